"""Times the pieces of the lightning op's forward+backward by leaving parts out, per-head against per-token rates.

    python -m benchmarks.pieces [--shapes 1x32768x32x128,...] [--kinds head,token]

For each shape (bf16) and each decay kind (a per-head rate, fixed; per-token
rates, differentiated as the CLI's fwd+bwd does; per-token rates held fixed)
it times, with `--variant` (auto), the forward, the VJP with respect to q, k, v
(and the rates), and the VJP with respect to q, k or v alone: the differences
place the backward's time in its sweeps. Each kernel's own time comes from
`benchmarks.kernel_profile` under ncu.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import lightning_jax as lj
from lightning_jax.tune import timing

KINDS = ("head", "token", "token-fixed")


def _inputs(shape, kind, seed):
  b, t, h, d = shape
  keys = jax.random.split(jax.random.key(seed), 5)
  q, k, v, do = (jax.random.normal(key, (b, t, h, d), jnp.bfloat16) for key in keys[:4])
  if kind == "head":
    decay = jnp.asarray(lj.alibi_slopes(h))
  else:
    decay = jax.random.uniform(keys[4], (b, t, h), jnp.float32, 0.001, 0.1)
  return q, k, v, do, decay


def _vjp_fn(kind, wrt, variant="auto"):
  """o and the cotangents of the inputs in `wrt` (a subset of "qkvg")."""
  def fn(q, k, v, do, decay):
    args = dict(q=q, k=k, v=v, g=decay)
    names = [n for n in "qkvg" if n in wrt and not (n == "g" and kind != "token")]

    def attn(*diff):
      full = dict(args, **dict(zip(names, diff)))
      return lj.lightning_attention(full["q"], full["k"], full["v"], full["g"], impl="pallas", variant=variant)

    o, vjp = jax.vjp(attn, *(args[n] for n in names))
    return o, vjp(do)
  return fn


# What each kind times: the VJP with respect to these inputs ("" is the forward alone).
PIECES = {"head": ("", "qkv", "q", "k", "v"), "token": ("", "qkvg", "g"), "token-fixed": ("qkv", "q", "k", "v")}
COLUMNS = ("", "qkv", "qkvg", "g", "q", "k", "v")


def _pieces(kind, variant):
  def forward(q, k, v, do, decay):
    del do
    return lj.lightning_attention(q, k, v, decay, impl="pallas", variant=variant)

  return {wrt: _vjp_fn(kind, wrt, variant) if wrt else forward for wrt in PIECES[kind]}


def time_ms(fn, arg_sets, max_seconds=0.4):
  """fn's median ms, compiled for arg_sets[0] and called over the rotated sets (`lightning_jax.tune.timing`)."""
  compiled = jax.jit(fn).lower(*arg_sets[0]).compile()
  result = timing.measure(lambda i: compiled(*arg_sets[i]), jax.block_until_ready, n_sets=len(arg_sets), warmup=2,
                          max_iters=15, max_seconds=max_seconds, min_sample_seconds=timing.GPU_SAMPLE_SECONDS)
  return result["time_ms"]


def _parse(shape):
  return tuple(int(x) for x in shape.split("x"))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="1x32768x32x128,4x8192x32x64")
  p.add_argument("--kinds", default=",".join(KINDS))
  p.add_argument("--variant", default="auto")
  args = p.parse_args(argv)
  kinds = args.kinds.split(",")
  rows = []
  for shape in args.shapes.split(","):
    for kind in kinds:
      arg_sets = [_inputs(_parse(shape), kind, seed) for seed in range(2)]
      for name, fn in _pieces(kind, args.variant).items():
        ms = time_ms(fn, arg_sets)
        rows.append((shape, kind, name, ms))
        print(f"{shape:18s} {kind:12s} vjp {name or '(fwd)':6s} {ms:8.3f} ms", flush=True)
  print("\nmedian ms; columns: the VJP with respect to these inputs (fwd: the forward alone)")
  print("shape              kind         " + " ".join(f"{n or 'fwd':>9s}" for n in COLUMNS))
  for shape in args.shapes.split(","):
    for kind in kinds:
      by_name = {n: ms for s, k, n, ms in rows if s == shape and k == kind}
      print(f"{shape:18s} {kind:12s} " + " ".join(f"{by_name[n]:9.3f}" if n in by_name else f"{'-':>9s}"
                                                  for n in COLUMNS))


if __name__ == "__main__":
  main()
