"""The intelligibility recognizer is real: pocketsphinx transcribes a real demo clip close to its
text, and a generation of the random-weight tiny model scores a high error rate (the metric can fail)."""

from pathlib import Path

import pytest

from tts_lightning.data.audio import load_audio
from tts_lightning.evaluation.asr import PocketsphinxRecognizer, error_rates, make_recognizer

CLIPS = Path(__file__).resolve().parents[2] / "tts_lightning" / "demo" / "clips"
TEXT = "My brother fixed the bicycle in an hour."  # bob_000's transcript (tts_lightning/demo/train.jsonl)


def test_error_rates_normalize_case_and_punctuation():
    assert error_rates("Hello, World!", "hello world") == {"cer": 0.0, "wer": 0.0}
    assert error_rates("hello world", "") == {"cer": 1.0, "wer": 1.0}
    assert error_rates("hello world", "hello word")["wer"] == 0.5


def test_pocketsphinx_hears_real_speech_and_not_the_tiny_models(tiny_custom_voice_dir):
    from tts_lightning.model.synthesis import synthesize

    asr = make_recognizer("pocketsphinx")
    assert isinstance(asr, PocketsphinxRecognizer)
    real = load_audio(CLIPS / "bob" / "bob_000.flac", 24_000).numpy().reshape(-1)
    heard = asr.transcribe(real, 24_000)
    real_rates = error_rates(TEXT, heard)
    # Measured: "my brother through the bicycle louder"; over all 24 demo clips WER 0.92, CER 0.64.
    assert real_rates["wer"] <= 0.6 and real_rates["cer"] <= 0.5, heard  # measured 0.50, 0.41
    (wav,), sr = synthesize(tiny_custom_voice_dir, [TEXT], speaker="vivian", max_new_tokens=40, device="cpu")
    noise_rates = error_rates(TEXT, asr.transcribe(wav, sr))
    assert noise_rates["cer"] >= 0.7 and noise_rates["wer"] >= 0.9
    assert noise_rates["cer"] > real_rates["cer"] + 0.3


@pytest.mark.parametrize("timestamps", [True, False])
def test_whisper_path_runs_end_to_end_on_a_random_weight_model(tmp_path, monkeypatch, timestamps):
    """Real transformers Whisper classes, random weights, a byte-level vocabulary written here: the
    recognizer loads the folder, transcribes (garbage) and the rates are computed. A generation over
    30 s is heard whole: by Whisper's long-form decoding (the whole log-mel in one call) when the
    checkpoint has timestamp tokens, else in 30 s windows; it was cut at 30 s."""
    import json

    import numpy as np
    import torch
    from transformers import (
        AddedToken,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    from tts_lightning.evaluation.asr import WhisperRecognizer

    (tmp_path / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(bytes_to_unicode().values())}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = WhisperTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|startoftranscript|>", "<|notimestamps|>"]})
    if timestamps:  # as the released checkpoints: <|0.00|> .. <|30.00|> right after <|notimestamps|>
        tokenizer.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", lstrip=False, rstrip=False) for i in range(1501)])
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tokenizer).save_pretrained(
        tmp_path
    )
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=80,
        encoder_layers=1,
        decoder_layers=1,
        d_model=32,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        decoder_start_token_id=tokenizer.convert_tokens_to_ids("<|startoftranscript|>"),
        eos_token_id=end,
        pad_token_id=end,
        bos_token_id=end,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    if timestamps:
        model.generation_config.no_timestamps_token_id = tokenizer.convert_tokens_to_ids("<|notimestamps|>")
        model.generation_config._from_model_config = False  # else loading rebuilds it from config.json
    model.save_pretrained(tmp_path)

    asr = make_recognizer(str(tmp_path))
    assert isinstance(asr, WhisperRecognizer) and asr.name == str(tmp_path)
    assert asr.model.dtype == torch.float32
    if not timestamps:  # bound for a GPU (the samples' recognizer waits in host memory): bf16, half the bytes
        on_gpu = make_recognizer(str(tmp_path), device="cpu", runs_on="cuda:0")
        assert on_gpu.model.dtype == torch.bfloat16 and on_gpu.model.device.type == "cpu"
        on_gpu.max_new_tokens = 4
        assert isinstance(on_gpu.transcribe(np.zeros(16_000, dtype=np.float32), 16_000), str)
    asr.max_new_tokens = 16
    noise = np.random.default_rng(0).normal(0.0, 0.1, 24_000).astype(np.float32)
    text = asr.transcribe(noise, 24_000)
    assert isinstance(text, str)
    rates = error_rates(TEXT, text)
    assert rates["cer"] >= 0.7  # garbage

    frames, heard = [], []  # the log-mel frames of each generate call (100 a second), the seconds heard
    generate, processor = asr.model.generate, asr.processor

    def recording(features, **kwargs):
        frames.append(features.shape[-1])
        return generate(features, **kwargs)

    class Listening:  # the real processor, recording the audio it is given
        feature_extractor = processor.feature_extractor
        batch_decode = processor.batch_decode

        def __call__(self, wave, **kwargs):
            heard.append(round(len(wave) / 16_000, 2))
            return processor(wave, **kwargs)

    monkeypatch.setattr(asr.model, "generate", recording)
    monkeypatch.setattr(asr, "processor", Listening())
    long = np.random.default_rng(1).normal(0.0, 0.1, 61 * 24_000).astype(np.float32)  # 61 s
    assert isinstance(asr.transcribe(long, 24_000), str)
    if timestamps:  # one call with the whole log-mel
        assert (frames, heard) == ([6100], [61.0])
    else:  # equal windows (not 30 + 30 + 1 s, whose last one would be mostly padding), each padded to 30 s
        assert (frames, heard) == ([3000] * 3, [20.33] * 3)
