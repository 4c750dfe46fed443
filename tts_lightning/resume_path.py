"""What ``--ckpt_path`` names, checked and resolved before a run starts.

- ``last`` is `last.ckpt` of the run's checkpoint folder, unless a complete checkpoint of a later
  step was written after it: `ModelCheckpoint` writes a step's top-k checkpoint before its
  `last.ckpt`, so a run stopped between the two has a top-k checkpoint of a later step (Lightning
  then resumed from the older one), and SLURM's requeue checkpoint is newer still. Both tests, the
  step and the time written: a copied folder's files have the times of the copy (the time alone,
  Lightning's rule among `last*.ckpt` files, resumed a copy from whichever file was copied last),
  and a folder where a run was resumed from an earlier step keeps the abandoned later steps'
  files, older than the resumed run's `last.ckpt` (the step alone would resume those). Without a
  `last.ckpt`, the checkpoint of the highest step. A checkpoint that a save set aside
  (``.last.ckpt.old``, `tts_lightning.distributed.atomic`) counts when the checkpoint it stood for
  is missing. Half-written saves (``.*.partial``) never do (a fit's start removes them). SLURM's
  auto-requeue checkpoints (``hpc_ckpt_<n>.ckpt`` in the run's folder) count too, and a SLURM job
  without ``--ckpt_path`` whose folder has them (a requeued one) resumes from the run's newest
  complete checkpoint, not from a number that a save the time limit cut short took.
- ``best`` (``validate``, ``test``, ``predict``) is the best checkpoint the run's newest complete
  checkpoint records (its `ModelCheckpoint` state's ``best_model_path``): Lightning knows it only
  in the process that ran the fit.
- Anything else must be a checkpoint: a file that is not one, or a folder that is not a sharded
  checkpoint, is one line, not an unpickling traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tts_lightning.errors import ConfigError

LAST = "last.ckpt"  # Lightning's ModelCheckpoint.CHECKPOINT_NAME_LAST + FILE_EXTENSION
# Lightning's SLURM auto-requeue saves `hpc_ckpt_<n>.ckpt` in the run's default_root_dir, and a
# requeued job resumes from the highest <n>, complete or not (a save the time limit cut short).
REQUEUE_PREFIX = "hpc_ckpt_"


def newest_checkpoint(folder: str | Path | None, requeued_in: str | Path | None = None) -> Path | None:
    """The checkpoint ``--ckpt_path last`` resumes (the module's docstring) among the complete ones
    of ``folder`` and the SLURM auto-requeue checkpoints (`REQUEUE_PREFIX`) in ``requeued_in`` (the
    run's ``default_root_dir``, where Lightning writes them); None when there is none."""
    from tts_lightning.model.checkpoint import CheckpointError, CheckpointReader

    candidates = []
    if folder is not None and Path(folder).is_dir():
        folder = Path(folder)
        candidates = [p for p in folder.iterdir() if p.suffix == ".ckpt" and not p.name.startswith(".")]
        set_aside = folder / f".{LAST}.old"
        if not (folder / LAST).exists() and set_aside.exists():
            candidates.append(set_aside)  # a save stopped between its two renames
    if requeued_in is not None and Path(requeued_in).is_dir():
        candidates += [p for p in Path(requeued_in).glob(f"{REQUEUE_PREFIX}*.ckpt") if p not in candidates]
    order = {}
    for path in candidates:
        try:
            step = CheckpointReader(path).global_step
        except CheckpointError:
            continue  # not readable as a checkpoint: never resumed from
        # A sharded checkpoint's meta.pt is written with its shards (a folder's own time changes
        # with its entries only).
        order[path] = (step, (path / "meta.pt" if path.is_dir() else path).stat().st_mtime_ns)
    if not order:
        return None
    last = next((p for p in order if p.name in (LAST, f".{LAST}.old")), None)
    if last is None:
        return max(order, key=order.__getitem__)
    step, written = order[last]
    later = [p for p, (s, w) in order.items() if s > step and w > written]  # saved since, of a later step
    return max(later, key=order.__getitem__) if later else last


def best_checkpoint(folder: str | Path | None) -> Path | None:
    """The best checkpoint (by the run's monitor) that the newest complete checkpoint of ``folder``
    records, where it still exists; None when there is none."""
    import pickle

    import torch

    newest = newest_checkpoint(folder)
    if newest is None:
        return None
    try:
        saved = torch.load(newest / "meta.pt" if newest.is_dir() else newest, map_location="cpu", mmap=True)
    except (pickle.UnpicklingError, RuntimeError):  # not plain tensors and containers: none we can read
        return None
    for state in (saved.get("callbacks") or {}).values():
        best = state.get("best_model_path") if isinstance(state, dict) else None
        if best:
            # The folder's own file first: a moved or copied run's recorded path is elsewhere.
            for candidate in (newest.parent / Path(best).name, Path(best)):
                if candidate.exists():
                    return candidate
    return None


def check_checkpoint(
    path: str | Path,
    speakers: Sequence[str] | None = None,
    adapter: bool | None = None,
    sharded_prefix: str | None = None,
) -> dict[str, Any]:
    """The hyper-parameters of the checkpoint ``--ckpt_path`` names. A path that does not exist or
    is not a checkpoint, or one trained on other speakers than ``speakers`` (the run's: its speaker
    table has a row each), or with a LoRA adapter where the run has none (``adapter``: whether it
    has one) or the reverse (its tensors are another set), or a sharded checkpoint the other FSDP
    strategy wrote (``sharded_prefix``: the run's strategy's layout), is one line naming it."""
    from tts_lightning.model.checkpoint import GIVE_THE_FOLDER, CheckpointError, CheckpointReader, refuse_other_strategy

    hint = "give a checkpoint file or a sharded checkpoint folder"
    if not Path(path).exists():
        raise ConfigError(f"ckpt_path {path} does not exist: {hint}")
    try:
        reader = CheckpointReader(path)
    except CheckpointError as exc:
        said = str(exc) if str(exc).endswith(GIVE_THE_FOLDER) else f"{exc}: {hint}"
        raise ConfigError(f"ckpt_path: {said}") from exc
    hyper_parameters = reader.hyper_parameters
    if sharded_prefix is not None and reader.sharded_prefix is not None:
        refuse_other_strategy(path, reader.sharded_prefix, sharded_prefix)
    saved = [str(s) for s in hyper_parameters.get("speakers") or []]
    if speakers is not None and saved and saved != list(speakers):
        keep = "[" + ", ".join(saved) + "]"
        raise ConfigError(
            f"ckpt_path {path} was trained on the speakers {keep}, this run has [{', '.join(speakers)}]: "
            f"resume with its speakers (--data.speakers '{keep}' and its data), or start a new run"
        )
    trained_with = hyper_parameters.get("adapter") is not None
    if adapter is not None and "adapter" in hyper_parameters and trained_with != adapter:
        with_, without = "with a LoRA adapter (model.adapter)", "without a LoRA adapter"
        raise ConfigError(
            f"ckpt_path {path} was trained {with_ if trained_with else without}, this run is "
            f"{with_ if adapter else without}: use the config it was trained with, or start a new run"
        )
    return hyper_parameters
