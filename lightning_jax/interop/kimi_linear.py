"""Kimi Linear's KDA layer: transformers' `KimiLinearDeltaAttention`
(models/kimi_linear/modeling_kimi_linear.py) as `lightning_jax.nnx.DeltaAttention`, and back.

`DeltaAttention`'s defaults are this block (short convolutions with SiLU, L2-normalised
q and k, beta = sigmoid(x W_b), the KDA forget gate -exp(A_log) * softplus(f_b(f_a(x)) +
dt_bias), the sigmoid-gated RMS norm); the converter sets its sizes, the norm's epsilon
(config.rms_norm_eps) and the ranks of the low-rank gates (the head dim), and reshapes
the weights: PyTorch's Linear weight [out, in] becomes a kernel [in, out...], the fused
depthwise conv1d [3 H D, 1, K] the q/k/v kernels [K, H, D], A_log [1, 1, H, 1] [H] and
dt_bias [H D] [H, D].
"""

from __future__ import annotations

import collections.abc
import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lightning_jax import nnx as lj_nnx
from lightning_jax._layer_common import _is_int
from lightning_jax.interop import _common

# The short convolutions' activation (config.hidden_act) is the layer's SiLU.
ACTIVATIONS = ("silu", "swish")
# Options of the layer that do not change what it computes; the converter sets the others.
LAYER_OPTIONS = ("precision", "decode", "impl", "mesh", "batch_axes", "head_axis", "sequence_axis")
# The original checkpoints' names (moonshotai/Kimi-Linear-*) -> transformers' (its conversion
# mapping also concatenates q_conv1d, k_conv1d and v_conv1d into conv1d).
CHECKPOINT_NAMES = {"f_a_proj.weight": "forget_gate.f_a_proj.weight", "f_b_proj.weight": "forget_gate.f_b_proj.weight",
                    "dt_bias": "forget_gate.dt_bias", "A_log": "forget_gate.A_log"}


@dataclasses.dataclass(frozen=True)
class KimiSizes:
  """The fields of a Kimi Linear config that shape its KDA layers."""
  hidden_size: int
  num_heads: int
  head_dim: int
  conv_size: int
  norm_eps: float
  num_layers: int
  layer_types: tuple[str, ...]


def read_config(hf_config) -> KimiSizes:
  """A `KimiLinearConfig` or its dict (missing fields: transformers' defaults) -> KimiSizes.

  A dict may hold the KDA sizes and layer kinds in `linear_attn_config` (as the
  checkpoints' config.json does), which takes precedence as in transformers.
  """
  cfg = _common.ConfigReader(hf_config, "Kimi Linear")
  linear = (cfg.get("linear_attn_config") or {}) if cfg.is_dict else {}
  num_layers = cfg.positive_int("num_hidden_layers", 27)
  sizes = {}
  for name, linear_name, default in (("linear_num_heads", "num_heads", 32), ("linear_head_dim", "head_dim", 128),
                                     ("linear_conv_kernel_dim", "short_conv_kernel_size", 4)):
    value = linear.get(linear_name, cfg.get(name, default))
    if not _is_int(value, 1):
      raise ValueError(f"hf_config.{name} must be an int >= 1, got {value!r}")
    sizes[name] = int(value)
  eps = cfg.positive_float("rms_norm_eps", 1e-5)
  cfg.choice("hidden_act", "silu", ACTIVATIONS, "the short convolutions' SiLU")
  layer_types = cfg.get("layer_types")
  if layer_types is None and "full_attn_layers" in linear and "kda_layers" in linear:
    layer_types = [None] * num_layers  # the checkpoints number their layers from 1
    for kind, layers in (("full_attention", linear["full_attn_layers"]), ("linear_attention", linear["kda_layers"])):
      for index in layers:
        layer_types[index - 1] = kind
  if layer_types is None:  # KimiLinearConfig's default: full attention every fourth layer from layer 4
    layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
  if len(layer_types) != num_layers:
    raise ValueError(f"hf_config.layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}")
  return KimiSizes(hidden_size=cfg.positive_int("hidden_size", 2304), num_heads=sizes["linear_num_heads"],
                   head_dim=sizes["linear_head_dim"], conv_size=sizes["linear_conv_kernel_dim"], norm_eps=eps,
                   num_layers=num_layers, layer_types=tuple(layer_types))


def _state_dict_shapes(sizes: KimiSizes) -> dict[str, tuple[int, ...]]:
  """The shapes of the HF layer's parameters, in transformers' names."""
  h, d, f, k = sizes.num_heads, sizes.head_dim, sizes.hidden_size, sizes.conv_size
  width = h * d
  return {"q_proj.weight": (width, f), "k_proj.weight": (width, f), "v_proj.weight": (width, f),
          "conv1d.weight": (3 * width, 1, k), "forget_gate.f_a_proj.weight": (d, f),
          "forget_gate.f_b_proj.weight": (width, d), "forget_gate.dt_bias": (width,),
          "forget_gate.A_log": (1, 1, h, 1), "b_proj.weight": (h, f), "g_a_proj.weight": (d, f),
          "g_b_proj.weight": (width, d), "o_norm.weight": (d,), "o_proj.weight": (f, width)}


def _read_weights(state_dict, prefix: str, sizes: KimiSizes) -> dict[str, np.ndarray]:
  """The layer's weights in transformers' names, from its names or the original checkpoints'."""
  shapes = _state_dict_shapes(sizes)
  if not (isinstance(state_dict, collections.abc.Mapping) and isinstance(prefix, str)
          and prefix + "q_conv1d.weight" in state_dict):
    return _common.read_state_dict(state_dict, prefix, shapes, {})
  to_checkpoint = {hf_name: name for name, hf_name in CHECKPOINT_NAMES.items()}
  checkpoint_shapes = {to_checkpoint.get(name, name): shape for name, shape in shapes.items()
                       if name != "conv1d.weight"}
  checkpoint_shapes.update({f"{x}_conv1d.weight": (sizes.num_heads * sizes.head_dim, 1, sizes.conv_size)
                            for x in "qkv"})
  weights = _common.read_state_dict(state_dict, prefix, checkpoint_shapes, {})
  weights["conv1d.weight"] = np.concatenate([weights.pop(f"{x}_conv1d.weight") for x in "qkv"])
  return {CHECKPOINT_NAMES.get(name, name): value for name, value in weights.items()}


def kimi_delta_attention(hf_config, layer_idx: int, state_dict, *, prefix: str = "", dtype=None,
                         param_dtype=jnp.float32, **layer_options) -> lj_nnx.DeltaAttention:
  """transformers' `KimiLinearDeltaAttention(hf_config, layer_idx)` with `state_dict`, as a
  `lightning_jax.nnx.DeltaAttention`.

  Its call on hidden states [B, T, hidden_size] equals `KimiLinearDeltaAttention(...)(
  hidden_states)`, and decoding (`init_cache`, then `decode=True`) equals that layer's
  decoding with the model's cache (`DynamicCache(config=hf_config)`).

  Args:
    hf_config: a transformers `KimiLinearConfig` or its dict (config.json, whose
      `linear_attn_config` is read too); reads hidden_size, linear_num_heads (H),
      linear_head_dim (D), linear_conv_kernel_dim (K), hidden_act, rms_norm_eps,
      num_hidden_layers and layer_types (missing dict fields take transformers'
      defaults).
    layer_idx: the layer's index in the model, a "linear_attention" layer of
      layer_types.
    state_dict: {name: torch tensor or numpy array} of the layer, in transformers'
      names: q_proj, k_proj, v_proj .weight [H D, hidden], conv1d.weight [3 H D, 1,
      K], forget_gate.f_a_proj.weight [D, hidden], forget_gate.f_b_proj.weight [H D,
      D], forget_gate.dt_bias [H D], forget_gate.A_log [1, 1, H, 1], b_proj.weight
      [H, hidden], g_a_proj.weight [D, hidden], g_b_proj.weight [H D, D],
      o_norm.weight [D], o_proj.weight [hidden, H D]; or in the original
      checkpoints' (q_conv1d, k_conv1d, v_conv1d .weight [H D, 1, K] each,
      f_a_proj, f_b_proj, dt_bias and A_log outside forget_gate). torch is
      imported only for torch tensors.
    prefix: the layer's prefix in a model's state dict, e.g.
      "model.layers.0.self_attn."; keys outside it are ignored.
    dtype, param_dtype: the layer's computation and parameter dtypes.
    **layer_options: passed to the layer: precision, decode, impl, mesh, batch_axes, head_axis,
      sequence_axis.

  Returns:
    The layer, its parameters converted to param_dtype.
  """
  sizes = read_config(hf_config)
  _common.check_layer_idx(layer_idx, sizes.num_layers, sizes.layer_types, "Kimi Linear")
  _common.check_layer_options(layer_options, LAYER_OPTIONS)
  weights = _read_weights(state_dict, prefix, sizes)
  h, d, f, k = sizes.num_heads, sizes.head_dim, sizes.hidden_size, sizes.conv_size
  layer = nnx.eval_shape(lambda: lj_nnx.DeltaAttention(
      h, f, head_dim=d, gate="kda", gate_rank=d, output_gate_activation="sigmoid", output_gate_rank=d,
      conv_size=k, norm_eps=sizes.norm_eps, scale=d ** -0.5, use_bias=False, dtype=dtype, param_dtype=param_dtype,
      rngs=nnx.Rngs(0), **layer_options))
  conv = weights["conv1d.weight"][:, 0].T.reshape(k, 3, h, d)  # tap K - 1 on the current token, as ours
  _common.load_params(layer, {
      "q_proj": {"kernel": weights["q_proj.weight"].T.reshape(f, h, d)},
      "k_proj": {"kernel": weights["k_proj.weight"].T.reshape(f, h, d)},
      "v_proj": {"kernel": weights["v_proj.weight"].T.reshape(f, h, d)},
      "q_conv1d": conv[:, 0], "k_conv1d": conv[:, 1], "v_conv1d": conv[:, 2],
      "b_proj": {"kernel": weights["b_proj.weight"].T},
      "f_a_proj": {"kernel": weights["forget_gate.f_a_proj.weight"].T},
      "f_b_proj": {"kernel": weights["forget_gate.f_b_proj.weight"].T.reshape(d, h, d)},
      "A_log": weights["forget_gate.A_log"].reshape(h),
      "dt_bias": weights["forget_gate.dt_bias"].reshape(h, d),
      "g_a_proj": {"kernel": weights["g_a_proj.weight"].T},
      "g_b_proj": {"kernel": weights["g_b_proj.weight"].T.reshape(d, h, d)},
      "o_norm": weights["o_norm.weight"],
      "o_proj": {"kernel": weights["o_proj.weight"].T.reshape(h, d, f)},
  }, param_dtype)
  return layer


def state_dict_of(layer: lj_nnx.DeltaAttention) -> dict[str, np.ndarray]:
  """The parameters of a Kimi-shaped `DeltaAttention` in transformers' names and layout,
  numpy arrays in the parameters' dtype."""
  spec = layer.spec
  d = spec.head_dim
  problems = [
      (spec.gate != "kda" or spec.gate_rank != d, "gate='kda' with gate_rank == head_dim"),
      (spec.output_gate_activation != "sigmoid" or spec.output_gate_rank != d,
       "output_gate_activation='sigmoid' with output_gate_rank == head_dim"),
      (spec.num_v_heads != spec.num_heads, "num_v_heads == num_heads"),
      (spec.value_head_dim != d, "value_head_dim == head_dim"),
      (spec.allow_neg_eigval, "allow_neg_eigval=False"),
      (spec.use_bias, "use_bias=False"),
      (spec.scale != d ** -0.5, "scale=head_dim ** -0.5"),
      (spec.out_features != spec.in_features, "out_features == in_features"),
  ]
  missing = [need for failed, need in problems if failed]
  if missing:
    raise ValueError("transformers' KimiLinearDeltaAttention cannot hold this DeltaAttention: it needs "
                     + "; ".join(missing))
  p = _common.layer_params(layer)
  h, f, k = spec.num_heads, spec.in_features, spec.conv_size
  width = h * d
  conv = np.stack([p[f"{x}_conv1d"] for x in "qkv"], axis=1).reshape(k, 3 * width)  # [K, 3 H D]
  return {"q_proj.weight": p["q_proj"]["kernel"].reshape(f, width).T,
          "k_proj.weight": p["k_proj"]["kernel"].reshape(f, width).T,
          "v_proj.weight": p["v_proj"]["kernel"].reshape(f, width).T,
          "conv1d.weight": conv.T[:, None, :],
          "forget_gate.f_a_proj.weight": p["f_a_proj"]["kernel"].T,
          "forget_gate.f_b_proj.weight": p["f_b_proj"]["kernel"].reshape(d, width).T,
          "forget_gate.dt_bias": p["dt_bias"].reshape(width),
          "forget_gate.A_log": p["A_log"].reshape(1, 1, h, 1),
          "b_proj.weight": p["b_proj"]["kernel"].T,
          "g_a_proj.weight": p["g_a_proj"]["kernel"].T,
          "g_b_proj.weight": p["g_b_proj"]["kernel"].reshape(d, width).T,
          "o_norm.weight": p["o_norm"],
          "o_proj.weight": p["o_proj"]["kernel"].reshape(width, f).T}
