"""Sequence parallelism for the delta rule: T split over a mesh axis inside `jax.shard_map`.

The delta rule is affine in its state: after token t of a slice the state is
M_t S + L_t for the state S before the slice, with M_t [D, D] the product of
the slice's transitions (I - beta_t k_t k_t^T) Diag(a_t) so far (0 once a
segment starts inside the slice) and L_t [D, E] the state from zeros; the
output o_t = scale S_t^T q_t is then scale L_t^T q_t + S^T (scale M_t^T q_t).
Device p of the P devices along the axis

  1. runs the op over its slice once, with the values [0 | v] ([.., D + E])
     from the state [I | 0] (the first D columns carry I through the
     transitions and receive no update, the others are v's state): its
     outputs are [q~ | o~] = [scale M_t^T q_t | scale L_t^T q_t] and its final
     state is the slice's map [M_p | L_p] (two passes, [0] from I and v from
     zeros, where D + E exceeds the op's largest E);
  2. all-gathers every device's [M | L] (float32 [B, H, D, D + E]) with each
     slice's first and last segment ids;
  3. composes P_0 = S_0, P_{p+1} = M_p P_p + L_p over the slices, locally (the
     same on every device), with P_p = 0 where slice p's first token starts a
     segment of its own;
  4. takes o = o~ + q~ P_p (a [T_p, D] x [D, E] product per head).

Only the maps cross devices, never q, k, v or o. The backward pass is JAX's:
the op's own VJP for step 1, the all-gather's transpose (a reduce-scatter of
the maps' cotangents), the composition's and the product's. The op runs with
D more value columns than alone, forward and backward: the price of
exactness without a reverse pass of maps of our own (the lightning op's
`sequence_parallel` has one: its maps are scalars). q~ and o~ come out in
the inputs' dtype, so with 16-bit inputs o carries two roundings of that
dtype instead of one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import sequence_parallel as lightning_sequence_parallel

_HI = jax.lax.Precision.HIGHEST


def prefix_states(maps, continues, initial_state, dim_k):
  """(the state before each slice [P, B, H, D, E], the state after the last [B, H, D, E]), float32.

  maps: [P, B, H, D, D + E], each slice's [M | L]; continues: [B, P] bool,
  whether slice p's first token continues the segment before it (else its
  state before is zeros); initial_state: [B, H, D, E] float32 or None.
  """
  m, local = maps[..., :dim_k], maps[..., dim_k:]
  state = jnp.zeros(local.shape[1:], jnp.float32) if initial_state is None else initial_state

  def step(state, slice_):
    m_p, local_p, continues_p = slice_
    before = jnp.where(continues_p[:, None, None, None], state, 0.0)
    return jnp.einsum("bhij,bhje->bhie", m_p, before, precision=_HI) + local_p, before

  # Unrolled: P is small and static, and XLA's while loop copied the carried [P, B, H, D, E] buffers (an H200, B2 H8
  # T32K D64 in 8 pieces: 42 us of copies in a 0.94 ms fwd+bwd).
  final, before = jax.lax.scan(step, state, (m, local, continues.T), unroll=True)
  return before, final


def end_cotangents(transitions, start_cotangents, continues, d_final):
  """The cotangent of the state after each slice, [P, B, H, D, E] float32: `prefix_states`' scan run backwards.

  transitions: [P, B, H, D, D], each slice's M; start_cotangents: [P, B, H, D,
  E], dL/dS_start of each slice through its own outputs alone (a zero
  cotangent at its end); continues: as in `prefix_states`; d_final: [B, H, D,
  E] float32 or None (zeros). After slice p - 1 the cotangent is that of slice
  p's start, M_p^T dS_end(p) + its own, where slice p continues it, else 0.
  """
  d_end = jnp.zeros(start_cotangents.shape[1:], jnp.float32) if d_final is None else d_final

  def step(d_end, slice_):
    m_p, own_p, continues_p = slice_
    d_start = jnp.einsum("bhij,bhie->bhje", m_p, d_end, precision=_HI) + own_p
    return jnp.where(continues_p[:, None, None, None], d_start, 0.0), d_end

  # As above.
  _, ends = jax.lax.scan(step, d_end, (transitions, start_cotangents, continues.T), reverse=True, unroll=True)
  return ends


def affine_maps(run, v, *, dim_k, max_value_dim):
  """Run a slice from [I | 0] over the values [0 | v]: ((scale M_t^T q_t, scale L_t^T q_t) outputs, [M | L]).

  run(values [B, T, H, E'], initial_state [B, H, D, E'] float32) -> (outputs
  [B, T, H, E'], final state [B, H, D, E'] float32): the op on one slice; v
  [B, T, H, E]. Where D + E exceeds `max_value_dim` (the largest E `run`
  takes) it runs twice, [0] from I and v from zeros. Returns (carried q [B, T,
  H, D], local o [B, T, H, E], maps [B, H, D, D + E] float32); the outputs
  None where `run` returns None for them (a map alone).
  """
  b, _, h, e = v.shape
  no_values = jnp.zeros((*v.shape[:-1], dim_k), v.dtype)
  identity = jnp.broadcast_to(jnp.eye(dim_k, dtype=jnp.float32), (b, h, dim_k, dim_k))
  if dim_k + e <= max_value_dim:
    outputs, maps = run(jnp.concatenate([no_values, v], axis=-1),
                        jnp.concatenate([identity, jnp.zeros((b, h, dim_k, e), jnp.float32)], axis=-1))
    return (None, None, maps) if outputs is None else (outputs[..., :dim_k], outputs[..., dim_k:], maps)
  (carried_q, transitions), (local_o, local_states) = run(no_values, identity), run(v, None)
  return carried_q, local_o, jnp.concatenate([transitions, local_states], axis=-1)


def sequence_parallel(run, q, k, v, beta, decay, initial_state, segment_ids, *, axis, max_value_dim):
  """The delta op over this device's slice of T, from the state of the slices before it (module docstring).

  run(q, k, v, beta, decay, initial_state, segment_ids) -> (o, final state):
  the op on one device's slice (inside `jax.shard_map`). q, k: [B, T_p, H, D],
  v: [B, T_p, H, E], beta, decay, segment_ids: this device's slice;
  initial_state: the state before the whole sequence ([B, H, D, E] float32) or
  None; max_value_dim: the largest E `run` takes. Returns (o [B, T_p, H, E],
  the final state after the whole sequence [B, H, D, E] float32, the same on
  every device of `axis`).
  """
  b, d = q.shape[0], q.shape[-1]
  carried_q, local_o, maps = affine_maps(lambda values, state: run(q, k, values, beta, decay, state, segment_ids), v,
                                         dim_k=d, max_value_dim=max_value_dim)
  starts = None if segment_ids is None else chunk_common.segment_starts(segment_ids)
  maps, links = lightning_sequence_parallel.links(axis, None, segment_ids, starts, maps)
  continues = jnp.ones((b, maps.shape[0]), bool) if links.continues is None else links.continues
  before, final = prefix_states(maps, continues, initial_state, d)
  from_before = jnp.einsum("bthi,bhie->bthe", carried_q.astype(jnp.float32), before[jax.lax.axis_index(axis)],
                           precision=_HI)
  return (local_o.astype(jnp.float32) + from_before).astype(local_o.dtype), final
