"""The structured-output bench runs: a step with every row constrained
against none, and the mask alone, on ``tiny``."""

from __future__ import annotations

from slipstream.service.bench import grammar_mask


def test_the_bench_times_each_case(tiny_model_dir, capsys):
    common = ["--model", str(tiny_model_dir), "--batch", "2", "--context", "16"]
    grammar_mask.main([*common, "--steps", "2", "--rounds", "1", "--warmup", "1"])
    grammar_mask.main([*common, "--steps", "2", "--rounds", "1", "--mask-only"])
    out = capsys.readouterr().out
    for case in ("none", "json_string", "digits"):
        assert out.count(f"  {case} ") == 2, out
