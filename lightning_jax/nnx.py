"""`LightningAttention` and `DeltaAttention` as `flax.nnx.Module`s."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_kernel_init

from lightning_jax import _delta_layer_common as delta_common
from lightning_jax import _layer_common as common

__all__ = ["DeltaAttention", "LightningAttention"]


class LightningAttention(nnx.Module):
  __doc__ = common.LAYER_DOC + """
  NNX specifics: `rngs` (nnx.Rngs) initialises the parameters. `init_cache`
  stores the recurrent state in the `nnx.Cache` variable `cached_state` and
  the segment id of each row's last token in `cached_segment_id`.

  Example::

    layer = LightningAttention(4, 64, rngs=nnx.Rngs(0))
    y = layer(x)                          # x: [B, T, 64] -> [B, T, 64]
    layer.init_cache(batch_size=B)
    y0 = layer(prompt, decode=True)       # chunked prefill, updates the state
    y1 = layer(next_token, decode=True)   # [B, 1, 64]: one recurrent step
    y = layer(x, segment_ids=ids)         # packed sequences, ids: int [B, T]
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, *, decay="alibi", layer_idx: int | None = None,
               num_layers: int | None = None, learnable_decay: bool = False, feature_map: str = "silu",
               value_feature_map: str = "identity", output_gate: bool = True, output_norm: str | None = "rms",
               norm_eps: float = common.NORM_EPSILON, scale: float | None = None,
               dtype=None, param_dtype=jnp.float32, precision=None, kernel_init=default_kernel_init,
               bias_init=initializers.zeros_init(), use_bias: bool = True, decode: bool = False,
               impl: str = "auto", variant: str = "auto", config=None, mesh=None, batch_axes=None,
               head_axis: str | None = None, sequence_axis: str | None = None, rngs: nnx.Rngs):
    self.spec = spec = common.make_spec(
        num_heads=num_heads, in_features=in_features, qkv_features=qkv_features, out_features=out_features,
        decay=decay, layer_idx=layer_idx, num_layers=num_layers, learnable_decay=learnable_decay,
        feature_map=feature_map, value_feature_map=value_feature_map, output_gate=output_gate,
        output_norm=output_norm, norm_eps=norm_eps, scale=scale, impl=impl, variant=variant, config=config,
        mesh=mesh, batch_axes=batch_axes, head_axis=head_axis, sequence_axis=sequence_axis)
    self.decode = decode
    heads = (spec.num_heads, spec.head_dim)
    linear = functools.partial(nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype, precision=precision,
                               kernel_init=kernel_init, bias_init=bias_init, use_bias=use_bias, rngs=rngs)
    self.query, self.key, self.value = (linear(spec.in_features, heads) for _ in range(3))
    self.gate = linear(spec.in_features, heads) if spec.output_gate else None
    self.norm = nnx.Param(jnp.ones(heads, param_dtype)) if spec.output_norm else None
    self.decay = (nnx.Param(common.decay_param_init(spec.decay).astype(param_dtype))
                  if spec.learnable_decay else None)
    self.out = linear(heads, spec.out_features, axis=(-2, -1))
    # Assigned by init_cache; nnx.data so that a Cache can replace the None.
    self.cached_state: nnx.Cache | None = nnx.data(None)
    self.cached_segment_id: nnx.Cache | None = nnx.data(None)

  def decay_rates(self) -> jax.Array | None:
    """Current float32 [H] decay rates (None without decay)."""
    return common.layer_decay(self.spec, None if self.decay is None else self.decay[...])

  def init_cache(self, batch_size: int, dtype=jnp.float32) -> None:
    """Creates (or resets) the decode cache: a zero state [B, H, Dh, Dh] in
    `cached_state` and segment ids int32 [B] (zeros) in `cached_segment_id`."""
    shape = common.state_shape(batch_size, self.spec)
    self.cached_state = nnx.Cache(jnp.zeros(shape, dtype))
    self.cached_segment_id = nnx.Cache(jnp.zeros(shape[:1], jnp.int32))

  def __call__(self, inputs: jax.Array, *, decode: bool | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """inputs: [B, T, in_features] -> [B, T, out_features]; decode, segment_ids: the class docstring, "Call"."""
    common.check_inputs(inputs, self.spec)
    common.check_segment_ids(segment_ids, inputs)
    q, k, v = self.query(inputs), self.key(inputs), self.value(inputs)
    kwargs = dict(decay=self.decay_rates(), gate=None if self.gate is None else self.gate(inputs),
                  norm_scale=None if self.norm is None else self.norm[...])
    if not (self.decode if decode is None else decode):
      return self.out(common.attend(self.spec, q, k, v, segment_ids=segment_ids, **kwargs)[0])
    state = None if self.cached_state is None else self.cached_state[...]
    common.check_state(state, inputs.shape[0], self.spec)
    o, (new_state, new_ids) = common.attend(self.spec, q, k, v, segment_ids=segment_ids,
                                            cache=(state, self.cached_segment_id[...]), **kwargs)
    self.cached_state[...], self.cached_segment_id[...] = new_state, new_ids
    return self.out(o)


class DeltaAttention(nnx.Module):
  __doc__ = delta_common.LAYER_DOC + """
  NNX specifics: `rngs` (nnx.Rngs) initialises the parameters. `init_cache`
  creates the decode cache as `nnx.Cache` variables: `cached_state` (the
  recurrent state), `cached_q_conv`, `cached_k_conv`, `cached_v_conv` (the
  convolution windows) and `cached_segment_id`.

  Example::

    layer = DeltaAttention(4, 256, head_dim=64, rngs=nnx.Rngs(0))   # Kimi Linear's KDA
    y = layer(x)                          # x: [B, T, 256] -> [B, T, 256]
    layer.init_cache(batch_size=B)
    y0 = layer(prompt, decode=True)       # chunked prefill, updates the cache
    y1 = layer(next_token, decode=True)   # [B, 1, 256]: one recurrent step
    y = layer(x, segment_ids=ids)         # packed sequences, ids: int [B, T]
  """

  def __init__(self, num_heads: int, in_features: int, *, num_v_heads: int | None = None,
               head_dim: int | None = None, value_head_dim: int | None = None, out_features: int | None = None,
               gate: str | None = "kda", gate_rank: int | None = None, output_gate_activation: str | None = "sigmoid",
               output_gate_rank: int | None = None, full_rank_output_gate: bool = False,
               allow_neg_eigval: bool = False, conv_size: int = 4, norm_eps: float = 1e-6, scale: float | None = None,
               dtype=None, param_dtype=jnp.float32, precision=None, kernel_init=default_kernel_init,
               bias_init=initializers.zeros_init(), use_bias: bool = False, decode: bool = False, impl: str = "auto",
               mesh: jax.sharding.Mesh | None = None, batch_axes: tuple[str, ...] | str | None = None,
               head_axis: str | None = None, sequence_axis: str | None = None, rngs: nnx.Rngs):
    self.spec = spec = delta_common.make_spec(
        num_heads=num_heads, in_features=in_features, num_v_heads=num_v_heads, head_dim=head_dim,
        value_head_dim=value_head_dim, out_features=out_features, gate=gate, gate_rank=gate_rank,
        output_gate_activation=output_gate_activation, output_gate_rank=output_gate_rank,
        full_rank_output_gate=full_rank_output_gate, allow_neg_eigval=allow_neg_eigval, conv_size=conv_size,
        norm_eps=norm_eps, scale=scale, use_bias=use_bias, impl=impl, mesh=mesh, batch_axes=batch_axes,
        head_axis=head_axis, sequence_axis=sequence_axis)
    self.decode = decode
    for name, fan_in, fan_out in delta_common.projections(spec):
      axis = tuple(range(-len(fan_in), 0)) if isinstance(fan_in, tuple) else -1
      setattr(self, name, nnx.LinearGeneral(fan_in, fan_out, axis=axis, use_bias=use_bias, dtype=dtype,
                                            param_dtype=param_dtype, precision=precision, kernel_init=kernel_init,
                                            bias_init=bias_init, rngs=rngs))
    for name, (shape, init) in delta_common.param_specs(spec).items():
      setattr(self, name, nnx.Param(init(rngs.params(), shape, param_dtype)))
    # Assigned by init_cache; nnx.data so that a Cache can replace the None.
    for name in delta_common.CACHE_NAMES:
      setattr(self, name, nnx.data(None))

  def init_cache(self, batch_size: int) -> None:
    """Creates (or resets) the decode cache for batch_size rows: zeros (see the class docstring)."""
    for name, (shape, dtype) in delta_common.cache_shapes(batch_size, self.spec).items():
      setattr(self, name, nnx.Cache(jnp.zeros(shape, dtype)))

  def __call__(self, inputs: jax.Array, *, segment_ids: jax.Array | None = None,
               decode: bool | None = None) -> jax.Array:
    """inputs: [B, T, in_features] -> [B, T, out_features]; segment_ids, decode: the class docstring, "Call"."""
    spec = self.spec
    common.check_inputs(inputs, spec)
    common.check_segment_ids(segment_ids, inputs)
    acts = delta_common.project(spec, lambda name: getattr(self, name), inputs)
    params = {name: getattr(self, name)[...] for name in delta_common.param_specs(spec)}
    if not (self.decode if decode is None else decode):
      return self.o_proj(delta_common.mix(spec, acts, params, segment_ids)[0])
    cache = None if self.cached_state is None else {name: getattr(self, name)[...]
                                                    for name in delta_common.CACHE_NAMES}
    delta_common.check_cache(cache, inputs.shape[0], spec)
    o, cache = delta_common.mix(spec, acts, params, segment_ids, cache)
    for name, value in cache.items():
      getattr(self, name)[...] = value
    return self.o_proj(o)
