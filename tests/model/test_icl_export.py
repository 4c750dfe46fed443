"""A run trained on the ICL layout resumes exactly, exports as a ``base`` model (`tts-lightning export` picks it from
the checkpoint) and clones through the official ``generate_voice_clone`` in ICL mode, streaming and not."""

import json

import lightning as L
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file

from tts_lightning import Qwen3TTSModule
from tts_lightning.data.demo import demo_dir
from tts_lightning.model.checkpoint import load_training_checkpoint
from tts_lightning.model.export import ExportError, export_base
from tts_lightning.model.export_cli import export_command
from tts_lightning.model.pretrained import check_pretrained
from tts_lightning.model.synthesis import SynthesisError, check_request, load_tts
from tts_lightning.model.synthesis_cli import synthesize_command


def _fit(tiny_dir, make_datamodule, root, max_steps, ckpt_path=None):
    """A single-process fit on the ICL streaming layout, checkpointing every step; its checkpoints folder."""
    L.seed_everything(0)
    data = make_datamodule(layout="icl", streaming=True, max_frames_per_batch=300)
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names, learning_rate=1e-3)
    every_step = L.pytorch.callbacks.ModelCheckpoint(root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=[every_step],
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return root


def test_icl_trained_checkpoint_resumes_exactly_exports_as_base_and_clones(
    tiny_dir, tiny_custom_voice_dir, make_datamodule, tmp_path
):
    torch.set_num_threads(1)
    straight = _fit(tiny_dir, make_datamodule, tmp_path / "straight", 3)
    resumed = _fit(tiny_dir, make_datamodule, tmp_path / "resumed", 3, ckpt_path=straight / "step=1.ckpt")
    ckpt = straight / "step=3.ckpt"
    final, again = (load_training_checkpoint(d / "step=3.ckpt").state_dict for d in (straight, resumed))
    assert final.keys() == again.keys()
    for key, value in final.items():  # resumed mid-epoch on the ICL layout: the same weights
        torch.testing.assert_close(again[key], value, atol=0, rtol=0, msg=key)

    assert export_command(["--ckpt", str(ckpt), "--out", str(tmp_path / "voice"), "--dtype", "fp32"]) == 0
    out = tmp_path / "voice"
    assert json.loads((out / "config.json").read_text())["tts_model_type"] == "base"
    exported = load_file(str(out / "model.safetensors"))
    weights = load_training_checkpoint(ckpt).model_state_dict()
    pretrained = load_file(str(tiny_dir / "model.safetensors"))
    assert set(exported) == set(weights) and any(k.startswith("speaker_encoder.") for k in exported)
    for key, value in exported.items():
        torch.testing.assert_close(value, weights[key], atol=0, rtol=0, msg=key)
    assert not torch.equal(exported["talker.codec_head.weight"], pretrained["talker.codec_head.weight"])  # trained

    with pytest.raises(ExportError, match="is a custom_voice model: a base export needs a base model"):
        export_base(ckpt, tmp_path / "nope", pretrained=tiny_custom_voice_dir)

    from qwen_tts import Qwen3TTSModel

    model = Qwen3TTSModel.from_pretrained(str(out))
    clip = demo_dir() / "clips" / "alice" / "alice_001"
    wav, sr = sf.read(clip.with_suffix(".flac"), dtype="float32")
    torch.manual_seed(0)
    wavs, rate = model.generate_voice_clone(
        text="Hello there.",
        language="english",
        ref_audio=(wav, sr),
        ref_text=clip.with_suffix(".txt").read_text().strip(),
        x_vector_only_mode=False,
        non_streaming_mode=False,  # the streaming layout the run trained
        max_new_tokens=16,
    )
    assert rate == 24_000 and wavs[0].ndim == 1 and wavs[0].size > 0

    # Non-streaming, through `tts-lightning synthesize` (generate_voice_clone inside): --ref-text clones
    # in ICL mode, --no-streaming picks the layout.
    said = tmp_path / "said.wav"
    argv = ["--model", str(out), "--ref-audio", str(clip.with_suffix(".flac")), "--text", "Hello there."]
    argv += ["--ref-text", clip.with_suffix(".txt").read_text().strip(), "--no-streaming", "--max-new-tokens", "8"]
    assert synthesize_command([*argv, "--out", str(said), "--device", "cpu"]) == 0
    assert sf.info(str(said)).samplerate == 24_000 and sf.info(str(said)).frames > 0
    # The flags reach qwen_tts: the file is its ICL, non-streaming generation at the same seed (as
    # the 16-bit file holds it), and neither x-vector-only cloning nor the streaming layout is.
    fp32 = load_tts(out, "cpu", torch.float32)

    def official(**mode):
        torch.manual_seed(0)  # synthesize's default --seed
        ref = {"ref_audio": str(clip.with_suffix(".flac")), "ref_text": clip.with_suffix(".txt").read_text().strip()}
        (wav,), _ = fp32.generate_voice_clone(text=["Hello there."], language="Auto", **ref, **mode, max_new_tokens=8)
        return wav

    written = torch.from_numpy(sf.read(str(said), dtype="float32")[0])

    def same(wav):
        return written.shape == wav.shape and bool((written - torch.from_numpy(wav)).abs().max() <= 1 / 32767)

    assert same(official(x_vector_only_mode=False, non_streaming_mode=True))
    assert not same(official(x_vector_only_mode=True, non_streaming_mode=True))
    assert not same(official(x_vector_only_mode=False, non_streaming_mode=False))
    with pytest.raises(SynthesisError, match="--ref-text clones in ICL mode, which needs a base model"):
        check_request(
            check_pretrained(tiny_custom_voice_dir), speaker="x", ref_audio=None, language="auto", ref_text="Hi."
        )
