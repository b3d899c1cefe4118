"""Public entry points: `delta_attention` (DeltaNet, Gated DeltaNet, Kimi Delta Attention) and
`sharded_delta_attention` (the op over a device mesh)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lightning_jax.ops.delta_attention import chunk
from lightning_jax.ops.delta_attention import pallas_triton
from lightning_jax.ops.delta_attention import reference
from lightning_jax.ops.delta_attention import sequence_parallel
from lightning_jax.ops.delta_attention import sequence_split
from lightning_jax.ops.delta_attention import vjp
from lightning_jax.ops.delta_attention import xla
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import api as lightning_api
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import manual_axes
from lightning_jax.ops.lightning_attention import packing
from lightning_jax.ops.lightning_attention import sharding
from lightning_jax.ops.lightning_attention.config import WarpSpecializedConfig

IMPLS = ("auto", "pallas", "xla", "reference")
MAX_HEAD_DIM = lightning_api.MAX_HEAD_DIM  # q, k, v are checked by the lightning op's `check_qkv`
XLA_CHUNK_SIZE = 64
# The models' L2 norm (flash-linear-attention's `l2norm`): x / sqrt(sum x^2 + eps).
L2_NORM_EPS = 1e-6


def _check_rates(name, x, expected):
  if not hasattr(x, "shape") or x.shape not in expected:
    shapes = " or ".join(f"{what} = {list(shape)}" for shape, what in expected.items())
    raise ValueError(f"{name} must be {shapes}, got {getattr(x, 'shape', type(x).__name__)}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{name} must be a floating array, got {x.dtype}")


def _validate(q, k, v, beta, decay, scale, initial_state, return_final_state, segment_ids, cu_seqlens, sequence_axis,
              normalize_qk, impl, config, interpret):
  b, t, h, d, e = lightning_api.check_qkv(q, k, v)
  _check_rates("beta", beta, {(b, t, h): "[B, T, H]"})
  if lightning_api.is_concrete(beta):
    values = np.asarray(beta, np.float32)
    if not np.all(np.isfinite(values)) or np.any(values < 0) or np.any(values > 2):
      bad = values[~(np.isfinite(values) & (values >= 0) & (values <= 2))]
      raise ValueError(f"beta must be finite and in [0, 2] (the delta rule's step), got {bad[:8]}")
  if decay is not None:
    _check_rates("decay", decay, {(b, t, h): "None, per-token rates [B, T, H] (Gated DeltaNet)",
                                  (b, t, h, d): "per-token, per-key-channel rates [B, T, H, D] (KDA)"})
    lightning_api.check_rate_values(decay)
  lightning_api.check_packing(segment_ids, cu_seqlens, b, t)
  lightning_api.check_initial_state(initial_state, cu_seqlens, (b, h, d, e))
  lightning_api.check_scale(scale)
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  for name, flag in (("return_final_state", return_final_state), ("normalize_qk", normalize_qk)):
    if not isinstance(flag, bool):
      raise TypeError(f"{name} must be a bool, got {flag!r}")
  if config is not None and not isinstance(config, pallas_triton.DeltaConfig):
    raise TypeError(f"config must be a DeltaConfig or None, got {type(config).__name__}")
  if config is not None:
    config.splits_backward(per_channel_gate=decay is not None and decay.ndim == 4)
  if interpret is not None and not isinstance(interpret, bool):
    raise TypeError(f"interpret must be None or a bool, got {interpret!r}")
  lightning_api.check_sequence_axis(sequence_axis, cu_seqlens, op="delta_attention",
                                    or_else="give q a NamedSharding over an explicit mesh that splits T")


def l2_normalize(x):
  """x / sqrt(sum(x^2) + eps) over the last axis, in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2_NORM_EPS)).astype(x.dtype)


def delta_attention(q, k, v, beta, decay=None, *, scale=None, initial_state=None, return_final_state=False,
                    segment_ids=None, cu_seqlens=None, sequence_axis=None, normalize_qk=False, impl="auto",
                    config=None, interpret=None):
  r"""Causal delta attention: DeltaNet, Gated DeltaNet and Kimi Delta Attention (KDA), in O(T).

  Per batch and head, with the state S [D, E] in float32 and a_t = exp(-decay_t)
  (1 without decay):

      S_t = (I - beta_t k_t k_t^T) Diag(a_t) S_{t-1} + beta_t k_t v_t^T,   S_{-1} = initial_state
      o_t = scale * S_t^T q_t

  Args:
    q, k: [B, T, H, D]. v: [B, T, H, E]. Any T >= 1 and D, E in [1, 256]
      on every impl (the Pallas kernels keep all of D in a block, padded to a
      power of two, and split E; D = 256 was checked compiled on an H200);
      float32, bfloat16 or float16 (one dtype for all three). The delta rule
      is stable for |k| <= 1 (use `normalize_qk`, as the models do).
    beta: [B, T, H] step sizes in [0, 2] (a sigmoid, or twice one).
    decay: None (DeltaNet), [B, T, H] per-token rates (Gated DeltaNet) or
      [B, T, H, D] per-token, per-key-channel rates (KDA), all >= 0: the gate
      g = -decay (log a). Any rate from 0 to huge is fine.
    scale: multiplies q; default D ** -0.5.
    initial_state: the state before the first token, float32: [B, H, D, E]
      (with segment_ids, it feeds each row's first segment), or with
      cu_seqlens one per sequence, [N, H, D, E].
    return_final_state: also return the state after the last token, float32
      [B, H, D, E] (with segment_ids, the end of each row's last segment), or
      with cu_seqlens one per sequence, [N, H, D, E].
    segment_ids: None or int [B, T]: packed sequences (a segment is a maximal
      run of equal ids in a row; the state restarts from zeros at each).
    cu_seqlens: None or int [N + 1]: N sequences packed in a batch of one
      (flash-linear-attention's convention; empty ones allowed). Not with
      segment_ids. With per-sequence initial or final states the sequences
      are laid out chunk-aligned (O(T + N C) rows), and "pallas" runs a
      sweep program per (head, value block, sequence) from that sequence's
      initial state (no sequence split): on sm90 the warp-specialised
      sweeps (KDA's backward on the Triton ones).
    sequence_axis: None, or the name of a mesh axis over which T is sharded,
      when called inside `jax.shard_map` (sequence parallelism): q, k, v,
      beta, decay and segment_ids are this device's slice of T (devices in
      axis order), initial_state is the state before the whole sequence and
      the final state the one after it, the same on every device. Each device
      runs its slice from the state of the slices before it, which one
      all-gather of every slice's affine map (float32 [B, H, D, D + E])
      gives (`sequence_parallel`); the gradients flow back the same way. Not
      with cu_seqlens.
    normalize_qk: apply the models' L2 norm to q and k (over D) inside the op.
    impl: "pallas" (Triton kernels, the chunked WY form, on sm90 the
      forward's sweep warp-specialised in Mosaic GPU, `warp_specialized`,
      KDA's where no 16-token block decays by more than 60 (6 in float16)
      on a key channel, and then its backward too; interpret mode without
      a supported GPU), "xla" (chunked jnp, O(T)), "reference"
      (token-serial scan, the oracle) or "auto" (pallas on NVIDIA GPUs with
      compute capability >= 8.0, else xla; cu_seqlens with per-sequence
      states run a sweep program per sequence, the sequences chunk-aligned).
    config: a `DeltaConfig` (the Pallas kernels' blocks; on sm90 whether the
      differentiated forward keeps each chunk's states for the backward,
      `forward_states`) or None. Its fields left None are chosen for the call
      (`pallas_triton.default_config`; with few (batch, head) pairs and long
      T, the sequence split of `sequence_split.num_pieces`: each row cut into
      pieces run in parallel), so setting one keeps the others' tuned blocks.
    interpret: force (True) or forbid (False) Pallas interpret mode.

  Every array argument is differentiable (beta, decay and initial_state
  included; the gradients of segment_ids and cu_seqlens are zero).

  Under `jax.jit`, inputs split over B and H by a `NamedSharding` run on each
  device's block, with no gather of q, k, v, o or their gradients: on an
  explicit-sharding mesh the op splits itself by q's type (T split too: it
  runs sequence parallel over that axis), on any other the Pallas kernels go
  through XLA's partitioner (`auto_sharding`; a T split is gathered there:
  use `sharded_delta_attention` for sequence parallelism on such a mesh).

  Returns:
    o: [B, T, H, E] in the input dtype; with return_final_state, (o, final state).
  """
  _validate(q, k, v, beta, decay, scale, initial_state, return_final_state, segment_ids, cu_seqlens, sequence_axis,
            normalize_qk, impl, config, interpret)
  layout = lightning_api.explicit_layout(q) if sequence_axis is None else None
  if layout is not None:  # q typed as split over a mesh: run on each device's block
    return _explicit_split(q, k, v, beta, decay, layout, scale=scale, initial_state=initial_state,
                           return_final_state=return_final_state, segment_ids=segment_ids, cu_seqlens=cu_seqlens,
                           normalize_qk=normalize_qk, impl=impl, config=config, interpret=interpret)
  if normalize_qk:
    q, k = l2_normalize(q), l2_normalize(k)
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  if sequence_axis is not None and jax.lax.axis_size(sequence_axis) > 1:
    def run(q, k, v, beta, decay, initial_state, segment_ids):  # one device's slice
      return delta_attention(q, k, v, beta, decay, scale=scale, initial_state=initial_state, return_final_state=True,
                             segment_ids=segment_ids, impl=impl, config=config, interpret=interpret)

    o, final_state = sequence_parallel.sequence_parallel(run, q, k, v, beta, decay, initial_state, segment_ids,
                                                         axis=sequence_axis, max_value_dim=MAX_HEAD_DIM)
    return (o, final_state) if return_final_state else o
  device = heuristics.device_of(q, k, v)
  cc = heuristics.compute_capability(device)
  # Each sequence's own states (cu_seqlens) run on a chunk-aligned layout (`chunk.aligned_sequences`).
  sequence_states = cu_seqlens is not None and (initial_state is not None or return_final_state)
  if impl == "auto":
    impl = "pallas" if heuristics.supported_gpu(cc) else "xla"
  beta = beta.astype(jnp.float32)
  decay = None if decay is None else decay.astype(jnp.float32)
  initial_state = None if initial_state is None else initial_state.astype(jnp.float32)
  if impl == "reference":
    o, final_state = reference.delta_attention_recurrent(q, k, v, beta, decay, scale=scale,
                                                         initial_state=initial_state, segment_ids=segment_ids,
                                                         cu_seqlens=cu_seqlens)
  elif sequence_states and impl == "xla":
    o, final_state = xla.chunked_sequences(q, k, v, beta, decay, cu_seqlens, initial_state, scale=scale,
                                           chunk_size=XLA_CHUNK_SIZE, with_final_state=return_final_state)
  elif sequence_states:
    o, final_state = _pallas_sequences(q, k, v, beta, decay, cu_seqlens, initial_state, scale=scale,
                                       with_final_state=return_final_state, config=config, interpret=interpret,
                                       device=device)
  else:
    if cu_seqlens is not None:
      segment_ids = packing.segment_ids_from_cu_seqlens(cu_seqlens, q.shape[1])
    starts = None if segment_ids is None else chunk_common.segment_starts(segment_ids)
    if impl == "pallas":
      per_channel_gate = decay is not None and decay.ndim == 4
      interpret = lightning_api.pallas_interpret(interpret, cc, q)
      config = _resolve_warp_specialized(_filled_config(config, q, v, decay, device), q, v, cc=cc,
                                         interpret=interpret)
      if config.forward_states and not (config.warp_specializes_backward(per_channel_gate=per_channel_gate)
                                        or config.keeps_chunk_terms(per_channel_gate=per_channel_gate)):
        raise ValueError("DeltaConfig(forward_states=True) needs the warp-specialised backward, which this call does "
                         "not run (`DeltaConfig.warp_specializes_backward`: the sm90 forward, compiled or forced, a "
                         "scalar decay or none, split_backward not False, block_e >= 64; for KDA's per-key-channel "
                         "decay, the sm90 forward); pass None or False")
      if config.sequence_pieces is None:
        config = dataclasses.replace(config, sequence_pieces=sequence_split.call_pieces(
            q.shape, v.shape[-1], config, per_channel_gate=per_channel_gate, num_sms=heuristics.num_sms(device),
            ungated=decay is None and starts is None))
      opts = vjp.PallasOptions(scale=scale, with_final_state=return_final_state, config=config, interpret=interpret)
      o, final_state = vjp.delta_attention_pallas(q, k, v, beta, decay, starts, initial_state, opts)
    else:
      o, final_state = xla.chunked(q, k, v, beta, decay, starts, initial_state, scale=scale,
                                   chunk_size=XLA_CHUNK_SIZE)
  o = o.astype(q.dtype)
  if final_state is not None and sequence_axis is not None and sequence_axis in manual_axes.varying_axes(final_state):
    # One device along the axis: the final state is typed as the same on every
    # device of the axis, as with several (a sum over one device).
    final_state = jax.lax.psum(final_state, sequence_axis)
  return (o, final_state) if return_final_state else o


def _filled_config(config, q, v, decay, device):
  """config (None: every field) filled from `pallas_triton.default_config` for a call on device; where config forces
  the warp-specialised kernels (sm90's alone, also interpreted), for an sm90 device."""
  config = config or pallas_triton.DeltaConfig()
  cc = (WarpSpecializedConfig.COMPUTE_CAPABILITY if config.warp_specialized
        else heuristics.compute_capability(device))
  return config.filled(pallas_triton.default_config(
      per_channel_gate=decay is not None and decay.ndim == 4, dtype=q.dtype, dim_k=q.shape[-1], dim_v=v.shape[-1],
      compute_capability=cc, batch_heads=q.shape[0] * q.shape[2], num_sms=heuristics.num_sms(device)))


def _resolve_warp_specialized(config, q, v, *, cc, interpret):
  """config with `warp_specialized` resolved to a bool: True where asked or (None) where the warp-specialised
  forward runs compiled (its interpreter is for tests); ValueError where asked and it cannot run."""
  cannot = heuristics.warp_specialized_unsupported(dim_k=q.shape[-1], dim_v=v.shape[-1], dtype=q.dtype,
                                                   compute_capability=cc, interpret=interpret)
  if config.warp_specialized and cannot:
    raise ValueError(f"DeltaConfig(warp_specialized=True): the warp-specialised forward {cannot}")
  return dataclasses.replace(config, warp_specialized=not cannot and (
      config.warp_specialized or (config.warp_specialized is None and not interpret)))


def _pallas_sequences(q, k, v, beta, decay, cu_seqlens, initial_state, *, scale, with_final_state, config, interpret,
                      device):
  """`delta_attention`'s Pallas path for cu_seqlens with per-sequence states: the sequences chunk-aligned
  (`chunk.aligned_sequences`), a sweep program per sequence (`vjp.delta_attention_sequences_pallas`): the
  warp-specialised sweeps where they run."""
  cc = heuristics.compute_capability(device)
  interpret = lightning_api.pallas_interpret(interpret, cc, q)
  config = _resolve_warp_specialized(_filled_config(config, q, v, decay, device), q, v, cc=cc, interpret=interpret)
  config = dataclasses.replace(config, sequence_pieces=1)
  opts = vjp.PallasOptions(scale=scale, with_final_state=with_final_state, config=config, interpret=interpret)
  layout = chunk.aligned_sequences(cu_seqlens, q.shape[1], pallas_triton.sequence_chunk(config))
  aligned = (None if x is None else layout.to_layout(x) for x in (q, k, v, beta, decay))
  o, final_state = vjp.delta_attention_sequences_pallas(*aligned, layout.first, layout.end, initial_state, opts)
  return layout.from_layout(o), final_state


def sharded_delta_attention(q, k, v, beta, decay=None, *, mesh, batch_axes=None, head_axis=None, sequence_axis=None,
                            scale=None, initial_state=None, return_final_state=False, segment_ids=None,
                            cu_seqlens=None, normalize_qk=False, impl="auto", config=None, interpret=None):
  """`delta_attention` with B, H and T split over the axes of `mesh` (jit-able, differentiable).

  Each device runs the op on its own block of q, k, v (and beta, the rates
  and the segment ids, split with the tokens): q, k, v, o and their gradients
  never leave it. With `sequence_axis`, T is split too (sequence
  parallelism): devices along that axis hold consecutive slices of the
  sequence, and only the slices' float32 affine maps [B, H, D, D + E] cross
  devices (see `delta_attention`'s `sequence_axis`). With cu_seqlens (B = 1)
  and no per-sequence states the packing runs as its segment ids, sequence
  parallel; with per-sequence states T cannot be split this way: a
  sequence_axis then gathers T for the op and splits o again (the states
  [N, H, D, E] are split over H).

  Args:
    q, k: [B, T, H, D]; v: [B, T, H, E]; beta: [B, T, H]; decay: None,
      [B, T, H] or [B, T, H, D] rates (as in `delta_attention`).
    mesh: a `jax.sharding.Mesh`.
    batch_axes: None, a mesh axis name or a tuple of names splitting B.
    head_axis: None or a mesh axis name splitting H.
    sequence_axis: None or a mesh axis name splitting T.
    scale, initial_state, return_final_state, segment_ids, cu_seqlens,
      normalize_qk, impl, config, interpret: as in `delta_attention`.

  The inputs may live anywhere: under `jax.jit` they are laid out on the mesh
  as these axes say (pass them already sharded so to avoid a copy).

  Returns:
    o [B, T, H, E] split as the axes say, and with return_final_state the
    final state ([B, H, D, E], or [N, H, D, E] with cu_seqlens) float32 split
    over batch_axes and head_axis.
  """
  if cu_seqlens is not None and sequence_axis is not None and initial_state is None and not return_final_state:
    # No state per sequence: the packing is its segment ids', whose T splits.
    b, t = lightning_api.check_qkv(q, k, v)[:2]
    lightning_api.check_packing(segment_ids, cu_seqlens, b, t)
    # Formed whole on every device (a cumulative sum over T, which XLA would gather if it split it), then each
    # device's slice taken.
    segment_ids = jax.lax.with_sharding_constraint(packing.segment_ids_from_cu_seqlens(cu_seqlens, t),
                                                   jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    cu_seqlens = None
  gathered_t = sequence_axis is not None and cu_seqlens is not None

  def op(given, sequence_axis):
    out = delta_attention(given["q"], given["k"], given["v"], given["beta"], given.get("decay"), scale=scale,
                          initial_state=given.get("initial_state"), return_final_state=return_final_state,
                          segment_ids=given.get("segment_ids"), cu_seqlens=given.get("cu_seqlens"),
                          sequence_axis=sequence_axis, normalize_qk=normalize_qk, impl=impl, config=config,
                          interpret=interpret)
    return out if return_final_state else (out,)

  state = "bhde" if cu_seqlens is None else "nhde"  # n: the sequences, never split
  per_channel = decay is not None and getattr(decay, "ndim", None) == 4
  out = sharding.run_sharded(
      op, dict(q=(q, "bthd"), k=(k, "bthd"), v=(v, "bthe"), beta=(beta, "bth"),
               decay=(decay, "bthd" if per_channel else "bth"), initial_state=(initial_state, state),
               segment_ids=(segment_ids, "bt"), cu_seqlens=(cu_seqlens, "n")),
      mesh=mesh, batch_axes=batch_axes, head_axis=head_axis, sequence_axis=None if gathered_t else sequence_axis,
      out_labels=("bthe", state) if return_final_state else ("bthe",))
  if gathered_t:  # each device keeps its slice of T (no communication)
    spec = sharding.spec_of("bthe", mesh=mesh, batch_axes=batch_axes, head_axis=head_axis,
                            sequence_axis=sequence_axis)
    lay_out = jax.reshard if sharding.is_explicit(mesh) else jax.lax.with_sharding_constraint
    out = (lay_out(out[0], jax.sharding.NamedSharding(mesh, spec)), *out[1:])
  return out if return_final_state else out[0]


def _explicit_split(q, k, v, beta, decay, layout, **options):
  """`delta_attention` on the explicit mesh that q's type names, B, H and T split as in q."""
  mesh, (batch_axes, sequence_axes, head_axis) = layout
  return sharded_delta_attention(q, k, v, beta, decay, mesh=mesh, batch_axes=batch_axes, head_axis=head_axis,
                                 sequence_axis=sequence_axes, **options)
