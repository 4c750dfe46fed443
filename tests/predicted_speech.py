"""What `tts-lightning predict` writes, checked against the checkpoint it read: with greedy decoding
(a copy of the pretrained directory whose ``generation_config.json`` turns sampling off) the audio
is a function of the weights and the speaker's row alone, so every file written by the ranks must
be what one plain process speaks with the same checkpoint (`Qwen3TTSModule.predict_step`, itself
checked against the official generation), and not what the model spoke before training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from tts_lightning import Qwen3TTSModule

PCM_16_STEP = 1 / 32767  # PredictionWriter writes 16-bit WAV


def greedy_copy(pretrained: Path, dest: Path) -> Path:
    """``pretrained`` with greedy generation (talker and code predictor), once per ``dest``."""
    if not dest.exists():
        shutil.copytree(pretrained, dest)
        config_path = dest / "generation_config.json"
        config = json.loads(config_path.read_text())
        config.update(do_sample=False, subtalker_dosample=False)
        config_path.write_text(json.dumps(config, indent=2))
    return dest


def assert_written_by_the_checkpoint(
    out: Path, ckpt: Path, greedy: Path, texts: list[str], speakers: list[str], language: str = "english"
):
    """Each ``<i>_<speaker>.wav`` in ``out`` is what the checkpoint speaks, to 16-bit rounding, in
    ``language`` (predict's choice for a speaker: its clips' language; the demo clips' is English); for
    a model whose speakers are not codec rows, at least one file differs from the untrained model's
    speech with the same speaker rows (the weights were read, not only the speaker table)."""
    trained = Qwen3TTSModule.load_from_checkpoint(ckpt, map_location="cpu", pretrained=str(greedy)).eval()
    untrained = None
    if trained.speaker_codec_ids is None:
        untrained = Qwen3TTSModule(str(greedy), speakers=trained.speakers).eval()
        untrained.configure_model()
        untrained.speaker_embeddings.copy_(trained.speaker_embeddings)
    differs = 0
    for i, text in enumerate(texts):
        for speaker in speakers:
            written, rate = sf.read(out / f"{i:04d}_{speaker}.wav", dtype="float32")
            batch = {"text": [text], "speaker": [speaker], "language": [language]}
            with torch.no_grad():
                (row,) = trained.predict_step(batch, 0)
            expected = np.clip(row["audio"], -1, 1)
            assert rate == row["sample_rate"] and written.shape == expected.shape, (text, speaker)
            assert np.abs(written - expected).max() <= PCM_16_STEP, (text, speaker)
            if untrained is not None:
                with torch.no_grad():
                    (before,) = untrained.predict_step(batch, 0)
                differs += int(before["audio"].shape != expected.shape or not np.allclose(before["audio"], expected))
    assert untrained is None or differs, "predict spoke as the untrained model does"
