"""The autotuner: times one sweep of the Pallas kernels over a grid of block configs, per job.

    python -m lightning_jax.tune --shapes 4x8192x32x64,2x8192x32x128 --out tune.json

A sweep is the unit the heuristics of `lightning_jax.ops.lightning_attention.heuristics`
choose blocks for: the forward pass is one `forward` sweep, the backward pass a
`tangent` sweep (dq, with the decay tangent when the decay is differentiated,
else a `forward`-like sweep) and a `dual` sweep (dk and dv). Every candidate
that fits the device's shared-memory budget is compiled, checked against the
output of the first that compiled (the default, unless it failed), and timed
with `lightning_jax.tune.timing` (samples of at least `--sample-seconds`, as in
the benchmark CLI); the JSON holds every row, and one line per (shape,
job, decay, variant) prints the default's time and status beside the best
config's. The default rows run the heuristics: tune ignores every tuning cache.

    python -m lightning_jax.tune --shapes 4x8192x32x64,2x8192x32x128 --write-cache my_gpu.json

also writes a tuning cache for this device (see
`lightning_jax.ops.lightning_attention.tuning_cache`), or updates the one at
that path: per sweep, the config that `pick_configs` picks. It needs a GPU.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import datetime
import itertools
import json
import math
import os
import re
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import pallas_triton
from lightning_jax.ops.lightning_attention import tuning_cache
from lightning_jax.ops.lightning_attention.pallas_triton import SweepOperands
from lightning_jax.tune import timing

# Explore a little past the heuristics' register limit, to check that limit.
MAX_ACCUMULATOR_REGISTERS = heuristics.MAX_ACCUMULATOR_REGISTERS + 32


def parse_shapes(text: str) -> list[tuple[int, int, int, int, int]]:
  """Comma-separated "BxTxHxD" or "BxTxHxDxE" (E = D if left out) -> [(B, T, H, D, E)]."""
  shapes = []
  for part in filter(None, (p.strip() for p in text.split(","))):
    if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){3,4}", part):
      raise ValueError(f"bad shape {part!r}: use BxTxHxD[xE] with every dim >= 1, e.g. 4x8192x32x64")
    dims = [int(x) for x in part.split("x")]
    shapes.append(tuple(dims) if len(dims) == 5 else (*dims, dims[3]))
  return shapes


def chunk_loop_candidates(sweep: config_lib.SweepShape, budget: int):
  for c, be, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
    if be > sweep.dim_v:
      continue
    cfg = config_lib.ChunkLoopConfig(chunk_size=c, block_e=be, num_warps=warps, num_stages=stages)
    if cfg.shared_memory_bytes(sweep) <= budget and cfg.accumulator_registers(sweep) <= MAX_ACCUMULATOR_REGISTERS:
      yield config_lib.LightningConfig(chunk_loop=cfg)


def parallel_candidates(sweep: config_lib.SweepShape, budget: int):
  for c, be, warps in itertools.product((64, 128), (32, 64, 128), (4, 8)):
    if be > sweep.dim_v:
      continue
    cfg = config_lib.ChunkOutputConfig(chunk_size=c, block_e=be, num_warps=warps, num_stages=1)
    if cfg.shared_memory_bytes(sweep) <= budget:
      yield config_lib.LightningConfig(chunk_output=cfg)


def job_fn(job, opts):
  """The sweep of `job` as a function of (q, k, v, decay, do), as the op runs it."""
  def fn(q, k, v, decay, do):
    sweep = lambda ins, reverse: pallas_triton.sweep(  # noqa: E731
        ins, reverse=reverse, with_final_state=False, out_dtype=q.dtype, opts=opts)
    if job == "forward":
      return sweep(SweepOperands(decay=decay, x=q, y=k, z=v), False).out
    if job == "tangent":
      res = sweep(SweepOperands(decay=decay, x=do, y=v, z=k, tangent_with=q), False)
      return res.out, res.row_dots
    res = sweep(SweepOperands(decay=decay, x=k, y=q, z=do, dual_with=v), True)
    return res.out, res.dual
  return jax.jit(fn)


def sweep_dims(d, e, job):
  """The padded dims of `job`'s sweep for head dims D, E: the tangent (dq) sweep runs on (E, D)."""
  dim_k, dim_v = (e, d) if job == "tangent" else (d, e)
  return dict(dim_k=config_lib.padded_dim(dim_k), dim_v=config_lib.padded_dim(dim_v))


# The kernel whose config each variant's candidates set (chunk_states keeps the heuristics).
KERNEL_OF_VARIANT = {"chunk_loop": "chunk_loop", "parallel": "chunk_output"}


def pick_configs(rows, *, compute_capability, itemsize, min_gain):
  """Per sweep and kernel, the config a tuning cache should hold, from the rows of `main`.

  A cache entry serves every B, T, H and decay of its padded dims, so a group is
  every row of one (job, padded dims, variant), and the configs with status "ok"
  in each of its (shape, decay) settings compete on their total time. The
  heuristics' config (the default rows, and the candidate equal to it: the
  faster per setting) keeps the sweep unless the fastest beats it by more than
  the fraction `min_gain`: an entry that repeats the heuristics, or wins by
  noise, would only pin this version's choice on this device.

  Returns {(job, dim_k, dim_v, kernel): the config, or None where the heuristics
  keep the sweep}; a group with no config ok in every setting is left out.
  """
  groups = collections.defaultdict(list)
  for row in rows:
    dims = sweep_dims(*row["shape"][3:], row["job"])
    groups[row["job"], dims["dim_k"], dims["dim_v"], KERNEL_OF_VARIANT[row["variant"]]].append(row)
  picks = {}
  for (job, dim_k, dim_v, kernel), group in groups.items():
    with tuning_cache.use_tuning_cache(None):  # what the default rows ran
      heuristic = getattr(heuristics.resolve(None, dim_k=dim_k, dim_v=dim_v, itemsize=itemsize,
                                             compute_capability=compute_capability, job=job), kernel)
    settings = {(tuple(r["shape"]), r["decay"]) for r in group}
    times = collections.defaultdict(dict)  # config -> {setting: time_ms}
    for r in group:
      if r["status"] == "ok":
        cfg = heuristic if r["default"] else tuning_cache.KERNELS[kernel](**r["config"][kernel])
        setting = (tuple(r["shape"]), r["decay"])
        times[cfg][setting] = min(r["time_ms"], times[cfg].get(setting, math.inf))
    totals = {cfg: sum(t.values()) for cfg, t in times.items() if len(t) == len(settings)}
    if not totals:
      continue
    best = min(totals, key=totals.get)
    keep = best == heuristic or (heuristic in totals and totals[best] > (1 - min_gain) * totals[heuristic])
    picks[job, dim_k, dim_v, kernel] = None if keep else best
  return picks


def merge_picks(cache, picks, *, compute_capability, itemsize, **metadata):
  """`cache` (None: an empty one) with the `picks` of `pick_configs` applied.

  A pick sets its kernel's config in the entry of its sweep, or with None drops
  it (the heuristics won on this device); an entry it changes takes `metadata`
  (device, jax, date, command), and one left with no config goes. Entries of
  other sweeps and devices stay as they were.
  """
  entries = {entry.key: entry for entry in (cache.entries if cache else ())}
  cc = tuple(compute_capability)
  for (job, dim_k, dim_v, kernel), cfg in picks.items():
    key = (cc, job, dim_k, dim_v, itemsize)
    old = entries.pop(key, None)
    kernels = {name: getattr(old, name, None) for name in tuning_cache.KERNELS} | {kernel: cfg}
    if old is not None and getattr(old, kernel) == cfg:
      entries[key] = old  # unchanged, with the metadata of the run that measured it
    elif any(value is not None for value in kernels.values()):
      entries[key] = tuning_cache.TuningEntry(compute_capability=cc, job=job, dim_k=dim_k, dim_v=dim_v,
                                              itemsize=itemsize, **kernels, **metadata)
  return tuning_cache.TuningCache(entries=tuple(sorted(entries.values(), key=lambda entry: entry.key)),
                                  path=cache.path if cache else None)


def rel_err(x, y):
  x, y = (np.asarray(a, np.float64) for a in (x, y))
  return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", default="4x8192x32x64,2x8192x32x128")
  parser.add_argument("--jobs", default="forward,tangent,dual")
  parser.add_argument("--variants", default="chunk_loop,parallel")
  parser.add_argument("--decays", default="on,off", help="on, off or both")
  parser.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "f32"))
  parser.add_argument("--compile-threads", type=int, default=8)
  parser.add_argument("--max-seconds", type=float, default=420.0, help="stop starting new groups after this")
  parser.add_argument("--sample-seconds", type=float, default=timing.GPU_SAMPLE_SECONDS,
                      help="each timed sample lasts at least this long (see lightning_jax.tune.timing)")
  parser.add_argument("--out", default=None, help="JSON file for every row")
  parser.add_argument("--write-cache", default=None, metavar="PATH",
                      help="write the picked configs to this tuning cache (updated if it exists); needs a GPU")
  parser.add_argument("--cache-min-gain", type=float, default=0.05,
                      help="a config enters the cache where it takes this fraction less time than the heuristics'")
  args = parser.parse_args(argv)

  dtype = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}[args.dtype]
  itemsize = jnp.dtype(dtype).itemsize
  # None: interpret mode on the CPU (a smoke test, not a tuning).
  cc = heuristics.compute_capability(jax.devices()[0])
  if args.write_cache and cc is None:
    parser.error("--write-cache needs an NVIDIA GPU: interpret-mode timings on the CPU say nothing about a "
                 "device's blocks")
  # A broken cache file fails now, not after the timings.
  previous = (tuning_cache.TuningCache.load(args.write_cache)
              if args.write_cache and os.path.exists(args.write_cache) else None)
  budget = config_lib.shared_memory_budget(cc)
  start = time.perf_counter()
  rows = []
  for b, t, h, d, e in parse_shapes(args.shapes):
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    sets = [tuple(jax.random.normal(keys[4 * s + i], (b, t, h, dim), dtype) for i, dim in enumerate((d, d, e, e)))
            for s in range(2)]
    rates = jax.random.uniform(keys[-1], (h,), jnp.float32, 0.01, 0.5)
    for job, decay_on, variant in itertools.product(args.jobs.split(","), args.decays.split(","),
                                                     args.variants.split(",")):
      if time.perf_counter() - start > args.max_seconds:
        print(f"time budget spent; skipping {(b, t, h, d, e)} {job} decay={decay_on} {variant}", flush=True)
        continue
      if job == "tangent" and decay_on == "off":
        continue  # the tangent needs a decay; without one the dq sweep is a forward sweep
      decay = rates if decay_on == "on" else None
      make = chunk_loop_candidates if variant == "chunk_loop" else parallel_candidates
      sweep = config_lib.SweepShape(**sweep_dims(d, e, job), itemsize=itemsize, job=job)
      configs = [None] + list(make(sweep, budget))
      opts = [config_lib.PallasOptions(scale=d ** -0.5, return_final_state=False, variant=variant, config=cfg,
                                       compute_capability=cc, num_sms=heuristics.num_sms(jax.devices()[0]),
                                       interpret=cc is None) for cfg in configs]
      inputs = [(q, k, v, decay, do) for q, k, v, do in sets]

      def compile_one(o):
        try:
          with tuning_cache.use_tuning_cache(None):  # the default rows run the heuristics
            return job_fn(job, o).lower(*inputs[0]).compile()
        except Exception as err:  # noqa: BLE001 - a config the compiler rejects is a result
          return err

      with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
        compiled = list(pool.map(compile_one, opts))
      want, best = None, None
      for cfg, fn in zip(configs, compiled):
        row = dict(shape=[b, t, h, d, e], job=job, decay=decay_on == "on", variant=variant,
                   config=None if cfg is None else dataclasses.asdict(cfg), default=cfg is None)
        if isinstance(fn, Exception):
          row.update(status="compile_error", error=f"{type(fn).__name__}: {str(fn)[:300]}")
        else:
          out = jax.block_until_ready(fn(*inputs[0]))
          if want is None:
            want = out
          err = max(rel_err(a, w) for a, w in zip(jax.tree.leaves(out), jax.tree.leaves(want)))
          row.update(err=err, **timing.measure(lambda i: fn(*inputs[i]), jax.block_until_ready,
                                               n_sets=len(inputs), max_iters=15, max_seconds=0.3,
                                               min_sample_seconds=args.sample_seconds))
          row["status"] = "ok" if err < 2e-2 else "wrong"
          if row["status"] == "ok" and (best is None or row["time_ms"] < best["time_ms"]):
            best = row
        rows.append(row)
      default = next(r for r in rows[-len(configs):] if r["default"])
      best_text = f"best {best['time_ms']:.3f} ms {best['config']}" if best else "no candidate compiled and agreed"
      print(f"B{b} T{t} H{h} D{d} E{e} {job:7s} decay={decay_on:3s} {variant:10s} "
            f"default {default.get('time_ms', float('nan')):.3f} ms ({default['status']})  {best_text}", flush=True)
      if args.out:
        with open(args.out, "w") as f:
          json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                         sample_seconds=args.sample_seconds, rows=rows), f, indent=1)
  if args.write_cache:
    picks = pick_configs(rows, compute_capability=cc, itemsize=itemsize, min_gain=args.cache_min_gain)
    command = ["python", "-m", "lightning_jax.tune", *(sys.argv[1:] if argv is None else argv)]
    cache = merge_picks(previous, picks, compute_capability=cc, itemsize=itemsize,
                        device=jax.devices()[0].device_kind, jax=jax.__version__,
                        date=datetime.date.today().isoformat(), command=shlex.join(command))
    cache.save(args.write_cache)
    tuned = sum(cfg is not None for cfg in picks.values())
    print(f"wrote {args.write_cache}: {tuned} of the {len(picks)} kernel configs measured are tuned, the others "
          f"keep the heuristics; {len(cache.entries)} entries in all", flush=True)

