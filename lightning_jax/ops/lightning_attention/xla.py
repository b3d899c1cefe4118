"""Chunked O(T) Lightning Attention in plain jnp (`impl="xla"`).

The fallback on CPU and TPU. It runs the same chunk algebra as the kernels
(`chunk_common`), vectorised over chunks, with a `lax.scan` over chunk states, and
is differentiated by JAX autodiff. Everything is computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lightning_jax.ops.lightning_attention import chunk_common

_HI = jax.lax.Precision.HIGHEST


def lightning_attention_chunked(q, k, v, decay=None, *, scale, initial_state=None, chunk_size=64):
  """Returns (o [B, T, H, E] float32, final_state [B, H, D, E] float32)."""
  b, t, h, d = q.shape
  e = v.shape[-1]
  c = chunk_size
  n = -(-t // c)
  pad = n * c - t
  q, k, v = (jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, c, h, -1)
             for x in (q, k, v))
  lam2 = (jnp.zeros((h,), jnp.float32) if decay is None
          else decay.astype(jnp.float32) * chunk_common.LOG2_E)
  factors = jax.vmap(  # over heads
      jax.vmap(lambda l, i: chunk_common.chunk_decay_factors(
          l, chunk_common.valid_rows(i, chunk_size=c, seq_len=t), chunk_size=c, reverse=False),
               in_axes=(None, 0)),  # over chunks
      in_axes=(0, None))
  f = factors(lam2, jnp.arange(n, dtype=jnp.int32))
  row, key, state_decay, intra = f.row, f.key, f.state, f.intra  # [H,N,C] [H,N,C] [H,N] [H,N,C,C]

  chunk_kv = jnp.einsum("bnchd,hnc,bnche->nbhde", k, key, v, precision=_HI)
  s0 = (jnp.zeros((b, h, d, e), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))

  def step(s, xs):
    kv, dec = xs  # [B,H,D,E], [H]
    return dec[None, :, None, None] * s + kv, s

  final_state, states_before = jax.lax.scan(step, s0, (chunk_kv, jnp.moveaxis(state_decay, 1, 0)))
  inter = jnp.einsum("bnchd,nbhde,hnc->bnche", q, states_before, row, precision=_HI)
  scores = jnp.einsum("bnihd,bnjhd,hnij->bnhij", q, k, intra, precision=_HI)
  o = inter + jnp.einsum("bnhij,bnjhe->bnihe", scores, v, precision=_HI)
  o = scale * o.reshape(b, n * c, h, e)[:, :t]
  return o, final_state
