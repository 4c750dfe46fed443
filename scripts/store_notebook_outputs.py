"""Execute the notebooks and store them with their outputs, so a reader sees the results (tables,
plots, audio players) without running them:

    python scripts/store_notebook_outputs.py            # every notebook in notebooks/
    python scripts/store_notebook_outputs.py quickstart.ipynb

Each notebook runs top to bottom in a fresh ``python3`` kernel of this interpreter (one thread per
op), in an empty temporary working directory. What is stored is kept stable from run to run, so
tests/test_notebooks.py can check it still comes from the current code: the cells' sources are
recorded by digest (``metadata.tts_lightning.executed_sources``); stderr streams (library warnings
and log lines, which change with the environment) and the per-cell timing metadata are dropped; the
working directory's path is shown as ``.`` and the repository's as ``<repo>``. The test re-executes
the notebooks and compares each code cell's output kinds (output type and MIME types) with the
stored ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import nbclient
import nbformat

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = ("quickstart.ipynb", "memory_planning.ipynb")
RECORD = "tts_lightning"  # the notebook metadata key of what the stored outputs came from


def kernel_env(root: Path, setenv: Callable[[str, str], None]) -> None:
    """A ``python3`` kernelspec for sys.executable under ``root``, found before any other (a
    ``python3`` kernelspec installed elsewhere, e.g. one whose ``argv`` starts with a bare
    ``python``, cannot hijack it), one thread per op."""
    spec_dir = root / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)",
        "language": "python",
        "env": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    setenv("JUPYTER_PATH", str(root / "jupyter"))
    setenv("JUPYTER_RUNTIME_DIR", str(root / "jupyter-runtime"))
    setenv("IPYTHONDIR", str(root / "ipython"))
    setenv("OMP_NUM_THREADS", "1")
    setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")


def client(nb, workdir: Path) -> nbclient.NotebookClient:
    return nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(workdir)}}
    )


def source_digest(cell) -> str:
    return hashlib.sha256(cell.source.encode()).hexdigest()[:16]


def shown(output) -> bool:
    """What is stored and compared: everything but stderr (warnings, log lines)."""
    return not (output.output_type == "stream" and output.get("name") == "stderr")


def output_kinds(cell) -> list[str]:
    """A code cell's outputs as kinds: ``stream:stdout``, ``display_data:image/png+text/plain``, ...
    (consecutive repeats once: a stream may arrive in one piece or several)."""
    kinds: list[str] = []
    for output in filter(shown, cell.get("outputs", [])):
        if output.output_type == "stream":
            kind = f"stream:{output.name}"
        elif output.output_type == "error":
            kind = f"error:{output.ename}"
        else:
            kind = f"{output.output_type}:" + "+".join(sorted(output.get("data", {})))
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return kinds


def stable(executed, original, workdir: Path):
    """The executed notebook as stored: ``original``'s metadata and the digests of its sources,
    stderr and timing metadata dropped, the working directory shown as ``.``, the repository as ``<repo>``."""
    nb = nbformat.from_dict(json.loads(json.dumps(executed)))  # a deep copy
    nb.metadata = nbformat.from_dict(dict(original.metadata))
    nb.metadata[RECORD] = {"executed_sources": [source_digest(c) for c in nb.cells]}

    def local(text: str) -> str:
        return text.replace(str(workdir), ".").replace(str(REPO), "<repo>")

    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        cell.outputs = [o for o in cell.outputs if shown(o)]
        for output in cell.outputs:
            if output.output_type == "stream":
                output.text = local(output.text)
            for mime, value in output.get("data", {}).items():
                if isinstance(value, str) and mime.startswith("text/"):
                    output.data[mime] = local(value)
    return nb


def store(name: str, root: Path) -> None:
    path = NOTEBOOK_DIR / name
    original = nbformat.read(path, as_version=4)
    nb = nbformat.from_dict(json.loads(json.dumps(original)))
    workdir = root / "work" / name
    workdir.mkdir(parents=True)
    start = time.monotonic()
    client(nb, workdir).execute()  # raises CellExecutionError on the first failing cell
    stored = stable(nb, original, workdir)
    nbformat.validate(stored)
    text = nbformat.writes(stored) + "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomically: a failed run leaves the notebook as it was
    print(f"{path}: executed in {time.monotonic() - start:.0f} s, {len(text) / 1024:.0f} KiB stored")


def main(argv: list[str]) -> int:
    names = argv or list(NOTEBOOKS)
    unknown = [n for n in names if not (NOTEBOOK_DIR / n).is_file()]
    if unknown:
        print(f"no such notebook in {NOTEBOOK_DIR}: {unknown}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="notebooks-") as tmp:
        kernel_env(Path(tmp), os.environ.__setitem__)
        for name in names:
            store(name, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
