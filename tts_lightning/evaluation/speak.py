"""Speak and score: one system's generations through the official ``qwen_tts`` paths (custom voice,
x-vector or ICL cloning), seeded per (text, sample) so that every system and every model says the same
(text, seed); then each generation scored against the speaker's real clips. Shared by `evaluate`
and `tts_lightning.evaluation.zero_shot`."""

from __future__ import annotations

import gc
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tts_lightning.evaluation.inputs import SAMPLE_RATE, EvaluationError, SpeakerPlan
from tts_lightning.metrics.speech import (
    frame_limit,
    hit_frame_limit,
    max_new_tokens_for,
    speaking_rate_ratio,
    speech_seconds,
)


def _record_frames(tts) -> list[int]:
    """Wrap ``tts.model.generate`` (on this instance only) to record the frames of every generation
    (the official code cuts them at ``codec_eos``); undone by `_unwrap`."""
    frames: list[int] = []
    original = tts.model.generate

    def generate(*args, **kwargs):
        codes, hidden = original(*args, **kwargs)
        frames.extend(int(c.shape[0]) for c in codes)
        return codes, hidden

    tts.model.generate = generate
    return frames


def _unwrap(tts) -> None:
    del tts.model.generate


def _language(language: str) -> str:
    return "Auto" if language.lower() == "auto" else language


def generate_system(
    tts,
    system: str,
    plans: list[SpeakerPlan],
    *,
    paces: dict[str, float],
    num_samples: int,
    seed: int,
    limit_factor: float,
    audio_dir: Path,
    label: str | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Speak every (speaker, text, sample) with one system; the audio goes to
    ``audio_dir/<speaker>/<label>/`` (``label``: default the system's name)."""
    from tts_lightning.files import atomic_write_wav

    out: dict[str, list[dict[str, Any]]] = {}
    frames = _record_frames(tts)
    spoken = [p for p in plans if system != "zero_shot_icl" or p.reference_text]  # ICL needs a transcript
    count = sum(len(p.texts) for p in spoken) * num_samples
    print(f"evaluate: {label or system}: {count} generations ({len(spoken)} speakers) ...", flush=True)
    began = time.perf_counter()
    try:
        for plan in spoken:
            prompt = None
            if system != "fine_tuned":
                prompt = tts.create_voice_clone_prompt(
                    ref_audio=str(plan.reference),
                    ref_text=plan.reference_text,
                    x_vector_only_mode=system == "zero_shot_xvector",
                )
            gens = []
            for t, text in enumerate(plan.texts):
                limit = frame_limit(text, paces[plan.name], factor=limit_factor)
                for k in range(num_samples):
                    sample_seed = seed + 1000 * k + t  # the same for every system
                    torch.manual_seed(sample_seed)
                    kwargs = {
                        "text": text,
                        "language": _language(plan.language),
                        "max_new_tokens": max_new_tokens_for(limit),
                    }
                    started = time.perf_counter()
                    if system == "fine_tuned":
                        wavs, sr = tts.generate_custom_voice(speaker=plan.name, **kwargs)
                    else:
                        wavs, sr = tts.generate_voice_clone(voice_clone_prompt=prompt, **kwargs)
                    elapsed = time.perf_counter() - started
                    if int(sr) != SAMPLE_RATE:
                        raise EvaluationError(f"the model speaks at {sr} Hz, expected {SAMPLE_RATE}")
                    wav = np.asarray(wavs[0], dtype=np.float32).reshape(-1)
                    path = audio_dir / plan.name / (label or system) / f"text{t:02d}_sample{k}.wav"
                    atomic_write_wav(path, np.clip(wav, -1.0, 1.0), SAMPLE_RATE)  # a full disk: WriteError
                    n = frames[-1]
                    gens.append(
                        {
                            "text_index": t,
                            "sample": k,
                            "seed": sample_seed,
                            "audio": str(path),
                            "frames": n,
                            "frame_limit": limit,
                            "eos_failure": hit_frame_limit(n, limit),
                            "seconds": wav.size / SAMPLE_RATE,
                            "speech_seconds": speech_seconds(wav, SAMPLE_RATE),
                            "generation_seconds": elapsed,
                            "_wav": wav,
                        }
                    )
            out[plan.name] = gens
    finally:
        _unwrap(tts)
    print(f"evaluate: {label or system}: done in {time.perf_counter() - began:.0f} s", flush=True)
    return out


def score_speaker(
    plan: SpeakerPlan,
    generated: dict[str, dict[str, list[dict]]],
    real_audio: list[np.ndarray],
    pace: float,
    recognizer=None,
) -> dict[str, list[dict]]:
    """One speaker's generations by system, each scored in place (speaker similarity to the real
    clips, speaking-rate ratio; None for silence; with a ``recognizer``, its transcript and CER / WER
    against the text) and its audio dropped."""
    from tts_lightning.evaluation.asr import error_rates
    from tts_lightning.metrics.speaker_similarity import embed_utterances, reference_embedding

    reference = reference_embedding(real_audio, SAMPLE_RATE)
    systems: dict[str, list[dict]] = {}
    for system, per_speaker in generated.items():
        if plan.name not in per_speaker:
            continue
        gens = per_speaker[plan.name]
        for g in gens:
            wav = g.pop("_wav")
            audible = wav.size > 0 and float(np.abs(wav).max()) > 0
            g["similarity"] = (
                float(torch.nn.functional.cosine_similarity(embed_utterances([wav], SAMPLE_RATE)[0], reference, dim=0))
                if audible
                else None
            )
            ratio = speaking_rate_ratio(wav, plan.texts[g["text_index"]], SAMPLE_RATE, pace)
            g["speaking_rate_ratio"] = ratio if audible and math.isfinite(ratio) else None
            if recognizer is not None:
                g["transcript"] = recognizer.transcribe(wav, SAMPLE_RATE) if audible else ""
                g.update(error_rates(plan.texts[g["text_index"]], g["transcript"]))
        systems[system] = gens
    return systems


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
