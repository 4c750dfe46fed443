"""Quality and step time of each `model.optimizer` on the tiny model: the demo's fit (configs/tiny-cpu.yaml:
2 FSDP ranks on CPU, the demo clips, 60 steps, validation at 20, 40 and 60), once per option, beside
fp32 AdamW (the default) over several seeds.

Each run is the real command, `tts-lightning fit --config configs/tiny-cpu.yaml --model.optimizer X`
(the bf16 options with ``--trainer.precision bf16-mixed``, as they require), seeded with
``--seed_everything S --data.seed S`` (the batch order). The demo's clips are split once into
training and validation manifests (2 clips of each speaker held out, ~17% as the demo's 15%), so
that every run validates on the same clips whatever its seed. Printed per option: the
final validation loss (``val/loss`` at step 60, from the run's TensorBoard file) beside the fp32
AdamW runs' range and mean +- sd, and its mean step time after ``--warmup`` steps (rank 0, from
the start of a training batch to its end: forward, backward, optimizer step; validation apart) over
the mean step time of the fp32 AdamW runs just before and after it, in wall time and in CPU time
of the rank's process (steadier on a shared machine). The runs are interleaved
(adamw, an option, adamw, the next option, ...) so that each ratio compares runs close in time on a
shared machine; the first step (allocations; on GPUs torchao's per-shape compile, none on the CPU,
where the update runs eagerly) is reported apart.

    PYTHONPATH=. python benchmarks/optimizer_quality.py                 # 9 fits, ~20-30 min on 2 cores
    PYTHONPATH=. python benchmarks/optimizer_quality.py --seeds 5 --option-seeds 2
    PYTHONPATH=. python benchmarks/optimizer_quality.py --seeds 3 --steps 20   # step times only (7 fits)
    PYTHONPATH=. python benchmarks/optimizer_quality.py --precision bf16-mixed --options bf16_sr,bf16_sr_adamw8bit
        # the bf16 options beside fp32 AdamW at the same bf16 compute (on CPU, FSDP computes in bf16)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPTIONS = ("adamw8bit", "adamw4bit", "bf16_sr", "bf16_sr_adamw8bit")

try:
    from lightning.pytorch import Callback
except ImportError:  # the parent process needs no Lightning
    Callback = object  # type: ignore[assignment, misc]


class StepTimes(Callback):  # type: ignore[misc, valid-type]
    """Each training step's wall time and CPU time of this rank's process (batch start to batch end:
    forward, backward, optimizer step), written to ``<default_root_dir>/step-times-rank<r>.json``.
    CPU time is the work done whatever else runs on the machine (one thread per rank); wall time
    also counts the waits for the other rank and for the cores."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.t0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        wall, cpu = getattr(self, "times", ([], []))
        self.times = [*wall, time.perf_counter() - self.t0[0]], [*cpu, time.process_time() - self.t0[1]]

    def on_train_end(self, trainer, pl_module) -> None:
        wall, cpu = getattr(self, "times", ([], []))
        out = Path(trainer.default_root_dir) / f"step-times-rank{trainer.global_rank}.json"
        out.write_text(json.dumps({"wall": wall, "cpu": cpu}))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=5, help="fp32 AdamW runs (seeds 0..N-1)")
    p.add_argument("--option-seeds", type=int, default=1, help="runs of each other option (seeds 0..N-1)")
    p.add_argument("--options", default=",".join(OPTIONS))
    p.add_argument(
        "--precision",
        default=None,
        help="every run at this trainer.precision, fp32 AdamW included (default: the bf16 options at "
        "bf16-mixed, as they require, the others at the config's fp32)",
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step time")
    p.add_argument("--pretrained", default="runs/tiny-model", help="built with `tts-lightning tiny-model` if absent")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench" / "optimizer-quality")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    return p.parse_args()


def split_demo(work: Path) -> tuple[Path, Path]:
    """The demo clips copied to ``work/demo`` with a fixed split: the first 2 clips of each speaker
    (in manifest order) validate, the rest train."""
    import shutil

    from tts_lightning.data.demo import demo_dir

    folder = work / "demo"
    if not folder.is_dir():
        shutil.copytree(demo_dir(), folder, ignore=shutil.ignore_patterns(".*"))
    records = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines() if line.strip()]
    val, seen = [], {}  # type: ignore[var-annotated]
    for r in records:
        seen[r["speaker"]] = seen.get(r["speaker"], 0) + 1
        val.append(seen[r["speaker"]] <= 2)
    out = folder / "split-train.jsonl", folder / "split-val.jsonl"
    for path, keep in zip(out, (False, True), strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r, v in zip(records, val, strict=True) if v == keep))
    return out


def fit(args: argparse.Namespace, option: str, seed: int, manifests: tuple[Path, Path]) -> dict:
    run = (args.work if args.precision is None else args.work / args.precision) / f"{option}-seed{seed}"
    command = [
        sys.executable,
        "-m",
        "tts_lightning",
        "fit",
        "--config",
        str(REPO / "configs" / "tiny-cpu.yaml"),
        "--data.pretrained",
        args.pretrained,
        "--data.train_manifest",
        str(manifests[0]),
        "--data.val_manifest",
        str(manifests[1]),
        "--data.val_fraction",
        "0",
        "--data.cache_dir",
        str(args.work / f"cache-seed{seed}"),
        "--data.seed",
        str(seed),
        "--seed_everything",
        str(seed),
        "--model.optimizer",
        option,
        "--trainer.max_steps",
        str(args.steps),
        "--trainer.val_check_interval",
        str(min(20, args.steps)),  # the demo's 20; shorter runs validate at their end
        "--trainer.default_root_dir",
        str(run),
        "--trainer.enable_checkpointing",
        "false",
        '--trainer.callbacks+={"class_path": "optimizer_quality.StepTimes"}',
    ]
    precision = args.precision or ("bf16-mixed" if option.startswith("bf16_sr") else None)
    if precision:
        command += ["--trainer.precision", precision]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"{option} seed {seed} failed (exit {done.returncode})")
    times = json.loads((run / "step-times-rank0.json").read_text())
    cpu = times["cpu"][args.warmup :]
    times = times["wall"]
    steady = times[args.warmup :]
    val = _scalars(run)["val/loss"]
    print(
        f"  {option:18} seed {seed}: val/loss {val[-1][1]:.4f} at step {val[-1][0] + 1}, step "
        f"{statistics.mean(steady) * 1000:.0f} ms, CPU {statistics.mean(cpu) * 1000:.0f} ms (first "
        f"{times[0] * 1000:.0f} ms), {wall:.0f} s",
        flush=True,
    )
    return {
        "option": option,
        "seed": seed,
        "val_loss": val[-1][1],
        "val_losses": val,
        "step_s": statistics.mean(steady),
        "step_median_s": statistics.median(steady),
        "step_cpu_s": statistics.mean(cpu),
        "first_step_s": times[0],
        "steps": len(times),
        "wall_s": wall,
    }


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(Path(run_dir).rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events[-1].parent), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def schedule(args: argparse.Namespace) -> list[tuple[str, int]]:
    """fp32 AdamW runs with the other options' runs between them: adamw, option, adamw, option, ..."""
    others = [(o, s) for s in range(args.option_seeds) for o in args.options.split(",")]
    plan: list[tuple[str, int]] = []
    for seed in range(max(args.seeds, len(others) + 1)):
        if seed < args.seeds:
            plan.append(("adamw", seed))
        if seed < len(others):
            plan.append(others[seed])
    return plan


def neighbours(runs: list[dict], i: int) -> list[dict]:
    """The fp32 AdamW runs just before and after run ``i``."""
    before = [r for r in runs[:i] if r["option"] == "adamw"][-1:]
    after = [r for r in runs[i + 1 :] if r["option"] == "adamw"][:1]
    return before + after


def report(runs: list[dict]) -> dict:
    base = [r["val_loss"] for r in runs if r["option"] == "adamw"]
    lo, hi = min(base), max(base)
    mean, sd = statistics.mean(base), statistics.stdev(base) if len(base) > 1 else 0.0
    print(
        f"\nfp32 AdamW over {len(base)} seeds: val/loss {lo:.4f}-{hi:.4f}, mean {mean:.4f} +- {sd:.4f} (sd)\n"
        f"{'option':20}{'seed':>5}{'val/loss':>10}{'in range':>10}{'(v-mean)/sd':>13}{'step/adamw':>12}"
        f"{'CPU/adamw':>11}{'step ms':>9}{'CPU ms':>8}{'first ms':>10}"
    )
    rows = []
    for i, r in enumerate(runs):
        ref = neighbours(runs, i) if r["option"] != "adamw" else [r]
        ratio = r["step_s"] / statistics.mean(n["step_s"] for n in ref)
        cpu_ratio = r["step_cpu_s"] / statistics.mean(n["step_cpu_s"] for n in ref)
        z = (r["val_loss"] - mean) / sd if sd else 0.0
        inside = lo <= r["val_loss"] <= hi
        rows.append({**r, "step_ratio": ratio, "step_cpu_ratio": cpu_ratio, "in_range": inside, "z": z})
        print(
            f"{r['option']:20}{r['seed']:>5}{r['val_loss']:10.4f}{'yes' if inside else 'NO':>10}{z:13.2f}"
            f"{ratio:12.3f}{cpu_ratio:11.3f}{r['step_s'] * 1000:9.0f}{r['step_cpu_s'] * 1000:8.0f}"
            f"{r['first_step_s'] * 1000:10.0f}"
        )
    return {"adamw_val_loss": {"min": lo, "max": hi, "mean": mean, "sd": sd}, "runs": rows}


def main() -> int:
    args = parse()
    args.work.mkdir(parents=True, exist_ok=True)
    if not Path(args.pretrained).is_dir():
        subprocess.run([sys.executable, "-m", "tts_lightning", "tiny-model", args.pretrained], cwd=REPO, check=True)
    plan = schedule(args)
    print(f"{len(plan)} fits, interleaved: {', '.join(f'{o}/{s}' for o, s in plan)}", flush=True)
    manifests = split_demo(args.work)
    runs = [fit(args, option, seed, manifests) for option, seed in plan]
    figures = report(runs)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
