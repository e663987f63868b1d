"""No function or method in ``hgcli/`` is longer than MAX_LINES, read from the source (nothing is
imported): a long function is one that does several things, and reads and tests worse than its
pieces. A function's lines run from its ``def`` to its last line, docstring included; decorators
(click's options) are declarations and do not count. Nested functions count on their own and inside
the function that holds them."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hgcli"
MAX_LINES = 60
# "path:qualified name" -> why it cannot be split. Empty: every function fits.
ALLOWED: dict[str, str] = {}


def long_functions(root: Path, limit: int) -> dict[str, int]:
    """``path:Class.function`` -> lines (``def`` to last line) of each one longer than ``limit``."""
    found: dict[str, int] = {}

    def walk(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    if lines > limit:
                        found[f"{path}:{name}"] = lines
                walk(child, path, name + ".")
            else:
                walk(child, path, prefix)

    for file in sorted(root.rglob("*.py")):
        walk(ast.parse(file.read_text(encoding="utf-8")), file.relative_to(root.parent).as_posix(), "")
    return found


def test_no_function_in_the_package_is_longer_than_the_limit():
    too_long = {k: v for k, v in long_functions(PACKAGE, MAX_LINES).items() if k not in ALLOWED}
    assert not too_long, (f"functions over {MAX_LINES} lines (split them; ALLOWED only with the reason "
                          f"they cannot be): {too_long}")


def test_every_allowed_function_is_still_long():
    # An entry that no longer needs its exemption is removed, so the list cannot hide a new long function.
    assert set(ALLOWED) <= set(long_functions(PACKAGE, MAX_LINES))


def test_the_walk_finds_a_long_method_inside_a_class(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    (package / "m.py").write_text(f"class C:\n    def f(self):\n{body}\n\n    def g(self):\n        pass\n")
    assert long_functions(package, MAX_LINES) == {"pkg/m.py:C.f": MAX_LINES + 1}
