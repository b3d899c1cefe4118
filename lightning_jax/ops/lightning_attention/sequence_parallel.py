"""Sequence parallelism (LASP-2): T sharded over a mesh axis, each device running its slice from the state before it.

Inside `shard_map`, device p of the P devices along `sequence_axis` holds
tokens [p T_p, (p + 1) T_p) of every row. With L_p its slice's own final state
(from zeros) and A_p the slice's decay (exp of minus its summed rates; 0 where a
segment starts in it), the state before slice p is

    P_0 = S_0,   P_{p+1} = A_p P_p + L_p,

the recurrence of the sequence split inside one GPU, so the same closed form
(`chunk_common.combine_slice_states`) computes it. Forward, per device:

  1. L_p from k, v (a states-only pass: no outputs),
  2. one all-gather of (L_p, the slice's log-decay and segment boundary ids),
  3. every P_p and the final state P_P from the combine, locally,
  4. the local op from P_p (zeros where the slice starts a new segment).

The backward pass is the mirror image. With D_p = dLoss/dP_p through slice p's
own outputs (a reverse states-only pass over q and do), the state cotangents
run from later devices to earlier ones,

    g_P = dS_final,   g_p = D_p + A_p g_{p+1},

the same combine over the slices in reverse order after one all-gather of the
D_p. Each device then runs the local op's backward with g_{p+1} as its final
state's cotangent, which gives dq, dk, dv and the decay gradient exactly (the
local op's final state is P_{p+1}); dS_0 = g_0. Only [B, H, D, E] float32
states (and [B, H] decays, [B] ids) cross devices: no q, k, v or o.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import manual_axes

_HI = jax.lax.Precision.HIGHEST


class Local(NamedTuple):
  """How to run the local pieces (hashable: a nondiff argument of the custom_vjp)."""
  axis: str
  scale: float
  with_final_state: bool
  run_op: object  # (q, k, v, decay, initial_state, segment_ids) -> (o, final_state): the local op
  slice_state: object  # (y, z, decay, starts, reverse) -> [B, H, D, E] float32, the sweep's end state from zeros


def _varies(x, axis) -> bool:
  """Whether x's type varies over `axis` (shard_map's check_vma; never without it)."""
  return axis in manual_axes.varying_axes(x)


def slice_log_decay(decay, num_tokens, batch):
  """[B, H] float32: the slice's summed rates (minus the log of A_p, before segment resets)."""
  if decay is None:
    return None
  if chunk_common.per_token(decay):
    return jnp.sum(decay.astype(jnp.float32), axis=1)
  return jnp.broadcast_to(decay.astype(jnp.float32) * num_tokens, (batch, decay.shape[0]))


def slice_state_jnp(y, z, decay, starts, *, reverse):
  """The state a sweep over y, z ends with from zeros, in jnp: [B, H, Dy, Dz] float32.

  Forward: sum_t exp(-rates after t) y_t^T z_t over the tokens after the last
  segment start. Reverse: sum_t exp(-rates through t) y_t^T z_t over the tokens
  before the first start (token t's own rate takes the state to t).
  """
  b, t, h = y.shape[:3]
  rates = jnp.zeros((b, t, h), jnp.float32)
  if decay is not None:
    rates = jnp.broadcast_to(decay.astype(jnp.float32), (b, t, h))
  cut = jnp.zeros((b, t), jnp.int32) if starts is None else starts.astype(jnp.int32)
  if reverse:  # through t: inclusive sums from the start
    exponent = jax.lax.cumsum(rates, axis=1)
    blocked = jax.lax.cumsum(cut, axis=1) > 0
  else:  # after t: the sums of t + 1 .. T - 1, not a difference of sums
    after = lambda x: jnp.pad(x[:, 1:], [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    exponent = jax.lax.cumsum(after(rates), axis=1, reverse=True)
    blocked = jax.lax.cumsum(after(cut), axis=1, reverse=True) > 0
  weight = jnp.where(blocked[..., None], 0.0, jnp.exp(-exponent))
  return jnp.einsum("bthd,bthe->bhde", y.astype(jnp.float32) * weight[..., None], z.astype(jnp.float32),
                    precision=_HI)


def _gather(axis, *parts):
  """One all-gather of several arrays (floats and int32 ids, bitcast) along a new leading axis."""
  flat = [jax.lax.bitcast_convert_type(x, jnp.float32) if x.dtype == jnp.int32 else x.astype(jnp.float32)
          for x in parts]
  gathered = manual_axes.all_gather_invariant(jnp.concatenate([x.reshape(-1) for x in flat]), axis)
  out, offset = [], 0
  for x in parts:
    piece = gathered[:, offset:offset + x.size].reshape((-1,) + x.shape)
    out.append(jax.lax.bitcast_convert_type(piece, jnp.int32) if x.dtype == jnp.int32 else piece)
    offset += x.size
  return out


class Links(NamedTuple):
  """How the slices connect (gathered, the same on every device)."""
  log_decay: jax.Array | None  # [B, H, P] summed rates of each slice
  resets: jax.Array | None  # [B, P] bool: a segment starts in the slice (nothing before it passes)
  continues: jax.Array | None  # [B, P] bool: the slice's first token continues the previous slice's segment


def links(axis, log_decay, segment_ids, starts, states):
  """All-gathers this device's `states` with what connects the slices; returns (gathered states, Links)."""
  parts = [states]
  if log_decay is not None:
    parts.append(log_decay)
  if segment_ids is not None:
    ids = segment_ids.astype(jnp.int32)
    parts += [ids[:, 0], ids[:, -1], jnp.any(starts, axis=1).astype(jnp.int32)]
  gathered = _gather(axis, *parts)
  gathered_states, rest = gathered[0], gathered[1:]
  log_decay_p = jnp.moveaxis(rest.pop(0), 0, -1) if log_decay is not None else None
  resets = continues = None
  if segment_ids is not None:
    first, last, inner = (x.T for x in rest)  # [B, P]
    continues = jnp.pad(first[:, 1:] == last[:, :-1], ((0, 0), (1, 0)), constant_values=True)
    resets = (inner > 0) | ~continues
  return gathered_states, Links(log_decay_p, resets, continues)


def _combine(local_states, slice_links, initial_state, *, reverse):
  """combine_slice_states over the devices' slices ([P, B, H, D, E] local states), in or against device order.

  Returns [B, H, P + 1, D, E]: forward, the state before each slice and after
  the last; reverse, indexed by device, entry p the cotangent of the state
  before slice p (entry P: dS_final).
  """
  num_devices = local_states.shape[0]
  local = jnp.moveaxis(local_states, 0, 2)
  log_decay, resets = slice_links.log_decay, slice_links.resets
  flip = (lambda x: None if x is None else jnp.flip(x, axis=-1)) if reverse else (lambda x: x)  # noqa: E731
  if reverse:
    local = jnp.flip(local, axis=2)
  states, _ = chunk_common.combine_slice_states(local, (1,) * num_devices, initial_state=initial_state,
                                                slice_decay=flip(log_decay), slice_resets=flip(resets))
  return jnp.flip(states, axis=2) if reverse else states


def _mine(x, p, axis):
  return jax.lax.dynamic_index_in_dim(x, p, axis=axis, keepdims=False)


def _forward_parts(local: Local, q, k, v, decay, initial_state, segment_ids):
  b, t = q.shape[:2]
  p = jax.lax.axis_index(local.axis)
  starts = None if segment_ids is None else chunk_common.segment_starts(segment_ids)
  own = local.slice_state(k, v, decay, starts, False)
  log_decay = slice_log_decay(decay, t, b)
  gathered, slice_links = links(local.axis, log_decay, segment_ids, starts, own)
  states = _combine(gathered, slice_links, initial_state, reverse=False)
  prefix = _mine(states, p, axis=2)
  if slice_links.continues is not None:
    prefix = jnp.where(_mine(slice_links.continues, p, axis=1)[:, None, None, None], prefix, 0.0)
  return prefix, states[:, :, -1], slice_links, p, starts


def _primal(local: Local, q, k, v, decay, initial_state, segment_ids):
  prefix, final_state, *_ = _forward_parts(local, q, k, v, decay, initial_state, segment_ids)
  o, _ = local.run_op(q, k, v, decay, prefix, segment_ids)
  return (o, final_state) if local.with_final_state else o


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def sequence_parallel(local: Local, q, k, v, decay, initial_state, segment_ids):
  """The op on this device's slice of T, inside `shard_map` over `local.axis` (module docstring).

  q, k: [B, T_p, H, D]; v: [B, T_p, H, E]; decay: None, [H] or per-token
  [B, T_p, H] float32; initial_state: [B, H, D, E] float32 or None (the state
  before device 0's slice); segment_ids: int [B, T_p] or None (global ids: a
  segment may span devices). Returns o [B, T_p, H, E], and with
  `local.with_final_state` the state after the last device's slice [B, H, D,
  E] float32, the same on every device.
  """
  return _primal(local, q, k, v, decay, initial_state, segment_ids)


class _Needs(NamedTuple):
  """Which inputs the caller differentiates (the others get no sweep, no tangent, no exchange)."""
  q: bool
  k: bool
  v: bool
  decay: bool
  initial_state: bool

  @property
  def op_inputs(self) -> list[str]:
    """The local op's differentiated inputs (the prefix is not: its cotangent travels as the g_p)."""
    return [name for name in ("q", "k", "v", "decay") if getattr(self, name)]

  @property
  def state_grads(self) -> bool:
    """Whether anything needs the state cotangents g_p (every gradient but dq's)."""
    return self.k or self.v or self.decay or self.initial_state


def _fwd(local: Local, q, k, v, decay, initial_state, segment_ids):
  # With symbolic_zeros the primals say whether each one is differentiated: the
  # local op's vjp is then taken over those alone, so that a fixed decay (the
  # usual ALiBi slopes) costs no tangent and the prefix no initial-state sweep.
  perturbed = lambda x: x is not None and x.perturbed  # noqa: E731
  needs = _Needs(*(perturbed(x) for x in (q, k, v, decay, initial_state)))
  q, k, v, decay, initial_state, segment_ids = (
      None if x is None else x.value for x in (q, k, v, decay, initial_state, segment_ids))
  prefix, final_state, slice_links, p, starts = _forward_parts(local, q, k, v, decay, initial_state, segment_ids)
  primals = dict(q=q, k=k, v=v, decay=decay)

  def op(*args):
    return local.run_op(**{**primals, **dict(zip(needs.op_inputs, args))}, initial_state=prefix,
                        segment_ids=segment_ids)

  o, op_vjp = jax.vjp(op, *(primals[name] for name in needs.op_inputs))
  out = (o[0], final_state) if local.with_final_state else o[0]
  # Without state cotangents the local op's final state gets a zero one, typed like it.
  zero_final = None if needs.state_grads else manual_axes.zeros_of(jax.typeof(o[1]))
  return out, (op_vjp, needs, slice_links, p, q, decay, initial_state, starts, zero_final)


def _bwd(local: Local, residuals, cotangents):
  op_vjp, needs, slice_links, p, q, decay, initial_state, starts, after_mine = residuals
  do, d_final = cotangents if local.with_final_state else (cotangents, None)
  if isinstance(do, SymbolicZero):
    do = manual_axes.zeros_of(do.aval)  # only the final state is used downstream
  if isinstance(d_final, SymbolicZero):
    d_final = None
  axis = local.axis
  typed = _varies(q, axis)  # False: shard_map without check_vma (q, sharded over the axis, varies)
  if d_final is not None and (not typed or _varies(d_final, axis)):
    # Every device returned the same final state: its cotangent is the sum of theirs.
    d_final = jax.lax.psum(d_final, axis)
  state_grads = None
  if needs.state_grads:
    own = local.scale * local.slice_state(q, do, decay, starts, True)
    if slice_links.continues is not None:
      own = jnp.where(_mine(slice_links.continues, p, axis=1)[:, None, None, None], own, 0.0)
    (gathered,) = _gather(axis, own)
    state_grads = _combine(gathered, slice_links, d_final, reverse=True)
    after_mine = _mine(state_grads, p + 1, axis=2)
  # dq does not depend on the state cotangents: without them the local op's
  # backward runs the dq sweep alone.
  grads = dict(zip(needs.op_inputs, op_vjp((do, after_mine))))
  d_initial = None
  if needs.initial_state:
    d_initial = state_grads[:, :, 0]
    if not typed or _varies(initial_state, axis):
      # shard_map sums the cotangents of an input not typed as replicated: device 0's counts.
      d_initial = jnp.where(p == 0, d_initial, 0.0)
    d_initial = d_initial.astype(initial_state.dtype)
  # (A rate replicated over the axis gets its devices' contributions summed by
  # the local op's vjp, under check_vma, or by shard_map's transpose, without.)
  return grads.get("q"), grads.get("k"), grads.get("v"), grads.get("decay"), d_initial, None


sequence_parallel.defvjp(_fwd, _bwd, symbolic_zeros=True)
