"""Property-based fuzzing of the OpenAI API with schemathesis: server errors must be 0.

Starts `helixserve demo` (3 TLS workers, SmolLM2-135M on CPU; or use --url for a running
server), fetches its /openapi.json, bounds the generated `max_tokens` / `max_completion_tokens`
(and `n`) in the copy of the schema given to the fuzzer, and gives requests without one
max_tokens = 8 (benchmarks/api_fuzz_hooks.py): any max_tokens is served in full, so an
unbounded run never finishes; the API itself keeps its limits and defaults. Then runs
`st run --checks not_a_server_error` over the chosen phases. Prints a table and writes JSON.

    pip install schemathesis
    python -m benchmarks.api_fuzz --phases examples,coverage,fuzzing --max-examples 30 \
        --json benchmarks/results/api_fuzz.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from helixserve.local.launch import free_port, wait_http_ready

API_KEY = "sk-fuzz"
#: generated max_tokens-like fields are bounded to this in the fuzzer's copy of the schema
MAX_GENERATED_TOKENS = 8
#: and the number of choices per request
MAX_GENERATED_CHOICES = 2
BOUNDED = {"max_tokens": MAX_GENERATED_TOKENS, "max_completion_tokens": MAX_GENERATED_TOKENS,
           "n": MAX_GENERATED_CHOICES}


def bound_schema(node: Any) -> int:
    """Cap the BOUNDED integer fields wherever they appear (also inside anyOf); the count."""
    count = 0
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict):
            for name, cap in BOUNDED.items():
                if name in props:
                    count += _cap(props[name], cap)
        for value in node.values():
            count += bound_schema(value)
    elif isinstance(node, list):
        for value in node:
            count += bound_schema(value)
    return count


def _cap(prop: dict[str, Any], cap: int) -> int:
    branches = prop.get("anyOf") or [prop]
    n = 0
    for b in branches:
        if b.get("type") == "integer":
            b["maximum"] = min(int(b.get("maximum", cap)), cap)
            n += 1
    return n


def start_demo(workdir: Path, port: int) -> subprocess.Popen[bytes]:
    log = (workdir / "demo.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "helixserve", "demo", "--workdir", str(workdir), "--port",
         str(port), "--api-key", API_KEY],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def summarize(ndjson: Path) -> dict[str, Any]:
    """Counts from schemathesis' ndjson event stream: test cases (API calls), failures by
    check, server errors (5xx)."""
    cases = 0
    statuses: dict[str, int] = {}
    failures: dict[str, int] = {}
    for line in ndjson.read_text().splitlines():
        event = json.loads(line)
        for name, body in event.items():
            if name != "ScenarioFinished":
                continue
            recorder = body.get("recorder", {})
            for interactions in recorder.get("interactions", {}).values():
                response = interactions.get("response") or {}
                code = str(response.get("status_code", "none"))
                statuses[code] = statuses.get(code, 0) + 1
                cases += 1
            for checks in recorder.get("checks", {}).values():
                for check in checks:
                    if check.get("status") == "FAILURE":
                        failures[check["name"]] = failures.get(check["name"], 0) + 1
    server_errors = sum(v for k, v in statuses.items() if k.startswith("5"))
    return {"api_calls": cases, "status_codes": dict(sorted(statuses.items())),
            "failed_checks": failures, "server_errors": server_errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start the demo)")
    ap.add_argument("--phases", default="examples,coverage,fuzzing")
    ap.add_argument("--max-examples", type=int, default=30)
    ap.add_argument("--max-time", type=int, default=None, help="seconds for the whole run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    st = shutil.which("st")
    if st is None:
        raise SystemExit("schemathesis is not installed: pip install schemathesis")
    work = Path(tempfile.mkdtemp(prefix="helix-fuzz-"))
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_demo(work, port)
    try:
        wait_http_ready(url, proc, 600.0, work / "demo.log" if proc is not None else None)
        schema = httpx.get(url + "/openapi.json", timeout=10).json()
        capped = bound_schema(schema)
        (work / "openapi.json").write_text(json.dumps(schema))
        cmd = [st, "run", str(work / "openapi.json"), "--url", url,
               "-H", f"Authorization: Bearer {API_KEY}", "--checks", "not_a_server_error",
               "--phases", args.phases, "--max-examples", str(args.max_examples),
               "--seed", str(args.seed), "--workers", "2", "--request-timeout", "120",
               "--report", "ndjson", "--report-ndjson-path", str(work / "events.ndjson"),
               "--no-color", "--continue-on-failure"]  # fmt: skip
        if args.max_time:
            cmd += ["--max-time", str(args.max_time)]
        t0 = time.monotonic()
        hooks_env = dict(os.environ, SCHEMATHESIS_HOOKS="api_fuzz_hooks", PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
        run = subprocess.run(cmd, capture_output=True, text=True, env=hooks_env)
        wall_s = time.monotonic() - t0
        print(run.stdout[-3000:])
        result = summarize(work / "events.ndjson")
        result.update(phases=args.phases, max_examples=args.max_examples, seed=args.seed,
                      wall_s=round(wall_s, 1), schemathesis_exit_code=run.returncode,
                      bounded_fields=capped, max_generated_tokens=MAX_GENERATED_TOKENS)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    print(f"{'phases':<28} {'API calls':>9} {'5xx':>5} {'failed checks':<20} {'wall s':>7}")
    print(f"{args.phases:<28} {result['api_calls']:>9} {result['server_errors']:>5} "
          f"{json.dumps(result['failed_checks']):<20} {result['wall_s']:>7}")
    print("status codes:", result["status_codes"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["server_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
