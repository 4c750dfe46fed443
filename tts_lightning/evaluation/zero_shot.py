"""Zero-shot cloning of held-out speakers, before and after fine-tuning (``evaluate --held-out``).

Fine-tuning on a few speakers can cost the model its ability to clone voices it never heard. For
each held-out speaker (named in a manifest the data module reads: JSONL, LJSpeech ``metadata.csv``
or a folder of clips; none of them a speaker of the run's data), the speaker's first clip is the
reference (its audio and transcript) and the speaker's other clips are what the clones are scored
against; a speaker with one clip is scored against its reference (similarity then rewards copying
that clip, but before and after are still compared on the same footing).

- ``before``: the starting Base model (``--base``) clones the reference through the official
  ``Qwen3TTSModel.generate_voice_clone`` in ICL mode (reference audio and transcript in the prompt);
- ``after``: the same with the fine-tuned model's weights (`load_fine_tuned_base`): a run from a
  Base model exports as ``custom_voice``, which has no speaker encoder and which
  ``generate_voice_clone`` refuses, so its weights are loaded into the Base model, whose speaker
  encoder is the run's own (training freezes it by default, `tts_lightning.model.parameters`).

Both speak the same texts (the evaluation's, at most ``max_texts``) with the same seeds, so with
unchanged weights after equals before sample for sample. Each clone is scored like the evaluation's
other generations (`score_speaker`) and after is compared with before by the report's paired tests.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tts_lightning.evaluation.inputs import EvaluationError, SpeakerPlan, load_real_clips
from tts_lightning.evaluation.speak import free_memory, generate_system, score_speaker
from tts_lightning.metrics.speech import text_characters
from tts_lightning.model.synthesis import load_tts

WHEN = ("before", "after")
DEFAULT_SPEAKER = "held_out"  # a folder of clips without speaker sub-folders


def read_held_out(path: str | os.PathLike, training_speakers: Sequence[str]) -> list[SpeakerPlan]:
    """One `SpeakerPlan` per held-out speaker of the manifest at ``path`` (texts left to the caller):
    reference = its first clip, real clips = its other clips (else the reference). One clear error
    naming the file for anything that cannot be cloned or scored."""
    from tts_lightning.data.manifest import ManifestEncodingError, load_manifest

    path = Path(path).expanduser()
    try:
        manifest = load_manifest(path, DEFAULT_SPEAKER)
    except (FileNotFoundError, ManifestEncodingError, ValueError) as exc:
        raise EvaluationError(f"--held-out: {exc}") from None
    if manifest.rejected:
        r = manifest.rejected[0]
        raise EvaluationError(f"--held-out {path}: {r.source}: {r.detail}; fix or remove the entry")
    by_speaker: dict[str, list] = {}
    for record in manifest.records:
        by_speaker.setdefault(record.speaker, []).append(record)
    if not by_speaker:
        raise EvaluationError(f"--held-out {path}: no clips in it")
    trained = {s.lower() for s in training_speakers}
    clash = sorted(s for s in by_speaker if s.lower() in trained)
    if clash:
        raise EvaluationError(
            f"--held-out {path}: speaker(s) {clash} are in the run's data, so not held out; name other speakers"
        )
    for record in manifest.records:
        if not text_characters(record.text):
            raise EvaluationError(f"--held-out {path}: {record.source}: needs a transcript (the ICL prompt's)")
        if not record.audio.is_file():
            raise EvaluationError(f"--held-out {path}: {record.source}: audio {record.audio} does not exist")
    return [
        SpeakerPlan(
            name=name,
            language=records[0].language,
            reference=records[0].audio,
            reference_text=records[0].text,
            real_clips=[(r.audio, r.text) for r in (records[1:] or records)],
            held_out=len(records) > 1,
            texts=[],
        )
        for name, records in by_speaker.items()
    ]


def check_started_from_base(model_dir: Path, base_dir: Path, data_speakers: Sequence[str]) -> None:
    """Refuse a fine-tuned model with speakers neither the base model's nor the data's: the built-in
    speakers of a CustomVoice start, which had no zero-shot cloning to compare with."""
    from tts_lightning.model.pretrained import check_pretrained

    known = set(check_pretrained(base_dir).speakers) | {s.lower() for s in data_speakers}
    built_in = sorted(set(check_pretrained(model_dir).speakers) - known)
    if built_in:
        raise EvaluationError(
            f"--held-out: the fine-tuned model {model_dir} has built-in speakers {built_in}, so it started from a "
            "CustomVoice model, which cannot clone; held-out cloning needs a run from a Base model"
        )


def load_fine_tuned_base(model_dir: Path, base_dir: Path, device: str, dtype: torch.dtype):
    """The Base model at ``base_dir`` (its config, processor and speaker encoder) with every other
    weight read from ``model_dir`` (a ``custom_voice`` export of the run): a model
    ``generate_voice_clone`` accepts. The new speakers' ``codec_embedding`` rows come along; ICL
    never reads them (its prompt holds the reference's x-vector and codes, not a speaker id, and
    generation suppresses the top 1024 codec ids but ``codec_eos``, where those rows sit)."""
    from tts_lightning.model.loading import WeightReader
    from tts_lightning.model.pretrained import check_pretrained

    tts = load_tts(base_dir, device, dtype)
    state = tts.model.state_dict()
    reader = WeightReader(check_pretrained(model_dir))
    wanted = {k for k in state if not k.startswith("speaker_encoder.")}
    have = {k for k in reader.keys() if not k.startswith("speaker_encoder.")}
    if have != wanted:
        missing, extra = sorted(wanted - have)[:3], sorted(have - wanted)[:3]
        raise EvaluationError(
            f"{model_dir}'s weights do not fit the base model {base_dir} (missing {missing}, extra {extra}): "
            "give the --base the run started from"
        )
    with torch.no_grad():
        for key in sorted(wanted):  # one tensor at a time: memory stays near one model
            value = reader.read(key)
            if value.shape != state[key].shape:
                raise EvaluationError(
                    f"{model_dir}: {key} is {tuple(value.shape)}, the base model {base_dir} has "
                    f"{tuple(state[key].shape)}: give the --base the run started from"
                )
            state[key].copy_(value)
    return tts


def clone_before_after(
    model_dir: Path,
    base_dir: Path,
    plans: list[SpeakerPlan],
    *,
    device: str,
    torch_dtype: torch.dtype,
    **common: Any,
) -> tuple[dict[str, dict[str, list[dict]]], dict[str, list[np.ndarray]], dict[str, float]]:
    """ICL clones of every held-out speaker by the Base model (before) and by the fine-tuned weights
    in it (after), one model in memory at a time; with the speakers' real clips and pace, what
    `zero_shot_result` scores them with. ``common``: `generate_system`'s settings but ``paces``;
    the audio goes to ``<audio_dir>/<speaker>/zero_shot_before|zero_shot_after/``."""
    real_audio, paces = load_real_clips(plans)
    generated: dict[str, dict[str, list[dict]]] = {}
    for when in WHEN:
        if when == "before":
            tts = load_tts(base_dir, device, torch_dtype)
        else:
            tts = load_fine_tuned_base(model_dir, base_dir, device, torch_dtype)
        label = f"zero_shot_{when}"
        generated[when] = generate_system(tts, "zero_shot_icl", plans, paces=paces, label=label, **common)
        del tts
        free_memory(device)
    return generated, real_audio, paces


def zero_shot_result(
    source: str | os.PathLike,
    plans: list[SpeakerPlan],
    generated: dict[str, dict[str, list[dict]]],
    real_audio: dict[str, list[np.ndarray]],
    paces: dict[str, float],
    *,
    alpha: float,
    recognizer=None,
) -> dict[str, Any]:
    """What ``evaluation.json`` holds under ``zero_shot``: per held-out speaker its reference, the clips
    it is scored against, before and after summarized, and after compared with before (Δ = after -
    before over the same (text, seed) pairs)."""
    from tts_lightning.evaluation.report import comparisons, summarize

    speakers = {}
    for plan in plans:
        systems = score_speaker(plan, generated, real_audio[plan.name], paces[plan.name], recognizer)
        speakers[plan.name] = {
            "language": plan.language,
            "reference": str(plan.reference),
            "reference_text": plan.reference_text,
            "real_clips": [str(a) for a, _ in plan.real_clips],
            "real_clips_are_reference": not plan.held_out,
            "seconds_per_character": paces[plan.name],
            "texts": plan.texts,
            "summary": {w: summarize(systems[w]) for w in WHEN},
            "comparison": comparisons(systems, "after", alpha=alpha)["before"],
            "generations": {w: systems[w] for w in WHEN},
        }
    return {"held_out": str(source), "mode": "icl", "speakers": speakers}
