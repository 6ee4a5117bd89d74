"""The CPU load and calibration leave no OpenMP team on the calling thread
(``kernels/compute_thread.py``): the engine's thread is the only one, and its
parallel regions keep their workers awake between them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import structlog
import torch

from slipstream.kernels.compute_thread import on_own_thread
from slipstream.service.engine.runner import SLEEPING_WORKERS

# A fresh interpreter: load `tiny` on the main thread as `serve` does, then
# time-slice torch's parallel regions on another thread (the engine's) and
# count the voluntary context switches of every thread meanwhile. A team
# that sleeps between regions makes up to two per region (0.6-2.0 on an AMD
# EPYC Zen 5, where its worker sometimes catches the next region still
# spinning); one that stays awake, none.
_PROBE = textwrap.dedent(
    """
    import os, sys, threading, torch
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # serve's default: one thread a CPU
    from slipstream.service.engine.config import EngineConfig
    from slipstream.service.engine import calibration, loader
    if sys.argv[1] == "on-the-caller":  # the code before: the load runs where it is called
        loader.on_own_thread = calibration.on_own_thread = lambda fn, name: fn()
    engine = loader.load_engine(EngineConfig(model="tiny", dtype="float32"))
    engine.start()  # its runner checks its thread's workers, and warns if they sleep
    engine.shutdown()

    from slipstream.kernels.compute_thread import sleeps_per_region

    def regions():
        print(sleeps_per_region(1000))
    engine_like = threading.Thread(target=regions)
    engine_like.start()
    engine_like.join()
    """
)


def _switches_per_region(where: str) -> tuple[float, bool]:
    """Switches a region on a thread other than the loader's, and whether the
    engine's runner warned that its workers sleep."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, where],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1]), "openmp_workers_sleep" in out.stdout


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity")
    or len(os.sched_getaffinity(0)) < 2
    or not os.path.isdir("/proc/self/task")
    or "OpenMP" not in torch.__config__.parallel_info(),
    reason="needs 2+ CPUs, Linux's /proc and torch on OpenMP",
)
def test_after_a_load_another_threads_parallel_regions_keep_their_workers_awake() -> None:
    switches, warned = _switches_per_region("on-its-own-thread")
    assert switches < SLEEPING_WORKERS and not warned
    # The check can tell: loaded on the caller's thread, the regions sleep,
    # and the engine says so in its log. The engine's own probe is short, so
    # under a loaded machine (xdist's other workers) one start can miss it:
    # the control gets three tries, each a fresh interpreter.
    tries = [_switches_per_region("on-the-caller")]
    while len(tries) < 3 and not (tries[-1][0] > SLEEPING_WORKERS and tries[-1][1]):
        tries.append(_switches_per_region("on-the-caller"))
    switches, warned = tries[-1]
    assert switches > SLEEPING_WORKERS and warned, tries


def test_on_own_thread_returns_raises_and_carries_the_callers_context() -> None:
    caller = threading.current_thread()
    seen: list[threading.Thread] = []

    def work() -> dict[str, object]:
        seen.append(threading.current_thread())
        return structlog.contextvars.get_contextvars()

    with structlog.contextvars.bound_contextvars(request="r1"):
        assert on_own_thread(work, "probe") == {"request": "r1"}
    assert seen[0] is not caller and not seen[0].is_alive()

    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        on_own_thread(fail, "probe")


def test_on_own_thread_called_on_such_a_thread_runs_right_there() -> None:
    threads: list[threading.Thread] = []

    def outer() -> None:
        threads.append(threading.current_thread())
        on_own_thread(lambda: threads.append(threading.current_thread()), "inner")

    on_own_thread(outer, "outer")
    assert threads[0] is threads[1]  # a calibration inside a load: no second team


@pytest.mark.parametrize(("load", "busy"), [(7.5, True), (0.4, False)])
def test_sleeping_workers_on_a_busy_host_are_blamed_on_the_host(monkeypatch, load, busy) -> None:
    """At a 1-minute load of 7 on 2 CPUs the workers sleep whatever this
    process does: the warning said another OpenMP team of it was the cause."""
    from structlog.testing import capture_logs

    from slipstream.service.engine import runner

    monkeypatch.setattr(runner, "sleeps_per_region", lambda: 1.2)
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(runner.os, "sched_getaffinity", lambda pid: {0, 1})
    with capture_logs() as logs:
        runner.ModelRunner.on_engine_thread(object())  # type: ignore[arg-type]
    [warning] = [line for line in logs if line["event"] == "openmp_workers_sleep"]
    assert ("the host is busy" in warning["detail"]) is busy, warning
    assert ("another thread of this process" in warning["detail"]) is not busy, warning
    assert warning.get("load_1m") == (load if busy else None)
