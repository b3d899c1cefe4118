"""delta_attention (DeltaNet, Gated DeltaNet, KDA): the oracle against a float64 loop, every impl against the oracle.

Outputs, final states and the gradients of every array input (q, k, v, beta,
decay, initial_state) on odd T, D and E, with packed sequences, rates from 1e-7
to 1e4 in one call, beta near 0 and 2; the errors of bad input.
"""

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BF16, F32, TOL, rel_err

import lightning_jax as lj
from lightning_jax.ops.delta_attention import reference
from lightning_jax.ops.delta_attention import xla

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")

ARG_NAMES = ("q", "k", "v", "beta", "decay", "initial_state")
SHARED_MEMORY = pathlib.Path(__file__).parent.parent / "benchmarks" / "tuning" / "delta-shared-memory.json"


@dataclasses.dataclass(frozen=True)
class Case:
  b: int = 2
  t: int = 45
  h: int = 2
  d: int = 9
  e: int = 7
  decay: str | None = "token"  # None (DeltaNet), "token" [B, T, H] (Gated DeltaNet), "channel" [B, T, H, D] (KDA)
  rates: str = "moderate"  # or "extreme": 1e-7 and 1e4 mixed; "steep": 2.5 to 5 (KDA's 16-row spans near the
  # largest the kernels factor through a block's first row, on both sides of it)
  beta: str = "uniform"  # [0, 2], or "edges": 0, 1e-4, 2 - 1e-4, 2
  segments: bool = False
  initial_state: bool = True

  def __str__(self):
    return (f"B{self.b}T{self.t}H{self.h}D{self.d}E{self.e}-decay_{self.decay}-{self.rates}-beta_{self.beta}"
            f"-seg{int(self.segments)}-s0_{int(self.initial_state)}")


def make_inputs(case, seed=0):
  keys = jax.random.split(jax.random.key(seed), 8)
  shape = (case.b, case.t, case.h)
  q = jax.random.normal(keys[0], (*shape, case.d))
  k = jax.random.normal(keys[1], (*shape, case.d))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)  # the delta rule's contraction needs |k| <= 1
  v = jax.random.normal(keys[2], (*shape, case.e))
  if case.beta == "edges":
    beta = jnp.asarray([0.0, 1e-4, 2 - 1e-4, 2.0])[jax.random.randint(keys[3], shape, 0, 4)]
  else:
    beta = jax.random.uniform(keys[3], shape, maxval=2.0)
  decay = None
  if case.decay is not None:
    rate_shape = shape if case.decay == "token" else (*shape, case.d)
    decay = jax.random.uniform(keys[4], rate_shape, maxval=0.6)
    if case.rates == "extreme":
      decay = jnp.where(jax.random.bernoulli(keys[5], 0.2, rate_shape), 1e4, 1e-7)
    elif case.rates == "steep":
      decay = jax.random.uniform(keys[4], rate_shape, minval=2.5, maxval=5.0)
  s0 = jax.random.normal(keys[6], (case.b, case.h, case.d, case.e)) if case.initial_state else None
  ids = None
  if case.segments:  # boundaries inside chunks, a length-1 segment, one on a 16-token edge
    ids = jnp.cumsum(jax.random.bernoulli(keys[7], 0.1, (case.b, case.t)), axis=1).astype(jnp.int32)
    ids = ids.at[:, 16].add(50).at[:, 17:].add(100)
  return q, k, v, beta, decay, s0, ids


def loop64(q, k, v, beta, decay, s0, ids, scale):
  """The recurrence in float64 numpy, token by token (the oracle's oracle)."""
  q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
  b, t, h, d = q.shape
  a = np.ones((b, t, h, d)) if decay is None else np.exp(-np.asarray(decay, np.float64))
  a = np.broadcast_to(a[..., None] if a.ndim == 3 else a, (b, t, h, d))
  state = np.zeros((b, h, d, v.shape[-1])) if s0 is None else np.asarray(s0, np.float64).copy()
  o = np.zeros(v.shape)
  for bi in range(b):
    for ti in range(t):
      if ids is not None and ti > 0 and ids[bi, ti] != ids[bi, ti - 1]:
        state[bi] = 0.0
      for hi in range(h):
        s = a[bi, ti, hi][:, None] * state[bi, hi]
        kk = k[bi, ti, hi]
        s = s + beta[bi, ti, hi] * np.outer(kk, v[bi, ti, hi] - kk @ s)
        state[bi, hi] = s
        o[bi, ti, hi] = scale * q[bi, ti, hi] @ s
  return o, state


@pytest.mark.parametrize("case", [Case(), Case(decay=None, segments=True), Case(decay="channel", segments=True),
                                  Case(decay="channel", rates="extreme", beta="edges")], ids=str)
def test_oracle_matches_float64_loop(case):
  q, k, v, beta, decay, s0, ids = make_inputs(case)
  o, final = reference.delta_attention_recurrent(q, k, v, beta, decay, scale=0.4, initial_state=s0, segment_ids=ids)
  o64, final64 = loop64(q, k, v, beta, decay, s0, None if ids is None else np.asarray(ids), 0.4)
  assert rel_err(o, o64) < 1e-5 and rel_err(final, final64) < 1e-5


def value_and_grads(impl, with_final_state=True, **kwargs):
  """jit(value_and_grad) of <o, do> + <final state, dfinal> (without the final state: of <o, do>; final None)."""
  def loss(q, k, v, beta, decay, s0, ids, do, dfinal):
    out = lj.delta_attention(q, k, v, beta, decay, initial_state=s0, segment_ids=ids,
                             return_final_state=with_final_state, impl=impl, **kwargs)
    o, final = out if with_final_state else (out, None)
    value = jnp.sum(o.astype(jnp.float32) * do)
    return (value if final is None else value + jnp.sum(final * dfinal)), (o, final)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))


CHUNKED_CASES = [
    Case(),
    Case(t=77, d=16, e=24, decay=None, segments=True),
    Case(t=130, d=5, e=3, decay="channel", segments=True),
    Case(t=64, decay="channel", rates="extreme", beta="edges"),
    Case(b=1, t=1, h=3, decay="token"),
    Case(t=70, decay="token", rates="extreme", beta="edges", segments=True, initial_state=False),
]


@pytest.mark.parametrize("case", CHUNKED_CASES, ids=str)
def test_chunked_matches_oracle(case):
  q, k, v, beta, decay, s0, ids = make_inputs(case, seed=1)
  cot = jax.random.split(jax.random.key(2), 2)
  do = jax.random.normal(cot[0], v.shape)
  dfinal = jax.random.normal(cot[1], (case.b, case.h, case.d, case.e))
  args = (q, k, v, beta, decay, s0, ids, do, dfinal)
  (_, (o, final)), grads = value_and_grads("xla")(*args)
  (_, (o_ref, final_ref)), grads_ref = value_and_grads("reference")(*args)
  assert rel_err(o, o_ref) < 1e-4 and rel_err(final, final_ref) < 1e-4
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads if g is not None)
  for name, g, g_ref in zip(ARG_NAMES, grads, grads_ref):
    if g_ref is not None:
      assert rel_err(g, g_ref) < 1e-3, (name, rel_err(g, g_ref))


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_cumsum_is_each_chunks_sums(chunk_size):
  """The kernels' chunk-local sums (a product with a triangle of ones) against float64 sums per chunk, with their
  vjp (the sums to each chunk's end, also as `chunk_sums_to_end` forms them, negated), on rates from 1e-7 to 1e4
  and trailing dims of any size."""
  from lightning_jax.ops.delta_attention import chunk

  keys = jax.random.split(jax.random.key(21), 3)
  shape = (2, 3 * chunk_size, 3, 5)
  x = jnp.exp(jax.random.uniform(keys[0], shape, minval=np.log(1e-7), maxval=np.log(1e4)))
  got, vjp = jax.vjp(jax.jit(lambda x: chunk.chunk_cumsum(x, chunk_size=chunk_size)), x)
  chunks = np.asarray(x, np.float64).reshape(2, 3, chunk_size, 3, 5)
  np.testing.assert_allclose(got, np.cumsum(chunks, axis=2).reshape(shape), rtol=1e-6)
  cot = jax.random.normal(keys[1], shape)
  want = np.cumsum(np.asarray(cot, np.float64).reshape(chunks.shape)[:, :, ::-1], axis=2)[:, :, ::-1]
  atol = 1e-5 * float(jnp.max(jnp.abs(cot)))
  np.testing.assert_allclose(vjp(cot)[0], want.reshape(shape), rtol=1e-5, atol=atol)
  np.testing.assert_allclose(chunk.chunk_sums_to_end(cot, chunk_size=chunk_size, sign=-1.0), -want.reshape(shape),
                             rtol=1e-5, atol=atol)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_sizes(chunk_size):
  case = Case(t=50, decay="channel", segments=True)
  q, k, v, beta, decay, s0, ids = make_inputs(case, seed=3)
  # Jitted: one program each (eager, every op compiled on its own).
  got = jax.jit(lambda *a: xla.delta_attention_chunked(*a, scale=0.3, initial_state=s0, segment_ids=ids,
                                                       chunk_size=chunk_size))(q, k, v, beta, decay)
  want = jax.jit(lambda *a: reference.delta_attention_recurrent(*a, scale=0.3, initial_state=s0,
                                                                segment_ids=ids))(q, k, v, beta, decay)
  assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1], want[1]) < 1e-5


def test_bfloat16_inputs_float32_state():
  case = Case(t=40, d=16, e=16, decay="channel")
  q, k, v, beta, decay, s0, _ = make_inputs(case, seed=4)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  run = lambda impl: jax.jit(lambda: lj.delta_attention(q, k, v, beta, decay, initial_state=s0,  # noqa: E731
                                                        return_final_state=True, impl=impl))()
  o, final = run("xla")
  o_ref, final_ref = run("reference")
  assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
  assert rel_err(o, o_ref) < 1e-2 and rel_err(final, final_ref) < 1e-4


def test_cu_seqlens_equals_sequences_alone():
  lengths = (5, 0, 23, 1, 18)
  cu = jnp.asarray(np.cumsum((0,) + lengths), jnp.int32)
  case = Case(b=1, t=sum(lengths), decay="channel", initial_state=False)
  q, k, v, beta, decay, _, _ = make_inputs(case, seed=5)
  s0 = jax.random.normal(jax.random.key(6), (len(lengths), case.h, case.d, case.e))
  # Each call jitted: one program per call and shape (eager, every op compiled on its own).
  call = jax.jit(lj.delta_attention, static_argnames=("return_final_state", "impl"))
  o = call(q, k, v, beta, decay, cu_seqlens=cu, impl="xla")
  o_ref, finals = call(q, k, v, beta, decay, cu_seqlens=cu, initial_state=s0, return_final_state=True,
                       impl="reference")
  for n, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
    alone = lambda x: x[:, lo:hi]  # noqa: E731
    if hi > lo:
      want = call(*map(alone, (q, k, v, beta, decay)), impl="reference")
      assert rel_err(o[:, lo:hi], want) < 1e-5
      want, want_final = call(*map(alone, (q, k, v, beta, decay)), initial_state=s0[n:n + 1],
                              return_final_state=True, impl="reference")
      assert rel_err(o_ref[:, lo:hi], want) < 1e-6 and rel_err(finals[n], want_final[0]) < 1e-6
    else:
      np.testing.assert_array_equal(finals[n], s0[n])


def check_sequence_states(decay, dtype, states, lengths=(5, 0, 70, 1, 53, 18, 0), **kw):
  """Per-sequence states with cu_seqlens against the oracle (states: "both", "initial" or "final" given):
  boundaries inside 64-token chunks and on their edges, empty and length-1 sequences, one longer than a chunk, D and
  E off the blocks (by default; lengths: the sequences'); outputs, per-sequence final states and every gradient.
  kw: delta_attention's impl and the rest."""
  cu = jnp.asarray(np.cumsum((0,) + lengths), jnp.int32)
  case = Case(b=1, t=sum(lengths), decay=decay, initial_state=False)
  q, k, v, beta, rates, _, _ = make_inputs(case, seed=7)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  keys = jax.random.split(jax.random.key(8), 3)
  s0 = None if states == "final" else jax.random.normal(keys[0], (len(lengths), case.h, case.d, case.e))
  do = jax.random.normal(keys[1], v.shape)
  dfinal = jax.random.normal(keys[2], (len(lengths), case.h, case.d, case.e))
  with_final = states != "initial"

  def value_and_grads(**options):
    def loss(q, k, v, beta, rates, s0, cu):
      out = lj.delta_attention(q, k, v, beta, rates, initial_state=s0, cu_seqlens=cu, return_final_state=with_final,
                               **options)
      o, finals = out if with_final else (out, None)
      return jnp.sum(o * do) + (jnp.sum(finals * dfinal) if with_final else 0.0), (o, finals)
    argnums = (0, 1, 2, 3, 4) + ((5,) if s0 is not None else ())
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))

  (_, (o, finals)), grads = value_and_grads(**kw)(q, k, v, beta, rates, s0, cu)
  (_, (o_ref, finals_ref)), grads_ref = value_and_grads(impl="reference")(q, k, v, beta, rates, s0, cu)
  tol = TOL[dtype] if dtype == BF16 else 1e-4
  assert o.dtype == dtype and rel_err(o, o_ref) < tol
  if with_final:
    assert finals.dtype == F32 and rel_err(finals, finals_ref) < tol
    for n in np.flatnonzero(np.asarray(lengths) == 0):  # empty: its initial state
      np.testing.assert_array_equal(finals[n], 0.0 if s0 is None else s0[n])
  for name, g, g_ref in zip(ARG_NAMES, grads, grads_ref):
    if g_ref is not None:
      assert rel_err(g, g_ref) < (3e-2 if dtype == BF16 else 1e-3), (name, rel_err(g, g_ref))


@pytest.mark.parametrize("decay", [None, "token", "channel"])
def test_cu_seqlens_states_chunked_matches_oracle(decay):
  """xla's chunk-aligned sequences (auto's choice off the GPU), in float32."""
  check_sequence_states(decay, F32, "both", impl="xla")


@pytest.mark.parametrize("decay,dtype,states", [(None, "float32", "both"), ("token", "float32", "both"),
                                                ("channel", "float32", "both"), ("token", "bfloat16", "both"),
                                                ("channel", "float32", "initial"), (None, "float32", "final")])
def test_cu_seqlens_states_pallas_matches_oracle(decay, dtype, states, kernel_mode):
  """Pallas' (the Triton sweeps, each sequence's state set at its first chunk): float32 for each decay form,
  bfloat16, and with initial or final states alone."""
  dtype = {"float32": F32, "bfloat16": BF16}[dtype]
  check_sequence_states(decay, dtype, states, impl="pallas", interpret=kernel_mode)


def test_cu_seqlens_states_pallas_last_sequence_runs_the_trailing_chunks():
  """A program per sequence: the last one (non-empty here, ending inside a chunk) also runs the layout's trailing
  zero chunks, and a first sequence without tokens gets its initial state."""
  check_sequence_states("token", F32, "both", lengths=(0, 64, 3, 90), impl="pallas", interpret=True)


def test_cu_seqlens_states_pallas_takes_any_chunks():
  """The layout follows the config's largest chunk (128 here, over the 64 of the backward's default)."""
  check_sequence_states("token", F32, "both", impl="pallas", interpret=True,
                        config=lj.DeltaConfig(chunk_size=16, backward_chunk_size=128))


def test_cu_seqlens_states_pallas_lowers_for_cuda():
  """The Triton sweeps with per-sequence states (each chunk's sequence marks loaded as scalars, a sequence's tile
  read or written at a traced row) lower for CUDA from any backend, forward and backward (interpret mode checks
  their arithmetic, not their Triton lowering)."""
  from lightning_jax.ops.delta_attention import pallas_triton
  from lightning_jax.ops.delta_attention import vjp
  from lightning_jax.ops.lightning_attention import heuristics

  if heuristics.jax_version() >= (0, 11) and jax.devices()[0].platform != "gpu":
    pytest.skip("jax >= 0.11 lowers Pallas Triton for CUDA only beside a GPU (the README's tier, jax 0.10, runs it)")
  t, h, d, e, s = 256, 2, 64, 48, 3
  config = dataclasses.replace(pallas_triton.default_config(per_channel_gate=False, dtype=BF16, dim_k=d, dim_v=e,
                                                            compute_capability=(9, 0), batch_heads=h, num_sms=132),
                               warp_specialized=False, sequence_pieces=1)
  opts = vjp.PallasOptions(scale=0.125, with_final_state=True, config=config, interpret=False)

  def loss(q, k, v, beta, rates, first, end, s0):
    o, finals = vjp.delta_attention_sequences_pallas(q, k, v, beta, rates, first, end, s0, opts)
    return jnp.sum(o.astype(F32)) + jnp.sum(finals)

  spec = jax.ShapeDtypeStruct
  args = (spec((1, t, h, d), BF16), spec((1, t, h, d), BF16), spec((1, t, h, e), BF16), spec((1, t, h), F32),
          spec((1, t, h), F32), spec((s,), jnp.int32), spec((s,), jnp.int32), spec((s, h, d, e), F32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 7))).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("delta_attention_sweep") >= 2 and "delta_attention_state_cotangents" in text


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_cu_seqlens_states_trace_once(impl):
  case = Case(b=1, t=40, decay="token", initial_state=False)
  q, k, v, beta, rates, _, _ = make_inputs(case, seed=9)
  s0 = jnp.ones((3, case.h, case.d, case.e))
  traces = []

  @jax.jit
  def run(cu):
    traces.append(cu)
    return lj.delta_attention(q, k, v, beta, rates, initial_state=s0, cu_seqlens=cu, return_final_state=True,
                              impl=impl)

  for lengths in ((10, 20, 10), (0, 39, 1)):
    cu = jnp.asarray(np.cumsum((0,) + lengths), jnp.int32)
    o, finals = run(cu)
    o_ref, finals_ref = lj.delta_attention(q, k, v, beta, rates, initial_state=s0, cu_seqlens=cu,
                                           return_final_state=True, impl="reference")
    assert rel_err(o, o_ref) < 1e-4 and rel_err(finals, finals_ref) < 1e-4
  assert len(traces) == 1


def test_normalize_qk_is_the_models_l2_norm():
  case = Case(t=20, decay="token")
  q, k, v, beta, decay, s0, _ = make_inputs(case, seed=7)
  q, k = 3.0 * q, 0.5 * jax.random.normal(jax.random.key(8), k.shape)
  norm = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)  # noqa: E731
  got = jax.jit(lambda q, k: lj.delta_attention(q, k, v, beta, decay, normalize_qk=True, impl="xla"))(q, k)
  want = jax.jit(lambda q, k: lj.delta_attention(norm(q), norm(k), v, beta, decay, impl="reference"))(q, k)
  assert rel_err(got, want) < 1e-5
  grad = lambda f: jax.jit(jax.grad(lambda q, k: jnp.sum(f(q, k) * v)))(q, k)  # noqa: E731
  g1 = grad(lambda q, k: lj.delta_attention(q, k, v, beta, decay, normalize_qk=True, impl="xla"))
  g2 = grad(lambda q, k: lj.delta_attention(norm(q), norm(k), v, beta, decay, impl="reference"))
  assert rel_err(g1, g2) < 1e-4


def test_numerical_gradients():
  case = Case(b=1, t=21, h=1, d=4, e=3, decay="channel", segments=True)
  q, k, v, beta, decay, s0, ids = make_inputs(case, seed=9)
  beta = 0.2 + 0.6 * beta  # away from the ends, where finite differences leave [0, 2]

  def f(q, k, v, beta, decay, s0):
    o, final = lj.delta_attention(q, k, v, beta, decay + 0.05, initial_state=s0, segment_ids=ids,
                                  return_final_state=True, impl="xla")
    return jnp.sum(jnp.sin(o)) + jnp.sum(final ** 2)

  # float32 central differences: eps and tolerances sized to its rounding. Jitted: one program for the many
  # evaluations (eager, every op compiled on its own).
  jax.test_util.check_grads(jax.jit(f), (q, k, v, beta, decay, s0), order=1, modes=("rev",), eps=3e-3, atol=2e-2,
                            rtol=2e-2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(k=jnp.zeros((2, 9, 2, 6))), ValueError, r"k must be \[B, T, H, D\]"),
    (dict(v=jnp.zeros((2, 8, 2, 4))), ValueError, r"v must be \[B, T, H, E\]"),
    (dict(beta=jnp.zeros((2, 9))), ValueError, r"beta must be \[B, T, H\]"),
    (dict(beta=jnp.full((2, 9, 2), 2.5)), ValueError, r"beta must be finite and in \[0, 2\]"),
    (dict(decay=jnp.zeros((2,))), ValueError, r"decay must be None, per-token rates \[B, T, H\]"),
    (dict(decay=-jnp.ones((2, 9, 2))), ValueError, "decay rates must be finite and >= 0"),
    (dict(initial_state=jnp.zeros((2, 2, 5, 5))), ValueError, r"initial_state must be \[B, H, D, E\]"),
    (dict(segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, r"segment_ids must be None or an int \[B, T\]"),
    (dict(q=jnp.zeros((2, 9, 2, 5), jnp.int32)), TypeError, "q must be float32"),
    (dict(normalize_qk=1), TypeError, "normalize_qk must be a bool"),
    (dict(impl="cuda"), ValueError, "impl must be one of"),
    (dict(decay=jnp.zeros((2, 9, 2, 5)), config=lj.DeltaConfig(split_backward=True)), ValueError,
     r"split_backward=True\) takes a scalar decay per token or none"),
])
def test_bad_input_errors(kwargs, error, match):
  args = dict(q=jnp.zeros((2, 9, 2, 5)), k=jnp.zeros((2, 9, 2, 5)), v=jnp.zeros((2, 9, 2, 4)),
              beta=jnp.zeros((2, 9, 2)))
  args.update(kwargs)
  with pytest.raises(error, match=match):
    lj.delta_attention(**args)


PALLAS_CASES = [
    Case(t=77, d=9, e=20, decay="token", segments=True),
    Case(t=130, d=16, e=24, decay="channel", segments=True),
    Case(t=64, d=5, e=3, decay="channel", rates="extreme", beta="edges"),
    Case(t=50, d=32, e=16, decay=None, initial_state=False),
    Case(b=1, t=40, h=1, d=256, e=200, decay="channel"),  # the largest head dims, whole in a block
]


@pytest.mark.parametrize("case", PALLAS_CASES, ids=str)
def test_pallas_matches_oracle(case, kernel_mode):
  q, k, v, beta, decay, s0, ids = make_inputs(case, seed=11)
  run = lambda impl, **kw: lj.delta_attention(q, k, v, beta, decay, initial_state=s0, segment_ids=ids,  # noqa: E731
                                              return_final_state=True, impl=impl, **kw)
  o, final = jax.jit(lambda: run("pallas", interpret=kernel_mode))()
  o_ref, final_ref = jax.jit(lambda: run("reference"))()
  assert rel_err(o, o_ref) < 1e-4 and rel_err(final, final_ref) < 1e-4


@pytest.mark.parametrize("case", [Case(t=40, d=8, e=16, decay="channel", segments=True),
                                  Case(t=75, d=20, e=9, decay="token", initial_state=False),
                                  Case(b=1, t=33, d=16, e=16, decay=None, segments=True),
                                  # the largest head dims in float32: the blocks default_config shrinks to fit
                                  Case(b=1, t=40, h=1, d=256, e=200, decay="token", initial_state=False)], ids=str)
def test_pallas_gradients(case, kernel_mode):
  q, k, v, beta, decay, s0, ids = make_inputs(case, seed=12)
  cot = jax.random.split(jax.random.key(13), 2)
  args = (q, k, v, beta, decay, s0, ids, jax.random.normal(cot[0], v.shape),
          jax.random.normal(cot[1], (case.b, case.h, case.d, case.e)))
  (_, (o, _)), grads = value_and_grads("pallas", interpret=kernel_mode)(*args)
  (_, (o_ref, _)), grads_ref = value_and_grads("reference")(*args)
  assert rel_err(o, o_ref) < 1e-4
  for name, g, g_ref in zip(ARG_NAMES, grads, grads_ref):
    assert (g is None) == (g_ref is None), name
    if g_ref is not None:
      assert rel_err(g, g_ref) < 1e-3, (name, rel_err(g, g_ref))


@pytest.mark.parametrize("case, config", [
    (Case(b=1, t=100, d=8, e=40, decay="channel", segments=True, rates="extreme", beta="edges"),
     dict(chunk_size=16, backward_chunk_size=64, block_e=16)),
    (Case(b=1, t=70, d=5, e=3, decay="token", segments=True, rates="extreme", beta="edges"),
     dict(chunk_size=64, backward_chunk_size=16, split_backward=False)),
    (Case(b=1, t=77, d=40, e=24, decay="token", segments=True, rates="extreme", beta="edges"),
     dict(backward_chunk_size=32, block_d=16, block_e=16)),
    (Case(b=1, t=90, d=12, e=70, decay=None, segments=True), dict(backward_chunk_size=64, block_e=16)),
    (Case(b=1, t=80, d=24, e=16, decay="channel", rates="steep"), dict(chunk_size=64, backward_chunk_size=32)),
    # The H200 defaults' 64 value columns in one program (small B H picks fewer, `default_config`).
    (Case(b=1, t=70, d=33, e=50), dict(block_e=64)),
], ids=str)
def test_pallas_gradients_any_blocks(case, config, kernel_mode):
  """The backward's own chunking (several 16-row blocks, one), several D and E steps, the split gradient kernels
  and the one per chunk with a scalar gate, extreme rates, beta at 0 and 2."""
  q, k, v, beta, decay, s0, ids = make_inputs(case, seed=17)
  cot = jax.random.split(jax.random.key(18), 2)
  args = (q, k, v, beta, decay, s0, ids, jax.random.normal(cot[0], v.shape), jax.random.normal(cot[1], s0.shape))
  _, grads = value_and_grads("pallas", interpret=kernel_mode, config=lj.DeltaConfig(**config))(*args)
  _, grads_ref = value_and_grads("reference")(*args)
  for name, g, g_ref in zip(ARG_NAMES, grads, grads_ref):
    if g_ref is not None:
      assert rel_err(g, g_ref) < 1e-4, (name, rel_err(g, g_ref))


SPLIT_CASES = [
    # 150 tokens in 4 pieces of 64: the third partly, the fourth wholly padding.
    (Case(b=1, t=150, d=8, e=12, decay="token", segments=True), 4, True),
    # Without the final state: every piece's map with two rows; the last one's not formed with one row.
    (Case(b=2, t=130, d=6, e=5, decay="channel", initial_state=False), 2, False),
    (Case(b=1, t=200, d=16, e=16, decay=None, beta="edges", segments=True), 4, False),
]


@pytest.mark.parametrize("case, pieces, with_final_state", SPLIT_CASES, ids=str)
def test_sequence_split_matches_oracle(case, pieces, with_final_state, kernel_mode, monkeypatch):
  """Each row cut into pieces run in parallel from their true initial states (`sequence_split`): outputs, final
  state and the gradient of every input as the token-serial oracle's, with a segment starting at a piece's first
  token (and elsewhere), pieces past T, with and without the final state."""
  from lightning_jax.ops.delta_attention import sequence_split

  q, k, v, beta, decay, s0, ids = make_inputs(case, seed=23)
  if ids is not None:
    ids = ids.at[:, 64:].add(1000)
  cot = jax.random.split(jax.random.key(24), 2)
  args = (q, k, v, beta, decay, s0, ids, jax.random.normal(cot[0], v.shape),
          jax.random.normal(cot[1], (case.b, case.h, case.d, case.e)))
  runs = []
  for name in ("forward", "backward"):
    monkeypatch.setattr(sequence_split, name, functools.partial(
        lambda fn, name, *a, **kw: runs.append(name) or fn(*a, **kw), getattr(sequence_split, name), name))
  (_, (o, final)), grads = value_and_grads(
      "pallas", with_final_state, interpret=kernel_mode,
      config=lj.DeltaConfig(sequence_pieces=pieces, chunk_size=16 if case.decay == "channel" else 32))(*args)
  assert runs == ["forward", "backward"]
  (_, (o_ref, final_ref)), grads_ref = value_and_grads("reference", with_final_state)(*args)
  assert rel_err(o, o_ref) < 1e-4 and (final is final_ref is None or rel_err(final, final_ref) < 1e-4)
  for name, g, g_ref in zip(ARG_NAMES, grads, grads_ref):
    assert (g is None) == (g_ref is None), name
    if g_ref is not None:
      assert rel_err(g, g_ref) < 1e-4, (name, rel_err(g, g_ref))


def test_sequence_pieces_where_measured():
  """The split runs where the sweeps' programs fill at most a quarter of the SMs (4 or 8 pieces, each at least 16
  chunks), not at 2; where the map pass is warp-specialised (the chain alone) from half the SMs, 2 to 16
  pieces. `default_config` leaves it to the call, an explicit count is checked."""
  from lightning_jax.ops.delta_attention import sequence_split

  pieces = lambda programs, chunks=1024, ws=False: sequence_split.num_pieces(  # noqa: E731
      programs=programs, num_tokens=chunks * 64 - 3, num_sms=132, warp_specialized_map=ws)
  assert [pieces(p) for p in (8, 16, 32, 33, 34, 64, 128)] == [8, 8, 4, 4, 1, 1, 1]
  assert [pieces(p, ws=True) for p in (4, 8, 9, 16, 32, 33, 34, 64, 66, 67, 128)] == [16, 16, 8, 8, 4, 4, 2, 2, 2,
                                                                                        1, 1]
  assert pieces(16, chunks=127) == 4 and pieces(16, chunks=63) == 1
  assert pieces(64, chunks=31, ws=True) == 1 and pieces(64, chunks=32, ws=True) == 2
  # A call's: a scalar gate's map pass on the warp-specialised sweeps is the chain (2 pieces at B1 H32 D128, 64
  # programs; 4 at B1 H16); KDA's is the Triton sweep's, so KDA there never splits; on the Triton sweeps both take
  # the Triton rule (none at 64 programs, 4 pieces at 32).
  call = lambda h, ws, kda: sequence_split.call_pieces(  # noqa: E731
      (1, 8192, h, 128), 128, lj.DeltaConfig(warp_specialized=ws, block_e=64), num_sms=132, per_channel_gate=kda)
  assert [call(32, True, False), call(16, True, False), call(32, True, True), call(16, True, True),
          call(2, True, True)] == [2, 4, 1, 1, 1]
  assert [call(32, False, kda) for kda in (False, True)] == [1, 1]
  # Without gates (DeltaNet unpacked) the warp-specialised map pass needs 4 pieces: none at 64 programs, 4 at 32
  # (8 at 8 programs: 128 chunks make 8 pieces of the least 16 chunks).
  ungated = lambda h: sequence_split.call_pieces(  # noqa: E731
      (1, 8192, h, 128), 128, lj.DeltaConfig(warp_specialized=True, block_e=64), num_sms=132, per_channel_gate=False,
      ungated=True)
  assert [ungated(32), ungated(16), ungated(4)] == [1, 4, 8]
  assert [call(16, False, kda) for kda in (False, True)] == [4, 4]
  # Where the kernels walk rows off whole chunks: the power of two where it cuts T into pieces of a multiple of 8
  # tokens (a reshape), else the most pieces that do, down to half the SMs' count; else the power of two, padded.
  exact = lambda programs, t: sequence_split.num_pieces(  # noqa: E731
      programs=programs, num_tokens=t, num_sms=132, warp_specialized_map=True, unpadded_rows=True)
  assert [exact(8, 60000), exact(32, 60000), exact(24, 61440), exact(24, 61720), exact(8, 15360 + 8 * 15),
          exact(32, 65528)] == [15, 4, 4, 5, 15, 4]
  assert exact(8, 8 * 4099) == 16 and exact(8, 8 * 4099 * 3) == 16  # 3 pieces: fewer than half of 16
  assert sequence_split.num_pieces(programs=8, num_tokens=60000, num_sms=132, warp_specialized_map=True) == 16
  call_t = lambda t, h, d, e, kda=False: sequence_split.call_pieces(  # noqa: E731
      (1, t, h, d), e, lj.DeltaConfig(warp_specialized=True, block_e=64), num_sms=132, per_channel_gate=kda)
  # KDA and E > 128 (the Triton gradient kernel pads its rows) keep whole chunks.
  assert [call_t(60000, 8, 64, 64), call_t(60000, 2, 64, 256), call_t(60000, 8, 64, 64, kda=True)] == [15, 16, 1]
  assert [sequence_split.piece_length(60000, p, unpadded_rows=u) for p, u in ((15, True), (16, True), (15, False))
          ] == [4000, 3776, 4032]
  assert lj.DeltaConfig().sequence_pieces is None
  for bad in (0, 1.5, True):
    with pytest.raises(ValueError, match="sequence_pieces must be None or an int >= 1"):
      lj.DeltaConfig(sequence_pieces=bad)


def test_default_config_fits_every_device():
  """The blocks default_config picks for each target, form, dtype and padded D fit that target's shared memory, as
  Triton's own allocator measured every kernel, forward and backward (benchmarks/shared_memory.py, committed)."""
  from lightning_jax.ops.delta_attention import pallas_triton
  from lightning_jax.ops.lightning_attention import config as lightning_config

  table = json.loads(SHARED_MEMORY.read_text())
  rows = table["rows"]
  # The Triton kernels' fields (a later field, as warp_specialized, changes no Triton kernel).
  fields = tuple(rows[0]["config"])
  measured = {(r["capability"], r["form"], r["dtype"], r["dim_k"], tuple(r["config"][f] for f in fields)):
              r["max_bytes"] for r in rows}
  grid = sorted({(r["capability"], r["form"], r["dtype"], r["dim_k"]) for r in rows})
  assert len(grid) == 6 * 3 * 3 * 5  # sm80/86/89/90/100/120, the three forms, three dtypes, padded D 16 to 256
  for capability, form, dtype, dim in grid:
    cc = divmod(capability, 10)
    choose = lambda cc: pallas_triton.default_config(  # noqa: E731
        per_channel_gate=form == "kda", dtype=jnp.dtype(dtype), dim_k=dim,
        compute_capability=cc)
    config = choose(cc)
    key = (capability, form, dtype, dim, tuple(dataclasses.asdict(config)[f] for f in fields))
    assert key in measured, f"no measurement of {key}: run python -m benchmarks.shared_memory"
    # Measured over several chunks: a loop of one chunk does not pipeline, and took under half the bytes.
    assert table["metadata"]["tokens"] >= 4 * max(config.chunk_size, config.backward_chunk_size)
    assert measured[key] <= lightning_config.shared_memory_budget(cc), (key, measured[key])
    # No GPU or an unknown one: the smallest budget's blocks.
    assert choose(None) == choose((8, 6))
  # Where the H200's blocks overflow a smaller device (float32, D = 256 on sm80) the defaults differ.
  assert any(r["role"] == "h200" and r["max_bytes"] > r["budget"] for r in rows)
  for bad in (24, 48, 8):
    with pytest.raises(ValueError, match="backward_chunk_size must be None or a power of two"):
      lj.DeltaConfig(backward_chunk_size=bad)
  with pytest.raises(TypeError, match="split_backward must be None or a bool"):
    lj.DeltaConfig(split_backward=1)


@pytest.mark.parametrize("form", ["deltanet", "kda"])
def test_config_fields_left_none_are_the_calls_own(form, monkeypatch):
  """A DeltaConfig with a few fields set runs the call's own blocks for the others, as config=None does: setting
  sequence_pieces (or forward_states) must not reset the chunks and blocks `default_config` tuned per form (KDA's
  Triton backward at 16-token chunks: at 64, its gradient kernel's code grows fivefold, and compiles for most of a
  minute). A field set stays as set."""
  from lightning_jax.ops.delta_attention import vjp as delta_vjp

  class Ran(Exception):
    pass

  configs = []

  def record(*args):  # the configs the op would run with, before any kernel
    configs.append(args[-1].config)
    raise Ran

  monkeypatch.setattr(delta_vjp, "delta_attention_pallas", record)
  b, t, h, d = 1, 40, 2, 16
  x = jnp.ones((b, t, h, d), F32)
  beta = jnp.full((b, t, h), 0.5, F32)
  decay = jnp.full((b, t, h, d) if form == "kda" else (b, t, h), 0.1, F32)
  for config in (None, lj.DeltaConfig(sequence_pieces=1), lj.DeltaConfig(block_e=16, sequence_pieces=1)):
    with pytest.raises(Ran):
      lj.delta_attention(x, x, x, beta, decay, impl="pallas", config=config, interpret=True)
  own, pieces, narrow = configs
  assert pieces == dataclasses.replace(own, sequence_pieces=1)
  assert narrow == dataclasses.replace(own, sequence_pieces=1, block_e=16) and own.block_e != 16
  # The per-form defaults the docstring gives: KDA's chunks are 16 tokens in both passes, the others' 32 and 64.
  assert (own.chunk_size, own.backward_chunk_size) == ((16, 16) if form == "kda" else (32, 64))
  assert all(getattr(lj.DeltaConfig(), field.name) is None for field in dataclasses.fields(lj.DeltaConfig))
  with pytest.raises(ValueError, match="num_warps must be None or a power of two"):
    lj.DeltaConfig(num_warps=True)
  with pytest.raises(ValueError, match="num_stages must be None or an int >= 1"):
    lj.DeltaConfig(num_stages=0)
  with pytest.raises(ValueError, match="takes a filled DeltaConfig"):
    lj.DeltaConfig(warp_specialized=True).warp_specializes_backward(per_channel_gate=False)


def test_default_config_fills_the_sweeps_grid():
  """Few (batch, head) pairs on the Triton sweeps: their value columns halve while twice the programs fit in the SMs,
  down to 16; the H200 shapes keep 64; an unknown B H, or KDA, changes nothing. Where the backward's sweeps are
  warp-specialised (sm90, 16-bit, D <= 128, jax >= 0.11.2) they keep the 64 columns of its CTAs."""
  from lightning_jax.ops.delta_attention import pallas_triton
  from lightning_jax.ops.lightning_attention import heuristics

  def block_e(batch_heads, dim, num_sms=132, dim_v=None, cc=(8, 0)):
    return pallas_triton.default_config(per_channel_gate=False, dtype=jnp.bfloat16, dim_k=dim, dim_v=dim_v,
                                        compute_capability=cc, batch_heads=batch_heads, num_sms=num_sms).block_e

  ws = heuristics.warp_specialized_unsupported(dim_k=128, dim_v=128, dtype=jnp.bfloat16, compute_capability=(9, 0),
                                               interpret=False) is None
  assert block_e(16, 128, cc=(9, 0)) == (64 if ws else 16)
  assert block_e(16, 256, cc=(9, 0)) == 32  # D = 256: the Triton sweeps, E = 256 halved once

  assert [block_e(bh, 128) for bh in (0, 1, 16, 17, 33, 34, 128)] == [64, 16, 16, 32, 32, 64, 64]
  assert [block_e(bh, 64) for bh in (8, 32, 66, 67, 128)] == [16, 16, 32, 64, 64]
  assert block_e(32, 128, num_sms=264) == 16 and block_e(32, 128, num_sms=78) == 64
  assert block_e(16, 64, dim_v=256) == 32  # E, not D, sets the programs
  assert block_e(4, 24) == 16  # E padded to 32: one halving
  assert pallas_triton.default_config(per_channel_gate=True, dtype=jnp.bfloat16, dim_k=128, compute_capability=(9, 0),
                                      batch_heads=16).block_e == 64  # KDA's one gradient kernel walks E in block_e


def test_default_config_prepare_warps_where_measured():
  """The forward's prepare kernel takes 2 warps where the H200 measured it faster (sm90, 16-bit, D <= 128, a
  scalar gate or none); elsewhere num_warps. The backward's prepare always takes num_warps."""
  from lightning_jax.ops.delta_attention import pallas_triton

  def warps(cc=(9, 0), dtype=jnp.bfloat16, dim=128, per_channel_gate=False):
    return pallas_triton.default_config(per_channel_gate=per_channel_gate, dtype=dtype, dim_k=dim,
                                        compute_capability=cc).prepare_warps

  assert warps() == warps(dim=64) == warps(dtype=jnp.float16) == 2
  assert warps(dim=256) is warps(dtype=jnp.float32) is warps(per_channel_gate=True) is warps(cc=(8, 0)) is None
  with pytest.raises(ValueError, match="prepare_warps must be None or a power of two"):
    lj.DeltaConfig(prepare_warps=3)


def test_default_config_gradient_kernel_where_measured():
  """The backward's tile gradient kernel steps 64 key and value columns whatever the sweeps' block_e, and pipelines 2
  deep where the sweeps take 3 (16-bit, sm90 and sm100), else as deep as the sweeps (H200 measurements); an explicit
  gradient_stages is checked."""
  from lightning_jax.ops.delta_attention import pallas_triton

  def config(dim=128, dtype=jnp.bfloat16, cc=(9, 0), batch_heads=0):
    return pallas_triton.default_config(per_channel_gate=False, dtype=dtype, dim_k=dim, compute_capability=cc,
                                        batch_heads=batch_heads)

  assert config(batch_heads=32, cc=(8, 0)).block_e == 32 and config(batch_heads=32, cc=(8, 0)).block_d == 64
  assert config().block_d == config(dim=64).block_d == config(dim=256).block_d == config(cc=(8, 0)).block_d == 64
  for cc in ((9, 0), (10, 0)):
    assert (config(cc=cc).num_stages, config(cc=cc).gradient_stages) == (3, 2)
  assert config(cc=(8, 0)).gradient_stages is config(dtype=jnp.float32).gradient_stages is None
  for bad in (0, 1.5, True):
    with pytest.raises(ValueError, match="gradient_stages must be None or an int >= 1"):
      lj.DeltaConfig(gradient_stages=bad)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("decay", ["token", "channel"])
def test_pallas_low_precision(dtype, decay, kernel_mode):
  case = Case(b=1, t=200, h=2, d=64, e=32, decay=decay, segments=True)
  q, k, v, beta, rates, s0, ids = make_inputs(case, seed=14)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  o, final = jax.jit(lambda: lj.delta_attention(q, k, v, beta, rates, initial_state=s0, segment_ids=ids,
                                                 return_final_state=True, impl="pallas", interpret=kernel_mode))()
  o_ref, final_ref = jax.jit(lambda: lj.delta_attention(q, k, v, beta, rates, initial_state=s0, segment_ids=ids,
                                                         return_final_state=True, impl="reference"))()
  assert o.dtype == dtype and final.dtype == jnp.float32
  assert rel_err(o, o_ref) < 2e-2 and rel_err(final, final_ref) < 2e-2


@pytest.mark.parametrize("decay", ["token", "channel"])
def test_pallas_low_precision_gradients(decay, kernel_mode):
  case = Case(b=1, t=70, h=2, d=32, e=16, decay=decay, segments=True)
  q, k, v, beta, rates, s0, ids = make_inputs(case, seed=15)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  cot = jax.random.split(jax.random.key(16), 2)
  args = (q, k, v, beta, rates, s0, ids, jax.random.normal(cot[0], v.shape), jax.random.normal(cot[1], s0.shape))
  _, grads = value_and_grads("pallas", interpret=kernel_mode)(*args)
  _, grads_ref = value_and_grads("reference")(*args)
  for name, g, g_ref in zip(ARG_NAMES, grads, grads_ref):
    assert g.dtype == g_ref.dtype and rel_err(g, g_ref) < 3e-2, (name, rel_err(g, g_ref))


# Chunk inverses' cases: segments without decay; extreme rates with beta at 0 and 2; per-token rates and segments.
INVERSE_CASES = [Case(t=150, d=48, decay=None, segments=True), Case(t=100, d=64, rates="extreme", beta="edges"),
                 Case(t=70, d=40, decay="token", segments=True)]


def inverse_inputs(case, dtype, aligned_keys, seed=11):
  """(k in dtype, beta, rates or None, segment starts [B, T] or None) for `inverse_error`: random keys of norm 1,
  and with aligned_keys, keys near one direction (where T's entries grow and its rounding shows) in every row but
  the first (both kinds in one kernel call, one compile)."""
  _, k, _, beta, decay, _, ids = make_inputs(case, seed=seed)
  if aligned_keys:
    assert case.b >= 2, case
    aligned = k * 0.3 + jnp.ones_like(k)
    k = (aligned / jnp.linalg.norm(aligned, axis=-1, keepdims=True)).at[0].set(k[0])
  starts = None if ids is None else jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], 1)
  return k.astype(dtype), beta, decay, starts


def inverse_error(got, k, beta, decay, starts, *, scaled):
  """The largest error of got [B, H, Tp, 64], each 64-token chunk's T = (I + A)^{-1} (with `scaled`, T Diag(beta)),
  against numpy's float64 inverse of A's definition on k as given (its rounding, then exact), relative to the
  chunk's largest entry where that exceeds 1."""
  b, t, h, _ = k.shape
  c, tp = 64, got.shape[2]
  got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
  pad = lambda x: np.pad(np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64),  # noqa: E731
                         [(0, 0), (0, tp - t)] + [(0, 0)] * (np.ndim(x) - 2))
  k64, beta64 = pad(k), pad(beta)
  rates = np.zeros((b, tp, h)) if decay is None else pad(decay)
  seg = np.zeros((b, tp)) if starts is None else np.cumsum(pad(starts), axis=1)
  worst = 0.0
  for bi in range(b):
    for hi in range(h):
      for start in range(0, tp, c):
        rows = slice(start, start + c)
        gate = -np.cumsum(rates[bi, rows, hi])
        # e^{g_t - g_s} <= 1 on the pairs kept (s <= t); clamped where they are dropped, which overflow
        pairs = k64[bi, rows, hi] @ k64[bi, rows, hi].T * np.exp(np.minimum(gate[:, None] - gate[None, :], 0.0))
        same = seg[bi, rows][:, None] == seg[bi, rows][None, :]
        a = np.where(np.tri(c, k=-1, dtype=bool) & same, beta64[bi, rows, hi][:, None] * pairs, 0.0)
        want = np.linalg.inv(np.eye(c) + a) * (beta64[bi, rows, hi][None, :] if scaled else 1.0)
        worst = max(worst, np.max(np.abs(got[bi, hi, rows] - want)) / max(1.0, np.max(np.abs(want))))
  return worst


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", INVERSE_CASES, ids=str)
@pytest.mark.parametrize("kernel", ["prepare", "prepare_by_tiles"])
def test_inverse_matches_float64(kernel, case, dtype, kernel_mode):
  """Each 64-token chunk's T = (I + A)^{-1} against numpy's float64 inverse of A's definition, with random keys
  (the first row) and keys near one direction (the second): `prepare`'s T (by 16-row blocks) and
  `prepare_by_tiles`' (the split backward's, whole tiles). The warp-specialised path's Mosaic GPU kernel:
  tests/test_warp_specialized.py."""
  from lightning_jax.ops.delta_attention import pallas_triton as pt
  k, beta, decay, starts = inverse_inputs(case, dtype, aligned_keys=True)
  c = 64
  g = pt.gate_logs(decay, seq_len=case.t, dim_k=case.d, chunk_size=c)
  _, kp, _, beta_rows, gates = pt.padded_operands(k, k, k, beta, starts, g, chunk_size=c)
  config = lj.DeltaConfig(chunk_size=c)
  if kernel == "prepare":
    call = lambda: pt.prepare(kp, kp, kp, beta_rows, gates, scale=1.0, with_inverse=True, config=config,  # noqa: E731
                              interpret=kernel_mode)[3]
  else:
    call = lambda: pt.prepare_by_tiles(kp, kp, beta_rows, gates, config=config, interpret=kernel_mode)[2]  # noqa: E731
  worst = inverse_error(jax.jit(call)(), k, beta, decay, starts, scaled=False)
  # bfloat16: T's own rounding is 4e-3 of its largest entry; the float16 products add up to 7e-3 (aligned keys)
  assert worst < (1e-5 if dtype == jnp.float32 else 1e-2), worst
