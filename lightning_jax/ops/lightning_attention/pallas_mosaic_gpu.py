"""The warp-specialised forward sweep in Pallas Mosaic GPU (Hopper, sm90).

Every Mosaic-GPU-specific import of the package lives in this file and in
`delta_attention.pallas_mosaic_gpu` (the delta rule's backward sweeps, built
from this file's pieces), beside the Triton kernels of `pallas_triton`. It
computes the lightning op's forward pass, from an optional initial state
and optionally returning the final one, and, unless a per-head rate takes a
gradient, the backward's dq sweep (a forward over (do, v, k), `vjp`) and, at
D > 64, its dv and dk sweeps (`forward(..., reverse=True)`: the chunks walked
last to first); trained per-token rates take the float32 row dots of its
output (`forward_padded(dot_with=...)`).

One CTA per (head, batch and slice of the sequence, block of 64 value columns)
walks the chunks of 64 tokens of its slice in order (the whole sequence unless
`forward` splits it), split into three warpgroups that run concurrently:

  memory  issues the TMA loads of each chunk's q, k, v tiles into a ring of
          `num_stages` slots, all on the slot's one barrier (H200: 1.5-3.5%
          less time than a barrier per tile), refilling a slot once both
          others released it;
  state   carries S^T [64, K] (float32, in wgmma registers) down the chunks,
          S^T <- a^C S^T + (key * v)^T k, and publishes S_n (bf16/fp16, the
          state before chunk n) in `published_states` buffers; it starts from the initial
          state and writes the final one when asked, both float32 and staged
          through the publishing buffer's shared memory, idle then;
  output  computes o = row * (q S_n) + (intra * q k^T) v for chunk n and
          stores it by TMA (with `dot_with`, its row dots beside it: the
          memory warpgroup loads their weights with q, k and v).

So the serial state chain, the output matmuls and the loads overlap, which a
Triton program (one instruction stream) cannot do (benchmarks/PERFORMANCE.md,
"Warp-specialised forward (sm90)"). The decay factors (`chunk_common`, with
scale folded into the row and intra factors) come in one of two forms:

  per head  (a per-head rate or none) computed outside and loaded once;
            with packed sequences, each chunk's segment-start counts come
            with its q, k, v and mask them, in a chunk where a segment
            starts (no exp2 in the kernel);
  per chunk (per-token rates) each chunk's cumulative
            rates (and segment counts, `chunk_factors`) loaded with its q, k,
            v; each warpgroup builds the factors it needs from them, so that
            no factor per chunk crosses HBM. Where a chunk's rates sum to at
            most `chunk_common.FACTORIZED_MAX_LOG2`, the output warpgroup
            factorises the intra factors, 2^(c_j - c_i) = 2^(c_j - m) 2^(m - c_i), from
            2C exp2 instead of C^2 (PERFORMANCE.md, "Per-token decay and
            packed sequences").

Compiled, left operands of wgmma stay in registers where that measured faster
(`_register_operands`); interpreted, they are staged in shared memory.

The delta rule's forward (`delta_attention.warp_specialized`) runs the same
kernel in its delta mode (`forward_padded`'s `delta_inverse`): the memory
warpgroup also loads each chunk's T' = (I + A)^{-1} Diag(beta), and the state
warpgroup forms its pseudo-values U = T' (V - K_g S) before its update and
publishes them with S_n for the output warpgroup, which multiplies them in
place of v. With `delta_states` the third warpgroup also stores the published
S_n^T and U^T (the delta backward's residuals); the backward's state sweep
(`delta_attention.pallas_mosaic_gpu.state_sweep`) runs it so without outputs:
no q, and the third warpgroup stores them alone. With KDA's per-key-channel
gates (`delta_channel_gates`) q and k come gated (Q_g, K_g), the ring also
holds each chunk's K_C, P and the state's decay per key channel, the update
scales S^T's columns by that decay, and the output warpgroup takes P from the
ring in place of its weighted q k^T.

Where the kernel runs is `heuristics.warp_specialized_unsupported`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import manual_axes
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import pallas_triton
from lightning_jax.ops.lightning_attention.config import PallasOptions, WarpSpecializedConfig

CHUNK_SIZE = WarpSpecializedConfig.CHUNK_SIZE
BLOCK_E = WarpSpecializedConfig.BLOCK_E
_F32 = jnp.float32
# No warpgroup rebalances its registers (setmaxnreg): all three keep the 168 per
# thread of a 384-thread CTA. With the memory warpgroup cut to 40 (and 24, 56, 72
# tried), ptxas (CUDA 13.0) left values of the shared prologue in registers above
# the cut in some kernels of both modes (one compiled sweep: 4 of 224 variants at
# 40; e.g. R164 after a cut to 40), which faults with CUDA_ERROR_ILLEGAL_INSTRUCTION.
# At 168 none of the 224 spills; on an H200 the forwards took the same time
# within 2%, DeltaNet at B1 H16 T32K D128 4% more (PERFORMANCE.md, "Delta attention").


def decay_factors(decay, heads: int, *, scale: float, last_rows: int = CHUNK_SIZE, reverse: bool = False):
  """Per-head factors: intra [H, C, C] and vectors [H, 5, C] (row, key, state; last key, last state), float32.

  With scale folded in: intra = scale * a^(i-j) on j <= i, row = scale * a^(i+1),
  key = a^(C-1-j), and the state factor a^C repeated along the last axis; then
  the key and state factors of a last chunk of `last_rows` real rows, which the
  final state needs (a^(L-1-j) on j < L, else 0, and a^L). Without decay a = 1.
  `reverse`: the anti-causal sweep's (`chunk_common.chunk_decay_factors`):
  intra on j >= i, row = scale * a^(C-1-i), key = a^(j+1).
  """
  c = CHUNK_SIZE
  lam2 = (jnp.zeros((heads,), _F32) if decay is None else decay.astype(_F32)) * chunk_common.LOG2_E
  full, last = (jax.vmap(lambda l, end=end: chunk_common.chunk_decay_factors(l, end, chunk_size=c, reverse=reverse))(
      lam2) for end in (c, last_rows))
  repeat = lambda x: jnp.broadcast_to(x[:, None], (heads, c))  # noqa: E731
  vectors = jnp.stack([scale * full.row, full.key, repeat(full.state), last.key, repeat(last.state)], axis=1)
  return scale * full.intra, vectors


# Rows of the per-head factors (`decay_factors`) and of a chunk's (`chunk_factors`).
_ROW, _KEY, _STATE, _LAST_KEY, _LAST_STATE = range(5)
CUM, RUNS = 0, 1
# Subtracted per segment start in an exponent (log2 units): 2^-1e4 is 0 in float32.
_SEGMENT_EXPONENT = 1.0e4


def chunk_factors(cumdecay, runs):
  """Per-chunk factors of per-token rates and segment starts, [B, H, N, F, C] float32.

  Rows: the cumulative rates (`CUM`, log2 units) and, with segments (F = 2),
  the segment-start counts (`RUNS`): the inputs of
  `chunk_common.token_decay_factors`, which the kernel computes from them.

  Args:
    cumdecay: [B, H, Tp] float32 (`chunk_common.token_chunk_gates`, forward).
    runs: [B, Tp] int32 segment-start counts, or None (no segments).
  """
  b, h, tp = cumdecay.shape
  cum = cumdecay.reshape(b, h, tp // CHUNK_SIZE, 1, CHUNK_SIZE)
  if runs is None:
    return cum
  run_counts = jnp.broadcast_to(runs.reshape(b, 1, tp // CHUNK_SIZE, 1, CHUNK_SIZE).astype(_F32), cum.shape)
  return jnp.concatenate([cum, run_counts], axis=3)


def scaled_causal_mask(scale: float, *, reverse: bool = False) -> np.ndarray:
  """scale on the causal mask j <= i (`reverse`: the anti-causal one, j >= i), [C, C] float32: the per-chunk
  factors' intra operand. A constant of the program: XLA does not fold one built from iotas, so each call would
  launch a kernel to form it."""
  full = np.full((CHUNK_SIZE, CHUNK_SIZE), scale, np.float32)
  return np.triu(full) if reverse else np.tril(full)


def sweep_gates(decay, segment_starts, *, num_tokens: int, reverse: bool = False):
  """The warp-specialised kernels' gates (this op's forward and reverse sweeps; the delta rule's forward and
  backward sweeps): (cumdecay [B, H, Tp] float32 or None, runs [B, Tp] int32 or None), as
  `chunk_common.token_chunk_gates` gives them for a sweep over 64-token chunks (`reverse`: the anti-causal one's),
  from per-token rates [B, T, H] or None and segment starts [B, T] or None (T <= num_tokens)."""
  if decay is None and segment_starts is None:
    return None, None
  cumdecay, runs = chunk_common.token_chunk_gates(decay, segment_starts, chunk_size=CHUNK_SIZE, num_tokens=num_tokens,
                                                  reverse=reverse)
  return cumdecay, None if segment_starts is None else runs


def swizzled_smem(shape, dtype):
  """Shared memory in rows of 128 bytes (64 bf16 elements), swizzled: the layout wgmma reads."""
  swizzle_elems = 128 // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle_elems)),
                                              plgpu.SwizzleTransform(128)))


def update(init, *products, in_registers, during=None):
  """init + sum of a @ b over the (a, b) products through wgmma: in registers, the accumulator started from init
  (`ACC.init`, compiled only); else (the a staged in shared memory, as the interpreter needs) the products added to
  init after them. during: None, or called once the products are issued, before they are waited for (work that
  overlaps them on the tensor cores; in registers only)."""
  if in_registers:
    def accumulate(acc):
      for a, b in products:
        plgpu.wgmma(acc, a, b)
      if during is not None:
        during()
    return pl.run_state(accumulate)(plgpu.ACC.init(init))
  assert during is None, "during overlaps products whose operands are in registers"

  def product(acc):
    for a, b in products:
      plgpu.wgmma(acc, a, b)
    return acc[...]
  return init + pl.run_scoped(product, plgpu.ACC(init.shape, _F32))


def last_chunks(num_chunks, count: int):
  """The first of the last `count` chunks of num_chunks (an int, or traced: a sequence's own chunks), at least 0."""
  return max(num_chunks - count, 0) if isinstance(num_chunks, int) else jnp.maximum(num_chunks - count, 0)


def fill_ring(load, released, *, num_chunks, num_stages: int):
  """The memory warpgroup's loop: load(n, slot) issues chunk n's loads into the ring's slot, first num_stages of
  them, then each once both compute warpgroups released the slot (`released`, one barrier a slot). num_chunks: an
  int, or traced (a sequence's own chunks). The first loads run in a loop too: a chunk index is then traced, so a
  tile may run past an unpadded operand's rows (TMA reads zeros there), which a static slice may not."""
  first = min(num_stages, num_chunks) if isinstance(num_chunks, int) else jnp.minimum(num_chunks, num_stages)

  @pl.loop(0, first)
  def _first(n):
    load(n, n)

  @pl.loop(num_stages, num_chunks)
  def _refill(n):
    slot = lax.rem(n, num_stages)
    plgpu.barrier_wait(released.at[slot])  # both compute warpgroups are done with chunk n - num_stages
    load(n, slot)

  # Every completed phase of a barrier a warpgroup waits on is observed
  # before the kernel ends (the GPU interpreter checks it): here the releases
  # of the last chunks.
  @pl.loop(last_chunks(num_chunks, num_stages), num_chunks)
  def _drain(n):
    plgpu.barrier_wait(released.at[lax.rem(n, num_stages)])


def update_exponents(rows, *, cum_end, runs_end, has_segments):
  """A chunk's factors of the state update (log2 units), from its factor rows [F, C] (`chunk_factors`) and their
  last entries: key_j = c_j - c_end and the state's -c_end, each minus _SEGMENT_EXPONENT per segment start after row
  j (in the chunk)."""
  key_exponent = jnp.minimum(rows[CUM] - cum_end, 0.0)
  state_exponent = -cum_end
  if has_segments:
    key_exponent = key_exponent - _SEGMENT_EXPONENT * jnp.maximum(runs_end - rows[RUNS], 0.0)
    state_exponent = state_exponent - _SEGMENT_EXPONENT * runs_end
  return key_exponent, state_exponent


def sees_prior_state(runs):
  """Packed rows: 1 for a chunk's rows before its first segment start (they see the state before the chunk), else
  0, float32, from the chunk's segment-start counts runs [C] (non-decreasing along the chunk in sweep order); of the
  last count, 1 where the state carries over the chunk. Arithmetic masks: the warpgroup lowering broadcasts no
  scalar."""
  return 1.0 - jnp.minimum(runs, 1.0)


def reaches_chunk_end(runs, runs_end):
  """Packed rows: 1 for a chunk's rows in its last segment in sweep order (their keys reach its end), else 0,
  float32, from its segment-start counts runs [C] and the last of them (`sees_prior_state`'s)."""
  return 1.0 - jnp.minimum(runs_end - runs, 1.0)


def row_exponents(rows, *, has_segments):
  """A chunk's query-row factors (log2 units) from its factor rows: -c_i, driven to -inf past a segment start."""
  row_exponent = -rows[CUM]
  if has_segments:
    row_exponent = row_exponent - _SEGMENT_EXPONENT * rows[RUNS]
  return row_exponent


def pair_weights(intra, rows, columns, *, cum_end, has_segments):
  """A chunk's [C, C] score factors of per-token rates: intra_ij (the scaled causal mask) times 2^(c_j - c_i),
  zero across a segment start. rows, columns: the chunk's factor rows, read along the rows and, from their second
  copy, along the columns of the scores (one load cannot take both layouts)."""
  c = intra.shape[0]
  by_row = lambda x: lax.broadcast_in_dim(x, (c, c), (0,))  # noqa: E731
  by_column = lambda x: lax.broadcast_in_dim(x, (c, c), (1,))  # noqa: E731

  def factorized():
    # 2^(c_j - c_i) = 2^(m - c_i) 2^(c_j - m), m = c_end / 2: each factor in
    # [2^-60, 2^60], applied after the mask, so that no entry overflows.
    mid = 0.5 * cum_end
    mask = intra
    if has_segments:
      mask = jnp.where(by_row(rows[RUNS]) == by_column(columns[RUNS]), intra, 0.0)
    return mask * by_row(jnp.exp2(mid - rows[CUM])) * by_column(jnp.exp2(columns[CUM] - mid))

  def clamped():
    # Exponents clamped at 0, so that no entry outside the causal mask
    # overflows (the mask zeroes them); a segment start drives them to -inf.
    gap = by_column(columns[CUM]) - by_row(rows[CUM])
    if has_segments:
      gap = gap - _SEGMENT_EXPONENT * (by_row(rows[RUNS]) - by_column(columns[RUNS]))
    return intra * jnp.exp2(jnp.minimum(gap, 0.0))

  return lax.cond(cum_end <= chunk_common.FACTORIZED_MAX_LOG2, factorized, clamped)


def delta_pseudo_values(state_in, keys, inverse, values, rows, *, has_segments, staging=None):
  """A delta chunk's U^T = (V - K_g S)^T T'^T [BLOCK_E, C] float32 (K_g = 2^-c K, zero on rows after a segment
  start): the first half of the chain's step.

  state_in: S^T [BLOCK_E, K] in the input dtype; keys [C, K], inverse T' [C, C]
  and values [C, BLOCK_E] the chunk's tiles in shared memory (values None:
  zeros, the identity columns of the sequence split's map pass); rows: its
  factor rows (`chunk_factors`), or None where the keys come gated (K_g itself,
  KDA's) or there are no gates (K_g = K). staging: None (the left operands of
  wgmma in registers, compiled), or shared memory for them, (S^T [BLOCK_E, K],
  [BLOCK_E, C]), as the interpreter needs.
  """
  c, be = CHUNK_SIZE, BLOCK_E
  dtype = state_in.dtype
  if staging is not None:
    staging[0][...] = state_in
    plgpu.commit_smem()
    state_in = staging[0]

  def projection(acc):  # (K S)^T
    plgpu.wgmma(acc, state_in, keys.transpose((1, 0)))
    return acc[...]

  projected = pl.run_scoped(projection, plgpu.ACC((be, c), _F32))
  by_column = lambda x: lax.broadcast_in_dim(x, (be, c), (1,))  # noqa: E731
  if rows is None:
    correction = (-projected).astype(dtype)
  else:
    correction = (projected * by_column(-jnp.exp2(row_exponents(rows, has_segments=has_segments)))).astype(dtype)
  if staging is not None:
    staging[1][...] = correction
    plgpu.commit_smem()
    correction = staging[1]
  inverse_t = inverse.transpose((1, 0))

  # U^T = V^T T'^T + correction T'^T, V^T read transposed from shared memory by wgmma (no register copy).
  def pseudo_values(acc):
    if values is not None:
      plgpu.wgmma(acc, values.transpose((1, 0)), inverse_t)
    plgpu.wgmma(acc, correction, inverse_t)
    return acc[...]

  return pl.run_scoped(pseudo_values, plgpu.ACC((be, c), _F32))


def delta_update(state_t, values_t, keys, key_exponent, state_exponent, *, staging=None, during=None,
                 channel_decay=None):
  """The chain step's second half: S^T <- 2^state_exponent S^T + (2^key_exponent * U^T) k, float32 [BLOCK_E, K].
  values_t: `delta_pseudo_values`'; the exponents `update_exponents`', or None (no gates: DeltaNet unpacked, or
  KDA's below); keys, staging as there; during as `update`'s. channel_decay: None, or (KDA) the state's decay per
  key channel [K] float32, the keys K_C coming gated: S^T <- S^T Diag(channel_decay 2^state_exponent) +
  (2^key_exponent * U^T) K_C, the exponents packed rows' segment masks (`update_exponents` of zero rates)."""
  scaled, decayed = values_t, state_t
  if key_exponent is not None:
    scaled = values_t * lax.broadcast_in_dim(jnp.exp2(key_exponent), values_t.shape, (1,))
  if channel_decay is not None:
    if state_exponent is not None:
      channel_decay = channel_decay * jnp.exp2(state_exponent)
    decayed = state_t * lax.broadcast_in_dim(channel_decay, state_t.shape, (1,))
  elif state_exponent is not None:
    decayed = state_t * jnp.exp2(state_exponent)
  scaled = scaled.astype(keys.dtype)
  if staging is not None:
    staging[1][...] = scaled
    plgpu.commit_smem()
    scaled = staging[1]
  return update(decayed, (scaled, keys), in_registers=staging is None, during=during)


def _kernel(intra_ref, vectors_ref, q_ref, k_ref, v_ref, *refs, num_chunks, num_slices, num_stages, published,
            per_chunk, has_decay, has_segments, has_initial, has_final, last_rows, scale, register_state,
            register_scores, delta, delta_states, with_outputs, overlap_publish, channel_gated, sequences,
            reverse_chunks, row_dots):
  refs = list(refs)
  # The delta rule: each chunk's T' = (I + A)^{-1} Diag(beta) [B, H, Tp, C]; with KDA's per-channel gates
  # (`channel_gated`: q and k come as Q_g and K_g) K_C [B, Tp, H, K], P [B, H, Tp, C] and the state's decay
  # [B, H, N, 1, K] float32.
  inverse_ref = refs.pop(0) if delta else None
  keys_end_ref, pairs_ref, channel_decay_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if channel_gated else (
      None, None, None)
  # Per-head factors with packed sequences: each chunk's segment-start counts [B, N, 1, C].
  head_segments = has_segments and not per_chunk
  runs_ref = refs.pop(0) if head_segments else None
  initial_ref = refs.pop(0) if has_initial else None
  # `sequences`: each sequence's chunk bounds [2, S] int32 (its first chunk, one past its last).
  bounds_ref = refs.pop(0) if sequences else None
  # `row_dots`: the weights w [B, T', H, V] of the output's row dots.
  dots_ref = refs.pop(0) if row_dots else None
  # The output, its row dots [B, H, V / BLOCK_E, Tp] float32, and (the delta rule's `delta_states`) S_n^T
  # [B, H, N, V, K] and U^T [B, H, V, Tp].
  out_ref = refs.pop(0) if with_outputs else None
  row_dots_ref = refs.pop(0) if row_dots else None
  states_out_ref, values_out_ref = (refs.pop(0), refs.pop(0)) if delta_states else (None, None)
  final_ref = refs.pop(0) if has_final else None
  buffers, barriers = refs
  q_smem, k_smem, v_smem, state_smem, (out_smem, intra_smem), vectors_smem, *buffers = buffers
  # The delta rule: the ring's T tiles and the published U^T [published, BLOCK_E, C].
  inverse_smem, values_smem = (buffers.pop(0), buffers.pop(0)) if delta else (None, None)
  keys_end_smem, pairs_smem, channel_decay_smem = (buffers.pop(0), buffers.pop(0), buffers.pop(0)) if (
      channel_gated) else (None, None, None)
  # Left operands of wgmma staged in shared memory where they do not stay in registers (`_register_operands`):
  # the weighted scores, key * v (the delta rule: -(K_g S)^T, then key * U^T, [BLOCK_E, C], and the state
  # S^T [BLOCK_E, K]).
  scores_smem = None if register_scores else buffers.pop(0)
  vk_smem = None if register_state else buffers.pop(0)
  state_in_smem = buffers.pop(0) if delta and not register_state else None
  # Per chunk: a second copy of each chunk's factors. Per head with segments: each chunk's segment-start
  # counts, twice (along the rows and along the columns of the scores).
  factors_by_column = buffers.pop(0) if per_chunk else None
  runs_smem, runs_by_column = (buffers.pop(0), buffers.pop(0)) if head_segments else (None, None)
  # The ring's tiles of the row dots' weights, and the row dots of the last two chunks' outputs.
  dots_smem, row_dots_smem = buffers if row_dots else (None, None)
  # `loaded`: one barrier a slot, for every tile of the chunk (each copy arrives on it).
  loaded, released, state_ready, state_read, factors_loaded = barriers[:5]
  barriers = list(barriers[5:])
  if has_initial or has_final:
    # The float32 initial/final state shares memory with the published states:
    # it is read before the first one is published and written after the last is read.
    state_smem, state_f32_smem = state_smem
  if has_initial:
    (initial_loaded,) = barriers
  c, be = CHUNK_SIZE, BLOCK_E
  head, col = lax.axis_index("heads"), lax.axis_index("value_blocks")
  # A CTA walks `num_chunks` chunks of one slice of the sequence (see `forward`), or with `sequences` a
  # sequence's own chunks of the one row (a traced count: an empty sequence's CTA walks none); unsplit, the
  # offsets stay static.
  batch, sequence_slice, first_chunk = lax.axis_index("batch_slices"), 0, 0
  if sequences:
    batch, sequence_slice = 0, batch
    first_chunk = bounds_ref[0, sequence_slice]
    num_chunks = bounds_ref[1, sequence_slice] - first_chunk
  elif num_slices > 1:
    batch, sequence_slice = lax.div(batch, num_slices), lax.rem(batch, num_slices)
    first_chunk = sequence_slice * num_chunks
    if reverse_chunks is not None and reverse_chunks < num_slices * num_chunks:
      # Reversed, the slices start at T's last chunk (the Triton states pass's): the last one walks what is left.
      num_chunks = jnp.minimum(num_chunks, reverse_chunks - first_chunk)
  cols = pl.ds(col * be, be)
  wg = lax.axis_index("wg")

  def chunk_of(n):  # the chunk of step n; reversed (`reverse_chunks`: the chunks in all), the last first
    return first_chunk + n if reverse_chunks is None else reverse_chunks - 1 - first_chunk - n

  # The row of a chunk's segment-start counts (and per-chunk cumulative rates) that holds its total: its last in
  # sweep order.
  total_row = c - 1 if reverse_chunks is None else 0

  def chunk_rows(n):
    start = chunk_of(n) * c
    return pl.ds(start if isinstance(start, int) else pl.multiple_of(start, c), c)

  def slot_of(n):
    return lax.rem(n, num_stages)

  @pl.when(wg == 0)
  def _memory():
    if per_chunk:  # the scaled causal mask; the rest comes with each chunk
      plgpu.copy_gmem_to_smem(intra_ref, intra_smem, factors_loaded.at[0])
    else:
      plgpu.copy_gmem_to_smem(intra_ref.at[head], intra_smem, factors_loaded.at[0])
      plgpu.copy_gmem_to_smem(vectors_ref.at[head], vectors_smem, factors_loaded.at[1])

    def load(n, slot):
      rows = chunk_rows(n)
      if with_outputs:  # else the chain alone reads the ring
        plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, head], k_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[batch, rows, head, cols], v_smem.at[slot], loaded.at[slot])
      if row_dots:
        plgpu.copy_gmem_to_smem(dots_ref.at[batch, rows, head, cols], dots_smem.at[slot], loaded.at[slot])
      if delta:
        plgpu.copy_gmem_to_smem(inverse_ref.at[batch, head, rows], inverse_smem.at[slot], loaded.at[slot])
      if channel_gated:
        plgpu.copy_gmem_to_smem(keys_end_ref.at[batch, rows, head], keys_end_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(pairs_ref.at[batch, head, rows], pairs_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(channel_decay_ref.at[batch, head, chunk_of(n)], channel_decay_smem.at[slot],
                                loaded.at[slot])
      if per_chunk:
        for factors_smem in (vectors_smem, factors_by_column):
          plgpu.copy_gmem_to_smem(vectors_ref.at[batch, head, chunk_of(n)], factors_smem.at[slot],
                                  loaded.at[slot])
      elif head_segments:
        for runs_buffer in (runs_smem, runs_by_column):
          plgpu.copy_gmem_to_smem(runs_ref.at[batch, chunk_of(n)], runs_buffer.at[slot], loaded.at[slot])

    fill_ring(load, released, num_chunks=num_chunks, num_stages=num_stages)

  def chunk_factor_rows(n):
    """Chunk n's factors in shared memory, [F, C] (per-chunk factors; per head with segments, its segment-start
    counts [1, C]), once its slot is `loaded`."""
    return (runs_smem if head_segments else vectors_smem).at[slot_of(n)]

  @pl.when(wg == 1)
  def _state_chain():
    if has_initial:
      plgpu.copy_gmem_to_smem(initial_ref.at[batch, head, sequence_slice, cols], state_f32_smem,
                              initial_loaded.at[0])
    if has_decay and not per_chunk:
      plgpu.barrier_wait(factors_loaded.at[1])

    def claim(m):
      """The publishing buffer of chunk m, once the output warpgroup is done with chunk m - published's."""
      buf = lax.rem(m, published)

      @pl.when(m >= published)
      def _():
        plgpu.barrier_wait(state_read.at[buf])

      return buf

    def hand_over(buf):
      plgpu.commit_smem()
      plgpu.barrier_arrive(state_ready.at[buf])

    def publish(m, state):
      """S_m out to the output warpgroup."""
      buf = claim(m)
      state_smem[buf] = state.astype(state_smem.dtype)
      hand_over(buf)

    def decay_exponents(slot, rows):
      """`update_exponents` of the chunk in the ring's slot. rows: its factor rows in shared memory."""
      return update_exponents(rows, cum_end=vectors_smem[slot, CUM, total_row],
                              runs_end=vectors_smem[slot, RUNS, total_row] if has_segments else None,
                              has_segments=has_segments)

    # Per-head factors are at hand: S_n goes out first thing in chunk n. Per-chunk
    # factors: S_{n+1} goes out as soon as it exists, at the end of chunk n, before
    # the chain waits for chunk n+1's k and v (PERFORMANCE.md, change 9 of "Per-token decay
    # and packed sequences": H100, B2 H32 T32K D128 per-token rates, 2% less time than
    # publishing during the update's product).
    def body(n, carry, head_factors):
      # Packed rows with a per-head rate carry the next chunk's total segment starts, read from HBM a chunk
      # ahead: a chunk where none starts (most) then keeps the head's factors, and the chain, which bounds
      # the kernel, neither waits for the counts nor masks (PERFORMANCE.md, change 13 of "Per-token decay and
      # packed sequences").
      state_t, runs_end = carry if head_segments else (carry, None)
      if head_segments:
        runs_next = runs_ref[batch, chunk_of(jnp.minimum(n + 1, num_chunks - 1)), 0, total_row]
      slot = slot_of(n)
      plgpu.barrier_wait(loaded.at[slot])
      if not per_chunk:
        publish(n, state_t)
      values, state_decay = v_smem.at[slot].transpose((1, 0)), None  # wgmma's left operand: v^T or (key * v)^T
      if has_decay:
        if per_chunk:
          # key_j = 2^(c_j - c_end), state = 2^-c_end, both zero across a segment start.
          key_exponent, state_exponent = decay_exponents(slot, chunk_factor_rows(n))
          key, state_decay = jnp.exp2(key_exponent), jnp.exp2(state_exponent)
        else:
          key, state_decay = head_factors
          if head_segments:  # zero for rows before the chunk's last segment; no state past a start
            # (counts, non-decreasing along the chunk: arithmetic masks, as warpgroup lowering broadcasts no scalar)
            def masked(key=key, state_decay=state_decay):
              return (key * reaches_chunk_end(chunk_factor_rows(n)[0], runs_end),
                      state_decay * sees_prior_state(runs_end))

            key, state_decay = lax.cond(runs_end > 0, masked, lambda: (key, state_decay))
          state_decay = state_decay[:, None]
        if register_state:  # in registers
          values = (values[...].astype(_F32) * lax.broadcast_in_dim(key, (be, c), (1,))).astype(v_smem.dtype)
        else:  # key * v staged, so that wgmma reads its transpose from shared memory
          vk_smem[...] = (v_smem[slot].astype(_F32) * key[:, None]).astype(vk_smem.dtype)
          plgpu.commit_smem()
          values = vk_smem.transpose((1, 0))
      decayed = state_t if state_decay is None else state_t * state_decay
      new_state = update(decayed, (values, k_smem.at[slot]), in_registers=register_state)
      plgpu.barrier_arrive(released.at[slot])
      if per_chunk:
        @pl.when(n + 1 < num_chunks)
        def _():
          publish(n + 1, new_state)
      return (new_state, runs_next) if head_segments else new_state

    staging = None if register_state else (state_in_smem, vk_smem)

    def delta_body(n, state_t):
      """Chunk n of the delta rule: S_n and the chunk's U^T go out together, before the update."""
      slot = slot_of(n)
      plgpu.barrier_wait(loaded.at[slot])
      # Without per-chunk factors (no gates: DeltaNet or KDA, unpacked) K_g is K, or KDA's K_g as it comes; packed
      # KDA rows still lose the state past a segment start (its factor rows' counts, of zero rates).
      rows = chunk_factor_rows(n) if per_chunk else None
      buf = claim(n)
      state_in = state_t.astype(state_smem.dtype)
      state_smem[buf] = state_in
      values_t = delta_pseudo_values(state_in, k_smem.at[slot], inverse_smem.at[slot], v_smem.at[slot], rows,
                                     has_segments=has_segments, staging=staging)

      def publish_values():
        values_smem[buf] = values_t.astype(values_smem.dtype)
        hand_over(buf)

      if not overlap_publish:
        publish_values()
      during = publish_values if overlap_publish else None
      # KDA packed: the exponents are the segments' alone (its factor rows' rates are zeros).
      exponents = decay_exponents(slot, rows) if per_chunk else (None, None)
      if channel_gated:
        state_t = delta_update(state_t, values_t, keys_end_smem.at[slot], *exponents, staging=staging, during=during,
                               channel_decay=channel_decay_smem[slot, 0])
      else:
        state_t = delta_update(state_t, values_t, k_smem.at[slot], *exponents, staging=staging, during=during)
      plgpu.barrier_arrive(released.at[slot])
      return state_t

    if has_initial:
      plgpu.barrier_wait(initial_loaded.at[0])
      state = state_f32_smem[...]
      plgpu.commit_smem()  # every thread has read it before the first publish overwrites it
    else:
      state = jnp.zeros((be, q_smem.shape[-1]), _F32)
    # Per head, a partial last chunk has its own key and state factors (padded
    # rows are zeros, but they would still decay the state); only the final
    # state sees them. Per chunk, padded rows have rate 0 and change nothing.
    last_apart = has_final and has_decay and not per_chunk and last_rows != c
    split = num_chunks - 1 if last_apart else num_chunks
    head_factors = None
    if has_decay and not per_chunk:
      head_factors = vectors_smem[_KEY], vectors_smem[_STATE]
    if delta:
      state = lax.fori_loop(0, num_chunks, delta_body, state)
    else:
      if per_chunk:
        publish(0, state)
      carry = (state, runs_ref[batch, chunk_of(0), 0, total_row]) if head_segments else state
      carry = lax.fori_loop(0, split, lambda n, s: body(n, s, head_factors), carry)
      if last_apart:
        last_factors = vectors_smem[_LAST_KEY], vectors_smem[_LAST_STATE]
        carry = lax.fori_loop(split, num_chunks, lambda n, s: body(n, s, last_factors), carry)
      state = carry[0] if head_segments else carry

    @pl.loop(last_chunks(num_chunks, published), num_chunks)
    def _drain(n):
      plgpu.barrier_wait(state_read.at[lax.rem(n, published)])

    if has_final:  # the output warpgroup has read every published state (the drain above)
      state_f32_smem[...] = state
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(state_f32_smem, final_ref.at[sequence_slice if sequences else batch, head, cols])
      plgpu.wait_smem_to_gmem(0)

  def store_published(n, pub):
    """S_n^T and U^T to HBM from the buffers the chain publishes them in (read before `state_read`: see
    `wait_smem_to_gmem(0, wait_read_only=True)` where they are released)."""
    plgpu.copy_smem_to_gmem(state_smem.at[pub], states_out_ref.at[batch, head, chunk_of(n), cols])
    plgpu.copy_smem_to_gmem(values_smem.at[pub], values_out_ref.at[batch, head, cols, chunk_rows(n)])

  def _published_out():
    plgpu.barrier_wait(factors_loaded.at[0])
    if not per_chunk:  # observed, though the stores need no factors
      plgpu.barrier_wait(factors_loaded.at[1])

    @pl.loop(0, num_chunks)
    def _chunk(n):
      pub = lax.rem(n, published)
      plgpu.barrier_wait(state_ready.at[pub])
      store_published(n, pub)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      plgpu.barrier_arrive(state_read.at[pub])
      plgpu.barrier_arrive(released.at[slot_of(n)])

    plgpu.wait_smem_to_gmem(0)

  def _outputs():
    plgpu.barrier_wait(factors_loaded.at[0])
    intra = intra_smem[...]  # per chunk: the scaled causal mask
    plgpu.commit_smem()  # every thread has read it before the first output overwrites it
    row = None
    if not per_chunk:
      plgpu.barrier_wait(factors_loaded.at[1])
      row = vectors_smem[_ROW]

    @pl.loop(0, num_chunks)
    def _chunk(n):
      slot, buf, pub = slot_of(n), lax.rem(n, 2), lax.rem(n, published)
      plgpu.barrier_wait(loaded.at[slot])
      chunk_row = row
      if channel_gated:  # Q_g and P come gated and scaled; packed, Q_g's rows past a segment start see no S_n
        chunk_row = jnp.exp2(row_exponents(chunk_factor_rows(n), has_segments=True)) if has_segments else None
      elif per_chunk:
        # row_i = scale 2^-c_i before the chunk's first segment start, intra_ij =
        # scale 2^(c_j - c_i) on j <= i within a segment. Each row is read along
        # the rows and, from its second copy, along the columns of the scores
        # (one load cannot take both layouts).
        rows, columns = chunk_factor_rows(n), factors_by_column.at[slot]
        cum_end = vectors_smem[slot, CUM, total_row]
        chunk_row = scale * jnp.exp2(row_exponents(rows, has_segments=has_segments))
      # The scores' factors [C, C] (scale, causal mask, decay, segments), built while q k^T runs on the
      # tensor cores: they depend on the chunk's rates alone.
      if head_segments:
        # Pairs within a segment, in a chunk where one starts; rows past the chunk's first segment start do
        # not see S_n. A chunk where none starts reads no counts.
        started = runs_smem[slot, 0, total_row] > 0

        def weights():
          def within_segments():
            same_segment = (lax.broadcast_in_dim(runs_smem[slot, 0], (c, c), (0,))
                            == lax.broadcast_in_dim(runs_by_column[slot, 0], (c, c), (1,)))
            return jnp.where(same_segment, intra, 0.0)

          return lax.cond(started, within_segments, lambda: intra)

        chunk_row = lax.cond(started, lambda: row * sees_prior_state(runs_smem[slot, 0]), lambda: row)
      elif not per_chunk:
        weights = lambda: intra  # noqa: E731
      else:
        weights = lambda: pair_weights(intra, rows, columns, cum_end=cum_end, has_segments=has_segments)  # noqa: E731

      def weighted_scores(acc):
        plgpu.wgmma(acc, q_smem.at[slot], k_smem.at[slot].transpose((1, 0)))
        chunk_weights = weights()
        return acc[...] * chunk_weights

      if channel_gated:
        weighted = pairs_smem.at[slot]
      else:
        weighted = pl.run_scoped(weighted_scores, plgpu.ACC((c, c), _F32)).astype(q_smem.dtype)
      if not register_scores and not channel_gated:
        scores_smem[...] = weighted
        plgpu.commit_smem()
        weighted = scores_smem
      if delta:  # U = (U^T)^T, published with S_n
        values = values_smem.at[pub].transpose((1, 0))
      else:
        values = v_smem.at[slot]
      plgpu.barrier_wait(state_ready.at[pub])
      if delta_states:
        store_published(n, pub)

      def products(intra_acc, inter_acc):
        plgpu.wgmma(intra_acc, weighted, values)
        plgpu.wgmma(inter_acc, q_smem.at[slot], state_smem.at[pub].transpose((1, 0)))
        return intra_acc[...], inter_acc[...]

      intra_out, inter = pl.run_scoped(products, plgpu.ACC((c, be), _F32), plgpu.ACC((c, be), _F32))
      if delta_states:  # the stores above have read the published buffers (and the output's of chunk n - 1 its own)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      # The row dots' weights leave the slot before it is released (in wgmma's layout, the output's).
      dot_weights = plgpu.layout_cast(dots_smem[slot], plgpu.Layout.WGMMA) if row_dots else None
      plgpu.barrier_arrive(state_read.at[pub])
      plgpu.barrier_arrive(released.at[slot])
      out = intra_out + (inter if chunk_row is None else inter * chunk_row[:, None])
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the stores of chunk n - 2 have read their buffers
      out_smem[buf] = out.astype(out_smem.dtype)
      if row_dots:  # from the float32 output, as the Triton sweeps' (`pallas_triton.SweepOperands.dot_with`)
        row_dots_smem[buf] = jnp.sum(out * dot_weights.astype(_F32), axis=1)
      plgpu.commit_smem()
      # One group a chunk: the wait above counts groups.
      plgpu.copy_smem_to_gmem(out_smem.at[buf], out_ref.at[batch, chunk_rows(n), head, cols], commit_group=not row_dots)
      if row_dots:
        plgpu.copy_smem_to_gmem(row_dots_smem.at[buf], row_dots_ref.at[batch, head, col, chunk_rows(n)])

    plgpu.wait_smem_to_gmem(0)

  pl.when(wg == 2)(_outputs if with_outputs else _published_out)


def _register_operands(dim_k: int, per_chunk: bool, interpret: bool, delta: bool = False) -> dict:
  """Which left operands of wgmma stay in registers instead of a round trip through shared memory.

  The state chain's key * v (with the update accumulating onto the decayed
  state) and the output's weighted scores: both at K = 128, the scores alone
  with per-chunk factors at K = 64 (H200, in-process: 2-10% less time at D128,
  5.6% with per-token rates at D64, 4.5% more with a per-head rate at D64;
  on an H100, within 1%: PERFORMANCE.md, "Warp-specialised forward"). Never
  interpreted: the Mosaic GPU interpreter's wgmma reads shared memory alone and
  has no initialised accumulator, so there staging tiles (allocated only for
  staged operands) hold the same operands, and the update is added after the
  product. The delta rule's chain keeps its left operands in registers at
  every K (the state, -(K_g S)^T, key * U^T): all come from its accumulators;
  so do its scores, gated or not (as measured with per-chunk factors).
  At K = 128 it also publishes U^T for the output warpgroup while its update's
  products run (`overlap_publish`; they read key * U^T from registers): on an
  H200 (DeltaNet, forward kernel, `jax.profiler`) 0.209 -> 0.189 ms at B2 H32
  T8K and 0.757 -> 0.738 at T32K; at K = 64 (B4 H32 T32K) 0.655 -> 0.665.
  Publishing S_n while (K S)^T runs was slower at K = 128 (0.757 -> 0.816 at
  T32K) and within 1.2% at K = 64.
  """
  compiled = not interpret
  return dict(register_state=compiled and (dim_k > 64 or delta),
              register_scores=compiled and (per_chunk or delta or dim_k > 64),
              overlap_publish=compiled and delta and dim_k > 64)


def warpgroup_barrier():
  """A barrier of the warpgroup's 128 threads (`bar.sync`), for a kernel of `warpgroup_kernel(...,
  auto_barriers=False)`: every thread's reads and writes of shared memory before it, the tensor cores' reads of
  wgmma operands each thread waited for included, come before any thread's after it."""
  plgpu.inline_mgpu()(lambda _: mgpu_utils.warpgroup_barrier())()


def warpgroup_kernel(body, *, out_type, scratch_types, grid, grid_names, interpret, kernel_name,
                     num_warpgroups: int = 3, auto_barriers: bool = True):
  """plgpu.kernel in warpgroup lowering, as every kernel of this file and of the delta rule's runs: of
  `num_warpgroups` warpgroups (axis "wg"; 1: no such axis); approx_math: exp2 as the one ex2.approx instruction
  (relative error ~2^-22), not a library routine. auto_barriers=False: Pallas puts no warpgroup barrier around
  each shared-memory store and async copy (`unsafe_no_auto_barriers`), so the body must order its own reads
  before the writes that reuse their memory (`warpgroup_barrier`)."""
  return plgpu.kernel(
      body,
      out_type=out_type,
      scratch_types=scratch_types,
      grid=grid,
      grid_names=grid_names,
      num_threads=num_warpgroups if num_warpgroups > 1 else None,
      thread_name="wg" if num_warpgroups > 1 else None,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True,
                                           unsafe_no_auto_barriers=not auto_barriers),
      interpret=plgpu.InterpretGPUParams() if interpret else False,
      kernel_name=kernel_name,
  )


def forward_padded(q, k, v, decay, initial_state=None, *, chunk_gates=None, chunk_runs=None,
                   delta_inverse=None, delta_states: bool = False, delta_channel_gates=None,
                   with_outputs: bool = True, scale: float,
                   seq_len: int,
                   return_final_state: bool = False, cfg: WarpSpecializedConfig, num_slices: int = 1,
                   sequences=None, num_tokens: int | None = None, interpret: bool = False, reverse: bool = False,
                   dot_with=None):
  """The forward pass on padded inputs (see `forward` for unpadded ones).

  With `delta_inverse`, the delta rule's (`delta_attention.chunk`): the state
  chain computes each chunk's pseudo-values U = T' (V - K_g S) before its
  update, S <- a S + K_C^T U, and the output is scale (Q_g S_n + P U).

  Args:
    q, k: [B, T', H, K]; v: [B, T', H, V]; bf16 or fp16, K = 64 or 128, V a
      multiple of `BLOCK_E` (`WarpSpecializedConfig.padded_dims`), each T' <= Tp
      (`num_tokens`) a multiple of `WarpSpecializedConfig.TMA_ROWS` (or Tp).
      Rows past the real tokens must be zeros, and rows past T' read as zeros
      (TMA fills a tile that runs past the array), so T' = T needs no copy of
      the operands to whole chunks. o has v's rows (TMA drops those past them).
    decay: [H] float32 rates or None.
    chunk_gates: None, or per-token rates and packed sequences as
      `chunk_common.token_chunk_gates` gives them for a forward sweep over Tp
      tokens in chunks of CHUNK_SIZE: (cumdecay [B, H, Tp] float32 or None,
      runs [B, Tp] int32 or None), with decay None. The delta rule's (None,
      None) (no gates) runs the per-head factors of no decay.
    chunk_runs: None, or with a per-head rate (or none) the segment-start
      counts of packed sequences, [B, Tp] int32 (`token_chunk_gates`' runs, in the sweep's convention).
    delta_inverse: None, or the delta rule's T' = (I + A)^{-1} Diag(beta) of
      each chunk, [B, H, Tp, C] in the input dtype
      (`delta_attention.pallas_mosaic_gpu.inverse`; with chunk_gates and one slice).
    delta_states: with delta_inverse, also return each chunk's S_n^T (the
      state before it) [B, H, N, V, K] and U^T [B, H, V, Tp] in the input
      dtype, stored by the third warpgroup from the buffers the chain
      publishes them in (the delta backward's).
    delta_channel_gates: None, or with delta_inverse KDA's per-key-channel
      gates, q and k given as Q_g = scale q 2^G and K_g = k 2^G and
      chunk_gates (None, runs): (K_C [B, Tp, H, K] in the input dtype, P
      [B, H, Tp, C] in the input dtype, the state's decay 2^G_C [B, H, N, 1,
      K] float32), `delta_attention.pallas_mosaic_gpu.channel_gated_chunks`'.
      Packed rows (runs given): those terms as if unpacked (G runs on across a
      segment start), the kernel dropping the rows of Q_g and K_g past a
      segment start in the chunk, those of K_C before its last one, and the
      state's decay in a chunk where one starts.
    with_outputs: form o (False: with delta_states, the delta backward's
      state sweep, which stores S_n^T and U^T alone; q is not read and may be
      None).
    initial_state: None, or the transposed state before each slice, [B, H,
      num_slices, V, K] float32.
    seq_len: the number of real tokens T (with one slice, Tp - CHUNK_SIZE < T <= Tp).
    return_final_state: also return S_T transposed, [B, H, V, K] float32 (one slice only).
    cfg: the ring's depth and the published states (`heuristics.resolve_warp_specialized`).
    num_slices: slices of Tp / num_slices tokens, each walked by its own CTAs
      from its initial state (the sequence split; see `forward`).
    num_tokens: Tp, the tokens the CTAs walk, a multiple of `num_slices *
      CHUNK_SIZE` (None: q's rows, which must be one).
    sequences: None, or with delta_inverse and B = 1 (first, end) [S] int32,
      the chunk bounds of S sequences laid out chunk-aligned in the row
      (`delta_attention.chunk.aligned_sequences`, in chunks of CHUNK_SIZE)
      that together cover every chunk: each is walked by its own CTAs from
      its initial state, initial_state [1, H, S, V, K], to its final state,
      returned as [S, H, V, K] (an empty sequence's: its initial state).
    interpret: run in the Mosaic GPU interpreter (on any backend).
    reverse: the anti-causal sweep, out_t = scale x_t G_t with G_t = a G_{t+1}
      + k_t^T v_t (`pallas_triton`'s, in its convention: the state carried in
      already decayed once): the chunks walked last to first (slice 0 the
      last), with the reverse factors (chunk_gates and chunk_runs in the
      reverse sweep's convention, `token_chunk_gates(reverse=True)`: each
      chunk's totals at its first row); with a per-head rate, a first chunk in
      sweep order that is whole, or no initial state (its factors are a whole
      chunk's; per-token, padded rows have rate 0). Split, slice 0 ends at T's
      last chunk and the last slice walks the chunks left (fewer where T's
      chunks do not fill the slices). The final state is the one before the
      first chunk.
    dot_with: None, or weights w of v's shape (not the delta rule's): also
      return the output's float32 row dots, sum_j o_tj w_tj per token, from
      the output before its rounding, [B, H, V / BLOCK_E, Tp] float32 (one
      row a block of BLOCK_E value columns; the per-token rates' gradient
      takes them, `vjp`).

  Returns:
    o: [B, Tp, H, V] in the input dtype; or a tuple of o (with_outputs), its row dots (dot_with), S_n^T and U^T
    (delta_states) and S_T^T (return_final_state), in that order.
  """
  if reverse and (delta_inverse is not None or sequences is not None):
    raise ValueError("the reverse sweep takes no delta rule and no sequences")
  if delta_states and delta_inverse is None:
    raise ValueError("delta_states takes delta_inverse")
  if not with_outputs and (not delta_states or return_final_state):
    raise ValueError("with_outputs=False takes delta_states, and no final state")
  row_dots = dot_with is not None
  if row_dots and (delta_inverse is not None or not with_outputs or dot_with.shape != v.shape):
    raise ValueError(f"dot_with takes outputs, no delta rule, and v's shape {v.shape}; got {dot_with.shape}")
  q = k if q is None and not with_outputs else q  # not read
  num_stages, published = cfg.num_stages, cfg.published_states
  b, rows, h, dim_k = q.shape
  tp = rows if num_tokens is None else num_tokens
  dim_v, value_rows = v.shape[-1], v.shape[1]
  c, be = CHUNK_SIZE, BLOCK_E
  if tp % (num_slices * c) or not all(WarpSpecializedConfig.takes_rows(n, tp) for n in (rows, k.shape[1], value_rows)):
    raise ValueError(f"the padded length {tp} must be a multiple of num_slices * {c} = {num_slices * c} and hold "
                     f"the rows of q, k and v ({rows}, {k.shape[1]}, {value_rows}), each a multiple of "
                     f"{WarpSpecializedConfig.TMA_ROWS} unless all of them")
  if num_slices == 1 and not tp - c < seq_len <= tp:
    raise ValueError(f"seq_len must be in ({tp - c}, {tp}] for {tp} padded tokens, got {seq_len}")
  if num_slices > 1 and (return_final_state or not 0 < seq_len <= tp):
    raise ValueError(f"with {num_slices} slices seq_len must be in (0, {tp}] and the final state comes from the "
                     f"slices' combine, got seq_len={seq_len}, return_final_state={return_final_state}")
  num_states = num_slices  # initial states per row: one a slice, or one a sequence
  if sequences is not None:
    first, end = sequences
    num_states = first.shape[0]
    if delta_inverse is None or b != 1 or num_slices != 1 or first.shape != (num_states,) or end.shape != first.shape:
      raise ValueError(f"sequences take the delta rule, one row of one slice and (first, end) [S] chunk bounds; got "
                       f"delta_inverse {delta_inverse is not None}, B = {b}, {num_slices} slices, bounds "
                       f"{first.shape} and {end.shape}")
  if initial_state is not None and initial_state.shape != (b, h, num_states, dim_v, dim_k):
    raise ValueError(f"initial_state must be [B, H, S, V, K] = {(b, h, num_states, dim_v, dim_k)}, "
                     f"got {initial_state.shape}")
  if chunk_gates is not None and (decay is not None or chunk_runs is not None):
    raise ValueError("give decay (per head) and chunk_runs, or chunk_gates (per token), not both")
  is_delta = delta_inverse is not None
  channel_gated = delta_channel_gates is not None
  if channel_gated and (not is_delta or chunk_gates is None or chunk_gates[0] is not None):
    raise ValueError("delta_channel_gates takes delta_inverse and chunk_gates (None, runs or None)")
  if is_delta and (chunk_gates is None or decay is not None or num_slices != 1 or delta_inverse.shape != (b, h, tp, c)):
    raise ValueError(f"the delta rule takes chunk_gates, no decay, one slice and delta_inverse [B, H, Tp, C] = "
                     f"{(b, h, tp, c)}; got {chunk_gates is not None}, {decay is not None}, {num_slices}, "
                     f"{delta_inverse.shape}")
  num_chunks = tp // c // num_slices
  # The last chunk's own factors serve the final state alone (one slice; reversed, the last chunk walked is whole).
  last_rows = seq_len - (tp // c - 1) * c if num_slices == 1 and not reverse else c
  # The delta rule without gates (chunk_gates (None, None): DeltaNet, or KDA, whose terms carry its gates, on
  # unpacked rows) takes the per-head factors of no decay: no factor rows a chunk, no exp2 on the chain.
  per_chunk = chunk_gates is not None and any(gate is not None for gate in chunk_gates)
  if per_chunk:
    cumdecay, runs = chunk_gates
    if cumdecay is None:
      cumdecay = jnp.zeros((b, h, tp), _F32)
    intra = scaled_causal_mask(scale, reverse=reverse)
    vectors = chunk_factors(cumdecay, runs)
    factor_smem = (plgpu.SMEM((num_stages,) + vectors.shape[-2:], _F32),) * 2
  else:
    intra, vectors = decay_factors(decay, h, scale=scale, last_rows=last_rows, reverse=reverse)
    factor_smem = (plgpu.SMEM(vectors.shape[1:], _F32),)
    if chunk_runs is not None:
      factor_smem += (plgpu.SMEM((num_stages, 1, c), _F32),) * 2
  dtype = q.dtype
  with_states = initial_state is not None or return_final_state
  state_smem = swizzled_smem((published, be, dim_k), dtype)
  if with_states:  # the same bytes as the published states (see `WarpSpecializedConfig`)
    state_smem = plgpu.RefUnion(state_smem, swizzled_smem((be, dim_k), _F32))
  registers = _register_operands(dim_k, per_chunk, interpret, is_delta)
  staged_state = ((swizzled_smem((be, c), dtype), swizzled_smem((be, dim_k), dtype)) if is_delta
                  else (swizzled_smem((c, be), dtype),))
  staged = ((() if registers["register_scores"] else (swizzled_smem((c, c), dtype),))
            + (() if registers["register_state"] else staged_state))
  # The delta rule's ring of inverses and its published U^T; KDA's ring of K_C, P and the state's decay.
  delta_smem = ((swizzled_smem((num_stages, c, c), dtype), swizzled_smem((published, be, c), dtype)) if is_delta
                else ())
  if channel_gated:
    delta_smem += (swizzled_smem((num_stages, c, dim_k), dtype), swizzled_smem((num_stages, c, c), dtype),
                   plgpu.SMEM((num_stages, 1, dim_k), _F32))
  # The row dots' weights in the ring, and two chunks' row dots (double-buffered as the outputs).
  dots_smem = (swizzled_smem((num_stages, c, be), dtype), plgpu.SMEM((2, c), _F32)) if row_dots else ()
  # Each chunk's copies, one arrival each on its slot's barrier: q (with outputs), k, v, the row dots' weights, the
  # delta rule's inverse, and two copies of the chunk's factor rows (per-token rates or packed sequences).
  copies_per_chunk = (2 + with_outputs + row_dots + is_delta + 3 * channel_gated
                      + 2 * (per_chunk or chunk_runs is not None))
  scratch = (
      # The [C, C] float32 factors are read once, before the first output is staged in the same bytes.
      (swizzled_smem((num_stages, c, dim_k), dtype), swizzled_smem((num_stages, c, dim_k), dtype),
       swizzled_smem((num_stages, c, be), dtype), state_smem,
       plgpu.RefUnion(swizzled_smem((2, c, be), dtype), plgpu.SMEM((c, c), _F32)), factor_smem[0])
      + delta_smem + staged + factor_smem[1:] + dots_smem,
      (plgpu.Barrier(num_arrivals=copies_per_chunk, num_barriers=num_stages),
       plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
       plgpu.Barrier(num_barriers=published), plgpu.Barrier(num_barriers=published), plgpu.Barrier(num_barriers=2))
      + ((plgpu.Barrier(num_barriers=1),) if initial_state is not None else ()),
  )
  runs = () if chunk_runs is None else (chunk_runs.reshape(b, tp // c, 1, c).astype(_F32),)
  bounds = () if sequences is None else (jnp.stack(sequences).astype(jnp.int32),)
  inputs = (intra, vectors, q, k, v) + ((delta_inverse,) if is_delta else ()) + (
      tuple(delta_channel_gates) if channel_gated else ()) + runs + (
      () if initial_state is None else (initial_state,)) + bounds + ((dot_with,) if row_dots else ())
  out_type = (((manual_axes.struct((b, value_rows, h, dim_v), dtype, *inputs),) if with_outputs else ())
              + ((manual_axes.struct((b, h, dim_v // be, tp), _F32, *inputs),) if row_dots else ())
              + ((manual_axes.struct((b, h, tp // c, dim_v, dim_k), dtype, *inputs),
                  manual_axes.struct((b, h, dim_v, tp), dtype, *inputs)) if delta_states else ())
              + ((manual_axes.struct((b if sequences is None else num_states, h, dim_v, dim_k), _F32, *inputs),)
                 if return_final_state else ()))
  kernel = functools.partial(_kernel, num_chunks=num_chunks, num_slices=num_slices, num_stages=num_stages,
                             published=published, per_chunk=per_chunk,
                             has_decay=per_chunk or decay is not None or chunk_runs is not None,
                             has_segments=chunk_runs is not None or (per_chunk and chunk_gates[1] is not None),
                             has_initial=initial_state is not None, has_final=return_final_state,
                             last_rows=last_rows, scale=scale, delta=is_delta, delta_states=delta_states,
                             with_outputs=with_outputs, channel_gated=channel_gated,
                             sequences=sequences is not None, reverse_chunks=-(-seq_len // c) if reverse else None,
                             row_dots=row_dots, **registers)
  results = warpgroup_kernel(
      kernel, out_type=out_type, scratch_types=scratch, grid=(h, b * num_states, dim_v // be),
      grid_names=("heads", "batch_slices", "value_blocks"), interpret=interpret,
      kernel_name="delta_warp_specialized" if is_delta else "lightning_warp_specialized")(*inputs)
  return results[0] if len(results) == 1 else tuple(results)


def forward(q, k, v, decay, initial_state, opts: PallasOptions, segment_starts=None, given_starts=None,
            transposed_states=False, reverse=False, dot_with=None) -> pallas_triton.SweepResults:
  """The forward pass on unpadded inputs: `pallas_triton.SweepResults` with out (o [B, T, H, E]), final_state
  ([B, H, D, E] float32, with `opts.return_final_state`), row_dots (with dot_with) and the sequence split's
  slice_starts (`pallas_triton.SliceStarts`, where it split).

  q, k: [B, T, H, D]; v: [B, T, H, E]; decay: [H] or (per-token) [B, T, H]
  float32 or None; initial_state: [B, H, D, E] float32 or None;
  segment_starts: [B, T] bool or None (`chunk_common.segment_starts`). Per-token
  rates run the kernel's per-chunk factors; segments with a per-head rate (or
  none) its per-head ones, masked by each chunk's segment starts. Pads the
  dims (not T: the kernel reads zeros past it), runs `forward_padded` with
  the config of `heuristics.resolve_warp_specialized`, and slices the
  padding off.

  Where (batch, head, value block) CTAs alone leave SMs idle, the sequence is
  split (`heuristics.slice_chunks`) into equal slices (the last one's chunks
  past T read as zeros): the Triton states kernel writes each slice's own state and
  `pallas_triton.slice_starts` combines them into the state before each slice.
  given_starts: another sweep's `pallas_triton.SliceStarts` over these k and v
  (the forward's, transposed, for the backward's dq sweep): the split takes
  its slices and states instead (then no final state). transposed_states: the
  call carries the transpose of another's state over the same operands (the
  dq sweep's, where no starts were handed over): its split runs that call's
  pass, transposed (`pallas_triton.slice_starts`), which XLA's CSE may merge.
  reverse: the anti-causal sweep of the backward pass (`forward_padded`'s),
  its final state the one before the first token; its slices start at T's
  last chunk, so the last one (the sequence's start) may be the short one.
  dot_with: None, or weights w [B, T, H, E]: row_dots [B, H, T] float32,
  sum_j o_tj w_tj from the float32 output (the per-token rates' gradient's,
  as `pallas_triton.SweepOperands.dot_with`).
  """
  b, t, h, dim_k = q.shape
  dim_v = v.shape[-1]
  c = CHUNK_SIZE
  kp, vp = WarpSpecializedConfig.padded_dims(dim_k, dim_v)
  cfg = heuristics.resolve_warp_specialized(opts.config, dim_k=kp, itemsize=q.dtype.itemsize,
                                            row_dots=dot_with is not None)
  num_chunks = -(-t // c)
  if given_starts is not None and (given_starts.chunk_size != c or opts.return_final_state):
    raise ValueError(f"given_starts must be of {c}-token chunks, without a final state")
  slice_chunks = given_starts.slice_chunks if given_starts is not None else heuristics.slice_chunks(
      programs=b * h * (vp // BLOCK_E), num_chunks=num_chunks, chunk_size=c, num_sms=opts.num_sms,
      slice_size=None if opts.config is None else opts.config.slice_size)
  num_slices = -(-num_chunks // slice_chunks)
  tp = num_slices * slice_chunks * c
  # T stays as it is where TMA can tile it (the kernel reads zeros past it, see `forward_padded`); else (a copy either
  # way) T goes to whole slices.
  pad_rows = functools.partial(chunk_common.pad_tokens_and_features,
                               num_tokens=WarpSpecializedConfig.walked_rows(t, tp))
  q, k, v = pad_rows(q, dim=kp), pad_rows(k, dim=kp), pad_rows(v, dim=vp)
  dot_with = None if dot_with is None else pad_rows(dot_with, dim=vp)
  initial_state = chunk_common.pad_state(initial_state, kp, vp)
  cumdecay = runs = chunk_gates = chunk_runs = None
  per_token = chunk_common.per_token(decay)
  if per_token or segment_starts is not None:
    cumdecay, runs = sweep_gates(decay if per_token else None, segment_starts, num_tokens=tp, reverse=reverse)
    if per_token:
      chunk_gates = (cumdecay, runs)
    else:
      chunk_runs = runs
  final_state = starts = None
  if given_starts is not None:
    initial_state, starts = chunk_common.pad_state(given_starts.states, kp, vp), given_starts
  elif num_slices > 1:
    # The states pass takes the gates as the chunk loop's sweeps do (a per-head rate stays one, masked by the
    # segments): the per-head kernels, which the dq sweep would run for the same states. Its counts carry each
    # chunk's total (`pallas_triton.segment_fields`); this kernel's are the counts alone.
    gates = dict(decay=None if per_token else decay, chunk_cumdecay=cumdecay,
                 **pallas_triton.segment_fields(runs, chunk_size=c, num_chunks=num_chunks, reverse=reverse))
    configs = heuristics.resolve(opts.config, dim_k=kp, dim_v=vp, itemsize=q.dtype.itemsize,
                                 compute_capability=opts.compute_capability, split_chunk_size=c)
    (initial_state, _), (final_state, _) = pallas_triton.slice_starts(
        pallas_triton.SweepOperands(**gates, y=k, z=v, initial_state=initial_state), cfg=configs.slice_states,
        chunk_size=c, seq_len=t, reverse=reverse, slice_chunks=slice_chunks,
        with_final_state=opts.return_final_state, branch=heuristics.branch_per_chunk(dual=False),
        interpret=opts.interpret, transposed=transposed_states)
    starts = pallas_triton.SliceStarts(initial_state[..., :dim_k, :dim_v], chunk_size=c, slice_chunks=slice_chunks)
  elif initial_state is not None:
    initial_state = initial_state[:, :, None]
  # The kernel carries the state transposed, S^T [V, K].
  if initial_state is not None:
    initial_state = jnp.swapaxes(initial_state, -1, -2)
  result = forward_padded(q, k, v, decay if chunk_gates is None else None, initial_state, chunk_gates=chunk_gates,
                          chunk_runs=chunk_runs, scale=opts.scale, seq_len=t,
                          return_final_state=opts.return_final_state and num_slices == 1, cfg=cfg,
                          num_slices=num_slices, num_tokens=tp, interpret=opts.interpret, reverse=reverse,
                          dot_with=dot_with)
  o, *result = result if isinstance(result, tuple) else (result,)
  row_dots = None if dot_with is None else result.pop(0).sum(axis=2)[:, :, :t]
  if result:  # the kernel's final state (one slice)
    final_state = jnp.swapaxes(result.pop(), -1, -2)
  if final_state is not None:
    final_state = final_state[:, :, :dim_k, :dim_v]
  return pallas_triton.SweepResults(out=o[:, :t, :, :dim_v], final_state=final_state, row_dots=row_dots,
                                    slice_starts=starts)
