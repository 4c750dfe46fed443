"""A warm interpreter that forks `python ...` runs for the tests (tests/launcher.py): `tts-lightning`
commands (``-m tts_lightning ...``), other modules, ``-c`` code and scripts.

Every `tts-lightning` process spends ~12 s of CPU importing Lightning (with torchmetrics, transformers,
scipy) and qwen_tts before it does anything, and the multi-process tests start dozens of them.
This process imports those packages once, then for each request read from stdin (one JSON line:
the interpreter's argv, env, cwd, stdout and stderr paths) forks a child that becomes that command:
its own session, environment, working folder and output files, then runs the module (``-m``), the
code (``-c``) or the script as the interpreter would. The project's own modules are imported by the
child, not here. When a child ends, its exit status is written to ``<stdout path>.exit``; its pid
is answered on stdout (``error <reason>`` when the fork itself failed).

The tests fork each rank from a zygote of its own (tests/launcher.py): Python's string hashing is
seeded per interpreter, and ranks that iterate a set in different orders must stay visible.

Only for commands whose processes are all started from outside: the tools, `ray-fit`'s driver (Ray
starts its workers in fresh interpreters), and Lightning commands whose ranks are given
``LOCAL_RANK`` as torchrun does. Lightning's own launcher re-runs ``sys.argv``, so a command that
relies on it runs in a fresh interpreter. What these imports print goes to the zygote's log: a test
of import-time output starts a fresh interpreter of its own.
"""

import atexit
import json
import os
import runpy
import signal
import sys
import traceback
from contextlib import redirect_stdout

with redirect_stdout(sys.stderr):  # stdout answers the test: import-time prints go to stderr
    import lightning.pytorch  # noqa: F401  (the imports this process exists for)
    import qwen_tts  # noqa: F401
    import torch  # noqa: F401
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

children: dict[int, str] = {}  # pid -> its exit file


def reap(signum, frame) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)  # the test polls for this file: it must appear whole


def run(argv: list[str]) -> None:
    """``python <argv>``, in this process: ``-m module args``, ``-c code args`` or ``script args``."""
    # sys.path[0] is this file's folder: the interpreter puts the working folder (-m), "" (-c) or
    # the script's folder there, then PYTHONPATH.
    first = {"-m": os.getcwd(), "-c": ""}.get(argv[0])
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0])) if first is None else first
    sys.path[1:1] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file in sys.argv[0]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def own_disk(source: str, target: str) -> None:
    """Give this process a mount namespace of its own in which ``source`` is mounted at ``target``:
    the same path then names another folder for this process than for the others (the tests' node-local
    disks). Needs CAP_SYS_ADMIN (the tests run as root); a forked child is single-threaded, as
    unshare(2) wants."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private, ms_bind = 0x00020000, 1 << 14, 1 << 18, 1 << 12
    steps = (
        lambda: libc.unshare(clone_newns),
        lambda: libc.mount(b"none", b"/", None, ms_rec | ms_private, None),  # our mounts stay ours
        lambda: libc.mount(source.encode(), target.encode(), None, ms_bind, None),
    )
    for step in steps:
        if step() != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"cannot mount {source} at {target} in a namespace of its own: {os.strerror(errno)}")


def become(request: dict) -> None:
    """In the forked child: turn into ``python <argv>`` and exit with its status (never return: the
    child must not go on serving requests)."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command reaps its own children
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        os.setsid()  # the test kills the whole group on a timeout
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        if request.get("disk"):
            own_disk(*request["disk"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # Lightning set this when it was imported, from the environment this process had then.
        rank_zero_only.rank = _get_rank() or 0
        run(request["argv"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        # Python's exit, less the C library's: the imported packages' C++ thread pools (created
        # here, before the fork) would be joined by their destructors and hang the child forever.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    signal.signal(signal.SIGCHLD, reap)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # record the pid before reaping it
        try:
            pid = os.fork()
        except OSError as exc:  # e.g. ENOMEM while the machine is short of memory: say so, keep serving
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            print(f"error {exc}", flush=True)
            continue
        if pid == 0:
            become(request)
        children[pid] = request["stdout"] + ".exit"
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        print(pid, flush=True)


if __name__ == "__main__":
    main()
