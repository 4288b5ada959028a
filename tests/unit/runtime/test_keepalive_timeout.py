"""The keepalive ping's timeout (runtime/transport.py, KEEPALIVE_TIMEOUT_S): how long a
ping's ACK may queue behind data before a live peer is declared dead. Both sides use it, it
follows HELIXSERVE_GRPC_KEEPALIVE_TIMEOUT_S (the rehearsal scales it by its time scale), and
the default is gRPC's own 20 s, not the 10 s that closed live streams on slow links."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helixserve.errors import UserError
from helixserve.runtime import transport as tp


def _timeout_ms(options: list) -> int:
    return dict(options)["grpc.keepalive_timeout_ms"]


def test_channels_and_servers_wait_the_timeout_given():
    assert _timeout_ms(tp.channel_options(20.0, 80.0)) == 80_000
    assert _timeout_ms(tp.server_options(20.0, 80.0)) == 80_000
    assert dict(tp.channel_options(20.0, 80.0))["grpc.keepalive_time_ms"] == 20_000


def test_the_default_is_grpcs_own_and_the_environment_overrides_it():
    env = {k: v for k, v in os.environ.items() if k != "HELIXSERVE_GRPC_KEEPALIVE_TIMEOUT_S"}
    code = ("from helixserve.runtime import transport as tp;"
            "print(dict(tp.CHANNEL_OPTIONS)['grpc.keepalive_timeout_ms'],"
            "dict(tp.SERVER_OPTIONS)['grpc.keepalive_timeout_ms'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["20000", "20000"]
    env["HELIXSERVE_GRPC_KEEPALIVE_TIMEOUT_S"] = "80"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["80000", "80000"]


def test_a_rehearsal_can_fix_the_stream_window_and_turn_bdp_probing_off():
    env = {k: v for k, v in os.environ.items() if k != "HELIXSERVE_GRPC_STREAM_WINDOW_BYTES"}
    code = ("from helixserve.runtime import transport as tp;"
            "c, s = dict(tp.CHANNEL_OPTIONS), dict(tp.SERVER_OPTIONS);"
            "print(c.get('grpc.http2.lookahead_bytes'), c.get('grpc.http2.bdp_probe'),"
            "s.get('grpc.http2.lookahead_bytes'), s.get('grpc.http2.bdp_probe'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["None"] * 4  # gRPC's own window, growing with the link
    env["HELIXSERVE_GRPC_STREAM_WINDOW_BYTES"] = "32768"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["32768", "0", "32768", "0"]


def test_a_bad_value_in_the_environment_is_a_user_error_naming_it(monkeypatch):
    monkeypatch.setenv("HELIXSERVE_GRPC_KEEPALIVE_TIMEOUT_S", "abc")
    with pytest.raises(UserError, match=r"HELIXSERVE_GRPC_KEEPALIVE_TIMEOUT_S: bad value 'abc'"):
        tp._env_number("HELIXSERVE_GRPC_KEEPALIVE_TIMEOUT_S", 20.0, 0.001)
    monkeypatch.setenv("HELIXSERVE_GRPC_STREAM_WINDOW_BYTES", "-3")
    with pytest.raises(UserError, match=r"HELIXSERVE_GRPC_STREAM_WINDOW_BYTES: bad value '-3'"):
        tp._env_number("HELIXSERVE_GRPC_STREAM_WINDOW_BYTES", 0, 0)
    monkeypatch.delenv("HELIXSERVE_GRPC_STREAM_WINDOW_BYTES")
    assert tp._env_number("HELIXSERVE_GRPC_STREAM_WINDOW_BYTES", 0, 0) == 0
