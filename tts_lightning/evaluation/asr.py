"""Intelligibility: transcribe a generation and score it against its text (character and word error
rates, jiwer). One small interface, `Recognizer.transcribe(audio, sample_rate) -> str`, over

- Whisper through transformers (``openai/whisper-small`` or a local folder): for real runs;
- pocketsphinx: offline, ships an English model; weak (on the demo's real clips, measured: WER 0.92,
  CER 0.64) but real, which is what the tests need to tell speech from noise.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

ASR_RATE = 16_000  # both recognizers take 16 kHz mono


class Recognizer(Protocol):
    name: str

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> str: ...


def _to_16k(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    import torchaudio

    wave = torch.as_tensor(np.asarray(audio, dtype=np.float32).reshape(-1))
    if sample_rate != ASR_RATE:
        wave = torchaudio.functional.resample(wave, sample_rate, ASR_RATE)
    return wave.clamp(-1.0, 1.0).numpy()


class PocketsphinxRecognizer:
    """CMU pocketsphinx with its bundled US-English acoustic and language models."""

    name = "pocketsphinx"

    def __init__(self) -> None:
        from pocketsphinx import Decoder

        self._decoder = Decoder(samprate=ASR_RATE, loglevel="FATAL")

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> str:
        pcm = (_to_16k(audio, sample_rate) * 32767).astype(np.int16).tobytes()
        self._decoder.start_utt()
        self._decoder.process_raw(pcm, full_utt=True)
        self._decoder.end_utt()
        hyp = self._decoder.hyp()
        return hyp.hypstr if hyp is not None else ""


class WhisperRecognizer:
    """A Whisper checkpoint (hub name or local folder) through transformers' own classes. Audio over
    30 s is transcribed whole, by Whisper's own long-form decoding (window by window, led by its
    timestamp tokens; ``max_new_tokens`` is per window), or, for a checkpoint without timestamp
    tokens, in equal windows of at most 30 s: cut at 30 s, a generation that runs on would be scored on
    its first 30 s only."""

    def __init__(
        self, model: str, *, device: str = "cpu", max_new_tokens: int = 128, dtype: torch.dtype = torch.float32
    ) -> None:
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        self.name = model
        self.device = device
        self.max_new_tokens = max_new_tokens
        self.processor = WhisperProcessor.from_pretrained(model)
        self.model = WhisperForConditionalGeneration.from_pretrained(model, dtype=dtype).to(device).eval()
        # Long-form decoding needs the timestamp tokens (every openai/whisper-* checkpoint has them).
        self.has_timestamps = getattr(self.model.generation_config, "no_timestamps_token_id", None) is not None

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> str:
        wave = _to_16k(audio, sample_rate)
        window = self.processor.feature_extractor.n_samples  # type: ignore[attr-defined]  # 30 s
        long_form = wave.shape[0] > window
        if long_form and not self.has_timestamps:
            # A checkpoint without timestamp tokens: equal windows of at most 30 s (a short last one,
            # padded with 30 s of silence, would make Whisper invent words).
            windows = np.array_split(wave, -(-wave.shape[0] // window))
            return " ".join(self.transcribe(w, ASR_RATE) for w in windows)
        # Long-form takes the whole log-mel (not padded or cut to 30 s) and its attention mask.
        options = {"truncation": False, "padding": "longest", "return_attention_mask": True} if long_form else {}
        features = self.processor(wave, sampling_rate=ASR_RATE, return_tensors="pt", **options)
        extra = {"attention_mask": features.attention_mask.to(self.device)} if long_form else {}
        with torch.no_grad():
            ids = self.model.generate(
                features.input_features.to(self.device, self.model.dtype), max_new_tokens=self.max_new_tokens, **extra
            )
        return str(self.processor.batch_decode(ids, skip_special_tokens=True)[0]).strip()


def whisper_dtype(device: str) -> torch.dtype:
    """bf16 where Whisper will run on a GPU (half the memory: whisper-large-v3 2.9 instead of 5.8 GiB,
    on rank 0's GPU while the samples are scored), fp32 on the CPU (no fast bf16 there)."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def make_recognizer(spec: str, *, device: str = "cpu", runs_on: str | None = None) -> Recognizer:
    """``pocketsphinx``, else a Whisper checkpoint's hub name or folder, loaded on ``device`` in the
    dtype for the device it will run on (``runs_on``, default ``device``: `whisper_dtype`)."""
    if spec == "pocketsphinx":
        return PocketsphinxRecognizer()
    return WhisperRecognizer(spec, device=device, dtype=whisper_dtype(runs_on or device))


def normalize(text: str) -> str:
    """Lower case, no punctuation, single spaces: what both rates compare."""
    import jiwer

    return " ".join(jiwer.RemovePunctuation()(text.lower()).split())


def error_rates(reference: str, hypothesis: str) -> dict[str, float]:
    """``{"cer", "wer"}`` of the hypothesis against the reference (1.0 each for an empty hypothesis)."""
    import jiwer

    ref, hyp = normalize(reference), normalize(hypothesis)
    return {"cer": float(jiwer.cer(ref, hyp)), "wer": float(jiwer.wer(ref, hyp))}
