"""Starting a local serving stack (`demo`, `serve` with local workers, the integration tests
and the benchmarks): one package, one way.

`launch` starts `helixserve worker` subprocesses (`WorkerProcesses`), runs the API under
uvicorn in the current loop (`serve_app`) and picks free ports (`free_port`); `stack` prepares
the demo's files and runs coordinator + API (+ local workers) in one process (`run_stack`);
`supervisor` restarts local workers that exit. Only `launch` is imported by a worker itself
(`die_with_parent`), so this file imports nothing.
"""
