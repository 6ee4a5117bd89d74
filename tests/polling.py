"""Waiting in tests for what another thread or process does."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether ``predicate`` came true within ``timeout_s`` (polled every 20 ms)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
