"""The porting guide (docs/runtime.md, "Porting a DDP script"): the bundled example (hgcli) and its
plain torchrun DDP twin differ in at most 10 lines, and the doc shows exactly their diff; so do the
GPT-style pair that draws its own batches ("Scripts that draw their own batches"). The two DataLoader
scripts running as real jobs: tests/launch/test_launch_port.py; the GPT-style port under a hybrid
plan and a group of one: tests/runtime/test_drawn.py."""
from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DDP = "hgcli/examples/ddp_resnet.py"
HGCLI = "hgcli/examples/train.py"
DDP_GPT = "hgcli/examples/ddp_gpt.py"
HGCLI_GPT = "hgcli/examples/train_gpt.py"
HUNK = re.compile(r"^@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@$")
MAX_CHANGED = 10


def code_lines(path: str) -> tuple[list[str], int]:
    """The file's lines after its module docstring, and how many lines come before them."""
    text = (REPO / path).read_text()
    docstring = ast.parse(text).body[0]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant), path
    assert docstring.end_lineno is not None
    lines = text.splitlines()
    return lines[docstring.end_lineno:], docstring.end_lineno


def port_diff(before: str = DDP, after: str = HGCLI) -> list[str]:
    """``diff -u`` of the two scripts with the module docstrings' hunk left out: line numbers are the
    files' own."""
    ddp, ddp_at = code_lines(before)
    ported, ported_at = code_lines(after)
    out = []
    for line in difflib.unified_diff(ddp, ported, before, after, lineterm=""):
        hunk = HUNK.match(line)
        if hunk:
            line = (f"@@ -{int(hunk[1]) + ddp_at}{hunk[2] or ''} "
                    f"+{int(hunk[3]) + ported_at}{hunk[4] or ''} @@")
        out.append(line)
    return out


def changed_lines(diff: list[str]) -> tuple[int, int, int]:
    """(changed, removed, added): in each run of adjacent removed and added lines, a replaced line
    counts once, so ``changed`` is the number of lines of the DDP script replaced or deleted plus
    the lines inserted."""
    changed = removed = added = 0
    run = [0, 0]
    for line in [*diff[2:], " "]:
        if line.startswith("-"):
            run[0] += 1
        elif line.startswith("+"):
            run[1] += 1
        else:
            changed += max(run)
            removed, added = removed + run[0], added + run[1]
            run = [0, 0]
    return changed, removed, added


def doc_block(heading: str = "## Porting a DDP script") -> list[str]:
    """The first ``diff`` block after ``heading`` in docs/runtime.md."""
    text = (REPO / "docs/runtime.md").read_text()
    section = text[text.index(heading + "\n"):]
    block = section[section.index("```diff\n") + len("```diff\n"):]
    return block[:block.index("```\n")].splitlines()


def test_the_port_changes_at_most_ten_lines_of_the_ddp_script():
    changed, removed, added = changed_lines(port_diff())
    assert changed <= MAX_CHANGED, "\n".join(port_diff())
    assert (changed, removed, added) == (10, 9, 8)      # the counts docs/runtime.md states


def test_the_porting_guide_shows_the_scripts_diff():
    assert doc_block() == port_diff(), "regenerate the block: " + "\n".join(port_diff())


def test_the_gpt_style_port_changes_at_most_ten_lines_of_its_ddp_script():
    changed, removed, added = changed_lines(port_diff(DDP_GPT, HGCLI_GPT))
    assert changed <= MAX_CHANGED, "\n".join(port_diff(DDP_GPT, HGCLI_GPT))
    assert (changed, removed, added) == (9, 7, 9)       # the counts docs/runtime.md states


def test_the_porting_guide_shows_the_gpt_style_scripts_diff():
    expected = port_diff(DDP_GPT, HGCLI_GPT)
    assert doc_block("### Scripts that draw their own batches") == expected, \
        "regenerate the block: " + "\n".join(expected)


def test_the_change_count_reads_a_replaced_line_once():
    diff = ["--- a", "+++ b", "@@ -1,4 +1,4 @@", " same", "-old", "+new", " same", "-gone", "+extra", "+more"]
    assert changed_lines(diff) == (3, 2, 3)
