"""`tts-lightning fit` with 2 real FSDP processes on CPU: training, logs, checkpoints, exact resume,
and validation of a checkpoint."""

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tts_lightning.data.demo import demo_dir
from tts_lightning.model.checkpoint import load_training_checkpoint

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu.yaml"


def run_cli(*args, cwd, check=True, timeout=900):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{Path(__file__).parent}"}
    proc = subprocess.run(
        [sys.executable, "-m", "tts_lightning", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("fit")
    shutil.copytree(demo_dir(), root / "demo")
    return root


def fit_args(workdir, tiny_dir, run, *extra):
    return [
        "fit",
        "--config",
        CONFIG,
        "--data.pretrained",
        tiny_dir,
        "--data.train_manifest",
        workdir / "demo" / "train.jsonl",
        "--data.cache_dir",
        workdir / "cache",
        "--data.max_frames_per_batch",
        150,
        "--trainer.default_root_dir",
        workdir / run,
        "--trainer.logger.init_args.save_dir",
        workdir / run,
        *extra,
    ]


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(Path(run_dir).rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {run_dir}"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def fitted(workdir, tiny_dir):
    proc = run_cli(
        *fit_args(workdir, tiny_dir, "run", "--trainer.max_steps", 12, "--trainer.val_check_interval", 4), cwd=workdir
    )
    return workdir / "run", proc


def test_fit_trains_with_two_fsdp_ranks(fitted):
    run_dir, proc = fitted
    held = re.findall(r"\[rank (\d)\] FSDP FULL_SHARD: ([\d,]+) of ([\d,]+) parameters", proc.stdout + proc.stderr)
    assert sorted(r for r, _, _ in held) == ["0", "1"]
    for _, local, total in held:
        share = int(local.replace(",", "")) / int(total.replace(",", ""))
        assert 0.45 < share < 0.55  # each rank holds about half of the flat parameters
    logged = scalars(run_dir)
    train = [v for _, v in logged["train/loss_step"]]
    assert len(train) >= 2 and train[-1] < train[0]
    assert "val/loss" in logged and "train/acc_codebook_15_step" in logged and "lr-AdamW" in logged
    checkpoints = list(run_dir.rglob("*.ckpt"))
    assert any(c.name == "last.ckpt" for c in checkpoints)
    assert (next(run_dir.rglob("config.yaml"))).is_file()  # the run describes itself


def final_weights(run_dir):
    # A resumed run logs into a new version folder: take the newest `last`.
    newest = max(Path(run_dir).rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)
    return load_training_checkpoint(newest)


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_resume_from_last_equals_uninterrupted(workdir, tiny_dir, state_dict_type):
    """A run killed mid-epoch at step 9 (last checkpoint at step 7) and resumed with
    `--ckpt_path last` ends with the weights of a run that was never interrupted."""
    steps = 14
    common = (
        "--trainer.max_steps",
        steps,
        "--trainer.val_check_interval",
        7,
        "--trainer.strategy.init_args.state_dict_type",
        state_dict_type,
    )
    straight_dir, resumed_dir = f"straight-{state_dict_type}", f"resumed-{state_dict_type}"
    run_cli(*fit_args(workdir, tiny_dir, straight_dir, *common), cwd=workdir)
    crash = '{"class_path": "crash_callbacks.CrashAt", "init_args": {"step": 9}}'
    crashed = run_cli(
        *fit_args(workdir, tiny_dir, resumed_dir, *common, f"--trainer.callbacks+={crash}"), cwd=workdir, check=False
    )
    assert crashed.returncode != 0 and "[CrashAt] rank 0 exits at global_step 9" in crashed.stdout
    assert load_training_checkpoint(workdir / resumed_dir / "checkpoints" / "last.ckpt").global_step == 7
    resumed_run = run_cli(*fit_args(workdir, tiny_dir, resumed_dir, *common, "--ckpt_path", "last"), cwd=workdir)
    assert "Restoring states from the checkpoint path" in resumed_run.stdout + resumed_run.stderr
    straight, resumed = final_weights(workdir / straight_dir), final_weights(workdir / resumed_dir)
    assert straight.path.is_dir() == (state_dict_type == "sharded")
    assert straight.global_step == resumed.global_step == steps
    assert straight.state_dict.keys() == resumed.state_dict.keys()
    assert any(k.startswith("model.speaker_encoder.") for k in resumed.state_dict)  # kept for resume
    for key, value in straight.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[key], value, atol=1e-6, rtol=1e-5, msg=key)
    # The weights must have moved, or the comparison proves nothing.
    assert not torch.equal(straight.state_dict["model.talker.codec_head.weight"], _pretrained_codec_head(tiny_dir))


def _pretrained_codec_head(tiny_dir):
    from tts_lightning.model.pretrained import check_pretrained, load_state_dict

    return load_state_dict(check_pretrained(tiny_dir), prefix="talker.codec_head.")["talker.codec_head.weight"]


def test_validate_reports_the_logged_val_loss(fitted, workdir, tiny_dir):
    run_dir, _ = fitted
    best = [c for c in run_dir.rglob("*.ckpt") if c.name != "last.ckpt"]
    assert best
    ckpt = best[0]
    logged = float(re.search(r"val_loss(\d+\.\d+)", ckpt.name).group(1))
    run_cli(
        "validate",
        "--config",
        CONFIG,
        "--data.pretrained",
        tiny_dir,
        "--data.train_manifest",
        workdir / "demo" / "train.jsonl",
        "--data.cache_dir",
        workdir / "cache",
        "--data.max_frames_per_batch",
        150,
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir",
        workdir / "validate",
        "--ckpt_path",
        ckpt,
        cwd=workdir,
    )
    rows = list(csv.DictReader(open(next((workdir / "validate").rglob("metrics.csv")))))
    reported = float(next(r["val/loss"] for r in rows if r.get("val/loss")))
    assert abs(reported - logged) < 1e-4, (reported, logged)


@pytest.mark.parametrize(
    "override, needle",
    [
        (["--model.no_such_option", "1"], "no_such_option"),
        (["--model.learning_rate", "fast"], "learning_rate"),
        (["--data.pretrained", "/no/such/dir"], "/no/such/dir"),
        (["--data.speakers", "[carol]"], "carol"),
    ],
)
def test_bad_config_fails_before_spawning(workdir, tiny_dir, override, needle):
    args = fit_args(workdir, tiny_dir, "bad")
    proc = run_cli(*args, *override, cwd=workdir, check=False, timeout=120)
    assert proc.returncode != 0
    assert needle in proc.stderr + proc.stdout
    assert "FSDP" not in proc.stdout  # nothing was wrapped: no process group, no spawn
