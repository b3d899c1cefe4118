"""`jax.custom_vjp` of the Pallas path: the Triton forward, and for now the chunked jnp path's vjp backward.

The backward recomputes from the inputs (the residuals; nothing of size
O(T D E) is kept) and differentiates the chunked jnp algebra (`xla`), which
has the same chunk structure as the kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from lightning_jax.ops.delta_attention import pallas_triton
from lightning_jax.ops.delta_attention import xla


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasOptions:
  scale: float
  with_final_state: bool
  config: pallas_triton.DeltaConfig
  interpret: bool


def _primal(q, k, v, beta, decay, segment_starts, initial_state, opts):
  return pallas_triton.forward(q, k, v, beta, decay, segment_starts, initial_state, scale=opts.scale,
                               with_final_state=opts.with_final_state, config=opts.config, interpret=opts.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def delta_attention_pallas(q, k, v, beta, decay, segment_starts, initial_state, opts: PallasOptions):
  """(o [B, T, H, E], final state [B, H, D, E] float32 or None) of validated inputs (see `pallas_triton.forward`)."""
  return _primal(q, k, v, beta, decay, segment_starts, initial_state, opts)


def _forward(q, k, v, beta, decay, segment_starts, initial_state, opts):
  out = _primal(q, k, v, beta, decay, segment_starts, initial_state, opts)
  return out, (q, k, v, beta, decay, segment_starts, initial_state)


def _backward(opts, residuals, cotangents):
  q, k, v, beta, decay, segment_starts, initial_state = residuals
  do, d_final = cotangents

  def chunked(q, k, v, beta, decay, initial_state):
    o, final_state = xla.chunked(q, k, v, beta, decay, segment_starts, initial_state, scale=opts.scale,
                                 chunk_size=opts.config.chunk_size)
    return o.astype(q.dtype), final_state if opts.with_final_state else None

  _, pullback = jax.vjp(chunked, q, k, v, beta, decay, initial_state)
  dq, dk, dv, d_beta, d_decay, d_initial = pullback((do, d_final))
  return dq, dk, dv, d_beta, d_decay, None, d_initial


delta_attention_pallas.defvjp(_forward, _backward)
