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
  b, t, h, d = q.shape
  n = -(-t // chunk_size)
  rates = None
  if decay is not None:
    rates = to_chunks(decay, n, chunk_size).reshape(b, h, n * chunk_size, *decay.shape[3:])
  starts = None if segment_starts is None else jnp.pad(segment_starts, ((0, 0), (0, n * chunk_size - t)))
  g, runs = chunk.chunk_gates(rates, starts, chunk_size=chunk_size)
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


