"""Timing one decode step of the real ``ModelRunner``, and the memory-read
floors it is compared with.

Two passes over the same synthetic plan:

- **plain**: ``runner.execute(plan)`` wall time per step, nothing added. This
  is the step time a report quotes.
- **hooked**: the same steps with ``perf_counter_ns`` accumulators around the
  model's paged-attention callable, every ``Linear.__call__`` and
  ``Linear.argmax`` (lm_head included), ``LlamaModel.forward`` and the
  runner's ``sample`` call. The
  hooks cost a few microseconds per call, so this pass is slower than the
  plain one and only its *split* is reported::

      execute ─┬─ host      (plan -> tensors and attention metadata, result dict)
               ├─ forward ──┬─ attention   (paged attention calls)
               │            ├─ linears     (every projection, lm_head included)
               │            └─ rest        (embedding, norms, RoPE, KV write, residuals)
               └─ sample    (argmax over the logits; none where the LM head
                             picks a greedy step's tokens, ``Linear.argmax``)

  ``host`` and ``rest`` are residuals (execute minus what is hooked inside
  it); the other parts are timed directly. Where the layer loop is one
  native call (``model.native_layers``), it times its own attention and
  projection calls (``model.layer_part_ns``) and the hooks see the calls
  made from Python (lm_head, sampling).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from slipstream.kernels.kv_layout import fill_normal_
from slipstream.scheduler.plan import StepPlan
from slipstream.scheduler.request import SamplingParams
from slipstream.service.engine.calibration import synthetic_plan
from slipstream.service.engine.runner import kv_bytes_per_block

if TYPE_CHECKING:
    from slipstream.service.engine.runner import ModelRunner
    from slipstream.service.models.llama import LlamaModel

FLOOR_REPEATS = 9


def blocks_per_seq(context: int, block_size: int) -> int:
    """Blocks one sequence holds once its new token is written at ``context``."""
    return -(-(context + 1) // block_size)


def decode_plan(
    batch: int,
    context: int,
    block_size: int,
    prefill: int = 0,
    sampling: SamplingParams | None = None,
) -> StepPlan:
    """``batch`` decodes, each with ``context`` tokens cached in its own
    blocks (sequence i owns blocks ``i*n .. i*n + n - 1``), greedy unless
    ``sampling`` says how each draws. ``prefill`` > 0: sequence 0 is instead
    a prefill chunk of that many tokens ending where its decode would (at
    ``context``), so the step is a mixed one."""
    if not 0 <= prefill <= context + 1:
        raise ValueError(f"a prefill chunk of {prefill} tokens does not fit a context of {context}")
    shapes = [(context, 1)] * batch
    if prefill:
        shapes[0] = (context + 1 - prefill, prefill)
    plan = synthetic_plan(shapes, block_size, batch * blocks_per_seq(context, block_size))
    if sampling is None or sampling.is_greedy:
        return plan
    return dataclasses.replace(plan, seqs=[seq._replace(sampling=sampling) for seq in plan.seqs])


def fill_kv(runner: ModelRunner, seed: int = 0) -> None:
    """Seeded random K/V in every device block: finite, and every page touched
    before timing (the pool starts zeroed)."""
    device = runner.device_pool[0][0].device
    generator = torch.Generator(device=device).manual_seed(seed)
    for k_cache, v_cache in runner.device_pool:
        fill_normal_(k_cache, generator)
        fill_normal_(v_cache, generator)


def time_plain(runner: ModelRunner, plan: StepPlan, num_steps: int, warmup: int) -> list[float]:
    """Milliseconds per ``execute`` for ``num_steps`` steps after ``warmup`` untimed
    ones (the first steps of a shape grow the gather workspace and fault its pages)."""
    for _ in range(warmup):
        runner.execute(plan)
    times = []
    for _ in range(num_steps):
        start = time.perf_counter_ns()
        runner.execute(plan)
        times.append((time.perf_counter_ns() - start) / 1e6)
    return times


def time_launches(runner: Any, plan: StepPlan, num_steps: int) -> tuple[list[float], list[float]]:
    """A device runner's step with the host one step ahead, as the engine
    plans ahead: (milliseconds the host spends in each ``launch``,
    milliseconds per step when each launch precedes the previous step's
    ``result()``). The first is the host's share of a step, the second the
    step's pace once the host is off the critical path."""
    handle = runner.launch(plan)
    handle.result()
    handle = runner.launch(plan)
    launches, paces = [], []
    for _ in range(num_steps):
        start = time.perf_counter_ns()
        following = runner.launch(plan)
        launched = time.perf_counter_ns()
        handle.result()
        launches.append((launched - start) / 1e6)
        paces.append((time.perf_counter_ns() - start) / 1e6)
        handle = following
    handle.result()
    return launches, paces


class _Clock:
    """Nanoseconds per part, accumulated over one step's calls."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.last_logits: torch.Tensor | None = None

    def add(self, part: str, ns: int) -> None:
        self.ns[part] = self.ns.get(part, 0) + ns

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter_ns() - start)

        return wrapper

    def take_ms(self, part: str) -> float:
        return self.ns.pop(part, 0) / 1e6


@contextmanager
def _replaced(obj: object, name: str, value: object) -> Iterator[None]:
    """``obj.name = value`` for the block; an instance attribute that shadowed a
    class attribute is removed again rather than left behind."""
    had_own = name in getattr(obj, "__dict__", {})
    original = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had_own or isinstance(obj, type):
            setattr(obj, name, original)
        else:
            delattr(obj, name)


@contextmanager
def _hooks(model: LlamaModel, clock: _Clock) -> Iterator[None]:
    from slipstream.kernels.linear import Linear
    from slipstream.service.engine import runner as runner_module

    forward = clock.timed("forward", model.forward)

    argmax = clock.timed("linears", Linear.argmax)

    def forward_keeping_logits(*args: Any) -> torch.Tensor:
        out = forward(*args)
        if out.is_floating_point():  # not a greedy step's tokens
            clock.last_logits = out
        return out

    def argmax_keeping_rows(linear: Linear, x: torch.Tensor) -> torch.Tensor:
        clock.last_logits = x  # greedy tokens picked in the LM head: its rows stand in
        return argmax(linear, x)

    # Linear defines __slots__, and Python looks __call__ up on the type: the
    # class attribute is the one place every projection goes through.
    with (
        _replaced(Linear, "__call__", clock.timed("linears", Linear.__call__)),
        _replaced(Linear, "argmax", argmax_keeping_rows),
        _replaced(model, "_paged_attention", clock.timed("attention", model._paged_attention)),
        _replaced(model, "forward", forward_keeping_logits),
        _replaced(runner_module, "sample", clock.timed("sample", runner_module.sample)),
        _replaced(model, "layer_part_ns", torch.zeros(2, dtype=torch.int64)),
    ):
        yield


def _take_native_parts(model: LlamaModel, clock: _Clock) -> None:
    """Moves what the native layer loop timed into the clock's parts."""
    part_ns = model.layer_part_ns
    if part_ns is None:
        return
    attention_ns, linears_ns = part_ns.tolist()
    part_ns.zero_()
    clock.add("attention", attention_ns)
    clock.add("linears", linears_ns)


BREAKDOWN_PARTS = ("attention_ms", "linears_ms", "other_ms", "host_ms")


def time_hooked(
    runner: ModelRunner, plan: StepPlan, num_steps: int, warmup: int
) -> dict[str, float]:
    """Medians over ``num_steps`` hooked steps: ``hooked_step_ms``, the four
    parts of ``BREAKDOWN_PARTS`` (``other_ms`` includes sampling) and
    ``sampling_ms``. Each part is its own median, so the parts need not sum
    exactly to ``hooked_step_ms``."""
    clock = _Clock()
    samples: dict[str, list[float]] = {
        p: [] for p in ("hooked_step_ms", *BREAKDOWN_PARTS, "sampling_ms")
    }
    with _hooks(runner.model, clock):
        for i in range(warmup + num_steps):
            clock.ns.clear()
            start = time.perf_counter_ns()
            runner.execute(plan)
            total = (time.perf_counter_ns() - start) / 1e6
            _take_native_parts(runner.model, clock)
            forward, sampling = clock.take_ms("forward"), clock.take_ms("sample")
            attention, linears = clock.take_ms("attention"), clock.take_ms("linears")
            if i < warmup:
                continue
            samples["hooked_step_ms"].append(total)
            samples["attention_ms"].append(attention)
            samples["linears_ms"].append(linears)
            samples["other_ms"].append(forward - attention - linears + sampling)
            samples["sampling_ms"].append(sampling)
            samples["host_ms"].append(total - forward - sampling)
    if clock.last_logits is None or not bool(torch.isfinite(clock.last_logits).all()):
        raise RuntimeError("the synthetic decode step produced non-finite logits")
    return {part: statistics.median(values) for part, values in samples.items()}


def weight_read_bytes(model: LlamaModel) -> int:
    """Bytes of weights one decode step must read: every projection (lm_head
    included), bias and norm. The embedding table is left out unless lm_head
    shares it: a step reads only its tokens' rows."""
    from slipstream.kernels.linear import Linear

    tensors: dict[int, torch.Tensor] = {}
    linears: list[Linear] = [model.lm_head]
    norms = [model.norm]
    for layer in model.layers:
        linears += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
        norms += [layer.input_norm, layer.post_norm]
    for t in [*norms, *(lin.weight for lin in linears), *(lin.bias for lin in linears)]:
        if t is not None:
            tensors[id(t)] = t
    # numel and element_size are logical, also for a oneDNN-packed weight.
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_read_bytes(model: LlamaModel, batch: int, seq_len: int) -> int:
    """Bytes of K and V that attention must read for ``batch`` sequences of
    ``seq_len`` tokens, over all layers."""
    return batch * seq_len * kv_bytes_per_block(model, block_size=1)


def read_floor_ms(
    num_bytes: int,
    dtype: torch.dtype,
    repeats: int = FLOOR_REPEATS,
    device: str = "cpu",
    statistic: Callable[[list[float]], float] = statistics.median,
) -> float:
    """Milliseconds (the median of ``repeats``, or ``statistic``) to sum a buffer
    of ``num_bytes`` on ``device`` (one fused read; on the CPU with the current
    torch thread count, on a GPU its memory bandwidth) after one untimed pass."""
    element_size = torch.empty((), dtype=dtype).element_size()
    # ones, not empty: every page is written (mapped) before the clock starts.
    buffer = torch.ones(max(1, num_bytes // element_size), dtype=dtype, device=device)
    sync = torch.cuda.synchronize if buffer.is_cuda else (lambda: None)
    buffer.sum()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter_ns()
        buffer.sum()
        sync()
        times.append((time.perf_counter_ns() - start) / 1e6)
    return statistic(times)
