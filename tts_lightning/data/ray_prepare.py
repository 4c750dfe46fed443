"""Codec encoding through Ray Data: `tts-lightning prepare --ray.num_workers N`.

The clips whose codes are not cached yet become a Ray dataset (path, content hash, duration:
small rows, the audio is read where it is encoded); ``map_batches`` runs them through `_Encoder`,
an actor per worker that loads the speech tokenizer once and writes each clip's codes into the
cache with `CodecCache.encode_missing`, exactly as a single process does, so the bytes are the
same. ``data.cache_dir`` must be storage every worker sees (any path on one machine); the pretrained
model is the driver's folder where a worker's node has it, else the ``data.pretrained`` the user
named, resolved on that node (a hub id downloads into the node's own Hugging Face cache).
Needs the ``ray`` extra (``pip install 'tts-lightning[ray]'``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

import numpy as np

from tts_lightning.data.codec_cache import CodecCache
from tts_lightning.data.manifest import ClipRecord
from tts_lightning.data.validation import AcceptedClip
from tts_lightning.ray_start import start_ray

INSTALL_HINT = "pip install 'tts-lightning[ray]'"


class _Encoder:
    """One per Ray worker: the speech tokenizer, loaded once, encoding batches of rows."""

    def __init__(
        self,
        cache_dir: str,
        pretrained: str,
        named: str,
        normalize: str | None,
        trim_silence: bool,
        device: str | None,
        batch_size: int,
        max_seconds: float | None = None,
    ) -> None:
        from tts_lightning.model.pretrained import check_pretrained

        info = check_pretrained(worker_pretrained(pretrained, named))
        self.cache = CodecCache(cache_dir, info, normalize=normalize, trim_silence=trim_silence, device=device)
        self.batch_size = batch_size
        self.max_seconds = max_seconds

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        clips = [
            AcceptedClip(ClipRecord(audio=Path(a), text="", speaker="", source=str(s)), float(d), str(h))
            for a, s, d, h in zip(batch["audio"], batch["source"], batch["duration"], batch["content_hash"])
        ]
        return {
            "encoded": np.array(
                [self.cache.encode_missing(clips, batch_size=self.batch_size, max_seconds=self.max_seconds)]
            )
        }


def worker_pretrained(resolved: str, named: str) -> str:
    """What a worker loads: the driver's resolved folder (a Hugging Face snapshot, the tiny model in
    the user cache) where the worker's node has it, else the name the user gave, for that node to
    resolve (the driver's cache folders are on its own disk)."""
    return resolved if Path(resolved).is_dir() else named


def actor_device(device: str | None, *, cuda_available: bool | None = None) -> tuple[float, str]:
    """(GPUs each encoding actor asks Ray for, the device it encodes on) for the prepare device:
    a CUDA device becomes one GPU per actor, which Ray makes the actor's only visible one
    (``cuda``). None is the prepare default, decided here as on one machine (a GPU when there is
    one, ``cuda_available``: the cluster's GPUs for `encode_with_ray`, else this process's), never
    by each actor: Ray hides no GPU from an actor that asks for none, so every actor's speech
    tokenizer landed on GPU 0. The decision is
    rehearsed on CPU (tests/data/test_ray_prepare.py); Ray has not run on a GPU here (the GPU
    check's wheels do not carry it)."""
    if device is None:
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        device = "cuda" if cuda_available else "cpu"
    if str(device).startswith("cuda"):
        return 1.0, "cuda"
    return 0.0, str(device)


def encode_with_ray(
    cache: CodecCache,
    clips: list[AcceptedClip],
    *,
    num_workers: int,
    batch_size: int = 8,
    max_seconds: float | None = None,
    address: str = "local",
    pretrained: str | None = None,
) -> int:
    """Encode the codes of ``clips`` not cached yet on ``num_workers`` Ray actors; return how many
    were encoded. Starts a local Ray instance (``address="local"``) or joins ``address``, and shuts
    down only what it started. Codes a manifest carries are stored here, without Ray. ``pretrained``:
    the model as the user named it (default: the cache's resolved folder)."""
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError(f"--ray.num_workers needs Ray: {INSTALL_HINT}") from exc
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    cache.encode_missing([c for c in clips if c.record.audio_codes is not None])
    rows, seen = [], set()
    for c in sorted(clips, key=lambda c: (c.duration, c.content_hash)):  # similar lengths share a batch
        path = cache.path(c)
        if c.record.audio_codes is None and path not in seen and not cache.is_cached(c):
            seen.add(path)
            rows.append(
                {
                    "audio": str(c.record.audio),
                    "source": c.record.source,
                    "duration": c.duration,
                    "content_hash": c.content_hash,
                }
            )
    if not rows:
        return 0
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if address == "local" else None
    started = start_ray(address, num_workers, threads, include_dashboard=False, log_to_driver=False)
    try:
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        dataset = ray.data.from_items(rows, override_num_blocks=min(len(rows), num_workers * 4))
        cluster_gpus = ray.cluster_resources().get("GPU", 0) > 0  # not the driver's: it may have none
        gpus, device = actor_device(None if cache.device is None else str(cache.device), cuda_available=cluster_gpus)
        # GPU actors as the cluster's GPUs allow (a fixed pool would wait for all of them).
        pool = (
            ray.data.ActorPoolStrategy(min_size=1, max_size=num_workers)
            if gpus
            else ray.data.ActorPoolStrategy(size=num_workers)
        )
        encoded = dataset.map_batches(
            _Encoder,
            fn_constructor_kwargs={
                "cache_dir": str(cache.cache_dir),
                "pretrained": str(cache.info.path),
                "named": str(pretrained or cache.info.path),
                "normalize": cache.normalize,
                "trim_silence": cache.trim_silence,
                "device": device,
                "batch_size": batch_size,
                "max_seconds": max_seconds,
            },
            batch_size=batch_size,
            compute=pool,
            num_cpus=1,
            num_gpus=gpus,
        )
        return int(cast(int, encoded.sum("encoded")) or 0)  # one column: a number (None when empty)
    finally:
        if started:
            ray.shutdown()
