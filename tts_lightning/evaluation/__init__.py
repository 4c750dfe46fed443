"""`tts-lightning evaluate`: the fine-tuned voice against the base model's zero-shot cloning."""

from tts_lightning.evaluation.evaluate import evaluate
from tts_lightning.evaluation.inputs import DEFAULT_TEXTS, EvaluationError

__all__ = ["DEFAULT_TEXTS", "EvaluationError", "evaluate"]
