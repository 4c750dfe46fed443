"""The memory planner: meta-built sizes, FSDP units as the strategy wraps them, scaling, fit/advice,
the activation formula against saved tensors, and the `plan` command."""

import json
import random
import re
from pathlib import Path

import pytest
import torch
import yaml

from tts_lightning.__main__ import main
from tts_lightning.distributed.memory import (
    CUDA_OVERHEAD_BYTES,
    TEXT_EMBEDDING,
    GiB,
    _activation_bytes,
    count_parameters,
    model_shape,
    plan_from_config,
    plan_memory,
)
from tts_lightning.distributed.plan_cli import plan_command
from tts_lightning.model.loading import build_model
from tts_lightning.model.pretrained import check_pretrained
from tts_lightning.model.row_blocks import DEFAULT_TEXT_EMBEDDING_BLOCKS, split_text_embedding

REPO = Path(__file__).resolve().parents[2]
BASE = dict(
    gpus=4,
    gpu_memory_gb=16,
    sharding="FULL_SHARD",
    precision="bf16-mixed",
    activation_checkpointing=True,
    cpu_offload=False,
    micro_batch_frames=2000,
)


@pytest.mark.parametrize("preset, expected", [("1.7b", 1_928.7e6), ("0.6b", 914.6e6)])
def test_preset_parameter_counts_match_the_shared_doc(preset, expected):
    assert count_parameters(preset) == pytest.approx(expected, rel=0.01)
    units = {u.name: u.numel for u in model_shape(preset).units}
    blocks = [n for name, n in units.items() if name.startswith(f"{TEXT_EMBEDDING}.blocks.")]
    assert len(blocks) == DEFAULT_TEXT_EMBEDDING_BLOCKS  # the text embedding's row blocks, a unit each
    assert sum(blocks) == pytest.approx(311.2e6, rel=0.001) and max(blocks) - min(blocks) <= 2048
    assert sum(units.values()) == count_parameters(preset)  # every parameter in exactly one unit


def test_1_7b_components():
    units = model_shape("1.7b").units
    layers = [u for u in units if u.name.startswith("talker.model.layers.")]
    assert len(layers) == 28 and layers[0].numel == pytest.approx(50.3e6, rel=0.001)
    assert units[0].name == "" and units[0].numel < 70e6  # root: heads, projections, speaker encoder


def test_tiny_directory_count_equals_the_built_model(tiny_dir):
    model = build_model(check_pretrained(tiny_dir))
    assert count_parameters(tiny_dir) == sum(p.numel() for p in model.parameters())


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")
def test_units_are_the_units_fsdp_builds(tiny_dir):
    """Wrap the tiny model with FSDP and the strategy's policy: same units, same sizes."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from tts_lightning.distributed.fsdp import DEFAULT_WRAP, import_classes

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    model = build_model(check_pretrained(tiny_dir), load_weights=False)
    split_text_embedding(model, DEFAULT_TEXT_EMBEDDING_BLOCKS)  # as Qwen3TTSModule.configure_model
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrapped = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy(import_classes(DEFAULT_WRAP)),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )
        names = {id(m): n.replace("_fsdp_wrapped_module.", "") for n, m in wrapped.named_modules()}
        fsdp_units = sorted(
            (names[id(m)], m._handle.flat_param._unpadded_unsharded_size.numel())
            for m in FSDP.fsdp_modules(wrapped)
            if m._handle is not None
        )
    finally:
        dist.destroy_process_group()
    planned = sorted((u.name, u.numel) for u in model_shape(tiny_dir).units)
    assert fsdp_units == planned


def test_full_shard_scales_with_gpus_no_shard_does_not():
    full = {n: plan_memory("1.7b", **{**BASE, "gpus": n}).model_states for n in (2, 4, 8)}
    assert full[4] / full[2] == pytest.approx(0.5, rel=0.01)
    assert full[8] / full[4] == pytest.approx(0.5, rel=0.01)
    none = {n: plan_memory("1.7b", **{**BASE, "gpus": n, "sharding": "NO_SHARD"}).model_states for n in (2, 8)}
    assert none[2] == none[8]
    assert none[2] == pytest.approx(16 * 1.9287e9, rel=0.01)  # the doc's 30.9 GB for DDP


def test_1_7b_on_4x16gb_fits_with_full_shard_and_checkpointing():
    plan = plan_memory("1.7b", **BASE)
    assert plan.model_states == pytest.approx(7.7e9, rel=0.01)  # shared doc: 7.7 GB per GPU
    assert plan.fits and plan.headroom > 0 and plan.advice == []
    # a talker decoder layer in bf16, no longer the text embedding (row blocks of 38.9M parameters)
    assert plan.largest_gathered_unit == 2 * 50_336_000 and plan.largest_unit_name == "talker.model.layers.0"
    table = plan.table()
    assert "GiB per GPU" in table and "optimizer states" in table and "activations" in table


def test_without_checkpointing_it_does_not_fit_and_advice_says_so():
    plan = plan_memory("1.7b", **{**BASE, "activation_checkpointing": False})
    assert not plan.fits
    assert "activation checkpointing" in plan.advice[0] and plan.advice[0].endswith("(fits)")


def test_no_shard_does_not_fit_and_advice_names_full_shard():
    plan = plan_memory("1.7b", **{**BASE, "sharding": "NO_SHARD"})
    assert not plan.fits
    assert any("FULL_SHARD" in a and a.endswith("(fits)") for a in plan.advice)


def test_advice_names_a_leaner_optimizer_before_more_gpus_or_offload():
    """1.7B on one 16 GB card with the text embedding frozen: 8-bit moments, then bf16 weights with
    stochastic rounding (switching a 32-true run to bf16-mixed, which they need), and no more."""
    one_card = {**BASE, "gpus": 1, "freeze": ["speaker_encoder", TEXT_EMBEDDING]}
    plan = plan_memory("1.7b", **one_card)
    assert [a.split(" (")[0] for a in plan.advice] == [
        "use model.optimizer adamw8bit",
        "use model.optimizer bf16_sr_adamw8bit",
    ], plan.advice
    assert plan.advice[-1].endswith("(fits)") and not plan.advice[0].endswith("(fits)")
    lean = plan_memory("1.7b", **{**one_card, "optimizer": "bf16_sr_adamw8bit"})
    assert lean.fits and plan.advice[-1].endswith(f"-> {lean.total / 2**30:.1f} GiB per GPU (fits)")
    fp32 = plan_memory("1.7b", **{**one_card, "precision": "32-true"})
    assert "use model.optimizer bf16_sr_adamw8bit and trainer.precision bf16-mixed (" in fp32.advice[-1]
    # LoRA trains adapters only: their optimizer state is not what fills the card.
    lora = plan_memory("1.7b", **{**one_card, "gpu_memory_gb": 4, "adapter": {"rank": 16}})
    assert not any("model.optimizer" in a for a in lora.advice), lora.advice


def test_advice_says_when_the_optimizer_fits_without_the_freeze_before_it():
    """0.6B on one 8 GB card: the advice freezes the text embedding first, then reaches
    bf16_sr_adamw8bit; that optimizer alone fits too, with everything trained: said, as an 'or'."""
    plan = plan_memory("0.6b", **{**BASE, "gpus": 1, "gpu_memory_gb": 8})
    alone = plan_memory("0.6b", **{**BASE, "gpus": 1, "gpu_memory_gb": 8, "optimizer": "bf16_sr_adamw8bit"})
    assert alone.fits and not plan.fits
    assert plan.advice[0].startswith(f"freeze {TEXT_EMBEDDING}") and plan.advice[-2].endswith("(fits)")
    assert plan.advice[-1] == (
        f"or, {TEXT_EMBEDDING} trained too (not frozen), model.optimizer bf16_sr_adamw8bit: "
        f"{alone.total / 2**30:.1f} GiB per GPU (fits)"
    )
    # Already frozen by the user: nothing to add.
    frozen = plan_memory(
        "0.6b", **{**BASE, "gpus": 1, "gpu_memory_gb": 8, "freeze": ["speaker_encoder", TEXT_EMBEDDING]}
    )
    assert not any(a.startswith("or, ") for a in frozen.advice), frozen.advice


def test_freezing_text_embedding_and_cpu_offload():
    base = plan_memory("1.7b", **BASE)
    frozen = plan_memory("1.7b", **BASE, freeze=["speaker_encoder", TEXT_EMBEDDING])
    # its own unit: no gradient and no AdamW state, 12 bytes per parameter, sharded 4 ways
    assert base.model_states - frozen.model_states == pytest.approx(311_164_928 * 12 / 4, rel=0.001)
    off = plan_memory("1.7b", **{**BASE, "cpu_offload": True})
    assert off.parameters == off.gradients == off.optimizer_states == 0
    assert off.host_memory == base.model_states and off.total < base.total


def test_activation_formula_matches_saved_tensors(monkeypatch):
    """Bytes autograd saves for `compute_loss` (plus the talker's kept fp32 logits and their
    gradients, the code predictor's kept NLL and top-1 codes) on a small model of the real classes,
    against the planner's formula without checkpointing. The code predictor's heads run checkpointed
    in any case (`loss.predictor_losses`): their block is a transient, not saved (the planner's
    term is measured by tests/distributed/test_row_chunks.py), left out here."""
    from tts_lightning.distributed.memory import activations

    monkeypatch.setattr(activations, "HEAD_LOGIT_BYTES", 0)
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    from tts_lightning.model.loss import compute_loss
    from tts_lightning.model.sequence import SpecialIds, build_sequence, collate
    from tts_lightning.model.tiny import tiny_configs

    config, _ = tiny_configs()
    talker = config["talker_config"]
    talker.update(
        hidden_size=256,
        intermediate_size=768,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_scaling={"rope_type": "default", "mrope_section": [16, 8, 8], "interleaved": True},
    )
    talker["code_predictor_config"].update(
        hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )
    config["speaker_encoder_config"]["enc_dim"] = 256
    cfg = Qwen3TTSConfig.from_dict(config)
    for c in (cfg, cfg.talker_config, cfg.talker_config.code_predictor_config):
        c._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3TTSForConditionalGeneration(cfg).to(torch.bfloat16)
    rng = random.Random(0)
    ids = SpecialIds.from_config(config)
    seqs = [
        build_sequence(
            ids,
            [1, 2, 3] + [rng.randrange(300) for _ in range(10)] + [4, 5, 6, 7, 8],
            torch.randint(0, 256, (60 - 10 * i, 16)),
        )
        for i in range(3)
    ]
    batch = collate(seqs, torch.randn(3, 256), [0, 1, 2], pad_text_id=0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compute_loss(model.talker, batch)
    logits = out.talker_logits
    assert logits.untyped_storage().data_ptr() not in saved
    measured = (
        sum(saved.values())
        + logits.untyped_storage().nbytes()
        + 4 * logits.numel()
        + out.predictor_nll.untyped_storage().nbytes()
        + out.predictor_predictions.untyped_storage().nbytes()
    )
    acts, logit_bytes = _activation_bytes(
        model_shape(config).dims,
        batch.text_ids.numel(),
        2,
        False,
        False,
        frames=int(batch.frame_mask.sum()),
        targets=int((batch.labels != -100).sum()),
    )
    assert acts + logit_bytes == pytest.approx(measured, rel=0.03)


def test_plan_command_exit_codes(capsys):
    assert plan_command(["--model", "1.7b", "--gpus", "4", "--gpu-memory", "16"]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "optimizer states" in out
    # The options list says what adamw4bit costs in quality (docs/benchmarks.md), on its line only.
    caveats = [line for line in out.splitlines() if "prefer adamw8bit" in line]
    assert [line.split()[0] for line in caveats] == ["adamw4bit"]
    assert plan_command(["--model", "1.7b", "--gpus", "4", "--gpu-memory", "16", "--no-activation-checkpointing"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "activation checkpointing" in out
    assert (
        plan_command(["--model", "1.7b", "--gpus", "4", "--gpu-memory", "16", "--sharding", "NO_SHARD", "--freeze"])
        == 1
    )
    assert "FULL_SHARD" in capsys.readouterr().out
    assert main(["plan", "--model", "no-such-model", "--gpu-memory", "16"]) == 2
    assert "tts-lightning plan: error: model 'no-such-model': not a preset" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # planned for 1 GPU before
        plan_command(["--model", "1.7b", "--gpus", "0", "--gpu-memory", "16"])
    assert exit_.value.code == 2 and "--gpus must be >= 1, got 0" in capsys.readouterr().err


def test_plan_from_yaml(tmp_path, tiny_dir, capsys):
    """A config is read by the real `fit` parser: class_path/init_args, defaults, command-line
    overrides and the data.pretrained -> model.pretrained link resolve as `fit` resolves them."""
    released = {
        "trainer": {
            "devices": 4,
            "precision": "bf16-mixed",
            "strategy": {
                "class_path": "tts_lightning.distributed.fsdp.Qwen3TTSFSDPStrategy",
                "init_args": {"sharding_strategy": "FULL_SHARD"},
            },
        },
        "model": {"freeze": ["speaker_encoder"]},
        "data": {
            "pretrained": "Qwen/Qwen3-TTS-12Hz-1.7B-Base",
            "train_manifest": "train.jsonl",
            "max_frames_per_batch": 2000,
        },
    }
    path = tmp_path / "released.yaml"
    path.write_text(yaml.safe_dump(released))
    plan = plan_from_config(path, 16)
    direct = plan_memory("1.7b", **BASE)
    assert (plan.total, plan.fits, plan.gpus) == (direct.total, True, 4)
    assert plan_command(["--config", str(path), "--gpu-memory", "16"]) == 0
    assert plan_command(["--config", str(path), "--gpu-memory", "16", "--gpus", "1"]) == 1
    # fit's own overrides, after the YAML: one GPU does not fit, 32-true on 8 is planned as fit would run it
    assert plan_command(["--config", str(path), "--gpu-memory", "16", "--trainer.devices", "1"]) == 1
    capsys.readouterr()
    override = plan_from_config(path, 16, overrides=["--trainer.devices", "8", "--trainer.precision", "32-true"])
    assert (override.gpus, override.precision) == (8, "32-true")
    assert override.total == plan_memory("1.7b", **{**BASE, "gpus": 8, "precision": "32-true"}).total
    # a key fit rejects is rejected here too (the hand-written reader ignored it)
    path.write_text(yaml.safe_dump({**released, "model": {"freeze": ["speaker_encoder"], "no_such_option": 1}}))
    with pytest.raises(SystemExit):
        plan_from_config(path, 16)
    assert "no_such_option" in capsys.readouterr().err

    tiny = {
        "trainer": {
            "devices": 2,
            "precision": "32-true",
            "strategy": {
                "class_path": "tts_lightning.distributed.fsdp.Qwen3TTSFSDPStrategy",
                "init_args": {"sharding_strategy": "SHARD_GRAD_OP", "activation_checkpointing_policy": []},
            },
        },
        "model": {"freeze": ["speaker_encoder", TEXT_EMBEDDING]},
        "data": {"pretrained": str(tiny_dir), "train_manifest": "train.jsonl", "max_frames_per_batch": 400},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny))
    plan = plan_from_config(path, 2)
    assert (plan.gpus, plan.precision, plan.sharding, plan.micro_batch_frames) == (2, "32-true", "SHARD_GRAD_OP", 400)
    assert not plan.activation_checkpointing and plan.freeze == ["speaker_encoder", TEXT_EMBEDDING]
    assert plan.total_parameters == count_parameters(tiny_dir) and plan.fits
    assert plan.total < 1.1 * GiB  # a tiny model: essentially the constant CUDA overhead
    # the strategy's defaults come from its signature: no init_args at all is FULL_SHARD, checkpointed
    default = {
        **tiny,
        "trainer": {**tiny["trainer"], "strategy": {"class_path": tiny["trainer"]["strategy"]["class_path"]}},
    }
    path.write_text(yaml.safe_dump(default))
    plan = plan_from_config(path, 2)
    assert (plan.sharding, plan.activation_checkpointing) == ("FULL_SHARD", True)

    path.write_text(yaml.safe_dump({**tiny, "trainer": {"devices": "auto", "strategy": "ddp"}}))
    with pytest.raises(ValueError, match="devices"):
        plan_from_config(path, 16)
    assert plan_from_config(path, 16, gpus=2).sharding == "NO_SHARD"


OURS = "tts_lightning.distributed.fsdp.Qwen3TTSFSDPStrategy"


@pytest.mark.parametrize(
    ("strategy", "full"),
    [
        ({"class_path": OURS}, False),  # sharded by default
        ({"class_path": OURS, "init_args": {"state_dict_type": "full"}}, True),
        ({"class_path": "lightning.pytorch.strategies.FSDPStrategy"}, True),  # Lightning's default: full
        ("fsdp", True),
        ("ddp", False),
    ],
)  # fmt: skip
def test_full_checkpoints_are_said_not_planned(tiny_dir, tmp_path, strategy, full):
    """A full (one-file) checkpoint gathers everything on rank 0 and FSDP1 resumes it whole in every
    process: not what the phases plan, so the plan says so, with the sizes."""
    config = {
        "trainer": {"devices": 4, "strategy": strategy},
        "data": {"pretrained": str(tiny_dir), "train_manifest": "x.jsonl"},
    }
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(config))
    plan = plan_from_config(path, 16)
    said = [n for n in plan.notes if n.startswith("state_dict_type full")]
    assert bool(said) == full, plan.notes
    if full:
        model, settings = plan.planned
        whole = (plan.parameters + plan.optimizer_states) * (1 if plan.sharding == "NO_SHARD" else 4)
        assert f"rank 0's host memory ({whole / GiB:.1f} GiB)" in said[0]


def test_samples_are_planned_for_the_runs_speakers_a_generate_call_at_a_time(tiny_dir, tmp_path):
    """The samples callback speaks the run's speakers, up to its max_speakers, by default: the planner
    counts the training manifest's (two where it cannot read it), capped at one generate call's rows."""
    from tts_lightning.data.demo import demo_dir
    from tts_lightning.model.generation import GENERATION_ROWS

    samples = {"class_path": "tts_lightning.callbacks.SpeakerSamplesCallback", "init_args": {"texts": ["Hi."]}}
    lines = [json.dumps({"audio": f"{i}.wav", "text": "Hi.", "speaker": f"s{i}"}) for i in range(40)]
    (tmp_path / "many.jsonl").write_text("\n".join(lines) + "\n")

    def rows(manifest: str, *overrides: str) -> int:
        config = {
            "trainer": {"devices": 1, "callbacks": [samples]},
            "data": {"pretrained": str(tiny_dir), "train_manifest": manifest},
        }
        path = tmp_path / "samples.yaml"
        path.write_text(yaml.safe_dump(config))
        return plan_from_config(path, 16, overrides=list(overrides)).planned[1].sample_rows

    assert rows(str(demo_dir() / "train.jsonl")) == 2  # alice and bob, one text
    assert rows(str(demo_dir() / "train.jsonl"), "--data.speakers", "[alice]") == 1
    assert rows(str(tmp_path / "nope.jsonl")) == 2  # not readable here: planned as two
    assert rows(str(tmp_path / "many.jsonl")) == 8  # 40 speakers: the callback samples max_speakers (8)
    samples["init_args"]["max_speakers"] = None  # all 40: one generate call at a time
    assert rows(str(tmp_path / "many.jsonl")) == GENERATION_ROWS


@pytest.mark.parametrize("preset", ["1.7b", "0.6b"])
def test_preset_special_ids_are_inside_the_vocabulary(preset):
    """A model built from a preset (the benchmarks build released-size ones) must not index past
    its codec embedding: every codec special id lies in the 1024-entry block after the codes."""
    from tts_lightning.distributed.memory import resolve_config

    talker = resolve_config(preset)[1]["talker_config"]
    codec = [v for k, v in talker.items() if k.startswith("codec_") and isinstance(v, int)]
    codec += list(talker["codec_language_id"].values())
    assert codec and all(2048 <= i < talker["vocab_size"] == 3072 for i in codec)


def test_samples_phase_is_planned(tiny_dir):
    """The samples callback's rank-0 phase: a compute-dtype copy of the model, the KV cache, and the
    speech tokenizer counted from a local directory's weights."""
    from tts_lightning.distributed.memory import speech_tokenizer_bytes
    from tts_lightning.model.pretrained import load_speech_tokenizer

    tokenizer = load_speech_tokenizer(check_pretrained(tiny_dir))
    assert speech_tokenizer_bytes(tiny_dir) == 4 * sum(t.numel() for t in tokenizer.model.state_dict().values())
    plain = plan_memory("1.7b", **BASE)
    sampled = plan_memory("1.7b", **BASE, samples=True, sample_rows=4, sample_frames=600)
    assert sampled.samples_model == 2 * plain.total_parameters  # bf16 copy, never the fp32 model
    # The samples run in validation, which Lightning starts by releasing the gradients (unless it
    # falls between the micro-batches of one step).
    at_validation = plain.parameters + plain.optimizer_states + plain.overhead
    assert sampled.samples_total == at_validation + sampled.samples_model + sampled.samples_cache
    mid = plan_memory("1.7b", **BASE, samples=True, sample_rows=4, sample_frames=600, validation_holds_gradients=True)
    assert mid.samples_total == sampled.samples_total + plain.gradients
    assert sampled.total == max(plain.total, sampled.samples_total)
    assert "samples" in sampled.table()
    # LoRA on one card: the samples (a bf16 copy beside the frozen base) are the peak, and named so.
    lora = plan_memory(
        "1.7b", **{**BASE, "gpus": 1}, adapter={"rank": 16}, samples=True, sample_rows=4, sample_frames=600
    )
    assert lora.total == lora.samples_total and lora.peak_phase.startswith("rank 0's samples")
    assert sampled.peak_phase.startswith("start of backward")  # 4 GPUs: the step is
    config = plan_from_config("configs/qwen3-tts-1.7b-4x16gb.yaml", 16)
    assert config.samples and config.samples_cache > 0


def test_the_samples_first_round_is_the_start_phase():
    """A run from step 0 samples once before its first step (the baseline or held-out round): the start
    phase holds the sharded parameters and the generation copy with its KV cache, no optimizer state;
    without that round (``baseline: false``) the start is the model's build alone, and a resume (which
    skips the round) is unchanged either way."""
    plain = plan_memory("1.7b", **BASE)
    sampled = plan_memory("1.7b", **BASE, samples=True, sample_rows=4, sample_frames=600)
    first_round = plain.parameters + plain.overhead + sampled.samples_model + sampled.samples_cache
    assert first_round > plain.startup  # a bf16 model is more than the largest unit being built
    assert sampled.startup == first_round < sampled.samples_total
    assert sampled.resume == plain.resume
    assert "start" in sampled.table() and "with the samples' first round" in sampled.table()
    quiet = plan_memory("1.7b", **BASE, samples=True, sample_rows=4, sample_frames=600, samples_at_start=False)
    assert quiet.startup == plain.startup and "first round" not in quiet.table()
    # Read from a config: the shipped callback samples a baseline; `baseline: false` does not, unless
    # held-out voices are cloned at the start too.
    config = "configs/qwen3-tts-1.7b-4x16gb.yaml"
    path = "--trainer.callbacks.init_args"
    assert plan_from_config(config, 16).samples_at_start
    assert not plan_from_config(config, 16, overrides=[f"{path}.baseline", "false"]).samples_at_start
    held_out = [f"{path}.baseline", "false", f"{path}.held_out", "voices.jsonl"]
    assert plan_from_config(config, 16, overrides=held_out).samples_at_start


def test_the_samples_note_says_where_the_copy_is_made():
    """One GPU under FSDP1 (NO_SHARD) copies the parameters on the device; sharded or offloaded
    parameters are gathered to host memory first."""
    one = plan_memory("0.6b", gpus=1, gpu_memory_gb=24, samples=True)
    assert any("copies the parameters it holds on the GPU" in n for n in one.notes)
    for settings in ({"gpus": 2}, {"gpus": 1, "cpu_offload": True}, {"gpus": 1, "layout": "fsdp2"}):
        other = plan_memory("0.6b", **{"gpu_memory_gb": 24, "samples": True, **settings})
        assert any("gathers the weights to host memory first (3.4 GiB" in n for n in other.notes), settings
    bf16 = plan_memory("0.6b", gpus=2, gpu_memory_gb=24, samples=True, optimizer="bf16_sr")
    assert any("host memory first (1.7 GiB" in n for n in bf16.notes)  # bf16 weights gathered as they are


# Each case: the Trainer and checkpoint settings; whether validation and each save find gradients;
# the same settings as `fit` overrides for the planner, which must count the gradients exactly then.
GRADIENT_CASES = {
    # The default: a checkpoint on a validation metric, written after validation.
    "after validation": ({}, {}, [{False}], [{False}], []),
    # At training steps' ends (every_n_train_steps): every save holds them.
    "every step": (
        {},
        {"every_n_train_steps": 1, "monitor": None},
        [{False}],
        [{True}, {True}],
        ["--checkpoint.every_n_train_steps=1"],
    ),
    # Validation between the micro-batches of one step: it and the save after it hold them.
    "mid accumulation": (
        {"accumulate_grad_batches": 2, "val_check_interval": 3, "max_steps": 2},
        {},
        [{True}],
        [{True}],
        ["--trainer.accumulate_grad_batches=2", "--trainer.val_check_interval=3"],
    ),
    # No validation: the save at the (last) epoch's end, after the last step.
    "no validation": ({"limit_val_batches": 0}, {"monitor": None}, [], [{True}], ["--trainer.limit_val_batches=0"]),
}


@pytest.mark.parametrize("case", list(GRADIENT_CASES))
def test_gradients_at_validation_and_save_as_lightning_holds_them(case, tiny_dir, make_datamodule, tmp_path):
    """The planner's save and samples phases: Lightning releases the gradients before validation
    (``on_validation_model_zero_grad``) only at a step boundary, so a checkpoint written after
    validation finds none, one written at a training step's end or with no validation before it
    finds them all, and validation between micro-batches holds them. Real 1-process fits record
    what each phase finds; the planner, given the same settings, counts the gradients exactly then."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tts_lightning import Qwen3TTSModule

    trainer_args, checkpoint_args, at_validation, at_save, overrides = GRADIENT_CASES[case]

    class GradientsSeen(L.Callback):
        def __init__(self):
            self.validation, self.save = [], []

        def _held(self, pl_module):
            return {p.grad is not None for p in pl_module.parameters() if p.requires_grad}

        def on_validation_start(self, trainer, pl_module):
            self.validation.append(self._held(pl_module))

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            self.save.append(self._held(pl_module))

    L.seed_everything(0)
    data = make_datamodule()
    probe = GradientsSeen()
    checkpoint_args = {"monitor": "val/loss", "save_top_k": -1, **checkpoint_args}
    trainer_args = {"max_steps": 2, "val_check_interval": 2, "limit_val_batches": 1, **trainer_args}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, **checkpoint_args), probe],
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    trainer.fit(Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names), datamodule=data)
    assert (probe.validation, probe.save) == (at_validation, at_save)

    config, pretrained = REPO / "configs" / "tiny-cpu.yaml", ["--data.pretrained", str(tiny_dir)]
    plan = plan_from_config(config, 16, overrides=[*pretrained, *overrides])
    held = plan.gradients if True in at_save[-1] else 0
    assert plan.checkpoint_save == plan.parameters + plan.optimizer_states + held + CUDA_OVERHEAD_BYTES
    # The samples run in validation: with the gradients only when validation holds them.
    sampled = plan_from_config(
        config,
        16,
        overrides=[*pretrained, *overrides, "--trainer.callbacks+=tts_lightning.callbacks.SpeakerSamplesCallback"],
    )
    held = sampled.gradients if at_validation and True in at_validation[0] else 0
    assert sampled.samples_total == (
        sampled.parameters
        + sampled.optimizer_states
        + held
        + CUDA_OVERHEAD_BYTES
        + max(sampled.samples_model + sampled.samples_cache, sampled.speech_tokenizer)
    )


EVERY_EPOCH = ["--trainer.check_val_every_n_epoch=1"]


@pytest.mark.parametrize(
    "overrides, held",
    [
        ([], False),
        (["--checkpoint.train_time_interval=0:10:00"], True),
        # tiny-cpu.yaml validates every 20 steps, not at each epoch's end: an epoch-end save may follow steps.
        (["--checkpoint.save_on_train_epoch_end=true"], True),
        (["--data.val_fraction=0"], True),  # no validation at all
        # Every 20 batches of an epoch: a step boundary (windows restart with each epoch).
        (["--trainer.accumulate_grad_batches=4", "--trainer.val_check_interval=20", *EVERY_EPOCH], False),
        # Every 20 batches counted across epochs (tiny-cpu.yaml's check_val_every_n_epoch: null): not.
        (["--trainer.accumulate_grad_batches=4", "--trainer.val_check_interval=20"], True),
        (["--trainer.accumulate_grad_batches=4", "--trainer.val_check_interval=0.5", *EVERY_EPOCH], True),
        (["--trainer.accumulate_grad_batches=4", "--trainer.val_check_interval=00:00:10:00"], True),  # a clock
        (
            [
                "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                "--trainer.callbacks.every_n_train_steps=50",
            ],
            True,
        ),
    ],
)
def test_planner_reads_every_setting_that_saves_with_gradients(tiny_dir, overrides, held):
    """The config settings besides the four fitted above under which a save holds the gradients."""
    config = REPO / "configs" / "tiny-cpu.yaml"
    plan = plan_from_config(config, 16, overrides=["--data.pretrained", str(tiny_dir), *overrides])
    gradients = plan.gradients if held else 0
    assert plan.checkpoint_save == plan.parameters + plan.optimizer_states + gradients + CUDA_OVERHEAD_BYTES


@pytest.mark.parametrize(
    "lightning, ray, held",
    [
        # Reports every N steps are written at the step's end, its gradients held.
        ([], ["--ray.checkpoint_every_n_steps", "10"], True),
        # At epoch ends (the default) after the epoch's validation: released; but with max_steps the
        # last report is written at that step's end, before its validation.
        ([], [], False),
        (["--trainer.max_steps", "100"], [], True),
        # Validation every N batches counted across epochs (tiny-cpu.yaml's): not at every epoch's end.
        (["--trainer.check_val_every_n_epoch", "null", "--trainer.val_check_interval", "20"], [], True),
    ],
)
def test_plan_reads_ray_fit_options(tiny_dir, lightning, ray, held, capsys):
    """`plan --config ... --ray.num_workers N` plans the `ray-fit` run: N processes, and its reports
    (`RayCheckpointReport`) as saves that hold the gradients when written at a step's end."""
    config = str(REPO / "configs" / "tiny-cpu.yaml")
    base = ["--data.pretrained", str(tiny_dir), *EVERY_EPOCH, "--trainer.val_check_interval", "1.0"]
    base += ["--trainer.max_steps", "-1", *lightning]
    plain = plan_from_config(config, 16, gpus=4, overrides=base)
    assert plain.checkpoint_save == plain.parameters + plain.optimizer_states + CUDA_OVERHEAD_BYTES
    every_n = int(ray[1]) if ray else 0
    plan = plan_from_config(config, 16, gpus=4, overrides=base, ray_checkpoint_every_n_steps=every_n)
    assert plan.checkpoint_save == plain.checkpoint_save + (plan.gradients if held else 0)
    # The command takes ray-fit's own options after the config, as ray-fit does.
    argv = ["--config", config, "--gpu-memory", "16", *base, *ray, "--ray.num_workers", "4", "--ray.use_gpu"]
    assert plan_command(argv) == 0
    out = capsys.readouterr().out
    assert "4 GPU(s)" in out
    assert f"checkpoint save {plan.checkpoint_save / 2**30:.2f}" in out


def test_planning_a_ray_fit_on_cpu_workers_is_refused(tiny_dir, capsys):
    """`ray-fit` without ``--ray.use_gpu`` trains on CPU workers: there are no GPUs to plan."""
    config = str(REPO / "configs" / "tiny-cpu.yaml")
    with pytest.raises(SystemExit) as exit_:
        plan_command(
            ["--config", config, "--gpu-memory", "16", "--data.pretrained", str(tiny_dir), "--ray.num_workers", "4"]
        )
    assert exit_.value.code == 2
    assert "ray-fit without --ray.use_gpu trains on CPU workers; add --ray.use_gpu" in capsys.readouterr().err


def test_a_lora_checkpoint_holds_the_trainable_tensors_only():
    """The planner's host memory for a LoRA save is the adapters (fp32) and their AdamW state: what
    the checkpoint holds (tests/distributed/test_lora_fsdp.py checks that no frozen tensor is saved),
    not the frozen base; the table names the parameters as the base + adapters."""
    for layout in ("fsdp1", "fsdp2"):
        lora = plan_memory("1.7b", gpus=1, gpu_memory_gb=16, adapter={"rank": 16, "alpha": 32}, layout=layout)
        assert lora.checkpoint_host == 4 * lora.trainable_parameters + lora.optimizer_states
        assert lora.checkpoint_host < lora.parameters / 10
        assert "parameters (frozen base + adapters)" in lora.table()
    full = plan_memory("1.7b", gpus=4, gpu_memory_gb=16)
    assert full.checkpoint_host == full.parameters + full.optimizer_states


def test_the_samples_asr_model_is_planned(tmp_path):
    """A local Whisper folder as the samples' ``asr``: its bf16 weights are counted on rank 0's GPU while
    it transcribes, one at a time with the copy and the speech tokenizer; a hub name is said not to
    be counted; pocketsphinx runs on the CPU."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from tts_lightning.distributed.memory import asr_model_bytes

    config = WhisperConfig(
        vocab_size=300, num_mel_bins=80, encoder_layers=1, decoder_layers=1, d_model=32,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=1,
    )  # fmt: skip
    model = WhisperForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    saved = asr_model_bytes(str(tmp_path))
    # bf16, as `make_recognizer` loads it to run on a GPU (tests/evaluation/test_asr.py); tied weights once
    assert saved == 2 * sum(p.numel() for p in model.parameters())
    assert asr_model_bytes("pocketsphinx") == asr_model_bytes(None) == asr_model_bytes("openai/whisper-small") == 0

    settings = dict(gpus=4, gpu_memory_gb=16, samples=True, sample_rows=4, sample_frames=600)
    plain = plan_memory("1.7b", **settings)
    big = plan_memory("1.7b", **settings, sample_asr=str(tmp_path))
    assert big.asr_model == saved and "then the ASR model" in big.table()
    assert big.samples_total == plain.samples_total  # a tiny Whisper stays below the copy
    hub = plan_memory("1.7b", **settings, sample_asr="openai/whisper-large-v3")
    assert any("ASR model openai/whisper-large-v3 is not counted" in n for n in hub.notes)
    # Read from a config's callback: the asr setting reaches the planner.
    path = "--trainer.callbacks.init_args.asr"
    read = plan_from_config("configs/qwen3-tts-1.7b-4x16gb.yaml", 16, overrides=[path, str(tmp_path)])
    assert read.asr_model == saved


def _readme_planner_rows() -> list[tuple[str, str]]:
    """The rows of the README's planner table: (the row, as written; its settings)."""
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Will it fit?") : readme.index("Estimates, not measured")]
    return [(row, row.split("|")[3]) for row in table.splitlines() if re.match(r"\| (1\.7B|0\.6B) \|", row)]


def test_the_readmes_planner_table_is_found():
    assert len(_readme_planner_rows()) >= 10  # the rows the next test plans again


@pytest.mark.parametrize("row", [row for row, _ in _readme_planner_rows()])
def test_the_readmes_planner_table_is_what_the_planner_says(row):
    """Each row of the README's table, planned again from its settings: the same GiB and verdict."""
    model, gpus_memory, settings, per_gpu, verdict = [cell.strip() for cell in row.strip("|").split("|")]
    gpus, memory = (int(x) for x in gpus_memory.split(" x "))
    kwargs = {**BASE, "gpus": gpus, "gpu_memory_gb": memory}
    if "NO_SHARD" in settings:
        kwargs["sharding"] = "NO_SHARD"
    if "text_embedding` frozen" in settings or "text embedding frozen" in settings:
        kwargs["freeze"] = ["speaker_encoder", TEXT_EMBEDDING]
    if "CPU offload" in settings:
        kwargs["cpu_offload"] = True
    if positions := re.search(r"(\d+) positions", settings):
        kwargs["micro_batch_frames"] = int(positions.group(1))
    if optimizer := re.search(r"`(adamw8bit|adamw4bit|bf16_sr|bf16_sr_adamw8bit)`", settings):
        kwargs["optimizer"] = optimizer.group(1)
    plan = plan_memory(model.lower(), **kwargs)
    assert (f"{plan.total / GiB:.1f}", "fits" if plan.fits else "does not fit") == (per_gpu, verdict)
    if "host RAM" in settings:
        assert f"({plan.host_memory / GiB:.1f} GiB host RAM)" in settings
