"""shard_map's typing of values by the mesh axes they vary over (`check_vma`), across jax 0.10-0.12.

Inside `jax.shard_map(..., check_vma=True)` every value carries the set of
manual mesh axes along which it may differ between devices. A `pallas_call`'s
outputs must be given that set, and an all-gathered value that is the same on
every device must be typed so to be returned as replicated.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp


def _manual_type(x):
  return getattr(jax.typeof(x), "manual_axis_type", None)  # jax 0.10; later versions: `vma`


def varying_axes(x) -> frozenset:
  """The mesh axes x varies over (empty outside shard_map or without check_vma)."""
  return _aval_axes(jax.typeof(x))


def _aval_axes(aval) -> frozenset:
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return manual.varying
  return frozenset(getattr(aval, "vma", frozenset()))


def zeros_of(aval):
  """Zeros of an abstract value's shape and dtype, varying over the axes it does (a cotangent's type)."""
  axes = tuple(sorted(_aval_axes(aval), key=str))
  zeros = jnp.zeros(aval.shape, aval.dtype)
  return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


def struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A kernel result's ShapeDtypeStruct, varying over every axis any of `inputs` (None skipped) varies over."""
  inputs = [x for x in inputs if x is not None]
  axes = frozenset().union(*(varying_axes(x) for x in inputs))
  manual = next((m for m in map(_manual_type, inputs) if m is not None), None)
  if manual is not None:
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=type(manual)(varying=axes))
  return jax.ShapeDtypeStruct(shape, dtype, vma=axes)


def all_gather_invariant(x, axis_name):
  """all_gather along a new leading axis, typed (under check_vma) as the same on every device, which it is.

  `jax.lax.all_gather`'s result stays typed as varying; this one can be
  returned with a replicated out_spec.
  """
  if axis_name not in varying_axes(x):
    return jax.lax.all_gather(x, axis_name, axis=0)
  if "to" in inspect.signature(jax.lax.all_gather).parameters:  # jax >= 0.12
    return jax.lax.all_gather(x, axis_name, axis=0, to="invarying")
  from jax._src.lax import parallel  # jax 0.10, 0.11: private
  return parallel.all_gather_invariant(x, axis_name, axis=0)


def sum_to_type_of(cotangent, primal):
  """A custom_vjp cotangent summed over the mesh axes it varies over and its primal does not.

  A value the same on every device (say a replicated [H] decay) is used by
  each; its gradient is the sum of theirs, typed like it.
  """
  if cotangent is None or primal is None:
    return cotangent
  extra = tuple(sorted(varying_axes(cotangent) - varying_axes(primal), key=str))
  return jax.lax.psum(cotangent, extra) if extra else cotangent


def vary_like(x, *refs):
  """x typed as varying over every axis that one of `refs` varies over (a scan carry must keep its type).

  A zero (or replicated) initial state meets per-device inputs in a scan whose
  carry then varies: the carry must be typed so from the start.
  """
  extra = tuple(sorted(frozenset().union(*(varying_axes(r) for r in refs)) - varying_axes(x), key=str))
  return jax.lax.pcast(x, extra, to="varying") if extra else x
