"""`Qwen3TTSFSDP2Strategy`: FSDP2 (``torch.distributed.fsdp.fully_shard``, per-parameter sharding) for
Qwen3-TTS, on top of Lightning's `ModelParallelStrategy`; the alternative to the FSDP1
`Qwen3TTSFSDPStrategy` (flat parameters per unit). Select it in YAML with
``class_path: tts_lightning.distributed.fsdp2.Qwen3TTSFSDP2Strategy``.

Layout (applied in `setup`, after `Qwen3TTSModule.configure_model` built the model on meta):
- one ``fully_shard`` unit per talker decoder layer and per code-predictor decoder layer, each
  activation-checkpointed (``activation_checkpointing_policy``, composable checkpoint: parameter
  names do not change; the code predictor's by blocks of frames, `row_chunks`), and one per row
  block of the 311M-parameter text embedding (``layer_classes``; `tts_lightning.model.row_blocks`),
  each given a zero input with a gradient so that FSDP2 reduces and frees it right after its own
  backward (its token ids have none);
- ``groups``: module-name globs, each list one unit: the codec embeddings (the talker's and the code
  predictor's, together), the frozen speaker encoder alone
  (never gathered: unused by the loss, and frozen parameters get no gradient);
- the LightningModule itself as the root (its ``forward`` runs first each step), holding the rest.

Every parameter is a DTensor sharded on dim 0 over all ranks; frozen ones have no gradient. Under
``bf16-mixed`` the units compute in bf16 (``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``) while the sharded master weights, gradients and optimizer state stay fp32,
and buffers (the MRoPE ``inv_freq``) are not cast (``bf16-true`` casts everything, as Lightning
does). ``cpu_offload`` keeps the shards in host memory (``CPUOffloadPolicy``; not yet run on a GPU).
Weights are loaded without a full copy on any rank: the meta model is sharded, its meta tensors
are allocated as shards, and global rank 0 reads and scatters one tensor at a time
(`tts_lightning.model.loading.MetaWeights.fill_sharded`); the real tensors (buffers, metric states)
are kept. Checkpoints: ``sharded`` (torch.distributed.checkpoint, one file per rank) or ``full``
(one file, gathered on rank 0), both written atomically (`AtomicCheckpoints`). CPU with gloo works
(CI trains with real processes). Collectives only on the root device (NCCL refuses CPU tensors).

LoRA (``model.adapter``): the adapters sit in the units of their layers (frozen parameters have no
gradient under FSDP2, so no unit of their own is needed, unlike FSDP1); the frozen base is stored
in ``adapter.frozen_dtype`` (bf16 under ``bf16-mixed``), given to its meta parameters before
``fully_shard`` (`MetaWeights.cast_frozen`: FSDP2 wants one dtype only among a unit's trainable
parameters). Checkpoints hold the trainable tensors and buffers only; the frozen shards are never
gathered or copied to save them (``ignore_frozen_params``), and loading reads just the keys the
checkpoint holds, the frozen base keeping the pretrained values it was built with.

Step time on CPU (gloo), against FSDP1 (profiled on ``benchmarks/fsdp_memory.py``'s model): the
same bytes are gathered and reduced in fewer, larger collectives (14 all-gathers and 7
reduce-scatters per step against FSDP1's 58 and 22; gloo runs each reduce-scatter as an
all-reduce, in both); gradient clipping by norm (torch's ``clip_grad_norm_`` on the DTensor
gradients) is one all-reduce. What FSDP2 adds is its per-parameter layout's copies, on the
training thread on CPU: each all-gather copies the local shards into a flat input (copy-in) and
the flat output into the unsharded parameters (copy-out), where FSDP1 gathers its flat parameter
in place; plus AdamW on DTensors. (Each reduce-scatter's copy of the gradients into a flat input,
``chunk_cat``, has its FSDP1 counterpart: autograd concatenates the views' gradients into the
flat one.) Asynchronous all-gathers with explicit prefetching did not help on 2 cores (the gloo
thread competes with the compute), so none is set.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from tts_lightning.distributed.atomic import AtomicCheckpoints
from tts_lightning.distributed.fsdp import DEFAULT_CHECKPOINT, check_trainable, import_classes
from tts_lightning.distributed.processes import choose_backend, split_cpu_threads
from tts_lightning.distributed.row_chunks import checkpoint_by_rows
from tts_lightning.distributed.scheduler_signals import SchedulerSignals
from tts_lightning.model.checkpoint import FSDP2_PREFIX, refuse_other_strategy, sharded_prefix

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "DEFAULT_GROUPS",
    "DEFAULT_LAYERS",
    "Qwen3TTSFSDP2Strategy",
    "apply_fully_shard",
    "fsdp2_modules",
    "group_members",
]

DEFAULT_LAYERS = (
    "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSTalkerDecoderLayer",
    "qwen_tts.core.models.modeling_qwen3_tts.Qwen3TTSDecoderLayer",
    # each row block of the text embedding (`tts_lightning.model.row_blocks`)
    "tts_lightning.model.row_blocks.EmbeddingRowBlock",
)
# Module names (globs, relative to the Qwen3-TTS model) of the units other than the layers.
DEFAULT_GROUPS = (
    ("talker.model.codec_embedding", "talker.code_predictor.model.codec_embedding.*"),
    ("speaker_encoder",),
)


class Qwen3TTSFSDP2Strategy(SchedulerSignals, AtomicCheckpoints, ModelParallelStrategy):
    """FSDP2 for Qwen3-TTS. Every argument can be set from YAML under ``trainer.strategy.init_args``.

    Args:
        layer_classes: module classes (import paths) that each become a unit.
        groups: lists of module-name globs (relative to the Qwen3-TTS model); each list is one unit.
        activation_checkpointing_policy: module classes whose activations are recomputed in backward
            (an empty list turns it off).
        reshard_after_forward: free the gathered parameters of a unit after its forward (ZeRO-3,
            less memory) or keep them until backward (ZeRO-2-like, one all-gather fewer per step).
        cpu_offload: keep the sharded parameters, gradients and optimizer state in host memory.
        state_dict_type: ``sharded`` (torch.distributed.checkpoint, one file per rank) or ``full``.
    """

    # A LightningModule whose `configure_model` sees this flag leaves its parameters on the meta
    # device with a `pending_weights` loader (`tts_lightning.model.loading.MetaWeights`).
    materializes_meta_parameters = True
    SHARDED_PREFIX = FSDP2_PREFIX  # the module state's keys in its sharded checkpoints

    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        layer_classes: list[str] | None = None,
        groups: list[list[str]] | None = None,
        activation_checkpointing_policy: list[str] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        state_dict_type: Literal["full", "sharded"] = "sharded",
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.layer_classes = tuple(import_classes(DEFAULT_LAYERS if layer_classes is None else layer_classes))
        self.groups = [list(g) for g in (DEFAULT_GROUPS if groups is None else groups)]
        self.checkpoint_classes = tuple(
            import_classes(
                DEFAULT_CHECKPOINT if activation_checkpointing_policy is None else activation_checkpointing_policy
            )
        )
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.state_dict_type = state_dict_type

    # -- processes ---------------------------------------------------------------------------
    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if self.root_device.type == "cpu" or self.cpu_offload:
            split_cpu_threads(self.num_processes)  # CPU runs, or the CPU optimizer step under cpu_offload
        self._setup_distributed()  # the process group, as ModelParallelStrategy does
        # One data-parallel dimension over all ranks (ModelParallelStrategy's default mesh is 2D).
        self._device_mesh = init_device_mesh(
            self.root_device.type, (self.world_size,), mesh_dim_names=("data_parallel",)
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _get_process_group_backend(self) -> str:
        # NCCL alone on GPUs, unless cpu_offload puts tensors of collectives on the CPU (choose_backend).
        return choose_backend(self.root_device, self.cpu_offload, self._process_group_backend)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- sharding ----------------------------------------------------------------------------
    @property
    def mixed_precision_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.precision_plugin.precision == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def setup(self, trainer) -> None:
        from torch.distributed.fsdp import FSDPModule

        module = self.lightning_module
        assert module is not None
        if not isinstance(module, FSDPModule):
            self._shard(module)
        super().setup(trainer)
        self._report_shards(module)
        # `validate`, `test` and `predict` under no_grad, as Lightning runs its FSDP1 strategy's (and a
        # fit's validation): on GPUs Lightning chose inference mode, in which FSDP2's first all-gather
        # failed at world size 1 ("Inference tensors do not track version counter") and made its
        # reused buffers inference tensors otherwise. Rehearsed by tests/distributed/test_fsdp2_no_grad.py.
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False

    def _shard(self, module: nn.Module) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, register_fsdp_forward_method

        model = getattr(module, "model", None)
        if not isinstance(model, nn.Module):
            raise TypeError(f"{type(self).__name__} expects a LightningModule with the Qwen3-TTS model at `.model`")
        weights = getattr(module, "pending_weights", None)
        if weights is not None:
            # The shards are allocated in the dtype each parameter is sharded with: a LoRA run's
            # frozen base takes its storage dtype (bf16 under bf16-mixed) while still on meta.
            weights.cast_frozen(model)
        apply_fully_shard(
            module,
            model,
            layer_classes=self.layer_classes,
            groups=self.groups,
            checkpoint_classes=self.checkpoint_classes,
            mesh=self.device_mesh,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self.mixed_precision_policy,
            offload_policy=CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        )
        # Generation calls the model's submodules, never the LightningModule's `forward`: running
        # `predict_step` as a forward makes the LightningModule the root state (FSDP2 otherwise takes
        # the first unit called) and gathers its own parameters (heads, norms, projections) for it.
        register_fsdp_forward_method(module, "predict_step")
        if weights is not None:
            self._materialize(module, model, weights)
            setattr(module, "pending_weights", None)

    def _materialize(self, module: nn.Module, model: nn.Module, weights) -> None:
        """Allocate every rank's shards (in host memory under ``cpu_offload``), then rank 0 reads and
        scatters the weights one tensor at a time. Only meta tensors are replaced: ``to_empty`` would
        also wipe the real ones (the MRoPE ``inv_freq`` buffers, the torchmetrics states and their
        reset values); those move as ``.to()`` moves them, values and dtype kept."""
        shards = torch.device("cpu") if self.cpu_offload else self.root_device
        root = self.root_device
        # Through the root FSDPModule's _apply, which re-registers the sharded parameters after it.
        module._apply(lambda t: torch.empty_like(t, device=shards) if t.is_meta else t.to(root))
        weights.fill_sharded(model, device=root, broadcast=self.world_size > 1)

    def model_to_device(self) -> None:
        """Under ``cpu_offload`` the sharded parameters stay in host memory (FSDP2 refuses them on
        the GPU); buffers and metric states go to the device."""
        if not self.cpu_offload:
            return super().model_to_device()
        from torch.distributed.tensor import DTensor

        assert self.model is not None
        root = self.root_device
        self.model._apply(lambda t: t if isinstance(t, DTensor) else t.to(root))

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's ``predict_step`` runs as an FSDP forward (registered in `_shard`:
        the root's own parameters gathered, the LightningModule the root state); the units gather
        and free their parameters around each call, on every rank in lockstep, as under FSDP1.
        Free the root's parameters after each predict step whatever ``reshard_after_forward``
        says (torch keeps a root's gathered when it is left unset)."""
        from torch.distributed.fsdp import FSDPModule

        module: Any = self.lightning_module  # fully_shard made it an FSDPModule too
        try:
            return super().predict_step(*args, **kwargs)
        finally:
            if isinstance(module, FSDPModule):
                module.reshard()

    # -- checkpoints -------------------------------------------------------------------------
    _sharded_state_key = "state_dict"  # ModelParallelStrategy's layout: {"state_dict": ..., "optimizer_0": ...}

    def _writes_sharded(self) -> bool:
        return self._save_distributed_checkpoint

    def _adapter_module(self) -> nn.Module | None:
        """The LightningModule when it trains LoRA adapters (its checkpoints hold the trainable
        tensors and buffers only: `Qwen3TTSModule.frozen_keys`), else None."""
        module = self.lightning_module
        if module is None or getattr(module, "adapter", None) is None or not getattr(module, "frozen_keys", None):
            return None
        return module

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Lightning's, but with an adapter the frozen base is left out before anything is gathered
        or copied (``ignore_frozen_params``): only the trainable tensors and buffers are saved."""
        if self._adapter_module() is None:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(
            full_state_dict=not self._save_distributed_checkpoint, cpu_offload=True, ignore_frozen_params=True
        )
        assert self.model is not None
        return get_model_state_dict(self.model, options=options)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from tts_lightning.distributed import rank_local_state

        quantized = rank_local_state.optimizer_state(self, optimizer)  # torchao's 8/4-bit: saved per rank
        return super().optimizer_state(optimizer) if quantized is None else quantized

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from tts_lightning.distributed import rank_local_state

        return rank_local_state.load_checkpoint(self, checkpoint_path, lambda p: self._load_checkpoint(p, weights_only))

    def _load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any]:
        """Lightning's, plus a LoRA run's checkpoints, which hold only the trainable tensors and
        buffers: every trainable tensor must be there; the frozen base keeps the values it was built
        with (the pretrained directory's). A sharded checkpoint is read key by key into the module's
        own shards (Lightning would ask it for the frozen keys too); a full one goes through
        Lightning's loading, which skips absent keys when ``strict_loading`` is off (it is for
        adapters)."""
        from lightning.fabric.strategies.fsdp import _is_full_checkpoint, _is_sharded_checkpoint
        from torch.distributed.checkpoint import FileSystemReader

        path = self.check_on_every_node(checkpoint_path)
        if _is_sharded_checkpoint(path):  # torchrun, SLURM: no CLI check before
            metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
            refuse_other_strategy(path, sharded_prefix(metadata), self.SHARDED_PREFIX)
        module = self._adapter_module()
        if module is None:
            return super().load_checkpoint(path, weights_only)

        if _is_full_checkpoint(path):
            from lightning.fabric.utilities.load import _lazy_load

            check_trainable(module, set(_lazy_load(path)["state_dict"]), path)
            return super().load_checkpoint(path, weights_only)
        if not _is_sharded_checkpoint(path):
            return super().load_checkpoint(path, weights_only)  # Lightning's error for a bad path
        from lightning.fabric.utilities.load import _METADATA_FILENAME
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # ModelParallelStrategy's layout: {"state_dict": ..., "optimizer_0": ...}; `metadata` read above
        stored = {k[len(FSDP2_PREFIX) :] for k in metadata if k.startswith(FSDP2_PREFIX)}
        check_trainable(module, stored, path)
        assert self.model is not None
        # The module's own DTensor shards by key: DCP reads the checkpoint's pieces straight into them.
        state = {k: v for k, v in get_model_state_dict(self.model).items() if k in stored}
        load({"state_dict": state}, checkpoint_id=path)
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=False))
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            load(optim_state, checkpoint_id=path)
            set_optimizer_state_dict(
                self.model, optimizer, optim_state_dict=optim_state[key], options=StateDictOptions(cpu_offload=True)
            )
        return torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=weights_only)

    def _report_shards(self, module: nn.Module) -> None:
        """Say on every rank how much of the model it holds (the first thing to check when memory
        does not fit) and in how many units."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())
        total = torch.tensor([local], dtype=torch.long, device=self.root_device)  # NCCL: never CPU
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        units = len({id(m._get_fsdp_state()) for m in fsdp2_modules(module)}) if isinstance(module, FSDPModule) else 0
        print(
            f"[rank {self.global_rank}] FSDP2 fully_shard: {local:,} of {int(total):,} parameters held locally "
            f"({100 * local / max(int(total), 1):.1f}%) in {units} units",
            flush=True,
        )


def apply_fully_shard(
    root: nn.Module,
    model: nn.Module,
    *,
    layer_classes: tuple[type[nn.Module], ...],
    groups: list[list[str]] | tuple[tuple[str, ...], ...],
    checkpoint_classes: tuple[type[nn.Module], ...] = (),
    **kwargs: Any,
) -> None:
    """The FSDP2 layout: composable activation checkpointing of ``checkpoint_classes``, one unit per
    ``layer_classes`` module of ``model``, one per list of module-name globs in ``groups`` (the
    outermost matching modules; the members of a list are one unit), then ``root`` (``model`` or a
    module holding it, whose ``forward`` runs first). ``kwargs`` go to every ``fully_shard``."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.fsdp import fully_shard

    from tts_lightning.model.row_blocks import RowBlockEmbedding

    for sub in model.modules():
        if isinstance(sub, RowBlockEmbedding):
            sub.anchor_backward = True  # each block's post-backward right after its gradient
    if checkpoint_classes:
        from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSDecoderLayer

        for sub in model.modules():
            if isinstance(sub, checkpoint_classes) and isinstance(sub, Qwen3TTSDecoderLayer):
                checkpoint_by_rows(sub, checkpointed=False)  # the code predictor: by blocks of frames
            elif isinstance(sub, checkpoint_classes):
                checkpoint(sub)
    for sub in model.modules():
        if isinstance(sub, layer_classes):
            fully_shard(sub, **kwargs)
    modules = dict(model.named_modules())
    for globs in groups:
        names = group_members(model, globs)
        if names is not None:
            members = [modules[n] for n in names]
            fully_shard(members if len(members) > 1 else members[0], **kwargs)
    fully_shard(root, **kwargs)


def group_members(model: nn.Module, globs: Sequence[str]) -> list[str] | None:
    """The names of the modules of ``model`` that one group of module-name ``globs`` shards as one
    unit: the outermost matches only ("speaker_encoder" takes the whole encoder). None for the
    default ``speaker_encoder`` group on a model without one (a custom_voice model): a group to leave
    out, not an error. `apply_fully_shard` and the memory planner both ask, so the planner's units
    are the strategy's."""
    matched = [n for n, _ in model.named_modules() if n and any(fnmatch.fnmatchcase(n, g) for g in globs)]
    members = [n for n in matched if not any(n.startswith(f"{m}.") for m in matched)]
    if not members and tuple(globs) == ("speaker_encoder",) and getattr(model, "speaker_encoder", 1) is None:
        return None
    if not members:
        raise ValueError(f"FSDP2 group {list(globs)} matches no module of the model")
    return members


def fsdp2_modules(module: nn.Module) -> list[FSDPModule]:
    """The modules of ``module`` managed by ``fully_shard`` (a group counts each of its members)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]
