"""The memory planner's FSDP2 layout (`Qwen3TTSFSDP2Strategy`, ``fully_shard``): its units are the ones
``fully_shard`` builds, and against the FSDP1 layout on the same model it differs where it should:
frozen parameters inside a unit cost no gradient, each parameter is padded on dim 0."""

import pytest
import yaml

from tts_lightning.distributed.memory import (
    FSDP2_GROUPS,
    FSDP2_LAYERS,
    TEXT_EMBEDDING,
    model_shape,
    plan_from_config,
    plan_memory,
)
from tts_lightning.distributed.plan_cli import plan_command
from tts_lightning.model.loading import build_model
from tts_lightning.model.pretrained import check_pretrained
from tts_lightning.model.row_blocks import DEFAULT_TEXT_EMBEDDING_BLOCKS, split_text_embedding

BASE = dict(gpus=4, gpu_memory_gb=16, precision="bf16-mixed", micro_batch_frames=2000)


def test_fsdp2_units_are_the_units_fully_shard_builds(tiny_dir):
    """Apply ``fully_shard`` to the tiny model with the strategy's own layer classes and groups (as its
    `_shard` does, on one gloo rank): same units, same parameters in each."""
    import fnmatch

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from tts_lightning.distributed.fsdp import import_classes
    from tts_lightning.distributed.fsdp2 import DEFAULT_GROUPS, DEFAULT_LAYERS

    assert tuple(FSDP2_LAYERS) == tuple(DEFAULT_LAYERS)
    assert [list(g) for g in FSDP2_GROUPS] == [list(g) for g in DEFAULT_GROUPS]
    assert not dist.is_initialized()
    model = build_model(check_pretrained(tiny_dir), load_weights=False)
    split_text_embedding(model, DEFAULT_TEXT_EMBEDDING_BLOCKS)  # as Qwen3TTSModule.configure_model
    names_before = {id(p): n for n, p in model.named_parameters()}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layer_classes = tuple(import_classes(list(DEFAULT_LAYERS)))
        for sub in model.modules():
            if isinstance(sub, layer_classes):
                fully_shard(sub, mesh=mesh)
        modules = dict(model.named_modules())
        for globs in DEFAULT_GROUPS:
            matched = [n for n in modules if n and any(fnmatch.fnmatchcase(n, g) for g in globs)]
            members = [modules[n] for n in matched if not any(n.startswith(f"{m}.") for m in matched)]
            fully_shard(members if len(members) > 1 else members[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        names = {id(p): n for n, p in model.named_parameters()}
        built = set()
        for sub in model.modules():
            if isinstance(sub, FSDPModule):
                group = sub._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    built.add(frozenset(names[id(fp.sharded_param)] for fp in group.fsdp_params))
    finally:
        dist.destroy_process_group()
    assert sorted(names.values()) == sorted(names_before.values())
    planned = model_shape(tiny_dir, layout="fsdp2")
    assert {frozenset(n for n, _ in u.params) for u in planned.units} == built
    assert len(planned.units) == len(built)
    kinds = {u.name: u.kind for u in planned.units}
    assert kinds[""] == "root" and TEXT_EMBEDDING not in kinds
    assert [kinds[f"{TEXT_EMBEDDING}.blocks.{i}"] for i in range(DEFAULT_TEXT_EMBEDDING_BLOCKS)] == ["embedding"] * 8
    assert [u.gathered_in_training for u in planned.units if u.name == "speaker_encoder"] == [False]


def test_fsdp2_against_fsdp1_on_the_released_1_7b():
    """Everything trainable, no padding at 4 GPUs: the two layouts plan the same. Frozen parameters
    in a unit with trainable ones (the text projection in the root, the MLPs in the talker's layer
    units): FSDP1 keeps their gradient, FSDP2 none, so its plan is smaller by exactly that."""
    everything = {
        layout: plan_memory("1.7b", **BASE, freeze=[], layout=layout, advise=False) for layout in ("fsdp1", "fsdp2")
    }
    assert everything["fsdp2"].model_states == everything["fsdp1"].model_states
    assert everything["fsdp2"].total == pytest.approx(everything["fsdp1"].total, rel=0.01)

    freeze = ["speaker_encoder", "talker.text_projection", "talker.model.layers.*.mlp.*"]
    fsdp1, fsdp2 = (plan_memory("1.7b", **BASE, freeze=freeze, layout=layout) for layout in ("fsdp1", "fsdp2"))
    numels = model_shape("1.7b").param_numels()
    frozen_in_mixed = sum(n for p, n in numels.items() if p.startswith("talker.text_projection.") or ".mlp." in p)
    frozen_in_mixed -= sum(n for p, n in numels.items() if ".mlp." in p and "code_predictor" in p)  # not frozen
    assert fsdp1.trainable_parameters == fsdp2.trainable_parameters
    assert fsdp1.gradients - fsdp2.gradients == 4 * frozen_in_mixed // 4
    assert fsdp1.optimizer_states == fsdp2.optimizer_states and fsdp1.parameters == fsdp2.parameters
    assert fsdp2.gathered < fsdp1.gathered and fsdp2.total < fsdp1.total
    assert any("share a unit" in n for n in fsdp1.notes) and not any("share a unit" in n for n in fsdp2.notes)
    assert "FSDP2" in fsdp2.table() and fsdp2.layout == "fsdp2"

    # 3 GPUs: the text embedding's 151,936 rows do not divide, FSDP2 pads each parameter
    three = {
        layout: plan_memory("1.7b", **{**BASE, "gpus": 3}, freeze=[], layout=layout) for layout in ("fsdp1", "fsdp2")
    }
    assert three["fsdp2"].parameters > three["fsdp1"].parameters
    assert three["fsdp2"].parameters - three["fsdp1"].parameters < 4 * 3 * 10 * 2048 * 10  # a few rows per parameter
    with pytest.raises(ValueError, match="NO_SHARD"):
        plan_memory("1.7b", **{**BASE, "sharding": "NO_SHARD"}, layout="fsdp2")


def test_fsdp2_lora_and_one_gpu(tiny_dir):
    """LoRA: FSDP1 gives each adapter a unit of its own, so both layouts keep gradients and AdamW
    state for the adapters only. On one GPU FSDP2 does not switch to NO_SHARD."""
    adapter = {"rank": 4, "alpha": 8.0}
    fsdp1, fsdp2 = (
        plan_memory(tiny_dir, gpus=1, gpu_memory_gb=16, adapter=adapter, layout=layout) for layout in ("fsdp1", "fsdp2")
    )
    assert fsdp2.trainable_parameters == fsdp1.trainable_parameters < fsdp1.total_parameters // 10
    assert (fsdp2.parameters, fsdp2.gradients, fsdp2.optimizer_states) == (
        fsdp1.parameters,
        fsdp1.gradients,
        fsdp1.optimizer_states,
    )
    assert fsdp2.gradients == 4 * fsdp2.trainable_parameters
    assert any("NO_SHARD" in n for n in fsdp1.notes) and not any("NO_SHARD" in n for n in fsdp2.notes)
    # bf16-mixed (the default): the frozen base stored and sharded in bf16, as Qwen3TTSFSDP2Strategy
    # casts it; 32-true: fp32 throughout
    fp32 = plan_memory(tiny_dir, gpus=1, gpu_memory_gb=16, adapter=adapter, layout="fsdp2", precision="32-true")
    frozen = fsdp2.total_parameters - fsdp2.trainable_parameters
    assert fsdp2.parameters == 4 * fsdp2.trainable_parameters + 2 * frozen
    assert fp32.parameters == 4 * fp32.total_parameters
    assert (fp32.gradients, fp32.optimizer_states) == (fsdp2.gradients, fsdp2.optimizer_states)


def test_fsdp2_from_the_command_and_a_config(tmp_path, tiny_dir, capsys):
    assert plan_command(["--model", str(tiny_dir), "--gpus", "2", "--gpu-memory", "16", "--strategy", "fsdp2"]) == 0
    assert "FSDP2 reshard_after_forward=True" in capsys.readouterr().out
    config = {
        "trainer": {
            "devices": 2,
            "precision": "bf16-mixed",
            "strategy": {
                "class_path": "tts_lightning.distributed.fsdp2.Qwen3TTSFSDP2Strategy",
                "init_args": {"reshard_after_forward": False, "activation_checkpointing_policy": []},
            },
        },
        "model": {"freeze": ["speaker_encoder", "talker.text_projection"]},
        "data": {"pretrained": str(tiny_dir), "train_manifest": "train.jsonl", "max_frames_per_batch": 400},
    }
    path = tmp_path / "fsdp2.yaml"
    path.write_text(yaml.safe_dump(config))
    plan = plan_from_config(path, 16)
    assert (plan.layout, plan.sharding, plan.activation_checkpointing) == ("fsdp2", "SHARD_GRAD_OP", False)
    direct = plan_memory(
        tiny_dir,
        gpus=2,
        gpu_memory_gb=16,
        sharding="SHARD_GRAD_OP",
        activation_checkpointing=False,
        freeze=["speaker_encoder", "talker.text_projection"],
        micro_batch_frames=400,
        layout="fsdp2",
    )
    assert plan.total == direct.total and plan.gradients == direct.gradients


def test_torch_optimizer_state_reader_steps_once_on_zero_gradients():
    """torch's `get_optimizer_state_dict`, which FSDP2's resume calls on the fresh optimizer to have
    tensors to read the checkpoint into, creates the AdamW state with one zero-lr step on zero
    gradients: for that step every trainable parameter has a gradient. The planner's FSDP2 resume
    counts them; FSDP1's does not (its reader builds the state from the checkpoint's), nor do the
    quantized optimizers' (their per-rank state is read without it: `rank_local_state`)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[1].requires_grad_(False)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    seen = []
    optim.register_step_pre_hook(lambda *_: seen.append([p.grad is not None for p in model.parameters()]))
    before = [p.detach().clone() for p in model.parameters()]
    state = get_optimizer_state_dict(model, optim)
    assert seen == [[True, True, False, False]]  # one step, with a gradient on each trainable parameter
    assert all(p.grad is None for p in model.parameters())  # freed after it
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert set(state["state"]) == {"0.weight", "0.bias"}

    fsdp1, fsdp2 = (plan_memory("0.6b", **BASE, layout=layout) for layout in ("fsdp1", "fsdp2"))
    from tts_lightning.distributed.memory import CUDA_OVERHEAD_BYTES

    assert fsdp2.resume == fsdp2.parameters + fsdp2.gradients + fsdp2.optimizer_states + CUDA_OVERHEAD_BYTES
    assert fsdp1.resume == fsdp1.parameters + fsdp1.optimizer_states + CUDA_OVERHEAD_BYTES
    quantized = plan_memory("0.6b", **BASE, layout="fsdp2", optimizer="adamw8bit")
    assert quantized.resume == max(
        quantized.startup, quantized.parameters + quantized.optimizer_states + CUDA_OVERHEAD_BYTES
    )
