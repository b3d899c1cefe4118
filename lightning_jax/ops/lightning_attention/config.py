"""Block configurations of the Pallas kernels, chosen per device.

One frozen, keyword-only dataclass per kernel; `LightningConfig` bundles them
for the `config=` argument. Every field left `None` is filled by the heuristics
of this module, which pick blocks by compute capability so that each kernel's
shared-memory estimate stays within the device's per-block budget.

Kernel "dims" below are those of one sweep: `dim_k` is the feature dim of the
query/key-like operands (the state's rows), `dim_v` the value-like dim (its
columns). The backward pass runs sweeps with the roles of D and E swapped, so
block sizes are clipped to the dims of each sweep.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

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


def shared_memory_budget(compute_capability: tuple[int, int] | None) -> int:
  if compute_capability is None:
    return SAFE_SHARED_MEMORY_BUDGET
  return SHARED_MEMORY_BUDGET.get(tuple(compute_capability), SAFE_SHARED_MEMORY_BUDGET)


def _check_pow2(name: str, value: int, lo: int, hi: int):
  if not isinstance(value, int) or isinstance(value, bool) or value < lo or value > hi or value & (value - 1):
    raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _LaunchConfig:
  """Fields every kernel has; validates those of subclasses too."""
  num_warps: int
  num_stages: int

  def __post_init__(self):
    for name in ("chunk_size", "block_d", "block_e"):
      if hasattr(self, name):
        _check_pow2(name, getattr(self, name), MIN_BLOCK, 256)
    _check_pow2("num_warps", self.num_warps, 1, 16)
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkLoopConfig(_LaunchConfig):
  """`variant="chunk_loop"`: one program per (batch, head, value block) walks all chunks.

  Attributes:
    chunk_size: tokens per chunk (the intra-chunk attention is chunk_size^2).
    block_e: value columns per program; the state tile is [dim_k, block_e].
    num_warps, num_stages: Triton launch parameters.
  """
  chunk_size: int
  block_e: int

  def shared_memory_bytes(self, dim_k: int, dim_v: int, itemsize: int, job: str = "forward") -> int:
    c, be = self.chunk_size, min(self.block_e, dim_v)
    extra = int(job in ("tangent", "dual"))  # the tangent weights, or the dual's u
    # Pipelined loads (x, y, z and the extra input), then a margin for the
    # operands produced in registers and re-laid out for the dots or the store
    # (a second score tile for the dual output). On an H100 Triton asked for the
    # pipelined loads alone (benchmarks/PERFORMANCE.md, item 6).
    staged = self.num_stages * (2 * c * dim_k + (1 + extra) * c * be)
    return itemsize * (staged + (1 + (job == "dual")) * c * c + dim_k * be + c * dim_k + c * be)

  def accumulator_registers(self, dim_k: int, dim_v: int, job: str = "forward") -> int:
    """float32 registers per thread for the carried state(s), score tile(s) and output tile(s).

    Triton keeps these in registers; past about 160 of a thread's 255 the
    kernel spills.
    """
    c, be = self.chunk_size, min(self.block_e, dim_v)
    words = (dim_k * be * (1 + (job == "tangent")) + c * c * (1 + (job == "dual")) + c * be
             + (c * dim_k if job == "dual" else 0))
    return words // (32 * self.num_warps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkStatesConfig(_LaunchConfig):
  """`variant="parallel"`, pass 1: materialise the state before every chunk.

  One program per (batch, head, key block, value block) sweeps the chunks; the
  chunk size is `ChunkOutputConfig.chunk_size`.
  """
  block_d: int
  block_e: int

  def shared_memory_bytes(self, dim_k: int, dim_v: int, itemsize: int, chunk_size: int) -> int:
    bd, be = min(self.block_d, dim_k), min(self.block_e, dim_v)
    return itemsize * (self.num_stages * chunk_size * (bd + be) + chunk_size * bd)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkOutputConfig(_LaunchConfig):
  """`variant="parallel"`, pass 2: every (batch, head, chunk, value block) in parallel."""
  chunk_size: int
  block_e: int

  def shared_memory_bytes(self, dim_k: int, dim_v: int, itemsize: int, job: str = "forward") -> int:
    c, be = self.chunk_size, min(self.block_e, dim_v)
    extra = int(job in ("tangent", "dual"))
    return itemsize * (2 * c * dim_k + (2 + extra) * c * be + (1 + (job == "dual")) * c * c + dim_k * be)

  def accumulator_registers(self, dim_k: int, dim_v: int, job: str = "forward") -> int:
    """float32 registers per thread for the score tile(s) and output tile(s) (see ChunkLoopConfig)."""
    c, be = self.chunk_size, min(self.block_e, dim_v)
    words = c * c * (1 + (job == "dual")) + c * be * (1 + (job == "tangent")) + (c * dim_k if job == "dual" else 0)
    return words // (32 * self.num_warps)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarpSpecializedConfig:
  """`variant="warp_specialized"`: the Mosaic GPU forward (sm90), see `mosaic_gpu_forward`.

  One CTA per (batch, head, 64 value columns) walks chunks of 64 tokens; its
  memory warpgroup keeps `num_stages` chunks of q, k, v in flight.
  """
  num_stages: int

  CHUNK_SIZE: ClassVar[int] = 64
  BLOCK_E: ClassVar[int] = 64
  # wgmma exists on sm90 alone (sm100 has tcgen05 instead).
  COMPUTE_CAPABILITY: ClassVar[tuple[int, int]] = (9, 0)

  def __post_init__(self):
    if not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool) or self.num_stages < 1:
      raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")

  def shared_memory_bytes(self, dim_k: int, itemsize: int) -> int:
    """The load ring, the published states (x2), the staged scores, key-scaled v and outputs (x2), the factors.

    The float32 initial/final state shares the published states' memory (the
    same bytes at 16 bits).
    """
    c, be = self.CHUNK_SIZE, self.BLOCK_E
    ring = self.num_stages * c * (2 * dim_k + be)
    staged = 2 * be * dim_k + 2 * c * c + 2 * c * be
    return itemsize * (ring + staged) + 4 * (c * c + 5 * c)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LightningConfig:
  """Explicit kernel configuration for `lightning_attention(config=...)`.

  Fields left None are chosen by the per-device heuristics.
  """
  chunk_loop: ChunkLoopConfig | None = None
  chunk_states: ChunkStatesConfig | None = None
  chunk_output: ChunkOutputConfig | None = None
  warp_specialized: WarpSpecializedConfig | None = None

  def __post_init__(self):
    for name, cls in (("chunk_loop", ChunkLoopConfig), ("chunk_states", ChunkStatesConfig),
                      ("chunk_output", ChunkOutputConfig), ("warp_specialized", WarpSpecializedConfig)):
      value = getattr(self, name)
      if value is not None and not isinstance(value, cls):
        raise TypeError(f"LightningConfig.{name} must be a {cls.__name__} or None, got {type(value).__name__}")


SWEEP_JOBS = ("forward", "tangent", "dual")


def sweep_job(*, tangent: bool, dual: bool) -> str:
  """The kind of sweep, for the heuristics: plain, carrying the decay tangent, or with the dual output."""
  if tangent and dual:
    raise ValueError("a sweep computes the decay tangent or the dual output, not both")
  return "tangent" if tangent else "dual" if dual else "forward"


def padded_dim(dim: int) -> int:
  """Feature dims are padded to a power of two >= 16 for Triton's dots."""
  return max(MIN_BLOCK, 1 << (dim - 1).bit_length())


# The heuristics below follow `python -m benchmarks.tune` on an H100 (bf16, T 8K,
# D = E = 64 and 128; the numbers are in benchmarks/PERFORMANCE.md): chunks of
# 64 tokens, 4 warps and the deepest software pipeline that fits the shared
# memory beat every other shape of the chunk_loop kernel, by up to 2x over a
# 2-stage pipeline; the decay-tangent sweep prefers 32 value columns per program
# (twice the programs, half the carried state). Devices with less shared memory
# get shallower pipelines or smaller blocks from the same preference order.
MAX_ACCUMULATOR_REGISTERS = 160
MAX_STAGES = {"forward": 4, "tangent": 3, "dual": 3}


def fuse_dk_dv(*, dim_k: int, dim_v: int) -> bool:
  """Whether the backward pass computes dk as the dual output of the dv sweep.

  It saves one pass over q, k, v, do, but holds two score tiles and two
  output tiles per chunk. On an H100 the fused sweep is 1.2-1.5x faster than
  two sweeps at D = E = 64, and 2x slower at 128, where it spills.
  """
  return dim_k <= 64 and dim_v <= 64


def default_chunk_loop(dim_k: int, dim_v: int, itemsize: int, budget: int, job: str = "forward") -> ChunkLoopConfig:
  block_es = (32, 16) if job == "tangent" else (64, 32, 16)
  for chunk_size in (64, 32, 16):
    for pipelined in (True, False):
      for block_e in block_es:
        for stages in range(MAX_STAGES[job], 1, -1) if pipelined else (1,):
          for warps in (4, 8):
            cfg = ChunkLoopConfig(chunk_size=chunk_size, block_e=min(block_e, dim_v), num_warps=warps,
                                  num_stages=stages)
            if (cfg.accumulator_registers(dim_k, dim_v, job) <= MAX_ACCUMULATOR_REGISTERS
                and cfg.shared_memory_bytes(dim_k, dim_v, itemsize, job) <= budget):
              return cfg
  raise AssertionError("unreachable: the smallest chunk_loop config fits every budget")


def default_chunk_output(dim_k: int, dim_v: int, itemsize: int, budget: int,
                         job: str = "forward") -> ChunkOutputConfig:
  # Chunks of 128 halve the float32 states the states kernel writes.
  for chunk_size in (128, 64, 32, 16):
    for block_e in (128, 64, 32, 16):
      for warps in (4, 8):
        cfg = ChunkOutputConfig(chunk_size=chunk_size, block_e=min(block_e, dim_v), num_warps=warps,
                                num_stages=1)
        if (cfg.accumulator_registers(dim_k, dim_v, job) <= MAX_ACCUMULATOR_REGISTERS
            and cfg.shared_memory_bytes(dim_k, dim_v, itemsize, job) <= budget):
          return cfg
  raise AssertionError("unreachable: the smallest chunk_output config fits every budget")


def default_chunk_states(dim_k: int, dim_v: int, itemsize: int, budget: int, chunk_size: int) -> ChunkStatesConfig:
  for block in (64, 32, 16):
    bd, be = min(block, dim_k), min(block, dim_v)
    for stages in (3, 2, 1):
      cfg = ChunkStatesConfig(block_d=bd, block_e=be, num_warps=4, num_stages=stages)
      if cfg.shared_memory_bytes(dim_k, dim_v, itemsize, chunk_size) <= budget:
        return cfg
  raise AssertionError("unreachable: the smallest chunk_states config fits every budget")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepConfigs:
  """The resolved configs of one sweep (dims already padded and clipped)."""
  chunk_loop: ChunkLoopConfig
  chunk_states: ChunkStatesConfig
  chunk_output: ChunkOutputConfig


def _clip(cfg, **maxima):
  changes = {f: min(getattr(cfg, f), m) for f, m in maxima.items()}
  return dataclasses.replace(cfg, **changes)


def _check_budget(name, cfg, cost, *, budget, compute_capability, dims, origin="config."):
  """`cfg` if its shared-memory `cost` fits `budget`, else a ValueError naming both and `cfg`'s origin."""
  if cost > budget:
    where = (f"compute capability {compute_capability[0]}.{compute_capability[1]}"
             if compute_capability else "an unknown device")
    raise ValueError(
        f"{origin}{name}={cfg} needs about {cost} bytes of shared memory for dims ({dims}), over the "
        f"{budget}-byte per-block budget of {where}; use a smaller chunk_size, block or num_stages")
  return cfg


def resolve(config: LightningConfig | None, *, dim_k: int, dim_v: int, itemsize: int,
            compute_capability: tuple[int, int] | None, job: str = "forward") -> SweepConfigs:
  """Fills the unset fields of `config` for one sweep and checks the budget.

  `dim_k`, `dim_v` are padded dims (powers of two >= 16); `job` one of
  `SWEEP_JOBS` (see `sweep_job`). A kernel's config is the one set in
  `config`, else the active tuning cache's for this sweep (consulted at trace
  time, see `tuning_cache`), else the heuristics'.
  """
  from lightning_jax.ops.lightning_attention import tuning_cache  # noqa: PLC0415 -- it imports this module

  if job not in SWEEP_JOBS:
    raise ValueError(f"job must be one of {SWEEP_JOBS}, got {job!r}")
  config, origins = tuning_cache.fill_from_cache(config or LightningConfig(), compute_capability=compute_capability,
                                                 job=job, dim_k=dim_k, dim_v=dim_v, itemsize=itemsize)
  budget = shared_memory_budget(compute_capability)
  check = functools.partial(_check_budget, budget=budget, compute_capability=compute_capability,
                            dims=f"dim_k={dim_k}, dim_v={dim_v}, itemsize={itemsize}")

  loop = config.chunk_loop
  loop = (default_chunk_loop(dim_k, dim_v, itemsize, budget, job) if loop is None
          else check("chunk_loop", _clip(loop, block_e=dim_v),
                     _clip(loop, block_e=dim_v).shared_memory_bytes(dim_k, dim_v, itemsize, job),
                     origin=origins["chunk_loop"]))
  out = config.chunk_output
  out = (default_chunk_output(dim_k, dim_v, itemsize, budget, job) if out is None
         else check("chunk_output", _clip(out, block_e=dim_v),
                    _clip(out, block_e=dim_v).shared_memory_bytes(dim_k, dim_v, itemsize, job),
                    origin=origins["chunk_output"]))
  states = config.chunk_states
  if states is None:
    states = default_chunk_states(dim_k, dim_v, itemsize, budget, out.chunk_size)
  else:
    states = _clip(states, block_d=dim_k, block_e=dim_v)
    check("chunk_states", states, states.shared_memory_bytes(dim_k, dim_v, itemsize, out.chunk_size),
          origin=origins["chunk_states"])
  return SweepConfigs(chunk_loop=loop, chunk_states=states, chunk_output=out)


def choose_variant(*, batch: int, heads: int, seq_len: int, dim_v: int, block_e: int, num_sms: int) -> str:
  """`variant="auto"`: the parallel variant when the chunk_loop grid cannot fill the device.

  chunk_loop runs batch*heads*ceil(dim_v/block_e) programs, each walking
  seq_len/chunk_size chunks in order; with far fewer programs than SMs most of
  the chip idles while they walk, and materialising chunk states (an extra
  float32 round trip through HBM) buys parallelism. Measured on an H100 (132
  SMs, bf16, T 8K-16K): 8 programs favour parallel by 2x, 128 favour chunk_loop
  by 1.4-1.8x; the threshold sits between.
  """
  programs = batch * heads * math.ceil(dim_v / block_e)
  return "parallel" if 2 * programs <= num_sms and seq_len >= 1024 else "chunk_loop"


def prefer_warp_specialized(*, dim_k: int) -> bool:
  """Whether `variant="auto"` takes the warp-specialised forward over chunk_loop (where both can run).

  On an H100 (bf16, B2 H32 D128 and B4 H32 D64, T 8K and 32K, side by side in
  one process; benchmarks/PERFORMANCE.md, item 13) it took 8-10% less time
  than chunk_loop at D = 128 and T = 32K and tied at 8K (-3% to +1%); at
  D = 64 it was 2-11% slower.
  """
  return dim_k > 64


# Deeper rings than 4 chunks bought nothing in the chunk_loop kernel (MAX_STAGES).
MAX_WARP_SPECIALIZED_STAGES = 4


def resolve_warp_specialized(config: LightningConfig | None, *, dim_k: int, itemsize: int) -> WarpSpecializedConfig:
  """The `warp_specialized` config: the user's (checked against the budget) or the deepest ring that fits.

  The kernel runs on sm90 alone (also when interpreted), so the budget is sm90's.
  """
  budget = shared_memory_budget(WarpSpecializedConfig.COMPUTE_CAPABILITY)
  cfg = config.warp_specialized if config is not None else None
  if cfg is not None:
    return _check_budget("warp_specialized", cfg, cfg.shared_memory_bytes(dim_k, itemsize), budget=budget,
                         compute_capability=WarpSpecializedConfig.COMPUTE_CAPABILITY,
                         dims=f"dim_k={dim_k}, itemsize={itemsize}")
  for stages in range(MAX_WARP_SPECIALIZED_STAGES, 0, -1):
    cfg = WarpSpecializedConfig(num_stages=stages)
    if cfg.shared_memory_bytes(dim_k, itemsize) <= budget:
      return cfg
  raise AssertionError("unreachable: one stage fits sm90 at every dim_k <= 128")
