"""The tiny directory's text tokenizer: a byte-level BPE trained offline on a small corpus, written
as the Qwen2 tokenizer files (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``) that load as
``Qwen2TokenizerFast``, with the chat and TTS specials at fixed ids after the learned vocabulary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Generation slices the chat template by position ([:3], [3:-5]), so "assistant" and
# "\n" must each be one token; the specials are pinned at fixed ids after the learned vocabulary.
TEXT_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
]
TEXT_BPE_VOCAB = 400  # learned byte-level BPE entries, ids 0..399; specials follow
TEXT_VOCAB_SIZE = 512

_CORPUS = (
    "<|im_start|>assistant\nThe quick brown fox jumps over the lazy dog.<|im_end|>\n"
    "<|im_start|>user\nPlease read this sentence aloud, clearly and slowly.<|im_end|>\n"
    "Hello world, this is a small voice. It speaks in short sentences and numbers 0 1 2 3 4 5 6 7 8 9. "
    "Speech synthesis turns written text into sound; a speaker's voice has pitch, timbre and rhythm. "
    "Training a model on a few minutes of clips can clone a voice, if the data are clean and varied. "
)


def special_id(token: str) -> int:
    """The fixed id of one of `TEXT_SPECIAL_TOKENS`."""
    return TEXT_BPE_VOCAB + TEXT_SPECIAL_TOKENS.index(token)


def _train_bpe(out: Path) -> tuple[dict[str, int], str]:
    """The learned vocabulary and merges (trained in a scratch folder under ``out``, removed after)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    # Qwen2's own pre-tokenisation, so the files load as Qwen2TokenizerFast with the same splits.
    split = pre_tokenizers.Split(
        Regex(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+"
        ),
        behavior="isolated",
    )
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TEXT_BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        min_frequency=1,
    )
    corpus = [_CORPUS] * 50 + ["assistant\n", "user\n"] * 200
    tok.train_from_iterator(corpus, trainer=trainer)
    model_dir = out / "_bpe"
    model_dir.mkdir()
    tok.model.save(str(model_dir))
    vocab = json.loads((model_dir / "vocab.json").read_text())
    merges = (model_dir / "merges.txt").read_text()
    shutil.rmtree(model_dir)
    if len(vocab) > TEXT_BPE_VOCAB:
        raise RuntimeError(f"BPE vocabulary grew to {len(vocab)} > {TEXT_BPE_VOCAB}")
    return vocab, merges


def _added_tokens(learned: int) -> dict[str, dict]:
    """``added_tokens_decoder``: the specials at their fixed ids, and reserved tokens on the unused
    ids between the ``learned`` vocabulary and them, so that the added-token ids are honoured exactly."""
    added = {
        str(special_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in TEXT_SPECIAL_TOKENS
    }
    for i in range(learned, TEXT_BPE_VOCAB):
        added[str(i)] = {
            "content": f"<|reserved_{i}|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    return dict(sorted(added.items(), key=lambda kv: int(kv[0])))


def build_text_tokenizer(out: Path) -> None:
    """Write the text tokenizer's files and ``preprocessor_config.json`` into ``out``."""
    vocab, merges = _train_bpe(out)
    # Pad the learned vocabulary so that the specials sit at fixed ids.
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, sort_keys=True))
    (out / "merges.txt").write_text(merges)
    tokenizer_config = {
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens(len(vocab)),
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({"processor_class": "Qwen3TTSProcessor"}, indent=2))
