"""What an evaluation compares: the fine-tuned model (an exported directory, or a training
checkpoint exported first), the base model, the prepared data (``prepared.json``), the speakers both
share, and for each speaker a `SpeakerPlan`: the texts it says, the reference clip the base model
clones from and the real clips its generations are scored against. `evaluate` runs the comparison.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from tts_lightning.errors import UserError
from tts_lightning.metrics.speech import seconds_per_character, text_characters
from tts_lightning.names import some_names, unknown_names

SAMPLE_RATE = 24_000
DEFAULT_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back when you get this message.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "We will meet at the station at half past nine tomorrow morning.",
)
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
            "first, or pass its cache folder (the run's data.cache_dir) with --prepared"
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


def resolve_model(
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
        hparams = CheckpointReader(path, trust=trust_checkpoint).hyper_parameters
        named_base = hparams.get("pretrained")
        if hparams.get("speaker_codec_ids") is not None:  # started from a custom_voice model: it exports
            named_base, base = None, None  # from its own start; --base is the zero-shot side only
        out = export_custom_voice(
            path, workdir / "fine_tuned", dtype=dtype, pretrained=base, trust_checkpoint=trust_checkpoint
        )
    except (CheckpointError, ExportError, PretrainedError) as exc:
        raise EvaluationError(str(exc)) from exc
    return out, "training checkpoint", None if named_base is None else str(named_base)


def resolve_base(base: str | os.PathLike | None) -> Path:
    """The base model's directory (given, or named by the checkpoint), checked to be a base model."""
    from tts_lightning.model.pretrained import PretrainedError, check_pretrained

    if base is None:
        raise EvaluationError(
            "give --base: the base model the fine-tuned one started from (an exported directory does not name it)"
        )
    try:
        return check_pretrained(base, require_type="base").path
    except PretrainedError as exc:
        raise EvaluationError(f"base model: {exc}") from exc


def choose_speakers(index: dict, index_file: Path, model_dir: Path, speakers: Sequence[str] | None) -> list[str]:
    """The speakers to evaluate: those asked for, else every speaker both the model and the data have."""
    from tts_lightning.model.pretrained import check_pretrained

    model_speakers = set(check_pretrained(model_dir).speakers)
    data_speakers = [s["name"] for s in index["speakers"]]
    available = [s for s in data_speakers if s.lower() in model_speakers]
    if speakers:
        unknown = [s for s in speakers if s not in available]
        if unknown:
            raise EvaluationError(
                f"unknown speaker(s) {unknown_names(unknown, available)}: the fine-tuned model and the data "
                f"({index_file}) share {some_names(available) or 'none'} (model: {some_names(sorted(model_speakers))}; "
                f"data: {some_names(data_speakers)})"
            )
        return list(speakers)
    if not available:
        raise EvaluationError(
            f"the fine-tuned model's speakers ({some_names(sorted(model_speakers))}) are not in the "
            f"data ({index_file}: {some_names(data_speakers)}): give the run's data, --prepared <its data.cache_dir> "
            "or --config <the config.yaml its fit saved beside its TensorBoard logs>"
        )
    return available


def load_real_clips(plans: list[SpeakerPlan]) -> tuple[dict[str, list[np.ndarray]], dict[str, float]]:
    """Each speaker's real clips (the audio the generations are scored against) and their pace
    (seconds of speech per character)."""
    from tts_lightning.data.audio import load_audio

    real_audio = {p.name: [load_audio(a, SAMPLE_RATE).numpy() for a, _ in p.real_clips] for p in plans}
    paces = {
        p.name: seconds_per_character(real_audio[p.name], [t for _, t in p.real_clips], SAMPLE_RATE) for p in plans
    }
    return real_audio, paces
