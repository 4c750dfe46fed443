"""`tts-lightning plan`: will a fine-tuning run fit in GPU memory? Prints the per-GPU breakdown
and, when it does not fit, what to turn on, cheapest first. FSDP1 (`Qwen3TTSFSDPStrategy`) or FSDP2
(``--strategy fsdp2``, `Qwen3TTSFSDP2Strategy`); with ``--config`` the strategy is the config's.
Exit status 0 if it fits, 1 if not, 2 on a usage or configuration error. No GPU and no network
needed: the model is built on the meta device."""

from __future__ import annotations

import argparse
import json
import sys

from tts_lightning.distributed.memory import DEFAULT_FREEZE, PRECISIONS, PRESETS, SHARDINGS
from tts_lightning.errors import ConfigError
from tts_lightning.model.optimizers import CAVEATS, OPTIMIZERS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tts-lightning plan",
        description="Per-GPU memory plan for FSDP fine-tuning of Qwen3-TTS (no GPU needed).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help=f"preset ({', '.join(PRESETS)}), released hub id, or pretrained directory")
    source.add_argument(
        "--config",
        help="a LightningCLI YAML (tts-lightning fit --config ...), read as `fit` reads it; `fit`'s "
        "overrides may follow (--trainer.devices 8, --data.max_frames_per_batch 1000, ...), or "
        "`ray-fit`'s --ray.* options to plan that run (--ray.num_workers 8 --ray.use_gpu)",
    )
    parser.add_argument("--gpu-memory", type=float, required=True, help="memory of one GPU, GiB")
    parser.add_argument("--gpus", type=int, help="number of GPUs (default 1; with --config: trainer.devices)")
    parser.add_argument(
        "--strategy",
        choices=("fsdp", "fsdp2"),
        default="fsdp",
        help="fsdp: Qwen3TTSFSDPStrategy (FSDP1, flat parameters per unit); fsdp2: Qwen3TTSFSDP2Strategy "
        "(fully_shard; --sharding SHARD_GRAD_OP = reshard_after_forward false)",
    )
    parser.add_argument("--sharding", choices=SHARDINGS, default="FULL_SHARD")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed")
    parser.add_argument("--no-activation-checkpointing", action="store_true")
    parser.add_argument("--cpu-offload", action="store_true")
    parser.add_argument(
        "--freeze",
        nargs="*",
        metavar="PATTERN",
        help=f"frozen parameter patterns (default: {' '.join(DEFAULT_FREEZE)}; '--freeze' alone freezes nothing)",
    )
    parser.add_argument(
        "--frames", type=int, default=2000, help="padded talker positions per micro-batch (data.max_frames_per_batch)"
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        metavar="R",
        help="plan LoRA adapters of rank R (alpha 2R, the default targets) instead of full fine-tuning",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="model.optimizer: adamw (fp32 states), adamw8bit / adamw4bit (quantized moments; 4 bits trains "
        "slower), bf16_sr / bf16_sr_adamw8bit (bf16 weights, stochastic rounding; bf16-mixed only)",
    )
    return parser


def plan_command(argv: list[str]) -> int:
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    if overrides and not args.config:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    if args.gpus is not None and args.gpus < 1:
        parser.error(f"--gpus must be >= 1, got {args.gpus}")
    from tts_lightning.distributed.memory import plan_from_config, plan_memory

    ray, overrides = _ray_options(overrides)

    if args.config:
        given = [
            flag
            for flag, value, default in (
                ("--strategy", args.strategy, "fsdp"),
                ("--sharding", args.sharding, "FULL_SHARD"),
                ("--precision", args.precision, "bf16-mixed"),
                ("--no-activation-checkpointing", args.no_activation_checkpointing, False),
                ("--cpu-offload", args.cpu_offload, False),
                ("--freeze", args.freeze, None),
                ("--frames", args.frames, 2000),
                ("--lora-rank", args.lora_rank, None),
                ("--optimizer", args.optimizer, "adamw"),
            )
            if value != default
        ]
        if given:
            parser.error(f"with --config the settings come from the YAML; drop {', '.join(given)}")
    try:
        if args.config:
            gpus = args.gpus if args.gpus is not None or ray is None else ray.num_workers
            every_n = None if ray is None else ray.checkpoint_every_n_steps
            plan = plan_from_config(
                args.config, args.gpu_memory, gpus=gpus, overrides=overrides, ray_checkpoint_every_n_steps=every_n
            )
        else:
            plan = plan_memory(
                args.model,
                gpus=args.gpus or 1,
                gpu_memory_gb=args.gpu_memory,
                sharding=args.sharding,
                precision=args.precision,
                activation_checkpointing=not args.no_activation_checkpointing,
                cpu_offload=args.cpu_offload,
                freeze=list(DEFAULT_FREEZE) if args.freeze is None else args.freeze,
                micro_batch_frames=args.frames,
                adapter=None if args.lora_rank is None else {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank},
                layout="fsdp2" if args.strategy == "fsdp2" else "fsdp1",
                optimizer=args.optimizer,
            )
    except json.JSONDecodeError as exc:  # a pretrained directory's config.json (the planner reads it)
        where = f"{args.model}: its config.json" if args.model else f"the pretrained config.json {args.config} names"
        raise ConfigError(f"{where} is not valid JSON ({exc})") from None
    print(plan.table())
    print(options_summary(plan))
    if plan.fits:
        print(
            f"FITS: {plan.total / 2**30:.1f} GiB of {plan.gpu_memory / 2**30:.1f} GiB per GPU "
            f"({plan.headroom / 2**30:.1f} GiB headroom)"
        )
        return 0
    print(f"DOES NOT FIT: {plan.total / 2**30:.1f} GiB needed, {plan.gpu_memory / 2**30:.1f} GiB per GPU")
    if plan.advice:
        print("To make it fit, in order of cost (each step includes the ones before it, except 'or'):")
        for line in plan.advice:
            print(f"  - {line}")
    return 1


def _ray_options(overrides: list[str]) -> tuple[argparse.Namespace | None, list[str]]:
    """`ray-fit`'s ``--ray.*`` options among the overrides (parsed as ray-fit parses them; None when
    there are none), and the overrides left for LightningCLI."""
    if not any(o.startswith("--ray.") for o in overrides):
        return None, overrides
    from tts_lightning.distributed.ray_cli import build_parser, options_problem

    parser = build_parser()
    parser.prog = "tts-lightning plan"
    options, rest = parser.parse_known_args(overrides)
    problem = options_problem(options)
    if problem is None and not options.use_gpu:
        problem = "ray-fit without --ray.use_gpu trains on CPU workers; add --ray.use_gpu to plan its GPUs"
    if problem is not None:
        parser.error(problem)
    return options, rest


def options_summary(plan) -> str:
    """The same run under every ``model.optimizer``, cheapest in memory last (the bf16 ones at bf16-mixed)."""
    from dataclasses import replace

    from tts_lightning.distributed.memory import plan_memory

    lines = ["model.optimizer options (the same run; README 'Out of memory?'):"]
    model, settings = plan.planned
    for name in OPTIMIZERS:
        precision = "bf16-mixed" if name.startswith("bf16_sr") else settings.precision
        trial = plan_memory(model, advise=False, **vars(replace(settings, optimizer=name, precision=precision)))
        verdict = "fits" if trial.fits else "does not fit"
        marker = " <- this plan" if name == plan.optimizer and precision == plan.precision else ""
        caveat = f" ({CAVEATS[name]})" if name in CAVEATS else ""
        lines.append(f"  {name:<18} {trial.total / 2**30:6.1f} GiB per GPU, {verdict}{caveat}{marker}")
    return "\n".join(lines)


def main() -> None:  # pragma: no cover
    from tts_lightning.errors import report_errors

    sys.exit(report_errors("plan", lambda: plan_command(sys.argv[1:])))


if __name__ == "__main__":  # pragma: no cover
    main()
