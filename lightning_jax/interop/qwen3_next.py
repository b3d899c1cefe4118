"""Qwen3-Next's Gated DeltaNet layer: transformers' `Qwen3NextGatedDeltaNet`
(models/qwen3_next/modeling_qwen3_next.py) as `lightning_jax.nnx.DeltaAttention`, and back.

The block is `DeltaAttention` with gate="scalar" (g = -exp(A_log) * softplus(x W_a + dt_bias),
one decay per value head and token), a full-rank output gate z with SiLU
(`full_rank_output_gate=True, output_gate_activation="silu"`, Qwen3NextRMSNormGated) and
Hv = linear_num_value_heads value heads over H = linear_num_key_heads q/k heads. The converter
splits transformers' fused weights, which it lays out per q/k head: in_proj_qkvz [2 H D + 2 Hv E,
hidden] holds for each q/k head [q (D) | k (D) | v (Hv/H E) | z (Hv/H E)], in_proj_ba [2 Hv,
hidden] for each q/k head [b (Hv/H) | a (Hv/H)], and conv1d [2 H D + Hv E, 1, K] the q, k and v
channels one after the other; q/k head h serves value heads h Hv/H ... (h + 1) Hv/H - 1, as in
`DeltaAttention`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lightning_jax import nnx as lj_nnx
from lightning_jax.interop import _common
from lightning_jax.interop.kimi_linear import ACTIVATIONS, LAYER_OPTIONS


@dataclasses.dataclass(frozen=True)
class Qwen3NextSizes:
  """The fields of a Qwen3-Next config that shape its Gated DeltaNet layers."""
  hidden_size: int
  num_heads: int       # H, linear_num_key_heads
  num_v_heads: int     # Hv, linear_num_value_heads
  head_dim: int        # D, linear_key_head_dim
  value_head_dim: int  # E, linear_value_head_dim
  conv_size: int
  norm_eps: float
  num_layers: int
  layer_types: tuple[str, ...]


def read_config(hf_config) -> Qwen3NextSizes:
  """A `Qwen3NextConfig` or its dict (missing fields: transformers' defaults) -> Qwen3NextSizes."""
  cfg = _common.ConfigReader(hf_config, "Qwen3-Next")
  num_layers = cfg.positive_int("num_hidden_layers", 48)
  heads = cfg.positive_int("linear_num_key_heads", 16)
  v_heads = cfg.positive_int("linear_num_value_heads", 32)
  if v_heads % heads:
    raise ValueError(f"hf_config.linear_num_value_heads ({v_heads}) must be a multiple of linear_num_key_heads "
                     f"({heads})")
  cfg.choice("hidden_act", "silu", ACTIVATIONS, "the short convolutions' SiLU")
  layer_types = cfg.get("layer_types")
  if layer_types is None:  # Qwen3NextConfig's default: full attention every fourth layer from layer 4
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
  if len(layer_types) != num_layers:
    raise ValueError(f"hf_config.layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}")
  return Qwen3NextSizes(hidden_size=cfg.positive_int("hidden_size", 2048), num_heads=heads, num_v_heads=v_heads,
                        head_dim=cfg.positive_int("linear_key_head_dim", 128),
                        value_head_dim=cfg.positive_int("linear_value_head_dim", 128),
                        conv_size=cfg.positive_int("linear_conv_kernel_dim", 4),
                        norm_eps=cfg.positive_float("rms_norm_eps", 1e-6),
                        num_layers=num_layers, layer_types=tuple(layer_types))


def _state_dict_shapes(sizes: Qwen3NextSizes) -> dict[str, tuple[int, ...]]:
  """The shapes of the HF layer's parameters, in transformers' names."""
  h, hv, d, e, f = sizes.num_heads, sizes.num_v_heads, sizes.head_dim, sizes.value_head_dim, sizes.hidden_size
  return {"in_proj_qkvz.weight": (2 * h * d + 2 * hv * e, f), "in_proj_ba.weight": (2 * hv, f),
          "conv1d.weight": (2 * h * d + hv * e, 1, sizes.conv_size), "dt_bias": (hv,), "A_log": (hv,),
          "norm.weight": (e,), "out_proj.weight": (f, hv * e)}


def qwen3_next_gated_delta_net(hf_config, layer_idx: int, state_dict, *, prefix: str = "", dtype=None,
                               param_dtype=jnp.float32, **layer_options) -> lj_nnx.DeltaAttention:
  """transformers' `Qwen3NextGatedDeltaNet(hf_config, layer_idx)` with `state_dict`, as a
  `lightning_jax.nnx.DeltaAttention`.

  Its call on hidden states [B, T, hidden_size] equals `Qwen3NextGatedDeltaNet(...)(
  hidden_states)`, and decoding (`init_cache`, then `decode=True`) equals that layer's
  decoding with the model's cache (`DynamicCache(config=hf_config)`).

  Args:
    hf_config: a transformers `Qwen3NextConfig` or its dict (config.json); reads
      hidden_size, linear_num_key_heads (H), linear_num_value_heads (Hv, a multiple
      of H), linear_key_head_dim (D), linear_value_head_dim (E),
      linear_conv_kernel_dim (K), hidden_act, rms_norm_eps, num_hidden_layers and
      layer_types (missing dict fields take transformers' defaults).
    layer_idx: the layer's index in the model, a "linear_attention" layer of
      layer_types.
    state_dict: {name: torch tensor or numpy array} of the layer, in transformers'
      names: in_proj_qkvz.weight [2 H D + 2 Hv E, hidden], in_proj_ba.weight
      [2 Hv, hidden], conv1d.weight [2 H D + Hv E, 1, K], dt_bias [Hv], A_log [Hv],
      norm.weight [E], out_proj.weight [hidden, Hv E]. torch is imported only for
      torch tensors.
    prefix: the layer's prefix in a model's state dict, e.g.
      "model.layers.0.linear_attn."; keys outside it are ignored.
    dtype, param_dtype: the layer's computation and parameter dtypes.
    **layer_options: passed to the layer: precision, decode, impl, mesh, batch_axes, head_axis,
      sequence_axis.

  Returns:
    The layer, its parameters converted to param_dtype.
  """
  sizes = read_config(hf_config)
  _common.check_layer_idx(layer_idx, sizes.num_layers, sizes.layer_types, "Qwen3-Next")
  _common.check_layer_options(layer_options, LAYER_OPTIONS)
  weights = _common.read_state_dict(state_dict, prefix, _state_dict_shapes(sizes), {})
  h, hv, d, e, f, k = (sizes.num_heads, sizes.num_v_heads, sizes.head_dim, sizes.value_head_dim, sizes.hidden_size,
                       sizes.conv_size)
  n = hv // h  # value heads per q/k head
  layer = nnx.eval_shape(lambda: lj_nnx.DeltaAttention(
      h, f, num_v_heads=hv, head_dim=d, value_head_dim=e, gate="scalar", output_gate_activation="silu",
      full_rank_output_gate=True, conv_size=k, norm_eps=sizes.norm_eps, scale=d ** -0.5, use_bias=False, dtype=dtype,
      param_dtype=param_dtype, rngs=nnx.Rngs(0), **layer_options))
  qkvz = weights["in_proj_qkvz.weight"].T.reshape(f, h, 2 * d + 2 * n * e)
  ba = weights["in_proj_ba.weight"].T.reshape(f, h, 2 * n)
  conv = weights["conv1d.weight"][:, 0].T  # [K, channels], tap K - 1 on the current token, as ours
  _common.load_params(layer, {
      "q_proj": {"kernel": qkvz[..., :d]},
      "k_proj": {"kernel": qkvz[..., d:2 * d]},
      "v_proj": {"kernel": qkvz[..., 2 * d:2 * d + n * e].reshape(f, hv, e)},
      "g_proj": {"kernel": qkvz[..., 2 * d + n * e:].reshape(f, hv, e)},
      "q_conv1d": conv[:, :h * d].reshape(k, h, d), "k_conv1d": conv[:, h * d:2 * h * d].reshape(k, h, d),
      "v_conv1d": conv[:, 2 * h * d:].reshape(k, hv, e),
      "b_proj": {"kernel": ba[..., :n].reshape(f, hv)},
      "a_proj": {"kernel": ba[..., n:].reshape(f, hv)},
      "A_log": weights["A_log"], "dt_bias": weights["dt_bias"],
      "o_norm": weights["norm.weight"],
      "o_proj": {"kernel": weights["out_proj.weight"].T.reshape(hv, e, f)},
  }, param_dtype)
  return layer


def state_dict_of(layer: lj_nnx.DeltaAttention) -> dict[str, np.ndarray]:
  """The parameters of a Qwen3-Next-shaped `DeltaAttention` in transformers' names and layout,
  numpy arrays in the parameters' dtype."""
  spec = layer.spec
  problems = [
      (spec.gate != "scalar", "gate='scalar'"),
      (spec.output_gate_activation != "silu" or spec.output_gate_rank is not None,
       "full_rank_output_gate=True with output_gate_activation='silu'"),
      (spec.allow_neg_eigval, "allow_neg_eigval=False"),
      (spec.use_bias, "use_bias=False"),
      (spec.scale != spec.head_dim ** -0.5, "scale=head_dim ** -0.5"),
      (spec.out_features != spec.in_features, "out_features == in_features"),
  ]
  missing = [need for failed, need in problems if failed]
  if missing:
    raise ValueError("transformers' Qwen3NextGatedDeltaNet cannot hold this DeltaAttention: it needs "
                     + "; ".join(missing))
  p = _common.layer_params(layer)
  h, hv, d, e, f, k = (spec.num_heads, spec.num_v_heads, spec.head_dim, spec.value_head_dim, spec.in_features,
                       spec.conv_size)
  n = hv // h
  qkvz = np.concatenate([p["q_proj"]["kernel"], p["k_proj"]["kernel"],
                         p["v_proj"]["kernel"].reshape(f, h, n * e), p["g_proj"]["kernel"].reshape(f, h, n * e)],
                        axis=-1)
  ba = np.concatenate([p["b_proj"]["kernel"].reshape(f, h, n), p["a_proj"]["kernel"].reshape(f, h, n)], axis=-1)
  conv = np.concatenate([p["q_conv1d"].reshape(k, h * d), p["k_conv1d"].reshape(k, h * d),
                         p["v_conv1d"].reshape(k, hv * e)], axis=1)
  return {"in_proj_qkvz.weight": qkvz.reshape(f, -1).T,
          "in_proj_ba.weight": ba.reshape(f, 2 * hv).T,
          "conv1d.weight": conv.T[:, None, :],
          "dt_bias": p["dt_bias"], "A_log": p["A_log"],
          "norm.weight": p["o_norm"],
          "out_proj.weight": p["o_proj"]["kernel"].reshape(hv * e, f).T}
