"""Text from nodes, ranks and files made safe for a terminal and for rich.

Two dangers, one module:
- **Control characters.** A rank (or a node's ``nvidia-smi``, or a hand-edited file) can print ESC
  sequences: OSC 52 writes the user's clipboard, others set the window title or clear the screen.
  On a terminal every C0 and C1 control character except tab, and DEL, is shown visibly instead:
  ``^[`` for ESC (caret notation, as ``cat -v``), ``\\x9b`` for a C1 character. ``--raw`` opts out;
  files and ``--json`` always keep the exact bytes.
- **Markup.** rich reads ``[...]`` in plain strings as markup (``[/oops]`` raises MarkupError, ``[link=...]``
  makes a hyperlink). Values from outside go to rich as ``Text`` (never parsed), via ``cell``.
Imports nothing but the standard library, so pipes and ``--json`` do not pay for rich.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.text import Text

CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")   # every C0/C1 control and DEL, but tab
CONTROL_NO_NEWLINE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")   # ... and newline: for multi-line cells


def _show(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x20:
        return "^" + chr(code + 0x40)   # ESC -> ^[, CR -> ^M, NUL -> ^@
    if code == 0x7F:
        return "^?"
    return f"\\x{code:02x}"             # C1 (0x80-0x9f), e.g. CSI 0x9b


def visible(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters shown as ``^X`` / ``\\xNN`` (tab kept; newlines kept only
    with ``keep_newlines``). Text without any is returned as is (one regex search, in C)."""
    pattern = CONTROL_NO_NEWLINE if keep_newlines else CONTROL
    if pattern.search(text) is None:
        return text
    return pattern.sub(_show, text)


def cell(value: Any, style: str = "") -> Text:
    """A value from a node, a rank or a file as a rich ``Text``: never read as markup, control
    characters shown visibly (multi-line values keep their lines)."""
    from rich.text import Text

    return Text(visible("" if value is None else str(value), keep_newlines=True), style=style)
