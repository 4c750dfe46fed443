"""The cache folder of prepared data: where it is, the tag that marks it as a cache, what it holds.

Layout (``cache_dir``, default ``<manifest folder>/.tts_lightning_cache``)::

    CACHEDIR.TAG                   marks the folder as a cache: a folder manifest (and backups) skip it
    report.json                    accepted / rejected clips and why
    prepared.json                  the settings, the speakers and every clip (hash, text, speaker,
                                   language, frames, codes file, train/val split)
    validation/<manifest>.json     the memoised validation of each manifest
    validation/parts/              each rank's checks of its share of the files, while a run validates
    ranks/                         one empty file per rank while a run finds out which ranks share the folder
    fingerprints.json (+ .lock)    file digests by size and modification time (tts_lightning.data.fingerprints)
    codes/<tokenizer_id>/<key>.npy codes (T x 16) per clip      (tts_lightning.data.codec_cache)
    speakers/<model_id>.pt         fp32 embedding per speaker   (tts_lightning.data.speakers)
    speakers/parts/                embeddings computed by the ranks of a run, until the table takes them
    segments/<tag>-<key>/          clips cut from a long recording at its subtitles (tts_lightning.data.segments)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CACHE_DIR_NAME = ".tts_lightning_cache"

# A Cache Directory Tagging Specification tag (https://bford.info/cachedir/): folders holding it are
# skipped by folder manifests (and by backup tools), so a cache inside the data is never read as data.
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by tts-lightning.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)


def default_cache_dir(manifest: str | os.PathLike) -> Path:
    """``<manifest folder>/.tts_lightning_cache``; a user cache folder when that is not writable
    (e.g. a manifest inside an installed package)."""
    path = Path(manifest).expanduser().absolute()
    folder = path if path.is_dir() else path.parent
    candidate = folder / CACHE_DIR_NAME
    if os.access(candidate if candidate.is_dir() else folder, os.W_OK):
        return candidate
    root = os.environ.get("TTS_LIGHTNING_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tts-lightning"
    )
    return Path(root) / "prepared" / hashlib.sha256(str(path).encode()).hexdigest()[:12]


def write_cachedir_tag(folder: Path) -> None:
    """Write `CACHEDIR_TAG` as ``folder/CACHEDIR.TAG`` (creating the folder) unless a tag is already there."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with open(folder / "CACHEDIR.TAG", "x", encoding="ascii") as f:
            f.write(CACHEDIR_TAG)
    except FileExistsError:
        pass  # written earlier, or by another rank at the same time


def tag_cache_dir(folder: Path) -> None:
    """Mark ``folder`` as a cache (CACHEDIR.TAG) before anything is written in it: a folder
    manifest that holds it does not read it as data, and backup tools skip it."""
    try:
        write_cachedir_tag(folder)
    except OSError:
        pass  # an unwritable folder: the first real write names it (WriteError)


def is_cache_dir(folder: Path) -> bool:
    """True when ``folder`` holds a CACHEDIR.TAG starting with the spec's 43-byte signature line."""
    signature = CACHEDIR_TAG.split("\n", 1)[0].encode()
    try:
        with open(folder / "CACHEDIR.TAG", "rb") as f:
            return f.read(len(signature)) == signature
    except OSError:
        return False
