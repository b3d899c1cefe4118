"""Packed sequences given as `cu_seqlens`: segment ids, and each sequence's own initial and final state.

The kernels run a `cu_seqlens` call as the segments of one row, every segment
from a zero state. Each sequence's initial state S0_n is linear in what it adds,
so it is added here, with each sequence's final state, in O((T + N C) D E)
work on (chunk, sequence) pairs: with F_t the rates of t's sequence summed
from its start through t, and R_j those after j through the sequence's end,

    o_t      += scale * exp(-F_t) q_t S0_n                      (t in sequence n)
    S_end,n   = exp(-F_end) S0_n + sum_{j in n} exp(-R_j) k_j^T v_j.

A pair is the tokens of one chunk of `PAIR_CHUNK` that belong to one sequence:
there are at most T / PAIR_CHUNK + N of them, so the work does not grow with
N T, and every boundary stays a traced value.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lightning_jax.ops.lightning_attention import chunk_common

PAIR_CHUNK = 256
_HI = jax.lax.Precision.HIGHEST


def segment_ids_from_cu_seqlens(cu_seqlens, total_length: int):
  """int32 [1, total_length]: the index of the sequence each token belongs to.

  `cu_seqlens` is int [N + 1], the cumulative lengths of N sequences packed in
  one row (flash-linear-attention's convention; empty sequences allowed), and
  may be traced. The result is the `segment_ids` of the same packing.
  """
  cu = jnp.asarray(cu_seqlens)
  if cu.ndim != 1 or cu.shape[0] < 2 or not jnp.issubdtype(cu.dtype, jnp.integer):
    raise ValueError(f"cu_seqlens must be an int [N + 1] array with N >= 1, got {cu.dtype} {cu.shape}")
  pos = jnp.arange(total_length, dtype=jnp.int32)
  return jnp.searchsorted(cu[1:].astype(jnp.int32), pos, side="right").astype(jnp.int32)[None]


def sequence_states(q, k, v, decay, cu_seqlens, *, scale, initial_state, with_final_state, tensor_cores=False):
  """Each sequence's initial state's share of the outputs, and each sequence's final state.

  Args:
    q, k: [1, T, H, D]; v: [1, T, H, E].
    decay: None, [H] or [1, T, H] float32 rates.
    cu_seqlens: int [N + 1].
    initial_state: [N, H, D, E] float32 or None.
    with_final_state: compute the final states.
    tensor_cores: the call runs on a GPU: 16-bit inputs' products in bfloat16
      with float32 sums (float32 inputs, and without it: float32 products).

  Returns:
    (o_extra [1, T, H, E] float32 or None without initial states, final
    states [N, H, D, E] float32 or None).
  """
  _, t, h, d = q.shape
  e = v.shape[-1]
  cu = cu_seqlens.astype(jnp.int32)
  n = cu.shape[0] - 1
  c = min(PAIR_CHUNK, -(-t // 16) * 16)
  nc = -(-t // c)
  tp = nc * c
  pos = jnp.arange(tp, dtype=jnp.int32)
  seq = jnp.minimum(jnp.searchsorted(cu[1:], pos, side="right"), n - 1).astype(jnp.int32)  # padding: the last
  chunk = pos // c
  pair = chunk + seq  # both non-decreasing along T: one label per (chunk, sequence) pair
  num_pairs = nc + n - 1
  pair_chunk = jnp.clip(jax.ops.segment_max(chunk, pair, num_pairs), 0, nc - 1)
  pair_seq = jnp.clip(jax.ops.segment_max(seq, pair, num_pairs), 0, n - 1)
  # [P, C, 1]: 1 where row c of pair p's chunk belongs to pair p.
  in_pair = jnp.where(pair.reshape(nc, c)[pair_chunk] == jnp.arange(num_pairs)[:, None], 1.0, 0.0)[..., None]

  rates = jnp.zeros((t, h), jnp.float32) if decay is None else jnp.broadcast_to(decay, (1, t, h))[0]
  rates = jnp.pad(rates.astype(jnp.float32), ((0, tp - t), (0, 0)))
  first, last = pos == cu[seq], pos == cu[seq + 1] - 1
  by_pair = lambda x: x.reshape(nc, c, *x.shape[1:])[pair_chunk]  # noqa: E731  [P, C, ...]
  # With tensor_cores, 16-bit inputs' products take bfloat16 operands (the states and the scaled keys rounded to it
  # once, as the kernels' own products take them) and float32 sums; else float32 products (XLA's CPU backend runs
  # no bfloat16 product with float32 results in every layout).
  operand = jnp.bfloat16 if tensor_cores and q.dtype != jnp.float32 else jnp.float32
  product = functools.partial(jnp.einsum, preferred_element_type=jnp.float32,
                              precision=_HI if operand == jnp.float32 else None)
  pad = lambda x: jnp.pad(x[0].astype(operand), ((0, tp - t), (0, 0), (0, 0)))  # noqa: E731

  o_extra = final_states = None
  if initial_state is not None:
    from_start = segmented_exp(rates, first, reverse=False)  # exp(-F_t)
    weights = in_pair * by_pair(from_start)  # [P, C, H]: a row's factor, applied to its product
    o_pairs = weights[..., None] * product("pchd,phde->pche", by_pair(pad(q)),
                                           initial_state.astype(operand)[pair_seq])
    o_extra = scale * jax.ops.segment_sum(o_pairs, pair_chunk, nc).reshape(tp, h, e)[None, :t]
  if with_final_state:
    # R_j: the rates after j, so the token after j's rate, summed backwards within the sequence.
    after = jnp.where(last[:, None], 0.0, jnp.pad(rates[1:], ((0, 1), (0, 0))))
    to_end = segmented_exp(after, last, reverse=True)  # exp(-R_j)
    weights = in_pair * by_pair(to_end)
    partial = product("pchd,pche->phde", (by_pair(pad(k)) * weights[..., None]).astype(operand), by_pair(pad(v)))
    final_states = jax.ops.segment_sum(partial, pair_seq, n)
    if initial_state is not None:
      total = jax.ops.segment_sum(jnp.where(pos[:, None] < t, rates, 0.0), seq, n)  # [N, H]; empty: 0
      final_states = final_states + jnp.exp(-total)[..., None, None] * initial_state
  return o_extra, final_states


def segmented_exp(rates, starts, *, reverse):
  """exp(-x) of the segmented inclusive sums x of `rates` [T, H] (restarting where `starts` [T] is True)."""
  return jnp.exp(-chunk_common.segmented_cumsum(rates, starts, axis=0, reverse=reverse))
