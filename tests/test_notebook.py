"""`examples/quickstart.ipynb`: stored executed and current, and it runs.

The notebook is stored with its outputs (GitHub shows it as stored), made by
`scripts/run_notebook.py`, which records a hash of the code cells: a cell
changed without running the script again fails here. It is run on
TensorFlow, the backend it is shown with.
"""

import os
import runpy

import keras
import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
NOTEBOOK = os.path.join(ROOT, "examples", "quickstart.ipynb")
RUN_NOTEBOOK = runpy.run_path(os.path.join(ROOT, "scripts", "run_notebook.py"))

BACKEND = keras.backend.backend()


def _text(notebook):
    return "".join(
        o.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for o in cell.outputs
    )


def _images(notebook):
    return [
        o
        for cell in notebook.cells
        for o in cell.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]


def _check_outputs(notebook):
    text = _text(notebook)
    assert "loss_scale:" in text and "skipped_steps:" in text
    assert "Recommended initial loss scale" in text
    assert "restored loss scale:" in text and "served: float32" in text
    assert "same class as the trained model" in text
    assert len(_images(notebook)) == 2  # the loss-scale curve and the gradient histogram


@pytest.mark.skipif(BACKEND != "tensorflow", reason="checked once")
def test_stored_notebook_is_executed_and_current():
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    stored = notebook.metadata.get("keras_mp", {}).get("sources_sha256")
    assert stored == RUN_NOTEBOOK["sources_hash"](notebook), (
        "a code cell changed since the notebook was executed: run `python scripts/run_notebook.py`"
    )
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    assert all(o.output_type != "error" for c in code for o in c.outputs)
    assert "absl::InitializeLog" not in _text(notebook)  # no native start-up lines
    _check_outputs(notebook)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="run on the backend it is shown with")
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("KERAS_BACKEND", BACKEND)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError naming the failing cell
    _check_outputs(notebook)
