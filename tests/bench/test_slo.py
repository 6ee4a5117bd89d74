"""``slipstream bench slo --sim`` on a small seeded workload: deterministic
(no wall clock in any number checked), a few seconds."""

from __future__ import annotations

import argparse
import json

import pytest

from slipstream.service.bench import slo
from slipstream.service.bench.slo_workload import gamma_arrivals

CLASS_KEYS = {"attainment", "goodput_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s"}
CLASS_KEYS |= {"tpot_p99_s", "max_wait_s", "wait_p99_s", "preemptions", "early_rejections"}
CLASS_KEYS |= {"missed_compute_s"}
RUN_KEYS = {"policy", "load", "cv", "mode", "goodput_tokens_per_s", "classes", "swapped_bytes"}
RUN_KEYS |= {"preemptions_swap", "preemptions_recompute", "early_rejections", "missed_compute_s"}


@pytest.fixture(scope="module")
def report() -> dict[str, object]:
    opts = slo.SloOptions(
        mode="sim",
        num_requests=600,
        loads=(1.5,),
        cvs=(1.0,),
        policies=("fcfs", "priority", "deadline"),
        capacity_requests=200,
        seed=3,
    )
    return slo.run_sim_bench(opts)


def test_json_has_the_documented_shape(report: dict[str, object]) -> None:
    runs = report["runs"]
    assert isinstance(runs, list) and len(runs) == 3
    for run in runs:
        assert set(run) >= RUN_KEYS
        assert run["mode"] == "sim" and run["load"] == 1.5 and run["cv"] == 1.0
        assert set(run["classes"]) == {"0", "1", "2"}
        for metrics in run["classes"].values():
            assert set(metrics) >= CLASS_KEYS
    json.dumps(report)  # serialisable


def test_deadline_beats_fcfs_on_class_0_attainment_at_1_5x(report: dict[str, object]) -> None:
    by_policy = {r["policy"]: r for r in report["runs"]}  # type: ignore[union-attr]
    class0 = {p: r["classes"]["0"]["attainment"] for p, r in by_policy.items()}
    assert class0["deadline"] >= 0.95
    assert class0["deadline"] > class0["fcfs"] + 0.2
    assert by_policy["deadline"]["goodput_tokens_per_s"] > by_policy["fcfs"]["goodput_tokens_per_s"]


def test_simulation_is_deterministic() -> None:
    opts = slo.SloOptions(
        mode="sim", num_requests=150, loads=(1.5,), cvs=(3.0,), policies=("deadline",)
    )
    first = slo.sim_run(opts, "deadline", 1.5, 3.0, capacity_rps=2.0)
    second = slo.sim_run(opts, "deadline", 1.5, 3.0, capacity_rps=2.0)
    for run in (first, second):
        del run["sim_wall_s"]
    assert first == second


def test_gamma_arrivals_have_the_requested_rate_and_cv() -> None:
    import random

    times = gamma_arrivals(20_000, rate_rps=4.0, cv=3.0, rng=random.Random(0))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    mean = sum(gaps) / len(gaps)
    std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert mean == pytest.approx(0.25, rel=0.1)
    assert std / mean == pytest.approx(3.0, rel=0.15)


def test_cli_single_run_writes_json_and_plot(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    slo.add_parser(sub)
    out, png = tmp_path / "slo.json", tmp_path / "slo.png"
    args = parser.parse_args(
        [
            "slo",
            "--sim",
            "--requests",
            "120",
            "--load",
            "1.0",
            "--cv",
            "1",
            "--policy",
            "deadline",
            "--capacity-requests",
            "100",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert [(r["policy"], r["load"], r["cv"]) for r in report["runs"]] == [("deadline", 1.0, 1.0)]
    assert png.stat().st_size > 1000
