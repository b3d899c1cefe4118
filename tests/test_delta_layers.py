"""Flax layers: lightning_jax.nnx.DeltaAttention and lightning_jax.linen.DeltaAttention.

Outputs are checked against `reference_layer`, the block written out by hand
(einsum projections, lax.conv depthwise convolutions, the gates, the token-serial
oracle `delta_attention_recurrent`, the gated RMS norm), with every parameter
randomised; decoding and packed sequences against the layer's own full forward.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lightning_jax import linen as lj_linen
from lightning_jax import nnx as lj_nnx
from lightning_jax.ops.delta_attention import delta_attention_recurrent

# Compiles dominate the run time; the tolerances are far above float32 rounding.
pytestmark = pytest.mark.usefixtures("unoptimized_compiles")


@pytest.fixture(autouse=True)
def full_precision_matmuls():
  """The layers' float32 projections at full precision, as the reference's: a GPU's default is TF32 (about 1e-3
  relative), which failed the 1e-4 comparisons on an H200. The tests check the block's math."""
  with jax.default_matmul_precision("highest"):
    yield

HI = jax.lax.Precision.HIGHEST
B, T, F, H, D = 2, 19, 32, 2, 8
SIZES = dict(num_heads=H, in_features=F, head_dim=D)
CONFIGS = {
    # Kimi Linear's KDA block (the defaults).
    "kda": dict(),
    # Qwen3-Next's Gated DeltaNet, with two value heads per q/k head and E != D.
    "scalar": dict(gate="scalar", num_v_heads=4, value_head_dim=6, full_rank_output_gate=True,
                   output_gate_activation="silu", conv_size=3),
    # DeltaNet: no gate, a plain output norm; and the remaining options.
    "plain": dict(gate=None, output_gate_activation=None, allow_neg_eigval=True, use_bias=True, scale=0.3,
                  out_features=7, conv_size=2, norm_eps=1e-3),
}


# Inputs and parameters come from numpy: every eager jnp op on a new shape is an XLA compile.
def _normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _randomize(params, seed):
  """Every parameter random (so zero biases or unit norm scales cannot hide a bug)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: jnp.asarray(0.5 * rng.standard_normal(p.shape), p.dtype), params)


def _close(a, b, tol=1e-4):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.abs(b).max()))


def reference_layer(p, x, *, output_gate_activation="sigmoid", allow_neg_eigval=False, scale=None, norm_eps=1e-6,
                    **_):
  """The block written out from its parameters (the gate kinds are read off the parameter names)."""
  def dense(name, x):  # o_proj contracts [Hv, E], the others the features
    y = jnp.tensordot(x, p[name]["kernel"], axes=2 if name == "o_proj" else 1, precision=HI)
    return y + p[name].get("bias", 0.0)

  def conv(x, kernel):  # depthwise, causal, then SiLU; kernel [K, heads, dim] -> lax's [K, 1, C]
    b, t, h, d = x.shape
    y = jax.lax.conv_general_dilated(x.reshape(b, t, h * d), kernel.reshape(kernel.shape[0], 1, h * d), (1,),
                                     [(kernel.shape[0] - 1, 0)], dimension_numbers=("NWC", "WIO", "NWC"),
                                     feature_group_count=h * d, precision=HI).reshape(x.shape)
    return y / (1 + jnp.exp(-y))

  def l2norm(x):
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

  q = l2norm(conv(dense("q_proj", x), p["q_conv1d"]))
  k = l2norm(conv(dense("k_proj", x), p["k_conv1d"]))
  v = conv(dense("v_proj", x), p["v_conv1d"])
  group = v.shape[2] // q.shape[2]
  q, k = jnp.repeat(q, group, axis=2), jnp.repeat(k, group, axis=2)
  beta = (2.0 if allow_neg_eigval else 1.0) / (1 + jnp.exp(-dense("b_proj", x)))
  softplus = lambda u: jnp.log1p(jnp.exp(u))
  if "f_a_proj" in p:  # KDA: a rate per head and key channel
    decay = jnp.exp(p["A_log"])[:, None] * softplus(dense("f_b_proj", dense("f_a_proj", x)) + p["dt_bias"])
  elif "a_proj" in p:  # Gated DeltaNet: a rate per head
    decay = jnp.exp(p["A_log"]) * softplus(dense("a_proj", x) + p["dt_bias"])
  else:
    decay = None
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  o, _ = delta_attention_recurrent(q, k, v, beta, decay, scale=scale)
  o = o / jnp.sqrt(jnp.mean(o * o, axis=-1, keepdims=True) + norm_eps) * p["o_norm"]
  if output_gate_activation is not None:
    z = dense("g_proj", x) if "g_proj" in p else dense("g_b_proj", dense("g_a_proj", x))
    o = o * (z if output_gate_activation == "silu" else 1.0) / (1 + jnp.exp(-z))
  return dense("o_proj", o)


# --- NNX / Linen behind one interface: build, apply with params ---------------------------------


def nnx_params(module):
  return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def set_nnx_params(module, params):
  state = nnx.state(module, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(module, state)


def build(framework, config, seed=0, **kwargs):
  """(apply(params, x, **call_kwargs) -> y, random params) of one framework's layer; the layer is
  built abstractly (no initialisation to compile), its parameters come from numpy."""
  kwargs = {**SIZES, **CONFIGS[config], "impl": "xla", **kwargs}
  if framework == "nnx":
    abstract = nnx.eval_shape(lambda: lj_nnx.DeltaAttention(**kwargs, rngs=nnx.Rngs(seed)))
    graphdef, param_state, rest = nnx.split(abstract, nnx.Param, ...)

    def apply(params, x, **call_kwargs):
      state = jax.tree.map(lambda a: a, param_state)  # a copy, filled with `params`
      nnx.replace_by_pure_dict(state, params)
      return nnx.merge(graphdef, state, rest)(x, **call_kwargs)
    params = nnx.to_pure_dict(param_state)
  else:
    module = lj_linen.DeltaAttention(**kwargs)
    params = jax.eval_shape(module.init, jax.random.key(seed), jnp.zeros((1, 1, F)))["params"]
    apply = lambda p, x, **call_kwargs: module.apply({"params": p}, x, **call_kwargs)
  return apply, _randomize(params, seed + 1)


def nnx_layer(config, **kwargs):
  """An NNX layer with random parameters."""
  layer = nnx.eval_shape(lambda: lj_nnx.DeltaAttention(**SIZES, **CONFIGS[config], impl="xla", **kwargs,
                                                       rngs=nnx.Rngs(0)))
  set_nnx_params(layer, _randomize(nnx_params(layer), seed=1))
  return layer


# --- forward ------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_layer_matches_reference(config):
  apply, params = build("nnx", config)
  x = _normal(2, (B, T, F))
  y = jax.jit(apply)(params, x)
  assert y.shape == (B, T, CONFIGS[config].get("out_features", F)) and y.dtype == jnp.float32
  _close(y, jax.jit(lambda p, x: reference_layer(p, x, **CONFIGS[config]))(params, x))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_nnx_and_linen_agree(config):
  # The NNX parameter dict is a valid Linen `params` collection, and both give the same output.
  nnx_apply, params = build("nnx", config)
  linen_apply, linen_params = build("linen", config)
  assert jax.tree.map(jnp.shape, linen_params) == jax.tree.map(jnp.shape, params)
  x = _normal(3, (B, T, F))
  np.testing.assert_array_equal(jax.jit(linen_apply)(params, x), jax.jit(nnx_apply)(params, x))


def test_param_names_and_shapes():
  shapes = jax.tree.map(jnp.shape, build("nnx", "kda")[1])
  qk = {"kernel": (F, H, D)}
  assert shapes == {
      "q_proj": qk, "k_proj": qk, "v_proj": qk, "q_conv1d": (4, H, D), "k_conv1d": (4, H, D),
      "v_conv1d": (4, H, D), "b_proj": {"kernel": (F, H)}, "f_a_proj": {"kernel": (F, D)},
      "f_b_proj": {"kernel": (D, H, D)}, "A_log": (H,), "dt_bias": (H, D), "g_a_proj": {"kernel": (F, D)},
      "g_b_proj": {"kernel": (D, H, D)}, "o_norm": (D,), "o_proj": {"kernel": (H, D, F)}}
  shapes = jax.tree.map(jnp.shape, build("linen", "scalar")[1])
  hv, e = 4, 6
  assert shapes == {
      "q_proj": qk, "k_proj": qk, "v_proj": {"kernel": (F, hv, e)}, "q_conv1d": (3, H, D), "k_conv1d": (3, H, D),
      "v_conv1d": (3, hv, e), "b_proj": {"kernel": (F, hv)}, "a_proj": {"kernel": (F, hv)}, "A_log": (hv,),
      "dt_bias": (hv,), "g_proj": {"kernel": (F, hv, e)}, "o_norm": (e,), "o_proj": {"kernel": (hv, e, F)}}
  plain = build("nnx", "plain")[1]
  assert set(plain) == {"q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "b_proj", "o_norm",
                        "o_proj"}
  assert set(plain["o_proj"]) == {"kernel", "bias"}


def test_initial_values():
  nnx_init = nnx_params(lj_nnx.DeltaAttention(**SIZES, rngs=nnx.Rngs(0)))
  linen_init = jax.jit(lj_linen.DeltaAttention(**SIZES).init)(jax.random.key(0), jnp.zeros((1, 1, F)))["params"]
  for params in (nnx_init, linen_init):
    assert np.all((params["A_log"] >= 0) & (params["A_log"] <= np.log(16)))  # A uniform in [1, 16]
    np.testing.assert_array_equal(params["dt_bias"], np.ones((H, D)))
    np.testing.assert_array_equal(params["o_norm"], np.ones(D))
    conv = np.asarray(params["q_conv1d"])
    assert np.all(np.abs(conv) <= 0.5) and np.std(conv) > 0.1  # uniform in +-1/sqrt(K)


# --- decoding -----------------------------------------------------------------------------------

# Steps shorter than the convolution window (2), longer ones (5), and single tokens; few
# distinct lengths, since each compiles.
SPLITS = (2, 1, 1, 2, 1, 5, 1, 5, 1)


def _pieces(x):
  bounds = np.cumsum((0,) + SPLITS)
  assert bounds[-1] == x.shape[1]
  return [x[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("config,dtype,jit", [("kda", jnp.float32, False), ("plain", jnp.bfloat16, True)])
def test_nnx_decode_matches_full_forward(config, dtype, jit):
  # Eager calls with decode=True, or nnx.jit calls of a layer built with decode=True.
  layer = nnx_layer(config, dtype=dtype, decode=jit)
  x = _normal(4, (B, T, F))
  full = layer(x, decode=False)
  layer.init_cache(B)
  assert layer.cached_state[...].dtype == jnp.float32
  step = nnx.jit(lambda m, piece: m(piece)) if jit else (lambda m, piece: m(piece, decode=True))
  outs = [step(layer, piece) for piece in _pieces(x)]
  assert outs[0].dtype == dtype and layer.cached_q_conv[...].dtype == jnp.float32
  _close(np.concatenate(outs, axis=1), full, tol=1e-4 if dtype == jnp.float32 else 3e-2)


def test_linen_decode_matches_full_forward():
  model = lj_linen.DeltaAttention(**SIZES, **CONFIGS["scalar"], impl="xla")
  x = _normal(5, (B, T, F))
  # As with Flax's decode caches, `init` with decode=True creates a zero cache.
  variables = jax.jit(lambda key, x: model.init(key, x, decode=True))(jax.random.key(0), x[:, :1])
  params, cache = _randomize(variables["params"], seed=6), variables["cache"]
  full = jax.jit(model.apply)({"params": params}, x)
  assert jax.tree.map(jnp.shape, cache) == {
      "cached_state": (B, 4, D, 6), "cached_q_conv": (B, 2, H, D), "cached_k_conv": (B, 2, H, D),
      "cached_v_conv": (B, 2, 4, 6), "cached_segment_id": (B,)}
  assert not any(np.any(c) for c in jax.tree.leaves(cache))
  step = jax.jit(lambda cache, piece: model.apply({"params": params, "cache": cache}, piece, decode=True,
                                                  mutable=["cache"]))
  outs = []
  for piece in _pieces(x):
    y, cache = step(cache, piece)
    cache = cache["cache"]
    outs.append(y)
  _close(np.concatenate(outs, axis=1), full)
  # init_cache resets the cache.
  _, reset = model.apply({"params": params, "cache": cache}, B, method="init_cache", mutable=["cache"])
  assert not any(np.any(c) for c in jax.tree.leaves(reset))


def test_prefill_in_two_pieces_equals_one():
  layer = nnx_layer("kda")
  step = nnx.jit(lambda m, x: m(x, decode=True))
  x = _normal(7, (B, T, F))
  layer.init_cache(B)
  whole = step(layer, x)
  want = {name: getattr(layer, name)[...] for name in ("cached_state", "cached_q_conv", "cached_k_conv",
                                                       "cached_v_conv")}
  layer.init_cache(B)
  pieces = np.concatenate([step(layer, x[:, :8]), step(layer, x[:, 8:])], axis=1)
  _close(pieces, whole)
  for name, value in want.items():
    _close(getattr(layer, name)[...], value)
  # The window holds the last K - 1 inputs of the convolution (q_proj's outputs).
  _close(layer.cached_q_conv[...], jnp.einsum("btf,fhd->bthd", x[:, -3:], layer.q_proj.kernel[...], precision=HI))


# --- packed sequences ---------------------------------------------------------------------------

# Segments shorter than the convolution window (1, 2) and a reused id (row 1: 3, 7, 3).
IDS = np.stack([np.repeat([0, 1, 2], [5, 2, 12]), np.repeat([3, 7, 3], [1, 9, 9])]).astype(np.int32)


def _segments_alone(apply, params, x, ids):
  """The layer's output with every segment of (x, ids) run alone, in a row of its own, right-padded
  with copies of its last token (causal: the segment never sees them)."""
  segs = []
  for r, row in enumerate(ids):
    bounds = [0, *(np.flatnonzero(row[1:] != row[:-1]) + 1), len(row)]
    segs += [(r, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
  length = max(b - a for _, a, b in segs)
  rows = np.array([[r] * length for r, _, _ in segs])
  cols = np.array([[min(a + j, b - 1) for j in range(length)] for _, a, b in segs])
  y = np.asarray(jax.jit(apply)(params, x[rows, cols]))
  out = np.zeros(x.shape[:2] + y.shape[-1:], np.float32)
  for s, (r, a, b) in enumerate(segs):
    out[r, a:b] = y[s, :b - a]
  return out


@pytest.mark.parametrize("framework,config", [("nnx", "kda"), ("linen", "scalar")])
def test_packed_equals_segments_alone(framework, config):
  apply, params = build(framework, config)
  x = _normal(9, (B, T, F))
  packed = jax.jit(lambda p, x, ids: apply(p, x, segment_ids=ids))(params, x, jnp.asarray(IDS))
  _close(packed, _segments_alone(apply, params, x, IDS))


# Decoding after a packed prefill of (x[:, :T], IDS), in steps of (row 0's ids, row 1's): row 0
# continues its last segment (id 2); row 1 starts id 8 in a one-token step, then id 9 two tokens
# before the end of a block (so the stored convolution window must drop the token of id 8).
STEPS = [([2], [8]), ([2, 2, 2], [8, 9, 9]), ([2], [9]), ([2], [9])]


def test_decode_after_packed_prefill_continues_or_restarts_segments():
  layer = nnx_layer("kda")
  call = nnx.jit(lambda m, x, ids, decode: m(x, segment_ids=ids, decode=decode), static_argnames="decode")
  ids = np.concatenate([IDS] + [np.array(step, np.int32) for step in STEPS], axis=1)
  x = _normal(10, (B, ids.shape[1], F))
  want = call(layer, x, ids, False)  # the packed forward (checked against segments alone above)
  layer.init_cache(B)
  outs, start = [call(layer, x[:, :T], IDS, True)], T
  for row0, _ in STEPS:
    stop = start + len(row0)
    outs.append(call(layer, x[:, start:stop], ids[:, start:stop], True))
    start = stop
  _close(np.concatenate(outs, axis=1), want)
  np.testing.assert_array_equal(layer.cached_segment_id[...], [2, 9])


# --- gradients ----------------------------------------------------------------------------------


@pytest.mark.parametrize("framework,config,dtype", [("nnx", "kda", jnp.float32), ("linen", "scalar", jnp.bfloat16),
                                                    ("nnx", "plain", jnp.bfloat16)])
def test_gradients_reach_every_parameter(framework, config, dtype):
  apply, params = build(framework, config, dtype=dtype)
  x, target = _normal(11, (B, T, F)), _normal(12, (B, T, CONFIGS[config].get("out_features", F)))
  loss = lambda p: jnp.mean((apply(p, x, segment_ids=jnp.asarray(IDS)).astype(jnp.float32) - target) ** 2)
  grads = jax.jit(jax.grad(loss))(params)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))), jax.tree_util.keystr(path)
    assert float(jnp.abs(g).max()) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"


# --- argument validation ------------------------------------------------------------------------


def test_input_errors():
  layer = nnx_layer("kda")
  for shape in [(B, T, F + 1), (T, F), (1, B, T, F)]:
    with pytest.raises(ValueError, match="in_features=32"):
      layer(jnp.ones(shape))
  x = _normal(13, (B, 1, F))
  with pytest.raises(TypeError, match="integer"):
    layer(x, segment_ids=jnp.zeros((B, 1)))
  with pytest.raises(ValueError, match=r"segment_ids must be \[B, T\]"):
    layer(x, segment_ids=jnp.zeros((B, 2), jnp.int32))
  with pytest.raises(ValueError, match="init_cache"):
    layer(x, decode=True)
  layer.init_cache(B + 1)
  with pytest.raises(ValueError, match="batch_size=2"):
    layer(x, decode=True)
  with pytest.raises(ValueError, match="batch_size"):
    layer.init_cache(0)
  model = lj_linen.DeltaAttention(**SIZES)
  params = model.init(jax.random.key(0), x)["params"]
  with pytest.raises(ValueError, match="init_cache"):
    model.apply({"params": params}, x, decode=True, mutable=["cache"])


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_heads=0), ValueError, "num_heads"),
    (dict(in_features=2.0), ValueError, "in_features"),
    (dict(num_v_heads=3), ValueError, "multiple of num_heads"),
    (dict(num_heads=3, head_dim=None), ValueError, "give head_dim"),
    (dict(value_head_dim=300), ValueError, "value_head_dim = 300 exceeds"),
    (dict(gate="mamba"), ValueError, "gate must be"),
    (dict(gate="scalar", gate_rank=4), ValueError, "gate_rank"),
    (dict(output_gate_activation="relu"), ValueError, "output_gate_activation"),
    (dict(output_gate_rank=4, full_rank_output_gate=True), ValueError, "output_gate_rank"),
    (dict(output_gate_rank=4, output_gate_activation=None), ValueError, "output_gate_rank"),
    (dict(full_rank_output_gate=1), TypeError, "full_rank_output_gate"),
    (dict(conv_size=0), ValueError, "conv_size"),
    (dict(norm_eps=0.0), ValueError, "norm_eps"),
    (dict(scale="big"), TypeError, "scale"),
    (dict(impl="cuda"), ValueError, "impl"),
    (dict(sequence_axis=3), TypeError, "sequence_axis must be None or a mesh axis name"),
])
@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_bad_constructor_arguments(framework, kwargs, error, match):
  kwargs = {**SIZES, **kwargs}
  with pytest.raises(error, match=match):
    if framework == "nnx":
      lj_nnx.DeltaAttention(**kwargs, rngs=nnx.Rngs(0))
    else:
      lj_linen.DeltaAttention(**kwargs)
