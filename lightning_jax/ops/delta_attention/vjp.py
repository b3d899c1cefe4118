"""`jax.custom_vjp` of the Pallas path: the Triton forward; a backward of two Triton sweeps around jnp chunk algebra.

Residuals are the inputs: nothing of size O(T D E) is kept. The backward
recomputes every chunk's S-independent terms (`chunk.chunk_terms`, in jnp,
all chunks at once) and, per chunk n with S_n the state before it,

    U = U_v - W S_n,   O = Q_g S_n + P U,   S_{n+1} = Diag(a_n) S_n + K_C^T U.

With G_n = dL/dS_{n+1}, a reverse sweep gives dU = P^T dO + K_C G_n and
dL/dS_n = Diag(a_n) G_n + Q_g^T dO - W^T dU; the two serial passes (the
states S_n, then the G_n) are Triton kernels (`pallas_triton.chunk_states`,
`state_cotangents`). The terms' cotangents then follow for all chunks at once,

    dW = -dU S_n^T,  dU_v = dU,  dQ_g = dO S_n^T,  dP = dO U^T,
    dK_C = U G_n^T,  da_n = sum_e G_n * S_n,

and the vjp of `chunk_terms` carries them to q, k, v, beta and the decay.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lightning_jax.ops.delta_attention import chunk
from lightning_jax.ops.delta_attention import pallas_triton
from lightning_jax.ops.delta_attention import xla

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasOptions:
  """The static options of the Pallas path: the op's scale, whether the final state is returned, the blocks."""
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
  c = opts.config.chunk_size
  terms_of = lambda q, k, v, beta, decay: xla.prepare(q, k, v, beta, decay, segment_starts, scale=opts.scale,  # noqa: E731
                                                      chunk_size=c)[0]
  terms, pullback = jax.vjp(terms_of, q, k, v, beta, decay)
  kernels = dict(dtype=q.dtype, config=opts.config, interpret=opts.interpret)
  states = pallas_triton.chunk_states(terms, initial_state, **kernels)  # S_n [B, H, N, D, E]
  do = xla.to_chunks(do, terms.w.shape[2], c)  # [B, H, N, C, E] float32
  d_next, d_initial = pallas_triton.state_cotangents(terms, do, d_final, **kernels)  # G_n, dL/dS_0
  mm = lambda spec, x, y: jnp.einsum(spec, x, y, precision=_HI)  # noqa: E731
  u = terms.u - mm("...cd,...de->...ce", terms.w, states)
  du = mm("...ts,...te->...se", terms.p, do) + mm("...cd,...de->...ce", terms.k_end, d_next)
  d_terms = chunk.ChunkTerms(
      w=-mm("...ce,...de->...cd", du, states), u=du, q_gated=mm("...ce,...de->...cd", do, states),
      p=mm("...te,...se->...ts", do, u), k_end=mm("...ce,...de->...cd", u, d_next),
      state_decay=jnp.sum(d_next * states, axis=-1))
  dq, dk, dv, d_beta, d_decay = pullback(d_terms)
  return dq, dk, dv, d_beta, d_decay, None, None if initial_state is None else d_initial


delta_attention_pallas.defvjp(_forward, _backward)
