"""The processes of a rehearsal: one emulated worker per placed node, the link proxy, and the
real coordinator with the OpenAI API (`helixserve serve`), all on 127.0.0.1.

    with EmulatedCluster(inputs, workdir, time_scale=1.0) as cluster:   # started, API ready
        ... HTTP to cluster.api_url ...
    # stopped: API and coordinator, workers, proxy (SIGTERM, then SIGKILL), process groups

    bench client --HTTP--> helixserve serve (coordinator + API)
        --gRPC + mTLS--> proxy, node n0's public port --> worker n0's private port
    worker n0 --gRPC + mTLS--> proxy, node n1's public port --> worker n1 ...
    (the proxy: one FIFO per directed link, helixserve/rehearse/links.py)

Each worker is `helixserve worker --engine emulated --placement P --node N --cluster C`,
with C the rehearsal's copy of the cluster file, whose node addresses are the proxy's public
ports: the machine (gpu, num_gpus, memory_gb) and the peers a worker may forward to come from
it, as on a real cluster. Mutual TLS with dev credentials made for the run (as `helixserve
demo` and local stacks do). Every child runs in its own session (process group) and dies with
the rehearsal (helixserve/rehearse/child.py); `stop` signals each group, so nothing a child
started outlives it either.

Activations travel as a payload of `payload_bytes_per_token` (default 64) bytes a token, the
rest declared by the workers to the proxy's link ledger, an abstract unix socket named for
this rehearsal (HELIXSERVE_LINK_LEDGER in the workers' environment), and charged there
(links.py, engine/emulated.py); None: the real bytes cross.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from helixserve.engine.emulated import DEFAULT_RESERVED_GB_PER_GPU
from helixserve.errors import UserError
from helixserve.local.launch import PARENT_PID_ENV
from helixserve.rehearse.forkserver import COMMAND as FORKSERVER
from helixserve.rehearse.forkserver import ForkServer
from helixserve.rehearse.inputs import RehearsalInputs, reserve_ports
from helixserve.rehearse.links import (
    ProxyConfig,
    ProxyRoute,
    link_table,
    read_stats,
    read_unattributed,
)
from helixserve.runtime.config import CoordinatorConfig
from helixserve.runtime.threads import THREAD_KINDS, process_cpu_seconds, thread_cpu_seconds
from helixserve.runtime.transport import LINK_LEDGER_ENV
from helixserve.spec.cluster import COORDINATOR

HOST = "127.0.0.1"
#: seconds each process gets to exit on SIGTERM before SIGKILL
STOP_GRACE_S = 10.0
#: a worker still serving when it is told to stop fails what it holds after this long (the
#: coordinator has gone by then; nothing is left to finish)
WORKER_DRAIN_S = 2.0
#: glibc malloc arenas per child process (MALLOC_ARENA_MAX; see child_env)
MALLOC_ARENAS = 2
#: bytes a token the emulated workers' activation messages carry (module doc); the rest
#: (16 KiB - 64 a token for LLaMA-2-70B) is declared to the link proxy and charged there
DEFAULT_PAYLOAD_BYTES_PER_TOKEN = 64
#: the shutdown line of an emulated worker (helixserve/commands/worker.py, EmulationReport)
_REPORT_RE = re.compile(
    r"EMULATED engine emulated (\d+) steps, ([\d.]+) s of emulated compute, (\d+) prompt \+ "
    r"(\d+) decode tokens \((\d+) prompt tokens from the prefix cache\), ([\d.]+) s over "
    r"the emulated times")


#: one sample of the Prometheus text format: name, {labels}, value
_METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+0-9.eEinfNa]+)$")


@dataclass
class Ports:
    api: int
    #: node -> where the proxy listens for it (the address in the cluster copy)
    public: dict[str, int]
    #: node -> where its worker listens
    private: dict[str, int]

    @classmethod
    def reserve(cls, nodes: list[str], base_port: int) -> Ports:
        needs = ["the OpenAI API"]
        for n in nodes:
            needs += [f"node {n}'s link proxy", f"node {n}'s worker"]
        ports = reserve_ports(base_port, needs, HOST)
        return cls(ports[0], {n: ports[1 + 2 * i] for i, n in enumerate(nodes)},
                   {n: ports[2 + 2 * i] for i, n in enumerate(nodes)})


#: how `Cluster.cpu` names the workers' CPU by kind of thread (`threads/event_loop`, ...)
THREADS_KEY = "threads/"


#: real bytes (on the wire + declared) an HTTP/2 stream may have unacknowledged on a
#: rehearsal's link (`stream_window_bytes`): two of the largest messages a worker writes
#: (runtime/worker.py BATCH_BYTES of items, 4 MiB, then one more, at most a 512-token prefill
#: chunk of LLaMA-2-70B, 8 MiB), so the next message is on its way while one is being
#: serialized; a PING's ACK waits behind at most this and the proxy's window (36 MiB: 3 s
#: at 0.1 Gbit/s, x K like the keepalive timeout, 20 s x K). At 8 MiB
#: (a 32 KiB window on the wire) a chunk's message (~34 KiB on the wire: its 64-byte rows and
#: its token ids) did not fit, its sender waited for a WINDOW_UPDATE once per message, and
#: helix-geo-24's saturated 0.1 Gbit/s links carried 87-95% of their bandwidth (issue 27)
GRPC_WINDOW_REAL_BYTES = 32 * 2**20


def stream_window_bytes(payload_bytes_per_token: int, real_bytes_per_token: int) -> int:
    """The HTTP/2 stream window on the wire that stands for GRPC_WINDOW_REAL_BYTES of real
    bytes when activations cross as `payload_bytes_per_token` of `real_bytes_per_token`
    (at least gRPC's 64 KiB default, so no message of the control traffic waits on it)."""
    return max(65536, GRPC_WINDOW_REAL_BYTES * payload_bytes_per_token // real_bytes_per_token)


def child_env() -> dict[str, str]:
    """The environment of every child: this helixserve first on the path, one CPU thread
    for numeric libraries, at most MALLOC_ARENAS malloc arenas, and the pid the child must
    not outlive."""
    import helixserve

    root = str(Path(helixserve.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    # glibc's malloc gives each thread that allocates its own arena (the engine thread, gRPC's
    # and the event loop's), and each keeps what it once held: 2 arenas cut 42 workers'
    # memory under load by ~0.5 GiB (docs/rehearse.md) for no CPU this host could measure
    env.setdefault("MALLOC_ARENA_MAX", str(MALLOC_ARENAS))
    env[PARENT_PID_ENV] = str(os.getpid())
    return env


class EmulatedCluster:
    def __init__(self, inputs: RehearsalInputs, workdir: Path, *, time_scale: float = 1.0,
                 base_port: int = 0, max_seconds: float = 3600.0,
                 worker_args: Sequence[str] = (), serve_args: Sequence[str] = (),
                 payload_bytes_per_token: int | None = DEFAULT_PAYLOAD_BYTES_PER_TOKEN) -> None:
        self.inputs = inputs
        self.workdir = workdir
        self.time_scale = time_scale
        self.max_seconds = max_seconds
        #: more flags for every worker and for `helixserve serve` (e.g. the multi-turn
        #: benchmark's `--no-prefix-caching`, `--no-cache-aware-routing`)
        self.worker_args = list(worker_args)
        self.serve_args = list(serve_args)
        #: activation payload a token (module doc); None: the real bytes
        self.payload_bytes_per_token = payload_bytes_per_token
        #: the link ledger's name, unique to this rehearsal (None without a smaller payload)
        self.ledger = (None if payload_bytes_per_token is None
                       else f"helixserve-links-{os.getpid()}-{secrets.token_hex(6)}")
        self.nodes = [r.name for r in inputs.placement.nodes]
        self.ports = Ports.reserve(self.nodes, base_port)
        self.logs = workdir / "logs"
        #: name -> a subprocess.Popen, or a ForkedProcess for a worker (forkserver.py)
        self.procs: dict[str, Any] = {}
        self.forkserver: ForkServer | None = None
        self.cluster_path = workdir / "cluster.yaml"
        self.placement_path = workdir / "placement.json"
        self.stats_path = workdir / "links-stats.json"
        #: per worker, what it emulated (from its shutdown line), after `stop`
        self.emulated: dict[str, dict[str, float]] = {}
        #: the model name the API serves (set once it answers)
        self.model_name = ""

    @property
    def step_timeout_s(self) -> float:
        """The coordinator's step timeout: its default x the time scale (every step takes K
        times its cluster time in wall time)."""
        return CoordinatorConfig().step_timeout_s * self.time_scale

    @property
    def stats_interval_s(self) -> float:
        """How often the coordinator polls every worker's Info: its default x the time scale
        (the same period in cluster time, so the same polls per token as on the cluster)."""
        return CoordinatorConfig().stats_interval_s * self.time_scale

    @property
    def hang_timeout_s(self) -> float:
        """The coordinator's Info deadline for declaring a worker hung: its default x the time
        scale (a rehearsal's machine is saturated on purpose)."""
        return CoordinatorConfig().hang_timeout_s * self.time_scale

    @property
    def admission_timeout_s(self) -> float:
        """How long a request waits for KV room before the API answers 503: its default x the
        time scale (the same wait in cluster time: a rehearsal past saturation queues requests
        as the cluster would)."""
        return CoordinatorConfig().admission_timeout_s * self.time_scale

    @property
    def api_url(self) -> str:
        return f"http://{HOST}:{self.ports.api}"

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    # ---- start ---------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_files(self) -> None:
        """The cluster file with each placed node's address at its proxy port (unplaced
        nodes lose theirs: nothing may leave 127.0.0.0/8), and the placement with flows."""
        self.logs.mkdir(parents=True, exist_ok=True)
        data = yaml.safe_load(self.inputs.cluster_path.read_text())
        for node in data["nodes"]:
            node.pop("address", None)
            if node["name"] in self.ports.public:
                node["address"] = f"{HOST}:{self.ports.public[node['name']]}"
        self.cluster_path.write_text(yaml.safe_dump(data, sort_keys=False))
        self.inputs.placement.save(self.placement_path)

    def grpc_env(self) -> dict[str, str]:
        """gRPC's settings for this rehearsal's workers and coordinator (docs/rehearse.md,
        "Links"): the keepalive timeout x the time scale, as every emulated time is; with a
        smaller payload, an HTTP/2 stream window of the wire bytes that stand for
        GRPC_WINDOW_REAL_BYTES of real ones (flow control counts wire bytes), so a sender
        cannot run far ahead of a slow link and a PING's answer never waits behind minutes
        of queued bytes, while two of the largest messages fit in it (`stream_window_bytes`)."""
        from helixserve.runtime.transport import KEEPALIVE_TIMEOUT_S

        env = {"HELIXSERVE_GRPC_KEEPALIVE_TIMEOUT_S": repr(KEEPALIVE_TIMEOUT_S * self.time_scale)}
        if self.payload_bytes_per_token is not None:
            model = self.inputs.model
            real = model.hidden_size * model.dtype_bytes
            if self.payload_bytes_per_token < real:
                env["HELIXSERVE_GRPC_STREAM_WINDOW_BYTES"] = str(
                    stream_window_bytes(self.payload_bytes_per_token, real))
        return env

    def _spawn(self, name: str, args: list[str], stdout: Any = None,
               stdin: Any = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "helixserve.rehearse.child", *args],
                                stdin=stdin, stdout=stdout or log, stderr=log,
                                env={**child_env(), **(env or {})}, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        from helixserve.runtime.security import create_dev_credentials

        self.write_files()
        creds = create_dev_credentials(self.workdir / "tls", self.nodes)
        common = ["--model", str(self.inputs.model_dir), "--placement", str(self.placement_path)]
        # the workers, forked from it, inherit its environment: the link ledger's name
        server = self._spawn("forkserver", [FORKSERVER, "worker"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE,
                             env={**self.grpc_env(),
                                  **({LINK_LEDGER_ENV: self.ledger} if self.ledger else {})})
        self.forkserver = ForkServer(server)
        payload = ([] if self.payload_bytes_per_token is None else
                   ["--emulated-payload-bytes-per-token", str(self.payload_bytes_per_token)])
        for node in self.nodes:
            self.procs[f"worker-{node}"] = self.forkserver.spawn([
                "worker", "--engine", "emulated", *common, "--node", node,
                "--cluster", str(self.cluster_path), "--profiles", str(self.inputs.profiles_path),
                "--gpu-reserve-gb", str(DEFAULT_RESERVED_GB_PER_GPU),
                "--time-scale", repr(self.time_scale), "--host", HOST,
                "--port", str(self.ports.private[node]),
                "--drain-timeout-s", str(WORKER_DRAIN_S), *creds.nodes[node].flags(),
                *payload, *self.worker_args],
                self.logs / f"worker-{node}.log")
        names = [COORDINATOR, *self.nodes]
        worker_pids = {self.procs[f"worker-{n}"].pid: n for n in self.nodes}
        config = ProxyConfig(
            routes=[ProxyRoute(n, self.ports.public[n], self.ports.private[n]) for n in self.nodes],
            links=link_table(self.inputs.cluster, names, self.time_scale), pids=worker_pids,
            stats_path=str(self.stats_path), host=HOST, other_source=COORDINATOR,
            max_seconds=self.max_seconds, ledger=self.ledger)
        config_path = self.workdir / "links.json"
        config_path.write_text(config.to_json())
        proxy = self._spawn("links", ["links", str(config_path)], stdout=subprocess.PIPE)
        assert proxy.stdout is not None
        if proxy.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"rehearse: the link proxy did not start:\n{self.log_tail('links')}")
        self._wait_workers(timeout_s=120.0)
        self._spawn("coordinator", [
            "serve", "--step-timeout-s", repr(self.step_timeout_s),
            "--stats-interval-s", repr(self.stats_interval_s),
            "--hang-timeout-s", repr(self.hang_timeout_s),
            "--admission-timeout-s", repr(self.admission_timeout_s),
            "--cluster", str(self.cluster_path), *common, "--host", HOST,
            "--port", str(self.ports.api), "--profiles", str(self.inputs.profiles_path),
            "--gpu-reserve-gb", str(DEFAULT_RESERVED_GB_PER_GPU), "--no-replan",
            "--log-level", "warning", *creds.coordinator.flags(), *self.serve_args],
            env=self.grpc_env())
        self._wait_api(timeout_s=180.0)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"rehearse: {name} exited with code {proc.returncode}; log "
                                   f"{self.logs / (name + '.log')}:\n{self.log_tail(name)}")

    def _wait_workers(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = list(self.nodes)
        while waiting:
            self._check_alive()
            waiting = [n for n in waiting if "listening on" not in self.log_tail(f"worker-{n}",
                                                                                  100_000)]
            if time.monotonic() > deadline:
                raise RuntimeError(f"rehearse: workers {', '.join(waiting)} not listening after "
                                   f"{timeout_s:.0f} s:\n{self.log_tail('worker-' + waiting[0])}")
            time.sleep(0.2)

    def _wait_api(self, timeout_s: float) -> None:
        """Until the API lists the model (the coordinator has connected to every worker) and
        says it is emulated."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(
                    self.api_url + "/v1/models", timeout=2.0) as resp:
                card = json.loads(resp.read())["data"][0]
                if not card.get("emulated"):
                    raise RuntimeError(f"rehearse: the API does not say it is emulated: {card}")
                self.model_name = str(card["id"])
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"rehearse: the API is not ready after {timeout_s:.0f} s; "
                                   f"coordinator log:\n{self.log_tail('coordinator')}")
            time.sleep(0.3)

    def log_tail(self, name: str, num_chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return (self.logs / f"{name}.log").read_text(errors="replace")[-num_chars:]
        return ""

    # ---- during the run ------------------------------------------------------------------

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of every live child, by name, and of the workers' threads by
        kind, summed over the workers (`threads/<kind>`: runtime/threads.py THREAD_KINDS)."""
        out = {}
        threads = dict.fromkeys(THREAD_KINDS, 0.0)
        for name, proc in self.procs.items():
            if name.startswith("worker-"):  # its kinds of threads add up to its CPU
                by_kind = thread_cpu_seconds(proc.pid)
                if by_kind is not None:
                    out[name] = sum(by_kind.values())
                    for kind, v in by_kind.items():
                        threads[kind] += v
                continue
            s = process_cpu_seconds(proc.pid)
            if s is not None:
                out[name] = s
        out.update({f"{THREADS_KEY}{kind}": v for kind, v in threads.items()})
        return out

    def unattributed(self) -> dict[str, dict[str, int]]:
        """Per machine, the traffic whose caller the proxy could not find, as of its last
        write (`link_stats` asks for one): counted on no link (docs/rehearse.md)."""
        return read_unattributed(self.stats_path)

    def link_stats(self, timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
        """The proxy's per-link counters now (it writes them on SIGUSR1)."""
        proxy = self.procs.get("links")
        if proxy is None or proxy.poll() is not None:
            return read_stats(self.stats_path)[1]
        before, _ = read_stats(self.stats_path)
        proxy.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            writes, links = read_stats(self.stats_path)
            if writes > before:
                return links
            time.sleep(0.02)
        raise RuntimeError(f"rehearse: the link proxy wrote no counters in {timeout_s:.0f} s")

    def coordinator_metrics(self) -> dict[str, Any]:
        """What the coordinator's /metrics says now: preemptions and re-routes since it
        started, and each node's busy fraction over the workers' last 5 s (their Info)."""
        out: dict[str, Any] = {"preemptions": None, "reroutes": None, "busy_fraction": {}}
        try:
            with urllib.request.urlopen(self.api_url + "/metrics", timeout=10.0) as resp:
                text = resp.read().decode()
        except OSError:
            return out
        for line in text.splitlines():
            m = _METRIC_RE.match(line)
            if m is None:
                continue
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            if name == "vllm:num_preemptions_total":
                out["preemptions"] = value
            elif name == "helixserve:request_reroutes_total":
                out["reroutes"] = value
            elif name == "helixserve:node_busy_fraction":
                node = re.search(r'node="([^"]*)"', labels)
                if node:
                    out["busy_fraction"][node.group(1)] = value
        return out

    # ---- stop ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Coordinator and API first (they release what the workers hold), then the workers,
        then the proxy; each process group SIGTERMed, SIGKILLed after STOP_GRACE_S; the fork
        server last, once its children are gone (it reaps them). Then what each worker
        emulated, from its shutdown line. Safe to call twice."""
        order = ["coordinator", *(f"worker-{n}" for n in self.nodes), "links"]
        order = [n for n in order if n in self.procs]
        if "coordinator" in order:
            _stop_group(self.procs["coordinator"], STOP_GRACE_S)
        for name in order:
            _signal_group(self.procs[name], signal.SIGTERM)
        for name in order:
            _stop_group(self.procs[name], STOP_GRACE_S)
        if self.forkserver is not None:
            self.forkserver.close()  # a closed stdin ends it
        if "forkserver" in self.procs:
            _stop_group(self.procs["forkserver"], STOP_GRACE_S)
        proxy = self.procs.get("links")
        if proxy is not None and proxy.stdout is not None:
            proxy.stdout.close()
        for node in self.nodes:
            m = _REPORT_RE.search(self.log_tail(f"worker-{node}", 4000))
            if m:
                self.emulated[node] = {
                    "steps": int(m.group(1)), "emulated_s": float(m.group(2)),
                    "prompt_tokens": int(m.group(3)), "decode_tokens": int(m.group(4)),
                    "cached_tokens": int(m.group(5)), "overrun_s": float(m.group(6))}
            elif node not in self.emulated and f"worker-{node}" in self.procs:
                code = self.procs[f"worker-{node}"].poll()
                print(f"rehearse: worker-{node} left no EMULATED report line (exit code {code}; "
                      f"its log: {self.logs / f'worker-{node}.log'})", file=sys.stderr,
                      flush=True)

    def stopped(self) -> bool:
        return all(p.poll() is not None for p in self.procs.values())


def _signal_group(proc: Any, sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def _stop_group(proc: Any, grace_s: float) -> None:
    """SIGTERM the child's process group, SIGKILL it after `grace_s`, reap the child."""
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
    # anything the child left in its group goes with it
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def check_workdir(path: Path) -> Path:
    """The directory for logs, certificates and the cluster copy: made if missing."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--workdir {path}: cannot create it: {exc.strerror}") from None
    return path
