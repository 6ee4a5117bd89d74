"""``slipstream serve --http-port``: the HTTP front in a real server process,
through SIGTERM: health 503 and new requests refused while the running
stream finishes, then the process exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import openai


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def health(base_url: str) -> int:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        assert json.loads(exc.read())["error"]["code"] == "draining"
        return exc.code


def test_http_front_drains_on_sigterm(
    spawn_server: Callable[..., tuple[subprocess.Popen[str], str]],
) -> None:
    port = free_port()
    # The stream's 400 tokens take ~2 s alone, over 20 s on a loaded 2-core
    # machine: the default 30 s grace would cut them SHUTDOWN now and then.
    flags = ("--model", "tiny", "--no-calibrate", "--grace-s", "300", "--http-port", str(port))
    proc, _ = spawn_server(*flags)
    base_url = f"http://127.0.0.1:{port}"
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as oai:
        assert health(base_url) == 200
        running = oai.completions.create(
            model="tiny",
            prompt="drain me",
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(running)
        next(chunks)

        proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 2
        while health(base_url) != 503:
            assert time.monotonic() < end, "/health still 200 after SIGTERM"
            time.sleep(0.02)
        try:
            oai.completions.create(model="tiny", prompt="too late", max_tokens=2)
            raise AssertionError("a new request was accepted while draining")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503

        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        assert len(rest) == 400  # 399 more tokens, then the finish chunk
    assert proc.wait(timeout=30) == 0


def test_a_busy_http_port_fails_the_start_in_one_line() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "slipstream.service.cli", "serve", "--port", "0"]
        command += ["--model", "tiny", "--http-port", str(port)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slipstream: error:")]
    assert len(errors) == 1 and f"cannot listen for HTTP on 127.0.0.1:{port}" in errors[0]


def test_a_busy_metrics_port_fails_the_start_in_one_line() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "slipstream.service.cli", "serve", "--port", "0"]
        command += ["--model", "tiny", "--http-port", "0", "--metrics-port", str(port)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slipstream: error:")]
    assert len(errors) == 1 and f"cannot listen for metrics on 127.0.0.1:{port}" in errors[0]


def test_a_grpc_port_another_server_holds_fails_the_start_in_one_line() -> None:
    """Held with SO_REUSEPORT, as another gRPC server holds its port: the start
    fails instead of sharing the port (clients split between two servers)."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "slipstream.service.cli", "serve", "--port", str(port)]
        command += ["--model", "tiny", "--http-port", "0"]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slipstream: error:")]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0]


def test_serves_size_limit_flags_hold_over_http(
    spawn_server: Callable[..., tuple[subprocess.Popen[str], str]],
) -> None:
    port = free_port()
    proc, _ = spawn_server(
        "--model", "tiny", "--no-calibrate", "--http-port", str(port), "--max-prompt-bytes", "8"
    )
    body = json.dumps({"model": "tiny", "prompt": "nine byte", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(request, timeout=30)
        raise AssertionError("a prompt over --max-prompt-bytes was served")
    except urllib.error.HTTPError as exc:
        error = json.loads(exc.read())["error"]
        assert exc.code == 400 and error["param"] == "prompt", error
        assert error["message"] == "prompt is 9 bytes, over this server's limit of 8"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
