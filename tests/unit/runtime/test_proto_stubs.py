"""The committed gRPC stubs are what `python -m helixserve.runtime.gen_proto` makes of proto/helix.proto."""

import pytest

pytest.importorskip("grpc_tools")


def test_committed_stubs_match_a_fresh_generation():
    from helixserve.runtime.gen_proto import stale_files

    assert stale_files() == [], "run: python -m helixserve.runtime.gen_proto"


def test_stale_check_notices_a_changed_proto(tmp_path):
    from helixserve.runtime.gen_proto import PROTO_DIR, PROTO_NAME, generate, normalized

    changed = tmp_path / "proto"
    changed.mkdir()
    text = (PROTO_DIR / PROTO_NAME).read_text()
    (changed / PROTO_NAME).write_text(text.replace("int32 position = 6;", "int64 position = 6;"))
    a, b = tmp_path / "a", tmp_path / "b"
    generate(a)
    generate(b, proto_dir=changed)
    name = "helix_pb2.py"
    assert normalized((a / name).read_text()) != normalized((b / name).read_text())
