"""`tts-lightning evaluate` on the tiny model: a short fine-tune of the demo speakers, exported,
against the tiny base model's zero-shot cloning (x-vector and ICL) through the official paths."""

import json

import lightning as L
import numpy as np
import pytest
import soundfile as sf
import torch

from tts_lightning import Qwen3TTSModule
from tts_lightning.__main__ import main
from tts_lightning.model.export import export_custom_voice

pytestmark = pytest.mark.slow  # a short fit, then 18 generations through the official paths
SPEAKERS = ["alice", "bob"]
SYSTEMS = ["fine_tuned", "zero_shot_xvector", "zero_shot_icl"]
TEXT = "Good morning to you."


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, tiny_dir, demo_data):
    """A 3-step fine-tune of both demo speakers, one validation clip held out (so one speaker has
    none): its full checkpoint and its fp32 export."""
    import shutil

    from tts_lightning import SpeakerClipsDataModule

    root = tmp_path_factory.mktemp("evaluate")
    _, manifest, shared = demo_data
    cache = shutil.copytree(shared, root / "cache")  # the codes reused, the split its own
    data = SpeakerClipsDataModule(
        str(tiny_dir), str(manifest), val_fraction=0.05, cache_dir=str(cache), seed=0, max_frames_per_batch=150
    )
    L.seed_everything(0)
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names, learning_rate=1e-3)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    with torch.no_grad():  # a speaker no batch has shown yet gets the data's embedding, as export needs
        table = data.speaker_embeddings()
        for i in range(len(SPEAKERS)):
            if not bool(module.speaker_embeddings[i].abs().sum() > 0):
                module.speaker_embeddings[i] = table[i]
    ckpt = root / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    voice = export_custom_voice(ckpt, root / "voice", dtype="fp32")
    return root, ckpt, voice, cache


def run(*args):
    return main(["evaluate", *map(str, args)])


@pytest.fixture(scope="module")
def evaluated(finetuned, tiny_dir, held_out_manifest):
    """The one evaluate run (exported model, 2 samples, a held-out speaker) the tests below read: its
    output folder and what it printed."""
    import contextlib
    import io

    root, ckpt, voice, cache = finetuned
    out = root / "eval-export"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = run(
            *("--model", voice, "--base", tiny_dir, "--prepared", cache, "--out", out, "--text", TEXT),
            *("--num-samples", 2, "--held-out", held_out_manifest),
        )
    assert code == 0
    return out, printed.getvalue()


def test_evaluate_exported_directory_and_checkpoint(finetuned, evaluated, tiny_dir, held_out_manifest):
    root, ckpt, voice, cache = finetuned
    out, printed = evaluated
    result = json.loads((out / "evaluation.json").read_text())
    assert result["model_kind"] == "exported directory" and result["settings"]["alpha"] == 0.05
    (validated,) = {
        c["speaker"] for c in json.loads((cache / "prepared.json").read_text())["clips"] if c["split"] == "val"
    }
    (unvalidated,) = set(SPEAKERS) - {validated}
    assert sorted(result["speakers"]) == SPEAKERS
    for name in SPEAKERS:
        speaker = result["speakers"][name]
        assert speaker["texts"] == [TEXT]
        # One validation clip, of one speaker: the other is scored on their other clips.
        assert speaker["real_clips_held_out"] == (name == validated)
        assert speaker["reference_text"]  # the reference's transcript, for ICL
        assert 0.03 < speaker["seconds_per_character"] < 0.15  # the real clips' pace
        assert sorted(speaker["generations"]) == sorted(SYSTEMS)
        for system in SYSTEMS:
            gens = speaker["generations"][system]
            assert [(g["text_index"], g["sample"]) for g in gens] == [(0, 0), (0, 1)]
            assert [g["seed"] for g in gens] == [0, 1000]  # the same seeds for every system
            for g in gens:
                wav, sr = sf.read(g["audio"])
                assert sr == 24_000 and len(wav) == g["frames"] * 1920
                assert 2 <= g["frames"] <= g["frame_limit"]
                assert g["eos_failure"] == (g["frames"] >= g["frame_limit"])
                assert -1.0 <= g["similarity"] <= 1.0 and g["speaking_rate_ratio"] > 0
                assert "cer" not in g  # no --asr: not scored
            summary = speaker["summary"][system]
            assert summary["generations"] == 2 and summary["real_time_factor"] > 0
            assert summary["eos_failure_rate"] == summary["eos_failures"] / 2
        for other in SYSTEMS[1:]:
            for metric, test in (("speaker_similarity", "paired t"), ("pace_error", "paired t")):
                c = speaker["comparison"][other][metric]
                assert c["verdict"] in ("better", "worse", "within noise") and c["test"] == test
                assert c["pairs"] == 2 and 0.0 <= c["p_value"] <= 1.0
            eos = speaker["comparison"][other]["eos_failure_rate"]
            assert eos["test"] == "exact McNemar" and eos["verdict"] == "within noise"  # 2 pairs never suffice
    table = (out / "evaluation.md").read_text()
    assert table in printed
    header = table.splitlines()[0]
    assert all(label in header for label in ("fine-tuned", "zero-shot x-vector", "zero-shot ICL", "verdict"))
    assert f"{unvalidated}: no validation clips" in table

    # The held-out speaker cloned (ICL) by the base model and by the fine-tuned weights in it.
    zero_shot = result["zero_shot"]
    assert zero_shot["held_out"] == str(held_out_manifest) and list(zero_shot["speakers"]) == ["dave"]
    dave = zero_shot["speakers"]["dave"]
    assert dave["texts"] == [TEXT] and dave["reference"].endswith("dave_000.wav")
    assert [p.rsplit("/", 1)[-1] for p in dave["real_clips"]] == ["dave_001.wav"]
    pairs = list(zip(dave["generations"]["before"], dave["generations"]["after"], strict=True))
    assert [(b["seed"], a["seed"]) for b, a in pairs] == [(0, 0), (1000, 1000)]  # the same seeds
    for b, a in pairs:
        assert -1.0 <= b["similarity"] <= 1.0 and -1.0 <= a["similarity"] <= 1.0
        assert sf.read(b["audio"])[0].size == b["frames"] * 1920
    # The fine-tuned weights clone differently (the equal-weights case is test_zero_shot's).
    assert any(not np.array_equal(sf.read(b["audio"])[0], sf.read(a["audio"])[0]) for b, a in pairs)
    for when in ("before", "after"):
        sims = [g["similarity"] for g in dave["generations"][when]]
        assert dave["summary"][when]["speaker_similarity"]["mean"] == pytest.approx(np.mean(sims))
    c = dave["comparison"]["speaker_similarity"]
    diff = np.mean([a["similarity"] - b["similarity"] for b, a in pairs])
    assert c["test"] == "paired t" and c["pairs"] == 2 and c["difference"] == pytest.approx(diff)
    before, after = (f"{dave['summary'][w]['speaker_similarity']['mean']:.3f}" for w in ("before", "after"))
    assert f"| dave | speaker similarity | {before} ± " in table and f"| {after} ± " in table
    assert "Zero-shot cloning of held-out speakers" in table
    # "after" is the export's weights in the base model, the speaker encoder the base model's own.
    from safetensors.torch import load_file

    from tts_lightning.evaluation.zero_shot import load_fine_tuned_base

    state = load_fine_tuned_base(voice, tiny_dir, "cpu", torch.float32).model.state_dict()
    exported, base_weights = load_file(str(voice / "model.safetensors")), load_file(str(tiny_dir / "model.safetensors"))
    assert (
        set(state) == set(base_weights) == set(exported) | {k for k in base_weights if k.startswith("speaker_encoder.")}
    )
    for key, value in state.items():
        torch.testing.assert_close(
            value, (base_weights if key.startswith("speaker_encoder.") else exported)[key], atol=0, rtol=0
        )
    assert not torch.equal(state["talker.codec_head.weight"], base_weights["talker.codec_head.weight"])  # trained
    for name in SPEAKERS:
        assert f"| {name} | speaker similarity |" in table and f"| {name} | end-of-speech failures |" in table
        assert "character error rate" not in table

    # The training checkpoint itself (exported on the fly, fp32 on CPU): the same audio for the same
    # seeds, and the base model named by the checkpoint.
    out_ckpt = root / "eval-ckpt"
    assert (
        run(
            "--model",
            ckpt,
            "--prepared",
            cache / "prepared.json",
            "--out",
            out_ckpt,
            "--text",
            TEXT,
            "--num-samples",
            1,
            "--speaker",
            "bob",
            "--no-icl",
            "--asr",
            "pocketsphinx",
        )
        == 0
    )
    again = json.loads((out_ckpt / "evaluation.json").read_text())
    assert again["model_kind"] == "training checkpoint" and list(again["speakers"]) == ["bob"]
    assert sorted(again["speakers"]["bob"]["generations"]) == ["fine_tuned", "zero_shot_xvector"]
    # Intelligibility (pocketsphinx): the random tiny model's noise is not speech, the recognizer hears
    # (almost) nothing of the text.
    for g in (gs[0] for gs in again["speakers"]["bob"]["generations"].values()):
        assert isinstance(g["transcript"], str) and g["cer"] >= 0.7 and g["wer"] >= 0.7
    cer = again["speakers"]["bob"]["comparison"]["zero_shot_xvector"]["cer"]
    assert cer["test"] == "paired t" and cer["pairs"] == 1 and cer["verdict"] == "within noise"  # one pair
    assert again["speakers"]["bob"]["summary"]["fine_tuned"]["cer"]["mean"] >= 0.7
    table = (out_ckpt / "evaluation.md").read_text()
    assert "| bob | character error rate |" in table and "| bob | word error rate |" in table
    for system in ("fine_tuned", "zero_shot_xvector"):
        a = sf.read(again["speakers"]["bob"]["generations"][system][0]["audio"])[0]
        b = sf.read(result["speakers"]["bob"]["generations"][system][0]["audio"])[0]
        assert a.shape == b.shape and abs(a - b).max() < 1e-4
    assert not [p for p in out_ckpt.iterdir() if p.name.startswith(".evaluate-")]  # the temporary export is gone


def test_evaluate_fails_clearly(finetuned, tiny_dir, tiny_custom_voice_dir, held_out_manifest, capsys, monkeypatch):
    root, ckpt, voice, cache = finetuned
    out = root / "eval-errors"
    common = ["--prepared", cache, "--out", out, "--text", TEXT]
    (out / ".evaluate-k1l2m3n4").mkdir(parents=True)  # the temporary export of a killed run
    (out / "evaluation.json").write_text('{"previous": true}\n')  # a previous evaluation's report

    assert run("--model", root / "missing.ckpt", "--base", tiny_dir, *common) == 2
    assert "missing.ckpt does not exist" in capsys.readouterr().err

    assert run("--model", voice, "--base", tiny_dir, "--speaker", "carol", *common) == 2
    err = capsys.readouterr().err
    assert "unknown speaker(s) 'carol':" in err and "share alice, bob" in err

    assert run("--model", voice, "--base", tiny_custom_voice_dir, *common) == 2
    err = capsys.readouterr().err
    assert "base model:" in err and "tts_model_type is 'custom_voice', but 'base' is required" in err

    assert run("--model", voice, *common) == 2
    assert "give --base" in capsys.readouterr().err

    assert run("--model", voice, "--base", tiny_dir, "--prepared", root / "nowhere", "--out", out) == 2
    assert "no prepared data index" in capsys.readouterr().err

    # --held-out: each bad file named in one line, before any model loads.
    bad = root / "held-out-errors"
    bad.mkdir()
    (bad / "trained.jsonl").write_text('{"audio": "a.wav", "text": "Hi there.", "speaker": "alice"}\n')
    (bad / "broken.jsonl").write_text('{"audio": "a.wav", "text": "Hi there.", "speaker": "eve"}\n{"audio": \n')
    (bad / "missing.jsonl").write_text('{"audio": "gone.wav", "text": "Hi there.", "speaker": "eve"}\n')
    for held, message in (
        (bad / "nothing.jsonl", f"--held-out: manifest not found: {bad / 'nothing.jsonl'}"),
        (bad / "trained.jsonl", f"--held-out {bad / 'trained.jsonl'}: speaker(s) ['alice'] are in the run's data"),
        (bad / "broken.jsonl", f"--held-out {bad / 'broken.jsonl'}: broken.jsonl:2: invalid JSON"),
        (bad / "missing.jsonl", f"missing.jsonl:1: audio {bad / 'gone.wav'} does not exist"),
    ):
        assert run("--model", voice, "--base", tiny_dir, *common, "--held-out", held) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    # A model from a CustomVoice start (built-in speakers) had no zero-shot cloning to compare with.
    assert run("--model", tiny_custom_voice_dir, "--base", tiny_dir, *common, "--held-out", held_out_manifest) == 2
    err = capsys.readouterr().err
    assert "has built-in speakers ['ryan', 'serena', 'vivian'], so it started from a CustomVoice model" in err
    assert [p.name for p in out.glob("*.json")] == ["evaluation.json"]  # a refused run keeps the last report

    # Stopped while its audio is written (into the folder of the previous evaluation): no report that
    # describes other audio stays, nor a temporary export.
    import importlib

    evaluate_module = importlib.import_module(
        "tts_lightning.evaluation.evaluate"
    )  # the package exports a function of that name

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate_module, "_generate_all", stopped)
    assert run("--model", voice, "--base", tiny_dir, *common, "--no-icl") == 130
    assert "tts-lightning evaluate: stopped by Ctrl-C" in capsys.readouterr().err
    assert not (out / "evaluation.json").exists() and not list(out.glob(".evaluate-*"))


def test_evaluation_page_plays_in_a_headless_browser(evaluated, tmp_path):
    """evaluation.html in Debian's chromium (Playwright drives it): no console errors, one player per
    generation plus one real clip per speaker, every source decodes to its clip's duration, one chart
    per speaker, and the paired verdicts of evaluation.json shown (verdict, p, test) for every
    system against the fine-tuned one. The screenshot is left in the test's tmp folder."""
    from browser import durations as decoded
    from browser import open_page

    out, _ = evaluated
    result = json.loads((out / "evaluation.json").read_text())
    gens = [g for s in result["speakers"].values() for gs in s["generations"].values() for g in gs]
    errors: list[str] = []
    with open_page(out / "evaluation.html", errors) as page:
        assert page.locator("audio.generation").count() == len(gens) == 12
        assert page.locator("audio.reference").count() == len(SPEAKERS)
        assert page.locator("div.chart svg").count() == len(SPEAKERS)
        durations = decoded(page, "audio.generation")
        zero_shot = {w: decoded(page, f"audio.zero-shot.{w}") for w in ("before", "after")}
        assert page.locator("audio.zero-shot.cloned-reference").count() == 1
        shown_zero_shot = page.evaluate(
            """() => [...document.querySelectorAll('table.zero-shot tr')].filter(r => r.querySelector('td.verdict'))
                .map(r => [...r.querySelectorAll('td')].map(td => td.innerText))"""
        )
        verdicts = page.evaluate(
            """() => [...document.querySelectorAll('table.verdicts tr')].filter(r => r.querySelector('td.verdict'))
                .map(r => [...r.querySelectorAll('td')].map(td => td.innerText)
                    .concat([r.querySelector('td.verdict').checkVisibility()]))"""
        )
        page.screenshot(path=str(tmp_path / "evaluation.png"), full_page=True)
    assert not errors, errors
    expected = [g["seconds"] for s in result["speakers"].values() for gs in s["generations"].values() for g in gs]
    assert durations == pytest.approx(expected, abs=0.01)
    assert (tmp_path / "evaluation.png").stat().st_size > 10_000
    # The held-out speaker's clones, before and after, each decoding to its clip's duration; the
    # similarity verdict as the JSON says.
    dave = result["zero_shot"]["speakers"]["dave"]
    for when in ("before", "after"):
        assert zero_shot[when] == pytest.approx([g["seconds"] for g in dave["generations"][when]], abs=0.01)
    c = dave["comparison"]["speaker_similarity"]
    ((speaker, _, _, diff, verdict, p_value, pairs),) = shown_zero_shot
    assert speaker == "dave" and verdict == c["verdict"] and int(pairs) == c["pairs"] == 2
    assert float(diff) == pytest.approx(c["difference"], abs=5e-4)
    assert float(p_value) == pytest.approx(c["p_value"], rel=0.05, abs=1e-12)
    # All speakers together, then per speaker: each zero-shot system against the fine-tuned one on
    # similarity, pace and failures (no --asr here: no CER rows), in the JSON's order, as it says.
    expected_verdicts = [
        (other, c)
        for s in [result["all_speakers"], *result["speakers"].values()]
        for other, metrics in s["comparison"].items()
        for c in metrics.values()
        if c["pairs"]
    ]
    assert len(verdicts) == len(expected_verdicts) == (1 + len(SPEAKERS)) * 2 * 3
    labels = {"zero_shot_xvector": "zero-shot x-vector", "zero_shot_icl": "zero-shot ICL"}
    for shown, (other, c) in zip(verdicts, expected_verdicts, strict=True):
        metric, _, against, _, diff, verdict, p_value, test, pairs, visible = shown
        assert visible and against == labels[other] and verdict == c["verdict"] and test == c["test"]
        assert float(p_value) == pytest.approx(c["p_value"], rel=0.05, abs=1e-12)
        assert float(diff) == pytest.approx(c["difference"], abs=5e-4) and int(pairs) == c["pairs"]


def test_all_speakers_are_compared_together(evaluated):
    """With several speakers, one comparison of them all, the overall answer (each speaker alone has
    few pairs), first in the table and the page: each speaker counts once (the paired t-test on the
    speakers' mean similarities: a speaker's pairs are not independent of each other)."""
    from scipy import stats

    out, printed = evaluated
    result = json.loads((out / "evaluation.json").read_text())
    pooled = result["all_speakers"]
    for other in SYSTEMS[1:]:
        c = pooled["comparison"][other]["speaker_similarity"]
        means = {
            system: [np.mean([g["similarity"] for g in result["speakers"][s]["generations"][system]]) for s in SPEAKERS]
            for system in ("fine_tuned", other)
        }
        assert c["pairs"] == len(SPEAKERS) and c["test"] == "paired t on speaker means"
        assert c["difference"] == pytest.approx(np.mean(np.subtract(means["fine_tuned"], means[other])))
        assert c["p_value"] == pytest.approx(stats.ttest_rel(means["fine_tuned"], means[other]).pvalue)
    assert pooled["summary"]["fine_tuned"]["generations"] == 2 * len(SPEAKERS)
    assert pooled["summary"]["fine_tuned"]["speakers"] == len(SPEAKERS)
    table = (out / "evaluation.md").read_text()
    assert table.splitlines()[2].startswith("| all speakers | speaker similarity |")
    for system in SYSTEMS:  # what it is doing, while it does it (72 speakers were minutes of silence)
        assert f"evaluate: {system}: 4 generations (2 speakers) ...\nevaluate: {system}: done in " in printed
    assert "<h2>All speakers</h2>" in (out / "evaluation.html").read_text()
