"""An op over a device mesh under `shard_map` (`sharded_lightning_attention`, `sharded_delta_attention`), for callers
who do not write it."""

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


def is_explicit(mesh) -> bool:
  """Whether the mesh has an explicit-sharding axis (`jax.make_mesh`'s default): arrays carry their layout in
  their type there and are laid out by `jax.reshard`, not by a sharding constraint."""
  return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def spec_of(label, *, mesh, batch_axes, head_axis, sequence_axis) -> P:
  """The PartitionSpec of an array labelled `label` ("bthd": B, T, H, D; see `run_sharded`) over these axes."""
  split = {"b": _spec_entry(_axes("batch_axes", batch_axes, mesh)),
           "t": _spec_entry(_axes("sequence_axis", sequence_axis, mesh)),
           "h": _spec_entry(_axes("head_axis", head_axis, mesh))}
  return P(*(split.get(dim) for dim in label))


def run_sharded(op, arrays, *, mesh, batch_axes, head_axis, sequence_axis, out_labels):
  """`op(given, sequence_axis)` under shard_map over `mesh` (axes checked), each device on its block.

  arrays: {name: (array or None, label)}, "q" first; a label names each dim
  (e.g. "bthd": B, T, H, D): b is split over batch_axes, t over sequence_axis,
  h over head_axis, any other dim replicated. op gets {name: block} of the
  arrays given (not None) and the name of the axis splitting T (or None), and
  returns a tuple of arrays labelled by out_labels. The body of
  `sharded_lightning_attention` and `sharded_delta_attention` (see there).
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
  q = arrays["q"][0]
  if not hasattr(q, "shape") or len(q.shape) != 4:
    raise ValueError(f"q must be [B, T, H, D], got {getattr(q, 'shape', type(q).__name__)}")
  for dim, (label, names) in zip((q.shape[0], q.shape[1], q.shape[2]),
                                 (("B", batch), ("T", seq), ("H", heads))):
    size = math.prod(mesh.shape[a] for a in names)
    if dim % size:
      raise ValueError(f"{label} = {dim} must be divisible by the {size} devices of mesh axes {names} that split it")
  t_ = _spec_entry(seq)
  spec = lambda label: spec_of(label, mesh=mesh, batch_axes=batch_axes, head_axis=head_axis,  # noqa: E731
                               sequence_axis=sequence_axis)
  given = {name: value for name, (value, _) in arrays.items() if value is not None}
  in_specs = {name: spec(arrays[name][1]) for name in given}

  # check_vma=False: Pallas interpret mode cannot run under check_vma (a jax
  # limitation), and the op handles both typings (see `sequence_parallel`).
  run = jax.shard_map(lambda given: tuple(op(given, t_)), mesh=mesh, in_specs=(in_specs,),
                      out_specs=tuple(map(spec, out_labels)), check_vma=False)
  if is_explicit(mesh):
    # An explicit-sharding mesh (jax.make_mesh's default) types every array's
    # layout: lay the inputs out as the specs say first.
    given = {name: jax.reshard(value, jax.sharding.NamedSharding(mesh, in_specs[name]))
             for name, value in given.items()}
  return run(given)
