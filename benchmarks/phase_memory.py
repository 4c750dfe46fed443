"""Host memory of every phase of a real-size run on this CPU machine, beside the planner's figure for
each: start (model built, loaded and sharded), training steps, validation, a sharded checkpoint
save, and a resume (the model built and the checkpoint read back) followed by one more step.

The run is `tts-lightning fit` with 2 ranks (Lightning's launcher, the real CLI, strategy and
module) of ``--config`` (default configs/tiny-cpu.yaml: FSDP1, fp32) on a released-size Base
directory with random weights (benchmarks/released_dir.py), ``--frames`` padded positions per
batch: 2 steps, a validation and its checkpoint (best + last), then a second `fit` resumed from
``last`` for one more step. A probe callback (benchmarks/memory_probe.py `PhaseMemory`) samples
each rank's RSS every 5 ms and keeps each phase's peak.

Printed per phase: the peak RSS summed over both ranks (what must fit the machine: the goal of
issue 28 is <= 21 GiB in every phase, the save at most 1 GiB above the step), and the RSS above the
pre-model level beside the planner's bytes for that phase (`plan_from_config` on the same config and
overrides; its CUDA constant left out, its per-GPU figure times 2). RSS also holds allocator caching
and ~1 GiB of imports per process (in the baseline). The live heap column is glibc's heap in use
(``mallinfo2``) at its peak above the baseline's: RSS without the freed blocks glibc keeps mapped
(run with ``MALLOC_MMAP_THRESHOLD_=65536`` in the environment to return them, and RSS follows it).

    PYTHONPATH=. python benchmarks/phase_memory.py                                     # ~10 min, ~20 GiB
    PYTHONPATH=. python benchmarks/phase_memory.py --config configs/tiny-cpu-fsdp2.yaml  # FSDP2
    PYTHONPATH=. python benchmarks/phase_memory.py --size 1.7b --validate                # 1.7B validate
    PYTHONPATH=. python benchmarks/phase_memory.py --small     # ~93M parameters, ~5 GiB (--talker-layers N: mid size)
    PYTHONPATH=. python benchmarks/phase_memory.py --small --trim  # glibc's malloc_trim at each phase and step
    PYTHONPATH=. python benchmarks/phase_memory.py --samples   # with the samples callback (validation end)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30


def command(args: list[str], work: Path, name: str = "fit") -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # glibc's allocator as users run it (not the Makefile's test settings)
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'benchmarks'}",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run([sys.executable, "-m", "tts_lightning", name, *args], cwd=REPO, env=env, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}); its output is above")


def largest_parameter(pretrained: Path) -> int:
    """Values in the model's largest parameter (read from the config on the meta device)."""
    from tts_lightning.distributed.memory import resolve_config
    from tts_lightning.distributed.memory.shapes import build_meta_model

    return max(p.numel() for p in build_meta_model(resolve_config(pretrained)[1]).parameters())


def phases(folder: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Per phase: the summed peak RSS, and the summed peak above each rank's baseline."""
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    names = [p for p in ranks[0]["peaks"] if all(p in r["peaks"] for r in ranks)]
    total = {p: sum(r["peaks"][p] for r in ranks) for p in names}
    above = {p: sum(r["peaks"][p] - r["baseline"] for r in ranks) for p in names}
    return total, above


def live_heap(folder: Path) -> dict[str, int]:
    """Per phase: glibc's live heap at its peak (sampled every 50 ms) above the baseline's, summed
    over the ranks: the bytes of live objects, without the freed blocks the allocator keeps."""
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    names = [p for p in ranks[0]["in_use_peaks"] if all(p in r["in_use_peaks"] for r in ranks)]
    return {p: sum(r["in_use_peaks"][p] - r["heap"]["baseline"]["in_use"] for r in ranks) for p in names}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--size", default="0.6b", choices=("0.6b", "1.7b"))
    parser.add_argument("--frames", type=int, default=60, help="data.max_frames_per_batch")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bench" / "phases")
    parser.add_argument(
        "--talker-layers", type=int, help="that many talker decoder layers (a mid-size model; the planner follows)"
    )
    parser.add_argument("--small", action="store_true", help="released_dir.SMALL's sizes (~93M parameters)")
    parser.add_argument("--validate", action="store_true", help="only `validate` the pretrained weights")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) at each phase's and step's start")
    parser.add_argument(
        "--samples", action="store_true", help="with SpeakerSamplesCallback (8 new tokens, no similarity scorer)"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    from released_dir import build_released_dir

    from tts_lightning.distributed.memory import CUDA_OVERHEAD_BYTES, plan_from_config

    name = f"released-{args.size}" + (f"-{args.talker_layers}layers" if args.talker_layers else "")
    name += "-small" if args.small else ""
    pretrained = build_released_dir(
        args.size, REPO / "runs" / "bench" / name, talker_layers=args.talker_layers, small=args.small
    )
    shutil.rmtree(args.work / "run", ignore_errors=True)
    overrides = [
        "--data.pretrained",
        str(pretrained),
        "--data.max_frames_per_batch",
        str(args.frames),
        "--trainer.val_check_interval",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.num_sanity_val_steps",
        "0",
    ]
    samples = []
    if args.samples:  # rank 0 gathers the full weights to host memory and generates at the validation's end
        samples += ["--trainer.callbacks+=tts_lightning.callbacks.SpeakerSamplesCallback"]
        samples += ["--trainer.callbacks.max_new_tokens", "8", "--trainer.callbacks.similarity", "false"]
    common = [
        "--config",
        args.config,
        *overrides,
        *samples,
        "--data.cache_dir",
        str(args.work / "cache"),
        "--trainer.default_root_dir",
        str(args.work / "run"),
        "--trainer.callbacks+=memory_probe.PhaseMemory",
        *(["--trainer.callbacks.trim", "true"] if args.trim else []),
    ]
    if args.validate:
        command([*common, "--trainer.callbacks.out_dir", str(args.work / "validate")], args.work, "validate")
        total, above = phases(args.work / "validate")
        print(f"\nvalidate, {args.size}, {args.config}, 2 ranks (RSS in GiB, summed over ranks)")
        for name in total:
            print(f"{name:20}{total[name] / GiB:10.2f}{above[name] / GiB:16.2f}")
        return 0
    command([*common, "--trainer.callbacks.out_dir", str(args.work / "fit"), "--trainer.max_steps", "2"], args.work)
    command(
        [*common, "--trainer.callbacks.out_dir", str(args.work / "resume"), "--trainer.max_steps", "3"]
        + ["--ckpt_path", "last"],
        args.work,
    )
    plan = plan_from_config(args.config, 1000, overrides=overrides)
    planned = {
        "start": plan.startup,
        "step": plan.total,
        "save": plan.checkpoint_save,
        "resume": plan.resume,
    }
    planned = {k: 2 * (v - CUDA_OVERHEAD_BYTES) for k, v in planned.items()}  # two ranks, no CUDA here
    if args.samples:
        # Rank 0 in a sampling round: what the planner's phase holds besides the copy (its GPU is this
        # host), and the larger of the copy with its KV cache and the full fp32 weights gathered to
        # host memory while the copy is built from them: each gathered value is freed once copied, so
        # the gathered state and the copy together stay at one model, plus the copy's parameter being
        # allocated before its gathered value goes (the largest: the text embedding). Rank 1 holds
        # its parameters, and after the steps its optimizer state.
        sampled = plan_from_config(args.config, 1000, overrides=[*overrides, *samples])
        generation = max(sampled.samples_model + sampled.samples_cache, sampled.speech_tokenizer)
        copy_bytes = sampled.samples_model // sampled.total_parameters
        building = 4 * plan.total_parameters + copy_bytes * largest_parameter(pretrained)
        held = sampled.samples_total - CUDA_OVERHEAD_BYTES - generation
        rank1 = plan.parameters + plan.optimizer_states
        planned["validation end"] = held + max(building, generation) + rank1
        # The baseline round at the start: the same, before any optimizer state exists.
        planned["start"] = max(planned["start"], 2 * plan.parameters + max(building, generation))
    fit_total, fit_above = phases(args.work / "fit")
    resume_total, resume_above = phases(args.work / "resume")
    fit_live, resume_live = live_heap(args.work / "fit"), live_heap(args.work / "resume")
    live = {
        "start": fit_live.get("start"),
        "step": fit_live.get("step"),
        "validate": fit_live.get("validate"),
        "validation end": fit_live.get("validation end"),
        "save": fit_live.get("save"),
        "resume": resume_live.get("start"),
        "step after resume": resume_live.get("step"),
    }
    rows = [
        ("start", fit_total.get("start"), fit_above.get("start"), planned["start"]),
        ("step", fit_total.get("step"), fit_above.get("step"), planned["step"]),
        ("validate", fit_total.get("validate"), fit_above.get("validate"), None),
        (
            "validation end",
            fit_total.get("validation end"),
            fit_above.get("validation end"),
            planned.get("validation end"),
        ),
        ("save", fit_total.get("save"), fit_above.get("save"), planned["save"]),
        ("resume", resume_total.get("start"), resume_above.get("start"), planned["resume"]),
        ("step after resume", resume_total.get("step"), resume_above.get("step"), planned["step"]),
    ]
    print(f"\n{name}, {args.config}, 2 ranks, {args.frames} positions per batch (RSS in GiB, summed over ranks)")
    print(
        f"{'phase':20}{'peak RSS':>10}{'above baseline':>16}{'planner':>10}{'meas/plan':>11}"
        f"{'live heap':>11}{'live/plan':>11}"
    )
    for name, total, above, plan_bytes in rows:
        if total is None:
            continue
        ratio = f"{above / plan_bytes:11.2f}" if plan_bytes else f"{'':11}"
        planner = f"{plan_bytes / GiB:10.2f}" if plan_bytes is not None else f"{'':10}"
        heap = live.get(name)
        heap_text = f"{heap / GiB:11.2f}" if heap is not None else f"{'':11}"
        heap_ratio = f"{heap / plan_bytes:11.2f}" if heap is not None and plan_bytes else ""
        print(f"{name:20}{total / GiB:10.2f}{above / GiB:16.2f}{planner}{ratio}{heap_text}{heap_ratio}")
    print(f"save - step: {(fit_total['save'] - fit_total['step']) / GiB:+.2f} GiB (goal <= +1)")
    worst = max(t for _, t, _, _ in rows if t is not None)
    print(f"highest phase: {worst / GiB:.2f} GiB (goal <= 21 on this 24 GiB machine)")
    (args.work / "phases.json").write_text(
        json.dumps(
            {"rows": rows, "live": live, "config": args.config, "size": args.size, "frames": args.frames}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
