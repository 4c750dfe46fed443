"""`tts-lightning evaluate`: the fine-tuned voice against the base model's zero-shot cloning."""

from tts_lightning.evaluation.evaluate import DEFAULT_TEXTS, EvaluationError, evaluate

__all__ = ["DEFAULT_TEXTS", "EvaluationError", "evaluate"]
