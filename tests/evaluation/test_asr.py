"""The intelligibility recognizer is real: pocketsphinx transcribes a real demo clip close to its
text, and a generation of the random-weight tiny model scores a high error rate (the metric can fail)."""

from pathlib import Path

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
