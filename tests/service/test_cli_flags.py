"""Flag values every command shares: refused at parsing, with the flag named."""

from __future__ import annotations

import argparse

import pytest

from slipstream.service.cli.arg_types import tcp_port


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What the command printed when it refused ``argv`` at parsing (exit 2)."""
    from slipstream.service.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("text", ["0", "50051", "65535"])
def test_a_port_is_0_to_65535(text: str) -> None:
    assert tcp_port(text) == int(text)


@pytest.mark.parametrize("text", ["65536", "70000", "-1", "http"])
def test_a_port_out_of_range_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        tcp_port(text)


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_serve_refuses_a_port_grpc_would_wrap(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """gRPC takes port 70000 as 70000 - 65536 and listens on 4464: the
    command must refuse it before anything starts."""
    err = usage_error(["serve", "--model", "tiny", flag, "70000"], capsys)
    assert f"argument {flag}: a port is 0-65535, got 70000" in err


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["bench", "slo", "--sim", "--requests", "0"], "argument --requests: must be >= 1"),
        (["bench", "slo", "--sim", "--load", "0"], "argument --load: must be > 0"),
        (["bench", "slo", "--sim", "--slack", "4", "0", "16"], "argument --slack: must be > 0"),
        (["bench", "serve", "--model", "tiny", "--requests", "0"], "argument --requests"),
        (["bench", "serve", "--model", "tiny", "--rate", "0"], "argument --rate: must be > 0"),
        (["bench", "soak", "--minutes", "0"], "argument --minutes: must be > 0"),
        (["bench", "soak", "--load", "nan"], "argument --load: must be > 0, got nan"),
    ],
)
def test_a_benchmark_refuses_a_value_it_cannot_run(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each of these hung (slo --requests 0), divided by zero (serve
    --requests 0, --rate 0) or failed deep inside a run (soak --minutes 0)."""
    assert complaint in usage_error(argv, capsys)


@pytest.mark.parametrize(
    ("flag", "value", "complaint"),
    [
        ("--kv-cache-gb", "0", "must be > 0, got 0"),  # was one sequence's worth of blocks
        ("--kv-cache-gb", "-2", "must be > 0, got -2"),
        ("--gpu-memory-fraction", "2", "must be in (0, 1], got 2"),
        ("--grace-s", "-1", "must be >= 0, got -1"),
    ],
)
def test_serve_refuses_a_size_or_time_out_of_range(
    flag: str, value: str, complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(["serve", "--model", "tiny", flag, value], capsys)
    assert f"argument {flag}: {complaint}" in err


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        # protobuf's own "Value out of range: -3", naming no flag, before these
        (["generate", "--max-tokens", "-3"], "argument --max-tokens: must be >= 1, got -3"),
        (["generate", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["generate", "--expected-tokens", "-1"], "argument --expected-tokens: must be >= 1"),
        (["generate", "--cancel-after", "0"], "argument --cancel-after: must be >= 1, got 0"),
        (["generate", "--deadline-ms", "-5"], "argument --deadline-ms: must be >= 0, got -5"),
        (["chat", "--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
        (["chat", "--temperature", "-1"], "argument --temperature: must be >= 0, got -1"),
    ],
)
def test_a_client_command_refuses_a_value_the_server_would(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    command, *flags = argv
    where = ["--server", "127.0.0.1:1"] + (["--prompt", "hi"] if command == "generate" else [])
    assert complaint in usage_error([command, *where, *flags], capsys)
