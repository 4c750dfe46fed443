"""The console shows what a user acts on: `make demo`'s commands (with a shorter fit) print the data
report, the metrics, the progress in steps and where the files went, within a line budget, without
the known third-party noise; `--trainer.enable_checkpointing false` writes no checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tts_lightning import console

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
LINE_BUDGET = 120
NOISE = (
    "flash-attn",
    "SoX",
    "sox:",
    "LeafSpec",
    "pad_token_id",
    "_get_pg_default_device",
    "ShardedTensor",
    "v_num",
    "litlogger",
    "/-2",
    "LightningCLI's args parameter",
    "smaller than the logging interval",
)


@pytest.fixture(scope="module")
def workspace(demo_workspace) -> Path:
    """The scratch folder laid out like the repository where `make demo`'s commands ran (the
    session's `demo_workspace`, tests/conftest.py, shared with the README tests)."""
    return demo_workspace[0]


@pytest.fixture(scope="module")
def demo_outputs(demo_workspace) -> dict[str, str]:
    """What `make demo`'s commands print (a 4-step fit), by command; tiny-model builds the model the
    others use and is not part of the budget."""
    outputs = demo_workspace[1]
    assert list(outputs) == ["tiny-model", "fit", "export", "synthesize"]
    return {name: text for name, text in outputs.items() if name != "tiny-model"}


def test_demo_commands_print_what_matters_within_the_budget(workspace, demo_outputs, capsys):
    outputs = demo_outputs
    text = "\n".join(outputs.values())
    lines = text.splitlines()
    assert len(lines) <= LINE_BUDGET, f"{len(lines)} lines:\n{text}"
    for noise in NOISE:
        assert noise not in text, f"{noise!r} is back on the console:\n{text}"
    with capsys.disabled():
        print(f"\n[console] make demo's commands (4-step fit) printed {len(lines)} lines")

    fit = outputs["fit"]
    assert fit.count("data report (") == 1 and "accepted 24 clips" in fit
    assert re.search(r"step 4/4\b", fit)  # steps, not "Epoch 1/-2"
    assert "val/loss" in fit and "train/loss" in fit  # the metrics
    assert f"checkpoints: {workspace / 'runs' / 'tiny-cpu' / 'checkpoints'} (last: " in fit
    assert "logs: runs/tiny-cpu/lightning_logs/version_" in fit
    assert str(Path("runs/tiny-cpu/voice")) in outputs["export"]
    assert "runs/tiny-cpu/hello_alice.wav" in outputs["synthesize"]


def test_fit_without_checkpointing_or_logger_writes_neither(workspace, run_cli):
    """``--trainer.logger false`` drops the default LearningRateMonitor (Lightning refuses it
    without a logger) and ``--trainer.enable_checkpointing false`` the `checkpoint:` callback."""
    logs = workspace / "runs" / "tiny-cpu" / "lightning_logs"  # the default logger (the demo's run writes there)
    before = sorted(logs.rglob("*"))
    proc = run_cli(
        "fit",
        "--config",
        "configs/tiny-cpu.yaml",
        "--data.pretrained",
        "runs/tiny-model",
        "--trainer.devices",  # one process: what is printed does not depend on the rank count
        "1",
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.default_root_dir",
        "runs/no-ckpt",
        "--trainer.logger",
        "false",
        cwd=workspace,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert "checkpoints: none (checkpointing is off)" in out and "step 2/2" in out and "logs:" not in out
    assert not list((workspace / "runs" / "no-ckpt").rglob("*.ckpt"))
    assert not (workspace / "runs" / "no-ckpt" / "checkpoints").exists()
    assert sorted(logs.rglob("*")) == before


def test_quiet_output_drops_only_the_known_banners(capfd):
    with console.quiet_output():
        print(console.FLASH_ATTN_BANNER, end="")
        os.system("echo from-a-child-process; echo " + "'" + console.SOX_SHELL_LINE.strip() + "' >&2")
        print("a message of ours")
        print("SoX could not be found! (not the exact banner)", file=sys.stderr)
    out, err = capfd.readouterr()
    assert out == "from-a-child-process\na message of ours\n"
    assert err == "SoX could not be found! (not the exact banner)\n"


def test_quiet_output_keeps_everything_when_the_body_fails(capfd):
    with pytest.raises(RuntimeError):
        with console.quiet_output():
            print(console.FLASH_ATTN_BANNER, end="")
            raise RuntimeError("import failed")
    assert "flash-attn" in capfd.readouterr().out


def _python(*codes: str) -> list[subprocess.CompletedProcess]:
    """Each code in a fresh interpreter of its own, all at once (each spends seconds importing)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for code in codes
    ]
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()  # only one that still runs: a timeout
            p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def test_the_installed_filters_silence_qwen_tts_import_alone():
    code = "import qwen_tts, torchao; print('imported', qwen_tts.Qwen3TTSModel.__name__)"
    proc, unfiltered = _python("from tts_lightning import console; console.install(); " + code, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "imported Qwen3TTSModel\n" and proc.stderr == ""
    # Without the filters, torchao's import logs what LOG_FILTERS drops (the filter is still needed).
    assert "<enum 'KernelPreference'> is an Enum subclass" in unfiltered.stderr


def test_export_to_a_full_disk_is_one_clear_error(workspace, demo_outputs, tmp_path, run_cli):
    """The exported folder does not fit on a 1 MiB file system: one line naming the folder and the
    free space, no traceback, nothing left on that file system."""
    fs = tmp_path / "small"
    fs.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(fs)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {exc}")
    try:
        proc = run_cli(
            *("export", "--dtype", "fp32", "--ckpt", "runs/tiny-cpu/checkpoints/last.ckpt", "--out", fs / "voice"),
            cwd=workspace,
            check=False,
            timeout=300,
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stderr.startswith(
            f"tts-lightning export: error: cannot write {fs / 'voice'}: no space left on device ("
        )
        assert "free there" in proc.stderr and "Traceback" not in proc.stderr
        assert list(fs.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False, capture_output=True)
