"""Check every clip before training: accept it, or reject it with a reason a user can act on."""

from __future__ import annotations

import hashlib
import math
import os
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from tts_lightning.data.audio import AudioReadError, probe_audio, read_audio, trim_edge_silence
from tts_lightning.data.manifest import ClipRecord, Rejection
from tts_lightning.files import atomic_write_json
from tts_lightning.metrics.speech import text_characters  # the count the speaking-rate metrics use

ACTIONS = ("reject", "flag")
# Below this, audio is telephone quality (8-11 kHz): trained on, flagged in the report's warnings.
LOW_SAMPLE_RATE = 16_000
# Robust spread floor for the speaking-rate check, in natural-log units: a speaker whose clips all
# share one rate (a TTS voice, one read-aloud session) still tolerates ~10% natural variation.
MIN_LOG_RATE_SPREAD = 0.1
MIN_CLIPS_FOR_RATE_STATS = 5  # fewer clips of a speaker: only the absolute limits apply


@dataclass
class ValidationConfig:
    min_duration: float = 0.5  # seconds
    max_duration: float = 30.0  # seconds
    silence_threshold_db: float = -50.0  # RMS of the mono mix (DC removed) below this dBFS: silent
    # Clipping, measured on the decoded source samples (before any normalisation).
    clip_level: float = 0.999  # |sample| at or above this counts as at full scale
    max_clipped_fraction: float = 0.001  # more samples than this share at full scale: `clipped`
    clipped_action: str = "reject"  # "reject", or "flag" (kept, listed in the report's warnings)
    # Transcript/audio alignment: characters (letters and digits) per second of speech, edge
    # silence excluded, against the speaker's median (robust z-score of the log rate) and limits.
    max_rate_zscore: float = 3.5
    min_chars_per_second: float = 1.0
    max_chars_per_second: float = 35.0
    mismatch_action: str = "reject"  # "reject", or "flag"

    def __post_init__(self) -> None:
        for name in ("clipped_action", "mismatch_action"):
            if getattr(self, name) not in ACTIONS:
                raise ValueError(f"{name} must be one of {ACTIONS}, got {getattr(self, name)!r}")
        if not 0.0 <= self.max_clipped_fraction <= 1.0:
            raise ValueError(f"max_clipped_fraction must be in [0, 1], got {self.max_clipped_fraction}")
        if self.max_rate_zscore <= 0:
            raise ValueError(f"max_rate_zscore must be positive, got {self.max_rate_zscore}")
        if not 0.0 <= self.min_chars_per_second < self.max_chars_per_second:
            raise ValueError(
                f"need 0 <= min_chars_per_second < max_chars_per_second, got "
                f"{self.min_chars_per_second} and {self.max_chars_per_second}"
            )


@dataclass(frozen=True)
class AcceptedClip:
    record: ClipRecord
    duration: float  # seconds, at the file's own rate
    content_hash: str  # sha256 hex of the file bytes; the codec cache keys on it


@dataclass
class ValidationReport:
    """Accepted clips, rejected entries, and warnings: problems of accepted clips that the
    config says to flag rather than reject (same fields as a rejection)."""

    accepted: list[AcceptedClip] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    config: ValidationConfig = field(default_factory=ValidationConfig)
    warnings: list[Rejection] = field(default_factory=list)
    # Clips cut from long recordings at their subtitles (tts_lightning.data.segments.Segment as dicts).
    segments: list[dict] = field(default_factory=list)

    @property
    def total_duration(self) -> float:
        return sum(c.duration for c in self.accepted)

    def speaker_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(c.record.speaker for c in self.accepted).items()))

    def reason_counts(self) -> dict[str, int]:
        return dict(Counter(r.reason for r in self.rejected).most_common())

    def warning_counts(self) -> dict[str, int]:
        return dict(Counter(w.reason for w in self.warnings).most_common())

    def to_dict(self) -> dict:
        return {
            "accepted": len(self.accepted),
            "rejected": len(self.rejected),
            "flagged": len(self.warnings),
            "total_accepted_seconds": round(self.total_duration, 3),
            "speakers": self.speaker_counts(),
            "rejection_reasons": self.reason_counts(),
            "warning_reasons": self.warning_counts(),
            "config": asdict(self.config),
            "rejections": [asdict(r) for r in self.rejected],
            "warnings": [asdict(w) for w in self.warnings],
            "segments": list(self.segments),
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
        if self.segments:
            recordings = len({s["recording"] for s in self.segments})
            lines.append(
                f"cut {recordings} long recording(s) at their subtitles into {len(self.segments)} clip(s) "
                "(listed under segments in the report)"
            )
        if self.warnings:
            lines.append(f"warnings: {len(self.warnings)} accepted clip(s) flagged (trained on; see the report)")
            lines += [f"  {reason}: {n}" for reason, n in self.warning_counts().items()]
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


def _mono(samples: torch.Tensor) -> torch.Tensor:
    """The mix that is encoded, its DC offset removed: a constant offset or two channels in
    opposite phase carry no speech, whatever each channel's level."""
    mono = samples.mean(dim=0) if samples.dim() == 2 else samples
    return mono - mono.mean()


def _rms_dbfs(mono: torch.Tensor) -> float:
    rms = float(torch.linalg.vector_norm(mono, dtype=torch.float64)) / math.sqrt(max(mono.numel(), 1))
    return 20.0 * math.log10(rms) if rms > 0 else float("-inf")


def clipped_fraction(samples: torch.Tensor, level: float = 0.999) -> float:
    """Share of samples (all channels) whose magnitude is at or above ``level`` of full scale."""
    return float((samples.abs() >= level).double().mean())


def _check_speaking_rates(measured: list[tuple[AcceptedClip, float]], config: ValidationConfig) -> dict[int, str]:
    """{index into measured: detail} for clips whose characters per second of speech lie outside
    the absolute limits or far (robust z-score of the log rate, median/MAD) from the speaker's."""
    rates = [text_characters(c.record.text) / max(secs, 1e-3) for c, secs in measured]
    by_speaker: dict[str, list[int]] = defaultdict(list)
    for i, (c, _) in enumerate(measured):
        by_speaker[c.record.speaker].append(i)
    problems: dict[int, str] = {}
    for speaker, members in by_speaker.items():
        logs = [math.log(max(rates[i], 1e-6)) for i in members]
        median = statistics.median(logs)
        mad = statistics.median(abs(x - median) for x in logs)
        spread = max(mad / 0.6745, MIN_LOG_RATE_SPREAD)  # MAD -> standard deviation of a normal
        use_stats = len(members) >= MIN_CLIPS_FOR_RATE_STATS
        for i, x in zip(members, logs):
            clip, secs = measured[i]
            z = (x - median) / spread
            why = None
            if rates[i] < config.min_chars_per_second:
                why = f"below the minimum {config.min_chars_per_second} chars/s"
            elif rates[i] > config.max_chars_per_second:
                why = f"above the maximum {config.max_chars_per_second} chars/s"
            elif use_stats and abs(z) > config.max_rate_zscore:
                why = f"robust z-score {z:+.1f} beyond +/-{config.max_rate_zscore}"
            if why is not None:
                problems[i] = (
                    f"{rates[i]:.1f} chars/s of speech ({text_characters(clip.record.text)} characters in "
                    f"{secs:.2f} s without edge silence), speaker {speaker!r} median {math.exp(median):.1f} chars/s "
                    f"over {len(members)} clip(s): {why}; does the transcript belong to this audio?"
                )
    return problems


@dataclass(frozen=True)
class FileCheck:
    """What the checks of one audio file found, on its own: the same whichever record names it and
    whichever process reads it, so the files can be checked anywhere (each rank of a run checks its
    share) and combined in manifest order by `validate_clips`. Plain JSON values (`asdict`)."""

    digest: str | None = None  # sha256 of the file bytes; None when they could not be read
    reason: str | None = None  # the first per-file check that failed (with its detail), else None
    detail: str = ""
    duration: float = 0.0  # seconds, decoded
    speech: float = 0.0  # seconds without edge silence
    clipped: str | None = None  # detail of a clipped clip that the config flags rather than rejects
    rate: int = 0  # the file's sample rate (0: a check made before it was recorded)
    # [size, mtime_ns] before the file was read: a check of a file changed since then is stale.
    stamp: list[int] | None = None


def check_file(path: Path, config: ValidationConfig) -> FileCheck:
    """Read, hash, decode and check one audio file: unreadable, too short / too long (from the
    header, so an hour-long file is not decoded), silent, clipped."""
    try:
        st = os.stat(path)
        data = path.read_bytes()
    except OSError as exc:
        return FileCheck(reason="unreadable_audio", detail=f"cannot read {path}: {exc.strerror or exc}")
    digest, stamp = hashlib.sha256(data).hexdigest(), [st.st_size, st.st_mtime_ns]
    return replace(_check_bytes(path, data, config), digest=digest, stamp=stamp)


def _check_bytes(path: Path, data: bytes, config: ValidationConfig) -> FileCheck:
    """`check_file` on the file's bytes (its digest and stamp are `check_file`'s to add)."""
    try:
        info = probe_audio(path, data=data)
        if info.duration < config.min_duration:
            detail = f"{info.duration:.2f} s is shorter than min_duration {config.min_duration} s"
            return FileCheck(reason="too_short", detail=detail)
        if info.duration > config.max_duration:
            detail = f"{info.duration:.2f} s is longer than max_duration {config.max_duration} s"
            return FileCheck(reason="too_long", detail=detail)
        samples, rate = read_audio(path, data=data)
    except AudioReadError as exc:
        return FileCheck(reason="unreadable_audio", detail=exc.reason)
    mono = _mono(samples)
    level = _rms_dbfs(mono)
    if level < config.silence_threshold_db:
        shown = "-inf" if math.isinf(level) else f"{level:.1f}"
        return FileCheck(reason="silent", detail=f"RMS level {shown} dBFS is below {config.silence_threshold_db} dBFS")
    clipped, flagged = clipped_fraction(samples, config.clip_level), None
    if clipped > config.max_clipped_fraction:
        flagged = (
            f"{100 * clipped:.2f}% of samples at or above {config.clip_level} of full scale "
            f"(limit {100 * config.max_clipped_fraction:.2f}%): the recording is clipped"
        )
        if config.clipped_action == "reject":
            return FileCheck(reason="clipped", detail=flagged)
    # Decoded length, not the header's: compressed formats may only estimate it.
    duration = samples.shape[1] / rate
    speech = trim_edge_silence(mono, rate).shape[-1] / rate  # seconds without edge silence
    return FileCheck(duration=duration, speech=speech, clipped=flagged, rate=int(rate))


def _precheck(rec: ClipRecord) -> tuple[str, str] | None:
    """The checks of a record that read no audio (before its duplicate-path check), as (reason, detail)."""
    if not rec.audio.is_file():
        return "missing_file", f"audio file not found: {rec.audio}"
    if not rec.text.strip():
        return "empty_transcript", "transcript is empty or whitespace only"
    if rec.ref_audio is not None and not rec.ref_audio.is_file():
        return "missing_ref_audio", f"reference audio not found: {rec.ref_audio}"
    return None


def files_to_check(records: Iterable[ClipRecord]) -> list[Path]:
    """The distinct audio files `validate_clips` reads for ``records`` (the records that pass the
    checks that read no audio: their audio and reference audio), in order: what `check_file` can do
    ahead of it."""
    files: dict[Path, None] = {}
    for rec in records:
        if _precheck(rec) is None:
            files[rec.audio] = None
            if rec.ref_audio is not None:
                files[rec.ref_audio] = None
    return list(files)


# A reference clip only feeds the speaker embedding: it must be readable speech, of any length.
_BAD_REFERENCE = ("unreadable_audio", "silent")


def validate_clips(
    records: Iterable[ClipRecord],
    config: ValidationConfig | None = None,
    *,
    manifest_rejections: Iterable[Rejection] = (),
    checks: Mapping[Path, FileCheck] | None = None,
) -> ValidationReport:
    """Read each clip's bytes once and accept or reject it.

    Checks, in order: missing file, duplicate path, empty transcript, missing ref_audio,
    duplicate content (sha256 of the file bytes), unreadable/corrupt audio, duration
    outside [min, max], silence (of the DC-free mono mix), clipping, an unreadable or silent
    ref_audio; then, over all the clips that passed, the speaking rate of each against its
    speaker's (`transcript_mismatch`). A clip is a duplicate only of an earlier clip that passed
    the per-clip checks. Clipping and mismatches are rejected or, as the
    config says, kept and listed in ``report.warnings``. ``checks``: `check_file` results already
    computed (e.g. by several processes); a file without one is checked here.
    """
    config = config or ValidationConfig()
    checks = checks or {}
    report = ValidationReport(rejected=list(manifest_rejections), config=config)
    seen_paths: dict[Path, str] = {}
    seen_hashes: dict[str, str] = {}
    measured: list[tuple[AcceptedClip, float]] = []  # (clip, seconds of speech)
    flagged: list[list[Rejection]] = []  # each measured clip's doubts
    ref_checks: dict[Path, FileCheck] = {}

    for rec in records:
        audio = str(rec.audio)

        def reject(reason: str, detail: str, rec: ClipRecord = rec, audio: str = audio) -> None:
            report.rejected.append(Rejection(rec.source, audio, reason, detail))

        problem = _precheck(rec)
        if problem is not None and problem[0] == "missing_file":
            reject(*problem)
            continue
        if rec.audio in seen_paths:
            reject("duplicate", f"same audio path as {seen_paths[rec.audio]}")
            continue
        if problem is not None:
            reject(*problem)
            continue
        check = checks.get(rec.audio) or check_file(rec.audio, config)
        if check.digest is not None and check.digest in seen_hashes:
            reject("duplicate", f"same audio content as {seen_hashes[check.digest]}")
            continue
        if check.reason is not None or check.digest is None:
            reject(check.reason or "unreadable_audio", check.detail)
            continue
        if rec.ref_audio is not None:
            if rec.ref_audio not in ref_checks:
                ref = checks.get(rec.ref_audio) or check_file(rec.ref_audio, config)
                if ref.reason in ("too_short", "too_long"):  # judged from the header: decode it all the same
                    ref = check_file(rec.ref_audio, replace(config, min_duration=0.0, max_duration=math.inf))
                ref_checks[rec.ref_audio] = ref
            ref = ref_checks[rec.ref_audio]
            if ref.digest is None or ref.reason in _BAD_REFERENCE:
                reject(ref.reason or "unreadable_audio", f"reference audio {rec.ref_audio}: {ref.detail}")
                continue
        doubts = []  # listed in the report's warnings if the clip is accepted in the end
        if check.clipped is not None:
            doubts.append(Rejection(rec.source, audio, "clipped", check.clipped))
        if 0 < check.rate < LOW_SAMPLE_RATE:
            detail = (
                f"recorded at {check.rate} Hz: it holds nothing above {check.rate // 2} Hz, and the model learns "
                "that muffled sound from it (a better recording, or leave it out)"
            )
            doubts.append(Rejection(rec.source, audio, "low_sample_rate", detail))
        seen_paths[rec.audio] = rec.source
        seen_hashes[check.digest] = rec.source
        measured.append((AcceptedClip(rec, check.duration, check.digest), check.speech))
        flagged.append(doubts)

    problems = _check_speaking_rates(measured, config)
    for i, (clip, _) in enumerate(measured):
        if i in problems:
            entry = Rejection(clip.record.source, str(clip.record.audio), "transcript_mismatch", problems[i])
            if config.mismatch_action == "reject":
                report.rejected.append(entry)
                continue
            flagged[i].append(entry)
        report.warnings += flagged[i]
        report.accepted.append(clip)
    return report
