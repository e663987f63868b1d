"""Human output of ``hgtrain probe``: a live progress line on stderr, then the inventory table."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..schema.stages import PLAN_NEEDS, GpuInfo, Inventory, NodeInfo, PythonRuntime
from .safe import cell, visible

# Everything a node reports (GPU and CPU names, OS, errors) is its own text: it reaches rich as Text
# with control characters shown (render/safe.py), never as markup.

EMULATED = "EMULATED"


@contextmanager
def probe_progress(names: Sequence[str], console: Console | None = None
                   ) -> Iterator[Callable[[NodeInfo], None] | None]:
    """Yields the ``on_done`` callback for ``probe_cluster`` that shows nodes as they answer, and
    which ones are still awaited; yields None when stderr is not a terminal (logs, pipes, CI)."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    waiting = list(names)
    lock = threading.Lock()

    def waiting_text() -> str:
        shown = ", ".join(waiting[:4]) + (f" +{len(waiting) - 4}" if len(waiting) > 4 else "")
        return f"waiting for {shown}" if waiting else "done"

    columns = (SpinnerColumn(), TextColumn("probing"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(waiting_text(), total=len(waiting))

        def done(info: NodeInfo) -> None:
            with lock:
                if info.name in waiting:
                    waiting.remove(info.name)
                line = Text.assemble(("ok  " if info.ok else "FAIL", "green" if info.ok else "bold red"),
                                     f" {visible(info.name)} ({info.elapsed_s or 0:.1f} s)")
                if not info.ok:
                    line.append(f": {visible(str(info.error))}", style="red")
                progress.console.print(line)
                progress.update(task, advance=1, description=waiting_text())

        yield done


def _mib(value: int | None) -> str:
    if value is None:
        return "?"
    return f"{value / 1024:.0f} GiB" if value >= 1024 else f"{value} MiB"


def _gpu_line(gpu: GpuInfo) -> Text:
    text = cell(f"{gpu.index}: {gpu.name}  {_mib(gpu.memory_total_mib)}")
    if gpu.compute_capability:
        text.append(f"  cc {visible(gpu.compute_capability)}")
    if gpu.emulated:
        speed = f" x{gpu.speed:g}" if gpu.speed is not None else ""
        text.append(f"  {EMULATED}{speed}", style="bold reverse magenta")
    return text


def _gpus_cell(node: NodeInfo) -> Text:
    if not node.ok:   # the reason goes below the table, whole: a cell would cut it to the column
        return Text("FAILED (reason below)", style="bold red")
    if not node.gpus:
        return Text("none (CPU only)", style="dim")
    return Text("\n").join(_gpu_line(g) for g in node.gpus)


def _system_cell(node: NodeInfo) -> Text | str:
    """CPU, RAM, OS, Python and torch stacked in one cell, so the GPU column keeps its width."""
    if not node.ok:
        return ""
    cpu = " ".join(filter(None, [node.cpu_model, f"({node.cpu_cores} cores)" if node.cpu_cores else None]))
    torch = node.torch_version or "not installed"
    if node.torch_version and node.torch_cuda:
        torch += f" (CUDA {node.torch_cuda})"
    return cell("\n".join([f"CPU {cpu or '?'}", f"RAM {_mib(node.memory_total_mib)}", f"OS {node.os or '?'}",
                           f"Python {node.python_version or '?'}, torch {torch}", _plans_line(node.runtime)]))


def _plans_line(runtime: PythonRuntime | None) -> str:
    """Which plans the node's Python can run: "plans: allreduce yes, hybrid/ps NO (numpy: ...)"."""
    if runtime is None:
        return "plans: not checked"
    parts = []
    kinds: dict[tuple[str, ...], list[str]] = {}   # strategies that need the same: "hybrid/ps"
    for strategy, modules in PLAN_NEEDS.items():
        kinds.setdefault(modules, []).append(strategy.value)
    for needs, strategies in kinds.items():
        plans = "/".join(strategies)
        lacking = runtime.lacking(needs)
        unknown = [n for n in needs if getattr(runtime, n) is None]
        if lacking:
            reasons = ", ".join(f"{n}: {runtime.why[n]}" if n in runtime.why else n for n in lacking)
            parts.append(f"{plans} NO ({reasons})")
        elif unknown:
            parts.append(f"{plans} ? ({', '.join(unknown)} not known)")
        else:
            parts.append(f"{plans} yes")
    return "plans: " + ", ".join(parts)


def _node_cell(node: NodeInfo) -> Text:
    text = cell(node.name, style="bold")
    text.append(f"\n{visible(node.host)}", style="dim")
    if node.elapsed_s is not None:
        text.append(f"\n{node.elapsed_s:.1f} s", style="dim")
    return text


def inventory_table(inventory: Inventory) -> Table:
    table = Table(title=Text(f"hgtrain probe: {len(inventory.nodes)} node(s)"), title_justify="left")
    table.add_column("node", overflow="fold")
    table.add_column("GPUs", no_wrap=True)
    table.add_column("system", overflow="fold")
    for node in inventory.nodes:
        table.add_row(_node_cell(node), _gpus_cell(node), _system_cell(node),
                      style=None if node.ok else "red")
    return table


def render_inventory(inventory: Inventory, console: Console | None = None) -> None:
    console = console or Console()
    console.print(inventory_table(inventory))
    failed = inventory.failed
    for node in failed:
        # Folded, never cut: the reason often ends in what to do (a host key's fingerprint and the
        # ssh-keyscan line to add it), and a pipe or a log file has no terminal width to spare.
        reason = cell(f"{node.name} ({node.host}) FAILED: {node.error}", style="red")
        reason.overflow = "fold"
        console.print(reason, soft_wrap=False)
    summary = f"{len(inventory.succeeded)}/{len(inventory.nodes)} node(s) answered"
    if failed:
        console.print(cell(f"{summary}; failed: {', '.join(n.name for n in failed)}", style="bold red"))
    else:
        console.print(Text(summary, style="green"))
    if any(g.emulated for n in inventory.nodes for g in n.gpus):
        console.print(Text(f"{EMULATED} devices are declared in the cluster file, not real GPUs: they run "
                           "on the CPU at the relative speed shown.", style="magenta"))
