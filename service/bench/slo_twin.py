"""The engine against its simulated twin (``bench slo``'s engine mode):
which requests the two scored differently, which class-0 requests missed
on the engine, and, for cells replayed more than once, how far apart the
engine's own replays are next to each twin's distance from them."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from slipstream.scheduler.simulator import SimOutcome, SimRequest, SimResult
from slipstream.service.bench.slo_report import side_attainment
from slipstream.service.bench.slo_workload import score_against

SIDES = (("engine", None), ("twin", "sim_twin"), ("twin_run_fit", "sim_twin_run_fit"))


def reproducibility(runs: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """For every cell replayed more than once (same requests, same policy):
    per class and overall, the engine's attainment in each replay and its
    spread (max - min), each twin's, and how far each twin's median is from
    the engine's. A deterministic twin cannot be within ``d`` of every
    replay when the replays themselves spread by more than ``2d``."""
    cells: dict[tuple[object, ...], list[dict[str, object]]] = {}
    for run in runs:
        key = (run["cv"], run["load"], run["policy"], run["deadlines"])
        cells.setdefault(key, []).append(run)
    rows: list[dict[str, object]] = []
    for (cv, load, policy, deadlines), group in cells.items():
        if len(group) < 2:
            continue
        classes: dict[str, dict[str, object]] = {}
        for cls in ("all", "0", "1", "2"):
            entry: dict[str, object] = {}
            medians: dict[str, float | None] = {}
            for name, field_name in SIDES:
                side_class = None if cls == "all" else cls
                values = [
                    side_attainment(run if field_name is None else run.get(field_name), side_class)
                    for run in group
                ]
                known = [float(v) for v in values if v is not None]  # type: ignore[arg-type]
                medians[name] = statistics.median(known) if known else None
                entry[name] = values
                entry[f"{name}_median"] = medians[name]
                if field_name is None:
                    entry["engine_spread"] = max(known) - min(known) if known else None
            ours = medians["engine"]
            for name, _ in SIDES[1:]:
                theirs = medians[name]
                entry[f"{name}_gap"] = (
                    None if theirs is None or ours is None else abs(theirs - ours)
                )
            classes[cls] = entry
        rows.append(
            {
                "cv": cv,
                "load": load,
                "policy": policy,
                "deadlines": deadlines,
                "replays": len(group),
                "classes": classes,
            }
        )
    return rows


MAX_LISTED_DISAGREEMENTS = 20


# One engine step as a run records it: (settled at, seconds, sequences),
# times on the run's clock (seconds from its start).
StepRecord = tuple[float, float, int]


def class0_misses(
    outcomes: Sequence[SimOutcome],
    requests: Sequence[SimRequest],
    steps: Sequence[StepRecord] = (),
    twin: Sequence[SimOutcome] = (),
    submit_lag_s: Mapping[str, float] | None = None,
) -> list[dict[str, object]]:
    """Every class-0 request that missed on the engine, with what happened
    to it and what it asked for: the first place to look when class 0 falls
    short. With the run's ``steps``, also the steps settled while it was
    live (how many, their median and longest, their median batch) beside
    the whole run's median step: whether it met slow steps or only many.
    With its ``twin``'s outcomes, the steps the twin held it back in beside
    the engine's. With the replay's ``submit_lag_s``, how late it reached
    the engine (time its deadline lost before the engine saw it)."""
    rows: list[dict[str, object]] = []
    twin_held = {o.req_id: o.num_held_back for o in twin}
    run_step_ms = 1e3 * statistics.median(s for _, s, _ in steps) if steps else None
    for outcome, spec in zip(score_against(outcomes, requests), requests, strict=True):
        if spec.priority != 0 or outcome.met_deadline:
            continue
        row: dict[str, object] = {
            "req_id": spec.req_id,
            "arrival_s": spec.arrival,
            "fate": _fate(outcome),
            "deadline_s": None if spec.deadline is None else spec.deadline - spec.arrival,
            "prompt_len": spec.prompt_len,
            "output_len": spec.output_len,
            "queue_wait_s": None
            if outcome.first_scheduled_time is None
            else outcome.first_scheduled_time - spec.arrival,
            "ttft_s": None
            if outcome.first_token_time is None
            else outcome.first_token_time - spec.arrival,
            "preemptions": outcome.num_preemptions,
            "held_back_steps": outcome.num_held_back,
        }
        if spec.req_id in twin_held:
            row["twin_held_back_steps"] = twin_held[spec.req_id]
        if submit_lag_s is not None and spec.req_id in submit_lag_s:
            row["submit_lag_ms"] = 1e3 * submit_lag_s[spec.req_id]
        if steps:
            row.update(_steps_while_live(steps, spec.arrival, outcome.finish_time))
            row["run_step_ms_p50"] = run_step_ms
        rows.append(row)
    return rows


def _steps_while_live(
    steps: Sequence[StepRecord], arrival: float, finish: float
) -> dict[str, object]:
    """The steps settled in ``(arrival, finish]``, summarised."""
    live = [(s, n) for at, s, n in steps if arrival < at <= finish]
    if not live:
        return {"steps_while_live": 0}
    return {
        "steps_while_live": len(live),
        "step_ms_p50_while_live": 1e3 * statistics.median(s for s, _ in live),
        "step_ms_max_while_live": 1e3 * max(s for s, _ in live),
        "batch_p50_while_live": statistics.median(n for _, n in live),
    }


def scored_differently(
    engine: Sequence[SimOutcome], twin: Sequence[SimOutcome], requests: Sequence[SimRequest]
) -> list[dict[str, object]]:
    """The requests that met their deadline on one side and not the other
    (both judged against ``requests``' deadlines), in request order."""
    ours, theirs = score_against(engine, requests), score_against(twin, requests)
    rows: list[dict[str, object]] = []
    for e, t, spec in zip(ours, theirs, requests, strict=True):
        if e.met_deadline == t.met_deadline:
            continue
        rows.append(
            {
                "req_id": spec.req_id,
                "priority": spec.priority,
                "met_on_engine": e.met_deadline,
                "met_in_twin": t.met_deadline,
                "engine": _fate(e),
                "twin": _fate(t),
                "deadline_s": None if spec.deadline is None else spec.deadline - spec.arrival,
            }
        )
    return rows


def _fate(outcome: SimOutcome) -> str:
    reason = outcome.finish_reason.name.lower()
    if outcome.rejection:
        reason = f"{reason}:{outcome.rejection}"
    return f"{reason} after {outcome.finish_time - outcome.arrival:.2f}s"


def twin_summary(metrics: dict[str, object], result: SimResult) -> dict[str, object]:
    classes = metrics["classes"]
    assert isinstance(classes, dict)
    return {
        "attainment": metrics["attainment"],
        "goodput_tokens_per_s": metrics["goodput_tokens_per_s"],
        "early_rejections": metrics["early_rejections"],
        "overload_refusals": metrics["overload_refusals"],
        "preemptions_swap": result.num_swap_preemptions,
        "preemptions_recompute": result.num_recompute_preemptions,
        "classes": {
            name: {key: c[key] for key in ("attainment", "ttft_p99_s", "max_wait_s")}
            for name, c in classes.items()
        },
    }
