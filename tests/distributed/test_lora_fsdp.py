"""LoRA with 2 real FSDP ranks on CPU (`configs/tiny-cpu-lora.yaml`): it trains, only the adapters
get gradients and move, checkpoints hold the adapters only, a run killed mid-epoch resumes to the
same adapters (sharded and full checkpoints), and export merges them into a custom_voice directory
whose loss equals the training module's and that qwen_tts speaks with."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tts_lightning.data.demo import demo_dir
from tts_lightning.model.checkpoint import CheckpointReader, load_training_checkpoint

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu-lora.yaml"
STEPS, CHECKPOINT_EVERY, CRASH_AT = 8, 4, 6
CHECK_FROZEN = '{"class_path": "lora_callbacks.CheckFrozen"}'


def run_cli(*args, cwd, check=True, timeout=900):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{Path(__file__).parent}"}
    proc = subprocess.run(
        [sys.executable, "-m", "tts_lightning", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(Path(run_dir).rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_dir):
    import shutil

    root = tmp_path_factory.mktemp("lora")
    shutil.copytree(demo_dir(), root / "demo")
    return root


def fit_args(workdir, tiny_dir, run, *extra, config=CONFIG):
    return [
        "fit",
        "--config",
        config,
        "--data.pretrained",
        tiny_dir,
        "--data.train_manifest",
        workdir / "demo" / "train.jsonl",
        "--data.cache_dir",
        workdir / "cache",
        "--data.max_frames_per_batch",
        150,
        "--trainer.max_steps",
        STEPS,
        "--trainer.val_check_interval",
        CHECKPOINT_EVERY,
        "--trainer.default_root_dir",
        workdir / run,
        "--trainer.logger.init_args.save_dir",
        workdir / run,
        *extra,
    ]


def newest_last(run_dir):
    return max(Path(run_dir).rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)


@pytest.fixture(scope="module")
def runs(workdir, tiny_dir):
    """The uninterrupted LoRA runs, one per checkpoint format (the first checks gradients and frozen
    weights on every rank)."""
    out = {}
    for kind in ("sharded", "full"):
        extra = ["--trainer.strategy.init_args.state_dict_type", kind]
        if kind == "sharded":
            extra.append(f"--trainer.callbacks+={CHECK_FROZEN}")
        out[kind] = (
            workdir / f"straight-{kind}",
            run_cli(*fit_args(workdir, tiny_dir, f"straight-{kind}", *extra), cwd=workdir),
        )
    return out


def test_lora_trains_with_two_fsdp_ranks(runs):
    run_dir, proc = runs["sharded"]
    output = proc.stdout + proc.stderr
    for rank in (0, 1):
        assert re.search(
            rf"\[CheckFrozen\] rank {rank}: \d+ frozen weights unchanged, \d+ lora_B moved, "
            rf"{STEPS} backward passes checked",
            output,
        ), output[-3000:]
    assert len(re.findall(r"\[rank \d\] FSDP FULL_SHARD", output)) == 2
    val = [v for _, v in scalars(run_dir)["val/loss"]]
    assert len(val) == 2 and val[-1] < val[0], val
    state = load_training_checkpoint(newest_last(run_dir)).state_dict
    assert state and all(".lora_" in k or k == "speaker_embeddings" for k in state), sorted(state)[:5]
    assert any(".code_predictor." in k for k in state) and state["speaker_embeddings"].abs().sum() > 0


def test_lora_checkpoint_is_under_a_tenth_of_full_fine_tuning(runs, workdir, tiny_dir):
    full_ft = workdir / "full-ft"
    run_cli(
        *fit_args(
            workdir,
            tiny_dir,
            "full-ft",
            "--trainer.max_steps",
            1,
            "--trainer.val_check_interval",
            1,
            "--trainer.strategy.init_args.state_dict_type",
            "full",
            config=REPO / "configs" / "tiny-cpu.yaml",
        ),
        cwd=workdir,
    )
    lora = newest_last(runs["full"][0]).stat().st_size
    full = newest_last(full_ft).stat().st_size
    assert lora < 0.1 * full, (lora, full)
    print(f"LoRA / full fine-tuning checkpoint (full format): {lora} / {full} bytes = {lora / full:.3f}")


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_resume_gives_the_same_adapters(runs, workdir, tiny_dir, state_dict_type):
    run = f"resumed-{state_dict_type}"
    common = ("--trainer.strategy.init_args.state_dict_type", state_dict_type)
    crash = f'{{"class_path": "crash_callbacks.CrashAt", "init_args": {{"step": {CRASH_AT}}}}}'
    crashed = run_cli(
        *fit_args(workdir, tiny_dir, run, *common, f"--trainer.callbacks+={crash}"), cwd=workdir, check=False
    )
    assert crashed.returncode != 0 and f"exits at global_step {CRASH_AT}" in crashed.stdout
    assert load_training_checkpoint(workdir / run / "checkpoints" / "last.ckpt").global_step == CHECKPOINT_EVERY
    resumed = run_cli(*fit_args(workdir, tiny_dir, run, *common, "--ckpt_path", "last"), cwd=workdir)
    assert "Restoring states from the checkpoint path" in resumed.stdout + resumed.stderr
    straight = load_training_checkpoint(newest_last(runs[state_dict_type][0]))
    again = load_training_checkpoint(newest_last(workdir / run))
    assert straight.path.is_dir() == (state_dict_type == "sharded")
    assert straight.global_step == again.global_step == STEPS
    assert straight.state_dict.keys() == again.state_dict.keys()
    for key, value in straight.state_dict.items():
        torch.testing.assert_close(again.state_dict[key], value, atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_merged_export_equals_the_adapter_model(runs, workdir, tiny_dir, make_datamodule, state_dict_type):
    from tts_lightning import Qwen3TTSModule
    from tts_lightning.model.export import export_custom_voice
    from tts_lightning.model.loading import MetaWeights, build_empty_model
    from tts_lightning.model.loss import compute_loss
    from tts_lightning.model.pretrained import check_pretrained

    ckpt = newest_last(runs[state_dict_type][0])
    out = export_custom_voice(ckpt, workdir / f"voice-{state_dict_type}", dtype="fp32")
    reader = CheckpointReader(ckpt)
    import inspect

    accepted = inspect.signature(Qwen3TTSModule).parameters
    module = Qwen3TTSModule(**{k: v for k, v in reader.hyper_parameters.items() if k in accepted})
    module.configure_model()
    missing, unexpected = module.load_state_dict(reader.read(reader.tensor_keys()), strict=False)
    assert not unexpected and not (set(missing) & module.trainable_keys)

    info = check_pretrained(tiny_dir)
    plain = MetaWeights(model := build_empty_model(info), info).materialize_all(model)
    exported = load_file(str(out / "model.safetensors"))
    assert not any(".lora_" in k or ".base_layer." in k for k in exported)
    plain.load_state_dict(exported, strict=False)  # all but the dropped speaker encoder

    data = make_datamodule()
    data.setup("fit")
    batch = next(iter(data.val_dataloader()))
    with torch.no_grad():
        adapted = module.eval()(batch).loss
        merged = compute_loss(plain.eval().talker, batch, module.hparams.sub_talker_loss_weight).loss
        base = compute_loss(
            MetaWeights(m := build_empty_model(info), info).materialize_all(m).eval().talker,
            batch,
            module.hparams.sub_talker_loss_weight,
        ).loss
    assert abs(float(adapted) - float(merged)) < 1e-5, (float(adapted), float(merged))
    assert abs(float(adapted) - float(base)) > 1e-4  # the adapters changed the model

    from qwen_tts import Qwen3TTSModel

    voice = Qwen3TTSModel.from_pretrained(str(out))
    assert set(voice.get_supported_speakers()) == {"alice", "bob"}
    torch.manual_seed(0)
    wavs, sr = voice.generate_custom_voice(text="Hello there.", speaker="alice", max_new_tokens=24)
    assert sr == 24_000 and wavs[0].ndim == 1 and wavs[0].size > 0


def test_adapter_only_export_is_peft_format(runs, workdir, tiny_dir):
    from peft import PeftModel

    from tts_lightning.model.loading import MetaWeights, build_empty_model
    from tts_lightning.model.lora import MergedWeights
    from tts_lightning.model.pretrained import check_pretrained

    ckpt = newest_last(runs["sharded"][0])
    out = workdir / "adapter"
    run_cli("export", "--ckpt", ckpt, "--out", out, "--adapter-only", cwd=workdir)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert json.loads((out / "speakers.json").read_text())["speakers"] == ["alice", "bob"]
    merged = (
        load_file(str(workdir / "voice-sharded" / "model.safetensors"))
        if (workdir / "voice-sharded").exists()
        else None
    )

    info = check_pretrained(tiny_dir)
    base = MetaWeights(model := build_empty_model(info), info).materialize_all(model)
    peft_model = PeftModel.from_pretrained(base, str(out))
    weights = MergedWeights(peft_model.base_model.model)
    state = load_training_checkpoint(ckpt).state_dict
    layer = "talker.model.layers.0.self_attn.q_proj"
    a, b = state[f"model.{layer}.lora_A.default.weight"], state[f"model.{layer}.lora_B.default.weight"]
    expected = MetaWeights(m := build_empty_model(info), info).materialize_all(m).get_parameter(f"{layer}.weight")
    torch.testing.assert_close(weights[f"{layer}.weight"], expected + 2.0 * (b @ a), atol=1e-6, rtol=1e-5)
    if merged is not None:
        torch.testing.assert_close(weights[f"{layer}.weight"], merged[f"{layer}.weight"], atol=1e-6, rtol=1e-5)


def test_validate_a_lora_checkpoint_reports_the_logged_val_loss(runs, workdir, tiny_dir):
    import csv

    run_dir, _ = runs["sharded"]
    ckpt = next(c for c in sorted(run_dir.rglob("*.ckpt")) if c.name != "last.ckpt")
    logged = float(re.search(r"val_loss(\d+\.\d+)", ckpt.name).group(1))
    run_cli(
        "validate",
        "--config",
        CONFIG,
        "--data.pretrained",
        tiny_dir,
        "--data.train_manifest",
        workdir / "demo" / "train.jsonl",
        "--data.cache_dir",
        workdir / "cache",
        "--data.max_frames_per_batch",
        150,
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir",
        workdir / "validate",
        "--ckpt_path",
        ckpt,
        cwd=workdir,
    )
    rows = list(csv.DictReader(open(next((workdir / "validate").rglob("metrics.csv")))))
    reported = float(next(r["val/loss"] for r in rows if r.get("val/loss")))
    assert abs(reported - logged) < 1e-4, (reported, logged)


def test_bf16_mixed_keeps_the_frozen_base_in_bf16(workdir, tiny_dir):
    """Under bf16-mixed the frozen base is stored in bf16 (the adapters stay fp32) and it trains."""
    proc = run_cli(
        *fit_args(
            workdir,
            tiny_dir,
            "bf16",
            "--trainer.precision",
            "bf16-mixed",
            "--trainer.max_steps",
            2,
            "--trainer.val_check_interval",
            2,
            "--trainer.enable_checkpointing",
            "false",
            '--trainer.callbacks+={"class_path": "lora_callbacks.ReportDtypes"}',
        ),
        cwd=workdir,
    )
    output = proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"[ReportDtypes] rank {rank}: frozen torch.bfloat16, trainable torch.float32" in output, output[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in output
