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

The backward pass is three such sweeps (dq forward, dk and dv reverse), which
is why one parameterised kernel serves both directions. The decay gradient is
the forward-mode tangent of a sweep with respect to lambda: with
U = -dS/dlambda (a distance-weighted state),

    U_next  = state * U + end * state * S + sum_j key_exp_j key_j k_j^T v_j
    out'_i  = row_i q_i U + row_exp_i row_i q_i S + sum_j gap_ij intra_ij (q_i . k_j) v_j

Every term has a non-negative weight, so nothing large cancels.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

LOG2_E = math.log2(math.e)


def valid_rows(chunk_idx, *, chunk_size, seq_len):
  """Number of real rows in chunk `chunk_idx` (traced int32 scalar ok)."""
  return jnp.minimum(chunk_size, seq_len - chunk_idx * chunk_size)


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


def chunk_decay_factors(lam2, chunk_idx, *, chunk_size, seq_len, reverse):
  """Decay factors of one chunk.

  Args:
    lam2: decay rate times log2(e) (float32 scalar, >= 0), so that exp2 is used.
    chunk_idx: index of the chunk in the sequence (not in sweep order).
    chunk_size, seq_len: static ints.
    reverse: static bool, the anti-causal sweep of the backward pass.
  """
  c = chunk_size
  end = valid_rows(chunk_idx, chunk_size=c, seq_len=seq_len)
  i = jnp.arange(c, dtype=jnp.int32)
  valid = i < end
  # Exponents that feed the state from the far side of the chunk. Masked rows use
  # exponent 0 so that exp2 never sees a large positive argument.
  from_start = (i + 1).astype(jnp.float32)
  to_end = jnp.where(valid, end - 1 - i, 0).astype(jnp.float32)
  row_exp, key_exp = (to_end, from_start) if reverse else (from_start, to_end)
  row = jnp.where(valid, jnp.exp2(-lam2 * row_exp), 0.0)
  key = jnp.where(valid, jnp.exp2(-lam2 * key_exp), 0.0)
  end = end.astype(jnp.float32)
  state = jnp.exp2(-lam2 * end)
  mask = causal_mask(c, reverse=reverse)
  gap = jnp.where(mask, jnp.abs(i[:, None] - i[None, :]), 0).astype(jnp.float32)
  intra = jnp.where(mask, jnp.exp2(-lam2 * gap), 0.0)
  return ChunkFactors(row, key, state, intra, row_exp, key_exp, end, gap)


def causal_mask(chunk_size, *, reverse):
  """[C, C] bool: j <= i (forward) or j >= i (reverse)."""
  i = jnp.arange(chunk_size, dtype=jnp.int32)
  return (i[None, :] >= i[:, None]) if reverse else (i[None, :] <= i[:, None])
