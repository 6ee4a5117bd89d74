"""The ``bench step`` report as a table and as a plot."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slipstream.scheduler.request import SamplingParams

# (row key, label, colour) of the hooked pass's parts, bottom to top in the plot.
PARTS = (
    ("linears_ms", "linears", "tab:blue"),
    ("attention_ms", "attention", "tab:orange"),
    ("other_ms", "other (norms, rope, kv write, sampling)", "tab:green"),
    ("host_ms", "host (plan -> tensors)", "tab:gray"),
)


def describe_run(report: Mapping[str, Any]) -> list[str]:
    cpu, p, load = report["cpu"], report["parameters"], report["load"]
    flags = " ".join(f"{f}={'yes' if has else 'no'}" for f, has in cpu["has_flags"].items())
    return [
        f"cpu: {cpu['model']} | {flags} | torch {cpu['torch_capability']} | "
        f"dtype {p['dtype']} (requested {p['requested_dtype']}), "
        f"KV cache {p.get('kv_cache_dtype', 'auto')}",
        f"model {p['model']}, context {p['context']}, block {p['block_size']}, "
        f"{_sampling(p.get('sampling'))}, "
        f"{p['threads']} threads; medians of {p['steps']} steps after {p['warmup_steps']} "
        f"warm-up; 1-min load average {load['load_avg_1m_start']:.1f} before (other work), "
        f"{load['load_avg_1m_end']:.1f} after (this run included) on {load['cpus']} CPUs",
    ]


def _sampling(sampling: Mapping[str, Any] | None) -> str:
    if not sampling or SamplingParams(**sampling).is_greedy:
        return "greedy"
    return (f"sampling at temperature {sampling['temperature']:g}, top-k {sampling['top_k']}, "
            f"top-p {sampling['top_p']:g}")  # fmt: skip


def format_table(report: Mapping[str, Any]) -> str:
    header = (
        f"{'batch':>5} {'mode':<11} {'step ms':>8} {'p10-p90':>13} {'tok/s':>7} | "
        f"{'attn':>7} {'linears':>7} {'other':>6} {'host':>6} | "
        f"{'w-floor':>7} {'kv-floor':>8} | {'step/w':>6} {'step/(lin+kv)':>13}"
    )
    lines = [*describe_run(report), "", header, "-" * len(header)]
    for r in report["rows"]:
        lead = f"{r['batch']:>5} {r['mode']:<11}"
        if r["status"] != "ok":
            lines.append(f"{lead} skipped: {r['reason']}")
            continue
        spread = f"{r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f}"
        line = f"{lead} {r['step_ms']:>8.2f} {spread:>13} {r['tokens_per_s']:>7.0f} | "
        line += " ".join(
            f"{_num(r.get(key)):>{width}}"
            for key, width in (("attention_ms", 7), ("linears_ms", 7), ("other_ms", 6))
        )
        line += f" {_num(r.get('host_ms')):>6} | "
        line += f"{r['weight_read_floor_ms']:>7.2f} {r['kv_read_floor_ms']:>8.2f} | "
        line += f"{r['step_over_weight_floor']:>6.1f} "
        line += f"{_num(r.get('step_over_linears_plus_kv_floor'), 1):>13}"
        lines.append(line)
        if r.get("step_ms_planned_ahead") is not None:
            lines.append(
                f"{'':>5} {'':<8} planned ahead {r['step_ms_planned_ahead']:.2f} ms a step "
                f"(host in launch {r['host_launch_ms']:.2f} ms)"
            )
    lines.append(
        "attn/linears/other/host: ms from the hooked pass (its own medians; hooks add time); "
        "floors: one buffer read of the weights / K+V; planned ahead (a GPU): the step's pace "
        "with each launch before the previous step's result, and the host's time in launch"
    )
    return "\n".join(lines)


def _num(value: object, digits: int = 2) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"  # type: ignore[arg-type]


def plot_steps(report: Mapping[str, Any], path: str) -> None:
    """Left: step ms vs batch (log-log) per mode, with the read floors. Right:
    the hooked pass's split of an eager step per batch, as shares."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r["status"] == "ok"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["batch"])
        left.plot([r["batch"] for r in mine], [r["step_ms"] for r in mine], "o-", label=mode)
    floors = _floor_rows(rows)
    batches = [r["batch"] for r in floors]
    weight = [r["weight_read_floor_ms"] for r in floors]
    kv = [r["kv_read_floor_ms"] for r in floors]
    left.plot(batches, weight, "k--", label="floor: read weights")
    left.plot(batches, kv, "k:", label="floor: read K+V")
    left.plot(batches, [w + k for w, k in zip(weight, kv, strict=True)], "--", color="0.6",
              label="floor: weights + K+V")  # fmt: skip
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(batches, [str(b) for b in batches])
    left.set_xlabel("batch (sequences decoding one token)")
    left.set_ylabel("ms per decode step (median)")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    _plot_split(
        right, [r for r in rows if r["mode"] == "eager" and r.get("breakdown_pass") == "hooked"]
    )
    title = describe_run(report)
    fig.suptitle("\n".join(title), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _floor_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per batch (the first mode's): floors do not depend on the mode."""
    by_batch: dict[int, dict[str, Any]] = {}
    for r in rows:
        by_batch.setdefault(r["batch"], r)
    return [by_batch[b] for b in sorted(by_batch)]


def _plot_split(ax: Any, rows: list[dict[str, Any]]) -> None:
    rows = sorted(rows, key=lambda r: r["batch"])
    totals = [sum(r[key] for key, _, _ in PARTS) for r in rows]
    bottom = [0.0] * len(rows)
    labels = [str(r["batch"]) for r in rows]
    for key, label, colour in PARTS:
        shares = [100 * r[key] / total for r, total in zip(rows, totals, strict=True)]
        ax.bar(labels, shares, bottom=bottom, label=label, color=colour)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    for i, r in enumerate(rows):
        ax.text(i, 101, f"{r['hooked_step_ms']:.1f} ms", ha="center", fontsize=8)
    ax.set_ylim(0, 110)
    ax.set_xlabel("batch")
    ax.set_ylabel("% of the hooked eager step")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
