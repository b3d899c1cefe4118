"""Chunk decay factors shared by the Pallas kernels and the chunked jnp path.

A sweep walks chunks of `chunk_size` tokens of a sequence of `seq_len` real
tokens (the last chunk may be partial; its padded rows are zeros). With
lambda = decay rate and the carried state located just before the chunk in the
order of the sweep, one chunk does

  forward (causal, reverse=False):
    out_i   = row_i   * q_i S + sum_{j <= i} exp(-lambda (i - j)) (q_i . k_j) v_j
    S_next  = state   * S     + sum_j key_j * k_j^T v_j
  reverse (anti-causal, reverse=True): the same with j >= i,

where row/key/state are powers of exp(-lambda) given by the chunk's position.
`end` = number of real rows in the chunk; rows at or beyond it get factor 0, so
that padding can neither overflow an exponent nor reach the state.

The backward pass runs such sweeps too (dq forward, dk and dv reverse), which
is why one parameterised kernel serves both directions. The decay gradient is
the forward-mode tangent of a sweep with respect to lambda: with
U = -dS/dlambda (a distance-weighted state),

    U_next  = state * U + end * state * S + sum_j key_exp_j key_j k_j^T v_j
    out'_i  = row_i q_i U + row_exp_i row_i q_i S + sum_j gap_ij intra_ij (q_i . k_j) v_j

Every term has a non-negative weight, so nothing large cancels.

Per-token decay and packed sequences (`token_chunk_gates`,
`token_decay_factors`): each token t has its own rate r_t and may start a new
segment. A sweep sees them in its own convention: the rate and the segment
start of a sweep step are those of the transition *into* it (the forward sweep:
r_t; a reverse sweep, which walks G_t = a_{t+1} G_{t+1} + ...: r_{t+1}). With
c_i the rates summed from the chunk's first row (in sweep order) through row i
and run_i the segment starts among those rows, the factors are

    row_i = 2^-c_i if run_i == 0,         intra_ij = 2^(c_j - c_i) if run_i == run_j,
    key_j = 2^(c_j - c_end) if run_j == run_end,   state = 2^-c_end if run_end == 0,

with `end` the chunk's last row in sweep order (padding rows have rate 0 and
start nothing, so they change nothing).

A sweep can also be split into slices of consecutive chunks that run in
parallel, each from the state before it (`combine_slice_states`): the same
combine serves slices of one sequence on one GPU and, across devices, the
slices of a sequence-parallel program.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

LOG2_E = math.log2(math.e)
# Per-token rates are clamped here (log2 units): 2^-150 rounds to 0 in float32,
# so the clamp changes no factor, and it bounds the chunk-local sums whose
# rounding is the factors' error.
MAX_LOG2_RATE = 150.0
# A kernel's chunk whose rates sum to at most this (log2 units; 83 in natural
# units) may take factorised intra factors (`token_decay_factors`): each factor
# then lies in [2^-60, 2^60], so scaled scores overflow only past 2^68, far
# beyond any q . k of 16-bit inputs.
FACTORIZED_MAX_LOG2 = 120.0


def _pad_axis(x, axis, size):
  if x is None or x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def pad_tokens_and_features(x, num_tokens, dim):
  """[B, T, H, D] zero-padded to [B, num_tokens, H, dim] (None stays None): kernels run whole chunks."""
  return _pad_axis(_pad_axis(x, 1, num_tokens), 3, dim)


def pad_state(state, dim_k, dim_v):
  """[B, H, K, V] (or [B, H, S, K, V], a state per slice) zero-padded to [..., dim_k, dim_v]; None stays None."""
  return _pad_axis(_pad_axis(state, -2, dim_k), -1, dim_v)


def valid_rows(chunk_idx, *, chunk_size, seq_len):
  """Number of real rows in chunk `chunk_idx` (traced int32 scalar ok)."""
  return jnp.minimum(chunk_size, seq_len - chunk_idx * chunk_size)


def slice_lengths(*, seq_len: int, chunk_size: int, slice_chunks: int, reverse: bool) -> tuple[int, ...]:
  """Real tokens in each slice of `slice_chunks` chunks, in the order of the sweep.

  A forward sweep's slices start at token 0 (its last one holds the partial
  last chunk); a reverse sweep's start at the last chunk, so its first slice
  holds the partial chunk.
  """
  num_chunks = -(-seq_len // chunk_size)
  bounds = []
  for first in range(0, num_chunks, slice_chunks):
    last = min(first + slice_chunks, num_chunks)  # chunks [first, last) in sweep order
    lo, hi = (num_chunks - last, num_chunks - first) if reverse else (first, last)
    bounds.append(min(hi * chunk_size, seq_len) - lo * chunk_size)
  return tuple(bounds)


# Up to this many slices, `combine_slice_states` sums the weighted slice states in one XLA reduction over the
# slices instead of a matmul: XLA's GPU gemm for an [S + 1, S] x [S, K V] product moved its float32 states at a
# third of the copy bandwidth (15 us at B1 H32 S4 K = V = 128 on an H200: 3.6% of that forward), while the
# reduction reads each state once per later slice (L2 serves a few) and keeps the products in registers. Beside
# decay tangents XLA materialised the products instead (CPU), so those keep the matmul.
SUMMED_SLICES = 8


def combine_slice_states(local_states, lengths, decay=None, initial_state=None, local_tangents=None, *,
                         slice_decay=None, slice_resets=None):
  """The state before each slice of a sweep, and after the last, from each slice's own contribution.

  A sweep of consecutive slices s = 0, 1, ... (in sweep order) of `lengths[s]`
  real tokens, where L_s is slice s's state at its end when started from zeros
  and A_s the slice's decay (a^{len_s} for a per-head rate; the product of its
  tokens' factors for per-token rates, 0 where a segment starts inside it):

      P_0 = S_0,   P_{s+1} = A_s P_s + L_s,

  computed in closed form, P_s = (prod_{u<s} A_u) S_0 + sum_{r<s} (prod_{r<u<s} A_u) L_r:
  one weighted sum over the slice axis (a reduction up to `SUMMED_SLICES`
  slices, else a small matmul), no serial scan. The log-products are
  summed from slice s backwards, so the weights of near slices never come from
  a difference of large sums. With `local_tangents` (V_s = -dL_s/dlambda, a
  per-head rate only), also the decay tangent U_s = -dP_s/dlambda (the initial
  state does not depend on lambda):

      U_s = G_s a^{G_s} S_0 + sum_{r<s} a^{G_s - G_{r+1}} ((G_s - G_{r+1}) L_r + V_r),

  with G_s the tokens before slice s.

  Args:
    local_states: [B, H, S, K, V] float32, L_s.
    lengths: S static ints.
    decay: [H] float32 per-head rates, or None.
    initial_state: [B, H, K, V] float32 or None (zeros).
    local_tangents: [B, H, S, K, V] float32 or None.
    slice_decay: [B, H, S] float32, each slice's summed per-token rates, or
      None (then `decay`, or no decay).
    slice_resets: [B, S] bool, a segment starts inside slice s (nothing before
      it reaches past it), or None.

  Returns:
    (states, tangents): [B, H, S + 1, K, V] float32 P_0..P_S, and U likewise
    (None without `local_tangents`).
  """
  b, h, num_slices = local_states.shape[:3]
  if num_slices != len(lengths):
    raise ValueError(f"local_states must be [B, H, S={len(lengths)}, K, V], got shape {local_states.shape}")
  if decay is not None and slice_decay is not None:
    raise ValueError("give decay (per head) or slice_decay (per token), not both")
  lengths_f = np.asarray(lengths, np.float32)
  if decay is not None:
    slice_decay = decay.astype(jnp.float32)[None, :, None] * lengths_f  # [1, H, S]
  # between[s, r] = the rates of slices r < u < s; start[s] = those of u < s.
  earlier = np.arange(num_slices)[None, :] < np.arange(num_slices + 1)[:, None]  # [S + 1, S]: r < s

  def suffix_sums(x):  # [..., S] -> ([..., S + 1, S] sums over r < u < s, [..., S + 1] over u < s)
    x = jnp.where(earlier, x[..., None, :], 0)
    suffix = jax.lax.cumsum(x, axis=x.ndim - 1, reverse=True)
    return jnp.pad(suffix[..., 1:], [(0, 0)] * (x.ndim - 1) + [(0, 1)]), suffix[..., 0]

  weights = jnp.broadcast_to(jnp.asarray(earlier, jnp.float32), (b, h) + earlier.shape)
  start_decay = jnp.ones((b, h, num_slices + 1), jnp.float32)
  if slice_decay is not None:
    between, start = suffix_sums(slice_decay.astype(jnp.float32))
    weights = weights * jnp.exp(-between)
    start_decay = start_decay * jnp.exp(-start)
  if slice_resets is not None:
    between, start = suffix_sums(slice_resets.astype(jnp.int32))
    weights = jnp.where(between[:, None] == 0, weights, 0.0)
    start_decay = jnp.where(start[:, None] == 0, start_decay, 0.0)

  def over_slices(w, x):
    if local_tangents is None and num_slices <= SUMMED_SLICES:
      return jnp.sum(w[..., None, None] * x[:, :, None], axis=3)
    return jnp.einsum("bhsr,bhrkv->bhskv", w, x, precision=jax.lax.Precision.HIGHEST)

  states = over_slices(weights, local_states)
  if initial_state is not None:
    init = initial_state.astype(jnp.float32)[:, :, None]
    states = states + start_decay[..., None, None] * init
  if local_tangents is None:
    return states, None
  if decay is None:
    raise ValueError("the decay tangent needs a per-head decay")
  gap, gap_start = suffix_sums(lengths_f)  # tokens between slices r and s, and before s
  tangents = over_slices(weights * gap, local_states) + over_slices(weights, local_tangents)
  if initial_state is not None:
    tangents = tangents + (gap_start * start_decay)[..., None, None] * init
  return states, tangents


def count_at_most(values, size: int):
  """[size] int32: at each x in 0..size-1, how many of `values` (int, >= 0) are <= x.

  For sorted values this is `jnp.searchsorted(values, x, side="right")` for
  x = 0, 1, ..., as a scatter and a cumulative sum: searchsorted's default
  method is a loop, which on a GPU waits for the host at every step.
  """
  marks = jnp.zeros(size, jnp.int32).at[values].add(1, mode="drop")
  return jnp.cumsum(marks, dtype=jnp.int32)


def per_token(decay) -> bool:
  """Whether `decay` holds per-token rates [B, T, H] (else None or per-head [H])."""
  return decay is not None and decay.ndim == 3


def segment_starts(segment_ids):
  """[B, T] bool: token t starts a new segment (its id differs from token t - 1's); never token 0.

  Token 0 continues the initial state, which feeds each row's first segment.
  """
  change = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.pad(change, ((0, 0), (1, 0)))


def segmented_cumsum(x, starts, *, axis, reverse=False):
  """Inclusive cumulative sums of x along `axis` that restart wherever `starts` is True (in scan order).

  Each sum adds only the elements of its own segment, in a tree, so no
  rounding of earlier segments' (possibly large) sums reaches it.

  Args:
    x: float array.
    starts: bool, shaped like x's leading dims through `axis` (broadcast over the rest).
    reverse: scan from the end (then a True marks the last element of a segment in array order).
  """
  flags = jnp.broadcast_to(starts.reshape(starts.shape + (1,) * (x.ndim - starts.ndim)), x.shape)

  def combine(earlier, later):
    (value_a, start_a), (value_b, start_b) = earlier, later
    return jnp.where(start_b, value_b, value_a + value_b), start_a | start_b

  return jax.lax.associative_scan(combine, (x, flags), reverse=reverse, axis=axis)[0]


def token_chunk_gates(rates, starts, *, chunk_size, num_tokens, reverse):
  """Chunk-local cumulative rates and segment-start counts, in a sweep's convention (module docstring).

  Args:
    rates: [B, T, H] float32 per-token rates >= 0 (each token's own, the
      forward convention), or None (no decay, or a per-head rate: then
      cumdecay is None).
    starts: [B, T] bool segment starts (`segment_starts`), or None.
    chunk_size: static; num_tokens: Tp, a multiple of it (T padded).
    reverse: the anti-causal sweep: each step takes the rate and start of the
      token after it, and sums run from each chunk's last row backwards.

  Returns:
    (cumdecay [B, H, Tp] float32 or None, the rates in log2 units summed from
    the chunk's first row in sweep order through each row; runs [B, Tp] int32,
    the segment starts among those rows).
  """
  b, t = (rates if rates is not None else starts).shape[:2]
  starts = jnp.zeros((b, t), jnp.int32) if starts is None else starts.astype(jnp.int32)
  # A reverse sweep's step t takes the transition t + 1 -> t; the last token's is the identity.
  shift = (lambda x: jnp.pad(x[:, 1:], [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 2))) if reverse else (  # noqa: E731
      lambda x: x)
  in_chunks = lambda x: x.reshape(*x.shape[:-1], num_tokens // chunk_size, chunk_size)  # noqa: E731
  runs = jax.lax.cumsum(in_chunks(jnp.pad(shift(starts), ((0, 0), (0, num_tokens - t)))), axis=2, reverse=reverse)
  cumdecay = None
  if rates is not None:
    rates = shift(jnp.minimum(rates.astype(jnp.float32) * LOG2_E, MAX_LOG2_RATE))
    rates = jnp.pad(jnp.moveaxis(rates, 2, 1), ((0, 0), (0, 0), (0, num_tokens - t)))
    cumdecay = jax.lax.cumsum(in_chunks(rates), axis=3, reverse=reverse).reshape(b, -1, num_tokens)
  return cumdecay, runs.reshape(b, num_tokens)


# A chunk's segment-start count sits in its first row's bits from RUN_TOTAL_SHIFT up (`with_run_totals`); the
# row's own count in the bits below.
RUN_TOTAL_SHIFT = 16
RUN_COUNTS = (1 << RUN_TOTAL_SHIFT) - 1


def with_run_totals(runs, *, chunk_size, reverse):
  """`token_chunk_gates`' runs [B, Tp] with each chunk's last count in sweep order (its segment starts) added to the
  chunk's first row in memory, shifted left by RUN_TOTAL_SHIFT.

  The Triton sweeps read a chunk's total there by one scalar load (`runs & RUN_COUNTS` are the counts): at the
  chunk's first row, the address of its [C] counts' load, the forward sweeps ran as fast as the reverse ones, which
  find the total there anyway; a scalar load of the chunk's last row instead made the packed dq sweep 18% slower
  (H200, B1 H32 T32K D128, per-head rate; PERFORMANCE.md, "Per-token decay and packed sequences").
  """
  b, tp = runs.shape
  chunks = runs.reshape(b, tp // chunk_size, chunk_size)
  total = chunks[..., (0 if reverse else chunk_size - 1), None]
  # Elementwise (no scatter into a copy): XLA fuses it into one loop.
  first_row = np.arange(chunk_size) == 0
  return (chunks + jnp.where(first_row, total << RUN_TOTAL_SHIFT, 0)).reshape(b, tp)


def chunk_totals(cumdecay, runs, *, chunk_size, num_chunks, reverse):
  """Each chunk's summed rates (natural units) [B, H, N] (None without cumdecay) and whether a segment
  starts in it [B, N] (None without runs), in sweep order.

  From `token_chunk_gates`' outputs; the first `num_chunks` chunks are real.
  """
  end = 0 if reverse else chunk_size - 1  # the chunk's last row in sweep order
  in_order = (lambda x: x[..., ::-1]) if reverse else (lambda x: x)  # noqa: E731
  started = None
  if runs is not None:
    started = in_order((runs.reshape(runs.shape[0], -1, chunk_size)[:, :num_chunks, end] & RUN_COUNTS) > 0)
  if cumdecay is None:
    return None, started
  rate = cumdecay.reshape(*cumdecay.shape[:2], -1, chunk_size)[:, :, :num_chunks, end] / LOG2_E
  return in_order(rate), started


class ChunkFactors(NamedTuple):
  """Decay factors of one chunk (float32); the exponents feed the decay tangent."""
  row: jax.Array  # [C] exp(-lambda * row_exp)
  key: jax.Array  # [C] exp(-lambda * key_exp)
  state: jax.Array  # () exp(-lambda * end)
  intra: jax.Array  # [C, C] exp(-lambda * gap), zero outside the (anti-)causal mask
  row_exp: jax.Array  # [C]
  key_exp: jax.Array  # [C]
  end: jax.Array  # () real rows in the chunk
  gap: jax.Array  # [C, C] |i - j| inside the mask, else 0


# The fields that depend on the number of real rows (intra and gap do not).
_END_FIELDS = ("row", "key", "state", "row_exp", "key_exp", "end")


def chunk_decay_factors(lam2, end, *, chunk_size, reverse):
  """Decay factors of one chunk.

  Args:
    lam2: decay rate times log2(e) (float32 scalar, >= 0), so that exp2 is used.
    end: number of real rows in the chunk (int or traced int32 scalar, see
      `valid_rows`).
    chunk_size: static int.
    reverse: static bool, the anti-causal sweep of the backward pass.
  """
  c = chunk_size
  i = jnp.arange(c, dtype=jnp.int32)
  valid = i < end
  # Exponents that feed the state from the far side of the chunk. Masked rows use
  # exponent 0 so that exp2 never sees a large positive argument.
  from_start = (i + 1).astype(jnp.float32)
  to_end = jnp.where(valid, end - 1 - i, 0).astype(jnp.float32)
  row_exp, key_exp = (to_end, from_start) if reverse else (from_start, to_end)
  row = jnp.where(valid, jnp.exp2(-lam2 * row_exp), 0.0)
  key = jnp.where(valid, jnp.exp2(-lam2 * key_exp), 0.0)
  end = jnp.asarray(end, jnp.float32)
  state = jnp.exp2(-lam2 * end)
  mask = causal_mask(c, reverse=reverse)
  gap = jnp.where(mask, jnp.abs(i[:, None] - i[None, :]), 0).astype(jnp.float32)
  intra = jnp.where(mask, jnp.exp2(-lam2 * gap), 0.0)
  return ChunkFactors(row, key, state, intra, row_exp, key_exp, end, gap)


def token_decay_factors(cumdecay, runs, *, reverse, branch=False, cum_end=None, run_end=None):
  """Decay factors of one chunk from per-token rates and segment starts (module docstring).

  Args:
    cumdecay: [C] float32, the chunk's `token_chunk_gates` cumulative rates.
    runs: [C] int32, its segment-start counts, or None (no segments).
    reverse: static bool, the anti-causal sweep.
    branch: a kernel's chunk that branches on its own rates and starts
      (`heuristics.branch_per_chunk`): where the chunk's rates sum to at most
      `FACTORIZED_MAX_LOG2` the intra factors come from 2C exp2,
      2^(c_j - c_i) = 2^(m - c_i) 2^(c_j - m) with m half the sum (each factor
      within 2^+-60, their product at most 2^120), else from C^2; and segments
      mask only a chunk in which one starts (`mask_started_segments`).
      Otherwise (and always on the xla path, vmapped and differentiated) the
      C^2 form, masked unconditionally.
    cum_end, run_end: the chunk's last values (in sweep order) of cumdecay and
      runs, where a kernel loads them as scalars (a reduction over the chunk
      waits for every warp), else None (reduced here).

  Returns:
    `ChunkFactors` with row, key, state and intra (the decay tangent's fields
    are None: per-token rates are differentiated in reverse mode, see `vjp`).
  """
  c = cumdecay.shape[0]
  i = jnp.arange(c, dtype=jnp.int32)
  end_row = 0 if reverse else c - 1
  c_end = jnp.sum(jnp.where(i == end_row, cumdecay, 0.0)) if cum_end is None else cum_end
  # Exponents are clamped at 0 so that masked entries never overflow; `where`,
  # not `minimum`, so that autodiff (the xla path) gives a tie its whole slope.
  nonpositive = lambda x: jnp.where(x <= 0, x, 0.0)  # noqa: E731
  mask = causal_mask(c, reverse=reverse)

  def clamped():
    return jnp.where(mask, jnp.exp2(nonpositive(cumdecay[None, :] - cumdecay[:, None])), 0.0)

  def factorized():
    mid = 0.5 * c_end
    return jnp.where(mask, jnp.exp2(mid - cumdecay)[:, None] * jnp.exp2(cumdecay - mid)[None, :], 0.0)

  intra = jax.lax.cond(c_end <= FACTORIZED_MAX_LOG2, factorized, clamped) if branch else clamped()
  f = ChunkFactors(jnp.exp2(-cumdecay), jnp.exp2(nonpositive(cumdecay - c_end)), jnp.exp2(-c_end), intra,
                   None, None, None, None)
  if runs is None:
    return f
  return mask_started_segments(f, runs, run_end) if branch else mask_segments(f, runs, run_end)


def mask_segments(f, runs, run_end=None):
  """Chunk factors `f` restricted to segments: nothing reaches across a segment start.

  runs: [C] int32 segment-start counts of the chunk (`token_chunk_gates`);
  run_end: their last value in sweep order (their largest), or None (reduced
  here). The decay-tangent fields stay: their terms vanish with the factors
  they scale.
  """
  return mask_segment_rows(f, runs, run_end)._replace(intra=same_segment(f.intra, runs))


def mask_segment_rows(f, runs, run_end=None):
  """`mask_segments`' row, key and state factors alone ([C] selects); intra stays (a kernel that masks its [C, C]
  products instead, `same_segment`)."""
  run_end = jnp.max(runs) if run_end is None else run_end
  return f._replace(row=jnp.where(runs == 0, f.row, 0.0), key=jnp.where(runs == run_end, f.key, 0.0),
                    state=jnp.where(run_end == 0, f.state, 0.0))


def same_segment(pairs, runs):
  """[C, C] `pairs` zeroed where rows i and j lie in different segments (runs: the chunk's [C] counts)."""
  return jnp.where(runs[:, None] == runs[None, :], pairs, 0.0)


def mask_started_segments(f, runs, run_end=None):
  """`mask_segments` in a kernel: a chunk in which no segment starts keeps `f` (a branch, not [C, C] selects)."""
  run_end = jnp.max(runs) if run_end is None else run_end
  return jax.lax.cond(run_end > 0, lambda: mask_segments(f, runs, run_end), lambda: f)


def sweep_decay_factors(lam2, *, chunk_size, seq_len, reverse):
  """The factors of every chunk of a sweep, computed once, before the chunk loop.

  Every chunk but a partial last one has the same factors, so a kernel computes
  the (at most two) distinct sets once and the loop body only selects: no
  [C, C] exp2 per chunk.

  Returns:
    A function of the chunk index (traced int32 ok) returning its `ChunkFactors`.
  """
  num_chunks = -(-seq_len // chunk_size)
  last_rows = seq_len - (num_chunks - 1) * chunk_size
  full = chunk_decay_factors(lam2, chunk_size, chunk_size=chunk_size, reverse=reverse)
  if last_rows == chunk_size:
    return lambda chunk_idx: full
  last = chunk_decay_factors(lam2, last_rows, chunk_size=chunk_size, reverse=reverse)

  def factors(chunk_idx):
    is_last = chunk_idx == num_chunks - 1
    return full._replace(**{name: jnp.where(is_last, getattr(last, name), getattr(full, name))
                            for name in _END_FIELDS})

  return factors


def causal_mask(chunk_size, *, reverse):
  """[C, C] bool: j <= i (forward) or j >= i (reverse)."""
  i = jnp.arange(chunk_size, dtype=jnp.int32)
  return (i[None, :] >= i[:, None]) if reverse else (i[None, :] <= i[:, None])
