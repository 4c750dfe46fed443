"""Intelligibility of the samples callback's generations (``val/cer``, ``val/wer``): each sample
transcribed by the recognizer `evaluate --asr` uses (tts_lightning.evaluation.asr) and scored
against its text by jiwer. Rank 0 alone transcribes, like it alone generates and scores."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tts_lightning.callbacks.generation_copy import on_device
from tts_lightning.errors import ConfigError
from tts_lightning.metrics.speaker_similarity import INSTALL_HINT  # the eval extra: asr too

if TYPE_CHECKING:
    from tts_lightning.evaluation.asr import Recognizer


class SampleIntelligibility:
    """``asr``: "pocketsphinx" (offline, weak) or a Whisper checkpoint (hub name or local folder)."""

    def __init__(self, asr: str) -> None:
        if not isinstance(asr, str) or not asr.strip():
            raise ConfigError(f"SpeakerSamplesCallback asr must be 'pocketsphinx' or a Whisper checkpoint, got {asr!r}")
        local = Path(asr).expanduser()
        if asr.startswith(("/", ".", "~")) and not (local / "config.json").is_file():
            raise ConfigError(
                f"SpeakerSamplesCallback asr: {asr} is not a Whisper checkpoint folder (no config.json); "
                "give 'pocketsphinx', a hub name such as openai/whisper-small, or a local Whisper folder"
            )
        self.asr = asr
        self._recognizer: Recognizer | None = None  # rank 0 only, built on first use

    def check_installed(self) -> None:
        """Before training, on every rank: the packages the recognizer and the rates need."""
        needed = ["jiwer", "pocketsphinx" if self.asr == "pocketsphinx" else "transformers"]
        for module in needed:
            try:
                __import__(module)
            except ImportError as exc:
                raise ConfigError(
                    f"SpeakerSamplesCallback asr={self.asr!r} needs {module}, which is not importable "
                    f"({type(exc).__name__}: {exc}); {INSTALL_HINT}, or drop asr"
                ) from exc

    def score(
        self, texts: list[str], wavs: list[np.ndarray], sample_rate: int, device: str
    ) -> tuple[dict[str, float], list[str]]:
        """Mean CER and WER over the samples (a silent or empty one transcribes to "", rates 1.0)
        and the transcripts, in order."""
        from tts_lightning.evaluation.asr import error_rates, make_recognizer

        if self._recognizer is None:
            # Kept in host memory between rounds, in the dtype of the device it transcribes on.
            self._recognizer = make_recognizer(self.asr, device="cpu", runs_on=device)
        recognizer = self._recognizer
        transcripts, rates = [], []
        # Whisper on rank 0's GPU only while it transcribes (pocketsphinx has no model to move).
        with on_device(recognizer, device) if hasattr(recognizer, "model") else contextlib.nullcontext():
            for text, wav in zip(texts, wavs, strict=True):
                audible = wav.size > 0 and float(np.abs(wav).max()) > 0
                transcripts.append(recognizer.transcribe(wav, sample_rate) if audible else "")
                rates.append(error_rates(text, transcripts[-1]))
        means = {key: float(np.mean([r[key] for r in rates])) for key in ("cer", "wer")}
        return means, transcripts
