"""delta_attention on several devices: inputs split over B and H by a NamedSharding stay on their devices.

On an Auto mesh (no shard_map, plain `jax.jit`) the Pallas kernels run under
custom_partitioning; on an explicit mesh the op splits itself by q's type. Each
result is compared with the token-serial oracle on one device: outputs, the
final state and the gradients of q, k, v, beta, the rates and the initial state;
the compiled HLO shows what crosses devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import collectives, cpu_mesh, elements, explicit_mesh, gpu_only, rel_err
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lightning_jax as lj

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")

B, H, D, E = 2, 4, 8, 5
ARGNUMS = (0, 1, 2, 3, 4, 5)
NAMES = ("q", "k", "v", "beta", "decay", "initial_state")
ROWS, STATE = P("data", None, "model"), P("data", "model")  # B and H split: [B, T, H, ...], [B, H, D, E]


def make_inputs(t, form, *, seed, segments=True):
  """q, k (unit rows), v, beta in [0, 2], the form's rates, s0, segment ids, and the cotangents do, d_final."""
  keys = jax.random.split(jax.random.key(seed), 9)
  q = jax.random.normal(keys[0], (B, t, H, D))
  k = jax.random.normal(keys[1], (B, t, H, D))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(keys[2], (B, t, H, E))
  beta = jax.random.uniform(keys[3], (B, t, H), maxval=2.0)
  rate_shape = {"deltanet": None, "gated_deltanet": (B, t, H), "kda": (B, t, H, D)}[form]
  decay = None if rate_shape is None else jax.random.uniform(keys[4], rate_shape, maxval=0.6)
  s0 = jax.random.normal(keys[5], (B, H, D, E))
  ids = jnp.cumsum(jax.random.bernoulli(keys[6], 0.1, (B, t)), axis=1).astype(jnp.int32) if segments else None
  return q, k, v, beta, decay, s0, ids, jax.random.normal(keys[7], (B, t, H, E)), jax.random.normal(keys[8], s0.shape)


def value_and_grads(ids, do, d_final, **kwargs):
  def loss(q, k, v, beta, decay, s0):
    o, final = lj.delta_attention(q, k, v, beta, decay, initial_state=s0, return_final_state=True, segment_ids=ids,
                                  **kwargs)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * d_final), (o, final)

  return jax.jit(jax.value_and_grad(loss, argnums=ARGNUMS, has_aux=True))


def check_close(got, want, got_grads, want_grads):
  for name, a, b in zip(("o", "final_state"), got, want):
    assert rel_err(a, b) < 1e-4, (name, rel_err(a, b))
  for name, a, b in zip(NAMES, got_grads, want_grads):
    if b is not None:
      assert rel_err(a, b) < 1e-3, (name, rel_err(a, b))


@pytest.mark.parametrize("impl,form,pieces", [("pallas", "kda", None), ("pallas", "gated_deltanet", None),
                                              ("pallas", "gated_deltanet", 2), ("xla", "deltanet", None)])
def test_auto_mesh_inputs_stay_on_their_devices(impl, form, pieces):
  """A plain Mesh (Auto axes), inputs placed over batch and heads: forward and backward run on each device's
  block, and nothing crosses devices but the loss's sums (every operand and result of the delta rule is per batch
  and head); with a sequence split too (its pieces' states and maps kept per device for the backward)."""
  mesh = cpu_mesh((2, 2), ("data", "model"))
  inputs = make_inputs(37, form, seed=1)
  q, k, v, beta, decay, s0, ids, do, d_final = inputs
  (_, want), want_grads = value_and_grads(ids, do, d_final, impl="reference")(q, k, v, beta, decay, s0)

  specs = (ROWS, ROWS, ROWS, ROWS, ROWS, STATE, P("data"), ROWS, STATE)
  place = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  q, k, v, beta, decay, s0, ids, do, d_final = map(place, inputs, specs)
  kwargs = dict(impl=impl, interpret=True) if impl == "pallas" else dict(impl=impl)
  if pieces:
    kwargs["config"] = lj.DeltaConfig(sequence_pieces=pieces)
  vg = value_and_grads(ids, do, d_final, **kwargs)
  (_, got), got_grads = vg(q, k, v, beta, decay, s0)
  check_close(got, want, got_grads, want_grads)
  assert got[0].sharding.spec[:3] == ("data", None, "model") and got_grads[0].sharding.spec[:3] == tuple(ROWS)

  def forward(q, k, v, beta, decay, s0):
    return lj.delta_attention(q, k, v, beta, decay, initial_state=s0, segment_ids=ids, **kwargs)

  assert collectives(forward, q, k, v, beta, decay, s0) == {}
  found = collectives(vg, q, k, v, beta, decay, s0)  # the loss's sums, scalars, alone
  assert set(found) <= {"all-reduce"} and all(elements(s) == 1 for s in found.get("all-reduce", [])), found


def test_auto_mesh_per_chunk_tiles_stay_on_their_devices():
  """`auto_sharding.blockwise` with per-chunk [B, H, Tp, C] tiles (CHUNK_TILES: the warp-specialised forward's
  inverses, which its backward takes) as a result and as an operand: split over B and H like the rest, nothing
  gathered, at a T off the padded length."""
  from lightning_jax.ops.lightning_attention import auto_sharding

  mesh = cpu_mesh((2, 2), ("data", "model"))
  t, tp, c = 37, 64, 16
  q = jax.device_put(jax.random.normal(jax.random.key(0), (B, t, H, D)), NamedSharding(mesh, ROWS))

  def to_tiles(q):  # [B, H, Tp, C]
    return (2 * jnp.pad(jnp.moveaxis(q, 2, 1), ((0, 0), (0, 0), (0, tp - t), (0, c - D))),)

  def round_trip(q):
    (tiles,) = auto_sharding.blockwise(to_tiles, [(q, auto_sharding.ROWS_D)], (auto_sharding.CHUNK_TILES,))
    back = auto_sharding.blockwise(lambda q, tiles: (q + jnp.moveaxis(tiles[:, :, :t, :D], 1, 2),),
                                   [(q, auto_sharding.ROWS_D), (tiles, auto_sharding.CHUNK_TILES)],
                                   (auto_sharding.ROWS_D,))[0]
    return tiles, back

  tiles, back = jax.jit(round_trip)(q)
  assert tiles.shape == (B, H, tp, c) and tiles.sharding.spec[:2] == ("data", "model")
  np.testing.assert_allclose(back, 3 * q, rtol=1e-6)
  assert collectives(round_trip, q) == {}


@pytest.mark.parametrize("spec", [P("data", None, "model"), P(None, "data", "model")],
                         ids=["batch-heads", "sequence-heads"])
def test_explicit_mesh_splits_the_op(spec):
  """Arrays typed as split over an explicit mesh (jax.make_mesh's default): the op splits itself over B and H,
  and runs a T split sequence parallel; o comes back split like q."""
  mesh = explicit_mesh((2, 2), ("data", "model"))
  q, k, v, beta, decay, s0, ids, do, d_final = make_inputs(2 * 23, "kda", seed=2)
  (_, want), want_grads = value_and_grads(ids, do, d_final, impl="reference")(q, k, v, beta, decay, s0)
  place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  q, k, v, do = (place(x, spec) for x in (q, k, v, do))
  vg = value_and_grads(ids, do, d_final, impl="pallas", interpret=True)
  (_, got), got_grads = vg(q, k, v, beta, decay, s0)
  check_close(got, want, got_grads, want_grads)
  assert got[0].sharding.spec[:3] == tuple(spec)
  found = collectives(vg, q, k, v, beta, decay, s0)
  if spec[1] is None:  # B and H split: q, k, v, o and their gradients never move
    assert "all-gather" not in found
  else:  # T split: the slices' maps move, nothing of q's size
    assert found["all-gather"] and all(elements(s) < q.size for s in found["all-gather"]), found


@pytest.mark.parametrize("impl", ["auto", "pallas"])  # the chunked jnp path; the Triton kernels' (interpreted)
def test_explicit_mesh_cu_seqlens_states_split_over_heads(impl):
  mesh = explicit_mesh((2,), ("model",))
  lengths = (9, 0, 30, 1)
  cu = jnp.asarray(np.cumsum((0,) + lengths), jnp.int32)
  q, k, v, beta, decay, _, _, _, _ = make_inputs(sum(lengths), "gated_deltanet", seed=3, segments=False)
  q, k, v, beta, decay = (x[:1] for x in (q, k, v, beta, decay))
  s0 = jax.random.normal(jax.random.key(4), (len(lengths), H, D, E))

  def run(q, s0, impl):
    return lj.delta_attention(q, k, v, beta, decay, initial_state=s0, cu_seqlens=cu, return_final_state=True,
                              impl=impl)

  want = run(q, s0, "reference")
  got = jax.jit(run, static_argnums=2)(jax.device_put(q, NamedSharding(mesh, P(None, None, "model"))),
                                       jax.device_put(s0, NamedSharding(mesh, P(None, "model"))), impl)
  assert rel_err(got[0], want[0]) < 1e-4 and rel_err(got[1], want[1]) < 1e-4
  assert got[1].sharding.spec[:2] == (None, "model")


def test_auto_mesh_cu_seqlens_states_stay_on_their_devices():
  """cu_seqlens with per-sequence states on the Triton kernels, the inputs and the states placed over heads on a plain
  Mesh: o, the final states and every gradient equal the oracle's, and nothing crosses devices but the loss's sums
  (`auto_sharding.blockwise`; the chunk-aligned layout is per head)."""
  mesh = cpu_mesh((2,), ("model",))
  lengths = (9, 0, 30, 1)
  cu = jnp.asarray(np.cumsum((0,) + lengths), jnp.int32)
  q, k, v, beta, decay, _, _, _, _ = make_inputs(sum(lengths), "gated_deltanet", seed=5, segments=False)
  q, k, v, beta, decay = (x[:1] for x in (q, k, v, beta, decay))
  keys = jax.random.split(jax.random.key(6), 3)
  s0, d_final = (jax.random.normal(key, (len(lengths), H, D, E)) for key in keys[:2])
  do = jax.random.normal(keys[2], v.shape)

  def value_and_grads(**kwargs):
    def loss(q, k, v, beta, decay, s0):
      o, finals = lj.delta_attention(q, k, v, beta, decay, initial_state=s0, cu_seqlens=cu, return_final_state=True,
                                     **kwargs)
      return jnp.sum(o * do) + jnp.sum(finals * d_final), (o, finals)
    return jax.jit(jax.value_and_grad(loss, argnums=ARGNUMS, has_aux=True))

  args = (q, k, v, beta, decay, s0)
  (_, want), want_grads = value_and_grads(impl="reference")(*args)
  heads = [P(None, None, "model")] * 5 + [P(None, "model")]  # H: q, k, v, beta, decay's dim 2, the states' dim 1
  placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(args, heads)]
  vg = value_and_grads(impl="pallas", interpret=True)
  (_, got), got_grads = vg(*placed)
  check_close(got, want, got_grads, want_grads)
  assert got[0].sharding.spec[:3] == (None, None, "model") and got[1].sharding.spec[:2] == (None, "model")

  def forward(*args):
    return lj.delta_attention(*args[:5], initial_state=args[5], cu_seqlens=cu, return_final_state=True,
                              impl="pallas", interpret=True)

  assert collectives(forward, *placed) == {}
  found = collectives(vg, *placed)  # the loss's sums, scalars, alone
  assert set(found) <= {"all-reduce"} and all(elements(s) == 1 for s in found.get("all-reduce", [])), found


@pytest.mark.parametrize("form", ["kda", "deltanet"])
def test_sharded_wrapper_equals_the_oracle(form):
  """`sharded_delta_attention` with batch, heads and sequence split at once over a 2 x 2 x 2 Auto mesh: o, the
  final state and every gradient equal the oracle's; o comes back split as the axes say."""
  mesh = cpu_mesh((2, 2, 2), ("data", "sp", "model"))
  q, k, v, beta, decay, s0, ids, do, d_final = make_inputs(2 * 19, form, seed=11)
  (_, want), want_grads = value_and_grads(ids, do, d_final, impl="reference")(q, k, v, beta, decay, s0)

  def loss(q, k, v, beta, decay, s0):
    o, final = lj.sharded_delta_attention(q, k, v, beta, decay, mesh=mesh, batch_axes="data", sequence_axis="sp",
                                          head_axis="model", initial_state=s0, return_final_state=True,
                                          segment_ids=ids, impl="xla")
    return jnp.sum(o * do) + jnp.sum(final * d_final), (o, final)

  (_, got), got_grads = jax.jit(jax.value_and_grad(loss, argnums=ARGNUMS, has_aux=True))(q, k, v, beta, decay, s0)
  check_close(got, want, got_grads, want_grads)
  assert got[0].sharding.spec[:3] == ("data", "sp", "model") and got[1].sharding.spec[:2] == ("data", "model")


def test_sharded_wrapper_with_cu_seqlens_gathers_t():
  """cu_seqlens (B = 1) with a sequence_axis: T gathered for the op, o split over it again; the sequences'
  states [N, H, D, E] split over H."""
  mesh = cpu_mesh((2, 2), ("sp", "model"))
  lengths = (9, 0, 21, 2)
  cu = jnp.asarray(np.cumsum((0,) + lengths), jnp.int32)
  q, k, v, beta, decay, _, _, _, _ = make_inputs(sum(lengths), "gated_deltanet", seed=3, segments=False)
  q, k, v, beta, decay = (x[:1] for x in (q, k, v, beta, decay))
  s0 = jax.random.normal(jax.random.key(4), (len(lengths), H, D, E))
  options = dict(initial_state=s0, cu_seqlens=cu, return_final_state=True)
  want = lj.delta_attention(q, k, v, beta, decay, impl="reference", **options)
  got = jax.jit(lambda q: lj.sharded_delta_attention(q, k, v, beta, decay, mesh=mesh, sequence_axis="sp",
                                                     head_axis="model", **options))(q)
  assert rel_err(got[0], want[0]) < 1e-4 and rel_err(got[1], want[1]) < 1e-4
  assert got[0].sharding.spec[:3] == (None, "sp", "model") and got[1].sharding.spec[:2] == (None, "model")


def test_sharded_wrapper_with_cu_seqlens_and_no_states_runs_sequence_parallel():
  """cu_seqlens without per-sequence states: the packing runs as segment ids with T split (only the slices' maps
  move); o and every gradient equal the oracle's."""
  mesh = cpu_mesh((4,), ("sp",))
  lengths = (9, 0, 21, 2, 12)  # 44 tokens, slices of 11: sequences cross the boundaries
  cu = jnp.asarray(np.cumsum((0,) + lengths), jnp.int32)
  q, k, v, beta, decay, _, _, do, _ = make_inputs(sum(lengths), "kda", seed=6, segments=False)
  q, k, v, beta, decay, do = (x[:1] for x in (q, k, v, beta, decay, do))

  def sharded(*args):
    return lj.sharded_delta_attention(*args, cu_seqlens=cu, mesh=mesh, sequence_axis="sp", impl="xla")

  def oracle(*args):
    return lj.delta_attention(*args, cu_seqlens=cu, impl="reference")

  grads = lambda op: jax.jit(jax.grad(lambda *a: jnp.sum(op(*a) * do), argnums=(0, 1, 2, 3, 4)))  # noqa: E731
  for name, a, b in zip(NAMES, grads(sharded)(q, k, v, beta, decay), grads(oracle)(q, k, v, beta, decay)):
    assert rel_err(a, b) < 1e-3, (name, rel_err(a, b))
  assert rel_err(jax.jit(sharded)(q, k, v, beta, decay), oracle(q, k, v, beta, decay)) < 1e-4
  gathered = collectives(sharded, q, k, v, beta, decay)
  assert set(gathered) == {"all-gather"}, gathered  # each device's map and its ids (B = 1), never q, k, v
  assert sum(elements(s) for s in gathered["all-gather"]) == 4 * (H * D * (D + E) + 3), gathered


def test_sharded_wrapper_errors_name_the_argument():
  mesh = cpu_mesh((2,), ("sp",))
  q, beta = jnp.ones((1, 6, 2, 4)), jnp.ones((1, 6, 2))
  with pytest.raises(ValueError, match="sequence_axis='tp' names an axis not in the mesh"):
    lj.sharded_delta_attention(q, q, q, beta, mesh=mesh, sequence_axis="tp")
  with pytest.raises(ValueError, match="H = 2 must be divisible by the 4 devices"):
    lj.sharded_delta_attention(q, q, q, beta, mesh=cpu_mesh((4,), ("model",)), head_axis="model")
  with pytest.raises(ValueError, match="T = 7 must be divisible by the 2 devices"):
    lj.sharded_delta_attention(jnp.ones((1, 7, 2, 4)), jnp.ones((1, 7, 2, 4)), jnp.ones((1, 7, 2, 4)),
                               jnp.ones((1, 7, 2)), mesh=mesh, sequence_axis="sp")


def test_interpret_mode_inside_check_vma_shard_map_is_refused():
  mesh = cpu_mesh((2,), ("data",))
  q = jnp.ones((2, 8, 2, 4))
  beta = jnp.ones((2, 8, 2))
  with pytest.raises(ValueError, match="interpret mode cannot run inside jax.shard_map with check_vma=True"):
    jax.shard_map(lambda q, beta: lj.delta_attention(q, q, q, beta, impl="pallas", interpret=True),
                  mesh=mesh, in_specs=P("data"), out_specs=P("data"))(q, beta)


def check_sequence_parallel(mesh, t_local, form, check_vma, **kwargs):
  """T split over `mesh`'s "sp" devices inside the caller's shard_map: o, the final state and every gradient
  equal the token-serial oracle on the whole sequence, with segments across device boundaries, one starting
  exactly at device 2's first token; the forward moves only the slices' maps [B, H, D, D + E] and where their
  segments meet."""
  n = mesh.shape["sp"]
  t = n * t_local
  q, k, v, beta, decay, s0, _, do, d_final = make_inputs(t, form, seed=5, segments=False)
  starts = np.zeros((B, t), bool)
  starts[0, [5, min(2, n - 1) * t_local, t - 14]] = True
  starts[1, [(t_local + 3) % t]] = True  # on one device: inside its slice
  ids = jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)
  (_, want), want_grads = value_and_grads(ids, do, d_final, impl="reference")(q, k, v, beta, decay, s0)

  tokens, rates = P(None, "sp"), P(None, "sp") if decay is not None else P()

  def local(q, k, v, beta, decay, s0, ids):
    return lj.delta_attention(q, k, v, beta, decay, initial_state=s0, return_final_state=True, segment_ids=ids,
                              sequence_axis="sp", **kwargs)

  sharded = jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, tokens, rates, P(), tokens),
                          out_specs=(tokens, P()), check_vma=check_vma)

  def loss(q, k, v, beta, decay, s0):
    o, final = sharded(q, k, v, beta, decay, s0, ids)
    return jnp.sum(o * do) + jnp.sum(final * d_final), (o, final)

  (_, got), got_grads = jax.jit(jax.value_and_grad(loss, argnums=ARGNUMS, has_aux=True))(q, k, v, beta, decay, s0)
  check_close(got, want, got_grads, want_grads)
  if jax.default_backend() == "cpu" and n > 1:  # the HLO's text as XLA:CPU writes it
    gathered = collectives(lambda *a: sharded(*a, ids), q, k, v, beta, decay, s0)
    assert set(gathered) == {"all-gather"}, gathered
    # Per device: its map, and per row its first and last ids and whether a segment starts inside.
    assert sum(elements(s) for s in gathered["all-gather"]) == n * (B * H * D * (D + E) + 3 * B), gathered


@pytest.mark.parametrize("impl,form,check_vma", [("xla", "kda", True), ("xla", "deltanet", True),
                                                 ("pallas", "gated_deltanet", False)])
def test_sequence_axis_runs_each_slice_from_the_state_before_it(impl, form, check_vma):
  """On 4 CPU devices, slices of 11 tokens (the Pallas kernels in interpret mode)."""
  kwargs = dict(impl=impl, interpret=True) if impl == "pallas" else dict(impl=impl)
  check_sequence_parallel(cpu_mesh((4,), ("sp",)), 11, form, check_vma, **kwargs)


@gpu_only
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("form", ["deltanet", "gated_deltanet", "kda"])
def test_sequence_axis_compiled_kernels(form, check_vma):
  """The compiled Pallas kernels, forward and backward, over every GPU there is (slices of 150 tokens: not a
  multiple of any chunk); the oracle at full float32 precision."""
  with jax.default_matmul_precision("highest"):
    check_sequence_parallel(Mesh(np.array(jax.devices()), ("sp",)), 150, form, check_vma, impl="pallas")


def test_sequence_axis_errors():
  mesh = cpu_mesh((2,), ("sp",))
  q = jnp.ones((1, 8, 2, 4))
  beta = jnp.ones((1, 8, 2))
  run = lambda **kw: jax.shard_map(lambda q, beta: lj.delta_attention(q, q, q, beta, impl="xla", **kw),  # noqa: E731
                                   mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(q, beta)
  with pytest.raises(ValueError, match="sequence_axis='tp' is not an axis of the enclosing shard_map"):
    run(sequence_axis="tp")
  with pytest.raises(ValueError, match="cu_seqlens does not combine with sequence_axis"):
    run(sequence_axis="sp", cu_seqlens=jnp.asarray([0, 4], jnp.int32))


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_layers_with_sequence_axis_equal_one_device(framework):
  """The delta layers inside shard_map with T split over 4 devices: outputs and every parameter's gradient equal
  the layer on the whole sequence; the short convolutions reach across device boundaries (conv_size 4, slices of
  11 tokens) but not across a segment start on one (token 22)."""
  from flax import nnx

  mesh = cpu_mesh((4,), ("sp",))
  t = 4 * 11
  x = jax.random.normal(jax.random.key(7), (B, t, 16))
  starts = np.zeros((B, t), bool)
  starts[0, [5, 22]] = True
  starts[1, 30] = True
  ids = jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)
  options = dict(head_dim=D, gate="scalar", impl="xla")
  tokens = P(None, "sp")
  if framework == "nnx":
    plain = lj.nnx.DeltaAttention(2, 16, **options, rngs=nnx.Rngs(0))
    split = lj.nnx.DeltaAttention(2, 16, **options, sequence_axis="sp", rngs=nnx.Rngs(0))
    params = nnx.state(plain, nnx.Param)
    apply = lambda layer: lambda p, x, ids: nnx.merge(nnx.graphdef(layer), p)(x, segment_ids=ids)  # noqa: E731
    apply_plain, apply_split = apply(plain), apply(split)
  else:
    plain = lj.linen.DeltaAttention(2, 16, **options)
    split = lj.linen.DeltaAttention(2, 16, **options, sequence_axis="sp")
    params = plain.init(jax.random.key(0), x, segment_ids=ids)
    apply_plain = lambda p, x, ids: plain.apply(p, x, segment_ids=ids)  # noqa: E731
    apply_split = lambda p, x, ids: split.apply(p, x, segment_ids=ids)  # noqa: E731
  sharded = jax.shard_map(apply_split, mesh=mesh, in_specs=(P(), tokens, tokens), out_specs=tokens)

  def value_and_grads(apply):  # the outputs too (has_aux): no forward program of each compiled on its own
    return jax.jit(jax.value_and_grad(lambda p: (lambda y: (jnp.sum(y ** 2), y))(apply(p, x, ids)), has_aux=True))

  (want, y_want), want_grads = value_and_grads(apply_plain)(params)
  (got, y_got), got_grads = value_and_grads(sharded)(params)
  assert rel_err(got, want) < 1e-5
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert rel_err(a, b) < 1e-4
  np.testing.assert_allclose(y_got, y_want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_layers_on_a_mesh_equal_one_device(framework):
  """The delta layers given a mesh (the op through `sharded_delta_attention`, B, Hv and T split at once over a
  2 x 2 x 2 mesh; the projections and convolutions left to XLA): outputs and every parameter's gradient equal the
  layer without one, with packed segments."""
  from flax import nnx

  mesh = cpu_mesh((2, 2, 2), ("data", "sp", "model"))
  t = 2 * 13
  x = jax.random.normal(jax.random.key(9), (B, t, 16))
  ids = jnp.asarray(np.cumsum(np.random.default_rng(2).random((B, t)) < 0.15, axis=1), jnp.int32)
  options = dict(head_dim=D, gate="kda", impl="xla")
  axes = dict(mesh=mesh, batch_axes="data", head_axis="model", sequence_axis="sp")
  if framework == "nnx":
    plain = lj.nnx.DeltaAttention(2, 16, **options, rngs=nnx.Rngs(0))
    split = lj.nnx.DeltaAttention(2, 16, **options, **axes, rngs=nnx.Rngs(0))
    params = nnx.state(plain, nnx.Param)
    apply = lambda layer: lambda p: nnx.merge(nnx.graphdef(layer), p)(x, segment_ids=ids)  # noqa: E731
    apply_plain, apply_split = apply(plain), apply(split)
  else:
    plain = lj.linen.DeltaAttention(2, 16, **options)
    split = lj.linen.DeltaAttention(2, 16, **options, **axes)
    params = plain.init(jax.random.key(0), x, segment_ids=ids)
    apply_plain = lambda p: plain.apply(p, x, segment_ids=ids)  # noqa: E731
    apply_split = lambda p: split.apply(p, x, segment_ids=ids)  # noqa: E731
  want, want_grads = jax.jit(jax.value_and_grad(lambda p: jnp.sum(apply_plain(p) ** 2)))(params)
  got, got_grads = jax.jit(jax.value_and_grad(lambda p: jnp.sum(apply_split(p) ** 2)))(params)
  assert rel_err(got, want) < 1e-5
  # The gate's parameters (A_log, dt_bias) sum many cancelling terms, in another order per split: 1e-4 apart.
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    assert rel_err(a, b) < 1e-3
  assert "all-gather" in collectives(apply_split, params)  # the slices' maps: the op did run split


def test_layers_on_a_mesh_decode_where_t_is_not_split():
  """A mesh splitting B only decodes as the layer without one; one splitting T refuses to decode."""
  from flax import nnx

  mesh = cpu_mesh((2, 2), ("data", "sp"))
  x = jax.random.normal(jax.random.key(3), (B, 7, 16))
  layers = [lj.nnx.DeltaAttention(2, 16, head_dim=D, impl="xla", rngs=nnx.Rngs(0), **axes)
            for axes in ({}, dict(mesh=mesh, batch_axes="data"))]
  outs = []
  for layer in layers:
    layer.init_cache(batch_size=B)
    outs.append(jnp.concatenate([layer(x[:, :5], decode=True), layer(x[:, 5:6], decode=True),
                                 layer(x[:, 6:], decode=True)], axis=1))
  assert rel_err(outs[1], outs[0]) < 1e-5
  split_t = lj.nnx.DeltaAttention(2, 16, head_dim=D, mesh=mesh, sequence_axis="sp", rngs=nnx.Rngs(0))
  split_t.init_cache(batch_size=B)
  with pytest.raises(ValueError, match="decode does not combine with sequence_axis"):
    split_t(x, decode=True)
  with pytest.raises(ValueError, match="batch_axes and head_axis need a mesh"):
    lj.nnx.DeltaAttention(2, 16, batch_axes="data", rngs=nnx.Rngs(0))


def test_layers_with_sequence_axis_do_not_decode():
  from flax import nnx

  layer = lj.nnx.DeltaAttention(2, 16, head_dim=D, sequence_axis="sp", rngs=nnx.Rngs(0))
  layer.init_cache(batch_size=1)
  with pytest.raises(ValueError, match="decode does not combine with sequence_axis"):
    layer(jnp.ones((1, 3, 16)), decode=True)


def test_sequence_axis_past_the_largest_value_dim():
  """D + E over the op's largest E (256): the slices' maps come from two passes, [0] from I and v from zeros."""
  mesh = cpu_mesh((2,), ("sp",))
  b, t, h, d = 1, 2 * 9, 1, 130
  keys = jax.random.split(jax.random.key(8), 4)
  q, v = (jax.random.normal(key, (b, t, h, d)) for key in keys[:2])
  k = jax.random.normal(keys[2], (b, t, h, d))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  beta = jax.random.uniform(keys[3], (b, t, h), maxval=2.0)
  want = lj.delta_attention(q, k, v, beta, return_final_state=True, impl="reference")
  tokens = P(None, "sp")
  got = jax.jit(jax.shard_map(
      lambda q, k, v, beta: lj.delta_attention(q, k, v, beta, return_final_state=True, sequence_axis="sp", impl="xla"),
      mesh=mesh, in_specs=(tokens,) * 4, out_specs=(tokens, P())))(q, k, v, beta)
  assert rel_err(got[0], want[0]) < 1e-4 and rel_err(got[1], want[1]) < 1e-4
