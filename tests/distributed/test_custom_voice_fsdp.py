"""Start from the tiny CustomVoice model and keep its voices: 2 new speakers and a built-in one
trained with instructs on 2 real FSDP ranks, exported, spoken through the official loader with every
speaker, with and without an instruct; exact resume in this layout. A shorter run in one process with
``--data.streaming true``: sampled, exported and spoken in the streaming layout
(``generate_custom_voice(non_streaming_mode=False)``), with and without an instruct (its exact resume:
tests/data/test_replay.py)."""

import json
import shutil

import pytest
import torch
from tiny_runs import TINY_CPU, data_args, fit_args, newest_last

from tts_lightning.data.demo import demo_dir
from tts_lightning.model.checkpoint import load_training_checkpoint
from tts_lightning.model.custom_voice import CODEC_EMBEDDING_KEY
from tts_lightning.model.pretrained import check_pretrained, load_state_dict

pytestmark = pytest.mark.slow
STEPS, EVERY, CRASH = 4, 2, 3
NEW, TRAINED, KEPT = ("alice", "bob"), "Vivian", ("ryan", "serena")
INSTRUCT = "Speak slowly, in a warm voice."


@pytest.fixture(scope="module")
def cli(run_cli):
    from tiny_runs import HERE

    def run(*args, cwd, check=True):
        return run_cli(*args, cwd=cwd, check=check, timeout=900, pythonpath=[HERE])

    return run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The demo clips: alice's and bob's first 8 (new speakers), the last 4 of each as the
    built-in "Vivian"; every other clip carries an instruct."""
    root = tmp_path_factory.mktemp("custom-voice")
    shutil.copytree(demo_dir(), root / "demo")
    lines = []
    for i, line in enumerate((root / "demo" / "train.jsonl").read_text().splitlines()):
        record = json.loads(line)
        if int(record["audio"][-8:-5]) >= 8:
            record["speaker"] = TRAINED
        if i % 2:
            record["instruct"] = INSTRUCT
        lines.append(json.dumps(record))
    (root / "demo" / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


# Samples after each validation, spoken with the speakers' rows (on_error raise: a failure fails the run).
SAMPLES = json.dumps(
    {
        "class_path": "tts_lightning.callbacks.SpeakerSamplesCallback",
        "init_args": {
            "texts": ["Hi."],
            "max_new_tokens": 8,
            "similarity": False,
            "baseline": False,
            "on_error": "raise",
        },
    }
)


def _fit(cli, workdir, tiny_custom_voice_dir, run, *extra, check=True):
    steps = ("--trainer.max_steps", STEPS, "--trainer.val_check_interval", EVERY, f"--trainer.callbacks+={SAMPLES}")
    return cli(*fit_args(TINY_CPU, workdir, tiny_custom_voice_dir, run, *steps, *extra), cwd=workdir, check=check)


@pytest.fixture(scope="module")
def fitted(cli, workdir, tiny_custom_voice_dir):
    _fit(cli, workdir, tiny_custom_voice_dir, "straight")
    return load_training_checkpoint(newest_last(workdir / "straight"))


STREAMED_STEPS = 2  # sampled, validated and checkpointed once
STREAMED = ("--data.streaming", "true", "--trainer.devices", 1, "--trainer.max_steps", STREAMED_STEPS)


@pytest.fixture(scope="module")
def streamed(cli, workdir, tiny_custom_voice_dir):
    """The run with data.streaming true, in one process, 2 steps (the layout is what differs)."""
    _fit(cli, workdir, tiny_custom_voice_dir, "streamed", *STREAMED)
    return load_training_checkpoint(newest_last(workdir / "streamed"))


def _start_rows(tiny_custom_voice_dir):
    info = check_pretrained(tiny_custom_voice_dir)
    return info, load_state_dict(info, prefix=CODEC_EMBEDDING_KEY)[CODEC_EMBEDDING_KEY]


def test_rows_train_and_built_in_rows_are_kept(fitted, tiny_custom_voice_dir):
    info, start = _start_rows(tiny_custom_voice_dir)
    hp = fitted.hyper_parameters
    assert hp["speakers"] == sorted([*NEW, TRAINED])  # the data module's order
    ids = dict(zip(hp["speakers"], hp["speaker_codec_ids"]))
    rows = fitted.state_dict[f"model.{CODEC_EMBEDDING_KEY}"]
    assert ids[TRAINED] == info.speakers["vivian"] and not torch.equal(rows[ids[TRAINED]], start[ids[TRAINED]])
    for name in NEW:
        assert ids[name] not in info.speakers.values()
        assert not torch.equal(rows[ids[name]], start[sorted(info.speakers.values())].mean(0))  # trained
    assert not torch.equal(rows[ids["alice"]], rows[ids["bob"]])  # one start, parted by their clips
    for name in KEPT:  # never in a batch: bit-equal, weight decay included
        assert torch.equal(rows[info.speakers[name]], start[info.speakers[name]]), name


def test_samples_speak_with_every_speaker(fitted, workdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list((workdir / "straight").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent), size_guidance={"audio": 0})
    acc.Reload()
    spoken = sorted(t for t in acc.Tags()["audio"] if t.startswith("samples/"))  # beside real/<speaker>
    assert spoken == [f"samples/{s}/0" for s in sorted([*NEW, TRAINED])]
    assert [e.step for e in acc.Audio("samples/alice/0")] == [EVERY, STEPS]


def test_export_speaks_with_every_speaker_with_and_without_instruct(fitted, workdir, tiny_custom_voice_dir, tiny_dir):
    from qwen_tts import Qwen3TTSModel
    from safetensors.torch import load_file

    from tts_lightning.model.export import export_custom_voice
    from tts_lightning.model.pretrained import PretrainedError

    ckpt = newest_last(workdir / "straight")
    with pytest.raises(PretrainedError, match="tts_model_type is 'base', but 'custom_voice' is required"):
        export_custom_voice(ckpt, workdir / "wrong", pretrained=tiny_dir)
    assert not (workdir / "wrong").exists()
    out = export_custom_voice(ckpt, workdir / "voice", dtype="fp32")
    model = Qwen3TTSModel.from_pretrained(str(out))
    expected = {"vivian", "ryan", "serena", "alice", "bob"}
    assert set(model.get_supported_speakers()) == expected
    spk_id = model.model.config.talker_config.spk_id
    exported = load_file(str(out / "model.safetensors"))[CODEC_EMBEDDING_KEY]
    trained = fitted.state_dict[f"model.{CODEC_EMBEDDING_KEY}"]
    _, start = _start_rows(tiny_custom_voice_dir)
    for name in expected:
        assert torch.equal(exported[spk_id[name]], trained[spk_id[name]]), name
    for name in KEPT:
        assert torch.equal(exported[spk_id[name]], start[spk_id[name]]), name
    spoken = {}
    for name in sorted(expected):
        for instruct in (None, INSTRUCT):
            torch.manual_seed(0)
            wavs, sr = model.generate_custom_voice(
                text="Hello there.", speaker=name, instruct=instruct, max_new_tokens=12
            )
            assert sr == 24_000 and wavs[0].ndim == 1 and wavs[0].size > 0, (name, instruct)
            spoken[name, instruct] = wavs[0]
    # Same seed: the instruct and the speaker both change what is said (each is read).
    for name in expected:
        assert not _same(spoken[name, None], spoken[name, INSTRUCT]), name
    # (alice and bob start from the same row, the built-in mean, and 4 warm-up steps part them
    # too little to change a seeded draw: their rows differ, checked above.)
    assert not _same(spoken["alice", None], spoken["vivian", None])
    assert not _same(spoken["ryan", None], spoken["serena", None])


def _same(a, b):
    return a.shape == b.shape and bool((a == b).all())


def test_predict_speaks_every_speaker_on_two_ranks(fitted, cli, workdir, tiny_custom_voice_dir):
    """`tts-lightning predict` of the 2-rank run on 2 FSDP1 ranks: each speaker's row is read through
    the codec embedding's own unit (its weight is a rank's flat shard outside that unit's forward:
    "speaker_embeddings must be (1, D) for 1 texts, got (1,)" before), as the checkpoint speaks."""
    from predicted_speech import assert_written_by_the_checkpoint, greedy_copy

    out = workdir / "predicted"
    greedy = greedy_copy(tiny_custom_voice_dir, workdir / "greedy")
    ckpt = newest_last(workdir / "straight")
    cli(
        "predict",
        "--config",
        TINY_CPU,
        *data_args(workdir, greedy),
        "--ckpt_path",
        ckpt,
        "--trainer.logger",
        "false",
        "--data.predict_texts",
        "[Hello there.]",
        "--trainer.callbacks+=tts_lightning.data.predict.PredictionWriter",
        "--trainer.callbacks.output_dir",
        out,
        cwd=workdir,
    )
    speakers = fitted.hyper_parameters["speakers"]
    written = sorted(p.name for p in out.glob("*.wav"))
    assert written == sorted(f"0000_{s}.wav" for s in speakers)
    assert_written_by_the_checkpoint(out, ckpt, greedy, ["Hello there."], speakers)


def test_streaming_run_samples_exports_and_speaks_streaming(streamed, workdir):
    """Sampled in the streaming layout at validation (on_error raise), then exported and spoken with
    ``generate_custom_voice(non_streaming_mode=False)``, with and without an instruct."""
    from qwen_tts import Qwen3TTSModel
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tts_lightning.model.export import export_custom_voice

    ckpt = newest_last(workdir / "streamed")
    assert streamed.global_step == STREAMED_STEPS
    assert sorted(streamed.hyper_parameters["speakers"]) == sorted([*NEW, TRAINED])
    (events,) = list((workdir / "streamed").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent), size_guidance={"audio": 0})
    acc.Reload()
    assert [e.step for e in acc.Audio("samples/alice/0")] == [STREAMED_STEPS]
    model = Qwen3TTSModel.from_pretrained(str(export_custom_voice(ckpt, workdir / "streamed-voice", dtype="fp32")))
    spoken = {}
    for instruct, streaming in ((None, True), (INSTRUCT, True), (None, False)):
        torch.manual_seed(0)
        layout = {"non_streaming_mode": not streaming, "max_new_tokens": 12}
        wavs, sr = model.generate_custom_voice(text="Hello there.", speaker="alice", instruct=instruct, **layout)
        assert sr == 24_000 and wavs[0].ndim == 1 and wavs[0].size > 0, (instruct, streaming)
        spoken[instruct, streaming] = wavs[0]
    # Same seed: the instruct and the layout each change what is said (each is read).
    assert not _same(spoken[None, True], spoken[INSTRUCT, True])
    assert not _same(spoken[None, True], spoken[None, False])


def test_resume_from_last_equals_uninterrupted(fitted, cli, workdir, tiny_custom_voice_dir):
    crash = f'{{"class_path": "crash_callbacks.CrashAt", "init_args": {{"step": {CRASH}}}}}'
    crashed = _fit(cli, workdir, tiny_custom_voice_dir, "resumed", f"--trainer.callbacks+={crash}", check=False)
    assert crashed.returncode != 0 and f"[CrashAt] rank 0 exits at global_step {CRASH}" in crashed.stdout
    assert load_training_checkpoint(workdir / "resumed" / "checkpoints" / "last.ckpt").global_step == EVERY
    _fit(cli, workdir, tiny_custom_voice_dir, "resumed", "--ckpt_path", "last")
    resumed = load_training_checkpoint(newest_last(workdir / "resumed"))
    assert resumed.global_step == fitted.global_step == STEPS
    assert resumed.state_dict.keys() == fitted.state_dict.keys()
    for key, value in fitted.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_fsdp2_layout_of_a_model_without_speaker_encoder(tiny_custom_voice_dir):
    """FSDP2's default groups name the speaker encoder, which a custom_voice model lacks: that
    group is left out (one gloo rank); any other group that matches nothing is still an error."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from tts_lightning.distributed.fsdp import import_classes
    from tts_lightning.distributed.fsdp2 import DEFAULT_GROUPS, DEFAULT_LAYERS, apply_fully_shard
    from tts_lightning.model.loading import build_model
    from tts_lightning.model.row_blocks import DEFAULT_TEXT_EMBEDDING_BLOCKS, split_text_embedding

    layers = tuple(import_classes(list(DEFAULT_LAYERS)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = build_model(check_pretrained(tiny_custom_voice_dir), load_weights=False)
        split_text_embedding(model, DEFAULT_TEXT_EMBEDDING_BLOCKS)  # as Qwen3TTSModule.configure_model
        apply_fully_shard(model, model, layer_classes=layers, groups=DEFAULT_GROUPS, mesh=mesh)
        assert isinstance(model.talker.model.codec_embedding, FSDPModule) and model.speaker_encoder is None
        names = {n for n, _ in model.named_parameters()}
        other = build_model(check_pretrained(tiny_custom_voice_dir), load_weights=False)
        with pytest.raises(ValueError, match=r"FSDP2 group \['talker.nope'\] matches no module"):
            apply_fully_shard(other, other, layer_classes=layers, groups=[["talker.nope"]], mesh=mesh)
    finally:
        dist.destroy_process_group()
    # The memory planner lays the units out the same way.
    from tts_lightning.distributed.memory import model_shape

    planned = model_shape(tiny_custom_voice_dir, layout="fsdp2")
    assert "speaker_encoder" not in {u.name for u in planned.units}
    assert {n for u in planned.units for n, _ in u.params} == names
