"""lightning_jax: Lightning Attention (chunked causal linear attention) for JAX."""

from lightning_jax.ops.lightning_attention import (
    ChunkLoopConfig,
    ChunkOutputConfig,
    ChunkStatesConfig,
    LightningConfig,
    lightning_attention,
    lightning_attention_chunked,
    lightning_attention_quadratic,
    lightning_attention_recurrent,
)

__version__ = "0.1.0"

__all__ = [
    "ChunkLoopConfig",
    "ChunkOutputConfig",
    "ChunkStatesConfig",
    "LightningConfig",
    "lightning_attention",
    "lightning_attention_chunked",
    "lightning_attention_quadratic",
    "lightning_attention_recurrent",
]
