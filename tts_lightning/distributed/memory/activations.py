"""The activation model: bytes saved for backward per micro-batch, from constants counted on the
real layer classes (`_activation_bytes`), and which decoder-layer classes are checkpointed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tts_lightning.distributed import row_chunks
from tts_lightning.distributed.memory.shapes import PREDICTOR_LAYER, TALKER_LAYER, _import_classes

__all__ = ["HEAD_LOGIT_BYTES", "LOGIT_BYTES", "PREDICTOR_LAYER_BYTES", "PREDICTOR_TARGET_BYTES", "TALKER_LAYER_BYTES"]

# Bytes saved for backward per token per decoder layer, as coefficients of
# (H = hidden, A = heads * head_dim, KV = kv_heads * head_dim, I = intermediate), by compute dtype.
# Counted with torch.autograd.graph.saved_tensors_hooks (unique storages) on the real classes driven
# by `tts_lightning.model.loss.compute_loss`, varying one width at a time; the fits are exact to
# < 4% at widths of 256 and the residual shrinks with width. H: two RMSNorms (each saves an fp32
# copy of its input plus bf16 casts) and the projections' inputs; A: q, attention output and o_proj
# input; I: gate, up, act(gate) and the down_proj input. The talker gets an attention mask (padded
# batches), so transformers expands K/V to all heads (repeat_kv) before SDPA: K/V cost ~A there.
# The code predictor runs without a mask and uses SDPA's native GQA. GPU flash / memory-efficient
# SDPA saves the same q, k, v, output and logsumexp, with no sequence x sequence term.
TALKER_LAYER_BYTES = {2: (16, 14, 6, 8), 4: (24, 24, 8, 16)}
PREDICTOR_LAYER_BYTES = {2: (16, 10, 10, 8), 4: (24, 16, 16, 16)}
# Talker logits: each one is kept as fp32 in the loss output (the module's accuracy metrics read it),
# saved again as fp32 log-softmax by cross-entropy, and gets an fp32 gradient: 12 bytes.
LOGIT_BYTES = 12
# Code-predictor logits exist one block of `row_chunks.HEAD_ROWS` frames at a time (`loss.predictor_losses`);
# while backward recomputes a block: its fp32 log-softmax, the incoming fp32 gradient, the fp32 and
# bf16 gradients of the logits (bf16 compute; ~12 in fp32). Kept for the step: an fp32 NLL and an
# int64 top-1 code per target.
HEAD_LOGIT_BYTES = 14
PREDICTOR_TARGET_BYTES = 12


def _layer_bytes(coef: tuple[int, ...], h: int, a: int, kv: int, i: int) -> int:
    return coef[0] * h + coef[1] * a + coef[2] * kv + coef[3] * i


def _activation_bytes(
    d: Mapping[str, int],
    positions: int,
    b: int,
    ckpt_talker: bool,
    ckpt_predictor: bool,
    frames: int | None = None,
    targets: int | None = None,
) -> tuple[int, int]:
    """(activations alive at the start of backward, logits/outputs alive until the step ends).

    ``positions`` = padded talker positions per micro-batch (the data module's
    ``max_frames_per_batch``); code-predictor frames and talker targets are bounded by it (the text
    prefill has no frames), so both are taken equal to it unless given: an upper bound.
    Talker, per position: each of the L layers saves ``TALKER_LAYER_BYTES`` (all of them without
    checkpointing; only its b*H input with checkpointing, plus one layer's full set while that
    layer is recomputed in backward); outside the layers, the text projection (b*(T + 2*I_t)), the
    final RMSNorm ((4 + 2b)*H) and the codec_head input (b*H).
    Code predictor, per frame: 16 positions through its layers (same rule, ``PREDICTOR_LAYER_BYTES``;
    a checkpointed layer is recomputed by blocks of ``PREDICTOR_ROWS`` frames,
    `tts_lightning.distributed.row_chunks`, so one block's full set is alive), the
    small_to_mtp_projection input (b*16*H, when it is a Linear), its final norm ((4+2b)*16*H_cp).
    Logits: talker ``vocab`` per target, ``LOGIT_BYTES`` each, and 15 x ``cp_vocab`` per frame of one
    block of ``HEAD_ROWS`` frames, ``HEAD_LOGIT_BYTES`` each, and the heads' weight gradients, a
    recomputation like a layer's (the heads' backward ends before the predictor layers' begins: the
    larger of the two counts).
    """
    P = positions
    F = positions if frames is None else frames
    targets = F if targets is None else targets
    talker_layer = _layer_bytes(TALKER_LAYER_BYTES[b], d["hidden"], d["attn"], d["kv"], d["intermediate"])
    cp_layer = _layer_bytes(PREDICTOR_LAYER_BYTES[b], d["cp_hidden"], d["cp_attn"], d["cp_kv"], d["cp_intermediate"])
    cp_tokens = F * d["code_groups"]
    recompute = 0
    if ckpt_talker:
        talker = P * d["layers"] * b * d["hidden"]
        recompute = max(recompute, P * talker_layer)
    else:
        talker = P * d["layers"] * talker_layer
    if ckpt_predictor:
        predictor = cp_tokens * d["cp_layers"] * b * d["cp_hidden"]
        recompute = max(recompute, min(F, row_chunks.PREDICTOR_ROWS) * d["code_groups"] * cp_layer)
    else:
        predictor = cp_tokens * d["cp_layers"] * cp_layer
    # With several blocks, the heads' weight gradients are summed in autograd's buffers until the last
    # (an upper bound: none when the heads are frozen, e.g. LoRA's defaults).
    head_weights = d["cp_heads"] * d["cp_hidden"] * d["cp_vocab"] * b if F > row_chunks.HEAD_ROWS else 0
    recompute = max(
        recompute, min(F, row_chunks.HEAD_ROWS) * d["cp_heads"] * d["cp_vocab"] * HEAD_LOGIT_BYTES + head_weights
    )
    other = (
        P * b * (d["text_hidden"] + 2 * d["text_intermediate"])
        + P * (4 + 2 * b) * d["hidden"]
        + targets * b * d["hidden"]
        + cp_tokens * b * d["hidden"] * d["cp_projection"]
        + cp_tokens * (4 + 2 * b) * d["cp_hidden"]
    )
    logits = LOGIT_BYTES * targets * d["vocab"] + PREDICTOR_TARGET_BYTES * F * d["cp_heads"]
    return talker + predictor + recompute + other, logits


def _checkpointed(activation_checkpointing: bool | Sequence[str]) -> tuple[bool, bool]:
    if isinstance(activation_checkpointing, bool):
        return activation_checkpointing, activation_checkpointing
    classes = set(_import_classes(list(activation_checkpointing)))
    talker_cls, cp_cls = _import_classes([TALKER_LAYER])[0], _import_classes([PREDICTOR_LAYER])[0]
    return (any(issubclass(talker_cls, c) for c in classes), any(issubclass(cp_cls, c) for c in classes))
