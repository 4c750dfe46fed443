"""Lightning callbacks: audio samples, spectrograms and speaker similarity during training; the
codebook accuracies in one chart; the checkpoint callback of `tts-lightning fit`."""

from tts_lightning.callbacks.codebook_chart import CodebookAccuracyChart
from tts_lightning.callbacks.last_step_checkpoint import LastStepCheckpoint
from tts_lightning.callbacks.samples import SpeakerSamplesCallback

__all__ = ["CodebookAccuracyChart", "LastStepCheckpoint", "SpeakerSamplesCallback"]
