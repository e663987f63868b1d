"""Human output of ``hgtrain stop``: per node, what was stopped and what (if anything) is left."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..jobs.stop import StopResult


def render_stop(result: StopResult, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"stop {result.record.id}", title_justify="left", show_edge=False)
    for column in ("node", "result", "agent", "killed", "detail"):
        table.add_column(column)
    for n in result.nodes:
        outcome = Text("stopped", style="yellow") if n.ok else Text("NOT CONFIRMED", style="bold red")
        detail = n.error or (f"job {n.state}" if n.state else "")
        table.add_row(n.node, outcome, n.agent or "-", ", ".join(map(str, n.killed)) or "-", detail)
    console.print(table)
    console.print(Text.assemble("job ", (result.record.id, "bold"), f" is {result.record.state.value}"))
