"""The loader names the directory, the file and the problem."""

import json
import shutil

import pytest

from tts_lightning.model.loading import build_model
from tts_lightning.model.pretrained import PretrainedError, check_pretrained


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_accepts_tiny(tiny_dir):
    info = check_pretrained(tiny_dir)
    assert info.tts_model_type == "base" and info.num_code_groups == 16
    model = build_model(info)
    assert model.speaker_encoder is not None
    assert all(p.dtype.is_floating_point and p.dtype.itemsize == 4 for p in model.parameters())


def test_missing_directory(tmp_path):
    with pytest.raises(PretrainedError, match="does not exist"):
        check_pretrained(tmp_path / "nope")


def test_no_config(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(PretrainedError, match=r"model config missing \(config.json not found\)"):
        check_pretrained(d)


def test_non_tts_config(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(PretrainedError, match="model_type is 'llama'.*not a Qwen3-TTS checkpoint"):
        check_pretrained(d)


def test_wrong_tts_model_type(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["tts_model_type"] = "voice_design"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PretrainedError, match="'voice_design', but 'base' is required"):
        check_pretrained(d, require_type="base")


def test_missing_speech_tokenizer(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    shutil.rmtree(d / "speech_tokenizer")
    with pytest.raises(PretrainedError, match="speech tokenizer missing"):
        check_pretrained(d)


def test_missing_text_tokenizer(tmp_path, tiny_dir):
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "merges.txt").unlink()
    with pytest.raises(PretrainedError, match="text tokenizer incomplete, missing merges.txt"):
        check_pretrained(d)


def test_a_model_read_onto_a_device_has_its_buffers_there(tiny_dir):
    """`MetaWeights.materialize_all(device=...)` (replay records, forgetting scores) moves the buffers
    built on the CPU too: the talker's rotary embedding multiplies its ``inv_freq`` with positions on
    the model's device without moving it (a GPU run failed there). CPU rehearsal: the meta device
    stands for the GPU."""
    from tts_lightning.model.loading import MetaWeights, build_empty_model

    info = check_pretrained(tiny_dir)
    model = build_empty_model(info)
    assert any(b.device.type == "cpu" for b in model.buffers())
    MetaWeights(model, info).materialize_all(model, device="meta")
    assert [n for n, b in model.named_buffers() if b.device.type != "meta"] == []
    assert all(p.device.type == "meta" for p in model.parameters())
