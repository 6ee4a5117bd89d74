"""Client-side balancing over several replicas, all through gRPC's own
service config (no proxy, no home-made router):

- ``round_robin`` over every address the name resolves to (a list of
  addresses, ``dns:///name:port`` or an ``ipv4:``/``ipv6:`` list);
- client health checking: a replica whose ``slipstream.v1.Inference`` health
  is NOT_SERVING (loading, draining) gets no new calls;
- a retry policy: a call that failed UNAVAILABLE before any response
  message (a replica that went away or refused it while draining) is sent
  again, to another replica. A call that has received a message (Accepted)
  is never retried: gRPC commits to the replica at the first response.

The retry policy covers ``GenerateOne`` and the unary calls. ``Generate``
(one long-lived stream, many requests) is not retried: its requests are
the caller's to resubmit.

    from slipstream.clients import Client
    client = Client(["10.0.0.5:50051", "10.0.0.6:50051"])        # or
    client = Client("dns:///slipstream.default.svc:50051", balanced=True)
    client.generate_one("Hello", max_tokens=16).result()
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence

SERVICE = "slipstream.v1.Inference"
RETRIED_METHODS = ("GenerateOne", "Tokenize", "GetModelInfo", "GetServerStats")


def service_config(
    *,
    health_service: str | None = SERVICE,
    max_attempts: int = 5,
    initial_backoff_s: float = 0.05,
    max_backoff_s: float = 1.0,
) -> str:
    """The service config JSON: round_robin, health checking (unless
    ``health_service`` is None) and the UNAVAILABLE retry policy."""
    if not 2 <= max_attempts <= 5:
        raise ValueError("max_attempts must be in [2, 5] (gRPC caps retries at 5 attempts)")
    config: dict[str, object] = {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [{"service": SERVICE, "method": method} for method in RETRIED_METHODS],
                "retryPolicy": {
                    "maxAttempts": max_attempts,
                    "initialBackoff": f"{initial_backoff_s}s",
                    "maxBackoff": f"{max_backoff_s}s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
    if health_service is not None:
        config["healthCheckConfig"] = {"serviceName": health_service}
    return json.dumps(config)


def channel_options(config: str | None = None) -> list[tuple[str, object]]:
    """Channel options that apply ``config`` (default: ``service_config()``)
    and ignore any service config a DNS TXT record might carry."""
    return [
        ("grpc.service_config", config or service_config()),
        ("grpc.service_config_disable_resolution", 1),
        ("grpc.enable_retries", 1),
    ]


def channel_target(addresses: str | Sequence[str]) -> str:
    """One gRPC target for ``addresses``: a string is used as is
    (``host:port``, ``[::1]:port``, ``dns:///name:port``, ``ipv4:a:p,b:p``,
    ``unix:path``); a list of IP ``host:port`` literals becomes an
    ``ipv4:``/``ipv6:`` target. An address without a port is refused: gRPC
    would dial 443."""
    if isinstance(addresses, str):
        for address in _target_addresses(addresses):
            _split_host_port(address)
        return addresses
    if not addresses:
        raise ValueError("no server addresses given")
    hosts = [_split_host_port(address) for address in addresses]
    versions = set()
    for host, _ in hosts:
        try:
            versions.add(ipaddress.ip_address(host).version)
        except ValueError:
            raise ValueError(
                f"{host!r} is not an IP address: list IP:port addresses, or give "
                "one 'dns:///name:port' target that resolves to every replica"
            ) from None
    if len(versions) > 1:
        raise ValueError("mix of IPv4 and IPv6 addresses: use a dns:/// name instead")
    if versions == {4}:
        return "ipv4:" + ",".join(f"{h}:{p}" for h, p in hosts)
    return "ipv6:" + ",".join(f"[{h}]:{p}" for h, p in hosts)


# Targets whose resolver takes no port: a socket path, a vsock CID:port.
_PORTLESS_SCHEMES = ("unix:", "unix-abstract:", "vsock:")


def _target_addresses(target: str) -> list[str]:
    """The ``host:port`` parts of a gRPC target that name a TCP address."""
    if target.startswith(_PORTLESS_SCHEMES):
        return []
    if target.startswith(("ipv4:", "ipv6:")):
        return target.partition(":")[2].split(",")
    if target.startswith("dns:"):
        name = target.removeprefix("dns:")
        # dns:///name:port or dns://authority/name:port; dns:name:port
        return [name[2:].partition("/")[2] if name.startswith("//") else name]
    if "://" in target:  # another resolver's target: its rules, not ours
        return []
    return [target]


def _split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port or (host.startswith("[") and not host.endswith("]")):
        # "localhost", "localhost:", "[::1]" (its last colon is the address's)
        raise ValueError(f"address {address!r} has no port (HOST:PORT, e.g. localhost:50051)")
    if not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    _check_port(port, address)
    return host.strip("[]"), int(port)


MAX_PORT = 65535


def check_port(port: int) -> int:
    """``port`` where it is a TCP port, else ValueError: gRPC would take 70000
    as 70000 - 65536 and dial (or listen on) 4464."""
    if not 0 <= port <= MAX_PORT:
        raise ValueError(f"a port is 0-{MAX_PORT}, got {port}")
    return port


def _check_port(port: str, address: str) -> None:
    try:
        check_port(int(port))
    except ValueError as exc:
        raise ValueError(f"address {address!r}: {exc}") from None
