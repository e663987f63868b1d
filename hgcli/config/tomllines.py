"""Line numbers of TOML tables and keys, so cluster-file errors can name file:LINE.

``tomllib`` reports positions only for syntax errors; once a file parses, the values carry no
position. This scanner reads the (already valid) text once and records where each table header and
each key starts, addressed like the parsed data: ``("nodes", 2, "port")`` is the ``port`` key of the
third ``[[nodes]]`` table. It understands headers, arrays of tables, dotted and quoted keys, and
values spanning lines (arrays, multi-line strings) well enough for error messages; it is not a parser.
"""
from __future__ import annotations

import re

Path = tuple[str | int, ...]

_KEY = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_DOTTED = rf"{_KEY}(?:\s*\.\s*{_KEY})*"
_ARRAY_HEADER = re.compile(rf"^\s*\[\[\s*({_DOTTED})\s*\]\]")
_TABLE_HEADER = re.compile(rf"^\s*\[\s*({_DOTTED})\s*\]")
_KEY_LINE = re.compile(rf"^\s*({_DOTTED})\s*=")
_KEY_PART = re.compile(_KEY)


def _split_dotted(dotted: str) -> list[str]:
    parts = []
    for m in _KEY_PART.finditer(dotted):
        part = m.group(0)
        parts.append(part[1:-1] if part[:1] in "\"'" else part)
    return parts


class _ValueScanner:
    """Tracks whether the next line still belongs to a value (open brackets, multi-line strings)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string: str | None = None   # the closing delimiter of an open multi-line string

    @property
    def open(self) -> bool:
        return self.depth > 0 or self.in_string is not None

    def feed(self, text: str) -> None:
        i = 0
        while i < len(text):
            if self.in_string is not None:
                end = text.find(self.in_string, i)
                if end < 0:
                    return
                i = end + len(self.in_string)
                self.in_string = None
                continue
            ch = text[i]
            if text.startswith('"""', i) or text.startswith("'''", i):
                self.in_string = text[i:i + 3]
                i += 3
            elif ch in "\"'":
                i = self._skip_string(text, i)
            elif ch == "#":
                return
            elif ch in "[{":
                self.depth += 1
                i += 1
            elif ch in "]}":
                self.depth = max(0, self.depth - 1)
                i += 1
            else:
                i += 1

    @staticmethod
    def _skip_string(text: str, start: int) -> int:
        quote = text[start]
        i = start + 1
        while i < len(text):
            if quote == '"' and text[i] == "\\":
                i += 2
                continue
            if text[i] == quote:
                return i + 1
            i += 1
        return i


class TomlLines:
    """Where each table and key of a TOML text starts (1-based lines)."""

    def __init__(self, text: str) -> None:
        self._lines = text.splitlines()
        self._where: dict[Path, int] = {(): 1}
        self._arrays: dict[tuple[str, ...], int] = {}   # array-of-tables name path -> last index
        table: Path = ()
        value = _ValueScanner()
        for number, line in enumerate(self._lines, start=1):
            if value.open:
                value.feed(line)
                continue
            if m := _ARRAY_HEADER.match(line):
                table = self._array_path(_split_dotted(m.group(1)))
                self._where.setdefault(table, number)
            elif m := _TABLE_HEADER.match(line):
                table = self._resolve(_split_dotted(m.group(1)))
                self._where.setdefault(table, number)
            elif m := _KEY_LINE.match(line):
                key = table + tuple(_split_dotted(m.group(1)))
                self._where.setdefault(key, number)
                value.feed(line[m.end():])

    def _resolve(self, names: list[str]) -> Path:
        """Header names -> data path, entering the last element of every array of tables on the way."""
        path: list[str | int] = []
        for k in range(len(names)):
            path.append(names[k])
            index = self._arrays.get(tuple(names[:k + 1]))
            if index is not None:
                path.append(index)
        return tuple(path)

    def _array_path(self, names: list[str]) -> Path:
        parent = self._resolve(names[:-1])
        key = tuple(names)
        self._arrays[key] = self._arrays.get(key, -1) + 1
        return parent + (names[-1], self._arrays[key])

    def line(self, path: Path) -> int:
        """The line of ``path``, else of its nearest recorded ancestor (an inline table's key is
        searched for on the lines of that table's value)."""
        for cut in range(len(path), -1, -1):
            found = self._where.get(path[:cut])
            if found is None:
                continue
            rest = path[cut:]
            if rest and all(isinstance(p, str) for p in rest):
                return self._inline_key_line(found, str(rest[-1]))
            return found
        return 1

    def _inline_key_line(self, start: int, key: str) -> int:
        pattern = re.compile(rf"(?:^|[{{,\s]){re.escape(key)}\s*=")
        for number in range(start, len(self._lines) + 1):
            text = self._lines[number - 1]
            if number > start and (_KEY_LINE.match(text) or _TABLE_HEADER.match(text)):
                break
            if pattern.search(text[text.find("=") + 1:] if number == start else text):
                return number
        return start
