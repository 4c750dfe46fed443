"""``evaluation.html``: one self-contained page to listen and see (no network, works from file://).

Per speaker the real reference clip and, per text, an audio player per system and sample beside its
scores; per speaker the paired verdicts (each system against the fine-tuned one: Δ, verdict, p and
the test used) and an inline SVG chart of similarity, speaking rate, intelligibility (with --asr)
and end-of-speech failures per system with their spread; the run's settings; with replay records,
a "Built-in speakers" section (the forgetting table; per replay text, the starting and the
fine-tuned model); with ``--held-out``, a "Zero-shot cloning" section (before / after per held-out
speaker, text and seed). Audio is embedded as 16-bit WAV data URIs."""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

from tts_lightning.evaluation.report import COMPARED, DEFAULT_ALPHA, SYSTEM_LABELS


def _wav_uri(audio: np.ndarray, sample_rate: int) -> str:
    buf = io.BytesIO()
    sf.write(buf, np.clip(audio, -1.0, 1.0), sample_rate, format="WAV", subtype="PCM_16")
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _file_uri(path: str | Path, sample_rate: int) -> str:
    from tts_lightning.data.audio import load_audio

    return _wav_uri(load_audio(path, sample_rate).numpy().reshape(-1), sample_rate)


def _chart_svg(speaker: dict[str, Any]) -> str:
    """Bars per system with the spread (sd; binomial standard error for the failure rate)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = speaker["summary"]
    systems = list(summary)
    panels = [
        ("speaker similarity", lambda s: (s["speaker_similarity"]["mean"], s["speaker_similarity"]["sd"])),
        (
            "speaking rate ratio (1 = pace)",
            lambda s: (s["speaking_rate_ratio"]["mean"], s["speaking_rate_ratio"]["sd"]),
        ),
    ]
    if summary[systems[0]].get("cer", {}).get("mean") is not None:
        panels.append(("character error rate", lambda s: (s["cer"]["mean"], s["cer"]["sd"])))

    def failures(s):
        p, n = s["eos_failure_rate"], s["generations"]
        return p, math.sqrt(p * (1 - p) / n) if n else None

    panels.append(("end-of-speech failure rate", failures))
    fig = Figure(figsize=(3.2 * len(panels), 2.8))
    FigureCanvasAgg(fig)
    for ax, (title, get) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        values = [get(summary[s]) for s in systems]
        means = [v[0] if v[0] is not None else 0.0 for v in values]
        errs = [v[1] if v[1] is not None else 0.0 for v in values]
        ax.bar(
            range(len(systems)), means, yerr=errs, capsize=4, color=["#4c72b0", "#dd8452", "#55a868"][: len(systems)]
        )
        ax.set_xticks(range(len(systems)), [SYSTEM_LABELS.get(s, s) for s in systems], rotation=20, fontsize=7)
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]  # drop the XML prolog: inline in HTML


def _scores(g: dict[str, Any]) -> str:
    parts = []
    if g.get("similarity") is not None:
        parts.append(f"similarity {g['similarity']:.3f}")
    if g.get("speaking_rate_ratio") is not None:
        parts.append(f"rate {g['speaking_rate_ratio']:.2f}")
    if g.get("cer") is not None:
        parts.append(f"CER {g['cer']:.2f}, WER {g['wer']:.2f}")
    parts.append("did not end" if g["eos_failure"] else "ended")
    return html.escape("; ".join(parts))


def _summary_value(summary: dict[str, Any], key: str) -> str:
    """The system's own number for a compared metric, as the markdown table shows it."""
    if key == "eos_failure_rate":
        return f"{summary['eos_failures']}/{summary['generations']} failed"
    stat = summary["speaking_rate_ratio" if key == "pace_error" else key]
    if stat.get("mean") is None:
        return "n/a"
    digits = 2 if key == "pace_error" else 3
    return f"{stat['mean']:.{digits}f} ± {stat['sd']:.{digits}f}" + (" (rate ratio)" if key == "pace_error" else "")


def _verdicts_table(speaker: dict[str, Any], alpha: float) -> str:
    """Each other system against the fine-tuned one, metric by metric: both values, the mean paired
    difference, the verdict, its p-value and the test that gave it."""
    summary = speaker["summary"]
    head = "<tr><th>metric</th><th>fine-tuned</th><th>against</th><th>its value</th><th>Δ (paired)</th>"
    rows = [head + "<th>verdict</th><th>p</th><th>test</th><th>pairs</th></tr>"]
    for other, metrics in speaker["comparison"].items():
        for key, c in metrics.items():
            if c["pairs"] == 0:  # e.g. CER without --asr
                continue
            cells = [
                COMPARED[key][2],
                _summary_value(summary["fine_tuned"], key),
                SYSTEM_LABELS.get(other, other),
                _summary_value(summary[other], key),
                f"{c['difference']:+.3f}",
            ]
            tds = "".join(f"<td>{html.escape(v)}</td>" for v in cells)
            verdict = html.escape(c["verdict"])
            rows.append(
                f'<tr class="{verdict.replace(" ", "-")}">{tds}<td class="verdict"><b>{verdict}</b></td>'
                f'<td class="p">{c["p_value"]:.2g}</td><td class="test">{html.escape(c["test"])}</td>'
                f"<td>{c['pairs']}</td></tr>"
            )
    note = (
        f"<p>Δ: fine-tuned minus the other system over the same (text, seed) pairs (pace: the change in "
        f"|log rate ratio|). Better / worse only when the paired test gives p &lt; {alpha:g}, else within noise.</p>"
    )
    return '<table class="verdicts">' + "".join(rows) + "</table>" + note


def _speaker_section(name: str, speaker: dict[str, Any], sample_rate: int, alpha: float) -> list[str]:
    out = [f"<h2>{html.escape(name)}</h2>", _verdicts_table(speaker, alpha)]
    out += ['<div class="chart">', _chart_svg(speaker), "</div>"]
    out.append(
        f'<p>Real reference clip: <audio controls preload="metadata" class="reference" '
        f'src="{_file_uri(speaker["reference"], sample_rate)}"></audio></p>'
    )
    for t, text in enumerate(speaker["texts"]):
        out += [
            f"<h3>“{html.escape(text)}”</h3>",
            "<table><tr><th>system</th><th>sample</th><th>audio</th><th>scores</th></tr>",
        ]
        for system, gens in speaker["generations"].items():
            for g in (g for g in gens if g["text_index"] == t):
                src = _file_uri(g["audio"], sample_rate)
                out.append(
                    f"<tr><td>{html.escape(SYSTEM_LABELS.get(system, system))}</td><td>{g['sample']} (seed {g['seed']})"
                    f'</td><td><audio controls preload="metadata" class="generation" src="{src}"></audio></td>'
                    f"<td>{_scores(g)}</td></tr>"
                )
        out.append("</table>")
    return out


def _built_in_section(forgetting: dict[str, Any], sample_rate: int) -> list[str]:
    """The forgetting table (`tts_lightning.evaluation.forgetting`) and, per replay text, the starting
    model's speech (the record) beside the fine-tuned model's (`tts_lightning.evaluation.built_in`)."""
    head = "<tr><th>built-in speaker</th><th>records</th><th>loss before</th><th>loss after</th><th>Δ</th></tr>"
    rows = [head]
    for name, s in forgetting["speakers"].items():
        rows.append(
            f'<tr><td class="speaker">{html.escape(name)}</td><td>{s["before"]["records"]}</td>'
            f'<td class="before">{s["before"]["loss"]:.4f}</td><td class="after">{s["after"]["loss"]:.4f}</td>'
            f'<td class="difference">{s["difference"]:+.4f}</td></tr>'
        )
    out = [
        '<h2 id="built-in">Built-in speakers</h2>',
        "<p>Teacher-forced loss on the replay records (the starting model's own speech with each built-in "
        "speaker), with the starting model (before) and the fine-tuned one (after); Δ &gt; 0: forgetting.</p>",
        '<table class="forgetting">' + "".join(rows) + "</table>",
    ]
    for name, s in forgetting["speakers"].items():
        out.append(f"<h3>{html.escape(name)}</h3>")
        out.append("<table><tr><th>text</th><th>starting model</th><th>fine-tuned</th><th>similarity</th></tr>")
        for g in s.get("samples", []):
            players = "".join(
                f'<td><audio controls preload="metadata" class="built-in {when}" '
                f'src="{_file_uri(g[when + "_audio"], sample_rate)}"></audio></td>'
                for when in ("before", "after")
            )
            similarity = "n/a" if g["similarity"] is None else f"{g['similarity']:.3f}"
            out.append(f"<tr><td>“{html.escape(g['text'])}” (seed {g['seed']})</td>{players}<td>{similarity}</td></tr>")
        out.append("</table>")
    return out


def _zero_shot_section(zero_shot: dict[str, Any], sample_rate: int) -> list[str]:
    """Held-out speakers cloned (ICL) by the starting base model and by the fine-tuned weights
    (`tts_lightning.evaluation.zero_shot`): similarity before / after with the paired verdict, and
    per text and seed both clones side by side."""
    head = "<tr><th>held-out speaker</th><th>similarity before</th><th>after</th><th>Δ (paired)</th>"
    rows = [head + "<th>verdict</th><th>p</th><th>pairs</th></tr>"]
    for name, s in zero_shot["speakers"].items():
        c = s["comparison"]["speaker_similarity"]
        before, after = (_summary_value(s["summary"][w], "speaker_similarity") for w in ("before", "after"))
        p = "n/a" if c["p_value"] is None else f"{c['p_value']:.2g}"
        diff = "n/a" if c["difference"] is None else f"{c['difference']:+.3f}"
        rows.append(
            f'<tr class="{c["verdict"].replace(" ", "-")}"><td class="speaker">{html.escape(name)}</td>'
            f'<td class="before">{before}</td><td class="after">{after}</td><td class="difference">{diff}</td>'
            f'<td class="verdict"><b>{html.escape(c["verdict"])}</b></td><td class="p">{p}</td>'
            f"<td>{c['pairs']}</td></tr>"
        )
    out = [
        '<h2 id="zero-shot">Zero-shot cloning of held-out speakers</h2>',
        "<p>Each held-out speaker's first clip cloned in ICL mode (<code>generate_voice_clone</code>) by the "
        "starting base model (before) and by the fine-tuned weights in it (after), the same texts and seeds; "
        "similarity to the speaker's other clips. Δ &lt; 0: fine-tuning cost zero-shot cloning.</p>",
        '<table class="zero-shot">' + "".join(rows) + "</table>",
    ]
    for name, s in zero_shot["speakers"].items():
        out += [
            f"<h3>{html.escape(name)}</h3>",
            f'<p>Reference clip (cloned): <audio controls preload="metadata" class="zero-shot cloned-reference" '
            f'src="{_file_uri(s["reference"], sample_rate)}"></audio> “{html.escape(s["reference_text"])}”</p>',
            "<table><tr><th>text</th><th>sample</th><th>before</th><th>after</th></tr>",
        ]
        if s["real_clips_are_reference"]:
            out.insert(-1, "<p>One clip: the clones are scored against the reference they cloned.</p>")
        pairs = zip(s["generations"]["before"], s["generations"]["after"], strict=True)
        for b, a in pairs:  # generated in the same (text, sample) order before and after
            cells = "".join(
                f'<td><audio controls preload="metadata" class="zero-shot {when}" '
                f'src="{_file_uri(g["audio"], sample_rate)}"></audio><br>{_scores(g)}</td>'
                for when, g in (("before", b), ("after", a))
            )
            text = html.escape(s["texts"][b["text_index"]])
            out.append(f"<tr><td>“{text}”</td><td>{b['sample']} (seed {b['seed']})</td>{cells}</tr>")
        out.append("</table>")
    return out


def evaluation_html(result: dict[str, Any], sample_rate: int) -> str:
    settings = {"model": result["model"], "base": result["base"], "prepared": result["prepared"], **result["settings"]}
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in settings.items())
    body = ["<h1>Evaluation</h1>", f"<table class=settings>{rows}</table>"]
    if "all_speakers" in result:  # every speaker's pairs together: the overall answer
        alpha = result["settings"].get("alpha", DEFAULT_ALPHA)
        body += ["<h2>All speakers</h2>", _verdicts_table(result["all_speakers"], alpha)]
        body.append(
            "<p>Each speaker counts once: Δ and the paired t-test are over the speakers' means, for the "
            "speakers both systems spoke for (the exact sign test where every speaker differs by the same "
            "amount).</p>"
        )
    for name, speaker in result["speakers"].items():
        body += _speaker_section(name, speaker, sample_rate, result["settings"].get("alpha", DEFAULT_ALPHA))
    if "forgetting" in result:
        body += _built_in_section(result["forgetting"], sample_rate)
    if "zero_shot" in result:
        body += _zero_shot_section(result["zero_shot"], sample_rate)
    style = (
        "body{font-family:sans-serif;margin:1em 2em}td,th{padding:2px 8px;text-align:left}svg{max-width:100%}"
        "tr.better .verdict{color:#1a7f37}tr.worse .verdict{color:#c62828}"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>Evaluation</title>'
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
