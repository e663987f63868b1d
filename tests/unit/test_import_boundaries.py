"""The package's import boundaries, read from the source (no imports run):

- code that runs on a node (``hgcli/node``), in a training script (``hgcli/runtime``, ``hgcli/integrations``) and the schema
  shipped with them must not import click, rich or paramiko at all: a node needs only Python and torch;
- the controller (every other package, and ``hgcli.cli`` itself) must not import torch or numpy when its
  modules load: ``--help``, ``probe`` and ``status`` stay light. Imports inside functions are the
  controller's way to reach torch lazily and are allowed there.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hgcli"
NODE_SIDE = ("hgcli.node", "hgcli.runtime", "hgcli.integrations", "hgcli.schema")
CONTROLLER = ("hgcli.cli", "hgcli.config", "hgcli.probe", "hgcli.bench", "hgcli.plan", "hgcli.launch",
              "hgcli.jobs", "hgcli.remote", "hgcli.render", "hgcli.schema", "hgcli.state", "hgcli.errors")
CONTROLLER_ONLY = ("click", "rich", "paramiko")
HEAVY = ("torch", "numpy")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _absolute(name: str, node: ast.ImportFrom) -> list[str]:
    """The modules an ImportFrom names: its base, and each imported name that is itself a module."""
    if node.level:
        package = name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    return [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]


def imports(name: str, *, top_level_only: bool) -> set[str]:
    """Modules imported by one module: at load time only, or anywhere in it."""
    tree = ast.parse(MODULES[name].read_text())
    if top_level_only:
        nodes: list[ast.AST] = []
        pending: list[ast.AST] = list(tree.body)
        while pending:      # module level, including inside if/try blocks, not inside def or class
            stmt = pending.pop()
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                continue    # for the type checker only
            nodes.append(stmt)
            pending.extend(ast.iter_child_nodes(stmt))
    else:
        nodes = list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.update(_absolute(name, node))
    return found


def closure(start: str, *, top_level_only: bool) -> dict[str, str]:
    """Every module reachable from ``start`` -> the hgcli module that imports it first (for the message).
    Importing ``a.b.c`` also runs ``a`` and ``a.b``."""
    seen: dict[str, str] = {start: start}
    todo = [start]
    while todo:
        current = todo.pop()
        for target in imports(current, top_level_only=top_level_only):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix not in seen:
                    seen[prefix] = current
                    if prefix in MODULES:
                        todo.append(prefix)
    return seen


def offenders(start: str, banned: tuple[str, ...], *, top_level_only: bool) -> list[str]:
    reached = closure(start, top_level_only=top_level_only)
    return sorted(f"{m} (imported by {by})" for m, by in reached.items() if m.split(".")[0] in banned)


def in_packages(prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in MODULES if any(m == p or m.startswith(p + ".") for p in prefixes))


@pytest.mark.parametrize("module", in_packages(NODE_SIDE))
def test_node_and_runtime_code_never_imports_the_controllers_libraries(module):
    assert offenders(module, CONTROLLER_ONLY, top_level_only=False) == []


@pytest.mark.parametrize("module", in_packages(CONTROLLER))
def test_the_controller_does_not_import_torch_when_it_loads(module):
    assert offenders(module, HEAVY, top_level_only=True) == []


def test_the_walk_sees_a_violation(tmp_path, monkeypatch):
    """The checks above can fail: a node module importing rich, through a helper module, is found."""
    pkg = tmp_path / "hgcli"
    (pkg / "node").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "node" / "__init__.py").write_text("")
    (pkg / "node" / "a.py").write_text("from . import b\n")
    (pkg / "node" / "b.py").write_text("def f():\n    import rich.console\n")
    (pkg / "cli.py").write_text("import sys\nif sys:\n    from .node import a\nimport torch.nn\n")
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    monkeypatch.setitem(globals(), "MODULES", {module_name(p): p for p in pkg.rglob("*.py")})
    assert offenders("hgcli.node.a", CONTROLLER_ONLY, top_level_only=False) == [
        "rich (imported by hgcli.node.b)", "rich.console (imported by hgcli.node.b)"]
    assert offenders("hgcli.node.a", CONTROLLER_ONLY, top_level_only=True) == []
    assert offenders("hgcli.cli", HEAVY, top_level_only=True) == ["torch (imported by hgcli.cli)",
                                                                 "torch.nn (imported by hgcli.cli)"]
