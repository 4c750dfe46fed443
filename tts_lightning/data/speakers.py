"""One fp32 embedding per speaker, averaged over its reference clips, with the model's own encoder.

The embedding goes into the talker's speaker slot during training and becomes the new speaker's
``codec_embedding`` row on export, so it must be what the checkpoint's speaker encoder gives for the
speaker's audio: the same ECAPA-TDNN weights (``speaker_encoder.*`` of the checkpoint, fp32) and the
same 128-bin log-mel front end as ``Qwen3TTSForConditionalGeneration.extract_speaker_embedding``.

Unlike the official recipe, references may have any sample rate, channel count and length: each is
read with `tts_lightning.data.audio` (mono, 24 kHz), encoded on its own, and the per-clip embeddings
are averaged in fp32.

References of a speaker: the first ``num_reference_clips`` (by path) of the ``ref_audio`` files its
records name, when any do; otherwise of its accepted clips.

Embeddings are cached in ``<cache_dir>/speakers/<model_id>.pt`` (``model_id``: hash of the speaker
encoder's weights and config) as ``{"speakers": [names], "embeddings": (N, D) fp32, "keys": [...]}``.
A speaker's key hashes its references' contents, the audio options and the encoder; only speakers
whose key changed are recomputed, and the encoder is built only then.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tts_lightning.data.audio import TARGET_SAMPLE_RATE, load_audio
from tts_lightning.data.fingerprints import fingerprint_memo, memoized_by_stat
from tts_lightning.data.validation import AcceptedClip
from tts_lightning.files import atomic_write, sha256_file
from tts_lightning.model.pretrained import PretrainedInfo, load_config, load_state_dict, weight_files

logger = logging.getLogger(__name__)

SPEAKER_CACHE_VERSION = 1
PREFIX = "speaker_encoder."
# extract_speaker_embedding's front end (modeling_qwen3_tts.py).
MEL_KWARGS = dict(n_fft=1024, num_mels=128, sampling_rate=24_000, hop_size=256, win_size=1024, fmin=0, fmax=12_000)


@dataclass(frozen=True)
class SpeakerReference:
    path: Path
    content_hash: str  # sha256 of the file bytes


@dataclass
class SpeakerTable:
    names: list[str]
    embeddings: Tensor  # (N, D) fp32, row i for names[i]
    keys: list[str]
    path: Path | None = None

    def index(self, name: str) -> int:
        return self.names.index(name)


def mel_features(wave: Tensor) -> Tensor:
    """(samples,) float32 at 24 kHz -> (1, frames, 128) log-mel, as extract_speaker_embedding."""
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    return mel_spectrogram(wave.float().unsqueeze(0), **MEL_KWARGS).transpose(1, 2)


class SpeakerEncoder:
    """The checkpoint's speaker encoder, fp32, eval, no grad. Built on first use."""

    def __init__(
        self, info: PretrainedInfo, device: str | torch.device = "cpu", *, memo_path: str | os.PathLike | None = None
    ) -> None:
        self.info = info
        self.device = torch.device(device)
        self.memo_path = memo_path  # remember the fingerprint while the weight files are unchanged
        self._state: dict[str, Tensor] | None = None
        self._module: torch.nn.Module | None = None
        self._fingerprint: str | None = None

    def _weights(self) -> dict[str, Tensor]:
        if self._state is None:
            state = load_state_dict(self.info, prefix=PREFIX)
            if not state:
                raise ValueError(
                    f"{self.info.path}: the checkpoint has no speaker encoder (tts_model_type "
                    f"{self.info.tts_model_type!r}); speaker embeddings need a *-Base model"
                )
            self._state = {k[len(PREFIX) :]: v for k, v in state.items()}
        return self._state

    @property
    def fingerprint(self) -> str:
        """Short hex hash of the encoder's weights (names, dtypes, shapes, bytes) and config."""
        if self._fingerprint is None:
            if self.memo_path is None:
                self._fingerprint = self._compute_fingerprint()
            else:
                files = [self.info.path / "config.json", *weight_files(self.info.path)]
                self._fingerprint = memoized_by_stat(
                    self.memo_path, f"speaker_encoder:{self.info.path}", files, self._compute_fingerprint
                )
        return self._fingerprint

    def _compute_fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(json.dumps(self.info.config.get("speaker_encoder_config"), sort_keys=True).encode())
        for name, t in sorted(self._weights().items()):
            t = t.detach().contiguous().cpu()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    @property
    def module(self) -> torch.nn.Module:
        if self._module is None:
            from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder

            config = load_config(self.info).speaker_encoder_config
            module = Qwen3TTSSpeakerEncoder(config)
            module.load_state_dict({k: v.float() for k, v in self._weights().items()}, strict=True)
            self._module = module.float().eval().requires_grad_(False).to(self.device)
        return self._module

    @torch.no_grad()
    def embed(self, wave: Tensor) -> Tensor:
        """One clip (mono float32 at 24 kHz, 1-D) -> (D,) fp32 embedding."""
        mels = mel_features(wave.detach().cpu()).to(self.device, torch.float32)
        return self.module(mels)[0].float().cpu()

    def embed_files(
        self, paths: Sequence[str | os.PathLike], *, normalize: str | None = None, trim_silence: bool = False
    ) -> Tensor:
        """Mean fp32 embedding over audio files of any rate / channels / length."""
        if not paths:
            raise ValueError("no reference clips to embed")
        embeddings = []
        for p in paths:
            wave = load_audio(os.fspath(p), TARGET_SAMPLE_RATE, normalize=normalize, trim_silence=trim_silence)
            try:
                embeddings.append(self.embed(wave))
            except RuntimeError as exc:  # e.g. a clip shorter than the mel window
                raise ValueError(f"cannot compute a speaker embedding for {p}: {exc}") from exc
        return torch.stack(embeddings).mean(0)


_WARNED: set[tuple[str, int]] = set()  # (speaker, references named): said once per process


def select_references(
    clips: Iterable[AcceptedClip],
    speakers: Sequence[str],
    num_reference_clips: int = 3,
) -> dict[str, list[SpeakerReference]]:
    """Each speaker's reference files, at most ``num_reference_clips``, by path: the ``ref_audio``
    files its records name, else its accepted clips. Records that name a reference of their own
    (e.g. each clip itself) would otherwise make thousands: every one embedded, and loaded at once
    by the samples callback to score against."""
    if num_reference_clips <= 0:
        raise ValueError(f"num_reference_clips must be positive, got {num_reference_clips}")
    by_speaker: dict[str, list[AcceptedClip]] = {s: [] for s in speakers}
    for clip in clips:
        if clip.record.speaker in by_speaker:
            by_speaker[clip.record.speaker].append(clip)
    known = {c.record.audio: c.content_hash for cs in by_speaker.values() for c in cs}
    out: dict[str, list[SpeakerReference]] = {}
    for speaker in speakers:
        own = by_speaker[speaker]
        refs = sorted({c.record.ref_audio for c in own if c.record.ref_audio is not None}, key=str)
        if len(refs) > num_reference_clips and (speaker, len(refs)) not in _WARNED:
            _WARNED.add((speaker, len(refs)))
            logger.warning(
                "speaker %r: its records name %d reference clips (ref_audio); its embedding averages the first %d "
                "by path (data.num_reference_clips)",
                speaker,
                len(refs),
                num_reference_clips,
            )
        if refs:
            refs = refs[:num_reference_clips]
            out[speaker] = [SpeakerReference(p, known.get(p) or sha256_file(p)) for p in refs]
        else:
            chosen = sorted(own, key=lambda c: str(c.record.audio))[:num_reference_clips]
            if not chosen:
                raise ValueError(f"speaker {speaker!r} has no accepted clips to take a reference from")
            out[speaker] = [SpeakerReference(c.record.audio, c.content_hash) for c in chosen]
    return out


def _speaker_key(encoder_id: str, refs: Sequence[SpeakerReference], options: dict) -> str:
    payload = {
        "version": SPEAKER_CACHE_VERSION,
        "encoder": encoder_id,
        "references": [r.content_hash for r in refs],
        "options": options,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def speaker_table_path(cache_dir: str | os.PathLike, model_id: str) -> Path:
    return Path(cache_dir) / "speakers" / f"{model_id}.pt"


def _read_store(path: Path) -> dict[str, tuple[str, Tensor]]:
    if not path.is_file():
        return {}
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
        return {n: (k, data["embeddings"][i]) for i, (n, k) in enumerate(zip(data["speakers"], data["keys"]))}
    except Exception as exc:  # unreadable cache: recompute rather than fail
        logger.warning("ignoring unreadable speaker cache %s (%s)", path, exc)
        return {}


def speaker_part_path(cache_dir: str | os.PathLike, key: str) -> Path:
    """Where `embed_speakers` leaves the embedding of a speaker key (the key names the encoder,
    the references' contents and the options, so the file can only hold that embedding)."""
    return Path(cache_dir) / "speakers" / "parts" / f"{key}.pt"


def _embed(encoder: SpeakerEncoder, refs: Sequence[SpeakerReference], options: dict) -> Tensor:
    return encoder.embed_files(
        [r.path for r in refs], normalize=options["normalize"], trim_silence=options["trim_silence"]
    )


def embed_speakers(
    cache_dir: str | os.PathLike,
    info: PretrainedInfo,
    references: dict[str, list[SpeakerReference]],
    names: Iterable[str],
    *,
    normalize: str | None = None,
    trim_silence: bool = False,
    device: str | torch.device = "cpu",
) -> None:
    """Compute the embeddings of ``names`` (of ``references``) that the speaker table does not hold
    up to date, each into its own file (`speaker_part_path`), which `compute_speaker_table` then
    takes instead of computing it: how several processes share the work."""
    names = list(names)
    if not names:
        return
    encoder = SpeakerEncoder(info, device, memo_path=fingerprint_memo(cache_dir))
    options = {"sample_rate": TARGET_SAMPLE_RATE, "normalize": normalize, "trim_silence": trim_silence}
    store = _read_store(speaker_table_path(cache_dir, encoder.fingerprint))
    for name in names:
        key = _speaker_key(encoder.fingerprint, references[name], options)
        part = speaker_part_path(cache_dir, key)
        if (name in store and store[name][0] == key) or _read_part(part) is not None:
            continue  # in the table already, or computed by an earlier run that stopped before the table
        logger.info("computing speaker embedding of %r from %d reference clip(s)", name, len(references[name]))
        atomic_write(part, functools.partial(torch.save, _embed(encoder, references[name], options)))


def _read_part(path: Path) -> Tensor | None:
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True).float()
    except Exception as exc:  # unreadable part: compute it here rather than fail
        logger.warning("ignoring unreadable speaker embedding %s (%s)", path, exc)
        return None


def compute_speaker_table(
    cache_dir: str | os.PathLike,
    info: PretrainedInfo,
    references: dict[str, list[SpeakerReference]],
    *,
    normalize: str | None = None,
    trim_silence: bool = False,
    device: str | torch.device = "cpu",
    encoder: SpeakerEncoder | None = None,
) -> SpeakerTable:
    """Embeddings for ``references`` (name -> files), in that order, reusing the cache where each
    speaker's key is unchanged and the embeddings `embed_speakers` left. The cache file keeps other
    speakers it already held."""
    encoder = encoder or SpeakerEncoder(info, device, memo_path=fingerprint_memo(cache_dir))
    options = {"sample_rate": TARGET_SAMPLE_RATE, "normalize": normalize, "trim_silence": trim_silence}
    path = speaker_table_path(cache_dir, encoder.fingerprint)
    store = _read_store(path)
    names = list(references)
    keys, rows, computed, taken = [], [], [], []
    for name in names:
        key = _speaker_key(encoder.fingerprint, references[name], options)
        cached = store.get(name)
        if cached is not None and cached[0] == key:
            rows.append(cached[1].float())
        else:
            part = speaker_part_path(cache_dir, key)
            emb = _read_part(part)
            if emb is None:
                logger.info("computing speaker embedding of %r from %d reference clip(s)", name, len(references[name]))
                emb = _embed(encoder, references[name], options)
            taken.append(part)  # in the table now; an unreadable one a killed run left goes too
            rows.append(emb)
            store[name] = (key, emb)
            computed.append(name)
        keys.append(key)
    if computed or not path.is_file():
        all_names = sorted(store)
        data = {
            "version": SPEAKER_CACHE_VERSION,
            "speakers": all_names,
            "embeddings": torch.stack([store[n][1].float() for n in all_names]),
            "keys": [store[n][0] for n in all_names],
        }
        atomic_write(path, lambda fh: torch.save(data, fh))
    for part in taken:
        part.unlink(missing_ok=True)
    return SpeakerTable(names, torch.stack(rows).float(), keys, path)


CODEC_ROW_KEY = "codec-row"


def codec_row_table(cache_dir: str | os.PathLike, info: PretrainedInfo, names: Sequence[str]) -> SpeakerTable:
    """The table of a run from a ``custom_voice`` model, which has no speaker encoder: its speakers
    are codec-embedding rows that train with the model (`tts_lightning.model.custom_voice`), so the
    table holds zeros (nothing goes into the speaker slot on top of the row)."""
    hidden = int(info.config["talker_config"]["hidden_size"])
    path = Path(cache_dir) / "speakers" / "codec_rows.pt"
    embeddings, keys = torch.zeros(len(names), hidden), [CODEC_ROW_KEY] * len(names)
    data = {"version": SPEAKER_CACHE_VERSION, "speakers": list(names), "embeddings": embeddings, "keys": keys}
    atomic_write(path, lambda fh: torch.save(data, fh))
    return SpeakerTable(list(names), embeddings, keys, path)


def load_speaker_table(path: str | os.PathLike, names: Sequence[str], keys: Sequence[str]) -> SpeakerTable:
    """Read the rows for ``names`` from a cache file, checking each still has the expected key."""
    path = Path(path)
    store = _read_store(path)
    rows = []
    for name, key in zip(names, keys):
        entry = store.get(name)
        if entry is None or entry[0] != key:
            raise FileNotFoundError(
                f"{path}: no up-to-date speaker embedding for {name!r} (the cache changed after prepare); "
                "run prepare again"
            )
        rows.append(entry[1].float())
    return SpeakerTable(list(names), torch.stack(rows), list(keys), path)
