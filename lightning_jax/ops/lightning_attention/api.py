"""Public entry point: `lightning_attention`."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from lightning_jax.ops.lightning_attention import config as config_lib
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention import reference
from lightning_jax.ops.lightning_attention import vjp
from lightning_jax.ops.lightning_attention import xla

IMPLS = ("auto", "pallas", "xla", "reference")
VARIANTS = ("auto", "chunk_loop", "parallel", "warp_specialized")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_HEAD_DIM = 256
XLA_CHUNK_SIZE = 64


def _check_float(name, x):
  if not any(x.dtype == d for d in DTYPES):
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def validate_options(*, scale, impl, variant, config):
  """Checks the static options shared by the op and the layers that pass them on."""
  if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)
                            or not np.isfinite(scale)):
    raise TypeError(f"scale must be None or a finite Python float, got {scale!r}")
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if variant not in VARIANTS:
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
  if config is not None and not isinstance(config, config_lib.LightningConfig):
    raise TypeError(f"config must be a LightningConfig or None, got {type(config).__name__}")


def _validate(q, k, v, decay, scale, initial_state, impl, variant, config, interpret, return_final_state):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, H, D], got shape {q.shape}")
  b, t, h, d = q.shape
  if k.shape != q.shape:
    raise ValueError(f"k must be [B, T, H, D] = {q.shape} like q, got shape {k.shape}")
  if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
    raise ValueError(f"v must be [B, T, H, E] = [{b}, {t}, {h}, E] to match q, got shape {v.shape}")
  e = v.shape[-1]
  if min(b, h) < 1 or t < 1:
    raise ValueError(f"q, k, v need B, T, H >= 1, got q.shape={q.shape}")
  for name, dim in (("D (q.shape[-1])", d), ("E (v.shape[-1])", e)):
    if not 1 <= dim <= MAX_HEAD_DIM:
      raise ValueError(f"head dim {name} must be in [1, {MAX_HEAD_DIM}], got {dim}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    _check_float(name, x)
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if decay is not None:
    if not hasattr(decay, "shape") or decay.shape != (h,):
      raise ValueError(f"decay must be None or a [H] = [{h}] array, got "
                       f"{getattr(decay, 'shape', type(decay).__name__)}")
    if not jnp.issubdtype(decay.dtype, jnp.floating):
      raise TypeError(f"decay must be a floating array, got {decay.dtype}")
    if not isinstance(decay, jax.core.Tracer) and bool(np.any(np.asarray(decay) < 0)):
      raise ValueError(f"decay rates must be >= 0 (lambda = exp(-decay) <= 1), got {np.asarray(decay)}")
  if initial_state is not None:
    if not hasattr(initial_state, "shape") or initial_state.shape != (b, h, d, e):
      raise ValueError(f"initial_state must be [B, H, D, E] = [{b}, {h}, {d}, {e}], got "
                       f"{getattr(initial_state, 'shape', type(initial_state).__name__)}")
    if not jnp.issubdtype(initial_state.dtype, jnp.floating):
      raise TypeError(f"initial_state must be a floating array (float32), got {initial_state.dtype}")
  validate_options(scale=scale, impl=impl, variant=variant, config=config)
  if interpret is not None and not isinstance(interpret, bool):
    raise TypeError(f"interpret must be None or a bool, got {interpret!r}")
  if not isinstance(return_final_state, bool):
    raise TypeError(f"return_final_state must be a bool, got {return_final_state!r}")


def lightning_attention(q, k, v, decay=None, *, scale=None, initial_state=None, return_final_state=False,
                        impl="auto", variant="auto", config=None, interpret=None):
  r"""Causal linear attention with optional per-head decay (Lightning Attention-2).

  With a = exp(-decay_h) (a = 1 without decay), for every batch and head:

      S_t = a * S_{t-1} + k_t^T v_t,        S_0 = initial_state (zeros if None)
      o_t = scale * q_t S_t

  i.e. o_t = scale * (sum_{j<=t} a^(t-j) (q_t . k_j) v_j + a^t q_t S_0), in O(T).

  Args:
    q, k: [B, T, H, D]. v: [B, T, H, E]. Any T >= 1 and D, E in [1, 256];
      float32, bfloat16 or float16 (one dtype for all three).
    decay: None, or [H] non-negative rates (lambda = exp(-rate); the
      Lightning Attention-2 / TransNormerLLM / MiniMax-01 convention).
      Differentiable.
    scale: multiplies q; default D ** -0.5. `scale=1.0` matches the original
      Lightning Attention-2 kernels.
    initial_state: [B, H, D, E] state S_0 (computed in float32); differentiable.
    return_final_state: also return S_T, float32 [B, H, D, E] (its cotangent is
      accepted), for chunked prefill and recurrent decoding.
    impl: "pallas" (Triton kernels; interpret mode without a supported GPU),
      "xla" (chunked jnp, O(T)), "reference" (token-serial scan, the oracle) or
      "auto" (pallas on NVIDIA GPUs with compute capability >= 8.0, else xla).
    variant: pallas only: "chunk_loop", "parallel", "warp_specialized" or
      "auto". "warp_specialized" is a Mosaic GPU forward for sm90 (bf16/fp16,
      D <= 128, E <= 256, jax >= 0.11; the backward pass runs the chunk_loop
      sweeps); "auto" picks it where it is faster.
    config: a `LightningConfig` overriding, field by field, the active tuning
      cache (see `use_tuning_cache`) and the per-device block heuristics
      (its `slice_size` sets the sequence split, which otherwise runs slices
      of a long sequence in parallel where few (batch, head) pairs would
      leave the GPU idle).
    interpret: force (True) or forbid (False) Pallas interpret mode.

  The kernels run on the device of q (under `jax.jit`, the default device);
  their blocks and variant follow that device (see `heuristics`).

  Returns:
    o: [B, T, H, E] in the input dtype; with return_final_state, (o, S_T).
  """
  _validate(q, k, v, decay, scale, initial_state, impl, variant, config, interpret, return_final_state)
  b, t, h, d = q.shape
  scale = float(d ** -0.5 if scale is None else scale)
  decay = None if decay is None else decay.astype(jnp.float32)
  initial_state = None if initial_state is None else initial_state.astype(jnp.float32)

  device = heuristics.device_of(q, k, v)
  cc = heuristics.compute_capability(device)
  if impl == "auto":
    impl = "pallas" if heuristics.supported_gpu(cc) else "xla"

  if impl == "pallas":
    interpret = (not heuristics.supported_gpu(cc)) if interpret is None else interpret
    variant = heuristics.pallas_variant(variant, d=d, e=v.shape[-1], dtype=q.dtype, compute_capability=cc,
                                        interpret=interpret)
    opts = config_lib.PallasOptions(scale=scale, return_final_state=return_final_state, variant=variant,
                                    config=config, compute_capability=cc, num_sms=heuristics.num_sms(device),
                                    interpret=interpret)
    return vjp.lightning_attention_pallas(q, k, v, decay, initial_state, opts)

  if impl == "xla":
    o, final_state = xla.lightning_attention_chunked(q, k, v, decay, scale=scale, initial_state=initial_state,
                                                     chunk_size=XLA_CHUNK_SIZE)
  else:
    o, final_state = reference.lightning_attention_recurrent(q, k, v, decay, scale=scale,
                                                             initial_state=initial_state)
  o = o.astype(q.dtype)
  return (o, final_state) if return_final_state else o
