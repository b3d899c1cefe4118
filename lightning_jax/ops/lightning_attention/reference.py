"""Pure-jnp oracles for Lightning Attention.

Both compute, in float32 whatever the input dtype, the causal recurrence

    S_t = exp(-decay) * S_{t-1} + k_t^T v_t,      S_0 = initial_state
    o_t = scale * q_t S_t

for q, k: [B, T, H, D], v: [B, T, H, E], state [B, H, D, E]. The recurrence
also takes per-token rates and packed sequences; the quadratic form, per-head
rates [H] only.
They are the oracles of the test-suite: simple, slow and obviously right.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import manual_axes


def _decay_rates(decay, num_heads):
  if decay is None:
    return jnp.zeros((num_heads,), jnp.float32)
  if decay.ndim != 1:
    raise ValueError("the quadratic form takes per-head rates [H] only")
  return decay.astype(jnp.float32)


def lightning_attention_recurrent(q, k, v, decay=None, *, scale, initial_state=None, segment_ids=None,
                                  cu_seqlens=None):
  """Token-serial recurrence with `lax.scan`. Returns (o [B,T,H,E] float32, final state float32).

  decay: None, [H] or per-token [B, T, H] rates, S_t = exp(-decay_t) S_{t-1} + k_t^T v_t.
  segment_ids: [B, T] ints; the state restarts from zeros where the id changes
    (initial_state [B, H, D, E] feeds each row's first segment; the final state
    is each row's last, [B, H, D, E]).
  cu_seqlens: [N + 1] cumulative lengths of N sequences packed in a batch of
    one; each starts from its own initial_state [N, H, D, E] (zeros if None)
    and the final state is each one's last, [N, H, D, E] (an empty sequence's
    is its initial state).
  """
  b, t, h, d = q.shape
  e = v.shape[-1]
  rates = jnp.zeros((h,), jnp.float32) if decay is None else decay.astype(jnp.float32)
  a = jnp.exp(-jnp.broadcast_to(rates, (b, t, h)))
  qkv = tuple(x.astype(jnp.float32) for x in (q, k, v))

  def update(state, q_t, k_t, v_t, a_t):  # state [..., D, E]; q_t, k_t [..., D]; v_t [..., E]; a_t [...]
    state = a_t[..., None, None] * state + k_t[..., :, None] * v_t[..., None, :]
    return state, scale * jnp.einsum("...d,...de->...e", q_t, state, precision=jax.lax.Precision.HIGHEST)

  return scan_tokens(update, (*qkv, a), initial_state, state_shape=(h, d, e), segment_ids=segment_ids,
                     cu_seqlens=cu_seqlens)


def scan_tokens(update, inputs, initial_state, *, state_shape, segment_ids=None, cu_seqlens=None):
  """A token-serial recurrence over packed rows, with `lax.scan`: the driver of every oracle.

  update(state [..., *state_shape], *inputs at one token [..., ...]) -> (new
  state, output at that token). inputs: float32 [B, T, ...] arrays. Packing
  as in `lightning_attention_recurrent`: with segment_ids the state restarts
  from zeros at every id change (initial_state [B, *state_shape] feeds each
  row's first segment); with cu_seqlens each sequence starts from its own
  initial_state [N, *state_shape] (zeros if None). Returns (outputs [B, T,
  ...], final state: each row's, or with cu_seqlens each sequence's, [N,
  *state_shape], an empty sequence's being its initial state).
  """
  b, t = inputs[0].shape[:2]
  lead = (b,) if cu_seqlens is None else (cu_seqlens.shape[0] - 1,)
  s0 = (jnp.zeros(lead + state_shape, jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  s0 = manual_axes.vary_like(s0, *inputs)  # inside shard_map, the carry varies like the inputs
  if cu_seqlens is None:
    starts = jnp.zeros((b, t), bool) if segment_ids is None else chunk_common.segment_starts(segment_ids)

    def step(state, xs):
      *inputs_t, start_t = xs
      state = jnp.where(start_t.reshape(-1, *(1,) * len(state_shape)), 0.0, state)
      return update(state, *inputs_t)

    final_state, o = jax.lax.scan(step, s0, tuple(jnp.moveaxis(x, 1, 0) for x in (*inputs, starts)))
    return jnp.moveaxis(o, 0, 1), final_state

  cu = jnp.asarray(cu_seqlens, jnp.int32)
  pos = jnp.arange(t, dtype=jnp.int32)
  seq = jnp.searchsorted(cu[1:], pos, side="right").astype(jnp.int32)
  is_start, is_end = pos == cu[seq], pos == cu[seq + 1] - 1

  def varlen_step(carry, xs):
    state, finals = carry  # [*state_shape], [N, *state_shape]
    seq_t, start_t, end_t, *inputs_t = xs
    state, o_t = update(jnp.where(start_t, s0[seq_t], state), *inputs_t)
    return (state, finals.at[seq_t].set(jnp.where(end_t, state, finals[seq_t]))), o_t

  # Empty sequences see no token: their final state stays their initial one.
  (_, finals), o = jax.lax.scan(varlen_step, (s0[0], s0), (seq, is_start, is_end, *(x[0] for x in inputs)))
  return o[None], finals


def lightning_attention_quadratic(q, k, v, decay=None, *, scale, initial_state=None):
  """Masked quadratic ("attention") form. Returns (o [B,T,H,E] float32, S_T [B,H,D,E])."""
  b, t, h, d = q.shape
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
