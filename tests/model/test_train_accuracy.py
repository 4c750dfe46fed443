"""The training accuracies' epoch value (`EpochAccuracy`) is what Lightning's own weighted mean
computed when each codebook's batch accuracy was logged every step with its targets counted as
``batch_size`` (the way they were logged before): bit for bit, through Lightning's result
collection."""

from __future__ import annotations

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from tts_lightning.model.train_accuracy import EpochAccuracy


def test_epoch_accuracy_equals_lightnings_weighted_mean():
    generator = torch.Generator().manual_seed(0)
    groups, steps = 16, 40
    ours, lightnings = EpochAccuracy(), _ResultCollection(training=True)
    for _ in range(steps):
        counted = torch.randint(0, 300, (groups,), generator=generator)
        correct = (torch.rand(groups, generator=generator) * counted).floor()
        accuracy = correct / counted.clamp(min=1)  # as `codebook_accuracy` computes it
        ours.update(accuracy, counted)
        for j in range(groups):
            lightnings.log(
                "training_step", f"acc_{j}", accuracy[j], on_step=False, on_epoch=True, batch_size=counted[j]
            )
    expected = torch.stack([lightnings[f"training_step.acc_{j}"].compute() for j in range(groups)])
    assert torch.equal(ours.result(), expected), (ours.result() - expected).abs().max()
    ours.reset()
    assert ours.weighted is None and ours.counted is None
