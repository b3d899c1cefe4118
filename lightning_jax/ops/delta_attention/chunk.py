"""Chunk algebra of the delta rule (the WY / UT form), in jnp, shared by the chunked path and the kernels' tests.

Within a chunk of C tokens starting from the state S (per batch and head), let
g_t = sum_{s <= t} log a_s be the chunk-local cumulative log decay ([D] per
token for KDA, a scalar otherwise; g <= 0 and non-increasing). With the
pseudo-values u_t = beta_t (v_t - (Diag(a_t) S_{t-1})^T k_t), the state after
token t is

    S_t = Diag(e^{g_t}) S + sum_{s <= t} Diag(e^{g_t - g_s}) k_s u_s^T,

so the u solve the unit lower-triangular system (I + A) U = beta (V - K_g S),
A_ts = beta_t sum_d k_td k_sd e^{g_td - g_sd} (s < t), K_g = k * e^g. With
T = (I + A)^{-1} (the UT transform of the chunk's Householder products):

    W = T beta K_g,   U_v = T beta V,   U = U_v - W S                    [C, D], [C, E]
    O = scale (Q_g S + P U),          P_ts = sum_d q_td k_sd e^{g_td - g_sd} (s <= t)
    S_next = Diag(e^{g_C}) S + K_C^T U,   K_C = k * e^{g_C - g}.

Everything but U, O and S_next is independent of S, so it is computed for all
chunks at once; only two [C, D] x [D, E]-sized products per chunk are serial.

Gated pair products e^{g_t - g_s} (KDA: per key channel) are formed without
ever exponentiating a positive number: across sub-chunks of `SUB_CHUNK` rows
they factor through the last row r before t's sub-chunk, e^{g_t - g_r} e^{g_r - g_s}
(both <= 1), and within a sub-chunk they are taken pair by pair.

Packed sequences: `runs` counts the segment starts among a chunk's rows up to
each row. Pairs of different runs do not interact, rows after a start do not
see S (their K_g, Q_g rows are 0), and S reaches S_next only if no segment
starts in the chunk. A segment start's own decay never matters (it multiplies
a zero state).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lightning_jax.ops.lightning_attention import chunk_common

SUB_CHUNK = 16
# Rates are clamped at 104 (e^-104 is 0 in float32, so no factor changes): it
# bounds the chunk-local sums, whose rounding is the factors' error.
MAX_RATE = chunk_common.MAX_LOG2_RATE / chunk_common.LOG2_E
_HI = jax.lax.Precision.HIGHEST


def gated_pairs(x, y, g, allowed):
  """sum_d x_td y_sd e^{g_td - g_sd} where `allowed` (all with s <= t), else 0.

  x, y: [..., C, D]; g: None (no decay), [..., C] (one rate per token) or
  [..., C, D] (per key channel), non-increasing along C; allowed: bool
  broadcastable to [..., C, C]. Returns [..., C, C] float32.
  """
  c = x.shape[-2]
  if g is None:
    return jnp.where(allowed, jnp.einsum("...td,...sd->...ts", x, y, precision=_HI), 0.0)
  if g.ndim == x.ndim - 1:  # a scalar gate per token: one factor per pair
    gap = jnp.where(allowed, g[..., :, None] - g[..., None, :], 0.0)
    return jnp.where(allowed, jnp.einsum("...td,...sd->...ts", x, y, precision=_HI) * jnp.exp(gap), 0.0)
  sub = min(SUB_CHUNK, c)
  if c % sub:
    raise ValueError(f"chunk size {c} must be a multiple of {sub}")
  ns = c // sub
  lead = x.shape[:-2]
  rows = jnp.arange(c)
  # Across sub-chunks: through r_i, the last row before sub-chunk i (g_{-1} = 0).
  ref_row = jnp.arange(ns) * sub - 1
  g_ref = jnp.where((ref_row >= 0)[:, None], jnp.take(g, jnp.maximum(ref_row, 0), axis=-2), 0.0)  # [..., NS, D]
  x_hat = x.reshape(*lead, ns, sub, -1) * jnp.exp(g.reshape(*lead, ns, sub, -1) - g_ref[..., None, :])
  before = rows[None, :] <= ref_row[:, None]  # [NS, C]: s <= r_i
  gap = jnp.where(before[..., None], g_ref[..., :, None, :] - g[..., None, :, :], 0.0)  # [..., NS, C, D]
  y_hat = jnp.where(before[..., None], y[..., None, :, :] * jnp.exp(gap), 0.0)
  across = jnp.einsum("...ipd,...isd->...ips", x_hat, y_hat, precision=_HI).reshape(*lead, c, c)
  # Within a sub-chunk: pair by pair.
  xs, ys, gs = (z.reshape(*lead, ns, sub, -1) for z in (x, y, g))
  lower = jnp.tril(jnp.ones((sub, sub), bool))[..., None]
  gap = jnp.where(lower, gs[..., :, None, :] - gs[..., None, :, :], 0.0)  # [..., NS, sub, sub, D]
  within = jnp.sum(xs[..., :, None, :] * ys[..., None, :, :] * jnp.exp(gap), axis=-1)
  same_sub = (rows[:, None] // sub) == (rows[None, :] // sub)
  within = _block_diagonal(within)
  return jnp.where(allowed, jnp.where(same_sub, within, across), 0.0)


def _block_diagonal(blocks):
  """[..., NS, S, S] -> [..., NS S, NS S] with the blocks on the diagonal."""
  ns, sub = blocks.shape[-3], blocks.shape[-1]
  eye = jnp.eye(ns, dtype=blocks.dtype)
  return jnp.einsum("...ipq,ij->...ipjq", blocks, eye).reshape(*blocks.shape[:-3], ns * sub, ns * sub)


class ChunkTerms(NamedTuple):
  """The S-independent terms of every chunk ([B, H, N, ...] float32; see the module docstring)."""
  w: jax.Array            # [B, H, N, C, D]   T beta K_g
  u: jax.Array            # [B, H, N, C, E]   T beta V
  q_gated: jax.Array      # [B, H, N, C, D]   scale Q_g
  p: jax.Array            # [B, H, N, C, C]   scale P
  k_end: jax.Array        # [B, H, N, C, D]   K_C
  state_decay: jax.Array  # [B, H, N, D]      e^{g_C}, 0 where a segment starts in the chunk


def _chunk_product(triangle, x):
  """triangle [C, C] times x [B, N C, ...] along axis 1 within each chunk of C rows, float32 (HIGHEST precision),
  rows token-major so that the triangle broadcasts over B N alone ([B N, C, C])."""
  b, tp = x.shape[:2]
  c = triangle.shape[0]
  n = b * (tp // c)
  rows = x.reshape(n, c, -1).astype(jnp.float32)
  return jnp.einsum("nts,nsx->ntx", jnp.broadcast_to(triangle, (n, c, c)), rows, precision=_HI).reshape(x.shape)


def chunk_cumsum(x, *, chunk_size):
  """Inclusive sums of x [B, N C, ...] along axis 1 within each chunk of `chunk_size` rows, float32.

  One float32 product (HIGHEST precision) with a triangle of ones per
  (batch, chunk); its vjp, the sums from each row to the chunk's end, is
  the transposed product (`chunk_sums_to_end`). XLA's cumsum on a GPU is an
  associative scan fused into one loop: for KDA's rates at B2 H32 T8K D128 on
  an H200 it took 0.62 ms, its vjp 0.49; the product 0.22 and 0.14
  (PERFORMANCE.md).
  """
  return _chunk_product(jnp.tril(jnp.ones((chunk_size, chunk_size), jnp.float32)), x)


def chunk_sums_to_end(x, *, chunk_size, sign=1.0):
  """sign times the sums of x [B, N C, ...] along axis 1 from each row to its chunk's end, float32: `chunk_cumsum`'s
  vjp, the transposed product (sign, 1 or -1, folded into the triangle)."""
  return _chunk_product(sign * jnp.triu(jnp.ones((chunk_size, chunk_size), jnp.float32)), x)


def chunk_log_decays(rates, *, chunk_size):
  """g = -(the rates summed from each chunk's first row through each row), float32, token-major.

  rates: [B, N C, H] or [B, N C, H, D] rates >= 0 (padded with 0), clamped at
  MAX_RATE; sums by `chunk_cumsum`, so that the vjp is one product too.
  Returns g like rates (<= 0, non-increasing within each chunk).
  """
  return -chunk_cumsum(jnp.minimum(rates.astype(jnp.float32), MAX_RATE), chunk_size=chunk_size)


def chunk_runs(starts, *, chunk_size):
  """[B, 1, N, C] int32: the segment starts ([B, N C] bool, `chunk_common.segment_starts`) among each chunk's rows
  up to each row."""
  b, tp = starts.shape
  return jnp.cumsum(starts.astype(jnp.int32).reshape(b, 1, tp // chunk_size, chunk_size), axis=-1)


def chunk_terms(q, k, v, beta, g, runs, *, scale):
  """Every chunk's S-independent terms.

  q, k: [B, H, N, C, D]; v: [B, H, N, C, E]; beta: [B, H, N, C]; g: None,
  [B, H, N, C] or [B, H, N, C, D] (`chunk_log_decays`); runs: [B, 1, N, C] (`chunk_runs`) or
  None. All float32, padding rows zero. Returns `ChunkTerms`.
  """
  c = q.shape[-2]
  causal = jnp.tril(jnp.ones((c, c), bool))
  if runs is None:
    same_run, sees_state, run_end = causal, 1.0, 1.0
  else:
    same_run = causal & (runs[..., :, None] == runs[..., None, :])
    sees_state = (runs == 0)[..., None].astype(jnp.float32)
    run_end = runs[..., -1:]
  # The decay of each row from the chunk start, of each row to the chunk end
  # ([..., C, D or 1]), and of the chunk ([..., 1, D or 1]); 1 without decay.
  if g is None:
    decay_rows, to_end, chunk_decay = 1.0, 1.0, jnp.ones((1, 1), q.dtype)
  else:
    gate = g if g.ndim == q.ndim else g[..., None]
    g_end = gate[..., -1:, :]
    decay_rows, to_end, chunk_decay = jnp.exp(gate), jnp.exp(g_end - gate), jnp.exp(g_end)
  decay_rows = decay_rows * sees_state
  strict = same_run & ~jnp.eye(c, dtype=bool)
  a = beta[..., :, None] * gated_pairs(k, k, g, strict)
  t_beta = lambda x: jax.lax.linalg.triangular_solve(  # noqa: E731  (I + A)^{-1} beta x
      a + jnp.eye(c, dtype=a.dtype), beta[..., None] * x, left_side=True, lower=True, unit_diagonal=True)
  w = t_beta(k * decay_rows)
  u = t_beta(v)
  p = scale * gated_pairs(q, k, g, same_run)
  if runs is not None:
    to_end = to_end * (runs == run_end)[..., None]
    chunk_decay = chunk_decay * (run_end == 0)[..., None]
  state_decay = jnp.broadcast_to(chunk_decay[..., 0, :], (*q.shape[:-2], q.shape[-1]))
  return ChunkTerms(w=w, u=u, q_gated=scale * q * decay_rows, p=p, k_end=k * to_end, state_decay=state_decay)


def chunk_outputs(terms: ChunkTerms, states):
  """O [B, H, N, C, E] from each chunk's terms and its state before it, [B, H, N, D, E]."""
  u = terms.u - jnp.einsum("...cd,...de->...ce", terms.w, states, precision=_HI)
  return (jnp.einsum("...cd,...de->...ce", terms.q_gated, states, precision=_HI)
          + jnp.einsum("...ts,...se->...te", terms.p, u, precision=_HI))


def next_state(terms_n, state):
  """S_next from one chunk's terms ([B, H, ...] slices of `ChunkTerms`) and its state before it [B, H, D, E]."""
  u = terms_n.u - jnp.einsum("...cd,...de->...ce", terms_n.w, state, precision=_HI)
  return terms_n.state_decay[..., None] * state + jnp.einsum("...cd,...ce->...de", terms_n.k_end, u, precision=_HI)


class AlignedSequences(NamedTuple):
  """`cu_seqlens`' N sequences laid out chunk-aligned in one row: sequence n takes the whole chunks
  [first[n], end[n]) of `chunk_size` tokens, its last one zero-padded (a zero row leaves the state as it is: k = v =
  beta = 0 and rate 0), so no chunk holds two sequences and each sequence's state can be set where its first chunk
  begins. With N sequences in T tokens that is at most ceil(T / C) + N - 1 chunks, a static bound (the boundaries
  stay traced).

  rows: [T] int32, each token's row in the layout.
  sources: [num_chunks chunk_size] int32, each layout row's token (T: a padding row).
  first, end: [N] int32, each sequence's first chunk and one past its last (first == end: empty).
  """
  rows: jax.Array
  sources: jax.Array
  first: jax.Array
  end: jax.Array
  num_chunks: int
  chunk_size: int

  def to_layout(self, x):
    """[1, T, ...] -> [1, num_chunks chunk_size, ...] in x's dtype, zeros between the sequences."""
    return take_rows(x, self.sources, self.rows)

  def from_layout(self, y):
    """[1, num_chunks chunk_size, ...] -> [1, T, ...]: each token's row (the inverse of to_layout)."""
    return take_rows(y, self.rows, self.sources)


@jax.custom_vjp
def take_rows(x, index, inverse):
  """x[:, index] (x: [1, L, ...]; index [M] int32, zeros where index[m] >= L), index being one-to-one where in range
  and `inverse` [L] its inverse (out of range at rows nothing takes).

  Its transpose is the gather by `inverse`, where autodiff's is a scatter-add:
  both directions of the layout stay gathers (XLA's CPU scatter fusions of
  jaxlib 0.10 hung at random in these gradients, and a GPU scatter needs
  atomics)."""
  return jnp.take(x, index, axis=1, mode="fill", fill_value=0)


def _take_rows_fwd(x, index, inverse):
  return take_rows(x, index, inverse), (index, inverse)


def _take_rows_bwd(residuals, cotangent):
  index, inverse = residuals
  return take_rows(cotangent, inverse, index), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def aligned_sequences(cu_seqlens, seq_len: int, chunk_size: int) -> AlignedSequences:
  """The chunk-aligned layout of the sequences of cu_seqlens (int [N + 1], validated: 0 = cu[0] <= ... <= cu[N] =
  seq_len), in chunks of chunk_size."""
  cu = cu_seqlens.astype(jnp.int32)
  n = cu.shape[0] - 1
  c = chunk_size
  end = jnp.cumsum(-(-(cu[1:] - cu[:-1]) // c)).astype(jnp.int32)
  first = end - (-(-(cu[1:] - cu[:-1]) // c)).astype(jnp.int32)
  pos = jnp.arange(seq_len, dtype=jnp.int32)
  seq = chunk_common.count_at_most(cu[1:], seq_len)
  num_chunks = -(-seq_len // c) + n - 1
  # Each layout row's sequence: the first whose chunks end after the row's chunk (empty ones end before it).
  row = jnp.arange(num_chunks * c, dtype=jnp.int32)
  row_seq = jnp.minimum(chunk_common.count_at_most(end, num_chunks), n - 1)[row // c]
  offset = row - first[row_seq] * c
  sources = jnp.where((offset >= 0) & (offset < cu[row_seq + 1] - cu[row_seq]), cu[row_seq] + offset, seq_len)
  return AlignedSequences(rows=first[seq] * c + pos - cu[seq], sources=sources.astype(jnp.int32), first=first,
                          end=end, num_chunks=num_chunks, chunk_size=c)
