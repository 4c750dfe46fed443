"""A run trained in the ICL layout (streaming or not) is sampled, and predicts, in that layout: the
samples callback's audio and ``predict``'s codes are those the official ``generate_voice_clone``
gives on the same weights for the speaker's training reference (codes and transcript), seed and text."""

import io

import lightning as L
import numpy as np
import pytest
import soundfile as sf
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from test_samples import read_events

from tts_lightning import Qwen3TTSModule
from tts_lightning.callbacks import SpeakerSamplesCallback
from tts_lightning.data.codec_cache import load_codes
from tts_lightning.metrics.speech import max_new_tokens_for
from tts_lightning.model.row_blocks import official_state

TEXTS = ["Good morning, how are you today?"]


def official_model(tiny_dir, module):
    """The official ``Qwen3TTSModel`` (tokenizers, sampling settings) holding the module's weights."""
    from qwen_tts import Qwen3TTSModel

    official = Qwen3TTSModel.from_pretrained(str(tiny_dir))
    official.model.load_state_dict(official_state(module.model.state_dict()))  # row blocks joined
    official.model.eval()
    return official


def official_clone(official, prompts, texts, languages, streaming, seed, **kwargs):
    """``generate_voice_clone``'s audio, with the talker codes it generated."""
    from qwen_tts.inference.qwen3_tts_model import VoiceClonePromptItem

    generated = []
    generate = official.model.generate

    def recording(*args, **kw):  # the official generate itself, its codes kept for the comparison
        out = generate(*args, **kw)
        generated.extend(c.cpu() for c in out[0])
        return out

    official.model.generate = recording
    items = [
        VoiceClonePromptItem(ref_code=c, ref_spk_embedding=e, x_vector_only_mode=False, icl_mode=True, ref_text=t)
        for t, c, e in prompts
    ]
    torch.manual_seed(seed)
    try:
        wavs, _ = official.generate_voice_clone(
            text=texts, language=languages, voice_clone_prompt=items, non_streaming_mode=not streaming, **kwargs
        )
    finally:
        official.model.generate = generate
    return wavs, generated


def training_reference(data, speaker):
    """The reference the data module gave the speaker's first training clip: (transcript, codes)."""
    index = data.speaker_names.index(speaker)
    item = next(it for it in data.train_dataset.items if it.speaker_index == index)
    clip = next(c for c in data.prepared_index.clips if c.audio == item.reference.key)
    return clip.text, load_codes(item.reference.codes)


def fit_one_step_with_samples(module, data, samples, tmp_path) -> L.Trainer:
    """One training step, then a validation in which ``samples`` speaks (logged to tmp_path/tb)."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(tmp_path, name="tb"),
        callbacks=[samples],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [False, True], ids=["non_streaming", "streaming"])
def test_icl_run_samples_and_predicts_as_generate_voice_clone(streaming, tiny_dir, make_datamodule, tmp_path):
    torch.set_num_threads(1)
    L.seed_everything(0)
    data = make_datamodule(layout="icl", streaming=streaming, max_frames_per_batch=700, predict_texts=TEXTS)
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names, learning_rate=1e-3)
    samples = SpeakerSamplesCallback(texts=TEXTS, max_new_tokens=6, seed=3, similarity=False, baseline=False)
    trainer = fit_one_step_with_samples(module, data, samples, tmp_path)
    acc = read_events(tmp_path / "tb")

    speakers = data.speaker_names
    table = data.speaker_embeddings()
    embeddings = [module.speaker_embeddings[i] if module.speaker_embeddings[i].any() else table[i] for i in range(2)]
    prompts = [(*training_reference(data, s), embeddings[i].float()) for i, s in enumerate(speakers)]
    languages = [samples.facts.language_of(trainer, s) for s in speakers]
    limit = max(samples.facts.frame_limit(trainer, s, TEXTS[0]) for s in speakers)
    official = official_model(tiny_dir, module)
    wavs, codes = official_clone(
        official, prompts, TEXTS * 2, languages, streaming, 3, max_new_tokens=max_new_tokens_for(limit)
    )
    assert all(0 < c.shape[0] <= limit for c in codes)
    for speaker, wav in zip(speakers, wavs):  # the logged sample is the official clone of the same codes
        (event,) = acc.Audio(f"samples/{speaker}/0")
        logged, sr = sf.read(io.BytesIO(event.encoded_audio_string), dtype="float32")
        assert sr == 24_000 and logged.shape == wav.shape
        np.testing.assert_allclose(logged, np.clip(wav, -1, 1), atol=2 / 32768)

    # predict: the same layout and references, with the pretrained directory's sampling settings.
    (batch,) = data.predict_dataloader()  # the run's layout and each speaker's reference, per row
    assert (batch.layout, batch.streaming) == ("icl", streaming)
    with torch.no_grad():  # a speaker no batch of the one step showed speaks with the data's embedding,
        for i in range(2):  # as the official clone above does (which speakers the step shows is a draw)
            if not module.speaker_embeddings[i].any():
                module.speaker_embeddings[i] = table[i]
    module.predict_tools()  # loads the tokenizers (their random init draws from the RNG)
    torch.manual_seed(5)
    predictions = module.eval().predict_step(batch, 0)
    _, expected = official_clone(official, prompts, TEXTS * 2, languages, streaming, 5)
    assert [p["speaker"] for p in predictions] == speakers
    for prediction, want in zip(predictions, expected):
        assert torch.equal(prediction["codes"], want)


DIALECT = "sichuan_dialect"


@pytest.fixture(scope="module")
def dialect_custom_voice(tiny_custom_voice_dir, tmp_path_factory):
    """The tiny CustomVoice model with serena speaking a dialect, and 3 demo clips each of alice (a
    new speaker) and of bob, named serena (the built-in dialect speaker), language "auto"."""
    import json
    import shutil

    from tts_lightning.data.demo import demo_dir

    root = tmp_path_factory.mktemp("cv-samples")
    model_dir = shutil.copytree(tiny_custom_voice_dir, root / "model")
    config = json.loads((model_dir / "config.json").read_text())
    talker = config["talker_config"]
    talker["codec_language_id"][DIALECT] = talker["vocab_size"] - 1024 + 20
    talker["spk_is_dialect"]["serena"] = DIALECT
    (model_dir / "config.json").write_text(json.dumps(config))
    lines = []
    for folder, speaker in (("alice", "alice"), ("bob", "serena")):
        for i in range(3):
            src = demo_dir() / "clips" / folder / f"{folder}_{i:03d}"
            shutil.copy(src.with_suffix(".flac"), root / f"{src.name}.flac")
            text = src.with_suffix(".txt").read_text().strip()
            lines.append(json.dumps({"audio": f"{src.name}.flac", "text": text, "speaker": speaker}))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return model_dir, root / "train.jsonl"


def official_custom_voice(official, speakers, texts, languages, seed, streaming=True, **kwargs):
    """``generate_custom_voice(non_streaming_mode=not streaming)``'s audio and the talker codes it generated."""
    generated = []
    generate = official.model.generate

    def recording(*args, **kw):
        out = generate(*args, **kw)
        generated.extend(c.cpu() for c in out[0])
        return out

    official.model.generate = recording
    torch.manual_seed(seed)
    try:
        wavs, _ = official.generate_custom_voice(
            text=texts, speaker=speakers, language=languages, non_streaming_mode=not streaming, **kwargs
        )
    finally:
        official.model.generate = generate
    return wavs, generated


@pytest.mark.slow
def test_custom_voice_streaming_run_samples_and_predicts_as_generate_custom_voice(dialect_custom_voice, tmp_path):
    """A run from a custom_voice model with ``data.streaming: true`` samples and predicts what the
    official ``generate_custom_voice(non_streaming_mode=False)`` says with the run's weights, a new
    speaker's row named in ``spk_id`` as export names it, and a built-in dialect speaker's dialect."""
    from tts_lightning import SpeakerClipsDataModule

    torch.set_num_threads(1)
    L.seed_everything(0)
    model_dir, manifest = dialect_custom_voice
    data = SpeakerClipsDataModule(
        str(model_dir), str(manifest), val_fraction=0.34, seed=0, batch_size=2, streaming=True, predict_texts=TEXTS
    )
    module = Qwen3TTSModule(str(model_dir), speakers=data.speaker_names, learning_rate=1e-3)
    samples = SpeakerSamplesCallback(texts=TEXTS, max_new_tokens=6, seed=3, similarity=False, baseline=False)
    trainer = fit_one_step_with_samples(module, data, samples, tmp_path)
    acc = read_events(tmp_path / "tb")

    speakers = data.speaker_names
    assert speakers == ["alice", "serena"] and data.layout.streaming
    languages = [samples.facts.language_of(trainer, s) for s in speakers]
    assert languages == ["auto", "auto"]  # serena's dialect comes from the model, as in generation
    limit = max(samples.facts.frame_limit(trainer, s, TEXTS[0]) for s in speakers)
    official = official_model(model_dir, module)
    talker = official.model.config.talker_config
    talker.spk_id["alice"] = module.speaker_codec_ids[0]  # as export names the new speaker
    talker.spk_is_dialect["alice"] = False
    wavs, codes = official_custom_voice(
        official, speakers, TEXTS * 2, languages, 3, max_new_tokens=max_new_tokens_for(limit)
    )
    assert all(0 < c.shape[0] <= limit for c in codes)
    for speaker, wav in zip(speakers, wavs):  # the logged sample is the official speech of the same codes
        (event,) = acc.Audio(f"samples/{speaker}/0")
        logged, sr = sf.read(io.BytesIO(event.encoded_audio_string), dtype="float32")
        assert sr == 24_000 and logged.shape == wav.shape
        np.testing.assert_allclose(logged, np.clip(wav, -1, 1), atol=2 / 32768)

    # predict: the same layout, with the pretrained directory's sampling settings.
    (batch,) = data.predict_dataloader()
    assert (batch.layout, batch.streaming) == ("xvector", True)
    # Loads the tokenizers (their random init draws from the RNG); 12 frames instead of the directory's 48 (time).
    module.predict_tools().generation["max_new_tokens"] = 12
    torch.manual_seed(5)
    predictions = module.eval().predict_step(batch, 0)
    _, expected = official_custom_voice(official, speakers, TEXTS * 2, languages, 5, max_new_tokens=12)
    assert [p["speaker"] for p in predictions] == speakers
    for prediction, want in zip(predictions, expected):
        assert torch.equal(prediction["codes"], want)
    # Not vacuous: serena's dialect tag and the streaming layout each change what is said.
    talker.spk_is_dialect["serena"] = False
    _, no_dialect = official_custom_voice(official, speakers, TEXTS * 2, languages, 5, max_new_tokens=12)
    talker.spk_is_dialect["serena"] = DIALECT
    _, non_streaming = official_custom_voice(official, speakers, TEXTS * 2, languages, 5, False, max_new_tokens=12)
    assert not _same(no_dialect[1], expected[1])
    assert not any(_same(a, b) for a, b in zip(non_streaming, expected))


def _same(a, b):
    return a.shape == b.shape and torch.equal(a, b)
