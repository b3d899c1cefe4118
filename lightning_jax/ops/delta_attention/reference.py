"""Token-serial oracle for delta attention (DeltaNet, Gated DeltaNet, Kimi Delta Attention).

Per batch and head, with the state S [D, E] in float32 and a_t = exp(-decay_t)
(1 without decay; one rate per token for Gated DeltaNet, one per token and key
channel for KDA):

    S_t = (I - beta_t k_t k_t^T) Diag(a_t) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

It is the oracle of the test-suite: simple, slow and obviously right.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lightning_jax.ops.lightning_attention import reference as lightning_reference

_HI = jax.lax.Precision.HIGHEST


def key_channel_rates(decay, shape):
  """Rates as [B, T, H, D] float32 (zeros without decay; a [B, T, H] rate is shared by the key channels)."""
  if decay is None:
    return jnp.zeros(shape, jnp.float32)
  decay = decay.astype(jnp.float32)
  return jnp.broadcast_to(decay[..., None] if decay.ndim == 3 else decay, shape)


def delta_attention_recurrent(q, k, v, beta, decay=None, *, scale, initial_state=None, segment_ids=None,
                              cu_seqlens=None):
  """The recurrence with `lax.scan`. Returns (o [B, T, H, E] float32, final state float32).

  q, k: [B, T, H, D]; v: [B, T, H, E]; beta: [B, T, H]; decay: None, [B, T, H]
  or [B, T, H, D] rates >= 0.
  segment_ids: None or [B, T]; the state restarts from zeros where the id
    changes (initial_state [B, H, D, E] feeds each row's first segment; the
    final state is the end of each row's last, [B, H, D, E]).
  cu_seqlens: None or [N + 1] cumulative lengths of N sequences packed in a
    batch of one; each starts from its own initial_state [N, H, D, E] (zeros
    if None) and the final state is each one's last, [N, H, D, E] (an empty
    sequence's is its initial state).
  """
  b, t, h, d = q.shape
  e = v.shape[-1]
  alpha = jnp.exp(-key_channel_rates(decay, (b, t, h, d)))
  q, k, v, beta = (x.astype(jnp.float32) for x in (q, k, v, beta))

  def update(state, q_t, k_t, v_t, beta_t, a_t):  # [..., D, E]; [..., D] x2, [..., E], [...], [..., D]
    state = a_t[..., None] * state
    residual = v_t - jnp.einsum("...d,...de->...e", k_t, state, precision=_HI)
    state = state + (beta_t[..., None] * k_t)[..., :, None] * residual[..., None, :]
    return state, scale * jnp.einsum("...d,...de->...e", q_t, state, precision=_HI)

  return lightning_reference.scan_tokens(update, (q, k, v, beta, alpha), initial_state, state_shape=(h, d, e),
                                         segment_ids=segment_ids, cu_seqlens=cu_seqlens)
