"""Issue 30's CPU targets, met or missed, read from the reports that
``ops/cpu-verify.sh`` writes into one folder::

    python -m slipstream.service.bench.cpu_targets bench-results

- ``cpu-offline-{small,smollm2}-{64,256}.json`` (``bench offline --engines
  slipstream,vllm``): Slipstream at least ``MIN_VLLM_RATIO`` times vLLM's
  output tokens/s;
- ``cpu-step-{small,smollm2}.json`` (``bench step --batch 1,64,256``): decode
  attention at most ``MAX_ATTENTION_OVER_KV_FLOOR`` times its K/V read floor
  and "other" at most ``MAX_OTHER_SHARE`` of the step at batch 64 and 256; the
  batch-1 step at most ``MAX_BATCH1_OVER_WEIGHT_FLOOR`` times its weight read
  floor.

A missing report or row is said as such, never counted as met.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MODELS = ("small", "smollm2")
REQUESTS = (64, 256)
MIN_VLLM_RATIO = 1.5
MAX_ATTENTION_OVER_KV_FLOOR = 1.25
MAX_OTHER_SHARE = 0.10
MAX_BATCH1_OVER_WEIGHT_FLOOR = 1.5


@dataclass(frozen=True, slots=True)
class Verdict:
    target: str
    value: float | None  # None: not measured (the reason is in ``note``)
    met: bool
    note: str = ""

    def line(self) -> str:
        state = "met   " if self.met else "MISSED" if self.value is not None else "n/a   "
        value = f"{self.value:.2f}" if self.value is not None else "-"
        return f"{state} {self.target:<48} {value:>7}  {self.note}".rstrip()


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def offline_verdicts(folder: Path) -> Iterator[Verdict]:
    for model in MODELS:
        for n in REQUESTS:
            target = f"offline {model} {n}: Slipstream / vLLM >= {MIN_VLLM_RATIO}"
            report = _load(folder / f"cpu-offline-{model}-{n}.json")
            if report is None:
                yield Verdict(target, None, False, "no report")
                continue
            engines = report.get("engines", {})
            ratio = report.get("ratios", {}).get("slipstream/vllm")
            if ratio is None:
                errors = [
                    f"{name}: {e.get('error')}" for name, e in engines.items() if "error" in e
                ]
                yield Verdict(target, None, False, "; ".join(errors) or "no vLLM ratio")
                continue
            ours = engines["slipstream"]["output_tokens_per_s"]
            theirs = engines["vllm"]["output_tokens_per_s"]
            note = f"{ours:.1f} vs {theirs:.1f} tok/s"
            yield Verdict(target, ratio, ratio >= MIN_VLLM_RATIO, note)


def _row(report: dict, batch: int) -> dict | None:
    rows = [
        r for r in report.get("rows", []) if r.get("batch") == batch and r.get("status") == "ok"
    ]
    return rows[0] if rows else None


def step_verdicts(folder: Path) -> Iterator[Verdict]:
    for model in MODELS:
        report = _load(folder / f"cpu-step-{model}.json")
        for batch in (64, 256):
            attention = (
                f"step {model} {batch}: attention / K/V floor <= {MAX_ATTENTION_OVER_KV_FLOOR}"
            )
            other = f"step {model} {batch}: other / step <= {MAX_OTHER_SHARE:.2f}"
            row = _row(report, batch) if report is not None else None
            if row is None or row.get("attention_over_kv_floor") is None:
                missing = "no report" if report is None else f"no batch-{batch} row with parts"
                yield Verdict(attention, None, False, missing)
                yield Verdict(other, None, False, missing)
                continue
            ratio = row["attention_over_kv_floor"]
            note = f"{row['attention_ms']:.2f} vs {row['kv_read_floor_ms']:.2f} ms"
            yield Verdict(attention, ratio, ratio <= MAX_ATTENTION_OVER_KV_FLOOR, note)
            # Of the plain step, as the table and docs/performance.md give it.
            share = row["other_ms"] / row["step_ms"]
            note = f"{row['other_ms']:.2f} of {row['step_ms']:.2f} ms"
            yield Verdict(other, share, share <= MAX_OTHER_SHARE, note)
        target = f"step {model} 1: step / weight floor <= {MAX_BATCH1_OVER_WEIGHT_FLOOR}"
        row = _row(report, 1) if report is not None else None
        if row is None:
            yield Verdict(target, None, False, "no report" if report is None else "no batch-1 row")
            continue
        ratio = row["step_over_weight_floor"]
        note = f"{row['step_ms']:.2f} vs {row['weight_read_floor_ms']:.2f} ms"
        yield Verdict(target, ratio, ratio <= MAX_BATCH1_OVER_WEIGHT_FLOOR, note)


def summary(folder: Path) -> list[Verdict]:
    return [*offline_verdicts(folder), *step_verdicts(folder)]


def machine(folder: Path) -> str:
    """The CPU and dtype the first step report names."""
    for model in MODELS:
        report = _load(folder / f"cpu-step-{model}.json")
        if report is not None:
            cpu, rows = report.get("cpu") or {}, report.get("rows") or [{}]
            flags = " ".join(cpu.get("flags", []))
            return f"cpu {cpu.get('model')} [{flags}], dtype {rows[0].get('dtype')}"
    return "cpu: no step report"


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else "bench-results")
    print(machine(folder))
    verdicts = summary(folder)
    for verdict in verdicts:
        print(verdict.line())
    met = sum(v.met for v in verdicts)
    measured = sum(v.value is not None for v in verdicts)
    print(f"{met} of {len(verdicts)} targets met ({measured} measured) in {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
