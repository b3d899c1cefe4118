"""`jax.custom_vjp` of the Pallas path: the Triton forward, and a Triton backward that recomputes (on sm90 the
forward's sweep and both of the backward's sweeps are warp-specialised Mosaic GPU kernels).

Residuals are the inputs, and where the backward's sweeps are
warp-specialised each chunk's inverses T and T' = T Diag(beta) [B, H, Tp, 64]
that the forward formed, and (`DeltaConfig.forward_states`) each chunk's S_n,
the state before chunk n, and U, as the forward's sweep formed them. Else the
backward (`pallas_triton.backward`) runs the state sweep again (after the
prepare kernel, on the Triton sweeps), the sweep writing S_n and U. Per chunk (`chunk`'s
notation; Y = [W, U_v] = T X, X = [beta K_g, beta V], T = (I + A)^{-1}):

    U = U_v - W S_n,   O = Q_g S_n + P U,   S_{n+1} = Diag(a_n) S_n + K_C^T U.

With G_n = dL/dS_{n+1}, a reverse sweep (`state_cotangents`) gives
dU = P^T dO + K_C G_n and dL/dS_n = Diag(a_n) G_n + Q_g^T dO - W^T dU, and
writes the G_n. Then every chunk in parallel (`chunk_gradients`, or with a
scalar gate or none `tile_gradients`, which reads T from prepare, U from the
sweep and dU from the reverse sweep):

    dQ_g = dO S_n^T,  dW = -dU S_n^T,  dK_C = U G_n^T,  dP = dO U^T,
    da_n = sum_e G_n * S_n,  dX = T^T [dW, dU],  dA = -dX Y^T (strictly lower),

where, as W enters only U, dA = -(T^T dU) U^T (`tile_gradients` takes it so);
and the pair products A_ts = beta_t sum_d k_td k_sd e^{g_td - g_sd} and
P_ts = scale sum_d q_td k_sd e^{g_td - g_sd} pass their cotangents to the rows
(dx_t = sum_s dM_ts y_s e^{g_t - g_s}) and the columns (dy_s likewise). The
gate g enters every term as e^{g_t} (Q_g, K_g, the pair products' rows) or
e^{-g_t} (K_C, their columns), and g_C (the chunk's last row) in K_C and a_n,
so dg_t = x_t dx_t - y_t dy_t summed over those uses; the rates' cotangent is
the vjp of the chunk-local cumulative sum (`pallas_triton.gate_logs`).

KDA's per-key-channel gates: where the forward is warp-specialised, the
backward runs at its 64-token chunks on the warp-specialised sweeps, on each
chunk's terms and S_n^T and U^T, which the forward keeps
(`DeltaConfig.keeps_chunk_terms`) or the forward's kernels form again
(`pallas_triton._channel_gated_backward`), else the Triton one at 16-token
chunks.

The backward is first-order only (`lightning_attention.vjp.first_order_only`).
Forward and backward kernels run through `auto_sharding.blockwise`: under
`jax.jit`, inputs split over B and H of a mesh stay on their devices (every
operand and result of the delta rule is per batch and head, so nothing is
summed across devices).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from lightning_jax.ops.delta_attention import pallas_triton
from lightning_jax.ops.delta_attention import sequence_parallel
from lightning_jax.ops.delta_attention import sequence_split
from lightning_jax.ops.delta_attention import warp_specialized
from lightning_jax.ops.lightning_attention import manual_axes
from lightning_jax.ops.lightning_attention import auto_sharding
from lightning_jax.ops.lightning_attention.auto_sharding import CHUNK_BLOCKS
from lightning_jax.ops.lightning_attention.auto_sharding import CHUNK_STATES
from lightning_jax.ops.lightning_attention.auto_sharding import CHUNK_TILES
from lightning_jax.ops.lightning_attention.auto_sharding import CHUNK_VALUES
from lightning_jax.ops.lightning_attention.auto_sharding import ROWS_D
from lightning_jax.ops.lightning_attention.auto_sharding import ROWS_E
from lightning_jax.ops.lightning_attention.auto_sharding import STARTS
from lightning_jax.ops.lightning_attention.auto_sharding import STATE
from lightning_jax.ops.lightning_attention.auto_sharding import TOKENS
from lightning_jax.ops.lightning_attention.config import WarpSpecializedConfig
from lightning_jax.ops.lightning_attention.vjp import first_order_only

# The map pass of a sequence split runs D more value columns: past this E it runs twice (`sequence_parallel`).
MAX_VALUE_DIM = WarpSpecializedConfig.MAX_DIM_V
# The split's residuals: the state before each piece, each piece's transition M (both [B P, H, D, *]) and
# whether each piece continues the segment before it ([B, P]).
SPLIT_LABELS = (STATE, STATE, STARTS)
# cu_seqlens' sequences, one per element ([S] chunk bounds) or one state each ([S, H, D, E]): S is never split.
SEQUENCES, SEQUENCE_STATES = "s", "shde"
# KDA's chunk terms (`delta_mosaic.ChannelGatedChunks` with its backward terms: T', P, Q_g, K_g, K_C, T and G),
# then each chunk's S_n^T and U^T and its 16-token blocks' log decays (`ChannelGatedChunks.block_ends`).
TERM_LABELS = (CHUNK_TILES, CHUNK_TILES, ROWS_D, ROWS_D, ROWS_D, CHUNK_TILES, ROWS_D, CHUNK_STATES, CHUNK_VALUES,
               CHUNK_BLOCKS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasOptions:
  """The static options of the Pallas path: the op's scale, whether the final state is returned, the blocks."""
  scale: float
  with_final_state: bool
  config: pallas_triton.DeltaConfig
  interpret: bool


def _labelled(q, k, v, beta, decay, segment_starts, initial_state):
  """The operands with the labels of their dims, for `auto_sharding.blockwise`."""
  rates = ROWS_D if decay is not None and decay.ndim == 4 else TOKENS  # KDA's: one per key channel
  return ((q, ROWS_D), (k, ROWS_D), (v, ROWS_E), (beta, TOKENS), (decay, rates), (segment_starts, STARTS),
          (initial_state, STATE))


def _unpadded_pieces(opts, decay, v) -> bool:
  """`sequence_split.walks_unpadded_pieces` for this call (the forward's and the backward's piece rows alike)."""
  return sequence_split.walks_unpadded_pieces(opts.config, per_channel_gate=decay is not None and decay.ndim == 4,
                                              dim_v=v.shape[-1])


def _primal(q, k, v, beta, decay, segment_starts, initial_state, opts, with_inverses=False, with_states=False,
            with_chunk_terms=False):
  """The forward kernels on each device's block of B and H (see `auto_sharding`): the prepare (or inverse) kernel,
  then the warp-specialised sweep where `DeltaConfig.warp_specialized` (resolved by the op) says so, else the
  Triton one, over pieces of the sequence where `DeltaConfig.sequence_pieces` > 1 (`sequence_split`).

  Returns ((o, final state or None), the backward's residuals: with_inverses
  each chunk's (T, T') (the warp-specialised forward's), with_states each
  chunk's (S_n^T, U^T) (its sweep's), with_chunk_terms KDA's chunk terms
  (`TERM_LABELS`), then with a split its piece starts, transitions and
  continues flags (`SPLIT_LABELS`)).
  """
  ws = opts.config.warp_specialized
  # The scalar-gate chain serves the split's map pass and takes inverses formed once for both its passes; KDA's
  # forward forms its gated terms itself.
  ws_scalar = ws and not (decay is not None and decay.ndim == 4)
  pieces = opts.config.sequence_pieces or 1
  kernels = dict(scale=opts.scale, config=opts.config, interpret=opts.interpret)

  def triton_forward(*args):
    return pallas_triton.forward(*args, with_final_state=opts.with_final_state, **kernels)

  def run(*args, inverses=None):
    if not ws:
      return triton_forward(*args)
    o, final_state, *kept = warp_specialized.forward(*args, scale=opts.scale, with_final_state=opts.with_final_state,
                                                     interpret=opts.interpret, with_inverses=with_inverses,
                                                     with_states=with_states, inverses=inverses,
                                                     fallback=None if ws_scalar else triton_forward,
                                                     with_chunk_terms=with_chunk_terms)
    return (o, final_state, *(kept[0] if kept else ()))

  def piece_maps(k, v, beta, decay, segment_starts, inverses):  # the split's map pass: final states alone
    if ws_scalar:
      return warp_specialized.piece_maps(k, v, decay, segment_starts, interpret=opts.interpret,
                                         inverse=inverses[1] if with_inverses else inverses)

    def forward(values, state):  # k stands in for q: no outputs are formed
      return pallas_triton.forward(k, k, values, beta, decay, segment_starts, state, with_final_state=True,
                                   with_outputs=False, **kernels)
    return sequence_parallel.affine_maps(forward, v, dim_k=k.shape[-1], max_value_dim=MAX_VALUE_DIM)[2]

  def chunk_inverses(k, beta, decay, segment_starts):  # formed once for both of the split's passes
    return warp_specialized.chunk_inverses(k, beta, decay, segment_starts, with_unscaled=with_inverses,
                                           interpret=opts.interpret)

  def local(*args):
    if pieces == 1:
      o, final_state, *kept = run(*args)
    else:
      (o, final_state), kept, split = sequence_split.forward(
          run, piece_maps, *args, pieces=pieces, with_final_state=opts.with_final_state,
          unpadded_rows=_unpadded_pieces(opts, decay, v),
          chunk_inverses=chunk_inverses if ws_scalar else None)
      kept = (*kept, split.starts, split.transitions, split.continues)
    return (o,) + ((final_state,) if opts.with_final_state else ()) + tuple(kept)

  out = auto_sharding.blockwise(local, _labelled(q, k, v, beta, decay, segment_starts, initial_state),
                                (ROWS_E,) + ((STATE,) if opts.with_final_state else ())
                                + ((CHUNK_TILES, CHUNK_TILES) if with_inverses else ())
                                + ((CHUNK_STATES, CHUNK_VALUES) if with_states else ())
                                + (TERM_LABELS if with_chunk_terms else ())
                                + (SPLIT_LABELS if pieces > 1 else ()))
  return (out[0], out[1] if opts.with_final_state else None), tuple(out[1 + opts.with_final_state:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def delta_attention_pallas(q, k, v, beta, decay, segment_starts, initial_state, opts: PallasOptions):
  """(o [B, T, H, E], final state [B, H, D, E] float32 or None) of validated inputs (see `pallas_triton.forward`)."""
  return _primal(q, k, v, beta, decay, segment_starts, initial_state, opts)[0]


def _forward(q, k, v, beta, decay, segment_starts, initial_state, opts):
  # The warp-specialised backward takes the forward's inverses, and its states where it keeps them
  # (`pallas_triton.backward`).
  per_channel_gate = decay is not None and decay.ndim == 4
  with_inverses = opts.config.warp_specializes_backward(per_channel_gate=per_channel_gate)
  with_states = opts.config.keeps_forward_states(per_channel_gate=per_channel_gate)
  with_chunk_terms = opts.config.keeps_chunk_terms(per_channel_gate=per_channel_gate)
  q, k, v, beta, decay, segment_starts, initial_state = first_order_only(
      "delta_attention", (q, k, v, beta, decay, segment_starts, initial_state))
  out, kept = _primal(q, k, v, beta, decay, segment_starts, initial_state, opts, with_inverses=with_inverses,
                      with_states=with_states, with_chunk_terms=with_chunk_terms)
  kept = list(kept)
  inverses = (kept.pop(0), kept.pop(0)) if with_inverses else (None, None)
  states = (kept.pop(0), kept.pop(0)) if with_states else (None, None)
  terms = tuple(kept.pop(0) for _ in TERM_LABELS) if with_chunk_terms else ()
  return out, (q, k, v, beta, decay, segment_starts, initial_state, *inverses, *states, terms, tuple(kept))


def _backward(opts, residuals, cotangents):
  residuals, cotangents = first_order_only("delta_attention", (residuals, cotangents))
  q, k, v, beta, decay, segment_starts, initial_state, tri, tri_beta, states_t, values_t, terms, split = residuals
  do, d_final = cotangents
  operands = _labelled(q, k, v, beta, decay, segment_starts, initial_state)
  # The cotangents `pallas_triton.backward` returns: of q, k, v, beta, and of decay and initial_state if given.
  returned = [label for x, label in operands[:5] + operands[6:] if x is not None]
  kernels = dict(scale=opts.scale, config=opts.config, interpret=opts.interpret)

  def local(q, k, v, beta, decay, segment_starts, initial_state, do, d_final, tri, tri_beta, states_t, values_t,
            *rest):
    inverses = None if tri is None else (tri, tri_beta)
    states = None if states_t is None else (states_t, values_t)
    chunk_terms, split_arrays = (rest[:len(terms)] or None), rest[len(terms):]
    if not split_arrays:
      grads = pallas_triton.backward(q, k, v, beta, decay, segment_starts, initial_state, do, d_final,
                                     inverses=inverses, states=states, chunk_terms=chunk_terms, **kernels)
    else:
      starts, transitions, continues = split_arrays
      pieces = sequence_split.Pieces(count=continues.shape[1],
                                     length=sequence_split.piece_length(
                                         q.shape[1], continues.shape[1],
                                         unpadded_rows=_unpadded_pieces(opts, decay, v)),
                                     starts=starts, transitions=transitions, continues=continues)
      run = functools.partial(pallas_triton.backward, inverses=inverses, states=states, chunk_terms=chunk_terms,
                              **kernels)
      grads = sequence_split.backward(run, pieces, q, k, v, beta, decay, segment_starts, do, d_final)
      grads = grads if initial_state is not None else grads[:-1]
    return tuple(g for g in grads if g is not None)

  grads = iter(auto_sharding.blockwise(local, (*operands, (do, ROWS_E), (d_final, STATE), (tri, CHUNK_TILES),
                                               (tri_beta, CHUNK_TILES), (states_t, CHUNK_STATES),
                                               (values_t, CHUNK_VALUES), *zip(terms, TERM_LABELS),
                                               *zip(split, SPLIT_LABELS)), returned))
  dq, dk, dv, d_beta = (next(grads) for _ in range(4))
  d_decay = None if decay is None else next(grads)
  d_initial = None if initial_state is None else next(grads)
  # Inside shard_map, an input the same on every device (the sequence-parallel map pass's [I | 0] state, a
  # replicated initial state or gate) collects every device's share.
  return (*(manual_axes.sum_to_type_of(g, x) for g, x in zip((dq, dk, dv, d_beta, d_decay), (q, k, v, beta, decay))),
          None, manual_axes.sum_to_type_of(d_initial, initial_state))


delta_attention_pallas.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def delta_attention_sequences_pallas(q, k, v, beta, decay, first, end, initial_state, opts: PallasOptions):
  """(o [1, T, H, E], each sequence's final state [S, H, D, E] float32 or None) of S sequences, each from its own
  initial state: q, k, v, beta and decay in the layout of `chunk.aligned_sequences` at
  `pallas_triton.sequence_chunk(opts.config)` tokens a chunk, first and end [S] int32 its chunk bounds,
  initial_state [S, H, D, E] float32 or None (zeros). The forward runs a sweep program (CTAs on the
  warp-specialised sweep where `opts.config.warp_specialized`, else a Triton program) per sequence; the backward
  recomputes what it needs, a program per sequence in each sweep too (`pallas_triton.backward`'s sequences)."""
  return _sequences_forward(q, k, v, beta, decay, first, end, initial_state, opts)[0]


def _sequence_operands(q, k, v, beta, decay, first, end, initial_state):
  """The operands with their labels, for `auto_sharding.blockwise` (the heads split, as the other paths')."""
  return (*_labelled(q, k, v, beta, decay, None, None)[:5], (first, SEQUENCES), (end, SEQUENCES),
          (initial_state, SEQUENCE_STATES))


def _sequences_forward(q, k, v, beta, decay, first, end, initial_state, opts):
  q, k, v, beta, decay, initial_state = first_order_only("delta_attention", (q, k, v, beta, decay, initial_state))

  def local(q, k, v, beta, decay, first, end, initial_state):
    triton_forward = functools.partial(pallas_triton.forward, scale=opts.scale, with_final_state=opts.with_final_state,
                                       config=opts.config, interpret=opts.interpret, sequences=(first, end))
    if opts.config.warp_specialized:
      bounds = pallas_triton.sequence_bounds((first, end), None, seq_len=q.shape[1],
                                             chunk_size=WarpSpecializedConfig.CHUNK_SIZE,
                                             layout_chunk=pallas_triton.sequence_chunk(opts.config))
      o, final_state = warp_specialized.forward(q, k, v, beta, decay, None, initial_state, scale=opts.scale,
                                                with_final_state=opts.with_final_state, interpret=opts.interpret,
                                                fallback=triton_forward, sequences=bounds)
    else:
      o, final_state = triton_forward(q, k, v, beta, decay, None, initial_state)
    return (o,) + ((final_state,) if opts.with_final_state else ())

  out = auto_sharding.blockwise(local, _sequence_operands(q, k, v, beta, decay, first, end, initial_state),
                                (ROWS_E,) + ((SEQUENCE_STATES,) if opts.with_final_state else ()))
  return (out[0], out[1] if opts.with_final_state else None), (q, k, v, beta, decay, first, end, initial_state)


def _sequences_backward(opts, residuals, cotangents):
  residuals, cotangents = first_order_only("delta_attention", (residuals, cotangents))
  q, k, v, beta, decay, first, end, initial_state = residuals
  do, d_final = cotangents
  operands = _sequence_operands(q, k, v, beta, decay, first, end, initial_state)
  returned = [label for x, label in operands[:5] + operands[7:] if x is not None]

  def local(q, k, v, beta, decay, first, end, initial_state, do, d_final):
    grads = pallas_triton.backward(q, k, v, beta, decay, None, initial_state, do, d_final, scale=opts.scale,
                                   config=opts.config, interpret=opts.interpret, sequences=(first, end))
    return tuple(g for g in grads if g is not None)

  grads = iter(auto_sharding.blockwise(local, (*operands, (do, ROWS_E), (d_final, SEQUENCE_STATES)), returned))
  dq, dk, dv, d_beta = (next(grads) for _ in range(4))
  d_decay = None if decay is None else next(grads)
  d_initial = None if initial_state is None else next(grads)
  return dq, dk, dv, d_beta, d_decay, None, None, d_initial


delta_attention_sequences_pallas.defvjp(_sequences_forward, _sequences_backward)
