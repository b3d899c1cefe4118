"""`LightningAttention` and `DeltaAttention` as `flax.linen.Module`s."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.linear import default_kernel_init

from lightning_jax import _delta_layer_common as delta_common
from lightning_jax import _layer_common as common

__all__ = ["DeltaAttention", "LightningAttention"]


class LightningAttention(nn.Module):
  __doc__ = common.LAYER_DOC + """
  Linen specifics: the recurrent state lives in the `cache` collection as
  `cached_state`, the segment id of each row's last token as
  `cached_segment_id`. Create them with `init_cache` (e.g.
  `layer.apply(variables, B, method="init_cache", mutable=["cache"])`) or, as
  Flax's decode caches, by `init` with decode=True (which only creates the
  zero cache); then apply with decode=True and mutable=["cache"].
  """

  num_heads: int
  in_features: int
  qkv_features: int | None = None
  out_features: int | None = None
  decay: Any = "alibi"
  layer_idx: int | None = None
  num_layers: int | None = None
  learnable_decay: bool = False
  feature_map: str = "silu"
  value_feature_map: str = "identity"
  output_gate: bool = True
  output_norm: str | None = "rms"
  norm_eps: float = common.NORM_EPSILON
  scale: float | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Any = default_kernel_init
  bias_init: Any = nn.initializers.zeros_init()
  use_bias: bool = True
  decode: bool = False
  impl: str = "auto"
  variant: str = "auto"
  config: Any = None
  mesh: Any = None
  batch_axes: Any = None
  head_axis: str | None = None
  sequence_axis: str | None = None

  def __post_init__(self):
    _ = self.spec  # validates the arguments at construction, as the NNX layer does
    super().__post_init__()

  @property
  def spec(self) -> common.LayerSpec:
    return common.make_spec(
        num_heads=self.num_heads, in_features=self.in_features, qkv_features=self.qkv_features,
        out_features=self.out_features, decay=self.decay, layer_idx=self.layer_idx, num_layers=self.num_layers,
        learnable_decay=self.learnable_decay, feature_map=self.feature_map,
        value_feature_map=self.value_feature_map, output_gate=self.output_gate, output_norm=self.output_norm,
        norm_eps=self.norm_eps, scale=self.scale, impl=self.impl, variant=self.variant, config=self.config,
        mesh=self.mesh, batch_axes=self.batch_axes, head_axis=self.head_axis, sequence_axis=self.sequence_axis)

  def init_cache(self, batch_size: int, dtype=jnp.float32) -> None:
    """Creates (or resets) `cache/cached_state`, a zero state [B, H, Dh, Dh], and
    `cache/cached_segment_id`, segment ids int32 [B] (zeros)."""
    shape = common.state_shape(batch_size, self.spec)
    self.put_variable("cache", "cached_state", jnp.zeros(shape, dtype))
    self.put_variable("cache", "cached_segment_id", jnp.zeros(shape[:1], jnp.int32))

  @nn.compact
  def __call__(self, inputs: jax.Array, *, decode: bool | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """inputs: [B, T, in_features] -> [B, T, out_features]; decode, segment_ids: the class docstring, "Call"."""
    spec = self.spec
    common.check_inputs(inputs, spec)
    common.check_segment_ids(segment_ids, inputs)
    heads = (spec.num_heads, spec.head_dim)
    dense = functools.partial(nn.DenseGeneral, dtype=self.dtype, param_dtype=self.param_dtype,
                              precision=self.precision, kernel_init=self.kernel_init, bias_init=self.bias_init,
                              use_bias=self.use_bias)
    q, k, v = (dense(features=heads, name=name)(inputs) for name in ("query", "key", "value"))
    decay_param = (self.param("decay", lambda _: common.decay_param_init(spec.decay).astype(self.param_dtype))
                   if spec.learnable_decay else None)
    kwargs = dict(
        decay=common.layer_decay(spec, decay_param),
        gate=dense(features=heads, name="gate")(inputs) if spec.output_gate else None,
        norm_scale=(self.param("norm", nn.initializers.ones, heads, self.param_dtype)
                    if spec.output_norm else None))
    out = dense(features=spec.out_features, axis=(-2, -1), name="out")
    if not (self.decode if decode is None else decode):
      return out(common.attend(spec, q, k, v, segment_ids=segment_ids, **kwargs)[0])
    initializing = self.is_initializing()
    if not (initializing or self.has_variable("cache", "cached_state")):
      common.check_state(None, inputs.shape[0], spec)  # raises: call init_cache first
    shape = common.state_shape(inputs.shape[0], spec)
    state = self.variable("cache", "cached_state", jnp.zeros, shape, jnp.float32)
    ids = self.variable("cache", "cached_segment_id", jnp.zeros, shape[:1], jnp.int32)
    common.check_state(state.value, inputs.shape[0], spec)
    o, (new_state, new_ids) = common.attend(spec, q, k, v, segment_ids=segment_ids,
                                            cache=(state.value, ids.value), **kwargs)
    if not initializing:  # init only creates the zero cache, as Flax's decode caches do
      state.value, ids.value = new_state, new_ids
    return out(o)


class DeltaAttention(nn.Module):
  __doc__ = delta_common.LAYER_DOC + """
  Linen specifics: the decode cache lives in the `cache` collection as
  `cached_state` (the recurrent state), `cached_q_conv`, `cached_k_conv`,
  `cached_v_conv` (the convolution windows) and `cached_segment_id`. Create it
  with `init_cache` (e.g. `layer.apply(variables, B, method="init_cache",
  mutable=["cache"])`) or, as Flax's decode caches, by `init` with decode=True
  (which only creates the zero cache); then apply with decode=True and
  mutable=["cache"].
  """

  num_heads: int
  in_features: int
  num_v_heads: int | None = None
  head_dim: int | None = None
  value_head_dim: int | None = None
  out_features: int | None = None
  gate: str | None = "kda"
  gate_rank: int | None = None
  output_gate_activation: str | None = "sigmoid"
  output_gate_rank: int | None = None
  full_rank_output_gate: bool = False
  allow_neg_eigval: bool = False
  conv_size: int = 4
  norm_eps: float = 1e-6
  scale: float | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Any = default_kernel_init
  bias_init: Any = nn.initializers.zeros_init()
  use_bias: bool = False
  decode: bool = False
  impl: str = "auto"
  mesh: jax.sharding.Mesh | None = None
  batch_axes: tuple[str, ...] | str | None = None
  head_axis: str | None = None
  sequence_axis: str | None = None

  def __post_init__(self):
    _ = self.spec  # validates the arguments at construction, as the NNX layer does
    super().__post_init__()

  @property
  def spec(self) -> delta_common.DeltaSpec:
    return delta_common.make_spec(
        num_heads=self.num_heads, in_features=self.in_features, num_v_heads=self.num_v_heads,
        head_dim=self.head_dim, value_head_dim=self.value_head_dim, out_features=self.out_features,
        gate=self.gate, gate_rank=self.gate_rank, output_gate_activation=self.output_gate_activation,
        output_gate_rank=self.output_gate_rank, full_rank_output_gate=self.full_rank_output_gate,
        allow_neg_eigval=self.allow_neg_eigval, conv_size=self.conv_size, norm_eps=self.norm_eps, scale=self.scale,
        use_bias=self.use_bias, impl=self.impl, mesh=self.mesh, batch_axes=self.batch_axes, head_axis=self.head_axis,
        sequence_axis=self.sequence_axis)

  def init_cache(self, batch_size: int) -> None:
    """Creates (or resets) the decode cache for batch_size rows: zeros (see the class docstring)."""
    for name, (shape, dtype) in delta_common.cache_shapes(batch_size, self.spec).items():
      self.put_variable("cache", name, jnp.zeros(shape, dtype))

  @nn.compact
  def __call__(self, inputs: jax.Array, *, segment_ids: jax.Array | None = None,
               decode: bool | None = None) -> jax.Array:
    """inputs: [B, T, in_features] -> [B, T, out_features]; segment_ids, decode: the class docstring, "Call"."""
    spec = self.spec
    common.check_inputs(inputs, spec)
    common.check_segment_ids(segment_ids, inputs)
    dense = {name: nn.DenseGeneral(fan_out, axis=tuple(range(-len(fan_in), 0)) if isinstance(fan_in, tuple) else -1,
                                   use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                                   precision=self.precision, kernel_init=self.kernel_init, bias_init=self.bias_init,
                                   name=name)
             for name, fan_in, fan_out in delta_common.projections(spec)}
    acts = delta_common.project(spec, dense.__getitem__, inputs)
    params = {name: self.param(name, init, shape, self.param_dtype)
              for name, (shape, init) in delta_common.param_specs(spec).items()}
    if not (self.decode if decode is None else decode):
      return dense["o_proj"](delta_common.mix(spec, acts, params, segment_ids)[0])
    initializing = self.is_initializing()
    if not (initializing or self.has_variable("cache", "cached_state")):
      delta_common.check_cache(None, inputs.shape[0], spec)  # raises: call init_cache first
    cache = {name: self.variable("cache", name, jnp.zeros, shape, dtype)
             for name, (shape, dtype) in delta_common.cache_shapes(inputs.shape[0], spec).items()}
    delta_common.check_cache({name: var.value for name, var in cache.items()}, inputs.shape[0], spec)
    o, new_cache = delta_common.mix(spec, acts, params, segment_ids, {name: var.value for name, var in cache.items()})
    if not initializing:  # init only creates the zero cache, as Flax's decode caches do
      for name, var in cache.items():
        var.value = new_cache[name]
    return dense["o_proj"](o)
