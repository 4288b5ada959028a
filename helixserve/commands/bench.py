"""`helixserve bench`: load-test any OpenAI-compatible server, like vLLM's `bench serve`."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from helixserve.commands.args import finite_float


def _rate(text: str) -> float:
    if text.lower() in ("inf", "infinity"):
        return float("inf")
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'inf', got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or 'inf'), got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server (throughput, TTFT, TPOT, ITL, E2E)",
        description="Stream requests at an OpenAI-compatible server and report request and "
        "output-token throughput and TTFT/TPOT/ITL/E2E latency (mean, p50, p90, p99).",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", default=os.environ.get("HELIXSERVE_API_KEY"))
    p.add_argument("--dataset", choices=("azure-conv", "random"), default="random")
    p.add_argument("--dataset-path", type=Path, default=None, help="azure-conv trace CSV")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=_rate, default=float("inf"), help="req/s or 'inf'")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=finite_float, default=0.0)
    p.add_argument(
        "--max-input-len", type=int, default=None, help="azure-conv: scale prompts to fit"
    )
    p.add_argument(
        "--max-output-len", type=int, default=None, help="azure-conv: scale outputs to fit"
    )
    p.add_argument("--temperature", type=finite_float, default=0.0)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="send this max_tokens and let outputs end at EOS (default: force each "
        "request's dataset output length with max_tokens + ignore_eos)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=finite_float, default=600.0)
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results here")
    p.set_defaults(func=run)


def _first_model(url: str, api_key: str | None) -> str:
    import httpx

    from helixserve.errors import UserError

    root = url.rstrip("/")
    root = root if root.endswith("/v1") else root + "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(root + "/models", headers=headers, timeout=30.0)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise UserError(f"--url: cannot list models at {root}/models: {exc}") from None


def run(args: argparse.Namespace) -> int:
    import asyncio

    from helixserve.bench.client import ClientConfig, probe, run_requests
    from helixserve.bench.datasets import default_trace_path, load_azure_conv, make_random
    from helixserve.bench.report import format_table, summarize
    from helixserve.commands.args import Output, check_output, write_outputs
    from helixserve.errors import UserError

    if args.num_prompts < 1:
        raise UserError(f"--num-prompts: must be >= 1, got {args.num_prompts}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UserError(f"--max-tokens: must be >= 1, got {args.max_tokens}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UserError(f"--max-concurrency: must be >= 1, got {args.max_concurrency}")
    # before the run: a path that cannot be written fails now (missing directories are made)
    if args.json is not None:
        check_output("--json", args.json, make_parents=True)
    if args.dataset == "azure-conv":
        requests = load_azure_conv(
            args.dataset_path or default_trace_path(),
            args.num_prompts,
            args.seed,
            args.max_input_len,
            args.max_output_len,
        )
    else:
        requests = make_random(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    model = args.model or _first_model(args.url, args.api_key)
    cfg = ClientConfig(
        base_url=args.url,
        model=model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        timeout_s=args.timeout_s,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
    )
    check = asyncio.run(probe(cfg))
    if not check.success:
        raise UserError(f"--url {args.url} --model {model}: test request failed: {check.error}")
    print(
        f"bench: {len(requests)} requests ({args.dataset}) to {args.url} model {model!r}, "
        f"rate {args.request_rate}/s, max concurrency {args.max_concurrency or 'unlimited'}"
    )
    results, duration_s = asyncio.run(run_requests(cfg, requests))
    report = summarize(results, duration_s)
    print(format_table(report))
    if args.json is not None:
        out = {
            "config": {
                "url": args.url,
                "model": model,
                "endpoint": args.endpoint,
                "dataset": args.dataset,
                "num_prompts": args.num_prompts,
                "request_rate": str(args.request_rate),
                "max_concurrency": args.max_concurrency,
                "random_input_len": args.random_input_len,
                "random_output_len": args.random_output_len,
                "max_input_len": args.max_input_len,
                "max_output_len": args.max_output_len,
                "seed": args.seed,
            },
            **report.to_dict(),
        }
        text = json.dumps(out, indent=2) + "\n"
        write_outputs([Output("--json", args.json, lambda path: path.write_text(text))])
    return 0 if report.failed == 0 else 1
