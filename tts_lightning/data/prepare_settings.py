"""`PrepareSettings`: what preparing the data depends on, typed, and what of it prepared.json records."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tts_lightning.data.validation import ValidationConfig


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
    prepare_device: str | None = None

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
