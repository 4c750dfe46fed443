"""Lightning callbacks: audio samples, spectrograms and speaker similarity during training; the
codebook accuracies in one chart."""

from tts_lightning.callbacks.codebook_chart import CodebookAccuracyChart
from tts_lightning.callbacks.samples import SpeakerSamplesCallback

__all__ = ["CodebookAccuracyChart", "SpeakerSamplesCallback"]
