"""Framed JSON lines between node-side code and the controller.

A frame is one line: the marker, then a JSON object with a "type". Login shells on real nodes print
noise (motd, rc-file echoes) on the same stdout; the marker lets the controller skip it safely.
"""
from __future__ import annotations

import json
import sys
import threading
from typing import Any, TextIO

MARKER = "\x1ehgtrain "
_lock = threading.Lock()


def encode(obj: dict[str, Any]) -> str:
    return MARKER + json.dumps(obj, separators=(",", ":"), default=str) + "\n"


def emit(obj: dict[str, Any], stream: TextIO | None = None) -> None:
    """Write one frame and flush; thread-safe so several reader threads can share stdout."""
    out = stream or sys.stdout
    line = encode(obj)
    with _lock:
        out.write(line)
        out.flush()


def decode(line: str) -> dict[str, Any] | None:
    """The frame in ``line``, or None for noise (anything without the marker, or broken JSON)."""
    pos = line.find(MARKER)
    if pos < 0:
        return None
    try:
        obj = json.loads(line[pos + len(MARKER):])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
