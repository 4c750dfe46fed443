"""`SpeakerSamplesCallback` with a fault injected after the zero-shot baseline: decoding the samples
of every validation fails on rank 0 (as an out-of-memory error or a codec failure would)."""

from tts_lightning.callbacks import SpeakerSamplesCallback


class FailingSamples(SpeakerSamplesCallback):
    def _log_and_score(self, trainer, pl_module, generated, loggers, scoring, *, baseline=False):
        if not baseline:
            raise RuntimeError("injected decoding failure")
        return super()._log_and_score(trainer, pl_module, generated, loggers, scoring, baseline=baseline)
