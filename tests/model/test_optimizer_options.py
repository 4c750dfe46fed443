"""`model.optimizer` on one process: what bf16 weights do to small updates, the refused combinations,
and the planner's model-state bytes against the real ones on the tiny model."""

import pytest
import torch

from tts_lightning import Qwen3TTSModule
from tts_lightning.distributed.memory import plan_memory
from tts_lightning.errors import ConfigError
from tts_lightning.model.optimizers import OPTIMIZERS, build_optimizer, check_optimizer

LR = 2e-6  # a fine-tuning rate of the real models


def _one_step(name: str, weights: torch.Tensor) -> torch.Tensor:
    """The weights after one step with a gradient of +1 everywhere (Adam's first update is lr)."""
    param = torch.nn.Parameter(weights.clone())
    if name == "torch_adamw":
        optimizer = torch.optim.AdamW([param], lr=LR, weight_decay=0.0)
    else:
        optimizer = build_optimizer(name, [param], LR, 0.0)
    param.grad = torch.ones_like(param)
    optimizer.step()
    return param.detach()


def test_bf16_weights_need_stochastic_rounding():
    """bf16 keeps 8 significant bits: in [0.5, 1) a step is 2**-8, so a 2e-6 update rounds back to
    the same weight for every value with round-to-nearest; stochastic rounding moves a value by one
    step with probability update / step, so the weights move by the update on average."""
    weights = (0.5 + 0.5 * torch.rand(1_000_000, generator=torch.Generator().manual_seed(0))).bfloat16()
    plain = _one_step("torch_adamw", weights)
    assert plain.dtype == torch.bfloat16
    assert (plain == weights).float().mean() > 0.999  # the update is lost
    rounded = _one_step("bf16_sr", weights)
    assert rounded.dtype == torch.bfloat16
    moved = (rounded.float() - weights.float()).mean().item()
    assert moved == pytest.approx(-LR, rel=0.15)  # the expected update, on average
    changed = (rounded != weights).float().mean().item()
    assert changed == pytest.approx(LR / 2**-8, rel=0.2)  # each value moved by one bf16 step, rarely


@pytest.mark.parametrize(
    ("optimizer", "precision", "message"),
    [
        ("adamw", "bf16-true", "trainer.precision bf16-true stores the weights in 16 bits"),
        ("adamw8bit", "16-true", "trainer.precision 16-true stores the weights in 16 bits"),
        ("bf16_sr", "32-true", "model.optimizer bf16_sr keeps bf16 weights and computes in bf16"),
        ("bf16_sr_adamw8bit", "bf16-true", "set trainer.precision bf16-mixed"),
        ("sgd", None, "model.optimizer 'sgd' is not one of"),
    ],
)
def test_combinations_that_lose_updates_are_refused(optimizer, precision, message):
    with pytest.raises(ConfigError, match=message):
        check_optimizer(optimizer, precision)


def test_the_module_refuses_an_unknown_optimizer(tiny_dir):
    with pytest.raises(ConfigError, match="model.optimizer 'lion'"):
        Qwen3TTSModule(str(tiny_dir), optimizer="lion")


def _state_bytes(value) -> int:
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    if isinstance(value, (OptimState8bit, OptimState4bit)):
        return sum(t.numel() * t.element_size() for t in (value.codes, value.scale, value.qmap))
    return value.numel() * value.element_size()


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_planner_bytes_equal_the_measured_model_states(tiny_dir, optimizer):
    """On one GPU (FSDP1 runs NO_SHARD: each piece is a whole parameter) the planner's weights,
    gradients and moments are the bytes the module holds after a step (step counters left out)."""
    module = Qwen3TTSModule(str(tiny_dir), speakers=["alice"], optimizer=optimizer)
    module.configure_model()
    trainable = [p for p in module.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.randn_like(p)
    step = module.configure_optimizers()["optimizer"]
    step.step()
    weights = sum(p.numel() * p.element_size() for p in module.model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in trainable)
    moments = sum(_state_bytes(v) for s in step.state.values() for k, v in s.items() if k != "step")
    precision = "bf16-mixed" if optimizer.startswith("bf16_sr") else "32-true"
    plan = plan_memory(str(tiny_dir), gpus=1, gpu_memory_gb=1, precision=precision, optimizer=optimizer)
    assert (plan.parameters, plan.gradients, plan.optimizer_states) == (weights, grads, moments)
    if optimizer != "adamw":
        assert plan.optimizer_states < plan.parameters * 2  # less than AdamW's 8 bytes per trained value
