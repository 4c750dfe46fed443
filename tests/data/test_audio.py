from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from tts_lightning.data.audio import (
    TARGET_SAMPLE_RATE,
    AudioReadError,
    load_audio,
    read_audio,
)


def _dominant_freq(wave: torch.Tensor, sr: int) -> float:
    spectrum = torch.fft.rfft(wave.double()).abs()
    return float(spectrum.argmax()) * sr / wave.numel()


@pytest.mark.parametrize(
    ("sr", "channels", "frames"),
    [(48_000, 2, 48_002), (16_000, 1, 16_002), (44_100, 1, 44_103), (24_000, 1, 24_007)],
)
def test_load_audio_gives_24k_mono_float32_of_expected_length(tmp_path: Path, write_tone, sr, channels, frames) -> None:
    path = write_tone(tmp_path / f"in_{sr}.wav", sr=sr, channels=channels, frames=frames, freq=300.0, amp=0.4)
    wave = load_audio(path)
    assert wave.dtype == torch.float32 and wave.dim() == 1
    assert wave.numel() == round(frames * TARGET_SAMPLE_RATE / sr)
    # Content survives: same pitch, and the stereo mix is the mean of the channels (0.4 and 0).
    assert abs(_dominant_freq(wave, TARGET_SAMPLE_RATE) - 300.0) < 2.0
    assert wave.abs().max().item() == pytest.approx(0.4 / channels, rel=0.03)


def test_read_audio_keeps_channels_and_rate(tmp_path: Path, write_tone) -> None:
    path = write_tone(tmp_path / "s.flac", sr=22_050, channels=2, frames=1000)
    wave, sr = read_audio(path)
    assert sr == 22_050 and wave.shape == (2, 1000) and wave.dtype == torch.float32


def test_reads_ogg(tmp_path: Path, write_tone) -> None:
    path = write_tone(tmp_path / "v.ogg", sr=48_000, seconds=0.5)
    wave = load_audio(path)
    assert abs(wave.numel() - 12_000) <= 1


def test_peak_and_rms_normalisation(tmp_path: Path, write_tone) -> None:
    path = write_tone(tmp_path / "quiet.wav", amp=0.05, seconds=1.0)
    assert load_audio(path, normalize="peak").abs().max().item() == pytest.approx(0.95, abs=1e-4)
    rms = load_audio(path, normalize="rms").pow(2).mean().sqrt().item()
    assert 20 * math.log10(rms) == pytest.approx(-20.0, abs=0.05)

    # One loud click in near-silence: reaching -20 dBFS would need gain past full scale, so it is capped.
    spiky = np.full(24_000, 0.001, dtype=np.float32)
    spiky[100] = 0.5
    sf.write(tmp_path / "spiky.wav", spiky, 24_000, subtype="FLOAT")
    out = load_audio(tmp_path / "spiky.wav", normalize="rms")
    assert out.abs().max().item() <= 1.0
    with pytest.raises(ValueError, match="normalize"):
        load_audio(path, normalize="loud")


def test_trim_silence_cuts_edges_only(tmp_path: Path, make_sine) -> None:
    sr = 24_000
    tone = make_sine(0.5, sr, amp=0.5)
    gap = np.zeros(sr // 2, dtype=np.float32)
    sf.write(tmp_path / "padded.wav", np.concatenate([gap, tone, gap, tone, gap]), sr)
    untrimmed = load_audio(tmp_path / "padded.wav")
    trimmed = load_audio(tmp_path / "padded.wav", trim_silence=True)
    assert untrimmed.numel() == int(2.5 * sr)
    # tone + inner gap + tone = 1.5 s stays, give or take one 10 ms frame per edge.
    assert abs(trimmed.numel() - int(1.5 * sr)) <= 2 * sr // 100
    assert trimmed[: sr // 100].abs().max() > 0.1


def test_bad_files_raise_audio_read_error_naming_the_file(tmp_path: Path, write_tone) -> None:
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    text = tmp_path / "notes.wav"
    text.write_text("this is a transcript, not audio\n" * 20)
    whole = write_tone(tmp_path / "whole.wav", seconds=1.0)
    truncated = tmp_path / "truncated.wav"
    data = whole.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    # libsndfile quietly returns the frames that are left, so the check must be ours.
    assert 0 < sf.info(truncated).frames < sf.info(whole).frames

    for path, expected in [(empty, "empty"), (text, "not recognised"), (truncated, "truncated")]:
        with pytest.raises(AudioReadError, match=path.name) as info:
            load_audio(path)
        assert expected in info.value.reason.lower()
        assert isinstance(info.value, ValueError)
