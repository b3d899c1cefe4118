"""Pallas kernels for one Lightning Attention sweep, lowered through Triton.

Every Triton-specific import of the package lives in this file, so that another
Pallas backend can sit beside it.

A sweep computes, for inputs already padded by the caller (T to a multiple of
the chunk size, feature dims to powers of two >= 16),

    out_t = scale * x_t S_t,   S_t = a S_{t-1} + y_t^T z_t     (forward), or
    out_t = scale * x_t G_t,   G_t = a G_{t+1} + y_t^T z_t     (reverse),

with x, y: [B, T, H, K], z: [B, T, H, V], a = exp(-decay_h), the carried state
in float32, and optionally the per-token row dot `sum_v out_t * w_t` of the
float32 output with a tensor w shaped like `out` (the decay gradient needs
these). The forward pass is one forward sweep; the backward pass is three.

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
  return pl.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=False if exact else None)


def _chunk_factors(decay_ref, chunk_idx, *, chunk_size, seq_len, reverse):
  if decay_ref is None:
    return None
  lam2 = decay_ref[()].astype(_F32) * chunk_common.LOG2_E
  return chunk_common.chunk_decay_factors(lam2, chunk_idx, chunk_size=chunk_size, seq_len=seq_len,
                                          reverse=reverse)


def _chunk_out(x, y, z, state, factors, *, scale, reverse, exact):
  """Output of one chunk: intra-chunk (masked, decayed x y^T z) plus inter-chunk (x S)."""
  scores = _dot(x, y, trans_b=True, exact=exact)  # [C, C]
  if factors is None:
    scores = jnp.where(chunk_common.causal_mask(x.shape[0], reverse=reverse), scores, 0.0)
  else:
    scores = scores * factors[3]
  out = _dot(scores.astype(z.dtype), z, exact=exact)
  inter = _dot(x, state.astype(x.dtype), exact=exact)
  if factors is not None:
    inter = inter * factors[0][:, None]
  return scale * (out + inter)


def _chunk_state(y, z, state, factors, *, exact):
  """State after one chunk: decayed state plus decayed y^T z."""
  if factors is not None:
    y = (y * factors[1][:, None]).astype(y.dtype)
    state = factors[2] * state
  return state + _dot(y, z, trans_a=True, exact=exact)


def _unpack(refs, flags):
  """Splits `refs` by the static presence flags; absent refs are None."""
  it = iter(refs)
  return [next(it) if present else None for present in flags]


def _chunk_loop_kernel(*refs, scale, chunk_size, seq_len, num_chunks, reverse, has_decay,
                       has_initial_state, has_row_dot, exact):
  (decay_ref, x_ref, y_ref, z_ref, s0_ref, w_ref, out_ref, state_ref, row_dot_ref) = _unpack(
      refs, (has_decay, True, True, True, has_initial_state, has_row_dot, True, True, has_row_dot))
  state_shape = (x_ref.shape[-1], z_ref.shape[-1])
  state = s0_ref[...] if has_initial_state else jnp.zeros(state_shape, _F32)

  def body(step, state):
    n = num_chunks - 1 - step if reverse else step
    rows = pl.ds(pl.multiple_of(n * chunk_size, chunk_size), chunk_size)
    x, y, z = x_ref[rows, :], y_ref[rows, :], z_ref[rows, :]
    factors = _chunk_factors(decay_ref, n, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse)
    out = _chunk_out(x, y, z, state, factors, scale=scale, reverse=reverse, exact=exact)
    out_ref[rows, :] = out.astype(out_ref.dtype)
    if has_row_dot:
      row_dot_ref[rows] = jnp.sum(out * w_ref[rows, :].astype(_F32), axis=1)
    return _chunk_state(y, z, state, factors, exact=exact)

  state_ref[...] = jax.lax.fori_loop(0, num_chunks, body, state)


def _chunk_states_kernel(*refs, chunk_size, seq_len, num_chunks, reverse, has_decay, has_initial_state,
                         exact):
  decay_ref, y_ref, z_ref, s0_ref, states_ref, state_ref = _unpack(
      refs, (has_decay, True, True, has_initial_state, True, True))
  state_shape = (y_ref.shape[-1], z_ref.shape[-1])
  state = s0_ref[...] if has_initial_state else jnp.zeros(state_shape, _F32)

  def body(step, state):
    n = num_chunks - 1 - step if reverse else step
    rows = pl.ds(pl.multiple_of(n * chunk_size, chunk_size), chunk_size)
    states_ref[n, :, :] = state
    factors = _chunk_factors(decay_ref, n, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse)
    return _chunk_state(y_ref[rows, :], z_ref[rows, :], state, factors, exact=exact)

  state_ref[...] = jax.lax.fori_loop(0, num_chunks, body, state)


def _chunk_output_kernel(*refs, scale, chunk_size, seq_len, reverse, has_decay, has_row_dot, exact):
  decay_ref, x_ref, y_ref, z_ref, states_ref, w_ref, out_ref, row_dot_ref = _unpack(
      refs, (has_decay, True, True, True, True, has_row_dot, True, has_row_dot))
  factors = _chunk_factors(decay_ref, pl.program_id(1), chunk_size=chunk_size, seq_len=seq_len,
                           reverse=reverse)
  out = _chunk_out(x_ref[...], y_ref[...], z_ref[...], states_ref[...], factors, scale=scale,
                   reverse=reverse, exact=exact)
  out_ref[...] = out.astype(out_ref.dtype)
  if has_row_dot:
    row_dot_ref[...] = jnp.sum(out * w_ref[...].astype(_F32), axis=1)


def sweep(x, y, z, decay, initial_state, row_dot_with, *, scale: float, seq_len: int, reverse: bool,
          variant: str, configs: SweepConfigs, out_dtype, interpret: bool):
  """One sweep over padded inputs.

  Args:
    x, y: [B, Tp, H, K]; z: [B, Tp, H, V]; Tp a multiple of the chunk size,
      K and V powers of two >= 16 (see `config.padded_dim`).
    decay: [H] float32 rates or None. initial_state: [B, H, K, V] float32 or None.
    row_dot_with: [B, Tp, H, V] or None.
    seq_len: the number of real tokens (<= Tp).

  Returns:
    out [B, Tp, H, V] (out_dtype), final state [B, H, K, V] float32 (the state
    after the last real token of the sweep), and row dots [B, H, Tp] float32
    (None without `row_dot_with`).
  """
  b, tp, h, dim_k = x.shape
  dim_v = z.shape[-1]
  exact = x.dtype == jnp.float32
  has_decay, has_s0, has_w = decay is not None, initial_state is not None, row_dot_with is not None
  flags = dict(reverse=reverse, has_decay=has_decay, exact=exact)

  def keep(*pairs):
    return [item for item, present in pairs if present]

  if variant == "chunk_loop":
    cfg = configs.chunk_loop
    c, be = cfg.chunk_size, cfg.block_e
    n_e = dim_v // be
    grid = (b * h, n_e)
    seq = lambda width, col=False: pl.BlockSpec(  # noqa: E731
        (None, tp, None, width), (lambda i, e: (i // h, 0, i % h, e)) if col else (lambda i, e: (i // h, 0, i % h, 0)))
    in_specs = keep((pl.BlockSpec((None,), lambda i, e: (i % h,)), has_decay),
                    (seq(dim_k), True), (seq(dim_k), True), (seq(be, True), True),
                    (pl.BlockSpec((None, None, dim_k, be), lambda i, e: (i // h, i % h, 0, e)), has_s0),
                    (seq(be, True), has_w))
    out_specs = keep((seq(be, True), True),
                     (pl.BlockSpec((None, None, dim_k, be), lambda i, e: (i // h, i % h, 0, e)), True),
                     (pl.BlockSpec((None, None, None, tp), lambda i, e: (i // h, i % h, e, 0)), has_w))
    out_shape = keep((jax.ShapeDtypeStruct((b, tp, h, dim_v), out_dtype), True),
                     (jax.ShapeDtypeStruct((b, h, dim_k, dim_v), _F32), True),
                     (jax.ShapeDtypeStruct((b, h, n_e, tp), _F32), has_w))
    kernel = functools.partial(_chunk_loop_kernel, scale=scale, chunk_size=c, seq_len=seq_len,
                               num_chunks=tp // c, has_initial_state=has_s0, has_row_dot=has_w, **flags)
    results = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret, name="lightning_chunk_loop",
    )(*keep((decay, has_decay), (x, True), (y, True), (z, True), (initial_state, has_s0),
            (row_dot_with, has_w)))
  elif variant == "parallel":
    st, oc = configs.chunk_states, configs.chunk_output
    c = oc.chunk_size
    n = tp // c
    bd, bes = st.block_d, st.block_e
    grid = (b * h, dim_k // bd, dim_v // bes)
    in_specs = keep((pl.BlockSpec((None,), lambda i, d, e: (i % h,)), has_decay),
                    (pl.BlockSpec((None, tp, None, bd), lambda i, d, e: (i // h, 0, i % h, d)), True),
                    (pl.BlockSpec((None, tp, None, bes), lambda i, d, e: (i // h, 0, i % h, e)), True),
                    (pl.BlockSpec((None, None, bd, bes), lambda i, d, e: (i // h, i % h, d, e)), has_s0))
    out_specs = [pl.BlockSpec((None, None, n, bd, bes), lambda i, d, e: (i // h, i % h, 0, d, e)),
                 pl.BlockSpec((None, None, bd, bes), lambda i, d, e: (i // h, i % h, d, e))]
    out_shape = [jax.ShapeDtypeStruct((b, h, n, dim_k, dim_v), _F32),
                 jax.ShapeDtypeStruct((b, h, dim_k, dim_v), _F32)]
    kernel = functools.partial(_chunk_states_kernel, chunk_size=c, seq_len=seq_len, num_chunks=n,
                               has_initial_state=has_s0, **flags)
    states, final_state = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=st.num_warps, num_stages=st.num_stages),
        interpret=interpret, name="lightning_chunk_states",
    )(*keep((decay, has_decay), (y, True), (z, True), (initial_state, has_s0)))

    be = oc.block_e
    n_e = dim_v // be
    grid = (b * h, n, n_e)
    chunk = lambda width, col=False: pl.BlockSpec(  # noqa: E731
        (None, c, None, width),
        (lambda i, j, e: (i // h, j, i % h, e)) if col else (lambda i, j, e: (i // h, j, i % h, 0)))
    in_specs = keep((pl.BlockSpec((None,), lambda i, j, e: (i % h,)), has_decay),
                    (chunk(dim_k), True), (chunk(dim_k), True), (chunk(be, True), True),
                    (pl.BlockSpec((None, None, None, dim_k, be), lambda i, j, e: (i // h, i % h, j, 0, e)), True),
                    (chunk(be, True), has_w))
    out_specs = keep((chunk(be, True), True),
                     (pl.BlockSpec((None, None, None, c), lambda i, j, e: (i // h, i % h, e, j)), has_w))
    out_shape = keep((jax.ShapeDtypeStruct((b, tp, h, dim_v), out_dtype), True),
                     (jax.ShapeDtypeStruct((b, h, n_e, tp), _F32), has_w))
    kernel = functools.partial(_chunk_output_kernel, scale=scale, chunk_size=c, seq_len=seq_len,
                               has_row_dot=has_w, **flags)
    outputs = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=oc.num_warps, num_stages=oc.num_stages),
        interpret=interpret, name="lightning_chunk_output",
    )(*keep((decay, has_decay), (x, True), (y, True), (z, True), (states, True), (row_dot_with, has_w)))
    results = (outputs[0], final_state, *outputs[1:])
  else:
    raise ValueError(f"unknown variant {variant!r}")

  out, final_state = results[0], results[1]
  row_dots = results[2].sum(axis=2) if has_w else None
  return out, final_state, row_dots
