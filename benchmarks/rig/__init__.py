"""The emulated cluster rig: real workers made unequal and far apart on one host.

See docs/rig.md. Modules: clusters (definitions, cluster YAML, GPU catalog), speed
(--slowdown or cgroup quotas), stack (processes, with the package's link proxy,
helixserve/rehearse/links.py, for per-link bandwidth and latency), measure (profiles,
workloads, measured and simulated metrics), run (the benchmark loop), table (the printed
table).
"""
