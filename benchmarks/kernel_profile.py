"""Each kernel's time in one forward+backward of the lightning or the delta op, per case, from Nsight Compute.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
        python -m benchmarks.kernel_profile --cases 1x32768x32x128:head,1x32768x32x128:head:8 > ncu.csv
    python -m benchmarks.kernel_profile --summarize ncu.csv

A case is `BxTxHxD:decay[:segments]`: the lightning op with decay `none`,
`head` (ALiBi slopes, held fixed) or `token` (per-token rates, differentiated),
or the delta op with decay the form, `deltanet`, `gated_deltanet` or `kda`
(L2-normalised q and k, beta, rates and every input differentiated);
segments the sequences packed in each row (the benchmark CLI's boundaries,
`cases.segment_ids`). Each
case runs once compiled, then once more between cuProfilerStart and
cuProfilerStop after a marker kernel (`case_separator`), so that `--summarize`
splits the CSV by case (in the order of `--cases`). ncu times each kernel alone (one at a
time, clocks left as they are): compare kernels of one run, not their sum with
a CLI time. Without a GPU (`--no-profiler`, interpret mode) it only runs the cases.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import lightning_jax as lj
from benchmarks import cases as bench_cases
from benchmarks.shared_memory import FORMS as DELTA_FORMS  # the delta forms: the ndim of their rates
from lightning_jax.ops.delta_attention import api as delta_api

DECAYS = ("none", "head", "token")
MARKER = "case_separator"


def parse_case(text: str) -> tuple[tuple[int, int, int, int], str, int]:
  """`BxTxHxD:decay[:segments]` -> ((B, T, H, D), decay, segments)."""
  match = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+):(\w+)(?::(\d+))?", text)
  if match is None or match[5] not in DECAYS + tuple(DELTA_FORMS):
    raise ValueError(f"a case is BxTxHxD:decay[:segments] with decay in {DECAYS + tuple(DELTA_FORMS)}, "
                     f"got {text!r}")
  return tuple(int(match[i]) for i in range(1, 5)), match[5], int(match[6] or 1)


def _inputs(shape, decay, segments):
  """(q, k, v, do, rates, segment ids) and, for the delta forms, beta; q and k L2-normalised there, as the models
  call the op."""
  b, t, h, d = shape
  keys = jax.random.split(jax.random.key(0), 6)
  q, k, v, do = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys[:4])
  ids = bench_cases.segment_ids(dict(batch=b, seq_len=t, segments=segments))
  ids = None if ids is None else jnp.asarray(ids)
  if decay in DELTA_FORMS:
    ndim = DELTA_FORMS[decay]
    rates = None if ndim is None else jax.random.uniform(keys[4], (b, t, h, d)[:ndim], jnp.float32, 0.001, 0.2)
    beta = jax.nn.sigmoid(jax.random.normal(keys[5], (b, t, h), jnp.float32))
    q, k = (delta_api.l2_normalize(x) for x in (q, k))
    return q, k, v, do, rates, ids, beta
  rates = {"none": None, "head": jnp.asarray(lj.alibi_slopes(h)),
           "token": jax.random.uniform(keys[4], (b, t, h), jnp.float32, 0.001, 0.1)}[decay]
  return q, k, v, do, rates, ids


def _forward_backward(decay, interpret):
  if decay in DELTA_FORMS:
    def delta(q, k, v, do, rates, ids, beta):
      o, vjp = jax.vjp(lambda q, k, v, beta, rates: lj.delta_attention(
          q, k, v, beta, rates, segment_ids=ids, impl="pallas", interpret=interpret), q, k, v, beta, rates)
      return o, vjp(do)

    return jax.jit(delta)

  def attn(q, k, v, rates, ids):
    return lj.lightning_attention(q, k, v, rates, segment_ids=ids, impl="pallas", interpret=interpret)

  def fn(q, k, v, do, rates, ids):
    if decay == "token":  # a model's per-token gates are trained
      o, vjp = jax.vjp(lambda q, k, v, g: attn(q, k, v, g, ids), q, k, v, rates)
    else:
      o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, rates, ids), q, k, v)
    return o, vjp(do)

  return jax.jit(fn)


def _marker(interpret):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

  return jax.jit(lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name=MARKER,
                                          interpret=interpret)(x))


def run(case_texts, *, profiler: bool = True):
  """One profiled forward+backward per case (compiled and run once before), each after a marker kernel."""
  interpret = not profiler and jax.default_backend() == "cpu"
  cuda = ctypes.CDLL("libcuda.so.1") if profiler else None
  marker, x = _marker(interpret), jnp.zeros((16, 16), jnp.float32)
  for text in case_texts:
    shape, decay, segments = parse_case(text)
    fn, args = _forward_backward(decay, interpret), _inputs(shape, decay, segments)
    jax.block_until_ready((fn(*args), marker(x)))
    if cuda is not None:
      cuda.cuProfilerStart()
    jax.block_until_ready(marker(x))
    jax.block_until_ready(fn(*args))
    if cuda is not None:
      cuda.cuProfilerStop()
    print(f"profiled {text}", flush=True)


_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def summarize(csv_lines) -> list[list[tuple[str, float]]]:
  """ncu's CSV (`--csv --metrics gpu__time_duration.sum`) -> per case, its kernels' (name, us) in launch order."""
  rows = list(csv.reader(csv_lines))
  header = next(i for i, row in enumerate(rows) if "Kernel Name" in row)
  cols = rows[header]
  name_col, unit_col, value_col = (cols.index(c) for c in ("Kernel Name", "Metric Unit", "Metric Value"))
  by_case = []
  for row in rows[header + 1:]:
    if len(row) <= value_col:
      continue
    if MARKER in row[name_col]:
      by_case.append([])
    elif by_case:
      by_case[-1].append((row[name_col], float(row[value_col].replace(",", "")) * _TO_US[row[unit_col]]))
  return by_case


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cases", help="comma-separated BxTxHxD:decay[:segments] (decay: none, head, token, or a delta "
                                 "form: deltanet, gated_deltanet, kda)")
  p.add_argument("--summarize", metavar="CSV", help="print each case's kernels from ncu's CSV")
  p.add_argument("--min-us", type=float, default=3.0, help="kernels shorter than this are summed, not listed")
  p.add_argument("--no-profiler", action="store_true", help="run the cases without cuProfilerStart (no GPU needed)")
  args = p.parse_args(argv)
  if args.summarize:
    with open(args.summarize) as f:
      per_case = summarize(f)
    names = args.cases.split(",") if args.cases else [f"case {i}" for i in range(len(per_case))]
    for name, kernels in zip(names, per_case):
      print(f"== {name}: {sum(us for _, us in kernels):.1f} us in {len(kernels)} kernels")
      small = [us for _, us in kernels if us < args.min_us]
      for kernel, us in kernels:
        if us >= args.min_us:
          print(f"   {us:9.1f}  {kernel[:70]}")
      if small:
        print(f"   {sum(small):9.1f}  ({len(small)} kernels under {args.min_us} us)")
    return
  if not args.cases:
    p.error("--cases is required to run")
  run(args.cases.split(","), profiler=not args.no_profiler)


if __name__ == "__main__":
  main()
