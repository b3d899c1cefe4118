"""Pieces shared by the Hugging Face converters: reading a transformers config or its
dict, checking and reading a layer's state dict, filling and reading an NNX layer's
parameters. Imports no torch unless torch tensors are passed in (or asked for).
"""

from __future__ import annotations

import collections.abc

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lightning_jax._layer_common import _is_int


class ConfigReader:
  """Reads the fields of a transformers config object or of its dict (`config.to_dict()`,
  or a checkpoint's config.json); a dict without a field gets transformers' default."""

  def __init__(self, hf_config, model: str):
    self.is_dict = isinstance(hf_config, collections.abc.Mapping)
    if not (self.is_dict or hasattr(hf_config, "to_dict")):
      raise TypeError(f"hf_config must be a transformers {model} config or its dict, got "
                      f"{type(hf_config).__name__}")
    self.config = hf_config

  def get(self, name: str, default=None):
    return self.config.get(name, default) if self.is_dict else getattr(self.config, name, default)

  def positive_int(self, name: str, default: int) -> int:
    value = self.get(name, default)
    if not _is_int(value, 1):
      raise ValueError(f"hf_config.{name} must be an int >= 1, got {value!r}")
    return int(value)

  def positive_float(self, name: str, default: float) -> float:
    value = self.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
      raise ValueError(f"hf_config.{name} must be a float > 0, got {value!r}")
    return float(value)

  def choice(self, name: str, default: str, allowed, why: str) -> str:
    """The field's value, one of `allowed` (`why` says what it becomes in the layer)."""
    value = self.get(name, default)
    if value not in allowed:
      raise ValueError(f"hf_config.{name} must be one of {tuple(allowed)} ({why}), got {value!r}")
    return value


def check_layer_idx(layer_idx, num_layers: int, layer_types: tuple[str, ...], model: str) -> None:
  """layer_idx must index a linear-attention layer of the model's num_layers."""
  if not (_is_int(layer_idx, 0) and layer_idx < num_layers):
    raise ValueError(f"layer_idx must be an int in [0, num_hidden_layers={num_layers}), got {layer_idx!r}")
  if layer_types[layer_idx] != "linear_attention":
    raise ValueError(f"layer {layer_idx} of this {model} config is a {layer_types[layer_idx]!r} layer, not "
                     "'linear_attention' (hf_config.layer_types)")


def check_layer_options(layer_options: dict, allowed: tuple[str, ...]) -> None:
  """The converters set a layer's other options from the config; only these pass through."""
  for name in layer_options:
    if name not in allowed:
      raise TypeError(f"unexpected keyword argument {name!r}: the converter sets the layer's other options from "
                      f"hf_config; it passes on {allowed}")


def _to_numpy(value, key: str) -> np.ndarray:
  """A torch tensor (any device; bfloat16 and float16 widened to float32, exactly), numpy or
  jax array as a numpy array."""
  if type(value).__module__.partition(".")[0] == "torch":
    import torch  # only here: a torch tensor was passed
    value = value.detach().to("cpu")
    if value.dtype in (torch.bfloat16, torch.float16):  # numpy has no bfloat16
      value = value.float()
    return value.numpy()
  if not hasattr(value, "shape") or not hasattr(value, "dtype"):
    raise TypeError(f"state_dict[{key!r}] must be a torch tensor or an array, got {type(value).__name__}")
  return np.asarray(value)


def read_state_dict(state_dict, prefix: str, shapes: dict[str, tuple[int, ...]],
                    optional: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
  """The entries of `state_dict` under `prefix`, checked: every key of `shapes` present with
  that shape, keys of `optional` (buffers the model derives) with theirs if present, no other.

  Returns {key without prefix: numpy array} for the keys of `shapes` and those of
  `optional` present. Errors name the key with its prefix.
  """
  if not isinstance(state_dict, collections.abc.Mapping):
    raise TypeError(f"state_dict must be a mapping of names to torch tensors or arrays, got "
                    f"{type(state_dict).__name__}")
  if not isinstance(prefix, str):
    raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
  entries = {key[len(prefix):]: value for key, value in state_dict.items()
             if isinstance(key, str) and key.startswith(prefix)}
  unexpected = sorted(set(entries) - set(shapes) - set(optional))
  if unexpected:
    names = ", ".join(repr(prefix + key) for key in unexpected[:5]) + (", ..." if len(unexpected) > 5 else "")
    raise ValueError(f"state_dict has {len(unexpected)} unexpected key(s) for this layer: {names}. Pass the "
                     "layer's own state dict, or give prefix (e.g. 'model.layers.3.self_attn.') to pick the layer "
                     "out of a model's")
  out = {}
  for key, shape in {**shapes, **optional}.items():
    if key not in entries:
      if key in optional:
        continue
      raise ValueError(f"state_dict lacks {prefix + key!r} (expected shape {list(shape)})")
    array = _to_numpy(entries[key], prefix + key)
    if array.shape != shape:
      raise ValueError(f"state_dict[{prefix + key!r}] has shape {list(array.shape)}, expected {list(shape)} from "
                       "hf_config")
    if not np.issubdtype(array.dtype, np.floating) and array.dtype != jnp.bfloat16:
      raise TypeError(f"state_dict[{prefix + key!r}] must be floating point, got {array.dtype}")
    out[key] = array
  return out


def load_params(layer: nnx.Module, params: dict, param_dtype) -> None:
  """Fills every parameter of `layer` (built under nnx.eval_shape: shapes only) from the
  nested dict `params` of numpy arrays, converted to param_dtype."""
  state = nnx.state(layer, nnx.Param)
  abstract = nnx.to_pure_dict(state)
  # The converters map every parameter: a mismatch here is a bug of theirs, not of the inputs.
  assert jax.tree.structure(abstract) == jax.tree.structure(params), (abstract, params)
  assert all(a.shape == p.shape for a, p in zip(jax.tree.leaves(abstract), jax.tree.leaves(params)))
  nnx.replace_by_pure_dict(state, jax.tree.map(lambda p: jnp.asarray(p, param_dtype), params))
  nnx.update(layer, state)


def layer_params(layer: nnx.Module) -> dict:
  """The layer's parameters as a nested dict of numpy arrays (in their dtype)."""
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))


def finish_state_dict(entries: dict[str, np.ndarray], prefix: str, as_torch: bool) -> dict:
  """{prefix + key: array}, as numpy arrays (copies: writable, contiguous) or torch tensors of
  the same dtype."""
  if not isinstance(prefix, str):
    raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
  if not isinstance(as_torch, bool):
    raise TypeError(f"as_torch must be a bool, got {as_torch!r}")
  entries = {prefix + key: np.array(value) for key, value in entries.items()}
  if not as_torch:
    return entries
  import torch  # only when torch tensors are asked for
  # torch.from_numpy knows no bfloat16: through float32, exactly.
  return {key: (torch.from_numpy(value.astype(np.float32)).to(torch.bfloat16) if value.dtype == jnp.bfloat16
                else torch.from_numpy(value)) for key, value in entries.items()}
