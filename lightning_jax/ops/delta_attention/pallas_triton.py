"""Pallas Triton kernels of the delta attention forward: the chunk algebra of `chunk`, in two passes.

  prepare, grid (B, H, N), every chunk in parallel: the gated pair products A
    and P in 16-row blocks, T = (I + A)^{-1} block by block (each diagonal
    block by the product (I - X)(I + X^2)(I + X^4)(I + X^8), X = -A_ii, then
    forward substitution between blocks, all in float32), and
    W = T beta K_g, U_v = T beta V. Writes W [B, T, H, D], U_v [B, T, H, E]
    (the input dtype) and, with per-key-channel gates, P [B, H, T, C]
    (float32, scale included).
  sweep, grid (B, H, E / block_e), the chunks in order with the state tile
    [D, block_e] on chip: U = U_v - W S, O = scale Q_g S + P U,
    S <- Diag(e^{g_C}) S + K_C^T U. With a scalar gate (or none) it forms P
    itself: one [C, D] x [D, C] product, cheaper than a float32 round trip.

The gates arrive as chunk-local cumulative log decays g (`chunk.chunk_gates`):
[B, H, T] for a scalar per token, [B, H, T, D] per key channel (KDA), with
the segment-start counts `runs` [B, T] for packed sequences. KDA's pair
products factor through the row before each 16-row block (both factors <= 1);
within a block they are taken column by column.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lightning_jax.ops import triton_lowering
from lightning_jax.ops.delta_attention import chunk
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import config as lightning_config
from lightning_jax.ops.lightning_attention import manual_axes

_F32 = jnp.float32
BLOCK = chunk.SUB_CHUNK


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeltaConfig:
  """Blocks of the delta attention kernels.

  Attributes:
    chunk_size: tokens per chunk (a multiple of 16). 32 was 1.2-1.6x faster
      than 64 for all three forms on an H200 (B2 H32 T8K D128, bf16): the
      prepare kernel's serial chain of 16-row blocks halves.
    block_e: value columns per sweep program (a power of two >= 16; clipped to E).
    num_warps, num_stages: Triton's, for both kernels.
  """
  chunk_size: int = 32
  block_e: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if self.chunk_size < BLOCK or self.chunk_size % BLOCK:
      raise ValueError(f"chunk_size must be a positive multiple of {BLOCK}, got {self.chunk_size}")
    if self.block_e < lightning_config.MIN_BLOCK or self.block_e & (self.block_e - 1):
      raise ValueError(f"block_e must be a power of two >= {lightning_config.MIN_BLOCK}, got {self.block_e}")


def _rows(start, size):
  return pl.ds(start, size)


def _gate_rows(g_ref, start, size):
  """g of rows [start, start + size): [size, 1] for a scalar gate per token, [size, D] per key channel."""
  if g_ref is None:
    return jnp.zeros((size, 1), _F32)
  if len(g_ref.shape) == 1:
    return g_ref[_rows(start, size)][:, None]
  return g_ref[_rows(start, size), :]


def _pair_block(x_i, y_ref, g_ref, runs_ref, *, i, j, inclusive, exact):
  """Block (i, j), j <= i, of sum_d x_td y_sd e^{g_td - g_sd} over the chunk's 16-row blocks, masked: [16, 16] f32.

  x_i: [16, D] rows of block i; y_ref: the chunk's [C, D] ref; `inclusive`
  keeps s == t. Pairs of different segments are 0.
  """
  t = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
  s = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
  allowed = ((t >= s) if inclusive else (t > s)) if i == j else jnp.full((BLOCK, BLOCK), True)
  if runs_ref is not None:
    allowed &= runs_ref[_rows(i * BLOCK, BLOCK)][:, None] == runs_ref[_rows(j * BLOCK, BLOCK)][None, :]
  y_j = y_ref[_rows(j * BLOCK, BLOCK), :]
  if g_ref is None:
    return jnp.where(allowed, triton_lowering.dot(x_i, y_j, trans_b=True, exact=exact), 0.0)
  g_i = _gate_rows(g_ref, i * BLOCK, BLOCK)
  if len(g_ref.shape) == 1:  # a scalar gate: one factor per pair
    g_j = g_ref[_rows(j * BLOCK, BLOCK)][None, :]
    gap = jnp.where(allowed, g_i - g_j, 0.0)
    return jnp.where(allowed, triton_lowering.dot(x_i, y_j, trans_b=True, exact=exact) * jnp.exp(gap), 0.0)
  if i > j:  # per key channel, through r = the row before block i: both factors <= 1
    g_r = _gate_rows(g_ref, i * BLOCK - 1, 1)
    x_hat = (x_i.astype(_F32) * jnp.exp(g_i - g_r)).astype(x_i.dtype)
    y_hat = (y_j.astype(_F32) * jnp.exp(g_r - _gate_rows(g_ref, j * BLOCK, BLOCK))).astype(y_j.dtype)
    return jnp.where(allowed, triton_lowering.dot(x_hat, y_hat, trans_b=True, exact=exact), 0.0)
  x_f32 = x_i.astype(_F32)
  row = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, 1), 0)

  def column(c, acc):  # the pairs (t, j * 16 + c) for every row t of the block
    y_c = y_ref[_rows(j * BLOCK + c, 1), :].astype(_F32)
    gap = jnp.where(row >= c, g_i - _gate_rows(g_ref, j * BLOCK + c, 1), 0.0)
    return jnp.where(s == c, jnp.sum(x_f32 * y_c * jnp.exp(gap), axis=1, keepdims=True), acc)

  return jnp.where(allowed, jax.lax.fori_loop(0, BLOCK, column, jnp.zeros((BLOCK, BLOCK), _F32)), 0.0)


def _unit_lower_inverse(a):
  """(I + a)^{-1} for a strictly lower [16, 16] float32 a: sum_n (-a)^n as (I + X)(I + X^2)(I + X^4)(I + X^8)."""
  eye = jnp.where(jax.lax.broadcasted_iota(jnp.int32, a.shape, 0) == jax.lax.broadcasted_iota(jnp.int32, a.shape, 1),
                  1.0, 0.0)
  power = -a
  inverse = eye + power
  for _ in range(int(math.log2(BLOCK)) - 1):
    power = triton_lowering.dot(power, power, exact=True)
    inverse = inverse + triton_lowering.dot(inverse, power, exact=True)
  return inverse


def _prepare_kernel(q_ref, k_ref, v_ref, beta_ref, g_ref, runs_ref, w_ref, u_ref, p_ref, *, scale, exact):
  c = k_ref.shape[0]
  nb = c // BLOCK
  dtype = k_ref.dtype
  tri = {}  # (i, j) -> block of T = (I + A)^{-1}
  a = {}
  for i in range(nb):
    k_i = k_ref[_rows(i * BLOCK, BLOCK), :]
    beta_i = beta_ref[_rows(i * BLOCK, BLOCK)][:, None]
    for j in range(i + 1):
      a[i, j] = beta_i * _pair_block(k_i, k_ref, g_ref, runs_ref, i=i, j=j, inclusive=False, exact=exact)
    tri[i, i] = _unit_lower_inverse(a[i, i])
    for j in range(i - 1, -1, -1):  # forward substitution: (I + A_ii) T_ij = -sum_{j <= m < i} A_im T_mj
      acc = sum(triton_lowering.dot(a[i, m], tri[m, j], exact=True) for m in range(j, i))
      tri[i, j] = -triton_lowering.dot(tri[i, i], acc, exact=True)
  for i in range(nb):
    rows = _rows(i * BLOCK, BLOCK)
    w_i = u_i = 0.0
    for j in range(i + 1):
      rows_j = _rows(j * BLOCK, BLOCK)
      beta_j = beta_ref[rows_j][:, None]
      sees_state = 1.0 if runs_ref is None else (runs_ref[rows_j] == 0)[:, None]
      k_gated = k_ref[rows_j, :].astype(_F32) * (jnp.exp(_gate_rows(g_ref, j * BLOCK, BLOCK)) * sees_state * beta_j)
      v_beta = v_ref[rows_j, :].astype(_F32) * beta_j
      t_ij = tri[i, j].astype(dtype)
      w_i = w_i + triton_lowering.dot(t_ij, k_gated.astype(dtype), exact=exact)
      u_i = u_i + triton_lowering.dot(t_ij, v_beta.astype(dtype), exact=exact)
    w_ref[rows, :] = w_i.astype(w_ref.dtype)
    u_ref[rows, :] = u_i.astype(u_ref.dtype)
    if p_ref is None:
      continue
    q_i = q_ref[rows, :]
    for j in range(nb):
      p_ij = (scale * _pair_block(q_i, k_ref, g_ref, runs_ref, i=i, j=j, inclusive=True, exact=exact) if j <= i
              else jnp.zeros((BLOCK, BLOCK), _F32))
      p_ref[rows, _rows(j * BLOCK, BLOCK)] = p_ij


def _sweep_kernel(q_ref, k_ref, w_ref, u_ref, p_ref, g_ref, runs_ref, decay_ref, s0_ref, o_ref, final_ref, *,
                  scale, chunk_size, num_chunks, exact):
  c = chunk_size
  dtype = q_ref.dtype
  dim_k = k_ref.shape[-1]
  state = jnp.zeros((dim_k, u_ref.shape[-1]), _F32) if s0_ref is None else s0_ref[...]

  def body(n, state):
    start = pl.multiple_of(n * c, c)
    rows = _rows(start, c)
    state_in = state.astype(dtype)
    u = u_ref[rows, :].astype(_F32) - triton_lowering.dot(w_ref[rows, :], state_in, exact=exact)
    u_in = u.astype(dtype)
    g = _gate_rows(g_ref, start, c)
    g_end = _gate_rows(g_ref, start + c - 1, 1)
    row_decay, to_end = (1.0, 1.0) if g_ref is None else (jnp.exp(g), jnp.exp(g_end - g))
    if runs_ref is not None:
      runs = runs_ref[rows][:, None]
      row_decay = row_decay * (runs == 0).astype(_F32)
      to_end = to_end * (runs == runs_ref[_rows(start + c - 1, 1)][None, :])
    q = q_ref[rows, :]
    q_gated = (q.astype(_F32) * (scale * row_decay)).astype(dtype)
    if p_ref is not None:
      p = p_ref[rows, :]
    else:  # one factor per pair: as cheap to recompute as to read
      t = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
      s = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
      allowed = t >= s
      if runs_ref is not None:
        allowed &= runs == runs_ref[rows][None, :]
      gap = 0.0 if g_ref is None else jnp.where(allowed, g - g_ref[rows][None, :], 0.0)
      p = jnp.where(allowed, scale * triton_lowering.dot(q, k_ref[rows, :], trans_b=True, exact=exact) * jnp.exp(gap),
                    0.0)
    out = (triton_lowering.dot(q_gated, state_in, exact=exact)
           + triton_lowering.dot(p.astype(dtype), u_in, exact=exact))
    o_ref[rows, :] = out.astype(o_ref.dtype)
    k_end = (k_ref[rows, :].astype(_F32) * to_end).astype(dtype)
    new_state = triton_lowering.dot(k_end, u_in, trans_a=True, exact=exact)
    if decay_ref is None:
      return state + new_state
    return decay_ref[_rows(pl.multiple_of(n * dim_k, dim_k), dim_k), :] * state + new_state

  state = jax.lax.fori_loop(0, num_chunks, body, state)
  if final_ref is not None:
    final_ref[...] = state


class Gates(NamedTuple):
  """The decay and segments in the kernels' form (None where absent).

  g: [B, H, Tp] (a scalar per token) or [B, H, Tp, Dp] (per key channel)
    float32 chunk-local cumulative log decays (`chunk.chunk_gates`).
  runs: [B, Tp] int32 segment-start counts within each chunk.
  state_decay: [B, H, N Dp, 1] float32 e^{g_C} per chunk and key channel, 0
    where a segment starts in the chunk.
  """
  g: jax.Array | None
  runs: jax.Array | None
  state_decay: jax.Array | None


def gates(decay, segment_starts, *, batch, heads, seq_len, dim_k, chunk_size) -> Gates:
  """The kernels' `Gates` of decay (None, [B, T, H] or [B, T, H, D] float32) and segment starts ([B, T] or None)."""
  c = chunk_size
  n = -(-seq_len // c)
  tp = n * c
  rates = None
  if decay is not None:
    per_channel = decay.ndim == 4
    rates = chunk_common.pad_tokens_and_features(decay if per_channel else decay[..., None], num_tokens=tp,
                                                 dim=dim_k if per_channel else 1)
    rates = jnp.moveaxis(rates, 2, 1) if per_channel else jnp.moveaxis(rates[..., 0], 2, 1)
  starts = None if segment_starts is None else jnp.pad(segment_starts, ((0, 0), (0, tp - seq_len)))
  g, runs = chunk.chunk_gates(rates, starts, chunk_size=c)
  if g is None and runs is None:
    return Gates(None, None, None)
  shape = (batch, heads, n, dim_k)
  state_decay = jnp.ones(shape, _F32)
  if g is not None:
    state_decay = jnp.broadcast_to(jnp.exp(g[:, :, :, -1] if g.ndim == 5 else g[:, :, :, -1:]), shape)
    g = g.reshape(batch, heads, tp, *g.shape[4:])
  if runs is not None:
    state_decay = state_decay * (runs[:, :, :, -1:] == 0)
    runs = runs.reshape(batch, tp)
  return Gates(g, runs, state_decay.reshape(batch, heads, n * dim_k, 1))


def prepare(q, k, v, beta, gates_: Gates, *, scale, config: DeltaConfig, interpret):
  """The prepare kernel on padded inputs ([B, Tp, H, Dp/Ep]; beta [B, H, Tp]): (W, U_v, P or None).

  P [B, H, Tp, C] float32 only with per-key-channel gates (the sweep forms a
  scalar gate's P itself).
  """
  b, tp, h, dp = q.shape
  ep = v.shape[-1]
  c = config.chunk_size
  n = tp // c
  per_channel = gates_.g is not None and gates_.g.ndim == 4
  struct = lambda shape, dtype: manual_axes.struct(shape, dtype, q, k, v)  # noqa: E731
  chunk_rows = lambda width: pl.BlockSpec((None, c, None, width), lambda bi, hi, ni: (bi, ni, hi, 0))  # noqa: E731
  head_rows = pl.BlockSpec((None, None, c), lambda bi, hi, ni: (bi, hi, ni))
  g_spec = None if gates_.g is None else (
      pl.BlockSpec((None, None, c, dp), lambda bi, hi, ni: (bi, hi, ni, 0)) if per_channel else head_rows)
  p_spec = pl.BlockSpec((None, None, c, c), lambda bi, hi, ni: (bi, hi, ni, 0)) if per_channel else None
  return pl.pallas_call(
      functools.partial(_prepare_kernel, scale=scale, exact=q.dtype == _F32), grid=(b, h, n),
      in_specs=[chunk_rows(dp), chunk_rows(dp), chunk_rows(ep), head_rows, g_spec,
                None if gates_.runs is None else pl.BlockSpec((None, c), lambda bi, hi, ni: (bi, ni))],
      out_specs=[chunk_rows(dp), chunk_rows(ep), p_spec],
      out_shape=[struct((b, tp, h, dp), q.dtype), struct((b, tp, h, ep), q.dtype),
                 struct((b, h, tp, c), _F32) if per_channel else None],
      compiler_params=triton_lowering.compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret, name="delta_attention_prepare")(q, k, v, beta, gates_.g, gates_.runs)


def sweep(q, k, w, u, p, gates_: Gates, initial_state, *, scale, with_final_state, config: DeltaConfig, interpret):
  """The sweep kernel on padded inputs: (O [B, Tp, H, Ep], final state [B, H, Dp, Ep] float32 or None)."""
  b, tp, h, dp = q.shape
  ep = u.shape[-1]
  c = config.chunk_size
  n = tp // c
  be = min(config.block_e, ep)
  whole = lambda width: pl.BlockSpec((None, tp, None, width), lambda bi, hi, ei: (bi, 0, hi, 0))  # noqa: E731
  columns = pl.BlockSpec((None, tp, None, be), lambda bi, hi, ei: (bi, 0, hi, ei))
  state_spec = pl.BlockSpec((None, None, dp, be), lambda bi, hi, ei: (bi, hi, 0, ei))
  g_spec = None
  if gates_.g is not None:
    g_spec = (pl.BlockSpec((None, None, tp, dp), lambda bi, hi, ei: (bi, hi, 0, 0)) if gates_.g.ndim == 4
              else pl.BlockSpec((None, None, tp), lambda bi, hi, ei: (bi, hi, 0)))
  struct = lambda shape, dtype: manual_axes.struct(shape, dtype, q, k, u)  # noqa: E731
  return pl.pallas_call(
      functools.partial(_sweep_kernel, scale=scale, chunk_size=c, num_chunks=n, exact=q.dtype == _F32),
      grid=(b, h, ep // be),
      in_specs=[whole(dp), whole(dp), whole(dp), columns,
                None if p is None else pl.BlockSpec((None, None, tp, c), lambda bi, hi, ei: (bi, hi, 0, 0)),
                g_spec, None if gates_.runs is None else pl.BlockSpec((None, tp), lambda bi, hi, ei: (bi, 0)),
                None if gates_.state_decay is None else pl.BlockSpec((None, None, n * dp, 1),
                                                                     lambda bi, hi, ei: (bi, hi, 0, 0)),
                None if initial_state is None else state_spec],
      out_specs=[columns, state_spec if with_final_state else None],
      out_shape=[struct((b, tp, h, ep), q.dtype), struct((b, h, dp, ep), _F32) if with_final_state else None],
      compiler_params=triton_lowering.compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret, name="delta_attention_sweep")(q, k, w, u, p, gates_.g, gates_.runs, gates_.state_decay,
                                                         initial_state)


def forward(q, k, v, beta, decay, segment_starts, initial_state, *, scale, with_final_state, config: DeltaConfig,
            interpret):
  """The delta attention forward on the Pallas Triton kernels.

  q, k: [B, T, H, D]; v: [B, T, H, E] (one float dtype); beta: [B, T, H]
  float32; decay: None, [B, T, H] or [B, T, H, D] float32 rates;
  segment_starts: [B, T] bool or None; initial_state: [B, H, D, E] float32
  or None. Returns (o [B, T, H, E] in q's dtype, final state [B, H, D, E]
  float32 or None).
  """
  b, t, h, d = q.shape
  e = v.shape[-1]
  c = config.chunk_size
  dp, ep = lightning_config.padded_dim(d), lightning_config.padded_dim(e)
  tp = -(-t // c) * c
  pad = functools.partial(chunk_common.pad_tokens_and_features, num_tokens=tp)
  qp, kp, vp = pad(q, dim=dp), pad(k, dim=dp), pad(v, dim=ep)
  gates_ = gates(decay, segment_starts, batch=b, heads=h, seq_len=t, dim_k=dp, chunk_size=c)
  beta_rows = jnp.moveaxis(jnp.pad(beta, ((0, 0), (0, tp - t), (0, 0))), 2, 1)  # [B, H, Tp]
  w, u, p = prepare(qp, kp, vp, beta_rows, gates_, scale=scale, config=config, interpret=interpret)
  o, final_state = sweep(qp, kp, w, u, p, gates_, chunk_common.pad_state(initial_state, dp, ep), scale=scale,
                         with_final_state=with_final_state, config=config, interpret=interpret)
  return o[:, :t, :, :e], None if final_state is None else final_state[:, :, :d, :e]
