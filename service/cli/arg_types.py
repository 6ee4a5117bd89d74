"""argparse types shared by the commands' flags (serve, generate, the benchmarks)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from slipstream.clients.balancing import check_port
from slipstream.clients.wire import MAX_DURATION_S


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (and <= ``high``, if given),
    else a usage error naming it."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def float_where(holds: Callable[[float], bool], rule: str) -> Callable[[str], float]:
    """An argparse type: a number for which ``holds`` is true (NaN never
    is, as no comparison holds for it), else a usage error ``must be {rule}``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not holds(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


positive_float = float_where(lambda v: v > 0, "> 0")  # inf included
positive_finite_float = float_where(lambda v: 0 < v < math.inf, "> 0 and finite")
non_negative_float = float_where(lambda v: v >= 0, ">= 0")  # inf included
non_negative_finite_float = float_where(lambda v: 0 <= v < math.inf, ">= 0 and finite")
fraction = float_where(lambda v: 0 < v <= 1, "in (0, 1]")  # a share


# A flag that fills a wire field takes the field's range: past it, protobuf
# refused the value in words naming no flag ("Value out of range: ...").
positive_uint32 = int_at_least(1, 2**32 - 1)  # a token count
non_negative_int32 = int_at_least(0, 2**31 - 1)  # a priority
non_negative_uint64 = int_at_least(0, 2**64 - 1)  # a seed
# google.protobuf.Duration's range (10,000 years), in milliseconds.
MAX_DURATION_MS = MAX_DURATION_S * 1000
duration_ms = float_where(lambda v: 0 <= v <= MAX_DURATION_MS, f"in [0, {MAX_DURATION_MS}] ms")


def tcp_port(text: str) -> int:
    """An argparse type: a TCP port, 0-65535 (0: the caller's meaning, a free
    port or off), as the clients check a target's (``check_port``)."""
    try:
        return check_port(non_negative_int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
