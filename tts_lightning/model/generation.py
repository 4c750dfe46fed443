"""Speak with the model being trained, through the official `Qwen3TTSForConditionalGeneration.generate`.

The speaker goes in as a voice-clone prompt (the raw speaker embedding in the speaker slot) in the
layout the run trained (`tts_lightning.model.layouts.SequenceLayout`, default x-vector non-streaming):
`voice_clone_inputs` maps it to ``generate``'s arguments as ``generate_voice_clone`` builds them
(``icl``: the reference codes and transcript, ``x_vector_only_mode=False``; streaming:
``non_streaming_mode=False``). A run from a custom_voice model passes its speakers' codec rows and
their `custom_voice.spoken_languages`: ``generate`` then builds what ``generate_custom_voice`` builds
for the same speaker (the same row in the slot; ``non_streaming_mode`` from the layout alike).

Two traps are handled here rather than at every call site:

- ``module.dtype`` lies under FSDP mixed precision (it reports the fp32 flat parameter while the
  forward computes in bf16), and the official code casts the speaker embedding to it. The embedding
  is cast to the compute dtype of the weights, and generation runs under autocast when the two differ.
- Sampling draws from the global RNG: with ``seed`` the draw is reproducible and the caller's RNG
  state (training's) is left exactly as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from tts_lightning.model.layouts import SequenceLayout, VoiceReference

DEFAULT_LAYOUT = SequenceLayout()

SAMPLE_RATE = 24_000


@dataclass
class PredictBatch:
    """What `Qwen3TTSModule.predict_step` speaks: row ``i`` is ``texts[i]`` said by ``speakers[i]``
    (a name of the run's speakers) in ``languages[i]``. ``ids`` name the rows' files; ``padding``
    marks rows added only to give every rank the same number of steps (generated, never written).

    Made by `tts_lightning.data.predict.collate_texts`; `from_mapping` reads a dict of lists
    (``text``, ``speaker`` and optionally ``language``, ``id``, ``padding``)."""

    texts: list[str]
    speakers: list[str]
    languages: list[str]
    ids: list[str]
    padding: list[bool]
    layout: str = "xvector"  # the run's `SequenceLayout`, as plain fields (Lightning rebuilds batches)
    streaming: bool = False
    references: list[VoiceReference] | None = None  # per row, for ``icl``

    @property
    def sequence_layout(self) -> SequenceLayout:
        return SequenceLayout(self.layout, self.streaming)

    def __post_init__(self) -> None:
        n = len(self.texts)
        for name in ("speakers", "languages", "ids", "padding"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"predict batch has {n} texts but {len(getattr(self, name))} {name}")

    def __len__(self) -> int:
        return len(self.texts)

    @classmethod
    def build(
        cls,
        texts: Sequence[str],
        speakers: Sequence[str],
        languages: Sequence[str] | None = None,
        ids: Sequence[str] | None = None,
        padding: Sequence[bool] | None = None,
        batch_idx: int = 0,
    ) -> PredictBatch:
        """A batch with defaults: languages "auto", ids ``<batch_idx>_<row>``, no padding."""
        n = len(texts)
        return cls(
            texts=list(texts),
            speakers=list(speakers),
            languages=[lang or "auto" for lang in languages] if languages is not None else ["auto"] * n,
            ids=[str(i) for i in ids] if ids is not None else [f"{batch_idx:04d}_{i}" for i in range(n)],
            padding=[bool(p) for p in padding] if padding is not None else [False] * n,
        )

    @classmethod
    def from_mapping(cls, batch: Mapping[str, Sequence[Any]], batch_idx: int = 0) -> PredictBatch:
        """A dict of lists: ``text`` and ``speaker``, optionally ``language``, ``id``, ``padding``."""
        return cls.build(
            batch["text"],
            batch["speaker"],
            batch.get("language"),
            batch.get("id"),
            batch.get("padding"),
            batch_idx=batch_idx,
        )


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the talker's weights compute in: FSDP's ``param_dtype`` when a mixed-precision FSDP
    unit manages the model, else the dtype of the codec-embedding weights (never ``module.dtype``)."""
    fsdp: tuple[type, ...] = ()
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        fsdp = (FullyShardedDataParallel,)
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    for module in model.modules():
        if isinstance(module, fsdp):
            param_dtype = getattr(getattr(module, "mixed_precision", None), "param_dtype", None)
            if param_dtype is not None:
                return param_dtype
    return _input_embeddings(model).weight.dtype


def _input_embeddings(model: nn.Module) -> nn.Embedding:
    """The talker's codec embedding (typed: `nn.Module` attribute access is untyped)."""
    talker: Any = model.talker
    return talker.get_input_embeddings()


def rng_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose RNG `torch.random.fork_rng` saves for work on ``device`` (none on the CPU)."""
    if device.type == "cuda":
        return [device.index if device.index is not None else torch.cuda.current_device()]
    return []


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device):
    """Seed the global RNG for the block and restore the caller's RNG state afterwards."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=rng_devices(device)):
        torch.manual_seed(int(seed))
        yield


def voice_clone_inputs(
    layout: SequenceLayout,
    embeddings: list[Tensor],
    references: Sequence[tuple[Sequence[int], Tensor]] | None,
    device: torch.device,
) -> dict[str, Any]:
    """``generate``'s ``voice_clone_prompt``, ``ref_ids`` and ``non_streaming_mode`` for ``layout``, as
    ``generate_voice_clone`` builds them. ``references``: per row (the reference transcript's full
    template ids, `layouts.reference_prompt_ids`; its codes (R, G)), needed by ``icl`` only."""
    B, icl = len(embeddings), layout.needs_reference
    if icl and (references is None or len(references) != B):
        raise ValueError(f"the icl layout needs one reference per row ({B} rows)")
    refs = list(references or []) if icl else []
    prompt = {
        "ref_spk_embedding": embeddings,
        "x_vector_only_mode": [not icl] * B,
        "icl_mode": [icl] * B,
        "ref_code": [torch.as_tensor(c, dtype=torch.long).to(device) for _, c in refs] if icl else None,
    }
    ref_ids = [torch.tensor([list(ids)], dtype=torch.long, device=device) for ids, _ in refs] if icl else None
    return {"voice_clone_prompt": prompt, "ref_ids": ref_ids, "non_streaming_mode": not layout.streaming}


GENERATION_ROWS = 16  # rows per generate call: bounds the KV cache (the planner counts this many)


def generate_codes(
    model: nn.Module,
    text_ids: Sequence[Sequence[int]],
    speaker_embeddings: Tensor,
    languages: Sequence[str] | None = None,
    *,
    max_new_tokens: int = 2048,
    do_sample: bool = True,
    seed: int | None = None,
    dtype: torch.dtype | None = None,
    layout: SequenceLayout = DEFAULT_LAYOUT,
    references: Sequence[tuple[Sequence[int], Tensor]] | None = None,
    **generate_kwargs: Any,
) -> list[Tensor]:
    """One LongTensor (T, G) of codec frames per row, stopped at ``codec_eos``.

    Args:
        model: a `Qwen3TTSForConditionalGeneration` (plain, or with FSDP-managed submodules whose
            parameters are usable in this context).
        text_ids: per row, the tokenised chat template (`tts_lightning.model.sequence.tokenize_text`).
        speaker_embeddings: (B, D) fp32 raw speaker embeddings, one per row.
        languages: per row, "auto" or a language the model knows; default "auto" for all.
        max_new_tokens: cap on generated frames (12.5 frames per second).
        do_sample: sample (the official default) or greedy decoding of code 0.
        seed: seeds sampling for this call only; the caller's RNG state is restored afterwards.
        dtype: the dtype the weights compute in; default `compute_dtype(model)`. Pass the weights'
            own dtype when FSDP's forward is bypassed (full-precision ``summon_full_params``).
        layout: the run's sequence layout; ``references`` per row for ``icl`` (`voice_clone_inputs`).
        generate_kwargs: passed to ``model.generate`` (top_k, temperature, subtalker_*,
            repetition_penalty, ...).

    At most `GENERATION_ROWS` rows go to one ``generate`` call (the KV cache grows with the rows:
    a sampling round of every speaker of a large dataset would not fit); the calls after the
    first are seeded ``seed + first row``.
    """
    B = len(text_ids)
    if speaker_embeddings.dim() != 2 or speaker_embeddings.shape[0] != B:
        raise ValueError(f"speaker_embeddings must be ({B}, D) for {B} texts, got {tuple(speaker_embeddings.shape)}")
    if B > GENERATION_ROWS:
        return [
            codes
            for start in range(0, B, GENERATION_ROWS)
            for codes in generate_codes(
                model,
                text_ids[start : start + GENERATION_ROWS],
                speaker_embeddings[start : start + GENERATION_ROWS],
                None if languages is None else languages[start : start + GENERATION_ROWS],
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                seed=None if seed is None else seed + start,
                dtype=dtype,
                layout=layout,
                references=None if references is None else references[start : start + GENERATION_ROWS],
                **generate_kwargs,
            )
        ]
    languages = ["auto"] * B if languages is None else [lang or "auto" for lang in languages]
    if len(languages) != B:
        raise ValueError(f"{len(languages)} languages for {B} texts")
    if B == 0:
        return []
    talker: Any = model.talker
    weight = _input_embeddings(model).weight
    device = weight.device
    dtype = compute_dtype(model) if dtype is None else dtype
    input_ids = [torch.tensor([list(ids)], dtype=torch.long, device=device) for ids in text_ids]
    embeddings = [e.detach().to(device=device, dtype=dtype) for e in speaker_embeddings]
    inputs = voice_clone_inputs(layout, embeddings, references, device)
    # The official code casts the embedding to `talker.dtype`; where that is not the dtype the
    # weights compute in, autocast brings every input back to the weights' dtype.
    mixed = dtype != talker.dtype and dtype in (torch.bfloat16, torch.float16)
    autocast = torch.autocast(device.type, dtype=dtype) if mixed else contextlib.nullcontext()
    with torch.no_grad(), seeded(seed, device), autocast:
        generate: Any = model.generate
        codes, _ = generate(
            input_ids=input_ids,
            languages=list(languages),
            **inputs,
            max_new_tokens=int(max_new_tokens),
            do_sample=do_sample,
            **generate_kwargs,
        )
    return [c.detach().to("cpu", torch.long) for c in codes]


def decode_codes(
    speech_tokenizer, codes_list: Sequence[Tensor], prefixes: Sequence[Tensor] | None = None
) -> list[np.ndarray]:
    """Waveforms (float32, 24 kHz) for codes (T, G) with the 12 Hz speech tokenizer; an empty
    code sequence gives an empty waveform. ``prefixes`` (the ICL reference codes, per row) are decoded
    in front and cut off again, as ``generate_voice_clone`` does.

    One row at a time: the tokenizer pads a batch to its longest row and splits only along time,
    so decoding every row at once (speakers x texts of a sampling round) holds activations growing
    with the rows; one row's stay bounded whatever their number."""
    wavs: list[np.ndarray] = [np.zeros(0, dtype=np.float32) for _ in codes_list]
    for i, codes in enumerate(codes_list):
        if codes.shape[0] == 0:
            continue
        full = codes if prefixes is None else torch.cat([prefixes[i].to(codes), codes])
        (wav,), sr = speech_tokenizer.decode([{"audio_codes": full}])
        if int(sr) != SAMPLE_RATE:
            raise ValueError(f"speech tokenizer decodes at {sr} Hz, expected {SAMPLE_RATE}")
        wav = np.asarray(wav, dtype=np.float32).reshape(-1)
        cut = 0 if prefixes is None else int(prefixes[i].shape[0] / max(full.shape[0], 1) * wav.shape[0])
        wavs[i] = wav[cut:]
    return wavs


GENERATE_OPTIONS = (
    "max_new_tokens",
    "do_sample",
    "top_k",
    "top_p",
    "temperature",
    "subtalker_dosample",
    "subtalker_top_k",
    "subtalker_top_p",
    "subtalker_temperature",
    "repetition_penalty",
)


def generation_defaults(pretrained_dir) -> dict[str, Any]:
    """The sampling settings of a pretrained directory's ``generation_config.json``, as the official
    `Qwen3TTSModel` applies them (only the options ``generate`` takes)."""
    import json
    from pathlib import Path

    path = Path(pretrained_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return {k: config[k] for k in GENERATE_OPTIONS if k in config}
