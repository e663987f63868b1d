"""Human output of ``hgtrain bench``: live progress per node while it runs, then the results.

Progress goes to stderr and only on a terminal, so ``--json`` and pipes get clean output. The
tables mark emulated devices EMULATED (their figures are the CPU's, scaled) and show errors.
"""
from __future__ import annotations

import threading
from typing import cast

from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..bench.cluster import BenchEvent
from ..schema.stages import DeviceProfile, Measurement, Profiles


class BenchProgress:
    """A line per node (and per link) showing what it measures now; a no-op off a terminal."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._lock = threading.Lock()   # events arrive from one thread per node

    def __enter__(self) -> "BenchProgress":
        if self.console.is_terminal:
            self._progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.fields[subject]}"),
                                      TextColumn("{task.description}"), TimeElapsedColumn(),
                                      console=self.console, transient=True)
            self._progress.start()
        return self

    def __call__(self, event: BenchEvent) -> None:
        if self._progress is None:
            return
        text = f"{event.device}: {event.stage}"
        with self._lock:
            task = self._tasks.get(event.subject)
            if task is None:
                self._tasks[event.subject] = self._progress.add_task(text, subject=event.subject, total=None)
            else:
                self._progress.update(task, description=text)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def render_profiles(profiles: Profiles, console: Console) -> None:
    devices = Table(title="Devices", title_justify="left")
    for col, justify in (("node", "left"), ("device", "left"), ("name", "left"), ("fp32 TFLOP/s", "right"),
                         ("bf16/fp16 TFLOP/s", "right"), ("mem GB/s", "right"), ("h2d GB/s", "right"),
                         ("step ms (batch)", "right"), ("together ms (batch)", "right"),
                         ("peak MiB (max batch)", "right"), ("status", "left")):
        devices.add_column(col, justify=cast(JustifyMethod, justify))
    for d in profiles.devices:
        name = f"{escape(d.name)} [yellow]EMULATED x{d.speed:g}[/]" if d.emulated else escape(d.name)
        half = "/".join(_fmt(d.matmul_tflops.get(k)) for k in ("bf16", "fp16") if k in d.matmul_tflops)
        largest = d.steps[-1] if d.steps else None
        devices.add_row(escape(d.node), d.device, name, _fmt(d.matmul_tflops.get("fp32")), half or "-",
                        _fmt(d.mem_bandwidth_gbs), _fmt(d.h2d_bandwidth_gbs), _steps(d), _together(d),
                        str(largest.memory_mib) if largest and largest.memory_mib is not None else "-",
                        _status(d.error))
    console.print(devices)
    if profiles.links:
        links = Table(title="Links", title_justify="left")
        for col, justify in (("a", "left"), ("b", "left"), ("backend", "left"), ("GB/s", "right"),
                             ("latency µs", "right"), ("status", "left")):
            links.add_column(col, justify=cast(JustifyMethod, justify))
        for link in profiles.links:
            latency = _fmt(link.latency_s, scale=1e6)
            links.add_row(escape(link.a), escape(link.b), link.backend, _fmt(link.bandwidth_gbs), latency, _status(link.error))
        console.print(links)
    if profiles.model is not None:
        console.print(f"model {escape(profiles.model.name)}: {profiles.model.parameters:,} parameters; "
                      "figures are medians of repeated runs (spread in --json)")
    if any(d.together for d in profiles.devices):
        console.print("together: the mean step while every device of the node stepped at once, as they will "
                      "train; the plan's costs come from it, the ideal from the step alone")
    if any(d.emulated for d in profiles.devices):
        console.print("[yellow]EMULATED[/]: measured on the node's CPU, then scaled by the declared speed")


def _steps(d: DeviceProfile) -> str:
    return ", ".join(f"{s.seconds.median * 1000:.3g} ({s.batch_size})" for s in d.steps) or "-"


def _together(d: DeviceProfile) -> str:
    steps = d.together.steps if d.together else ()
    return ", ".join(f"{s.mean_s * 1000:.3g} ({s.batch_size})" for s in steps) or "-"


def _status(error: str | None) -> str:
    return f"[red]{escape(error)}[/]" if error else "[green]ok[/]"


def _fmt(m: Measurement | None, scale: float = 1.0) -> str:
    return "-" if m is None else f"{m.median * scale:.3g}"
