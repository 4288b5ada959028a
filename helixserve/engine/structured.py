"""Grammar-constrained sampling on the last stage (llguidance), per request, per step.

A request with `SamplingParams.structured` gets a `GrammarState` in its `RequestHistory`: an
llguidance matcher over the model's tokenizer, advanced by the request's generated tokens in
order. Each step, before the sampler picks (greedy included), `constrain_` asks each such
row's matcher which tokens may come next (a bitmask of [ceil(vocab / 32)] int32 words,
computed on the CPU, on llguidance's thread pool when there are many) and sets the others'
logits to -inf (greedy rows on the CPU mostly skip that: their best allowed token is found
among their top candidates). EOS is allowed only where the grammar accepts, and is the only token left
once the grammar is finished, so the request ends there.

The matcher follows the tokens, not the route: it is built lazily from the request's generated
tokens the first time a row of the request is sampled here, so a request replayed on a new
route, or re-prefilled after preemption (prompt + output with `num_prompt_tokens`), replays
its output through a fresh matcher and goes on where it was. It lives in the history, which the
engine drops on `free`.

The tokenizer: the engine that loads a last stage registers its model (`register_model`: the
model directory, the logits' width and the EOS ids); the llguidance tokenizer is built from it
on the first structured request (~0.4 s for tokenizer.json) and kept. A pristine matcher per
grammar is kept too (building one compiles the grammar against the tokenizer), and each
request starts from a copy.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from helixserve.engine.history import RequestHistory, suppresses_stop
from helixserve.request import SamplingParams, StructuredOutput
from helixserve.structured import grammar_of

log = logging.getLogger(__name__)

NEG_INF = float("-inf")
#: greedy constrained rows on the CPU: the best allowed token is looked for among this many
#: most likely tokens first (one top-k, no pass over the row to mask it)
GREEDY_CANDIDATES = 16
#: pristine matchers kept per process (one per distinct grammar)
MATCHER_CACHE_SIZE = 64
#: masks are computed on llguidance's thread pool from this many rows, on hosts with this
#: many CPUs; below, one after the other on the engine thread (~10-100 us a row: a pool's
#: spinning threads would cost the forward pass more on a small host)
PARALLEL_FILL_ROWS = 16
PARALLEL_FILL_CPUS = 8


@dataclass(frozen=True)
class ModelTokenizer:
    """Where a last stage's tokenizer comes from, and what the sampler's logits look like."""

    model_path: Path
    """HF model directory (tokenizer.json), or a GGUF file / directory holding one."""
    vocab_size: int
    """Width of the logits rows (the lm_head's rows; may exceed the tokenizer's vocabulary)."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end a request: allowed where the grammar accepts, forced when it is done."""


_models: dict[int, ModelTokenizer] = {}


def register_model(model_path: str | Path, vocab_size: int,
                   eos_token_ids: list[int] | tuple[int, ...]) -> None:
    """Called by an engine that holds a model's last layer: structured rows of logits
    [rows, vocab_size] are constrained with this model's tokenizer."""
    _models[vocab_size] = ModelTokenizer(Path(model_path), vocab_size, tuple(eos_token_ids))


def _model_for(vocab_size: int) -> ModelTokenizer:
    model = _models.get(vocab_size)
    if model is None:
        raise RuntimeError(
            f"structured output: no model registered for logits of width {vocab_size} "
            "(engine/structured.register_model is called when a last stage loads)")
    return model


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(model: ModelTokenizer) -> Any:
    import llguidance

    path = model.model_path
    folder = path if path.is_dir() else path.parent
    eos = list(model.eos_token_ids) or None
    tokenizer_json = folder / "tokenizer.json"
    if tokenizer_json.is_file():
        return llguidance.LLTokenizer(tokenizer_json.read_text(), n_vocab=model.vocab_size,
                                      eos_token=eos)
    # a GGUF model without tokenizer.json: transformers reads the tokenizer out of the file
    import llguidance.hf
    from transformers import AutoTokenizer

    gguf = {"gguf_file": path.name} if path.is_file() else {}
    hf: Any = AutoTokenizer.from_pretrained(str(folder), **gguf)
    return llguidance.hf.from_tokenizer(hf, n_vocab=model.vocab_size, eos_token=eos)


_pristine: OrderedDict[tuple[int, str], Any] = OrderedDict()


def _new_matcher(model: ModelTokenizer, so: StructuredOutput) -> Any:
    """A fresh matcher for `so`: a copy of the cached pristine one."""
    import llguidance

    key = (model.vocab_size, grammar_of(so))
    base = _pristine.get(key)
    if base is None:
        base = llguidance.LLMatcher(_ll_tokenizer(model), key[1], log_level=0)
        if base.is_error():  # grammar_of validated it without a tokenizer; say why anyway
            raise RuntimeError(f"structured output: {base.get_error()}")
        _pristine[key] = base
        if len(_pristine) > MATCHER_CACHE_SIZE:
            _pristine.popitem(last=False)
    else:
        _pristine.move_to_end(key)
    return base.deep_copy()


@dataclass
class GrammarState:
    """One request's matcher and how far into its generated tokens it has read."""

    matcher: Any
    """llguidance.LLMatcher"""
    eos_token_ids: tuple[int, ...]
    consumed: int = 0
    """Generated tokens fed to the matcher so far."""
    reported: bool = field(default=False)
    """Its error was logged once."""

    def advance(self, output_ids: list[int]) -> None:
        """Feed the generated tokens the matcher has not read yet. An EOS after the grammar
        finished (a request with ignore_eos goes on) is not fed: it is all it allows."""
        m = self.matcher
        for token in output_ids[self.consumed:]:
            if not (m.is_stopped() and token in self.eos_token_ids):
                m.consume_token(token)
        self.consumed = len(output_ids)
        if m.is_error() and not self.reported:
            # a rejected token (only from a row whose mask allowed nothing): llguidance then
            # allows only EOS, so the request ends
            self.reported = True
            log.warning("structured output: the matcher failed: %s", m.get_error())


def state_of(params: SamplingParams, hist: RequestHistory, vocab_size: int) -> GrammarState:
    """The request's grammar state, built on first use and caught up with its output."""
    assert params.structured is not None
    if hist.grammar is None:
        model = _model_for(vocab_size)
        hist.grammar = GrammarState(_new_matcher(model, params.structured), model.eos_token_ids)
    state: GrammarState = hist.grammar
    state.advance(hist.output_ids)
    return state


_executor: Any = None


def _fill(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """Allowed-token bitmask [len(matchers), ceil(vocab / 32)] int32 on the CPU: bit t of
    row i is set when matchers[i] allows token t next."""
    import llguidance

    global _executor
    bitmask = torch.zeros((len(matchers), (vocab_size + 31) // 32), dtype=torch.int32)
    row_bytes = bitmask.shape[1] * 4
    if len(matchers) < PARALLEL_FILL_ROWS or (os.cpu_count() or 1) < PARALLEL_FILL_CPUS:
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bitmask.data_ptr() + i * row_bytes, row_bytes)
    else:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                          bitmask.data_ptr(), row_bytes, len(matchers))
    return bitmask


def disallowed_mask(bitmask: torch.Tensor, vocab_size: int,
                    device: torch.device) -> torch.Tensor:
    """bitmask: [rows, words] int32 (CPU) -> [rows, vocab_size] bool on `device`, True
    where the token is NOT allowed. On the CPU one numpy unpack of the inverted words (no
    other pass over the rows); elsewhere the words travel (vocab / 8 bytes a row) and are
    unpacked there."""
    if device.type == "cpu":
        inverted = np.invert(bitmask.numpy()).view(np.uint8)
        bits = np.unpackbits(inverted, axis=1, count=vocab_size, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))
    return ~unpack_words(bitmask.to(device, non_blocking=True), vocab_size)


def unpack_words(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """words: [rows, ceil(vocab / 32)] int32 -> allowed [rows, vocab_size] bool, bit t of
    word w being token 32 w + t (torch ops: runs where `words` is)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[:, :, None] >> shifts) & 1  # [rows, words, 32]
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def constrain_(work: torch.Tensor, params: list[SamplingParams],
               hists: list[RequestHistory]) -> None:
    """In place: the rows of structured requests keep only the tokens their grammar allows
    next (the others -> -inf). work: [rows, vocab] float, finite (make_finite_ ran: a token
    the grammar allows but min_tokens masked is the lowest float, so a row never ends up
    all -inf; the grammar wins)."""
    rows = [i for i, p in enumerate(params) if p.structured is not None]
    if not rows:
        return
    vocab = work.shape[-1]
    states = [state_of(params[i], hists[i], vocab) for i in rows]
    banned = disallowed_mask(_fill([s.matcher for s in states], vocab), vocab, work.device)
    if len(rows) == work.shape[0]:
        work.masked_fill_(banned, NEG_INF)
        return
    at = torch.tensor(rows, dtype=torch.long, device=work.device)
    work[at] = work[at].masked_fill_(banned, NEG_INF)


def greedy_constrained_(logits: torch.Tensor, params: list[SamplingParams],
                        hists: list[RequestHistory], chosen: torch.Tensor) -> set[int]:
    """Greedy rows whose only change to the logits is a grammar, on the CPU: the best allowed
    token of each row's GREEDY_CANDIDATES most likely, written into chosen [rows]; returns
    the rows resolved so. A row goes the masked way (`constrain_`) when none of its
    candidates is allowed, one is not finite, or the pick ties with the last candidate (a
    token beyond them may tie too: argmax takes the lowest id of equal maxima, and so must
    this). logits: [rows, vocab] float32, raw. On other devices this resolves nothing: the
    masked way costs a few kernels there, and this would cost a host sync."""
    vocab = logits.shape[-1]
    if logits.device.type != "cpu" or vocab <= GREEDY_CANDIDATES:
        return set()
    rows = [i for i, (p, h) in enumerate(zip(params, hists, strict=True))
            if p.structured is not None and p.is_greedy and not p.has_penalties
            and not p.logit_bias and not suppresses_stop(p, h)]
    if not rows:
        return set()
    words = _fill([state_of(params[i], hists[i], vocab).matcher for i in rows], vocab)
    at = torch.tensor(rows, dtype=torch.long)
    vals_t, ids_t = torch.topk(logits[at], GREEDY_CANDIDATES, dim=-1)  # [n, k], descending
    vals, ids = vals_t.numpy(), ids_t.numpy()
    w = words.numpy().view(np.uint32)
    allowed = (w[np.arange(len(rows))[:, None], ids >> 5] >> (ids & 31).astype(np.uint32)) & 1
    picked: set[int] = set()
    for j, row in enumerate(rows):
        ok = np.flatnonzero(allowed[j])
        if ok.size == 0 or not np.isfinite(vals[j]).all():
            continue
        best = vals[j, ok[0]]
        if best == vals[j, -1]:
            continue
        chosen[row] = int(ids[j, ok[vals[j, ok] == best]].min())
        picked.add(row)
    return picked
