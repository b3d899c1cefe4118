"""Lightning Attention: chunked causal linear attention with per-head or per-token decay, packed sequences."""

from lightning_jax.ops.lightning_attention.api import lightning_attention, sharded_lightning_attention
from lightning_jax.ops.lightning_attention.config import (
    ChunkLoopConfig,
    ChunkOutputConfig,
    ChunkStatesConfig,
    LightningConfig,
    WarpSpecializedConfig,
)
from lightning_jax.ops.lightning_attention.packing import segment_ids_from_cu_seqlens
from lightning_jax.ops.lightning_attention.reference import (
    lightning_attention_quadratic,
    lightning_attention_recurrent,
)
from lightning_jax.ops.lightning_attention.tuning_cache import TuningCache, TuningEntry, use_tuning_cache
from lightning_jax.ops.lightning_attention.xla import lightning_attention_chunked

__all__ = [
    "ChunkLoopConfig",
    "ChunkOutputConfig",
    "ChunkStatesConfig",
    "LightningConfig",
    "TuningCache",
    "TuningEntry",
    "WarpSpecializedConfig",
    "lightning_attention",
    "lightning_attention_chunked",
    "lightning_attention_quadratic",
    "lightning_attention_recurrent",
    "segment_ids_from_cu_seqlens",
    "sharded_lightning_attention",
    "use_tuning_cache",
]
