"""Check every clip before training: accept it, or reject it with a reason a user can act on."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tts_lightning.data.audio import AudioReadError, probe_audio, read_audio
from tts_lightning.data.manifest import ClipRecord, Rejection
from tts_lightning.files import atomic_write_json


@dataclass
class ValidationConfig:
    min_duration: float = 0.5  # seconds
    max_duration: float = 30.0  # seconds
    silence_threshold_db: float = -50.0  # clip RMS below this dBFS counts as silent


@dataclass(frozen=True)
class AcceptedClip:
    record: ClipRecord
    duration: float  # seconds, at the file's own rate
    content_hash: str  # sha256 hex of the file bytes; the codec cache keys on it


@dataclass
class ValidationReport:
    accepted: list[AcceptedClip] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    config: ValidationConfig = field(default_factory=ValidationConfig)

    @property
    def total_duration(self) -> float:
        return sum(c.duration for c in self.accepted)

    def speaker_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(c.record.speaker for c in self.accepted).items()))

    def reason_counts(self) -> dict[str, int]:
        return dict(Counter(r.reason for r in self.rejected).most_common())

    def to_dict(self) -> dict:
        return {
            "accepted": len(self.accepted),
            "rejected": len(self.rejected),
            "total_accepted_seconds": round(self.total_duration, 3),
            "speakers": self.speaker_counts(),
            "rejection_reasons": self.reason_counts(),
            "config": asdict(self.config),
            "rejections": [asdict(r) for r in self.rejected],
        }

    def write_json(self, path: str | Path) -> Path:
        """Write the report atomically, so a crash never leaves half a file."""
        return atomic_write_json(path, self.to_dict())

    def summary(self) -> str:
        speakers = self.speaker_counts()
        lines = [
            f"accepted {len(self.accepted)} clips ({self.total_duration:.1f} s) "
            f"from {len(speakers)} speaker(s); rejected {len(self.rejected)}"
        ]
        lines += [f"  {reason}: {n}" for reason, n in self.reason_counts().items()]
        return "\n".join(lines)

    def raise_if_empty(self, manifest_path: str | Path) -> None:
        """Raise ValueError naming the manifest and the main reasons when no clip survived."""
        if self.accepted:
            return
        if not self.rejected:
            raise ValueError(f"no clips found in manifest {manifest_path}")
        top = list(self.reason_counts().items())[:3]
        parts = []
        for reason, n in top:
            example = next(r for r in self.rejected if r.reason == reason)
            parts.append(f"{reason} x{n} (e.g. {example.source}: {example.detail})")
        raise ValueError(
            f"no usable clips in manifest {manifest_path}: all {len(self.rejected)} entries were rejected; "
            "top reasons: " + "; ".join(parts)
        )


def _rms_dbfs(samples) -> float:
    rms = float(samples.double().pow(2).mean().sqrt())
    return 20.0 * math.log10(rms) if rms > 0 else float("-inf")


def validate_clips(
    records: Iterable[ClipRecord],
    config: ValidationConfig | None = None,
    *,
    manifest_rejections: Iterable[Rejection] = (),
) -> ValidationReport:
    """Read each clip's bytes once and accept or reject it.

    Checks, in order: missing file, duplicate path, empty transcript, missing ref_audio,
    duplicate content (sha256 of the file bytes), unreadable/corrupt audio, duration
    outside [min, max], silence. A clip is a duplicate only of an earlier *accepted* clip.
    """
    config = config or ValidationConfig()
    report = ValidationReport(rejected=list(manifest_rejections), config=config)
    seen_paths: dict[Path, str] = {}
    seen_hashes: dict[str, str] = {}

    for rec in records:
        audio = str(rec.audio)

        def reject(reason: str, detail: str, rec: ClipRecord = rec, audio: str = audio) -> None:
            report.rejected.append(Rejection(rec.source, audio, reason, detail))

        if not rec.audio.is_file():
            reject("missing_file", f"audio file not found: {rec.audio}")
            continue
        if rec.audio in seen_paths:
            reject("duplicate", f"same audio path as {seen_paths[rec.audio]}")
            continue
        if not rec.text.strip():
            reject("empty_transcript", "transcript is empty or whitespace only")
            continue
        if rec.ref_audio is not None and not rec.ref_audio.is_file():
            reject("missing_ref_audio", f"reference audio not found: {rec.ref_audio}")
            continue
        try:
            data = rec.audio.read_bytes()
        except OSError as exc:
            reject("unreadable_audio", f"cannot read {rec.audio}: {exc.strerror or exc}")
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen_hashes:
            reject("duplicate", f"same audio content as {seen_hashes[digest]}")
            continue
        try:
            # Header first so an hour-long file is rejected as too_long without decoding it.
            info = probe_audio(rec.audio, data=data)
            if info.duration < config.min_duration:
                reject("too_short", f"{info.duration:.2f} s is shorter than min_duration {config.min_duration} s")
                continue
            if info.duration > config.max_duration:
                reject("too_long", f"{info.duration:.2f} s is longer than max_duration {config.max_duration} s")
                continue
            samples, rate = read_audio(rec.audio, data=data)
        except AudioReadError as exc:
            reject("unreadable_audio", exc.reason)
            continue
        level = _rms_dbfs(samples)
        if level < config.silence_threshold_db:
            shown = "-inf" if math.isinf(level) else f"{level:.1f}"
            reject("silent", f"RMS level {shown} dBFS is below {config.silence_threshold_db} dBFS")
            continue
        seen_paths[rec.audio] = rec.source
        seen_hashes[digest] = rec.source
        # Decoded length, not the header's: compressed formats may only estimate it.
        report.accepted.append(AcceptedClip(rec, samples.shape[1] / rate, digest))
    return report
