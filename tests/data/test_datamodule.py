from __future__ import annotations

import json
import logging
import random
import re
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import soundfile as sf
import torch

from tts_lightning.__main__ import main
from tts_lightning.data.cache_folder import CACHEDIR_TAG
from tts_lightning.data.datamodule import DistributedSamplerError, SpeakerClipsDataModule, rank_device
from tts_lightning.data.demo import demo_dir
from tts_lightning.data.manifest import ClipRecord
from tts_lightning.data.prepare_cli import prepare_command
from tts_lightning.data.prepared_index import PreparedIndex
from tts_lightning.data.references import choose_references
from tts_lightning.data.selection import split_validation
from tts_lightning.data.validation import AcceptedClip
from tts_lightning.errors import ConfigError
from tts_lightning.model.sequence import TalkerBatch


@pytest.fixture(scope="module")
def prepared(tiny_dir, tmp_path_factory):
    """The demo set copied once per module and prepared once; tests only read it."""
    root = tmp_path_factory.mktemp("dm")
    shutil.copytree(demo_dir(), root / "demo", ignore=shutil.ignore_patterns(".*"))
    manifest = root / "demo" / "train.jsonl"
    SpeakerClipsDataModule(str(tiny_dir), str(manifest), max_frames_per_batch=400).prepare()
    return manifest


def make(tiny_dir, manifest, **kwargs) -> SpeakerClipsDataModule:
    kwargs.setdefault("max_frames_per_batch", 400)
    return SpeakerClipsDataModule(str(tiny_dir), str(manifest), **kwargs)


def val_audio(data: SpeakerClipsDataModule) -> set[str]:
    return {e["audio"] for e in json.loads(data.prepared_path.read_text())["clips"] if e["split"] == "val"}


def _clip(i: int, speaker: str = "s") -> AcceptedClip:
    record = ClipRecord(audio=Path(f"{i}.wav"), text="hi", speaker=speaker, source=f"m.jsonl:{i}")
    return AcceptedClip(record=record, duration=1.0, content_hash=f"{i:064x}")


def test_split_is_seeded_stable_and_never_empty():
    clips = [_clip(i) for i in range(30)]
    a = split_validation(clips, 0.1, seed=0)
    assert len(a) == 3 and a == split_validation(list(reversed(clips)), 0.1, seed=0)
    assert a != split_validation(clips, 0.1, seed=1)
    assert len(split_validation(clips, 0.001, seed=0)) == 1  # at least one
    assert len(split_validation(clips[:2], 0.9, seed=0)) == 1  # never all
    assert split_validation(clips[:1], 0.5, seed=0) == set() and split_validation(clips, 0.0, seed=0) == set()


def test_split_leaves_every_speaker_a_training_clip():
    alone = _clip(99, speaker="carol")  # carol's only clip: never validation, whatever its rank
    for seed in range(20):
        assert alone.content_hash not in split_validation([alone, *map(_clip, range(9))], 0.2, seed=seed)
    assert split_validation([_clip(0, "a"), _clip(1, "b")], 0.5, seed=0) == set()  # one clip each: no split
    assert len(split_validation([alone, *map(_clip, range(9))], 0.2, seed=0)) == 2  # the count kept


def test_split_shares_the_validation_clips_among_the_speakers():
    """Each speaker is validated on in proportion to its clips (the demo's 0.15 of 2 x 12 clips put
    all 4 on alice before, none on bob); a speaker too small for a share may have none."""
    two = [_clip(i, "alice") for i in range(12)] + [_clip(100 + i, "bob") for i in range(12)]
    for seed in range(20):
        chosen = split_validation(two, 0.15, seed=seed)
        assert sorted(c.record.speaker for c in two if c.content_hash in chosen) == ["alice"] * 2 + ["bob"] * 2
    three = [_clip(i, "a") for i in range(20)] + [_clip(100 + i, "b") for i in range(5)]
    three += [_clip(200 + i, "c") for i in range(5)]
    for seed in range(20):
        chosen = split_validation(three, 0.1, seed=seed)
        counts = Counter(c.record.speaker for c in three if c.content_hash in chosen)
        assert counts["a"] == 2 and counts["b"] + counts["c"] == 1, counts  # 3 = 2 + one remainder


def test_the_notice_of_unvalidated_speakers_says_why():
    from tts_lightning.data.selection import unvalidated_notice

    clips = [_clip(i, "a") for i in range(5)] + [_clip(10 + i, "c") for i in range(5)] + [_clip(30, "b")]
    clips += [_clip(40 + i, f"s{i:02d}") for i in range(10)]  # 21 clips: 0.05 of them is 1
    chosen = split_validation(clips, 0.05, seed=0)
    (validated,) = {c.record.speaker for c in clips if c.content_hash in chosen}
    (unreached,) = {"a", "c"} - {validated}
    assert unvalidated_notice([unreached, "b"], clips, 0.05, None) == (
        f"no validation clips of {unreached} (data.val_fraction 0.05 does not reach them, 0.08 would: or give a "
        "data.val_manifest); of b (one clip each, kept for training): val/loss does not measure them"
    )
    for fraction, reached in ((0.07, {validated}), (0.08, {"a", "c"})):  # 0.08 of 21 clips is 2
        chosen = split_validation(clips, fraction, seed=0)
        assert {c.record.speaker for c in clips if c.content_hash in chosen} == reached
    many = unvalidated_notice([f"s{i:02d}" for i in range(10)], clips, 0.1, None)
    assert "s00, s01, s02, s03, s04, s05, s06, s07 and 2 more (one clip each" in many
    assert unvalidated_notice(["a"], clips, 0.1, "val.jsonl") == (
        "no validation clips of a in val.jsonl: val/loss does not measure them"
    )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"val_fraction": 1.0}, r"val_fraction must be in \[0, 1\), got 1.0"),
        ({"max_frames_per_batch": None}, "set max_frames_per_batch, batch_size, or both"),
        ({"normalize": "loud"}, "normalize must be None, 'peak' or 'rms', got 'loud'"),
        ({"num_workers": -1}, "num_workers must be >= 0, got -1"),
        ({"manifest_encoding": "klingon-8"}, "unknown manifest_encoding 'klingon-8'"),
        ({"speakers": ["a", "b", "a"]}, r"speakers must be a non-empty list of distinct names, got \['a', 'b', 'a'\]"),
        ({"speakers": []}, r"distinct names, got \[\]"),
        ({"clipped_action": "drop"}, "clipped_action must be one of"),
    ],
)
def test_bad_arguments_are_refused_when_the_data_module_is_built(arguments, message):
    with pytest.raises(ValueError, match=message):
        SpeakerClipsDataModule("nowhere", "nowhere/train.jsonl", **arguments)


def test_the_preparation_arguments_become_the_settings_and_all_arguments_the_hparams():
    data = SpeakerClipsDataModule("p", "train.jsonl", speakers=["b", "a"], seed=3, batch_size=4, num_workers=1)
    assert data.settings.speakers == ("b", "a") and data.settings.seed == 3 and data.settings.pretrained == "p"
    assert data.hparams["batch_size"] == 4 and data.hparams["seed"] == 3 and "speakers" not in data.hparams


def test_split_stable_across_instances(tiny_dir, prepared):
    try:
        first = make(tiny_dir, prepared, seed=0)
        first.prepare()
        split0 = val_audio(first)
        second = make(tiny_dir, prepared, seed=0)
        second.prepare()
        assert val_audio(second) == split0 and len(split0) == 2  # round(0.1 * 24)
        other = make(tiny_dir, prepared, seed=1)
        other.prepare()
        assert val_audio(other) != split0
    finally:
        make(tiny_dir, prepared).prepare()  # leave the module's cache with the default settings


def test_setup_reads_only_files(tiny_dir, prepared):
    data = make(tiny_dir, prepared)  # a fresh instance: prepare_data never ran on it
    data.setup("fit")
    assert data.speaker_names == ["alice", "bob"]
    emb = data.speaker_embeddings()
    assert emb.dtype == torch.float32 and emb.shape == (2, 64)
    assert len(data.train_dataset) == 22 and len(data.val_dataset) == 2

    # The typed index is prepared.json: the same JSON, byte for byte, and the JSON readers still get a dict.
    index = data.prepared_index
    assert isinstance(index, PreparedIndex) and index.speaker_names == ["alice", "bob"]
    assert [len(index.split("train")), len(index.split("val"))] == [22, 2]
    assert all(c.frames > 0 and isinstance(c.frames, int) for c in index.clips)
    text = data.prepared_path.read_text(encoding="utf-8")
    assert json.dumps(index.to_json(), indent=2, ensure_ascii=False) + "\n" == text
    assert PreparedIndex.from_json(json.loads(text)) == index and data.read_index() == json.loads(text)

    # Other settings than the index was prepared with: refuse rather than train on stale data.
    with pytest.raises(RuntimeError, match="seed"):
        make(tiny_dir, prepared, seed=5).setup("fit")
    with pytest.raises(FileNotFoundError, match="prepare"):
        make(tiny_dir, prepared, cache_dir=str(prepared.parent / "empty")).setup("fit")


def test_train_batches_are_consistent_and_respect_the_frame_cap(tiny_dir, prepared):
    data = make(tiny_dir, prepared)
    data.setup("fit")
    table = data.speaker_embeddings()
    lengths = data.train_dataset.lengths()
    seen = 0
    for batch in data.train_dataloader():
        assert isinstance(batch, TalkerBatch)
        B, S = batch.text_ids.shape
        F = batch.codes.shape[1]
        assert batch.codec_ids.shape == (B, S, 16) and batch.labels.shape == (B, S)
        assert batch.attention_mask.shape == batch.speaker_mask.shape == (B, S)
        assert batch.codes.shape == (B, F, 16) and batch.frame_mask.shape == batch.frame_positions.shape == (B, F)
        assert batch.speaker_mask.sum(1).eq(1).all()
        assert torch.equal(batch.speaker_embedding, table[batch.speaker_index])
        assert B * S <= 400  # padded talker positions (prefill + frames) under the cap
        # One label per frame plus eos, on real positions only.
        assert torch.equal((batch.labels != -100).sum(1), batch.frame_mask.sum(1) + 1)
        assert ((batch.labels != -100) <= batch.attention_mask.bool()).all()
        seen += B
    assert seen == len(lengths) == 22
    # The validation loader is deterministic.
    val = [b.codes.sum().item() for b in data.val_dataloader()]
    assert val == [b.codes.sum().item() for b in data.val_dataloader()]


def test_ranks_get_disjoint_batches_and_a_distributed_sampler_is_refused(tiny_dir, prepared):
    # A real 2-process Trainer (not launched) that would inject a DistributedSampler: refused by
    # setup (before any encoding) and by the loaders, with what to set; the flag is left as it was.
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False)
    data = make(tiny_dir, prepared)
    data.trainer = trainer
    with pytest.raises(
        DistributedSamplerError, match=r"2 ranks itself: build the Trainer with use_distributed_sampler"
    ):
        data.setup("fit")
    data.trainer = None
    data.setup("fit")
    data.trainer = trainer
    for hook in (data.train_dataloader, data.val_dataloader):
        with pytest.raises(DistributedSamplerError, match="use_distributed_sampler=False"):
            hook()
    assert trainer._accelerator_connector.use_distributed_sampler is True  # read, never written
    data.trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, use_distributed_sampler=False)
    assert len(data.train_dataloader()) > 0

    per_rank = []
    for rank in range(2):
        data = make(tiny_dir, prepared)
        data.setup("fit")
        connector = SimpleNamespace(use_distributed_sampler=False)
        data.trainer = SimpleNamespace(
            world_size=2, global_rank=rank, current_epoch=0, _accelerator_connector=connector
        )
        loader = data.train_dataloader()
        assert len(list(loader)) == len(loader)
        per_rank.append([tuple(b) for b in loader.batch_sampler])
    # Same number of batches on each rank; together they cover every clip, and only the batch
    # repeated to even out the count appears on both.
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    assert {i for batches in per_rank for b in batches for i in b} == set(range(22))
    assert len(set(per_rank[0]) & set(per_rank[1])) <= 1


def _digest(batch: TalkerBatch) -> tuple:
    """Every input the loss reads (the ICL reference and streaming text included), exactly."""
    return tuple(t.tolist() for t in (batch.text_ids, batch.codec_ids, batch.labels, batch.codes, batch.speaker_index))


@pytest.mark.parametrize("layout, streaming", [("xvector", False), ("xvector", True), ("icl", False), ("icl", True)])
def test_sampler_state_resumes_the_data_order(tiny_dir, prepared, layout, streaming):
    kwargs = dict(max_frames_per_batch=400 if layout == "icl" else 200, layout=layout, streaming=streaming)
    data = make(tiny_dir, prepared, **kwargs)
    data.setup("fit")
    full = [_digest(b) for b in data.train_dataloader()]
    assert len(full) >= 4

    data = make(tiny_dir, prepared, **kwargs)
    data.setup("fit")
    it = iter(data.train_dataloader())
    head = [_digest(next(it)) for _ in range(2)]
    state = data.state_dict()
    assert state["train_sampler"]["consumed"] == 2

    resumed = make(tiny_dir, prepared, **kwargs)
    resumed.load_state_dict(state)  # before setup / the loader exists, as Lightning does
    resumed.setup("fit")
    tail = [_digest(b) for b in resumed.train_dataloader()]
    assert head + tail == full


class _Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[tuple[int, float]] = []

    def training_step(self, batch: TalkerBatch, batch_idx: int):
        self.seen.append((self.current_epoch, batch.codes.sum().item()))
        return self.w * batch.codes.float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_trainer_resume_mid_epoch_continues_the_data_order(tiny_dir, prepared, tmp_path):
    kwargs = dict(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    ckpt = L.pytorch.callbacks.ModelCheckpoint(tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    full = _Recorder()
    L.Trainer(default_root_dir=tmp_path, callbacks=[ckpt], **kwargs).fit(
        full, make(tiny_dir, prepared, max_frames_per_batch=200)
    )
    epochs = [[s for e, s in full.seen if e == k] for k in (0, 1)]
    assert len(epochs[0]) > 3 and epochs[0] != epochs[1]  # set_epoch reached the sampler

    resumed = _Recorder()
    L.Trainer(default_root_dir=tmp_path / "r", **kwargs).fit(
        resumed, make(tiny_dir, prepared, max_frames_per_batch=200), ckpt_path=str(tmp_path / "step=3.ckpt")
    )
    assert resumed.seen == full.seen[3:]


def test_errors_name_the_manifest_and_the_speaker(tiny_dir, prepared, tmp_path):
    bad = tmp_path / "bad.jsonl"
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(24_000, dtype=np.float32), 24_000)
    bad.write_text(
        json.dumps({"audio": "missing.wav", "text": "hi"})
        + "\n"
        + json.dumps({"audio": str(silent), "text": "hi"})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl.*missing_file"):
        make(tiny_dir, bad).prepare()
    assert (tmp_path / ".tts_lightning_cache" / "report.json").is_file()  # the report is still written

    with pytest.raises(ValueError, match="'carol'"):
        make(tiny_dir, prepared, speakers=["alice", "carol"], cache_dir=str(tmp_path / "c")).prepare()
    # The quick check the CLI runs before starting other processes: the manifest's names only.
    with pytest.raises(ValueError, match=r"'carol' are not named by .*train\.jsonl \(its speakers: alice, bob\)"):
        make(tiny_dir, prepared, speakers=["alice", "carol"]).preparer.check_requested_speakers()
    make(tiny_dir, prepared, speakers=["bob"]).preparer.check_requested_speakers()
    with pytest.raises(ValueError, match=r"'Bob' \(did you mean 'bob'\?\) are not named by"):  # names are exact
        make(tiny_dir, prepared, speakers=["Bob"]).preparer.check_requested_speakers()


def test_a_speaker_left_without_clips_is_explained_and_an_unknown_language_rejects_one_clip(
    tiny_dir, prepared, write_tone, tmp_path
):
    entries = [json.loads(line) for line in prepared.read_text().splitlines()[:5]]
    for e in entries:
        e["audio"] = str(prepared.parent / e["audio"])
        e.pop("ref_audio")
    entries[4]["language"] = "en"  # the model's name is "english"
    short = write_tone(tmp_path / "carol.wav", seconds=0.2)
    entries.append({"audio": str(short), "text": "Hi.", "speaker": "carol"})
    manifest = tmp_path / "mixed.jsonl"
    manifest.write_text("".join(json.dumps(e) + "\n" for e in entries))

    with pytest.raises(
        ValueError, match=r"'carol': 1 clip\(s\) rejected \(too_short: 1\).*--data.speakers '\[alice\]'"
    ):
        make(tiny_dir, manifest).preparer.plan(show_report=False)
    plan = make(tiny_dir, manifest, speakers=["alice"]).preparer.plan(show_report=False)
    assert (tmp_path / ".tts_lightning_cache" / "CACHEDIR.TAG").read_text() == CACHEDIR_TAG
    assert len(plan.clips) == 4 and plan.speakers == ["alice"]
    (bad,) = [r for r in plan.report.rejected if r.source == "mixed.jsonl:5"]
    assert bad.reason == "malformed_entry" and "language 'en' is not supported" in bad.detail
    with pytest.raises(ValueError, match="^data.language: language 'klingon'"):
        make(tiny_dir, manifest, language="klingon").preparer.plan(show_report=False)


def test_prepare_command_prints_the_summary(tiny_dir, prepared, tmp_path, capsys):
    config = tmp_path / "fit.yaml"
    config.write_text(
        "trainer: {max_steps: 3}\nmodel: {learning_rate: 0.1}\n"
        "data:\n  class_path: tts_lightning.SpeakerClipsDataModule\n  init_args:\n"
        f"    pretrained: {tiny_dir}\n    train_manifest: {prepared}\n    max_frames_per_batch: 400\n"
    )
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_logger.addHandler(handler)
    try:
        assert prepare_command(["--config", str(config)]) == 0
    finally:
        rank_zero_logger.removeHandler(handler)
    out = capsys.readouterr().out
    assert "(2 speakers: alice, bob)" in out
    assert prepare_command(["--config", str(config), "--speakers", "[alice]"]) == 0
    assert "(1 speaker: alice)" in capsys.readouterr().out
    # The summary once: printed, not logged as well (in full, or as "data report unchanged").
    assert out.count("accepted 24 clips") == 1, out
    assert not [line for line in lines if "data report" in line or "accepted 24 clips" in line], lines
    assert any(line.startswith("prepared 24 clips (22 train, 2 val)") for line in lines), lines  # 1 each
    assert not [line for line in lines if "no validation clips" in line], lines
    # 0.05 of 24 clips is 1: one speaker is not validated on, and the summary says so.
    rank_zero_logger.addHandler(handler)
    try:
        assert prepare_command(["--config", str(config), "--val_fraction", "0.05"]) == 0
    finally:
        rank_zero_logger.removeHandler(handler)
    (unvalidated,) = [line for line in lines if "no validation clips" in line]
    assert re.fullmatch(
        r"no validation clips of (alice|bob) \(data.val_fraction 0.05 does not reach them, 0.07 would: .*", unvalidated
    )

    # Flat flags, a flat data: section, and a failure.
    assert (
        prepare_command(
            ["--pretrained", str(tiny_dir), "--data.train_manifest", str(prepared), "--max_frames_per_batch", "400"]
        )
        == 0
    )
    flat = tmp_path / "flat.yaml"
    flat.write_text(f"data:\n  pretrained: {tiny_dir}\n  train_manifest: {prepared}\n  speakers: [nobody]\n")
    assert main(["prepare", "--config", str(flat), "--cache_dir", str(tmp_path / "c")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("tts-lightning prepare: error: ") and "'nobody'" in line


def test_prepare_command_takes_the_manifest_encoding(tiny_dir, tmp_path, capsys):
    root = tmp_path / "lj"
    (root / "wavs").mkdir(parents=True)
    rows = []
    for i, clip in enumerate(["alice/alice_000", "alice/alice_001", "bob/bob_000"]):
        wave, sr = sf.read(demo_dir() / "clips" / f"{clip}.flac", dtype="float32")
        sf.write(root / "wavs" / f"c{i}.wav", wave, sr)
        rows.append(f"c{i}|{(demo_dir() / 'clips' / f'{clip}.txt').read_text().strip()} Café.")
    (root / "metadata.csv").write_bytes(("\n".join(rows) + "\n").encode("latin-1"))
    flags = ["--pretrained", str(tiny_dir), "--train_manifest", str(root), "--cache_dir", str(tmp_path / "c")]

    assert main(["prepare", *flags]) == 2
    (err,) = capsys.readouterr().err.splitlines()
    assert f"{root / 'metadata.csv'}: line 1" in err and "byte 0xe9" in err and "manifest_encoding" in err
    assert prepare_command(flags + ["--data.manifest_encoding", "latin-1"]) == 0
    assert "accepted 3 clips" in capsys.readouterr().out


def test_the_report_is_shown_once_per_fit(tiny_dir, prepared, tmp_path):
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_logger.addHandler(handler)
    try:
        data = make(tiny_dir, prepared, max_frames_per_batch=200)
        data.report_path.unlink()  # a report nobody has seen yet
        data.prepare()
        L.Trainer(
            accelerator="cpu",
            max_steps=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            default_root_dir=tmp_path,
        ).fit(_Recorder(), data)  # prepare_data prepares again
        make(tiny_dir, prepared).prepare()  # another instance (process): the same report, one line
    finally:
        rank_zero_logger.removeHandler(handler)
    reports = [line for line in lines if line.startswith("data report")]
    assert len(reports) == 2, lines
    assert reports[0].startswith("data report (") and "accepted 24 clips" in reports[0]
    assert reports[1] == f"data report unchanged ({data.report_path}): 24 clips accepted, 0 rejected"


@pytest.mark.slow  # multi-process or a model build: about a minute
def test_pretrained_tiny_is_built_once_into_the_user_cache_even_by_concurrent_ranks(
    tiny_dir, tmp_path, monkeypatch, run_script
):
    cache = tmp_path / "user-cache"
    script = "from tts_lightning.model.pretrained import check_pretrained as c; print('BUILT', c('tiny').path)"
    # Two processes started at the same moment (forked from warm interpreters), as the ranks of a run.
    proc = run_script("-c", script, timeout=300, ranks=2, env={"TTS_LIGHTNING_CACHE": str(cache)})
    paths = re.findall(r"^BUILT (.+)$", proc.stdout, flags=re.M)
    assert len(paths) == 2, proc.stdout + proc.stderr
    built = {Path(p) for p in paths}
    assert len(built) == 1 and [p.name for p in cache.iterdir()] == [next(iter(built)).name]  # no temp folder left
    (path,) = built
    files = sorted(p.relative_to(tiny_dir) for p in tiny_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    assert all((path / f).read_bytes() == (tiny_dir / f).read_bytes() for f in files)  # the seed-0 tiny model

    monkeypatch.setenv("TTS_LIGHTNING_CACHE", str(cache))
    assert SpeakerClipsDataModule("tiny", str(demo_dir() / "train.jsonl")).pretrained_dir == path


def test_a_cuda_prepare_device_means_each_ranks_own_gpu():
    """In a run on GPUs, `prepare_device: cuda:0` would load every rank's speech tokenizer (and a
    CUDA context per rank) on GPU 0; each rank takes its own."""
    gpu3 = torch.device("cuda", 3)
    assert rank_device("cuda:0", gpu3) == rank_device("cuda", gpu3) == "cuda:3"
    assert rank_device("cpu", gpu3) == "cpu" and rank_device(None, gpu3) is None
    assert rank_device("cuda:0", torch.device("cpu")) == "cuda:0"  # a CPU run: the user's choice stands


def test_icl_references_are_other_training_clips_of_the_speaker_and_bad_layouts_are_refused(tiny_dir, prepared):
    data = make(tiny_dir, prepared, layout="icl")
    data.setup("fit")
    clips = {c.audio: c for c in data.prepared_index.clips}
    items = data.train_dataset.items + data.val_dataset.items
    chosen = [it.reference.key for it in items]
    for item, key in zip(items, chosen):
        ref = clips[key]
        assert key != item.key and ref.split == "train" and ref.speaker == clips[item.key].speaker
        assert item.reference.frames == ref.frames
    assert len(set(chosen)) > 4  # not one reference for everyone
    again = make(tiny_dir, prepared, layout="icl")
    again.setup("fit")
    assert [it.reference.key for it in again.train_dataset.items + again.val_dataset.items] == chosen
    # The data folder moved (another machine, another temporary folder): the same references.
    here = data.prepared_index.clips
    moved = [replace(c, audio=f"/elsewhere/{c.speaker}/{Path(c.audio).name}") for c in here]
    assert choose_references(moved, seed=3) == choose_references(here, seed=3)
    # The choice of checkpoints written before the pool stopped being copied per clip (quadratic in the
    # clips of a speaker): random.choice over the speaker's other training clips.
    train = [i for i, c in enumerate(here) if c.split == "train"]
    copied = [
        random.Random(f"3:{c.content_hash}").choice([j for j in train if j != i and here[j].speaker == c.speaker])
        for i, c in enumerate(here)
    ]
    assert choose_references(here, seed=3) == copied

    with pytest.raises(ConfigError, match=r"^data.layout 'instruct' \(streaming=False\) is not offered"):
        make(tiny_dir, prepared, layout="instruct")
    clips_of = {s: [c for c in data.prepared_index.clips if c.speaker == s] for s in ("alice", "bob")}
    alone = clips_of["alice"] + clips_of["bob"][:1]  # bob: one clip
    with pytest.raises(ConfigError, match=r"^data.layout 'icl': speaker 'bob' has no other training clip"):
        choose_references([replace(c, split="train") for c in alone], seed=0)
