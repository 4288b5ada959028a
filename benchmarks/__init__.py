"""Benchmark scripts, each answering one question (docs/benchmarks.md); run from the repository
root as modules, `python -m benchmarks.NAME ...`, so they share helpers by import
(`benchmarks.serving_sim`, `benchmarks.rig`, and `helixserve.local` for starting stacks)."""
