"""Every notebook in notebooks/ runs on the CPU without raising (small sizes: LIGHTNING_JAX_SMOKE=1)."""

import os
import pathlib

import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_are_found():
  assert {"quickstart.ipynb", "benchmarks.ipynb"} <= {p.name for p in NOTEBOOKS}


@pytest.mark.slow  # each in a kernel of its own
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
  monkeypatch.setenv("LIGHTNING_JAX_SMOKE", "1")
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(path.parent)}})
  client.execute()  # raises CellExecutionError, with the failing cell and traceback, if a cell raises
