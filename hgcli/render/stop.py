"""Human output of ``hgtrain stop``: per node, what was stopped and what (if anything) is left."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..jobs.stop import StopResult
from .safe import cell, visible


def render_stop(result: StopResult, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=cell(f"stop {result.record.id}"), title_justify="left", show_edge=False)
    for column in ("node", "result", "agent", "killed", "detail"):
        table.add_column(column)
    for n in result.nodes:
        outcome = Text("stopped", style="yellow") if n.ok else Text("NOT CONFIRMED", style="bold red")
        detail = n.error or (f"job {n.state}" if n.state else "")
        # What a node answered (its error, its agent) is Text: never markup, control characters shown.
        table.add_row(cell(n.node), outcome, cell(n.agent or "-"), cell(", ".join(map(str, n.killed)) or "-"),
                      cell(detail))
    console.print(table)
    console.print(Text.assemble("job ", (visible(result.record.id), "bold"), f" is {result.record.state.value}"))
