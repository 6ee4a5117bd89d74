"""The server's TLS certificate, re-read without a restart.

gRPC asks ``CertificateFiles.fetch`` before every new connection's handshake
(``grpc.dynamic_ssl_server_credentials``). It looks at the files' stat
(mtime, size, inode): unchanged, the current certificate stays; changed, the
files are read again and checked (the key matches the certificate, the
client CA parses) before gRPC gets them. A rotation caught half-written (a
new certificate with the old key) fails that check, is logged, and the old
certificate serves until the next connection finds the pair complete.
Connections already open keep the certificate they were made with.
"""

from __future__ import annotations

import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

log = structlog.get_logger(__name__)


class TLSFilesError(ValueError):
    """A certificate, key or client CA file is missing or unusable."""


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """``client_ca_file`` set: mutual TLS, every client must present a
    certificate signed by it."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    @property
    def files(self) -> tuple[Path, ...]:
        extra = () if self.client_ca_file is None else (self.client_ca_file,)
        return (self.cert_file, self.key_file, *extra)


_Stamp = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True)
class _Material:
    cert: bytes
    key: bytes
    client_ca: bytes | None


class CertificateFiles:
    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        self._stamp, material = self._read()  # TLSFilesError: the server does not start
        self._initial = _configuration(material)
        self.num_reloads = 0

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial,
            self.fetch,
            require_client_authentication=self.tls.client_ca_file is not None,
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate fetcher: a new configuration when the files
        changed and are usable, else None (keep the current one). Never raises."""
        with self._lock:
            try:
                stamp = _stamp(self.tls.files)
                if stamp == self._stamp:
                    return None
                new_stamp, material = self._read()
            except (OSError, TLSFilesError) as exc:
                log.error("tls_reload_failed", detail=str(exc), keeping="the current certificate")
                return None
            self._stamp = new_stamp
            self.num_reloads += 1
        log.info("tls_certificate_reloaded", cert_file=str(self.tls.cert_file))
        return _configuration(material)

    def _read(self) -> tuple[_Stamp, _Material]:
        """The files' stamp and contents, checked; the stamp is taken before
        reading and compared after, so a file replaced mid-read is not taken."""
        tls = self.tls
        try:
            before = _stamp(tls.files)
            material = _Material(
                tls.cert_file.read_bytes(),
                tls.key_file.read_bytes(),
                None if tls.client_ca_file is None else tls.client_ca_file.read_bytes(),
            )
            _check(tls)
            if _stamp(tls.files) != before:
                raise TLSFilesError("the files changed while they were read")
        except OSError as exc:
            raise TLSFilesError(f"cannot read {exc.filename}: {exc.strerror}") from None
        return before, material


def _stamp(files: tuple[Path, ...]) -> _Stamp:
    stats = [os.stat(path) for path in files]
    return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in stats)


def _check(tls: ServerTLS) -> None:
    """The standard library's TLS parses the files: the key must match the
    certificate, the client CA must hold certificates."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as exc:
        raise TLSFilesError(
            f"{tls.cert_file} and {tls.key_file} are not a PEM certificate and its key "
            f"({exc.reason or exc})"
        ) from None
    if tls.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=tls.client_ca_file)
        except ssl.SSLError as exc:
            raise TLSFilesError(
                f"{tls.client_ca_file} is not a PEM CA certificate ({exc.reason or exc})"
            ) from None


def _configuration(material: _Material) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.key, material.cert)], root_certificates=material.client_ca
    )
