"""`PrepareSettings`: what preparing the data depends on, typed, and what of it prepared.json records."""

from __future__ import annotations

import codecs
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from tts_lightning.data.validation import ValidationConfig
from tts_lightning.errors import ConfigError
from tts_lightning.files import file_in_the_way


@dataclass(frozen=True)
class PrepareSettings:
    """What preparing the data depends on (the `SpeakerClipsDataModule` arguments of the same
    names; see its docstring)."""

    pretrained: str
    train_manifest: str
    val_manifest: str | None = None
    val_fraction: float = 0.1
    cache_dir: str | None = None
    speakers: tuple[str, ...] | None = None
    default_speaker: str = "speaker"
    language: str | None = None
    seed: int = 0
    min_duration: float = 0.5
    max_duration: float = 30.0
    manifest_encoding: str | None = None
    max_clipped_fraction: float = 0.001
    clipped_action: Literal["reject", "flag"] = "reject"
    max_rate_zscore: float = 3.5
    mismatch_action: Literal["reject", "flag"] = "reject"
    subtitle_target_seconds: float = 10.0
    normalize: Literal["peak", "rms"] | None = None
    trim_silence: bool = False
    num_reference_clips: int = 3
    encode_batch_size: int = 8
    encode_batch_seconds: float = 80.0
    prepare_device: str | None = None
    # Replay (`tts_lightning.data.replay`): off at 0; not in prepared.json (the records have a folder of their own).
    replay_fraction: float = 0.0
    replay_texts: tuple[str, ...] | None = None
    replay_texts_file: str | None = None
    replay_max_new_tokens: int = 256

    def __post_init__(self) -> None:
        """Refuse a bad value now rather than in the middle of prepare."""
        if self.num_reference_clips <= 0:  # found now, not after every clip is encoded
            raise ValueError(f"num_reference_clips must be positive, got {self.num_reference_clips}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        file = file_in_the_way(self.cache_dir) if self.cache_dir else None
        if file is not None:
            raise ValueError(f"data.cache_dir {self.cache_dir}: {file} is a file; give a folder")
        if self.normalize not in (None, "peak", "rms"):
            raise ValueError(f"normalize must be None, 'peak' or 'rms', got {self.normalize!r}")
        if self.manifest_encoding is not None:
            try:
                codecs.lookup(self.manifest_encoding)
            except LookupError:
                raise ValueError(f"unknown manifest_encoding {self.manifest_encoding!r}") from None
        if self.speakers is not None:
            speakers = list(self.speakers)
            dupes = sorted(s for s, n in Counter(speakers).items() if n > 1)
            if not speakers or dupes:
                raise ValueError(f"speakers must be a non-empty list of distinct names, got {speakers}")
            object.__setattr__(self, "speakers", tuple(speakers))  # a list from YAML or Python
        if self.encode_batch_size < 1 or self.encode_batch_seconds <= 0:
            raise ConfigError(
                "data.encode_batch_size must be >= 1 and data.encode_batch_seconds > 0, got "
                f"{self.encode_batch_size} and {self.encode_batch_seconds}"
            )
        if not 0.0 <= self.replay_fraction < 1.0:
            raise ConfigError(f"data.replay_fraction must be in [0, 1) (0: off), got {self.replay_fraction}")
        if self.replay_max_new_tokens < 1:
            raise ConfigError(f"data.replay_max_new_tokens must be >= 1, got {self.replay_max_new_tokens}")
        if self.replay_texts is not None:
            object.__setattr__(self, "replay_texts", tuple(self.replay_texts))  # a list from YAML or Python
        self.validation_config()  # raises on a bad validation setting

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> PrepareSettings:
        """The settings among ``arguments`` (e.g. `SpeakerClipsDataModule`'s, which has more)."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls) if f.name in arguments})

    def validation_config(self) -> ValidationConfig:
        return ValidationConfig(
            min_duration=self.min_duration,
            max_duration=self.max_duration,
            max_clipped_fraction=self.max_clipped_fraction,
            clipped_action=self.clipped_action,
            max_rate_zscore=self.max_rate_zscore,
            mismatch_action=self.mismatch_action,
        )

    def index_settings(self, pretrained_dir: Path) -> dict[str, Any]:
        """Everything prepared.json depends on (``pretrained_dir``: the pretrained directory these
        settings name); `read_index_json` refuses an index written for other settings."""

        def absolute(p: str | None) -> str | None:
            return None if p is None else str(Path(p).expanduser().absolute())

        return {
            "pretrained": str(pretrained_dir),
            "train_manifest": absolute(self.train_manifest),
            "val_manifest": absolute(self.val_manifest),
            "val_fraction": self.val_fraction,
            "seed": self.seed,
            "speakers": None if self.speakers is None else list(self.speakers),
            "default_speaker": self.default_speaker,
            "language": self.language,
            "min_duration": self.min_duration,
            "max_duration": self.max_duration,
            "manifest_encoding": self.manifest_encoding,
            "max_clipped_fraction": self.max_clipped_fraction,
            "clipped_action": self.clipped_action,
            "max_rate_zscore": self.max_rate_zscore,
            "mismatch_action": self.mismatch_action,
            "subtitle_target_seconds": self.subtitle_target_seconds,
            "normalize": self.normalize,
            "trim_silence": self.trim_silence,
            "num_reference_clips": self.num_reference_clips,
        }
