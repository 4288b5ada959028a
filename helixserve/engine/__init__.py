"""Model execution for one layer range on one device.

Llama-family model code, paged KV cache, batched forward, sampling and weight loading
(safetensors, GGUF). Requests arrive as the torch-free types of `helixserve.request`.
Knows nothing about networks or clusters; `runtime/` wraps it.
"""

from helixserve.engine.config import ModelArgs
from helixserve.engine.demo import demo_model_dir, prepare_demo_model
from helixserve.engine.kv_cache import KVCacheFullError
from helixserve.engine.shard import ItemOutput, ShardEngine, WorkItem

__all__ = [
    "ItemOutput",
    "KVCacheFullError",
    "ModelArgs",
    "ShardEngine",
    "WorkItem",
    "demo_model_dir",
    "prepare_demo_model",
]
