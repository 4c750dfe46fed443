"""`tts-lightning ray-fit`: train a LightningCLI config on a Ray cluster (Ray Train `TorchTrainer`).

    tts-lightning ray-fit --config configs/tiny-cpu.yaml --ray.num_workers 2 --trainer.max_steps 10
    tts-lightning ray-fit --config my.yaml --ray.address auto --ray.num_workers 8 --ray.use_gpu \\
        --ray.storage_path s3://bucket/runs --ray.max_failures 3

``--ray.*`` options (and ``--ckpt_path``) belong to this command; every other argument goes to
LightningCLI untouched (``tts-lightning fit --help`` lists them). Ray is an optional extra:
``pip install 'tts-lightning[ray]'``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

INSTALL_HINT = "pip install 'tts-lightning[ray]'"

DESCRIPTION = """\
Fine-tune with the same LightningCLI config as `fit`, on a Ray cluster.

The driver (this process) checks the config and prepares the data once (codec tokens, speaker
embeddings, index) into data.cache_dir; then a Ray Train TorchTrainer starts --ray.num_workers
workers, one training process each, with the config's FSDP strategy in its Ray variant, init_args
kept: FSDP1 (auto, fsdp or Qwen3TTSFSDPStrategy -> RayQwen3TTSFSDPStrategy) or FSDP2
(Qwen3TTSFSDP2Strategy -> RayQwen3TTSFSDP2Strategy); any other strategy is refused before Ray
starts. The config's trainer.devices and trainer.num_nodes are replaced by Ray's workers,
trainer.accelerator by --ray.use_gpu (gloo on CPU, nccl on GPU; a config on accelerator gpu
without --ray.use_gpu is refused: it would train on CPU workers). On a multi-node cluster
data.cache_dir (and the config's paths) must be shared storage, mounted at the same path on every
node.

Checkpoints are reported to Ray every --ray.checkpoint_every_n_steps steps (0: each epoch end)
and at the end, into <storage_path>/<name>/checkpoint_stepNNNNNN/checkpoint.ckpt (a sharded
folder or one file, as trainer.strategy.state_dict_type says); `tts-lightning export --ckpt` takes
it. After a worker failure, Ray restarts the workers (--ray.max_failures times) and they resume
from the latest reported checkpoint: step, optimizer, LR schedule and data position. Running
again with the same --ray.name and --ray.storage_path also resumes from there. The config's
`checkpoint:` (ModelCheckpoint) still writes into trainer.default_root_dir as in `fit`.

All other arguments go to LightningCLI untouched: --config FILE, --trainer.max_steps 10, ...
(see `tts-lightning fit --help`)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tts-lightning ray-fit",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    ray = parser.add_argument_group("Ray options")
    ray.add_argument(
        "--ray.address",
        dest="address",
        default="local",
        help="'local' (default): start a one-machine Ray cluster for this run; 'auto': join "
        "the running cluster (`ray start --head`); or an address such as ray://host:10001",
    )
    ray.add_argument(
        "--ray.num_workers",
        dest="num_workers",
        type=int,
        default=2,
        help="training processes (replaces trainer.devices x trainer.num_nodes; default 2)",
    )
    ray.add_argument(
        "--ray.use_gpu",
        dest="use_gpu",
        action="store_true",
        help="one GPU per worker, accelerator gpu, nccl (default: CPU, gloo)",
    )
    ray.add_argument(
        "--ray.resources_per_worker",
        dest="resources_per_worker",
        type=_json_resources,
        help='JSON, e.g. \'{"CPU": 4, "GPU": 1}\' (default {"CPU": 1}, plus "GPU": 1 with --ray.use_gpu)',
    )
    ray.add_argument(
        "--ray.max_failures",
        dest="max_failures",
        type=int,
        default=0,
        help="worker-group restarts allowed, each resuming from the latest checkpoint (default 0; -1: unlimited)",
    )
    ray.add_argument(
        "--ray.storage_path",
        dest="storage_path",
        help="where Ray keeps checkpoints: a shared folder or URI such as s3://... on a "
        "multi-node cluster (default <trainer.default_root_dir>/ray)",
    )
    ray.add_argument(
        "--ray.name",
        dest="name",
        help="run name, the folder under the storage path (default tts-lightning-<time>); "
        "an existing run's name resumes it",
    )
    ray.add_argument(
        "--ray.checkpoint_every_n_steps",
        dest="checkpoint_every_n_steps",
        type=int,
        default=0,
        help="report a checkpoint every N optimizer steps (default 0: at each epoch end); always once more at the end",
    )
    ray.add_argument(
        "--ray.num_to_keep",
        dest="num_to_keep",
        type=int,
        help="keep only the newest K reported checkpoints (default: all)",
    )
    parser.add_argument(
        "--ckpt_path",
        help="start the first attempt from this Lightning checkpoint "
        "(ignored when Ray has a reported checkpoint to resume from)",
    )
    return parser


def options_problem(options: argparse.Namespace) -> str | None:
    """What is wrong with parsed ``--ray.*`` options, in one line, or None. Checked before the driver
    prepares anything (Ray's own checks of the resources come only when its trainer is built)."""
    if options.num_workers < 1:
        return "--ray.num_workers must be >= 1"
    if options.checkpoint_every_n_steps < 0:
        return "--ray.checkpoint_every_n_steps must be >= 0"
    gpus = (options.resources_per_worker or {}).get("GPU")
    if gpus is not None and not options.use_gpu:
        return '--ray.resources_per_worker asks for "GPU" without --ray.use_gpu: add --ray.use_gpu, or drop "GPU"'
    if gpus is not None and gpus != 1:
        # A fraction puts two ranks on one GPU, which NCCL refuses; more than one leaves the rest idle
        # (Lightning's Ray environment gives each worker one device).
        return f'--ray.resources_per_worker "GPU": {gpus:g}: each worker trains on exactly one GPU; use "GPU": 1'
    return None


def _json_resources(text: str) -> dict[str, float]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) for v in value.values()):
        raise argparse.ArgumentTypeError('expected a JSON object of numbers, e.g. {"CPU": 2}')
    return {str(k): float(v) for k, v in value.items()}


def ray_missing() -> str | None:
    """Why Ray Train cannot be used here, or None when it can."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed"
    try:
        import ray.train.lightning  # noqa: F401
        import ray.train.torch  # noqa: F401
    except ImportError as exc:
        return f"Ray Train cannot be imported ({exc})"
    return None


def ray_fit_command(argv: list[str]) -> int:
    parser = build_parser()
    options, lightning_args = parser.parse_known_args(argv)
    stray = [a for a in lightning_args if a.startswith("--ray.") or a.startswith("--ray=")]
    if stray:
        parser.error(f"unknown Ray option(s): {' '.join(stray)}")
    problem = options_problem(options)
    if problem is not None:
        parser.error(problem)
    problem = ray_missing()
    if problem is not None:
        from tts_lightning.errors import UserError

        raise UserError(f"{problem}. Install it with: {INSTALL_HINT}")

    from tts_lightning.distributed.ray import RayFitError, RayOptions, describe_result, run

    values = vars(options)
    ckpt_path = values.pop("ckpt_path")  # checked on the driver before Ray starts (`prepare_on_driver`)
    ray_options = RayOptions(**values)
    try:
        # A user error in the config or the data, found before Ray starts, is reported by the
        # entry point like `fit`'s (tts_lightning.errors).
        result = run(lightning_args, ray_options, ckpt_path=ckpt_path)
    except RayFitError as exc:
        print(f"tts-lightning ray-fit: error: {exc}", file=sys.stderr)
        if exc.checkpoint is not None:
            print(f"tts-lightning ray-fit: latest checkpoint: {exc.checkpoint}", file=sys.stderr)
        return 1
    print(describe_result(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from tts_lightning.errors import report_errors

    args = list(sys.argv[1:] if argv is None else argv)
    return report_errors("ray-fit", lambda: ray_fit_command(args))


if __name__ == "__main__":
    sys.exit(main())
