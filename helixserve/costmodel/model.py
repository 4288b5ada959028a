"""Cost model: time of a batch on a layer range of a machine, memory, node throughput T(k).

Time of ONE layer for a mixed batch of P prompt tokens and D decode sequences is, as in
Helix, t(P, D) = t_prompt(P) + t_decode(D):
  * measured: linear interpolation in the profiles table when (model, gpu, num_gpus) has
    both curves (clamped below the first point, linear extrapolation past the last);
  * analytic otherwise, a roofline summed over its parts on num_gpus x the catalog rates:
      t_decode(D) = W/(BW e_bw) + 2 N D/(F e_f) + D c kv/(BW e_bw)
      t_prompt(P) = W/(BW e_bw) + 2 N P/(F e_f)
    (W layer weight bytes, N layer params, kv KV bytes per token per layer, c the context
    length a decoding sequence reads). e_bw, e_f and c are fitted to the measured curves.
Memory of a machine holding k layers: k W for weights and the rest (times
MEMORY_UTILIZATION) for KV cache. Planners keep weights within WEIGHT_FRACTION of the memory
(Helix's rule, `max_layers`); a machine can load more (`loadable_layers`), with little KV.
T(k) (docs/planner.md): decode tokens/s of the machine with the largest batch its KV cache
and its batch limit allow, each sequence holding `context_tokens` of KV:
      b(k) = min(max_decode_tokens, kv_capacity_tokens(k) / context_tokens)
      T(k) = b(k) / (k t_decode(b(k)))
With a `Workload` (costmodel/workload.py, docs/planner.md "Workload-aware planning") T(k)
is output tokens/s of that mix at the decode-only batch b(k) (P' = the mean prompt, capped
at the node's prompt batch limit):
      T(k)  = b / (k t_decode(b) + r b k t_prompt(P') / P')
r = 0 gives the decode-only T(k) exactly.
The head (the node holding the model's last layer also runs the final norm, the lm_head and
sampling on one row per sequence sampled in a step; docs/calibration.md "The head"):
`head_ms` from the profiles' part=head rows, else a roofline like a layer's
      t_head(n) = (V H + H) bytes/(BW e_bw) + 2 V H n/(F e_f)     (V vocab, H hidden, n rows)
times, on a machine with measured layers, t_decode(n) measured / t_decode(n) analytic.
A node's T(k) with `holds_last_layer` adds t_head(b)/b per output token (one sampled row per
output token).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from helixserve.costmodel.workload import Workload
from helixserve.errors import UserError
from helixserve.spec import ClusterSpec, Curve, GpuCatalog, ModelSpec, NodeSpec, ProfileTable
from helixserve.spec.gpus import load_gpu_catalog

GIB = 2**30
#: weights may use at most this fraction of a machine's memory (Helix's cap); the rest is KV
WEIGHT_FRACTION = 0.5
#: above this the engine's MEMORY_UTILIZATION leaves no KV at the cap
MAX_WEIGHT_FRACTION = 0.9
#: per-GPU memory held by the CUDA context, activations and the allocator, never usable
RESERVED_BYTES_PER_GPU = 1 * GIB
#: the same for vLLM, fitted to the KV blocks vLLM 0.4.0 allocated with k layers of
#: LLaMA-2-70B loaded on an A100-40GB, L4 and T4 (Helix's measurements,
#: examples/profiles/helix-gpu-constants.csv): with 4.5 GB our KV matches theirs
#: within 6% at every k; with 1 GiB it is 10-66% more. The simulator's vLLM engine model
#: uses it (helixserve.simulator.presets)
VLLM_RESERVED_GB_PER_GPU = 4.5
#: fraction of memory the serving engine may allocate (vLLM's gpu_memory_utilization)
MEMORY_UTILIZATION = 0.9
#: KV tokens a decoding sequence holds on average (the Azure conversation trace: ~1000)
DEFAULT_CONTEXT_TOKENS = 1024
#: batch limits of the analytic model (a measured curve's last point otherwise)
ANALYTIC_MAX_PROMPT_TOKENS = 8192
ANALYTIC_MAX_DECODE_TOKENS = 512
#: fallbacks when no measured curve is there to fit the factors to
DEFAULT_EFFICIENCY = (0.8, 0.5, 512.0)  # (e_bw, e_f, decode context tokens)


@dataclass(frozen=True)
class Efficiency:
    """Fitted factors of the analytic model."""

    memory_bandwidth: float
    tensor_flops: float
    decode_context_tokens: float


def _interp(curve: Curve, tokens: float) -> float:
    """Time at `tokens`: linear between points, clamped below, extrapolated above."""
    xs, ys = curve.batch_tokens, curve.layer_ms
    if tokens <= xs[0]:
        return ys[0]
    if tokens >= xs[-1]:
        if len(xs) == 1:
            return ys[-1]
        # slope of a least-squares line through the upper half: robust to the last point's noise
        half = max(2, len(xs) // 2)
        tx, ty = xs[-half:], ys[-half:]
        mx, my = statistics.fmean(tx), statistics.fmean(ty)
        var = sum((x - mx) ** 2 for x in tx)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(tx, ty, strict=True)) / var)
        return ys[-1] + slope * (tokens - xs[-1])
    lo, hi = 0, len(xs) - 1
    while hi - lo > 1:  # bisect
        mid = (lo + hi) // 2
        if xs[mid] <= tokens:
            lo = mid
        else:
            hi = mid
    frac = (tokens - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] + frac * (ys[hi] - ys[lo])


class CostModel:
    def __init__(
        self,
        model: ModelSpec,
        profiles: ProfileTable | None = None,
        catalog: GpuCatalog | None = None,
        *,
        context_tokens: int | None = None,
        workload: Workload | None = None,
        weight_fraction: float = WEIGHT_FRACTION,
        reserved_gb_per_gpu: float | None = None,
    ) -> None:
        self.model = model
        self.profiles = profiles or ProfileTable.empty()
        self.catalog = catalog or load_gpu_catalog()
        #: None: Helix's decode-only T(k) in decode tokens/s; set: T(k) in output tokens/s of
        #: this mix (module doc), and the flow network's links scaled to the same unit
        self.workload = workload
        #: KV tokens per decoding sequence: given, else the workload's prompt + output, else
        #: DEFAULT_CONTEXT_TOKENS
        self.context_tokens = (context_tokens if context_tokens is not None
                               else workload.kv_tokens_per_request if workload is not None
                               else DEFAULT_CONTEXT_TOKENS)
        #: token positions whose hidden states cross a link per unit of flow: 1 + r with a
        #: workload, 1 decode-only (module doc)
        self.activation_tokens_per_flow_unit = (
            workload.activation_tokens_per_output_token if workload is not None else 1.0)
        if not 0.0 < weight_fraction <= 1.0:
            raise UserError(f"cost model: weight_fraction: bad value {weight_fraction}; "
                            f"must be in (0, 1]")
        #: most of a machine's memory its weights may take (Helix: 0.5); less leaves more KV
        self.weight_fraction = weight_fraction
        if reserved_gb_per_gpu is not None and not 0.0 <= reserved_gb_per_gpu < 1e4:
            raise UserError(f"cost model: reserved_gb_per_gpu: bad value {reserved_gb_per_gpu}; "
                            f"must be >= 0 GB")
        #: memory per GPU outside weights and KV (CUDA context, activations, graphs)
        self.reserved_bytes_per_gpu = (RESERVED_BYTES_PER_GPU if reserved_gb_per_gpu is None
                                       else reserved_gb_per_gpu * 1e9)
        self.efficiency = self._fit_efficiency()
        self._throughput_cache: dict[tuple[str, int, float | None, int, bool], float] = {}

    # ---- time -------------------------------------------------------------------------
    def measured(self, gpu: str, num_gpus: int) -> bool:
        return self.profiles.has(self.model.name, gpu, num_gpus)

    def layer_time_ms(self, gpu: str, num_gpus: int, prompt_tokens: int,
                      decode_tokens: int) -> float:
        """Time of one layer for a batch of `prompt_tokens` prefill + `decode_tokens` decode."""
        total = 0.0
        if self.measured(gpu, num_gpus):
            if prompt_tokens > 0:
                c = self.profiles.curve(self.model.name, gpu, num_gpus, "prompt")
                assert c is not None
                total += _interp(c, prompt_tokens)
            if decode_tokens > 0:
                c = self.profiles.curve(self.model.name, gpu, num_gpus, "decode")
                assert c is not None
                total += _interp(c, decode_tokens)
            return total
        if prompt_tokens > 0:
            total += self._analytic_ms(gpu, num_gpus, prompt_tokens, "prompt", self.efficiency)
        if decode_tokens > 0:
            total += self._analytic_ms(gpu, num_gpus, decode_tokens, "decode", self.efficiency)
        return total

    def batch_time_s(self, node: NodeSpec, num_layers: int, prompt_tokens: int,
                     decode_tokens: int) -> float:
        """Time for `node` to run the batch through `num_layers` layers."""
        ms = self.layer_time_ms(node.gpu, node.num_gpus, prompt_tokens, decode_tokens)
        return num_layers * ms / 1000.0

    def head_ms(self, gpu: str, num_gpus: int, phase: str, rows: int) -> float:
        """Time of the last stage's head (final norm + lm_head + sampler) in a step that
        samples `rows` rows (decode: its sequences; prompt: the sequences whose prompt ends
        in it). From the head rows of the profiles (the other phase's when this one has
        none), else the roofline of the module doc scaled to the machine's measured layer
        time; for a machine with measured layers but not in the catalog, its decode layer
        time times the head's share of parameters."""
        if rows <= 0:
            return 0.0
        name = self.model.name
        other = "prompt" if phase == "decode" else "decode"
        curve = (self.profiles.head_curve(name, gpu, num_gpus, phase)
                 or self.profiles.head_curve(name, gpu, num_gpus, other))
        if curve is not None:
            return _interp(curve, rows)
        m = self.model
        head_params = m.vocab_size * m.hidden_size + m.hidden_size  # lm_head + final norm
        if gpu not in self.catalog:
            return (self.layer_time_ms(gpu, num_gpus, 0, rows)
                    * head_params / m.layer_params)
        spec = self.catalog.get(gpu)
        eff = self.efficiency
        bw_bytes_per_s = spec.memory_bandwidth_gbytes_per_s * 1e9 * num_gpus * eff.memory_bandwidth
        flops_per_s = max(spec.dense_tflops, 1e-3) * 1e12 * num_gpus * eff.tensor_flops
        t_s = head_params * m.dtype_bytes / bw_bytes_per_s + 2.0 * head_params * rows / flops_per_s
        if self.measured(gpu, num_gpus):
            # the roofline says how the head compares with a layer, the measured layer how fast
            # this machine is (the rig's slowed pseudo-GPUs share one catalog row)
            t_s *= (self.layer_time_ms(gpu, num_gpus, 0, rows)
                    / self._analytic_ms(gpu, num_gpus, rows, "decode", eff))
        return t_s * 1000.0

    def head_time_s(self, node: NodeSpec, phase: str, rows: int) -> float:
        """`head_ms` of `node`, in seconds."""
        return self.head_ms(node.gpu, node.num_gpus, phase, rows) / 1000.0

    def _analytic_ms(self, gpu: str, num_gpus: int, tokens: float, phase: str,
                     eff: Efficiency) -> float:
        spec = self.catalog.get(gpu)
        bw_bytes_per_s = spec.memory_bandwidth_gbytes_per_s * 1e9 * num_gpus * eff.memory_bandwidth
        flops_per_s = max(spec.dense_tflops, 1e-3) * 1e12 * num_gpus * eff.tensor_flops
        m = self.model
        t_s = m.layer_weight_bytes / bw_bytes_per_s + 2.0 * m.layer_params * tokens / flops_per_s
        if phase == "decode":
            t_s += tokens * eff.decode_context_tokens * m.kv_bytes_per_token_per_layer / bw_bytes_per_s
        return t_s * 1000.0

    def _fit_efficiency(self) -> Efficiency:
        """Fit e_bw, e_f and the decode context to every measured curve of a catalog GPU."""
        m = self.model
        e_bw: list[float] = []
        e_f: list[float] = []
        machines = {(g, n) for (_, g, n, _) in self.profiles.curves if g in self.catalog}
        models = {mod for (mod, _, _, _) in self.profiles.curves}
        # curves of another model of the table still tell how efficient the GPU is, but the
        # byte and FLOP counts are this model's, so only use this model's curves when present
        use_model = m.name if m.name in models else None
        if use_model is None:
            return Efficiency(*DEFAULT_EFFICIENCY)
        for gpu, n in sorted(machines):
            spec = self.catalog.get(gpu)
            dec = self.profiles.curve(use_model, gpu, n, "decode")
            pro = self.profiles.curve(use_model, gpu, n, "prompt")
            if dec is None or pro is None:
                continue
            bw = spec.memory_bandwidth_gbytes_per_s * 1e9 * n
            e_bw.append(min(1.0, m.layer_weight_bytes / bw / (dec.layer_ms[0] / 1000.0)))
            t_last_s = pro.layer_ms[-1] / 1000.0 - m.layer_weight_bytes / (bw * e_bw[-1])
            if t_last_s > 0 and spec.dense_tflops > 0:
                flops = 2.0 * m.layer_params * pro.batch_tokens[-1]
                e_f.append(min(1.0, flops / (spec.dense_tflops * 1e12 * n) / t_last_s))
        if not e_bw or not e_f:
            return Efficiency(*DEFAULT_EFFICIENCY)
        base = Efficiency(statistics.median(e_bw), statistics.median(e_f), 0.0)
        contexts: list[float] = []
        for gpu, n in sorted(machines):
            dec = self.profiles.curve(use_model, gpu, n, "decode")
            if dec is None or not self.profiles.has(use_model, gpu, n):
                continue
            d = dec.batch_tokens[-1]
            residual_ms = dec.layer_ms[-1] - self._analytic_ms(gpu, n, d, "decode", base)
            bw = self.catalog.get(gpu).memory_bandwidth_gbytes_per_s * 1e9 * n * base.memory_bandwidth
            contexts.append(max(0.0, residual_ms / 1000.0 * bw / (d * m.kv_bytes_per_token_per_layer)))
        ctx = statistics.median(contexts) if contexts else DEFAULT_EFFICIENCY[2]
        return Efficiency(base.memory_bandwidth, base.tensor_flops, ctx)

    # ---- memory -----------------------------------------------------------------------
    def memory_bytes(self, node: NodeSpec, reserved_per_gpu: float | None = None) -> float:
        """Usable memory of the node: its budget, or the catalog memory less a per-GPU
        reserve (the cost model's `reserved_bytes_per_gpu` unless given)."""
        if node.memory_gb is not None:
            return node.memory_gb * 1e9
        spec = self.catalog.get(node.gpu)
        reserve = self.reserved_bytes_per_gpu if reserved_per_gpu is None else reserved_per_gpu
        return node.num_gpus * max(0.0, spec.memory_gb * GIB - reserve)

    def max_layers(self, node: NodeSpec, weight_fraction: float | None = None) -> int:
        """Most layers the node can hold: weights within `weight_fraction` (default: this
        model's) of its memory. The cap is Helix's rule of thumb for the machine, so it is
        taken with the default reserve whatever `reserved_gb_per_gpu` says (that one changes
        the KV, not the cap)."""
        fraction = self.weight_fraction if weight_fraction is None else weight_fraction
        memory = self.memory_bytes(node, RESERVED_BYTES_PER_GPU)
        k = int(memory * fraction // self.model.layer_weight_bytes)
        return min(k, self.model.num_layers)

    def loadable_layers(self, node: NodeSpec) -> int:
        """Most layers the node can physically serve: their weights fit in the memory the
        engine may allocate (MEMORY_UTILIZATION) with KV left for one sequence of
        `context_tokens` on every layer. Planners stay within `max_layers` (the weight cap);
        a placement beyond it but within this still runs, with little KV (Helix's own
        separate-pipeline baselines do this), so the evaluator and simulator accept it."""
        m = self.model
        per_layer = m.layer_weight_bytes + self.context_tokens * m.kv_bytes_per_token_per_layer
        k = int(self.memory_bytes(node) * MEMORY_UTILIZATION // per_layer)
        return max(self.max_layers(node), min(k, m.num_layers))

    def servable_layers(self, node: NodeSpec) -> int:
        """Most layers, within the weight cap, the node holds with T(k) > 0: with KV left for
        a batch (a large --gpu-reserve-gb leaves some nodes KV for fewer layers than the
        cap; T(k) only falls as k grows, so the first k from the cap down is the one)."""
        k = self.max_layers(node)
        while k > 0 and self.node_throughput_tokens_per_s(node, k) <= 0:
            k -= 1
        return k

    def _check_kv_left(self, cluster: ClusterSpec) -> None:
        """Raise UserError when the per-GPU reserve leaves the nodes KV cache for too few
        layers to serve every layer (their T(k) would be 0: a plan of throughput 0)."""
        servable = {n.name: self.servable_layers(n) for n in cluster.nodes}
        layers = sum(servable.values())
        if layers >= self.model.num_layers:
            return
        where = (f"{cluster.source}: with {self.reserved_bytes_per_gpu / 1e9:g} GB kept per GPU "
                 f"(--gpu-reserve-gb), ")
        idle = [n.name for n in cluster.nodes if servable[n.name] == 0]
        if idle:
            raise UserError(
                f"{where}{len(idle)} of {len(cluster.nodes)} nodes have no memory left for KV "
                f"cache (first: {idle[0]}); the others hold at most {layers} of the "
                f"{self.model.num_layers} layers")
        short = next(n for n in cluster.nodes if servable[n.name] < self.max_layers(n))
        raise UserError(
            f"{where}the nodes have memory left for KV cache on at most {layers} of the "
            f"{self.model.num_layers} layers (first short: {short.name}, {servable[short.name]} "
            f"of its {self.max_layers(short)})")

    def kv_capacity_tokens(self, node: NodeSpec, num_layers: int) -> int:
        """Tokens of KV cache per layer held, with `num_layers` layers loaded."""
        if num_layers <= 0:
            return 0
        free = (self.memory_bytes(node) * MEMORY_UTILIZATION
                - num_layers * self.model.layer_weight_bytes)
        per_token = num_layers * self.model.kv_bytes_per_token_per_layer
        return max(0, int(free // per_token))

    def batch_limits(self, node: NodeSpec) -> tuple[int, int]:
        """(max prompt tokens, max decode sequences) of one iteration of the node."""
        if self.measured(node.gpu, node.num_gpus):
            pro = self.profiles.curve(self.model.name, node.gpu, node.num_gpus, "prompt")
            dec = self.profiles.curve(self.model.name, node.gpu, node.num_gpus, "decode")
            assert pro is not None and dec is not None
            return pro.batch_tokens[-1], dec.batch_tokens[-1]
        return ANALYTIC_MAX_PROMPT_TOKENS, ANALYTIC_MAX_DECODE_TOKENS

    # ---- throughput -------------------------------------------------------------------
    def decode_batch(self, node: NodeSpec, num_layers: int) -> int:
        """b(k): decode sequences the node batches when holding `num_layers` layers."""
        kv_seqs = self.kv_capacity_tokens(node, num_layers) // self.context_tokens
        return max(0, min(self.batch_limits(node)[1], kv_seqs))

    def node_throughput_tokens_per_s(self, node: NodeSpec, num_layers: int,
                                     holds_last_layer: bool = False) -> float:
        """T(k): decode tokens/s through the node holding `num_layers` layers (0 if it can't
        load them: more than `loadable_layers`); with a workload, output tokens/s of its mix.
        `holds_last_layer`: the layers end at the model's last, so the node runs the head too."""
        key = (node.gpu, node.num_gpus, node.memory_gb, num_layers, holds_last_layer)
        cached = self._throughput_cache.get(key)
        if cached is not None:
            return cached
        value = 0.0
        if 0 < num_layers <= self.loadable_layers(node):
            head = self.head_time_s if holds_last_layer else None
            b = self.decode_batch(node, num_layers)
            if b > 0:
                value = b / (self.batch_time_s(node, num_layers, 0, b)
                             + b * self.prompt_s_per_output_token(node, num_layers)
                             + (head(node, "decode", b) if head is not None else 0.0))
        self._throughput_cache[key] = value
        return value

    def prompt_s_per_output_token(self, node: NodeSpec, num_layers: int) -> float:
        """Seconds the node spends prefilling the r prompt tokens that come with one output
        token of the workload (0 without one, or with r = 0), timed at a batch of the mean
        prompt capped at the node's prompt batch limit (longer prompts are split)."""
        w = self.workload
        if w is None or w.prompt_tokens <= 0:
            return 0.0
        p = max(1, min(round(w.prompt_tokens), self.batch_limits(node)[0]))
        return (w.prompt_tokens_per_output_token
                * self.batch_time_s(node, num_layers, p, 0) / p)

    def check_fits(self, cluster: ClusterSpec) -> None:
        """Raise UserError when the whole cluster cannot hold every layer of the model."""
        total = sum(self.max_layers(n) for n in cluster.nodes)
        if total >= self.model.num_layers:
            self._check_kv_left(cluster)
            return
        m = self.model
        need_gb = m.num_layers * m.layer_weight_bytes / self.weight_fraction / 1e9
        have_gb = sum(self.memory_bytes(n) for n in cluster.nodes) / 1e9
        short = max(need_gb - have_gb, (m.num_layers - total) * m.layer_weight_bytes
                    / self.weight_fraction / 1e9)
        raise UserError(
            f"{cluster.source}: model {m.name!r} ({m.num_layers} layers x "
            f"{m.layer_weight_bytes / 1e9:.3f} GB) does not fit in the cluster: its nodes hold at "
            f"most {total} layers ({have_gb:.1f} GB usable, weights at most "
            f"{self.weight_fraction:.0%} of it); short by {math.ceil(short * 100) / 100:.2f} GB"
            + self._fraction_hint(cluster)
        )

    def _fraction_hint(self, cluster: ClusterSpec) -> str:
        """'; --weight-fraction F would let it fit' with the smallest such F in steps of 0.05,
        or '' when even MAX_WEIGHT_FRACTION would not (or the cap is not the reason)."""
        steps = range(int(round(self.weight_fraction * 20)) + 1,
                      int(round(MAX_WEIGHT_FRACTION * 20)) + 1)
        for step in steps:
            f = step / 20
            if sum(self.max_layers(n, f) for n in cluster.nodes) >= self.model.num_layers:
                return (f"; with --weight-fraction {f:g} it loads, with less KV cache per node "
                        f"(lower throughput)")
        return ""
