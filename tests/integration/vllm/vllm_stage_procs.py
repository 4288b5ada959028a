"""`VllmStageEngine`s in processes of their own (vLLM builds one stage per process), driven
directly with work items over a pipe: the engine interface without workers or coordinator,
for tests that look at one engine's KV and prefix cache. Also a two-stage greedy pipeline
over them."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helixserve.engine.protocol import WorkItem
from helixserve.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _serve(conn: Any, model: str, start: int, end: int, kv_bytes: int, block: int) -> None:
    os.environ.update({"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                       "VLLM_LOGGING_LEVEL": "WARNING"})
    import json

    import torch

    from helixserve.engine.errors import EngineError
    from helixserve.engine.vllm_stage import VllmStageEngine, configure_vllm_process

    configure_vllm_process(1)
    eng = VllmStageEngine.load(model, start, end, kv_cache_bytes=kv_bytes, block_size=block)
    config = json.loads((Path(model) / "config.json").read_text())
    conn.send(("ok", None))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        op, args = msg
        try:
            if op == "step":
                for it in args:
                    if it.hidden is not None:
                        it.hidden = torch.from_numpy(it.hidden)
                outs = eng.step(args)
                for o in outs:
                    if o.hidden is not None:
                        o.hidden = o.hidden.cpu().numpy()
                result: Any = outs
            elif op == "reset":  # a fresh engine (empty pool) on the same runner and weights
                eng = VllmStageEngine(eng.built, eng.model_dir, start, end, config, eng.device,
                                      eng.dtype, prefix_caching=args)
                result = None
            elif op == "free":
                result = eng.free(args)
            elif op == "seq_len":
                result = eng.seq_len(args)
            elif op == "kv_fits":
                result = eng.kv_fits(args)
            elif op == "kv_stats":
                result = dict(eng.kv_stats()), eng._count_cached_free()
            elif op == "events":
                ev = eng.take_cache_events()
                result = (ev.stored, ev.removed, ev.reset)
            else:
                raise ValueError(op)
            conn.send(("ok", result))
        except EngineError as exc:
            attrs = {k: v for k, v in vars(exc).items() if isinstance(v, str | int | list)}
            conn.send(("engine_error", (type(exc).__name__, str(exc), attrs)))
        except Exception:  # noqa: BLE001 - reported to the test process
            conn.send(("crash", traceback.format_exc()))


class StageError(Exception):
    """An EngineError the stage raised: `kind` its class name, `attrs` its attributes."""

    def __init__(self, kind: str, message: str, attrs: dict[str, Any]) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.attrs = kind, attrs


@dataclass
class Stage:
    start: int
    end: int
    proc: Any = None
    conn: Any = None

    def call(self, op: str, args: Any = None) -> Any:
        self.conn.send((op, args))
        status, result = self.conn.recv()
        if status == "engine_error":
            raise StageError(*result)
        if status == "crash":
            raise RuntimeError(f"stage [{self.start}, {self.end}) failed:\n{result}")
        return result

    def step(self, items: list[WorkItem]) -> list[Any]:
        return self.call("step", items)

    def kv(self) -> dict[str, int]:
        """kv_stats(), checked against the slow count of cached unused blocks."""
        stats, slow = self.call("kv_stats")
        assert stats["cached_blocks"] == slow, (stats, slow)
        return stats

    def events(self) -> tuple[list[bytes], list[bytes], bool]:
        return self.call("events")


def start_stages(model: Path, ranges: list[tuple[int, int]], kv_bytes: int,
                 block: int) -> list[Stage]:
    ctx = mp.get_context("spawn")
    stages = []
    for start, end in ranges:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, str(model), start, end, kv_bytes, block),
                           daemon=True)
        proc.start()
        stages.append(Stage(start, end, proc, parent))
    for s in stages:
        if not s.conn.poll(600):
            raise TimeoutError(f"stage [{s.start}, {s.end}) did not start")
        status, result = s.conn.recv()
        assert status == "ok", result
    return stages


def stop_stages(stages: list[Stage]) -> None:
    for s in stages:
        with contextlib.suppress(OSError):
            s.conn.send(None)
    for s in stages:
        s.proc.join(30)
        if s.proc.is_alive():
            s.proc.kill()
            s.proc.join()


@dataclass
class Run:
    """One request through the pipeline: `prompt`, of which the first `cached` tokens are
    taken from the stages' prefix caches."""

    request_id: str
    prompt: list[int]
    cached: int = 0
    tokens: list[int] = field(default_factory=list)


def generate(stages: list[Stage], runs: list[Run], max_new: int,
             after_step: Callable[[int], None] | None = None) -> None:
    """Greedy decode of every run, all in each step, through `stages` in order (their layer
    ranges chain from 0 to the model's last layer); fills `run.tokens`. `after_step(i)` is
    called after step i."""
    pos = {r.request_id: r.cached for r in runs}
    feed = {r.request_id: r.prompt[r.cached:] for r in runs}
    first = {r.request_id: True for r in runs}
    for step in range(max_new):
        hidden: dict[str, Any] = {r.request_id: None for r in runs}
        for i, stage in enumerate(stages):
            last = i == len(stages) - 1
            items = [WorkItem(r.request_id, stage.start, stage.end, pos[r.request_id],
                              feed[r.request_id], hidden=hidden[r.request_id],
                              sampling=GREEDY if last else None,
                              prefix_token_ids=(r.prompt[:r.cached]
                                                if first[r.request_id] and r.cached else None))
                     for r in runs]
            outs = stage.step(items)
            for r, o in zip(runs, outs, strict=True):
                if last:
                    r.tokens.append(o.token_id)
                else:
                    hidden[r.request_id] = o.hidden
        for r in runs:
            pos[r.request_id] += len(feed[r.request_id])
            feed[r.request_id] = [r.tokens[-1]]
            first[r.request_id] = False
        if after_step is not None:
            after_step(step)
