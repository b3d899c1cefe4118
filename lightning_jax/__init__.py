"""lightning_jax: Lightning Attention (chunked causal linear attention) for JAX."""

from lightning_jax.ops.lightning_attention import (
    ChunkLoopConfig,
    ChunkOutputConfig,
    ChunkStatesConfig,
    LightningConfig,
    TuningCache,
    TuningEntry,
    WarpSpecializedConfig,
    lightning_attention,
    lightning_attention_chunked,
    lightning_attention_quadratic,
    lightning_attention_recurrent,
    segment_ids_from_cu_seqlens,
    sharded_lightning_attention,
    use_tuning_cache,
)
from lightning_jax.attention_fn import attention_fn
from lightning_jax.ops.delta_attention import (
    DeltaConfig,
    delta_attention,
    delta_attention_chunked,
    delta_attention_recurrent,
    sharded_delta_attention,
)
from lightning_jax.slopes import alibi_slopes, minimax_slopes

__version__ = "0.1.0"

__all__ = [
    "ChunkLoopConfig",
    "ChunkOutputConfig",
    "ChunkStatesConfig",
    "DeltaConfig",
    "LightningConfig",
    "TuningCache",
    "TuningEntry",
    "WarpSpecializedConfig",
    "alibi_slopes",
    "attention_fn",
    "delta_attention",
    "delta_attention_chunked",
    "delta_attention_recurrent",
    "lightning_attention",
    "lightning_attention_chunked",
    "lightning_attention_quadratic",
    "lightning_attention_recurrent",
    "minimax_slopes",
    "segment_ids_from_cu_seqlens",
    "sharded_delta_attention",
    "sharded_lightning_attention",
    "use_tuning_cache",
]


def __getattr__(name):
  # The Flax layers live in lightning_jax.nnx and lightning_jax.linen, imported
  # (with flax) on first use rather than with the package.
  if name in ("nnx", "linen"):
    import importlib
    return importlib.import_module(f"lightning_jax.{name}")
  raise AttributeError(f"module 'lightning_jax' has no attribute {name!r}")
