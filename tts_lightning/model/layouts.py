"""The voice-clone sequence layouts other than the default, each as ``Qwen3TTSForConditionalGeneration.generate``
builds it (`generate_voice_clone` of qwen_tts 0.1.1).

Every layout shares the prefix of `tts_lightning.model.sequence` up to and including
``tts_bos + codec_pad`` (role tokens; think / language tags; the raw speaker embedding). What follows:

- ``xvector``, non-streaming (the default, `sequence.build_sequence`): the text content and ``tts_eos``
  on ``codec_pad``, then ``tts_pad + codec_bos``; every frame position carries ``tts_pad``.
- ``xvector``, streaming: only the first content token, on ``codec_bos``; frame k then carries the
  text token k+1 of ``content[1:] + [tts_eos]`` (``trailing_text_hidden``), then ``tts_pad``.
- ``icl`` (reference codes and transcript in the prompt): text ``ref_content + content + [tts_eos]``
  and codec ``[codec_bos] + reference frames`` (all 16 codebooks summed). Non-streaming: the text on
  ``codec_pad``, then the codec rows on ``tts_pad``; frames carry ``tts_pad``. Streaming: the two
  zipped position by position (text padded with ``tts_pad``); text left over goes on the frames.
  The last reference frame predicts code 0 of the first target frame.

From a ``custom_voice`` model (``generate_custom_voice``) the speaker slot holds the speaker's
``codec_embedding`` row and an instruct may come first (`sequence.as_custom_voice`); generate builds
the rest as for an x-vector, streaming (``non_streaming_mode=False``) or not. ICL is not offered
there (`check_custom_voice_layout`).

Only layouts whose loss is proven equal to the official generation's NLL
(tests/model/test_loss_parity.py; from a custom_voice model tests/model/test_custom_voice_parity.py)
are offered: `SequenceLayout` and `check_custom_voice_layout` refuse any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tts_lightning.errors import ConfigError
from tts_lightning.model.sequence import (
    IGNORE_INDEX,
    NO_CODEC,
    SpecialIds,
    TalkerSequence,
    as_custom_voice,
    build_sequence,
)

# (layout, streaming) pairs proven by tests/model/test_loss_parity.py; nothing else is offered.
PROVEN = {("xvector", False), ("xvector", True), ("icl", False), ("icl", True)}
# From a custom_voice model: proven by tests/model/test_custom_voice_parity.py.
PROVEN_CUSTOM_VOICE = {("xvector", False), ("xvector", True)}


@dataclass(frozen=True)
class SequenceLayout:
    """How a run lays its training sequences out (``data.layout`` and ``data.streaming``)."""

    layout: str = "xvector"
    streaming: bool = False

    def __post_init__(self) -> None:
        if (self.layout, bool(self.streaming)) not in PROVEN:
            offered = sorted({name for name, _ in PROVEN})
            raise ConfigError(
                f"data.layout {self.layout!r} (streaming={self.streaming}) is not offered: its loss is not proven "
                f"equal to generation's; use one of {offered}"
            )

    @property
    def is_default(self) -> bool:
        return self.layout == "xvector" and not self.streaming

    @property
    def needs_reference(self) -> bool:
        return self.layout == "icl"


def check_custom_voice_layout(layout: SequenceLayout, model: object) -> None:
    """Refuse a layout not offered from a custom_voice ``model`` (its path, for the message)."""
    if (layout.layout, bool(layout.streaming)) in PROVEN_CUSTOM_VOICE:
        return
    raise ConfigError(
        f"data.layout {layout.layout!r} is not offered from a custom_voice model ({model}): generate_voice_clone "
        "refuses non-base models and a CustomVoice model has no speaker encoder; use data.layout xvector "
        "(data.streaming true or false) or start from a *-Base model"
    )


@dataclass(frozen=True)
class Reference:
    """The reference clip of an ICL example: its transcript's content ids and its codes."""

    text_ids: tuple[int, ...]  # `reference_text_ids`
    codes: Tensor | Path  # (R, G), or the cached .npy file
    frames: int  # R
    key: str = ""  # the reference clip's audio path


def reference_text(text: str) -> str:
    """The reference transcript's template (`Qwen3TTSModel._build_ref_text`)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


@dataclass  # not frozen: Lightning rebuilds a batch's dataclasses when it moves them to a device
class VoiceReference:
    """A speaker's reference for generating in the ICL layout: its transcript and codes (R, G), what
    ``create_voice_clone_prompt(..., x_vector_only_mode=False)`` makes of a clip."""

    text: str
    codes: Tensor


def reference_prompt_ids(tokenizer, text: str) -> list[int]:
    """The reference transcript's full template ids, as ``generate_voice_clone`` passes ``ref_ids``
    (generate slices ``[3:-2]`` of them, the content `reference_text_ids` trains with)."""
    return list(tokenizer([reference_text(text)])["input_ids"][0])


def reference_text_ids(tokenizer, texts: list[str]) -> list[tuple[int, ...]]:
    """The content ids of each reference transcript: its template's ids ``[3:-2]``, as generate slices them."""
    rows = tokenizer([reference_text(t) for t in texts])["input_ids"] if texts else []
    return [tuple(ids[3:-2]) for ids in rows]


def _prefix(ids: SpecialIds, text_ids: list[int], language: str | None) -> tuple[list[int], list[int], int]:
    """Text ids, code-0 ids and the speaker slot of the shared prefix, up to ``tts_bos + codec_pad``."""
    lang = ids.language_id(language)
    tags = (
        [ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos]
        if lang is None
        else [ids.codec_think, ids.codec_think_bos, lang, ids.codec_think_eos]
    )
    text = list(text_ids[:3]) + [ids.tts_pad] * (len(tags) + 1) + [ids.tts_bos]
    codec0 = [NO_CODEC] * 3 + tags + [NO_CODEC] + [ids.codec_pad]
    return text, codec0, 3 + len(tags)


def _code0_rows(ids: SpecialIds, code0: list[int]) -> Tensor:
    rows = torch.full((len(code0), ids.num_code_groups), NO_CODEC, dtype=torch.long)
    rows[:, 0] = torch.tensor(code0, dtype=torch.long)
    return rows


def _assemble(
    ids: SpecialIds,
    text: list[int],
    codec: Tensor,
    codes: Tensor,
    trailing: list[int],
    speaker_position: int,
) -> TalkerSequence:
    """Prefill (``text``, ``codec`` rows), then one position per frame of ``codes``: frame k's codes
    plus text ``trailing[k]`` (``tts_pad`` past its end). The last prefill position predicts frame 0."""
    L, T = len(text), codes.shape[0]
    frame_text = [trailing[k] if k < len(trailing) else ids.tts_pad for k in range(T)]
    labels = torch.full((L + T,), IGNORE_INDEX, dtype=torch.long)
    if T:
        labels[L - 1 : L - 1 + T] = codes[:, 0]
        labels[L - 1 + T] = ids.codec_eos
    return TalkerSequence(
        text_ids=torch.tensor(text + frame_text, dtype=torch.long),
        codec_ids=torch.cat([codec, codes], dim=0),
        speaker_position=speaker_position,
        labels=labels,
        frame_positions=torch.arange(L - 1, L - 1 + T, dtype=torch.long),
        codes=codes,
    )


def _xvector_streaming(ids: SpecialIds, text_ids: list[int], codes: Tensor, language: str | None) -> TalkerSequence:
    text, code0, speaker = _prefix(ids, text_ids, language)
    content = list(text_ids[3:-5])
    # The first content token rides on codec_bos; the rest, then tts_eos, on the frames.
    return _assemble(
        ids, text + content[:1], _code0_rows(ids, code0 + [ids.codec_bos]), codes, content[1:] + [ids.tts_eos], speaker
    )


def _icl(
    ids: SpecialIds,
    text_ids: list[int],
    codes: Tensor,
    language: str | None,
    reference: tuple[list[int], Tensor],
    streaming: bool,
) -> TalkerSequence:
    text, code0, speaker = _prefix(ids, text_ids, language)
    ref_text, ref_codes = reference
    words = list(ref_text) + list(text_ids[3:-5]) + [ids.tts_eos]
    frames = torch.cat([_code0_rows(ids, [ids.codec_bos]), ref_codes], dim=0)  # (R + 1, G)
    n = frames.shape[0]
    if not streaming:
        block_text = words + [ids.tts_pad] * n
        block = torch.cat([_code0_rows(ids, [ids.codec_pad] * len(words)), frames], dim=0)
        trailing: list[int] = []
    else:
        block_text = (words + [ids.tts_pad] * n)[:n]
        block = frames
        trailing = words[n:]
    prefill = torch.cat([_code0_rows(ids, code0), block], dim=0)
    return _assemble(ids, text + block_text, prefill, codes, trailing, speaker)


def build_layout_sequence(
    ids: SpecialIds,
    text_ids: list[int],
    codes: Tensor | None,
    *,
    layout: SequenceLayout,
    language: str | None = "auto",
    reference: tuple[list[int], Tensor] | None = None,
    speaker_id: int | None = None,
    instruct_ids: Sequence[int] = (),
) -> TalkerSequence:
    """The talker sequence of one clip in ``layout`` (the default one is `sequence.build_sequence`'s,
    unchanged). ``reference``: (content ids of the reference transcript, reference codes (R, G)),
    needed by ``icl``. ``codes`` None gives the prefill alone. ``speaker_id`` (a codec id): the
    custom_voice layout of the same (`sequence.as_custom_voice`), with ``instruct_ids`` first."""
    if speaker_id is not None:
        check_custom_voice_layout(layout, "the custom_voice layout")
        seq = build_layout_sequence(ids, text_ids, codes, layout=layout, language=language)
        return as_custom_voice(seq, speaker_id, instruct_ids)
    if layout.is_default:
        return build_sequence(ids, text_ids, codes, language=language)
    G = ids.num_code_groups
    codes = torch.zeros(0, G, dtype=torch.long) if codes is None else torch.as_tensor(codes, dtype=torch.long)
    if codes.dim() != 2 or codes.shape[1] != G:
        raise ValueError(f"codes must be (T, {G}), got {tuple(codes.shape)}")
    if layout.layout == "xvector":
        return _xvector_streaming(ids, text_ids, codes, language)
    if reference is None:
        raise ValueError("the icl layout needs a reference (transcript ids, codes)")
    ref_text, ref_codes = reference
    ref_codes = torch.as_tensor(ref_codes, dtype=torch.long)
    if ref_codes.dim() != 2 or ref_codes.shape[1] != G:
        raise ValueError(f"reference codes must be (R, {G}), got {tuple(ref_codes.shape)}")
    return _icl(ids, text_ids, codes, language, (list(ref_text), ref_codes), layout.streaming)
