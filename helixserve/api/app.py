"""The OpenAI-compatible HTTP app: `create_app(coordinator, served_model_name, api_key)`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models,
GET /v1/models/{id}, GET and HEAD /health, GET /ready, GET /metrics, POST /tokenize,
POST /detokenize, GET /version.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer and
break client-disconnect cancellation of streams) does two things for every request: takes
`X-Request-Id` (or makes one) and echoes it on the response, and checks the API key on
/v1/*, /tokenize and /detokenize. /health, /ready, /metrics and /version stay open for probes
and Prometheus, as in vLLM. Readiness is /ready (the process serves HTTP: requests are
accepted, and wait or get a 503 with Retry-After during an outage); /health (503 while a layer
has no live worker) is for monitoring.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from helixserve import __version__
from helixserve.api.errors import APIError, install_error_handlers
from helixserve.api.metrics import ServingMetrics
from helixserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from helixserve.api.serving import Batch, Choice, CoordinatorLike, Serving, map_error
from helixserve.api.tools import ToolPlan
from helixserve.api.tools import enforce as enforce_tool_choice
from helixserve.runtime import TokenEvent
from helixserve.runtime.stats import CoordinatorStats

T = TypeVar("T")
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
#: status nginx uses for "client closed the request"; the client never sees it
_CLIENT_CLOSED = 499

Events = AsyncGenerator[tuple[Choice, TokenEvent], None]


#: largest request body read (a 128k-token prompt is well under 1 MiB of text)
MAX_BODY_BYTES = 32 * 2**20


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than {limit:,} bytes",
                    code="request_too_large")


class RequestContextMiddleware:
    """X-Request-Id in and out, Bearer API-key auth, and a cap on the body size (413 past
    `max_body_bytes`, by Content-Length or while reading a chunked body), as plain ASGI."""

    def __init__(self, app: Any, api_key: str | None,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        given = headers.get(b"x-request-id", b"").decode("latin-1").strip()[:128]
        request_id = given or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        scope["state"]["request_id_given"] = bool(given)

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode("latin-1")),
                ]
            await send(message)

        if self.api_key is not None and scope["path"].startswith(_PROTECTED_PREFIXES):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                err = APIError(
                    401,
                    "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                )
                await err.response()(scope, receive, send_with_id)
                return
        limit = self.max_body_bytes
        length = headers.get(b"content-length", b"").decode("latin-1").strip()
        if length.isdigit() and int(length) > limit:
            await _too_large(limit).response()(scope, receive, send_with_id)
            return
        if scope["method"] in ("POST", "PUT", "PATCH") and not length.isdigit():
            # chunked: read it here, counting, and hand the app the same messages
            messages = []
            received = 0
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request":
                    break
                received += len(message.get("body", b""))
                if received > limit:
                    await _too_large(limit).response()(scope, receive, send_with_id)
                    return
                if not message.get("more_body", False):
                    break
            replay = iter(messages)

            async def replaying_receive() -> Any:
                return next(replay, None) or await receive()

            await self.app(scope, replaying_receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends, so a client disconnect
    closes the coordinator generators (and frees KV) at once, not at garbage collection."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class _ClientGone(Exception):
    pass


async def _until_disconnect(request: Request) -> None:
    # the body is already read, so the next ASGI message is the disconnect
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _with_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    # cancelling the task throws CancelledError into the coordinator's generators,
    # whose cleanup releases the request's KV along its route
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise _ClientGone()


def health_detail(stats: CoordinatorStats) -> dict[str, Any]:
    """/health's body: per node what an operator checks first, and the recovery state."""
    nodes = {}
    for name, n in sorted(stats.nodes.items()):
        nodes[name] = {"alive": n.alive, "start_layer": n.start_layer, "end_layer": n.end_layer,
                       "in_placement": n.in_placement, "queue_len": n.queue_len,
                       "active_requests": n.active_requests,
                       **(dataclasses.asdict(n.process) if n.process is not None else {}),
                       "last_down_reason": n.last_down_reason}
    return {"nodes": nodes, "recovery": stats.recovery, "down_events": stats.down_events}


def uncovered_layers(stats: CoordinatorStats) -> str:
    """Layers no live node holds, as 'a-b, c' ('' when all are covered or stats say nothing).
    The model's layer count is taken as the largest end_layer of any node, live or not."""
    from helixserve.planner.placement import layer_gaps

    nodes = list(stats.nodes.values())
    num_layers = max((n.end_layer for n in nodes), default=0)
    gaps = layer_gaps(((n.start_layer, n.end_layer) for n in nodes if n.alive), num_layers)
    return ", ".join(str(a) if b == a + 1 else f"{a}-{b - 1}" for a, b in gaps)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _usage_chunk(batch: Any, model: str, obj: str) -> str:
    """The final SSE chunk of `stream_options.include_usage`: no choices, the batch's usage."""
    return _sse({"id": batch.request_id, "object": obj, "created": batch.created,
                 "model": model, "choices": [], "usage": batch.usage()})


def create_app(
    coordinator: CoordinatorLike,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    tool_call_parser: str = "auto",
) -> FastAPI:
    """The API over a running coordinator. `api_key` None = no auth. `tool_call_parser`:
    how tool calls are read from the output (helixserve/api/tools.py; auto = by template)."""
    name = served_model_name or coordinator.model_name
    metrics = ServingMetrics(name, coordinator.stats)
    serving = Serving(coordinator, name, metrics)
    serving.tool_call_parser = tool_call_parser
    app = FastAPI(title="helixserve", version=__version__, docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, api_key=api_key,
                       max_body_bytes=max_body_bytes)

    def response_id(request: Request, prefix: str) -> str:
        rid = str(request.state.request_id)
        return rid if request.state.request_id_given else f"{prefix}-{rid}"

    async def start_stream(
        request: Request,
        batch: Batch,
        render: Callable[[tuple[Choice, TokenEvent] | None, Events], AsyncGenerator[str, None]],
    ) -> Response:
        # Wait for the first event before sending headers, so a request that cannot start
        # (no route, queue full) gets its HTTP status instead of a 200 with an error inside.
        events = serving.events(batch)
        try:
            first: tuple[Choice, TokenEvent] | None = await _with_disconnect(request, anext(events))
        except StopAsyncIteration:
            first = None
        except _ClientGone:
            return Response(status_code=_CLIENT_CLOSED)
        except Exception as exc:
            await events.aclose()
            raise map_error(exc) from exc
        return _ClosingStreamingResponse(render(first, events), media_type="text/event-stream")

    async def run_to_end(request: Request, batch: Batch) -> bool:
        try:
            await _with_disconnect(request, serving.collect(batch))
        except _ClientGone:
            return False
        return True

    # ---- completions ----------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving.check_model(body.model)
        rid = response_id(request, "cmpl")
        prompts = await serving.off_loop(serving.completion_prompts, body)
        batch = serving.build_batch(
            rid,
            body,
            prompts,
            body.max_tokens,
            body.logprobs,
            "prompt",
            prompt_logprobs=body.logprobs if body.echo else None,
        )
        if body.stream:
            return await start_stream(
                request, batch, lambda first, ev: completion_sse(batch, body, first, ev)
            )
        if not await run_to_end(request, batch):
            return Response(status_code=_CLIENT_CLOSED)
        choices = []
        for c in batch.choices:
            prefix = c.prompt_text if body.echo else ""
            choices.append(
                {
                    "index": c.index,
                    "text": prefix + c.text,
                    "logprobs": None
                    if body.logprobs is None
                    else serving.completion_logprobs(c, 0, len(c.token_ids), body.echo, 0),
                    "finish_reason": c.finish_reason,
                    "stop_reason": None,
                }
            )
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": batch.created,
                "model": name,
                "choices": choices,
                "usage": batch.usage(),
                "system_fingerprint": None,
            }
        )

    async def completion_sse(
        batch: Batch,
        body: CompletionRequest,
        first: tuple[Choice, TokenEvent] | None,
        events: Events,
    ) -> AsyncGenerator[str, None]:
        include_usage = body.include_usage()
        sent_tokens = {c.index: 0 for c in batch.choices}
        sent_chars = {c.index: 0 for c in batch.choices}

        def chunk(c: Choice, ev: TokenEvent) -> dict[str, Any]:
            echo = body.echo and sent_chars[c.index] == 0 and sent_tokens[c.index] == 0
            text = (c.prompt_text if echo else "") + (ev.text or "")
            logprobs = None
            if body.logprobs is not None:
                logprobs = serving.completion_logprobs(
                    c, sent_tokens[c.index], len(c.token_ids), echo, sent_chars[c.index]
                )
            sent_tokens[c.index] = len(c.token_ids)
            sent_chars[c.index] += len(text)
            out: dict[str, Any] = {
                "id": batch.request_id,
                "object": "text_completion",
                "created": batch.created,
                "model": name,
                "choices": [
                    {
                        "index": c.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": ev.finish_reason,
                        "stop_reason": None,
                    }
                ],
            }
            if include_usage:
                out["usage"] = None
            return out

        try:
            if first is not None:
                yield _sse(chunk(*first))
                async for c, ev in events:
                    yield _sse(chunk(c, ev))
        except Exception as exc:
            yield _sse(map_error(exc).body())
        if include_usage:
            yield _usage_chunk(batch, name, "text_completion")
        yield "data: [DONE]\n\n"

    # ---- chat completions -----------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        serving.check_model(body.model)
        rid = response_id(request, "chatcmpl")
        prompts = await serving.off_loop(serving.chat_prompt, body)
        batch = serving.build_batch(
            rid, body, prompts, body.effective_max_tokens(), body.num_logprobs(), "messages"
        )
        tools = serving.tool_plan(body)
        enforce_tool_choice(tools, batch)
        if body.stream:
            return await start_stream(
                request, batch, lambda first, ev: chat_sse(batch, body, first, ev, tools)
            )
        if not await run_to_end(request, batch):
            return Response(status_code=_CLIENT_CLOSED)
        choices = []
        for c in batch.choices:
            message, finish = ({"role": "assistant", "content": c.text}, c.finish_reason)
            if tools is not None:
                message, finish = tools.message(c.text, c.finish_reason)
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": serving.chat_logprobs(c, 0, len(c.token_ids))
                if body.logprobs
                else None,
                "finish_reason": finish,
                "stop_reason": None,
            })
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": batch.created,
                "model": name,
                "choices": choices,
                "usage": batch.usage(),
                "system_fingerprint": None,
            }
        )

    async def chat_sse(
        batch: Batch,
        body: ChatCompletionRequest,
        first: tuple[Choice, TokenEvent] | None,
        events: Events,
        tools: ToolPlan | None = None,
    ) -> AsyncGenerator[str, None]:
        include_usage = body.include_usage()
        sent_tokens = {c.index: 0 for c in batch.choices}
        tool_streams = {c.index: tools.stream() for c in batch.choices} if tools else {}

        def envelope(choice: dict[str, Any]) -> dict[str, Any]:
            out: dict[str, Any] = {
                "id": batch.request_id,
                "object": "chat.completion.chunk",
                "created": batch.created,
                "model": name,
                "choices": [choice],
            }
            if include_usage:
                out["usage"] = None
            return out

        def chunk(c: Choice, ev: TokenEvent) -> dict[str, Any] | None:
            delta: dict[str, Any] = {"content": ev.text} if ev.text else {}
            finish = ev.finish_reason
            if tools is not None:  # content and tool_calls deltas (helixserve/api/tools.py)
                delta, finish = tool_streams[c.index].delta(ev.text, ev.finish_reason)
            if not delta and finish is None:
                return None  # nothing to show yet (e.g. half a UTF-8 character)
            logprobs = None
            if body.logprobs:
                logprobs = serving.chat_logprobs(c, sent_tokens[c.index], len(c.token_ids))
            sent_tokens[c.index] = len(c.token_ids)
            return envelope(
                {
                    "index": c.index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            )

        # the first chunk of every choice carries the assistant role, as OpenAI's does
        for c in batch.choices:
            yield _sse(
                envelope(
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            )
        try:
            if first is not None:
                data = chunk(*first)
                if data is not None:
                    yield _sse(data)
                async for c, ev in events:
                    data = chunk(c, ev)
                    if data is not None:
                        yield _sse(data)
        except Exception as exc:
            yield _sse(map_error(exc).body())
        if include_usage:
            yield _usage_chunk(batch, name, "chat.completion.chunk")
        yield "data: [DONE]\n\n"

    # ---- the rest -------------------------------------------------------------------------

    def model_card() -> dict[str, Any]:
        # the workers' engines (torch, vllm, emulated): an emulated cluster says so here
        engines = sorted({n.backend for n in coordinator.stats().nodes.values()} - {""})
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "helixserve",
            "root": coordinator.model_name,
            "max_model_len": coordinator.max_model_len,
            "engines": engines,
            "emulated": "emulated" in engines,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        if body.messages is not None:
            tokens = await serving.off_loop(serving.encode_chat, body.template_messages(),
                                            body.add_generation_prompt)
        else:
            tokens = await serving.off_loop(serving.encode_text, body.prompt or "",
                                            body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": coordinator.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        vocab = len(serving.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: id {bad[0]} out of range [0, {vocab})", param="tokens")
        return {"prompt": await serving.off_loop(serving.tokenizer.decode, body.tokens)}

    # GET and HEAD as two routes: one route with both methods gives both operations the same
    # OpenAPI operationId (FastAPI warns "Duplicate Operation ID"); HEAD stays out of the schema
    @app.head("/health", include_in_schema=False)
    @app.get("/health")
    async def health() -> Response:
        # 503 while the live workers leave a layer uncovered: a readiness probe then takes
        # this replica out of rotation instead of sending it requests it must refuse. The
        # body says why, per node (up, layers, restarts, last failure) and the re-plan state.
        stats = coordinator.stats()
        detail = health_detail(stats)
        uncovered = uncovered_layers(stats)
        if uncovered:
            recovering = (detail.get("recovery") or {}).get("state") in ("planning", "loading")
            err = APIError(
                503,
                f"no route covers the model: layers {uncovered} have no live worker"
                + ("; re-planning onto the live workers" if recovering else ""),
                code="no_route",
                headers={"Retry-After": "5"} if recovering else None,
            )
            return JSONResponse({**err.body(), **detail}, status_code=503,
                                headers=err.headers or None)
        return JSONResponse({"status": "ok", **detail})

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        # The readiness probe: this process takes requests. An outage of workers is not
        # unreadiness (module doc): a request then waits for the re-plan, or gets a clear 503.
        return {"status": "ready"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    return app
