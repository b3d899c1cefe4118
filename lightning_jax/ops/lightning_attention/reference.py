"""Pure-jnp oracles for Lightning Attention.

Both compute, in float32 whatever the input dtype, the causal recurrence

    S_t = exp(-decay_h) * S_{t-1} + k_t^T v_t,      S_0 = initial_state
    o_t = scale * q_t S_t

for q, k: [B, T, H, D], v: [B, T, H, E], decay: [H] or None, state [B, H, D, E].
They are the oracles of the test-suite: simple, slow and obviously right.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _decay_rates(decay, num_heads):
  if decay is None:
    return jnp.zeros((num_heads,), jnp.float32)
  return decay.astype(jnp.float32)


def lightning_attention_recurrent(q, k, v, decay=None, *, scale, initial_state=None):
  """Token-serial recurrence with `lax.scan`. Returns (o [B,T,H,E] float32, S_T [B,H,D,E])."""
  b, _, h, d = q.shape
  e = v.shape[-1]
  lam = _decay_rates(decay, h)
  a = jnp.exp(-lam)[None, :, None, None]
  s0 = (jnp.zeros((b, h, d, e), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))

  def step(state, qkv):
    q_t, k_t, v_t = qkv  # [B, H, D], [B, H, D], [B, H, E]
    state = a * state + k_t[..., :, None] * v_t[..., None, :]
    o_t = scale * jnp.einsum("bhd,bhde->bhe", q_t, state,
                             precision=jax.lax.Precision.HIGHEST)
    return state, o_t

  xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v))
  final_state, o = jax.lax.scan(step, s0, xs)
  return jnp.moveaxis(o, 0, 1), final_state


def lightning_attention_quadratic(q, k, v, decay=None, *, scale, initial_state=None):
  """Masked quadratic ("attention") form. Returns (o [B,T,H,E] float32, S_T [B,H,D,E])."""
  b, t, h, d = q.shape
  e = v.shape[-1]
  hi = jax.lax.Precision.HIGHEST
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  lam = _decay_rates(decay, h)
  pos = jnp.arange(t, dtype=jnp.float32)
  gap = pos[:, None] - pos[None, :]  # i - j
  causal = gap >= 0
  # Clamp the exponent outside the mask so that exp never overflows (and autodiff
  # of the oracle never meets inf * 0).
  weights = jnp.where(causal[None], jnp.exp(-lam[:, None, None] * jnp.where(causal, gap, 0.0)[None]), 0.0)
  scores = jnp.einsum("bihd,bjhd->bhij", q, k, precision=hi) * weights[None]
  o = jnp.einsum("bhij,bjhe->bihe", scores, v, precision=hi)
  key_decay = jnp.exp(-lam[None, :] * (t - 1 - pos)[:, None])  # [T, H]
  final_state = jnp.einsum("bjhd,bjhe,jh->bhde", k, v, key_decay, precision=hi)
  if initial_state is not None:
    s0 = initial_state.astype(jnp.float32)
    row_decay = jnp.exp(-lam[None, :] * (pos + 1)[:, None])  # [T, H]
    o = o + jnp.einsum("bihd,bhde,ih->bihe", q, s0, row_decay, precision=hi)
    final_state = final_state + jnp.exp(-lam * t)[None, :, None, None] * s0
  return scale * o, final_state
