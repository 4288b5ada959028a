"""The emulated cluster rig: real workers made unequal and far apart on one host.

See docs/rig.md. Modules: clusters (definitions, cluster YAML, GPU catalog), speed
(--slowdown or cgroup quotas), proxy (per-link bandwidth and latency), stack (processes),
measure (profiles, workloads, measured and simulated metrics), run (the benchmark loop),
table (the printed table).
"""
