"""Regenerate the Python stubs of `proto/helix.proto` into `helixserve/runtime/proto/`.

    python -m helixserve.runtime.gen_proto            # rewrite the committed stubs
    python -m helixserve.runtime.gen_proto --check    # exit 1 if they differ from a fresh build

grpc_tools writes `import helix_pb2` in the service module, which only works with the output
directory on sys.path; we rewrite that one line to a package import. A test
(tests/unit/runtime/test_proto_stubs.py) regenerates into a temporary directory and compares.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto"
OUT_DIR = Path(__file__).resolve().parent / "proto"
PROTO_NAME = "helix.proto"
GENERATED = ("helix_pb2.py", "helix_pb2.pyi", "helix_pb2_grpc.py")
PACKAGE_INIT = '"""Generated from proto/helix.proto by `python -m helixserve.runtime.gen_proto`."""\n'

# Lines that carry the generator's version: they differ between grpcio-tools releases without
# the contract changing, so the staleness check ignores them.
_VERSION_LINE = re.compile(
    r"^(# Protobuf Python Version:.*|GRPC_GENERATED_VERSION = .*|\s*\d+,\s*$|\s*'',\s*$)$"
)


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc (from grpc_tools) on helix.proto; write the three stub files into out_dir."""
    from grpc_tools import protoc  # only needed at generation time

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    argv = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto_dir / PROTO_NAME),
    ]
    code = protoc.main(argv)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(argv)}")
    grpc_file = out_dir / "helix_pb2_grpc.py"
    text = grpc_file.read_text()
    text = text.replace(
        "import helix_pb2 as helix__pb2",
        "from helixserve.runtime.proto import helix_pb2 as helix__pb2",
    )
    grpc_file.write_text(text)
    (out_dir / "__init__.py").write_text(PACKAGE_INIT)
    return [out_dir / name for name in GENERATED]


def normalized(text: str) -> list[str]:
    return [line for line in text.splitlines() if not _VERSION_LINE.match(line)]


def stale_files(out_dir: Path = OUT_DIR) -> list[str]:
    """Names of committed stub files that differ from a fresh generation (versions ignored)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_dir = Path(tmp)
        generate(fresh_dir)
        stale = []
        for name in GENERATED:
            committed = out_dir / name
            if not committed.exists():
                stale.append(name)
                continue
            if normalized(committed.read_text()) != normalized((fresh_dir / name).read_text()):
                stale.append(name)
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale stubs: {', '.join(stale)}; run python -m helixserve.runtime.gen_proto")
            return 1
        print("stubs match proto/helix.proto")
        return 0
    for path in generate(OUT_DIR):
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
