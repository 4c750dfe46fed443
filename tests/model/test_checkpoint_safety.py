"""A checkpoint whose pickle would run code is refused before any of it runs."""

import os

import pytest
import torch

from tts_lightning.model.checkpoint import CheckpointError, CheckpointReader
from tts_lightning.model.export import export_custom_voice


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # what a malicious file does: run a command when unpickled
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def evil_checkpoint(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "shared.ckpt"
    torch.save({"state_dict": {"model.talker.x": torch.zeros(1)}, "hyper_parameters": {"x": Payload(marker)}}, path)
    return path, marker


def test_export_refuses_a_code_running_pickle(evil_checkpoint, tmp_path):
    path, marker = evil_checkpoint
    with pytest.raises(CheckpointError, match="--trust-checkpoint") as info:
        export_custom_voice(path, tmp_path / "voice")
    assert str(path) in str(info.value)
    with pytest.raises(CheckpointError, match="can run code"):
        CheckpointReader(path)
    assert not marker.exists() and not (tmp_path / "voice").exists()


def test_trusting_it_is_an_explicit_choice(evil_checkpoint):
    path, marker = evil_checkpoint
    CheckpointReader(path, trust=True)  # the user vouched for it: it is unpickled, code included
    assert marker.exists()
