"""Human output of ``hgtrain logs``: every line tagged ``node:rank``, one colour per rank."""
from __future__ import annotations

from rich.console import Console
from rich.text import Text

from ..jobs.logs import LogLine

RANK_COLOURS = ("cyan", "green", "yellow", "blue", "magenta", "bright_cyan", "bright_green", "bright_blue")


def log_tag(node: str, rank: int) -> str:
    return f"{node}:{rank}"


class LogPrinter:
    """Prints lines as they come; stderr lines get a red bar so they stand out in a merged view."""

    def __init__(self, console: Console | None = None) -> None:
        # No markup/highlighting: a rank's output is shown exactly as it printed it.
        self.console = console or Console(highlight=False, markup=False, emoji=False, soft_wrap=True)

    def __call__(self, item: LogLine) -> None:
        colour = RANK_COLOURS[item.rank % len(RANK_COLOURS)]
        line = Text.assemble((log_tag(item.node, item.rank), colour), ("|" if item.stream != "err" else "!",
                             "red" if item.stream == "err" else "dim"), " ", item.line)
        self.console.print(line, end="" if item.partial else "\n")


def log_failures(failed: dict[str, str], console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    for node, error in failed.items():
        console.print(Text(f"{node}: logs incomplete: {error}", style="red"))
