"""After validation, before encoding: which accepted clips a run trains and validates on.

Clips a check after validation rejects (the same audio in both sets, manifest codes of another
clip, a language the model does not know), the speakers (each needs accepted training clips), and
the seeded train/val split. `Plan` is the outcome, what encoding and the index start from.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tts_lightning.data.audio import TARGET_SAMPLE_RATE
from tts_lightning.data.codec_cache import SAMPLES_PER_FRAME, CodecCache
from tts_lightning.data.manifest import ManifestResult, Rejection
from tts_lightning.data.validation import AcceptedClip, ValidationReport
from tts_lightning.model.sequence import SpecialIds
from tts_lightning.names import some_names


@dataclass
class Plan:
    """What `DataPreparer.plan` decided before encoding: the report and the clips to train on."""

    report: ValidationReport
    speakers: list[str]
    clips: list[AcceptedClip]
    val_hashes: set[str]
    languages: dict[str, str]  # content hash -> language


def split_validation(clips: list[AcceptedClip], val_fraction: float, seed: int) -> set[str]:
    """Content hashes of the validation clips: ``round(val_fraction * n)`` clips (at least 1 when
    val_fraction > 0 and n >= 2, never all), shared among the speakers in proportion to their
    clips (largest remainders), so that each speaker large enough for a share is validated on;
    a speaker keeps at least one training clip (so fewer, or none, when every speaker has one
    clip). Within a speaker, the clips with the smallest seeded hash. Depends only on the seed and
    the clips' contents and speakers, not on manifest order, so it is stable across runs."""
    n = len(clips)
    if val_fraction <= 0 or n < 2:
        return set()
    n_val = min(n - 1, max(1, round(val_fraction * n)))

    def rank(key: str) -> str:
        return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()

    by_speaker: dict[str, list[AcceptedClip]] = {}
    for clip in clips:
        by_speaker.setdefault(clip.record.speaker, []).append(clip)
    room = {s: len(own) - 1 for s, own in by_speaker.items()}  # each keeps a training clip
    quota = {s: min(room[s], n_val * len(own) // n) for s, own in by_speaker.items()}
    # The rest one by one, largest remainder first (ties in a seeded order of the names), while
    # any speaker has room.
    by_remainder = sorted(by_speaker, key=lambda s: (-(n_val * len(by_speaker[s]) % n), rank(s)))
    left = n_val - sum(quota.values())
    while left and any(quota[s] < room[s] for s in by_speaker):
        for speaker in by_remainder:
            if left and quota[speaker] < room[speaker]:
                quota[speaker] += 1
                left -= 1
    chosen: set[str] = set()
    for speaker, own in by_speaker.items():
        chosen.update(c.content_hash for c in sorted(own, key=lambda c: rank(c.content_hash))[: quota[speaker]])
    return chosen


def unvalidated_notice(
    speakers: list[str], clips: list[AcceptedClip], val_fraction: float, val_manifest: str | None, seed: int = 0
) -> str:
    """One line on the run's ``speakers`` that have no validation clip, why, and the smallest
    ``val_fraction`` (to 0.01, up to 0.5) that would reach them (``clips``: the run's accepted
    clips, validation ones included); names past the eighth are counted."""
    if val_manifest:
        return f"no validation clips of {some_names(speakers)} in {val_manifest}: val/loss does not measure them"
    count = Counter(c.record.speaker for c in clips)
    alone, unreached = [s for s in speakers if count[s] <= 1], [s for s in speakers if count[s] > 1]
    said = []
    if unreached:
        # The shares are largest remainders, not monotonic in the fraction: the one suggested must
        # reach every speaker with more than one clip, not only these.
        hashes = {c.content_hash: c.record.speaker for c in clips}
        several = {s for s, n in count.items() if n > 1}
        reaching = next(
            (
                f / 100
                for f in range(int(val_fraction * 100) + 1, 51)
                if several <= {hashes[h] for h in split_validation(clips, f / 100, seed)}
            ),
            None,
        )
        enough = f"{reaching:g} would" if reaching is not None else "nor would 0.5"
        said.append(
            f"{some_names(unreached)} (data.val_fraction {val_fraction:g} does not reach them, {enough}: or give a "
            "data.val_manifest)"
        )
    if alone:
        said.append(f"{some_names(alone)} (one clip each, kept for training)")
    return f"no validation clips of {'; of '.join(said)}: val/loss does not measure them"


def reject_training_duplicates(train: ValidationReport, val: ValidationReport) -> None:
    """Reject the validation clips whose audio is a training clip's (``duplicate``): the same
    audio in both sets would make the validation loss meaningless."""
    in_train = {c.content_hash: c.record.source for c in train.accepted}
    kept = []
    for c in val.accepted:
        if c.content_hash in in_train:
            val.rejected.append(
                Rejection(
                    c.record.source,
                    str(c.record.audio),
                    "duplicate",
                    f"same audio content as training clip {in_train[c.content_hash]}",
                )
            )
        else:
            kept.append(c)
    val.accepted = kept


def _reject(report: ValidationReport, problem: Callable[[AcceptedClip], str | None]) -> None:
    """Move the accepted clips with a ``problem`` to the rejected ones (``malformed_entry``)."""
    kept = []
    for c in report.accepted:
        why = problem(c)
        if why is None:
            kept.append(c)
        else:
            report.rejected.append(Rejection(c.record.source, str(c.record.audio), "malformed_entry", why))
    report.accepted = kept


def reject_bad_codes(report: ValidationReport, cache: CodecCache) -> None:
    """Manifest ``audio_codes`` that are malformed, or too many or too few frames for the clip's audio
    (the codes of another clip: the codec makes 12.5 frames per second)."""

    def problem(c: AcceptedClip) -> str | None:
        why = cache.check_given_codes(c)
        if why is not None or c.record.audio_codes is None:
            return why
        frames, expected = len(c.record.audio_codes), c.duration * TARGET_SAMPLE_RATE / SAMPLES_PER_FRAME
        if abs(frames - expected) > max(2.0, 0.1 * expected):
            return (
                f"audio_codes has {frames} frames, but its audio ({c.duration:.2f} s) makes about {expected:.0f} "
                f"at {TARGET_SAMPLE_RATE / SAMPLES_PER_FRAME:g} frames per second: the codes of another clip?"
            )
        return None

    _reject(report, problem)


def reject_unknown_languages(report: ValidationReport, ids: SpecialIds, language: str | None) -> None:
    """Clips whose language (``language`` when set, else the clip's own) the model does not know."""

    def problem(c: AcceptedClip) -> str | None:
        try:
            ids.language_id(language or c.record.language)
        except ValueError as exc:
            return str(exc)
        return None

    _reject(report, problem)


def check_distinct_names(speakers: list[str], manifest: str) -> None:
    """Raise ValueError when two of the run's speakers differ only in case: a custom_voice model
    looks its speakers up in lower case, so `export` would refuse the trained run."""
    by_lower: dict[str, list[str]] = {}
    for name in speakers:
        by_lower.setdefault(name.lower(), []).append(name)
    clashes = [" and ".join(map(repr, names)) for names in by_lower.values() if len(names) > 1]
    if clashes:
        raise ValueError(
            f"speaker names that differ only in case: {'; '.join(clashes)} in {manifest} (an exported model "
            "looks speakers up in lower case): give each speaker one name, or train on some with --data.speakers"
        )


def check_speakers(
    speakers: list[str], train_manifest: ManifestResult, train: ValidationReport, manifest: str, report_path: Path
) -> None:
    """Raise ValueError when a speaker of ``speakers`` has no accepted training clip, naming why
    its clips were rejected and the speakers that have clips (``manifest``: the training manifest
    as given; ``report_path``: report.json)."""
    found = sorted({c.record.speaker for c in train.accepted})
    missing = [name for name in speakers if name not in found]
    if not missing:
        return
    speaker_of = {r.source: r.speaker for r in train_manifest.records}
    whys = []
    for name in missing:
        reasons = Counter(r.reason for r in train.rejected if speaker_of.get(r.source) == name)
        counts = ", ".join(f"{reason}: {n}" for reason, n in reasons.most_common())
        whys.append(f"{name!r}: " + (f"{sum(reasons.values())} clip(s) rejected ({counts})" if reasons else "no clip"))
    whole = sum(1 for r in train.rejected if r.source not in speaker_of)
    if whole:  # whole entries or recordings (a manifest line, a subtitled recording): no one clip's speaker
        whys.append(f"and {whole} rejected manifest entry(ies) or recording(s)")
    keep = "[" + ", ".join(found) + "]"
    raise ValueError(
        f"no accepted training clip of speaker(s) {'; '.join(whys)} in {manifest} (see "
        f"{report_path}). Speakers with accepted clips: {', '.join(found) or 'none'}. Fix those clips"
        + (f", or train without them: --data.speakers '{keep}' (data.speakers in a config)" if found else "")
    )


def choose_clips(
    train: ValidationReport,
    val: ValidationReport | None,
    speakers: list[str],
    *,
    val_fraction: float,
    seed: int,
    val_manifest: str | None,
) -> tuple[list[AcceptedClip], set[str]]:
    """The accepted clips of ``speakers`` and the content hashes of those to validate on: all of
    ``val``'s when there is a validation manifest (``val_manifest``, which must give a clip), else
    a seeded share of the training clips (`split_validation`)."""
    chosen = set(speakers)

    def select(clips: list[AcceptedClip]) -> list[AcceptedClip]:
        return [c for c in clips if c.record.speaker in chosen]

    train_clips = select(train.accepted)
    if val is None:
        return train_clips, split_validation(train_clips, val_fraction, seed)
    val_clips = select(val.accepted)
    if not val_clips:
        raise ValueError(f"{val_manifest}: no accepted clip of speakers {speakers}")
    return train_clips + val_clips, {c.content_hash for c in val_clips}
