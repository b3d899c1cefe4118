"""Packed sequences given as `cu_seqlens`: segment ids, the pieces of a sequence split, and each sequence's own
initial and final state on the chunked jnp path.

The chunked jnp path runs a `cu_seqlens` call as the segments of one row,
every segment from a zero state (the Pallas path runs per-sequence states in
its kernels: `SequencePieces`). Each sequence's initial state S0_n is linear in
what it adds, so `sequence_states` adds it, with each sequence's final state,
in O((T + N C) D E) work on (chunk, sequence) pairs: with F_t the rates of t's sequence summed
from its start through t, and R_j those after j through the sequence's end,

    o_t      += scale * exp(-F_t) q_t S0_n                      (t in sequence n)
    S_end,n   = exp(-F_end) S0_n + sum_{j in n} exp(-R_j) k_j^T v_j.

A pair is the tokens of one chunk of `PAIR_CHUNK` that belong to one sequence:
there are at most T / PAIR_CHUNK + N of them, so the work does not grow with
N T, and every boundary stays a traced value.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lightning_jax.ops.lightning_attention import chunk_common

PAIR_CHUNK = 256
_HI = jax.lax.Precision.HIGHEST
# Most pieces a sequence split cuts sequences into (`SequencePieces`): their combine is O(pieces^2) states.
MAX_PIECES = 64


def segment_ids_from_cu_seqlens(cu_seqlens, total_length: int):
  """int32 [1, total_length]: the index of the sequence each token belongs to.

  `cu_seqlens` is int [N + 1], the cumulative lengths of N sequences packed in
  one row (flash-linear-attention's convention; empty sequences allowed), and
  may be traced. The result is the `segment_ids` of the same packing.
  """
  cu = jnp.asarray(cu_seqlens)
  if cu.ndim != 1 or cu.shape[0] < 2 or not jnp.issubdtype(cu.dtype, jnp.integer):
    raise ValueError(f"cu_seqlens must be an int [N + 1] array with N >= 1, got {cu.dtype} {cu.shape}")
  return chunk_common.count_at_most(cu[1:].astype(jnp.int32), total_length)[None]


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
  seq = jnp.minimum(chunk_common.count_at_most(cu[1:], tp), n - 1)  # padding: the last
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


def sequence_starts(cu_seqlens, num_tokens: int):
  """[T] bool: token t is the first of a (non-empty) sequence of `cu_seqlens` [N + 1] (token 0 included)."""
  return jnp.zeros(num_tokens, bool).at[cu_seqlens[:-1]].set(True, mode="drop")


def without_next_rates(rates, cu_seqlens):
  """[.., T, ...] rates (T the axis after the batch's) with a sequence's first token's rate 0: a reverse sweep,
  whose token takes the next one's rate, then gives each sequence's last token none."""
  starts = sequence_starts(cu_seqlens, rates.shape[1])
  return jnp.where(starts.reshape((1, -1) + (1,) * (rates.ndim - 2)), 0.0, rates)


class SequencePieces(NamedTuple):
  """Sequences cut at the boundaries of a sequence split's slices: the Pallas path's sequence programs.

  Piece p is tokens bounds[p]:bounds[p + 1] of one sequence and one slice, in
  token order (P = N + S - 1 for N sequences and S slices; a piece is empty
  where none such exists). Every field is traced but the counts.
  """
  bounds: jax.Array  # [P + 1] int32
  sequence: jax.Array  # [P] int32, the sequence of a non-empty piece
  starts: jax.Array  # [P] bool, a non-empty piece holding its sequence's first token
  ends: jax.Array  # [P] bool, ... its last token
  first: jax.Array  # [N] int32, the piece of each sequence's first token (any, for an empty sequence)
  last: jax.Array  # [N] int32, ... of its last token
  label: jax.Array  # [T] int32, each token's piece


def sequence_pieces(cu_seqlens, *, seq_len: int, slice_tokens: int) -> SequencePieces:
  """The pieces of sequences `cu_seqlens` ([N + 1], ending at seq_len) cut at every multiple of slice_tokens."""
  cu = cu_seqlens.astype(jnp.int32)
  n = cu.shape[0] - 1
  num_pieces = n + -(-seq_len // slice_tokens) - 1
  pos = jnp.arange(seq_len, dtype=jnp.int32)
  seq = chunk_common.count_at_most(cu[1:], seq_len)
  label = pos // slice_tokens + seq  # non-decreasing, up by one or more at each cut: one label per piece
  # bounds[p]: the tokens of labels below p.
  bounds = jnp.pad(chunk_common.count_at_most(label, num_pieces), (1, 0))
  lo, hi = bounds[:-1], bounds[1:]
  sequence = seq[jnp.minimum(lo, seq_len - 1)]
  at = lambda i: label[jnp.clip(i, 0, seq_len - 1)]  # noqa: E731
  return SequencePieces(bounds, sequence, (hi > lo) & (lo == cu[sequence]), (hi > lo) & (hi == cu[sequence + 1]),
                        at(cu[:-1]), at(cu[1:] - 1), label)


def piece_rates(rates, pieces: SequencePieces, *, reverse: bool):
  """Each piece's summed rates [P, H] float32, in a sweep's convention (`chunk_common.token_chunk_gates`): a
  reverse sweep's token takes the next token's rate. rates: [1, T, H], for a reverse sweep as it takes them
  (`without_next_rates`: a sequence's last token takes none)."""
  rates = jnp.minimum(rates[0].astype(jnp.float32), chunk_common.MAX_LOG2_RATE / chunk_common.LOG2_E)
  if reverse:
    rates = jnp.pad(rates[1:], ((0, 1), (0, 0)))
  return jax.ops.segment_sum(rates, pieces.label, pieces.sequence.shape[0], indices_are_sorted=True)


def piece_starts(local_states, pieces: SequencePieces, rates, sequence_states, *, reverse: bool):
  """The state before each piece of a sweep over sequences: [P, H, K, V] float32.

  `local_states` [P, H, K, V]: each piece's state at its end (in sweep
  order) from zeros; rates: [1, T, H] per-token rates as `piece_rates` takes them, or None;
  sequence_states [N, H, K, V] or None (zeros): what each sequence's first
  piece in sweep order starts from (its initial state forward, its final
  state's cotangent in reverse). The pieces chain as the slices of a
  sequence split (`chunk_common.combine_slice_states`, in sweep order), but
  the piece before a sequence's first passes nothing on (a reset) and hands
  it the sequence's state as its own.
  """
  order = (lambda x: x[::-1]) if reverse else (lambda x: x)  # noqa: E731
  first = order(pieces.ends if reverse else pieces.starts)
  local = order(local_states.astype(jnp.float32))
  num_pieces = local.shape[0]
  given = (jnp.zeros_like(local) if sequence_states is None
           else order(sequence_states.astype(jnp.float32)[pieces.sequence]))
  resets = jnp.pad(first[1:], (0, 1))  # piece q hands on nothing when q + 1 starts a sequence
  local = jnp.where(resets[:, None, None, None], jnp.roll(given, -1, axis=0), local)
  slice_decay = None if rates is None else order(piece_rates(rates, pieces, reverse=reverse)).T[None]
  states, _ = chunk_common.combine_slice_states(
      jnp.moveaxis(local, 0, 1)[None], (0,) * num_pieces, initial_state=given[:1], slice_decay=slice_decay,
      slice_resets=resets[None])
  return order(jnp.moveaxis(states[0, :, :num_pieces], 1, 0))


def sequence_ends(piece_states, pieces: SequencePieces, sequence_states, *, reverse: bool):
  """Each sequence's state at its end in sweep order, [N, H, K, V]: its last piece's (forward; in reverse its first
  piece's) from `piece_states` [P, H, K, V], or for an empty sequence the state it started from
  (`sequence_states` [N, H, K, V] or None: zeros)."""
  index = pieces.first if reverse else pieces.last
  ends = piece_states[index]
  # An empty sequence's piece index names a piece of another sequence.
  nonempty = pieces.sequence[index] == jnp.arange(index.shape[0])
  start = jnp.zeros_like(ends) if sequence_states is None else sequence_states.astype(jnp.float32)
  return jnp.where(nonempty[:, None, None, None], ends, start)
