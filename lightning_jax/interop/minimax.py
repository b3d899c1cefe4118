"""MiniMax-Text-01 / MiniMax-M1 lightning attention: transformers' `MiniMaxLightningAttention`
(models/minimax/modeling_minimax.py) as `lightning_jax.nnx.LightningAttention`, and back.

transformers' layer, for hidden states x [B, T, F] with H heads of dim D:

    q, k, v = split(act(x W_qkv))     W_qkv [3 H D, F], per head [q | k | v]
    o = lightning attention of q, k, v with slope_rate decay and scale 1
    y = (rms_norm(o over all H D features) * sigmoid(x W_gate)) W_out

`LightningAttention` with the options set here computes the same: the fused qkv_proj
split into query, key, value (act on all three: value_feature_map), decay = the
layer's slope rates (`slope_rates`), scale 1.0, output_norm "rms" with MiniMaxRMSNorm's
epsilon, the sigmoid output gate, no biases.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lightning_jax import nnx as lj_nnx
from lightning_jax._layer_common import _is_int
from lightning_jax.interop import _common

# transformers' hidden_act (ACT2FN names) -> the layer's feature maps.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "relu": "relu"}
# MiniMaxLightningAttention builds its MiniMaxRMSNorm with the default epsilon, not config.rms_norm_eps.
NORM_EPS = 1e-6
# Options of the layer that do not change what it computes; the converter sets the others.
LAYER_OPTIONS = ("precision", "decode", "impl", "variant", "config", "mesh", "batch_axes", "head_axis",
                 "sequence_axis")


@dataclasses.dataclass(frozen=True)
class MiniMaxSizes:
  """The fields of a MiniMax config that shape its lightning-attention layers."""
  hidden_size: int
  num_heads: int
  head_dim: int
  num_layers: int
  block_size: int
  feature_map: str
  layer_types: tuple[str, ...]


def read_config(hf_config) -> MiniMaxSizes:
  """A `MiniMaxConfig` or its dict (missing fields: transformers' defaults) -> MiniMaxSizes."""
  cfg = _common.ConfigReader(hf_config, "MiniMax")
  hidden = cfg.positive_int("hidden_size", 4096)
  heads = cfg.positive_int("num_attention_heads", 32)
  num_layers = cfg.positive_int("num_hidden_layers", 32)
  head_dim = cfg.get("head_dim") or hidden // heads  # transformers' rule
  if not _is_int(head_dim, 1):
    raise ValueError(f"hf_config.head_dim must be None or an int >= 1, got {head_dim!r}")
  act = cfg.choice("hidden_act", "silu", ACTIVATIONS, "the layer's feature maps")
  # MiniMaxConfig's default alternates full and linear attention, starting with full.
  layer_types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 2 else "linear_attention"
                                           for i in range(num_layers)]
  if len(layer_types) != num_layers:
    raise ValueError(f"hf_config.layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}")
  return MiniMaxSizes(hidden_size=hidden, num_heads=heads, head_dim=int(head_dim), num_layers=num_layers,
                      block_size=cfg.positive_int("block_size", 256), feature_map=ACTIVATIONS[act],
                      layer_types=tuple(layer_types))


def slope_rates(num_heads: int, layer_idx: int, num_layers: int) -> np.ndarray:
  """transformers' `MiniMaxLightningAttention.get_slope_rate` as float32 [H] decay rates:

      rate_h = 2^(-8 (h + 1) / H) * (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)

  for every H, in float32 as torch computes it (to the ulp: torch rounds the power of the
  float32 base correctly, as float64 here does). `lightning_jax.minimax_slopes` divides by
  num_layers - 1 (a factor apart by < 2e-7 relative) and, for H not a power of two,
  follows ALiBi's interleaving rule.
  """
  base = np.float64(np.float32(1 / (2 ** (8 / num_heads))))
  powers = (base ** np.arange(1, num_heads + 1, dtype=np.float64)).astype(np.float32)
  return powers * np.float32(1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)


def _state_dict_shapes(sizes: MiniMaxSizes) -> tuple[dict, dict]:
  """(shapes of the parameters, shapes of the buffers derived from the config) of the HF layer."""
  h, width, f, block = sizes.num_heads, sizes.num_heads * sizes.head_dim, sizes.hidden_size, sizes.block_size
  params = {"qkv_proj.weight": (3 * width, f), "output_gate.weight": (width, f), "out_proj.weight": (f, width),
            "norm.weight": (width,)}
  buffers = {"slope_rate": (h, 1, 1), "query_decay": (h, block, 1), "key_decay": (h, block, 1),
             "diagonal_decay": (1, h, block, block)}
  return params, buffers


def minimax_lightning_attention(hf_config, layer_idx: int, state_dict, *, prefix: str = "", dtype=None,
                                param_dtype=jnp.float32, **layer_options) -> lj_nnx.LightningAttention:
  """transformers' `MiniMaxLightningAttention(hf_config, layer_idx)` with `state_dict`, as a
  `lightning_jax.nnx.LightningAttention`.

  Its call on hidden states [B, T, hidden_size] equals
  `MiniMaxLightningAttention(...)(hidden_states, position_embeddings=None,
  attention_mask=None)[0]`, and decoding (`init_cache`, then `decode=True`) equals that
  layer's decoding with a `MiniMaxCache`.

  Args:
    hf_config: a transformers `MiniMaxConfig` or its dict (config.json); reads
      hidden_size, num_attention_heads, head_dim, num_hidden_layers, hidden_act,
      block_size and layer_types (missing dict fields take transformers' defaults).
    layer_idx: the layer's index in the model; sets its decay rates (`slope_rates`)
      and must be a "linear_attention" layer of layer_types.
    state_dict: {name: torch tensor or numpy array} of the layer: qkv_proj.weight
      [3 H D, hidden], output_gate.weight [H D, hidden], out_proj.weight [hidden,
      H D], norm.weight [H D]; its buffers (slope_rate, query_decay, key_decay,
      diagonal_decay) may be present, and slope_rate is checked against
      layer_idx. torch is imported only for torch tensors.
    prefix: the layer's prefix in a model's state dict, e.g.
      "model.layers.1.self_attn."; keys outside it are ignored.
    dtype, param_dtype: the layer's computation and parameter dtypes.
    **layer_options: passed to the layer: precision, decode, impl, variant,
      config, mesh, batch_axes, head_axis, sequence_axis.

  Returns:
    The layer, its parameters converted to param_dtype.
  """
  sizes = read_config(hf_config)
  _common.check_layer_idx(layer_idx, sizes.num_layers, sizes.layer_types, "MiniMax")
  _common.check_layer_options(layer_options, LAYER_OPTIONS)
  shapes, buffers = _state_dict_shapes(sizes)
  weights = _common.read_state_dict(state_dict, prefix, shapes, buffers)
  h, d, f = sizes.num_heads, sizes.head_dim, sizes.hidden_size
  rates = slope_rates(h, layer_idx, sizes.num_layers)
  if "slope_rate" in weights and not np.allclose(weights["slope_rate"].reshape(h), rates, rtol=1e-5, atol=0):
    raise ValueError(f"state_dict[{prefix + 'slope_rate'!r}] differs from the slope rates of layer_idx={layer_idx} "
                     f"of {sizes.num_layers} layers: a state dict of another layer, or another num_hidden_layers?")
  layer = nnx.eval_shape(lambda: lj_nnx.LightningAttention(
      h, f, qkv_features=h * d, decay=rates, feature_map=sizes.feature_map, value_feature_map=sizes.feature_map,
      output_gate=True, output_norm="rms", norm_eps=NORM_EPS, scale=1.0, use_bias=False, dtype=dtype,
      param_dtype=param_dtype, rngs=nnx.Rngs(0), **layer_options))
  qkv = weights["qkv_proj.weight"].T.reshape(f, h, 3, d)  # per head [q | k | v]
  _common.load_params(layer, {
      "query": {"kernel": qkv[:, :, 0]}, "key": {"kernel": qkv[:, :, 1]}, "value": {"kernel": qkv[:, :, 2]},
      "gate": {"kernel": weights["output_gate.weight"].T.reshape(f, h, d)},
      "norm": weights["norm.weight"].reshape(h, d),
      "out": {"kernel": weights["out_proj.weight"].T.reshape(h, d, f)},
  }, param_dtype)
  return layer


def state_dict_of(layer: lj_nnx.LightningAttention) -> dict[str, np.ndarray]:
  """The parameters of a MiniMax-shaped `LightningAttention` in transformers' names and
  layout (without the derived buffers), numpy arrays in the parameters' dtype."""
  spec = layer.spec
  params = _common.layer_params(layer)
  problems = [
      (spec.feature_map != spec.value_feature_map or spec.feature_map not in ACTIVATIONS.values(),
       f"one activation on q, k and v (feature_map == value_feature_map, one of {sorted(set(ACTIVATIONS.values()))})"),
      (not spec.output_gate, "output_gate=True"),
      (spec.output_norm != "rms", "output_norm='rms'"),
      (spec.norm_eps != NORM_EPS, f"norm_eps={NORM_EPS}"),
      (spec.scale != 1.0, "scale=1.0"),
      (spec.learnable_decay, "fixed decay rates (learnable_decay=False)"),
      (spec.out_features != spec.in_features, "out_features == in_features"),
      (any("bias" in p for p in params.values() if isinstance(p, dict)), "no biases (use_bias=False)"),
  ]
  missing = [need for failed, need in problems if failed]
  if missing:
    raise ValueError("transformers' MiniMaxLightningAttention cannot hold this LightningAttention: it needs "
                     + "; ".join(missing))
  h, d, f = spec.num_heads, spec.head_dim, spec.in_features
  qkv = np.stack([params[name]["kernel"] for name in ("query", "key", "value")], axis=2)  # [F, H, 3, D]
  return {"qkv_proj.weight": qkv.reshape(f, 3 * h * d).T,
          "output_gate.weight": params["gate"]["kernel"].reshape(f, h * d).T,
          "out_proj.weight": params["out"]["kernel"].reshape(h * d, f).T,
          "norm.weight": params["norm"].reshape(h * d)}
