"""Judging synthesised speech: speaker similarity (a torchmetrics `Metric`), speaking rate and
end-of-speech failures."""

from tts_lightning.metrics.speaker_similarity import (
    SpeakerSimilarity,
    embed_utterances,
    reference_embedding,
    similarity_unavailable,
)
from tts_lightning.metrics.speech import (
    frame_limit,
    hit_frame_limit,
    max_new_tokens_for,
    seconds_per_character,
    speaking_rate_ratio,
    speech_seconds,
    text_characters,
)

__all__ = [
    "SpeakerSimilarity",
    "embed_utterances",
    "frame_limit",
    "hit_frame_limit",
    "max_new_tokens_for",
    "reference_embedding",
    "seconds_per_character",
    "similarity_unavailable",
    "speaking_rate_ratio",
    "speech_seconds",
    "text_characters",
]
