"""Log-mel spectrogram images of generated speech for TensorBoard."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from tts_lightning.model.generation import SAMPLE_RATE


def mel_image(audio: np.ndarray, sample_rate: int = SAMPLE_RATE, n_mels: int = 80, top_db: float = 80.0) -> Tensor:
    """A log-mel spectrogram as a CHW float image in [0, 1], low frequencies at the bottom: RGB
    through matplotlib's magma colormap when matplotlib is installed, else one grey channel."""
    import torchaudio

    wave = torch.as_tensor(audio, dtype=torch.float32).reshape(-1)
    n_fft = 1024
    if wave.numel() < n_fft:
        wave = torch.nn.functional.pad(wave, (0, n_fft - wave.numel()))
    mel = torchaudio.transforms.MelSpectrogram(
        sample_rate=sample_rate, n_fft=n_fft, hop_length=256, n_mels=n_mels, f_max=sample_rate / 2
    )(wave)
    db = 10.0 * torch.log10(mel.clamp(min=1e-10))
    image = ((db - db.max() + top_db) / top_db).clamp(0.0, 1.0).flip(0)  # (n_mels, frames)
    try:
        from matplotlib import colormaps
    except ImportError:
        return image[None]
    rgb = colormaps["magma"](image.numpy())[..., :3]  # (H, W, 3)
    return torch.from_numpy(np.ascontiguousarray(rgb, dtype=np.float32)).permute(2, 0, 1)
