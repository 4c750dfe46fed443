"""The `tts-lightning` command: LightningCLI subcommands plus the project's own tools.

This file only routes: each tool's arguments and code live next to its domain (``model/tiny_cli.py``,
``data/prepare_cli.py``, ``model/export_cli.py``, ``model/synthesis_cli.py``, ``distributed/plan_cli.py``,
``distributed/ray_cli.py``, ``evaluation/cli.py``), imported only when its command runs; and it
reports every command's errors in one place: a user error as one message with exit status 2
(`tts_lightning.errors.report_errors`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

from tts_lightning.errors import STOPPED_BY_CTRL_C, STOPPED_BY_SIGTERM, report_errors

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
SUMMARIES = {  # `tts-lightning --help`: each command in a line
    "fit": "fine-tune with a YAML config (LightningCLI; --ckpt_path last resumes)",
    "validate": "the validation loss of a checkpoint (--ckpt_path)",
    "test": "the test loss of a checkpoint (--ckpt_path)",
    "predict": "speak texts with a checkpoint (--ckpt_path)",
    "tiny-model": "build the tiny random-weight Qwen3-TTS directory (demo, tests)",
    "prepare": "check a dataset and cache its codec tokens and speaker embeddings",
    "export": "a checkpoint -> a model directory the official qwen-tts loads",
    "synthesize": "speak texts with an exported model",
    "plan": "will it fit? GPU memory per phase, and what to change",
    "ray-fit": "fit on a Ray cluster",
    "evaluate": "did fine-tuning help? the exported model against zero-shot cloning",
}


def _tiny_model(argv: list[str]) -> int:
    from tts_lightning.model.tiny_cli import tiny_model_command

    return tiny_model_command(argv)


def _synthesize(argv: list[str]) -> int:
    from tts_lightning.model.synthesis_cli import synthesize_command

    return synthesize_command(argv)


def _export(argv: list[str]) -> int:
    from tts_lightning.model.export_cli import export_command

    return export_command(argv)


def _prepare(argv: list[str]) -> int:
    from tts_lightning.data.prepare_cli import prepare_command

    return prepare_command(argv)


def _plan(argv: list[str]) -> int:
    from tts_lightning.distributed.plan_cli import plan_command

    return plan_command(argv)


def _ray_fit(argv: list[str]) -> int:
    from tts_lightning.distributed.ray_cli import ray_fit_command

    return ray_fit_command(argv)


def _evaluate(argv: list[str]) -> int:
    from tts_lightning.evaluation.cli import evaluate_command

    return evaluate_command(argv)


TOOLS = {
    "tiny-model": _tiny_model,
    "prepare": _prepare,
    "export": _export,
    "synthesize": _synthesize,
    "plan": _plan,
    "ray-fit": _ray_fit,
    "evaluate": _evaluate,
}


class _Terminated(BaseException):
    """SIGTERM, raised where the tool is, so that its cleanup runs (Python's default ends the
    process at once: a staged folder or temporary file stayed)."""


def _raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
    raise _Terminated()


_ctrl_c = threading.Event()  # set by `_note_ctrl_c` when Ctrl-C reaches this process


def _note_ctrl_c(signum, frame) -> None:
    _ctrl_c.set()
    signal.default_int_handler(signum, frame)  # Python's own: KeyboardInterrupt


def _stopped_by_ctrl_c(error: BaseException) -> str | None:
    """Whether ``error`` is Ctrl-C or what followed it, as the words to add to the stop line (""
    when none are needed), else None. Lightning exits after its own graceful stop (its SystemExit's
    context), torch's distributed checkpoint code wraps the KeyboardInterrupt of a save or read in
    its CheckpointException (``failures``: rank -> (exception, trace)), and a process waiting in a
    collective when Ctrl-C came sees its stopped peer's closed connection (a RuntimeError) before
    its own KeyboardInterrupt: then only the noted signal tells, and the error is named (it could
    be a bug of the shutdown; ``TTS_LIGHTNING_TRACEBACK=1`` shows its traceback)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, KeyboardInterrupt):
            return ""
        failures = getattr(exc, "failures", None)
        wrapped = failures.values() if isinstance(failures, dict) else ()
        todo += [exc.__cause__, exc.__context__, *(f[0] for f in wrapped if isinstance(f, tuple) and f)]
    if (
        not _ctrl_c.is_set()
        or isinstance(error, SystemExit)
        or os.environ.get("TTS_LIGHTNING_TRACEBACK", "") not in ("", "0")
    ):
        return None
    first_line = (str(error).splitlines() or [""])[0]
    return f" (then {type(error).__name__}: {first_line})"


def _stoppable(command: str, run: Callable[[], int]) -> int:
    """A tool stopped by Ctrl-C or SIGTERM: its cleanup runs, then one line (no traceback) and the
    status a shell gives such a stop (130, 143). What it finished stays; a rerun continues."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        return run()
    except BaseException as stop:
        if isinstance(stop, _Terminated):
            how = "SIGTERM"
        elif (then := _stopped_by_ctrl_c(stop)) is not None:
            how = f"Ctrl-C{then}"
        else:
            raise
        print(f"tts-lightning {command}: stopped by {how}; what it finished is kept", file=sys.stderr)
        return STOPPED_BY_SIGTERM if how == "SIGTERM" else STOPPED_BY_CTRL_C
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    from tts_lightning import console

    console.install()  # known third-party noise off the console (see tts_lightning/console.py)
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    _ctrl_c.clear()
    noting = threading.current_thread() is threading.main_thread()
    noting = noting and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if noting:
        signal.signal(signal.SIGINT, _note_ctrl_c)
    try:
        return _route(argv, from_command_line)
    finally:
        _ctrl_c.clear()
        if noting and signal.getsignal(signal.SIGINT) is _note_ctrl_c:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _route(argv: list[str], from_command_line: bool) -> int:
    if argv and argv[0] in TOOLS:
        return _stoppable(argv[0], lambda: report_errors(argv[0], lambda: TOOLS[argv[0]](argv[1:])))
    if argv and argv[0] in LIGHTNING_COMMANDS:

        def lightning() -> int:
            from lightning.pytorch.utilities.exceptions import SIGTERMException
            from lightning.pytorch.utilities.rank_zero import rank_zero_only

            from tts_lightning.cli import cli_main, forget_the_fit, what_a_stopped_fit_kept

            def stopped(how: str, status: int) -> int:
                kept = "no results were written"
                if argv[0] == "predict":
                    kept = "the files written so far are kept"
                elif argv[0] == "fit":
                    kept = what_a_stopped_fit_kept()
                if getattr(rank_zero_only, "rank", 0) == 0:  # said once, not by every process
                    print(f"tts-lightning {argv[0]}: stopped by {how} before the end; {kept}", file=sys.stderr)
                return status

            forget_the_fit()  # an earlier call's fit in this process (tests, notebooks)
            try:
                # From the command line LightningCLI reads sys.argv itself (given args, it warns that
                # they are meant for calls from Python).
                cli_main(None if from_command_line else argv)
            except SIGTERMException:  # a SystemExit without a status: it would exit 0
                return stopped("SIGTERM", STOPPED_BY_SIGTERM)
            except BaseException as error:
                # Lightning's own stop on Ctrl-C (its graceful shutdown, then sys.exit(1)), Ctrl-C
                # before its Trainer runs (start-up), or an error that followed it (a checkpoint
                # being written or read, a collective): `_stopped_by_ctrl_c`.
                if (then := _stopped_by_ctrl_c(error)) is not None:
                    return stopped(f"Ctrl-C{then}", STOPPED_BY_CTRL_C)
                raise
            return 0

        # In a run of several processes each one that fails says so; Lightning has already
        # stopped the others. An error found before they start is said once.
        return report_errors(argv[0], lightning)
    commands = ", ".join([*LIGHTNING_COMMANDS, *TOOLS])
    if argv[:1] in (["-h"], ["--help"]):
        lines = [f"  {name:<11} {summary}" for name, summary in SUMMARIES.items()]
        print(
            f"usage: tts-lightning {{{commands}}} ...", *lines, "`tts-lightning COMMAND --help`: its options", sep="\n"
        )
        return 0
    print(f"usage: tts-lightning {{{commands}}} ...", file=sys.stderr)
    problem = f"unknown command {argv[0]!r}" if argv else "give a command (tts-lightning --help lists them)"
    print(f"tts-lightning: error: {problem}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
