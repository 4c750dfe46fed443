"""Lightning callbacks: audio samples, spectrograms and speaker similarity during training."""

from tts_lightning.callbacks.samples import SpeakerSamplesCallback

__all__ = ["SpeakerSamplesCallback"]
