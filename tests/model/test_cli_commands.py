"""The model commands (`model/tiny_cli.py`, `model/export_cli.py`, `model/synthesis_cli.py`) through
the `tts-lightning` router, in process: names, messages and exit codes (their real runs are in
tests/test_console.py, tests/model/test_tiny.py and tests/distributed/test_export.py; every
command's user errors in tests/test_user_errors.py), and synthesize's device."""

import numpy as np
import pytest
import torch

from tts_lightning.__main__ import TOOLS, main
from tts_lightning.data.demo import demo_dir


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


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "give --text or --text-file"),
        (["--text", " "], "--text is empty: give the words to speak"),
        (["--text", "Hi.", "--out", "{tmp}/x.mp3"], "--out {tmp}/x.mp3: synthesize writes WAV; give a .wav file"),
        (["--text", "Hi.", "--text", "Bye."], "--out {tmp}/x.wav is one file for 2 texts; give a folder"),
    ],
)  # fmt: skip
def test_synthesize_usage_errors_before_the_model_loads(tmp_path, capsys, args, said):
    filled = [a.format(tmp=tmp_path) for a in args]
    out = [] if "--out" in filled else ["--out", str(tmp_path / "x.wav")]
    with pytest.raises(SystemExit) as exit_:
        main(["synthesize", "--model", str(tmp_path / "nope"), *out, *filled])
    assert exit_.value.code == 2 and said.format(tmp=tmp_path) in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_an_unknown_command_is_named(capsys):
    assert main(["fitt"]) == 2
    assert capsys.readouterr().err.endswith("tts-lightning: error: unknown command 'fitt'\n")
    assert main([]) == 2
    assert capsys.readouterr().err.endswith("tts-lightning: error: give a command (tts-lightning --help lists them)\n")


def test_help_says_what_each_command_does(capsys):
    from tts_lightning.__main__ import LIGHTNING_COMMANDS, TOOLS

    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    described = [line.split()[0] for line in lines if line.startswith("  ")]
    assert described == [*LIGHTNING_COMMANDS, *TOOLS]  # each command, once, with its line


@pytest.mark.parametrize(
    ("cuda", "requested", "device"),
    [(True, None, "cuda"), (False, None, "cpu"), (True, "cpu", "cpu"), (True, "cuda:1", "cuda:1")],
)
def test_synthesize_device_defaults_to_cuda_when_there_is_one(monkeypatch, cuda, requested, device):
    from tts_lightning.model.synthesis import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device(requested) == device


def test_synthesize_device_option_reaches_the_model(monkeypatch, tmp_path):
    """--device (absent: None, decided by `resolve_device`) is what `synthesize` receives."""
    from tts_lightning.model import synthesis

    seen = []

    def fake(model, texts, **kwargs):
        seen.append(kwargs["device"])
        return [np.zeros(240, dtype=np.float32)], 24_000

    monkeypatch.setattr(synthesis, "synthesize", fake)
    common = ["synthesize", "--model", str(tmp_path), "--text", "Hi."]
    assert main([*common, "--device", "cuda:1", "--out", str(tmp_path / "a.wav")]) == 0
    assert main([*common, "--out", str(tmp_path / "b.wav")]) == 0
    assert seen == ["cuda:1", None]


def test_synthesize_speaks_on_the_cpu(tiny_custom_voice_dir, tmp_path, monkeypatch, capsys):
    """No GPU here: the default device is the CPU, for the model and its speech tokenizer."""
    import soundfile as sf
    from qwen_tts import Qwen3TTSModel

    loaded = []
    from_pretrained = Qwen3TTSModel.from_pretrained.__func__

    def recording(cls, path, **kwargs):
        model = from_pretrained(cls, path, **kwargs)
        loaded.append((kwargs, model))
        return model

    monkeypatch.setattr(Qwen3TTSModel, "from_pretrained", classmethod(recording))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "hello.wav"
    args = ["--model", str(tiny_custom_voice_dir), "--speaker", "ryan", "--text", "Hello.", "--max-new-tokens", "8"]
    assert main(["synthesize", *args, "--out", str(out)]) == 0
    [(kwargs, model)] = loaded
    assert kwargs["device_map"] == "cpu"
    assert {p.device.type for p in model.model.parameters()} == {"cpu"}
    tokenizer = model.model.speech_tokenizer
    assert tokenizer.device.type == "cpu" and {p.device.type for p in tokenizer.model.parameters()} == {"cpu"}
    info = sf.info(str(out))
    assert info.samplerate == 24_000 and info.frames > 0
    assert capsys.readouterr().out.startswith(f"{out}  ")
    assert [p.name for p in tmp_path.iterdir()] == ["hello.wav"]  # no temporary file left


@pytest.mark.parametrize("kind", ["custom_voice", "base"])
def test_synthesize_speaks_a_few_texts_at_a_time_in_the_chosen_dtype(
    kind, tiny_custom_voice_dir, tiny_dir, tmp_path, monkeypatch
):
    """qwen_tts pads a batch to its longest row and decodes it at once: 5 texts at --batch-size 2 are
    3 calls of 2, 2 and 1, with one voice-clone prompt for all of them; --dtype bf16 loads the model
    (and its speech tokenizer) in bf16 (the GPU default: `default_dtype`)."""
    import soundfile as sf
    from qwen_tts import Qwen3TTSModel

    from tts_lightning.model.synthesis import default_dtype

    assert (default_dtype("cuda"), default_dtype("cuda:1"), default_dtype("cpu")) == ("bf16", "bf16", "fp32")
    speak = "generate_custom_voice" if kind == "custom_voice" else "generate_voice_clone"
    calls, prompts = [], []
    original, make_prompt = getattr(Qwen3TTSModel, speak), Qwen3TTSModel.create_voice_clone_prompt

    def recording(self, **kwargs):
        calls.append((len(kwargs["text"]), self.model.dtype, self.model.speech_tokenizer.model.dtype))
        return original(self, **kwargs)

    def recording_prompt(self, **kwargs):
        prompts.append(kwargs)
        return make_prompt(self, **kwargs)

    monkeypatch.setattr(Qwen3TTSModel, speak, recording)
    monkeypatch.setattr(Qwen3TTSModel, "create_voice_clone_prompt", recording_prompt)
    if kind == "custom_voice":
        args = ["--model", str(tiny_custom_voice_dir), "--speaker", "ryan"]
    else:
        clip = demo_dir() / "clips" / "alice" / "alice_001.flac"
        args = ["--model", str(tiny_dir), "--ref-audio", str(clip)]
    args += [arg for i in range(5) for arg in ("--text", f"Text {i}.")]
    out = tmp_path / "said"
    common = ["synthesize", *args, "--max-new-tokens", "4", "--device", "cpu", "--out", str(out)]
    assert main([*common, "--batch-size", "2", "--dtype", "bf16"]) == 0
    assert calls == [(n, torch.bfloat16, torch.bfloat16) for n in (2, 2, 1)]
    assert len(prompts) == (0 if kind == "custom_voice" else 1)
    assert sorted(p.name for p in out.iterdir()) == [f"{i:03d}.wav" for i in range(5)]
    assert all(sf.info(str(p)).frames > 0 for p in out.iterdir())
    calls.clear()
    assert main(common) == 0  # the defaults: 4 texts at a time, fp32 on the CPU
    assert [(n, dtype) for n, dtype, _ in calls] == [(4, torch.float32), (1, torch.float32)]
