"""The fine-tuning loss, aligned once and only once with what generation does.

Talker: the hidden state at position p (after the final norm) goes through ``codec_head`` and is
scored against the code-0 token at p+1: code 0 of each frame, then ``codec_eos``.

Code predictor, frame k: generation starts it with ``past_hidden`` (the talker's hidden state at the
position that predicted code 0 of frame k) followed by ``codec_embedding(code0_k)``; each further
input is the previous codebook's embedding. Head j reads position j+1 and predicts codebook j+1,
for j = 0..14: all 15 heads are trained.

The upstream recipe gets three of these wrong (labels shifted twice, ``past_hidden`` taken one
position late, ``text_projection`` skipped); see tests/model/test_loss_parity.py for the proof.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

from tts_lightning.distributed.row_chunks import checkpointed_by_rows
from tts_lightning.model.sequence import IGNORE_INDEX, TalkerBatch, embed_batch


@dataclass
class LossOutput:
    loss: Tensor  # talker + weight * code predictor
    talker_loss: Tensor  # mean NLL over talker targets in the batch
    code_predictor_loss: Tensor  # mean NLL over all (frame, codebook 1..G-1) targets
    codebook_losses: Tensor  # (G-1,) mean NLL per code-predictor codebook
    talker_nll: Tensor  # (N_t,) per target, in batch order
    talker_example: Tensor  # (N_t,) example index of each talker target
    talker_logits: Tensor  # (N_t, V_talker) fp32
    talker_targets: Tensor  # (N_t,)
    predictor_nll: Tensor  # (N_f, G-1) per frame and codebook
    predictor_example: Tensor  # (N_f,) example index of each frame
    predictor_predictions: Tensor  # (N_f, G-1) top-1 code (the logits are not kept: `predictor_losses`)
    predictor_targets: Tensor  # (N_f, G-1)


def talker_attention_mask(talker, batch: TalkerBatch, dtype: torch.dtype) -> Tensor:
    """The mask the talker attends with. For a padded batch, the (B, 1, S, S) causal padding mask
    transformers builds from the 2D one (`create_causal_mask`, the configured attention's mask
    function), built here because the collate knows the batch is padded: transformers first asks
    the device whether anything is (`_ignore_causal_mask_sdpa`: ``padding_mask.all()``, a host wait
    per forward on a GPU). Same mask, same kernel, same bits. A batch with nothing padded keeps the
    2D mask, from which transformers gives SDPA no mask (its ``is_causal`` kernel): only its check
    makes that choice (with no mask at all, the talker's position ids make it build a
    packed-sequence mask, another kernel). Sliding-window talkers keep the 2D mask too."""
    config = talker.model.config
    if not batch.padded or getattr(config, "sliding_window", None) is not None:
        return batch.attention_mask
    B, S = batch.attention_mask.shape
    return ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation](
        batch_size=B,
        cache_position=torch.arange(S, device=batch.attention_mask.device),
        kv_length=S,
        kv_offset=0,
        mask_function=causal_mask_function,
        attention_mask=batch.attention_mask.bool(),
        allow_is_causal_skip=False,
        dtype=dtype,
        config=config,
    )


def talker_hidden_states(talker, batch: TalkerBatch) -> Tensor:
    """Last hidden states (B, S, D) of the talker over the whole teacher-forced sequence."""
    inputs_embeds = embed_batch(talker, batch)
    # Always pass a mask: without it transformers treats position jumps as packed sequences.
    position_ids, _ = talker.get_rope_index(batch.attention_mask)
    out = talker.model(
        inputs_embeds=inputs_embeds,
        attention_mask=talker_attention_mask(talker, batch, inputs_embeds.dtype),
        position_ids=position_ids,
        use_cache=False,
    )
    return out.last_hidden_state


def code_predictor_inputs(talker, past_hidden: Tensor, codes: Tensor) -> Tensor:
    """(N, G, D): past_hidden, then the embeddings of codes 0..G-2 of each frame, as generation
    feeds them (code 0 through the talker's codec embedding, g >= 1 through the predictor's)."""
    G = codes.shape[1]
    embeds = [past_hidden[:, None, :], talker.model.codec_embedding(codes[:, :1])]
    predictor_embeddings = talker.code_predictor.model.codec_embedding
    for g in range(1, G - 1):
        embeds.append(predictor_embeddings[g - 1](codes[:, g : g + 1]))
    return torch.cat(embeds, dim=1)


def code_predictor_hidden(talker, inputs: Tensor) -> Tensor:
    """(N, G, D): the code predictor's last hidden states."""
    predictor = talker.code_predictor
    return predictor.model(inputs_embeds=predictor.small_to_mtp_projection(inputs), use_cache=False).last_hidden_state


def head_logits(heads, hidden: Tensor) -> Tensor:
    """(N, G-1, V): head j applied at position j+1 of ``hidden`` (N, G, D)."""
    return torch.stack([heads[j](hidden[:, j + 1]) for j in range(hidden.shape[1] - 1)], dim=1)


def code_predictor_logits(talker, inputs: Tensor) -> Tensor:
    """(N, G-1, V): the code predictor's logits for its inputs (`code_predictor_inputs`)."""
    return head_logits(talker.code_predictor.lm_head, code_predictor_hidden(talker, inputs))


def _head_losses(heads, hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    # Cross-entropy in fp32: under bf16 compute the logits' rounding would dominate small losses.
    logits = head_logits(heads, hidden).float()
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    return nll, logits.argmax(-1)


def predictor_losses(talker, hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(NLL (N, G-1) fp32, top-1 codes (N, G-1)) of the code predictor's heads on its last hidden
    states ``hidden`` (N, G, D) against ``targets`` (N, G-1). Computed by blocks of frames, each
    checkpointed (`tts_lightning.distributed.row_chunks.checkpointed_by_rows`): only one block's
    logits are alive at a time, in the forward and when backward recomputes them."""
    return checkpointed_by_rows(partial(_head_losses, talker.code_predictor.lm_head), hidden, targets)


def compute_loss(talker, batch: TalkerBatch, sub_talker_loss_weight: float = 0.3) -> LossOutput:
    hidden = talker_hidden_states(talker, batch)

    # The collate's indices of the masks' positions (the same rows, in the same order, as selecting
    # with the masks, which on a GPU would read their counts back to the host).
    talker_example, talker_position = batch.target_index.unbind(1)
    talker_targets = batch.labels[talker_example, talker_position]
    # Cross-entropy in fp32: under bf16 compute the logits' rounding would dominate small losses.
    talker_logits = talker.codec_head(hidden[talker_example, talker_position]).float()
    talker_nll = F.cross_entropy(talker_logits, talker_targets, reduction="none")

    frame_example, frame_index = batch.frame_index.unbind(1)
    past_hidden = hidden[frame_example, batch.frame_positions[frame_example, frame_index]]
    codes = batch.codes[frame_example, frame_index]  # (N_f, G)
    predictor_targets = codes[:, 1:]
    predictor_hidden = code_predictor_hidden(talker, code_predictor_inputs(talker, past_hidden, codes))
    predictor_nll, predictor_predictions = predictor_losses(talker, predictor_hidden, predictor_targets)

    talker_loss = talker_nll.mean()
    codebook_losses = predictor_nll.mean(0)
    code_predictor_loss = predictor_nll.mean()
    return LossOutput(
        loss=talker_loss + sub_talker_loss_weight * code_predictor_loss,
        talker_loss=talker_loss,
        code_predictor_loss=code_predictor_loss,
        codebook_losses=codebook_losses,
        talker_nll=talker_nll,
        talker_example=talker_example,
        talker_logits=talker_logits,
        talker_targets=talker_targets,
        predictor_nll=predictor_nll,
        predictor_example=frame_example,
        predictor_predictions=predictor_predictions,
        predictor_targets=predictor_targets,
    )


@torch.no_grad()
def codebook_accuracy(out: LossOutput) -> tuple[Tensor, Tensor]:
    """Top-1 accuracy (G,) of codebook 0 (the talker) and 1..G-1 (the code predictor) over the
    batch's targets, and the targets counted (G,); 0 where none. Device ops only: no value is read
    back to the host."""
    talker_valid = out.talker_targets != IGNORE_INDEX
    predictor_valid = out.predictor_targets != IGNORE_INDEX
    correct = torch.cat(
        [
            ((out.talker_logits.argmax(-1) == out.talker_targets) & talker_valid).sum()[None],
            ((out.predictor_predictions == out.predictor_targets) & predictor_valid).sum(0),
        ]
    )
    counted = torch.cat([talker_valid.sum()[None], predictor_valid.sum(0)])
    return correct / counted.clamp(min=1), counted
