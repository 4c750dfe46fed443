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


def _launch(argv, *, timeout: float, cwd=None, check=True, pythonpath=()) -> subprocess.CompletedProcess:
    """Run a command in its own session (Lightning spawns its other ranks from it); on timeout (a
    deadlock) the whole process group is killed and the test fails."""
    import os
    import signal

    path = os.pathsep.join([str(REPO), *map(str, pythonpath)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.Popen(
        [sys.executable, *map(str, argv)],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"no exit after {timeout} s (deadlock?)\n{stdout[-3000:]}\n{stderr[-5000:]}")
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{stdout[-4000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="session")
def run_script():
    """run_script(script, *args, timeout, cwd=None) -> output: one launcher for multi-process tests."""

    def run(script, *args, timeout: float, cwd=None) -> str:
        proc = _launch([script, *args], timeout=timeout, cwd=cwd)
        return proc.stdout + proc.stderr

    return run


@pytest.fixture(scope="session")
def run_cli():
    """run_cli(*args, cwd, timeout=900, check=True, pythonpath=()) -> CompletedProcess: the
    `tts-lightning` command (``python -m tts_lightning``) through the same launcher; ``pythonpath``
    adds folders (e.g. the test's own, for callbacks named in ``--trainer.callbacks``)."""

    def run(*args, cwd, timeout: float = 900, check: bool = True, pythonpath=()) -> subprocess.CompletedProcess:
        return _launch(["-m", "tts_lightning", *args], timeout=timeout, cwd=cwd, check=check, pythonpath=pythonpath)

    return run
