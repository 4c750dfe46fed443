"""`tts-lightning ray-fit` on a local Ray cluster (CPU, 2 workers, tiny model): a worker crash under
FSDP2 resumed from the last reported checkpoint, ending with the weights of the uninterrupted run
(`fsdp1_reference`, a plain `fit` of the same config and data, tests/distributed/conftest.py); and
the same crash under FSDP1 without retries failing cleanly, its checkpoint intact and exported for
qwen_tts."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from tiny_runs import REFERENCE_EVERY, REFERENCE_STEPS, data_args, newest_last

from tts_lightning.__main__ import main
from tts_lightning.data.demo import demo_dir
from tts_lightning.distributed import ray_cli
from tts_lightning.model.checkpoint import load_training_checkpoint

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONFIG = REPO / "configs" / "tiny-cpu.yaml"  # FSDP1
FSDP2_CONFIG = REPO / "configs" / "tiny-cpu-fsdp2.yaml"  # the same run with FSDP2
MAX_STEPS, EVERY, CRASH_AT = 8, 3, 5  # checkpoints at 3, 6, 8; rank 1 dies before step 6 runs
VALIDATE_EVERY = 4
# The uninterrupted run to compare with trains the same steps, validating at the same steps.
assert (MAX_STEPS, VALIDATE_EVERY) == (REFERENCE_STEPS, REFERENCE_EVERY)
needs_ray = pytest.mark.skipif(ray_cli.ray_missing() is not None, reason="needs the ray extra")


def ray_fit(run_cli, workdir, tiny_dir, run, *extra, callbacks=(), config=CONFIG, timeout=900):
    """`tts-lightning ray-fit` in a process of its own (its own local Ray cluster; Ray starts the
    workers), through the shared launcher (tests/conftest.py): on a timeout its whole process group
    is killed.
    The output is also kept in ``<workdir>/<run>.log``."""
    extra_config = workdir / f"{run}.yaml"
    extra_config.write_text(json.dumps({"trainer": {"callbacks": list(callbacks)}}))  # JSON is YAML
    args = [
        "ray-fit",
        "--config",
        config,
        "--config",
        extra_config,
        *data_args(workdir, tiny_dir),
        "--trainer.default_root_dir",
        workdir / run,
        "--trainer.max_steps",
        MAX_STEPS,
        "--trainer.val_check_interval",
        VALIDATE_EVERY,
        "--ray.num_workers",
        2,
        "--ray.checkpoint_every_n_steps",
        EVERY,
        "--ray.name",
        run,
        *extra,
    ]
    # The workers import ray_test_callbacks from this folder; RAY_DEDUP_LOGS=0 keeps every rank's lines.
    proc = run_cli(*args, cwd=workdir, timeout=timeout, check=False, pythonpath=[HERE], env={"RAY_DEDUP_LOGS": "0"})
    log = proc.stdout + proc.stderr
    (workdir / f"{run}.log").write_text(log)
    return proc, log


def record(path):
    return {"class_path": "ray_test_callbacks.RecordSteps", "init_args": {"path": str(path)}}


def crash(marker):
    return {
        "class_path": "ray_test_callbacks.CrashOnce",
        "init_args": {"step": CRASH_AT, "marker": str(marker), "rank": 1},
    }


def attempts(steps_file):
    """The RecordSteps lines, split per fit attempt: [(start step, [(step, batch hash), ...])]."""
    runs = []
    for line in Path(steps_file).read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "start":
            runs.append((e["step"], []))
        else:
            runs[-1][1].append((e["step"], e["batch"]))
    return runs


def checkpoint_of(run_dir, step):
    return run_dir / "ray" / run_dir.name / f"checkpoint_step{step:06d}" / "checkpoint.ckpt"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    shutil.copytree(demo_dir(), root / "demo")
    return root


@needs_ray
def test_worker_crash_resumes_from_the_last_checkpoint(run_cli, fsdp1_reference, workdir, tiny_dir):
    """Under FSDP2 (RayQwen3TTSFSDP2Strategy), while the `failed` run below and the README's
    `ray-fit` train FSDP1: one launch covers FSDP2's Ray run, its DCP shards merged into the
    reported checkpoint and the resume from it."""
    marker, steps_file = workdir / "crashed.marker", workdir / "resumed.jsonl"
    proc, log = ray_fit(
        run_cli,
        workdir,
        tiny_dir,
        "resumed",
        "--ray.max_failures",
        1,
        callbacks=[crash(marker), record(steps_file)],
        config=FSDP2_CONFIG,
    )
    assert proc.returncode == 0, log[-8000:]
    assert marker.is_file() and f"rank 1 exits at global_step {CRASH_AT}" in log
    run_dir = workdir / "resumed"
    assert re.search(r"resuming from \S+checkpoint_step000003", log)
    # FSDP2 in both attempts, on both ranks (four worker processes; Ray may echo a line twice):
    # each holds half of the parameters.
    held = re.findall(
        r"pid=(\d+)\S* \[rank (\d)\] FSDP2 fully_shard: ([\d,]+) of ([\d,]+) parameters held locally", log
    )
    workers = {(pid, rank) for pid, rank, _, _ in held}
    assert len(workers) == 4 and sorted(rank for _, rank in workers) == ["0", "0", "1", "1"], log[-4000:]
    for _, _, local, total in held:
        assert 0.45 < int(local.replace(",", "")) / int(total.replace(",", "")) < 0.55
    assert "FSDP FULL_SHARD:" not in log  # no FSDP1 worker
    for step in (3, 6, 8):  # DCP shards of both ranks merged into each reported checkpoint
        saved = checkpoint_of(run_dir, step)
        assert (saved / ".metadata").is_file() and (saved / "meta.pt").is_file()
        assert sorted(p.name for p in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    first, second = attempts(steps_file)
    assert first[0] == 0 and [s for s, _ in first[1]] == list(range(1, CRASH_AT + 1))
    last_saved = CRASH_AT // EVERY * EVERY
    assert second[0] == last_saved  # not from step 0
    assert [s for s, _ in second[1]] == list(range(last_saved + 1, MAX_STEPS + 1))
    assert second[0] + len(second[1]) == MAX_STEPS  # optimizer steps of the run that counts
    # The data position was restored: the replayed steps saw the same batches.
    assert dict(first[1])[last_saved + 1] == dict(second[1])[last_saved + 1]

    # Step, optimizer, LR schedule and data restored: the weights equal the uninterrupted run's, a
    # plain `fit` (no Ray) of the same config on the same data. That run trained with FSDP1 and
    # this one with FSDP2, on the same batches in fp32: the bound is the one
    # tests/distributed/test_fsdp2.py::test_fsdp2_trains_like_fsdp1 holds FSDP2 to against FSDP1
    # (atol 1e-5, rtol 1e-5); a resume within one strategy is held to 1e-6.
    resumed = load_training_checkpoint(checkpoint_of(run_dir, MAX_STEPS))
    reference = load_training_checkpoint(newest_last(fsdp1_reference[0]))
    assert resumed.global_step == reference.global_step == MAX_STEPS
    assert resumed.state_dict.keys() == reference.state_dict.keys()
    for key, value in reference.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[key], value, atol=1e-5, rtol=1e-5, msg=key)
    # The weights moved, or the comparison proves nothing.
    start = load_training_checkpoint(checkpoint_of(run_dir, last_saved))
    assert not torch.equal(
        start.state_dict["model.talker.codec_head.weight"], resumed.state_dict["model.talker.codec_head.weight"]
    )


@pytest.fixture(scope="module")
def failed(run_cli, workdir, tiny_dir):
    """FSDP1 workers, rank 1 dying before step CRASH_AT + 1 with no retries: (process, output)."""
    marker = workdir / "failed.marker"
    proc, log = ray_fit(
        run_cli,
        workdir,
        tiny_dir,
        "failed",
        "--ray.max_failures",
        0,
        callbacks=[crash(marker), record(workdir / "failed.jsonl")],
    )
    assert marker.is_file()
    return proc, log


@needs_ray
def test_two_fsdp1_workers_train_on_data_prepared_once_and_the_checkpoint_exports(failed, workdir):
    _, log = failed
    held = dict(re.findall(r"\[rank (\d)\] FSDP FULL_SHARD: ([\d,]+) of [\d,]+ parameters held locally", log))
    assert sorted(held) == ["0", "1"], log[-4000:]
    # Prepared once, on the driver; the workers found everything cached.
    driver = [ln for ln in log.splitlines() if "codec cache:" in ln and "RayTrainWorker" not in ln]
    workers = [ln for ln in log.splitlines() if "codec cache:" in ln and "RayTrainWorker" in ln]
    assert driver and re.search(r"codec cache: \d+ clip\(s\) encoded", driver[0])
    assert workers and all("codec cache: 0 clip(s) encoded" in ln for ln in workers), workers
    assert not any(re.search(r"RayTrainWorker.*encoded \d+/\d+ clips", ln) for ln in log.splitlines())

    [(start, steps)] = attempts(workdir / "failed.jsonl")
    assert start == 0 and [s for s, _ in steps] == list(range(1, CRASH_AT + 1))
    saved = checkpoint_of(workdir / "failed", EVERY)  # sharded, merged from both ranks
    assert (saved / ".metadata").is_file()
    assert sorted(p.name for p in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    from qwen_tts import Qwen3TTSModel

    from tts_lightning.model.export import export_custom_voice

    out = export_custom_voice(saved, workdir / "voice", dtype="fp32")
    model = Qwen3TTSModel.from_pretrained(str(out))
    assert set(model.get_supported_speakers()) == {"alice", "bob"}


@needs_ray
def test_worker_crash_without_retries_fails_and_keeps_the_checkpoint(failed, workdir):
    proc, _ = failed
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-8000:]
    assert "tts-lightning ray-fit: error: training failed (max_failures=0): WorkerGroupError" in proc.stderr
    assert "Rank 1" in proc.stderr and "died" in proc.stderr  # names the worker that failed
    last = checkpoint_of(workdir / "failed", EVERY)
    assert f"latest checkpoint: {last}" in proc.stderr
    assert not checkpoint_of(workdir / "failed", 2 * EVERY).exists()
    checkpoint = load_training_checkpoint(last)
    assert checkpoint.global_step == EVERY and any(k.startswith("model.talker.") for k in checkpoint.state_dict)


def test_without_ray_the_command_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as when it is not installed
    assert main(["ray-fit", "--config", str(CONFIG), "--ray.num_workers", "2"]) == 2
    assert capsys.readouterr().err == (
        "tts-lightning ray-fit: error: Ray is not installed. Install it with: pip install 'tts-lightning[ray]'\n"
    )


def test_help_names_the_ray_options_and_what_they_replace(capsys):
    with pytest.raises(SystemExit) as exit_:
        ray_cli.ray_fit_command(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--ray.address",
        "--ray.num_workers",
        "--ray.use_gpu",
        "--ray.resources_per_worker",
        "--ray.max_failures",
        "--ray.storage_path",
        "--ray.name",
    ):
        assert option in text
    assert "trainer.devices and trainer.num_nodes are replaced" in " ".join(text.split())


@needs_ray
@pytest.mark.parametrize(
    "override, code, needle",
    [
        (["--model.no_such_option", "1"], 2, "no_such_option"),
        (["--data.speakers", "[carol]"], 2, "tts-lightning ray-fit: error: speaker(s) 'carol' are not named by"),
    ],
)
def test_bad_config_fails_on_the_driver_before_ray_starts(workdir, tiny_dir, capsys, override, code, needle):
    import ray

    args = ["--config", str(CONFIG), *map(str, data_args(workdir, tiny_dir, workdir / "bad-cache")), *override]
    try:
        rc = main(["ray-fit", *args])
    except SystemExit as exc:  # LightningCLI's parser error
        rc = exc.code
    assert rc == code
    assert needle in capsys.readouterr().err
    assert not ray.is_initialized()


@needs_ray
@pytest.mark.parametrize(
    "strategy, needle",
    [
        ("ddp", "trainer.strategy='ddp' is not supported"),
        (
            '{"class_path": "lightning.pytorch.strategies.DDPStrategy"}',
            "trainer.strategy lightning.pytorch.strategies.DDPStrategy is not supported",
        ),
    ],
    ids=["name", "class_path"],
)
def test_a_strategy_other_than_fsdp1_or_fsdp2_is_refused_before_ray_starts(
    workdir, tiny_dir, tmp_path, capsys, strategy, needle
):
    import ray

    cache = tmp_path / "cache"
    args = ["--config", str(CONFIG), *map(str, data_args(workdir, tiny_dir, cache)), "--trainer.strategy", strategy]
    assert main(["ray-fit", *args]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "tts-lightning ray-fit: error: ray-fit trains with FSDP1 or FSDP2;" in err and needle in err
    assert "tts_lightning.distributed.fsdp2.Qwen3TTSFSDP2Strategy (FSDP2)" in err  # says what works
    assert not ray.is_initialized() and not cache.exists()  # before Ray and before the data


def test_unknown_ray_option_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        ray_cli.ray_fit_command(["--config", str(CONFIG), "--ray.num_wrkers", "2"])
    assert exit_.value.code == 2 and "--ray.num_wrkers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "options, needle",
    [
        (['{"GPU": 1}'], 'asks for "GPU" without --ray.use_gpu: add --ray.use_gpu'),
        # NCCL refuses two ranks on one GPU; Lightning's Ray environment gives a worker one device.
        (['{"GPU": 0.5}', "--ray.use_gpu"], '"GPU": 0.5: each worker trains on exactly one GPU'),
        (['{"CPU": 4, "GPU": 2}', "--ray.use_gpu"], '"GPU": 2: each worker trains on exactly one GPU'),
    ],
)
def test_gpu_resources_other_than_one_per_gpu_worker_are_refused_before_anything_runs(capsys, options, needle):
    with pytest.raises(SystemExit) as exit_:
        ray_cli.ray_fit_command(["--config", "no-such.yaml", "--ray.resources_per_worker", *options])
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


def test_the_driver_finds_the_folders_a_node_lacks(tmp_path):
    """Before training, a task on every alive node checks the folders the workers need (the working
    directory, data.cache_dir, a local --ray.storage_path); on this one-node cluster the one that is
    not there is named, and the node's address with it."""
    import signal

    import ray

    from tts_lightning.distributed.ray import folders_missing_on_nodes

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        lacking = folders_missing_on_nodes({"here": str(tmp_path), "gone": str(tmp_path / "gone")})
        (address,) = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    finally:
        ray.shutdown()
        for s, handler in handlers.items():
            signal.signal(s, handler)  # Ray's own would stay in this test worker
    assert lacking == {address: ["gone"]}
