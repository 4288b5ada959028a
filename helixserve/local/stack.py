"""The serving stack in one process: coordinator + API (+ local workers for the demo).

`prepare_demo` makes everything the demo needs in a work dir: the demo model (SmolLM2-135M-
Instruct), a short CPU profile of this machine, a cluster of 3 `cpu` nodes on 127.0.0.1 with
unequal memory budgets (so the MILP places layers unevenly and the flow has more than one
route; `memory_gb` with N budgets gives N nodes, up to 6), and the MILP placement. `run_stack` then serves it: coordinator over the workers,
the OpenAI API on uvicorn, clean shutdown in reverse order.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helixserve.errors import UserError
from helixserve.local.launch import WorkerProcesses, WorkerSpec, free_port, serve_app
from helixserve.spec.scheduling import DEFAULT_KV_WATERMARK

#: memory budgets of the demo's 3 nodes (GB). The planner lets weights use half a node's
#: memory; SmolLM2-135M's 30 layers are ~7 MB each in bf16, so these hold at most about 10,
#: 21 and 30 layers.
DEMO_MEMORY_GB = (0.15, 0.30, 0.50)
#: the modelled network between worker nodes, as a fraction of what the pipeline computes.
#: The 3 nodes share one CPU type, and with equal compute a chain of disjoint ranges is
#: always max-flow optimal: one route. Helix's point is the case where the network binds
#: (machines in different regions), so the demo tells the planner that worker-to-worker
#: links carry only this fraction of the fast-network plan's throughput; the max flow then
#: splits over more than one route. The sockets are loopback: this is the planner's model of
#: the cluster, not a throttle.
DEMO_WORKER_LINK_FRACTION = 0.5
#: the names of the demo's worker nodes: `--memory-gb` with N budgets gives the first N (the
#: default budgets 3). More workers let the max flow split over more routes (each worker is a
#: torch process of the 135M model with --worker-threads threads: 4-6 of them share a
#: small machine's cores slowly but work).
DEMO_NODES = ("n1", "n2", "n3", "n4", "n5", "n6")


@dataclass
class DemoFiles:
    workdir: Path
    model_dir: Path
    profiles_path: Path | None
    cluster_path: Path
    placement_path: Path
    #: every node of the cluster file; `workers_with_layers` says which to start
    workers: list[WorkerSpec]
    #: the placement in `placement_path`
    placement: Any = None


def default_workdir() -> Path:
    import os

    root = os.environ.get("HELIXSERVE_CACHE") or str(Path.home() / ".cache" / "helixserve")
    return Path(root) / "demo"


def write_local_cluster(
    path: Path,
    name: str,
    workers: list[WorkerSpec],
    memory_gb: tuple[float, ...],
    worker_link_gbps: float | None = None,
) -> None:
    """A cluster YAML of `cpu` nodes at the workers' addresses. Links: loopback-fast, or
    `worker_link_gbps` between worker nodes (the coordinator's links stay fast: they carry
    only token ids)."""
    lines = [f"name: {name}", "nodes:"]
    for w, mem in zip(workers, memory_gb, strict=True):
        lines += [
            f"  - name: {w.node}",
            "    gpu: cpu",
            f"    memory_gb: {mem}",
            f"    address: {w.address}",
        ]
    fast = "{bandwidth_gbps: 10.0, latency_ms: 0.1}"
    if worker_link_gbps is None:
        lines += ["links:", f"  default: {fast}", ""]
    else:
        lines += ["links:", f"  default: {{bandwidth_gbps: {worker_link_gbps}, latency_ms: 0.1}}"]
        lines.append("  explicit:")
        for w in workers:
            for src, dst in (("coordinator", w.node), (w.node, "coordinator")):
                lines.append(
                    f"    - {{src: {src}, dst: {dst}, bandwidth_gbps: 10.0, latency_ms: 0.1}}"
                )
        lines.append("")
    path.write_text("\n".join(lines))


def profile_cpu(model_dir: Path, out: Path, log: Callable[[str], None]) -> Path | None:
    """Short CPU profile via `helixserve profile` (few points, 2 layers, 5 repeats: seconds,
    not a minute). Each point is the fastest of its repeats, so a busy host's extra time
    does not make large batches look dearer than they are (which would turn the plan into
    one chain); None (analytic cost model) if it fails."""
    cmd = [
        sys.executable, "-m", "helixserve", "profile",
        "--model", str(model_dir), "--device", "cpu", "--out", str(out),
        "--prompt-tokens", "64,256", "--decode-batches", "1,8,32",
        "--layers", "2", "--repeats", "5",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        log(
            "demo: profiling failed, planning with the analytic cost model: "
            + (proc.stderr.strip().splitlines() or ["no output"])[-1]
        )
        return None
    return out


def plan_placement(
    model_dir: Path,
    cluster_path: Path,
    profiles_path: Path | None,
    out: Path,
    planner: str = "milp",
    time_limit_s: float = 20.0,
) -> Any:
    from helixserve.costmodel import CostModel
    from helixserve.planner import plan
    from helixserve.spec import load_cluster, load_model, load_profiles

    cluster = load_cluster(cluster_path)
    model = load_model(model_dir)
    profiles = load_profiles(profiles_path) if profiles_path is not None else None
    placement = plan(planner, cluster, model, CostModel(model, profiles), time_limit_s)
    placement.save(out)
    return placement


def prepare_demo(
    workdir: Path,
    host: str = "127.0.0.1",
    memory_gb: tuple[float, ...] = DEMO_MEMORY_GB,
    reprofile: bool = False,
    worker_link_fraction: float | None = DEMO_WORKER_LINK_FRACTION,
    log: Callable[[str], None] = print,
) -> DemoFiles:
    """Model, profile (cached in workdir), cluster with fresh free ports, MILP placement."""
    from helixserve.engine import prepare_demo_model
    from helixserve.spec import load_model

    workdir.mkdir(parents=True, exist_ok=True)
    from helixserve.engine.demo import demo_model_dir, is_prepared

    if not is_prepared(demo_model_dir()):
        log("demo: converting the demo model (SmolLM2-135M-Instruct GGUF, first run only)")
    model_dir = prepare_demo_model()
    profiles_path = workdir / "profiles.csv"
    profiles: Path | None = profiles_path
    if reprofile or not profiles_path.is_file():
        log("demo: profiling this machine (CPU, short)")
        profiles = profile_cpu(model_dir, profiles_path, log)
    workers = [WorkerSpec(name, host, free_port(host)) for name in DEMO_NODES[: len(memory_gb)]]
    cluster_path = workdir / "cluster.yaml"
    placement_path = workdir / "placement.json"
    write_local_cluster(cluster_path, "local-demo", workers, memory_gb)
    log("demo: planning the placement (milp)")
    placement = plan_placement(model_dir, cluster_path, profiles, placement_path)
    if worker_link_fraction is not None and placement.throughput_tokens_per_s:
        bits_per_token = load_model(model_dir).activation_bytes_per_token * 8
        gbps = worker_link_fraction * placement.throughput_tokens_per_s * bits_per_token / 1e9
        log(
            "demo: planning again as if the workers were machines in different regions "
            f"(links between them modelled at {worker_link_fraction:g} x what the pipeline "
            "computes), so the max flow spreads over more than one route; the sockets are "
            "loopback and nothing is throttled"
        )
        write_local_cluster(cluster_path, "local-demo", workers, memory_gb, round(gbps, 9))
        placement = plan_placement(model_dir, cluster_path, profiles, placement_path)
    return DemoFiles(workdir, model_dir, profiles, cluster_path, placement_path, workers,
                     placement)


def workers_with_layers(workers: list[WorkerSpec],
                        placement: Any) -> tuple[list[WorkerSpec], list[str]]:
    """The workers to start: those of the nodes the placement gives layers (in `workers`'
    order), and the names of the others. A planner may leave a node without layers (a
    small memory budget, or a faster chain without it); a worker started for it would exit
    ("no node holds layers") and take the demo down."""
    placed = {n.name for n in placement.nodes}
    start = [w for w in workers if w.node in placed]
    if not start:
        raise UserError(f"placement: no layers on any of the nodes "
                        f"{', '.join(w.node for w in workers)}")
    return start, [w.node for w in workers if w.node not in placed]


def describe_placement(placement: Any, cluster: Any, predicted: bool = True) -> str:
    """Human-readable placement: one line per node, then the routes of the max flow with
    their tokens/s and the total (`predicted`), or with their share of the flow only (the
    demo: its network is modelled, so its tokens/s are not what this machine delivers)."""
    lines = [f"placement ({placement.planner}) of {placement.model} over {cluster.name}:"]
    by_name = {n.name: n for n in cluster.nodes}
    for r in placement.nodes:
        node = by_name.get(r.name)
        bar = "." * r.start_layer + "#" * r.num_layers + "." * (placement.num_layers - r.end_layer)
        where = f"{node.address} mem {node.memory_gb} GB" if node else ""
        lines.append(f"  {r.name:<4} layers [{r.start_layer:>2}, {r.end_layer:>2})  {bar}  {where}")
    routes = flow_routes(placement.flows)
    total = sum(t for _, t in routes) or 1.0
    for route, tokens_per_s in routes:
        share = (f"{tokens_per_s:.1f} tokens/s of the max flow" if predicted
                 else f"{tokens_per_s / total:.0%} of the requests")
        lines.append(f"  route {' -> '.join(route)}: {share}")
    if predicted and placement.throughput_tokens_per_s is not None:
        lines.append(f"  max-flow throughput: {placement.throughput_tokens_per_s:.1f} tokens/s")
    return "\n".join(lines)


def flow_routes(flows: list[Any]) -> list[tuple[list[str], float]]:
    """Decompose the coordinator -> ... -> coordinator flow into routes (paths with their
    share), taking the widest remaining edge at each step."""
    left: dict[tuple[str, str], float] = {}
    for f in flows:
        if f.tokens_per_s > 1e-9:
            left[(f.src, f.dst)] = left.get((f.src, f.dst), 0.0) + f.tokens_per_s
    routes: list[tuple[list[str], float]] = []
    while len(routes) < 32:
        path: list[str] = []
        node = "coordinator"
        while True:
            nxt = [(v, dst) for (src, dst), v in left.items() if src == node and v > 1e-6]
            if not nxt:
                break
            node = max(nxt)[1]
            if node == "coordinator" or node in path:
                break
            path.append(node)
        if node != "coordinator" or not path:
            break
        hops = list(zip(["coordinator", *path], [*path, "coordinator"], strict=True))
        amount = min(left[h] for h in hops)
        for h in hops:
            left[h] -= amount
        routes.append((path, amount))
    return routes


def usage_examples(host: str, port: int, model: str, api_key: str | None) -> str:
    url = f"http://{host}:{port}"
    auth = f' -H "Authorization: Bearer {api_key}"' if api_key else ""
    key = api_key or "none"
    return f"""\
API ready at {url}/v1   (model {model!r}; metrics at {url}/metrics; Ctrl-C stops everything)

  measure what this machine delivers (16 concurrent streams of 64 tokens):
  helixserve bench --url {url} --dataset random --num-prompts 64 --max-concurrency 16 \\
    --random-input-len 32 --random-output-len 64{' --api-key ' + api_key if api_key else ''}

  curl {url}/v1/chat/completions -H "Content-Type: application/json"{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}'

  python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="{key}")
for chunk in client.chat.completions.create(
        model="{model}", stream=True, max_tokens=64, temperature=0,
        messages=[{{"role": "user", "content": "What is the capital of France?"}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
EOF
"""


async def run_stack(
    cluster_path: Path,
    placement_path: Path,
    model_dir: Path,
    host: str,
    port: int,
    api_key: str | None = None,
    served_model_name: str | None = None,
    scheduler: str = "maxflow",
    workers: WorkerProcesses | None = None,
    on_started: Callable[[Any, Any], None] | None = None,
    log_level: str = "warning",
    kv_allocation: str = "on-demand",
    kv_watermark: float = DEFAULT_KV_WATERMARK,
    recovery: Any = None,
    tls: Any = None,
    cost: Any = None,
    timing: Mapping[str, Any] | None = None,
    prefix_caching: bool = True,
    cache_aware_routing: bool = True,
    tool_call_parser: str = "auto",
) -> None:
    """Serve until SIGINT/SIGTERM. With `workers`, start them first, restart any that exits
    (helixserve/local/supervisor.py) and stop them last. `recovery` (a RecoveryConfig): re-plan live
    when layers lose their last holder (runtime/replan.py); None: requests fail while they do.
    `tls` (runtime.security.TlsConfig): the coordinator's credentials for worker traffic;
    with `workers` and no `tls`, theirs (dev credentials unless they run insecure). `cost`
    (runtime.costs.CostInputs): the profiles, GPU catalog (the cluster is read with it) and
    dtype of the plan; None: the analytic model and the shipped catalog. `timing`:
    CoordinatorConfig's timing fields by name (step_timeout_s, stats_interval_s,
    hang_timeout_s, admission_timeout_s; `serve --step-timeout-s` ...), the others its
    defaults; a rehearsal scales them by its time scale. `prefix_caching`,
    `cache_aware_routing`: CoordinatorConfig's (`--no-prefix-caching`,
    `--no-cache-aware-routing`; docs/prefix-caching.md). `tool_call_parser`: the API's
    (`--tool-call-parser`; docs/tool-calls.md)."""
    from helixserve.api.app import create_app
    from helixserve.planner import load_placement
    from helixserve.runtime import Coordinator, CoordinatorConfig
    from helixserve.runtime.costs import CostInputs
    from helixserve.spec import load_cluster

    cost = cost or CostInputs()
    cluster = load_cluster(cluster_path, catalog=cost.catalog)
    placement = load_placement(placement_path)
    missing = [n.name for n in placement.nodes if not _address(cluster, n.name)]
    if missing:
        raise UserError(
            f"{cluster_path}: nodes {', '.join(missing)} hold layers in {placement_path} "
            "but have no address"
        )
    from helixserve.local.supervisor import Supervisor

    supervisor = None
    try:
        if workers is not None:
            workers.start()
            workers.wait_ready()
            supervisor = Supervisor(workers)
            supervisor.start()
            if tls is None:
                tls = workers.coordinator_tls
        config = CoordinatorConfig(scheduler=scheduler, kv_allocation=kv_allocation,
                                   kv_watermark=kv_watermark, recovery=recovery, cost=cost,
                                   prefix_caching=prefix_caching,
                                   cache_aware_routing=cache_aware_routing)
        config = dataclasses.replace(config, **(timing or {}))
        coord = await Coordinator.create(cluster, placement, model_dir, config, tls=tls)
        coord.process_stats = None if supervisor is None else supervisor.stats
        try:
            app = create_app(coord, served_model_name, api_key,
                             tool_call_parser=tool_call_parser)
            await serve_app(
                app,
                host,
                port,
                log_level=log_level,
                on_started=None if on_started is None else lambda: on_started(cluster, placement),
                on_shutdown=lambda: setattr(app.state.serving, "draining", True),
            )
        finally:
            await coord.close()
    finally:
        if supervisor is not None:
            supervisor.stop()
        if workers is not None:
            workers.stop()


def _address(cluster: Any, node: str) -> str | None:
    for n in cluster.nodes:
        if n.name == node:
            return str(n.address) if n.address else None
    return None
