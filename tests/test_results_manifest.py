"""benchmarks/results/ holds the current runs only, and MANIFEST.md is what their JSONs' metadata make.

After adding or replacing a run: python -m benchmarks.report --manifest benchmarks/results/*.json
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
  stray = sorted(p.name for p in RESULTS.iterdir() if p.name not in outputs | {report.MANIFEST_NAME})
  assert not stray, f"files of no run in benchmarks/results/: {stray}"
