"""lightning_attention against the float32 oracles: forward, final state and every gradient."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (BF16, DECAY_TOL, F16, F32, GPU_ONLY, TOL, Case, check_against_oracle, loss_fn,
                     make_inputs, oracle_outputs_and_grads, ours, pallas_calls, rel_err)

import lightning_jax as lj
from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import reference

# Interpret-mode kernels against the oracles with tolerances far above float32
# rounding: compiled without LLVM's optimisations on the CPU (see conftest).
pytestmark = pytest.mark.usefixtures("unoptimized_compiles")

# The cases of 420 tokens walk many chunks and end on a partial one: 4 to 14
# chunks of every chunk size the configs of the CPU and of the GPUs pick, more
# than the stages of any software pipeline over them. The two of 2048 tokens
# check the error of long sequences (the rounding of the state, the decay
# gradient's position-weighted sum, which grows with T): `slow`. Batch and
# heads are small where the interpreter's run time grows with the grid (at
# head dims of 256).
CASES = [
    Case(1, 1, 1, 16, 16),
    Case(2, 17, 3, 48, 80),
    Case(1, 63, 8, 64, 64, BF16, initial_state=False),
    Case(3, 64, 1, 80, 48, F16, decay=None, scale=1.0),
    Case(2, 65, 3, 128, 16, BF16, scale=0.3),
    Case(1, 65, 3, 16, 48, F32, decay="extreme"),
    Case(2, 420, 1, 48, 64, F32, initial_state=False, final_state=False),
    Case(1, 420, 3, 256, 48, BF16, decay="extreme"),
    pytest.param(Case(1, 2048, 1, 64, 128, BF16), marks=pytest.mark.slow),
    pytest.param(Case(1, 2048, 2, 16, 256, F16, decay=None, initial_state=False), marks=pytest.mark.slow),
    Case(2, 17, 3, 256, 256, BF16),
    Case(2, 1, 3, 64, 48, F16, final_state=False),
    Case(2, 33, 2, 1, 3, F32, scale=0.5),
]


@pytest.mark.parametrize("variant", ["chunk_loop", "parallel"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_pallas_matches_oracle(case, variant, kernel_mode):
  check_against_oracle(case, seed=zlib.crc32(f"{case}{variant}".encode()), impl="pallas", variant=variant,
                       interpret=kernel_mode)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_xla_matches_oracle(case):
  check_against_oracle(case, seed=zlib.crc32(str(case).encode()) + 1, impl="xla")


SMALL_CONFIG = lj.LightningConfig(
    chunk_loop=lj.ChunkLoopConfig(chunk_size=16, block_e=16, num_warps=2, num_stages=1),
    chunk_states=lj.ChunkStatesConfig(block_d=16, block_e=16, num_warps=2, num_stages=1),
    chunk_output=lj.ChunkOutputConfig(chunk_size=32, block_e=32, num_warps=4, num_stages=1))


@pytest.mark.parametrize("variant,config,seed", [("auto", None, 3), ("chunk_loop", SMALL_CONFIG, 4),
                                                 ("parallel", SMALL_CONFIG, 4)], ids=["auto", "chunk_loop-small",
                                                                                      "parallel-small"])
def test_auto_variant_and_explicit_config(variant, config, seed, kernel_mode):
  case = Case(2, 130, 3, 32, 64, BF16)
  check_against_oracle(case, seed=seed, impl="pallas", variant=variant, config=config, interpret=kernel_mode)


# The defaults depend on the device only through its shared-memory budget: one
# device per distinct budget.
BUDGET_DEVICES = sorted({budget: cc for cc, budget in config_lib.SHARED_MEMORY_BUDGET.items()}.values())
DEVICE_CASES = [Case(2, 130, 3, 64, 64, BF16), Case(1, 100, 2, 128, 128, F16, decay="extreme"),
                Case(1, 70, 2, 256, 256, BF16), Case(2, 65, 3, 48, 80, F32, initial_state=False)]


@pytest.mark.parametrize("variant", ["chunk_loop", "parallel"])
@pytest.mark.parametrize("cc", [pytest.param(cc, id=str(cc), marks=GPU_ONLY) for cc in BUDGET_DEVICES])
def test_other_devices_default_configs_compile_and_match_here(cc, variant, monkeypatch):
  """Other devices' default configs, compiled on the GPU at hand where they fit its shared memory.

  Only sm90 is measured (benchmarks/PERFORMANCE.md); this checks that the blocks
  the heuristics pick for the other budgets are valid Triton programs that
  compute the right thing.
  """
  here = heuristics.compute_capability(jax.devices()[0])
  budget, budget_here = config_lib.shared_memory_budget(cc), config_lib.shared_memory_budget(here)
  if budget == budget_here:
    pytest.skip(f"every other GPU test runs the defaults of this device's {budget}-byte budget")
  if budget > budget_here:
    pytest.skip(f"the defaults of {cc} need more shared memory than this {here} device has")
  monkeypatch.setattr(heuristics, "compute_capability", lambda device: cc)
  for case in DEVICE_CASES:
    check_against_oracle(case, seed=zlib.crc32(f"{case}{cc}{variant}".encode()), impl="pallas", variant=variant,
                         interpret=False)


@jax.jit
def _both_oracles(q, k, v, decay, s0):
  return (reference.lightning_attention_recurrent(q, k, v, decay, scale=0.7, initial_state=s0),
          reference.lightning_attention_quadratic(q, k, v, decay, scale=0.7, initial_state=s0))


@pytest.mark.parametrize("t", [1, 17, 64, 65])
@pytest.mark.parametrize("decay", [False, True])
def test_oracles_agree(t, decay):
  """The two oracles (token-serial scan and masked quadratic form) agree."""
  case = Case(2, t, 3, 16, 24, decay="random" if decay else None)
  q, k, v, dec, s0, _, _ = make_inputs(case, seed=t)
  (o1, f1), (o2, f2) = _both_oracles(q, k, v, dec, s0)
  assert rel_err(o1, o2) < 1e-5 and rel_err(f1, f2) < 1e-5


def test_reference_by_hand():
  """One head, two tokens, written out: S1 = a S0 + k1^T v1, S2 = a S1 + k2^T v2."""
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, 1, 2, 3)), rng.normal(size=(2, 1, 2, 3))
  v, s0 = rng.normal(size=(2, 1, 2, 4)), rng.normal(size=(1, 2, 3, 4))
  lam = np.array([0.3, 1.1])
  expect_o = np.zeros((2, 1, 2, 4))
  for h in range(2):
    a, s = np.exp(-lam[h]), s0[0, h]
    for t in range(2):
      s = a * s + np.outer(k[t, 0, h], v[t, 0, h])
      expect_o[t, 0, h] = 0.5 * q[t, 0, h] @ s
  to = lambda x: jnp.asarray(np.moveaxis(x, 0, 1), F32)  # [T, B, ...] -> [B, T, ...]
  o, _ = reference.lightning_attention_recurrent(to(q), to(k), to(v), jnp.asarray(lam, F32), scale=0.5,
                                                 initial_state=jnp.asarray(s0, F32))
  np.testing.assert_allclose(np.asarray(o), np.moveaxis(expect_o, 0, 1), rtol=1e-5, atol=1e-5)


def test_reference_check_grads():
  case = Case(1, 9, 2, 4, 3)
  q, k, v, decay, s0, _, _ = make_inputs(case, seed=0)
  fn = jax.jit(lambda q, k, v, decay, s0: reference.lightning_attention_recurrent(
      q, k, v, decay, scale=0.5, initial_state=s0))
  # The oracle computes in float32, so finite differences need a float32-sized step.
  jax.test_util.check_grads(fn, (q, k, v, decay, s0), order=1, modes=("fwd", "rev"), eps=1e-2,
                            atol=2e-2, rtol=2e-2)


# Differentiating a subset of the inputs: the backward pass skips the cotangents
# nobody asked for (symbolic zeros), so every subset is its own code path.
SUBSETS = [("q", "k", "v"), ("decay",), ("q",), ("k",), ("v", "initial_state"), ("initial_state",)]


@pytest.mark.parametrize("variant", ["chunk_loop", "parallel"])
@pytest.mark.parametrize("wrt", SUBSETS, ids="+".join)
def test_gradient_subsets(wrt, variant, kernel_mode):
  case = Case(2, 77, 3, 32, 48, F32)
  q, k, v, decay, s0, do, d_final = make_inputs(case, seed=zlib.crc32(f"{wrt}{variant}".encode()))
  names = ("q", "k", "v", "decay", "initial_state")
  argnums = tuple(names.index(n) for n in wrt)
  kwargs = dict(impl="pallas", variant=variant, interpret=kernel_mode)
  grads = jax.jit(jax.grad(loss_fn(ours(case, **kwargs), case, do, d_final), argnums))(q, k, v, decay, s0)
  _, grads_ref = oracle_outputs_and_grads(case)(q, k, v, decay, s0, do, d_final)
  for name, g in zip(wrt, grads):
    assert rel_err(g, grads_ref[name]) < (DECAY_TOL if name == "decay" else TOL)[F32], (name,
                                                                                        rel_err(g, grads_ref[name]))


@pytest.mark.parametrize("variant", ["chunk_loop", "parallel"])
@pytest.mark.parametrize("used", ["o", "final_state"])
def test_gradient_through_one_output(used, variant, kernel_mode):
  """return_final_state=True with only one of the two outputs in the loss (the other's cotangent is zero)."""
  case = Case(1, 40, 2, 16, 32, F32)
  q, k, v, decay, s0, do, d_final = make_inputs(case, seed=len(used))
  pick = (lambda o, f: jnp.sum(o * do)) if used == "o" else (lambda o, f: jnp.sum(f * d_final))

  def loss(fn):
    return lambda q, k, v, decay, s0: pick(*fn(q, k, v, decay, s0))

  kwargs = dict(impl="pallas", variant=variant, interpret=kernel_mode)
  grads = jax.jit(jax.grad(loss(ours(case, **kwargs)), (0, 1, 2, 3, 4)))(q, k, v, decay, s0)
  # The oracle's gradients of the same loss: the unused output's cotangent zero.
  zero = jnp.zeros_like
  cotangents = (do, zero(d_final)) if used == "o" else (zero(do), d_final)
  _, grads_ref = oracle_outputs_and_grads(case)(q, k, v, decay, s0, *cotangents)
  for name, g in zip(("q", "k", "v", "decay", "initial_state"), grads):
    assert rel_err(g, grads_ref[name]) < (DECAY_TOL if name == "decay" else TOL)[F32], (name,
                                                                                        rel_err(g, grads_ref[name]))


@pytest.mark.parametrize("dim", [16, 128])
@pytest.mark.parametrize("wrt", [("q", "k", "v"), ("q",), ("k",), ("v",), ("decay",), ("q", "k", "v", "decay")],
                         ids="+".join)
def test_backward_runs_only_the_sweeps_it_needs(wrt, dim):
  """Forward: 1 sweep. Backward: dq (and the decay tangent) 1 sweep; dk and dv 1 fused sweep for head dims
  <= 64, else 2."""
  case = Case(1, 40, 2, dim, dim, F32, initial_state=False, final_state=False)
  q, k, v, decay, s0, do, d_final = make_inputs(case, seed=1)
  argnums = tuple(("q", "k", "v", "decay").index(n) for n in wrt)
  grad = jax.grad(loss_fn(ours(case, impl="pallas", variant="chunk_loop", interpret=True), case, do, d_final),
                  argnums)
  calls = list(pallas_calls(jax.make_jaxpr(grad)(q, k, v, decay, s0).jaxpr))
  dq_sweep = bool({"q", "decay"} & set(wrt))
  dk_dv_sweeps = (("k" in wrt) + ("v" in wrt)) if dim > 64 else int(bool({"k", "v"} & set(wrt)))
  assert len(calls) == 1 + dq_sweep + dk_dv_sweeps


@pytest.mark.parametrize("variant", ["chunk_loop", "parallel"])
@pytest.mark.parametrize("return_final_state,initial_state,wrt", [
    (False, False, ("q", "k", "v", "decay")),
    (False, True, ("q", "k", "v")),
    (False, True, ("initial_state",)),
    (True, False, ("q", "k", "v")),
    (True, False, ("q", "decay")),
])
def test_final_states_written_only_when_read(return_final_state, initial_state, wrt, variant):
  """The float32 [B, H, D, E] final state is an output of a kernel only where something reads it: the
  forward pass with return_final_state, the dv sweep for d initial_state, the dq sweep for the decay
  gradient through the final state (state and its tangent). The parallel
  variant's states kernel writes it with a slice axis of one, [B, H, 1, D, E];
  its per-chunk states ([B, H, N, D, E], N = 3 here) are not final states."""
  case = Case(1, 300, 2, 16, 32, F32, initial_state=initial_state, final_state=return_final_state)
  q, k, v, decay, s0, do, d_final = make_inputs(case, seed=2)
  argnums = tuple(("q", "k", "v", "decay", "initial_state").index(n) for n in wrt)
  grad = jax.grad(loss_fn(ours(case, impl="pallas", variant=variant, interpret=True), case, do, d_final),
                  argnums)
  outputs = [var.aval for eqn in pallas_calls(jax.make_jaxpr(grad)(q, k, v, decay, s0).jaxpr)
             for var in eqn.outvars]
  state_shapes = ((1, 2, 16, 32), (1, 2, 32, 16), (1, 2, 1, 16, 32), (1, 2, 1, 32, 16))
  state_avals = [a for a in outputs if a.dtype == F32 and a.shape in state_shapes]
  expected = return_final_state + ("initial_state" in wrt) + 2 * (return_final_state and "decay" in wrt)
  assert len(state_avals) == expected, outputs


@pytest.mark.parametrize("t", [200, 256])
def test_chunk_loop_walks_t_unpadded(t):
  """The chunk loop takes T as it is, forward and backward (its last chunk's loads and stores masked): at T off
  whole chunks (200) as at T on them (256) the lowered program pads nothing and holds no operand of whole chunks,
  and lowers for CUDA (from any backend under jax 0.10; interpret mode checks the arithmetic)."""
  from lightning_jax.ops.lightning_attention import vjp

  if heuristics.jax_version() >= (0, 11) and jax.devices()[0].platform != "gpu":
    pytest.skip("jax >= 0.11 lowers Pallas Triton for CUDA only beside a GPU (the README's tier, jax 0.10, runs it)")
  b, h, d = 1, 2, 64
  opts = config_lib.PallasOptions(scale=0.125, return_final_state=False, variant="chunk_loop", config=None,
                                  compute_capability=(9, 0), num_sms=132, interpret=False)

  def loss(q, k, v, decay):
    out = vjp.lightning_attention_pallas(q, k, v, decay, None, None, opts)
    return jnp.sum(out[0].astype(F32))

  x = jax.ShapeDtypeStruct((b, t, h, d), BF16)
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(x, x, x, jax.ShapeDtypeStruct((h,), F32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("lightning_chunk_loop") >= 3  # the forward sweep and the backward's
  pads = [line.strip()[:200] for line in text.splitlines() if "stablehlo.pad" in line]
  assert not pads and (t % 64 == 0 or f"{b}x{-(-t // 64) * 64}x{h}x{d}" not in text), pads
