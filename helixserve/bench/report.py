"""Throughput and latency percentiles of a benchmark run, as a table and as JSON.

Definitions follow vLLM's `bench serve`: TTFT is send -> first generated text; TPOT is
(E2E - TTFT) / (output tokens - 1) per request; ITL is every gap between successive
streamed chunks, pooled over requests; E2E is send -> last chunk. Output throughput is all
generated tokens / wall-clock duration of the run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from helixserve.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class LatencyStats:
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of(cls, values_s: list[float]) -> LatencyStats:
        ms = [v * 1000.0 for v in values_s]
        mean = sum(ms) / len(ms) if ms else 0.0
        return cls(mean, *(percentile(ms, q) for q in PERCENTILES))


@dataclass
class BenchReport:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput_per_s: float
    output_throughput_tokens_per_s: float
    total_throughput_tokens_per_s: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    errors: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: list[RequestResult], duration_s: float) -> BenchReport:
    ok = [r for r in results if r.success]
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    return BenchReport(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput_per_s=len(ok) / duration,
        output_throughput_tokens_per_s=out_tokens / duration,
        total_throughput_tokens_per_s=(in_tokens + out_tokens) / duration,
        ttft=LatencyStats.of([r.ttft_s for r in ok]),
        tpot=LatencyStats.of(tpots),
        itl=LatencyStats.of([gap for r in ok for gap in r.itl_s]),
        e2e=LatencyStats.of([r.e2e_s for r in ok]),
        # distinct error messages, so a misconfigured run says why at once
        errors=sorted({r.error for r in results if not r.success})[:10],
    )


def format_table(report: BenchReport, title: str = "Serving Benchmark Result") -> str:
    lines = [f"{'=' * 16} {title} {'=' * 16}"]
    width = len(lines[0])

    def row(label: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<{width - 12}}{text:>12}")

    row("Successful requests:", report.completed)
    row("Failed requests:", report.failed)
    row("Benchmark duration (s):", report.duration_s)
    row("Total input tokens:", report.total_input_tokens)
    row("Total generated tokens:", report.total_output_tokens)
    row("Request throughput (req/s):", report.request_throughput_per_s)
    row("Output token throughput (tok/s):", report.output_throughput_tokens_per_s)
    row("Total token throughput (tok/s):", report.total_throughput_tokens_per_s)
    for name, label, stats in (
        ("ttft", "Time to First Token", report.ttft),
        ("tpot", "Time per Output Token (excl. 1st token)", report.tpot),
        ("itl", "Inter-token Latency", report.itl),
        ("e2e", "End-to-end Latency", report.e2e),
    ):
        lines.append(f"{label:-^{width}}")
        row(f"Mean {name.upper()} (ms):", stats.mean_ms)
        for q in PERCENTILES:
            row(f"P{q} {name.upper()} (ms):", getattr(stats, f"p{q}_ms"))
    lines.append("=" * width)
    for err in report.errors:
        lines.append(f"error: {err}")
    return "\n".join(lines)
