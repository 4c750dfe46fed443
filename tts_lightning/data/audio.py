"""Read audio files and bring them to the model's format: mono float32 at 24 kHz.

Files are decoded with soundfile (torchaudio >= 2.9 delegates file I/O to torchcodec, which we
do not depend on); torchaudio is used only for resampling.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
import torchaudio.functional as AF

TARGET_SAMPLE_RATE = 24_000
PEAK_TARGET = 0.95
RMS_TARGET_DBFS = -20.0
# Ceiling applied after RMS normalisation so a loud-peaked quiet clip is not clipped.
RMS_PEAK_CEILING = 0.999

# Formats whose header states an exact frame count we can compare against what was decoded.
_EXACT_LENGTH_FORMATS = frozenset({"WAV", "WAVEX", "RF64", "W64", "AIFF", "FLAC"})


class AudioReadError(ValueError):
    """An audio file exists but cannot be decoded (corrupt, truncated, empty, not audio)."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"cannot read audio file {self.path}: {reason}")


@dataclass(frozen=True)
class AudioInfo:
    sample_rate: int
    frames: int
    channels: int
    format: str

    @property
    def duration(self) -> float:
        return self.frames / self.sample_rate


def _read_bytes(path: Path, data: bytes | None) -> bytes:
    if data is None:
        data = path.read_bytes()  # FileNotFoundError names the path itself
    if not data:
        raise AudioReadError(path, "file is empty (0 bytes)")
    return data


def _check_wav_data_chunk(path: Path, data: bytes) -> None:
    """Raise if a RIFF/WAVE file's data chunk declares more bytes than the file holds.

    libsndfile silently shortens such files, so a half-copied wav would otherwise pass as a
    shorter clip whose transcript no longer matches the audio.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    offset = 12
    while offset + 8 <= len(data):
        chunk_id = data[offset : offset + 4]
        (size,) = struct.unpack("<I", data[offset + 4 : offset + 8])
        if chunk_id == b"data":
            # 0 and 0xFFFFFFFF are "unknown size" markers written by streaming encoders.
            if size in (0, 0xFFFFFFFF):
                return
            available = len(data) - (offset + 8)
            if available < size:
                raise AudioReadError(
                    path, f"truncated WAV: header declares {size} data bytes but only {available} are present"
                )
            return
        offset += 8 + size + (size & 1)


def probe_audio(path: str | Path, *, data: bytes | None = None) -> AudioInfo:
    """Read the header only (rate, frames, channels); raises AudioReadError for corrupt files.

    `data` is the file's bytes when the caller already has them (avoids a second disk read).
    """
    path = Path(path)
    data = _read_bytes(path, data)
    _check_wav_data_chunk(path, data)
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.SoundFileError, RuntimeError) as exc:
        raise AudioReadError(path, _clean_sf_message(exc)) from exc
    if info.frames <= 0:
        raise AudioReadError(path, "file contains no audio samples")
    if info.samplerate <= 0 or info.channels <= 0:
        raise AudioReadError(path, f"invalid header (rate={info.samplerate}, channels={info.channels})")
    return AudioInfo(int(info.samplerate), int(info.frames), int(info.channels), str(info.format))


def read_audio(path: str | Path, *, data: bytes | None = None) -> tuple[torch.Tensor, int]:
    """Decode a file at its own rate: float32 tensor (channels, samples) and the sample rate.

    Raises AudioReadError naming the file for empty, corrupt, truncated or non-audio files.
    """
    path = Path(path)
    data = _read_bytes(path, data)
    _check_wav_data_chunk(path, data)
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            declared = f.frames
            fmt = f.format
            samples = f.read(dtype="float32", always_2d=True)
            rate = f.samplerate
    except (sf.SoundFileError, RuntimeError) as exc:
        raise AudioReadError(path, _clean_sf_message(exc)) from exc
    if samples.shape[0] == 0:
        raise AudioReadError(path, "file contains no audio samples")
    if fmt in _EXACT_LENGTH_FORMATS and samples.shape[0] < declared:
        raise AudioReadError(path, f"truncated: header declares {declared} frames but only {samples.shape[0]} decoded")
    if not np.isfinite(samples).all():
        raise AudioReadError(path, "decoded samples contain NaN or infinity")
    return torch.from_numpy(np.ascontiguousarray(samples.T)), int(rate)


def _clean_sf_message(exc: Exception) -> str:
    # soundfile mentions "<_io.BytesIO object at 0x..>" because we decode from memory; keep the useful part.
    msg = str(exc)
    if ":" in msg and "BytesIO" in msg:
        msg = msg.split(":", 1)[1].strip()
    return msg or type(exc).__name__


def resample(wave: torch.Tensor, orig_sr: int, new_sr: int) -> torch.Tensor:
    """Resample along the last axis to exactly round(n * new_sr / orig_sr) samples."""
    if orig_sr == new_sr:
        return wave
    n = wave.shape[-1]
    out = AF.resample(wave, int(orig_sr), int(new_sr))
    # torchaudio rounds the length up; pin it to the nearest-integer length callers expect.
    want = int(round(n * new_sr / orig_sr))
    if out.shape[-1] > want:
        out = out[..., :want]
    elif out.shape[-1] < want:
        out = torch.nn.functional.pad(out, (0, want - out.shape[-1]))
    return out


def peak_normalize(wave: torch.Tensor, peak: float = PEAK_TARGET) -> torch.Tensor:
    current = wave.abs().max()
    if current <= 0:
        return wave  # silence stays silence
    return wave * (peak / current)


def rms_normalize(wave: torch.Tensor, target_dbfs: float = RMS_TARGET_DBFS) -> torch.Tensor:
    rms = wave.pow(2).mean().sqrt()
    if rms <= 0:
        return wave
    gain = (10.0 ** (target_dbfs / 20.0)) / rms
    peak = wave.abs().max()
    # Lower the gain rather than hard-clip: clipping adds distortion the model would learn.
    gain = torch.minimum(gain, RMS_PEAK_CEILING / peak)
    return wave * gain


def trim_edge_silence(
    wave: torch.Tensor, sample_rate: int, top_db: float = 40.0, frame_ms: float = 10.0
) -> torch.Tensor:
    """Cut leading/trailing frames whose RMS is more than `top_db` below the loudest frame.

    Only the edges are trimmed; pauses inside the clip are kept.
    """
    frame = max(1, int(sample_rate * frame_ms / 1000))
    n = wave.shape[-1]
    n_frames = math.ceil(n / frame)
    padded = torch.nn.functional.pad(wave, (0, n_frames * frame - n))
    rms = padded.view(n_frames, frame).pow(2).mean(dim=1).sqrt()
    loudest = rms.max()
    if loudest <= 0:
        return wave
    keep = torch.nonzero(rms >= loudest * (10.0 ** (-top_db / 20.0))).flatten()
    start = int(keep[0]) * frame
    end = min(n, (int(keep[-1]) + 1) * frame)
    return wave[start:end]


def load_audio(
    path: str | Path,
    sample_rate: int = TARGET_SAMPLE_RATE,
    *,
    normalize: str | None = None,
    trim_silence: bool = False,
    trim_top_db: float = 40.0,
    data: bytes | None = None,
) -> torch.Tensor:
    """Read a file as a mono float32 1-D tensor at `sample_rate`.

    normalize: None, "peak" (to 0.95 peak) or "rms" (to -20 dBFS, gain capped below full scale).
    trim_silence: cut edge frames quieter than `trim_top_db` below the loudest frame.
    data: the file's bytes, when already read.
    """
    if normalize not in (None, "peak", "rms"):
        raise ValueError(f"normalize must be None, 'peak' or 'rms', got {normalize!r}")
    wave, sr = read_audio(path, data=data)
    mono = resample(wave.mean(dim=0), sr, sample_rate)
    if trim_silence:
        mono = trim_edge_silence(mono, sample_rate, top_db=trim_top_db)
    if normalize == "peak":
        mono = peak_normalize(mono)
    elif normalize == "rms":
        mono = rms_normalize(mono)
    return mono.contiguous()
