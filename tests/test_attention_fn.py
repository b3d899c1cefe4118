"""attention_fn: Lightning Attention inside Flax's own multi-head attention layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import lightning_jax as lj

HI = jax.lax.Precision.HIGHEST
# The sizes of test_layers.py (B, T, H, head dim 6), so compiled shapes are shared.
B, T, F, H, D = 2, 13, 18, 3, 6


# numpy inputs: eager jnp ops on new shapes are XLA compiles, the bulk of test time.
def _normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _randomize(params, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: jnp.asarray(0.5 * rng.standard_normal(p.shape), p.dtype), params)


@jax.jit
def reference_mha(params, x, rates):
  """Flax MHA's projections around the oracle recurrence (GQA by repeating k/v heads)."""
  def proj(name):
    return jnp.einsum("btf,fhd->bthd", x, params[name]["kernel"], precision=HI) + params[name]["bias"]
  q, k, v = proj("query"), proj("key"), proj("value")
  rep = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  o, _ = lj.lightning_attention_recurrent(q, k, v, rates, scale=q.shape[-1] ** -0.5)
  return jnp.einsum("bthd,hdo->bto", o, params["out"]["kernel"], precision=HI) + params["out"]["bias"]


def _nnx_mha(fn, num_kv_heads=None, **kwargs):
  layer = nnx.MultiHeadAttention(H, F, num_kv_heads=num_kv_heads, attention_fn=fn, decode=False,
                                 rngs=nnx.Rngs(0), **kwargs)
  state = nnx.state(layer, nnx.Param)
  params = _randomize(nnx.to_pure_dict(state), seed=1)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(layer, state)
  return layer, params


def _close(a, b, tol=2e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("decay", [None, "alibi", np.array([0.05, 0.0, 0.7], np.float32)])
def test_nnx_multihead_attention(decay):
  layer, params = _nnx_mha(lj.attention_fn(decay, impl="xla"))
  x = _normal(2, (B, T, F))
  rates = None if decay is None else jnp.asarray(lj.alibi_slopes(H) if isinstance(decay, str) else decay)
  want = reference_mha(params, x, rates)
  _close(layer(x), want)
  # A causal mask (concrete) and is_causal are accepted and change nothing.
  _close(layer(x, mask=nnx.make_causal_mask(x[..., 0]), is_causal=True), want)


def test_linen_multihead_dot_product_attention():
  layer = nn.MultiHeadDotProductAttention(H, attention_fn=lj.attention_fn("minimax", layer_idx=1, num_layers=3,
                                                                          impl="xla"))
  x = _normal(3, (B, T, F))
  params = _randomize(layer.init(jax.random.key(0), x)["params"], seed=4)
  want = reference_mha(params, x, jnp.asarray(lj.minimax_slopes(H, 1, 3)))
  _close(layer.apply({"params": params}, x), want)
  _close(layer.apply({"params": params}, x, mask=nn.make_causal_mask(x[..., 0])), want)


def test_grouped_query_heads():
  layer, params = _nnx_mha(lj.attention_fn("alibi", impl="xla"), num_kv_heads=1)
  x = _normal(5, (B, T, F))
  _close(layer(x), reference_mha(params, x, jnp.asarray(lj.alibi_slopes(H))))


def test_direct_call_any_batch_dims():
  fn = lj.attention_fn("alibi", impl="xla")
  q, k, v = _normal(6, (1, B, T, H, D)), _normal(7, (1, B, T, H, D)), _normal(8, (1, B, T, H, 5))
  got = fn(q, k, v)
  want, _ = lj.lightning_attention_recurrent(q[0], k[0], v[0], jnp.asarray(lj.alibi_slopes(H)), scale=D ** -0.5)
  assert got.shape == (1, B, T, H, 5)
  _close(got[0], want)
  _close(fn(q[0, 0], k[0, 0], v[0, 0]), want[0])  # no batch dims at all


def test_pallas_passthrough():
  fn = lj.attention_fn("alibi", impl="pallas")
  q, k, v = (_normal(s, (1, 17, 2, 16)) for s in (9, 10, 11))
  want, _ = lj.lightning_attention_recurrent(q, k, v, jnp.asarray(lj.alibi_slopes(2)), scale=0.25)
  _close(fn(q, k, v), want, tol=1e-4)


def test_jit_and_grad_through_nnx_mha():
  layer, _ = _nnx_mha(lj.attention_fn("alibi", impl="xla"))
  x = _normal(12, (B, T, F))
  grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))(layer, x)
  for path, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads)):
    assert float(jnp.abs(g).max()) > 0, jax.tree_util.keystr(path)


def test_bfloat16_dtype():
  layer, params = _nnx_mha(lj.attention_fn("alibi", impl="xla"), dtype=jnp.bfloat16)
  x = _normal(13, (B, T, F))
  y = layer(x)
  want = reference_mha(params, x, jnp.asarray(lj.alibi_slopes(H)))
  assert y.dtype == jnp.bfloat16
  assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - want))) < 3e-2 * float(jnp.max(jnp.abs(want)))


# --- what linear attention cannot honour -----------------------------------------------------


@pytest.mark.parametrize("mask", [
    np.ones((B, 1, T, T), bool),  # bidirectional
    np.tril(np.ones((T, T), bool)) & (np.arange(T) < T - 3)[None, :],  # causal + key padding
    np.ones((B, 1, T, 5), bool),  # wrong shape
])
def test_non_causal_mask_raises(mask):
  layer, _ = _nnx_mha(lj.attention_fn(impl="xla"))
  with pytest.raises(ValueError, match="cannot honour an arbitrary attention mask"):
    layer(_normal(14, (B, T, F)), mask=jnp.asarray(mask))


def test_traced_mask_raises():
  layer, _ = _nnx_mha(lj.attention_fn(impl="xla"))
  x = _normal(15, (B, T, F))
  with pytest.raises(ValueError, match="traced mask"):
    nnx.jit(lambda m, x: m(x, mask=nnx.make_causal_mask(x[..., 0])))(layer, x)


def test_dropout_raises():
  fn = lj.attention_fn(impl="xla")
  layer = nnx.MultiHeadAttention(H, F, attention_fn=fn, dropout_rate=0.1, decode=False, rngs=nnx.Rngs(0))
  x = _normal(16, (B, T, F))
  with pytest.raises(ValueError, match="dropout"):
    layer(x, deterministic=False)
  assert layer(x, deterministic=True).shape == (B, T, F)  # no dropout applied: fine


def test_sow_weights_raises():
  layer, _ = _nnx_mha(lj.attention_fn(impl="xla"))
  with pytest.raises(ValueError, match="sow"):
    layer(_normal(17, (B, T, F)), sow_weights=True)
  linen_layer = nn.MultiHeadDotProductAttention(H, attention_fn=lj.attention_fn(impl="xla"))
  x = _normal(18, (B, T, F))
  with pytest.raises(ValueError, match="sow"):
    linen_layer.init(jax.random.key(0), x, sow_weights=True)


def test_bias_and_cross_attention_raise():
  fn = lj.attention_fn(impl="xla")
  q = _normal(19, (B, T, H, D))
  with pytest.raises(ValueError, match="bias"):
    fn(q, q, q, bias=jnp.zeros((B, H, T, T)))
  with pytest.raises(ValueError, match="self-attention"):
    fn(q, q[:, :5], q[:, :5])
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    fn(q, q[:, :, :2], q[:, :, :2])


def test_flax_decode_cache_raises():
  layer = nnx.MultiHeadAttention(H, F, attention_fn=lj.attention_fn(impl="xla"), decode=True, rngs=nnx.Rngs(0))
  layer.init_cache((B, T, F))
  with pytest.raises(ValueError, match="LightningAttention"):
    layer(_normal(20, (B, 1, F)))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(decay="minimax"), ValueError, "layer_idx and num_layers"),
    (dict(decay="retnet"), ValueError, "decay"),
    (dict(decay=np.array([0.1, -1.0])), ValueError, ">= 0"),
    (dict(decay=object()), TypeError, "decay"),
])
def test_bad_arguments(kwargs, error, match):
  with pytest.raises(error, match=match):
    lj.attention_fn(**kwargs)


def test_decay_length_must_match_heads():
  fn = lj.attention_fn(np.array([0.1, 0.2]), impl="xla")
  q = _normal(21, (B, T, H, D))
  with pytest.raises(ValueError, match=r"shape \[3\]"):
    fn(q, q, q)
