"""The model commands (`model/tiny_cli.py`, `model/export_cli.py`, `model/synthesis_cli.py`) through
the `tts-lightning` router, in process: names, messages and exit codes (their real runs are in
tests/test_console.py, tests/model/test_tiny.py and tests/distributed/test_export.py; every
command's user errors in tests/test_user_errors.py)."""

import pytest

from tts_lightning.__main__ import TOOLS, main


def test_router_names_every_model_command(capsys):
    assert {"tiny-model", "export", "synthesize"} <= set(TOOLS)
    assert main(["nope"]) == 2
    assert "tiny-model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, description",
    [
        ("tiny-model", "Build a tiny random-weight Qwen3-TTS 12 Hz pretrained"),
        ("export", "Export a training checkpoint"),
        ("synthesize", "Speak texts with a custom_voice model"),
    ],
)
def test_help_keeps_the_program_name(command, description, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith(f"usage: tts-lightning {command}") and description in out


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert main(["export", "--ckpt", str(tmp_path / "nope.ckpt"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tts-lightning export: error: ") and "nope.ckpt" in err and "does not exist" in err
    assert not (tmp_path / "out").exists()


def test_synthesize_without_text_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["synthesize", "--model", str(tmp_path), "--out", str(tmp_path / "x.wav")])
    assert exit_.value.code == 2 and "give --text or --text-file" in capsys.readouterr().err
