"""What the benchmark measures: implementations, shapes, profiles and jobs.

Pure Python (no JAX, no torch): the parent process and every worker import it.
The functions that build a job's arrays import numpy; only the workers call them.

A *job* is one implementation on one shape, dtype, decay and packing setting;
its worker measures every requested mode of it and returns one result per mode.
Jobs of one *group* run in one subprocess, in the order of `make_jobs` (growing T).

A job's `decay` is True (per-head rates [H]), False (none), "token" (per-token
rates [B, T, H]) or None (softmax attention, which has no decay); its
`segments` is the number of sequences packed in each row (1: unpacked), and
`states` (packed jobs) whether they run as `cu_seqlens` over the batch's rows
laid end to end, each sequence with its own initial and final state (serving's
prefill of several prompts), instead of as segment ids.

Two ops are measured: `lightning_attention` and `delta_attention`. A job of
the delta op carries its form in `decay`: "deltanet" (no decay),
"gated_deltanet" (per-token rates [B, T, H]) or "kda" (per-token, per-key-
channel rates [B, T, H, D]). The form is the delta op's decay setting, so every
key, report panel and metric that keeps decay settings apart keeps the forms
apart (and apart from the lightning settings) without a field of its own.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import NamedTuple

MODES = ("fwd", "bwd", "fwdbwd")
DTYPE_ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
DECAYS = {"on": True, "off": False, "token": "token"}
# The delta op's forms (`lightning_jax.delta_attention` with decay None, [B, T, H], [B, T, H, D]) and their labels.
DELTA_FORMS = {"deltanet": "DeltaNet", "gated_deltanet": "Gated DeltaNet", "kda": "KDA"}
DECAY_LABELS = {True: "decay", False: "no decay", "token": "per-token decay", None: "", **DELTA_FORMS}
# --ops: the lightning op (its settings from --decay) and the delta forms; "delta" names the three forms.
OPS = ("lightning", *DELTA_FORMS)
# The lightning setting each delta form is compared with (`metrics.derive`'s lightning_ratio): the same decay
# without the delta rule (lightning takes no per-channel rates: KDA is compared with per-token decay).
LIGHTNING_COUNTERPART = {"deltanet": False, "gated_deltanet": "token", "kda": "token"}
KINDS = ("ours", "baseline", "peer")


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation; `group` names the subprocess (worker module) that runs it."""
  name: str
  group: str
  kind: str  # "ours", "baseline" or "peer"
  decay_aware: bool  # False: decay does not apply (softmax attention)
  label: str
  # Why it cannot run per-token decay or packed sequences (None: it can); those jobs are reported skipped.
  no_token_decay: str | None = None
  no_packing: str | None = None
  no_sequence_states: str | None = None  # why it cannot run packed sequences with states of their own
  op: str = "lightning"  # the op whose settings it runs: "lightning" or "delta" (softmax runs once for any)


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

_SOFTMAX_NO_PACKING = "jax.nn.dot_product_attention takes no segment ids (packed rows not measured)"
_JLA_NO_SEQUENCE_STATES = ("jax-linear-attention's Mosaic GPU kernels take segment ids with one initial state per "
                           "row (its cu_seqlens is the reference path's)")
IMPLS = (
    Impl("lj-pallas-chunk_loop", "lj-pallas", "ours", True, "lightning_jax pallas chunk_loop"),
    Impl("lj-pallas-parallel", "lj-pallas", "ours", True, "lightning_jax pallas parallel"),
    Impl("lj-pallas-warp_specialized", "lj-pallas", "ours", True,
         "lightning_jax pallas warp_specialized (Mosaic GPU forward, chunk_loop backward)"),
    Impl("lj-pallas-auto", "lj-pallas", "ours", True, "lightning_jax pallas auto"),
    Impl("lj-xla", "lj-xla", "ours", True, "lightning_jax xla (chunked jnp)"),
    Impl("cudnn-flash", "cudnn", "baseline", False, "cuDNN FlashAttention (causal softmax)",
         no_packing=_SOFTMAX_NO_PACKING),
    Impl("xla-softmax", "xla-softmax", "baseline", False, "XLA softmax attention (causal)",
         no_packing=_SOFTMAX_NO_PACKING),
    Impl("fla-chunk", "fla", "peer", True, "fla chunk_simple_gla"),
    Impl("fla-fused_chunk", "fla", "peer", True, "fla fused_chunk_simple_gla"),
    Impl("lightning-attn2", "lightning-attn", "peer", True, "lightning-attn lightning_attn2",
         no_token_decay="lightning_attn2 takes per-head decay rates s [H, 1, 1] only",
         no_packing="lightning_attn2 takes no cu_seqlens or segment ids"),
    Impl("jla-mosaic", "jla", "peer", True, "jax-linear-attention simple_gla (mosaic_gpu)",
         no_sequence_states=_JLA_NO_SEQUENCE_STATES),
    # The delta op (last, so that the lightning implementations keep their order and plot colours).
    Impl("lj-delta-pallas", "lj-pallas", "ours", True,
         "lightning_jax delta_attention pallas (Triton; on sm90 the forward's sweep warp-specialised, Mosaic GPU)",
         op="delta"),
    Impl("lj-delta-xla", "lj-xla", "ours", True, "lightning_jax delta_attention xla (chunked jnp)", op="delta"),
    Impl("fla-delta-chunk", "fla", "peer", True, "fla chunk_delta_rule, chunk_gated_delta_rule, chunk_kda",
         op="delta"),
    Impl("jla-delta-mosaic", "jla", "peer", True,
         "jax-linear-attention deltanet, gated_deltanet, kda (mosaic_gpu)", op="delta",
         no_sequence_states=_JLA_NO_SEQUENCE_STATES),
)
IMPL_BY_NAME = {impl.name: impl for impl in IMPLS}
IMPL_SETS = {
    "all": tuple(impl.name for impl in IMPLS),
    **{kind: tuple(impl.name for impl in IMPLS if impl.kind == kind) for kind in KINDS},
    "pallas": tuple(impl.name for impl in IMPLS if impl.group == "lj-pallas" and impl.op == "lightning"),
    "delta": tuple(impl.name for impl in IMPLS if impl.op == "delta"),
}
# Our implementation users get by default on a GPU (impl="auto"), per op: the report's headlines.
HEADLINE_IMPLS = {"lightning": "lj-pallas-auto", "delta": "lj-delta-pallas"}
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
    # The performance targets of per-token decay and of packed sequences.
    "token": _families([8192, 32768]),
    "packed": [Shape(1, 32768, 32, 128, 128)],
    # The performance targets of the delta forms.
    "delta": [*_families([2048, 8192, 32768]), Shape(1, 65536, 32, 128, 128)],
    # The delta forms at few (batch, head) pairs, long T: the sequence split's territory (8 to 64 programs).
    "delta-long": [Shape(1, 65536, 32, 128, 128), Shape(1, 65536, 16, 128, 128), Shape(2, 32768, 8, 64, 64),
                   Shape(1, 131072, 8, 64, 64)],
}

# A sample of 20 ms of back-to-back calls: with 1 ms samples (2 calls of a
# 0.7 ms kernel) the host's dispatch and sync latency, larger for JAX than for
# torch, added 13% to a kernel's time (PERFORMANCE.md, "Timing method"). The
# autotuner's `lightning_jax.tune.timing.GPU_SAMPLE_SECONDS`, repeated here (a
# test checks) because the CLI's parent process imports no framework.
GPU_SAMPLE_SECONDS = 0.02
# Half a second of back-to-back calls before the samples: the GPU at its power cap's steady clocks
# (`lightning_jax.tune.timing.GPU_WARMUP_SECONDS`, repeated here as the sample length is).
GPU_WARMUP_SECONDS = 0.5
_GPU_SETTINGS = dict(dtype="bf16", warmup=2, warmup_seconds=GPU_WARMUP_SECONDS, iters=20, case_seconds=0.3,
                     sample_seconds=GPU_SAMPLE_SECONDS, compile_threads=4, rotate_bytes=256 << 20)
_SMOKE_SETTINGS = dict(dtype="bf16", warmup=1, warmup_seconds=0.0, iters=3, case_seconds=0.05, sample_seconds=0.001,
                       compile_threads=1, rotate_bytes=0, max_seconds=600.0)
PROFILES = {
    # Everything, bounded by --max-seconds (cases past the budget are reported as skipped).
    "full": dict(shapes="la3-long", impls="all", modes="fwd,bwd,fwdbwd", decay="on,off", segments="1",
                 max_seconds=420.0, **_GPU_SETTINGS),
    "quick": dict(shapes="quick", impls="all", modes="fwd,bwd,fwdbwd", decay="on", segments="1", max_seconds=180.0,
                  **_GPU_SETTINGS),
    # Long context against every peer (the quadratic baselines would take minutes a call there).
    "long": dict(shapes="long", impls="lj-pallas-auto,lj-pallas-chunk_loop,lj-pallas-warp_specialized,peer",
                 modes="fwd,fwdbwd", decay="on,off", segments="1",
                 max_seconds=540.0, **_GPU_SETTINGS),
    # Per-token decay against the peers that take it (the others are reported skipped).
    "token": dict(shapes="token", impls="lj-pallas-auto,peer", modes="fwd,fwdbwd", decay="token", segments="1",
                  max_seconds=420.0, **_GPU_SETTINGS),
    # A row of 8 packed sequences and the same row unpacked (the report gives their ratio).
    "packed": dict(shapes="packed", impls="lj-pallas-auto,peer", modes="fwd,fwdbwd", decay="on,token",
                   segments="1,8", max_seconds=420.0, **_GPU_SETTINGS),
    # The same with each packed sequence's own initial and final state (cu_seqlens: serving's prefill).
    "packed-states": dict(shapes="packed", impls="lj-pallas-auto,fla-chunk,jla-mosaic", modes="fwd,fwdbwd",
                          decay="on,token", segments="1,8", sequence_states=True, max_seconds=420.0,
                          **_GPU_SETTINGS),
    # Tiny shapes that run on a CPU in seconds (Pallas in interpret mode).
    "smoke": dict(shapes="smoke", impls="lj-pallas-auto,lj-xla,baseline,peer", modes="fwd,bwd,fwdbwd",
                  decay="on", segments="1", **_SMOKE_SETTINGS),
    # Per-token decay, unpacked and packed, on one tiny shape (the implementations of `token` and `packed`).
    "smoke-token-packed": dict(shapes="1x64x2x16", impls="lj-pallas-auto,peer", modes="fwd,fwdbwd", decay="token",
                               segments="1,3", **_SMOKE_SETTINGS),
    # The delta forms against their peers, cuDNN (the crossover length) and the lightning op's counterparts.
    "delta": dict(shapes="delta", impls="lj-delta-pallas,lj-pallas-auto,cudnn-flash,fla-delta-chunk,jla-delta-mosaic",
                  ops="lightning,delta", modes="fwd,fwdbwd", decay="off,token", segments="1", max_seconds=540.0,
                  **_GPU_SETTINGS),
    # The delta forms at few (batch, head) pairs against the peers that run them.
    "delta-long": dict(shapes="delta-long", impls="lj-delta-pallas,fla-delta-chunk,jla-delta-mosaic", ops="delta",
                       modes="fwd,fwdbwd", decay="off", segments="1", max_seconds=540.0, **_GPU_SETTINGS),
    # The same on one tiny shape (the Pallas kernels in interpret mode).
    "smoke-delta": dict(shapes="1x64x2x16",
                        impls="lj-delta-pallas,fla-delta-chunk,jla-delta-mosaic,lj-pallas-auto,baseline",
                        ops="lightning,delta", modes="fwd,fwdbwd", decay="off,token", segments="1", **_SMOKE_SETTINGS),
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


def parse_ops(text: str) -> list[str]:
  """Comma-separated ops: "lightning", the delta forms (`DELTA_FORMS`), or "delta" for the three forms."""
  forms = ",".join(DELTA_FORMS)
  return parse_choices(",".join(forms if part == "delta" else part for part in _split(text)), OPS, "--ops")


def op_of(decay) -> str:
  """The op of a decay setting (a job's `decay`): "delta" for the delta forms, else "lightning"."""
  return "delta" if decay in DELTA_FORMS else "lightning"


def is_delta(job: dict) -> bool:
  return op_of(job["decay"]) == "delta"


def parse_segments(text: str) -> list[int]:
  """Comma-separated numbers of sequences packed in a row (1: unpacked)."""
  parts = _split(text)
  if not parts or not all(p.isdigit() and int(p) >= 1 for p in parts):
    raise ValueError(f"bad --segments {text!r}: comma-separated integers >= 1, e.g. 1,8")
  return list(dict.fromkeys(int(p) for p in parts))


def make_jobs(impls: list[str], shapes: list[Shape], decays: list, modes: list[str], dtype: str,
              segments=(1,), states: bool = False) -> list[dict]:
  """Jobs ordered by T, then shape, packing, decay and implementation; `tier` 1 marks T > CORE_MAX_SEQ_LEN.

  `decays` holds lightning settings and delta forms; each implementation gets those of its op. Softmax attention
  ignores decay: it gets one job per shape and packing, with decay None. With `states`, the packed jobs carry
  per-sequence states (`states_of`).
  """
  jobs = []
  for shape in sorted(shapes, key=lambda s: s.seq_len):
    for n in segments:
      if n > 1 and _cut_count(shape.seq_len) < n - 1:
        raise ValueError(f"T = {shape.seq_len} cannot hold {n} packed sequences (boundaries avoid multiples of 64)")
      for decay in decays:
        for name in impls:
          impl = IMPL_BY_NAME[name]
          if (not impl.decay_aware and decay != decays[0]) or (impl.decay_aware and impl.op != op_of(decay)):
            continue
          jobs.append(dict(id=len(jobs), impl=name, group=impl.group, tier=int(shape.seq_len > CORE_MAX_SEQ_LEN),
                           **shape._asdict(), dtype=dtype, decay=decay if impl.decay_aware else None, segments=n,
                           states=states and n > 1, modes=list(modes)))
  return jobs


def segments_of(case: dict) -> int:
  """Sequences packed in a row of a job or result (results from before packing have no field: 1)."""
  return case.get("segments", 1)


def states_of(case: dict) -> bool:
  """Whether a job's (or result's) packed sequences carry states of their own (results from before: no)."""
  return case.get("states", False)


def case_key(case: dict, mode: str) -> tuple:
  """Identifies a measurement: a job (or result) and a mode."""
  return (case["impl"], mode, *(case[f] for f in Shape._fields), case["dtype"], case["decay"], segments_of(case),
          states_of(case))


def unsupported(job: dict) -> str | None:
  """Why the implementation cannot run the job's decay or packing (it is reported skipped), else None."""
  impl = IMPL_BY_NAME[job["impl"]]
  if job["decay"] == "token" and impl.no_token_decay:
    return impl.no_token_decay
  if segments_of(job) > 1 and impl.no_packing:
    return impl.no_packing
  if states_of(job) and impl.no_sequence_states:
    return impl.no_sequence_states
  return None


def setting_label(decay, segments: int, states: bool = False) -> str:
  """A setting in words, e.g. "per-token decay, 8 packed sequences"; "" for softmax on unpacked rows."""
  packing = f"{segments} packed sequences{' with their own states' if states else ''}" if segments > 1 else ""
  return ", ".join(x for x in (DECAY_LABELS[decay], packing) if x)


def job_shape(job: dict) -> Shape:
  return Shape(*(job[field] for field in Shape._fields))


def input_set_bytes(job: dict) -> int:
  """Bytes of one input set of a job: q, k, v and the output's cotangent."""
  b, t, h, d, e = job_shape(job)
  return DTYPE_ITEMSIZE[job["dtype"]] * b * t * h * (2 * d + 2 * e)


def decay_rates(heads: int) -> list[float]:
  """Per-head decay rates (a = exp(-rate)): the ALiBi slopes 2^(-8 (h+1) / H) of Lightning Attention."""
  return [2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)]


# A job's inputs besides q, k and v. Every implementation gets the same values (fixed
# seeds), in its own form.

def decay_array(job: dict):
  """float32 rates: [H] (decay on), [B, T, H] (per-token), or None (no decay, softmax).

  Per-token rates are the head's ALiBi slope times a factor per (b, t, h) drawn
  uniformly from [0.5, 1.5]: a data-dependent gate around the per-head rates.
  """
  import numpy as np  # noqa: PLC0415 -- the parent process imports no numerics

  if not job["decay"]:
    return None
  rates = np.asarray(decay_rates(job["heads"]), np.float32)
  if job["decay"] != "token":
    return rates
  b, t, h, _, _ = job_shape(job)
  return (rates * np.random.default_rng(0).uniform(0.5, 1.5, (b, t, h))).astype(np.float32)


def delta_gates(job: dict) -> dict:
  """float32 gates of a delta-form job, by `delta_attention`'s names (fixed seed).

  beta [B, T, H]: sigmoid of a standard normal. decay (not for DeltaNet): rates
  uniform in [0.01, 0.1], [B, T, H] (Gated DeltaNet) or [B, T, H, D] (KDA).
  Drawn in float32: the KDA rates of the 64K shape are 2^28 values.
  """
  import numpy as np  # noqa: PLC0415

  b, t, h, d, _ = job_shape(job)
  rng = np.random.default_rng(0)
  gates = {"beta": 1 / (1 + np.exp(-rng.standard_normal((b, t, h), np.float32)))}
  if job["decay"] != "deltanet":
    shape = (b, t, h, d) if job["decay"] == "kda" else (b, t, h)
    gates["decay"] = 0.01 + 0.09 * rng.random(shape, np.float32)
  return gates


def differentiated_inputs(job: dict) -> int:
  """How many of the job's extra inputs, the first ones, the backward modes differentiate with q, k and v.

  Per-token rates (1) and the delta forms' beta and rates (1 or 2) are (a
  model's gates are trained, and fla's backward computes their gradients
  whether asked or not); fixed per-head rates (the ALiBi slopes) are not.
  """
  return {"token": 1, "deltanet": 1, "gated_deltanet": 2, "kda": 2}.get(job["decay"], 0)


def gate_floats(case: dict) -> int:
  """float32 values per (b, t, h) of the differentiated gates of a job or result (its HBM floor reads them)."""
  return {"token": 1, "deltanet": 1, "gated_deltanet": 2, "kda": 1 + case["dim_k"]}.get(case["decay"], 0)


def _cut_count(seq_len: int) -> int:
  """Positions 1..T-1 not on a multiple of 64, where a packed sequence may start."""
  return seq_len - 1 - (seq_len - 1) // 64


def segment_starts(job: dict) -> list[list[int]]:
  """Each row's sequence starts (0 first): `segments` random lengths summing to T, each at least 1 token.

  No sequence starts on a multiple of 64, so that every boundary falls inside a
  chunk of the chunked kernels (the case that needs masking). Rows differ; the
  seed is fixed.
  """
  rng = random.Random(0)
  cuts = [c for c in range(1, job["seq_len"]) if c % 64]
  return [[0, *sorted(rng.sample(cuts, segments_of(job) - 1))] for _ in range(job["batch"])]


def segment_ids(job: dict):
  """int32 [B, T], the index of each token's sequence in its row; None when unpacked."""
  import numpy as np  # noqa: PLC0415

  if segments_of(job) == 1:
    return None
  ids = np.zeros((job["batch"], job["seq_len"]), np.int32)
  for row, starts in zip(ids, segment_starts(job)):
    row[starts[1:]] = 1
  return np.cumsum(ids, axis=1, dtype=np.int32)


def sequence_states(job: dict):
  """float32 [N, H, D, E] initial states of the packed sequences of all rows, in `cu_seqlens`' order (fixed seed,
  standard normal times 0.1)."""
  import numpy as np  # noqa: PLC0415

  b, _, h, d, e = job_shape(job)
  return (0.1 * np.random.default_rng(1).standard_normal((b * segments_of(job), h, d, e))).astype(np.float32)


def cu_seqlens(job: dict) -> list[int]:
  """The packed sequences of all rows as one row of B * T tokens: [N + 1] cumulative lengths (varlen APIs)."""
  t = job["seq_len"]
  return [row * t + s for row, starts in enumerate(segment_starts(job)) for s in starts] + [job["batch"] * t]


def device_slug(device_kind: str) -> str:
  """File-name form of a device kind: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
  return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "unknown"
