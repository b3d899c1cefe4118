"""`LightningAttention` as a `flax.linen.Module`."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.linear import default_kernel_init

from lightning_jax import _layer_common as common

__all__ = ["LightningAttention"]


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
  output_gate: bool = True
  output_norm: str | None = "rms"
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
        learnable_decay=self.learnable_decay, feature_map=self.feature_map, output_gate=self.output_gate,
        output_norm=self.output_norm, scale=self.scale, impl=self.impl, variant=self.variant, config=self.config,
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
