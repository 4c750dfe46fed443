"""The dual-channel talker sequence, laid out exactly as non-streaming generation builds it.

Every position carries a text channel (``talker.text_projection(text_embedding(id))``) plus a codec
channel (a sum of codec embeddings), except the speaker slot, whose codec channel is the raw speaker
embedding. For language "auto" and a speaker, one example reads:

    pos  text channel            codec channel
    0-2  <|im_start|> assistant \\n   (none)
    3    tts_pad                 nothink
    4    tts_pad                 think_bos
    5    tts_pad                 think_eos
    6    tts_pad                 speaker embedding
    7    tts_bos                 codec_pad
    ...  text content tokens     codec_pad
         tts_eos                 codec_pad
    L-1  tts_pad                 codec_bos           -> predicts code 0 of frame 0
    L+k  tts_pad                 sum of the 16 codes of frame k -> predicts code 0 of frame k+1 / eos

An explicit language reads ``think, think_bos, <lang>, think_eos`` at 3-6, moving the speaker slot
one place. The data side builds these sequences; the loss reads the same layout. Both live here
because the layout is the model's knowledge: it must equal what generation builds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100
NO_CODEC = -1  # a codebook slot with no embedding at that position


@dataclass(frozen=True)
class SpecialIds:
    tts_pad: int
    tts_bos: int
    tts_eos: int
    codec_pad: int
    codec_bos: int
    codec_eos: int
    codec_think: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    languages: Mapping[str, int]
    num_code_groups: int

    @classmethod
    def from_config(cls, config: Any) -> SpecialIds:
        """From a `Qwen3TTSConfig` or the dict of a ``config.json``."""
        get = (lambda o, k: o[k]) if isinstance(config, Mapping) else getattr
        talker = get(config, "talker_config")
        return cls(
            tts_pad=get(config, "tts_pad_token_id"),
            tts_bos=get(config, "tts_bos_token_id"),
            tts_eos=get(config, "tts_eos_token_id"),
            codec_pad=get(talker, "codec_pad_id"),
            codec_bos=get(talker, "codec_bos_id"),
            codec_eos=get(talker, "codec_eos_token_id"),
            codec_think=get(talker, "codec_think_id"),
            codec_nothink=get(talker, "codec_nothink_id"),
            codec_think_bos=get(talker, "codec_think_bos_id"),
            codec_think_eos=get(talker, "codec_think_eos_id"),
            languages=dict(get(talker, "codec_language_id") or {}),
            num_code_groups=get(talker, "num_code_groups"),
        )

    def language_id(self, language: str | None) -> int | None:
        if language is None or language.lower() == "auto":
            return None
        try:
            return self.languages[language.lower()]
        except KeyError:
            raise ValueError(
                f"language {language!r} is not supported by this model; use 'auto' or one of {sorted(self.languages)}"
            ) from None


def assistant_text(text: str) -> str:
    """The chat template generation tokenises (`Qwen3TTSModel._build_assistant_text`)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def tokenize_text(tokenizer, text: str) -> list[int]:
    return tokenize_texts(tokenizer, [text])[0]


def tokenize_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """`tokenize_text` of every text, in one call: a fast tokenizer encodes a batch ~3x faster than
    the texts one by one (a data set's every transcript, on every rank's ``setup``)."""
    rows = tokenizer([assistant_text(t) for t in texts])["input_ids"] if texts else []
    for text, ids in zip(texts, rows):
        if len(ids) < 9:
            raise ValueError(f"text {text!r} tokenised to {len(ids)} ids; the template alone needs 8")
    return [list(ids) for ids in rows]


@dataclass
class TalkerSequence:
    """One example, unpadded. S positions, T frames."""

    text_ids: Tensor  # (S,) text-channel token at every position
    codec_ids: Tensor  # (S, G) codec ids summed at each position; NO_CODEC where absent
    speaker_position: int  # index of the speaker slot, -1 when there is none
    labels: Tensor  # (S,) code 0 the talker must predict at each position, IGNORE_INDEX elsewhere
    frame_positions: Tensor  # (T,) position whose hidden state predicts code 0 of frame k
    codes: Tensor  # (T, G)

    @property
    def prefill_length(self) -> int:
        return int(self.text_ids.shape[0] - self.codes.shape[0])


def build_sequence(
    ids: SpecialIds,
    text_ids: list[int],
    codes: Tensor | None,
    *,
    language: str | None = "auto",
    with_speaker: bool = True,
) -> TalkerSequence:
    """The talker sequence for one clip: prefill, then one position per frame of ``codes``.

    ``text_ids`` is the tokenised chat template (`tokenize_text`); ``codes`` (T, G), or None for the
    prefill alone (inference).
    """
    G = ids.num_code_groups
    codes = torch.zeros(0, G, dtype=torch.long) if codes is None else torch.as_tensor(codes, dtype=torch.long)
    if codes.dim() != 2 or codes.shape[1] != G:
        raise ValueError(f"codes must be (T, {G}), got {tuple(codes.shape)}")
    role, content = text_ids[:3], text_ids[3:-5]
    lang = ids.language_id(language)
    tags = (
        [ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos]
        if lang is None
        else [ids.codec_think, ids.codec_think_bos, lang, ids.codec_think_eos]
    )
    speaker_slot = [NO_CODEC] if with_speaker else []
    codec0 = [NO_CODEC] * 3 + tags + speaker_slot + [ids.codec_pad] * (1 + len(content) + 1) + [ids.codec_bos]
    n_tag = len(tags) + len(speaker_slot)
    text = list(role) + [ids.tts_pad] * n_tag + [ids.tts_bos] + list(content) + [ids.tts_eos] + [ids.tts_pad]
    # tts_bos sits on codec_pad; content and tts_eos on codec_pad; tts_pad on codec_bos.
    assert len(text) == len(codec0), (len(text), len(codec0))
    L = len(text)
    T = codes.shape[0]

    prefill_codec = torch.full((L, G), NO_CODEC, dtype=torch.long)
    prefill_codec[:, 0] = torch.tensor(codec0)
    codec_ids = torch.cat([prefill_codec, codes], dim=0)
    text_ids_t = torch.tensor(text + [ids.tts_pad] * T, dtype=torch.long)

    labels = torch.full((L + T,), IGNORE_INDEX, dtype=torch.long)
    if T:
        # Position L-1+k predicts code 0 of frame k; the last frame's position predicts eos.
        labels[L - 1 : L - 1 + T] = codes[:, 0]
        labels[L - 1 + T] = ids.codec_eos
    return TalkerSequence(
        text_ids=text_ids_t,
        codec_ids=codec_ids,
        speaker_position=3 + len(tags) if with_speaker else -1,
        labels=labels,
        frame_positions=torch.arange(L - 1, L - 1 + T, dtype=torch.long),
        codes=codes,
    )


@dataclass
class TalkerBatch:
    """A right-padded batch of talker sequences (B examples, S positions, F frames)."""

    text_ids: Tensor  # (B, S)
    codec_ids: Tensor  # (B, S, G)
    attention_mask: Tensor  # (B, S) 1 on real positions
    speaker_mask: Tensor  # (B, S) bool, True at the speaker slot
    speaker_embedding: Tensor  # (B, D) fp32 raw speaker embedding per example
    speaker_index: Tensor  # (B,) index into the run's speaker list
    labels: Tensor  # (B, S)
    frame_positions: Tensor  # (B, F) padded with 0
    frame_mask: Tensor  # (B, F) bool
    codes: Tensor  # (B, F, G) padded with 0
    # The positions the masks select, (N, 2) rows of (example, position / frame) in row-major order,
    # found by the collate on the host: selecting with a mask on a GPU reads its count back (a stall).
    target_index: Tensor  # where labels != IGNORE_INDEX
    frame_index: Tensor  # where frame_mask
    # Whether any example is shorter than the batch (a host bool from the collate): the talker then
    # attends with a mask built without asking the device (tts_lightning/model/loss.py).
    padded: bool

    def _map(self, fn) -> TalkerBatch:
        return TalkerBatch(
            **{f.name: fn(v) if isinstance(v := getattr(self, f.name), Tensor) else v for f in fields(self)}
        )

    def to(self, device) -> TalkerBatch:
        """On ``device``. To a GPU the copies do not block the host (from pinned memory they run
        asynchronously; Lightning moves a batch type of its own with ``to(device)`` alone); back to
        the host they do, so the values are there when read."""
        non_blocking = torch.device(device).type == "cuda"
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> TalkerBatch:
        """Page-locked copies: the DataLoader's ``pin_memory=True`` (set on GPU runs) calls this for
        a batch type of its own; without it the batch stayed pageable. Checked by gpu_check.sh."""
        return self._map(Tensor.pin_memory)

    def __len__(self) -> int:
        return self.text_ids.shape[0]


def collate(
    sequences: list[TalkerSequence],
    speaker_embeddings: Tensor,
    speaker_indices: list[int] | Tensor,
    *,
    pad_text_id: int,
) -> TalkerBatch:
    """Right-pad sequences into a batch. Padding is masked out of attention and loss; each
    sequence keeps its own positions (the talker's rope index counts real positions only)."""
    B = len(sequences)
    S = max(s.text_ids.shape[0] for s in sequences)
    F = max(max(s.codes.shape[0] for s in sequences), 1)
    G = sequences[0].codec_ids.shape[1]
    batch = TalkerBatch(
        text_ids=torch.full((B, S), pad_text_id, dtype=torch.long),
        codec_ids=torch.full((B, S, G), NO_CODEC, dtype=torch.long),
        attention_mask=torch.zeros(B, S, dtype=torch.long),
        speaker_mask=torch.zeros(B, S, dtype=torch.bool),
        speaker_embedding=speaker_embeddings.float(),
        speaker_index=torch.as_tensor(speaker_indices, dtype=torch.long),
        labels=torch.full((B, S), IGNORE_INDEX, dtype=torch.long),
        frame_positions=torch.zeros(B, F, dtype=torch.long),
        frame_mask=torch.zeros(B, F, dtype=torch.bool),
        codes=torch.zeros(B, F, G, dtype=torch.long),
        target_index=torch.zeros(0, 2, dtype=torch.long),  # filled below, from the masks
        frame_index=torch.zeros(0, 2, dtype=torch.long),
        padded=any(s.text_ids.shape[0] < S for s in sequences),
    )
    for b, s in enumerate(sequences):
        n, t = s.text_ids.shape[0], s.codes.shape[0]
        batch.text_ids[b, :n] = s.text_ids
        batch.codec_ids[b, :n] = s.codec_ids
        batch.attention_mask[b, :n] = 1
        if s.speaker_position >= 0:
            batch.speaker_mask[b, s.speaker_position] = True
        batch.labels[b, :n] = s.labels
        batch.frame_positions[b, :t] = s.frame_positions
        batch.frame_mask[b, :t] = True
        batch.codes[b, :t] = s.codes
    batch.target_index = (batch.labels != IGNORE_INDEX).nonzero()
    batch.frame_index = batch.frame_mask.nonzero()
    return batch


def codec_embedding_sum(talker, codec_ids: Tensor) -> Tensor:
    """Sum of the codec embeddings at each position: group 0 through the talker's
    ``codec_embedding``, group g >= 1 through the code predictor's ``codec_embedding[g-1]``,
    as generation feeds each frame back. ``codec_ids`` (..., G) with NO_CODEC where absent.

    Every embedding runs whatever the batch holds: under FSDP each one is a unit whose forward is
    collective, so skipping an absent codebook on one rank would leave the others waiting (and
    asking the host whether it is present costs a device sync per codebook)."""
    present = codec_ids != NO_CODEC
    ids = codec_ids.clamp(min=0)
    out = talker.model.codec_embedding(ids[..., 0]) * present[..., :1]
    predictor_embeddings = talker.code_predictor.model.codec_embedding
    for g in range(1, codec_ids.shape[-1]):
        out = out + predictor_embeddings[g - 1](ids[..., g]) * present[..., g : g + 1]
    return out


def embed_batch(talker, batch: TalkerBatch) -> Tensor:
    """The talker's input embeddings (B, S, D) for a batch: projected text channel + codec channel,
    with the raw speaker embedding in the speaker slot."""
    text = talker.text_projection(talker.model.text_embedding(batch.text_ids))
    codec = codec_embedding_sum(talker, batch.codec_ids)
    speaker = batch.speaker_embedding.to(codec.dtype)[:, None, :] * batch.speaker_mask[..., None]
    return text + codec + speaker


def build_custom_voice_sequence(
    ids: SpecialIds,
    text_ids: list[int],
    codes: Tensor | None,
    *,
    speaker_id: int,
    instruct_ids: Sequence[int] = (),
    language: str | None = "auto",
) -> TalkerSequence:
    """The sequence ``generate_custom_voice`` builds (non-streaming): the speaker slot holds the
    speaker's ``codec_embedding`` row (``speaker_id``, a codec id, so the row trains like any
    codec embedding) and an instruct, when given, comes first as text-only positions
    (``text_projection`` of the tokenised `tts_lightning.model.custom_voice.instruct_text`, no codec
    channel, no target). ``language`` is the tag generation uses (a dialect speaker's dialect:
    `tts_lightning.model.custom_voice.spoken_language`). The streaming one:
    `tts_lightning.model.layouts.build_layout_sequence` with ``speaker_id``."""
    seq = build_sequence(ids, text_ids, codes, language=language, with_speaker=True)
    return as_custom_voice(seq, speaker_id, instruct_ids)


def as_custom_voice(seq: TalkerSequence, speaker_id: int, instruct_ids: Sequence[int] = ()) -> TalkerSequence:
    """An x-vector sequence (any layout with a speaker slot) as ``generate`` builds it with
    ``speakers`` and ``instruct_ids``: the slot's codec channel is the speaker's row, and the instruct
    goes first (text only, no target). Generation builds the rest of the prompt alike either way."""
    seq.codec_ids[seq.speaker_position, 0] = speaker_id
    n = len(instruct_ids)
    if not n:
        return TalkerSequence(seq.text_ids, seq.codec_ids, -1, seq.labels, seq.frame_positions, seq.codes)
    G = seq.codec_ids.shape[1]
    return TalkerSequence(
        text_ids=torch.cat([torch.tensor(list(instruct_ids), dtype=torch.long), seq.text_ids]),
        codec_ids=torch.cat([torch.full((n, G), NO_CODEC, dtype=torch.long), seq.codec_ids]),
        speaker_position=-1,
        labels=torch.cat([torch.full((n,), IGNORE_INDEX, dtype=torch.long), seq.labels]),
        frame_positions=seq.frame_positions + n,
        codes=seq.codes,
    )
