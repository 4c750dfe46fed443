"""`Qwen3TTSModule`: the LightningModule that fine-tunes a Qwen3-TTS Base model on new voices."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from tts_lightning.distributed.step_collectives import all_reduce_in_step
from tts_lightning.errors import ConfigError
from tts_lightning.hparams import HParam
from tts_lightning.model.custom_voice import (
    CODEC_EMBEDDING_KEY,
    TRAINABLE_TYPES,
    custom_voice_speakers,
    initial_rows,
    spoken_languages,
    without_decay_of_codec_embedding,
)
from tts_lightning.model.generation import (
    SAMPLE_RATE,
    PredictBatch,
    decode_codes,
    generate_codes,
    generation_defaults,
)
from tts_lightning.model.layouts import reference_prompt_ids
from tts_lightning.model.loading import MetaWeights, build_empty_model
from tts_lightning.model.lora import LoRASettings, checkpoint_key, inject_lora, is_adapter_key
from tts_lightning.model.loss import LossOutput, compute_loss
from tts_lightning.model.optimizers import OptimizerName, build_optimizer, check_optimizer, weights_dtype
from tts_lightning.model.parameters import DEFAULT_FREEZE as _DEFAULT_FREEZE
from tts_lightning.model.parameters import matches as _matches
from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer, load_text_tokenizer
from tts_lightning.model.row_blocks import DEFAULT_TEXT_EMBEDDING_BLOCKS, check_blocks, split_text_embedding
from tts_lightning.model.sequence import IGNORE_INDEX, TalkerBatch, tokenize_text
from tts_lightning.model.train_accuracy import CodebookEpochValue, EpochAccuracy, TrainAccuracyLogging
from tts_lightning.names import some_names, unknown_names


@dataclass(frozen=True)
class PredictTools:
    """What `Qwen3TTSModule.predict_step` loads on first use: the text and speech tokenizers and the
    pretrained directory's sampling settings (``generation_config.json``)."""

    text_tokenizer: Any
    speech_tokenizer: Any
    generation: dict[str, Any]


# Lightning suggests sync_dist for epoch values logged without it; the training losses are reduced
# over ranks already, at every step (`Qwen3TTSModule._shared_step`).
warnings.filterwarnings(
    "ignore",
    message=r"It is recommended to use `self.log\('train/(loss|talker_loss|code_predictor_loss)'",
    category=PossibleUserWarning,
)


# `Qwen3TTSModule.load_from_checkpoint` reads a sharded checkpoint's tensors in groups of this many
# bytes: the 1.7B's fp32 state is 7.2 GiB, held once (the model) plus one group, not twice.
LOAD_BYTES = 2**28


class Qwen3TTSModule(TrainAccuracyLogging):
    """Talker + code-predictor fine-tuning with the loss of `tts_lightning.model.loss`.

    Args:
        pretrained: a Qwen3-TTS 12 Hz *Base* or *CustomVoice* directory or hub id (the tiny models
            work too). From a CustomVoice model its speakers are kept, and a speaker of ``speakers``
            named like one of them trains that speaker (`tts_lightning.model.custom_voice`).
        speakers: the run's speaker names, in the order of the data module's speaker indices.
        learning_rate: peak AdamW learning rate. Low rates keep the base model's speaker
            similarity; watch ``val/speaker_similarity`` to pick a checkpoint.
        weight_decay: AdamW decoupled weight decay.
        warmup_steps: linear warm-up from 0, in optimizer steps.
        warmup_ratio: the warm-up as a fraction of the run's optimizer steps (Lightning's
            ``estimated_stepping_batches``, rounded up), used when ``warmup_steps`` is 0, as Hugging
            Face's ``warmup_ratio``: it scales with the data, where a fixed count can outlast a
            short run.
        lr_schedule: ``constant`` after warm-up, or ``cosine`` decay to zero at the last step
            (transformers' ``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup``).
        sub_talker_loss_weight: weight of the code-predictor loss (0.3 as upstream).
        freeze: parameter-name patterns kept fixed (module prefixes or globs), e.g.
            ``talker.model.text_embedding`` to save the memory of its gradient and optimizer state.
        attn_implementation: ``sdpa`` (default) or ``eager``; flash-attn is never required.
        adapter: train LoRA adapters (`tts_lightning.model.lora.LoRASettings`, built with peft)
            instead of the whole model: the base weights are frozen and never enter the optimizer,
            only the adapters and ``adapter.trainable`` modules train, and checkpoints hold only
            those (plus the speaker table). Real models: lr 2e-6..5e-6 (2e-5 gives noise).
        optimizer: ``adamw`` (fp32 weights and moments), ``adamw8bit`` / ``adamw4bit`` (torchao's
            quantized moments), ``bf16_sr`` (bf16 weights and moments, stochastic rounding) or
            ``bf16_sr_adamw8bit`` (bf16 weights, 8-bit moments): `tts_lightning.model.optimizers`.
            The bf16 ones need ``trainer.precision: bf16-mixed``.
        text_embedding_blocks: the talker's text embedding is held as this many row blocks, each its
            own FSDP unit, so that no unit's backward (gathered weight and gradients) is much larger
            than a decoder layer's; values and gradients are those of one embedding, and export
            writes the one official tensor (`tts_lightning.model.row_blocks`). 1: one unit.
    """

    speaker_embeddings: Tensor  # a buffer (registered in __init__)
    # The constructor's settings as typed attributes over `hparams` (one value: editing either after
    # construction changes the run, and checkpoints save what is used).
    pretrained: HParam[str] = HParam()
    learning_rate: HParam[float] = HParam()
    weight_decay: HParam[float] = HParam()
    warmup_steps: HParam[int] = HParam()
    warmup_ratio: HParam[float] = HParam()
    lr_schedule: HParam[Literal["constant", "cosine"]] = HParam()
    sub_talker_loss_weight: HParam[float] = HParam()
    freeze_patterns: HParam[list[str]] = HParam("freeze")
    attn_implementation: HParam[Literal["sdpa", "eager"]] = HParam()
    optimizer: HParam[OptimizerName] = HParam()
    text_embedding_blocks: HParam[int] = HParam()

    def __init__(
        self,
        pretrained: str,
        speakers: list[str] | None = None,
        learning_rate: float = 2e-5,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
        warmup_ratio: float = 0.0,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        sub_talker_loss_weight: float = 0.3,
        freeze: list[str] = list(_DEFAULT_FREEZE),
        attn_implementation: Literal["sdpa", "eager"] = "sdpa",
        adapter: LoRASettings | None = None,
        optimizer: OptimizerName = "adamw",
        text_embedding_blocks: int = DEFAULT_TEXT_EMBEDDING_BLOCKS,
    ) -> None:
        super().__init__()
        check_optimizer(optimizer, None)
        if not 0.0 <= warmup_ratio < 1.0:
            raise ConfigError(f"model.warmup_ratio must be in [0, 1) (a fraction of the run), got {warmup_ratio}")
        self.adapter = LoRASettings.coerce(adapter)
        self.save_hyperparameters()  # the settings below (`HParam`) are these entries, typed
        self.freeze_patterns = list(freeze)  # a copy: the default list is shared between instances
        # Plain data in checkpoints (loaded with weights_only=True), never a pickled dataclass.
        self.hparams["adapter"] = None if self.adapter is None else self.adapter.to_dict()
        # A LoRA checkpoint leaves out the frozen base weights, which configure_model rebuilds from
        # `pretrained`; resume then loads the trainable tensors only (checked in on_load_checkpoint
        # and by Qwen3TTSFSDPStrategy.load_checkpoint).
        self.strict_loading = self.adapter is None
        self.frozen_keys: frozenset[str] = frozenset()  # "model.<name>" of frozen parameters
        self.trainable_keys: frozenset[str] = frozenset()
        info = check_pretrained(pretrained, require_type=TRAINABLE_TYPES)  # fail before any process spawns
        talker_cfg = info.config["talker_config"]
        self.num_code_groups = int(talker_cfg["num_code_groups"])
        check_blocks(text_embedding_blocks, int(talker_cfg["text_vocab_size"]))
        self.model: nn.Module | None = None
        self.pending_weights: MetaWeights | None = None  # set by configure_model for the strategy
        self.wrap_trainable_leaves = False  # set by configure_model with an adapter (see there)
        self._predict_tools: PredictTools | None = None  # loaded by predict_step on first use
        self.speakers = list(speakers or [])
        # From a custom_voice model each speaker is a codec-embedding row (tts_lightning.model.custom_voice);
        # the ids go into the checkpoint, so that export names the same rows.
        self.speaker_codec_ids = custom_voice_speakers(info, self.speakers, self.adapter)
        if self.speaker_codec_ids is not None:
            self.hparams["speaker_codec_ids"] = list(self.speaker_codec_ids)
        self._speakers_complete = False  # every row of `speaker_embeddings` filled (see _remember_speakers)
        # The fp32 speaker embeddings the run trains with, saved in every checkpoint so that export
        # writes exactly these vectors into the new speakers' codec-embedding rows.
        self.register_buffer("speaker_embeddings", torch.zeros(len(self.speakers), int(talker_cfg["hidden_size"])))
        # validate_args=False: the checks read values back (a host sync per update on a GPU).
        metric = lambda n: MulticlassAccuracy(  # noqa: E731
            n, top_k=1, average="micro", ignore_index=IGNORE_INDEX, validate_args=False
        )
        self.accuracy = nn.ModuleDict(
            {
                stage: nn.ModuleList(
                    [metric(int(talker_cfg["vocab_size"]))]
                    + [
                        metric(int(talker_cfg["code_predictor_config"]["vocab_size"]))
                        for _ in range(self.num_code_groups - 1)
                    ]
                )
                for stage in ("val_acc", "test_acc")  # training: `_log_train_accuracy`
            }
        )
        self._train_accuracy = EpochAccuracy()  # train/acc_codebook_<j>_epoch (TrainAccuracyLogging)
        groups = range(self.num_code_groups)
        self.train_accuracy_epoch = nn.ModuleList([CodebookEpochValue(self._train_accuracy, j) for j in groups])

    # -- construction ------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Build the model here, not in __init__, so that FSDP can wrap it as it is created.

        The parameters are built on the meta device and filled from the checkpoint tensor by
        tensor (`tts_lightning.model.loading`): never a random init, never a second copy. A strategy
        that materializes meta models itself (`Qwen3TTSFSDPStrategy`: unit by unit while wrapping,
        read on rank 0 and broadcast) gets them as they are; otherwise they are filled here."""
        if self.model is not None:
            return
        info = check_pretrained(self.pretrained, require_type=TRAINABLE_TYPES)
        model = build_empty_model(info, attn_implementation=self.attn_implementation)
        split_text_embedding(model, self.text_embedding_blocks)  # still on meta: no memory
        adapter = self.adapter
        if adapter is not None:
            model = inject_lora(model, adapter)
            # FSDP: each trainable leaf (the adapters, the extras) becomes its own unit, so that the
            # frozen units keep no gradient (`Qwen3TTSFSDPStrategy`).
            self.wrap_trainable_leaves = True
        for name, param in model.named_parameters():
            if adapter is None:
                trainable = not _matches(name, self.freeze_patterns)
            else:
                key = checkpoint_key(name)
                trainable = (is_adapter_key(name) or _matches(key, adapter.trainable)) and not _matches(
                    key, self.freeze_patterns
                )
            param.requires_grad_(trainable)
        if adapter is not None:
            unmatched = [
                p
                for p in adapter.trainable
                if not any(_matches(checkpoint_key(n), [p]) for n, _ in model.named_parameters())
            ]
            if unmatched:
                raise ConfigError(f"model.adapter.trainable patterns {unmatched} match no parameter of the model")
        self.frozen_keys = frozenset(f"model.{n}" for n, p in model.named_parameters() if not p.requires_grad)
        self.trainable_keys = frozenset(f"model.{n}" for n, p in model.named_parameters() if p.requires_grad)
        precision = getattr(self._trainer, "precision", None) if self._trainer is not None else None
        check_optimizer(self.optimizer, precision)
        dtype = weights_dtype(self.optimizer)
        frozen_dtype = None
        if adapter is not None:
            frozen_dtype = adapter.frozen_dtype(precision)
        if dtype != torch.float32:
            frozen_dtype = dtype  # bf16 weights: the frozen ones too (never above the trained ones)
        weights = MetaWeights(
            model, info, dtype=dtype, adapter_seed=0 if adapter is None else adapter.seed, frozen_dtype=frozen_dtype
        )
        if dtype != torch.float32:
            weights.cast_meta(model)  # FSDP2 allocates each shard in its meta parameter's dtype
        if self.speaker_codec_ids is not None:  # the new speakers' rows start from the built-in ones
            weights.row_overrides[CODEC_EMBEDDING_KEY] = initial_rows(
                weights.reader.read(CODEC_EMBEDDING_KEY), info.config["talker_config"], self.speakers
            )
        strategy = self._trainer.strategy if self._trainer is not None else None
        if getattr(strategy, "materializes_meta_parameters", False):
            self.pending_weights = weights
        else:
            weights.materialize_all(model)
        self.model = model

    @property
    def talker(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("the model is built by configure_model(); call it (or let the Trainer) first")
        return cast(nn.Module, self.model.talker)

    # -- checkpoints -------------------------------------------------------------------------
    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: Any,
        map_location: Any = None,
        hparams_file: Any = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Qwen3TTSModule:
        """Lightning's, plus the sharded checkpoints (folders) the FSDP strategies write: their module
        tensors are read by key on the CPU (never the optimizer state), `LOAD_BYTES` at a time
        (the model and one group in memory, not a second copy of the state; the text embedding,
        read as its blocks and joined, is briefly held twice); a LoRA checkpoint's frozen base
        comes from the pretrained directory, as in training. ``on_load_checkpoint`` sees the
        checkpoint's keys (its values are read afterwards, by groups)."""
        if not isinstance(checkpoint_path, (str, os.PathLike)) or not Path(checkpoint_path).is_dir():
            return super().load_from_checkpoint(
                checkpoint_path, map_location, hparams_file, strict, weights_only, **kwargs
            )
        import inspect

        from tts_lightning.model.checkpoint import CheckpointReader, groups_of_bytes

        reader = CheckpointReader(checkpoint_path, trust=weights_only is False)
        accepted = inspect.signature(cls).parameters
        stored = {k: v for k, v in reader.hyper_parameters.items() if k in accepted}
        module = cls(**{**stored, **kwargs})  # an unknown keyword fails here, as in Lightning
        module.configure_model()
        keys = reader.tensor_keys()
        # A LoRA checkpoint must hold every trainable tensor (the keys are what is checked).
        module.on_load_checkpoint({"state_dict": dict.fromkeys(keys)})
        never_loaded: set[str] | None = None
        unexpected: list[str] = []
        for group in groups_of_bytes(keys, lambda k: reader.numel(k) * reader.dtype(k).itemsize, LOAD_BYTES):
            result = module.load_state_dict(reader.read(group), strict=False)
            unexpected += result.unexpected_keys
            # missing from every group: never loaded
            never_loaded = set(result.missing_keys) if never_loaded is None else never_loaded & set(result.missing_keys)
        missing = sorted(never_loaded or ())
        strict = module.strict_loading if strict is None else strict
        if unexpected or (strict and missing):
            raise KeyError(
                f"{checkpoint_path} does not match this module: {len(missing)} missing key(s) {missing[:3]}, "
                f"{len(unexpected)} unexpected {unexpected[:3]}"
            )
        return module.to(map_location) if isinstance(map_location, (str, torch.device)) else module

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """With an adapter, the checkpoint keeps the trainable tensors and the buffers (the
        speaker table) only: the frozen base is the pretrained directory's, rebuilt on load."""
        state = checkpoint.get("state_dict")
        if self.adapter is None or state is None:
            return
        checkpoint["state_dict"] = type(state)((k, v) for k, v in state.items() if k not in self.frozen_keys)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict")  # absent under FSDP (its strategy loads and checks)
        if self.adapter is None or state is None or not self.trainable_keys:
            return
        missing = sorted(self.trainable_keys - set(state))
        if missing:
            raise KeyError(
                f"checkpoint lacks {len(missing)} trainable tensor(s) of this adapter setting, "
                f"e.g. {missing[:3]} (was it trained with another `adapter`?)"
            )

    def on_train_start(self) -> None:
        self._adopt_prepared_speakers()

    @torch.no_grad()
    def _adopt_prepared_speakers(self) -> None:
        """At the start of training (after a resume: every strategy has restored by now), the
        speaker table against the data's prepared one, which the batches carry. A row never filled
        takes the prepared embedding now: a speaker no batch has shown yet (a short run, a speaker
        with few clips) would otherwise leave export without its embedding. A filled row that
        differs (a speaker's references or the speaker encoder changed since the checkpoint was
        written) takes it too, with a warning naming the speakers: the steps before trained with
        the old one. Every rank holds the same prepared table, so all find the table complete
        together and skip the per-step collectives (`_remember_speakers`)."""
        datamodule: Any = getattr(self.trainer, "datamodule", None)
        if self.speaker_codec_ids is not None or not hasattr(datamodule, "speaker_embeddings"):
            return
        table = self.speaker_embeddings
        held = table.cpu()
        prepared = dict(zip(datamodule.speaker_names, datamodule.speaker_embeddings()))
        for row, name in enumerate(self.speakers):
            if name in prepared and held[row].abs().sum() == 0:
                table[row] = prepared[name].to(table.device, table.dtype)
        self._speakers_complete = bool((table.abs().sum(1) > 0).all())
        changed = [
            (row, name)
            for row, name in enumerate(self.speakers)
            if name in prepared and held[row].abs().sum() > 0 and not torch.equal(held[row], prepared[name])
        ]
        if not changed:
            return
        for row, name in changed:
            table[row] = prepared[name].to(table.device, table.dtype)
        names = ", ".join(repr(name) for _, name in changed)
        rank_zero_warn(
            f"speaker(s) {names}: the prepared embedding differs from the one the checkpoint trained with (their "
            "reference clips, data.num_reference_clips or the speaker encoder changed since); training goes on with "
            "the prepared one, which export writes"
        )

    # -- steps -------------------------------------------------------------------------------
    def forward(self, batch: TalkerBatch) -> LossOutput:
        return compute_loss(self.talker, batch, self.sub_talker_loss_weight)

    def _shared_step(self, batch: TalkerBatch, stage: str) -> torch.Tensor:
        """Nothing here reads a value back to the host (a GPU stall), except on logging steps:
        `self.log` keeps tensors on the device and Lightning converts them when it writes the logs
        (tests/model/test_step_host_reads.py counts the reads)."""
        self._remember_speakers(batch)
        out = self(batch)
        train, n = stage == "train", len(batch)
        # add_dataloader_idx: val/* keep their names beside the replay loader (`validation_step`).
        once: dict[str, Any] = {"batch_size": n, "on_epoch": True, "add_dataloader_idx": False}
        losses = {"loss": out.loss, "talker_loss": out.talker_loss, "code_predictor_loss": out.code_predictor_loss}
        if train:
            # The logged step losses are the means over ranks: one all-reduce queued on the device,
            # not `sync_dist`'s barrier and all-reduce per value (a host wait on NCCL). The epoch's
            # value is the mean of its micro-batches' (batch_size 1), the same on every rank. The progress
            # bar shows train/loss from `StepProgressBar` at logging steps: prog_bar=True would make
            # Lightning convert it to a float after every step.
            world = self._trainer.world_size if self._trainer is not None else 1
            means = all_reduce_in_step(torch.stack([v.detach() for v in losses.values()]), "mean", world)
            for name, value in zip(losses, means):
                self.log(f"train/{name}", value, on_step=True, on_epoch=True, batch_size=1, add_dataloader_idx=False)
            self._log_train_accuracy(out, n)
            return out.loss
        for name, value in losses.items():
            # sync_dist: validation's losses are the same on every rank (a checkpoint monitors them).
            self.log(f"{stage}/{name}", value, prog_bar=name == "loss", sync_dist=True, on_step=False, **once)
        metrics = [cast(MulticlassAccuracy, m) for m in cast(nn.ModuleList, self.accuracy[f"{stage}_acc"])]
        # The talker's logits, the code predictor's top-1 codes (its logits are not kept: `loss`).
        pairs = [(out.talker_logits.detach(), out.talker_targets)] + [
            (out.predictor_predictions[:, j], out.predictor_targets[:, j]) for j in range(self.num_code_groups - 1)
        ]
        for j, (metric, (predicted, targets)) in enumerate(zip(metrics, pairs)):
            metric.update(predicted, targets)  # computed (and synced) by Lightning at epoch end
            self.log(f"{stage}/acc_codebook_{j}", metric, on_step=False, **once)
        return out.loss

    def _logging_step(self) -> bool:
        """Whether this training step's metrics are written (Trainer's ``log_every_n_steps``): the
        same on every rank."""
        trainer = self._trainer
        if trainer is None:
            return True
        every = max(int(getattr(trainer, "log_every_n_steps", 1)), 1)  # set in Trainer.__init__, undeclared
        return (trainer.global_step + 1) % every == 0

    @torch.no_grad()
    def _remember_speakers(self, batch: TalkerBatch) -> None:
        """Copy the batch's speaker embeddings into the `speaker_embeddings` buffer that checkpoints
        and export carry, on every rank: each row comes from one rank that saw the speaker (summing
        one value with zeros is exact), so all ranks hold the same complete table.

        The collectives are all-reduces over the default process group, queued on the device
        (`all_reduce_in_step`: no barrier; a single process gets its input back), on tensors made on
        the strategy's root device (NCCL refuses CPU tensors). Without a trainer, only this
        process's rows are filled. All on the device: whether
        the table is complete is read back only on logging steps (`_speakers_complete`, the same
        decision on every rank, which then skip the collectives together)."""
        table = self.speaker_embeddings
        if self.speaker_codec_ids is not None:
            return  # a custom_voice run: the speakers are codec rows, the table stays empty
        if not len(self.speakers) or self._speakers_complete:
            return
        strategy = self._trainer.strategy if self._trainer is not None else None
        device = table.device if strategy is None else strategy.root_device
        local = torch.zeros(table.shape, dtype=table.dtype, device=device)
        local[batch.speaker_index.to(device)] = batch.speaker_embedding.to(device=device, dtype=table.dtype)
        if strategy is not None:
            me = self.global_rank + 1
            world = self.trainer.world_size
            owner = all_reduce_in_step((local.abs().sum(1) > 0).long() * me, "max", world)
            local = all_reduce_in_step(local * (owner == me)[:, None], "sum", world)
        local = local.to(table.device)
        new = (local.abs().sum(1) > 0) & (table.abs().sum(1) == 0)
        table.copy_(torch.where(new[:, None], local, table))
        if self._logging_step():
            self._speakers_complete = bool((table.abs().sum(1) > 0).all())

    def training_step(self, batch: TalkerBatch, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: TalkerBatch, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        if dataloader_idx == 1:  # the data module's replay records (`tts_lightning.data.replay`)
            out = self(batch)
            self.log("val/replay_loss", out.loss, batch_size=len(batch), sync_dist=True, add_dataloader_idx=False)
            return out.loss
        return self._shared_step(batch, "val")

    def test_step(self, batch: TalkerBatch, batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "test")

    def predict_step(
        self, batch: PredictBatch | Mapping[str, Sequence[Any]], batch_idx: int, dataloader_idx: int = 0
    ) -> list[dict[str, Any]]:
        """Speak each text of the batch as its speaker, with this checkpoint's weights.

        ``batch`` is a `PredictBatch` (`tts_lightning.data.predict.collate_texts` makes them; a dict
        of lists ``text``, ``speaker`` and optionally ``language``, ``id``, ``padding`` is read with
        `PredictBatch.from_mapping`). Padding rows (added to even out ranks) are generated and passed
        through. Sampling settings come from the pretrained directory's ``generation_config.json``,
        as in the official ``qwen_tts``. Returns one dict per row: ``id, text, speaker, language,
        padding, codes`` (T x 16), ``audio`` (float32) and ``sample_rate`` (24 kHz).
        """
        if not isinstance(batch, PredictBatch):
            batch = PredictBatch.from_mapping(batch, batch_idx=batch_idx)
        rows = {name: i for i, name in enumerate(self.speakers)}
        unknown = sorted({s for s in batch.speakers if s not in rows})
        if unknown:
            raise ConfigError(
                f"unknown speaker(s) {unknown_names(unknown, self.speakers)}; "
                f"this model speaks as {some_names(self.speakers)}"
            )
        table = self.speaker_embeddings
        index = torch.tensor([rows[s] for s in batch.speakers], dtype=torch.long, device=table.device)
        embeddings = table[index].float()
        languages = batch.languages
        if self.speaker_codec_ids is not None:  # the rows themselves: what spk_id selects after export
            # Looked up through the embedding's forward, not its weight: under FSDP1 with several
            # ranks it is a unit of its own whose weight is this rank's flat shard outside that forward
            # (a collective: every rank predicts the same number of batches).
            codec_embedding = cast(nn.Module, cast(Any, self.talker).get_input_embeddings())
            ids = torch.tensor([self.speaker_codec_ids[rows[s]] for s in batch.speakers], device=self.device)
            embeddings = codec_embedding(ids).detach().float()
            languages = spoken_languages(cast(Any, self.model).config.talker_config, batch.speakers, languages)
        empty = sorted({s for s, e in zip(batch.speakers, embeddings) if not bool(e.abs().sum() > 0)})
        if empty:
            raise ConfigError(
                f"speaker(s) {empty} have no embedding in this checkpoint (never seen in a training step); "
                "predict with a later checkpoint or without them (data.predict_speakers)"
            )
        if self.model is None:
            raise RuntimeError("the model is built by configure_model(); call it (or let the Trainer) first")
        tools = self.predict_tools()
        layout = batch.sequence_layout  # the run's, as trained
        refs = batch.references if layout.needs_reference else None
        prompts = [(reference_prompt_ids(tools.text_tokenizer, r.text), r.codes) for r in refs] if refs else None
        codes = generate_codes(
            self.model,
            [tokenize_text(tools.text_tokenizer, t) for t in batch.texts],
            embeddings,
            languages,
            layout=layout,
            references=prompts,
            **tools.generation,
        )
        audio = decode_codes(tools.speech_tokenizer, codes, [c for _, c in prompts] if prompts else None)
        return [
            {
                "id": batch.ids[i],
                "text": batch.texts[i],
                "speaker": batch.speakers[i],
                "language": batch.languages[i],
                "padding": batch.padding[i],
                "codes": codes[i],
                "audio": audio[i],
                "sample_rate": SAMPLE_RATE,
            }
            for i in range(len(batch))
        ]

    def predict_tools(self) -> PredictTools:
        """The tokenizers and sampling settings `predict_step` uses, loaded once (the speech tokenizer
        on this module's device) and kept in a plain attribute: neither hparams nor state dict."""
        if self._predict_tools is None:
            info = check_pretrained(self.pretrained)
            self._predict_tools = PredictTools(
                text_tokenizer=load_text_tokenizer(info),
                speech_tokenizer=load_speech_tokenizer(info, device=self.device),
                generation=generation_defaults(info.path),
            )
        return self._predict_tools

    # -- optimisation ------------------------------------------------------------------------
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        params = [p for p in self.parameters() if p.requires_grad]
        groups: Any = params
        if self.speaker_codec_ids is not None and f"model.{CODEC_EMBEDDING_KEY}" in self.trainable_keys:
            # Weight decay would move every row of the codec embedding at each step: the built-in
            # speakers the run does not train keep their rows bit-equal without it (zero gradient).
            groups = without_decay_of_codec_embedding(self.named_parameters())
        optimizer = build_optimizer(self.optimizer, groups, self.learning_rate, self.weight_decay)
        # Hugging Face's schedules: linear warm-up from 0, then constant or cosine to 0 at the last step.
        from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

        warmup = self.warmup_steps
        by_ratio = not warmup and self.warmup_ratio > 0  # warmup_steps wins, as in Hugging Face's Trainer
        total = 0
        if self.lr_schedule == "cosine" or by_ratio:
            estimated = self.trainer.estimated_stepping_batches
            if math.isinf(estimated):
                raise ConfigError(
                    "model.lr_schedule cosine and model.warmup_ratio need the run's length: set "
                    "trainer.max_steps or trainer.max_epochs"
                )
            total = max(int(estimated), 1)
        if by_ratio:
            warmup = math.ceil(self.warmup_ratio * total)
        if self.lr_schedule == "cosine":
            scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total)
        else:
            scheduler = get_constant_schedule_with_warmup(optimizer, warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
