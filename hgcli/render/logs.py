"""Human output of ``hgtrain logs``: every line tagged ``node:rank``, one colour per rank.

On a terminal (``LogPrinter``) the ranks' control characters are shown visibly (``^[``:
render/safe.py), so a rank cannot write the user's clipboard or retitle the window. Elsewhere, and
with ``--raw`` (``PlainLogPrinter``), lines are written as the ranks wrote them, without colour.
"""
from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console
from rich.text import Text

from ..jobs.logs import LogLine
from .safe import cell, visible

RANK_COLOURS = ("cyan", "green", "yellow", "blue", "magenta", "bright_cyan", "bright_green", "bright_blue")


def log_tag(node: str, rank: int) -> str:
    return f"{node}:{rank}"


def _bar(item: LogLine) -> str:
    return "!" if item.stream == "err" else "|"


class LogPrinter:
    """Prints lines as they come; stderr lines get a red bar so they stand out in a merged view."""

    def __init__(self, console: Console | None = None) -> None:
        # No markup/highlighting: a rank's output is shown exactly as it printed it, but for control
        # characters, which are shown visibly.
        self.console = console or Console(highlight=False, markup=False, emoji=False, soft_wrap=True)

    def __call__(self, item: LogLine) -> None:
        colour = RANK_COLOURS[item.rank % len(RANK_COLOURS)]
        line = Text.assemble((visible(log_tag(item.node, item.rank)), colour),
                             (_bar(item), "red" if item.stream == "err" else "dim"), " ", visible(item.line))
        self.console.print(line, end="" if item.partial else "\n")


class PlainLogPrinter:
    """Not a terminal, or ``--raw``: ``node:rank| line`` with the line's characters as they are."""

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out

    def __call__(self, item: LogLine) -> None:
        out = self._out or sys.stdout
        out.write(f"{log_tag(item.node, item.rank)}{_bar(item)} {item.line}{'' if item.partial else chr(10)}")


def log_failures(failed: dict[str, str], console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    for node, error in failed.items():
        console.print(cell(f"{node}: logs incomplete: {error}", style="red"))
