"""Delta attention: DeltaNet, Gated DeltaNet and Kimi Delta Attention (chunked WY form), packed sequences."""

from lightning_jax.ops.delta_attention.api import delta_attention
from lightning_jax.ops.delta_attention.api import sharded_delta_attention
from lightning_jax.ops.delta_attention.pallas_triton import DeltaConfig
from lightning_jax.ops.delta_attention.reference import delta_attention_recurrent
from lightning_jax.ops.delta_attention.xla import delta_attention_chunked

__all__ = ["DeltaConfig", "delta_attention", "delta_attention_chunked", "delta_attention_recurrent",
           "sharded_delta_attention"]
