"""Measure the time of one transformer layer vs batch tokens, and of the last stage's head,
for the planner's cost model.

Rows follow the profiles format of FORMATS.md: `model,gpu,num_gpus,phase,batch_tokens,
layer_ms,part`. One shard of the model's last `num_layers` layers (no embedding when the
model has more layers) runs real engine steps on random hidden states:
- part=layer: steps that stop before the head (items not sampled); the step time divided
  by the number of layers is the per-layer time, so the engine's per-step overhead is
  amortized the way a real shard amortizes it.
  - prompt: `batch_tokens` prompt tokens in sequences of at most `prompt_seq_tokens`,
    starting at position 0 (a fresh prefill).
  - decode: `batch_tokens` sequences each decoding one token after a `decode_context`-token
    context (prefilled, untimed).
- part=head: what the worker holding the model's last layer adds to a step, the final norm,
  lm_head and sampler on the last row of every sampled item (engine/shard.py `_outputs`,
  vllm_stage.py `_run_call`/`_sample`): the same step with the items sampled minus
  without, on items that run only the last layer (a small base keeps the difference above
  the noise). `batch_tokens` is the number of rows sampled: decode, a batch of that many
  sequences; prompt, that many sequences whose prompt of `head_prompt_seq_tokens` ends in
  the step (only a prompt's last token reaches the head). A head below the timing noise is
  written as HEAD_FLOOR_MS.
Each point is the fastest of `repeats` timed steps after one warm-up: other load on the
host only adds time to a step, so the minimum is the estimate closest to the step's own cost.
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from helixserve.engine.kv_cache import KVCacheLayout
from helixserve.engine.loader import load_args
from helixserve.engine.protocol import WorkItem
from helixserve.engine.shard import ShardEngine, resolve_device, resolve_dtype
from helixserve.engine.slowdown import slowed
from helixserve.request import SamplingParams

PROFILE_COLUMNS = ("model", "gpu", "num_gpus", "phase", "batch_tokens", "layer_ms", "part")
#: a head time not above the timing noise (sampled step <= unsampled step) is written as this
#: (the CSV's resolution; the loader wants > 0)
HEAD_FLOOR_MS = 0.0001


@dataclass(frozen=True)
class ProfileRow:
    model: str
    gpu: str
    num_gpus: int
    phase: str  # "prompt" | "decode"
    batch_tokens: int
    layer_ms: float
    part: str = "layer"  # "layer": one layer's time | "head": the head's whole time


@dataclass(frozen=True)
class ProfileSettings:
    prompt_batch_tokens: tuple[int, ...] = (128, 256, 512, 1024)
    decode_batch_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    prompt_seq_tokens: int = 512
    """Longest single sequence in a prompt batch; bigger batches hold several."""
    decode_context: int = 128
    num_layers: int = 4
    """Consecutive middle layers timed together (step time / num_layers = layer_ms)."""
    repeats: int = 3
    slowdown: float = 1.0
    """Steps stretched to this factor x their compute time (engine/slowdown.py)."""
    head_prompt_seq_tokens: int = 32
    """Prompt length of each sequence of a prompt head point (one row of it is sampled)."""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def profile_model(
    model_path: Path,
    device: str = "cpu",
    dtype: torch.dtype | str | None = None,
    model_name: str | None = None,
    settings: ProfileSettings | None = None,
    engine_name: str = "torch",
) -> list[ProfileRow]:
    """Time `settings.num_layers` layers and the head on engine `engine_name` (torch | vllm):
    the planner then plans with what that engine's workers do."""
    s = settings or ProfileSettings()
    dev = resolve_device(device)
    args = load_args(Path(model_path))
    n = min(s.num_layers, args.num_layers)
    start = args.num_layers - n  # the last layers: the head is there; no embedding if n < L
    layout = KVCacheLayout(n, args.num_kv_heads, args.head_dim, 16, resolve_dtype(dtype, dev))
    max_tokens = max(
        max(s.prompt_batch_tokens) + s.prompt_seq_tokens,
        max(s.decode_batch_tokens) * (s.decode_context + 2 * s.repeats + 19),
        max(s.decode_batch_tokens) * s.head_prompt_seq_tokens,
    )
    budget = layout.block_bytes * (max_tokens // 16 + 2 * max(s.decode_batch_tokens) + 64)
    if engine_name == "vllm":
        # vLLM's CPU blocks hold 128 tokens, not 16: a decode request of ~150 tokens takes two
        budget *= 2
    from helixserve.engine.registry import load_engine

    engine = load_engine(engine_name, model_path, start, start + n, str(dev), dtype,
                         kv_cache_bytes=budget)
    engine = slowed(engine, s.slowdown)
    name = model_name or Path(model_path).name
    gpu = device_name(engine.device)
    rows: list[ProfileRow] = []
    for bt in s.prompt_batch_tokens:
        ms = _time_prompt(engine, bt, s) / n
        rows.append(ProfileRow(name, gpu, 1, "prompt", bt, round(ms, 4)))
    for bt in s.decode_batch_tokens:
        ms = _time_decode(engine, bt, s) / n
        rows.append(ProfileRow(name, gpu, 1, "decode", bt, round(ms, 4)))
    # the head at as many sampled rows as the decode batches have sequences, for both phases
    for phase in ("prompt", "decode"):
        for rows_sampled in s.decode_batch_tokens:
            ms = max(HEAD_FLOOR_MS, round(_time_head(engine, phase, rows_sampled, s), 4))
            rows.append(ProfileRow(name, gpu, 1, phase, rows_sampled, ms, "head"))
    return rows


def _item(engine: ShardEngine, request_id: str, position: int, num_tokens: int,
          sample: bool = False, last_layer_only: bool = False) -> WorkItem:
    """Random hidden states (RMS 1, like real activations) through all the shard's layers
    (or only its last one), sampled at the end or not."""
    start = engine.end_layer - 1 if last_layer_only else engine.start_layer
    hidden = None
    if start > 0:
        hidden = torch.randn(num_tokens, engine.hidden_size, device=engine.device,
                             dtype=engine.dtype)
    # greedy, as throughput runs sample (bench/client.py, the rig); temperature > 0 adds a
    # softmax and a draw over the vocabulary
    sampling = SamplingParams(temperature=0.0) if sample else None
    return WorkItem(request_id, start, engine.end_layer, position, [0] * num_tokens, hidden,
                    sampling=sampling, sample=sample)


def _sync(engine: ShardEngine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _time_prompt(engine: ShardEngine, batch_tokens: int, s: ProfileSettings) -> float:
    lengths = [s.prompt_seq_tokens] * (batch_tokens // s.prompt_seq_tokens)
    if batch_tokens % s.prompt_seq_tokens:
        lengths.append(batch_tokens % s.prompt_seq_tokens)
    times = []
    for rep in range(s.repeats + 1):
        items = [_item(engine, f"p{rep}-{i}", 0, n) for i, n in enumerate(lengths)]
        _sync(engine)
        t0 = time.perf_counter()
        engine.step(items)
        _sync(engine)
        times.append(time.perf_counter() - t0)
        for it in items:
            engine.free(it.request_id)
    return min(times[1:]) * 1e3


def _time_decode(engine: ShardEngine, batch: int, s: ProfileSettings) -> float:
    ids = [f"d{i}" for i in range(batch)]
    ctx = s.decode_context
    engine.step([_item(engine, r, 0, ctx) for r in ids])
    times = []
    for rep in range(s.repeats + 1):
        items = [_item(engine, r, ctx + rep, 1) for r in ids]
        _sync(engine)
        t0 = time.perf_counter()
        engine.step(items)
        _sync(engine)
        times.append(time.perf_counter() - t0)
    for r in ids:
        engine.free(r)
    return min(times[1:]) * 1e3


def _time_head(engine: ShardEngine, phase: str, rows: int, s: ProfileSettings) -> float:
    """Head time (ms) of a step sampling `rows` rows: the step sampled minus the same step
    not sampled, each the fastest of `repeats` (interleaved, so drifting load hits both)."""
    ctx = s.decode_context
    ids = [f"h{phase}{i}" for i in range(rows)]
    if phase == "decode":
        engine.step([_item(engine, r, 0, ctx, last_layer_only=True) for r in ids])
    plain: list[float] = []
    sampled: list[float] = []
    for rep in range(s.repeats + 1):
        for sample, times in ((False, plain), (True, sampled)):
            if phase == "decode":
                pos = ctx + 2 * rep + sample
                items = [_item(engine, r, pos, 1, sample, True) for r in ids]
            else:
                items = [_item(engine, f"{r}-{rep}-{sample}", 0, s.head_prompt_seq_tokens,
                               sample, True) for r in ids]
            _sync(engine)
            t0 = time.perf_counter()
            engine.step(items)
            _sync(engine)
            times.append(time.perf_counter() - t0)
            if phase == "prompt":
                for it in items:
                    engine.free(it.request_id)
    for r in ids:
        engine.free(r)
    return (min(sampled[1:]) - min(plain[1:])) * 1e3


def write_profiles_csv(rows: list[ProfileRow], out: Path) -> None:
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(PROFILE_COLUMNS)
        for r in rows:
            w.writerow([r.model, r.gpu, r.num_gpus, r.phase, r.batch_tokens, r.layer_ms,
                        r.part])
