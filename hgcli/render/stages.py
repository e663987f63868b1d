"""The pipeline's stage lines (probe, bench, plan) on stderr, so stdout keeps only the result."""
from __future__ import annotations

from typing import Callable

from rich.console import Console
from rich.text import Text

STAGE_STYLE = {"probe": "cyan", "bench": "magenta", "plan": "green"}


def stage_printer(console: Console | None = None) -> Callable[[str, str], None]:
    """An ``on_stage`` callback for ``pipeline.prepare_plan`` printing ``stage  message`` lines."""
    console = console or Console(stderr=True)

    def show(stage: str, message: str) -> None:
        console.print(Text.assemble((f"{stage:<5}", f"bold {STAGE_STYLE.get(stage, 'white')}"), "  ", message))

    return show
