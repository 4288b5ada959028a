"""Conversion between helixserve's Python types and the protobuf messages of proto/helix.proto.

This is the only module that builds or reads `helix_pb2` messages. Tensors travel as raw
row-major bytes with dtype and shape (never pickled); `tensor_from_pb` checks dtype, shape and
byte length against what the receiver expects and raises `WireError` naming the field.
Hidden states in another float dtype than the receiver's are cast (mixed-GPU clusters).
A worker whose expected dtype is a wire name rather than a torch dtype (the emulated engine,
which runs without torch) gets and sends `RawHidden`: the same checked bytes, no tensor.

Emulated activations may travel as a smaller payload (engine/emulated.py, module doc): the
tensor keeps its real dtype and shape, `data` holds fewer whole bytes a token, and only an
emulated receiver accepts it. The bytes left out are charged by the rehearsal's link proxy
(rehearse/links.py), which sees only TLS ciphertext: `declare_unsent` tells it, over a local
datagram socket named by HELIXSERVE_LINK_LEDGER, "link <this node> -> <next hop's address>:
K more bytes", just before the worker writes the batch they belong to.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from helixserve.engine.protocol import RawHidden
from helixserve.errors import UserError
from helixserve.planner.placement import NodeRange
from helixserve.prefix import BLOCK_HASH_BYTES, CacheEvents
from helixserve.request import PromptLogprob, SamplingParams, StructuredOutput
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.spec.model import DTYPE_BYTES
from helixserve.spec.scheduling import DEFAULT_PREFILL_CHUNK_TOKENS

if TYPE_CHECKING:
    # Only the tensor functions need torch, and they import it when called: the coordinator
    # (which moves no tensors) imports this module on a machine without torch.
    import torch

log = logging.getLogger(__name__)

#: gRPC message size limit on every channel and server. Raised deliberately from gRPC's 4 MiB
#: default: a prefill chunk carries hidden: [chunk_tokens, hidden_size]; at 512 tokens of a
#: 8192-wide fp32 model that is 16 MiB. Prefills longer than `prefill_chunk_tokens(...)` are split.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024



def _env_number(name: str, default: float, minimum: float) -> float:
    """The number in environment variable `name` (`default` when unset); a value that is not
    a number >= `minimum` is a UserError naming the variable and the value."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= minimum:
        raise UserError(f"{name}: bad value {raw!r}; need a number >= {minimum:g}")
    return value


#: Seconds between keepalive pings on idle channels (env HELIXSERVE_GRPC_KEEPALIVE_S; tests
#: shrink it to reproduce hours of idling in seconds).
KEEPALIVE_S = _env_number("HELIXSERVE_GRPC_KEEPALIVE_S", 20.0, 0.001)
#: Seconds a keepalive ping waits for its ACK before the connection is declared dead (env
#: HELIXSERVE_GRPC_KEEPALIVE_TIMEOUT_S; the rehearsal scales it by its time scale, as its
#: links). The ACK travels behind all the peer has already written in that direction: its
#: socket buffer (Linux autotunes up to 4 MiB) and its HTTP/2 window (gRPC's BDP probe grows
#: it to several MiB on a long link), ~8 MiB of activations on a busy pipeline link: 0.7 s at
#: 0.1 Gbit/s, but 7 s at 10 Mbit/s. gRPC's own default, 20 s, keeps a live peer on such a
#: slow link alive; a dead one is still found within KEEPALIVE_S + this.
KEEPALIVE_TIMEOUT_S = _env_number("HELIXSERVE_GRPC_KEEPALIVE_TIMEOUT_S", 20.0, 0.001)
#: A fixed HTTP/2 stream window in bytes on the wire, BDP probing off (env
#: HELIXSERVE_GRPC_STREAM_WINDOW_BYTES; unset: gRPC's own, which grows with the link). Only
#: for a rehearsal whose activations cross as a smaller payload (rehearse/links.py): flow
#: control counts bytes on the wire, so there a sender runs ahead by ~256x the real bytes a
#: real link's window would let it, and a PING's ACK queues behind all of it.
STREAM_WINDOW_BYTES = int(_env_number("HELIXSERVE_GRPC_STREAM_WINDOW_BYTES", 0, 0))


def _window_options() -> list[tuple[str, Any]]:
    if STREAM_WINDOW_BYTES <= 0:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES)]


def channel_options(keepalive_s: float = KEEPALIVE_S,
                    timeout_s: float = KEEPALIVE_TIMEOUT_S) -> list[tuple[str, Any]]:
    """Options of every client channel (coordinator -> worker, worker -> next hop)."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # Loopback and LAN links: keep persistent streams alive through idle periods and NATs.
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        *_window_options(),
    ]


def server_options(keepalive_s: float = KEEPALIVE_S,
                   timeout_s: float = KEEPALIVE_TIMEOUT_S) -> list[tuple[str, Any]]:
    """Options of the worker's server, agreeing with `channel_options`' pings: by default a
    gRPC server allows a ping without data only every 5 minutes and sends GOAWAY
    `too_many_pings` after 2 early ones, which killed idle worker-to-worker streams after
    ~1 minute of 20 s pings. The server here accepts pings at half the client's interval,
    with or without calls in flight."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(keepalive_s * 1000 / 2)),
        # the server's own pings to idle clients (a dead coordinator's stream is noticed)
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
        *_window_options(),
    ]


CHANNEL_OPTIONS: list[tuple[str, Any]] = channel_options()
SERVER_OPTIONS: list[tuple[str, Any]] = server_options()

#: the float dtypes on the wire, by name, and their bytes per element
_ITEMSIZE = DTYPE_BYTES

OK = grpc.StatusCode.OK.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]


#: the wire contract this side speaks (InfoReply.wire_version): 2 = continuation items (a decode
#: item after a request's first carries only what changed; see WorkItem in proto/helix.proto);
#: 3 = releases on the coordinator's Work stream (WorkBatch.release_ids) instead of a Release
#: call per request and hop
WIRE_VERSION = 3


#: how the error text of a prefix miss starts (with status FAILED_PRECONDITION)
PREFIX_MISS = "prefix miss"


class WireError(ValueError):
    """An incoming message does not match what the receiver expects (-> INVALID_ARGUMENT)."""


class StaleRouteError(WireError):
    """A continuation item for layers this worker no longer holds (-> UNAVAILABLE: replay)."""


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def prefill_chunk_tokens(hidden_size: int, dtype: torch.dtype | str,
                         max_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS) -> int:
    """Tokens per prefill chunk so one chunk's hidden states stay under half the message limit.
    `dtype`: a torch dtype or its wire name ("bfloat16")."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    if name not in _ITEMSIZE:
        raise WireError(f"dtype: unknown {name!r}; known: {', '.join(_ITEMSIZE)}")
    bytes_per_token = hidden_size * _ITEMSIZE[name]
    return max(1, min(max_tokens, (MAX_MESSAGE_BYTES // 2) // bytes_per_token))


# ---- tensors ----------------------------------------------------------------------------


def _wire_fields(t: torch.Tensor | RawHidden) -> tuple[str, list[int], bytes]:
    """(dtype name, shape, row-major bytes) of hidden states or any tensor."""
    if isinstance(t, RawHidden):
        return t.dtype, list(t.shape), t.data
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # Reinterpret as bytes: works for bf16, which numpy cannot represent.
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return dtype_name(t.dtype), list(t.shape), data


def raw_hidden(t: torch.Tensor | RawHidden) -> RawHidden:
    """Hidden states as their wire bytes (a tensor is copied off its device once)."""
    if isinstance(t, RawHidden):
        return t
    dtype, shape, data = _wire_fields(t)
    return RawHidden(dtype, tuple(shape), data)


def tensor_to_pb(t: torch.Tensor | RawHidden) -> pb.Tensor:
    dtype, shape, data = _wire_fields(t)
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def set_tensor_pb(dst: pb.Tensor, t: torch.Tensor | RawHidden) -> None:
    """Write `t` into `dst` (a field of a message being built) in place: the bytes are copied
    once, into the message (through `tensor_to_pb` and `CopyFrom` they are copied twice more)."""
    dtype, shape, data = _wire_fields(t)
    dst.dtype = dtype
    del dst.shape[:]
    dst.shape.extend(shape)
    dst.data = data


def tensor_from_pb(
    msg: pb.Tensor, where: str, shape: Sequence[int | None], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Decode a tensor, checking dtype (exactly `dtype`, or any known float type when None),
    rank, each fixed dim (None = any) and byte length; the result has the message's dtype."""
    import torch

    # Each read of a bytes field copies it (upb hands out a new bytes object): read it once.
    data = msg.data
    got_shape = _checked_shape(msg, where, shape, dtype, data)
    # bytearray: torch needs a writable buffer, and the engine may work in place.
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, msg.dtype)).view(got_shape)


def _checked_shape(msg: pb.Tensor, where: str, shape: Sequence[int | None],
                   dtype: torch.dtype | str | None, data: bytes | None = None,
                   payload: bool = False) -> list[int]:
    """The message's shape, after checking its dtype, rank, fixed dims and byte length.
    `data`: `msg.data` when the caller has read it already (each read copies the bytes).
    `payload`: also accept an emulated payload (module doc): fewer whole bytes for each of
    shape[0] tokens than a row has, at least one."""
    if msg.dtype not in _ITEMSIZE or (dtype is not None and msg.dtype != dtype_name(dtype)):
        want = dtype_name(dtype) if dtype is not None else " | ".join(_ITEMSIZE)
        raise WireError(f"{where}.dtype: got {msg.dtype!r}, expected {want}")
    got_shape = list(msg.shape)
    if len(got_shape) != len(shape) or any(
        w is not None and g != w for g, w in zip(got_shape, shape, strict=False)
    ):
        pretty = ["*" if w is None else w for w in shape]
        raise WireError(f"{where}.shape: got {got_shape}, expected {pretty}")
    if any(g <= 0 for g in got_shape):
        raise WireError(f"{where}.shape: dims must be positive, got {got_shape}")
    itemsize = _ITEMSIZE[msg.dtype]
    want_bytes = math.prod(got_shape) * itemsize
    got_bytes = len(msg.data if data is None else data)
    if payload and got_bytes < want_bytes and got_bytes >= got_shape[0] \
            and got_bytes % got_shape[0] == 0:
        return got_shape  # an emulated payload: the rest is charged by the link emulation
    if got_bytes != want_bytes:
        raise WireError(
            f"{where}.data: {got_bytes} bytes, expected {want_bytes} "
            f"(shape {got_shape} x {itemsize} bytes of {msg.dtype})"
        )
    return got_shape


def hidden_from_pb(msg: pb.Tensor, where: str, num_tokens: int,
                   expect: ExpectedInput) -> torch.Tensor | RawHidden:
    """Hidden states for this worker: [num_tokens, hidden_size] in its own dtype.

    Workers of one cluster may serve in different dtypes (bfloat16 on A100, float16 on T4,
    float32 on CPU): any float type is accepted and cast, but a cast that overflows is refused
    rather than passing inf along the route. A worker expecting a wire name (the emulated
    engine) gets the checked bytes as RawHidden, in the sender's dtype, without torch.
    """
    if isinstance(expect.dtype, str):
        data = msg.data  # one read: each copies the bytes
        shape = _checked_shape(msg, where, (num_tokens, expect.hidden_size), None, data,
                               payload=True)
        return RawHidden(msg.dtype, tuple(shape), data)
    import torch

    hidden = tensor_from_pb(msg, where, (num_tokens, expect.hidden_size))
    if hidden.dtype != expect.dtype:
        hidden = hidden.to(expect.dtype)
        if not bool(torch.isfinite(hidden).all()):
            raise WireError(
                f"{where}: values overflow {dtype_name(expect.dtype)} (sent as {msg.dtype})"
            )
    return hidden


# ---- emulated payloads: the bytes left out, declared to the link emulation ---------------

#: the environment variable naming the rehearsal's link ledger: an abstract unix datagram
#: socket ("\0" + the name) where its link proxy takes declarations (rehearse/links.py)
LINK_LEDGER_ENV = "HELIXSERVE_LINK_LEDGER"
#: seconds a declaration may wait for room in the proxy's queue before it is counted lost
LEDGER_SEND_TIMEOUT_S = 1.0


def ledger_message(src: str, address: str, num_bytes: int, wire_bytes: int = 0) -> bytes:
    """One declaration: `num_bytes` more on the link from node `src` to `address`; with
    `wire_bytes` > 0, the size on the wire of the message they belong to (a 4th line), so the
    proxy charges them with that message's own bytes (rehearse/links.py)."""
    tail = f"\n{wire_bytes}" if wire_bytes > 0 else ""
    return f"{src}\n{address}\n{num_bytes}{tail}".encode()


class LinkLedger:
    """The sending side of a link ledger: one datagram per declaration. A unix datagram
    socket does not drop: a full queue makes the send wait, up to LEDGER_SEND_TIMEOUT_S,
    after which the bytes are counted in `lost_bytes` and logged (never silently)."""

    def __init__(self, name: str) -> None:
        self.address = "\0" + name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # non-blocking first: a socket with a timeout polls before every send (a syscall
        # more a message); only a full queue waits (`declare`)
        self.sock.setblocking(False)
        self.lost_bytes = 0
        self.lost_declarations = 0

    def declare(self, src: str, address: str, num_bytes: int, wire_bytes: int = 0) -> None:
        message = ledger_message(src, address, num_bytes, wire_bytes)
        try:
            try:
                self.sock.sendto(message, self.address)
            except BlockingIOError:  # the proxy's queue is full: wait for room, up to a bound
                self.sock.settimeout(LEDGER_SEND_TIMEOUT_S)
                try:
                    self.sock.sendto(message, self.address)
                finally:
                    self.sock.setblocking(False)
        except OSError as exc:
            self.lost_bytes += num_bytes
            self.lost_declarations += 1
            if self.lost_declarations & (self.lost_declarations - 1) == 0:  # 1, 2, 4, ...
                log.warning("link ledger %r: %d unsent bytes on %s -> %s not declared (%s); "
                            "%d declarations, %d bytes lost so far", self.address[1:],
                            num_bytes, src, address, exc, self.lost_declarations,
                            self.lost_bytes)


#: this process's ledger: None until the first declaration looks it up, False when there is
#: none (then a smaller payload is charged nowhere, which is logged once)
_ledger: LinkLedger | bool | None = None


#: what gRPC over mutual TLS adds to a serialized message on the wire, as the link proxy
#: counts it (measured through the proxy, tests/integration/rehearse/test_declared_sizes.py):
#: gRPC's length prefix, one HTTP/2 DATA frame header per 16 KiB of the prefixed message, and
#: one TLS 1.3 record (5 bytes of header, 16 of AEAD tag, 1 of inner content type) per 16,284
#: bytes of frames (gRPC's TLS frame protector: 16 KiB less 100 bytes of overhead a record)
_GRPC_PREFIX_BYTES = 5
_HTTP2_FRAME_HEADER_BYTES = 9
_HTTP2_FRAME_PAYLOAD_BYTES = 16384
TLS_RECORD_OVERHEAD_BYTES = 22
_TLS_RECORD_PLAINTEXT_BYTES = 16284


def _wire_bytes(message_bytes: int) -> int:
    """Bytes on the wire of one gRPC message of `message_bytes` (its protobuf `ByteSize()`)
    written alone on a stream over mutual TLS: what the link proxy reads for it. A message
    that flow control splits pays one more frame and record per split (~31 bytes), and a
    stream's first message follows its HEADERS (~250 bytes); neither is counted here."""
    framed = message_bytes + _GRPC_PREFIX_BYTES
    frames = -(-framed // _HTTP2_FRAME_PAYLOAD_BYTES)
    plaintext = framed + frames * _HTTP2_FRAME_HEADER_BYTES
    records = -(-plaintext // _TLS_RECORD_PLAINTEXT_BYTES)
    return plaintext + records * TLS_RECORD_OVERHEAD_BYTES


def declare_unsent(src: str, address: str, hiddens: Iterable[Any],
                   message: Any | None = None,
                   framing: Callable[[int], int] | None = None) -> None:
    """Declare the bytes that `hiddens` (the activations of one batch for `address`, the next
    hop) left out of their payload (`unsent_nbytes`, engine/emulated.py's ZeroHidden) on the
    link src -> address, just before the batch is written (module doc). Real activations
    leave nothing out: nothing is sent.

    `message` is the batch itself (`pb.WorkBatch`): the declaration then names its size on
    the wire (`_wire_bytes`), and the link proxy charges the declared bytes with exactly the
    bytes it reads for that message (rehearse/links.py, Declared bytes). Without it the size
    named is the payloads' alone, less than the message on the wire (ids, route, framing: a
    decode item's 64 bytes of payload are ~180 on the wire): on a link that never drains the
    proxy then charges each message with debts of messages written after it, and a decode
    step's message waits for the next prefill chunk's megabytes (docs/rehearse.md).
    `framing` gives the wire size of a message of n serialized bytes for the data plane that
    writes it (default gRPC's, `_wire_bytes`; the stream data plane's: runtime/dataplane.py
    `frame_wire_bytes`)."""
    global _ledger
    hiddens = list(hiddens)
    num_bytes = sum(getattr(h, "unsent_nbytes", 0) for h in hiddens)
    if not num_bytes:
        return
    if _ledger is None:
        name = os.environ.get(LINK_LEDGER_ENV)
        _ledger = LinkLedger(name) if name else False
        if not name:
            log.warning("activations are sent as a smaller payload but %s names no link "
                        "ledger: the bytes left out are charged by no link", LINK_LEDGER_ENV)
    if isinstance(_ledger, LinkLedger):
        if message is not None:
            wire_bytes = (framing or _wire_bytes)(message.ByteSize())
        else:  # the payloads' size only (docstring)
            wire_bytes = sum(getattr(h, "payload_nbytes", 0) for h in hiddens if h is not None)
        _ledger.declare(src, address, num_bytes, wire_bytes)


# ---- work items -------------------------------------------------------------------------


@dataclass
class WireItem:
    """One unit of work for one hop: a prefill chunk or one decode token of one request."""

    request_id: str
    coordinator_id: str
    step_id: int
    hop_index: int
    #: the request's pipeline (scheduler.Route's hops) and each hop's worker (host:port)
    route: tuple[NodeRange, ...]
    addresses: tuple[str, ...]
    #: position of token_ids[0] in the request's sequence
    position: int
    token_ids: list[int]
    #: hidden: [num_tokens, hidden_size]; None on the first hop (it embeds token_ids)
    hidden: torch.Tensor | RawHidden | None
    sampling: SamplingParams | None
    sample: bool
    compute_s: float = 0.0
    #: set on a re-prefill of prompt + output: tokens at positions >= this are generated ones
    num_prompt_tokens: int | None = None
    #: a request's first item when its prefix is cached: tokens [0, position) (helix.proto)
    prefix_token_ids: list[int] | None = None

    @property
    def hop(self) -> NodeRange:
        return self.route[self.hop_index]

    @property
    def is_last_hop(self) -> bool:
        return self.hop_index == len(self.route) - 1


@dataclass
class WireResult:
    """What comes back to the coordinator for one item: a token, an ack, or an error."""

    request_id: str
    step_id: int
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    status_code: int = OK
    error: str = ""
    node: str = ""
    compute_s: float = 0.0
    #: with the first token of a prompt_logprobs request: prompt tokens 1.. (see helix.proto)
    prompt_logprobs: list[PromptLogprob] | None = None
    #: with a prefix miss: the names of the prefix blocks the hop does not hold
    prefix_missing: list[bytes] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status_code == OK

    @property
    def prefix_miss(self) -> bool:
        """A hop did not hold the prefix the item named (FAILED_PRECONDITION "prefix miss")."""
        return self.status_code == FAILED_PRECONDITION and self.error.startswith(PREFIX_MISS)


def route_to_pb(route: Sequence[NodeRange], addresses: Sequence[str]) -> list[pb.Hop]:
    return [
        pb.Hop(node=h.name, address=a, start_layer=h.start_layer, end_layer=h.end_layer)
        for h, a in zip(route, addresses, strict=True)
    ]


def sampling_to_pb(s: SamplingParams | None) -> pb.SamplingParams | None:
    if s is None:
        return None
    return pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k is not None else 0,
        min_p=s.min_p,
        has_seed=s.seed is not None,
        seed=s.seed or 0,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logprobs=-1 if s.logprobs is None else s.logprobs,
        min_tokens=s.min_tokens,
        stop_token_ids=list(s.stop_token_ids),
        prompt_logprobs=-1 if s.prompt_logprobs is None else s.prompt_logprobs,
        logit_bias=dict(s.logit_bias),
        structured_kind=s.structured.kind if s.structured is not None else "",
        structured_spec=s.structured.spec if s.structured is not None else "",
    )


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.has_seed else None,
        repetition_penalty=msg.repetition_penalty,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logprobs=None if msg.logprobs < 0 else msg.logprobs,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        prompt_logprobs=None if msg.prompt_logprobs < 0 else msg.prompt_logprobs,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        structured=(StructuredOutput(msg.structured_kind, msg.structured_spec)
                    if msg.structured_kind else None),
    )


def item_to_pb(item: WireItem, route_pb: list[pb.Hop] | None = None) -> pb.WorkItem:
    """`route_pb` lets a caller reuse the converted route across a request's steps."""
    msg = pb.WorkItem(
        request_id=item.request_id,
        coordinator_id=item.coordinator_id,
        step_id=item.step_id,
        hop_index=item.hop_index,
        route=route_pb if route_pb is not None else route_to_pb(item.route, item.addresses),
        position=item.position,
        token_ids=item.token_ids,
        sample=item.sample,
        compute_s=item.compute_s,
        num_prompt_tokens=item.num_prompt_tokens or 0,
        prefix_token_ids=item.prefix_token_ids or [],
    )
    if item.hidden is not None:
        set_tensor_pb(msg.hidden, item.hidden)
    sampling = sampling_to_pb(item.sampling)
    if sampling is not None:
        msg.sampling.CopyFrom(sampling)
    return msg


def forward_item_pb(msg: pb.WorkItem, hidden: torch.Tensor | RawHidden,
                    compute_s: float) -> pb.WorkItem:
    """The same item for the next hop: hidden states replace nothing else. A continuation item
    (empty route) stays one: the next hop keeps the request's route too."""
    out = pb.WorkItem()
    forward_item_into(out, msg, hidden, compute_s)
    return out


class Continuation:
    """What a worker keeps of a received continuation item to forward it (the fields
    `forward_item_into` writes of one): a protobuf copy of each item cost more, and a
    continuation item is most of a decode-heavy hop's traffic."""

    __slots__ = ("request_id", "step_id", "position", "token_ids", "sample")
    route: tuple[()] = ()
    prefix_token_ids: tuple[()] = ()

    def __init__(self, item: WireItem) -> None:
        self.request_id = item.request_id
        self.step_id = item.step_id
        self.position = item.position
        self.token_ids = item.token_ids
        self.sample = item.sample


def forward_item_into(dst: pb.WorkItem, msg: pb.WorkItem | Continuation,
                      hidden: torch.Tensor | RawHidden | None, compute_s: float) -> None:
    """`forward_item_pb` written into `dst` (an item of an outgoing batch, or a new message):
    the hidden states' bytes are copied once, into `dst` itself. `msg` should come without
    hidden states (the worker clears the previous hop's): a full item's are copied, then
    replaced."""
    if isinstance(msg, pb.WorkItem) and msg.route:
        # a full item: everything but the hidden states, then the next hop's index
        dst.CopyFrom(msg)
        dst.hop_index = msg.hop_index + 1
    else:
        # a continuation item stays one: only what changed
        dst.Clear()
        dst.request_id = msg.request_id
        dst.step_id = msg.step_id
        dst.position = msg.position
        dst.token_ids.extend(msg.token_ids)
        dst.sample = msg.sample
    dst.compute_s = compute_s
    if hidden is not None:
        set_tensor_pb(dst.hidden, hidden)


def continuation_to_pb(request_id: str, step_id: int, position: int,
                       token_ids: list[int]) -> pb.WorkItem:
    """A decode item of a request whose first item (with route and sampling) went before it:
    only what changed (proto/helix.proto, WorkItem; the route's workers speak WIRE_VERSION 2)."""
    return pb.WorkItem(request_id=request_id, step_id=step_id, position=position,
                       token_ids=token_ids, sample=True)


@dataclass(frozen=True)
class RequestRoute:
    """What a worker keeps of a request from its first item, for its continuation items."""

    coordinator_id: str
    hop_index: int
    route: tuple[NodeRange, ...]
    addresses: tuple[str, ...]
    #: the sampling of decode steps (prompt_logprobs are scored with the prefill, not again)
    sampling: SamplingParams | None

    @staticmethod
    def of(item: WireItem) -> RequestRoute:
        sampling = item.sampling
        if sampling is not None and sampling.prompt_logprobs is not None:
            sampling = dataclasses.replace(sampling, prompt_logprobs=None)
        return RequestRoute(item.coordinator_id, item.hop_index, item.route, item.addresses,
                            sampling)


def _tokens_and_hidden(msg: pb.WorkItem, start_layer: int, expect: ExpectedInput,
                       where: str) -> torch.Tensor | RawHidden | None:
    """The item's token ids and position checked, and its hidden states: none on a hop that
    starts at layer 0 (it embeds the tokens), [num_tokens, hidden_size] on any other."""
    num_tokens = len(msg.token_ids)
    if num_tokens == 0:
        raise WireError(f"{where}.token_ids: empty")
    if msg.position < 0:
        raise WireError(f"{where}.position: {msg.position} < 0")
    num_prefix = len(msg.prefix_token_ids)
    if num_prefix and num_prefix != msg.position:
        raise WireError(f"{where}.prefix_token_ids: {num_prefix} tokens, but the item starts at "
                        f"position {msg.position} (the prefix is the tokens before it)")
    if start_layer == 0:
        if msg.HasField("hidden"):
            raise WireError(f"{where}.hidden: set on the first hop, which embeds token_ids")
        return None
    if not msg.HasField("hidden"):
        raise WireError(f"{where}.hidden: missing for a hop starting at layer {start_layer}")
    # hidden: [num_tokens, hidden_size]
    return hidden_from_pb(msg.hidden, f"{where}.hidden", num_tokens, expect)


def continuation_from_pb(msg: pb.WorkItem, kept: RequestRoute, expect: ExpectedInput,
                         where: str = "item") -> WireItem:
    """Decode a continuation item (empty route) with what the worker `kept` of its request;
    WireError names the bad field."""
    where = f"{where}[{msg.request_id}]"
    if msg.prefix_token_ids:
        raise WireError(f"{where}.prefix_token_ids: set on a continuation item (only a "
                        "request's first item carries a prefix)")
    hop = kept.route[kept.hop_index]
    if not (expect.start_layer <= hop.start_layer and hop.end_layer <= expect.end_layer):
        raise StaleRouteError(
            f"{where}: the request's layers [{hop.start_layer}, {hop.end_layer}) are no longer "
            f"held by this worker [{expect.start_layer}, {expect.end_layer})"
        )
    hidden = _tokens_and_hidden(msg, hop.start_layer, expect, where)
    return WireItem(
        request_id=msg.request_id,
        coordinator_id=kept.coordinator_id,
        step_id=msg.step_id,
        hop_index=kept.hop_index,
        route=kept.route,
        addresses=kept.addresses,
        position=msg.position,
        token_ids=list(msg.token_ids),
        hidden=hidden,
        sampling=kept.sampling,
        sample=msg.sample,
        compute_s=msg.compute_s,
    )


@dataclass(frozen=True)
class ExpectedInput:
    """What a worker accepts: its layer range, the model's depth, the hidden width and dtype."""

    start_layer: int
    end_layer: int
    num_model_layers: int
    hidden_size: int
    #: a torch dtype, or a wire name (float16, ...) for an engine without torch (RawHidden)
    dtype: torch.dtype | str


def item_from_pb(msg: pb.WorkItem, expect: ExpectedInput, where: str = "item") -> WireItem:
    """Decode and validate one incoming item; raise WireError naming the bad field."""
    if not msg.request_id:
        raise WireError(f"{where}.request_id: empty")
    where = f"{where}[{msg.request_id}]"
    route = tuple(NodeRange(h.node, h.start_layer, h.end_layer) for h in msg.route)
    if not route:
        raise WireError(f"{where}.route: empty")
    if msg.hop_index >= len(route):
        raise WireError(f"{where}.hop_index: {msg.hop_index} outside route of {len(route)} hops")
    layer = 0
    for i, h in enumerate(route):
        if h.start_layer != layer or h.end_layer <= h.start_layer:
            raise WireError(
                f"{where}.route[{i}]: layers [{h.start_layer}, {h.end_layer}) do not continue "
                f"from layer {layer}"
            )
        layer = h.end_layer
    if layer != expect.num_model_layers:
        raise WireError(
            f"{where}.route: covers layers [0, {layer}), model has {expect.num_model_layers}"
        )
    hop = route[msg.hop_index]
    if not (expect.start_layer <= hop.start_layer and hop.end_layer <= expect.end_layer):
        raise WireError(
            f"{where}.route[{msg.hop_index}]: layers [{hop.start_layer}, {hop.end_layer}) "
            f"not held by this worker [{expect.start_layer}, {expect.end_layer})"
        )
    hidden = _tokens_and_hidden(msg, hop.start_layer, expect, where)
    sampling = sampling_from_pb(msg.sampling) if msg.HasField("sampling") else None
    return WireItem(
        request_id=msg.request_id,
        coordinator_id=msg.coordinator_id,
        step_id=msg.step_id,
        hop_index=msg.hop_index,
        route=route,
        addresses=tuple(h.address for h in msg.route),
        position=msg.position,
        token_ids=list(msg.token_ids),
        hidden=hidden,
        sampling=sampling,
        sample=msg.sample,
        compute_s=msg.compute_s,
        num_prompt_tokens=msg.num_prompt_tokens or None,
        prefix_token_ids=list(msg.prefix_token_ids) or None,
    )


def work_batch_pb(
    items: Sequence[pb.WorkItem], coordinator_id: str = "", sender: str = "",
    coordinator_token: str = "", release_ids: Sequence[str] = (),
) -> pb.WorkBatch:
    batch = pb.WorkBatch(items=items, release_ids=release_ids)
    if coordinator_id or sender:
        batch.hello.CopyFrom(pb.StreamHello(coordinator_id=coordinator_id, sender=sender,
                                            coordinator_token=coordinator_token))
    return batch


def hello_of(batch: pb.WorkBatch) -> tuple[str, str] | None:
    """(coordinator_id, sender) when the batch opens a stream, else None."""
    if not batch.HasField("hello"):
        return None
    return batch.hello.coordinator_id, batch.hello.sender


def hello_token(batch: pb.WorkBatch) -> str:
    """The coordinator's secret in a stream's hello ("" when none)."""
    return batch.hello.coordinator_token if batch.HasField("hello") else ""


# ---- results ----------------------------------------------------------------------------


def result_to_pb(r: WireResult) -> pb.WorkResult:
    msg = pb.WorkResult(
        request_id=r.request_id,
        step_id=r.step_id,
        has_token=r.token_id is not None,
        token_id=r.token_id or 0,
        logprob=r.logprob or 0.0,
        has_logprob=r.logprob is not None,
        top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in r.top_logprobs],
        status_code=r.status_code,
        error=r.error,
        node=r.node,
        compute_s=r.compute_s,
        has_prompt_logprobs=r.prompt_logprobs is not None,
        prompt_logprobs=[
            pb.PromptLogprob(
                token_id=p.token_id,
                logprob=p.logprob,
                top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in p.top_logprobs],
            )
            for p in r.prompt_logprobs or []
        ],
        prefix_missing=r.prefix_missing,
    )
    return msg


def result_from_pb(msg: pb.WorkResult) -> WireResult:
    prompt_logprobs = None
    if msg.has_prompt_logprobs:
        prompt_logprobs = [
            PromptLogprob(p.token_id, p.logprob, [(t.token_id, t.logprob) for t in p.top_logprobs])
            for p in msg.prompt_logprobs
        ]
    return WireResult(
        request_id=msg.request_id,
        step_id=msg.step_id,
        token_id=msg.token_id if msg.has_token else None,
        logprob=msg.logprob if msg.has_logprob else None,
        top_logprobs=[(t.token_id, t.logprob) for t in msg.top_logprobs],
        status_code=msg.status_code,
        error=msg.error,
        node=msg.node,
        compute_s=msg.compute_s,
        prompt_logprobs=prompt_logprobs,
        prefix_missing=list(msg.prefix_missing),
    )


def result_batch_pb(results: Sequence[pb.WorkResult],
                    cache: pb.CacheEvents | None = None) -> pb.ResultBatch:
    batch = pb.ResultBatch(results=results)
    if cache is not None:
        batch.cache.CopyFrom(cache)
    return batch


# ---- prefix cache events ----------------------------------------------------------------


def cache_events_to_pb(node: str, ev: CacheEvents) -> pb.CacheEvents:
    return pb.CacheEvents(node=node, stored=ev.stored, removed=ev.removed, reset=ev.reset)


def cache_events_from_pb(msg: pb.CacheEvents, where: str = "cache") -> CacheEvents:
    """A worker's cache report; WireError when a name is not a block name (16 bytes)."""
    stored, removed = list(msg.stored), list(msg.removed)
    for name, names in (("stored", stored), ("removed", removed)):
        for i, h in enumerate(names):
            if len(h) != BLOCK_HASH_BYTES:
                raise WireError(f"{where}.{name}[{i}]: {len(h)} bytes, a block name has "
                                f"{BLOCK_HASH_BYTES}")
    return CacheEvents(stored, removed, msg.reset)


def merge_cache_events(first: pb.CacheEvents, then: pb.CacheEvents) -> pb.CacheEvents:
    """One report saying what `first` and then `then` said (each name in its last state)."""
    if then.reset:
        return then
    state = dict.fromkeys(first.stored, True)
    state.update(dict.fromkeys(first.removed, False))
    state.update(dict.fromkeys(then.stored, True))
    state.update(dict.fromkeys(then.removed, False))
    return pb.CacheEvents(node=then.node or first.node,
                          stored=[h for h, s in state.items() if s],
                          removed=[h for h, s in state.items() if not s], reset=first.reset)


def release_pb(request_ids: Sequence[str], coordinator_id: str = "",
               coordinator_token: str = "") -> pb.ReleaseRequest:
    return pb.ReleaseRequest(request_ids=list(request_ids), coordinator_id=coordinator_id,
                             coordinator_token=coordinator_token)


# ---- info -------------------------------------------------------------------------------


#: upper bounds of the tokens-per-engine-step histogram (vLLM's iteration_tokens_total)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class WorkerInfo:
    node: str
    model: str
    num_model_layers: int
    start_layer: int
    end_layer: int
    backend: str
    device: str
    dtype: str
    hidden_size: int
    kv_block_size: int
    kv_total_blocks: int
    kv_used_blocks: int
    kv_capacity_tokens: int
    queue_len: int
    last_batch_size: int
    busy_fraction: float
    steps: int
    items_run: int
    active_requests: int
    draining: bool
    eos_token_ids: tuple[int, ...]
    #: engine steps per bucket of STEP_TOKEN_BUCKETS (+ one for larger), tokens over all steps
    step_tokens_counts: tuple[int, ...] = ()
    step_tokens_sum: int = 0
    engine: str = "torch"
    vllm_version: str = ""
    #: 0/1: full items only; 2: continuation items too; 3: releases on the Work stream too
    #: (WIRE_VERSION)
    wire_version: int = 0
    #: Work/result messages sent and the items they carried (items per message)
    work_messages_out: int = 0
    work_items_out: int = 0

    @property
    def kv_free_tokens(self) -> int:
        return (self.kv_total_blocks - self.kv_used_blocks) * self.kv_block_size


def info_to_pb(info: WorkerInfo) -> pb.InfoReply:
    fields = {k: getattr(info, k) for k in WorkerInfo.__dataclass_fields__}
    fields["eos_token_ids"] = list(info.eos_token_ids)
    fields["step_tokens_counts"] = list(info.step_tokens_counts)
    return pb.InfoReply(**fields)


def info_from_pb(msg: pb.InfoReply) -> WorkerInfo:
    fields = {k: getattr(msg, k) for k in WorkerInfo.__dataclass_fields__}
    fields["eos_token_ids"] = tuple(msg.eos_token_ids)
    fields["step_tokens_counts"] = tuple(msg.step_tokens_counts)
    return WorkerInfo(**fields)
