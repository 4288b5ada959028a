"""Load generator for any OpenAI-compatible server (`helixserve bench`), like vLLM's `bench serve`.

`datasets` turns a trace or a random spec into `BenchRequest`s (prompt text + output length),
`client` streams them against a server under a request rate and a concurrency cap and times
every streamed chunk, `report` turns the timings into throughput and latency percentiles.
"""
