"""The reference clip of every clip for the ICL layout: another training clip of the same speaker.

Chosen once per clip from a seeded generator keyed by the seed and the clip's audio content (its
hash, as the validation split is), so the choice is the same on every rank, every epoch and every
resume, wherever the data lives (a path would change it when the folder moves), and does not move
when other clips are added. Sampling and ``predict`` in the ICL layout speak each speaker with the reference of
its first training clip (`speaker_references`): one the run trained with. Only training clips serve
as references (a validation clip never enters a training prompt); their codes are those prepare already cached.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from tts_lightning.data.prepared_index import PreparedClip
from tts_lightning.errors import ConfigError
from tts_lightning.model.layouts import (
    Reference,
    SequenceLayout,
    VoiceReference,
    reference_prompt_ids,
    reference_text_ids,
)


class _AllBut(Sequence[int]):
    """``items`` without the one at position ``skip`` (None: all of them), not copied: a clip's pool of
    references is its speaker's training clips but itself, and copying it per clip was quadratic."""

    def __init__(self, items: list[int], skip: int | None) -> None:
        self.items, self.skip = items, skip

    def __len__(self) -> int:
        return len(self.items) - (self.skip is not None)

    def __getitem__(self, k):  # random.choice indexes with an int
        return self.items[k + (self.skip is not None and k >= self.skip)]


def choose_references(clips: list[PreparedClip], seed: int) -> list[int]:
    """For clip i, the index of its reference clip: a training clip of the same speaker, not i."""
    train: dict[str, list[int]] = defaultdict(list)
    position: dict[int, int] = {}  # a training clip's place in its speaker's list
    for i, c in enumerate(clips):
        if c.split == "train":
            position[i] = len(train[c.speaker])
            train[c.speaker].append(i)
    chosen: list[int] = []
    for i, c in enumerate(clips):
        pool = _AllBut(train[c.speaker], position.get(i))
        if not pool:
            raise ConfigError(
                f"data.layout 'icl': speaker {c.speaker!r} has no other training clip to serve as the "
                f"reference of {c.audio}; give it at least two training clips, or use data.layout xvector"
            )
        chosen.append(random.Random(f"{seed}:{c.content_hash}").choice(pool))
    return chosen


def references(clips: list[PreparedClip], cache_dir: Path, tokenizer, seed: int) -> list[Reference]:
    """The `Reference` of every clip (transcript ids, cached codes file), in the order of ``clips``."""
    chosen = choose_references(clips, seed)
    texts = reference_text_ids(tokenizer, [c.text for c in clips])
    return [Reference(texts[j], cache_dir / clips[j].codes, clips[j].frames, key=clips[j].audio) for j in chosen]


def speaker_references(
    clips: list[PreparedClip], cache_dir: Path, seed: int, speakers: list[str]
) -> dict[str, VoiceReference]:
    """Per speaker, what generation in the ICL layout clones from: the reference clip the data module
    chose for the speaker's first training clip (transcript, cached codes)."""
    from tts_lightning.data.codec_cache import load_codes

    chosen = choose_references(clips, seed)
    out: dict[str, VoiceReference] = {}
    for i, c in enumerate(clips):
        if c.split == "train" and c.speaker in speakers and c.speaker not in out:
            ref = clips[chosen[i]]
            out[c.speaker] = VoiceReference(ref.text, load_codes(cache_dir / ref.codes))
    missing = sorted(set(speakers) - set(out))
    if missing:
        raise ConfigError(f"data.layout 'icl': speaker(s) {missing} have no training clip to take a reference from")
    return out


def generation_layout(datamodule, speakers: list[str]) -> tuple[SequenceLayout, dict[str, VoiceReference]]:
    """The layout a run's data module trains (default x-vector non-streaming without one) and, for
    ``icl``, each speaker's `speaker_references`: what sampling and ``predict`` generate with."""
    layout = getattr(datamodule, "layout", None) or SequenceLayout()
    if not layout.needs_reference:
        return layout, {}
    return layout, speaker_references(datamodule.prepared_index.clips, datamodule.cache_dir, datamodule.seed, speakers)


def generation_prompts(datamodule, speakers: list[str], tokenizer) -> tuple[SequenceLayout, dict[str, tuple]]:
    """`generation_layout` with each reference as ``generate`` takes it: (the transcript's template
    ids, `reference_prompt_ids`; the codes)."""
    layout, refs = generation_layout(datamodule, speakers)
    return layout, {s: (reference_prompt_ids(tokenizer, r.text), r.codes) for s, r in refs.items()}
