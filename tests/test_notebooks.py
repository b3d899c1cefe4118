"""Every notebook in notebooks/ runs on the CPU without raising (small sizes: LIGHTNING_JAX_SMOKE=1)."""

import pathlib

import pytest
from helpers import end_to_end_env

# the test extras install both; a GPU image without them still collects the rest of the suite
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_are_found():
  assert {"quickstart.ipynb", "benchmarks.ipynb"} <= {p.name for p in NOTEBOOKS}


@pytest.mark.slow  # each in a kernel of its own
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
  for name, value in end_to_end_env(LIGHTNING_JAX_SMOKE="1", MPLBACKEND="Agg").items():
    monkeypatch.setenv(name, value)
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(path.parent)}})
  client.execute()  # raises CellExecutionError, with the failing cell and traceback, if a cell raises
