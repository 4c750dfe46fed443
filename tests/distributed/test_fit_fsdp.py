"""`tts-lightning fit` with 2 real FSDP processes on CPU: training, logs, golden losses, checkpoints,
exact resume, and validation of a checkpoint."""

import csv
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from tiny_runs import REFERENCE_EVERY, REFERENCE_STEPS, TINY_CPU, data_args, fit_args, newest_last, scalars

from tts_lightning.data.demo import demo_dir
from tts_lightning.errors import ConfigError
from tts_lightning.model.checkpoint import load_training_checkpoint
from tts_lightning.model.row_blocks import DEFAULT_TEXT_EMBEDDING_BLOCKS as TEXT_BLOCKS

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
# The seeded run every test here reads is `fsdp1_reference` (conftest.py of this folder): 8 steps,
# validated and checkpointed at steps 4 and 8; it is also the uninterrupted reference of both resume
# tests (state_dict_type changes only the files) and of the FSDP2 tests.
STEPS, EVERY, CRASH = REFERENCE_STEPS, REFERENCE_EVERY, 6

# Golden losses of that run (seed 0, 2 gloo ranks, fp32, the tiny model and the demo clips, 150 frames
# per batch), compared at rtol 1e-4 as torchtune's recipe tests do: a silent change in the model, the
# loss, the optimizer, the schedule or the data order fails here. To regenerate them after an
# intended change, run this module with TTS_PRINT_GOLDEN=1 and `-s`, check that the change explains
# the difference, and paste the printed values. Keys are the event file's steps (the optimizer step - 1).
# Regenerated when the schedule became transformers' (its warm-up starts at lr 0, so the first step
# does not move the weights, and the warm-up rates are lower than the hand-written schedule's).
# The text embedding's row blocks (8 FSDP units instead of 1) change only the order in which the
# clipping norm sums the units' squares: the val loss at step 4 moved by one float32 ulp
# (8.694840431 -> 8.694841385), within rtol; with gradient_clip_val null the weights after 6 steps are
# bit-identical to the one-unit embedding's.
# Regenerated when the validation share became per speaker: the demo's 4 validation clips were all
# alice's, now 2 of alice's and 2 of bob's (other clips train, other clips validate).
GOLDEN_TRAIN_LOSS = {4: 8.42149543762207}  # train/loss_step, step 5 (logged every 5 steps)
GOLDEN_VAL_LOSS = {3: 8.632116317749023, 7: 7.708812713623047}  # val/loss at steps 4 and 8


@pytest.fixture(scope="module")
def cli(run_cli):
    """The shared launcher (tests/conftest.py), with this folder on PYTHONPATH (crash_callbacks)."""

    def run(*args, cwd, check=True, timeout=900, slurm_job=None, env=None):
        return run_cli(*args, cwd=cwd, check=check, timeout=timeout, pythonpath=[HERE], slurm_job=slurm_job, env=env)

    return run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("fit")
    shutil.copytree(demo_dir(), root / "demo")
    return root


@pytest.fixture(scope="module")
def fitted(fsdp1_reference):
    return fsdp1_reference


def test_fit_trains_with_two_fsdp_ranks(fitted):
    run_dir, output = fitted
    held = re.findall(r"\[rank (\d)\] FSDP FULL_SHARD: ([\d,]+) of ([\d,]+) parameters", output)
    assert sorted(r for r, _, _ in held) == ["0", "1"]
    for _, local, total in held:
        share = int(local.replace(",", "")) / int(total.replace(",", ""))
        assert 0.45 < share < 0.55  # each rank holds about half of the flat parameters
    logged = scalars(run_dir)
    for rank in (0, 1):  # every step's loss, as each rank saw it (fsdp2_callbacks.RecordSteps)
        losses = [s["loss"] for s in json.loads((run_dir / f"steps-rank{rank}.json").read_text())]
        assert len(losses) == STEPS and losses[-1] < losses[0], losses
    assert "train/loss_step" in logged and "train/loss_epoch" in logged
    assert "It is recommended to use `self.log('train/" not in output  # reduced at each step already
    assert "val/loss" in logged and "train/acc_codebook_15_step" in logged and "lr-AdamW" in logged
    checkpoints = list(run_dir.rglob("*.ckpt"))
    assert any(c.name == "last.ckpt" for c in checkpoints)
    assert (next(run_dir.rglob("config.yaml"))).is_file()  # the run describes itself
    # each row block of the text embedding is an FSDP unit of its own (fsdp2_callbacks.RecordSteps)
    units = json.loads((run_dir / "units-rank0.json").read_text())
    text = "model.talker.model.text_embedding"
    assert [u for u in units if u.startswith(text)] == [f"{text}.blocks.{i}" for i in range(TEXT_BLOCKS)]


def test_seeded_run_matches_the_golden_losses(fitted):
    """The losses the run wrote to its TensorBoard event file, at fixed steps."""
    logged = scalars(fitted[0])
    train = {step: value for step, value in logged["train/loss_step"]}
    val = {step: value for step, value in logged["val/loss"]}
    if os.environ.get("TTS_PRINT_GOLDEN"):
        print(f"\nGOLDEN_TRAIN_LOSS = {train}\nGOLDEN_VAL_LOSS = {val}")
    assert sorted(train) == sorted(GOLDEN_TRAIN_LOSS) and sorted(val) == sorted(GOLDEN_VAL_LOSS), (train, val)
    for step, value in GOLDEN_TRAIN_LOSS.items():
        assert train[step] == pytest.approx(value, rel=1e-4), ("train/loss_step", step)
    for step, value in GOLDEN_VAL_LOSS.items():
        assert val[step] == pytest.approx(value, rel=1e-4), ("val/loss", step)


def test_load_from_checkpoint_reads_the_sharded_checkpoint(fitted, monkeypatch):
    """`Qwen3TTSModule.load_from_checkpoint` of a sharded (folder) checkpoint gives the module
    every tensor the checkpoint holds, exactly, read a group of tensors at a time (not a second
    copy of the whole state)."""
    from tts_lightning import Qwen3TTSModule
    from tts_lightning.model import module as module_file
    from tts_lightning.model.checkpoint import CheckpointReader
    from tts_lightning.model.row_blocks import official_state

    ckpt = final_weights(fitted[0])
    newest = newest_last(fitted[0])
    assert newest.is_dir()
    limit = 2**16
    monkeypatch.setattr(module_file, "LOAD_BYTES", limit)
    reads: list[int] = []  # bytes of each read
    original = CheckpointReader.read

    def read(self, keys, dtype=None):
        values = original(self, keys, dtype)
        reads.append(sum(v.numel() * v.element_size() for v in values.values()))
        return values

    monkeypatch.setattr(CheckpointReader, "read", read)
    # the module holds the text embedding as row blocks; the reader gives the official layout
    state = official_state(Qwen3TTSModule.load_from_checkpoint(newest).state_dict())
    largest = max(v.numel() * v.element_size() for v in ckpt.state_dict.values())
    assert len(reads) > 1 and max(reads) <= max(limit, largest), reads
    assert sum(reads) == sum(v.numel() * v.element_size() for v in ckpt.state_dict.values())  # each tensor once
    assert set(ckpt.state_dict) == set(state)
    for key, value in ckpt.state_dict.items():
        assert torch.equal(state[key], value), key


def final_weights(run_dir):
    return load_training_checkpoint(newest_last(run_dir))


# bf16 weights with stochastic rounding and 8-bit moments (configs/qwen3-tts-1.7b-1x24gb.yaml's
# optimizer): its rank-local quantized state and its seeded rounding must survive a kill too.
LEAN = "bf16_sr_adamw8bit"
LEAN_ARGS = ("--model.optimizer", LEAN, "--trainer.precision", "bf16-mixed")


@pytest.fixture(scope="module")
def lean_uninterrupted(workdir, tiny_dir, cli):
    """The resume test's uninterrupted run under `LEAN` (sharded checkpoints at steps 4 and 8)."""
    steps = ("--trainer.max_steps", STEPS, "--trainer.val_check_interval", EVERY)
    cli(*fit_args(TINY_CPU, workdir, tiny_dir, "uninterrupted-lean", *steps, *LEAN_ARGS), cwd=workdir)
    return workdir / "uninterrupted-lean"


@pytest.mark.parametrize(("state_dict_type", "optimizer"), [("sharded", "adamw"), ("full", "adamw"), ("sharded", LEAN)])
def test_resume_from_last_equals_uninterrupted(workdir, tiny_dir, cli, state_dict_type, optimizer, request):
    """A run killed mid-epoch at step 6 (last checkpoint at step 4) and resumed with
    `--ckpt_path last` ends with the weights of a run that was never interrupted (`fitted`, the
    same training with sharded checkpoints: the file format does not change the training). With
    bf16 weights, stochastic rounding and 8-bit moments: bit for bit, against its own uninterrupted run."""
    lean = optimizer == LEAN
    common = (
        "--trainer.max_steps",
        STEPS,
        "--trainer.val_check_interval",
        EVERY,
        "--trainer.strategy.init_args.state_dict_type",
        state_dict_type,
        *(LEAN_ARGS if lean else ()),
    )
    resumed_dir = f"resumed-{state_dict_type}-{optimizer}"
    # The full-checkpoint run is stopped by a SIGTERM to rank 1 alone, in its backward (a scheduler's
    # stop; tts_lightning/distributed/scheduler_signals.py), the others are killed.
    sigterm = state_dict_type == "full"
    stop = "SignalAt" if sigterm else "CrashAt"
    # The ranks stop at the start of the second batch after the one in which rank 1 got the signal
    # (its all-reduce is read one batch later): the signal comes a step earlier for the same stop.
    at = CRASH - 1 if sigterm else CRASH
    crash = f'{{"class_path": "crash_callbacks.{stop}", "init_args": {{"step": {at}}}}}'
    crashed = cli(
        *fit_args(TINY_CPU, workdir, tiny_dir, resumed_dir, *common, f"--trainer.callbacks+={crash}"),
        cwd=workdir,
        check=False,
        timeout=300,  # Lightning's own SIGTERM handler hung here until the process group's timeout
    )
    if sigterm:
        assert crashed.returncode == 143, crashed.stderr[-3000:]
        assert "stopped by SIGTERM before the end" in crashed.stderr and "--ckpt_path last" in crashed.stderr
        for rank in (0, 1):  # both at the same batch, before the next checkpoint's step
            assert f"[SignalAt] rank {rank} stops after global_step {CRASH + 1}: SIGTERMException" in crashed.stdout
    else:
        assert crashed.returncode != 0 and f"[CrashAt] rank 0 exits at global_step {CRASH}" in crashed.stdout
    checkpoints = workdir / resumed_dir / "checkpoints"
    saved = load_training_checkpoint(checkpoints / "last.ckpt")
    assert saved.global_step == EVERY
    assert saved.path.is_dir() == (state_dict_type == "sharded")
    half_written = state_dict_type == "sharded" and not lean
    if half_written:  # as if stopped while writing its last.ckpt, after the top-k checkpoint of that step
        (checkpoints / "last.ckpt").rename(checkpoints / ".last.ckpt.partial")
    resumed_run = cli(*fit_args(TINY_CPU, workdir, tiny_dir, resumed_dir, *common, "--ckpt_path", "last"), cwd=workdir)
    assert "Restoring states from the checkpoint path" in resumed_run.stdout + resumed_run.stderr
    if half_written:  # `last` is the newest complete checkpoint, not a start from step 0
        assert f"ckpt_path last: resuming from {checkpoints / 'step'}{EVERY:06d}-" in resumed_run.stdout
        assert not (checkpoints / ".last.ckpt.partial").exists()  # removed by the next save
    straight_dir = request.getfixturevalue("lean_uninterrupted" if lean else "fitted")
    straight_dir = straight_dir if lean else straight_dir[0]
    straight, resumed = final_weights(straight_dir), final_weights(workdir / resumed_dir)
    assert straight.path.is_dir() and resumed.path.is_dir() == (state_dict_type == "sharded")
    assert straight.global_step == resumed.global_step == STEPS
    assert straight.state_dict.keys() == resumed.state_dict.keys()
    assert any(k.startswith("model.speaker_encoder.") for k in resumed.state_dict)  # kept for resume
    for key, value in straight.state_dict.items():
        if lean:
            assert torch.equal(resumed.state_dict[key], value), key
        else:
            torch.testing.assert_close(resumed.state_dict[key], value, atol=1e-6, rtol=1e-5, msg=key)
    # The weights must have moved (in bf16 with the lean optimizer), or the comparison proves nothing.
    head = straight.state_dict["model.talker.codec_head.weight"]
    assert head.dtype == (torch.bfloat16 if lean else torch.float32)
    assert not torch.equal(head, _pretrained_codec_head(tiny_dir).to(head.dtype))


def test_a_sigterm_in_the_sanity_check_stops_every_rank_at_the_first_batch(workdir, tiny_dir, cli):
    """Lightning registers its SIGTERM handlers just before the sanity check: one rank's signal there
    stops both ranks before the first training batch (tts_lightning/distributed/scheduler_signals.py), as later."""
    sigterm = '{"class_path": "crash_callbacks.SignalAt", "init_args": {"step": -1}}'
    stopped = cli(
        *fit_args(
            TINY_CPU, workdir, tiny_dir, "sigterm-sanity", "--trainer.max_steps", "2", f"--trainer.callbacks+={sigterm}"
        ),
        cwd=workdir,
        check=False,
        timeout=300,
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "[SignalAt] SIGTERM to rank 1 at global_step -1" in stopped.stdout
    for rank in (0, 1):
        assert f"[SignalAt] rank {rank} stops after global_step 0: SIGTERMException" in stopped.stdout


def test_slurm_requeue_signal_saves_one_step_on_every_rank_and_resumes_exactly(workdir, tiny_dir, cli, fitted):
    """SLURM's requeue signal (SIGUSR1, `sbatch --signal=USR1@90`, with Lightning's auto-requeue) to
    rank 1 alone inside its backward: Lightning's handler saved a checkpoint from inside the signal
    handler, its collectives meeting the other rank's FSDP collective (a hang). Now both ranks save
    `hpc_ckpt_1.ckpt` at the end of the same later batch (tts_lightning/distributed/scheduler_signals.py)
    and rank 0 asks SLURM to requeue the job, once; the run goes on to its end with the uninterrupted
    run's weights. Started again as the requeued job is (no `--ckpt_path`; its later checkpoints
    gone, as if the time limit had stopped it right after the save), it resumes from that checkpoint,
    not from the higher number of a save the time limit cut short (Lightning's choice), and ends
    with them too."""
    # What Lightning asks of SLURM (`scontrol requeue <job>`), recorded: there is no SLURM here.
    bin_dir = workdir / "slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    calls = workdir / "scontrol-calls.txt"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "rank $SLURM_PROCID: $*" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    common = ("--trainer.max_steps", STEPS, "--trainer.val_check_interval", EVERY)
    usr1 = '{"class_path": "crash_callbacks.SignalAt", "init_args": {"step": 3, "signal": "SIGUSR1"}}'
    run = workdir / "requeued"
    signalled = cli(
        *fit_args(TINY_CPU, workdir, tiny_dir, "requeued", *common, f"--trainer.callbacks+={usr1}"),
        cwd=workdir,
        timeout=300,
        slurm_job="4242",
        env=env,
    )
    assert "[SignalAt] SIGUSR1 to rank 1 at global_step 3" in signalled.stdout
    hpc = run / "hpc_ckpt_1.ckpt"
    # In step 4's backward; agreed at step 5's start (the all-reduce queued at the start of the
    # validation batch after step 4); saved at its end.
    assert load_training_checkpoint(hpc).global_step == 5
    assert sorted(p.name for p in hpc.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert sorted(p.name for p in run.glob("*hpc_ckpt_*")) == ["hpc_ckpt_1.ckpt"]
    assert calls.read_text() == "rank 0: requeue 4242\n"
    straight = final_weights(fitted[0])
    for resumed in (False, True):
        if resumed:
            shutil.rmtree(run / "checkpoints")
            shutil.copytree(hpc, run / ".hpc_ckpt_2.ckpt.partial", ignore=shutil.ignore_patterns("meta.pt"))
            requeued = cli(
                *fit_args(TINY_CPU, workdir, tiny_dir, "requeued", *common), cwd=workdir, slurm_job="4242", env=env
            )
            assert f"resuming this SLURM job from {hpc}, the run's newest complete checkpoint" in requeued.stdout
            assert not (run / ".hpc_ckpt_2.ckpt.partial").exists()  # removed when the fit started
            assert calls.read_text() == "rank 0: requeue 4242\n"  # no signal this time
        weights = final_weights(run)
        assert weights.global_step == STEPS
        for key, value in straight.state_dict.items():
            torch.testing.assert_close(weights.state_dict[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_last_is_the_newest_complete_checkpoint(fitted, tmp_path):
    """`--ckpt_path last` (tts_lightning.resume_path) on the run's real checkpoints: last.ckpt,
    whatever the order the files were copied in; a checkpoint of a later step written after it (a
    save stopped before its last.ckpt, a SLURM requeue checkpoint); not a later step written before
    it (a run resumed from an earlier step leaves the abandoned steps' files); without last.ckpt,
    its set-aside copy, else the highest step; never a half-written or unreadable one."""
    import os

    from tts_lightning.resume_path import newest_checkpoint

    folder = shutil.copytree(fitted[0] / "checkpoints", tmp_path / "checkpoints")
    topk = {int(p.name[4:10]): p for p in folder.glob("step*.ckpt")}
    assert sorted(topk) == [EVERY, STEPS], topk
    (folder / "broken.ckpt").write_text("not a checkpoint\n")
    shutil.copytree(folder / "last.ckpt", folder / ".step000099-val_loss1.0000.ckpt.partial")

    def written(path, order):
        os.utime(path / "meta.pt", ns=(order, order))

    for order, path in enumerate([folder / "last.ckpt", topk[STEPS], topk[EVERY]]):
        written(path, order)  # copied in this order: last.ckpt the oldest file
    assert newest_checkpoint(folder) == folder / "last.ckpt"
    # A run resumed from step EVERY into this folder: its last.ckpt (step EVERY), written after the
    # abandoned run's step STEPS, is the one; a later step saved after it (a save stopped before
    # its last.ckpt) would be.
    shutil.rmtree(folder / "last.ckpt")
    shutil.copytree(topk[EVERY], folder / "last.ckpt")
    written(topk[STEPS], 10)
    written(folder / "last.ckpt", 20)
    assert newest_checkpoint(folder) == folder / "last.ckpt"  # not the abandoned step STEPS
    written(topk[STEPS], 30)
    assert newest_checkpoint(folder) == topk[STEPS]
    (folder / "last.ckpt").rename(folder / ".last.ckpt.old")  # stopped between the renames of a save
    written(folder / ".last.ckpt.old", 40)
    assert newest_checkpoint(folder) == folder / ".last.ckpt.old"
    shutil.rmtree(folder / ".last.ckpt.old")  # stopped while writing its first last.ckpt
    written(topk[EVERY], 50)
    assert newest_checkpoint(folder) == topk[STEPS]  # the highest step, though written first
    # SLURM's auto-requeue checkpoints, in the run's folder, count too.
    requeued = shutil.copytree(fitted[0] / "checkpoints" / "last.ckpt", tmp_path / "hpc_ckpt_1.ckpt")
    written(requeued, 60)
    assert newest_checkpoint(folder, requeued_in=tmp_path) == requeued  # the same step, written later
    assert newest_checkpoint(None, requeued_in=tmp_path) == requeued
    assert newest_checkpoint(tmp_path / "nope") is None


def _pretrained_codec_head(tiny_dir):
    from tts_lightning.model.pretrained import check_pretrained, load_state_dict

    return load_state_dict(check_pretrained(tiny_dir), prefix="talker.codec_head.")["talker.codec_head.weight"]


def test_validate_reports_the_logged_val_loss(fitted, workdir, tiny_dir, cli):
    """`validate --ckpt_path best` on 2 ranks: each rank resolves the run's best checkpoint (Lightning
    refused "best" where no fit ran in the process), and reports the val/loss logged when it was saved."""
    run_dir, _ = fitted
    kept = {c: float(re.search(r"val_loss(\d+\.\d+)", c.name).group(1)) for c in run_dir.rglob("step*.ckpt")}
    assert len(kept) > 1, kept
    ckpt = min(kept, key=kept.__getitem__)  # the config's checkpoint monitors val/loss, lowest best
    logged = kept[ckpt]
    done = cli(
        "validate",
        "--config",
        TINY_CPU,
        *data_args(workdir, tiny_dir),
        "--trainer.default_root_dir",
        run_dir,
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir",
        workdir / "validate",
        "--ckpt_path",
        "best",
        cwd=workdir,
    )
    assert f"ckpt_path best: {ckpt}" in done.stdout
    rows = list(csv.DictReader(open(next((workdir / "validate").rglob("metrics.csv")))))
    reported = float(next(r["val/loss"] for r in rows if r.get("val/loss")))
    assert abs(reported - logged) < 1e-4, (reported, logged)


def test_a_sigterm_in_validate_stops_every_rank_at_the_same_batch(fitted, workdir, tiny_dir, cli):
    """`validate` on 2 ranks, a SIGTERM to rank 1 alone after its first batch: Lightning's notifier
    broadcast from inside the handler while rank 0 was in the next batch's FSDP collectives, and its
    loop stopped rank 1 alone; now both stop at the start of the third batch (the all-reduce queued at
    the second's), exit 143 and say so. A larger validation share (its own cache) and small batches
    give each rank more than three batches."""
    sigterm = '{"class_path": "crash_callbacks.SigtermInValidation"}'
    args = [*data_args(workdir, tiny_dir, cache=workdir / "cache-val-share"), "--data.val_fraction", "0.4"]
    args[args.index("--data.max_frames_per_batch") + 1] = 60
    stopped = cli(
        "validate",
        "--config",
        TINY_CPU,
        *args,
        "--trainer.logger",
        "false",
        f"--trainer.callbacks+={sigterm}",
        "--ckpt_path",
        newest_last(fitted[0]),
        cwd=workdir,
        check=False,
        timeout=300,
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    said = "tts-lightning validate: stopped by SIGTERM before the end; no results were written"
    assert stopped.stderr.count(said) == 1  # by rank 0 only
    assert "[SigtermInValidation] SIGTERM to rank 1 after validation batch 0" in stopped.stdout
    for rank in (0, 1):
        assert f"[SigtermInValidation] rank {rank} stops at validation batch 2: SIGTERMException" in stopped.stdout


def launch_trapped_main(monkeypatch, workdir):
    """The `tts-lightning` entry point, to run in this process with Lightning's launcher (which would
    start rank 1) and torch.distributed's process group booby-trapped: reaching either raises."""
    import sys

    import torch.distributed
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from tts_lightning.__main__ import main

    def trap(*args, **kwargs):
        raise AssertionError("reached the process launch")

    monkeypatch.setattr(_SubprocessScriptLauncher, "launch", trap)
    monkeypatch.setattr(torch.distributed, "init_process_group", trap)
    monkeypatch.setattr(sys, "argv", ["tts-lightning"])
    monkeypatch.chdir(workdir)
    return main


def test_the_launch_trap_catches_a_good_config(workdir, tiny_dir, monkeypatch):
    """Without this, the test below could pass with a trap that never fires."""
    main = launch_trapped_main(monkeypatch, workdir)
    with pytest.raises(AssertionError, match="reached the process launch"):
        main([*map(str, fit_args(TINY_CPU, workdir, tiny_dir, "good", "--trainer.max_steps", 1))])


@pytest.mark.parametrize(
    "override, message",
    [
        (["--model.no_such_option", "1"], "unrecognized arguments: --model.no_such_option 1"),
        (
            ["--model.learning_rate", "fast"],
            "Parser key \"model.learning_rate\": Expected a <class 'float'>. Got value: fast",
        ),
        (
            ["--data.pretrained", "/no/such/dir"],
            "pretrained directory '/no/such/dir' does not exist: give a Qwen3-TTS 12 Hz directory, a hub id "
            "(Qwen/Qwen3-TTS-12Hz-1.7B-Base) or tiny",
        ),
        (
            ["--data.speakers", "[carol]"],
            "speaker(s) 'carol' are not named by {workdir}/demo/train.jsonl (its speakers: alice, bob)",
        ),
        (
            ["--trainer.precision", "bf16-true"],
            "trainer.precision bf16-true stores the weights in 16 bits, where round-to-nearest drops updates "
            "under 1/256 of a weight (all of them at fine-tuning rates): use bf16-mixed (fp32 weights), or "
            "model.optimizer bf16_sr / bf16_sr_adamw8bit (bf16 weights, stochastic rounding)",
        ),
        (
            ["--model.optimizer", "bf16_sr"],
            "model.optimizer bf16_sr keeps bf16 weights and computes in bf16: set trainer.precision bf16-mixed "
            "(fp32 reductions), not '32-true'",
        ),
    ],
)
def test_bad_config_fails_before_spawning(workdir, tiny_dir, override, message, monkeypatch, capsys):
    """The launching process finds the error before Lightning starts rank 1 (the trap): one
    message, exit status 2, no traceback."""
    main = launch_trapped_main(monkeypatch, workdir)
    try:
        code = main([*map(str, fit_args(TINY_CPU, workdir, tiny_dir, "bad")), *override])
    except SystemExit as exc:  # the parser's errors exit from inside LightningCLI
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("tts-lightning fit: error: ")]
    assert errors == [f"tts-lightning fit: error: {message.format(workdir=workdir)}"], err


def test_a_sharded_checkpoint_of_the_other_strategy_is_one_line(fitted, cli, workdir, tiny_dir, capsys, monkeypatch):
    """FSDP1's sharded checkpoint given to an FSDP2 run (their module states are keyed apart): one
    line naming both strategies, status 2, no traceback; said by the command before any other
    process starts, and by every rank where the ranks are started apart (SLURM, torchrun: the
    command's own check is left to the strategies there)."""
    import sys

    from tiny_runs import TINY_CPU_FSDP2

    from tts_lightning.__main__ import main
    from tts_lightning.model.checkpoint import FSDP2_PREFIX
    from tts_lightning.resume_path import check_checkpoint

    ckpt = newest_last(fitted[0])
    said = (
        f"tts-lightning fit: error: ckpt_path {ckpt} is a sharded checkpoint of FSDP1 (Qwen3TTSFSDPStrategy), "
        "this run uses FSDP2 (Qwen3TTSFSDP2Strategy): use the strategy it was written with (the config "
        "it was trained with); `tts-lightning export` reads either\n"
    )
    args = [str(a) for a in fit_args(TINY_CPU_FSDP2, workdir, tiny_dir, "other-strategy", "--ckpt_path", ckpt)]
    monkeypatch.setattr(sys, "argv", ["tts-lightning"])
    assert main(args) == 2  # in this process: refused before Lightning starts rank 1
    err = capsys.readouterr().err
    assert err.count("tts-lightning fit: error:") == 1 and said in err and "Traceback" not in err
    proc = cli(*args, cwd=workdir, check=False, timeout=300, slurm_job="4243")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).count(said) == 2  # each rank, from the strategy
    assert check_checkpoint(ckpt)["speakers"]  # the same checkpoint, read where no strategy is named
    with pytest.raises(ConfigError, match="is a sharded checkpoint of FSDP1"):
        check_checkpoint(ckpt, sharded_prefix=FSDP2_PREFIX)
