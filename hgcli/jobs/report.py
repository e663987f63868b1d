"""`hgtrain report JOB -o run.png`: one picture of a run, drawn from its recorded metrics.

Six panels: throughput per group over time with the plan's prediction for each group (dashed);
loss against time and against the samples each group trained on; accuracy events; the staleness
of the parameter servers' pushes (their ``ps_push`` records: the same figures as the PS trace)
when the job had any; and a summary of measured against predicted. The points are
``series.py``'s, the ones TensorBoard files get, so both views agree.

matplotlib (the optional extra ``hgtrain[report]``) draws with its Agg canvas: no display, no
pyplot state. Imported only here and only when the command runs.
"""
from __future__ import annotations

import base64
import collections
import html
import io
from pathlib import Path
from typing import Any

from .. import state
from ..errors import JobError, UsageError
from ..schema.stages import JobRecord
from ..launch.series import Point, points_of

INSTALL = "pip install 'hgtrain[report]'"
FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf", ".html": "html"}
SIZE_IN = (15.0, 8.4)
DPI = 80   # 1200 x 672 pixels: sharp on a screen, well under 200 KB as a PNG
LOG_RATIO = 20.0   # throughput drawn on a log scale when its largest value is this many times its smallest


def format_of(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UsageError(f"{path}: the report is written as .png, .svg, .pdf or .html (by the name's ending)")
    return fmt


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"hgtrain report needs matplotlib: {INSTALL}") from None


def _series(points: list[Point], tag: str) -> dict[str, list[Point]]:
    """run -> its points of ``tag``, groups in plan order."""
    out: dict[str, list[Point]] = collections.defaultdict(list)
    for p in points:
        if p.tag == tag:
            out[p.run].append(p)
    return dict(sorted(out.items(), key=lambda item: _run_order(item[0])))


def _run_order(run: str) -> tuple[int, str]:
    digits = run.lstrip("abcdefghijklmnopqrstuvwxyz")
    return (int(digits), run) if digits.isdigit() else (1 << 30, run)


def _smooth(values: list[float]) -> list[float]:
    """A trailing mean over a fiftieth of the points: per-step loss is too noisy to read."""
    width = max(1, len(values) // 50)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def _figure(record: JobRecord, points: list[Point]) -> Any:
    from matplotlib.figure import Figure

    t0 = min(p.time for p in points)
    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    axes = fig.subplots(2, 3)
    groups = sorted({p.run for p in points if p.run.startswith(("group", "ungrouped"))}, key=_run_order)
    color = {run: f"C{i % 10}" for i, run in enumerate(groups)}
    rates = _throughput_panel(axes[0][0], points, t0, groups, color)
    _loss_panels(axes[0][1], axes[0][2], points, t0, groups, color)
    _accuracy_panel(axes[1][0], points, t0)
    _staleness_panel(axes[1][1], points, color)
    for ax in (axes[0][0], axes[0][1], axes[1][0]):
        ax.set_xlim(left=0)   # the same time axis: seconds since the job's first record
    for ax in (axes[0][0], axes[0][1], axes[0][2], axes[1][0], axes[1][1]):
        if ax.get_legend_handles_labels()[0]:
            for text in ax.legend(fontsize="small").get_texts():
                text.set_parse_math(False)   # labels are run and event names from the job's metrics
        ax.grid(alpha=0.3)
    _summary(axes[1][2], record, rates, _series(points, "throughput/predicted"), groups, color)
    # the command is the user's text, not matplotlib math: "$x_$" in it would fail to parse
    fig.suptitle(f"{record.id}: {' '.join(record.command)}"[:160], fontsize="medium", parse_math=False)
    return fig


def _throughput_panel(ax: Any, points: list[Point], t0: float, groups: list[str],
                      color: dict[str, str]) -> dict[str, list[Point]]:
    """Each group's samples/s (and the job's) against the plan's prediction; returns the rates."""
    rates = _series(points, "throughput/samples_per_s")
    for run, predicted in _series(points, "throughput/predicted").items():
        if run in color:
            ax.axhline(predicted[-1].value, color=color[run], linestyle="--", linewidth=1.2)
    for run in groups:
        got = rates.get(run, [])
        ax.plot([p.time - t0 for p in got], [p.value for p in got], color=color[run], label=run)
    if len(groups) > 1 and "job" in rates:
        got = rates["job"]
        ax.plot([p.time - t0 for p in got], [p.value for p in got], color="black", label="total")
        job_predicted = _series(points, "throughput/predicted").get("job")
        if job_predicted:
            ax.axhline(job_predicted[-1].value, color="black", linestyle="--", linewidth=1.2)
    adapts = _series(points, "adapt")
    for run, got in adapts.items():
        for p in got:      # a group re-split its batch (rebalancing): when, in its colour
            ax.axvline(p.time - t0, color=color.get(run, "gray"), linestyle=":", linewidth=1.2)
    title = "Throughput (dashed: the plan's prediction" + ("; dotted: batch re-splits)" if adapts else ")")
    drawn = [y for line in ax.get_lines() for y in line.get_ydata() if y > 0]
    if drawn and max(drawn) > LOG_RATIO * min(drawn):
        # a prediction far from the measurement (a bench of another model) would flatten the
        # measured lines against zero: a log scale keeps both readable
        ax.set_yscale("log")
        title += ", log scale"
    else:
        ax.set_ylim(bottom=0)
    ax.set(title=title, xlabel="seconds", ylabel="samples/s")
    return rates


def _loss_panels(by_time: Any, by_samples_ax: Any, points: list[Point], t0: float, groups: list[str],
                 color: dict[str, str]) -> None:
    loss = _series(points, "loss")
    by_samples = _series(points, "loss_by_samples")
    for ax, source, x_of, xlabel, title in (
            (by_time, loss, lambda p: p.time - t0, "seconds", "Loss over time"),
            (by_samples_ax, by_samples, lambda p: p.step, "samples trained on by the group", "Loss against samples")):
        for run in groups:
            got = source.get(run, [])
            ax.plot([x_of(p) for p in got], _smooth([p.value for p in got]), color=color[run], label=run)
        ax.set(title=title, xlabel=xlabel, ylabel="loss (trailing mean)")


def _accuracy_panel(ax: Any, points: list[Point], t0: float) -> None:
    accuracy: dict[str, list[Point]] = collections.defaultdict(list)
    for p in points:
        if p.run == "job" and p.tag.startswith("accuracy/"):
            accuracy[p.tag.split("/", 1)[1]].append(p)
    for i, (event, got) in enumerate(accuracy.items()):
        ax.plot([p.time - t0 for p in got], [p.value for p in got], marker="o*sD^"[i % 5], color=f"C{i + 3}",
                linestyle="-" if len(got) > 1 else "none", label=event)
    ax.set(title="Accuracy events", xlabel="seconds", ylabel="accuracy")
    if not accuracy:
        _empty(ax, "no accuracy was logged")


def _staleness_panel(ax: Any, points: list[Point], color: dict[str, str]) -> None:
    staleness = {run: got for run, got in _series(points, "staleness").items() if run in color}
    if staleness:
        top = int(max(p.value for got in staleness.values() for p in got))
        width = 0.8 / len(staleness)
        for i, (run, got) in enumerate(staleness.items()):
            counts = collections.Counter(int(p.value) for p in got)
            ax.bar([s - 0.4 + width * (i + 0.5) for s in range(top + 1)], [counts[s] for s in range(top + 1)],
                   width=width, color=color[run], label=run)
        ax.set_xticks(range(top + 1))
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set(title="Staleness of the parameter servers' pushes", xlabel="versions behind",
               ylabel="pushes")
    else:
        ax.set(title="Staleness", xticks=[], yticks=[])
        _empty(ax, "no parameter-server pushes\n(a synchronous job)")


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def _summary(ax: Any, record: JobRecord, rates: dict[str, list[Point]], predicted: dict[str, list[Point]],
             groups: list[str], color: dict[str, str]) -> None:
    """Measured (the mean rate over the second half of the run, past the warm-up) against predicted."""
    ax.axis("off")
    plan = record.plan
    lines = [(f"strategy {plan.strategy.value}, {len(plan.workers)} workers, {len(plan.ps_shards)} "
              f"parameter server(s); {record.state.value}", "black"), ("", "black"), ("samples/s   measured   predicted", "black")]
    for run in groups + (["job"] if "job" in rates and len(groups) > 1 else []):
        late = [p.value for p in rates.get(run, [])[len(rates.get(run, [])) // 2:]]
        want = predicted.get(run)
        cells = [f"{sum(late) / len(late):.1f}" if late else "-", f"{want[-1].value:.1f}" if want else "-"]
        name = "total" if run == "job" else run
        lines.append((f"{name:<10}{cells[0]:>9}   {cells[1]:>9}", color.get(run, "black")))
    for i, (text, tint) in enumerate(lines):
        ax.text(0.0, 1.0 - i * 0.085, text, transform=ax.transAxes, va="top", family="monospace",
                fontsize="medium", color=tint, parse_math=False)   # run names: job data, not math


def write_report(record: JobRecord, rows: list[dict[str, Any]], path: Path, fmt: str) -> None:
    points = points_of(record.plan, rows)
    if not points:
        raise JobError(f"job {record.id} recorded no metrics to draw (its ranks never called ctx.log)")
    fig = _figure(record, points)
    if fmt == "html":
        png = io.BytesIO()
        fig.savefig(png, format="png")
        title = html.escape(f"hgtrain report: {record.id}")
        page = (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title></head>\n"
                f"<body><h1>{title}</h1>\n<p>{html.escape(' '.join(record.command))}</p>\n"
                f"<img alt=\"{title}\" src=\"data:image/png;base64,"
                f"{base64.b64encode(png.getvalue()).decode()}\">\n</body></html>\n")
        content: Any = page
    else:
        def content(fh: Any) -> None:
            fig.savefig(fh, format=fmt)
    try:
        state.atomic_write(path, content, mode=0o644)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc
