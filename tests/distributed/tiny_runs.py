"""What the multi-process tests of this folder share: the `tts-lightning fit` arguments for the demo
clips on the tiny model, and what they read back from a run (TensorBoard scalars, the newest
``last.ckpt``). Imported by the test modules and by this folder's conftest.py."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TINY_CPU = REPO / "configs" / "tiny-cpu.yaml"
TINY_CPU_FSDP2 = REPO / "configs" / "tiny-cpu-fsdp2.yaml"
# The seeded reference runs (conftest.py): 8 optimizer steps, validated and checkpointed at 4 and 8.
REFERENCE_STEPS, REFERENCE_EVERY = 8, 4


def data_args(workdir: Path, tiny_dir: Path, cache: Path | None = None) -> list:
    """The demo clips (copied to ``workdir/demo``) on the tiny model, 150 frames per batch, codes
    cached in ``cache`` (default ``workdir/cache``)."""
    return [
        "--data.pretrained",
        tiny_dir,
        "--data.train_manifest",
        workdir / "demo" / "train.jsonl",
        "--data.cache_dir",
        workdir / "cache" if cache is None else cache,
        "--data.max_frames_per_batch",
        150,
    ]


def fit_args(config: Path, workdir: Path, tiny_dir: Path, run: str, *extra) -> list:
    """`fit` of ``config`` on the demo clips, logging and checkpointing into ``workdir/run``."""
    return [
        "fit",
        "--config",
        config,
        *data_args(workdir, tiny_dir),
        "--trainer.default_root_dir",
        workdir / run,
        *extra,
    ]


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run's TensorBoard event file: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(Path(run_dir).rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {run_dir}"
    acc = EventAccumulator(str(events[0].parent), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def newest_last(run_dir: Path) -> Path:
    """The newest ``last.ckpt`` under ``run_dir`` (a resumed run logs into a new version folder)."""
    return max(Path(run_dir).rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)
