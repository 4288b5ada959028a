"""The emulated engine (engine/emulated.py): a step takes the cost model's time for the GPU,
the layers and the batch; its paged KV is the memory model's and runs out as the torch
engine's does (KvExhaustedError, nothing changed); tokens are a deterministic function of
the prompt and the position; activations are the model's real size. Times are checked as the
durations the engine computes and reports, never as wall-clock bounds; steps that sleep run
at a tiny time scale."""

from __future__ import annotations

from pathlib import Path

import pytest

from helixserve.costmodel import CostModel
from helixserve.engine.emulated import EmulatedEngine, EmulationSpec, ZeroHidden
from helixserve.engine.emulated_tokenizer import EmulatedTokenizer, has_tokenizer
from helixserve.engine.errors import InvalidWorkError, KvExhaustedError
from helixserve.engine.protocol import Engine, RawHidden, WorkItem
from helixserve.errors import UserError
from helixserve.request import SamplingParams
from helixserve.spec import NodeSpec, load_gpu_catalog, load_model, load_profiles

SHARED = Path(__file__).resolve().parents[2] / "data" / "shared"
MODEL = SHARED / "models" / "llama-2-70b"  # config.json only
PROFILES = SHARED / "profiles" / "helix-measured.csv"
ROW_BYTES = 8192 * 2  # hidden_size x fp16
#: steps that sleep do so for this share of their emulated time
FAST = 1e-4
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def profiles():
    return load_profiles(PROFILES)


def engine(profiles, start: int, end: int, gpu: str = "L4", time_scale: float = FAST,
           **kw) -> EmulatedEngine:
    spec = EmulationSpec(gpu, profiles, time_scale=time_scale)
    return EmulatedEngine.load(MODEL, start, end, spec, **kw)


def cost(profiles) -> CostModel:
    return CostModel(load_model(MODEL), profiles, load_gpu_catalog(), reserved_gb_per_gpu=4.5)


def hidden(n: int) -> RawHidden:
    return RawHidden("float16", (n, 8192), bytes(n * ROW_BYTES))


def decode_items(n: int, start: int, end: int, position: int = 40) -> list[WorkItem]:
    h = hidden(1) if start > 0 else None
    return [WorkItem(f"r{i}", start, end, position, [7], h, GREEDY) for i in range(n)]


def test_is_an_engine(profiles):
    assert isinstance(engine(profiles, 0, 10), Engine)


def test_step_time_is_the_cost_models_for_the_gpu_layers_and_batch(profiles):
    e, c, l4 = engine(profiles, 0, 10), cost(profiles), NodeSpec("x", "L4")
    for d in (1, 8, 32):
        want = 10 * c.layer_time_ms("L4", 1, 0, d) / 1000
        assert e.step_time_s(decode_items(d, 0, 10)) == pytest.approx(want)
    prefill = [WorkItem("p", 0, 10, 0, list(range(300)), None, None)]
    assert e.step_time_s(prefill) == pytest.approx(c.batch_time_s(l4, 10, 300, 0))
    mixed = prefill + decode_items(8, 0, 10)
    assert e.step_time_s(mixed) == pytest.approx(c.batch_time_s(l4, 10, 300, 8))
    # batching pays: 32 decode sequences in one step cost far less than 32 steps of one
    ratio = e.step_time_s(decode_items(32, 0, 10)) / e.step_time_s(decode_items(1, 0, 10))
    assert ratio == pytest.approx(c.layer_time_ms("L4", 1, 0, 32) / c.layer_time_ms("L4", 1, 0, 1))
    assert ratio < 4
    # another GPU, other times: the A100's own curve
    a100 = engine(profiles, 0, 10, gpu="A100-40GB")
    assert a100.step_time_s(decode_items(8, 0, 10)) == pytest.approx(
        10 * c.layer_time_ms("A100-40GB", 1, 0, 8) / 1000)


def test_partial_inference_and_the_head_are_timed_as_the_simulator_does(profiles):
    e, c, l4 = engine(profiles, 70, 80), cost(profiles), NodeSpec("x", "L4")
    items = [WorkItem("a", 70, 80, 40, [7], hidden(1), GREEDY),
             WorkItem("b", 73, 80, 40, [7], hidden(1), GREEDY)]
    # layers 70-72 run one sequence, 73-79 two; the head samples two rows
    want = (c.batch_time_s(l4, 3, 0, 1) + c.batch_time_s(l4, 7, 0, 2)
            + c.head_time_s(l4, "decode", 2))
    assert e.step_time_s(items) == pytest.approx(want)
    # a non-final prompt chunk samples nothing: no head
    chunk = [WorkItem("p", 70, 80, 0, [5] * 300, hidden(300), GREEDY, sample=False)]
    assert e.step_time_s(chunk) == pytest.approx(c.batch_time_s(l4, 10, 300, 0))


def test_a_step_reports_the_time_it_emulated_times_the_scale(profiles):
    e = engine(profiles, 0, 10)
    items = [WorkItem("p", 0, 10, 0, list(range(100)), None, None)]
    expected = e.step_time_s(items)
    e.step(items)
    for pos in range(100, 103):
        e.step([WorkItem("p", 0, 10, pos, [3], None, None)])
    expected += 3 * e.step_time_s(decode_items(1, 0, 10))
    r = e.report()
    assert (r.steps, r.prompt_tokens, r.decode_tokens) == (4, 100, 3)
    assert r.emulated_s == pytest.approx(expected * FAST)


def test_kv_is_the_memory_models_and_grows_by_blocks(profiles):
    e, c = engine(profiles, 0, 10), cost(profiles)
    stats = e.kv_stats()
    assert stats["block_size"] == 16
    assert stats["total_blocks"] == c.kv_capacity_tokens(NodeSpec("x", "L4"), 10) // 16 > 0
    # more layers loaded, less room for KV
    assert engine(profiles, 0, 11).kv_stats()["total_blocks"] < stats["total_blocks"]
    e.step([WorkItem("g", 0, 10, 0, list(range(17)), None, None)])
    assert e.kv_stats()["used_blocks"] == 2 and e.seq_len("g") == 17
    for pos in range(17, 33):
        e.step([WorkItem("g", 0, 10, pos, [5], None, None)])
    assert e.kv_stats()["used_blocks"] == 3
    e.free("g")
    e.free("g")  # idempotent
    assert e.kv_stats()["used_blocks"] == 0 and e.seq_len("g") == 0


def test_a_step_beyond_the_kv_raises_the_typed_error_and_changes_nothing(profiles):
    per_block = 10 * load_model(MODEL).kv_bytes_per_token_per_layer * 16
    e = engine(profiles, 0, 10, kv_cache_bytes=6 * per_block)
    assert e.kv_stats()["total_blocks"] == 6
    e.step([WorkItem("keep", 0, 10, 0, list(range(37)), None, None)])  # 3 blocks
    before, steps = e.kv_stats(), e.report().steps
    with pytest.raises(KvExhaustedError) as err:
        e.step([WorkItem("keep", 0, 10, 37, [1], None, None),
                WorkItem("big", 0, 10, 0, [3] * 60, None, None)])  # 4 more blocks > 3 free
    assert (err.value.needed_blocks, err.value.free_blocks) == (4, 3)
    assert e.kv_stats() == before and e.seq_len("keep") == 37 and not e.seq_len("big")
    assert e.report().steps == steps  # a refused step takes no emulated time
    e.step([WorkItem("keep", 0, 10, 37, [1], None, None)])  # and the survivor goes on
    assert e.seq_len("keep") == 38


def test_kv_fits_says_what_a_step_would_find_without_changing_anything(profiles):
    per_block = 10 * load_model(MODEL).kv_bytes_per_token_per_layer * 16
    e = engine(profiles, 0, 10, kv_cache_bytes=6 * per_block)
    e.step([WorkItem("keep", 0, 10, 0, list(range(37)), None, None)])  # 3 of 6 blocks
    grow = WorkItem("keep", 0, 10, 37, [1], None, None)  # fits in its third block
    big = WorkItem("big", 0, 10, 0, [3] * 60, None, None)  # 4 blocks
    small = WorkItem("small", 0, 10, 0, [3] * 40, None, None)  # 3 blocks
    before = e.kv_stats()
    assert e.kv_fits([grow, small]) and not e.kv_fits([grow, big])
    assert not e.kv_fits([grow, small, WorkItem("more", 0, 10, 0, [1], None, None)])
    assert e.kv_stats() == before and not e.seq_len("small")
    with pytest.raises(KvExhaustedError):
        e.step([grow, big])
    e.step([grow, small])  # what kv_fits said fits, fits
    assert e.kv_stats()["used_blocks"] == 6


def test_the_worker_maps_typed_errors_to_wire_codes():
    from helixserve.runtime import transport as tp
    from helixserve.runtime.worker import engine_error_status

    assert engine_error_status(KvExhaustedError("full")) == tp.RESOURCE_EXHAUSTED
    assert engine_error_status(InvalidWorkError("bad")) == tp.INVALID_ARGUMENT
    assert engine_error_status(RuntimeError("bug")) == tp.INTERNAL


def test_bad_items_are_refused_with_the_typed_error(profiles):
    e = engine(profiles, 10, 20)
    with pytest.raises(InvalidWorkError, match="not inside"):
        e.step([WorkItem("a", 0, 20, 0, [1], None, None)])
    with pytest.raises(InvalidWorkError, match="needs hidden"):
        e.step([WorkItem("a", 10, 20, 0, [1, 2], hidden(1), None)])
    with pytest.raises(InvalidWorkError, match="a step was skipped"):
        e.step([WorkItem("a", 10, 20, 5, [1], hidden(1), None)])


def test_activations_have_the_models_real_size_and_pass_on(profiles):
    first, middle = engine(profiles, 0, 10), engine(profiles, 10, 20)
    (out,) = first.step([WorkItem("a", 0, 10, 0, list(range(5)), None, None)])
    assert isinstance(out.hidden, RawHidden)
    assert out.hidden.shape == (5, 8192) and len(out.hidden.data) == 5 * ROW_BYTES
    (nxt,) = middle.step([WorkItem("a", 10, 20, 0, list(range(5)), out.hidden, None)])
    assert nxt.hidden.shape == (5, 8192) and nxt.hidden.data == bytes(5 * ROW_BYTES)


def test_queued_input_keeps_only_its_size_and_the_output_keeps_the_real_one(profiles):
    middle = engine(profiles, 10, 20)
    came = RawHidden("bfloat16", (3, 8192), bytes(3 * ROW_BYTES))
    kept = middle.compact_input(came)
    assert isinstance(kept, ZeroHidden) and kept.nbytes == 3 * ROW_BYTES  # no bytes held
    assert kept.shape == (3, 8192) and kept.dtype == "bfloat16"
    (out,) = middle.step([WorkItem("a", 10, 20, 0, [1, 2, 3], kept, None)])
    assert out.hidden.dtype == "bfloat16" and out.hidden.shape == (3, 8192)
    assert len(out.hidden.data) == 3 * ROW_BYTES  # the real size leaves for the next hop


def payload_engine(profiles, start: int, end: int, payload: int | None) -> EmulatedEngine:
    spec = EmulationSpec("L4", profiles, time_scale=FAST, payload_bytes_per_token=payload)
    return EmulatedEngine.load(MODEL, start, end, spec)


def test_a_smaller_payload_keeps_the_real_size_and_says_what_it_left_out(profiles):
    first, middle = payload_engine(profiles, 0, 10, 64), payload_engine(profiles, 10, 20, 64)
    (out,) = first.step([WorkItem("a", 0, 10, 0, list(range(5)), None, None)])
    h = out.hidden
    assert isinstance(h, ZeroHidden) and h.shape == (5, 8192) and h.dtype == "float16"
    assert h.nbytes == 5 * ROW_BYTES  # what the worker batches by, as real activations
    assert h.data == bytes(5 * 64) and h.unsent_nbytes == 5 * (ROW_BYTES - 64)
    # the next stage takes the payload as it came (transport checked it), keeps its real size
    came = RawHidden("float16", (5, 8192), h.data)
    kept = middle.compact_input(came)
    assert kept.nbytes == 5 * ROW_BYTES and kept.payload_nbytes == 5 * 64
    (nxt,) = middle.step([WorkItem("a", 10, 20, 0, list(range(5)), kept, None)])
    assert len(nxt.hidden.data) == 5 * 64 and nxt.hidden.unsent_nbytes == 5 * (ROW_BYTES - 64)
    assert "sent as 64 bytes a token" in middle.describe()
    # the real size: nothing left out; a payload at least a row is the real size too
    for payload in (None, ROW_BYTES, 10 * ROW_BYTES):
        (real,) = payload_engine(profiles, 0, 10, payload).step(
            [WorkItem("b", 0, 10, 0, [1, 2], None, None)])
        assert len(real.hidden.data) == 2 * ROW_BYTES and real.hidden.unsent_nbytes == 0
    with pytest.raises(UserError, match="--emulated-payload-bytes-per-token: bad value 0"):
        payload_engine(profiles, 0, 10, 0)


def run_tokens(e: EmulatedEngine, rid: str, prompt: list[int], n: int,
               params: SamplingParams = GREEDY, chunk: int = 512) -> list[int]:
    out = None
    for a in range(0, len(prompt), chunk):
        part = prompt[a : a + chunk]
        (out,) = e.step([WorkItem(rid, 70, 80, a, part, hidden(len(part)), params,
                                  sample=a + chunk >= len(prompt))])
    assert out is not None and out.token_id is not None
    tokens = [out.token_id]
    while len(tokens) < n:
        pos = len(prompt) + len(tokens) - 1
        (out,) = e.step([WorkItem(rid, 70, 80, pos, [tokens[-1]], hidden(1), params)])
        assert out.token_id is not None
        tokens.append(out.token_id)
    return tokens


def test_tokens_are_a_function_of_the_prompt_and_position(profiles):
    a, b = engine(profiles, 70, 80), engine(profiles, 70, 80)
    prompt = list(range(100, 140))
    tokens = run_tokens(a, "x", prompt, 12)
    assert run_tokens(b, "another-id", prompt, 12, chunk=16) == tokens  # any id, any chunks
    assert run_tokens(a, "y", prompt[:-1] + [5], 12) != tokens
    assert all(0 <= t < 32000 and t not in (1, 2) for t in tokens)  # never BOS or EOS
    assert len(set(tokens)) > 6
    # a re-prefill of prompt + output (after a preemption) goes on with the same tokens
    (out,) = b.step([WorkItem("z", 70, 80, 0, prompt + tokens[:5], hidden(45), GREEDY,
                              num_prompt_tokens=len(prompt))])
    assert out.token_id == tokens[5]


def test_logit_bias_forces_or_bans_tokens_after_min_tokens(profiles):
    e = engine(profiles, 70, 80)
    prompt = list(range(10, 30))
    plain = run_tokens(e, "p", prompt, 4)
    eos = SamplingParams(logit_bias=((2, 100.0),), min_tokens=2, stop_token_ids=(2,))
    assert run_tokens(e, "q", prompt, 4, eos)[1:] == [plain[1], 2, 2]
    ban = SamplingParams(logit_bias=((plain[0], -100.0),))
    assert run_tokens(e, "r", prompt, 1, ban)[0] != plain[0]
    asked = run_tokens(e, "s", prompt, 1, SamplingParams(logprobs=2))
    assert asked == plain[:1]


def test_config_errors_name_the_flag_and_value(profiles, tmp_path):
    from helixserve.errors import UserError

    with pytest.raises(UserError, match=r"--gpu: 'H100-80GB' .*profiled: A100-40GB x1"):
        engine(profiles, 0, 10, gpu="H100-80GB")
    with pytest.raises(UserError, match=r"--model: .*config.json: no such file"):
        EmulatedEngine.load(tmp_path, 0, 10, EmulationSpec("L4", profiles))
    with pytest.raises(UserError, match=r"--layers 0:40: L4 x1 has no room for one KV block"):
        engine(profiles, 0, 40)


def test_emulated_tokenizer_for_a_config_only_directory(tmp_path):
    assert not has_tokenizer(MODEL)
    tok = EmulatedTokenizer.from_model_dir(MODEL)
    assert tok.vocab_size == 32000 and tok.eos_token_id == 2
    ids = tok.encode("the cat sat on the mat")
    assert len(ids) == 7 and ids[0] == 1 and ids[1] == ids[5]  # BOS + one token a word
    assert tok.encode(tok.decode([5, 31999]), add_special_tokens=False) == [5, 31999]
    assert tok.decode([5, 2, 6], skip_special_tokens=True) == " tok5 tok6"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == "user: hi\nassistant:"
    (tmp_path / "tokenizer.json").write_text("{}")
    assert has_tokenizer(tmp_path)


def test_emulated_tokenizer_remembers_pieces_without_changing_ids(monkeypatch):
    import helixserve.engine.emulated_tokenizer as et

    text = "the averyveryverylongword tok77 the cat averyveryverylongword"
    fresh = [1] + [EmulatedTokenizer(32000).piece_id(p) for p in
                   ("the", "averyver", "yverylon", "gword", "tok77", "the", "cat",
                    "averyver", "yverylon", "gword")]
    tok = EmulatedTokenizer(32000)
    assert tok.encode(text) == fresh and tok.encode(text) == fresh  # cold, then remembered
    monkeypatch.setattr(et, "_KNOWN_PIECES", 3)  # a full table starts again, same ids
    small = EmulatedTokenizer(32000)
    assert small.encode(text) == fresh and len(small._ids) <= 3


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--profiles", "{profiles}"], "--gpu: required with --engine emulated"),
        (["--gpu", "L4"], "--profiles: required with --engine emulated"),
        (["--gpu", "H100-80GB", "--profiles", "{profiles}"],
         "--gpu: 'H100-80GB' x1 has no prompt and decode rows for 'llama-2-70b' in --profiles"),
        (["--gpu", "L4", "--num-gpus", "4", "--profiles", "{profiles}"],
         "--gpu: 'L4' x4 has no prompt and decode rows"),
        (["--gpu", "L4", "--profiles", "{tmp}/none.csv"], "--profiles: {tmp}/none.csv"),
        (["--gpu", "L4", "--profiles", "{profiles}", "--model", "{tmp}"],
         "--model: {tmp}/config.json: no such file"),
        (["--gpu", "L4", "--profiles", "{profiles}", "--layers", "0:40"],
         "--layers 0:40: L4 x1 has no room for one KV block"),
        (["--gpu", "L4", "--profiles", "{profiles}", "--slowdown", "2"],
         "--slowdown: not with --engine emulated"),
        (["--gpu", "L4", "--profiles", "{profiles}", "--time-scale", "0"],
         "--time-scale: bad value 0.0"),
        (["--engine", "torch", "--gpu", "L4"], "--gpu: only with --engine emulated"),
    ],
)
def test_worker_flags_exit_2_with_one_line(tmp_path, capsys, argv, needle):
    from helixserve.cli import main

    argv = [a.format(profiles=PROFILES, tmp=tmp_path) for a in argv]
    if "--engine" not in argv:
        argv = ["--engine", "emulated", *argv]
    if "--model" not in argv:
        argv += ["--model", str(MODEL)]
    if "--layers" not in argv:
        argv += ["--layers", "0:10"]
    assert main(["worker", *argv, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle.format(tmp=tmp_path) in err and len(err.splitlines()) == 1, err


def test_registry_builds_it_by_name_and_weight_commands_refuse_it(profiles):
    from helixserve.engine.registry import ENGINE_CHOICES, load_engine, resolve_engine
    from helixserve.errors import UserError

    assert "emulated" in ENGINE_CHOICES and resolve_engine("emulated") == "emulated"
    with pytest.raises(UserError, match="--engine emulated: this command runs the model's weights"):
        resolve_engine("emulated", weights=True)
    e = load_engine("emulated", MODEL, 0, 10, emulation=EmulationSpec("L4", profiles))
    assert e.engine_name == "emulated" and e.dtype == "float16"
    with pytest.raises(UserError, match="needs --gpu and --profiles"):
        load_engine("emulated", MODEL, 0, 10)


def test_a_new_range_live_frees_the_old_kv_first(profiles):
    e = engine(profiles, 0, 10)
    e.step([WorkItem("a", 0, 10, 0, [1, 2, 3], None, None)])
    new = e.with_range(0, 8)  # what the worker's LoadRange does (runtime/worker.py _switch)
    e.release_memory()
    new.allocate_kv(None)
    assert new.kv_stats()["total_blocks"] > engine(profiles, 0, 10).kv_stats()["total_blocks"]
    assert new.kv_stats()["used_blocks"] == 0 and (new.start_layer, new.end_layer) == (0, 8)
    # the machine's report counts the steps of both ranges, each timed for its own range
    new.step([WorkItem("b", 0, 8, 0, [1, 2, 3], None, None)])
    assert new.report().steps == 2 and new.report().prompt_tokens == 6
    assert e.step_time_s([WorkItem("c", 0, 10, 0, [1, 2, 3], None, None)]) > new.step_time_s(
        [WorkItem("c", 0, 8, 0, [1, 2, 3], None, None)])


def test_a_placed_worker_emulates_the_machine_its_cluster_file_names(tmp_path):
    import argparse
    import json

    from helixserve.commands.worker import emulation_from_args

    placement = tmp_path / "p.json"
    placement.write_text(json.dumps({
        "format": "helixserve.placement/v1", "model": "llama-2-70b", "cluster": "c",
        "num_layers": 80, "planner": "test",
        "nodes": [{"name": "n5", "start_layer": 0, "end_layer": 80}]}))
    args = argparse.Namespace(
        gpu=None, num_gpus=None, profiles=PROFILES, gpus=None, gpu_reserve_gb=None,
        time_scale=1.0, slowdown=1.0, device=None, placement=placement, node="n5",
        cluster=SHARED / "clusters" / "helix-single-24.yaml",
        emulated_payload_bytes_per_token="real")
    spec = emulation_from_args(args, "emulated")
    assert (spec.gpu, spec.num_gpus, spec.model_name) == ("L4", 1, "llama-2-70b")
    assert spec.payload_bytes_per_token is None
    args.emulated_payload_bytes_per_token = "64"
    assert emulation_from_args(args, "emulated").payload_bytes_per_token == 64
    args.emulated_payload_bytes_per_token = "0"  # 0 is the real size too
    assert emulation_from_args(args, "emulated").payload_bytes_per_token is None
    args.emulated_payload_bytes_per_token = "-3"
    with pytest.raises(UserError, match="--emulated-payload-bytes-per-token: bad value '-3'"):
        emulation_from_args(args, "emulated")
    args.emulated_payload_bytes_per_token = "real"
    args.gpu = "T4"  # a flag given wins
    assert emulation_from_args(args, "emulated").gpu == "T4"
