"""`Qwen3TTSFSDPStrategy`: Lightning's FSDPStrategy with Qwen3-TTS defaults, typed for YAML, CPU-capable.

What it changes, and why:
- Wraps and activation-checkpoints **both** decoder-layer classes (the model's `_no_split_modules`
  names only the code predictor's, which would leave every talker layer in the root unit), and wraps
  each `nn.Embedding` too, so the 311M-parameter text embedding is not gathered for the whole step
  (it is held as row blocks, each an `nn.Embedding` unit: `tts_lightning.model.row_blocks`).
- Types the FSDP options users tune, so LightningCLI accepts them from YAML.
- bf16-mixed keeps buffers and gradient reduction in fp32: Lightning's default casts the MRoPE
  `inv_freq` buffer to bf16 (1.15 rad of angle error at position 1000).
- Loads big models without a full copy per rank: a model built with meta parameters (see
  `tts_lightning.model.loading`) is materialized unit by unit as FSDP wraps it, read on global rank 0
  and broadcast to the others on the root device.
- Runs on CPU with gloo (FSDP1 needs ``device_id=cpu`` there; Lightning passes None), so CI trains
  with real FSDP processes, and gives each rank its share of the cores (also on GPU runs with
  ``cpu_offload``, where the optimizer steps on the CPU).
- Clips gradients by their norm over all shards (`Trainer(gradient_clip_val=...)`, algorithm
  ``norm``): its precision plugin asks the FSDP root, the only module that sees every shard
  (Lightning's `FSDPPrecision` refuses norm clipping). The LightningModule knows nothing of FSDP.
- Every tensor it hands to a collective lives on the root device: NCCL refuses CPU tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, cast

import torch
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer

from tts_lightning.distributed.atomic import AtomicCheckpoints, CheckpointWriteError
from tts_lightning.distributed.lean_state import LeanShards
from tts_lightning.distributed.processes import split_cpu_threads
from tts_lightning.distributed.row_chunks import checkpoint_wrapped_predictor_by_rows
from tts_lightning.distributed.scheduler_signals import SchedulerSignals
from tts_lightning.model.checkpoint import MODEL_PREFIX, refuse_other_strategy, sharded_prefix

__all__ = [
    "CheckpointWriteError",
    "DEFAULT_CHECKPOINT",
    "DEFAULT_WRAP",
    "Qwen3TTSFSDPPrecision",
    "Qwen3TTSFSDPStrategy",
    "import_classes",
]

DEFAULT_WRAP = (
    "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSTalkerDecoderLayer",
    "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSDecoderLayer",
    "torch.nn.Embedding",
    # Frozen and unused by the loss: as its own unit it is never gathered and has no gradient
    # (in the root unit it would be gathered every step and share the root's flat gradient).
    "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSSpeakerEncoder",
)
DEFAULT_CHECKPOINT = (
    "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSTalkerDecoderLayer",
    "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSDecoderLayer",
)


def import_classes(paths: list[str] | tuple[str, ...]) -> set[type[nn.Module]]:
    classes = set()
    for path in paths:
        module_name, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"cannot import module class {path!r}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"{path!r} is not a torch.nn.Module class")
        classes.add(cls)
    return classes


class Qwen3TTSFSDPPrecision(FSDPPrecision):
    """Lightning's `FSDPPrecision`, plus gradient clipping by norm: the norm is over the gradient of
    the whole model, so only the FSDP root can compute it (``FullyShardedDataParallel.clip_grad_norm_``
    sums every rank's shards, and counts replicated shards once). Lightning's plugin has no reference
    to the root and refuses; this one asks ``root()``, which `Qwen3TTSFSDPStrategy` points at its
    wrapped model. Clipping by value needs no root (element by element) and is Lightning's.

    `Qwen3TTSFSDPStrategy` makes one of these from whatever `FSDPPrecision` the Trainer gives it.
    """

    def __init__(
        self,
        precision: Literal["32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed"],
        scaler: Any = None,
        root: Callable[[], nn.Module | None] | None = None,
    ) -> None:
        super().__init__(precision, scaler)
        self.root = root

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = None if self.root is None else self.root()
        if not isinstance(model, FullyShardedDataParallel):
            raise RuntimeError(
                "gradient clipping by norm under FSDP needs the FSDP root (the strategy's wrapped model), "
                "and there is none yet"
            )
        model.clip_grad_norm_(clip_val)


class Qwen3TTSFSDPStrategy(SchedulerSignals, AtomicCheckpoints, FSDPStrategy):
    """FSDP for Qwen3-TTS. Every argument can be set from YAML under ``trainer.strategy.init_args``.

    Args:
        auto_wrap_policy: module classes (import paths) that become FSDP units.
        activation_checkpointing_policy: module classes whose activations are recomputed in backward.
            An empty list turns activation checkpointing off.
        sharding_strategy: FULL_SHARD (parameters, gradients and optimizer state sharded),
            SHARD_GRAD_OP, NO_SHARD (DDP-like) or HYBRID_SHARD.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory
            (GPU only; the last resort when a shard does not fit).
        state_dict_type: ``sharded`` (one file per rank, fast, the default) or ``full``.
        mixed_precision_buffers_fp32: under bf16-mixed, keep buffers and reductions in fp32.
    """

    SHARDED_PREFIX = MODEL_PREFIX  # the module state's keys in its sharded checkpoints

    def __init__(
        self,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        auto_wrap_policy: list[str] | None = None,
        activation_checkpointing_policy: list[str] | None = None,
        sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = "FULL_SHARD",
        cpu_offload: bool = False,
        state_dict_type: Literal["full", "sharded"] = "sharded",
        use_orig_params: bool = True,
        limit_all_gathers: bool = True,
        forward_prefetch: bool = False,
        backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST"] | None = "BACKWARD_PRE",
        sync_module_states: bool = False,
        mixed_precision_buffers_fp32: bool = True,
        **kwargs: Any,
    ) -> None:
        from torch.distributed.fsdp import BackwardPrefetch

        wrap = import_classes(DEFAULT_WRAP if auto_wrap_policy is None else auto_wrap_policy)
        checkpoint = import_classes(
            DEFAULT_CHECKPOINT if activation_checkpointing_policy is None else activation_checkpointing_policy
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            cpu_offload=cpu_offload,
            auto_wrap_policy=wrap,
            activation_checkpointing_policy=checkpoint or None,
            sharding_strategy=sharding_strategy,
            state_dict_type=state_dict_type,
            use_orig_params=use_orig_params,
            limit_all_gathers=limit_all_gathers,
            forward_prefetch=forward_prefetch,
            backward_prefetch=None if backward_prefetch is None else BackwardPrefetch[backward_prefetch],
            sync_module_states=sync_module_states,
            **kwargs,
        )
        self.mixed_precision_buffers_fp32 = mixed_precision_buffers_fp32

    @property
    def mixed_precision_config(self):
        """Lightning's, with fp32 buffers and reductions (``mixed_precision_buffers_fp32``), and the
        batch left as it is: the root would cast its fp32 speaker embeddings to bf16, and the speaker
        table the run saves and exports (filled from the batch) would be bf16-rounded. The loss casts
        them to the compute dtype where they meet the model (`tts_lightning.model.sequence`)."""
        config = super().mixed_precision_config
        if config is None or self.mixed_precision is not None:
            return config
        from torch.distributed.fsdp import MixedPrecision

        fp32 = self.mixed_precision_buffers_fp32
        return MixedPrecision(
            param_dtype=config.param_dtype,
            reduce_dtype=torch.float32 if fp32 else config.reduce_dtype,
            buffer_dtype=torch.float32 if fp32 else config.buffer_dtype,
            cast_root_forward_inputs=False,
        )

    @property
    def precision_plugin(self) -> FSDPPrecision:
        plugin = self._precision_plugin
        if plugin is None:  # as Lightning's (a fresh default each time), with norm clipping
            return Qwen3TTSFSDPPrecision("32-true", root=self._clipping_root)
        assert isinstance(plugin, FSDPPrecision)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """The Trainer's `FSDPPrecision` (from ``precision=``, or given to the strategy) becomes a
        `Qwen3TTSFSDPPrecision` with the same settings, so that norm clipping works; a subclass of
        the user's own is kept as it is."""
        if type(plugin) is FSDPPrecision:
            converted = Qwen3TTSFSDPPrecision(cast(Any, plugin.precision), root=self._clipping_root)
            converted.scaler = plugin.scaler  # the same 16-mixed scaler (FSDPPrecision drops a given one)
            plugin = converted
        FSDPStrategy.precision_plugin.fset(self, plugin)  # type: ignore[attr-defined]

    def _clipping_root(self) -> nn.Module | None:
        return self.model

    # A LightningModule whose `configure_model` sees this flag may leave its parameters on the meta
    # device with a `pending_weights` loader (`tts_lightning.model.loading.MetaWeights`).
    materializes_meta_parameters = True

    def setup_environment(self) -> None:
        if self.root_device.type == "cpu" or self.cpu_offload.offload_params:
            split_cpu_threads(self.num_processes)  # CPU runs, or the CPU optimizer step under cpu_offload
        super().setup_environment()

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return self._report_shards(checkpoint_wrapped_predictor_by_rows(super()._setup_model(model)))
        # Wrap here, then let Lightning do the rest (metrics, activation checkpointing; the code
        # predictor's recomputed by blocks of frames: `row_chunks`) as for an
        # already-wrapped model. FSDP1 on CPU needs device_id=cpu (Lightning passes the index, None
        # on CPU), and a meta-built model is materialized unit by unit as it is wrapped.
        kwargs = dict(self.kwargs)
        # Units of their own for the trainable leaves only when training: they spare the frozen
        # units a gradient, but each is one more all-gather per forward: with a lora_A and a lora_B
        # per adapted linear, generation (predict, validate's samples) ran several times slower than
        # with the layer units alone. Checkpoints are keyed by parameter name: either wrapping loads them.
        # A flat parameter holds one dtype, so a bf16 frozen base (LoRA under bf16-mixed) needs the
        # fp32 adapters in units of their own in validate and predict too.
        weights = getattr(model, "pending_weights", None)
        mixed_dtypes = weights is not None and weights.frozen_dtype != weights.dtype
        leaves = getattr(model, "wrap_trainable_leaves", False) and (self._fitting() or mixed_dtypes)
        if leaves and kwargs.get("auto_wrap_policy") is not None:
            kwargs["auto_wrap_policy"] = _with_trainable_leaves(kwargs["auto_wrap_policy"])
        if weights is not None:
            broadcast = self.world_size > 1
            kwargs["param_init_fn"] = lambda module: weights.materialize(
                module, device=self.root_device, broadcast=broadcast
            )
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **kwargs,
        )
        if weights is not None:
            setattr(model, "pending_weights", None)  # any LightningModule: an untyped attribute
        policy = self.kwargs.pop("auto_wrap_policy", None)
        try:
            return self._report_shards(checkpoint_wrapped_predictor_by_rows(super()._setup_model(wrapped)))
        finally:
            if policy is not None:
                self.kwargs["auto_wrap_policy"] = policy

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self._restore_frozen_no_shard_parameters()

    def _restore_frozen_no_shard_parameters(self) -> None:
        """Work around a torch FSDP1 bug (2.14) at NO_SHARD, which FSDP uses at world size 1: a
        grad-enabled forward turns a unit's parameters into plain tensor views and leaves them so
        until its post-backward hook, which a unit whose parameters are all frozen (a LoRA run's
        decoder layers, a frozen text embedding) never gets. The next forward's writeback then
        stores those tensors as the parameters for good: they vanish from ``named_parameters``
        and every state dict fails (``FSDP assumes ... base_layer.weight is in the state_dict``).
        Registering the parameters again after each backward, as FSDP does for trainable units,
        keeps them. Rehearsed on CPU by the 1-GPU configs of tests/test_shipped_configs.py."""
        from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

        if self.model is None:
            return
        for handle in _get_fsdp_handles(self.model):
            if not handle.uses_sharded_strategy and not handle.flat_param.requires_grad:
                handle._use_sharded_views()  # NO_SHARD: registers the unflattened views as parameters

    def _fitting(self) -> bool:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer is None or trainer.state.fn == TrainerFn.FITTING

    def _writes_sharded(self) -> bool:
        return self._state_dict_type == "sharded"

    # -- checkpoints: sharded ones lean (tts_lightning.distributed.lean_state), full ones Lightning's --
    _lean_shards: LeanShards | None = None

    def _lean(self) -> LeanShards:
        """Where each rank's piece of each parameter lies (computed once per wrapped model)."""
        assert self.model is not None, "the checkpoint is made after the model is set up"
        if self._lean_shards is None or self._lean_shards.model is not self.model:
            self._lean_shards = LeanShards(self.model)
        return self._lean_shards

    def _saved_keys(self) -> set[str] | None:
        """The module state a checkpoint holds: all of it, or for a LoRA run only the trainable
        tensors and the buffers (`Qwen3TTSModule.frozen_keys` are rebuilt from the pretrained
        directory)."""
        from tts_lightning.distributed.lean_state import buffers

        module = self.lightning_module
        frozen = getattr(module, "frozen_keys", None)
        if not frozen or getattr(module, "adapter", None) is None:
            return None
        return (set(self._lean().params) - set(frozen)) | set(buffers(self._lean().model))

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._state_dict_type != "sharded":
            return super().lightning_module_state_dict()
        from tts_lightning.distributed.lean_state import model_state_dict

        return model_state_dict(self._lean(), self._saved_keys())

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        from tts_lightning.distributed import rank_local_state

        return rank_local_state.load_checkpoint(self, checkpoint_path, lambda p: self._load_checkpoint(p, weights_only))

    def _load_checkpoint(self, checkpoint_path, weights_only: bool | None) -> dict[str, Any]:
        """A sharded checkpoint read straight into this rank's shards and optimizer state (no gather,
        at any world size); a full one by Lightning; once every node sees it. A LoRA run's checkpoint
        holds the trainable tensors only (`Qwen3TTSModule.frozen_keys`): the frozen base keeps the
        values it was built with (from the pretrained directory); every trainable tensor must be there."""
        from lightning.fabric.strategies.fsdp import _METADATA_FILENAME, _is_full_checkpoint, _is_sharded_checkpoint
        from lightning.fabric.utilities.load import _lazy_load

        path = self.check_on_every_node(checkpoint_path)
        module = self.lightning_module
        assert module is not None and self.model is not None
        adapter = getattr(module, "adapter", None) is not None
        if not _is_sharded_checkpoint(path):
            if adapter and _is_full_checkpoint(path):
                check_trainable(module, set(_lazy_load(path)["state_dict"]), path)
            return super().load_checkpoint(path, weights_only)  # strict_loading is off for adapters
        from torch.distributed.checkpoint import FileSystemReader

        from tts_lightning.distributed.lean_state import buffers, load

        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        refuse_other_strategy(path, sharded_prefix(metadata), self.SHARDED_PREFIX)  # torchrun: no CLI check
        stored = {k[len("model.") :] for k in metadata if k.startswith("model.")}
        wanted = self._saved_keys() or set(self._lean().params) | set(buffers(self._lean().model))
        if adapter:
            check_trainable(module, stored, path)
        elif wanted - stored:
            missing = sorted(wanted - stored)
            raise KeyError(f"{path} lacks {len(missing)} tensor(s) of this model, e.g. {missing[:3]}")
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        load(self._lean(), path, keys=wanted & stored, optimizers=list(self.optimizers) if fitting else [])
        return torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=weights_only)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        from tts_lightning.distributed import rank_local_state

        quantized = rank_local_state.optimizer_state(self, optimizer)  # torchao's 8/4-bit: saved per rank
        if quantized is not None:
            return quantized
        if self._state_dict_type == "sharded":
            from tts_lightning.distributed.lean_state import optimizer_state_dict

            return optimizer_state_dict(self._lean(), getattr(optimizer, "_optimizer", optimizer))
        if self.root_device.type != "cpu":
            return super().optimizer_state(optimizer)
        # On CPU, FSDP's offload_to_cpu (a no-op copy there) makes the full optimizer state reuse one
        # buffer for every state of a parameter: exp_avg came out equal to exp_avg_sq and a resumed
        # run silently diverged. Gather without it.
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            OptimStateKeyType,
            StateDictType,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        optimizer = getattr(optimizer, "_optimizer", optimizer)
        model = self.model
        assert model is not None, "the optimizer state is gathered after the model is set up"
        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        ):
            state = FSDP.optim_state_dict(model, optimizer)
            if self.global_rank == 0:
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, model)
            return state

    def _report_shards(self, model: nn.Module) -> nn.Module:
        """Say on every rank how much of the model it holds: the first thing to check when memory
        does not fit (a big root unit or an unwrapped layer class shows here)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        local = sum(p.numel() for p in model.parameters())  # orig-param views of the local shard
        total = torch.tensor([local], dtype=torch.long, device=self.root_device)  # NCCL: never CPU
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        units = sum(isinstance(m, FullyShardedDataParallel) for m in model.modules())
        strategy = getattr(model, "sharding_strategy", self.sharding_strategy)  # 1 rank -> NO_SHARD
        print(
            f"[rank {self.global_rank}] FSDP {strategy.name}: {local:,} of {int(total):,} "
            f"parameters held locally ({100 * local / max(int(total), 1):.1f}%) in {units} units",
            flush=True,
        )
        return model


def check_trainable(module: nn.Module, stored: set[str], path: Path) -> None:
    """Fail, naming the checkpoint, when it lacks a trainable tensor of ``module`` (a LoRA run's
    checkpoint holds only those, `Qwen3TTSModule.trainable_keys`); shared by both strategies."""
    missing = sorted(k for k in getattr(module, "trainable_keys", ()) if k not in stored)
    if missing:
        raise KeyError(
            f"{path} lacks {len(missing)} trainable tensor(s) of this run, e.g. {missing[:3]} "
            "(was it trained with another `adapter` setting?)"
        )


def _with_trainable_leaves(policy):
    """``policy`` or: every leaf module whose parameters all train (LoRA's lora_A / lora_B, the
    extras trained in full) is a unit of its own. FSDP1 keeps a full-size gradient for a unit that
    mixes frozen and trainable parameters; this way the frozen units have none (peft's
    ``fsdp_auto_wrap_policy`` does the same)."""
    import functools

    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy

    def trainable_leaf(module: nn.Module) -> bool:
        params = list(module.parameters(recurse=False))
        return not list(module.children()) and bool(params) and all(p.requires_grad for p in params)

    leaves = functools.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf)
    return functools.partial(_or_policy, policies=[leaves, policy])
