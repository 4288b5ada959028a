"""Tensor and work-item conversion at the wire edge: exact round trips, loud rejections."""

import pytest
import torch

from helixserve.planner.placement import NodeRange
from helixserve.request import SamplingParams
from helixserve.runtime import transport as tp

EXPECT = tp.ExpectedInput(start_layer=10, end_layer=20, num_model_layers=30, hidden_size=8,
                          dtype=torch.float32)
ROUTE = (NodeRange("a", 0, 10), NodeRange("b", 10, 20), NodeRange("c", 20, 30))
ADDRESSES = ("h:1", "h:2", "h:3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_round_trip_is_bit_exact(dtype):
    t = torch.randn(3, 8).to(dtype)  # hidden: [num_tokens, hidden_size]
    msg = tp.tensor_to_pb(t[:, :])
    assert msg.dtype == str(dtype).removeprefix("torch.") and list(msg.shape) == [3, 8]
    back = tp.tensor_from_pb(msg, "x", (None, 8), dtype)
    assert back.dtype == dtype and torch.equal(back, t)


def test_tensor_from_non_contiguous_view():
    t = torch.randn(8, 3).t()  # [3, 8], not contiguous
    assert torch.equal(tp.tensor_from_pb(tp.tensor_to_pb(t), "x", (3, 8), torch.float32), t)


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (tp.pb.Tensor(dtype="float16", shape=[1, 8], data=bytes(16)), "x.dtype"),
        (tp.pb.Tensor(dtype="int8", shape=[1, 8], data=bytes(8)), "x.dtype"),
        (tp.pb.Tensor(dtype="float32", shape=[1, 7], data=bytes(28)), "x.shape"),
        (tp.pb.Tensor(dtype="float32", shape=[8], data=bytes(32)), "x.shape"),
        (tp.pb.Tensor(dtype="float32", shape=[0, 8], data=b""), "x.shape"),
        (tp.pb.Tensor(dtype="float32", shape=[1, 8], data=bytes(31)), "x.data"),
    ],
)
def test_tensor_mismatch_raises_naming_the_field(msg, field):
    with pytest.raises(tp.WireError, match=field.replace(".", r"\.")):
        tp.tensor_from_pb(msg, "x", (None, 8), torch.float32)


def test_hidden_in_another_float_dtype_is_cast():
    """Mixed clusters: a bfloat16 worker feeds a float32 one; a float32 one feeds float16."""
    h = torch.randn(2, 8).to(torch.bfloat16)
    got = tp.hidden_from_pb(tp.tensor_to_pb(h), "h", 2, EXPECT)
    assert got.dtype == torch.float32 and torch.equal(got, h.float())
    to_half = tp.ExpectedInput(10, 20, 30, 8, torch.float16)
    big = torch.full((2, 8), 1e6)
    with pytest.raises(tp.WireError, match="overflow float16"):
        tp.hidden_from_pb(tp.tensor_to_pb(big), "h", 2, to_half)
    with pytest.raises(tp.WireError, match="h.dtype: got 'int64'"):
        tp.hidden_from_pb(tp.tensor_to_pb(torch.ones(2, 8, dtype=torch.long)), "h", 2, EXPECT)


def _item(**kw):
    base = dict(request_id="r", coordinator_id="c", step_id=3, hop_index=1, route=ROUTE, addresses=ADDRESSES,
                position=5, token_ids=[1, 2], hidden=torch.randn(2, 8),
                sampling=SamplingParams(temperature=0.5, top_k=4, seed=9, logprobs=2,
                                        prompt_logprobs=0), sample=True)
    base.update(kw)
    return tp.WireItem(**base)


def test_item_round_trip():
    item = _item()
    back = tp.item_from_pb(tp.item_to_pb(item), EXPECT)
    assert (back.request_id, back.step_id, back.hop_index, back.position, back.token_ids) == (
        "r", 3, 1, 5, [1, 2])
    assert back.route == ROUTE and back.hop == ROUTE[1] and not back.is_last_hop
    assert back.addresses == ADDRESSES
    assert torch.equal(back.hidden, item.hidden)
    assert back.sampling == item.sampling


def test_forwarded_item_goes_to_the_next_hop():
    msg = tp.item_to_pb(_item())
    fwd = tp.forward_item_pb(msg, torch.ones(2, 8), compute_s=0.25)
    expect_c = tp.ExpectedInput(20, 30, 30, 8, torch.float32)
    back = tp.item_from_pb(fwd, expect_c)
    assert back.hop_index == 2 and back.is_last_hop and back.compute_s == 0.25
    assert torch.equal(back.hidden, torch.ones(2, 8))


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"hop_index": 0, "hidden": None}, "not held by this worker"),
        ({"hop_index": 3}, "hop_index"),
        ({"route": (NodeRange("a", 0, 10), NodeRange("b", 12, 30)), "addresses": ("", "")},
         "do not continue"),
        ({"route": (NodeRange("a", 0, 10), NodeRange("b", 10, 20)), "addresses": ("", "")},
         "covers layers"),
        ({"hidden": None}, "hidden: missing"),
        ({"hidden": torch.randn(3, 8)}, "shape"),
        ({"token_ids": []}, "token_ids: empty"),
        ({"position": -1}, "position"),
        ({"request_id": ""}, "request_id"),
    ],
)
def test_invalid_items_are_rejected(changes, needle):
    item = _item(**changes)
    msg = tp.item_to_pb(item)
    with pytest.raises(tp.WireError, match=needle):
        tp.item_from_pb(msg, EXPECT)


def test_first_hop_must_not_carry_hidden():
    expect_a = tp.ExpectedInput(0, 10, 30, 8, torch.float32)
    msg = tp.item_to_pb(_item(hop_index=0))
    with pytest.raises(tp.WireError, match="set on the first hop"):
        tp.item_from_pb(msg, expect_a)


def test_prefill_chunk_fits_the_message_limit():
    assert tp.prefill_chunk_tokens(576, torch.float32) == 512
    wide = tp.prefill_chunk_tokens(65536, torch.float32, max_tokens=10_000)
    assert wide * 65536 * 4 <= tp.MAX_MESSAGE_BYTES // 2 and wide >= 1


def test_result_round_trip():
    r = tp.WireResult("r", 4, token_id=7, logprob=-0.5, top_logprobs=[(7, -0.5), (3, -1.25)],
                      node="c", compute_s=0.01)
    back = tp.result_from_pb(tp.result_to_pb(r))
    assert back == r
    ack = tp.result_from_pb(tp.result_to_pb(tp.WireResult("r", 5)))
    assert ack.token_id is None and ack.ok
    assert ack.prompt_logprobs is None


def test_prompt_logprobs_round_trip():
    from helixserve.request import PromptLogprob

    scored = [PromptLogprob(5, -2.5, [(9, -0.5), (5, -2.5)]), PromptLogprob(6, -0.25, [])]
    r = tp.WireResult("r", 4, token_id=7, prompt_logprobs=scored)
    assert tp.result_from_pb(tp.result_to_pb(r)).prompt_logprobs == scored
    # a one-token prompt: scored, but nothing to score (not the same as not asked)
    empty = tp.result_from_pb(tp.result_to_pb(tp.WireResult("r", 4, token_id=7, prompt_logprobs=[])))
    assert empty.prompt_logprobs == []
    assert tp.sampling_from_pb(tp.sampling_to_pb(SamplingParams())).prompt_logprobs is None


def test_continuation_item_carries_only_what_changed():
    """A decode step after a request's first item: request id, step, position, token (and
    hidden states between workers); no route, coordinator or sampling (proto: WorkItem)."""
    msg = tp.continuation_to_pb("r", 11, 7, [42])
    assert {f.name for f, _ in msg.ListFields()} == {
        "request_id", "step_id", "position", "token_ids", "sample"}
    full = tp.item_to_pb(_item(hidden=None, hop_index=0, token_ids=[42], position=7))
    assert msg.ByteSize() * 4 < full.ByteSize()
    # what the worker kept from the first item fills in the rest
    kept = tp.RequestRoute.of(tp.item_from_pb(tp.item_to_pb(_item()), EXPECT))
    hidden = torch.randn(1, 8)
    fwd = tp.forward_item_pb(msg, hidden, compute_s=0.5)  # as hop 0 forwards it
    assert not fwd.route and not fwd.coordinator_id and not fwd.HasField("sampling")
    back = tp.continuation_from_pb(fwd, kept, EXPECT)
    assert (back.request_id, back.step_id, back.position, back.token_ids, back.sample) == (
        "r", 11, 7, [42], True)
    assert back.route == ROUTE and back.hop_index == 1 and back.addresses == ADDRESSES
    assert back.coordinator_id == "c" and back.compute_s == 0.5
    assert torch.equal(back.hidden, hidden)
    # decode steps do not score the prompt again
    assert back.sampling == SamplingParams(temperature=0.5, top_k=4, seed=9, logprobs=2)


def test_continuation_item_is_checked_like_a_full_one():
    kept = tp.RequestRoute.of(tp.item_from_pb(tp.item_to_pb(_item()), EXPECT))
    with pytest.raises(tp.WireError, match=r"hidden: missing"):
        tp.continuation_from_pb(tp.continuation_to_pb("r", 1, 7, [42]), kept, EXPECT)
    bad = tp.forward_item_pb(tp.continuation_to_pb("r", 1, 7, [42]), torch.randn(1, 7), 0.0)
    with pytest.raises(tp.WireError, match=r"hidden.shape"):
        tp.continuation_from_pb(bad, kept, EXPECT)
    moved = tp.ExpectedInput(0, 10, 30, 8, torch.float32)  # the worker holds other layers now
    with pytest.raises(tp.StaleRouteError, match="no longer held"):
        tp.continuation_from_pb(tp.continuation_to_pb("r", 1, 7, [42]), kept, moved)


def test_info_reports_the_wire_version_and_message_counts():
    info = tp.info_from_pb(tp.info_to_pb(tp.WorkerInfo(
        node="n", model="m", num_model_layers=30, start_layer=0, end_layer=30, backend="torch",
        device="cpu", dtype="float32", hidden_size=8, kv_block_size=16, kv_total_blocks=4,
        kv_used_blocks=0, kv_capacity_tokens=64, queue_len=0, last_batch_size=0,
        busy_fraction=0.0, steps=0, items_run=0, active_requests=0, draining=False,
        eos_token_ids=(), wire_version=tp.WIRE_VERSION, work_messages_out=3,
        work_items_out=48)))
    assert (info.wire_version, info.work_messages_out, info.work_items_out) == (3, 3, 48)
    # a worker of an older contract reports no version: full items only
    assert tp.info_from_pb(tp.pb.InfoReply()).wire_version == 0


class _CountingTensor:
    """A pb.Tensor stand-in that counts reads of `data` (each read of a protobuf bytes field
    copies it: 8 MiB per prefill chunk of LLaMA-2-70B)."""

    def __init__(self, msg):
        self.dtype, self.shape, self._data, self.reads = msg.dtype, list(msg.shape), msg.data, 0

    @property
    def data(self):
        self.reads += 1
        return self._data


def test_hidden_bytes_are_read_once():
    raw_expect = tp.ExpectedInput(10, 20, 30, 8, "float16")
    msg = _CountingTensor(tp.tensor_to_pb(torch.randn(2, 8).half()))
    got = tp.hidden_from_pb(msg, "h", 2, raw_expect)
    assert msg.reads == 1 and got.shape == (2, 8) and got.dtype == "float16"
    assert got.data == msg._data
    msg = _CountingTensor(tp.tensor_to_pb(torch.randn(2, 8)))
    assert torch.equal(tp.tensor_from_pb(msg, "x", (2, 8), torch.float32).view(-1),
                       torch.frombuffer(bytearray(msg._data), dtype=torch.float32))
    assert msg.reads == 1
    # a wrong length is still named, with the byte counts
    bad = tp.pb.Tensor(dtype="float16", shape=[2, 8], data=bytes(31))
    with pytest.raises(tp.WireError, match=r"h\.data: 31 bytes, expected 32"):
        tp.hidden_from_pb(bad, "h", 2, raw_expect)


def test_forward_item_into_writes_over_a_used_item():
    """The worker writes next-hop items into a batch's items: whatever `dst` held (another
    item, the previous hop's hidden states) is replaced, as `forward_item_pb` builds it."""
    from helixserve.engine.protocol import RawHidden

    full = tp.item_to_pb(_item())  # carries hop 1's input hidden states
    cont = tp.continuation_to_pb("r", 4, 7, [3])
    for msg, hidden in ((full, torch.ones(2, 8)),
                        (cont, RawHidden("float32", (1, 8), bytes(32)))):
        dst = tp.item_to_pb(_item(request_id="old", hidden=torch.randn(5, 8)))
        tp.forward_item_into(dst, msg, hidden, 0.75)
        assert dst == tp.forward_item_pb(msg, hidden, 0.75)
        assert list(dst.hidden.shape) == list(hidden.shape) and dst.compute_s == 0.75
    assert not dst.route and dst.request_id == "r" and dst.hop_index == 0
    back = tp.item_from_pb(tp.forward_item_pb(full, torch.ones(2, 8), 0.75),
                           tp.ExpectedInput(20, 30, 30, 8, torch.float32))
    assert back.hop_index == 2 and torch.equal(back.hidden, torch.ones(2, 8))
    assert back.sampling == _item().sampling and back.route == ROUTE
