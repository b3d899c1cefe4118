"""`jax.custom_vjp` of the Pallas path: one sweep forward, three sweeps backward.

With q' = scale * q, a = exp(-lambda) and G_t = dL/dS_t (the state gradient,
G_t = a G_{t+1} + q'_t^T do_t, G_{T-1} also receiving the final-state cotangent),

    dq_t = scale * do_t S_t^T                     forward sweep  (x=do, y=v, z=k,  S_0^T)
    dk_t = v_t G_t^T                              reverse sweep  (x=v,  y=do, z=q, dS_T^T / scale)
    dv_t = k_t G_t                                reverse sweep  (x=k,  y=q,  z=do, dS_T / scale)
    d initial_state = a G_0                       the state the dv sweep ends with, times scale

The decay gradient is a reduction of terms these sweeps already hold. Writing
a^(t-j) = exp(b_t - b_j) with b_t = -lambda (t+1), token t enters the loss
through exp(b_t) as a query and through exp(-b_t) as a key, so

    dL/db_t = q_t . dq_t - k_t . dk_t    (+ <dS_T, S_T> for the last token)
    dL/dlambda = -sum_t (t+1) dL/db_t

The row dots q_t . dq_t and k_t . dk_t come out of the dq and dk sweeps in
float32, before the outputs are rounded to the input dtype. Residuals are the
inputs (and the final state, when it has a cotangent and decay is learnable):
nothing of size O(T D E) is kept.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from lightning_jax.ops.lightning_attention import config as config_lib
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


def sweep(x, y, z, decay, initial_state, row_dot_with, *, reverse, out_dtype, opts: PallasOptions):
  """A sweep on unpadded [B, T, H, *] inputs: pads T and the feature dims, runs, slices."""
  t, dim_k, dim_v = x.shape[1], x.shape[-1], z.shape[-1]
  kp, vp = config_lib.padded_dim(dim_k), config_lib.padded_dim(dim_v)
  configs = config_lib.resolve(opts.config, dim_k=kp, dim_v=vp, itemsize=x.dtype.itemsize,
                               compute_capability=opts.compute_capability)
  chunk = (configs.chunk_loop if opts.variant == "chunk_loop" else configs.chunk_output).chunk_size
  tp = math.ceil(t / chunk) * chunk
  x, y = (_pad_axis(_pad_axis(a, 1, tp), 3, kp) for a in (x, y))
  z, row_dot_with = (_pad_axis(_pad_axis(a, 1, tp), 3, vp) for a in (z, row_dot_with))
  initial_state = _pad_axis(_pad_axis(initial_state, 2, kp), 3, vp)
  out, final_state, row_dots = pallas_triton.sweep(
      x, y, z, decay, initial_state, row_dot_with, scale=opts.scale, seq_len=t, reverse=reverse,
      variant=opts.variant, configs=configs, out_dtype=out_dtype, interpret=opts.interpret)
  out = out[:, :t, :, :dim_v]
  final_state = final_state[:, :, :dim_k, :dim_v]
  row_dots = None if row_dots is None else row_dots[:, :, :t]
  return out, final_state, row_dots


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def lightning_attention_pallas(q, k, v, decay, initial_state, opts: PallasOptions):
  """q, k: [B, T, H, D], v: [B, T, H, E], decay: [H] float32 or None, initial_state float32 or None."""
  out, _ = _forward(q, k, v, decay, initial_state, opts)
  return out


def _forward(q, k, v, decay, initial_state, opts):
  o, final_state, _ = sweep(q, k, v, decay, initial_state, None, reverse=False, out_dtype=q.dtype, opts=opts)
  keep_final = opts.return_final_state and decay is not None
  residuals = (q, k, v, decay, initial_state, final_state if keep_final else None)
  return ((o, final_state) if opts.return_final_state else o), residuals


def _backward(opts, residuals, cotangents):
  q, k, v, decay, initial_state, final_state = residuals
  do, d_final = cotangents if opts.return_final_state else (cotangents, None)
  has_decay = decay is not None
  scale = opts.scale
  transpose = lambda s: None if s is None else jnp.swapaxes(s, -1, -2)  # noqa: E731
  d_final_scaled = None if d_final is None else d_final / scale

  dq, _, q_dq = sweep(do, v, k, decay, transpose(initial_state), q if has_decay else None,
                      reverse=False, out_dtype=q.dtype, opts=opts)
  dk, _, k_dk = sweep(v, do, q, decay, transpose(d_final_scaled), k if has_decay else None,
                      reverse=True, out_dtype=k.dtype, opts=opts)
  dv, state_before_start, _ = sweep(k, q, do, decay, d_final_scaled, None,
                                    reverse=True, out_dtype=v.dtype, opts=opts)
  d_initial = None if initial_state is None else scale * state_before_start
  d_decay = None
  if has_decay:
    t = q.shape[1]
    position = jnp.arange(1, t + 1, dtype=jnp.float32)
    d_b = q_dq - k_dk  # [B, H, T]
    d_decay = -jnp.einsum("bht,t->h", d_b, position, precision=jax.lax.Precision.HIGHEST)
    if d_final is not None:
      d_decay = d_decay - t * jnp.sum(d_final * final_state, axis=(0, 2, 3))
  return dq, dk, dv, d_decay, d_initial


lightning_attention_pallas.defvjp(_forward, _backward)
