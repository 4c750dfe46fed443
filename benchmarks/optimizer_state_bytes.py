"""Model-state bytes per rank under each `model.optimizer`, measured at the released 1.7B size (random
weights, CPU) beside the planner's: one `benchmarks/real_size.py` run per option (rank 0 of a
``--world``-rank run under torch's fake process group: the rank's real shards, nothing sent).

After the run's steps (2: FSDP1 still holds the first step's gathered root parameters after one),
the bytes of the unique tensor storages held for weights, gradients and optimizer state (torchao's
quantized moments: their codes, block scales and lookup tables; the scalar step counters left out),
as `fsdp_memory.held_bytes` counts them, beside `plan_memory`'s for the same settings (strategy
layout, world size, optimizer, precision: bf16-mixed for the bf16 options, else 32-true). Goal:
within 5% for every option. Tensor bytes, not RSS.

The world sizes are what this 24 GiB machine holds with the other sessions (the fp32-weight options
as 1 rank of 4, the bf16 ones as 1 rank of 2); each option is a separate process, run one after the
other. Memory heavy: run it alone (``flock /tmp/heavy.lock``).

    PYTHONPATH=. python benchmarks/optimizer_state_bytes.py                          # ~30-60 min on 2 cores
    PYTHONPATH=. python benchmarks/optimizer_state_bytes.py --runs bf16_sr_adamw8bit:1 --strategy fsdp2
    PYTHONPATH=. python benchmarks/optimizer_state_bytes.py --pretrained runs/tiny-model   # seconds
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = "bf16_sr_adamw8bit:2,adamw8bit:4,adamw4bit:4,bf16_sr:2,adamw:4"
PARTS = ("parameters", "gradients", "optimizer")
GiB = 2**30


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=RUNS, help="option:world, comma-separated")
    p.add_argument("--strategy", default="fsdp1", choices=("fsdp1", "fsdp2"))
    p.add_argument("--size", default="1.7b", choices=("1.7b", "0.6b"))
    p.add_argument("--pretrained", type=Path, default=None, help="a pretrained directory instead of --size")
    # The states do not depend on the batch: the smallest one (one demo clip, ~50-100 positions)
    # keeps the step, slow in bf16 on a CPU without bf16 instructions, short.
    p.add_argument("--frames", type=int, default=60, help="data.max_frames_per_batch")
    p.add_argument("--clip-seconds", type=float, default=1.0, help="as real_size.py's (1: the demo clips as they are)")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench" / "optimizer-state-bytes")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    p.add_argument("--tolerance", type=float, default=0.05, help="exit 1 when a part is further off")
    return p.parse_args()


def measure(args: argparse.Namespace, option: str, world: int, out: Path) -> dict:
    source = ["--pretrained", str(args.pretrained)] if args.pretrained else ["--size", args.size]
    command = [sys.executable, str(REPO / "benchmarks" / "real_size.py"), *source, "--world", str(world)]
    command += ["--strategy", args.strategy, "--optimizer", option, "--steps", "2", "--frames", str(args.frames)]
    command += ["--clip-seconds", str(args.clip_seconds), "--work", str(args.work), "--out", str(out)]
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def main() -> int:
    args = parse()
    results = []
    folder = args.work / "figures"  # each run's figures, kept as they come
    folder.mkdir(parents=True, exist_ok=True)
    for item in args.runs.split(","):
        option, world = item.split(":")
        results.append(measure(args, option, int(world), folder / f"{option}-{args.strategy}-world{world}.json"))
    print(f"\nmodel states of rank 0, {args.strategy}, measured / planner (GiB)")
    print(f"{'option':19}{'world':>6}  " + "".join(f"{p:>24}" for p in (*PARTS, "total")))
    worst = 0.0
    for r in results:
        cells = []
        for part in (*PARTS, "total"):
            got = r["model_states"] if part == "total" else r["held"][part]
            planned = r["planned_model_states"] if part == "total" else r["planned_held"][part]
            ratio = got / planned if planned else float(got == 0)
            worst = max(worst, abs(ratio - 1))
            cells.append(f"{got / GiB:7.3f} / {planned / GiB:7.3f} {ratio:6.3f}")
            r.setdefault("ratios", {})[part] = ratio
        print(f"{r['optimizer']:19}{r['world']:>6}  " + "".join(f"{c:>24}" for c in cells))
    print(f"largest |measured / planner - 1|: {worst:.4f} (goal <= {args.tolerance})")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
