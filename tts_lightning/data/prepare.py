"""Preparing speaker clips for training, without Lightning: validate, encode, embed and index.

`DataPreparer` does the slow, write-once work `SpeakerClipsDataModule.prepare_data` (and
`tts-lightning prepare`) run: read the manifests, validate every clip (memoised, ``report.json``),
split train/val, encode missing codes into the codec cache, compute the speaker embeddings and
write ``prepared.json``. It orchestrates; each step has its own room:

- `tts_lightning.data.prepare_settings`: the settings (`PrepareSettings`);
- `tts_lightning.data.cache_folder`: where the cache folder is, and its layout;
- `tts_lightning.data.validation_memo`: each manifest's validation, remembered;
- `tts_lightning.data.report_log`: report.json, shown once;
- `tts_lightning.data.selection`: the speakers, the clips and the seeded train/val split (`Plan`);
- `tts_lightning.data.codec_cache`, `tts_lightning.data.speakers`: the codes and the embeddings;
- `tts_lightning.data.prepared_index`: prepared.json (`PreparedIndex`);
- `tts_lightning.data.prepare_ranks`: the same work split over the ranks of a run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from tts_lightning.data import prepare_ranks
from tts_lightning.data.cache_folder import default_cache_dir, tag_cache_dir
from tts_lightning.data.codec_cache import CodecCache
from tts_lightning.data.manifest import ManifestResult, load_manifest
from tts_lightning.data.prepare_settings import PrepareSettings
from tts_lightning.data.prepared_index import PreparedIndex, build_index, read_index_json
from tts_lightning.data.progress import EncodeProgress
from tts_lightning.data.replay import ReplayRecord, check_replay, prepare_replay, replay_folder, replay_texts
from tts_lightning.data.report_log import ReportLog
from tts_lightning.data.segments import Segment, cut_subtitled
from tts_lightning.data.selection import (
    Plan,
    check_distinct_names,
    check_speakers,
    choose_clips,
    reject_bad_codes,
    reject_training_duplicates,
    reject_unknown_languages,
    unvalidated_notice,
)
from tts_lightning.data.speakers import codec_row_table, compute_speaker_table, embed_speakers, select_references
from tts_lightning.data.subtitles import subtitle_speakers
from tts_lightning.data.validation import AcceptedClip, FileCheck, ValidationConfig, ValidationReport, files_to_check
from tts_lightning.data.validation_memo import (
    file_stamp,
    read_validation_memo,
    validate_with_memo,
    validation_fingerprint,
    validation_memo_path,
)
from tts_lightning.files import atomic_write_json
from tts_lightning.model.custom_voice import check_instructs, is_custom_voice
from tts_lightning.model.pretrained import PretrainedInfo, check_pretrained
from tts_lightning.model.sequence import SpecialIds
from tts_lightning.names import some_names, unknown_names

__all__ = ["DataPreparer", "Plan", "Prepared", "PreparedIndex", "PrepareSettings", "default_cache_dir"]


@dataclass
class Prepared:
    """What `DataPreparer.prepare` returns: the validation report and the index it wrote."""

    report: ValidationReport
    index: PreparedIndex


class DataPreparer:
    """Prepares the data of one `PrepareSettings` into its cache folder.

    An instance remembers the report it last showed, so that preparing twice in one run (e.g.
    ``data.prepare()`` and then ``trainer.fit``, whose ``prepare_data`` prepares again) shows it once.
    """

    def __init__(self, settings: PrepareSettings) -> None:
        self.settings = settings
        self._info: PretrainedInfo | None = None
        self._manifest_speakers: list[str] | None = None
        self._report_log = ReportLog()

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
        return self.settings.index_settings(self.info.path)

    # -- speakers -------------------------------------------------------------------------------

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
        does not, or two of the run's speakers differ only in case: a quick check, before any
        process is started (`plan` checks accepted clips)."""
        check_distinct_names(self.requested_speakers(), self.settings.train_manifest)
        if self.settings.speakers is None:
            return
        known = self.manifest_speakers()
        missing = [name for name in self.settings.speakers if name not in known]
        if missing:
            raise ValueError(
                f"speaker(s) {unknown_names(missing, known)} are not named by {self.settings.train_manifest} "
                f"(its speakers: {some_names(known) or 'none'})"
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
            self._encode_with_ray(plan.clips, ray_workers, ray_address)
        else:
            self.encode(plan.clips)
        index = self.write_index(plan)
        self.prepare_replay()
        return Prepared(plan.report, index)

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
        node read the manifests; `tts_lightning.data.prepare_ranks`). First the ranks find out which
        of them see the same cache folder: all of them when ``cache_dir`` is shared storage, the
        ranks of each node when each node has its own disk. Each step that reads every clip is then
        split over the ranks of a group: each does every n-th item and leaves its results in the
        cache folder; once all are done the group's first rank (the finishing rank) combines them.

        1. Validation: each rank checks its share of the audio files (`check_file`, into
           ``validation/parts/``); the finishing rank validates with those results (the report of
           one process), writes the memo and report.json, shows the report, and removes the parts
           an interrupted run left (other files or another group size).
        2. Encoding: each rank encodes its share of the clips (sorted by duration, so the shares
           are even) and embeds its share of the speakers (``speakers/parts/``); the finishing
           rank writes the index.

        Everything is written with the bytes a single process writes with as many CPU threads per
        process (the speaker encoder's float sums follow the thread count: a run of 2 ranks of 1
        thread and one process of 2 threads differ in the last bits, ~1e-6). ``agree(ok)`` is a
        collective of all ranks (the strategy's ``reduce_boolean_decision(ok, all=True)``): True
        when every rank's step succeeded. It ends each step, so it is the barrier between them too,
        and a step that fails on one rank (e.g. the finishing rank's validation finds no usable
        clip) stops every rank: that rank raises its error, the others `PrepareStopped`, instead
        of waiting at the next barrier until the process group times out. ``gather(n)`` is an
        all-gather of one integer per rank (in rank order).
        """
        prepare_ranks.prepare_on_all_ranks(self, world, rank, agree=agree, gather=gather, device=device)

    def read_manifests(self) -> None:
        """Read the manifests, cutting long subtitled recordings into clips: what a run of several
        processes does once per node (``prepare_data``) before its ranks read them together."""
        for path in filter(None, (self.settings.train_manifest, self.settings.val_manifest)):
            self._read_manifest(path)
        tag_cache_dir(self.cache_dir)  # after reading them: a missing manifest leaves no folder behind

    def files_to_validate(self) -> list[Path]:
        """The audio files of the manifests whose validation memo is out of date, each once,
        sorted by size (so that every ``world``-th file makes even shares) and path."""
        config = self.settings.validation_config()
        files: dict[Path, int] = {}
        for path in filter(None, (self.settings.train_manifest, self.settings.val_manifest)):
            manifest, _ = self._read_manifest(path)
            fingerprint = validation_fingerprint(manifest, config)
            memo = validation_memo_path(self.cache_dir, path)
            if read_validation_memo(manifest, config, memo, fingerprint) is None:
                files.update((f, (file_stamp(f) or [0])[0]) for f in files_to_check(manifest.records))
        return sorted(files, key=lambda f: (files[f], str(f)))

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
        check_replay(self.info, s.replay_fraction)  # before anything is read: a wrong start is the user's to fix
        check_distinct_names(self.requested_speakers(), s.train_manifest)  # before anything is written
        ids = SpecialIds.from_config(self.info.config)
        if s.language is not None:  # a wrong setting is the user's to fix at once, not a rejection per clip
            try:
                ids.language_id(s.language)
            except ValueError as exc:
                raise ValueError(f"data.language: {exc}") from None
        config = s.validation_config()
        cache = self.codec_cache()
        train_manifest, train, val, segments = self._validate(config, checks)
        if write_report:
            tag_cache_dir(self.cache_dir)  # after reading the manifests: a missing one leaves no folder
        for rep in (train, val):
            if rep is not None:
                reject_bad_codes(rep, cache)
                reject_unknown_languages(rep, ids, s.language)
        report = ValidationReport(
            accepted=train.accepted + (val.accepted if val else []),
            rejected=train.rejected + (val.rejected if val else []),
            config=config,
            warnings=train.warnings + (val.warnings if val else []),
            segments=[asdict(seg) for seg in segments],
        )
        if write_report:
            self._report_log.write(report, self.report_path, show=show_report)
        train.raise_if_empty(s.train_manifest)
        if val is not None and s.val_manifest is not None:
            val.raise_if_empty(s.val_manifest)

        # Speakers: all the manifest names (sorted) or the ones asked for; each needs clips.
        speakers = self.requested_speakers()
        check_speakers(speakers, train_manifest, train, s.train_manifest, self.report_path)
        clips, val_hashes = choose_clips(
            train, val, speakers, val_fraction=s.val_fraction, seed=s.seed, val_manifest=s.val_manifest
        )
        check_instructs(self.info, clips)
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
        encoded = cache.encode_missing(
            clips,
            batch_size=self.settings.encode_batch_size,
            max_seconds=self.settings.encode_batch_seconds,
            progress=progress,
        )
        cache.release()
        rank_zero_info(
            f"{log}codec cache: {encoded} clip(s) encoded, {len(clips) - encoded} already cached ({self.cache_dir})"
        )
        return encoded

    def embed(self, plan: Plan, speakers: list[str]) -> None:
        """Compute the embeddings of ``speakers`` that the speaker table lacks, each into a file
        that `write_index` takes instead of computing it: how the ranks of a run share the work."""
        s = self.settings
        if is_custom_voice(self.info.config):
            return  # speakers are codec rows of the model (codec_row_table): nothing to embed
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
        references = select_references(plan.clips, plan.speakers, s.num_reference_clips)
        if is_custom_voice(self.info.config):
            table = codec_row_table(self.cache_dir, self.info, plan.speakers)
        else:
            table = compute_speaker_table(
                self.cache_dir,
                self.info,
                references,
                normalize=s.normalize,
                trim_silence=s.trim_silence,
                device=s.prepare_device or "cpu",
            )
        index = build_index(plan, self.codec_cache(), table, references, self.index_settings())
        atomic_write_json(self.prepared_path, index.to_json())
        n_clips, n_val = len(index.clips), len(index.split("val"))
        rank_zero_info(
            f"prepared {n_clips} clips ({n_clips - n_val} train, {n_val} val) of "
            f"{len(plan.speakers)} speaker(s) in {self.prepared_path}"
        )
        unvalidated = sorted(set(plan.speakers) - {c.speaker for c in index.split("val")})
        if n_val and unvalidated:
            rank_zero_info(unvalidated_notice(unvalidated, plan.clips, s.val_fraction, s.val_manifest, s.seed))
        return index

    def replay_texts(self) -> list[str]:
        return replay_texts(self.settings.replay_texts, self.settings.replay_texts_file)

    def check_replay(self) -> None:
        """Raise a one-line user error for replay settings that cannot work (the model, the texts); quick."""
        if self.settings.replay_fraction > 0:
            check_replay(self.info, self.settings.replay_fraction)
            self.replay_texts()

    def replay_folder(self) -> Path:
        """The folder of the replay records these settings train with (`tts_lightning.data.replay`)."""
        s = self.settings
        return replay_folder(self.cache_dir, self.info, self.replay_texts(), s.replay_max_new_tokens, s.seed)

    def prepare_replay(self, device: str | None = None) -> list[ReplayRecord]:
        """The starting model's replay records (spoken once, then read from the cache); none when replay is off."""
        s = self.settings
        if s.replay_fraction <= 0:
            return []
        check_replay(self.info, s.replay_fraction)
        return prepare_replay(
            self.cache_dir,
            self.info,
            self.replay_texts(),
            max_new_tokens=s.replay_max_new_tokens,
            seed=s.seed,
            # As the codec cache: cuda when available. The CPU runs the same calls (tests/data/test_replay.py).
            device=device or s.prepare_device or ("cuda" if torch.cuda.is_available() else "cpu"),
        )

    def read_index_json(self) -> dict[str, Any]:
        """prepared.json as JSON, checked against these settings (its version and settings)."""
        return read_index_json(self.prepared_path, self.index_settings())

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

    def _validate(
        self, config: ValidationConfig, checks: Mapping[Path, FileCheck] | None
    ) -> tuple[ManifestResult, ValidationReport, ValidationReport | None, list[Segment]]:
        """The training manifest, its validation, the validation manifest's (its clips of training
        audio rejected) and every segment cut from subtitled recordings."""
        s = self.settings
        train_manifest, segments = self._read_manifest(s.train_manifest)
        memo = validation_memo_path(self.cache_dir, s.train_manifest)
        train = validate_with_memo(train_manifest, config, memo, checks=checks)
        val: ValidationReport | None = None
        if s.val_manifest is not None:
            val_manifest, val_segments = self._read_manifest(s.val_manifest)
            segments += val_segments
            memo = validation_memo_path(self.cache_dir, s.val_manifest)
            val = validate_with_memo(val_manifest, config, memo, checks=checks)
            reject_training_duplicates(train, val)
        return train_manifest, train, val, segments

    def _encode_with_ray(self, clips: list[AcceptedClip], workers: int, address: str) -> None:
        from tts_lightning.data.ray_prepare import encode_with_ray

        cache = self.codec_cache()
        cache.verify(clips)
        encoded = encode_with_ray(
            cache,
            clips,
            num_workers=workers,
            batch_size=self.settings.encode_batch_size,
            max_seconds=self.settings.encode_batch_seconds,
            address=address,
            pretrained=str(self.settings.pretrained),
        )
        rank_zero_info(
            f"codec cache: {encoded} clip(s) encoded on {workers} Ray worker(s), "
            f"{len(clips) - encoded} already cached ({self.cache_dir})"
        )
