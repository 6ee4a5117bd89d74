"""``slipstream bench slo --sim`` on a small seeded workload: deterministic
(no wall clock in any number checked), a few seconds."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from slipstream.scheduler.cost_model import MAX_OVERRUN, CostModel
from slipstream.scheduler.simulator import simulate
from slipstream.service.bench import slo, slo_capacity, slo_engine, slo_options, slo_report, slo_sim
from slipstream.service.bench.slo_twin import reproducibility
from slipstream.service.bench.slo_workload import gamma_arrivals, hide_deadlines, score_against

CLASS_KEYS = {"attainment", "goodput_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s"}
CLASS_KEYS |= {"tpot_p99_s", "max_wait_s", "wait_p99_s", "preemptions", "early_rejections"}
CLASS_KEYS |= {"missed_compute_s"}
RUN_KEYS = {"policy", "load", "cv", "mode", "goodput_tokens_per_s", "classes", "swapped_bytes"}
RUN_KEYS |= {"preemptions_swap", "preemptions_recompute", "early_rejections", "missed_compute_s"}


@pytest.fixture(scope="module")
def report() -> dict[str, object]:
    opts = slo_options.SloOptions(
        mode="sim",
        num_requests=600,
        loads=(1.5,),
        cvs=(1.0,),
        policies=("fcfs", "priority", "deadline"),
        capacity_requests=200,
        seed=3,
    )
    return slo_sim.run_sim_bench(opts)


def test_json_has_the_documented_shape(report: dict[str, object]) -> None:
    runs = report["runs"]
    assert isinstance(runs, list) and len(runs) == 5  # baselines enforced and unaware
    for run in runs:
        assert set(run) >= RUN_KEYS
        assert run["mode"] == "sim" and run["load"] == 1.5 and run["cv"] == 1.0
        assert set(run["classes"]) == {"0", "1", "2"}
        for metrics in run["classes"].values():
            assert set(metrics) >= CLASS_KEYS
    json.dumps(report)  # serialisable


def test_deadline_meets_the_most_deadlines_at_1_5x(report: dict[str, object]) -> None:
    by_policy = {
        r["policy"]: r
        for r in report["runs"]  # type: ignore[union-attr]
        if r["deadlines"] == "enforced"
    }
    class0 = {p: r["classes"]["0"]["attainment"] for p, r in by_policy.items()}
    assert class0["deadline"] >= 0.95
    assert class0["deadline"] > class0["fcfs"] + 0.2
    overall = {p: r["attainment"] for p, r in by_policy.items()}
    assert overall["deadline"] > max(overall["fcfs"], overall["priority"]) + 0.1
    # Past capacity it turns the heaviest class-2 requests away: more requests
    # meet their deadlines, a few of the tokens go with them.
    goodput = {p: r["goodput_tokens_per_s"] for p, r in by_policy.items()}
    assert goodput["deadline"] > 0.9 * goodput["fcfs"]


def test_unaware_baselines_never_expire_but_are_scored_against_deadlines(
    report: dict[str, object],
) -> None:
    runs = {(r["policy"], r["deadlines"]): r for r in report["runs"]}  # type: ignore[union-attr]
    for policy in ("fcfs", "priority"):
        unaware, enforced = runs[policy, "unaware"], runs[policy, "enforced"]
        assert all(c["deadline_exceeded"] == 0 for c in unaware["classes"].values())
        assert unaware["early_rejections"] == 0
        assert sum(c["deadline_exceeded"] for c in enforced["classes"].values()) > 0
        # Overloaded and never dropping late work: some requests finish late.
        assert unaware["attainment"] < 1.0
        # Late work runs to completion, so more compute goes to misses.
        assert unaware["missed_compute_s"] > enforced["missed_compute_s"]


def test_goodput_ratios_compare_deadline_with_each_baseline_mode(
    report: dict[str, object],
) -> None:
    goodput = {
        (r["policy"], r["deadlines"]): r["goodput_tokens_per_s"]
        for r in report["runs"]  # type: ignore[union-attr]
    }
    rows = {r["baseline_deadlines"]: r for r in report["goodput_ratios"]}  # type: ignore[union-attr]
    assert set(rows) == {"enforced", "unaware"}
    for mode, row in rows.items():
        for baseline in ("fcfs", "priority"):
            expected = goodput["deadline", "enforced"] / goodput[baseline, mode]
            assert row[f"over_{baseline}"] == pytest.approx(expected)
    capacity = report["capacity_tokens_per_s"]
    for run in report["runs"]:  # type: ignore[union-attr]
        fraction = run["goodput_tokens_per_s"] / capacity  # type: ignore[operator]
        assert run["goodput_fraction_of_capacity"] == pytest.approx(fraction)


def test_score_against_refuses_mismatched_outcomes() -> None:
    from slipstream.scheduler.simulator import SimRequest

    requests = [SimRequest(f"r{i}", float(i), 8, 4, deadline=float(i) + 1) for i in range(2)]
    hidden = hide_deadlines(requests)
    assert all(r.deadline is None for r in hidden)
    outcomes = simulate(hidden, slo_options.scheduler_config(_tiny_opts(), "fcfs"), CostModel())
    scored = score_against(outcomes.outcomes, requests)
    assert [o.deadline for o in scored] == [1.0, 2.0]
    with pytest.raises(ValueError, match="is not request"):
        score_against(outcomes.outcomes, requests[::-1])


def _tiny_opts() -> slo_options.SloOptions:
    return slo_options.SloOptions(
        mode="sim", num_requests=2, loads=(1.0,), cvs=(1.0,), policies=("fcfs",)
    )


def test_simulation_is_deterministic() -> None:
    opts = slo_options.SloOptions(
        mode="sim", num_requests=150, loads=(1.5,), cvs=(3.0,), policies=("deadline",)
    )
    capacity = slo_capacity.Capacity(rps=2.0, tokens_per_s=100.0)
    first = slo_sim.sim_run(opts, "deadline", 1.5, 3.0, capacity)
    second = slo_sim.sim_run(opts, "deadline", 1.5, 3.0, capacity)
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


def test_sim_on_an_h100s_steps_calibrates_on_them(tmp_path) -> None:
    """--device-steps h100: the model is calibrated on the device's steps
    (the fixed cost of an eager step comes out of the fit) and the runs take
    the device's times, not the model's."""
    from slipstream.service.bench.device_steps import H100_EAGER_S, H100_GRAPHED_S

    parser = argparse.ArgumentParser()
    slo.add_parser(parser.add_subparsers())
    out = tmp_path / "slo.json"
    argv = ["slo", "--sim", "--device-steps", "h100", "--requests", "150", "--load", "1.5"]
    argv += ["--cv", "1", "--slack", "4", "8", "16", "--policy", "fcfs", "--policy", "deadline"]
    args = parser.parse_args(
        [*argv, "--capacity-requests", "100", "--json", str(out), "--plot", ""]
    )
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    step = report["options"]["coefficients"]["per_prefill_step_s"]
    assert step == pytest.approx(H100_EAGER_S - H100_GRAPHED_S, rel=0.05)
    runs = {r["policy"]: r for r in report["runs"] if r["deadlines"] == "enforced"}
    assert runs["deadline"]["classes"]["0"]["attainment"] >= 0.95
    assert runs["fcfs"]["classes"]["0"]["attainment"] < 0.9  # the deadlines bind
    with pytest.raises(SystemExit, match="takes --sim"):
        bad = parser.parse_args(["slo", "--device-steps", "h100"])
        slo.options_from_args(bad)


def test_sim_on_an_h200s_loaded_steps_with_an_idle_engines_deadlines(tmp_path, monkeypatch) -> None:
    """--device-steps h200-loaded --engine-shape --plan-ahead --yardstick F:
    the engine mode's workload on an H200's loaded steps, deadlines from a
    request alone on an idle engine (1 ms a step). Planning ahead, class 0
    meets its tight deadlines only with the ceilings' spare steps for the
    step in flight (without them, its short requests end a hair late)."""
    import slipstream.scheduler.deadline_policy as deadline_policy

    idle = tmp_path / "idle.json"
    idle.write_text(json.dumps({"base_s": 0.001, "per_prefill_token_s": 2e-7,
                                "per_decode_seq_s": 0.0, "per_context_token_s": 0.0}))  # fmt: skip
    argv = ["slo", "--sim", "--device-steps", "h200-loaded", "--engine-shape", "--plan-ahead"]
    argv += ["--yardstick", str(idle), "--requests", "1000", "--load", "1.5", "--cv", "1"]
    opts = slo.options_from_args(_parse([*argv, "--slack", "4", "8", "16", "--policy", "deadline"]))
    assert opts.yardstick is not None and opts.yardstick.base_s == 0.001
    assert (opts.num_device_blocks, opts.prompt_len, opts.aging_s) == (256, (16, 128), 10.0)
    assert opts.capacity_requests == 96 and opts.plan_ahead

    def class0() -> float:
        (run,) = slo_sim.run_sim_bench(opts)["runs"]
        return run["classes"]["0"]["attainment"]

    assert class0() >= 0.99
    monkeypatch.setattr(deadline_policy, "IN_FLIGHT_MARGIN_STEPS", 0.0)
    assert class0() < 0.97
    with pytest.raises(SystemExit, match="take --sim"):
        slo.options_from_args(_parse(["slo", "--yardstick", str(idle)]))


def test_engine_mode_on_a_gpu_takes_the_gpus_step_budget(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(slo, "resolve_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(slo, "resolved_dtype", lambda dtype, device: "bfloat16")
    parser = argparse.ArgumentParser()
    slo.add_parser(parser.add_subparsers())
    opts = slo.options_from_args(parser.parse_args(["slo", "--device", "cuda"]))
    assert opts.device == "cuda:0" and opts.max_num_batched_tokens == 8192
    sim = slo.options_from_args(parser.parse_args(["slo", "--sim", "--device", "cuda"]))
    assert sim.max_num_batched_tokens == 512


def test_engine_mode_replays_on_the_real_engine_with_a_sim_twin(
    tiny_model_dir, tmp_path, monkeypatch
) -> None:
    # One policy's engine at a time: each engine started finds every earlier
    # one shut down, its thread (and on the CPU its OpenMP team) gone.
    started: list[tuple[str, object]] = []
    start = slo_engine.start_engine

    def spied(opts, policy, cost=None):
        assert all(not rig.engine._thread.is_alive() for _, rig in started)
        rig, calibration = start(opts, policy, cost)
        started.append((policy, rig))
        return rig, calibration

    monkeypatch.setattr(slo_engine, "start_engine", spied)
    opts = replace(
        slo.options_from_args(
            _parse(["slo", "--requests", "24", "--model", "tiny", "--repeats", "2"])
        ),
        loads=(1.5,),
        cvs=(1.0,),
        policies=("priority", "deadline"),
        baseline_deadlines=("unaware",),
        capacity_requests=16,
    )
    report = slo_engine.run_engine_bench(opts)
    assert [policy for policy, _ in started] == ["priority", "deadline"]
    assert not started[-1][1].engine._thread.is_alive()
    runs = report["runs"]
    assert [(r["policy"], r["deadlines"]) for r in runs] == [
        ("priority", "unaware"),
        ("deadline", "enforced"),
    ]
    for run in runs:
        assert run["mode"] == "engine" and set(run) >= RUN_KEYS
        assert sum(c["num_requests"] for c in run["classes"].values()) == 24
        twin = run["sim_twin"]
        assert 0.0 <= twin["attainment"] <= 1.0
        listed = run["twin_disagreements"]
        assert len(listed) == min(run["num_twin_disagreements"], 20)
        assert all(row["met_on_engine"] != row["met_in_twin"] for row in listed)
        run_fit = run["sim_twin_run_fit"]
        assert 0.0 <= run_fit["attainment"] <= 1.0 and run_fit["num_disagreements"] >= 0
        # fit on this run's own steps: moved away from the start-up calibration
        assert run_fit["coefficients"] != report["coefficients"]
        misses = run["class0_misses"]
        c0 = run["classes"]["0"]
        missed_c0 = round(c0["num_requests"] * (1 - c0["attainment"]))
        assert len(misses) == min(missed_c0, 20)
        assert all(row["fate"] and row["deadline_s"] > 0 for row in misses)
        assert all(0 <= row["held_back_steps"] <= row["steps_while_live"] for row in misses)
        assert set(twin["classes"]) == {"0", "1", "2"}
        # the twins plan with the margin the engine kept for its own error
        assert 0.0 <= twin["overrun"] <= MAX_OVERRUN
        assert 0.0 <= run_fit["overrun"] <= MAX_OVERRUN
        # the engine thread's time a step, by phase (the CPU runs its forward in the launch)
        host = run["host_ms_per_step"]
        assert host["steps"] > 0 and host["planning"] > 0 and host["launch"] > 0
        assert host["device_wait"] == 0
        # how late the replay reached engine.submit, and each class-0 miss's own lag
        lag = run["submit_lag_ms"]
        assert 0.0 <= lag["p50"] <= lag["p99"] <= lag["max"]
        assert all(0.0 <= row["submit_lag_ms"] <= lag["max"] for row in misses)
    # every cell replayed a second time on the same requests
    again = report["repeat_runs"]
    assert [(r["policy"], r["repeat"]) for r in again] == [("priority", 1), ("deadline", 1)]
    cells = report["reproducibility"]
    assert [(c["policy"], c["replays"]) for c in cells] == [("priority", 2), ("deadline", 2)]
    for cell, first, second in zip(cells, runs, again, strict=True):
        engine_all = cell["classes"]["all"]
        assert engine_all["engine"] == [first["attainment"], second["attainment"]]
        assert engine_all["engine_spread"] == pytest.approx(
            abs(first["attainment"] - second["attainment"])
        )
    assert report["capacity_rps"] > 0 and report["sim_capacity_rps"] > 0
    assert report["deadline_scale"] > 0  # isolated requests measured on the engine
    probes = report["deadline_probe_ratios"]
    assert list(probes) == ["32x8", "64x24", "128x48"] and min(probes.values()) > 0
    assert report["deadline_scale"] == pytest.approx(sorted(probes.values())[1])
    assert {r["baseline_deadlines"] for r in report["goodput_ratios"]} == {"unaware"}
    summary = slo_report.format_summary(report)
    assert "engine vs its simulated twin" in summary and "capacity: engine" in summary
    assert "isolated requests measured: 32x8 " in summary
    assert "the engine replaying the same requests" in summary
    assert "engine thread, ms a step" in summary and "; submissions late p50 " in summary
    png = tmp_path / "slo.png"
    slo_report.plot_attainment(report, str(png))  # the replays drawn next to the first runs
    assert png.stat().st_size > 1000


def test_reproducibility_states_the_engines_spread_and_each_twins_gap() -> None:
    def run(engine: float, twin: float, fit: float, policy: str = "deadline") -> dict:
        def side(value: float) -> dict:
            return {"attainment": value, "classes": {c: {"attainment": value} for c in "012"}}

        return {
            "cv": 1.0,
            "load": 1.5,
            "policy": policy,
            "deadlines": "enforced",
            **side(engine),
            "sim_twin": side(twin),
            "sim_twin_run_fit": side(fit),
        }

    rows = reproducibility(
        [
            run(0.90, 0.80, 0.91),
            run(0.96, 0.82, 0.93),
            run(0.93, 0.81, 0.92),
            run(0.5, 0.5, 0.5, "fcfs"),
        ]
    )
    assert len(rows) == 1  # fcfs ran once: no spread to state
    c1 = rows[0]["classes"]["1"]
    assert rows[0]["replays"] == 3
    assert c1["engine"] == [0.90, 0.96, 0.93]
    assert c1["engine_spread"] == pytest.approx(0.06)
    assert c1["engine_median"] == pytest.approx(0.93)
    assert c1["twin_gap"] == pytest.approx(0.12)
    assert c1["twin_run_fit_gap"] == pytest.approx(0.01)


def test_repeats_are_refused_where_they_cannot_differ() -> None:
    for argv in (["slo", "--sim", "--repeats", "2"], ["slo", "--capacity", "--repeats", "3"]):
        with pytest.raises(SystemExit):
            slo.options_from_args(_parse(argv))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    slo.add_parser(parser.add_subparsers())
    return parser.parse_args(argv)


@pytest.mark.slow
def test_engine_capacity_search_on_the_real_engine(tiny_model_dir) -> None:
    opts = replace(
        slo.options_from_args(_parse(["slo", "--capacity", "--requests", "16", "--model", "tiny"])),
        cvs=(1.0,),
        policies=("deadline",),
        capacity_requests=16,
        capacity_sweep=(0.5, 1.0),
        capacity_bisections=0,
    )
    report = slo_engine.run_engine_capacity(opts)
    entry = report["capacity"]["deadline"]
    assert entry["load"] in (0.0, 0.5, 1.0)
    assert entry["rate_rps"] == pytest.approx(entry["load"] * report["capacity_rps"])
    runs = report["capacity_runs"]
    assert 1 <= len(runs) <= 2 and all(r["mode"] == "engine" and "sim_twin" in r for r in runs)


def test_the_whole_step_h100_graphs_steps_with_a_prefill_up_to_the_graphs_size(tmp_path) -> None:
    """h100-whole-step: a step with a prefill costs about a graphed decode
    step up to PREFILL_GRAPH_TOKENS tokens, an eager step past it; the sim
    plans ahead with --plan-ahead and says so in its options."""
    from slipstream.scheduler.plan import ScheduledSeq, StepPlan
    from slipstream.scheduler.request import SamplingParams
    from slipstream.service.bench.device_steps import H100_EAGER_S, device_steps
    from slipstream.service.engine.config import PREFILL_GRAPH_TOKENS

    def plan(prefill: int, decodes: int) -> StepPlan:
        seqs = [ScheduledSeq("p", [5] * prefill, 0, [0], True, 0, SamplingParams())][:prefill]
        seqs += [
            ScheduledSeq(f"d{i}", [5], 512, [0], True, 3, SamplingParams()) for i in range(decodes)
        ]
        return StepPlan(step=0, seqs=seqs)

    whole, eager = device_steps("h100-whole-step", 256), device_steps("h100", 256)
    decode_only = plan(0, 8)
    assert whole(decode_only) == eager(decode_only)
    assert whole(plan(256, 8)) < 1.2 * whole(decode_only) < H100_EAGER_S
    assert eager(plan(256, 8)) > H100_EAGER_S
    past = plan(PREFILL_GRAPH_TOKENS, 8)
    assert whole(past) == eager(past)

    parser = argparse.ArgumentParser()
    slo.add_parser(parser.add_subparsers())
    out = tmp_path / "slo.json"
    argv = ["slo", "--sim", "--device-steps", "h100-whole-step", "--plan-ahead"]
    argv += ["--requests", "100", "--load", "1.0", "--cv", "1", "--policy", "deadline"]
    args = parser.parse_args([*argv, "--capacity-requests", "60", "--json", str(out), "--plot", ""])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["options"]["plan_ahead"] is True
    assert report["options"]["device_steps"] == "h100-whole-step"
    assert report["runs"][0]["classes"]["0"]["attainment"] >= 0.95


def test_a_class0_miss_lists_the_steps_it_lived_through() -> None:
    """With the run's steps, a class-0 miss says how many steps settled while
    it was live, how long they took against the run's median, and their batch."""
    from slipstream.scheduler.request import FinishReason
    from slipstream.scheduler.simulator import SimOutcome, SimRequest
    from slipstream.service.bench.slo_twin import class0_misses

    spec = SimRequest("r", arrival=1.0, prompt_len=16, output_len=10, priority=0, deadline=1.03)
    missed = SimOutcome(
        "r",
        0,
        1.0,
        1.03,
        FinishReason.MAX_TOKENS,
        "",
        1.002,
        1.008,
        1.035,
        10,
        0.0,
        0,
        num_held_back=4,
    )
    steps = [(0.5, 0.002, 4), (1.01, 0.002, 8), (1.02, 0.006, 10), (1.035, 0.003, 12)]
    steps.append((2.0, 0.002, 3))
    (row,) = class0_misses([missed], [spec], steps)
    assert row["held_back_steps"] == 4  # the steps the batch shaper held it back in
    assert "twin_held_back_steps" not in row
    twin = replace(missed, num_held_back=1)
    (with_twin,) = class0_misses([missed], [spec], steps, [twin])
    assert with_twin["twin_held_back_steps"] == 1
    assert row["steps_while_live"] == 3
    assert row["step_ms_p50_while_live"] == pytest.approx(3.0)
    assert row["step_ms_max_while_live"] == pytest.approx(6.0)
    assert row["batch_p50_while_live"] == 10
    assert row["run_step_ms_p50"] == pytest.approx(2.0)
    (bare,) = class0_misses([missed], [spec])
    assert "steps_while_live" not in bare and bare["ttft_s"] == pytest.approx(0.008)
    assert "submit_lag_ms" not in bare
    (late,) = class0_misses([missed], [spec], steps, [twin], {"r": 0.0045, "other": 1.0})
    assert late["submit_lag_ms"] == pytest.approx(4.5)  # its deadline lost that before the engine


def test_a_class0_miss_line_says_how_late_it_was_submitted() -> None:
    row = {
        "req_id": "r7",
        "arrival_s": 0.5,
        "fate": "deadline_exceeded after 0.02s",
        "deadline_s": 0.02,
        "prompt_len": 40,
        "output_len": 12,
        "queue_wait_s": 0.0,
        "ttft_s": 0.004,
        "preemptions": 0,
        "held_back_steps": 3,
        "twin_held_back_steps": 0,
    }
    run = {"cv": 1.0, "load": 1.5, "policy": "deadline", "deadlines": "enforced"}
    (header, line) = slo_report._class0_miss_lines([{**run, "class0_misses": [row]}])
    assert header.strip().startswith("class-0 misses on the engine, cv 1 load 1.5")
    assert line.endswith("held back 3 steps (twin 0)")  # a report from before the lag was kept
    late = {**row, "submit_lag_ms": 6.25}
    (_, line) = slo_report._class0_miss_lines([{**run, "class0_misses": [late]}])
    assert line.endswith("held back 3 steps (twin 0), submitted 6.2 ms late")
