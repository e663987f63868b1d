"""JSON as hgtrain's ``--json`` promises it: strict (issue 51). Python's parser takes ``NaN`` and
``Infinity``, which no other JSON reader does; the tests that read a command's ``--json`` output read
it through :func:`loads`, so every command's output is checked for them where it is already tested."""
from __future__ import annotations

import json
from typing import Any


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} in --json output: not JSON")


def loads(text: str | bytes) -> Any:
    return json.loads(text, parse_constant=_refuse)
