"""Framework-free pieces shared by the NNX and Linen `DeltaAttention` layers: argument
validation, the parameter and decode-cache layout, and the block between the input and
output projections (short convolutions, gates, delta attention, gated RMS norm).

Shapes: B batch, T tokens, F in_features, H = num_heads q/k heads of dim D = head_dim,
Hv = num_v_heads value heads of dim E = value_head_dim, K = conv_size.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp

from lightning_jax._layer_common import Sharding
from lightning_jax._layer_common import _is_int
from lightning_jax._layer_common import make_sharding
from lightning_jax.ops.delta_attention import api as delta_api
from lightning_jax.ops.lightning_attention import api as lightning_api
from lightning_jax.ops.delta_attention import reference
from lightning_jax.ops.lightning_attention import chunk_common

GATES = ("kda", "scalar", None)
OUTPUT_GATE_ACTIVATIONS = ("sigmoid", "silu", None)
_ACTIVATIONS = {"sigmoid": jax.nn.sigmoid, "silu": jax.nn.silu}
# Names of the decode cache's variables (NNX `nnx.Cache` attributes, Linen "cache" collection).
CACHE_NAMES = ("cached_state", "cached_q_conv", "cached_k_conv", "cached_v_conv", "cached_segment_id")


@dataclasses.dataclass(frozen=True)
class DeltaSpec:
  """Checked, resolved constructor arguments of a DeltaAttention layer (hashable)."""
  num_heads: int
  num_v_heads: int
  in_features: int
  out_features: int
  head_dim: int
  value_head_dim: int
  gate: str | None
  gate_rank: int | None  # KDA only
  output_gate_activation: str | None
  output_gate_rank: int | None  # None: full rank (or no output gate)
  allow_neg_eigval: bool
  conv_size: int
  norm_eps: float
  scale: float
  use_bias: bool
  impl: str
  sharding: Sharding | None = None

  @property
  def shard_map_sequence_axis(self) -> str | None:
    """The axis T is split over inside the caller's `jax.shard_map` (no mesh given), else None."""
    return None if self.sharding is None or self.sharding.mesh is not None else self.sharding.sequence_axis


def make_spec(*, num_heads, in_features, num_v_heads, head_dim, value_head_dim, out_features, gate, gate_rank,
              output_gate_activation, output_gate_rank, full_rank_output_gate, allow_neg_eigval, conv_size,
              norm_eps, scale, use_bias, impl, mesh=None, batch_axes=None, head_axis=None,
              sequence_axis=None) -> DeltaSpec:
  """Validates the layer arguments (clear errors naming each one) and resolves defaults."""
  for name, value, optional in (("num_heads", num_heads, False), ("in_features", in_features, False),
                                ("num_v_heads", num_v_heads, True), ("head_dim", head_dim, True),
                                ("value_head_dim", value_head_dim, True), ("out_features", out_features, True),
                                ("gate_rank", gate_rank, True), ("output_gate_rank", output_gate_rank, True),
                                ("conv_size", conv_size, False)):
    if not (optional and value is None) and not _is_int(value, 1):
      raise ValueError(f"{name} must be {'None or ' if optional else ''}an int >= 1, got {value!r}")
  num_v_heads = num_heads if num_v_heads is None else num_v_heads
  if num_v_heads % num_heads:
    raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_heads ({num_heads}): each q/k head "
                     "serves num_v_heads // num_heads value heads")
  if head_dim is None:
    if in_features % num_heads:
      raise ValueError(f"head_dim=None is in_features // num_heads, but in_features ({in_features}) is not "
                       f"divisible by num_heads ({num_heads}): give head_dim")
    head_dim = in_features // num_heads
  value_head_dim = head_dim if value_head_dim is None else value_head_dim
  for name, dim in (("head_dim", head_dim), ("value_head_dim", value_head_dim)):
    if dim > delta_api.MAX_HEAD_DIM:
      raise ValueError(f"{name} = {dim} exceeds the op's limit {delta_api.MAX_HEAD_DIM}")
  if gate not in GATES:
    raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
  if gate != "kda" and gate_rank is not None:
    raise ValueError(f"gate_rank sizes the KDA gate's low-rank projection; it needs gate='kda', got gate={gate!r}")
  if output_gate_activation not in OUTPUT_GATE_ACTIVATIONS:
    raise ValueError(f"output_gate_activation must be one of {OUTPUT_GATE_ACTIVATIONS}, got "
                     f"{output_gate_activation!r}")
  for name, flag in (("full_rank_output_gate", full_rank_output_gate), ("allow_neg_eigval", allow_neg_eigval),
                     ("use_bias", use_bias)):
    if not isinstance(flag, bool):
      raise TypeError(f"{name} must be a bool, got {flag!r}")
  if output_gate_rank is not None and (full_rank_output_gate or output_gate_activation is None):
    raise ValueError("output_gate_rank sizes the low-rank output gate; it needs output_gate_activation and "
                     "full_rank_output_gate=False")
  if not isinstance(norm_eps, numbers.Real) or isinstance(norm_eps, bool) or not norm_eps > 0:
    raise ValueError(f"norm_eps must be a float > 0, got {norm_eps!r}")
  lightning_api.check_scale(scale)
  if impl not in delta_api.IMPLS:
    raise ValueError(f"impl must be one of {delta_api.IMPLS}, got {impl!r}")
  sharding = make_sharding(mesh=mesh, batch_axes=batch_axes, head_axis=head_axis, sequence_axis=sequence_axis)
  low_rank = value_head_dim  # Kimi Linear's low-rank gates go through a head's width
  return DeltaSpec(
      num_heads=num_heads, num_v_heads=num_v_heads, in_features=in_features,
      out_features=in_features if out_features is None else out_features, head_dim=head_dim,
      value_head_dim=value_head_dim, gate=gate,
      gate_rank=(gate_rank or low_rank) if gate == "kda" else None,
      output_gate_activation=output_gate_activation,
      output_gate_rank=(None if full_rank_output_gate or output_gate_activation is None
                        else output_gate_rank or low_rank),
      allow_neg_eigval=allow_neg_eigval, conv_size=conv_size, norm_eps=float(norm_eps),
      scale=float(head_dim ** -0.5 if scale is None else scale), use_bias=use_bias, impl=impl, sharding=sharding)


def projections(spec: DeltaSpec) -> tuple[tuple[str, int | tuple[int, ...], int | tuple[int, ...]], ...]:
  """(name, in features, out features) of every dense projection of the layer; a tuple of
  in features is contracted over the input's last axes (o_proj's [Hv, E])."""
  f, r = spec.in_features, spec.gate_rank
  qk, v = (spec.num_heads, spec.head_dim), (spec.num_v_heads, spec.value_head_dim)
  rows = [("q_proj", f, qk), ("k_proj", f, qk), ("v_proj", f, v), ("b_proj", f, spec.num_v_heads)]
  if spec.gate == "kda":
    rows += [("f_a_proj", f, r), ("f_b_proj", r, (spec.num_v_heads, spec.head_dim))]
  elif spec.gate == "scalar":
    rows += [("a_proj", f, spec.num_v_heads)]
  if spec.output_gate_activation is not None:
    rows += ([("g_proj", f, v)] if spec.output_gate_rank is None
             else [("g_a_proj", f, spec.output_gate_rank), ("g_b_proj", spec.output_gate_rank, v)])
  return (*rows, ("o_proj", v, spec.out_features))


def conv_kernel_init(key, shape, dtype=jnp.float32):
  """PyTorch's depthwise Conv1d default: uniform in +-1/sqrt(K) for a [K, heads, dim] kernel."""
  bound = shape[0] ** -0.5
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def a_log_init(key, shape, dtype=jnp.float32):
  """log(A) with A uniform in [1, 16], as Kimi Linear and flash-linear-attention initialise it."""
  return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def param_specs(spec: DeltaSpec) -> dict[str, tuple[tuple[int, ...], object]]:
  """{name: (shape, init(key, shape, dtype))} of the layer's parameters outside the projections."""
  h, hv, d, e, k = spec.num_heads, spec.num_v_heads, spec.head_dim, spec.value_head_dim, spec.conv_size
  out = {"q_conv1d": ((k, h, d), conv_kernel_init), "k_conv1d": ((k, h, d), conv_kernel_init),
         "v_conv1d": ((k, hv, e), conv_kernel_init)}
  if spec.gate is not None:
    # dt_bias starts at 1 (transformers' initialisation of Kimi Linear and Qwen3-Next).
    out["A_log"] = ((hv,), a_log_init)
    out["dt_bias"] = ((hv, d) if spec.gate == "kda" else (hv,), jax.nn.initializers.ones)
  out["o_norm"] = ((e,), jax.nn.initializers.ones)
  return out


def project(spec: DeltaSpec, proj, x) -> dict[str, jax.Array | None]:
  """The input projections of x [B, T, F]; proj(name) is the named projection (a callable).

  Returns q, k [B, T, H, D]; v [B, T, Hv, E]; b [B, T, Hv] (beta logits); f (gate
  pre-activation: [B, T, Hv, D] for KDA, [B, T, Hv] scalar, or None); z (output gate
  pre-activation [B, T, Hv, E] or None).
  """
  acts = {name: proj(f"{name}_proj")(x) for name in ("q", "k", "v", "b")}
  acts["f"] = (proj("f_b_proj")(proj("f_a_proj")(x)) if spec.gate == "kda"
               else proj("a_proj")(x) if spec.gate == "scalar" else None)
  acts["z"] = (None if spec.output_gate_activation is None
               else proj("g_proj")(x) if spec.output_gate_rank is None
               else proj("g_b_proj")(proj("g_a_proj")(x)))
  return acts


def cache_shapes(batch_size, spec: DeltaSpec) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
  """{name: (shape, dtype)} of the decode cache: the recurrent state [B, Hv, D, E], the last
  K - 1 inputs of each short convolution [B, K - 1, heads, dim] (float32 holds any compute
  dtype exactly) and the segment id of each row's last token [B]."""
  if not _is_int(batch_size, 1):
    raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
  b, w, f32 = int(batch_size), spec.conv_size - 1, jnp.float32
  qk, v = (spec.num_heads, spec.head_dim), (spec.num_v_heads, spec.value_head_dim)
  return {"cached_state": ((b, spec.num_v_heads, spec.head_dim, spec.value_head_dim), f32),
          "cached_q_conv": ((b, w, *qk), f32), "cached_k_conv": ((b, w, *qk), f32),
          "cached_v_conv": ((b, w, *v), f32), "cached_segment_id": ((b,), jnp.int32)}


def check_cache(cache, batch_size, spec: DeltaSpec) -> None:
  """cache: {name: array} or None (no cache created yet)."""
  if spec.sharding is not None and spec.sharding.sequence_axis is not None:
    raise ValueError("decode does not combine with sequence_axis (decoding extends whole sequences): decode with "
                     "a layer built without it; the parameters are the same")
  if cache is None:
    raise ValueError("decode=True needs the decode cache (recurrent state and convolution windows): call "
                     "init_cache(batch_size) first")
  for name, (shape, _) in cache_shapes(batch_size, spec).items():
    if tuple(cache[name].shape) != shape:
      raise ValueError(f"decode cache holds {name} of shape {tuple(cache[name].shape)} but the inputs need "
                       f"{shape}: call init_cache with batch_size={batch_size}")


def short_conv(x, kernel, window, run_start):
  """Causal depthwise convolution then SiLU (flash-linear-attention's ShortConvolution).

  x: [B, T, heads, dim]; kernel: [K, heads, dim] (tap K - 1 on the current token);
  window: float32 [B, K - 1, heads, dim], the inputs before x (zeros for none);
  run_start: int [B, T], where each token's segment starts (negative: before x,
  through the window). A tap never reaches a token before its segment's start.
  Returns (y [B, T, heads, dim] in x's dtype, the window after x, float32: the
  last K - 1 inputs, zeros where they precede the last token's segment).
  """
  k, t = kernel.shape[0], x.shape[1]
  full = jnp.concatenate([window, x.astype(jnp.float32)], axis=1)  # input of token i at full[:, i + K - 1]
  pos = jnp.arange(t)
  y = jnp.zeros(x.shape, jnp.float32)
  for j in range(k):
    lag = k - 1 - j
    taps = jnp.where((pos - lag >= run_start)[..., None, None], full[:, j:j + t], 0.0)
    y = y + kernel[j].astype(jnp.float32) * taps
  return jax.nn.silu(y).astype(x.dtype), _in_last_segment(full[:, t:], run_start)


def _in_last_segment(tail, run_start):
  """tail [B, K - 1, heads, dim], the inputs of the last K - 1 tokens (run_start [B, T] of `short_conv`), with
  zeros where they precede the last token's segment: the window the next tokens continue."""
  t, width = run_start.shape[1], tail.shape[1]
  kept = jnp.arange(t - width, t) >= run_start[:, -1:]
  return jnp.where(kept[..., None, None], tail, 0.0)


def _previous_windows(xs, segment_ids, run_start, *, conv_size, axis):
  """The convolution windows before this device's slice of T (`sequence_axis`): the previous device's last
  K - 1 inputs of each x (zeros before its last token's segment, and all zeros where this slice's first token
  starts a segment of its own, or on the first device), one collective permute each."""
  t = xs[0].shape[1]
  width = conv_size - 1
  if t < width:
    raise ValueError(f"with sequence_axis each device's slice of T needs at least conv_size - 1 = {width} tokens, "
                     f"got {t}")
  num_devices = jax.lax.axis_size(axis)
  to_next = [(i, i + 1) for i in range(num_devices - 1)]
  windows = [jax.lax.ppermute(_in_last_segment(x[:, t - width:].astype(jnp.float32), run_start), axis, to_next)
             for x in xs]
  if segment_ids is None:
    return windows
  last_before = jax.lax.ppermute(segment_ids[:, -1].astype(jnp.int32), axis, to_next)
  same = (segment_ids[:, 0].astype(jnp.int32) == last_before)[:, None, None, None]
  return [jnp.where(same, w, 0.0) for w in windows]


def gated_rms_norm(o, weight, gate, activation, eps):
  """RMS norm of o [..., E] (float32) times weight [E], times activation(gate) when gated;
  o's dtype. The order of the roundings is transformers' RMSNormGated."""
  o32 = o.astype(jnp.float32)
  y = (o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)).astype(o.dtype)
  y = weight.astype(o.dtype) * y
  if gate is None:
    return y
  return (y.astype(jnp.float32) * _ACTIVATIONS[activation](gate.astype(jnp.float32))).astype(o.dtype)


# Jitted so that eager calls (a decode loop outside jit) compile once per shape instead of
# dispatching op by op; under an outer jit it is inlined.
@functools.partial(jax.jit, static_argnames="spec")
def mix(spec: DeltaSpec, acts, params, segment_ids=None, cache=None):
  """The layer between its input and output projections.

  acts: `project`'s dict; params: {name: array} of `param_specs(spec)`; segment_ids:
  int [B, T] or None; cache: {name: array} of `cache_shapes` or None (no decoding).
  Returns (o [B, T, Hv, E] for o_proj, the updated cache or None).
  """
  q, k, v = acts["q"], acts["k"], acts["v"]
  b, t = q.shape[:2]
  state = last_ids = None
  # Where each token's segment starts; -K (through the window) for a row's first segment.
  run_start = jnp.full((b, t), -spec.conv_size, jnp.int32)
  if segment_ids is not None:
    run_start = jax.lax.cummax(jnp.where(chunk_common.segment_starts(segment_ids), jnp.arange(t), run_start), axis=1)
  if cache is None and spec.shard_map_sequence_axis is not None:
    windows = _previous_windows((q, k, v), segment_ids, run_start, conv_size=spec.conv_size,
                                axis=spec.shard_map_sequence_axis)
  elif cache is None:
    windows = tuple(jnp.zeros((b, spec.conv_size - 1, *x.shape[2:]), jnp.float32) for x in (q, k, v))
  else:
    state, last_ids = cache["cached_state"], cache["cached_segment_id"]
    windows = tuple(cache[f"cached_{name}_conv"] for name in "qkv")
    if segment_ids is not None:
      # A row whose first token has another id than its last cached token starts a new
      # segment: from a zero state and an empty convolution window.
      same = (segment_ids[:, 0].astype(jnp.int32) == last_ids)[:, None, None, None]
      state = jnp.where(same, state, 0.0)
      windows = tuple(jnp.where(same, w, 0.0) for w in windows)
      last_ids = segment_ids[:, -1].astype(jnp.int32)
  (q, q_window), (k, k_window), (v, v_window) = (
      short_conv(x, params[f"{name}_conv1d"], w, run_start) for x, name, w in zip((q, k, v), "qkv", windows))

  beta = jax.nn.sigmoid(acts["b"].astype(jnp.float32)) * (2.0 if spec.allow_neg_eigval else 1.0)
  decay = None
  if spec.gate is not None:
    # The models' log-gate g = -exp(A_log) * softplus(f + dt_bias); the op takes the rate -g >= 0.
    a = jnp.exp(params["A_log"].astype(jnp.float32))
    decay = (a[:, None] if spec.gate == "kda" else a) * jax.nn.softplus(
        acts["f"].astype(jnp.float32) + params["dt_bias"].astype(jnp.float32))
  group = spec.num_v_heads // spec.num_heads
  if group > 1:  # each q/k head serves `group` consecutive value heads (torch's repeat_interleave)
    q, k = jnp.repeat(q, group, axis=2), jnp.repeat(k, group, axis=2)

  if state is not None and t == 1:
    # A decode step: the token-serial recurrence, a few flops, cheaper than the chunked op.
    o, state = reference.delta_attention_recurrent(delta_api.l2_normalize(q), delta_api.l2_normalize(k), v, beta,
                                                   decay, scale=spec.scale, initial_state=state)
    o = o.astype(q.dtype)
  else:
    options = dict(scale=spec.scale, initial_state=state, return_final_state=state is not None,
                   segment_ids=segment_ids, normalize_qk=True, impl=spec.impl)
    if spec.sharding is not None and spec.sharding.mesh is not None:
      sharding = spec.sharding
      out = delta_api.sharded_delta_attention(q, k, v, beta, decay, mesh=sharding.mesh,
                                              batch_axes=sharding.batch_axes, head_axis=sharding.head_axis,
                                              sequence_axis=sharding.sequence_axis, **options)
    else:
      out = delta_api.delta_attention(q, k, v, beta, decay, sequence_axis=spec.shard_map_sequence_axis, **options)
    o, state = out if state is not None else (out, None)
  o = gated_rms_norm(o, params["o_norm"], acts["z"], spec.output_gate_activation, spec.norm_eps)
  if cache is None:
    return o, None
  return o, {"cached_state": state, "cached_q_conv": q_window, "cached_k_conv": k_window,
             "cached_v_conv": v_window, "cached_segment_id": last_ids}


LAYER_DOC = """Delta attention block: Kimi Linear's KDA, Gated DeltaNet (Qwen3-Next) or DeltaNet.

  For inputs x [B, T, in_features], with H = num_heads q/k heads of dim D =
  head_dim and Hv = num_v_heads value heads of dim E = value_head_dim:

      q, k = l2norm(silu(conv(x W_q))), l2norm(silu(conv(x W_k)))    [B, T, H, D]
      v = silu(conv(x W_v))                                          [B, T, Hv, E]
      beta = sigmoid(x W_b)  (times 2 with allow_neg_eigval)         [B, T, Hv]
      g = -exp(A_log) * softplus(x W_f + dt_bias)   (the log-gate, a = exp(g))
          "kda": W_f = f_a_proj f_b_proj (low rank), g [B, T, Hv, D];
          "scalar": W_f = a_proj, g [B, T, Hv]; None: no gate (a = 1)
      S_t = (I - beta_t k_t k_t^T) Diag(a_t) S_{t-1} + beta_t k_t v_t^T
      o_t = scale * S_t^T q_t                              (`delta_attention`)
      o = rms_norm(o) * o_norm * act(x W_g)     (per head over E; act: sigmoid or
          silu, or no gate)
      y = o W_o                                            [B, T, out_features]

  conv is a causal depthwise convolution of kernel conv_size over time. With
  Hv > H each q/k head serves Hv // H consecutive value heads. The state S
  [B, Hv, D, E], the gates, the convolution sums and the norm are float32 whatever
  the dtype. With the defaults this is Kimi Linear's KDA layer (Kimi Team, 2025;
  flash-linear-attention's `KimiDeltaAttention`); gate="scalar",
  full_rank_output_gate=True, output_gate_activation="silu" is Gated DeltaNet
  (Yang et al., 2025) as in Qwen3-Next; gate=None, output_gate_activation=None
  is DeltaNet with short convolutions.

  Parameters (the same names and shapes in the NNX and Linen layers, so a
  parameter dict moves between them), after transformers' and the checkpoints'
  module names so that converting weights renames and reshapes:
    q_proj, k_proj {kernel [F, H, D]}, v_proj {kernel [F, Hv, E]}: the input
      projections (with use_bias, every projection also has a bias).
    q_conv1d, k_conv1d [K, H, D], v_conv1d [K, Hv, E]: the convolution kernels
      (PyTorch's Conv1d weight [H*D, 1, K], transposed; Qwen3-Next packs the
      three in one conv1d).
    b_proj {kernel [F, Hv]}: beta.
    "kda": f_a_proj {kernel [F, gate_rank]}, f_b_proj {kernel [gate_rank, Hv,
      D]}, A_log [Hv], dt_bias [Hv, D]. "scalar": a_proj {kernel [F, Hv]},
      A_log [Hv], dt_bias [Hv]. (Kimi Linear's A_log [1, 1, H, 1] and dt_bias
      [H*D], Qwen3-Next's in_proj_ba = per q/k head [b | a], reshape to these.)
    g_a_proj {kernel [F, r]}, g_b_proj {kernel [r, Hv, E]}: the low-rank output
      gate (Kimi Linear), or g_proj {kernel [F, Hv, E]} with
      full_rank_output_gate (Qwen3-Next's z: its in_proj_qkvz is per q/k head
      [q | k | v | z], split into q_proj, k_proj, v_proj and g_proj).
    o_norm [E]: the RMS norm's scale, shared by the heads.
    o_proj {kernel [Hv, E, out_features]} (Qwen3-Next's out_proj).

  Args:
    num_heads: H, the q/k heads.
    in_features: F, features of the inputs (the models' hidden_size).
    num_v_heads: Hv, a multiple of H (default H).
    head_dim: D (default in_features // num_heads).
    value_head_dim: E (default head_dim).
    out_features: output features (default in_features).
    gate: "kda" (default; per-key-channel decay), "scalar" (one decay per head
      and token: Gated DeltaNet) or None (DeltaNet).
    gate_rank: rank of the KDA gate's projection f_a_proj -> f_b_proj (default
      value_head_dim, as Kimi Linear).
    output_gate_activation: "sigmoid" (default; Kimi Linear), "silu"
      (Qwen3-Next) or None (no output gate: a plain RMS norm).
    output_gate_rank: rank of the low-rank output gate g_a_proj -> g_b_proj
      (default value_head_dim, as Kimi Linear).
    full_rank_output_gate: one g_proj [F, Hv, E] instead (Qwen3-Next, Kimi's
      `use_full_rank_output_gate`).
    allow_neg_eigval: beta = 2 sigmoid(.) in [0, 2] (Grazzi et al., 2025).
    conv_size: K, the short convolutions' kernel size (default 4; no bias).
    norm_eps: epsilon of the output RMS norm (default 1e-6, the models'
      rms_norm_eps; the L2 norm of q and k uses 1e-6 as the models do).
    scale: multiplies q in the op; default D ** -0.5.
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: parameter dtype (default float32).
    precision: precision of the projections.
    kernel_init, bias_init: of the projections. The convolution kernels start
      uniform in +-1/sqrt(K), A_log at log(uniform(1, 16)), dt_bias and o_norm
      at 1.
    use_bias: biases on every projection (default False: the models have none).
    decode: consume tokens against the decode cache (`init_cache`) and update
      it; overridable per call.
    impl: passed to `delta_attention` ("auto", "pallas", "xla" or "reference").
    mesh, batch_axes, head_axis, sequence_axis: several devices. With a
      `jax.sharding.Mesh`, the op runs through `sharded_delta_attention` with
      B split over batch_axes, Hv over head_axis and T over sequence_axis
      (sequence parallelism; a name each, batch_axes also a tuple); the
      projections and convolutions around it are jnp, which XLA splits by
      itself. Without a mesh, sequence_axis alone: the layer is called inside
      your own `jax.shard_map` with T split over that axis; each device's
      slice takes the previous device's last conv_size - 1 inputs as its
      convolution window (one collective permute each) and runs
      `delta_attention` with this `sequence_axis`. sequence_axis not with
      decode.

  Call: `layer(inputs, *, segment_ids=None, decode=None)`, inputs [B, T,
  in_features] -> [B, T, out_features]. segment_ids: None or int [B, T], packed
  sequences. A segment is a maximal run of equal ids in a row; a token sees only
  the earlier tokens of its own segment, in the recurrence and in the
  convolutions (give padding an id of its own). With decode (this argument, else
  the attribute) the T tokens continue the sequences held in the decode cache
  and update it: T == 1 is one jnp step of the recurrence, T > 1 a chunked
  prefill. The cache holds per row the state and the convolution windows at the
  end of its last segment and that segment's id; a call's first segment in a row
  continues them when its id equals the cached id, else it starts afresh. So
  one-token steps with [B, 1] ids continue or restart each row (continuous
  batching), and calls without segment_ids continue every row's last segment.
  When decoding after a packed prefill, pad prompts on the left.
  """
