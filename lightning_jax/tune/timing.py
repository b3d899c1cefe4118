"""Framework-agnostic timing: warm-up, then the median of device-synchronised samples.

`measure(call, sync, ...)` times the autotuner's candidates and, in the
benchmark CLI (`benchmarks/`), both the JAX and the torch workers, so that every
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
  overhead for short kernels; long kernels use one call per sample. It is
  sized from timed batches of calls, not from one call, whose launch and sync
  latency would overstate a short kernel's time and cut its samples short;
* `warmup_seconds` of such samples, discarded, come first: under sustained load
  an H200 reaches its 700 W power cap within about 0.1 s and then runs the
  memory-bound kernels at 1350-1500 MHz instead of 1980 (up to 19% longer
  kernels), so the first samples after an idle spell (a compilation) ran faster
  than the rest and moved the median; warmed up, every sample is taken in the
  steady state that a training loop sees (PERFORMANCE.md, "Timing method");
* samples are taken until `max_iters` samples or `max_seconds`, but at least
  `min_iters`; the result is their median (with min, p10, p90).
"""

from __future__ import annotations

import math
import statistics
import time

# A GPU sample lasts at least this long: spread over so many back-to-back
# calls, the host's dispatch and sync latency adds under 1% (benchmarks/
# PERFORMANCE.md, "Timing method"). The benchmark CLI's GPU profiles use the same.
GPU_SAMPLE_SECONDS = 0.02
# Back-to-back calls before the samples on a GPU: the power cap's clocks are steady after about 0.3 s of load.
GPU_WARMUP_SECONDS = 0.5


def _sample(call, sync, start: int, count: int, n_sets: int) -> float:
  t0 = time.perf_counter()
  out = None
  for i in range(start, start + count):
    out = call(i % n_sets)
  sync(out)
  return (time.perf_counter() - t0) / count


def _quantile(sorted_values: list[float], q: float) -> float:
  return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


MAX_CALLS_PER_SAMPLE = 10_000
_SIZING_ROUNDS = 4


def _calls_per_sample(call, sync, n_sets: int, one_call: float, min_sample_seconds: float) -> int:
  """Back-to-back calls for a sample of at least `min_sample_seconds`.

  Starts from one call's time and times batches of that many calls, growing
  the batch until one spans the target: each batch's time per call still
  carries its share of the fixed sync latency, so the count rises towards the
  target from below. A batch is timed even when one call seemed to span the
  target, since that call may have been the one that compiled or autotuned.
  """
  count = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(min_sample_seconds / max(one_call, 1e-7))))
  for _ in range(_SIZING_ROUNDS if min_sample_seconds > 0 else 0):
    took = count * _sample(call, sync, 0, count, n_sets)
    if took >= min_sample_seconds or count == MAX_CALLS_PER_SAMPLE:
      break
    # 10% over, so that the samples after it, often a little faster, still span the target.
    count = min(MAX_CALLS_PER_SAMPLE, math.ceil(1.1 * count * min_sample_seconds / max(took, 1e-9)))
  return count


def measure(call, sync, *, n_sets: int = 1, warmup: int = 2, min_iters: int = 3, max_iters: int = 20,
            max_seconds: float = 0.5, min_sample_seconds: float = 1e-3, warmup_seconds: float = 0.0) -> dict:
  """Times `call`; returns milliseconds (median, min, p10, p90), the sample counts and lengths, and the samples
  discarded in `warmup_seconds`."""
  one_call = spent = 0.0
  for i in range(max(1, warmup)):  # the last warm-up call starts the sample sizing
    if i and spent > max_seconds:
      break
    one_call = _sample(call, sync, i, 1, n_sets)
    spent += one_call
  per_sample = _calls_per_sample(call, sync, n_sets, one_call, min_sample_seconds)
  discarded, start = 0, time.perf_counter()
  while time.perf_counter() - start < warmup_seconds:
    _sample(call, sync, discarded * per_sample, per_sample, n_sets)
    discarded += 1
  samples, start = [], time.perf_counter()
  while len(samples) < max(1, min_iters) or (len(samples) < max_iters and time.perf_counter() - start < max_seconds):
    samples.append(_sample(call, sync, len(samples) * per_sample, per_sample, n_sets))
  ordered = sorted(samples)
  return dict(time_ms=1e3 * statistics.median(ordered), time_ms_min=1e3 * ordered[0],
              time_ms_p10=1e3 * _quantile(ordered, 0.1), time_ms_p90=1e3 * _quantile(ordered, 0.9),
              samples=len(samples), calls_per_sample=per_sample, n_sets=n_sets, warmup_samples=discarded,
              sample_ms_min=1e3 * per_sample * ordered[0])


def rotation_sets(set_bytes: int, rotate_bytes: int, max_sets: int = 8) -> int:
  """Input sets to rotate so that together they span `rotate_bytes` (several times the L2 cache)."""
  return max(1, min(max_sets, math.ceil(rotate_bytes / max(1, set_bytes))))
