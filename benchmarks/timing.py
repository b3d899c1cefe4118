"""Framework-agnostic timing: warm-up, then the median of device-synchronised samples.

`measure(call, sync, ...)` is shared by the JAX and the torch workers, so every
implementation is timed the same way:

* compilation (and autotuning) happens before: the caller passes compiled
  functions, and `warmup` calls run first (torch/Triton peers JIT-compile and
  autotune in their first call, which is a warm-up call); calls longer than
  `max_seconds` get a single warm-up call;
* `call(i)` runs on input set `i % n_sets`: the sets are rotated so that
  successive calls do not find their inputs in the L2 cache;
* a sample is `calls_per_sample` back-to-back calls followed by one
  `sync(output)` (block_until_ready / cuda.synchronize), timed on the host and
  divided by the number of calls. The count is chosen so that a sample lasts
  at least `min_sample_seconds`, which amortises the host's launch and sync
  overhead for very short kernels; long kernels use one call per sample;
* samples are taken until `max_iters` samples or `max_seconds`, but at least
  `min_iters`; the result is their median (with min, p10, p90).
"""

from __future__ import annotations

import math
import statistics
import time


def _sample(call, sync, start: int, count: int, n_sets: int) -> float:
  t0 = time.perf_counter()
  out = None
  for i in range(start, start + count):
    out = call(i % n_sets)
  sync(out)
  return (time.perf_counter() - t0) / count


def _quantile(sorted_values: list[float], q: float) -> float:
  return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def measure(call, sync, *, n_sets: int = 1, warmup: int = 2, min_iters: int = 3, max_iters: int = 20,
            max_seconds: float = 0.5, min_sample_seconds: float = 1e-3) -> dict:
  """Times `call`; returns milliseconds (median, min, p10, p90) and the sample counts."""
  one_call = spent = 0.0
  for i in range(max(1, warmup)):  # the last warm-up call calibrates the sample size
    if i and spent > max_seconds:
      break
    one_call = _sample(call, sync, i, 1, n_sets)
    spent += one_call
  per_sample = max(1, min(100, math.ceil(min_sample_seconds / max(one_call, 1e-7))))
  samples, start = [], time.perf_counter()
  while len(samples) < max(1, min_iters) or (len(samples) < max_iters and time.perf_counter() - start < max_seconds):
    samples.append(_sample(call, sync, len(samples) * per_sample, per_sample, n_sets))
  ordered = sorted(samples)
  return dict(time_ms=1e3 * statistics.median(ordered), time_ms_min=1e3 * ordered[0],
              time_ms_p10=1e3 * _quantile(ordered, 0.1), time_ms_p90=1e3 * _quantile(ordered, 0.9),
              samples=len(samples), calls_per_sample=per_sample, n_sets=n_sets)


def rotation_sets(set_bytes: int, rotate_bytes: int, max_sets: int = 8) -> int:
  """Input sets to rotate so that together they span `rotate_bytes` (several times the L2 cache)."""
  return max(1, min(max_sets, math.ceil(rotate_bytes / max(1, set_bytes))))
