"""Host memory to start a real fine-tuning run of the released-size 0.6B, and to export from it.

All on this CPU machine, with a released-size Base directory of random weights
(benchmarks/released_dir.py; 914.6M parameters, 3.41 GiB in fp32):

1. ``load``: one process building the model the old way (random fp32 init, the whole state dict
   read, an fp32 copy of it, load_state_dict) and the new way (`build_model`: parameters on the
   meta device, filled tensor by tensor), side by side: peak RSS above the process's baseline.
2. ``fit``: `tts-lightning fit` with 2 FSDP ranks on the demo clips (the real CLI, strategy and
   module) with a probe callback (benchmarks/memory_probe.py) sampling each rank's RSS from `setup`
   (imports done, data prepared, no model) to `on_train_start` (loaded, wrapped, sharded, optimizer
   built); it then saves a sharded checkpoint and stops before the first step.
3. ``export``: `export_custom_voice` from that sharded checkpoint to bf16: peak RSS above baseline.

Goals (issue 11): sum over ranks <= 1.5x the fp32 model (was ~5.6x); export <= 1.3x the exported
weights. With 2 ranks each FULL_SHARD rank keeps half the fp32 parameters (0.5x) by design, so the
"other ranks below 0.3x" goal can only hold from 4 ranks on; the table shows each rank's own shard
beside its peak.

    PYTHONPATH=. python benchmarks/startup_memory.py        # ~10 minutes, ~12 GiB of RAM, 6 GiB disk
    PYTHONPATH=. python benchmarks/startup_memory.py --config configs/tiny-cpu-fsdp2.yaml   # FSDP2
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "runs" / "bench" / "startup"
GiB = 2**30

LOAD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "benchmarks")
    from memory_probe import PeakSampler
    import torch
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    from tts_lightning.model.loading import build_model
    from tts_lightning.model.pretrained import check_pretrained, load_config, load_state_dict
    info = check_pretrained(sys.argv[1])
    sampler = PeakSampler().start()
    if sys.argv[2] == "legacy":  # what build_model did before: random init, whole file, a second copy
        model = Qwen3TTSForConditionalGeneration(load_config(info)).float()
        model.load_state_dict({k: v.float() for k, v in load_state_dict(info).items()})
    else:
        model = build_model(info)
    print(json.dumps({"peak_above_baseline": sampler.stop()}))
""")

EXPORT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, "benchmarks")
    from memory_probe import PeakSampler
    from tts_lightning.model.export import export_custom_voice
    import safetensors, torch.distributed.checkpoint  # imports before the baseline
    sampler = PeakSampler().start()
    out = export_custom_voice(sys.argv[1], sys.argv[2], dtype="bf16", overwrite=True)
    print(json.dumps({"peak_above_baseline": sampler.stop()}))
""")


def run(args: list[str], **kwargs) -> str:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'benchmarks'}",
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(map(str, args[:4]))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc.stdout


def last_json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-cpu.yaml", help="the fit config (its strategy is measured)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    from released_dir import build_released_dir

    pretrained = build_released_dir("0.6b", REPO / "runs" / "bench" / "released-0.6b")
    index = json.loads((pretrained / "model.safetensors.index.json").read_text())
    fp32 = index["metadata"]["total_size"] * 2  # stored bf16
    print(
        f"released-size 0.6B directory: {pretrained} ({fp32 / 4 / 1e6:,.1f}M parameters, {fp32 / GiB:.2f} GiB in fp32)",
        flush=True,
    )

    shutil.rmtree(WORK, ignore_errors=True)
    checkpoint = WORK / "startup.ckpt"
    run(
        [
            sys.executable,
            "-m",
            "tts_lightning",
            "fit",
            "--config",
            args.config,
            "--data.pretrained",
            str(pretrained),
            "--data.cache_dir",
            str(WORK / "cache"),
            "--data.max_frames_per_batch",
            "150",
            "--trainer.default_root_dir",
            str(WORK / "run"),
            "--trainer.enable_checkpointing",
            "false",
            "--trainer.num_sanity_val_steps",
            "0",
            "--trainer.callbacks+=memory_probe.StartupMemory",
            "--trainer.callbacks.out_dir",
            str(WORK / "probe"),
            "--trainer.callbacks.checkpoint",
            str(checkpoint),
        ],
        timeout=3600,
    )
    ranks = [json.loads((WORK / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)]
    exported = last_json(run([sys.executable, "-c", EXPORT, str(checkpoint), str(WORK / "voice")]))
    voice_bytes = sum(f.stat().st_size for f in (WORK / "voice").glob("model*.safetensors"))
    loads = {
        mode: last_json(run([sys.executable, "-c", LOAD, str(pretrained), mode]))["peak_above_baseline"]
        for mode in ("legacy", "meta")
    }

    print("\nload one model (one process, peak RSS above baseline / fp32 model):")
    print(
        f"  before (random init + whole state dict + fp32 copy)  {loads['legacy'] / GiB:6.2f} GiB  "
        f"{loads['legacy'] / fp32:5.2f}x"
    )
    print(
        f"  now (meta parameters, filled tensor by tensor)        {loads['meta'] / GiB:6.2f} GiB  "
        f"{loads['meta'] / fp32:5.2f}x"
    )
    print(f"  now / before                                          {loads['meta'] / loads['legacy']:5.2f}")
    print(f"\nfit startup, 2 ranks of {args.config} (setup -> on_train_start), peak RSS above baseline / fp32 model:")
    for r in ranks:
        print(
            f"  rank {r['rank']}: {r['peak_above_baseline'] / GiB:6.2f} GiB  {r['peak_above_baseline'] / fp32:5.2f}x"
            f"   (its own fp32 shard: {r['local_parameter_bytes'] / fp32:4.2f}x; {r['seconds']:.0f} s)"
        )
    total = sum(r["peak_above_baseline"] for r in ranks)
    print(f"  sum over ranks: {total / GiB:.2f} GiB = {total / fp32:.2f}x the fp32 model (goal <= 1.5x)")
    print(
        f"\nexport from the sharded checkpoint to bf16: peak {exported['peak_above_baseline'] / GiB:.2f} GiB "
        f"above baseline = {exported['peak_above_baseline'] / voice_bytes:.2f}x the exported weights "
        f"({voice_bytes / GiB:.2f} GiB; goal <= 1.3x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
