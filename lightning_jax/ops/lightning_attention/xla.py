"""Chunked O(T) Lightning Attention in plain jnp (`impl="xla"`).

The fallback on CPU and TPU. It runs the same chunk algebra as the kernels
(`chunk_common`), vectorised over chunks, with a `lax.scan` over chunk states, and
is differentiated by JAX autodiff. Everything is computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import manual_axes

_HI = jax.lax.Precision.HIGHEST


def _factors(decay, starts, *, batch, heads, seq_len, chunk_size):
  """(row [B', N, C, H], key [B', N, C, H], state [N, B', H], intra [B', N, H, C, C]); B' = 1 for per-head rates."""
  c = chunk_size
  n = -(-seq_len // c)
  if starts is None and (decay is None or decay.ndim == 1):
    lam2 = (jnp.zeros((heads,), jnp.float32) if decay is None
            else decay.astype(jnp.float32) * chunk_common.LOG2_E)
    per_chunk = jax.vmap(lambda lam, i: chunk_common.chunk_decay_factors(
        lam, chunk_common.valid_rows(i, chunk_size=c, seq_len=seq_len), chunk_size=c, reverse=False),
                         in_axes=(None, 0))
    f = jax.vmap(per_chunk, in_axes=(0, None))(lam2, jnp.arange(n, dtype=jnp.int32))  # [H, N, ...]
    expand = lambda x: x[None]  # noqa: E731
  else:
    rates = (jnp.zeros((batch, seq_len, 1), jnp.float32) if decay is None
             else jnp.broadcast_to(decay.astype(jnp.float32), (batch, seq_len, heads)))
    cumdecay, runs = chunk_common.token_chunk_gates(rates, starts, chunk_size=c, num_tokens=n * c, reverse=False)
    runs = jnp.broadcast_to(runs[:, None], cumdecay.shape)
    per_chunk = jax.vmap(lambda cd, r: chunk_common.token_decay_factors(cd, r, reverse=False))
    f = jax.vmap(jax.vmap(per_chunk))(cumdecay.reshape(*cumdecay.shape[:2], n, c),
                                      runs.reshape(*runs.shape[:2], n, c))  # [B', H', N, ...]
    expand = lambda x: x  # noqa: E731
  row, key = (jnp.moveaxis(expand(x), 1, 3) for x in (f.row, f.key))
  return row, key, jnp.moveaxis(expand(f.state), 2, 0), jnp.swapaxes(expand(f.intra), 1, 2)


def lightning_attention_chunked(q, k, v, decay=None, *, scale, initial_state=None, chunk_size=64, segment_ids=None):
  """Returns (o [B, T, H, E] float32, final_state [B, H, D, E] float32).

  decay: None, [H] or per-token [B, T, H] rates; segment_ids: None or [B, T]
  (the state restarts where the id changes; initial_state feeds each row's
  first segment and the final state is each row's last).
  """
  b, t, h, d = q.shape
  e = v.shape[-1]
  c = chunk_size
  n = -(-t // c)
  pad = n * c - t
  q, k, v = (jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, c, h, -1)
             for x in (q, k, v))
  starts = None if segment_ids is None else chunk_common.segment_starts(segment_ids)
  row, key, state_decay, intra = _factors(decay, starts, batch=b, heads=h, seq_len=t, chunk_size=c)

  chunk_kv = jnp.einsum("bnchd,bnche->nbhde", k, v * key[..., None], precision=_HI)
  s0 = (jnp.zeros((b, h, d, e), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  s0 = manual_axes.vary_like(s0, chunk_kv)  # inside shard_map, the carry varies like the inputs

  def step(s, xs):
    kv, dec = xs  # [B, H, D, E], [B', H]
    return dec[..., None, None] * s + kv, s

  final_state, states_before = jax.lax.scan(step, s0, (chunk_kv, state_decay))
  inter = jnp.einsum("bnchd,nbhde->bnche", q, states_before, precision=_HI) * row[..., None]
  scores = jnp.einsum("bnihd,bnjhd->bnhij", q, k, precision=_HI) * intra
  o = inter + jnp.einsum("bnhij,bnjhe->bnihe", scores, v, precision=_HI)
  o = scale * o.reshape(b, n * c, h, e)[:, :t]
  return o, final_state
