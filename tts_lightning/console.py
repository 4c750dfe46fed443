"""A quiet console: known third-party noise filtered at its source, nothing of ours hidden.

`install()` is called by the `tts-lightning` entry points (not on `import tts_lightning`, so a
notebook or a user's script keeps every message). Each filter names the exact message and the
module that emits it:

- qwen_tts prints a flash-attn banner on import, and the `sox` package it imports runs `sox -h`
  through a shell (``/bin/sh: 1: sox: not found``) and logs "SoX could not be found!" (SoX is not
  used here). The import of ``qwen_tts`` alone runs with its output captured; those two exact texts
  are dropped and anything else it printed is passed on.
- transformers logs "Setting `pad_token_id` to `eos_token_id` ..." on every `generate` call.
- Lightning's pytree helper triggers torch's "`isinstance(treespec, LeafSpec)` is deprecated" on
  every step; Lightning advertises litlogger in a "Tip" line.
- torchao (imported by transformers) logs two pytree-registration deprecations on import.
- torch's FSDP state-dict and checkpoint code warn about ``_get_pg_default_device`` and
  ShardedTensor deprecations on every sharded checkpoint.
- peft asks for transformers >= 5.6, which qwen-tts (pinned to 4.57.3) rules out; Lightning warns
  that an epoch has fewer batches than ``log_every_n_steps``, though it counts steps over the run.

This module imports nothing heavy: installing it costs nothing on `tts-lightning --help`.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import io
import logging
import os
import sys
import tempfile
import threading
import warnings
from typing import Any

FLASH_ATTN_BANNER = (
    "\n********\nWarning: flash-attn is not installed. Will only run the manual PyTorch version. "
    "Please install flash-attn for faster inference.\n********\n \n"
)
SOX_SHELL_LINE = "/bin/sh: 1: sox: not found\n"
SOX_WARNING = """SoX could not be found!

    If you do not have SoX, proceed here:
     - - - http://sox.sourceforge.net/ - - -

    If you do (or think that you should) have SoX, double-check your
    path variables.
    \n"""
KNOWN_IMPORT_NOISE = (FLASH_ATTN_BANNER, SOX_SHELL_LINE, SOX_WARNING)

# (message regex, module regex) of warnings dropped.
WARNING_FILTERS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree"),
    (r"`_get_pg_default_device` will be deprecated", r"torch\.distributed\.fsdp\._shard_utils"),
    (r"Multiple backends are registered with this ProcessGroup", r"torch\.distributed\.fsdp\._shard_utils"),
    (
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        r"torch\.distributed\.fsdp\._state_dict_utils",
    ),
    # Reading and writing the lean FSDP1 checkpoints (tts_lightning.distributed.lean_state), whose
    # ShardedTensors carry the parameters' own shapes (DTensor cannot hold FSDP1's uneven pieces).
    (
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        r"torch\.distributed\.checkpoint\.(planner_helpers|default_planner|_sharded_tensor_utils|utils)",
    ),
    # Every FSDP2 step: a decoder layer returns a view. Nothing modifies it in place (the 2-rank test
    # gets FSDP1's gradients and weights to 1e-5), so the warning says nothing about this model.
    (r"FSDP2-wrapped module \(.*\) returned a view tensor", r"torch\.distributed\.fsdp\._fully_shard\._fsdp_state"),
    # qwen-tts pins transformers 4.57.3: a user cannot act on peft's advice to upgrade.
    (r"Support for Transformers < 5\.6 is deprecated in PEFT", r"peft\.import_utils"),
    # Lightning counts log_every_n_steps over the whole run, not per epoch: a short epoch still logs.
    (
        r"The number of training batches \(\d+\) is smaller than the logging interval",
        r"lightning\.pytorch\.loops\.fit_loop",
    ),
)
# logger name -> message prefixes dropped.
LOG_FILTERS = {
    "transformers.generation.utils": ("Setting `pad_token_id` to `eos_token_id`",),
    "lightning.pytorch.utilities.rank_zero": ("💡 Tip: For seamless cloud",),
    # torchao 0.18 registers two of its enums as pytree constants on import (transformers imports it).
    "torch.utils._pytree": (
        "<enum 'KernelPreference'> is an Enum subclass and is now natively supported",
        "<enum 'ScaleCalculationMode'> is an Enum subclass and is now natively supported",
    ),
}
QUIET_IMPORTS = ("qwen_tts",)

_installed = False
_lock = threading.Lock()


class _PrefixFilter(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to hide
            return True
        return not message.startswith(self.prefixes)


def drop_known_noise(text: str) -> str:
    """``text`` without the known import-time banners (exact texts only)."""
    for noise in KNOWN_IMPORT_NOISE:
        text = text.replace(noise, "")
    return text


@contextlib.contextmanager
def quiet_output():
    """Capture what the body prints, at the Python level and at the file-descriptor level (child
    processes); afterwards pass on everything but the known banners (all of it when the body
    raised)."""
    streams = [(sys.stdout, 1), (sys.stderr, 2)]
    for stream, _ in streams:
        with contextlib.suppress(Exception):
            stream.flush()
    saved, captures = [], []
    try:
        for _, fd in streams:
            capture = tempfile.TemporaryFile(mode="w+b")
            saved.append(os.dup(fd))
            captures.append(capture)
            os.dup2(capture.fileno(), fd)
    except OSError:  # no usable file descriptors (an embedded interpreter): capture nothing
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        saved, captures = [], []
    py_out, py_err = io.StringIO(), io.StringIO()
    failed = False
    try:
        with contextlib.redirect_stdout(py_out), contextlib.redirect_stderr(py_err):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        fd_texts = []
        for (_, fd), copy, capture in zip(streams, saved, captures):
            os.dup2(copy, fd)
            os.close(copy)
            capture.seek(0)
            fd_texts.append(capture.read().decode("utf-8", "replace"))
            capture.close()
        keep = (lambda t: t) if failed else drop_known_noise
        for i, (stream, _) in enumerate(streams):
            text = keep((fd_texts[i] if fd_texts else "") + (py_out if i == 0 else py_err).getvalue())
            if text.strip():
                stream.write(text)
                stream.flush()


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        with quiet_output():
            self.loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self.loader, name)


class _QuietImportFinder(importlib.abc.MetaPathFinder):
    """Runs the first import of the named top-level packages inside `quiet_output`."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = set(names)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        self.names.discard(fullname)
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None:
            return None
        spec.loader = _QuietLoader(spec.loader)
        return spec


def install() -> None:
    """Install the filters (once per process; the environment carries nothing, so every FSDP
    process that re-runs the entry point installs them itself)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    for message, module in WARNING_FILTERS:
        warnings.filterwarnings("ignore", message=message, module=module)
    for name, prefixes in LOG_FILTERS.items():
        logging.getLogger(name).addFilter(_PrefixFilter(prefixes))
    pending = tuple(n for n in QUIET_IMPORTS if n not in sys.modules)
    if pending:
        sys.meta_path.insert(0, _QuietImportFinder(pending))
