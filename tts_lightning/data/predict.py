"""Prediction data: texts to speak with the run's speakers, and a writer for the audio.

`TextsDataset` pairs every text with every requested speaker (in the run's layout, with each
speaker's reference for ``icl``); `collate_texts` makes the batch
`Qwen3TTSModule.predict_step` reads: a `PredictBatch`, defined beside the generation code it feeds
(`tts_lightning.model.generation`: nothing in ``model/`` imports ``data/``). `PredictionWriter`
writes each prediction as ``<output_dir>/<id>_<speaker>.wav`` (24 kHz, 16-bit) with the text beside it in a ``.txt``.

Under FSDP every rank must run the same number of generation steps in lockstep, so the dataset
shards itself: each rank gets the same number of items, the last ones padded with repeats that are
marked ``padding`` and not written.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import Dataset

from tts_lightning.files import atomic_write, atomic_write_wav
from tts_lightning.model.generation import PredictBatch
from tts_lightning.model.layouts import SequenceLayout, VoiceReference
from tts_lightning.model.synthesis import read_text_file

__all__ = [
    "PredictBatch",
    "PredictionWriter",
    "TextsDataset",
    "collate_texts",
    "read_texts",
    "speaker_languages",
]


def read_texts(texts: Sequence[str] | None = None, texts_file: str | os.PathLike | None = None) -> list[str]:
    """Inline texts, then the non-empty lines of ``texts_file``; raise if there are none."""
    out = [t.strip() for t in (texts or []) if t and t.strip()]
    if texts_file is not None:
        path = Path(texts_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"predict texts file {path} not found")
        out += read_text_file(path, "data.predict_texts_file")  # names an unreadable or non-UTF-8 file
    if not out:
        raise ValueError("nothing to predict: give predict_texts and/or predict_texts_file (one text per line)")
    return out


def speaker_languages(index: Mapping[str, Any]) -> dict[str, str]:
    """Each speaker's most common language among its prepared clips (``prepared.json``)."""
    counts: dict[str, Counter] = {}
    for clip in index.get("clips", []):
        counts.setdefault(clip["speaker"], Counter())[clip.get("language") or "auto"] += 1
    return {speaker: c.most_common(1)[0][0] for speaker, c in counts.items()}


class TextsDataset(Dataset):
    """Every text spoken by every speaker: items ``{"text", "speaker", "language", "id", "padding"}``.

    Args:
        texts: what to say.
        speakers: who says it (each text once per speaker).
        languages: one language for all, or per speaker (missing speakers: "auto").
        ids: one id per text (default its zero-padded position); file names are ``<id>_<speaker>``.
        num_replicas, rank: shard for distributed prediction; every rank gets ``ceil(n / replicas)``
            items, padded with repeats marked ``padding=True``.
        layout, references: the run's layout and, for ``icl``, each speaker's reference
            (`tts_lightning.data.references.generation_layout`); items then carry them.
    """

    def __init__(
        self,
        texts: Sequence[str],
        speakers: Sequence[str],
        *,
        languages: str | Mapping[str, str] | None = None,
        ids: Sequence[str] | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        layout: SequenceLayout | None = None,
        references: Mapping[str, VoiceReference] | None = None,
    ) -> None:
        texts, speakers = list(texts), list(speakers)
        if not texts or not speakers:
            raise ValueError(f"need at least one text and one speaker (got {len(texts)} texts, speakers {speakers})")
        if ids is not None and len(ids) != len(texts):
            raise ValueError(f"{len(ids)} ids for {len(texts)} texts")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside 0..{num_replicas - 1}")
        width = max(4, len(str(len(texts) - 1)))
        ids = [str(i) for i in ids] if ids is not None else [f"{i:0{width}d}" for i in range(len(texts))]

        def language(speaker: str) -> str:
            if isinstance(languages, Mapping):
                return languages.get(speaker) or "auto"
            return languages or "auto"

        items = [
            {"text": text, "speaker": speaker, "language": language(speaker), "id": id_, "padding": False}
            for text, id_ in zip(texts, ids)
            for speaker in speakers
        ]
        for item in items if layout is not None else []:
            item["layout"] = layout
            if references:
                item["reference"] = references[str(item["speaker"])]
        per_rank = math.ceil(len(items) / num_replicas)
        self.items = [
            dict(items[i % len(items)], padding=i >= len(items))
            for i in range(rank, per_rank * num_replicas, num_replicas)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self.items[index])


def collate_texts(items: Sequence[Mapping[str, Any]]) -> PredictBatch:
    """The predict batch of `TextsDataset` items (``text`` and ``speaker``; ``language``, ``id`` and
    ``padding`` where every item has them)."""

    def column(key: str) -> list[Any] | None:
        return [item[key] for item in items] if all(key in item for item in items) else None

    batch = PredictBatch.build(
        [item["text"] for item in items],
        [item["speaker"] for item in items],
        languages=column("language"),
        ids=column("id"),
        padding=column("padding"),
    )
    if items and "layout" in items[0]:  # the run's layout (one per run), references for icl
        layout = items[0]["layout"]
        batch.layout, batch.streaming, batch.references = layout.layout, layout.streaming, column("reference")
    return batch


_UNSAFE = re.compile(r"[^\w.\-]+")


def _safe(name: str) -> str:
    return _UNSAFE.sub("_", str(name)).strip("._") or "_"


class PredictionWriter(BasePredictionWriter):
    """Write each prediction of `Qwen3TTSModule.predict_step` as ``<output_dir>/<id>_<speaker>.wav``
    (16-bit PCM at the prediction's sample rate, 24 kHz) and its text as ``.txt`` beside it.

    Add it from the command line:
    ``--trainer.callbacks+=tts_lightning.data.predict.PredictionWriter --trainer.callbacks.output_dir DIR``.
    """

    def __init__(self, output_dir: str = "predictions") -> None:
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)

    def path_for(self, prediction: Mapping[str, Any]) -> Path:
        return self.output_dir / f"{_safe(prediction['id'])}_{_safe(prediction['speaker'])}.wav"

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        for item in prediction or []:
            if not item.get("padding"):
                self.write_item(item)

    def write_item(self, item: Mapping[str, Any]) -> None:
        """One prediction's ``.wav`` and ``.txt``, each written beside its place and renamed: a
        full disk raises `WriteError` and leaves no partial file."""
        path = self.path_for(item)
        audio = np.clip(np.asarray(item["audio"], dtype=np.float32), -1.0, 1.0)
        atomic_write_wav(path, audio, int(item["sample_rate"]), subtype="PCM_16")
        text = item["text"] + "\n"
        atomic_write(path.with_suffix(".txt"), lambda fh: fh.write(text), binary=False)
