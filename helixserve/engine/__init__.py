"""Model execution for one layer range on one device.

Two engines behind one interface (`registry`): `torch`, our Llama-family model code, paged KV
cache, batched forward, sampling and weight loading (safetensors, GGUF); and `vllm`
(`vllm_stage`), vLLM's model runner and paged KV for a layer range, an optional extra.
Requests arrive as the torch-free types of `helixserve.request`.
Knows nothing about networks or clusters; `runtime/` wraps it.
"""

from helixserve.engine.config import ModelArgs
from helixserve.engine.demo import demo_model_dir, prepare_demo_model
from helixserve.engine.kv_cache import KVCacheFullError
from helixserve.engine.registry import ENGINE_CHOICES, ENGINES, load_engine, resolve_engine
from helixserve.engine.shard import ItemOutput, ShardEngine, WorkItem

__all__ = [
    "ENGINES",
    "ENGINE_CHOICES",
    "ItemOutput",
    "KVCacheFullError",
    "ModelArgs",
    "ShardEngine",
    "WorkItem",
    "demo_model_dir",
    "load_engine",
    "prepare_demo_model",
    "resolve_engine",
]
