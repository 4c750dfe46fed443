"""A training step reads nothing back from the device except on logging steps (`tests/host_reads.py`
counts the reads on CPU that would block the host on a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
from host_reads import HostReads
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger

from tts_lightning import Qwen3TTSModule
from tts_lightning.cli import StepProgressBar

LOG_EVERY = 3
TRANSFORMERS_MASK_CHECK = " _ignore_causal_mask_sdpa"  # transformers/masking_utils.py
SIGNALS_AGREED = " result"  # tts_lightning/distributed/scheduler_signals.py


def test_training_steps_read_back_only_when_logging(tiny_dir, make_datamodule, tmp_path):
    """A real single-process fit with the shipped defaults (logger, learning-rate monitor, progress
    bar, gradient clipping by norm) and, as the 1-GPU configs, gradients accumulated over micro-batches:
    zero scalar reads and host copies on the micro-batches that do not log (only a logged step's
    last one does)."""
    data = make_datamodule(num_workers=1)  # the collate runs in a worker, as on GPU runs
    reads = HostReads()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2 * LOG_EVERY,
        log_every_n_steps=LOG_EVERY,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=CSVLogger(tmp_path),
        callbacks=[reads, LearningRateMonitor(logging_interval="step"), StepProgressBar()],
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names)
    trainer.fit(module, datamodule=data)
    print(*reads.steps, sep="\n")
    assert sorted({r.step for r in reads.steps}) == list(range(1, 2 * LOG_EVERY + 1))
    assert len(reads.steps) > 2 * LOG_EVERY  # micro-batches (an epoch's last step may have one)
    last_of_step = {r.step: r for r in reads.steps}  # the micro-batch that steps the optimizer
    logging = [r for step, r in last_of_step.items() if step % LOG_EVERY == 0]
    quiet = [r for r in reads.steps if not any(r is s for s in logging)]
    # A padded batch reads nothing; a batch with nothing padded leaves transformers one read: whether
    # the 2D attention mask pads anything, asked once per talker forward (docs/architecture.md,
    # "Host reads in a training step").
    assert {r.padded for r in quiet} == {True, False}, quiet  # the demo's batches at 150 frames have both
    assert all(r.syncs == 0 for r in quiet if r.padded), quiet
    unpadded = [r for r in quiet if not r.padded]
    assert all(r.syncs == 1 and next(iter(r.sites)).endswith(TRANSFORMERS_MASK_CHECK) for r in unpadded), quiet
    # Only transformers' SDPA mask check (one per talker forward) selects by data (docs/architecture.md).
    assert all(r.shape_reads == 0 for r in reads.steps), reads.steps
    logged = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()[0].split(",")
    for name in ("train/loss_step", "train/loss_epoch", "train/acc_codebook_0_step", "train/acc_codebook_15_epoch"):
        assert name in logged, logged  # the names TensorBoard readers and the tests know
    assert all(r.syncs > 1 for r in logging), logging  # the counter sees the logged values read back


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_fsdp_training_steps_read_back_only_when_logging(strategy, tiny_dir, demo_data, run_script, tmp_path):
    """The same with 2 real FSDP processes (gloo), FSDP1 at 32-true and FSDP2 at bf16-mixed: the loss
    all-reduce for logging, the speaker table's collectives and clipping by the norm over both
    ranks' shards read nothing back."""
    _, manifest, cache = demo_data
    worker = Path(__file__).parents[1] / "distributed" / "host_reads_worker.py"
    run_script(worker, tiny_dir, manifest, cache, tmp_path, LOG_EVERY, strategy, timeout=300, cwd=tmp_path, ranks=2)
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [s["step"] for s in steps] == list(range(1, 2 * LOG_EVERY + 1)), steps
        quiet = [s for s in steps if s["step"] % LOG_EVERY]
        # The FSDP strategies' agreement on signals waits on the first batch only (later batches read the
        # previous batch's, from the host: tts_lightning/distributed/scheduler_signals.py; Lightning's own
        # per-step broadcast and read of its flag is off); transformers' mask check reads where the
        # batch pads nothing.
        for s in quiet:
            expected = ([] if s["padded"] else [TRANSFORMERS_MASK_CHECK]) + ([SIGNALS_AGREED] if s["step"] == 1 else [])
            assert s["syncs"] == len(expected), (rank, quiet)
            assert sorted(site[site.rindex(" ") :] for site in s["sites"]) == sorted(expected), (rank, quiet)
        assert all(s["shape_reads"] == 0 for s in steps), (rank, steps)


def test_codebook_accuracy_equals_torchmetrics(tiny_dir, make_datamodule):
    """The training accuracies (`codebook_accuracy`, all codebooks at once) are torchmetrics'
    micro-averaged top-1 `MulticlassAccuracy` of each codebook, as logged before."""
    import torch
    from torchmetrics.classification import MulticlassAccuracy

    from tts_lightning.model.loss import codebook_accuracy, compute_loss

    data = make_datamodule()
    data.setup("fit")
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names)
    module.configure_model()
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        out = compute_loss(module.talker, batch)
    accuracy, counted = codebook_accuracy(out)
    # The code predictor's logits are not kept (`predictor_losses`): its top-1 codes are compared.
    codes = module.talker.code_predictor.config.vocab_size
    pairs = [(out.talker_logits, out.talker_targets, out.talker_logits.shape[-1])] + [
        (out.predictor_predictions[:, j], out.predictor_targets[:, j], codes)
        for j in range(out.predictor_targets.shape[1])
    ]
    assert accuracy.shape == (len(pairs),)
    for j, (predicted, targets, classes) in enumerate(pairs):
        reference = MulticlassAccuracy(classes, top_k=1, average="micro", ignore_index=-100)
        torch.testing.assert_close(accuracy[j], reference(predicted, targets), rtol=0, atol=1e-7)
        assert int(counted[j]) == targets.numel()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_padded_batch_attends_with_transformers_mask_and_the_same_bits(attention, tiny_dir, make_datamodule):
    """The talker's mask for a padded batch, built without transformers' check, is the one
    transformers builds from the 2D mask for the configured attention: the same tensor, and the
    same loss and gradients bit for bit (`padded=False` sends the 2D mask through transformers' own
    path)."""
    import dataclasses

    import torch
    from transformers.masking_utils import create_causal_mask

    from tts_lightning.model.loss import compute_loss, talker_attention_mask

    data = make_datamodule(max_frames_per_batch=2000)  # all 20 clips in one batch
    data.setup("fit")
    module = Qwen3TTSModule(str(tiny_dir), speakers=data.speaker_names, attn_implementation=attention)
    module.configure_model()
    talker = module.talker
    assert talker.model.config._attn_implementation == attention
    (batch,) = list(data.train_dataloader())
    assert batch.padded and bool((batch.attention_mask == 0).any())
    S = batch.attention_mask.shape[1]
    theirs = create_causal_mask(
        talker.model.config, torch.zeros(len(batch), S, 1), batch.attention_mask, torch.arange(S), None
    )
    assert theirs is not None and torch.equal(talker_attention_mask(talker, batch, torch.float32), theirs)

    def loss_and_grads(b):
        talker.zero_grad(set_to_none=True)
        loss = compute_loss(talker, b).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in talker.parameters() if p.grad is not None]

    prepared, transformers_path = loss_and_grads(batch), loss_and_grads(dataclasses.replace(batch, padded=False))
    assert torch.equal(prepared[0], transformers_path[0])
    assert len(prepared[1]) == len(transformers_path[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(prepared[1], transformers_path[1], strict=True))
