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
from tts_lightning.model.layouts import Reference, SequenceLayout, build_layout_sequence, check_custom_voice_layout
from tts_lightning.model.sequence import (
    SpecialIds,
    TalkerBatch,
    TalkerSequence,
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
    reference: Reference | None = None  # the ICL layout's reference clip
    instruct_ids: tuple[int, ...] = ()  # the tokenised instruct (custom_voice models), none when empty
    layout: SequenceLayout | None = None  # its own layout, not the run's (replay records: the one they were spoken in)


def _codes(c: Tensor | Path) -> Tensor:
    return load_codes(c) if isinstance(c, (str, os.PathLike)) else torch.as_tensor(c, dtype=torch.long)


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
        layout: SequenceLayout | None = None,
        speaker_codec_ids: Sequence[int] | None = None,
    ) -> None:
        self.items = list(items)
        self.ids = ids
        self.with_speaker = with_speaker
        self.layout = layout if layout is not None and not layout.is_default else None
        if self.layout is not None and not with_speaker:
            raise ValueError(f"layout {self.layout} always has a speaker slot (with_speaker=False is the default's)")
        # From a custom_voice model: speaker index -> the codec id of its row (the custom_voice layout,
        # streaming or not, never with a reference: `layouts.check_custom_voice_layout`).
        self.speaker_codec_ids = None if speaker_codec_ids is None else list(speaker_codec_ids)
        if self.speaker_codec_ids is not None and self.layout is not None:
            check_custom_voice_layout(self.layout, "this data set")
        # Prefill lengths depend only on the text, language (and reference length); computed once for the sampler.
        self._prefill = [self._build(it, None, None).text_ids.shape[0] for it in self.items]

    def _layout(self, item: PreparedItem) -> SequenceLayout | None:
        """The item's layout: its own, else the data set's; None for the default."""
        layout = self.layout if item.layout is None else item.layout
        return None if layout is None or layout.is_default else layout

    def _build(self, item: PreparedItem, codes: Tensor | None, ref_codes: Tensor | None) -> TalkerSequence:
        """The item's sequence; ``ref_codes`` None stands for zeros of the reference's length."""
        layout = self._layout(item)
        if self.speaker_codec_ids is not None:  # the custom_voice layout of the same
            return build_layout_sequence(
                self.ids,
                list(item.text_ids),
                codes,
                layout=layout or SequenceLayout(),
                language=item.language,
                speaker_id=self.speaker_codec_ids[item.speaker_index],
                instruct_ids=item.instruct_ids,
            )
        if layout is None:
            return build_sequence(
                self.ids, list(item.text_ids), codes, language=item.language, with_speaker=self.with_speaker
            )
        reference = None
        if layout.needs_reference:
            if item.reference is None:
                raise ValueError(f"{item.key or 'an item'} has no reference clip, which the icl layout needs")
            if ref_codes is None:
                ref_codes = torch.zeros(item.reference.frames, self.ids.num_code_groups, dtype=torch.long)
            reference = (list(item.reference.text_ids), ref_codes)
        return build_layout_sequence(
            self.ids, list(item.text_ids), codes, layout=layout, language=item.language, reference=reference
        )

    def __len__(self) -> int:
        return len(self.items)

    def lengths(self) -> list[int]:
        """Talker positions of each example (prefill + frames): what a padded batch holds per row."""
        return [p + it.frames for p, it in zip(self._prefill, self.items)]

    def codes(self, index: int) -> Tensor:
        return _codes(self.items[index].codes)

    def __getitem__(self, index: int) -> ClipExample:
        item = self.items[index]
        codes = self.codes(index)
        if codes.shape[0] != item.frames:
            raise RuntimeError(
                f"codes of {item.key or index} have {codes.shape[0]} frames, the prepared index says "
                f"{item.frames}; the cache changed after prepare, run prepare again"
            )
        ref_codes = None
        layout = self._layout(item)
        if layout is not None and layout.needs_reference and item.reference is not None:
            ref_codes = _codes(item.reference.codes)
            if ref_codes.shape[0] != item.reference.frames:
                raise RuntimeError(
                    f"codes of {item.reference.key} (the reference of {item.key or index}) changed after prepare; "
                    "run prepare again"
                )
        return ClipExample(self._build(item, codes, ref_codes), item.speaker_index)


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
