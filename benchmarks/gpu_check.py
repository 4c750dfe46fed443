"""Every GPU figure the project needs, in one run on one GPU machine (an H200 here), within a deadline.

Run by benchmarks/gpu_check.sh (which installs the wheels the device image lacks first). Writes one
JSON with every step's status, seconds and figures, and one log of every step's output, to $OUT
(the device tool's result folder; runs/gpu_check elsewhere); exits non-zero when a step failed or
could not run, and still writes both files.

0. preflight: every module the steps import, each named when missing (nothing else runs then);
1. the shipped 1-GPU configs on the GPU with the tiny model, NCCL at world size 1 (FSDP1 NO_SHARD,
   bf16-mixed, the samples callback, lean sharded checkpoints, pinned batches, resume from last):
   configs/qwen3-tts-0.6b-1gpu.yaml, also with cpu_offload (pinned shards saved and resumed); and
   configs/qwen3-tts-0.6b-1gpu-fsdp2.yaml with cpu_offload (gradients clipped on the CPU through the
   process group's gloo backend beside NCCL); and
   configs/qwen3-tts-1.7b-1x24gb.yaml (model.optimizer bf16_sr_adamw8bit: torchao's compiled step,
   8-bit state saved per rank, resume from last);
   meanwhile the released-size 1.7B and 0.6B random-weight directories are built (CPU);
2. the released 1.7B as one rank of 4 (FULL_SHARD, fake process group, benchmarks/real_size.py)
   on what a 16 GB card offers after the CUDA context, 2000-position batches: memory beside the
   planner, step time, tokens/s after warm-up, MFU from matmul FLOPs (alone on the GPU: timed);
3. side by side (memory only; each process capped at its card): the same with the samples callback,
   with cpu_offload, with FSDP2; the 0.6B at world size 1 on a 24 GB card.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the device image does not install the project: its preflight imports it from here
OUT = Path(os.environ.get("OUT") or REPO / "runs" / "gpu_check")
WORK = REPO / "runs" / "gpu_check_work"
DEADLINE = time.monotonic() + float(os.environ.get("GPU_CHECK_SECONDS", "530"))
NEEDED = (
    "torch", "torchaudio", "lightning", "transformers", "tokenizers", "huggingface_hub", "accelerate", "peft",
    "safetensors", "jsonargparse", "docstring_parser", "typeshed_client", "soundfile", "librosa", "sox",
    "qwen_tts", "torchmetrics", "tensorboard", "filelock", "tqdm", "rich", "yaml", "torchao.optim",
    "tts_lightning.cli", "tts_lightning.distributed.fsdp", "tts_lightning.distributed.fsdp2",
    "tts_lightning.callbacks", "tts_lightning.distributed.memory",
)  # fmt: skip
log = []
report: dict = {"steps": {}}


def preflight() -> list[str]:
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an import that fails for any reason is missing here
            missing.append(f"{name} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    return missing


def start(name: str, argv: list[str], threads: int = 4) -> tuple[str, subprocess.Popen, float]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
    }
    logfile = open(WORK / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=logfile, stderr=subprocess.STDOUT)
    return name, proc, time.monotonic()


def finish(running: list, limit: float, figures: dict[str, Path] | None = None) -> bool:
    """Wait for the started steps (each at most ``limit`` s and never past the deadline)."""
    ok = True
    for name, proc, began in running:
        try:
            proc.wait(timeout=max(1.0, min(limit - (time.monotonic() - began), DEADLINE - time.monotonic())))
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            status = "timed out"
        output = (WORK / f"{name}.log").read_text(errors="replace")
        step = {"status": status, "seconds": round(time.monotonic() - began, 1), "tail": output[-1500:]}
        path = (figures or {}).get(name)
        if path is not None and path.is_file():
            try:
                step["figures"] = json.loads(path.read_text())
            except ValueError as error:  # cut short while writing
                step["figures"] = f"unreadable: {error}"
        report["steps"][name] = step
        log.append(f"===== {name}: {status} in {step['seconds']} s\n{output}")
        ok &= status == "ok"
    save()
    return ok


def save() -> None:
    """The report so far, after every stage: a device call cut short still brings back what ran."""
    for path, text in ((OUT / "gpu_check.json", json.dumps(report, indent=1)), (OUT / "gpu_check.log", "\n".join(log))):
        partial = path.with_name(path.name + ".partial")
        partial.write_text(text)
        partial.replace(path)


def fit_config(name: str, config: str, *extra: str) -> list[str]:
    run = WORK / name
    return [
        "-m", "tts_lightning", "fit", "--config", config, "--data.pretrained", "tiny",
        "--data.train_manifest", "tts_lightning/demo/train.jsonl", "--data.cache_dir", str(WORK / "cache"),
        "--trainer.default_root_dir", str(run),
        "--trainer.max_steps", "2", "--trainer.callbacks.max_new_tokens", "8",
        "--trainer.callbacks.similarity", "false", "--checkpoint.monitor", "val/loss", "--checkpoint.mode", "min",
        *extra,
    ]  # fmt: skip


def metadata_on_host(meta: Path) -> bool:
    """A sharded checkpoint's ``meta.pt`` (rank 0's ModelCheckpoint scores, loop state...) holds no
    CUDA tensor: read on another rank without a map_location it would land on cuda:0 there (the
    GPU side of `AtomicCheckpoints._write_sharded`, which CPU runs cannot show)."""
    import torch

    found: list[str] = []

    def walk(value, where: str) -> None:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            found.append(f"{where}: {value.device}")
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}.{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")

    began = time.monotonic()
    try:
        walk(torch.load(meta, weights_only=False), "meta")
        status = "ok" if not found else f"CUDA tensors in {meta}: {found[:5]}"
    except OSError as error:
        status = f"unreadable: {error}"
    report["steps"]["metadata_on_host"] = {"status": status, "seconds": round(time.monotonic() - began, 1)}
    log.append(f"===== metadata_on_host: {status}")
    return status == "ok"


def real_size(name: str, *args: str) -> list[str]:
    return [
        "benchmarks/real_size.py",
        "--device",
        "cuda",
        "--frames",
        "2000",
        "--out",
        str(WORK / f"{name}.json"),
        *args,
    ]


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    import torch

    report["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    report["torch"] = torch.__version__
    missing = preflight()
    report["preflight_missing"] = missing
    save()
    ok = not missing and torch.cuda.is_available()
    if ok:
        one_gpu = "configs/qwen3-tts-0.6b-1gpu.yaml"
        fsdp2 = "configs/qwen3-tts-0.6b-1gpu-fsdp2.yaml"
        offload = "config_0.6b_1gpu_fsdp2_offload"
        # FSDP1 with cpu_offload at world size 1: pinned shards in the lean sharded checkpoint.
        offload1 = "config_0.6b_1gpu_offload"
        # model.optimizer bf16_sr_adamw8bit on a GPU: torchao's compiled step (CPU runs it eagerly).
        lean = "configs/qwen3-tts-1.7b-1x24gb.yaml"
        for fresh in ("config_0.6b_1gpu", offload, offload1, "config_1.7b_1x24gb"):
            shutil.rmtree(WORK / fresh, ignore_errors=True)  # a rerun on a warm machine: new runs, not resumes
        ok &= finish(
            [
                start("build_1.7b", ["benchmarks/released_dir.py", "1.7b", "runs/bench/released-1.7b"], threads=6),
                start("build_0.6b", ["benchmarks/released_dir.py", "0.6b", "runs/bench/released-0.6b"], threads=4),
                start("config_0.6b_1gpu", fit_config("config_0.6b_1gpu", one_gpu)),
                start(offload, fit_config(offload, fsdp2, "--trainer.strategy.init_args.cpu_offload", "true")),
                start(offload1, fit_config(offload1, one_gpu, "--trainer.strategy.init_args.cpu_offload", "true")),
                start("config_1.7b_1x24gb", fit_config("config_1.7b_1x24gb", lean)),
            ],
            limit=240,
        )
        if ok:  # resume the FSDP1 run from its last checkpoint, one step more
            resume = fit_config("config_0.6b_1gpu", one_gpu, "--trainer.max_steps", "3", "--ckpt_path", "last")
            lean_resume = fit_config("config_1.7b_1x24gb", lean, "--trainer.max_steps", "3", "--ckpt_path", "last")
            offload_resume = fit_config(
                offload1,
                one_gpu,
                "--trainer.strategy.init_args.cpu_offload",
                "true",
                "--trainer.max_steps",
                "3",
                "--ckpt_path",
                "last",
            )
            ok &= finish(
                [
                    start("config_0.6b_1gpu_resume", resume),
                    start("config_1.7b_1x24gb_resume", lean_resume),
                    start(f"{offload1}_resume", offload_resume),
                ],
                limit=90,
            )
        if ok:
            ok &= metadata_on_host(WORK / "config_0.6b_1gpu" / "checkpoints" / "last.ckpt" / "meta.pt")
        name = "real_1.7b_16gb"
        timed = start(name, real_size(name, "--gpu-memory", "16", "--steps", "4"), threads=8)
        ok &= finish([timed], 150, {name: WORK / f"{name}.json"})
        # Side by side, each process would count the others' memory as its CUDA context: the lone run's.
        alone = report["steps"][name].get("figures")
        context = ["--cuda-context", str(alone["cuda_context"])] if isinstance(alone, dict) else []
        side = {
            "real_1.7b_16gb_samples": ("--gpu-memory", "16", "--steps", "2", "--samples"),
            "real_1.7b_16gb_offload": ("--gpu-memory", "16", "--steps", "2", "--cpu-offload"),
            "real_1.7b_16gb_fsdp2": ("--gpu-memory", "16", "--steps", "2", "--strategy", "fsdp2"),
            "real_0.6b_24gb": ("--size", "0.6b", "--world", "1", "--gpu-memory", "24", "--steps", "3"),
        }
        running = [start(n, real_size(n, *args, *context), threads=3) for n, args in side.items()]
        ok &= finish(running, 200, {n: WORK / f"{n}.json" for n in side})
    report["ok"] = bool(ok)
    save()
    print(json.dumps({n: s["status"] for n, s in report["steps"].items()}, indent=1))
    print("missing:", missing or "nothing")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
