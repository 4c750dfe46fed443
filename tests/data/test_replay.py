"""Replay against forgetting (`tts_lightning.data.replay`), from the tiny CustomVoice model on the demo
clips: the records are spoken once by the starting model and reused, mixed in at the set fraction,
refused from a base model, kept in their own (non-streaming) layout in a streaming run; a short fit
keeps the built-in speakers' loss with replay on (and shows how far it moves without); resume stays
exact (a streaming run's); ``evaluate`` reports the loss before and after."""

import json
import shutil

import lightning as L
import numpy as np
import pytest
import torch

from tts_lightning import Qwen3TTSModule, SpeakerClipsDataModule
from tts_lightning.data.demo import demo_dir
from tts_lightning.data.replay import mixed_count, prepare_replay, read_pointer, read_records
from tts_lightning.errors import ConfigError
from tts_lightning.model.pretrained import check_pretrained

TEXTS = ["Hello world.", "The quick brown fox."]
FRACTION = 0.25
MARGIN = 0.05  # replay on: the built-in speakers' loss may rise at most this much (nats) in the fit


@pytest.fixture(scope="module")
def replay_data(tmp_path_factory, tiny_custom_voice_dir):
    """make(**kwargs) -> a data module on the demo clips from the tiny CustomVoice model, replay on;
    prepared once here (the replay records spoken then)."""
    root = tmp_path_factory.mktemp("replay")
    shutil.copytree(demo_dir(), root / "demo", ignore=shutil.ignore_patterns(".*"))

    def make(**kwargs):
        settings = dict(val_fraction=0.15, cache_dir=str(root / "cache"), max_frames_per_batch=150)
        settings.update(replay_fraction=FRACTION, replay_texts=TEXTS, replay_max_new_tokens=8)
        settings.update(kwargs)
        return SpeakerClipsDataModule(str(tiny_custom_voice_dir), str(root / "demo" / "train.jsonl"), **settings)

    make().prepare_data()
    return root / "cache", make


def _records_state(folder):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def test_replay_records_are_spoken_once_and_reused(replay_data, tiny_custom_voice_dir, tmp_path):
    cache, make = replay_data
    folder = read_pointer(cache)
    header, records = read_records(folder)
    built_in = sorted(check_pretrained(tiny_custom_voice_dir).speakers)
    assert sorted({r.speaker for r in records}) == built_in and {r.text for r in records} == set(TEXTS)
    assert len(records) == len(built_in) * len(TEXTS) and all(1 <= r.frames <= 8 for r in records)
    before = _records_state(folder)
    make().prepare_data()  # again: read from the cache, nothing spoken or written
    assert _records_state(folder) == before and read_pointer(cache) == folder
    # Seeded per (speaker, text): the first text alone, spoken afresh, gives the same codes, in a folder of its own.
    info = check_pretrained(tiny_custom_voice_dir)
    again = prepare_replay(tmp_path, info, TEXTS[:1], max_new_tokens=8, seed=0)
    assert read_pointer(tmp_path).name != folder.name and [r.text for r in again] == TEXTS[:1] * len(built_in)
    first = [r for r in records if r.text == TEXTS[0]]
    for mine, theirs in zip(first, again, strict=True):
        assert mine.speaker == theirs.speaker
        assert np.array_equal(np.load(cache / mine.codes), np.load(tmp_path / theirs.codes))


def test_replay_is_mixed_at_its_fraction(replay_data):
    _, make = replay_data
    data = make()
    data.setup("fit")
    real = len(data.prepared_index.split("train"))
    items = data.train_dataset.items
    replayed = [it for it in items if it.key.startswith("replay:")]
    assert len(items) == real + len(replayed) and len(replayed) == mixed_count(real, FRACTION) > 0
    assert abs(len(replayed) / len(items) - FRACTION) <= 1 / len(items)
    assert [it.key for it in replayed] == [it.key for it in data.replay_dataset.items * 2][: len(replayed)]
    # A built-in speaker the run does not train: an index after the run's, its own codec row.
    info = check_pretrained(data.pretrained)
    codec_ids = data.train_dataset.speaker_codec_ids
    assert all(it.speaker_index >= len(data.speaker_names) for it in replayed)
    assert {codec_ids[it.speaker_index] for it in replayed} == set(info.speakers.values())
    assert isinstance(data.val_dataloader(), list) and len(data.val_dataloader()) == 2
    again = make()
    again.setup("fit")
    assert list(again.train_dataloader().batch_sampler) == list(data.train_dataloader().batch_sampler)
    off = make(replay_fraction=0.0)
    off.setup("fit")
    assert len(off.train_dataset) == real and off.replay_dataset is None
    # A streaming run: its clips stream, the replay records keep the layout they were spoken in.
    streaming = make(streaming=True)
    streaming.setup("fit")
    for i, item in enumerate(streaming.train_dataset.items):
        mine, plain = streaming.train_dataset[i].sequence, data.train_dataset[i].sequence
        assert torch.equal(mine.text_ids, plain.text_ids) == item.key.startswith("replay:"), item.key
    assert streaming.replay_dataset is not None and streaming.replay_dataset.layout is None  # scored non-streaming


def test_replay_is_refused_without_built_in_speakers(make_datamodule):
    with pytest.raises(ConfigError, match=r"data.replay_fraction: replay needs a custom_voice model"):
        make_datamodule(replay_fraction=0.2).prepare_data()
    with pytest.raises(ConfigError, match=r"data.replay_fraction must be in \[0, 1\)"):
        make_datamodule(replay_fraction=1.0)


def _replay_loss(module, data, codec_id=None):
    """The module's loss on the replay records (of the speaker at ``codec_id``), in one batch."""
    dataset = data.replay_dataset
    rows = [i for i, it in enumerate(dataset.items) if codec_id in (None, dataset.speaker_codec_ids[it.speaker_index])]
    batch = data._collate([dataset[i] for i in rows])
    module.eval()
    with torch.no_grad():
        return float(module(batch).loss)


def _fit(tiny_custom_voice_dir, data, root, max_steps, *, ckpt_path=None, val_every=None):
    L.seed_everything(0)
    module = Qwen3TTSModule(str(tiny_custom_voice_dir), speakers=data.speaker_names, learning_rate=1e-3)
    every_step = L.pytorch.callbacks.ModelCheckpoint(root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        limit_val_batches=None if val_every else 0,
        val_check_interval=val_every,
        check_val_every_n_epoch=None if val_every else 1,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=[every_step],
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, trainer


@pytest.mark.slow
def test_replay_keeps_the_built_in_speakers(replay_data, tiny_custom_voice_dir, tmp_path):
    """12 steps at lr 1e-3 train the demo speakers; the built-in speakers' loss on their own speech
    (the replay records) is measured before and after, with replay on and off."""
    _, make = replay_data
    moved = {}
    for fraction in (0.0, FRACTION):
        data = make(replay_fraction=fraction)
        data.setup("fit")
        reference = make()
        reference.setup("fit")
        start = Qwen3TTSModule(str(tiny_custom_voice_dir), speakers=data.speaker_names)
        start.configure_model()
        before = _replay_loss(start, reference)
        module, trainer = _fit(tiny_custom_voice_dir, data, tmp_path / str(fraction), 12, val_every=12)
        after = _replay_loss(module, reference)
        moved[fraction] = after - before
        print(
            f"replay_fraction {fraction}: built-in speakers' loss {before:.4f} -> {after:.4f} ({after - before:+.4f})"
        )
        if fraction:  # validation scored the same records as val/replay_loss (a mean over batches)
            assert abs(float(trainer.callback_metrics["val/replay_loss"]) - after) < 0.05
        else:
            assert "val/replay_loss" not in trainer.callback_metrics
    assert moved[FRACTION] <= MARGIN
    assert moved[FRACTION] < moved[0.0]


@pytest.mark.slow
def test_replay_resumes_exactly_and_evaluate_reports_forgetting(replay_data, tiny_custom_voice_dir, tiny_dir, tmp_path):
    from tts_lightning.evaluation.evaluate import evaluate
    from tts_lightning.model.checkpoint import load_training_checkpoint

    cache, make = replay_data
    straight = tmp_path / "straight"
    # In the streaming layout (its exact resume from a custom_voice model), the replay records in theirs.
    _fit(tiny_custom_voice_dir, make(streaming=True), straight, 3)
    _fit(tiny_custom_voice_dir, make(streaming=True), tmp_path / "resumed", 3, ckpt_path=straight / "step=1.ckpt")
    final, again = (load_training_checkpoint(d / "step=3.ckpt").state_dict for d in (straight, tmp_path / "resumed"))
    assert final.keys() == again.keys()
    for key, value in final.items():  # resumed mid-epoch with replay records in the batches: the same weights
        torch.testing.assert_close(again[key], value, atol=0, rtol=0, msg=key)

    # The checkpoint exports from its own start (the CustomVoice model); --base is a base model for the zero-shot side.
    out, ckpt = tmp_path / "evaluation", straight / "step=3.ckpt"
    result = evaluate(ckpt, cache, out, base=tiny_dir, speakers=["alice"], texts=["Hi."], num_samples=1, icl=False)
    forgetting = json.loads((out / "evaluation.json").read_text())["forgetting"]
    assert forgetting == json.loads(json.dumps(result["forgetting"]))
    assert sorted(forgetting["speakers"]) == sorted(check_pretrained(tiny_custom_voice_dir).speakers)
    data = make()
    data.setup("fit")
    start = Qwen3TTSModule(str(tiny_custom_voice_dir), speakers=data.speaker_names)
    start.configure_model()
    trained = Qwen3TTSModule.load_from_checkpoint(straight / "step=3.ckpt")
    for name, s in forgetting["speakers"].items():
        assert s["difference"] == pytest.approx(s["after"]["loss"] - s["before"]["loss"])
        assert s["before"]["records"] == len(TEXTS)
    # The evaluation's loss is the training loss: the module's on each speaker's records, before and after.
    rows = check_pretrained(tiny_custom_voice_dir).speakers
    for model, when in ((start, "before"), (trained, "after")):
        for name, s in forgetting["speakers"].items():
            assert s[when]["loss"] == pytest.approx(_replay_loss(model, data, rows[name]), abs=1e-4), (name, when)
    table = (out / "evaluation.md").read_text()
    assert "Forgetting" in table and "similarity after/before" in table
    print(table[table.index("Forgetting") :])
    _check_built_in_audio(cache, out, forgetting, tiny_custom_voice_dir, tmp_path)


def _check_built_in_audio(cache, out, forgetting, start_dir, tmp_path):
    """evaluate's built-in speakers heard: per replay record, the starting model's speech (the record's
    codes decoded) and the fine-tuned model's with the same seed, written and decodable, and shown on
    evaluation.html (the forgetting table as in evaluation.json, every player's source decoding). The
    starting model through the same path says exactly its records: the seed and settings are the records'."""
    import soundfile as sf
    from browser import durations, open_page
    from qwen_tts import Qwen3TTSModel

    from tts_lightning.evaluation.built_in import speak_built_in

    _, records = read_records(read_pointer(cache))
    for name, s in forgetting["speakers"].items():
        assert [g["text"] for g in s["samples"]] == [r.text for r in records if r.speaker == name]
        for g, r in zip(s["samples"], (r for r in records if r.speaker == name)):
            for when in ("before", "after"):
                audio, sr = sf.read(g[f"{when}_audio"])
                assert sr == 24_000 and audio.size == round(g[f"{when}_seconds"] * sr) > 0
            assert g["before_seconds"] == r.frames * 1920 / 24_000  # 12.5 codec frames a second
            assert -1 <= g["similarity"] <= 1
    errors: list[str] = []
    with open_page(out / "evaluation.html", errors) as page:
        assert page.locator("h2#built-in").inner_text() == "Built-in speakers"
        shown = page.evaluate(
            """() => [...document.querySelectorAll('table.forgetting tr')].slice(1)
                .map(r => [...r.querySelectorAll('td')].map(td => td.innerText))"""
        )
        heard = {when: durations(page, f"audio.built-in.{when}") for when in ("before", "after")}
    assert not errors, errors
    assert [row[0] for row in shown] == list(forgetting["speakers"])
    for (_, n, before, after, difference), s in zip(shown, forgetting["speakers"].values(), strict=True):
        assert int(n) == s["before"]["records"] and float(difference) == pytest.approx(s["difference"], abs=5e-5)
        assert (float(before), float(after)) == pytest.approx((s["before"]["loss"], s["after"]["loss"]), abs=5e-5)
    for when, seconds in heard.items():
        expected = [g[f"{when}_seconds"] for s in forgetting["speakers"].values() for g in s["samples"]]
        assert seconds == pytest.approx(expected, abs=0.01) and len(seconds) == len(records)

    # One speaker's records (time): said again by the starting model, identical, similarity 1.
    start = Qwen3TTSModel.from_pretrained(str(start_dir), device_map="cpu", dtype=torch.float32)
    name = next(iter(forgetting["speakers"]))
    again = {"records": forgetting["records"], "speakers": {name: {}}}
    speak_built_in(start, again, tmp_path / "start-audio", device="cpu")
    assert len(again["speakers"][name]["samples"]) == len(TEXTS)
    for g in again["speakers"][name]["samples"]:
        before, after = (sf.read(g[f"{when}_audio"])[0] for when in ("before", "after"))
        np.testing.assert_allclose(after, before, atol=1e-4)
        assert g["similarity"] == pytest.approx(1.0, abs=1e-5)


def test_replay_texts_come_from_the_setting_the_file_or_the_shipped_list(tmp_path):
    from tts_lightning.data.replay import DEFAULT_TEXTS_FILE, replay_texts

    shipped = replay_texts(None, None)
    assert shipped == DEFAULT_TEXTS_FILE.read_text(encoding="utf-8").split("\n")[: len(shipped)] and len(shipped) >= 3
    lines = tmp_path / "texts.txt"
    lines.write_text("One.\n\n  Two.  \n", encoding="utf-8")
    assert replay_texts(["Zero."], str(lines)) == ["Zero.", "One.", "Two."]
    assert replay_texts(["Zero."], None) == ["Zero."]  # given texts replace the shipped list
    with pytest.raises(ConfigError, match=r"data.replay_texts_file: .*nope.txt not found"):
        replay_texts(None, str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="give no text to replay"):
        replay_texts(None, str(tmp_path / "empty.txt"))
