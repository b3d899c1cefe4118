"""Times `delta_attention` (or `lightning_attention`) with `cu_seqlens` and per-sequence states, beside the same
row without them.

    python -m benchmarks.sequence_states [--op delta|lightning] [--decay head|token]
        [--cases 32768x16x128x8,32768x8x64x8] [--paths xla,pallas,pallas-triton,packed,unpacked]

Each case TxHxDxN is one row (B = 1) of T tokens cut into N random-length
sequences (seed 0), bf16, D = E: Gated DeltaNet (per-token rates), or with
`--op lightning` the lightning op with ALiBi's per-head rates (held fixed; no
`pallas-triton` path: its Pallas kernels are the variant rule's), or with
`--decay token` per-token rates in [0, 0.1) (differentiated). The paths:
`xla` and `pallas`, per-sequence initial and final states ([N, H, D, E]) on the
chunked jnp path and on the Pallas kernels (on sm90 the warp-specialised
forward; `pallas-triton`, the Triton sweeps forced); `packed`, the same cu_seqlens with
no states (the packed row's kernels); `unpacked`, no cu_seqlens. Each is
compiled, run twice, then timed as the median of `--calls` calls, each waited
for (wall time: launches included), forward and forward plus backward of every
input. PERFORMANCE.md ("Open gaps", per-sequence states) cites its runs: the
benchmark CLI's packed cases take segment ids, without per-sequence states.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import jax
import jax.numpy as jnp

import lightning_jax as lj

PATHS = {"xla": dict(impl="xla", states=True), "pallas": dict(impl="pallas", states=True),
         "pallas-triton": dict(impl="pallas", states=True, config=lj.DeltaConfig(warp_specialized=False)),
         "packed": dict(impl="pallas", states=False), "unpacked": dict(impl="pallas", states=False, unpacked=True)}


def _inputs(t, h, d, n, seed=0):
  """q, k, v [1, T, H, D] bf16 (k L2-normalised), beta [1, T, H], rates [1, T, H], cu_seqlens [N + 1], states
  [N, H, D, D]."""
  keys = jax.random.split(jax.random.key(seed), 8)
  q = jax.random.normal(keys[0], (1, t, h, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, t, h, d))
  k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, t, h, d), jnp.bfloat16)
  beta = jax.random.uniform(keys[3], (1, t, h))
  rates = jax.random.uniform(keys[4], (1, t, h), maxval=0.1)
  cu = jnp.asarray([0, *sorted(random.Random(seed).sample(range(1, t), n - 1)), t], jnp.int32)
  return q, k, v, beta, rates, cu, 0.1 * jax.random.normal(keys[5], (n, h, d, d))


def _median_ms(fn, args, calls):
  """(median ms of `calls` waited calls after two, seconds of the first call)."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  first = time.perf_counter() - start
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times), first


def time_case(case: str, path: str, calls: int, op: str = "delta", decay: str = "head") -> str:
  """One line: the case, the path, forward and fwd+bwd median ms (and their first calls' seconds)."""
  t, h, d, n = (int(x) for x in case.split("x"))
  q, k, v, beta, rates, cu, s0 = _inputs(t, h, d, n)
  options = PATHS[path]
  cotangent = jax.random.normal(jax.random.key(9), v.shape, jnp.bfloat16)

  def attention(q, k, v, beta, rates, s0):
    kw = dict(impl=options["impl"])
    if not options.get("unpacked"):
      kw["cu_seqlens"] = cu
    if options["states"]:
      kw.update(initial_state=s0, return_final_state=True)
    if op == "lightning":
      return lj.lightning_attention(q, k, v, lj.alibi_slopes(h) if decay == "head" else rates, **kw)
    return lj.delta_attention(q, k, v, beta, rates, config=options.get("config"), **kw)

  def loss(*args):
    out = attention(*args)
    o, finals = out if options["states"] else (out, None)
    return jnp.sum(o.astype(jnp.float32) * cotangent) + (0.0 if finals is None else jnp.sum(finals))

  args = (q, k, v, beta, rates, s0)
  forward, first_forward = _median_ms(jax.jit(attention), args, calls)
  # The lightning op's ALiBi rates are fixed: q, k, v (and its per-token rates, and the states).
  argnums = (0, 1, 2) + ((3, 4) if op == "delta" else (4,) if decay == "token" else ()) + (
      (5,) if options["states"] else ())
  both, first_both = _median_ms(jax.jit(jax.grad(loss, argnums=argnums)), args, calls)
  return (f"{case:18s} {path:13s} fwd {forward:9.3f} ms  fwd+bwd {both:9.3f} ms  "
          f"(first calls {first_forward:.0f} s, {first_both:.0f} s)")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cases", default="32768x16x128x8,32768x8x64x8", help="TxHxDxN, comma-separated")
  p.add_argument("--paths", help=f"comma-separated, of {', '.join(PATHS)} (default: every path of the op)")
  p.add_argument("--calls", type=int, default=15)
  p.add_argument("--op", choices=("delta", "lightning"), default="delta")
  p.add_argument("--decay", choices=("head", "token"), default="head", help="the lightning op's rates")
  args = p.parse_args(argv)
  choices = [path for path in PATHS if args.op == "delta" or path != "pallas-triton"]
  paths = args.paths.split(",") if args.paths else choices
  if unknown := set(paths) - set(choices):
    raise SystemExit(f"unknown --paths {sorted(unknown)} for --op {args.op}: choose from {', '.join(choices)}")
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.op}"
        f"{f', {args.decay} rates' if args.op == 'lightning' else ''}", flush=True)
  for case in args.cases.split(","):
    for path in paths:
      print(time_case(case, path, args.calls, args.op, args.decay), flush=True)


if __name__ == "__main__":
  main()
