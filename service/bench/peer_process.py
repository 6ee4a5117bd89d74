"""What the peers run in other processes share: their error (with the end of
their log) and the wait for an HTTP server's health endpoint."""

from __future__ import annotations

import http.client
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence


class PeerError(RuntimeError):
    """A peer did not produce a usable run; ``log_tail`` holds its last log lines."""

    def __init__(self, message: str, log_tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.log_tail = list(log_tail)

    def report_entry(self, settings: Mapping[str, object]) -> dict[str, object]:
        """The report entry of a failed run (no metrics, so nothing to compare)."""
        return {"error": str(self), "log_tail": self.log_tail, "settings": dict(settings)}


def wait_healthy(
    proc: subprocess.Popen[bytes],
    port: int,
    timeout_s: float,
    fail: Callable[[str], Exception],
    path: str = "/health",
) -> None:
    """Until ``GET path`` answers 200; ``fail(message)`` is raised if the
    process exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise fail(f"exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise fail(f"not healthy after {timeout_s:.0f} s")
