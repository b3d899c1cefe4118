"""Pallas Triton kernels of delta attention: the chunk algebra of `chunk`, forward and backward.

Forward, two passes:
  prepare, grid (B, H, N), every chunk in parallel: the gated pair products A
    and P in 16-row blocks, T = (I + A)^{-1} block by block (each diagonal
    block by merging inverses of 1, 2, 4 and 8 rows, `_unit_lower_inverse`,
    then forward substitution between blocks, all in float32), and
    W = T beta K_g, U_v = T beta V. Writes W [B, T, H, D], U_v [B, T, H, E]
    (the input dtype) and, with per-key-channel gates, P [B, H, T, C]
    (float32, scale included).
  sweep, grid (B, H, E / block_e), the chunks in order with the state tile
    [D, block_e] on chip: U = U_v - W S, O = scale Q_g S + P U,
    S <- Diag(e^{g_C}) S + K_C^T U. With a scalar gate (or none) it forms P
    itself: one [C, D] x [D, C] product, cheaper than a float32 round trip.
On sm90 the forward is Mosaic GPU instead (`warp_specialized`): an inverse
kernel writes each chunk's T' = (I + A)^{-1} Diag(beta)
(`pallas_mosaic_gpu.inverse`; for KDA with P and the gated keys and queries,
`pallas_mosaic_gpu.channel_gated_chunks`), from which the warp-specialised
sweep forms U itself.

Backward (`backward`), recomputing instead of storing: prepare again; the
sweep again, writing the state before every chunk S_n instead of outputs;
`state_cotangents`, walking back, writing G_n = dL/dS_{n+1}; and the
`chunk_gradients` kernel, grid (B, H, N), every chunk in parallel: from S_n,
G_n and dO it recomputes the chunk's terms and takes their vjp (the module
docstring of `vjp` has the algebra) down to dq, dk, dv, dbeta and the
cotangent of g. With a scalar gate or none (`DeltaConfig.split_backward`)
the backward chunks by 64 tokens and that last step takes whole [C, C]
tiles: prepare also writes T (where D and E <= 128 `prepare_by_tiles` forms
W, U_v and T by whole tiles), the sweeps also write U and dU, and
`tile_gradients` (grid (B, H, N)) takes dA from the value columns alone
(-(T^T dU) U^T), then walks the key columns for the products with S_n and
G_n. On sm90 (where the forward's sweep is warp-specialised) both sweeps
are too (`pallas_mosaic_gpu.state_sweep` and `state_cotangents`, writing S_n,
U, G_n and dU transposed, as `tile_gradients(transposed=True)` reads them)
and no prepare runs: they and the gradient kernel take the T and T' of the
forward's inverse kernel; `backward` says where. KDA's backward where its
forward is warp-specialised (`_channel_gated_backward`) runs at 64-token
chunks too: on the forward's chunk terms and states (or its kernels again),
the warp-specialised reverse sweep in a channel-gated mode, and
`tile_gradients` with the per-key-channel gates
(`_channel_tile_gradients_kernel`).

The gates arrive as chunk-local cumulative log decays g (`chunk.chunk_log_decays`):
[B, H, T] for a scalar per token, [B, H, T, D] per key channel (KDA), with
the segment-start counts `runs` [B, T] for packed sequences. KDA's pair
products factor through the row before each 16-row block (both factors <= 1);
within a block through its first row on the matrix units where the block's
decay keeps the factors in range (`_factorable`), else column by column.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lightning_jax.ops import triton_lowering
from lightning_jax.ops.delta_attention import chunk
from lightning_jax.ops.delta_attention import pallas_mosaic_gpu
from lightning_jax.ops.delta_attention import warp_specialized as warp_specialized_forward
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import config as lightning_config
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import manual_axes
from lightning_jax.ops.lightning_attention import pallas_mosaic_gpu as lightning_mosaic
from lightning_jax.ops.lightning_attention.config import WarpSpecializedConfig

_F32 = jnp.float32
BLOCK = chunk.SUB_CHUNK


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeltaConfig:
  """Blocks of the delta attention kernels (`default_config` picks them per call).

  Every field left None is the call's own choice: `delta_attention` fills it from `default_config` for the call's
  shapes, dtype and device (`filled`), so that setting one field (say `sequence_pieces` or `forward_states`) keeps
  the tuned blocks of the others. The kernels and the methods below take a config so filled; "None: ..." below
  says what a field means where `default_config` leaves it None too.

  Attributes:
    chunk_size: tokens per chunk of the Triton forward (a power of two >=
      16). 32 was 1.2-1.6x faster than 64 for all three forms on an H200 (B2
      H32 T8K D128, bf16): the prepare kernel's serial chain of 16-row blocks
      halves; KDA's default is 16 (one block per chunk). The
      warp-specialised forward chunks by 64 whatever it says.
    backward_chunk_size: tokens per chunk of the backward, which recomputes
      everything and so may chunk differently (a power of two >= 16).
    block_e: value columns per sweep program and per step of the one
      gradient kernel's loop over E (a power of two >= 16; clipped to E).
    block_d: key and value columns per loop step of the split backward's
      gradient kernel (and of KDA's on sm90, `_channel_gated_backward`),
      which walks D and E by [C, block_d] tiles (a power of two >= 16;
      clipped to D and to E).
    split_backward: the backward's per-chunk gradients by whole [C, C]
      tiles, walking D and E (`_tile_gradients_kernel`; a scalar gate or
      none), or by 16-row blocks (`_chunk_gradients_kernel`,
      which KDA's per-key-channel gates need: their pair products go by
      16-row blocks). None: split unless the gates are per key channel. The
      one kernel holds a chunk's whole [C, D] cotangents and spills past
      16-token chunks, where the states it reads are 4x a chunk's inputs at
      D = E = 128; the tile kernel takes 64-token chunks.
    num_warps, num_stages: Triton's, for every kernel.
    gradient_stages: Triton's pipeline stages of the split backward's
      gradient kernel (None: num_stages).
    gradient_warps: Triton's warps of that kernel (None: num_warps).
    prepare_warps: Triton's warps of the Triton forward's prepare kernel
      (None: num_warps; the backward's prepare, at backward_chunk_size,
      takes num_warps).
    warp_specialized: the forward on the warp-specialised Mosaic GPU kernel
      (`warp_specialized`: sm90, bf16/fp16, D <= 128, E <= 256), which
      takes each 64-token chunk's inverse (times beta) from a Mosaic GPU
      kernel (`pallas_mosaic_gpu.inverse`; KDA's with its gated pair
      products and keys, `channel_gated_chunks`) instead of W
      and U_v from prepare, and for a scalar decay or none, where block_e >=
      64, the backward's sweeps on warp-specialised kernels too, with no
      prepare (`pallas_mosaic_gpu`; `backward`). None:
      wherever it runs compiled; True: required (ValueError where it cannot
      run); False: the Triton sweeps.
    forward_states: where the backward's sweeps are warp-specialised
      (`warp_specializes_backward`), the forward's output warpgroup also
      stores each chunk's S_n^T and U^T as the chain publishes them, and the
      backward takes them instead of running its state sweep: residuals of
      E/64 times q's bytes (S_n^T [B, H, T/64, E, D]) plus v's (U^T), held
      from the forward to the backward. None: so wherever the backward is
      warp-specialised; True: required (ValueError where it is not); False:
      the backward's state sweep recomputes them (less memory between the
      two). For KDA's per-key-channel gates, where the forward is
      warp-specialised, the chunk terms its pair kernel forms (T, T', P,
      Q_g, K_g, K_C and G) with S_n^T and U^T (about 9.5 times q's bytes at
      D = E = 128), which the backward would form again, running the pair
      kernel and the state sweep (`keeps_chunk_terms`).
    sequence_pieces: pieces each row of the sequence is cut into, run in
      parallel from their true initial states (`sequence_split`), forward and
      backward; 1: no split; None: `sequence_split.call_pieces` for the call
      (4 to 8 pieces where the sweeps' programs would fill at most a quarter
      of the SMs; where the map pass is warp-specialised, a scalar gate or
      none on the warp-specialised sweeps, 2 to 16, from half; KDA on the
      warp-specialised sweeps, whose map pass is the Triton sweep's, none).
  """
  chunk_size: int | None = None
  backward_chunk_size: int | None = None
  block_e: int | None = None
  block_d: int | None = None
  split_backward: bool | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  gradient_stages: int | None = None
  gradient_warps: int | None = None
  prepare_warps: int | None = None
  warp_specialized: bool | None = None
  forward_states: bool | None = None
  sequence_pieces: int | None = None

  def __post_init__(self):
    # Triton's arrays have power-of-two sizes.
    for names, smallest in ((("chunk_size", "backward_chunk_size"), BLOCK),
                            (("block_e", "block_d"), lightning_config.MIN_BLOCK)):
      for name in names:
        size = getattr(self, name)
        if size is not None and (not lightning_config.is_int(size) or size < smallest or size & (size - 1)):
          raise ValueError(f"{name} must be None or a power of two >= {smallest}, got {size!r}")
    for name in ("num_stages", "gradient_stages", "sequence_pieces"):
      count = getattr(self, name)
      if count is not None and not (lightning_config.is_int(count) and count >= 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {count!r}")
    for name in ("num_warps", "prepare_warps", "gradient_warps"):
      warps = getattr(self, name)
      if warps is not None and not (lightning_config.is_int(warps) and warps in (1, 2, 4, 8, 16)):
        raise ValueError(f"{name} must be None or a power of two up to 16, got {warps!r}")
    for name in ("split_backward", "warp_specialized", "forward_states"):
      if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
        raise TypeError(f"{name} must be None or a bool, got {getattr(self, name)!r}")

  def filled(self, defaults: DeltaConfig) -> DeltaConfig:
    """This config with each field left None taken from `defaults` (`default_config`'s for the call)."""
    return dataclasses.replace(self, **{field.name: getattr(defaults, field.name)
                                        for field in dataclasses.fields(self) if getattr(self, field.name) is None})

  def splits_backward(self, *, per_channel_gate: bool) -> bool:
    """Whether the backward takes the split gradient kernels for these gates (see `split_backward`)."""
    if self.split_backward and per_channel_gate:
      raise ValueError("DeltaConfig(split_backward=True) takes a scalar decay per token or none; per-key-channel "
                       "decay [B, T, H, D] (KDA) needs split_backward=False or None")
    return not per_channel_gate if self.split_backward is None else self.split_backward

  def warp_specializes_backward(self, *, per_channel_gate: bool) -> bool:
    """Whether the backward's sweeps are the warp-specialised ones (`backward`): `warp_specialized` resolved
    True (as the op resolves it), the split gradient kernel, and the sweeps' block_e at least the 64 value
    columns those kernels' CTAs take."""
    if self.warp_specialized and self.block_e is None:
      raise ValueError("warp_specializes_backward takes a filled DeltaConfig (block_e set: `DeltaConfig.filled`, as "
                       "delta_attention fills it per call)")
    return (self.splits_backward(per_channel_gate=per_channel_gate) and bool(self.warp_specialized)
            and self.block_e >= WarpSpecializedConfig.BLOCK_E)

  def keeps_forward_states(self, *, per_channel_gate: bool) -> bool:
    """Whether the forward keeps S_n^T and U^T for the backward (`forward_states`)."""
    return self.warp_specializes_backward(per_channel_gate=per_channel_gate) and self.forward_states is not False

  def keeps_chunk_terms(self, *, per_channel_gate: bool) -> bool:
    """Whether KDA's warp-specialised forward keeps its chunk terms for the backward (`forward_states`)."""
    return per_channel_gate and bool(self.warp_specialized) and self.forward_states is not False


# The Mosaic GPU gradient kernel's widest padded E (K and Ep 64 or 128); wider values take the Triton one.
MOSAIC_GRADIENTS_MAX_E = 128


# What shrinks, by (operand bytes, padded D at least, budget at most), and the largest backward chunk there.
# Triton's allocation of every kernel, forward and backward, on sm80 to sm120 (`benchmarks/shared_memory.py`,
# `benchmarks/tuning/delta-shared-memory.json`, over 4 chunks: a loop of one chunk does not pipeline). float32 at
# D = 64 on the 99 KiB devices: the tile gradient kernel's pipelined [64, 64] float32 loads took 163,840 B at D = 64
# (114,688 at D = 16) and take 90,112 with 32 key and value columns; past D = 64 the value columns, the pipeline,
# and at D = 256 on 99 KiB devices the chunk and the warps (the gradient kernel's tiles) shrink. The backward's
# sweeps hold [C, D] tiles of q, k and W, pipelined: at 64-token chunks the reverse sweep
# (`state_cotangents`) took 296,456 B at D = 256 with 16-bit operands on sm90 (3 stages; 107,268 at 2 on the 99
# KiB devices), 197,380 with float32 at D = 128 on sm80 and 107,268 at D = 64 on the 99 KiB devices: there the
# backward chunks by 32, as float32 at D = 256 and at D = 128 on the 99 KiB devices already did for the same sweep.
# A chunk cap never raises a form's own backward chunk (KDA's 16).
_STEPS = (
    ((4, 256, 99 * 1024), dict(chunk_size=16, block_e=16, num_stages=1, num_warps=2), 16),
    ((4, 256, 163 * 1024), dict(block_e=32, num_stages=1), 32),
    ((4, 256, math.inf), dict(), 32),
    ((4, 128, 99 * 1024), dict(block_e=32, num_stages=1), 32),
    ((4, 128, 163 * 1024), dict(), 32),
    ((4, 64, 99 * 1024), dict(block_e=32, block_d=32), 32),
    ((4, 16, 99 * 1024), dict(block_e=32, block_d=32), 64),
    ((2, 256, math.inf), dict(), 32),
)


# 16-bit operands pipeline the sweeps' loads 3 deep where a block may hold 227 KiB (sm90, sm100): on an H200
# (`benchmarks/delta_sweep.py`, B2 H32 D128 and B4 H32 D64, T8K, DeltaNet and Gated DeltaNet) the forward took
# 15-21% less time than at 2 and forward + backward 9-18% less (4 stages: within 3% of 3); the kernels without a
# loop (prepare, the chunk gradients) do not pipeline.
_DEEP_PIPELINE_BUDGET = 227 * 1024


def default_config(*, per_channel_gate: bool, dtype, dim_k: int, compute_capability=None, dim_v: int | None = None,
                   batch_heads: int = 0, num_sms: int = heuristics.DEFAULT_NUM_SMS) -> DeltaConfig:
  """The blocks for one call: the H200's (B2 H32 T8K D128, bf16), smaller where a device's shared memory needs
  or where the sweeps' grid would leave the GPU half idle.

  The backward: with a scalar gate or none the split gradient kernels at
  64-token chunks (fwd+bwd 30-37% faster than the one kernel at 16 at D128,
  8-27% at D64; 32-token chunks were slower at D128, level at D64). KDA's
  one gradient kernel is bound by registers: 1.6-3.2x faster at 16-token
  chunks than 32 once its diagonal blocks ran on the matrix units (DeltaNet's
  was 8x faster at D128). KDA's prepare kernel spilled registers with two blocks
  per chunk: one (16-token chunks) made its forward 3.6x (D128) and 1.7x (D64)
  faster (B2 H32 / B4 H32 T8K, bf16; `benchmarks/delta_sweep.py`).
  float32 operands with D > 128 halve block_e: the reverse sweep's state tile
  [D, 64] then needed 242688 bytes of shared memory, over sm90's 232448. With
  compute_capability None (no GPU, or an unknown one) the smallest budget
  applies (`lightning_config.shared_memory_budget`).

  The Triton sweeps run one program per (batch, head, block_e value
  columns): where twice that many programs still fit in the device's
  `num_sms` SMs (few heads, long sequences), block_e halves, down to 16. On
  an H200 (T 32K-64K, bf16, `benchmarks/delta_sweep.py`, before the
  backward's sweeps were warp-specialised) fwd+bwd took 14% (DeltaNet) and
  10% (Gated DeltaNet) less time at B1 H32 D128 with 32 columns, 22-24% less
  at B1 H16 D128 and 10-12% less at B2 H8 D64 with 16; 16 at B1 H32 was
  slower than 64. Where the backward's sweeps are warp-specialised (sm90,
  16-bit, D <= 128) block_e stays 64, their CTAs' width, and the sequence
  split fills the GPU (`sequence_split`): since the backward ran without
  prepare, on the warp-specialised sweeps, 64 columns took 8% (DeltaNet) and
  25% (Gated DeltaNet) less time than 32 at B1 H32 T64K D128 (H200,
  in-process: 8.66 against 9.42 ms, 9.32 against 12.38). KDA keeps its
  columns: its one gradient kernel walks E in block_e steps, and its fwd+bwd
  took 10-17% more time at D128 with fewer.
  The forward's prepare kernel takes 2 warps on sm90 with 16-bit inputs,
  D <= 128 and a scalar gate or none: on an H200 (B2 H32 D128 and B4 H32
  D64, T8K, `benchmarks/delta_sweep.py`) it took 12-14% less time than with
  4 (Gated DeltaNet D128 0.377 -> 0.332 ms, DeltaNet D64 0.479 -> 0.419,
  Gated DeltaNet D64 0.532 -> 0.458), level at DeltaNet D128 (0.293 ->
  0.297), and with 8 warps 40-80% more.
  The backward's `_tile_gradients_kernel` walks D and E by 64 columns
  (block_d) whatever block_e the sweeps take, and pipelines 2 deep where
  the sweeps take 3: on an H200 (bf16, the kernel alone on the backward's
  own intermediates, in-process) B2 H32 T8K D128 took 0.717 ms (DeltaNet)
  and 0.885 (Gated DeltaNet) so, against 0.993 and 1.011 with 3 stages
  (with 32 key columns for Gated DeltaNet: 64 spilled registers and lost
  there) and 0.947-1.599 with 32 key or value columns at 2 or 3 stages; at
  B4 H32 T8K D64 2 and 3 stages were level (0.703 / 0.865 ms) and 32
  columns slower; at B1 H32 T64K D128, where the sweeps take 32 value
  columns, the kernel at 32 took 3.80 / 4.91 ms with 3 stages, 4.52 / 5.44
  with 2.
  KDA's tile gradient kernel, where its forward is warp-specialised
  (`_channel_gated_backward`), walks D and E by 32 columns: on an H200
  (bf16, T8K, fwd+bwd, in-process) B2 H32 D128 took 6.43 ms so against 7.29
  with 64 and 7.29 with 16, B4 H32 D64 4.73 against 7.33 and 5.95 (8 warps:
  7.83 and 6.49; ptxas, sm90a: 3.0 KB of spills a thread at 64 columns, 0.45
  at 32).
  `batch_heads` = B H (0: unknown, no change); `dim_v` = E (default D).
  """
  dp = lightning_config.padded_dim(dim_k)
  itemsize = jnp.dtype(dtype).itemsize
  budget = lightning_config.shared_memory_budget(compute_capability)
  deep = itemsize == 2 and budget >= _DEEP_PIPELINE_BUDGET
  config = DeltaConfig(chunk_size=16 if per_channel_gate else 32, backward_chunk_size=16 if per_channel_gate else 64,
                       block_e=32 if itemsize * dp > 512 else 64, block_d=32 if per_channel_gate else 64,
                       num_warps=4, num_stages=3 if deep else 2, gradient_stages=2 if deep else None,
                       prepare_warps=2 if itemsize == 2 and not per_channel_gate and dp <= 128
                       and compute_capability == (9, 0) else None)
  for (step_itemsize, min_dim, max_budget), step, largest_backward_chunk in _STEPS:
    if itemsize == step_itemsize and dp >= min_dim and budget <= max_budget:
      config = dataclasses.replace(config, **step,
                                   backward_chunk_size=min(config.backward_chunk_size, largest_backward_chunk))
      break
  ep = lightning_config.padded_dim(dim_k if dim_v is None else dim_v)
  block_e = min(config.block_e, ep)
  # Where the backward's sweeps are warp-specialised they take 64 columns a CTA; the sequence split fills the GPU.
  warp_specialized = heuristics.warp_specialized_unsupported(
      dim_k=dim_k, dim_v=dim_k if dim_v is None else dim_v, dtype=dtype, compute_capability=compute_capability,
      interpret=False) is None
  while (not per_channel_gate and not warp_specialized and batch_heads and block_e > lightning_config.MIN_BLOCK
         and 2 * batch_heads * (ep // block_e) <= num_sms):
    block_e //= 2
  return config if block_e == min(config.block_e, ep) else dataclasses.replace(config, block_e=block_e)


def _rows(start, size):
  return pl.ds(start, size)


def _block(i):
  """Rows of the chunk's 16-row block i."""
  return _rows(i * BLOCK, BLOCK)


def _gate_rows(g_ref, start, size):
  """g of rows [start, start + size): [size, 1] for a scalar gate per token, [size, D] per key channel."""
  if len(g_ref.shape) == 1:
    return g_ref[_rows(start, size)][:, None]
  return g_ref[_rows(start, size), :]


def _sees_state(runs_ref, start, size):
  """[size, 1] float32: 1 for rows before the chunk's first segment start (they see the state before the chunk)."""
  return (runs_ref[_rows(start, size)] == 0)[:, None].astype(_F32)


def _decay_factors(g_ref, runs_ref, *, start, size, last_row):
  """(e^{g_t}, 0 for rows that do not see the state before the chunk; e^{g_C - g_t}, 0 for rows not in its last
  segment) of rows [start, start + size), [size, D or 1] float32; a Python 1.0 where a factor is all ones."""
  row_decay = to_end = 1.0
  if g_ref is not None:
    g = _gate_rows(g_ref, start, size)
    row_decay, to_end = jnp.exp(g), jnp.exp(_gate_rows(g_ref, last_row, 1) - g)
  if runs_ref is not None:
    row_decay = row_decay * _sees_state(runs_ref, start, size)
    to_end = to_end * (runs_ref[_rows(start, size)][:, None] == runs_ref[_rows(last_row, 1)][None, :]).astype(_F32)
  return row_decay, to_end


def _pair_mask(runs_ref, *, i, j, inclusive):
  """[16, 16] bool: the pairs (t, s) of blocks (i, j), j <= i, that interact (s <= t, or s < t, in one segment)."""
  t = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
  s = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
  mask = jnp.full((BLOCK, BLOCK), True)
  if runs_ref is not None:
    mask = runs_ref[_block(i)][:, None] == runs_ref[_block(j)][None, :]
  if i == j:
    mask &= (t >= s) if inclusive else (t > s)
  return mask


def _scalar_pair_decay(g_ref, *, i, j):
  """[16, 16] e^{g_t - g_s} of blocks (i, j) for a scalar gate (1 above the diagonal: those pairs are masked)."""
  gap = _gate_rows(g_ref, i * BLOCK, BLOCK) - g_ref[_block(j)][None, :]  # <= 0 for s <= t
  if i == j:
    gap = jnp.where(jax.lax.broadcasted_iota(jnp.int32, gap.shape, 0)
                    >= jax.lax.broadcasted_iota(jnp.int32, gap.shape, 1), gap, 0.0)
  return jnp.exp(gap)


def _through_row_before(g_ref, *, i, j):
  """Per key channel, e^{g_t - g_s} = e^{g_t - g_r} e^{g_r - g_s} through r, the row before block i > j:
  ([16, D] e^{g_t - g_r} of block i's rows, [16, D] e^{g_r - g_s} of block j's), both <= 1."""
  g_r = _gate_rows(g_ref, i * BLOCK - 1, 1)
  return jnp.exp(_gate_rows(g_ref, i * BLOCK, BLOCK) - g_r), jnp.exp(g_r - _gate_rows(g_ref, j * BLOCK, BLOCK))


# The largest decay a diagonal block may span (max over D of g_first - g_last) for `_diagonal_factors`:
# then e^{-span} <= e^{g_t - g_first} <= 1 <= e^{g_first - g_s} <= e^{span} stays in the operands' range
# (float16's is narrow), and in the backward's float32 sums of up to 16 such terms.
_FACTORED_SPAN = {jnp.dtype(jnp.float16): 6.0}
_FACTORED_SPAN_WIDE = 60.0  # bfloat16 and float32: e^60 = 1.1e26


def _factorable(g_ref, *, i, dtype):
  """Whether block i's diagonal pair products may factor through its first row (`_diagonal_factors`)."""
  span = jnp.max(_gate_rows(g_ref, i * BLOCK, 1) - _gate_rows(g_ref, i * BLOCK + BLOCK - 1, 1))
  return span <= _FACTORED_SPAN.get(jnp.dtype(dtype), _FACTORED_SPAN_WIDE)


def _columns_to_take(factorable):
  """The column loop's trip count: none where the block factors (a traced bool), else all 16. A loop of traced
  length stands in for cond, under which jaxlib 0.11.2's Triton failed to compile the vjp on an H200."""
  return (1 - factorable.astype(jnp.int32)) * BLOCK


def _diagonal_factors(g_ref, *, i):
  """Per key channel, e^{g_t - g_s} = e^{g_t - g_f} e^{g_f - g_s} through f, block i's first row:
  ([16, D] e^{g_t - g_f} <= 1, [16, D] e^{g_f - g_t} >= 1) of the block's rows (`_factorable` bounds them)."""
  gap = _gate_rows(g_ref, i * BLOCK, BLOCK) - _gate_rows(g_ref, i * BLOCK, 1)
  return jnp.exp(gap), jnp.exp(-gap)


def _column_decay(g_i, g_ref, *, i, c):
  """[16, D] e^{g_t - g_c} for the rows t of block i (g_i, loaded once per block) and its row c (1 for t < c:
  those pairs are masked)."""
  row = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, 1), 0)
  return jnp.exp(jnp.where(row >= c, g_i - _gate_rows(g_ref, i * BLOCK + c, 1), 0.0))


def _pair_blocks(xs, y_ref, g_ref, runs_ref, *, i, j, exact):
  """Block (i, j), j <= i, of sum_d x_td y_sd e^{g_td - g_sd} for each x, over the chunk's 16-row blocks.

  xs: ((x_i [16, D] rows of block i, inclusive), ...): `inclusive` keeps
  s == t. y_ref: the chunk's [C, D] ref. Pairs of different segments are 0.
  The x share the gate factors (A and P). Per key channel, a diagonal block
  goes through its first row where `_factorable`, else column by column.
  Returns a list of masked [16, 16] float32 blocks.
  """
  masks = [_pair_mask(runs_ref, i=i, j=j, inclusive=inclusive) for _, inclusive in xs]
  y_j = y_ref[_block(j), :]
  dot = lambda x, y: triton_lowering.dot(x, y, trans_b=True, exact=exact)  # noqa: E731
  if g_ref is None:
    return [jnp.where(mask, dot(x, y_j), 0.0) for (x, _), mask in zip(xs, masks)]
  if len(g_ref.shape) == 1:  # a scalar gate: one factor per pair
    decay = _scalar_pair_decay(g_ref, i=i, j=j)
    return [jnp.where(mask, dot(x, y_j) * decay, 0.0) for (x, _), mask in zip(xs, masks)]
  if i > j:  # per key channel, through the row before block i
    to_i, from_j = _through_row_before(g_ref, i=i, j=j)
    y_hat = (y_j.astype(_F32) * from_j).astype(y_j.dtype)
    return [jnp.where(mask, dot((x.astype(_F32) * to_i).astype(x.dtype), y_hat), 0.0)
            for (x, _), mask in zip(xs, masks)]

  # Where the block does not factor (these overflow), the column loop below overwrites every column.
  to_first, from_first = _diagonal_factors(g_ref, i=i)
  y_hat = (y_j.astype(_F32) * from_first).astype(y_j.dtype)
  blocks = tuple(dot((x.astype(_F32) * to_first).astype(x.dtype), y_hat) for x, _ in xs)
  xs_f32 = [x.astype(_F32) for x, _ in xs]
  s = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
  g_i = _gate_rows(g_ref, i * BLOCK, BLOCK)

  def column(c, blocks):  # the pairs (t, j * 16 + c) for every row t of the block
    y_decayed = y_ref[_rows(j * BLOCK + c, 1), :].astype(_F32) * _column_decay(g_i, g_ref, i=i, c=c)
    return tuple(jnp.where(s == c, jnp.sum(x * y_decayed, axis=1, keepdims=True), block)
                 for x, block in zip(xs_f32, blocks))

  blocks = jax.lax.fori_loop(0, _columns_to_take(_factorable(g_ref, i=i, dtype=y_j.dtype)), column, blocks)
  return [jnp.where(mask, block, 0.0) for block, mask in zip(blocks, masks)]


def _pair_blocks_vjp(d_pairs, xs, ys, y_ref, g_ref, *, dtype, exact):
  """The vjp of `_pair_blocks` over a whole chunk: x and y cotangents from the pair products' cotangents.

  d_pairs: per product, a dict (i, j) -> masked [16, 16] float32 cotangent
  (j <= i); xs: per product, the list of x's [16, D] row blocks; ys: the
  shared y's blocks, y_ref its [C, D] ref. Returns (per product, the list of
  dx blocks; the list of dy blocks, summed over the products), [16, D] float32.
  """
  nb = len(ys)
  dot = functools.partial(triton_lowering.dot, exact=exact)
  cast = lambda x: x.astype(dtype)  # noqa: E731
  dxs = [[jnp.zeros(ys[0].shape, _F32) for _ in range(nb)] for _ in xs]
  dys = [jnp.zeros(ys[0].shape, _F32) for _ in range(nb)]
  per_channel = g_ref is not None and len(g_ref.shape) == 2
  row = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, 1), 0)
  s = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
  for i in range(nb):
    for j in range(i + 1):
      if per_channel and i == j:  # as in the forward: through the block's first row where it factors, else by columns
        factorable = _factorable(g_ref, i=i, dtype=dtype)
        x_f32 = [x[i].astype(_F32) for x in xs]
        d_blocks = [d[i, i] for d in d_pairs]

        def column(c, carry, i=i, x_f32=x_f32, d_blocks=d_blocks, g_i=_gate_rows(g_ref, i * BLOCK, BLOCK)):
          dx_blocks, dy = carry
          decay = _column_decay(g_i, g_ref, i=i, c=c)
          y_decayed = y_ref[_rows(i * BLOCK + c, 1), :].astype(_F32) * decay
          dx_blocks = list(dx_blocks)
          for p, (x, d) in enumerate(zip(x_f32, d_blocks)):
            d_column = jnp.sum(jnp.where(s == c, d, 0.0), axis=1, keepdims=True)  # [16, 1]
            dx_blocks[p] = dx_blocks[p] + d_column * y_decayed
            dy = dy + jnp.where(row == c, jnp.sum(d_column * x * decay, axis=0, keepdims=True), 0.0)
          return tuple(dx_blocks), dy

        # Where the block does not factor (these overflow), the loop takes every column instead.
        to_first, from_first = _diagonal_factors(g_ref, i=i)
        y_hat = cast(ys[i].astype(_F32) * from_first)
        dx_blocks = tuple(jnp.where(factorable, dx[i] + dot(cast(d), y_hat) * to_first, dx[i])
                          for dx, d in zip(dxs, d_blocks))
        dy = jnp.where(factorable, dys[i] + from_first * sum(dot(cast(d), cast(x * to_first), trans_a=True)
                                                             for x, d in zip(x_f32, d_blocks)), dys[i])
        dx_blocks, dy = jax.lax.fori_loop(0, _columns_to_take(factorable), column, (dx_blocks, dy))
        for dx, dx_block in zip(dxs, dx_blocks):
          dx[i] = dx_block
        dys[i] = dy
        continue
      if per_channel:  # through the row before block i, as in the forward
        to_i, from_j = _through_row_before(g_ref, i=i, j=j)
        y_hat = cast(ys[j].astype(_F32) * from_j)
        for dx, x, d in zip(dxs, xs, d_pairs):
          dx[i] = dx[i] + dot(cast(d[i, j]), y_hat) * to_i
          dys[j] = dys[j] + dot(cast(d[i, j]), cast(x[i].astype(_F32) * to_i), trans_a=True) * from_j
        continue
      decay = 1.0 if g_ref is None else _scalar_pair_decay(g_ref, i=i, j=j)
      for dx, x, d in zip(dxs, xs, d_pairs):
        d_decayed = cast(d[i, j] * decay)
        dx[i] = dx[i] + dot(d_decayed, ys[j])
        dys[j] = dys[j] + dot(d_decayed, x[i], trans_a=True)
  return dxs, dys


def _unit_lower_inverse(a, *, dtype=_F32, exact=True):
  """(I + a)^{-1} for a strictly lower [n, n] float32 a (n a power of two), by whole tiles.

  Inverses of diagonal blocks of size s merge into blocks of size 2s,
  X <- X - X (L X) with L the lower-left s-blocks of a in each 2s-block, from
  s = 1 (X = I) to n / 2: 2 log2(n) - 2 products with `dtype` operands. Each
  step writes exact blocks of the inverse, so no intermediate exceeds them;
  the powers of a (the Neumann product (I - a)(I + a^2)(I + a^4)...) do, and
  lost 3.5e-4 of T's largest entry in float32 with keys near one direction,
  where the merges lose 1e-6 (tests/test_delta_ops.py).
  """
  n = a.shape[0]
  t = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
  s = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)

  def links(size):  # a's lower-left (size/2)-blocks within each diagonal size-block
    half = size // 2
    return jnp.where((t // size == s // size) & (t % size >= half) & (s % size < half), a, 0.0)

  x = jnp.where(t == s, 1.0, 0.0) - links(2)
  size = 4
  while size <= n:
    linked = triton_lowering.dot(links(size).astype(dtype), x.astype(dtype), exact=exact)
    x = x - triton_lowering.dot(x.astype(dtype), linked.astype(dtype), exact=exact)
    size *= 2
  return x


def _chunk_inverse(q, k, beta, k_ref, g_ref, runs_ref, *, exact):
  """A chunk's pair products and T = (I + A)^{-1}, by 16-row blocks.

  q: None or the list of the chunk's [16, D] query blocks; k: its key
  blocks (k_ref the [C, D] ref); beta: [16, 1] float32 blocks. Returns dicts
  over blocks (i, j), j <= i, of [16, 16] float32: the key pair products
  (strictly lower: A = beta_t times them), T, and (with q) the query-key
  pair products (inclusive; P without the scale), sharing A's gate factors.
  """
  key_pairs, tri, query_pairs = {}, {}, {}
  for i in range(len(k)):
    for j in range(i):
      key_pairs[i, j] = _pair_blocks([(k[i], False)], k_ref, g_ref, runs_ref, i=i, j=j, exact=exact)[0]
    diagonal = _pair_blocks([(k[i], False)] + ([] if q is None else [(q[i], True)]), k_ref, g_ref, runs_ref, i=i,
                            j=i, exact=exact)
    key_pairs[i, i] = diagonal[0]
    if q is not None:
      query_pairs[i, i] = diagonal[1]
    tri[i, i] = _unit_lower_inverse(beta[i] * key_pairs[i, i])
    for j in range(i - 1, -1, -1):  # forward substitution: (I + A_ii) T_ij = -sum_{j <= m < i} A_im T_mj
      acc = sum(triton_lowering.dot(beta[i] * key_pairs[i, m], tri[m, j], exact=True) for m in range(j, i))
      tri[i, j] = -triton_lowering.dot(tri[i, i], acc, exact=True)
  return key_pairs, tri, query_pairs


def _query_pairs_below(q_i, k_ref, g_ref, runs_ref, *, i, j, exact):
  """Block (i, j), j < i, of the query-key pair products (P without the scale)."""
  return _pair_blocks([(q_i, True)], k_ref, g_ref, runs_ref, i=i, j=j, exact=exact)[0]


class _ChunkRows(NamedTuple):
  """A chunk's inputs and per-row factors, by 16-row blocks (lists over blocks)."""
  q: list            # [16, D] input dtype
  k: list            # [16, D]
  beta: list         # [16, 1] float32
  decay_rows: list   # e^{g_t}, 0 for rows after a segment start (they do not see S) (`_decay_factors`)
  to_end: list       # e^{g_C - g_t}, 0 for rows before the last segment


def _chunk_rows(q_ref, k_ref, beta_ref, g_ref, runs_ref):
  c = k_ref.shape[0]
  blocks = range(c // BLOCK)
  factors = [_decay_factors(g_ref, runs_ref, start=i * BLOCK, size=BLOCK, last_row=c - 1) for i in blocks]
  return _ChunkRows(
      q=[q_ref[_block(i), :] for i in blocks], k=[k_ref[_block(i), :] for i in blocks],
      beta=[beta_ref[_block(i)][:, None] for i in blocks], decay_rows=[f[0] for f in factors],
      to_end=[f[1] for f in factors])


def _lower_row(tri, x, i, *, dtype, exact, transpose=False):
  """Row block i of T x (or T^T x) for T by 16-row blocks (`_chunk_inverse`) and x a list of [16, X] row blocks."""
  dot = lambda j: triton_lowering.dot(  # noqa: E731
      tri[(j, i) if transpose else (i, j)].astype(dtype), x[j].astype(dtype), trans_a=transpose, exact=exact)
  return sum(dot(j) for j in (range(i, len(x)) if transpose else range(i + 1)))


def _lower_product(tri, x, *, dtype, exact, transpose=False):
  """Every row block of T x (or T^T x): see `_lower_row`."""
  return [_lower_row(tri, x, i, dtype=dtype, exact=exact, transpose=transpose) for i in range(len(x))]


def _prepare_kernel(q_ref, k_ref, v_ref, beta_ref, g_ref, runs_ref, w_ref, u_ref, p_ref, t_ref, *, scale, exact):
  dtype = k_ref.dtype
  rows = _chunk_rows(q_ref, k_ref, beta_ref, g_ref, runs_ref)
  nb = len(rows.k)
  _, tri, p_diagonal = _chunk_inverse(None if p_ref is None else rows.q, rows.k, rows.beta, k_ref, g_ref, runs_ref,
                                      exact=exact)
  k_gated = [rows.k[i].astype(_F32) * (rows.decay_rows[i] * rows.beta[i]) for i in range(nb)]
  v_beta = [v_ref[_block(i), :].astype(_F32) * rows.beta[i] for i in range(nb)]
  for i in range(nb):  # block by block, writing as it goes: D = E = 256 fits in shared memory
    w_ref[_block(i), :] = _lower_row(tri, k_gated, i, dtype=dtype, exact=exact).astype(w_ref.dtype)
    u_ref[_block(i), :] = _lower_row(tri, v_beta, i, dtype=dtype, exact=exact).astype(u_ref.dtype)
    if t_ref is not None:
      for j in range(nb):
        t_ref[_block(i), _block(j)] = (tri[i, j] if j <= i else jnp.zeros((BLOCK, BLOCK), _F32)).astype(t_ref.dtype)
    if p_ref is None:
      continue
    for j in range(nb):
      p_ij = (p_diagonal[i, i] if j == i else jnp.zeros((BLOCK, BLOCK), _F32) if j > i
              else _query_pairs_below(rows.q[i], k_ref, g_ref, runs_ref, i=i, j=j, exact=exact))
      p_ref[_block(i), _block(j)] = scale * p_ij


def _tiles_kernel(k_ref, v_ref, beta_ref, g_ref, runs_ref, w_ref, u_ref, t_ref, *, exact):
  """One chunk by whole [C, C] tiles, for a scalar gate or none: A in one product, then T = (I + A)^{-1} by
  `_unit_lower_inverse` over the whole chunk; writes T, W = T beta K_g and U_v = T beta V, each product one [C, C]
  x [C, D] tile."""
  c = k_ref.shape[0]
  k = k_ref[...]
  beta = beta_ref[...].astype(_F32)
  a = (triton_lowering.dot(k, k, trans_b=True, exact=exact) * beta[:, None]
       * _pair_factors(g_ref, runs_ref, start=0, size=c, inclusive=False))
  # float16 operands for 16-bit inputs: bfloat16's 8 bits made T 5x less accurate with keys near one direction
  # (7e-3 against 3.5e-2 of its largest entry, tests/test_delta_ops.py), at the same speed; A's entries are at most 2
  # for keys of norm at most 1.
  x = _unit_lower_inverse(a, dtype=_F32 if exact else jnp.float16, exact=exact)
  t_ref[...] = x.astype(t_ref.dtype)
  product = lambda rows: triton_lowering.dot(x.astype(k.dtype), rows.astype(k.dtype), exact=exact)  # noqa: E731
  row_decay, _ = _decay_factors(g_ref, runs_ref, start=0, size=c, last_row=c - 1)
  w_ref[...] = product(k.astype(_F32) * (row_decay * beta[:, None])).astype(w_ref.dtype)
  u_ref[...] = product(v_ref[...].astype(_F32) * beta[:, None]).astype(u_ref.dtype)


def _pair_factors(g_ref, runs_ref, *, start, size, inclusive):
  """[size, size] float32 e^{g_t - g_s} for the pairs (t, s) of rows [start, start + size) that interact (s <= t,
  or s < t, in one segment), else 0: a scalar gate's (or no gate's) factors of a whole chunk's pair products."""
  rows = _rows(start, size)
  t = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
  s = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
  allowed = (t >= s) if inclusive else (t > s)
  if runs_ref is not None:
    allowed &= runs_ref[rows][:, None] == runs_ref[rows][None, :]
  if g_ref is None:
    return allowed.astype(_F32)
  g = g_ref[rows]
  return jnp.where(allowed, jnp.exp(jnp.where(allowed, g[:, None] - g[None, :], 0.0)), 0.0)


def _gated_queries_and_pairs(q_ref, k_ref, p_ref, g_ref, runs_ref, row_decay, *, start, chunk_size, scale, exact):
  """Rows [start, start + C) of one chunk: (scale Q_g [C, D], scale P [C, C]), float32.

  P is read where the prepare kernel wrote it (per key channel), else formed:
  one [C, D] x [D, C] product, as cheap to recompute as to read.
  """
  c = chunk_size
  rows = _rows(start, c)
  q = q_ref[rows, :]
  q_gated = q.astype(_F32) * (scale * row_decay)
  if p_ref is not None:
    return q_gated, p_ref[rows, :]
  p = scale * triton_lowering.dot(q, k_ref[rows, :], trans_b=True, exact=exact)
  return q_gated, p * _pair_factors(g_ref, runs_ref, start=start, size=c, inclusive=True)


def _chunk_range(first_ref, end_ref, num_chunks):
  """The chunks a sweep program runs: all, or with per-sequence bounds ([S] int32) its sequence's (grid axis 3)."""
  if first_ref is None:
    return 0, num_chunks
  sequence = pl.program_id(3)
  return first_ref[sequence], end_ref[sequence]


def _sweep_kernel(q_ref, k_ref, w_ref, u_ref, p_ref, g_ref, runs_ref, decay_ref, s0_ref, first_ref, end_ref, o_ref,
                  final_ref, states_ref, values_ref, *, scale, chunk_size, num_chunks, exact):
  """The chunks in order from the initial state (s0_ref, zeros where None): writes O (o_ref), the final state, the
  state before every chunk (states_ref) and/or U = U_v - W S_n (values_ref), each where given.

  With first_ref and end_ref ([S] int32 chunk bounds of the sequences of `chunk.aligned_sequences`, each in whole
  chunks), the program runs sequence `program_id(3)`'s chunks alone, from its initial state to its final one.
  """
  c = chunk_size
  dtype = k_ref.dtype
  dim_k = k_ref.shape[-1]
  state = jnp.zeros((dim_k, u_ref.shape[-1]), _F32) if s0_ref is None else s0_ref[...]

  def body(n, state):
    start = pl.multiple_of(n * c, c)
    rows = _rows(start, c)
    state_rows = _rows(pl.multiple_of(n * dim_k, dim_k), dim_k)
    state_in = state.astype(dtype)
    if states_ref is not None:
      states_ref[state_rows, :] = state_in.astype(states_ref.dtype)
    u_in = (u_ref[rows, :].astype(_F32) - triton_lowering.dot(w_ref[rows, :], state_in, exact=exact)).astype(dtype)
    if values_ref is not None:
      values_ref[rows, :] = u_in.astype(values_ref.dtype)
    row_decay, to_end = _decay_factors(g_ref, runs_ref, start=start, size=c, last_row=start + c - 1)
    if o_ref is not None:
      q_gated, p = _gated_queries_and_pairs(q_ref, k_ref, p_ref, g_ref, runs_ref, row_decay, start=start,
                                            chunk_size=c, scale=scale, exact=exact)
      out = (triton_lowering.dot(q_gated.astype(dtype), state_in, exact=exact)
             + triton_lowering.dot(p.astype(dtype), u_in, exact=exact))
      o_ref[rows, :] = out.astype(o_ref.dtype)
    k_end = (k_ref[rows, :].astype(_F32) * to_end).astype(dtype)
    new_state = triton_lowering.dot(k_end, u_in, trans_a=True, exact=exact)
    return new_state + (state if decay_ref is None else decay_ref[state_rows, :] * state)

  state = jax.lax.fori_loop(*_chunk_range(first_ref, end_ref, num_chunks), body, state)
  if final_ref is not None:
    final_ref[...] = state


def _state_cotangents_kernel(q_ref, k_ref, w_ref, p_ref, g_ref, runs_ref, decay_ref, do_ref, d_final_ref, first_ref,
                             end_ref, d_next_ref, d_initial_ref, du_ref, *, scale, chunk_size, num_chunks, exact):
  """Walking back from the final state's cotangent (d_final_ref, zeros where None): G_n = dL/dS_{n+1} (written for
  every chunk n where d_next_ref is given), dU = P^T dO + K_C G_n (written where du_ref is given), dL/dS_n =
  Diag(e^{g_C}) G_n + Q_g^T dO - W^T dU, and dL/dS_0 (d_initial_ref).

  With first_ref and end_ref (`_sweep_kernel`'s), over sequence `program_id(3)`'s chunks alone.
  """
  c = chunk_size
  dtype = k_ref.dtype
  dim_k = k_ref.shape[-1]
  grad = jnp.zeros((dim_k, do_ref.shape[-1]), _F32) if d_final_ref is None else d_final_ref[...]
  first, end = _chunk_range(first_ref, end_ref, num_chunks)

  def body(step, grad):
    n = end - 1 - step
    start = pl.multiple_of(n * c, c)
    rows = _rows(start, c)
    state_rows = _rows(pl.multiple_of(n * dim_k, dim_k), dim_k)
    grad_in = grad.astype(dtype)
    if d_next_ref is not None:
      d_next_ref[state_rows, :] = grad_in.astype(d_next_ref.dtype)
    do = do_ref[rows, :]
    row_decay, to_end = _decay_factors(g_ref, runs_ref, start=start, size=c, last_row=start + c - 1)
    q_gated, p = _gated_queries_and_pairs(q_ref, k_ref, p_ref, g_ref, runs_ref, row_decay, start=start, chunk_size=c,
                                          scale=scale, exact=exact)
    k_end = (k_ref[rows, :].astype(_F32) * to_end).astype(dtype)
    du = (triton_lowering.dot(p.astype(dtype), do, trans_a=True, exact=exact)
          + triton_lowering.dot(k_end, grad_in, exact=exact))
    if du_ref is not None:
      du_ref[rows, :] = du.astype(du_ref.dtype)
    grad_before = (triton_lowering.dot(q_gated.astype(dtype), do, trans_a=True, exact=exact)
                   - triton_lowering.dot(w_ref[rows, :], du.astype(dtype), trans_a=True, exact=exact))
    return grad_before + (grad if decay_ref is None else decay_ref[state_rows, :] * grad)

  d_initial_ref[...] = jax.lax.fori_loop(0, end - first, body, grad)


def _chunk_gradients_kernel(q_ref, k_ref, v_ref, beta_ref, g_ref, runs_ref, states_ref, d_next_ref, do_ref,
                            dq_ref, dk_ref, dv_ref, d_beta_ref, dg_ref, *, scale, block_e, exact):
  """One chunk's input cotangents from S_n (states_ref), G_n (d_next_ref) and dO; see `vjp` for the algebra.

  dg_ref gets every share of dg but the state decay's (`backward` adds it).
  """
  c, dim_k = k_ref.shape
  dim_v = v_ref.shape[-1]
  nb = c // BLOCK
  blocks = range(nb)
  dtype = k_ref.dtype
  dot = functools.partial(triton_lowering.dot, exact=exact)
  cast = lambda x: x.astype(dtype)  # noqa: E731
  f32 = lambda x: x.astype(_F32)  # noqa: E731
  zeros = lambda *shape: jnp.zeros(shape, _F32)  # noqa: E731
  rows = _chunk_rows(q_ref, k_ref, beta_ref, g_ref, runs_ref)
  key_pairs, tri, query_pairs = _chunk_inverse(rows.q, rows.k, rows.beta, k_ref, g_ref, runs_ref, exact=exact)
  for i in blocks:
    for j in range(i):
      query_pairs[i, j] = _query_pairs_below(rows.q[i], k_ref, g_ref, runs_ref, i=i, j=j, exact=exact)
  # The gated rows are recomputed where used rather than kept: registers, not FLOPs, bound this kernel.
  k_gated = lambda i: f32(rows.k[i]) * (rows.decay_rows[i] * rows.beta[i])  # noqa: E731  beta K_g
  q_gated = lambda i: f32(rows.q[i]) * (scale * rows.decay_rows[i])  # noqa: E731
  k_end = lambda i: f32(rows.k[i]) * rows.to_end[i]  # noqa: E731
  w = [cast(x) for x in _lower_product(tri, [k_gated(i) for i in blocks], dtype=dtype, exact=exact)]
  p = {ij: cast(scale * x) for ij, x in query_pairs.items()}
  # Cotangents summed over the value columns: of Q_g, W, K_C, P, of the pair
  # products through T (dA before its sign), and of the state decay (every row).
  d_q_gated, d_w, d_k_end = ([zeros(BLOCK, dim_k) for _ in blocks] for _ in range(3))
  d_p = {ij: zeros(BLOCK, BLOCK) for ij in query_pairs}
  d_tri_pairs = {ij: zeros(BLOCK, BLOCK) for ij in query_pairs}
  d_beta = [zeros(BLOCK) for _ in blocks]
  for e0 in range(0, dim_v, block_e):
    cols = pl.ds(e0, block_e)
    state, d_next = states_ref[:, cols], d_next_ref[:, cols]
    v = [f32(v_ref[_block(i), cols]) for i in blocks]
    do = [do_ref[_block(i), cols] for i in blocks]
    u_v = _lower_product(tri, [v[i] * rows.beta[i] for i in blocks], dtype=dtype, exact=exact)
    u = [cast(u_v[i] - dot(w[i], cast(state))) for i in blocks]
    du = [sum(dot(p[j, i], do[j], trans_a=True) for j in range(i, nb)) + dot(cast(k_end(i)), cast(d_next))
          for i in blocks]
    d_v_beta = _lower_product(tri, du, dtype=dtype, exact=exact, transpose=True)  # T^T dU
    for i in blocks:
      d_q_gated[i] += dot(do[i], cast(state), trans_b=True)
      d_w[i] -= dot(cast(du[i]), cast(state), trans_b=True)
      d_k_end[i] += dot(u[i], cast(d_next), trans_b=True)
      for j in range(i + 1):
        d_p[i, j] += dot(do[i], u[j], trans_b=True)
        d_tri_pairs[i, j] += dot(cast(d_v_beta[i]), cast(u_v[j]), trans_b=True)
      dv_ref[_block(i), cols] = (rows.beta[i] * d_v_beta[i]).astype(dv_ref.dtype)
      d_beta[i] += jnp.sum(v[i] * d_v_beta[i], axis=1)
  # g enters as e^{+g} in Q_g, K_g and the pair products' rows, as e^{-g} in K_C
  # and their columns, and g_C (the last row) in K_C and the state decay (whose
  # share `backward` adds): dg sums x * dx over those uses. Each cotangent is
  # folded in as soon as it is whole.
  with_gate = dg_ref is not None
  dq = [scale * rows.decay_rows[i] * d_q_gated[i] for i in blocks]
  dk = [rows.to_end[i] * d_k_end[i] for i in blocks]
  if with_gate:
    dg = [q_gated(i) * d_q_gated[i] - k_end(i) * d_k_end[i] for i in blocks]
    d_end = jnp.sum(sum(k_end(i) * d_k_end[i] for i in blocks), axis=0, keepdims=True)
  d_k_gated = _lower_product(tri, d_w, dtype=dtype, exact=exact, transpose=True)  # T^T dW
  d_key_pairs, d_query_pairs = {}, {}
  for (i, j), d in d_tri_pairs.items():  # dA = -(T^T dY) Y^T over Y = [W, U_v]; then A = beta_t (key pairs)
    d_a = -jnp.where(_pair_mask(runs_ref, i=i, j=j, inclusive=False), d + dot(cast(d_k_gated[i]), w[j], trans_b=True),
                     0.0)
    d_beta[i] += jnp.sum(d_a * key_pairs[i, j], axis=1)
    d_key_pairs[i, j] = rows.beta[i] * d_a
    d_query_pairs[i, j] = scale * jnp.where(_pair_mask(runs_ref, i=i, j=j, inclusive=True), d_p[i, j], 0.0)
  for i in blocks:
    d_beta[i] += jnp.sum(f32(rows.k[i]) * rows.decay_rows[i] * d_k_gated[i], axis=1)
    d_beta_ref[_block(i)] = d_beta[i]
    dk[i] += rows.beta[i] * rows.decay_rows[i] * d_k_gated[i]
    if with_gate:
      dg[i] += k_gated(i) * d_k_gated[i]
  (dk_rows, dq_rows), dk_columns = _pair_blocks_vjp([d_key_pairs, d_query_pairs], [rows.k, rows.q], rows.k, k_ref,
                                                     g_ref, dtype=dtype, exact=exact)
  last_row = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, 1), 0) == BLOCK - 1
  for i in blocks:
    dq_ref[_block(i), :] = (dq[i] + dq_rows[i]).astype(dq_ref.dtype)
    dk_ref[_block(i), :] = (dk[i] + dk_rows[i] + dk_columns[i]).astype(dk_ref.dtype)
    if not with_gate:
      continue
    dg_i = dg[i] + f32(rows.k[i]) * (dk_rows[i] - dk_columns[i]) + f32(rows.q[i]) * dq_rows[i]
    if i == nb - 1:
      dg_i += jnp.where(last_row, d_end, 0.0)
    if len(dg_ref.shape) == 1:
      dg_ref[_block(i)] = jnp.sum(dg_i, axis=1)
    else:
      dg_ref[_block(i), :] = dg_i


def _value_cotangents(tri, beta, v_ref, u_ref, du_ref, do_ref, dv_ref, *, block_e, transposed, exact):
  """The value columns' share of one chunk's cotangents, walking E by block_e: with Z = T^T dU, writes dv = beta Z
  and returns (dP = dO U^T [C, C], -Z U^T [C, C] (dA, unmasked), dbeta's share sum_e v Z [C]), float32.

  tri: T [C, C] in the operands' dtype; beta: [C, 1]; U, dU [C, Ep], or
  `transposed` U^T, dU^T [Ep, C]; v, dO, dv [C, Ep].
  """
  c = tri.shape[0]
  dtype = tri.dtype
  dot = functools.partial(triton_lowering.dot, exact=exact)

  def values(ei, acc):
    d_p, d_a, d_beta = acc
    cols = pl.ds(pl.multiple_of(ei * block_e, block_e), block_e)
    u = u_ref[cols, :] if transposed else u_ref[:, cols]
    z = dot(tri, du_ref[cols, :] if transposed else du_ref[:, cols], trans_a=True, trans_b=transposed)
    dv_ref[:, cols] = (beta * z).astype(dv_ref.dtype)
    return (d_p + dot(do_ref[:, cols], u, trans_b=not transposed),
            d_a - dot(z.astype(dtype), u, trans_b=not transposed),
            d_beta + jnp.sum(v_ref[:, cols].astype(_F32) * z, axis=1))

  return jax.lax.fori_loop(0, v_ref.shape[-1] // block_e, values,
                           (jnp.zeros((c, c), _F32), jnp.zeros((c, c), _F32), jnp.zeros((c,), _F32)))


def _state_products(states_ref, d_next_ref, u_ref, du_ref, do_ref, key_cols, d_state_decay, *, block_d, block_e,
                    transposed, decay_axis, exact):
  """One chunk's products with its state S_n and state cotangent G_n over key columns key_cols, walking E by
  block_e: (dQ_g = dO S_n^T, dK_C = U G_n^T, dW = -dU S_n^T, each [C, block_d] float32, and d_state_decay plus
  G_n * S_n summed over `decay_axis` of the state tiles (None: d_state_decay is None and none is formed)).

  S_n, G_n [Dp, Ep] and U, dU [C, Ep], or `transposed` S_n^T, G_n^T [Ep, Dp]
  and U^T, dU^T [Ep, C]; dO [C, Ep].
  """
  c = do_ref.shape[0]
  dot = functools.partial(triton_lowering.dot, exact=exact)
  by_values = dict(trans_a=transposed, trans_b=not transposed)  # U's, dU's columns times a state tile

  def along_values(ei, acc):
    d_q_gated, d_k_end, d_w, d_state_decay = acc
    cols = pl.ds(pl.multiple_of(ei * block_e, block_e), block_e)
    tile = lambda ref: ref[cols, key_cols] if transposed else ref[key_cols, cols]  # noqa: E731
    value_columns = lambda ref: ref[cols, :] if transposed else ref[:, cols]  # noqa: E731
    state, d_next = tile(states_ref), tile(d_next_ref)
    if decay_axis is not None:  # by value columns: Triton's sm100 passes failed on a full reduction
      d_state_decay = d_state_decay + jnp.sum(state.astype(_F32) * d_next.astype(_F32), axis=decay_axis,
                                              keepdims=True)
    return (d_q_gated + dot(do_ref[:, cols], state, trans_b=not transposed),
            d_k_end + dot(value_columns(u_ref), d_next, **by_values),
            d_w - dot(value_columns(du_ref), state, **by_values), d_state_decay)

  zeros = jnp.zeros((c, block_d), _F32)
  return jax.lax.fori_loop(0, do_ref.shape[-1] // block_e, along_values, (zeros, zeros, zeros, d_state_decay))


def _tile_gradients_kernel(q_ref, k_ref, v_ref, beta_ref, g_ref, runs_ref, t_ref, states_ref, d_next_ref, u_ref,
                           du_ref, do_ref, dq_ref, dk_ref, dv_ref, d_beta_ref, dg_ref, *, scale, block_d, block_e,
                           transposed, exact):
  """One chunk's input cotangents by whole [C, C] tiles (a scalar gate or none; `vjp` has the algebra).

  q_ref, k_ref: [C, Dp]; v_ref, u_ref, du_ref, do_ref: V, U (the sweep's),
  dU (`state_cotangents`') and dO [C, Ep]; t_ref: T [C, C] (`prepare`, or
  `pallas_mosaic_gpu.inverse` where the sweeps are warp-specialised);
  states_ref, d_next_ref: S_n and G_n [Dp, Ep]. `transposed`: S_n^T, G_n^T
  [Ep, Dp] and U^T, dU^T [Ep, C] instead (the warp-specialised sweeps', which
  store them from the buffers they publish them in). W enters only U = U_v - W S_n,
  so dW = -dU S_n^T, and with Z = T^T dU the pair products' cotangent
  dA = -(T^T dW) W^T - Z U_v^T is -Z U^T (U_v - W S_n = U): the value
  columns alone give dA, dP = dO U^T, dv = beta Z and dbeta's share
  through U_v. Then block_d key columns at a time, walking E: dQ_g = dO
  S_n^T, dK_C = U G_n^T and dW, which give dq, dk and dg's share of these
  columns (q dq - k dk, plus the last row's g_C through K_C and the state
  decay a_n = e^{g_C}). Nothing of size [C, D] crosses HBM but the results.
  """
  c, dp = k_ref.shape
  dtype = k_ref.dtype
  dot = functools.partial(triton_lowering.dot, exact=exact)
  zeros = lambda *shape: jnp.zeros(shape, _F32)  # noqa: E731
  tri = t_ref[...].astype(dtype)
  beta = beta_ref[...][:, None]
  row_decay, to_end = _decay_factors(g_ref, runs_ref, start=0, size=c, last_row=c - 1)
  key_columns = lambda di: pl.ds(pl.multiple_of(di * block_d, block_d), block_d)  # noqa: E731
  d_p, d_a, d_beta = _value_cotangents(tri, beta, v_ref, u_ref, du_ref, do_ref, dv_ref, block_e=block_e,
                                       transposed=transposed, exact=exact)
  # A_ts = beta_t (k_t . k_s) f_ts (f: the pair factors, 0 where pairs do not interact), so dA's masked part counts.
  factors = _pair_factors(g_ref, runs_ref, start=0, size=c, inclusive=False)
  key_pairs = jax.lax.fori_loop(0, dp // block_d, lambda di, pairs: pairs + dot(k_ref[:, key_columns(di)],
                                                                                  k_ref[:, key_columns(di)],
                                                                                  trans_b=True), zeros(c, c))
  d_beta = d_beta + jnp.sum(d_a * key_pairs * factors, axis=1)
  d_key_pairs = (beta * d_a * factors).astype(dtype)
  d_query_pairs = (scale * d_p * _pair_factors(g_ref, runs_ref, start=0, size=c, inclusive=True)).astype(dtype)
  with_gate = dg_ref is not None
  last_row = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1

  def keys(di, acc):
    d_beta, dg, g_end_rows, d_state_decay = acc
    key_cols = key_columns(di)
    # da_n = sum G_n * S_n, over the keys by value columns (summed over those after the loop).
    d_q_gated, d_k_end, d_w, d_state_decay = _state_products(
        states_ref, d_next_ref, u_ref, du_ref, do_ref, key_cols, d_state_decay, block_d=block_d, block_e=block_e,
        transposed=transposed, decay_axis=(1 if transposed else 0) if with_gate else None, exact=exact)
    q, k = q_ref[:, key_cols], k_ref[:, key_cols]
    k32 = k.astype(_F32)
    dq = scale * row_decay * d_q_gated + dot(d_query_pairs, k)
    dq_ref[:, key_cols] = dq.astype(dq_ref.dtype)
    if with_gate:  # here, so that dq is not live beside the [C, block_d] sums below (registers)
      dg = dg + jnp.sum(q.astype(_F32) * dq, axis=1)
    d_k_gated = dot(tri, d_w.astype(dtype), trans_a=True)  # T^T dW: the cotangent of beta K_g
    d_beta = d_beta + jnp.sum(k32 * row_decay * d_k_gated, axis=1)
    # k's uses by the sign of g in their factors (two [C, block_d] sums live at a time, not five: registers):
    # beta K_g's and A's rows (e^{+g}); K_C's, P's columns and A's columns (e^{-g}).
    rising = beta * row_decay * d_k_gated + dot(d_key_pairs, k)
    through_end = to_end * d_k_end
    if with_gate:
      g_end_rows = g_end_rows + jnp.sum(k32 * through_end, axis=1)  # summed over the rows once, after the loop
    falling = through_end + dot(d_query_pairs, q, trans_a=True) + dot(d_key_pairs, k, trans_a=True)
    dk_ref[:, key_cols] = (rising + falling).astype(dk_ref.dtype)
    if with_gate:
      dg = dg + jnp.sum(k32 * (rising - falling), axis=1)
    return d_beta, dg, g_end_rows, d_state_decay

  d_beta, dg, g_end_rows, d_state_decay = jax.lax.fori_loop(
      0, dp // block_d, keys, (d_beta, zeros(c), zeros(c),
                               (zeros(block_e, 1) if transposed else zeros(1, block_e)) if with_gate else None))
  d_beta_ref[...] = d_beta
  if with_gate:  # g_C's share (through K_C and the state decay a_n) goes to the last row
    # The last row's e^{g_C}, 0 where a segment starts in the chunk: the state decay a_n.
    state_decay = jnp.sum(jnp.where(last_row, row_decay, 0.0), axis=0, keepdims=True)
    g_end = (jnp.sum(g_end_rows[:, None], axis=0, keepdims=True)
             + state_decay * jnp.sum(d_state_decay, axis=0 if transposed else 1, keepdims=True))
    dg_ref[...] = dg + jnp.sum(jnp.where(last_row, g_end, 0.0), axis=1)


def _channel_tile_gradients_kernel(q_ref, k_ref, v_ref, beta_ref, g_ref, runs_ref, t_ref, states_ref, d_next_ref,
                                   u_ref, du_ref, do_ref, dq_ref, dk_ref, dv_ref, d_beta_ref, dg_ref, *, scale, block_d,
                                   block_e, transposed, exact):
  """`_tile_gradients_kernel` for KDA's per-key-channel gates, at the warp-specialised chunks.

  g_ref: [C, Dp] float32 G, the chunk-local cumulative log2 decays
  (`pallas_mosaic_gpu.channel_gated_chunks`' gates); runs_ref: [C] int32
  segment-start counts (packed rows; or None), whose pairs and rows the
  forward dropped (the pair kernel and the sweep), and so their cotangents
  here; dg_ref: [C, Dp]
  float32, the cotangent of the natural-log gates G ln 2, every share. The
  rest as `_tile_gradients_kernel`'s. Q_g, K_g and K_C are q and k times
  [C, block_d] tiles of factors, and the state decay a_n = 2^{G_C} one per
  key channel. The pair products A_ts = beta_t sum_d k_td k_sd 2^(G_td - G_sd)
  and P (q's rows) take their cotangents dA, dP [C, C] to their rows and
  columns as `channel_gated_chunks` formed them, through O_i, the log decay
  before 16-row block i: for the rows t of block i, sum_s M_ts y_s 2^(G_t -
  G_s) = 2^(G_t - O_i) sum_s M_ts (y_s 2^(O_i - G_s)) with the rows s past
  block i dropped (M is zero there), and for the columns s of block i
  2^(O_i - G_s) sum_t M_ts (x_t 2^(G_t - O_i)) with the rows t before it
  dropped. Each factor is at most 1 but 2^(O_i - G_s) on block i's rows, at
  most 2^max_block_span, which the caller bounds (`channel_spans_bounded`):
  four [C, C] x [C, block_d] products a block on the matrix units.
  """
  c = k_ref.shape[0]
  dtype = k_ref.dtype
  dot = functools.partial(triton_lowering.dot, exact=exact)
  tri = t_ref[...].astype(dtype)
  beta = beta_ref[...][:, None]
  d_p, d_a, d_beta = _value_cotangents(tri, beta, v_ref, u_ref, du_ref, do_ref, dv_ref, block_e=block_e,
                                       transposed=transposed, exact=exact)
  t = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
  s = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
  same_segment, sees_state, reaches_end = True, 1.0, 1.0
  if runs_ref is not None:  # packed: the pairs of one segment; the rows that see the state, or reach the end
    runs = runs_ref[...]
    same_segment = runs[:, None] == runs[None, :]
    sees_state = (runs == 0).astype(_F32)[:, None]
    reaches_end = (runs[:, None] == runs_ref[pl.ds(c - 1, 1)][None, :]).astype(_F32)
  d_query_pairs = jnp.where((t >= s) & same_segment, scale * d_p, 0.0).astype(dtype)
  d_a = jnp.where((t > s) & same_segment, d_a, 0.0)
  # A's rows take beta_t outside their sums (dbeta's share is k . (dA's rows)), its columns inside.
  d_key_pairs, d_key_pairs_beta = d_a.astype(dtype), (beta * d_a).astype(dtype)
  row_block = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) // BLOCK
  last_row = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0) == c - 1
  no_start = 1.0 if runs_ref is None else jnp.sum(jnp.where(last_row, sees_state, 0.0), axis=0, keepdims=True)

  def keys(di, d_beta):
    key_cols = pl.ds(pl.multiple_of(di * block_d, block_d), block_d)
    # da_n per key channel: G_n * S_n summed over the values.
    d_q_gated, d_k_end, d_w, d_state_decay = _state_products(
        states_ref, d_next_ref, u_ref, du_ref, do_ref, key_cols, jnp.zeros((1, block_d) if transposed else
                                                                            (block_d, 1), _F32),
        block_d=block_d, block_e=block_e, transposed=transposed, decay_axis=0 if transposed else 1, exact=exact)
    if not transposed:
      d_state_decay = d_state_decay.T
    g = g_ref[:, key_cols]
    g_end = g_ref[pl.ds(c - 1, 1), key_cols]
    k32 = k_ref[:, key_cols].astype(_F32)
    row_decay = sees_state * jnp.exp2(g)
    dq = scale * row_decay * d_q_gated
    d_k_gated = dot(tri, d_w.astype(dtype), trans_a=True)  # T^T dW: the cotangent of beta K_g
    d_beta = d_beta + jnp.sum(k32 * row_decay * d_k_gated, axis=1)
    rising = beta * row_decay * d_k_gated  # k's uses whose factors rise with g: beta K_g's, A's rows
    falling = reaches_end * jnp.exp2(g_end - g) * d_k_end  # and fall: K_C's, A's and P's columns
    state_decay = jnp.exp2(g_end) * no_start  # a_n = 2^{G_C}, 0 where a segment starts in the chunk
    g_end_share = jnp.sum(k32 * falling, axis=0, keepdims=True) + state_decay * d_state_decay
    q = q_ref[:, key_cols]
    for i in range(c // BLOCK):  # the factors formed where used, each [C, block_d] tile briefly live (registers)
      before = 0.0 if i == 0 else g_ref[pl.ds(i * BLOCK - 1, 1), key_cols]
      to_block = lambda rows: jnp.where(rows, jnp.exp2(jnp.minimum(g - before, 0.0)), 0.0)  # noqa: E731
      from_block = lambda rows: jnp.where(rows, jnp.exp2(before - g), 0.0)  # noqa: E731
      keys_y = (k32 * from_block(row_block <= i)).astype(dtype)  # rows past block i dropped (overflow)
      x_rows = to_block(row_block == i)
      dq = dq + x_rows * dot(d_query_pairs, keys_y)
      key_rows = x_rows * dot(d_key_pairs, keys_y)
      d_beta = d_beta + jnp.sum(k32 * key_rows, axis=1)
      rising = rising + beta * key_rows
      x = to_block(row_block >= i)
      columns = (dot(d_query_pairs, (q.astype(_F32) * x).astype(dtype), trans_a=True)
                 + dot(d_key_pairs_beta, (k32 * x).astype(dtype), trans_a=True))
      falling = falling + from_block(row_block == i) * columns
    dq_ref[:, key_cols] = dq.astype(dq_ref.dtype)
    dk_ref[:, key_cols] = (rising + falling).astype(dk_ref.dtype)
    dg = q.astype(_F32) * dq + k32 * (rising - falling)
    dg_ref[:, key_cols] = dg + jnp.where(last_row, g_end_share, 0.0)
    return d_beta

  d_beta_ref[...] = jax.lax.fori_loop(0, k_ref.shape[1] // block_d, keys, d_beta)


class Gates(NamedTuple):
  """The decay and segments in the kernels' form (None where absent).

  g: [B, H, Tp] (a scalar per token) or [B, H, Tp, Dp] (per key channel)
    float32 chunk-local cumulative log decays (`gate_logs`).
  runs: [B, Tp] int32 segment-start counts within each chunk.
  state_decay: [B, H, N Dp, 1] float32 e^{g_C} per chunk and key channel, 0
    where a segment starts in the chunk.
  """
  g: jax.Array | None
  runs: jax.Array | None
  state_decay: jax.Array | None


def gate_logs(decay, *, seq_len, dim_k, chunk_size):
  """g of `Gates` from the rates: None, [B, T, H] or [B, T, H, D] float32 (differentiable): `chunk.chunk_log_decays`,
  token-major, then the heads moved ahead of the tokens."""
  if decay is None:
    return None
  tp = -(-seq_len // chunk_size) * chunk_size
  per_channel = decay.ndim == 4
  rates = chunk_common.pad_tokens_and_features(decay if per_channel else decay[..., None], num_tokens=tp,
                                               dim=dim_k if per_channel else 1)
  g = chunk.chunk_log_decays(rates, chunk_size=chunk_size)
  return jnp.moveaxis(g, 2, 1) if per_channel else jnp.moveaxis(g[..., 0], 2, 1)


def gates(g, segment_starts, *, batch, heads, seq_len, dim_k, chunk_size) -> Gates:
  """The kernels' `Gates` of g (`gate_logs`) and segment starts ([B, T] bool or None)."""
  c = chunk_size
  n = -(-seq_len // c)
  runs = None
  if segment_starts is not None:
    runs = chunk.chunk_runs(jnp.pad(segment_starts, ((0, 0), (0, n * c - seq_len))), chunk_size=c)
  if g is None and runs is None:
    return Gates(None, None, None)
  shape = (batch, heads, n, dim_k)
  state_decay = jnp.ones(shape, _F32)
  if g is not None:
    g_end = g.reshape(batch, heads, n, c, *g.shape[3:])[:, :, :, -1]
    state_decay = jnp.broadcast_to(jnp.exp(g_end if g.ndim == 4 else g_end[..., None]), shape)
  if runs is not None:
    state_decay = state_decay * (runs[:, :, :, -1:] == 0)
    runs = runs.reshape(batch, n * c)
  return Gates(g, runs, state_decay.reshape(batch, heads, n * dim_k, 1))


def _head_rows(c, width=None):
  """BlockSpec of one chunk's rows of a [B, H, Tp] (or [B, H, Tp, width]) array, over the grid (B, H, N)."""
  if width is None:
    return pl.BlockSpec((None, None, c), lambda bi, hi, ni: (bi, hi, ni))
  return pl.BlockSpec((None, None, c, width), lambda bi, hi, ni: (bi, hi, ni, 0))


def _chunk_rows_spec(c, width):
  """BlockSpec of one chunk's rows of a [B, Tp, H, width] array, over the grid (B, H, N)."""
  return pl.BlockSpec((None, c, None, width), lambda bi, hi, ni: (bi, ni, hi, 0))


def _gate_specs(gates_: Gates, c, dp, *, per_chunk):
  """BlockSpecs of g and runs: one chunk's rows (grid (B, H, N)) or every row (grid (B, H, E blocks))."""
  tokens = c if per_chunk else None
  g_spec = runs_spec = None
  if gates_.g is not None:
    if per_chunk:
      g_spec = _head_rows(c, dp if gates_.g.ndim == 4 else None)
    elif gates_.g.ndim == 4:
      g_spec = pl.BlockSpec((None, None, gates_.g.shape[2], dp), lambda bi, hi, ei: (bi, hi, 0, 0))
    else:
      g_spec = pl.BlockSpec((None, None, gates_.g.shape[2]), lambda bi, hi, ei: (bi, hi, 0))
  if gates_.runs is not None:
    runs_spec = (pl.BlockSpec((None, tokens), lambda bi, hi, ni: (bi, ni)) if per_chunk
                 else pl.BlockSpec((None, gates_.runs.shape[1]), lambda bi, hi, ei: (bi, 0)))
  return g_spec, runs_spec


def prepare(q, k, v, beta, gates_: Gates, *, scale, with_inverse=False, config: DeltaConfig, interpret):
  """The prepare kernel on padded inputs ([B, Tp, H, Dp/Ep]; beta [B, H, Tp]): (W, U_v, P or None, T or None).

  P [B, H, Tp, C] float32 only with per-key-channel gates (the sweeps form a
  scalar gate's P themselves); T [B, H, Tp, C], each chunk's (I + A)^{-1}
  in the input dtype (the operand the kernels' products round it to), only
  `with_inverse` (the split backward reads it).
  """
  b, tp, h, dp = q.shape
  ep = v.shape[-1]
  c = config.chunk_size
  per_channel = gates_.g is not None and gates_.g.ndim == 4
  struct = lambda shape, dtype: manual_axes.struct(shape, dtype, q, k, v)  # noqa: E731
  return pl.pallas_call(
      functools.partial(_prepare_kernel, scale=scale, exact=q.dtype == _F32), grid=(b, h, tp // c),
      in_specs=[_chunk_rows_spec(c, dp), _chunk_rows_spec(c, dp), _chunk_rows_spec(c, ep), _head_rows(c),
                *_gate_specs(gates_, c, dp, per_chunk=True)],
      out_specs=[_chunk_rows_spec(c, dp), _chunk_rows_spec(c, ep), _head_rows(c, c) if per_channel else None,
                 _head_rows(c, c) if with_inverse else None],
      out_shape=[struct((b, tp, h, dp), q.dtype), struct((b, tp, h, ep), q.dtype),
                 struct((b, h, tp, c), _F32) if per_channel else None,
                 struct((b, h, tp, c), q.dtype) if with_inverse else None],
      compiler_params=triton_lowering.compiler_params(num_warps=config.prepare_warps or config.num_warps,
                                                      num_stages=config.num_stages),
      interpret=interpret, name="delta_attention_prepare")(q, k, v, beta, gates_.g, gates_.runs)


def prepare_by_tiles(k, v, beta, gates_: Gates, *, config: DeltaConfig, interpret):
  """`prepare(..., with_inverse=True)`'s (W, U_v, T) by whole [C, C] tiles (`_tiles_kernel`), for a scalar gate or
  none: the split backward's on the Triton sweeps, where D and E <= 128 (its [C, D] tiles stay whole; larger dims
  take `prepare`). k: [B, Tp, H, Dp]; v: [B, Tp, H, Ep]; beta: [B, H, Tp]."""
  b, tp, h, dp = k.shape
  c = config.chunk_size
  if gates_.g is not None and gates_.g.ndim == 4:
    raise ValueError("the whole-tile kernel takes a scalar gate per token or none; per key channel, prepare writes T")
  struct = lambda shape: manual_axes.struct(shape, k.dtype, k)  # noqa: E731
  rows = (_chunk_rows_spec(c, dp), _chunk_rows_spec(c, v.shape[-1]))
  return pl.pallas_call(
      functools.partial(_tiles_kernel, exact=k.dtype == _F32), grid=(b, h, tp // c),
      in_specs=[*rows, _head_rows(c), *_gate_specs(gates_, c, dp, per_chunk=True)],
      out_specs=[*rows, _head_rows(c, c)], out_shape=[struct(k.shape), struct(v.shape), struct((b, h, tp, c))],
      compiler_params=triton_lowering.compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret, name="delta_attention_prepare_by_tiles",
  )(k, v, beta, gates_.g, gates_.runs)


def _state_specs(b, h, n, dp, be):
  """BlockSpecs over the grid (B, H, E blocks): a state tile [Dp, be], and every chunk's [N Dp, be]."""
  return (pl.BlockSpec((None, None, dp, be), lambda bi, hi, ei: (bi, hi, 0, ei)),
          pl.BlockSpec((None, None, n * dp, be), lambda bi, hi, ei: (bi, hi, 0, ei)))


class _Programs(NamedTuple):
  """A sweep's grid and boundary states: one program per (row, head, value block) over every chunk, with one state
  per row [B, H, Dp, Ep]; or with `sweep`'s sequences one per (head, value block, sequence) over its own chunks
  (grid axis 3), with one state per sequence [S, H, Dp, Ep]."""
  grid: tuple
  spec: Callable  # a BlockSpec over the (B, H, E blocks) grid -> the same over this grid
  state_spec: pl.BlockSpec  # a boundary state's block
  num_states: int  # B or S
  bounds: tuple  # (first, end) [S] int32 and their BlockSpec, or Nones


def _programs(sequences, *, b, h, dp, ep, be) -> _Programs:
  """`_Programs` of a sweep over (B, H, E blocks); sequences: (first, end) [S] int32 chunk bounds, or None."""
  if sequences is None:
    return _Programs((b, h, ep // be), lambda spec: spec, _state_specs(b, h, 1, dp, be)[0], b, (None, None, None))
  if b != 1:
    raise ValueError(f"per-sequence states take one row, got B = {b}")
  first, end = sequences

  def over_sequences(spec):
    return None if spec is None else pl.BlockSpec(spec.block_shape,
                                                  lambda bi, hi, ei, si: spec.index_map(bi, hi, ei))

  return _Programs((b, h, ep // be, first.shape[0]), over_sequences,
                   pl.BlockSpec((None, None, dp, be), lambda bi, hi, ei, si: (si, hi, 0, ei)), first.shape[0],
                   (first, end, pl.BlockSpec(first.shape, lambda bi, hi, ei, si: (0,))))


def sweep(q, k, w, u, p, gates_: Gates, initial_state, *, scale, with_outputs=True, with_final_state,
          with_states=False, with_values=False, sequences=None, config: DeltaConfig, interpret):
  """The sweep kernel on padded inputs: (O [B, Tp, H, Ep] or None, final state [B, H, Dp, Ep] float32 or None,
  the state before every chunk [B, H, N Dp, Ep] in the input dtype (the kernels' operand) or None,
  U = U_v - W S_n [B, Tp, H, Ep] in the input dtype or None).

  sequences: None, or (first, end) [S] int32, the chunk bounds of S chunk-aligned sequences covering every chunk
  (`sequence_bounds`): then a program runs each sequence, and the initial and final states are per sequence,
  [S, H, Dp, Ep] (`_sweep_kernel`).
  """
  b, tp, h, dp = q.shape
  ep = u.shape[-1]
  c = config.chunk_size
  n = tp // c
  be = min(config.block_e, ep)
  whole = lambda width: pl.BlockSpec((None, tp, None, width), lambda bi, hi, ei: (bi, 0, hi, 0))  # noqa: E731
  columns = pl.BlockSpec((None, tp, None, be), lambda bi, hi, ei: (bi, 0, hi, ei))
  states_spec = _state_specs(b, h, n, dp, be)[1]
  programs = _programs(sequences, b=b, h=h, dp=dp, ep=ep, be=be)
  first, end, bounds_spec = programs.bounds
  struct = lambda shape, dtype: manual_axes.struct(shape, dtype, q, k, u)  # noqa: E731
  over_rows = [whole(dp), whole(dp), whole(dp), columns,
               None if p is None else pl.BlockSpec((None, None, tp, c), lambda bi, hi, ei: (bi, hi, 0, 0)),
               *_gate_specs(gates_, c, dp, per_chunk=False),
               None if gates_.state_decay is None else pl.BlockSpec((None, None, n * dp, 1),
                                                                    lambda bi, hi, ei: (bi, hi, 0, 0))]
  o, final_state, states, values = pl.pallas_call(
      functools.partial(_sweep_kernel, scale=scale, chunk_size=c, num_chunks=n, exact=q.dtype == _F32),
      grid=programs.grid,
      in_specs=[*map(programs.spec, over_rows), None if initial_state is None else programs.state_spec,
                bounds_spec, bounds_spec],
      out_specs=[programs.spec(columns) if with_outputs else None,
                 programs.state_spec if with_final_state else None,
                 programs.spec(states_spec) if with_states else None,
                 programs.spec(columns) if with_values else None],
      out_shape=[struct((b, tp, h, ep), q.dtype) if with_outputs else None,
                 struct((programs.num_states, h, dp, ep), _F32) if with_final_state else None,
                 struct((b, h, n * dp, ep), q.dtype) if with_states else None,
                 struct((b, tp, h, ep), q.dtype) if with_values else None],
      compiler_params=triton_lowering.compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret, name="delta_attention_sweep")(q, k, w, u, p, gates_.g, gates_.runs, gates_.state_decay,
                                                         initial_state, first, end)
  return o, final_state, states, values


def state_cotangents(q, k, w, p, gates_: Gates, do, d_final, *, scale, with_value_cotangents=False,
                     with_chunk_cotangents=True, sequences=None, config: DeltaConfig, interpret):
  """(G_n = dL/dS after every chunk [B, H, N Dp, Ep] in the input dtype `with_chunk_cotangents` (else None: the
  sequence split's pass from zero end cotangents), dL/dS_0 [B, H, Dp, Ep] float32, dU [B, Tp, H, Ep] in the input
  dtype `with_value_cotangents`, else None).

  Padded operands as for `sweep`; do: [B, Tp, H, Ep]; d_final: [B, H, Dp, Ep] or None. sequences: as `sweep`'s
  (d_final and dL/dS_0 then per sequence, [S, H, Dp, Ep]).
  """
  b, tp, h, dp = q.shape
  ep = do.shape[-1]
  c = config.chunk_size
  n = tp // c
  be = min(config.block_e, ep)
  whole = pl.BlockSpec((None, tp, None, dp), lambda bi, hi, ei: (bi, 0, hi, 0))
  columns = pl.BlockSpec((None, tp, None, be), lambda bi, hi, ei: (bi, 0, hi, ei))
  states_spec = _state_specs(b, h, n, dp, be)[1]
  programs = _programs(sequences, b=b, h=h, dp=dp, ep=ep, be=be)
  first, end, bounds_spec = programs.bounds
  struct = lambda shape, dtype: manual_axes.struct(shape, dtype, q, k, do)  # noqa: E731
  over_rows = [whole, whole, whole,
               None if p is None else pl.BlockSpec((None, None, tp, c), lambda bi, hi, ei: (bi, hi, 0, 0)),
               *_gate_specs(gates_, c, dp, per_chunk=False),
               None if gates_.state_decay is None else pl.BlockSpec((None, None, n * dp, 1),
                                                                    lambda bi, hi, ei: (bi, hi, 0, 0)),
               columns]
  d_next, d_initial, d_values = pl.pallas_call(
      functools.partial(_state_cotangents_kernel, scale=scale, chunk_size=c, num_chunks=n, exact=q.dtype == _F32),
      grid=programs.grid,
      in_specs=[*map(programs.spec, over_rows), None if d_final is None else programs.state_spec,
                bounds_spec, bounds_spec],
      out_specs=[programs.spec(states_spec) if with_chunk_cotangents else None, programs.state_spec,
                 programs.spec(columns) if with_value_cotangents else None],
      out_shape=[struct((b, h, n * dp, ep), q.dtype) if with_chunk_cotangents else None,
                 struct((programs.num_states, h, dp, ep), _F32),
                 struct((b, tp, h, ep), q.dtype) if with_value_cotangents else None],
      compiler_params=triton_lowering.compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret, name="delta_attention_state_cotangents")(q, k, w, p, gates_.g, gates_.runs,
                                                                     gates_.state_decay, do,
                                                                     d_final, first, end)
  return d_next, d_initial, d_values


def chunk_gradients(q, k, v, beta, gates_: Gates, states, d_next, do, *, scale, config: DeltaConfig, interpret):
  """The chunk_gradients kernel on padded operands: (dq, dk [B, Tp, H, Dp], dv [B, Tp, H, Ep] in the input dtype,
  dbeta [B, H, Tp] float32, dg like gates_.g float32 or None)."""
  b, tp, h, dp = q.shape
  ep = v.shape[-1]
  c = config.chunk_size
  struct = lambda shape, dtype: manual_axes.struct(shape, dtype, q, k, v)  # noqa: E731
  chunk_state = pl.BlockSpec((None, None, dp, ep), lambda bi, hi, ni: (bi, hi, ni, 0))
  g_spec, runs_spec = _gate_specs(gates_, c, dp, per_chunk=True)
  return pl.pallas_call(
      functools.partial(_chunk_gradients_kernel, scale=scale, block_e=min(config.block_e, ep), exact=q.dtype == _F32),
      grid=(b, h, tp // c),
      in_specs=[_chunk_rows_spec(c, dp), _chunk_rows_spec(c, dp), _chunk_rows_spec(c, ep), _head_rows(c), g_spec,
                runs_spec, chunk_state, chunk_state, _chunk_rows_spec(c, ep)],
      out_specs=[_chunk_rows_spec(c, dp), _chunk_rows_spec(c, dp), _chunk_rows_spec(c, ep), _head_rows(c), g_spec],
      out_shape=[struct((b, tp, h, dp), q.dtype), struct((b, tp, h, dp), q.dtype), struct((b, tp, h, ep), q.dtype),
                 struct((b, h, tp), _F32), None if gates_.g is None else struct(gates_.g.shape, _F32)],
      compiler_params=triton_lowering.compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret, name="delta_attention_chunk_gradients")(q, k, v, beta, gates_.g, gates_.runs, states,
                                                                    d_next, do)


def tile_gradients(q, k, v, beta, gates_: Gates, tri, states, d_next, u, du, do, *, scale, config: DeltaConfig,
                   interpret, transposed=False, channel_gates=None):
  """`_tile_gradients_kernel` over the grid (B, H, N) on padded operands: (dq, dk [B, Tp, H, Dp], dv [B, Tp, H,
  Ep] in the input dtype, dbeta [B, H, Tp] float32, dg [B, H, Tp] float32 (every share) or None).

  tri: T [B, H, Tp, C] (`prepare`, or `pallas_mosaic_gpu.inverse(...,
  with_unscaled=True)`); states, d_next: S_n (`sweep`) and G_n
  (`state_cotangents`) [B, H, N Dp, Ep]; u, du: U (`sweep`) and dU
  (`state_cotangents`) [B, Tp, H, Ep]; do: [B, Tp, H, Ep].
  `transposed`: S_n^T, G_n^T [B, H, N, Ep, Dp] and U^T, dU^T [B, H, Ep, Tp]
  as `pallas_mosaic_gpu.state_sweep` and `state_cotangents` write them.
  channel_gates: KDA's G [B, Tp, H, Dp] float32 (`_channel_tile_gradients_kernel`;
  gates_ then its runs alone, or empty), and dg [B, Tp, H, Dp] the cotangent of G ln 2.
  """
  b, tp, h, dp = q.shape
  ep = v.shape[-1]
  c = config.chunk_size
  struct = lambda shape, dtype: manual_axes.struct(shape, dtype, q, k, v)  # noqa: E731
  keys, values = _chunk_rows_spec(c, dp), _chunk_rows_spec(c, ep)
  # (a chunk's state, its value rows) as stored untransposed or transposed
  state_spec, u_spec = ((pl.BlockSpec((None, None, None, ep, dp), lambda bi, hi, ni: (bi, hi, ni, 0, 0)),
                         pl.BlockSpec((None, None, ep, c), lambda bi, hi, ni: (bi, hi, 0, ni))) if transposed
                        else (pl.BlockSpec((None, None, dp, ep), lambda bi, hi, ni: (bi, hi, ni, 0)), values))
  blocks = dict(scale=scale, block_d=min(config.block_d, dp), block_e=min(config.block_d, ep), transposed=transposed,
                exact=q.dtype == _F32)
  if channel_gates is not None:
    if gates_.g is not None:
      raise ValueError("channel_gates take no other gates")
    kernel = functools.partial(_channel_tile_gradients_kernel, **blocks)
    gate_operands, gate_specs = (channel_gates, gates_.runs), [keys, _gate_specs(gates_, c, dp, per_chunk=True)[1]]
    dg_shape = (b, tp, h, dp)
  else:
    kernel = functools.partial(_tile_gradients_kernel, **blocks)
    gate_operands, gate_specs = (gates_.g, gates_.runs), list(_gate_specs(gates_, c, dp, per_chunk=True))
    dg_shape = None if gates_.g is None else (b, h, tp)
  return pl.pallas_call(
      kernel, grid=(b, h, tp // c),
      in_specs=[keys, keys, values, _head_rows(c), *gate_specs, _head_rows(c, c), state_spec, state_spec, u_spec,
                u_spec, values],
      out_specs=[keys, keys, values, _head_rows(c), gate_specs[0]],
      out_shape=[struct((b, tp, h, dp), q.dtype), struct((b, tp, h, dp), q.dtype), struct((b, tp, h, ep), q.dtype),
                 struct((b, h, tp), _F32), None if dg_shape is None else struct(dg_shape, _F32)],
      compiler_params=triton_lowering.compiler_params(
          num_warps=config.num_warps if config.gradient_warps is None else config.gradient_warps,
          num_stages=config.num_stages if config.gradient_stages is None else config.gradient_stages),
      interpret=interpret, name="delta_attention_tile_gradients")(q, k, v, beta, *gate_operands, tri, states,
                                                                   d_next, u, du, do)


def padded_operands(q, k, v, beta, segment_starts, g, *, chunk_size, dims=None, rows=None):
  """The kernels' operands: q, k, v padded to [B, Tp, H, Dp/Ep] (rows: to that many rows instead, T <= rows <= Tp),
  beta [B, H, Tp], `Gates`. dims: (Dp, Ep), by default `lightning_config.padded_dim`'s; g: `gate_logs`' at Dp."""
  b, t, h, d = q.shape
  dp, ep = dims or (lightning_config.padded_dim(d), lightning_config.padded_dim(v.shape[-1]))
  tp = -(-t // chunk_size) * chunk_size
  pad = functools.partial(chunk_common.pad_tokens_and_features, num_tokens=tp if rows is None else rows)
  beta_rows = jnp.moveaxis(jnp.pad(beta, ((0, 0), (0, tp - t), (0, 0))), 2, 1)
  gates_ = gates(g, segment_starts, batch=b, heads=h, seq_len=t, dim_k=dp, chunk_size=chunk_size)
  return pad(q, dim=dp), pad(k, dim=dp), pad(v, dim=ep), beta_rows, gates_


def sequence_chunk(config: DeltaConfig) -> int:
  """Tokens a chunk of the `chunk.aligned_sequences` layout that `forward`'s and `backward`'s sequences take: their
  sweeps' largest chunk, the warp-specialised forward's 64 where `config.warp_specialized` (the others divide it:
  powers of two)."""
  return max(config.chunk_size, config.backward_chunk_size,
             WarpSpecializedConfig.CHUNK_SIZE if config.warp_specialized else 0)


def sequence_bounds(sequences, segment_starts, *, seq_len, chunk_size, layout_chunk):
  """`sweep`'s sequences from `forward`'s and `backward`'s ((first, end) chunk bounds of a `chunk.aligned_sequences`
  layout at layout_chunk tokens a chunk, or None), for chunks of chunk_size: the last sequence's program also runs
  the layout's trailing chunks (zero rows: they leave its state as it is), so the programs cover every chunk."""
  if sequences is None:
    return None
  first, end = sequences
  if seq_len % layout_chunk or segment_starts is not None:
    raise ValueError(f"sequences take a row laid out in whole chunks of {layout_chunk} tokens and no segment starts; "
                     f"got T = {seq_len}")
  per_chunk = layout_chunk // chunk_size
  end = jnp.concatenate([end[:-1] * per_chunk, jnp.full((1,), seq_len // chunk_size, end.dtype)])
  return first * per_chunk, end


def forward(q, k, v, beta, decay, segment_starts, initial_state, *, scale, with_final_state, config: DeltaConfig,
            interpret, with_outputs=True, sequences=None):
  """The delta attention forward on the Pallas Triton kernels.

  q, k: [B, T, H, D]; v: [B, T, H, E] (one float dtype); beta: [B, T, H]
  float32; decay: None, [B, T, H] or [B, T, H, D] float32 rates;
  segment_starts: [B, T] bool or None; initial_state: [B, H, D, E] float32
  or None. Returns (o [B, T, H, E] in q's dtype, or None without
  with_outputs (the sweep then forms no output), final state [B, H, D, E]
  float32 or None).

  sequences: None, or (first, end) [S] int32, the chunk bounds of S
  sequences laid out in one row by `chunk.aligned_sequences` (at
  `sequence_chunk(config)` tokens a chunk; no segment starts): each starts from
  its own initial state, initial_state [S, H, D, E] (None: zeros), and the
  final states are each sequence's, [S, H, D, E] (an empty one's: its
  initial state).
  """
  t, d, e = q.shape[1], q.shape[-1], v.shape[-1]
  c = config.chunk_size
  dp, ep = lightning_config.padded_dim(d), lightning_config.padded_dim(e)
  bounds = sequence_bounds(sequences, segment_starts, seq_len=t, chunk_size=c, layout_chunk=sequence_chunk(config))
  g = gate_logs(decay, seq_len=t, dim_k=dp, chunk_size=c)
  qp, kp, vp, beta_rows, gates_ = padded_operands(q, k, v, beta, segment_starts, g, chunk_size=c)
  w, u, p, _ = prepare(qp, kp, vp, beta_rows, gates_, scale=scale, config=config, interpret=interpret)
  o, final_state, _, _ = sweep(qp, kp, w, u, p, gates_, chunk_common.pad_state(initial_state, dp, ep), scale=scale,
                               with_outputs=with_outputs, with_final_state=with_final_state, sequences=bounds,
                               config=config, interpret=interpret)
  return None if o is None else o[:, :t, :, :e], None if final_state is None else final_state[:, :, :d, :e]


def backward(q, k, v, beta, decay, segment_starts, initial_state, do, d_final, *, scale, config: DeltaConfig,
             interpret, inverses=None, states=None, chunk_terms=None, initial_cotangent_only=False, sequences=None):
  """The cotangents (dq, dk, dv, dbeta, d decay or None, d initial_state or None) of `forward`'s inputs.

  do: [B, T, H, E] the output cotangent; d_final: [B, H, D, E] or None.
  Where `config.warp_specializes_backward` (the forward's sweep is the
  warp-specialised one, and the Triton sweeps would take 64 value columns:
  the warp-specialised CTAs take 64 each, so where `default_config` gives the
  Triton sweeps fewer to fill the GPU, they would leave SMs idle; an H200, B1
  H32 T64K D128, bf16, in-process: DeltaNet's fwd+bwd 10.25 ms with them
  against 9.56 with the Triton sweeps at 32 columns), both sweeps are
  warp-specialised (`pallas_mosaic_gpu`) and no prepare runs: the state sweep
  forms U from T' as the forward does, the reverse sweep forms W from T', and
  the gradient kernel reads T (`pallas_mosaic_gpu.tile_gradients` where Ep <=
  128, else `tile_gradients`). inverses: then (T, T') [B, H, Tp, 64], padded
  as the forward's (`warp_specialized.forward(..., with_inverses=True)`, its
  residuals); None: `pallas_mosaic_gpu.inverse` forms them here. states:
  then (S_n^T [B, H, N, Ep, Dp], U^T [B, H, Ep, Tp]) as the forward kept them
  (`warp_specialized.forward(..., with_states=True)`; `forward_states`), or
  None: the state sweep forms them here.
  chunk_terms: KDA's, where its forward is warp-specialised: the
  forward's `pallas_mosaic_gpu.ChannelGatedChunks` with its backward terms,
  then S_n^T, U^T and its block ends (`ChannelGatedChunks.block_ends`)
  (`warp_specialized.forward(..., with_chunk_terms=True)`), or None: formed
  here (`_channel_gated_backward`).
  initial_cotangent_only: return only dL/dS_0 [B, H, D, E] float32 (the
  reverse sweep's; initial_state may be None): the sequence split's
  cotangent of each piece's start from its own outputs (`sequence_split`).
  sequences: `forward`'s, in the layout of `sequence_chunk(config)`:
  initial_state, d_final and dL/dS_0 are per sequence, and each sweep runs
  a program per sequence (the warp-specialised ones with a scalar gate or
  none, where `config.warp_specializes_backward`; KDA's on the Triton
  sweeps). Nothing is kept from the forward: the backward forms it again.
  """
  layout_chunk = sequence_chunk(config)
  if sequences is not None:
    if inverses is not None or states is not None or chunk_terms is not None or initial_cotangent_only:
      raise ValueError("per-sequence states take no kept inverses, states or chunk terms, and return every cotangent")
    if decay is not None and decay.ndim == 4:  # KDA's warp-specialised backward takes no sequences
      config = dataclasses.replace(config, warp_specialized=False)
  t, d, e = q.shape[1], q.shape[-1], v.shape[-1]
  per_channel_gate = decay is not None and decay.ndim == 4
  if per_channel_gate and config.warp_specialized:
    if inverses is not None or states is not None:
      raise ValueError("KDA's warp-specialised backward takes chunk_terms, not inverses or states")
    arguments = (q, k, v, beta, decay, segment_starts, initial_state, do, d_final)
    triton = functools.partial(backward, *arguments, scale=scale, config=dataclasses.replace(
        config, warp_specialized=False), interpret=interpret, initial_cotangent_only=initial_cotangent_only)
    return _channel_gated_backward(*arguments, scale=scale, config=config, interpret=interpret,
                                   chunk_terms=chunk_terms, initial_cotangent_only=initial_cotangent_only,
                                   fallback=triton)
  split = config.splits_backward(per_channel_gate=per_channel_gate)
  warp_specialized = config.warp_specializes_backward(per_channel_gate=per_channel_gate)
  config = dataclasses.replace(config, chunk_size=config.backward_chunk_size, prepare_warps=None)
  c = config.chunk_size
  if warp_specialized and c != WarpSpecializedConfig.CHUNK_SIZE:
    raise ValueError(f"the warp-specialised backward takes backward_chunk_size={WarpSpecializedConfig.CHUNK_SIZE}, "
                     f"got {c}")
  if chunk_terms is not None:
    raise ValueError("chunk_terms are KDA's where its forward is warp-specialised")
  if (inverses is not None or states is not None) and not warp_specialized:
    raise ValueError("inverses and states are the warp-specialised backward's (DeltaConfig.warp_specializes_backward)")
  dp, ep = (WarpSpecializedConfig.padded_dims(d, e) if warp_specialized
            else (lightning_config.padded_dim(d), lightning_config.padded_dim(e)))
  per_sequence = dict(sequences=sequence_bounds(sequences, segment_starts, seq_len=t, chunk_size=c,
                                                 layout_chunk=layout_chunk))
  g, gate_vjp = jax.vjp(functools.partial(gate_logs, seq_len=t, dim_k=dp, chunk_size=c), decay)
  mosaic_gradients = warp_specialized and ep <= MOSAIC_GRADIENTS_MAX_E  # `tile_gradients`' Mosaic GPU form
  # The Mosaic GPU kernels read zeros past T where TMA tiles it (`warp_specialized.walked_rows`): where they alone
  # run, q, k, v and do go to them with T rows, no copy to whole chunks; the Triton kernels take whole chunks.
  rows = warp_specialized_forward.walked_rows(t)[0] if mosaic_gradients else None
  qp, kp, vp, beta_rows, gates_ = padded_operands(q, k, v, beta, segment_starts, g, chunk_size=c, dims=(dp, ep),
                                                  rows=rows)
  tp = beta_rows.shape[-1]  # T in whole chunks, as `padded_operands` padded beta
  kernels = dict(scale=scale, config=config, interpret=interpret)
  initial_state = chunk_common.pad_state(initial_state, dp, ep)
  dop = chunk_common.pad_tokens_and_features(do.astype(q.dtype), num_tokens=qp.shape[1], dim=ep)
  d_final = chunk_common.pad_state(d_final, dp, ep)
  if warp_specialized:  # S_n^T and U^T, G_n^T and dU^T from the warp-specialised sweeps
    transpose = lambda x: None if x is None else jnp.swapaxes(x, -1, -2)  # noqa: E731
    chunk_gates = lightning_mosaic.sweep_gates(decay, segment_starts, num_tokens=tp)
    if inverses is None:  # T only where the gradient kernel runs
      formed = pallas_mosaic_gpu.inverse(kp, beta_rows, chunk_gates, with_unscaled=not initial_cotangent_only,
                                         num_tokens=tp, interpret=interpret)
      inverses = (None, formed) if initial_cotangent_only else formed
    tri, tri_beta = inverses
    if initial_cotangent_only:
      return transpose(pallas_mosaic_gpu.state_cotangents(qp, kp, tri_beta, dop, chunk_gates, transpose(d_final),
                                                          scale=scale, interpret=interpret, initial_only=True,
                                                          num_tokens=tp))[:, :, :d, :e]
    d_next, d_initial, d_values = pallas_mosaic_gpu.state_cotangents(qp, kp, tri_beta, dop, chunk_gates,
                                                                     transpose(d_final), scale=scale,
                                                                     interpret=interpret, num_tokens=tp,
                                                                     **per_sequence)
    d_initial = transpose(d_initial)
    states, values = states or pallas_mosaic_gpu.state_sweep(kp, vp, tri_beta, chunk_gates,
                                                             transpose(initial_state), interpret=interpret,
                                                             num_tokens=tp, **per_sequence)
  else:  # S_n and U, G_n and dU from the Triton sweeps, on prepare's W and U_v (and P, T)
    if split and max(dp, ep) <= 128:  # by whole tiles (`prepare_by_tiles`)
      (w, u, tri), p = prepare_by_tiles(kp, vp, beta_rows, gates_, config=config, interpret=interpret), None
    else:
      w, u, p, tri = prepare(qp, kp, vp, beta_rows, gates_, with_inverse=split, **kernels)
    if initial_cotangent_only:
      return state_cotangents(qp, kp, w, p, gates_, dop, d_final, with_chunk_cotangents=False,
                              **kernels)[1][:, :, :d, :e]
    d_next, d_initial, d_values = state_cotangents(qp, kp, w, p, gates_, dop, d_final, with_value_cotangents=split,
                                                   **per_sequence, **kernels)
    _, _, states, values = sweep(qp, kp, w, u, p, gates_, initial_state, with_outputs=False, with_final_state=False,
                                 with_states=True, with_values=split, **per_sequence, **kernels)
  if mosaic_gradients:
    dq, dk, dv, d_beta, dg = pallas_mosaic_gpu.tile_gradients(qp, kp, vp, beta_rows, gates_, tri, states, d_next,
                                                              values, d_values, dop, scale=scale, num_tokens=tp,
                                                              interpret=interpret)
  elif split:
    dq, dk, dv, d_beta, dg = tile_gradients(qp, kp, vp, beta_rows, gates_, tri, states, d_next, values, d_values,
                                            dop, transposed=warp_specialized, **kernels)
  else:
    dq, dk, dv, d_beta, dg = chunk_gradients(qp, kp, vp, beta_rows, gates_, states, d_next, dop, **kernels)
  d_decay = None
  if decay is not None and split:
    d_decay = gate_vjp(dg)[0]
  elif decay is not None:  # the state decay's share of dg, at each chunk's last row: e^{g_C} sum_e G_n S_n
    b, h, n, dp = *qp.shape[:1], qp.shape[2], qp.shape[1] // c, qp.shape[-1]
    d_state_decay = gates_.state_decay[..., 0] * jnp.sum(states.astype(_F32) * d_next.astype(_F32), axis=-1)
    d_state_decay = d_state_decay.reshape(b, h, n, dp)
    dg = dg.reshape(b, h, n, c, *dg.shape[3:])
    dg = dg.at[:, :, :, -1].add(d_state_decay if dg.ndim == 5 else jnp.sum(d_state_decay, axis=-1))
    d_decay = gate_vjp(dg.reshape(b, h, n * c, *dg.shape[4:]))[0]
  if initial_state is not None:
    d_initial = d_initial[:, :, :d, :e]
  return (dq[:, :t, :, :d], dk[:, :t, :, :d], dv[:, :t, :, :e], jnp.moveaxis(d_beta[:, :, :t], 1, 2).astype(beta.dtype),
          d_decay, None if initial_state is None else d_initial)


def _channel_gated_backward(q, k, v, beta, decay, segment_starts, initial_state, do, d_final, *, scale,
                            config: DeltaConfig, interpret, chunk_terms, initial_cotangent_only, fallback):
  """`backward` for KDA's per-key-channel gates where the forward is warp-specialised (`config.warp_specialized`),
  at its 64-token chunks, where every 16-token block's decay is bounded
  (`pallas_mosaic_gpu.channel_spans_bounded`; else `fallback`, `backward`'s Triton one at 16-token chunks, a
  traced choice).

  Each chunk's T', T, P, Q_g, K_g, K_C and G, its S_n^T and U^T and its
  blocks' log decays come from the forward (chunk_terms, `backward`'s), or
  `pallas_mosaic_gpu.channel_gated_chunks` and `state_sweep` form them
  again as the forward did. The warp-specialised reverse sweep
  (`pallas_mosaic_gpu.state_cotangents` in its channel-gated mode: Q_g and P
  carry the scale, K_C the decay to the chunk's end, the state decays by
  2^{G_C} per key channel, W = T' K_g formed on chip) gives G_n^T and dU^T;
  then `tile_gradients(channel_gates=G, transposed=True)` every chunk's
  cotangents, and the rates' is the vjp of their chunk-local sums. Packed
  rows: the pair terms of one segment alone, and the rows that reach past a
  segment's ends dropped (`pallas_mosaic_gpu.mask_channel_gated_chunks`; the
  forward's sweep drops them itself), and the tile kernel's cotangents the same.
  """
  b, t, h, d = q.shape
  e = v.shape[-1]
  c = WarpSpecializedConfig.CHUNK_SIZE
  tp = -(-t // c) * c
  dp, ep = WarpSpecializedConfig.padded_dims(d, e)
  pad = lambda x, dim: chunk_common.pad_tokens_and_features(x, num_tokens=tp, dim=dim)  # noqa: E731
  transpose = lambda x: None if x is None else jnp.swapaxes(x, -1, -2)  # noqa: E731
  qp, kp, vp = pad(q, dp), pad(k, dp), pad(v, ep)
  beta_rows = warp_specialized_forward.beta_rows(beta, tp=tp)
  runs = warp_specialized_forward.segment_runs(segment_starts, num_tokens=tp)
  kept_states = None
  if chunk_terms is None:  # formed again, as the forward formed them, with the block ends the choice below takes
    terms = pallas_mosaic_gpu.channel_gated_chunks(qp, kp, beta_rows, pad(decay.astype(_F32), dp), scale=scale,
                                                   runs=runs, with_backward_terms=True, interpret=interpret)
  else:  # the forward's, whose block ends it also kept where its Triton fallback ran
    terms = pallas_mosaic_gpu.ChannelGatedChunks(*chunk_terms[:-3], block_ends=chunk_terms[-1])
    kept_states = chunk_terms[-3:-1]
  block_ends = terms.block_ends

  def on_chunk_terms():
    # Packed, the forward's sweep dropped the rows of Q_g, K_g and K_C that reach past a segment's ends itself; here
    # XLA does.
    masked = pallas_mosaic_gpu.mask_channel_gated_chunks(terms, runs)
    channel_decay = pallas_mosaic_gpu.channel_state_decay(block_ends, runs)  # 2^G_C [B, H, N, 1, Dp]
    dop = chunk_common.pad_tokens_and_features(do.astype(q.dtype), num_tokens=tp, dim=ep)
    reverse_sweep = functools.partial(
        pallas_mosaic_gpu.state_cotangents, masked.queries, masked.keys_to_end, masked.inverse, dop, (None, None),
        transpose(chunk_common.pad_state(d_final, dp, ep)), scale=1.0, interpret=interpret,
        channel_gates=(masked.keys, masked.pairs, channel_decay))
    if initial_cotangent_only:
      return transpose(reverse_sweep(initial_only=True))[:, :, :d, :e]
    d_next_t, d_initial_t, du_t = reverse_sweep()
    states_t, values_t = kept_states or pallas_mosaic_gpu.state_sweep(
        masked.keys, vp, masked.inverse, (None, None), transpose(chunk_common.pad_state(initial_state, dp, ep)),
        channel_gates=(masked.keys_to_end, masked.pairs, channel_decay), interpret=interpret)
    dq, dk, dv, d_beta, dg = tile_gradients(qp, kp, vp, beta_rows, Gates(None, runs, None), masked.unscaled_inverse,
                                            states_t, d_next_t, values_t, du_t, dop, scale=scale,
                                            config=dataclasses.replace(config, chunk_size=c), interpret=interpret,
                                            transposed=True, channel_gates=masked.gates)
    # The vjp of the rates' chunk-local sums g = -cumsum(min(rates, MAX_RATE)): every rate here is below
    # chunk.MAX_RATE (a 16-token block decays by at most the span bound), so the clamp passes each gradient whole.
    d_rates = chunk.chunk_sums_to_end(dg, chunk_size=c, sign=-1.0)
    return (dq[:, :t, :, :d], dk[:, :t, :, :d], dv[:, :t, :, :e],
            jnp.moveaxis(d_beta[:, :, :t], 1, 2).astype(beta.dtype), d_rates[:, :t, :, :d].astype(decay.dtype),
            None if initial_state is None else transpose(d_initial_t)[:, :, :d, :e])

  return jax.lax.cond(pallas_mosaic_gpu.channel_spans_bounded(block_ends, q.dtype), on_chunk_terms, fallback)
