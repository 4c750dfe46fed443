"""The benchmarks that emulate a rank of a larger run run in the suite at a tiny size, so that they
cannot rot unseen (benchmarks/gpu_check.sh runs them at the released sizes on a GPU)."""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_real_size_emulates_one_rank_of_four(strategy, tiny_dir, tmp_path, run_script):
    """benchmarks/real_size.py: rank 0 of 4 under torch's fake process group, through data setup
    (whose agreement between ranks the fake group cannot carry) and training; its model states are
    the planner's, byte for byte, for the tiny model too."""
    out = tmp_path / "figures.json"
    args = ["--pretrained", tiny_dir, "--world", 4, "--strategy", strategy, "--steps", 2, "--frames", 150]
    run_script(REPO / "benchmarks" / "real_size.py", *args, "--out", out, "--work", tmp_path, timeout=300, cwd=tmp_path)
    figures = json.loads(out.read_text())
    assert figures["world"] == 4 and figures["steps"] == 2 and figures["positions"] > 0
    assert figures["model_states"] == figures["planned_model_states"] > 0


def test_the_gpu_check_imports_what_it_names():
    """benchmarks/gpu_check.py's preflight names every module its steps import: all of them import
    here (a misspelt name would make the GPU run stop at its first minute)."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    assert gpu_check.preflight() == []
