"""Log-mel spectrograms of speech: the values in dB (with the mel bands' frequencies, for the
figures' axes) and the TensorBoard image of them."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from tts_lightning.model.generation import SAMPLE_RATE

N_FFT, HOP, N_MELS = 1024, 256, 80
TOP_DB = 80.0  # the dynamic range shown: quieter bins are clipped to the peak minus this


def mel_db(audio: np.ndarray, sample_rate: int = SAMPLE_RATE) -> tuple[np.ndarray, np.ndarray]:
    """(log-mel in dB, `TOP_DB` below the peak at most, shape (n_mels, frames); the mel bands'
    centre frequencies in Hz)."""
    import torchaudio

    wave = torch.as_tensor(audio, dtype=torch.float32).reshape(-1)
    if wave.numel() < N_FFT:
        wave = torch.nn.functional.pad(wave, (0, N_FFT - wave.numel()))
    transform = torchaudio.transforms.MelSpectrogram(
        sample_rate=sample_rate, n_fft=N_FFT, hop_length=HOP, n_mels=N_MELS, f_max=sample_rate / 2
    )
    db = 10.0 * torch.log10(transform(wave).clamp(min=1e-10))
    db = db.clamp(min=float(db.max()) - TOP_DB)
    # The bands' centres: n_mels + 2 points evenly spaced in mel, the ends dropped (torchaudio's HTK scale).
    mels = np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), N_MELS + 2)[1:-1]
    return db.numpy(), _mel_to_hz(mels)


def _hz_to_mel(hz: float | np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + np.asarray(hz) / 700.0)  # the HTK scale torchaudio uses by default


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_image(audio: np.ndarray) -> Tensor:
    """The log-mel spectrogram (`mel_db`) as a CHW float RGB image through matplotlib's magma
    colormap, low frequencies at the bottom."""
    from matplotlib import colormaps

    db, _ = mel_db(audio)
    image = np.flipud((db - db.max() + TOP_DB) / TOP_DB)  # in [0, 1]: mel_db clips at TOP_DB below the peak
    rgb = colormaps["magma"](image)[..., :3]  # (H, W, 3)
    return torch.from_numpy(np.ascontiguousarray(rgb, dtype=np.float32)).permute(2, 0, 1)
