"""The Pallas path partitioned by XLA: inputs sharded over B and H under `jax.jit` stay on their devices.

A `pallas_call` is a custom call that XLA's partitioner cannot look into: given
q, k, v split over a mesh with Auto axes (`jax.device_put` or `in_shardings`
with a `NamedSharding`, no shard_map), it gathers them onto every device. Here
the kernels of the forward pass and of the backward pass are each wrapped in
`custom_partitioning`: a Shardy rule says that every operand and result is
batched over B and H (T, D and E replicated), and the partition callback runs
the same kernels on each device's block of q's B and H split. q, k, v, o, the
states and their gradients stay on their devices; only the per-head decay
gradient, [H], is summed over the batch shards. (A T split is gathered: that
is sequence parallelism, `sequence_axis` inside shard_map.) The XLA and
reference paths need none of this: XLA partitions their jnp itself.

A per-head decay [H] enters as rows [B, H] (all equal; each block reads its
first row), so that every operand and result carries B: its gradient comes
back as rows [B, H] (zero but for each block's first row) summed outside, which
needs no collective inside the kernels and no knowledge of the mesh.

Inside `jax.shard_map` the op already runs on each device's block and the
plain `vjp.lightning_attention_pallas` is used; under `jax.vmap` the kernels
are vmapped directly (custom_partitioning has no batching rule), unpartitioned;
with one device there is nothing to partition and the kernels run as they are.
The delta op's Pallas path (`delta_attention.vjp`) runs its forward and
backward kernels through the same `blockwise`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import vjp
from lightning_jax.ops.lightning_attention.config import PallasOptions

# Labels of the dimensions of each array (Shardy factors): B, T, H, D, E; and the delta rule's per-chunk [C, C]
# tiles [B, H, Tp, C] (p: T padded to whole chunks, c: a chunk's tokens), its states before each chunk, transposed,
# [B, H, N, Ep, Dp] (n: chunks; f, k: E and D padded), pseudo-values U^T [B, H, Ep, Tp], and KDA's log decays at
# each chunk's 16-token blocks' ends [B, H, N, 4, Dp] (j: the blocks).
ROWS_D, ROWS_E, TOKENS, STATE, STARTS, CHUNK_TILES = "bthd", "bthe", "bth", "bhde", "bt", "bhpc"
# cu_seqlens run as sequence programs: the bounds [N + 1] (u) and the states [N, H, D, E] (s: the sequences).
BOUNDS, SEQUENCE_STATE = "u", "shde"
CHUNK_STATES, CHUNK_VALUES, CHUNK_BLOCKS = "bhnfk", "bhfp", "bhnjk"
_SPLIT = ("b", "h")  # the factors kept split; the others are gathered if they were split


def _body(fn, labels, *arrays):
  del labels  # used by the rule and the partition callback only
  return fn(*arrays)


def _rule(fn, labels, mesh, operand_types, result_types):
  """The Shardy rule, say "b t h d, b t h d, b t h e, b h -> b t h e": B, H batch; T, D, E (every other factor)
  never split."""
  del fn, mesh, operand_types, result_types
  ins, outs = labels
  join = lambda group: ", ".join(" ".join(label) for label in group)  # noqa: E731
  # (in the order the rule's factors are numbered: their first appearance)
  replicated = [f for f in dict.fromkeys("".join(ins + outs)) if f not in _SPLIT]
  return f"{join(ins)} -> {join(outs)}", dict(need_replication_factors=tuple(replicated))


def _partition(fn, labels, mesh, arg_shapes, result_shape):
  """Every array split over q's B and H mesh axes (where they divide them), the rest replicated."""
  del result_shape
  ins, outs = labels
  q = arg_shapes[0]
  axes = {}
  if isinstance(q.sharding, NamedSharding):
    spec = tuple(q.sharding.spec) + (None,) * len(ins[0])
    for factor in _SPLIT:
      dim = ins[0].index(factor)
      names = () if spec[dim] is None else (spec[dim],) if isinstance(spec[dim], str) else tuple(spec[dim])
      axes[factor] = spec[dim] if q.shape[dim] % math.prod(mesh.shape[n] for n in names) == 0 else None
  else:  # no mesh names the axes (a GSPMDSharding): each device runs the whole op, as XLA would
    mesh = Mesh(np.array(list(q.sharding.device_set)), ("devices",))
  sharding = lambda label: NamedSharding(mesh, P(*(axes.get(f) for f in label)))  # noqa: E731
  return mesh, fn, tuple(map(sharding, outs)), tuple(map(sharding, ins))


def _infer_result_shardings(fn, labels, mesh, arg_shapes, result_shape):
  """The partition's result shardings (for the GSPMD partitioner; Shardy reads `_rule`)."""
  return _partition(fn, labels, mesh, arg_shapes, result_shape)[2]


_partitioned = custom_partitioning(_body, static_argnums=(0, 1))
_partitioned.def_partition(_partition, infer_sharding_from_operands=_infer_result_shardings, sharding_rule=_rule)


def blockwise(fn, ins, out_labels):
  """fn(*arrays) -> tuple of arrays, run on each device's block of B and H (the Pallas paths of both ops).

  ins: (array or None, label) pairs, label naming its dims ("bthd", ...); fn
  gets None where the array is None. out_labels: the labels of fn's results.
  Inside shard_map, or with one device, fn runs as it is.
  """
  if unpartitioned():
    return tuple(fn(*(x for x, _ in ins)))
  given = [i for i, (x, _) in enumerate(ins) if x is not None]

  def flat(*arrays):
    args = [None] * len(ins)
    for i, x in zip(given, arrays):
      args[i] = x
    return tuple(fn(*args))

  # Under jit, the kernels' constants (numpy arrays) stay inside: custom_partitioning takes none.
  body = jax.jit(flat)
  arrays = [ins[i][0] for i in given]
  # custom_partitioning declares no effects, so cannot carry a body's (the Mosaic GPU interpreter's ordered
  # callbacks): such a body runs unpartitioned. The partitioned call below reuses this trace.
  if body.trace(*arrays).jaxpr.effects:
    return body(*arrays)
  labels = (tuple(ins[i][1] for i in given), tuple(out_labels))
  call = jax.custom_batching.custom_vmap(lambda *arrays: _partitioned(body, labels, *arrays))

  @call.def_vmap
  def _vmapped(axis_size, in_batched, *arrays):
    del axis_size
    out = jax.vmap(flat, in_axes=[0 if b else None for b in in_batched])(*arrays)
    return out, tuple(True for _ in out)

  return call(*arrays)


def _decay_in(decay, b):
  """(operand, label): per-token rates [B, T, H] as they are, per-head [H] as equal rows [B, H]."""
  if decay is None or chunk_common.per_token(decay):
    return decay, TOKENS
  return jnp.broadcast_to(decay, (b, decay.shape[0])), "bh"


def _decay_local(decay):
  """A block's decay: per-token rates, or the first of the per-head rows."""
  return decay if decay is None or decay.ndim == 3 else decay[0]


def _packing_labels(packing):
  """(the packing's label, the states'): segment starts [B, T] and states [B, H, D, E], or sequence bounds and
  states per sequence."""
  return (STARTS, STATE) if vjp.sequence_bounds(packing) is None else (BOUNDS, SEQUENCE_STATE)


def _forward(q, k, v, decay, packing, initial_state, opts):
  """o [B, T, H, E], and with opts.return_final_state (o, final state [B, H, D, E])."""
  def local(q, k, v, decay, packing, initial_state):
    out = vjp._primal(q, k, v, _decay_local(decay), packing, initial_state, opts)
    return out if opts.return_final_state else (out,)

  packing_label, state = _packing_labels(packing)
  outs = (ROWS_E, state) if opts.return_final_state else (ROWS_E,)
  out = blockwise(local, ((q, ROWS_D), (k, ROWS_D), (v, ROWS_E), _decay_in(decay, q.shape[0]),
                          (packing, packing_label), (initial_state, state)), outs)
  return out if opts.return_final_state else out[0]


def inside_shard_map():
  return bool(jax.sharding.get_abstract_mesh().manual_axes)


def unpartitioned():
  """Whether `blockwise` runs its function as it is: inside shard_map, or with one device."""
  return inside_shard_map() or jax.device_count() == 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _lightning_attention_pallas(q, k, v, decay, packing, initial_state, opts: PallasOptions):
  return _forward(q, k, v, decay, packing, initial_state, opts)


def lightning_attention_pallas(q, k, v, decay, packing, initial_state, opts: PallasOptions):
  """`vjp.lightning_attention_pallas` (same arguments), partitioned over B and H outside shard_map."""
  op = vjp.lightning_attention_pallas if inside_shard_map() else _lightning_attention_pallas
  return op(q, k, v, decay, packing, initial_state, opts)


def _fwd(q, k, v, decay, packing, initial_state, opts):
  # symbolic_zeros: the primals arrive wrapped, saying which are differentiated.
  perturbed = lambda x: x is not None and x.perturbed  # noqa: E731
  needs = vjp.Needs(*map(perturbed, (q, k, v, decay, initial_state)))
  q, k, v, decay, packing, initial_state = vjp.first_order_only("lightning_attention", tuple(
      None if x is None else x.value for x in (q, k, v, decay, packing, initial_state)))
  slice_starts = None
  if unpartitioned():  # the kernels run as they are: the forward keeps its split's first pass for the dq sweep
    out, slice_starts = vjp.forward(q, k, v, decay, packing, initial_state, opts)
  else:
    out = _forward(q, k, v, decay, packing, initial_state, opts)
  # The per-token decay gradient's last term reads the final state (as in `vjp`).
  final_state = out[1] if opts.return_final_state and needs.d_decay and chunk_common.per_token(decay) else None
  return out, (q, k, v, decay, packing, initial_state, final_state,
               vjp.dq_sweep_starts(slice_starts, decay, needs), needs)


def _bwd(opts, residuals, cotangents):
  residuals, cotangents = vjp.first_order_only("lightning_attention", (residuals, cotangents))
  q, k, v, decay, packing, initial_state, final_state, slice_starts, needs = residuals
  do, d_final = cotangents if opts.return_final_state else (cotangents, None)
  if isinstance(d_final, SymbolicZero):
    d_final = None
  if isinstance(do, SymbolicZero):
    do = jnp.zeros(do.shape, q.dtype)
  decay_in, decay_label = _decay_in(decay, q.shape[0])
  packing_label, state = _packing_labels(packing)
  # The gradients asked for, each of which `vjp._backward` computes: (index in its result, label).
  wanted = [(i, label) for i, (need, label) in enumerate(
      ((needs.dq, ROWS_D), (needs.dk, ROWS_D), (needs.dv, ROWS_E), (needs.d_decay and decay is not None, decay_label),
       (False, None), (needs.d_initial and initial_state is not None, state))) if need]

  def local(q, k, v, decay, packing, initial_state, final_state, do, d_final):
    # slice_starts is None unless blockwise runs this as it is (as the forward did).
    grads = vjp._backward(opts, (q, k, v, _decay_local(decay), packing, initial_state, final_state, slice_starts,
                                 needs),
                          (do, d_final) if opts.return_final_state else do)
    if grads[3] is not None and decay.ndim == 2:  # per-head: the block's sum, as its first row
      grads = grads[:3] + (jnp.zeros_like(decay).at[0].set(grads[3]),) + grads[4:]
    return tuple(grads[i] for i, _ in wanted)

  out = blockwise(local, ((q, ROWS_D), (k, ROWS_D), (v, ROWS_E), (decay_in, decay_label), (packing, packing_label),
                          (initial_state, state), (final_state, state), (do, ROWS_E), (d_final, state)),
                  [label for _, label in wanted])
  grads = [None] * 6
  for (i, _), g in zip(wanted, out):
    grads[i] = g
  if grads[3] is not None and decay.ndim == 1:
    grads[3] = grads[3].sum(0)
  return tuple(grads)


_lightning_attention_pallas.defvjp(_fwd, _bwd, symbolic_zeros=True)
