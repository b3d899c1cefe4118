"""Shared test helpers: cases, inputs, tolerances and the check of lightning_attention against the oracles.

Imported by the test files (and conftest); it holds no tests. Most of the time
of the kernel tests is XLA compiling programs (interpret-mode kernels, oracles
and their gradients), so a check compiles one program per side (outputs and
gradients together), and the oracle's program is compiled once per case and
process, whatever the seed, variant or gradient subset that asks for it.
"""

import dataclasses
import functools
import os
import pathlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import lightning_jax as lj
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import reference

ROOT = pathlib.Path(__file__).resolve().parents[1]

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
# Relative error norm against a float32 oracle on the same (rounded) inputs. Low
# precision dtypes round scores and states to the input dtype before the matrix units.
TOL = {F32: 1e-4, BF16: 2e-2, F16: 5e-3}
# The decay gradient is a position-weighted sum over all tokens, so its rounding
# error grows with T; its tolerances are looser.
DECAY_TOL = {F32: 1e-3, BF16: 5e-2, F16: 2e-2}
ARG_NAMES = ("q", "k", "v", "decay", "initial_state")


@functools.cache
def gpu_available() -> bool:
  try:
    cc = heuristics.compute_capability(jax.devices()[0])
  except RuntimeError:
    return False
  return heuristics.supported_gpu(cc)


# The marks of a test (or parameter) that runs compiled kernels on an NVIDIA GPU.
GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU with compute capability >= 8.0"),
]


def gpu_only(test):
  """`GPU_ONLY`'s marks on a test function."""
  for mark in GPU_ONLY:
    test = mark(test)
  return test


WS = lj.WarpSpecializedConfig
# Whether this JAX lowers (and interprets) the warp-specialised forward.
WS_JAX = heuristics.jax_version() >= WS.MIN_JAX
needs_ws_jax = pytest.mark.skipif(not WS_JAX, reason=f"needs jax >= {WS.MIN_JAX}")


@functools.cache
def on_sm90() -> bool:
  try:
    return heuristics.compute_capability(jax.devices()[0]) == WS.COMPUTE_CAPABILITY
  except RuntimeError:
    return False


# The modes of a warp-specialised test: its interpreter (any backend), compiled on an sm90 GPU.
WS_MODES = [pytest.param("interpret", id="interpret", marks=needs_ws_jax),
            pytest.param("gpu", id="gpu", marks=[*GPU_ONLY, needs_ws_jax,
                                                 pytest.mark.skipif(not on_sm90(), reason="needs an sm90 GPU")])]


@dataclasses.dataclass(frozen=True)
class Case:
  b: int
  t: int
  h: int
  d: int
  e: int
  dtype: object = F32
  decay: str | None = "random"  # None, "random" or "extreme"
  initial_state: bool = True
  scale: float | None = None
  final_state: bool = True

  def __str__(self):
    name = getattr(self.dtype, "__name__", str(self.dtype))
    return (f"B{self.b}T{self.t}H{self.h}D{self.d}E{self.e}-{name}-decay_{self.decay}"
            f"-s0_{int(self.initial_state)}-scale_{self.scale}-final_{int(self.final_state)}")


def make_inputs(case: Case, seed: int):
  keys = jax.random.split(jax.random.PRNGKey(seed), 7)
  q = jax.random.normal(keys[0], (case.b, case.t, case.h, case.d), case.dtype)
  k = jax.random.normal(keys[1], (case.b, case.t, case.h, case.d), case.dtype)
  v = jax.random.normal(keys[2], (case.b, case.t, case.h, case.e), case.dtype)
  if case.decay is None:
    decay = None
  elif case.decay == "random":
    decay = jax.random.uniform(keys[3], (case.h,), F32, 0.005, 1.0)
  else:  # "extreme": no decay, fast decay, and one so fast that naive exponents overflow
    decay = jnp.array([0.0, 8.0, 60.0] * case.h, F32)[:case.h]
  s0 = jax.random.normal(keys[4], (case.b, case.h, case.d, case.e), F32) if case.initial_state else None
  do = jax.random.normal(keys[5], (case.b, case.t, case.h, case.e), F32)
  d_final = jax.random.normal(keys[6], (case.b, case.h, case.d, case.e), F32)
  return q, k, v, decay, s0, do, d_final


def loss_fn(fn, case: Case, do, d_final, *, with_outputs=False):
  """A scalar loss with random cotangents for o (and the final state); with_outputs: (loss, fn's outputs)."""

  def loss(q, k, v, decay, s0):
    out = fn(q, k, v, decay, s0)
    if case.final_state:
      o, final = out
      value = jnp.sum(o.astype(F32) * do) + jnp.sum(final * d_final)
    else:
      value = jnp.sum(out.astype(F32) * do)
    return (value, out) if with_outputs else value

  return loss


def oracle(case: Case):
  scale = case.d ** -0.5 if case.scale is None else case.scale
  ref = reference.lightning_attention_recurrent if case.t <= 64 else reference.lightning_attention_quadratic

  def fn(q, k, v, decay, s0):
    o, final = ref(q, k, v, decay, scale=scale, initial_state=s0)
    return (o, final) if case.final_state else o

  return fn


def ours(case: Case, **kwargs):
  def fn(q, k, v, decay, s0):
    return lj.lightning_attention(q, k, v, decay, scale=case.scale, initial_state=s0,
                                  return_final_state=case.final_state, **kwargs)

  return fn


def outputs_and_grads(fn, case: Case, argnums):
  """One jitted program: fn's outputs and the gradients (wrt `argnums`) of `loss_fn`.

  Called as (q, k, v, decay, s0, do, d_final): the cotangents are arguments, so
  that the program does not depend on the seed.
  """

  def run(q, k, v, decay, s0, do, d_final):
    loss = loss_fn(fn, case, do, d_final, with_outputs=True)
    (_, out), grads = jax.value_and_grad(loss, argnums, has_aux=True)(q, k, v, decay, s0)
    return out, grads

  return jax.jit(run)


@functools.cache
def oracle_outputs_and_grads(case: Case):
  """`outputs_and_grads` of the oracle, wrt every argument `case` has; one compile per case and process.

  Each gradient does not depend on which other arguments are differentiated, so
  every gradient subset of a case reads its gradients from this one program.
  """
  argnums = tuple(i for i, name in enumerate(ARG_NAMES)
                  if not (name == "decay" and case.decay is None or name == "initial_state" and not case.initial_state))
  run = outputs_and_grads(oracle(case), case, argnums)
  names = [ARG_NAMES[i] for i in argnums]

  def outputs_and_named_grads(q, k, v, decay, s0, do, d_final):
    out, grads = run(q, k, v, decay, s0, do, d_final)
    return out, dict(zip(names, grads))

  return outputs_and_named_grads


def rel_err(x, y):
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  assert np.all(np.isfinite(x)), "non-finite values"
  return np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)


def pallas_calls(jaxpr):
  """Every pallas_call equation of a jaxpr, nested jaxprs included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from pallas_calls(inner)


def check_against_oracle(case: Case, seed: int, *, argnums=None, one_device=False, **kwargs):
  """Outputs, final state and the gradients wrt `argnums` (default: every argument the case has).

  one_device: run the op inside shard_map over one device, the path of a
  single GPU (with the host's 8 CPU devices the Pallas kernels are otherwise
  partitioned over them, `auto_sharding`).
  """
  q, k, v, decay, s0, do, d_final = make_inputs(case, seed)
  args = (q, k, v, decay, s0)
  argnums = tuple(i for i, a in enumerate(args) if a is not None and (argnums is None or i in argnums))

  fn = ours(case, **kwargs)
  if one_device:
    fn = jax.shard_map(fn, mesh=cpu_mesh((1,), ("one",)), in_specs=P(), out_specs=P(), check_vma=False)
  out, grads = outputs_and_grads(fn, case, argnums)(*args, do, d_final)
  want, grads_ref = oracle_outputs_and_grads(case)(*args, do, d_final)
  o, final = out if case.final_state else (out, None)
  o_ref, final_ref = want if case.final_state else (want, None)
  chex.assert_shape(o, (case.b, case.t, case.h, case.e))
  chex.assert_type(o, case.dtype)
  tol = TOL[case.dtype]
  assert rel_err(o, o_ref) < tol, ("o", rel_err(o, o_ref))
  if case.final_state:
    chex.assert_shape(final, (case.b, case.h, case.d, case.e))
    chex.assert_type(final, F32)
    assert rel_err(final, final_ref) < tol, ("final_state", rel_err(final, final_ref))

  names = [ARG_NAMES[i] for i in argnums]
  for name, g, arg in zip(names, grads, (args[i] for i in argnums)):
    chex.assert_equal_shape((g, arg))
    chex.assert_type(g, arg.dtype)
    limit = DECAY_TOL[case.dtype] if name == "decay" else tol
    err = rel_err(g, grads_ref[name])
    assert err < limit, (name, err)


# --- several devices (the CPU's host devices: conftest asks XLA for 8) ---


def end_to_end_env(**extra) -> dict:
  """The environment of an end-to-end run in a subprocess (the benchmark CLI, a notebook): the repository on
  PYTHONPATH and, unless the caller set it, XLA's optimisations off (JAX_DISABLE_MOST_OPTIMIZATIONS=1). These runs
  check that every step completes and what it writes, not timings, and most of their time is XLA compiling."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
  env.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  return {**env, **extra}


def cpu_mesh(shape, names):
  devices = jax.devices("cpu")
  if len(devices) < int(np.prod(shape)):
    pytest.skip(f"needs {int(np.prod(shape))} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  return Mesh(np.array(devices[:int(np.prod(shape))]).reshape(shape), names)


def explicit_mesh(shape, names):
  cpu_mesh(shape, names)  # skips without enough devices
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape),
                       devices=jax.devices("cpu")[:int(np.prod(shape))])


def collectives(fn, *args):
  """{kind: [shapes of the arrays it moves]} of the collectives in fn's compiled HLO (jitted here unless it is).

  XLA combines collectives into one over a tuple of arrays: each counts.
  """
  text = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*args).compile().as_text()
  found = {}
  for kind in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"):
    for match in re.finditer(rf"= (\([^)]*\)|\S+) {kind}(-start)?\(", text):
      found.setdefault(kind, []).extend(re.findall(r"\w+\[[\d,]*\]", match.group(1)))
  return found


def elements(shape_text):
  dims = re.search(r"\[([\d,]*)\]", shape_text).group(1)
  return int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
