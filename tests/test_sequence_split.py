"""The sequence split: slices of one sequence in parallel, each from the state before it.

The slice-state combine against a token-serial recurrence; the split sweeps of
every Pallas variant against the oracles (forward, final state and every
gradient, so the reverse sweeps and the decay tangent are split too); where
the heuristic splits.
"""

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BF16, F16, F32, WS_MODES, Case, check_against_oracle, needs_ws_jax, pallas_calls, rel_err

import lightning_jax as lj
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import vjp

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")


# --- the combine ---------------------------------------------------------------

def serial_slice_states(keys, values, decay, lengths, initial_state):
  """Token by token, in float64: the state before each slice and after the last ([B, H, S + 1, K, V]).

  keys: [B, H, T, K], values: [B, H, T, V].
  """
  a = np.exp(-np.asarray(decay, np.float64))[None, :, None, None]
  state = np.asarray(initial_state, np.float64)
  out, t = [state], 0
  for length in lengths:
    for _ in range(length):
      state = a * state + np.einsum("bhk,bhv->bhkv", keys[:, :, t], values[:, :, t])
      t += 1
    out.append(state)
  return np.stack(out, axis=2)


def local_states(keys, values, decay, lengths):
  """Each slice's state at its end, from zeros (float64, [B, H, S, K, V])."""
  starts = np.cumsum((0,) + tuple(lengths))
  zeros = np.zeros(keys.shape[:2] + (keys.shape[-1], values.shape[-1]))
  return np.stack([serial_slice_states(keys[:, :, s:e], values[:, :, s:e], decay, (e - s,), zeros)[:, :, 1]
                   for s, e in zip(starts[:-1], starts[1:])], axis=2)


# Up to `chunk_common.SUMMED_SLICES` slices the combine sums the weighted states, beyond that a matmul: both.
@pytest.mark.parametrize("lengths", [(5,), (4, 4, 1), (3, 0, 7, 2), (1, 1, 1, 1, 1), (2, 1, 0, 3, 1, 2, 2, 1, 4, 1)],
                         ids=str)
@pytest.mark.parametrize("with_decay", [True, False])
def test_combine_matches_the_serial_recurrence(lengths, with_decay):
  rng = np.random.default_rng(zlib.crc32(f"{lengths}{with_decay}".encode()))
  b, h, dk, dv, t = 2, 3, 4, 5, sum(lengths)
  keys, values = rng.normal(size=(b, h, t, dk)), rng.normal(size=(b, h, t, dv))
  decay = rng.uniform(0.0, 0.7, size=h) if with_decay else np.zeros(h)
  s0 = rng.normal(size=(b, h, dk, dv))
  want = serial_slice_states(keys, values, decay, lengths, s0)
  local = local_states(keys, values, decay, lengths)
  # Jitted: one program (eager, every op of the combine compiled on its own).
  states, tangents = jax.jit(chunk_common.combine_slice_states, static_argnums=1)(
      jnp.asarray(local, F32), lengths, jnp.asarray(decay, F32) if with_decay else None, jnp.asarray(s0, F32))
  assert tangents is None
  assert states.shape == (b, h, len(lengths) + 1, dk, dv) and states.dtype == F32
  assert rel_err(states, want) < 1e-5


def test_combine_tangent_is_the_derivative_wrt_the_decay():
  """U = -dP/dlambda, against the forward-mode derivative of a serial jnp scan (every rate at once)."""
  rng = np.random.default_rng(7)
  lengths, b, h, dk, dv = (3, 5, 2, 4), 2, 3, 4, 2
  t = sum(lengths)
  keys, values = (jnp.asarray(rng.normal(size=(b, h, t, n)), F32) for n in (dk, dv))
  decay, s0 = jnp.asarray([0.05, 0.4, 2.0], F32), jnp.asarray(rng.normal(size=(b, h, dk, dv)), F32)
  ends = np.cumsum(lengths)

  def serial(rates, start, lo, hi):
    a = jnp.exp(-rates)[None, :, None, None]
    state = start
    for i in range(lo, hi):
      state = a * state + jnp.einsum("bhk,bhv->bhkv", keys[:, :, i], values[:, :, i])
    return state

  def prefixes(rates):
    return jnp.stack([serial(rates, s0, 0, e) for e in (0,) + tuple(ends)], axis=2)

  def locals_(rates):
    zeros = jnp.zeros_like(s0)
    return jnp.stack([serial(rates, zeros, e - n, e) for e, n in zip(ends, lengths)], axis=2)

  ones = jnp.ones_like(decay)
  # Jitted: one program each (eager, every op of the serial scans compiled on its own).
  want_states, d_states = jax.jit(lambda d: jax.jvp(prefixes, (d,), (ones,)))(decay)
  local, d_local = jax.jit(lambda d: jax.jvp(locals_, (d,), (ones,)))(decay)
  states, tangents = jax.jit(lambda *a: chunk_common.combine_slice_states(a[0], lengths, *a[1:]))(
      local, decay, s0, -d_local)
  assert rel_err(states, want_states) < 1e-5
  assert rel_err(tangents, -d_states) < 1e-5


def test_combine_checks_the_slice_count():
  with pytest.raises(ValueError, match="S=2"):
    chunk_common.combine_slice_states(jnp.zeros((1, 1, 3, 2, 2)), (4, 4))


@pytest.mark.parametrize("reverse,want", [(False, (128, 128, 44)), (True, (108, 128, 64))])
def test_slice_lengths(reverse, want):
  # 300 tokens in chunks of 64 (4 full, one of 44 rows), slices of 2 chunks, in sweep order.
  assert chunk_common.slice_lengths(seq_len=300, chunk_size=64, slice_chunks=2, reverse=reverse) == want


# --- the heuristic -------------------------------------------------------------

def test_slice_chunks_heuristic():
  split = heuristics.slice_chunks
  many = dict(programs=128, num_chunks=512, chunk_size=64, num_sms=132)
  assert split(**many) == 512  # enough programs: no split
  few = split(programs=32, num_chunks=512, chunk_size=64, num_sms=132)
  assert few < 512 and 512 % few == 0 and few >= heuristics.MIN_SLICE_CHUNKS
  assert 32 * (512 // few) <= max(132 * heuristics.SLICE_PROGRAMS_PER_SM, 64)
  # Short sequences are not cut below the least slice.
  assert split(programs=1, num_chunks=heuristics.MIN_SLICE_CHUNKS + 1, chunk_size=64, num_sms=132) == (
      heuristics.MIN_SLICE_CHUNKS + 1)
  # A prime chunk count: slices of equal length where none divide, the last one shorter.
  odd = split(programs=8, num_chunks=509, chunk_size=64, num_sms=132)
  assert heuristics.MIN_SLICE_CHUNKS <= odd < 509
  # The config's slice size (tokens, rounded up to whole chunks) overrides it.
  assert split(**many, slice_size=1000) == 16
  assert split(programs=1, num_chunks=4, chunk_size=64, num_sms=132, slice_size=10**6) == 4


def test_slice_size_is_validated():
  for bad in (0, -64, 1.5, True):
    with pytest.raises(ValueError, match="slice_size must be None or an int >= 1"):
      lj.LightningConfig(slice_size=bad)


def kernel_names(fn, *args):
  """The Pallas kernels `fn` launches, in order."""
  return re.findall(r"name=(lightning_chunk_\w+|lightning_warp_specialized)", str(jax.make_jaxpr(fn)(*args)))


def test_auto_splits_few_long_sequences_only():
  """On a device of 132 SMs, one (batch, head) pair of 4096 tokens is split; 132 pairs are not."""
  def call(b, h):
    q = jnp.zeros((b, 4096, h, 32), F32)
    return kernel_names(lambda q: lj.lightning_attention(q, q, q, impl="pallas", variant="chunk_loop",
                                                         interpret=True), q)

  assert call(1, 1) == ["lightning_chunk_states", "lightning_chunk_loop"]
  assert call(2, 66) == ["lightning_chunk_loop"]


# --- split sweeps against the oracles ------------------------------------------

# Slices of 2 and 3 chunks (of the CPU's and the GPUs' 64-token chunks, and the
# small config's 16): a last slice shorter than the others and a partial last
# chunk, slices that end on the real end, one chunk per slice, odd head dims.
SPLIT_CASES = [
    (Case(2, 420, 1, 48, 64, F32), 128),
    (Case(1, 420, 3, 64, 48, F32, decay="extreme"), 192),
    (Case(1, 300, 2, 16, 16, F16, initial_state=False, final_state=False), 64),
    (Case(1, 256, 2, 32, 80, F32, decay=None), 128),
    (Case(1, 130, 2, 128, 128, BF16), 64),
]


@pytest.mark.parametrize("case,slice_size", SPLIT_CASES, ids=lambda x: str(x))
def test_split_chunk_loop_matches_oracle(case, slice_size, kernel_mode):
  check_against_oracle(case, seed=zlib.crc32(f"{case}split".encode()), impl="pallas", variant="chunk_loop",
                       config=lj.LightningConfig(slice_size=slice_size), interpret=kernel_mode)


@pytest.mark.parametrize("case", [Case(1, 200, 2, 72, 96, F32), Case(1, 150, 1, 24, 32, F32, decay="extreme")],
                         ids=str)
def test_split_backward_with_fixed_rates_matches_oracle(case):
  """q, k, v and initial-state gradients, the rates fixed: the dq sweep's split pass is the forward's transposed,
  and (D > 64: dk in a sweep of its own) the dk sweep's the dv sweep's."""
  check_against_oracle(case, seed=zlib.crc32(f"{case}fixed".encode()), argnums=(0, 1, 2, 4), impl="pallas",
                       variant="chunk_loop", config=lj.LightningConfig(slice_size=64), interpret=True)


def test_split_backward_takes_the_forward_and_dv_passes():
  """With the kernels partitioned over the 8 host devices (where the forward keeps no `SliceStarts`), a jitted
  forward+backward still runs two split passes, not four: the dq sweep issues the forward's transposed, the same
  kernel call on the same operands, which XLA's common-subexpression pass merges (counted in the optimised CPU
  program), and the dk sweep takes the dv sweep's."""
  q, k, v, do = (jax.random.normal(key, (1, 256, 1, 80)) for key in jax.random.split(jax.random.key(2), 4))
  config = lj.LightningConfig(slice_size=64)

  def fwdbwd(q, k, v, do):
    o, vjp = jax.vjp(lambda q, k, v: lj.lightning_attention(q, k, v, jnp.array([0.1]), impl="pallas", interpret=True,
                                                             variant="chunk_loop", config=config), q, k, v)
    return o, vjp(do)

  hlo = jax.jit(fwdbwd).lower(q, k, v, do).compile().as_text()
  loops = re.findall(r" while\([^\n]*op_name=\"[^\"]*?(lightning_\w+)\)*/while\"", hlo)
  assert sorted(loops) == ["lightning_chunk_loop"] * 4 + ["lightning_chunk_states"] * 2, loops


@pytest.mark.parametrize("variant", ["chunk_loop", pytest.param("warp_specialized", marks=needs_ws_jax)])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("wrt", ["qkv", "q"])
def test_split_backward_takes_the_forwards_pass(variant, packed, wrt):
  """The custom VJP keeps the forward's split pass for the dq sweep and hands the dv sweep's to the dk sweep: a
  forward+backward traces 2 states passes (1 for dq alone), whatever XLA's CSE would merge (on the GPU it did
  not always: the Triton IR carries source locations, which differ between a forward and a backward)."""
  q = jax.ShapeDtypeStruct((1, 256, 1, 80), BF16)
  starts = jnp.zeros((1, 256), bool).at[0, 100].set(True) if packed else None
  opts = config_lib.PallasOptions(scale=0.1, return_final_state=False, variant=variant,
                                  config=lj.LightningConfig(slice_size=64), compute_capability=None, num_sms=132,
                                  interpret=True)

  def fwdbwd(q, k, v, do):  # the plain custom_vjp (one device, or inside shard_map)
    args = dict(q=q, k=k, v=v)
    o, grads = jax.vjp(lambda *x: vjp.lightning_attention_pallas(*(dict(args, **dict(zip(wrt, x)))[n] for n in "qkv"),
                                                                 jnp.array([0.1]), starts, None, opts),
                       *(args[n] for n in wrt))
    return o, grads(do)

  names = [str(eqn.params["name"]) for eqn in pallas_calls(jax.make_jaxpr(fwdbwd)(q, q, q, q).jaxpr)]
  assert names.count("lightning_chunk_states") == (2 if wrt == "qkv" else 1), names


@pytest.mark.parametrize("variant,case", [
    ("chunk_loop", Case(1, 200, 2, 72, 40, F32)),
    pytest.param("warp_specialized", Case(1, 256, 2, 64, 96, BF16), marks=needs_ws_jax)], ids=str)
def test_split_backward_from_handed_over_passes_matches_oracle(variant, case):
  """On one device, where the forward hands its split pass to the dq sweep and the dv sweep its own to the dk
  sweep (`pallas_triton.SliceStarts`): outputs and the q, k, v, initial-state gradients against the oracle."""
  check_against_oracle(case, seed=zlib.crc32(f"{case}handed".encode()), argnums=(0, 1, 2, 4), one_device=True,
                       impl="pallas", variant=variant, config=lj.LightningConfig(slice_size=64), interpret=True)


@needs_ws_jax
def test_split_warp_specialized_forward_shares_its_pass_with_the_dq_sweep():
  """Packed rows with a per-head rate, the kernels partitioned over the 8 host devices (so the forward keeps no
  `SliceStarts`): the warp-specialised forward runs per-token factors, but its split pass takes the rate as the
  chunk loop does; the dq sweep, the warp-specialised kernel too, issues its first pass as the forward's
  transposed, the same call, which XLA merges (one states loop, and no chunk loop)."""
  q, k, v, do = (jax.random.normal(key, (1, 256, 1, 64), BF16) for key in jax.random.split(jax.random.key(3), 4))
  segment_ids = jnp.asarray([[0] * 100 + [1] * 156], jnp.int32)

  def fwd_dq(q, do):
    o, vjp = jax.vjp(lambda q: lj.lightning_attention(q, k, v, jnp.array([0.1]), segment_ids=segment_ids,
                                                      impl="pallas", variant="warp_specialized", interpret=True,
                                                      config=lj.LightningConfig(slice_size=64)), q)
    return o, vjp(do)

  hlo = jax.jit(fwd_dq).lower(q, do).compile().as_text()
  loops = re.findall(r" while\([^\n]*op_name=\"[^\"]*?(lightning_chunk_\w+)\)*/while\"", hlo)
  assert loops == ["lightning_chunk_states"], loops


def test_split_with_small_blocks_matches_oracle():
  small = lj.LightningConfig(
      chunk_loop=lj.ChunkLoopConfig(chunk_size=16, block_e=16, num_warps=2, num_stages=1),
      chunk_states=lj.ChunkStatesConfig(block_d=16, block_e=16, num_warps=2, num_stages=1), slice_size=48)
  check_against_oracle(Case(1, 100, 2, 24, 40, F32), seed=11, impl="pallas", variant="chunk_loop", config=small,
                       interpret=True)


# The warp-specialised forward pads T to whole slices: 300 tokens in slices of 2
# chunks end with a slice of one real chunk (44 rows) and one of padding.
@pytest.mark.parametrize("mode", WS_MODES)
@pytest.mark.parametrize("case,slice_size", [
    (Case(1, 300, 2, 64, 64, BF16), 128),
    (Case(2, 129, 1, 40, 72, F16, decay="extreme", initial_state=False), 64),
    (Case(1, 200, 2, 128, 96, BF16, decay=None), 64),
], ids=lambda x: str(x))
def test_split_warp_specialized_matches_oracle(case, slice_size, mode):
  if mode == "interpret" and case.d > 64:
    # A split run always has a state before each slice, and the Mosaic GPU
    # interpreter hangs at K = 128 with a state at 1, 2 and 3 stages once the
    # grid has several slices (test_warp_specialized.py); the GPU runs it.
    pytest.skip("the Mosaic GPU interpreter hangs at K = 128 with per-slice states")
  config = lj.LightningConfig(slice_size=slice_size)
  check_against_oracle(case, seed=zlib.crc32(f"{case}ws-split".encode()), impl="pallas", variant="warp_specialized",
                       config=config, interpret=mode == "interpret")
