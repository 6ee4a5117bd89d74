"""The server's TLS certificate, re-read without a restart, for both fronts.

gRPC asks ``CertificateFiles.fetch`` before every new connection's handshake
(``grpc.dynamic_ssl_server_credentials``); the HTTP front's ``ssl.SSLContext``
(``CertificateFiles.ssl_context``) asks the same from its server-name
callback, which OpenSSL runs on every ClientHello, SNI or not, and moves the
connection onto a context holding the new pair. Either way the files' stat
(mtime, size, inode) is looked at: unchanged, the current certificate stays;
changed, the files are read again and checked (the key matches the
certificate, the client CA parses, today is inside the certificate's validity
period) before they are taken. A rotation caught half-written (a new
certificate with the old key), or to an expired certificate, fails that
check, is logged, and the old certificate serves until the next connection
finds a usable pair. A certificate that expires within ``EXPIRY_WARNING`` is
taken with a warning. Connections already open keep the certificate they were made
with. Each front has its own ``CertificateFiles``: each sees every change.
"""

from __future__ import annotations

import datetime
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from cryptography import x509

log = structlog.get_logger(__name__)

# A certificate that expires sooner than this is served with a warning at
# start-up and on each rotation to it.
EXPIRY_WARNING = datetime.timedelta(days=7)


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
    context: ssl.SSLContext  # loaded from the same files, between the same two stamps
    not_after: datetime.datetime  # the certificate's, in UTC


class CertificateFiles:
    def __init__(self, tls: ServerTLS, front: str = "grpc") -> None:
        """``front`` names the listener in the reload log lines."""
        self.tls = tls
        self.front = front
        self._lock = threading.Lock()
        self._stamp, material = self._read()  # TLSFilesError: the server does not start
        self._initial = _configuration(material)
        self._context = material.context
        self._warn_if_expiring(material)
        self.num_reloads = 0
        # The files' state (or error) of the last failed reload: said once,
        # not on every connection until the rotation completes.
        self._failed: object = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial,
            self.fetch,
            require_client_authentication=self.tls.client_ca_file is not None,
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate fetcher: a new configuration when the files
        changed and are usable, else None (keep the current one). Never raises."""
        material = self._reload()
        return None if material is None else _configuration(material)

    def ssl_context(self) -> ssl.SSLContext:
        """A server context for the standard library (the HTTP front) that
        serves the files' current pair to each new connection."""
        context = self._context
        context.sni_callback = self._on_client_hello
        return context

    def _on_client_hello(
        self, conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        material = self._reload()
        if material is not None:
            self._context = material.context
        if self._context is not context:
            # OpenSSL keeps the verify mode set when the connection began and
            # verifies against the new context's client CA.
            conn.context = self._context

    def _reload(self) -> _Material | None:
        """The files' contents when they changed and are usable, else None
        (keep the current pair). Never raises."""
        with self._lock:
            stamp: _Stamp | None = None
            try:
                stamp = _stamp(self.tls.files)
                if stamp == self._stamp or stamp == self._failed:
                    return None
                new_stamp, material = self._read()
            except (OSError, TLSFilesError) as exc:
                failed = stamp if stamp is not None else str(exc)
                if failed == self._failed:
                    return None
                self._failed = failed
                log.error(
                    "tls_reload_failed",
                    front=self.front,
                    detail=str(exc),
                    keeping="the current certificate",
                )
                return None
            self._stamp, self._failed = new_stamp, None
            self.num_reloads += 1
        log.info(
            "tls_certificate_reloaded",
            front=self.front,
            cert_file=str(self.tls.cert_file),
            not_after=material.not_after.isoformat(),
        )
        self._warn_if_expiring(material)
        return material

    def _warn_if_expiring(self, material: _Material) -> None:
        left = material.not_after - datetime.datetime.now(datetime.UTC)
        if left < EXPIRY_WARNING:
            log.warning(
                "tls_certificate_expires_soon",
                front=self.front,
                cert_file=str(self.tls.cert_file),
                not_after=material.not_after.isoformat(),
                hours_left=round(left.total_seconds() / 3600, 1),
            )

    def _read(self) -> tuple[_Stamp, _Material]:
        """The files' stamp and contents, checked; the stamp is taken before
        reading and compared after, so a file replaced mid-read is not taken."""
        tls = self.tls
        try:
            before = _stamp(tls.files)
            cert = tls.cert_file.read_bytes()
            material = _Material(
                cert,
                tls.key_file.read_bytes(),
                None if tls.client_ca_file is None else tls.client_ca_file.read_bytes(),
                _server_context(tls),
                _not_after(tls.cert_file, cert, datetime.datetime.now(datetime.UTC)),
            )
            if _stamp(tls.files) != before:
                raise TLSFilesError("the files changed while they were read")
        except OSError as exc:
            raise TLSFilesError(f"cannot read {exc.filename}: {exc.strerror}") from None
        return before, material


def _stamp(files: tuple[Path, ...]) -> _Stamp:
    stats = [os.stat(path) for path in files]
    return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in stats)


def _server_context(tls: ServerTLS) -> ssl.SSLContext:
    """The standard library's TLS parses the files: the key must match the
    certificate, the client CA must hold certificates. The context it loaded
    them into serves the HTTP front; with a client CA it requires a client
    certificate."""
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
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _not_after(cert_file: Path, cert: bytes, now: datetime.datetime) -> datetime.datetime:
    """The server certificate's (the chain's first) expiry; TLSFilesError
    when ``now`` is outside its validity period. OpenSSL loads such a
    certificate without a word, and every client then refuses it."""
    try:
        leaf = x509.load_pem_x509_certificate(cert)
    except ValueError as exc:
        raise TLSFilesError(f"{cert_file} is not a PEM certificate ({exc})") from None
    if now < leaf.not_valid_before_utc:
        raise TLSFilesError(
            f"{cert_file} is not valid until {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
        )
    if now > leaf.not_valid_after_utc:
        raise TLSFilesError(f"{cert_file} expired on {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
    return leaf.not_valid_after_utc


def _configuration(material: _Material) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.key, material.cert)], root_certificates=material.client_ca
    )
