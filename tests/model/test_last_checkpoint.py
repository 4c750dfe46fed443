"""`tts-lightning fit` in one process (FSDP1 NO_SHARD, as the 1-GPU configs): ``--ckpt_path last``
with no checkpoint yet says so in one line and starts at step 0; ``last.ckpt`` holds the last step
even when the run ends between validations (Lightning saved it at the end only when it had saved
none: a fit of 3 steps validated every 2 ended with ``last.ckpt`` at step 2); `validate --ckpt_path
best` finds the run's best checkpoint (Lightning knows it only in the process of the fit)."""

from __future__ import annotations

import sys
from pathlib import Path

from tts_lightning.__main__ import main
from tts_lightning.model.checkpoint import load_training_checkpoint

TINY_CPU = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml"


def test_last_checkpoint_is_the_last_step(tiny_dir, demo_data, tmp_path, monkeypatch, capsys):
    _, manifest, cache = demo_data
    monkeypatch.setattr(sys, "argv", ["tts-lightning"])  # as the command sees it (not pytest's)
    run = tmp_path / "run"
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
    args += ["--trainer.max_steps", "3", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1"]
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
