"""`EmulatedEngine`: a GPU machine emulated from measured profiles; no weights, no torch.

For rehearsing a cluster at full size on one host (docs/emulated.md): each worker stands for
one GPU machine serving its layer range, and the runtime around it (worker, gRPC hops,
coordinator, API) is the real one. The engine does what the real engines do except the math:

- **Time.** A step over a batch takes the time the cost model (costmodel/model.py) gives for
  this GPU, the layers each item runs and the batch, from measured per-layer profiles (the
  same numbers `simulate` uses): for each run of consecutive layers with the same items
  (partial inference), `layers x (t_prompt(P) + t_decode(D))` with P the prompt tokens and D
  the decode sequences running there; on the last stage plus the head (final norm, lm_head,
  sampling) over the rows sampled. The engine thread sleeps until the step's start plus that
  time (time.sleep releases the GIL), times `time_scale`.
- **KV.** Paged, `block_size` tokens a block, as many blocks as the memory model gives this GPU
  with these layers loaded (costmodel `kv_capacity_tokens`; or `kv_cache_bytes` when given):
  the same BlockAllocator the torch engine's cache uses, so admission, growth, rewinds and
  exhaustion (KvExhaustedError -> the coordinator preempts) are the real ones, and so is
  prefix caching (on unless `prefix_caching=False`): full blocks are named and kept, evicted
  LRU, and a new request's `prefix_token_ids` attach cached blocks or raise PrefixMissError.
  A prefix taken from the cache is not computed, so it takes no time: a step is timed by
  the tokens its items bring, which is what a cache hit saves on a real GPU.
- **Activations** of the model's real size, [num_tokens, hidden_size] x dtype bytes (16 KiB
  a token for LLaMA-2-70B in bf16), as RawHidden: zeros from the first stage, passed on by
  the others. What crosses a hop is either those bytes (`payload_bytes_per_token` None, the
  default of `helixserve worker`), or a smaller payload of `payload_bytes_per_token` bytes a
  token (the default of `helixserve rehearse`: 64) with the real shape and dtype, the rest
  being charged by link emulation instead of sent:
  - why: the bytes are most of a rehearsal's control-plane CPU (gRPC's threads, TLS, parse,
    serialize and copies of 16 KiB a token a hop: ~2 ms of CPU an output token on
    single-24), and they are emulation's cost, not the runtime's: a real cluster moves them
    with NICs and GPUs' DMA, not with this host's two cores;
  - how (runtime/transport.py, rehearse/links.py): the output's `ZeroHidden` knows both sizes
    (`nbytes` the real one, which the worker batches by, as it would real activations;
    `unsent_nbytes` what the payload leaves out). Just before a worker writes a batch to its
    next hop, it declares the batch's unsent bytes for the directed link (itself -> that
    hop's address) to the rehearsal's link proxy over a local datagram socket
    (`transport.declare_unsent`, naming the message's size on the wire); the proxy charges
    them with exactly that message's bytes on that link's FIFO, so the message takes the
    real size's serialization time, and counts them in the link's bytes (wire and declared
    apart; docs/rehearse.md, "Delivery message by message");
  - on arrival an emulated worker accepts a payload of whole bytes a token smaller than a
    row (`transport.hidden_from_pb`: it computes nothing on the values); a torch or vllm
    worker accepts only the real size;
  - the coordinator's items carry token ids, not activations, and results carry tokens: only
    worker -> worker hops declare.
- **Tokens.** The last stage emits deterministic ids, like greedy decoding of a real model: a
  function of the prompt and the position (a hash of the prompt's tokens and the position,
  within the vocabulary), so the same prompt gives the same output on any route and after a
  preemption or re-route (which re-prefills prompt + output). It never emits an EOS, BOS or
  stop id, so `max_tokens` ends a request (the coordinator applies max_tokens, stop strings
  and stop ids to the ids, as for every engine), unless a request asks: a logit bias of +100
  forces its token(s) (after `min_tokens`), -100 bans them. Temperature, seeds and penalties
  change nothing. Logprobs asked for are 0.0 (the emitted token is certain).

It keeps count of what it emulated (`report`): steps, emulated compute seconds, prompt and
decode tokens, prompt tokens taken from the prefix cache. Labelled everywhere: `engine_name` "emulated", the worker's Info and logs.
"""

from __future__ import annotations

import array
import json
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from helixserve.costmodel import CostModel
from helixserve.engine.config import ModelArgs
from helixserve.engine.errors import InvalidWorkError
from helixserve.engine.kv_blocks import BlockAllocator, Prefix, items_fit
from helixserve.engine.protocol import (
    ItemOutput,
    KvStats,
    RawHidden,
    WorkItem,
    check_step,
    kv_stats_of,
)
from helixserve.errors import UserError
from helixserve.prefix import CacheEvents
from helixserve.request import PromptLogprob, SamplingParams
from helixserve.spec import GpuCatalog, ModelSpec, NodeSpec, ProfileTable, load_gpu_catalog
from helixserve.spec.model import DTYPE_BYTES, parse_model
from helixserve.spec.profiles import load_profiles
from helixserve.spec.scheduling import DEFAULT_KV_BLOCK_SIZE

#: GB per GPU kept outside weights and KV: the simulator's vllm engine model's (its default),
#: so a rehearsal's KV matches what `simulate` gives the same placement
DEFAULT_RESERVED_GB_PER_GPU = 4.5
#: a logit bias this large forces its token, this negative bans it (OpenAI's range ends)
FORCE_BIAS = 100.0
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class EmulationSpec:
    """Which machine the engine emulates, and from which measurements."""

    gpu: str
    """GPU type: a `gpu` of the profiles (and of the GPU catalog, for its memory)."""
    profiles: ProfileTable
    """Measured per-layer times (`--profiles`); must hold both phases for this machine."""
    num_gpus: int = 1
    """GPUs in the machine, as the profiles' `num_gpus` column."""
    catalog: GpuCatalog | None = None
    """GPU catalog for the memory model; None: the shipped one."""
    reserved_gb_per_gpu: float = DEFAULT_RESERVED_GB_PER_GPU
    """Memory per GPU outside weights and KV (the KV cache is what remains)."""
    time_scale: float = 1.0
    """Every emulated time x this (a host too slow for real time; docs/emulated.md)."""
    model_name: str | None = None
    """The model's name in the profiles; None: the model directory's name."""
    memory_gb: float | None = None
    """The machine's memory budget (a cluster file's `memory_gb`); None: the catalog's."""
    payload_bytes_per_token: int | None = None
    """Bytes a token an activation message carries (module doc); None, or at least the real
    row (hidden_size x dtype bytes): the real bytes. Smaller: the rest is declared to the
    link emulation, which charges it, instead of sent."""

    @classmethod
    def load(cls, gpu: str, profiles_path: str | Path, **options: object) -> EmulationSpec:
        try:
            table = load_profiles(profiles_path)
        except UserError as exc:
            raise UserError(f"--profiles: {exc}") from None
        return cls(gpu, table, **options)  # type: ignore[arg-type]


@dataclass(frozen=True)
class EmulationReport:
    """What an emulated engine has emulated since it started."""

    steps: int
    emulated_s: float
    """Sum of the steps' emulated compute times (what it slept, at time_scale 1)."""
    prompt_tokens: int
    decode_tokens: int
    overrun_s: float = 0.0
    """Seconds steps took beyond their emulated time (bookkeeping slower than the GPU, or a
    host too busy to wake the engine thread on time): not 0 means this host is the limit."""
    cached_tokens: int = 0
    """Prompt tokens taken from the prefix cache (not computed, not timed)."""

    def describe(self) -> str:
        return (f"{self.steps} steps, {self.emulated_s:.2f} s of emulated compute, "
                f"{self.prompt_tokens} prompt + {self.decode_tokens} decode tokens "
                f"({self.cached_tokens} prompt tokens from the prefix cache), "
                f"{self.overrun_s:.2f} s over the emulated times")


class ZeroHidden(RawHidden):
    """Emulated activations of `nbytes` (the real size of `shape` x dtype): zeros, made only
    when `data` is read (when the worker writes the message to the next hop). Until then a
    queued item costs this host no memory for its hidden states, however long the backlog
    behind a slow hop. `data` is `payload_nbytes` of them (all `nbytes` unless a smaller
    payload was asked for); the `unsent_nbytes` left out are declared to the link emulation
    when the message is written (module doc)."""

    nbytes: int
    payload_nbytes: int

    def __init__(self, dtype: str, shape: tuple[int, ...], nbytes: int,
                 payload_nbytes: int | None = None) -> None:
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "nbytes", nbytes)
        object.__setattr__(self, "payload_nbytes",
                           nbytes if payload_nbytes is None else min(payload_nbytes, nbytes))

    @property  # type: ignore[override]
    def data(self) -> bytes:
        return bytes(self.payload_nbytes)

    @property
    def unsent_nbytes(self) -> int:
        """Bytes of the real size that `data` leaves out (runtime/transport.py declares them)."""
        return self.nbytes - self.payload_nbytes

    def __repr__(self) -> str:
        sent = "" if self.payload_nbytes == self.nbytes else f", {self.payload_nbytes} sent"
        return f"ZeroHidden({self.dtype!r}, {self.shape}, {self.nbytes} bytes{sent})"


@dataclass
class _LastStage:
    """What the last stage keeps of one request to choose its tokens."""

    seed: int = 0
    """crc32 of the prompt's token ids so far."""
    prompt_len: int = 0
    sampled_once: bool = False
    prompt_ids: list[int] | None = None
    """Prompt token ids, kept only when prompt logprobs are asked for."""


@dataclass
class _Counters:
    steps: int = 0
    emulated_s: float = 0.0
    prompt_tokens: int = 0
    decode_tokens: int = 0
    overrun_s: float = 0.0
    cached_tokens: int = 0
    step_cache: dict[tuple[int, int, int], float] = field(default_factory=dict)


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _is_decode(it: WorkItem) -> bool:
    """A decode step: one token after the prompt (a prefill chunk otherwise)."""
    return len(it.token_ids) == 1 and it.position > 0


class EmulatedEngine:
    """A layer range of one model on an emulated GPU machine; see the module doc."""

    engine_name = "emulated"
    vllm_version = ""

    def __init__(self, model: ModelSpec, args: ModelArgs, spec: EmulationSpec, start_layer: int,
                 end_layer: int, dtype: str, block_size: int = DEFAULT_KV_BLOCK_SIZE,
                 kv_cache_bytes: int | None = None, allocate_kv: bool = True,
                 prefix_caching: bool = True) -> None:
        if not 0 <= start_layer < end_layer <= model.num_layers:
            raise UserError(f"--layers: range [{start_layer}, {end_layer}) is outside the "
                            f"model's {model.num_layers} layers")
        self.model, self.args, self.spec = model, args, spec
        self.start_layer, self.end_layer = start_layer, end_layer
        self.num_model_layers = model.num_layers
        self.hidden_size = model.hidden_size
        self.vocab_size = model.vocab_size
        self.dtype = dtype
        self.eos_token_ids = list(args.eos_token_ids)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.node = NodeSpec(name=f"emulated-{spec.gpu}", gpu=spec.gpu, num_gpus=spec.num_gpus,
                             memory_gb=spec.memory_gb)
        self.cost = CostModel(model, spec.profiles, spec.catalog or load_gpu_catalog(),
                              reserved_gb_per_gpu=spec.reserved_gb_per_gpu)
        self._row_bytes = model.hidden_size * DTYPE_BYTES[dtype]
        payload = spec.payload_bytes_per_token
        if payload is not None and payload < 1:
            raise UserError(f"--emulated-payload-bytes-per-token: bad value {payload}; need >= 1 "
                            "(or real)")
        #: bytes a token of an activation message; the real row when None or larger
        self.payload_bytes_per_token: int | None = (
            payload if payload is not None and payload < self._row_bytes else None)
        self._special = set(self.eos_token_ids)
        if args.bos_token_id is not None:
            self._special.add(int(args.bos_token_id))
        self._seq_len: dict[str, int] = {}
        self._last: dict[str, _LastStage] = {}
        self._n = _Counters()
        self.kv = BlockAllocator(1, block_size, prefix_caching)  # a placeholder until allocate_kv
        if allocate_kv:
            self.allocate_kv(kv_cache_bytes)

    @classmethod
    def load(cls, model_dir: str | Path, start_layer: int, end_layer: int, spec: EmulationSpec,
             dtype: str | None = None, kv_cache_bytes: int | None = None,
             block_size: int | None = None, prefix_caching: bool = True) -> EmulatedEngine:
        """The engine for [start_layer, end_layer) of the model whose config.json is in
        `model_dir` (no weights are read); UserError naming the flag, file and value for a
        missing config, a GPU the profiles do not hold, a range that leaves no KV."""
        path = Path(model_dir)
        config = path / "config.json"
        if not config.is_file():
            raise UserError(f"--model: {config}: no such file (the emulated engine needs the "
                            "model's config.json, no weights)")
        args = ModelArgs.from_dir(path)
        cfg = json.loads(config.read_text())
        name = spec.model_name or path.resolve().name
        wire = dtype or str(cfg.get("torch_dtype") or "float16")
        if wire not in DTYPE_BYTES:
            raise UserError(f"--dtype: {wire!r} (from {config} torch_dtype unless given) is "
                            f"not served; known: {', '.join(DTYPE_BYTES)}")
        model = parse_model(cfg, name, source=str(config), dtype_bytes=DTYPE_BYTES[wire])
        check_profiled(spec, name)
        return cls(model, args, spec, start_layer, end_layer, wire,
                   block_size=block_size or DEFAULT_KV_BLOCK_SIZE, kv_cache_bytes=kv_cache_bytes,
                   prefix_caching=prefix_caching)

    def with_range(self, start_layer: int, end_layer: int) -> EmulatedEngine:
        """The same machine serving [start_layer, end_layer) (LoadRange); its KV is allocated
        by `allocate_kv`, after this engine's `release_memory` (as the torch engine's)."""
        engine = EmulatedEngine(self.model, self.args, self.spec, start_layer, end_layer,
                                self.dtype, self.block_size, allocate_kv=False,
                                prefix_caching=self.prefix_caching)
        # the machine's report counts every step it emulated, under every range it held (the
        # step times cached per batch shape are the old range's: not carried)
        engine._n = replace(self._n, step_cache={})
        return engine

    # ---- memory ------------------------------------------------------------------------
    def kv_blocks_for(self, kv_cache_bytes: int | None) -> int:
        """Blocks of KV: what `kv_cache_bytes` holds, else what the memory model leaves this
        machine with this range's weights loaded."""
        layers = self.end_layer - self.start_layer
        if kv_cache_bytes is not None:
            per_block = layers * self.model.kv_bytes_per_token_per_layer * self.block_size
            return int(kv_cache_bytes) // per_block
        return self.cost.kv_capacity_tokens(self.node, layers) // self.block_size

    def allocate_kv(self, kv_cache_bytes: int | None = None) -> None:
        """(Re)size the KV cache (drops every request's KV and the prefix cache: the next
        `take_cache_events` says reset); UserError when it holds nothing."""
        blocks = self.kv_blocks_for(kv_cache_bytes)
        if blocks < 1:
            layers = self.end_layer - self.start_layer
            weights_gb = layers * self.model.layer_weight_bytes / 1e9
            have_gb = self.cost.memory_bytes(self.node) / 1e9
            where = ("--kv-cache-bytes" if kv_cache_bytes is not None else
                     f"--layers {self.start_layer}:{self.end_layer}")
            raise UserError(f"{where}: {self.spec.gpu} x{self.spec.num_gpus} has no room for one "
                            f"KV block with {layers} layers of {self.model.name} loaded "
                            f"({weights_gb:.1f} GB of weights, {have_gb:.1f} GB usable)")
        self.kv = BlockAllocator(blocks, self.block_size, self.prefix_caching)
        self._seq_len, self._last = {}, {}

    def release_memory(self) -> None:
        """Drop the KV cache; the engine serves nothing afterwards (LoadRange)."""
        self.kv = BlockAllocator(1, self.block_size, self.prefix_caching)
        self._seq_len, self._last = {}, {}

    # ---- bookkeeping -------------------------------------------------------------------
    def kv_stats(self) -> KvStats:
        return kv_stats_of(self.kv)

    def take_cache_events(self) -> CacheEvents:
        """Prefix blocks stored and evicted since the last call (reset on the first)."""
        return self.kv.take_cache_events()

    def free(self, request_id: str) -> None:
        """Release a request's KV blocks and token state; idempotent."""
        self.kv.free(request_id)
        self._seq_len.pop(request_id, None)
        self._last.pop(request_id, None)

    def seq_len(self, request_id: str) -> int:
        return self._seq_len.get(request_id, 0)

    def report(self) -> EmulationReport:
        n = self._n
        return EmulationReport(n.steps, n.emulated_s, n.prompt_tokens, n.decode_tokens,
                               n.overrun_s, n.cached_tokens)

    def describe(self) -> str:
        """For the worker's start-up log."""
        return (f"EMULATED engine: no weights, times from {self.spec.profiles.source} for "
                f"{self.spec.gpu} x{self.spec.num_gpus}"
                + (f" x time scale {self.spec.time_scale:g}" if self.spec.time_scale != 1 else "")
                + f"; KV {self.kv.num_blocks} blocks of {self.block_size} tokens (memory model, "
                f"{self.spec.reserved_gb_per_gpu:g} GB kept per GPU); activations "
                f"{self._row_bytes} bytes a token ({self.dtype})"
                + ("" if self.payload_bytes_per_token is None else
                   f", sent as {self.payload_bytes_per_token} bytes a token, the rest declared "
                   "to the link emulation (charged, not sent)"))

    # ---- time --------------------------------------------------------------------------
    def step_time_s(self, items: list[WorkItem]) -> float:
        """Emulated seconds of one step over `items` (module doc), before time_scale. Only
        the items' tokens are timed: a prefix attached from the cache is not computed."""
        cuts = sorted({it.start_layer for it in items} | {it.end_layer for it in items})
        total = 0.0
        for a, b in zip(cuts, cuts[1:], strict=False):
            prompt = decode = 0
            for it in items:
                if it.start_layer <= a and b <= it.end_layer:
                    if _is_decode(it):
                        decode += 1
                    else:
                        prompt += len(it.token_ids)
            if prompt or decode:
                total += self._layers_time_s(b - a, prompt, decode)
        sampled = [it for it in items if it.end_layer == self.num_model_layers and it.sample]
        if sampled:
            phase = "decode" if any(_is_decode(it) for it in sampled) else "prompt"
            total += self.cost.head_time_s(self.node, phase, len(sampled))
        return total

    def _layers_time_s(self, layers: int, prompt_tokens: int, decode_seqs: int) -> float:
        cache = self._n.step_cache
        key = (layers, prompt_tokens, decode_seqs)
        t = cache.get(key)
        if t is None:
            if len(cache) > 100_000:
                cache.clear()
            t = cache[key] = self.cost.batch_time_s(self.node, layers, prompt_tokens, decode_seqs)
        return t

    def compact_input(self, hidden: RawHidden) -> RawHidden:
        """What the worker keeps of a received item's hidden states while it waits for its
        step: their dtype, shape and size, not their bytes. The emulated engine's outputs are
        zeros of the real size whatever came in, so a backlog of queued prefill chunks (8 MiB
        each for LLaMA-2-70B) costs this host no memory; the bytes still crossed the hop (or
        a smaller payload did, the rest charged by the link emulation: module doc)."""
        shape = tuple(hidden.shape)
        real = self._row_bytes_of(hidden.dtype) * (shape[0] if shape else 0)
        return ZeroHidden(hidden.dtype, shape, real, len(hidden.data))

    def _row_bytes_of(self, dtype: str) -> int:
        return self.hidden_size * DTYPE_BYTES[dtype]

    # ---- the step ----------------------------------------------------------------------
    def kv_fits(self, items: list[WorkItem]) -> bool:
        """Whether `step(items)` would find its KV blocks (changes nothing): the worker asks
        it to run the items that fit when a step is out of KV (runtime/worker.py)."""
        return items_fit(self.kv, items)

    def step(self, items: list[WorkItem]) -> list[ItemOutput]:
        """One step over all items, taking the emulated time; outputs in the order of items.
        KvExhaustedError / InvalidWorkError / PrefixMissError change nothing and take no
        time."""
        if not items:
            return []
        t0 = time.perf_counter()
        self._validate(items)
        prefixes: dict[str, Prefix] = {}
        for it in items:  # every prefix checked before anything changes
            if it.prefix_token_ids:
                p = prefixes[it.request_id] = Prefix(it.prefix_token_ids, it.start_layer,
                                                     it.end_layer)
                self.kv.check_prefix(it.request_id, p)
        for it in items:
            rid = it.request_id
            if rid in prefixes:
                if self.kv.has(rid) or rid in self._seq_len:
                    self.free(rid)  # known here: it starts over from its prefix
            elif it.position < self._seq_len.get(rid, 0):
                self.kv.truncate(rid, it.position)  # re-prefill from `position`
                self._seq_len[rid] = it.position
        self.kv.reserve({it.request_id: it.position + len(it.token_ids) for it in items},
                        prefixes)
        emulated_s = self.step_time_s(items) * self.spec.time_scale
        outs = [self._output(it) for it in items]
        n = self._n
        n.steps += 1
        n.emulated_s += emulated_s
        for it in items:
            self._seq_len[it.request_id] = it.position + len(it.token_ids)
            self.kv.commit(it.request_id, it.position, it.token_ids, it.start_layer,
                           it.end_layer)
            if it.prefix_token_ids:
                n.cached_tokens += len(it.prefix_token_ids)
            if _is_decode(it):
                n.decode_tokens += 1
            else:
                n.prompt_tokens += len(it.token_ids)
        left = t0 + emulated_s - time.perf_counter()
        if left > 0:
            time.sleep(left)
        n.overrun_s += max(0.0, time.perf_counter() - t0 - emulated_s)
        return outs

    def _validate(self, items: list[WorkItem]) -> None:
        check_step(items, self, lambda rid: self._seq_len.get(rid, 0))

    def _output(self, it: WorkItem) -> ItemOutput:
        out = ItemOutput(it.request_id)
        n = len(it.token_ids)
        if it.end_layer < self.num_model_layers:
            # hidden: [n, hidden_size], zeros in the dtype that came in (self.dtype on the
            # first stage): the emulated activations carry no values, only their size
            h = it.hidden
            dtype = h.dtype if isinstance(h, RawHidden) else self.dtype
            payload = self.payload_bytes_per_token
            out.hidden = ZeroHidden(dtype, (n, self.hidden_size), n * self._row_bytes_of(dtype),
                                    None if payload is None else n * payload)
            return out
        state = self._record_prompt(it)
        if it.sample:
            params = it.sampling or SamplingParams()
            position = it.position + n  # of the token chosen now
            out.token_id = self.token_at(state.seed, position, position - state.prompt_len,
                                         params)
            if params.logprobs is not None:
                out.logprob = 0.0
                out.top_logprobs = [(out.token_id, 0.0)] if params.logprobs > 0 else []
            if params.prompt_logprobs is not None and not state.sampled_once:
                top = params.prompt_logprobs > 0
                out.prompt_logprobs = [PromptLogprob(t, 0.0, [(t, 0.0)] if top else [])
                                       for t in (state.prompt_ids or [])[1:]]
                state.prompt_ids = None
            state.sampled_once = True
        return out

    def _record_prompt(self, it: WorkItem) -> _LastStage:
        """Fold the item's prompt tokens into its request's seed (last stage); for a request
        that took a prefix from the cache, the prefix's first, as if computed."""
        if it.position == 0 or it.prefix_token_ids:
            self._last.pop(it.request_id, None)  # a new request, or a re-prefill
        state = self._last.setdefault(it.request_id, _LastStage())
        if it.prefix_token_ids:
            self._fold_prompt(state, it, 0, it.prefix_token_ids)
        self._fold_prompt(state, it, it.position, it.token_ids)
        return state

    @staticmethod
    def _fold_prompt(state: _LastStage, it: WorkItem, position: int,
                     token_ids: list[int]) -> None:
        """Fold the prompt ones of tokens [position, ...) of `it`'s request into its seed
        (crc32 is incremental: folding in pieces gives the seed of the whole)."""
        if it.num_prompt_tokens is not None:
            prompt = token_ids[: max(0, it.num_prompt_tokens - position)]
        else:
            prompt = [] if state.sampled_once else token_ids
        if prompt and position == state.prompt_len:
            state.seed = zlib.crc32(array.array("q", prompt).tobytes(), state.seed)
            state.prompt_len += len(prompt)
            if it.sampling is not None and it.sampling.prompt_logprobs is not None:
                state.prompt_ids = (state.prompt_ids or []) + list(prompt)

    def token_at(self, seed: int, position: int, index: int, params: SamplingParams) -> int:
        """The token at `position` (the `index`-th generated) of a request whose prompt hashes
        to `seed`: never EOS, BOS or a stop id unless a +100 logit bias forces it (and
        min_tokens are done); never a token with a -100 bias."""
        banned = set(self._special) | set(params.stop_token_ids)
        banned.update(t for t, b in params.logit_bias if b <= -FORCE_BIAS)
        h = _mix64((seed << 32) ^ position)
        forced = sorted(t for t, b in params.logit_bias if b >= FORCE_BIAS and t < self.vocab_size)
        if forced:
            allowed = [t for t in forced if index >= params.min_tokens or t not in banned]
            if allowed:
                return allowed[h % len(allowed)]
        token = h % self.vocab_size
        for _ in range(self.vocab_size):
            if token not in banned:
                return token
            token = (token + 1) % self.vocab_size
        raise InvalidWorkError("every token of the vocabulary is banned by the logit bias")


def check_profiled(spec: EmulationSpec, model_name: str) -> None:
    """UserError naming --profiles, --gpu and the machines profiled, unless the profiles time
    both phases of `model_name` on `spec`'s machine."""
    table = spec.profiles
    if table.has(model_name, spec.gpu, spec.num_gpus):
        catalog = spec.catalog or load_gpu_catalog()
        if spec.gpu not in catalog:
            raise UserError(f"--gpu: {spec.gpu!r} is not in the GPU catalog {catalog.source} (its "
                            f"memory sizes the KV cache); known: {', '.join(catalog.names())}")
        return
    machines = sorted({(g, n) for (m, g, n, _ph) in table.curves if m == model_name})
    if not machines:
        models = sorted({m for (m, _g, _n, _ph) in table.curves})
        raise UserError(f"--profiles {table.source}: no rows for model {model_name!r} (the "
                        f"model directory's name); profiled models: {', '.join(models) or 'none'}")
    known = ", ".join(f"{g} x{n}" for g, n in machines)
    raise UserError(f"--gpu: {spec.gpu!r} x{spec.num_gpus} has no prompt and decode rows for "
                    f"{model_name!r} in --profiles {table.source}; profiled: {known}")
