"""``slipstream bench slo --capacity``: the SLO capacity of each policy.

Goodput is capped by capacity, so comparing goodput says little about a
scheduler. The serving literature (DistServe) asks instead: what is the
highest arrival rate at which the SLO attainment target still holds? Here
the target is class-0 attainment >= 99% and attainment over all requests
>= 90%; the rate is stated as a load (x measured capacity, see ``slo``) and
in requests per second.

Search, per policy (baselines with enforced deadlines): a seeded sweep over
``SWEEP_LOADS`` in ascending order up to the first load that misses the
target, then ``BISECTIONS`` bisection steps between the last load that met
it and that one. Every load evaluated is kept for the plot. Attainment is
not strictly monotone in load on one seed; the sweep's first miss bounds
the search, so a lucky pass above it is not reported as capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

SWEEP_LOADS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0)
BISECTIONS = 4
CLASS0_TARGET = 0.99
OVERALL_TARGET = 0.90

Run = dict[str, object]


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """``load`` is the highest load found to meet the target (0.0 when even
    the lowest swept load misses it); ``is_lower_bound`` when every swept
    load met it (the true capacity is higher); ``runs`` every evaluation."""

    policy: str
    load: float
    is_lower_bound: bool
    runs: list[Run]


def meets_target(run: Run) -> bool:
    """Class-0 attainment >= 99% and overall attainment >= 90%."""
    classes = run["classes"]
    assert isinstance(classes, dict)
    class0 = classes["0"]["attainment"]
    overall = run["attainment"]
    if class0 is None or overall is None:
        return False
    return float(class0) >= CLASS0_TARGET and float(overall) >= OVERALL_TARGET


def find_capacity(
    policy: str,
    evaluate: Callable[[float], Run],
    sweep: Sequence[float] = SWEEP_LOADS,
    bisections: int = BISECTIONS,
) -> CapacityResult:
    """The highest load at which ``evaluate(load)`` meets the target."""
    if not sweep or any(b <= a for a, b in pairwise(sweep)):
        raise ValueError("the sweep must be a non-empty ascending list of loads")
    runs: list[Run] = []
    passed, failed = 0.0, None
    for load in sweep:
        run = evaluate(load)
        runs.append(run)
        if not meets_target(run):
            failed = load
            break
        passed = load
    if failed is None:
        return CapacityResult(policy, passed, True, runs)
    low, high = passed, failed
    for _ in range(bisections):
        mid = (low + high) / 2
        run = evaluate(mid)
        runs.append(run)
        if meets_target(run):
            low = mid
        else:
            high = mid
    return CapacityResult(policy, low, False, runs)


def capacity_json(results: Sequence[CapacityResult], capacity_rps: float) -> dict[str, object]:
    """``{"<policy>": {"load": L, "rate_rps": R, "is_lower_bound": b}, ...}``."""
    return {
        r.policy: {
            "load": r.load,
            "rate_rps": r.load * capacity_rps,
            "is_lower_bound": r.is_lower_bound,
        }
        for r in results
    }


def capacity_ratios(capacity: dict[str, object]) -> dict[str, float | None]:
    """``deadline``'s capacity over each other policy's (None when absent or 0)."""
    ours = capacity.get("deadline")
    if not isinstance(ours, dict):
        return {}
    ratios: dict[str, float | None] = {}
    for policy, entry in capacity.items():
        if policy == "deadline" or not isinstance(entry, dict):
            continue
        theirs = float(entry["load"])
        ratios[f"over_{policy}"] = float(ours["load"]) / theirs if theirs > 0 else None
    return ratios


def plot_capacity(report: dict[str, object], path: str) -> None:
    """Attainment vs load, one panel per class (and one overall), a line per
    policy, each policy's capacity marked by a vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["capacity_runs"]
    capacity = report["capacity"]
    assert isinstance(runs, list) and isinstance(capacity, dict)
    panels = [("all", None), ("class 0", "0"), ("class 1", "1"), ("class 2", "2")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    policies = sorted({str(r["policy"]) for r in runs})
    colors = {p: f"C{i}" for i, p in enumerate(policies)}
    for ax, (title, cls) in zip(axes[0], panels, strict=True):
        for policy in policies:
            rows = sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["load"])
            values = [
                r["attainment"] if cls is None else r["classes"][cls]["attainment"] for r in rows
            ]
            ax.plot(
                [r["load"] for r in rows], values, marker="o", color=colors[policy], label=policy
            )
            load = capacity[policy]["load"]
            ax.axvline(load, color=colors[policy], linestyle=":", alpha=0.8)
        target = OVERALL_TARGET if cls is None else (CLASS0_TARGET if cls == "0" else None)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        style_attainment_axes(ax, f"{title} (capacity: dotted)")
    save_figure(fig, path)


def style_attainment_axes(ax: Any, title: str) -> None:
    """The look every attainment-vs-load panel of ``bench slo`` shares."""
    ax.set_title(title)
    ax.set_xlabel("load (x capacity)")
    ax.set_ylabel("deadline attainment")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def save_figure(fig: Any, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_capacity(report: dict[str, object]) -> str:
    capacity = report["capacity"]
    assert isinstance(capacity, dict)
    lines = [
        f"SLO capacity (class 0 >= {CLASS0_TARGET:.0%}, all >= {OVERALL_TARGET:.0%}; "
        f"load x measured capacity {float(report['capacity_rps']):.2f} req/s):"  # type: ignore[arg-type]
    ]
    for policy, entry in capacity.items():
        bound = " (lower bound: every swept load met it)" if entry["is_lower_bound"] else ""
        lines.append(
            f"  {policy:<8} load {entry['load']:.3f}  {entry['rate_rps']:.2f} req/s{bound}"
        )
    limit = report.get("attainable_load")
    if isinstance(limit, float):
        lines.append(
            f"  any      at most load {limit:.3f}: past it, the heaviest requests the target"
            " lets go carry less than the 1 - 1/load of the work that must go"
        )
    ratios = report.get("capacity_ratios") or {}
    assert isinstance(ratios, dict)
    if ratios:
        parts = "  ".join(
            f"x {name.removeprefix('over_')} {'-' if v is None else f'{v:.2f}'}"
            for name, v in ratios.items()
        )
        lines.append(f"  deadline's capacity: {parts}")
    return "\n".join(lines)
