"""Why `model.optimizer: adamw4bit` trails fp32 AdamW on the tiny demo: which of its two 4-bit moments costs
the quality, without FSDP in the way.

Each run is the demo's fit (`tts-lightning fit --config configs/tiny-cpu.yaml`, 60 steps, lr 1e-3 cosine,
the fixed train/validation split of benchmarks/optimizer_quality.py) in ONE process (``--trainer.devices 1
--trainer.strategy auto``: whole tensors, no FSDP pieces), under torchao's AdamW4bit with each moment
stored in fp32, 8 bits (torchao's OptimState8bit, block 256) or 4 bits (OptimState4bit, block 128) as
a run's ``first/second`` says. `MomentBits` sets that by replacing the optimizer's ``_new_buffer``
before the first step (torchao creates the state lazily there); the update is torchao's
``single_param_adam`` in every run. The rows ``adamw`` / ``adamw8bit`` / ``adamw4bit`` are the options
as shipped. Printed: the validation loss at steps 20, 40 and 60.

``--toy`` also trains a small MLP (60 steps, lr 1e-2) with torchao's own ``AdamW4bit`` class (its
compiled step) beside this project's ``build_optimizer("adamw4bit")`` (eager on the CPU), adamw8bit
and fp32 AdamW: the same gap without this project's model, data or wrapper.

    PYTHONPATH=. python benchmarks/optimizer_4bit_moments.py --toy     # ~8 min on 2 cores
    PYTHONPATH=. python benchmarks/optimizer_4bit_moments.py --runs adamw4bit --diagnose  # + the moment's error
    PYTHONPATH=. python benchmarks/optimizer_4bit_moments.py --runs 4/4/32               # 4-bit blocks of 32
    PYTHONPATH=. python benchmarks/optimizer_4bit_moments.py --runs adamw,adamw4bit --lr 1e-4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = "adamw,adamw8bit,adamw4bit,4/32,32/4,8/4,4/8"

try:
    from lightning.pytorch import Callback
except ImportError:  # the parent process needs no Lightning
    Callback = object  # type: ignore[assignment, misc]


class MomentBits(Callback):  # type: ignore[misc, valid-type]
    """Stores AdamW4bit's first / second moment in ``first`` / ``second`` bits (32, 8 or 4; 4-bit blocks
    of ``block4`` values), with torchao's own rule for which tensors are quantized (>= 4096 values, whole blocks)."""

    def __init__(self, first: int = 4, second: int = 4, block4: int = 128) -> None:
        self.bits = {True: first, False: second}  # torchao's ``signed``: the first moment
        self.block4 = block4

    def on_train_start(self, trainer, pl_module) -> None:
        import torch
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit

        def new_buffer(p, signed: bool):
            bits = self.bits[signed]
            block = self.block4 if bits == 4 else 256
            if bits < 32 and p.numel() >= 4096 and p.numel() % block == 0:
                return (OptimState4bit if bits == 4 else OptimState8bit).zeros(p.shape, signed, block, p.device)
            return torch.zeros_like(p)

        trainer.optimizers[0]._new_buffer = new_buffer


class ShadowMoment(Callback):  # type: ignore[misc, valid-type]
    """The quantized first moment against an fp32 one updated from the same gradients (torchao's lerp),
    over the tensors whose state is quantized: relative error, norm ratio and the share of values the
    quantized one holds at 0 where the fp32 one does not, at the steps in ``at``, written to
    ``<default_root_dir>/shadow-moment.json``."""

    def __init__(self, at: tuple[int, ...] = (1, 2, 5, 10, 20, 40, 60)) -> None:
        self.at, self.shadow, self.rows = at, {}, []

    def on_train_start(self, trainer, pl_module) -> None:
        import torch

        optimizer = trainer.optimizers[0]
        update = optimizer._update  # `_EagerOnCPU._update`: per parameter, the clipped gradient in p.grad

        def shadowed(fn, group, p) -> None:
            if p.numel() >= 4096:  # possibly quantized: compared if its state is
                old = self.shadow.get(p, p.grad.new_zeros(p.shape, dtype=torch.float32))
                self.shadow[p] = old.lerp(p.grad.float(), 1 - group["betas"][0])
            update(fn, group, p)

        optimizer._update = shadowed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch

        step = trainer.global_step
        if step not in self.at:
            return
        pairs = [(s["exp_avg"], self.shadow[p]) for p, s in trainer.optimizers[0].state.items() if p in self.shadow]
        pairs = [(q.dequantize().flatten(), t.flatten()) for q, t in pairs if hasattr(q, "dequantize")]
        quant, true = torch.cat([q for q, _ in pairs]), torch.cat([t for _, t in pairs])
        self.rows.append(
            {
                "step": step,
                "relative_error": float((quant - true).norm() / true.norm()),
                "norm_ratio": float(quant.norm() / true.norm()),
                "zeroed": float(((quant == 0) & (true != 0)).float().mean()),
                "values": quant.numel(),
            }
        )
        (Path(trainer.default_root_dir) / "shadow-moment.json").write_text(json.dumps(self.rows))


def fit(args: argparse.Namespace, run: str, manifests: tuple[Path, Path]) -> list[tuple[int, float]]:
    from optimizer_quality import _scalars

    folder = args.work / run.replace("/", "-")
    command = [sys.executable, "-m", "tts_lightning", "fit", "--config", str(REPO / "configs" / "tiny-cpu.yaml")]
    command += ["--data.pretrained", args.pretrained, "--data.train_manifest", str(manifests[0])]
    command += ["--data.val_manifest", str(manifests[1]), "--data.val_fraction", "0"]
    command += ["--data.cache_dir", str(args.work / "cache"), "--trainer.devices", "1", "--trainer.strategy", "auto"]
    command += ["--trainer.default_root_dir", str(folder)]
    command += ["--trainer.enable_checkpointing", "false", "--model.learning_rate", str(args.lr)]
    command += ["--model.optimizer", run if "/" not in run else "adamw4bit"]
    if "/" in run:
        first, second, block4 = [*run.split("/"), "128"][:3]
        init = f'"init_args": {{"first": {first}, "second": {second}, "block4": {block4}}}'
        command.append(f'--trainer.callbacks+={{"class_path": "optimizer_4bit_moments.MomentBits", {init}}}')
    if args.diagnose and run == "adamw4bit":
        command.append('--trainer.callbacks+={"class_path": "optimizer_4bit_moments.ShadowMoment"}')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"run {run} failed (exit {done.returncode})")
    if args.diagnose and run == "adamw4bit":
        for row in json.loads((folder / "shadow-moment.json").read_text()):
            print(
                f"    step {row['step']:2}: 4-bit first moment vs fp32 from the same gradients: relative error "
                f"{row['relative_error']:.3f}, norm {row['norm_ratio']:.3f}, zero where fp32 is not {row['zeroed']:.3f}"
            )
    return [(step + 1, value) for step, value in _scalars(folder)["val/loss"]]


def toy() -> None:
    """A 64-128-64 MLP regression: torchao's AdamW4bit class against ours and the others."""
    import torch
    from torchao.optim import AdamW4bit

    from tts_lightning.model.optimizers import build_optimizer

    torch.manual_seed(0)
    x, w = torch.randn(512, 64), torch.randn(64, 64) / 8
    y = torch.tanh(x @ w) + 0.05 * torch.randn(512, 64)
    finals = {}
    for kind in ("torchao AdamW4bit", "adamw4bit", "adamw8bit", "adamw"):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
        params = list(model.parameters())
        own = " " in kind  # torchao's class itself
        opt = AdamW4bit(params, lr=1e-2, weight_decay=0.01) if own else build_optimizer(kind, params, 1e-2, 0.01)
        t0 = time.perf_counter()
        for step in range(60):
            rows = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(step))
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
        finals[kind] = torch.cat([p.detach().flatten() for p in params])
        with torch.no_grad():
            mse = torch.nn.functional.mse_loss(model(x), y).item()
        print(f"  toy {kind:18} final mse {mse:.5f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    def apart(a: str, b: str) -> float:
        return float((finals[a] - finals[b]).norm() / finals[b].norm())

    print(
        "  toy weights apart (relative norm): torchao AdamW4bit vs ours "
        f"{apart('torchao AdamW4bit', 'adamw4bit'):.3f}, adamw4bit vs adamw {apart('adamw4bit', 'adamw'):.3f}, "
        f"adamw8bit vs adamw {apart('adamw8bit', 'adamw'):.3f}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--runs", default=RUNS, help="options, or AdamW4bit's first/second moment bits (32, 8, 4)[/4-bit block]"
    )
    p.add_argument("--lr", type=float, default=1e-3, help="model.learning_rate (the demo's 1e-3)")
    p.add_argument("--pretrained", default="runs/tiny-model", help="built with `tts-lightning tiny-model` if absent")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench" / "optimizer-4bit-moments")
    p.add_argument("--diagnose", action="store_true", help="the adamw4bit run's first moment against fp32")
    p.add_argument("--toy", action="store_true", help="also the toy MLP with torchao's own AdamW4bit class")
    args = p.parse_args()
    from optimizer_quality import split_demo

    args.work.mkdir(parents=True, exist_ok=True)
    if not Path(args.pretrained).is_dir():
        subprocess.run([sys.executable, "-m", "tts_lightning", "tiny-model", args.pretrained], cwd=REPO, check=True)
    manifests = split_demo(args.work)
    print("run (first/second moment bits)   val/loss at steps 20, 40, 60", flush=True)
    for run in args.runs.split(","):
        losses = fit(args, run, manifests)
        print(f"  {run:30} " + ", ".join(f"{v:.4f}" for _, v in losses), flush=True)
    if args.toy:
        toy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
