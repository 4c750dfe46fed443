"""Peak memory of one training forward + backward (`compute_loss`, activation checkpointing on both
decoder-layer classes as the strategies apply it), in three arms, beside the memory planner's
activation figure for the same shapes.

The model is the real `Qwen3TTSForConditionalGeneration` in bf16 with small widths (hidden 256 in
the talker and the code predictor, 2 layers each, SDPA; by default the released models' 2048 codes per codebook), so
that a batch of ``--frames`` frames runs in seconds on a CPU core; the code predictor sees one row
per frame, as at any size. The arms run in this process, alternately, ``--repeats`` times each, on
the same weights and batch:

* ``whole``: Lightning's ``CheckpointWrapper`` (torch's ``checkpoint_wrapper``) on every decoder
  layer, and the code predictor's 15 heads and cross-entropy on all frames at once, their logits
  kept for backward;
* ``rows``: the same, the predictor layers' wrappers called once per `PREDICTOR_ROWS` rows (FSDP1's
  path; FSDP2 checkpoints the same blocks with ``torch.utils.checkpoint``);
* ``heads``: ``rows``, and the heads and cross-entropy by checkpointed blocks of `HEAD_ROWS` frames
  (`tts_lightning.model.loss.predictor_losses`), what training runs now.

Method: torch.profiler's memory events (every CPU allocation and free, ``profile_memory=True``)
from the start of the forward to the end of the backward; the peak of their running sum is the
peak of bytes allocated above the level before the step. The parameters' gradients are allocated
(zeros) before, so the figure is activations, logits and transients (a layer's incoming gradient).
Only the loss is kept for backward, as in Lightning (the step returns it; its other outputs go).
The loss and every gradient of the arms are compared (they must agree to bf16 rounding).

    PYTHONPATH=. python benchmarks/activation_memory.py [--frames 2048] [--repeats 2] [--codebook-size 2048]

(about a minute and 2 GiB).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

MiB = 2**20


def build_model(layers: int = 2, dtype: torch.dtype = torch.bfloat16, codebook_size: int = 2048):
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    from tts_lightning.model.tiny import tiny_configs

    config, _ = tiny_configs(codebook_size=codebook_size)
    talker = config["talker_config"]
    widths = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    talker.update(
        **widths,
        num_hidden_layers=layers,
        rope_scaling={"rope_type": "default", "mrope_section": [16, 8, 8], "interleaved": True},
    )
    talker["code_predictor_config"].update(**widths, num_hidden_layers=layers)
    config["speaker_encoder_config"]["enc_dim"] = 256
    cfg = Qwen3TTSConfig.from_dict(config)
    for c in (cfg, cfg.talker_config, cfg.talker_config.code_predictor_config):
        c._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return config, Qwen3TTSForConditionalGeneration(cfg).to(dtype).train()


def build_batch(config: dict, frames: int):
    from tts_lightning.model.sequence import SpecialIds, build_sequence, collate

    rng = random.Random(0)
    ids = SpecialIds.from_config(config)
    text = [1, 2, 3] + [rng.randrange(300) for _ in range(20)] + [4, 5, 6, 7, 8]
    seq = build_sequence(ids, text, torch.randint(0, 256, (frames, 16), generator=torch.Generator().manual_seed(0)))
    return collate([seq], torch.randn(1, 256), [0], pad_text_id=0)


def checkpoint_layers(model) -> list:
    """Lightning's FSDP1 activation checkpointing (torch's wrapper) on both decoder-layer classes;
    returns the predictor layers' wrappers."""
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSDecoderLayer, Qwen3TTSTalkerDecoderLayer
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
    )

    classes = (Qwen3TTSTalkerDecoderLayer, Qwen3TTSDecoderLayer)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, classes))
    return [
        m
        for m in model.modules()
        if isinstance(m, CheckpointWrapper) and isinstance(m._checkpoint_wrapped_module, Qwen3TTSDecoderLayer)
    ]


def step_peak(model, batch) -> tuple[int, float, torch.Tensor, list[torch.Tensor]]:
    """(peak bytes allocated above the start, seconds, loss, gradients) of one forward + backward."""
    from tts_lightning.model.loss import compute_loss

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = compute_loss(model.talker, batch).loss
        loss.backward()
        loss = loss.detach()
    seconds = time.perf_counter() - start
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak, seconds, loss, [p.grad.clone() for p in params]


ARMS = {"whole": ("whole", "whole"), "rows": ("rows", "whole"), "heads": ("rows", "blocks")}


@contextmanager
def arm(layers: str, heads: str, wrappers: list):
    """Run the code predictor's layers (``"whole"`` or by ``"rows"``) and heads (``"whole"`` or by
    ``"blocks"``) as an arm of the module docstring does, with the planner's constants set to match;
    ``wrappers``: `checkpoint_layers`'s."""
    from tts_lightning.distributed import row_chunks
    from tts_lightning.distributed.memory import activations
    from tts_lightning.model import loss

    saved = (row_chunks.PREDICTOR_ROWS, row_chunks.HEAD_ROWS, activations.HEAD_LOGIT_BYTES)
    saved_losses = loss.predictor_losses
    for w in wrappers:
        w.__dict__.pop("forward", None)
        if layers == "rows":
            row_chunks.checkpoint_by_rows(w, checkpointed=True)
    if layers == "whole":
        row_chunks.PREDICTOR_ROWS = 10**9  # for the planner: the whole layer as one block
    if heads == "whole":
        # The heads before: all frames' logits at once and kept (fp32, log-softmax, gradient).
        loss.predictor_losses = lambda talker, hidden, targets: loss._head_losses(
            talker.code_predictor.lm_head, hidden, targets
        )
        row_chunks.HEAD_ROWS, activations.HEAD_LOGIT_BYTES = 10**9, activations.LOGIT_BYTES
    try:
        yield
    finally:
        row_chunks.PREDICTOR_ROWS, row_chunks.HEAD_ROWS, activations.HEAD_LOGIT_BYTES = saved
        loss.predictor_losses = saved_losses
        for w in wrappers:
            w.__dict__.pop("forward", None)


def planned(config: dict, batch, compute_bytes: int = 2) -> tuple[int, int]:
    """The planner's (activations, logits) for this batch, both layer kinds checkpointed, with the
    constants of the arm it runs in (`arm`)."""
    from tts_lightning.distributed.memory import _activation_bytes, model_shape

    frames, targets = int(batch.frame_mask.sum()), int((batch.labels != -100).sum())
    d = model_shape(config).dims
    return _activation_bytes(d, batch.text_ids.numel(), compute_bytes, True, True, frames=frames, targets=targets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--codebook-size", type=int, default=2048, help="2048 as released; 256 as the tiny model")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from tts_lightning.distributed.row_chunks import HEAD_ROWS, PREDICTOR_ROWS

    config, model = build_model(codebook_size=args.codebook_size)
    batch = build_batch(config, args.frames)
    wrappers = checkpoint_layers(model)
    results: dict[str, list] = {name: [] for name in ARMS}
    plans = {}
    for _ in range(args.repeats):
        for name in results:
            with arm(*ARMS[name], wrappers):
                results[name].append(step_peak(model, batch))
                plans[name] = planned(config, batch)
    print(
        f"{args.frames} frames ({batch.text_ids.shape[1]} talker positions), {args.codebook_size} codes, bf16, "
        f"PREDICTOR_ROWS={PREDICTOR_ROWS}, HEAD_ROWS={HEAD_ROWS}"
    )
    for name, runs in results.items():
        acts, logits = plans[name]
        peaks = ", ".join(f"{r[0] / MiB:.0f}" for r in runs)
        times = ", ".join(f"{r[1]:.1f}" for r in runs)
        print(
            f"  {name:5s}: measured peak {peaks} MiB ({times} s); planner {(acts + logits) / MiB:.0f} MiB "
            f"(activations {acts / MiB:.0f} + logits {logits / MiB:.0f})"
        )
    _, _, loss_w, grads_w = results["whole"][0]
    for name in ("rows", "heads"):
        _, _, loss_r, grads_r = results[name][0]
        worst = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in zip(grads_w, grads_r))
        print(f"  loss whole {float(loss_w):.6f}, {name} {float(loss_r):.6f}; largest gradient difference {worst:.2e}")
    best = {name: min(r[0] for r in runs) for name, runs in results.items()}
    print(f"  peak rows / whole: {best['rows'] / best['whole']:.3f}; heads / rows: {best['heads'] / best['rows']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
