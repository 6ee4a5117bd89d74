"""Engine mode of ``slipstream bench slo``: the same workloads replayed in
real time through the real ``Engine``.

This mode calibrates one cost model on the first engine's runner
(``service.cost_model.calibrate``), scales it so that its isolated service
times match requests run alone through that engine (``deadline_yardstick``),
uses the scaled model to set the workload's deadlines, and
installs in every engine, before it starts, a scheduler reading its own
copy of the calibration, which the engine then refits online. One policy's
engine runs at a time (``Bench``). Capacity is the throughput
of a closed batch several times ``max_num_seqs`` (so the engine is
saturated for most of it), measured on the first policy's engine. Per-request
compute is not observable from outside the engine: ``missed_compute_s`` is
reported as 0 here.

Every engine run carries ``sim_twin``: the same requests, scheduler
configuration and deadline mode through the simulator, with the cost model
the engine held when the run started (and the margin it kept for its own
error, ``CostModel.overrun``) — where the two disagree, the report says by
how much — and ``sim_twin_run_fit``, the same with a model fit on the run's
own steps and the run's mean margin. ``--repeats N`` replays every cell N
times on the same requests: ``reproducibility`` states the engine's own
spread next to each twin's distance from the engine's median. Capacity is
predicted twice: from the start-up calibration (``sim_capacity_rps``) and
from the model the first engine refit online over the capacity run
(``sim_capacity_rps_refit``).
"""

from __future__ import annotations

import itertools
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from slipstream.scheduler.cost_model import CostCoefficients, CostModel
from slipstream.scheduler.errors import SchedulerError
from slipstream.scheduler.plan import StepPlan
from slipstream.scheduler.request import FinishReason
from slipstream.scheduler.scheduler import Scheduler
from slipstream.scheduler.simulator import (
    REJECT_CAUSE_NAMES,
    SimOutcome,
    SimRequest,
    carried_state,
)
from slipstream.service.bench.slo_capacity import (
    Capacity,
    capacity_report,
    goodput_fraction,
    search_capacities,
)
from slipstream.service.bench.slo_options import (
    SloOptions,
    run_grid,
    run_header,
    scheduler_config,
    workload_spec,
)
from slipstream.service.bench.slo_report import grid_report
from slipstream.service.bench.slo_sim import sim_capacity, simulate_workload
from slipstream.service.bench.slo_twin import (
    MAX_LISTED_DISAGREEMENTS,
    StepRecord,
    class0_misses,
    reproducibility,
    scored_differently,
    twin_summary,
)
from slipstream.service.bench.slo_workload import (
    as_scheduled,
    make_requests,
    percentile,
    saturating_requests,
    scored_metrics,
)
from slipstream.service.engine.calibration import calibrate
from slipstream.service.engine.config import EngineConfig
from slipstream.service.engine.engine import Engine
from slipstream.service.engine.events import (
    EngineStats,
    Event,
    FinishEvent,
    RequestSpec,
    TokenEvent,
)
from slipstream.service.engine.gc_heap import frozen_heap
from slipstream.service.engine.loader import load_parts
from slipstream.service.engine.runner import kv_bytes_per_block
from slipstream.service.models.llama import LlamaModel


@dataclass
class Rig:
    """An engine composed for the benchmark from the loader's parts, with the
    scheduler and cost model it was given (read between runs) and the step
    listeners it calls."""

    engine: Engine
    scheduler: Scheduler
    cost_model: CostModel
    model: LlamaModel
    listeners: list[Callable[[StepPlan, float], None]] = field(default_factory=list)


def start_engine(
    opts: SloOptions, policy: str, cost: CostModel | None = None
) -> tuple[Rig, CostModel]:
    """One started engine for ``policy``, with its own copy of ``cost`` (the
    start-up calibration, refit online from its own steps); None calibrates
    it on this engine's runner first. Returns the rig and the calibration."""
    parts = load_parts(
        EngineConfig(
            model=opts.model,
            dtype=opts.dtype,
            block_size=opts.block_size,
            num_device_blocks=opts.num_device_blocks,
            num_host_blocks=opts.num_host_blocks,
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            policy=policy,
            device=opts.device,
            prefill_graph_tokens=opts.prefill_graph_tokens,
            # As serve does: no block's first write faults its pages in mid-run.
            commit_kv_memory=True,
        )
    )
    if cost is None:
        cost = calibrate(parts.runner, opts.max_num_batched_tokens, opts.max_num_seqs)
    config = replace(
        scheduler_config(opts, policy), max_model_len=parts.scheduler_config.max_model_len
    )
    # Each engine gets its own copy, refit online from its measured steps.
    own = CostModel(cost.coefficients)
    scheduler = Scheduler(config, cost_model=own)
    listeners: list[Callable[[StepPlan, float], None]] = []
    engine = Engine(
        scheduler, parts.runner, parts.tokenizer, parts.info, listeners, parts.plan_ahead
    )
    engine.start()
    return Rig(engine, scheduler, own, parts.model, listeners), cost


# Isolated probe requests (prompt, output) that measure the engine's real
# isolated service time, three repeats each (the median counts).
PROBES = ((32, 8), (64, 24), (128, 48))
PROBE_REPEATS = 3
# Probe prompts are drawn from their own seeds, apart from the workload's (0).
PROBE_SEED = 1_000_000


def deadline_yardstick(
    opts: SloOptions, engine: Engine, cost: CostModel
) -> tuple[CostModel, float, dict[str, float]]:
    """The model the workload's deadlines are set with: ``cost`` scaled so
    that its isolated service times match what the engine measures for
    requests run alone (``PROBES``), that scale, and each probe's own
    measured / predicted ratio (``"prompt x output"``).

    The start-up calibration times bare forwards; a request alone also pays
    the engine loop's planning and publishing every step, so deadlines of
    ``slack x`` the calibration's isolated time would really be tighter than
    ``slack x`` (measured here: ~0.75x on ``small``). One scale serves every
    request only while the calibration has the shape of a request's time
    right; probes whose ratios differ widely say it has not (an H200's fit
    without a fixed step cost: 13x).
    """
    ratios = []
    vocab = engine.info.vocab_size
    seeds = itertools.count(PROBE_SEED)
    # One untimed pass first: a shape's first request pays one-off set-up
    # (measured on tiny: the first probe up to 5x the others).
    for prompt, output in PROBES:
        probe = SimRequest("warm-up", 0.0, prompt_len=prompt, output_len=output)
        _replay(engine, _submissions([probe], vocab, next(seeds)), time.monotonic())
    for prompt, output in PROBES:
        probe = SimRequest(req_id="", arrival=0.0, prompt_len=prompt, output_len=output)
        predicted = cost.service_seconds(0, prompt, output, opts.max_num_batched_tokens)
        times = []
        for i in range(PROBE_REPEATS):
            # A prompt of its own each time: a repeated one would find its
            # blocks in the prefix cache and time a decode with no prefill.
            request = replace(probe, req_id=f"probe-{prompt}-{output}-{i}")
            submissions = _submissions([request], vocab, next(seeds))
            started = time.monotonic()
            _replay(engine, submissions, started)
            times.append(time.monotonic() - started)
        ratios.append(statistics.median(times) / predicted)
    scale = statistics.median(ratios)
    by_probe = {f"{p}x{o}": r for (p, o), r in zip(PROBES, ratios, strict=True)}
    c = cost.coefficients
    scaled = CostCoefficients(
        base_s=c.base_s * scale,
        per_prefill_token_s=c.per_prefill_token_s * scale,
        per_decode_seq_s=c.per_decode_seq_s * scale,
        per_context_token_s=c.per_context_token_s * scale,
        swap_s_per_block=c.swap_s_per_block,
        per_prefill_step_s=c.per_prefill_step_s * scale,
    )
    return CostModel(scaled), scale, by_probe


def measure_capacity(opts: SloOptions, engine: Engine) -> Capacity:
    batch = saturating_requests(workload_spec(opts, 1.0, 1.0), opts.capacity_requests)
    submissions = _submissions(batch, engine.info.vocab_size)
    started = time.monotonic()
    _replay(engine, submissions, started)
    return Capacity.of(batch, time.monotonic() - started)


@dataclass(slots=True)
class Bench:
    """What every engine-mode run starts from: the start-up calibration, the
    model the workload's deadlines are set with (and its scale, and each
    probe's ratio) and the first engine's measured capacity, and the one
    policy's engine running now.

    One engine at a time: on the CPU each engine thread that has stepped
    keeps an OpenMP team, and with more teams than cores libgomp stops
    spinning between regions. Measured on a 2-core Zen 3, the same closed
    batch on ``tiny``: 3.05 and 3.40 s on the only engine, 4.1-6.0 s on each
    of three once all had stepped (``small``: 27.7-31.6 s against 29-37):
    the policies replayed after the first ran on a slower machine than the
    one their load was measured on. A policy's engine is started when its
    first run comes and shut down (its thread and team gone) before the next
    policy's starts, so runs go policy by policy."""

    opts: SloOptions
    calibration: CostModel
    yardstick: CostModel
    deadline_scale: float
    probe_ratios: dict[str, float]
    capacity: Capacity
    current: Rig

    def rig(self, policy: str) -> Rig:
        """``policy``'s engine, started (and any other shut down) if need be."""
        if policy != self.current.scheduler.config.policy:
            self.current.engine.shutdown()
            self.current, _ = start_engine(self.opts, policy, self.calibration)
        return self.current

    def run(
        self, opts: SloOptions, policy: str, deadlines: str, load: float, cv: float,
        requests: list[SimRequest],
    ) -> dict[str, object]:  # fmt: skip
        """One real-time replay with its twins, scored against capacity."""
        run = _engine_run(self.rig(policy), policy, deadlines, load, cv, requests, opts)
        run["goodput_fraction_of_capacity"] = goodput_fraction(run, self.capacity)
        return run

    def requests(self, opts: SloOptions, load: float, cv: float) -> list[SimRequest]:
        spec = workload_spec(opts, load * self.capacity.rps, cv)
        return make_requests(spec, self.yardstick, opts.max_num_batched_tokens)

    def report_fields(self) -> dict[str, object]:
        return {
            "coefficients": _coeffs(self.calibration),
            "deadline_scale": self.deadline_scale,
            "deadline_probe_ratios": self.probe_ratios,
        }


@contextmanager
def started_bench(opts: SloOptions) -> Iterator[Bench]:
    """The first policy's engine started and measured; the engine running
    at the end shut down on exit. The heap is frozen for the collector while
    they run, as the server freezes it."""
    first, cost = start_engine(opts, opts.policies[0])
    bench: Bench | None = None
    try:
        with frozen_heap():
            yardstick, scale, probes = deadline_yardstick(opts, first.engine, cost)
            capacity = measure_capacity(opts, first.engine)
            bench = Bench(opts, cost, yardstick, scale, probes, capacity, first)
            yield bench
    finally:
        (first if bench is None else bench.current).engine.shutdown()


def run_engine_capacity(opts: SloOptions) -> dict[str, object]:
    """Each policy's SLO capacity on the real engine (see ``slo_capacity``):
    every evaluated load is a real-time replay, with its simulated twin."""
    cv = opts.cvs[0]
    with started_bench(opts) as bench:
        results = search_capacities(
            opts,
            lambda policy, load: bench.run(
                opts, policy, "enforced", load, cv, bench.requests(opts, load, cv)
            ),
        )
    report = capacity_report(results, bench.capacity, opts, cv, bench.yardstick)
    return {**report, **bench.report_fields()}


def run_engine_bench(opts: SloOptions) -> dict[str, object]:
    with started_bench(opts) as bench:
        predicted = sim_capacity(opts, CostModel(bench.calibration.coefficients))
        refit = sim_capacity(opts, CostModel(bench.current.cost_model.coefficients))
        workloads: dict[tuple[float, float], list[SimRequest]] = {}
        cells = list(run_grid(opts))
        done: dict[tuple[int, int], dict[str, object]] = {}
        # Policy by policy (one engine at a time, see Bench); reported in grid order.
        for policy in opts.policies:
            for index, (cv, load, p, deadlines) in enumerate(cells):
                if p != policy:
                    continue
                if (cv, load) not in workloads:
                    workloads[cv, load] = bench.requests(opts, load, cv)
                for repeat in range(opts.repeats):
                    run = bench.run(opts, policy, deadlines, load, cv, workloads[cv, load])
                    run["repeat"] = repeat
                    done[index, repeat] = run
        runs = [run for (_, repeat), run in sorted(done.items()) if repeat == 0]
        repeat_runs = [run for (_, repeat), run in sorted(done.items()) if repeat > 0]
    return {
        **grid_report(runs, bench.capacity),
        "sim_capacity_rps": predicted.rps,
        "sim_capacity_tokens_per_s": predicted.tokens_per_s,
        "sim_capacity_rps_refit": refit.rps,
        **bench.report_fields(),
        "repeat_runs": repeat_runs,
        "reproducibility": reproducibility([*runs, *repeat_runs]),
    }


def _engine_run(
    rig: Rig,
    policy: str,
    deadlines: str,
    load: float,
    cv: float,
    requests: list[SimRequest],
    opts: SloOptions,
) -> dict[str, object]:
    engine, sched, model = rig.engine, rig.scheduler, rig.cost_model
    # What the engine knew at the start, margin for its own error included
    # (a twin without it would plan closer to deadlines than the engine does).
    held = CostModel(model.coefficients, overrun=model.overrun)
    swaps0, recomputes0 = sched.num_swap_preemptions, sched.num_recompute_preemptions
    # The run's own steps, fit afresh (no forgetting): the step-time model of
    # exactly the machine time this run had, whatever the machine did before.
    own_steps = CostModel(held.coefficients, forgetting=1.0, max_drift=None)
    overruns: list[float] = []
    steps: list[StepRecord] = []  # (settled at, seconds, sequences), on the monotonic clock
    # Fit after the run: the listener runs on the engine thread, whose time
    # is the step's (a refit 60-90 us a step of 41 sequences on a Zen 3 core).
    measured: list[tuple[StepPlan, float]] = []

    def listen(plan: StepPlan, seconds: float) -> None:
        measured.append((plan, seconds))
        overruns.append(model.overrun)  # the margin the engine planned the next step with
        steps.append((time.monotonic(), seconds, len(plan.seqs)))

    rig.listeners.append(listen)
    seen = as_scheduled(requests, deadlines)
    submissions = _submissions(seen, engine.info.vocab_size)
    before = engine.stats()
    started = time.monotonic()
    # The twins start where the engine's policy stood (its overload window,
    # class-0 reserve and loaded step, learned from the runs before this
    # one), on the replay's clock, whose zero is ``started``.
    carried = carried_state(sched.policy, -started)
    try:
        outcomes, lags = _replay(engine, submissions, started)
    finally:
        rig.listeners.remove(listen)
    for plan, seconds in measured:
        own_steps.observe_plan(plan, seconds)
    swaps = sched.num_swap_preemptions - swaps0
    after = engine.stats()
    twin, twin_metrics = simulate_workload(opts, policy, requests, held, deadlines, carried)
    disagreements = scored_differently(outcomes, twin.outcomes, requests)
    mean_overrun = statistics.fmean(overruns) if overruns else model.overrun
    refit = CostModel(own_steps.coefficients, overrun=mean_overrun)
    twin_refit, twin_refit_metrics = simulate_workload(
        opts, policy, requests, refit, deadlines, carried
    )
    return {
        **run_header(policy, deadlines, load, cv, "engine"),
        **scored_metrics(outcomes, requests),
        "num_requests": len(requests),
        "preemptions_swap": swaps,
        "preemptions_recompute": sched.num_recompute_preemptions - recomputes0,
        "swapped_bytes_lower_bound": swaps * kv_bytes_per_block(rig.model, opts.block_size),
        "swapped_bytes": None,
        "sim_twin": {**twin_summary(twin_metrics, twin), "overrun": held.overrun},
        "sim_twin_run_fit": {
            **twin_summary(twin_refit_metrics, twin_refit),
            "coefficients": _coeffs(refit),
            "overrun": mean_overrun,
            "num_disagreements": len(scored_differently(outcomes, twin_refit.outcomes, requests)),
        },
        "host_ms_per_step": host_ms_per_step(before, after),
        "submit_lag_ms": submit_lag_ms(lags.values()),
        "num_twin_disagreements": len(disagreements),
        "twin_disagreements": disagreements[:MAX_LISTED_DISAGREEMENTS],
        "class0_misses": class0_misses(
            outcomes,
            requests,
            [(at - started, sec, n) for at, sec, n in steps],
            twin.outcomes,
            lags,
        )[:MAX_LISTED_DISAGREEMENTS],
    }


def submit_lag_ms(lags: Iterable[float]) -> dict[str, float] | None:
    """How late the replay's submissions were, ms: median, 99th percentile
    and largest; None without a submission."""
    ms = [1e3 * lag for lag in lags]
    if not ms:
        return None
    return {"p50": statistics.median(ms), "p99": percentile(ms, 99) or 0.0, "max": max(ms)}


def host_ms_per_step(before: EngineStats, after: EngineStats) -> dict[str, float] | None:
    """The engine thread's milliseconds a step by phase between two snapshots
    (``HostTimes``), and the steps they are over; None without a step."""
    steps = after.step - before.step
    if steps <= 0:
        return None
    start, end = before.host_times.as_dict(), after.host_times.as_dict()
    return {"steps": steps, **{k: 1e3 * (end[k] - start[k]) / steps for k in end}}


def _submissions(
    requests: Sequence[SimRequest], vocab: int, seed: int = 0
) -> list[tuple[SimRequest, list[int]]]:
    """Each of ``requests`` with its prompt (tokens drawn from ``seed``, in
    arrival order). Drawn before a replay starts, as a client's own work done in
    its own process: drawn at each submission (~0.1 ms a request on a Zen 3
    core alone, 0.23 ms beside a busy engine), they held the GIL that a GPU
    engine's host step needs (docs/gpu.md, "The replay's own prompts")."""
    rng = random.Random(seed)
    prompts: list[list[int]] = [[] for _ in requests]
    for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival):
        prompts[i] = [rng.randrange(4, vocab) for _ in range(requests[i].prompt_len)]
    return list(zip(requests, prompts, strict=True))


class Replay(NamedTuple):
    """A replay's outcomes in its submissions' order, and how late each
    request reached ``engine.submit`` after its arrival (seconds, by req_id):
    the replaying thread's own delay (its sleep's wake-up, the interpreter
    shared with the engine thread), which a deadline counted from the
    arrival pays."""

    outcomes: list[SimOutcome]
    submit_lag_s: dict[str, float]


def _replay(
    engine: Engine, submissions: Sequence[tuple[SimRequest, list[int]]], t0: float
) -> Replay:
    """Submits each request with its prompt at ``t0 + arrival``; waits for
    every finish."""
    requests = [spec for spec, _ in submissions]
    lags: dict[str, float] = {}
    done = threading.Event()
    lock = threading.Lock()
    first_token: dict[str, float] = {}
    finished: dict[str, tuple[FinishEvent | None, float, str]] = {}

    def on_event(event: Event) -> None:
        # On the engine thread, once a request a step: a token after the
        # first costs a look-up (only this thread writes ``first_token``).
        if isinstance(event, TokenEvent):
            if event.req_id not in first_token:
                first_token[event.req_id] = time.monotonic()
            return
        now = time.monotonic()
        with lock:
            finished[event.req_id] = (event, now, "")
            if len(finished) == len(requests):
                done.set()

    for spec, prompt in sorted(submissions, key=lambda s: s[0].arrival):
        delay = t0 + spec.arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        request = RequestSpec(
            req_id=spec.req_id,
            prompt_token_ids=prompt,
            max_new_tokens=spec.output_len,
            ignore_eos=True,
            priority=spec.priority,
            deadline=None if spec.deadline is None else t0 + spec.deadline,
            expected_output_tokens=spec.expected_output_tokens,
            arrival_time=t0 + spec.arrival,
        )
        lags[spec.req_id] = time.monotonic() - request.arrival_time
        try:
            engine.submit(request, on_event)
        except SchedulerError as exc:
            with lock:
                finished[spec.req_id] = (None, time.monotonic(), type(exc).__name__)
                if len(finished) == len(requests):
                    done.set()
    done.wait()
    outcomes = [
        _outcome(spec, t0, finished[spec.req_id], first_token.get(spec.req_id)) for spec in requests
    ]
    return Replay(outcomes, lags)


def _outcome(
    spec: SimRequest, t0: float, end: tuple[FinishEvent | None, float, str], first: float | None
) -> SimOutcome:
    event, when, rejection = end
    reason = FinishReason.REJECTED if event is None else event.reason
    if event is not None and event.reject_cause is not None:
        rejection = REJECT_CAUSE_NAMES[event.reject_cause]
    wait = (
        None
        if event is None or (event.ttft_s is None and event.num_output_tokens == 0)
        else event.queue_wait_s
    )
    return SimOutcome(
        req_id=spec.req_id,
        priority=spec.priority,
        arrival=spec.arrival,
        deadline=spec.deadline,
        finish_reason=reason,
        rejection=rejection,
        first_scheduled_time=None if wait is None else spec.arrival + wait,
        first_token_time=None if first is None else first - t0,
        finish_time=when - t0,
        num_output_tokens=0 if event is None else event.num_output_tokens,
        compute_s=0.0,
        num_preemptions=0 if event is None else event.num_preemptions,
        num_held_back=0 if event is None else event.num_held_back,
    )


def _coeffs(cost: CostModel) -> dict[str, float]:
    c = cost.coefficients
    return {name: getattr(c, name) for name in c.__slots__}
