"""The engine as a composition: a real scheduler, a fake runner and a word-level
tokenizer, no model. The step is plan -> execute -> update -> publish; every
ending is decided by the scheduler (stop sequences included); the scheduler
refits its own cost model from the steps the engine measured."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel

from slipstream.scheduler.config import SchedulerConfig
from slipstream.scheduler.cost_model import CostCoefficients, CostModel
from slipstream.scheduler.plan import PENDING_TOKEN, StepPlan
from slipstream.scheduler.request import FinishReason
from slipstream.scheduler.scheduler import Scheduler
from slipstream.service.engine.engine import Engine, FinishedResult
from slipstream.service.engine.events import ModelInfo, RequestSpec, StepOutOfMemory

WORDS = ["<eos>", "a", "b", "c", "x", "y", "z", "!"]
EOS = 0


class _Tokenizer:
    """What the engine needs of a Hugging Face tokenizer: its fast backend."""

    def __init__(self) -> None:
        self.backend_tokenizer = Tokenizer(
            WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eos>")
        )
        self.backend_tokenizer.decoder = decoders.Fuse()
        self.backend_tokenizer.add_special_tokens(["<eos>"])  # never shown in the text


@dataclass
class _Result:
    sampled: dict[str, int]
    logprobs: dict[str, object] = field(default_factory=dict)
    verified: dict[str, list[int]] = field(default_factory=dict)


class _ScriptedRunner:
    """Each request's next token from its script (by output position); records plans."""

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        self.scripts = scripts
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> _Result:
        self.plans.append(plan)
        return _Result(
            {s.req_id: self.scripts[s.req_id][s.output_index] for s in plan.seqs if s.sample}
        )


class _CountingScheduler(Scheduler):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.num_aborts = 0

    def abort_request(self, *args: object, **kwargs: object) -> object:
        self.num_aborts += 1
        return super().abort_request(*args, **kwargs)  # type: ignore[arg-type]


def _engine(
    scripts: dict[str, list[int]],
) -> tuple[Engine, _CountingScheduler, CostModel, _ScriptedRunner]:
    cost = CostModel(CostCoefficients(), max_drift=None)
    config = SchedulerConfig(
        num_device_blocks=32, block_size=4, max_model_len=64, policy="deadline"
    )
    scheduler = _CountingScheduler(config, cost_model=cost)
    runner = _ScriptedRunner(scripts)
    info = ModelInfo(
        name="fake", path="", architecture="none", max_model_len=64, vocab_size=len(WORDS),
        dtype="float32", block_size=4, attention_backend="none", eos_token_ids=[EOS],
    )  # fmt: skip
    return Engine(scheduler, runner, _Tokenizer(), info), scheduler, cost, runner  # type: ignore[arg-type]


# Three requests, each ended another way: its token limit, EOS, a stop sequence.
ENDINGS_SCRIPTS = {
    "limit": [1, 2, 3, 1, 2, 3],
    "eos": [4, 5, EOS, 6, 6, 6],
    "stop": [1, 4, 5, 6, 1, 1],  # "axyz...": stops at "yz"
}
ENDINGS = [
    RequestSpec(req_id="limit", prompt_token_ids=[1, 2], max_new_tokens=4),
    RequestSpec(req_id="eos", prompt_token_ids=[3], max_new_tokens=6),
    RequestSpec(
        req_id="stop", prompt_token_ids=[2, 2, 2], max_new_tokens=6, stop_sequences=("yz",)
    ),
]


def _check_endings(results: dict[str, FinishedResult]) -> None:
    """What callers see of ENDINGS: each ends its own way, with its text."""
    assert results["limit"].finish.reason is FinishReason.MAX_TOKENS
    assert results["limit"].token_ids == [1, 2, 3, 1] and results["limit"].text == "abca"
    assert results["eos"].finish.reason is FinishReason.EOS
    assert results["eos"].token_ids == [4, 5, EOS] and results["eos"].text == "xy"
    # The stop sequence ends the request in update(), like EOS, never through
    # an abort, and the text ends right before the stop string.
    assert results["stop"].finish.reason is FinishReason.STOP_SEQUENCE
    assert results["stop"].token_ids == [1, 4, 5, 6] and results["stop"].text == "ax"


def test_every_ending_is_the_schedulers() -> None:
    engine, scheduler, cost, runner = _engine(ENDINGS_SCRIPTS)
    try:
        results = {r.req_id: r for r in engine.generate(ENDINGS)}
    finally:
        engine.shutdown()
    _check_endings(results)
    assert scheduler.num_aborts == 0
    # No step for "stop" after the one that ended it.
    assert sum(s.req_id == "stop" for p in runner.plans for s in p.seqs) == 4
    # The scheduler refit its cost model from every step that ran.
    assert cost.num_samples == len([p for p in runner.plans if p.seqs])
    stats = engine.stats()
    assert stats.device_blocks.used == 0 and stats.step >= 4  # four tokens, one step each


def test_a_step_listener_sees_each_step_with_its_seconds() -> None:
    engine, _, _, runner = _engine({"r": [1, 2, 3]})
    seen: list[tuple[int, float]] = []
    listeners = [lambda plan, seconds: seen.append((plan.step, seconds))]
    composed = Engine(engine._scheduler, runner, engine.tokenizer, engine.info, listeners)
    try:
        (result,) = composed.generate(
            [RequestSpec(req_id="r", prompt_token_ids=[1], max_new_tokens=3)]
        )
    finally:
        composed.shutdown()
    assert result.token_ids == [1, 2, 3]
    assert [step for step, _ in seen] == [p.step for p in runner.plans if p.seqs]
    assert all(seconds > 0 for _, seconds in seen)


def test_a_runner_with_device_memory_reports_it_in_the_stats() -> None:
    from slipstream.service.engine.events import PoolStats

    class _GpuLike(_ScriptedRunner):
        def memory(self) -> PoolStats:
            return PoolStats(used=3, free=5)

    engine, scheduler, _, _ = _engine({})
    assert engine.stats().device_memory is None  # the CPU runner has none
    composed = Engine(scheduler, _GpuLike({}), engine.tokenizer, engine.info)
    assert composed.stats().device_memory == PoolStats(used=3, free=5)


def test_a_runner_is_prepared_once_on_the_engine_thread_before_its_first_step() -> None:
    calls: list[tuple[str, int]] = []

    class _Prepared(_ScriptedRunner):
        def on_engine_thread(self) -> None:
            calls.append((threading.current_thread().name, len(self.plans)))

    engine, scheduler, _, _ = _engine({})
    runner = _Prepared({"r": [1, 2]})
    composed = Engine(scheduler, runner, engine.tokenizer, engine.info)
    try:
        composed.generate([RequestSpec(req_id="r", prompt_token_ids=[1], max_new_tokens=2)])
    finally:
        composed.shutdown()
    assert calls == [("slipstream-engine", 0)]


def test_start_returns_once_the_engine_thread_is_prepared() -> None:
    """A server marks itself ready when ``start`` returns: a slow preparation
    (the OpenMP probe on a busy host) held the first request, as queue time."""
    prepared = threading.Event()

    class _Slow(_ScriptedRunner):
        def on_engine_thread(self) -> None:
            time.sleep(0.3)
            prepared.set()

    engine, scheduler, _, _ = _engine({})
    composed = Engine(scheduler, _Slow({}), engine.tokenizer, engine.info)
    try:
        composed.start()
        assert prepared.is_set()
    finally:
        composed.shutdown()


class _Deferred:
    """A launched step: it runs when its result is asked for, as a GPU's step
    lands after the host has moved on."""

    def __init__(self, run: object) -> None:
        self._run = run

    def result(self) -> _Result:
        return self._run()  # type: ignore[operator,no-any-return]


class _AheadRunner(_ScriptedRunner):
    """``launch`` returns at once; the step runs when its result is taken.
    ``fail``: (req_id, where) — runs out of memory once, in ``execute``
    (planning behind), at ``launch`` or at ``result``, on the first step that
    holds req_id."""

    def __init__(self, scripts: dict[str, list[int]], fail: tuple[str, str] | None = None):
        super().__init__(scripts)
        self.fail = fail
        self.launched: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> _Result:
        if self.fail is not None and self.fail == (self._victim(plan), "execute"):
            self.fail = None
            raise StepOutOfMemory([s.req_id for s in plan.seqs], "CUDA out of memory (execute)")
        return super().execute(plan)

    def _victim(self, plan: StepPlan) -> str | None:
        names = {s.req_id for s in plan.seqs}
        return self.fail[0] if self.fail is not None and self.fail[0] in names else None

    def launch(self, plan: StepPlan) -> _Deferred:
        self.launched.append(plan)
        failing = self.fail is not None and self.fail[0] in {s.req_id for s in plan.seqs}
        if failing and self.fail is not None and self.fail[1] == "launch":
            self.fail = None
            raise StepOutOfMemory([s.req_id for s in plan.seqs], "CUDA out of memory (launch)")
        if failing:
            self.fail = None

            def fail() -> _Result:
                raise StepOutOfMemory([s.req_id for s in plan.seqs], "CUDA out of memory (result)")

            return _Deferred(fail)
        return _Deferred(lambda: self.execute(plan))


def _ahead(runner: _AheadRunner, plan_ahead: bool = True) -> tuple[Engine, Scheduler]:
    engine, scheduler, _, _ = _engine({})
    composed = Engine(scheduler, runner, engine.tokenizer, engine.info, plan_ahead=plan_ahead)
    return composed, scheduler


def test_planning_ahead_every_ending_lands_a_step_late_but_callers_see_the_same() -> None:
    runner = _AheadRunner(ENDINGS_SCRIPTS)
    engine, scheduler = _ahead(runner)
    try:
        results = {r.req_id: r for r in engine.generate(ENDINGS)}
        stats = engine.stats()
    finally:
        engine.shutdown()
    _check_endings(results)
    planned = {
        req_id: sum(s.req_id == req_id for p in runner.launched for s in p.seqs)
        for req_id in ENDINGS_SCRIPTS
    }
    # A limit is known when planning: never planned past. EOS and a stop
    # sequence are known from the results: one step more was already launched.
    assert planned == {"limit": 4, "eos": 4, "stop": 5}
    # Every launched step but the first was launched before the previous one's
    # results were taken: the pending tokens of its decodes.
    assert any(s.token_ids == [PENDING_TOKEN] for p in runner.launched for s in p.seqs)
    assert stats.device_blocks.used == 0 and scheduler.num_aborts == 0


@pytest.mark.parametrize("where", ["execute", "launch", "result"])
def test_a_step_out_of_memory_ends_its_requests_and_the_engine_goes_on(where: str) -> None:
    """Planning behind (``execute``) or ahead (at ``launch`` or at ``result``)."""
    runner = _AheadRunner({"big": [1] * 8, "after": [2, 3, 1]}, fail=("big", where))
    engine, _ = _ahead(runner, plan_ahead=where != "execute")
    try:
        (big,) = engine.generate(
            [RequestSpec(req_id="big", prompt_token_ids=[1] * 20, max_new_tokens=8)]
        )
        (after,) = engine.generate(
            [RequestSpec(req_id="after", prompt_token_ids=[1, 2], max_new_tokens=3)]
        )
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert big.finish.reason is FinishReason.OUT_OF_MEMORY and where in big.finish.message
    assert after.finish.reason is FinishReason.MAX_TOKENS and after.token_ids == [2, 3, 1]
    assert stats.device_blocks.used == 0 and stats.waiting == stats.running == 0
