"""The delta rule's forward on sm90: the inverse kernel, then the warp-specialised sweep.

The inverse kernel (`delta_mosaic.inverse`) writes every 64-token chunk's
T' = (I + A)^{-1} Diag(beta); the Mosaic GPU kernel of
`lightning_attention.pallas_mosaic_gpu`, in its delta mode, walks the chunks
with three warpgroups: the memory warpgroup loads q, k, v and T ahead, the
state warpgroup computes each chunk's U = T' (V - K_g S) and
S <- a S + K_C^T U, and the output warpgroup O = scale (Q_g S_n + P U) from
the U it publishes. So W and U_v never cross HBM, and the output products
leave the serial chain, which the Triton sweep's one instruction stream
cannot do. The backward's sweeps are warp-specialised too
(`pallas_mosaic_gpu`): they take the inverses this forward formed, T and T'
(`forward(..., with_inverses=True)`, the op's residuals), and, as the output
warpgroup stores them too (`with_states`), each chunk's S_n^T and U^T in place
of their state sweep (`DeltaConfig.forward_states`).
The sequence split's map pass (`piece_maps`) runs the chain alone, twice a CTA.

KDA's per-key-channel gates (`_channel_gated`): `delta_mosaic.channel_gated_chunks`
forms each chunk's T', P, Q_g, K_g and K_C, and the chain takes them
pre-gated (its `channel_gated` mode: the state decayed per key channel). The
backward (`pallas_triton._channel_gated_backward`, on the warp-specialised
sweeps in the same mode) takes those chunk terms with T and G and the S_n^T
and U^T the output warpgroup stores (`with_chunk_terms`), or forms them
again; packed rows drop the chunk terms' pairs and rows that reach past a
segment's ends; the split's map pass is the Triton sweep's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lightning_jax.ops.delta_attention import pallas_mosaic_gpu as delta_mosaic
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import pallas_mosaic_gpu
from lightning_jax.ops.lightning_attention.config import WarpSpecializedConfig

CHUNK_SIZE = WarpSpecializedConfig.CHUNK_SIZE


def beta_rows(beta, *, tp):
  """beta [B, T, H] as the inverse kernel's rows [B, H, Tp], zero past T (the padding changes no state). The rates
  and segment starts need no padding here: `pallas_mosaic_gpu.sweep_gates` pads them."""
  return jnp.pad(jnp.moveaxis(beta, 2, 1), ((0, 0), (0, 0), (0, tp - beta.shape[1])))


def walked_rows(t: int) -> tuple[int, int]:
  """(the rows q, k, v and the rates go to the kernels with, Tp = T in whole 64-token chunks): T itself where TMA
  tiles it (`WarpSpecializedConfig.walked_rows`: no copy of the operands to whole chunks), else Tp."""
  tp = -(-t // CHUNK_SIZE) * CHUNK_SIZE
  return WarpSpecializedConfig.walked_rows(t, tp), tp


def chunk_inverses(k, beta, decay, segment_starts, *, with_unscaled, interpret):
  """Each 64-token chunk's T' = (I + A)^{-1} Diag(beta) [B, H, Tp, 64] in k's dtype, with_unscaled as (T, T')
  (`delta_mosaic.inverse`): what `forward` forms, for a caller that runs it more than once on the same k, beta
  and gates (`sequence_split`). Arguments as `forward`'s."""
  rows, tp = walked_rows(k.shape[1])
  dp = WarpSpecializedConfig.padded_dims(k.shape[-1], k.shape[-1])[0]
  chunk_gates = pallas_mosaic_gpu.sweep_gates(decay, segment_starts, num_tokens=tp)
  return delta_mosaic.inverse(chunk_common.pad_tokens_and_features(k, num_tokens=rows, dim=dp), beta_rows(beta, tp=tp),
                              chunk_gates, with_unscaled=with_unscaled, num_tokens=tp, interpret=interpret)


def segment_runs(segment_starts, *, num_tokens):
  """The segment-start counts [B, Tp] int32 the kernels take (`sweep_gates`' runs), of segment starts [B, T] bool
  (None: None)."""
  return None if segment_starts is None else pallas_mosaic_gpu.sweep_gates(None, segment_starts,
                                                                            num_tokens=num_tokens)[1]


def _kernel_state(initial_state, *, dp, ep, sequences):
  """initial_state [B, H, D, E] (with sequences [S, H, D, E]) float32 or None as the sweep's transposed S^T, one
  slice a row: [B, H, 1, Ep, Dp] (with sequences, one row of S states: [1, H, S, Ep, Dp])."""
  if initial_state is None:
    return None
  state_t = jnp.swapaxes(chunk_common.pad_state(initial_state, dp, ep), -1, -2)
  return jnp.moveaxis(state_t, 0, 1)[None] if sequences is not None else state_t[:, :, None]


def _channel_gated(q, k, v, beta, decay, segment_starts, initial_state, *, scale, with_final_state, interpret,
                   fallback, with_chunk_terms, sequences):
  """`forward` with KDA's per-key-channel rates decay [B, T, H, D]: `delta_mosaic.channel_gated_chunks` forms each
  chunk's T', P, Q_g, K_g and K_C (packed rows: the pairs of one segment alone), and the sweep takes them (packed,
  with the segment-start counts: it drops the rows of Q_g, K_g and K_C that reach past a segment's ends).
  Where some 16-token block decays by more than `delta_mosaic.max_block_span(q.dtype)` (log2 units) on a key
  channel (by the block ends that kernel returns), `fallback` (a callable of `forward`'s arguments) runs instead:
  the chunks' factors would leave the operands' range (a traced choice, `lax.cond`, after that kernel).
  with_chunk_terms: a third result, the chunk terms with their backward terms (`delta_mosaic.ChannelGatedChunks`
  but its block ends, as a tuple) and each chunk's S_n^T [B, H, N, Ep, Dp] and U^T [B, H, Ep, Tp]
  (`delta_states`), zeros where `fallback` runs, then the block ends (from which the backward makes the same
  choice)."""
  t, d, e = q.shape[1], q.shape[-1], v.shape[-1]
  rows, tp = walked_rows(t)
  dp, ep = WarpSpecializedConfig.padded_dims(d, e)
  pad = lambda x, dim: chunk_common.pad_tokens_and_features(x, num_tokens=rows, dim=dim)  # noqa: E731
  runs = segment_runs(segment_starts, num_tokens=tp)
  terms = delta_mosaic.channel_gated_chunks(pad(q, dp), pad(k, dp), beta_rows(beta, tp=tp),
                                            pad(decay, dp).astype(jnp.float32), scale=scale, runs=runs,
                                            with_backward_terms=with_chunk_terms, num_tokens=tp,
                                            interpret=interpret)
  block_ends = terms.block_ends  # [B, H, N, 4, Dp]

  def on_chunk_terms():
    channel_decay = delta_mosaic.channel_state_decay(block_ends, None)  # per key channel (packed: the sweep drops it)
    state = _kernel_state(initial_state, dp=dp, ep=ep, sequences=sequences)
    cfg = heuristics.resolve_warp_specialized(None, dim_k=dp, itemsize=q.dtype.itemsize, delta=True,
                                              channel_gated=True)
    result = pallas_mosaic_gpu.forward_padded(
        terms.queries, terms.keys, pad(v, ep), None, state, chunk_gates=(None, runs),
        delta_inverse=terms.inverse, delta_states=with_chunk_terms,
        delta_channel_gates=(terms.keys_to_end, terms.pairs, channel_decay),
        scale=scale, seq_len=t, return_final_state=with_final_state, cfg=cfg, sequences=sequences,
        num_tokens=tp, interpret=interpret)
    o, *results = result if isinstance(result, tuple) else (result,)
    final_state = jnp.swapaxes(results.pop(), -1, -2)[:, :, :d, :e] if with_final_state else None
    return o[:, :t, :, :e], final_state, ((*terms[:-1], *results) if with_chunk_terms else ())

  def on_fallback():
    kept = ()
    if with_chunk_terms:  # placeholders of the terms' shapes: the backward's own choice skips them
      kept = tuple(jnp.zeros(x.shape, x.dtype) for x in jax.eval_shape(on_chunk_terms)[2])
    return (*fallback(q, k, v, beta, decay, segment_starts, initial_state), kept)

  o, final_state, kept = lax.cond(delta_mosaic.channel_spans_bounded(block_ends, q.dtype), on_chunk_terms,
                                  on_fallback)
  return (o, final_state, (*kept, block_ends)) if with_chunk_terms else (o, final_state)


def forward(q, k, v, beta, decay, segment_starts, initial_state, *, scale, with_final_state, interpret,
            with_inverses=False, with_states=False, inverses=None, fallback=None, with_chunk_terms=False,
            sequences=None):
  """`pallas_triton.forward`'s contract (its arguments but the blocks' config, and its results) on the
  warp-specialised sweep; with_inverses
  or with_states, a third result, the backward's residuals (`pallas_triton.backward`'s inverses and states): each
  chunk's (T, T') [B, H, Tp, 64] (`delta_mosaic.inverse(..., with_unscaled=True)`) with_inverses, then with_states
  (S_n^T [B, H, Tp / 64, Ep, Dp], U^T [B, H, Ep, Tp]), all in the input dtype. inverses: `chunk_inverses`' (T', or
  (T, T') with_inverses) for these k, beta and gates, or None (formed here).

  q, k: [B, T, H, D]; v: [B, T, H, E] bf16 or fp16; beta: [B, T, H]
  float32; decay: None or [B, T, H] float32 rates; segment_starts: [B, T]
  bool or None; initial_state: [B, H, D, E] float32 or None. The kernels
  walk whole 64-token chunks (zero beta and rates past T: they change no
  state), reading zeros past T where it is a multiple of 8 (`walked_rows`;
  else q, k and v are padded), with D padded to 64 or 128 and E to a
  multiple of 64. The chunk is the sweep's, 64 tokens, whatever
  `DeltaConfig.chunk_size` says.

  KDA's per-key-channel rates (decay [B, T, H, D]; neither inverses nor
  states are kept, but with_chunk_terms its chunk terms and states, the
  third result) run `_channel_gated`, with `fallback` (a callable of this
  function's first seven arguments returning (o, final state)) where the
  chunks' gates leave its range.

  sequences: None, or (first, end) [S] int32, the bounds in 64-token chunks
  of S sequences laid out chunk-aligned in one row (B = 1, no segment starts;
  `pallas_triton.sequence_bounds`: together they cover every chunk), each
  walked by its own CTAs from its own initial state, initial_state [S, H, D,
  E], to its own final state [S, H, D, E] (the backward's residuals are not
  kept: the backward forms them again).
  """
  if sequences is not None and (with_inverses or with_states or with_chunk_terms or segment_starts is not None):
    raise ValueError("sequences keep no residuals for the backward and take no segment starts")
  if decay is not None and decay.ndim == 4:
    if with_inverses or with_states or inverses is not None or fallback is None:
      raise ValueError("per-key-channel gates take no kept inverses or states, and a fallback")
    return _channel_gated(q, k, v, beta, decay, segment_starts, initial_state, scale=scale,
                          with_final_state=with_final_state, interpret=interpret, fallback=fallback,
                          with_chunk_terms=with_chunk_terms, sequences=sequences)
  if with_chunk_terms:
    raise ValueError("with_chunk_terms is KDA's (per-key-channel gates)")
  t, d, e = q.shape[1], q.shape[-1], v.shape[-1]
  rows, tp = walked_rows(t)
  dp, ep = WarpSpecializedConfig.padded_dims(d, e)
  pad = lambda x, dim: chunk_common.pad_tokens_and_features(x, num_tokens=rows, dim=dim)  # noqa: E731
  kp = pad(k, dp)
  # The gates in the per-chunk factors' form, of the inverse kernel and the sweep alike.
  chunk_gates = pallas_mosaic_gpu.sweep_gates(decay, segment_starts, num_tokens=tp)
  if inverses is None:  # as `chunk_inverses` forms them, on the operands padded once here
    inverses = delta_mosaic.inverse(kp, beta_rows(beta, tp=tp), chunk_gates, with_unscaled=with_inverses,
                                    num_tokens=tp, interpret=interpret)
  inverse = inverses[1] if with_inverses else inverses
  cfg = heuristics.resolve_warp_specialized(None, dim_k=dp, itemsize=q.dtype.itemsize, delta=True)
  result = pallas_mosaic_gpu.forward_padded(
      pad(q, dp), kp, pad(v, ep), None, _kernel_state(initial_state, dp=dp, ep=ep, sequences=sequences),
      chunk_gates=chunk_gates, delta_inverse=inverse, delta_states=with_states, scale=scale, seq_len=t,
      return_final_state=with_final_state, cfg=cfg, sequences=sequences, num_tokens=tp, interpret=interpret)
  o, *results = result if isinstance(result, tuple) else (result,)
  final_state = jnp.swapaxes(results.pop(), -1, -2)[:, :, :d, :e] if with_final_state else None
  o = o[:, :t, :, :e]
  if with_inverses or with_states:
    return o, final_state, (tuple(inverses) if with_inverses else ()) + tuple(results)
  return o, final_state


def piece_maps(k, v, decay, segment_starts, *, inverse, interpret):
  """Each row's affine map [M | L] [B, H, D, D + E] float32 (`sequence_parallel.affine_maps`' maps: the state
  after the row from [I | 0] over the values [0 | v]), by `pallas_mosaic_gpu.piece_maps`: no outputs, q or
  augmented operands. inverse: `chunk_inverses`' T' for these k, beta and gates (beta enters through it alone);
  the rest as `forward`'s."""
  t, d, e = k.shape[1], k.shape[-1], v.shape[-1]
  rows, tp = walked_rows(t)
  dp, ep = WarpSpecializedConfig.padded_dims(d, e)
  maps_t = delta_mosaic.piece_maps(
      chunk_common.pad_tokens_and_features(k, num_tokens=rows, dim=dp),
      chunk_common.pad_tokens_and_features(v, num_tokens=rows, dim=ep), inverse,
      pallas_mosaic_gpu.sweep_gates(decay, segment_starts, num_tokens=tp), interpret=interpret, num_tokens=tp)
  maps = jnp.swapaxes(maps_t, -1, -2)[:, :, :d]  # [B, H, D, Dp + Ep]
  return jnp.concatenate([maps[..., :d], maps[..., dp:dp + e]], axis=-1)
