import os

# Small machines: torch's default thread pool makes tiny models run at random speeds (0.5-15 s per
# generate call on 2 cores); one thread per process is steady. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# `make test` sets this: a test that skips there fails instead, since a skip would pass silently
# (the README installs everything the suite uses). Only what the machine itself rules out may skip:
# the checks of messages a machine without a GPU prints, on a machine with one; the full-disk tests,
# which mount a small tmpfs, where the user is not root.
MAY_SKIP_ONLY = ("the GPU is there", "cannot mount a tmpfs here (needs root)")


def _fail_a_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and os.environ.get("TTS_LIGHTNING_NO_SKIPS") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not reason.removeprefix("Skipped: ").startswith(MAY_SKIP_ONLY):
            report.outcome = "failed"
            report.longrepr = f"skipped under `make test`, where no test may skip: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_a_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):  # a whole module skipped as it is collected
    outcome = yield
    _fail_a_skip(outcome.get_result())


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """A test that initializes torch.distributed in this process and fails (or forgets) before its
    destroy_process_group() must not hand its group to the next test (as litgpt's conftest does),
    nor the variables Lightning sets for it (MASTER_PORT, WORLD_SIZE, LOCAL_RANK, ...): every later
    `tts-lightning fit` subprocess inherits the environment and would join that one-process world."""
    import os

    # A module or session fixture's changes come before this snapshot: drop what seed_everything
    # leaves (later fits would re-seed from it: Lightning's reset_seed), so no test inherits it.
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        os.environ.pop(name, None)
    environ = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if dict(os.environ) != environ:  # untouched, it stays so: threads of a module may be reading it
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tts_lightning import build_tiny_pretrained

    return build_tiny_pretrained(tmp_path_factory.mktemp("tiny") / "base", seed=0)


@pytest.fixture(scope="session")
def tiny_custom_voice_dir(tmp_path_factory):
    from tts_lightning import build_tiny_pretrained

    return build_tiny_pretrained(tmp_path_factory.mktemp("tiny") / "custom_voice", seed=0, model_type="custom_voice")


# The demo speakers prepared once for the whole session, with the settings of configs/tiny-cpu.yaml,
# so that multi-process runs reuse the same cache instead of encoding again.
@pytest.fixture(scope="session")
def demo_data(tmp_path_factory, tiny_dir):
    from tts_lightning import SpeakerClipsDataModule
    from tts_lightning.data.demo import demo_dir

    root = tmp_path_factory.mktemp("samples")
    shutil.copytree(demo_dir(), root / "demo", ignore=shutil.ignore_patterns(".*"))
    manifest, cache = root / "demo" / "train.jsonl", root / "cache"
    SpeakerClipsDataModule(
        str(tiny_dir), str(manifest), val_fraction=0.15, cache_dir=str(cache), seed=0, max_frames_per_batch=150
    ).prepare()
    return root, manifest, cache


HELD_OUT = "dave"


# Held-out clips for `evaluate --held-out` and the samples callback's held_out: a speaker no run trains on.
@pytest.fixture(scope="session")
def held_out_manifest(tmp_path_factory):
    """Two clips of "dave", a voice not in the demo data: two of bob's sentences sped up by 1.25
    (pitch and pace up a third; resampled, then read at the original rate), in a Qwen3-TTS JSONL."""
    import json

    import soundfile as sf
    import torch
    import torchaudio.functional as AF

    from tts_lightning.data.demo import demo_dir

    root = tmp_path_factory.mktemp("held_out")
    lines = []
    for i in range(2):
        clip = demo_dir() / "clips" / "bob" / f"bob_{i:03d}"
        wav, sr = sf.read(clip.with_suffix(".flac"), dtype="float32")
        faster = AF.resample(torch.from_numpy(wav), sr, sr * 4 // 5).numpy()
        sf.write(root / f"{HELD_OUT}_{i:03d}.wav", faster, sr)
        text = clip.with_suffix(".txt").read_text().strip()
        lines.append({"audio": f"{HELD_OUT}_{i:03d}.wav", "text": text, "speaker": HELD_OUT, "language": "english"})
    manifest = root / "held_out.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return manifest


@pytest.fixture
def make_datamodule(tiny_dir, demo_data):
    """make_datamodule(**kwargs): a SpeakerClipsDataModule on the prepared demo data."""
    from tts_lightning import SpeakerClipsDataModule

    _, manifest, cache = demo_data

    def make(**kwargs):
        kwargs.setdefault("max_frames_per_batch", 150)
        return SpeakerClipsDataModule(
            str(tiny_dir), str(manifest), val_fraction=0.15, cache_dir=str(cache), seed=0, **kwargs
        )

    return make


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def zygotes():
    """The warm interpreters the session's commands and scripts are forked from (tests/launcher.py)."""
    from launcher import Zygotes

    warm = Zygotes()
    yield warm
    warm.close()


@pytest.fixture(scope="session")
def run_script(zygotes):
    """run_script(script, *args, timeout, cwd=None, ranks=1, check=True, env=None) -> CompletedProcess:
    a script (or ``"-m", module`` or ``"-c", code``, as the interpreter takes them) as ``ranks``
    processes of its own (tests/launcher.py), forked from warm interpreters; ``env`` adds variables."""
    from launcher import launch

    def run(
        script, *args, timeout: float, cwd=None, ranks: int = 1, check: bool = True, env=None
    ) -> subprocess.CompletedProcess:
        return launch([script, *args], timeout=timeout, cwd=cwd, check=check, ranks=ranks, env=env, zygotes=zygotes)

    return run


@pytest.fixture(scope="session")
def run_cli(zygotes):
    """run_cli(*args, cwd, timeout=900, check=True, pythonpath=(), env=None, slurm_job=None) -> CompletedProcess: the
    `tts-lightning` command, as many processes as it runs on, started by tests/launcher.py (forked
    from a warm interpreter where it can be); ``pythonpath`` adds folders (e.g. the test's own, for
    callbacks named in ``--trainer.callbacks``); ``env`` adds environment variables; ``slurm_job``:
    the processes as the tasks of a SLURM job (tests/launcher.py)."""
    from launcher import cli_ranks, launch

    def run(
        *args, cwd, timeout: float = 900, check: bool = True, pythonpath=(), env=None, slurm_job=None
    ) -> subprocess.CompletedProcess:
        kwargs = dict(timeout=timeout, cwd=cwd, check=check, pythonpath=pythonpath, env=env, slurm_job=slurm_job)
        ranks = cli_ranks(args, cwd)
        if ranks is None:  # Lightning starts the other processes: a fresh interpreter, as typed
            return launch(["-m", "tts_lightning", *args], **kwargs)
        return launch(["-m", "tts_lightning", *args], ranks=ranks, zygotes=zygotes, **kwargs)

    return run


# The fit of `make demo`, shortened: what the console and README tests check needs 4 steps.
DEMO_SHORT_FIT = " --trainer.max_steps 4 --trainer.val_check_interval 2"


@pytest.fixture(scope="session")
def demo_workspace(tmp_path_factory):
    """A scratch folder laid out like the repository (configs/, the package's demo clips) in which
    `make demo`'s four commands ran once, in order, with the fit shortened (DEMO_SHORT_FIT): the
    README tests go on from there and the console tests read what each command printed.
    Returns (folder, {command name: stdout and stderr interleaved})."""
    import re
    import shlex

    from launcher import demo_commands

    from tts_lightning.data.demo import demo_dir

    root = tmp_path_factory.mktemp("demo-workspace")
    (root / "configs").symlink_to(REPO / "configs")
    # The package folder itself, as in a checkout: the commands read tts_lightning/demo/, and a
    # script run here imports the same package either way.
    (root / "tts_lightning").symlink_to(demo_dir().parent)
    cli = f"{shlex.quote(sys.executable)} -m tts_lightning "
    outputs = {}
    for command in demo_commands():
        name = command.split("bin/tts-lightning ")[1].split()[0]
        # This interpreter instead of .venv/bin/tts-lightning; make's environment (CPU_ENV) stays.
        command = re.sub(r"\S*bin/tts-lightning ", cli, command, count=1)
        command += DEMO_SHORT_FIT if name == "fit" else ""
        proc = subprocess.run(
            ["bash", "-c", command], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
        )
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-6000:]}"
        outputs[name] = proc.stdout
    return root, outputs
