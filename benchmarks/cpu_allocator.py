"""The Makefile's allocator settings (``CPU_ENV``) against glibc's defaults, on CPU: prepare and a short fit.

glibc returns every freed block above its mmap threshold (at most 32 MiB) to the kernel and the
next allocation of that size faults its pages in again; the speech tokenizer's and the model's
activations are such blocks. ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` (read from
the Makefile's ``CPU_ENV``, the one place they are set) keep them in the heap. Each workload runs in
fresh processes, alternately with the default allocator and with the settings, ``--repeats`` times:

* ``prepare``: benchmarks/prepare_parallel.py's data set (240 clips, ~10.5 minutes of audio) and
  script, with 1 and with 2 processes, each on a fresh cache: rank 0's wall time from
  ``prepare_data`` to the end of ``setup``, its system CPU time and its minor page faults.
* ``fit``: ``tts-lightning fit --config configs/tiny-cpu.yaml`` (FSDP, 2 processes) for ``--steps``
  steps on the demo set, prepared before the timed runs: the whole command's wall time, start-up
  (imports, ~12 s of CPU per process; the second rank's launch; the sanity check) included, as a
  user waits for it.

The default arm runs without any ``MALLOC_*`` or ``GLIBC_TUNABLES`` variable, even when the calling
shell exported them.

Reports the median ratio settings / default per workload (lower is faster), and prepare's
2-process / 1-process ratio under each (prepare_parallel.py's goal, <= 0.6).

    python benchmarks/cpu_allocator.py [--repeats 3] [--steps 30]   # ~12 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prepare_parallel import SCRIPT, Timing, make_dataset, run  # noqa: E402


def makefile_cpu_env() -> dict[str, str]:
    """The allocator variables of the Makefile's ``CPU_ENV`` (OMP_NUM_THREADS=1 is set in both arms)."""
    line = re.search(r"^CPU_ENV\s*:=\s*(.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    if line is None:
        raise SystemExit("no CPU_ENV line in the Makefile")
    pairs = dict(item.split("=", 1) for item in line.group(1).split())
    return {k: v for k, v in pairs.items() if k.startswith("MALLOC_")}


def fit(tiny: Path, out: Path, steps: int, env: dict[str, str]) -> float:
    """Wall seconds of `tts-lightning fit` with the demo config, ``steps`` steps, logs under ``out``."""
    command = [
        sys.executable, "-m", "tts_lightning", "fit", "--config", "configs/tiny-cpu.yaml",
        "--data.pretrained", str(tiny), "--data.cache_dir", str(out.parent / "fit-cache"),
        "--trainer.max_steps", str(steps), "--trainer.default_root_dir", str(out),
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"fit failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    shutil.rmtree(out)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every workload in both settings")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each fit")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]:
        print(f"unset {name} for the default arm (the processes of both arms inherit this environment)")
        del os.environ[name]
    tuned = makefile_cpu_env()
    arms = {"default": {}, "settings": tuned}

    from tts_lightning.model.tiny import build_tiny_pretrained

    prepared: dict[tuple[str, int], list[Timing]] = {(a, d): [] for a in arms for d in (1, 2)}
    fits: dict[str, list[float]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory(prefix="tts-bench-") as tmp:
        root = Path(tmp)
        tiny = build_tiny_pretrained(root / "tiny", seed=0)
        manifest, seconds = make_dataset(root / "data", 10)
        script = root / "prepare_run.py"
        script.write_text(SCRIPT)
        fit(tiny, root / "warm-up", 1, {})  # prepares the demo set's cache the fits share
        for i in range(args.repeats):
            order = list(arms) if i % 2 == 0 else list(reversed(arms))  # cancel drift
            for devices in (1, 2):
                for arm in order:
                    cache = root / f"cache-{arm}-{devices}"
                    prepared[arm, devices].append(run(tiny, manifest, cache, devices, script, arms[arm]))
                    shutil.rmtree(cache)
            for arm in order:
                fits[arm].append(fit(tiny, root / f"fit-{arm}", args.steps, arms[arm]))

    def median_ratio(pairs) -> str:
        ratios = [b / a for a, b in pairs]
        return f"{statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"

    def times(values) -> str:
        return ", ".join(f"{v:.1f}" for v in values)

    print(f"settings: {' '.join(f'{k}={v}' for k, v in tuned.items())} (Makefile CPU_ENV)")
    print(f"{os.cpu_count()} CPU cores, load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for devices in (1, 2):
        default, tuned_runs = prepared["default", devices], prepared["settings", devices]
        print(f"prepare, {devices} process(es), {seconds / 60:.1f} min of audio:")
        for arm, runs in (("default", default), ("settings", tuned_runs)):
            print(
                f"  {arm:9s} {times(r.seconds for r in runs)} s wall; rank 0 system CPU "
                f"{times(r.system for r in runs)} s, minor faults {', '.join(str(r.faults) for r in runs)}"
            )
        print(f"  settings / default: {median_ratio((a.seconds, b.seconds) for a, b in zip(default, tuned_runs))}")
    for arm in arms:
        one, two = prepared[arm, 1], prepared[arm, 2]
        print(f"prepare 2 / 1 processes, {arm}: {median_ratio((a.seconds, b.seconds) for a, b in zip(one, two))}")
    print(f"fit, {args.steps} steps, FSDP on 2 processes, whole command:")
    for arm in arms:
        print(f"  {arm:9s} {times(fits[arm])} s")
    print(f"  settings / default: {median_ratio(zip(fits['default'], fits['settings']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
