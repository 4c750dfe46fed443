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
# A difference counts when a paired test rejects "no difference" at this level (``--alpha``).
DEFAULT_ALPHA = 0.05


ALL_SPEAKERS = "all speakers"  # the table's row of every speaker's pairs together (`pooled`)


def mean_sd(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the finite values (None when there are none)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None, None
    m = sum(finite) / len(finite)
    sd = math.sqrt(sum((v - m) ** 2 for v in finite) / (len(finite) - 1)) if len(finite) > 1 else 0.0
    return m, sd


ROUNDING = 1e-12  # differences this close to 0 are none (0.1 + 0.2 - 0.3)


def compare(
    ours: Sequence[float | None],
    theirs: Sequence[float | None],
    *,
    higher_is_better: bool,
    binary: bool = False,
    alpha: float = DEFAULT_ALPHA,
) -> dict[str, Any]:
    """``ours[i]`` and ``theirs[i]`` are the same (text, seed) spoken by two systems: the mean of the
    paired differences (ours - theirs), a paired test's p-value and a verdict, "better" / "worse" when
    p < ``alpha`` in the good / bad direction, else "within noise".

    Continuous scores: the paired t-test (``ttest_rel``). Δ is a mean difference, so a test of the
    mean is the matching one; the Wilcoxon signed-rank test cannot reach p < 0.05 with fewer than 6
    pairs (its smallest two-sided p is 2 / 2^n) and evaluations are often that small.
    Pass/fail (``binary``, e.g. end-of-speech failures): the exact McNemar test, a two-sided binomial
    test on the discordant pairs (only one system failed), since pairs that agree carry no evidence.
    Scores whose pairs all differ by the same amount (no spread: 2 speakers' failure rates 0 against
    1) leave the t statistic undefined: the exact sign test then says what n pairs all one way can
    show (two-sided p = 2 / 2^n: 0.5 for 2 pairs), not p = 0. Differences within rounding of 0
    count as none."""
    from scipy import stats

    pairs = [(a, b) for a, b in zip(ours, theirs, strict=True) if a is not None and b is not None]
    pairs = [(float(a), float(b)) for a, b in pairs if math.isfinite(a) and math.isfinite(b)]
    if not pairs:
        return {"difference": None, "p_value": None, "test": None, "pairs": 0, "verdict": "n/a"}
    diffs = [a - b for a, b in pairs]
    diff = sum(diffs) / len(diffs)
    if math.isclose(diff, 0.0, abs_tol=ROUNDING):
        diff = 0.0
    if binary:
        test = "exact McNemar"
        worse_for_ours, better_for_ours = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
        discordant = worse_for_ours + better_for_ours
        p = float(stats.binomtest(worse_for_ours, discordant, 0.5).pvalue) if discordant else 1.0
    else:
        test = "paired t"
        if len(pairs) < 2:
            p = 1.0  # one pair: no spread, no evidence
        elif math.isclose(max(diffs), min(diffs), rel_tol=1e-9, abs_tol=ROUNDING):  # no spread
            if diff != 0:  # every pair one way: a sign test of n pairs
                test = "sign (no spread)"
                p = float(stats.binomtest(len(pairs), len(pairs), 0.5).pvalue)
            else:
                p = 1.0
        else:
            p = float(stats.ttest_rel([a for a, _ in pairs], [b for _, b in pairs]).pvalue)
    if p >= alpha or diff == 0:
        verdict = "within noise"
    else:
        verdict = "better" if (diff > 0) == higher_is_better else "worse"
    return {"difference": diff, "p_value": p, "test": test, "pairs": len(pairs), "verdict": verdict}


# metric key -> (per-generation value, higher is better, label)
COMPARED = {
    "speaker_similarity": ("similarity", True, "speaker similarity"),
    "pace_error": ("pace_error", False, "pace error |log rate ratio|"),
    "eos_failure_rate": ("eos_failure", False, "end-of-speech failures"),
    "cer": ("cer", False, "character error rate"),  # with --asr only
    "wer": ("wer", False, "word error rate"),
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
        "cer": dict(zip(("mean", "sd"), mean_sd([g.get("cer") for g in generations]), strict=True)),
        "wer": dict(zip(("mean", "sd"), mean_sd([g.get("wer") for g in generations]), strict=True)),
        "eos_failures": failures,
        "eos_failure_rate": failures / len(generations) if generations else None,
        "mean_seconds": dur_m,
        "real_time_factor": wall / seconds if seconds > 0 else None,
    }


def comparisons(
    systems: dict[str, list[dict[str, Any]]], ours: str = "fine_tuned", *, alpha: float = DEFAULT_ALPHA
) -> dict[str, dict]:
    """Our system against every other one, metric by metric, on the generations both made from the
    same (text, seed)."""
    out: dict[str, dict] = {}
    mine = {(g["text_index"], g["seed"]): g for g in systems[ours]}
    for other, gens in systems.items():
        if other == ours:
            continue
        pairs = [(mine[k], g) for g in gens if (k := (g["text_index"], g["seed"])) in mine]
        out[other] = {}
        for key, (field, higher, _) in COMPARED.items():
            a = [_value(m, field) for m, _ in pairs]
            b = [_value(t, field) for _, t in pairs]
            binary = field == "eos_failure"
            out[other][key] = compare(a, b, higher_is_better=higher, binary=binary, alpha=alpha)
    return out


def pooled(speakers: dict[str, dict[str, Any]], *, alpha: float = DEFAULT_ALPHA) -> dict[str, Any]:
    """Every speaker together, the overall answer where each speaker alone has too few pairs for a
    test to tell a difference from noise. A speaker counts once: each system's summary is over the
    speakers it spoke for, and each comparison pairs the fine-tuned model's mean with the other
    system's, speaker by speaker, over the speakers both spoke for (a paired t-test on the speakers'
    means: their pairs are not independent of each other)."""
    summary: dict[str, Any] = {}
    comparison: dict[str, dict] = {}
    for system in dict.fromkeys(s for speaker in speakers.values() for s in speaker["generations"]):
        spoken = [sp for sp in speakers.values() if system in sp["generations"]]
        summary[system] = summarize([g for sp in spoken for g in sp["generations"][system]])
        summary[system]["speakers"] = len(spoken)
        if system == "fine_tuned":
            continue
        both = [sp["generations"] for sp in spoken if "fine_tuned" in sp["generations"]]
        comparison[system] = {}
        for key, (field, higher, _) in COMPARED.items():
            ours = [mean_sd([_value(g, field) for g in gens["fine_tuned"]])[0] for gens in both]
            theirs = [mean_sd([_value(g, field) for g in gens[system]])[0] for gens in both]
            c = compare(ours, theirs, higher_is_better=higher, alpha=alpha)
            comparison[system][key] = {**c, "test": c["test"] and f"{c['test']} on speaker means"}
    return {"summary": summary, "comparison": comparison}


def _value(generation: dict[str, Any], field: str) -> float | None:
    if field == "pace_error":
        return pace_error(generation["speaking_rate_ratio"])
    if field == "eos_failure":
        return 1.0 if generation["eos_failure"] else 0.0
    return generation.get(field)


def _fmt(mean: float | None, sd: float | None = None, digits: int = 3) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:.{digits}f}" if sd is None else f"{mean:.{digits}f} ± {sd:.{digits}f}"


def _signed(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:+.{digits}f}"


def _verdict(c: dict[str, Any]) -> str:
    return c["verdict"] if c.get("p_value") is None else f"{c['verdict']} (p={c['p_value']:.2g})"


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
    alpha = result.get("settings", {}).get("alpha", DEFAULT_ALPHA)
    everyone = [(ALL_SPEAKERS, result["all_speakers"])] if "all_speakers" in result else []
    for name, speaker in [*everyone, *result["speakers"].items()]:
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
                    cells += [_signed(c["difference"], diff_digits), _verdict(c)]
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
        if summary["fine_tuned"].get("cer", {}).get("mean") is not None:  # scored with --asr
            for key, label in (("cer", "character error rate"), ("wer", "word error rate")):
                row(label, lambda s, k=key: _fmt(s[k]["mean"], s[k]["sd"]), key)
        row("end-of-speech failures", lambda s: f"{s['eos_failures']}/{s['generations']}", "eos_failure_rate", 2)
        row("mean duration (s)", lambda s: _fmt(s["mean_seconds"], digits=2))
        row("real-time factor", lambda s: _fmt(s["real_time_factor"], digits=2))
    pooled_note = (
        f"{ALL_SPEAKERS}: each speaker counts once (Δ and the paired t-test on the speakers' means, over the "
        "speakers both systems spoke for; the exact sign test where every speaker differs by the same amount)."
    )
    notes = [
        "",
        *([pooled_note] if everyone else []),
        "Δ: fine-tuned minus zero-shot, the mean over the same (text, seed) pairs (for the speaking rate: "
        "the change in |log ratio|, the distance from the speaker's pace; negative is closer). Verdict: "
        f"better / worse when a paired test gives p < {alpha:g} (paired t-test for similarity and pace, "
        "exact McNemar test for end-of-speech failures; the exact sign test where every pair differs by the "
        "same amount), else within noise.",
    ]
    for name, speaker in result["speakers"].items():
        if not speaker.get("real_clips_held_out", True):
            notes.append(
                f"{name}: no validation clips; similarity and pace are measured against the speaker's "
                "other clips, which the model trained on."
            )
    return "\n".join(lines + notes) + "\n"


def zero_shot_table(zero_shot: dict[str, Any]) -> str:
    """The Markdown table of `tts_lightning.evaluation.zero_shot.zero_shot_result`: before, after, Δ
    and the verdict per metric."""
    lines = [
        "",
        "Zero-shot cloning of held-out speakers (ICL, generate_voice_clone): the starting base model (before) "
        "and the fine-tuned weights in it (after)",
        "",
        "| held-out speaker | metric | before | after | Δ (after - before) | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in zero_shot["speakers"].items():
        before, after, comp = s["summary"]["before"], s["summary"]["after"], s["comparison"]
        rows = [
            ("speaker similarity", lambda x: _fmt(x["speaker_similarity"]["mean"], x["speaker_similarity"]["sd"])),
            (
                "speaking rate ratio",
                lambda x: _fmt(x["speaking_rate_ratio"]["mean"], x["speaking_rate_ratio"]["sd"], 2),
            ),
            ("end-of-speech failures", lambda x: f"{x['eos_failures']}/{x['generations']}"),
        ]
        for (label, cell), key in zip(rows, ("speaker_similarity", "pace_error", "eos_failure_rate"), strict=True):
            c = comp[key]
            lines.append(
                f"| {name} | {label} | {cell(before)} | {cell(after)} | {_signed(c['difference'])} | {_verdict(c)} |"
            )
    lines += [
        "",
        "Δ < 0 in similarity (worse, when the paired test says so): fine-tuning cost the model some of its "
        "zero-shot cloning. Speaking rate: Δ is the change in |log ratio|, negative is closer to the speaker's pace.",
    ]
    for name, s in zero_shot["speakers"].items():
        if s["real_clips_are_reference"]:
            lines.append(f"{name}: one clip, so the clones are scored against the reference they cloned.")
    return "\n".join(lines) + "\n"
