"""``--ranks 0,2-3``: the one parser of rank lists (launch shows only those; logs prints only those)."""
from __future__ import annotations

from ..errors import UsageError

# Above any job's world size (the largest clusters run some tens of thousands of ranks): a bound so
# that `--ranks 0-99999999999` is refused instead of built in memory.
MAX_RANK = (1 << 17) - 1


def parse_rank_list(text: str) -> frozenset[int]:
    """``"0,2-3"`` -> {0, 2, 3}; a UsageError for anything else (cli.py names the flag)."""
    chosen: set[int] = set()
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not _digits(lo) or (sep and not _digits(hi)):
            raise UsageError(f"rank list {text!r}: expected numbers and ranges like 0,2-3")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last > MAX_RANK:
            raise UsageError(f"rank list {text!r}: rank {last} is beyond any job's ranks (at most {MAX_RANK})")
        if last < first:
            raise UsageError(f"rank list {text!r}: range {item} runs backwards")
        chosen.update(range(first, last + 1))
    return frozenset(chosen)


def _digits(text: str) -> bool:
    """ASCII digits only ("²".isdigit() is true, and int() refuses it), and few enough for int()."""
    return 0 < len(text) <= 12 and text.isascii() and text.isdigit()
