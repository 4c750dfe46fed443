"""Did fine-tuning help? The fine-tuned voice against the base model's zero-shot cloning.

For each speaker, a fixed set of texts (the speaker's validation transcripts, else `DEFAULT_TEXTS`,
or the caller's) is spoken ``num_samples`` times, with the same seeds, by

- ``fine_tuned``: the fine-tuned model, an exported ``custom_voice`` directory or a training
  checkpoint (full file or sharded folder; exported to a temporary directory first), through the
  official ``Qwen3TTSModel.generate_custom_voice``;
- ``zero_shot_xvector`` and ``zero_shot_icl``: the base model cloning the speaker from the same
  reference clip (the first of the speaker's reference clips in the prepared index), through the
  official ``generate_voice_clone`` in x-vector-only mode and in ICL mode with the reference's
  transcript.

Every generation is scored on the speaker's real clips (the validation clips when there are any,
else the speaker's other clips): speaker similarity (resemblyzer), speaking-rate ratio (seconds of
speech per character over the real clips'), end-of-speech failure (no ``codec_eos`` within a limit
set from the text's length and the speaker's pace), duration and real-time factor. The result is
``evaluation.json``, ``evaluation.md`` (the table with verdicts) and the audio under ``audio/``.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from tts_lightning.errors import UserError
from tts_lightning.metrics.speech import (
    DEFAULT_LIMIT_FACTOR,
    frame_limit,
    hit_frame_limit,
    max_new_tokens_for,
    seconds_per_character,
    speaking_rate_ratio,
    speech_seconds,
    text_characters,
)

SAMPLE_RATE = 24_000
DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back when you get this message.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "We will meet at the station at half past nine tomorrow morning.",
)
SYSTEMS = ("fine_tuned", "zero_shot_xvector", "zero_shot_icl")
Dtype = Literal["bf16", "fp16", "fp32"]


class EvaluationError(UserError, ValueError):
    """The inputs of an evaluation are missing, of the wrong kind or do not match each other."""


@dataclass
class SpeakerPlan:
    name: str
    language: str
    reference: Path  # the clip the base model clones from
    reference_text: str | None  # its transcript (ICL); None when the index does not have it
    real_clips: list[tuple[Path, str]]  # (audio, transcript) the generations are scored against
    held_out: bool  # real_clips are validation clips (not trained on)
    texts: list[str]


def read_prepared(path: str | os.PathLike) -> tuple[Path, dict]:
    """``prepared.json`` (the file, or the cache folder holding it) as the data module wrote it."""
    path = Path(path).expanduser()
    file = path / "prepared.json" if path.is_dir() else path
    if not file.is_file():
        raise EvaluationError(
            f"no prepared data index at {file}: run `tts-lightning prepare --config ...` for the run's data "
            "first, or pass its cache folder (data.cache_dir)"
        )
    try:
        index = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise EvaluationError(f"{file} is not valid JSON ({exc})") from exc
    if not isinstance(index, dict) or "speakers" not in index or "clips" not in index:
        raise EvaluationError(f"{file} is not a tts-lightning prepared index (no speakers / clips)")
    return file, index


def plan_speakers(
    index: dict, speakers: Sequence[str], *, texts: Sequence[str] | None = None, max_texts: int = 4
) -> list[SpeakerPlan]:
    """What each speaker says and what it is compared with, from the prepared index."""
    from tts_lightning.data.predict import speaker_languages

    languages = speaker_languages(index)
    by_path = {str(c["audio"]): c for c in index["clips"]}
    entries = {s["name"]: s for s in index["speakers"]}
    plans = []
    for name in speakers:
        entry = entries[name]
        clips = [c for c in index["clips"] if c["speaker"] == name]
        references = [Path(r) for r in entry.get("references") or []]
        if not references:
            raise EvaluationError(f"speaker {name!r} has no reference clip in the prepared index")
        reference = references[0]
        ref_clip = by_path.get(str(reference))
        val = [c for c in clips if c.get("split") == "val"]
        ref_paths = {str(r) for r in references}
        real = val or [c for c in clips if str(c["audio"]) not in ref_paths] or clips
        if texts:
            chosen = list(texts)
            empty = [t for t in chosen if not text_characters(t)]
            if empty:
                raise EvaluationError(f"texts without letters or digits cannot be judged: {empty}")
        else:
            chosen = [c["text"] for c in val] or list(DEFAULT_TEXTS)
        plans.append(
            SpeakerPlan(
                name=name,
                language=languages.get(name, "auto"),
                reference=reference,
                reference_text=None if ref_clip is None else ref_clip["text"],
                real_clips=[(Path(c["audio"]), c["text"]) for c in real],
                held_out=bool(val),
                texts=chosen[:max_texts],
            )
        )
    return plans


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


def _load(path: Path, device: str, dtype: torch.dtype):
    from qwen_tts import Qwen3TTSModel

    return Qwen3TTSModel.from_pretrained(str(path), device_map=device, dtype=dtype, attn_implementation="sdpa")


def _language(language: str) -> str:
    return "Auto" if language.lower() == "auto" else language


def _generate_system(
    tts,
    system: str,
    plans: list[SpeakerPlan],
    *,
    paces: dict[str, float],
    num_samples: int,
    seed: int,
    limit_factor: float,
    audio_dir: Path,
) -> dict[str, list[dict[str, Any]]]:
    """Speak every (speaker, text, sample) with one system; the audio goes to ``audio_dir``."""
    from tts_lightning.files import atomic_write_wav

    out: dict[str, list[dict[str, Any]]] = {}
    frames = _record_frames(tts)
    try:
        for plan in plans:
            if system == "zero_shot_icl" and not plan.reference_text:
                continue  # no transcript of the reference: ICL is not possible
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
                    path = audio_dir / plan.name / system / f"text{t:02d}_sample{k}.wav"
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
    return out


def _resolve_model(
    model: str | os.PathLike, workdir: Path, *, base: str | os.PathLike | None, dtype: Dtype, trust_checkpoint: bool
) -> tuple[Path, str, str | None]:
    """(a custom_voice directory, what it is, the base the checkpoint names)."""
    from tts_lightning.model.checkpoint import CheckpointError, CheckpointReader
    from tts_lightning.model.pretrained import PretrainedError, check_pretrained

    path = Path(model).expanduser()
    if not path.exists():
        raise EvaluationError(
            f"model {path} does not exist: give an exported directory (`tts-lightning export`) "
            "or a training checkpoint (a .ckpt file or a sharded checkpoint folder)"
        )
    if path.is_dir() and (path / "config.json").is_file():
        try:
            info = check_pretrained(path)
        except PretrainedError as exc:
            raise EvaluationError(str(exc)) from exc
        if info.tts_model_type != "custom_voice":
            raise EvaluationError(
                f"{path} is a {info.tts_model_type!r} model; the fine-tuned model must be a "
                "custom_voice directory (`tts-lightning export`) or a training checkpoint"
            )
        return info.path, "exported directory", None
    from tts_lightning.model.export import ExportError, export_custom_voice

    try:
        named_base = CheckpointReader(path, trust=trust_checkpoint).hyper_parameters.get("pretrained")
        out = export_custom_voice(
            path, workdir / "fine_tuned", dtype=dtype, pretrained=base, trust_checkpoint=trust_checkpoint
        )
    except (CheckpointError, ExportError, PretrainedError) as exc:
        raise EvaluationError(str(exc)) from exc
    return out, "training checkpoint", None if named_base is None else str(named_base)


def evaluate(
    model: str | os.PathLike,
    prepared: str | os.PathLike,
    out: str | os.PathLike,
    *,
    base: str | os.PathLike | None = None,
    speakers: Sequence[str] | None = None,
    texts: Sequence[str] | None = None,
    max_texts: int = 4,
    num_samples: int = 2,
    seed: int = 0,
    limit_factor: float = DEFAULT_LIMIT_FACTOR,
    icl: bool = True,
    device: str | None = None,
    dtype: Dtype | None = None,
    trust_checkpoint: bool = False,
) -> dict[str, Any]:
    """Run the comparison; write ``evaluation.json``, ``evaluation.md`` and ``audio/`` under ``out``;
    return the result (what the JSON holds)."""
    from tts_lightning.evaluation.report import comparisons, markdown_table, summarize
    from tts_lightning.files import WriteError, atomic_write, atomic_write_json, storage_error
    from tts_lightning.metrics.speaker_similarity import embed_utterances, reference_embedding, similarity_unavailable
    from tts_lightning.model.pretrained import PretrainedError, check_pretrained

    if num_samples < 1:
        raise EvaluationError(f"num_samples must be >= 1, got {num_samples}")
    if max_texts < 1:
        raise EvaluationError(f"max_texts must be >= 1, got {max_texts}")
    reason = similarity_unavailable()
    if reason is not None:
        raise EvaluationError(f"speaker similarity is needed: {reason}")
    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bf16" if device.startswith("cuda") else "fp32")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    index_file, index = read_prepared(prepared)
    out = Path(out).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix=".evaluate-", dir=out))
    except OSError as exc:  # a full disk or a folder that cannot be written: one message
        cause = storage_error(exc)
        if cause is None:
            raise
        raise WriteError(out, cause) from exc
    try:
        model_dir, model_kind, named_base = _resolve_model(
            model, workdir, base=base, dtype=dtype, trust_checkpoint=trust_checkpoint
        )
        base = base if base is not None else named_base
        if base is None:
            raise EvaluationError(
                "give --base: the base model the fine-tuned one started from (an exported directory does not name it)"
            )
        try:
            base_info = check_pretrained(base, require_type="base")
        except PretrainedError as exc:
            raise EvaluationError(f"base model: {exc}") from exc
        model_speakers = set(check_pretrained(model_dir).speakers)
        data_speakers = [s["name"] for s in index["speakers"]]
        available = [s for s in data_speakers if s.lower() in model_speakers]
        if speakers:
            unknown = [s for s in speakers if s not in available]
            if unknown:
                raise EvaluationError(
                    f"unknown speaker(s) {unknown}: the fine-tuned model and the data ({index_file}) share "
                    f"{available or 'none'} (model: {sorted(model_speakers)}, data: {data_speakers})"
                )
            chosen = list(speakers)
        else:
            chosen = available
            if not chosen:
                raise EvaluationError(
                    f"the fine-tuned model's speakers {sorted(model_speakers)} are not in the "
                    f"data ({index_file}: {data_speakers})"
                )
        plans = plan_speakers(index, chosen, texts=texts, max_texts=max_texts)

        from tts_lightning.data.audio import load_audio

        real_audio = {p.name: [load_audio(a, SAMPLE_RATE).numpy() for a, _ in p.real_clips] for p in plans}
        paces = {
            p.name: seconds_per_character(real_audio[p.name], [t for _, t in p.real_clips], SAMPLE_RATE) for p in plans
        }

        generated: dict[str, dict[str, list[dict]]] = {}
        audio_dir = out / "audio"
        common: dict[str, Any] = dict(
            paces=paces, num_samples=num_samples, seed=seed, limit_factor=limit_factor, audio_dir=audio_dir
        )
        tts = _load(model_dir, device, torch_dtype)
        generated["fine_tuned"] = _generate_system(tts, "fine_tuned", plans, **common)
        del tts
        _free(device)
        tts = _load(base_info.path, device, torch_dtype)
        generated["zero_shot_xvector"] = _generate_system(tts, "zero_shot_xvector", plans, **common)
        if icl:
            generated["zero_shot_icl"] = _generate_system(tts, "zero_shot_icl", plans, **common)
        del tts
        _free(device)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    result: dict[str, Any] = {
        "model": str(model),
        "model_kind": model_kind,
        "base": str(base_info.path),
        "prepared": str(index_file),
        "settings": {
            "num_samples": num_samples,
            "seed": seed,
            "limit_factor": limit_factor,
            "device": device,
            "dtype": dtype,
            "max_texts": max_texts,
        },
        "speakers": {},
    }
    for plan in plans:
        reference = reference_embedding(real_audio[plan.name], SAMPLE_RATE)
        systems: dict[str, list[dict]] = {}
        for system, per_speaker in generated.items():
            if plan.name not in per_speaker:
                continue
            gens = per_speaker[plan.name]
            for g in gens:
                wav = g.pop("_wav")
                audible = wav.size > 0 and float(np.abs(wav).max()) > 0
                g["similarity"] = (
                    float(
                        torch.nn.functional.cosine_similarity(embed_utterances([wav], SAMPLE_RATE)[0], reference, dim=0)
                    )
                    if audible
                    else None
                )
                ratio = speaking_rate_ratio(wav, plan.texts[g["text_index"]], SAMPLE_RATE, paces[plan.name])
                g["speaking_rate_ratio"] = ratio if audible and math.isfinite(ratio) else None
            systems[system] = gens
        result["speakers"][plan.name] = {
            "language": plan.language,
            "reference": str(plan.reference),
            "reference_text": plan.reference_text,
            "real_clips": [str(a) for a, _ in plan.real_clips],
            "real_clips_held_out": plan.held_out,
            "seconds_per_character": paces[plan.name],
            "texts": plan.texts,
            "summary": {s: summarize(g) for s, g in systems.items()},
            "comparison": comparisons(systems),
            "generations": systems,
        }
    atomic_write_json(out / "evaluation.json", result)
    table = markdown_table(result)
    atomic_write(out / "evaluation.md", lambda fh: fh.write(table), binary=False)
    result["table"] = table
    return result


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
