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

from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import manual_axes

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

  xs = (q, k, v, beta, alpha)
  if cu_seqlens is None:
    starts = jnp.zeros((b, t), bool) if segment_ids is None else chunk_common.segment_starts(segment_ids)
    s0 = jnp.zeros((b, h, d, e), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    s0 = manual_axes.vary_like(s0, q, k, v)

    def step(state, xs_t):
      *inputs, start_t = xs_t
      return update(jnp.where(start_t[:, None, None, None], 0.0, state), *inputs)

    final_state, o = jax.lax.scan(step, s0, tuple(jnp.moveaxis(x, 1, 0) for x in (*xs, starts)))
    return jnp.moveaxis(o, 0, 1), final_state

  cu = jnp.asarray(cu_seqlens, jnp.int32)
  n = cu.shape[0] - 1
  s0 = jnp.zeros((n, h, d, e), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
  s0 = manual_axes.vary_like(s0, q, k, v)
  pos = jnp.arange(t, dtype=jnp.int32)
  seq = jnp.searchsorted(cu[1:], pos, side="right").astype(jnp.int32)
  is_start, is_end = pos == cu[seq], pos == cu[seq + 1] - 1

  def varlen_step(carry, xs_t):
    state, finals = carry  # [H, D, E], [N, H, D, E]
    seq_t, start_t, end_t, *inputs = xs_t
    state, o_t = update(jnp.where(start_t, s0[seq_t], state), *inputs)
    return (state, finals.at[seq_t].set(jnp.where(end_t, state, finals[seq_t]))), o_t

  # Empty sequences see no token: their final state stays their initial one.
  (_, finals), o = jax.lax.scan(varlen_step, (s0[0], s0), (seq, is_start, is_end, *(x[0] for x in xs)))
  return o[None], finals
