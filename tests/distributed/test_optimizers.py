"""`model.optimizer` on 2 real FSDP ranks (FSDP1 and FSDP2): every option trains (the loss goes down,
only trainable parameters change, the weights and the state have the option's dtypes and types), and
adamw8bit and bf16_sr resume exactly from sharded and from full checkpoints (tests/distributed/
optimizer_worker.py: one launch per strategy, several fits in it)."""

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
OPTIONS = ("adamw8bit", "adamw4bit", "bf16_sr", "bf16_sr_adamw8bit")
RESUMED = ("adamw8bit", "bf16_sr")
EXPECTED = {  # weights' dtype, the types of the optimizer state's values, the moments' dtypes
    "adamw8bit": (["torch.float32"], {"OptimState8bit", "Tensor"}, ["torch.float32"]),
    "adamw4bit": (["torch.float32"], {"OptimState4bit", "Tensor"}, ["torch.float32"]),
    "bf16_sr": (["torch.bfloat16"], {"Tensor"}, ["torch.bfloat16"]),
    "bf16_sr_adamw8bit": (["torch.bfloat16"], {"OptimState8bit", "Tensor"}, ["torch.bfloat16"]),
}


def _run(run_script, tmp_path_factory, tiny_dir, demo_data, kind):
    _, manifest, cache = demo_data
    out = tmp_path_factory.mktemp(f"optimizers-{kind}")
    args = (kind, tiny_dir, manifest, cache, out, ",".join(("adamw", *OPTIONS)), ",".join(RESUMED))
    run_script(HERE / "optimizer_worker.py", *args, timeout=900, cwd=out, ranks=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)], out


@pytest.fixture(scope="module")
def fsdp1(run_script, tmp_path_factory, tiny_dir, demo_data):
    return _run(run_script, tmp_path_factory, tiny_dir, demo_data, "fsdp1")


@pytest.fixture(scope="module")
def fsdp2(run_script, tmp_path_factory, tiny_dir, demo_data):
    return _run(run_script, tmp_path_factory, tiny_dir, demo_data, "fsdp2")


@pytest.fixture(params=["fsdp1", "fsdp2"])
def results(request):
    return request.param, request.getfixturevalue(request.param)[0]


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_trains_only_the_trainable_parameters(results, option):
    kind, ranks = results
    weights, types, moments = EXPECTED[option]
    for rank in ranks:
        run = rank[option]
        assert run["losses"][-1] < run["losses"][0], (kind, option, run["losses"])
        assert run["frozen_changed"] == [], (kind, option)
        # The parameters plain AdamW moves on this rank (those with a piece here and a gradient); with
        # stochastic rounding a small one may stay put over 4 steps.
        moved, plain = set(run["changed"]), set(rank["adamw"]["changed"])
        assert moved <= plain and len(moved) >= 0.9 * len(plain) and plain, (kind, option, plain - moved)
        assert run["weight_dtypes"] == weights, (kind, option)
        assert set(run["state_types"]) <= types and "step" not in run["state_types"], (kind, option)
        assert run["moment_dtypes"] == moments, (kind, option, run["moment_dtypes"])
    quantized = {t for rank in ranks for t in rank[option]["state_types"]}
    assert quantized == types, (kind, option, quantized)  # some moments quantized, some small ones not


@pytest.mark.parametrize("option", RESUMED)
def test_resume_equals_uninterrupted(results, option):
    """From the sharded checkpoint at step 2 and from a full one written by that resumed run at
    step 3, a fresh module ends at step 4 with the uninterrupted run's weights, bit for bit."""
    kind, ranks = results
    for rank in ranks:
        run = rank[option]
        assert run["resumed_from"] == {"sharded": True, "full": True}
        assert run["resume_sharded_differ"] == [], (kind, option)  # the parameters that differ
        assert run["resume_full_differ"] == [], (kind, option)
        # Full checkpoints of quantized state gather over `host_group`: made at setup (NCCL clusters
        # where gloo cannot connect fail at the start), used at the save; never for sharded ones.
        quantized = option in ("adamw8bit", "adamw4bit", "bf16_sr_adamw8bit")
        assert run["host_group_calls_full"] == (["setup", "training"] if quantized else []), (kind, option)
        assert run["host_group_calls"] == [], (kind, option)


def test_lora_with_8bit_moments_trains_the_adapters_only(results):
    """LoRA adapters plus a fully trained codec head (big enough for 8-bit pieces): FSDP1 with
    adamw8bit, FSDP2 with bf16_sr_adamw8bit (bf16 weights, adapters included)."""
    kind, ranks = results
    for rank in ranks:
        run = rank["lora"]
        assert run["frozen_changed"] == [] and run["trainable_changed"] == run["trainable"] > 0
        assert all("lora_" in n or "codec_head" in n for n in run["changed"]), run["changed"][:5]
        assert run["weight_dtypes"] == (["torch.float32"] if kind == "fsdp1" else ["torch.bfloat16"]), kind
    assert "OptimState8bit" in {t for rank in ranks for t in rank["lora"]["state_types"]}, kind


def test_export_of_a_lean_checkpoint_reads_the_weights_only(fsdp1, tmp_path):
    """`export` of a sharded checkpoint with bf16 weights and per-rank 8-bit moments: the weights it
    holds (upcast exactly to fp32), which qwen_tts loads; no optimizer entry is read."""
    from qwen_tts import Qwen3TTSModel
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from tts_lightning.model.checkpoint import load_training_checkpoint
    from tts_lightning.model.export import export_custom_voice

    path = fsdp1[1] / "bf16_sr_adamw8bit" / "a" / "step4.ckpt"
    read: list[str] = []
    real = FileSystemReader.read_data

    def spy(self, plan, planner):  # records what is read, then reads it
        read.extend(item.storage_index.fqn for item in plan.items)
        return real(self, plan, planner)

    FileSystemReader.read_data = spy
    try:
        out = export_custom_voice(path, tmp_path / "voice", dtype="fp32")
    finally:
        FileSystemReader.read_data = real
    assert read and not any(fqn.startswith("optimizer") for fqn in read), sorted(set(read))[:5]
    saved = load_training_checkpoint(path).state_dict
    exported = load_file(str(out / "model.safetensors"))
    head = saved["model.talker.codec_head.weight"]
    assert head.dtype == torch.bfloat16 and torch.equal(exported["talker.codec_head.weight"], head.float())
    loaded = Qwen3TTSModel.from_pretrained(str(out)).model.state_dict()
    assert torch.equal(loaded["talker.codec_head.weight"].float(), head.float())


@pytest.mark.parametrize(("option", "checkpoint"), [("adamw8bit", "a/step4.ckpt"), ("bf16_sr", "b/step3.ckpt")])
def test_load_from_checkpoint_reads_the_weights_only(fsdp2, option, checkpoint):
    """A sharded checkpoint with per-rank 8-bit state, and a full one with bf16 weights: the module
    gets the weights the checkpoint holds (the optimizer state is never read), in their dtype."""
    from tts_lightning import Qwen3TTSModule
    from tts_lightning.model.checkpoint import load_training_checkpoint
    from tts_lightning.model.row_blocks import official_state

    path = fsdp2[1] / option / checkpoint
    saved = load_training_checkpoint(path).state_dict
    state = official_state(Qwen3TTSModule.load_from_checkpoint(path).state_dict())  # row blocks joined
    assert set(state) == set(saved) and not any(k.startswith("optimizer") for k in state)
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    dtype = torch.bfloat16 if option == "bf16_sr" else torch.float32
    assert state["model.talker.codec_head.weight"].dtype == dtype
