"""The notebooks run top to bottom in a real Jupyter kernel, and are committed without outputs.

Each notebook is executed by nbclient in a fresh ``python3`` kernel that runs *this* interpreter
(a kernelspec written to a temporary ``JUPYTER_PATH``, so a ``python3`` kernelspec installed
elsewhere, e.g. one whose ``argv`` starts with a bare ``python``, cannot hijack it), in an empty
temporary working directory: the notebooks must not depend on being run from ``notebooks/``. The
notebooks run at the same time, each in its own kernel. Any cell error fails the test (nbclient
raises ``CellExecutionError`` with the traceback).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = ("quickstart.ipynb", "memory_planning.ipynb")

# What each notebook must leave under runs/ in its working directory.
EXPECTED_OUTPUTS = {
    "quickstart.ipynb": [
        "runs/quickstart/tiny-model/config.json",
        "runs/quickstart/cache/report.json",
        "runs/quickstart/voice/config.json",
        "runs/quickstart/voice/model.safetensors",
        "runs/quickstart/hello_alice.wav",
    ],
    "memory_planning.ipynb": [],
}


def _read(name: str):
    return nbformat.read(NOTEBOOK_DIR / name, as_version=4)


def _kernel_env(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``python3`` kernelspec for sys.executable under ``root``, found before any other, one
    thread per op."""
    spec_dir = root / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (tests)",
        "language": "python",
        "env": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(root / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(root / "jupyter-runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(root / "ipython"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return root


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    return _kernel_env(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Every notebook executed once, all at the same time, each in its own fresh kernel and empty
    working directory (one kernel mostly runs one thread: two share the 2 cores):
    {name: (executed notebook, working directory, seconds, the error it raised or None)}, and the
    listing of notebooks/ from before."""
    root = tmp_path_factory.mktemp("notebooks")
    before = sorted(p.name for p in NOTEBOOK_DIR.iterdir())
    notebooks, clients = {}, {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        _kernel_env(root, monkeypatch)
        for name in NOTEBOOKS:
            workdir = root / "work" / name
            workdir.mkdir(parents=True)
            notebooks[name] = (_read(name), workdir)
            clients[name] = nbclient.NotebookClient(
                notebooks[name][0], kernel_name="python3", timeout=600, resources={"metadata": {"path": str(workdir)}}
            )

        async def execute(name):
            start = time.monotonic()
            try:
                await clients[name].async_execute()  # raises CellExecutionError on the first failing cell
                error = None
            except Exception as exc:
                error = exc
            return name, time.monotonic() - start, error

        async def execute_all():
            return await asyncio.gather(*(execute(name) for name in NOTEBOOKS))

        results = asyncio.run(execute_all())
    return {name: (*notebooks[name], seconds, error) for name, seconds, error in results}, before


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    nb = _read(name)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, f"{name}: code cells {dirty} have outputs or execution counts; clear them before committing"
    assert not any("execution" in cell.get("metadata", {}) for cell in nb.cells), f"{name}: cell timing metadata"
    assert any(c.cell_type == "markdown" for c in nb.cells) and any(c.cell_type == "code" for c in nb.cells)


def test_kernel_runs_this_interpreter(kernel_env):
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("import os, sys\nprint(sys.executable)\nprint(os.environ['OMP_NUM_THREADS'])")]
    )
    nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(kernel_env)}}
    ).execute()
    printed = "".join(o.get("text", "") for o in nb.cells[0].outputs).split()
    assert printed == [sys.executable, "1"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, executed):
    runs, before = executed
    nb, workdir, seconds, error = runs[name]
    print(f"{name}: executed in {seconds:.1f} s")
    if error is not None:
        raise error

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    missing = [p for p in EXPECTED_OUTPUTS[name] if not (workdir / p).is_file()]
    assert not missing, f"{name} did not write {missing} under its working directory"
    assert sorted(p.name for p in NOTEBOOK_DIR.iterdir()) == before, f"{name} wrote into {NOTEBOOK_DIR}"
    # Every figure rendered (inline PNGs), so a plot that silently drew nothing would show here.
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{name} displayed no figure"
