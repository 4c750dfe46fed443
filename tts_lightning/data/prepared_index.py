"""``prepared.json``, typed: the settings the data were prepared with, the speakers and every clip.

`PreparedIndex.to_json` writes the very same JSON (``PREPARED_VERSION`` 1) as before it was typed;
`read_index_json` refuses a file of another version or prepared with other settings.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from tts_lightning.data.codec_cache import CodecCache, check_codes_header
from tts_lightning.data.selection import Plan
from tts_lightning.data.speakers import SpeakerReference, SpeakerTable
from tts_lightning.data.validation import AcceptedClip

PREPARED_VERSION = 1


@dataclass
class PreparedSpeaker:
    """A speaker of the run: its row key in the speaker table and the clips its embedding averages."""

    name: str
    key: str
    references: list[str]


@dataclass
class PreparedClip:
    """One clip to train or validate on; ``codes`` is relative to the cache folder."""

    audio: str
    source: str
    content_hash: str
    text: str
    speaker: str
    language: str
    duration: float
    frames: int
    codes: str
    split: Literal["train", "val"]
    instruct: str = ""  # written only when set: an index without instructs keeps its bytes


@dataclass
class PreparedIndex:
    """``prepared.json``: the settings it was prepared with, the speakers and every clip. The field
    names and order are the file's keys (`to_json` / `from_json`)."""

    version: int
    settings: dict[str, Any]
    tokenizer_id: str
    speaker_table: str  # relative to the cache folder
    speakers: list[PreparedSpeaker] = field(default_factory=list)
    clips: list[PreparedClip] = field(default_factory=list)

    @property
    def speaker_names(self) -> list[str]:
        return [s.name for s in self.speakers]

    def split(self, name: Literal["train", "val"]) -> list[PreparedClip]:
        return [c for c in self.clips if c.split == name]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for clip in data["clips"]:
            if not clip["instruct"]:
                del clip["instruct"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PreparedIndex:
        return cls(
            version=int(data["version"]),
            settings=dict(data.get("settings", {})),
            tokenizer_id=str(data["tokenizer_id"]),
            speaker_table=str(data["speaker_table"]),
            speakers=[
                PreparedSpeaker(str(s["name"]), str(s["key"]), [str(r) for r in s["references"]])
                for s in data["speakers"]
            ],
            clips=[
                PreparedClip(
                    audio=str(c["audio"]),
                    source=str(c["source"]),
                    content_hash=str(c["content_hash"]),
                    text=str(c["text"]),
                    speaker=str(c["speaker"]),
                    language=str(c["language"]),
                    duration=float(c["duration"]),
                    frames=int(c["frames"]),
                    codes=str(c["codes"]),
                    split="val" if c["split"] == "val" else "train",
                    instruct=str(c.get("instruct") or ""),
                )
                for c in data["clips"]
            ],
        )


def _prepared_clip(c: AcceptedClip, plan: Plan, cache: CodecCache) -> PreparedClip:
    """The index entry of a planned clip whose codes are cached (the file's header is checked as
    its length is read: `CacheEntryError` names a bad one)."""
    codes_rel = cache.relative_path(c)
    return PreparedClip(
        audio=str(c.record.audio),
        source=c.record.source,
        content_hash=c.content_hash,
        text=c.record.text,
        speaker=c.record.speaker,
        language=plan.languages[c.content_hash],
        duration=round(c.duration, 4),
        frames=check_codes_header(cache.cache_dir / codes_rel, cache.num_code_groups)[0],
        codes=codes_rel,
        split="val" if c.content_hash in plan.val_hashes else "train",
        instruct=c.record.instruct,
    )


def build_index(
    plan: Plan,
    cache: CodecCache,
    table: SpeakerTable,
    references: dict[str, list[SpeakerReference]],
    settings: dict[str, Any],
) -> PreparedIndex:
    """The index of ``plan``: its clips (codes all cached in ``cache``), the speaker ``table``
    (saved in the cache folder) and the ``references`` its embeddings average."""
    clips = [_prepared_clip(c, plan, cache) for c in plan.clips]
    assert table.path is not None  # compute_speaker_table saves the table
    return PreparedIndex(
        version=PREPARED_VERSION,
        settings=settings,
        tokenizer_id=cache.tokenizer_id,
        speaker_table=table.path.relative_to(cache.cache_dir).as_posix(),
        speakers=[PreparedSpeaker(n, k, [str(r.path) for r in references[n]]) for n, k in zip(table.names, table.keys)],
        clips=clips,
    )


def read_index_json(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """prepared.json at ``path`` as JSON, checked: its version, and that it was prepared with
    ``settings`` (`PrepareSettings.index_settings`)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run prepare_data() (or `tts-lightning prepare`) before setup()")
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("version") != PREPARED_VERSION:
        raise RuntimeError(
            f"{path} has format version {index.get('version')}, expected {PREPARED_VERSION}; run prepare again"
        )
    theirs = index.get("settings", {})
    diff = [f"{k}: {theirs.get(k)!r} there, {v!r} here" for k, v in settings.items() if theirs.get(k) != v]
    if diff:
        raise RuntimeError(f"{path} was prepared with other settings ({'; '.join(diff)}); run prepare again")
    return index
