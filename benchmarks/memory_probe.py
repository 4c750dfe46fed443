"""A Lightning callback for benchmarks/startup_memory.py: samples this rank's resident memory from
`setup` (imports done, data prepared, no model yet) to `on_train_start` (model built, loaded,
wrapped by FSDP and sharded, optimizer created), writes the figures, saves a sharded checkpoint
for the export measurement, and stops the run before its first step."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import lightning as L


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """The highest RSS seen between start() and stop(), sampled every few milliseconds."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def start(self) -> PeakSampler:
        self.baseline = rss_bytes()
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak - self.baseline


class StartupMemory(L.Callback):
    def __init__(self, out_dir: str, checkpoint: str = "") -> None:
        self.out_dir, self.checkpoint = Path(out_dir), checkpoint

    def setup(self, trainer, pl_module, stage) -> None:
        self.sampler = PeakSampler().start()
        self.t0 = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        above = self.sampler.stop()
        # FSDP1: orig-param views of the local flat shard; FSDP2: DTensors, whose local part counts.
        local = sum(getattr(p, "to_local", lambda p=p: p)().numel() * p.element_size() for p in pl_module.parameters())
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(
            json.dumps(
                {
                    "rank": trainer.global_rank,
                    "baseline": self.sampler.baseline,
                    "peak_above_baseline": above,
                    "local_parameter_bytes": local,
                    "seconds": time.perf_counter() - self.t0,
                }
            )
        )
        if self.checkpoint:
            # The speaker table fills at the first step, which this run never takes: take the data
            # module's (what that step would copy) so the checkpoint can be exported.
            pl_module.speaker_embeddings.copy_(trainer.datamodule.speaker_embeddings())
            trainer.save_checkpoint(self.checkpoint)
        trainer.should_stop = True
