"""Times our Pallas variants under settings of the sequence-split heuristic, to fit its constants.

    python -m benchmarks.split_sweep --out split.json [--shapes 1x32768x32x64,...]

For each shape (bf16, decay on) and each (SLICE_PROGRAMS_PER_SM,
MIN_SLICE_CHUNKS) setting of `heuristics` (0: no split), it compiles and
times the forward (chunk_loop and, on sm90, warp_specialized) and the forward
plus backward (chunk_loop sweeps), and once the parallel variant; it prints a
table of median milliseconds and writes the rows as JSON. The settings are
patched into `heuristics` before each compile (they are read at trace time).
PERFORMANCE.md ("Sequence split") cites its runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json

import jax
import jax.numpy as jnp

import lightning_jax as lj
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.tune import timing

LONG_SHAPES = "1x65536x16x128,1x32768x32x64,2x32768x8x128,1x131072x8x64,1x32768x64x128,1x8192x16x64"
SETTINGS = ((0, 8), (1, 8), (2, 8), (4, 8), (1, 16))


def _time(compiled, args_sets):
  result = timing.measure(lambda i: compiled(*args_sets[i]), jax.block_until_ready, n_sets=len(args_sets),
                          warmup=2, max_iters=20, max_seconds=0.3, min_sample_seconds=timing.GPU_SAMPLE_SECONDS)
  return result["time_ms"]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default=LONG_SHAPES, help="BxTxHxD, comma-separated")
  p.add_argument("--out", help="write the rows as JSON here")
  p.add_argument("--compile-threads", type=int, default=8)
  p.add_argument("--settings", default=";".join(f"{a},{b}" for a, b in SETTINGS),
                 help="SLICE_PROGRAMS_PER_SM,MIN_SLICE_CHUNKS pairs, ';'-separated")
  p.add_argument("--variants", default="parallel,chunk_loop,warp_specialized")
  p.add_argument("--chunk-loop", help="BLOCK_E,NUM_WARPS,NUM_STAGES of a ChunkLoopConfig(chunk_size=64) for every "
                 "sweep (default: the heuristics')")
  p.add_argument("--decay-grad", type=int, default=1, help="0: differentiate q, k, v only (as the CLI does)")
  args = p.parse_args(argv)
  settings = [tuple(int(x) for x in pair.split(",")) for pair in args.settings.split(";")]
  variants = args.variants.split(",")
  config = None
  if args.chunk_loop:
    block_e, warps, stages = (int(x) for x in args.chunk_loop.split(","))
    config = lj.LightningConfig(chunk_loop=lj.ChunkLoopConfig(chunk_size=64, block_e=block_e, num_warps=warps,
                                                              num_stages=stages))
  on_sm90 = heuristics.compute_capability(jax.devices()[0]) == (9, 0)
  rows = []
  for shape in args.shapes.split(","):
    b, t, h, d = (int(x) for x in shape.split("x"))
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    sets = [tuple(jax.random.normal(keys[4 * s + i], (b, t, h, d), jnp.bfloat16) for i in range(4))
            for s in range(2)]
    decay = jnp.linspace(0.01, 0.5, h, dtype=jnp.float32)
    sets = [(q, k, v, do, decay) for q, k, v, do in sets]

    def fwd(variant):
      return lambda q, k, v, do, decay: lj.lightning_attention(q, k, v, decay, impl="pallas", variant=variant,
                                                               config=config)

    def fwdbwd(variant):
      def fn(q, k, v, do, decay):
        attend = lambda q, k, v, decay: lj.lightning_attention(q, k, v, decay, impl="pallas",  # noqa: E731
                                                               variant=variant, config=config)
        if args.decay_grad:
          o, vjp = jax.vjp(attend, q, k, v, decay)
        else:
          o, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, decay), q, k, v)
        return o, vjp(do)
      return fn

    jobs = [("parallel", mode, None) for mode in ("fwd", "fwdbwd") if "parallel" in variants]
    for setting in settings:
      if "chunk_loop" in variants:
        jobs += [("chunk_loop", "fwd", setting), ("chunk_loop", "fwdbwd", setting)]
      if on_sm90 and "warp_specialized" in variants:
        jobs.append(("warp_specialized", "fwd", setting))
    # Traced one by one under each setting (read at trace time), compiled in parallel.
    lowered = []
    for variant, mode, setting in jobs:
      if setting is not None:
        heuristics.SLICE_PROGRAMS_PER_SM, heuristics.MIN_SLICE_CHUNKS = setting
      lowered.append(jax.jit((fwd if mode == "fwd" else fwdbwd)(variant)).lower(*sets[0]))
    with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
      compiled = list(pool.map(lambda low: low.compile(), lowered))
    for (variant, mode, setting), fn in zip(jobs, compiled):
      row = dict(shape=[b, t, h, d], variant=variant, mode=mode, setting=setting, median_ms=_time(fn, sets))
      rows.append(row)
      print(json.dumps(row), flush=True)
    if args.out:  # after every shape, so that a run cut short keeps what it measured
      with open(args.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
