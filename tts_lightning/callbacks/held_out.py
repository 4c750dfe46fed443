"""Zero-shot cloning of held-out speakers while a run trains (`SpeakerSamplesCallback`'s ``held_out``).

Fine-tuning on a few voices can cost the model its ability to clone voices it never heard. The
held-out speakers come from a manifest read as ``evaluate --held-out`` reads it
(`tts_lightning.evaluation.zero_shot.read_held_out`): each speaker's first clip is the reference
(its audio and transcript), its other clips (else the reference) what the clones are scored against.

Each round clones every held-out speaker in ICL mode (``x_vector_only_mode=False``, the reference's
codes and transcript in the prompt; ``generate_voice_clone``'s default ``non_streaming_mode=False``,
as ``evaluate --held-out`` generates) with the weights of the moment, the same texts and seed every
round, so rounds differ only by the weights. The prompts are computed once, on rank 0, and kept:
the reference's x-vector from the checkpoint's speaker encoder (`SpeakerEncoder`, fp32: the frozen
encoder the run's own speaker embeddings come from), its codes from the speech tokenizer.
"""

from __future__ import annotations

import os
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn

from tts_lightning.callbacks.figures import log_samples
from tts_lightning.callbacks.generation_copy import on_device
from tts_lightning.errors import ConfigError
from tts_lightning.model.generation import SAMPLE_RATE, decode_codes, generate_codes

NAMES = ("zero_shot_samples", "zero_shot_spectrograms")  # the audio's and the images' tags
METRIC = "val/zero_shot_similarity"
BEFORE = "val/zero_shot_similarity_before"  # the baseline round's, at step 0: Lightning logs METRIC at step - 1


class HeldOutVoices:
    """The held-out speakers of one run: checked on every rank before training, cloned on rank 0."""

    def __init__(self, manifest: str | os.PathLike) -> None:
        self.manifest = manifest
        self.plans: list = []  # `SpeakerPlan`s, read by `check`
        self._prompts: dict[str, tuple[Tensor, list[int], Tensor]] | None = None  # x-vector, ref ids, codes
        self._scored_against: dict[str, Tensor] = {}  # resemblyzer embedding of the real clips
        self._clips: dict[str, np.ndarray] = {}  # the reference audio, shown beside the clones

    def check(self, pl_module: Any) -> None:
        """Every rank, before training: a CustomVoice start cannot clone; the manifest must be usable."""
        from tts_lightning.evaluation.inputs import EvaluationError
        from tts_lightning.evaluation.zero_shot import read_held_out

        if getattr(pl_module, "speaker_codec_ids", None) is not None:
            raise ConfigError(
                f"SpeakerSamplesCallback held_out: {pl_module.hparams['pretrained']} is a CustomVoice model, which has "
                "no speaker encoder to clone held-out speakers with; held_out needs a run from a Base model"
            )
        try:
            self.plans = read_held_out(self.manifest, list(getattr(pl_module, "speakers", []) or []))
        except EvaluationError as exc:
            raise ConfigError("SpeakerSamplesCallback " + str(exc).replace("--held-out", "held_out", 1)) from None

    def _prepare(self, pl_module: Any, text_tokenizer, speech_tokenizer) -> dict[str, tuple[Tensor, list[int], Tensor]]:
        """Once, rank 0: each speaker's ICL prompt and what its clones are scored against."""
        if self._prompts is None:
            from tts_lightning.data.audio import load_audio
            from tts_lightning.data.speakers import SpeakerEncoder
            from tts_lightning.model.layouts import reference_prompt_ids
            from tts_lightning.model.pretrained import check_pretrained

            encoder = SpeakerEncoder(check_pretrained(pl_module.hparams["pretrained"]))
            prompts = {}
            for plan in self.plans:
                wave = load_audio(plan.reference, SAMPLE_RATE).reshape(-1)
                with on_device(speech_tokenizer, pl_module.device):
                    codes = speech_tokenizer.encode(wave.numpy(), sr=SAMPLE_RATE).audio_codes[0]
                ids = reference_prompt_ids(text_tokenizer, plan.reference_text)
                prompts[plan.name] = (encoder.embed(wave), ids, codes.detach().to("cpu", torch.long))
                self._clips[plan.name] = wave.numpy()
            self._prompts = prompts
        return self._prompts

    def generate(self, pl_module: Any, model: nn.Module, tokenizers: tuple, texts: list[str], **options: Any) -> tuple:
        """Rank 0, the model in eval mode: (rows, codes, prefixes) of every (speaker, text);
        ``options``: ``seed`` and ``max_new_tokens`` (each clone is cut there)."""
        from tts_lightning.metrics.speech import max_new_tokens_for
        from tts_lightning.model.layouts import SequenceLayout
        from tts_lightning.model.sequence import tokenize_text

        text_tokenizer, speech_tokenizer = tokenizers
        prompts = self._prepare(pl_module, text_tokenizer, speech_tokenizer)
        rows = [(p.name, i) for p in self.plans for i in range(len(texts))]
        language = {p.name: (p.language or "auto").lower() for p in self.plans}
        limit = int(options["max_new_tokens"])
        codes = generate_codes(
            model,
            [tokenize_text(text_tokenizer, texts[i]) for _, i in rows],
            torch.stack([prompts[s][0] for s, _ in rows]),
            [language[s] for s, _ in rows],
            max_new_tokens=max_new_tokens_for(limit),
            seed=options["seed"],
            dtype=cast(Any, model).talker.get_input_embeddings().weight.dtype,
            layout=SequenceLayout("icl", streaming=True),
            references=[(prompts[s][1], prompts[s][2]) for s, _ in rows],
        )
        return rows, [c[:limit] for c in codes], [prompts[s][2] for s, _ in rows]

    def log_and_score(
        self, generated: tuple, speech_tokenizer, device, loggers: list, step: int, **shown
    ) -> float | None:
        """Rank 0: decode, score (None without ``scoring``) and log the clones at ``step``: their audio,
        spectrograms and per-speaker similarity (under `BEFORE` in the baseline round); ``shown``:
        ``texts``, ``scoring``, ``before`` and ``real_logged`` (the speakers whose real clip
        TensorBoard has, updated here)."""
        rows, codes, prefixes = generated
        with on_device(speech_tokenizer, device):
            wavs = decode_codes(speech_tokenizer, codes, prefixes)
        scores = self._score(rows, wavs) if shown["scoring"] else {}
        real_logged: set[str] = shown["real_logged"]
        fresh = {s for s in self._clips if s not in real_logged}
        for logger in loggers:
            log_samples(logger.experiment, NAMES, shown["texts"], rows, wavs, step, self._clips, scores, fresh)
            for speaker, score in scores.items():
                logger.experiment.add_scalar(f"{BEFORE if shown['before'] else METRIC}/{speaker}", score, step)
        real_logged.update(fresh)
        return float(np.mean(list(scores.values()))) if scores else None

    def _score(self, rows: list, wavs: list) -> dict[str, float]:
        """Per speaker, the mean similarity of its audible clones to its real clips (the project's
        metric, as `evaluate` scores them)."""
        from tts_lightning.evaluation.inputs import load_real_clips
        from tts_lightning.metrics.speaker_similarity import SpeakerSimilarity, reference_embedding

        if not self._scored_against:
            real_audio, _ = load_real_clips(self.plans)
            self._scored_against = {s: reference_embedding(clips, SAMPLE_RATE) for s, clips in real_audio.items()}
        scores = {}
        for plan in self.plans:
            audible = [w for (s, _), w in zip(rows, wavs) if s == plan.name and w.size and np.abs(w).max() > 0]
            if audible:  # rank 0 alone: no sync in compute()
                metric = SpeakerSimilarity(sample_rate=SAMPLE_RATE, sync_on_compute=False)
                metric.update(audible, self._scored_against[plan.name])
                scores[plan.name] = float(metric.compute())
        return scores
