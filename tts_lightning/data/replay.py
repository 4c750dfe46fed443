"""Replay against forgetting: the starting CustomVoice model's own speech, mixed into training.

Before training (in prepare, once, on the rank that writes the index), the *starting* ``custom_voice``
model speaks each replay text with each of its built-in speakers through the official
``Qwen3TTSForConditionalGeneration.generate`` (the call ``generate_custom_voice`` makes: the
speaker's row, non-streaming, language "auto", which a dialect speaker turns into its dialect), with
the directory's sampling settings, seeded per record, so the codes are reproducible. Only codec
codes are kept (no audio is decoded). They go to ``<cache_dir>/replay/<key>/`` with ``records.json``
written last; ``key`` fingerprints what they depend on (the model's files, the texts, the settings),
so a rerun with the same settings reuses them and other settings get a folder of their own.
``<cache_dir>/replay.json`` names the folder last prepared (what ``evaluate`` reads).

The data module then adds these records to the training clips as records of the built-in speaker
(`mixed_records`): ``fraction`` of the training records, cycling through them in order, so the
epoch's batches stay a function of the seed (exact resume holds). Validation scores them all once
more as ``val/replay_loss``. They keep the layout they were spoken in (non-streaming custom_voice)
in a run of ``data.streaming: true`` too: see docs/replay.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

from tts_lightning.errors import ConfigError
from tts_lightning.files import atomic_write, atomic_write_json
from tts_lightning.model.custom_voice import built_in_speakers, is_custom_voice, spoken_language
from tts_lightning.model.pretrained import PretrainedInfo, weight_files
from tts_lightning.model.synthesis import read_text_file

DEFAULT_TEXTS_FILE = Path(__file__).with_name("replay_texts.txt")
REPLAY_VERSION = 1
POINTER_NAME = "replay.json"


@dataclass(frozen=True)
class ReplayRecord:
    """One replay target: ``speaker`` (a built-in name) says ``text``; ``codes`` is relative to the cache folder."""

    speaker: str
    text: str
    language: str
    frames: int
    codes: str


def replay_texts(texts: Sequence[str] | None, texts_file: str | None) -> list[str]:
    """``texts`` and the non-empty lines of ``texts_file``; neither given: the shipped list."""
    out = [t.strip() for t in texts or () if t.strip()]
    path = Path(texts_file).expanduser() if texts_file else (None if out else DEFAULT_TEXTS_FILE)
    if path is not None:
        if not path.is_file():
            raise ConfigError(f"data.replay_texts_file: {path} not found; give a UTF-8 file with one text a line")
        out += read_text_file(path, "data.replay_texts_file")  # names an unreadable or non-UTF-8 file
    if not out:
        raise ConfigError("data.replay_texts / data.replay_texts_file give no text to replay; give at least one line")
    return out


def check_replay(info: PretrainedInfo, fraction: float) -> None:
    """Refuse replay where there is no built-in speaker to keep."""
    if fraction > 0 and not (is_custom_voice(info.config) and built_in_speakers(info.config["talker_config"])):
        raise ConfigError(
            f"data.replay_fraction: replay needs a custom_voice model with built-in speakers as data.pretrained "
            f"({info.path} is {info.config.get('tts_model_type')!r}); set data.replay_fraction: 0"
        )


def mixed_count(train_records: int, fraction: float) -> int:
    """How many replay records make ``fraction`` of the training records (real + replay)."""
    return round(train_records * fraction / (1.0 - fraction)) if fraction > 0 else 0


def mixed_records(records: Sequence[Any], train_records: int, fraction: float) -> list[Any]:
    """``records`` cycled in order up to `mixed_count`: deterministic, so batch order and resume hold."""
    if not records:
        return []
    return [records[i % len(records)] for i in range(mixed_count(train_records, fraction))]


def record_seed(seed: int, speaker_number: int, text_number: int) -> int:
    """The seed of one replay record: the built-in speaker's number in sorted order, the text's in the list."""
    return seed + 1000 * speaker_number + text_number


def _generation(info: PretrainedInfo, max_new_tokens: int) -> dict[str, Any]:
    from tts_lightning.model.generation import generation_defaults

    return {**generation_defaults(info.path), "max_new_tokens": int(max_new_tokens)}


def replay_folder(cache_dir: Path, info: PretrainedInfo, texts: Sequence[str], max_new_tokens: int, seed: int) -> Path:
    """The folder of the replay records for these settings, ``replay/<key>``: the key hashes the model's
    files, the texts, the generation settings and the seed."""
    from tts_lightning.data.fingerprints import fingerprint_files, fingerprint_memo

    files = [*weight_files(info.path), info.path / "config.json"]
    files += [p for p in [info.path / "generation_config.json"] if p.is_file()]
    described = {
        "version": REPLAY_VERSION,
        "model": fingerprint_files(files, fingerprint_memo(cache_dir)),
        "texts": list(texts),
        "generation": _generation(info, max_new_tokens),
        "seed": int(seed),
    }
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / "replay" / key


def read_records(folder: Path) -> tuple[dict[str, Any], list[ReplayRecord]]:
    """``records.json`` of a replay folder: its header and records (FileNotFoundError when absent)."""
    path = folder / "records.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no replay records for these settings; run prepare again")
    data = json.loads(path.read_text(encoding="utf-8"))
    return data, [ReplayRecord(**r) for r in data["records"]]


def read_pointer(cache_dir: Path) -> Path | None:
    """The replay folder last prepared in ``cache_dir``, None when there is none."""
    path = cache_dir / POINTER_NAME
    if not path.is_file():
        return None
    return cache_dir / json.loads(path.read_text(encoding="utf-8"))["folder"]


def prepare_replay(
    cache_dir: Path,
    info: PretrainedInfo,
    texts: Sequence[str],
    *,
    max_new_tokens: int,
    seed: int,
    device: str = "cpu",
) -> list[ReplayRecord]:
    """The replay records of these settings: read from their folder when prepared before, else
    spoken now by the starting model (each built-in speaker x each text) and written."""
    folder = replay_folder(cache_dir, info, texts, max_new_tokens, seed)
    try:
        _, records = read_records(folder)
        rank_zero_info(f"replay: {len(records)} record(s) already prepared ({folder})")
    except FileNotFoundError:
        records = _speak(folder, cache_dir, info, texts, _generation(info, max_new_tokens), seed, device)
        header = {"version": REPLAY_VERSION, "pretrained": str(info.path), "seed": seed, "texts": list(texts)}
        header["max_new_tokens"] = int(max_new_tokens)  # evaluate has the fine-tuned model say them alike
        atomic_write_json(folder / "records.json", {**header, "records": [asdict(r) for r in records]})
        rank_zero_info(f"replay: {len(records)} record(s) spoken by the starting model ({folder})")
    atomic_write_json(cache_dir / POINTER_NAME, {"folder": folder.relative_to(cache_dir).as_posix()})
    return records


def _save(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda fh: np.save(fh, array, allow_pickle=False))


def _speak(
    folder: Path,
    cache_dir: Path,
    info: PretrainedInfo,
    texts: Sequence[str],
    generation: dict[str, Any],
    seed: int,
    device: str,
) -> list[ReplayRecord]:
    """Each built-in speaker says each text, one record per call (padding never changes a record),
    seeded ``seed + 1000 x speaker number + text number`` with the caller's RNG left as it was."""
    from tts_lightning.data.codec_cache import check_codes, codebook_size
    from tts_lightning.model.generation import seeded
    from tts_lightning.model.loading import MetaWeights, build_empty_model
    from tts_lightning.model.pretrained import load_text_tokenizer
    from tts_lightning.model.sequence import tokenize_text

    talker_config = info.config["talker_config"]
    size = codebook_size(info)
    model = build_empty_model(info)
    MetaWeights(model, info).materialize_all(model, device=device)
    model.eval()
    generate: Any = model.generate  # the official generation (typed as a module attribute)
    tokenizer = load_text_tokenizer(info)
    records: list[ReplayRecord] = []
    speakers = sorted(built_in_speakers(talker_config))
    for s, speaker in enumerate(speakers):
        language = spoken_language(talker_config, speaker, "auto")
        for t, text in enumerate(texts):
            ids = torch.tensor([tokenize_text(tokenizer, text)], dtype=torch.long, device=device)
            with torch.no_grad(), seeded(record_seed(seed, s, t), torch.device(device)):
                codes, _ = generate(
                    input_ids=[ids], languages=[language], speakers=[speaker], non_streaming_mode=True, **generation
                )
            if codes[0].shape[0] == 0:
                continue  # nothing said before codec_eos: no target
            array = check_codes(codes[0], info.num_code_groups, size)  # the codec cache's dtype
            name = f"{speaker}_{t:03d}.npy"
            _save(folder / name, array)
            relative = (folder / name).relative_to(cache_dir).as_posix()
            records.append(ReplayRecord(speaker, text, language, int(array.shape[0]), relative))
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # training starts next on this device
    return records


def replay_items(preparer, tokenizer, names: Sequence[str]) -> tuple[list[int], list[Any]]:
    """The replay records of ``preparer``'s settings as `PreparedItem`s of the data module, and the
    codec ids of the speakers they add: a built-in speaker the run trains is its speaker index, one
    it does not is a new index after the run's (``len(names) + k``), whose codec row is its own."""
    from tts_lightning.data.dataset import PreparedItem
    from tts_lightning.model.layouts import SequenceLayout
    from tts_lightning.model.sequence import tokenize_texts

    _, records = read_records(preparer.replay_folder())
    built_in = built_in_speakers(preparer.info.config["talker_config"])
    index = {n.lower(): i for i, n in enumerate(names)}
    added: list[int] = []
    for speaker in sorted({r.speaker for r in records}):
        if speaker.lower() not in index:
            index[speaker.lower()] = len(names) + len(added)
            added.append(built_in[speaker.lower()])
    texts = tokenize_texts(tokenizer, [r.text for r in records])
    items = [
        PreparedItem(
            text_ids=tuple(ids),
            codes=preparer.cache_dir / r.codes,
            frames=r.frames,
            speaker_index=index[r.speaker.lower()],
            language=r.language,
            key=f"replay:{r.codes}",
            # In the layout they were spoken in, whatever the run's (docs/replay.md): the starting
            # model's own non-streaming speech, whose loss is then generation's NLL of its own draw.
            layout=SequenceLayout(),
        )
        for r, ids in zip(records, texts)
    ]
    return added, items
