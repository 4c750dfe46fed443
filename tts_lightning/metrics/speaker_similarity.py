"""`SpeakerSimilarity`: does synthesised speech sound like the speaker's reference clips?

Scored by an encoder independent of the model being trained: resemblyzer's `VoiceEncoder` (a GE2E
speaker-verification network, its bundled weights, CPU). Each waveform is resampled to 16 kHz with
torchaudio and preprocessed with resemblyzer's own ``preprocess_wav`` (volume normalisation, long
silences cut by VAD). A speaker's reference embedding is the mean of its clips' unit-norm embeddings;
the score of a generated clip is the cosine between its embedding and that mean. ``compute()`` is
the mean score over every clip seen, on every rank.

resemblyzer is optional (``pip install 'tts-lightning[eval]'``); `similarity_unavailable()` says why
it cannot be used, so callers can switch the metric off instead of failing.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torchaudio.functional as AF
from torch import Tensor
from torchmetrics import Metric

ENCODER_SAMPLE_RATE = 16_000
INSTALL_HINT = "pip install 'tts-lightning[eval]'"
# Below this many samples (at 16 kHz) after VAD trimming, embed the untrimmed clip instead: VAD can
# remove everything from a short or unusual (e.g. early-training) clip.
MIN_TRIMMED_SAMPLES = ENCODER_SAMPLE_RATE // 10

Waveform = np.ndarray | Tensor


def _import_resemblyzer():
    with warnings.catch_warnings():
        # webrtcvad imports pkg_resources, which setuptools deprecates loudly.
        warnings.filterwarnings("ignore", message=".*pkg_resources.*")
        import resemblyzer

    return resemblyzer


@functools.lru_cache(maxsize=1)
def similarity_unavailable() -> str | None:
    """None when the speaker-verification encoder can be used, else the reason it cannot."""
    try:
        _import_resemblyzer()
    except Exception as exc:  # ImportError, or pkg_resources missing under setuptools >= 81
        return f"resemblyzer is not importable ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


@functools.lru_cache(maxsize=1)
def voice_encoder():
    """resemblyzer's `VoiceEncoder` with its bundled weights, on CPU, loaded once per process."""
    reason = similarity_unavailable()
    if reason is not None:
        raise ImportError(reason)
    encoder = _import_resemblyzer().VoiceEncoder("cpu", verbose=False)
    encoder.eval()
    return encoder


def _mono(wav: Waveform) -> Tensor:
    t = torch.as_tensor(wav).detach().to("cpu", torch.float32)
    if t.dim() == 2:  # (channels, samples)
        t = t.mean(0)
    if t.dim() != 1:
        raise ValueError(f"a waveform must be 1-D (or channels x samples), got shape {tuple(t.shape)}")
    return t


def embed_utterances(wavs: Sequence[Waveform], sample_rate: int) -> Tensor:
    """(N, D) unit-norm float32 speaker embeddings of ``wavs`` (any rate; resampled to 16 kHz)."""
    audio = _import_resemblyzer().audio
    encoder = voice_encoder()
    out = []
    for wav in wavs:
        mono = _mono(wav)
        if mono.numel() == 0 or not bool(mono.abs().max() > 0):
            raise ValueError("cannot embed an empty or silent waveform")
        if sample_rate != ENCODER_SAMPLE_RATE:
            mono = AF.resample(mono, int(sample_rate), ENCODER_SAMPLE_RATE)
        wav16 = mono.numpy().astype(np.float32)
        processed = audio.preprocess_wav(wav16)
        if processed.size < MIN_TRIMMED_SAMPLES:
            processed = audio.normalize_volume(wav16, audio.audio_norm_target_dBFS, increase_only=True)
        embedding = torch.from_numpy(np.asarray(encoder.embed_utterance(processed), dtype=np.float32))
        out.append(torch.nn.functional.normalize(embedding, dim=0))
    if not out:
        return torch.zeros(0, 256)
    return torch.stack(out)


def reference_embedding(reference_wavs: Sequence[Waveform], sample_rate: int) -> Tensor:
    """(D,) a speaker's reference: the mean of its clips' unit-norm embeddings (not re-normalised;
    the cosine divides by its norm)."""
    if len(reference_wavs) == 0:
        raise ValueError("a speaker needs at least one reference clip")
    return embed_utterances(reference_wavs, sample_rate).mean(0)


class SpeakerSimilarity(Metric):
    """Mean cosine similarity between generated clips and their speaker's reference clips.

    ``update(generated, references)``:
      - one speaker: ``generated`` a waveform or a list of waveforms, ``references`` a list of that
        speaker's reference waveforms, or its `reference_embedding` (a 1-D tensor) to skip
        re-embedding the references at every update;
      - several speakers: both as mappings keyed by speaker name (every generated speaker needs
        references).

    Waveforms are numpy arrays or tensors at ``sample_rate`` (24 kHz by default). States are a sum
    and a count, reduced by summation across ranks, so ``compute()`` is the mean over all clips of
    all ranks.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, sample_rate: int = 24_000, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sample_rate = int(sample_rate)
        self.similarity_sum: Tensor
        self.count: Tensor
        self.add_state("similarity_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def reference_embedding(self, reference_wavs: Sequence[Waveform]) -> Tensor:
        return reference_embedding(reference_wavs, self.sample_rate)

    def update(self, generated: Any, references: Any) -> None:
        if isinstance(generated, Mapping):
            if not isinstance(references, Mapping):
                raise TypeError("generated is keyed by speaker: references must be keyed by speaker too")
            missing = sorted(set(generated) - set(references))
            if missing:
                raise KeyError(f"no reference clips for speaker(s) {missing}")
            for speaker, wavs in generated.items():
                self._update_one(wavs, references[speaker])
        else:
            self._update_one(generated, references)

    def _update_one(self, generated: Any, references: Any) -> None:
        if isinstance(generated, (np.ndarray, Tensor)) and torch.as_tensor(generated).dim() == 1:
            generated = [generated]
        if isinstance(references, Tensor) and references.dim() == 1:
            ref = references.detach().float().cpu()
        else:
            ref = self.reference_embedding(list(references))
        embeddings = embed_utterances(list(generated), self.sample_rate)
        if embeddings.shape[0] == 0:
            return
        cosine = torch.nn.functional.cosine_similarity(embeddings, ref[None, :], dim=1)
        self.similarity_sum += cosine.double().sum().to(self.similarity_sum.device)
        self.count += embeddings.shape[0]

    def compute(self) -> Tensor:
        if int(self.count) == 0:
            return torch.tensor(float("nan"))
        return (self.similarity_sum / self.count).float()
