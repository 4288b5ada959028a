"""Structured output: validity over varied JSON schemas, and what the grammar costs in decode.

On the demo model (SmolLM2-135M-Instruct), one torch engine holding all 30 layers, in this
process (the constraint runs on the last stage only: the engine alone is where its share of a
step is largest; the runtime's per-hop costs would only dilute it).

1. Validity: `--schemas` JSON schemas (default 50) drawn from a fixed seed: nested objects,
   arrays of strings, numbers and objects (with minItems / maxItems), enums, required and
   optional fields, `additionalProperties: false`, anyOf, nullable fields, and the string
   formats email, date, date-time, time, uuid, ipv4, uri, plus patterns and length bounds.
   Each is asked for greedily (`--streams` requests at a time), the prompt naming the topic
   and the fields, up to `--max-tokens`; the output must end on EOS (not be cut by max_tokens), parse as
   JSON, and validate (`jsonschema` draft 2020-12, numbers read as decimals, with its format
   checker and RFC 3339 `time` / `date-time`).
2. Decode throughput at `--streams` streams: the same prompts, prefilled, then
   `--decode-steps` decode steps of all streams at once, unconstrained vs each stream under a
   JSON schema that does not end within the steps (an array of objects). Rounds alternate the
   two (`--rounds`), so a shared machine's drift hits both; the median of each is reported,
   and the cost is 1 - constrained / unconstrained tokens per second, and the extra CPU time
   of this process per output token (which other jobs on the machine disturb less). Also the
   sampler alone: sample_rows over fixed logits [streams, vocab], constrained vs not (ms per
   step), and the first run of the schema, timed apart (module code: cold lexer states).

    python -m benchmarks.structured --json benchmarks/results/structured.json
"""

from __future__ import annotations

import argparse
import datetime
import decimal
import json
import os
import platform
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EOS_FALLBACK = 2

# ---- the schemas ---------------------------------------------------------------------------

_ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string", "maxLength": 40},
    "city": {"type": "string", "maxLength": 30},
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["street", "city"], "additionalProperties": False}
_ITEM = {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
    "price": {"type": "number", "minimum": 0, "maximum": 100000, "multipleOf": 0.01}},
    "required": ["sku", "qty"], "additionalProperties": False}

#: name -> a property's schema; each generated schema picks a few
FIELDS: dict[str, dict[str, Any]] = {
    "name": {"type": "string", "minLength": 1, "maxLength": 30},
    "title": {"type": "string", "maxLength": 60},
    "email": {"type": "string", "format": "email", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "score": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.1},
    "active": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 4},
    "status": {"type": "string", "enum": ["active", "inactive", "pending"]},
    "priority": {"type": "integer", "enum": [1, 2, 3]},
    "created": {"type": "string", "format": "date"},
    "updated_at": {"type": "string", "format": "date-time", "maxLength": 32},
    "opens_at": {"type": "string", "format": "time", "maxLength": 20},
    "id": {"type": "string", "format": "uuid"},
    "ip": {"type": "string", "format": "ipv4"},
    "website": {"type": "string", "format": "uri", "maxLength": 60},
    "address": _ADDRESS,
    "items": {"type": "array", "items": _ITEM, "minItems": 1, "maxItems": 3},
    "coords": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.0001}},
    "nickname": {"type": ["string", "null"], "maxLength": 20},
    "contact": {"anyOf": [{"type": "string", "format": "email", "maxLength": 40},
                          {"type": "string", "pattern": "^\\+[0-9]{8,12}$"}]},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "color": {"type": "string", "enum": ["red", "green", "blue", "black"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 1000000},
    "notes": {"type": "string", "maxLength": 80},
}
TOPICS = ["a customer", "a product order", "a library book", "a city", "a web server",
          "a movie", "an employee", "a weather report", "a restaurant", "a bank transfer"]


def make_schemas(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n varied schemas, the same for a seed: objects of 2-6 fields, some nested one level
    further, some arrays of objects at the top. Written as OpenAI's strict mode wants them
    (every object closed with additionalProperties: false) and with every free string and
    number bounded (maxLength; minimum, maximum and multipleOf): an open object, string or
    number lets a 135M model ramble on past any max_tokens (it writes one more key, or one
    more digit of a fraction, forever)."""
    rng = random.Random(seed)
    names = sorted(FIELDS)
    out = []
    for i in range(n):
        def obj(k: int) -> dict[str, Any]:
            picked = rng.sample(names, k)
            required = [f for f in picked if rng.random() < 0.7] or picked[:1]
            return {"type": "object", "properties": {f: FIELDS[f] for f in picked},
                    "required": required, "additionalProperties": False}

        shape = i % 5
        if shape == 3:  # nested: an object holding an object and a list of them
            inner = obj(rng.randint(2, 3))
            schema = {"type": "object", "properties": {
                "record": inner,
                "related": {"type": "array", "items": obj(2), "maxItems": 2},
                "kind": {"type": "string", "enum": ["x", "y"]}},
                "required": ["record", "kind"], "additionalProperties": False}
        elif shape == 4:  # a top-level array
            schema = {"type": "array", "items": obj(rng.randint(2, 3)), "minItems": 1,
                      "maxItems": 3}
        else:
            schema = obj(rng.randint(2, 6))
        schema["title"] = TOPICS[i % len(TOPICS)]
        out.append(schema)
    return out


# ---- a small batched greedy loop over one engine ---------------------------------------------


@dataclass
class Stream:
    rid: str
    prompt: list[int]
    params: Any  # SamplingParams
    out: list[int] = field(default_factory=list)
    done: bool = False


def _step(engine: Any, streams: list[Stream]) -> None:
    """One engine step: prefill the new streams, decode the others (all batched)."""
    from helixserve.engine.protocol import WorkItem

    n = engine.num_model_layers
    items = []
    for s in streams:
        if not s.out:
            items.append(WorkItem(s.rid, 0, n, 0, s.prompt, None, s.params))
        else:
            items.append(WorkItem(s.rid, 0, n, len(s.prompt) + len(s.out) - 1, [s.out[-1]],
                                  None, s.params))
    for s, o in zip(streams, engine.step(items), strict=True):
        s.out.append(int(o.token_id))


def generate(engine: Any, streams: list[Stream], max_tokens: int, eos: set[int]) -> None:
    """Greedy until EOS or max_tokens, all streams batched; frees them after."""
    live = list(streams)
    while live:
        _step(engine, live)
        for s in live:
            if s.out[-1] in eos or len(s.out) >= max_tokens:
                s.done = s.out[-1] in eos
                engine.free(s.rid)
        live = [s for s in live if s.out[-1] not in eos and len(s.out) < max_tokens]


def chat_ids(tok: Any, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


# ---- 1. validity -----------------------------------------------------------------------------

_RFC3339_TIME = re.compile(r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?"
                           r"([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")


def _fields_hint(schema: dict[str, Any]) -> str:
    """A short prompt hint (the schema itself would make prompts of ~500 tokens, and the
    grammar, not the prompt, is what this measures)."""
    obj = schema.get("items", schema)
    keys = list(obj.get("properties", {}))
    return f" with the fields {', '.join(keys)}" if keys else ""


def format_checker() -> Any:
    """jsonschema's draft 2020-12 format checker, with RFC 3339 `time` and `date-time`
    (jsonschema checks those only with the optional rfc3339-validator installed)."""
    import jsonschema

    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER

    @checker.checks("time")
    def _time(value: object) -> bool:
        return not isinstance(value, str) or bool(_RFC3339_TIME.fullmatch(value))

    @checker.checks("date-time", raises=ValueError)
    def _date_time(value: object) -> bool:
        if not isinstance(value, str):
            return True
        day, sep, time_ = value.partition(value[10:11] if len(value) > 10 else "T")
        return (sep in ("T", "t", " ") and bool(_RFC3339_TIME.fullmatch(time_))
                and bool(datetime.date.fromisoformat(day)))

    return checker


def validity(engine: Any, tok: Any, n: int, streams: int, max_tokens: int,
             eos: set[int]) -> dict[str, Any]:
    import jsonschema

    from helixserve.request import SamplingParams, StructuredOutput

    schemas = make_schemas(n)
    checker = format_checker()
    results = []
    t0 = time.perf_counter()
    for start in range(0, n, streams):
        batch = []
        for i in range(start, min(n, start + streams)):
            text = f"Give an example of {schemas[i]['title']} as JSON{_fields_hint(schemas[i])}."
            params = SamplingParams(temperature=0.0, structured=StructuredOutput(
                "json", json.dumps(schemas[i])))
            batch.append(Stream(f"v{i}", chat_ids(tok, text), params))
        generate(engine, batch, max_tokens, eos)
        for i, s in enumerate(batch, start):
            body = s.out[:-1] if s.done else s.out
            text = tok.decode(body)
            verdict, why = "valid", ""
            if not s.done:
                verdict, why = "truncated", f"no EOS within {max_tokens} tokens"
            else:
                try:
                    # numbers as decimals (schema and output): multipleOf 0.1 is exact then,
                    # where floats would call 1.2 no multiple of it
                    exact = json.loads(json.dumps(schemas[i]), parse_float=decimal.Decimal)
                    jsonschema.Draft202012Validator(exact, format_checker=checker).validate(
                        json.loads(text, parse_float=decimal.Decimal))
                except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
                    verdict, why = "invalid", str(exc).splitlines()[0]
            results.append({"schema": i, "verdict": verdict, "why": why, "tokens": len(s.out),
                            "output": text})
    valid = sum(r["verdict"] == "valid" for r in results)
    return {"schemas": n, "valid": valid, "valid_pct": 100.0 * valid / n,
            "formats_checked": sorted(checker.checkers),
            "truncated": sum(r["verdict"] == "truncated" for r in results),
            "invalid": sum(r["verdict"] == "invalid" for r in results),
            "mean_tokens": statistics.mean(r["tokens"] for r in results),
            "wall_s": time.perf_counter() - t0, "results": results}


# ---- 2. decode throughput ----------------------------------------------------------------------

#: does not end within the decode steps: a long array of small objects
LONG_SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 200,
    "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "label": {"type": "string", "maxLength": 12},
        "ok": {"type": "boolean"}}, "required": ["id", "label", "ok"],
        "additionalProperties": False}}}, "required": ["rows"]}


def decode_rate(engine: Any, tok: Any, streams: int, steps: int, constrained: bool,
                tag: str) -> tuple[float, float]:
    """(output tokens per second, CPU ms of this process per output token) over `steps`
    decode steps of `streams` streams (after their prefill, which is not timed). CPU time
    is what a loaded machine disturbs less: it does not count the waits for a core."""
    from helixserve.request import SamplingParams, StructuredOutput

    so = StructuredOutput("json", json.dumps(LONG_SCHEMA)) if constrained else None
    batch = [Stream(f"{tag}{i}", chat_ids(tok, f"Make table {i} as JSON rows."),
                    SamplingParams(temperature=0.0, structured=so)) for i in range(streams)]
    _step(engine, batch)  # prefill (and the first token)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        _step(engine, batch)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    for s in batch:
        engine.free(s.rid)
    return streams * steps / elapsed, 1000.0 * cpu / (streams * steps)


def sampler_ms(streams: int, vocab: int, constrained: bool, steps: int = 30) -> float:
    """sample_rows alone over fixed logits [streams, vocab], greedy; ms per step. The
    constrained rows advance a matcher through a long JSON document token by token."""
    import torch

    from helixserve.engine.history import RequestHistory
    from helixserve.engine.sampling import sample_rows
    from helixserve.request import SamplingParams, StructuredOutput

    so = StructuredOutput("json", json.dumps(LONG_SCHEMA)) if constrained else None
    params = [SamplingParams(temperature=0.0, structured=so) for _ in range(streams)]
    hists = [RequestHistory() for _ in range(streams)]
    logits = torch.randn(streams, vocab, generator=torch.Generator().manual_seed(0))
    sample_rows(logits, params, hists)  # builds the matchers (not timed)
    t0 = time.perf_counter()
    for _ in range(steps):
        for h, r in zip(hists, sample_rows(logits, params, hists), strict=True):
            h.add_tokens([r.token_id], generated=True)
    return 1000.0 * (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", type=int, default=50)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--skip-validity", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from helixserve.engine import ShardEngine, prepare_demo_model

    torch.set_num_threads(args.threads)
    model = prepare_demo_model()
    tok = AutoTokenizer.from_pretrained(str(model))
    engine = ShardEngine.load(model, 0, 30, kv_cache_bytes=512 << 20)
    eos = set(engine.eos_token_ids) or {EOS_FALLBACK}
    out: dict[str, Any] = {"model": str(model), "engine": "torch", "device": "cpu",
                           "threads": args.threads, "machine": platform.node(),
                           "load_avg_before": os.getloadavg()}

    if not args.skip_validity:
        v = validity(engine, tok, args.schemas, args.streams, args.max_tokens, eos)
        out["validity"] = v
        print(f"validity: {v['valid']}/{v['schemas']} valid ({v['valid_pct']:.0f}%), "
              f"{v['truncated']} cut by max_tokens, {v['invalid']} invalid; "
              f"{v['mean_tokens']:.0f} tokens on average, {v['wall_s']:.0f} s")
        for r in v["results"]:
            if r["verdict"] != "valid":
                print(f"  schema {r['schema']}: {r['verdict']}: {r['why']}: {r['output'][:120]!r}")

    rates: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    cpu_ms: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    # the first run of a schema is slower: llguidance builds its lexer states as the
    # document first reaches them (kept for the next requests); timed apart, not in the rounds
    cold, _ = decode_rate(engine, tok, args.streams, args.decode_steps, True, "cold")
    for r in range(args.rounds):
        for mode in (("unconstrained", "constrained") if r % 2 == 0
                     else ("constrained", "unconstrained")):
            rate, ms = decode_rate(engine, tok, args.streams, args.decode_steps,
                                   mode == "constrained", f"t{r}{mode[0]}")
            rates[mode].append(rate)
            cpu_ms[mode].append(ms)
    free_ms = [sampler_ms(args.streams, engine.vocab_size, False) for _ in range(3)]
    grammar_ms = [sampler_ms(args.streams, engine.vocab_size, True) for _ in range(3)]
    med = {k: statistics.median(v) for k, v in rates.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu_ms.items()}
    cost = 1.0 - med["constrained"] / med["unconstrained"]
    cpu_cost = med_cpu["constrained"] / med_cpu["unconstrained"] - 1.0
    out["throughput"] = {"streams": args.streams, "decode_steps": args.decode_steps,
                         "rounds": rates, "median_tokens_per_s": med, "cost_pct": 100 * cost,
                         "cpu_ms_per_token_rounds": cpu_ms, "median_cpu_ms_per_token": med_cpu,
                         "cpu_cost_pct": 100 * cpu_cost, "first_run_tokens_per_s": cold,
                         "sampler_ms_per_step": {"unconstrained": statistics.median(free_ms),
                                                 "constrained": statistics.median(grammar_ms)}}
    out["load_avg_after"] = os.getloadavg()
    print(f"\n{'decode, ' + str(args.streams) + ' streams':<20}{'tok/s (median)':>16}"
          f"{'CPU ms/token (median)':>24}   rounds (tok/s)")
    for k in ("unconstrained", "constrained"):
        print(f"{k:<20}{med[k]:>16.1f}{med_cpu[k]:>24.2f}   "
              f"{'  '.join(f'{x:.1f}' for x in rates[k])}")
    print(f"{'cost of the grammar':<20}{100 * cost:>15.1f}%{100 * cpu_cost:>23.1f}%")
    print(f"first run of the schema (cold lexer states): {cold:.1f} tok/s")
    s = out["throughput"]["sampler_ms_per_step"]
    print(f"sampler alone, {args.streams} rows: {s['unconstrained']:.2f} ms/step free, "
          f"{s['constrained']:.2f} ms/step constrained")
    print(f"load average before / after: {out['load_avg_before']} / {out['load_avg_after']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
