"""Hugging Face interop: transformers' MiniMax, Kimi Linear and Qwen3-Next linear attention
layers as the package's NNX layers, with their weights, and back.

    from lightning_jax import interop

    layer = interop.minimax_lightning_attention(config, 1, state_dict)   # nnx.LightningAttention
    layer = interop.kimi_delta_attention(config, 0, state_dict)          # nnx.DeltaAttention (KDA)
    layer = interop.qwen3_next_gated_delta_net(config, 0, state_dict)    # nnx.DeltaAttention (GDN)
    state_dict = interop.to_hf_state_dict(layer, as_torch=True)          # back, for load_state_dict

`config` is the transformers config (or its dict), `state_dict` the layer's (torch tensors
or numpy arrays; `prefix=` picks a layer out of a model's). The layers' outputs and
cached decoding equal transformers' own modules (transformers 5.23, float32: relative
error <= 5e-7 for MiniMax, ~1e-6 for Kimi Linear's KDA and Qwen3-Next's Gated DeltaNet;
tests/test_interop.py). Neither
torch nor transformers is needed unless torch tensors are passed in or asked for
(`pip install -e ".[hf]"` installs both).
"""

from __future__ import annotations

from lightning_jax import nnx as lj_nnx
from lightning_jax.interop import _common
from lightning_jax.interop import kimi_linear, minimax, qwen3_next
from lightning_jax.interop.kimi_linear import kimi_delta_attention
from lightning_jax.interop.minimax import minimax_lightning_attention
from lightning_jax.interop.qwen3_next import qwen3_next_gated_delta_net

__all__ = ["kimi_delta_attention", "minimax_lightning_attention", "qwen3_next_gated_delta_net", "to_hf_state_dict"]


def to_hf_state_dict(layer, *, prefix: str = "", as_torch: bool = False) -> dict:
  """The state dict of transformers' layer equal to `layer`: the reverse of the converters.

  A `LightningAttention` gives `MiniMaxLightningAttention`'s (qkv_proj, output_gate,
  out_proj, norm; not its buffers slope_rate, query_decay, key_decay, diagonal_decay,
  which transformers derives from the config: `load_state_dict(..., strict=False)`, or
  `from_pretrained`, which recomputes them), a `DeltaAttention` gives
  `KimiLinearDeltaAttention`'s with gate="kda" and `Qwen3NextGatedDeltaNet`'s with
  gate="scalar" (transformers' names). The decay rates are not weights: the MiniMax
  layer's come from its config and layer_idx.

  Args:
    layer: a `lightning_jax.nnx.LightningAttention` or `DeltaAttention` with the options
      of the Hugging Face layer (as the converters build it); otherwise a ValueError
      names the options that differ.
    prefix: prepended to every key, e.g. "model.layers.1.self_attn.".
    as_torch: torch tensors (imports torch) instead of numpy arrays; either in the
      parameters' dtype.

  Returns:
    {name: array}.
  """
  if isinstance(layer, lj_nnx.LightningAttention):
    entries = minimax.state_dict_of(layer)
  elif isinstance(layer, lj_nnx.DeltaAttention) and layer.spec.gate == "scalar":
    entries = qwen3_next.state_dict_of(layer)
  elif isinstance(layer, lj_nnx.DeltaAttention):
    entries = kimi_linear.state_dict_of(layer)
  else:
    raise TypeError(f"layer must be a lightning_jax.nnx.LightningAttention or DeltaAttention, got "
                    f"{type(layer).__name__}")
  return _common.finish_state_dict(entries, prefix, as_torch)
