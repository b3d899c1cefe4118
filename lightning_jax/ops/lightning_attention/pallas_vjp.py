"""`jax.custom_vjp` of the Pallas path: one sweep forward, two (or three) backward.

The forward pass is a Triton sweep, or with `variant="warp_specialized"` the
Mosaic GPU kernel of `mosaic_gpu_forward`; the backward sweeps are Triton's.

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
real arithmetic but loses every digit to cancellation in bfloat16). Residuals
are the inputs: nothing of size O(T D E) is kept. Cotangents nobody asked for
(`symbolic_zeros`) are not computed: a decay that is not differentiated costs
no tangent, unused q or k, v gradients no sweep.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import mosaic_gpu_forward
from lightning_jax.ops.lightning_attention import pallas_triton


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasOptions:
  scale: float
  return_final_state: bool
  variant: str
  config: config_lib.LightningConfig | None
  compute_capability: tuple[int, int] | None
  interpret: bool


def _pad_axis(x, axis, size):
  if x is None or x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _pad_to(x, t, dim):
  """[B, T, H, D] zero-padded to [B, t, H, dim]."""
  return _pad_axis(_pad_axis(x, 1, t), 3, dim)


def sweep(x, y, z, decay, initial_state, tangent_with=None, dual_with=None, *, reverse, with_final_state, out_dtype,
          opts: PallasOptions):
  """`pallas_triton.sweep` on unpadded [B, T, H, *] inputs: pads T and the feature dims, runs, slices."""
  t, dim_k, dim_v = x.shape[1], x.shape[-1], z.shape[-1]
  kp, vp = config_lib.padded_dim(dim_k), config_lib.padded_dim(dim_v)
  configs = config_lib.resolve(opts.config, dim_k=kp, dim_v=vp, itemsize=x.dtype.itemsize,
                               compute_capability=opts.compute_capability,
                               job=config_lib.sweep_job(tangent=tangent_with is not None,
                                                        dual=dual_with is not None))
  chunk = (configs.chunk_loop if opts.variant == "chunk_loop" else configs.chunk_output).chunk_size
  tp = math.ceil(t / chunk) * chunk
  x, y = (_pad_to(a, tp, kp) for a in (x, y))
  z, tangent_with, dual_with = (_pad_to(a, tp, vp) for a in (z, tangent_with, dual_with))
  initial_state = _pad_axis(_pad_axis(initial_state, 2, kp), 3, vp)
  out, dual, final_state, row_dots, final_tangent = pallas_triton.sweep(
      x, y, z, decay, initial_state, tangent_with, dual_with, scale=opts.scale, seq_len=t, reverse=reverse,
      with_final_state=with_final_state, variant=opts.variant, configs=configs, out_dtype=out_dtype,
      interpret=opts.interpret)
  unpad_state = lambda s: None if s is None else s[:, :, :dim_k, :dim_v]  # noqa: E731
  row_dots = None if row_dots is None else row_dots[:, :, :t]
  dual = None if dual is None else dual[:, :t, :, :dim_k]
  return out[:, :t, :, :dim_v], dual, unpad_state(final_state), row_dots, unpad_state(final_tangent)


class Needs(NamedTuple):
  """Which cotangents the caller differentiates (the others are symbolic zeros)."""
  dq: bool
  dk: bool
  dv: bool
  d_decay: bool
  d_initial: bool


def warp_specialized_forward(q, k, v, decay, initial_state, opts: PallasOptions):
  """`mosaic_gpu_forward.forward` on unpadded [B, T, H, *] inputs: (o, the final state or None)."""
  t, dim_k, dim_v = q.shape[1], q.shape[-1], v.shape[-1]
  kp, vp = mosaic_gpu_forward.padded_dims(dim_k, dim_v)
  cfg = config_lib.resolve_warp_specialized(opts.config, dim_k=kp, itemsize=q.dtype.itemsize)
  tp = math.ceil(t / cfg.CHUNK_SIZE) * cfg.CHUNK_SIZE
  # The kernel carries the state transposed, S^T [V, K].
  if initial_state is not None:
    initial_state = jnp.swapaxes(_pad_axis(_pad_axis(initial_state, 2, kp), 3, vp), -1, -2)
  result = mosaic_gpu_forward.forward(
      _pad_to(q, tp, kp), _pad_to(k, tp, kp), _pad_to(v, tp, vp), decay, initial_state, scale=opts.scale,
      seq_len=t, return_final_state=opts.return_final_state, num_stages=cfg.num_stages, interpret=opts.interpret)
  o, final_state = result if opts.return_final_state else (result, None)
  if final_state is not None:
    final_state = jnp.swapaxes(final_state, -1, -2)[:, :, :dim_k, :dim_v]
  return o[:, :t, :, :dim_v], final_state


def _primal(q, k, v, decay, initial_state, opts):
  if opts.variant == "warp_specialized":
    o, final_state = warp_specialized_forward(q, k, v, decay, initial_state, opts)
  else:
    o, _, final_state, _, _ = sweep(q, k, v, decay, initial_state, reverse=False,
                                    with_final_state=opts.return_final_state, out_dtype=q.dtype, opts=opts)
  return (o, final_state) if opts.return_final_state else o


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def lightning_attention_pallas(q, k, v, decay, initial_state, opts: PallasOptions):
  """q, k: [B, T, H, D], v: [B, T, H, E], decay: [H] float32 or None, initial_state float32 or None."""
  return _primal(q, k, v, decay, initial_state, opts)


def _forward(q, k, v, decay, initial_state, opts):
  # With symbolic_zeros the primals arrive wrapped, saying whether each one is
  # differentiated: a fixed decay (the usual ALiBi slopes) skips the tangent.
  perturbed = lambda x: x is not None and x.perturbed  # noqa: E731
  needs = Needs(dq=perturbed(q), dk=perturbed(k), dv=perturbed(v), d_decay=perturbed(decay),
                d_initial=perturbed(initial_state))
  q, k, v, decay, initial_state = (None if x is None else x.value for x in (q, k, v, decay, initial_state))
  return _primal(q, k, v, decay, initial_state, opts), (q, k, v, decay, initial_state, needs)


def _backward(opts, residuals, cotangents):
  q, k, v, decay, initial_state, needs = residuals
  if opts.variant == "warp_specialized":  # a forward kernel only: the backward sweeps are chunk_loop's
    opts = dataclasses.replace(opts, variant="chunk_loop")
  do, d_final = cotangents if opts.return_final_state else (cotangents, None)
  if isinstance(d_final, SymbolicZero):
    d_final = None
  if isinstance(do, SymbolicZero):
    do = jnp.zeros(do.shape, q.dtype)  # only the final state is used downstream
  scale = opts.scale
  transpose = lambda s: None if s is None else jnp.swapaxes(s, -1, -2)  # noqa: E731
  d_final_scaled = None if d_final is None else d_final / scale
  with_tangent = needs.d_decay and decay is not None

  dq = d_decay = d_initial = dk = dv = None
  if needs.dq or with_tangent:
    # The dq sweep carries S^T; for the decay gradient it also carries
    # U^T = -dS^T/dlambda and reduces q_t . (scale do_t U_t^T) per token.
    dq, _, _, q_dq_tangent, final_tangent = sweep(do, v, k, decay, transpose(initial_state),
                                                  q if with_tangent else None, reverse=False,
                                                  with_final_state=with_tangent and d_final is not None,
                                                  out_dtype=q.dtype, opts=opts)
    if with_tangent:
      d_decay = -jnp.sum(q_dq_tangent, axis=(0, 2))
      if d_final is not None:
        d_decay = d_decay - jnp.sum(d_final * transpose(final_tangent), axis=(0, 2, 3))
  # Reverse sweeps over G (the state gradient): dv = k G + ..., and
  # dk = v G^T + ..., the dv sweep's dual output or a sweep of its own (see
  # `config.fuse_dk_dv`). The state the dv sweep ends with gives d initial_state.
  fuse = needs.dk and config_lib.fuse_dk_dv(dim_k=config_lib.padded_dim(q.shape[-1]),
                                            dim_v=config_lib.padded_dim(v.shape[-1]))
  with_initial = needs.d_initial and initial_state is not None
  if needs.dv or with_initial or fuse:
    dv, dk, state_before_start, _, _ = sweep(k, q, do, decay, d_final_scaled, dual_with=v if fuse else None,
                                             reverse=True, with_final_state=with_initial, out_dtype=v.dtype,
                                             opts=opts)
    if with_initial:
      d_initial = scale * state_before_start
  if needs.dk and not fuse:
    dk, _, _, _, _ = sweep(v, do, q, decay, transpose(d_final_scaled), reverse=True, with_final_state=False,
                           out_dtype=k.dtype, opts=opts)
  return dq, dk, dv, d_decay, d_initial


lightning_attention_pallas.defvjp(_forward, _backward, symbolic_zeros=True)
