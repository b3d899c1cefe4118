"""Derived metrics of the results: tokens per second, HBM floor, speedup against cuDNN, scaling.

Pure Python; `derive(results, copy_bandwidth_gbps)` adds to every "ok" result:

* tokens_per_s: B * T / time;
* floor_bytes: the bytes the mode must move at least. fwd reads q, k, v and
  writes o; bwd reads q, k, v, do and writes dq, dk, dv; fwdbwd is both;
  per-token gates (float32: decay rates, a delta form's beta and rates) are
  read by each, their gradients written by bwd (the segment ids, a 1/H of a
  gate, are left out);
  floor_ms: those bytes at the copy bandwidth measured in the same run (the
  result's own `copy_bandwidth_gbps`, stamped by the run that measured it, so
  that a `--resume` run does not re-floor older results; else the argument);
  floor_ratio: time / floor_ms (1.0 would be a memory-bound kernel at copy speed);
* speedup_vs_cudnn: cuDNN FlashAttention's time on the same shape and mode
  (softmax attention has no decay: the same cuDNN row serves every decay setting)
  divided by this time;
* scaling_ratio: this time divided by the time of the same case at T / 2
  (2 for a linear cost, 4 for a quadratic one);
* packing_ratio (packed rows): this time divided by the time of the same case
  unpacked (one sequence a row);
* lightning_ratio (delta forms): this time divided by the time of our
  lightning op (`cases.HEADLINE_IMPLS`) on the same shape, mode and packing,
  with the decay of `cases.LIGHTNING_COUNTERPART` (the target: at most 2).
"""

from __future__ import annotations

from benchmarks import cases

SHAPE_KEY = ("batch", "heads", "dim_k", "dim_v", "dtype")


def floor_bytes(r: dict) -> int:
  """Minimum HBM traffic of a result's mode, in bytes."""
  itemsize = cases.DTYPE_ITEMSIZE[r["dtype"]]
  tokens = r["batch"] * r["seq_len"] * r["heads"]
  d, e = r["dim_k"], r["dim_v"]
  fwd = 2 * d + 2 * e  # read q, k, v; write o
  bwd = (2 * d + 2 * e) + (2 * d + e)  # read q, k, v, do; write dq, dk, dv
  per_token = {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[r["mode"]]
  gates = {"fwd": 4, "bwd": 8, "fwdbwd": 12}[r["mode"]] * cases.gate_floats(r)  # float32
  return tokens * (itemsize * per_token + gates)


_SAME = object()


def _key(r: dict, *, seq_len=None, decay=_SAME, impl=None, segments=None) -> tuple:
  """r's case key with the fields given replaced (decay None: softmax's; unpacked rows carry no states)."""
  segments = segments or cases.segments_of(r)
  return ((impl or r["impl"]), r["mode"], seq_len or r["seq_len"], *(r[k] for k in SHAPE_KEY),
          r["decay"] if decay is _SAME else decay, segments, segments > 1 and cases.states_of(r))


def derive(results: list[dict], copy_bandwidth_gbps: float | None) -> list[dict]:
  """Adds the derived metrics (in place) to the "ok" results; returns `results`."""
  ok = [r for r in results if r["status"] == "ok"]
  by_key = {_key(r): r for r in ok}
  cudnn = {_key(r, decay=None): r for r in ok if r["impl"] == cases.BASELINE_IMPL}
  lightning = cases.HEADLINE_IMPLS["lightning"]
  for r in ok:
    seconds = r["time_ms"] / 1e3
    r["tokens_per_s"] = r["batch"] * r["seq_len"] / seconds
    r["floor_bytes"] = floor_bytes(r)
    bandwidth = r.get("copy_bandwidth_gbps") or copy_bandwidth_gbps
    if bandwidth:
      r["floor_ms"] = r["floor_bytes"] / (bandwidth * 1e9) * 1e3
      r["floor_ratio"] = r["time_ms"] / r["floor_ms"]
    base = cudnn.get(_key(r, decay=None, impl=cases.BASELINE_IMPL))
    if base is not None:
      r["speedup_vs_cudnn"] = base["time_ms"] / r["time_ms"]
    half = by_key.get(_key(r, seq_len=r["seq_len"] // 2)) if r["seq_len"] % 2 == 0 else None
    if half is not None:
      r["scaling_ratio"] = r["time_ms"] / half["time_ms"]
    unpacked = by_key.get(_key(r, segments=1)) if cases.segments_of(r) > 1 else None
    if unpacked is not None:
      r["packing_ratio"] = r["time_ms"] / unpacked["time_ms"]
    counterpart = (by_key.get(_key(r, impl=lightning, decay=cases.LIGHTNING_COUNTERPART[r["decay"]]))
                   if cases.is_delta(r) else None)
    if counterpart is not None:
      r["lightning_ratio"] = r["time_ms"] / counterpart["time_ms"]
  return results
