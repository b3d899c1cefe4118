"""The delta rule's chunk inverses, backward sweeps, gradient kernel and the sequence split's map pass in Pallas
Mosaic GPU (Hopper, sm90), the sweeps and the map pass warp-specialised.

`state_sweep` is `pallas_triton.sweep`'s job in the backward (S_n and U, no
output): the forward's warp-specialised kernel with `delta_states` and no
outputs, whose third warpgroup stores the S_n^T and U^T the chain publishes
(where the forward kept them, `DeltaConfig.forward_states`, it does not run).

`state_cotangents` is `pallas_triton.state_cotangents`' job (its results
transposed, below) for a scalar gate or none, and in a channel-gated mode for
KDA (below). One CTA per (head, batch, 64
value columns) walks the 64-token chunks from the last, carrying G^T = (dL/dS
after the chunk)^T [64, K] float32 in the registers of its state warpgroup,
with three warpgroups running concurrently:

  memory  TMA loads of each chunk's q, k, T' = T Diag(beta) and dO into a
          ring of `num_stages` slots (and its factor rows, `chunk_factors`);
  pairs   P = scale (q k^T) * 2^(c_s - c_t) on s <= t within a segment
          (`pair_weights`), then W = T' K_g (K_g = Diag(2^-c) K, zero past a
          segment start), each published in shared memory as it is formed
          (the chain's first products take P, its update W): neither depends
          on G, so both leave the chain, and W never crosses HBM;
  state   per chunk: G_n^T out (TMA), dU^T = dO^T P + (G^T K^T) Diag(to_end)
          out (TMA), then G^T <- a G^T + (dO^T Diag(row)) Q - dU^T W. Its
          left operands (G^T, dO^T Diag(row), dU^T) stay in registers.

(`vjp`'s notation: dU = P^T dO + K_C G_n, dL/dS_n = Diag(a_n) G_n + Q_g^T dO
- W^T dU.) The serial chain holds two rounds of products a chunk, as the
forward's; the Triton sweep's one instruction stream also forms P and the
query products in it.

The state warpgroup stores G_n^T and dU^T from the shared memory it
publishes them in, so both come out transposed: G^T [B, H, N, Ep, K] and
dU^T [B, H, Ep, Tp], as `pallas_triton.tile_gradients` reads them with
`cotangents_transposed` (and `state_sweep`'s S_n^T and U^T with
`states_transposed`). The sequence split's pass from zero end cotangents
(`state_cotangents(..., initial_only=True)`) stores neither: it needs
dL/dS_0 alone.

KDA's mode (`channel_gates`) takes the terms `channel_gated_chunks` formed:
q and k as Q_g (scaled) and K_C, and in three more ring slots K_g, P and the
state's decay per key channel; the pairs warpgroup forms W = T' K_g alone (P
is read where it is loaded), and the chain decays G^T per key channel.

`tile_gradients` is `pallas_triton.tile_gradients`' job after those sweeps
for a scalar gate or none: every chunk's dq, dk, dv, dbeta and dg from its T,
S_n^T, G_n^T, U^T and dU^T, one chunk a CTA (H200, B2 H32 T8K D128: 0.562 ms
against Triton's 0.706 for DeltaNet, 0.734 against 0.817 for Gated DeltaNet).

`inverse` forms each chunk's T' = (I + A)^{-1} Diag(beta), which all of them
and the forward's sweep take: one warpgroup, the 16 x 16 diagonal blocks of T
solved in float32 registers, then merged on the tensor cores.

`channel_gated_chunks` is `inverse` for KDA's per-key-channel gates: one
warpgroup per 64 key columns forms each chunk's A and P through each 16-row
block's start on the tensor cores, the first solves T' from A as `inverse`
does, and they write P and the gated queries and keys the forward's sweep
takes (`warp_specialized`).

`piece_maps` is the split's forward map pass: the forward's chain step
(`lightning_mosaic.delta_pseudo_values`, `delta_update`) from [I | 0] over
[0 | v], two chains a CTA (one warpgroup each, I's 64 rows and 64 value
columns), no outputs.

Where the kernels run is
`heuristics.warp_specialized_unsupported` (sm90, bf16/fp16, K <= 128) and
`pallas_triton.backward`; they also run in the Mosaic GPU interpreter (the
inverse's solve aside: it is inline Mosaic GPU, which the interpreter does not
run).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, memref, vector
from jaxlib.mlir.dialects import math as mlir_math

from lightning_jax.ops.delta_attention import chunk
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import config as lightning_config
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import manual_axes
from lightning_jax.ops.lightning_attention import pallas_mosaic_gpu as lightning_mosaic
from lightning_jax.ops.lightning_attention.config import WarpSpecializedConfig

CHUNK_SIZE = WarpSpecializedConfig.CHUNK_SIZE
BLOCK_E = WarpSpecializedConfig.BLOCK_E
_F32 = jnp.float32
# Chunks whose pair products and W the pairs warpgroup may publish ahead of the state chain.
_PUBLISHED_PAIRS = 2
# Shared memory beside the buffers (barriers, alignment): 1,216 bytes in one variant of this kernel (233,664
# compiled, over sm90's 232,448, where its buffers summed to 232,448).
_RESERVED = 2048


def shared_memory_bytes(*, num_stages: int, dim_k: int, itemsize: int, factor_rows: int = 2,
                        channel_gated: bool = False) -> int:
  """The kernel's shared memory: the ring (q, k [C, K], T' [C, C] and dO [C, 64] per slot, the factor rows twice),
  the scaled causal mask, the published pair products and W, G^T and dU^T double-buffered for their stores (the
  float32 [64, K] initial and final cotangent share G^T's bytes), and `_RESERVED`. channel_gated (KDA): K_g [C, K],
  P [C, C] and the state's decay [K] float32 in each ring slot instead of the factor rows, W alone published and
  no causal mask."""
  c, be = CHUNK_SIZE, BLOCK_E
  slot = c * (2 * dim_k + c + be) * itemsize + (
      c * (dim_k + c) * itemsize + dim_k * 4 if channel_gated else 2 * factor_rows * c * 4)
  published = _PUBLISHED_PAIRS * c * (dim_k + (0 if channel_gated else c)) * itemsize
  stores = 2 * be * (dim_k + c) * itemsize
  mask = 0 if channel_gated else c * c * 4
  return num_stages * slot + mask + published + max(stores, be * dim_k * 4 + 2 * be * c * itemsize) + _RESERVED


def _deepest_ring(bytes_at, max_stages: int) -> int:
  """The most ring slots, at most `max_stages`, whose kernel fits sm90's shared memory (bytes_at(stages))."""
  budget = lightning_config.shared_memory_budget(WarpSpecializedConfig.COMPUTE_CAPABILITY)
  for stages in range(max_stages, 0, -1):
    if bytes_at(stages) <= budget:
      return stages
  raise AssertionError("unreachable: one stage fits sm90 at every K <= 128")


def num_stages(*, dim_k: int, itemsize: int, max_stages: int = 3, channel_gated: bool = False) -> int:
  """The deepest ring of at most `max_stages` that fits sm90 (2 at K = 128 in 16 bits, 3 at K = 64; the same
  channel_gated)."""
  return _deepest_ring(lambda stages: shared_memory_bytes(num_stages=stages, dim_k=dim_k, itemsize=itemsize,
                                                          channel_gated=channel_gated), max_stages)


def _kernel(q_ref, k_ref, inverse_ref, do_ref, *refs, num_chunks, num_stages, gated, has_segments, has_final, scale,
            in_registers, per_chunk, channel_gated, sequences):
  refs = list(refs)
  # The gates: the scaled causal mask and (`gated`: a scalar gate or packed rows) each chunk's factor rows
  # (`chunk_factors`); or KDA's (`channel_gated`: q and k come as Q_g, scaled, and K_C) K_g [B, Tp, H, K], P [B, H,
  # Tp, C] and the state's decay [B, H, N, 1, K].
  intra_ref = None if channel_gated else refs.pop(0)
  vectors_ref = refs.pop(0) if gated else None
  keys_ref, given_pairs_ref, channel_decay_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if channel_gated else (
      None, None, None)
  d_final_ref = refs.pop(0) if has_final else None
  # `sequences`: each sequence's chunk bounds [2, S] int32 (its first chunk, one past its last).
  bounds_ref = refs.pop(0) if sequences else None
  # Without `per_chunk`, dL/dS_0^T alone: G_n^T and dU^T are formed in shared memory but not stored.
  d_next_ref, du_ref = (refs.pop(0), refs.pop(0)) if per_chunk else (None, None)
  d_initial_ref, buffers, barriers = refs
  q_smem, k_smem, inverse_smem, do_smem, *buffers = buffers
  if channel_gated:  # ring slots of K_g, P and the state's decay; P read there, W alone published
    keys_smem, given_pairs_smem, channel_decay_smem, w_smem, (g_smem, g_f32_smem), du_smem, *staged = buffers
    rows_smem = columns_smem = intra_smem = pairs_smem = None
  else:
    rows_smem, columns_smem = (buffers.pop(0), buffers.pop(0)) if gated else (None, None)
    intra_smem, pairs_smem, w_smem, (g_smem, g_f32_smem), du_smem, *staged = buffers
  # Interpreted: the left operands dO^T Diag(row) (the chain's) and T' Diag(2^-c) (the pairs') staged, as Diag(row) dO
  # [C, 64] and [C, C] (G^T and dU^T are read where they are published).
  queries_smem = staged[0] if staged else None
  inverse_scaled_smem = staged[1] if len(staged) > 1 else None  # (KDA's W needs no scaled T')
  # `loaded`: one barrier a slot, for every tile of the chunk (each copy arrives on it).
  loaded, intra_loaded, released, pairs_ready, w_ready, pairs_read, *barriers = barriers
  c, be = CHUNK_SIZE, BLOCK_E
  head, batch, col = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("value_blocks")
  # With `sequences` a CTA walks its sequence's own chunks of the one row (a traced count), its cotangents the
  # sequence's (rows of d_final and dL/dS_0 indexed by the sequence).
  sequence, end_chunk = batch, num_chunks
  if sequences:
    batch = 0
    end_chunk = bounds_ref[1, sequence]
    num_chunks = end_chunk - bounds_ref[0, sequence]
  cols = pl.ds(col * be, be)
  wg = lax.axis_index("wg")

  def chunk_of(i):  # the i-th chunk walked: the last first
    return end_chunk - 1 - i

  def chunk_rows(i):
    start = chunk_of(i) * c
    return pl.ds(start if isinstance(start, int) else pl.multiple_of(start, c), c)

  def slot_of(i):
    return lax.rem(i, num_stages)

  @pl.when(wg == 0)
  def _memory():
    if not channel_gated:
      plgpu.copy_gmem_to_smem(intra_ref, intra_smem, intra_loaded.at[0])

    def load(i, slot):
      rows = chunk_rows(i)
      plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, head], k_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(inverse_ref.at[batch, head, rows], inverse_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head, cols], do_smem.at[slot], loaded.at[slot])
      if channel_gated:
        plgpu.copy_gmem_to_smem(keys_ref.at[batch, rows, head], keys_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(given_pairs_ref.at[batch, head, rows], given_pairs_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(channel_decay_ref.at[batch, head, chunk_of(i)], channel_decay_smem.at[slot],
                                loaded.at[slot])
      elif gated:
        for factors_smem in (rows_smem, columns_smem):
          plgpu.copy_gmem_to_smem(vectors_ref.at[batch, head, chunk_of(i)], factors_smem.at[slot], loaded.at[slot])

    lightning_mosaic.fill_ring(load, released, num_chunks=num_chunks, num_stages=num_stages)

  @pl.when(wg == 1)
  def _state_chain():
    if has_final:
      (final_loaded,) = barriers
      plgpu.copy_gmem_to_smem(d_final_ref.at[sequence, head, cols], g_f32_smem, final_loaded.at[0])
      plgpu.barrier_wait(final_loaded.at[0])
      grad_t = g_f32_smem[...]
      plgpu.commit_smem()  # every thread has read it before the first G^T overwrites it
    else:
      grad_t = jnp.zeros((be, q_smem.shape[-1]), _F32)
    by_column = lambda x: lax.broadcast_in_dim(x, (be, c), (1,))  # noqa: E731

    def body(i, grad_t):
      slot, buf, pub = slot_of(i), lax.rem(i, 2), lax.rem(i, _PUBLISHED_PAIRS)
      plgpu.barrier_wait(loaded.at[slot])
      if channel_gated:  # Q_g (scaled) and K_C carry the gates, the state decays per key channel
        row = key_factor = None
        decay = lax.broadcast_in_dim(channel_decay_smem[slot, 0], grad_t.shape, (1,))
      elif not gated:  # no factors but the scale
        row, key_factor, decay = scale, None, None
      else:
        rows = rows_smem.at[slot]
        cum_end = rows_smem[slot, lightning_mosaic.CUM, c - 1]
        runs_end = rows_smem[slot, lightning_mosaic.RUNS, c - 1] if has_segments else None
        key_exponent, state_exponent = lightning_mosaic.update_exponents(rows, cum_end=cum_end, runs_end=runs_end,
                                                                         has_segments=has_segments)
        key_factor, decay = by_column(jnp.exp2(key_exponent)), jnp.exp2(state_exponent)
        # scale 2^-c_t (zero past a segment start): dO^T Diag(row) Q is dO^T Q_g.
        row = scale * jnp.exp2(lightning_mosaic.row_exponents(rows, has_segments=has_segments))
      # G_n^T out; the stores of chunk i - 2 have read their buffers (two stores a chunk). Staged where stored or
      # read from shared memory by wgmma.
      staged = per_chunk or not in_registers
      grad_in = grad_t.astype(g_smem.dtype)
      if staged:
        plgpu.wait_smem_to_gmem(2, wait_read_only=True)
        g_smem[buf] = grad_in
        plgpu.commit_smem()
      if per_chunk:
        plgpu.copy_smem_to_gmem(g_smem.at[buf], d_next_ref.at[batch, head, chunk_of(i), cols])
      do_t = do_smem.at[slot].transpose((1, 0))
      if channel_gated:
        pairs = given_pairs_smem.at[slot]
      else:
        plgpu.barrier_wait(pairs_ready.at[pub])
        pairs = pairs_smem.at[pub]

      def cotangent_products(through_pairs, through_keys):  # dO^T P and G^T K^T
        plgpu.wgmma(through_pairs, do_t, pairs)
        plgpu.wgmma(through_keys, grad_in if in_registers else g_smem.at[buf], k_smem.at[slot].transpose((1, 0)))
        return through_pairs[...], through_keys[...]

      through_pairs, through_keys = pl.run_scoped(cotangent_products, plgpu.ACC((be, c), _F32),
                                                  plgpu.ACC((be, c), _F32))
      du_t = (through_pairs + (through_keys if key_factor is None else through_keys * key_factor)).astype(
          du_smem.dtype)
      if staged:
        du_smem[buf] = du_t
        plgpu.commit_smem()
      if per_chunk:
        plgpu.copy_smem_to_gmem(du_smem.at[buf], du_ref.at[batch, head, cols, chunk_rows(i)])
      # -dO^T Diag(row): negated with the state term below.
      if in_registers:
        do_rows = do_t[...].astype(_F32)
        queries_t = (-do_rows if row is None else do_rows * (by_column(-row) if gated else -row)).astype(
            do_smem.dtype)
      else:  # staged untransposed, read transposed by wgmma
        do_rows = do_smem[slot].astype(_F32)
        queries_smem[...] = (-do_rows if row is None else do_rows * (-row[:, None] if gated else -row)).astype(
            queries_smem.dtype)
        plgpu.commit_smem()
        queries_t = queries_smem.transpose((1, 0))
      # -(G^T before the chunk) = -a G^T - dO^T Q_g + dU^T W, one accumulator.
      plgpu.barrier_wait(w_ready.at[pub])
      negated = lightning_mosaic.update(
          -grad_t if decay is None else grad_t * -decay, (queries_t, q_smem.at[slot]),
          (du_t if in_registers else du_smem.at[buf], w_smem.at[pub]), in_registers=in_registers)
      plgpu.barrier_arrive(pairs_read.at[pub])
      plgpu.barrier_arrive(released.at[slot])
      return -negated

    grad_t = lax.fori_loop(0, num_chunks, body, grad_t)
    plgpu.wait_smem_to_gmem(0)  # G^T's buffers are free: dL/dS_0^T goes out through their bytes
    g_f32_smem[...] = grad_t
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(g_f32_smem, d_initial_ref.at[sequence, head, cols])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _pairs():
    if not channel_gated:
      plgpu.barrier_wait(intra_loaded.at[0])
      intra = intra_smem[...]

    @pl.loop(0, num_chunks)
    def _chunk(i):
      slot, pub = slot_of(i), lax.rem(i, _PUBLISHED_PAIRS)
      plgpu.barrier_wait(loaded.at[slot])

      def claim():  # the chain is done with chunk i - _PUBLISHED_PAIRS's buffers
        @pl.when(i >= _PUBLISHED_PAIRS)
        def _():
          plgpu.barrier_wait(pairs_read.at[pub])

      if channel_gated:  # W = T' K_g (P comes in the ring)
        inverse_scaled, keys = inverse_smem.at[slot], keys_smem.at[slot]
      else:
        def weighted_scores(acc):
          plgpu.wgmma(acc, q_smem.at[slot], k_smem.at[slot].transpose((1, 0)))
          if not gated:
            return acc[...] * intra
          weights = lightning_mosaic.pair_weights(intra, rows_smem.at[slot], columns_smem.at[slot],
                                                  cum_end=rows_smem[slot, lightning_mosaic.CUM, c - 1],
                                                  has_segments=has_segments)
          return acc[...] * weights

        pairs = pl.run_scoped(weighted_scores, plgpu.ACC((c, c), _F32)).astype(pairs_smem.dtype)
        claim()
        # P out first: the chain's first products take it, its update alone W.
        pairs_smem[pub] = pairs
        plgpu.commit_smem()
        plgpu.barrier_arrive(pairs_ready.at[pub])
        # W = T' K_g = (T' Diag(2^-c_s)) K, the columns of T' scaled as K_g's rows (zero past a segment start);
        # without gates T' K, T' read from the ring.
        inverse_scaled = inverse_smem.at[slot]
        if gated:
          by_column = lambda x: lax.broadcast_in_dim(x, (c, c), (1,))  # noqa: E731
          key_rows = jnp.exp2(lightning_mosaic.row_exponents(columns_smem.at[slot], has_segments=has_segments))
          inverse_scaled = (inverse_smem[slot].astype(_F32) * by_column(key_rows)).astype(inverse_smem.dtype)
          if not in_registers:
            inverse_scaled_smem[...] = inverse_scaled
            plgpu.commit_smem()
            inverse_scaled = inverse_scaled_smem
        keys = k_smem.at[slot]

      def wy_keys(acc):
        plgpu.wgmma(acc, inverse_scaled, keys)
        return acc[...]

      w = pl.run_scoped(wy_keys, plgpu.ACC((c, k_smem.shape[-1]), _F32)).astype(w_smem.dtype)
      if channel_gated:
        claim()
      w_smem[pub] = w
      plgpu.commit_smem()
      plgpu.barrier_arrive(w_ready.at[pub])
      plgpu.barrier_arrive(released.at[slot])

    @pl.loop(lightning_mosaic.last_chunks(num_chunks, _PUBLISHED_PAIRS), num_chunks)
    def _drain(i):
      plgpu.barrier_wait(pairs_read.at[lax.rem(i, _PUBLISHED_PAIRS)])


def _check_operands(keys, dim_v: int, inverse, num_tokens=None) -> int:
  """Tp, of keys [B, T', H, K] with K 64 or 128 and T' <= Tp (num_tokens; None: T') rows, T' a multiple of
  `WarpSpecializedConfig.TMA_ROWS` or Tp itself (rows past T' read as zeros), Tp a multiple of 64, Ep = dim_v a
  multiple of 64, inverse [B, H, Tp, 64]; or a ValueError."""
  b, rows, h, dim_k = keys.shape
  tp = rows if num_tokens is None else num_tokens
  c, be = CHUNK_SIZE, BLOCK_E
  if (tp % c or not WarpSpecializedConfig.takes_rows(rows, tp) or dim_k not in (64, 128)
      or dim_v % be or inverse.shape != (b, h, tp, c)):
    raise ValueError(f"operands: Tp a multiple of {c}, keys [B, T', H, K] with T' <= Tp a multiple of "
                     f"{WarpSpecializedConfig.TMA_ROWS} (or Tp) and K 64 or 128, Ep a multiple of {be}, inverse "
                     f"[B, H, Tp, {c}]; got keys {keys.shape}, Tp {tp}, Ep {dim_v}, inverse {inverse.shape}")
  return tp


def _checked_factors(keys, dim_v: int, inverse, chunk_gates, num_tokens=None):
  """The chunks' factor rows (`lightning_mosaic.chunk_factors`) for the operands, which it checks
  (`_check_operands`); None without gates (DeltaNet unpacked: the kernels then load no factor rows and form no
  exp2)."""
  tp = _check_operands(keys, dim_v, inverse, num_tokens)
  b, _, h, _ = keys.shape
  cumdecay, runs = chunk_gates
  if cumdecay is None and runs is None:
    return None
  if cumdecay is None:
    cumdecay = jnp.zeros((b, h, tp), _F32)
  return lightning_mosaic.chunk_factors(cumdecay, runs)


def state_sweep(k, v, inverse, chunk_gates, initial_state, *, interpret: bool = False, channel_gates=None,
                sequences=None, num_tokens=None):
  """The backward's state sweep: (S_n^T [B, H, N, Ep, K], the state before chunk n; U^T [B, H, Ep, Tp]), both in
  the input dtype.

  k: [B, T', H, K]; v: [B, T', H, Ep] (as for `state_cotangents`, with num_tokens); inverse:
  each chunk's T' = T Diag(beta) [B, H, Tp, 64] (`inverse`, as
  the forward's); chunk_gates: as for `state_cotangents`; initial_state: None or
  S_0^T [B, H, Ep, K] float32. channel_gates: None, or KDA's (K_C, P, the
  state's decay), k then K_g and chunk_gates (None, None), as
  `lightning_mosaic.forward_padded`'s `delta_channel_gates`. sequences: as
  for `state_cotangents` (initial_state then [S, H, Ep, K], each sequence's).
  """
  dim_k = k.shape[-1]
  tp = k.shape[1] if num_tokens is None else num_tokens
  cfg = heuristics.resolve_warp_specialized(None, dim_k=dim_k, itemsize=k.dtype.itemsize, delta=True,
                                            channel_gated=channel_gates is not None)
  if initial_state is not None:  # one slice a row, or one row of S sequences' states
    initial_state = jnp.moveaxis(initial_state, 0, 1)[None] if sequences is not None else initial_state[:, :, None]
  return lightning_mosaic.forward_padded(
      None, k, v, None, initial_state, chunk_gates=chunk_gates, delta_inverse=inverse, delta_states=True,
      delta_channel_gates=channel_gates, with_outputs=False, scale=1.0, seq_len=tp, cfg=cfg, sequences=sequences,
      num_tokens=tp, interpret=interpret)


def state_cotangents(q, k, inverse, do, chunk_gates, d_final, *, scale: float, interpret: bool = False,
                     initial_only: bool = False, channel_gates=None, sequences=None, num_tokens=None):
  """The reverse sweep: (G^T [B, H, N, Ep, K] in the input dtype, G_n^T = (dL/dS after chunk
  n)^T; dL/dS_0^T [B, H, Ep, K] float32; dU^T [B, H, Ep, Tp] in the input dtype); with `initial_only`, dL/dS_0^T
  alone (the sequence split's pass from zero end cotangents, which stores nothing a chunk).

  q, k: [B, T', H, K]; inverse: T' [B, H, Tp, 64] as for `state_sweep`; do:
  [B, T', H, Ep]; bf16 or fp16, Tp (num_tokens; None: T') a multiple of 64,
  T' <= Tp a multiple of 8 or Tp itself (the kernel reads zeros past it: no
  copy of the operands to whole chunks), K = 64 or 128, Ep a multiple of 64
  (`WarpSpecializedConfig.padded_dims`). chunk_gates: (cumdecay [B, H,
  Tp] float32 or None, runs [B, Tp] int32 or None) as
  `chunk_common.token_chunk_gates` gives them for the forward sweep over 64-token
  chunks. d_final: None or (dL/dS_T)^T [B, H, Ep, K] float32.
  channel_gates: None, or KDA's per-key-channel gates (`channel_gated_chunks`'
  terms): (K_g [B, Tp, H, K], P [B, H, Tp, 64], the state's decay 2^G_C [B,
  H, N, 1, K] float32), with q and k given as Q_g (scaled) and K_C,
  chunk_gates (None, None) and scale 1: P is read as given, W = T' K_g.
  sequences: None, or with B = 1 (first, end) [S] int32, the 64-token chunk
  bounds of S chunk-aligned sequences covering every chunk
  (`pallas_triton.sequence_bounds`): CTAs per (head, sequence, value block)
  walk each sequence's chunks back from its own end cotangent (d_final [S,
  H, Ep, K]) to its own dL/dS_0^T [S, H, Ep, K].
  """
  b, rows, h, dim_k = q.shape
  tp = rows if num_tokens is None else num_tokens
  dim_v = do.shape[-1]
  c, be = CHUNK_SIZE, BLOCK_E
  if k.shape != q.shape or do.shape[:3] != q.shape[:3]:
    raise ValueError(f"q, k [B, T', H, K] and do [B, T', H, Ep] take the same rows; got q {q.shape}, k {k.shape}, "
                     f"do {do.shape}")
  channel_gated = channel_gates is not None
  if channel_gated:
    keys, pairs, channel_decay = channel_gates
    if (any(g is not None for g in chunk_gates) or scale != 1.0 or keys.shape != q.shape
        or pairs.shape != (b, h, tp, c) or channel_decay.shape != (b, h, tp // c, 1, dim_k)):
      raise ValueError(f"channel_gates take chunk_gates (None, None), scale 1, and K_g [B, Tp, H, K] = {q.shape}, P "
                       f"[B, H, Tp, {c}], the state's decay [B, H, N, 1, K]; got {chunk_gates}, {scale}, "
                       f"{keys.shape}, {pairs.shape}, {channel_decay.shape}")
    _check_operands(q, dim_v, inverse, num_tokens)
    gate_inputs = (keys, pairs, channel_decay.astype(_F32))
  else:
    vectors = _checked_factors(q, dim_v, inverse, chunk_gates, num_tokens)
    gate_inputs = (lightning_mosaic.scaled_causal_mask(scale),) + (() if vectors is None else (vectors,))
  dtype = q.dtype
  stages = num_stages(dim_k=dim_k, itemsize=dtype.itemsize, channel_gated=channel_gated)
  in_registers = not interpret  # the interpreter's wgmma reads shared memory alone
  smem = lightning_mosaic.swizzled_smem
  ring = lambda width: smem((stages, c, width), dtype)  # noqa: E731
  if channel_gated:  # K_g, P and the state's decay in the ring; W published
    gate_smem = (ring(dim_k), ring(c), plgpu.SMEM((stages, 1, dim_k), _F32))
  else:  # the factor rows twice in the ring (with gates), the scaled causal mask; P and W published
    gate_smem = (() if vectors is None else (plgpu.SMEM((stages,) + vectors.shape[-2:], _F32),) * 2) + (
        plgpu.SMEM((c, c), _F32), smem((_PUBLISHED_PAIRS, c, c), dtype))
  gated = not channel_gated and vectors is not None
  staged = () if in_registers else (smem((c, be), dtype),) + (() if not gated else (smem((c, c), dtype),))
  scratch = (
      (ring(dim_k), ring(dim_k), ring(c), ring(be), *gate_smem, smem((_PUBLISHED_PAIRS, c, dim_k), dtype),
       plgpu.RefUnion(smem((2, be, dim_k), dtype), plgpu.SMEM((be, dim_k), _F32)), smem((2, be, c), dtype))
      + staged,
      # q, k, T', dO and the factor rows twice (KDA: K_g, P and the decay), one arrival each.
      (plgpu.Barrier(num_arrivals=4 + 3 * channel_gated + 2 * gated, num_barriers=stages),
       plgpu.Barrier(num_barriers=1),
       plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier(num_barriers=_PUBLISHED_PAIRS),
       plgpu.Barrier(num_barriers=_PUBLISHED_PAIRS), plgpu.Barrier(num_barriers=_PUBLISHED_PAIRS))
      + ((plgpu.Barrier(num_barriers=1),) if d_final is not None else ()),
  )
  num_states = b  # end and initial cotangents: one a row, or one a sequence
  if sequences is not None:
    num_states = sequences[0].shape[0]
    if b != 1 or any(x.shape != (num_states,) for x in sequences):
      raise ValueError(f"sequences take one row and (first, end) [S] chunk bounds; got B = {b}, "
                       f"{[x.shape for x in sequences]}")
  if d_final is not None and d_final.shape != (num_states, h, dim_v, dim_k):
    raise ValueError(f"d_final must be [B or S, H, Ep, K] = {(num_states, h, dim_v, dim_k)}, got {d_final.shape}")
  inputs = (q, k, inverse, do) + gate_inputs + (() if d_final is None else (d_final,)) + (
      () if sequences is None else (jnp.stack(sequences).astype(jnp.int32),))
  n = tp // c
  out_type = (manual_axes.struct((b, h, n, dim_v, dim_k), dtype, *inputs),
              manual_axes.struct((b, h, dim_v, tp), dtype, *inputs))
  out_type = (() if initial_only else out_type) + (
      manual_axes.struct((num_states, h, dim_v, dim_k), _F32, *inputs),)
  kernel = functools.partial(_kernel, num_chunks=n, num_stages=stages, gated=gated,
                             has_segments=not channel_gated and chunk_gates[1] is not None,
                             has_final=d_final is not None, scale=scale, in_registers=in_registers,
                             per_chunk=not initial_only, channel_gated=channel_gated,
                             sequences=sequences is not None)
  *per_chunk, d_initial_t = lightning_mosaic.warpgroup_kernel(
      kernel, out_type=out_type, scratch_types=scratch, grid=(h, num_states, dim_v // be),
      grid_names=("heads", "batch", "value_blocks"), interpret=interpret,
      kernel_name="delta_state_cotangents_warp_specialized")(*inputs)
  if initial_only:
    return d_initial_t
  d_next_t, du_t = per_chunk
  return d_next_t, d_initial_t, du_t


# Deepest ring of `piece_maps`: four slots of k, v, T' and the factor rows take 130 KB at K = 128 in 16 bits.
_MAP_STAGES = 4


def piece_maps_shared_memory_bytes(*, num_stages: int, dim_k: int, itemsize: int, factor_rows: int = 2,
                                   staged: bool = False) -> int:
  """`piece_maps`' shared memory: the ring (k [C, K], v [C, 64], T' [C, C] and the factor rows per slot), each
  chain's float32 [64, K] state, and with `staged` (interpreted) each chain's staged left operands."""
  c, be = CHUNK_SIZE, BLOCK_E
  ring = num_stages * (c * (dim_k + be + c) * itemsize + factor_rows * c * 4)
  chains = 2 * be * dim_k * 4 + (2 * be * (dim_k + c) * itemsize if staged else 0)
  return ring + chains + _RESERVED


def _maps_kernel(identity_ref, *refs, num_chunks, num_stages, identity_blocks, value_blocks, gated, has_segments,
                 in_registers):
  # `gated`: each chunk's factor rows [B, H, N, F, C] come first (a scalar gate or packed rows).
  vectors_ref, k_ref, v_ref, inverse_ref, maps_ref, buffers, barriers = (None,) * (not gated) + refs
  k_smem, v_smem, inverse_smem, *buffers = buffers
  rows_smem = buffers.pop(0) if gated else None
  state_smem, *staged = buffers
  loaded, released, identity_loaded = barriers
  c, be = CHUNK_SIZE, BLOCK_E
  head, batch, col = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("blocks")
  wg = lax.axis_index("wg")
  # CTA `col` carries identity block min(col, identity_blocks - 1) and value block min(col, value_blocks - 1):
  # where K and Ep differ, the narrower side's last block runs twice and writes the same rows twice.
  identity_block = jnp.minimum(col, identity_blocks - 1)
  value_block = jnp.minimum(col, value_blocks - 1)

  @pl.when(wg == 0)
  def _memory():
    value_cols = pl.ds(pl.multiple_of(value_block * be, be), be)

    def load(n, slot):  # n static for the ring's first slots
      rows = pl.ds(n * c if isinstance(n, int) else pl.multiple_of(n * c, c), c)
      plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, head], k_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[batch, rows, head, value_cols], v_smem.at[slot], loaded.at[slot])
      plgpu.copy_gmem_to_smem(inverse_ref.at[batch, head, rows], inverse_smem.at[slot], loaded.at[slot])
      if gated:
        plgpu.copy_gmem_to_smem(vectors_ref.at[batch, head, n], rows_smem.at[slot], loaded.at[slot])

    lightning_mosaic.fill_ring(load, released, num_chunks=num_chunks, num_stages=num_stages)

  # Two chains, one warpgroup each, on the same chunks: the identity block's (from I's rows, no values: M^T) and the
  # value block's (from zeros: L^T). Each chain's products wait on its own last ones; two chains in one CTA fill
  # those waits, and halve the CTAs of one chain a CTA.
  for chain, carries_identity in enumerate((True, False)):
    @pl.when(wg == 1 + chain)
    def _chain():
      state_f32 = state_smem.at[chain]
      staging = None if in_registers else tuple(buffer.at[chain] for buffer in staged)
      if carries_identity:
        plgpu.copy_gmem_to_smem(identity_ref.at[identity_block], state_f32, identity_loaded.at[0])
        plgpu.barrier_wait(identity_loaded.at[0])
        state = state_f32[...]
        first_row = identity_block * be
      else:
        state = jnp.zeros((be, k_smem.shape[-1]), _F32)
        first_row = (identity_blocks + value_block) * be

      def body(n, state_t):
        slot = lax.rem(n, num_stages)
        plgpu.barrier_wait(loaded.at[slot])
        rows = rows_smem.at[slot] if gated else None
        values_t = lightning_mosaic.delta_pseudo_values(
            state_t.astype(k_smem.dtype), k_smem.at[slot], inverse_smem.at[slot],
            None if carries_identity else v_smem.at[slot], rows, has_segments=has_segments, staging=staging)
        exponents = (None, None)
        if gated:
          exponents = lightning_mosaic.update_exponents(
              rows, cum_end=rows_smem[slot, lightning_mosaic.CUM, c - 1],
              runs_end=rows_smem[slot, lightning_mosaic.RUNS, c - 1] if has_segments else None,
              has_segments=has_segments)
        state_t = lightning_mosaic.delta_update(state_t, values_t, k_smem.at[slot], *exponents, staging=staging)
        plgpu.barrier_arrive(released.at[slot])
        return state_t

      state = lax.fori_loop(0, num_chunks, body, state)
      state_f32[...] = state
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(state_f32, maps_ref.at[batch, head, pl.ds(pl.multiple_of(first_row, be), be)])
      plgpu.wait_smem_to_gmem(0)


def piece_maps(k, v, inverse, chunk_gates, *, interpret: bool = False, num_tokens=None):
  """Each row's affine map, transposed: [M | L]^T [B, H, K + Ep, K] float32, M [K, K] the product of the row's
  transitions (I - beta_t k_t k_t^T) Diag(a_t) and L [K, Ep] its state from zeros (`sequence_split`).

  The forward from [I | 0] over the values [0 | v] (`sequence_parallel.affine_maps`),
  without its outputs, q or the augmented operands: one CTA per (head, row,
  64 rows of I and 64 value columns) walks the row's chunks, its memory
  warpgroup loading k, v, T' and the factor rows into a ring and two chain
  warpgroups running the forward's chain step (`delta_pseudo_values`,
  `delta_update`), one from I's 64 rows without values and one from zeros over
  the 64 value columns. Operands as `state_sweep`'s: k [B, T', H, K], v [B,
  T', H, Ep] with T' rows (`_check_operands`; num_tokens Tp, None: T'), inverse
  T' [B, H, Tp, 64], chunk_gates (cumdecay or None, runs or None).
  """
  b, _, h, dim_k = k.shape
  dim_v = v.shape[-1]
  c, be = CHUNK_SIZE, BLOCK_E
  vectors = _checked_factors(k, dim_v, inverse, chunk_gates, num_tokens)
  tp = inverse.shape[2]  # Tp, as `_check_operands` checked it
  runs = chunk_gates[1]
  identity_blocks, value_blocks = dim_k // be, dim_v // be
  identity = jnp.eye(dim_k, dtype=_F32).reshape(identity_blocks, be, dim_k)  # I^T's rows, 64 a block
  dtype = k.dtype
  in_registers = not interpret  # the interpreter's wgmma reads shared memory alone
  gated = vectors is not None
  factor_rows = vectors.shape[-2] if gated else 0
  smem = lightning_mosaic.swizzled_smem
  stages = _deepest_ring(lambda stages: piece_maps_shared_memory_bytes(
      num_stages=stages, dim_k=dim_k, itemsize=dtype.itemsize, factor_rows=factor_rows, staged=not in_registers),
      _MAP_STAGES)
  scratch = (
      (smem((stages, c, dim_k), dtype), smem((stages, c, be), dtype), smem((stages, c, c), dtype))
      + ((plgpu.SMEM((stages, factor_rows, c), _F32),) if gated else ()) + (plgpu.SMEM((2, be, dim_k), _F32),)
      + (() if in_registers else (smem((2, be, dim_k), dtype), smem((2, be, c), dtype))),
      # k, v, T' and the factor rows (with gates), one arrival each; both chains release a slot.
      (plgpu.Barrier(num_arrivals=3 + gated, num_barriers=stages), plgpu.Barrier(num_arrivals=2, num_barriers=stages),
       plgpu.Barrier(num_barriers=1)),
  )
  inputs = (identity,) + ((vectors,) if gated else ()) + (k, v, inverse)
  kernel = functools.partial(_maps_kernel, num_chunks=tp // c, num_stages=stages, identity_blocks=identity_blocks,
                             value_blocks=value_blocks, gated=gated, has_segments=runs is not None,
                             in_registers=in_registers)
  return lightning_mosaic.warpgroup_kernel(
      kernel, out_type=manual_axes.struct((b, h, dim_k + dim_v, dim_k), _F32, *inputs), scratch_types=scratch,
      grid=(h, b, max(identity_blocks, value_blocks)), grid_names=("heads", "batch", "blocks"), interpret=interpret,
      kernel_name="delta_piece_maps_warp_specialized")(*inputs)


# The inverse kernel's diagonal blocks: each is solved by substitution, then the blocks merge 16 -> 32 -> 64.
_SOLVE_BLOCK = 16
# Float32 padding of the solve's shared-memory rows of 16: rows of 80 bytes keep its 16-byte loads aligned and spread
# the 8 rows a warp stores at once over the banks.
_SOLVE_PAD = 4
# The factor row of beta (`_factor_rows`).
_BETA_ROW = 0


class ChunkWalks(NamedTuple):
  """How many chunks a CTA of a per-chunk kernel walks by default (the next chunk's loads in flight during this
  one's chain): the first of `one_wave_walks` dividing the row's chunks whose CTAs, at least `ctas_per_sm` an SM,
  all fit in one wave of `resident_per_sm` an SM (no tail of CTAs left alone on their SMs); else the most of `walks`
  dividing them that leave at least `ctas_per_sm` CTAs an SM, else 1 (one chunk's chain is latency-bound, so CTAs
  sharing an SM fill its waits)."""
  walks: tuple[int, ...]
  ctas_per_sm: int
  one_wave_walks: tuple[int, ...] = ()
  resident_per_sm: int = 1


# `inverse`. H200, 2026-11-30, the kernel alone (121 registers, 43 KB of shared memory at D64), 4 / 8 / 16 chunks a
# CTA: 0.1053 / 0.1030 / 0.1016 ms at B4 H32 T8K D64, 0.3820 / 0.3726 / 0.3705 at T32K, 0.0706 / 0.0711 / 0.0858 at B2
# H32 T8K D128, 0.2443 / 0.2389 / 0.2449 at T32K, 0.2441 / 0.2357 / 0.2423 at B1 H32 T64K D128 (per-token rates
# alike), but 0.0453 / 0.0515 / 0.0426 at B4 H32 T2K D64: 8 leave 512 CTAs, which run as if three an SM fit (a wave and
# a tail) although registers and shared memory would hold four, and 16 leave 256, one wave. (At two CTAs an SM, before
# 74c138b, 16 had led 8 by 0.3-3% and 32 was 1.5x slower at T2K: PERFORMANCE.md, "Delta attention".)
INVERSE_WALKS = ChunkWalks(walks=(8, 4, 2), ctas_per_sm=1, one_wave_walks=(16,), resident_per_sm=3)
# `channel_gated_chunks` (KDA). H200, 2026-11-30, two CTAs an SM at K = 64: the default / 4 / 8 / 16 chunks a CTA
# within 1% of each other at B4 H32 D64, T 2K to 32K.
CHANNEL_GATED_WALKS = ChunkWalks(walks=(8, 4, 2), ctas_per_sm=2)


def _solve_tile():
  """One of the solve's two float32 [C / 16, 16, 16 + _SOLVE_PAD] shared-memory tiles: the diagonal blocks alone."""
  return plgpu.SMEM((CHUNK_SIZE // _SOLVE_BLOCK, _SOLVE_BLOCK, _SOLVE_BLOCK + _SOLVE_PAD), _F32)


def _solve_diagonal_blocks(neg_a, upper_ref, solved_ref):
  """The inverses of the 16 x 16 diagonal blocks of I + A, [C, C] float32, zero outside them.

  neg_a: -A, float32 [C, C] registers, of which the strictly lower part of
  each diagonal block is read; upper_ref, solved_ref: `_solve_tile()`s. Warp w
  of the warpgroup holds rows 16 w to 16 w + 15, so diagonal block w is its
  registers of those columns: it stores them alone, transposed (upper_ref's
  blocks hold -A^T's), and loads the solved block back into them (zeros in the
  others). Thread c of the warpgroup's first 64 solves column c of its block by
  forward substitution, right-looking: with r = e_c, for j = 0, 1, ... of the
  block's rows, x_j = r_j and r_i -= A_ij x_j for the rows i > j. So the
  dependent chain is one FMA a row, -A^T's row j holds the column of A that
  step j reads (16-byte loads, broadcast within a warp), and the 16 values of r
  stay in registers. Off the tensor cores: merging up to 16-row blocks took
  eight of the Triton kernel's ten dependent products.
  """

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.RefType()),
                     return_type=plgpu.ShapeDtypeStruct((CHUNK_SIZE, CHUNK_SIZE), _F32, layout=plgpu.Layout.WGMMA))
  def solve(_, neg_a, upper_ref, solved_ref):
    block = _SOLVE_BLOCK
    f32, i32, index = ir.F32Type.get(), ir.IntegerType.get_signless(32), ir.IndexType.get()
    quad, pair = ir.VectorType.get([4], f32), ir.VectorType.get([2], f32)
    const = mgpu_utils.c
    as_index = lambda x: arith.index_cast(index, x)  # noqa: E731
    # WGMMA_LAYOUT: register (j, h), a pair of float32, holds row 16 warp + 8 h + lane / 4 and columns 8 j +
    # 2 (lane % 4) + (0, 1).
    registers = neg_a.registers.reshape(CHUNK_SIZE // 8, 2)
    thread = arith.remui(mgpu_utils.thread_idx(), const(128, i32))
    warp, lane = arith.divui(thread, const(32, i32)), arith.remui(thread, const(32, i32))
    in_warp = [arith.cmpi(arith.CmpIPredicate.eq, warp, const(w, i32)) for w in range(CHUNK_SIZE // block)]
    block_row = lambda h: as_index(arith.addi(arith.divui(lane, const(4, i32)), const(8 * h, i32)))  # noqa: E731
    block_column = lambda offset: as_index(  # noqa: E731
        arith.addi(arith.muli(arith.remui(lane, const(4, i32)), const(2, i32)), const(offset, i32)))
    for half in range(2):  # the block's columns 8 half + (0 .. 7): register j = 2 warp + half
      for h in range(2):
        value = registers[half, h]
        for w in range(1, CHUNK_SIZE // block):
          value = arith.select(in_warp[w], registers[2 * w + half, h], value)
        for e in range(2):  # transposed: a warp's 32 stores fall on 32 banks (rows of 16 + _SOLVE_PAD)
          entry = vector.extract(value, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e]))
          memref.store(entry, upper_ref, [as_index(warp), block_column(8 * half + e), block_row(h)])
    mgpu_utils.warpgroup_barrier()  # every thread reads rows the others stored
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, thread, const(CHUNK_SIZE, i32))):
      local = arith.remui(thread, const(block, i32))
      which = as_index(arith.divui(thread, const(block, i32)))  # the column's block
      col = as_index(local)
      zero, one = const(0.0, f32), const(1.0, f32)
      residual = [arith.select(arith.cmpi(arith.CmpIPredicate.eq, local, const(i, i32)), one, zero)
                  for i in range(block)]
      for j in range(block):
        memref.store(residual[j], solved_ref, [which, const(j, index), col])
        for i0 in range((j + 1) // 4 * 4, block, 4):
          entries = vector.load(quad, upper_ref, [which, const(j, index), const(i0, index)])
          for i in range(max(i0, j + 1), i0 + 4):
            entry = vector.extract(entries, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i - i0]))
            residual[i] = mlir_math.fma(entry, residual[j], residual[i])
    mgpu_utils.warpgroup_barrier()  # every column is stored
    solved = [[vector.load(pair, solved_ref, [as_index(warp), block_row(h), block_column(8 * half)]) for h in range(2)]
              for half in range(2)]
    mgpu_utils.warpgroup_barrier()  # every thread has read its block: the tiles may be reused
    zeros = vector.broadcast(pair, const(0.0, f32))
    result = np.empty_like(neg_a.registers).reshape(CHUNK_SIZE // 8, 2)
    for j in range(CHUNK_SIZE // 8):
      for h in range(2):
        result[j, h] = arith.select(in_warp[j // 2], solved[j % 2][h], zeros)
    return mgpu.FragmentedArray(_registers=result.reshape(neg_a.registers.shape), _layout=neg_a.layout,
                                _is_signed=None)

  return solve(neg_a, upper_ref, solved_ref)


def _merge_tile(k_steps: bool):
  """A float16 [C, C] staging tile of `_unit_lower_inverse`'s merges. With k_steps swizzled by 32 bytes, so that a
  product reads it as b in k-steps of 16 (wgmma issues k in groups of the swizzle's width), else by 128."""
  shape = (CHUNK_SIZE, CHUNK_SIZE)
  if k_steps:
    return plgpu.SMEM(shape, jnp.float16, transforms=(plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32)))
  return lightning_mosaic.swizzled_smem(shape, jnp.float16)


def _unit_lower_inverse(neg_a, solve_smem, staging, *, in_registers, k_steps):
  """T = (I + A)^{-1} [C, C] float32 of a chunk's strictly lower A [C, C] float32 registers.

  neg_a: -A, of which only the strictly lower part is read (so the caller need
  not mask the rest); solve_smem: the solve's two `_solve_tile()`s; staging:
  `_merge_tile(k_steps)`'s (links, x), and where the interpreter runs (its wgmma
  reads shared memory alone) a third for the products' a. The diagonal blocks
  are solved in registers (`_solve_diagonal_blocks`; interpreted, which runs no
  inline Mosaic GPU, from single rows), then merged 16 -> 32 -> 64 rows: X <-
  X - (X L) X, L the lower-left blocks of A in each, so that every step writes
  exact blocks of T. A's links are staged negated once a chunk, before the solve
  (so that -A leaves the registers), as X L's b (so that X L comes out negated,
  as the update takes it), and X is staged while X L runs. With k_steps, X L is
  one product a block, of X's columns over the block's second half and the
  links' block of L alone ([C, 16] twice, then [C, 32]: no mask, a quarter and a
  half of the whole product's work), and (X L) X takes each of them as a with
  the k-steps of X's rows it covers; else X L is whole, masked to L's blocks.
  Operands are rounded to float16 (as the Triton inverse's merges: bfloat16's 8
  bits made T 5x less accurate with keys near one direction).
  """
  links, staged_x, *staged_a = staging
  c = CHUNK_SIZE
  t = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  s = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  same_block = lambda size: lax.div(t, size) == lax.div(s, size)  # noqa: E731
  links[...] = neg_a.astype(links.dtype)
  plgpu.commit_smem()
  if in_registers:
    x = _solve_diagonal_blocks(neg_a, *solve_smem)
    size = 2 * _SOLVE_BLOCK
  else:
    x = jnp.where(t == s, 1.0, 0.0)
    size = 2

  while size <= c:
    half = size // 2
    if k_steps and half % 16 == 0:  # (first column, width) of each block's product: its lower-left block alone
      blocks = tuple((start, half) for start in range(0, c, size))
    else:
      blocks = ((0, c),)
    x_half = x.astype(jnp.float16)
    x_operand = x_half if in_registers else staged_x

    def stage_x(x_half=x_half):
      staged_x[...] = x_half
      plgpu.commit_smem()

    def x_by_links(*accs):  # in registers, x's staging store runs while the products do
      for acc, (start, width) in zip(accs, blocks):
        rows = start + width if width < c else 0  # X L's k: the block's second half (L's rows)
        a_part = x_operand[:, rows:rows + width] if in_registers else x_operand.at[:, pl.ds(rows, width)]
        plgpu.wgmma(acc, a_part, links.at[pl.ds(rows, width), pl.ds(start, width)])
      if in_registers:
        if size > 2 * _SOLVE_BLOCK:  # the last merge's (X L) X has read x's tile on every warp
          lightning_mosaic.warpgroup_barrier()
        stage_x()
      return tuple(acc[...] for acc in accs)

    if not in_registers:
      stage_x()
    neg_x_links = pl.run_scoped(x_by_links, *(plgpu.ACC((c, width), _F32) for _, width in blocks))
    if len(blocks) == 1 and blocks[0][1] == c:  # whole: masked to the lower-left blocks
      lower_left = same_block(size) & (lax.rem(t, size) >= half) & (lax.rem(s, size) < half)
      neg_x_links = (jnp.where(lower_left, neg_x_links[0], 0.0),)
    products = []
    for neg_x_link, (start, width) in zip(neg_x_links, blocks):
      neg_x_link = neg_x_link.astype(jnp.float16)
      if not in_registers:
        staged_a[0].at[:, pl.ds(start, width)][...] = neg_x_link
        neg_x_link = staged_a[0].at[:, pl.ds(start, width)]
      products.append((neg_x_link, staged_x.at[pl.ds(start, width)]))
    if not in_registers:
      plgpu.commit_smem()
    x = lightning_mosaic.update(x, *products, in_registers=in_registers)
    size *= 2
  return x


def _inverse_kernel(rows_ref, k_ref, *refs, chunks_per_cta, cum_row, runs_row, with_unscaled, in_registers):
  *outputs, buffers, loaded = refs
  k_smem, rows_smem, staging, (solve_smem, out_smem) = buffers
  c = CHUNK_SIZE
  head, batch = lax.axis_index("heads"), lax.axis_index("batch")
  first_chunk = lax.axis_index("chunk_blocks") * chunks_per_cta

  def load(n, slot):  # chunk first_chunk + n: its keys, and its factor rows twice (one copy per layout)
    chunk = first_chunk + n
    rows = pl.ds(pl.multiple_of(chunk * c, c), c)
    plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, head], k_smem.at[slot], loaded.at[slot])
    for copy in range(2):
      plgpu.copy_gmem_to_smem(rows_ref.at[batch, head, chunk], rows_smem.at[slot, copy], loaded.at[slot])

  load(0, 0)
  by_row = lambda x: lax.broadcast_in_dim(x, (c, c), (0,))  # noqa: E731
  by_column = lambda x: lax.broadcast_in_dim(x, (c, c), (1,))  # noqa: E731

  @pl.loop(0, chunks_per_cta)
  def _chunk(n):
    slot = lax.rem(n, 2)
    plgpu.barrier_wait(loaded.at[slot])

    @pl.when(n + 1 < chunks_per_cta)
    def _prefetch():  # into the other slot, which chunk n - 1's products (complete) read last
      load(n + 1, 1 - slot)

    keys = k_smem.at[slot]
    rows, columns = rows_smem.at[slot, 0], rows_smem.at[slot, 1]

    def key_products(acc):
      plgpu.wgmma(acc, keys, keys.transpose((1, 0)))
      return acc[...]

    # The pair products (k_t . k_s) 2^-|c_t - c_s| of one segment, then -A (-beta_t by rows), unmasked
    # (`_unit_lower_inverse` reads its lower triangle alone).
    pairs = pl.run_scoped(key_products, plgpu.ACC((c, c), _F32))
    if cum_row is not None:
      gap = by_column(columns[cum_row]) - by_row(rows[cum_row])
      pairs = pairs * jnp.exp2(jnp.minimum(gap, -gap))
    if runs_row is not None:
      pairs = jnp.where(by_row(rows[runs_row]) == by_column(columns[runs_row]), pairs, 0.0)
    neg_a = pairs * by_row(-rows[_BETA_ROW])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # chunk n - 1's stores have read their tiles (the solve's)
    x = _unit_lower_inverse(neg_a, solve_smem, staging, in_registers=in_registers, k_steps=True)
    results = ((x * by_column(columns[_BETA_ROW]),) + ((x,) if with_unscaled else ()))
    rows_out = pl.ds(pl.multiple_of((first_chunk + n) * c, c), c)
    for result, tile, out_ref in zip(results, out_smem, outputs):
      tile[...] = result.astype(tile.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tile, out_ref.at[batch, head, rows_out])

  plgpu.wait_smem_to_gmem(0)


def _factor_rows(beta, *extra):
  """The factor rows [B, H, N, R, C] float32 a kernel of this file loads with each chunk: beta's (`_BETA_ROW`) of
  beta [B, H, Tp], then those of each of extra given ([B, H, Tp] per head, or [B, Tp] per row, as the segment-start
  counts, the same for every head); and the indices of extra's rows (None for one not given)."""
  b, h, tp = beta.shape
  n = tp // CHUNK_SIZE
  rows, indices = [beta.astype(_F32).reshape(b, h, n, 1, CHUNK_SIZE)], []
  for x in extra:
    indices.append(None if x is None else len(rows))
    if x is not None:
      rows.append(jnp.broadcast_to(x.astype(_F32).reshape(b, -1, n, 1, CHUNK_SIZE), rows[0].shape))
  return (jnp.concatenate(rows, axis=3), *indices)


def default_chunks_per_cta(*, batch_heads: int, num_chunks: int, num_sms: int,
                           policy: ChunkWalks = INVERSE_WALKS) -> int:
  """Chunks each CTA of a per-chunk kernel walks under `policy` (`ChunkWalks`), over batch_heads rows of num_chunks
  chunks on num_sms SMs."""
  ctas = lambda chunks: batch_heads * (num_chunks // chunks)  # noqa: E731
  for chunks in policy.one_wave_walks:
    if num_chunks % chunks == 0 and policy.ctas_per_sm * num_sms <= ctas(chunks) <= policy.resident_per_sm * num_sms:
      return chunks
  for chunks in policy.walks:
    if num_chunks % chunks == 0 and ctas(chunks) >= policy.ctas_per_sm * num_sms:
      return chunks
  return 1


def _checked_chunks_per_cta(chunks_per_cta, *, batch_heads: int, num_chunks: int, policy: ChunkWalks) -> int:
  """The chunks each CTA of `inverse` or `channel_gated_chunks` walks: chunks_per_cta, checked, or where None
  `default_chunks_per_cta`'s under the kernel's policy."""
  if chunks_per_cta is None:
    return default_chunks_per_cta(batch_heads=batch_heads, num_chunks=num_chunks,
                                  num_sms=heuristics.num_sms(jax.devices()[0]), policy=policy)
  if not lightning_config.is_int(chunks_per_cta) or chunks_per_cta < 1 or num_chunks % chunks_per_cta:
    raise ValueError(f"chunks_per_cta must be None or a positive int dividing the {num_chunks} chunks, "
                     f"got {chunks_per_cta!r}")
  return chunks_per_cta


def inverse(k, beta, chunk_gates, *, with_unscaled: bool = False, chunks_per_cta: int | None = None,
            num_tokens: int | None = None, interpret: bool = False):
  """Each 64-token chunk's T' = T Diag(beta), T = (I + A)^{-1}, [B, H, Tp, 64] in k's dtype; with_unscaled, (T, T').

  A_ts = beta_t (k_t . k_s) 2^(c_s - c_t) for s < t in one segment (c the
  cumulative rates, log2 units), as the Triton kernels form it, for the
  warp-specialised sweeps. One warpgroup a CTA walks `chunks_per_cta` chunks
  (None: `default_chunks_per_cta`; it must divide the chunks), the next chunk's
  keys and factor rows loading by TMA during this one's chain: k k^T on the
  tensor cores, the 16 x 16 diagonal blocks of T by substitution in float32
  registers (`_solve_diagonal_blocks`), then two merges, 16 -> 32 -> 64 rows
  (four dependent steps of float16 products, against the Triton kernel's ten,
  each product on the blocks where its operands hold nonzeros). 121 registers a
  thread; the solve's float32 tiles hold the diagonal blocks alone and share
  memory with the results' (43 KB of shared memory at K = 64, 59 KB at K = 128,
  6 KB more with_unscaled), so chunk n - 1's stores are read out before chunk
  n's solve. The kernel orders its own shared memory (`warpgroup_kernel(...,
  auto_barriers=False)`: 10 warpgroup barriers a chunk, not 20). Compiled only
  on sm90; the interpreter, which runs no inline Mosaic GPU, merges from single
  rows instead of the solve.

  Args:
    k: [B, T', H, K] bf16 or fp16, K 64 or 128, T' <= Tp (`num_tokens`) a
      multiple of `WarpSpecializedConfig.TMA_ROWS` (or Tp): rows past T' read as
      zeros (TMA fills a tile that runs past the array), so the caller need
      not copy k to whole chunks.
    beta: [B, H, Tp] float32, zero on padding.
    chunk_gates: (cumdecay [B, H, Tp] float32 or None, runs [B, Tp] int32 or
      None), `lightning_mosaic.sweep_gates`' for these tokens.
    num_tokens: Tp, a multiple of 64 (None: k's rows, which must be one).
  """
  b, key_rows, h, dim_k = k.shape
  tp = key_rows if num_tokens is None else num_tokens
  c = CHUNK_SIZE
  if (tp % c or not WarpSpecializedConfig.takes_rows(key_rows, tp) or dim_k not in (64, 128)
      or beta.shape != (b, h, tp)):
    raise ValueError(f"operands: k [B, T', H, K] with K 64 or 128 and T' rows a multiple of "
                     f"{WarpSpecializedConfig.TMA_ROWS} (or all Tp), beta [B, H, Tp], Tp a multiple of {c}; got k "
                     f"{k.shape}, beta {beta.shape}, Tp {tp}")
  rows, cum_row, runs_row = _factor_rows(beta, *chunk_gates)
  n = tp // c
  per_cta = _checked_chunks_per_cta(chunks_per_cta, batch_heads=b * h, num_chunks=n, policy=INVERSE_WALKS)
  in_registers = not interpret
  dtype = k.dtype
  smem = lightning_mosaic.swizzled_smem
  num_outputs = 2 if with_unscaled else 1
  scratch = (
      (smem((2, c, dim_k), dtype), plgpu.SMEM((2, 2) + rows.shape[-2:], _F32),
       tuple(_merge_tile(k_steps=True) for _ in range(2 if in_registers else 3)),
       # The solve's tiles, then the results'.
       plgpu.RefUnion((_solve_tile(), _solve_tile()), tuple(smem((c, c), dtype) for _ in range(num_outputs)))),
      plgpu.Barrier(num_arrivals=3, num_barriers=2),  # the keys and the factor rows twice
  )
  out_type = tuple(manual_axes.struct((b, h, tp, c), dtype, k, beta) for _ in range(num_outputs))
  kernel = functools.partial(_inverse_kernel, chunks_per_cta=per_cta, cum_row=cum_row, runs_row=runs_row,
                             with_unscaled=with_unscaled, in_registers=in_registers)
  tri_beta, *tri = lightning_mosaic.warpgroup_kernel(
      kernel, out_type=out_type, scratch_types=scratch, grid=(h, b, n // per_cta),
      grid_names=("heads", "batch", "chunk_blocks"), interpret=interpret, kernel_name="delta_inverse_mosaic",
      num_warpgroups=1, auto_barriers=not in_registers)(rows, k)
  return (tri[0], tri_beta) if with_unscaled else tri_beta


def _tile_gradients_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, tri_ref, states_ref, d_next_ref, u_ref, du_ref,
                           *refs, scale, gate_row, runs_row, in_registers):
  # One chunk a CTA, one warpgroup: the value side (loaded first) while q, S_n^T and G_n^T load, then the key side.
  dq_ref, dk_ref, dv_ref, d_beta_ref, *refs = refs
  dg_ref = refs.pop(0) if gate_row is not None else None
  buffers, (values_loaded, keys_loaded) = refs
  ((q_smem, k_smem, (v_smem, dk_smem), (do_smem, dq_smem), tri_smem, states_smem, d_next_smem, u_smem, du_smem,
    rows_smem, (z_smem, dw_smem), query_pairs_smem, key_pairs_smem, dv_smem, vectors_smem)) = buffers
  c = CHUNK_SIZE
  dp, ep = q_smem.shape[-1], v_smem.shape[-1]
  head, batch, n = lax.axis_index("heads"), lax.axis_index("batch"), lax.axis_index("chunks")
  rows_in = pl.ds(pl.multiple_of(n * c, c), c)
  for src, dst in ((k_ref.at[batch, rows_in, head], k_smem), (v_ref.at[batch, rows_in, head], v_smem),
                   (do_ref.at[batch, rows_in, head], do_smem), (tri_ref.at[batch, head, rows_in], tri_smem),
                   (u_ref.at[batch, head, :, rows_in], u_smem), (du_ref.at[batch, head, :, rows_in], du_smem),
                   (rows_ref.at[batch, head, n], rows_smem.at[0]), (rows_ref.at[batch, head, n], rows_smem.at[1])):
    plgpu.copy_gmem_to_smem(src, dst, values_loaded.at[0])
  for src, dst in ((q_ref.at[batch, rows_in, head], q_smem), (states_ref.at[batch, head, n], states_smem),
                   (d_next_ref.at[batch, head, n], d_next_smem)):
    plgpu.copy_gmem_to_smem(src, dst, keys_loaded.at[0])

  def product(shape, *operands, during=None):
    """sum of a @ b over the (a, b) operands (shared memory), float32 [shape]; with during, (that sum, during()),
    during called once the products are issued (one warpgroup a CTA: its elementwise work runs while the tensor
    cores do, where it would otherwise wait on them)."""
    def accumulate(acc):
      for a, b in operands:
        plgpu.wgmma(acc, a, b)
      extra = None if during is None else during()
      return acc[...] if during is None else (acc[...], extra)
    return pl.run_scoped(accumulate, plgpu.ACC(shape, _F32))

  def stage(tile, value):
    tile[...] = value.astype(tile.dtype)
    plgpu.commit_smem()

  # Layouts given, not inferred (the inference's search does not end on this kernel unguided): tiles in wgmma's,
  # [C] vectors in its rows' or columns'.
  wgmma = plgpu.Layout.WGMMA
  as_tile = lambda x: plgpu.layout_cast(x, wgmma)  # noqa: E731
  tile = lambda ref: as_tile(ref[...].astype(_F32))  # noqa: E731
  t = as_tile(lax.broadcasted_iota(jnp.int32, (c, c), 0))
  s = as_tile(lax.broadcasted_iota(jnp.int32, (c, c), 1))
  by_row = lambda x, width: as_tile(  # noqa: E731
      lax.broadcast_in_dim(plgpu.layout_cast(x, wgmma.reduce(1)), (c, width), (0,)))
  by_column = lambda x: as_tile(lax.broadcast_in_dim(plgpu.layout_cast(x, wgmma.reduce(0)), (c, c), (1,)))  # noqa: E731
  row_sum = lambda x: jnp.sum(x, axis=1)  # noqa: E731
  plgpu.barrier_wait(values_loaded.at[0])
  rows, columns = rows_smem.at[0], rows_smem.at[1]
  beta = rows[_BETA_ROW]
  runs_end = None if runs_row is None else rows_smem[0, runs_row, c - 1]
  g_end = None if gate_row is None else rows_smem[0, gate_row, c - 1]

  def pair_and_row_factors():
    """The pair factors e^{g_t - g_s} (s < t, or s <= t, in one segment; else 0), and the rows' own: e^{g_t} where
    the row sees the state before the chunk, e^{g_C - g_t} where its key reaches the chunk's end (None: 1)."""
    allowed_pairs, allowed_queries = t > s, t >= s
    row_decay = to_end = None
    if runs_row is not None:
      same_segment = by_row(rows[runs_row], c) == by_column(columns[runs_row])
      allowed_pairs, allowed_queries = allowed_pairs & same_segment, allowed_queries & same_segment
      row_decay, to_end = lightning_mosaic.sees_prior_state(rows[runs_row]), lightning_mosaic.reaches_chunk_end(
          rows[runs_row], runs_end)
    if gate_row is None:
      return (*(jnp.where(allowed, 1.0, 0.0) for allowed in (allowed_pairs, allowed_queries)), row_decay, to_end)
    gap = by_row(rows[gate_row], c) - by_column(columns[gate_row])  # <= 0 where allowed
    factors = jnp.exp(jnp.where(allowed_queries, gap, 0.0))  # one exp for both: the pairs are the queries' but t = s
    decays = jnp.exp(rows[gate_row]), jnp.exp(g_end - rows[gate_row])
    row_decay, to_end = decays if row_decay is None else (row_decay * decays[0], to_end * decays[1])
    return (*(jnp.where(allowed, factors, 0.0) for allowed in (allowed_pairs, allowed_queries)), row_decay, to_end)

  # The value side. Z = T^T dU; dv = beta Z; dP = dO U^T; dA = -Z U^T (U = U_v - W S_n). The factors form while the
  # tensor cores form Z.
  z, (pair_factors, query_factors, row_decay, to_end) = product(
      (c, ep), (tri_smem.transpose((1, 0)), du_smem.transpose((1, 0))), during=pair_and_row_factors)
  stage(dv_smem, by_row(beta, ep) * z)
  plgpu.copy_smem_to_gmem(dv_smem, dv_ref.at[batch, rows_in, head])
  d_beta = row_sum(tile(v_smem) * z)
  stage(z_smem, z)
  d_pairs = product((c, c), (do_smem, u_smem))
  d_key_products = -product((c, c), (z_smem, u_smem))
  key_products = product((c, c), (k_smem, k_smem.transpose((1, 0))))
  # A_ts = beta_t (k_t . k_s) f_ts: dA's allowed part counts; P_ts = scale (q_t . k_s) f'_ts.
  d_beta = d_beta + row_sum(d_key_products * key_products * pair_factors)
  stage(key_pairs_smem, by_row(beta, c) * d_key_products * pair_factors)
  stage(query_pairs_smem, scale * d_pairs * query_factors)

  # The key side: dQ_g = dO S_n^T, dW = -dU S_n^T, dK_C = U G_n^T (S_n^T, G_n^T [Ep, Dp]).
  # k and q are read from shared memory at each use: [C, K] float32 tiles held across the products would take
  # registers the accumulators need.
  plgpu.barrier_wait(keys_loaded.at[0])
  row_scale = scale if row_decay is None else by_row(scale * row_decay, dp)
  dq = lightning_mosaic.update(row_scale * product((c, dp), (do_smem, states_smem)), (query_pairs_smem, k_smem),
                               in_registers=in_registers)
  dg = row_sum(tile(q_smem) * dq) if dg_ref is not None else None
  stage(dq_smem, dq)
  plgpu.copy_smem_to_gmem(dq_smem, dq_ref.at[batch, rows_in, head])
  stage(dw_smem, -product((c, dp), (du_smem.transpose((1, 0)), states_smem)))
  d_keys_gated = product((c, dp), (tri_smem.transpose((1, 0)), dw_smem))  # T^T dW: the cotangent of beta K_g
  if row_decay is not None:
    d_keys_gated = d_keys_gated * by_row(row_decay, dp)
  d_beta = d_beta + row_sum(tile(k_smem) * d_keys_gated)
  # k's uses by the sign of g in their factors: beta K_g's and A's rows (rising), K_C's, P's columns and A's
  # columns (falling); dk = rising + falling, dg's share k (rising - falling) = k (2 rising - dk).
  rising = lightning_mosaic.update(by_row(beta, dp) * d_keys_gated, (key_pairs_smem, k_smem),
                                   in_registers=in_registers)
  # dg's share of rising while the tensor cores form through_end; K_C's, before dk's products consume it.
  rising_share = None if dg_ref is None else (lambda: 2.0 * row_sum(tile(k_smem) * rising))
  through_end = product((c, dp), (u_smem.transpose((1, 0)), d_next_smem), during=rising_share)
  if dg_ref is not None:
    through_end, share = through_end
    dg = dg + share
  if to_end is not None:
    through_end = through_end * by_row(to_end, dp)
  if dg_ref is not None:
    last = jnp.sum(row_sum(tile(k_smem) * through_end))
  dk = lightning_mosaic.update(rising + through_end, (query_pairs_smem.transpose((1, 0)), q_smem),
                               (key_pairs_smem.transpose((1, 0)), k_smem), in_registers=in_registers)
  stage(dk_smem, dk)
  plgpu.copy_smem_to_gmem(dk_smem, dk_ref.at[batch, rows_in, head])
  d_beta_smem, dg_smem = vectors_smem.at[0], vectors_smem.at[1]
  d_beta_smem[...] = d_beta
  if dg_ref is not None:
    dg = dg - row_sum(tile(k_smem) * dk)
    # g_C's share (through K_C and the state decay e^{g_C}, 0 where a segment starts in the chunk) to the last row;
    # sum(S_n^T G_n^T) by 64-row halves, as whole [Ep, K] tiles would take two accumulators' registers.
    state_share = sum(jnp.sum(row_sum(tile(states_smem.at[pl.ds(i, c)]) * tile(d_next_smem.at[pl.ds(i, c)])))
                      for i in range(0, ep, c))
    state_decay = jnp.exp(g_end) if runs_row is None else jnp.exp(g_end) * lightning_mosaic.sees_prior_state(runs_end)
    last = last + state_decay * state_share
    last_row = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (c,), 0), wgmma.reduce(1)) == c - 1
    dg_smem[...] = dg + jnp.where(last_row, last, 0.0)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(d_beta_smem, d_beta_ref.at[batch, head, rows_in])
  if dg_ref is not None:
    plgpu.copy_smem_to_gmem(dg_smem, dg_ref.at[batch, head, rows_in])
  plgpu.wait_smem_to_gmem(0)


def tile_gradients(q, k, v, beta, gates, tri, states, d_next, u, du, do, *, scale: float, num_tokens=None,
                   interpret: bool = False):
  """`pallas_triton.tile_gradients(..., transposed=True)` for a scalar gate or none on sm90: (dq, dk [B, T', H, K],
  dv [B, T', H, Ep] in the input dtype, dbeta [B, H, Tp] float32, dg [B, H, Tp] float32 or None).

  One 64-token chunk a CTA, one warpgroup: T, U^T, dU^T, dO, v and k load
  first (TMA), and the value side (Z = T^T dU, dv = beta Z, dP = dO U^T, dA =
  -Z U^T, k k^T and the pair factors) runs while q, S_n^T and G_n^T load; then
  the key side (dQ_g = dO S_n^T, dW = -dU S_n^T, T^T dW, dK_C = U G_n^T and the
  pair cotangents' products with q and k), every product on the tensor cores
  from shared memory (so the interpreter runs the same code). `vjp` has the
  algebra; `pallas_triton._tile_gradients_kernel` is the Triton form.

  Args:
    q, k: [B, T', H, K]; v, do: [B, T', H, Ep]; bf16 or fp16, K and Ep 64 or
      128; Tp (num_tokens; None: T') a multiple of 64, T' <= Tp a multiple of
      8 or Tp itself: rows past T' read as zeros, and dq, dk and dv have T'
      rows (TMA drops those past them).
    beta: [B, H, Tp] float32; gates: `pallas_triton.Gates` (g [B, H, Tp]
      float32 natural-log chunk-local cumulative decays, or None; runs [B, Tp]
      int32, or None).
    tri: T = (I + A)^{-1} [B, H, Tp, 64] (`inverse(..., with_unscaled=True)`).
    states, d_next: S_n^T and G_n^T [B, H, N, Ep, K] (`state_sweep`,
      `state_cotangents`); u, du: U^T and dU^T [B, H, Ep, Tp].
  """
  b, key_rows, h, dim_k = q.shape
  tp = key_rows if num_tokens is None else num_tokens
  dim_v = v.shape[-1]
  c = CHUNK_SIZE
  n = tp // c
  if (tp % c or not WarpSpecializedConfig.takes_rows(key_rows, tp) or dim_k not in (64, 128)
      or dim_v not in (64, 128) or k.shape != q.shape or v.shape[:3] != q.shape[:3]
      or do.shape != v.shape or tri.shape != (b, h, tp, c) or states.shape != (b, h, n, dim_v, dim_k)
      or d_next.shape != states.shape or u.shape != (b, h, dim_v, tp) or du.shape != u.shape):
    raise ValueError(f"operands: q, k [B, T', H, K], v, do [B, T', H, Ep] with T' <= Tp a multiple of "
                     f"{WarpSpecializedConfig.TMA_ROWS} (or Tp), Tp a multiple of {c}, K and Ep 64 or 128, T [B, H, "
                     f"Tp, {c}], S_n^T, G_n^T [B, H, N, Ep, K], U^T, dU^T [B, H, Ep, Tp]; got q {q.shape}, v "
                     f"{v.shape}, Tp {tp}, T {tri.shape}, S {states.shape}, U {u.shape}")
  rows, gate_row, runs_row = _factor_rows(beta, gates.g, gates.runs)
  dtype = q.dtype
  smem = lightning_mosaic.swizzled_smem
  keys_tile, values_tile = smem((c, dim_k), dtype), smem((c, dim_v), dtype)
  scratch = (
      (keys_tile, keys_tile, plgpu.RefUnion(values_tile, keys_tile), plgpu.RefUnion(values_tile, keys_tile),
       smem((c, c), dtype), smem((dim_v, dim_k), dtype), smem((dim_v, dim_k), dtype), smem((dim_v, c), dtype),
       smem((dim_v, c), dtype), plgpu.SMEM((2,) + rows.shape[-2:], _F32),
       plgpu.RefUnion(values_tile, keys_tile), smem((c, c), dtype), smem((c, c), dtype), values_tile,
       plgpu.SMEM((2, c), _F32)),
      # The value side's k, v, dO, T, U^T, dU^T and factor rows twice; the key side's q, S_n^T and G_n^T.
      (plgpu.Barrier(num_arrivals=8, num_barriers=1), plgpu.Barrier(num_arrivals=3, num_barriers=1)),
  )
  inputs = (q, k, v, do, rows, tri, states, d_next, u, du)
  out_type = (manual_axes.struct((b, key_rows, h, dim_k), dtype, *inputs),
              manual_axes.struct((b, key_rows, h, dim_k), dtype, *inputs),
              manual_axes.struct((b, key_rows, h, dim_v), dtype, *inputs),
              manual_axes.struct((b, h, tp), _F32, *inputs))
  if gate_row is not None:
    out_type += (manual_axes.struct((b, h, tp), _F32, *inputs),)
  kernel = functools.partial(_tile_gradients_kernel, scale=scale, gate_row=gate_row, runs_row=runs_row,
                             in_registers=not interpret)
  dq, dk, dv, d_beta, *dg = lightning_mosaic.warpgroup_kernel(
      kernel, out_type=out_type, scratch_types=scratch, grid=(h, b, n), grid_names=("heads", "batch", "chunks"),
      interpret=interpret, kernel_name="delta_tile_gradients_mosaic", num_warpgroups=1)(*inputs)
  return dq, dk, dv, d_beta, dg[0] if dg else None


class ChannelGatedChunks(NamedTuple):
  """`channel_gated_chunks`' results, each chunk's terms of KDA's per-key-channel gates (G the chunk-local
  cumulative log2 decay [C, K], every factor at most 1), in the input dtype.

  inverse: T' = (I + A)^{-1} Diag(beta) [B, H, Tp, C].
  pairs: P = scale tril(q k^T gated) [B, H, Tp, C], P_ts = scale sum_d q_td k_sd 2^(G_td - G_sd) on s <= t.
  queries: Q_g = scale q 2^G [B, Tp, H, K].
  keys: K_g = k 2^G [B, Tp, H, K].
  keys_to_end: K_C = k 2^(G_C - G) [B, Tp, H, K].
  unscaled_inverse: T = (I + A)^{-1} [B, H, Tp, C], and
  gates: G [B, Tp, H, K] float32, both only `with_backward_terms` (KDA's warp-specialised backward), else None.
  block_ends: G's last row in each 16-row block of each chunk [B, H, Tp / C, 4, K] float32: the log decays O_j the
  pair factors go through (O_1 .. O_3), then G_C (`channel_spans_bounded`'s operand; the state's decay is 2^G_C).
  """
  inverse: jax.Array
  pairs: jax.Array
  queries: jax.Array
  keys: jax.Array
  keys_to_end: jax.Array
  unscaled_inverse: jax.Array | None = None
  gates: jax.Array | None = None
  block_ends: jax.Array | None = None


# The columns of each part the kernel forms its [C, K] tiles in (K / _PART of them).
_PART = 64

# The largest decay (log2 units) across any 16-token block of a chunk at which `channel_gated_chunks` runs, by the
# operands' dtype (`max_block_span`): its diagonal blocks' key factors 2^(O - G) reach 2^span (O the log decay before
# the block). 60 in natural log (86.6 here), as the Triton kernels' bound: bf16 and float32 hold the factor and its
# reciprocal with room for the keys; float16, whose largest value is 65504, 6 (8.7 here, 2^8 of room for the keys;
# the Triton kernels' float16 bound too).
MAX_BLOCK_SPAN = 60.0 * chunk_common.LOG2_E
MAX_BLOCK_SPAN_FLOAT16 = 6.0 * chunk_common.LOG2_E


def max_block_span(dtype) -> float:
  """The bound of `channel_spans_bounded` for operands of this dtype."""
  return MAX_BLOCK_SPAN_FLOAT16 if jnp.dtype(dtype) == jnp.float16 else MAX_BLOCK_SPAN


def _store_block_ends(gates, ends_ref, *, in_registers):
  """The last row of each 16-row block of gates [C, _PART] float32 (G in wgmma's layout) into ends_ref
  [C / 16, _PART] float32 shared memory (not swizzled): O_1 .. O_4. Compiled, the threads holding those rows store
  them (warp w holds rows 16w .. 16w + 15); interpreted, which runs no inline Mosaic GPU, a strided slice."""
  if not in_registers:
    ends_ref[...] = gates[_SOLVE_BLOCK - 1::_SOLVE_BLOCK]
    return

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
  def store(_, gates, ends_ref):
    index = ir.IndexType.get()
    block = mgpu_utils.c(_SOLVE_BLOCK, index)
    for (row, column), register in zip(gates.layout.thread_idxs(gates.shape), np.ndindex(gates.registers.shape)):
      last = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(row, block), mgpu_utils.c(_SOLVE_BLOCK - 1, index))
      with mgpu_utils.when(last):
        vector.store(gates.registers[register], ends_ref, [arith.divui(row, block), column])

  store(gates, ends_ref)


def _channel_gated_kernel(rows_ref, q_ref, k_ref, rates_ref, inverse_ref, pairs_ref, queries_ref, keys_ref,
                          keys_end_ref, *refs, chunks_per_cta, scale, runs_row, in_registers):
  # with_backward_terms: T and G out too; last, G's blocks' last rows O_1 .. O_4 (which the factors go through).
  # Every [C, K] tile is K / _PART column parts ([..., parts, C, _PART] in shared memory): warpgroup p forms part
  # p's, as [C, _PART] float32 tiles in registers (at K = 128 whole tiles spilled 668 bytes a thread, ptxas);
  # warpgroup 0, the leader, also runs the pair products over every part, the solve and the stores of T' and P. At
  # K = 128 its one warpgroup a CTA (shared memory allows one CTA an SM) waited on its own elementwise passes: two
  # halve them. One buffer of q, k and G, the next chunk's loading during the solve, and T' and P staged in the union
  # of tiles: two CTAs an SM at K = 64 (74 KB of shared memory; 255 registers, which allow no third). runs_row:
  # packed, the segment counts' row of rows_ref (the solve keeps one segment's pairs).
  unscaled_ref, gates_ref, ends_ref, buffers, barriers = refs if len(refs) == 5 else (None, None, *refs)
  (q_smem, k_smem, g_smem, rows_smem, boundary_smem,
   (operands, (solve_smem, links), rate_pieces, (inverse_smem, pairs_smem)), keys_end_smem, staging) = buffers
  loaded, rows_loaded, *hand_overs = barriers
  x_keys, y_keys, x_queries = operands
  c, block = CHUNK_SIZE, _SOLVE_BLOCK
  num_blocks = c // block
  num_parts, dtype = q_smem.shape[0], q_smem.dtype
  split = num_parts > 1
  part = lax.axis_index("wg") if split else 0
  head, batch = lax.axis_index("heads"), lax.axis_index("batch")
  first_chunk = lax.axis_index("chunk_blocks") * chunks_per_cta
  columns = pl.ds(part * _PART, _PART)  # this warpgroup's part

  def leader(body):
    """body() on warpgroup 0 alone."""
    if split:
      pl.when(part == 0)(body)
    else:
      body()

  # Split, the warpgroups hand over through two barriers: `formed`, part 1's operand tiles are in shared memory (part
  # 1 to the leader); `consumed`, the leader's products are done with them (after each block's, and after the
  # solve, whose tiles the rates' pieces share, once the next chunk's triangle of ones is out).
  formed, consumed = ((hand_overs[0].at[0], 1), (hand_overs[1].at[0], 0)) if split else (None, None)

  def signal(hand_over):
    """Split: hand_over's giver (barrier, giving warpgroup) arrives at it."""
    if split:
      barrier, by = hand_over

      @pl.when(part == by)
      def _():
        plgpu.barrier_arrive(barrier)

  def await_signal(hand_over):
    """Split: the other warpgroup waits for hand_over."""
    if split:
      barrier, by = hand_over

      @pl.when(part != by)
      def _():
        plgpu.barrier_wait(barrier)

  def load(n, slot):  # chunk first_chunk + n: q, k and the rates on this part; beta's row twice
    chunk_index = first_chunk + n
    rows = pl.ds(pl.multiple_of(chunk_index * c, c), c)
    for src, dst in ((q_ref, q_smem), (k_ref, k_smem), (rates_ref, g_smem)):
      plgpu.copy_gmem_to_smem(src.at[batch, rows, head, columns], dst.at[part], loaded.at[part])

    @leader
    def _():
      for copy in range(2):  # two layouts
        plgpu.copy_gmem_to_smem(rows_ref.at[batch, head, chunk_index], rows_smem.at[slot, copy],
                                rows_loaded.at[slot])

  load(0, 0)
  t = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  s = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  # Layouts given, not inferred: the [C, _PART] tiles in wgmma's, each row of G one value per column of it (the
  # inference's search does not end on this kernel unguided).
  as_tile = lambda x: plgpu.layout_cast(x, plgpu.Layout.WGMMA)  # noqa: E731
  # Each row's 16-row block, formed where used (not an int32 tile live across the loop: registers).
  token_block = lambda: as_tile(lax.div(lax.broadcasted_iota(jnp.int32, (c, _PART), 0), block))  # noqa: E731
  by_row = lambda x: lax.broadcast_in_dim(x, (c, c), (0,))  # noqa: E731
  by_column = lambda x: lax.broadcast_in_dim(x, (c, c), (1,))  # noqa: E731
  by_channel = lambda x: as_tile(lax.broadcast_in_dim(  # noqa: E731
      plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(0)), (c, _PART), (1,)))
  ones = staging[0]  # the merges' x tile, free from one solve to the next (so swizzled as the pieces: k_steps off)

  def ones_out():  # the triangle of ones: the rate sums' left operand
    ones[...] = jnp.where(t >= s, 1.0, 0.0).astype(ones.dtype)
    plgpu.commit_smem()

  leader(ones_out)
  signal(consumed)

  @pl.loop(0, chunks_per_cta)
  def _chunk(n):
    slot = lax.rem(n, 2)  # of the barriers and beta's rows
    plgpu.barrier_wait(loaded.at[part])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # chunk n - 1's stores have read their tiles
    gates = lambda: as_tile(g_smem[part])  # noqa: E731
    keys = lambda: as_tile(k_smem[part].astype(_F32))  # noqa: E731
    queries = lambda: as_tile(q_smem[part].astype(_F32))  # noqa: E731
    # O_j, the log decay before 16-row block j (0 before the first; O_4 = G_C) on this part's columns, by column.
    block_end = lambda j: by_channel(boundary_smem[part, j - 1])  # noqa: E731
    rows_out = pl.ds(pl.multiple_of((first_chunk + n) * c, c), c)
    await_signal(consumed)

    def rate_sums(acc):
      """G = -log2(e) tril(1) R on the tensor cores, R the rates split into two float16 pieces (their sum within
      2^-22 of each rate, 3e-8 below float16's normal range), in tiles the pair products' operands share (free
      here)."""
      rates = jnp.minimum(gates(), chunk.MAX_RATE)
      for piece in rate_pieces:
        rounded = rates.astype(piece.dtype)
        piece.at[part][...] = rounded
        rates = rates - rounded.astype(_F32)
      plgpu.commit_smem()
      for piece in rate_pieces:
        plgpu.wgmma(acc, ones, piece.at[part])
      return acc[...]

    g = pl.run_scoped(rate_sums, plgpu.ACC((c, _PART), _F32)) * -chunk_common.LOG2_E
    g_smem[part] = g
    _store_block_ends(g, boundary_smem.at[part], in_registers=in_registers)
    plgpu.commit_smem()  # also every thread's rows of the block ends, read below by every thread
    plgpu.copy_smem_to_gmem(boundary_smem.at[part], ends_ref.at[batch, head, first_chunk + n, :, part])
    if gates_ref is not None:
      plgpu.copy_smem_to_gmem(g_smem.at[part], gates_ref.at[batch, rows_out, head, columns])

    def pair_products(acc_a, acc_p):
      """Through O_j: with x = k 2^(G - O_j) on the rows of blocks >= j (at most 1) and y = k 2^(O_j - G) on block
      j's (at most 2^max_block_span), x y^T holds A's column block j (beta aside) and P's (from q's x), each summed
      over the column parts (the leader's accumulators)."""
      for j in range(num_blocks):
        if j:
          @leader
          def _():  # block j - 1's products have read the operand tiles
            plgpu.wgmma_wait(0)

          signal(consumed)
          await_signal(consumed)
        offset = 0.0 if j == 0 else block_end(j)
        x_factor = jnp.where(token_block() >= j, jnp.exp2(jnp.minimum(gates() - offset, 0.0)), 0.0)
        y_factor = jnp.where(token_block() == j, jnp.exp2(offset - gates()), 0.0)
        x_keys.at[part][...] = (keys() * x_factor).astype(dtype)
        x_queries.at[part][...] = (queries() * (scale * x_factor)).astype(dtype)
        y_keys.at[part][...] = (keys() * y_factor).astype(dtype)
        plgpu.commit_smem()
        if j == 0:  # x = K_g and scale Q_g (O_0 = 0): out as they are
          plgpu.copy_smem_to_gmem(x_keys.at[part], keys_ref.at[batch, rows_out, head, columns])
          plgpu.copy_smem_to_gmem(x_queries.at[part], queries_ref.at[batch, rows_out, head, columns])
        signal(formed)

        @leader
        def _products():
          await_signal(formed)
          for p in range(num_parts):
            x, y, xq = x_keys.at[p], y_keys.at[p], x_queries.at[p]
            plgpu.wgmma(acc_a, x, y.transpose((1, 0)))
            plgpu.wgmma(acc_p, xq, y.transpose((1, 0)))

        if j == 0:
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # before block 1 rewrites the tiles
      return acc_a[...], acc_p[...]

    pairs, query_pairs = pl.run_scoped(pair_products, *(plgpu.ACC((c, c), _F32) for _ in range(2)))
    # K_C = k 2^(G_C - G), while the leader's solve below runs on other tiles.
    keys_end_smem.at[part][...] = (keys() * jnp.exp2(block_end(num_blocks) - gates())).astype(dtype)
    plgpu.commit_smem()  # every thread is done with this chunk's q, k and G (whose store the first block waited)
    plgpu.copy_smem_to_gmem(keys_end_smem.at[part], keys_end_ref.at[batch, rows_out, head, columns])

    @pl.when(n + 1 < chunks_per_cta)
    def _prefetch():  # the next chunk's q, k and rates, during the solve
      load(n + 1, 1 - slot)

    @leader
    def _solve():
      plgpu.barrier_wait(rows_loaded.at[slot])
      rows, columns_ = rows_smem.at[slot, 0], rows_smem.at[slot, 1]
      kept, kept_inclusive = t > s, t >= s
      if runs_row is not None:  # packed: the pairs of one segment alone
        same_segment = by_row(rows[runs_row]) == by_column(columns_[runs_row])
        kept, kept_inclusive = kept & same_segment, kept_inclusive & same_segment
      neg_a = jnp.where(kept, pairs * by_row(-rows[_BETA_ROW]), 0.0)
      x = _unit_lower_inverse(neg_a, solve_smem, (links, *staging), in_registers=in_registers, k_steps=False)
      for result, tile, out_ref in ((x * by_column(columns_[_BETA_ROW]), inverse_smem, inverse_ref),
                                    (jnp.where(kept_inclusive, query_pairs, 0.0), pairs_smem, pairs_ref)):
        tile[...] = result.astype(tile.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(tile, out_ref.at[batch, head, rows_out])
      if unscaled_ref is not None:  # T through the inverse's tile, once its T' store has read it
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        inverse_smem[...] = x.astype(inverse_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(inverse_smem, unscaled_ref.at[batch, head, rows_out])

    @pl.when(n + 1 < chunks_per_cta)
    def _next():  # the solve is done with its tiles: the next chunk's triangle of ones, and part 1 goes on
      @leader
      def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # T' and P are out of the union, which part 1 writes next
        ones_out()

      signal(consumed)

  plgpu.wait_smem_to_gmem(0)


def channel_gated_chunks(q, k, beta, rates, *, scale: float, runs=None, chunks_per_cta: int | None = None,
                         with_backward_terms: bool = False, num_tokens: int | None = None,
                         interpret: bool = False) -> ChannelGatedChunks:
  """Each 64-token chunk's terms of KDA's per-key-channel gates for the warp-specialised forward
  (`ChannelGatedChunks`): the pair products A and P, T' from A as `inverse` forms it, and the gated keys and queries.

  Every pair factor 2^(G_t - G_s) factors through the log decay O_j before
  the 16-row block j of s: x_t = 2^(G_t - O_j) <= 1 and y_s = 2^(O_j - G_s) <=
  2^span, span the block's largest decay over its key channels, so the
  products run on the tensor cores (four [C, K] x [K, C] products a chunk for
  each of A and P; the solve reads A's diagonal blocks transposed, as
  `inverse`'s) as long as every span is at most `max_block_span(q.dtype)`,
  which the caller checks on the O_j the kernel returns
  (`channel_spans_bounded`; past it the other results are not used). A CTA
  walks `chunks_per_cta` chunks (`inverse`'s), the next chunk's q, k and rates
  loading by TMA during this one's solve: one buffer each, so that two CTAs
  share an SM at K = 64 (one buffer was faster at K = 128 too, where one CTA
  fits either way). G, the chunk-local cumulative log2 decay, is formed from
  the rates in the kernel (one triangle of ones times the rates in two float16
  pieces, on the tensor cores). Every [C, K] tile is formed in 64-column
  parts, one warpgroup each (at K = 128 two, whose first issues the products
  over both parts and solves T': 7% faster than one warpgroup forming both
  parts on an H200, B2 H32 T8K).

  Args:
    q, k: [B, T', H, K] bf16 or fp16, K 64 or 128, T' rows as `inverse`'s
      (read as zeros past them; the terms have Tp rows).
    beta: [B, H, Tp] float32, zero on padding.
    rates: [B, T', H, K] float32 >= 0, zero on padding (clamped at
      `chunk.MAX_RATE`, as `chunk.chunk_log_decays` does).
    runs: None, or packed rows' segment-start counts within each chunk [B,
      Tp] int32 (`pallas_mosaic_gpu.sweep_gates`' runs): A, T' and P then
      keep the pairs of one segment alone. G runs on across a segment start
      (a kept pair's factor spans one segment's rates), so Q_g, K_g, K_C and
      the state decay 2^G_C are the rows' as if unpacked: their rows that see
      no state, or no chunk end, are for the forward's sweep to drop (given
      the same runs, `lightning_mosaic.forward_padded`), and for the backward's
      `mask_channel_gated_chunks`.
    with_backward_terms: also T and G (`ChannelGatedChunks`).
    num_tokens: Tp, as `inverse`'s.
  """
  b, key_rows, h, dim_k = k.shape
  tp = key_rows if num_tokens is None else num_tokens
  c = CHUNK_SIZE
  n = tp // c
  if (tp % c or not WarpSpecializedConfig.takes_rows(key_rows, tp) or dim_k not in (64, 128)
      or q.shape != k.shape or rates.shape != k.shape or beta.shape != (b, h, tp)):
    raise ValueError(f"operands: q, k, rates [B, T', H, K] with K 64 or 128 and T' rows a multiple of "
                     f"{WarpSpecializedConfig.TMA_ROWS} (or all Tp), beta [B, H, Tp], Tp a multiple of {c}; got q "
                     f"{q.shape}, k {k.shape}, rates {rates.shape}, beta {beta.shape}, Tp {tp}")
  per_cta = _checked_chunks_per_cta(chunks_per_cta, batch_heads=b * h, num_chunks=n, policy=CHANNEL_GATED_WALKS)
  in_registers = not interpret
  dtype = k.dtype
  smem = lightning_mosaic.swizzled_smem
  parts = dim_k // _PART
  rows, runs_row = _factor_rows(beta, runs)  # beta's row; packed, the segment counts' after it
  pieces = tuple(smem((parts, c, _PART), jnp.float16) for _ in range(2))
  scratch = (
      (smem((parts, c, _PART), dtype), smem((parts, c, _PART), dtype), smem((parts, c, _PART), _F32),
       plgpu.SMEM((2, 2, rows.shape[3], c), _F32), plgpu.SMEM((parts, c // _SOLVE_BLOCK, _PART), _F32),
       # The pair products' operand tiles, the solve's with the merges' links, the rates' pieces and the results' T'
       # and P: one at a time.
       plgpu.RefUnion(tuple(smem((parts, c, _PART), dtype) for _ in range(3)),
                      ((_solve_tile(), _solve_tile()), _merge_tile(k_steps=False)), pieces,
                      (smem((c, c), dtype), smem((c, c), dtype))),
       smem((parts, c, _PART), dtype),
       tuple(_merge_tile(k_steps=False) for _ in range(1 if in_registers else 2))),
      # Each part's q, k and rates; beta's row twice, by slot; split, the hand-overs.
      (plgpu.Barrier(num_arrivals=3, num_barriers=parts), plgpu.Barrier(num_arrivals=2, num_barriers=2),
       *((plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=1)) if parts > 1 else ())),
  )
  num_blocks = c // _SOLVE_BLOCK
  out_type = (
      *(manual_axes.struct((b, h, tp, c), dtype, k, beta) for _ in range(2)),
      *(manual_axes.struct((b, tp, h, dim_k), dtype, k, beta) for _ in range(3)),
      *((manual_axes.struct((b, h, tp, c), dtype, k, beta), manual_axes.struct((b, tp, h, dim_k), _F32, k, beta))
        if with_backward_terms else ()),
      manual_axes.struct((b, h, n, num_blocks, parts, _PART), _F32, k, beta))
  kernel = functools.partial(_channel_gated_kernel, chunks_per_cta=per_cta, scale=scale, runs_row=runs_row,
                             in_registers=in_registers)
  *terms, block_ends = lightning_mosaic.warpgroup_kernel(
      kernel, out_type=out_type, scratch_types=scratch, grid=(h, b, n // per_cta),
      grid_names=("heads", "batch", "chunk_blocks"), interpret=interpret, kernel_name="delta_channel_gated_mosaic",
      num_warpgroups=parts)(rows, q, k, rates.astype(_F32))
  return ChannelGatedChunks(*terms, block_ends=block_ends.reshape(b, h, n, num_blocks, dim_k))


def mask_channel_gated_chunks(terms: ChannelGatedChunks, runs) -> ChannelGatedChunks:
  """`channel_gated_chunks`' terms of packed rows: Q_g's and K_g's rows dropped where a segment starts at or before
  the row in its chunk (the row sees no state from before the chunk), K_C's where one starts after it (the row's
  segment ends in the chunk). runs: as `channel_gated_chunks`'; None: the terms as they are. The backward's: the
  forward's sweep drops those rows itself, but in the reverse sweep's state chain the same masks (its scalar gates'
  factor rows) took 1.8 ms against 1.1 unpacked (H200, B1 H32 T32K D128, 8 sequences), these passes about 0.35."""
  if runs is None:
    return terms
  b, tp = runs.shape
  chunks = runs.reshape(b, tp // CHUNK_SIZE, CHUNK_SIZE)
  sees_state = (chunks == 0).reshape(b, tp, 1, 1)
  reaches_end = (chunks == chunks[..., -1:]).reshape(b, tp, 1, 1)
  drop = lambda x, keep: jnp.where(keep, x, jnp.zeros((), x.dtype))  # noqa: E731
  return terms._replace(queries=drop(terms.queries, sees_state), keys=drop(terms.keys, sees_state),
                        keys_to_end=drop(terms.keys_to_end, reaches_end))


def channel_state_decay(block_ends, runs):
  """The state's decay per key channel over each chunk, 2^G_C [B, H, N, 1, K] float32, from
  `ChannelGatedChunks.block_ends`; 0 where a packed segment starts in the chunk (runs as `channel_gated_chunks`', or
  None)."""
  decay = jnp.exp2(block_ends[:, :, :, -1:])
  if runs is None:
    return decay
  b, tp = runs.shape
  no_start = runs.reshape(b, 1, tp // CHUNK_SIZE, 1, CHUNK_SIZE)[..., -1:] == 0  # [B, 1, N, 1, 1]
  return jnp.where(no_start, decay, 0.0)


def channel_spans_bounded(block_ends, dtype):
  """Whether every 16-row block of every chunk decays by at most `max_block_span(dtype)` on each key channel (a
  traced bool): `channel_gated_chunks`' condition for operands of that dtype. block_ends: its
  `ChannelGatedChunks.block_ends` [B, H, Tp / 64, 4, K]."""
  before = jnp.concatenate([jnp.zeros_like(block_ends[..., :1, :]), block_ends[..., :-1, :]], axis=-2)
  return jnp.max(before - block_ends) <= max_block_span(dtype)
