"""Several devices: sequence parallelism (`sequence_axis`), `sharded_lightning_attention` and the layers' mesh.

On the CPU the mesh is made of host devices (conftest asks XLA for 8). Every
result is compared with the single-device op on the same inputs: outputs, the
final state and the gradients of q, k, v, the decay and the initial state.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import collectives, cpu_mesh, elements, explicit_mesh, gpu_only, pallas_calls, rel_err
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lightning_jax as lj
from lightning_jax import linen
from lightning_jax.nnx import LightningAttention

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")

B, H, D, E = 2, 3, 8, 5
ARGNUMS = (0, 1, 2, 3, 4)


def make_inputs(t, decay_kind, *, segments, seed, h=H):
  keys = jax.random.split(jax.random.key(seed), 8)
  q, k = (jax.random.normal(key, (B, t, h, D)) for key in keys[:2])
  v = jax.random.normal(keys[2], (B, t, h, E))
  decay = {"none": None, "head": jax.random.uniform(keys[3], (h,), minval=0.02, maxval=0.5),
           "token": jax.random.uniform(keys[3], (B, t, h), maxval=0.6)}[decay_kind]
  s0 = jax.random.normal(keys[4], (B, h, D, E))
  ids = None
  if segments:  # random boundaries, inside slices and on a slice edge
    ids = jnp.cumsum(jax.random.bernoulli(keys[5], 0.08, (B, t)), axis=1).astype(jnp.int32)
    ids = ids.at[:, t // 2:].add(7)
  return q, k, v, decay, s0, ids, jax.random.normal(keys[6], (B, t, h, E)), jax.random.normal(keys[7], (B, h, D, E))


def value_and_grads(fn, do, d_final, argnums):
  def loss(*args):
    o, final = fn(*args)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * d_final), (o, final)

  return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def check_close(got, want, names, tol=2e-5):
  for name, a, b in zip(names, got, want):
    assert rel_err(a, b) < tol, (name, rel_err(a, b))


def single_device(ids):
  def fn(q, k, v, decay, s0):
    return lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, segment_ids=ids,
                                  impl="reference")
  return fn


# (devices, tokens per device, decay, packed, impl, check_vma): every count of
# devices, decays and packing, both shard_map typings, the XLA path and the
# Pallas kernels (interpret mode; check_vma=True needs compiled kernels).
SP_CASES = [
    (2, 21, "head", False, "xla", True),
    (4, 37, "none", False, "pallas", False),
    (8, 9, "token", True, "xla", False),
    (4, 21, "token", True, "pallas", False),
    (2, 33, "head", True, "pallas", False),
    (8, 13, "head", False, "xla", True),
    (4, 21, "token", False, "xla", True),
]


@pytest.mark.parametrize("devices,t_local,decay_kind,segments,impl,check_vma", SP_CASES)
def test_sequence_parallel_equals_one_device(devices, t_local, decay_kind, segments, impl, check_vma):
  """T split over 2, 4, 8 devices inside shard_map: outputs, final state and every gradient as on one device."""
  mesh = cpu_mesh((devices,), ("sp",))
  t = devices * t_local
  q, k, v, decay, s0, ids, do, d_final = make_inputs(t, decay_kind, segments=segments, seed=devices + t_local)
  kwargs = dict(impl=impl, interpret=True) if impl == "pallas" else dict(impl=impl)
  rows, token = P(None, "sp"), P(None, "sp", None)

  def local(q, k, v, decay, s0, ids):
    return lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, segment_ids=ids,
                                  sequence_axis="sp", **kwargs)

  in_specs = (rows, rows, rows, token if decay_kind == "token" else P(), P(), None if ids is None else rows)
  sharded = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(rows, P()), check_vma=check_vma)
  argnums = ARGNUMS if decay is not None else (0, 1, 2, 4)
  (_, want), want_grads = value_and_grads(single_device(ids), do, d_final, argnums)(q, k, v, decay, s0)
  (_, got), got_grads = value_and_grads(lambda *a: sharded(*a, ids), do, d_final, argnums)(q, k, v, decay, s0)
  check_close(got, want, ("o", "final_state"))
  check_close(got_grads, want_grads, [("q", "k", "v", "decay", "initial_state")[i] for i in argnums],
              tol=2e-4 if decay_kind == "head" else 2e-5)  # dL/d(rate) sums T position-weighted terms


# (argnums, impl, loss): the Pallas kernels in interpret mode (shard_map without check_vma), and the
# XLA path under check_vma, where every zero cotangent must be typed as varying over the axis.
SUBSETS = [((0,), "pallas", "both"), ((1,), "pallas", "both"), ((3,), "pallas", "both"), ((4,), "pallas", "both"),
           ((0, 2), "pallas", "both"), ((0,), "xla", "both"), ((3,), "xla", "both"), ((1, 4), "xla", "final")]


@pytest.mark.parametrize("argnums,impl,loss", SUBSETS)
def test_sequence_parallel_differentiates_any_subset(argnums, impl, loss):
  """Gradients of some inputs alone (the rest fixed, e.g. ALiBi rates), and of the final state alone (o's
  cotangent a symbolic zero), equal one device's."""
  mesh = cpu_mesh((2,), ("sp",))
  q, k, v, decay, s0, _, do, d_final = make_inputs(2 * 19, "head", segments=False, seed=11 + len(argnums))
  rows = P(None, "sp")
  kwargs = dict(impl="pallas", interpret=True) if impl == "pallas" else dict(impl=impl)

  def local(q, k, v, decay, s0):
    return lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, sequence_axis="sp",
                                  **kwargs)

  sharded = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, P(), P()), out_specs=(rows, P()),
                          check_vma=impl != "pallas")
  names = [("q", "k", "v", "decay", "initial_state")[i] for i in argnums]
  if loss == "both":
    _, want = value_and_grads(single_device(None), do, d_final, argnums)(q, k, v, decay, s0)
    _, got = value_and_grads(sharded, do, d_final, argnums)(q, k, v, decay, s0)
  else:
    final_only = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a)[1] * d_final), argnums))  # noqa: E731
    want, got = final_only(single_device(None))(q, k, v, decay, s0), final_only(sharded)(q, k, v, decay, s0)
  check_close(got, want, names, tol=2e-4)


def _pallas_calls(fn, *args):
  """The pallas_calls in fn's jaxpr, nested ones included: (name, operand shapes, result shapes) each."""
  return sorted((str(eqn.params["name"]), tuple(x.aval.shape for x in eqn.invars),
                 tuple(x.aval.shape for x in eqn.outvars)) for eqn in pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr))


def test_sequence_parallel_runs_the_local_ops_kernels_and_two_states_passes():
  """With fixed rates, a device's forward+backward of q, k, v runs the plain op's kernels from an initial state
  (the prefix) with a final-state cotangent, plus one states pass each way: no decay tangent, no initial-state
  gradient."""
  devices, t_local = 2, 64
  mesh = cpu_mesh((devices,), ("sp",))
  q, k, v, decay, s0, _, do, d_final = make_inputs(devices * t_local, "head", segments=False, seed=3)
  kwargs = dict(impl="pallas", interpret=True)

  def local(q, k, v, do, d_final):
    def attn(q, k, v):
      return lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, **kwargs)
    return jax.vjp(attn, q, k, v)[1]((do, d_final))

  def split(q, k, v, do):
    attn = lambda q, k, v: lj.sharded_lightning_attention(  # noqa: E731
        q, k, v, decay, mesh=mesh, sequence_axis="sp", **kwargs)
    return jax.vjp(attn, q, k, v)[1](do)

  want = _pallas_calls(local, *(x[:, :t_local] for x in (q, k, v, do)), d_final)
  got = _pallas_calls(split, q, k, v, do)
  states_passes = [call for call in got if call[0] == "lightning_chunk_states"]
  assert len(states_passes) == 2 and not any(call[0] == "lightning_chunk_states" for call in want), (want, got)
  assert [call for call in got if call not in states_passes] == want, (want, got)


def test_sequence_axis_of_one_device_is_the_plain_op():
  """One device along the axis: the plain op, its final state typed as replicated (out_specs P()) as with several."""
  mesh = cpu_mesh((1,), ("sp",))
  q, k, v, decay, s0, _, _, _ = make_inputs(40, "head", segments=False, seed=3)
  # Both sides jitted: one program each (eager, every op compiled on its own).
  fn = jax.jit(jax.shard_map(lambda q: lj.lightning_attention(q, k, v, decay, initial_state=s0,
                                                              return_final_state=True, sequence_axis="sp", impl="xla"),
                             mesh=mesh, in_specs=P(None, "sp"), out_specs=(P(None, "sp"), P())))
  want = jax.jit(lambda q: lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True,
                                                  impl="xla"))(q)
  for got, ref in zip(fn(q), want):
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_plain_op_inside_shard_map_with_check_vma(impl):
  """Batch split inside the caller's shard_map (check_vma=True): packed rows, per-token decay, no initial state."""
  mesh = cpu_mesh((2,), ("data",))
  q, k, v, decay, _, ids, _, _ = make_inputs(30, "token", segments=True, seed=4)

  def op(q, k, v, decay, ids):
    return lj.lightning_attention(q, k, v, decay, segment_ids=ids, return_final_state=True, impl=impl)

  # Both sides jitted: one program each (eager, every op compiled on its own).
  fn = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=(P("data"),) * 5, out_specs=(P("data"), P("data"))))
  for got, ref in zip(fn(q, k, v, decay, ids), jax.jit(op)(q, k, v, decay, ids)):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decay_kind", ["head", "token"])
def test_sharded_wrapper_equals_one_device(decay_kind):
  """Batch, heads and sequence split at once, over a 2 x 2 x 2 mesh."""
  mesh = cpu_mesh((2, 2, 2), ("data", "sp", "model"))
  q, k, v, decay, s0, ids, do, d_final = make_inputs(2 * 19, decay_kind, segments=decay_kind == "token", seed=11,
                                                     h=4)

  def sharded(q, k, v, decay, s0):
    return lj.sharded_lightning_attention(q, k, v, decay, mesh=mesh, batch_axes="data", sequence_axis="sp",
                                          head_axis="model", initial_state=s0, return_final_state=True,
                                          segment_ids=ids, impl="xla")

  (_, want), want_grads = value_and_grads(single_device(ids), do, d_final, ARGNUMS)(q, k, v, decay, s0)
  (_, got), got_grads = value_and_grads(sharded, do, d_final, ARGNUMS)(q, k, v, decay, s0)
  check_close(got, want, ("o", "final_state"))
  check_close(got_grads, want_grads, ("q", "k", "v", "decay", "initial_state"), tol=2e-4)


def test_batch_and_head_sharding_moves_no_activations():
  """Split over batch and heads: the forward has no collective; the backward only sums the [H] decay gradient."""
  mesh = cpu_mesh((2, 4), ("data", "model"))
  q = jnp.ones((4, 64, 8, 16))
  decay = jnp.full((8,), 0.1)

  def fwd(q, decay):
    return lj.sharded_lightning_attention(q, q, q, decay, mesh=mesh, batch_axes="data", head_axis="model",
                                          impl="xla")

  assert collectives(fwd, q, decay) == {}
  grads = collectives(jax.grad(lambda q, d: fwd(q, d).sum(), argnums=(0, 1)), q, decay)
  assert set(grads) <= {"all-reduce"} and all(elements(s) <= 8 for s in grads.get("all-reduce", [])), grads


@pytest.mark.parametrize("spec", [P("data", None, "model"), P("data", "model"), P(None, "model", "data")],
                         ids=["batch-heads", "batch-sequence", "sequence-heads"])
def test_explicitly_sharded_inputs_split_the_plain_op(spec):
  """Arrays typed as split over an explicit mesh: the plain op runs per device, with no all-gather of activations."""
  mesh = explicit_mesh((2, 4), ("data", "model"))
  q, k, v, decay, s0, _, do, d_final = make_inputs(4 * 12, "head", segments=False, seed=2, h=4)
  place = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
  q, k, v, do = (place(x, spec) for x in (q, k, v, do))

  def ours(q, k, v, decay, s0):
    return lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, impl="pallas",
                                  interpret=True)

  (_, want), want_grads = value_and_grads(single_device(None), do, d_final, ARGNUMS)(q, k, v, decay, s0)
  (_, got), got_grads = value_and_grads(ours, do, d_final, ARGNUMS)(q, k, v, decay, s0)
  check_close(got, want, ("o", "final_state"))
  check_close(got_grads, want_grads, ("q", "k", "v", "decay", "initial_state"), tol=2e-4)
  assert got[0].sharding.spec[:3] == tuple(spec) + (None,) * (3 - len(spec))
  state_size = B * 4 * D * E
  for fn in (ours, jax.grad(lambda *a: ours(*a)[0].sum(), argnums=ARGNUMS)):
    for kind, shapes in collectives(fn, q, k, v, decay, s0).items():
      assert kind in ("all-gather", "all-reduce"), (kind, shapes)
      assert all(elements(s) <= 4 * (state_size + B * 4) for s in shapes), (kind, shapes)  # states, never q, k, v


@pytest.mark.parametrize("impl,decay_kind", [("pallas", "head"), ("pallas", "token"), ("xla", "head")])
def test_auto_mesh_sharded_inputs_split_the_plain_op(impl, decay_kind):
  """Inputs placed over batch and heads of a plain Mesh (Auto axes), no shard_map: under jax.jit the op runs
  on each device's block (the Pallas kernels through custom_partitioning), forward and backward."""
  mesh = cpu_mesh((2, 2), ("data", "model"))
  h = 4
  inputs = make_inputs(37, decay_kind, segments=decay_kind == "token", seed=7, h=h)
  q, k, v, decay, s0, ids, do, d_final = inputs
  want_vg = value_and_grads(single_device(ids), do, d_final, ARGNUMS)
  (_, want), want_grads = want_vg(q, k, v, decay, s0)  # on one device

  rows, state = P("data", None, "model", None), P("data", "model", None, None)
  specs = (rows, rows, rows, P("model") if decay_kind == "head" else P("data", None, "model"), state, P("data"),
           rows, state)
  place = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  q, k, v, decay, s0, ids, do, d_final = map(place, inputs, specs)
  kwargs = dict(impl=impl, interpret=True) if impl == "pallas" else dict(impl=impl)

  def ours(q, k, v, decay, s0):
    return lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, segment_ids=ids,
                                  **kwargs)

  vg = value_and_grads(ours, do, d_final, ARGNUMS)
  (_, got), got_grads = vg(q, k, v, decay, s0)
  check_close(got, want, ("o", "final_state"))
  check_close(got_grads, want_grads, ("q", "k", "v", "decay", "initial_state"))
  assert got[0].sharding.spec[:3] == ("data", None, "model") and got_grads[0].sharding.spec[:3] == rows[:3]
  for fn in (ours, vg):  # the forward, and forward and backward
    found = collectives(fn, q, k, v, decay, s0)
    assert set(found) <= {"all-reduce"}, found  # nothing gathered
    # Pallas sums only the per-head decay gradient [H / 2] over the batch. (XLA's autodiff of impl="xla" sums
    # the cotangents of the per-head decay factors, [T, H / 2] and [T / 64, H / 2, 64, 64], before reducing them.)
    if impl == "pallas":
      assert all(elements(s) <= h for s in found.get("all-reduce", [])), found


@pytest.mark.parametrize("decay_kind", ["head", "token"])
def test_auto_mesh_sharded_cu_seqlens_states_split_the_plain_op(decay_kind):
  """cu_seqlens with per-sequence states ([N, H, D, E]) over a head-split Auto mesh: each device runs its heads'
  sequence programs (bounds replicated), forward and backward, and nothing is gathered."""
  mesh = cpu_mesh((4,), ("model",))
  h, t = 4, 90
  keys = jax.random.split(jax.random.key(3), 7)
  q, k = (jax.random.normal(key, (1, t, h, D)) for key in keys[:2])
  v = jax.random.normal(keys[2], (1, t, h, E))
  decay = (jax.random.uniform(keys[3], (h,), minval=0.02, maxval=0.5) if decay_kind == "head"
           else jax.random.uniform(keys[3], (1, t, h), maxval=0.6))
  cu = jnp.array([0, 17, 17, 80, 90], jnp.int32)
  s0, d_final = (jax.random.normal(key, (4, h, D, E)) for key in keys[4:6])
  do = jax.random.normal(keys[6], (1, t, h, E))

  def call(**kwargs):
    return lambda q, k, v, decay, s0: lj.lightning_attention(q, k, v, decay, initial_state=s0,
                                                             return_final_state=True, cu_seqlens=cu, **kwargs)

  (_, want), want_grads = value_and_grads(call(impl="reference"), do, d_final, ARGNUMS)(q, k, v, decay, s0)
  rows, state = P(None, None, "model"), P(None, "model")
  place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  decay = place(decay, P("model") if decay_kind == "head" else rows)
  q, k, v, do, s0, d_final = (place(x, spec) for x, spec in ((q, rows), (k, rows), (v, rows), (do, rows),
                                                             (s0, state), (d_final, state)))
  ours = call(impl="pallas", interpret=True, config=lj.LightningConfig(slice_size=64))  # 2 slices: pieces
  vg = value_and_grads(ours, do, d_final, ARGNUMS)
  (_, got), got_grads = vg(q, k, v, decay, s0)
  check_close(got, want, ("o", "final_state"), tol=2e-4)
  check_close(got_grads, want_grads, ("q", "k", "v", "decay", "initial_state"), tol=2e-4)
  assert got[0].sharding.spec[:3] == (None, None, "model") and got[1].sharding.spec[:2] == (None, "model")
  for fn in (ours, vg):
    assert set(collectives(fn, q, k, v, decay, s0)) <= {"all-reduce"}  # nothing gathered


def test_sequence_parallel_exchanges_only_states():
  """Forward: one all-gather, of the states (and decays, ids); backward: its mirror, plus the [H] decay gradient."""
  devices, t_local = 4, 32
  mesh = cpu_mesh((devices,), ("sp",))
  q = jnp.ones((B, devices * t_local, H, D))
  decay = jnp.full((H,), 0.1)
  state_size = B * H * D * D

  def fwd(q, decay):
    return lj.sharded_lightning_attention(q, q, q, decay, mesh=mesh, sequence_axis="sp", impl="xla")

  found = collectives(fwd, q, decay)
  assert list(found) == ["all-gather"] and len(found["all-gather"]) == 1, found
  # [P, B H D E + B H]: the states and each slice's decay, nothing of size T.
  assert elements(found["all-gather"][0]) == devices * (state_size + B * H), found
  grads = collectives(jax.grad(lambda q, d: fwd(q, d).sum(), argnums=(0, 1)), q, decay)
  assert set(grads) <= {"all-gather", "all-reduce"}, grads
  assert len(grads["all-gather"]) == 2 and all(elements(s) <= devices * (state_size + B * H)
                                               for s in grads["all-gather"]), grads
  assert all(elements(s) <= H for s in grads.get("all-reduce", [])), grads


@pytest.mark.parametrize("mode", ["nnx_mesh", "nnx_shard_map", "linen_mesh"])
def test_layers_on_a_mesh_equal_one_device(mode):
  mesh = cpu_mesh((2, 4), ("data", "sp"))
  x = jax.random.normal(jax.random.key(0), (4, 4 * 11, 32))
  if mode == "linen_mesh":
    plain = linen.LightningAttention(4, 32, impl="xla")
    on_mesh = linen.LightningAttention(4, 32, impl="xla", mesh=mesh, batch_axes="data", sequence_axis="sp")
    params = plain.init(jax.random.key(1), x)
    want, want_grad = jax.jit(jax.value_and_grad(lambda p: plain.apply(p, x).sum()))(params)
    got, got_grad = jax.jit(jax.value_and_grad(lambda p: on_mesh.apply(p, x).sum()))(params)
    assert rel_err(got, want) < 1e-5
    for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
      assert rel_err(a, b) < 1e-4
    return
  plain = LightningAttention(4, 32, impl="xla", rngs=nnx.Rngs(0))
  if mode == "nnx_mesh":
    layer = LightningAttention(4, 32, impl="xla", mesh=mesh, batch_axes="data", sequence_axis="sp", rngs=nnx.Rngs(0))
    run = nnx.jit(lambda m, x: m(x))
  else:
    layer = LightningAttention(4, 32, impl="xla", sequence_axis="sp", rngs=nnx.Rngs(0))
    mapped = jax.shard_map(lambda x: layer(x), mesh=mesh, in_specs=P("data", "sp"), out_specs=P("data", "sp"))
    run = lambda m, x: mapped(x)  # noqa: E731
  # The one-device side jitted (one program, not every op compiled eagerly).
  np.testing.assert_allclose(run(layer, x), nnx.jit(lambda m, x: m(x))(plain, x), rtol=1e-5, atol=1e-5)
  if mode == "nnx_mesh":
    got = nnx.grad(lambda m: m(x).sum())(layer)
    want = nnx.jit(nnx.grad(lambda m: m(x).sum()))(plain)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert rel_err(a, b) < 1e-4


def test_errors_name_the_argument():
  mesh = cpu_mesh((2,), ("sp",))
  q = jnp.ones((1, 10, 2, 4))
  with pytest.raises(ValueError, match="sequence_axis='sp' is not an axis"):
    lj.lightning_attention(q, q, q, sequence_axis="sp")
  with pytest.raises(ValueError, match="cu_seqlens does not combine with sequence_axis"):
    jax.shard_map(lambda q: lj.lightning_attention(q, q, q, cu_seqlens=jnp.array([0, 10]), sequence_axis="sp"),
                  mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q)
  with pytest.raises(ValueError, match="interpret mode cannot run inside jax.shard_map with check_vma=True"):
    jax.shard_map(lambda q: lj.lightning_attention(q, q, q, impl="pallas", interpret=True, sequence_axis="sp"),
                  mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q)
  with pytest.raises(ValueError, match="T = 9 must be divisible by the 2 devices"):
    lj.sharded_lightning_attention(jnp.ones((1, 9, 2, 4)), q[:, :9], q[:, :9], mesh=mesh, sequence_axis="sp")
  with pytest.raises(ValueError, match="names an axis not in the mesh"):
    lj.sharded_lightning_attention(q, q, q, mesh=mesh, batch_axes="data")
  with pytest.raises(ValueError, match="may split only one dimension"):
    lj.sharded_lightning_attention(q, q, q, mesh=mesh, batch_axes="sp", sequence_axis="sp")
  with pytest.raises(ValueError, match="batch_axes and head_axis need a mesh"):
    LightningAttention(2, 8, batch_axes="data", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="mesh must be None or a jax.sharding.Mesh"):
    LightningAttention(2, 8, mesh="sp", rngs=nnx.Rngs(0))


@gpu_only
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("decay_kind", ["head", "token"])
def test_compiled_kernels_inside_shard_map(check_vma, decay_kind):
  """The compiled kernels (forward and backward) under shard_map, T split over the GPUs there are."""
  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("sp",))
  q, k, v, decay, s0, ids, do, d_final = make_inputs(len(devices) * 150, decay_kind, segments=decay_kind == "token",
                                                     seed=5)
  rows = P(None, "sp")

  def local(q, k, v, decay, s0, ids):
    return lj.lightning_attention(q, k, v, decay, initial_state=s0, return_final_state=True, segment_ids=ids,
                                  sequence_axis="sp", impl="pallas")

  in_specs = (rows, rows, rows, rows if decay_kind == "token" else P(), P(), None if ids is None else rows)
  sharded = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(rows, P()), check_vma=check_vma)
  (_, want), want_grads = value_and_grads(single_device(ids), do, d_final, ARGNUMS)(q, k, v, decay, s0)
  (_, got), got_grads = value_and_grads(lambda *a: sharded(*a, ids), do, d_final, ARGNUMS)(q, k, v, decay, s0)
  check_close(got, want, ("o", "final_state"), tol=1e-4)
  check_close(got_grads, want_grads, ("q", "k", "v", "decay", "initial_state"), tol=1e-3)

