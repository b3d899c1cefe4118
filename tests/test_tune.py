"""The autotuner (`python -m lightning_jax.tune`) and its timing: candidates, samples, the JSON it writes.

Its tuning-cache side (`--write-cache`, `pick_configs`, `merge_picks`) is in test_tuning_cache.py.
"""

import json

import pytest

from lightning_jax import tune
from lightning_jax.tune import timing


def test_parse_shapes():
  assert tune.parse_shapes("4x8192x32x64, 2x100x3x48x80") == [(4, 8192, 32, 64, 64), (2, 100, 3, 48, 80)]
  for bad in ("4x8192x32", "4x0x32x64", "4x8192x32x64x1x1", "la3"):
    with pytest.raises(ValueError, match="bad shape"):
      tune.parse_shapes(bad)


def test_measure_rotates_inputs_and_counts_samples():
  seen = []
  stats = timing.measure(seen.append, lambda _: None, n_sets=3, warmup=2, min_iters=4, max_iters=4,
                         max_seconds=10.0, min_sample_seconds=0.0)
  assert stats["samples"] == 4 and stats["calls_per_sample"] == 1
  assert seen == [0, 1, 0, 1, 2, 0]
  seen.clear()  # calls longer than max_seconds: one warm-up call, min_iters samples
  stats = timing.measure(seen.append, lambda _: None, n_sets=3, warmup=2, min_iters=3, max_iters=9,
                         max_seconds=-1.0, min_sample_seconds=0.0)
  assert stats["samples"] == 3 and seen == [0, 0, 1, 2]
  assert timing.rotation_sets(100, 250) == 3 and timing.rotation_sets(10**9, 250) == 1


def test_samples_span_sample_seconds_of_back_to_back_calls(monkeypatch):
  now = [0.0]
  monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

  def call(i):  # 3 ms per call on the fake clock
    now[0] += 0.003
  stats = timing.measure(call, lambda _: None, warmup=1, min_iters=3, max_iters=3, max_seconds=10.0,
                         min_sample_seconds=0.02)
  assert stats["calls_per_sample"] == 7 and stats["samples"] == 3  # ceil(20 ms / 3 ms)
  assert stats["time_ms"] == pytest.approx(3.0) and stats["sample_ms_min"] == pytest.approx(21.0)


def test_warmup_seconds_of_samples_are_discarded(monkeypatch):
  """`warmup_seconds` of back-to-back samples run before the timed ones (the GPU at its power cap's steady clocks)
  and none of them is in the result: calls slow down after 50 ms of load, as an H200's clocks drop at its cap."""
  now = [0.0]
  monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

  def call(i):  # 1 ms per call for the first 50 ms, then 1.2 ms
    now[0] += 0.001 if now[0] < 0.05 else 0.0012
  kwargs = dict(warmup=1, min_iters=5, max_iters=5, max_seconds=10.0, min_sample_seconds=0.01)
  cold = timing.measure(call, lambda _: None, **kwargs)
  assert cold["warmup_samples"] == 0 and cold["time_ms_min"] == pytest.approx(1.0)  # samples before the drop
  now[0] = 0.0
  warm = timing.measure(call, lambda _: None, warmup_seconds=0.1, **kwargs)
  assert warm["warmup_samples"] >= 7 and warm["time_ms_min"] == pytest.approx(1.2)  # every sample after it
  assert warm["calls_per_sample"] == cold["calls_per_sample"]


def test_samples_are_sized_past_sync_latency_and_a_slow_first_call(monkeypatch):
  # 0.1 ms per call and 1 ms per sync: one call reads 1.1 ms, so sizing from it
  # alone gives 19-call samples of 2.9 ms. The first call also took 5 s (as a
  # compiling or autotuning call does), which alone would give 1-call samples.
  now = [0.0]
  monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
  calls = []

  def call(i):
    now[0] += 5.0 if not calls else 1e-4
    calls.append(i)

  def sync(_):
    now[0] += 1e-3
  for max_seconds in (10.0, 1.0):  # sizing after two warm-up calls, and after the slow one alone
    calls.clear()
    stats = timing.measure(call, sync, warmup=2, min_iters=3, max_iters=3, max_seconds=max_seconds,
                           min_sample_seconds=0.02)
    assert stats["sample_ms_min"] >= 20.0 - 1e-6, stats  # (float sums on the fake clock)
    assert stats["calls_per_sample"] <= 220  # 190 suffice (19 ms of calls at 0.1 ms), 10% over is the margin
    assert stats["time_ms"] == pytest.approx(0.1 + 1.0 / stats["calls_per_sample"])


@pytest.mark.usefixtures("unoptimized_compiles")  # compiling the candidates is most of its time
def test_tune_smoke(tmp_path, monkeypatch):
  """The autotuner in interpret mode: every candidate compiles, agrees with the default, and is timed."""
  out = tmp_path / "tune.json"
  sample_lengths = []
  measure = tune.timing.measure

  def recording_measure(*args, **kwargs):
    sample_lengths.append(kwargs["min_sample_seconds"])
    return measure(*args, **kwargs)

  monkeypatch.setattr(tune.timing, "measure", recording_measure)
  tune.main(["--shapes", "1x40x2x16x32", "--jobs", "forward,dual", "--variants", "parallel", "--decays", "on",
             "--dtype", "f32", "--sample-seconds", "0.003", "--out", str(out)])
  saved = json.loads(out.read_text())
  rows = saved["rows"]
  assert {r["job"] for r in rows} == {"forward", "dual"}
  assert sum(r["default"] for r in rows) == 2 and len(rows) > 2
  assert saved["sample_seconds"] == 0.003 and sample_lengths == [0.003] * len(rows)
  for r in rows:
    assert r["status"] == "ok" and r["err"] < 1e-5 and r["time_ms"] > 0, r


def test_tune_reports_a_group_where_nothing_compiles(tmp_path, monkeypatch, capsys):
  """A group whose every candidate fails is recorded and reported, and the sweep goes on."""
  class Rejected:
    def lower(self, *args):
      raise RuntimeError("rejected by the compiler")

  monkeypatch.setattr(tune, "job_fn", lambda job, opts: Rejected())
  out = tmp_path / "tune.json"
  tune.main(["--shapes", "1x20x1x16x16", "--jobs", "forward,dual", "--variants", "parallel", "--decays", "on",
             "--dtype", "f32", "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert {r["job"] for r in rows} == {"forward", "dual"}
  assert rows and all(r["status"] == "compile_error" and "rejected by the compiler" in r["error"] for r in rows)
  assert capsys.readouterr().out.count("no candidate compiled and agreed") == 2
