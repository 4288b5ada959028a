"""The real distributed runtime: worker processes on 127.0.0.1, real gRPC, real weights.

Greedy output through the pipelines equals the single-process engine token for token, with
requests in flight at once on several routes; cancelling mid-stream frees KV on every worker;
malformed tensors are rejected with INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from runtime_procs import (
    NUM_LAYERS,
    WorkerProc,
    even_placement,
    make_cluster,
    make_placement,
    uneven_placement,
)

from helixserve.engine import ShardEngine, WorkItem
from helixserve.planner.placement import NodeRange
from helixserve.request import SamplingParams
from helixserve.runtime import (
    Coordinator,
    CoordinatorConfig,
    GenerationRequest,
    NoRouteError,
    security,
)
from helixserve.runtime import transport as tp
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colors.",
    "Why is the sky blue? Answer in detail, with an explanation of Rayleigh scattering.",
    "Say hello.",
    "What is 2 + 2?",
]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def prompts(demo_model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model))
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def reference(demo_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens from one in-process engine holding all layers, one request at a time."""
    # One thread: the workers run beside us on a small shared machine, and OpenMP threads
    # spinning against other processes slow everything down by 10x or more.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = ShardEngine.load(demo_model, 0, NUM_LAYERS, kv_cache_bytes=64 * 1024 * 1024)
    refs = []
    for prompt in prompts:
        rid = uuid.uuid4().hex
        out = engine.step([WorkItem(rid, 0, NUM_LAYERS, 0, prompt, None, GREEDY)])
        tokens = [out[0].token_id]
        while len(tokens) < MAX_TOKENS:
            pos = len(prompt) + len(tokens) - 1
            out = engine.step([WorkItem(rid, 0, NUM_LAYERS, pos, [tokens[-1]], None, GREEDY)])
            tokens.append(out[0].token_id)
        engine.free(rid)
        refs.append(tokens)
    torch.set_num_threads(threads)
    return refs


async def run_all(coord: Coordinator, prompts: list[list[int]]) -> list[tuple[list[int], str]]:
    async def one(i: int, prompt: list[int]) -> tuple[list[int], str]:
        req = GenerationRequest(f"req-{i}", prompt, GREEDY, max_tokens=MAX_TOKENS, ignore_eos=True)
        ids, text = [], ""
        async for ev in coord.generate(req):
            ids.append(ev.token_id)
            text += ev.text
        assert ev.finish_reason == "length"
        return ids, text

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def worker_infos(workers: dict[str, WorkerProc]) -> dict[str, tp.WorkerInfo]:
    out = {}
    for name, w in workers.items():
        async with grpc.aio.insecure_channel(w.address) as ch:
            out[name] = tp.info_from_pb(await pb_grpc.HelixWorkerStub(ch).Info(pb.InfoRequest()))
    return out


async def wait_kv_empty(workers: dict[str, WorkerProc], timeout_s: float = 10.0) -> dict[str, int]:
    used: dict[str, int] = {}
    for _ in range(int(timeout_s / 0.1)):
        infos = await worker_infos(workers)
        used = {n: i.kv_used_blocks for n, i in infos.items()}
        if not any(used.values()):
            return used
        await asyncio.sleep(0.1)
    return used


def test_even_pipeline_matches_single_process(workers, demo_model, prompts, reference):
    even = {n: workers[n] for n in ("n0", "n1", "n2")}

    async def main() -> tuple[list[tuple[list[int], str]], dict[str, Any]]:
        coord = await Coordinator.create(make_cluster(list(even.values())), even_placement(),
                                         demo_model)
        try:
            results = await run_all(coord, prompts)
            return results, coord.stats()
        finally:
            await coord.close()

    results, stats = asyncio.run(main())
    tok_decode = _tokenizer(demo_model).decode
    for (ids, text), ref in zip(results, reference, strict=True):
        assert ids == ref
        assert text == tok_decode(ids, skip_special_tokens=True)
    assert stats.routes == {"n0->n1->n2": len(prompts)}
    assert asyncio.run(wait_kv_empty(workers)) == dict.fromkeys(workers, 0)


def test_uneven_placement_routes_with_partial_inference(workers, demo_model, prompts, reference):
    async def main() -> tuple[list[tuple[list[int], str]], dict[str, Any]]:
        # Small prefill chunks: every prompt is split, and the chunks pipeline along the route.
        # Cache-aware routes (the default): the six share the chat template's system prompt
        # (24 tokens, one block), which the test before cached on n0->n1->n2, and every route
        # ends on n2, so load never tells them apart; the flow term does (a route is taken
        # for its cache only while less than saved / prefix_flow_weight tokens of work over
        # its flow share: docs/prefix-caching.md "Routing"), so they still spread.
        coord = await Coordinator.create(make_cluster(list(workers.values())), uneven_placement(),
                                         demo_model, CoordinatorConfig(prefill_chunk_tokens=16))
        try:
            results = await run_all(coord, prompts)
            return results, coord.stats()
        finally:
            await coord.close()

    results, stats = asyncio.run(main())
    for (ids, _), ref in zip(results, reference, strict=True):
        assert ids == ref
    routes = stats.routes
    assert len(routes) >= 2, routes
    # m [0,25) then n2 runs only [25,30); or n0 then m runs only [10,25): partial inference
    assert {"m->n2", "n0->m->n2"} & set(routes), routes
    assert asyncio.run(wait_kv_empty(workers)) == dict.fromkeys(workers, 0)


def test_cancel_mid_stream_frees_kv_on_every_worker(workers, demo_model, prompts):
    even = {n: workers[n] for n in ("n0", "n1", "n2")}

    async def main() -> tuple[dict[str, int], dict[str, int]]:
        coord = await Coordinator.create(make_cluster(list(even.values())), even_placement(),
                                         demo_model)
        rpc_releases: list[str] = []

        async def no_release_call(ids: list[str]) -> int:
            rpc_releases.extend(ids)  # frees nothing: the stream's release ids must
            return 0

        for node in coord.nodes.values():
            node.release = no_release_call  # type: ignore[method-assign]
        try:
            gens = [coord.generate(GenerationRequest(f"cancel-{i}", p, GREEDY, max_tokens=500,
                                                     ignore_eos=True))
                    for i, p in enumerate(prompts[:3])]
            for g in gens:
                for _ in range(3):
                    await g.__anext__()
            during = {n: i.kv_used_blocks for n, i in (await worker_infos(even)).items()}
            for g in gens:
                await g.aclose()  # what the API does when the client disconnects
            after = await wait_kv_empty(even)
            assert coord.stats().running == 0
            assert rpc_releases == []  # freed by release ids on the Work streams
            return during, after
        finally:
            await coord.close()

    during, after = asyncio.run(main())
    assert all(v > 0 for v in during.values()), during
    assert after == {"n0": 0, "n1": 0, "n2": 0}


def test_no_route_when_workers_do_not_cover_the_model(workers, demo_model):
    async def main() -> None:
        # n2 is declared down by pointing the placement at n0/n1 only plus a dead address.
        from helixserve.spec import ClusterSpec, NodeSpec

        placement = make_placement(
            [("n0", 0, 10), ("n1", 10, 20), ("n2", 20, 30)],
            [("coordinator", "n0", 1), ("n0", "n1", 1), ("n1", "n2", 1), ("n2", "coordinator", 1)],
        )
        cluster = ClusterSpec(name="t", nodes=[
            NodeSpec("n0", "L4", address=workers["n0"].address),
            NodeSpec("n1", "L4", address=workers["n1"].address),
            NodeSpec("n2", "L4", address=workers["n2"].address),
        ])
        coord = await Coordinator.create(cluster, placement, demo_model)
        try:
            coord._on_node_down("n2", "test: marked down")
            coord.nodes["n2"].alive = False
            coord.nodes["n2"].reconnectable = lambda: False  # type: ignore[method-assign]
            with pytest.raises(NoRouteError, match="no route covers"):
                async for _ in coord.generate(GenerationRequest("x", [1, 2, 3], GREEDY, 4)):
                    pass
        finally:
            await coord.close()

    asyncio.run(main())


#: a coordinator identity for the raw-stub tests (workers refuse a hello without its token)
TESTER_ID, TESTER_TOKEN = security.new_coordinator_identity()


def _bad_item(worker: WorkerProc, **changes: Any) -> pb.WorkItem:
    """A decode item for n1 ([10,20)) with hidden states, then `changes` applied."""
    hidden = torch.zeros(1, 576)
    route = (NodeRange("n0", 0, 10), NodeRange("n1", 10, 20), NodeRange("n2", 20, 30))
    item = tp.WireItem(request_id="bad", coordinator_id=TESTER_ID, step_id=7, hop_index=1,
                       route=route, addresses=("x", worker.address, "y"), position=0,
                       token_ids=[1], hidden=hidden,
                       sampling=GREEDY, sample=True)
    msg = tp.item_to_pb(item)
    for key, value in changes.items():
        if key == "hidden":
            msg.hidden.CopyFrom(value)
        elif key == "route":
            del msg.route[:]
            msg.route.extend(tp.route_to_pb(value, ["x"] * len(value)))
        else:
            setattr(msg, key, value)
    return msg


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden": pb.Tensor(dtype="int16", shape=[1, 576], data=bytes(1152))}, "dtype"),
        ({"hidden": pb.Tensor(dtype="float16", shape=[1, 576], data=bytes(100))}, "bytes"),
        ({"hidden": pb.Tensor(dtype="float32", shape=[1, 575], data=bytes(2300))}, "shape"),
        ({"hidden": pb.Tensor(dtype="float32", shape=[2, 576], data=bytes(4608))}, "shape"),
        ({"hidden": pb.Tensor(dtype="float32", shape=[1, 576], data=bytes(100))}, "bytes"),
        ({"hidden": pb.Tensor(dtype="pickle", shape=[1, 576], data=bytes(100))}, "dtype"),
        ({"route": [NodeRange("n0", 0, 15), NodeRange("n1", 15, 30)]}, "not held"),
        ({"route": [NodeRange("n0", 0, 10), NodeRange("n1", 10, 20)]}, "covers"),
        ({"hop_index": 5}, "hop_index"),
    ],
)
def test_bad_tensors_are_rejected(workers, changes, message):
    async def main() -> pb.WorkResult:
        async with grpc.aio.insecure_channel(workers["n1"].address) as ch:
            stub = pb_grpc.HelixWorkerStub(ch)
            msg = _bad_item(workers["n1"], **changes)

            async def requests() -> Any:
                yield tp.work_batch_pb([msg], coordinator_id=TESTER_ID, sender="test",
                                       coordinator_token=TESTER_TOKEN)

            call = stub.Work(requests())
            batch = await asyncio.wait_for(call.__aiter__().__anext__(), 10)
            call.cancel()
            return batch.results[0]

    result = asyncio.run(main())
    assert result.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert result.request_id == "bad" and result.step_id == 7
    assert message in result.error and "node n1" in result.error


def test_info_and_health(workers):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def main() -> tuple[int, tp.WorkerInfo]:
        async with grpc.aio.insecure_channel(workers["m"].address) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="helixserve.v1.HelixWorker"))
            info = tp.info_from_pb(await pb_grpc.HelixWorkerStub(ch).Info(pb.InfoRequest()))
            return health.status, info

    status, info = asyncio.run(main())
    assert status == 1  # SERVING
    assert (info.node, info.start_layer, info.end_layer, info.num_model_layers) == ("m", 0, 25, 30)
    assert (info.backend, info.device, info.dtype, info.hidden_size) == ("torch", "cpu", "float32", 576)
    assert info.kv_capacity_tokens == info.kv_total_blocks * info.kv_block_size > 0
    assert info.eos_token_ids


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_admission_limits(workers, demo_model):
    from helixserve.errors import UserError
    from helixserve.runtime import QueueFullError

    even = [workers[n] for n in ("n0", "n1", "n2")]

    async def main() -> None:
        # reserve: the waiting below needs prompt + max_tokens held at admission
        coord = await Coordinator.create(make_cluster(even), even_placement(), demo_model,
                                         CoordinatorConfig(max_queue=0, max_model_len=100_000,
                                                           kv_allocation="reserve"))
        try:
            capacity = coord.nodes["n0"].kv_capacity_tokens
            # can never fit: refused at once instead of waiting forever
            with pytest.raises(UserError, match="no route can hold"):
                await coord.generate(GenerationRequest("big", [1, 2], GREEDY, capacity)).__anext__()
            # fits alone, but not beside a running request: waits, and the queue holds 0
            first = coord.generate(GenerationRequest("a", [1, 2], GREEDY, capacity - 100))
            await first.__anext__()
            with pytest.raises(QueueFullError):
                await coord.generate(GenerationRequest("b", [1, 2], GREEDY, 200)).__anext__()
            await first.aclose()
            third = coord.generate(GenerationRequest("c", [1, 2], GREEDY, 200))
            assert (await third.__anext__()).token_id >= 0
            await third.aclose()
        finally:
            await coord.close()

    asyncio.run(main())
    assert asyncio.run(wait_kv_empty(workers)) == dict.fromkeys(workers, 0)


def test_starts_without_an_unreachable_worker_when_the_rest_cover(workers, demo_model, reference,
                                                                   prompts):
    from helixserve.local.launch import free_port
    from helixserve.spec import ClusterSpec, NodeSpec

    even = [workers[n] for n in ("n0", "n1", "n2")]
    cluster = make_cluster(even)
    cluster = ClusterSpec(name="t", nodes=[*cluster.nodes,
                                           NodeSpec("ghost", "L4", address=f"127.0.0.1:{free_port()}")])
    placement = make_placement(
        [("n0", 0, 10), ("n1", 10, 20), ("n2", 20, 30), ("ghost", 0, 25)],
        [("coordinator", "n0", 1), ("coordinator", "ghost", 1), ("n0", "n1", 1),
         ("n1", "n2", 1), ("ghost", "n2", 1), ("n2", "coordinator", 2)],
    )

    async def main() -> tuple[list[int], dict[str, Any]]:
        coord = await Coordinator.create(cluster, placement, demo_model,
                                         CoordinatorConfig(connect_timeout_s=1.0))
        try:
            ids = [ev.token_id async for ev in coord.generate(
                GenerationRequest("g", prompts[0], GREEDY, MAX_TOKENS, ignore_eos=True))]
            return ids, coord.stats()
        finally:
            await coord.close()

    ids, stats = asyncio.run(main())
    assert ids == reference[0]
    assert stats.nodes["ghost"].alive is False
    assert stats.routes == {"n0->n1->n2": 1}


def test_workers_free_the_kv_of_a_coordinator_that_vanished(workers, demo_model, prompts):
    even = {n: workers[n] for n in ("n0", "n1", "n2")}

    async def main() -> tuple[dict[str, int], dict[str, int]]:
        coord = await Coordinator.create(make_cluster(list(even.values())), even_placement(),
                                         demo_model)
        gen = coord.generate(GenerationRequest("orphan", prompts[1], GREEDY, 500, ignore_eos=True))
        for _ in range(3):
            await gen.__anext__()
        during = {n: i.kv_used_blocks for n, i in (await worker_infos(even)).items()}
        # The coordinator "crashes": its streams drop and no Release is ever sent.
        coord.active.clear()
        for node in coord.nodes.values():
            await node.close()
        after = await wait_kv_empty(even)
        await gen.aclose()
        await coord.close()
        return during, after

    during, after = asyncio.run(main())
    assert all(v > 0 for v in during.values()), during
    assert after == {"n0": 0, "n1": 0, "n2": 0}


def test_logprobs_come_back_only_when_asked(workers, demo_model, prompts):
    even = [workers[n] for n in ("n0", "n1", "n2")]

    async def main() -> tuple[list[Any], list[Any]]:
        coord = await Coordinator.create(make_cluster(even), even_placement(), demo_model)
        try:
            asked = [ev async for ev in coord.generate(GenerationRequest(
                "lp", prompts[0], SamplingParams(temperature=0.0, logprobs=2), 3))]
            plain = [ev async for ev in coord.generate(GenerationRequest("nolp", prompts[0], GREEDY, 3))]
            return asked, plain
        finally:
            await coord.close()

    asked, plain = asyncio.run(main())
    for ev in asked:
        assert ev.logprob is not None and ev.logprob <= 0.0
        assert len(ev.top_logprobs) == 2
        assert ev.top_logprobs[0][0] == ev.token_id  # greedy picks the most likely token
    assert all(ev.logprob is None and not ev.top_logprobs for ev in plain)


def test_placement_without_flows_is_evaluated_then_served(workers, demo_model, prompts):
    """FORMATS.md lets an input placement omit `flows`: the coordinator computes them."""
    even = [workers[n] for n in ("n0", "n1", "n2")]
    placement = even_placement()
    placement.flows = []

    async def main() -> list[int]:
        coord = await Coordinator.create(make_cluster(even), placement, demo_model)
        try:
            return [ev.token_id async for ev in coord.generate(
                GenerationRequest("noflows", prompts[0], GREEDY, 4))]
        finally:
            await coord.close()

    tokens = asyncio.run(main())
    assert len(tokens) == 4
    assert placement.flows and placement.throughput_tokens_per_s
    assert {(f.src, f.dst) for f in placement.flows} == {
        ("coordinator", "n0"), ("n0", "n1"), ("n1", "n2"), ("n2", "coordinator")}


def test_min_tokens_masks_eos_on_the_last_hop(workers, demo_model, prompts):
    """min_tokens travels with the sampling params: EOS cannot end the request early."""
    even = [workers[n] for n in ("n0", "n1", "n2")]
    short = prompts[QUESTIONS.index("Say hello.")]

    async def run(min_tokens: int) -> list[Any]:
        coord = await Coordinator.create(make_cluster(even), even_placement(), demo_model)
        try:
            return [ev async for ev in coord.generate(GenerationRequest(
                f"min{min_tokens}", short, GREEDY, 48, min_tokens=min_tokens))]
        finally:
            await coord.close()

    free = asyncio.run(run(0))
    assert free[-1].finish_reason == "stop" and len(free) < 40, "prompt should end by itself"
    forced = asyncio.run(run(len(free) + 3))
    assert len(forced) >= len(free) + 3
    # identical greedy tokens up to where EOS was sampled before
    assert [e.token_id for e in forced[: len(free) - 1]] == [e.token_id for e in free[:-1]]
