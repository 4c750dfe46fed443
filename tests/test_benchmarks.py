"""The benchmarks that emulate a rank of a larger run run in the suite at a tiny size, so that they
cannot rot unseen (benchmarks/gpu_check.sh runs them at the released sizes on a GPU)."""

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


# FSDP2 with the leanest optimizer (bf16 weights, 8-bit moments: torchao's quantized state counted
# by benchmarks/optimizer_state_bytes.py), FSDP1 with the default: no run added for the optimizer.
@pytest.mark.parametrize(("strategy", "optimizer"), [("fsdp1", "adamw"), ("fsdp2", "bf16_sr_adamw8bit")])
def test_real_size_emulates_one_rank_of_four(strategy, optimizer, tiny_dir, tmp_path, run_script):
    """benchmarks/real_size.py: rank 0 of 4 under torch's fake process group, through data setup
    (whose agreement between ranks the fake group cannot carry) and training; its weights,
    gradients and optimizer state are the planner's, byte for byte, for the tiny model too."""
    out = tmp_path / "figures.json"
    args = ["--pretrained", tiny_dir, "--world", 4, "--strategy", strategy, "--steps", 2, "--frames", 150]
    args += ["--optimizer", optimizer]
    run_script(REPO / "benchmarks" / "real_size.py", *args, "--out", out, "--work", tmp_path, timeout=300, cwd=tmp_path)
    figures = json.loads(out.read_text())
    assert figures["world"] == 4 and figures["steps"] == 2 and figures["positions"] > 0
    assert figures["model_states"] == figures["planned_model_states"] > 0
    assert figures["held"] == figures["planned_held"]
    assert figures["precision"] == ("bf16-mixed" if optimizer.startswith("bf16") else "32-true")


def test_the_gpu_check_imports_what_it_names_where_the_project_is_not_installed(tmp_path):
    """benchmarks/gpu_check.py run as on the device (`python3 benchmarks/gpu_check.py`, the project
    not installed there, the wheels it lacks on PYTHONPATH): its preflight imports every module its
    steps need, this project's included (it named all five tts_lightning modules missing there, and
    the GPU run would have done nothing), and writes its report; without CUDA it stops there.
    ``-S``: no site-packages processing, so the editable install's finder is absent; the
    environment's packages come through PYTHONPATH, after the standard library."""
    import subprocess
    import sys
    import sysconfig

    paths = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    # No CUDA: the check stops after its preflight (with a GPU it would run every stage).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-S", str(REPO / "benchmarks" / "gpu_check.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["preflight_missing"] == [], done.stdout[-3000:]
    assert report["device"] == "no CUDA device" and report["ok"] is False and done.returncode == 1
