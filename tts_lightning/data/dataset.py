"""Prepared clips as talker sequences, and the collate function that batches them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.data import Dataset

from tts_lightning.data.codec_cache import load_codes
from tts_lightning.model.sequence import (
    SpecialIds,
    TalkerBatch,
    TalkerSequence,
    build_custom_voice_sequence,
    build_sequence,
    collate,
)


@dataclass(frozen=True)
class PreparedItem:
    """One clip ready for training: tokenised text, its codes (or the file holding them), speaker."""

    text_ids: tuple[int, ...]  # the tokenised chat template (`tokenize_text`)
    codes: Tensor | Path  # (T, G) codes, or a cached .npy file read on access
    frames: int  # T
    speaker_index: int  # row of the speaker table
    language: str = "auto"
    key: str = ""  # a stable name for the clip (its audio path), for logs
    instruct_ids: tuple[int, ...] = ()  # the tokenised instruct (custom_voice models), none when empty


class ClipExample(NamedTuple):
    sequence: TalkerSequence
    speaker_index: int


class SpeakerClipsDataset(Dataset):
    """Map-style dataset: item i is the `TalkerSequence` of clip i (prefill + one position per
    frame) and its speaker index. Codes stored as files are read on access, so worker processes
    do not copy a whole corpus of codes."""

    def __init__(
        self,
        items: Sequence[PreparedItem],
        ids: SpecialIds,
        *,
        with_speaker: bool = True,
        speaker_codec_ids: Sequence[int] | None = None,
    ) -> None:
        self.items = list(items)
        self.ids = ids
        self.with_speaker = with_speaker
        # From a custom_voice model: speaker index -> the codec id of its row (the custom_voice layout).
        self.speaker_codec_ids = None if speaker_codec_ids is None else list(speaker_codec_ids)
        # Prefill lengths depend only on the text and language; computed once for the sampler.
        self._prefill = [self._sequence(it, None).text_ids.shape[0] for it in self.items]

    def _sequence(self, item: PreparedItem, codes: Tensor | None) -> TalkerSequence:
        if self.speaker_codec_ids is None:
            return build_sequence(
                self.ids, list(item.text_ids), codes, language=item.language, with_speaker=self.with_speaker
            )
        return build_custom_voice_sequence(
            self.ids,
            list(item.text_ids),
            codes,
            speaker_id=self.speaker_codec_ids[item.speaker_index],
            instruct_ids=item.instruct_ids,
            language=item.language,
        )

    def __len__(self) -> int:
        return len(self.items)

    def prefill_length(self, index: int) -> int:
        return self._prefill[index]

    def lengths(self) -> list[int]:
        """Talker positions of each example (prefill + frames): what a padded batch holds per row."""
        return [p + it.frames for p, it in zip(self._prefill, self.items)]

    def codes(self, index: int) -> Tensor:
        c = self.items[index].codes
        return load_codes(c) if isinstance(c, (str, os.PathLike)) else torch.as_tensor(c, dtype=torch.long)

    def __getitem__(self, index: int) -> ClipExample:
        item = self.items[index]
        codes = self.codes(index)
        if codes.shape[0] != item.frames:
            raise RuntimeError(
                f"codes of {item.key or index} have {codes.shape[0]} frames, the prepared index says "
                f"{item.frames}; the cache changed after prepare, run prepare again"
            )
        return ClipExample(self._sequence(item, codes), item.speaker_index)


class TalkerCollate:
    """Collate `ClipExample`s into a `TalkerBatch`, looking the speaker embeddings up by index.
    A class (not a closure) so DataLoader workers can pickle it."""

    def __init__(self, speaker_embeddings: Tensor, pad_text_id: int) -> None:
        self.speaker_embeddings = speaker_embeddings.detach().float().cpu()
        self.pad_text_id = int(pad_text_id)

    def __call__(self, examples: Sequence[ClipExample]) -> TalkerBatch:
        indices = torch.tensor([e.speaker_index for e in examples], dtype=torch.long)
        return collate(
            [e.sequence for e in examples],
            self.speaker_embeddings[indices],
            indices,
            pad_text_id=self.pad_text_id,
        )
