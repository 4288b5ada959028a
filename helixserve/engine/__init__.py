"""Model execution for one layer range on one device.

Three engines behind one interface (`protocol.Engine`, chosen by name in `registry`):
`torch`, our Llama-family model code, paged KV cache, batched forward, sampling and weight
loading (safetensors, GGUF); `vllm` (`vllm_stage`), vLLM's model runner and paged KV for a
layer range, an optional extra; and `emulated` (`emulated`), no weights: each step takes the
time measured profiles give for a GPU, with real KV accounting and activation sizes.
Requests arrive as the torch-free types of `helixserve.request` and `protocol`; a failed
step raises a class of `errors`. Knows nothing about networks or clusters; `runtime/` wraps it.

Importing this package imports no torch: the names below are loaded when first used, so
that the emulated engine (and `protocol`, `errors`, `kv_blocks`) run where torch is absent.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real names for type checkers; at run time see __getattr__
    from helixserve.engine.config import ModelArgs
    from helixserve.engine.demo import demo_model_dir, prepare_demo_model
    from helixserve.engine.errors import EngineError, InvalidWorkError, KvExhaustedError
    from helixserve.engine.protocol import Engine, ItemOutput, RawHidden, WorkItem
    from helixserve.engine.registry import ENGINE_CHOICES, ENGINES, load_engine, resolve_engine
    from helixserve.engine.shard import ShardEngine

#: public name -> module that defines it
_EXPORTS = {
    "ENGINES": "registry",
    "ENGINE_CHOICES": "registry",
    "load_engine": "registry",
    "resolve_engine": "registry",
    "Engine": "protocol",
    "ItemOutput": "protocol",
    "WorkItem": "protocol",
    "RawHidden": "protocol",
    "EngineError": "errors",
    "InvalidWorkError": "errors",
    "KvExhaustedError": "errors",
    "ModelArgs": "config",
    "demo_model_dir": "demo",
    "prepare_demo_model": "demo",
    "ShardEngine": "shard",
}

__all__ = [
    "ENGINES",
    "ENGINE_CHOICES",
    "Engine",
    "EngineError",
    "InvalidWorkError",
    "ItemOutput",
    "KvExhaustedError",
    "ModelArgs",
    "RawHidden",
    "ShardEngine",
    "WorkItem",
    "demo_model_dir",
    "load_engine",
    "prepare_demo_model",
    "resolve_engine",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'helixserve.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"helixserve.engine.{module}"), name)
    globals()[name] = value
    return value
