"""A Lightning callback for benchmarks/startup_memory.py: samples this rank's resident memory from
`setup` (imports done, data prepared, no model yet) to `on_train_start` (model built, loaded,
wrapped by FSDP and sharded, optimizer created), writes the figures, saves a sharded checkpoint
for the export measurement, and stops the run before its first step."""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from pathlib import Path

import lightning as L


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _Mallinfo2


def heap_bytes() -> dict[str, int]:
    """glibc's heap (``mallinfo2``, all arenas): ``in_use`` (malloc'd, not freed; mmapped blocks
    included) and ``free_kept`` (freed, still mapped and resident in the arenas: RSS that holds no
    live object, until malloc reuses it or ``malloc_trim`` returns it)."""
    info = _LIBC.mallinfo2()
    return {"in_use": info.uordblks + info.hblkhd, "free_kept": info.fordblks}


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


class PhaseMemory(L.Callback):
    """This rank's peak resident memory in each phase of a run, written to ``out_dir/rank<N>.json``:
    ``start`` (setup: imports done, data prepared, to the first step: model built, loaded and sharded,
    a checkpoint read back when resuming), ``step`` (training steps), ``validate`` (its batches),
    ``validation end`` (after the last batch: the samples callback when there is one), ``save`` (after
    validation, where `ModelCheckpoint` writes: it runs after this callback), and the baseline
    before the model existed. ``trim``: call glibc's ``malloc_trim(0)`` at each phase's (and each
    step's) start, to see how much of RSS above the live heap is freed memory kept across phases."""

    def __init__(self, out_dir: str, trim: bool = False) -> None:
        self.out_dir, self.trim, self.trim_seconds = Path(out_dir), trim, 0.0
        self.peaks: dict[str, int] = {}
        self.heap: dict[str, dict[str, int]] = {}  # glibc's heap at the end of each phase
        self.in_use_peaks: dict[str, int] = {}  # the highest live heap (malloc'd bytes) per phase
        self.phase = "start"
        self.seconds: dict[str, float] = {}  # wall time spent in each phase (all its entries)
        self._entered = time.perf_counter()
        self._stop = threading.Event()

    def _sample(self) -> None:
        tick = 0
        while not self._stop.is_set():
            rss = rss_bytes()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            if tick % 10 == 0:  # every 50 ms (mallinfo2 walks the arenas): the live heap's peak
                live = heap_bytes()["in_use"]
                self.in_use_peaks[self.phase] = max(self.in_use_peaks.get(self.phase, 0), live)
            tick += 1
            time.sleep(0.005)

    def _enter(self, phase: str) -> None:
        if self.trim:  # return glibc's freed heap to the kernel before the phase starts
            started = time.perf_counter()
            _LIBC.malloc_trim(0)
            self.trim_seconds += time.perf_counter() - started
        now = time.perf_counter()
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + now - self._entered
        self._entered = now
        self.heap[self.phase] = {**heap_bytes(), "rss": rss_bytes()}
        rss = rss_bytes()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
        self.phase = phase
        self.peaks[phase] = max(self.peaks.get(phase, 0), rss)

    def setup(self, trainer, pl_module, stage) -> None:
        self.baseline = rss_bytes()
        self.heap["baseline"] = {**heap_bytes(), "rss": self.baseline}
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._enter("step")

    def on_validation_start(self, trainer, pl_module) -> None:
        self._enter("validate")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._enter("validate")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        # What follows the last batch is the validation epoch's end: metrics and the samples callback.
        self._enter("validation end")

    def on_validation_end(self, trainer, pl_module) -> None:
        self._enter("save")

    def on_train_end(self, trainer, pl_module) -> None:
        self._enter("end")

    def teardown(self, trainer, pl_module, stage) -> None:
        self._stop.set()
        self.thread.join()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        figures = {"rank": trainer.global_rank, "baseline": self.baseline, "peaks": self.peaks, "heap": self.heap}
        figures["in_use_peaks"] = self.in_use_peaks
        figures["seconds"] = self.seconds
        figures["trim_seconds"] = self.trim_seconds
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(figures))
