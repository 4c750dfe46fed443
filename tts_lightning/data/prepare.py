"""Preparing speaker clips for training, without Lightning: validate, encode, embed and index.

`DataPreparer` does the slow, write-once work `SpeakerClipsDataModule.prepare_data` (and
`tts-lightning prepare`) run: read the manifests, validate every clip (memoised, ``report.json``),
split train/val, encode missing codes into the codec cache, compute the speaker embeddings and
write ``prepared.json``. `PreparedIndex` is that file, typed; `PreparedIndex.to_json` writes the
very same JSON (``PREPARED_VERSION`` 1) as before it was typed.

Cache folder layout (``cache_dir``, default ``<manifest folder>/.tts_lightning_cache``)::

    CACHEDIR.TAG                   marks the folder as a cache: a folder manifest (and backups) skip it
    report.json                    accepted / rejected clips and why
    prepared.json                  the settings, the speakers and every clip (hash, text, speaker,
                                   language, frames, codes file, train/val split)
    validation/<manifest>.json     the memoised validation of each manifest
    validation/parts/              each rank's checks of its share of the files, while a run validates
    ranks/                         one empty file per rank while a run finds out which ranks share the folder
    codes/<tokenizer_id>/<key>.npy codes (T x 16) per clip      (tts_lightning.data.codec_cache)
    speakers/<model_id>.pt         fp32 embedding per speaker   (tts_lightning.data.speakers)
    speakers/parts/                embeddings computed by the ranks of a run, until the table takes them
    segments/<tag>-<key>/          clips cut from a long recording at its subtitles (tts_lightning.data.subtitles)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_info

from tts_lightning.data.audio import TARGET_SAMPLE_RATE
from tts_lightning.data.codec_cache import SAMPLES_PER_FRAME, CodecCache, check_codes_header
from tts_lightning.data.manifest import ManifestResult, Rejection, load_manifest, write_cachedir_tag
from tts_lightning.data.progress import EncodeProgress
from tts_lightning.data.speakers import compute_speaker_table, embed_speakers, select_references
from tts_lightning.data.subtitles import Segment, cut_subtitled, subtitle_speakers
from tts_lightning.data.validation import (
    AcceptedClip,
    FileCheck,
    ValidationConfig,
    ValidationReport,
    check_file,
    files_to_check,
    validate_clips,
)
from tts_lightning.files import atomic_write_json, remove_stale_temporaries
from tts_lightning.model.pretrained import PretrainedInfo, check_pretrained
from tts_lightning.model.sequence import SpecialIds

logger = logging.getLogger(__name__)

PREPARED_VERSION = 1
VALIDATION_MEMO_VERSION = 3
CACHE_DIR_NAME = ".tts_lightning_cache"


def default_cache_dir(manifest: str | os.PathLike) -> Path:
    """``<manifest folder>/.tts_lightning_cache``; a user cache folder when that is not writable
    (e.g. a manifest inside an installed package)."""
    path = Path(manifest).expanduser().absolute()
    folder = path if path.is_dir() else path.parent
    candidate = folder / CACHE_DIR_NAME
    if os.access(candidate if candidate.is_dir() else folder, os.W_OK):
        return candidate
    root = os.environ.get("TTS_LIGHTNING_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tts-lightning"
    )
    return Path(root) / "prepared" / hashlib.sha256(str(path).encode()).hexdigest()[:12]


def split_validation(clips: list[AcceptedClip], val_fraction: float, seed: int) -> set[str]:
    """Content hashes of the validation clips: the ``round(val_fraction * n)`` clips (at least 1
    when val_fraction > 0 and n >= 2, never all) with the smallest seeded hash, passing over a clip
    that would leave its speaker without a training clip (so fewer, or none, when every speaker has
    one clip). Depends only on the seed and the clips' contents and speakers, not on manifest order,
    so it is stable across runs."""
    n = len(clips)
    if val_fraction <= 0 or n < 2:
        return set()
    n_val = min(n - 1, max(1, round(val_fraction * n)))
    ranked = sorted(clips, key=lambda c: hashlib.sha256(f"{seed}:{c.content_hash}".encode()).hexdigest())
    left = Counter(c.record.speaker for c in clips)  # training clips each speaker still has
    chosen: set[str] = set()
    for c in ranked:
        if len(chosen) == n_val:
            break
        if left[c.record.speaker] > 1:
            left[c.record.speaker] -= 1
            chosen.add(c.content_hash)
    return chosen


def _file_stamp(path: Path | None) -> list[int] | None:
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
        h.update(repr((r, _file_stamp(r.audio), _file_stamp(r.ref_audio))).encode())
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
    fresh = {f: c for f, c in (checks or {}).items() if c.stamp is not None and c.stamp == _file_stamp(f)}
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


class PrepareStopped(RuntimeError):
    """Raised on the ranks of a run whose own step of `DataPreparer.prepare_on_all_ranks` went
    well when another rank's failed (that rank raises its own error)."""


# -- the settings ---------------------------------------------------------------------------------


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


# -- the prepared index (prepared.json) -----------------------------------------------------------


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
        return asdict(self)

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
                )
                for c in data["clips"]
            ],
        )


@dataclass
class Plan:
    """What `DataPreparer.plan` decided before encoding: the report and the clips to train on."""

    report: ValidationReport
    speakers: list[str]
    clips: list[AcceptedClip]
    val_hashes: set[str]
    languages: dict[str, str]  # content hash -> language


@dataclass
class Prepared:
    """What `DataPreparer.prepare` returns: the validation report and the index it wrote."""

    report: ValidationReport
    index: PreparedIndex


# -- the preparer ---------------------------------------------------------------------------------


class DataPreparer:
    """Prepares the data of one `PrepareSettings` into its cache folder.

    An instance remembers the report it last showed, so that preparing twice in one run (e.g.
    ``data.prepare()`` and then ``trainer.fit``, whose ``prepare_data`` prepares again) shows it once.
    """

    def __init__(self, settings: PrepareSettings) -> None:
        self.settings = settings
        self._info: PretrainedInfo | None = None
        self._manifest_speakers: list[str] | None = None
        self._logged_report: str | None = None  # JSON text of the report last shown

    # -- paths ----------------------------------------------------------------------------------

    @property
    def info(self) -> PretrainedInfo:
        if self._info is None:
            self._info = check_pretrained(self.settings.pretrained)
        return self._info

    @property
    def cache_dir(self) -> Path:
        if self.settings.cache_dir:
            return Path(self.settings.cache_dir).expanduser().absolute()
        return default_cache_dir(self.settings.train_manifest)

    @property
    def report_path(self) -> Path:
        return self.cache_dir / "report.json"

    @property
    def prepared_path(self) -> Path:
        return self.cache_dir / "prepared.json"

    def index_settings(self) -> dict[str, Any]:
        """Everything prepared.json depends on; `read_index` refuses an index written for other settings."""
        s = self.settings

        def absolute(p: str | None) -> str | None:
            return None if p is None else str(Path(p).expanduser().absolute())

        return {
            "pretrained": str(self.info.path),
            "train_manifest": absolute(s.train_manifest),
            "val_manifest": absolute(s.val_manifest),
            "val_fraction": s.val_fraction,
            "seed": s.seed,
            "speakers": None if s.speakers is None else list(s.speakers),
            "default_speaker": s.default_speaker,
            "language": s.language,
            "min_duration": s.min_duration,
            "max_duration": s.max_duration,
            "manifest_encoding": s.manifest_encoding,
            "max_clipped_fraction": s.max_clipped_fraction,
            "clipped_action": s.clipped_action,
            "max_rate_zscore": s.max_rate_zscore,
            "mismatch_action": s.mismatch_action,
            "subtitle_target_seconds": s.subtitle_target_seconds,
            "normalize": s.normalize,
            "trim_silence": s.trim_silence,
            "num_reference_clips": s.num_reference_clips,
        }

    def requested_speakers(self) -> list[str]:
        """The ``speakers`` setting, else every speaker the training manifest names, sorted."""
        if self.settings.speakers is not None:
            return list(self.settings.speakers)
        return self.manifest_speakers()

    def manifest_speakers(self) -> list[str]:
        """Every speaker the training manifest names (its entries and subtitle cues), sorted; read
        once, without validating a clip."""
        s = self.settings
        if self._manifest_speakers is None:
            records = load_manifest(s.train_manifest, s.default_speaker, s.manifest_encoding).records
            speakers: set[str] = set()
            for r in records:
                speakers |= {r.speaker} if r.subtitles is None else subtitle_speakers(r, s.manifest_encoding)
            self._manifest_speakers = sorted(speakers)
        return list(self._manifest_speakers)

    def check_requested_speakers(self) -> None:
        """Raise ValueError when the ``speakers`` setting names a speaker the training manifest
        does not: a quick check, before any process is started (`plan` checks accepted clips)."""
        if self.settings.speakers is None:
            return
        known = self.manifest_speakers()
        missing = [name for name in self.settings.speakers if name not in known]
        if missing:
            raise ValueError(
                f"speaker(s) {', '.join(map(repr, missing))} are not named by {self.settings.train_manifest} "
                f"(its speakers: {', '.join(known) or 'none'})"
            )

    # -- the whole job ------------------------------------------------------------------------

    def prepare(self, *, ray_workers: int = 0, ray_address: str = "local", show_report: bool = True) -> Prepared:
        """Validate, encode, embed and index the data; return the report and the index.

        ``ray_workers`` > 0 encodes the codes on that many Ray Data workers
        (`tts_lightning.data.ray_prepare`; a local Ray instance, or the cluster at ``ray_address``),
        with the same bytes. ``show_report=False`` writes report.json without logging it: the
        caller shows it (and this preparer does not show it again). Raises ValueError when the
        training manifest has no usable clip (naming it and the main reasons) or a requested
        speaker has no accepted clip.
        """
        plan = self.plan(show_report=show_report)
        if ray_workers > 0:
            from tts_lightning.data.ray_prepare import encode_with_ray

            cache = self.codec_cache()
            cache.verify(plan.clips)
            encoded = encode_with_ray(
                cache,
                plan.clips,
                num_workers=ray_workers,
                batch_size=self.settings.encode_batch_size,
                address=ray_address,
            )
            rank_zero_info(
                f"codec cache: {encoded} clip(s) encoded on {ray_workers} Ray worker(s), "
                f"{len(plan.clips) - encoded} already cached ({self.cache_dir})"
            )
        else:
            self.encode(plan.clips)
        return Prepared(plan.report, self.write_index(plan))

    def prepare_on_all_ranks(
        self,
        world: int,
        rank: int,
        *,
        agree: Callable[[bool], bool],
        gather: Callable[[int], list[int]],
        device: str,
    ) -> None:
        """`prepare`, split over the ranks of a run (called on every rank, after one process per
        node read the manifests). First the ranks find out which of them see the same cache
        folder: all of them when ``cache_dir`` is shared storage, the ranks of each node when each
        node has its own disk. Each step that reads every clip is then split over the
        ranks of a group: each does every n-th item and leaves its results in the cache folder; once
        all are done the group's first rank (the finishing rank) combines them. So each node with a
        disk of its own prepares its whole copy with all its ranks, and nobody waits for one rank to
        do another node's share.

        1. Validation: each rank checks its share of the audio files (`check_file`, into
           ``validation/parts/``); the finishing rank validates with those results (the report of
           one process), writes the memo and report.json, shows the report, and removes the parts
           an interrupted run left (other files or another group size).
        2. Encoding: each rank encodes its share of the clips (sorted by duration, so the shares
           are even) and embeds its share of the speakers (``speakers/parts/``); the finishing
           rank writes the index.

        Everything is written with the bytes a single process writes. ``agree(ok)`` is a
        collective of all ranks (the strategy's ``reduce_boolean_decision(ok, all=True)``): True
        when every rank's step succeeded. It ends each step, so it is the barrier between them too,
        and a step that fails on one rank (e.g. the finishing rank's validation finds no usable
        clip) stops every rank: that rank raises its error, the others `PrepareStopped`, instead
        of waiting at the next barrier until the process group times out. ``gather(n)`` is an
        all-gather of one integer per rank (in rank order).
        """

        def together(step: str, work: Callable[[], Any]) -> Any:
            error: Exception | None = None
            try:
                result = work()
            except Exception as exc:  # raised below, once every rank knows
                error, result = exc, None
            if not agree(error is None):
                if error is not None:
                    raise error
                raise PrepareStopped(f"rank {rank}: preparing the data stopped while {step}: another rank failed")
            return result

        # Which ranks see this cache folder: each leaves a file of a random name, the names are
        # all-gathered (every rank has written its file by then), and each looks for the others'.
        probe = together("finding the ranks that share the cache folder", self._leave_probe)
        tokens = gather(int(probe.stem[1:], 16))
        config = self.settings.validation_config()

        def check() -> tuple[int, int, list[Path], list[Path]]:
            seen = (r for r, token in enumerate(tokens) if (probe.parent / _probe_name(token)).exists())
            sharing = sorted({rank, *seen})
            index, size = sharing.index(rank), len(sharing)
            files = self._files_to_validate()  # empty when every memo is up to date: a second run checks nothing
            parts = self._checks_parts(files, size)  # one name per rank, from one stat of every file
            if files:
                atomic_write_json(parts[index], [[str(f), asdict(check_file(f, config))] for f in files[index::size]])
            return index, size, files, parts

        try:
            index, size, files, parts = together("checking the audio files", check)
        finally:
            probe.unlink(missing_ok=True)  # every rank has looked: the step ends with a collective
        finisher = index == 0
        plan: Plan | None = together(
            "validating", lambda: self.plan(checks=self._gather_checks(files, parts, config)) if finisher else None
        )

        def encode() -> None:
            parts[index].unlink(missing_ok=True)  # the finishing rank has read it
            if finisher:  # parts an interrupted run left under other names (other files or group size)
                for stale in set(parts[index].parent.glob("*.json")) - set(parts):
                    stale.unlink(missing_ok=True)
                for folder in (parts[index].parent, self.cache_dir / "speakers" / "parts", probe.parent):
                    remove_stale_temporaries(folder, ".*.tmp")  # what a killed rank's writes left
            mine = plan or self.plan(show_report=False, write_report=False)  # the memo the finishing rank wrote
            ordered = sorted(mine.clips, key=lambda c: (c.duration, c.content_hash))
            self.encode(ordered[index::size], device=device, log=f"rank {rank}/{world}: ")
            self.embed(mine, mine.speakers[index::size])

        together("encoding", encode)

        def write_index() -> None:
            if finisher:
                assert plan is not None
                # Each rank checked or wrote its share in this folder. Should two ranks have seen
                # the folder differently (a file system caching lookups), what no one encoded is
                # encoded here (a stat per clip when nothing is missing).
                cache = self.codec_cache(device)
                cache.encode_missing(plan.clips, batch_size=self.settings.encode_batch_size)
                cache.release()
                self.write_index(plan)

        together("writing the index", write_index)

    def _leave_probe(self) -> Path:
        """An empty file of a random name in ``ranks/``, for the other ranks of a run to look for."""
        folder = self.cache_dir / "ranks"
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / _probe_name(int.from_bytes(os.urandom(7), "big"))  # not a seeded generator; an int64
        probe.touch()
        return probe

    def read_manifests(self) -> None:
        """Read the manifests, cutting long subtitled recordings into clips: what a run of several
        processes does once per node (``prepare_data``) before its ranks read them together."""
        self._tag_cache_dir()
        for path in filter(None, (self.settings.train_manifest, self.settings.val_manifest)):
            self._read_manifest(path)

    def _files_to_validate(self) -> list[Path]:
        """The audio files of the manifests whose validation memo is out of date, each once,
        sorted by size (so that every ``world``-th file makes even shares) and path."""
        config = self.settings.validation_config()
        files: dict[Path, int] = {}
        for path in filter(None, (self.settings.train_manifest, self.settings.val_manifest)):
            manifest, _ = self._read_manifest(path)
            fingerprint = validation_fingerprint(manifest, config)
            if read_validation_memo(manifest, config, self._validation_memo(path), fingerprint) is None:
                files.update((f, (_file_stamp(f) or [0])[0]) for f in files_to_check(manifest.records))
        return sorted(files, key=lambda f: (files[f], str(f)))

    def _checks_parts(self, files: list[Path], world: int) -> list[Path]:
        """Where each rank leaves its checks of ``files``: named by the files (with their size and
        modification time) and the settings, so a part an interrupted run left is never taken."""
        h = hashlib.sha256(
            json.dumps({"version": VALIDATION_MEMO_VERSION, **asdict(self.settings.validation_config())}).encode()
        )
        for f in files:
            h.update(repr((str(f), _file_stamp(f))).encode())
        folder = self.cache_dir / "validation" / "parts"
        return [folder / f"{h.hexdigest()[:16]}-{rank}-of-{world}.json" for rank in range(world)]

    def _gather_checks(self, files: list[Path], parts: list[Path], config: ValidationConfig) -> dict[Path, FileCheck]:
        """Every rank's checks of ``files``; a share whose part this rank cannot read (another
        node's disk) is checked here."""
        checks: dict[Path, FileCheck] = {}
        for r, path in enumerate(parts):
            share = files[r :: len(parts)]
            found: dict[Path, FileCheck] = {}
            if share and path.is_file():
                try:
                    found = {Path(f): FileCheck(**c) for f, c in json.loads(path.read_text(encoding="utf-8"))}
                except (OSError, ValueError, TypeError) as exc:
                    logger.warning("ignoring unreadable validation part %s (%s); checking its files here", path, exc)
            if set(found) != set(share):
                found = {f: check_file(f, config) for f in share}
            checks.update(found)
        return checks

    # -- the steps ------------------------------------------------------------------------------

    def plan(
        self,
        *,
        show_report: bool = True,
        write_report: bool = True,
        checks: Mapping[Path, FileCheck] | None = None,
    ) -> Plan:
        """Read the manifests, validate (memoised; ``checks``: files already checked), and choose
        the clips, speakers, split and languages; write the report when ``write_report`` and show
        it (once) when ``show_report``. Raises as `prepare` says."""
        s = self.settings
        if write_report:
            self._tag_cache_dir()
        ids = SpecialIds.from_config(self.info.config)
        if s.language is not None:  # a wrong setting is the user's to fix at once, not a rejection per clip
            try:
                ids.language_id(s.language)
            except ValueError as exc:
                raise ValueError(f"data.language: {exc}") from None
        config = s.validation_config()
        cache = self.codec_cache()

        train_manifest, segments = self._read_manifest(s.train_manifest)
        train = validate_with_memo(train_manifest, config, self._validation_memo(s.train_manifest), checks=checks)
        val: ValidationReport | None = None
        if s.val_manifest is not None:
            val_manifest, val_segments = self._read_manifest(s.val_manifest)
            segments += val_segments
            val = validate_with_memo(val_manifest, config, self._validation_memo(s.val_manifest), checks=checks)
            # The same audio in both sets would make the validation loss meaningless.
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
        for rep in (train, val):
            if rep is not None:
                _reject_bad_codes(rep, cache)
                _reject_unknown_languages(rep, ids, s.language)

        report = ValidationReport(
            accepted=train.accepted + (val.accepted if val else []),
            rejected=train.rejected + (val.rejected if val else []),
            config=config,
            warnings=train.warnings + (val.warnings if val else []),
            segments=[asdict(seg) for seg in segments],
        )
        if write_report:
            self._write_report(report, show=show_report)
        train.raise_if_empty(s.train_manifest)
        if val is not None and s.val_manifest is not None:
            val.raise_if_empty(s.val_manifest)

        # Speakers: all the manifest names (sorted) or the ones asked for; each needs clips.
        found = sorted({c.record.speaker for c in train.accepted})
        speakers = self.requested_speakers()
        missing = [name for name in speakers if name not in found]
        if missing:
            speaker_of = {r.source: r.speaker for r in train_manifest.records}
            whys = []
            for name in missing:
                reasons = Counter(r.reason for r in train.rejected if speaker_of.get(r.source) == name)
                counts = ", ".join(f"{reason}: {n}" for reason, n in reasons.most_common())
                whys.append(
                    f"{name!r}: " + (f"{sum(reasons.values())} clip(s) rejected ({counts})" if reasons else "no clip")
                )
            whole = sum(1 for r in train.rejected if r.source not in speaker_of)
            if whole:  # whole entries or recordings (a manifest line, a subtitled recording): no one clip's speaker
                whys.append(f"and {whole} rejected manifest entry(ies) or recording(s)")
            keep = "[" + ", ".join(found) + "]"
            raise ValueError(
                f"no accepted training clip of speaker(s) {'; '.join(whys)} in {s.train_manifest} (see "
                f"{self.report_path}). Speakers with accepted clips: {', '.join(found) or 'none'}. Fix those clips"
                + (f", or train without them: --data.speakers '{keep}' (data.speakers in a config)" if found else "")
            )
        chosen = set(speakers)

        def select(clips: list[AcceptedClip]) -> list[AcceptedClip]:
            return [c for c in clips if c.record.speaker in chosen]

        train_clips = select(train.accepted)
        if val is not None:
            val_clips = select(val.accepted)
            if not val_clips:
                raise ValueError(f"{s.val_manifest}: no accepted clip of speakers {speakers}")
            val_hashes = {c.content_hash for c in val_clips}
            clips = train_clips + val_clips
        else:
            val_hashes = split_validation(train_clips, s.val_fraction, s.seed)
            clips = train_clips
        skipped = len(train.accepted) + (len(val.accepted) if val else 0) - len(clips)
        if skipped and write_report:
            rank_zero_info(f"{skipped} accepted clip(s) of other speakers are not used (speakers={speakers})")

        languages = {c.content_hash: s.language or c.record.language for c in clips}  # checked above
        return Plan(report, speakers, clips, val_hashes, languages)

    def codec_cache(self, device: str | None = None) -> CodecCache:
        s = self.settings
        return CodecCache(
            self.cache_dir,
            self.info,
            normalize=s.normalize,
            trim_silence=s.trim_silence,
            device=device or s.prepare_device,
        )

    def encode(self, clips: list[AcceptedClip], *, device: str | None = None, log: str = "") -> int:
        """Encode the codes of ``clips`` that are not cached yet; return how many were encoded."""
        cache = self.codec_cache(device)
        progress = EncodeProgress(f"{log}encoded")
        cache.verify(clips)  # a truncated or malformed cache file is removed (warning) and encoded again
        encoded = cache.encode_missing(clips, batch_size=self.settings.encode_batch_size, progress=progress)
        cache.release()
        rank_zero_info(
            f"{log}codec cache: {encoded} clip(s) encoded, {len(clips) - encoded} already cached ({self.cache_dir})"
        )
        return encoded

    def embed(self, plan: Plan, speakers: list[str]) -> None:
        """Compute the embeddings of ``speakers`` that the speaker table lacks, each into a file
        that `write_index` takes instead of computing it: how the ranks of a run share the work."""
        s = self.settings
        embed_speakers(
            self.cache_dir,
            self.info,
            select_references(plan.clips, plan.speakers, s.num_reference_clips),
            speakers,
            normalize=s.normalize,
            trim_silence=s.trim_silence,
            device=s.prepare_device or "cpu",  # the device `write_index` embeds on: the same bytes
        )

    def write_index(self, plan: Plan) -> PreparedIndex:
        """Speaker embeddings and prepared.json (the clips' codes must all be cached; each file's
        header is checked as its length is read: `CacheEntryError` names a bad one)."""
        s = self.settings
        cache_dir = self.cache_dir
        cache = self.codec_cache()
        references = select_references(plan.clips, plan.speakers, s.num_reference_clips)
        table = compute_speaker_table(
            cache_dir,
            self.info,
            references,
            normalize=s.normalize,
            trim_silence=s.trim_silence,
            device=s.prepare_device or "cpu",
        )
        clips = []
        for c in plan.clips:
            codes_rel = cache.relative_path(c)
            clips.append(
                PreparedClip(
                    audio=str(c.record.audio),
                    source=c.record.source,
                    content_hash=c.content_hash,
                    text=c.record.text,
                    speaker=c.record.speaker,
                    language=plan.languages[c.content_hash],
                    duration=round(c.duration, 4),
                    frames=check_codes_header(cache_dir / codes_rel, cache.num_code_groups)[0],
                    codes=codes_rel,
                    split="val" if c.content_hash in plan.val_hashes else "train",
                )
            )
        assert table.path is not None  # compute_speaker_table saves the table
        index = PreparedIndex(
            version=PREPARED_VERSION,
            settings=self.index_settings(),
            tokenizer_id=cache.tokenizer_id,
            speaker_table=table.path.relative_to(cache_dir).as_posix(),
            speakers=[
                PreparedSpeaker(n, k, [str(r.path) for r in references[n]]) for n, k in zip(table.names, table.keys)
            ],
            clips=clips,
        )
        atomic_write_json(self.prepared_path, index.to_json())
        n_val = len(index.split("val"))
        rank_zero_info(
            f"prepared {len(clips)} clips ({len(clips) - n_val} train, {n_val} val) of "
            f"{len(plan.speakers)} speaker(s) in {self.prepared_path}"
        )
        return index

    def read_index_json(self) -> dict[str, Any]:
        """prepared.json as JSON, checked against these settings (its version and settings)."""
        path = self.prepared_path
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: run prepare_data() (or `tts-lightning prepare`) before setup()")
        index = json.loads(path.read_text(encoding="utf-8"))
        if index.get("version") != PREPARED_VERSION:
            raise RuntimeError(
                f"{path} has format version {index.get('version')}, expected {PREPARED_VERSION}; run prepare again"
            )
        ours, theirs = self.index_settings(), index.get("settings", {})
        diff = [f"{k}: {theirs.get(k)!r} there, {v!r} here" for k, v in ours.items() if theirs.get(k) != v]
        if diff:
            raise RuntimeError(f"{path} was prepared with other settings ({'; '.join(diff)}); run prepare again")
        return index

    def read_index(self) -> PreparedIndex:
        """prepared.json, typed, checked as `read_index_json` says."""
        return PreparedIndex.from_json(self.read_index_json())

    # -- helpers ----------------------------------------------------------------------------------

    def _read_manifest(self, path: str) -> tuple[ManifestResult, list[Segment]]:
        """The manifest's records, long subtitled recordings cut into clips (cached in
        ``<cache_dir>/segments``), and the segments cut."""
        s = self.settings
        manifest = load_manifest(path, s.default_speaker, s.manifest_encoding)
        return cut_subtitled(
            manifest,
            self.cache_dir / "segments",
            target_seconds=s.subtitle_target_seconds,
            max_duration=s.max_duration,
            encoding=s.manifest_encoding,
        )

    def _tag_cache_dir(self) -> None:
        """Mark the cache folder as a cache (CACHEDIR.TAG) before anything is written in it: a
        folder manifest that holds it does not read it as data, and backup tools skip it."""
        try:
            write_cachedir_tag(self.cache_dir)
        except OSError:
            pass  # an unwritable folder: the first real write names it (WriteError)

    def _validation_memo(self, manifest: str) -> Path:
        name = hashlib.sha256(str(Path(manifest).expanduser().absolute()).encode()).hexdigest()[:16]
        return self.cache_dir / "validation" / f"{name}.json"

    def _write_report(self, report: ValidationReport, *, show: bool) -> None:
        """Write report.json and, when ``show``, show the report once: in full when it is new; as
        one line when report.json already held the same report (shown when it was written, e.g. by
        `tts-lightning prepare` or another process); not at all when this instance already showed it."""
        text = json.dumps(report.to_dict(), sort_keys=True)
        if not show or text == self._logged_report:
            report.write_json(self.report_path)
            self._logged_report = text  # shown by the caller, or already
            return
        try:
            unchanged = json.dumps(json.loads(self.report_path.read_text(encoding="utf-8")), sort_keys=True) == text
        except (OSError, ValueError):
            unchanged = False
        report.write_json(self.report_path)
        self._logged_report = text
        if unchanged:
            flagged = f", {len(report.warnings)} flagged" if report.warnings else ""
            rank_zero_info(
                f"data report unchanged ({self.report_path}): {len(report.accepted)} clips accepted, "
                f"{len(report.rejected)} rejected{flagged}"
            )
        else:
            rank_zero_info(f"data report ({self.report_path}):\n{report.summary()}")


def _probe_name(token: int) -> str:
    return f".{token:014x}.tmp"  # hidden and .tmp: swept with the temporaries a killed rank left


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


def _reject_bad_codes(report: ValidationReport, cache: CodecCache) -> None:
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


def _reject_unknown_languages(report: ValidationReport, ids: SpecialIds, language: str | None) -> None:
    def problem(c: AcceptedClip) -> str | None:
        try:
            ids.language_id(language or c.record.language)
        except ValueError as exc:
            return str(exc)
        return None

    _reject(report, problem)
