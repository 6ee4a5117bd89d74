"""``slipstream serve``'s start-up banner: where it listens, and commands that connect."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from slipstream.service.cli.serve import http_hint, usage_hint


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]"])
def test_a_wildcard_host_is_said_as_listened_on_and_the_commands_connect_to_loopback(
    host: str,
) -> None:
    banner = usage_hint(host, 53100, "tiny", has_chat_template=True)
    first, *commands = banner.splitlines()
    assert f"listening on {host}:53100 (every interface)" in first
    addresses = {m for line in commands for m in re.findall(r"\S+:53100\b", line)}
    assert addresses == {"127.0.0.1:53100"}
    assert http_hint(host, 8000) == (
        "slipstream: OpenAI-compatible HTTP API at http://127.0.0.1:8000/v1"
    )


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "[::1]", "localhost"])
def test_a_named_host_is_listened_on_and_connected_to_as_given(host: str) -> None:
    first, *commands = usage_hint(host, 53100, "tiny").splitlines()
    assert first == f"slipstream: serving tiny, listening on {host}:53100"
    assert all(f"{host}:53100" in line for line in commands[1:])


@pytest.mark.parametrize("has_client_ca", [False, True])
def test_under_mutual_tls_the_commands_present_a_client_certificate(has_client_ca: bool) -> None:
    flags = {"has_tls": True, "has_chat_template": True, "has_client_ca": has_client_ca}
    commands = usage_hint("127.0.0.1", 53100, "tiny", **flags).splitlines()[2:]
    ours = [line for line in commands if line.startswith("  slipstream ")]
    grpcurl = [line for line in commands if line.startswith("  grpcurl ")]
    assert len(ours) == 3 and len(grpcurl) == 3
    assert all("--tls-ca CA.pem" in line for line in ours)
    assert all("-cacert CA.pem" in line for line in grpcurl)
    client_cert = [
        *("--tls-cert CLIENT.pem --tls-key CLIENT.key" in line for line in ours),
        *("-cert CLIENT.pem -key CLIENT.key" in line for line in grpcurl),
    ]
    assert client_cert == [has_client_ca] * 6


def test_the_http_front_is_announced_with_grpcs_banner_once_the_model_serves(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both fronts listen while the model loads and answer 'loading'; the
    HTTP line was printed then, seconds before the model served, as if the
    API were up."""
    from types import SimpleNamespace

    from slipstream.service.api import server
    from slipstream.service.cli import build_parser, serve

    printed = {}

    async def run(
        *args: object,
        on_ready: Callable[..., None],
        on_http: Callable[[int], None],
        **kwargs: object,
    ) -> bool:
        on_http(46031)  # listening, the model loading
        printed["loading"] = capsys.readouterr().out
        on_ready(46030, SimpleNamespace(info=SimpleNamespace(has_chat_template=False)))
        printed["serving"] = capsys.readouterr().out
        return True

    monkeypatch.setattr(server, "run", run)
    monkeypatch.setattr(serve, "telemetry", lambda args: None)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    flags = ["serve", "--model", "tiny", "--port", "46030", "--http-port", "46031"]
    assert serve.run(build_parser().parse_args(flags)) == 0
    assert printed["loading"] == ""
    lines = printed["serving"].splitlines()
    assert lines[0] == "slipstream: serving tiny, listening on 127.0.0.1:46030"
    assert "slipstream: OpenAI-compatible HTTP API at http://127.0.0.1:46031/v1" in lines
