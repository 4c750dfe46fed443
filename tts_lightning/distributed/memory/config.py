"""`plan_from_config`: plan a `tts-lightning fit` config as `fit` reads it. The YAML goes through
this project's own LightningCLI (`tts_lightning.cli.cli_main` with `TTSLightningCLI`), stopped
before anything is instantiated, so defaults, ``class_path``/``init_args``, command-line overrides
(``--trainer.devices 8``) and linked arguments (``data.pretrained`` -> ``model.pretrained``) are
resolved exactly as `fit` resolves them; a config `fit` rejects ends the same way (``SystemExit``,
the message on stderr)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from tts_lightning.callbacks.samples import DEFAULT_TEXTS, MAX_SAMPLED_SPEAKERS
from tts_lightning.cli import TTSLightningCLI, cli_main
from tts_lightning.config_yaml import load_yaml_config
from tts_lightning.distributed.memory.plan import MemoryPlan, plan_memory
from tts_lightning.model.generation import GENERATION_ROWS
from tts_lightning.model.parameters import DEFAULT_FREEZE
from tts_lightning.model.row_blocks import DEFAULT_TEXT_EMBEDDING_BLOCKS

__all__ = ["parse_fit_config", "plan_from_config"]

PRECISION_PLANNED: dict[str, Literal["bf16-mixed", "32-true"]] = {
    "bf16-mixed": "bf16-mixed",
    "16-mixed": "bf16-mixed",
    "bf16": "bf16-mixed",
    "32-true": "32-true",
    "32": "32-true",
    "None": "32-true",  # the Trainer's default
}


class _ParseOnlyCLI(TTSLightningCLI):
    """`TTSLightningCLI` that parses and checks (``run=False``: the ``fit`` arguments without the
    subcommand) and instantiates nothing: no model, data module, trainer or callbacks."""

    def instantiate_classes(self) -> None:
        pass


def parse_fit_config(config_yaml_path: str | os.PathLike, *overrides: str) -> Any:
    """The config namespace `tts-lightning fit --config PATH OVERRIDES...` would instantiate.
    ``seed_everything`` is not applied (parsing must not reseed the caller's generators). A
    missing or bad YAML file is a `ConfigError` naming it."""
    load_yaml_config(config_yaml_path)
    with warnings.catch_warnings():
        # The arguments are given on purpose (the caller's own command line is not `fit`'s).
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        cli = cli_main(
            ["--config", str(config_yaml_path), *overrides, "--seed_everything", "false"],
            run=False,
            cli_class=_ParseOnlyCLI,
        )
    return cli.config


def _get(namespace: Any, key: str, default: Any = None) -> Any:
    if namespace is None:
        return default
    if isinstance(namespace, Mapping):
        return namespace.get(key, default)
    return getattr(namespace, key, default)


def _devices(devices: Any, num_nodes: Any) -> int | None:
    nodes = int(num_nodes or 1)
    if isinstance(devices, (list, tuple)):
        return len(devices) * nodes
    if isinstance(devices, str):
        if "," in devices:
            return len([d for d in devices.split(",") if d.strip()]) * nodes
        if not devices.strip().lstrip("-").isdigit():
            return None  # "auto": as many as the machine has
        devices = int(devices)
    count = int(devices)
    return None if count < 0 else count * nodes


def _class_names(class_path: str) -> set[str]:
    """The names of the class at ``class_path`` and of its bases (the CLI has imported it already)."""
    import importlib

    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return {c.__name__ for c in cls.__mro__}


def plan_from_config(
    config_yaml_path: str | os.PathLike,
    gpu_memory_gb: float,
    *,
    gpus: int | None = None,
    overrides: Sequence[str] = (),
    ray_checkpoint_every_n_steps: int | None = None,
) -> MemoryPlan:
    """Plan a `tts-lightning fit` config (with optional command-line ``overrides`` such as
    ``["--trainer.devices", "8"]``): the pretrained model (``data.pretrained``), ``model.freeze``
    and ``model.adapter``, ``trainer.devices`` x ``num_nodes`` (or ``gpus``), ``trainer.precision``,
    the strategy (`Qwen3TTSFSDPStrategy` or Lightning's FSDP: sharding, cpu_offload, activation
    checkpointing and wrap policy; `Qwen3TTSFSDP2Strategy`: the FSDP2 layout with its layer classes,
    groups and ``reshard_after_forward``), ``data.max_frames_per_batch``, a `SpeakerSamplesCallback`
    and when checkpoints and validation find the gradients held (`ModelCheckpoint` settings,
    validation, gradient accumulation). Plain ``ddp`` (or several
    devices with no strategy) is planned as NO_SHARD without checkpointing.

    For a `ray-fit` run, ``gpus`` is ``--ray.num_workers`` and ``ray_checkpoint_every_n_steps`` its
    ``--ray.checkpoint_every_n_steps``: when its reports are written (with the gradients held or not)."""
    path = str(config_yaml_path)
    cfg = parse_fit_config(path, *overrides)
    given = f"{path} with {' '.join(overrides)}" if overrides else path  # a bad value may be an override
    data, model_cfg, trainer = cfg.data, cfg.model, cfg.trainer
    pretrained = _pretrained(path, data, model_cfg)
    n = gpus if gpus is not None else _devices(_get(trainer, "devices", "auto"), _get(trainer, "num_nodes", 1))
    if n is None:
        raise ValueError(f"{given}: trainer.devices is {_get(trainer, 'devices')!r}; pass the GPU count")
    precision = PRECISION_PLANNED.get(str(_get(trainer, "precision")))
    if precision is None:
        raise ValueError(
            f"{given}: trainer.precision {_get(trainer, 'precision')!r} is not planned (bf16-mixed or 32-true)"
        )
    strategy = _strategy_layout(path, _get(trainer, "strategy", "auto"))
    full_checkpoints = _full_checkpoints(_get(trainer, "strategy", "auto"))
    freeze = _get(model_cfg, "freeze", list(DEFAULT_FREEZE))
    adapter = _get(model_cfg, "adapter")
    if adapter is not None and not isinstance(adapter, Mapping):
        adapter = adapter.as_dict() if hasattr(adapter, "as_dict") else vars(adapter)
    frames = _get(data, "max_frames_per_batch") or 2000
    samples = _samples_callback(trainer)
    sample_args = _get(samples, "init_args")
    texts = len(_get(sample_args, "texts") or DEFAULT_TEXTS)
    cap = _get(sample_args, "max_speakers", MAX_SAMPLED_SPEAKERS)  # without `speakers`: the run's, up to this many
    speakers = len(_get(sample_args, "speakers") or ()) or min(_speaker_count(data), cap or 10**9)
    every_n = ray_checkpoint_every_n_steps
    ray_reports_hold = every_n is not None and _ray_reports_hold_gradients(cfg, every_n)
    return plan_memory(
        pretrained,
        gpus=n,
        gpu_memory_gb=gpu_memory_gb,
        sharding=strategy.sharding,
        precision=precision,
        activation_checkpointing=strategy.checkpointing,
        cpu_offload=strategy.offload,
        freeze=list(freeze or []),
        micro_batch_frames=int(frames),
        auto_wrap_policy=strategy.wrap,
        samples=samples is not None,
        sample_frames=int(_get(sample_args, "max_new_tokens", 240) or 240),
        sample_rows=min(GENERATION_ROWS, texts * speakers),  # rows per generate call
        samples_at_start=bool(_get(sample_args, "baseline", True)) or _get(sample_args, "held_out") is not None,
        sample_asr=_get(sample_args, "asr"),
        adapter=dict(adapter) if isinstance(adapter, Mapping) else None,
        layout=strategy.layout,
        full_checkpoints=full_checkpoints,
        groups=strategy.groups,
        optimizer=str(_get(model_cfg, "optimizer", "adamw") or "adamw"),
        text_embedding_blocks=int(_get(model_cfg, "text_embedding_blocks", DEFAULT_TEXT_EMBEDDING_BLOCKS)),
        save_at_train_steps=_saves_hold_gradients(cfg) or ray_reports_hold,
        validation_holds_gradients=_validation_holds_gradients(trainer),
    )


def _checkpoint_callbacks(cfg: Any) -> list[Any]:
    """The init_args of every `ModelCheckpoint`: the ``checkpoint:`` section and any in trainer.callbacks."""
    callbacks = _get(_get(cfg, "trainer"), "callbacks") or []
    extra = [_get(c, "init_args") for c in callbacks if str(_get(c, "class_path", "")).endswith("ModelCheckpoint")]
    return [c for c in [_get(cfg, "checkpoint"), *extra] if c is not None]


def _validation(cfg: Any) -> tuple[bool, bool]:
    """Whether the run validates at all, and whether it validates at every epoch's end."""
    trainer, data = _get(cfg, "trainer"), _get(cfg, "data")
    none = _get(trainer, "limit_val_batches") == 0 or (
        not _get(data, "val_manifest") and not _get(data, "val_fraction", 0.1)
    )
    interval = _get(trainer, "val_check_interval")
    at_epoch_end = interval is None or (isinstance(interval, float) and interval == 1.0)  # int 1: every batch
    every_epoch = not none and _get(trainer, "check_val_every_n_epoch", 1) == 1 and at_epoch_end
    return not none, every_epoch


def _saves_hold_gradients(cfg: Any) -> bool:
    """Whether checkpoints can be written with the last step's gradients held: at training steps'
    ends, or at an epoch's end with no validation (none at all, or not every epoch) before it."""
    validates, every_epoch = _validation(cfg)
    checkpoints = _checkpoint_callbacks(cfg)
    return (not validates and bool(checkpoints)) or any(
        _get(c, "every_n_train_steps")
        or _get(c, "train_time_interval")
        or (_get(c, "save_on_train_epoch_end") and not every_epoch)
        for c in checkpoints
    )


def _ray_reports_hold_gradients(cfg: Any, every_n_steps: int) -> bool:
    """`ray-fit`'s reports (`RayCheckpointReport`) are written at a training step's end, the step's
    gradients held, every N steps and at ``max_steps``; otherwise at each epoch's end, after the
    epoch's validation (which releases them) when there is one."""
    max_steps = _get(_get(cfg, "trainer"), "max_steps", -1)
    return bool(every_n_steps) or (max_steps is not None and max_steps > 0) or not _validation(cfg)[1]


def _validation_holds_gradients(trainer: Any) -> bool:
    """Whether validation can start between the micro-batches of one step: Lightning releases the
    gradients before validation only at a step boundary. Accumulation windows restart with each
    epoch (whose last batch always steps), so validation every N batches of an epoch lands on a
    boundary when N is a multiple of the window; N batches counted across epochs
    (``check_val_every_n_epoch: null``), a fraction of the epoch or a time interval may not."""
    accumulate = int(_get(trainer, "accumulate_grad_batches", 1) or 1)
    interval = _get(trainer, "val_check_interval")
    if accumulate == 1 or interval is None:
        return False
    if isinstance(interval, bool) or not isinstance(interval, (int, float)):
        return True  # a time interval: validation starts whenever the clock says
    if isinstance(interval, float):
        return interval < 1.0
    return _get(trainer, "check_val_every_n_epoch", 1) is None or interval % accumulate != 0


def _full_checkpoints(strategy: Any) -> bool:
    """Whether the strategy writes full (one-file) checkpoints: its ``state_dict_type``, whose
    default is ``sharded`` for this project's strategies and ``full`` for Lightning's FSDP."""
    class_path = str(_get(strategy, "class_path") or "")
    if "FSDP" not in class_path and str(strategy).lower() != "fsdp":
        return False  # ddp, auto, single device: Lightning's one-file checkpoints, not FSDP's gather
    default = "sharded" if "Qwen3TTS" in class_path else "full"
    return str(_get(_get(strategy, "init_args"), "state_dict_type", None) or default) == "full"


def _speaker_count(data: Any) -> int:
    """The run's speakers, as the data module counts them (``data.speakers``, else the training
    manifest's); two where the manifest cannot be read here (a plan made before the data exists)."""
    from tts_lightning.data.prepare import DataPreparer, PrepareSettings
    from tts_lightning.errors import UserError

    arguments = data.as_dict() if hasattr(data, "as_dict") else dict(data or {})
    try:
        return len(DataPreparer(PrepareSettings.from_arguments(arguments)).requested_speakers()) or 2
    except (OSError, ValueError, UserError):  # a missing or unreadable manifest: `fit` says what is wrong
        return 2


def _pretrained(path: str, data: Any, model_cfg: Any) -> str:
    """The pretrained model the config trains (``data.pretrained``, else ``model.pretrained``); the
    embedded ``tiny`` resolved to its directory, built as `fit` builds it."""
    from tts_lightning.model.pretrained import resolve_pretrained

    pretrained = str(_get(data, "pretrained") or _get(model_cfg, "pretrained") or "")
    if not pretrained:
        raise ValueError(f"{path}: no data.pretrained")
    if pretrained == "tiny" and not os.path.isdir(pretrained):
        pretrained = str(resolve_pretrained(pretrained))  # the embedded tiny model, as `fit` builds it
    return pretrained


@dataclass
class _StrategyLayout:
    """What the planner needs of ``trainer.strategy``."""

    sharding: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
    offload: bool
    checkpointing: list[str]
    wrap: list[str] | None = None  # None: the strategy's default units
    layout: Literal["fsdp1", "fsdp2"] = "fsdp1"
    groups: list[list[str]] | None = None


def _strategy_layout(path: str, strategy: Any) -> _StrategyLayout:
    """``trainer.strategy`` as the planner sees it: a ``class_path`` (ours, FSDP1 or FSDP2, or
    Lightning's FSDP) with its init_args, ``fsdp``, or anything else (planned as NO_SHARD)."""
    class_path = _get(strategy, "class_path")
    if class_path:
        return _configured_strategy(path, str(class_path), _get(strategy, "init_args"))
    if str(strategy).lower().startswith("fsdp"):
        return _StrategyLayout("FULL_SHARD", offload=False, checkpointing=[], wrap=[])
    return _StrategyLayout("NO_SHARD", offload=False, checkpointing=[])  # ddp, auto, single device


def _configured_strategy(path: str, class_path: str, args: Any) -> _StrategyLayout:
    """A strategy given by ``class_path`` and ``init_args``."""
    from tts_lightning.distributed.fsdp import DEFAULT_CHECKPOINT

    names = _class_names(class_path)
    policy = _get(args, "activation_checkpointing_policy")
    offload = bool(_get(args, "cpu_offload", False))
    if "Qwen3TTSFSDP2Strategy" in names:
        sharding = "FULL_SHARD" if _get(args, "reshard_after_forward", True) else "SHARD_GRAD_OP"
        ckpt = list(DEFAULT_CHECKPOINT) if policy is None else list(policy)
        layers = _get(args, "layer_classes")
        raw_groups = _get(args, "groups")
        return _StrategyLayout(
            _planned_sharding(path, sharding),
            offload,
            ckpt,
            wrap=None if layers is None else list(layers),
            layout="fsdp2",
            groups=None if raw_groups is None else [list(g) for g in raw_groups],
        )
    ours = "Qwen3TTSFSDPStrategy" in names
    raw = _get(args, "sharding_strategy", "FULL_SHARD")
    sharding = str(getattr(raw, "name", raw))
    ckpt = list(DEFAULT_CHECKPOINT) if (policy is None and ours) else list(policy or [])
    wrap_policy = _get(args, "auto_wrap_policy")
    wrap = None if wrap_policy is None else list(wrap_policy)
    if wrap is None and not ours:
        wrap = []  # Lightning's FSDPStrategy without a policy: one unit, the root
    return _StrategyLayout(_planned_sharding(path, sharding), offload, ckpt, wrap)


def _planned_sharding(path: str, sharding: str) -> Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]:
    """``sharding``, if the planner plans it."""
    if sharding == "HYBRID_SHARD":
        raise ValueError(f"{path}: HYBRID_SHARD is not planned (plan FULL_SHARD with the GPUs of one node)")
    if sharding not in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        raise ValueError(f"{path}: sharding_strategy {sharding!r} is not planned")
    return cast(Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"], sharding)


def _samples_callback(trainer: Any) -> Any:
    """The config's `SpeakerSamplesCallback` (its ``class_path`` and ``init_args``), None without one."""
    return next(
        (
            c
            for c in _get(trainer, "callbacks") or []
            if str(_get(c, "class_path", "")).endswith("SpeakerSamplesCallback")
        ),
        None,
    )
