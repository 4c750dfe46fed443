"""The notebooks run top to bottom in a real Jupyter kernel, and are stored with the outputs of an
executed run (scripts/store_notebook_outputs.py) that still come from the current code.

Each notebook is executed by nbclient in a fresh ``python3`` kernel that runs *this* interpreter
(a kernelspec written to a temporary ``JUPYTER_PATH``, so a ``python3`` kernelspec installed
elsewhere, e.g. one whose ``argv`` starts with a bare ``python``, cannot hijack it), in an empty
temporary working directory: the notebooks must not depend on being run from ``notebooks/``. The
notebooks run at the same time, each in its own kernel. Any cell error fails the test (nbclient
raises ``CellExecutionError`` with the traceback).

The stored outputs must match: the sources they were made from (digests the script records) are the
cells' sources, and each code cell's re-executed output kinds (output type and MIME types: text,
image/png, text/html tables, audio players) are the stored ones. When a cell changes, run
``python scripts/store_notebook_outputs.py`` and commit the notebook.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import ipykernel  # noqa: F401  (the notebooks' kernel: a missing one fails here, not as a skip)
import nbclient
import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import store_notebook_outputs as store  # noqa: E402

NOTEBOOK_DIR = store.NOTEBOOK_DIR
NOTEBOOKS = store.NOTEBOOKS
MAX_STORED_BYTES = 600_000  # per notebook: the repository stays light

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
    store.kernel_env(root, monkeypatch.setenv)
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
            clients[name] = store.client(notebooks[name][0], workdir)

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
def test_stored_with_outputs_of_its_current_cells(name):
    """Every code cell ran, in order, and the outputs are stored; the recorded sources are today's
    (a cell edited since the outputs were stored fails here: re-store them); nothing that changes
    from run to run (timing metadata, stderr) is stored; the file stays small."""
    path = NOTEBOOK_DIR / name
    nb = _read(name)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    recorded = nb.metadata.get(store.RECORD, {}).get("executed_sources")
    assert recorded == [store.source_digest(c) for c in nb.cells], (
        f"{name}: cells changed since their outputs were stored; run python scripts/store_notebook_outputs.py {name}"
    )
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{name}: not run top to bottom"
    outputs = [o for c in code for o in c.outputs]
    assert len(outputs) >= len(code) // 2, f"{name}: {len(outputs)} outputs stored for {len(code)} code cells"
    assert not [o for o in outputs if o.output_type == "error" or not store.shown(o)]
    assert not any("execution" in cell.get("metadata", {}) for cell in nb.cells), f"{name}: cell timing metadata"
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name}: no stored figure"
    assert path.stat().st_size < MAX_STORED_BYTES, f"{name}: {path.stat().st_size} bytes stored"


def test_the_checks_notice_an_edited_cell_and_a_lost_figure():
    nb = _read("quickstart.ipynb")
    recorded = nb.metadata[store.RECORD]["executed_sources"]
    i, cell = next(
        (i, c) for i, c in enumerate(nb.cells) if any("image/png" in o.get("data", {}) for o in c.get("outputs", []))
    )
    cell.source += "\nplt.close('all')"
    assert [store.source_digest(c) for c in nb.cells] != recorded
    kinds = store.output_kinds(cell)
    assert "display_data:image/png+text/plain" in kinds
    cell.outputs = [o for o in cell.outputs if "image/png" not in o.get("data", {})]
    assert store.output_kinds(cell) != kinds


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
    # The stored outputs come from these cells: the same sources were executed, and each cell gave
    # the same kinds of output (text, figures, tables, audio players) as the stored ones.
    stored = _read(name)
    assert [c.source for c in nb.cells] == [c.source for c in stored.cells]
    for i, (ran, kept) in enumerate(zip(nb.cells, stored.cells, strict=True)):
        if ran.cell_type == "code":
            assert store.output_kinds(ran) == store.output_kinds(kept), (
                f"{name} cell {i}: outputs changed; run python scripts/store_notebook_outputs.py {name}"
            )
