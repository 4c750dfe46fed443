"""Fine-tuning that starts from a ``custom_voice`` model and keeps its voices.

In a released CustomVoice model a speaker is a learned row of the talker's ``codec_embedding``,
selected by ``talker_config.spk_id[name]`` and placed in the speaker slot as it is (no x-vector,
no speaker encoder). A run from such a model therefore trains speakers as rows:

- a speaker of the run named like a built-in one (case-insensitive, as generation looks names up)
  is that speaker: its row trains, starting from the built-in row;
- every other speaker gets a free codec id (`new_speaker_ids`: never a special token's, a
  language's or a built-in speaker's) whose row starts as the mean of the built-in rows;
- built-in speakers the run does not name keep their rows bit-equal (their gradient is zero, and
  the module takes the codec embedding out of weight decay).

``export`` then lists the built-in and the new speakers at these ids. An ``instruct`` text is
tokenised as ``generate_custom_voice(instruct=...)`` tokenises it (`instruct_text`) and goes before
the prompt (`tts_lightning.model.sequence.build_custom_voice_sequence`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

CODEC_EMBEDDING_KEY = "talker.model.codec_embedding.weight"
TRAINABLE_TYPES = ("base", "custom_voice")  # the tts_model_type a run may start from


def is_custom_voice(config: Mapping[str, Any]) -> bool:
    return config.get("tts_model_type") == "custom_voice"


def built_in_speakers(talker_config: Mapping[str, Any]) -> dict[str, int]:
    """The model's speakers, lower-cased name -> codec id."""
    return {str(k).lower(): int(v) for k, v in (talker_config.get("spk_id") or {}).items()}


def new_speaker_ids(talker_config: Mapping[str, Any], count: int) -> list[int]:
    """Unused codec ids for new speakers: 3000, 3001, ... on the released models (vocab 3072), the
    same place (vocab - 72) on smaller vocabularies, where the official recipe and the CustomVoice
    models put speakers; past the 72nd, the other ids generation never emits ([vocab - 1024,
    vocab): input-only rows: special tokens, languages and speakers, about a thousand). Never an id
    a special token, language or speaker uses."""
    from tts_lightning.errors import UserError

    vocab = int(talker_config["vocab_size"])
    used = {v for k, v in talker_config.items() if k.startswith("codec_") and isinstance(v, int)}
    used |= set((talker_config.get("codec_language_id") or {}).values())
    used |= set((talker_config.get("spk_id") or {}).values())
    codes = int((talker_config.get("code_predictor_config") or {}).get("vocab_size", 0))
    low = max(vocab - 1024, codes, 0)  # ids generation emits (the codes) are never speakers
    free = [i for i in (*range(max(vocab - 72, low), vocab), *range(low, vocab - 72)) if i not in used]
    if count > len(free):
        raise UserError(
            f"{count} new speakers, but the model has {len(free)} free speaker ids (codec vocabulary {vocab}): "
            "train fewer speakers per run (data.speakers)"
        )
    return free[:count]


def speaker_codec_ids(talker_config: Mapping[str, Any], speakers: Sequence[str]) -> list[int]:
    """The codec id of each of the run's speakers: a built-in speaker's own id, else a new one,
    given in the sorted order of the new names, so that any order of the same speakers (the data
    module's, the model's, the checkpoint's) maps each name to the same row."""
    built_in = built_in_speakers(talker_config)
    new = sorted((s for s in speakers if s.lower() not in built_in), key=lambda s: (s.lower(), s))
    fresh = dict(zip(new, new_speaker_ids(talker_config, len(new))))
    return [built_in[s.lower()] if s.lower() in built_in else fresh[s] for s in speakers]


def spoken_language(talker_config: Mapping[str, Any], speaker: str, language: str) -> str:
    """The language tag generation uses for ``speaker``: a dialect speaker's dialect replaces
    "auto" and "chinese" (as `Qwen3TTSForConditionalGeneration.generate` does)."""
    dialect = (talker_config.get("spk_is_dialect") or {}).get(speaker.lower(), False)
    if dialect and language.lower() in ("chinese", "auto"):
        return str(dialect)
    return language


def spoken_languages(talker_config: Any, speakers: Sequence[str], languages: Sequence[str]) -> list[str]:
    """`spoken_language` per row, from a ``talker_config`` dict or the model's config object: what
    generation with the speaker's row in the slot (samples, ``predict``) must pass as the language
    to say what ``generate_custom_voice`` says for that speaker."""
    dialects = talker_config.get("spk_is_dialect") if isinstance(talker_config, Mapping) else None
    if dialects is None and not isinstance(talker_config, Mapping):
        dialects = getattr(talker_config, "spk_is_dialect", None)
    table = {"spk_is_dialect": dialects or {}}
    return [spoken_language(table, s, lang or "auto") for s, lang in zip(speakers, languages)]


def check_instructs(info, clips) -> None:
    """Refuse ``instruct`` records where generation would not read them: a base model (voice clone
    has no instruct) or a 0.6B CustomVoice (``generate_custom_voice`` drops it for "0b6")."""
    from tts_lightning.errors import ConfigError

    first = next((c.record for c in clips if c.record.instruct), None)
    if first is None:
        return
    config = info.config
    if not is_custom_voice(config):
        raise ConfigError(
            f"{first.source}: 'instruct' needs a custom_voice model as data.pretrained ({info.path} is "
            f"{config.get('tts_model_type')!r}); remove the instructs or start from a *-CustomVoice model"
        )
    if str(config.get("tts_model_size")) in "0b6":  # the official test, a substring one
        raise ConfigError(
            f"{first.source}: 'instruct' is ignored by {info.path} (tts_model_size "
            f"{config.get('tts_model_size')!r}: generate_custom_voice drops instructs); remove them"
        )


def instruct_text(instruct: str) -> str:
    """The template `Qwen3TTSModel._build_instruct_text` tokenises."""
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def tokenize_instructs(tokenizer, instructs: Sequence[str]) -> list[tuple[int, ...]]:
    """The instruct ids of each text; an empty instruct is none (generation skips it)."""
    wanted = [i for i, text in enumerate(instructs) if text]
    rows = tokenizer([instruct_text(instructs[i]) for i in wanted])["input_ids"] if wanted else []
    out: list[tuple[int, ...]] = [() for _ in instructs]
    for i, ids in zip(wanted, rows):
        out[i] = tuple(ids)
    return out


def initial_rows(weight: torch.Tensor, talker_config: Mapping[str, Any], speakers: Sequence[str]) -> dict[int, Any]:
    """The starting rows of the run's new speakers (the mean of the built-in rows, in fp32), by
    codec id; built-in speakers start from their own rows, so they are not listed."""
    built_in = built_in_speakers(talker_config)
    ids = speaker_codec_ids(talker_config, speakers)
    new = [i for s, i in zip(speakers, ids) if s.lower() not in built_in]
    if not new or not built_in:  # no built-in row to start from: the directory's own rows
        return {}
    mean = weight[sorted(built_in.values())].float().mean(0)
    return {i: mean for i in new}


def custom_voice_speakers(info, speakers: Sequence[str], adapter: Any = None) -> list[int] | None:
    """The codec ids of a run's speakers when it starts from a custom_voice model, else None.
    Raises `ConfigError` for what the layout does not offer."""
    from tts_lightning.errors import ConfigError

    if not is_custom_voice(info.config):
        return None
    lowered = [s.lower() for s in speakers]
    if len(set(lowered)) != len(lowered):
        raise ConfigError(
            f"speaker names {list(speakers)} clash after lower-casing (generation looks speakers up in "
            "lower case); rename them in the manifest"
        )
    if adapter is not None:
        raise ConfigError(
            f"model.adapter: LoRA is not offered from a custom_voice model ({info.path}): its speakers are "
            "codec-embedding rows that train in full; train without model.adapter"
        )
    return speaker_codec_ids(info.config["talker_config"], speakers)


def without_decay_of_codec_embedding(named_parameters) -> list[dict[str, Any]]:
    """AdamW parameter groups: the talker's codec embedding without weight decay, the rest as set.
    Names may carry FSDP1's ``_fsdp_wrapped_module.`` (``use_orig_params``)."""
    rows: list[torch.nn.Parameter] = []
    rest: list[torch.nn.Parameter] = []
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        plain = name.replace("_fsdp_wrapped_module.", "")
        (rows if plain.endswith(CODEC_EMBEDDING_KEY) else rest).append(param)
    if not rows and rest:  # a flat parameter (FSDP1 use_orig_params: false) hides it: decay would move every row
        from tts_lightning.errors import ConfigError

        raise ConfigError(
            f"the codec embedding ({CODEC_EMBEDDING_KEY}) is not among the trainable parameters by name, so "
            "the built-in speakers' rows cannot be kept out of weight decay: set "
            "trainer.strategy.init_args.use_orig_params: true (or freeze talker.model.codec_embedding)"
        )
    return [{"params": rest}, {"params": rows, "weight_decay": 0.0}]
