"""Ray Train launcher: the same LightningCLI config, trained by a `TorchTrainer` on a Ray cluster.

Needs the ``ray`` extra (``pip install 'tts-lightning[ray]'``); `tts_lightning.distributed.ray_cli`
is the command (``tts-lightning ray-fit``) and checks for it before importing this module.

How a run goes:
1. The driver parses the config exactly as ``tts-lightning fit`` does (bad configs fail before Ray
   starts, and so does a ``trainer.strategy`` other than FSDP1 or FSDP2) and runs the data module's
   `prepare()` once: codec tokens, speaker embeddings and the index land in ``data.cache_dir``.
   Every worker reads that folder, so on a multi-node cluster it must be shared storage (NFS, ...)
   mounted at the same path; here it is the local disk.
2. Each Ray worker builds the model, data module and trainer from the same arguments, with the
   strategy replaced by its Ray variant, the config's init_args kept: `RayQwen3TTSFSDPStrategy`
   for FSDP1 (``auto``, ``fsdp`` or `Qwen3TTSFSDPStrategy`: its wrap / activation-checkpointing
   policies, bf16 buffer handling and CPU ``device_id`` fix) or `RayQwen3TTSFSDP2Strategy` for
   FSDP2 (`Qwen3TTSFSDP2Strategy`: ``fully_shard`` units, its data-parallel mesh built on Ray's
   process group), each with Ray's device and ranks; ``RayLightningEnvironment`` as cluster
   environment, one process per worker (the config's ``devices`` / ``num_nodes`` are replaced by
   Ray's workers) and `RayCheckpointReport`. Only global rank 0 runs ``prepare_data``, which finds
   everything cached and encodes nothing.
3. `RayCheckpointReport` (`ray_checkpoints.py`) saves a Lightning checkpoint every N optimizer
   steps (or each epoch end) and at the end, and reports it to Ray; Ray copies it to
   ``<storage_path>/<name>/checkpoint_stepNNNNNN/checkpoint.ckpt`` (a sharded folder in
   torch.distributed.checkpoint's layout, the same under FSDP1 and FSDP2, or one file). After a
   worker failure Ray restarts the worker group (``max_failures``) and each worker resumes with
   ``trainer.fit(..., ckpt_path=<latest reported checkpoint>)``: global step, optimizer, LR
   scheduler and the data position (the sampler's state) are restored.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import Strategy
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.lightning import RayFSDPStrategy, RayLightningEnvironment, prepare_trainer
from ray.train.torch import TorchConfig, TorchTrainer

from tts_lightning.cli import TTSLightningCLI, check_callback_speakers, cli_main
from tts_lightning.distributed.fsdp import Qwen3TTSFSDPStrategy
from tts_lightning.distributed.fsdp2 import Qwen3TTSFSDP2Strategy
from tts_lightning.distributed.processes import choose_backend
from tts_lightning.distributed.ray_checkpoints import RayCheckpointReport, checkpoint_file, latest_checkpoint
from tts_lightning.errors import ConfigError
from tts_lightning.ray_start import start_ray
from tts_lightning.resume_path import check_checkpoint


class RayQwen3TTSFSDPStrategy(Qwen3TTSFSDPStrategy, RayFSDPStrategy):
    """`Qwen3TTSFSDPStrategy` (wrap and checkpointing policies, fp32 buffers under bf16-mixed, CPU
    ``device_id`` fix, shard report) with Ray's device and ranks. Ray Train creates the process
    group before the worker function runs (gloo when no GPU is requested, else nccl), so
    ``process_group_backend`` and ``timeout`` act through the launcher's `TorchConfig`."""


class RayQwen3TTSFSDP2Strategy(Qwen3TTSFSDP2Strategy):
    """`Qwen3TTSFSDP2Strategy` (``fully_shard`` units, meta weights filled from rank 0, fp32
    buffers under bf16-mixed, shard report) with Ray's device and ranks: what Ray's
    `RayFSDPStrategy` sets for FSDP1 (its ``root_device``; the sampler's world size and global
    rank are the base class's already), with ranks from ``RayLightningEnvironment``.

    Ray Train creates the process group before the worker function runs (gloo when no GPU is
    requested, else nccl), so ``process_group_backend`` and ``timeout`` act through the launcher's
    `TorchConfig`: Lightning's ``_init_dist_connection`` finds the group initialized and returns,
    and the one-dimensional data-parallel mesh (``init_device_mesh``) is built on that group."""

    @property
    def root_device(self) -> torch.device:
        return ray.train.torch.get_device()

    def _get_process_group_backend(self) -> str:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return str(torch.distributed.get_backend())  # Ray's, not a guess from the device
        return super()._get_process_group_backend()


# The strategies ray-fit trains with, by class name (``trainer.strategy.class_path``'s last part).
RAY_STRATEGIES: dict[str, type[Strategy]] = {
    "Qwen3TTSFSDPStrategy": RayQwen3TTSFSDPStrategy,
    "RayQwen3TTSFSDPStrategy": RayQwen3TTSFSDPStrategy,
    "Qwen3TTSFSDP2Strategy": RayQwen3TTSFSDP2Strategy,
    "RayQwen3TTSFSDP2Strategy": RayQwen3TTSFSDP2Strategy,
}
_SUPPORTED = (
    "use auto or fsdp (FSDP1), tts_lightning.distributed.fsdp.Qwen3TTSFSDPStrategy (FSDP1) or "
    "tts_lightning.distributed.fsdp2.Qwen3TTSFSDP2Strategy (FSDP2)"
)


class RayFitError(RuntimeError):
    """The workers failed more often than ``max_failures`` allows. ``checkpoint`` is the newest
    committed Lightning checkpoint (None when none was)."""

    def __init__(self, message: str, *, run_dir: str, checkpoint: str | None) -> None:
        super().__init__(message)
        self.run_dir = run_dir
        self.checkpoint = checkpoint


@dataclass
class RayOptions:
    """The ``--ray.*`` options of ``tts-lightning ray-fit``."""

    address: str = "local"
    num_workers: int = 2
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    max_failures: int = 0
    storage_path: str | None = None
    name: str | None = None
    checkpoint_every_n_steps: int = 0
    num_to_keep: int | None = None
    env_vars: dict[str, str] = field(default_factory=dict)


# -- building the Lightning objects from the config ---------------------------------------------


def build_cli(args: list[str], trainer_overrides: Callable[[TTSLightningCLI], dict] | None) -> TTSLightningCLI:
    """``cli_main(args, run=False)`` with a hook on the Trainer: ``trainer_overrides(cli)`` returns
    Trainer arguments that replace the config's; with None no Trainer is built (the driver)."""

    class _RayCLI(TTSLightningCLI):
        def instantiate_trainer(self, **kwargs: Any) -> Trainer:
            if trainer_overrides is None:
                return None  # type: ignore[return-value]  # the driver builds no Trainer
            return super().instantiate_trainer(**{**kwargs, **trainer_overrides(self)})

    with warnings.catch_warnings():
        # `args` is all of sys.argv but the --ray.* options: intended, not a mistake.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        return cli_main(args, run=False, cli_class=_RayCLI)


def ray_strategy(strategy: Any) -> tuple[type[Strategy], dict[str, Any]]:
    """The Ray strategy class for the config's ``trainer.strategy`` and the init_args to build it
    with: `RayQwen3TTSFSDPStrategy` for ``auto`` / ``fsdp`` / unset (defaults) and
    `Qwen3TTSFSDPStrategy` (FSDP1), `RayQwen3TTSFSDP2Strategy` for `Qwen3TTSFSDP2Strategy` (FSDP2),
    each with the config's init_args. Any other strategy raises ConfigError (the driver calls this
    before Ray starts)."""
    if strategy is None or (isinstance(strategy, str) and strategy in ("auto", "fsdp")):
        return RayQwen3TTSFSDPStrategy, {}
    class_path = getattr(strategy, "class_path", None) if not isinstance(strategy, dict) else strategy.get("class_path")
    cls = None if class_path is None else RAY_STRATEGIES.get(str(class_path).rsplit(".", 1)[-1])
    if cls is None:
        named = f"={strategy!r}" if class_path is None else f" {class_path}"
        raise ConfigError(
            f"ray-fit trains with FSDP1 or FSDP2; trainer.strategy{named} is not supported ({_SUPPORTED})"
        )
    init = strategy.get("init_args") if isinstance(strategy, dict) else getattr(strategy, "init_args", None)
    if init is None:
        return cls, {}
    init = init.as_dict() if hasattr(init, "as_dict") else dict(init)
    # Set by the Trainer / Ray, never from YAML.
    for key in ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"):
        init.pop(key, None)
    return cls, init


def _ray_trainer_overrides(options: RayOptions, report: Callback) -> Callable[[TTSLightningCLI], dict]:
    def overrides(cli: TTSLightningCLI) -> dict[str, Any]:
        trainer_cfg = cli.config["trainer"]
        init_plugins = cli.config_init["trainer"].get("plugins") or []
        init_plugins = init_plugins if isinstance(init_plugins, list) else [init_plugins]
        callbacks = cli.config_init["trainer"].get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        strategy_class, strategy_args = ray_strategy(trainer_cfg.get("strategy"))
        return {
            "strategy": strategy_class(**strategy_args),
            "accelerator": "gpu" if options.use_gpu else "cpu",
            "devices": "auto",  # one process per Ray worker
            "num_nodes": 1,
            "plugins": [p for p in init_plugins if not isinstance(p, ClusterEnvironment)] + [RayLightningEnvironment()],
            # A new list: LightningCLI appends its extra callbacks to the one it is given.
            "callbacks": [*callbacks, report],
        }

    return overrides


# -- the worker -----------------------------------------------------------------------------------


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """What every Ray worker runs: build everything from the config, then fit or resume."""
    cwd = config.get("cwd")
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)  # relative paths of the config mean what they mean on the driver
    options = RayOptions(**config["options"])
    report = RayCheckpointReport(options.checkpoint_every_n_steps)
    cli = build_cli(list(config["args"]), _ray_trainer_overrides(options, report))
    trainer = _prepare_trainer(cli.trainer)
    # The driver prepared the cache; one process checks it (it finds everything cached).
    cli.datamodule.prepare_data_per_node = False

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=config.get("ckpt_path"))
        return
    with checkpoint.as_directory() as directory:
        ckpt_path = checkpoint_file(directory)
        if trainer.global_rank == 0:
            print(f"[ray-fit] resuming from {checkpoint.path} ({ckpt_path})", flush=True)
        trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=str(ckpt_path))


def _prepare_trainer(trainer: Trainer) -> Trainer:
    """Ray's `prepare_trainer` for its own strategy classes (FSDP1 here); it refuses any other, so
    for FSDP2 the same check of what it checks: Ray's cluster environment."""
    if isinstance(trainer.strategy, RayFSDPStrategy):
        return prepare_trainer(trainer)
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if not isinstance(environment, RayLightningEnvironment):
        raise RuntimeError(f"ray-fit needs RayLightningEnvironment as cluster environment, got {type(environment)}")
    return trainer


# -- the driver -----------------------------------------------------------------------------------


def worker_cpus(cluster: dict[str, float], use_gpu: bool, cpu_offload: bool) -> float:
    """CPUs each worker asks for, by default: one, except GPU workers under ``cpu_offload``, whose
    optimizer steps on the CPU: the cluster's CPUs per GPU (Ray then sets the worker's
    ``OMP_NUM_THREADS`` to that, and the strategy's threads follow it)."""
    if not (use_gpu and cpu_offload):
        return 1
    gpus = cluster.get("GPU", 0) or 1
    return float(max(1, int(cluster.get("CPU", 1) // gpus)))


def prepare_on_driver(args: list[str], ckpt_path: str | None = None, *, use_gpu: bool = False) -> TTSLightningCLI:
    """Parse and check the config as ``fit`` would (a new run into an earlier run's checkpoint
    folder refused, here: the workers build their trainers without `fit`'s checks), and prepare
    the data once, here."""
    cli = build_cli(args, None)
    strategy, _ = ray_strategy(cli.config["trainer"].get("strategy"))  # only FSDP1 / FSDP2, refused early
    if ckpt_path is not None:  # a sharded checkpoint of the other strategy: one line here, not on every worker
        check_checkpoint(ckpt_path, sharded_prefix=getattr(strategy, "SHARDED_PREFIX", None))
    check_callback_speakers(cli.config_init["trainer"].get("callbacks"), list(cli.datamodule.speaker_names))
    accelerator = str(cli.config["trainer"].get("accelerator") or "auto")
    if accelerator in ("gpu", "cuda") and not use_gpu:
        # Ray, not the config, places the workers: a GPU config would train on CPU workers.
        raise ConfigError(
            f"trainer.accelerator is {accelerator}, but without --ray.use_gpu Ray starts CPU workers: add "
            "--ray.use_gpu, or --trainer.accelerator cpu to train on CPU"
        )
    if ckpt_path is None:
        cli.refuse_an_earlier_runs_folder()
    cli.datamodule.prepare()
    return cli


def run(args: list[str], options: RayOptions, *, ckpt_path: str | None = None):
    """Prepare the data on the driver, then train on Ray. Returns Ray's `Result`; raises
    `RayFitError` when the workers fail more than ``max_failures`` times. ``args`` are LightningCLI
    arguments without a subcommand (``--config FILE --trainer.max_steps 10 ...``)."""
    cli = prepare_on_driver(args, ckpt_path, use_gpu=options.use_gpu)
    root = cli.config["trainer"].get("default_root_dir") or "runs"
    storage_path = options.storage_path or str(Path(root, "ray").expanduser().absolute())
    if "://" not in storage_path:
        storage_path = str(Path(storage_path).expanduser().absolute())
    name = options.name or f"tts-lightning-{time.strftime('%Y%m%d-%H%M%S')}"

    _, strategy_args = ray_strategy(cli.config["trainer"].get("strategy"))
    timeout: Any = strategy_args.get("timeout")
    offload = bool(strategy_args.get("cpu_offload", False))
    device = torch.device("cuda" if options.use_gpu else "cpu")
    torch_config = TorchConfig(
        backend=choose_backend(device, offload, strategy_args.get("process_group_backend")),
        timeout_s=int(timeout.total_seconds()) if hasattr(timeout, "total_seconds") else 1800,
    )
    resources = dict(options.resources_per_worker or {})
    resources.setdefault("CPU", 1)
    if options.use_gpu:
        resources.setdefault("GPU", 1)

    # A local cluster sized for the requested workers.
    started = start_ray(options.address, int(options.num_workers * resources["CPU"]), dict(options.env_vars))
    try:
        _check_every_node_sees(cli, storage_path, options.use_gpu)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    if "CPU" not in (options.resources_per_worker or {}):
        resources["CPU"] = worker_cpus(ray.cluster_resources(), options.use_gpu, offload)

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "args": list(args),
            "options": asdict(options),
            "cwd": os.getcwd(),
            "ckpt_path": ckpt_path,
        },
        scaling_config=ScalingConfig(
            num_workers=options.num_workers, use_gpu=options.use_gpu, resources_per_worker=resources
        ),
        torch_config=torch_config,
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=options.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=options.num_to_keep),
        ),
    )
    run_dir = f"{storage_path}/{name}"
    print(f"[ray-fit] run {name}: checkpoints under {run_dir}", flush=True)
    try:
        return trainer.fit()
    except ray.train.TrainingFailedError as exc:
        latest = latest_checkpoint(run_dir)
        raise RayFitError(
            f"training failed (max_failures={options.max_failures}): {type(exc).__name__}: {exc}",
            run_dir=run_dir,
            checkpoint=latest,
        ) from exc
    finally:
        if started:
            ray.shutdown()


def _check_every_node_sees(cli: TTSLightningCLI, storage_path: str, use_gpu: bool) -> None:
    """Refuse, in one line, folders that a node that may host a worker (a GPU node for GPU workers)
    does not see: the workers read the codes the driver prepared in ``data.cache_dir`` and hand
    their checkpoints to a local ``--ray.storage_path``. Ray checks its storage only when the first
    checkpoint is reported (after ``checkpoint_every_n_steps`` of training, on every retry); a
    missing cache failed on every worker."""
    folders = {"data.cache_dir": str(cli.datamodule.cache_dir)}
    if "://" not in storage_path:
        Path(storage_path).mkdir(parents=True, exist_ok=True)
        folders["--ray.storage_path"] = storage_path
    lacking = folders_missing_on_nodes(folders, gpu_nodes_only=use_gpu)
    if lacking:
        node, missing = next(iter(lacking.items()))
        named = ", ".join(f"{what} ({folders[what]})" for what in missing)
        raise ConfigError(
            f"node {node} of the Ray cluster does not see {named}: on several machines they must be on storage "
            "every node mounts at the same path (NFS; --ray.storage_path also takes s3://, gs://)"
        )


def folders_missing_on_nodes(folders: dict[str, str], *, gpu_nodes_only: bool = False) -> dict[str, list[str]]:
    """{node address: the names in ``folders`` (name: path) whose folder it lacks}, for every alive
    node of the Ray cluster this process is connected to (with ``gpu_nodes_only``, those with GPUs),
    each checked by a task pinned there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def missing(paths: dict[str, str]) -> list[str]:
        return [name for name, path in paths.items() if not os.path.isdir(path)]

    nodes = [n for n in ray.nodes() if n["Alive"] and (not gpu_nodes_only or n["Resources"].get("GPU", 0) > 0)]
    pending = [
        missing.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(folders)
        for n in nodes
    ]
    found = ray.get(pending)
    return {n["NodeManagerAddress"]: lacking for n, lacking in zip(nodes, found) if lacking}


def describe_result(result) -> str:
    """What a finished run prints: the latest checkpoint and its main metrics."""
    lines = []
    if result.checkpoint is not None:
        lines.append(f"latest checkpoint: {checkpoint_file(result.checkpoint.path)}")
    metrics = {k: result.metrics[k] for k in ("step", "epoch", "train/loss", "val/loss") if k in (result.metrics or {})}
    if metrics:
        lines.append("metrics: " + json.dumps(metrics))
    return "\n".join(lines)
