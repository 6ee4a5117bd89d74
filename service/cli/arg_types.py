"""argparse types shared by the commands' flags (serve, generate, the benchmarks)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``, else a usage error naming it."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (``inf`` included), else a usage error."""
    value = _number(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0, else a usage error."""
    value = _number(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a share in (0, 1], else a usage error."""
    value = _number(text)
    if not 0 < value <= 1:  # NaN too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def tcp_port(text: str) -> int:
    """An argparse type: a TCP port, 0-65535 (0: the caller's meaning, a free
    port or off). gRPC would take 70000 as 70000 - 65536 and listen there."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {value}")
    return value
