"""torchmetrics `Metric` classes for judging synthesised speech."""

from tts_lightning.metrics.speaker_similarity import (
    SpeakerSimilarity,
    embed_utterances,
    reference_embedding,
    similarity_unavailable,
)

__all__ = ["SpeakerSimilarity", "embed_utterances", "reference_embedding", "similarity_unavailable"]
