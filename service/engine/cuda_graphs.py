"""CUDA graphs for decode-only steps: one graph per padded batch size.

A decode step of n sequences replays the graph of the smallest captured size
``B >= n`` (``bucket_for``); rows ``n .. B`` are padding (``staging.stage_step``
with ``pad_to``). Graphs read their inputs from the staging buffer's device
twin, whose regions never move, and write logits into the output tensor
captured with them: a replay is the staging copy, then ``graph.replay()``.
Sizes are captured largest first into one shared memory pool (a smaller
graph's activations fit in the larger one's), after an eager warm-up of the
same size that compiles the Triton kernels and lets cuBLAS pick its kernels
outside the capture.

Steps with a prefill chunk, or more sequences than the largest size, run
eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)

_Out = TypeVar("_Out")


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 below ``max_batch``, then ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 8))
    return [*sizes, max_batch]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows; None when none does."""
    if num_seqs < 1:
        return None
    for size in sizes:  # ascending, a few dozen at most
        if size >= num_seqs:
            return size
    return None


@dataclass(slots=True)
class GraphStats:
    """For the start-up log line and ``GetModelInfo``."""

    enabled: bool
    batch_sizes: list[int] = field(default_factory=list)
    capture_seconds: float = 0.0
    memory_bytes: int = 0
    disabled_reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "batch_sizes": list(self.batch_sizes),
            "capture_seconds": round(self.capture_seconds, 3),
            "memory_bytes": self.memory_bytes,
            "disabled_reason": self.disabled_reason,
        }

    def log_line(self, sizes: str) -> str:
        """For the start-up log: ``sizes`` names what the sizes count."""
        if not self.enabled:
            return f"off ({self.disabled_reason or 'disabled'})"
        first, last = self.batch_sizes[0], self.batch_sizes[-1]
        return (
            f"{len(self.batch_sizes)} {sizes} {first}..{last} captured in "
            f"{self.capture_seconds:.2f} s, {self.memory_bytes / (1 << 20):.0f} MiB"
        )


class DecodeGraphs:
    """Captured decode graphs by padded batch size.

    ``prepare(B)`` stages and uploads a B-row padding step (outside any
    capture); ``body(B)`` runs the step's device work on the staged inputs and
    returns its logits ``[B, vocab]``; it must allocate nothing that outlives it
    but the returned tensor, and must not synchronise.
    """

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(sizes)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(
        self,
        device: torch.device,
        prepare: Callable[[int], None],
        body: Callable[[int], torch.Tensor],
    ) -> GraphStats:
        """Captures every size; on a CUDA out-of-memory error drops them all and
        says so in the stats (the engine then runs every step eagerly)."""
        try:
            captured, stats = capture_sizes(
                self.sizes, device, prepare, lambda size: [partial(body, size)]
            )
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
            stats = GraphStats(enabled=False, disabled_reason=f"capture out of memory: {exc}")
        if not stats.enabled:  # outside the except: its traceback no longer holds the graphs
            torch.cuda.empty_cache()
            log.warning("cuda graph capture ran out of memory; decode steps run eagerly")
            return stats
        self._graphs = {size: graphs[0] for size, graphs in captured.items()}
        return stats

    def replay(self, size: int) -> torch.Tensor:
        """Replays the graph of ``size`` on the current stream; returns its logits
        tensor, valid until the next replay."""
        graph, logits = self._graphs[size]
        graph.replay()
        return logits

    def __contains__(self, size: int) -> bool:
        return size in self._graphs


def capture_sizes(
    sizes: list[int],
    device: torch.device,
    prepare: Callable[[int], None],
    bodies: Callable[[int], list[Callable[[], _Out]]],
) -> tuple[dict[int, list[tuple[torch.cuda.CUDAGraph, _Out]]], GraphStats]:
    """For each size, largest first: ``prepare(size)``, then each of
    ``bodies(size)`` captured in turn (``capture_graph``), all into one memory
    pool. Returns, by size, each graph with what its captured run returned,
    and the stats: the whole capture's time and the device memory it took.
    Raises what a capture raises; the caller says which errors leave it eager."""
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    start = time.perf_counter()
    pool = None
    captured: dict[int, list[tuple[torch.cuda.CUDAGraph, _Out]]] = {}
    for size in sorted(sizes, reverse=True):
        prepare(size)
        graphs = []
        for body in bodies(size):
            graph, out, pool = capture_graph(body, device, pool)
            graphs.append((graph, out))
        captured[size] = graphs
    torch.cuda.synchronize(device)
    used = max(free_before - torch.cuda.mem_get_info(device)[0], 0)
    return captured, GraphStats(True, sorted(sizes), time.perf_counter() - start, used)


def capture_graph(
    body: Callable[[], _Out], device: torch.device, pool: Any
) -> tuple[torch.cuda.CUDAGraph, _Out, Any]:
    """Runs ``body`` once eagerly (Triton compiles, cuBLAS picks its kernels
    outside the capture), then captures it into ``pool`` (None: a new one).
    Returns the graph, what the captured run returned (rewritten by each
    replay) and the pool, for the next capture to share."""
    body()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out, graph.pool() if pool is None else pool


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA allocation failure, also when it surfaces as the error of ending
    a capture it broke (the original is then the exception's context)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError) or "out of memory" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
