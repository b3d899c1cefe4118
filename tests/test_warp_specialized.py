"""variant="warp_specialized": the Mosaic GPU forward against the oracles, its lowering, its limits, auto's choice;
its delta-rule mode, the forward of `delta_attention` on sm90; and the delta rule's warp-specialised reverse sweep,
in its backward.

Its kernel runs in the Mosaic GPU interpreter on the CPU (jax >= 0.11) and
compiled on an sm90 GPU; the gradients come from the chunk_loop sweeps.
"""

import dataclasses
import functools
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (BF16, DECAY_TOL, F16, F32, TOL, WS_JAX, WS_MODES, Case, check_against_oracle, needs_ws_jax,
                     on_sm90, pallas_calls, rel_err)
from test_delta_ops import ARG_NAMES as DELTA_ARG_NAMES
from test_delta_ops import INVERSE_CASES, inverse_error, inverse_inputs
from test_delta_ops import Case as DeltaCase
from test_delta_ops import check_sequence_states
from test_delta_ops import make_inputs as delta_inputs
from test_delta_ops import value_and_grads as delta_value_and_grads
from test_packed import EXTREME_RATES, Packing, check_packed

import lightning_jax as lj
from lightning_jax.ops.delta_attention import pallas_mosaic_gpu as delta_mosaic
from lightning_jax.ops.delta_attention import pallas_triton
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import pallas_mosaic_gpu
from lightning_jax.ops.lightning_attention import reference

# Interpret-mode kernels against the oracles with tolerances far above float32
# rounding: compiled without LLVM's optimisations on the CPU (see conftest).
pytestmark = pytest.mark.usefixtures("unoptimized_compiles")

# T and the head dims off the 64-token chunk and the padded dims; with decay and
# over 2 chunks, so that the state decays between chunks; more chunks than the
# load ring has slots (4 at K = 64, 3 at K = 128), so that slots are refilled;
# with and without an initial and a final state, the final state after a partial
# last chunk (its own decay factors), also at rates that overflow naive exponents.
CASES = [
    Case(2, 300, 3, 128, 96, BF16),
    Case(1, 77, 3, 64, 64, F16, decay="extreme"),
    Case(2, 128, 2, 40, 72, BF16, decay=None, initial_state=False),
    Case(1, 200, 2, 64, 48, BF16, final_state=False),
    Case(1, 1, 1, 16, 16, BF16),
    Case(2, 65, 3, 64, 64, BF16, initial_state=False, final_state=False),
    Case(1, 600, 2, 64, 48, BF16, initial_state=False, final_state=False),
    Case(1, 450, 2, 128, 96, F16, decay=None, initial_state=False, final_state=False),
    Case(1, 130, 3, 128, 128, F16, decay="extreme", initial_state=False, final_state=False),
    Case(2, 100, 2, 100, 80, BF16, decay=None, initial_state=False, final_state=False, scale=1.0),
    Case(1, 200, 1, 24, 256, BF16, initial_state=False, final_state=False),
    Case(2, 1, 2, 16, 16, F16, initial_state=False, final_state=False),
]


# The Mosaic GPU interpreter of jax 0.11 and 0.12 (on the 2-core CI machine)
# hangs at K = 128 with 3 stages once the kernel allocates any shared buffer
# beyond those of the stateless kernel: the float32 state's RefUnion member (the
# interpreter allocates members separately), or just as well an unused 4 KiB
# buffer; why is not known. So the interpreted cases with a state run 2 stages
# at K = 128; the GPU runs the default 3.
INTERPRETED_STATE_CONFIG = lj.LightningConfig(warp_specialized=lj.WarpSpecializedConfig(num_stages=2))
# The delta rule's internal functions take a config with every block set (`delta_attention` fills a DeltaConfig's
# unset fields per call, `DeltaConfig.filled`): these tests call them with a scalar gate's blocks.
DELTA_BLOCKS = lj.DeltaConfig(chunk_size=32, backward_chunk_size=64, block_e=64, block_d=64, num_warps=4, num_stages=2)


@pytest.mark.parametrize("mode", WS_MODES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_warp_specialized_matches_oracle(case, mode):
  with_states = case.initial_state or case.final_state
  config = INTERPRETED_STATE_CONFIG if mode == "interpret" and with_states and case.d > 64 else None
  check_against_oracle(case, seed=zlib.crc32(f"{case}ws".encode()), impl="pallas", variant="warp_specialized",
                       interpret=mode == "interpret", config=config)


@pytest.mark.parametrize("mode", WS_MODES)
@pytest.mark.parametrize("with_states", [False, True], ids=["no_state", "states"])
def test_warp_specialized_under_vmap_jit_and_checkpoint(mode, with_states):
  b, t, h, d = 1, 150, 2, 128  # B = 1: vmap batches the kernel over the stack of 2 (what this checks)
  keys = jax.random.split(jax.random.PRNGKey(11), 5)
  q, k, v = (jax.random.normal(key, (2, b, t, h, d), BF16) for key in keys[:3])
  decay = jax.random.uniform(keys[3], (h,), F32, 0.01, 1.0)
  s0 = jax.random.normal(keys[4], (2, b, h, d, d), F32) if with_states else None
  config = INTERPRETED_STATE_CONFIG if mode == "interpret" and with_states else None

  def fn(q, k, v, s0):
    return lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=with_states,
                                  impl="pallas", variant="warp_specialized", config=config,
                                  interpret=mode == "interpret")

  out = jax.jit(jax.vmap(jax.checkpoint(fn)))(q, k, v, s0)
  out, final = out if with_states else (out, None)
  chex.assert_shape(out, (2, b, t, h, d))
  chex.assert_type(out, BF16)
  # The oracle jitted, over the stack (one program, not every op compiled eagerly).
  wants, want_finals = jax.jit(jax.vmap(lambda q, k, v, s0: reference.lightning_attention_quadratic(
      q, k, v, decay, scale=d ** -0.5, initial_state=s0)))(q, k, v, s0)
  for i in range(2):
    want, want_final = wants[i], want_finals[i]
    assert rel_err(out[i], want) < 2e-2
    if with_states:
      chex.assert_type(final, F32)
      assert rel_err(final[i], want_final) < 2e-2


# Per-token rates run the kernel's per-chunk factors, packed rows with a
# per-head rate (or none) its per-head ones masked by each chunk's segment
# starts (the reverse sweeps' gradients come from chunk_loop, dq from this kernel
# without rates: `test_warp_specialized_dq_sweep_with_fixed_rates`): boundaries
# inside chunks and on their edges, per-token and per-head rates and none,
# cu_seqlens with empty sequences.
WS_PACKINGS = [
    Packing(((64, 1, 50, 35), (20, 44, 86)), d=64, e=48, dtype=BF16),
    Packing(((100, 48, 130),), d=128, e=64, dtype=BF16, decay="head", initial_state=False),
    Packing(((0, 30, 99, 0),), h=1, d=40, e=80, dtype=F16, decay=None, cu_seqlens=True),
    # No decay: a state that crossed a segment start would dominate the next segment's outputs.
    Packing(((100, 48, 130),), h=1, d=64, e=48, dtype=BF16, decay=None, initial_state=False),
    # D > 64 without a rate gradient: the reverse dv and dk sweeps on this kernel, their segments on chunk edges.
    Packing(((64, 1, 50, 35), (20, 44, 86)), h=1, d=96, e=128, dtype=BF16, decay=None),
]


@pytest.mark.parametrize("mode", WS_MODES)
@pytest.mark.parametrize("p", WS_PACKINGS, ids=str)
def test_warp_specialized_packed_matches_sequences_alone(p, mode):
  config = INTERPRETED_STATE_CONFIG if mode == "interpret" and p.d > 64 else None
  check_packed(p, zlib.crc32(f"{p}ws".encode()), impl="pallas", variant="warp_specialized",
               interpret=mode == "interpret", config=config)


# Split packed rows: the Triton states pass before the kernel restarts each slice's own state where a segment
# starts inside one of its chunks (slices of one 64-token chunk; starts inside the second and third).
WS_SPLIT_PACKINGS = [
    Packing(((100, 48, 130),), d=64, e=48, dtype=BF16, decay="head"),
    Packing(((70, 1, 120, 87),), h=1, d=32, e=64, dtype=BF16, decay=None, initial_state=False),
]


@pytest.mark.parametrize("mode", WS_MODES)
@pytest.mark.parametrize("p", WS_SPLIT_PACKINGS, ids=str)
def test_warp_specialized_split_packed_row_matches_sequences_alone(p, mode):
  check_packed(p, zlib.crc32(f"{p}ws-split".encode()), impl="pallas", variant="warp_specialized",
               interpret=mode == "interpret", config=lj.LightningConfig(slice_size=64))


@pytest.mark.parametrize("mode", WS_MODES)
@pytest.mark.parametrize("rates,packed,slice_size,d,e,chunk_loops", [
    ("head", False, None, 64, 64, 1), ("token", True, None, 64, 48, 1), ("head", True, 64, 64, 48, 1),
    ("token", False, 64, 64, 48, 1), ("head", False, None, 96, 48, 3), ("head", False, 64, 48, 128, 0),
    ("head", True, 64, 96, 64, 0), ("token-trained", True, 64, 64, 48, 1)])
def test_warp_specialized_dq_sweep_matches_oracle(rates, packed, slice_size, d, e, chunk_loops, mode):
  """Without a per-head rate's gradient, the dq sweep, a forward over (do, v, k), runs this kernel too (one
  Triton chunk loop left at D, E <= 64: the fused dk/dv sweep), split from the forward's slices where the forward
  was; but not over K = E <= 64 with a per-head rate where the forward's K = D was not (three chunk loops: dq, dv,
  dk); over K = E = 128 beside D = 48 it does, and so do the reverse sweeps at D > 64, packed rows too (E = 64:
  auto's rule takes K = 64 for packed rows; no chunk loop left): q, k, v and initial-state gradients against the
  oracle, per-head and per-token rates, packed rows, a partial last chunk; trained per-token rates' gradient from
  the dq sweep's row dots and the fused sweep's."""
  rng = np.random.default_rng(23)
  b, t, h = 2, 200, 2
  trained = rates.endswith("-trained")
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, n)), BF16) for n in (d, d, e))
  decay = jnp.asarray(rng.uniform(0.01, 1.0, size=(h,) if rates == "head" else (b, t, h)), F32)
  segment_ids = jnp.asarray(np.cumsum(rng.random((b, t)) < 0.02, axis=1), jnp.int32) if packed else None
  s0 = jnp.asarray(rng.normal(size=(b, h, d, e)), F32)
  do = jnp.asarray(rng.normal(size=(b, t, h, e)), F32)

  def grads(**kw):
    loss = lambda q, k, v, s0, decay: jnp.sum(do * lj.lightning_attention(  # noqa: E731
        q, k, v, decay, initial_state=s0, segment_ids=segment_ids, **kw).astype(F32))
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4) if trained else (0, 1, 2, 3))

  # The interpreter runs K = 128 with a state at 2 stages (INTERPRETED_STATE_CONFIG).
  stages = INTERPRETED_STATE_CONFIG.warp_specialized if mode == "interpret" and max(d, e) > 64 else None
  ours = grads(impl="pallas", variant="warp_specialized", interpret=mode == "interpret",
               config=lj.LightningConfig(slice_size=slice_size, warp_specialized=stages))
  names = [str(eqn.params["name"]) for eqn in pallas_calls(jax.make_jaxpr(ours)(q, k, v, s0, decay).jaxpr)]
  assert names.count("lightning_chunk_loop") == chunk_loops, names
  for name, g, want in zip(("dq", "dk", "dv", "d_initial_state", "d_decay"), ours(q, k, v, s0, decay),
                           jax.jit(grads(impl="reference"))(q, k, v, s0, decay)):
    assert rel_err(g, want) < (DECAY_TOL if name == "d_decay" else TOL)[BF16], (name, rel_err(g, want))


# D > 64, where dk and dv are reverse sweeps of their own: a per-head rate or none, whole and partial last chunks,
# a final-state cotangent (where the first chunk walked is partial, with a rate, the Triton sweeps run them), a split,
# and splits whose last slice (the sequence's start, walked last) is short: 5 chunks in slices of 2, 8 in slices of 3.
WS_REVERSE_CASES = [
    (Case(1, 256, 2, 96, 128, BF16), None),
    (Case(2, 200, 2, 128, 80, BF16, decay=None), None),
    (Case(1, 200, 2, 96, 96, BF16, initial_state=False, final_state=False), None),
    (Case(1, 320, 2, 128, 128, BF16), 64),
    (Case(1, 300, 1, 80, 128, F16, initial_state=False, final_state=False), 64),
    (Case(1, 300, 2, 128, 96, BF16, final_state=False), 128),
    (Case(2, 450, 1, 96, 128, BF16, decay=None), 192),
]


@pytest.mark.parametrize("mode", WS_MODES)
@pytest.mark.parametrize("case,slice_size", WS_REVERSE_CASES, ids=str)
def test_warp_specialized_reverse_sweeps_match_oracle(case, slice_size, mode):
  """With the rates fixed, the dv and dk sweeps run this kernel reversed (no Triton chunk loop left where it can):
  outputs, final state and the q, k, v, initial-state gradients against the oracle."""
  config = lj.LightningConfig(slice_size=slice_size,
                              warp_specialized=INTERPRETED_STATE_CONFIG.warp_specialized if mode == "interpret"
                              else None)
  kw = dict(impl="pallas", variant="warp_specialized", interpret=mode == "interpret", config=config)
  check_against_oracle(case, seed=zlib.crc32(f"{case}ws-reverse".encode()), argnums=(0, 1, 2, 4), **kw)
  if case.t % 64 == 0 or case.decay is None or not case.final_state:  # where the reverse sweeps take this kernel
    q = jax.ShapeDtypeStruct((case.b, case.t, case.h, case.d), case.dtype)
    v = jax.ShapeDtypeStruct((case.b, case.t, case.h, case.e), case.dtype)
    decay = None if case.decay is None else jnp.ones((case.h,), F32)
    fn = jax.grad(lambda q, k, v: jnp.sum(lj.lightning_attention(q, k, v, decay, **kw).astype(F32)), argnums=(0, 1, 2))
    names = [str(eqn.params["name"]) for eqn in pallas_calls(jax.make_jaxpr(fn)(q, q, v).jaxpr)]
    assert "lightning_chunk_loop" not in names, names


@pytest.mark.parametrize("mode", WS_MODES)
@pytest.mark.parametrize("packed,slice_size,trained", [(False, None, False), (True, 128, True)])
def test_warp_specialized_reverse_sweeps_with_token_rates(packed, slice_size, trained, mode):
  """Per-token rates: at D > 64 the dv and dk sweeps run this kernel reversed (its per-chunk factors in the reverse
  sweep's convention), from a partial chunk and a final-state cotangent, with segments and a split whose last slice
  is short (5 chunks in slices of 2); trained, the rates' gradient comes from the dq and dv sweeps' row dots (no
  Triton sweep either way): outputs, final state and the q, k, v, initial-state (and rates') gradients against the
  oracle, rates from 1e-7 to 1e4."""
  rng = np.random.default_rng(29)
  b, t, h, d, e = 2, 300, 1, 128, 64
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, n)), BF16) for n in (d, d, e))
  decay = rng.uniform(0.01, 1.0, size=(b, t, h))
  decay[:, 40], decay[:, 41], decay[:, 250] = 1e4, 1e-7, 30.0
  decay = jnp.asarray(decay, F32)
  segment_ids = jnp.asarray(np.cumsum(rng.random((b, t)) < 0.02, axis=1), jnp.int32) if packed else None
  s0 = jnp.asarray(rng.normal(size=(b, h, d, e)), F32)
  do = jnp.asarray(rng.normal(size=(b, t, h, e)), F32)
  d_final = jnp.asarray(rng.normal(size=(b, h, d, e)), F32)

  def loss(q, k, v, s0, decay, **kw):
    o, final = lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True,
                                      segment_ids=segment_ids, **kw)
    return jnp.sum(do * o.astype(F32)) + jnp.sum(d_final * final), (o, final)

  config = lj.LightningConfig(slice_size=slice_size,
                              warp_specialized=INTERPRETED_STATE_CONFIG.warp_specialized if mode == "interpret"
                              else None)
  names = ("dq", "dk", "dv", "d_initial_state") + (("d_decay",) if trained else ())
  argnums = tuple(range(len(names)))
  ours = jax.grad(functools.partial(loss, impl="pallas", variant="warp_specialized", interpret=mode == "interpret",
                                    config=config), argnums=argnums, has_aux=True)
  calls = [str(eqn.params["name"]) for eqn in pallas_calls(jax.make_jaxpr(ours)(q, k, v, s0, decay).jaxpr)]
  assert "lightning_chunk_loop" not in calls, calls
  grads, (o, final) = ours(q, k, v, s0, decay)
  want, (o_ref, final_ref) = jax.jit(jax.grad(functools.partial(loss, impl="reference"), argnums=argnums,
                                              has_aux=True))(q, k, v, s0, decay)
  for name, x, x_ref in zip(("o", "final_state") + names, (o, final, *grads), (o_ref, final_ref, *want)):
    limit = DECAY_TOL[BF16] if name == "d_decay" else TOL[BF16]
    assert rel_err(x, x_ref) < limit, (name, rel_err(x, x_ref))


@pytest.mark.parametrize("mode", WS_MODES)
def test_warp_specialized_extreme_token_rates_in_a_split_sequence(mode):
  """Rates from 0 to 1e4 in one chunk, segments, and 5 slices from the Triton states pass: against the oracle."""
  rng = np.random.default_rng(17)
  b, t, h, d, e = 2, 300, 2, 64, 64
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, n)), BF16) for n in (d, d, e))
  decay = jnp.asarray(np.repeat(rng.choice(EXTREME_RATES, size=(b, t // 4, h)), 4, axis=1), F32)
  decay = decay.at[:, 7].set(1e4).at[:, 8].set(1e-7)
  segment_ids = jnp.asarray(np.cumsum(rng.random((b, t)) < 0.02, axis=1), jnp.int32)
  s0 = jnp.asarray(rng.normal(size=(b, h, d, e)), F32)
  # Two published states (the delta rule's choice at D = 128) with a ring of 2: the chain's buffers wrap every chunk.
  config = lj.LightningConfig(slice_size=64,
                              warp_specialized=lj.WarpSpecializedConfig(num_stages=2, published_states=2))
  call = lambda **kw: lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True,  # noqa: E731
                                             segment_ids=segment_ids, **kw)
  o, final = call(impl="pallas", variant="warp_specialized", config=config, interpret=mode == "interpret")
  o_ref, final_ref = jax.jit(lambda: call(impl="reference"))()
  assert rel_err(o, o_ref) < TOL[BF16] and rel_err(final, final_ref) < TOL[BF16]


@needs_ws_jax
@pytest.mark.parametrize("dim_k,dim_v,gates,with_states,rows", [
    (128, 128, "head", False, 192), (64, 256, None, False, 192), (128, 64, "head", True, 192),
    (64, 128, None, True, 192), (64, 64, "token", True, 192), (128, 128, "packed", False, 192),
    (128, 128, "head-packed", True, 192), (128, 128, "head", True, 152), (64, 64, "token", False, 152),
    (128, 128, "head-reverse", True, 152), (64, 128, "none-reverse", False, 192),
    (128, 128, "head-packed-reverse", True, 152), (128, 128, "packed-reverse", True, 152),
    (64, 64, "token-reverse", False, 152), (128, 128, "token-dots", False, 152),
    (128, 128, "packed-reverse-dots", True, 152), (64, 128, "token-reverse-dots", False, 192)])
def test_warp_specialized_lowers_for_cuda(dim_k, dim_v, gates, with_states, rows):
  """Mosaic GPU lowering (layout inference included) for an sm90 GPU, from any backend.

  The interpreter checks the arithmetic and the barriers but not the layouts;
  this checks that the kernel lowers as the GPU compiles it. gates: a per-head
  rate (with segments: "head-packed"), none, or per-chunk factors of per-token
  rates (with segments: "packed"); "-reverse": the reverse sweep's; "-dots": with the output's row dots. rows: the
  operands' (192, whole chunks; 152, unpadded: the last tile runs past them), a multiple of TMA's 8 (150 is not:
  refused).
  """
  q = jax.ShapeDtypeStruct((2, rows, 3, dim_k), BF16)
  v = jax.ShapeDtypeStruct((2, rows, 3, dim_v), BF16)
  dots = gates is not None and gates.endswith("-dots")
  gates = gates.removesuffix("-dots") if dots else gates
  reverse = gates is not None and gates.endswith("-reverse")
  gates = gates.removesuffix("-reverse") if reverse else gates
  decay = jax.ShapeDtypeStruct((3,), F32) if gates in ("head", "head-packed") else None
  chunk_gates = None
  runs = jax.ShapeDtypeStruct((2, 192), jnp.int32) if gates in ("packed", "head-packed") else None
  if gates in ("token", "packed"):
    chunk_gates, runs = (jax.ShapeDtypeStruct((2, 3, 192), F32), runs), None
  s0 = jax.ShapeDtypeStruct((2, 3, 1, dim_v, dim_k), F32) if with_states else None  # one slice
  cfg = heuristics.resolve_warp_specialized(None, dim_k=dim_k, itemsize=2, row_dots=dots)
  fn = jax.jit(lambda q, k, v, decay, s0, chunk_gates, runs: pallas_mosaic_gpu.forward_padded(
      q, k, v, decay, s0, chunk_gates=chunk_gates, chunk_runs=runs, scale=0.125, seq_len=150,
      return_final_state=with_states, cfg=cfg, num_tokens=192, reverse=reverse, dot_with=v if dots else None))
  exported = jax.export.export(fn, platforms=["cuda"])(q, q, v, decay, s0, chunk_gates, runs)
  assert "lightning_warp_specialized" in exported.mlir_module()
  assert exported.out_avals[0].shape == (2, rows, 3, dim_v)
  if dots:
    assert exported.out_avals[1].shape == (2, 3, dim_v // 64, 192)
  if rows != 192:
    with pytest.raises(ValueError, match="a multiple of 8"):
      jax.eval_shape(fn, jax.ShapeDtypeStruct((2, 150, 3, dim_k), BF16), jax.ShapeDtypeStruct((2, 150, 3, dim_k), BF16),
                     jax.ShapeDtypeStruct((2, 150, 3, dim_v), BF16), decay, s0, chunk_gates, runs)


@needs_ws_jax
def test_warp_specialized_reverse_split_with_a_short_last_slice_lowers_for_cuda():
  """Mosaic GPU lowering for an sm90 GPU of a reverse sweep over slices that T's chunks do not fill (3 chunks in two
  slices of 2): the last slice's CTAs walk a traced count of chunks."""
  q = jax.ShapeDtypeStruct((2, 256, 3, 128), BF16)
  s0 = jax.ShapeDtypeStruct((2, 3, 2, 128, 128), F32)
  cfg = heuristics.resolve_warp_specialized(None, dim_k=128, itemsize=2)
  fn = jax.jit(lambda q, k, v, decay, s0: pallas_mosaic_gpu.forward_padded(
      q, k, v, decay, s0, scale=0.125, seq_len=150, cfg=cfg, num_slices=2, num_tokens=256, reverse=True))
  exported = jax.export.export(fn, platforms=["cuda"])(q, q, q, jax.ShapeDtypeStruct((3,), F32), s0)
  assert "lightning_warp_specialized" in exported.mlir_module()
  assert exported.out_avals[0].shape == (2, 256, 3, 128)


def test_warp_specialized_rejects_what_it_cannot_run():
  keys = jax.random.split(jax.random.PRNGKey(5), 3)
  q, k, v = (jax.random.normal(key, (1, 40, 2, 32), BF16) for key in keys)
  run = lambda q, k, v, **kw: lj.lightning_attention(q, k, v, impl="pallas", variant="warp_specialized",  # noqa: E731
                                                     **kw)
  if not WS_JAX:
    with pytest.raises(ValueError, match="variant='warp_specialized' needs jax >= 0.11"):
      run(q, k, v, interpret=True)
    return
  wide = jax.random.normal(keys[0], (1, 40, 2, 160), BF16)
  for match, call in [
      ("needs bfloat16 or float16 inputs, got float32", lambda: run(*(x.astype(F32) for x in (q, k, v)))),
      ("needs D <= 128 and E <= 256, got D=160", lambda: run(wide, wide, v)),
      ("needs a compute capability 9.0 GPU", lambda: run(q, k, v, interpret=False)),
  ]:
    if "compute capability" in match and on_sm90():
      continue
    with pytest.raises(ValueError, match=match):
      call()


def test_warp_specialized_config_is_validated_and_budgeted():
  with pytest.raises(ValueError, match="num_stages must be an int >= 1"):
    lj.WarpSpecializedConfig(num_stages=0)
  for published in (1, 4, True):
    with pytest.raises(ValueError, match="published_states must be 2 or 3"):
      lj.WarpSpecializedConfig(num_stages=2, published_states=published)
  # The shared-memory estimate: 3 stages and 3 published states fit sm90 at D = 128 in 16-bit, 4 stages do not
  # (with 2 published states they would, but the preference keeps the third state before a fourth stage).
  assert heuristics.resolve_warp_specialized(None, dim_k=128, itemsize=2) == lj.WarpSpecializedConfig(num_stages=3)
  assert heuristics.resolve_warp_specialized(None, dim_k=64, itemsize=2) == lj.WarpSpecializedConfig(num_stages=4)
  deep = lj.LightningConfig(warp_specialized=lj.WarpSpecializedConfig(num_stages=4))
  with pytest.raises(ValueError, match="config.warp_specialized=.* over the 232448-byte per-block budget"):
    heuristics.resolve_warp_specialized(deep, dim_k=128, itemsize=2)
  fewer_states = lj.LightningConfig(warp_specialized=lj.WarpSpecializedConfig(num_stages=4, published_states=2))
  assert heuristics.resolve_warp_specialized(fewer_states, dim_k=128, itemsize=2).num_stages == 4


@pytest.mark.parametrize("call,want", [
    (dict(), "warp_specialized"),
    (dict(d=64), "chunk_loop"),  # measured slower than Triton at D = 64 with a per-head rate
    (dict(d=64, per_token=True), "warp_specialized"),  # and faster with per-chunk factors
    # On an H200, one CTA per SM (B4 H32 on 132 SMs) with a per-head rate: WS.
    (dict(d=64, e=64, per_head_decay=True, batch_heads=128, num_sms=132, device_kind="NVIDIA H200"),
     "warp_specialized"),
    (dict(d=64, e=64, per_head_decay=True, batch_heads=128, num_sms=132, device_kind="NVIDIA H100 80GB HBM3"),
     "chunk_loop"),
    (dict(d=64, e=64, per_head_decay=False, batch_heads=128, num_sms=132, device_kind="NVIDIA H200"), "chunk_loop"),
    # Two waves, or a split sequence (half the SMs or fewer): chunk_loop.
    (dict(d=64, e=64, per_head_decay=True, batch_heads=256, num_sms=132, device_kind="NVIDIA H200"), "chunk_loop"),
    (dict(d=64, e=64, per_head_decay=True, batch_heads=64, num_sms=132, device_kind="NVIDIA H200"), "chunk_loop"),
    # The CTAs count value blocks: B2 H32 with E = 128 is one wave too.
    (dict(d=64, e=128, per_head_decay=True, batch_heads=64, num_sms=132, device_kind="NVIDIA H200"),
     "warp_specialized"),
    # T off TMA's 8 rows: the warp-specialised forward would copy q, k, v and o; chunk_loop masks its last chunk.
    (dict(seq_len=32700), "chunk_loop"),
    (dict(d=64, per_token=True, seq_len=20001), "chunk_loop"),
    (dict(seq_len=32760), "warp_specialized"),
    (dict(dtype=F32), "chunk_loop"),
    (dict(compute_capability=(8, 0)), "chunk_loop"),
    (dict(compute_capability=(10, 0)), "chunk_loop"),
    (dict(interpret=True), "chunk_loop"),
])
def test_auto_picks_warp_specialized_where_it_was_measured_faster(call, want):
  kw = dict(d=128, e=128, dtype=BF16, compute_capability=(9, 0), interpret=False)
  kw.update(call)
  if not WS_JAX and want == "warp_specialized":
    want = "chunk_loop"
  assert heuristics.pallas_variant("auto", **kw) == want


def test_factors_fold_the_scale_and_decay():
  """The per-head factors the kernel loads, against their definition."""
  decay = jnp.array([0.0, 0.3, 5.0], F32)
  last_rows = 13
  intra, vectors = pallas_mosaic_gpu.decay_factors(decay, 3, scale=0.5, last_rows=last_rows)
  c = pallas_mosaic_gpu.CHUNK_SIZE
  i = np.arange(c)
  for h, rate in enumerate(np.asarray(decay, np.float64)):
    gap = i[:, None] - i[None, :]
    want_intra = np.where(gap >= 0, 0.5 * np.exp(-rate * np.maximum(gap, 0)), 0.0)
    np.testing.assert_allclose(intra[h], want_intra, rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(vectors[h, 0], 0.5 * np.exp(-rate * (i + 1)), rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(vectors[h, 1], np.exp(-rate * (c - 1 - i)), rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(vectors[h, 2], np.full(c, np.exp(-rate * c)), rtol=1e-5, atol=1e-30)
    # A last chunk of 13 real rows: only those feed the final state, decayed to its end.
    want_last_key = np.where(i < last_rows, np.exp(-rate * np.maximum(last_rows - 1 - i, 0)), 0.0)
    np.testing.assert_allclose(vectors[h, 3], want_last_key, rtol=1e-5, atol=1e-30)
    np.testing.assert_allclose(vectors[h, 4], np.full(c, np.exp(-rate * last_rows)), rtol=1e-5, atol=1e-30)


# The delta rule's mode: DeltaNet and Gated DeltaNet, packed, from and to states, rates from 1e-7 to 1e4 and beta
# at 0 and 2, T, D and E off the chunk and the blocks.
DELTA_CASES = [
    DeltaCase(b=2, t=150, h=2, d=64, e=48, decay="token", segments=True),
    DeltaCase(b=1, t=136, h=2, d=40, e=64, decay=None, initial_state=False),  # T % 8 == 0: the kernels walk it
    DeltaCase(b=1, t=104, h=1, d=64, e=72, decay="token", rates="extreme", beta="edges"),  # the backward walks T too
    DeltaCase(b=2, t=300, h=3, d=128, e=100, decay="token", segments=True),
    DeltaCase(b=1, t=200, h=2, d=100, e=128, decay=None, segments=True),
    DeltaCase(b=1, t=1, h=1, d=16, e=16),  # one token: a chunk of padding
]


# K = 128 compiled only: like the lightning kernel's with a state (INTERPRETED_STATE_CONFIG), the interpreter hangs
# there with the delta rule's extra buffers on the 2-core CI machine (the lowering test below covers K = 128).
DELTA_PARAMS = [pytest.param(case, *mode.values, marks=mode.marks, id=f"{case}-{mode.id}")
                for case in DELTA_CASES for mode in (WS_MODES if case.d <= 64 else WS_MODES[1:])]


@pytest.mark.parametrize("case,mode", DELTA_PARAMS)
def test_delta_warp_specialized_matches_oracle(case, mode):
  q, k, v, beta, decay, s0, ids = delta_inputs(case, seed=zlib.crc32(f"{case}ws".encode()))
  q, k, v = (x.astype(BF16) for x in (q, k, v))
  config = lj.DeltaConfig(warp_specialized=True)
  call = lambda **kw: lj.delta_attention(q, k, v, beta, decay, initial_state=s0, segment_ids=ids,  # noqa: E731
                                         return_final_state=True, **kw)
  o, final = jax.jit(lambda: call(impl="pallas", config=config, interpret=mode == "interpret"))()
  o_ref, final_ref = jax.jit(lambda: call(impl="reference"))()
  assert o.dtype == BF16 and final.dtype == F32
  assert rel_err(o, o_ref) < TOL[BF16] and rel_err(final, final_ref) < TOL[BF16]


# The backward's sweeps warp-specialised (`delta_attention.pallas_mosaic_gpu`): the op's gradients
# with warp_specialized=True against the oracle's, bf16 inputs; interpreted on the packed and the extreme case
# (D <= 64; each runs the whole backward in the interpreters). Not the one-token case: there the rate's gradient is a
# sum of terms that cancel within the rounding of the state, stored in bf16 for the gradient kernel (0.2 relative
# error on the Triton sweeps too).
# float16 compiled on a gated and an ungated case (the gradient kernel's other operand type).
DELTA_GRADIENT_PARAMS = [
    *(pytest.param(case, BF16, *mode.values, marks=mode.marks, id=f"{case}-{mode.id}")
      for i, case in enumerate(DELTA_CASES[:-1]) for mode in (WS_MODES if i in (0, 2) else WS_MODES[1:])),
    *(pytest.param(DELTA_CASES[i], F16, *WS_MODES[1].values, marks=WS_MODES[1].marks, id=f"{DELTA_CASES[i]}-f16-gpu")
      for i in (1, 3))]


@pytest.mark.parametrize("case,dtype,mode", DELTA_GRADIENT_PARAMS)
def test_delta_warp_specialized_gradients_match_oracle(case, dtype, mode):
  q, k, v, beta, decay, s0, ids = delta_inputs(case, seed=zlib.crc32(f"{case}ws-grad".encode()))
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  cot = jax.random.split(jax.random.key(zlib.crc32(str(case).encode())), 2)
  args = (q, k, v, beta, decay, s0, ids, jax.random.normal(cot[0], v.shape),
          jax.random.normal(cot[1], (case.b, case.h, case.d, case.e)))
  _, grads = delta_value_and_grads("pallas", config=lj.DeltaConfig(warp_specialized=True),
                                   interpret=mode == "interpret")(*args)
  _, grads_ref = delta_value_and_grads("reference")(*args)
  for name, g, g_ref in zip(DELTA_ARG_NAMES, grads, grads_ref):
    assert (g is None) == (g_ref is None), name
    if g_ref is not None:
      assert g.dtype == g_ref.dtype and rel_err(g, g_ref) < 3e-2, (name, rel_err(g, g_ref))


@pytest.mark.parametrize("t,mode", [pytest.param(t, *mode.values, marks=mode.marks, id=f"{t}-{mode.id}")
                                    for t in (300, 288) for mode in WS_MODES])
def test_delta_sequence_split_matches_oracle(t, mode):
  """The sequence split (`sequence_split`) on the warp-specialised kernels, forward and backward: 300 tokens in 4
  pieces of 128 (the third partly, the fourth wholly padding), or 288 in 4 pieces of 72, the row reshaped (each
  piece a chunk and 8 rows, the kernels reading zeros past them); a segment starting at a piece's first
  token; without the final state (the last piece's map not formed, the chunks' inverses formed once for both
  passes)."""
  case = DeltaCase(b=1, t=t, h=1, d=64, e=48, decay="token", segments=True)
  q, k, v, beta, decay, s0, ids = delta_inputs(case, seed=zlib.crc32(f"{case}ws-split".encode()))
  q, k, v = (x.astype(BF16) for x in (q, k, v))
  ids = ids.at[:, 128 if t == 300 else t // 4:].add(1000)
  cot = jax.random.split(jax.random.key(31), 2)
  args = (q, k, v, beta, decay, s0, ids, jax.random.normal(cot[0], v.shape),
          jax.random.normal(cot[1], (case.b, case.h, case.d, case.e)))
  (_, (o, _)), grads = delta_value_and_grads(
      "pallas", False, config=lj.DeltaConfig(warp_specialized=True, sequence_pieces=4),
      interpret=mode == "interpret")(*args)
  (_, (o_ref, _)), grads_ref = delta_value_and_grads("reference", False)(*args)
  assert rel_err(o, o_ref) < TOL[BF16]
  for name, g, g_ref in zip(DELTA_ARG_NAMES, grads, grads_ref):
    assert (g is None) == (g_ref is None), name
    if g_ref is not None:
      assert rel_err(g, g_ref) < 3e-2, (name, rel_err(g, g_ref))


# The split's map pass (`warp_specialized.piece_maps`): K and Ep equal, and both ways apart (the narrower side's last
# block run twice). Interpreted on the first alone.
PIECE_MAPS_PARAMS = [
    pytest.param(d, e, *mode.values, marks=mode.marks, id=f"D{d}E{e}-{mode.id}")
    for i, (d, e) in enumerate([(48, 80), (128, 128), (128, 40)]) for mode in (WS_MODES if i == 0 else WS_MODES[1:])]


@pytest.mark.parametrize("d,e,mode", PIECE_MAPS_PARAMS)
def test_delta_piece_maps_match_oracle(d, e, mode):
  """Each row's map [M | L]: the oracle's final state from [I | 0] over the values [0 | v] (q = k), T off the chunk,
  per-token rates and segment starts (none at token 0, as on the split's piece rows)."""
  from lightning_jax.ops.delta_attention import warp_specialized

  case = DeltaCase(b=2, t=200, h=2, d=d, e=e, decay="token", segments=True)
  _, k, v, beta, decay, _, ids = delta_inputs(case, seed=zlib.crc32(f"{case}maps".encode()))
  k, v = k.astype(BF16), v.astype(BF16)
  starts = jnp.concatenate([jnp.zeros_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
  interpret = mode == "interpret"
  maps = jax.jit(lambda: warp_specialized.piece_maps(
      k, v, decay, starts, interpret=interpret, inverse=warp_specialized.chunk_inverses(
          k, beta, decay, starts, with_unscaled=False, interpret=interpret)))()
  values = jnp.concatenate([jnp.zeros((*v.shape[:-1], d), BF16), v], axis=-1)
  identity = jnp.broadcast_to(jnp.eye(d, d + e), (case.b, case.h, d, d + e))
  _, maps_ref = jax.jit(lambda: lj.delta_attention(k, k, values, beta, decay, initial_state=identity, segment_ids=ids,
                                                   return_final_state=True, impl="reference"))()
  assert maps.shape == maps_ref.shape and maps.dtype == F32
  assert rel_err(maps[..., :d], maps_ref[..., :d]) < TOL[BF16], "M"
  assert rel_err(maps[..., d:], maps_ref[..., d:]) < TOL[BF16], "L"


@pytest.mark.parametrize("mode", WS_MODES)
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("case", INVERSE_CASES, ids=str)
def test_delta_inverse_matches_float64(case, dtype, mode):
  """The Mosaic GPU inverse kernel's T and T' = T Diag(beta) against numpy's float64 inverse of A's definition, D
  padded to 64, T off the chunk (its substitution runs compiled alone: interpreted, every block merges); random keys
  in the first row, keys near one direction in the second (one interpreted call for both)."""
  from lightning_jax.ops.delta_attention import warp_specialized

  k, beta, decay, starts = inverse_inputs(case, dtype, aligned_keys=True)
  tri, tri_beta = jax.jit(lambda: warp_specialized.chunk_inverses(k, beta, decay, starts, with_unscaled=True,
                                                                  interpret=mode == "interpret"))()
  assert tri.shape == tri_beta.shape == (case.b, case.h, -(-case.t // 64) * 64, 64) and tri.dtype == dtype
  # T's own rounding is 4e-3 of its largest entry in bfloat16; the float16 products add up to 7e-3 (aligned keys)
  assert inverse_error(tri, k, beta, decay, starts, scaled=False) < 1e-2
  assert inverse_error(tri_beta, k, beta, decay, starts, scaled=True) < 1e-2


@pytest.mark.parametrize("mode", WS_MODES)
def test_delta_inverse_walks_any_chunks_per_cta(mode):
  """A CTA walking 2 or 4 chunks (the next one's loads in flight) writes what one chunk a CTA does, bit for bit;
  a count that does not divide the chunks is refused."""
  b, t, h, d = 1, 256, 2, 64  # H > 1: heads interleave in k's rows, where a chunk's offset must step over them
  k, beta, decay, starts = inverse_inputs(DeltaCase(b=b, t=t, h=h, d=d, decay="token", segments=True), BF16, False)
  chunk_gates = pallas_mosaic_gpu.sweep_gates(decay, starts, num_tokens=t)
  beta = jnp.moveaxis(beta, 2, 1)
  interpret = mode == "interpret"
  walk = lambda n: jax.jit(lambda: delta_mosaic.inverse(k, beta, chunk_gates, with_unscaled=True,  # noqa: E731
                                                        chunks_per_cta=n, interpret=interpret))()
  one = walk(1)
  for n in (2, 4):
    for got, want in zip(walk(n), one):
      np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)))
  for bad in (3, 0, True):
    with pytest.raises(ValueError, match=f"chunks_per_cta must be None or a positive int dividing the 4 chunks, "
                                         f"got {bad!r}"):
      delta_mosaic.inverse(k, beta, chunk_gates, chunks_per_cta=bad, interpret=interpret)
  walks = functools.partial(delta_mosaic.default_chunks_per_cta, num_sms=132)
  assert walks(batch_heads=16, num_chunks=1024) == 8
  # 16 where their CTAs, at least one an SM, fit in one wave of three an SM: 256 CTAs (8 chunks a CTA: 512).
  assert walks(batch_heads=128, num_chunks=32) == 16
  assert walks(batch_heads=64, num_chunks=32) == 8  # 16 would leave 128 CTAs, fewer than the SMs
  assert walks(batch_heads=128, num_chunks=64) == 8  # 16 would leave 512, past one wave
  # At least a CTA an SM: 8 chunks a CTA give 128 CTAs at one head, 4 give 256.
  assert walks(batch_heads=1, num_chunks=1024) == 4
  assert walks(batch_heads=1, num_chunks=12) == 1
  # KDA's kernel: at most 8, and 2 CTAs an SM (4 chunks a CTA give 256 CTAs at one head, 2 give 512).
  assert walks(batch_heads=16, num_chunks=1024, policy=delta_mosaic.CHANNEL_GATED_WALKS) == 8
  assert walks(batch_heads=1, num_chunks=1024, policy=delta_mosaic.CHANNEL_GATED_WALKS) == 2


@needs_ws_jax
@pytest.mark.parametrize("dim_k,gated,segments,with_unscaled", [(128, True, True, True), (64, False, False, False)])
def test_delta_inverse_lowers_for_cuda(dim_k, gated, segments, with_unscaled):
  """The inverse kernel (its inline Mosaic GPU substitution included) lowers as the GPU compiles it, from any
  backend."""
  k = jax.ShapeDtypeStruct((2, 512 if gated else 504, 3, dim_k), BF16)  # 504: unpadded, the last tile runs past
  beta = jax.ShapeDtypeStruct((2, 3, 512), F32)
  gates = (jax.ShapeDtypeStruct((2, 3, 512), F32) if gated else None,
           jax.ShapeDtypeStruct((2, 512), jnp.int32) if segments else None)
  fn = jax.jit(lambda k, beta, gates: delta_mosaic.inverse(k, beta, gates, with_unscaled=with_unscaled,
                                                           chunks_per_cta=4, num_tokens=512))
  exported = jax.export.export(fn, platforms=["cuda"])(k, beta, gates)
  assert "delta_inverse_mosaic" in exported.mlir_module()
  assert [o.shape for o in exported.out_avals] == [(2, 3, 512, 64)] * (2 if with_unscaled else 1)


@needs_ws_jax
@pytest.mark.parametrize("dim_k,segments", [(128, True), (64, False)])
def test_delta_channel_gated_chunks_lower_for_cuda(dim_k, segments):
  """KDA's chunk-terms kernel (the inverse's solve and merges inside it) lowers as the GPU compiles it, from any
  backend: Mosaic GPU's layout inference runs here, where a tile shared by operands of two swizzles fails."""
  q = jax.ShapeDtypeStruct((1, 512, 2, dim_k), BF16)
  beta = jax.ShapeDtypeStruct((1, 2, 512), F32)
  rates = jax.ShapeDtypeStruct((1, 512, 2, dim_k), F32)
  runs = jax.ShapeDtypeStruct((1, 512), jnp.int32) if segments else None
  fn = jax.jit(lambda q, k, beta, rates, runs: delta_mosaic.channel_gated_chunks(
      q, k, beta, rates, scale=0.1, runs=runs, chunks_per_cta=4, num_tokens=512))
  exported = jax.export.export(fn, platforms=["cuda"])(q, q, beta, rates, runs)
  assert "delta_channel_gated" in exported.mlir_module()


def _channel_gated_inputs(b, t, h, d, rates, seed):
  """q, k [B, Tp, H, Dp] bf16 (padded to whole chunks and 64 or 128 features), beta [B, H, Tp] and per-key-channel
  rates [B, Tp, H, Dp] uniform in `rates` (natural log): `channel_gated_chunks`' operands."""
  keys = jax.random.split(jax.random.key(seed), 4)
  tp, dp = -(-t // 64) * 64, 64 if d <= 64 else 128
  pad = lambda x: chunk_common.pad_tokens_and_features(x, num_tokens=tp, dim=dp)  # noqa: E731
  q = pad(jax.random.normal(keys[0], (b, t, h, d)).astype(BF16))
  k = jax.random.normal(keys[1], (b, t, h, d))
  k = pad((k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(BF16))
  beta = jnp.pad(jax.random.uniform(keys[2], (b, h, t), maxval=2.0), ((0, 0), (0, 0), (0, tp - t)))
  return q, k, beta, pad(jax.random.uniform(keys[3], (b, t, h, d), minval=rates[0], maxval=rates[1]))


def _log2_gates64(rates):
  """numpy float64 G [B, Tp, H, K] of rates [B, Tp, H, K]: the log2 decay from each 64-token chunk's start through
  each row."""
  b, tp, h, d = rates.shape
  sums = np.cumsum(np.asarray(rates, np.float64).reshape(b, tp // 64, 64, h, d), axis=2).reshape(rates.shape)
  return -sums * np.log2(np.e)


def _block_ends64(rates):
  """numpy float64 [B, H, Tp / 64, 4, K]: G's rows 15, 31, 47 and 63 of each chunk (`_log2_gates64`), the block ends
  `channel_gated_chunks` returns."""
  b, tp, h, d = rates.shape
  ends = _log2_gates64(rates)[:, 15::16]  # [B, Tp / 16, H, K]
  return np.moveaxis(ends.reshape(b, tp // 64, 4, h, d), 3, 1)


# Moderate rates, and rates whose 16-token blocks decay by up to 59 (the kernel's bound is 60, natural log).
CHANNEL_GATED_CASES = [(2, 150, 2, 40, (0.0, 0.6)), (1, 128, 1, 64, (2.5, 3.7)), (1, 100, 2, 128, (0.0, 0.6))]


@pytest.mark.parametrize("case,mode", [
    pytest.param(case, *mode.values, marks=mode.marks, id=f"{case[:4]}-{case[4]}-{mode.id}")
    for case in CHANNEL_GATED_CASES for mode in WS_MODES])
def test_delta_channel_gated_chunks_match_float64(case, mode):
  """KDA's chunk terms from `channel_gated_chunks` (T', P, Q_g, K_g, K_C and the backward's T and G: pair products
  through each 16-row block's start on the tensor cores, T' from A as the inverse kernel solves it, G from the rates
  in the kernel, and its block ends) against numpy float64 of their definitions on the same bf16 q and k, T off the
  chunk, D padded (D 128: two column parts, one warpgroup each), one CTA walking every chunk of a row."""
  b, t, h, d, rates = case
  q, k, beta, rates = _channel_gated_inputs(b, t, h, d, rates, seed=zlib.crc32(str(case).encode()))
  scale = 0.3
  got = jax.jit(lambda: delta_mosaic.channel_gated_chunks(q, k, beta, rates, scale=scale,
                                                          chunks_per_cta=q.shape[1] // 64, with_backward_terms=True,
                                                          interpret=mode == "interpret"))()
  f64 = lambda x: np.asarray(jnp.asarray(x).astype(F32), np.float64)  # noqa: E731
  q64, k64, beta64, g64 = f64(q), f64(k), f64(beta), _log2_gates64(rates)
  # The blocks' ends against G's rows 15, 31, 47 and 63 (float32 sums of up to 64 rates: a few ulps of G; a
  # neighbouring row is a whole rate away); these rates are within the fast path's bound.
  want_ends = _block_ends64(rates)
  assert np.max(np.abs(f64(got.block_ends) - want_ends) / np.maximum(1.0, np.abs(want_ends))) < 2e-6
  assert bool(delta_mosaic.channel_spans_bounded(got.block_ends, q.dtype))
  tp, c = q.shape[1], 64
  for bi in range(b):
    for hi in range(h):
      for start in range(0, tp, c):
        rows = slice(start, start + c)
        qc, kc, gc, bc = q64[bi, rows, hi], k64[bi, rows, hi], g64[bi, rows, hi], beta64[bi, hi, rows]
        # 2^(G_t - G_s) <= 1 on the pairs kept (s <= t), clamped on the others (dropped)
        factors = np.exp2(np.minimum(gc[:, None, :] - gc[None, :, :], 0.0))
        a = np.where(np.tri(c, k=-1, dtype=bool), bc[:, None] * np.einsum("td,sd,tsd->ts", kc, kc, factors), 0.0)
        unscaled = np.linalg.inv(np.eye(c) + a)
        want = {"inverse": unscaled * bc[None, :], "unscaled_inverse": unscaled, "gates": gc,
                "pairs": np.where(np.tri(c, dtype=bool), scale * np.einsum("td,sd,tsd->ts", qc, kc, factors), 0.0),
                "queries": scale * qc * np.exp2(gc), "keys": kc * np.exp2(gc),
                "keys_to_end": kc * np.exp2(gc[-1:] - gc)}
        for name, value in want.items():
          tile = f64(getattr(got, name))
          tile = tile[bi, hi, rows] if name in ("inverse", "pairs", "unscaled_inverse") else tile[bi, rows, hi]
          err = np.max(np.abs(tile - value)) / max(1.0, np.max(np.abs(value)))
          assert err < 1e-2, (name, start, err)


def test_delta_channel_spans_bounded():
  """The fast path's condition: every 16-row block of every chunk decays by at most the operands' dtype's bound on
  each key channel (60 in natural log, 6 for float16), counted from the row before the block; moderate rates meet
  it, extreme ones do not, and one block of one channel just past the bound fails it."""
  def bounded(rates, dtype=BF16):
    return bool(delta_mosaic.channel_spans_bounded(jnp.asarray(_block_ends64(rates), F32), dtype))

  assert bounded(_channel_gated_inputs(1, 200, 2, 64, (0.0, 0.6), seed=0)[3])
  assert not bounded(_channel_gated_inputs(1, 200, 2, 64, (30.0, 40.0), seed=0)[3])

  def spike(span):  # zero rates but block 1 of chunk 1 (rows 80-95), channel 5 of head 1: G falls by span there
    return jnp.zeros((1, 256, 2, 64), F32).at[0, 80:96, 1, 5].set(span / 16)

  for dtype, limit in ((BF16, 60.0), (F16, 6.0)):
    assert delta_mosaic.max_block_span(dtype) == pytest.approx(limit / np.log(2))  # natural log in log2 units
    assert bounded(spike(limit - 0.5), dtype)
    assert not bounded(spike(limit + 0.5), dtype)


# KDA on the warp-specialised forward: from and to states, E off the blocks, rates near the fast path's bound, and
# extreme rates (1e-7 and 1e4), where the Triton forward runs instead (`warp_specialized._channel_gated`).
# The first in 2 pieces (`sequence_split`: the pieces' forwards warp-specialised, their maps the Triton sweep's);
# the second packed (segments starting inside chunks, on a 16-token edge, one of one token) and in 2 pieces too.
KDA_CASES = [
    (DeltaCase(b=1, t=150, h=1, d=64, e=48, decay="channel"), (0.0, 0.6), 2),
    (DeltaCase(b=1, t=150, h=1, d=64, e=48, decay="channel", segments=True), (0.0, 0.6), 2),
    (DeltaCase(b=1, t=200, h=2, d=40, e=72, decay="channel", initial_state=False), (2.5, 3.7), 1),
    (DeltaCase(b=1, t=100, h=1, d=64, e=64, decay="channel", rates="extreme", beta="edges"), None, 1),
    (DeltaCase(b=2, t=300, h=3, d=128, e=100, decay="channel"), (0.0, 0.6), 1),
]


@pytest.mark.parametrize("case,rates,pieces,mode", [
    pytest.param(case, rates, pieces, *mode.values, marks=mode.marks, id=f"{case}-{rates}-{pieces}-{mode.id}")
    for i, (case, rates, pieces) in enumerate(KDA_CASES)
    # Interpreted: D <= 64 but the first case (its 2-piece split is the second's, packed; its unpacked row the
    # third's): each interpreted case costs about 35 s on 2 cores.
    for mode in (WS_MODES if case.d <= 64 and i else WS_MODES[1:])])
def test_delta_kda_warp_specialized_matches_oracle(case, rates, pieces, mode):
  """KDA's forward on the warp-specialised kernels (o and the final state) and the op's gradients through it (its
  backward on the chunk terms, split in 2 pieces for the first case) against the oracle's; whether the fast path
  runs is checked on the same rates."""
  q, k, v, beta, decay, s0, ids = delta_inputs(case, seed=zlib.crc32(f"{case}kda".encode()))
  if rates is not None:
    decay = jax.random.uniform(jax.random.key(case.t), decay.shape, minval=rates[0], maxval=rates[1])
  q, k, v = (x.astype(BF16) for x in (q, k, v))
  padded = chunk_common.pad_tokens_and_features(decay, num_tokens=-(-case.t // 64) * 64,
                                                dim=64 if case.d <= 64 else 128)
  assert bool(delta_mosaic.channel_spans_bounded(jnp.asarray(_block_ends64(padded), F32), BF16)) == (
      rates is not None)
  config = lj.DeltaConfig(warp_specialized=True, sequence_pieces=pieces)
  interpret = mode == "interpret"
  # The op's gradients at D <= 64 through the custom VJP, o and the final state from the same call (the backward
  # alone, at every D and near the bound: test_delta_kda_backward_on_chunk_terms); else the forward alone.
  if case.d <= 64 and rates is not None and rates[1] < 1.0:
    cot = jax.random.split(jax.random.key(1), 2)
    args = (q, k, v, beta, decay, s0, ids, jax.random.normal(cot[0], v.shape),
            jax.random.normal(cot[1], (case.b, case.h, case.d, case.e)))
    (_, (o, final)), grads = delta_value_and_grads("pallas", config=config, interpret=interpret)(*args)
    (_, (o_ref, final_ref)), grads_ref = delta_value_and_grads("reference")(*args)
    for name, g, g_ref in zip(DELTA_ARG_NAMES, grads, grads_ref):
      if g_ref is not None:
        assert rel_err(g, g_ref) < 3e-2, (name, rel_err(g, g_ref))
  else:
    call = lambda **kw: lj.delta_attention(q, k, v, beta, decay, initial_state=s0, segment_ids=ids,  # noqa: E731
                                           return_final_state=True, **kw)
    o, final = jax.jit(lambda: call(impl="pallas", config=config, interpret=interpret))()
    o_ref, final_ref = jax.jit(lambda: call(impl="reference"))()
  assert o.dtype == BF16 and final.dtype == F32
  assert rel_err(o, o_ref) < TOL[BF16] and rel_err(final, final_ref) < TOL[BF16]


# KDA's warp-specialised backward: T, E and D off the blocks and from and to states, packed; rates near the bound of
# the 16-token blocks' spans; extreme rates, where the Triton backward runs instead; D = 128 on the GPU alone.
KDA_BACKWARD_CASES = [
    (DeltaCase(b=1, t=130, h=1, d=40, e=72, decay="channel", segments=True), (0.0, 0.6)),
    (DeltaCase(b=1, t=200, h=2, d=64, e=48, decay="channel"), (2.5, 3.7)),
    (DeltaCase(b=1, t=100, h=1, d=64, e=64, decay="channel", rates="extreme", beta="edges"), None),
    (DeltaCase(b=2, t=300, h=3, d=128, e=100, decay="channel"), (0.0, 0.6)),
]


@pytest.mark.parametrize("case,rates,mode", [
    pytest.param(case, rates, *mode.values, marks=mode.marks, id=f"{case}-{rates}-{mode.id}")
    for i, (case, rates) in enumerate(KDA_BACKWARD_CASES) for mode in (WS_MODES if i == 0 else WS_MODES[1:])])
def test_delta_kda_backward_on_chunk_terms(case, rates, mode):
  """KDA's backward where the forward is warp-specialised (`pallas_triton._channel_gated_backward`: the chunk
  terms kernel, the warp-specialised state sweep and reverse sweep in their channel-gated modes, the per-channel
  tile gradient kernel) against the oracle's gradients; that path runs (its kernels in the jaxpr); where a block's
  span passes the bound, the Triton backward bit for bit; dL/dS_0 alone (the sequence split's) as in the full
  backward."""

  q, k, v, beta, decay, s0, ids = delta_inputs(case, seed=zlib.crc32(f"{case}kda-bwd".encode()))
  starts = None if ids is None else chunk_common.segment_starts(ids)
  if rates is not None:
    decay = jax.random.uniform(jax.random.key(case.t), decay.shape, minval=rates[0], maxval=rates[1])
  q, k, v = (x.astype(BF16) for x in (q, k, v))
  cot = jax.random.split(jax.random.key(3), 2)
  do = jax.random.normal(cot[0], v.shape).astype(BF16)
  d_final = jax.random.normal(cot[1], s0.shape)
  config = pallas_triton.default_config(per_channel_gate=True, dtype=BF16, dim_k=case.d, dim_v=case.e,
                                        compute_capability=(9, 0))
  options = dict(scale=case.d ** -0.5, interpret=mode == "interpret")
  backward = lambda warp_specialized, **kw: jax.jit(lambda: pallas_triton.backward(  # noqa: E731
      q, k, v, beta, decay, starts, s0, do, d_final,
      config=dataclasses.replace(config, warp_specialized=warp_specialized),
      **options, **kw))
  warp_specialized_backward = backward(True)  # one jitted function: traced once for its jaxpr and its run
  jaxpr = str(jax.make_jaxpr(warp_specialized_backward)())
  for kernel in ("delta_channel_gated_mosaic", "delta_warp_specialized", "delta_state_cotangents_warp_specialized",
                 "delta_attention_tile_gradients"):
    assert kernel in jaxpr, kernel
  grads = warp_specialized_backward()

  def loss(q, k, v, beta, decay, s0):
    o, final = lj.delta_attention(q, k, v, beta, decay, initial_state=s0, segment_ids=ids, return_final_state=True,
                                  impl="reference")
    return jnp.sum(o.astype(F32) * do.astype(F32)) + jnp.sum(final * d_final)

  grads_ref = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, beta, decay, s0)
  for name, g, g_ref in zip(DELTA_ARG_NAMES, grads, grads_ref):
    assert g.shape == g_ref.shape and g.dtype == g_ref.dtype, name
    # Near the bound the rates' gradient from bf16 operands is 0.1-0.2 off the float32 oracle's, as the Triton
    # backward's (0.1): the blocks' factors reach 2^86 there.
    bound = 0.3 if name == "decay" and rates is not None and rates[0] > 1.0 else 3e-2
    assert rel_err(g, g_ref) < bound, (name, rel_err(g, g_ref))
  if rates is None:  # not bounded: the Triton backward's gradients
    for g, g_triton in zip(grads, backward(False)()):
      assert jnp.array_equal(g, g_triton)
  assert jnp.array_equal(backward(True, initial_cotangent_only=True)(), grads[-1])


@pytest.mark.parametrize("mode", WS_MODES)
def test_delta_kda_backward_takes_the_forward_chunk_terms(mode):
  """KDA's forward keeping its chunk terms and states (`DeltaConfig.forward_states`, the default) and the backward
  taking them: o and the final state as without them, the backward's gradients bit for bit as it gives forming them
  again (the same kernels on the same operands: the pair kernel, the state sweep for S_n^T and U^T, the blocks' log
  decays), and (compiled) through the op's VJP in 2 pieces as with forward_states=False; where a block's span passes
  the bound, the zeros kept in their place are not read."""
  from lightning_jax.ops.delta_attention import warp_specialized

  # One head, 2 chunks (the last partial): the comparisons are bit for bit, the oracle's are the tests above.
  case = DeltaCase(b=1, t=100, h=1, d=40, e=72, decay="channel")
  q, k, v, beta, decay, s0, _ = delta_inputs(case, seed=31)
  decay = jax.random.uniform(jax.random.key(32), decay.shape, minval=0.0, maxval=0.6)
  q, k, v = (x.astype(BF16) for x in (q, k, v))
  do = jax.random.normal(jax.random.key(33), v.shape).astype(BF16)
  d_final = jax.random.normal(jax.random.key(34), s0.shape)
  config = pallas_triton.default_config(per_channel_gate=True, dtype=BF16, dim_k=case.d, compute_capability=(9, 0))
  config = dataclasses.replace(config, warp_specialized=True)
  assert config.keeps_chunk_terms(per_channel_gate=True)
  assert not dataclasses.replace(config, forward_states=False).keeps_chunk_terms(per_channel_gate=True)
  interpret = mode == "interpret"
  options = dict(scale=case.d ** -0.5, interpret=interpret)

  def fallback(*args):
    return pallas_triton.forward(*args, with_final_state=True, config=config, **options)

  # The rates traced: each function compiles once for both rates (the interpreted kernels' compiles dominate).
  forward = {kept: jax.jit(lambda rates, kept=kept: warp_specialized.forward(
      q, k, v, beta, rates, None, s0, with_final_state=True, fallback=fallback, with_chunk_terms=kept, **options))
      for kept in (True, False)}
  backward = jax.jit(lambda rates, terms: pallas_triton.backward(q, k, v, beta, rates, None, s0, do, d_final,
                                                                 config=config, chunk_terms=terms, **options))
  tp, h = -(-case.t // 64) * 64, case.h
  # The second rates pass the bound: the Triton kernels run (compiled only: interpreted, about 15 s on 2 cores).
  for rates in (decay,) + (() if interpret else (decay.at[0, 20:36, 0, 3].set(8.0),)):
    o, final, terms = forward[True](rates)
    o_alone, final_alone = forward[False](rates)
    assert jnp.array_equal(o, o_alone) and jnp.array_equal(final, final_alone)
    assert len(terms) == 10 and terms[6].shape == (1, tp, h, 64) and terms[6].dtype == F32
    assert [x.shape for x in terms[7:]] == [(1, h, tp // 64, 128, 64), (1, h, 128, tp), (1, h, tp // 64, 4, 64)]
    for g, g_formed in zip(backward(rates, terms), backward(rates, None)):
      assert jnp.array_equal(g, g_formed)
  if interpret:  # the op's VJP in 2 pieces compiled only: interpreted, test_delta_kda_warp_specialized_matches_oracle
    return
  cot = jax.random.split(jax.random.key(35), 2)
  args = (q, k, v, beta, decay, s0, None, jax.random.normal(cot[0], v.shape), jax.random.normal(cot[1], s0.shape))
  grads = [delta_value_and_grads("pallas", config=lj.DeltaConfig(warp_specialized=True, sequence_pieces=2,
                                                                 forward_states=kept), interpret=interpret)(*args)[1]
           for kept in (None, False)]
  for name, g, g_formed in zip(DELTA_ARG_NAMES, *grads):
    assert rel_err(g, g_formed) < 1e-6, (name, rel_err(g, g_formed))


@pytest.mark.parametrize("mode", WS_MODES)
def test_delta_kda_float16_keeps_its_range(mode):
  """float16 operands with rates whose 16-token blocks decay by 16-32 (natural log): within bf16's bound, past
  float16's (the blocks' key factors would pass its largest value), so the Triton kernels run, forward and backward,
  and o, the final state and every gradient match the oracle."""
  case = DeltaCase(b=1, t=100, h=2, d=64, e=48, decay="channel")
  q, k, v, beta, _, s0, _ = delta_inputs(case, seed=21)
  decay = jax.random.uniform(jax.random.key(22), (case.b, case.t, case.h, case.d), minval=1.0, maxval=2.0)
  q, k, v = (x.astype(F16) for x in (q, k, v))
  config = lj.DeltaConfig(warp_specialized=True, sequence_pieces=1)
  cot = jax.random.split(jax.random.key(23), 2)
  args = (q, k, v, beta, decay, s0, None, jax.random.normal(cot[0], v.shape), jax.random.normal(cot[1], s0.shape))
  (_, (o, final)), grads = delta_value_and_grads("pallas", config=config, interpret=mode == "interpret")(*args)
  (_, (o_ref, final_ref)), grads_ref = delta_value_and_grads("reference")(*args)
  assert rel_err(o, o_ref) < TOL[F16] and rel_err(final, final_ref) < TOL[F16]
  for name, g, g_ref in zip(DELTA_ARG_NAMES, grads, grads_ref):
    assert rel_err(g, g_ref) < 3e-2, (name, rel_err(g, g_ref))


@needs_ws_jax
@pytest.mark.parametrize("dim_k,dim_v,rows", [(128, 128, 512), (64, 192, 504)])
def test_delta_kda_kernels_lower_for_cuda(dim_k, dim_v, rows):
  """KDA's chunk-terms kernel and the sweep taking them (storing S_n^T and U^T for the backward, or those alone),
  both packed at K = 128 (the sweep then drops rows by the segment-start counts), and the reverse sweep in its
  channel-gated mode (2 ring slots at K = 128, 3 at K = 64, within sm90's shared memory) lower as the GPU compiles
  them, from any backend. rows: of q, k, the rates and v (504: unpadded, the last chunk's tiles run past them)."""
  given = jax.ShapeDtypeStruct((2, rows, 3, dim_k), BF16)
  beta = jax.ShapeDtypeStruct((2, 3, 512), F32)
  rates = jax.ShapeDtypeStruct((2, rows, 3, dim_k), F32)
  runs = (jax.ShapeDtypeStruct((2, 512), jnp.int32),) if dim_k == 128 else ()
  exported = jax.export.export(jax.jit(lambda q, k, beta, rates, *runs: tuple(delta_mosaic.channel_gated_chunks(
      q, k, beta, rates, scale=0.1, runs=runs[0] if runs else None, chunks_per_cta=4, num_tokens=512))),
      platforms=["cuda"])(given, given, beta, rates, *runs)
  assert "delta_channel_gated_mosaic" in exported.mlir_module()
  assert [o.shape for o in exported.out_avals] == ([(2, 3, 512, 64)] * 2 + [(2, 512, 3, dim_k)] * 3
                                                   + [(2, 3, 8, 4, dim_k)])
  q = jax.ShapeDtypeStruct((2, 512, 3, dim_k), BF16)  # the chunk terms
  v = jax.ShapeDtypeStruct((2, rows, 3, dim_v), BF16)
  tiles = jax.ShapeDtypeStruct((2, 3, 512, 64), BF16)
  channel_decay = jax.ShapeDtypeStruct((2, 3, 8, 1, dim_k), F32)
  s0 = jax.ShapeDtypeStruct((2, 3, 1, dim_v, dim_k), F32)
  cfg = heuristics.resolve_warp_specialized(None, dim_k=dim_k, itemsize=2, delta=True, channel_gated=True)
  gates = lambda runs: (None, runs[0] if runs else None)  # noqa: E731
  fn = jax.jit(lambda q, k, v, s0, inverse, keys_end, pairs, decay, *runs: pallas_mosaic_gpu.forward_padded(
      q, k, v, None, s0, chunk_gates=gates(runs), delta_inverse=inverse,
      delta_channel_gates=(keys_end, pairs, decay), scale=0.1, seq_len=500, return_final_state=True, cfg=cfg))
  exported = jax.export.export(fn, platforms=["cuda"])(q, q, v, s0, tiles, q, tiles, channel_decay, *runs)
  assert "delta_warp_specialized" in exported.mlir_module()
  assert [o.shape for o in exported.out_avals] == [(2, rows, 3, dim_v), (2, 3, dim_v, dim_k)]
  states = [(2, 3, 8, dim_v, dim_k), (2, 3, dim_v, 512)]
  fn = jax.jit(lambda q, k, v, inverse, keys_end, pairs, decay, *runs: pallas_mosaic_gpu.forward_padded(
      q, k, v, None, chunk_gates=gates(runs), delta_inverse=inverse, delta_channel_gates=(keys_end, pairs, decay),
      delta_states=True, scale=0.1, seq_len=500, cfg=cfg))
  exported = jax.export.export(fn, platforms=["cuda"])(q, q, v, tiles, q, tiles, channel_decay, *runs)
  assert [o.shape for o in exported.out_avals] == [(2, rows, 3, dim_v)] + states
  fn = jax.jit(lambda k, v, inverse, keys_end, pairs, decay, s0, *runs: delta_mosaic.state_sweep(
      k, v, inverse, gates(runs), s0, channel_gates=(keys_end, pairs, decay)))
  state_t = jax.ShapeDtypeStruct((2, 3, dim_v, dim_k), F32)
  v = jax.ShapeDtypeStruct((2, 512, 3, dim_v), BF16)  # the backward's operands: whole chunks
  exported = jax.export.export(fn, platforms=["cuda"])(q, v, tiles, q, tiles, channel_decay, state_t, *runs)
  assert [o.shape for o in exported.out_avals] == states
  assert delta_mosaic.num_stages(dim_k=dim_k, itemsize=2, channel_gated=True) == (2 if dim_k == 128 else 3)
  fn = jax.jit(lambda q, k, inverse, do, keys, pairs, decay, d_final: delta_mosaic.state_cotangents(
      q, k, inverse, do, (None, None), d_final, scale=1.0, channel_gates=(keys, pairs, decay)))
  exported = jax.export.export(fn, platforms=["cuda"])(q, q, tiles, v, q, tiles, channel_decay, state_t)
  assert "delta_state_cotangents_warp_specialized" in exported.mlir_module()
  assert [o.shape for o in exported.out_avals] == [states[0], (2, 3, dim_v, dim_k), states[1]]


@pytest.mark.parametrize("mode", WS_MODES)
def test_delta_backward_takes_what_the_forward_kept(mode):
  """The warp-specialised backward on the forward's T and T' and its S_n^T and U^T (the op's residuals) and on
  those it forms itself without them: the same gradients, so the forward padded and gated them as the backward
  does (T off the chunk, packed, per-token rates, from and to states); the states bit for bit (the same chain)."""
  from lightning_jax.ops.delta_attention import warp_specialized

  # DELTA_CASES[0] with B = 1, one head and 2 chunks, the last partial (its rows and heads against the oracle,
  # through the kept states: test_delta_warp_specialized_gradients_match_oracle).
  case = dataclasses.replace(DELTA_CASES[0], b=1, t=100, h=1)
  q, k, v, beta, decay, s0, ids = delta_inputs(case, seed=11)
  q, k, v = (x.astype(BF16) for x in (q, k, v))
  starts = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
  do = jax.random.normal(jax.random.key(12), v.shape).astype(BF16)
  d_final = jax.random.normal(jax.random.key(13), s0.shape)
  config = dataclasses.replace(DELTA_BLOCKS, warp_specialized=True)
  assert config.warp_specializes_backward(per_channel_gate=False)
  options = dict(scale=case.d ** -0.5, config=config, interpret=mode == "interpret")
  forward_options = dict(scale=options["scale"], interpret=options["interpret"])
  o, final, kept = jax.jit(lambda: warp_specialized.forward(q, k, v, beta, decay, starts, s0, with_final_state=True,
                                                             with_inverses=True, with_states=True,
                                                             **forward_options))()
  o_alone, final_alone = jax.jit(lambda: warp_specialized.forward(q, k, v, beta, decay, starts, s0,
                                                                  with_final_state=True, **forward_options))()
  assert jnp.array_equal(o, o_alone) and jnp.array_equal(final, final_alone)  # storing the states changes neither
  inverses, states = kept[:2], kept[2:]
  tp = -(-case.t // 64) * 64
  assert [x.shape for x in inverses] == [(case.b, case.h, tp, 64)] * 2
  assert [x.shape for x in states] == [(case.b, case.h, tp // 64, 64, 64), (case.b, case.h, 64, tp)]
  # The backward's state sweep on the same padded operands.
  pad = lambda x, **kw: chunk_common.pad_tokens_and_features(x, num_tokens=tp, **kw)  # noqa: E731
  pad_rows = lambda x: jnp.pad(x, ((0, 0), (0, tp - case.t)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
  swept = jax.jit(lambda: delta_mosaic.state_sweep(
      pad(k, dim=64), pad(v, dim=64), inverses[1],
      pallas_mosaic_gpu.sweep_gates(pad_rows(decay), pad_rows(starts), num_tokens=tp),
      jnp.swapaxes(chunk_common.pad_state(s0, 64, 64), -1, -2), interpret=mode == "interpret"))()
  for x, y in zip(states, swept):
    assert jnp.array_equal(x, y)
  backward = jax.jit(lambda inverses, states: pallas_triton.backward(q, k, v, beta, decay, starts, s0, do, d_final,
                                                                     inverses=inverses, states=states, **options))
  grads = backward(inverses, states)
  for name, g, g_formed in zip(DELTA_ARG_NAMES, grads, backward(None, None)):
    assert g.shape == g_formed.shape and rel_err(g, g_formed) < 1e-3, (name, rel_err(g, g_formed))
  # dL/dS_0 alone (the sequence split's pass from its pieces' own outputs), from the forward's T' or its own.
  initial_only = jax.jit(lambda inverses: pallas_triton.backward(q, k, v, beta, decay, starts, s0, do, d_final,
                                                                 inverses=inverses, initial_cotangent_only=True,
                                                                 **options))
  for given in (inverses, None):
    assert jnp.array_equal(initial_only(given), grads[-1])


@pytest.mark.parametrize("mode", WS_MODES)
@pytest.mark.parametrize("gated,segments,with_initial", [(True, True, True), (False, False, False)])
def test_delta_state_sweep_matches_the_triton_sweep(gated, segments, with_initial, mode):
  """The backward's warp-specialised state sweep (the forward's kernel storing S_n^T and U^T) against the Triton
  sweep's S_n and U, bf16, over 3 chunks, K = 64 (the interpreter), E over two value blocks."""
  from lightning_jax.ops.lightning_attention import chunk_common

  b, t, h, d, e = 1, 192, 2, 64, 128
  rng = np.random.default_rng(7)
  k = jnp.asarray(rng.normal(size=(b, t, h, d)) / d ** 0.5, BF16)
  v = jnp.asarray(rng.normal(size=(b, t, h, e)), BF16)
  beta = jnp.asarray(rng.uniform(0, 2, size=(b, h, t)), F32)
  rates = jnp.asarray(rng.uniform(0, 0.3, size=(b, t, h)), F32) if gated else None
  starts = jnp.asarray(np.isin(np.arange(t), [0, 70, 130])[None], bool) if segments else None
  s0 = jnp.asarray(0.3 * rng.normal(size=(b, h, d, e)), F32) if with_initial else None
  interpret = mode == "interpret"
  config = dataclasses.replace(DELTA_BLOCKS, chunk_size=64)
  gates = pallas_triton.gates(pallas_triton.gate_logs(rates, seq_len=t, dim_k=d, chunk_size=64), starts, batch=b,
                              heads=h, seq_len=t, dim_k=d, chunk_size=64)
  w, u_v, _ = pallas_triton.prepare_by_tiles(k, v, beta, gates, config=config, interpret=interpret)
  _, _, states, values = pallas_triton.sweep(k, k, w, u_v, None, gates, s0, scale=1.0, with_outputs=False,
                                             with_final_state=False, with_states=True, with_values=True,
                                             config=config, interpret=interpret)
  cumdecay, runs = (None, None) if rates is None and starts is None else chunk_common.token_chunk_gates(
      rates, starts, chunk_size=64, num_tokens=t, reverse=False)
  inverse = delta_mosaic.inverse(k, beta, (cumdecay, runs if segments else None), interpret=interpret)
  states_t, values_t = delta_mosaic.state_sweep(k, v, inverse, (cumdecay, runs if segments else None),
                                                None if s0 is None else jnp.swapaxes(s0, -1, -2), interpret=interpret)
  assert states_t.shape == (b, h, t // 64, e, d) and values_t.shape == (b, h, e, t)
  assert rel_err(jnp.swapaxes(states_t, -1, -2).reshape(states.shape), states) < TOL[BF16]
  assert rel_err(jnp.moveaxis(values_t, 3, 1), values) < TOL[BF16]


@needs_ws_jax
@pytest.mark.parametrize("dim_k,dim_v,gated,segments,with_final", [
    (128, 128, True, True, True), (64, 64, False, False, False), (128, 192, False, True, False)])
def test_delta_backward_sweeps_lower_for_cuda(dim_k, dim_v, gated, segments, with_final):
  """The backward's warp-specialised sweeps lower as the GPU compiles them (the reverse sweep's 2 ring slots at K =
  128 and 3 at K = 64 within sm90's shared memory, wgmma's operands), from any backend."""
  assert delta_mosaic.num_stages(dim_k=128, itemsize=2) == 2 and delta_mosaic.num_stages(dim_k=64, itemsize=2) == 3
  q = jax.ShapeDtypeStruct((2, 192, 3, dim_k), BF16)
  do = jax.ShapeDtypeStruct((2, 192, 3, dim_v), BF16)
  gates = (jax.ShapeDtypeStruct((2, 3, 192), F32) if gated else None,
           jax.ShapeDtypeStruct((2, 192), jnp.int32) if segments else None)
  d_final = jax.ShapeDtypeStruct((2, 3, dim_v, dim_k), F32) if with_final else None
  inverse = jax.ShapeDtypeStruct((2, 3, 192, 64), BF16)
  fn = jax.jit(lambda q, k, inverse, do, gates, d_final: delta_mosaic.state_cotangents(q, k, inverse, do, gates,
                                                                                       d_final, scale=0.125))
  exported = jax.export.export(fn, platforms=["cuda"])(q, q, inverse, do, gates, d_final)
  assert "delta_state_cotangents_warp_specialized" in exported.mlir_module()
  assert [o.shape for o in exported.out_avals] == [(2, 3, 3, dim_v, dim_k), (2, 3, dim_v, dim_k), (2, 3, dim_v, 192)]
  # The sequence split's pass from zero end cotangents: dL/dS_0^T alone.
  fn = jax.jit(lambda q, k, inverse, do, gates: delta_mosaic.state_cotangents(q, k, inverse, do, gates, None,
                                                                             scale=0.125, initial_only=True))
  exported = jax.export.export(fn, platforms=["cuda"])(q, q, inverse, do, gates)
  assert [o.shape for o in exported.out_avals] == [(2, 3, dim_v, dim_k)]
  # The state sweep before it: the forward's kernel storing S_n^T and U^T.
  fn = jax.jit(lambda k, v, inverse, gates, s0: delta_mosaic.state_sweep(k, v, inverse, gates, s0))
  exported = jax.export.export(fn, platforms=["cuda"])(q, do, inverse, gates, d_final)
  assert [o.shape for o in exported.out_avals] == [(2, 3, 3, dim_v, dim_k), (2, 3, dim_v, 192)]
  # The gradient kernel after both (K and Ep 64 or 128: wider values take the Triton one).
  beta = jax.ShapeDtypeStruct((2, 3, 192), F32)
  states = jax.ShapeDtypeStruct((2, 3, 3, dim_v, dim_k), BF16)
  values_t = jax.ShapeDtypeStruct((2, 3, dim_v, 192), BF16)
  fn = jax.jit(lambda *args: delta_mosaic.tile_gradients(*args, scale=0.125))
  args = (q, q, do, beta, pallas_triton.Gates(*gates, None), inverse, states, states, values_t, values_t, do)
  if dim_v > 128:
    with pytest.raises(ValueError, match="K and Ep 64 or 128"):
      jax.eval_shape(fn, *args)
    return
  exported = jax.export.export(fn, platforms=["cuda"])(*args)
  assert "delta_tile_gradients_mosaic" in exported.mlir_module()
  assert [o.shape for o in exported.out_avals] == ([(2, 192, 3, dim_k)] * 2 + [(2, 192, 3, dim_v), (2, 3, 192)]
                                                  + [(2, 3, 192)] * gated)


@pytest.mark.parametrize("mode", WS_MODES)
def test_delta_mosaic_tile_gradients_match_the_triton_kernel(mode):
  """The Mosaic GPU gradient kernel against the Triton one on the same chunk operands (random T, states and
  cotangents: the kernels' algebra alone), per-token rates and packed rows, K and Ep apart."""
  b, h, n, dim_k, dim_v, c = 1, 1, 3, 64, 128, 64
  tp = n * c
  keys = jax.random.split(jax.random.PRNGKey(7), 11)
  rnd = lambda i, shape, scale=1.0: (scale * jax.random.normal(keys[i], shape)).astype(BF16)  # noqa: E731
  q, k = rnd(0, (b, tp, h, dim_k), 0.3), rnd(1, (b, tp, h, dim_k), 0.3)
  v, do = rnd(2, (b, tp, h, dim_v)), rnd(3, (b, tp, h, dim_v))
  beta = jax.random.uniform(keys[4], (b, h, tp), maxval=2.0)
  tri = (jnp.tril(0.2 * jax.random.normal(keys[5], (b, h, n, c, c)), -1) + jnp.eye(c)).reshape(b, h, tp, c)
  states, d_next = rnd(6, (b, h, n, dim_v, dim_k), 0.5), rnd(7, (b, h, n, dim_v, dim_k), 0.5)
  values_t, d_values_t = rnd(8, (b, h, dim_v, tp)), rnd(9, (b, h, dim_v, tp))
  g = -jnp.cumsum(jax.random.uniform(keys[10], (b, h, n, c), maxval=0.3), axis=-1).reshape(b, h, tp)
  starts = np.zeros((b, tp), bool)
  starts[:, [5, 70, 71, 191]] = True  # inside chunks, twice in a row, a chunk's last row
  runs = jnp.asarray(np.cumsum(starts.reshape(b, n, c), axis=-1).reshape(b, tp).astype(np.int32))
  args = (q, k, v, beta, pallas_triton.Gates(g, runs, None), tri.astype(BF16), states, d_next, values_t, d_values_t,
          do)
  interpret = mode == "interpret"
  mosaic = jax.jit(lambda *a: delta_mosaic.tile_gradients(*a, scale=0.3, interpret=interpret))(*args)
  config = dataclasses.replace(pallas_triton.default_config(per_channel_gate=False, dtype=BF16, dim_k=dim_k,
                                                            dim_v=dim_v), chunk_size=c)
  triton = jax.jit(lambda *a: pallas_triton.tile_gradients(*a, scale=0.3, config=config, interpret=interpret,
                                                           transposed=True))(*args)
  for name, x, y in zip(("dq", "dk", "dv", "dbeta", "dg"), mosaic, triton):
    assert x.shape == y.shape and x.dtype == y.dtype, name
    assert rel_err(x, y) < 2e-3, (name, rel_err(x, y))


@needs_ws_jax
@pytest.mark.parametrize("dim_k,dim_v,gated,segments", [(128, 128, True, True), (64, 128, False, False),
                                                        (128, 64, True, False)])
def test_delta_piece_maps_lower_for_cuda(dim_k, dim_v, gated, segments):
  """The split's map pass lowers as the GPU compiles it (its ring of 4 slots within sm90's shared memory at K = 128,
  both chains' wgmma operands), from any backend."""
  assert delta_mosaic.piece_maps_shared_memory_bytes(num_stages=4, dim_k=128, itemsize=2) <= 232448
  k = jax.ShapeDtypeStruct((2, 192, 3, dim_k), BF16)
  v = jax.ShapeDtypeStruct((2, 192, 3, dim_v), BF16)
  gates = (jax.ShapeDtypeStruct((2, 3, 192), F32) if gated else None,
           jax.ShapeDtypeStruct((2, 192), jnp.int32) if segments else None)
  inverse = jax.ShapeDtypeStruct((2, 3, 192, 64), BF16)
  fn = jax.jit(lambda k, v, inverse, gates: delta_mosaic.piece_maps(k, v, inverse, gates))
  exported = jax.export.export(fn, platforms=["cuda"])(k, v, inverse, gates)
  assert "delta_piece_maps_warp_specialized" in exported.mlir_module()
  assert [o.shape for o in exported.out_avals] == [(2, 3, dim_k + dim_v, dim_k)]


@pytest.mark.parametrize("mode", WS_MODES[1:])
@pytest.mark.parametrize("num_chunks", range(1, 9))
@pytest.mark.parametrize("op,dim", [("lightning", 64), ("lightning", 128), ("delta", 64), ("delta", 128)])
def test_compiled_at_every_short_chunk_count(op, dim, num_chunks, mode):
  """Per-token rates over 1 to 8 chunks, compiled: the memory warpgroup's loops are unrolled differently at each
  count, and with registers rebalanced between the warpgroups ptxas once faulted at some counts (PERFORMANCE.md)."""
  t = num_chunks * pallas_mosaic_gpu.CHUNK_SIZE - 5
  if op == "lightning":
    rng = np.random.default_rng(num_chunks)
    q, k, v = (jnp.asarray(rng.normal(size=(1, t, 2, dim)), BF16) for _ in range(3))
    decay = jnp.asarray(rng.uniform(0.001, 0.3, size=(1, t, 2)), F32)
    call = lambda **kw: lj.lightning_attention(q, k, v, decay, **kw)  # noqa: E731
    o = call(impl="pallas", variant="warp_specialized")
  else:
    case = DeltaCase(b=1, t=t, h=2, d=dim, e=dim, initial_state=False)
    q, k, v, beta, decay, _, _ = delta_inputs(case, seed=num_chunks)
    q, k, v = (x.astype(BF16) for x in (q, k, v))
    call = lambda **kw: lj.delta_attention(q, k, v, beta, decay, **kw)  # noqa: E731
    o = call(impl="pallas", config=lj.DeltaConfig(warp_specialized=True))
  assert rel_err(o, jax.jit(lambda: call(impl="reference"))()) < TOL[BF16]


@needs_ws_jax
@pytest.mark.parametrize("dim_k,dim_v,gated,segments,with_states,kept,rows", [
    (128, 128, True, True, True, True, 192), (64, 64, False, False, False, False, 192),
    (128, 64, True, False, False, True, 152), (64, 128, True, True, True, False, 152)])
def test_delta_warp_specialized_lowers_for_cuda(dim_k, dim_v, gated, segments, with_states, kept, rows):
  """The delta mode lowers as the GPU compiles it (wgmma's operand shapes and layouts), from any backend; kept: the
  output warpgroup also stores S_n^T and U^T (the backward's residuals); rows: the operands' (152: unpadded, the last
  chunk's tiles run past them)."""
  q = jax.ShapeDtypeStruct((2, rows, 3, dim_k), BF16)
  v = jax.ShapeDtypeStruct((2, rows, 3, dim_v), BF16)
  gates = (jax.ShapeDtypeStruct((2, 3, 192), F32) if gated else None,
           jax.ShapeDtypeStruct((2, 192), jnp.int32) if segments else None)
  inverse = jax.ShapeDtypeStruct((2, 3, 192, 64), BF16)
  s0 = jax.ShapeDtypeStruct((2, 3, 1, dim_v, dim_k), F32) if with_states else None
  cfg = heuristics.resolve_warp_specialized(None, dim_k=dim_k, itemsize=2, delta=True)
  fn = jax.jit(lambda q, k, v, s0, gates, inverse: pallas_mosaic_gpu.forward_padded(
      q, k, v, None, s0, chunk_gates=gates, delta_inverse=inverse, delta_states=kept, scale=0.125, seq_len=150,
      return_final_state=with_states, cfg=cfg, num_tokens=192))
  exported = jax.export.export(fn, platforms=["cuda"])(q, q, v, s0, gates, inverse)
  assert "delta_warp_specialized" in exported.mlir_module()
  assert [o.shape for o in exported.out_avals] == ([(2, rows, 3, dim_v)] + [(2, 3, 3, dim_v, dim_k), (2, 3, dim_v, 192)]
                                                  * kept + [(2, 3, dim_v, dim_k)] * with_states)


@needs_ws_jax
@pytest.mark.parametrize("t,decay", [(200, None), (200, "channel"), (256, "token"), (202, None)])
def test_delta_warp_specialized_forward_walks_t_unpadded(t, decay):
  """The sm90 forward (the inverse or chunk-terms kernel, then the sweep) takes q, k, v and the rates with T rows
  where T is a multiple of 8 (the kernels read zeros past it): the program lowered for CUDA pads none of them and
  holds no [B, Tp, H, D] array of whole chunks but KDA's chunk terms, the kernel's own (beta's and the gates' rows
  are padded: [B, H, Tp], small). At 202 rows TMA cannot tile them, and they are copied to whole chunks."""
  from lightning_jax.ops.delta_attention import warp_specialized

  b, h, d = 1, 2, 64
  x = jax.ShapeDtypeStruct((b, t, h, d), BF16)
  beta = jax.ShapeDtypeStruct((b, t, h), F32)
  rates = {None: None, "token": jax.ShapeDtypeStruct((b, t, h), F32),
           "channel": jax.ShapeDtypeStruct((b, t, h, d), F32)}
  fallback = lambda q, *_: (q, None)  # noqa: E731  (KDA's range check: not what this test lowers)
  fn = jax.jit(lambda q, k, v, beta, decay: warp_specialized.forward(
      q, k, v, beta, decay, None, None, scale=0.125, with_final_state=False, interpret=False,
      fallback=fallback if decay is not None and decay.ndim == 4 else None)[0])
  text = jax.export.export(fn, platforms=["cuda"])(x, x, x, beta, rates[decay]).mlir_module()
  whole = f"{b}x{-(-t // 64) * 64}x{h}x{d}"
  operand_pads = [line.strip()[:200] for line in text.splitlines() if "stablehlo.pad" in line and f"x{h}x{d}x" in line]
  if t % 8:
    assert whole in text and operand_pads
  else:  # KDA's chunk terms, which its kernel writes, have whole chunks
    assert (t % 64 == 0 or decay == "channel" or whole not in text) and not operand_pads, operand_pads


@needs_ws_jax
@pytest.mark.parametrize("t,decay", [(200, None), (200, "token"), (202, "token")])
def test_delta_warp_specialized_backward_walks_t_unpadded(t, decay):
  """The sm90 backward (its reverse sweep, state sweep and gradient kernel) takes q, k, v and do with T rows where T
  is a multiple of 8 and writes dq, dk and dv with T rows: the gradients' program lowered for CUDA pads none of them
  and holds no [B, Tp, H, D] array of whole chunks. At 202 rows they are copied to whole chunks."""
  from lightning_jax.ops.delta_attention import vjp

  b, h, d = 1, 2, 64
  opts = vjp.PallasOptions(scale=0.125, with_final_state=False, interpret=False,
                           config=dataclasses.replace(DELTA_BLOCKS, warp_specialized=True, sequence_pieces=1))
  x = jax.ShapeDtypeStruct((b, t, h, d), BF16)
  rows = jax.ShapeDtypeStruct((b, t, h), F32)

  def loss(q, k, v, beta, rates):
    return jnp.sum(vjp.delta_attention_pallas(q, k, v, beta, rates, None, None, opts)[0].astype(F32))

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if decay is None else (0, 1, 2, 3, 4)))
  text = jax.export.export(grads, platforms=["cuda"])(x, x, x, rows, None if decay is None else rows).mlir_module()
  assert "delta_tile_gradients_mosaic" in text and "delta_state_cotangents_warp_specialized" in text
  whole = f"{b}x{-(-t // 64) * 64}x{h}x{d}"
  operand_pads = [line.strip()[:200] for line in text.splitlines() if "stablehlo.pad" in line and f"x{h}x{d}x" in line]
  if t % 8:
    assert whole in text and operand_pads
  else:
    assert whole not in text and not operand_pads, operand_pads


@needs_ws_jax
@pytest.mark.parametrize("t", [288, 300])
def test_delta_split_reshapes_the_row_into_pieces(t):
  """The sequence split on the sm90 kernels cuts a row of T = P L tokens, L a multiple of 8 but not of the 64-token
  chunk, into P rows of L by a reshape: the gradients' program lowered for CUDA pads no [.., H, D] operand and runs
  the kernels on [P, L, H, D]. At T = 300 (L = 75) the pieces are padded to whole chunks, as before."""
  from lightning_jax.ops.delta_attention import vjp

  b, h, d, pieces = 1, 2, 64, 4
  opts = vjp.PallasOptions(scale=0.125, with_final_state=True, interpret=False,
                           config=dataclasses.replace(DELTA_BLOCKS, warp_specialized=True, sequence_pieces=pieces))
  x = jax.ShapeDtypeStruct((b, t, h, d), BF16)
  rows = jax.ShapeDtypeStruct((b, t, h), F32)

  def loss(q, k, v, beta, rates):
    o, final = vjp.delta_attention_pallas(q, k, v, beta, rates, None, None, opts)
    return jnp.sum(o.astype(F32)) + jnp.sum(final)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  text = jax.export.export(grads, platforms=["cuda"])(x, x, x, rows, rows).mlir_module()
  assert "delta_tile_gradients_mosaic" in text
  operand_pads = [line.strip()[:200] for line in text.splitlines() if "stablehlo.pad" in line and f"x{h}x{d}x" in line]
  if t % (8 * pieces):
    assert operand_pads and f"{b * pieces}x128x{h}x{d}" in text
  else:
    assert not operand_pads and f"{b * pieces}x{t // pieces}x{h}x{d}" in text, operand_pads


def test_delta_warp_specialized_is_budgeted_and_refuses_what_it_cannot_run():
  # The inverse in the ring and U^T beside each published state: at D = 128, 3 stages with 2 published states
  # (3 and 3 do not fit), at D = 64 4 and 3.
  ws = lj.WarpSpecializedConfig
  assert heuristics.resolve_warp_specialized(None, dim_k=128, itemsize=2, delta=True) == ws(num_stages=3,
                                                                                              published_states=2)
  assert heuristics.resolve_warp_specialized(None, dim_k=64, itemsize=2, delta=True) == ws(num_stages=4)
  # KDA's K_C and P in the ring too: 2 stages at D = 128, 3 at D = 64.
  assert heuristics.resolve_warp_specialized(None, dim_k=128, itemsize=2, delta=True, channel_gated=True) == ws(
      num_stages=2, published_states=2)
  assert heuristics.resolve_warp_specialized(None, dim_k=64, itemsize=2, delta=True, channel_gated=True) == ws(
      num_stages=3)
  q, k, v, beta, _, _, _ = delta_inputs(DeltaCase(b=1, t=40, h=2, d=32, e=32, decay=None), seed=3)
  rates = jnp.full(q.shape, 0.1, F32)  # per key channel: KDA
  forced = dataclasses.replace(DELTA_BLOCKS, warp_specialized=True)
  keep = lj.DeltaConfig(forward_states=True)
  bf16 = (q.astype(BF16), k.astype(BF16), v.astype(BF16), beta)
  for args, config, match in [
      # float32 inputs (or jax < 0.11)
      ((q, k, v, beta), forced, r"warp_specialized=True\): the warp-specialised forward needs"),
      # The states (KDA: the chunk terms) are kept for the warp-specialised backward alone: not interpreted unless
      # forced.
      (bf16, keep, r"forward_states=True\) needs the warp-specialised backward"),
      ((*bf16, rates), keep, r"forward_states=True\) needs the warp-specialised backward"),
  ]:
    with pytest.raises(ValueError, match=match):
      lj.delta_attention(*args, impl="pallas", config=config, interpret=True)
  with pytest.raises(TypeError, match="warp_specialized must be None or a bool"):
    lj.DeltaConfig(warp_specialized=1)
  with pytest.raises(TypeError, match="forward_states must be None or a bool"):
    lj.DeltaConfig(forward_states=1)
  # The forward keeps the states where the backward's sweeps are warp-specialised, unless told not to.
  assert forced.keeps_forward_states(per_channel_gate=False)
  assert not forced.keeps_forward_states(per_channel_gate=True)
  assert not dataclasses.replace(forced, forward_states=False).keeps_forward_states(per_channel_gate=False)
  assert not dataclasses.replace(forced, warp_specialized=False, forward_states=True).keeps_forward_states(
      per_channel_gate=False)
  # KDA's warp-specialised forward keeps its chunk terms, unless told not to.
  assert forced.keeps_chunk_terms(per_channel_gate=True) and not forced.keeps_chunk_terms(per_channel_gate=False)
  assert not lj.DeltaConfig(warp_specialized=True, forward_states=False).keeps_chunk_terms(per_channel_gate=True)
  assert not lj.DeltaConfig(forward_states=True).keeps_chunk_terms(per_channel_gate=True)


@pytest.mark.parametrize("mode", WS_MODES)
def test_delta_forward_states_off_gives_the_same_gradients(mode):
  """forward_states=False (the backward's state sweep recomputes S_n and U) against the forward's kept states, through
  the sequence split (2 pieces, a segment starting inside the second): the same states, so the same gradients, bit
  for bit; and the state sweep (the warp-specialised kernel again) runs only when told to."""
  case = DeltaCase(b=1, t=200, h=1, d=64, e=64, decay="token", segments=True)  # one head: bit for bit, no oracle
  q, k, v, beta, decay, s0, ids = delta_inputs(case, seed=zlib.crc32(f"{case}ws-states".encode()))
  q, k, v = (x.astype(BF16) for x in (q, k, v))
  cot = jax.random.split(jax.random.key(41), 2)
  args = (q, k, v, beta, decay, s0, ids, jax.random.normal(cot[0], v.shape),
          jax.random.normal(cot[1], (case.b, case.h, case.d, case.e)))
  fns = [delta_value_and_grads("pallas", config=lj.DeltaConfig(warp_specialized=True, sequence_pieces=2,
                                                                forward_states=keep),
                               interpret=mode == "interpret") for keep in (None, False)]
  kernel_calls = [str(jax.make_jaxpr(fn)(*args)).count("delta_warp_specialized") for fn in fns]
  assert kernel_calls[0] < kernel_calls[1], kernel_calls
  if mode == "interpret":  # the wiring alone: interpreted, the two backward forms are compared bit for bit by
    return                 # test_delta_backward_takes_what_the_forward_kept (here the split doubles their cost)
  grads = [fn(*args)[1] for fn in fns]
  for name, kept, swept in zip(DELTA_ARG_NAMES, *grads):
    assert (kept is None) == (swept is None), name
    if kept is not None:
      assert jnp.array_equal(kept, swept), name


# Per-sequence states (cu_seqlens): DeltaNet and KDA compiled only (each case runs the whole Triton backward too).
SEQUENCE_STATES_PARAMS = [pytest.param(decay, *mode.values, marks=mode.marks, id=f"{decay}-{mode.id}")
                          for decay, modes in ((None, WS_MODES[1:]), ("token", WS_MODES), ("channel", WS_MODES[1:]))
                          for mode in modes]


@pytest.mark.parametrize("decay,mode", SEQUENCE_STATES_PARAMS)
def test_delta_cu_seqlens_states_warp_specialized(decay, mode):
  """Per-sequence states (cu_seqlens) on the warp-specialised forward: CTAs per sequence over its own chunks of the
  chunk-aligned layout (a traced count: an empty sequence walks none, the last one also the layout's trailing
  chunks), each from its own initial state to its own final state; the backward on the warp-specialised sweeps too
  (KDA's on the Triton ones). Outputs, final states and every gradient against the oracle."""
  check_sequence_states(decay, BF16, "both", lengths=(0, 64, 70, 1, 130, 3), impl="pallas",
                        interpret=mode == "interpret", config=lj.DeltaConfig(warp_specialized=True))


@needs_ws_jax
def test_delta_cu_seqlens_states_warp_specialized_lowers_for_cuda():
  """The per-sequence forward and backward take the warp-specialised sweeps, CTAs per (head, sequence, value block),
  and lower for CUDA from any backend."""
  from lightning_jax.ops.delta_attention import vjp

  t, h, d, e, s = 256, 2, 64, 128, 3
  config = dataclasses.replace(DELTA_BLOCKS, warp_specialized=True, sequence_pieces=1)
  opts = vjp.PallasOptions(scale=0.125, with_final_state=True, config=config, interpret=False)
  spec = jax.ShapeDtypeStruct
  args = (spec((1, t, h, d), BF16), spec((1, t, h, d), BF16), spec((1, t, h, e), BF16), spec((1, t, h), F32),
          spec((1, t, h), F32), spec((s,), jnp.int32), spec((s,), jnp.int32), spec((s, h, d, e), F32))
  exported = jax.export.export(jax.jit(lambda *a: vjp.delta_attention_sequences_pallas(*a, opts)),
                               platforms=["cuda"])(*args)
  text = exported.mlir_module()
  assert "delta_warp_specialized" in text and "delta_attention_sweep" not in text
  assert [o.shape for o in exported.out_avals] == [(1, t, h, e), (s, h, d, e)]

  def loss(q, k, v, beta, rates, first, end, s0):
    o, finals = vjp.delta_attention_sequences_pallas(q, k, v, beta, rates, first, end, s0, opts)
    return jnp.sum(o.astype(F32)) + jnp.sum(finals)

  exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 7))), platforms=["cuda"])(*args)
  text = exported.mlir_module()
  assert "delta_state_cotangents_warp_specialized" in text and "delta_attention_state_cotangents" not in text
  assert exported.out_avals[-1].shape == (s, h, d, e)
