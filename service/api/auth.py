"""Bearer tokens → tenants, and each tenant's limits: the most urgent
priority class it may ask for, the largest ``max_new_tokens``, how many of
its requests may be in flight and how many tokens (prompt + output) it may
spend per minute.

Every front door uses the same two calls::

    gate = tenants.gate(authorization_header)   # Unauthenticated
    spec, grant = gate.admit(spec)  # for each request the call makes
    #   Unauthenticated (its token was revoked since) | PermissionDenied
    #   (never allowed) | QuotaExceeded (retry later)
    ... grant.charge(n) as output tokens are made; grant.release() once, at the end

A gate holds the hash of the call's token: a reload that drops the hash (or
its tenant) refuses the later requests of a call that is already open, as it
refuses new calls. Requests admitted before the reload run to their end.

The tenants file is TOML, one table per tenant; every limit is optional::

    [tenants.search]
    token_sha256 = ["<sha256 hex of a token>", ...]
    max_priority_class = 1     # 0 is the most urgent class
    max_inflight = 32
    tokens_per_minute = 60000  # prompt + output tokens, a token bucket
    max_new_tokens = 1024

Tokens are never kept, only their SHA-256; a presented token is hashed and
compared with every known hash in constant time (``hmac.compare_digest``).
Nothing here logs a token or a hash. Thread-safe: grants are charged and
released on the engine thread, tenants admitted on the event loop.

The token bucket holds at most one minute's worth and refills continuously.
A request needs its prompt tokens in the bucket to be admitted; output
tokens are taken as they are made, so a long answer may leave the bucket in
debt, which delays the tenant's next requests rather than cutting this one.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from slipstream.service.engine.events import (
    Event,
    EventCallback,
    FinishEvent,
    RequestSpec,
)

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_LIMITS = ("max_priority_class", "max_inflight", "tokens_per_minute", "max_new_tokens")
# A full in-flight quota frees up when one of the tenant's requests ends,
# which nothing here can predict; a short hint keeps clients from hammering.
INFLIGHT_RETRY_S = 1.0


class Unauthenticated(Exception):
    """No bearer token, or one no tenant holds (UNAUTHENTICATED, the whole call)."""


class PermissionDenied(Exception):
    """The tenant may never make this request (PERMISSION_DENIED)."""


class QuotaExceeded(Exception):
    """The tenant's in-flight or token-rate quota is used up for now
    (RESOURCE_EXHAUSTED); ``retry_after_s`` says when a retry may succeed."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(f"{message}; retry after {math.ceil(retry_after_s * 1000)} ms")
        self.retry_after_s = retry_after_s


class TenantsFileError(ValueError):
    """The tenants file is missing, not TOML, or not in the documented shape."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant as configured; ``None`` is no limit."""

    name: str
    token_sha256: tuple[str, ...]
    max_priority_class: int | None = None
    max_inflight: int | None = None
    tokens_per_minute: int | None = None
    max_new_tokens: int | None = None


# ---------------------------------------------------------------- the file


def token_sha256(token: str) -> str:
    """The hex SHA-256 a tenants file lists for ``token`` (``printf %s TOKEN | sha256sum``)."""
    return hashlib.sha256(token.encode()).hexdigest()


def parse_tenants(text: str, source: str = "tenants file") -> dict[str, Tenant]:
    """Tenants by name from TOML text; raises TenantsFileError naming what is wrong."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"{source}: not valid TOML: {exc}") from None
    extra = set(document) - {"tenants"}
    if extra:
        raise TenantsFileError(f"{source}: unknown top-level keys {sorted(extra)}")
    tables = document.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise TenantsFileError(f"{source}: no [tenants.NAME] tables")
    tenants = {name: _tenant(name, table, source) for name, table in tables.items()}
    owners: dict[str, str] = {}
    for tenant in tenants.values():
        for digest in tenant.token_sha256:
            if digest in owners:
                raise TenantsFileError(
                    f"{source}: tenants {owners[digest]!r} and {tenant.name!r} share a token"
                )
            owners[digest] = tenant.name
    return tenants


def load_tenants(path: Path) -> dict[str, Tenant]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsFileError(f"cannot read tenants file {path}: {exc}") from None
    return parse_tenants(text, str(path))


def _tenant(name: str, table: object, source: str) -> Tenant:
    where = f"{source}: [tenants.{name}]"
    if not isinstance(table, dict):
        raise TenantsFileError(f"{where} must be a table")
    unknown = set(table) - {"token_sha256", *_LIMITS}
    if unknown:
        raise TenantsFileError(f"{where}: unknown keys {sorted(unknown)}")
    digests = table.get("token_sha256")
    if not isinstance(digests, list) or not digests:
        raise TenantsFileError(f"{where}: token_sha256 must be a non-empty list of hex digests")
    normalized = []
    for digest in digests:
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest.strip().lower()):
            raise TenantsFileError(f"{where}: token_sha256 entries must be 64 hex digits")
        normalized.append(digest.strip().lower())
    limits: dict[str, int] = {}
    for key in _LIMITS:
        if key in table:
            value = table[key]
            low = 0 if key == "max_priority_class" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise TenantsFileError(f"{where}: {key} must be an integer >= {low}")
            limits[key] = value
    return Tenant(name=name, token_sha256=tuple(normalized), **limits)


# ---------------------------------------------------------------- runtime


@dataclass(slots=True)
class _Usage:
    """One tenant's counters (guarded by ``Tenants._lock``)."""

    tenant: Tenant
    num_inflight: int = 0
    bucket: float = 0.0  # tokens available; negative while in debt
    refilled_at: float = 0.0

    def refill(self, now: float) -> None:
        rate = self.tenant.tokens_per_minute
        if rate is None:
            return
        self.bucket = min(float(rate), self.bucket + (now - self.refilled_at) * rate / 60.0)
        self.refilled_at = now

    def is_settled(self, now: float) -> bool:
        """Nothing in flight and the bucket full: nothing left to remember."""
        self.refill(now)
        rate = self.tenant.tokens_per_minute
        return self.num_inflight == 0 and (rate is None or self.bucket >= rate)


@dataclass(slots=True)
class Grant:
    """One admitted request's hold on its tenant's quota. ``charge`` output
    tokens as they are made; ``release`` exactly once when it ends (further
    calls do nothing)."""

    tenants: Tenants
    usage: _Usage
    num_charged: int = 0
    is_released: bool = False

    @property
    def tenant(self) -> Tenant:
        return self.usage.tenant

    def charge(self, num_tokens: int) -> None:
        self.tenants._charge(self, num_tokens)

    def release(self, num_output_tokens: int | None = None) -> None:
        """Frees the in-flight slot; ``num_output_tokens`` (the request's
        final count) charges whatever ``charge`` has not yet."""
        self.tenants._release(self, num_output_tokens)

    def wrap(self, on_event: EventCallback) -> EventCallback:
        """An engine callback that charges token events and releases on the
        finish event, then hands every event on to ``on_event``."""

        def charged(event: Event) -> None:
            if isinstance(event, FinishEvent):
                self.release(event.num_output_tokens)
            else:
                self.charge(len(event.token_ids))
            on_event(event)

        return charged


class Tenants:
    """The tenants of one server and their live usage. ``replace`` swaps in
    a re-read file; a tenant that keeps its name keeps its usage, and so does
    one removed and added back while its requests still ran or its bucket
    still refilled (a typo fixed in two reloads must not reset its limits)."""

    def __init__(
        self, tenants: Mapping[str, Tenant], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._usage: dict[str, _Usage] = {}
        self._removed: dict[str, _Usage] = {}  # not settled yet, by name
        self._digests: list[tuple[str, _Usage]] = []
        self.replace(tenants)

    @classmethod
    def from_file(cls, path: Path) -> Tenants:
        return cls(load_tenants(path))

    @property
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._usage)

    def replace(self, tenants: Mapping[str, Tenant]) -> None:
        now = self._clock()
        with self._lock:
            known = {**self._removed, **self._usage}
            usage: dict[str, _Usage] = {}
            for name, tenant in tenants.items():
                old = known.get(name)
                if old is None:
                    rate = tenant.tokens_per_minute
                    usage[name] = _Usage(tenant, bucket=float(rate or 0), refilled_at=now)
                else:
                    old.refill(now)
                    rate = tenant.tokens_per_minute
                    if rate is not None and old.tenant.tokens_per_minute is None:
                        old.bucket, old.refilled_at = float(rate), now  # a new limit starts full
                    elif rate is not None:
                        old.bucket = min(old.bucket, float(rate))
                    old.tenant = tenant
                    usage[name] = old
            self._usage = usage
            self._removed = {
                name: gone
                for name, gone in known.items()
                if name not in usage and not gone.is_settled(now)
            }
            self._digests = [(d, u) for u in usage.values() for d in u.tenant.token_sha256]

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant whose token an ``authorization`` header (``Bearer <token>``)
        carries; raises Unauthenticated."""
        return self.gate(authorization).tenant

    def gate(self, authorization: str | None) -> TenantGate:
        """``authenticate``, bound to the token: what a call admits its
        requests through. Every known digest is compared, so the time taken
        does not depend on which one matches."""
        if not authorization:
            raise Unauthenticated("missing bearer token (authorization: Bearer <token>)")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("the authorization header must be 'Bearer <token>'")
        presented = token_sha256(token)
        with self._lock:
            digests = self._digests
        found: _Usage | None = None
        for digest, usage in digests:
            if hmac.compare_digest(presented.encode(), digest.encode()):
                found = usage
        if found is None:
            raise Unauthenticated("unknown bearer token")
        return TenantGate(self, found.tenant, presented)

    def admit(
        self,
        tenant: Tenant,
        priority: int,
        max_new_tokens: int,
        num_prompt_tokens: int,
        token_digest: str | None = None,
    ) -> Grant:
        """A grant for one request of ``tenant``; raises Unauthenticated when
        a reload has since dropped the tenant or ``token_digest`` (the hash of
        the token the request came with), PermissionDenied for a request it
        may never make, QuotaExceeded when it must wait."""
        now = self._clock()
        with self._lock:
            usage = self._usage.get(tenant.name)
            if usage is None:  # removed by a reload since it authenticated
                raise Unauthenticated(f"tenant {tenant.name!r} was removed by a tenants reload")
            limits = usage.tenant  # the latest file's, should it have been re-read
            if token_digest is not None and not _lists(limits, token_digest):
                raise Unauthenticated(
                    f"the bearer token was revoked by a tenants reload (tenant {tenant.name!r})"
                )
            _check_permission(limits, priority, max_new_tokens, num_prompt_tokens)
            if limits.max_inflight is not None and usage.num_inflight >= limits.max_inflight:
                raise QuotaExceeded(
                    f"tenant {tenant.name!r} has {usage.num_inflight} requests in flight "
                    f"(max_inflight {limits.max_inflight})",
                    INFLIGHT_RETRY_S,
                )
            rate = limits.tokens_per_minute
            if rate is not None:
                usage.refill(now)
                if usage.bucket < num_prompt_tokens:
                    wait_s = (num_prompt_tokens - usage.bucket) * 60.0 / rate
                    raise QuotaExceeded(
                        f"tenant {tenant.name!r} is over its {rate} tokens per minute", wait_s
                    )
                usage.bucket -= num_prompt_tokens
            usage.num_inflight += 1
        return Grant(self, usage)

    def num_inflight(self, name: str) -> int:
        with self._lock:
            usage = self._usage.get(name)
            return 0 if usage is None else usage.num_inflight

    def _charge(self, grant: Grant, num_tokens: int) -> None:
        # Once per token event on the engine thread: no lock without a rate.
        if num_tokens <= 0 or grant.usage.tenant.tokens_per_minute is None:
            return
        with self._lock:
            if grant.is_released:
                return
            grant.num_charged += num_tokens
            grant.usage.refill(self._clock())
            grant.usage.bucket -= num_tokens

    def _release(self, grant: Grant, num_output_tokens: int | None) -> None:
        with self._lock:
            if grant.is_released:
                return
            grant.is_released = True
            usage = grant.usage
            usage.num_inflight -= 1
            owed = 0 if num_output_tokens is None else num_output_tokens - grant.num_charged
            if owed > 0 and usage.tenant.tokens_per_minute is not None:
                usage.refill(self._clock())
                usage.bucket -= owed


def _lists(tenant: Tenant, digest: str) -> bool:
    """Whether ``tenant`` still holds the token of hash ``digest``; each of
    its few hashes is compared, in constant time."""
    listed = False
    for known in tenant.token_sha256:
        listed |= hmac.compare_digest(digest.encode(), known.encode())
    return listed


def _check_permission(
    tenant: Tenant, priority: int, max_new_tokens: int, num_prompt_tokens: int
) -> None:
    if tenant.max_priority_class is not None and priority < tenant.max_priority_class:
        raise PermissionDenied(
            f"tenant {tenant.name!r} may not use priority class {priority} "
            f"(its most urgent is {tenant.max_priority_class})"
        )
    if tenant.max_new_tokens is not None and max_new_tokens > tenant.max_new_tokens:
        raise PermissionDenied(
            f"max_new_tokens {max_new_tokens} is over tenant {tenant.name!r}'s "
            f"{tenant.max_new_tokens}"
        )
    rate = tenant.tokens_per_minute
    if rate is not None and num_prompt_tokens > rate:
        raise PermissionDenied(
            f"a prompt of {num_prompt_tokens} tokens is over tenant {tenant.name!r}'s "
            f"{rate} tokens per minute"
        )


def authorization_header(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The first ``authorization`` value of gRPC call metadata."""
    for key, value in metadata:
        if key.lower() == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


@dataclass(frozen=True, slots=True)
class TenantGate:
    """One call's tenant, bound to the registry and to the call's token: what
    a session admits its requests through (``Tenants.gate`` makes one)."""

    tenants: Tenants
    tenant: Tenant
    token_digest: str  # the SHA-256 of the call's token; never logged

    @property
    def default_priority(self) -> int:
        """The class of a request that names none: the most urgent this
        tenant may use, so a caller that never heard of priorities is served."""
        return self.tenant.max_priority_class or 0

    def admit(self, request: RequestSpec) -> tuple[RequestSpec, Grant]:
        """``request`` labelled with the tenant, and its grant."""
        grant = self.tenants.admit(
            self.tenant,
            request.priority,
            request.max_new_tokens,
            len(request.prompt_token_ids),
            self.token_digest,
        )
        return replace(request, tenant=self.tenant.name), grant
