"""`rank_local_state`: a rank's quantized optimizer state as plain tensors and back, on one process
(the 2-rank saves and resumes are tests/distributed/test_optimizers.py)."""

import pytest
import torch

from tts_lightning.distributed.rank_local_state import local_state, restore
from tts_lightning.errors import ConfigError
from tts_lightning.model.optimizers import build_optimizer


def _stepped(name: str, numel: int, steps: int = 2):
    param = torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
    optimizer = build_optimizer(name, [param], 1e-3, 0.01)
    for _ in range(steps):
        param.grad = torch.randn(numel)
        optimizer.step()
    return param, optimizer


def _copy(tree):
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree.clone()


@pytest.mark.parametrize(("name", "kind"), [("adamw8bit", "OptimState8bit"), ("adamw4bit", "OptimState4bit")])
def test_quantized_state_round_trips_exactly(name, kind):
    param, optimizer = _stepped(name, 8192)
    saved = _copy(local_state(optimizer))  # views of the state: a checkpoint writes them out
    assert all(type(t) is torch.Tensor for t in saved["state"]["0"]["exp_avg"].values())  # plain tensors
    fresh_param = torch.nn.Parameter(param.detach().clone())
    fresh = build_optimizer(name, [fresh_param], 5e-4, 0.01)
    restore(fresh, saved)
    old, new = optimizer.state[param], fresh.state[fresh_param]
    assert type(new["exp_avg"]).__name__ == kind and float(new["step"]) == 2.0
    for moment in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(old[moment].codes, new[moment].codes) and torch.equal(old[moment].scale, new[moment].scale)
        assert torch.equal(old[moment].dequantize(), new[moment].dequantize())
    assert float(fresh.param_groups[0]["lr"]) == pytest.approx(1e-3)  # the saved rate, not the new one
    # The next step is the same from either.
    grad = torch.randn(8192)
    param.grad, fresh_param.grad = grad.clone(), grad.clone()
    optimizer.step()
    fresh.step()
    assert torch.equal(param, fresh_param)


def test_another_sharding_is_refused():
    _, optimizer = _stepped("adamw8bit", 8192, steps=1)
    other = build_optimizer("adamw8bit", [torch.nn.Parameter(torch.zeros(4096))], 1e-3, 0.01)
    with pytest.raises(ConfigError, match="saved with another sharding"):
        restore(other, local_state(optimizer))
