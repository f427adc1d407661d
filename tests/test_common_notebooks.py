"""Runs every notebook in notebooks/ top to bottom; any error fails.

Each notebook sets its own backend and devices in its first code cell, and
runs in its own kernel (python3, via ipykernel), in a fresh directory, with
this checkout's `keras_tp` (and nothing else of the checkout) first on
`PYTHONPATH`. Run alone: `python -m pytest tests/test_common_notebooks.py`.
"""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert [path.name for path in NOTEBOOKS][:2] == [
        "01_quickstart.ipynb",
        "02_transformer_lm.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs(path, monkeypatch, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    intro = notebook.cells[0]
    assert intro.cell_type == "markdown" and "Backend:" in intro.source
    # The kernel inherits this environment: make it import this checkout's
    # keras_tp and nothing else of the checkout (`benchmarks`, `tests`), as
    # after the documented install, and keep TensorFlow's C++ logs out of
    # the outputs. It runs in a fresh directory.
    package_only = tmp_path / "path"
    package_only.mkdir()
    (package_only / "keras_tp").symlink_to(REPO / "keras_tp")
    pythonpath = os.pathsep.join(
        p for p in (str(package_only), os.environ.get("PYTHONPATH")) if p
    )
    monkeypatch.setenv("PYTHONPATH", pythonpath)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=600,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
