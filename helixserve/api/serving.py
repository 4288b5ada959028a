"""Completions and chat completions over the coordinator: prompts in, choices and chunks out.

One HTTP request becomes one coordinator request per choice (prompt x n). Their token
events are merged into one stream; each event updates its choice (text, token ids,
logprobs, finish reason) and the metrics. Non-streaming requests collect the stream into one
response; streaming ones turn each event into an SSE chunk. Usage counts are the token ids
the tokenizer produced for the prompt and the tokens the coordinator emitted, so they are
exact.

Errors the coordinator raises before the first token (no route, full queue, bad input)
become HTTP errors, because a streaming response waits for its first event before it
sends its headers; a choice that fails mid-stream ends the stream with an SSE error event.
When the client goes away, the coordinator generators are closed, which frees the KV cache
along their routes.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from helixserve.api.errors import APIError
from helixserve.api.metrics import ServingMetrics
from helixserve.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from helixserve.api.tools import ToolPlan, chat_template_inputs, plan_tools, template_text
from helixserve.errors import UserError
from helixserve.request import SamplingParams, StructuredOutput
from helixserve.runtime import (
    GenerationRequest,
    NoRouteError,
    QueueFullError,
    RequestFailedError,
    TokenEvent,
)
from helixserve.runtime.stats import CoordinatorStats
from helixserve.structured import grammar_of


class CoordinatorLike(Protocol):
    """What the API needs of `helixserve.runtime.Coordinator`."""

    tokenizer: Any
    model_name: str
    max_model_len: int

    def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]: ...

    # optional: `max_new_tokens(prompt_tokens) -> int | None`, the most tokens a route's KV
    # cache leaves room for; used to default an unset max_tokens

    def stats(self) -> CoordinatorStats: ...


class ServerShuttingDown(Exception):
    """The server is stopping (Ctrl-C / SIGTERM): streams end now instead of being cut."""


def map_error(exc: BaseException) -> APIError:
    """A coordinator exception as the HTTP error the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ServerShuttingDown):
        return APIError(503, "server shutting down", code="server_shutting_down")
    if isinstance(exc, NoRouteError):
        retry = getattr(exc, "retry_after_s", None)
        return APIError(503, f"no route covers the model: {exc}", code="no_route",
                        headers=None if retry is None else {"Retry-After": str(retry)})
    if isinstance(exc, QueueFullError):
        return APIError(503, f"server busy, queue full: {exc}", code="queue_full")
    if isinstance(exc, RequestFailedError):
        # a worker failed the request in a way re-routing cannot fix: a server error
        return APIError(500, str(exc), code="request_failed")
    if isinstance(exc, UserError):
        return APIError(400, str(exc), code="invalid_parameter")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


async def _aclose(gen: AsyncIterator[Any]) -> None:
    """Close an async generator now (runs its cleanup: the coordinator frees KV)."""
    close = getattr(gen, "aclose", None)
    if close is not None:
        await close()


def _finite(logprob: float | None) -> float | None:
    # JSON has no -inf; vLLM reports impossible tokens as -9999.0
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) else -9999.0


@dataclass
class Choice:
    """One generated sequence: its request to the coordinator and what came back."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    #: prompt as text, for `echo`
    prompt_text: str
    request: GenerationRequest
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    #: prompt tokens 1.. scored by the engine (PromptLogprob), when echo asked for logprobs
    prompt_logprobs: list[Any] | None = None
    finish_reason: str | None = None
    start_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    last_token_s: float | None = None
    #: seconds waiting for a route before the prefill began (TokenEvent.queue_s)
    queue_s: float | None = None
    #: prompt tokens taken from the prefix cache (TokenEvent.cached_tokens)
    cached_tokens: int = 0


@dataclass
class Batch:
    """All choices of one HTTP request."""

    request_id: str
    created: int
    choices: list[Choice]
    #: token ids of each distinct prompt (usage counts each prompt once, as OpenAI does)
    prompts: list[list[int]]

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        # per distinct prompt, as prompt_tokens: the most any of its choices took from cache
        cached: dict[int, int] = {}
        for c in self.choices:
            cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.cached_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }


_T = TypeVar("_T")


class Serving:
    """Builds coordinator requests from API bodies and runs them.

    Tokenizing and detokenizing whole prompts (`off_loop`) run on one thread of their own,
    never on the event loop: a request with the largest allowed prompts must not stall every
    stream and /health. One thread, so the tokenizer is never used by two of them at once and
    one request's prompts cannot take more than one core."""

    def __init__(
        self, coordinator: CoordinatorLike, served_model_name: str, metrics: ServingMetrics
    ) -> None:
        self.coord = coordinator
        self.served_model_name = served_model_name
        self.metrics = metrics
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}
        self._seq = 0
        self._max_token_chars: int | None = None
        #: set when the server starts shutting down: running requests end at their next token
        self.draining = False
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        #: the family tool calls are parsed as (`--tool-call-parser`; auto = by chat template)
        self.tool_call_parser = "auto"

    async def off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` on the tokenizing thread (class doc); its APIError reaches the caller."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    # ---- tokenization -------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.coord.tokenizer

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes, for chat logprobs' `bytes`: a token holding part of a UTF-8
        character decodes to U+FFFD, but its bytes let a client rebuild the text (as
        OpenAI's do). Byte-level BPE and SentencePiece byte-fallback tokens give their raw
        bytes; any other token the UTF-8 of its text."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            text = self.token_text(token_id)
            raw = list(text.encode())
            if "\ufffd" in text:
                raw = _raw_token_bytes(self.tokenizer, token_id) or raw
            self._token_bytes[token_id] = raw
        return raw

    @property
    def max_token_chars(self) -> int:
        """Most characters one token can stand for (the longest vocabulary entry; byte-level
        entries hold one character per byte). A text of C characters is at least
        C / max_token_chars tokens, which bounds its length before tokenizing it."""
        if self._max_token_chars is None:
            vocab: dict[str, int] = getattr(self.tokenizer, "get_vocab", dict)()
            self._max_token_chars = max((len(t) for t in vocab), default=0) or 64
        return self._max_token_chars

    def encode_text(self, text: str, add_special_tokens: bool = True,
                    param: str = "prompt") -> list[int]:
        # A megabyte of text would keep the tokenizing thread (class doc) busy for seconds
        # and delay every other request's prompt: a text that cannot fit the context is
        # refused before it is read.
        limit = self.coord.max_model_len
        if len(text) > limit * self.max_token_chars:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{param} has {len(text):,} characters, more than {limit} tokens of at most "
                f"{self.max_token_chars} characters each can hold. Please reduce the length "
                "of the prompt.",
                param=param,
                code="context_length_exceeded",
            )
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template", param="messages")
        # tools only to a template that renders them (helixserve/api/tools.py)
        extra = {} if tools is None else {"tools": tools}
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                    **extra
                )
            )
        except Exception as exc:  # jinja errors from the template (e.g. role order)
            raise APIError(
                400, f"messages: chat template failed: {exc}", param="messages"
            ) from None

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        # the rendered template already holds the special tokens (BOS, role markers)
        text = self.render_chat(messages, add_generation_prompt)
        return self.encode_text(text, add_special_tokens=False, param="messages")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; served: '{self.served_model_name}'",
                param="model",
                code="model_not_found",
            )

    # ---- request building -----------------------------------------------------------------

    def _max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        limit = self.coord.max_model_len
        if prompt_len >= limit or (requested is not None and prompt_len + requested > limit):
            asked = prompt_len + (requested or 0)
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {asked} tokens ({prompt_len} in the {param}, {requested or 0} in "
                "the completion). Please reduce the length of the prompt or completion.",
                param=param,
                code="context_length_exceeded",
            )
        if requested is not None:
            return requested
        # Unset max_tokens: up to the context, but no more than a route's KV cache can hold,
        # so a request that leaves it out is served, not refused for KV it would never use
        # (vLLM instead refuses to start when the KV cannot hold one max_model_len sequence).
        default = limit - prompt_len
        room = getattr(self.coord, "max_new_tokens", None)
        fits = room(prompt_len) if room is not None else None
        if fits is not None and fits < default:
            if fits < 1:
                raise APIError(
                    400,
                    f"{param}: {prompt_len} tokens do not fit in the KV cache of any route "
                    f"with room for one generated token",
                    param=param,
                    code="context_length_exceeded",
                )
            default = fits
        return default

    def structured(self, body: SamplingFields) -> StructuredOutput | None:
        """The request's structured output, its grammar compiled and checked (an APIError
        400 naming the field when the schema, regex or grammar is bad). Compiling a large
        schema takes milliseconds: `completion_prompts` and `chat_prompt` call this on the
        tokenizing thread first, and `build_batch`'s call on the event loop then finds the
        grammar in grammar_of's cache."""
        asked = body.structured_output()
        if asked is None:
            return None
        so, param = asked
        try:
            grammar_of(so, field=param)
        except UserError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_parameter") from None
        return so

    def _sampling(
        self,
        body: SamplingFields,
        logprobs: int | None,
        seed: int | None,
        prompt_logprobs: int | None = None,
        structured: StructuredOutput | None = None,
    ) -> Any:
        params = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            min_p=0.0 if body.min_p is None else body.min_p,
            seed=seed,
            repetition_penalty=body.repetition_penalty or 1.0,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=body.bias_pairs(),
            structured=structured,
        )
        vocab = len(self.tokenizer)
        for token_id, _ in params.logit_bias:
            if token_id >= vocab:
                raise APIError(400, f"logit_bias: token id {token_id} out of range [0, {vocab})",
                               param="logit_bias", code="invalid_parameter")
        return params  # checked with its request (`GenerationRequest.validate`, build_batch)

    def _next_internal_id(self, request_id: str, index: int) -> str:
        # client request ids may repeat; the coordinator's must not
        self._seq += 1
        return f"{request_id}-{index}-{self._seq}"

    def build_batch(
        self,
        request_id: str,
        body: SamplingFields,
        prompts: list[tuple[list[int], str]],
        max_tokens: int | None,
        logprobs: int | None,
        param: str,
        prompt_logprobs: int | None = None,
    ) -> Batch:
        """`prompt_logprobs`: also score each prompt with this many top logprobs (echo)."""
        vocab = len(self.tokenizer)
        bad = [t for t in body.stop_token_ids or () if t >= vocab]
        if bad:
            # the last hop's sampler indexes the logits with them (min_tokens): an id past
            # the vocabulary is the client's error, a 400, never a failed step
            raise APIError(400, f"stop_token_ids: token id {bad[0]} out of range [0, {vocab})",
                           param="stop_token_ids", code="invalid_parameter")
        structured = self.structured(body)
        choices: list[Choice] = []
        for p_index, (ids, text) in enumerate(prompts):
            budget = self._max_tokens(len(ids), max_tokens, param)
            if body.min_tokens > budget:
                raise APIError(
                    400,
                    f"min_tokens: {body.min_tokens} is more than max_tokens ({budget})",
                    param="min_tokens",
                )
            for k in range(body.n):
                index = p_index * body.n + k
                # the same seed for every choice would give n identical choices
                seed = None if body.seed is None else (body.seed + k) % 2**63
                req = GenerationRequest(
                    request_id=self._next_internal_id(request_id, index),
                    prompt_token_ids=list(ids),
                    sampling=self._sampling(body, logprobs, seed, prompt_logprobs,
                                            structured),
                    max_tokens=budget,
                    min_tokens=body.min_tokens,
                    stop=body.stop_list(),
                    stop_token_ids=list(body.stop_token_ids or []),
                    ignore_eos=body.ignore_eos,
                )
                # the one check of the request (the coordinator trusts it): the context and
                # KV room are `_max_tokens`' above, worded as OpenAI's
                req.validate(self.coord.max_model_len)
                choices.append(Choice(index, p_index, list(ids), text, req))
        return Batch(request_id, int(time.time()), choices, [list(ids) for ids, _ in prompts])

    def completion_prompts(self, body: CompletionRequest) -> list[tuple[list[int], str]]:
        self.structured(body)  # compiled here, off the event loop (`structured`)
        raw = body.prompt
        items: list[str | list[int]]
        if isinstance(raw, str):
            items = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [list(raw)]  # type: ignore[arg-type]
        else:
            items = list(raw)  # type: ignore[arg-type]
        vocab = len(self.tokenizer)
        out = []
        for item in items:
            if isinstance(item, str):
                out.append((self.encode_text(item), item))
                continue
            bad = [t for t in item if not 0 <= t < vocab]
            if bad:
                raise APIError(
                    400, f"prompt: token id {bad[0]} out of range [0, {vocab})", param="prompt"
                )
            out.append((list(item), self.tokenizer.decode(item)))
        return out

    def chat_prompt(self, body: ChatCompletionRequest) -> list[tuple[list[int], str]]:
        self.structured(body)  # compiled here, off the event loop (`structured`)
        self.tool_plan(body)  # its grammar compiled here, off the event loop
        messages, tools = chat_template_inputs(body, template_text(self.tokenizer))
        text = self.render_chat(messages, body.add_generation_prompt, tools)
        return [(self.encode_text(text, add_special_tokens=False, param="messages"), text)]

    def tool_plan(self, body: ChatCompletionRequest) -> ToolPlan | None:
        """How the request's tools are offered, enforced and parsed (None: not offered). A
        required or named choice's grammar is compiled here (cached by grammar_of), so a
        parameters schema the grammar cannot take is a 400 naming it, before any work."""
        plan = plan_tools(body, template_text(self.tokenizer), self.tool_call_parser)
        if plan is not None and plan.structured is not None:
            try:
                grammar_of(plan.structured, field=plan.structured_param)
            except UserError as exc:
                raise APIError(400, str(exc), param=plan.structured_param,
                               code="invalid_parameter") from None
        return plan

    # ---- running --------------------------------------------------------------------------

    async def _raw_events(
        self, choices: list[Choice]
    ) -> AsyncGenerator[tuple[Choice, TokenEvent], None]:
        """Events of all choices, merged in arrival order. Closing this closes every
        coordinator generator (which frees their KV)."""
        if len(choices) == 1:
            c = choices[0]
            gen = self.coord.generate(c.request)
            try:
                async for ev in gen:
                    yield c, ev
            finally:
                await _aclose(gen)
            return

        queue: asyncio.Queue[tuple[Choice, TokenEvent | None, BaseException | None]] = (
            asyncio.Queue()
        )

        async def pump(c: Choice) -> None:
            gen = self.coord.generate(c.request)
            try:
                async for ev in gen:
                    await queue.put((c, ev, None))
                await queue.put((c, None, None))
            except Exception as exc:
                await queue.put((c, None, exc))
            finally:
                await _aclose(gen)

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            remaining = len(choices)
            while remaining:
                c, item, err = await queue.get()
                if err is not None:
                    raise err
                if item is None:
                    remaining -= 1
                    continue
                yield c, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def events(self, batch: Batch) -> AsyncGenerator[tuple[Choice, TokenEvent], None]:
        """Merged events, each already applied to its choice and to the metrics."""
        for ids in batch.prompts:
            self.metrics.prompt_tokens.inc(len(ids))
        raw = self._raw_events(batch.choices)
        try:
            async for c, ev in raw:
                now = time.perf_counter()
                if ev.token_id is not None and ev.token_id >= 0:
                    if c.first_token_s is None:
                        c.first_token_s = now
                        c.queue_s = getattr(ev, "queue_s", None)
                        c.cached_tokens = getattr(ev, "cached_tokens", None) or 0
                        self.metrics.ttft.observe(now - c.start_s)
                    elif c.last_token_s is not None:
                        self.metrics.itl.observe(now - c.last_token_s)
                    c.last_token_s = now
                    c.token_ids.append(ev.token_id)
                    c.logprobs.append(_finite(ev.logprob))
                    c.top_logprobs.append(list(ev.top_logprobs or []))
                    self.metrics.generation_tokens.inc()
                if ev.prompt_logprobs is not None:
                    c.prompt_logprobs = list(ev.prompt_logprobs)
                c.text += ev.text or ""
                if ev.finish_reason is not None:
                    c.finish_reason = ev.finish_reason
                    self._observe_finished(c, ev.finish_reason)
                yield c, ev
                if self.draining and any(x.finish_reason is None for x in batch.choices):
                    raise ServerShuttingDown()
        finally:
            await raw.aclose()
            for c in batch.choices:
                if c.finish_reason is None:
                    self._observe_finished(c, "abort")

    def _observe_finished(self, c: Choice, reason: str) -> None:
        self.metrics.observe_finished(
            reason,
            prompt_tokens=len(c.prompt_ids),
            generated_tokens=len(c.token_ids),
            e2e_s=time.perf_counter() - c.start_s,
            ttft_s=None if c.first_token_s is None else c.first_token_s - c.start_s,
            queue_s=c.queue_s,
        )

    async def collect(self, batch: Batch) -> None:
        """Run every choice to its end (non-streaming)."""
        stream = self.events(batch)
        try:
            async for _ in stream:
                pass
        except Exception as exc:
            raise map_error(exc) from exc
        finally:
            await stream.aclose()

    # ---- logprobs formatting --------------------------------------------------------------

    def completion_logprobs(
        self, c: Choice, start: int, end: int, echo_prompt: bool, text_offset: int
    ) -> dict[str, Any]:
        """OpenAI legacy logprobs of tokens [start, end) of choice c, plus the prompt's tokens
        when echoing: the first has a null logprob (nothing before it), the others the engine's
        scores given the tokens before them (null only if the prompt was not scored)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if echo_prompt:
            scored = c.prompt_logprobs or []  # scored[k - 1] is prompt token k's
            for k, tid in enumerate(c.prompt_ids):
                piece = self.token_text(tid)
                tokens.append(piece)
                entry = scored[k - 1] if 0 < k <= len(scored) else None
                if entry is None:
                    token_logprobs.append(None)
                    tops.append(None)
                else:
                    token_logprobs.append(_finite(entry.logprob))
                    tops.append(self._with_token(piece, entry.logprob, entry.top_logprobs))
                offsets.append(text_offset)
                text_offset += len(piece)
        for i in range(start, end):
            piece = self.token_text(c.token_ids[i])
            tokens.append(piece)
            token_logprobs.append(c.logprobs[i])
            tops.append(self._with_token(piece, c.logprobs[i], c.top_logprobs[i] or []))
            offsets.append(text_offset)
            text_offset += len(piece)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _with_token(self, piece: str, logprob: float | None,
                    top: list[tuple[int, float]]) -> dict[str, float]:
        """Legacy `top_logprobs` of one position: the top N, plus the token itself when it
        is not among them (as vLLM does; so `logprobs=0` still names the token)."""
        out = {self.token_text(t): _finite(lp) or 0.0 for t, lp in top}
        if piece not in out and logprob is not None:
            out[piece] = _finite(logprob) or 0.0
        return out

    def chat_logprobs(self, c: Choice, start: int, end: int) -> dict[str, Any]:
        content = []
        for i in range(start, end):
            piece = self.token_text(c.token_ids[i])
            content.append(
                {
                    "token": piece,
                    "logprob": c.logprobs[i],
                    "bytes": self.token_bytes(c.token_ids[i]),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": _finite(lp),
                            "bytes": self.token_bytes(t),
                        }
                        for t, lp in c.top_logprobs[i]
                    ],
                }
            )
        return {"content": content}


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's `bytes_to_unicode`),
    inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_LEVEL = _byte_level_alphabet()


def _raw_token_bytes(tokenizer: Any, token_id: int) -> list[int] | None:
    """Raw bytes of a token from its vocabulary string; None when the form is unknown."""
    try:
        piece = tokenizer.convert_ids_to_tokens(token_id)
    except Exception:  # noqa: BLE001 - a tokenizer without the method: keep the text's bytes
        return None
    if not isinstance(piece, str) or not piece:
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return [int(piece[3:5], 16)]  # SentencePiece byte fallback
        except ValueError:
            return None
    if all(ch in _BYTE_LEVEL for ch in piece):
        return [_BYTE_LEVEL[ch] for ch in piece]
    return None
