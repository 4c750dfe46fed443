"""A save that dies half-way leaves the previous checkpoint where `--ckpt_path last` finds it."""

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from tts_lightning.distributed.fsdp import Qwen3TTSFSDPStrategy


class DiesHalfWay(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
        raise OSError("disk full")


def strategy(io):
    s = Qwen3TTSFSDPStrategy(state_dict_type="full", checkpoint_io=io)
    s.parallel_devices = [torch.device("cpu")]
    return s


def test_interrupted_save_keeps_previous(tmp_path):
    last = tmp_path / "last.ckpt"
    strategy(TorchCheckpointIO()).save_checkpoint({"global_step": 1, "state_dict": {}}, last)
    assert torch.load(last, weights_only=False)["global_step"] == 1
    with pytest.raises(OSError, match="disk full"):
        strategy(DiesHalfWay()).save_checkpoint({"global_step": 2, "state_dict": {}}, last)
    assert torch.load(last, weights_only=False)["global_step"] == 1
    strategy(TorchCheckpointIO()).save_checkpoint({"global_step": 3, "state_dict": {}}, last)
    assert torch.load(last, weights_only=False)["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no partial or old left
