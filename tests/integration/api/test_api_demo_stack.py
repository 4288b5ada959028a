"""The demo stack end to end: real workers, coordinator, API, the real `openai` client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from api_demo_lib import API_KEY, processes_mentioning
from prometheus_client.parser import text_string_to_metric_families

from helixserve.bench.datasets import load_azure_conv
from helixserve.runtime import security
from helixserve.runtime.proto import helix_pb2, helix_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def model_name(demo) -> str:
    return httpx.get(demo.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]


def client(demo) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def worker_infos(demo) -> dict[str, helix_pb2.InfoReply]:
    out = {}
    tls = demo.coordinator_tls()
    for node, address in demo.worker_addresses().items():
        with security.sync_channel(address, tls) as channel:
            out[node] = helix_pb2_grpc.HelixWorkerStub(channel).Info(
                helix_pb2.InfoRequest(), timeout=10
            )
    return out


def test_worker_ports_refuse_clients_without_credentials(demo):
    """The demo runs mutual TLS by default: plaintext, and TLS without a client certificate,
    get nothing from any worker port; the demo's own credentials do."""
    addresses = demo.worker_addresses()
    tls = demo.coordinator_tls()
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=tls.ca_pem)
    refused = 0
    for address in addresses.values():
        for channel in (grpc.insecure_channel(address),
                        grpc.secure_channel(address, no_client_cert)):
            with channel:
                with pytest.raises(grpc.RpcError) as err:
                    helix_pb2_grpc.HelixWorkerStub(channel).Info(helix_pb2.InfoRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                refused += 1
    assert refused == 2 * len(addresses) >= 4
    assert set(worker_infos(demo)) == set(addresses)


def scrape(demo) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(demo.url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def total(samples, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, lab), v in samples.items()
        if n == name and all(dict(lab).get(k) == val for k, val in labels.items())
    )


def test_placement_is_uneven_with_more_than_one_route(demo):
    placement = json.loads((demo.workdir / "placement.json").read_text())
    sizes = [n["end_layer"] - n["start_layer"] for n in placement["nodes"]]
    assert len(sizes) == 3 and len(set(sizes)) > 1
    # more than one route: some node sends (or receives) flow on more than one edge
    flows = [f for f in placement["flows"] if f["tokens_per_s"] > 0]
    out_degree = {f["src"]: sum(1 for g in flows if g["src"] == f["src"]) for f in flows}
    in_degree = {f["dst"]: sum(1 for g in flows if g["dst"] == f["dst"]) for f in flows}
    assert max(out_degree.values()) > 1 or max(in_degree.values()) > 1, flows
    assert "API ready at" in demo.log() and "curl" in demo.log()


def test_chat_capital_of_france_non_streaming(demo):
    resp = client(demo).chat.completions.create(
        model=model_name(demo), messages=FRANCE, max_tokens=32, temperature=0
    )
    assert "Paris" in resp.choices[0].message.content
    assert resp.usage.completion_tokens >= 1
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_capital_of_france_streaming(demo):
    stream = client(demo).chat.completions.create(
        model=model_name(demo),
        messages=FRANCE,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    # exact usage: one content chunk per token at most, and the streamed text matches
    # what the non-streaming greedy answer says
    assert chunks[-1].usage.completion_tokens >= sum(
        1 for c in chunks if c.choices and c.choices[0].delta.content
    )
    same = client(demo).chat.completions.create(
        model=model_name(demo), messages=FRANCE, max_tokens=32, temperature=0
    )
    assert same.choices[0].message.content == text
    assert same.usage.completion_tokens == chunks[-1].usage.completion_tokens


def test_chat_without_max_tokens_is_served_within_a_routes_kv(demo):
    # the context (8,192) is more than any demo route's KV holds: the default max_tokens is
    # capped to what fits instead of the request being refused
    resp = client(demo).chat.completions.create(
        model=model_name(demo), messages=[{"role": "user", "content": "Say hello."}],
        temperature=0,
    )
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.content


def _token_id(demo, text: str) -> int:
    resp = httpx.post(demo.url + "/tokenize", headers=AUTH,
                      json={"prompt": text, "add_special_tokens": False})
    (token_id,) = resp.json()["tokens"]
    return token_id


def test_logit_bias_bans_and_forces_tokens_through_the_workers(demo):
    ask = {"model": model_name(demo), "messages": FRANCE, "max_tokens": 1, "temperature": 0}
    first = client(demo).chat.completions.create(**ask).choices[0].message.content
    banned = client(demo).chat.completions.create(
        **ask, logit_bias={str(_token_id(demo, first)): -100}
    ).choices[0].message.content
    assert banned != first
    paris = _token_id(demo, "Paris")
    forced = client(demo).chat.completions.create(
        **ask, logit_bias={str(paris): 100}, logprobs=True, top_logprobs=1
    ).choices[0]
    assert forced.message.content == "Paris"
    # the logprob is the model's own: forcing an unlikely first token does not make it likely
    assert forced.logprobs.content[0].logprob < -1.0


def _engine_prompt_logprobs(prompt_ids: list[int], top_n: int) -> list:
    """The same prompt scored by one in-process engine holding every layer."""
    import torch

    from helixserve.engine import ShardEngine, WorkItem, prepare_demo_model
    from helixserve.request import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers run beside us
    try:
        engine = ShardEngine.load(prepare_demo_model(), 0, 30, kv_cache_bytes=64 << 20)
        ask = SamplingParams(temperature=0.0, prompt_logprobs=top_n)
        (out,) = engine.step([WorkItem("ref", 0, 30, 0, prompt_ids, None, ask)])
    finally:
        torch.set_num_threads(threads)
    return out.prompt_logprobs


def test_echo_logprobs_score_the_prompt_like_the_engine(demo):
    """More than one 512-token prefill chunk, so a chunk boundary crosses the wire."""
    from transformers import AutoTokenizer

    from helixserve.engine import prepare_demo_model

    tok = AutoTokenizer.from_pretrained(prepare_demo_model())
    text = " ".join(f"Fact {i}: {i} times 7 is {i * 7}, and Paris is in France." for i in range(45))
    ids = tok.encode(text)
    assert 512 < len(ids) < 1500, len(ids)
    resp = client(demo).completions.create(
        model=model_name(demo), prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    scored = lp.token_logprobs[1 : len(ids)]
    assert all(x is not None for x in scored)
    ref = _engine_prompt_logprobs(ids, 2)
    assert scored == pytest.approx([p.logprob for p in ref], abs=2e-3)
    # the repeated pattern is learned: later facts are far more likely than the first
    assert sum(scored[-100:]) > sum(scored[:100]) + 50
    for k in (1, 511, 512, len(ids) - 1):  # around the chunk boundary too
        assert max(lp.top_logprobs[k].values()) == pytest.approx(
            ref[k - 1].top_logprobs[0][1], abs=2e-3
        )
    assert lp.text_offset[1] == len(lp.tokens[0])
    assert all(o >= 0 for o in lp.text_offset) and lp.text_offset == sorted(lp.text_offset)
    assert lp.token_logprobs[len(ids) :] == pytest.approx(
        [max(d.values()) for d in lp.top_logprobs[len(ids) :]], abs=1e-5
    )  # greedy: the generated tokens are the most likely ones

    stream = client(demo).completions.create(
        model=model_name(demo),
        prompt=ids,
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=2,
        stream=True,
    )
    first = next(iter(stream)).choices[0].logprobs
    stream.close()
    assert first.token_logprobs[0] is None
    assert first.token_logprobs[1 : len(ids)] == pytest.approx(scored, abs=1e-5)


def test_concurrent_requests_all_complete(demo):
    import concurrent.futures

    c = client(demo)
    name = model_name(demo)

    def one(i: int) -> int:
        resp = c.completions.create(
            model=name, prompt=f"Count to {i}:", max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return resp.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(6))) == [8] * 6


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        ({"temperature": -1}, AUTH, 400, "invalid_parameter"),
        ({"max_tokens": "x"}, AUTH, 400, "invalid_parameter"),
        ({"model": "no-such-model"}, AUTH, 404, "model_not_found"),
        ({}, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
        ({"messages": [{"role": "user", "content": "hi " * 9000}]}, AUTH, 400,
         "context_length_exceeded"),
    ],
)  # fmt: skip
def test_error_cases_status_and_openai_json(demo, body, headers, status, code):
    payload = {"model": model_name(demo), "messages": FRANCE, "max_tokens": 4, **body}
    resp = httpx.post(demo.url + "/v1/chat/completions", json=payload, headers=headers)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code


def test_disconnect_mid_stream_frees_kv_on_every_worker(demo):
    payload = {
        "model": model_name(demo),
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", demo.url + "/v1/completions", json=payload, headers=AUTH, timeout=60
    ) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
        held = worker_infos(demo)
        # the request holds KV on every worker of its route while it streams
        assert sum(i.kv_used_blocks for i in held.values()) > 0
    deadline = time.monotonic() + 15
    while True:
        infos = worker_infos(demo)
        if all(i.kv_used_blocks == 0 and i.active_requests == 0 for i in infos.values()):
            break
        assert time.monotonic() < deadline, {n: i.kv_used_blocks for n, i in infos.items()}
        time.sleep(0.2)
    # and the coordinator counted it as aborted, not finished
    assert total(scrape(demo), "vllm:request_success_total", finished_reason="abort") >= 1


def test_metrics_names_exposed_and_moving(demo):
    before = scrape(demo)
    resp = client(demo).completions.create(
        model=model_name(demo), prompt="Hello", max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    after = scrape(demo)
    names = {n for n, _ in after}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_success_total",
        "helixserve:node_layers",
        "helixserve:node_queue_length",
        "helixserve:node_batch_size",
        "helixserve:node_kv_cache_usage_perc",
        "helixserve:node_busy_fraction",
        "helixserve:route_hop_requests_total",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:iteration_tokens_total_count",
        "vllm:cache_config_info",
        "helixserve:node_up",
        "helixserve:node_restarts_total",
        "helixserve:replans_total",
        "helixserve:recovery_state",
    ):
        assert name in names, name
    for phase in ("queue", "prefill", "decode"):  # the request above, measured
        name = f"vllm:request_{phase}_time_seconds_count"
        assert total(after, name) == total(before, name) + 1, name
    # the workers count the tokens of every engine step: the 5 generated ones at least (read
    # from the workers every 0.5 s, so the last steps may show up a poll later)
    name = "vllm:iteration_tokens_total_sum"
    deadline = time.monotonic() + 10
    while total(scrape(demo), name) - total(before, name) < 5:
        assert time.monotonic() < deadline, (total(before, name), total(scrape(demo), name))
        time.sleep(0.2)
    assert (
        total(after, "vllm:generation_tokens_total") - total(before, "vllm:generation_tokens_total")
        == 5
    )
    assert (
        total(after, "vllm:prompt_tokens_total") - total(before, "vllm:prompt_tokens_total")
        == resp.usage.prompt_tokens
    )
    assert (
        total(after, "vllm:e2e_request_latency_seconds_count")
        == total(before, "vllm:e2e_request_latency_seconds_count") + 1
    )
    assert (
        total(after, "helixserve:node_layers") == 30 or total(after, "helixserve:node_layers") > 30
    )
    assert total(after, "helixserve:route_hop_requests_total", src="coordinator") >= 1
    # requests so far went over more than one route (the router spreads over the flow)
    routes = {dict(lab)["route"] for (n, lab), v in after.items()
              if n == "helixserve:route_requests_total" and v > 0}  # fmt: skip
    assert len(routes) > 1, routes


TRACE = Path(__file__).resolve().parents[2] / "data" / "shared" / "traces" / "azure-llm-conv-2023.csv"


def test_bench_azure_conv_against_the_stack(demo, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "helixserve", "bench", "--url", demo.url, "--api-key", API_KEY,
        "--dataset", "azure-conv", "--dataset-path", str(TRACE), "--num-prompts", "4", "--max-concurrency", "2",
        "--max-input-len", "64", "--max-output-len", "6", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    # the first 4 trace rows scaled to fit 64 / 6 tokens (ignore_eos forces the lengths)
    expected = [r.output_tokens for r in load_azure_conv(TRACE, 4, 0, 64, 6)]
    assert result["total_output_tokens"] == sum(expected)
    assert result["output_throughput_tokens_per_s"] > 0


def test_z_killing_the_only_holder_of_layers_replans_and_serves_again(demo_to_break):
    """A node whose layers no other node holds is killed (-9) (so on a stack that no `demo`
    test gets after, conftest.py). A request sent right after waits for the re-plan (or the
    supervisor's restart) and is served; /health is 200 again, and /metrics and /health tell
    what happened."""
    demo = demo_to_break
    placement = json.loads((demo.workdir / "placement.json").read_text())
    nodes = placement["nodes"]
    victim = next(
        n["name"]
        for n in nodes
        if any(
            not any(m["start_layer"] <= layer < m["end_layer"] for m in nodes if m is not n)
            for layer in range(n["start_layer"], n["end_layer"])
        )
    )
    pids = processes_mentioning(f"--node {victim} ")
    pids = [p for p in pids if p in processes_mentioning(str(demo.workdir))]
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    t_kill = time.monotonic()
    assert httpx.get(demo.url + "/ready").status_code == 200  # readiness: serves HTTP
    payload = {"model": model_name(demo), "messages": FRANCE, "max_tokens": 8,
               "temperature": 0}  # fmt: skip
    resp = httpx.post(demo.url + "/v1/chat/completions", json=payload, headers=AUTH,
                      timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 8
    deadline = t_kill + 90
    while httpx.get(demo.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, httpx.get(demo.url + "/health").text
        time.sleep(0.5)
    health = httpx.get(demo.url + "/health").json()
    assert health["status"] == "ok"
    assert health["down_events"] >= 1
    # the supervisor restarted the killed worker, or the re-plan moved its layers (or both)
    deadline = time.monotonic() + 90
    while "supervisor: restarted worker " + victim not in demo.log():
        assert time.monotonic() < deadline, demo.log()[-3000:]
        time.sleep(0.5)
    metrics = httpx.get(demo.url + "/metrics").text
    assert f'helixserve:node_restarts_total{{model_name="{model_name(demo)}",node="{victim}"}}' \
        in metrics
    assert "helixserve:replans_total" in metrics and "helixserve:node_down_events_total" in metrics


def test_zz_sigterm_stops_every_process(demo_to_break):
    """SIGTERM the demo; it exits and leaves no worker behind."""
    demo = demo_to_break
    assert len(processes_mentioning(str(demo.workdir))) >= 3  # demo + the live workers
    assert demo.stop() == 0
    deadline = time.monotonic() + 10
    while processes_mentioning(str(demo.workdir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(demo.workdir)) == []
