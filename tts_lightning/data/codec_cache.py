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
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from tts_lightning.data.audio import TARGET_SAMPLE_RATE, load_audio
from tts_lightning.data.fingerprints import fingerprint_files, fingerprint_memo
from tts_lightning.data.validation import AcceptedClip
from tts_lightning.files import atomic_write, remove_stale_temporaries
from tts_lightning.model.pretrained import PretrainedInfo, load_speech_tokenizer

logger = logging.getLogger(__name__)

SAMPLES_PER_FRAME = 1920  # 24 kHz / 12.5 Hz
CODEC_CACHE_VERSION = 1  # bump when the key or the file format changes
MANIFEST_CODES_DIR = "manifest"

Progress = Callable[[int, int, float, float], None]  # (clips done, clips to do, seconds done, seconds to do)


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
                [d / "model.safetensors", d / "config.json"], fingerprint_memo(self.cache_dir)
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
        """True when the clip's cache file exists and its header and size are sound (a cheap check:
        the values are read by `load` and `verify(..., full=True)`)."""
        path = self.path(clip)
        return path.is_file() and self.problem(path) is None

    # -- verifying -----------------------------------------------------------------------------

    def problem(self, path: str | os.PathLike, *, full: bool = False) -> str | None:
        """What is wrong with the cache file ``path``, or None. Checks the header and the file size
        (truncation), the shape (T, num_code_groups) and the integer dtype; ``full`` also reads the
        values and checks they lie in the codebook."""
        try:
            if full:
                read_codes(path, self.num_code_groups, self.codebook_size)
            else:
                check_codes_header(path, self.num_code_groups)
        except CacheEntryError as exc:
            return exc.problem
        return None

    def _discard(self, path: Path, problem: str, what: str | None = None) -> None:
        about = f" (codes of {what})" if what else ""
        logger.warning("codec cache: %s%s is bad: %s; removed, it will be encoded again", path, about, problem)
        path.unlink(missing_ok=True)

    def verify(self, clips: Iterable[AcceptedClip], *, full: bool = False) -> list[Path]:
        """Check the cache files of ``clips`` (see `problem`); remove each bad one with a warning
        naming it, so that `encode_missing` encodes it again. Returns the removed files."""
        removed: list[Path] = []
        seen: set[Path] = set()
        for clip in clips:
            path = self.path(clip)
            if path in seen or not path.is_file():
                continue
            seen.add(path)
            problem = self.problem(path, full=full)
            if problem is not None:
                self._discard(path, problem, str(clip.record.audio))
                removed.append(path)
        return removed

    def verify_all(
        self, *, full: bool = True, names: dict[str, str] | None = None, stale_after: float = 3600.0
    ) -> tuple[int, list[Path]]:
        """Check every cache file of this speech tokenizer (and the stored manifest codes); remove the
        bad ones with a warning naming each. ``names`` maps a file's path relative to the cache folder
        to the clip it holds, for the warning. Temporary files that a killed process left (older than
        ``stale_after`` seconds, so never one being written now) are removed too. Returns (files
        checked, bad files removed)."""
        folders = [self.cache_dir / "codes" / self.tokenizer_id, self.cache_dir / "codes" / MANIFEST_CODES_DIR]
        checked, removed = 0, []
        for folder in folders:
            for tmp in remove_stale_temporaries(folder, ".*.npy.*.tmp", stale_after):
                logger.warning("codec cache: removed %s, a temporary file an interrupted write left", tmp)
            for path in sorted(folder.glob("*.npy")) if folder.is_dir() else []:
                checked += 1
                problem = self.problem(path, full=full)
                if problem is not None:
                    what = (names or {}).get(path.relative_to(self.cache_dir).as_posix())
                    self._discard(path, problem, what)
                    removed.append(path)
        return checked, removed

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
        """The clip's codes, LongTensor (T, 16), checked (shape, dtype, codebook range). Manifest
        codes come straight from the record. A bad cache file (truncated, wrong shape, values out of
        range) is removed with a warning naming it and the clip is encoded again."""
        if clip.record.audio_codes is not None:
            return torch.from_numpy(self._given_codes(clip).astype(np.int64))
        path = self.path(clip)
        try:
            return load_codes(path, self.num_code_groups, self.codebook_size)
        except CacheEntryError as exc:
            self._discard(path, exc.problem, str(clip.record.audio))
        self.encode_missing([clip])
        return load_codes(path, self.num_code_groups, self.codebook_size)

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
        path = clip.record.audio
        data = path.read_bytes()
        # The codes are filed under the content validation hashed: a file rewritten since would
        # leave another audio's codes under that key, used whenever the old content comes back.
        if hashlib.sha256(data).hexdigest() != clip.content_hash:
            raise AudioChangedError(
                f"{path} changed after it was validated (its bytes differ from those checked): run prepare "
                "again; it validates the new audio and encodes it"
            )
        wave = load_audio(path, TARGET_SAMPLE_RATE, normalize=self.normalize, trim_silence=self.trim_silence, data=data)
        return pad_to_frames(wave.numpy().astype(np.float32, copy=False))

    def encode_missing(
        self,
        clips: Iterable[AcceptedClip],
        batch_size: int = 8,
        max_seconds: float | None = None,
        progress: Progress | None = None,
    ) -> int:
        """Encode every clip without a cache file, at most ``batch_size`` clips and ``max_seconds``
        of audio at a time (a longer clip alone); return how many were encoded. Manifest codes are
        checked and stored without encoding (and not counted)."""
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
        done, seconds, total_seconds = 0, 0.0, sum(c.duration for c in todo)
        for batch in _batches(todo, batch_size, max_seconds):
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
            seconds += sum(c.duration for c in batch)
            if progress is not None:
                progress(done, len(todo), seconds, total_seconds)
        return done

    def release(self) -> None:
        """Drop the speech tokenizer (frees its memory; it is reloaded if needed again)."""
        self._tokenizer = None
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # give its blocks back before training allocates the model


def _batches(clips: list[AcceptedClip], size: int, max_seconds: float | None) -> list[list[AcceptedClip]]:
    """Consecutive batches of at most ``size`` clips and ``max_seconds`` of audio (a clip longer
    than that alone): the encoder's activations grow with the seconds of a call, not its clips."""
    batches: list[list[AcceptedClip]] = []
    seconds = 0.0
    for clip in clips:
        full = batches and (
            len(batches[-1]) >= size or (max_seconds is not None and seconds + clip.duration > max_seconds)
        )
        if not batches or full:
            batches.append([])
            seconds = 0.0
        batches[-1].append(clip)
        seconds += clip.duration
    return batches


class AudioChangedError(RuntimeError):
    """A clip's audio file changed between its validation and its encoding."""


class CacheEntryError(ValueError):
    """A codec cache file that cannot be used: unreadable, truncated, wrong shape, dtype or values."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(
            f"codec cache file {self.path} is bad: {problem}. Run `tts-lightning prepare --verify` "
            "(or delete the file) and it is encoded again"
        )


def check_codes_header(path: str | os.PathLike, num_code_groups: int | None = None) -> tuple[int, ...]:
    """The shape of a cached ``.npy`` codes file from its header, after checking the header, the
    dtype (integer), the shape ((T >= 1, num_code_groups)) and that the file holds all the data the
    header announces (not truncated). Raises `CacheEntryError`; FileNotFoundError when missing."""
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(fh)
            offset = fh.tell()
            size = os.fstat(fh.fileno()).st_size
    except FileNotFoundError:
        raise
    except (OSError, ValueError, EOFError, SyntaxError) as exc:
        raise CacheEntryError(path, f"unreadable .npy header ({exc})") from None
    _check_layout(path, tuple(shape), dtype, num_code_groups)
    expected = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != expected:
        raise CacheEntryError(path, f"truncated or padded: {size} bytes, the header announces {expected}")
    return tuple(shape)


def _check_layout(path, shape: tuple[int, ...], dtype: np.dtype, num_code_groups: int | None) -> None:
    groups = "G" if num_code_groups is None else str(num_code_groups)
    if len(shape) != 2 or shape[0] < 1 or (num_code_groups is not None and shape[1] != num_code_groups):
        raise CacheEntryError(path, f"shape {shape}, expected (frames >= 1, {groups})")
    if dtype.kind not in "iu":
        raise CacheEntryError(path, f"dtype {dtype}, expected integers")


def read_codes(
    path: str | os.PathLike, num_code_groups: int | None = None, codebook_size: int | None = None
) -> np.ndarray:
    """A cached codes file as an integer array (T, G), checked: readable and complete, 2-D with
    ``num_code_groups`` columns, integer dtype, values in ``[0, codebook_size)`` (non-negative when
    no size is given). Raises `CacheEntryError` naming the file; FileNotFoundError when missing."""
    try:
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, EOFError) as exc:
        raise CacheEntryError(path, f"unreadable or truncated ({exc})") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive
        raise CacheEntryError(path, "not a single .npy array")
    _check_layout(path, arr.shape, arr.dtype, num_code_groups)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or (codebook_size is not None and hi >= codebook_size):
        bound = "" if codebook_size is None else f", {codebook_size}"
        raise CacheEntryError(path, f"values in [{lo}, {hi}], outside the codebook [0{bound})")
    return arr


def load_codes(
    path: str | os.PathLike, num_code_groups: int | None = None, codebook_size: int | None = None
) -> torch.Tensor:
    """A cached ``.npy`` codes file as a LongTensor (T, G), checked as `read_codes` does."""
    return torch.from_numpy(read_codes(path, num_code_groups, codebook_size).astype(np.int64))
