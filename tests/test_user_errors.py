"""Every command's user errors end in one message, ``tts-lightning <command>: error: ...``, and exit
status 2, without a traceback; bugs keep theirs (`tts_lightning.errors`).

The commands run in this process through the entry point (`tts_lightning.__main__.main`). For the
LightningCLI commands the Trainer is booby-trapped: what these tests provoke must be found while the
config is read and the model and data module are built, before any process would start (the
shipped config runs 2 FSDP processes). Errors only a running Trainer finds (the data preparation,
the predict texts) run with one process on the session's prepared demo clips."""

# ruff: noqa: E501  (the cases below read best one a line, each with its exact message)

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tts_lightning.__main__ import main
from tts_lightning.errors import USAGE, ConfigError, UserError, explain

REPO = Path(__file__).resolve().parents[1]
TINY_CPU = REPO / "configs" / "tiny-cpu.yaml"
GPU_CONFIG = TINY_CPU.parent / "qwen3-tts-1.7b-4x16gb.yaml"
FIT = [
    "--config",
    str(TINY_CPU),
    "--data.pretrained",
    "{tiny}",
    "--data.train_manifest",
    "{work}/demo/train.jsonl",
    "--data.cache_dir",
    "{work}/cache",
    "--trainer.default_root_dir",
    "{work}/run",
]
NO_PRETRAINED = (
    "pretrained directory '{work}/nope' does not exist: give a Qwen3-TTS 12 Hz directory, a hub id "
    "(Qwen/Qwen3-TTS-12Hz-1.7B-Base) or tiny"
)
CLASH = (
    "speaker names that differ only in case: 'Bob' and 'bob' in {work}/demo/clash.jsonl (an exported model "
    "looks speakers up in lower case): give each speaker one name, or train on some with --data.speakers"
)
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU is there")
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")

CASES = [
    # fit, validate: the config, read and built before any process starts
    ("fit", [*FIT, "--data.speakers", "[carol]"], "speaker(s) 'carol' are not named by {work}/demo/train.jsonl (its speakers: alice, bob)"),
    ("fit", [*FIT, "--data.pretrained", "{work}/nope"], NO_PRETRAINED),
    ("fit", [*FIT, "--data.train_manifest", "{work}/demo/clash.jsonl"], CLASH),
    ("fit", [*FIT, "--data.pretrained", "{work}/damaged"], "{work}/damaged/model.safetensors is damaged or incomplete (Error while deserializing header: incomplete metadata, file not fully covered): download or copy it again"),
    ("fit", [*FIT, "--data.pretrained", "{cv}", "--model.adapter.rank", "8"], "model.adapter: LoRA is not offered from a custom_voice model ({cv}): its speakers are codec-embedding rows that train in full; train without model.adapter"),
    ("fit", [*FIT, "--data.train_manifest", "{work}/nope.jsonl"], "manifest not found: {work}/nope.jsonl"),
    ("fit", [*FIT, "--data.train_manifest", "nope/train.jsonl"], "manifest not found: nope/train.jsonl (relative to the current folder, {cwd})"),
    ("fit", [*FIT, "--data.val_fraction", "2"], "val_fraction must be in [0, 1), got 2.0"),
    ("fit", [*FIT, "--data.num_reference_clips", "0"], "num_reference_clips must be positive, got 0"),
    ("fit", [*FIT, "--data.replay_fraction", "0.2"], "data.replay_fraction: replay needs a custom_voice model with built-in speakers as data.pretrained ({tiny} is 'base'); set data.replay_fraction: 0"),
    ("fit", [*FIT, "--data.pretrained", "{cv}", "--data.layout", "icl"], "data.layout 'icl' is not offered from a custom_voice model ({cv}): generate_voice_clone refuses non-base models and a CustomVoice model has no speaker encoder; use data.layout xvector (data.streaming true or false) or start from a *-Base model"),
    ("fit", [*FIT, "--data.pretrained", "{cv}", "--data.replay_fraction", "1"], "data.replay_fraction must be in [0, 1) (0: off), got 1.0"),
    ("fit", [*FIT, "--data.pretrained", "{cv}", "--data.replay_fraction", "0.2", "--data.replay_texts_file", "{work}/nope.txt"], "data.replay_texts_file: {work}/nope.txt not found; give a UTF-8 file with one text a line"),
    ("fit", [*FIT, "--data.manifest_encoding", "nope"], "unknown manifest_encoding 'nope'"),
    ("fit", [*FIT, "--model.adapter.rank", "0"], "model.adapter.rank must be >= 1, got 0"),
    ("fit", [*FIT, "--model.adapter.target_modules", "[]"], "model.adapter.target_modules is empty: name the nn.Linear layers to adapt"),
    ("fit", [*FIT, "--trainer.callbacks+=tts_lightning.callbacks.SpeakerSamplesCallback", "--trainer.callbacks.speakers", "[alcie]"], "SpeakerSamplesCallback: speakers 'alcie' (did you mean 'alice'?) are not in this run (alice, bob)"),
    ("validate", [*FIT, "--trainer.callbacks+=tts_lightning.callbacks.SpeakerSamplesCallback", "--trainer.callbacks.speakers", "[alcie]"], "SpeakerSamplesCallback: speakers 'alcie' (did you mean 'alice'?) are not in this run (alice, bob)"),
    ("fit", [*FIT, "--ckpt_path", "{work}/nope.ckpt"], "ckpt_path {work}/nope.ckpt does not exist: give a checkpoint file or a sharded checkpoint folder"),
    pytest.param("fit", [*FIT, "--trainer.accelerator", "gpu"], "No supported gpu backend found!", marks=no_gpu),
    ("validate", [*FIT, "--config", str(TINY_CPU.with_name("tiny-cpu-fsdp2.yaml")), "--ckpt_path", "{work}/lora-sharded"], "ckpt_path {work}/lora-sharded is a sharded checkpoint of FSDP1 (Qwen3TTSFSDPStrategy), this run uses FSDP2 (Qwen3TTSFSDP2Strategy): use the strategy it was written with (the config it was trained with); `tts-lightning export` reads either"),
    ("fit", [*FIT, "--ckpt_path", "{work}/lora-sharded/meta.pt"], "ckpt_path: {work}/lora-sharded/meta.pt is one file of the sharded checkpoint {work}/lora-sharded: give that folder"),
    ("fit", [*FIT, "--ckpt_path", "{work}/text.ckpt"], "ckpt_path: {work}/text.ckpt is not a checkpoint (not a whole file written by torch.save: another format, or cut short): give a checkpoint file or a sharded checkpoint folder"),
    ("fit", [*FIT, "--ckpt_path", "{tiny}/model.safetensors"], "ckpt_path: {tiny}/model.safetensors is not a checkpoint (not a whole file written by torch.save: another format, or cut short): give a checkpoint file or a sharded checkpoint folder"),
    ("fit", [*FIT, "--ckpt_path", "{work}/tensors.ckpt"], "ckpt_path: {work}/tensors.ckpt is not a Lightning checkpoint (no state_dict): give a checkpoint file or a sharded checkpoint folder"),
    ("fit", [*FIT, "--ckpt_path", "{work}/alice.ckpt"], "ckpt_path {work}/alice.ckpt was trained on the speakers [alice], this run has [alice, bob]: resume with its speakers (--data.speakers '[alice]' and its data), or start a new run"),
    ("fit", [*FIT, "--ckpt_path", "{work}/demo"], "ckpt_path: {work}/demo is a folder but not a sharded checkpoint (no .metadata file): give a checkpoint file or a sharded checkpoint folder"),
    ("fit", [*FIT, "--trainer.default_root_dir", "{work}/earlier"], "{work}/earlier/checkpoints holds the checkpoints of an earlier run (newest: last.ckpt): continue it with --ckpt_path last, or start this run in another --trainer.default_root_dir (or remove that folder)"),
    ("fit", [*FIT, "--ckpt_path", "{work}/lora-sharded"], "ckpt_path {work}/lora-sharded was trained with a LoRA adapter (model.adapter), this run is without a LoRA adapter: use the config it was trained with, or start a new run"),
    ("fit", [*FIT, "--data.cache_dir", "{work}/text.ckpt/cache"], "data.cache_dir {work}/text.ckpt/cache: {work}/text.ckpt is a file; give a folder"),
    ("validate", [*FIT, "--ckpt_path", "last"], "ckpt_path last: no checkpoint in {work}/run/checkpoints: give a checkpoint's path"),
    ("validate", [*FIT, "--ckpt_path", "best"], "ckpt_path best: no best checkpoint recorded in {work}/run/checkpoints: give a checkpoint's path"),
    ("validate", [*FIT, "--ckpt_path", "{work}/nope.ckpt"], "ckpt_path {work}/nope.ckpt does not exist: give a checkpoint file or a sharded checkpoint folder"),
    # synthesize: checked before the model is loaded
    ("synthesize", ["--model", "{work}/nope", "--text", "Hi.", "--out", "{work}/x.wav"], NO_PRETRAINED),
    ("synthesize", ["--model", "{work}/alice.ckpt", "--text", "Hi.", "--out", "{work}/x.wav"], "{work}/alice.ckpt is a training checkpoint, not a model directory: export it first (tts-lightning export --ckpt {work}/alice.ckpt --out DIR) and give DIR"),
    ("synthesize", ["--model", "{tiny}", "--text", "Hi.", "--out", "{work}/x.wav"], "{tiny} is a base model: pass --ref-audio CLIP (a clip of the voice to clone), or give a custom_voice model (`tts-lightning export`) and --speaker"),
    ("synthesize", ["--model", "{tiny}", "--ref-audio", "{work}/nope.wav", "--text", "Hi.", "--out", "{work}/x.wav"], "--ref-audio {work}/nope.wav does not exist"),
    ("synthesize", ["--model", "{cv}", "--text", "Hi.", "--out", "{work}/x.wav"], "{cv} is a custom_voice model: pass --speaker, one of ryan, serena, vivian"),
    ("synthesize", ["--model", "{cv}", "--speaker", "carol", "--text", "Hi.", "--out", "{work}/x.wav"], "--speaker 'carol' is not a speaker of {cv}; it has ryan, serena, vivian"),
    ("synthesize", ["--model", "{cv}", "--speaker", "ryan", "--language", "Klingon", "--text", "Hi.", "--out", "{work}/x.wav"], "--language 'Klingon' is not one of this model's: auto, chinese, english, french, german, japanese"),
    ("synthesize", ["--model", "{cv}", "--speaker", "ryan", "--text-file", "{work}/nope.txt", "--out", "{work}/x.wav"], "--text-file {work}/nope.txt does not exist"),
    ("synthesize", ["--model", "{cv}", "--speaker", "ryan", "--text-file", "{work}/demo", "--out", "{work}/x.wav"], "--text-file {work}/demo is a folder; give a text file with one text per line"),
    ("synthesize", ["--model", "{cv}", "--speaker", "ryan", "--device", "tpu9", "--text", "Hi.", "--out", "{work}/x.wav"], "--device 'tpu9' is not a device; use cpu, cuda or cuda:N"),
    pytest.param("synthesize", ["--model", "{cv}", "--speaker", "ryan", "--device", "cuda", "--text", "Hi.", "--out", "{work}/x.wav"], "--device cuda: CUDA is not available on this machine; use --device cpu", marks=no_gpu),
    # evaluate
    ("evaluate", ["--model", "{cv}", "--prepared", "{work}/nope", "--out", "{work}/ev", "--text-file", "{work}/nope.txt"], "--text-file {work}/nope.txt does not exist"),
    ("evaluate", ["--model", "{cv}", "--prepared", "{work}/nope", "--out", "{work}/ev"], "no prepared data index at {work}/nope: run `tts-lightning prepare --config ...` for the run's data first, or pass its cache folder (the run's data.cache_dir) with --prepared"),
    ("evaluate", ["--model", "{cv}", "--config", "{work}/nope.yaml", "--out", "{work}/ev"], "config {work}/nope.yaml does not exist"),
    ("evaluate", ["--model", "{cv}", "--config", "{work}/broken.yaml", "--out", "{work}/ev"], "config {work}/broken.yaml is not valid YAML (line 1, column 8): mapping values are not allowed here"),
    # prepare
    ("prepare", ["--config", "{work}/nope.yaml"], "config {work}/nope.yaml does not exist"),
    ("prepare", ["--pretrained", "{tiny}", "--train_manifest", "{work}/demo/clash.jsonl", "--cache_dir", "{work}/cache"], CLASH),
    ("prepare", ["--config", "{work}/broken.yaml"], "config {work}/broken.yaml is not valid YAML (line 1, column 8): mapping values are not allowed here"),
    ("prepare", ["--pretrained", "{tiny}", "--train_manifest", "{work}/nope.jsonl", "--cache_dir", "{work}/cache"], "manifest not found: {work}/nope.jsonl"),
    # tiny-model, export, plan, ray-fit
    ("tiny-model", ["{work}/text.ckpt"], "{work}/text.ckpt is a file; choose a folder path for the tiny model"),
    ("tiny-model", ["{work}/demo"], "{work}/demo exists and is not a tiny model directory; refusing to overwrite it: choose another path"),
    ("export", ["--ckpt", "{work}/nope.ckpt", "--out", "{work}/voice"], "checkpoint {work}/nope.ckpt does not exist"),
    ("export", ["--ckpt", "{work}/broken.yaml", "--out", "{work}/voice"], "{work}/broken.yaml is not a checkpoint (not a whole file written by torch.save: another format, or cut short)"),
    ("export", ["--ckpt", "{work}/lora-sharded/meta.pt", "--out", "{work}/voice"], "{work}/lora-sharded/meta.pt is one file of the sharded checkpoint {work}/lora-sharded: give that folder"),
    ("export", ["--ckpt", "{work}/lora-sharded/__0_0.distcp", "--out", "{work}/voice"], "{work}/lora-sharded/__0_0.distcp is one file of the sharded checkpoint {work}/lora-sharded: give that folder"),
    ("export", ["--ckpt", "{work}/earlier/ckpts", "--out", "{work}/voice"], "{work}/earlier/ckpts is a folder but not a sharded checkpoint (no .metadata file; it holds the checkpoints last.ckpt)"),
    ("export", ["--ckpt", "{work}/alice.ckpt", "--out", "{work}/notes"], "{work}/notes already exists; choose a new folder, or replace that export with --overwrite"),
    ("export", ["--ckpt", "{work}/alice.ckpt", "--out", "{work}/notes", "--overwrite"], "{work}/notes is not a model folder (it holds keep.txt): --overwrite replaces only an earlier export; choose a new folder for --out"),
    ("export", ["--ckpt", "{work}/alice.ckpt", "--out", "{tiny}", "--overwrite"], "{tiny} is a tiny model (`tts-lightning tiny-model`), not an export: choose a new folder"),
    ("export", ["--ckpt", "{work}/alice.ckpt", "--out", "{work}/text.ckpt/voice"], "{work}/text.ckpt/voice: {work}/text.ckpt is a file, not a folder; choose another --out"),
    ("plan", ["--config", "{work}/broken.yaml", "--gpu-memory", "16"], "config {work}/broken.yaml is not valid YAML (line 1, column 8): mapping values are not allowed here"),
    ("plan", ["--config", str(GPU_CONFIG), "--gpu-memory", "16", "--trainer.devices", "eight"], f"{GPU_CONFIG} with --trainer.devices eight: trainer.devices is 'eight'; pass the GPU count"),
    ("plan", ["--config", str(GPU_CONFIG), "--gpu-memory", "16", "--trainer.precision", "64-true"], f"{GPU_CONFIG} with --trainer.precision 64-true: trainer.precision '64-true' is not planned (bf16-mixed or 32-true)"),
    ("plan", ["--model", "nope", "--gpu-memory", "16"], "model 'nope': not a preset (1.7b, 0.6b), a released hub id (Qwen/Qwen3-TTS-12Hz-1.7B-Base, ...) or a directory with a config.json"),
    ("plan", ["--model", "{work}/badjson", "--gpu-memory", "16"], "{work}/badjson: its config.json is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("plan", ["--model", "{work}/demo", "--gpu-memory", "16"], "model '{work}/demo': not a preset (1.7b, 0.6b), a released hub id (Qwen/Qwen3-TTS-12Hz-1.7B-Base, ...) or a directory with a config.json"),
    pytest.param("ray-fit", [*FIT, "--trainer.strategy", "ddp"], "ray-fit trains with FSDP1 or FSDP2; trainer.strategy='ddp' is not supported (use auto or fsdp (FSDP1), tts_lightning.distributed.fsdp.Qwen3TTSFSDPStrategy (FSDP1) or tts_lightning.distributed.fsdp2.Qwen3TTSFSDP2Strategy (FSDP2))", marks=needs_ray),
    pytest.param("ray-fit", [*FIT, "--ckpt_path", "{work}/text.ckpt"], "ckpt_path: {work}/text.ckpt is not a checkpoint (not a whole file written by torch.save: another format, or cut short): give a checkpoint file or a sharded checkpoint folder", marks=needs_ray),
    pytest.param("ray-fit", [*FIT, "--trainer.default_root_dir", "{work}/earlier"], "{work}/earlier/checkpoints holds the checkpoints of an earlier run (newest: last.ckpt): continue it with --ckpt_path last, or start this run in another --trainer.default_root_dir (or remove that folder)", marks=needs_ray),
    pytest.param("ray-fit", [*FIT, "--trainer.accelerator", "gpu"], "trainer.accelerator is gpu, but without --ray.use_gpu Ray starts CPU workers: add --ray.use_gpu, or --trainer.accelerator cpu to train on CPU", marks=needs_ray),
    pytest.param("ray-fit", [*FIT, "--trainer.callbacks+=tts_lightning.callbacks.SpeakerSamplesCallback", "--trainer.callbacks.speakers", "[alcie]"], "SpeakerSamplesCallback: speakers 'alcie' (did you mean 'alice'?) are not in this run (alice, bob)", marks=needs_ray),
    pytest.param("ray-fit", [*FIT, "--config", str(TINY_CPU.with_name("tiny-cpu-fsdp2.yaml")), "--ckpt_path", "{work}/lora-sharded"], "ckpt_path {work}/lora-sharded is a sharded checkpoint of FSDP1 (Qwen3TTSFSDPStrategy), this run uses FSDP2 (Qwen3TTSFSDP2Strategy): use the strategy it was written with (the config it was trained with); `tts-lightning export` reads either", marks=needs_ray),
    pytest.param("ray-fit", [*FIT, "--data.speakers", "[carol]"], "speaker(s) 'carol' are not named by {work}/demo/train.jsonl (its speakers: alice, bob)", marks=needs_ray),
]  # fmt: skip


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_dir) -> Path:
    from tts_lightning.data.demo import demo_dir

    root = tmp_path_factory.mktemp("user-errors")
    shutil.copytree(demo_dir(), root / "demo")
    damaged = shutil.copytree(tiny_dir, root / "damaged")  # its weights cut short, as by an interrupted copy
    weights = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (root / "broken.yaml").write_text("data: a: b\n")
    (root / "text.ckpt").write_text("not a checkpoint\n")
    (root / "latin1.txt").write_bytes("Bon été.\n".encode("latin-1"))
    lines = (root / "demo" / "train.jsonl").read_text().splitlines()
    one_bob = [line for line in lines if '"bob"' not in line] + [next(line for line in lines if '"bob"' in line)]
    (root / "demo" / "one_bob.jsonl").write_text("\n".join(one_bob) + "\n")
    (root / "demo" / "clash.jsonl").write_text("\n".join([lines[0].replace('"alice"', '"Bob"'), *lines[1:]]) + "\n")
    torch.save({"weights": torch.zeros(2)}, root / "tensors.ckpt")
    # What the check reads of a Lightning checkpoint of this project: the module's tensors and its speakers.
    state = {
        "state_dict": {"model.talker.codec_head.weight": torch.zeros(2, 2)},
        "hyper_parameters": {"speakers": ["alice"]},
    }
    torch.save(state, root / "alice.ckpt")
    # A sharded checkpoint of a LoRA run (torch.distributed.checkpoint's layout, no process group).
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"model": {"model.talker.codec_head.weight": torch.zeros(2, 2)}},
        checkpoint_id=root / "lora-sharded",
        no_dist=True,
    )
    torch.save(
        {"hyper_parameters": {"speakers": ["alice", "bob"], "adapter": {"rank": 16}}}, root / "lora-sharded" / "meta.pt"
    )
    (root / "earlier" / "checkpoints").mkdir(parents=True)  # a run's folder: a new fit there is refused
    shutil.copy(root / "alice.ckpt", root / "earlier" / "checkpoints" / "last.ckpt")
    (root / "earlier" / "ckpts").mkdir(parents=True)  # a checkpoints folder, given where a checkpoint is asked
    shutil.copy(root / "alice.ckpt", root / "earlier" / "ckpts" / "last.ckpt")
    (root / "notes").mkdir()  # a folder of the user's: no export may replace it
    (root / "notes" / "keep.txt").write_text("keep\n")
    (root / "badjson").mkdir()
    (root / "badjson" / "config.json").write_text("{nope\n")
    return root


@pytest.fixture(autouse=True)
def command_line(monkeypatch):
    """sys.argv as the `tts-lightning` command sees it (LightningCLI warns about pytest's)."""
    monkeypatch.setattr(sys, "argv", ["tts-lightning"])


@pytest.fixture
def trapped_trainer(monkeypatch):
    """Reaching the Trainer (where Lightning would start the other processes) fails the test."""
    from lightning.pytorch.trainer import call

    def trap(*args, **kwargs):
        raise AssertionError("reached the Trainer")

    monkeypatch.setattr(call, "_call_and_handle_interrupt", trap)


def _fill(args: list[str], values: dict[str, Path]) -> list[str]:
    return [a.format(**values) for a in args]


def _run(command: str, args: list[str], capsys) -> tuple[int, str]:
    code = main([command, *args])
    return code, capsys.readouterr().err


def _one_message(err: str, command: str) -> str:
    """The error line, after checking that it is the only one and that no traceback came before it."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("tts-lightning ")]
    assert len(lines) == 1 and err.rstrip("\n").endswith(lines[0]), err
    prefix = f"tts-lightning {command}: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0][len(prefix) :]


@pytest.mark.parametrize(("command", "args", "message"), CASES)
def test_a_user_error_is_one_message_and_exit_status_2(
    command, args, message, work, tiny_dir, tiny_custom_voice_dir, trapped_trainer, capsys
):
    values = {"work": work, "tiny": tiny_dir, "cv": tiny_custom_voice_dir, "cwd": Path.cwd()}
    code, err = _run(command, _fill(args, values), capsys)
    assert (code, _one_message(err, command)) == (USAGE, message.format(**values))
    assert not (work / "cache").exists() and not (work / "run").exists()  # found before any work


def test_prepare_refuses_what_fit_would(work, tiny_dir, tmp_path, capsys):
    """An ICL run where a speaker has one clip: `prepare` passed it (status 0), then `fit` refused
    it on every rank. Said after the clips are prepared (the split decides): the cache is kept."""
    args = ["--pretrained", str(tiny_dir), "--train_manifest", str(work / "demo" / "one_bob.jsonl")]
    code, err = _run("prepare", [*args, "--cache_dir", str(tmp_path / "cache"), "--layout", "icl"], capsys)
    said = (
        f"data.layout 'icl': speaker 'bob' has no other training clip to serve as the reference of "
        f"{work}/demo/clips/bob/bob_000.flac; give it at least two training clips, or use data.layout xvector"
    )
    assert (code, _one_message(err, "prepare")) == (USAGE, said)
    assert (tmp_path / "cache" / "prepared.json").is_file()


@pytest.mark.parametrize(
    ("command", "args", "message"),
    [
        ("fit", ["--data.language", "klingon", "--data.cache_dir", "{work}/klingon"], "data.language: language 'klingon' is not supported by this model; use 'auto' or one of ['chinese', 'english', 'french', 'german', 'japanese']"),
        ("predict", [], "nothing to predict: give predict_texts and/or predict_texts_file (one text per line)"),
        ("predict", ["--data.predict_texts_file", "{work}/nope.txt"], "predict texts file {work}/nope.txt not found"),
        ("predict", ["--data.predict_texts_file", "{work}/latin1.txt"], "data.predict_texts_file {work}/latin1.txt is not UTF-8 text (invalid continuation byte at byte 4)"),
        ("predict", ["--data.predict_texts", "[Hi.]", "--data.predict_speakers", "[carol]"], "predict_speakers 'carol' are not speakers of this run (alice, bob)"),
    ],
)  # fmt: skip
def test_a_user_error_found_by_the_running_trainer(command, args, message, work, tiny_dir, demo_data, capsys):
    """One process, the session's prepared demo clips: the data module finds these in its hooks."""
    _, manifest, cache = demo_data
    values = {"work": work, "tiny": tiny_dir}
    run = [
        "--config",
        str(TINY_CPU),
        "--data.pretrained",
        str(tiny_dir),
        "--data.train_manifest",
        str(manifest),
        "--data.cache_dir",
        str(cache),
        "--data.max_frames_per_batch",
        "150",
        "--trainer.devices",
        "1",
        "--trainer.strategy",
        "auto",
        "--trainer.logger",
        "false",
        "--trainer.default_root_dir",
        str(work / "running"),
    ]
    code, err = _run(command, [*run, *_fill(args, values)], capsys)
    assert (code, _one_message(err, command)) == (USAGE, message.format(**values))


def test_a_parse_error_is_one_message_not_the_usage_of_every_option(work, tiny_dir, trapped_trainer, capsys):
    """LightningCLI's parser still exits (SystemExit 2, as argparse does), with two lines."""
    args = _fill([*FIT, "--model.learning_rate", "fast"], {"work": work, "tiny": tiny_dir})
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *args])
    assert exit_.value.code == USAGE
    assert capsys.readouterr().err == (
        "tts-lightning fit: error: Parser key \"model.learning_rate\": Expected a <class 'float'>. Got value: fast\n"
        "(`tts-lightning fit --help` lists every option)\n"
    )


def test_bad_yaml_in_a_config_names_the_file(work, tiny_dir, trapped_trainer, capsys):
    """jsonargparse names a YAML syntax error's place "<unicode string>": the file, line and column instead."""
    args = _fill([*FIT, "--config", "{work}/broken.yaml"], {"work": work, "tiny": tiny_dir})
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *args])
    assert exit_.value.code == USAGE
    assert capsys.readouterr().err == (
        f"tts-lightning fit: error: config {work}/broken.yaml is not valid YAML (line 1, column 8): mapping values "
        "are not allowed here\n(`tts-lightning fit --help` lists every option)\n"
    )


def test_a_config_url_is_read_as_jsonargparse_reads_it(work, tiny_dir, capsys):
    """Only local files are read ahead (to name bad YAML): a URL (s3://, https://, here fsspec's
    memory://) still reaches jsonargparse, which LightningCLI lets read remote configs."""
    import fsspec

    with fsspec.open("memory://tts-lightning/fit.yaml", "w") as f:
        f.write(TINY_CPU.read_text())
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", "memory://tts-lightning/fit.yaml", "--print_config"])
    assert exit_.value.code == 0
    assert "Qwen3TTSFSDPStrategy" in capsys.readouterr().out


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path, capsys):
    from tts_lightning.model import export

    def broken(*args, **kwargs):
        return {}["not a user error"]

    monkeypatch.setattr(export, "export_custom_voice", broken)
    with pytest.raises(KeyError, match="not a user error"):
        main(["export", "--ckpt", str(tmp_path / "a.ckpt"), "--out", str(tmp_path / "voice")])
    assert capsys.readouterr().err == ""


def test_the_traceback_of_a_user_error_on_request(monkeypatch, tmp_path):
    monkeypatch.setenv("TTS_LIGHTNING_TRACEBACK", "1")
    with pytest.raises(UserError, match="does not exist"):
        main(["export", "--ckpt", str(tmp_path / "nope.ckpt"), "--out", str(tmp_path / "voice")])


def test_what_counts_as_a_user_error():
    from tts_lightning.data.predict import read_texts
    from tts_lightning.files import WriteError

    def raised(make):
        try:
            make()
        except Exception as exc:
            return exc
        raise AssertionError("nothing raised")

    def wrapped(inner):  # as jsonargparse wraps what a link's compute_fn raises
        try:
            raise inner
        except Exception as exc:
            raise ValueError(f"Call to compute_fn failed: {exc}") from exc

    import tts_lightning

    assert tts_lightning.UserError is UserError  # public: `except tts_lightning.UserError`
    setting = ConfigError("model.adapter.rank must be >= 1, got 0")
    assert explain(setting) == (str(setting), 2)
    assert explain(raised(lambda: wrapped(setting))) == (str(setting), 2)  # unwrapped to the cause
    full = WriteError("/x/y.wav", OSError(28, "No space left on device"), free=0)
    assert explain(full) == (str(full), 1)  # the command was right: the disk was not
    # A check of the data side that raises a plain ValueError (its own `raise` statement) ...
    check = raised(lambda: read_texts([]))
    assert type(check) is ValueError and explain(check) == (str(check), 2)
    # ... but not a ValueError of a conversion in that code, nor one from a library: bugs.
    from tts_lightning.data.subtitles import _seconds

    conversion = raised(lambda: _seconds(None, "x", "0", "0"))
    assert type(conversion) is ValueError and explain(conversion) is None
    assert explain(raised(lambda: torch.zeros(2).view(3))) is None

    def while_handling():  # an error raised while handling a user error is a failure of its own
        try:
            raise setting
        except ConfigError:
            return {}["bug"]

    assert explain(raised(while_handling)) is None


def test_export_writes_into_an_empty_folder_and_replaces_only_an_export(tmp_path):
    """What `export` may write over: nothing, an empty folder, or (with --overwrite) an earlier
    export; `--out .` in a folder of the user's, or a run's folder, was deleted whole."""
    import json

    from tts_lightning.model.export import ExportError, check_replaceable

    empty = tmp_path / "empty"
    empty.mkdir()
    check_replaceable(empty, overwrite=False)
    check_replaceable(tmp_path / "new", overwrite=False)
    voice = tmp_path / "voice"
    voice.mkdir()
    (voice / "config.json").write_text(json.dumps({"model_type": "qwen3_tts"}))
    check_replaceable(voice, overwrite=True)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    check_replaceable(adapter, overwrite=True)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model_type": "other"}))
    with pytest.raises(ExportError, match="is not a model folder"):
        check_replaceable(run, overwrite=True)
