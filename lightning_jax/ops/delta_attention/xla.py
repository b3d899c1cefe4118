"""Chunked O(T) delta attention in plain jnp (`impl="xla"`): the fallback off NVIDIA GPUs.

Every chunk's S-independent terms at once (`chunk.chunk_terms`), a `lax.scan`
over the chunk states, then every chunk's outputs at once; differentiated by
JAX autodiff. Everything is computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lightning_jax.ops.delta_attention import chunk
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import manual_axes


def to_chunks(x, num_chunks, chunk_size):
  """[B, T, H, ...] -> [B, H, N, C, ...] float32, zero-padded to N C tokens."""
  x = jnp.moveaxis(x.astype(jnp.float32), 2, 1)
  x = jnp.pad(x, [(0, 0), (0, 0), (0, num_chunks * chunk_size - x.shape[2])] + [(0, 0)] * (x.ndim - 3))
  return x.reshape(*x.shape[:2], num_chunks, chunk_size, *x.shape[3:])


def from_chunks(x, seq_len):
  """[B, H, N, C, ...] -> [B, T, H, ...]."""
  x = x.reshape(*x.shape[:2], -1, *x.shape[4:])[:, :, :seq_len]
  return jnp.moveaxis(x, 1, 2)


def prepare(q, k, v, beta, decay, segment_starts, *, scale, chunk_size):
  """(`chunk.ChunkTerms`, number of chunks) of validated inputs ([B, T, H, ...] layout; starts [B, T] or None)."""
  t = q.shape[1]
  n = -(-t // chunk_size)
  pad_tokens = lambda x: jnp.pad(x, [(0, 0), (0, n * chunk_size - t)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
  g = None if decay is None else to_chunks(chunk.chunk_log_decays(pad_tokens(decay), chunk_size=chunk_size), n,
                                           chunk_size)
  runs = None if segment_starts is None else chunk.chunk_runs(pad_tokens(segment_starts), chunk_size=chunk_size)
  q, k, v, beta = (to_chunks(x, n, chunk_size) for x in (q, k, v, beta))
  return chunk.chunk_terms(q, k, v, beta, g, runs, scale=scale), n


def delta_attention_chunked(q, k, v, beta, decay=None, *, scale, initial_state=None, chunk_size=64,
                            segment_ids=None):
  """Returns (o [B, T, H, E] float32, final state [B, H, D, E] float32).

  q, k: [B, T, H, D]; v: [B, T, H, E]; beta: [B, T, H]; decay: None, [B, T, H]
  or [B, T, H, D] rates; segment_ids: None or [B, T] (the state restarts where
  the id changes; initial_state feeds each row's first segment and the final
  state is each row's last). chunk_size: a multiple of `chunk.SUB_CHUNK`.
  """
  starts = None if segment_ids is None else chunk_common.segment_starts(segment_ids)
  return chunked(q, k, v, beta, decay, starts, initial_state, scale=scale, chunk_size=chunk_size)


def chunked(q, k, v, beta, decay, segment_starts, initial_state, *, scale, chunk_size):
  """`delta_attention_chunked` with the segment starts ([B, T] bool or None) in place of the ids."""
  b, t, h, d = q.shape
  terms, _ = prepare(q, k, v, beta, decay, segment_starts, scale=scale, chunk_size=chunk_size)
  s0 = jnp.zeros((b, h, d, v.shape[-1]), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
  s0 = manual_axes.vary_like(s0, terms.w)  # inside shard_map, the carry varies like the inputs

  def step(state, terms_n):
    return chunk.next_state(terms_n, state), state

  serial = chunk.ChunkTerms(*(jnp.moveaxis(x, 2, 0) for x in terms))
  final_state, states = jax.lax.scan(step, s0, serial)
  o = chunk.chunk_outputs(terms, jnp.moveaxis(states, 0, 2))
  return from_chunks(o, t), final_state


def chunked_sequences(q, k, v, beta, decay, cu_seqlens, initial_state, *, scale, chunk_size, with_final_state):
  """The chunked path over `cu_seqlens` sequences, each from its own initial state, with each one's final state.

  The sequences are laid out chunk-aligned (`chunk.aligned_sequences`), so a
  sequence's initial state enters the scan where its first chunk begins:
  O((T + N C) C) work per head instead of O(T C).

  Args:
    q, k: [1, T, H, D]; v: [1, T, H, E]; beta: [1, T, H]; decay: None,
      [1, T, H] or [1, T, H, D] float32 rates.
    cu_seqlens: int [N + 1] (validated: 0 = cu[0] <= ... <= cu[N] = T).
    initial_state: [N, H, D, E] float32 or None (zeros).
    with_final_state: also compute each sequence's final state.

  Returns:
    (o [1, T, H, E] float32, final states [N, H, D, E] float32, an empty
    sequence's being its initial state; or None without with_final_state).
  """
  _, t, h, d = q.shape
  e = v.shape[-1]
  c = chunk_size
  n = cu_seqlens.shape[0] - 1
  layout = chunk.aligned_sequences(cu_seqlens, t, c)
  num_chunks = layout.num_chunks
  to_aligned = lambda x: layout.to_layout(x.astype(jnp.float32))  # noqa: E731
  q, k, v, beta = (to_aligned(x) for x in (q, k, v, beta))
  decay = None if decay is None else to_aligned(decay)
  terms, _ = prepare(q, k, v, beta, decay, None, scale=scale, chunk_size=c)
  s0 = jnp.zeros((n, h, d, e), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
  s0 = manual_axes.vary_like(s0, terms.w)
  index = jnp.arange(num_chunks, dtype=jnp.int32)
  chunk_seq = jnp.minimum(chunk_common.count_at_most(layout.end, num_chunks), n - 1)
  # Chunks past the last sequence's are all zero rows: they open and close nothing and change no state.
  opens = (index == layout.first[chunk_seq]) & (index < layout.end[-1])
  closes = (index == layout.end[chunk_seq] - 1) & (index < layout.end[-1])

  # The carry holds each sequence's final state, written (a dynamic slice: its transpose is one too, where a gather
  # over chunks would be a scatter) when its last chunk closes it; an empty sequence's stays its initial state.
  def step(carry, xs):  # state [1, H, D, E]: the state after the previous chunk
    state, finals = carry
    terms_n, opens_n, closes_n, seq_n = xs
    state = jnp.where(opens_n, jax.lax.dynamic_index_in_dim(s0, seq_n), state)
    after = chunk.next_state(terms_n, state)
    if with_final_state:
      finals = jax.lax.dynamic_update_index_in_dim(
          finals, jnp.where(closes_n, after, jax.lax.dynamic_index_in_dim(finals, seq_n)), seq_n, 0)
    return (after, finals), state

  serial = chunk.ChunkTerms(*(jnp.moveaxis(x, 2, 0) for x in terms))
  state = manual_axes.vary_like(jnp.zeros((1, h, d, e), jnp.float32), terms.w)
  (_, finals), states = jax.lax.scan(step, (state, s0 if with_final_state else None),
                                     (serial, opens, closes, chunk_seq))
  states = jnp.moveaxis(states, 0, 2)  # [1, H, P, D, E]: the state before each chunk
  o = layout.from_layout(from_chunks(chunk.chunk_outputs(terms, states), num_chunks * c))
  return o, finals
