"""Pallas kernels for one Lightning Attention sweep, lowered through Triton.

Every Triton-specific import of the package lives in this file, so that another
Pallas backend can sit beside it.

A sweep computes, for x, y: [B, T, H, K], z: [B, T, H, V] and a = exp(-decay_h),

    out_t = scale * x_t S_t,   S_t = a S_{t-1} + y_t^T z_t     (forward), or
    out_t = scale * x_t G_t,   G_t = a G_{t+1} + y_t^T z_t     (reverse),

with the carried state in float32. Optionally a sweep also computes either the
decay tangent (see `chunk_common`), reduced to per-token row dots
`sum_v out'_t * w_t` in float32 (the decay gradient), or the dual output
`u_t S_t^T + ...` [B, T, H, K] of a fourth input u (dk beside dv, from one
pass). The forward pass is one forward sweep; the backward pass is two or three
(see `vjp`).

Two variants:
  chunk_loop: grid (B*H, V/block_e); each program walks every chunk in order,
    the state tile stays on chip (the Lightning Attention-2 design).
  parallel: a states kernel, grid (B*H, K/block_d, V/block_e), writes the state
    before every chunk (float32, [B, H, N, K, V]); then an output kernel, grid
    (B*H, N, V/block_e), runs all chunks in parallel (the
    flash-linear-attention `chunk` design).

Optional operands and results are None when absent: a kernel receives None
refs for them, and each launcher builds the block specs of what is present
beside the operands (`_present`), so one kernel serves every combination.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention.config import PallasOptions, SweepConfigs

_F32 = jnp.float32


class SweepOperands(NamedTuple):
  """What the kernels of a sweep read; None where absent (a kernel also gets None for what it does not read).

  Shapes for padded inputs (the kernels') and, in `sweep`, unpadded ones:
    decay: [H] float32 rates, or None (no decay).
    x, y: [B, T, H, K]; z: [B, T, H, V].
    dual_with: [B, T, H, V] u of the dual output, or None.
    initial_state: [B, H, K, V] float32, or None (zeros).
    chunk_states, chunk_tangents: [B, H, N, K, V] float32, the state (and its
      decay tangent) before every chunk: the parallel variant's intermediates.
    tangent_with: [B, T, H, V] weights w of the decay tangent's row dots, or
      None (no tangent; needs a decay).
  """
  decay: jax.Array | None = None
  x: jax.Array | None = None
  y: jax.Array | None = None
  z: jax.Array | None = None
  dual_with: jax.Array | None = None
  initial_state: jax.Array | None = None
  chunk_states: jax.Array | None = None
  chunk_tangents: jax.Array | None = None
  tangent_with: jax.Array | None = None


class SweepResults(NamedTuple):
  """What the kernels of a sweep write; None where not asked for.

    out: [B, T, H, V] in the output dtype.
    dual: [B, T, H, K] dual output (with `dual_with`).
    chunk_states, chunk_tangents: the parallel variant's intermediates (see
      `SweepOperands`); None in what `sweep` returns.
    final_state: [B, H, K, V] float32, the state after the last real token of
      the sweep (with `with_final_state`).
    row_dots: [B, H, T] float32 decay-tangent row dots (with `tangent_with`).
    final_tangent: [B, H, K, V] float32 (with `tangent_with` and `with_final_state`).
  """
  out: jax.Array | None = None
  dual: jax.Array | None = None
  chunk_states: jax.Array | None = None
  chunk_tangents: jax.Array | None = None
  final_state: jax.Array | None = None
  row_dots: jax.Array | None = None
  final_tangent: jax.Array | None = None


def _present(values: NamedTuple, **specs) -> NamedTuple:
  """`values`' NamedTuple with each present field replaced by its spec in `specs`, absent ones None."""
  return values._make(None if value is None else specs[name] for name, value in zip(values._fields, values))


def _dot(a, b, *, exact, trans_a=False, trans_b=False):
  # float32 inputs get IEEE float32 products (Triton would otherwise use tf32).
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=False if exact else None)


def _sweep_factors(decay_ref, *, chunk_size, seq_len, reverse):
  """Chunk index -> `ChunkFactors` (None without decay), the exp2 work done once per program."""
  if decay_ref is None:
    return lambda chunk_idx: None
  lam2 = decay_ref[()].astype(_F32) * chunk_common.LOG2_E
  return chunk_common.sweep_decay_factors(lam2, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse)


def _scores(a, b, f, *, reverse, exact):
  """[C, C] a b^T inside the (anti-)causal mask, decayed by the gap."""
  scores = _dot(a, b, trans_b=True, exact=exact)
  if f is None:
    return jnp.where(chunk_common.causal_mask(a.shape[0], reverse=reverse), scores, 0.0)
  return scores * f.intra


def _chunk_out(x, y, z, u, state, tangent, f, *, scale, reverse, exact):
  """One chunk's outputs.

  out = intra (masked, decayed x y^T z) + inter (x S). With `u`, also the dual
  output (u z^T) y + u S^T, the same sweep seen from z's side (dk beside dv).
  With `tangent` (the state's decay tangent U), also out's decay tangent.
  """
  scores = _scores(x, y, f, reverse=reverse, exact=exact)
  # The state is read after the first product, which the chunk loop's
  # outputs-first order needs (see `_chunk_loop_kernel`). Its state-first order
  # and the parallel output kernel cast the state before the call; the cast here
  # is then a no-op.
  state_in = state.astype(x.dtype)
  inter = _dot(x, state_in, exact=exact)
  if f is not None:
    inter = inter * f.row[:, None]
  out = scale * (_dot(scores.astype(z.dtype), z, exact=exact) + inter)
  dual = None
  if u is not None:
    dual_inter = _dot(u, state_in, trans_b=True, exact=exact)
    if f is not None:
      dual_inter = dual_inter * f.row[:, None]
    dual_scores = _scores(u, z, f, reverse=reverse, exact=exact)
    dual = scale * (_dot(dual_scores.astype(y.dtype), y, exact=exact) + dual_inter)
  out_tangent = None
  if tangent is not None:
    out_tangent = scale * (_dot((scores * f.gap).astype(z.dtype), z, exact=exact)
                           + _dot(x, tangent.astype(x.dtype), exact=exact) * f.row[:, None]
                           + f.row_exp[:, None] * inter)
  return out, dual, out_tangent


def _chunk_state(y, z, state, tangent, f, *, exact):
  """State (and decay tangent) after one chunk."""
  if f is None:
    return state + _dot(y, z, trans_a=True, exact=exact), None
  # The key factors scale z's rows, not y's: in the chunk loop z is the narrower
  # tile ([C, block_e] against [C, K]), and y feeds the dot straight from its load.
  z_decayed = z * f.key[:, None]
  new_state = f.state * state + _dot(y, z_decayed.astype(z.dtype), trans_a=True, exact=exact)
  if tangent is None:
    return new_state, None
  new_tangent = (f.state * tangent + (f.end * f.state) * state
                 + _dot(y, (z_decayed * f.key_exp[:, None]).astype(z.dtype), trans_a=True, exact=exact))
  return new_state, new_tangent


def _initial_carry(ins: SweepOperands, *, with_tangent: bool):
  """(state, tangent) before the first chunk: S_0 (or zeros) and, for the decay tangent, zeros."""
  shape = (ins.y.shape[-1], ins.z.shape[-1])
  state = jnp.zeros(shape, _F32) if ins.initial_state is None else ins.initial_state[...]
  return state, (jnp.zeros(shape, _F32) if with_tangent else None)


def _chunk_rows(step, *, num_chunks, chunk_size, reverse):
  """Chunk index of sweep step `step` and the slice of its rows."""
  n = num_chunks - 1 - step if reverse else step
  return n, pl.ds(pl.multiple_of(n * chunk_size, chunk_size), chunk_size)


def _write_final(outs: SweepResults, state, tangent):
  """The final state (and tangent), where the caller asked for them."""
  if outs.final_state is not None:
    outs.final_state[...] = state
  if outs.final_tangent is not None:
    outs.final_tangent[...] = tangent


def _chunk_loop_kernel(ins: SweepOperands, outs: SweepResults, *, scale, chunk_size, seq_len, num_chunks, reverse,
                       exact):
  carry = _initial_carry(ins, with_tangent=ins.tangent_with is not None)
  factors = _sweep_factors(ins.decay, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse)

  def body(step, carry):
    state, tangent = carry
    n, rows = _chunk_rows(step, num_chunks=num_chunks, chunk_size=chunk_size, reverse=reverse)
    x, y, z = ins.x[rows, :], ins.y[rows, :], ins.z[rows, :]
    u = None if ins.dual_with is None else ins.dual_with[rows, :]
    f = factors(n)
    if ins.decay is not None:
      # The outputs first, reading the carried state only after the scores'
      # product, then the state update (PERFORMANCE.md, "Sweep order").
      out, dual, out_tangent = _chunk_out(x, y, z, u, state, tangent, f, scale=scale, reverse=reverse,
                                          exact=exact)
      next_carry = _chunk_state(y, z, state, tangent, f, exact=exact)
    else:
      # The next state first: it needs only this chunk's loads and the carried
      # state, so the next chunk's serial chain starts sooner; the cast right
      # after it (PERFORMANCE.md, "Sweep order").
      next_carry = _chunk_state(y, z, state, tangent, f, exact=exact)
      out, dual, out_tangent = _chunk_out(x, y, z, u, state.astype(x.dtype), tangent, f, scale=scale,
                                          reverse=reverse, exact=exact)
    outs.out[rows, :] = out.astype(outs.out.dtype)
    if outs.dual is not None:
      outs.dual[rows, :] = dual.astype(outs.dual.dtype)
    if outs.row_dots is not None:
      outs.row_dots[rows] = jnp.sum(out_tangent * ins.tangent_with[rows, :].astype(_F32), axis=1)
    return next_carry

  _write_final(outs, *jax.lax.fori_loop(0, num_chunks, body, carry))


def _chunk_states_kernel(ins: SweepOperands, outs: SweepResults, *, chunk_size, seq_len, num_chunks, reverse, exact):
  carry = _initial_carry(ins, with_tangent=outs.chunk_tangents is not None)
  factors = _sweep_factors(ins.decay, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse)

  def body(step, carry):
    state, tangent = carry
    n, rows = _chunk_rows(step, num_chunks=num_chunks, chunk_size=chunk_size, reverse=reverse)
    outs.chunk_states[n, :, :] = state
    if outs.chunk_tangents is not None:
      outs.chunk_tangents[n, :, :] = tangent
    return _chunk_state(ins.y[rows, :], ins.z[rows, :], state, tangent, factors(n), exact=exact)

  _write_final(outs, *jax.lax.fori_loop(0, num_chunks, body, carry))


def _chunk_output_kernel(ins: SweepOperands, outs: SweepResults, *, scale, chunk_size, seq_len, reverse, exact):
  f = _sweep_factors(ins.decay, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse)(pl.program_id(1))
  out, dual, out_tangent = _chunk_out(ins.x[...], ins.y[...], ins.z[...],
                                      None if ins.dual_with is None else ins.dual_with[...],
                                      ins.chunk_states[...].astype(ins.x.dtype),
                                      None if ins.chunk_tangents is None else ins.chunk_tangents[...], f,
                                      scale=scale, reverse=reverse, exact=exact)
  outs.out[...] = out.astype(outs.out.dtype)
  if outs.dual is not None:
    outs.dual[...] = dual.astype(outs.dual.dtype)
  if outs.row_dots is not None:
    outs.row_dots[...] = jnp.sum(out_tangent * ins.tangent_with[...].astype(_F32), axis=1)


def _call(kernel, grid, ins: SweepOperands, in_specs, results: SweepResults, out_specs, cfg, name,
          interpret) -> SweepResults:
  """One pallas_call on the present operands, writing the present results."""
  (outs,) = pl.pallas_call(
      kernel, grid=grid, in_specs=(in_specs,), out_specs=(out_specs,), out_shape=(results,),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret, name=name)(ins)
  return outs


def _output_structs(ins: SweepOperands, *, n_e, with_final_state, out_dtype) -> SweepResults:
  """The shapes of the results a sweep writes (None where not asked for)."""
  b, tp, h, dim_k = ins.x.shape
  dim_v = ins.z.shape[-1]
  state = jax.ShapeDtypeStruct((b, h, dim_k, dim_v), _F32)
  has_tangent = ins.tangent_with is not None
  return SweepResults(
      out=jax.ShapeDtypeStruct((b, tp, h, dim_v), out_dtype),
      # With several value blocks each program writes a float32 partial sum.
      dual=(None if ins.dual_with is None
            else jax.ShapeDtypeStruct((n_e, b, tp, h, dim_k), out_dtype if n_e == 1 else _F32)),
      final_state=state if with_final_state else None,
      row_dots=jax.ShapeDtypeStruct((b, h, n_e, tp), _F32) if has_tangent else None,
      final_tangent=state if has_tangent and with_final_state else None)


def _chunk_loop(ins: SweepOperands, *, scale, seq_len, reverse, with_final_state, configs: SweepConfigs, out_dtype,
                interpret) -> SweepResults:
  b, tp, h, dim_k = ins.x.shape
  dim_v = ins.z.shape[-1]
  cfg = configs.chunk_loop
  c, be = cfg.chunk_size, cfg.block_e
  n_e = dim_v // be

  def rows(width, by_column):
    return pl.BlockSpec((None, tp, None, width), lambda i, e: (i // h, 0, i % h, e if by_column else 0))

  state = pl.BlockSpec((None, None, dim_k, be), lambda i, e: (i // h, i % h, 0, e))
  in_specs = _present(ins, decay=pl.BlockSpec((None,), lambda i, e: (i % h,)), x=rows(dim_k, False),
                      y=rows(dim_k, False), z=rows(be, True), dual_with=rows(be, True), initial_state=state,
                      tangent_with=rows(be, True))
  results = _output_structs(ins, n_e=n_e, with_final_state=with_final_state, out_dtype=out_dtype)
  out_specs = _present(
      results, out=rows(be, True),
      dual=pl.BlockSpec((None, None, tp, None, dim_k), lambda i, e: (e, i // h, 0, i % h, 0)),
      final_state=state, row_dots=pl.BlockSpec((None, None, None, tp), lambda i, e: (i // h, i % h, e, 0)),
      final_tangent=state)
  kernel = functools.partial(_chunk_loop_kernel, scale=scale, chunk_size=c, seq_len=seq_len, num_chunks=tp // c,
                             reverse=reverse, exact=ins.x.dtype == _F32)
  return _call(kernel, (b * h, n_e), ins, in_specs, results, out_specs, cfg, "lightning_chunk_loop", interpret)


def _parallel(ins: SweepOperands, *, scale, seq_len, reverse, with_final_state, configs: SweepConfigs, out_dtype,
              interpret) -> SweepResults:
  b, tp, h, dim_k = ins.x.shape
  dim_v = ins.z.shape[-1]
  exact = ins.x.dtype == _F32
  st, oc = configs.chunk_states, configs.chunk_output
  c = oc.chunk_size
  n = tp // c

  # Pass 1: the state before every chunk (and the final state).
  bd, bes = st.block_d, st.block_e
  state_ins = SweepOperands(decay=ins.decay, y=ins.y, z=ins.z, initial_state=ins.initial_state)
  block_state = pl.BlockSpec((None, None, bd, bes), lambda i, d, e: (i // h, i % h, d, e))
  block_states = pl.BlockSpec((None, None, n, bd, bes), lambda i, d, e: (i // h, i % h, 0, d, e))
  states_struct = jax.ShapeDtypeStruct((b, h, n, dim_k, dim_v), _F32)
  final = _output_structs(ins, n_e=1, with_final_state=with_final_state, out_dtype=out_dtype)
  results = SweepResults(chunk_states=states_struct,
                         chunk_tangents=states_struct if ins.tangent_with is not None else None,
                         final_state=final.final_state, final_tangent=final.final_tangent)
  kernel = functools.partial(_chunk_states_kernel, chunk_size=c, seq_len=seq_len, num_chunks=n, reverse=reverse,
                             exact=exact)
  states = _call(
      kernel, (b * h, dim_k // bd, dim_v // bes), state_ins,
      _present(state_ins, decay=pl.BlockSpec((None,), lambda i, d, e: (i % h,)),
               y=pl.BlockSpec((None, tp, None, bd), lambda i, d, e: (i // h, 0, i % h, d)),
               z=pl.BlockSpec((None, tp, None, bes), lambda i, d, e: (i // h, 0, i % h, e)),
               initial_state=block_state),
      results, _present(results, chunk_states=block_states, chunk_tangents=block_states, final_state=block_state,
                        final_tangent=block_state),
      st, "lightning_chunk_states", interpret)

  # Pass 2: every chunk's outputs in parallel.
  be = oc.block_e
  n_e = dim_v // be

  def chunk(width, by_column):
    return pl.BlockSpec((None, c, None, width), lambda i, j, e: (i // h, j, i % h, e if by_column else 0))

  chunk_state = pl.BlockSpec((None, None, None, dim_k, be), lambda i, j, e: (i // h, i % h, j, 0, e))
  out_ins = ins._replace(initial_state=None, chunk_states=states.chunk_states, chunk_tangents=states.chunk_tangents)
  results = _output_structs(ins, n_e=n_e, with_final_state=False, out_dtype=out_dtype)
  kernel = functools.partial(_chunk_output_kernel, scale=scale, chunk_size=c, seq_len=seq_len, reverse=reverse,
                             exact=exact)
  outs = _call(
      kernel, (b * h, n, n_e), out_ins,
      _present(out_ins, decay=pl.BlockSpec((None,), lambda i, j, e: (i % h,)), x=chunk(dim_k, False),
               y=chunk(dim_k, False), z=chunk(be, True), dual_with=chunk(be, True), chunk_states=chunk_state,
               chunk_tangents=chunk_state, tangent_with=chunk(be, True)),
      results, _present(results, out=chunk(be, True),
                        dual=pl.BlockSpec((None, None, c, None, dim_k), lambda i, j, e: (e, i // h, j, i % h, 0)),
                        row_dots=pl.BlockSpec((None, None, None, c), lambda i, j, e: (i // h, i % h, e, j))),
      oc, "lightning_chunk_output", interpret)
  return outs._replace(final_state=states.final_state, final_tangent=states.final_tangent)


LAUNCHERS = {"chunk_loop": _chunk_loop, "parallel": _parallel}


def sweep(ins: SweepOperands, *, reverse: bool, with_final_state: bool, out_dtype,
          opts: PallasOptions) -> SweepResults:
  """One sweep of `opts.variant` ("chunk_loop" or "parallel") on unpadded operands.

  Pads T to a multiple of the chunk size and the feature dims to powers of two
  >= 16 (`config.padded_dim`), resolves the blocks for this sweep
  (`heuristics.resolve`), runs the launcher and slices the padding off.

  Args:
    ins: `SweepOperands` with x, y, z (and optionally decay, initial_state,
      dual_with, tangent_with; chunk_states and chunk_tangents None).
    reverse: the anti-causal sweep of the backward pass.
    with_final_state: whether to write the final state (and tangent); the
      kernels skip the float32 [B, H, K, V] write(s) nobody reads.
    out_dtype: dtype of `out` and `dual`.

  Returns:
    `SweepResults` with out, and dual, final_state, row_dots, final_tangent
    where asked for (see `SweepOperands`), unpadded.
  """
  if ins.tangent_with is not None and ins.decay is None:
    raise ValueError("the decay tangent needs a decay")
  t, dim_k, dim_v = ins.x.shape[1], ins.x.shape[-1], ins.z.shape[-1]
  kp, vp = config_lib.padded_dim(dim_k), config_lib.padded_dim(dim_v)
  configs = heuristics.resolve(opts.config, dim_k=kp, dim_v=vp, itemsize=ins.x.dtype.itemsize,
                               compute_capability=opts.compute_capability,
                               job=config_lib.sweep_job(tangent=ins.tangent_with is not None,
                                                        dual=ins.dual_with is not None))
  chunk = (configs.chunk_loop if opts.variant == "chunk_loop" else configs.chunk_output).chunk_size
  tp = math.ceil(t / chunk) * chunk
  pad_rows = functools.partial(chunk_common.pad_tokens_and_features, num_tokens=tp)
  padded = ins._replace(x=pad_rows(ins.x, dim=kp), y=pad_rows(ins.y, dim=kp), z=pad_rows(ins.z, dim=vp),
                        dual_with=pad_rows(ins.dual_with, dim=vp), tangent_with=pad_rows(ins.tangent_with, dim=vp),
                        initial_state=chunk_common.pad_state(ins.initial_state, kp, vp))
  res = LAUNCHERS[opts.variant](padded, scale=opts.scale, seq_len=t, reverse=reverse,
                                with_final_state=with_final_state, configs=configs, out_dtype=out_dtype,
                                interpret=opts.interpret)

  def unpad_state(s):
    return None if s is None else s[:, :, :dim_k, :dim_v]

  dual = res.dual
  if dual is not None:  # the value blocks' partial sums
    dual = (dual[0] if dual.shape[0] == 1 else dual.sum(axis=0).astype(out_dtype))[:, :t, :, :dim_k]
  return SweepResults(out=res.out[:, :t, :, :dim_v], dual=dual, final_state=unpad_state(res.final_state),
                      row_dots=None if res.row_dots is None else res.row_dots.sum(axis=2)[:, :, :t],
                      final_tangent=unpad_state(res.final_tangent))
