"""`SpeakerClipsDataModule`: speaker clips on disk -> length-bucketed `TalkerBatch`es.

``prepare_data`` (one process per node) does all the slow, write-once work through `prepare`
(`tts_lightning.data.prepare.DataPreparer`): read the manifests, validate every clip
(``report.json``), encode missing codes into the codec cache, compute the speaker embeddings, and
write ``prepared.json``, the index of what to train on (the cache folder's layout is described
there). ``setup`` (every process) reads those files, never attributes set by ``prepare_data``, so
it works in any process, and a fresh instance can ``setup`` from a cache prepared earlier.

In a run of several processes ``prepare_data`` only reads the manifests (cutting subtitled
recordings); ``setup`` then splits the work that reads every clip over the ranks
(`DataPreparer.prepare_on_all_ranks`) among the ranks that see the same cache folder (all of them
on shared storage, each node's on per-node disks): each rank checks its share of the audio files,
the first of them validates with those checks and writes the report; each rank encodes its share of
the codes and embeds its share of the speakers, and the first writes the index. The files are the
bytes one process writes.

The module deals its length-bucketed batches to the ranks itself, so a run of several processes
needs ``Trainer(use_distributed_sampler=False)`` (the ``tts-lightning`` CLI's default); with the
flag left on, ``setup`` and the dataloader hooks raise an error that says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.utils.data import DataLoader

from tts_lightning.data.batching import BatchSamplerView, LengthBucketBatchSampler, ResumableDataLoader
from tts_lightning.data.dataset import PreparedItem, SpeakerClipsDataset, TalkerCollate
from tts_lightning.data.prepare import DataPreparer, PreparedIndex, PrepareSettings
from tts_lightning.data.prepare_ranks import prepare_with_strategy, rank_device  # noqa: F401 (rank_device: its old home)
from tts_lightning.data.references import choose_references, generation_layout, references
from tts_lightning.data.replay import mixed_records, replay_items
from tts_lightning.data.speakers import load_speaker_table
from tts_lightning.data.validation import ValidationReport
from tts_lightning.model.custom_voice import is_custom_voice, speaker_codec_ids, spoken_language, tokenize_instructs
from tts_lightning.model.layouts import Reference, SequenceLayout, check_custom_voice_layout
from tts_lightning.model.pretrained import PretrainedInfo, load_text_tokenizer
from tts_lightning.model.sequence import SpecialIds, tokenize_texts
from tts_lightning.names import some_names, unknown_names


class DistributedSamplerError(RuntimeError):
    """A run of several processes whose Trainer would inject a DistributedSampler."""


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
        layout: the sequence layout trained: "xvector" (speaker embedding only) or "icl" (also another
            clip of the speaker, codes and transcript, in the prompt); see `tts_lightning.model.layouts`.
            From a custom_voice model "xvector" only (its speaker is a codec row; no ICL there).
        streaming: train the streaming layout (text fed alongside the frames, `generate_voice_clone`'s
            default; ``generate_custom_voice(non_streaming_mode=False)``) instead of the non-streaming one.
        replay_fraction: from a custom_voice model, this share of the training records (0: off) is the
            starting model's own speech of ``replay_texts`` by each built-in speaker, against
            forgetting; validation logs ``val/replay_loss`` on them (`tts_lightning.data.replay`).
        replay_texts, replay_texts_file: the texts replayed (default the shipped list).
        replay_max_new_tokens: cap on the frames of each replay record.
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
            cues; adjacent cues of one speaker are merged into clips of up to this many seconds
            (and never past ``max_duration``; a longer cue is rejected, not cut).
        normalize: None, "peak" or "rms" loudness normalisation before encoding.
        trim_silence: trim leading/trailing silence before encoding.
        num_reference_clips: clips averaged for a speaker's embedding, the first by path of the
            ``ref_audio`` files its records name, else of its clips.
        encode_batch_size: clips per speech-tokenizer call while preparing.
        encode_batch_seconds: and seconds of audio per call at most (the encoder's activations
            grow with them: about 0.026 GiB a second in fp32 at the released tokenizer's size,
            measured on CPU; 8 clips of 30 s would take ~6 GiB).
        prepare_device: device for the speech tokenizer and speaker encoder while preparing
            (default: cuda when available, else cpu). In a run of several processes on GPUs, a
            CUDA device means each rank's own GPU (see `rank_device`).

    The signature is long on purpose: LightningCLI reads it, and each argument is one flat key
    under ``data:`` that configs and the README use; the preparation ones become a
    `PrepareSettings`, built (and checked) in one place.
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
        encode_batch_seconds: float = 80.0,
        prepare_device: str | None = None,
        predict_texts: list[str] | None = None,
        predict_texts_file: str | None = None,
        predict_speakers: list[str] | None = None,
        layout: Literal["xvector", "icl"] = "xvector",
        streaming: bool = False,
        replay_fraction: float = 0.0,
        replay_texts: list[str] | None = None,
        replay_texts_file: str | None = None,
        replay_max_new_tokens: int = 256,
    ) -> None:
        super().__init__()
        self.layout = SequenceLayout(layout, streaming)  # refuses a layout not proven
        if max_frames_per_batch is None and batch_size is None:
            raise ValueError("set max_frames_per_batch, batch_size, or both")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        # `speakers` is left out: the model carries the resolved list (linked from `speaker_names`),
        # and Lightning refuses two different values under one hparam name.
        self.save_hyperparameters(ignore=["speakers"])
        # The preparation arguments, typed and checked; `hparams` keeps them for checkpoints and the saved config.
        self.settings = PrepareSettings.from_arguments({**self.hparams, "speakers": speakers})
        self.max_frames_per_batch = max_frames_per_batch
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.predict_texts = None if predict_texts is None else list(predict_texts)
        self.predict_texts_file = predict_texts_file
        self.predict_speakers = None if predict_speakers is None else list(predict_speakers)
        self.preparer = DataPreparer(self.settings)
        self.preparer.check_replay()  # before any process starts
        if not self.layout.is_default and is_custom_voice(self.pretrained_info.config):
            check_custom_voice_layout(self.layout, self.pretrained_info.path)  # ICL is not offered there
        # Set by setup() from files only.
        self._index: PreparedIndex | None = None
        self._speaker_table: Tensor | None = None
        self.train_dataset: SpeakerClipsDataset | None = None
        self.val_dataset: SpeakerClipsDataset | None = None
        self.replay_dataset: SpeakerClipsDataset | None = None  # replay on: its records, validated once each
        self._collate: TalkerCollate | None = None
        # Resume: the train sampler and a state loaded before it exists.
        self._train_sampler: LengthBucketBatchSampler | None = None
        self._pending_sampler_state: dict[str, Any] | None = None

    # -- paths and settings ----------------------------------------------------------------------

    @property
    def pretrained(self) -> str:
        """The pretrained directory or hub id, as given."""
        return self.settings.pretrained

    @property
    def pretrained_info(self) -> PretrainedInfo:
        return self.preparer.info

    @property
    def pretrained_dir(self) -> Path:
        return self.pretrained_info.path

    @property
    def cache_dir(self) -> Path:
        return self.preparer.cache_dir

    @property
    def report_path(self) -> Path:
        return self.preparer.report_path

    @property
    def prepared_path(self) -> Path:
        return self.preparer.prepared_path

    # -- speakers ---------------------------------------------------------------------------------

    @property
    def speaker_names(self) -> list[str]:
        """The run's speakers, index i = row i of `speaker_embeddings()`. Known before prepare:
        the ``speakers`` argument, else every speaker the training manifest names, sorted."""
        if self._index is not None:
            return self._index.speaker_names
        return self.preparer.requested_speakers()

    def speaker_embeddings(self) -> Tensor:
        """(num_speakers, D) fp32, after `setup`."""
        if self._speaker_table is None:
            raise RuntimeError("speaker_embeddings() needs setup() first (and prepare_data() before it)")
        return self._speaker_table.clone()

    # -- prepare (one process) -------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Lightning's hook (local rank 0 of each node). Alone: everything (`prepare`). In a run of
        several processes: the manifests only (subtitled recordings are cut here, once per node);
        `setup` then validates, encodes and embeds on every rank."""
        if self._distributed() is None:
            self.prepare()
        else:
            self.preparer.read_manifests()

    def prepare(
        self, *, ray_workers: int = 0, ray_address: str = "local", show_report: bool = True
    ) -> ValidationReport:
        """Validate, encode, embed and index the data; return the validation report
        (`DataPreparer.prepare`, which also gives the typed index: ``data.preparer.prepare()``).

        Usable without a Trainer. ``ray_workers`` > 0 encodes the codes on that many Ray Data
        workers (`tts_lightning.data.ray_prepare`; a local Ray instance, or the cluster at
        ``ray_address``), with the same bytes. ``show_report=False``: the caller shows the report
        (report.json is written all the same). Raises ValueError when the training manifest has no
        usable clip (naming it and the main reasons) or a requested speaker has no accepted clip.
        """
        prepared = self.preparer.prepare(ray_workers=ray_workers, ray_address=ray_address, show_report=show_report)
        self._index = None  # a later setup() reads the new index
        if self.layout.needs_reference:  # what `setup` refuses, said by `tts-lightning prepare` too
            choose_references(prepared.index.clips, self.seed)
        return prepared.report

    def _distributed(self) -> tuple[int, int] | None:
        """(world size, global rank) when the attached trainer runs several processes, else None."""
        trainer = self.trainer
        if trainer is None or int(trainer.world_size) <= 1:
            return None
        return int(trainer.world_size), int(trainer.global_rank)

    # -- setup (every process; files only) ----------------------------------------------------

    def read_index(self) -> dict[str, Any]:
        """prepared.json as JSON, checked against this data module's settings (for readers of the
        file's JSON; `read_prepared` gives it typed)."""
        return self.preparer.read_index_json()

    def read_prepared(self) -> PreparedIndex:
        """prepared.json, typed, checked against this data module's settings."""
        return self.preparer.read_index()

    @property
    def prepared_index(self) -> PreparedIndex:
        """The index `setup` read."""
        self._require_setup()
        assert self._index is not None
        return self._index

    def setup(self, stage: str | None = None) -> None:
        if self._index is not None:
            return
        distributed = self._distributed()
        if distributed is not None:
            self._check_sampler_flag(distributed[0])
            assert self.trainer is not None
            prepare_with_strategy(self.preparer, self.trainer.strategy, *distributed)
        index = self.read_prepared()
        cache_dir = self.cache_dir
        info = self.pretrained_info
        ids = SpecialIds.from_config(info.config)
        names = index.speaker_names
        table = load_speaker_table(cache_dir / index.speaker_table, names, [s.key for s in index.speakers])
        tokenizer = load_text_tokenizer(info)
        speaker_index = {n: i for i, n in enumerate(names)}
        splits: dict[str, list[PreparedItem]] = {"train": [], "val": []}
        text_ids = tokenize_texts(tokenizer, [e.text for e in index.clips])
        instruct_ids = tokenize_instructs(tokenizer, [e.instruct for e in index.clips])
        talker = info.config["talker_config"]
        # From a custom_voice model each speaker is a codec-embedding row (tts_lightning.model.custom_voice).
        codec_ids = speaker_codec_ids(talker, names) if is_custom_voice(info.config) else None
        refs: list[Reference | None] = [None] * len(index.clips)
        if self.layout.needs_reference:
            refs = list(references(index.clips, cache_dir, tokenizer, self.seed))
        for e, tokens, ref, instruct in zip(index.clips, text_ids, refs, instruct_ids):
            codes = cache_dir / e.codes
            if not codes.is_file():
                raise FileNotFoundError(f"{codes} (codes of {e.audio}) is missing; run prepare again")
            splits[e.split].append(
                PreparedItem(
                    text_ids=tuple(tokens),
                    codes=codes,
                    frames=e.frames,
                    speaker_index=speaker_index[e.speaker],
                    language=e.language if codec_ids is None else spoken_language(talker, e.speaker, e.language),
                    key=e.audio,
                    reference=ref,
                    instruct_ids=instruct,
                )
            )
        rows = table.embeddings
        if self.settings.replay_fraction > 0:  # after the clips: the default's datasets are unchanged
            assert codec_ids is not None  # prepare refused replay from a base model
            added, replay = replay_items(self.preparer, tokenizer, names)
            codec_ids += added
            rows = torch.cat([rows, torch.zeros(len(added), rows.shape[1])])  # unused: the slot is the codec row
            splits["train"] += mixed_records(replay, len(splits["train"]), self.settings.replay_fraction)
            self.replay_dataset = SpeakerClipsDataset(replay, ids, speaker_codec_ids=codec_ids)
        self.train_dataset = SpeakerClipsDataset(splits["train"], ids, layout=self.layout, speaker_codec_ids=codec_ids)
        self.val_dataset = SpeakerClipsDataset(splits["val"], ids, layout=self.layout, speaker_codec_ids=codec_ids)
        self._speaker_table = table.embeddings
        self._collate = TalkerCollate(rows, ids.tts_pad)
        self._index = index

    def _require_setup(self) -> None:
        if self._index is None:
            raise RuntimeError("call setup() first (after prepare_data())")

    # -- loaders ------------------------------------------------------------------------------

    def _check_sampler_flag(self, world: int) -> None:
        """Refuse a run of several processes whose Trainer would inject a DistributedSampler: the
        bucket sampler deals batches to the ranks itself (read only; Lightning has no public getter)."""
        connector = getattr(self.trainer, "_accelerator_connector", None)
        if getattr(connector, "use_distributed_sampler", False):
            raise DistributedSamplerError(
                f"SpeakerClipsDataModule deals its length-bucketed batches to the {world} ranks itself: build the "
                "Trainer with use_distributed_sampler=False (L.Trainer(..., use_distributed_sampler=False); "
                "`trainer: {use_distributed_sampler: false}` in a config; the tts-lightning CLI's default)"
            )

    def _replicas(self) -> tuple[int, int]:
        """(world size, rank) from the attached trainer, else (1, 0)."""
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        world, rank = int(trainer.world_size), int(trainer.global_rank)
        if world > 1:
            self._check_sampler_flag(world)
        return world, rank

    def _sampler(self, dataset: SpeakerClipsDataset, *, shuffle: bool) -> LengthBucketBatchSampler:
        world, rank = self._replicas()
        return LengthBucketBatchSampler(
            dataset.lengths(),
            max_frames=self.max_frames_per_batch,
            batch_size=self.batch_size,
            shuffle=shuffle,
            seed=self.seed,
            num_replicas=world,
            rank=rank,
        )

    def _loader(self, dataset: SpeakerClipsDataset, sampler: LengthBucketBatchSampler) -> DataLoader:
        workers = int(self.num_workers)
        return ResumableDataLoader(
            dataset,
            batch_sampler=BatchSamplerView(sampler),
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
        loader = self._loader(self.val_dataset, self._sampler(self.val_dataset, shuffle=False))
        if self.replay_dataset is None or len(self.replay_dataset) == 0:
            return loader
        # The second loader: `Qwen3TTSModule.validation_step` logs its loss as val/replay_loss.
        return [loader, self._loader(self.replay_dataset, self._sampler(self.replay_dataset, shuffle=False))]

    def predict_dataloader(self) -> DataLoader:
        """``predict_texts`` and the lines of ``predict_texts_file``, each spoken by every speaker of
        ``predict_speakers`` (default: all the run's speakers) in the speaker's training language
        (or ``language``). Sharded here, the same number of items on every rank (padding repeats are
        not written): under FSDP all ranks generate in lockstep."""
        from tts_lightning.data.predict import TextsDataset, collate_texts, read_texts, speaker_languages

        index = self.prepared_index
        speakers = list(self.predict_speakers or self.speaker_names)
        unknown = sorted(set(speakers) - set(self.speaker_names))
        if unknown:
            raise ValueError(
                f"predict_speakers {unknown_names(unknown, self.speaker_names)} are not speakers of this run "
                f"({some_names(self.speaker_names)})"
            )
        world, rank = self._replicas()
        layout, references = generation_layout(self, speakers)  # spoken in the layout trained
        dataset = TextsDataset(
            read_texts(self.predict_texts, self.predict_texts_file),
            speakers,
            languages=self.settings.language or speaker_languages(index.to_json()),
            num_replicas=world,
            rank=rank,
            layout=layout,
            references=references,
        )
        return DataLoader(dataset, batch_size=self.batch_size or 8, collate_fn=collate_texts)

    # -- resume ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The train sampler's position (epoch + batches consumed), saved in every checkpoint."""
        if self._train_sampler is None:
            return {"train_sampler": self._pending_sampler_state} if self._pending_sampler_state else {}
        state = self._train_sampler.state_dict()
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            # The loader runs ahead of training (prefetch, workers): count what training consumed.
            current = trainer.fit_loop.epoch_loop.batch_progress.current  # a _ProcessedTracker, typed as its base
            processed = int(getattr(current, "processed", current.completed))
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
