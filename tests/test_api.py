"""Composition with JAX transforms, per-device configs and input validation."""

import dataclasses
import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lightning_jax as lj
from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import reference

# Interpret-mode kernels against the oracles with tolerances far above float32
# rounding: compiled without LLVM's optimisations on the CPU (see conftest).
pytestmark = pytest.mark.usefixtures("unoptimized_compiles")

B, T, H, D, E = 2, 37, 3, 16, 24


def inputs(seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(ks[0], (B, T, H, D), dtype)
  k = jax.random.normal(ks[1], (B, T, H, D), dtype)
  v = jax.random.normal(ks[2], (B, T, H, E), dtype)
  decay = jax.random.uniform(ks[3], (H,), minval=0.01, maxval=0.8)
  s0 = jax.random.normal(ks[4], (B, H, D, E))
  return q, k, v, decay, s0


def ref_o(q, k, v, decay, s0=None):
  return reference.lightning_attention_recurrent(q, k, v, decay, scale=D ** -0.5, initial_state=s0)[0]


# The oracle jitted, over a stack of inputs (one program, not every op compiled eagerly).
_ref_o = jax.jit(jax.vmap(ref_o, in_axes=(0, 0, 0, None)))


def close(x, y, tol=1e-4):
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return np.linalg.norm(x - y) / np.linalg.norm(y) < tol


IMPLS = [dict(impl="pallas", variant="chunk_loop"), dict(impl="pallas", variant="parallel"), dict(impl="xla")]


@pytest.mark.parametrize("kw", IMPLS, ids=lambda kw: "-".join(kw.values()))
def test_vmap_over_extra_batch_axis(kw, kernel_mode):
  if kw["impl"] == "pallas":
    kw = dict(kw, interpret=kernel_mode)
  q, k, v, decay, _ = inputs(1)
  stack = lambda x: jnp.stack([x, 0.5 * x + 1.0])  # noqa: E731
  out = jax.jit(jax.vmap(lambda q, k, v: lj.lightning_attention(q, k, v, decay, **kw)))(
      stack(q), stack(k), stack(v))
  chex.assert_shape(out, (2, B, T, H, E))
  want = _ref_o(stack(q), stack(k), stack(v), decay)
  for i in range(2):
    assert close(out[i], want[i])


def _second_order_ops():
  """(name, attention(q, w, impl) -> o) of both ops on small random inputs (one row of 20 tokens), and q; w scales
  the values."""
  q, k, v, decay, s0 = inputs(5)
  q, k, v, s0 = q[:1, :20], k[:1, :20], v[:1, :20], s0[:1]
  kn = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  beta = jax.nn.sigmoid(q[..., 0])
  return [("lightning_attention", lambda q, w, impl, **kw: lj.lightning_attention(
              q, k, v * w, decay, initial_state=s0, impl=impl, **kw)),
          ("delta_attention", lambda q, w, impl, **kw: lj.delta_attention(
              q, kn, v * w, beta, jnp.broadcast_to(jnp.abs(q[..., :1]) * 0.1, k.shape), initial_state=s0, impl=impl,
              **kw))], q


def test_pallas_gradients_are_first_order_only(kernel_mode):
  """A derivative of the Pallas path's gradients (grad of grad through the inputs, or through the cotangent alone)
  raises a TypeError naming impl='xla', before any kernel is differentiated; impl='xla' gives it, equal to the
  reference's."""
  ops, q = _second_order_ops()
  w = jnp.float32(1.5)
  for name, attention in ops:
    def grad_q(q, w, impl, **kw):  # d/dq of a loss whose cotangent on o depends on w
      return jax.grad(lambda q: jnp.sum(jnp.sin(attention(q, w, impl, **kw)) * w))(q)

    second = lambda impl, **kw: jax.jit(jax.grad(  # noqa: E731
        lambda q, w: jnp.sum(grad_q(q, w, impl, **kw) ** 2), argnums=(0, 1)))(q, w)
    for argnums in (0, 1):  # through q (the forward's inputs), through w (also the cotangent)
      with pytest.raises(TypeError, match=f"{name} with impl='pallas' is differentiable once.*impl='xla'"):
        jax.grad(lambda q, w: jnp.sum(grad_q(q, w, "pallas", interpret=kernel_mode) ** 2), argnums=argnums)(q, w)
    # The cotangent alone: w enters the loss only, not the op.
    with pytest.raises(TypeError, match="differentiable once"):
      jax.grad(lambda w: jnp.sum(jax.grad(lambda q: jnp.sum(attention(q, 1.0, "pallas", interpret=kernel_mode) * w))(
          q) ** 2))(w)
    for got, want in zip(second("xla"), second("reference")):
      assert close(got, want, 1e-3), name


@pytest.mark.parametrize("kw", IMPLS, ids=lambda kw: "-".join(kw.values()))
def test_grad_under_jit_with_checkpoint(kw, kernel_mode):
  if kw["impl"] == "pallas":
    kw = dict(kw, interpret=kernel_mode)
  q, k, v, decay, s0 = inputs(2)

  def loss(fn):
    def f(q, k, v, decay, s0):
      o = jax.checkpoint(fn)(q, k, v, decay, s0)
      return jnp.sum(jnp.sin(o))
    return f

  ours = lambda q, k, v, d, s: lj.lightning_attention(q, k, v, d, initial_state=s, **kw)  # noqa: E731
  g = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3, 4)))(q, k, v, decay, s0)
  g_ref = jax.jit(jax.grad(loss(ref_o), argnums=(0, 1, 2, 3, 4)))(q, k, v, decay, s0)
  chex.assert_trees_all_equal_shapes_and_dtypes(g, (q, k, v, decay, s0))
  for a, b in zip(g, g_ref):
    assert close(a, b, 1e-3)


def test_chunked_prefill_equals_full_sequence(kernel_mode):
  """Splitting the sequence and passing the state on gives the same output."""
  q, k, v, decay, s0 = inputs(3)
  kw = dict(impl="pallas", variant="chunk_loop", interpret=kernel_mode)
  full, full_state = lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, **kw)
  a, state = lj.lightning_attention(q[:, :20], k[:, :20], v[:, :20], decay, initial_state=s0,
                                    return_final_state=True, **kw)
  b, state = lj.lightning_attention(q[:, 20:], k[:, 20:], v[:, 20:], decay, initial_state=state,
                                    return_final_state=True, **kw)
  assert close(jnp.concatenate([a, b], axis=1), full) and close(state, full_state)


def test_auto_impl_on_this_backend():
  q, k, v, decay, _ = inputs(4)
  assert close(lj.lightning_attention(q, k, v, decay), jax.jit(ref_o)(q, k, v, decay))


def test_initial_state_dtype_and_scale():
  q, k, v, decay, s0 = inputs(5, jnp.bfloat16)
  o = lj.lightning_attention(q, k, v, decay, initial_state=s0.astype(jnp.bfloat16), scale=1.0, impl="xla")
  chex.assert_type(o, jnp.bfloat16)
  want = reference.lightning_attention_recurrent(q, k, v, decay, scale=1.0,
                                                 initial_state=s0.astype(jnp.bfloat16))[0]
  assert close(o, want, 2e-2)


# --- per-device configs -------------------------------------------------------

CAPABILITIES = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (13, 0), None]


@pytest.mark.parametrize("cc", CAPABILITIES, ids=str)
@pytest.mark.parametrize("itemsize", [2, 4])
def test_default_configs_fit_budget(cc, itemsize):
  budget = config_lib.shared_memory_budget(cc)
  for dim_k in (16, 32, 64, 128, 256):
    for dim_v in (16, 32, 64, 128, 256):
      cfgs = heuristics.resolve(None, dim_k=dim_k, dim_v=dim_v, itemsize=itemsize, compute_capability=cc)
      sweep = config_lib.SweepShape(dim_k=dim_k, dim_v=dim_v, itemsize=itemsize)
      assert cfgs.chunk_loop.shared_memory_bytes(sweep) <= budget
      assert cfgs.chunk_output.shared_memory_bytes(sweep) <= budget
      states_sweep = config_lib.SweepShape(dim_k=dim_k, dim_v=dim_v, itemsize=itemsize,
                                           chunk_size=cfgs.chunk_output.chunk_size)
      assert cfgs.chunk_states.shared_memory_bytes(states_sweep) <= budget
      assert cfgs.chunk_loop.block_e <= dim_v and cfgs.chunk_states.block_d <= dim_k


def test_shared_memory_estimate_bounds_what_triton_asked_for():
  """The chunk-loop estimate stays above Triton's request measured on an H100.

  Triton (3.6, through jax 0.11.2) asked for 245,760 bytes for the forward sweep
  with D = E = 128, chunks of 128, 64 value columns, 8 warps and 3 stages: the
  three stages of q, k and v tiles. 4 stages at chunks of 64 fit sm90's budget.
  """
  measured = config_lib.ChunkLoopConfig(chunk_size=128, block_e=64, num_warps=8, num_stages=3)
  sweep = config_lib.SweepShape(dim_k=128, dim_v=128, itemsize=2)
  assert measured.shared_memory_bytes(sweep) >= 245_760 == 3 * 2 * (2 * 128 * 128 + 128 * 64)
  deep = config_lib.ChunkLoopConfig(chunk_size=64, block_e=64, num_warps=4, num_stages=4)
  assert deep.shared_memory_bytes(sweep) <= config_lib.shared_memory_budget((9, 0))


LIGHTNING_SHARED_MEMORY = (pathlib.Path(__file__).parent.parent / "benchmarks" / "tuning"
                           / "lightning-shared-memory.json")


def test_heuristics_blocks_fit_what_triton_allocates_on_every_device():
  """Triton's own allocation of every kernel the op lowers (chunk_loop and parallel, forward and gradients) in the
  blocks the heuristics pick for sm80 to sm120 (`python -m benchmarks.shared_memory --op lightning`, committed)
  fits each device, and the committed rows are today's picks."""
  rows = json.loads(LIGHTNING_SHARED_MEMORY.read_text())["rows"]
  assert {r["capability"] for r in rows} == {80, 86, 89, 90, 100, 120}
  for r in rows:
    cc, itemsize = divmod(r["capability"], 10), jnp.dtype(r["dtype"]).itemsize
    for job, recorded in r["configs"].items():
      today = heuristics.resolve(None, dim_k=r["dim"], dim_v=r["dim"], itemsize=itemsize, compute_capability=cc,
                                 job=job)
      assert dataclasses.asdict(today) == recorded, f"re-run benchmarks/shared_memory.py: sm{r['capability']} {job}"
    assert r["max_bytes"] <= config_lib.shared_memory_budget(cc), (r["capability"], r["dtype"], r["dim"], r["case"])
    if r["variant"] == "parallel" and r["case"] == "split-head-decay":
      # Its second chunk_output kernel is the dq sweep's, which carries the per-head decay's tangent state.
      measured = [k["bytes"] for k in r["kernels"] if k["name"] == "lightning_chunk_output"][1]
      sweep = config_lib.SweepShape(dim_k=r["dim"], dim_v=r["dim"], itemsize=itemsize, job="tangent")
      assert config_lib.ChunkOutputConfig(**r["configs"]["tangent"]["chunk_output"]).shared_memory_bytes(
          sweep) >= measured


def test_budgets_by_device():
  assert config_lib.shared_memory_budget((9, 0)) == 232448
  assert config_lib.shared_memory_budget((12, 0)) == 101376
  assert config_lib.shared_memory_budget((8, 0)) == 166912
  assert config_lib.shared_memory_budget((99, 0)) == config_lib.SAFE_SHARED_MEMORY_BUDGET == 101376


def test_user_config_over_budget_names_the_budget():
  big = lj.LightningConfig(chunk_loop=lj.ChunkLoopConfig(chunk_size=256, block_e=256, num_warps=8, num_stages=4))
  with pytest.raises(ValueError, match="101376-byte per-block budget of compute capability 12.0"):
    heuristics.resolve(big, dim_k=256, dim_v=256, itemsize=4, compute_capability=(12, 0))


def test_config_dataclasses_are_frozen_and_validated():
  cfg = lj.ChunkLoopConfig(chunk_size=64, block_e=64, num_warps=4, num_stages=2)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.chunk_size = 32
  with pytest.raises(TypeError):
    lj.ChunkLoopConfig(64, 64, 4, 2)  # keyword-only
  with pytest.raises(ValueError, match="chunk_size must be a power of two"):
    lj.ChunkLoopConfig(chunk_size=48, block_e=64, num_warps=4, num_stages=2)
  with pytest.raises(TypeError, match="chunk_loop must be a ChunkLoopConfig"):
    lj.LightningConfig(chunk_loop=lj.ChunkOutputConfig(chunk_size=64, block_e=64, num_warps=4, num_stages=1))


def test_auto_variant_is_chunk_loop_off_sm90():
  """Without the warp-specialised forward, auto runs chunk_loop (split where few programs would idle the GPU)."""
  for cc in ((8, 0), (8, 9), (10, 0), (12, 0), None):
    assert heuristics.pallas_variant("auto", d=64, e=64, dtype=jnp.bfloat16, compute_capability=cc,
                                     interpret=cc is None) == "chunk_loop"


# --- bad input ----------------------------------------------------------------

# Each bad call as a function of the inputs `inputs(6)` gives (made in the test, not at collection: arrays would
# compile eagerly in every pytest process).
_f = lj.lightning_attention
BAD_CALLS = [
    ("q must be \\[B, T, H, D\\]", ValueError, lambda q, k, v, decay, s0: _f(q[0], k, v)),
    ("k must be \\[B, T, H, D\\]", ValueError, lambda q, k, v, decay, s0: _f(q, k[:, :5], v)),
    ("v must be \\[B, T, H, E\\]", ValueError, lambda q, k, v, decay, s0: _f(q, k, v[:, :, :2])),
    ("head dim D", ValueError,
     lambda q, k, v, decay, s0: _f(jnp.ones((1, 4, 1, 300)), jnp.ones((1, 4, 1, 300)), jnp.ones((1, 4, 1, 8)))),
    ("head dim E", ValueError,
     lambda q, k, v, decay, s0: _f(jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 8)), jnp.ones((1, 4, 1, 257)))),
    ("q must be float32, bfloat16 or float16", TypeError,
     lambda q, k, v, decay, s0: _f(q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32))),
    ("share one dtype", TypeError, lambda q, k, v, decay, s0: _f(q, k.astype(jnp.bfloat16), v)),
    ("decay must be None, per-head rates \\[H\\]", ValueError,
     lambda q, k, v, decay, s0: _f(q, k, v, jnp.ones((H + 1,)))),
    ("decay must be a floating array", TypeError, lambda q, k, v, decay, s0: _f(q, k, v, jnp.ones((H,), jnp.int32))),
    ("decay rates must be finite and >= 0", ValueError, lambda q, k, v, decay, s0: _f(q, k, v, -decay)),
    ("initial_state must be \\[B, H, D, E\\]", ValueError,
     lambda q, k, v, decay, s0: _f(q, k, v, initial_state=s0[:, :, :, :3])),
    ("impl must be one of", ValueError, lambda q, k, v, decay, s0: _f(q, k, v, impl="cuda")),
    ("variant must be one of", ValueError, lambda q, k, v, decay, s0: _f(q, k, v, impl="pallas", variant="fast")),
    ("variant='warp_specialized' needs", ValueError,
     lambda q, k, v, decay, s0: _f(q, k, v, impl="pallas", variant="warp_specialized")),
    ("config must be a LightningConfig", TypeError, lambda q, k, v, decay, s0: _f(q, k, v, config={"chunk_size": 64})),
    ("scale must be None or a finite Python float", TypeError,
     lambda q, k, v, decay, s0: _f(q, k, v, scale=jnp.float32(0.5))),
    ("return_final_state must be a bool", TypeError, lambda q, k, v, decay, s0: _f(q, k, v, return_final_state=1)),
    ("need B, T, H >= 1", ValueError, lambda q, k, v, decay, s0: _f(q[:, :0], k[:, :0], v[:, :0])),
]


@pytest.mark.parametrize("match,error,call", BAD_CALLS, ids=[str(i) for i in range(len(BAD_CALLS))])
def test_bad_input_raises_clearly(match, error, call):
  with pytest.raises(error, match=match):
    call(*inputs(6))


def test_bad_input_raises_under_jit_before_tracing_kernels():
  q, k, v, decay, _ = inputs(7)
  with pytest.raises(ValueError, match="decay must be None, per-head rates \\[H\\]"):
    jax.jit(lambda q, k, v: lj.lightning_attention(q, k, v, jnp.ones((H, 2)), impl="pallas"))(q, k, v)
