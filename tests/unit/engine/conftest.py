"""Session fixtures for the engine tests: the demo model (prepared once), its tokenizer
and transformers reference, and small random-weight models of each family variant."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_testlib import make_random_model

from helixserve.engine import ShardEngine, prepare_demo_model


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """One intra-op thread: the CI machine is shared, and OpenMP threads spinning on an
    oversubscribed CPU made these tests 10-20x slower. Restored after each module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    return prepare_demo_model()


@pytest.fixture(scope="session")
def demo_tokenizer(demo_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_dir)


@pytest.fixture(scope="session")
def demo_prompt(demo_tokenizer) -> list[int]:
    ids = demo_tokenizer.apply_chat_template(
        [{"role": "user", "content": "List three facts about the planet Mars."}],
        add_generation_prompt=True,
    )
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return list(ids)


@pytest.fixture(scope="session")
def demo_engine(demo_dir: Path) -> ShardEngine:
    """Whole model; tests use unique request ids and free them."""
    return ShardEngine.load(demo_dir, 0, 30, kv_cache_bytes=96 << 20)


@pytest.fixture(scope="session")
def demo_hf(demo_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def random_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random-weight models covering the family's variants."""
    root = tmp_path_factory.mktemp("random_models")
    return {
        # qwen2: q/k/v bias, untied head.
        "qwen2": make_random_model(root / "qwen2", "qwen2"),
        # llama3 rope scaling (long wavelengths scaled), tied embeddings, sharded checkpoint.
        "llama3": make_random_model(
            root / "llama3",
            "llama",
            max_shard_size="100KB",
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        # mistral config, no GQA (kv heads = heads).
        "mistral": make_random_model(root / "mistral", "mistral", num_key_value_heads=4),
    }
