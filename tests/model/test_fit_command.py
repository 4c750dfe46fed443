"""`tts-lightning fit` in one process (FSDP1 NO_SHARD, as the 1-GPU configs), through the command:
``--ckpt_path last`` with no checkpoint yet says so in one line and starts at step 0; ``last.ckpt``
holds the last step even when the run ends between validations (Lightning saved it at the end only
when it had saved none: a fit of 3 steps validated every 2 ended with ``last.ckpt`` at step 2);
`validate --ckpt_path best` finds the run's best checkpoint (Lightning knows it only in the process
of the fit); Ctrl-C ends in one line that says how to resume, with status 130."""

from __future__ import annotations

import signal
import sys
import warnings
from pathlib import Path

import pytest
from lightning.pytorch import Callback

from tts_lightning.__main__ import main
from tts_lightning.model.checkpoint import load_training_checkpoint

TINY_CPU = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"


def _fit_args(tiny_dir, demo_data, run: Path) -> list[str]:
    _, manifest, cache = demo_data
    args = [
        "fit",
        "--config",
        str(TINY_CPU),
        "--data.pretrained",
        str(tiny_dir),
        "--data.train_manifest",
        str(manifest),
    ]
    args += ["--data.cache_dir", str(cache), "--data.max_frames_per_batch", "150", "--trainer.devices", "1"]
    args += ["--trainer.logger", "false", "--trainer.default_root_dir", str(run)]
    return [*args, "--trainer.max_steps", "3", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1"]


def test_last_checkpoint_is_the_last_step(tiny_dir, demo_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tts-lightning"])  # as the command sees it (not pytest's)
    run = tmp_path / "run"
    args = _fit_args(tiny_dir, demo_data, run)
    assert main([*args, "--ckpt_path", "last"]) == 0
    out, err = capsys.readouterr()
    assert f"ckpt_path last: no checkpoint in {run / 'checkpoints'} yet: starting at step 0" in out
    assert "there is no last checkpoint available" not in out + err  # Lightning's hint (save_last), not said
    assert load_training_checkpoint(run / "checkpoints" / "last.ckpt").global_step == 3
    kept = [p for p in (run / "checkpoints").iterdir() if p.name != "last.ckpt"]
    assert [p.name[:10] for p in kept] == ["step000002"]  # the validated step, as before
    # `validate --ckpt_path best` in another process: the best one the run's newest checkpoint records.
    validate = ["validate", *args[1 : args.index("--trainer.max_steps")], "--ckpt_path", "best"]
    assert main(validate) == 0
    assert f"ckpt_path best: {kept[0]}" in capsys.readouterr().out
    # Without --ckpt_path Lightning validates the model as built: the pretrained weights, said.
    assert main(validate[: validate.index("--ckpt_path")]) == 0
    assert "validate: no --ckpt_path: the weights of data.pretrained as they are" in capsys.readouterr().out
    # A resume from this run's checkpoint into another folder that holds files: Lightning's warning
    # stays (its first save may replace them); silenced only for a resume from the run's own folder.
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "notes.txt").write_text("mine\n")
    elsewhere = [*args[: args.index("--trainer.default_root_dir")], "--trainer.default_root_dir", str(other)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert (
            main([*elsewhere, "--trainer.max_steps", "4", "--ckpt_path", str(run / "checkpoints" / "last.ckpt")]) == 0
        )
    assert [w for w in caught if "exists and is not empty" in str(w.message)]


class CtrlCAt(Callback):
    """Ctrl-C at the start of training batch ``batch``: Python raises KeyboardInterrupt there."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.batch:
            raise KeyboardInterrupt


def test_ctrl_c_says_how_to_resume(tiny_dir, demo_data, tmp_path, monkeypatch, capsys):
    """Lightning stops gracefully on Ctrl-C and exits with status 1, saying nothing of the run;
    the command says what is kept and how to go on, with the status a shell gives Ctrl-C."""
    monkeypatch.setattr(sys, "argv", ["tts-lightning"])
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    handler = signal.getsignal(signal.SIGINT)
    try:
        args = _fit_args(tiny_dir, demo_data, tmp_path / "run")
        assert main([*args, "--trainer.callbacks+=test_fit_command.CtrlCAt", "--trainer.callbacks.batch", "2"]) == 130
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores further Ctrl-C while it shuts down
    said = "tts-lightning fit: stopped by Ctrl-C before the end; the checkpoints written so far are kept: resume with"
    assert f"{said} --ckpt_path last\n" in capsys.readouterr().err
    # As said: the resume ends the run, without Lightning's warning of a folder with files in it.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*args, "--ckpt_path", "last"]) == 0
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]
    assert load_training_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt").global_step == 3
    # With checkpointing off there is nothing to resume, and the line says so.
    try:
        args = [*_fit_args(tiny_dir, demo_data, tmp_path / "off"), "--trainer.enable_checkpointing", "false"]
        assert main([*args, "--trainer.callbacks+=test_fit_command.CtrlCAt", "--trainer.callbacks.batch", "0"]) == 130
    finally:
        signal.signal(signal.SIGINT, handler)
    said = "tts-lightning fit: stopped by Ctrl-C before the end; checkpointing is off: nothing was saved\n"
    assert said in capsys.readouterr().err


def test_ctrl_c_while_a_checkpoint_is_written_says_how_to_resume(tiny_dir, demo_data, tmp_path, monkeypatch, capsys):
    """Ctrl-C while torch's distributed checkpoint writes the first checkpoint: torch wraps the
    KeyboardInterrupt in its CheckpointException (a BaseException Lightning passes on): still the
    one line and status 130, not a traceback; no checkpoint of that step is visible."""
    from torch.distributed.checkpoint import FileSystemWriter

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "argv", ["tts-lightning"])
    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted)
    handler = signal.getsignal(signal.SIGINT)
    try:
        assert main(_fit_args(tiny_dir, demo_data, tmp_path / "run")) == 130
    finally:
        signal.signal(signal.SIGINT, handler)
    err = capsys.readouterr().err
    # No checkpoint is there to resume: the same command again, not --ckpt_path last.
    folder = tmp_path / "run" / "checkpoints"
    said = f"stopped by Ctrl-C before the end; no checkpoint was written yet (in {folder}): run the same command again"
    assert f"tts-lightning fit: {said}\n" in err and "Traceback" not in err
    assert not list(folder.glob("*.ckpt"))


def test_ctrl_c_before_training_starts_is_one_line(monkeypatch, capsys):
    """Ctrl-C while the command still starts (parsing the config, importing): the same line."""
    import tts_lightning.cli

    def starting(args=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(tts_lightning.cli, "cli_main", starting)
    try:
        status = main(["fit", "--config", str(TINY_CPU)])
    except KeyboardInterrupt:
        pytest.fail("the KeyboardInterrupt escaped the command")
    assert status == 130
    said = "stopped by Ctrl-C before the end; the checkpoints written so far are kept: resume with --ckpt_path last"
    assert capsys.readouterr().err == f"tts-lightning fit: {said}\n"  # nothing known yet of this fit


def test_an_error_after_ctrl_c_is_the_stop_and_without_it_a_bug(monkeypatch, capsys):
    """A process waiting in a collective when Ctrl-C comes sees its stopped peer's closed connection
    (a RuntimeError, no KeyboardInterrupt in it) first: the signal the command noted says it was
    Ctrl-C, and the error is named. The same error without Ctrl-C is a bug: its traceback."""
    import os
    import time

    import tts_lightning.__main__ as entry

    def collective(argv):
        interrupted = False
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the real signal, through the command's handler
            time.sleep(5)
        except KeyboardInterrupt:
            interrupted = True
        if interrupted:  # raised outside the except block: nothing links it to the interrupt
            raise RuntimeError("[gloo] Connection closed by peer")
        return 0

    monkeypatch.setitem(entry.TOOLS, "export", collective)
    # Python's own handler, which the command notes Ctrl-C beside (a shell may start pytest ignoring it).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(["export"]) == 130
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (
        "tts-lightning export: stopped by Ctrl-C (then RuntimeError: [gloo] Connection closed by peer); "
        "what it finished is kept"
    ) in capsys.readouterr().err

    def failing(argv):
        raise RuntimeError("[gloo] Connection closed by peer")

    monkeypatch.setitem(entry.TOOLS, "export", failing)
    with pytest.raises(RuntimeError, match="closed by peer"):
        main(["export"])


def test_the_checkpoint_callback_keeps_model_checkpoints_state_key():
    """Lightning matches a checkpoint's callback state by this key: with the class's own name, a
    run saved with `ModelCheckpoint` lost its best and top-k bookkeeping when resumed."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tts_lightning.callbacks import LastStepCheckpoint

    settings = {"monitor": "val/loss", "mode": "min", "save_last": True}
    assert LastStepCheckpoint(**settings).state_key == ModelCheckpoint(**settings).state_key
