"""`prepare` split over the ranks of a run: which ranks share a cache folder, and each one's share.

First the ranks find out which of them see the same cache folder (the storage probe): all of them
when ``cache_dir`` is shared storage, the ranks of each node when each node has its own disk. Each
step that reads every clip is then split over the ranks of a group: each does every n-th item and
leaves its results in the cache folder; once all are done the group's first rank (the finishing
rank) combines them. So each node with a disk of its own prepares its whole copy with all its
ranks, and nobody waits for one rank to do another node's share.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from tts_lightning.data.codec_cache import CodecCache
from tts_lightning.data.prepare_settings import PrepareSettings
from tts_lightning.data.prepared_index import PreparedIndex
from tts_lightning.data.selection import Plan
from tts_lightning.data.validation import AcceptedClip, FileCheck, ValidationConfig, check_file
from tts_lightning.data.validation_memo import VALIDATION_MEMO_VERSION, file_stamp
from tts_lightning.files import atomic_write_json, remove_stale_temporaries

logger = logging.getLogger(__name__)

T = TypeVar("T")


class PrepareStopped(RuntimeError):
    """Raised on the ranks of a run whose own step of `prepare_on_all_ranks` went well when
    another rank's failed (that rank raises its own error)."""


class Preparer(Protocol):
    """The steps of `tts_lightning.data.prepare.DataPreparer` that the ranks split."""

    settings: PrepareSettings

    @property
    def cache_dir(self) -> Path: ...

    def files_to_validate(self) -> list[Path]: ...

    def plan(
        self, *, show_report: bool = True, write_report: bool = True, checks: Mapping[Path, FileCheck] | None = None
    ) -> Plan: ...

    def codec_cache(self, device: str | None = None) -> CodecCache: ...

    def encode(self, clips: list[AcceptedClip], *, device: str | None = None, log: str = "") -> int: ...

    def embed(self, plan: Plan, speakers: list[str]) -> None: ...

    def write_index(self, plan: Plan) -> PreparedIndex: ...

    def prepare_replay(self, device: str | None = None) -> list: ...


@dataclass
class Share:
    """A rank's share of the work among the ranks that see its cache folder."""

    index: int  # its place among them; 0 is the finishing rank
    size: int  # how many ranks see the folder
    files: list[Path]  # the audio files to check, all ranks' (empty when every memo is up to date)
    parts: list[Path]  # where each of them leaves its checks


def probe_name(token: int) -> str:
    return f".{token:014x}.tmp"  # hidden and .tmp: swept with the temporaries a killed rank left


def leave_probe(cache_dir: Path) -> Path:
    """An empty file of a random name in ``ranks/``, for the other ranks of a run to look for."""
    folder = cache_dir / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / probe_name(int.from_bytes(os.urandom(7), "big"))  # not a seeded generator; an int64
    probe.touch()
    return probe


def checks_parts(cache_dir: Path, files: list[Path], world: int, config: ValidationConfig) -> list[Path]:
    """Where each rank leaves its checks of ``files``: named by the files (with their size and
    modification time) and the settings, so a part an interrupted run left is never taken."""
    h = hashlib.sha256(json.dumps({"version": VALIDATION_MEMO_VERSION, **asdict(config)}).encode())
    for f in files:
        h.update(repr((str(f), file_stamp(f))).encode())
    folder = cache_dir / "validation" / "parts"
    return [folder / f"{h.hexdigest()[:16]}-{rank}-of-{world}.json" for rank in range(world)]


def gather_checks(files: list[Path], parts: list[Path], config: ValidationConfig) -> dict[Path, FileCheck]:
    """Every rank's checks of ``files``; a share whose part this rank cannot read (another
    node's disk) is checked here."""
    checks: dict[Path, FileCheck] = {}
    for r, path in enumerate(parts):
        share = files[r :: len(parts)]
        found: dict[Path, FileCheck] = {}
        if share and path.is_file():
            try:
                found = {Path(f): FileCheck(**c) for f, c in json.loads(path.read_text(encoding="utf-8"))}
            except (OSError, ValueError, TypeError) as exc:
                logger.warning("ignoring unreadable validation part %s (%s); checking its files here", path, exc)
        if set(found) != set(share):
            found = {f: check_file(f, config) for f in share}
        checks.update(found)
    return checks


class _Together:
    """Runs a step on this rank and ends it with ``agree(ok)``, a collective of all ranks: the
    barrier between steps, and how a step that failed on one rank stops every rank (that rank
    raises its error, the others `PrepareStopped`) instead of leaving them waiting at the next
    barrier until the process group times out."""

    def __init__(self, rank: int, agree: Callable[[bool], bool]) -> None:
        self.rank = rank
        self.agree = agree

    def __call__(self, step: str, work: Callable[[], T]) -> T:
        try:
            result = work()
        except Exception:
            self.agree(False)  # raised once every rank knows
            raise
        if not self.agree(True):
            raise PrepareStopped(f"rank {self.rank}: preparing the data stopped while {step}: another rank failed")
        return result


def _check_share(preparer: Preparer, rank: int, probe: Path, tokens: list[int], config: ValidationConfig) -> Share:
    """This rank's place among the ranks whose probe it sees, and its checks of its share of the
    audio files (left in its part)."""
    seen = (r for r, token in enumerate(tokens) if (probe.parent / probe_name(token)).exists())
    sharing = sorted({rank, *seen})
    index, size = sharing.index(rank), len(sharing)
    files = preparer.files_to_validate()  # empty when every memo is up to date: a second run checks nothing
    parts = checks_parts(preparer.cache_dir, files, size, config)  # one name per rank, from one stat of every file
    if files:
        atomic_write_json(parts[index], [[str(f), asdict(check_file(f, config))] for f in files[index::size]])
    return Share(index, size, files, parts)


def _encode_share(
    preparer: Preparer, share: Share, plan: Plan | None, probes: Path, rank: int, world: int, device: str
) -> None:
    """Encode this rank's share of the clips and embed its share of the speakers; the finishing
    rank (which has the ``plan``) first sweeps what interrupted runs left."""
    part = share.parts[share.index]
    part.unlink(missing_ok=True)  # the finishing rank has read it
    if share.index == 0:  # parts an interrupted run left under other names (other files or group size)
        for stale in set(part.parent.glob("*.json")) - set(share.parts):
            stale.unlink(missing_ok=True)
        for folder in (part.parent, preparer.cache_dir / "speakers" / "parts", probes):
            remove_stale_temporaries(folder, ".*.tmp")  # what a killed rank's writes left
    mine = plan or preparer.plan(show_report=False, write_report=False)  # the memo the finishing rank wrote
    ordered = sorted(mine.clips, key=lambda c: (c.duration, c.content_hash))
    preparer.encode(ordered[share.index :: share.size], device=device, log=f"rank {rank}/{world}: ")
    preparer.embed(mine, mine.speakers[share.index :: share.size])


def _finish(preparer: Preparer, plan: Plan, device: str) -> None:
    """The finishing rank's last step: the index (and the replay records). Each rank checked or wrote its share in this
    folder. Should two ranks have seen the folder differently (a file system caching lookups),
    what no one encoded is encoded here (a stat per clip when nothing is missing)."""
    cache = preparer.codec_cache(device)
    cache.encode_missing(
        plan.clips,
        batch_size=preparer.settings.encode_batch_size,
        max_seconds=preparer.settings.encode_batch_seconds,
    )
    cache.release()
    preparer.write_index(plan)
    preparer.prepare_replay(device)  # the starting model's replay records, spoken once (when replay is on)


def prepare_on_all_ranks(
    preparer: Preparer,
    world: int,
    rank: int,
    *,
    agree: Callable[[bool], bool],
    gather: Callable[[int], list[int]],
    device: str,
) -> None:
    """``preparer.prepare``, split over the ranks of a run (called on every rank, after one process
    per node read the manifests); see `tts_lightning.data.prepare.DataPreparer.prepare_on_all_ranks`."""
    together = _Together(rank, agree)
    # Which ranks see this cache folder: each leaves a file of a random name, the names are
    # all-gathered (every rank has written its file by then), and each looks for the others'.
    probe = together("finding the ranks that share the cache folder", lambda: leave_probe(preparer.cache_dir))
    tokens = gather(int(probe.stem[1:], 16))
    config = preparer.settings.validation_config()
    try:
        share = together("checking the audio files", lambda: _check_share(preparer, rank, probe, tokens, config))
    finally:
        probe.unlink(missing_ok=True)  # every rank has looked: the step ends with a collective
    finisher = share.index == 0
    plan: Plan | None = together(
        "validating",
        lambda: preparer.plan(checks=gather_checks(share.files, share.parts, config)) if finisher else None,
    )
    together("encoding", lambda: _encode_share(preparer, share, plan, probe.parent, rank, world, device))
    together("writing the index", lambda: _finish(preparer, plan, device) if plan is not None else None)


def rank_device(prepare_device: str | None, root_device: torch.device) -> str | None:
    """``prepare_device`` for one rank of a run whose rank works on ``root_device``: a CUDA device
    becomes the rank's own GPU (``cuda:0`` on every rank would put every rank's speech tokenizer,
    speaker encoder and CUDA context on GPU 0); anything else is kept."""
    if prepare_device is not None and root_device.type == "cuda" and torch.device(prepare_device).type == "cuda":
        return str(root_device)
    return prepare_device


def prepare_with_strategy(preparer, strategy, world: int, rank: int) -> None:
    """`prepare_on_all_ranks` with a Lightning strategy's collectives, on this rank's device."""
    import copy
    from dataclasses import replace

    def gather(n: int) -> list[int]:
        # An all-gather as the sum of one row per rank (Lightning's all_gather warns of a
        # deprecated torch function); on the root device: NCCL takes no CPU tensor.
        rows = torch.zeros(world, dtype=torch.int64, device=strategy.root_device)
        rows[rank] = n
        return strategy.reduce(rows, reduce_op="sum").tolist()

    device = rank_device(preparer.settings.prepare_device, strategy.root_device)
    if device != preparer.settings.prepare_device:  # the speaker embeddings too: this rank's settings
        preparer = copy.copy(preparer)
        preparer.settings = replace(preparer.settings, prepare_device=device)
    preparer.prepare_on_all_ranks(
        world,
        rank,
        agree=lambda ok: strategy.reduce_boolean_decision(ok, all=True),
        gather=gather,
        device=device or str(strategy.root_device),
    )
