"""One rank of a 4-rank FULL_SHARD run of the released 1.7B, emulated in one process, measured next
to the planner's prediction for the same settings; ``--strategy fsdp2`` runs the same with
`Qwen3TTSFSDP2Strategy` (FSDP2, ``fully_shard``) instead of the FSDP1 `Qwen3TTSFSDPStrategy`.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``) stands in for the other
ranks: FSDP allocates exactly this rank's shards, gather buffers and reduce-scatter outputs, and
nothing is sent (the gathered values of the other shards are whatever memory held, so the loss is
not meaningful; the memory and the compute are one real rank's). Everything else is the project's
real path: a released-size Base directory with random weights (benchmarks/released_dir.py), the
`Qwen3TTSModule` built on the meta device and materialized by `Qwen3TTSFSDPStrategy` (rank 0 reads,
the broadcast is a no-op here), its loss and AdamW, driven by a Lightning Trainer for a few steps on
the demo clips.

Measured (per rank): model states (bytes of the unique storages of parameters, gradients and AdamW
state, as benchmarks/fsdp_memory.py counts them) and the training peak (CUDA: max allocated; CPU:
RSS above the level at the start of training, sampled), next to `plan_memory` for the largest batch
the run actually saw. Goal: within 15%.

    PYTHONPATH=. python benchmarks/real_size.py                      # 1.7B, rank 0 of 4, CPU fp32
    PYTHONPATH=. python benchmarks/real_size.py --strategy fsdp2          # the same with FSDP2
    PYTHONPATH=. python benchmarks/real_size.py --size 0.6b --world 1
    PYTHONPATH=. python benchmarks/real_size.py --device cuda --precision bf16-mixed --gpu-memory 16
    PYTHONPATH=. python benchmarks/real_size.py --pretrained runs/tiny-model --frames 150   # seconds (the suite)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
GiB = 2**30


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1.7b", choices=("1.7b", "0.6b"))
    p.add_argument(
        "--pretrained",
        type=Path,
        default=None,
        help="a pretrained directory instead of --size (the suite: tiny)",
    )
    p.add_argument("--world", type=int, default=4, help="emulated FULL_SHARD ranks (this process is rank 0)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default=None, help="default: 32-true on CPU, bf16-mixed on CUDA")
    p.add_argument("--frames", type=int, default=300, help="data.max_frames_per_batch (padded positions)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--clip-seconds",
        type=float,
        default=24.0,
        help="the demo clips joined into clips this long (batches near --frames)",
    )
    p.add_argument(
        "--gpu-memory", type=float, default=None, help="a card sold as this many GB: what it leaves after the context"
    )
    p.add_argument(
        "--cuda-context",
        type=int,
        default=None,
        help="bytes of the CUDA context, measured by a run alone on the GPU (default: measured here, which "
        "counts what other processes on the GPU hold too)",
    )
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--strategy", default="fsdp1", choices=("fsdp1", "fsdp2"), help="FSDP1 or FSDP2 (fully_shard)")
    p.add_argument("--samples", action="store_true", help="run SpeakerSamplesCallback after the steps")
    p.add_argument(
        "--optimizer",
        default="adamw",
        help="model.optimizer (tts_lightning.model.optimizers); the bf16 ones run at bf16-mixed",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench", help="where the data cache and logs go")
    return p.parse_args()


def long_clips(folder: Path, seconds: float) -> Path:
    """A manifest of the demo clips joined per speaker into clips of about ``seconds`` (their texts
    joined too): a batch of 2000 padded positions then holds a few long clips, as with real
    recordings, instead of the short demo clips' padding."""
    import numpy as np
    import soundfile as sf

    from tts_lightning.data.demo import demo_dir

    manifest = folder / "train.jsonl"
    if manifest.is_file():
        return manifest
    folder.mkdir(parents=True, exist_ok=True)
    records = [json.loads(line) for line in (demo_dir() / "train.jsonl").read_text().splitlines()]
    lines = []
    for speaker in sorted({r["speaker"] for r in records}):
        own = [r for r in records if r["speaker"] == speaker]
        for turn in range(3):  # the speaker's clips, three times over, each round from another start
            audio, texts, rate = [], [], 24000
            for r in own[turn:] + own[:turn]:
                wave, rate = sf.read(demo_dir() / r["audio"], dtype="float32")
                audio.append(wave)
                texts.append(r["text"])
                if sum(len(a) for a in audio) >= seconds * rate:
                    name = f"{speaker}_{turn}_{len(lines)}.wav"
                    sf.write(folder / name, np.concatenate(audio), rate)
                    lines.append(json.dumps({"audio": name, "text": " ".join(texts), "speaker": speaker}))
                    audio, texts = [], []
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def forward_flops(trainer, batch) -> int:
    """Matmul FLOPs of one forward of ``batch`` through the wrapped model (torch's counter: matrix
    products and attention, not embedding lookups), without gradients."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        trainer.strategy.model(batch)
    return int(counter.get_total_flops())


def main() -> int:
    args = parse()
    bf16_weights = args.optimizer.startswith("bf16_sr")
    precision = args.precision or ("bf16-mixed" if args.device == "cuda" or bf16_weights else "32-true")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    # One node per emulated rank, this process rank 0: Lightning treats the processes as launched
    # externally and finds the (fake) process group already initialized.
    os.environ.update(
        WORLD_SIZE=str(args.world),
        RANK="0",
        NODE_RANK="0",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29599",
        TOKENIZERS_PARALLELISM="false",
    )
    import lightning as L
    import torch
    import torch.distributed as dist
    from fsdp_memory import held_bytes
    from memory_probe import PeakSampler, rss_bytes
    from released_dir import build_released_dir
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tts_lightning import Qwen3TTSModule, SpeakerClipsDataModule
    from tts_lightning.distributed.fsdp import Qwen3TTSFSDPStrategy
    from tts_lightning.distributed.memory import CUDA_OVERHEAD_BYTES, plan_memory

    if args.pretrained is not None:
        pretrained, name = args.pretrained, args.pretrained.name
    else:
        pretrained, name = build_released_dir(args.size, REPO / "runs" / "bench" / f"released-{args.size}"), args.size
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    # Lightning's prepare_data barrier opens a side gloo group, which a fake store cannot back (it
    # crashes): prepare the data in this process first, and let that barrier be a no-op.
    import contextlib

    from lightning.pytorch.trainer.connectors import data_connector

    data_connector._InfiniteBarrier = contextlib.nullcontext
    cuda = args.device == "cuda"
    card = context = 0
    if cuda:
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the CUDA context exists now
        free, total = torch.cuda.mem_get_info()
        # The context and anything else outside PyTorch's allocator, other processes' included:
        # runs side by side take the figure of one measured alone (gpu_check.py).
        context = total - free if args.cuda_context is None else args.cuda_context
        if args.gpu_memory:
            # What a card sold as N GB offers in all (nvidia-smi's total: 16376 MiB for a 16 GB
            # card), of which the CUDA context takes its share first: the allocator gets the rest.
            card = int((args.gpu_memory * 1024 - 8) * 2**20)
            torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, (card - context) / total)))

    class Probe(L.Callback):
        positions = 0
        flops = 0
        step_seconds: list[float] = []
        tokens: list[int] = []

        def setup(self, trainer, pl_module, stage):
            self.baseline = rss_bytes()  # imports done, data prepared, no model yet

        def on_train_start(self, trainer, pl_module):
            self.startup_rss = rss_bytes()
            self.sampler = PeakSampler().start()
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.positions = max(self.positions, batch.text_ids.numel())
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self.step_seconds.append(time.perf_counter() - self.t0)
            self.tokens.append(int(batch.attention_mask.sum()))
            if not self.flops:  # the model's matmul FLOPs of this batch: 3 x the forward's
                self.flops = 3 * forward_flops(trainer, batch)

        def on_train_end(self, trainer, pl_module):
            self.rss_peak = self.sampler.stop()
            self.cuda_peak = torch.cuda.max_memory_allocated() if cuda else 0
            self.cuda_reserved = torch.cuda.max_memory_reserved() if cuda else 0
            self.held = held_bytes(trainer.strategy.model, trainer.optimizers[0])

    probe = Probe()
    callbacks = [probe]
    if args.samples:
        from tts_lightning.callbacks import SpeakerSamplesCallback

        callbacks.append(SpeakerSamplesCallback(max_new_tokens=60, similarity=False))
    work = args.work / f"real-size-{name}"
    data = SpeakerClipsDataModule(
        str(pretrained),
        str(long_clips(work / "clips", args.clip_seconds)),
        val_fraction=0.15,
        cache_dir=str(work / "cache"),
        seed=0,
        max_frames_per_batch=args.frames,
    )
    data.prepare()
    module = Qwen3TTSModule(str(pretrained), speakers=data.speaker_names, learning_rate=1e-6, optimizer=args.optimizer)
    from tts_lightning.distributed.fsdp2 import Qwen3TTSFSDP2Strategy

    strategy_class = Qwen3TTSFSDP2Strategy if args.strategy == "fsdp2" else Qwen3TTSFSDPStrategy

    class Emulated(strategy_class):  # type: ignore[misc, valid-type]
        def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
            # The fake group's all-reduce leaves the tensor as it was (a sum of 1, not of every
            # rank's 1): the other ranks are not there to disagree, so this rank's word is the answer.
            return decision

    strategy = Emulated(cpu_offload=args.cpu_offload)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        num_nodes=args.world,
        strategy=strategy,
        precision=precision,
        max_steps=args.steps,
        limit_val_batches=1 if args.samples else 0,
        val_check_interval=args.steps if args.samples else None,
        num_sanity_val_steps=0,
        logger=L.pytorch.loggers.TensorBoardLogger(str(work), name="tb") if args.samples else False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
        default_root_dir=str(work),
    )
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=data)
    wall = time.perf_counter() - t0

    plan = plan_memory(
        str(pretrained) if args.pretrained is not None else args.size,
        gpus=args.world,
        gpu_memory_gb=args.gpu_memory or 1000,
        precision=precision,
        micro_batch_frames=probe.positions,
        cpu_offload=args.cpu_offload,
        samples=args.samples,
        sample_rows=2 * 2,
        sample_frames=60,
        layout=args.strategy,
        optimizer=args.optimizer,
    )
    held = probe.held
    states = held["parameters"] + held["gradients"] + held["optimizer"]
    # CPU: the training peak above the process's level before the model existed (the parameters
    # are in memory from the start of training on, so they count, as in the planner's peak).
    peak = probe.cuda_peak if cuda else probe.rss_peak + probe.startup_rss - probe.baseline
    # The planner's peak counts a CUDA constant; tensors (CUDA) or RSS (CPU) do not.
    plan_peak = plan.total - CUDA_OVERHEAD_BYTES
    steady = probe.step_seconds[1:] or probe.step_seconds  # the first step warms up (allocator, kernels)
    step_s = sorted(steady)[len(steady) // 2]
    tokens_s = sum(probe.tokens[1:] or probe.tokens) / sum(steady)
    figures = {
        "size": name,
        "world": args.world,
        "device": args.device,
        "precision": precision,
        "cpu_offload": args.cpu_offload,
        "strategy": args.strategy,
        "positions": probe.positions,
        "steps": len(probe.step_seconds),
        "model_states": states,
        "planned_model_states": plan.model_states,
        "optimizer": args.optimizer,
        "planned_held": {
            "parameters": plan.parameters,
            "gradients": plan.gradients,
            "optimizer": plan.optimizer_states,
        },
        "peak": peak,
        "planned_peak": plan_peak,
        "step_s": step_s,
        "tokens_per_s": tokens_s,
        "wall_s": wall,
        "held": held,
        "samples": args.samples,
    }
    if cuda:
        # Model FLOPs of the first batch's matmuls (forward counted by torch, x3 for the backward;
        # activation recomputation and embedding lookups not counted), per second of a steady step.
        peak_flops = float(os.environ.get("PEAK_TFLOPS", "989")) * 1e12  # H200/H100 bf16 dense
        figures["mfu"] = probe.flops / step_s / peak_flops
        figures["cuda_context"] = context
        figures["cuda_reserved_peak"] = probe.cuda_reserved
        if card:
            figures["card_bytes"] = card
            figures["fits_card"] = probe.cuda_reserved + context <= card
    print(
        f"\n{name}: {args.strategy}, rank 0 of {args.world} (fake process group), {precision}, {args.device}, "
        f"cpu_offload {args.cpu_offload}, largest batch {probe.positions} padded positions, "
        f"{len(probe.step_seconds)} steps"
    )
    print(f"{'':34}{'measured GiB':>14}{'planner GiB':>13}{'meas/plan':>11}")
    print(
        f"{'model states (params+grads+AdamW)':34}{states / GiB:14.2f}{plan.model_states / GiB:13.2f}"
        f"{states / plan.model_states:11.3f}"
    )
    for part, planned in figures["planned_held"].items():
        label = f"  {part} ({args.optimizer})"
        print(f"{label:34}{held[part] / GiB:14.3f}{planned / GiB:13.3f}{held[part] / max(planned, 1):11.3f}")
    label = "peak, CUDA tensors" if cuda else "peak, RSS over pre-model level"
    print(f"{label:34}{peak / GiB:14.2f}{plan_peak / GiB:13.2f}{peak / plan_peak:11.3f}")
    if not cuda:
        print(
            f"(RSS before the model {probe.baseline / GiB:.2f} GiB, at train start {probe.startup_rss / GiB:.2f} "
            f"GiB; the planner's peak is without its {CUDA_OVERHEAD_BYTES / GiB:.0f} GiB CUDA constant; CPU "
            "time is compute only: no collective is sent)"
        )
    print(
        f"step {step_s:.2f} s (median after the first), {tokens_s:,.0f} tokens/s after the first step"
        + (f", MFU {figures['mfu'] * 100:.1f}% (matmul FLOPs)" if cuda else "")
    )
    if cuda:
        print(
            f"CUDA: context {context / GiB:.2f} GiB + reserved peak {probe.cuda_reserved / GiB:.2f} GiB "
            f"(allocated peak {probe.cuda_peak / GiB:.2f})"
            + (f" vs a {args.gpu_memory:g} GB card's {card / GiB:.2f} GiB: fits {figures['fits_card']}" if card else "")
        )
    if args.out:
        partial = args.out.with_name(args.out.name + ".partial")  # gpu_check.py may read it while it is cut short
        partial.write_text(json.dumps(figures, indent=2))
        partial.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
