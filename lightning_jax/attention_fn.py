"""`attention_fn`: Lightning Attention as the `attention_fn` of Flax's attention layers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from lightning_jax import _layer_common as common

__all__ = ["attention_fn"]


def _check_mask(mask, length):
  """Accepts only masks that are exactly causal: the one pattern linear attention computes."""
  if mask is None:
    return
  if isinstance(mask, jax.core.Tracer):
    raise ValueError(
        "attention_fn got a traced mask (built inside jit), so it cannot check that the mask is causal. "
        "Lightning attention is always causal: pass mask=None (it needs no causal mask).")
  mask = np.asarray(mask).astype(bool)
  causal = np.tril(np.ones((length, length), bool))
  try:
    is_causal = bool(np.all(np.broadcast_to(mask, np.broadcast_shapes(mask.shape, causal.shape)) == causal))
  except ValueError:  # shape not broadcastable to [..., T, T]
    is_causal = False
  if not is_causal:
    raise ValueError(
        f"attention_fn cannot honour an arbitrary attention mask (got shape {mask.shape}): lightning attention "
        "is causal linear attention with no attention matrix to mask. Pass mask=None or a causal mask; for "
        "packed sequences (a block-diagonal causal mask) pass segment_ids to LightningAttention or "
        "lightning_attention instead.")


def attention_fn(decay=None, *, layer_idx: int | None = None, num_layers: int | None = None,
                 scale: float | None = None, impl: str = "auto", variant: str = "auto", config=None,
                 interpret: bool | None = None):
  """Returns an `attention_fn` running causal Lightning Attention, for
  `nnx.MultiHeadAttention(attention_fn=...)` and
  `linen.MultiHeadDotProductAttention(attention_fn=...)`.

  Self-attention only (key and value as long as the query), always causal:
  `is_causal` is accepted whatever its value, and `mask` must be None or exactly
  the causal mask (checked, so it must be concrete, not built under jit). Errors
  are raised for what linear attention cannot honour: other masks, a `bias`,
  attention dropout (dropout_rate > 0 when not deterministic), sowing attention
  weights (`module`, from sow_weights=True) and custom einsums. `precision` and
  `force_fp32_for_softmax` are accepted and unused (the op accumulates in
  float32). Grouped key/value heads are repeated to the query heads. Note that
  the softmax layers' [B, T_max] decode cache does not fit linear attention:
  decode with `LightningAttention` instead. Packed sequences likewise: Flax
  passes their segments as a (usually traced) mask, which cannot be checked;
  pass `segment_ids` to `LightningAttention` or `lightning_attention`.

  Args:
    decay: None (no decay), "alibi", "minimax" (needs layer_idx and
      num_layers) or a concrete [H] array of rates >= 0; see `alibi_slopes`
      and `minimax_slopes`. Resolved for the number of query heads.
    layer_idx, num_layers: the depth used by decay="minimax".
    scale: multiplies q; default head_dim ** -0.5 (as dot-product attention).
    impl, variant, config, interpret: passed to `lightning_attention`.

  Returns:
    fn(query [batch..., T, H, D], key [batch..., T, H_kv, D], value
    [batch..., T, H_kv, E], **flax_kwargs) -> [batch..., T, H, E].
  """
  common.check_decay(decay, layer_idx, num_layers)

  def fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None, dropout_rate=0.0,
         deterministic=False, dtype=None, precision=None, module=None, is_causal=False,
         force_fp32_for_softmax=False, qk_attn_weights_einsum=None, attn_weights_value_einsum=None):
    del broadcast_dropout, dropout_rng, precision, is_causal, force_fp32_for_softmax  # see the docstring
    if bias is not None:
      raise ValueError("attention_fn cannot add an attention bias: lightning attention forms no attention logits")
    if dropout_rate > 0 and not deterministic:
      raise ValueError(f"attention_fn cannot apply attention dropout (dropout_rate={dropout_rate}): lightning "
                       "attention forms no attention weights. Use dropout_rate=0 or deterministic=True.")
    if module is not None:
      raise ValueError("attention_fn cannot sow attention weights (sow_weights=True): lightning attention "
                       "never forms the [T, T] weights")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
      raise ValueError("attention_fn does not support custom attention einsums")
    if not (query.ndim == key.ndim == value.ndim >= 3):
      raise ValueError(f"query, key, value must be [batch..., T, H, D] of one rank, got shapes "
                       f"{query.shape}, {key.shape}, {value.shape}")
    *batch, length, heads, head_dim = query.shape
    if key.shape[:-2] != query.shape[:-2] or value.shape[:-1] != key.shape[:-1]:
      raise ValueError(
          f"attention_fn computes causal self-attention: key and value need the query's batch dims and length "
          f"and one head count (got query {query.shape}, key {key.shape}, value {value.shape}). For decoding "
          "with a cache use LightningAttention(decode=True).")
    if heads % key.shape[-2]:
      raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({key.shape[-2]})")
    _check_mask(mask, length)
    rates = common.decay_rates(decay, heads, layer_idx, num_layers)

    dtype = dtype or jnp.result_type(query, key, value)
    n = math.prod(batch)
    q = query.astype(dtype).reshape(n, length, heads, head_dim)
    k, v = (jnp.repeat(x.astype(dtype), heads // key.shape[-2], axis=-2).reshape(n, length, heads, x.shape[-1])
            for x in (key, value))
    o = common.linear_attention(q, k, v, None if rates is None else jnp.asarray(rates), scale=scale, impl=impl,
                                variant=variant, config=config, interpret=interpret)
    return o.reshape(*batch, length, heads, value.shape[-1])

  return fn
