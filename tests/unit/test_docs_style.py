"""README.md and docs/*.md are for users: what hgtrain does, how to use it, and the current figures
with the command that reproduces each. The history of how a figure or a behaviour came to be (dates,
run ids, "used to", "before this") belongs in benchmarks/RESULTS.md, which keeps it as dated entries.

HISTORY is the check issue 48 states as a grep (``grep -rnE PATTERN README.md docs``), kept here so
that it stays true. It matches harmless English too ("is used to pick"): rephrase such lines rather
than widen an exception.
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HISTORY = re.compile(r"used to|before this|run E[0-9]|session|\(20[0-9]{2}-[0-9]{2}-[0-9]{2}, ")


def history_lines(paths: list[Path]) -> list[str]:
    """``path:line: text`` of every line that HISTORY matches."""
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{number}: {line}")
    return found


def user_docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_user_docs_hold_no_history():
    docs = user_docs()
    assert len(docs) > 10                      # README and docs/ are found, not an empty glob
    found = history_lines(docs)
    assert not found, ("history in the user docs: move it to benchmarks/RESULTS.md as a dated entry, "
                       "or rephrase:\n" + "\n".join(found))


def test_the_check_finds_each_kind_of_history(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "It runs on every node.",                                  # clean
        "The store used to listen on every interface.",
        "(before this, the store listened on `*:PORT`)",
        "by run E15, the shares moving",
        "Current figures (2026-12-06, late):",
        "each rank in its own session",
        "Current figures (a shared CPU; every run, dated: benchmarks/RESULTS.md):",   # clean
    ]))
    assert [line.split(":")[1] for line in history_lines([doc])] == ["2", "3", "4", "5", "6"]
