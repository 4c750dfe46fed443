"""Summaries, verdicts and the markdown table of an evaluation (pure functions on numbers)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

SYSTEM_LABELS = {
    "fine_tuned": "fine-tuned",
    "zero_shot_xvector": "zero-shot x-vector",
    "zero_shot_icl": "zero-shot ICL",
}
# A difference counts when it is larger than this many standard errors of the difference.
NOISE_Z = 2.0


def mean_sd(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the finite values (None when there are none)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None, None
    m = sum(finite) / len(finite)
    sd = math.sqrt(sum((v - m) ** 2 for v in finite) / (len(finite) - 1)) if len(finite) > 1 else 0.0
    return m, sd


def compare(ours: Sequence[float | None], theirs: Sequence[float | None], *, higher_is_better: bool) -> dict[str, Any]:
    """Difference of means (ours - theirs), its standard error from the spread of both, and a
    verdict: "better" / "worse" when the difference exceeds `NOISE_Z` standard errors in the
    good / bad direction, else "within noise"."""
    a = [float(v) for v in ours if v is not None and math.isfinite(v)]
    b = [float(v) for v in theirs if v is not None and math.isfinite(v)]
    if not a or not b:
        return {"difference": None, "noise": None, "verdict": "n/a"}
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    assert ma is not None and sa is not None and mb is not None and sb is not None  # a and b are finite
    diff = ma - mb
    noise = NOISE_Z * math.sqrt(sa**2 / len(a) + sb**2 / len(b))
    if abs(diff) <= noise or diff == 0:
        verdict = "within noise"
    else:
        verdict = "better" if (diff > 0) == higher_is_better else "worse"
    return {"difference": diff, "noise": noise, "verdict": verdict}


# metric key -> (per-generation value, higher is better, label)
COMPARED = {
    "speaker_similarity": ("similarity", True, "speaker similarity"),
    "pace_error": ("pace_error", False, "pace error |log rate ratio|"),
    "eos_failure_rate": ("eos_failure", False, "end-of-speech failures"),
}


def pace_error(ratio: float | None) -> float | None:
    """Distance from the speaker's pace, symmetric in faster and slower: |log(ratio)|."""
    if ratio is None or not math.isfinite(ratio) or ratio <= 0:
        return None
    return abs(math.log(ratio))


def summarize(generations: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-system numbers over its generations."""
    sim_m, sim_sd = mean_sd([g["similarity"] for g in generations])
    rate_m, rate_sd = mean_sd([g["speaking_rate_ratio"] for g in generations])
    dur_m, _ = mean_sd([g["seconds"] for g in generations])
    failures = sum(1 for g in generations if g["eos_failure"])
    seconds = sum(g["seconds"] for g in generations)
    wall = sum(g["generation_seconds"] for g in generations)
    return {
        "generations": len(generations),
        "speaker_similarity": {"mean": sim_m, "sd": sim_sd},
        "speaking_rate_ratio": {"mean": rate_m, "sd": rate_sd},
        "eos_failures": failures,
        "eos_failure_rate": failures / len(generations) if generations else None,
        "mean_seconds": dur_m,
        "real_time_factor": wall / seconds if seconds > 0 else None,
    }


def comparisons(systems: dict[str, list[dict[str, Any]]], ours: str = "fine_tuned") -> dict[str, dict]:
    """Our system against every other one, metric by metric."""
    out: dict[str, dict] = {}
    for other, gens in systems.items():
        if other == ours:
            continue
        out[other] = {}
        for key, (field, higher, _) in COMPARED.items():
            a = [_value(g, field) for g in systems[ours]]
            b = [_value(g, field) for g in gens]
            out[other][key] = compare(a, b, higher_is_better=higher)
    return out


def _value(generation: dict[str, Any], field: str) -> float | None:
    if field == "pace_error":
        return pace_error(generation["speaking_rate_ratio"])
    if field == "eos_failure":
        return 1.0 if generation["eos_failure"] else 0.0
    return generation[field]


def _fmt(mean: float | None, sd: float | None = None, digits: int = 3) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:.{digits}f}" if sd is None else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def _signed(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:+.{digits}f}"


def markdown_table(result: dict[str, Any]) -> str:
    """Per speaker, the fine-tuned model against each zero-shot system: value ± spread, difference
    and verdict for similarity, pace and end-of-speech failures; duration and real-time factor."""
    others = [
        s for s in SYSTEM_LABELS if s != "fine_tuned" and any(s in sp["summary"] for sp in result["speakers"].values())
    ]
    header = ["speaker", "metric", SYSTEM_LABELS["fine_tuned"]]
    for other in others:
        header += [SYSTEM_LABELS[other], "Δ", "verdict"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, speaker in result["speakers"].items():
        summary, comp = speaker["summary"], speaker["comparison"]

        def row(label, cell, key=None, diff_digits=3):
            cells = [name, label, cell(summary["fine_tuned"])]
            for other in others:
                if other not in summary:
                    cells += ["n/a", "", ""]
                    continue
                cells.append(cell(summary[other]))
                if key is None:
                    cells += ["", ""]
                else:
                    c = comp[other][key]
                    cells += [_signed(c["difference"], diff_digits), c["verdict"]]
            lines.append("| " + " | ".join(cells) + " |")

        row(
            "speaker similarity",
            lambda s: _fmt(s["speaker_similarity"]["mean"], s["speaker_similarity"]["sd"]),
            "speaker_similarity",
        )
        row(
            "speaking rate ratio (1 = speaker's pace)",
            lambda s: _fmt(s["speaking_rate_ratio"]["mean"], s["speaking_rate_ratio"]["sd"], 2),
            "pace_error",
            2,
        )
        row("end-of-speech failures", lambda s: f"{s['eos_failures']}/{s['generations']}", "eos_failure_rate", 2)
        row("mean duration (s)", lambda s: _fmt(s["mean_seconds"], digits=2))
        row("real-time factor", lambda s: _fmt(s["real_time_factor"], digits=2))
    notes = [
        "",
        f"Δ: fine-tuned minus zero-shot (for the speaking rate: the change in |log ratio|, the distance "
        f"from the speaker's pace; negative is closer). Verdict: better / worse when |Δ| exceeds "
        f"{NOISE_Z:g} standard errors of the difference (from the spread over texts and samples), else "
        "within noise.",
    ]
    for name, speaker in result["speakers"].items():
        if not speaker.get("real_clips_held_out", True):
            notes.append(
                f"{name}: no validation clips; similarity and pace are measured against the speaker's "
                "other clips, which the model trained on."
            )
    return "\n".join(lines + notes) + "\n"
