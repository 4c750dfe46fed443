"""Runs that several test modules of this folder compare with, each trained once per session."""

import json
import shutil

import pytest
from tiny_runs import HERE, REFERENCE_EVERY, REFERENCE_STEPS, TINY_CPU, TINY_CPU_FSDP2, fit_args


def _fit(run_cli, workdir, tiny_dir, config, run, *extra):
    """A seeded reference run with RecordSteps (each rank's per-step loss and gradient norms)."""
    record = json.dumps({"class_path": "fsdp2_callbacks.RecordSteps", "init_args": {"out": str(workdir / run)}})
    steps = ("--trainer.max_steps", REFERENCE_STEPS, "--trainer.val_check_interval", REFERENCE_EVERY)
    args = fit_args(config, workdir, tiny_dir, run, *steps, f"--trainer.callbacks+={record}", *extra)
    proc = run_cli(*args, cwd=workdir, pythonpath=[HERE])
    return workdir / run, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def reference_workdir(tmp_path_factory):
    from tts_lightning.data.demo import demo_dir

    root = tmp_path_factory.mktemp("reference")
    shutil.copytree(demo_dir(), root / "demo")
    return root


@pytest.fixture(scope="session")
def fsdp1_reference(run_cli, reference_workdir, tiny_dir):
    """configs/tiny-cpu.yaml (FSDP1, fp32, sharded checkpoints): (run folder, its output). The golden
    losses (test_fit_fsdp.py), the uninterrupted run of the resume tests, FSDP2's reference."""
    return _fit(run_cli, reference_workdir, tiny_dir, TINY_CPU, "fsdp1")


@pytest.fixture(scope="session")
def fsdp2_full_reference(run_cli, reference_workdir, tiny_dir):
    """configs/tiny-cpu-fsdp2.yaml with full (one-file) checkpoints, on the same batches as
    `fsdp1_reference`: (run folder, its output)."""
    return _fit(
        run_cli,
        reference_workdir,
        tiny_dir,
        TINY_CPU_FSDP2,
        "fsdp2",
        "--trainer.strategy.init_args.state_dict_type",
        "full",
    )
