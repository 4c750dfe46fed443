import os

# Small machines: torch's default thread pool makes tiny models run at random speeds (0.5-15 s per
# generate call on 2 cores); one thread per process is steady. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """A test that initializes torch.distributed in this process and fails (or forgets) before its
    destroy_process_group() must not hand its group to the next test (as litgpt's conftest does),
    nor the variables Lightning sets for it (MASTER_PORT, WORLD_SIZE, LOCAL_RANK, ...): every later
    `tts-lightning fit` subprocess inherits the environment and would join that one-process world."""
    import os

    environ = dict(os.environ)
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
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


def _launch(
    argv, *, timeout: float, cwd=None, check=True, pythonpath=(), env=None, ranks: int = 1
) -> subprocess.CompletedProcess:
    """Run a command in its own session (Lightning spawns its other ranks from it); on timeout (a
    deadlock) every process group is killed and the test fails. ``env`` adds variables.

    ``ranks`` > 1 starts that many copies of the command at once, each told its rank as torchrun or a
    cluster scheduler does (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), so that
    their imports overlap instead of rank 1 starting only when rank 0 reaches ``fit`` (~10 s per
    run on 2 cores). Their outputs are joined in rank order; the exit status is the first non-zero.
    The README and demo tests keep Lightning's own launcher, as a user types the command."""
    import os
    import signal
    import tempfile

    path = os.pathsep.join([str(REPO), *map(str, pythonpath)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}
    if ranks > 1:
        cluster = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "NODE_RANK": "0"}
        envs = [{**env, **cluster, "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r)} for r in range(ranks)]
    else:
        envs = [env]
    with tempfile.TemporaryDirectory() as logs:
        files = [(open(f"{logs}/{r}.out", "w+"), open(f"{logs}/{r}.err", "w+")) for r in range(len(envs))]
        procs = [
            subprocess.Popen(
                [sys.executable, *map(str, argv)],
                cwd=cwd,
                env=e,
                text=True,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
            for e, (out, err) in zip(envs, files)
        ]
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            timed_out = True
        else:
            timed_out = False
        for proc in procs:
            proc.wait()
        stdout, stderr = ("".join(_read(f[i]) for f in files) for i in (0, 1))
        for out, err in files:
            out.close()
            err.close()
    if timed_out:
        raise AssertionError(f"no exit after {timeout} s (deadlock?)\n{stdout[-3000:]}\n{stderr[-5000:]}")
    returncode = next((p.returncode for p in procs if p.returncode), 0)
    if check and returncode != 0:
        raise AssertionError(f"exit {returncode}\n{stdout[-4000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(procs[0].args, returncode, stdout, stderr)


def _read(file) -> str:
    file.seek(0)
    return file.read()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


def cli_ranks(args, cwd=None) -> int:
    """How many processes a `tts-lightning` command runs as: for a Lightning command on CPU, the
    trainer's ``devices`` (its ``--config`` files, then ``--trainer.devices``); otherwise 1 (the
    tools, ``ray-fit``, whose workers Ray starts, and GPU configs)."""
    import yaml

    args = [str(a) for a in args]
    if not args or args[0] not in LIGHTNING_COMMANDS:
        return 1
    trainer: dict = {}
    for flag, value in zip(args, args[1:]):
        if flag == "--config":
            config = yaml.safe_load((Path(cwd or ".") / value).read_text()) or {}
            trainer.update(config.get("trainer") or {})
        elif flag.startswith("--trainer.") and "." not in flag[len("--trainer.") :]:
            trainer[flag[len("--trainer.") :]] = yaml.safe_load(value)
    devices = trainer.get("devices", 1)
    return devices if trainer.get("accelerator") == "cpu" and isinstance(devices, int) else 1


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
    adds folders (e.g. the test's own, for callbacks named in ``--trainer.callbacks``); ``env`` adds
    environment variables. A Lightning command on several CPU processes starts them all at once
    (`cli_ranks`, `_launch`)."""

    def run(
        *args, cwd, timeout: float = 900, check: bool = True, pythonpath=(), env=None
    ) -> subprocess.CompletedProcess:
        argv = ["-m", "tts_lightning", *args]
        kwargs = dict(timeout=timeout, cwd=cwd, check=check, pythonpath=pythonpath, env=env)
        return _launch(argv, ranks=cli_ranks(args, cwd), **kwargs)

    return run


def make_demo_commands() -> list[str]:
    """The `tts-lightning` commands `make demo` runs, as make prints them (the install step excluded)."""
    import re

    printed = subprocess.run(["make", "-n", "-B", "demo"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    lines = re.sub(r"\\\n\s*", " ", printed).splitlines()
    return [line for line in lines if "bin/tts-lightning " in line]


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

    from tts_lightning.data.demo import demo_dir

    root = tmp_path_factory.mktemp("demo-workspace")
    (root / "configs").symlink_to(REPO / "configs")
    # The package folder itself, as in a checkout: the commands read tts_lightning/demo/, and a
    # script run here imports the same package either way.
    (root / "tts_lightning").symlink_to(demo_dir().parent)
    cli = f"OMP_NUM_THREADS=1 {shlex.quote(sys.executable)} -m tts_lightning "
    outputs = {}
    for command in make_demo_commands():
        name = command.split("bin/tts-lightning ")[1].split()[0]
        command = re.sub(r"^(OMP_NUM_THREADS=1 )?\S*bin/tts-lightning ", cli, command)
        command += DEMO_SHORT_FIT if name == "fit" else ""
        proc = subprocess.run(
            ["bash", "-c", command], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
        )
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-6000:]}"
        outputs[name] = proc.stdout
    return root, outputs
