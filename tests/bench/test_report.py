from __future__ import annotations

import pytest

from slipstream.service.bench.report import (
    EngineRun,
    RequestTiming,
    TokenCountMismatch,
    check_token_counts,
    engine_metrics,
    format_table,
    throughput_ratios,
)


def _run(name: str, wall_s: float, latencies: list[float], tokens: int = 10) -> EngineRun:
    return EngineRun(name, wall_s, [RequestTiming(tokens, lat, lat / 2) for lat in latencies])


def test_metrics_from_timings() -> None:
    metrics = engine_metrics(_run("x", 2.0, [1.0, 2.0, 3.0, 4.0, 5.0]))
    assert metrics["output_tokens_per_s"] == pytest.approx(25.0)
    assert metrics["p50_s"] == pytest.approx(3.0)
    assert metrics["p95_s"] == pytest.approx(4.8)
    assert metrics["ttft_p50_s"] == pytest.approx(1.5)
    assert metrics["num_output_tokens"] == 50


def test_ttft_unknown_when_any_request_lacks_it() -> None:
    run = EngineRun("x", 1.0, [RequestTiming(1, 1.0, None), RequestTiming(1, 1.0, 0.5)])
    assert engine_metrics(run)["ttft_p50_s"] is None


def test_ratios_against_each_peer() -> None:
    engines = {
        "slipstream": engine_metrics(_run("slipstream", 1.0, [1.0])),
        "hf_cb": engine_metrics(_run("hf_cb", 4.0, [1.0])),
    }
    assert throughput_ratios(engines) == {"slipstream/hf_cb": pytest.approx(4.0)}
    assert throughput_ratios({"hf_cb": engines["hf_cb"]}) == {}
    assert "hf_cb" in format_table(engines)


def test_token_count_mismatch_raises() -> None:
    run = _run("x", 1.0, [1.0, 1.0], tokens=3)
    check_token_counts(run, [3, 3])
    with pytest.raises(TokenCountMismatch):
        check_token_counts(run, [3, 4])
    with pytest.raises(TokenCountMismatch):
        check_token_counts(run, [3, 3, 3])
