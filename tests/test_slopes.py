"""Slope helpers: ALiBi and the MiniMax-01 / TransNormerLLM depth rule."""

import math

import numpy as np
import pytest

import lightning_jax as lj


def _press_slopes(n):
  """ALiBi slopes written as in Press et al.'s reference code (start * ratio^i)."""
  def pow2(m):
    start = 2 ** (-(2 ** -(math.log2(m) - 3)))
    return [start * start ** i for i in range(m)]
  if math.log2(n).is_integer():
    return pow2(n)
  closest = 2 ** math.floor(math.log2(n))
  return pow2(closest) + _press_slopes(2 * closest)[0::2][:n - closest]


@pytest.mark.parametrize("num_heads", [1, 2, 4, 8, 16, 64])
def test_alibi_power_of_two_formula(num_heads):
  got = lj.alibi_slopes(num_heads)
  want = [2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]
  assert got.shape == (num_heads,) and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("num_heads", [3, 5, 6, 7, 12, 20, 40])
def test_alibi_interleaving_rule(num_heads):
  np.testing.assert_allclose(lj.alibi_slopes(num_heads), _press_slopes(num_heads), rtol=1e-6)


def test_alibi_hand_values():
  # H=3: slopes of H=2 (2^-4, 2^-8), then the first of every other slope of H=4 (2^-2).
  np.testing.assert_allclose(lj.alibi_slopes(3), [2 ** -4, 2 ** -8, 2 ** -2], rtol=1e-7)
  # H=6: slopes of H=4, then 2^-1 and 2^-3 from H=8.
  np.testing.assert_allclose(lj.alibi_slopes(6), [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3],
                             rtol=1e-7)


@pytest.mark.parametrize("num_heads,num_layers", [(8, 4), (3, 5), (16, 2)])
def test_minimax_depth_rule(num_heads, num_layers):
  alibi = np.asarray(_press_slopes(num_heads))
  for layer_idx in range(num_layers):
    got = lj.minimax_slopes(num_heads, layer_idx, num_layers)
    assert got.shape == (num_heads,) and got.dtype == np.float32
    np.testing.assert_allclose(got, alibi * (1 - layer_idx / (num_layers - 1) + 1e-5), rtol=1e-6)
  # The first layer decays like ALiBi, the last almost not at all.
  np.testing.assert_allclose(lj.minimax_slopes(num_heads, 0, num_layers), alibi * (1 + 1e-5), rtol=1e-6)
  np.testing.assert_allclose(lj.minimax_slopes(num_heads, num_layers - 1, num_layers), alibi * 1e-5, rtol=1e-5)


def test_minimax_matches_minimax01_formula():
  # MiniMax-01: base ** (h + 1) * (1 - l / (L - 1 + 1e-5) + 1e-5), base = 2^(-8/H).
  h, num_layers = 64, 80
  base = 1 / 2 ** (8 / h)
  for layer_idx in (0, 7, 40, 79):
    want = base ** (np.arange(h) + 1) * (1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)
    # The guard in MiniMax-01's denominator shifts the factor by < 2e-7 (absolute).
    np.testing.assert_allclose(lj.minimax_slopes(h, layer_idx, num_layers), want, rtol=1e-5, atol=2e-7)


def test_minimax_single_layer():
  np.testing.assert_allclose(lj.minimax_slopes(4, 0, 1), lj.alibi_slopes(4) * (1 + 1e-5), rtol=1e-7)


@pytest.mark.parametrize("args,match", [
    ((0,), "num_heads"), ((True,), "num_heads"), ((2.0,), "num_heads"),
])
def test_alibi_bad_args(args, match):
  with pytest.raises(ValueError, match=match):
    lj.alibi_slopes(*args)


@pytest.mark.parametrize("args,match", [
    ((4, 4, 4), "layer_idx"), ((4, -1, 4), "layer_idx"), ((4, None, 4), "layer_idx"),
    ((4, 0, 0), "num_layers"), ((0, 0, 2), "num_heads"),
])
def test_minimax_bad_args(args, match):
  with pytest.raises(ValueError, match=match):
    lj.minimax_slopes(*args)
