"""JAX implementations and the JAX side of the measurements.

Implementations: lightning_jax (`lightning_attention` with `impl="pallas"`
and each variant, and `impl="xla"`; `delta_attention` with `impl="pallas"` and
`impl="xla"`), cuDNN FlashAttention (`jax.nn.dot_product_attention(...,
implementation="cudnn", is_causal=True)`) and XLA softmax attention
(`implementation="xla"`, which materialises the T x T scores).

    python -m benchmarks.jax_impls --json-in JOBS.json --json-out RESULTS.jsonl
    python -m benchmarks.jax_impls --probe OUT.json     # device, versions, copy bandwidth

For every job, the functions of its modes are lowered from abstract shapes and
compiled (in parallel threads) before anything is timed:

* fwd:    o = f(q, k, v)
* bwd:    the VJP function of f applied to a cotangent; `jax.vjp` runs in a
          separately compiled function, before the timed region, whose output
          (the residuals) the timed function takes as its argument;
* fwdbwd: o and the VJP of f at once (o is returned, so the forward cannot be
          eliminated).

The VJP is taken with respect to q, k and v, and per-token gates (the
lightning op's per-token rates, the delta forms' beta and rates). The delta
forms' q and k are L2-normalised over D, as the models do (the delta rule needs
|k| <= 1).

Memory: XLA's compiled memory analysis of the timed function (argument,
output, temporary and aliased bytes; footprint = argument + output + temp -
alias), checked against the device's memory before running (a case that
cannot fit is reported as "oom" without running it); and the device's
`peak_bytes_in_use` after the case. JAX cannot reset that high-water mark: it
is the peak of the worker process so far. Each group runs in its own process
with jobs ordered by growing T, so the mark is normally set by the case just
run; `device_peak_raised` says whether it rose during the case (if not, the
case's own peak is at most the value recorded).

`peers/jla.py` reuses `JaxBackend` for jax-linear-attention.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import platform
import sys
import time

import jax
import jax.numpy as jnp

import lightning_jax
from benchmarks import cases, worker
from lightning_jax.tune import timing

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
# The compiled functions each mode runs: the first is timed, the others prepare its arguments.
MODE_FUNCTIONS = {"fwd": ("fwd",), "bwd": ("bwd", "vjp_fwd"), "fwdbwd": ("fwdbwd",)}


def device_info() -> dict:
  """Platform, kind, compute capability, memory limit and versions of the default device."""
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  cc = getattr(device, "compute_capability", None)
  return dict(platform=device.platform, device_kind=device.device_kind, device_count=jax.device_count(),
              compute_capability=None if cc is None else str(cc), core_count=getattr(device, "core_count", None),
              bytes_limit=stats.get("bytes_limit"), python=platform.python_version(),
              versions={"jax": jax.__version__, "lightning_jax": lightning_jax.__version__,
                        **worker.package_versions(["jaxlib", "numpy"])})


def copy_bandwidth(num_bytes: int, sample_seconds: float, warmup_seconds: float = 0.0) -> dict:
  """Device-to-device streaming bandwidth: y = x + 1 over `num_bytes` of float32 (read + write).

  The input is random, not zeros: a device may move zeros faster than data.
  Samples last `sample_seconds` after `warmup_seconds` of back-to-back calls,
  as the cases' do, so that the floors and the times carry the same share of
  the host's dispatch and sync latency and are taken at the same clocks.
  """
  x = jax.random.uniform(jax.random.PRNGKey(0), (num_bytes // 4,), jnp.float32)
  add_one = jax.jit(lambda a: a + 1).lower(x).compile()
  stats = timing.measure(lambda i: add_one(x), jax.block_until_ready, warmup=3, min_iters=10, max_iters=50,
                         max_seconds=1.0, min_sample_seconds=sample_seconds, warmup_seconds=warmup_seconds)
  moved = 2 * x.nbytes
  return dict(bytes_moved=moved, time_ms=stats["time_ms"], bandwidth_gbps=moved / stats["time_ms"] / 1e6)


def probe(path: str, sample_seconds: float, warmup_seconds: float = 0.0):
  """Writes device_info() and the copy bandwidth (1 GiB on a GPU, 16 MiB elsewhere) to `path`."""
  info = device_info()
  limit = info["bytes_limit"]
  num_bytes = min(1 << 30, limit // 8) if info["platform"] == "gpu" and limit else 16 << 20
  info["copy_bandwidth"] = copy_bandwidth(num_bytes, sample_seconds, warmup_seconds)
  with open(path, "w") as f:
    json.dump(info, f)


def bind(call, inputs: dict):
  """(attn(q, k, v, *extras) -> o, extras) for call(q, k, v, **inputs).

  The inputs (gates, segment ids) become arguments of the compiled functions,
  so that XLA cannot fold them into constants.
  """
  names = tuple(inputs)
  return (lambda q, k, v, *extras: call(q, k, v, **dict(zip(names, extras)))), tuple(inputs.values())


def lightning_or_baseline(job: dict):
  """(attn(q, k, v, *extras) -> o, extras) for the implementations of this module.

  The extras: the lightning op's decay rates, or a delta form's beta and rates
  (`cases.delta_gates`), then the segment ids, each where the job has them. A
  job with per-sequence states (`cases.states_of`) runs its rows end to end as
  one row with `cu_seqlens`, each sequence from its own initial state
  (`cases.sequence_states`) and returning its final state (o alone is kept).
  """
  impl = job["impl"]
  if impl in ("cudnn-flash", "xla-softmax"):
    backend = "cudnn" if impl == "cudnn-flash" else "xla"
    return (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=backend)), ()
  if cases.is_delta(job):
    op, gates = lightning_jax.delta_attention, cases.delta_gates(job)
    options = dict(impl=impl.removeprefix("lj-delta-"))
  else:
    op, gates = lightning_jax.lightning_attention, {"decay": cases.decay_array(job)}
    options = (dict(impl="pallas", variant=impl.removeprefix("lj-pallas-")) if impl.startswith("lj-pallas-")
               else dict(impl="xla"))
  if cases.states_of(job):
    flat = lambda x: x.reshape(1, -1, *x.shape[2:])  # noqa: E731 -- [B, T, ...] -> [1, B * T, ...]
    inputs = {**{name: jnp.asarray(flat(x) if x.ndim >= 3 else x) for name, x in gates.items() if x is not None},
              "cu_seqlens": jnp.asarray(cases.cu_seqlens(job), jnp.int32),
              "initial_state": jnp.asarray(cases.sequence_states(job))}
    return bind(lambda q, k, v, **inputs: op(flat(q), flat(k), flat(v), **inputs, return_final_state=True,
                                             **options)[0].reshape(v.shape), inputs)
  inputs = {name: jnp.asarray(x) for name, x in {**gates, "segment_ids": cases.segment_ids(job)}.items()
            if x is not None}
  return bind(lambda q, k, v, **inputs: op(q, k, v, **inputs, **options), inputs)


def refusal(job: dict, attn, extras) -> str | None:
  """The ValueError that tracing attn's forward on the job's shapes raises (an op's own check of the shapes,
  dtype, device or options, before any kernel runs), else None."""
  try:
    jax.eval_shape(attn, *_abstract_args(job, extras)["fwd"])
  except ValueError as err:
    return str(err)
  return None


def lightning_unavailable(job: dict) -> str | None:
  """Why a variant of ours cannot run this job here, else None.

  The warp-specialised forward has limits (sm90, jax >= 0.11, 16-bit inputs,
  D <= 128), which its `refusal` gives.
  """
  if job["impl"] != "lj-pallas-warp_specialized":
    return None
  return refusal(job, *lightning_or_baseline(job))


def mode_functions(attn, n_grad: int = 0):
  """The four functions of `MODE_FUNCTIONS`, for attn(q, k, v, *extras); the first `n_grad` extras are
  differentiated with q, k and v."""
  def fwd(q, k, v, *extras):
    return attn(q, k, v, *extras)

  def vjp_fwd(q, k, v, *extras):
    fixed = extras[n_grad:]
    return jax.vjp(lambda q, k, v, *grad: attn(q, k, v, *grad, *fixed), q, k, v, *extras[:n_grad])

  def bwd(vjp_fn, do):
    return vjp_fn(do)

  def fwdbwd(q, k, v, do, *extras):
    o, vjp_fn = vjp_fwd(q, k, v, *extras)
    return o, vjp_fn(do)

  return dict(fwd=fwd, vjp_fwd=vjp_fwd, bwd=bwd, fwdbwd=fwdbwd)


def _abstract_args(job: dict, extras) -> dict:
  dtype = DTYPES[job["dtype"]]
  qk = jax.ShapeDtypeStruct((job["batch"], job["seq_len"], job["heads"], job["dim_k"]), dtype)
  v = jax.ShapeDtypeStruct((job["batch"], job["seq_len"], job["heads"], job["dim_v"]), dtype)
  ex = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in extras)
  return dict(fwd=(qk, qk, v, *ex), vjp_fwd=(qk, qk, v, *ex), fwdbwd=(qk, qk, v, v, *ex))


def _compile(fn, args):
  """(compiled executable or the exception raised, seconds)."""
  start = time.perf_counter()
  try:
    compiled = jax.jit(fn).lower(*args).compile()
  except Exception as exc:  # noqa: BLE001 -- reported with the modes that need it
    compiled = exc
  return compiled, time.perf_counter() - start


def _compile_fwd_and_bwd(fns: dict, args: tuple) -> dict:
  """vjp_fwd, then bwd lowered on vjp_fwd's `out_info`: the pytree it returns at run time.

  (`jax.eval_shape` of vjp_fwd would give a VJP pytree that does not compare
  equal to the one the compiled function returns, for custom_vjp functions.)
  """
  vjp_fwd = _compile(fns["vjp_fwd"], args)
  if isinstance(vjp_fwd[0], Exception):
    return {"vjp_fwd": vjp_fwd, "bwd": (vjp_fwd[0], 0.0)}
  o, vjp_fn = vjp_fwd[0].out_info
  return {"vjp_fwd": vjp_fwd, "bwd": _compile(fns["bwd"], (vjp_fn, o))}


def compile_modes(attn, extras, job: dict, threads: int) -> dict:
  """{function name: (compiled or exception, compile seconds)} for the job's modes, compiled in parallel.

  The per-token gates, the first of the extras, are differentiated (`cases.differentiated_inputs`).
  """
  fns = mode_functions(attn, cases.differentiated_inputs(job))
  args = _abstract_args(job, extras)
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
    futures = [pool.submit(lambda m: {m: _compile(fns[m], args[m])}, mode) for mode in ("fwd", "fwdbwd")
               if mode in job["modes"]]
    if "bwd" in job["modes"]:
      futures.append(pool.submit(_compile_fwd_and_bwd, fns, args["vjp_fwd"]))
    return {name: value for f in futures for name, value in f.result().items()}


def compiled_memory(compiled) -> dict:
  """Argument, output, temp and alias bytes of a compiled function, and their footprint."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  memory = {f"{name}_bytes": int(getattr(analysis, f"{name}_size_in_bytes"))
            for name in ("argument", "output", "temp", "alias")}
  memory["footprint_bytes"] = (memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"]
                               - memory["alias_bytes"])
  return memory


def _peak_bytes():
  return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def _l2_normalize(x):
  """x over its L2 norm along the last axis (computed in float32), in x's dtype."""
  x32 = x.astype(jnp.float32)
  return (x32 / jnp.linalg.norm(x32, axis=-1, keepdims=True)).astype(x.dtype)


def make_inputs(job: dict, n_sets: int, seed: int = 0) -> list[tuple]:
  """`n_sets` (q, k, v, do) sets in the job's dtype and [B, T, H, *] layout; q and k L2-normalised for the delta
  forms.

  One random set, then copies of it: distinct buffers (what the L2 rotation
  needs) without one random-number kernel per array.
  """
  dtype = DTYPES[job["dtype"]]
  b, t, h, d, e = cases.job_shape(job)
  shapes = ((b, t, h, d), (b, t, h, d), (b, t, h, e), (b, t, h, e))
  first = tuple(jax.random.normal(jax.random.key(seed + i), shape, dtype) for i, shape in enumerate(shapes))
  if cases.is_delta(job):
    first = (*map(_l2_normalize, first[:2]), *first[2:])
  return [first] + [tuple(jnp.copy(x) for x in first) for _ in range(n_sets - 1)]


@dataclasses.dataclass
class JaxCase:
  """An open job: its compiled functions, input sets and shared extra arguments."""
  settings: dict
  compiled: dict
  inputs: list
  extras: tuple


def _check_fits(memory: dict):
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  need = memory.get("footprint_bytes")
  if limit and need and need > limit:
    raise worker.DeviceMemoryExceeded(f"compiled memory analysis needs {need / 2**30:.1f} GiB, "
                                      f"over the device's {limit / 2**30:.1f} GiB")


def _calls(case: JaxCase, mode: str):
  """call(i) running `mode` on input set i (the bwd residuals are made here, before timing)."""
  fn = {name: compiled for name, (compiled, _) in case.compiled.items()}
  if mode == "fwd":
    return lambda i: fn["fwd"](*case.inputs[i][:3], *case.extras)
  if mode == "fwdbwd":
    return lambda i: fn["fwdbwd"](*case.inputs[i], *case.extras)
  vjp_fns = [fn["vjp_fwd"](*x[:3], *case.extras)[1] for x in case.inputs]
  return lambda i: fn["bwd"](vjp_fns[i], case.inputs[i][3])


def measure_mode(case: JaxCase, mode: str) -> dict:
  """Times one mode of an open case; returns timing, memory and compile fields."""
  for name in MODE_FUNCTIONS[mode]:
    compiled, _ = case.compiled[name]
    if isinstance(compiled, Exception):
      raise compiled
  timed = case.compiled[MODE_FUNCTIONS[mode][0]][0]
  memory = compiled_memory(timed)
  _check_fits(memory)
  peak_before = _peak_bytes()
  call = _calls(case, mode)
  s = case.settings
  stats = timing.measure(call, jax.block_until_ready, n_sets=len(case.inputs), warmup=s["warmup"],
                         max_iters=s["iters"], max_seconds=s["case_seconds"], min_sample_seconds=s["sample_seconds"],
                         warmup_seconds=s["warmup_seconds"])
  peak = _peak_bytes()
  del call
  memory.update(device_peak_bytes_in_use=peak,
                device_peak_raised=None if peak is None else peak > (peak_before or 0))
  compile_s = sum(case.compiled[name][1] for name in MODE_FUNCTIONS[mode])
  return dict(**stats, memory=memory, compile_s=compile_s)


class JaxBackend(worker.Backend):
  """Worker backend for JAX implementations given by `make_attention(job) -> (attn, extras)`."""

  def __init__(self, make_attention, unavailable=lambda job: None):
    self.make_attention = make_attention
    self.unavailable = unavailable

  def info(self) -> dict:
    return device_info()

  def unavailable_reason(self, job: dict) -> str | None:
    return self.unavailable(job)

  @contextlib.contextmanager
  def open_job(self, job: dict, settings: dict):
    attn, extras = self.make_attention(job)
    compiled = compile_modes(attn, extras, job, settings["compile_threads"])
    n_sets = timing.rotation_sets(cases.input_set_bytes(job), settings["rotate_bytes"])
    yield JaxCase(settings, compiled, make_inputs(job, n_sets), extras)

  def measure(self, ctx: JaxCase, mode: str) -> dict:
    return measure_mode(ctx, mode)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--probe"]:
    probe(argv[1], *map(float, argv[2:4]))
    return
  worker.main(lambda: JaxBackend(lightning_or_baseline, lightning_unavailable), argv)


if __name__ == "__main__":
  main()
