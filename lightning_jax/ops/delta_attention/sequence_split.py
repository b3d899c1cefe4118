"""The delta rule's sequence split on one device, for few (batch, head) pairs and long sequences.

The sweeps run one program per (batch, head, value block), each walking its
row's chunks in order: with few (batch, head) pairs most SMs idle while the
chains run. The split cuts every row into P pieces (`piece_length`: the row
reshaped where the kernels walk rows off whole chunks, else padded to whole
chunks), run as rows of their own, each from its true initial state. The
delta rule is affine in its state (`sequence_parallel`, whose math this is, on
one device): a piece maps the state before it to S_end = M_p S_start + L_p.

Forward:
  1. the forward over every piece with the values [0 | v] from [I | 0]
     (`sequence_parallel.affine_maps`; on sm90 the chain alone,
     `warp_specialized.piece_maps`) gives each piece's map [M_p | L_p];
  2. a scan over the pieces (`sequence_parallel.prefix_states`) gives the
     state before each, P_p (zeros where a piece starts a segment);
  3. the forward over the pieces from P_p gives o and the final state, exactly
     as unsplit: the outputs are the kernels' own, rounded once.

Backward: each piece's backward from the same P_p, with the true cotangent of
its end state. That cotangent comes from the pieces after it: a reverse sweep
over each piece from a zero end cotangent gives dL/dS_start through its own
outputs, and a reverse scan with the maps' M_p^T
(`sequence_parallel.end_cotangents`) adds the later pieces'. Nothing is
differentiated through the maps: split at piece boundaries, the chain rule of
the recurrence is the pieces' backward passes.

What the split costs: the map pass (the chain of a forward with D more value
columns, without outputs, on the chunks' inverses the main pass takes,
formed once), the reverse sweep from
zero end cotangents, the scans, and the [B P, H, D, D] float32 maps and
[B P, H, D, E] piece states kept for the backward.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from lightning_jax.ops.delta_attention import pallas_triton
from lightning_jax.ops.delta_attention import sequence_parallel
from lightning_jax.ops.lightning_attention.config import WarpSpecializedConfig

# Tokens per chunk of the pieces' lengths: the warp-specialised sweeps' chunk, a multiple of every Triton chunk.
PIECE_ALIGN = WarpSpecializedConfig.CHUNK_SIZE
# Pieces walk at least this many chunks: shorter ones pay the map pass and the pipelines' fill for too little.
MIN_PIECE_CHUNKS = 16
# The split pays where it gives at least MIN_PIECES pieces, and was measured up to MAX_PIECES (the _WARP_SPECIALIZED
# pair where the map pass is `warp_specialized.piece_maps`; PERFORMANCE.md, "Delta attention"). On an H200 (Gated
# DeltaNet, bf16, fwd+bwd), with the map pass a forward of D more value columns in twice the programs (the Triton
# sweeps' today), 4 pieces took 23% less time at B1 H16 T64K D128 (32 programs) and 8 pieces 39% less at B2 H8 T32K
# D64 (16), where 2 pieces at B1 H32 D128 (64) took 20% more; with the warp-specialised chain alone, 2 pieces there
# took 5% less, and 16 pieces 19-20% less than 8 at B1 H8 T128K D64 (8 programs). DeltaNet's unpacked chain, with
# no gates, is a tenth faster than a gated one (PERFORMANCE.md, "Delta attention"), so its 2 pieces no longer pay: at
# B1 H32 T64K D128 its forward took 1.466 ms in 2 pieces against 1.375 unsplit, fwd+bwd 6.505 against 6.464 (H200),
# where Gated DeltaNet's 2 pieces still took 4% less forward (1.693 against 1.767).
MIN_PIECES, MIN_PIECES_WARP_SPECIALIZED, MIN_PIECES_UNGATED = 4, 2, 4
MAX_PIECES, MAX_PIECES_WARP_SPECIALIZED = 8, 16


def num_pieces(*, programs: int, num_tokens: int, num_sms: int, warp_specialized_map: bool,
               unpadded_rows: bool = False, ungated: bool = False) -> int:
  """Pieces per row (1: no split) for a call whose sweeps run `programs` programs unsplit over rows of `num_tokens`.

  programs: B * H * value blocks of the sweeps' width (the warp-specialised
  CTAs' 64 columns, or the Triton sweeps' block_e where narrower). As many
  pieces as the `num_sms` SMs hold the programs of, a power of two, at most
  MAX_PIECES and each at least MIN_PIECE_CHUNKS 64-token chunks; none unless
  that is MIN_PIECES. Where the map pass is warp-specialised
  (`warp_specialized.piece_maps`: a scalar gate or none on the
  warp-specialised sweeps), MIN_PIECES_WARP_SPECIALIZED and
  MAX_PIECES_WARP_SPECIALIZED instead (`call_pieces` says where), and
  MIN_PIECES_UNGATED there for rows without gates (`ungated`: DeltaNet
  unpacked, whose chain is the fastest).

  With `unpadded_rows` (`piece_length`), where that power of two does not cut
  the row with no copy (T / P tokens a whole number of TMA's rows), the most
  pieces of any count that do, down to half the most that fit: on an H200
  (Gated DeltaNet, bf16, B1 T60000) copying the row to 4 padded pieces took
  66% more time forward and 31% more forward+backward than 4 pieces of 15000
  at H16 D128, and at H8 D64 16 padded pieces 41% and 27% more than 15 of
  4000 (10 pieces: 0.384 ms forward against 0.361; 6: 0.513, level with 16
  padded).
  """
  most, least = ((MAX_PIECES_WARP_SPECIALIZED, MIN_PIECES_UNGATED if ungated else MIN_PIECES_WARP_SPECIALIZED)
                 if warp_specialized_map else (MAX_PIECES, MIN_PIECES))
  num_chunks = -(-num_tokens // PIECE_ALIGN)

  def fits(pieces):
    return pieces <= most and pieces * programs <= num_sms and num_chunks // pieces >= MIN_PIECE_CHUNKS

  pieces = 1
  while fits(2 * pieces):
    pieces *= 2
  if pieces < least:
    return 1

  if unpadded_rows and not _reshapes(num_tokens, pieces):
    widest = max(p for p in range(pieces, 2 * pieces) if fits(p))
    for p in range(widest, max(least, -(-widest // 2)) - 1, -1):
      if _reshapes(num_tokens, p):
        return p
  return pieces


def _reshapes(t: int, pieces: int) -> bool:
  """Whether a row of t tokens cuts into `pieces` rows of T / P tokens, a whole number of TMA's rows
  (`WarpSpecializedConfig.tiles_rows`): then the pieces are the row reshaped."""
  return t % pieces == 0 and WarpSpecializedConfig.tiles_rows(t // pieces)


def walks_unpadded_pieces(config, *, per_channel_gate: bool, dim_v: int) -> bool:
  """Whether the split's pieces may be rows off whole chunks (`piece_length`): where every kernel of the forward
  and backward walks rows as they are, the warp-specialised ones of a scalar gate or none
  (`warp_specialized.walked_rows`; the backward's Mosaic GPU gradient kernel up to
  `pallas_triton.MOSAIC_GRADIENTS_MAX_E`). Elsewhere each kernel would copy every piece to whole chunks."""
  return (not per_channel_gate and config.warp_specializes_backward(per_channel_gate=False)
          and WarpSpecializedConfig.padded_dims(dim_v, dim_v)[1] <= pallas_triton.MOSAIC_GRADIENTS_MAX_E)


def call_pieces(q_shape, dim_v: int, config, *, per_channel_gate: bool, num_sms: int, ungated: bool = False) -> int:
  """`num_pieces` for a call of `delta_attention`'s Pallas path: q [B, T, H, D], E = dim_v, its resolved
  `DeltaConfig` (the sweeps' programs by its block_e, at most the warp-specialised CTAs' 64 columns; the map pass
  warp-specialised where the sweeps are; pieces off whole chunks where `walks_unpadded_pieces`); ungated: no decay
  and no segments (DeltaNet unpacked).

  KDA's per-key-channel gates on the warp-specialised sweeps: no split. Its
  map pass is the Triton sweep's, whose chain walks 64 tokens in about 8
  times the warp-specialised chain's time (H200, B1 H32 T64K D128, 64
  programs: the forward in 2 pieces took 12.5 ms, of which the map pass over
  one 32K-token piece about 6.9; unsplit 6.1), so no split into at most
  MAX_PIECES pieces shortens the forward's longest chain (PERFORMANCE.md,
  "KDA speed": where one might still pay in the backward).
  """
  if per_channel_gate and config.warp_specialized:
    return 1
  b, t, h, _ = q_shape
  value_blocks = -(-dim_v // min(config.block_e, WarpSpecializedConfig.BLOCK_E))
  return num_pieces(programs=b * h * value_blocks, num_tokens=t, num_sms=num_sms,
                    warp_specialized_map=bool(config.warp_specialized), ungated=ungated,
                    unpadded_rows=walks_unpadded_pieces(config, per_channel_gate=per_channel_gate, dim_v=dim_v))


class Pieces(NamedTuple):
  """A split's layout and what its backward reads.

  count, length: pieces per row and tokens per piece (`piece_length`).
  starts: [B P, H, D, E] float32, the state before each piece.
  transitions: [B P, H, D, D] float32, each piece's M.
  continues: [B, P] bool, whether piece p's first token continues the segment before it.
  """
  count: int
  length: int
  starts: jax.Array
  transitions: jax.Array
  continues: jax.Array


def piece_length(t: int, pieces: int, *, unpadded_rows: bool) -> int:
  """Tokens per piece of a row of t tokens cut into `pieces`.

  T / P where the kernels walk rows off whole chunks as they are
  (`unpadded_rows`: `walks_unpadded_pieces`) and T / P is a whole number of
  TMA's rows (`WarpSpecializedConfig.tiles_rows`): the pieces are then the row
  reshaped, no copy. Else whole PIECE_ALIGN chunks, T padded to P of them: a
  copy of every operand to the pieces, and of every output back.
  """
  if unpadded_rows and _reshapes(t, pieces):
    return t // pieces
  return math.ceil(math.ceil(t / PIECE_ALIGN) / pieces) * PIECE_ALIGN


def to_pieces(x, pieces: int, length: int):
  """[B, T, ...] -> [B P, length, ...]: T padded with zeros (False) to P pieces, each a row (a reshape where
  P length = T)."""
  if x is None:
    return None
  if pieces * length != x.shape[1]:
    x = jnp.pad(x, ((0, 0), (0, pieces * length - x.shape[1])) + ((0, 0),) * (x.ndim - 2))
  return x.reshape(x.shape[0] * pieces, length, *x.shape[2:])


def from_pieces(x, batch: int, t: int):
  """[B P, length, ...] -> [B, T, ...]."""
  return x.reshape(batch, -1, *x.shape[2:])[:, :t]


def _piece_starts(segment_starts, b: int, pieces: int, length: int):
  """(segment starts on the piece rows [B P, length] or None, continues [B, P]): a start at a piece's first token is
  its continues flag, not a start (the kernels' rows never start a segment at token 0)."""
  if segment_starts is None:
    return None, jnp.ones((b, pieces), bool)
  starts = to_pieces(segment_starts, pieces, length).reshape(b, pieces, length)
  return starts.at[:, :, 0].set(False).reshape(b * pieces, length), ~starts[:, :, 0]


def forward(run: Callable, piece_maps: Callable, q, k, v, beta, decay, segment_starts, initial_state, *, pieces: int,
            with_final_state: bool, unpadded_rows: bool, chunk_inverses: Callable | None = None):
  """The split forward. Returns ((o [B, T, H, E], final state [B, H, D, E] float32 or None), run's extra results on
  the pieces, `Pieces`).

  run(q, k, v, beta, decay, segment_starts, initial_state, *, inverses) ->
  (o, final state, *extra): the kernels' forward on padded piece rows.
  piece_maps(k, v, beta, decay, segment_starts, inverses) -> each row's map
  [M | L] [rows, H, D, D + E] float32 (`sequence_parallel.affine_maps`').
  chunk_inverses(k, beta, decay, segment_starts) -> what the forward would
  form from those alone (the warp-specialised forward's chunk inverses,
  arrays over the piece rows), or None: then formed once, and `run` and
  `piece_maps` get them for the rows they run, else None. Inputs as
  `pallas_triton.forward`'s: q, k [B, T, H, D], v [B, T, H, E], beta [B, T,
  H], decay None, [B, T, H] or [B, T, H, D], segment_starts [B, T] bool or
  None, initial_state [B, H, D, E] float32 or None. unpadded_rows: as for
  `piece_length`. with_final_state: whether
  the final state is returned (and its cotangent may reach the backward);
  without it, in a batch of one row, the last piece's map is not formed
  (nothing reads it; with more rows the other pieces' operands would be
  gathered for the map pass, which cost more than the map: on an H200, B2 H8
  T32K D64 and 8 pieces, the forward took 10% more time, and 4% less at B1
  H16 T64K D128 with 4 pieces).
  """
  b, t, _, d = q.shape
  length = piece_length(t, pieces, unpadded_rows=unpadded_rows)
  split = lambda x: to_pieces(x, pieces, length)  # noqa: E731
  qs, ks, vs, betas, decays = (split(x) for x in (q, k, v, beta, decay))
  starts, continues = _piece_starts(segment_starts, b, pieces, length)
  inverses = None if chunk_inverses is None else chunk_inverses(ks, betas, decays, starts)
  mapped = pieces - 1 if b == 1 and not with_final_state else pieces

  def first(x):  # [P, ...] -> the first `mapped` pieces' rows (B = 1)
    return x if x is None or mapped == pieces else x[:mapped]

  maps = piece_maps(*(first(x) for x in (ks, vs, betas, decays, starts)), jax.tree.map(first, inverses))
  maps = jnp.moveaxis(maps.reshape(b, mapped, *maps.shape[1:]), 1, 0)  # [mapped, B, H, D, D + E]
  before, after = sequence_parallel.prefix_states(maps, continues[:, :mapped], initial_state, d)
  if mapped < pieces:  # the last piece's start: the state after the one before it, where it continues it
    before = jnp.concatenate([before, jnp.where(continues[:, -1, None, None, None], after, 0.0)[None]])
  piece_starts = jnp.moveaxis(before, 0, 1).reshape(b * pieces, *before.shape[2:])
  o, final_states, *extra = run(qs, ks, vs, betas, decays, starts, piece_starts, inverses=inverses)
  final = None if final_states is None else final_states.reshape(b, pieces, *final_states.shape[1:])[:, -1]
  transitions = maps[..., :d]
  if mapped < pieces:  # no cotangent reaches the last piece's end: its M multiplies zeros
    transitions = jnp.concatenate([transitions, jnp.zeros_like(transitions[:1])])
  transitions = jnp.moveaxis(transitions, 0, 1).reshape(b * pieces, *transitions.shape[2:])
  return ((from_pieces(o, b, t), final), extra,
          Pieces(count=pieces, length=length, starts=piece_starts, transitions=transitions, continues=continues))


def backward(run_backward: Callable, pieces: Pieces, q, k, v, beta, decay, segment_starts, do, d_final):
  """The split backward: (dq, dk, dv, dbeta, d decay or None, dL/dS_0 [B, H, D, E] float32).

  run_backward(q, k, v, beta, decay, segment_starts, initial_state, do,
  d_final, *, initial_cotangent_only) -> `pallas_triton.backward`'s results
  on piece rows (just dL/dS_start with `initial_cotangent_only`). Inputs as
  for `forward` (unsplit), do [B, T, H, E], d_final [B, H, D, E] or None.
  """
  b, t = q.shape[:2]
  count, length = pieces.count, pieces.length
  split = lambda x: to_pieces(x, count, length)  # noqa: E731
  qs, ks, vs, betas, decays, dos = (split(x) for x in (q, k, v, beta, decay, do))
  starts = _piece_starts(segment_starts, b, count, length)[0]
  by_piece = lambda x: jnp.moveaxis(x.reshape(b, count, *x.shape[1:]), 1, 0)  # noqa: E731  [B P, ...] -> [P, B, ...]
  own = run_backward(qs, ks, vs, betas, decays, starts, None, dos, None, initial_cotangent_only=True)
  d_ends = sequence_parallel.end_cotangents(by_piece(pieces.transitions), by_piece(own), pieces.continues, d_final)
  d_ends = jnp.moveaxis(d_ends, 0, 1).reshape(b * count, *d_ends.shape[2:])
  dq, dk, dv, d_beta, d_decay, d_starts = run_backward(qs, ks, vs, betas, decays, starts, pieces.starts, dos, d_ends,
                                                       initial_cotangent_only=False)
  merge = lambda x: None if x is None else from_pieces(x, b, t)  # noqa: E731
  return (*(merge(x) for x in (dq, dk, dv, d_beta, d_decay)),
          d_starts.reshape(b, count, *d_starts.shape[1:])[:, 0])
