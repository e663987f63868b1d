"""Framed JSON lines between node-side code and the controller.

A frame is one line: the marker, then a JSON object with a "type". Login shells on real nodes print
noise (motd, rc-file echoes) on the same stdout; the marker lets the controller skip it safely.

A frame may carry a payload of raw bytes: ``"size": N`` in its JSON, and the N bytes follow its line
(``encode_raw``; ``read_stream`` gives them back as the frame's ``"text"``, or with ``raw`` as its
``"data"`` bytes). Log batches of the
launcher's own connection travel this way: JSON-escaping a flood of log text on the node and parsing
it again on the controller cost more CPU than everything else on the way (docs/launch.md).
"""
from __future__ import annotations

import json
import sys
import threading
from typing import Any, BinaryIO, Iterator, Mapping, TextIO

MARKER = "\x1ehgtrain "
_lock = threading.Lock()


def encode(obj: Mapping[str, Any]) -> str:
    return MARKER + json.dumps(obj, separators=(",", ":"), default=str) + "\n"


def encode_raw(obj: Mapping[str, Any], payload: bytes) -> bytes:
    """A frame whose ``payload`` follows its line as raw bytes (``size`` is added)."""
    return encode({**obj, "size": len(payload)}).encode("utf-8") + payload


def emit(obj: Mapping[str, Any], stream: TextIO | None = None) -> None:
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


def decode_lines(text: str) -> list[dict[str, Any]]:
    """Every frame in captured output, noise skipped. Split on ``"\n"`` only: ``str.splitlines()``
    also breaks at the marker's ``\x1e``."""
    return [frame for frame in map(decode, text.split("\n")) if frame is not None]


def read_stream(stream: BinaryIO, *, raw: bool = False) -> Iterator[dict[str, Any]]:
    """Every frame on a binary stream, noise lines skipped; a raw payload (``size``) is read exactly and
    handed over as the frame's ``text``, decoded as log text is (invalid UTF-8 bytes as ``\\xNN``), or
    with ``raw`` as its ``data``, undecoded (the launcher's log flood: see launch_events.LogLines).
    Ends at EOF, also inside a payload (the connection dropped: the rest never comes)."""
    for line in stream:
        frame = decode(line.decode("utf-8", "replace"))
        if frame is None:
            continue
        size = frame.pop("size", None)
        if isinstance(size, int) and size >= 0:
            payload = stream.read(size)
            if len(payload) < size:
                return
            if raw:
                frame["data"] = payload
            else:
                frame["text"] = payload.decode("utf-8", "backslashreplace")
        yield frame
