"""gRPC's native log lines stay out of a command's output unless the user
asks for them: a failed call is the command's one error line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.service.cli import quiet_grpc_logs


def _generate_with_a_bad_ca(tmp_path: Path, **env: str) -> list[str]:
    """stderr's lines of a `generate` whose --tls-ca is no certificate (gRPC's
    core logs four lines about it) to an address nothing listens on."""
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate\n")
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    command = [sys.executable, "-m", "slipstream.service.cli", "generate"]
    command += ["--server", "127.0.0.1:1", "--prompt", "hi", "--tls-ca", str(ca)]
    done = subprocess.run(
        command, env={**inherited, **env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    return done.stderr.splitlines()


def test_a_failed_call_is_one_line_without_grpc_logs(tmp_path: Path) -> None:
    """Four `E1129 … ssl_transport_security.cc …` lines came first."""
    [line] = _generate_with_a_bad_ca(tmp_path)
    assert line.startswith("slipstream: error: 127.0.0.1:1: UNAVAILABLE")


def test_grpc_logs_a_user_asked_for_still_print(tmp_path: Path) -> None:
    lines = _generate_with_a_bad_ca(tmp_path, GRPC_VERBOSITY="ERROR")
    assert any("Could not load any root certificate" in line for line in lines)
    assert lines[-1].startswith("slipstream: error: 127.0.0.1:1: UNAVAILABLE")


@pytest.mark.parametrize("key", ["GRPC_VERBOSITY", "GRPC_TRACE"])
def test_a_user_setting_of_grpc_logging_wins(key: str) -> None:
    environ = {key: "debug" if key == "GRPC_VERBOSITY" else "http"}
    quiet_grpc_logs(environ, ["generate"])
    assert environ == {key: environ[key]}
    unset: dict[str, str] = {}
    quiet_grpc_logs(unset, ["generate"])
    assert unset == {"GRPC_VERBOSITY": "NONE"}


def test_serve_keeps_grpcs_default_logging() -> None:
    """A server's operator may need gRPC's errors (a client's failed TLS
    handshake is logged nowhere else)."""
    environ: dict[str, str] = {}
    quiet_grpc_logs(environ, ["serve", "--model", "tiny"])
    assert environ == {}
    quiet_grpc_logs(environ, ["bench", "serve"])  # its servers inherit the setting
    assert environ == {}
