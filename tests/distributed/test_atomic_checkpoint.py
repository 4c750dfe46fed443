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


def test_full_disk_names_the_disk_and_removes_the_partial(tmp_path):
    """A real full disk (a 2 MiB tmpfs; the tests run as root, as CI does): the error says so and
    where, the previous checkpoint stays, no partial is left, and a save with room succeeds."""
    import subprocess

    from tts_lightning.distributed.fsdp import CheckpointWriteError

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True, capture_output=True)
    try:
        last = disk / "last.ckpt"
        small = {"global_step": 1, "state_dict": {"w": torch.zeros(1000)}}
        strategy(TorchCheckpointIO()).save_checkpoint(small, last)
        big = {"global_step": 2, "state_dict": {"w": torch.zeros(1_000_000)}}  # 4 MB
        with pytest.raises(CheckpointWriteError, match="the disk is full") as info:
            strategy(TorchCheckpointIO()).save_checkpoint(big, last)
        assert str(last) in str(info.value) and "GiB free" in str(info.value)
        assert torch.load(last, weights_only=True)["global_step"] == 1
        assert sorted(p.name for p in disk.iterdir()) == ["last.ckpt"]
        strategy(TorchCheckpointIO()).save_checkpoint({**small, "global_step": 3}, last)
        assert torch.load(last, weights_only=True)["global_step"] == 3
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, capture_output=True)
