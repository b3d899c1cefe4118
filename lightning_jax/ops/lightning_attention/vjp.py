"""`jax.custom_vjp` of the Pallas path: one sweep forward, two (or three) backward.

The forward pass is a Triton sweep (`pallas_triton`), or with
`variant="warp_specialized"` the Mosaic GPU kernel of `pallas_mosaic_gpu`; the
backward sweeps are Triton's, but after a warp-specialised forward where no
per-head rate takes a gradient: then the dq sweep runs that kernel too, and at
D > 64 so do the dv and dk sweeps, walked last chunk first (per-token rates'
gradient from the row dots of the dq and dv sweeps).

With q' = scale * q, a = exp(-lambda) and G_t = dL/dS_t (the state gradient,
G_t = a G_{t+1} + q'_t^T do_t, G_{T-1} also receiving the final-state cotangent),
written with the intra-chunk terms left out,

    dq_t = scale * do_t S_t^T      forward sweep (x=do, y=v, z=k, S_0^T)
    dv_t = k_t G_t                 reverse sweep (x=k, y=q, z=do, dS_T / scale), and
    dk_t = v_t G_t^T               its dual output (u=v), from the same G, or for
                                   large head dims a reverse sweep of its own
                                   (x=v, y=do, z=q, dS_T^T / scale)
    d initial_state = a G_0        the state the dv sweep ends with, times scale

The decay gradient is taken in forward mode inside the dq sweep, which already
walks S_t: with U_t = -dS_t/dlambda carried beside S_t (see `chunk_common`),

    dL/dlambda = -( sum_t q_t . (scale do_t U_t^T) + <dS_T, U_T> ).

All of U's terms carry non-negative distance weights, so no large terms cancel
(a reverse-mode reduction such as sum_t t (q_t . dq_t - k_t . dk_t) is exact in
real arithmetic but loses every digit to cancellation in bfloat16).

Per-token rates need one gradient per token, which forward mode cannot give.
With B_t the rates summed from the start of t's segment, o_t weighs token j by
exp(-(B_t - B_j)), so, with float32 row dots from the sweeps,

    dL/dB_t = k_t . dk_t - q_t . dq_t  (- <dS_T, S_T> at the last token),
    dL/dr_s = sum_{t >= s in s's segment} dL/dB_t   (0 where s starts a segment),

as flash-linear-attention's simple GLA does. k_t . dk_t equals v_t . dv_t
(both are k_t G_t v_t^T plus the same intra-chunk sum), which the fused dk/dv
sweep reduces from the v it already loads; otherwise the dk sweep reduces
k_t . dk_t, and the dq sweep q_t . dq_t, each loading one more [C, block]
tile. Residuals are the inputs (and the final state, for that last term):
nothing of size O(T D E) is kept, but where a sequence split runs the sweeps
(few batch-head pairs): the dq sweep's first pass over the states of (v, k)
is the forward's over (k, v) transposed, which the forward keeps for it
([B, H, slices, D, E] float32), and the dk sweep's is the dv sweep's. (Where
the kernels are partitioned over devices, `auto_sharding`, the forward keeps
nothing and the dq sweep issues the forward's pass again, which XLA's CSE may
merge.) Cotangents
nobody asked for (`symbolic_zeros`) are not computed: a decay that is not
differentiated costs no tangent, unused q or k, v gradients no sweep.

The backward is first-order only: its kernels have no derivative rules, so a
derivative of the gradients (grad of grad, `jax.hessian`, jvp of grad) is
refused with a `TypeError` naming `impl="xla"`, which has them
(`first_order_only`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import manual_axes
from lightning_jax.ops.lightning_attention import packing as packing_lib
from lightning_jax.ops.lightning_attention import pallas_mosaic_gpu
from lightning_jax.ops.lightning_attention import pallas_triton
from lightning_jax.ops.lightning_attention.config import PallasOptions
from lightning_jax.ops.lightning_attention.pallas_triton import SweepOperands


class Needs(NamedTuple):
  """Which cotangents the caller differentiates (the others are symbolic zeros)."""
  dq: bool
  dk: bool
  dv: bool
  d_decay: bool
  d_initial: bool


def sequence_bounds(packing):
  """The [N + 1] int32 sequence bounds of `packing` (see `lightning_attention_pallas`), or None (segment starts,
  or no packing)."""
  return packing if packing is not None and packing.ndim == 1 else None


def sweep_gates(decay, packing):
  """The SweepOperands fields of the decay (per-head or per-token rates) and the packing."""
  if sequence_bounds(packing) is not None:
    return dict(token_decay=decay, sequence_bounds=packing)
  if chunk_common.per_token(decay):
    return dict(token_decay=decay, segment_starts=packing)
  return dict(decay=decay, segment_starts=packing)


def forward(q, k, v, decay, packing, initial_state, opts):
  """(the op's outputs, the forward's `pallas_triton.SliceStarts` or None): the second is the dq sweep's first
  pass, transposed, where the sequence was split."""
  if opts.variant == "warp_specialized":
    if sequence_bounds(packing) is not None:
      raise ValueError("sequence programs (per-sequence states) run the chunk loop, not the warp-specialised kernel")
    res = pallas_mosaic_gpu.forward(q, k, v, decay, initial_state, opts, packing)
  else:
    res = pallas_triton.sweep(SweepOperands(**sweep_gates(decay, packing), x=q, y=k, z=v,
                                            initial_state=initial_state),
                              reverse=False, with_final_state=opts.return_final_state, out_dtype=q.dtype, opts=opts)
  o, final_state, starts = res.out, res.final_state, res.slice_starts
  return ((o, final_state) if opts.return_final_state else o), starts


def _primal(q, k, v, decay, packing, initial_state, opts):
  return forward(q, k, v, decay, packing, initial_state, opts)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def lightning_attention_pallas(q, k, v, decay, packing, initial_state, opts: PallasOptions):
  """q, k: [B, T, H, D], v: [B, T, H, E]; decay: [H] or (per-token) [B, T, H] float32 or None;
  segment_starts: [B, T] bool or None (`chunk_common.segment_starts`), or sequence bounds [N + 1] int32
  (`cu_seqlens`, B = 1: one chunk-loop program per sequence, with per-token rates or none, and
  states per sequence, [N, H, D, E]);
  initial_state: [B, H, D, E] float32 or None."""
  return _primal(q, k, v, decay, packing, initial_state, opts)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _refuse_derivatives(op, *arrays):
  return arrays


@_refuse_derivatives.defjvp
def _refuse_derivatives_jvp(op, primals, tangents):
  del primals, tangents
  raise TypeError(f"{op} with impl='pallas' is differentiable once: its backward's kernels have no derivatives "
                  "(grad of grad, jax.hessian, jvp of grad); impl='xla' (chunked jnp) has them")


def first_order_only(op: str, tree):
  """tree (the inputs of a Pallas forward's or backward's kernels under `jax.custom_vjp`) as it is, but a derivative
  through it, which the kernels cannot give, raises a `TypeError` naming `op` and impl="xla" (instead of JAX's
  linearization failure deep in a kernel). A derivative of the gradients reaches the custom VJP's forward rule
  (through the inputs) or its backward (through the cotangents alone). The arrays pass through one identity with a
  custom JVP that raises: the first-order path is unchanged, and zero tangents never call it."""
  leaves, treedef = jax.tree.flatten(tree)
  arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
  for i, x in zip(arrays, _refuse_derivatives(op, *(leaves[i] for i in arrays))):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def _forward(q, k, v, decay, packing, initial_state, opts):
  # With symbolic_zeros the primals arrive wrapped, saying whether each one is
  # differentiated: a fixed decay (the usual ALiBi slopes) skips the tangent.
  perturbed = lambda x: x is not None and x.perturbed  # noqa: E731
  needs = Needs(dq=perturbed(q), dk=perturbed(k), dv=perturbed(v), d_decay=perturbed(decay),
                d_initial=perturbed(initial_state))
  q, k, v, decay, packing, initial_state = first_order_only("lightning_attention", tuple(
      None if x is None else x.value for x in (q, k, v, decay, packing, initial_state)))
  out, slice_starts = forward(q, k, v, decay, packing, initial_state, opts)
  # The per-token decay gradient's last term reads the final state.
  final_state = out[1] if opts.return_final_state and needs.d_decay and chunk_common.per_token(decay) else None
  return out, (q, k, v, decay, packing, initial_state, final_state, dq_sweep_starts(slice_starts, decay, needs),
               needs)


def dq_sweep_starts(slice_starts, decay, needs):
  """The forward's `SliceStarts` where the dq sweep will take them (it runs, and carries no decay tangent)."""
  with_tangent = needs.d_decay and decay is not None and not chunk_common.per_token(decay)
  return slice_starts if needs.dq and not with_tangent else None


def initial_state_factor(decay, bounds=None):
  """What turns the state a reverse sweep ends with into dL/d initial_state (over scale).

  A per-token reverse sweep ends at G_0, which S_0 reached through token 0's
  factor; a per-head one already includes it. With sequence bounds, each
  sequence's first token's ([N, H, 1, 1]; 1 for an empty sequence, whose
  initial state is its final one).
  """
  if not chunk_common.per_token(decay):
    return 1.0
  if bounds is None:
    return jnp.exp(-decay[:, 0])[..., None, None]
  starts, ends = bounds[:-1], bounds[1:]
  first = decay[0, jnp.minimum(starts, decay.shape[1] - 1)]  # [N, H]
  return jnp.where((ends > starts)[:, None], jnp.exp(-first), 1.0)[..., None, None]


def _token_decay_grad(decay, packing, q_dq, k_dk, d_final, final_state, *, with_initial_state):
  """dL/d(per-token rates) [B, T, H] from the row dots q.dq, k.dk [B, H, T] (see the module docstring).

  With sequence bounds, each sequence is a row of its own: its last token takes
  its own final state's term, and its first token's rate scales its initial
  state (a zero one without `with_initial_state`).
  """
  d_cum = k_dk - q_dq
  bounds = sequence_bounds(packing)
  if bounds is None:
    if d_final is not None:
      d_cum = d_cum.at[..., -1].add(-jnp.sum(d_final * final_state, axis=(-2, -1)))
    starts = jnp.zeros(decay.shape[:2], bool) if packing is None else packing
    zero_state = starts
  else:
    t = decay.shape[1]
    starts = packing_lib.sequence_starts(bounds, t)[None]  # [1, T], token 0 included
    if d_final is not None:  # at each non-empty sequence's last token (an empty one's index drops)
      last = jnp.where(bounds[1:] > bounds[:-1], bounds[1:] - 1, t)
      d_cum = d_cum.at[0, :, last].add(-jnp.sum(d_final * final_state, axis=(-2, -1)), mode="drop")
    zero_state = jnp.zeros_like(starts) if with_initial_state else starts
  d_cum = jnp.swapaxes(d_cum, 1, 2)  # [B, T, H]
  # Summed backwards within each segment: a segment ends where the next one starts.
  ends = jnp.pad(starts[:, 1:], ((0, 0), (0, 1)), constant_values=True)
  d_rate = chunk_common.segmented_cumsum(d_cum, ends, axis=1, reverse=True)
  # Rates past the clamp change no factor (chunk_common.MAX_LOG2_RATE); a start's own rate scales a zero state.
  live = (decay * chunk_common.LOG2_E < chunk_common.MAX_LOG2_RATE) & ~zero_state[..., None]
  return jnp.where(live, d_rate, 0.0)


def _backward(opts, residuals, cotangents):
  """The gradients of `_forward`'s residuals and the cotangents (also `auto_sharding`'s backward, which guards its
  own inputs)."""
  q, k, v, decay, packing, initial_state, final_state, slice_starts, needs = residuals
  gates = sweep_gates(decay, packing)
  per_token = chunk_common.per_token(decay)
  warp_specialized = opts.variant == "warp_specialized"
  if warp_specialized:  # a forward kernel: the backward sweeps may run it (`warp_specialized_sweep`), else chunk_loop
    opts = dataclasses.replace(opts, variant="chunk_loop")
  do, d_final = cotangents if opts.return_final_state else (cotangents, None)
  if isinstance(d_final, SymbolicZero):
    d_final = None
  if isinstance(do, SymbolicZero):
    do = jnp.zeros(do.shape, q.dtype)  # only the final state is used downstream
  scale = opts.scale
  transpose = lambda s: None if s is None else jnp.swapaxes(s, -1, -2)  # noqa: E731
  d_final_scaled = None if d_final is None else d_final / scale
  with_tangent = needs.d_decay and decay is not None and not per_token  # forward mode, per-head rate
  token_grad = needs.d_decay and per_token  # reverse mode, per-token rates

  sweep = functools.partial(pallas_triton.sweep, opts=opts)
  dq = d_decay = d_initial = dk = dv = q_dq = k_dk = None

  def warp_specialized_sweep(x, z, *, reverse=False):
    """Whether a sweep over x [B, T, H, K] and z [B, T, H, V] runs the warp-specialised kernel: after its forward,
    with no per-head rate's gradient (per-token rates' come from its row dots), where auto would take it for this K
    as for the forward's
    (`heuristics.prefer_warp_specialized`: at K <= 64 with a per-head rate only as the forward's own choice, K = D;
    with per-token rates or packed rows at every K); reversed (segments or none: the forward ran no sequence
    programs), with per-token rates, or a per-head rate or none and a whole last chunk, no final-state cotangent or
    no decay (`pallas_mosaic_gpu.forward_padded`)."""
    dim = x.shape[-1]
    if (not warp_specialized or with_tangent
        or not (dim == q.shape[-1] or heuristics.prefer_warp_specialized(dim_k=dim,
                                                                         per_token=per_token or packing is not None))
        or heuristics.warp_specialized_unsupported(dim_k=dim, dim_v=z.shape[-1], dtype=q.dtype,
                                                   compute_capability=opts.compute_capability,
                                                   interpret=opts.interpret) is not None):
      return False
    return not reverse or (per_token or d_final is None or decay is None
                           or q.shape[1] % pallas_mosaic_gpu.CHUNK_SIZE == 0)

  ws_opts = dataclasses.replace(opts, return_final_state=False, variant="warp_specialized")
  if (needs.dq or token_grad) and warp_specialized_sweep(do, k):
    # The dq sweep is a forward over (do, v, k): where the forward ran the warp-specialised kernel, so does dq
    # (PERFORMANCE.md, "Warp-specialised forward (sm90)"), from the forward's slices transposed; per-token rates'
    # gradient takes its row dots q . dq.
    res = pallas_mosaic_gpu.forward(do, v, k, decay, transpose(initial_state), ws_opts, packing,
                                    given_starts=None if slice_starts is None else slice_starts.transposed(),
                                    transposed_states=True, dot_with=q if token_grad else None)
    dq, q_dq = res.out, res.row_dots
  elif needs.dq or with_tangent or token_grad:
    # The dq sweep carries S^T; for the decay gradient it also carries
    # U^T = -dS^T/dlambda and reduces q_t . (scale do_t U_t^T) per token, or
    # for per-token rates reduces q_t . dq_t.
    res = sweep(SweepOperands(**gates, x=do, y=v, z=k, initial_state=transpose(initial_state),
                              tangent_with=q if with_tangent else None, dot_with=q if token_grad else None),
                reverse=False, with_final_state=with_tangent and d_final is not None, out_dtype=q.dtype,
                given_starts=None if slice_starts is None else slice_starts.transposed(), transposed_states=True)
    dq = res.out
    if token_grad:
      q_dq = res.row_dots
    if with_tangent:
      d_decay = -jnp.sum(res.row_dots, axis=(0, 2))
      if d_final is not None:
        d_decay = d_decay - jnp.sum(d_final * transpose(res.final_tangent), axis=(0, 2, 3))
  # Reverse sweeps over G (the state gradient): dv = k G + ..., and
  # dk = v G^T + ..., the dv sweep's dual output or a sweep of its own (see
  # `heuristics.fuse_dk_dv`). The state the dv sweep ends with gives d initial_state.
  # With per-token rates, the fused sweep's float32 row dots v . dv give k . dk.
  dv_starts = None
  fuse = needs.dk and heuristics.fuse_dk_dv(dim_k=config_lib.padded_dim(q.shape[-1]),
                                            dim_v=config_lib.padded_dim(v.shape[-1]))
  with_initial = needs.d_initial and initial_state is not None
  # Unfused (D > 64), the reverse sweeps are forwards walked last chunk first: the warp-specialised kernel's where
  # it can (`warp_specialized_sweep`); the dv sweep's row dots v . dv give k . dk.
  ws_reverse = not fuse and warp_specialized_sweep(k, do, reverse=True) and warp_specialized_sweep(v, q, reverse=True)
  g0 = None  # the state the dv sweep ends with
  if ws_reverse and (needs.dv or with_initial or token_grad):
    res = pallas_mosaic_gpu.forward(
        k, q, do, decay, d_final_scaled, dataclasses.replace(ws_opts, return_final_state=with_initial), packing,
        reverse=True, dot_with=v if token_grad else None)
    dv, g0, dv_starts, k_dk = res.out, res.final_state, res.slice_starts, res.row_dots
  elif needs.dv or with_initial or fuse:
    res = sweep(SweepOperands(**gates, x=k, y=q, z=do, initial_state=d_final_scaled,
                              dual_with=v if fuse else None),
                reverse=True, with_final_state=with_initial, out_dtype=v.dtype, dots_with_dual=fuse and token_grad)
    dv, dk, k_dk = res.out, res.dual, res.row_dots  # row dots only with per-token rates: v . dv = k . dk
    dv_starts, g0 = res.slice_starts, res.final_state
  if with_initial:
    d_initial = scale * initial_state_factor(decay, sequence_bounds(packing)) * g0
  if ws_reverse and needs.dk:
    dk = pallas_mosaic_gpu.forward(v, do, q, decay, transpose(d_final_scaled), ws_opts, packing,
                                   given_starts=None if dv_starts is None else dv_starts.transposed(),
                                   transposed_states=True, reverse=True).out
  elif (needs.dk and not fuse) or (token_grad and k_dk is None):
    res = sweep(SweepOperands(**gates, x=v, y=do, z=q, initial_state=transpose(d_final_scaled),
                              dot_with=k if token_grad else None),
                reverse=True, with_final_state=False, out_dtype=k.dtype,
                given_starts=None if dv_starts is None else dv_starts.transposed())
    dk, k_dk = res.out, res.row_dots
  if token_grad:
    d_decay = _token_decay_grad(decay, packing, q_dq, k_dk, d_final, final_state,
                                with_initial_state=initial_state is not None)
  # Inside shard_map, a replicated decay or initial state collects every device's share.
  return (dq, dk, dv, manual_axes.sum_to_type_of(d_decay, decay), None,
          manual_axes.sum_to_type_of(d_initial, initial_state))


def _first_order_backward(opts, residuals, cotangents):
  return _backward(opts, *first_order_only("lightning_attention", (residuals, cotangents)))


lightning_attention_pallas.defvjp(_forward, _first_order_backward, symbolic_zeros=True)
