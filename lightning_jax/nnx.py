"""`LightningAttention` as a `flax.nnx.Module`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_kernel_init

from lightning_jax import _layer_common as common

__all__ = ["LightningAttention"]


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
               output_gate: bool = True, output_norm: str | None = "rms", scale: float | None = None,
               dtype=None, param_dtype=jnp.float32, precision=None, kernel_init=default_kernel_init,
               bias_init=initializers.zeros_init(), use_bias: bool = True, decode: bool = False,
               impl: str = "auto", variant: str = "auto", config=None, mesh=None, batch_axes=None,
               head_axis: str | None = None, sequence_axis: str | None = None, rngs: nnx.Rngs):
    self.spec = spec = common.make_spec(
        num_heads=num_heads, in_features=in_features, qkv_features=qkv_features, out_features=out_features,
        decay=decay, layer_idx=layer_idx, num_layers=num_layers, learnable_decay=learnable_decay,
        feature_map=feature_map, output_gate=output_gate, output_norm=output_norm, scale=scale, impl=impl,
        variant=variant, config=config, mesh=mesh, batch_axes=batch_axes, head_axis=head_axis,
        sequence_axis=sequence_axis)
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
