"""CPU torch work that must not leave an OpenMP team on the calling thread.

torch's CPU kernels run their parallel regions on OpenMP (GNU libgomp), and
each OS thread that enters one keeps a team of worker threads for good.
Once the process's teams hold more threads than it has CPUs, libgomp stops
spinning between regions: every region then puts its workers to sleep and
wakes them again (about two context switches a region). The engine steps on
its own thread, so a model loaded on the caller's thread (the main one)
left a second team there, idle but counted, and every step paid for it.
Measured on a 2-core AMD EPYC Zen 3, 2 torch threads: a SiLU over 28 x
1,536 floats took 30 us on the only team and 95-110 us beside an idle
second one; `bench offline --requests 64` on `small` went from 360-378 to
468-478 output tok/s, on `tiny` (256 requests) 1.28-1.69x in four pairs.

So the CPU load, the start-up calibration and the CPU probe (oneDNN's
bf16 reorder is a parallel region where the CPU has native bf16) run on a
thread of their own that ends when they do, taking its team with it, and
the engine's thread is left the only one; ``sleeps_per_region`` tells
whether it is. A team that spins is the worse neighbour of another busy
process on the same cores (docs/performance.md, "One OpenMP team").
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")

_local = threading.local()  # .active: this thread is one on_own_thread started


def on_own_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` run to completion on a new thread that then ends; its result
    returned, or its exception raised here. The caller's context variables
    (structlog's bound fields) go with it. Called on such a thread already
    (a calibration inside a load), ``fn`` runs right there: a thread
    started beside it would make a second team while the first lives."""
    if getattr(_local, "active", False):
        return fn()
    context = contextvars.copy_context()
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        _local.active = True
        try:
            outcome.append(context.run(fn))
        except BaseException as exc:  # handed to the caller, whatever it is
            failure.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


# Past torch's grain (32,768 elements): each SiLU over it is one parallel region.
_PROBE_SHAPE = (64, 4096)


def sleeps_per_region(regions: int = 200) -> float | None:
    """Voluntary context switches of the whole process per torch parallel
    region run on the calling thread: 0 where its OpenMP team is the only one
    (the workers spin between regions), ~0.6-2 where another team has made
    libgomp put them to sleep after each. None where it cannot be told: one
    CPU, no /proc, or torch not on OpenMP. Costs a few ms."""
    tasks = Path("/proc/self/task")
    if (
        not tasks.is_dir()  # first: no /proc, no os.sched_getaffinity either (macOS)
        or len(os.sched_getaffinity(0)) < 2
        or torch.get_num_threads() < 2
        or "OpenMP" not in torch.__config__.parallel_info()
    ):
        return None
    x = torch.randn(_PROBE_SHAPE)
    for _ in range(20):  # the team is started and its threads settled
        torch.nn.functional.silu(x)
    before = _voluntary_switches(tasks)
    for _ in range(regions):
        torch.nn.functional.silu(x)
    return (_voluntary_switches(tasks) - before) / regions


def _voluntary_switches(tasks: Path) -> int:
    total = 0
    for task in tasks.iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # a thread that ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                total += int(line.split()[1])
    return total
