"""Per-head decay rates ("slopes") for Lightning Attention.

The rates are the `decay` argument of `lightning_attention`: head h keeps
a = exp(-rate_h) of its state per token.

Not the rule of flash-linear-attention: its `chunk_lightning_attn(q, k, v,
layer_idx, num_layers)` uses the log-decay g_h = -(8 / H) * (1 - layer_idx /
num_layers) * h for h = 0..H-1, i.e. rates linear in h with rate 0 for head 0,
not the geometric ALiBi slopes below. Weights trained under one rule do not
carry over to the other without passing its rates explicitly as `decay`.
"""

from __future__ import annotations

import math
import numbers

import numpy as np


def _check_int(name, value, minimum):
  if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _alibi_list(n: int) -> list[float]:
  if n & (n - 1) == 0:  # power of two: 2^(-8 (h+1) / n)
    return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
  # Press et al.'s rule for other head counts: the slopes of the closest smaller
  # power of two, then every other slope of twice that power.
  p = 2 ** math.floor(math.log2(n))
  return _alibi_list(p) + _alibi_list(2 * p)[0::2][:n - p]


def alibi_slopes(num_heads: int):
  """ALiBi slopes 2^(-8 (h+1) / H), h = 0..H-1, as float32 [H] decay rates (numpy).

  For H not a power of two this follows the interleaving rule of ALiBi (Press
  et al., 2022), also used by TransNormerLLM's `_build_slope_tensor`.
  flash-linear-attention's `chunk_lightning_attn` uses a different rule (see the
  module docstring).
  """
  _check_int("num_heads", num_heads, 1)
  return np.asarray(_alibi_list(int(num_heads)), np.float32)


def minimax_slopes(num_heads: int, layer_idx: int, num_layers: int):
  """Depth-scaled ALiBi slopes of TransNormerLLM / MiniMax-01, float32 [H] (numpy).

      rate_h = alibi_h * (1 - layer_idx / (num_layers - 1) + 1e-5)

  so the first layer decays fastest and the last barely decays (TransNormerLLM's
  rule). MiniMax-01 divides by num_layers - 1 + 1e-5, which moves the factor by
  less than 2e-7; with num_layers == 1 the factor here is 1 + 1e-5, as that
  guard gives. MiniMax-01 uses 2^(-8 (h+1) / H) for every H; this helper keeps
  the ALiBi interleaving rule for H not a power of two (the same otherwise).
  flash-linear-attention's `chunk_lightning_attn` uses a different rule (see the
  module docstring).
  """
  _check_int("num_heads", num_heads, 1)
  _check_int("num_layers", num_layers, 1)
  if not isinstance(layer_idx, numbers.Integral) or isinstance(layer_idx, bool) or not 0 <= layer_idx < num_layers:
    raise ValueError(f"layer_idx must be an int in [0, num_layers={num_layers}), got {layer_idx!r}")
  depth = layer_idx / (num_layers - 1) if num_layers > 1 else 0.0
  factor = 1.0 - depth + 1e-5
  return np.asarray([s * factor for s in _alibi_list(int(num_heads))], np.float32)
