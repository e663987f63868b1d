"""JSON from a source hgtrain does not control (a rank's metrics line or error file, a job record or
metrics file on disk) parsed with its nesting bounded.

Python's parser takes ``'{"a":' * 900 + '1' + '}' * 900`` whole, and then every recursive reader
after it (the record's cleaning, the codec that saves it) fails with a RecursionError; deeper still,
the parser itself does. No record hgtrain writes or reads is deeper than a few levels, so anything
nested beyond MAX_DEPTH is refused before it is parsed, counted without recursion.
"""
from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 32
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def nesting(text: str) -> int:
    """How deep arrays and objects nest in ``text`` (brackets inside strings do not count)."""
    depth = deepest = 0
    for match in _BRACKETS.finditer(_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def too_deep(text: str | bytes) -> bool:
    """Whether ``text`` nests deeper than MAX_DEPTH."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return nesting(text) > MAX_DEPTH


def loads_bounded(text: str | bytes) -> Any:
    """``json.loads(text)``; ValueError (as for broken JSON) where it nests deeper than MAX_DEPTH."""
    if too_deep(text):
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    return json.loads(text)
