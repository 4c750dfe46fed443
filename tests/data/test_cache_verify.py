"""The codec cache checks what it reads: a truncated or malformed cache file is named in a warning,
removed and encoded again (the real tiny speech tokenizer), by `prepare()`, by `CodecCache.load`
and by `tts-lightning prepare --verify`."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from tts_lightning.data.codec_cache import (
    CacheEntryError,
    CodecCache,
    check_codes_header,
    load_codes,
    read_codes,
)
from tts_lightning.data.datamodule import SpeakerClipsDataModule
from tts_lightning.data.prepare_cli import prepare_command

LOGGER = "tts_lightning.data.codec_cache"


def _save(path: Path, arr: np.ndarray) -> Path:
    np.save(path, arr, allow_pickle=False)
    return path


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])


def test_reading_checks_every_property(tmp_path):
    good = _save(tmp_path / "good.npy", np.arange(32, dtype=np.int16).reshape(2, 16))
    assert load_codes(good, 16, 2048).shape == (2, 16)
    assert check_codes_header(good, 16) == (2, 16)

    truncated = _save(tmp_path / "truncated.npy", np.ones((50, 16), dtype=np.int16))
    _truncate(truncated)
    for check in (lambda p: read_codes(p, 16, 2048), lambda p: check_codes_header(p, 16)):
        with pytest.raises(CacheEntryError) as err:
            check(truncated)
        assert str(truncated) in str(err.value) and "prepare --verify" in str(err.value)
        assert "truncated" in err.value.problem

    cases = {
        "shape.npy": (np.zeros((5, 8), dtype=np.int16), "shape (5, 8)"),
        "flat.npy": (np.zeros(16, dtype=np.int16), "shape (16,)"),
        "empty.npy": (np.zeros((0, 16), dtype=np.int16), "shape (0, 16)"),
        "float.npy": (np.zeros((3, 16), dtype=np.float32), "dtype float32"),
        "range.npy": (np.full((3, 16), 4096, dtype=np.int16), "outside the codebook"),
        "negative.npy": (np.full((3, 16), -1, dtype=np.int16), "outside the codebook"),
    }
    for name, (arr, expected) in cases.items():
        path = _save(tmp_path / name, arr)
        with pytest.raises(CacheEntryError, match=re.escape(expected)):
            read_codes(path, 16, 2048)
    (tmp_path / "garbage.npy").write_bytes(b"not an npy file at all")
    with pytest.raises(CacheEntryError, match="garbage.npy"):
        load_codes(tmp_path / "garbage.npy")
    with pytest.raises(FileNotFoundError):
        load_codes(tmp_path / "missing.npy")


@pytest.fixture
def clips_manifest(tmp_path, write_tone) -> Path:
    """Five distinct 0.8 s tones of one speaker."""
    lines = []
    for i in range(5):
        write_tone(tmp_path / "clips" / f"{i}.wav", seconds=0.8, freq=180.0 + 40 * i)
        lines.append(json.dumps({"audio": f"clips/{i}.wav", "text": f"Clip number {i}.", "speaker": "bob"}))
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def _warned(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING)


def test_prepare_recovers_from_a_truncated_and_a_wrong_shape_file(tiny_dir, clips_manifest, tmp_path, caplog):
    data = SpeakerClipsDataModule(
        str(tiny_dir), str(clips_manifest), cache_dir=str(tmp_path / "cache"), val_fraction=0.2
    )
    data.prepare()
    index = json.loads(data.prepared_path.read_text())
    files = [data.cache_dir / e["codes"] for e in index["clips"]]
    originals = {f: f.read_bytes() for f in files}
    truncated, reshaped = files[0], files[1]
    _truncate(truncated)
    _save(reshaped, np.zeros((4, 8), dtype=np.int16))

    caplog.set_level(logging.WARNING, logger=LOGGER)
    data.prepare()
    warned = _warned(caplog)
    assert str(truncated) in warned and "truncated" in warned
    assert str(reshaped) in warned and "shape (4, 8)" in warned
    # Encoded again, byte for byte what the tokenizer gave the first time; the others untouched.
    assert {f: f.read_bytes() for f in files} == originals
    fresh = SpeakerClipsDataModule(
        str(tiny_dir), str(clips_manifest), cache_dir=str(tmp_path / "cache"), val_fraction=0.2
    )
    fresh.setup("fit")
    items = [fresh.train_dataset[i] for i in range(len(fresh.train_dataset))]
    assert len(items) + len(fresh.val_dataset) == 5


def test_codec_cache_load_reencodes_a_bad_file(tiny_dir, clips_manifest, tmp_path, caplog):
    from tts_lightning.data.manifest import load_manifest
    from tts_lightning.data.validation import validate_clips

    clips = validate_clips(load_manifest(clips_manifest).records).accepted[:2]
    cache = CodecCache(tmp_path / "cache", SpeakerClipsDataModule(str(tiny_dir), str(clips_manifest)).pretrained_info)
    assert cache.encode_missing(clips) == 2 and all(cache.is_cached(c) for c in clips)
    expected = cache.load(clips[0])
    path = cache.path(clips[0])
    _save(path, np.full((expected.shape[0], 16), 99999, dtype=np.int32))  # values outside the codebook
    assert cache.is_cached(clips[0])  # the cheap check reads the header only ...
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert (cache.load(clips[0]) == expected).all()  # ... loading reads the values: re-encoded
    assert str(path) in _warned(caplog) and "outside the codebook" in _warned(caplog)
    _truncate(path)
    assert not cache.is_cached(clips[0])


def test_prepare_verify_reads_back_the_whole_cache(tiny_dir, clips_manifest, tmp_path, caplog, capsys):
    args = [
        "--pretrained",
        str(tiny_dir),
        "--train_manifest",
        str(clips_manifest),
        "--cache_dir",
        str(tmp_path / "cache"),
        "--val_fraction",
        "0.2",
    ]
    assert prepare_command([*args, "--verify"]) == 0  # a fresh cache: nothing to read back yet, said so
    assert "verify: nothing was cached before this prepare" in capsys.readouterr().out
    index = json.loads((tmp_path / "cache" / "prepared.json").read_text())
    files = [tmp_path / "cache" / e["codes"] for e in index["clips"]]
    originals = {f: f.read_bytes() for f in files}
    _truncate(files[2])
    with open(files[3], "r+b") as fh:  # a flipped value far outside the codebook: only a full read sees it
        fh.seek(-2, 2)
        fh.write(np.int16(-7).tobytes())
    leftover = files[0].parent / f".{files[0].name}.k1ll3d.tmp"  # a write killed long ago
    leftover.write_bytes(b"\x93NUMPY half")
    os.utime(leftover, (time.time() - 7200, time.time() - 7200))
    capsys.readouterr()

    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert prepare_command([*args, "--verify"]) == 0
    assert not leftover.exists() and str(leftover) in _warned(caplog)
    out = capsys.readouterr().out
    assert "verified 5 cached codes file(s): 2 bad, encoded again" in out
    warned = _warned(caplog)
    for f in files[2:4]:
        assert str(f) in warned
    audio = {e["codes"]: e["audio"] for e in index["clips"]}
    assert audio[files[3].relative_to(tmp_path / "cache").as_posix()] in warned  # the clip is named too
    assert {f: f.read_bytes() for f in files} == originals
