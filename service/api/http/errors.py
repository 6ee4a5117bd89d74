"""Errors in OpenAI's JSON shape, and the one mapping from Slipstream's
domain errors (``service.api.status``) to HTTP statuses.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from aiohttp import web

from slipstream.scheduler.errors import (
    DeadlineInfeasible,
    Draining,
    DuplicateRequest,
    Overloaded,
    PromptTooLong,
    QueueFull,
)
from slipstream.service.api.auth import PermissionDenied, QuotaExceeded, Unauthenticated
from slipstream.service.api.lifecycle import Loading, NotServing
from slipstream.service.api.status import (
    INVALID,
    Rejection,
    caller_message,
    rejection_for,
    retry_after_ms,
)
from slipstream.service.engine.chat import ChatError

# What a client refused for want of capacity waits when the refusal has no
# hint of its own (a full tokenizer pool), and what a 503 without one says
# (loading, draining, cut off at shutdown). How long the server stays
# unavailable is not known (gRPC's UNAVAILABLE carries no hint either): a
# second is the cap of the gRPC clients' own backoff (clients/balancing.py).
RETRY_AFTER_S = 1

# Every 401 names the scheme it wants (RFC 9110 15.5.2; RFC 6750 3).
BEARER_CHALLENGE = 'Bearer realm="slipstream"'


@dataclass(slots=True)
class ApiError(Exception):
    """A request refused with ``status``; ``rejection`` is how telemetry
    records it (the same reason and gRPC status a gRPC submit would get)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    rejection: Rejection = INVALID

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        """Every 401 names its scheme; every 503 says when to retry (RFC 9110
        10.2.3), its own hint where it has one."""
        headers = self.headers
        if self.status == 401:
            headers = {"WWW-Authenticate": BEARER_CHALLENGE, **headers}
        if self.status == 503:
            headers = {**retry_after(None), **headers}
        return web.Response(
            status=self.status,
            text=json.dumps(self.body()),
            content_type="application/json",
            headers=headers,
        )


def retry_after(seconds: float | None) -> dict[str, str]:
    """The ``Retry-After`` header for a refusal's own hint (the one its
    message and gRPC's ``retry_after_ms`` give), in whole seconds rounded
    up, at least 1; ``RETRY_AFTER_S`` without one."""
    whole = RETRY_AFTER_S if seconds is None else max(1, math.ceil(seconds))
    return {"Retry-After": str(whole)}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def valid_unicode(value: str, name: str, param: str) -> str:
    """``value``, refused when it holds a lone UTF-16 surrogate (JSON's
    ``"\\ud800"``): no UTF-8 encodes one, so protobuf and the tokenizer
    would fail on it. ``name`` says where it is, ``param`` is the field."""
    if value.isascii():
        return value
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        message = f"{name} is not valid Unicode (a lone surrogate at character {exc.start})"
        raise invalid(message, param) from None
    return value


def too_large(message: str, param: str | None = None) -> ApiError:
    return ApiError(413, message, param=param, code="request_too_large")


def internal_error() -> ApiError:
    """A server bug's answer: the details go to the log, not to the caller."""
    return ApiError(500, "the server failed on this request", "server_error", code="internal_error")


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404, f"model {model!r} is not served here", param="model", code="model_not_found"
    )


# Domain error -> (HTTP status, OpenAI error type, code). Most specific first.
_STATUSES: dict[type[Exception], tuple[int, str, str | None]] = {
    PromptTooLong: (400, "invalid_request_error", "context_length_exceeded"),
    ChatError: (400, "invalid_request_error", "invalid_messages"),
    DuplicateRequest: (409, "invalid_request_error", "duplicate_request_id"),
    QueueFull: (429, "rate_limit_exceeded", "queue_full"),
    Overloaded: (429, "rate_limit_exceeded", "overloaded"),
    # The google.rpc mapping of DEADLINE_EXCEEDED; answered before any token.
    DeadlineInfeasible: (504, "deadline_exceeded", "deadline_infeasible"),
    Draining: (503, "service_unavailable", "draining"),
    Loading: (503, "service_unavailable", "loading"),
    NotServing: (503, "service_unavailable", "draining"),
    Unauthenticated: (401, "authentication_error", "invalid_api_key"),
    PermissionDenied: (403, "permission_denied", "permission_denied"),
    QuotaExceeded: (429, "rate_limit_exceeded", "quota_exceeded"),
    ValueError: (400, "invalid_request_error", None),
}


def from_domain(error: Exception, param: str | None = None) -> ApiError | None:
    """The HTTP answer to a domain error a submit raised, or None when the
    caller cannot have caused it (a server bug: let it propagate)."""
    rejection = rejection_for(error)
    if rejection is None:
        return None
    for cls in type(error).__mro__:
        mapped = _STATUSES.get(cls)
        if mapped is not None:
            status, kind, code = mapped
            hint_ms = retry_after_ms(error)
            headers = retry_after(hint_ms / 1000 if hint_ms else None) if status == 429 else {}
            return ApiError(status, caller_message(error), kind, param, code, headers, rejection)
    return None
