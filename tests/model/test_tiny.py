"""The tiny pretrained directory loads and runs through the official qwen_tts code paths."""

import hashlib
import json
import math

import numpy as np
import pytest
import torch

from tts_lightning import build_tiny_pretrained
from tts_lightning.model.tiny import NUM_CODE_GROUPS, SAMPLES_PER_FRAME


def _digests(path):
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_layout_and_size(tiny_dir):
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "speech_tokenizer/config.json",
        "speech_tokenizer/model.safetensors",
        "speech_tokenizer/preprocessor_config.json",
    ):
        assert (tiny_dir / name).is_file(), name
    total = sum(p.stat().st_size for p in tiny_dir.rglob("*") if p.is_file())
    assert total < 20 * 1024 * 1024
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["tts_model_type"] == "base"
    assert config["talker_config"]["num_code_groups"] == NUM_CODE_GROUPS
    assert config["talker_config"]["num_hidden_layers"] >= 2
    assert config["talker_config"]["code_predictor_config"]["num_hidden_layers"] >= 2


def test_text_tokenizer_specials_at_config_ids(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    config = json.loads((tiny_dir / "config.json").read_text())
    ids = tok("<|im_start|>assistant\nHi there.<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    # Generation slices by position: role = ids[:3], content = ids[3:-5].
    assert ids[0] == config["im_start_token_id"]
    assert tok.decode(ids[1:3]) == "assistant\n" and len(ids[:3]) == 3
    assert tok.decode(ids[3:-5]) == "Hi there."
    assert ids[-5] == config["im_end_token_id"] and ids[-3] == config["im_start_token_id"]
    text_vocab = config["talker_config"]["text_vocab_size"]
    for key in ("tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id"):
        assert config[key] < text_vocab
    assert max(ids) < text_vocab


def test_speech_tokenizer_round_trip(tiny_dir):
    from qwen_tts import Qwen3TTSTokenizer

    tok = Qwen3TTSTokenizer.from_pretrained(str(tiny_dir / "speech_tokenizer"))
    sr = 24_000
    n = int(2.5 * sr)
    t = np.arange(n) / sr
    wav = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    codes = tok.encode(wav, sr=sr).audio_codes[0]
    frames = math.ceil(n / SAMPLES_PER_FRAME)
    assert codes.shape == (frames, NUM_CODE_GROUPS) and codes.dtype == torch.long
    assert codes.unique().numel() > 8  # codebooks are filled, not all-zero
    audio, out_sr = tok.decode(tok.encode(wav, sr=sr))
    assert out_sr == sr
    assert audio[0].shape == (frames * SAMPLES_PER_FRAME,)
    assert np.abs(audio[0]).max() > 1e-3  # not silent


def test_generate_voice_clone_end_to_end(tiny_dir):
    from qwen_tts import Qwen3TTSModel

    model = Qwen3TTSModel.from_pretrained(str(tiny_dir))
    sr = 24_000
    ref = (0.2 * np.random.default_rng(0).standard_normal(sr * 2)).astype(np.float32)
    torch.manual_seed(0)
    wavs, out_sr = model.generate_voice_clone(
        text="Hello world.", language="English", ref_audio=(ref, sr), x_vector_only_mode=True
    )
    assert out_sr == sr and len(wavs) == 1
    assert wavs[0].ndim == 1 and wavs[0].size > 0 and wavs[0].size % SAMPLES_PER_FRAME == 0


@pytest.mark.slow  # multi-process or a model build: about a minute
def test_custom_voice_generates(tiny_custom_voice_dir):
    from qwen_tts import Qwen3TTSModel

    model = Qwen3TTSModel.from_pretrained(str(tiny_custom_voice_dir))
    assert set(model.get_supported_speakers()) == {"vivian", "ryan", "serena"}
    torch.manual_seed(0)
    wavs, sr = model.generate_custom_voice(text="Good morning.", speaker="Vivian")
    assert sr == 24_000 and wavs[0].size > 0


@pytest.mark.slow  # multi-process or a model build: about a minute
def test_same_seed_same_bytes_other_seed_other_weights(tiny_dir, tmp_path, run_script):
    # A separate process, so nothing cached in this one can make the bytes agree.
    code = (
        "import sys; from tts_lightning import build_tiny_pretrained; "
        "build_tiny_pretrained(sys.argv[1], seed=int(sys.argv[2]))"
    )
    run_script("-c", code, tmp_path / "again", 0, timeout=300)
    assert _digests(tmp_path / "again") == _digests(tiny_dir)
    other = build_tiny_pretrained(tmp_path / "other", seed=1)
    a, b = _digests(tiny_dir), _digests(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["vocab.json"] == b["vocab.json"]  # the text tokenizer does not depend on the seed


def test_second_call_reuses_directory(tiny_dir):
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_pretrained(tiny_dir, seed=0) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(FileExistsError, match="other arguments"):
        build_tiny_pretrained(tiny_dir, seed=5)


@pytest.mark.slow  # multi-process or a model build: about a minute
def test_cli_builds(tmp_path, run_cli):
    out = run_cli("tiny-model", tmp_path / "m", "--seed", 3, cwd=tmp_path, timeout=300).stdout
    assert out.strip().endswith(str(tmp_path / "m"))
    assert (tmp_path / "m" / "speech_tokenizer" / "model.safetensors").is_file()
