"""Overload shedding: past capacity, the heaviest less-urgent arrivals are
turned away at the door (``overload.py``). Fake clocks only."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import replace

import pytest

from slipstream.scheduler import (
    CostCoefficients,
    CostModel,
    DeadlinePolicy,
    Overloaded,
    QueueFull,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    StepShape,
)
from slipstream.scheduler.overload import (
    MIN_ARRIVALS,
    NO_THRESHOLD,
    TARGET_UTILIZATION,
    WINDOW,
    OverloadShedder,
)
from slipstream.scheduler.simulator import SimRequest, carried_state, resume_policy, simulate


def full_shedder() -> OverloadShedder:
    """A shedder whose engine's last step left waiting work out for want of
    room: the only state in which it refuses anything."""
    shedder = OverloadShedder()
    shedder.observe_saturated()
    return shedder


def feed(
    shedder: OverloadShedder, rate: float, weights: list[float], start: float = 0.0
) -> list[bool]:
    """Arrivals ``1 / rate`` apart, all sheddable (class 2); which were admitted."""
    return [shedder.admits(start + i / rate, w, 2) for i, w in enumerate(weights)]


def log_uniform_weights(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [math.exp(rng.uniform(math.log(0.1), math.log(1.6))) for _ in range(n)]


def test_below_capacity_nothing_is_refused() -> None:
    shedder = full_shedder()
    weights = log_uniform_weights(4 * WINDOW)
    mean = sum(weights) / len(weights)
    # Offered load 0.8 of the service rate (1.0 weight-second per second):
    # the window's estimate wanders a few percent, never up to the target.
    admitted = feed(shedder, 0.8 / mean, weights)
    assert all(admitted)
    assert shedder.threshold == NO_THRESHOLD
    assert shedder.utilization() == pytest.approx(0.8, rel=0.1)


def test_past_capacity_the_heaviest_go_and_carry_the_excess() -> None:
    shedder = full_shedder()
    weights = log_uniform_weights(6 * WINDOW)
    mean = sum(weights) / len(weights)
    admitted = feed(shedder, 1.5 / mean, weights)
    steady = list(zip(weights[2 * WINDOW :], admitted[2 * WINDOW :], strict=True))
    refused = [w for w, ok in steady if not ok]
    kept = [w for w, ok in steady if ok]
    # Only the heaviest are refused: every refused one outweighs nearly all kept.
    assert refused and min(refused) >= sorted(kept)[int(0.9 * len(kept))]
    # They carry what the engine cannot serve: 1 - target / 1.5 of the work.
    share = sum(refused) / sum(w for w, _ in steady)
    assert share == pytest.approx(1.0 - TARGET_UTILIZATION / 1.5, abs=0.05)
    # Far fewer requests than that share of them.
    assert len(refused) / len(steady) < 0.6 * share


def test_never_sheds_the_unsheddable_and_says_nothing_before_enough_arrivals() -> None:
    shedder = full_shedder()
    heavy = 100.0
    # A flood far past capacity: the first arrivals say nothing about a rate.
    early = [shedder.admits(i * 0.01, heavy, 2) for i in range(MIN_ARRIVALS - 1)]
    assert all(early) and shedder.offered_load() == 0.0
    for i in range(MIN_ARRIVALS, 4 * WINDOW):
        shedder.admits(i * 0.01, heavy, None)  # class 0: counted, never refused
    assert shedder.utilization() > 100
    assert shedder.admits(4 * WINDOW * 0.01, heavy, None)
    assert not shedder.admits(4 * WINDOW * 0.01, heavy, 2)


def test_the_least_urgent_class_goes_first_then_weight_within_it() -> None:
    shedder = full_shedder()
    rng = random.Random(5)
    weights = log_uniform_weights(6 * WINDOW, seed=2)
    classes = [rng.choice((1, 2, 2)) for _ in weights]
    mean = sum(weights) / len(weights)
    # 1.3x: class 2 carries ~2/3 of the work, so its heaviest cover the excess.
    admitted = [
        shedder.admits(i * mean / 1.3, w, c)
        for i, (w, c) in enumerate(zip(weights, classes, strict=True))
    ]
    steady = list(zip(weights, classes, admitted, strict=True))[2 * WINDOW :]
    assert all(ok for _, c, ok in steady if c == 1)
    refused = [w for w, c, ok in steady if not ok]
    assert refused and all(c == 2 for _, c, ok in steady if not ok)
    # Past what class 2 can give (5x: 80 % of the work must go, class 2
    # carries two thirds), class 1 is shed too, and class 2 entirely.
    flood = full_shedder()
    admitted = [
        flood.admits(i * mean / 5.0, w, c)
        for i, (w, c) in enumerate(zip(weights, classes, strict=True))
    ]
    late = list(zip(classes, admitted, strict=True))[2 * WINDOW :]
    assert not any(ok for c, ok in late if c == 2)
    assert not all(ok for c, ok in late if c == 1)


def test_a_threshold_does_not_outlive_the_overload_once_the_engine_idled() -> None:
    shedder = full_shedder()
    weights = log_uniform_weights(3 * WINDOW)
    mean = sum(weights) / len(weights)
    feed(shedder, 2.0 / mean, weights)
    heaviest = max(weights)
    assert shedder.threshold != NO_THRESHOLD
    # The overload drained and the engine idled for ten times as long as the
    # window's arrivals took: the first arrival after it is judged on the
    # window as it is now, not turned away by the threshold of the last
    # overloaded moment.
    last = (len(weights) - 1) * mean / 2.0
    later = last + 10 * WINDOW * mean / 2.0
    stale = full_shedder()
    feed(stale, 2.0 / mean, weights)
    assert not stale.admits(later, heaviest, 2)  # without the idle, it would be
    shedder.observe_idle()
    assert shedder.admits(later, heaviest, 2)
    assert shedder.threshold == NO_THRESHOLD


def test_the_estimate_read_while_nothing_arrives_falls_with_the_time() -> None:
    """The gauge an operator reads: an overload that ended with no arrival
    since must not read as one forever (the window's own span stops at its
    last arrival; read as of ``now`` it counts the quiet time too)."""
    shedder = full_shedder()
    weights = log_uniform_weights(WINDOW)
    mean = sum(weights) / len(weights)
    feed(shedder, 2.0 / mean, weights)
    last = (len(weights) - 1) * mean / 2.0
    assert shedder.load() > 1.5 and shedder.load(last) == shedder.load()
    shedder.observe_idle()
    assert shedder.load() == 1.0  # the room clamps it; the window still says 2
    # As long again as the window's arrivals took: half the rate; ten times: a tenth.
    assert shedder.load(2 * last) == pytest.approx(0.5 * shedder.utilization(), rel=0.01)
    assert shedder.load(11 * last) < 0.25


def test_a_shifted_copy_decides_as_the_original_on_its_own_clock() -> None:
    original = full_shedder()
    weights = log_uniform_weights(4 * WINDOW, seed=7)
    mean = sum(weights) / len(weights)
    feed(original, 1.6 / mean, weights[: 2 * WINDOW])
    twin = original.shifted(-1000.0)
    start = 2 * WINDOW * mean / 1.6
    rest = weights[2 * WINDOW :]
    assert feed(twin, 1.6 / mean, rest, start - 1000.0) == feed(original, 1.6 / mean, rest, start)
    assert twin.threshold == original.threshold


# -- in the scheduler --------------------------------------------------------

COEFFS = CostCoefficients(0.01, 0.0004, 0.0015, 0.000002, 0.00005)


def config(**kwargs: object) -> SchedulerConfig:
    fields: dict[str, object] = {
        "num_device_blocks": 4096,
        "block_size": 16,
        "max_model_len": 1024,
        "max_num_seqs": 32,
    }
    fields.update(kwargs)
    return SchedulerConfig(**fields)  # type: ignore[arg-type]


def mixed_request(i: int, now: float, rng: random.Random) -> Request:
    """Class ``i % 3``, ~0.1 weight-seconds on average, a distant deadline."""
    return Request(
        req_id=f"r{i}",
        prompt_token_ids=[1] * rng.randint(32, 512),
        max_new_tokens=rng.randint(16, 256),
        priority=i % 3,
        arrival_time=now,
        deadline=now + 1000.0,
    )


class Engine:
    """A fake-clock engine: steps take the cost model's time, every
    sampled token is 7 (no EOS), cancels land between steps."""

    def __init__(self, sched: Scheduler, cost: CostModel) -> None:
        self.sched, self.cost = sched, cost
        self.now = 0.0
        # Weight served: seconds of a full batch's time (capacity: 1 per second).
        self.work_s = 0.0
        self.cancels: list[tuple[float, str]] = []  # (when, req_id), a heap
        # (waiting, running) when each Overloaded refusal was raised.
        self.overloaded_at: list[tuple[int, int]] = []

    def run_until(self, until: float) -> None:
        sched = self.sched
        while self.now < until:
            while self.cancels and self.cancels[0][0] <= self.now:
                sched.abort_request(heapq.heappop(self.cancels)[1])
            if not sched.has_unfinished():
                sched.observe_idle(until - self.now)
                self.now = until
                return
            plan = sched.schedule(self.now)
            if not plan.seqs:
                self.now += self.cost.idle_seconds()
                continue
            seconds = self.cost.plan_seconds(plan)
            self.now += seconds
            batch = sched.config.max_num_seqs
            self.work_s += self.cost.batched_step_seconds(StepShape.of(plan), batch)
            sched.update(plan, {q.req_id: 7 for q in plan.seqs if q.sample}, self.now)

    def submit(self, req: Request, cancel_after: float | None = None) -> Exception | None:
        """Queues ``req`` at its arrival time (stepping until then); the
        error that refused it, if any."""
        self.run_until(req.arrival_time)
        try:
            self.sched.add_request(req, self.now)
        except SchedulerError as exc:
            if isinstance(exc, Overloaded):
                self.overloaded_at.append((self.sched.num_waiting, self.sched.num_running))
            return exc
        if cancel_after is not None:
            heapq.heappush(self.cancels, (self.now + cancel_after, req.req_id))
        return None


def test_a_refused_arrival_is_overloaded_with_a_retry_hint_and_counted_by_class() -> None:
    cost = CostModel(COEFFS)
    engine = Engine(Scheduler(config(), cost_model=cost), cost)
    rng = random.Random(3)
    refused: list[tuple[Request, Overloaded]] = []
    now = 0.0
    for i in range(3 * WINDOW):
        now += 0.01  # ~100 arrivals/s of ~0.1 weight-seconds each: ~10x capacity
        req = mixed_request(i, now, rng)
        error = engine.submit(req)
        if isinstance(error, Overloaded):
            refused.append((req, error))
    assert refused
    assert all(exc.retry_after_s and exc.load > 1.0 for _, exc in refused)
    assert not any(isinstance(exc, QueueFull) for _, exc in refused)  # its own reason
    assert all(req.priority > 0 for req, _ in refused)  # class 0 is never shed
    # ~10x capacity: all of class 2 cannot cover it, so class 1 goes too.
    assert {req.priority for req, _ in refused} == {1, 2}
    sched = engine.sched
    assert all(sched.get_request(req.req_id) is None for req, _ in refused)
    by_class = sched.num_overload_refused
    assert sum(by_class.values()) == len(refused) and 0 not in by_class
    by_reason = sched.num_refused_for_capacity
    assert sum(n for (_, reason), n in by_reason.items() if reason == "overloaded") == len(refused)
    message = str(refused[0][1])
    assert message.startswith("overloaded (") and f"{refused[0][1].load:.2f}x" in message


def test_an_engine_with_room_refuses_nothing_however_much_was_offered() -> None:
    """The window says 10x, but the engine's last step left nothing out:
    the estimate reads at most 1 and nothing is refused; the first step
    that leaves work out for want of room turns the refusals back on."""
    shedder = full_shedder()
    weights = log_uniform_weights(2 * WINDOW)
    mean = sum(weights) / len(weights)
    feed(shedder, 10.0 / mean, weights)
    assert shedder.load() > 5 and not shedder.admits(2 * WINDOW * mean / 10, max(weights), 2)
    shedder.observe_room()
    assert shedder.load() <= 1.0 and shedder.threshold == NO_THRESHOLD
    assert shedder.admits(2 * WINDOW * mean / 10, max(weights), 2)
    # A step with room in an overload does not forget the full engine's
    # refusals: they are offered work, and without them the estimate would
    # read about the service rate and stop shedding when the engine fills.
    offered = shedder.offered_load()
    shedder.observe_saturated()
    assert shedder.offered_load() == pytest.approx(offered) and shedder.load() > 5
    assert not shedder.admits(2 * WINDOW * mean / 10, max(weights), 2)
    # Once the engine idled they are forgotten: only admitted work counts.
    shedder.observe_idle()
    assert shedder.offered_load() < offered and shedder.load() <= 1.0
    admitted_rate = shedder.offered_load()
    shedder.observe_saturated()
    assert shedder.utilization() == pytest.approx(admitted_rate / shedder.service_rate)


def test_work_given_back_leaves_the_offered_load() -> None:
    """A cancelled request gives back the work it did not use; an expired
    one only while the engine has room (in a full engine its miss is the
    overload itself)."""
    shedder = full_shedder()
    for i in range(MIN_ARRIVALS):
        assert shedder.admits(i * 0.1, 1.0, 2, req_id=f"r{i}")
    before = shedder.offered_load()
    assert before == pytest.approx(10.0)
    shedder.observe_departure("r5", 0.75, is_load_driven=True)  # full engine: kept
    assert shedder.offered_load() == pytest.approx(before)
    for i in range(MIN_ARRIVALS // 2):
        shedder.observe_departure(f"r{i + 8}", 0.75, is_load_driven=False)
    assert shedder.offered_load() == pytest.approx(before * (1 - 0.75 / 2), rel=0.03)
    shedder.observe_room()
    shedder.observe_departure("r60", 5.0, is_load_driven=True)  # never more than it brought
    shedder.observe_departure("r60", 1.0, is_load_driven=False)  # once only
    assert shedder.offered_load() == pytest.approx(before * (1 - 0.75 / 2) - 1.0 / 6.3, rel=0.01)


def issue_mix(engine: Engine, seconds: float, rate: float, seed: int) -> dict[str, int]:
    """The mix of issue 31 at ``rate`` streams per second: streams of 1-6
    requests at once (max 1-128 tokens, classes 0-3, 30 % with a timeout of
    0.05 / 0.3 / 1 / 3 s, 20 % cancelled within 0.5 s), and long requests
    (200-600 tokens) dropped mid-generation. Refusals by error name."""
    rng = random.Random(seed)
    refusals: dict[str, int] = {}
    now, i = 0.0, 0
    while now < seconds:
        now += rng.expovariate(rate)
        burst = [("short", n) for n in range(rng.randint(1, 6))]
        if rng.random() < 0.3:
            burst.append(("long", 0))
        for kind, _ in burst:
            i += 1
            long = kind == "long"
            timeout = rng.choice((0.05, 0.3, 1.0, 3.0)) if rng.random() < 0.3 else None
            req = Request(
                req_id=f"q{i}",
                prompt_token_ids=[5] * rng.randint(8, 48),
                max_new_tokens=rng.randint(200, 600) if long else rng.randint(1, 128),
                priority=rng.randint(0, 3),
                arrival_time=now,
                deadline=None if timeout is None else now + timeout,
            )
            cancel = rng.uniform(0.05, 0.5) if long or rng.random() < 0.2 else None
            error = engine.submit(req, cancel)
            if error is not None:
                name = type(error).__name__
                refusals[name] = refusals.get(name, 0) + 1
    engine.run_until(now + 5.0)
    return refusals


def test_the_mix_of_issue_31_does_not_inflate_the_overload_estimate() -> None:
    """Deadlines that cannot be met, cancellations and dropped streams at
    under half the engine's capacity. Before: the offered load counted the
    cancelled and dropped work in full (2.0x the work served per second in
    this run) and nothing asked whether the engine had room: 36 arrivals of
    classes 1-3 were refused as overloaded, 30 of them with seats free in
    the batch and 10 with nobody waiting. Now the estimate follows the work
    served, and nothing is refused while the queue is empty or the batch has
    room."""
    cost = CostModel(COEFFS)
    sched = Scheduler(config(max_num_seqs=16), cost_model=cost)
    engine = Engine(sched, cost)
    refusals = issue_mix(engine, 240.0, rate=1.0, seed=1)
    served_rate = engine.work_s / engine.now
    # The engine serves under half the work a full batch would (its capacity).
    assert served_rate < 0.5
    assert refusals.get("DeadlineInfeasible", 0) > 0  # the mix holds infeasible deadlines
    assert "QueueFull" not in refusals
    # Refused only with the batch full and work waiting: never with room.
    assert all(waiting > 0 and running == 16 for waiting, running in engine.overloaded_at)
    assert len(engine.overloaded_at) == refusals.get("Overloaded", 0)
    policy = sched.policy
    assert isinstance(policy, DeadlinePolicy) and policy.overload_shedder is not None
    assert policy.overload_shedder.offered_load() < 1.25 * served_rate
    assert sched.num_used_device_blocks == 0 and not sched.has_unfinished()


def test_the_mix_of_issue_31_with_a_roomy_batch_refuses_nothing() -> None:
    """The same mix with the batch never full (32 seats): no refusal for capacity."""
    cost = CostModel(COEFFS)
    sched = Scheduler(config(), cost_model=cost)
    engine = Engine(sched, cost)
    refusals = issue_mix(engine, 240.0, rate=1.0, seed=1)
    assert engine.work_s / engine.now < 0.5
    assert "Overloaded" not in refusals and "QueueFull" not in refusals
    assert sched.num_refused_for_capacity == {}


def test_requests_without_a_deadline_are_never_refused() -> None:
    sched = Scheduler(config(), cost_model=CostModel(COEFFS))
    for i in range(3 * WINDOW):
        now = i * 0.001
        req = Request(
            req_id=f"r{i}",
            prompt_token_ids=[1] * 512,
            max_new_tokens=256,
            priority=2,
            arrival_time=now,
        )
        sched.add_request(req, now)
    assert sched.num_waiting == 3 * WINDOW


def overload_workload(load_rps: float, num: int) -> list[SimRequest]:
    """Log-uniform lengths, three classes, deadlines 10 / 15 / 25x the isolated time."""
    rng = random.Random(11)
    cost = CostModel(COEFFS)
    requests, now = [], 0.0
    for i in range(num):
        now += rng.expovariate(load_rps)
        prompt = round(math.exp(rng.uniform(math.log(32), math.log(512))))
        output = round(math.exp(rng.uniform(math.log(16), math.log(256))))
        cls = rng.choices((0, 1, 2), (0.1, 0.3, 0.6))[0]
        isolated = cost.service_seconds(0, prompt, output, 512)
        requests.append(
            SimRequest(
                req_id=f"r{i}",
                arrival=now,
                prompt_len=prompt,
                output_len=output,
                priority=cls,
                deadline=now + (10.0, 15.0, 25.0)[cls] * isolated,
                expected_output_tokens=output,
            )
        )
    return requests


def met(outcome: object, request: SimRequest) -> bool:
    finish = outcome.finish_time  # type: ignore[attr-defined]
    reason = outcome.finish_reason.name  # type: ignore[attr-defined]
    return reason == "MAX_TOKENS" and request.deadline is not None and finish <= request.deadline


def test_shedding_the_heaviest_meets_more_deadlines_past_capacity() -> None:
    """1.25x the rate a saturated batch of this mix sustains (~3.7 req/s)."""
    requests = overload_workload(4.6, 1000)
    cost = CostModel(COEFFS)
    shedding = simulate(requests, config(), cost)
    urgency_only = simulate(requests, replace(config(), shed_under_overload=False), cost)
    attained = [
        sum(met(o, r) for o, r in zip(result.outcomes, requests, strict=True)) / len(requests)
        for result in (shedding, urgency_only)
    ]
    assert attained[0] > attained[1] + 0.05
    refused = [
        r for o, r in zip(shedding.outcomes, requests, strict=True) if o.rejection == "Overloaded"
    ]
    # 1.25x: the heaviest of class 2 cover the excess; nothing else is refused.
    assert refused and all(r.priority == 2 for r in refused)
    weight = [cost.batched_seconds(r.prompt_len, r.output_len, 32) for r in requests]
    median = sorted(weight)[len(weight) // 2]
    heavy = sum(cost.batched_seconds(r.prompt_len, r.output_len, 32) > median for r in refused)
    assert heavy == len(refused)
    # Class 0 is untouched by the shedding.
    class0 = [
        met(o, r) for o, r in zip(shedding.outcomes, requests, strict=True) if r.priority == 0
    ]
    assert sum(class0) / len(class0) >= 0.99


def _overload_arrivals(
    engine: Engine, first: int, count: int, shift: float, stepping: bool = True
) -> list[bool]:
    """``count`` arrivals at ~3x capacity (times shifted by ``shift``); which
    came in. Without ``stepping`` no step runs between them."""
    rng = random.Random(first)
    admitted = []
    for i in range(first, first + count):
        req = mixed_request(i, i * 0.03 + shift, rng)
        if stepping:
            admitted.append(not isinstance(engine.submit(req), Overloaded))
            continue
        try:
            engine.sched.add_request(req, req.arrival_time)
            admitted.append(True)
        except Overloaded:
            admitted.append(False)
    return admitted


def test_a_twin_resumed_from_the_carried_state_refuses_what_the_original_does() -> None:
    """A simulated twin of a live engine starts where the engine's policy
    stood (its window, and its full batch); a fresh one, whose engine has
    room, admits everything."""

    def engine() -> Engine:
        cost = CostModel(COEFFS)
        return Engine(Scheduler(config(), cost_model=cost), cost)

    original = engine()
    assert not all(_overload_arrivals(original, 0, 2 * WINDOW, 0.0))
    carried = carried_state(original.sched.policy, -500.0)  # the twin's clock starts 500 s later
    twin, fresh = engine(), engine()
    resume_policy(twin.sched.policy, carried)
    first = 2 * WINDOW + 100  # past the original's clock
    expected = _overload_arrivals(original, first, MIN_ARRIVALS - 1, 0.0, stepping=False)
    assert not all(expected)
    assert _overload_arrivals(twin, first, MIN_ARRIVALS - 1, -500.0, stepping=False) == expected
    assert all(_overload_arrivals(fresh, first, MIN_ARRIVALS - 1, -500.0, stepping=False))
    with pytest.raises(TypeError):
        resume_policy(twin.sched.policy, None)


def _threshold_by_one_sort(shedder: OverloadShedder) -> tuple[float, float]:
    """The threshold as one sort of every sheddable (class, weight) finds it."""
    utilization = shedder.utilization()
    if utilization <= TARGET_UTILIZATION:
        return NO_THRESHOLD
    excess = (1.0 - TARGET_UTILIZATION / utilization) * shedder._window_weight
    ranked = sorted(
        ((a.shed_class, a.weight) for a in shedder._arrivals if a.shed_class is not None),
        reverse=True,
    )
    shed = 0.0
    for cls, weight in ranked:
        shed += weight
        if shed >= excess:
            return (float(cls), math.nextafter(weight, -math.inf))
    return (0.0, -math.inf)


def test_the_threshold_is_the_one_a_sort_of_the_whole_window_gives() -> None:
    # Classes mixed with unsheddable arrivals, weights repeated and given
    # back to 0, loads from under the target to four times it.
    kinds = set()
    for seed in range(60):
        rng = random.Random(seed)
        shedder = full_shedder()
        rate = rng.choice((1.0, 1.5, 2.0, 3.0, 6.0))  # x ~0.75 weight an arrival
        pool = [round(rng.uniform(0.0, 1.5), rng.choice((1, 6))) for _ in range(40)]
        for i in range(rng.randint(MIN_ARRIVALS, 2 * WINDOW)):
            cls = rng.choice((None, 1, 2, 2, 3))
            shedder.record(i / rate, rng.choice(pool), cls, req_id=f"r{i}")
        for i in rng.sample(range(WINDOW), 30):
            shedder.observe_departure(f"r{i}", rng.choice((0.0, 0.3, 10.0)), False)
        shedder._refresh()
        expected = _threshold_by_one_sort(shedder)
        assert shedder._threshold == expected, seed
        kinds.add("none" if expected == NO_THRESHOLD else "all" if expected[0] == 0 else "rank")
    assert kinds == {"none", "all", "rank"}  # every outcome was compared
