"""Public entry point: `lightning_attention`."""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from lightning_jax.ops.lightning_attention import auto_sharding
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import manual_axes
from lightning_jax.ops.lightning_attention import packing
from lightning_jax.ops.lightning_attention import pallas_triton
from lightning_jax.ops.lightning_attention import reference
from lightning_jax.ops.lightning_attention import sequence_parallel
from lightning_jax.ops.lightning_attention import sharding
from lightning_jax.ops.lightning_attention import vjp
from lightning_jax.ops.lightning_attention import xla

IMPLS = ("auto", "pallas", "xla", "reference")
VARIANTS = ("auto", "chunk_loop", "parallel", "warp_specialized")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256
XLA_CHUNK_SIZE = 64


def _check_float(name, x):
  if not any(x.dtype == d for d in DTYPES):
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def check_scale(scale):
  """scale must be None or a finite Python float (it is static: a traced value would recompile nothing)."""
  if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)
                            or not np.isfinite(scale)):
    raise TypeError(f"scale must be None or a finite Python float, got {scale!r}")


def validate_options(*, scale, impl, variant, config):
  """Checks the static options shared by the op and the layers that pass them on."""
  check_scale(scale)
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if variant not in VARIANTS:
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
  if config is not None and not isinstance(config, config_lib.LightningConfig):
    raise TypeError(f"config must be a LightningConfig or None, got {type(config).__name__}")


def is_concrete(x):
  """Whether x's values can be checked now (not traced under jit)."""
  return not isinstance(x, jax.core.Tracer)


def check_rate_values(decay):
  """Concrete decay rates must be finite and >= 0 (exp(-decay) in (0, 1]); traced ones cannot be checked."""
  if is_concrete(decay):
    rates = np.asarray(decay)
    if not np.all(np.isfinite(rates)) or np.any(rates < 0):
      bad = rates[~(np.isfinite(rates) & (rates >= 0))]
      raise ValueError(f"decay rates must be finite and >= 0 (exp(-decay) in (0, 1]), got {bad[:8]}")


def check_packing(segment_ids, cu_seqlens, b, t):
  """segment_ids: None or int [B, T]; cu_seqlens: None or int [N + 1] over B = 1 (values checked when concrete)."""
  if segment_ids is not None and cu_seqlens is not None:
    raise ValueError("give segment_ids or cu_seqlens, not both")
  if segment_ids is not None:
    if not hasattr(segment_ids, "shape") or segment_ids.shape != (b, t):
      raise ValueError(f"segment_ids must be None or an int [B, T] = [{b}, {t}] array, got "
                       f"{getattr(segment_ids, 'shape', type(segment_ids).__name__)}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise TypeError(f"segment_ids must be an integer array, got {segment_ids.dtype}")
  if cu_seqlens is not None:
    if not hasattr(cu_seqlens, "shape") or len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 2:
      raise ValueError(f"cu_seqlens must be None or an int [N + 1] array with N >= 1, got "
                       f"{getattr(cu_seqlens, 'shape', type(cu_seqlens).__name__)}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
      raise TypeError(f"cu_seqlens must be an integer array, got {cu_seqlens.dtype}")
    if b != 1:
      raise ValueError(f"cu_seqlens packs sequences along T of a batch of one: q must be [1, T, H, D], got B = {b}")
    if is_concrete(cu_seqlens):
      cu = np.asarray(cu_seqlens)
      if cu[0] != 0 or cu[-1] != t:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {t}, got {cu[0]} ... {cu[-1]}")
      if np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must be non-decreasing (sequence lengths >= 0), got {cu}")


def check_qkv(q, k, v):
  """Checks q, k [B, T, H, D] and v [B, T, H, E] (shapes, dims, one float dtype); returns (B, T, H, D, E)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, H, D], got shape {q.shape}")
  b, t, h, d = q.shape
  if k.shape != q.shape:
    raise ValueError(f"k must be [B, T, H, D] = {q.shape} like q, got shape {k.shape}")
  if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
    raise ValueError(f"v must be [B, T, H, E] = [{b}, {t}, {h}, E] to match q, got shape {v.shape}")
  e = v.shape[-1]
  if min(b, h) < 1 or t < 1:
    raise ValueError(f"q, k, v need B, T, H >= 1, got q.shape={q.shape}")
  for name, dim in (("D (q.shape[-1])", d), ("E (v.shape[-1])", e)):
    if not 1 <= dim <= MAX_HEAD_DIM:
      raise ValueError(f"head dim {name} must be in [1, {MAX_HEAD_DIM}], got {dim}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    _check_float(name, x)
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  return b, t, h, d, e


def check_initial_state(initial_state, cu_seqlens, shape):
  """initial_state: None, or [B, H, D, E] = `shape` ([N, H, D, E] with cu_seqlens of N sequences), floating."""
  if initial_state is None:
    return
  b, h, d, e = shape
  n = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
  want, what = ((b, h, d, e), "[B, H, D, E]") if n is None else ((n, h, d, e), "[N, H, D, E] (with cu_seqlens)")
  if not hasattr(initial_state, "shape") or initial_state.shape != want:
    raise ValueError(f"initial_state must be {what} = {list(want)}, got "
                     f"{getattr(initial_state, 'shape', type(initial_state).__name__)}")
  if not jnp.issubdtype(initial_state.dtype, jnp.floating):
    raise TypeError(f"initial_state must be a floating array (float32), got {initial_state.dtype}")


def _validate(q, k, v, decay, scale, initial_state, impl, variant, config, interpret, return_final_state,
              segment_ids, cu_seqlens, sequence_axis):
  b, t, h, d, e = check_qkv(q, k, v)
  if decay is not None:
    if not hasattr(decay, "shape") or decay.shape not in ((h,), (b, t, h)):
      raise ValueError(f"decay must be None, per-head rates [H] = [{h}] or per-token rates [B, T, H] = "
                       f"[{b}, {t}, {h}], got {getattr(decay, 'shape', type(decay).__name__)}")
    if not jnp.issubdtype(decay.dtype, jnp.floating):
      raise TypeError(f"decay must be a floating array, got {decay.dtype}")
    check_rate_values(decay)
  check_packing(segment_ids, cu_seqlens, b, t)
  check_initial_state(initial_state, cu_seqlens, (b, h, d, e))
  validate_options(scale=scale, impl=impl, variant=variant, config=config)
  if interpret is not None and not isinstance(interpret, bool):
    raise TypeError(f"interpret must be None or a bool, got {interpret!r}")
  if not isinstance(return_final_state, bool):
    raise TypeError(f"return_final_state must be a bool, got {return_final_state!r}")
  check_sequence_axis(sequence_axis, cu_seqlens, op="lightning_attention", or_else="use sharded_lightning_attention")


def check_sequence_axis(sequence_axis, cu_seqlens, *, op: str, or_else: str):
  """sequence_axis must be None or an axis of the enclosing shard_map, and not come with cu_seqlens."""
  if sequence_axis is None:
    return
  if cu_seqlens is not None:
    raise ValueError("cu_seqlens does not combine with sequence_axis: give segment_ids sharded like q "
                     "(segment_ids_from_cu_seqlens converts)")
  try:
    jax.lax.axis_size(sequence_axis)
  except NameError:
    raise ValueError(f"sequence_axis={sequence_axis!r} is not an axis of the enclosing shard_map (call {op} "
                     f"inside jax.shard_map over a mesh with that axis, or {or_else})") from None


def lightning_attention(q, k, v, decay=None, *, scale=None, initial_state=None, return_final_state=False,
                        segment_ids=None, cu_seqlens=None, sequence_axis=None, impl="auto", variant="auto",
                        config=None, interpret=None):
  r"""Causal linear attention with decay (Lightning Attention-2), optionally per token and packed.

  With a_t = exp(-decay) (per head, or per token; a = 1 without decay), for
  every batch and head:

      S_t = a_t * S_{t-1} + k_t^T v_t,        S_{-1} = initial_state (zeros if None)
      o_t = scale * q_t S_t

  i.e. with per-head rates o_t = scale * (sum_{j<=t} a^(t-j) (q_t . k_j) v_j
  + a^(t+1) q_t S_{-1}), in O(T). Packed sequences restart the recurrence at
  every sequence start.

  Args:
    q, k: [B, T, H, D]. v: [B, T, H, E]. Any T >= 1 and D, E in [1, 256];
      float32, bfloat16 or float16 (one dtype for all three).
    decay: None, [H] per-head rates or [B, T, H] per-token rates, all >= 0
      (a = exp(-rate); the Lightning Attention-2 / MiniMax-01 convention for
      [H], Mamba-2 / simple GLA gates g = -rate for [B, T, H]). Differentiable.
      Any rate from 0 to huge is fine (past ~104, exp(-rate) is 0 in float32).
    scale: multiplies q; default D ** -0.5. `scale=1.0` matches the original
      Lightning Attention-2 kernels.
    initial_state: the state before the first token, computed in float32,
      differentiable: [B, H, D, E] (with segment_ids, it feeds each row's first
      segment), or with cu_seqlens one per sequence, [N, H, D, E].
    return_final_state: also return the state after the last token, float32
      (its cotangent is accepted), for chunked prefill and recurrent decoding:
      [B, H, D, E] (with segment_ids, the end of each row's last segment), or
      with cu_seqlens one per sequence, [N, H, D, E] (an empty sequence's is
      its initial state).
    segment_ids: None or int [B, T]: packed sequences, a segment being a
      maximal run of equal ids in a row; a token sees only the earlier tokens
      of its own segment (padding gets an id of its own). Traced values are
      fine: changing boundaries reuse one compilation.
    cu_seqlens: None or int [N + 1]: N sequences packed in a batch of one (B =
      1), sequence n being tokens cu_seqlens[n]:cu_seqlens[n + 1] (empty ones
      allowed; flash-linear-attention's convention). Not with segment_ids.
      `segment_ids_from_cu_seqlens` converts. With initial or final states,
      impl="pallas" runs one chunk-loop program per sequence (or per piece of
      one, where few would leave the GPU idle) from its own state, whatever
      `variant`; without them, the packed row's kernels.
    sequence_axis: None, or the name of a mesh axis over which T is sharded,
      when called inside `jax.shard_map` (sequence parallelism): q, k, v, a
      per-token decay and segment_ids are this device's slice of T (devices in
      axis order), initial_state is the state before the whole sequence and
      the final state is the one after it, the same on every device. Each
      device runs its slice from the state of the slices before it: one
      all-gather of [B, H, D, E] float32 states forward and one backward
      (`sequence_parallel`). Not with cu_seqlens. See also
      `sharded_lightning_attention`.
    impl: "pallas" (Triton kernels; interpret mode without a supported GPU),
      "xla" (chunked jnp, O(T)), "reference" (token-serial scan, the oracle) or
      "auto" (pallas on NVIDIA GPUs with compute capability >= 8.0, else xla).
    variant: pallas only: "chunk_loop", "parallel", "warp_specialized" or
      "auto". "warp_specialized" is a Mosaic GPU forward for sm90 (bf16/fp16,
      D <= 128, E <= 256, jax >= 0.11; every decay form, packed rows too; the
      backward pass runs the chunk_loop sweeps); "auto" picks it where it is
      faster.
    config: a `LightningConfig` overriding, field by field, the active tuning
      cache (see `use_tuning_cache`) and the per-device block heuristics
      (its `slice_size` sets the sequence split, which otherwise runs slices
      of a long sequence in parallel where few (batch, head) pairs would
      leave the GPU idle).
    interpret: force (True) or forbid (False) Pallas interpret mode.

  The kernels run on the device of q (under `jax.jit`, the default device);
  their blocks and variant follow that device (see `heuristics`). Under
  `jax.jit`, inputs split over B and H by a `NamedSharding` run on each
  device's block, with no gather of q, k, v, o or their gradients: on an
  explicit-sharding mesh through `sharded_lightning_attention`, on any other
  through XLA's partitioner (`auto_sharding`; a T split is gathered there).

  Returns:
    o: [B, T, H, E] in the input dtype; with return_final_state, (o, final state).
  """
  _validate(q, k, v, decay, scale, initial_state, impl, variant, config, interpret, return_final_state,
            segment_ids, cu_seqlens, sequence_axis)
  layout = explicit_layout(q) if sequence_axis is None and cu_seqlens is None else None
  if layout is not None:  # q typed as split over a mesh: run on each device's block
    mesh, (batch_axes, sequence_axis, head_axis) = layout
    return sharded_lightning_attention(
        q, k, v, decay, mesh=mesh, batch_axes=batch_axes, head_axis=head_axis, sequence_axis=sequence_axis,
        scale=scale, initial_state=initial_state, return_final_state=return_final_state, segment_ids=segment_ids,
        impl=impl, variant=variant, config=config, interpret=interpret)
  d = q.shape[-1]
  scale = float(d ** -0.5 if scale is None else scale)
  decay = None if decay is None else decay.astype(jnp.float32)
  initial_state = None if initial_state is None else initial_state.astype(jnp.float32)
  device = heuristics.device_of(q, k, v)
  cc = heuristics.compute_capability(device)
  if impl == "auto":
    impl = "pallas" if heuristics.supported_gpu(cc) else "xla"
  if impl == "pallas":
    interpret = pallas_interpret(interpret, cc, q)
  run = functools.partial(_run, scale=scale, impl=impl, variant=variant, config=config, interpret=interpret,
                          device=device)
  if sequence_axis is not None and jax.lax.axis_size(sequence_axis) > 1:
    local = sequence_parallel.Local(
        axis=sequence_axis, scale=scale, with_final_state=return_final_state,
        run_op=functools.partial(run, return_final_state=True, cu_seqlens=None),
        slice_state=functools.partial(_slice_state, scale=scale, impl=impl, config=config, interpret=interpret,
                                      device=device))
    return sequence_parallel.sequence_parallel(local, q, k, v, decay, initial_state, segment_ids)
  out = run(q, k, v, decay, initial_state, segment_ids, return_final_state=return_final_state,
            cu_seqlens=cu_seqlens)
  if not return_final_state:
    return out[0]
  o, final_state = out
  if sequence_axis is not None and sequence_axis in manual_axes.varying_axes(final_state):
    # One device along the axis: the final state is typed as the same on every
    # device of the axis, as with several (a sum over one device).
    final_state = jax.lax.psum(final_state, sequence_axis)
  return o, final_state


def sharded_lightning_attention(q, k, v, decay=None, *, mesh, batch_axes=None, head_axis=None, sequence_axis=None,
                                scale=None, initial_state=None, return_final_state=False, segment_ids=None,
                                impl="auto", variant="auto", config=None, interpret=None):
  """`lightning_attention` with B, H and T split over the axes of `mesh` (jit-able, differentiable).

  Each device runs the kernels on its own block of q, k, v: q, k, v, o and
  their gradients never leave it. With `sequence_axis`, T is split too
  (sequence parallelism): devices along that axis hold consecutive slices of
  the sequence, and only [B, H, D, E] float32 states cross devices (one
  all-gather forward, one backward; see `lightning_attention`'s
  `sequence_axis`).

  Args:
    q, k: [B, T, H, D]; v: [B, T, H, E]; decay: None, [H] or [B, T, H] rates
      (as in `lightning_attention`).
    mesh: a `jax.sharding.Mesh`.
    batch_axes: None, a mesh axis name or a tuple of names splitting B.
    head_axis: None or a mesh axis name splitting H (and the decay's H).
    sequence_axis: None or a mesh axis name splitting T.
    scale, initial_state ([B, H, D, E]), return_final_state, segment_ids
      ([B, T]), impl, variant, config, interpret: as in `lightning_attention`
      (cu_seqlens: convert with `segment_ids_from_cu_seqlens`).

  The inputs may live anywhere: under `jax.jit` they are laid out on the mesh
  as these axes say (pass them already sharded so to avoid a copy).

  Returns:
    o [B, T, H, E] sharded as q, and with return_final_state the final state
    [B, H, D, E] float32 split over batch_axes and head_axis.
  """
  def op(given, sequence_axis):
    out = lightning_attention(given["q"], given["k"], given["v"], given.get("decay"), scale=scale,
                              initial_state=given.get("initial_state"), return_final_state=return_final_state,
                              segment_ids=given.get("segment_ids"), sequence_axis=sequence_axis, impl=impl,
                              variant=variant, config=config, interpret=interpret)
    return out if return_final_state else (out,)

  per_token = decay is not None and getattr(decay, "ndim", None) == 3
  out = sharding.run_sharded(
      op, dict(q=(q, "bthd"), k=(k, "bthd"), v=(v, "bthe"), decay=(decay, "bth" if per_token else "h"),
               initial_state=(initial_state, "bhde"), segment_ids=(segment_ids, "bt")),
      mesh=mesh, batch_axes=batch_axes, head_axis=head_axis, sequence_axis=sequence_axis,
      out_labels=("bthe", "bhde") if return_final_state else ("bthe",))
  return out if return_final_state else out[0]


def pallas_interpret(interpret, cc, q):
  """The Pallas kernels' interpret flag: as given, else on where `cc` is no supported GPU (checked usable)."""
  interpret = (not heuristics.supported_gpu(cc)) if interpret is None else interpret
  if interpret and manual_axes.varying_axes(q):
    raise ValueError("Pallas interpret mode cannot run inside jax.shard_map with check_vma=True (a limitation of "
                     "jax's interpreter): pass check_vma=False to shard_map, or impl='xla' off the GPU")
  return interpret


def explicit_layout(q):
  """(mesh, (B, T, H entries of q's spec)) when q's type says it is split over explicit mesh axes, else None.

  With an explicit-sharding mesh (`jax.make_mesh`'s default), arrays carry
  their layout in their type under `jax.jit`, so the op can split itself.
  """
  sharding = getattr(jax.typeof(q), "sharding", None)
  mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
  if mesh is None or spec is None or not any(spec[:3]):
    return None
  explicit = jax.sharding.AxisType.Explicit
  types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
  names = [n for entry in spec[:3] for n in ((entry,) if isinstance(entry, str) else entry or ())]
  if not all(types.get(n) == explicit for n in names):
    return None
  return mesh, tuple(spec[:3]) + (None,) * (3 - len(spec[:3]))


def _pallas_options(q, v, *, scale, per_token, return_final_state, variant, config, interpret, device,
                    per_head_decay=False):
  cc, num_sms = heuristics.compute_capability(device), heuristics.num_sms(device)
  variant = heuristics.pallas_variant(variant, d=q.shape[-1], e=v.shape[-1], dtype=q.dtype, compute_capability=cc,
                                      interpret=interpret, per_token=per_token, per_head_decay=per_head_decay,
                                      batch_heads=q.shape[0] * q.shape[2], num_sms=num_sms,
                                      device_kind=getattr(device, "device_kind", ""), seq_len=q.shape[1])
  return config_lib.PallasOptions(scale=scale, return_final_state=return_final_state, variant=variant,
                                  config=config, compute_capability=cc, num_sms=num_sms, interpret=interpret)


def _run(q, k, v, decay, initial_state, segment_ids, *, return_final_state, cu_seqlens, scale, impl, variant,
         config, interpret, device):
  """The op on validated inputs (float32 decay and initial_state, impl resolved): returns (o, final state or None)."""
  t = q.shape[1]
  if impl == "reference":  # the oracle takes packing as given
    o, final_state = reference.lightning_attention_recurrent(q, k, v, decay, scale=scale, initial_state=initial_state,
                                                             segment_ids=segment_ids, cu_seqlens=cu_seqlens)
    return o.astype(q.dtype), final_state

  if impl == "pallas" and cu_seqlens is not None and (initial_state is not None or return_final_state):
    # One chunk-loop program per sequence, from its own initial state to its own final state; a per-head rate
    # runs as the same rate at every token.
    rates = decay if decay is None or chunk_common.per_token(decay) else jnp.broadcast_to(decay, (1, t, q.shape[2]))
    opts = _pallas_options(q, v, scale=scale, per_token=True, return_final_state=return_final_state,
                           variant="chunk_loop", config=config, interpret=interpret, device=device)
    out = auto_sharding.lightning_attention_pallas(q, k, v, rates, cu_seqlens.astype(jnp.int32), initial_state, opts)
    o, final_state = out if return_final_state else (out, None)
    return o.astype(q.dtype), final_state

  # Otherwise cu_seqlens runs as the segments of one row from zero states; on
  # the xla path each sequence's own initial and final states come from `packing`.
  sequence_initial = None
  if cu_seqlens is not None:
    sequence_initial, initial_state = initial_state, None
    segment_ids = packing.segment_ids_from_cu_seqlens(cu_seqlens, t)
  kernel_final_state = return_final_state and cu_seqlens is None

  if impl == "pallas":
    per_token = segment_ids is not None or chunk_common.per_token(decay)
    opts = _pallas_options(q, v, scale=scale, per_token=per_token, return_final_state=kernel_final_state,
                           variant=variant, config=config, interpret=interpret, device=device,
                           per_head_decay=decay is not None and not per_token)
    starts = None if segment_ids is None else chunk_common.segment_starts(segment_ids)
    out = auto_sharding.lightning_attention_pallas(q, k, v, decay, starts, initial_state, opts)
    o, final_state = out if kernel_final_state else (out, None)
  else:
    o, final_state = xla.lightning_attention_chunked(q, k, v, decay, scale=scale, initial_state=initial_state,
                                                     chunk_size=XLA_CHUNK_SIZE, segment_ids=segment_ids)
  if cu_seqlens is not None and (sequence_initial is not None or return_final_state):
    o_extra, final_state = packing.sequence_states(q, k, v, decay, cu_seqlens, scale=scale,
                                                   initial_state=sequence_initial,
                                                   with_final_state=return_final_state,
                                                   tensor_cores=device.platform == "gpu")
    if o_extra is not None:
      o = o.astype(jnp.float32) + o_extra
  return o.astype(q.dtype), final_state


def _slice_state(y, z, decay, starts, reverse, *, scale, impl, config, interpret, device):
  """The state a sweep over y, z ends with from zeros (the local states of `sequence_parallel`).

  Forward (y=k, z=v): the slice's own final state. Reverse (y=q, z=do): the
  gradient of the slice's outputs with respect to its initial state, over scale.
  """
  if impl != "pallas":
    return sequence_parallel.slice_state_jnp(y, z, decay, starts, reverse=reverse)
  opts = _pallas_options(y, z, scale=scale, per_token=True, return_final_state=True, variant="chunk_loop",
                         config=config, interpret=interpret, device=device)
  ins = pallas_triton.SweepOperands(**vjp.sweep_gates(decay, starts), y=y, z=z)
  state = pallas_triton.sweep_final_state(ins, reverse=reverse, opts=opts)
  return vjp.initial_state_factor(decay) * state if reverse else state
