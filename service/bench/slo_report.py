"""How ``slipstream bench slo`` reports: the JSON of a grid of runs, the
table printed after it (with the engine-vs-twin lines of the engine mode),
and the PNGs of attainment against load."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from slipstream.service.bench.slo_capacity import CLASS0_TARGET, OVERALL_TARGET, Capacity
from slipstream.service.bench.slo_options import BASELINES, DEADLINE_MODES
from slipstream.service.engine.events import HostTimes


def grid_report(runs: list[dict[str, object]], capacity: Capacity) -> dict[str, object]:
    """The report of a grid of runs, either mode: the runs, the capacity
    they were loaded against and ``deadline``'s goodput over the baselines."""
    return {"runs": runs, **capacity.report_fields(), "goodput_ratios": goodput_ratios(runs)}


def goodput_ratios(runs: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """``deadline``'s goodput over each baseline's, per (mode, cv, load) and
    baseline deadline mode; None where the baseline is absent or met nothing."""
    goodput = {
        (r["mode"], r["cv"], r["load"], r["policy"], r["deadlines"]): r["goodput_tokens_per_s"]
        for r in runs
    }
    ratios: list[dict[str, object]] = []
    for (mode, cv, load, policy, _), ours in goodput.items():
        if policy != "deadline":
            continue
        for baseline_mode in DEADLINE_MODES:
            theirs = {b: goodput.get((mode, cv, load, b, baseline_mode)) for b in BASELINES}
            if all(v is None for v in theirs.values()):
                continue
            row: dict[str, object] = {
                "mode": mode,
                "cv": cv,
                "load": load,
                "baseline_deadlines": baseline_mode,
            }
            for baseline, value in theirs.items():
                row[f"over_{baseline}"] = (
                    float(ours) / float(value) if value else None  # type: ignore[arg-type]
                )
            ratios.append(row)
    return ratios


# -- plots ----------------------------------------------------------------------


def plot_attainment(report: dict[str, object], path: str) -> None:
    """Attainment (overall solid, class 0 dashed) vs load, one panel per CV;
    the replays of ``--repeats`` as hollow markers of the same colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    replays = report.get("repeat_runs") or []
    assert isinstance(runs, list) and isinstance(replays, list)
    cvs = sorted({r["cv"] for r in runs})
    fig, axes = plt.subplots(1, len(cvs), figsize=(5 * len(cvs), 4), squeeze=False)
    for ax, cv in zip(axes[0], cvs, strict=True):
        for policy, deadlines in sorted({(r["policy"], r["deadlines"]) for r in runs}):
            rows = sorted(
                (
                    r
                    for r in runs
                    if r["cv"] == cv and r["policy"] == policy and r["deadlines"] == deadlines
                ),
                key=lambda r: r["load"],
            )
            loads = [r["load"] for r in rows]
            name = policy if deadlines == "enforced" else f"{policy} (unaware)"
            style = "-" if deadlines == "enforced" else ":"
            line = ax.plot(
                loads,
                [r["attainment"] for r in rows],
                marker="o",
                linestyle=style,
                label=f"{name} all",
            )
            color = line[0].get_color()
            again = [
                r
                for r in replays
                if r["cv"] == cv and r["policy"] == policy and r["deadlines"] == deadlines
            ]
            _scatter_replays(ax, again, None, "o", color, f"{name} all, replays")
            if deadlines != "enforced":
                continue
            class0 = [r["classes"]["0"]["attainment"] for r in rows]
            ax.plot(loads, class0, linestyle="--", marker="x", color=color, label=f"{name} class 0")
            _scatter_replays(ax, again, "0", "s", color, f"{name} class 0, replays")
        style_attainment_axes(ax, f"{rows[0]['mode'] if rows else ''} CV {cv:g}")
    save_figure(fig, path)


def _scatter_replays(
    ax: Any, replays: list[dict[str, Any]], cls: str | None, marker: str, color: str, label: str
) -> None:
    """``replays``' attainment (overall, or of class ``cls``) as hollow markers."""
    if replays:
        ax.scatter(
            [r["load"] for r in replays],
            [side_attainment(r, cls) for r in replays],
            marker=marker,
            facecolors="none",
            edgecolors=color,
            label=label,
        )


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


def format_summary(report: dict[str, object]) -> str:
    runs = report["runs"]
    assert isinstance(runs, list)
    header = (
        f"{'mode':<6} {'cv':>3} {'load':>4} {'policy':<8} {'dl':<4} {'attain':>6} {'c0':>5} "
        f"{'c1':>5} {'c2':>5} {'goodput':>8} {'of cap':>6} {'c2 p99 wait':>11} "
        f"{'c2 max wait':>11} {'swap':>5} {'recomp':>6} {'reject':>6} {'shed':>5} {'missed s':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        c = r["classes"]
        lines.append(
            f"{r['mode']:<6} {r['cv']:>3g} {r['load']:>4g} {r['policy']:<8} "
            f"{str(r['deadlines'])[:4]:<4} "
            f"{_pct(r['attainment'])} {_pct(c['0']['attainment'])} {_pct(c['1']['attainment'])} "
            f"{_pct(c['2']['attainment'])} {r['goodput_tokens_per_s']:>8.1f} "
            f"{_pct(r.get('goodput_fraction_of_capacity')):>6} "
            f"{_num(c['2']['wait_p99_s']):>11} {_num(c['2']['max_wait_s']):>11} "
            f"{r['preemptions_swap']:>5} {r['preemptions_recompute']:>6} "
            f"{r['early_rejections']:>6} {r['overload_refusals']:>5} "
            f"{r['missed_compute_s']:>8.1f}"
        )
    twins = [r for r in runs if "sim_twin" in r]
    if twins:
        lines += [
            "",
            _capacity_line(report),
            "engine vs its simulated twin (attainment %: engine / twin with the model held at "
            "the run's start / twin with the run's own steps fit):",
        ]
        lines += [_twin_line(r) for r in twins]
        lines += _host_lines(twins)
        lines += _reproducibility_lines(report)
        lines += _disagreement_lines(twins)
        lines += _class0_miss_lines(twins)
    ratios = report.get("goodput_ratios") or []
    assert isinstance(ratios, list)
    if ratios:
        lines += ["", "goodput of deadline over the baselines (baseline deadline mode):"]
        for row in ratios:
            lines.append(
                f"  {row['mode']:<6} cv {row['cv']:g} load {row['load']:g} "
                f"{row['baseline_deadlines']:<8}  x priority {_num(row['over_priority']):>6}  "
                f"x fcfs {_num(row['over_fcfs']):>6}"
            )
    return "\n".join(lines)


def _capacity_line(report: dict[str, object]) -> str:
    return (
        f"capacity: engine {_num(report['capacity_rps'])} req/s; simulated with the start-up "
        f"calibration {_num(report['sim_capacity_rps'])}, with the online refit "
        f"{_num(report.get('sim_capacity_rps_refit'))} req/s; deadlines set with the "
        f"calibration x {_num(report.get('deadline_scale'))} (isolated requests measured"
        f"{_probes(report.get('deadline_probe_ratios'))})"
    )


def _probes(ratios: object) -> str:
    """Each isolated probe's measured / predicted time, where the run has them."""
    if not isinstance(ratios, dict) or not ratios:
        return ""
    return ": " + ", ".join(f"{name} {_num(r)}" for name, r in ratios.items())


def _twin_line(run: dict[str, object]) -> str:
    """Engine / twin with the model held at the start / twin with the run's own fit."""
    sides = [run, run["sim_twin"], run.get("sim_twin_run_fit")]

    def triple(cls: str | None) -> str:
        return "/".join(_pct(side_attainment(side, cls)) for side in sides)

    per_class = "  ".join(f"c{c} {triple(c)}" for c in ("0", "1", "2"))
    return (
        f"  cv {run['cv']:g} load {run['load']:g} {run['policy']:<8} {str(run['deadlines'])[:4]:<4}"
        f" all {triple(None)}  {per_class}"
    )


def _host_lines(runs: Sequence[dict[str, object]]) -> list[str]:
    """The engine thread's ms a step by phase, per engine run that has them."""
    rows = [(r, r.get("host_ms_per_step")) for r in runs]
    rows = [(r, h) for r, h in rows if isinstance(h, dict)]
    if not rows:
        return []
    lines = [
        "engine thread, ms a step (planning ahead, a device wait near 0: the host's pace),"
        " and the replay's ms late to submit:"
    ]
    for run, host in rows:
        phases = "  ".join(f"{name} {host[name]:.3f}" for name in HostTimes.__slots__)
        lag = run.get("submit_lag_ms")
        late = (
            f"; submissions late p50 {lag['p50']:.2f} / p99 {lag['p99']:.2f} / max {lag['max']:.2f}"
            if isinstance(lag, dict)
            else ""
        )
        lines.append(
            f"  cv {run['cv']:g} load {run['load']:g} {run['policy']:<8} "
            f"{str(run['deadlines'])[:4]:<4} {phases}  ({host['steps']:.0f} steps){late}"
        )
    return lines


def _reproducibility_lines(report: dict[str, object]) -> list[str]:
    """Per cell replayed more than once: the engine's spread over its replays
    and how far each twin's median is from the engine's, in points."""
    rows = report.get("reproducibility") or []
    assert isinstance(rows, list)
    if not rows:
        return []
    lines = [
        "the engine replaying the same requests (points: engine spread max-min / |twin median"
        " - engine median| / same, twin fit on each run's steps):"
    ]
    for row in rows:
        parts = []
        for cls, entry in row["classes"].items():
            name = "all" if cls == "all" else f"c{cls}"
            values = (entry["engine_spread"], entry["twin_gap"], entry["twin_run_fit_gap"])
            parts.append(f"{name} " + "/".join(_points(v) for v in values))
        lines.append(
            f"  cv {row['cv']:g} load {row['load']:g} {row['policy']:<8} "
            f"{str(row['deadlines'])[:4]:<4} x{row['replays']}  " + "  ".join(parts)
        )
    return lines


def _points(value: object) -> str:
    return "-" if value is None else f"{100 * float(value):.1f}"  # type: ignore[arg-type]


def side_attainment(side: object, cls: str | None) -> object:
    """A run's (or twin's) attainment, overall or of class ``cls``; None when absent."""
    if not isinstance(side, dict):
        return None
    return side["attainment"] if cls is None else side["classes"][cls]["attainment"]


def _disagreement_lines(runs: Sequence[dict[str, object]]) -> list[str]:
    """The requests the engine and its twin scored differently, per run."""

    def row_line(row: dict[str, object]) -> str:
        side = "met on the engine only" if row["met_on_engine"] else "met in the twin only"
        return (
            f"    {row['req_id']:<6} class {row['priority']} {side}: "
            f"engine {row['engine']}, twin {row['twin']}, deadline {_num(row['deadline_s'])}s"
        )

    return _listed_per_run(
        runs,
        "twin_disagreements",
        lambda run: (
            f"requests scored differently, cv {run['cv']:g} load {run['load']:g} "
            f"{run['policy']} ({run['num_twin_disagreements']} in all):"
        ),
        row_line,
    )


def _class0_miss_lines(runs: Sequence[dict[str, object]]) -> list[str]:
    """Class-0 requests that missed on the engine, per run."""
    return _listed_per_run(
        runs,
        "class0_misses",
        lambda run: (
            f"class-0 misses on the engine, cv {run['cv']:g} load {run['load']:g} "
            f"{run['policy']} {str(run['deadlines'])[:4]}:"
        ),
        lambda row: (
            f"    {row['req_id']:<6} at {row['arrival_s']:.2f}s: {row['fate']}, deadline "
            f"{_num(row['deadline_s'])}s, prompt {row['prompt_len']} / output "
            f"{row['output_len']}, queued {_num(row['queue_wait_s'])}s, TTFT "
            f"{_num(row['ttft_s'])}s, preempted {row['preemptions']}x, held back "
            f"{row.get('held_back_steps', 0)} steps"
            + (f" (twin {row['twin_held_back_steps']})" if "twin_held_back_steps" in row else "")
            + (
                f", submitted {row['submit_lag_ms']:.1f} ms late"
                if isinstance(row.get("submit_lag_ms"), float)
                else ""
            )
        ),
    )


def _listed_per_run(
    runs: Sequence[dict[str, object]],
    key: str,
    header: Callable[[dict[str, object]], str],
    line: Callable[[dict[str, object]], str],
) -> list[str]:
    """For each run with rows under ``key``: its header, then a line per row."""
    lines: list[str] = []
    for run in runs:
        rows = run.get(key) or []
        assert isinstance(rows, list)
        if rows:
            lines.append("  " + header(run))
            lines += [line(row) for row in rows]
    return lines


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


def _pct(value: object) -> str:
    return "    -" if value is None else f"{100 * float(value):>5.1f}"  # type: ignore[arg-type]


def _num(value: object) -> str:
    return "-" if value is None else f"{float(value):.2f}"  # type: ignore[arg-type]
