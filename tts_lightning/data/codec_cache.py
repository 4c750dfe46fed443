"""Speech-tokenizer codes (T x 16) per clip, cached on disk and computed only once.

A clip's cache file is named after what determines its codes and nothing else:

    <cache_dir>/codes/<tokenizer_id>/<clip_key>.npy

- ``tokenizer_id``: sha256 of the speech tokenizer's ``model.safetensors`` and ``config.json``
  (short hex). Another tokenizer gets another folder; nothing is ever mixed.
- ``clip_key``: sha256 of the audio file's content hash (from validation) and the audio
  preprocessing options (sample rate, normalisation, silence trimming, frame padding).

Every waveform is zero-padded to a whole number of 1920-sample frames before encoding. The 12 Hz
tokenizer gives identical codes batched or alone except for the last partial frame, which depends
on how much padding the batch adds; padding each clip to whole frames first makes its codes
independent of batch composition (T = ceil(samples / 1920) is unchanged).

Codes a manifest already carries (``audio_codes`` in a prepared Qwen3-TTS JSONL) are used as given,
checked to be (T, 16) integers inside the codebook, and stored under ``codes/manifest/``.

The speech tokenizer is loaded only when a clip actually needs encoding, so a fully cached run never
builds it. All files are written atomically (temporary file + ``os.replace``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from tts_lightning.data.audio import TARGET_SAMPLE_RATE, load_audio
from tts_lightning.data.validation import AcceptedClip
from tts_lightning.files import atomic_write, atomic_write_json, sha256_file
from tts_lightning.model.pretrained import PretrainedInfo, load_speech_tokenizer

logger = logging.getLogger(__name__)

SAMPLES_PER_FRAME = 1920  # 24 kHz / 12.5 Hz
CODEC_CACHE_VERSION = 1  # bump when the key or the file format changes
MANIFEST_CODES_DIR = "manifest"
_ID_LENGTH = 16

Progress = Callable[[int, int], None]  # (clips done, clips to do)


def fingerprint_files(paths: Sequence[str | os.PathLike], memo_path: str | os.PathLike | None = None) -> str:
    """sha256 over the contents of ``paths`` (in order), short hex.

    With ``memo_path``, each file's digest is remembered there against its size and modification
    time, so a multi-gigabyte checkpoint is hashed once, not on every run.
    """
    memo: dict = {}
    memo_file = Path(memo_path) if memo_path is not None else None
    if memo_file is not None and memo_file.is_file():
        try:
            memo = json.loads(memo_file.read_text())
        except (OSError, json.JSONDecodeError):
            memo = {}
    changed = False
    outer = hashlib.sha256()
    for p in paths:
        p = Path(p).resolve()
        st = p.stat()
        stamp = [st.st_size, st.st_mtime_ns]
        entry = memo.get(str(p))
        if entry is not None and entry.get("stamp") == stamp:
            digest = entry["sha256"]
        else:
            digest = sha256_file(p)
            memo[str(p)] = {"stamp": stamp, "sha256": digest}
            changed = True
        outer.update(f"{p.name}:{digest}\n".encode())
    if memo_file is not None and changed:
        atomic_write_json(memo_file, memo)
    return outer.hexdigest()[:_ID_LENGTH]


def memoized_by_stat(memo_path: str | os.PathLike, name: str, files: Sequence[str | os.PathLike], compute: Callable[[], str]) -> str:
    """``compute()``, remembered in ``memo_path`` under ``name`` for as long as ``files`` keep
    their size and modification time."""
    memo_file = Path(memo_path)
    stamp = []
    for p in files:
        st = Path(p).stat()
        stamp.append([str(Path(p).resolve()), st.st_size, st.st_mtime_ns])
    memo: dict = {}
    if memo_file.is_file():
        try:
            memo = json.loads(memo_file.read_text())
        except (OSError, json.JSONDecodeError):
            memo = {}
    entry = memo.get(name)
    if isinstance(entry, dict) and entry.get("stamp") == stamp:
        return entry["value"]
    value = compute()
    memo[name] = {"stamp": stamp, "value": value}
    atomic_write_json(memo_file, memo)
    return value


# -- codes -------------------------------------------------------------------------------------


def pad_to_frames(wave: np.ndarray, samples_per_frame: int = SAMPLES_PER_FRAME) -> np.ndarray:
    """Zero-pad a 1-D waveform to a whole number of frames (at least one)."""
    n = wave.shape[-1]
    target = max(1, -(-n // samples_per_frame)) * samples_per_frame
    if target == n:
        return wave
    return np.pad(wave, (0, target - n))


def check_codes(codes, num_code_groups: int, codebook_size: int, *, what: str = "audio_codes") -> np.ndarray:
    """Codes as an int16 array (T, G), or ValueError saying what is wrong."""
    arr = np.asarray(codes.cpu() if isinstance(codes, torch.Tensor) else codes)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] != num_code_groups:
        raise ValueError(f"{what} must be (frames, {num_code_groups}) with frames >= 1, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= codebook_size:
        raise ValueError(f"{what} values must lie in [0, {codebook_size}), found [{lo}, {hi}]")
    return arr.astype(np.int16 if codebook_size <= 32768 else np.int32)


def codebook_size(info: PretrainedInfo) -> int:
    talker = info.config.get("talker_config", {})
    predictor = talker.get("code_predictor_config") or {}
    return int(predictor.get("vocab_size", 2048))


class CodecCache:
    """Codes per accepted clip, encoded once with the checkpoint's speech tokenizer."""

    def __init__(
        self,
        cache_dir: str | os.PathLike,
        info: PretrainedInfo,
        *,
        normalize: str | None = None,
        trim_silence: bool = False,
        device: str | torch.device | None = None,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.info = info
        self.normalize = normalize
        self.trim_silence = trim_silence
        self.device = torch.device(device) if device is not None else None
        self.num_code_groups = info.num_code_groups
        self.codebook_size = codebook_size(info)
        self._tokenizer_id: str | None = None
        self._tokenizer = None
        self._options = json.dumps(
            {
                "version": CODEC_CACHE_VERSION,
                "sample_rate": TARGET_SAMPLE_RATE,
                "normalize": normalize,
                "trim_silence": trim_silence,
                "trim_top_db": 40.0 if trim_silence else None,
                "pad_to_frames": SAMPLES_PER_FRAME,
            },
            sort_keys=True,
        )

    # -- identity ------------------------------------------------------------------------------

    @property
    def tokenizer_id(self) -> str:
        """Short hex identity of the speech tokenizer's weights + config (hashed once)."""
        if self._tokenizer_id is None:
            d = self.info.speech_tokenizer_dir
            self._tokenizer_id = fingerprint_files(
                [d / "model.safetensors", d / "config.json"], self.cache_dir / "fingerprints.json"
            )
        return self._tokenizer_id

    def key(self, clip: AcceptedClip) -> str:
        """The clip's cache key: its audio content plus the preprocessing options."""
        return hashlib.sha256(f"{clip.content_hash}|{self._options}".encode()).hexdigest()[:32]

    def path(self, clip: AcceptedClip) -> Path:
        """Where this clip's codes live (whether or not they exist yet)."""
        given = clip.record.audio_codes
        if given is not None:
            arr = self._given_codes(clip)
            digest = hashlib.sha256(f"{arr.shape}|".encode() + arr.tobytes()).hexdigest()[:32]
            return self.cache_dir / "codes" / MANIFEST_CODES_DIR / f"{digest}.npy"
        return self.cache_dir / "codes" / self.tokenizer_id / f"{self.key(clip)}.npy"

    def relative_path(self, clip: AcceptedClip) -> str:
        return self.path(clip).relative_to(self.cache_dir).as_posix()

    def is_cached(self, clip: AcceptedClip) -> bool:
        return self.path(clip).is_file()

    # -- reading -------------------------------------------------------------------------------

    def _given_codes(self, clip: AcceptedClip) -> np.ndarray:
        return check_codes(
            clip.record.audio_codes,
            self.num_code_groups,
            self.codebook_size,
            what=f"audio_codes of {clip.record.source}",
        )

    def check_given_codes(self, clip: AcceptedClip) -> str | None:
        """None when the clip has no manifest codes or they are valid; else what is wrong."""
        if clip.record.audio_codes is None:
            return None
        try:
            self._given_codes(clip)
        except ValueError as exc:
            return str(exc)
        return None

    def load(self, clip: AcceptedClip) -> torch.Tensor:
        """The clip's codes, LongTensor (T, 16). Manifest codes come straight from the record."""
        if clip.record.audio_codes is not None:
            return torch.from_numpy(self._given_codes(clip).astype(np.int64))
        return load_codes(self.path(clip))

    # -- writing -------------------------------------------------------------------------------

    @staticmethod
    def _save(path: Path, codes: np.ndarray) -> None:
        atomic_write(path, lambda fh: np.save(fh, codes, allow_pickle=False))

    def _get_tokenizer(self):
        if self._tokenizer is None:
            device = self.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
            logger.info("loading speech tokenizer from %s on %s", self.info.speech_tokenizer_dir, device)
            self._tokenizer = load_speech_tokenizer(self.info, device)
        return self._tokenizer

    def _load_wave(self, clip: AcceptedClip) -> np.ndarray:
        wave = load_audio(
            clip.record.audio, TARGET_SAMPLE_RATE, normalize=self.normalize, trim_silence=self.trim_silence
        )
        return pad_to_frames(wave.numpy().astype(np.float32, copy=False))

    def encode_missing(
        self,
        clips: Iterable[AcceptedClip],
        batch_size: int = 8,
        progress: Progress | None = None,
    ) -> int:
        """Encode every clip without a cache file, ``batch_size`` at a time; return how many were
        encoded. Manifest codes are checked and stored without encoding (and not counted)."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        todo: list[AcceptedClip] = []
        seen: set[Path] = set()
        for clip in clips:
            path = self.path(clip)
            if path in seen or path.is_file():
                continue
            seen.add(path)
            if clip.record.audio_codes is not None:
                self._save(path, self._given_codes(clip))
            else:
                todo.append(clip)
        if not todo:
            return 0
        # Similar lengths together waste less compute on padding; the codes do not depend on it.
        todo.sort(key=lambda c: c.duration)
        tokenizer = self._get_tokenizer()
        done = 0
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            waves = [self._load_wave(c) for c in batch]
            out = tokenizer.encode(waves, sr=TARGET_SAMPLE_RATE)
            for clip, wave, codes in zip(batch, waves, out.audio_codes):
                expected = wave.shape[0] // SAMPLES_PER_FRAME
                arr = check_codes(codes, self.num_code_groups, self.codebook_size, what=f"codes of {clip.record.audio}")
                if arr.shape[0] != expected:
                    raise RuntimeError(
                        f"speech tokenizer returned {arr.shape[0]} frames for {clip.record.audio}, "
                        f"expected {expected} ({wave.shape[0]} padded samples)"
                    )
                self._save(self.path(clip), arr)
            done += len(batch)
            if progress is not None:
                progress(done, len(todo))
        return done

    def release(self) -> None:
        """Drop the speech tokenizer (frees its memory; it is reloaded if needed again)."""
        self._tokenizer = None


def load_codes(path: str | os.PathLike) -> torch.Tensor:
    """A cached ``.npy`` codes file as a LongTensor (T, G)."""
    return torch.from_numpy(np.load(path, allow_pickle=False).astype(np.int64))
