"""``--ranks 0,2-3``: the one parser of rank lists (launch shows only those; logs prints only those)."""
from __future__ import annotations

from ..errors import UsageError


def parse_rank_list(text: str) -> frozenset[int]:
    """``"0,2-3"`` -> {0, 2, 3}; a UsageError for anything else (cli.py names the flag)."""
    chosen: set[int] = set()
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise UsageError(f"rank list {text!r}: expected numbers and ranges like 0,2-3")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise UsageError(f"rank list {text!r}: range {item} runs backwards")
        chosen.update(range(first, last + 1))
    return frozenset(chosen)
