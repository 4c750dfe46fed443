"""The built-in speakers heard before and after: what `forgetting` measures, as audio.

For each replay record (a built-in speaker saying a replay text, `tts_lightning.data.replay`):
"before" is the record's codes (what the loss was measured on) decoded by the starting model's
speech tokenizer; "after" is the fine-tuned model saying the same text with the same speaker
through the official ``generate_custom_voice``, seeded as the record was (the same seed, language
"Auto", the record's ``max_new_tokens``; the model's own sampling settings), so with unchanged
weights it says exactly the record. Both go to ``<audio>/<speaker>/replay_before|replay_after/``,
with the similarity of after to before (resemblyzer). Added to ``forgetting["speakers"][name]["samples"]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tts_lightning.evaluation.inputs import SAMPLE_RATE

DEFAULT_MAX_NEW_TOKENS = 256  # records.json written before it held max_new_tokens: the setting's default


def _similarity(after: np.ndarray, before: np.ndarray) -> float | None:
    from tts_lightning.metrics.speaker_similarity import embed_utterances, similarity_unavailable

    audible = [w.size > 0 and float(np.abs(w).max()) > 0 for w in (after, before)]
    if similarity_unavailable() is not None or not all(audible):
        return None
    a, b = embed_utterances([after, before], SAMPLE_RATE)
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def speak_built_in(tts, forgetting: dict[str, Any], audio_dir: Path, *, device: str) -> None:
    """Write the before / after wavs of every replay record of the speakers in ``forgetting`` with
    ``tts`` (the fine-tuned `Qwen3TTSModel`, loaded) and record them in ``forgetting`` in place."""
    from tts_lightning.data.codec_cache import load_codes
    from tts_lightning.data.replay import read_records, record_seed
    from tts_lightning.files import atomic_write_wav
    from tts_lightning.model.custom_voice import built_in_speakers
    from tts_lightning.model.generation import decode_codes, seeded
    from tts_lightning.model.pretrained import check_pretrained, load_speech_tokenizer

    folder = Path(forgetting["records"])
    cache_dir = folder.parent.parent  # records live in <cache_dir>/replay/<key>/
    header, records = read_records(folder)
    start = check_pretrained(header["pretrained"])
    numbers = {name: s for s, name in enumerate(sorted(built_in_speakers(start.config["talker_config"])))}
    max_new_tokens = int(header.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    speech_tokenizer = load_speech_tokenizer(start, device=device)
    for name, entry in forgetting["speakers"].items():
        samples = []
        for record in (r for r in records if r.speaker == name):
            t = header["texts"].index(record.text)
            seed = record_seed(int(header["seed"]), numbers[name], t)
            (before,) = decode_codes(speech_tokenizer, [load_codes(cache_dir / record.codes)])
            with torch.no_grad(), seeded(seed, torch.device(device)):
                wavs, _ = tts.generate_custom_voice(
                    text=record.text, speaker=name, language="Auto", max_new_tokens=max_new_tokens
                )
            after = np.asarray(wavs[0], dtype=np.float32).reshape(-1)
            paths = {}
            for when, wav in (("before", before), ("after", after)):
                paths[when] = audio_dir / name / f"replay_{when}" / f"text{t:02d}.wav"
                atomic_write_wav(paths[when], np.clip(wav, -1.0, 1.0), SAMPLE_RATE)
            samples.append(
                {
                    "text": record.text,
                    "text_index": t,
                    "seed": seed,
                    "before_audio": str(paths["before"]),
                    "after_audio": str(paths["after"]),
                    "before_seconds": before.size / SAMPLE_RATE,
                    "after_seconds": after.size / SAMPLE_RATE,
                    "similarity": _similarity(after, before),
                }
            )
        entry["samples"] = samples
    del speech_tokenizer
