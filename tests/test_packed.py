"""Packed sequences (segment_ids, cu_seqlens) and per-token decay.

A packed call against each sequence run alone through the token-serial oracle
(outputs, per-sequence final states and every gradient) for the oracle itself
and the XLA path, and against the oracle's packed call in every Pallas variant
(split included), with and without a branch per chunk; per-token decay at
extreme rates against the oracle, both ways; the oracle itself against a
float64 loop; one compilation for changing boundaries; the errors of bad
input.
"""

import dataclasses
import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BF16, DECAY_TOL, F32, TOL, rel_err

import lightning_jax as lj
from lightning_jax.ops.lightning_attention import chunk_common, heuristics, reference

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")


@dataclasses.dataclass(frozen=True)
class Packing:
  """Rows of sequence lengths: `segment_ids` rows, or with `cu_seqlens` one row (empty sequences allowed)."""
  rows: tuple
  h: int = 2
  d: int = 16
  e: int = 24
  dtype: object = F32
  decay: str | None = "token"  # None, "head" ([H]) or "token" ([B, T, H])
  initial_state: bool = True
  cu_seqlens: bool = False

  @property
  def t(self):
    return sum(self.rows[0])

  def __str__(self):
    name = getattr(self.dtype, "__name__", str(self.dtype))
    return (f"{'cu' if self.cu_seqlens else 'seg'}{list(map(list, self.rows))}H{self.h}D{self.d}E{self.e}-{name}"
            f"-decay_{self.decay}-s0_{int(self.initial_state)}")


# Boundaries inside chunks and on the edges of 16- and 64-token chunks,
# length-1 and (cu_seqlens) empty sequences, odd dims.
PACKINGS = [
    Packing(((64, 1, 50, 35), (20, 44, 86)), d=24, e=40),
    Packing(((1, 0, 63, 64, 0, 17, 1),), cu_seqlens=True),
    Packing(((100, 48),), h=3, d=16, e=16, dtype=BF16, decay="head", initial_state=False),
    Packing(((0, 30, 99, 0),), h=1, d=40, e=8, dtype=BF16, decay=None, cu_seqlens=True),
    # A per-head rate over sequences that share chunks (sequence programs run it per token).
    Packing(((40, 0, 77, 3, 1),), h=2, d=16, e=40, decay="head", cu_seqlens=True),
    # Final states from zero states: each sequence's first rate scales nothing.
    Packing(((5, 64, 0, 20),), h=1, d=16, e=16, initial_state=False, cu_seqlens=True),
]


def make_inputs(p: Packing, seed):
  rng = np.random.default_rng(seed)
  b, t, n = len(p.rows), p.t, len(p.rows[0])
  q, k = (jnp.asarray(rng.normal(size=(b, t, p.h, p.d)), p.dtype) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(b, t, p.h, p.e)), p.dtype)
  # Rates log-uniform in [0.005, 1]: most heads keep a state across a chunk (e^{-64 rate}), so that a segment's
  # state leaking past its end (or a start not resetting one) shows in the outputs.
  rates = lambda shape: np.exp(rng.uniform(np.log(0.005), 0.0, shape))  # noqa: E731
  decay = {None: None, "head": lambda: rates(p.h), "token": lambda: rates((b, t, p.h))}[p.decay]
  decay = None if decay is None else jnp.asarray(decay(), F32)
  states = n if p.cu_seqlens else b
  s0 = jnp.asarray(rng.normal(size=(states, p.h, p.d, p.e)), F32) if p.initial_state else None
  do = jnp.asarray(rng.normal(size=(b, t, p.h, p.e)), F32)
  d_final = jnp.asarray(rng.normal(size=(states, p.h, p.d, p.e)), F32)
  return q, k, v, decay, s0, do, d_final


def packing_args(p: Packing):
  if p.cu_seqlens:
    return dict(cu_seqlens=jnp.asarray(np.cumsum((0,) + p.rows[0]), jnp.int32))
  ids = [np.repeat(np.arange(len(row)) * 7 % 5, row) for row in p.rows]  # ids repeat: runs, not values, count
  return dict(segment_ids=jnp.asarray(np.stack(ids), jnp.int32))


def alone(p: Packing, q, k, v, decay, s0):
  """Each sequence run by itself through the oracle: (o, final states), packed like the call's."""
  scale = p.d ** -0.5
  outs, finals = [], []
  for r, row in enumerate(p.rows):
    row_out, start = [], 0
    for i, length in enumerate(row):
      state_idx = i if p.cu_seqlens else r
      first = p.cu_seqlens or i == 0
      init = s0[state_idx][None] if (s0 is not None and first) else None
      if length == 0:
        final = jnp.zeros((1, p.h, p.d, p.e), F32) if init is None else init
      else:
        sl = slice(start, start + length)
        rates = None if decay is None else (decay if decay.ndim == 1 else decay[r:r + 1, sl])
        o, final = reference.lightning_attention_recurrent(q[r:r + 1, sl], k[r:r + 1, sl], v[r:r + 1, sl], rates,
                                                           scale=scale, initial_state=init)
        row_out.append(o)
      if p.cu_seqlens:
        finals.append(final)
      start += length
    if not p.cu_seqlens:
      finals.append(final)
    outs.append(jnp.concatenate(row_out, axis=1))
  return jnp.concatenate(outs, axis=0), jnp.concatenate(finals, axis=0)


def outputs_and_grads(fn, args, do, d_final):
  argnums = tuple(i for i, a in enumerate(args) if a is not None)

  def loss(*a):
    o, final = fn(*a)
    return jnp.sum(o.astype(F32) * do) + jnp.sum(final * d_final), (o, final)

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(*args)
  return out, dict(zip(("q", "k", "v", "decay", "initial_state"), (None,) * 5)) | dict(
      zip([("q", "k", "v", "decay", "initial_state")[i] for i in argnums], grads))


ARG_NAMES = ("q", "k", "v", "decay", "initial_state")


@functools.cache
def packed_oracle(p: Packing):
  """`outputs_and_grads` of the oracle's packed call as one jitted program of (q, k, v, decay, s0, do, d_final,
  packing arguments): compiled once per packing and process, whatever the seed or variant that asks for it."""
  argnums = tuple(i for i, name in enumerate(ARG_NAMES)
                  if not (name == "decay" and p.decay is None or name == "initial_state" and not p.initial_state))

  @jax.jit
  def run(q, k, v, decay, s0, do, d_final, pack):
    def loss(q, k, v, decay, s0):
      o, final = lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, **pack,
                                        impl="reference")
      return jnp.sum(o.astype(F32) * do) + jnp.sum(final * d_final), (o, final)

    (_, out), grads = jax.value_and_grad(loss, argnums, has_aux=True)(q, k, v, decay, s0)
    return out, dict(zip([ARG_NAMES[i] for i in argnums], grads))

  return run


def check_packed(p: Packing, seed, *, against_alone=False, **kwargs):
  """The call's outputs, final states and gradients against the oracle's: each sequence run alone
  (`against_alone`), else the oracle's packed call, which `test_reference_packed_matches_sequences_alone`
  holds to the sequences alone (one oracle compile instead of one per sequence)."""
  q, k, v, decay, s0, do, d_final = make_inputs(p, seed)
  pack = packing_args(p)

  def ours(q, k, v, decay, s0):
    return lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, **pack, **kwargs)

  (o, final), grads = outputs_and_grads(ours, (q, k, v, decay, s0), do, d_final)
  if against_alone:
    (o_ref, final_ref), grads_ref = outputs_and_grads(lambda *a: alone(p, *a), (q, k, v, decay, s0), do, d_final)
  else:
    (o_ref, final_ref), grads_ref = packed_oracle(p)(q, k, v, decay, s0, do, d_final, pack)
  tol = TOL[p.dtype]
  assert o.shape == o_ref.shape and o.dtype == p.dtype
  assert rel_err(o, o_ref) < tol, ("o", rel_err(o, o_ref))
  assert final.shape == final_ref.shape and final.dtype == F32
  assert rel_err(final, final_ref) < tol, ("final_state", rel_err(final, final_ref))
  for name, g in grads.items():
    if g is not None:
      limit = DECAY_TOL[p.dtype] if name == "decay" else tol
      assert rel_err(g, grads_ref[name]) < limit, (name, rel_err(g, grads_ref[name]))


@pytest.mark.parametrize("p", PACKINGS, ids=str)
def test_reference_packed_matches_sequences_alone(p):
  check_packed(p, zlib.crc32(f"{p}ref".encode()), against_alone=True, impl="reference")


@pytest.mark.parametrize("p", PACKINGS, ids=str)
def test_xla_packed_matches_sequences_alone(p):
  check_packed(p, zlib.crc32(f"{p}xla".encode()), against_alone=True, impl="xla")


SMALL_SPLIT = lj.LightningConfig(
    chunk_loop=lj.ChunkLoopConfig(chunk_size=16, block_e=16, num_warps=2, num_stages=1),
    chunk_states=lj.ChunkStatesConfig(block_d=16, block_e=16, num_warps=2, num_stages=1), slice_size=48)
PALLAS = {"chunk_loop": dict(variant="chunk_loop"), "parallel": dict(variant="parallel"),
          "split": dict(variant="chunk_loop", config=lj.LightningConfig(slice_size=64)),
          "split_small": dict(variant="chunk_loop", config=SMALL_SPLIT)}


@pytest.mark.parametrize("variant", list(PALLAS))
@pytest.mark.parametrize("p", PACKINGS, ids=str)
def test_pallas_packed_matches_sequences_alone(p, variant, kernel_mode):
  if variant == "split_small" and p.d > 16 and kernel_mode:
    pytest.skip("the small split config runs on the first packing's dims only (interpret time)")
  check_packed(p, zlib.crc32(f"{p}{variant}".encode()), impl="pallas", interpret=kernel_mode, **PALLAS[variant])


@pytest.mark.parametrize("decay", ["head", "token"])
def test_split_packed_rows_with_starts_in_every_step_of_a_slice(decay, kernel_mode):
  """A split of slices of 3 chunks of 16 over segments starting in each of a slice's steps (in both sweep
  orders), two in one slice, one on a chunk edge: every slice's own state restarts within it."""
  p = Packing(((20, 13, 30, 5, 28, 40), (7, 60, 41, 28)), h=2, d=16, e=16, decay=decay)
  check_packed(p, zlib.crc32(f"{p}slices".encode()), impl="pallas", interpret=kernel_mode, **PALLAS["split_small"])


@pytest.fixture(params=["walk", "mask"])
def segment_walks(request, monkeypatch):
  """Every packed Triton sweep program walking its chunks between segment starts (or masking every chunk's counts),
  however many starts it has (`heuristics.walked_segment_starts`)."""
  monkeypatch.setattr(heuristics, "walked_segment_starts", (lambda n: n) if request.param == "walk" else (lambda n: -1))
  return request.param


@pytest.mark.parametrize("variant", ["chunk_loop", "split_small"])
@pytest.mark.parametrize("decay", ["head", "token"])
def test_packed_programs_walk_their_chunks_or_mask_every_one(decay, variant, kernel_mode, segment_walks):
  """The two forms of a packed program, in every sweep: one program a row, and a split whose slices hold zero to
  three segment starts (in either sweep's order), one on a chunk edge."""
  p = Packing(((20, 13, 30, 5, 28, 40), (7, 60, 41, 28)), h=2, d=16, e=16, decay=decay)
  check_packed(p, zlib.crc32(f"{p}{variant}{segment_walks}".encode()), impl="pallas", interpret=kernel_mode,
               **PALLAS[variant])


@pytest.mark.parametrize("p", PACKINGS[:3], ids=str)
def test_pallas_packed_matches_sequences_alone_either_way_of_branching(p, kernel_mode, chunk_branches):
  """Chunks with and without segment starts, per-token and per-head rates, in every sweep of both forms."""
  check_packed(p, zlib.crc32(f"{p}{chunk_branches}".encode()), impl="pallas", interpret=kernel_mode,
               variant="chunk_loop")


# --- per-token decay at extreme rates --------------------------------------------

EXTREME_RATES = np.array([0.0, 1e-7, 0.3, 8.0, 60.0, 1e4], np.float32)


@jax.jit
def _extreme_rates_reference(q, k, v, decay, s0, do, d_final):
  """The oracle's outputs and gradients of test_extreme_token_rates_match_oracle: one program for every impl
  (the cotangents arguments, not constants)."""
  def loss(q, k, v, decay, s0):
    o, final = lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, impl="reference")
    return jnp.sum(o.astype(F32) * do) + jnp.sum(final * d_final), (o, final)

  (_, out), grads = jax.value_and_grad(loss, (0, 1, 2, 3, 4), has_aux=True)(q, k, v, decay, s0)
  return out, dict(zip(ARG_NAMES, grads))


@pytest.fixture(params=["branch", "no_branch"])
def chunk_branches(request, monkeypatch):
  """Every Triton sweep with (or without) a branch per chunk (`heuristics.branch_per_chunk`), whatever its dims."""
  monkeypatch.setattr(heuristics, "branch_per_chunk", lambda **_: request.param == "branch")
  return request.param


@pytest.mark.parametrize("impl", ["xla", "chunk_loop", "parallel", "split"])
def test_extreme_token_rates_match_oracle(impl, kernel_mode, chunk_branches):
  if impl == "xla" and (not kernel_mode or chunk_branches == "branch"):
    pytest.skip("xla has no kernel mode and no branch per chunk")
  rng = np.random.default_rng(zlib.crc32(impl.encode()))
  b, t, h, d, e = 2, 200, 2, 16, 32
  q, k = (jnp.asarray(rng.normal(size=(b, t, h, d)), F32) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(b, t, h, e)), F32)
  # Runs of one rate (so tiny rates follow huge ones inside a chunk) and single tokens.
  decay = jnp.asarray(np.repeat(rng.choice(EXTREME_RATES, size=(b, t // 4, h)), 4, axis=1), F32)
  decay = decay.at[:, 7].set(1e4).at[:, 8].set(1e-7)
  s0 = jnp.asarray(rng.normal(size=(b, h, d, e)), F32)
  do, d_final = jnp.asarray(rng.normal(size=(b, t, h, e)), F32), jnp.asarray(rng.normal(size=(b, h, d, e)), F32)
  kwargs = dict(impl="xla") if impl == "xla" else dict(impl="pallas", interpret=kernel_mode, **PALLAS[impl])

  def call(**kw):
    return lambda q, k, v, decay, s0: lj.lightning_attention(q, k, v, decay, initial_state=s0,
                                                             return_final_state=True, **kw)

  args = (q, k, v, decay, s0)
  (o, final), grads = outputs_and_grads(call(**kwargs), args, do, d_final)
  (o_ref, final_ref), grads_ref = _extreme_rates_reference(*args, do, d_final)
  assert rel_err(o, o_ref) < TOL[F32] and rel_err(final, final_ref) < TOL[F32]
  for name, g in grads.items():
    if g is not None:
      assert rel_err(g, grads_ref[name]) < (DECAY_TOL if name == "decay" else TOL)[F32], name


# --- the oracle against a float64 loop -----------------------------------------------

def loop_float64(q, k, v, rates, starts, s0, scale):
  """[T] tokens of one head: S_t = (0 if start else a_t S_{t-1}) + k_t v_t, from s0."""
  state, out = np.asarray(s0, np.float64), []
  for t in range(q.shape[0]):
    state = (0.0 if starts[t] else np.exp(-rates[t])) * state + np.outer(k[t], v[t])
    out.append(scale * q[t] @ state)
  return np.stack(out), state


def test_reference_matches_a_float64_loop():
  rng = np.random.default_rng(3)
  t, h, d, e = 23, 2, 3, 4
  q, k, v = (rng.normal(size=(2, t, h, n)) for n in (d, d, e))
  rates, s0 = rng.uniform(0, 2, (2, t, h)), rng.normal(size=(2, h, d, e))
  ids = np.stack([np.repeat([0, 1, 0], [5, 9, 9]), np.repeat([4, 4, 2], [1, 1, 21])])
  o, final = reference.lightning_attention_recurrent(*(jnp.asarray(x, F32) for x in (q, k, v, rates)), scale=0.7,
                                                     initial_state=jnp.asarray(s0, F32),
                                                     segment_ids=jnp.asarray(ids))
  for b in range(2):
    starts = np.r_[False, ids[b, 1:] != ids[b, :-1]]
    for hh in range(h):
      o_want, final_want = loop_float64(q[b, :, hh], k[b, :, hh], v[b, :, hh], rates[b, :, hh], starts,
                                        s0[b, hh], 0.7)
      assert rel_err(o[b, :, hh], o_want) < 1e-5 and rel_err(final[b, hh], final_want) < 1e-5
  # cu_seqlens: each sequence from its own state, an empty one keeps it.
  cu = np.array([0, 4, 4, 23])
  s0n = rng.normal(size=(3, h, d, e))
  o, finals = reference.lightning_attention_recurrent(*(jnp.asarray(x[:1], F32) for x in (q, k, v, rates)),
                                                      scale=0.7, initial_state=jnp.asarray(s0n, F32),
                                                      cu_seqlens=jnp.asarray(cu))
  for n in range(3):
    for hh in range(h):
      sl = slice(cu[n], cu[n + 1])
      if cu[n] == cu[n + 1]:
        assert rel_err(finals[n, hh], s0n[n, hh]) < 1e-6
        continue
      o_want, final_want = loop_float64(q[0, sl, hh], k[0, sl, hh], v[0, sl, hh], rates[0, sl, hh],
                                        np.zeros(cu[n + 1] - cu[n], bool), s0n[n, hh], 0.7)
      assert rel_err(o[0, sl, hh], o_want) < 1e-5 and rel_err(finals[n, hh], final_want) < 1e-5


# Jitted: one compile per (shape, direction), shared by the start rates (eager, each of the scan's many ops
# compiled on its own took most of this test's time).
_segmented_cumsum = jax.jit(lambda x, starts, *, reverse: chunk_common.segmented_cumsum(x, starts, axis=1,
                                                                                        reverse=reverse),
                            static_argnames="reverse")


@pytest.mark.parametrize("length", [1, 64, 65, 4100])
@pytest.mark.parametrize("reverse", [False, True])
def test_segmented_cumsum_matches_a_float64_loop(length, reverse):
  """Sums restart at every start, and each one's error is bounded by its own segment's magnitudes."""
  rng = np.random.default_rng(length + reverse)
  for start_rate in (0.0, 0.01, 0.5):
    # Magnitudes over 14 orders: a large segment must not leak rounding into a small neighbour.
    x = rng.normal(size=(2, length, 3)) * np.exp(rng.uniform(-16, 16, (2, length, 3)))
    starts = rng.random((2, length)) < start_rate
    got = np.asarray(_segmented_cumsum(jnp.asarray(x, F32), jnp.asarray(starts), reverse=reverse), np.float64)
    want, bound = np.zeros_like(x), np.zeros_like(x)
    acc, acc_abs = np.zeros((2, 3)), np.zeros((2, 3))
    for t in (range(length - 1, -1, -1) if reverse else range(length)):
      keep = ~starts[:, t, None]
      acc, acc_abs = keep * acc + x[:, t], keep * acc_abs + np.abs(x[:, t])
      want[:, t], bound[:, t] = acc, acc_abs
    assert np.all(np.abs(got - want) <= 1e-6 * bound), start_rate


@pytest.mark.parametrize("reverse", [False, True])
def test_chunk_segment_counts_carry_each_chunks_total_in_its_first_row(reverse):
  """The Triton sweeps' counts: each row's segment starts from its chunk's first row in sweep order in the low bits,
  the chunk's total in its first row's high bits (where a kernel reads it), and `chunk_totals` agrees."""
  c, t, tp = 64, 200, 256
  starts = np.random.default_rng(3).random((2, t)) < 0.05
  starts[1, 64] = starts[1, 127] = starts[1, 128] = True  # on a chunk's edges
  _, runs = chunk_common.token_chunk_gates(None, jnp.asarray(starts), chunk_size=c, num_tokens=tp, reverse=reverse)
  packed = np.asarray(chunk_common.with_run_totals(runs, chunk_size=c, reverse=reverse))
  # A reverse sweep's step t takes the start of token t + 1.
  steps = np.pad(starts[:, 1:] if reverse else starts, ((0, 0), (0, tp - t + reverse)))
  want = np.zeros((2, tp), np.int64)
  for chunk in range(tp // c):
    rows = range(chunk * c + c - 1, chunk * c - 1, -1) if reverse else range(chunk * c, chunk * c + c)
    count = 0
    for row in rows:
      count += steps[:, row]
      want[:, row] = count
  totals = steps.reshape(2, -1, c).sum(-1)
  assert np.array_equal(packed & chunk_common.RUN_COUNTS, want)
  high = packed.reshape(2, -1, c) >> chunk_common.RUN_TOTAL_SHIFT
  assert np.array_equal(high[..., 0], totals) and not high[..., 1:].any()
  _, started = chunk_common.chunk_totals(None, jnp.asarray(packed), chunk_size=c, num_chunks=tp // c,
                                         reverse=reverse)
  assert np.array_equal(np.asarray(started), (totals > 0)[:, ::-1] if reverse else totals > 0)


# --- one compilation, helper, errors -------------------------------------------------

@pytest.mark.parametrize("packing", ["segment_ids", "cu_seqlens"])
def test_changing_boundaries_reuse_one_compilation(packing):
  traces = []

  @jax.jit
  def f(q, boundaries):
    traces.append(1)
    kw = (dict(segment_ids=boundaries) if packing == "segment_ids"
          else dict(cu_seqlens=boundaries, initial_state=jnp.ones((3, 1, 8, 8)), return_final_state=True))
    return lj.lightning_attention(q, q, q, impl="xla", **kw)

  q = jnp.ones((1, 40, 1, 8))
  first = [jnp.asarray(np.repeat([0, 1, 2], [10, 10, 20])[None]), jnp.asarray([0, 10, 20, 40])]
  second = [jnp.asarray(np.repeat([0, 1, 2], [1, 30, 9])[None]), jnp.asarray([0, 0, 31, 40])]
  pick = 0 if packing == "segment_ids" else 1
  a, b = f(q, first[pick]), f(q, second[pick])
  assert len(traces) == 1
  assert not np.allclose(np.asarray(jax.tree.leaves(a)[0]), np.asarray(jax.tree.leaves(b)[0]))


def test_segment_ids_from_cu_seqlens():
  ids = lj.segment_ids_from_cu_seqlens(jnp.asarray([0, 2, 2, 5]), 5)
  assert ids.shape == (1, 5) and ids.dtype == jnp.int32
  assert ids.tolist() == [[0, 0, 2, 2, 2]]
  with pytest.raises(ValueError, match="cu_seqlens must be an int"):
    lj.segment_ids_from_cu_seqlens(jnp.asarray([0.0, 5.0]), 5)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(decay=jnp.ones((2, 9, 2))), ValueError, r"decay must be None, per-head rates \[H\]"),
    (dict(decay=jnp.full((1, 9, 2), -1.0)), ValueError, "finite and >= 0"),
    (dict(decay=jnp.full((1, 9, 2), jnp.nan)), ValueError, "finite and >= 0"),
    (dict(segment_ids=jnp.zeros((1, 8), jnp.int32)), ValueError, r"segment_ids must be None or an int \[B, T\]"),
    (dict(segment_ids=jnp.zeros((1, 9))), TypeError, "segment_ids must be an integer array"),
    (dict(cu_seqlens=jnp.asarray([0, 5, 3, 9])), ValueError, "non-decreasing"),
    (dict(cu_seqlens=jnp.asarray([0, 5, 8])), ValueError, "end at T = 9"),
    (dict(cu_seqlens=jnp.asarray([0.0, 9.0])), TypeError, "cu_seqlens must be an integer array"),
    (dict(cu_seqlens=jnp.asarray([0, 9]), segment_ids=jnp.zeros((1, 9), jnp.int32)), ValueError, "not both"),
    (dict(cu_seqlens=jnp.asarray([0, 4, 9]), initial_state=jnp.zeros((1, 2, 4, 4))), ValueError,
     r"\[N, H, D, E\] \(with cu_seqlens\)"),
])
def test_bad_packing_input_is_rejected(kwargs, error, match):
  q = jnp.zeros((1, 9, 2, 4))
  with pytest.raises(error, match=match):
    lj.lightning_attention(q, q, q, impl="xla", **kwargs)


def test_cu_seqlens_needs_a_batch_of_one():
  q = jnp.zeros((2, 9, 2, 4))
  with pytest.raises(ValueError, match="batch of one"):
    lj.lightning_attention(q, q, q, cu_seqlens=jnp.asarray([0, 9]), impl="xla")


# --- cu_seqlens' programs --------------------------------------------------------------

CU = (0, 17, 17, 80, 90)  # 4 sequences, one empty, 90 tokens
SMALL_SEQUENCES = lj.LightningConfig(
    chunk_loop=lj.ChunkLoopConfig(chunk_size=16, block_e=16, num_warps=2, num_stages=1),
    chunk_states=lj.ChunkStatesConfig(block_d=16, block_e=16, num_warps=2, num_stages=1))


@pytest.mark.parametrize("slice_size,programs", [(None, 2 * 4), (32, 2 * 6)])
def test_cu_seqlens_states_run_a_program_per_sequence_or_piece(slice_size, programs, monkeypatch):
  """With per-sequence states the sweeps run one program per (head, sequence), or, where the split cuts the row
  (slices of 32 tokens: 3), per piece of a sequence in a slice (6 pieces, 4 sequences) after a states pass over the
  pieces; nothing runs the XLA pair products (`packing.sequence_states`)."""
  from lightning_jax.ops.lightning_attention import packing  # noqa: PLC0415

  def refuse(*args, **kwargs):
    raise AssertionError("the Pallas path ran the XLA pair products")

  monkeypatch.setattr(packing, "sequence_states", refuse)
  q = jnp.zeros((1, CU[-1], 2, 16), F32)
  s0 = jnp.zeros((len(CU) - 1, 2, 16, 16), F32)
  config = dataclasses.replace(SMALL_SEQUENCES, slice_size=slice_size)

  def loss(q, k, v, decay, s0):
    o, final = lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True,
                                      cu_seqlens=jnp.asarray(CU), impl="pallas", variant="chunk_loop",
                                      interpret=False, config=config)
    return jnp.sum(o) + jnp.sum(final)

  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, q, q, jnp.full((2,), 0.1, F32), s0))
  calls = [(re.search(r"name=(\w+)", call)[1], re.search(r"grid=\((\d+),", call)[1])
           for call in text.split("pallas_call[")[1:]]
  loops = [grid for name, grid in calls if name == "lightning_chunk_loop"]
  assert loops == [str(programs)] * 3, calls  # forward, dq, dv with dk (fused)
  # The states passes over the pieces: the forward's, the dq sweep's (the same pass, transposed: on one device it
  # takes the forward's; over several, XLA's CSE may merge them) and the dv sweep's.
  assert [grid for name, grid in calls if name == "lightning_chunk_states"] == ([str(programs)] * 3 if slice_size
                                                                                 else []), calls


def test_sequence_programs_start_longest_first():
  """Grid axis 0 enumerates a sequence's rank by length (ties in order), then head, then value block: the GPU starts
  programs in that order, so the longest chains start first, and one chunk's programs of every value block run
  together."""
  from lightning_jax.ops.lightning_attention import pallas_triton  # noqa: PLC0415

  assert pallas_triton._longest_first(jnp.asarray(CU)).tolist() == [2, 0, 3, 1]
  coords = [pallas_triton._program_coords(i, h=2, ns=4, n_e=3, sequences=True) for i in range(24)]
  assert coords[:6] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 1, 0, 0), (0, 1, 0, 1), (0, 1, 0, 2)]
  assert sorted(coords) == [(0, head, rank, e) for head in range(2) for rank in range(4) for e in range(3)]
  # A split's slices: batch, head, slice, each one's value blocks together.
  coords = [pallas_triton._program_coords(i, h=2, ns=3, n_e=2, sequences=False) for i in range(24)]
  assert coords[:4] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1)]
  assert coords == [(b, head, s, e) for b in range(2) for head in range(2) for s in range(3) for e in range(2)]


@pytest.mark.parametrize("op", ["lightning", "delta"])
def test_cu_seqlens_programs_wait_for_no_host_loop(op):
  """Both ops' cu_seqlens paths (with per-sequence states, and the packed row without) lowered for CUDA hold no
  while loop outside their kernels: `jnp.searchsorted`'s default method is one, and a GPU waits for the host at
  each of its steps (0.2 ms of a 0.47 ms packed forward at B1 H8 T32K D64, H200)."""
  x = jax.ShapeDtypeStruct((1, 90, 2, 64), BF16)
  rows = jax.ShapeDtypeStruct((1, 90, 2), F32)
  states = jax.ShapeDtypeStruct((len(CU) - 1, 2, 64, 64), F32)
  cu = jnp.asarray(CU, jnp.int32)

  def loss(q, k, v, rates, s0):
    kw = dict(cu_seqlens=cu, impl="pallas", interpret=False)
    if s0 is not None:
      kw.update(initial_state=s0, return_final_state=True)
    out = (lj.lightning_attention(q, k, v, rates, **kw) if op == "lightning"
           else lj.delta_attention(q, k, v, jax.nn.sigmoid(rates), rates, **kw))
    return sum(jnp.sum(o.astype(F32)) for o in (out if s0 is not None else (out,)))

  for with_states in (True, False):
    args = (x, x, x, rows) + ((states,) if with_states else ())
    grads = jax.jit(jax.grad(lambda *a: loss(*a, *(() if with_states else (None,))), argnums=(0, 1, 2, 3)))
    try:
      text = jax.export.export(grads, platforms=["cuda"], disabled_checks=[
          jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
    except RuntimeError as e:  # jax 0.11 lowers a Triton kernel for CUDA only where a GPU is present
      if "No supported GPU devices found" not in str(e):
        raise
      pytest.skip(f"this jax ({jax.__version__}) lowers Triton kernels for CUDA only on a GPU")
    assert "stablehlo.custom_call" in text and "stablehlo.while" not in text, with_states


@pytest.mark.parametrize("reverse", [False, True])
def test_sequence_pieces_chain_each_sequence_from_its_own_state(reverse):
  """`packing.sequence_pieces`, `piece_starts` and `sequence_ends` against a walk over the tokens in numpy: empty
  sequences first, inside and last, a sequence ending on a slice edge, one spanning three slices; both sweep
  directions (a reverse step takes the next token's rate, none at a sequence's last token: `without_next_rates`)."""
  from lightning_jax.ops.lightning_attention import packing  # noqa: PLC0415

  cu = np.array([0, 0, 5, 16, 16, 40, 41, 41])
  t, h, width, n = 41, 2, 3, 7
  rng = np.random.default_rng(int(reverse))
  pieces = packing.sequence_pieces(jnp.asarray(cu, jnp.int32), seq_len=t, slice_tokens=8)
  bounds = np.asarray(pieces.bounds)
  num_pieces = len(bounds) - 1
  assert num_pieces == n + 6 - 1 and bounds[0] == 0 and bounds[-1] == t and np.all(np.diff(bounds) >= 0)
  seq_of = np.searchsorted(cu[1:], np.arange(t), side="right")
  for lo, hi in zip(bounds[:-1], bounds[1:]):  # each piece within one sequence and one slice
    assert hi == lo or (seq_of[lo] == seq_of[hi - 1] and lo // 8 == (hi - 1) // 8)
  assert len({(seq_of[i], i // 8) for i in range(t)}) == int(np.sum(np.diff(bounds) > 0))

  rates = rng.uniform(0.0, 0.5, (1, t, h)).astype(np.float32)
  local = rng.normal(size=(num_pieces, h, width, width)).astype(np.float32)
  given = rng.normal(size=(n, h, width, width)).astype(np.float32)
  # The walk: each piece's state before it, in sweep order, from its sequence's state where the sequence starts.
  step_rate = rates[0].copy()
  if reverse:  # token i takes i + 1's rate, and a sequence's last token none
    step_rate = np.concatenate([rates[0, 1:], np.zeros((1, h), np.float32)])
    step_rate[cu[1:][cu[1:] > cu[:-1]] - 1] = 0.0
  want = np.zeros_like(local)
  want_ends = given.copy()
  order = range(num_pieces - 1, -1, -1) if reverse else range(num_pieces)
  state = None
  for p in order:
    lo, hi = bounds[p], bounds[p + 1]
    if hi == lo:
      continue
    s = seq_of[lo]
    if (hi == cu[s + 1]) if reverse else (lo == cu[s]):
      state = given[s]
    want[p] = state
    state = np.exp(-step_rate[lo:hi].sum(0))[:, None, None] * state + local[p]
    want_ends[s] = state
  swept = jnp.asarray(rates)
  if reverse:  # as a reverse sweep takes them
    swept = packing.without_next_rates(swept, jnp.asarray(cu, jnp.int32))
  got = packing.piece_starts(jnp.asarray(local), pieces, swept, jnp.asarray(given), reverse=reverse)
  nonempty = np.diff(bounds) > 0
  np.testing.assert_allclose(np.asarray(got)[nonempty], want[nonempty], rtol=1e-5, atol=1e-5)
  # The states after each piece (what the sweep's programs end with) give each sequence's end state.
  after = np.asarray(got) * 0
  for p in range(num_pieces):
    lo, hi = bounds[p], bounds[p + 1]
    after[p] = np.exp(-step_rate[lo:hi].sum(0))[:, None, None] * np.asarray(got)[p] + local[p]
  ends = packing.sequence_ends(jnp.asarray(after), pieces, jnp.asarray(given), reverse=reverse)
  np.testing.assert_allclose(np.asarray(ends), want_ends, rtol=1e-5, atol=1e-5)


def test_cu_seqlens_states_under_vmap_with_different_bounds():
  """jax.vmap over calls whose cu_seqlens differ (serving batches of packed prompts): outputs, final states and
  gradients equal the oracle's per call."""
  rng = np.random.default_rng(11)
  t, h, d, e = 70, 2, 16, 8
  q, k = (jnp.asarray(rng.normal(size=(2, 1, t, h, d)), F32) for _ in range(2))
  v = jnp.asarray(rng.normal(size=(2, 1, t, h, e)), F32)
  cu = jnp.asarray([[0, 10, 40, 70], [0, 0, 65, 70]], jnp.int32)
  s0 = jnp.asarray(rng.normal(size=(2, 3, h, d, e)), F32)
  decay = jnp.asarray([0.1, 0.3], F32)

  def loss(impl, **kw):
    def call(q, k, v, cu, s0):
      return lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, cu_seqlens=cu,
                                    impl=impl, **kw)

    def total(q, k, v, cu, s0):
      o, final = jax.vmap(call)(q, k, v, cu, s0)
      return jnp.sum(o * v) + jnp.sum(final * s0), (o, final)
    return jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2, 4), has_aux=True))

  (_, got), got_grads = loss("pallas", interpret=True)(q, k, v, cu, s0)
  (_, want), want_grads = loss("reference")(q, k, v, cu, s0)
  for a, b in zip(got + got_grads, want + want_grads):
    assert rel_err(a, b) < TOL[F32], rel_err(a, b)
