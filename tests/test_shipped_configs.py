"""The rehearsal tier: every shipped config (configs/*.yaml, found by glob) runs as a user gets it, on
CPU with the tiny model: `fit` a few steps with validation and its callbacks, resume from ``last``,
`validate`.

Only what CPU and a test must change is overridden (`overrides`): the accelerator, the pretrained
directory, the data paths, the number of steps, the validation interval and the samples' length;
where a config accumulates gradients, the positions per micro-batch, so that the demo's few clips
make several micro-batches per step (at the shipped 2000 one holds them all).
Everything else stays as shipped: the world size (1 or 4 processes), the strategy and its options,
precision, callbacks, checkpoint settings and monitor, freeze lists, LoRA. The 1-GPU configs are
the world-size-1 runs (FSDP1 switches to NO_SHARD there) with the samples callback.

What CPU cannot run is said in the config's own comment (e.g. ``cpu_offload``, which pins memory:
tests/test_configs.py checks that those commented options still parse; the offload path itself is
rehearsed in tests/distributed/test_process_group.py and checked by benchmarks/gpu_check.sh when a GPU is lent).

The one-process configs (the 1-GPU ones) rehearse two at a time, each in a thread of this process
(`one_process_rehearsals`): a one-process run keeps one of the 2 CPU cores busy. A multi-process
config waits until none runs, and rehearses alone.
"""

import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from tts_lightning.model.checkpoint import load_training_checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
STEPS = 2  # then one more on resume


def _raw(config: Path) -> dict:
    return yaml.safe_load(config.read_text())


def _has_samples(config: Path) -> bool:
    callbacks = (_raw(config).get("trainer") or {}).get("callbacks") or []
    return any(str(c.get("class_path", "")).endswith("SpeakerSamplesCallback") for c in callbacks)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, demo_data):
    """The demo clips and one codec cache copied from the session's prepared data: every config
    reads the same clips, encoded once."""
    root = tmp_path_factory.mktemp("shipped")
    demo, _, cache = demo_data
    shutil.copytree(demo / "demo", root / "demo")
    shutil.copytree(cache, root / "cache")
    return root


def overrides(config: Path, workdir: Path, tiny_dir: Path, run: Path) -> list:
    """The only settings a rehearsal changes (see the module docstring)."""
    args = [
        "--trainer.accelerator",
        "cpu",
        "--data.pretrained",
        tiny_dir,
        "--data.train_manifest",
        workdir / "demo" / "train.jsonl",
        "--data.cache_dir",
        workdir / "cache",
        "--trainer.default_root_dir",
        run,
    ]
    if (_raw(config).get("trainer") or {}).get("val_check_interval"):  # a step interval: validate at the last step
        args += ["--trainer.val_check_interval", STEPS]
    else:  # per epoch (an epoch of the demo clips is a step or two here): validate and sample once
        args += ["--trainer.check_val_every_n_epoch", STEPS]
    if _has_samples(config):
        args += ["--trainer.callbacks.max_new_tokens", 6]
    if _accumulate(config) > 1:  # the demo's epoch as 4 micro-batches (1 at 2000 positions): accumulated
        args += ["--data.max_frames_per_batch", 500]
    return args


def _accumulate(config: Path) -> int:
    return (_raw(config).get("trainer") or {}).get("accumulate_grad_batches", 1)


def _micro_batches(checkpoint: Path) -> int:
    """The training batches the run has completed (Lightning's loop state in the checkpoint)."""
    meta = checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint
    loops = torch.load(meta, map_location="cpu", weights_only=False)["loops"]
    return loops["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"]


def _event_tags(run: Path, which: int = 0) -> dict[str, list[str]]:
    """The tags of the run's first (``which``: -1, the last) TensorBoard event file, by kind
    (scalars, audio, images)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(run.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {run}"
    acc = EventAccumulator(str(events[which].parent))
    acc.Reload()
    return acc.Tags()


def _prepared_table(config: Path, workdir: Path, tiny_dir: Path) -> torch.Tensor:
    """The fp32 speaker table the data module prepared for ``config`` (its data settings, the
    rehearsal's paths)."""
    from tts_lightning import SpeakerClipsDataModule

    settings = {**(_raw(config).get("data") or {}), "pretrained": str(tiny_dir), "cache_dir": str(workdir / "cache")}
    settings["train_manifest"] = str(workdir / "demo" / "train.jsonl")
    data = SpeakerClipsDataModule(**settings)
    data.setup("fit")
    return data.speaker_embeddings()


def _steps_of(path: Path) -> int:
    return load_training_checkpoint(path).global_step


def _devices(config: Path) -> int:
    return (_raw(config).get("trainer") or {}).get("devices", 1)


def rehearse(config: Path, workdir: Path, tiny_dir: Path, run_cli) -> None:
    """Fit, resume and validate ``config``, asserting on each as it ends."""
    run = workdir / config.stem
    common = ["--config", config, *overrides(config, workdir, tiny_dir, run)]
    fitted = run_cli("fit", *common, "--trainer.max_steps", STEPS, cwd=workdir)
    output = fitted.stdout + fitted.stderr
    last = run / "checkpoints" / "last.ckpt"
    assert last.exists(), output[-3000:]
    assert _steps_of(last) == STEPS
    if _accumulate(config) > 1:  # each optimizer step summed several micro-batches' gradients
        assert _micro_batches(last) >= 2 * STEPS, _micro_batches(last)
    monitor = (_raw(config).get("checkpoint") or {}).get("monitor", "val/loss")
    kept = [c for c in (run / "checkpoints").iterdir() if c.name != "last.ckpt" and not c.name.startswith(".")]
    assert kept, f"no checkpoint kept by {monitor}: {output[-3000:]}"
    if _has_samples(config):
        tags = _event_tags(run)
        assert any(t.startswith("samples/") for t in tags["audio"]), tags
        assert any(t.startswith("baseline_samples/") for t in tags["audio"]), tags
        assert "val/speaker_similarity" in tags["scalars"], tags["scalars"]
        assert any(t.startswith("spectrograms_vs_real/") for t in tags["images"]), tags["images"]

    # The speaker table the run saves (and export writes) is the prepared fp32 one, bit for bit, also
    # through bf16-mixed (FSDP1's root would cast the batch's embeddings to bf16).
    saved = load_training_checkpoint(last, keys=["speaker_embeddings"]).state_dict["speaker_embeddings"]
    assert saved.dtype == torch.float32 and torch.equal(saved, _prepared_table(config, workdir, tiny_dir))

    resumed = run_cli("fit", *common, "--trainer.max_steps", STEPS + 1, "--ckpt_path", "last", cwd=workdir)
    assert "Restoring states from the checkpoint path" in resumed.stdout + resumed.stderr
    assert _steps_of(last) == STEPS + 1
    if _has_samples(config):  # the resumed run keeps its checkpoint's baseline: no second round
        tags = _event_tags(run, which=-1)
        assert not [t for t in tags["audio"] + tags["scalars"] if t.startswith("baseline")], tags

    validated = run_cli("validate", *common, "--ckpt_path", last, cwd=workdir)
    assert re.search(r"val/loss\s*│\s*\d+\.\d+", validated.stdout), validated.stdout[-3000:]


@pytest.fixture(scope="module")
def one_process_rehearsals(request, workdir, tiny_dir, run_cli):
    """{config: the Future of its `rehearse`} for the session's one-process configs, started on first
    use, two at a time."""
    selected = [
        item.callspec.params["config"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    futures: dict[Path, Future] = {}
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="rehearse") as pool:
        for config in selected:
            if _devices(config) == 1:
                futures[config] = pool.submit(rehearse, config, workdir, tiny_dir, run_cli)
        yield futures
        for future in futures.values():  # a test cut short (-x, ^C): no run outlives the module
            future.cancel()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_shipped_config_fits_resumes_and_validates(config, workdir, tiny_dir, run_cli, one_process_rehearsals):
    if config in one_process_rehearsals:
        one_process_rehearsals[config].result()  # its failure, raised here
        return
    for future in one_process_rehearsals.values():  # this config's processes take both cores
        future.exception()
    rehearse(config, workdir, tiny_dir, run_cli)
