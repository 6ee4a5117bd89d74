"""Flags of the commands that call a server (``generate --server``,
``chat``, ``stats``): TLS to it and the bearer token to present."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from slipstream.clients.security import TLS

TOKEN_ENV = "SLIPSTREAM_TOKEN"


def add_connection_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Adds the flags, in a group of their own, and returns it."""
    group = parser.add_argument_group("connection (with --server)")
    group.add_argument(
        "--tls", action="store_true", help="TLS, checking the server against the system's CAs"
    )
    group.add_argument("--tls-ca", type=Path, help="TLS, checking the server against this CA")
    group.add_argument("--tls-cert", type=Path, help="client certificate, for mutual TLS")
    group.add_argument("--tls-key", type=Path, help="key of --tls-cert")
    group.add_argument(
        "--tls-server-name", help="name the server's certificate must carry, if not the host's"
    )
    group.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"bearer token for a server with tenants (env {TOKEN_ENV})",
    )
    return group


def call_failed(server: str, code: str, details: str) -> str:
    """The one error line for a call the server refused or that could not be
    made; an UNAUTHENTICATED one says how to give a token."""
    line = f"slipstream: error: {server}: {code}: {details}"
    if code == "UNAUTHENTICATED":
        line += f" (give --token or set {TOKEN_ENV})"
    return line


def unreadable_file(exc: OSError) -> str:
    """The one error line for a --tls-* file that cannot be read."""
    return f"slipstream: error: cannot read {exc.filename}: {exc.strerror}"


def client_tls(args: argparse.Namespace) -> TLS | None:
    """The TLS the flags ask for (any --tls* flag turns it on), or None."""
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name):
        return None
    return TLS(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
