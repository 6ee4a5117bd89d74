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


def parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What parsing ``argv`` printed when it refused it (exit 2); unlike
    ``usage_error`` nothing runs when it is accepted (no server starts)."""
    from slipstream.service.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
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
    ("ports", "complaint"),
    [
        (["--port", "46040", "--http-port", "46040"], "--http-port 46040 is --port's too"),
        (
            ["--port", "46040", "--http-port", "46041", "--metrics-port", "46041"],
            "--metrics-port 46041 is --http-port's too",
        ),
    ],
)
def test_serve_refuses_one_port_for_two_listeners(
    ports: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The second listener failed 'address already in use', as if another
    process held the port, after the first had started."""
    from slipstream.service.cli import main

    assert main(["serve", "--model", "tiny", *ports]) == 2
    err = capsys.readouterr().err
    assert f"slipstream: error: {complaint}: each listener needs a port of its own" in err
    assert "already in use" not in err


@pytest.mark.parametrize(
    "ports",
    [
        ["--port", "0", "--http-port", "0", "--metrics-port", "0"],
        ["--port", "46040", "--http-port", "0"],
        ["--port", "46040", "--metrics-port", "46040", "--metrics-host", "127.0.0.2"],
    ],
)
def test_free_ports_and_other_hosts_do_not_clash(ports: list[str]) -> None:
    from slipstream.service.cli import build_parser
    from slipstream.service.cli.serve import port_clash

    assert port_clash(build_parser().parse_args(["serve", *ports])) is None


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
        (["bench", "soak", "--calibrate-in-flight", "0"], "argument --calibrate-in-flight"),
        (["bench", "soak", "--calibrate-s", "inf"], "argument --calibrate-s: must be > 0 and"),
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
        # 0 was one sequence's worth of blocks
        ("--kv-cache-gb", "0", "must be > 0 and finite, got 0"),
        ("--kv-cache-gb", "-2", "must be > 0 and finite, got -2"),
        ("--gpu-memory-fraction", "2", "must be in (0, 1], got 2"),
        ("--kv-cache-gb", "inf", "must be > 0 and finite, got inf"),  # was an OverflowError
        ("--grace-s", "-1", "must be in [0, 9223372036] seconds, got -1"),
        ("--grace-s", "inf", "must be in [0, 9223372036] seconds, got inf"),  # failed at SIGTERM
        # Accepted as plain floats: NaN ran, -1 failed only after loading the model.
        ("--aging-s", "nan", "must be >= 0, got nan"),
        ("--aging-s", "-1", "must be >= 0, got -1"),
        ("--min-residency-s", "nan", "must be >= 0, got nan"),
        # Refused after parsing in words naming no flag, or not at all (gRPC's C int).
        ("--max-connection-age-s", "nan", "must be in (0, 2147483.647] seconds, got nan"),
        ("--max-connection-age-s", "1e10", "must be in (0, 2147483.647] seconds, got 1e10"),
        ("--max-connection-age-grace-s", "-1", "must be in [0, 2147483.647] seconds, got -1"),
        ("--keepalive-s", "0", "must be in (0, 2147483.647] seconds, got 0"),
        ("--keepalive-timeout-s", "nan", "must be in (0, 2147483.647] seconds, got nan"),
        ("--max-message-bytes", "4294967296", "must be in [1, 2147483647], got 4294967296"),
        ("--max-prompt-bytes", "0", "must be >= 1, got 0"),
        ("--max-stop-sequences", "-1", "must be >= 0, got -1"),
        ("--slow-reader-grace", "nan", "must be > 0, got nan"),
        ("--tokenizer-workers", "0", "must be >= 1, got 0"),
    ],
)
def test_serve_refuses_a_size_or_time_out_of_range(
    flag: str, value: str, complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """At parsing, naming the flag: before any model is loaded."""
    err = parse_error(["serve", "--model", "tiny", flag, value], capsys)
    assert f"argument {flag}: {complaint}" in err


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--aging-s", "0"), ("--aging-s", "inf"), ("--min-residency-s", "0"), ("--grace-s", "0")],
)
def test_serve_takes_zero_and_never_where_they_mean_something(flag: str, value: str) -> None:
    from slipstream.service.cli import build_parser

    args = build_parser().parse_args(["serve", flag, value])
    assert getattr(args, flag[2:].replace("-", "_")) == float(value)


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        # protobuf's own "Value out of range: -3", naming no flag, before these
        (["generate", "--max-tokens", "-3"], "argument --max-tokens: must be in [1, 4294967295]"),
        (["generate", "--seed", "-1"], "argument --seed: must be in [0, 18446744073709551615]"),
        (["generate", "--expected-tokens", "-1"], "argument --expected-tokens: must be in [1, "),
        (["generate", "--cancel-after", "0"], "argument --cancel-after: must be >= 1, got 0"),
        (["generate", "--deadline-ms", "-5"], "argument --deadline-ms: must be in [0, "),
        (["chat", "--max-tokens", "0"], "argument --max-tokens: must be in [1, 4294967295], got 0"),
        (["chat", "--temperature", "-1"], "argument --temperature: must be >= 0 and finite"),
        # Past the wire field: "max_tokens must be in [0, 4294967295]" (the Python
        # name), "Value out of range: 99999999999", or an OverflowError traceback.
        (["generate", "--max-tokens", "99999999999"], "argument --max-tokens: must be in [1, "),
        (["generate", "--expected-tokens", "4294967296"], "argument --expected-tokens: must be"),
        (["generate", "--priority", "99999999999"], "argument --priority: must be in [0, 2147"),
        (
            ["generate", "--seed", str(2**64)],
            "argument --seed: must be in [0, 18446744073709551615]",
        ),
        (["generate", "--deadline-ms", "inf"], "argument --deadline-ms: must be in [0, 3155760"),
        (["generate", "--deadline-ms", "1e30"], "argument --deadline-ms: must be in [0, 315576"),
        (["generate", "--deadline-ms", "nan"], "argument --deadline-ms: must be in [0, 315576"),
        (["generate", "--first-token-timeout", "inf"], "argument --first-token-timeout: must be"),
        (["generate", "--temperature", "inf"], "argument --temperature: must be >= 0 and finite"),
        (["chat", "--seed", str(2**64)], "argument --seed: must be in [0, 18446744073709551615]"),
        (["chat", "--temperature", "nan"], "argument --temperature: must be >= 0 and finite"),
    ],
)
def test_a_client_command_refuses_a_value_the_server_or_the_wire_would(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    command, *flags = argv
    where = ["--server", "127.0.0.1:1"] + (["--prompt", "hi"] if command == "generate" else [])
    assert complaint in usage_error([command, *where, *flags], capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--server", "localhost", "--prompt", "hi"],
        ["generate", "--server", "localhost", "--prompt", "hi", "--per-request"],
        ["stats", "--server", "localhost"],
        ["chat", "--server", "localhost"],
    ],
)
def test_a_server_without_a_port_is_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """gRPC dialled port 443 and failed with 'ipv4:127.0.0.1:443: Connection refused'."""
    err = usage_error(argv, capsys)
    assert (
        "slipstream: error: address 'localhost' has no port (HOST:PORT, e.g. localhost:50051)"
        in err
    )


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e309"])
def test_stats_refuses_a_timeout_that_fails_at_once(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was sent as the call's timeout: DEADLINE_EXCEEDED at once."""
    err = parse_error(["stats", "--server", "127.0.0.1:1", "--timeout-s", value], capsys)
    assert f"argument --timeout-s: must be > 0 and finite, got {value}" in err


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        ([], "slipstream: error: choose a command: model, generate, chat, serve, stats, bench"),
        (["model"], "slipstream model: error: choose a command: init, path, import-gguf"),
        (["kernels"], "slipstream kernels: error: choose a command: build"),
        (["bench"], "slipstream bench: error: choose a command: calibrate, host, kv-accuracy"),
    ],
)
def test_a_missing_command_names_the_choices(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse named its dest instead: 'the following arguments are required: model_command'."""
    err = usage_error(argv, capsys)
    assert complaint in err and "required" not in err


def test_model_path_of_an_unknown_model_is_an_error_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from slipstream.service.cli import main

    assert main(["model", "path", "nosuch"]) == 2
    assert capsys.readouterr().err.startswith("slipstream: error: unknown model 'nosuch'")


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-tokens", "4294967295", "--expected-tokens", "4294967295"],
        ["--priority", "2147483647", "--seed", str(2**64 - 1)],
        ["--deadline-ms", "0", "--first-token-timeout", "315576000000000"],
    ],
)
def test_generate_takes_the_ends_of_each_wire_range(flags: list[str]) -> None:
    from slipstream.service.cli import build_parser

    build_parser().parse_args(["generate", "--server", "127.0.0.1:1", "--prompt", "hi", *flags])
