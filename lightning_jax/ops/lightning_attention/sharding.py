"""The op over a device mesh under `shard_map` (`api.sharded_lightning_attention`), for callers who do not write it."""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P


def _axes(name, value, mesh):
  """A mesh axis name, a tuple of them or None -> tuple of names (checked against the mesh)."""
  names = () if value is None else (value,) if isinstance(value, str) else tuple(value)
  for axis in names:
    if axis not in mesh.axis_names:
      raise ValueError(f"{name}={value!r} names an axis not in the mesh {tuple(mesh.axis_names)}")
  return names


def _spec_entry(names):
  return None if not names else names[0] if len(names) == 1 else names


def run_sharded(op, q, k, v, decay, initial_state, segment_ids, *, mesh, batch_axes, head_axis, sequence_axis,
                return_final_state):
  """`op(q, k, v, decay, initial_state, segment_ids, sequence_axis)` under shard_map over `mesh` (checked).

  The body of `sharded_lightning_attention` (see there): B split over
  batch_axes, T over sequence_axis and H over head_axis.
  """
  batch = _axes("batch_axes", batch_axes, mesh)
  heads = _axes("head_axis", head_axis, mesh)
  seq = _axes("sequence_axis", sequence_axis, mesh)
  if len(heads) > 1 or len(seq) > 1:
    raise ValueError(f"head_axis and sequence_axis take one mesh axis name each, got {head_axis!r}, {sequence_axis!r}")
  used = batch + heads + seq
  if len(set(used)) != len(used):
    raise ValueError(f"a mesh axis may split only one dimension, got batch_axes={batch_axes!r}, "
                     f"head_axis={head_axis!r}, sequence_axis={sequence_axis!r}")
  if not hasattr(q, "shape") or len(q.shape) != 4:
    raise ValueError(f"q must be [B, T, H, D], got {getattr(q, 'shape', type(q).__name__)}")
  for dim, (label, names) in zip((q.shape[0], q.shape[1], q.shape[2]),
                                 (("B", batch), ("T", seq), ("H", heads))):
    size = math.prod(mesh.shape[a] for a in names)
    if dim % size:
      raise ValueError(f"{label} = {dim} must be divisible by the {size} devices of mesh axes {names} that split it")
  b_, t_, h_ = _spec_entry(batch), _spec_entry(seq), _spec_entry(heads)
  rows = P(b_, t_, h_, None)
  state = P(b_, h_, None, None)
  per_token = decay is not None and getattr(decay, "ndim", None) == 3
  decay_spec = P(b_, t_, h_) if per_token else P(h_)
  optional = dict(decay=(decay, decay_spec), initial_state=(initial_state, state),
                  segment_ids=(segment_ids, P(b_, t_)))
  given = {name: value for name, (value, _) in optional.items() if value is not None}

  def local(q, k, v, given):
    return op(q, k, v, given.get("decay"), given.get("initial_state"), given.get("segment_ids"), t_)

  # check_vma=False: Pallas interpret mode cannot run under check_vma (a jax
  # limitation), and the op handles both typings (see `sequence_parallel`).
  run = jax.shard_map(local, mesh=mesh,
                      in_specs=(rows, rows, rows, {name: optional[name][1] for name in given}),
                      out_specs=(rows, state) if return_final_state else rows, check_vma=False)
  if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
    # An explicit-sharding mesh (jax.make_mesh's default) types every array's
    # layout: lay the inputs out as the specs say first.
    place = lambda x, spec: jax.reshard(x, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    q, k, v = (place(x, rows) for x in (q, k, v))
    given = {name: place(value, optional[name][1]) for name, value in given.items()}
  return run(q, k, v, given)
