"""How much a warm cache saves: `SpeakerClipsDataModule.prepare()` fresh versus fully cached.

On a copy of the demo set (24 clips, 63 s) with the tiny random model, both in a temporary folder,
times a first prepare (validate + encode every clip + speaker embeddings) and a second one on the
same cache, in the same process, after one untimed warm-up run in another folder (imports, lazy
initialisation). The second run finds the validation outcome (files unchanged by size and mtime),
every clip's codes and both speaker embeddings cached: it loads neither the speech tokenizer nor the
speaker encoder. Each is repeated and the median is reported. Target: second / first <= 0.05.

The tiny model encodes unusually fast, so the ratio here is an upper bound for a real checkpoint.

    python benchmarks/prepare_cache.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    logging.getLogger("qwen_tts").setLevel(logging.WARNING)

    from tts_lightning.data.datamodule import SpeakerClipsDataModule
    from tts_lightning.data.demo import demo_dir
    from tts_lightning.model.tiny import build_tiny_pretrained

    with tempfile.TemporaryDirectory(prefix="tts-bench-") as tmp:
        root = Path(tmp)
        tiny = build_tiny_pretrained(root / "tiny", seed=0)
        shutil.copytree(demo_dir(), root / "demo", ignore=shutil.ignore_patterns(".*"))
        manifest = root / "demo" / "train.jsonl"

        def prepare(cache: Path) -> float:
            data = SpeakerClipsDataModule(str(tiny), str(manifest), cache_dir=str(cache))
            start = time.perf_counter()
            report = data.prepare()
            elapsed = time.perf_counter() - start
            assert len(report.accepted) == 24, report.summary()
            return elapsed

        prepare(root / "warmup")  # imports and one-time initialisation, not timed
        first, second = [], []
        for i in range(args.repeats):
            cache = root / f"cache{i}"
            first.append(prepare(cache))
            second.append(prepare(cache))
        f, s = statistics.median(first), statistics.median(second)
        ratio = s / f
        print(f"clips: 24 ({manifest}), tiny model, {args.repeats} repeats, medians")
        print(f"first prepare (fresh cache): {f * 1000:8.1f} ms   runs: {', '.join(f'{x * 1000:.0f}' for x in first)}")
        print(f"second prepare (warm cache): {s * 1000:8.1f} ms   runs: {', '.join(f'{x * 1000:.0f}' for x in second)}")
        print(f"ratio second/first: {ratio:.3f} (target <= 0.05: {'met' if ratio <= 0.05 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
