"""Kernel policy: which device runs what, with which blocks, in which variant.

Everything the Pallas path decides from the device and the shapes lives here:
the device of a call and its compute capability, the per-device default block
configs (filled in behind `config=` and the tuning cache by `resolve`), where
the warp-specialised forward can run, the `variant="auto"` choice and whether
the backward pass fuses dk into the dv sweep. The measurements behind each
choice are in benchmarks/PERFORMANCE.md, under the section each docstring
names.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import tuning_cache
from lightning_jax.ops.lightning_attention.config import (
    ChunkLoopConfig,
    ChunkOutputConfig,
    ChunkStatesConfig,
    LightningConfig,
    SweepConfigs,
    SweepShape,
    WarpSpecializedConfig,
)

# Measured on an H100 (132 SMs); a device that does not say its SM count is taken as one.
DEFAULT_NUM_SMS = 132


def device_of(*arrays) -> jax.Device:
  """The device the kernels of a call run on.

  The device of the first concrete array among `arrays` (the first of its
  devices if it is sharded); for traced arrays (under `jax.jit`) the default
  device, `jax.default_device` included.
  """
  for x in arrays:
    if x is not None and not isinstance(x, jax.core.Tracer) and hasattr(x, "devices"):
      return min(x.devices(), key=lambda device: device.id)
  default = jax.config.jax_default_device
  if isinstance(default, jax.Device):
    return default
  return jax.devices(default)[0] if isinstance(default, str) else jax.devices()[0]


def compute_capability(device: jax.Device) -> tuple[int, int] | None:
  """(major, minor) of an NVIDIA GPU device, else None."""
  cc = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or not cc:
    return None
  major, minor = str(cc).split(".")[:2]
  return int(major), int(minor)


def supported_gpu(cc: tuple[int, int] | None) -> bool:
  """Whether a device of compute capability `cc` (None: not an NVIDIA GPU) runs the Pallas kernels compiled."""
  return cc is not None and cc >= config_lib.MIN_COMPUTE_CAPABILITY


def num_sms(device: jax.Device) -> int:
  """The device's streaming multiprocessors (`DEFAULT_NUM_SMS` where it does not say)."""
  return getattr(device, "core_count", None) or DEFAULT_NUM_SMS


# The defaults below follow the autotuner (`python -m lightning_jax.tune`) on an
# H100 (bf16, T 8K, D = E = 64 and 128; PERFORMANCE.md, "Block heuristics and
# shared-memory model"): chunks of 64 tokens, 4 warps and the deepest software
# pipeline that fits the shared memory beat every other shape of the chunk_loop
# kernel (the forward 1.5x and 2.0x faster than the earlier defaults); the
# decay-tangent sweep prefers 32 value columns per program (twice the programs,
# half the carried state).
# Devices with less shared memory get shallower pipelines or smaller blocks from
# the same preference order.
MAX_ACCUMULATOR_REGISTERS = 160
MAX_STAGES = {"forward": 4, "tangent": 3, "dual": 3}
# The warp-specialised kernel's (num_stages, published_states), in order of preference: the deepest ring up to 4
# chunks (deeper rings bought nothing in the chunk_loop kernel, MAX_STAGES) with 3 published states; where that
# does not fit, a third published state before a fourth stage (no (4, 2)), and a third stage before a third state
# ((3, 2) before (2, 3)). H200, in-process forward: the lightning op at D128 3 stages and 3 states 2-3% faster
# than 4 and 2; the delta rule's at D128 3 stages and 2 states 1.5-2.5% faster than 2 and 3.
WARP_SPECIALIZED_PREFERENCE = ((4, 3), (3, 3), (3, 2), (2, 3), (2, 2), (1, 3), (1, 2))


def _fits(cfg, sweep: SweepShape, budget: int) -> bool:
  registers = getattr(cfg, "accumulator_registers", None)
  return (cfg.shared_memory_bytes(sweep) <= budget
          and (registers is None or registers(sweep) <= MAX_ACCUMULATOR_REGISTERS))


def default_chunk_loop(sweep: SweepShape, budget: int) -> ChunkLoopConfig:
  block_es = (32, 16) if sweep.job == "tangent" else (64, 32, 16)
  for chunk_size in (64, 32, 16):
    for pipelined in (True, False):
      for block_e in block_es:
        for stages in range(MAX_STAGES[sweep.job], 1, -1) if pipelined else (1,):
          for warps in (4, 8):
            cfg = ChunkLoopConfig(chunk_size=chunk_size, block_e=min(block_e, sweep.dim_v), num_warps=warps,
                                  num_stages=stages)
            if _fits(cfg, sweep, budget):
              return cfg
  raise AssertionError("unreachable: the smallest chunk_loop config fits every budget")


def default_chunk_output(sweep: SweepShape, budget: int) -> ChunkOutputConfig:
  # Chunks of 128 halve the float32 states the states kernel writes.
  for chunk_size in (128, 64, 32, 16):
    for block_e in (128, 64, 32, 16):
      for warps in (4, 8):
        cfg = ChunkOutputConfig(chunk_size=chunk_size, block_e=min(block_e, sweep.dim_v), num_warps=warps,
                                num_stages=1)
        if _fits(cfg, sweep, budget):
          return cfg
  raise AssertionError("unreachable: the smallest chunk_output config fits every budget")


def default_chunk_states(sweep: SweepShape, budget: int) -> ChunkStatesConfig:
  for block in (64, 32, 16):
    for stages in (3, 2, 1):
      cfg = ChunkStatesConfig(block_d=min(block, sweep.dim_k), block_e=min(block, sweep.dim_v), num_warps=4,
                              num_stages=stages)
      if _fits(cfg, sweep, budget):
        return cfg
  raise AssertionError("unreachable: the smallest chunk_states config fits every budget")


def default_slice_states(sweep: SweepShape, budget: int) -> ChunkStatesConfig:
  """The states pass of a sequence split and of sequence parallelism (each slice's own end state).

  A program per (key block, value block) reads its k columns once per value
  block and its v columns once per key block, so 64-wide blocks read a D = E =
  128 head's k and v twice each. Whole 128-wide blocks with 8 warps read them
  once: on an H100 (B1 H32 T128K D128 bf16, `benchmarks.sequence_pieces`) 0.72
  ms against 1.00 ms for 64 x 64 and 4 warps (0.91 with 2 stages, 0.76-0.79
  with 64 x 128 or 128 x 64). Dims up to 64 and the decay tangent's pass (two
  accumulators) keep the chunk_states order.
  """
  if sweep.job != "tangent" and max(sweep.dim_k, sweep.dim_v) > 64:
    for stages in (3, 2):
      cfg = ChunkStatesConfig(block_d=min(128, sweep.dim_k), block_e=min(128, sweep.dim_v), num_warps=8,
                              num_stages=stages)
      if _fits(cfg, sweep, budget):
        return cfg
  return default_chunk_states(sweep, budget)


def _check_budget(name, cfg, sweep: SweepShape, *, budget, compute_capability, origin="config.", **modes):
  """`cfg` if its shared memory (in the kernel's `modes`, keyword arguments of its `shared_memory_bytes`) fits
  `budget`, else a ValueError naming both and `cfg`'s origin."""
  cost = cfg.shared_memory_bytes(sweep, **modes)
  if cost > budget:
    where = (f"compute capability {compute_capability[0]}.{compute_capability[1]}"
             if compute_capability else "an unknown device")
    raise ValueError(
        f"{origin}{name}={cfg} needs about {cost} bytes of shared memory for dims ({sweep.describe()}), over the "
        f"{budget}-byte per-block budget of {where}; use a smaller chunk_size, block or num_stages")
  return cfg


def resolve(config: LightningConfig | None, *, dim_k: int, dim_v: int, itemsize: int,
            compute_capability: tuple[int, int] | None, job: str = "forward",
            split_chunk_size: int | None = None) -> SweepConfigs:
  """The Triton configs of one sweep: `config`'s fields, else the tuning cache's, else the defaults.

  `dim_k`, `dim_v` are padded dims (powers of two >= 16); `job` one of
  `config.SWEEP_JOBS` (see `config.sweep_job`); `split_chunk_size` the chunk
  of a sequence split's states pass (default: the chunk loop's; the
  warp-specialised forward's is its own). The active tuning cache is
  consulted at trace time (see `tuning_cache`). Set and cached configs are
  clipped to the dims and checked against the device's shared-memory budget.
  """
  sweep = SweepShape(dim_k=dim_k, dim_v=dim_v, itemsize=itemsize, job=job)
  config, origins = tuning_cache.fill_from_cache(config or LightningConfig(), compute_capability=compute_capability,
                                                 job=job, dim_k=dim_k, dim_v=dim_v, itemsize=itemsize)
  budget = config_lib.shared_memory_budget(compute_capability)

  def pick(name, default, sweep):
    cfg = getattr(config, name)
    if cfg is None:
      return default(sweep, budget)
    return _check_budget(name, cfg.clipped(sweep), sweep, budget=budget, compute_capability=compute_capability,
                         origin=origins[name])

  loop = pick("chunk_loop", default_chunk_loop, sweep)
  out = pick("chunk_output", default_chunk_output, sweep)
  states = pick("chunk_states", default_chunk_states, dataclasses.replace(sweep, chunk_size=out.chunk_size))
  slice_states = pick("chunk_states", default_slice_states,
                      dataclasses.replace(sweep, chunk_size=split_chunk_size or loop.chunk_size))
  return SweepConfigs(chunk_loop=loop, chunk_states=states, chunk_output=out, slice_states=slice_states)


# The sequence split (PERFORMANCE.md, "Sequence split"): a sweep whose
# (batch, head, value block) programs fill at most half the SMs runs slices of
# the sequence in parallel, SLICE_PROGRAMS_PER_SM programs per SM in all, each
# slice at least MIN_SLICE_CHUNKS chunks (shorter slices pay their state's
# round trip and the pipeline's fill for too few chunks). Measured on an H200
# (bf16, B*H 8-64, T 8K-128K): 2 programs per SM beat 1 and 4 for the
# backward sweeps at D = 64 and 128 and are within noise of 1 for the forward;
# splitting 128 programs in two lost 30%.
SLICE_PROGRAMS_PER_SM = 2
MIN_SLICE_CHUNKS = 8


def slice_chunks(*, programs: int, num_chunks: int, chunk_size: int, num_sms: int,
                 slice_size: int | None = None) -> int:
  """Chunks per slice of a chunk_loop or warp_specialized sweep; `num_chunks` means no split.

  Args:
    programs: the sweep's programs without a split (batch * heads * value blocks).
    num_chunks: chunks in the (padded) sequence.
    chunk_size: tokens per chunk.
    num_sms: the device's SMs.
    slice_size: `LightningConfig.slice_size` (tokens), overriding the heuristic.
  """
  if slice_size is not None:
    return min(num_chunks, -(-slice_size // chunk_size))
  slices = min(SLICE_PROGRAMS_PER_SM * num_sms // programs, num_chunks // MIN_SLICE_CHUNKS)
  if 2 * programs > num_sms or slices < 2:
    return num_chunks
  # Equal slices where a count down to half the target gives them: no shorter
  # last slice (whose programs finish early) and no padding to whole slices.
  for count in range(slices, (slices + 1) // 2 - 1, -1):
    if num_chunks % count == 0:
      return num_chunks // count
  return -(-num_chunks // slices)


def fuse_dk_dv(*, dim_k: int, dim_v: int) -> bool:
  """Whether the backward pass computes dk as the dual output of the dv sweep.

  It saves one pass over q, k, v, do, but holds two score tiles and two output
  tiles per chunk. On an H100 the fused sweep is 1.23x (with decay) and 1.37x
  (without) faster than two sweeps at D = E = 64, and 2x slower at 128, where it
  spills (PERFORMANCE.md, "Fused dk and dv sweep").
  """
  return dim_k <= 64 and dim_v <= 64


def branch_per_chunk(*, dual: bool) -> bool:
  """Whether a Triton sweep's chunks branch on their own gates (`chunk_common.token_decay_factors`).

  A branch per chunk computes per-token intra factors from 2C exp2 instead of
  C^2 where the chunk's rates allow, and masks segments only in a chunk where
  one starts. Its effect is the compiled loop's more than the work it skips:
  factorising every chunk without a branch changed no sweep by more than 1%.
  Measured (jax 0.11.2, per-token rates, fwd+bwd, T32K; ncu per kernel):
  with a branch the dq and dv sweeps at D = 128 (B2 H32, H100) took 19% less
  time (1335 -> 1078 and 1352 -> 1092 us) and the dk sweep 1% more; at D = 64
  (B4 H32, H200) the dq sweep less, but the fused dk/dv sweep 53% more
  (1103 -> 1686 us). Branching every sweep but the dual one: fwd+bwd 8.6% less
  at B4 H32 D64, 10.5% less at B2 H32 D128, 14% less with 8 packed sequences
  and a per-head rate at B1 H32 D128 (H200, in-process A/B; PERFORMANCE.md,
  "Per-token decay and packed sequences").
  """
  return not dual


def walked_segment_starts(num_steps):
  """The most chunks with a segment start that a packed row's Triton sweep program walks past (`pallas_triton._walk`);
  one with more loads and masks every chunk's segment counts instead. num_steps: its chunks (traced ok).

  Walked, a chunk where a segment starts runs apart, masked and unpipelined, and the plain chunks' loop restarts after
  it: about 3.5 chunks' time each; masking every chunk costs a program 9% of its chunks' time, so the two break even
  near one start per 40 chunks. Measured on an H200 (B1 H32 T32K D128, a per-head rate, 128-chunk programs, the
  backward's chunk loops, ms): no start 0.377-0.386 walked against 0.416-0.422 masked (unpacked 0.380-0.386); 1-2
  starts a program 0.404-0.411 against 0.415-0.422; 3 starts in two of four slices 0.413-0.422 against 0.416-0.421
  (PERFORMANCE.md, change 14 of "Per-token decay and packed sequences").
  """
  return num_steps // 40


# Devices on which a per-head rate at D <= 64 leaves chunk_loop's one program per
# SM latency-bound where the warp-specialised forward overlaps it: on an H200
# (bf16, 2026-11-26, `benchmarks/results/nvidia-h200-d64-variants`) WS took 11%
# less time at B4 H32 T 8K and 32K D64 with decay (128 CTAs on 132 SMs), and was
# within 1% (B8 H32, two waves) to 7% slower (split sequences) elsewhere; on an
# H100 it was 2-11% slower at B4 H32 and B2 H32.
WS_ONE_WAVE_DEVICE_KINDS = ("H200",)


def prefer_warp_specialized(*, dim_k: int, per_token: bool = False, per_head_decay: bool = False, programs: int = 0,
                            num_sms: int = DEFAULT_NUM_SMS, device_kind: str = "") -> bool:
  """Whether `variant="auto"` takes the warp-specialised forward over chunk_loop (where both can run).

  On an H100 (bf16, B2 H32 D128 and B4 H32 D64, T 8K and 32K; PERFORMANCE.md,
  "Warp-specialised forward (sm90)") it took 8-10% less time than chunk_loop at
  D = 128 and T = 32K and was within 4% at 8K; at D = 64 it was 2-11% slower
  with a per-head rate. With per-token rates or packed sequences (`per_token`)
  chunk_loop computes every chunk's factors in its one instruction stream, and
  the warp-specialised forward wins at D = 64 too (PERFORMANCE.md, "Per-token
  decay and packed sequences"). At D = 64 with a per-head rate it also wins on
  the devices of `WS_ONE_WAVE_DEVICE_KINDS` where its `programs` (batch * heads
  * 64-column value blocks) fill between half and all of the `num_sms` SMs: one
  program per SM, no sequence split.
  """
  if per_token or dim_k > 64:
    return True
  one_wave = num_sms // 2 < programs <= num_sms
  return per_head_decay and one_wave and any(kind in device_kind for kind in WS_ONE_WAVE_DEVICE_KINDS)


def jax_version() -> tuple[int, int]:
  return tuple(int(part) for part in jax.__version__.split(".")[:2])


def warp_specialized_unsupported(*, dim_k: int, dim_v: int, dtype, compute_capability: tuple[int, int] | None,
                                 interpret: bool) -> str | None:
  """Why the warp-specialised forward cannot run a call (None if it can); dims are the unpadded D and E."""
  ws = WarpSpecializedConfig
  if jax_version() < ws.MIN_JAX:
    return f"needs jax >= {ws.MIN_JAX[0]}.{ws.MIN_JAX[1]}, this is {jax.__version__}"
  if not interpret and compute_capability != ws.COMPUTE_CAPABILITY:
    return f"needs a compute capability 9.0 GPU (wgmma), this device has {compute_capability}"
  if not any(jnp.dtype(dtype) == d for d in ws.DTYPES):
    return f"needs bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
  if dim_k > ws.MAX_DIM_K or dim_v > ws.MAX_DIM_V:
    return f"needs D <= {ws.MAX_DIM_K} and E <= {ws.MAX_DIM_V}, got D={dim_k}, E={dim_v}"
  return None


def resolve_warp_specialized(config: LightningConfig | None, *, dim_k: int, itemsize: int,
                             delta: bool = False, channel_gated: bool = False,
                             row_dots: bool = False) -> WarpSpecializedConfig:
  """The `warp_specialized` config: the user's (checked against the budget) or the first of
  `WARP_SPECIALIZED_PREFERENCE` that fits.

  The kernel runs on sm90 alone (also when interpreted), so the budget is sm90's.
  `delta`, `channel_gated`: the delta rule's modes; `row_dots`: the output's row dots
  (`WarpSpecializedConfig.shared_memory_bytes`).
  """
  cc = WarpSpecializedConfig.COMPUTE_CAPABILITY
  budget = config_lib.shared_memory_budget(cc)
  sweep = SweepShape(dim_k=dim_k, dim_v=WarpSpecializedConfig.BLOCK_E, itemsize=itemsize)
  cfg = config.warp_specialized if config is not None else None
  modes = dict(delta=delta, channel_gated=channel_gated, row_dots=row_dots)
  if cfg is not None:
    return _check_budget("warp_specialized", cfg, sweep, budget=budget, compute_capability=cc, **modes)
  for stages, published in WARP_SPECIALIZED_PREFERENCE:
    cfg = WarpSpecializedConfig(num_stages=stages, published_states=published)
    if cfg.shared_memory_bytes(sweep, **modes) <= budget:
      return cfg
  raise AssertionError("unreachable: one stage fits sm90 at every dim_k <= 128")


def pallas_variant(variant: str, *, d: int, e: int, dtype, compute_capability: tuple[int, int] | None,
                   interpret: bool, per_token: bool = False, per_head_decay: bool = False, batch_heads: int = 0,
                   num_sms: int = DEFAULT_NUM_SMS, device_kind: str = "", seq_len: int | None = None) -> str:
  """The Pallas variant that runs: `variant`, checked, or the one "auto" picks for this call.

  `batch_heads` (B * H), `num_sms` and `device_kind` are the call's and its
  device's, for `prefer_warp_specialized`. seq_len: the call's T (None:
  unknown). Where TMA cannot tile T (`WarpSpecializedConfig.tiles_rows`)
  the warp-specialised forward copies q, k and v to whole chunks and o
  back (its TMA copies cannot tile T's rows), and chunk_loop, which masks
  its last chunk, took 1.5-2.5x less time (H200, bf16, per-head and
  per-token rates, B3 H12 T20001 D64 to B1 H16 T50001 D128;
  `results/nvidia-h200-odd-t-variants`): auto takes chunk_loop there.
  """
  ws_unsupported = warp_specialized_unsupported(dim_k=d, dim_v=e, dtype=dtype, compute_capability=compute_capability,
                                                interpret=interpret)
  if variant == "warp_specialized" and ws_unsupported:
    raise ValueError(f"variant='warp_specialized' {ws_unsupported}")
  if variant != "auto":
    return variant
  # Compiled only (its interpreter is for tests), and where it was measured faster.
  programs = batch_heads * -(-e // WarpSpecializedConfig.BLOCK_E)
  copies_t = seq_len is not None and not WarpSpecializedConfig.tiles_rows(seq_len)
  if not interpret and not ws_unsupported and not copies_t and prefer_warp_specialized(
      dim_k=d, per_token=per_token, per_head_decay=per_head_decay, programs=programs, num_sms=num_sms,
      device_kind=device_kind):
    return "warp_specialized"
  # With the sequence split filling the GPU where few (batch, head) programs
  # would not, chunk_loop beat parallel at every shape measured (PERFORMANCE.md,
  # "Variant choice").
  return "chunk_loop"
