"""``slipstream serve`` in a process of its own, as in production: the
server the load-generating benchmarks (``bench serve``, ``bench soak``) send
their requests to."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager


@contextmanager
def spawned_serve(
    flags: Sequence[str], env: Mapping[str, str] | None = None
) -> Iterator[tuple[int, str]]:
    """``slipstream serve --port 0 FLAGS`` as (pid, host:port) once it
    listens, stopped with SIGTERM on exit; ``env`` replaces the inherited
    environment when given."""
    command = [sys.executable, "-m", "slipstream.service.cli", "serve", "--port", "0", *flags]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=None if env is None else dict(env),
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.search(r"listening on (\S+:\d+)", line)
            if match:
                break
        else:
            raise RuntimeError(f"slipstream serve exited with {proc.wait()}")
        # Keep reading so a full pipe never blocks the server.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield proc.pid, match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
