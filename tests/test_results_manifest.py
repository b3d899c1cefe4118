"""benchmarks/results/ holds the current runs only, and MANIFEST.md is what their JSONs' metadata make.

After adding or replacing a run: python -m benchmarks.report --manifest benchmarks/results/*.json
(multi_device/ holds the runs of benchmarks/multi_device.py, which have their own report.)
"""

import json
import pathlib

from benchmarks import report

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _runs():
  return {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))}


def test_manifest_is_generated_from_the_committed_runs():
  assert (RESULTS / report.MANIFEST_NAME).read_text() == report.manifest(_runs()), (
      "benchmarks/results/MANIFEST.md is stale: python -m benchmarks.report --manifest benchmarks/results/*.json")


def test_every_results_file_belongs_to_a_run():
  stems = set(_runs())
  outputs = {f"{stem}{suffix}" for stem in stems
             for suffix in (".json", ".md", *(f"-{name}.png" for name in report.PLOT_NAMES))}
  stray = sorted(p.name for p in RESULTS.iterdir()
                 if p.is_file() and p.name not in outputs | {report.MANIFEST_NAME})
  assert not stray, f"files of no run in benchmarks/results/: {stray}"
  assert {p.name for p in RESULTS.iterdir() if p.is_dir()} <= {"multi_device"}


def test_multi_device_runs_come_from_their_script():
  """benchmarks/results/multi_device/: runs of `python -m benchmarks.multi_device`, each a JSON and its report."""
  folder = RESULTS / "multi_device"
  for path in sorted(folder.glob("*.json")):
    metadata = json.loads(path.read_text())["metadata"]
    assert metadata["command"].startswith("python -m benchmarks.multi_device"), path.name
    assert path.with_suffix(".md").exists(), path.name
  assert {p.suffix for p in folder.iterdir()} <= {".json", ".md"}
