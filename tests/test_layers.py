"""Flax layers: lightning_jax.nnx.LightningAttention and lightning_jax.linen.LightningAttention.

Outputs and gradients are checked against `reference_layer`, a hand-written
einsum version of the layer on top of the token-serial oracle
`lightning_attention_recurrent`, with every parameter randomised.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import lightning_jax as lj
from lightning_jax import _layer_common as common
from lightning_jax import linen as lj_linen
from lightning_jax import nnx as lj_nnx

# Compiles dominate the run time; compiled without LLVM's optimisations (conftest), the outputs and gradients
# stay within a fifth of these tolerances.
pytestmark = pytest.mark.usefixtures("unoptimized_compiles")

HI = jax.lax.Precision.HIGHEST
# Odd sizes: batch 2, 13 tokens, 10 input features, 3 heads of dim 6, 7 outputs.
B, T, F, H, DH, OUT = 2, 13, 10, 3, 6, 7
SIZES = dict(num_heads=H, in_features=F, qkv_features=H * DH, out_features=OUT)

FEATURE_MAPS = {
    "identity": lambda x: x,
    "silu": lambda x: x / (1 + jnp.exp(-x)),
    "elu_plus_one": lambda x: jnp.where(x > 0, x + 1, jnp.exp(x)),
    "relu": lambda x: jnp.maximum(x, 0),
}

CONFIGS = {
    "defaults": dict(),
    "plain": dict(decay=None, feature_map="identity", output_norm=None, output_gate=False),
    "minimax": dict(decay="minimax", layer_idx=1, num_layers=3, feature_map="elu_plus_one",
                    output_norm="head_rms"),
    "explicit": dict(decay=np.array([0.0, 0.3, 1.1], np.float32), feature_map="relu", output_gate=False,
                     scale=1.0, use_bias=False),
    "learnable": dict(decay="alibi", learnable_decay=True),
}


# Inputs and parameters come from numpy: every eager jnp op on a new shape is an
# XLA compile, and compiles dominate the run time of these small tests.
def _normal(seed, shape, scale=1.0):
  return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _randomize(params, seed):
  """Every parameter random (so zero biases or unit norm scales cannot hide a bug)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: jnp.asarray(0.5 * rng.standard_normal(p.shape), p.dtype), params)


def reference_layer(params, x, *, decay="alibi", layer_idx=None, num_layers=None, learnable_decay=False,
                    feature_map="silu", output_gate=True, output_norm="rms", scale=None, use_bias=True):
  """The layer written out: einsum projections, the oracle recurrence, norm, gate."""
  del use_bias  # biases are simply absent from params
  def proj(name):
    p = params[name]
    return jnp.einsum("btf,fhd->bthd", x, p["kernel"], precision=HI) + p.get("bias", 0.0)
  fmap = FEATURE_MAPS[feature_map]
  q, k, v = fmap(proj("query")), fmap(proj("key")), proj("value")
  if learnable_decay:
    rates = jnp.log1p(jnp.exp(params["decay"]))
  elif isinstance(decay, str):
    rates = (lj.alibi_slopes(q.shape[2]) if decay == "alibi"
             else lj.minimax_slopes(q.shape[2], layer_idx, num_layers))
  else:
    rates = decay
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  o, _ = lj.lightning_attention_recurrent(q, k, v, None if rates is None else jnp.asarray(rates), scale=scale)
  if output_norm is not None:
    axes = (-2, -1) if output_norm == "rms" else (-1,)
    o = o / jnp.sqrt(jnp.mean(o * o, axis=axes, keepdims=True) + 1e-6) * params["norm"]
  if output_gate:
    o = o / (1 + jnp.exp(-proj("gate")))
  out = params["out"]
  return jnp.einsum("bthd,hdo->bto", o, out["kernel"], precision=HI) + out.get("bias", 0.0)


@functools.partial(jax.jit, static_argnames="name")
def jit_reference(params, x, name):
  return reference_layer(params, x, **CONFIGS[name])


# --- NNX / Linen behind one interface: build, read params, apply with params -------------------


def nnx_params(module):
  return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def set_nnx_params(module, params):
  state = nnx.state(module, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(module, state)


def build(framework, seed=0, **kwargs):
  """Returns (apply(params, x) -> y, initial params) for one framework."""
  kwargs = {**SIZES, **kwargs}
  if framework == "nnx":
    module = lj_nnx.LightningAttention(**kwargs, rngs=nnx.Rngs(seed))
    graphdef, param_state, rest = nnx.split(module, nnx.Param, ...)

    def apply(params, x):
      state = jax.tree.map(lambda a: a, param_state)  # a copy, filled with `params`
      nnx.replace_by_pure_dict(state, params)
      return nnx.merge(graphdef, state, rest)(x)
    return apply, nnx.to_pure_dict(param_state)
  module = lj_linen.LightningAttention(**kwargs)
  params = module.init(jax.random.key(seed), jnp.zeros((1, 1, kwargs["in_features"])))["params"]
  return (lambda p, x: module.apply({"params": p}, x)), params


def _close(a, b, rtol=2e-5, atol=2e-5):
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=atol)


# --- forward against the reference ----------------------------------------------------------


@pytest.mark.parametrize("framework", ["nnx", "linen"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_matches_reference(framework, name):
  config = CONFIGS[name]
  apply, params = build(framework, impl="xla", **config)
  params = _randomize(params, seed=1)
  x = _normal(2, (B, T, F))
  y = apply(params, x)
  assert y.shape == (B, T, OUT) and y.dtype == jnp.float32
  _close(y, jit_reference(params, x, name))


def test_param_names_and_shapes():
  _, params = build("nnx", learnable_decay=True)
  shapes = jax.tree.map(jnp.shape, params)
  proj = {"kernel": (F, H, DH), "bias": (H, DH)}
  assert shapes == {"query": proj, "key": proj, "value": proj, "gate": proj,
                    "out": {"kernel": (H, DH, OUT), "bias": (OUT,)}, "norm": (H, DH), "decay": (H,)}
  _, plain = build("nnx", **CONFIGS["plain"], use_bias=False)
  assert set(plain) == {"query", "key", "value", "out"} and set(plain["out"]) == {"kernel"}


@pytest.mark.parametrize("name", ["defaults", "minimax", "learnable"])
def test_weights_transfer_between_nnx_and_linen(name):
  config = dict(impl="xla", **CONFIGS[name])
  x = _normal(3, (B, T, F))
  nnx_layer = lj_nnx.LightningAttention(**SIZES, **config, rngs=nnx.Rngs(0))
  linen_layer = lj_linen.LightningAttention(**SIZES, **config)
  linen_params = linen_layer.init(jax.random.key(1), x)["params"]
  assert jax.tree.map(jnp.shape, linen_params) == jax.tree.map(jnp.shape, nnx_params(nnx_layer))

  # NNX -> Linen: the NNX parameter dict is a valid Linen `params` collection.
  set_nnx_params(nnx_layer, _randomize(nnx_params(nnx_layer), seed=4))
  np.testing.assert_array_equal(linen_layer.apply({"params": nnx_params(nnx_layer)}, x), nnx_layer(x))
  # Linen -> NNX.
  linen_params = _randomize(linen_params, seed=5)
  set_nnx_params(nnx_layer, linen_params)
  np.testing.assert_array_equal(nnx_layer(x), linen_layer.apply({"params": linen_params}, x))


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_impl_passthrough(impl):
  apply, params = build("nnx", impl=impl)
  params = _randomize(params, seed=6)
  x = _normal(7, (B, T, F))
  _close(apply(params, x), jit_reference(params, x, "defaults"))


def test_pallas_passthrough():
  # Pallas kernels in interpret mode on CPU: small shapes only. Then decoding:
  # two chunked prefills through the kernel (initial_state, return_final_state)
  # around a single-token step.
  sizes = dict(num_heads=2, in_features=8, qkv_features=32, out_features=8)
  layer = lj_nnx.LightningAttention(**sizes, impl="pallas", rngs=nnx.Rngs(0))
  set_nnx_params(layer, _randomize(nnx_params(layer), seed=8))
  x = _normal(9, (1, 17, 8))
  want = jit_reference(nnx_params(layer), x, "defaults")
  _close(layer(x), want, rtol=1e-4, atol=1e-4)
  layer.init_cache(1)
  got = np.concatenate([layer(x[:, :8], decode=True), layer(x[:, 8:9], decode=True),
                        layer(x[:, 9:], decode=True)], axis=1)
  _close(got, want, rtol=1e-4, atol=1e-4)


# --- learnable decay ------------------------------------------------------------------------


@pytest.mark.parametrize("decay,want", [
    ("alibi", lj.alibi_slopes(H)),
    ("minimax", lj.minimax_slopes(H, 2, 4)),
    (np.array([0.5, 0.0, 2.0]), np.array([0.5, common.MIN_LEARNABLE_RATE, 2.0])),
])
def test_learnable_decay_initial_rates(decay, want):
  layer = lj_nnx.LightningAttention(**SIZES, decay=decay, layer_idx=2, num_layers=4, learnable_decay=True,
                                    rngs=nnx.Rngs(0))
  _close(layer.decay_rates(), want, rtol=1e-5, atol=1e-9)
  _close(jax.nn.softplus(layer.decay[...]), want, rtol=1e-5, atol=1e-9)
  linen_layer = lj_linen.LightningAttention(**SIZES, decay=decay, layer_idx=2, num_layers=4, learnable_decay=True)
  params = linen_layer.init(jax.random.key(0), jnp.zeros((1, 1, F)))["params"]
  np.testing.assert_array_equal(params["decay"], layer.decay[...])


def test_learnable_decay_stays_non_negative():
  layer = lj_nnx.LightningAttention(**SIZES, learnable_decay=True, impl="xla", rngs=nnx.Rngs(0))
  layer.decay[...] = jnp.array([-50.0, 0.0, 30.0])
  rates = layer.decay_rates()
  assert bool(jnp.all(rates >= 0)) and bool(jnp.all(jnp.isfinite(layer(_normal(0, (B, T, F))))))


def test_fixed_decay_is_not_a_parameter():
  _, params = build("nnx", decay="alibi")
  assert "decay" not in params
  layer = lj_nnx.LightningAttention(**SIZES, decay=None, rngs=nnx.Rngs(0))
  assert layer.decay_rates() is None


# --- gradients ------------------------------------------------------------------------------


def _mse(y, target):
  return jnp.mean((y - target) ** 2)


@functools.partial(jax.jit, static_argnames="name")
def reference_grads(params, x, target, name):
  return jax.grad(lambda p: _mse(reference_layer(p, x, **CONFIGS[name]), target))(params)


@pytest.mark.parametrize("framework,name", [("nnx", "learnable"), ("linen", "learnable"), ("nnx", "minimax")])
def test_gradients_reach_every_parameter(framework, name):
  config = CONFIGS[name]
  apply, params = build(framework, impl="xla", **config)
  params = _randomize(params, seed=10)
  x, target = _normal(11, (B, T, F)), _normal(12, (B, T, OUT))
  grads = jax.jit(jax.grad(lambda p: _mse(apply(p, x), target)))(params)
  want = reference_grads(params, x, target, name)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  if config.get("learnable_decay"):
    assert "decay" in grads
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert float(jnp.abs(g).max()) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"
  jax.tree.map(lambda g, w: _close(g, w, rtol=1e-4, atol=1e-5), grads, want)


def test_nnx_remat():
  layer = lj_nnx.LightningAttention(**SIZES, **CONFIGS["learnable"], impl="xla", rngs=nnx.Rngs(0))
  params = _randomize(nnx_params(layer), seed=13)
  set_nnx_params(layer, params)
  x, target = _normal(11, (B, T, F)), _normal(12, (B, T, OUT))
  remat_call = nnx.remat(lambda m, x: m(x))
  grads = nnx.jit(nnx.grad(lambda m: _mse(remat_call(m, x), target)))(layer)
  want = reference_grads(params, x, target, "learnable")
  jax.tree.map(lambda g, w: _close(g, w, rtol=1e-4, atol=1e-5), nnx.to_pure_dict(grads), want)


# --- training ----------------------------------------------------------------------------------


def _shift_task(seed, steps=30):
  """Synthetic causal task: predict the previous token's features (needs attention)."""
  x = _normal(seed, (B, T, F))
  target = np.pad(x[:, :-1, :OUT], ((0, 0), (1, 0), (0, 0)))
  return x, target, steps


def test_nnx_jit_train_step_reduces_loss():
  x, target, steps = _shift_task(20)
  model = lj_nnx.LightningAttention(**SIZES, learnable_decay=True, impl="xla", rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, target):
    loss, grads = nnx.value_and_grad(lambda m: _mse(m(x), target))(model)
    optimizer.update(model, grads)
    return loss

  decay0 = model.decay[...]
  losses = [float(train_step(model, optimizer, x, target)) for _ in range(steps)]
  assert losses[-1] < 0.6 * losses[0], losses
  assert not np.allclose(model.decay[...], decay0)  # the decay trains too


def test_linen_jax_jit_train_step_reduces_loss():
  x, target, steps = _shift_task(21)
  model = lj_linen.LightningAttention(**SIZES, learnable_decay=True, impl="xla")
  params = model.init(jax.random.key(0), x)["params"]
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: _mse(model.apply({"params": p}, x), target))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(steps):
    params, opt_state, loss = train_step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < 0.6 * losses[0], losses


# --- dtypes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_bfloat16_compute_float32_params(framework):
  apply16, params = build(framework, dtype=jnp.bfloat16, impl="xla")
  apply32, _ = build(framework, impl="xla")
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  params = _randomize(params, seed=14)
  x = _normal(15, (B, T, F))
  y16, y32 = apply16(params, x), apply32(params, x)
  assert y16.dtype == jnp.bfloat16
  assert float(jnp.max(jnp.abs(y16.astype(jnp.float32) - y32))) < 3e-2 * float(jnp.max(jnp.abs(y32)))


# --- decoding -----------------------------------------------------------------------------------

# Prefill of 5 tokens (kernel), 4 single tokens (jnp step), a block of 3, a last token.
SPLITS = (5, 1, 1, 1, 1, 3, 1)


def _pieces(x):
  bounds = np.cumsum((0,) + SPLITS)
  assert bounds[-1] == x.shape[1]
  return [x[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("decay,dtype", [(None, jnp.float32), ("alibi", jnp.bfloat16), ("learnable", jnp.float32)])
def test_nnx_decode_matches_full_forward(decay, dtype):
  config = dict(decay="alibi", learnable_decay=True) if decay == "learnable" else dict(decay=decay)
  layer = lj_nnx.LightningAttention(**SIZES, **config, dtype=dtype, impl="xla", rngs=nnx.Rngs(0))
  set_nnx_params(layer, _randomize(nnx_params(layer), seed=16))
  x = _normal(17, (B, T, F))
  full = layer(x)
  layer.init_cache(B)
  assert layer.cached_state[...].shape == (B, H, DH, DH) and layer.cached_state[...].dtype == jnp.float32
  steps = [layer(piece, decode=True) for piece in _pieces(x)]
  tol = 2e-5 if dtype == jnp.float32 else 3e-2
  _close(np.concatenate(steps, axis=1), full, rtol=tol, atol=tol * float(jnp.max(jnp.abs(full))))


@pytest.mark.parametrize("decay", [None, "minimax"])
def test_linen_decode_matches_full_forward(decay):
  model = lj_linen.LightningAttention(**SIZES, decay=decay, layer_idx=0, num_layers=2, impl="xla")
  x = _normal(18, (B, T, F))
  params = _randomize(model.init(jax.random.key(0), x)["params"], seed=19)
  full = model.apply({"params": params}, x)
  # As with Flax's decode caches, `init` with decode=True creates a zero cache.
  variables = model.init(jax.random.key(0), x[:, :1], decode=True)
  np.testing.assert_array_equal(variables["cache"]["cached_state"], jnp.zeros((B, H, DH, DH)))
  cache = variables["cache"]
  step = jax.jit(lambda cache, piece: model.apply({"params": params, "cache": cache}, piece, decode=True,
                                                  mutable=["cache"]))
  outs = []
  for piece in _pieces(x):
    y, updated = step(cache, piece)
    cache = updated["cache"]
    outs.append(y)
  _close(np.concatenate(outs, axis=1), full)
  # init_cache resets the state.
  _, reset = model.apply({"params": params, "cache": cache}, B, method="init_cache", mutable=["cache"])
  np.testing.assert_array_equal(reset["cache"]["cached_state"], jnp.zeros((B, H, DH, DH)))


def test_decode_state_is_the_oracle_final_state():
  layer = lj_nnx.LightningAttention(**SIZES, feature_map="identity", impl="xla", rngs=nnx.Rngs(0))
  params = _randomize(nnx_params(layer), seed=22)
  set_nnx_params(layer, params)
  x = _normal(23, (B, T, F))
  layer.init_cache(B)
  for piece in _pieces(x):
    layer(piece, decode=True)
  k = jnp.einsum("btf,fhd->bthd", x, params["key"]["kernel"], precision=HI) + params["key"]["bias"]
  v = jnp.einsum("btf,fhd->bthd", x, params["value"]["kernel"], precision=HI) + params["value"]["bias"]
  _, want = lj.lightning_attention_recurrent(k, k, v, jnp.asarray(lj.alibi_slopes(H)), scale=1.0)
  _close(layer.cached_state[...], want, rtol=1e-5, atol=1e-5)


def test_single_token_decode_launches_no_kernel():
  # One token is a jnp step; a block of tokens goes through the (Pallas) kernel.
  layer = lj_nnx.LightningAttention(num_heads=2, in_features=8, qkv_features=32, impl="pallas", rngs=nnx.Rngs(0))
  layer.init_cache(1)
  graphdef, state = nnx.split(layer)

  def jaxpr(tokens):
    step = lambda state, x: nnx.merge(graphdef, state)(x, decode=True)
    return str(jax.make_jaxpr(step)(state, jnp.ones((1, tokens, 8))))

  assert "pallas_call" not in jaxpr(1)
  assert "pallas_call" in jaxpr(4)


def test_decode_in_jit_with_nnx():
  layer = lj_nnx.LightningAttention(**SIZES, impl="xla", decode=True, rngs=nnx.Rngs(0))
  x = _normal(25, (B, T, F))
  full = layer(x, decode=False)
  layer.init_cache(B)
  step = nnx.jit(lambda m, piece: m(piece))
  outs = [step(layer, piece) for piece in _pieces(x)]
  _close(np.concatenate(outs, axis=1), full)


def test_decode_errors():
  layer = lj_nnx.LightningAttention(**SIZES, rngs=nnx.Rngs(0))
  x = _normal(26, (B, 1, F))
  with pytest.raises(ValueError, match="init_cache"):
    layer(x, decode=True)
  layer.init_cache(B + 1)
  with pytest.raises(ValueError, match="batch_size=2"):
    layer(x, decode=True)
  with pytest.raises(ValueError, match="batch_size"):
    layer.init_cache(0)
  model = lj_linen.LightningAttention(**SIZES)
  params = model.init(jax.random.key(0), x)["params"]
  with pytest.raises(ValueError, match="init_cache"):
    model.apply({"params": params}, x, decode=True, mutable=["cache"])


# --- argument validation ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_heads=4, in_features=10), ValueError, "divisible by num_heads"),
    (dict(qkv_features=20), ValueError, "divisible by num_heads"),
    (dict(num_heads=0), ValueError, "num_heads"),
    (dict(in_features=-1), ValueError, "in_features"),
    (dict(out_features=2.5), ValueError, "out_features"),
    (dict(feature_map="softmax"), ValueError, "feature_map"),
    (dict(decay="linear"), ValueError, "decay"),
    (dict(decay="minimax"), ValueError, "layer_idx and num_layers"),
    (dict(decay="minimax", layer_idx=3, num_layers=3), ValueError, "layer_idx"),
    (dict(decay=np.array([0.1, -0.2, 0.3])), ValueError, ">= 0"),
    (dict(decay=np.array([0.1, 0.2])), ValueError, r"shape \[3\]"),
    (dict(decay=None, learnable_decay=True), ValueError, "learnable_decay"),
    (dict(learnable_decay="yes"), TypeError, "learnable_decay"),
    (dict(output_norm="layer"), ValueError, "output_norm"),
    (dict(output_gate=1), TypeError, "output_gate"),
    (dict(scale="big"), TypeError, "scale"),
    (dict(impl="cuda"), ValueError, "impl"),
    (dict(variant="fast"), ValueError, "variant"),
    (dict(config={}), TypeError, "config"),
    (dict(num_heads=1, qkv_features=512), ValueError, "head dim"),
    (dict(sequence_axis=3), TypeError, "sequence_axis must be None or a mesh axis name"),
])
@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_bad_constructor_arguments(framework, kwargs, error, match):
  kwargs = {**SIZES, **kwargs}
  with pytest.raises(error, match=match):
    if framework == "nnx":
      lj_nnx.LightningAttention(**kwargs, rngs=nnx.Rngs(0))
    else:
      lj_linen.LightningAttention(**kwargs)


@pytest.mark.parametrize("shape", [(B, T, F + 1), (T, F), (1, B, T, F)])
def test_bad_input_shape(shape):
  layer = lj_nnx.LightningAttention(**SIZES, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="in_features=10"):
    layer(jnp.ones(shape))


def test_linen_layer_composes_in_a_model():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x[..., :OUT] + lj_linen.LightningAttention(**SIZES, impl="xla", name="attn")(nn.LayerNorm()(x))

  x = _normal(27, (B, T, F))
  variables = Block().init(jax.random.key(0), x)
  assert set(variables["params"]["attn"]) == {"query", "key", "value", "gate", "norm", "out"}
  assert Block().apply(variables, x).shape == (B, T, OUT)
