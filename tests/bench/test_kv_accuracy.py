"""``slipstream bench kv-accuracy`` end to end on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from slipstream.service.bench import kv_accuracy
from slipstream.service.cli import main


def test_reports_greedy_agreement_and_perplexity_under_both_caches(
    tiny_model_dir: Path, tmp_path: Path, capsys
) -> None:
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "acc.json"
    argv = ["bench", "kv-accuracy", "--model", str(tiny_model_dir), "--new-tokens", "6",
            "--text", str(text), "--chunk", "48", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    greedy, ppl = report["greedy"], report["perplexity"]
    assert greedy["prompts"] == len(kv_accuracy.PROMPTS) and 0 <= greedy["identical"] <= 12
    firsts = greedy["first_difference"]
    assert len(firsts) == 12 and sum(f is None for f in firsts) == greedy["identical"]
    assert all(f is None or 0 <= f < 6 for f in firsts)
    assert ppl["tokens"] > 100 and ppl["chunk"] == 48  # several chunks: later ones read the cache
    assert ppl["reference"] > 1 and ppl["quantized"] > 1
    assert ppl["ratio"] == ppl["quantized"] / ppl["reference"]
    assert 0.5 < ppl["top1_agreement"] <= 1
    assert "perplexity over" in capsys.readouterr().out


def test_first_difference_counts_the_equal_tokens_before_it() -> None:
    assert kv_accuracy._first_difference([1, 2, 3], [1, 2, 3]) is None
    assert kv_accuracy._first_difference([1, 2, 3], [1, 5, 3]) == 1


def test_a_missing_text_is_one_error_line(tmp_path: Path, capsys) -> None:
    argv = ["bench", "kv-accuracy", "--text", str(tmp_path / "none.txt")]
    assert main(argv) == 2
    assert "pass --text FILE" in capsys.readouterr().err
