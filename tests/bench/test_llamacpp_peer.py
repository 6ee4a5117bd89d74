"""The llama.cpp peer of ``bench offline`` against a stand-in ``llama-server``
that speaks its HTTP protocol (the real binary is not built in CI): flags,
start-up, the all-at-once replay, streamed TTFT and token counts, failures."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import pytest

from slipstream.service.bench import llamacpp_peer
from slipstream.service.bench.workload import WorkloadRequest

FAKE_SERVER = textwrap.dedent(
    '''\
    #!{python}
    """Stands in for llama-server: /health, and /completion streaming one
    event per token, then a final event with tokens_predicted."""
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    short = "--short" in open(args[args.index("--model") + 1]).read()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{{}}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["ignore_eos"] and body["stream"] and body["cache_prompt"] is False
            assert all(isinstance(t, int) for t in body["prompt"])
            n = body["n_predict"] - (1 if short else 0)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(n):
                time.sleep(0.001)
                self.wfile.write(b'data: {{"content": "x", "stop": false}}\\n\\n')
            final = json.dumps({{"stop": True, "tokens_predicted": n}})
            self.wfile.write(("data: " + final + "\\n\\n").encode())
            self.wfile.flush()
            self.close_connection = True

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    '''
)


@pytest.fixture
def fake_server(tmp_path: Path) -> Path:
    path = tmp_path / "llama-server"
    path.write_text(FAKE_SERVER.format(python=sys.executable))
    path.chmod(0o755)
    return path


def _settings(binary: Path) -> llamacpp_peer.LlamaServerSettings:
    return llamacpp_peer.LlamaServerSettings(binary=str(binary), num_threads=1, start_timeout_s=30)


WORKLOAD = [WorkloadRequest(list(range(5, 5 + n)), m) for n, m in [(3, 5), (40, 1), (7, 12)]]


def test_replays_all_requests_with_ttft_and_exact_counts(fake_server: Path, tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_text("weights")
    run = llamacpp_peer.run_llamacpp(gguf, WORKLOAD, _settings(fake_server))
    assert run.engine == "llamacpp" and run.wall_s > 0
    assert [t.num_output_tokens for t in run.timings] == [5, 1, 12]
    for t in run.timings:
        assert t.ttft_s is not None and 0 < t.ttft_s <= t.latency_s <= run.wall_s
    assert run.settings["parallel_slots"] == len(WORKLOAD)
    assert run.settings["context_per_slot"] >= 40 + 1


def test_a_wrong_token_count_is_an_error(fake_server: Path, tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_text("--short")
    with pytest.raises(llamacpp_peer.LlamaServerError, match="tokens where"):
        llamacpp_peer.run_llamacpp(gguf, WORKLOAD, _settings(fake_server))


def test_a_server_that_exits_reports_its_log(tmp_path: Path) -> None:
    broken = tmp_path / "llama-server"
    broken.write_text("#!/bin/sh\necho 'error: cannot load model' >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(llamacpp_peer.LlamaServerError, match="exited with 3") as exc:
        llamacpp_peer.run_llamacpp(tmp_path / "m.gguf", WORKLOAD, _settings(broken))
    assert any("cannot load model" in line for line in exc.value.log_tail)


def test_settings_need_an_executable(tmp_path: Path) -> None:
    args = argparse.Namespace(llama_server=None, num_threads=2, llama_server_log=None)
    with pytest.raises(ValueError, match="--llama-server PATH"):
        llamacpp_peer.settings_from_args(args, {})
    args.llama_server = str(tmp_path)
    with pytest.raises(ValueError, match="not an executable"):
        llamacpp_peer.settings_from_args(args, {})
