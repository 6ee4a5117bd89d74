"""How a client proves who it talks to and who it is: TLS (the server's CA,
optionally a client certificate for mutual TLS) and a bearer token.

    Client("inference.internal:443", tls=TLS(ca_file="ca.pem"), token=os.environ["TOKEN"])
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from slipstream.clients.wire import Metadata


@dataclass(frozen=True, slots=True)
class TLS:
    """``ca_file``: the CA that signed the server's certificate (None: the
    system's roots); ``cert_file`` and ``key_file``: this client's certificate
    and key, for a server that asks for one (mutual TLS); ``server_name``:
    the name to check the server's certificate against, when it differs from
    the target's host."""

    ca_file: str | Path | None = None
    cert_file: str | Path | None = None
    key_file: str | Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                "a client certificate needs its key, and a key its certificate: give both "
                "(cert_file with key_file; on the command line, --tls-cert with --tls-key)"
            )

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials from the files (read now; OSError if unreadable)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )

    def channel_options(self) -> list[tuple[str, object]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def _read(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def bearer_metadata(token: str | None) -> list[tuple[str, str]]:
    """The call metadata carrying ``token`` (none without one)."""
    if token is None:
        return []
    token = token.strip()
    if not token or any(c.isspace() for c in token):
        raise ValueError("a bearer token must be non-empty and contain no whitespace")
    return [("authorization", f"Bearer {token}")]


def with_token(metadata: Metadata, token: str | None) -> list[tuple[str, str]]:
    """A client's base metadata: ``metadata`` plus the token's (the trace
    context is added per call, by ``call_metadata``)."""
    pairs = list(metadata.items() if isinstance(metadata, Mapping) else metadata or ())
    if any(key.lower() == "authorization" for key, _ in pairs) and token is not None:
        raise ValueError("give the token either as token= or in metadata, not both")
    return [*bearer_metadata(token), *pairs]


def secure_channel(
    target: str, tls: TLS | None, options: list[tuple[str, object]] | None
) -> grpc.Channel:
    """A blocking channel: TLS when ``tls`` is given, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(
        target, tls.credentials(), options=[*(options or []), *tls.channel_options()]
    )


def secure_aio_channel(
    target: str, tls: TLS | None, options: list[tuple[str, object]] | None
) -> grpc.aio.Channel:
    """An asyncio channel: TLS when ``tls`` is given, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(
        target, tls.credentials(), options=[*(options or []), *tls.channel_options()]
    )
