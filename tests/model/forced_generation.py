"""Drive the official qwen_tts generation path with forced target codes and record the raw
log-likelihood it assigns to each target.

Everything runs through `Qwen3TTSForConditionalGeneration.generate`: its own prefill code, the
talker's KV cache, `past_hidden` into the code predictor's own `generate`, and the summed codebook
embeddings plus `tts_pad` as the talker's next input. Only the choice of token is forced (a logits
processor that leaves the target alone); the recorded logits are the raw ones, before any
processor, which is what a cross-entropy over the full vocabulary scores.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList

_SAMPLING_ARGS = ("top_k", "top_p", "temperature")


class _Force(LogitsProcessor):
    def __init__(self, targets: list[int]):
        self.targets = targets
        self.step = 0

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.targets[self.step]] = 0.0
        self.step += 1
        return forced


def official_forced_nll(
    model,
    text_ids: list[int],
    codes: torch.Tensor,
    speaker_embedding: torch.Tensor | None,
    language: str = "Auto",
    *,
    non_streaming_mode: bool = True,
    ref_ids: list[int] | None = None,
    ref_code: torch.Tensor | None = None,
    speaker: str | None = None,
    instruct_ids: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NLL per talker target (T+1: code 0 of each frame, then eos) and per code-predictor target
    (T, G-1), as the official generation path assigns them to ``codes`` (T, G). With ``ref_ids``
    (the tokenised reference template) and ``ref_code`` (R, G): the ICL prompt, as
    ``generate_voice_clone(..., x_vector_only_mode=False)`` passes it.

    A custom_voice model: ``speaker`` (a name of ``spk_id``) instead of ``speaker_embedding``, and
    optionally ``instruct_ids``, as ``generate_custom_voice`` passes them to ``generate``."""
    talker = model.talker
    eos = model.config.talker_config.codec_eos_token_id
    T = codes.shape[0]
    predictor_logits: list[torch.Tensor] = []
    recorded: dict[str, torch.Tensor] = {}
    original_talker_generate = talker.generate
    original_predictor_generate = talker.code_predictor.generate

    def predictor_generate(*args, **kwargs):
        k = len(predictor_logits)
        for a in _SAMPLING_ARGS:
            kwargs.pop(a, None)
        kwargs.update(
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            logits_processor=LogitsProcessorList([_Force(codes[k, 1:].tolist())]),
        )
        out = original_predictor_generate(*args, **kwargs)
        predictor_logits.append(torch.stack(out.logits, dim=1)[0])
        return out

    def talker_generate(*args, **kwargs):
        for a in _SAMPLING_ARGS:
            kwargs.pop(a, None)
        kwargs.update(
            max_new_tokens=T + 1,
            do_sample=False,
            output_logits=True,
            logits_processor=LogitsProcessorList([_Force(codes[:, 0].tolist() + [eos])]),
        )
        out = original_talker_generate(*args, **kwargs)
        recorded["talker"] = torch.stack(out.logits, dim=1)[0]
        return out

    icl = ref_code is not None
    talker.generate = talker_generate
    talker.code_predictor.generate = predictor_generate
    try:
        if speaker is None:
            prompt = {
                "voice_clone_prompt": {
                    "ref_spk_embedding": [speaker_embedding],
                    "x_vector_only_mode": [not icl],
                    "icl_mode": [icl],
                    "ref_code": [ref_code] if icl else None,
                }
            }
        else:
            instruct = None if not instruct_ids else torch.tensor([instruct_ids])
            prompt = {"speakers": [speaker], "instruct_ids": [instruct]}
        model.generate(
            input_ids=[torch.tensor([text_ids])],
            ref_ids=[torch.tensor([ref_ids])] if icl else None,
            languages=[language],
            non_streaming_mode=non_streaming_mode,
            **prompt,
            subtalker_dosample=False,
            do_sample=False,
        )
    finally:
        del talker.generate
        del talker.code_predictor.generate
    talker_targets = torch.tensor(codes[:, 0].tolist() + [eos])
    talker_nll = -torch.log_softmax(recorded["talker"].float(), -1)[torch.arange(T + 1), talker_targets]
    cp = torch.stack(predictor_logits).float()  # (T, G-1, V)
    cp_nll = -torch.log_softmax(cp, -1).gather(-1, codes[:, 1:, None]).squeeze(-1)
    return talker_nll, cp_nll
