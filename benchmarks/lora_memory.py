"""Model-state memory and step time per rank: LoRA versus full fine-tuning, side by side, on CPU
(2 processes, gloo, FSDP FULL_SHARD with the project's wrap policy).

The ~150M-parameter random model of `benchmarks/fsdp_memory.py` (real Qwen3-TTS classes, widened
tiny config). Full fine-tuning: fp32 master weights, gradients and AdamW state for everything but
the frozen speaker encoder. LoRA: peft adapters (rank 16, alpha 32, the default targets: attention
and MLP projections of the talker and the code predictor) as `Qwen3TTSModule(adapter=...)` builds
them: the frozen base stored in the run's precision (fp32 under 32-true; bf16 under bf16-mixed), the
adapters fp32 with AdamW state, each
adapter matrix an FSDP unit of its own (`Qwen3TTSFSDPStrategy`'s policy), so the frozen units keep no
gradient. Each arm takes 2 real AdamW steps on the project's loss; after them each rank sums the
bytes of the unique storages it holds for parameters, gradients and AdamW state (`held_bytes`). Step
time is the last step's (the first is warm-up). The planner (`plan_memory(..., adapter=...)`) predicts the model
states from a meta-device build of the same config.

Both precisions run side by side in one run by default: the fp32 arm (``32-true``: everything fp32)
and the bf16 arm (``bf16-mixed``, the GPU setting: FSDP mixed precision with bf16 compute; LoRA's
frozen base stored in bf16, its adapters fp32 with fp32 AdamW state; full fine-tuning keeps fp32
master weights, gradients and AdamW state).

    PYTHONPATH=. python benchmarks/lora_memory.py                    # both arms: ~30 minutes on 2
                                                                     # cores (bf16 matmuls are slow on
                                                                     # CPUs without bf16 instructions)
    PYTHONPATH=. python benchmarks/lora_memory.py 32-true            # one arm: ~3-5 minutes
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from fsdp_memory import FREEZE, LossModel, bench_config, free_port, held_bytes, make_batch  # noqa: E402

WORLD = 2
STEPS = 2
PRECISIONS = sys.argv[1:] or ["32-true", "bf16-mixed"]
ADAPTER = {"rank": 16, "alpha": 32.0}


def worker(rank: int, mode: str, port: int, out_dir: str, precision: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from tts_lightning.distributed.fsdp import DEFAULT_WRAP, _with_trainable_leaves, import_classes
    from tts_lightning.model.lora import LoRASettings, is_adapter_key, lora_config, target_names
    from tts_lightning.model.parameters import matches

    config = bench_config()
    torch.manual_seed(0)  # identical initial weights on every rank
    cfg = Qwen3TTSConfig.from_dict(json.loads(json.dumps(config)))
    for c in (cfg, cfg.talker_config, cfg.talker_config.code_predictor_config):
        c._attn_implementation = "sdpa"
    model = Qwen3TTSForConditionalGeneration(cfg).float()
    policy = ModuleWrapPolicy(import_classes(DEFAULT_WRAP))
    if mode == "lora":
        settings = LoRASettings(**ADAPTER)
        model = inject_adapter_in_model(lora_config(settings, target_names(model, settings)), model)
        for module in model.modules():  # as `tts_lightning.model.lora.inject_lora`
            if isinstance(module, LoraLayer):
                module.cast_input_dtype_enabled = False
        for name, p in model.named_parameters():
            p.requires_grad_(is_adapter_key(name))
            if not p.requires_grad and precision == "bf16-mixed":
                p.data = p.data.to(torch.bfloat16)  # the frozen base in the run's precision
        policy = _with_trainable_leaves(policy)
    else:
        for name, p in model.named_parameters():
            p.requires_grad_(not matches(name, FREEZE))
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    wrapped = FSDP(
        LossModel(model),
        auto_wrap_policy=policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32
        )
        if precision == "bf16-mixed"
        else None,
        device_id=torch.device("cpu"),
        use_orig_params=True,
        limit_all_gathers=True,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    )
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.0)
    times, losses = [], []
    for step in range(STEPS):
        batch = make_batch(config, seed=100 * step + rank)
        dist.barrier()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        loss = wrapped(batch)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    held = held_bytes(wrapped, optimizer)
    result = {
        "rank": rank,
        "mode": mode,
        "params": n_params,
        "trainable": n_trainable,
        "losses": losses,
        "step_s": times[-1],
        "held": held,
    }
    Path(out_dir, f"{mode}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    from tts_lightning.distributed.memory import plan_memory

    unknown = sorted(set(PRECISIONS) - {"32-true", "bf16-mixed"})
    if unknown:
        print(f"unknown precision(s) {unknown}: 32-true and/or bf16-mixed")
        return 2
    config = bench_config()
    summary = []
    ok = True
    for precision in PRECISIONS:
        results = {}
        with tempfile.TemporaryDirectory() as out:
            for mode in ("lora", "full"):
                t = time.perf_counter()
                mp.spawn(worker, args=(mode, free_port(), out, precision), nprocs=WORLD, join=True)
                wall = time.perf_counter() - t
                print(f"{precision} {mode}: {wall:.1f} s wall (spawn, build, wrap, {STEPS} steps)", flush=True)
                results[mode] = [json.loads(Path(out, f"{mode}-{r}.json").read_text()) for r in range(WORLD)]
        common = dict(
            gpus=WORLD,
            gpu_memory_gb=1000,
            precision=precision,
            activation_checkpointing=False,
            freeze=FREEZE,
            micro_batch_frames=100,
            sharding="FULL_SHARD",
        )
        predicted = {"lora": plan_memory(config, adapter=ADAPTER, **common), "full": plan_memory(config, **common)}
        mb = lambda x: f"{x / 2**20:9.1f}"  # noqa: E731
        r0 = results["lora"][0]
        print(
            f"\nmodel: real Qwen3-TTS classes, {results['full'][0]['params'] / 1e6:.1f}M parameters; LoRA r16/alpha32 "
            f"adds {(r0['params'] - results['full'][0]['params']) / 1e6:.2f}M trainable; {precision}, AdamW, "
            f"{WORLD} ranks (gloo, CPU), FSDP FULL_SHARD"
        )
        print(
            f"{'':22}{'params MiB':>10}{'grads MiB':>10}{'AdamW MiB':>10}{'states MiB':>11}"
            f"{'planner MiB':>12}{'meas/plan':>10}{'step s':>8}"
        )
        states: dict[str, list[int]] = {}
        for mode in ("lora", "full"):
            plan = predicted[mode]
            for r in results[mode]:
                h = r["held"]
                total = h["parameters"] + h["gradients"] + h["optimizer"]
                states.setdefault(mode, []).append(total)
                label = f"{'LoRA' if mode == 'lora' else 'full fine-tuning'} rank {r['rank']}"
                print(
                    f"{label:22}{mb(h['parameters']):>10}{mb(h['gradients']):>10}{mb(h['optimizer']):>10}"
                    f"{mb(total):>11}{mb(plan.model_states):>12}{total / plan.model_states:>10.3f}"
                    f"{r['step_s']:>8.2f}"
                )
        ratio = max(states["lora"]) / max(states["full"])
        planned = predicted["lora"].model_states / predicted["full"].model_states
        step_ratio = max(r["step_s"] for r in results["lora"]) / max(r["step_s"] for r in results["full"])
        err = max(abs(s / predicted[m].model_states - 1) for m in states for s in states[m])
        print(f"LoRA / full fine-tuning model states per rank: {ratio:.3f} (planner {planned:.3f}; target <= 0.25)")
        print(f"LoRA / full fine-tuning step time: {step_ratio:.2f} (step {STEPS}; the first is warm-up)")
        print(f"planner vs measurement, worst rank: {err * 100:.1f}% off (target within 15%)")
        print(
            f"losses per step (rank 0): LoRA {[round(x, 4) for x in results['lora'][0]['losses']]}, "
            f"full {[round(x, 4) for x in results['full'][0]['losses']]}\n",
            flush=True,
        )
        summary.append((precision, ratio, planned, step_ratio, err))
        # The memory goal is the GPU setting's (bf16-mixed); fp32 keeps 4 bytes per frozen parameter.
        ok = ok and err <= 0.15 and (precision != "bf16-mixed" or ratio <= 0.25)
    print(f"{'precision':12}{'states LoRA/full':>18}{'planner':>9}{'step LoRA/full':>16}{'planner off':>13}")
    for precision, ratio, planned, step_ratio, err in summary:
        print(f"{precision:12}{ratio:>18.3f}{planned:>9.3f}{step_ratio:>16.2f}{err * 100:>12.1f}%")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
