"""Pallas kernels for one Lightning Attention sweep, lowered through Triton.

Triton itself is reached through `ops.triton_lowering`, the package's one
Triton-specific module.

A sweep computes, for x, y: [B, T, H, K], z: [B, T, H, V] and a = exp(-decay_h),

    out_t = scale * x_t S_t,   S_t = a S_{t-1} + y_t^T z_t     (forward), or
    out_t = scale * x_t G_t,   G_t = a G_{t+1} + y_t^T z_t     (reverse),

with the carried state in float32. Optionally a sweep also computes either the
decay tangent (see `chunk_common`), reduced to per-token row dots
`sum_v out'_t * w_t` in float32 (the decay gradient), or the dual output
`u_t S_t^T + ...` [B, T, H, K] of a fourth input u (dk beside dv, from one
pass). The forward pass is one forward sweep; the backward pass is two or three
(see `vjp`).

Two variants:
  chunk_loop: grid (B*H*S, V/block_e); each program walks the chunks of one
    slice of the sequence in order, the state tile on chip (the Lightning
    Attention-2 design). With S > 1 slices (the sequence split, for few
    (batch, head) pairs), a states kernel first writes each slice's own state
    (float32, [B, H, S, K, V]), `chunk_common.combine_slice_states` turns them
    into the state before each slice, and each slice starts from that.
  parallel: a states kernel, grid (B*H, K/block_d, V/block_e), writes the state
    before every chunk (float32, [B, H, N, K, V]); then an output kernel, grid
    (B*H, N, V/block_e), runs all chunks in parallel (the
    flash-linear-attention `chunk` design).

Per-token rates and packed sequences (segment starts) run the same kernels:
only the decay factors change, loaded per chunk (`chunk_common.token_decay_factors`)
instead of computed once per program from a per-head rate.

Sequences with states of their own (`cu_seqlens` with initial or final
states) run the chunk loop with one program per (head, sequence, value
block): it walks the chunks that hold any of the sequence's tokens, reads and
writes only its rows (in its first and last chunk, which it may share, the
others are masked, as rows past T are, and the cumulative rates rebased to its
own rows: `_walk`), and starts from the sequence's initial state and stores
its final state. No copy of the operands, and no segment masks. The programs
start longest sequence first (`_program_coords`). Where those programs are too few to
fill the GPU, the sequences are cut at the split's slices into pieces
(`packing.SequencePieces`): a states pass over the pieces, their combine
(`packing.piece_starts`), then one program per piece.

Optional operands and results are None when absent: a kernel receives None
refs for them, and each launcher builds the block specs of what is present
beside the operands (`_present`), so one kernel serves every combination.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lightning_jax.ops import triton_lowering
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import manual_axes
from lightning_jax.ops.lightning_attention import packing
from lightning_jax.ops.lightning_attention.config import PallasOptions, SweepConfigs

_F32 = jnp.float32


class SweepOperands(NamedTuple):
  """What the kernels of a sweep read; None where absent (a kernel also gets None for what it does not read).

  Shapes for padded inputs (the kernels') and, in `sweep`, unpadded ones:
    decay: [H] float32 rates, or None (no decay).
    token_decay: [B, T, H] float32 per-token rates (each token's own), or None;
      `sweep` only (the kernels get chunk_cumdecay).
    segment_starts: [B, T] bool, tokens that start a segment, or None; `sweep`
      only (the kernels get chunk_runs).
    sequence_bounds: [N + 1] int32 cumulative lengths of N sequences packed in
      a batch of one (`cu_seqlens`), or None: the chunk loop then runs one
      program per (head, sequence, value block) over that sequence's chunks,
      from its own initial state ([N, H, K, V]) to its own final state (module
      docstring); with per-token rates or none.
    sequence_order: [N] int32, the kernels' only: the sequences longest first
      (`_longest_first`), the order their programs start in.
    chunk_cumdecay, chunk_runs: [B, H, Tp] float32 and [B, Tp] int32, the
      per-chunk factors' inputs in the sweep's convention
      (`chunk_common.token_chunk_gates`): cumdecay with per-token rates only,
      runs with segments only (a per-head rate is then masked), each chunk's
      total in its first row's high bits (`chunk_common.with_run_totals`).
    chunk_next_start: [B, N] int32 with segments (else None): for each sweep
      step, the first step at or after it whose chunk holds a segment start
      (N where none does; `segment_fields`). A chunk loop or states pass
      program with few such steps walks the chunks between two of them
      without the segments' counts and masks (`_walk`).
    x, y: [B, T, H, K]; z: [B, T, H, V].
    dual_with: [B, T, H, V] u of the dual output, or None.
    initial_state: [B, H, K, V] float32, or None (zeros); in the chunk loop's
      kernel [B, H, S, K, V], the state before each slice.
    initial_tangent: [B, H, S, K, V] float32, the decay tangent before each
      slice of the chunk loop, or None (zeros).
    chunk_states, chunk_tangents: [B, H, N, K, V] float32, the state (and its
      decay tangent) before every chunk: the parallel variant's intermediates.
    tangent_with: [B, T, H, V] weights w of the decay tangent's row dots, or
      None (no tangent; needs a per-head decay).
    dot_with: [B, T, H, V] weights w of the output's own row dots
      `sum_v out_t * w_t` (the per-token decay gradient), or None. (With
      `sweep(..., dots_with_dual=True)` the weights are `dual_with`, which the
      kernels have loaded already.)
  """
  decay: jax.Array | None = None
  token_decay: jax.Array | None = None
  segment_starts: jax.Array | None = None
  sequence_bounds: jax.Array | None = None
  sequence_order: jax.Array | None = None
  chunk_cumdecay: jax.Array | None = None
  chunk_runs: jax.Array | None = None
  chunk_next_start: jax.Array | None = None
  x: jax.Array | None = None
  y: jax.Array | None = None
  z: jax.Array | None = None
  dual_with: jax.Array | None = None
  initial_state: jax.Array | None = None
  initial_tangent: jax.Array | None = None
  chunk_states: jax.Array | None = None
  chunk_tangents: jax.Array | None = None
  tangent_with: jax.Array | None = None
  dot_with: jax.Array | None = None


class SweepResults(NamedTuple):
  """What the kernels of a sweep write; None where not asked for.

    out: [B, T, H, V] in the output dtype.
    dual: [B, T, H, K] dual output (with `dual_with`).
    chunk_states, chunk_tangents: the parallel variant's intermediates (see
      `SweepOperands`); None in what `sweep` returns.
    final_state: [B, H, K, V] float32, the state after the last real token of
      the sweep (with `with_final_state`); in the states kernel of a sequence
      split [B, H, S, K, V], each slice's state at its end, from zeros; with
      sequence_bounds [N, H, K, V], each sequence's.
    row_dots: [B, H, T] float32 row dots of the decay tangent (with
      `tangent_with`) or of out (with `dot_with`).
    final_tangent: [B, H, K, V] float32 (with `tangent_with` and `with_final_state`).
    slice_starts: the sequence split's `SliceStarts` (in what `sweep` returns), or None.
  """
  out: jax.Array | None = None
  dual: jax.Array | None = None
  chunk_states: jax.Array | None = None
  chunk_tangents: jax.Array | None = None
  final_state: jax.Array | None = None
  row_dots: jax.Array | None = None
  final_tangent: jax.Array | None = None
  slice_starts: SliceStarts | None = None


@functools.partial(jax.tree_util.register_dataclass, data_fields=["states"], meta_fields=["chunk_size", "slice_chunks"])
@dataclasses.dataclass(frozen=True)
class SliceStarts:
  """A sequence split's first pass: the state before each slice of `slice_chunks` chunks of `chunk_size` tokens.

  states: [B, H, S, K, V] float32 (unpadded K, V), from the sweep's initial
  state. The sweep that carries the transposed state over the same operands
  (the dq sweep beside the forward, the dk sweep beside the dv sweep) takes
  `transposed()` (`sweep(..., given_starts=)`) instead of running the pass
  again. A pytree with static sizes, so a custom_vjp keeps it as a residual.
  """
  states: jax.Array
  chunk_size: int
  slice_chunks: int

  def transposed(self) -> SliceStarts:
    return dataclasses.replace(self, states=jnp.swapaxes(self.states, -1, -2))


def _present(values: NamedTuple, **specs) -> NamedTuple:
  """`values`' NamedTuple with each present field replaced by its spec in `specs`, absent ones None."""
  return values._make(None if value is None else specs[name] for name, value in zip(values._fields, values))


_dot = triton_lowering.dot


def segment_fields(runs, *, chunk_size, num_chunks, reverse) -> dict:
  """`SweepOperands`' chunk_runs and chunk_next_start of a packed row (None: of an unpacked one), from
  `chunk_common.token_chunk_gates`' runs [B, Tp] in the sweep's convention; num_chunks: the real chunks."""
  if runs is None:
    return dict(chunk_runs=None, chunk_next_start=None)
  counts = chunk_common.with_run_totals(runs, chunk_size=chunk_size, reverse=reverse)
  _, started = chunk_common.chunk_totals(None, counts, chunk_size=chunk_size, num_chunks=num_chunks, reverse=reverse)
  steps = jnp.arange(num_chunks, dtype=jnp.int32)
  next_start = jax.lax.cummin(jnp.where(started, steps, num_chunks), axis=1, reverse=True)
  return dict(chunk_runs=counts, chunk_next_start=next_start)


def _sweep_factors(ins: SweepOperands, *, chunk_size, seq_len, reverse, branch, bounds=None):
  """Chunk index -> (`ChunkFactors` or None without decay, a pair mask or None).

  A per-head rate's exp2 work is done once per program (and masked per chunk
  by its segment starts); per-token factors are computed per chunk from its
  cumulative rates and segment starts. With `branch`
  (`heuristics.branch_per_chunk`) a chunk branches on its own rates and starts
  (`chunk_common.token_decay_factors`). Without it, segments with a per-head
  rate leave the factors' [C, C] intra the program's and mask the chunk's
  [C, C] products instead (the pair mask, `_scores`): the fused dk/dv sweep
  has two of them, and no per-chunk copy of intra beside them (H200, B4 H32
  T32K D64, 8 packed sequences: fwd+bwd 20% less time, PERFORMANCE.md).
  With `bounds` (bos, eos), a sequence program's rows, the cumulative rates
  are rebased to them (`_sequence_cumdecay`).
  """
  def chunk_rows(chunk_idx):
    return pl.ds(pl.multiple_of(chunk_idx * chunk_size, chunk_size), chunk_size)

  def at_end(ref, chunk_idx):  # the chunk's last value in sweep order, a scalar load
    return ref[chunk_idx * chunk_size + (0 if reverse else chunk_size - 1)]

  def runs_of(chunk_idx):  # the chunk's [C] counts and its total (`chunk_common.with_run_totals`)
    total = ins.chunk_runs[chunk_idx * chunk_size] >> chunk_common.RUN_TOTAL_SHIFT
    return ins.chunk_runs[chunk_rows(chunk_idx)] & chunk_common.RUN_COUNTS, total

  if ins.chunk_cumdecay is not None:
    def token_factors(chunk_idx):
      runs, run_end = (None, None) if ins.chunk_runs is None else runs_of(chunk_idx)
      if bounds is None:
        cumdecay, cum_end = ins.chunk_cumdecay[chunk_rows(chunk_idx)], at_end(ins.chunk_cumdecay, chunk_idx)
      else:
        cumdecay, cum_end = _sequence_cumdecay(ins.chunk_cumdecay, chunk_idx, bounds, chunk_size=chunk_size,
                                               reverse=reverse)
      return chunk_common.token_decay_factors(cumdecay, runs, reverse=reverse, branch=branch, cum_end=cum_end,
                                              run_end=run_end), None
    return token_factors
  if bounds is not None and ins.decay is not None:
    raise ValueError("sequence programs take per-token rates (a per-head rate broadcast over the tokens)")
  if ins.decay is None and ins.chunk_runs is None:
    return lambda chunk_idx: (None, None)
  lam2 = 0.0 if ins.decay is None else ins.decay[()].astype(_F32) * chunk_common.LOG2_E
  factors = chunk_common.sweep_decay_factors(lam2, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse)
  if ins.chunk_runs is None:
    return lambda chunk_idx: (factors(chunk_idx), None)
  if branch:
    return lambda chunk_idx: (chunk_common.mask_started_segments(factors(chunk_idx), *runs_of(chunk_idx)), None)

  def masked_products(chunk_idx):
    runs, run_end = runs_of(chunk_idx)
    return (chunk_common.mask_segment_rows(factors(chunk_idx), runs, run_end),
            functools.partial(chunk_common.same_segment, runs=runs))

  return masked_products


def _sequence_cumdecay(ref, chunk_idx, bounds, *, chunk_size, reverse):
  """One chunk's cumulative rates (`token_chunk_gates`, log2 units) rebased to the rows [bos, eos) of a sequence
  program, and their last value in sweep order: ([C], scalar).

  The chunk's sums start at its first row in sweep order, which may belong to
  the sequence before (forward) or after (reverse): subtracting the sum
  through the row before the sequence (forward) or at its last token (reverse:
  the sequence's last token takes no rate, `sweep`) leaves its own rates
  alone. A program's rows end inside a chunk only where its sequence ends (a
  piece of one is cut at whole slices). Rows outside hold the value of the
  nearest row inside in sweep order (rate 0, as padding past T).
  """
  bos, eos = bounds
  start = chunk_idx * chunk_size
  row = start + jnp.arange(chunk_size)
  lo, hi = jnp.maximum(bos, start), jnp.minimum(eos, start + chunk_size)
  cumdecay = ref[pl.ds(pl.multiple_of(start, chunk_size), chunk_size)]
  if reverse:
    base = jnp.where(eos < start + chunk_size, ref[hi - 1], 0.0)
    end = ref[lo] - base
    outside = jnp.where(row >= hi, 0.0, end)
  else:
    base = jnp.where(bos > start, ref[jnp.maximum(bos - 1, start)], 0.0)
    end = ref[hi - 1] - base
    outside = jnp.where(row < lo, 0.0, end)
  return jnp.where((row >= lo) & (row < hi), cumdecay - base, outside), end


def _scores(a, b, f, pair_mask, *, reverse, exact):
  """[C, C] a b^T inside the (anti-)causal mask, decayed by the gap (and zero across segments: pair_mask)."""
  scores = _dot(a, b, trans_b=True, exact=exact)
  if f is None:
    return jnp.where(chunk_common.causal_mask(a.shape[0], reverse=reverse), scores, 0.0)
  scores = scores * f.intra
  return scores if pair_mask is None else pair_mask(scores)


def _chunk_out(x, y, z, u, state, tangent, f, pair_mask, *, scale, reverse, exact):
  """One chunk's outputs.

  out = intra (masked, decayed x y^T z) + inter (x S). With `u`, also the dual
  output (u z^T) y + u S^T, the same sweep seen from z's side (dk beside dv).
  With `tangent` (the state's decay tangent U), also out's decay tangent.
  """
  scores = _scores(x, y, f, pair_mask, reverse=reverse, exact=exact)
  # The state is read after the first product, which the chunk loop's
  # outputs-first order needs (see `_chunk_loop_kernel`). Its state-first order
  # and the parallel output kernel cast the state before the call; the cast here
  # is then a no-op.
  state_in = state.astype(x.dtype)
  inter = _dot(x, state_in, exact=exact)
  if f is not None:
    inter = inter * f.row[:, None]
  out = scale * (_dot(scores.astype(z.dtype), z, exact=exact) + inter)
  dual = None
  if u is not None:
    dual_inter = _dot(u, state_in, trans_b=True, exact=exact)
    if f is not None:
      dual_inter = dual_inter * f.row[:, None]
    dual_scores = _scores(u, z, f, pair_mask, reverse=reverse, exact=exact)
    dual = scale * (_dot(dual_scores.astype(y.dtype), y, exact=exact) + dual_inter)
  out_tangent = None
  if tangent is not None:
    out_tangent = scale * (_dot((scores * f.gap).astype(z.dtype), z, exact=exact)
                           + _dot(x, tangent.astype(x.dtype), exact=exact) * f.row[:, None]
                           + f.row_exp[:, None] * inter)
  return out, dual, out_tangent


def _chunk_state(y, z, state, tangent, f, *, exact):
  """State (and decay tangent) after one chunk."""
  if f is None:
    return state + _dot(y, z, trans_a=True, exact=exact), None
  # The key factors scale z's rows, not y's: in the chunk loop z is the narrower
  # tile ([C, block_e] against [C, K]), and y feeds the dot straight from its load.
  z_decayed = z * f.key[:, None]
  new_state = f.state * state + _dot(y, z_decayed.astype(z.dtype), trans_a=True, exact=exact)
  if tangent is None:
    return new_state, None
  new_tangent = (f.state * tangent + (f.end * f.state) * state
                 + _dot(y, (z_decayed * f.key_exp[:, None]).astype(z.dtype), trans_a=True, exact=exact))
  return new_state, new_tangent


def _row_weights(ins: SweepOperands, load, u, *, dots_with_dual):
  """The chunk's rows of `tangent_with` or `dot_with` [C, V] (load: a ref -> the chunk's rows of it), or its `u`
  (`dots_with_dual`), or None."""
  if dots_with_dual:
    return u
  weights = ins.dot_with if ins.tangent_with is None else ins.tangent_with
  return None if weights is None else load(weights)


def _row_dots(ins: SweepOperands, weights, out, out_tangent):
  """Per-row sum_v of `weights` times the decay tangent (with `tangent_with`), else out: float32 [C]."""
  return jnp.sum((out if ins.tangent_with is None else out_tangent) * weights.astype(_F32), axis=1)


def _initial_carry(ins: SweepOperands, *, with_tangent: bool, sequence=None):
  """(state, tangent) before the program's first chunk: S_0 or zeros, and the decay tangent's or zeros. sequence:
  a sequence program's, whose block holds every sequence's initial state (`_chunk_loop`), or None."""
  shape = (ins.y.shape[-1], ins.z.shape[-1])
  state = (jnp.zeros(shape, _F32) if ins.initial_state is None
           else ins.initial_state[...] if sequence is None else ins.initial_state[sequence])
  if not with_tangent:
    return state, None
  return state, jnp.zeros(shape, _F32) if ins.initial_tangent is None else ins.initial_tangent[...]


def _slice_steps(slot, *, num_chunks, slice_chunks, num_slices):
  """(first sweep step, number of steps) of the program of slice `slot` (`_program_coords`) of the sequence.

  Only the last slice of the sequence can be shorter; its step count is then
  traced.
  """
  if num_slices == 1:
    return 0, min(slice_chunks, num_chunks)
  first = slot * slice_chunks
  if num_slices * slice_chunks <= num_chunks:
    return first, slice_chunks
  return first, jnp.minimum(slice_chunks, num_chunks - first)


def _longest_first(bounds):
  """[N] int32: the sequences of bounds [N + 1], longest first (ties in order)."""
  return jnp.argsort(bounds[:-1] - bounds[1:], stable=True).astype(jnp.int32)


def _with_sequences(ins: SweepOperands, bounds) -> SweepOperands:
  """ins with the sequence bounds [N + 1] its kernels walk and their order (`_longest_first`), formed once for the
  states pass and the loop over the same sequences or pieces."""
  return ins._replace(sequence_bounds=bounds, sequence_order=_longest_first(bounds))


def _program_coords(i, *, h, ns, n_e, sequences):
  """Program i of grid axis 0 -> (batch, head, slot, value block).

  The GPU starts programs in this order, axis 0 first. Value blocks (n_e of
  them) come innermost, so that a chunk's q and k tiles serve its value
  blocks' programs together (from L2). Outside them, slices of a split run
  batch-major, then head, then slice; sequence programs (a batch of one; slot:
  a sequence's rank in `sequence_order`) rank-major, then head, so that the
  longest sequences' chains start first.
  """
  e, i = i % n_e, i // n_e
  if sequences:
    return 0, i % h, i // h, e
  return i // ns // h, i // ns % h, i % ns, e


def _sequence_steps(ins: SweepOperands, rank, *, chunk_size, num_chunks, reverse):
  """(first sweep step, number of steps, (bos, eos), sequence) of the program of the sequence of `rank` in
  `sequence_order` (`_program_coords`): the chunks holding any of its tokens; an empty sequence's walks none."""
  seq = ins.sequence_order[rank]
  bos, eos = ins.sequence_bounds[seq], ins.sequence_bounds[seq + 1]
  first_chunk, end_chunk = bos // chunk_size, (eos + chunk_size - 1) // chunk_size
  first = num_chunks - end_chunk if reverse else first_chunk
  return first, jnp.where(eos > bos, end_chunk - first_chunk, 0), (bos, eos), seq


def _program_steps(ins: SweepOperands, *, coords, chunk_size, num_chunks, slice_chunks, num_slices, reverse):
  """(first sweep step, number of steps, the sequence's (bos, eos) or None, its index or None) of this program:
  its slice of the row, or with sequence bounds its sequence (each sequence, or piece of one, a slice of its own).
  coords: grid axis 0's index -> `_program_coords`' (batch, head, slot, value block)."""
  slot = coords(pl.program_id(0))[2]
  if ins.sequence_bounds is None:
    return *_slice_steps(slot, num_chunks=num_chunks, slice_chunks=slice_chunks, num_slices=num_slices), None, None
  return _sequence_steps(ins, slot, chunk_size=chunk_size, num_chunks=num_chunks, reverse=reverse)


def _chunk_rows(step, *, num_chunks, chunk_size, reverse):
  """Chunk index of sweep step `step` and the slice of its rows."""
  n = num_chunks - 1 - step if reverse else step
  return n, pl.ds(pl.multiple_of(n * chunk_size, chunk_size), chunk_size)


def _row_loader(n, rows, *, chunk_size, num_rows, bounds=None):
  """(load, valid) for chunk n's rows of [T, D] refs of num_rows rows: load(ref) -> [C, D] (None -> None), and
  valid [C] bool, the rows that exist, or None where every chunk is whole. Unpadded T (the chunk loop's operands:
  no copy of them to whole chunks) masks the last chunk's loads, which read zeros past T as padding would, and its
  stores; a sequence program's (`bounds`: bos, eos) masks the rows outside its sequence."""
  row = n * chunk_size + jnp.arange(chunk_size)
  if bounds is not None:
    valid = (row >= bounds[0]) & (row < bounds[1])
  else:
    valid = None if num_rows % chunk_size == 0 else row < num_rows

  def load(ref):
    return None if ref is None else triton_lowering.load_rows(ref, rows, valid)
  return load, valid


def _write_final(outs: SweepResults, state, tangent, sequence=None):
  """The final state (and tangent), where the caller asked for them; a sequence program's into its sequence's
  (`_initial_carry`)."""
  at = ... if sequence is None else sequence
  if outs.final_state is not None:
    outs.final_state[at] = state
  if outs.final_tangent is not None:
    outs.final_tangent[at] = tangent


def _factors_by_kind(ins: SweepOperands, *, bounds, **kwargs):
  """A chunk's kind -> `_sweep_factors`' function of a chunk, each set up once, before the program's loop: "plain"
  (a chunk of an unpacked row, a packed row's chunk where no segment starts, the middle of a sequence program),
  "edge" (a sequence program's first and last chunks, rebased to its rows: `bounds`) or "segments" (a packed row's
  chunk where a segment starts, masked by its counts)."""
  segments = _sweep_factors(ins, **kwargs)
  plain = segments if ins.chunk_next_start is None else _sweep_factors(ins._replace(chunk_runs=None), **kwargs)
  edge = plain if bounds is None else _sweep_factors(ins, bounds=bounds, **kwargs)
  return {"plain": plain, "edge": edge, "segments": segments}.__getitem__


def _walk(body, carry, *, num_steps, bounds, first, next_start):
  """The program's loop over its steps, body(step, carry, kind) -> carry (kind: `_factors_by_kind`'s).

  A sequence program's (`bounds`: bos, eos) first and last steps run with
  them, masked and rebased to its rows; the chunks between them hold its rows
  alone and run as an unpacked row's, with no masks and no rebase (H200, B1 H32
  T32K D128, 8 sequences: the forward's loop 0.912 -> 0.839 ms; PERFORMANCE.md,
  "Per-sequence states with `cu_seqlens`"). A packed row's program (`next_start`:
  the row's `chunk_next_start`; first: the program's first sweep step) walks the
  chunks between two where a segment starts as an unpacked row's, and each of
  those apart, masked, where it has few such chunks
  (`heuristics.walked_segment_starts`); else it loads and masks every chunk's
  counts, which costs it 9%.
  """
  plain = lambda step, c: body(step, c, "plain")  # noqa: E731
  if next_start is not None:
    def next_start_step(step):  # the program's next step at or after `step` where a segment starts, or num_steps
      return jnp.minimum(next_start[first + step] - first, num_steps)

    def run(state):  # the plain steps up to the next chunk where a segment starts, then that chunk
      step, c = state
      start = next_start_step(step)
      c = jax.lax.fori_loop(step, start, plain, c)
      c = jax.lax.cond(start < num_steps, lambda c: body(start, c, "segments"), lambda c: c, c)
      return start + 1, c

    def count_starts(state):  # up to one past the limit
      step, count = state
      start = next_start_step(step)
      return start + 1, count + (start < num_steps).astype(jnp.int32)

    limit = heuristics.walked_segment_starts(num_steps)
    _, starts = jax.lax.while_loop(lambda state: (state[0] < num_steps) & (state[1] <= limit), count_starts,
                                   (jnp.int32(0), jnp.int32(0)))
    walked = lambda c: jax.lax.while_loop(lambda state: state[0] < num_steps, run, (jnp.int32(0), c))[1]  # noqa: E731
    masked = lambda c: jax.lax.fori_loop(0, num_steps, lambda step, c: body(step, c, "segments"), c)  # noqa: E731
    return jax.lax.cond(starts > limit, masked, walked, carry)
  if bounds is None:
    return jax.lax.fori_loop(0, num_steps, plain, carry)
  edge = lambda step, c: body(step, c, "edge")  # noqa: E731
  carry = jax.lax.fori_loop(0, jnp.minimum(num_steps, 1), edge, carry)
  carry = jax.lax.fori_loop(1, num_steps - 1, plain, carry)
  return jax.lax.fori_loop(jnp.maximum(num_steps - 1, 1), num_steps, edge, carry)


def _chunk_loop_kernel(ins: SweepOperands, outs: SweepResults, *, scale, chunk_size, seq_len, num_chunks,
                       slice_chunks, num_slices, coords, reverse, exact, dots_with_dual, branch):
  first, num_steps, bounds, sequence = _program_steps(
      ins, coords=coords, chunk_size=chunk_size, num_chunks=num_chunks, slice_chunks=slice_chunks,
      num_slices=num_slices, reverse=reverse)
  carry = _initial_carry(ins, with_tangent=ins.tangent_with is not None, sequence=sequence)
  factors = _factors_by_kind(ins, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse, branch=branch,
                             bounds=bounds)

  def body(step, carry, kind):
    state, tangent = carry
    n, rows = _chunk_rows(first + step, num_chunks=num_chunks, chunk_size=chunk_size, reverse=reverse)
    load, valid = _row_loader(n, rows, chunk_size=chunk_size, num_rows=ins.x.shape[0],
                              bounds=bounds if kind == "edge" else None)
    x, y, z, u = load(ins.x), load(ins.y), load(ins.z), load(ins.dual_with)
    # Loaded before the chunk's products, which hide its latency: Triton's
    # pipeliner leaves a load that feeds no dot blocking.
    weights = _row_weights(ins, load, u, dots_with_dual=dots_with_dual)
    f, pair_mask = factors(kind)(n)
    if f is not None:
      # The outputs first, reading the carried state only after the scores'
      # product, then the state update (PERFORMANCE.md, "Sweep order").
      out, dual, out_tangent = _chunk_out(x, y, z, u, state, tangent, f, pair_mask, scale=scale, reverse=reverse,
                                          exact=exact)
      next_carry = _chunk_state(y, z, state, tangent, f, exact=exact)
    else:
      # The next state first: it needs only this chunk's loads and the carried
      # state, so the next chunk's serial chain starts sooner; the cast right
      # after it (PERFORMANCE.md, "Sweep order").
      next_carry = _chunk_state(y, z, state, tangent, f, exact=exact)
      out, dual, out_tangent = _chunk_out(x, y, z, u, state.astype(x.dtype), tangent, f, pair_mask, scale=scale,
                                          reverse=reverse, exact=exact)
    triton_lowering.store_rows(outs.out, rows, out.astype(outs.out.dtype), valid)
    if outs.dual is not None:
      triton_lowering.store_rows(outs.dual, rows, dual.astype(outs.dual.dtype), valid)
    if outs.row_dots is not None:
      triton_lowering.store_rows(outs.row_dots, rows, _row_dots(ins, weights, out, out_tangent), valid)
    return next_carry

  _write_final(outs, *_walk(body, carry, num_steps=num_steps, bounds=bounds, first=first,
                            next_start=ins.chunk_next_start), sequence)


def _chunk_states_kernel(ins: SweepOperands, outs: SweepResults, *, chunk_size, seq_len, num_chunks, slice_chunks,
                         num_slices, coords, reverse, exact, branch):
  first, num_steps, bounds, sequence = _program_steps(
      ins, coords=coords, chunk_size=chunk_size, num_chunks=num_chunks, slice_chunks=slice_chunks,
      num_slices=num_slices, reverse=reverse)
  carry = _initial_carry(ins, with_tangent=outs.chunk_tangents is not None or outs.final_tangent is not None,
                         sequence=sequence)
  factors = _factors_by_kind(ins, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse, branch=branch,
                             bounds=bounds)

  def body(step, carry, kind):
    state, tangent = carry
    n, rows = _chunk_rows(first + step, num_chunks=num_chunks, chunk_size=chunk_size, reverse=reverse)
    if outs.chunk_states is not None:
      outs.chunk_states[n, :, :] = state
    if outs.chunk_tangents is not None:
      outs.chunk_tangents[n, :, :] = tangent
    load, _ = _row_loader(n, rows, chunk_size=chunk_size, num_rows=ins.y.shape[0],
                          bounds=bounds if kind == "edge" else None)
    return _chunk_state(load(ins.y), load(ins.z), state, tangent, factors(kind)(n)[0], exact=exact)

  _write_final(outs, *_walk(body, carry, num_steps=num_steps, bounds=bounds, first=first,
                            next_start=ins.chunk_next_start), sequence)


def _chunk_output_kernel(ins: SweepOperands, outs: SweepResults, *, scale, chunk_size, seq_len, reverse, exact,
                         dots_with_dual, branch):
  f, pair_mask = _sweep_factors(ins, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse,
                                branch=branch)(pl.program_id(1))
  u = None if ins.dual_with is None else ins.dual_with[...]
  out, dual, out_tangent = _chunk_out(ins.x[...], ins.y[...], ins.z[...], u,
                                      ins.chunk_states[...].astype(ins.x.dtype),
                                      None if ins.chunk_tangents is None else ins.chunk_tangents[...], f,
                                      pair_mask, scale=scale, reverse=reverse, exact=exact)
  outs.out[...] = out.astype(outs.out.dtype)
  if outs.dual is not None:
    outs.dual[...] = dual.astype(outs.dual.dtype)
  if outs.row_dots is not None:
    outs.row_dots[...] = _row_dots(ins, _row_weights(ins, lambda ref: ref[...], u, dots_with_dual=dots_with_dual),
                                   out, out_tangent)


def _call(kernel, grid, ins: SweepOperands, in_specs, results: SweepResults, out_specs, cfg, name,
          interpret) -> SweepResults:
  """One pallas_call on the present operands, writing the present results.

  The results vary over the mesh axes the operands vary over (inside shard_map).
  """
  results = results._make(None if r is None else manual_axes.struct(r.shape, r.dtype, *ins) for r in results)
  (outs,) = pl.pallas_call(
      kernel, grid=grid, in_specs=(in_specs,), out_specs=(out_specs,), out_shape=(results,),
      compiler_params=triton_lowering.compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret, name=name)(ins)
  return outs


def _output_structs(ins: SweepOperands, *, n_e, with_final_state, out_dtype, dots_with_dual, tp,
                    num_states=None) -> SweepResults:
  """The shapes of the results a sweep writes (None where not asked for): out and dual of x's T rows, the row
  dots of tp (whole chunks), final states [B, H, K, V] (or num_states of them: one per sequence)."""
  b, t, h, dim_k = ins.x.shape
  dim_v = ins.z.shape[-1]
  state = jax.ShapeDtypeStruct((b if num_states is None else num_states, h, dim_k, dim_v), _F32)
  has_tangent = ins.tangent_with is not None
  return SweepResults(
      out=jax.ShapeDtypeStruct((b, t, h, dim_v), out_dtype),
      # With several value blocks each program writes a float32 partial sum.
      dual=(None if ins.dual_with is None
            else jax.ShapeDtypeStruct((n_e, b, t, h, dim_k), out_dtype if n_e == 1 else _F32)),
      final_state=state if with_final_state else None,
      row_dots=(jax.ShapeDtypeStruct((b, h, n_e, tp), _F32)
                if has_tangent or ins.dot_with is not None or dots_with_dual else None),
      final_tangent=state if has_tangent and with_final_state else None)


def _gate_rows(gates, spec, index):
  """The block of one (batch, head) row of chunk gates ([B, H, Tp] or [B, Tp]; None: None): the whole row, as
  spec(block, index) makes it."""
  return None if gates is None else spec((None,) * (gates.ndim - 1) + (gates.shape[-1],), index)


def _states_pass(ins: SweepOperands, *, cfg, chunk_size, seq_len, reverse, slice_chunks, num_slices,
                 with_chunk_states, with_final_state, with_tangent, branch, interpret) -> SweepResults:
  """The states kernel: grid (B*H*num_slices, K/block_d, V/block_e), each program one slice's chunks in order.

  Writes, where asked for, the state (and tangent) before every chunk, [B, H,
  N, K, V] (the parallel variant: one slice), and each slice's state (and
  tangent) at its end, [B, H, num_slices, K, V] (from `ins.initial_state`,
  or from zeros: the sequence split's local states). Chunks past the real
  tokens (the padding to whole slices of the warp-specialised forward) are
  not walked. y and z have T rows (unpadded: the last chunk's loads masked)
  or whole chunks; the gates, whole chunks.
  """
  b, t, h, dim_k = ins.y.shape
  dim_v = ins.z.shape[-1]
  n, ns = -(-t // chunk_size), num_slices
  bd, be = cfg.block_d, cfg.block_e
  sequences = ins.sequence_bounds is not None
  state_ins = SweepOperands(decay=ins.decay, sequence_bounds=ins.sequence_bounds, sequence_order=ins.sequence_order,
                            chunk_cumdecay=ins.chunk_cumdecay, chunk_runs=ins.chunk_runs,
                            chunk_next_start=ins.chunk_next_start, y=ins.y, z=ins.z,
                            initial_state=ins.initial_state)
  states_struct = jax.ShapeDtypeStruct((b, h, n, dim_k, dim_v), _F32)
  slice_struct = jax.ShapeDtypeStruct((b, h, ns, dim_k, dim_v), _F32)
  results = SweepResults(chunk_states=states_struct if with_chunk_states else None,
                         chunk_tangents=states_struct if with_chunk_states and with_tangent else None,
                         final_state=slice_struct if with_final_state else None,
                         final_tangent=slice_struct if with_final_state and with_tangent else None)
  coords = functools.partial(_program_coords, h=h, ns=ns, n_e=1, sequences=sequences)

  def spec(block, index):  # index: (batch, head, slot, d, e) -> the block's
    return pl.BlockSpec(block, lambda i, d, e: index(*coords(i)[:3], d, e))

  block_state = spec((None, None, bd, be), lambda bi, hi, si, d, e: (bi, hi, d, e))
  block_slice = spec((None, None, None, bd, be), lambda bi, hi, si, d, e: (bi, hi, si, d, e))
  if sequences:  # [P, H, K, V]: each sequence's (or piece's), from zeros, indexed in the kernel
    if with_chunk_states or ins.initial_state is not None or ins.sequence_order is None:
      raise ValueError("the states pass over sequences writes each one's own state from zeros, in their order "
                       "(`_with_sequences`)")
    slice_struct = jax.ShapeDtypeStruct((ns, h, dim_k, dim_v), _F32)
    block_slice = spec((ns, None, bd, be), lambda bi, hi, si, d, e: (0, hi, d, e))
    results = results._replace(final_state=slice_struct if with_final_state else None,
                               final_tangent=slice_struct if with_final_state and with_tangent else None)
  block_states = spec((None, None, n, bd, be), lambda bi, hi, si, d, e: (bi, hi, 0, d, e))
  kernel = functools.partial(_chunk_states_kernel, chunk_size=chunk_size, seq_len=seq_len,
                             num_chunks=-(-seq_len // chunk_size), slice_chunks=slice_chunks, num_slices=ns,
                             coords=coords, reverse=reverse, exact=ins.y.dtype == _F32, branch=branch)
  whole = lambda *_: (0,)  # noqa: E731
  specs = _present(state_ins, decay=spec((None,), lambda bi, hi, si, d, e: (hi,)),
                   sequence_bounds=spec((ns + 1,), whole), sequence_order=spec((ns,), whole),
                   chunk_cumdecay=_gate_rows(ins.chunk_cumdecay, spec, lambda bi, hi, si, d, e: (bi, hi, 0)),
                   chunk_runs=_gate_rows(ins.chunk_runs, spec, lambda bi, hi, si, d, e: (bi, 0)),
                   chunk_next_start=_gate_rows(ins.chunk_next_start, spec, lambda bi, hi, si, d, e: (bi, 0)),
                   y=spec((None, t, None, bd), lambda bi, hi, si, d, e: (bi, 0, hi, d)),
                   z=spec((None, t, None, be), lambda bi, hi, si, d, e: (bi, 0, hi, e)),
                   initial_state=block_state)
  out_specs = _present(results, chunk_states=block_states, chunk_tangents=block_states, final_state=block_slice,
                       final_tangent=block_slice)
  return _call(kernel, (b * h * ns, dim_k // bd, dim_v // be), state_ins, specs, results, out_specs, cfg,
               "lightning_chunk_states", interpret)


def _own_states(ins: SweepOperands, *, cfg, chunk_size, seq_len, reverse, slice_chunks, num_slices, branch,
                interpret, transposed) -> SweepResults:
  """Each slice's (or, with sequence bounds, each piece's) state, and tangent with `ins.tangent_with`, at its end
  from zeros: the states kernel's final_state and final_tangent.

  With `transposed`, where the states and the kernel's blocks are square and
  no tangent is carried, the kernel runs over (z, y) and its states are
  transposed: the very pass of the sweep that carries the transposed state
  over the same operands, which XLA's CSE may then merge with it.
  """
  with_tangent = ins.tangent_with is not None
  own = ins._replace(x=None, initial_state=None)
  if transposed and not with_tangent and ins.y.shape[-1] == ins.z.shape[-1] and cfg.block_d == cfg.block_e:
    own = own._replace(y=ins.z, z=ins.y)
    local = _states_pass(own, cfg=cfg, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse,
                         slice_chunks=slice_chunks, num_slices=num_slices, with_chunk_states=False,
                         with_final_state=True, with_tangent=False, branch=branch, interpret=interpret)
    return local._replace(final_state=jnp.swapaxes(local.final_state, -1, -2))
  return _states_pass(own, cfg=cfg, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse,
                      slice_chunks=slice_chunks, num_slices=num_slices, with_chunk_states=False,
                      with_final_state=True, with_tangent=with_tangent, branch=branch, interpret=interpret)


def slice_starts(ins: SweepOperands, *, cfg, chunk_size, seq_len, reverse, slice_chunks, with_final_state,
                 branch, interpret, transposed=False):
  """The state (and decay tangent, with `ins.tangent_with`) before each slice of a sequence split.

  Pass 1 of the split: the states kernel writes each slice's own state (the
  last slice's only for the final state; `_own_states`, `transposed` where no
  `SliceStarts` could be handed over, see `sweep`), and
  `combine_slice_states` adds the slices before it.

  Returns:
    (states, tangents): [B, H, S, K, V] float32 (tangents None without
    `tangent_with`), and (final_state, final_tangent), None unless
    `with_final_state`.
  """
  num_chunks = -(-seq_len // chunk_size)
  num_slices = -(-num_chunks // slice_chunks)
  lengths = chunk_common.slice_lengths(seq_len=seq_len, chunk_size=chunk_size, slice_chunks=slice_chunks,
                                       reverse=reverse)
  # Without the final state, nothing reads the last slice's own state.
  local_slices = num_slices if with_final_state else num_slices - 1
  local = _own_states(ins, cfg=cfg, chunk_size=chunk_size, seq_len=seq_len, reverse=reverse,
                      slice_chunks=slice_chunks, num_slices=local_slices, branch=branch, interpret=interpret,
                      transposed=transposed)
  slice_decay = slice_resets = None
  if ins.chunk_cumdecay is not None or ins.chunk_runs is not None:  # per-token or packed
    rate, started = chunk_common.chunk_totals(ins.chunk_cumdecay, ins.chunk_runs, chunk_size=chunk_size,
                                              num_chunks=num_chunks, reverse=reverse)
    pad = num_slices * slice_chunks - num_chunks
    by_slice = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(  # noqa: E731
        *x.shape[:-1], num_slices, slice_chunks)[..., :local_slices, :]
    slice_resets = None if started is None else by_slice(started).any(-1)
    slice_decay = None if rate is None else by_slice(rate).sum(-1)
  states, tangents = chunk_common.combine_slice_states(local.final_state, lengths[:local_slices], ins.decay,
                                                       ins.initial_state, local.final_tangent,
                                                       slice_decay=slice_decay, slice_resets=slice_resets)
  final = (None, None)
  if with_final_state:
    final = states[:, :, -1], None if tangents is None else tangents[:, :, -1]
  return (states[:, :, :num_slices], None if tangents is None else tangents[:, :, :num_slices]), final


def _chunk_loop(ins: SweepOperands, *, scale, seq_len, reverse, with_final_state, configs: SweepConfigs, out_dtype,
                slice_chunks, dots_with_dual, given_starts, transposed_states, branch, interpret,
                token_rates=None) -> SweepResults:
  b, t, h, dim_k = ins.x.shape  # T unpadded, or whole chunks
  dim_v = ins.z.shape[-1]
  cfg = configs.chunk_loop
  c, be = cfg.chunk_size, cfg.block_e
  n_e = dim_v // be
  num_chunks = -(-t // c)
  tp = num_chunks * c
  sequences = ins.sequence_bounds is not None
  ns = -(-num_chunks // slice_chunks)
  final_state = final_tangent = pieces = None
  if sequences:
    if b != 1 or ins.tangent_with is not None:
      raise ValueError("sequence programs run a batch of one, without a decay tangent")
    # Each sequence a slice of its own (`_sequence_steps`) from its own state, or, where the row would be split,
    # each piece of a sequence within one slice, from the state before it (`packing.piece_starts`).
    sequence_states = ins.initial_state
    if given_starts is not None or (ns > 1 and ins.sequence_bounds.shape[0] - 1 + ns - 1 <= packing.MAX_PIECES):
      pieces = packing.sequence_pieces(ins.sequence_bounds, seq_len=seq_len, slice_tokens=slice_chunks * c)
      ins = _with_sequences(ins, pieces.bounds)
      if given_starts is not None:
        starts = chunk_common.pad_state(given_starts.states, dim_k, dim_v)
      else:
        own = _own_states(ins, cfg=configs.slice_states, chunk_size=c, seq_len=seq_len, reverse=reverse,
                          slice_chunks=slice_chunks, num_slices=pieces.sequence.shape[0], branch=branch,
                          interpret=interpret, transposed=transposed_states).final_state
        starts = packing.piece_starts(own, pieces, token_rates, sequence_states, reverse=reverse)
      ins = ins._replace(initial_state=starts)
    if pieces is None:
      ins = _with_sequences(ins, ins.sequence_bounds)
    ns = ins.sequence_bounds.shape[0] - 1
  elif given_starts is not None:  # another sweep's first pass (see `sweep`), padded to this one's dims
    ins = ins._replace(initial_state=chunk_common.pad_state(given_starts.states, dim_k, dim_v))
  elif ns > 1:
    (states, tangents), (final_state, final_tangent) = slice_starts(
        ins, cfg=configs.slice_states, chunk_size=c, seq_len=seq_len, reverse=reverse, slice_chunks=slice_chunks,
        with_final_state=with_final_state, branch=branch, interpret=interpret, transposed=transposed_states)
    ins = ins._replace(initial_state=states, initial_tangent=tangents)
  elif ins.initial_state is not None:
    ins = ins._replace(initial_state=ins.initial_state[:, :, None])

  coords = functools.partial(_program_coords, h=h, ns=ns, n_e=n_e, sequences=sequences)

  def spec(block, index):  # index: (batch, head, slot, value block) -> the block's
    return pl.BlockSpec(block, lambda i: index(*coords(i)))

  def rows(width, by_column):
    return spec((None, t, None, width), lambda bi, hi, si, e: (bi, 0, hi, e if by_column else 0))

  start = spec((None, None, None, dim_k, be), lambda bi, hi, si, e: (bi, hi, si, 0, e))
  state = spec((None, None, dim_k, be), lambda bi, hi, si, e: (bi, hi, 0, e))  # one slice
  if sequences:  # [N, H, K, V]: every sequence's, indexed in the kernel
    start = state = spec((ns, None, dim_k, be), lambda bi, hi, si, e: (0, hi, 0, e))
  whole = lambda *_: (0,)  # noqa: E731
  in_specs = _present(ins, decay=spec((None,), lambda bi, hi, si, e: (hi,)),
                      sequence_bounds=spec((ns + 1,), whole), sequence_order=spec((ns,), whole),
                      chunk_cumdecay=_gate_rows(ins.chunk_cumdecay, spec, lambda bi, hi, si, e: (bi, hi, 0)),
                      chunk_runs=_gate_rows(ins.chunk_runs, spec, lambda bi, hi, si, e: (bi, 0)),
                      chunk_next_start=_gate_rows(ins.chunk_next_start, spec, lambda bi, hi, si, e: (bi, 0)),
                      x=rows(dim_k, False), y=rows(dim_k, False), z=rows(be, True), dual_with=rows(be, True),
                      initial_state=start, initial_tangent=start, tangent_with=rows(be, True),
                      dot_with=rows(be, True))
  # With slices the final state and tangent come from the combine.
  results = _output_structs(ins, n_e=n_e, with_final_state=with_final_state and (ns == 1 or sequences),
                            out_dtype=out_dtype, dots_with_dual=dots_with_dual, tp=tp,
                            num_states=ns if sequences else None)
  out_specs = _present(
      results, out=rows(be, True),
      dual=spec((None, None, t, None, dim_k), lambda bi, hi, si, e: (e, bi, 0, hi, 0)),
      final_state=state,
      row_dots=spec((None, None, None, tp), lambda bi, hi, si, e: (bi, hi, e, 0)),
      final_tangent=state)
  kernel = functools.partial(_chunk_loop_kernel, scale=scale, chunk_size=c, seq_len=seq_len, num_chunks=num_chunks,
                             slice_chunks=slice_chunks, num_slices=ns, coords=coords, reverse=reverse,
                             exact=ins.x.dtype == _F32, dots_with_dual=dots_with_dual, branch=branch)
  outs = _call(kernel, (b * h * ns * n_e,), ins, in_specs, results, out_specs, cfg, "lightning_chunk_loop",
               interpret)
  if pieces is not None:
    outs = outs._replace(
        final_state=None if outs.final_state is None else packing.sequence_ends(
            outs.final_state, pieces, sequence_states, reverse=reverse),
        slice_starts=SliceStarts(ins.initial_state, chunk_size=c, slice_chunks=slice_chunks))
  if ns > 1 and not sequences:
    outs = outs._replace(final_state=final_state, final_tangent=final_tangent,
                         slice_starts=SliceStarts(ins.initial_state, chunk_size=c, slice_chunks=slice_chunks))
  return outs


def _parallel(ins: SweepOperands, *, scale, seq_len, reverse, with_final_state, configs: SweepConfigs, out_dtype,
              slice_chunks, dots_with_dual, given_starts, transposed_states, branch, interpret,
              token_rates=None) -> SweepResults:
  del slice_chunks, given_starts, transposed_states, token_rates  # every chunk runs in parallel already: no split
  b, tp, h, dim_k = ins.x.shape
  dim_v = ins.z.shape[-1]
  exact = ins.x.dtype == _F32
  oc = configs.chunk_output
  c = oc.chunk_size
  n = tp // c

  # Pass 1: the state before every chunk (and the final state).
  states = _states_pass(ins, cfg=configs.chunk_states, chunk_size=c, seq_len=seq_len, reverse=reverse,
                        slice_chunks=n, num_slices=1, with_chunk_states=True, with_final_state=with_final_state,
                        with_tangent=ins.tangent_with is not None, branch=branch, interpret=interpret)

  # Pass 2: every chunk's outputs in parallel.
  be = oc.block_e
  n_e = dim_v // be

  def chunk(width, by_column):
    return pl.BlockSpec((None, c, None, width), lambda i, j, e: (i // h, j, i % h, e if by_column else 0))

  chunk_state = pl.BlockSpec((None, None, None, dim_k, be), lambda i, j, e: (i // h, i % h, j, 0, e))
  out_ins = ins._replace(initial_state=None, chunk_next_start=None, chunk_states=states.chunk_states,
                         chunk_tangents=states.chunk_tangents)
  results = _output_structs(ins, n_e=n_e, with_final_state=False, out_dtype=out_dtype, dots_with_dual=dots_with_dual,
                            tp=tp)
  kernel = functools.partial(_chunk_output_kernel, scale=scale, chunk_size=c, seq_len=seq_len, reverse=reverse,
                             exact=exact, dots_with_dual=dots_with_dual, branch=branch)
  outs = _call(
      kernel, (b * h, n, n_e), out_ins,
      _present(out_ins, decay=pl.BlockSpec((None,), lambda i, j, e: (i % h,)),
               chunk_cumdecay=pl.BlockSpec((None, None, tp), lambda i, j, e: (i // h, i % h, 0)),
               chunk_runs=pl.BlockSpec((None, tp), lambda i, j, e: (i // h, 0)), x=chunk(dim_k, False),
               y=chunk(dim_k, False), z=chunk(be, True), dual_with=chunk(be, True), chunk_states=chunk_state,
               chunk_tangents=chunk_state, tangent_with=chunk(be, True), dot_with=chunk(be, True)),
      results, _present(results, out=chunk(be, True),
                        dual=pl.BlockSpec((None, None, c, None, dim_k), lambda i, j, e: (e, i // h, j, i % h, 0)),
                        row_dots=pl.BlockSpec((None, None, None, c), lambda i, j, e: (i // h, i % h, e, j))),
      oc, "lightning_chunk_output", interpret)
  squeeze = lambda x: None if x is None else x[:, :, 0]  # noqa: E731  (one slice)
  return outs._replace(final_state=squeeze(states.final_state), final_tangent=squeeze(states.final_tangent))


LAUNCHERS = {"chunk_loop": _chunk_loop, "parallel": _parallel}



def _prepare(ins: SweepOperands, *, reverse: bool, opts: PallasOptions):
  """Pads `ins` for `opts.variant`'s kernels; returns (padded operands, configs, chunk size, slice chunks,
  whether chunks branch: `heuristics.branch_per_chunk`).

  The feature dims go to powers of two >= 16 (`config.padded_dim`), and for
  the parallel variant (its chunk blocks) T to a multiple of the chunk size;
  the chunk loop takes T as it is (its last chunk's loads and stores masked:
  no copy of the operands to whole chunks). Per-token rates and segment
  starts become the chunk gates of this sweep's direction, of whole chunks
  (`chunk_common.token_chunk_gates`).
  """
  if ins.tangent_with is not None and ins.decay is None:
    raise ValueError("the decay tangent needs a per-head decay")
  t, dim_k, dim_v = ins.y.shape[1], ins.y.shape[-1], ins.z.shape[-1]
  kp, vp = config_lib.padded_dim(dim_k), config_lib.padded_dim(dim_v)
  configs = heuristics.resolve(opts.config, dim_k=kp, dim_v=vp, itemsize=ins.y.dtype.itemsize,
                               compute_capability=opts.compute_capability,
                               job=config_lib.sweep_job(tangent=ins.tangent_with is not None,
                                                        dual=ins.dual_with is not None))
  chunk = (configs.chunk_loop if opts.variant == "chunk_loop" else configs.chunk_output).chunk_size
  tp = math.ceil(t / chunk) * chunk
  b, h = ins.y.shape[0], ins.y.shape[2]
  # Sequence programs: one per sequence already (their pieces split them further, `_chunk_loop`).
  sequences = 1 if ins.sequence_bounds is None else ins.sequence_bounds.shape[0] - 1
  slice_chunks = heuristics.slice_chunks(
      programs=b * h * sequences * (vp // configs.chunk_loop.block_e), num_chunks=tp // chunk, chunk_size=chunk,
      num_sms=opts.num_sms, slice_size=None if opts.config is None else opts.config.slice_size)
  pad_rows = functools.partial(chunk_common.pad_tokens_and_features, num_tokens=tp if opts.variant == "parallel" else t)
  padded = ins._replace(x=pad_rows(ins.x, dim=kp), y=pad_rows(ins.y, dim=kp), z=pad_rows(ins.z, dim=vp),
                        dual_with=pad_rows(ins.dual_with, dim=vp), tangent_with=pad_rows(ins.tangent_with, dim=vp),
                        dot_with=pad_rows(ins.dot_with, dim=vp),
                        initial_state=chunk_common.pad_state(ins.initial_state, kp, vp))
  if ins.token_decay is not None or ins.segment_starts is not None:
    if ins.decay is not None and ins.token_decay is not None:
      raise ValueError("give decay (per head) or token_decay, not both")
    cumdecay, runs = chunk_common.token_chunk_gates(ins.token_decay, ins.segment_starts, chunk_size=chunk,
                                                    num_tokens=tp, reverse=reverse)
    # Without segments the kernels get no counts, and mask nothing.
    padded = padded._replace(token_decay=None, segment_starts=None, chunk_cumdecay=cumdecay,
                             **segment_fields(runs if ins.segment_starts is not None else None, chunk_size=chunk,
                                              num_chunks=tp // chunk, reverse=reverse))
  return padded, configs, chunk, slice_chunks, heuristics.branch_per_chunk(dual=ins.dual_with is not None)


def sweep(ins: SweepOperands, *, reverse: bool, with_final_state: bool, out_dtype, opts: PallasOptions,
          dots_with_dual: bool = False, given_starts: SliceStarts | None = None,
          transposed_states: bool = False) -> SweepResults:
  """One sweep of `opts.variant` ("chunk_loop" or "parallel") on unpadded operands.

  Pads T to a multiple of the chunk size and the feature dims to powers of two
  >= 16 (`config.padded_dim`), resolves the blocks for this sweep
  (`heuristics.resolve`) and the chunk loop's sequence split
  (`heuristics.slice_chunks`), runs the launcher and slices the padding off.

  Args:
    ins: `SweepOperands` with x, y, z (and optionally decay, initial_state,
      dual_with, tangent_with; chunk_states and chunk_tangents None).
    reverse: the anti-causal sweep of the backward pass.
    with_final_state: whether to write the final state (and tangent); the
      kernels skip the float32 [B, H, K, V] write(s) nobody reads.
    out_dtype: dtype of `out` and `dual`.
    dots_with_dual: row dots of out with `dual_with` (u . out, from what the
      kernels load for the dual output); `ins.dot_with` is then None.
    given_starts: a sequence split's first pass over this sweep's y and z
      (another sweep's `SliceStarts`, transposed): the split takes its
      slices instead of running the pass. Used where the chunk loop runs
      chunks of its size and a split, without a tangent or the final state
      (which the pass gives); else ignored.
    transposed_states: the sweep carries the transpose of another sweep's
      state over the same operands (y and z swapped), whose first pass was
      not handed over: a split runs that sweep's pass, transposed
      (`slice_starts`), which XLA's CSE may merge with it.

  Returns:
    `SweepResults` with out, and dual, final_state, row_dots, final_tangent
    where asked for (see `SweepOperands`), unpadded, and the split's
    `slice_starts` where the sequence was split.
  """
  t, dim_k, dim_v = ins.x.shape[1], ins.x.shape[-1], ins.z.shape[-1]
  if ins.sequence_bounds is not None and opts.variant != "chunk_loop":
    raise ValueError(f"sequence programs (sequence_bounds) run the chunk loop, not {opts.variant!r}")
  if reverse and ins.sequence_bounds is not None and ins.token_decay is not None:
    # A reverse sweep's step takes the next token's rate: none at a sequence's last token (gates and pieces alike).
    ins = ins._replace(token_decay=packing.without_next_rates(ins.token_decay, ins.sequence_bounds))
  padded, configs, chunk, slice_chunks, branch = _prepare(ins, reverse=reverse, opts=opts)
  if given_starts is not None and (opts.variant != "chunk_loop" or given_starts.chunk_size != chunk
                                   or given_starts.slice_chunks >= -(-padded.x.shape[1] // chunk)
                                   or with_final_state or ins.tangent_with is not None):
    given_starts = None
  res = LAUNCHERS[opts.variant](padded, scale=opts.scale, seq_len=t, reverse=reverse,
                                with_final_state=with_final_state, configs=configs, out_dtype=out_dtype,
                                slice_chunks=slice_chunks if given_starts is None else given_starts.slice_chunks,
                                dots_with_dual=dots_with_dual, given_starts=given_starts,
                                transposed_states=transposed_states, branch=branch, interpret=opts.interpret,
                                token_rates=ins.token_decay if ins.sequence_bounds is not None else None)

  def unpad_state(s):
    return None if s is None else s[:, :, :dim_k, :dim_v]

  dual = res.dual
  if dual is not None:  # the value blocks' partial sums
    dual = (dual[0] if dual.shape[0] == 1 else dual.sum(axis=0).astype(out_dtype))[:, :t, :, :dim_k]
  starts = res.slice_starts
  if starts is not None:
    starts = dataclasses.replace(starts, states=starts.states[..., :dim_k, :dim_v])
  return SweepResults(out=res.out[:, :t, :, :dim_v], dual=dual, final_state=unpad_state(res.final_state),
                      row_dots=None if res.row_dots is None else res.row_dots.sum(axis=2)[:, :, :t],
                      final_tangent=unpad_state(res.final_tangent), slice_starts=starts)


def sweep_final_state(ins: SweepOperands, *, reverse: bool, opts: PallasOptions) -> jax.Array:
  """The state a sweep ends with, from `ins.initial_state` (or zeros), without its outputs: [B, H, K, V] float32.

  Reads y, z and the gates only (x is not needed): the states kernel of the
  chunk loop, over slices of the sequence combined as in the sequence split.
  This is the local state of sequence parallelism (`sequence_parallel`).
  """
  dim_k, dim_v = ins.y.shape[-1], ins.z.shape[-1]
  opts = dataclasses.replace(opts, variant="chunk_loop")
  padded, configs, chunk, slice_chunks, branch = _prepare(ins._replace(x=None), reverse=reverse, opts=opts)
  _, (final_state, _) = slice_starts(padded, cfg=configs.slice_states, chunk_size=chunk, seq_len=ins.y.shape[1],
                                     reverse=reverse, slice_chunks=slice_chunks, with_final_state=True,
                                     branch=branch, interpret=opts.interpret)
  return final_state[:, :, :dim_k, :dim_v]
