"""`SpeakerClipsDataModule`: speaker clips on disk -> length-bucketed `TalkerBatch`es.

``prepare_data`` (one process per node) does all the slow, write-once work through `prepare`:
read the manifests, validate every clip (``report.json``), encode missing codes into the codec
cache, compute the speaker embeddings, and write ``prepared.json``, the index of what to train on.
``setup`` (every process) reads those files, never attributes set by ``prepare_data``, so
it works in any process, and a fresh instance can ``setup`` from a cache prepared earlier.

In a run of several processes ``prepare_data`` only validates; ``setup`` then splits the codec
encoding over every rank (each re-reads the memoised validation from disk, encodes its share, and
after a barrier the ``prepare_data`` rank writes the index), with the same bytes as one process.

Cache folder layout (``cache_dir``, default ``<manifest folder>/.tts_lightning_cache``)::

    report.json                    accepted / rejected clips and why
    prepared.json                  the settings, the speakers and every clip (hash, text, speaker,
                                   language, frames, codes file, train/val split)
    codes/<tokenizer_id>/<key>.npy codes (T x 16) per clip      (tts_lightning.data.codec_cache)
    speakers/<model_id>.pt         fp32 embedding per speaker   (tts_lightning.data.speakers)
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Sampler

from tts_lightning.data.batching import LengthBucketBatchSampler
from tts_lightning.data.codec_cache import CodecCache
from tts_lightning.data.dataset import PreparedItem, SpeakerClipsDataset, TalkerCollate
from tts_lightning.data.manifest import ManifestResult, Rejection, load_manifest
from tts_lightning.data.progress import EncodeProgress
from tts_lightning.data.speakers import (
    compute_speaker_table,
    load_speaker_table,
    select_references,
)
from tts_lightning.data.subtitles import cut_subtitled, subtitle_speakers
from tts_lightning.data.validation import AcceptedClip, ValidationConfig, ValidationReport, validate_clips
from tts_lightning.files import atomic_write_json
from tts_lightning.model.pretrained import PretrainedInfo, check_pretrained, load_text_tokenizer
from tts_lightning.model.sequence import SpecialIds, tokenize_text

logger = logging.getLogger(__name__)

PREPARED_VERSION = 1
VALIDATION_MEMO_VERSION = 2
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
    when val_fraction > 0 and n >= 2, never all) with the smallest seeded hash. Depends only on
    the seed and the clips' contents, not on manifest order, so it is stable across runs."""
    n = len(clips)
    if val_fraction <= 0 or n < 2:
        return set()
    n_val = min(n - 1, max(1, round(val_fraction * n)))
    ranked = sorted(clips, key=lambda c: hashlib.sha256(f"{seed}:{c.content_hash}".encode()).hexdigest())
    return {c.content_hash for c in ranked[:n_val]}


def _file_stamp(path: Path | None) -> list[int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def validate_with_memo(manifest: ManifestResult, config: ValidationConfig, memo_path: Path) -> ValidationReport:
    """`validate_clips`, remembered in ``memo_path``: while the manifest's entries, the
    validation settings and every referenced file's size and modification time are unchanged,
    the previous outcome is reused instead of reading and decoding every clip again."""
    h = hashlib.sha256(json.dumps({"version": VALIDATION_MEMO_VERSION, "config": asdict(config)}).encode())
    for r in manifest.records:
        h.update(repr((r, _file_stamp(r.audio), _file_stamp(r.ref_audio))).encode())
    for rej in manifest.rejected:
        h.update(repr(rej).encode())
    fingerprint = h.hexdigest()
    if memo_path.is_file():
        try:
            memo = json.loads(memo_path.read_text(encoding="utf-8"))
            if memo.get("fingerprint") == fingerprint:
                return ValidationReport(
                    accepted=[AcceptedClip(manifest.records[i], d, c) for i, d, c in memo["accepted"]],
                    rejected=[Rejection(**r) for r in memo["rejected"]],
                    config=config,
                    warnings=[Rejection(**w) for w in memo["warnings"]],
                )
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            pass  # unreadable memo: validate again
    report = validate_clips(manifest.records, config, manifest_rejections=manifest.rejected)
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


class _BatchSamplerView(Sampler[list[int]]):
    """Hands a `LengthBucketBatchSampler` to a DataLoader. Lightning calls ``set_epoch`` on
    ``dataloader.batch_sampler.sampler`` at every epoch start, which is the bucket sampler here."""

    def __init__(self, sampler: LengthBucketBatchSampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class _ResumableDataLoader(DataLoader):
    """A DataLoader that tells Lightning it can resume mid-epoch. The position itself is saved by
    `SpeakerClipsDataModule.state_dict` (the train sampler's epoch and consumed batches), so these
    hold nothing; without them Lightning warns that a mid-epoch resume is unreliable."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


@dataclass
class _Plan:
    """What `prepare` decided before encoding: the report and the clips to train on."""

    report: ValidationReport
    speakers: list[str]
    clips: list[AcceptedClip]
    val_hashes: set[str]
    languages: dict[str, str]  # content hash -> language


class SpeakerClipsDataModule(LightningDataModule):
    """Clips of one or more speakers for fine-tuning a Qwen3-TTS Base model.

    Args:
        pretrained: the Qwen3-TTS 12 Hz Base directory or hub id (its speech tokenizer, speaker
            encoder and text tokenizer prepare the data).
        train_manifest: a Qwen3-TTS JSONL, an LJSpeech ``metadata.csv`` (or its folder), or a
            folder of clips with ``.txt`` transcripts (sub-folder = speaker).
        val_manifest: validation clips; when None, ``val_fraction`` of the training clips.
        val_fraction: share of training clips held out (seeded, stable; 0 for none).
        cache_dir: where prepared data live (default ``<manifest folder>/.tts_lightning_cache``).
        speakers: the speakers to train, in this order; default all speakers of the manifest,
            sorted. Each must have accepted clips.
        default_speaker: the speaker of entries that name none.
        language: overrides every clip's language ("auto", "english", ...).
        max_frames_per_batch: cap on padded talker positions per batch (batch size x the
            longest prefill + frames), which bounds activation memory.
        batch_size: cap on clips per batch (alone or with ``max_frames_per_batch``).
        num_workers: DataLoader worker processes.
        seed: the train/val split and the batch order.
        min_duration, max_duration: accepted clip durations, in seconds.
        manifest_encoding: text encoding of the manifests and transcript files (default UTF-8),
            e.g. "latin-1" or "cp1252".
        max_clipped_fraction: share of a clip's source samples at full scale (|x| >= 0.999)
            above which it counts as ``clipped``.
        clipped_action: "reject" clipped clips, or "flag" them (trained on, listed as warnings).
        max_rate_zscore: how far (robust z-score of the log rate, median/MAD) a clip's characters
            per second of speech may lie from its speaker's before it counts as
            ``transcript_mismatch``; rates outside 1-35 characters per second always do.
        mismatch_action: "reject" mismatched clips, or "flag" them.
        subtitle_target_seconds: a long recording with an ``.srt``/``.vtt`` beside it is cut at its
            cues; adjacent cues of one speaker are merged into clips of up to this many seconds.
        normalize: None, "peak" or "rms" loudness normalisation before encoding.
        trim_silence: trim leading/trailing silence before encoding.
        num_reference_clips: clips averaged for a speaker's embedding when its records give no
            ``ref_audio``.
        encode_batch_size: clips per speech-tokenizer call while preparing.
        prepare_device: device for the speech tokenizer and speaker encoder while preparing
            (default: cuda when available, else cpu).
    """

    def __init__(
        self,
        pretrained: str,
        train_manifest: str,
        val_manifest: str | None = None,
        val_fraction: float = 0.1,
        cache_dir: str | None = None,
        speakers: list[str] | None = None,
        default_speaker: str = "speaker",
        language: str | None = None,
        max_frames_per_batch: int | None = 2000,
        batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        min_duration: float = 0.5,
        max_duration: float = 30.0,
        manifest_encoding: str | None = None,
        max_clipped_fraction: float = 0.001,
        clipped_action: Literal["reject", "flag"] = "reject",
        max_rate_zscore: float = 3.5,
        mismatch_action: Literal["reject", "flag"] = "reject",
        subtitle_target_seconds: float = 10.0,
        normalize: Literal["peak", "rms"] | None = None,
        trim_silence: bool = False,
        num_reference_clips: int = 3,
        encode_batch_size: int = 8,
        prepare_device: str | None = None,
        predict_texts: list[str] | None = None,
        predict_texts_file: str | None = None,
        predict_speakers: list[str] | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if max_frames_per_batch is None and batch_size is None:
            raise ValueError("set max_frames_per_batch, batch_size, or both")
        if normalize not in (None, "peak", "rms"):
            raise ValueError(f"normalize must be None, 'peak' or 'rms', got {normalize!r}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self._validation_config(  # raises on a bad value now rather than in prepare
            min_duration, max_duration, max_clipped_fraction, clipped_action, max_rate_zscore, mismatch_action
        )
        if manifest_encoding is not None:
            try:
                codecs.lookup(manifest_encoding)
            except LookupError:
                raise ValueError(f"unknown manifest_encoding {manifest_encoding!r}") from None
        if speakers is not None:
            speakers = list(speakers)
            dupes = sorted(s for s, n in Counter(speakers).items() if n > 1)
            if not speakers or dupes:
                raise ValueError(f"speakers must be a non-empty list of distinct names, got {speakers}")
        # `speakers` is left out: the model carries the resolved list (linked from `speaker_names`),
        # and Lightning refuses two different values under one hparam name.
        self.save_hyperparameters(ignore=["speakers"])
        self.requested_speakers_arg = None if speakers is None else list(speakers)
        self._info: PretrainedInfo | None = None
        self._manifest_speakers: list[str] | None = None
        # Set by setup() from files only.
        self._index: dict | None = None
        self._speaker_table: Tensor | None = None
        self.train_dataset: SpeakerClipsDataset | None = None
        self.val_dataset: SpeakerClipsDataset | None = None
        self._collate: TalkerCollate | None = None
        # The report this instance last logged (JSON text): a repeat is not logged again.
        self._logged_report: str | None = None
        # Resume: the train sampler and a state loaded before it exists.
        self._train_sampler: LengthBucketBatchSampler | None = None
        self._pending_sampler_state: dict | None = None

    # -- paths and settings ----------------------------------------------------------------------

    @property
    def pretrained(self) -> str:
        """The pretrained directory or hub id, as given."""
        return self.hparams.pretrained

    @property
    def pretrained_info(self) -> PretrainedInfo:
        if self._info is None:
            self._info = check_pretrained(self.hparams.pretrained)
        return self._info

    @property
    def pretrained_dir(self) -> Path:
        return self.pretrained_info.path

    @property
    def cache_dir(self) -> Path:
        if self.hparams.cache_dir:
            return Path(self.hparams.cache_dir).expanduser().absolute()
        return default_cache_dir(self.hparams.train_manifest)

    @property
    def report_path(self) -> Path:
        return self.cache_dir / "report.json"

    @property
    def prepared_path(self) -> Path:
        return self.cache_dir / "prepared.json"

    def _settings(self) -> dict[str, Any]:
        """Everything prepared.json depends on; setup refuses an index written for other settings."""
        h = self.hparams

        def absolute(p):
            return None if p is None else str(Path(p).expanduser().absolute())

        return {
            "pretrained": str(self.pretrained_dir),
            "train_manifest": absolute(h.train_manifest),
            "val_manifest": absolute(h.val_manifest),
            "val_fraction": h.val_fraction,
            "seed": h.seed,
            "speakers": self.requested_speakers_arg,
            "default_speaker": h.default_speaker,
            "language": h.language,
            "min_duration": h.min_duration,
            "max_duration": h.max_duration,
            "manifest_encoding": h.manifest_encoding,
            "max_clipped_fraction": h.max_clipped_fraction,
            "clipped_action": h.clipped_action,
            "max_rate_zscore": h.max_rate_zscore,
            "mismatch_action": h.mismatch_action,
            "subtitle_target_seconds": h.subtitle_target_seconds,
            "normalize": h.normalize,
            "trim_silence": h.trim_silence,
            "num_reference_clips": h.num_reference_clips,
        }

    # -- speakers ---------------------------------------------------------------------------------

    @property
    def speaker_names(self) -> list[str]:
        """The run's speakers, index i = row i of `speaker_embeddings()`. Known before prepare:
        the ``speakers`` argument, else every speaker the training manifest names, sorted."""
        if self._index is not None:
            return [s["name"] for s in self._index["speakers"]]
        return self._requested_speakers()

    def _requested_speakers(self) -> list[str]:
        if self.requested_speakers_arg is not None:
            return list(self.requested_speakers_arg)
        if self._manifest_speakers is None:
            h = self.hparams
            records = load_manifest(h.train_manifest, h.default_speaker, h.manifest_encoding).records
            speakers = set()
            for r in records:
                speakers |= {r.speaker} if r.subtitles is None else subtitle_speakers(r, h.manifest_encoding)
            self._manifest_speakers = sorted(speakers)
        return list(self._manifest_speakers)

    def speaker_embeddings(self) -> Tensor:
        """(num_speakers, D) fp32, after `setup`."""
        if self._speaker_table is None:
            raise RuntimeError("speaker_embeddings() needs setup() first (and prepare_data() before it)")
        return self._speaker_table.clone()

    # -- prepare (one process) -------------------------------------------------------------------

    @staticmethod
    def _validation_config(
        min_duration, max_duration, max_clipped_fraction, clipped_action, max_rate_zscore, mismatch_action
    ) -> ValidationConfig:
        return ValidationConfig(
            min_duration=min_duration,
            max_duration=max_duration,
            max_clipped_fraction=max_clipped_fraction,
            clipped_action=clipped_action,
            max_rate_zscore=max_rate_zscore,
            mismatch_action=mismatch_action,
        )

    def prepare_data(self) -> None:
        """Lightning's hook (local rank 0 of each node). Alone: everything (`prepare`). In a run of
        several processes: validation and the report only; `setup` then encodes on every rank."""
        if self._distributed() is None:
            self.prepare()
        else:
            self._plan()

    def prepare(self, *, ray_workers: int = 0, ray_address: str = "local") -> ValidationReport:
        """Validate, encode, embed and index the data; return the validation report.

        Usable without a Trainer. ``ray_workers`` > 0 encodes the codes on that many Ray Data
        workers (`tts_lightning.data.ray_prepare`; a local Ray instance, or the cluster at
        ``ray_address``), with the same bytes. Raises ValueError when the training manifest has no
        usable clip (naming it and the main reasons) or a requested speaker has no accepted clip.
        """
        plan = self._plan()
        if ray_workers > 0:
            from tts_lightning.data.ray_prepare import encode_with_ray

            cache = self._codec_cache()
            cache.verify(plan.clips)
            encoded = encode_with_ray(
                cache,
                plan.clips,
                num_workers=ray_workers,
                batch_size=self.hparams.encode_batch_size,
                address=ray_address,
            )
            rank_zero_info(
                f"codec cache: {encoded} clip(s) encoded on {ray_workers} Ray worker(s), "
                f"{len(plan.clips) - encoded} already cached ({self.cache_dir})"
            )
        else:
            self._encode(plan.clips)
        self._write_index(plan)
        return plan.report

    def _distributed(self) -> tuple[int, int, bool] | None:
        """(world size, global rank, whether this rank finishes the index) when the attached
        trainer runs several processes, else None. The finishing rank is the one that ran
        ``prepare_data``: local rank 0 of each node (global rank 0 without ``prepare_data_per_node``)."""
        trainer = self.trainer
        if trainer is None or int(trainer.world_size) <= 1:
            return None
        rank = int(trainer.global_rank)
        finisher = int(trainer.local_rank) == 0 if self.prepare_data_per_node else rank == 0
        return int(trainer.world_size), rank, finisher

    def _prepare_on_all_ranks(self, world: int, rank: int, finisher: bool) -> None:
        """The codec encoding of `prepare`, split over the ranks of a run (called by `setup` on
        every rank after ``prepare_data`` validated the data). Each rank encodes every
        ``world``-th clip (sorted by duration, so the shares are even) into the cache, with the same
        bytes a single process writes; after a barrier the finishing rank encodes whatever it still
        cannot see (nothing when ``cache_dir`` is shared storage; the other nodes' shares when each
        node has its own disk), computes the speaker embeddings and writes the index; all ranks
        wait for it. Only the strategy's own ``barrier`` is used (no tensors, any backend)."""
        strategy = self.trainer.strategy
        plan = self._plan(report_it=False)  # the same plan on every rank: validation is memoised on disk
        ordered = sorted(plan.clips, key=lambda c: (c.duration, c.content_hash))
        device = self.hparams.prepare_device or str(strategy.root_device)
        self._encode(ordered[rank::world], device=device, log=f"rank {rank}/{world}: ")
        strategy.barrier("tts_lightning.prepare.encoded")
        if finisher:
            self._encode(plan.clips, device=device)
            self._write_index(plan)
        strategy.barrier("tts_lightning.prepare.indexed")

    def _plan(self, *, report_it: bool = True) -> _Plan:
        """Read the manifests, validate (memoised), and choose the clips, speakers, split and
        languages; write and show the report when ``report_it``. Raises as `prepare` says."""
        h = self.hparams
        info = self.pretrained_info
        ids = SpecialIds.from_config(info.config)
        config = self._validation_config(
            h.min_duration,
            h.max_duration,
            h.max_clipped_fraction,
            h.clipped_action,
            h.max_rate_zscore,
            h.mismatch_action,
        )
        cache = self._codec_cache()

        train_manifest, segments = self._read_manifest(h.train_manifest)
        train = validate_with_memo(train_manifest, config, self._validation_memo(h.train_manifest))
        val: ValidationReport | None = None
        if h.val_manifest is not None:
            val_manifest, val_segments = self._read_manifest(h.val_manifest)
            segments += val_segments
            val = validate_with_memo(val_manifest, config, self._validation_memo(h.val_manifest))
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
                self._reject_bad_codes(rep, cache)

        report = ValidationReport(
            accepted=train.accepted + (val.accepted if val else []),
            rejected=train.rejected + (val.rejected if val else []),
            config=config,
            warnings=train.warnings + (val.warnings if val else []),
            segments=[asdict(s) for s in segments],
        )
        if report_it:
            self._write_and_log_report(report)
        train.raise_if_empty(h.train_manifest)
        if val is not None:
            val.raise_if_empty(h.val_manifest)

        # Speakers: all the manifest names (sorted) or the ones asked for; each needs clips.
        found = sorted({c.record.speaker for c in train.accepted})
        speakers = self._requested_speakers()
        missing = [s for s in speakers if s not in found]
        if missing:
            why = (
                "not found among the accepted training clips"
                if self.requested_speakers_arg is not None
                else "named by the manifest, but all of its clips were rejected"
            )
            raise ValueError(
                f"speaker(s) {', '.join(map(repr, missing))} {why} of {h.train_manifest} "
                f"(speakers with accepted clips: {', '.join(found) or 'none'}; see {self.report_path})"
            )
        chosen = set(speakers)

        def select(clips: list[AcceptedClip]) -> list[AcceptedClip]:
            return [c for c in clips if c.record.speaker in chosen]

        train_clips = select(train.accepted)
        if val is not None:
            val_clips = select(val.accepted)
            if not val_clips:
                raise ValueError(f"{h.val_manifest}: no accepted clip of speakers {speakers}")
            val_hashes = {c.content_hash for c in val_clips}
            clips = train_clips + val_clips
        else:
            val_hashes = split_validation(train_clips, h.val_fraction, h.seed)
            clips = train_clips
        skipped = len(train.accepted) + (len(val.accepted) if val else 0) - len(clips)
        if skipped and report_it:
            rank_zero_info(f"{skipped} accepted clip(s) of other speakers are not used (speakers={speakers})")

        languages = {}
        for c in clips:
            lang = h.language or c.record.language
            try:
                ids.language_id(lang)
            except ValueError as exc:
                raise ValueError(f"{c.record.source}: {exc}") from None
            languages[c.content_hash] = lang
        return _Plan(report, speakers, clips, val_hashes, languages)

    def _codec_cache(self, device: str | None = None) -> CodecCache:
        h = self.hparams
        return CodecCache(
            self.cache_dir,
            self.pretrained_info,
            normalize=h.normalize,
            trim_silence=h.trim_silence,
            device=device or h.prepare_device,
        )

    def _encode(self, clips: list[AcceptedClip], *, device: str | None = None, log: str = "") -> int:
        """Encode the codes of ``clips`` that are not cached yet; return how many were encoded."""
        h = self.hparams
        cache = self._codec_cache(device)
        progress = EncodeProgress(f"{log}encoded")
        cache.verify(clips)  # a truncated or malformed cache file is removed (warning) and encoded again
        encoded = cache.encode_missing(clips, batch_size=h.encode_batch_size, progress=progress)
        cache.release()
        rank_zero_info(
            f"{log}codec cache: {encoded} clip(s) encoded, {len(clips) - encoded} already cached ({self.cache_dir})"
        )
        return encoded

    def _write_index(self, plan: _Plan) -> None:
        """Speaker embeddings and prepared.json (the clips' codes must all be cached)."""
        h = self.hparams
        info = self.pretrained_info
        cache_dir = self.cache_dir
        cache = self._codec_cache()
        clips, speakers, val_hashes, languages = plan.clips, plan.speakers, plan.val_hashes, plan.languages
        references = select_references(clips, speakers, h.num_reference_clips)
        table = compute_speaker_table(
            cache_dir,
            info,
            references,
            normalize=h.normalize,
            trim_silence=h.trim_silence,
            device=h.prepare_device or "cpu",
        )

        index = {
            "version": PREPARED_VERSION,
            "settings": self._settings(),
            "tokenizer_id": cache.tokenizer_id,
            "speaker_table": table.path.relative_to(cache_dir).as_posix(),
            "speakers": [
                {"name": n, "key": k, "references": [str(r.path) for r in references[n]]}
                for n, k in zip(table.names, table.keys)
            ],
            "clips": [],
        }
        for c in clips:
            codes_rel = cache.relative_path(c)
            frames = int(load_codes_shape(cache_dir / codes_rel)[0])
            index["clips"].append(
                {
                    "audio": str(c.record.audio),
                    "source": c.record.source,
                    "content_hash": c.content_hash,
                    "text": c.record.text,
                    "speaker": c.record.speaker,
                    "language": languages[c.content_hash],
                    "duration": round(c.duration, 4),
                    "frames": frames,
                    "codes": codes_rel,
                    "split": "val" if c.content_hash in val_hashes else "train",
                }
            )
        atomic_write_json(self.prepared_path, index)
        self._index = None  # a later setup() reads the new index
        n_val = sum(1 for e in index["clips"] if e["split"] == "val")
        rank_zero_info(
            f"prepared {len(clips)} clips ({len(clips) - n_val} train, {n_val} val) of "
            f"{len(speakers)} speaker(s) in {self.prepared_path}"
        )

    def _read_manifest(self, path: str) -> tuple[ManifestResult, list]:
        """The manifest's records, long subtitled recordings cut into clips (cached in
        ``<cache_dir>/segments``), and the segments cut."""
        h = self.hparams
        manifest = load_manifest(path, h.default_speaker, h.manifest_encoding)
        return cut_subtitled(
            manifest,
            self.cache_dir / "segments",
            target_seconds=h.subtitle_target_seconds,
            encoding=h.manifest_encoding,
        )

    def _write_and_log_report(self, report: ValidationReport) -> None:
        """Write report.json and show the report once: in full when it is new; as one line when
        report.json already held the same report (shown when it was written, e.g. by `prepare` or
        another process); not at all when this instance already showed it (``prepare()`` and then
        ``trainer.fit``, whose ``prepare_data`` prepares again)."""
        text = json.dumps(report.to_dict(), sort_keys=True)
        if text == self._logged_report:
            report.write_json(self.report_path)
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

    def _validation_memo(self, manifest: str) -> Path:
        name = hashlib.sha256(str(Path(manifest).expanduser().absolute()).encode()).hexdigest()[:16]
        return self.cache_dir / "validation" / f"{name}.json"

    @staticmethod
    def _reject_bad_codes(report: ValidationReport, cache: CodecCache) -> None:
        kept = []
        for c in report.accepted:
            problem = cache.check_given_codes(c)
            if problem is None:
                kept.append(c)
            else:
                report.rejected.append(Rejection(c.record.source, str(c.record.audio), "malformed_entry", problem))
        report.accepted = kept

    # -- setup (every process; files only) ----------------------------------------------------

    def read_index(self) -> dict:
        """prepared.json, checked against this data module's settings."""
        path = self.prepared_path
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: run prepare_data() (or `tts-lightning prepare`) before setup()")
        index = json.loads(path.read_text(encoding="utf-8"))
        if index.get("version") != PREPARED_VERSION:
            raise RuntimeError(
                f"{path} has format version {index.get('version')}, expected {PREPARED_VERSION}; run prepare again"
            )
        ours, theirs = self._settings(), index.get("settings", {})
        diff = [f"{k}: {theirs.get(k)!r} there, {v!r} here" for k, v in ours.items() if theirs.get(k) != v]
        if diff:
            raise RuntimeError(f"{path} was prepared with other settings ({'; '.join(diff)}); run prepare again")
        return index

    def setup(self, stage: str | None = None) -> None:
        if self._index is not None:
            return
        distributed = self._distributed()
        if distributed is not None:
            self._prepare_on_all_ranks(*distributed)
        index = self.read_index()
        cache_dir = self.cache_dir
        info = self.pretrained_info
        ids = SpecialIds.from_config(info.config)
        names = [s["name"] for s in index["speakers"]]
        table = load_speaker_table(cache_dir / index["speaker_table"], names, [s["key"] for s in index["speakers"]])
        tokenizer = load_text_tokenizer(info)
        speaker_index = {n: i for i, n in enumerate(names)}
        splits: dict[str, list[PreparedItem]] = {"train": [], "val": []}
        for e in index["clips"]:
            codes = cache_dir / e["codes"]
            if not codes.is_file():
                raise FileNotFoundError(f"{codes} (codes of {e['audio']}) is missing; run prepare again")
            splits[e["split"]].append(
                PreparedItem(
                    text_ids=tuple(tokenize_text(tokenizer, e["text"])),
                    codes=codes,
                    frames=int(e["frames"]),
                    speaker_index=speaker_index[e["speaker"]],
                    language=e["language"],
                    key=e["audio"],
                )
            )
        self.train_dataset = SpeakerClipsDataset(splits["train"], ids)
        self.val_dataset = SpeakerClipsDataset(splits["val"], ids)
        self._speaker_table = table.embeddings
        self._collate = TalkerCollate(table.embeddings, ids.tts_pad)
        self._index = index

    def _require_setup(self) -> None:
        if self._index is None:
            raise RuntimeError("call setup() first (after prepare_data())")

    # -- loaders ------------------------------------------------------------------------------

    def _replicas(self) -> tuple[int, int]:
        """(world size, rank) from the attached trainer, else (1, 0)."""
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        world, rank = int(trainer.world_size), int(trainer.global_rank)
        connector = getattr(trainer, "_accelerator_connector", None)
        if world > 1 and getattr(connector, "use_distributed_sampler", False):
            # The bucket sampler deals batches to ranks itself; Lightning would otherwise try to
            # inject a DistributedSampler into it, which it cannot take.
            connector.use_distributed_sampler = False
            rank_zero_info(
                "SpeakerClipsDataModule shards its length-bucketed batches across ranks itself: "
                "Trainer(use_distributed_sampler=...) is set to False"
            )
        return world, rank

    def _sampler(self, dataset: SpeakerClipsDataset, *, shuffle: bool) -> LengthBucketBatchSampler:
        world, rank = self._replicas()
        return LengthBucketBatchSampler(
            dataset.lengths(),
            max_frames=self.hparams.max_frames_per_batch,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            seed=self.hparams.seed,
            num_replicas=world,
            rank=rank,
        )

    def _loader(self, dataset: SpeakerClipsDataset, sampler: LengthBucketBatchSampler) -> DataLoader:
        workers = int(self.hparams.num_workers)
        return _ResumableDataLoader(
            dataset,
            batch_sampler=_BatchSamplerView(sampler),
            collate_fn=self._collate,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        self._require_setup()
        assert self.train_dataset is not None
        if len(self.train_dataset) == 0:
            raise RuntimeError("no training clips (all clips went to validation?)")
        sampler = self._sampler(self.train_dataset, shuffle=True)
        if self.trainer is not None:
            sampler.set_epoch(int(self.trainer.current_epoch))
        if self._pending_sampler_state is not None:
            sampler.load_state_dict(self._pending_sampler_state)
            self._pending_sampler_state = None
        self._train_sampler = sampler
        return self._loader(self.train_dataset, sampler)

    def val_dataloader(self) -> DataLoader | list:
        self._require_setup()
        assert self.val_dataset is not None
        if len(self.val_dataset) == 0:
            return []  # no validation set: Lightning skips validation
        sampler = self._sampler(self.val_dataset, shuffle=False)
        return self._loader(self.val_dataset, sampler)

    def predict_dataloader(self) -> DataLoader:
        """``predict_texts`` and the lines of ``predict_texts_file``, each spoken by every speaker of
        ``predict_speakers`` (default: all the run's speakers) in the speaker's training language
        (or ``language``). Sharded here, the same number of items on every rank (padding repeats are
        not written): under FSDP all ranks generate in lockstep."""
        from tts_lightning.data.predict import TextsDataset, collate_texts, read_texts, speaker_languages

        self._require_setup()
        h = self.hparams
        speakers = list(h.predict_speakers or self.speaker_names)
        unknown = sorted(set(speakers) - set(self.speaker_names))
        if unknown:
            raise ValueError(f"predict_speakers {unknown} are not speakers of this run {self.speaker_names}")
        world, rank = self._replicas()
        dataset = TextsDataset(
            read_texts(h.predict_texts, h.predict_texts_file),
            speakers,
            languages=h.language or speaker_languages(self._index),
            num_replicas=world,
            rank=rank,
        )
        return DataLoader(dataset, batch_size=h.batch_size or 8, collate_fn=collate_texts)

    # -- resume ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The train sampler's position (epoch + batches consumed), saved in every checkpoint."""
        if self._train_sampler is None:
            return {"train_sampler": self._pending_sampler_state} if self._pending_sampler_state else {}
        state = self._train_sampler.state_dict()
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            # The loader runs ahead of training (prefetch, workers): count what training consumed.
            processed = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
            state["consumed"] = min(int(state["consumed"]), processed)
        return {"train_sampler": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("train_sampler")
        if not state:
            return
        if self._train_sampler is not None:
            self._train_sampler.load_state_dict(state)
        else:
            self._pending_sampler_state = dict(state)


def load_codes_shape(path: Path) -> tuple[int, ...]:
    """The shape of a cached ``.npy`` codes file, from its header alone."""
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, _ = read(fh)
    return tuple(shape)
