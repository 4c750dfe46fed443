"""The code predictor's layers, and its heads, checkpointed by blocks of rows
(`tts_lightning.distributed.row_chunks`): the same loss and gradients as checkpointing them whole,
a lower peak, and the planner's model of the difference; on the real classes, with
benchmarks/activation_memory.py's small model and method."""

import sys
from pathlib import Path

import pytest
import torch

from tts_lightning.distributed import row_chunks
from tts_lightning.distributed.row_chunks import checkpoint_by_rows, is_checkpointed_by_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import activation_memory as bench  # noqa: E402


@pytest.mark.slow
def test_rows_keep_loss_and_gradients_and_cut_the_peak_as_planned(monkeypatch):
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSDecoderLayer

    monkeypatch.setattr(row_chunks, "PREDICTOR_ROWS", 16)
    # The tiny model's 256 codes: the heads' logits smaller than a layer's recomputation.
    config, model = bench.build_model(layers=2, dtype=torch.float32, codebook_size=256)
    batch = bench.build_batch(config, 100)  # 6 blocks of 16 rows and one of 4
    _, fsdp2_way = bench.build_model(layers=2, dtype=torch.float32, codebook_size=256)  # the same seeded weights
    for layer in fsdp2_way.modules():
        if isinstance(layer, Qwen3TTSDecoderLayer):
            checkpoint_by_rows(layer, checkpointed=False)  # what the FSDP2 strategy applies
    wrappers = bench.checkpoint_layers(model)  # what Lightning's FSDP1 activation checkpointing applies
    with bench.arm("whole", "blocks", wrappers):
        whole, planned_whole = bench.step_peak(model, batch), sum(bench.planned(config, batch, 4))
    with bench.arm("rows", "blocks", wrappers):  # what the FSDP1 strategy adds
        assert all(is_checkpointed_by_rows(w) for w in wrappers) and len(wrappers) == 2
        rows, rows_fsdp2 = bench.step_peak(model, batch), bench.step_peak(fsdp2_way, batch)
        planned_rows = sum(bench.planned(config, batch, 4))

    for other in (rows, rows_fsdp2):
        torch.testing.assert_close(other[2], whole[2], rtol=1e-6, atol=0)
        for a, b in zip(other[3], whole[3]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    planned_cut = planned_whole - planned_rows
    assert planned_cut > 0
    for other in (rows, rows_fsdp2):
        assert whole[0] - other[0] == pytest.approx(planned_cut, rel=0.2)


@pytest.mark.slow
def test_head_blocks_keep_loss_and_gradients_and_cut_the_peak_as_planned(monkeypatch):
    """The code predictor's heads and cross-entropy by checkpointed blocks of frames
    (`loss.predictor_losses`) against all frames' logits at once and kept, as before: the same loss
    and gradients, and the planner's cut of the peak (the logits of all frames but one block's)."""
    monkeypatch.setattr(row_chunks, "PREDICTOR_ROWS", 16)
    monkeypatch.setattr(row_chunks, "HEAD_ROWS", 16)
    config, model = bench.build_model(layers=2, dtype=torch.float32)
    # 25 blocks of 16 frames: at 100, the heads' weight gradients, summed over the blocks, would
    # cost as much as the logits cut.
    batch = bench.build_batch(config, 400)
    wrappers = bench.checkpoint_layers(model)
    peaks, plans = {}, {}
    for name in ("whole", "blocks"):
        with bench.arm("rows", name, wrappers):
            peaks[name], plans[name] = bench.step_peak(model, batch), sum(bench.planned(config, batch, 4))
    torch.testing.assert_close(peaks["blocks"][2], peaks["whole"][2], rtol=1e-6, atol=0)
    for a, b in zip(peaks["blocks"][3], peaks["whole"][3]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    planned_cut = plans["whole"] - plans["blocks"]
    assert planned_cut > 0
    assert peaks["whole"][0] - peaks["blocks"][0] == pytest.approx(planned_cut, rel=0.2)


def test_no_blocks_without_gradients_or_with_a_cache(monkeypatch):
    """Validation and generation call the layer once (generation's KV cache is not split)."""
    calls = []
    layer = torch.nn.Linear(4, 4)
    layer.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
    checkpoint_by_rows(layer, checkpointed=True)
    monkeypatch.setattr(row_chunks, "PREDICTOR_ROWS", 2)
    x = torch.randn(5, 4)
    with torch.no_grad():
        layer(x)
    assert calls == [5]
    calls.clear()
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert calls == [5]  # the hook sees the module's one call; the blocks run its class forward inside
