"""SLO capacity search, calibration files and twin disagreements: the search
on synthetic attainment curves and on a small seeded simulation."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from slipstream.scheduler.cost_model import CostCoefficients, CostModel
from slipstream.scheduler.request import FinishReason
from slipstream.scheduler.simulator import SimOutcome, SimRequest, simulate
from slipstream.service.bench import slo, slo_options, slo_sim
from slipstream.service.bench.calibrate import FORMAT, load_calibration
from slipstream.service.bench.slo_capacity import capacity_ratios, find_capacity, meets_target
from slipstream.service.bench.slo_twin import scored_differently
from slipstream.service.bench.slo_workload import (
    attainable_load,
    saturating_requests,
)


def synthetic_run(load: float, class0: float, overall: float) -> dict[str, object]:
    classes = {c: {"attainment": overall} for c in "12"}
    return {
        "load": load,
        "attainment": overall,
        "classes": {"0": {"attainment": class0}, **classes},
    }


def curve(knee: float) -> object:
    """Attainment 1.0 up to ``knee``, falling fast beyond it."""

    def evaluate(load: float) -> dict[str, object]:
        overall = 1.0 if load <= knee else max(0.0, 1.0 - 2 * (load - knee))
        return synthetic_run(load, 1.0 if load <= knee + 0.05 else 0.9, overall)

    return evaluate


def test_target_is_class0_at_99_and_overall_at_90() -> None:
    assert meets_target(synthetic_run(1.0, 0.99, 0.90))
    assert not meets_target(synthetic_run(1.0, 0.98, 1.0))
    assert not meets_target(synthetic_run(1.0, 1.0, 0.89))
    assert not meets_target(synthetic_run(1.0, None, 1.0))  # type: ignore[arg-type]


def test_bisection_closes_in_on_the_knee() -> None:
    # overall >= 0.9 up to knee + 0.05 = 1.15
    result = find_capacity("p", curve(1.1), (0.5, 1.0, 1.5), bisections=6)  # type: ignore[arg-type]
    assert not result.is_lower_bound
    assert 1.14 <= result.load <= 1.15
    assert len(result.runs) == 3 + 6


def test_sweep_stops_at_the_first_miss_and_reports_lower_bounds() -> None:
    calls: list[float] = []

    def evaluate(load: float) -> dict[str, object]:
        calls.append(load)
        return synthetic_run(load, 1.0, 0.5 if load == 1.0 else 1.0)  # a lucky pass at 1.5

    result = find_capacity("p", evaluate, (0.5, 1.0, 1.5), bisections=0)
    assert result.load == 0.5 and calls == [0.5, 1.0]
    everything = find_capacity("p", curve(9.0), (0.5, 1.0), bisections=3)  # type: ignore[arg-type]
    assert everything.is_lower_bound and everything.load == 1.0
    nothing = find_capacity("p", curve(0.0), (0.5, 1.0), bisections=2)  # type: ignore[arg-type]
    assert nothing.load == 0.0 and not nothing.is_lower_bound
    with pytest.raises(ValueError, match="ascending"):
        find_capacity("p", evaluate, (1.0, 0.5))


def test_capacity_ratios() -> None:
    found = {"deadline": {"load": 1.5}, "fcfs": {"load": 1.0}, "priority": {"load": 0.0}}
    assert capacity_ratios(found) == {"over_fcfs": 1.5, "over_priority": None}


def test_cli_capacity_in_the_simulator_writes_json_and_plot(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    slo.add_parser(parser.add_subparsers())
    out, png = tmp_path / "cap.json", tmp_path / "cap.png"
    argv = "slo --sim --capacity --requests 150 --capacity-requests 100 --cv 1"
    argv += " --policy fcfs --policy deadline --slack 4 8 16"
    argv += " --capacity-loads 0.5 1.0 2.0 --capacity-bisections 1"
    args = parser.parse_args([*argv.split(), "--json", str(out), "--plot", str(png)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert set(report["capacity"]) == {"fcfs", "deadline"}
    for policy, entry in report["capacity"].items():
        assert entry["rate_rps"] == pytest.approx(entry["load"] * report["capacity_rps"])
        runs = [r for r in report["capacity_runs"] if r["policy"] == policy]
        passing = [r["load"] for r in runs if meets_target(r)]
        assert entry["load"] == (max(passing) if passing else 0.0) or entry["is_lower_bound"]
        assert all("goodput_fraction_of_capacity" in r for r in runs)
    assert 1.0 < report["attainable_load"] < 3.0
    assert png.stat().st_size > 1000


def test_calibration_file_round_trip_and_clear_errors(tmp_path: Path) -> None:
    coeffs = {"base_s": 0.02, "per_prefill_token_s": 0.0003, "per_decode_seq_s": 0.001}
    good = tmp_path / "cal.json"
    good.write_text(json.dumps({"format": FORMAT, "coefficients": coeffs}))
    assert load_calibration(good) == CostCoefficients(0.02, 0.0003, 0.001)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(coeffs))
    assert load_calibration(bare).base_s == 0.02
    cases = {
        "other.json": ({"format": "x", "coefficients": coeffs}, "not a"),
        "unknown.json": ({"base_s": 1.0, "speed": 2.0}, "unknown coefficients"),
        "negative.json": ({"base_s": -1.0}, "bad coefficients"),
        "list.json": ([1, 2], "JSON object"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            load_calibration(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_calibration(tmp_path / "missing.json")


def outcome(spec: SimRequest, reason: FinishReason, finish: float) -> SimOutcome:
    return SimOutcome(
        spec.req_id, spec.priority, spec.arrival, None, reason, "", 0.0, 0.1, finish, 4, 0.0, 0
    )


def test_requests_scored_differently_are_listed() -> None:
    specs = [SimRequest(f"r{i}", 0.0, 8, 4, priority=i, deadline=1.0) for i in range(3)]
    engine = [
        outcome(specs[0], FinishReason.MAX_TOKENS, 0.5),
        outcome(specs[1], FinishReason.MAX_TOKENS, 1.5),  # late on the engine
        outcome(specs[2], FinishReason.DEADLINE_EXCEEDED, 1.0),
    ]
    twin = [
        outcome(specs[0], FinishReason.MAX_TOKENS, 0.6),
        outcome(specs[1], FinishReason.MAX_TOKENS, 0.9),
        outcome(specs[2], FinishReason.DEADLINE_EXCEEDED, 1.0),
    ]
    (row,) = scored_differently(engine, twin, specs)
    assert row["req_id"] == "r1" and row["priority"] == 1
    assert row["met_in_twin"] and not row["met_on_engine"]
    assert "max_tokens after 1.50s" in str(row["engine"])


# -- what any policy can attain -------------------------------------------------


def _req(i: int, prompt: int, output: int, cls: int) -> SimRequest:
    return SimRequest(f"r{i}", 0.0, prompt, output, priority=cls)


def test_attainable_load_gives_up_the_heaviest_the_targets_allow() -> None:
    cost = CostModel(CostCoefficients(0.0, 0.0, 0.01, 0.0))  # one unit per decode
    # 20 requests: outputs 11 (10 decodes) except two of 101 (100 decodes).
    requests = [_req(i, 8, 11, 2) for i in range(18)]
    requests += [_req(18, 8, 101, 2), _req(19, 8, 101, 0)]
    total = 18 * 10 + 2 * 100
    # 90 % of 20 lets 2 go; class 0 has one request, 99 % of it lets none go:
    # the heavy class-2 request and one light one.
    expected = total / (total - 100 - 10)
    assert attainable_load(requests, cost, 32, 0.90, 0.99) == pytest.approx(expected)
    # Class 0 free to go as well: both heavy ones.
    assert attainable_load(requests, cost, 32, 0.90, 0.0) == pytest.approx(total / (total - 200))
    # Every request must be met: no load above capacity is attainable.
    assert attainable_load(requests, cost, 32, 1.0, 1.0) == pytest.approx(1.0)


def test_batched_shares_add_up_to_a_saturated_runs_time() -> None:
    """The weights ``attainable_load`` compares are the simulated machine
    time of a saturating batch (within the ramp-down of its last steps)."""
    opts = slo_options.SloOptions(
        mode="sim", num_requests=400, loads=(1.0,), cvs=(1.0,), policies=("fcfs",)
    )
    spec = slo_options.workload_spec(opts, 1.0, 1.0)
    batch = saturating_requests(spec, 400)
    cost = CostModel(opts.coefficients)
    result = simulate(batch, slo_options.scheduler_config(opts, "fcfs"), cost)
    shares = sum(cost.batched_seconds(r.prompt_len, r.output_len, opts.max_num_seqs) for r in batch)
    assert shares == pytest.approx(result.makespan_s, rel=0.05)


def test_capacity_is_not_inflated_by_a_queue_limit() -> None:
    opts = slo_options.SloOptions(
        mode="sim",
        num_requests=100,
        loads=(1.0,),
        cvs=(1.0,),
        policies=("fcfs",),
        capacity_requests=120,
    )
    limited = slo_sim.sim_capacity(replace(opts, max_queue_len=16))
    assert limited.rps == pytest.approx(slo_sim.sim_capacity(opts).rps)
