"""Random calls: every keyword of both ops drawn at once, against the token-serial oracle.

The other modules test each feature over chosen shapes. Here a seed draws the op (`lightning_attention` or
`delta_attention`), B, T, H, D and E (mostly off the block sizes), the decay form and its rates (tiny to huge, some
zero), the packing (`segment_ids` with runs of arbitrary, sometimes repeated ids, or `cu_seqlens` with empty
sequences), initial and final states, the scale and, for Pallas, the variant, the sequence split and the chunk
sizes; the outputs, the final states and every gradient must match the oracle's (`impl="reference"`) on the same
inputs. The XLA path takes many seeds on the CPU, the Pallas kernels a few interpreted and, on a GPU, compiled
on longer rows in bfloat16 and float32.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BF16, DECAY_TOL, F32, TOL, gpu_only, rel_err

import lightning_jax as lj

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")


@dataclasses.dataclass(frozen=True)
class RandomCall:
  """One drawn call: `arrays` are the differentiable inputs (q, k, v[, beta][, decay][, initial_state])."""
  op: str
  arrays: tuple
  names: tuple
  kwargs: dict
  pallas_kwargs: dict
  dtype: object

  def __call__(self, impl, *arrays, interpret=None):
    named = dict(zip(self.names, arrays))
    extra = dict(self.pallas_kwargs, interpret=interpret) if impl == "pallas" else {}
    fn = lj.delta_attention if self.op == "delta" else lj.lightning_attention
    positional = [named["q"], named["k"], named["v"]] + ([named["beta"]] if self.op == "delta" else [])
    return fn(*positional, named.get("decay"), initial_state=named.get("initial_state"), impl=impl,
              **self.kwargs, **extra)


def _rates(rng, shape):
  """Per-head or per-token rates >= 0: small, spanning 1e-7 to 1e4 in one call, or with exact zeros."""
  kind = rng.integers(3)
  if kind == 0:
    return rng.uniform(0, 0.5, shape)
  if kind == 1:
    return np.exp(rng.uniform(np.log(1e-7), np.log(1e4), shape))
  rates = rng.uniform(0, 3.0, shape)
  rates[rng.random(shape) < 0.2] = 0.0
  return rates


def _segment_ids(rng, b, t):
  """Rows of up to 6 runs; ids jump by arbitrary steps and sometimes repeat (two runs then make one segment)."""
  ids = np.zeros((b, t), np.int32)
  for row in ids:
    cuts = np.sort(rng.choice(np.arange(1, t), size=min(int(rng.integers(0, 6)), t - 1), replace=False))
    for start, stop in zip([0, *cuts], [*cuts, t]):
      row[start:stop] = row[start - 1] + int(rng.integers(0, 4)) if start else int(rng.integers(0, 3))
  return ids


def draw(seed: int, *, gpu: bool = False) -> RandomCall:
  rng = np.random.default_rng(seed)
  op = str(rng.choice(["lightning", "delta"]))
  if gpu:  # rows long enough for the sequence split and the warp-specialised kernels
    t = int(rng.choice([100, 1000, 2047, 4100, int(rng.integers(1, 6000))]))
    b, h = int(rng.integers(1, 4)), int(rng.integers(1, 9))
    d = int(rng.choice([16, 32, 64, 100, 128]))
    e = int(rng.choice([d, 32, 96, 128]))
    dtype = BF16 if rng.random() < 0.7 else F32
  else:
    t = int(rng.choice([1, 2, 63, 65, 100, 129, int(rng.integers(1, 160))]))
    b, h = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    d = int(rng.choice([1, 3, 16, 17, 33, int(rng.integers(1, 70))]))
    e = int(rng.choice([d, 1, 5, 31, int(rng.integers(1, 70))]))
    dtype = F32
  packing = str(rng.choice(["none", "segment_ids", "cu_seqlens"]))
  if packing == "cu_seqlens":
    b = 1
  kwargs = {"return_final_state": bool(rng.random() < 0.7)}
  if rng.random() < 0.3:
    kwargs["scale"] = float(rng.uniform(0.1, 1.0))
  states = b
  if packing == "segment_ids":
    kwargs["segment_ids"] = jnp.asarray(_segment_ids(rng, b, t))
  elif packing == "cu_seqlens":
    cuts = np.sort(rng.integers(0, t + 1, size=int(rng.integers(0, 5))))
    kwargs["cu_seqlens"] = jnp.asarray(np.concatenate([[0], cuts, [t]]), jnp.int32)
    states = len(cuts) + 1

  names = ["q", "k", "v"]
  arrays = [rng.normal(size=(b, t, h, d)), rng.normal(size=(b, t, h, d)), rng.normal(size=(b, t, h, e))]
  if op == "delta":
    kwargs["normalize_qk"] = True  # the delta rule is stable for |k| <= 1
    names.append("beta")
    arrays.append(rng.uniform(0, 2, (b, t, h)))
    decay_shape = {"none": None, "gated": (b, t, h), "kda": (b, t, h, d)}[str(rng.choice(["none", "gated", "kda"]))]
  else:
    decay_shape = {"none": None, "head": (h,), "token": (b, t, h)}[str(rng.choice(["none", "head", "token"]))]
  if decay_shape is not None:
    names.append("decay")
    arrays.append(_rates(rng, decay_shape))
  if rng.random() < 0.5:
    names.append("initial_state")
    arrays.append(0.3 * rng.normal(size=(states, h, d, e)))
  arrays = tuple(jnp.asarray(a, dtype if i < 3 else F32) for i, a in enumerate(arrays))

  pallas_kwargs = {}
  if op == "lightning":
    pallas_kwargs["variant"] = str(rng.choice(["auto", "chunk_loop", "parallel"]))
    slice_size = int(rng.choice([0, 1024, 2048] if gpu else [0, 64, 128]))
    if slice_size:
      pallas_kwargs["config"] = lj.LightningConfig(slice_size=slice_size)
  else:
    config = {}
    if rng.random() < 0.5:
      config["sequence_pieces"] = int(rng.integers(1, 4))
    if rng.random() < 0.5:
      config["chunk_size"] = int(rng.choice([16, 32, 64]))
      config["backward_chunk_size"] = int(rng.choice([16, 32, 64]))
    if config:
      pallas_kwargs["config"] = lj.DeltaConfig(**config)
  return RandomCall(op, arrays, tuple(names), kwargs, pallas_kwargs, dtype)


def check(call: RandomCall, seed: int, impl: str, **kwargs):
  rng = np.random.default_rng(seed + 1)
  shapes = jax.eval_shape(lambda *arrays: call("reference", *arrays), *call.arrays)
  cotangents = [jnp.asarray(rng.normal(size=w.shape), F32) for w in jax.tree.leaves(shapes)]

  def outputs_and_grads(impl):
    def loss(*arrays):
      out = call(impl, *arrays, **kwargs)
      out = out if isinstance(out, tuple) else (out,)
      return sum(jnp.sum(o.astype(F32) * c) for o, c in zip(out, cotangents)), out

    return jax.jit(jax.grad(loss, range(len(call.arrays)), has_aux=True))(*call.arrays)

  grads_ref, want = outputs_and_grads("reference")
  grads, got = outputs_and_grads(impl)
  tol = max(TOL[call.dtype], 1e-3)  # float32: the oracle's token-serial sums round too, over up to 160 tokens
  for name, x, y in zip(("o", "final_state"), got, want):
    assert x.shape == y.shape and x.dtype == y.dtype, (name, x.shape, x.dtype, y.shape, y.dtype)
    assert rel_err(x, y) < tol, (name, rel_err(x, y))
  for name, g, g_ref, arg in zip(call.names, grads, grads_ref, call.arrays):
    assert g.shape == arg.shape and g.dtype == arg.dtype, (name, g.shape, g.dtype)
    limit = DECAY_TOL[call.dtype] if name == "decay" else tol
    assert rel_err(g, g_ref) < limit, (name, rel_err(g, g_ref))


@pytest.mark.parametrize("seed", range(32))
def test_xla_matches_oracle(seed):
  check(draw(seed), seed, "xla")


@pytest.mark.parametrize("seed", range(100, 108))
def test_pallas_interpreted_matches_oracle(seed):
  check(draw(seed), seed, "pallas", interpret=True)


@gpu_only
@pytest.mark.parametrize("seed", range(200, 212))
def test_pallas_compiled_matches_oracle(seed):
  check(draw(seed, gpu=True), seed, "pallas", interpret=False)
