"""Framework-free pieces shared by the NNX and Linen `LightningAttention` layers
and by `attention_fn`: argument validation, decay rules, feature maps and the
attention core (feature map -> linear attention -> norm -> gate).

Shapes: B batch, T tokens, H heads, D key/query head dim, E value head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from lightning_jax import slopes
from lightning_jax.ops.lightning_attention import api as op_api
from lightning_jax.ops.lightning_attention import reference
from lightning_jax.ops.lightning_attention.config import LightningConfig

FEATURE_MAPS = {
    "identity": lambda x: x,
    # TransNormerLLM and MiniMax-01 apply SiLU to q and k (MiniMax-01 to v as well).
    "silu": jax.nn.silu,
    # Katharopoulos et al. (2020), "Transformers are RNNs".
    "elu_plus_one": lambda x: jax.nn.elu(x) + 1,
    "relu": jax.nn.relu,
}
DECAY_NAMES = ("alibi", "minimax")
# "rms": one RMS norm over all heads' outputs (H*E features), as MiniMax-01 and
# TransNormerLLM normalise the concatenated head outputs; "head_rms": one per head.
OUTPUT_NORMS = (None, "rms", "head_rms")
# The output norm's default epsilon (MiniMax-01's, and TransNormerLLM's).
NORM_EPSILON = 1e-6
# softplus never reaches 0: a learnable rate of 0 starts here instead.
MIN_LEARNABLE_RATE = 1e-6


def _is_int(value, minimum):
  return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def check_decay(decay, layer_idx, num_layers) -> None:
  """Validates a decay spec (None, "alibi", "minimax" or an [H] array) up to its length."""
  if decay is None:
    return
  if isinstance(decay, str):
    if decay not in DECAY_NAMES:
      raise ValueError(f"decay must be None, one of {DECAY_NAMES} or an [H] array of rates, got {decay!r}")
    if decay == "minimax" and (layer_idx is None or num_layers is None):
      raise ValueError("decay='minimax' scales the slopes by depth and needs layer_idx and num_layers, got "
                       f"layer_idx={layer_idx!r}, num_layers={num_layers!r}")
    return
  if isinstance(decay, jax.core.Tracer):
    raise TypeError("decay must be a concrete [H] array (it configures the layer), not a traced value; "
                    "use learnable_decay=True to train it")
  try:
    rates = np.asarray(decay, np.float64)
  except (TypeError, ValueError):
    raise TypeError(f"decay must be None, one of {DECAY_NAMES} or an [H] array of rates, "
                    f"got {type(decay).__name__}") from None
  if rates.ndim != 1 or not np.all(np.isfinite(rates)) or np.any(rates < 0):
    raise ValueError(f"decay as an array must be [H] finite rates >= 0 (a = exp(-rate)), got {rates!r}")


def decay_rates(decay, num_heads, layer_idx=None, num_layers=None) -> np.ndarray | None:
  """Checks a decay spec and resolves it to float32 [H] rates (numpy), or None for no decay."""
  check_decay(decay, layer_idx, num_layers)
  if decay is None:
    return None
  if isinstance(decay, str):
    if decay == "alibi":
      return slopes.alibi_slopes(num_heads)
    return slopes.minimax_slopes(num_heads, layer_idx, num_layers)
  rates = np.asarray(decay, np.float32)
  if rates.shape != (num_heads,):
    raise ValueError(f"decay must have one rate per head, shape [{num_heads}], got shape {rates.shape}")
  return rates


def decay_param_init(rates) -> jax.Array:
  """Unconstrained value u with softplus(u) = rates (inverse softplus), float32 [H]."""
  r = jnp.maximum(jnp.asarray(rates, jnp.float32), MIN_LEARNABLE_RATE)
  return r + jnp.log(-jnp.expm1(-r))  # log(exp(r) - 1) without overflow


def layer_decay(spec: "LayerSpec", param) -> jax.Array | None:
  """The layer's float32 [H] rates: softplus of the unconstrained `decay` param when
  learnable (so they stay >= 0), else the fixed rates of the spec (or None)."""
  if spec.learnable_decay:
    return jax.nn.softplus(param.astype(jnp.float32))
  return None if spec.decay is None else jnp.asarray(spec.decay, jnp.float32)


@dataclasses.dataclass(frozen=True)
class LayerSpec:
  """Checked, resolved constructor arguments of a LightningAttention layer (hashable)."""
  num_heads: int
  in_features: int
  qkv_features: int
  out_features: int
  head_dim: int
  decay: tuple[float, ...] | None  # fixed rates, or the initial rates when learnable
  learnable_decay: bool
  feature_map: str
  value_feature_map: str
  output_gate: bool
  output_norm: str | None
  norm_eps: float
  scale: float
  impl: str
  variant: str
  config: LightningConfig | None
  sharding: Sharding | None = None


@dataclasses.dataclass(frozen=True)
class Sharding:
  """Where the op runs: over `mesh` (`sharded_lightning_attention`), or, mesh None, inside the caller's
  shard_map with T split over `sequence_axis`."""
  mesh: jax.sharding.Mesh | None
  batch_axes: tuple[str, ...] | str | None
  head_axis: str | None
  sequence_axis: str | None


def make_sharding(*, mesh, batch_axes, head_axis, sequence_axis) -> Sharding | None:
  """Checks the layer's mesh arguments (None when none is given)."""
  if mesh is None and batch_axes is None and head_axis is None and sequence_axis is None:
    return None
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(f"mesh must be None or a jax.sharding.Mesh, got {type(mesh).__name__}")
  for name, axis in (("head_axis", head_axis), ("sequence_axis", sequence_axis)):
    if axis is not None and not isinstance(axis, str):
      raise TypeError(f"{name} must be None or a mesh axis name, got {axis!r}")
  if mesh is None and (batch_axes is not None or head_axis is not None):
    raise ValueError("batch_axes and head_axis need a mesh (inside your own shard_map, give sequence_axis only)")
  if isinstance(batch_axes, list):
    batch_axes = tuple(batch_axes)
  names = (() if batch_axes is None else (batch_axes,) if isinstance(batch_axes, str) else batch_axes) + tuple(
      a for a in (head_axis, sequence_axis) if a is not None)
  if mesh is not None and any(a not in mesh.axis_names for a in names):
    raise ValueError(f"mesh axes {names} must be among the mesh's {tuple(mesh.axis_names)}")
  return Sharding(mesh, batch_axes, head_axis, sequence_axis)


def make_spec(*, num_heads, in_features, qkv_features, out_features, decay, layer_idx, num_layers,
              learnable_decay, feature_map, value_feature_map, output_gate, output_norm, norm_eps, scale, impl,
              variant, config, mesh=None, batch_axes=None, head_axis=None, sequence_axis=None) -> LayerSpec:
  """Validates the layer arguments (clear errors naming each one) and resolves defaults."""
  for name, value, optional in (("num_heads", num_heads, False), ("in_features", in_features, False),
                                ("qkv_features", qkv_features, True), ("out_features", out_features, True)):
    if not (optional and value is None) and not _is_int(value, 1):
      raise ValueError(f"{name} must be {'None or ' if optional else ''}an int >= 1, got {value!r}")
  qkv_features = in_features if qkv_features is None else qkv_features
  if qkv_features % num_heads:
    raise ValueError(f"qkv_features ({qkv_features}; in_features when None) must be divisible by "
                     f"num_heads ({num_heads})")
  head_dim = qkv_features // num_heads
  if head_dim > op_api.MAX_HEAD_DIM:
    raise ValueError(f"head dim qkv_features / num_heads = {head_dim} exceeds the op's limit {op_api.MAX_HEAD_DIM}")
  if not isinstance(learnable_decay, bool):
    raise TypeError(f"learnable_decay must be a bool, got {learnable_decay!r}")
  if learnable_decay and decay is None:
    raise ValueError("learnable_decay=True needs initial rates: decay='alibi', 'minimax' or an [H] array, got None")
  rates = decay_rates(decay, num_heads, layer_idx, num_layers)
  for name, fmap in (("feature_map", feature_map), ("value_feature_map", value_feature_map)):
    if fmap not in FEATURE_MAPS:
      raise ValueError(f"{name} must be one of {tuple(FEATURE_MAPS)}, got {fmap!r}")
  if not isinstance(output_gate, bool):
    raise TypeError(f"output_gate must be a bool, got {output_gate!r}")
  if output_norm not in OUTPUT_NORMS:
    raise ValueError(f"output_norm must be one of {OUTPUT_NORMS}, got {output_norm!r}")
  if not isinstance(norm_eps, numbers.Real) or isinstance(norm_eps, bool) or not norm_eps > 0:
    raise ValueError(f"norm_eps must be a float > 0, got {norm_eps!r}")
  op_api.validate_options(scale=scale, impl=impl, variant=variant, config=config)
  return LayerSpec(
      num_heads=num_heads, in_features=in_features, qkv_features=qkv_features,
      out_features=in_features if out_features is None else out_features, head_dim=head_dim,
      decay=None if rates is None else tuple(float(r) for r in rates), learnable_decay=learnable_decay,
      feature_map=feature_map, value_feature_map=value_feature_map, output_gate=output_gate,
      output_norm=output_norm, norm_eps=float(norm_eps), scale=float(head_dim ** -0.5 if scale is None else scale),
      impl=impl, variant=variant, config=config,
      sharding=make_sharding(mesh=mesh, batch_axes=batch_axes, head_axis=head_axis, sequence_axis=sequence_axis))


def check_inputs(inputs, spec: LayerSpec) -> None:
  if inputs.ndim != 3 or inputs.shape[-1] != spec.in_features:
    raise ValueError(f"inputs must be [B, T, in_features={spec.in_features}], got shape {inputs.shape}")


def check_segment_ids(segment_ids, inputs) -> None:
  """segment_ids must be None or an integer [B, T] array matching inputs [B, T, F]."""
  if segment_ids is None:
    return
  if not hasattr(segment_ids, "shape") or not hasattr(segment_ids, "dtype"):
    raise TypeError(f"segment_ids must be None or an integer [B, T] array, got {type(segment_ids).__name__}")
  if tuple(segment_ids.shape) != tuple(inputs.shape[:2]):
    raise ValueError(f"segment_ids must be [B, T] = {list(inputs.shape[:2])} like the inputs, got shape "
                     f"{tuple(segment_ids.shape)}")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise TypeError(f"segment_ids must be an integer array, got {segment_ids.dtype}")


def state_shape(batch_size, spec: LayerSpec) -> tuple[int, int, int, int]:
  """Shape [B, H, D, E] of the decode cache (D = E = head_dim)."""
  if not _is_int(batch_size, 1):
    raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
  return (int(batch_size), spec.num_heads, spec.head_dim, spec.head_dim)


def check_state(state, batch_size, spec: LayerSpec) -> None:
  if state is None:
    raise ValueError("decode=True needs the recurrent state: call init_cache(batch_size) first")
  if tuple(state.shape) != state_shape(batch_size, spec):
    raise ValueError(f"decode cache holds a state of shape {tuple(state.shape)} but the inputs need "
                     f"{state_shape(batch_size, spec)}: call init_cache with batch_size={batch_size}")


def rms_norm(x, scale, axes, eps) -> jax.Array:
  """RMS norm of x over `axes` (in float32) with epsilon eps, times `scale`; returns x.dtype."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=axes, keepdims=True) + eps)
  return (xf * scale.astype(jnp.float32)).astype(x.dtype)


# `linear_attention` and `attend` are jitted so that eager calls (e.g. a decode
# loop outside jit) compile once per shape instead of dispatching op by op;
# under an outer jit they are inlined.
@functools.partial(jax.jit, static_argnames=("scale", "impl", "variant", "config", "interpret", "sharding"))
def linear_attention(q, k, v, decay, *, scale, impl, variant, config, interpret=None, state=None, segment_ids=None,
                     sharding: Sharding | None = None):
  """Causal linear attention; with `state` also returns the state after these tokens.

  q, k: [B, T, H, D]; v: [B, T, H, E]; decay: float32 [H] or None; state: [B, H, D, E]
  or None; segment_ids: int [B, T] or None (packed sequences; `state` feeds each
  row's first segment); sharding: where the op runs (`Sharding`), or None.
  Returns o [B, T, H, E] (q.dtype), or (o, new float32 state: at the end of
  each row's last segment) given `state`.
  """
  if state is not None and q.shape[1] == 1:
    # A decode step: a few flops in jnp (the oracle's scan), not worth a kernel
    # launch (XLA splits it over any mesh). One token is one segment: its ids
    # change nothing here (the caller restarts the state).
    o, new_state = reference.lightning_attention_recurrent(q, k, v, decay, scale=scale, initial_state=state)
    return o.astype(q.dtype), new_state
  # Chunked prefill (with `state`): the kernel resumes from and returns the state.
  kwargs = dict(scale=scale, initial_state=state, return_final_state=state is not None, segment_ids=segment_ids,
                impl=impl, variant=variant, config=config, interpret=interpret)
  if sharding is not None and sharding.mesh is not None:
    return op_api.sharded_lightning_attention(q, k, v, decay, mesh=sharding.mesh, batch_axes=sharding.batch_axes,
                                              head_axis=sharding.head_axis, sequence_axis=sharding.sequence_axis,
                                              **kwargs)
  return op_api.lightning_attention(q, k, v, decay, sequence_axis=None if sharding is None else sharding.sequence_axis,
                                    **kwargs)


@functools.partial(jax.jit, static_argnames="spec")
def attend(spec: LayerSpec, q, k, v, *, decay, gate=None, norm_scale=None, segment_ids=None, cache=None):
  """The layer between its projections: feature maps, linear attention, output norm and gate.

  q, k, v: [B, T, H, head_dim] projections; decay: float32 [H] or None; gate:
  [B, T, H, head_dim] pre-sigmoid gate (or None); norm_scale: [H, head_dim] (or
  None); segment_ids: int [B, T] or None; cache: the decode cache (state
  [B, H, D, E], segment id of the last cached token int32 [B]) or None.
  Returns (o [B, T, H, head_dim], the updated cache or None).
  """
  state = None
  if cache is not None:
    state, last_ids = cache
    if segment_ids is not None:
      # A row whose first token has another id than its last cached token starts a
      # new segment, so it starts from a zero state instead of the cached one.
      same = segment_ids[:, 0].astype(jnp.int32) == last_ids
      state = jnp.where(same[:, None, None, None], state, jnp.zeros_like(state))
      last_ids = segment_ids[:, -1].astype(jnp.int32)
  fmap = FEATURE_MAPS[spec.feature_map]
  q, k, v = fmap(q), fmap(k), FEATURE_MAPS[spec.value_feature_map](v)
  out = linear_attention(q, k, v, decay, scale=spec.scale, impl=spec.impl, variant=spec.variant,
                         config=spec.config, state=state, segment_ids=segment_ids, sharding=spec.sharding)
  o, new_cache = (out, None) if state is None else (out[0], (out[1].astype(state.dtype), last_ids))
  if spec.output_norm is not None:
    o = rms_norm(o, norm_scale, (-2, -1) if spec.output_norm == "rms" else -1, spec.norm_eps)
  if gate is not None:
    # MiniMax-01's output gate: norm(attn) * sigmoid(x W_gate). (TransNormerLLM
    # multiplies by the un-activated projection instead.)
    o = o * jax.nn.sigmoid(gate).astype(o.dtype)
  return o, new_cache


LAYER_DOC = """Lightning Attention layer: causal linear attention with per-head decay.

  For inputs x [B, T, in_features], with H = num_heads and head dim
  Dh = qkv_features // H:

      q, k = phi(x W_query), phi(x W_key);  v = psi(x W_value)   [B, T, H, Dh]
      S_t = exp(-rate_h) S_{t-1} + k_t^T v_t;  o_t = scale * q_t S_t  (the op)
      o = norm(o) * sigmoid(x W_gate)                   (when enabled)
      y = o W_out                                        [B, T, out_features]

  With the defaults (silu feature map, RMS output norm, sigmoid output gate)
  this is the MiniMax-01 lightning-attention block (Li et al., 2025), itself the
  TransNormerLLM block (Qin et al., 2023) with a sigmoid gate; with decay
  "minimax" its slopes too. MiniMax-01 also applies its SiLU to v
  (value_feature_map="silu") and uses scale 1.0;
  `lightning_jax.interop.minimax_lightning_attention` sets these options from a
  Hugging Face config.

  Parameters (the same names and shapes in the NNX and Linen layers, so a
  parameter dict moves between them): `query`, `key`, `value` and `gate`
  {kernel [in_features, H, Dh], bias [H, Dh]}, `out` {kernel [H, Dh,
  out_features], bias [out_features]}, `norm` [H, Dh] (RMS-norm scale) and
  `decay` [H]: the unconstrained value u with rate = softplus(u) >= 0,
  initialised so that the initial rates equal the chosen slopes.

  Args:
    num_heads: H; must divide qkv_features.
    in_features: features of the inputs.
    qkv_features: H * Dh, default in_features.
    out_features: output features, default in_features.
    decay: per-head decay rates (a = exp(-rate)): "alibi" (default;
      `alibi_slopes`), "minimax" (`minimax_slopes`: ALiBi scaled by depth as in
      TransNormerLLM / MiniMax-01; needs layer_idx and num_layers), None (no
      decay: plain causal linear attention) or an explicit [H] array of rates
      >= 0. flash-linear-attention's `chunk_lightning_attn` uses another rule;
      pass its rates as an array to reproduce it.
    layer_idx, num_layers: the depth used by decay="minimax".
    learnable_decay: train the rates as the `decay` parameter (softplus
      parametrisation, starting at the rates above; a rate of 0 starts at 1e-6).
    feature_map: phi, applied to q and k: "silu" (default; TransNormerLLM /
      MiniMax-01), "identity", "elu_plus_one" (Katharopoulos et al., 2020) or
      "relu".
    value_feature_map: psi, applied to v, one of the same: "identity"
      (default) or "silu" (MiniMax-01 applies its activation to the whole fused
      qkv projection).
    output_gate: multiply the attention output by sigmoid(x W_gate) (MiniMax-01;
      TransNormerLLM gates with the un-activated projection) before `out`.
    output_norm: "rms" (default): RMS norm over all heads' outputs (H * Dh
      features) as in MiniMax-01 / TransNormerLLM; "head_rms": over each head's
      Dh features; None: no norm. Learnable scale `norm`.
    norm_eps: epsilon of the output norm (default 1e-6, MiniMax-01's).
    scale: multiplies q in the op; default Dh ** -0.5 (MiniMax-01 uses 1.0).
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: parameter dtype (default float32).
    precision: precision of the projections (the op accumulates in float32).
    kernel_init, bias_init, use_bias: of the projections.
    decode: consume tokens against the recurrent state of the decode cache
      (`init_cache`) and update it; overridable per call.
    impl, variant, config: passed to `lightning_attention` ("auto": the Pallas
      kernels on supported GPUs, the chunked XLA path elsewhere).
    mesh, batch_axes, head_axis, sequence_axis: several devices. With a
      `jax.sharding.Mesh`, the op runs through `sharded_lightning_attention`
      with B split over batch_axes, H over head_axis and T over sequence_axis
      (sequence parallelism; a name each, batch_axes also a tuple). Without a
      mesh, sequence_axis alone: the layer is called inside your own
      `jax.shard_map` with T split over that axis. One-token decode steps run
      in jnp, which XLA splits by itself.

  Call: `layer(inputs, *, decode=None, segment_ids=None)`, inputs [B, T,
  in_features] -> [B, T, out_features]. With decode (this argument, else the
  attribute) the T tokens continue the sequence held in the decode cache and
  update it: T == 1 is one jnp step of the recurrence, T > 1 a chunked prefill
  through the kernel. segment_ids: None or int [B, T], packed sequences. A
  segment is a maximal run of equal ids in a row; a token attends only to the
  earlier tokens of its own segment (give padding an id of its own). With
  decode, the cache holds per row the state at the end of its last segment
  and that segment's id; a call's first segment in a row continues the cached
  state when its id equals the cached id, else it starts from a zero state.
  So one-token steps with [B, 1] ids continue or restart each row (continuous
  batching), and calls without segment_ids continue every row's last segment.
  When decoding after a packed prefill, pad prompts on the left: decoding
  continues each row's last segment.
  """
