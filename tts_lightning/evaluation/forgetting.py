"""Forgetting, measured: the built-in speakers' teacher-forced loss on the replay records, before and after.

The replay records (`tts_lightning.data.replay`) are what the starting ``custom_voice`` model said
with each built-in speaker. Their loss under the training loss (`tts_lightning.model.loss`, the
layout ``generate_custom_voice`` reads: the speaker's own codec row) is scored with the starting
model ("before") and with the fine-tuned one ("after"); "difference" is after minus before, so a
positive value is forgetting. ``loss`` = talker loss + 0.3 x code-predictor loss (the default
``sub_talker_loss_weight``), each the mean over the speaker's targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tts_lightning.data.replay import ReplayRecord, read_pointer, read_records

LOSS_WEIGHT = 0.3  # the module's default sub_talker_loss_weight


def replay_losses(
    model_dir: str | Path, records: Sequence[ReplayRecord], cache_dir: Path, *, device: str = "cpu"
) -> dict[str, dict[str, float]]:
    """Per built-in speaker of ``records`` that ``model_dir`` has: its loss on its records (fp32)."""
    from tts_lightning.data.codec_cache import load_codes
    from tts_lightning.model.custom_voice import built_in_speakers
    from tts_lightning.model.loading import MetaWeights, build_empty_model
    from tts_lightning.model.loss import compute_loss
    from tts_lightning.model.pretrained import check_pretrained, load_text_tokenizer
    from tts_lightning.model.sequence import SpecialIds, build_custom_voice_sequence, collate, tokenize_text

    info = check_pretrained(model_dir)
    rows = built_in_speakers(info.config["talker_config"])
    model = build_empty_model(info)
    MetaWeights(model, info).materialize_all(model, device=device)
    model.eval()
    ids, tokenizer = SpecialIds.from_config(info.config), load_text_tokenizer(info)
    hidden = int(info.config["talker_config"]["hidden_size"])
    out: dict[str, dict[str, float]] = {}
    for speaker in sorted({r.speaker for r in records if r.speaker.lower() in rows}):
        mine = [r for r in records if r.speaker == speaker]
        sequences = [
            build_custom_voice_sequence(
                ids,
                tokenize_text(tokenizer, r.text),
                load_codes(cache_dir / r.codes),
                speaker_id=rows[speaker.lower()],
                language=r.language,
            )
            for r in mine
        ]
        batch = collate(sequences, torch.zeros(len(mine), hidden), list(range(len(mine))), pad_text_id=ids.tts_pad)
        with torch.no_grad():
            loss = compute_loss(model.talker, batch.to(device), LOSS_WEIGHT)
        out[speaker] = {
            "loss": float(loss.loss),
            "talker_loss": float(loss.talker_loss),
            "code_predictor_loss": float(loss.code_predictor_loss),
            "records": len(mine),
        }
    del model
    return out


def measure_forgetting(cache_dir: Path, model_dir: str | Path, *, device: str = "cpu") -> dict[str, Any] | None:
    """Before / after / difference per built-in speaker, on the replay records last prepared in
    ``cache_dir`` (None when replay was never prepared there). The starting model is the one that
    spoke the records."""
    folder = read_pointer(cache_dir)
    if folder is None:
        return None
    header, records = read_records(folder)
    before = replay_losses(header["pretrained"], records, cache_dir, device=device)
    after = replay_losses(model_dir, records, cache_dir, device=device)
    speakers = {
        name: {"before": before[name], "after": after[name], "difference": after[name]["loss"] - before[name]["loss"]}
        for name in before
        if name in after
    }
    return {"start": header["pretrained"], "records": str(folder), "loss_weight": LOSS_WEIGHT, "speakers": speakers}


def forgetting_table(forgetting: dict[str, Any]) -> str:
    """The Markdown table of `measure_forgetting`'s result."""
    lines = [
        "",
        "Forgetting: built-in speakers' teacher-forced loss on the replay records (starting model's speech)",
        "",
        "| built-in speaker | records | loss before | loss after | Δ (after - before) | similarity after/before |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in forgetting["speakers"].items():
        before, after = s["before"], s["after"]
        scores = [g["similarity"] for g in s.get("samples", []) if g["similarity"] is not None]
        similarity = f"{sum(scores) / len(scores):.3f}" if scores else "n/a"  # the mean over the records heard
        lines.append(
            f"| {name} | {before['records']} | {before['loss']:.4f} | {after['loss']:.4f} | {s['difference']:+.4f} "
            f"| {similarity} |"
        )
    lines += ["", "Δ > 0: the fine-tuned model fits the starting model's speech worse (forgetting)."]
    return "\n".join(lines) + "\n"
