"""TLS and mutual TLS over a real ``grpc.aio`` server and the HTTP front
(HTTPS) on the ``tiny`` model, with a CA made here (the ``cryptography``
package): TLS works, plaintext is refused, a wrong CA is refused, mTLS
without a client certificate is refused, a rotated certificate is served
without a restart (and a half-written rotation is not), the CLI's client
flags reach the server, and ``serve`` on a public address takes TLS and
tenants for both fronts."""

from __future__ import annotations

import asyncio
import datetime
import io
import ipaddress
import json
import os
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from server_thread import ServerThread

from slipstream.clients import TLS, Client
from slipstream.service.api.tls import CertificateFiles, ServerTLS, TLSFilesError
from slipstream.service.engine.config import EngineConfig
from slipstream.v1 import inference_pb2 as pb
from slipstream.v1 import inference_pb2_grpc as pb_grpc

CONFIG = EngineConfig(model="tiny", dtype="float32", calibrate_cost_model=False)


# ---------------------------------------------------------------- a CA of our own


@dataclass(frozen=True)
class Issued:
    cert: bytes
    key: bytes


class CA:
    def __init__(self, name: str) -> None:
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        self.cert = self._build(name, self._key, is_ca=True).public_bytes(
            serialization.Encoding.PEM
        )

    def issue(self, subject: str, *, server: bool, valid: tuple[float, float] = (-1, 30)) -> Issued:
        """``valid``: the validity period, in days from now."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._build(subject, key, is_ca=False, server=server, valid=valid)
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))

    def _build(
        self,
        subject: str,
        key: ec.EllipticCurvePrivateKey,
        *,
        is_ca: bool,
        server: bool = False,
        valid: tuple[float, float] = (-1, 30),
    ) -> x509.Certificate:
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.name)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now + datetime.timedelta(days=valid[0]))
            .not_valid_after(now + datetime.timedelta(days=valid[1]))
            .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        )
        if server:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(self._key, hashes.SHA256())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write(path: Path, data: bytes) -> Path:
    """Replaces ``path`` atomically, as certificate rotation tools do."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Server CA, a server certificate, a client CA and a client
    certificate, and an unrelated CA with a client certificate of its own."""
    root = tmp_path_factory.mktemp("pki")
    server_ca, client_ca, other_ca = CA("server-ca"), CA("client-ca"), CA("other-ca")
    server = server_ca.issue("localhost", server=True)
    expired = server_ca.issue("localhost", server=True, valid=(-30, -1))
    client = client_ca.issue("client-a", server=False)
    stranger = other_ca.issue("client-b", server=False)
    files = {
        "server_ca": server_ca.cert,
        "server_cert": server.cert,
        "server_key": server.key,
        "expired_cert": expired.cert,
        "expired_key": expired.key,
        "client_ca": client_ca.cert,
        "client_cert": client.cert,
        "client_key": client.key,
        "other_ca": other_ca.cert,
        "stranger_cert": stranger.cert,
        "stranger_key": stranger.key,
    }
    return {name: write(root / f"{name}.pem", data) for name, data in files.items()}


@pytest.fixture(scope="module")
def tls_server(engine: object, pki: dict[str, Path]) -> Iterator[ServerThread]:
    srv = ServerThread(engine, "localhost", tls=ServerTLS(pki["server_cert"], pki["server_key"]))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def mtls_server(engine: object, pki: dict[str, Path]) -> Iterator[ServerThread]:
    tls = ServerTLS(pki["server_cert"], pki["server_key"], pki["client_ca"])
    srv = ServerThread(engine, "localhost", tls=tls)
    yield srv
    srv.stop()


def rpc_code(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """The status of one GetModelInfo over a fresh channel."""
    channel = (
        grpc.insecure_channel(target)
        if credentials is None
        else grpc.secure_channel(target, credentials)
    )
    with channel:
        try:
            pb_grpc.InferenceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def ca_credentials(pki: dict[str, Path], ca: str = "server_ca") -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=pki[ca].read_bytes())


# ---------------------------------------------------------------- TLS


def test_tls_serves_generation(tls_server: ServerThread, pki: dict[str, Path]) -> None:
    with Client(tls_server.target, tls=TLS(ca_file=pki["server_ca"])) as client:
        result = client.generate([5, 6, 7], max_tokens=6, ignore_eos=True).result(timeout=60)
        assert result.is_ok and result.output_tokens == 6
        assert client.model_info().name == "tiny"


def test_plaintext_is_refused(tls_server: ServerThread) -> None:
    assert rpc_code(tls_server.target, None) is grpc.StatusCode.UNAVAILABLE


def test_a_wrong_ca_is_refused(tls_server: ServerThread, pki: dict[str, Path]) -> None:
    assert rpc_code(tls_server.target, ca_credentials(pki, "other_ca")) is (
        grpc.StatusCode.UNAVAILABLE
    )
    assert rpc_code(tls_server.target, ca_credentials(pki)) is grpc.StatusCode.OK


# ---------------------------------------------------------------- mutual TLS


def test_mtls_refuses_a_client_without_a_certificate(
    mtls_server: ServerThread, pki: dict[str, Path]
) -> None:
    assert rpc_code(mtls_server.target, ca_credentials(pki)) is grpc.StatusCode.UNAVAILABLE


def test_mtls_refuses_a_certificate_from_another_ca(
    mtls_server: ServerThread, pki: dict[str, Path]
) -> None:
    tls = TLS(pki["server_ca"], pki["stranger_cert"], pki["stranger_key"])
    assert rpc_code(mtls_server.target, tls.credentials()) is grpc.StatusCode.UNAVAILABLE


def test_mtls_serves_a_client_with_a_certificate(
    mtls_server: ServerThread, pki: dict[str, Path]
) -> None:
    tls = TLS(pki["server_ca"], pki["client_cert"], pki["client_key"])
    with Client(mtls_server.target, tls=tls) as client:
        result = client.generate([5, 6, 7], max_tokens=4, ignore_eos=True).result(timeout=60)
    assert result.is_ok and result.output_tokens == 4


# ---------------------------------------------------------------- rotation


def test_a_rotated_certificate_is_served_without_a_restart(engine: object, tmp_path: Path) -> None:
    old_ca, new_ca = CA("old-ca"), CA("new-ca")
    old, new = old_ca.issue("localhost", server=True), new_ca.issue("localhost", server=True)
    cert, key = write(tmp_path / "cert.pem", old.cert), write(tmp_path / "key.pem", old.key)
    old_ca_file = write(tmp_path / "old-ca.pem", old_ca.cert)
    new_ca_file = write(tmp_path / "new-ca.pem", new_ca.cert)
    srv = ServerThread(engine, "localhost", tls=ServerTLS(cert, key))
    try:
        trust_old = grpc.ssl_channel_credentials(old_ca_file.read_bytes())
        trust_new = grpc.ssl_channel_credentials(new_ca_file.read_bytes())
        assert rpc_code(srv.target, trust_old) is grpc.StatusCode.OK
        assert rpc_code(srv.target, trust_new) is grpc.StatusCode.UNAVAILABLE

        # Half-way through a rotation (new certificate, old key) the pair does
        # not match: the server keeps serving the old certificate.
        write(cert, new.cert)
        assert rpc_code(srv.target, trust_old) is grpc.StatusCode.OK

        write(key, new.key)
        assert rpc_code(srv.target, trust_new) is grpc.StatusCode.OK
        assert rpc_code(srv.target, trust_old) is grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()


def test_certificate_files_reload_only_on_change(pki: dict[str, Path], tmp_path: Path) -> None:
    cert = write(tmp_path / "cert.pem", pki["server_cert"].read_bytes())
    key = write(tmp_path / "key.pem", pki["server_key"].read_bytes())
    files = CertificateFiles(ServerTLS(cert, key))
    assert files.fetch() is None and files.num_reloads == 0
    write(cert, pki["server_cert"].read_bytes())  # same bytes, new inode: read again
    assert files.fetch() is not None and files.num_reloads == 1
    assert files.fetch() is None
    key.unlink()  # a missing file keeps the current certificate
    assert files.fetch() is None and files.num_reloads == 1


def test_unusable_files_stop_the_server_from_starting(pki: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(TLSFilesError, match="cannot read"):
        CertificateFiles(ServerTLS(tmp_path / "absent.pem", pki["server_key"]))
    with pytest.raises(TLSFilesError, match="certificate and its key"):
        CertificateFiles(ServerTLS(pki["server_cert"], pki["client_key"]))
    garbage = write(tmp_path / "ca.pem", b"not a certificate")
    with pytest.raises(TLSFilesError, match="CA"):
        CertificateFiles(ServerTLS(pki["server_cert"], pki["server_key"], garbage))


def test_a_certificate_outside_its_validity_period_stops_the_server_from_starting(
    tmp_path: Path,
) -> None:
    ca = CA("ca")
    for valid, complaint in [((-30, -1), "expired on"), ((1, 30), "is not valid until")]:
        issued = ca.issue("localhost", server=True, valid=valid)
        cert = write(tmp_path / "cert.pem", issued.cert)
        key = write(tmp_path / "key.pem", issued.key)
        with pytest.raises(TLSFilesError, match=f"cert.pem {complaint}"):
            CertificateFiles(ServerTLS(cert, key))


def test_a_rotation_to_an_expired_certificate_keeps_the_current_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream.service.api import tls

    failures: list[str] = []
    monkeypatch.setattr(tls.log, "error", lambda event, **fields: failures.append(fields["detail"]))
    ca = CA("ca")
    valid, expired = ca.issue("localhost", server=True), ca.issue("x", server=True, valid=(-9, -2))
    cert, key = write(tmp_path / "cert.pem", valid.cert), write(tmp_path / "key.pem", valid.key)
    files = tls.CertificateFiles(ServerTLS(cert, key))
    write(key, expired.key)
    write(cert, expired.cert)
    assert files.fetch() is None and files.num_reloads == 0
    assert len(failures) == 1 and "expired on" in failures[0]
    write(key, valid.key)
    write(cert, valid.cert)
    assert files.fetch() is not None and files.num_reloads == 1


def test_a_certificate_about_to_expire_is_taken_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream.service.api import tls

    warnings: list[tuple[str, str]] = []
    monkeypatch.setattr(
        tls.log, "warning", lambda event, **fields: warnings.append((event, fields["front"]))
    )
    ca = CA("ca")
    month, days = ca.issue("localhost", server=True), ca.issue("x", server=True, valid=(-1, 2))
    cert, key = write(tmp_path / "cert.pem", month.cert), write(tmp_path / "key.pem", month.key)
    files = tls.CertificateFiles(ServerTLS(cert, key), front="http")
    assert warnings == []
    write(key, days.key)
    write(cert, days.cert)
    assert files.fetch() is not None
    assert warnings == [("tls_certificate_expires_soon", "http")]
    tls.CertificateFiles(ServerTLS(cert, key))  # and at start-up
    assert warnings[1:] == [("tls_certificate_expires_soon", "grpc")]


# ---------------------------------------------------------------- the HTTP front (HTTPS)


class HttpsFront:
    """The HTTP front alone on its own event loop thread, serving ``engine``."""

    def __init__(self, engine: object, tls: ServerTLS) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._run(self._start(engine, tls))
        self.url = f"https://localhost:{self.port}"

    async def _start(self, engine: object, tls: ServerTLS) -> int:
        from slipstream.service.api.http.app import HttpFront
        from slipstream.service.api.lifecycle import Lifecycle

        lifecycle = Lifecycle(engine)  # type: ignore[arg-type]
        self.http = HttpFront(lifecycle, tls=tls)
        port = await self.http.start("127.0.0.1", 0)
        await lifecycle.serve()
        return port

    def _run(self, coro: object) -> int:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def stop(self) -> None:
        self._run(self.http.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture
def https_front(engine: object) -> Iterator[Callable[[ServerTLS], HttpsFront]]:
    fronts: list[HttpsFront] = []

    def start(tls: ServerTLS) -> HttpsFront:
        fronts.append(HttpsFront(engine, tls))
        return fronts[-1]

    yield start
    for front in fronts:
        front.stop()


def trusting(ca_file: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


def get(url: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """One request on a fresh connection (urllib keeps none open)."""
    with urllib.request.urlopen(url, timeout=10, context=context) as reply:
        return int(reply.status), reply.read()


# What a refused handshake looks like from urllib: an alert, a reset, or a
# connection closed before any reply.
REFUSED = (urllib.error.URLError, ssl.SSLError, ConnectionError)


def test_https_serves_a_client_that_trusts_the_ca(
    https_front: Callable[[ServerTLS], HttpsFront], pki: dict[str, Path]
) -> None:
    front = https_front(ServerTLS(pki["server_cert"], pki["server_key"]))
    status, body = get(f"{front.url}/v1/models", trusting(pki["server_ca"]))
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"
    with pytest.raises(REFUSED):
        get(f"{front.url}/health", trusting(pki["other_ca"]))
    with pytest.raises(REFUSED):  # plaintext HTTP to the HTTPS port
        get(f"http://127.0.0.1:{front.port}/health")


def test_https_with_a_client_ca_requires_a_client_certificate(
    https_front: Callable[[ServerTLS], HttpsFront], pki: dict[str, Path]
) -> None:
    front = https_front(ServerTLS(pki["server_cert"], pki["server_key"], pki["client_ca"]))
    with pytest.raises(REFUSED):
        get(f"{front.url}/health", trusting(pki["server_ca"]))
    stranger = trusting(pki["server_ca"], pki["stranger_cert"], pki["stranger_key"])
    with pytest.raises(REFUSED):
        get(f"{front.url}/health", stranger)
    client = trusting(pki["server_ca"], pki["client_cert"], pki["client_key"])
    assert get(f"{front.url}/health", client)[0] == 200


def test_https_serves_a_rotated_certificate_without_a_restart(
    https_front: Callable[[ServerTLS], HttpsFront], tmp_path: Path
) -> None:
    old_ca, new_ca = CA("old-ca"), CA("new-ca")
    old, new = old_ca.issue("localhost", server=True), new_ca.issue("localhost", server=True)
    cert, key = write(tmp_path / "cert.pem", old.cert), write(tmp_path / "key.pem", old.key)
    trust_old = trusting(write(tmp_path / "old-ca.pem", old_ca.cert))
    trust_new = trusting(write(tmp_path / "new-ca.pem", new_ca.cert))
    front = https_front(ServerTLS(cert, key))
    health = f"{front.url}/health"
    assert get(health, trust_old)[0] == 200
    with pytest.raises(REFUSED):
        get(health, trust_new)

    write(cert, new.cert)  # half-way: the old pair stays
    assert get(health, trust_old)[0] == 200

    write(key, new.key)
    assert get(health, trust_new)[0] == 200
    with pytest.raises(REFUSED):
        get(health, trust_old)
    assert get(health, trust_new)[0] == 200  # and stays


def test_a_half_written_rotation_is_said_once_not_on_every_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream.service.api import tls

    failures: list[str] = []
    monkeypatch.setattr(tls.log, "error", lambda event, **fields: failures.append(event))
    ca = CA("ca")
    old, new = ca.issue("localhost", server=True), ca.issue("localhost", server=True)
    cert, key = write(tmp_path / "cert.pem", old.cert), write(tmp_path / "key.pem", old.key)
    files = tls.CertificateFiles(ServerTLS(cert, key))
    write(cert, new.cert)  # half-way: the key does not match
    assert [files.fetch() for _ in range(5)] == [None] * 5  # five new connections
    assert failures == ["tls_reload_failed"]
    write(key, new.key)
    assert files.fetch() is not None and files.num_reloads == 1
    write(cert, old.cert)  # the next rotation's half-way is said again
    assert files.fetch() is None and failures == ["tls_reload_failed"] * 2


def test_https_takes_a_rotated_client_ca(
    https_front: Callable[[ServerTLS], HttpsFront], pki: dict[str, Path], tmp_path: Path
) -> None:
    new_ca = CA("new-client-ca")
    issued = new_ca.issue("client-c", server=False)
    new_cert, new_key = (
        write(tmp_path / "c.pem", issued.cert),
        write(tmp_path / "k.pem", issued.key),
    )
    client_ca = write(tmp_path / "client-ca.pem", pki["client_ca"].read_bytes())
    front = https_front(ServerTLS(pki["server_cert"], pki["server_key"], client_ca))
    old_client = trusting(pki["server_ca"], pki["client_cert"], pki["client_key"])
    new_client = trusting(pki["server_ca"], new_cert, new_key)
    assert get(f"{front.url}/health", old_client)[0] == 200
    with pytest.raises(REFUSED):
        get(f"{front.url}/health", new_client)

    write(client_ca, new_ca.cert)
    assert get(f"{front.url}/health", new_client)[0] == 200
    with pytest.raises(REFUSED):
        get(f"{front.url}/health", old_client)


def test_serve_speaks_https_with_the_tls_files(
    spawn_server: Callable[..., tuple[object, str]], pki: dict[str, Path]
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tls = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    spawn_server("--model", "tiny", "--no-calibrate", *tls, "--http-port", str(port))
    assert get(f"https://localhost:{port}/health", trusting(pki["server_ca"]))[0] == 200


# ---------------------------------------------------------------- the command line


def test_stats_command_speaks_mtls(
    mtls_server: ServerThread, pki: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from slipstream.service.cli import main

    argv = ["stats", "--server", mtls_server.target, "--json", "--tls-ca", str(pki["server_ca"])]
    mtls = ["--tls-cert", str(pki["client_cert"]), "--tls-key", str(pki["client_key"])]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([*argv, *mtls]) == 0
    assert json.loads(out.getvalue())["draining"] is False
    assert main(argv) == 1  # no client certificate
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert main([*argv, "--tls-cert", "absent.pem", "--tls-key", "absent.key"]) == 1
    assert "cannot read absent" in capsys.readouterr().err


def test_generate_command_speaks_mtls(mtls_server: ServerThread, pki: dict[str, Path]) -> None:
    from slipstream.service.cli import main

    argv = ["generate", "--server", mtls_server.target, "--prompt", "Hello", "--max-tokens", "3"]
    tls = ["--tls-ca", str(pki["server_ca"]), "--tls-cert", str(pki["client_cert"])]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([*argv, *tls, "--tls-key", str(pki["client_key"]), "--json"]) == 0
        assert main([*argv, "--tls-ca", str(pki["server_ca"])]) == 1  # no client certificate
    (line,) = [line for line in out.getvalue().splitlines() if line.startswith("{")]
    assert json.loads(line)["finish_reason"] in {"max_tokens", "eos"}


def test_serve_refuses_a_public_address_without_tls_and_tenants(
    capsys: pytest.CaptureFixture[str], pki: dict[str, Path]
) -> None:
    from slipstream.service.cli import main

    assert main(["serve", "--model", "tiny", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "refusing to start" in err and "TLS" in err and "tenants" in err and "--insecure" in err
    tls = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    assert main(["serve", "--model", "tiny", "--host", "10.1.2.3", *tls]) == 2
    err = capsys.readouterr().err
    assert "without tenants" in err


def serve_args(*argv: str) -> object:
    from slipstream.service.cli import build_parser

    return build_parser().parse_args(["serve", "--model", "tiny", *argv])


def test_serve_on_a_public_address_with_tls_and_tenants_passes_the_check(
    capsys: pytest.CaptureFixture[str], pki: dict[str, Path], tmp_path: Path
) -> None:
    """The README's Security example: the HTTP front is on (port 8000) and
    speaks HTTPS with the same files."""
    from slipstream.service.cli.serve import exposure_allowed

    tls = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    tenants = ["--tenants", str(tmp_path / "tenants.toml")]
    args = serve_args("--host", "0.0.0.0", *tls, *tenants)
    assert args.http_port == 8000  # type: ignore[attr-defined]
    assert exposure_allowed(args, has_tls=True, has_tenants=True)  # type: ignore[arg-type]
    mutual = serve_args("--host", "0.0.0.0", *tls, "--tls-client-ca", str(pki["client_ca"]))
    assert exposure_allowed(mutual, has_tls=True, has_tenants=True)  # type: ignore[arg-type]
    assert capsys.readouterr().err == ""


def test_the_refusal_names_what_is_missing_and_how_to_turn_the_http_front_off(
    capsys: pytest.CaptureFixture[str], pki: dict[str, Path], tmp_path: Path
) -> None:
    from slipstream.service.cli.serve import exposure_allowed

    tls = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    tenants = ["--tenants", str(tmp_path / "tenants.toml")]

    def refusal(*argv: str, has_tls: bool, has_tenants: bool) -> str:
        args = serve_args("--host", "0.0.0.0", *argv)
        assert not exposure_allowed(args, has_tls, has_tenants)  # type: ignore[arg-type]
        return capsys.readouterr().err

    err = refusal(has_tls=False, has_tenants=False)
    assert "without TLS (--tls-cert/--tls-key) or tenants" in err
    assert "Add --tls-cert/--tls-key and --tenants" in err and "--insecure" in err
    assert "port 8000" in err and "--http-port 0 turns it off" in err

    err = refusal(*tenants, has_tls=False, has_tenants=True)
    assert "without TLS" in err and "bearer tokens in the clear" in err
    assert "Add --tls-cert/--tls-key (" in err and "--http-port 0" in err

    err = refusal(*tls, has_tls=True, has_tenants=False)  # the HTTP front has TLS: not its fault
    assert "without tenants" in err and "Add --tenants," in err and "--http-port" not in err

    err = refusal("--http-port", "0", has_tls=False, has_tenants=False)
    assert "--http-port" not in err and "HTTP" not in err

    args = serve_args("--host", "0.0.0.0", "--insecure")
    assert exposure_allowed(args, has_tls=False, has_tenants=False)  # type: ignore[arg-type]
    assert "WARNING" in capsys.readouterr().err


def test_a_metrics_port_that_shows_tenants_to_the_network_is_warned_of(
    capsys: pytest.CaptureFixture[str], pki: dict[str, Path], tmp_path: Path
) -> None:
    """The metrics port speaks plain HTTP with no token; with tenants its
    page names them and their usage. On --host unless --metrics-host."""
    from slipstream.service.cli.serve import exposure_allowed

    tls = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    tenants = ["--tenants", str(tmp_path / "tenants.toml")]
    metrics = ["--metrics-port", "9400"]

    def warned(*argv: str, has_tls: bool = True, has_tenants: bool = True) -> str:
        assert exposure_allowed(serve_args(*argv), has_tls, has_tenants)  # type: ignore[arg-type]
        return capsys.readouterr().err

    err = warned("--host", "0.0.0.0", *tls, *tenants, *metrics)
    assert "WARNING: the metrics port listens on 0.0.0.0" in err
    assert "without a token" in err and "names every tenant" in err
    assert "--metrics-host 127.0.0.1 keeps it on this machine" in err
    assert "listens on 10.0.0.5" in warned(*tenants, *metrics, "--metrics-host", "10.0.0.5")

    public = ("--host", "0.0.0.0", *tls, *tenants)
    assert warned(*public, *metrics, "--metrics-host", "127.0.0.1") == ""
    assert warned(*public) == ""  # no metrics port
    assert warned(*tenants, *metrics) == ""  # on loopback, as --host
    err = warned("--host", "0.0.0.0", "--insecure", *metrics, has_tls=False, has_tenants=False)
    assert "--insecure" in err and "metrics" not in err  # no tenants to name


def test_serve_says_which_file_is_unusable(
    capsys: pytest.CaptureFixture[str], pki: dict[str, Path], tmp_path: Path
) -> None:
    from slipstream.service.cli import main

    serve = ["serve", "--model", "tiny", "--port", "0", "--no-calibrate"]
    mismatched = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["client_key"])]
    bad_tenants = write(tmp_path / "tenants.toml", b"[tenants.a\n")
    for extra, complaint in [
        (mismatched, "certificate and its key"),
        (["--tls-cert", str(pki["expired_cert"]), "--tls-key", str(pki["expired_key"])], "expired"),
        (["--tenants", str(bad_tenants)], "not valid TOML"),
        (["--tls-cert", str(pki["server_cert"])], "--tls-cert and --tls-key go together"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main([*serve, *extra])
        assert exited.value.code == 2
        assert complaint in capsys.readouterr().err


@pytest.mark.parametrize(
    ("host", "is_loopback"),
    [
        ("127.0.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_loopback_addresses(host: str, is_loopback: bool) -> None:
    from slipstream.service.api.server import exposure_warning
    from slipstream.service.api.server import is_loopback as loopback

    assert loopback(host) is is_loopback
    assert (exposure_warning(host, False, False) is None) is is_loopback
    assert exposure_warning(host, True, True) is None
    assert exposure_warning(host, True, True, has_http=True) is None
