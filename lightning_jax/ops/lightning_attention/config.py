"""Block configurations of the Pallas kernels and their resource models.

One frozen, keyword-only dataclass per kernel; `LightningConfig` bundles them
for the `config=` argument. Each kernel config estimates what it costs a sweep
(`shared_memory_bytes(sweep)`, and for the Triton kernels that keep tiles in
registers, `accumulator_registers(sweep)`); `heuristics` picks configs whose
cost fits the device. This module imports nothing else of the package.

A sweep's dims (`SweepShape`): `dim_k` is the feature dim of the query/key-like
operands (the state's rows), `dim_v` the value-like dim (its columns). The
backward pass runs sweeps with the roles of D and E swapped, so block sizes are
clipped to the dims of each sweep.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

# Opt-in shared memory per thread block, in bytes, by compute capability.
_KIB = 1024
SHARED_MEMORY_BUDGET = {
    (8, 0): 163 * _KIB,  # A100
    (8, 6): 99 * _KIB,  # RTX 30xx, A10, A40
    (8, 9): 99 * _KIB,  # RTX 40xx, L4, L40
    (9, 0): 227 * _KIB,  # H100, H200
    (10, 0): 227 * _KIB,  # B200
    (12, 0): 99 * _KIB,  # RTX 50xx: the 101,376-byte opt-in limit
}
# Unknown (newer or rarer) devices get the smallest budget above.
SAFE_SHARED_MEMORY_BUDGET = min(SHARED_MEMORY_BUDGET.values())
MIN_COMPUTE_CAPABILITY = (8, 0)
# Triton's matrix instructions need every dot dimension >= 16.
MIN_BLOCK = 16
# What a sweep computes beside its outputs: nothing more ("forward"), the decay
# tangent ("tangent", the dq sweep of a differentiated decay) or the dual output
# ("dual", dk beside dv).
SWEEP_JOBS = ("forward", "tangent", "dual")


def shared_memory_budget(compute_capability: tuple[int, int] | None) -> int:
  if compute_capability is None:
    return SAFE_SHARED_MEMORY_BUDGET
  return SHARED_MEMORY_BUDGET.get(tuple(compute_capability), SAFE_SHARED_MEMORY_BUDGET)


def padded_dim(dim: int) -> int:
  """Feature dims are padded to a power of two >= 16 for Triton's dots."""
  return max(MIN_BLOCK, 1 << (dim - 1).bit_length())


def sweep_job(*, tangent: bool, dual: bool) -> str:
  """The `SWEEP_JOBS` entry of a sweep: plain, carrying the decay tangent, or with the dual output."""
  if tangent and dual:
    raise ValueError("a sweep computes the decay tangent or the dual output, not both")
  return "tangent" if tangent else "dual" if dual else "forward"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepShape:
  """What a kernel config's cost depends on.

  Attributes:
    dim_k, dim_v: the sweep's padded feature dims (see `padded_dim`).
    itemsize: bytes per input element (2 or 4).
    job: one of `SWEEP_JOBS`.
    chunk_size: the chunk the parallel variant's states kernel walks in, set by
      its output kernel's config (None where no such pairing applies).
  """
  dim_k: int
  dim_v: int
  itemsize: int
  job: str = "forward"
  chunk_size: int | None = None

  def __post_init__(self):
    if self.job not in SWEEP_JOBS:
      raise ValueError(f"job must be one of {SWEEP_JOBS}, got {self.job!r}")

  def describe(self) -> str:
    return f"dim_k={self.dim_k}, dim_v={self.dim_v}, itemsize={self.itemsize}"


def is_int(x) -> bool:
  """Whether x is a Python int and not a bool (the configs' integer fields)."""
  return isinstance(x, int) and not isinstance(x, bool)


def _check_pow2(name: str, value: int, lo: int, hi: int):
  if not is_int(value) or value < lo or value > hi or value & (value - 1):
    raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {value!r}")


def _check_stages(num_stages):
  if not is_int(num_stages) or num_stages < 1:
    raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _TritonConfig:
  """Fields every Triton kernel has; validates those of subclasses too."""
  num_warps: int
  num_stages: int

  def __post_init__(self):
    for name in ("chunk_size", "block_d", "block_e"):
      if hasattr(self, name):
        _check_pow2(name, getattr(self, name), MIN_BLOCK, 256)
    _check_pow2("num_warps", self.num_warps, 1, 16)
    _check_stages(self.num_stages)

  def clipped(self, sweep: SweepShape):
    """This config with its blocks clipped to the sweep's dims (a block wider than its dim means the dim)."""
    maxima = {"block_d": sweep.dim_k, "block_e": sweep.dim_v}
    return dataclasses.replace(self, **{f: min(getattr(self, f), m) for f, m in maxima.items() if hasattr(self, f)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkLoopConfig(_TritonConfig):
  """`variant="chunk_loop"`: one program per (batch, head, value block) walks all chunks.

  Attributes:
    chunk_size: tokens per chunk (the intra-chunk attention is chunk_size^2).
    block_e: value columns per program; the state tile is [dim_k, block_e].
    num_warps, num_stages: Triton launch parameters.
  """
  chunk_size: int
  block_e: int

  def shared_memory_bytes(self, sweep: SweepShape) -> int:
    c, be, dim_k, job = self.chunk_size, min(self.block_e, sweep.dim_v), sweep.dim_k, sweep.job
    extra = int(job in ("tangent", "dual"))  # the tangent weights, or the dual's u
    # Pipelined loads (x, y, z and the extra input), then a margin for the
    # operands produced in registers and re-laid out for the dots or the store
    # (a second score tile for the dual output). On an H100 Triton asked for the
    # pipelined loads alone (benchmarks/PERFORMANCE.md, "Block heuristics and
    # shared-memory model").
    staged = self.num_stages * (2 * c * dim_k + (1 + extra) * c * be)
    return sweep.itemsize * (staged + (1 + (job == "dual")) * c * c + dim_k * be + c * dim_k + c * be)

  def accumulator_registers(self, sweep: SweepShape) -> int:
    """float32 registers per thread for the carried state(s), score tile(s) and output tile(s).

    Triton keeps these in registers; past about 160 of a thread's 255 the
    kernel spills.
    """
    c, be, dim_k, job = self.chunk_size, min(self.block_e, sweep.dim_v), sweep.dim_k, sweep.job
    words = (dim_k * be * (1 + (job == "tangent")) + c * c * (1 + (job == "dual")) + c * be
             + (c * dim_k if job == "dual" else 0))
    return words // (32 * self.num_warps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkStatesConfig(_TritonConfig):
  """`variant="parallel"`, pass 1: materialise the state before every chunk.

  One program per (batch, head, key block, value block) sweeps the chunks; the
  chunk size is `ChunkOutputConfig.chunk_size` (`SweepShape.chunk_size`).
  """
  block_d: int
  block_e: int

  def shared_memory_bytes(self, sweep: SweepShape) -> int:
    if sweep.chunk_size is None:
      raise ValueError("the chunk_states kernel's cost needs the sweep's chunk_size (the chunk_output config's)")
    bd, be, c = min(self.block_d, sweep.dim_k), min(self.block_e, sweep.dim_v), sweep.chunk_size
    return sweep.itemsize * (self.num_stages * c * (bd + be) + c * bd)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkOutputConfig(_TritonConfig):
  """`variant="parallel"`, pass 2: every (batch, head, chunk, value block) in parallel."""
  chunk_size: int
  block_e: int

  def shared_memory_bytes(self, sweep: SweepShape) -> int:
    c, be, dim_k, job = self.chunk_size, min(self.block_e, sweep.dim_v), sweep.dim_k, sweep.job
    extra = int(job in ("tangent", "dual"))
    # The tangent job reads a second [dim_k, be] state, the decay tangent's: without it the model fell 45,056
    # bytes short of Triton's allocation on sm80 (float32, D256; benchmarks/tuning/lightning-shared-memory.json).
    states = 1 + (job == "tangent")
    return sweep.itemsize * (2 * c * dim_k + (2 + extra) * c * be + (1 + (job == "dual")) * c * c
                             + states * dim_k * be)

  def accumulator_registers(self, sweep: SweepShape) -> int:
    """float32 registers per thread for the score tile(s) and output tile(s) (see ChunkLoopConfig)."""
    c, be, dim_k, job = self.chunk_size, min(self.block_e, sweep.dim_v), sweep.dim_k, sweep.job
    words = c * c * (1 + (job == "dual")) + c * be * (1 + (job == "tangent")) + (c * dim_k if job == "dual" else 0)
    return words // (32 * self.num_warps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarpSpecializedConfig:
  """`variant="warp_specialized"`: the Mosaic GPU forward (sm90), see `pallas_mosaic_gpu`.

  One CTA per (batch, head, 64 value columns) walks chunks of 64 tokens; its
  memory warpgroup keeps `num_stages` chunks of q, k, v in flight, and its
  state chain may publish `published_states` states (2 or 3) ahead of the
  output warpgroup: three let it run one chunk further ahead than two
  (PERFORMANCE.md, "Per-token decay and packed sequences", change 9). The class
  constants say where the kernel runs (`heuristics.warp_specialized_unsupported`).
  """
  num_stages: int
  published_states: int = 3

  CHUNK_SIZE: ClassVar[int] = 64
  BLOCK_E: ClassVar[int] = 64
  # Mosaic GPU's TMA copies of the swizzled tiles tile a GMEM operand's rows by 8 (it refuses other row counts): an
  # operand walked unpadded (T rows, its last tile reading zeros past them) needs T a multiple of it, else a copy.
  TMA_ROWS: ClassVar[int] = 8
  # wgmma exists on sm90 alone (sm100 has tcgen05 instead).
  COMPUTE_CAPABILITY: ClassVar[tuple[int, int]] = (9, 0)
  MAX_DIM_K: ClassVar[int] = 128
  MAX_DIM_V: ClassVar[int] = 256
  DTYPES: ClassVar[tuple] = (jnp.bfloat16, jnp.float16)
  # Older JAX cannot lower the kernel (its Mosaic GPU layout inference finds no
  # layouts) and has no GPU interpreter.
  MIN_JAX: ClassVar[tuple[int, int]] = (0, 11)

  def __post_init__(self):
    _check_stages(self.num_stages)
    if self.published_states not in (2, 3):  # True and False compare as 1 and 0: rejected too
      raise ValueError(f"published_states must be 2 or 3, got {self.published_states!r}")

  @classmethod
  def tiles_rows(cls, num_rows: int) -> bool:
    """Whether TMA tiles an operand of `num_rows` rows as it is (a multiple of `TMA_ROWS`)."""
    return num_rows % cls.TMA_ROWS == 0

  @classmethod
  def walked_rows(cls, num_tokens: int, padded_tokens: int) -> int:
    """The rows the kernels take a T-token operand with: T where TMA tiles it (no copy: the kernels read zeros past
    it), else `padded_tokens` (whole chunks or slices: a copy either way)."""
    return num_tokens if cls.tiles_rows(num_tokens) else padded_tokens

  @classmethod
  def takes_rows(cls, num_rows: int, padded_tokens: int) -> bool:
    """Whether the kernels take an operand of `num_rows` rows for `padded_tokens` (Tp): Tp itself, or fewer rows
    that TMA tiles (`walked_rows`' choices)."""
    return num_rows <= padded_tokens and cls.walked_rows(num_rows, padded_tokens) == num_rows

  @classmethod
  def padded_dims(cls, dim_k: int, dim_v: int) -> tuple[int, int]:
    """(K, V) the kernel runs at: K = 64 or 128, V a multiple of `BLOCK_E`."""
    return (64 if dim_k <= 64 else 128), -(-dim_v // cls.BLOCK_E) * cls.BLOCK_E

  def shared_memory_bytes(self, sweep: SweepShape, *, delta: bool = False, channel_gated: bool = False,
                         row_dots: bool = False) -> int:
    """The compiled kernel's: the load ring, the published states, the outputs (x2), the factors.

    With `delta` (the delta rule's mode): each chunk's inverse [C, C] in the
    ring and U^T [C, BLOCK_E] beside every published state, no staged operand;
    `channel_gated` (KDA's gates) also K_C [C, K], P [C, C] and the state's
    decay [K] float32 in the ring. `row_dots`: the output's row dots' weights
    [C, BLOCK_E] in the ring and two chunks' row dots [C] float32.

    The float32 initial/final state shares the published states' memory, and
    the [C, C] float32 factors the staged outputs' (read once before the first
    output). At K = 64 the scores and key-scaled v may be staged for wgmma
    (counted); at K = 128 they stay in registers (interpreted kernels stage
    them at every K: the interpreter has no shared-memory budget). The kernel's
    tiles are BLOCK_E values wide whatever `sweep.dim_v`. The factor rows: [5,
    C] float32 per head once or per chunk in every slot of the ring, and with
    packed sequences per head, two [C] segment-start rows per slot (counted
    here, the larger).
    """
    c, be, dim_k, itemsize = self.CHUNK_SIZE, self.BLOCK_E, sweep.dim_k, sweep.itemsize
    ring = self.num_stages * c * (2 * dim_k + be * (1 + row_dots) + (c if delta else 0)) * itemsize
    if channel_gated:
      ring += self.num_stages * (c * (dim_k + c) * itemsize + 4 * dim_k)
    published = self.published_states * be * (dim_k + (c if delta else 0)) * itemsize
    outputs_or_factors = max(2 * c * be * itemsize, 4 * c * c)
    staged_operands = (c * c + c * be) * itemsize if dim_k <= 64 and not delta else 0
    factor_rows = max(5 * self.num_stages, 5 + 2 * self.num_stages)
    return ring + published + outputs_or_factors + staged_operands + 4 * (factor_rows + 2 * row_dots) * c


@dataclasses.dataclass(frozen=True, kw_only=True)
class LightningConfig:
  """Explicit kernel configuration for `lightning_attention(config=...)`.

  Fields left None come from the active tuning cache, else the per-device
  heuristics.

  Attributes:
    chunk_loop, chunk_states, chunk_output, warp_specialized: the kernels'
      block configs (`chunk_states` also serves the sequence split's first
      pass).
    slice_size: tokens per slice of the sequence split (rounded up to whole
      chunks; see `heuristics.slice_chunks`): chunk_loop and warp_specialized
      sweeps run the slices of a sequence in parallel, each from the state
      before it. None: the heuristic, which splits only where (batch, head)
      programs alone leave the GPU idle; a value >= T: no split.
  """
  chunk_loop: ChunkLoopConfig | None = None
  chunk_states: ChunkStatesConfig | None = None
  chunk_output: ChunkOutputConfig | None = None
  warp_specialized: WarpSpecializedConfig | None = None
  slice_size: int | None = None

  def __post_init__(self):
    if self.slice_size is not None and (not is_int(self.slice_size) or self.slice_size < 1):
      raise ValueError(f"LightningConfig.slice_size must be None or an int >= 1 (tokens), got {self.slice_size!r}")
    for name, cls in (("chunk_loop", ChunkLoopConfig), ("chunk_states", ChunkStatesConfig),
                      ("chunk_output", ChunkOutputConfig), ("warp_specialized", WarpSpecializedConfig)):
      value = getattr(self, name)
      if value is not None and not isinstance(value, cls):
        raise TypeError(f"LightningConfig.{name} must be a {cls.__name__} or None, got {type(value).__name__}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepConfigs:
  """The resolved Triton configs of one sweep (dims already padded and clipped).

  `slice_states` is the states kernel at the chunk loop's chunk size: the
  first pass of a sequence split (`chunk_states` is at the output kernel's).
  """
  chunk_loop: ChunkLoopConfig
  chunk_states: ChunkStatesConfig
  chunk_output: ChunkOutputConfig
  slice_states: ChunkStatesConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasOptions:
  """The static options of one Pallas call, as the custom VJP and the kernels' wrappers take them.

  Attributes:
    scale: multiplies q.
    return_final_state: the forward pass also returns S_T.
    variant: "chunk_loop", "parallel" or "warp_specialized" (already chosen).
    config: the user's `LightningConfig` or None (resolved per sweep).
    compute_capability: of the device that runs the kernels, None for none.
    num_sms: that device's streaming multiprocessors (the sequence split
      fills them).
    interpret: run the kernels in Pallas interpret mode.
  """
  scale: float
  return_final_state: bool
  variant: str
  config: LightningConfig | None
  compute_capability: tuple[int, int] | None
  num_sms: int
  interpret: bool
