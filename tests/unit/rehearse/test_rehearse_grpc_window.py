"""The HTTP/2 stream window a rehearsal gives gRPC when activations cross as a smaller
payload (rehearse/cluster.py `stream_window_bytes`, docs/rehearse.md "Links"): two of the
largest messages a worker sends must fit in it, or its sender waits for a WINDOW_UPDATE once
per message and a saturated slow link idles a round trip each time (helix-geo-24 at 32 KiB:
a 512-token prefill chunk's message is ~34 KiB on the wire, and the 0.1 Gbit/s links carried
87-95% of their bandwidth). Sizes only, no timing."""

from __future__ import annotations

from helixserve.engine.protocol import RawHidden
from helixserve.planner.placement import NodeRange
from helixserve.rehearse.cluster import GRPC_WINDOW_REAL_BYTES, stream_window_bytes
from helixserve.runtime import transport as tp
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.worker import BATCH_BYTES
from helixserve.spec.scheduling import DEFAULT_PREFILL_CHUNK_TOKENS

HIDDEN, ROW = 8192, 8192 * 2  # LLaMA-2-70B, float16
PAYLOAD = 64  # rehearse's default bytes a token on the wire


def prefill_chunk_message(payload: int) -> pb.WorkBatch:
    """A worker's message to its next hop with one prefill chunk of the largest size, as
    `peers.GrpcPeer` writes it: a 13-hop route (helix-geo-24), token ids near the top of the vocabulary
    (the longest varints), the hidden states' rows `payload` bytes each."""
    tokens = tp.prefill_chunk_tokens(HIDDEN, "float16", DEFAULT_PREFILL_CHUNK_TOKENS)
    route = tuple(NodeRange(f"n{i}", i * 6, i * 6 + 6) for i in range(13))
    item = pb.WorkItem(request_id="cmpl-" + "f" * 32 + "-0-255#coord-" + "f" * 32 + ".255",
                       coordinator_id="coord-" + "f" * 32, step_id=1, hop_index=3,
                       route=tp.route_to_pb(route, [f"127.0.0.1:{20000 + i}" for i in range(13)]),
                       position=1024, token_ids=[31999] * tokens, num_prompt_tokens=2048)
    batch = tp.work_batch_pb([], sender="n3")
    tp.forward_item_into(batch.items.add(), item,
                         RawHidden("float16", (tokens, HIDDEN), bytes(tokens * payload)), 0.1)
    return batch


def test_two_prefill_chunk_messages_fit_in_the_stream_window():
    window = stream_window_bytes(PAYLOAD, ROW)
    message = prefill_chunk_message(PAYLOAD).ByteSize() + 9 + 5  # HTTP/2 frame + gRPC prefix
    assert 2 * message <= window
    # in real bytes, what the window stands for: two of the largest messages a worker
    # writes (a batch of BATCH_BYTES, then one more item: a chunk of the model's real size)
    tokens = tp.prefill_chunk_tokens(HIDDEN, "float16", DEFAULT_PREFILL_CHUNK_TOKENS)
    assert 2 * (BATCH_BYTES + tokens * ROW) <= GRPC_WINDOW_REAL_BYTES


def test_the_window_scales_with_the_payload_and_never_goes_under_grpcs_default():
    assert stream_window_bytes(64, ROW) == GRPC_WINDOW_REAL_BYTES * 64 // ROW
    assert stream_window_bytes(256, ROW) == 4 * stream_window_bytes(64, ROW)
    assert stream_window_bytes(8, ROW) == 65536
