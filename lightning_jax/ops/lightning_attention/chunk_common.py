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
  """[B, H, K, V] zero-padded to [B, H, dim_k, dim_v] (None stays None)."""
  return _pad_axis(_pad_axis(state, 2, dim_k), 3, dim_v)


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


def combine_slice_states(local_states, lengths, decay=None, initial_state=None, local_tangents=None):
  """The state before each slice of a sweep, and after the last, from each slice's own contribution.

  A sweep of consecutive slices s = 0, 1, ... (in sweep order) of `lengths[s]`
  real tokens, where L_s is slice s's state at its end when started from zeros:

      P_0 = S_0,   P_{s+1} = a^{len_s} P_s + L_s,

  computed in closed form, P_s = a^{G_s} S_0 + sum_{r<s} a^{G_s - G_{r+1}} L_r
  with G_s the tokens before slice s: one small matmul over the slice axis, no
  serial scan. With `local_tangents` (V_s = -dL_s/dlambda), also the decay
  tangent U_s = -dP_s/dlambda (the initial state does not depend on lambda):

      U_s = G_s a^{G_s} S_0 + sum_{r<s} a^{G_s - G_{r+1}} ((G_s - G_{r+1}) L_r + V_r).

  Args:
    local_states: [B, H, S, K, V] float32, L_s.
    lengths: S static ints.
    decay: [H] float32 rates or None (a = 1).
    initial_state: [B, H, K, V] float32 or None (zeros).
    local_tangents: [B, H, S, K, V] float32 or None.

  Returns:
    (states, tangents): [B, H, S + 1, K, V] float32 P_0..P_S, and U likewise
    (None without `local_tangents`).
  """
  num_slices = len(lengths)
  if local_states.shape[2] != num_slices:
    raise ValueError(f"local_states must be [B, H, S={num_slices}, K, V], got shape {local_states.shape}")
  starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.float32)  # G_0 .. G_S
  # gap[s, r] = tokens between the end of slice r and the start of slice s, r < s.
  earlier = np.arange(num_slices)[None, :] < np.arange(num_slices + 1)[:, None]
  gap = np.where(earlier, starts[:, None] - starts[None, 1:], 0.0).astype(np.float32)
  if decay is None:
    weights = jnp.broadcast_to(jnp.asarray(earlier, jnp.float32), (local_states.shape[1],) + earlier.shape)
    start_decay = None
  else:
    lam = decay.astype(jnp.float32)[:, None, None]
    weights = jnp.where(earlier, jnp.exp(-lam * gap), 0.0)  # [H, S + 1, S]
    start_decay = jnp.exp(-decay.astype(jnp.float32)[:, None] * starts)  # [H, S + 1]

  def over_slices(w, x):
    return jnp.einsum("hsr,bhrkv->bhskv", w, x, precision=jax.lax.Precision.HIGHEST)

  states = over_slices(weights, local_states)
  if initial_state is not None:
    init = initial_state.astype(jnp.float32)[:, :, None]
    states = states + (init if start_decay is None else start_decay[None, :, :, None, None] * init)
  if local_tangents is None:
    return states, None
  if decay is None:
    raise ValueError("the decay tangent needs a decay")
  tangents = over_slices(weights * gap, local_states) + over_slices(weights, local_tangents)
  if initial_state is not None:
    tangents = tangents + (starts * start_decay)[None, :, :, None, None] * init
  return states, tangents


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
