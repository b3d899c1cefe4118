"""The delta rule's forward on sm90: the Triton prepare kernel, then the warp-specialised sweep.

The prepare kernel (`pallas_triton.prepare`) writes every chunk's W and U_v;
the Mosaic GPU kernel of `lightning_attention.pallas_mosaic_gpu`, in its delta
mode, walks the 64-token chunks with three warpgroups: the memory warpgroup
loads q, k, W and U_v ahead, the state warpgroup computes each of the
prepare's chunks' U = U_v - W S and S <- a S + K_C^T U, and the output
warpgroup O = scale (Q_g S_n + P U) from the U it publishes. So the output
products leave the serial chain, which the Triton sweep's one instruction
stream cannot do. The backward stays on the Triton kernels, which recompute.
"""

from __future__ import annotations

import jax.numpy as jnp

from lightning_jax.ops.delta_attention import pallas_triton
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import config as lightning_config
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import pallas_mosaic_gpu
from lightning_jax.ops.lightning_attention.config import WarpSpecializedConfig

CHUNK_SIZE = WarpSpecializedConfig.CHUNK_SIZE


def unsupported(*, dim_k: int, dim_v: int, dtype, per_channel_gate: bool, chunk_size: int, compute_capability,
                interpret: bool) -> str | None:
  """Why the warp-specialised forward cannot run a call (None if it can); dims are the unpadded D and E."""
  if per_channel_gate:
    return "takes a scalar decay per token or none (KDA's per-key-channel gates are not in its chain)"
  if CHUNK_SIZE % chunk_size or chunk_size < 16:
    return f"needs DeltaConfig.chunk_size to divide {CHUNK_SIZE} (16, 32 or 64), got {chunk_size}"
  return heuristics.warp_specialized_unsupported(dim_k=dim_k, dim_v=dim_v, dtype=dtype,
                                                 compute_capability=compute_capability, interpret=interpret)


def forward(q, k, v, beta, decay, segment_starts, initial_state, *, scale, with_final_state,
            config: pallas_triton.DeltaConfig, interpret):
  """`pallas_triton.forward`'s contract (same arguments and results) on the warp-specialised sweep.

  q, k: [B, T, H, D]; v: [B, T, H, E] bf16 or fp16; beta: [B, T, H]
  float32; decay: None or [B, T, H] float32 rates; segment_starts: [B, T]
  bool or None; initial_state: [B, H, D, E] float32 or None. T is padded to
  whole 64-token chunks (zero beta and rates: the padding changes no state),
  D to 64 or 128 and E to a power of two >= 64.
  """
  b, t, h, d = q.shape
  e = v.shape[-1]
  tp = -(-t // CHUNK_SIZE) * CHUNK_SIZE
  dp = WarpSpecializedConfig.padded_dims(d, e)[0]
  ep = max(WarpSpecializedConfig.BLOCK_E, lightning_config.padded_dim(e))  # the prepare's Triton blocks
  pad = lambda x, dim: chunk_common.pad_tokens_and_features(x, num_tokens=tp, dim=dim)  # noqa: E731
  pad_tokens = lambda x: jnp.pad(x, ((0, 0), (0, tp - t)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
  beta = pad_tokens(beta)
  decay = None if decay is None else pad_tokens(decay)
  segment_starts = None if segment_starts is None else pad_tokens(segment_starts)
  g = pallas_triton.gate_logs(decay, seq_len=tp, dim_k=dp, chunk_size=config.chunk_size)
  qp, kp, vp, beta_rows, gates_ = pallas_triton.padded_operands(pad(q, dp), pad(k, dp), pad(v, ep), beta,
                                                                segment_starts, g, chunk_size=config.chunk_size)
  w, u, _, _ = pallas_triton.prepare(qp, kp, vp, beta_rows, gates_, scale=scale, config=config, interpret=interpret)
  # The sweep's own gates, of its 64-token chunks.
  cumdecay = runs = None
  if decay is not None or segment_starts is not None:
    cumdecay, runs = chunk_common.token_chunk_gates(decay, segment_starts, chunk_size=CHUNK_SIZE, num_tokens=tp,
                                                    reverse=False)
    runs = None if segment_starts is None else runs
  if initial_state is not None:  # the kernel carries S^T [E, D], one slice
    initial_state = jnp.swapaxes(chunk_common.pad_state(initial_state, dp, ep), -1, -2)[:, :, None]
  cfg = heuristics.resolve_warp_specialized(None, dim_k=dp, itemsize=q.dtype.itemsize, delta=True)
  result = pallas_mosaic_gpu.forward_padded(
      qp, kp, u, None, initial_state, chunk_gates=(cumdecay, runs), w=w, w_chunk_size=config.chunk_size,
      scale=scale, seq_len=t, return_final_state=with_final_state, num_stages=cfg.num_stages, interpret=interpret)
  o, final_state = result if with_final_state else (result, None)
  if final_state is not None:
    final_state = jnp.swapaxes(final_state, -1, -2)[:, :, :d, :e]
  return o[:, :t, :, :e], final_state
