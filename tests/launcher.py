"""How the tests start `tts-lightning` commands and scripts in processes of their own (the `run_cli`
and `run_script` fixtures of conftest.py).

- A Lightning command on several CPU processes starts them all at once, each told its rank as
  torchrun or a cluster scheduler does (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``),
  instead of Lightning's launcher starting rank 1 only when rank 0 reaches ``fit``.
- Those ranks, the tools, ``ray-fit``'s driver and scripts are forked from warm interpreters
  (tests/zygote.py, one per rank) that have already imported Lightning and qwen_tts: ~12 s of CPU
  saved per process. Ray starts its workers itself, in fresh interpreters.
`make demo`'s commands (tests/conftest.py, `demo_workspace`) run as a user types them, in fresh
interpreters, with Lightning's own launcher.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import yaml

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


def demo_commands() -> list[str]:
    """The `tts-lightning` commands `make demo` runs, as make prints them (the install step excluded)."""
    printed = subprocess.run(["make", "-n", "-B", "demo"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    lines = re.sub(r"\\\n\s*", " ", printed).splitlines()
    return [line for line in lines if "bin/tts-lightning " in line]


def cli_ranks(args, cwd=None) -> int | None:
    """How many processes a `tts-lightning` command runs as, when this launcher can start them all: 1
    for a tool or ``ray-fit`` (its driver; Ray starts the workers), the trainer's ``devices`` (its
    ``--config`` files, then ``--trainer.devices``) for a Lightning command on CPU. None otherwise:
    Lightning starts the processes (run it in a fresh interpreter, as typed)."""
    args = [str(a) for a in args]
    if not args:
        return None
    if args[0] not in LIGHTNING_COMMANDS:
        return 1
    trainer: dict = {}
    for flag, value in zip(args, args[1:]):
        if flag == "--config":
            config = yaml.safe_load((Path(cwd or ".") / value).read_text()) or {}
            trainer.update(config.get("trainer") or {})
        elif flag.startswith("--trainer.") and "." not in flag[len("--trainer.") :]:
            trainer[flag[len("--trainer.") :]] = yaml.safe_load(value)
    devices = trainer.get("devices", 1)
    return devices if trainer.get("accelerator") == "cpu" and isinstance(devices, int) else None


class Zygote:
    """tests/zygote.py, started on first use and stopped by `close`. Threads may fork from it at once
    (tests/test_shipped_configs.py runs two one-process commands side by side): one request and its
    answer at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._ready = False
        self._lock = threading.RLock()

    def start(self) -> None:
        """Start it (not waiting for its imports) unless it runs."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:  # a dead one: close its pipes and log before replacing it
                for stream in (self._proc.stdin, self._proc.stdout, self._log):
                    with contextlib.suppress(OSError):
                        stream.close()
            # Its own output (import-time noise, a crash) goes to a file, shown if it fails to start.
            self._log = tempfile.NamedTemporaryFile("w+", prefix="zygote-", suffix=".log")
            self._proc = subprocess.Popen(
                [sys.executable, str(TESTS / "zygote.py")],
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                text=True,
                start_new_session=True,
            )
            self._ready = False

    def fork(self, argv: list[str], env: dict[str, str], cwd, stdout: str, stderr: str, disk=None) -> Forked:
        with self._lock:
            return self._fork(argv, env, cwd, stdout, stderr, disk)

    def _fork(self, argv: list[str], env: dict[str, str], cwd, stdout: str, stderr: str, disk) -> Forked:
        request = {"argv": argv, "env": env, "cwd": str(cwd or os.getcwd()), "stdout": stdout, "stderr": stderr}
        if disk is not None:  # (folder, mount point): this process's own disk at that path (zygote.own_disk)
            request["disk"] = [str(disk[0]), str(disk[1])]
        for attempt in range(3):
            answer = self._request(request)
            if answer and answer.isdigit():
                assert self._proc is not None
                return Forked(int(answer), stdout + ".exit", self._proc)
            if answer == "":  # it read the request and died: the command may run, so never send it twice
                log = Path(self._log.name).read_text()[-5000:]
                raise AssertionError(f"tests/zygote.py died while forking {argv[:3]} (not retried)\n{log}")
            # The fork failed (the zygote says why) or the zygote was dead before the request: both
            # seen when the machine ran short of memory. Say so, start a fresh zygote if needed, retry.
            log = Path(self._log.name).read_text()[-2000:]
            warnings.warn(f"tests/zygote.py could not fork ({answer or 'it was dead'}); retrying\n{log}", stacklevel=3)
            if attempt < 2:
                time.sleep(5 * (attempt + 1))
        log = Path(self._log.name).read_text()[-5000:]
        raise AssertionError(f"tests/zygote.py could not fork {argv[:3]}: {answer or 'it was dead'}\n{log}")

    def _request(self, request: dict) -> str | None:
        """Send one request; its answer line: a pid, ``error ...``, "" when the zygote died after
        reading it, None when it never got it (dead before)."""
        self._start()
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        if not self._ready:
            if self._proc.stdout.readline().strip() != "ready":
                self._proc.wait()  # it died starting: the next `_start` replaces it
                return None
            self._ready = True
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._proc.wait()
            return None
        return self._proc.stdout.readline().strip()

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
            self._log.close()


class Zygotes:
    """One `Zygote` per rank: ranks forked from one interpreter would share its string-hash seed, so
    a set iterated in a different order on each rank (a classic collective mismatch) would go unseen."""

    def __init__(self) -> None:
        self._zygotes: list[Zygote] = []
        self._lock = threading.Lock()

    def for_ranks(self, ranks: int) -> list[Zygote]:
        """The first ``ranks`` zygotes, all started (their imports run side by side)."""
        with self._lock:
            while len(self._zygotes) < ranks:
                self._zygotes.append(Zygote())
            zygotes = self._zygotes[:ranks]
        for zygote in zygotes:
            zygote.start()
        return zygotes

    def close(self) -> None:
        for zygote in self._zygotes:
            zygote.close()


class Forked:
    """A command the zygote forked: not our child, so its exit status comes through a file."""

    def __init__(self, pid: int, exit_file: str, zygote: subprocess.Popen) -> None:
        self.pid, self._exit_file, self._zygote, self.returncode = pid, exit_file, zygote, None
        self.lost = False  # no exit status will come: its zygote died

    def poll(self) -> int | None:
        if self.returncode is None and not os.path.exists(self._exit_file) and self._zygote.poll() is not None:
            if not os.path.exists(self._exit_file):  # it may have written it just before it died
                # Its zygote died: nobody records this command's status. Stop the orphan (its own
                # session, so its group) rather than let it run on unseen.
                self.lost, self.returncode = True, -signal.SIGKILL
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, signal.SIGKILL)
        if self.returncode is None and os.path.exists(self._exit_file):
            self.returncode = int(Path(self._exit_file).read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.1)
        return self.returncode  # type: ignore[return-value]


def launch(
    argv,
    *,
    timeout: float,
    cwd=None,
    check=True,
    pythonpath=(),
    env=None,
    ranks: int = 1,
    zygotes: Zygotes | None = None,
    node_disks: list | None = None,
    slurm_job: str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python <argv>`` (with ``zygotes``: each rank forked from its own zygote) as ``ranks``
    processes started at once, each in its own session; on timeout (a deadlock) every process
    group is killed and the test fails. ``env`` adds variables.
    ``node_disks``: the ranks as that many nodes of ``ranks / len(node_disks)`` each (``NODE_RANK``,
    ``LOCAL_RANK`` as a cluster sets them), node k seeing ``node_disks[k]`` at ``cwd`` (a mount
    namespace per process, zygotes only): the same paths name each node's own storage, as on
    machines with disks of their own.
    ``slurm_job``: each rank also gets the variables SLURM's ``srun`` sets for a task of that job (one
    node), so Lightning takes the run for a SLURM job (its `SLURMEnvironment`, auto-requeue on).
    The outputs are joined in rank order; the exit status is the first non-zero."""
    path = os.pathsep.join([str(REPO), *map(str, pythonpath)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}
    if slurm_job is None:  # a suite run inside a SLURM job: Lightning would take every run for one of its tasks
        env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    per_node = ranks // len(node_disks) if node_disks else ranks
    disks = [(node_disks[r // per_node], cwd) if node_disks else None for r in range(ranks)]
    assert not node_disks or zygotes is not None, "node-local disks need the zygotes"
    if ranks > 1:
        cluster = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(ranks)}
        envs = [
            {**env, **cluster, "NODE_RANK": str(r // per_node), "LOCAL_RANK": str(r % per_node)} for r in range(ranks)
        ]
    else:
        envs = [env]
    if slurm_job is not None:
        for rank, e in enumerate(envs):
            e.update(SLURM_JOB_ID=slurm_job, SLURM_JOB_NAME="tts-lightning", SLURM_NTASKS=str(len(envs)))
            e.update(SLURM_NTASKS_PER_NODE=str(len(envs)), SLURM_NNODES="1", SLURM_NODEID="0")
            e.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODELIST="127.0.0.1")
    argv = [str(a) for a in argv]
    with tempfile.TemporaryDirectory() as logs:
        outputs = [(f"{logs}/{r}.out", f"{logs}/{r}.err") for r in range(len(envs))]
        procs: list[subprocess.Popen | Forked] = []
        forks = zygotes.for_ranks(len(envs)) if zygotes is not None else None
        for rank, (e, (out, err)) in enumerate(zip(envs, outputs)):
            if forks is not None:
                procs.append(forks[rank].fork(argv, e, cwd, out, err, disk=disks[rank]))
            else:
                with open(out, "w") as stdout, open(err, "w") as stderr:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, *argv],
                            cwd=cwd,
                            env=e,
                            stdout=stdout,
                            stderr=stderr,
                            start_new_session=True,
                        )
                    )
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:  # killed ones end at once (bounded: a dead zygote writes no exit file)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                timed_out = True
        stdout, stderr = ("".join(Path(o[i]).read_text() for o in outputs) for i in (0, 1))
    if timed_out:
        raise AssertionError(f"no exit after {timeout} s (deadlock?)\n{stdout[-3000:]}\n{stderr[-5000:]}")
    lost = [rank for rank, p in enumerate(procs) if getattr(p, "lost", False)]
    if lost:
        raise AssertionError(f"ranks {lost} ended with no exit status: their zygote died\n{stderr[-5000:]}")
    returncode = next((p.returncode for p in procs if p.returncode), 0)
    if check and returncode != 0:
        raise AssertionError(f"exit {returncode}\n{stdout[-4000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(argv, returncode, stdout, stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
