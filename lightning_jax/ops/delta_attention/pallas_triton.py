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


def _pair_blocks(xs, y_ref, g_ref, runs_ref, *, i, j, exact):
  """Block (i, j), j <= i, of sum_d x_td y_sd e^{g_td - g_sd} for each x, over the chunk's 16-row blocks.

  xs: ((x_i [16, D] rows of block i, inclusive), ...): `inclusive` keeps
  s == t. y_ref: the chunk's [C, D] ref. Pairs of different segments are 0.
  The x share the gate factors (A and P of the prepare kernel). Returns a
  list of masked [16, 16] float32 blocks.
  """
  t = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
  s = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
  same_run = jnp.full((BLOCK, BLOCK), True)
  if runs_ref is not None:
    same_run = runs_ref[_rows(i * BLOCK, BLOCK)][:, None] == runs_ref[_rows(j * BLOCK, BLOCK)][None, :]
  masks = [same_run & ((t >= s) if inclusive else (t > s)) if i == j else same_run for _, inclusive in xs]
  y_j = y_ref[_rows(j * BLOCK, BLOCK), :]
  dot = lambda x, y: triton_lowering.dot(x, y, trans_b=True, exact=exact)  # noqa: E731
  if g_ref is None:
    return [jnp.where(mask, dot(x, y_j), 0.0) for (x, _), mask in zip(xs, masks)]
  g_i = _gate_rows(g_ref, i * BLOCK, BLOCK)
  if len(g_ref.shape) == 1:  # a scalar gate: one factor per pair
    gap = g_i - g_ref[_rows(j * BLOCK, BLOCK)][None, :]  # <= 0 for s <= t: every pair of blocks j < i
    decay = jnp.exp(jnp.where(t >= s, gap, 0.0) if i == j else gap)
    return [jnp.where(mask, dot(x, y_j) * decay, 0.0) for (x, _), mask in zip(xs, masks)]
  if i > j:  # per key channel, through r = the row before block i: both factors <= 1
    g_r = _gate_rows(g_ref, i * BLOCK - 1, 1)
    to_i = jnp.exp(g_i - g_r)
    y_hat = (y_j.astype(_F32) * jnp.exp(g_r - _gate_rows(g_ref, j * BLOCK, BLOCK))).astype(y_j.dtype)
    return [jnp.where(mask, dot((x.astype(_F32) * to_i).astype(x.dtype), y_hat), 0.0)
            for (x, _), mask in zip(xs, masks)]
  xs_f32 = [x.astype(_F32) for x, _ in xs]
  row = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, 1), 0)

  def column(c, blocks):  # the pairs (t, j * 16 + c) for every row t of the block
    y_c = y_ref[_rows(j * BLOCK + c, 1), :].astype(_F32)
    y_decayed = y_c * jnp.exp(jnp.where(row >= c, g_i - _gate_rows(g_ref, j * BLOCK + c, 1), 0.0))
    return tuple(jnp.where(s == c, jnp.sum(x * y_decayed, axis=1, keepdims=True), block)
                 for x, block in zip(xs_f32, blocks))

  blocks = jax.lax.fori_loop(0, BLOCK, column, tuple(jnp.zeros((BLOCK, BLOCK), _F32) for _ in xs))
  return [jnp.where(mask, block, 0.0) for block, mask in zip(blocks, masks)]


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
  p_diagonal = {}  # P's diagonal blocks, from the same gate factors as A's (per key channel only)
  for i in range(nb):
    k_i = k_ref[_rows(i * BLOCK, BLOCK), :]
    beta_i = beta_ref[_rows(i * BLOCK, BLOCK)][:, None]
    for j in range(i):
      a[i, j] = beta_i * _pair_blocks([(k_i, False)], k_ref, g_ref, runs_ref, i=i, j=j, exact=exact)[0]
    xs = [(k_i, False)] + ([] if p_ref is None else [(q_ref[_rows(i * BLOCK, BLOCK), :], True)])
    diagonal = _pair_blocks(xs, k_ref, g_ref, runs_ref, i=i, j=i, exact=exact)
    a[i, i] = beta_i * diagonal[0]
    if p_ref is not None:
      p_diagonal[i] = diagonal[1]
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
      p_ij = (p_diagonal[i] if j == i else jnp.zeros((BLOCK, BLOCK), _F32) if j > i
              else _pair_blocks([(q_i, True)], k_ref, g_ref, runs_ref, i=i, j=j, exact=exact)[0])
      p_ref[rows, _rows(j * BLOCK, BLOCK)] = scale * p_ij


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


# The backward pass's two sweeps over the chunk terms of `chunk.chunk_terms` (float32 [B, H, N, C, ...], their
# products in the input dtype as in the forward): the state before every chunk, and walking back, the cotangent
# of the state after every chunk.


def _chunk_states_kernel(w_ref, u_ref, k_end_ref, decay_ref, s0_ref, states_ref, *, chunk_size, num_chunks, dtype,
                         exact):
  """S_{n+1} = Diag(decay_n) S_n + K_C^T (U_v - W S_n); writes S_n for every chunk n."""
  c, dim_k = chunk_size, w_ref.shape[-1]
  state = jnp.zeros((dim_k, u_ref.shape[-1]), _F32) if s0_ref is None else s0_ref[...]

  def body(n, state):
    rows, state_rows = _rows(pl.multiple_of(n * c, c), c), _rows(pl.multiple_of(n * dim_k, dim_k), dim_k)
    states_ref[state_rows, :] = state
    u = u_ref[rows, :] - triton_lowering.dot(w_ref[rows, :].astype(dtype), state.astype(dtype), exact=exact)
    return decay_ref[state_rows, :] * state + triton_lowering.dot(k_end_ref[rows, :].astype(dtype), u.astype(dtype),
                                                                  trans_a=True, exact=exact)

  jax.lax.fori_loop(0, num_chunks, body, state)


def _state_cotangents_kernel(q_gated_ref, p_ref, w_ref, k_end_ref, decay_ref, do_ref, d_final_ref, d_next_ref,
                             d_initial_ref, *, chunk_size, num_chunks, dtype, exact):
  """Walking back: G_n = dL/dS_{n+1} (written for every chunk n), dU = P^T dO + K_C G_n,
  dL/dS_n = Diag(decay_n) G_n + Q_g^T dO - W^T dU."""
  c, dim_k = chunk_size, w_ref.shape[-1]
  grad = jnp.zeros((dim_k, do_ref.shape[-1]), _F32) if d_final_ref is None else d_final_ref[...]

  def body(step, grad):
    n = num_chunks - 1 - step
    rows, state_rows = _rows(pl.multiple_of(n * c, c), c), _rows(pl.multiple_of(n * dim_k, dim_k), dim_k)
    d_next_ref[state_rows, :] = grad
    do = do_ref[rows, :].astype(dtype)
    du = (triton_lowering.dot(p_ref[rows, :].astype(dtype), do, trans_a=True, exact=exact)
          + triton_lowering.dot(k_end_ref[rows, :].astype(dtype), grad.astype(dtype), exact=exact))
    return (decay_ref[state_rows, :] * grad
            + triton_lowering.dot(q_gated_ref[rows, :].astype(dtype), do, trans_a=True, exact=exact)
            - triton_lowering.dot(w_ref[rows, :].astype(dtype), du.astype(dtype), trans_a=True, exact=exact))

  d_initial_ref[...] = jax.lax.fori_loop(0, num_chunks, body, grad)


def _sweep_operands(terms: chunk.ChunkTerms, *value_like):
  """Terms padded for the kernels: [B, H, N C, Dp] / [B, H, N C, Ep] / [B, H, N C, C] rows, decay [B, H, N Dp, 1],
  and each of `value_like` ([B, H, N, C, E] or [B, H, D, E] or None) padded to Ep columns."""
  b, h, n, c, d = terms.w.shape
  dp, ep = lightning_config.padded_dim(d), lightning_config.padded_dim(terms.u.shape[-1])
  rows = lambda x, width: jnp.pad(x, [(0, 0)] * 4 + [(0, width - x.shape[-1])]).reshape(b, h, n * c, width)  # noqa: E731
  padded = dict(w=rows(terms.w, dp), u=rows(terms.u, ep), q_gated=rows(terms.q_gated, dp), p=rows(terms.p, c),
                k_end=rows(terms.k_end, dp),
                decay=jnp.pad(terms.state_decay, ((0, 0),) * 3 + ((0, dp - d),)).reshape(b, h, n * dp, 1))
  extra = []
  for x in value_like:
    if x is not None and x.ndim == 5:
      x = rows(x, ep)
    elif x is not None:
      x = chunk_common.pad_state(x, dp, ep)
    extra.append(x)
  return padded, extra, (b, h, n, c, d, dp, ep)


def chunk_states(terms: chunk.ChunkTerms, initial_state, *, dtype, config: DeltaConfig, interpret):
  """The state before every chunk, [B, H, N, D, E] float32, from `chunk.chunk_terms` and the initial state."""
  e = terms.u.shape[-1]
  ops, (s0,), (b, h, n, c, d, dp, ep) = _sweep_operands(terms, initial_state)
  be = min(config.block_e, ep)
  rows = lambda width: pl.BlockSpec((None, None, n * c, width), lambda bi, hi, ei: (bi, hi, 0, 0))  # noqa: E731
  value_rows = pl.BlockSpec((None, None, n * c, be), lambda bi, hi, ei: (bi, hi, 0, ei))
  states = pl.pallas_call(
      functools.partial(_chunk_states_kernel, chunk_size=c, num_chunks=n, dtype=dtype, exact=dtype == _F32),
      grid=(b, h, ep // be),
      in_specs=[rows(dp), value_rows, rows(dp), pl.BlockSpec((None, None, n * dp, 1), lambda bi, hi, ei: (bi, hi, 0, 0)),
                None if s0 is None else pl.BlockSpec((None, None, dp, be), lambda bi, hi, ei: (bi, hi, 0, ei))],
      out_specs=pl.BlockSpec((None, None, n * dp, be), lambda bi, hi, ei: (bi, hi, 0, ei)),
      out_shape=manual_axes.struct((b, h, n * dp, ep), _F32, terms.w),
      compiler_params=triton_lowering.compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret, name="delta_attention_chunk_states")(ops["w"], ops["u"], ops["k_end"], ops["decay"], s0)
  return states.reshape(b, h, n, dp, ep)[..., :d, :e]


def state_cotangents(terms: chunk.ChunkTerms, do, d_final, *, dtype, config: DeltaConfig, interpret):
  """(dL/dS after every chunk [B, H, N, D, E], dL/dS_0 [B, H, D, E]), float32.

  do: [B, H, N, C, E] float32 output cotangents; d_final: [B, H, D, E] or None.
  """
  e = terms.u.shape[-1]
  ops, (do, d_final), (b, h, n, c, d, dp, ep) = _sweep_operands(terms, do, d_final)
  be = min(config.block_e, ep)
  rows = lambda width: pl.BlockSpec((None, None, n * c, width), lambda bi, hi, ei: (bi, hi, 0, 0))  # noqa: E731
  state_spec = pl.BlockSpec((None, None, dp, be), lambda bi, hi, ei: (bi, hi, 0, ei))
  d_next, d_initial = pl.pallas_call(
      functools.partial(_state_cotangents_kernel, chunk_size=c, num_chunks=n, dtype=dtype, exact=dtype == _F32),
      grid=(b, h, ep // be),
      in_specs=[rows(dp), rows(c), rows(dp), rows(dp),
                pl.BlockSpec((None, None, n * dp, 1), lambda bi, hi, ei: (bi, hi, 0, 0)),
                pl.BlockSpec((None, None, n * c, be), lambda bi, hi, ei: (bi, hi, 0, ei)),
                None if d_final is None else state_spec],
      out_specs=[pl.BlockSpec((None, None, n * dp, be), lambda bi, hi, ei: (bi, hi, 0, ei)), state_spec],
      out_shape=[manual_axes.struct((b, h, n * dp, ep), _F32, terms.w), manual_axes.struct((b, h, dp, ep), _F32, terms.w)],
      compiler_params=triton_lowering.compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret, name="delta_attention_state_cotangents")(
          ops["q_gated"], ops["p"], ops["w"], ops["k_end"], ops["decay"], do, d_final)
  return d_next.reshape(b, h, n, dp, ep)[..., :d, :e], d_initial[:, :, :d, :e]
