"""The `helixserve` command: parses flags and calls the layers that do the work.

Each subcommand lives in `helixserve/commands/<name>.py` with two functions:
`register(subparsers)` adds its parser (and sets `func`), and the function set as `func`
takes the parsed args and returns an exit code. Command modules import only the standard
library at module level, so `helixserve plan` runs without torch, grpc or fastapi.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from helixserve import __version__
from helixserve.commands.args import ArgumentParser
from helixserve.errors import UserError

# Order is the order shown in --help.
COMMAND_MODULES = (
    "plan",
    "evaluate",
    "simulate",
    "model",
    "profile",
    "worker",
    "serve",
    "demo",
    "bench",
    "rehearse",
    "deploy",
    "certs",
)


#: the optional dependencies by the extra of pyproject.toml that brings them (the top-level
#: module name); a command that imports one of them on a control-plane install gets one line
#: naming the extra, not a traceback
EXTRAS = {
    "engine": ("torch", "safetensors", "tokenizers", "transformers", "gguf", "accelerate",
               "psutil"),
    "serve": ("grpc", "grpc_health", "google", "fastapi", "uvicorn", "prometheus_client",
              "httpx", "openai", "cryptography"),
    "vllm": ("vllm",),
}


#: the extra each command that needs one runs on (`serve` includes `engine`)
COMMAND_EXTRAS = {"worker": "serve", "serve": "serve", "demo": "serve", "bench": "serve",
                  "certs": "serve", "profile": "engine", "model": "engine"}


def missing_extra(module: str | None) -> str | None:
    """The extra that installs `module` (None: not an optional dependency)."""
    top = (module or "").split(".")[0]
    return next((extra for extra, mods in EXTRAS.items() if top in mods), None)


def build_parser() -> argparse.ArgumentParser:
    # every parser one line on a usage error (commands.args); subparsers of subparsers
    # (deploy k8s) take their parent's class
    parser = ArgumentParser(
        prog="helixserve",
        description="Serve one LLM from a cluster of mixed GPUs (Helix max-flow placement).",
    )
    parser.add_argument("--version", action="version", version=f"helixserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"helixserve.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"helixserve.commands.{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except UserError as exc:
        print(f"helixserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc.name)
        if extra is None:
            raise
        if extra != "vllm":  # what the whole command needs, not only this first package
            extra = COMMAND_EXTRAS.get(args.command, extra)
        print(f"helixserve {args.command}: error: this command needs the Python package "
              f"{(exc.name or '').split('.')[0]!r}, which the control-plane install (pip install -e .) "
              f"leaves out: install the {extra!r} extra, pip install -e '.[{extra}]' in a "
              f"clone (or pip install 'helixserve[{extra}]')", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`helixserve evaluate --json | head`): stop quietly, as
        # cat does, and keep Python's exit-time flush from raising again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
