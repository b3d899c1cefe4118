"""What the benchmark measures: implementations, shapes, profiles and jobs.

Pure Python (no JAX, no torch): the parent process and every worker import it.

A *job* is one implementation on one shape, dtype and decay setting; its worker
measures every requested mode of it and returns one result per mode. Jobs of
one *group* run in one subprocess, in the order of `make_jobs` (growing T).
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

MODES = ("fwd", "bwd", "fwdbwd")
DTYPE_ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
DECAYS = {"on": True, "off": False}
KINDS = ("ours", "baseline", "peer")


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation; `group` names the subprocess (worker module) that runs it."""
  name: str
  group: str
  kind: str  # "ours", "baseline" or "peer"
  decay_aware: bool  # False: decay does not apply (softmax attention)
  label: str


# Groups that need an NVIDIA GPU: skipped without starting a worker when the probe finds none.
GPU_ONLY_GROUPS = ("cudnn",)
# Groups in the order they run: ours last, so that they get the time the others leave.
GROUP_MODULES = {
    "cudnn": "benchmarks.jax_impls",
    "xla-softmax": "benchmarks.jax_impls",
    "fla": "benchmarks.peers.fla",
    "lightning-attn": "benchmarks.peers.lightning_attn",
    "jla": "benchmarks.peers.jla",
    "lj-xla": "benchmarks.jax_impls",
    "lj-pallas": "benchmarks.jax_impls",
}

IMPLS = (
    Impl("lj-pallas-chunk_loop", "lj-pallas", "ours", True, "lightning_jax pallas chunk_loop"),
    Impl("lj-pallas-parallel", "lj-pallas", "ours", True, "lightning_jax pallas parallel"),
    Impl("lj-pallas-warp_specialized", "lj-pallas", "ours", True,
         "lightning_jax pallas warp_specialized (Mosaic GPU forward, chunk_loop backward)"),
    Impl("lj-pallas-auto", "lj-pallas", "ours", True, "lightning_jax pallas auto"),
    Impl("lj-xla", "lj-xla", "ours", True, "lightning_jax xla (chunked jnp)"),
    Impl("cudnn-flash", "cudnn", "baseline", False, "cuDNN FlashAttention (causal softmax)"),
    Impl("xla-softmax", "xla-softmax", "baseline", False, "XLA softmax attention (causal)"),
    Impl("fla-chunk", "fla", "peer", True, "fla chunk_simple_gla"),
    Impl("fla-fused_chunk", "fla", "peer", True, "fla fused_chunk_simple_gla"),
    Impl("lightning-attn2", "lightning-attn", "peer", True, "lightning-attn lightning_attn2"),
    Impl("jla-mosaic", "jla", "peer", True, "jax-linear-attention simple_gla (mosaic_gpu)"),
)
IMPL_BY_NAME = {impl.name: impl for impl in IMPLS}
IMPL_SETS = {
    "all": tuple(impl.name for impl in IMPLS),
    **{kind: tuple(impl.name for impl in IMPLS if impl.kind == kind) for kind in KINDS},
    "pallas": tuple(impl.name for impl in IMPLS if impl.group == "lj-pallas"),
}
# Our implementation users get by default on a GPU (impl="auto"): the report's headline.
HEADLINE_IMPL = "lj-pallas-auto"
BASELINE_IMPL = "cudnn-flash"
# Jobs up to the longest T of the Lightning Attention-3 reports run first (tier 0) for every
# group; the longer ones (tier 1) use the time left.
CORE_MAX_SEQ_LEN = 16384


class Shape(NamedTuple):
  batch: int
  seq_len: int
  heads: int
  dim_k: int
  dim_v: int

  def family(self) -> str:
    """The shape without T, e.g. "B4 H32 D64" (E shown only when it differs from D)."""
    e = "" if self.dim_v == self.dim_k else f" E{self.dim_v}"
    return f"B{self.batch} H{self.heads} D{self.dim_k}{e}"


def _seq_lens(lo: int, hi: int) -> list[int]:
  return [1 << p for p in range(lo.bit_length() - 1, hi.bit_length())]


def _families(seq_lens) -> list[Shape]:
  """The Lightning Attention-3 report shapes: B4 H32 D64 and B2 H32 D128."""
  return [Shape(b, t, 32, d, d) for b, d in ((4, 64), (2, 128)) for t in seq_lens]


# Long context: few (batch, head) pairs, B * H from 8 to 64 (the sequence split's
# territory), each family at T = 32K and 128K.
LONG_FAMILIES = ((1, 8, 64), (1, 16, 128), (1, 32, 64), (2, 8, 128), (1, 64, 128), (2, 32, 64))

SHAPE_SETS = {
    "long": [Shape(b, t, h, d, d) for b, h, d in LONG_FAMILIES for t in (32768, 131072)],
    "la3": _families(_seq_lens(1024, 16384)),
    "la3-long": _families(_seq_lens(1024, 131072)),
    "quick": _families([1024, 4096, 16384]),
    "smoke": [Shape(1, t, 2, 16, 16) for t in (32, 64)],
}

# A sample of 20 ms of back-to-back calls: with 1 ms samples (2 calls of a
# 0.7 ms kernel) the host's dispatch and sync latency, larger for JAX than for
# torch, added 13% to a kernel's time (PERFORMANCE.md, "Timing method"). The
# autotuner's `lightning_jax.tune.timing.GPU_SAMPLE_SECONDS`, repeated here (a
# test checks) because the CLI's parent process imports no framework.
GPU_SAMPLE_SECONDS = 0.02
_GPU_SETTINGS = dict(dtype="bf16", warmup=2, iters=20, case_seconds=0.3, sample_seconds=GPU_SAMPLE_SECONDS,
                     compile_threads=4, rotate_bytes=256 << 20)
PROFILES = {
    # Everything, bounded by --max-seconds (cases past the budget are reported as skipped).
    "full": dict(shapes="la3-long", impls="all", modes="fwd,bwd,fwdbwd", decay="on,off", max_seconds=420.0,
                 **_GPU_SETTINGS),
    "quick": dict(shapes="quick", impls="all", modes="fwd,bwd,fwdbwd", decay="on", max_seconds=180.0,
                  **_GPU_SETTINGS),
    # Long context against every peer (the quadratic baselines would take minutes a call there).
    "long": dict(shapes="long", impls="lj-pallas-auto,lj-pallas-chunk_loop,lj-pallas-warp_specialized,peer",
                 modes="fwd,fwdbwd", decay="on,off",
                 max_seconds=540.0, **_GPU_SETTINGS),
    # Tiny shapes that run on a CPU in seconds (Pallas in interpret mode).
    "smoke": dict(shapes="smoke", impls="lj-pallas-auto,lj-xla,baseline,peer", modes="fwd,bwd,fwdbwd",
                  decay="on", dtype="bf16", warmup=1, iters=3, case_seconds=0.05, sample_seconds=0.001,
                  compile_threads=1, rotate_bytes=0, max_seconds=600.0),
}


def _split(text: str) -> list[str]:
  return [part.strip() for part in text.split(",") if part.strip()]


def parse_impls(text: str) -> list[str]:
  """Comma-separated implementation names or sets ("all", "ours", "baseline", "peer", "pallas")."""
  names = []
  for part in _split(text):
    if part in IMPL_SETS:
      names.extend(IMPL_SETS[part])
    elif part in IMPL_BY_NAME:
      names.append(part)
    else:
      raise ValueError(f"unknown implementation {part!r}; choose from {sorted(IMPL_SETS) + list(IMPL_BY_NAME)}")
  return list(dict.fromkeys(names))


def parse_shapes(text: str) -> list[Shape]:
  """Comma-separated shape sets (`SHAPE_SETS`) or shapes "BxTxHxD" / "BxTxHxDxE"."""
  shapes = []
  for part in _split(text):
    if part in SHAPE_SETS:
      shapes.extend(SHAPE_SETS[part])
      continue
    if not re.fullmatch(r"\d+(x\d+){3,4}", part):
      raise ValueError(f"bad shape {part!r}: use a set {sorted(SHAPE_SETS)} or BxTxHxD[xE], e.g. 4x1024x32x64")
    dims = [int(x) for x in part.split("x")]
    if min(dims) < 1:
      raise ValueError(f"bad shape {part!r}: every dimension must be >= 1")
    shapes.append(Shape(*dims) if len(dims) == 5 else Shape(*dims, dims[3]))
  return list(dict.fromkeys(shapes))


def parse_choices(text: str, allowed, what: str) -> list[str]:
  values = _split(text)
  bad = [v for v in values if v not in allowed]
  if bad or not values:
    raise ValueError(f"bad {what} {text!r}: choose from {list(allowed)}")
  return list(dict.fromkeys(values))


def make_jobs(impls: list[str], shapes: list[Shape], decays: list[bool], modes: list[str], dtype: str) -> list[dict]:
  """Jobs ordered by T, then shape, decay and implementation; `tier` 1 marks T > CORE_MAX_SEQ_LEN.

  Softmax attention ignores decay: it gets one job per shape, with decay None.
  """
  jobs = []
  for shape in sorted(shapes, key=lambda s: s.seq_len):
    for decay in decays:
      for name in impls:
        impl = IMPL_BY_NAME[name]
        if not impl.decay_aware and decay != decays[0]:
          continue
        jobs.append(dict(id=len(jobs), impl=name, group=impl.group, tier=int(shape.seq_len > CORE_MAX_SEQ_LEN),
                         **shape._asdict(), dtype=dtype, decay=decay if impl.decay_aware else None,
                         modes=list(modes)))
  return jobs


def case_key(case: dict, mode: str) -> tuple:
  """Identifies a measurement: a job (or result) and a mode."""
  return (case["impl"], mode, *(case[f] for f in Shape._fields), case["dtype"], case["decay"])


def job_shape(job: dict) -> Shape:
  return Shape(*(job[field] for field in Shape._fields))


def input_set_bytes(job: dict) -> int:
  """Bytes of one input set of a job: q, k, v and the output's cotangent."""
  b, t, h, d, e = job_shape(job)
  return DTYPE_ITEMSIZE[job["dtype"]] * b * t * h * (2 * d + 2 * e)


def decay_rates(heads: int) -> list[float]:
  """Per-head decay rates (a = exp(-rate)): the ALiBi slopes 2^(-8 (h+1) / H) of Lightning Attention."""
  return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


def device_slug(device_kind: str) -> str:
  """File-name form of a device kind: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
  return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "unknown"
