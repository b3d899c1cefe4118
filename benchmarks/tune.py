"""Times one sweep of the Pallas kernels over a grid of block configs, per job.

    python -m benchmarks.tune --shapes 4x8192x32x64,2x8192x32x128 --out tune.json

A sweep is the unit the heuristics of `lightning_jax.ops.lightning_attention.config`
choose blocks for: the forward pass is one `forward` sweep, the backward pass a
`tangent` sweep (dq, with the decay tangent when the decay is differentiated,
else a `forward`-like sweep) and a `dual` sweep (dk and dv). Every candidate
that fits the device's shared-memory budget is compiled, checked against the
output of the first that compiled (the default, unless it failed), and timed
with `benchmarks.timing` (samples of at least `--sample-seconds`, as in the
benchmark CLI); the JSON holds every row, and one line per (shape,
job, decay, variant) prints the default's time and status beside the best
config's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from benchmarks.cases import GPU_SAMPLE_SECONDS, parse_shapes
from lightning_jax.ops.lightning_attention import api
from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import pallas_vjp

# Explore a little past the heuristics' register limit, to check that limit.
MAX_ACCUMULATOR_REGISTERS = config_lib.MAX_ACCUMULATOR_REGISTERS + 32


def chunk_loop_candidates(dim_k, dim_v, itemsize, budget, job):
  for c, be, warps, stages in itertools.product((32, 64, 128), (32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
    if be > dim_v:
      continue
    cfg = config_lib.ChunkLoopConfig(chunk_size=c, block_e=be, num_warps=warps, num_stages=stages)
    if (cfg.shared_memory_bytes(dim_k, dim_v, itemsize, job) <= budget
        and cfg.accumulator_registers(dim_k, dim_v, job) <= MAX_ACCUMULATOR_REGISTERS):
      yield config_lib.LightningConfig(chunk_loop=cfg)


def parallel_candidates(dim_k, dim_v, itemsize, budget, job):
  for c, be, warps in itertools.product((64, 128), (32, 64, 128), (4, 8)):
    if be > dim_v:
      continue
    cfg = config_lib.ChunkOutputConfig(chunk_size=c, block_e=be, num_warps=warps, num_stages=1)
    if cfg.shared_memory_bytes(dim_k, dim_v, itemsize, job) <= budget:
      yield config_lib.LightningConfig(chunk_output=cfg)


def job_fn(job, opts):
  """The sweep of `job` as a function of (q, k, v, decay, do), as the op runs it."""
  def fn(q, k, v, decay, do):
    if job == "forward":
      return pallas_vjp.sweep(q, k, v, decay, None, reverse=False, with_final_state=False, out_dtype=q.dtype,
                              opts=opts)[0]
    if job == "tangent":
      out, _, _, row_dots, _ = pallas_vjp.sweep(do, v, k, decay, None, q, reverse=False, with_final_state=False,
                                                out_dtype=q.dtype, opts=opts)
      return out, row_dots
    dv, dk, _, _, _ = pallas_vjp.sweep(k, q, do, decay, None, dual_with=v, reverse=True, with_final_state=False,
                                       out_dtype=q.dtype, opts=opts)
    return dv, dk
  return jax.jit(fn)


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
  parser.add_argument("--sample-seconds", type=float, default=GPU_SAMPLE_SECONDS,
                      help="each timed sample lasts at least this long (see benchmarks.timing)")
  parser.add_argument("--out", default=None, help="JSON file for every row")
  args = parser.parse_args(argv)

  dtype = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}[args.dtype]
  cc = api.gpu_compute_capability()  # None: interpret mode on the CPU (a smoke test, not a tuning)
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
      dims = dict(dim_k=config_lib.padded_dim(d if job != "tangent" else e),
                  dim_v=config_lib.padded_dim(e if job != "tangent" else d))
      make = chunk_loop_candidates if variant == "chunk_loop" else parallel_candidates
      configs = [None] + list(make(**dims, itemsize=jnp.dtype(dtype).itemsize, budget=budget, job=job))
      opts = [pallas_vjp.PallasOptions(scale=d ** -0.5, return_final_state=False, variant=variant, config=cfg,
                                       compute_capability=cc, interpret=cc is None) for cfg in configs]
      inputs = [(q, k, v, decay, do) for q, k, v, do in sets]

      def compile_one(o):
        try:
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


if __name__ == "__main__":
  main()
