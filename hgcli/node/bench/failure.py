"""How a failure on a node is named in a frame: one line a user can read, OOM recognised."""
from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``: tracebacks stay on the node, the cause travels."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def is_oom(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError is a RuntimeError; older builds only say so in the message."""
    return "out of memory" in str(exc).lower()
