"""Pallas kernels for one Lightning Attention sweep, lowered through Triton.

Every Triton-specific import of the package lives in this file, so that another
Pallas backend can sit beside it.

A sweep computes, for inputs already padded by the caller (T to a multiple of
the chunk size, feature dims to powers of two >= 16),

    out_t = scale * x_t S_t,   S_t = a S_{t-1} + y_t^T z_t     (forward), or
    out_t = scale * x_t G_t,   G_t = a G_{t+1} + y_t^T z_t     (reverse),

with x, y: [B, T, H, K], z: [B, T, H, V], a = exp(-decay_h), the carried state
in float32. Optionally a sweep also computes either the decay tangent (see
`chunk_common`), reduced to per-token row dots `sum_v out'_t * w_t` in float32
(the decay gradient), or the dual output `u_t S_t^T + ...` [B, T, H, K] of a
fourth input u (dk beside dv, from one pass). The forward pass is one forward
sweep; the backward pass is two or three (see `pallas_vjp`).

Two variants:
  chunk_loop: grid (B*H, V/block_e); each program walks every chunk in order,
    the state tile stays on chip (the Lightning Attention-2 design).
  parallel: a states kernel, grid (B*H, K/block_d, V/block_e), writes the state
    before every chunk (float32, [B, H, N, K, V]); then an output kernel, grid
    (B*H, N, V/block_e), runs all chunks in parallel (the
    flash-linear-attention `chunk` design).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention.config import SweepConfigs

_F32 = jnp.float32


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
  # and the parallel output kernel cast the state before the call, where this
  # function always cast it; the cast here is then a no-op.
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


def _unpack(refs, flags):
  """Splits `refs` by the static presence flags; absent refs are None."""
  it = iter(refs)
  return [next(it) if present else None for present in flags]


def _initial_carry(s0_ref, shape, has_tangent):
  """(state, tangent) before the first chunk: S_0 (or zeros) and, for the decay tangent, zeros."""
  state = jnp.zeros(shape, _F32) if s0_ref is None else s0_ref[...]
  return state, (jnp.zeros(shape, _F32) if has_tangent else None)


def _chunk_rows(step, *, num_chunks, chunk_size, reverse):
  """Chunk index of sweep step `step` and the slice of its rows."""
  n = num_chunks - 1 - step if reverse else step
  return n, pl.ds(pl.multiple_of(n * chunk_size, chunk_size), chunk_size)


def _chunk_loop_kernel(*refs, scale, chunk_size, seq_len, num_chunks, reverse, has_decay,
                       has_initial_state, has_tangent, has_dual, has_final, exact):
  (decay_ref, x_ref, y_ref, z_ref, u_ref, s0_ref, w_ref, out_ref, dual_ref, state_ref, row_dot_ref,
   tangent_ref) = _unpack(refs, (has_decay, True, True, True, has_dual, has_initial_state, has_tangent, True,
                                 has_dual, has_final, has_tangent, has_tangent and has_final))
  carry = _initial_carry(s0_ref, (x_ref.shape[-1], z_ref.shape[-1]), has_tangent)
  factors = _sweep_factors(decay_ref, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse)

  def body(step, carry):
    state, tangent = carry
    n, rows = _chunk_rows(step, num_chunks=num_chunks, chunk_size=chunk_size, reverse=reverse)
    x, y, z = x_ref[rows, :], y_ref[rows, :], z_ref[rows, :]
    u = u_ref[rows, :] if has_dual else None
    f = factors(n)
    if has_decay:
      # The outputs first, reading the carried state only after the scores'
      # product, then the state update: on the H100 up to 3% faster than the
      # order below at D128 and with the decay gradient, within 0.4% elsewhere
      # (benchmarks/PERFORMANCE.md, item 19).
      out, dual, out_tangent = _chunk_out(x, y, z, u, state, tangent, f, scale=scale, reverse=reverse,
                                          exact=exact)
      next_carry = _chunk_state(y, z, state, tangent, f, exact=exact)
    else:
      # The next state first: it needs only this chunk's loads and the carried
      # state, so the next chunk's serial chain starts sooner (3-17% on the D128
      # forward, item 8). The cast right after it: cast after the scores'
      # product, this order ran 23% slower at D128 (item 19).
      next_carry = _chunk_state(y, z, state, tangent, f, exact=exact)
      out, dual, out_tangent = _chunk_out(x, y, z, u, state.astype(x.dtype), tangent, f, scale=scale,
                                          reverse=reverse, exact=exact)
    out_ref[rows, :] = out.astype(out_ref.dtype)
    if has_dual:
      dual_ref[rows, :] = dual.astype(dual_ref.dtype)
    if has_tangent:
      row_dot_ref[rows] = jnp.sum(out_tangent * w_ref[rows, :].astype(_F32), axis=1)
    return next_carry

  state, tangent = jax.lax.fori_loop(0, num_chunks, body, carry)
  _write_final(state_ref, tangent_ref, state, tangent)


def _write_final(state_ref, tangent_ref, state, tangent):
  """The final state (and tangent), where the caller asked for them."""
  if state_ref is not None:
    state_ref[...] = state
  if tangent_ref is not None:
    tangent_ref[...] = tangent


def _chunk_states_kernel(*refs, chunk_size, seq_len, num_chunks, reverse, has_decay, has_initial_state,
                         has_tangent, has_final, exact):
  decay_ref, y_ref, z_ref, s0_ref, states_ref, tangents_ref, state_ref, tangent_ref = _unpack(
      refs, (has_decay, True, True, has_initial_state, True, has_tangent, has_final, has_tangent and has_final))
  carry = _initial_carry(s0_ref, (y_ref.shape[-1], z_ref.shape[-1]), has_tangent)
  factors = _sweep_factors(decay_ref, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse)

  def body(step, carry):
    state, tangent = carry
    n, rows = _chunk_rows(step, num_chunks=num_chunks, chunk_size=chunk_size, reverse=reverse)
    states_ref[n, :, :] = state
    if has_tangent:
      tangents_ref[n, :, :] = tangent
    return _chunk_state(y_ref[rows, :], z_ref[rows, :], state, tangent, factors(n), exact=exact)

  state, tangent = jax.lax.fori_loop(0, num_chunks, body, carry)
  _write_final(state_ref, tangent_ref, state, tangent)


def _chunk_output_kernel(*refs, scale, chunk_size, seq_len, reverse, has_decay, has_tangent, has_dual, exact):
  decay_ref, x_ref, y_ref, z_ref, u_ref, states_ref, tangents_ref, w_ref, out_ref, dual_ref, row_dot_ref = _unpack(
      refs, (has_decay, True, True, True, has_dual, True, has_tangent, has_tangent, True, has_dual, has_tangent))
  f = _sweep_factors(decay_ref, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse)(pl.program_id(1))
  out, dual, out_tangent = _chunk_out(x_ref[...], y_ref[...], z_ref[...], u_ref[...] if has_dual else None,
                                      states_ref[...].astype(x_ref.dtype),
                                      tangents_ref[...] if has_tangent else None, f,
                                      scale=scale, reverse=reverse, exact=exact)
  out_ref[...] = out.astype(out_ref.dtype)
  if has_dual:
    dual_ref[...] = dual.astype(dual_ref.dtype)
  if has_tangent:
    row_dot_ref[...] = jnp.sum(out_tangent * w_ref[...].astype(_F32), axis=1)


def sweep(x, y, z, decay, initial_state, tangent_with, dual_with, *, scale: float, seq_len: int, reverse: bool,
          with_final_state: bool, variant: str, configs: SweepConfigs, out_dtype, interpret: bool):
  """One sweep over padded inputs.

  Args:
    x, y: [B, Tp, H, K]; z: [B, Tp, H, V]; Tp a multiple of the chunk size,
      K and V powers of two >= 16 (see `config.padded_dim`).
    decay: [H] float32 rates or None. initial_state: [B, H, K, V] float32 or None.
    tangent_with: [B, Tp, H, V] or None (needs decay): also compute the decay
      tangent, as row dots sum_v out'_t * w_t and the final tangent state.
    dual_with: [B, Tp, H, V] (u) or None: also compute the dual output
      dual_t = scale * (sum_s m_ts (u_t . z_s) y_s + u_t S_t^T), [B, Tp, H, K].
    seq_len: the number of real tokens (<= Tp).
    with_final_state: whether to write the final state (and tangent); the
      kernels skip the float32 [B, H, K, V] write(s) nobody reads.

  Returns:
    out [B, Tp, H, V] (out_dtype); the dual output [B, Tp, H, K] (out_dtype) or
    None; with `with_final_state`, the final state [B, H, K, V] float32 (the
    state after the last real token of the sweep), else None; with
    `tangent_with`, row dots [B, H, Tp] float32 and, with `with_final_state`
    too, the final tangent state [B, H, K, V] float32 (else None).
  """
  b, tp, h, dim_k = x.shape
  dim_v = z.shape[-1]
  has_decay, has_s0 = decay is not None, initial_state is not None
  has_tangent, has_dual = tangent_with is not None, dual_with is not None
  if has_tangent and not has_decay:
    raise ValueError("the decay tangent needs a decay")
  flags = dict(reverse=reverse, has_decay=has_decay, has_tangent=has_tangent, has_dual=has_dual,
               exact=x.dtype == _F32)
  final_tangent_too = has_tangent and with_final_state
  state_struct = jax.ShapeDtypeStruct((b, h, dim_k, dim_v), _F32)

  def keep(*pairs):
    return [item for item, present in pairs if present]

  def dual_struct(n_e):
    # With several value blocks each program writes a float32 partial sum.
    return jax.ShapeDtypeStruct((n_e, b, tp, h, dim_k), out_dtype if n_e == 1 else _F32)

  def call(kernel, grid, in_specs, out_specs, out_shape, cfg, name, *args):
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret, name=name)(*args)

  if variant == "chunk_loop":
    cfg = configs.chunk_loop
    c, be = cfg.chunk_size, cfg.block_e
    n_e = dim_v // be

    def seq(width, by_column):
      return pl.BlockSpec((None, tp, None, width),
                          lambda i, e: (i // h, 0, i % h, e if by_column else 0))

    state_spec = pl.BlockSpec((None, None, dim_k, be), lambda i, e: (i // h, i % h, 0, e))
    in_specs = keep((pl.BlockSpec((None,), lambda i, e: (i % h,)), has_decay),
                    (seq(dim_k, False), True), (seq(dim_k, False), True), (seq(be, True), True),
                    (seq(be, True), has_dual), (state_spec, has_s0), (seq(be, True), has_tangent))
    out_specs = keep((seq(be, True), True),
                     (pl.BlockSpec((None, None, tp, None, dim_k), lambda i, e: (e, i // h, 0, i % h, 0)), has_dual),
                     (state_spec, with_final_state),
                     (pl.BlockSpec((None, None, None, tp), lambda i, e: (i // h, i % h, e, 0)), has_tangent),
                     (state_spec, final_tangent_too))
    out_shape = keep((jax.ShapeDtypeStruct((b, tp, h, dim_v), out_dtype), True), (dual_struct(n_e), has_dual),
                     (state_struct, with_final_state), (jax.ShapeDtypeStruct((b, h, n_e, tp), _F32), has_tangent),
                     (state_struct, final_tangent_too))
    kernel = functools.partial(_chunk_loop_kernel, scale=scale, chunk_size=c, seq_len=seq_len,
                               num_chunks=tp // c, has_initial_state=has_s0, has_final=with_final_state, **flags)
    results = iter(call(kernel, (b * h, n_e), in_specs, out_specs, out_shape, cfg, "lightning_chunk_loop",
                        *keep((decay, has_decay), (x, True), (y, True), (z, True), (dual_with, has_dual),
                              (initial_state, has_s0), (tangent_with, has_tangent))))
    out = next(results)
    dual = next(results) if has_dual else None
    final = next(results) if with_final_state else None
    row_dots = next(results) if has_tangent else None
    final_tangent = next(results) if final_tangent_too else None
  elif variant == "parallel":
    st, oc = configs.chunk_states, configs.chunk_output
    c = oc.chunk_size
    n = tp // c
    bd, bes = st.block_d, st.block_e
    block_state = pl.BlockSpec((None, None, bd, bes), lambda i, d, e: (i // h, i % h, d, e))
    block_states = pl.BlockSpec((None, None, n, bd, bes), lambda i, d, e: (i // h, i % h, 0, d, e))
    states_struct = jax.ShapeDtypeStruct((b, h, n, dim_k, dim_v), _F32)
    in_specs = keep((pl.BlockSpec((None,), lambda i, d, e: (i % h,)), has_decay),
                    (pl.BlockSpec((None, tp, None, bd), lambda i, d, e: (i // h, 0, i % h, d)), True),
                    (pl.BlockSpec((None, tp, None, bes), lambda i, d, e: (i // h, 0, i % h, e)), True),
                    (block_state, has_s0))
    out_specs = keep((block_states, True), (block_states, has_tangent), (block_state, with_final_state),
                     (block_state, final_tangent_too))
    out_shape = keep((states_struct, True), (states_struct, has_tangent), (state_struct, with_final_state),
                     (state_struct, final_tangent_too))
    kernel = functools.partial(_chunk_states_kernel, chunk_size=c, seq_len=seq_len, num_chunks=n,
                               has_initial_state=has_s0, reverse=reverse, has_decay=has_decay,
                               has_tangent=has_tangent, has_final=with_final_state, exact=flags["exact"])
    results = iter(call(kernel, (b * h, dim_k // bd, dim_v // bes), in_specs, out_specs, out_shape, st,
                        "lightning_chunk_states",
                        *keep((decay, has_decay), (y, True), (z, True), (initial_state, has_s0))))
    states = next(results)
    tangents = next(results) if has_tangent else None
    final = next(results) if with_final_state else None
    final_tangent = next(results) if final_tangent_too else None

    be = oc.block_e
    n_e = dim_v // be

    def chunk(width, by_column):
      return pl.BlockSpec((None, c, None, width),
                          lambda i, j, e: (i // h, j, i % h, e if by_column else 0))

    chunk_state = pl.BlockSpec((None, None, None, dim_k, be), lambda i, j, e: (i // h, i % h, j, 0, e))
    in_specs = keep((pl.BlockSpec((None,), lambda i, j, e: (i % h,)), has_decay),
                    (chunk(dim_k, False), True), (chunk(dim_k, False), True), (chunk(be, True), True),
                    (chunk(be, True), has_dual), (chunk_state, True), (chunk_state, has_tangent),
                    (chunk(be, True), has_tangent))
    out_specs = keep((chunk(be, True), True),
                     (pl.BlockSpec((None, None, c, None, dim_k), lambda i, j, e: (e, i // h, j, i % h, 0)), has_dual),
                     (pl.BlockSpec((None, None, None, c), lambda i, j, e: (i // h, i % h, e, j)), has_tangent))
    out_shape = keep((jax.ShapeDtypeStruct((b, tp, h, dim_v), out_dtype), True), (dual_struct(n_e), has_dual),
                     (jax.ShapeDtypeStruct((b, h, n_e, tp), _F32), has_tangent))
    kernel = functools.partial(_chunk_output_kernel, scale=scale, chunk_size=c, seq_len=seq_len, **flags)
    results = iter(call(kernel, (b * h, n, n_e), in_specs, out_specs, out_shape, oc, "lightning_chunk_output",
                        *keep((decay, has_decay), (x, True), (y, True), (z, True), (dual_with, has_dual),
                              (states, True), (tangents, has_tangent), (tangent_with, has_tangent))))
    out = next(results)
    dual = next(results) if has_dual else None
    row_dots = next(results) if has_tangent else None
  else:
    raise ValueError(f"unknown variant {variant!r}")

  if dual is not None:
    dual = dual[0] if dual.shape[0] == 1 else dual.sum(axis=0).astype(out_dtype)
  if row_dots is not None:
    row_dots = row_dots.sum(axis=2)  # partial sums of the value blocks
  return out, dual, final, row_dots, final_tangent
