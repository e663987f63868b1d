"""docs/architecture.md, "The tree", has a row for every package of ``hgcli/`` (a directory with an
``__init__.py``): a row's first cell is the package's path relative to ``hgcli/``, in backticks and
ending in ``/`` (the convention the section states). A new package without a row fails here, and so
does a row for a package that does not exist."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "hgcli"
DOC = REPO / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(?P<path>[A-Za-z0-9_]+(?:/[A-Za-z0-9_]+)*/)` \|", re.MULTILINE)


def packages(root: Path) -> set[str]:
    """Every sub-package of ``root`` as ``path/`` relative to it (``node/agent/``); not ``root`` itself."""
    return {init.parent.relative_to(root).as_posix() + "/" for init in root.rglob("__init__.py")
            if init.parent != root}


def tree_rows(markdown: str) -> set[str]:
    """The packages named by the first cells of the rows of the "## The tree" section."""
    start = markdown.index("\n## The tree\n")
    end = markdown.find("\n## ", start + 1)
    return {m["path"] for m in ROW.finditer(markdown[start:end if end != -1 else len(markdown)])}


def test_every_package_of_hgcli_has_a_row_in_the_tree():
    missing = packages(PACKAGE) - tree_rows(DOC.read_text(encoding="utf-8"))
    assert not missing, f"docs/architecture.md, 'The tree', has no row for: {sorted(missing)}"


def test_every_row_of_the_tree_is_a_package():
    unknown = tree_rows(DOC.read_text(encoding="utf-8")) - packages(PACKAGE)
    assert not unknown, f"docs/architecture.md, 'The tree', names packages hgcli/ does not have: {sorted(unknown)}"


def test_the_parsers_see_nested_packages_and_only_the_tree_section(tmp_path):
    (tmp_path / "pkg" / "a" / "b").mkdir(parents=True)
    (tmp_path / "pkg" / "plain").mkdir()                      # no __init__.py: not a package
    for d in ("pkg", "pkg/a", "pkg/a/b"):
        (tmp_path / d / "__init__.py").write_text("")
    assert packages(tmp_path / "pkg") == {"a/", "a/b/"}
    doc = ("# T\n\n| `x/` | before |\n\n## The tree\n\n| package | what |\n|---|---|\n| `cli.py` | c |\n"
           "| `a/` | one |\n| `a/b/` | two |\n\n## After\n\n| `y/` | after |\n")
    assert tree_rows(doc) == {"a/", "a/b/"}
