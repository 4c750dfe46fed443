"""The validation of a manifest, remembered in the cache folder (``validation/<manifest>.json``).

While a manifest's entries, the validation settings and every referenced file's size and
modification time are unchanged, the previous outcome is reused instead of reading and decoding
every clip again: a second `prepare` checks nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from tts_lightning.data.manifest import ManifestResult, Rejection
from tts_lightning.data.validation import AcceptedClip, FileCheck, ValidationConfig, ValidationReport, validate_clips
from tts_lightning.files import atomic_write_json

VALIDATION_MEMO_VERSION = 4  # 4: checks record the sample rate (low_sample_rate warnings)


def validation_memo_path(cache_dir: Path, manifest: str) -> Path:
    """Where the validation of ``manifest`` is remembered: named by its absolute path."""
    name = hashlib.sha256(str(Path(manifest).expanduser().absolute()).encode()).hexdigest()[:16]
    return cache_dir / "validation" / f"{name}.json"


def file_stamp(path: Path | None) -> list[int] | None:
    """[size, modification time in ns] of ``path``; None when it is None or cannot be read."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def validation_fingerprint(manifest: ManifestResult, config: ValidationConfig) -> str:
    """What a manifest's validation depends on: its entries, the settings, and every referenced
    file's size and modification time."""
    h = hashlib.sha256(json.dumps({"version": VALIDATION_MEMO_VERSION, "config": asdict(config)}).encode())
    for r in manifest.records:
        h.update(repr((r, file_stamp(r.audio), file_stamp(r.ref_audio))).encode())
    for rej in manifest.rejected:
        h.update(repr(rej).encode())
    return h.hexdigest()


def read_validation_memo(
    manifest: ManifestResult, config: ValidationConfig, memo_path: Path, fingerprint: str
) -> ValidationReport | None:
    """The report remembered in ``memo_path`` when it was made for ``fingerprint``, else None."""
    if not memo_path.is_file():
        return None
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
        if memo.get("fingerprint") != fingerprint:
            return None
        return ValidationReport(
            accepted=[AcceptedClip(manifest.records[i], d, c) for i, d, c in memo["accepted"]],
            rejected=[Rejection(**r) for r in memo["rejected"]],
            config=config,
            warnings=[Rejection(**w) for w in memo["warnings"]],
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None  # unreadable memo: validate again


def validate_with_memo(
    manifest: ManifestResult,
    config: ValidationConfig,
    memo_path: Path,
    *,
    checks: Mapping[Path, FileCheck] | None = None,
) -> ValidationReport:
    """`validate_clips`, remembered in ``memo_path``: while the manifest's entries, the
    validation settings and every referenced file's size and modification time are unchanged,
    the previous outcome is reused instead of reading and decoding every clip again. ``checks``:
    files already checked (`check_file`), e.g. by the ranks of a run."""
    fingerprint = validation_fingerprint(manifest, config)
    report = read_validation_memo(manifest, config, memo_path, fingerprint)
    if report is not None:
        return report
    # A check of a file changed since (stamped before it was read) is done again: the memo must
    # never pair the stamps of one content with the results of another.
    fresh = {f: c for f, c in (checks or {}).items() if c.stamp is not None and c.stamp == file_stamp(f)}
    report = validate_clips(manifest.records, config, manifest_rejections=manifest.rejected, checks=fresh)
    position = {id(r): i for i, r in enumerate(manifest.records)}
    atomic_write_json(
        memo_path,
        {
            "fingerprint": fingerprint,
            "accepted": [[position[id(c.record)], c.duration, c.content_hash] for c in report.accepted],
            "rejected": [asdict(r) for r in report.rejected],
            "warnings": [asdict(w) for w in report.warnings],
        },
    )
    return report
