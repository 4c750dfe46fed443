"""Lightning's cost per optimizer step: `Trainer.fit` with `Qwen3TTSModule` versus a bare PyTorch loop.

Single process, CPU, fp32, one thread. A mid-sized random model of the real Qwen3-TTS classes (the
tiny directory widened: talker hidden 256 x 4 layers, code predictor hidden 128 x 2 layers) so that
a step takes a few hundred ms and overhead is measurable. The demo data (24 clips, 2 speakers) are
prepared through `SpeakerClipsDataModule` into a temporary cache; its batches are collected once and
fed to every arm in the same order, through the same kind of DataLoader, from the same initial
weights:

* ``bare``: `compute_loss` -> backward -> AdamW.step -> LambdaLR.step (the module's own optimizer and
  schedule), zero_grad(set_to_none); nothing else.
* ``bare+metrics``: the same plus the rest of the module's step body (speaker-embedding buffer
  write, the per-codebook accuracies and their epoch accumulation), to tell the module's own metric
  work from the Trainer's.
* ``lightning``: `Trainer.fit` (no logger, checkpointing, progress bar, model summary, validation or
  gradient clipping; the module's `self.log` calls and metric updates run, as in every real run).

Steps are timed end to end (consecutive batch ends, data fetch included), in CPU time of the process
(one thread: the work done, whatever else runs on the machine) and wall time; the first ``--warmup``
steps of each run are dropped; the mean over the timed steps (the same batches in every arm) is
taken per repetition, and the median over repetitions is reported. Repetitions alternate the order
of the arms to cancel drift. Equal work is checked: every arm's per-step losses must equal the bare
loop's. Target: lightning / bare <= 1.10 (exit status 1 above it).

    python benchmarks/step_overhead.py [--repeats 8 --steps 12 --warmup 3]   # ~3 minutes on 2 cores
    python benchmarks/step_overhead.py --pairs-only --repeats 24   # bare and lightning only, ~10 minutes

    python benchmarks/step_overhead.py --profile --pairs-only --repeats 8 --steps 6 --warmup 2   # ~5 minutes

``--profile`` splits each step's CPU time into parts, measured inside the step: the bare loop's
work (forward and loss, backward, the AdamW update, zero_grad), the module's extras (`self.log`
calls, the accuracies, the speaker-table write) and the rest (the loop around them: Lightning's
hooks, closure, progress and logger connector, or the bare `for`). What Lightning and the module
add is the sum of the parts outside the work, minus the bare loop's rest: a few milliseconds
measured directly, rather than the difference of two noisy ~450 ms steps. The wrappers cost
microseconds per call (a handful of calls per step).

It also prints the median of the per-repetition ratios (lightning / bare, run back to back) with a
distribution-free 95% interval of that median (order statistics), which says how far the machine's
noise leaves the ratio undetermined.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LR, WEIGHT_DECAY, SUB_WEIGHT = 1e-4, 0.01, 0.3


def build_mid_pretrained(root: Path) -> Path:
    """The tiny pretrained directory with a wider, deeper talker and code predictor (random weights,
    same tokenizers and vocabularies, so the demo data prepare exactly as for the tiny model)."""
    import torch
    from safetensors.torch import save_file

    from tts_lightning import build_tiny_pretrained
    from tts_lightning.model.loading import build_model
    from tts_lightning.model.pretrained import check_pretrained

    tiny = build_tiny_pretrained(root / "tiny", seed=0)
    mid = root / "mid"
    shutil.copytree(tiny, mid)
    (mid / "tiny_model.json").unlink(missing_ok=True)
    config = json.loads((mid / "config.json").read_text())
    talker = config["talker_config"]
    talker.update(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        text_hidden_size=256,
        rope_scaling={"rope_type": "default", "mrope_section": [8, 4, 4], "interleaved": True},
    )
    talker["code_predictor_config"].update(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    config["speaker_encoder_config"]["enc_dim"] = 256  # the x-vector fills the talker's speaker slot
    config["tts_model_size"] = "bench-mid"
    (mid / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(0)
    model = build_model(check_pretrained(mid), load_weights=False)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(mid / "model.safetensors"))
    return mid


def collect_batches(pretrained: Path, cache: Path, max_frames: int) -> tuple[list, list[str]]:
    from tts_lightning import SpeakerClipsDataModule
    from tts_lightning.data.demo import demo_manifest

    data = SpeakerClipsDataModule(
        str(pretrained),
        str(demo_manifest()),
        cache_dir=str(cache),
        val_fraction=0.0,
        max_frames_per_batch=max_frames,
        seed=0,
    )
    data.prepare_data()
    data.setup("fit")
    return list(data.train_dataloader()), data.speaker_names


class Parts:
    """CPU seconds spent inside chosen functions (``--profile``): each is wrapped so that its calls add
    their `time.process_time` to a named part. Only functions that never call one another are
    wrapped, so the parts do not overlap, and what a step spends outside them is its remainder."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, attribute: str, part: str) -> None:
        original = getattr(owner, attribute)
        self.totals.setdefault(part, 0.0)
        self.calls.setdefault(part, 0)

        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[part] += time.process_time() - start
                self.calls[part] += 1

        setattr(owner, attribute, timed)
        self._undo.append((owner, attribute, original))

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        return dict(self.totals), dict(self.calls)


PARTS: Parts | None = None  # set by --profile


class StepClock:
    """Time between consecutive calls of `tick`: wall seconds and CPU seconds of this process. With
    one thread the CPU time is the work done, unaffected by other processes competing for the cores
    (a shared 2-core machine); wall time is what a user waits. With ``--profile`` each step also
    records the CPU seconds and calls of every part (`Parts`)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.parts: list[dict[str, float]] = []
        self.calls: list[dict[str, int]] = []
        self.start()

    def start(self) -> None:
        self._last = (time.perf_counter(), time.process_time())
        self._parts = PARTS.snapshot() if PARTS is not None else ({}, {})

    def tick(self) -> None:
        now = (time.perf_counter(), time.process_time())
        self.wall.append(now[0] - self._last[0])
        self.cpu.append(now[1] - self._last[1])
        self._last = now
        if PARTS is not None:
            totals, calls = PARTS.snapshot()
            self.parts.append({k: v - self._parts[0][k] for k, v in totals.items()})
            self.calls.append({k: v - self._parts[1][k] for k, v in calls.items()})
            self._parts = (totals, calls)


def install_parts() -> Parts:
    """``--profile``: the bare loop's work (forward and loss, backward, the AdamW update, zero_grad)
    and the module's own extras (`self.log`, the accuracies, the speaker-table write) as parts. The
    rest of a step is the loop around them: Lightning's (hooks, closure, progress, logger connector)
    or the bare loop's (`for`, `float(loss)`), with the DataLoader fetch in both."""
    import lightning as L
    import torch
    import torch.optim.adam as adam_file

    import tts_lightning.model.loss as loss_file
    import tts_lightning.model.module as module_file
    from tts_lightning.model.module import Qwen3TTSModule

    parts = Parts()
    parts.wrap(module_file, "compute_loss", "forward+loss")
    parts.wrap(torch.Tensor, "backward", "backward")
    parts.wrap(adam_file, "adam", "AdamW update")
    parts.wrap(torch.optim.Optimizer, "zero_grad", "zero_grad")
    parts.wrap(L.LightningModule, "log", "self.log")
    # Wherever the name is imported (the module before issue 30's last change, train_accuracy after).
    for owner in (loss_file, module_file, sys.modules.get("tts_lightning.model.train_accuracy")):
        if hasattr(owner, "codebook_accuracy"):
            parts.wrap(owner, "codebook_accuracy", "accuracies")
    parts.wrap(Qwen3TTSModule, "_remember_speakers", "speaker table")
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per arm and repetition")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    parser.add_argument("--max-frames", type=int, default=600, help="data.max_frames_per_batch")
    parser.add_argument(
        "--pairs-only",
        action="store_true",
        help="run only the bare and lightning arms (more repetitions in the same time)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also split each step's CPU time into parts (forward+loss, backward, AdamW, self.log, ...) and the "
        "loop around them, per arm: the overhead measured inside the step rather than as a difference of steps",
    )
    args = parser.parse_args(argv)

    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for name in ("lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import lightning as L

    import tts_lightning.model.loss as loss_file
    import tts_lightning.model.module as module_file
    from tts_lightning import Qwen3TTSModule

    global PARTS
    if args.profile:
        PARTS = install_parts()

    work = Path(tempfile.mkdtemp(prefix="step_overhead."))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the data report, qwen_tts' import banner
            pretrained = build_mid_pretrained(work)
            batches, speakers = collect_batches(pretrained, work / "cache", args.max_frames)
        n = args.warmup + args.steps
        sequence = [batches[i % len(batches)] for i in range(n)]

        def loader() -> DataLoader:
            return DataLoader(sequence, batch_size=None, shuffle=False, collate_fn=lambda b: b)

        template = Qwen3TTSModule(str(pretrained), speakers=speakers)
        template.configure_model()
        initial_state = copy.deepcopy(template.state_dict())
        params = sum(p.numel() for p in template.model.parameters())
        positions = [int(b.attention_mask.sum()) for b in batches]
        del template

        def fresh_module() -> Qwen3TTSModule:
            module = Qwen3TTSModule(
                str(pretrained),
                speakers=speakers,
                learning_rate=LR,
                weight_decay=WEIGHT_DECAY,
                sub_talker_loss_weight=SUB_WEIGHT,
            )
            module.configure_model()
            module.load_state_dict(initial_state)
            return module

        def bare(with_metrics: bool) -> tuple[StepClock, list[float]]:
            module = fresh_module().train()
            optimizer = torch.optim.AdamW(
                [p for p in module.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY
            )
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            if with_metrics:
                from tts_lightning.model.train_accuracy import EpochAccuracy

                epoch_accuracy = EpochAccuracy()
            losses: list[float] = []
            clock = StepClock()
            for batch in loader():
                if with_metrics:
                    with torch.no_grad():
                        module.speaker_embeddings[batch.speaker_index] = batch.speaker_embedding
                out = module_file.compute_loss(module.talker, batch, SUB_WEIGHT)
                if with_metrics:
                    epoch_accuracy.update(*loss_file.codebook_accuracy(out))
                optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                optimizer.step()
                scheduler.step()
                losses.append(float(out.loss))
                clock.tick()
            return clock, losses

        class StepTimer(L.Callback):
            def __init__(self) -> None:
                self.clock, self.losses = StepClock(), []

            def on_train_start(self, trainer, pl_module) -> None:
                self.clock.start()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                self.losses.append(float(outputs["loss"]))
                self.clock.tick()

        def lightning() -> tuple[StepClock, list[float]]:
            timer = StepTimer()
            trainer = L.Trainer(
                accelerator="cpu",
                devices=1,
                precision="32-true",
                max_steps=n,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
                callbacks=[timer],
            )
            with contextlib.redirect_stdout(io.StringIO()):
                trainer.fit(fresh_module(), train_dataloaders=loader())
            assert trainer.global_step == n
            return timer.clock, timer.losses

        arms = {"bare": lambda: bare(False), "bare+metrics": lambda: bare(True), "lightning": lightning}
        if args.pairs_only:
            del arms["bare+metrics"]
        cpu: dict[str, list[float]] = {name: [] for name in arms}  # mean step time per repetition
        wall: dict[str, list[float]] = {name: [] for name in arms}
        loss_diff = {name: 0.0 for name in arms}
        parts: dict[str, list[dict[str, float]]] = {name: [] for name in arms}  # --profile: mean per step
        calls: dict[str, dict[str, float]] = {}
        print(
            f"model: {params / 1e6:.1f}M parameters (real Qwen3-TTS classes, random weights), fp32, CPU, "
            f"{torch.get_num_threads()} thread; {len(batches)} demo batches of {min(positions)}-{max(positions)} "
            f"talker positions, cycled; {args.repeats} repetitions x ({args.warmup} warm-up + {args.steps} "
            "timed) steps per arm, arm order alternating",
            flush=True,
        )
        for rep in range(args.repeats):
            order = list(arms) if rep % 2 == 0 else list(reversed(arms))
            results = {name: arms[name]() for name in order}
            reference = results["bare"][1]
            for name, (clock, losses) in results.items():
                cpu[name].append(statistics.fmean(clock.cpu[args.warmup :]))  # the same batches in every arm
                wall[name].append(statistics.fmean(clock.wall[args.warmup :]))
                loss_diff[name] = max(loss_diff[name], max(abs(a - b) for a, b in zip(losses, reference)))
                if PARTS is not None:
                    timed = clock.parts[args.warmup :]
                    mean = {k: statistics.fmean(p[k] for p in timed) for k in timed[0]}
                    mean["rest of the step"] = cpu[name][-1] - sum(mean.values())
                    parts[name].append(mean)
                    calls[name] = {k: statistics.fmean(c[k] for c in clock.calls[args.warmup :]) for k in timed[0]}
            print(
                f"  repetition {rep + 1}: CPU ms/step "
                + ", ".join(f"{k} {1e3 * v[-1]:.1f}" for k, v in cpu.items())
                + f"   (lightning/bare {cpu['lightning'][-1] / cpu['bare'][-1]:.3f})",
                flush=True,
            )

        med_cpu = {name: statistics.median(v) for name, v in cpu.items()}
        med_wall = {name: statistics.median(v) for name, v in wall.items()}
        ratios = sorted(lit / bare for lit, bare in zip(cpu["lightning"], cpu["bare"]))
        print("per optimizer step (mean over the timed steps, median over repetitions):")
        print(f"  {'':13s} {'CPU ms':>8s} {'wall ms':>8s}   losses vs bare")
        for name in arms:
            print(
                f"  {name:13s} {1e3 * med_cpu[name]:8.1f} {1e3 * med_wall[name]:8.1f}   "
                f"max |diff| {loss_diff[name]:.1e}"
            )
        ratio = med_cpu["lightning"] / med_cpu["bare"]
        print(
            f"lightning / bare          = {ratio:.3f} CPU, {med_wall['lightning'] / med_wall['bare']:.3f} wall "
            f"(per-repetition CPU ratios {ratios[0]:.3f}..{ratios[-1]:.3f}; target <= 1.10)"
        )
        low, high = median_interval(ratios)
        print(
            f"paired ratios (each repetition's lightning / bare, run back to back): median "
            f"{statistics.median(ratios):.3f}, 95% interval of the median {low:.3f}..{high:.3f} (order "
            f"statistics, {len(ratios)} pairs), mean {statistics.fmean(ratios):.3f}"
            + (f" +- {statistics.stdev(ratios):.3f} sd" if len(ratios) > 1 else "")
        )
        if "bare+metrics" in arms:
            print(
                f"bare+metrics / bare       = {med_cpu['bare+metrics'] / med_cpu['bare']:.3f} CPU "
                "(the module's accuracies + speaker-buffer write, part of every Lightning step)"
            )
            print(
                f"lightning / bare+metrics  = {med_cpu['lightning'] / med_cpu['bare+metrics']:.3f} CPU "
                "(what is left: Trainer loop, hooks, self.log)"
            )
        if PARTS is not None:
            print_parts(parts, calls)
        if any(d > 1e-4 for d in loss_diff.values()):
            print("WARNING: the arms did not compute the same losses: the comparison is not like for like")
            return 1
        return 0 if ratio <= 1.10 else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_parts(parts: dict[str, list[dict[str, float]]], calls: dict[str, dict[str, float]]) -> None:
    """The ``--profile`` table: per arm, each part's CPU ms per step (median over repetitions of the
    mean over the timed steps) and its calls per step; "lightning - bare" is what Lightning and the
    module add, part by part."""
    names = list(parts)
    rows = list(parts[names[0]][0])
    med = {arm: {row: 1e3 * statistics.median(p[row] for p in parts[arm]) for row in rows} for arm in names}
    print("CPU ms per step by part (--profile; median over repetitions), calls per step in brackets:")
    print(f"  {'':18s}" + "".join(f"{arm:>20s}" for arm in names) + f"{'lightning - bare':>18s}")
    for row in rows + ["total"]:
        if row == "total":
            values = {arm: sum(med[arm].values()) for arm in names}
        else:
            values = {arm: med[arm][row] for arm in names}
        cells = "".join(
            f"{values[arm]:10.1f} [{calls.get(arm, {}).get(row, 0):5.1f}]  "
            if row in calls.get(arm, {})
            else f"{values[arm]:10.1f}{'':10s}"
            for arm in names
        )
        print(f"  {row:18s}{cells}{values['lightning'] - values['bare']:+18.1f}")
    work = ("forward+loss", "backward", "AdamW update", "zero_grad")
    outside = {arm: sum(v for row, v in med[arm].items() if row not in work) for arm in names}
    step = sum(med["bare"].values())
    added = outside["lightning"] - outside["bare"]
    print(
        f"outside the bare loop's work (forward+loss, backward, AdamW, zero_grad): bare {outside['bare']:.1f} ms, "
        f"lightning {outside['lightning']:.1f} ms per step: Lightning and the module add {added:.1f} ms, "
        f"{100 * added / step:.1f}% of the bare step ({step:.0f} ms), i.e. lightning / bare = {1 + added / step:.3f} "
        "with the work itself taking equal time"
    )


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics k and n+1-k
    with the largest k for which P(Binomial(n, 1/2) < k) <= (1 - level) / 2 (the whole range when
    there are too few values for that)."""
    import math

    ordered, n = sorted(values), len(values)
    k, tail = 0, 0.0
    while k < n // 2:
        tail += math.comb(n, k) / 2**n
        if tail > (1 - level) / 2:
            break
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


if __name__ == "__main__":
    sys.exit(main())
