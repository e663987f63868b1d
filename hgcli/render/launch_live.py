"""The terminal's view of `hgtrain launch` (rich): rank lines coloured per rank, scrolling above a live
metrics table (per group step, loss, samples/s; the cluster total against the plan's prediction).
Apart from ``render/launch.py`` so that only a terminal imports rich."""
from __future__ import annotations

from typing import Any, Callable, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..launch.events import BoardView, Event, JobEnded, JobRestarted, LogLines, Progress, RankExited, Stopping
from .launch import COLOURS, ending_lines, is_shown, rate_text, ratio_text, status_line, tag, write_tagged
from .safe import visible


class RichSink:
    """A terminal: coloured lines scrolling above a live metrics table."""

    def __init__(self, ranks: frozenset[int] | None, console: Console | None = None,
                 err: TextIO | None = None) -> None:
        self.ranks = ranks
        self.console = console or Console(highlight=False)
        self.err = err   # where ranks' stderr lines go when that is not this terminal (2> file)
        self.live: Live | None = None
        # Each handler takes the event type it is keyed by.
        self.handlers: dict[type, Callable[[Any], None]] = {
            LogLines: self._lines, Progress: self._progress, JobEnded: self._ended,
        }

    def __call__(self, event: Event) -> None:
        if not is_shown(event, self.ranks):
            return
        handler = self.handlers.get(type(event))
        if handler is not None:
            handler(event)
            return
        line = status_line(event)
        if line is not None:
            style = "bold red" if isinstance(event, (RankExited, Stopping, JobRestarted)) else "dim"
            self.console.print(Text(f"hgtrain: {visible(line)}", style=style), soft_wrap=True)

    def _lines(self, event: LogLines) -> None:
        if event.stream == "err" and self.err is not None:
            write_tagged(self.err, event)
            return
        colour = COLOURS[event.rank % len(COLOURS)]
        prefix = visible(f"{tag(event.node, event.rank, event.role)} │ ")
        style = "red" if event.stream == "err" else None
        for line in event.lines:   # a terminal is slow anyway; the Dispatcher bounds the backlog
            text = Text(prefix, style=colour)
            text.append(visible(line), style=style)   # a rank's ESC never reaches the terminal
            self.console.print(text, soft_wrap=True)

    def _progress(self, event: Progress) -> None:
        if self.live is None:
            self.live = Live(board_table(event.view), console=self.console, auto_refresh=False,
                             transient=True)
            self.live.start()
        self.live.update(board_table(event.view), refresh=True)

    def _ended(self, event: JobEnded) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
        lines = ending_lines(event)
        for i, line in enumerate(lines):
            bad = event.root_cause is not None and i == 0
            self.console.print(Text(visible(line), style="bold red" if bad else ("bold" if i == len(lines) - 1 else "")),
                               soft_wrap=True)


def board_table(view: BoardView) -> Group:
    table = Table(title=None, box=None, pad_edge=False, header_style="bold")
    for column in ("group", "ranks", "step", "loss", "samples/s"):
        table.add_column(column, justify="right" if column != "ranks" else "left")
    for g in view.groups:
        table.add_row(g.group, ",".join(map(str, g.ranks)), "-" if g.step is None else str(g.step),
                      "-" if g.loss is None else f"{g.loss:.4f}", rate_text(g.samples_per_s))
    total = (f"cluster {rate_text(view.samples_per_s)} samples/s · plan predicted "
             f"{rate_text(view.predicted_samples_per_s)}{ratio_text(view.samples_per_s, view.predicted_samples_per_s)}"
             f" · ideal {rate_text(view.ideal_samples_per_s)}")
    if view.accuracy is not None:
        total += f" · accuracy {view.accuracy:.4f}"
    return Group(table, Text(total, style="bold"))
