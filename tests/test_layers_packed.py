"""Packed sequences in the Flax layers: `LightningAttention(...)(x, segment_ids=ids)`, NNX and Linen.

The oracle is the layer itself, unpacked: every segment alone in a row of its
own, right-padded to a common length (causal, so the padding after a segment
never reaches it), through one call without segment_ids. Tiny sizes and
impl="xla"; each program is compiled once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lightning_jax import linen as lj_linen
from lightning_jax import nnx as lj_nnx

# Compiles dominate the run time; the tolerances are far above float32 rounding.
pytestmark = pytest.mark.usefixtures("unoptimized_compiles")

# 2 rows of 101 tokens (not a multiple of the 64-token chunks); 6 input features, 2 heads of dim 4, 5 outputs.
B, T, F, H, DH, OUT = 2, 101, 6, 2, 4, 5
SIZES = dict(num_heads=H, in_features=F, qkv_features=H * DH, out_features=OUT)
CONFIG = dict(decay="alibi", learnable_decay=True, impl="xla")  # the decay gradient crosses segments too
# Boundaries at odd positions (5, 17; 9, 11, 71): row 0's last segment and row 1's third cross the
# chunk boundary at 64; row 1 reuses id 3 (a segment is a maximal run, not an id).
IDS = np.stack([np.repeat([0, 1, 2], [5, 12, 84]), np.repeat([3, 7, 3, 1], [9, 2, 60, 30])]).astype(np.int32)


def _normal(seed, shape, scale=1.0):
  return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _randomize(params, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda p: jnp.asarray(0.5 * rng.standard_normal(p.shape), p.dtype), params)


def build(framework):
  """(apply(params, x, **call_kwargs) -> y, random params) of one framework's layer."""
  if framework == "nnx":
    graphdef, param_state, rest = nnx.split(lj_nnx.LightningAttention(**SIZES, **CONFIG, rngs=nnx.Rngs(0)),
                                            nnx.Param, ...)

    def apply(params, x, **kwargs):
      state = jax.tree.map(lambda a: a, param_state)  # a copy, filled with `params`
      nnx.replace_by_pure_dict(state, params)
      return nnx.merge(graphdef, state, rest)(x, **kwargs)
    return apply, _randomize(nnx.to_pure_dict(param_state), seed=1)
  module = lj_linen.LightningAttention(**SIZES, **CONFIG)
  params = module.init(jax.random.key(0), jnp.zeros((1, 1, F)))["params"]
  return (lambda p, x, **kwargs: module.apply({"params": p}, x, **kwargs)), _randomize(params, seed=1)


def segments(ids):
  """The (row, start, stop) of every maximal run of equal ids."""
  out = []
  for r, row in enumerate(np.asarray(ids)):
    bounds = [0, *np.flatnonzero(row[1:] != row[:-1]) + 1, len(row)]
    out += [(r, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
  return out


def unpack_index(ids):
  """Gathers [S, L] (segment, position) -> packed (row, token), and the [S, L] mask of real tokens."""
  segs = segments(ids)
  length = max(b - a for _, a, b in segs)
  rows = np.array([[r] * length for r, _, _ in segs])
  cols = np.array([[min(a + j, b - 1) for j in range(length)] for _, a, b in segs])
  valid = np.array([[j < b - a for j in range(length)] for _, a, b in segs])
  return rows, cols, valid


def alone(apply, params, x, ids, w=None):
  """The layer's output [B, T, OUT] with every segment of (x, ids) run alone, unpacked; given
  w [B, T, OUT], also the parameter gradients of sum(output * w)."""
  rows, cols, valid = unpack_index(ids)
  mask = valid[..., None]

  @jax.jit
  def run(params, x, w):
    def loss(p):
      # The tail repeats a segment's last token after it: causal, the segment never sees it.
      y = apply(p, x[rows, cols])
      return (0.0 if w is None else jnp.sum(jnp.where(mask, y * w[rows, cols], 0))), y
    if w is None:
      return loss(params)[1], None
    (_, y), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return y, grads

  y, grads = run(params, x, w)
  out = np.zeros(x.shape[:2] + (OUT,), np.float32)
  out[rows[valid], cols[valid]] = np.asarray(y)[valid]
  return out if w is None else (out, grads)


def _close(a, b, tol=1e-4):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.abs(b).max()))


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_packed_equals_segments_alone(framework):
  apply, params = build(framework)
  x, w = _normal(2, (B, T, F)), _normal(3, (B, T, OUT))

  # Outputs and parameter gradients (of a random weighting of the outputs) in one program.
  @jax.jit
  def packed(params, x, ids):
    def loss(p):
      y = apply(p, x, segment_ids=ids)
      return jnp.sum(y * w), y
    (_, y), grads = jax.value_and_grad(loss, has_aux=True)(params)
    # One segment per row is the unpacked layer.
    single = apply(params, x, segment_ids=jnp.full_like(ids, 5)) - apply(params, x)
    return y, grads, single

  y, grads, single = packed(params, x, jnp.asarray(IDS))
  want, want_grads = alone(apply, params, x, IDS, w)
  assert y.shape == (B, T, OUT)
  _close(y, want)
  assert set(grads) == set(want_grads) and "decay" in grads
  jax.tree.map(_close, grads, want_grads)
  assert float(jnp.abs(single).max()) < 1e-5


# Decoding after a packed prefill of (x[:, :T], IDS): (tokens, ids of the call or None: continue).
# Row 0 continues segment 2 throughout; row 1 continues segment 1, restarts at id 8 in a one-token
# step, continues and restarts again (id 9) inside a block of 3, then continues (without ids, and
# in a block with ids). Two shapes of steps only: each one compiles.
STEPS = [(1, None), (1, [[2], [8]]), (3, [[2, 2, 2], [8, 8, 9]]), (1, None), (3, [[2, 2, 2], [9, 9, 9]])]


def _decode_stream():
  """Inputs [B, T + 9, F] and the ids that every token gets (None: the row's last id)."""
  n = T + sum(t for t, _ in STEPS)
  ids = [IDS]
  for tokens, step_ids in STEPS:
    ids.append(np.repeat(ids[-1][:, -1:], tokens, axis=1) if step_ids is None else np.asarray(step_ids, np.int32))
  return _normal(4, (B, n, F)), np.concatenate(ids, axis=1)


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_decode_after_packed_prefill(framework):
  apply, params = build(framework)
  x, all_ids = _decode_stream()
  bounds = np.cumsum([0, T] + [t for t, _ in STEPS])
  calls = [(IDS, bounds[:2])] + [(s_ids, bounds[i + 1:i + 3]) for i, (_, s_ids) in enumerate(STEPS)]

  outs, last_ids = [], []
  if framework == "nnx":
    layer = lj_nnx.LightningAttention(**SIZES, **CONFIG, rngs=nnx.Rngs(0))
    state = nnx.state(layer, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(layer, state)
    layer.init_cache(B)
    for ids, (a, b) in calls:
      outs.append(layer(x[:, a:b], decode=True, segment_ids=None if ids is None else jnp.asarray(ids)))
      last_ids.append(np.asarray(layer.cached_segment_id[...]))
  else:
    module = lj_linen.LightningAttention(**SIZES, **CONFIG)
    cache = module.init(jax.random.key(0), x[:, :1], decode=True)["cache"]
    step = jax.jit(lambda cache, piece, ids: module.apply({"params": params, "cache": cache}, piece, decode=True,
                                                         segment_ids=ids, mutable=["cache"]))
    for ids, (a, b) in calls:
      y, cache = step(cache, x[:, a:b], None if ids is None else jnp.asarray(ids))
      cache = cache["cache"]
      outs.append(y)
      last_ids.append(np.asarray(cache["cached_segment_id"]))

  # The prefill leaves each row's last segment id; calls without ids keep it.
  np.testing.assert_array_equal(last_ids, all_ids[:, bounds[1:] - 1].T)
  _close(np.concatenate(outs, axis=1), alone(apply, params, x, all_ids))


@pytest.mark.parametrize("framework", ["nnx", "linen"])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("ids,error,match", [
    (np.zeros((B, T + 1), np.int32), ValueError, r"segment_ids must be \[B, T\] = \[2, 101\]"),
    (np.zeros((B,), np.int32), ValueError, "segment_ids must be"),
    (np.zeros((B, T, 1), np.int32), ValueError, "segment_ids must be"),
    (np.zeros((B, T), np.float32), TypeError, "segment_ids must be an integer array, got float32"),
    (np.zeros((B, T), bool), TypeError, "segment_ids must be an integer array, got bool"),
    ([[0] * T] * B, TypeError, "segment_ids must be None or an integer"),
])
def test_bad_segment_ids(framework, decode, ids, error, match):
  x = np.zeros((B, T, F), np.float32)
  if framework == "nnx":
    layer = lj_nnx.LightningAttention(**SIZES, **CONFIG, rngs=nnx.Rngs(0))
    layer.init_cache(B)
    call = lambda: layer(x, decode=decode, segment_ids=ids)
  else:
    module = lj_linen.LightningAttention(**SIZES, **CONFIG)
    variables = module.init(jax.random.key(0), x[:, :1], decode=True)
    call = lambda: module.apply(variables, x, decode=decode, segment_ids=ids, mutable=["cache"])
  with pytest.raises(error, match=match):
    call()
