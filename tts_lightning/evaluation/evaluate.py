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
What is compared (the models, the data, the speakers and their texts) is found by
`tts_lightning.evaluation.inputs`; generating and scoring is `tts_lightning.evaluation.speak`. With
``held_out`` (speakers not in the data), their zero-shot cloning before and after fine-tuning is
added (`tts_lightning.evaluation.zero_shot`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tts_lightning.evaluation.inputs import (
    SAMPLE_RATE,
    Dtype,
    EvaluationError,
    SpeakerPlan,
    choose_speakers,
    load_real_clips,
    plan_speakers,
    read_prepared,
    resolve_base,
    resolve_model,
)
from tts_lightning.evaluation.speak import free_memory, generate_system, score_speaker
from tts_lightning.metrics.speech import DEFAULT_LIMIT_FACTOR
from tts_lightning.model.export import DTYPES
from tts_lightning.model.synthesis import default_dtype, load_tts


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
    alpha: float = 0.05,
    asr: str | None = None,
    device: str | None = None,
    dtype: Dtype | None = None,
    trust_checkpoint: bool = False,
    held_out: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Run the comparison; write ``evaluation.json``, ``evaluation.md`` and ``audio/`` under ``out``;
    return the result (what the JSON holds). ``held_out``: a manifest of speakers not in the data,
    cloned zero-shot before and after fine-tuning (`tts_lightning.evaluation.zero_shot`)."""
    _check_settings(num_samples=num_samples, max_texts=max_texts, alpha=alpha)
    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    resolved: Dtype = dtype or default_dtype(device)
    torch_dtype = DTYPES[resolved]
    index_file, index = read_prepared(prepared)
    held_plans, cloned = None, None
    if held_out is not None:  # read before any model loads: a bad file fails at once
        from tts_lightning.evaluation.zero_shot import read_held_out

        held_plans = read_held_out(held_out, [s["name"] for s in index["speakers"]])
    out = Path(out).expanduser()
    workdir = _make_workdir(out)
    try:
        model_dir, model_kind, named_base = resolve_model(
            model, workdir, base=base, dtype=resolved, trust_checkpoint=trust_checkpoint
        )
        base_dir = resolve_base(base if base is not None else named_base)
        if held_plans is not None:
            from tts_lightning.evaluation.zero_shot import check_started_from_base

            check_started_from_base(model_dir, base_dir, [s["name"] for s in index["speakers"]])
        chosen = choose_speakers(index, index_file, model_dir, speakers)
        plans = plan_speakers(index, chosen, texts=texts, max_texts=max_texts)
        real_audio, paces = load_real_clips(plans)
        for held in held_plans or []:  # the evaluation's texts, the first max_texts of them
            held.texts = list(dict.fromkeys(t for p in plans for t in p.texts))[:max_texts]
        from tts_lightning.evaluation.forgetting import measure_forgetting

        forgetting = measure_forgetting(index_file.parent, model_dir, device=device)  # None without replay
        common: dict[str, Any] = {"num_samples": num_samples, "seed": seed, "limit_factor": limit_factor}
        common.update(audio_dir=out / "audio", device=device, torch_dtype=torch_dtype)
        _drop_reports(out)  # the audio they describe is rewritten now: a stopped run leaves none that lies
        generated = _generate_all(model_dir, base_dir, plans, forgetting=forgetting, icl=icl, paces=paces, **common)
        if held_plans is not None:
            from tts_lightning.evaluation.zero_shot import clone_before_after

            cloned = clone_before_after(model_dir, base_dir, held_plans, **common)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    result: dict[str, Any] = {
        "model": str(model),
        "model_kind": model_kind,
        "base": str(base_dir),
        "prepared": str(index_file),
        "settings": {
            "num_samples": num_samples,
            "seed": seed,
            "limit_factor": limit_factor,
            "device": device,
            "dtype": resolved,
            "max_texts": max_texts,
            "alpha": alpha,
            "asr": asr,
        },
        "speakers": {},
    }
    if forgetting is not None:
        result["forgetting"] = forgetting
    recognizer = None
    if asr is not None:  # after generation: one model in memory at a time
        from tts_lightning.evaluation.asr import make_recognizer

        recognizer = make_recognizer(asr, device=device)
    for plan in plans:
        systems = score_speaker(plan, generated, real_audio[plan.name], paces[plan.name], recognizer)
        result["speakers"][plan.name] = _speaker_result(plan, systems, paces[plan.name], alpha)
    if len(result["speakers"]) > 1:
        from tts_lightning.evaluation.report import pooled

        result["all_speakers"] = pooled(result["speakers"], alpha=alpha)
    if held_plans is not None and cloned is not None:
        from tts_lightning.evaluation.zero_shot import zero_shot_result

        result["zero_shot"] = zero_shot_result(str(held_out), held_plans, *cloned, alpha=alpha, recognizer=recognizer)
    _write_outputs(out, result)
    return result


def _check_settings(*, num_samples: int, max_texts: int, alpha: float) -> None:
    """Refuse what cannot be evaluated before anything is read or loaded."""
    from tts_lightning.metrics.speaker_similarity import similarity_unavailable

    if num_samples < 1:
        raise EvaluationError(f"num_samples must be >= 1, got {num_samples}")
    if max_texts < 1:
        raise EvaluationError(f"max_texts must be >= 1, got {max_texts}")
    if not 0 < alpha < 1:
        raise EvaluationError(f"alpha (--alpha, the significance level of a verdict) must be in (0, 1), got {alpha}")
    reason = similarity_unavailable()
    if reason is not None:
        raise EvaluationError(f"speaker similarity is needed: {reason}")


REPORTS = ("evaluation.json", "evaluation.md", "evaluation.html")


def _drop_reports(out: Path) -> None:
    for name in REPORTS:
        (out / name).unlink(missing_ok=True)


def _make_workdir(out: Path) -> Path:
    """``out`` made, and a temporary folder inside it (for a checkpoint's export); those a killed
    run left (no cleanup after SIGKILL) are removed."""
    from tts_lightning.files import WriteError, storage_error

    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob(".evaluate-*"):
            shutil.rmtree(stale, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=".evaluate-", dir=out))
    except OSError as exc:  # a full disk or a folder that cannot be written: one message
        cause = storage_error(exc)
        if cause is None:
            raise
        raise WriteError(out, cause) from exc


def _generate_all(
    model_dir: Path,
    base_dir: Path,
    plans: list[SpeakerPlan],
    *,
    forgetting: dict[str, Any] | None,
    icl: bool,
    device: str,
    torch_dtype: torch.dtype,
    **common: Any,
) -> dict[str, dict[str, list[dict]]]:
    """Every system's generations: the fine-tuned model's (and, with ``forgetting``, its built-in
    speakers' replay texts, `speak_built_in`), then the base model's (x-vector, then ICL when
    ``icl``), one model in memory at a time. ``common``: `generate_system`'s settings."""
    generated: dict[str, dict[str, list[dict]]] = {}
    tts = load_tts(model_dir, device, torch_dtype)
    generated["fine_tuned"] = generate_system(tts, "fine_tuned", plans, **common)
    if forgetting is not None:
        from tts_lightning.evaluation.built_in import speak_built_in

        speak_built_in(tts, forgetting, common["audio_dir"], device=device)
    del tts
    free_memory(device)
    tts = load_tts(base_dir, device, torch_dtype)
    generated["zero_shot_xvector"] = generate_system(tts, "zero_shot_xvector", plans, **common)
    if icl:
        generated["zero_shot_icl"] = generate_system(tts, "zero_shot_icl", plans, **common)
    del tts
    free_memory(device)
    return generated


def _speaker_result(plan: SpeakerPlan, systems: dict[str, list[dict]], pace: float, alpha: float) -> dict[str, Any]:
    """What ``evaluation.json`` holds for one speaker: its plan, each system's summary, the comparisons."""
    from tts_lightning.evaluation.report import comparisons, summarize

    return {
        "language": plan.language,
        "reference": str(plan.reference),
        "reference_text": plan.reference_text,
        "real_clips": [str(a) for a, _ in plan.real_clips],
        "real_clips_held_out": plan.held_out,
        "seconds_per_character": pace,
        "texts": plan.texts,
        "summary": {s: summarize(g) for s, g in systems.items()},
        "comparison": comparisons(systems, alpha=alpha),
        "generations": systems,
    }


def _write_outputs(out: Path, result: dict[str, Any]) -> None:
    """``evaluation.json``, ``evaluation.md`` (the table, also put in ``result["table"]``) and
    ``evaluation.html`` (the page to listen and see)."""
    from tts_lightning.evaluation.html_report import evaluation_html
    from tts_lightning.evaluation.report import markdown_table
    from tts_lightning.files import atomic_write, atomic_write_json

    atomic_write_json(out / "evaluation.json", result)
    table = markdown_table(result)
    if "forgetting" in result:
        from tts_lightning.evaluation.forgetting import forgetting_table

        table += forgetting_table(result["forgetting"])
    if "zero_shot" in result:
        from tts_lightning.evaluation.report import zero_shot_table

        table += zero_shot_table(result["zero_shot"])
    atomic_write(out / "evaluation.md", lambda fh: fh.write(table), binary=False)
    page = evaluation_html(result, SAMPLE_RATE)
    atomic_write(out / "evaluation.html", lambda fh: fh.write(page), binary=False)
    result["table"] = table
