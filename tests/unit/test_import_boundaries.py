"""The package's import rules, read from the source (no imports run):

- **layers**: every import arrow points down the layer order (docs/architecture.md, "Layers"). A
  module may import its own package and the packages of lower layers; an import sideways (another
  package of its own layer) or up fails, naming both modules and both layers. Every import counts:
  at module level, inside functions (the controller's lazy imports) and under ``TYPE_CHECKING`` (a
  type-only import is still a dependency on that layer, and the type checker follows it);
- **no circles**: no two modules import each other, directly or through others, with the imports
  that run (module level and inside functions; ``TYPE_CHECKING`` imports never run);
- code that runs on a node (``hgcli/node``), in a training script (``hgcli/runtime``, ``hgcli/integrations``)
  and the ground floor shipped with them must not import click, rich or paramiko at all: a node needs
  only Python and torch;
- the controller (every other package, and ``hgcli.cli`` itself) must not import torch or numpy when its
  modules load: ``--help``, ``probe`` and ``status`` stay light. Imports inside functions are the
  controller's way to reach torch lazily and are allowed there.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hgcli"
NODE_SIDE = ("hgcli.node", "hgcli.runtime", "hgcli.integrations", "hgcli.schema", "hgcli.state", "hgcli.errors")
CONTROLLER = ("hgcli.cli", "hgcli.commands", "hgcli.config", "hgcli.probe", "hgcli.bench", "hgcli.plan", "hgcli.launch",
              "hgcli.jobs", "hgcli.remote", "hgcli.render", "hgcli.schema", "hgcli.state", "hgcli.errors")

# The layers, lowest first; a package is named by its first part under hgcli/ (``hgcli`` itself: the
# package's root, which holds only its version). The ground floor is what every side stands on and
# what is shipped to nodes with them: the root, the errors, the contracts (schema) and the state
# directory with the job records (state).
GROUND = (("hgcli",), ("errors",), ("schema",), ("state",))
# The controller above the ground floor, in the order of the pipeline's dependencies.
CONTROLLER_LAYERS = (("remote",), ("config",), ("probe", "bench"), ("plan",), ("launch",), ("jobs",), ("render",),
                     ("commands",), ("cli",), ("__main__",))
# Apart from the controller: code that runs on nodes and in ranks, and what stands on it. They import
# the ground floor and the lower apart layers, never the controller.
APART = (("runtime",), ("node",), ("integrations", "examples", "local"))
# The apart packages the controller may import: the node programs' protocol and frames, and the
# ranks' environment and checkpoints it writes and reads.
SHARED = ("runtime", "node")
# Known upward edges, each to be removed by the change that fixes it; the test fails on any other.
PENDING: set[tuple[str, str]] = set()
# Known circles of modules (sorted tuples), each to be removed by the change that breaks it.
KNOWN_CIRCLES: set[tuple[str, ...]] = set()
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


def _run_only(tree: ast.Module) -> list[ast.AST]:
    """Every node of a module but those under ``if TYPE_CHECKING:`` (imports that never run)."""
    nodes: list[ast.AST] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        nodes.append(node)
        pending.extend(ast.iter_child_nodes(node))
    return nodes


def imports(name: str, *, top_level_only: bool, type_checking: bool = True) -> set[str]:
    """Modules imported by one module: at load time only, or anywhere in it (with ``type_checking``
    False, not those under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(MODULES[name].read_text())
    nodes: list[ast.AST] = []
    if not top_level_only and not type_checking:
        nodes = _run_only(tree)
    elif top_level_only:
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


def package_of(module: str) -> str:
    """``hgcli.launch.events`` -> ``launch``; ``hgcli.cli`` -> ``cli``; ``hgcli`` -> ``hgcli``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(package: str) -> tuple[str, int]:
    """(side, level): side is "ground", "controller" or "apart"; levels count up from 0 on each side,
    the controller's on from the ground floor's."""
    for side, layers, start in (("ground", GROUND, 0), ("controller", CONTROLLER_LAYERS, len(GROUND)),
                                ("apart", APART, len(GROUND))):
        for level, members in enumerate(layers, start):
            if package in members:
                return side, level
    raise AssertionError(f"hgcli/{package} is in no layer: add it to GROUND, CONTROLLER_LAYERS or APART")


def describe(package: str) -> str:
    side, level = layer_of(package)
    return f"{side} layer {level}: {package}"


def may_import(importer: str, imported: str) -> bool:
    """Whether package ``importer`` may import package ``imported``: down, never sideways or up."""
    if importer == imported:
        return True
    (side, level), (to_side, to_level) = layer_of(importer), layer_of(imported)
    if to_side == "ground":
        return side != "ground" or to_level < level   # everything stands on the ground floor
    if side == "ground":
        return False
    if side == to_side:
        return to_level < level
    return side == "controller" and imported in SHARED   # the controller drives the nodes and ranks


def layer_violations() -> list[str]:
    """Every import of an hgcli module that points up or sideways, but the PENDING ones."""
    found = []
    for name in sorted(MODULES):
        targets = {t for t in imports(name, top_level_only=False) if t.split(".")[0] == "hgcli"}
        for target in sorted(targets):
            # ``from ..jobs import status`` names hgcli.jobs and hgcli.jobs.status: the module is told
            if any(t.startswith(target + ".") for t in targets) or (name, target) in PENDING:
                continue
            importer, imported = package_of(name), package_of(target)
            if not may_import(importer, imported):
                side, level = layer_of(importer)
                to_side, to_level = layer_of(imported)
                way = "sideways" if (side, level) == (to_side, to_level) else "up or across"
                found.append(f"{name} ({describe(importer)}) imports {target} ({describe(imported)}): {way}")
    return found


def circles() -> list[tuple[str, ...]]:
    """Groups of modules that import each other (strongly connected, by the imports that run), but
    the KNOWN_CIRCLES. An import of a module's own package (``from . import x``) is not an edge to it."""
    edges: dict[str, set[str]] = {}
    for name in MODULES:
        targets = set()
        for target in imports(name, top_level_only=False, type_checking=False):
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != name and not name.startswith(target + "."):
                targets.add(target)
        edges[name] = targets
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[tuple[str, ...]] = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 and tuple(sorted(group)) not in KNOWN_CIRCLES:
                found.append(tuple(sorted(group)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def test_every_import_points_down_the_layers():
    assert layer_violations() == []


def test_every_package_has_a_layer():
    packages = {package_of(m) for m in MODULES}
    assert packages == {p for layers in (GROUND, CONTROLLER_LAYERS, APART) for ps in layers for p in ps}


def test_no_modules_import_each_other():
    assert circles() == []


def test_the_allowances_are_still_needed():
    """A PENDING edge or a KNOWN_CIRCLE that the code no longer has is taken off its list."""
    for name, target in PENDING:
        assert target in imports(name, top_level_only=False), (name, target)
    everything = set(KNOWN_CIRCLES)
    KNOWN_CIRCLES.clear()
    try:
        assert everything <= set(circles())
    finally:
        KNOWN_CIRCLES.update(everything)


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


def test_the_layer_check_sees_upward_sideways_and_circular_imports(tmp_path, monkeypatch):
    """The layer and circle checks can fail: an upward import inside a function, a type-only one, a
    sideways one, a node module importing the controller, and two modules importing each other."""
    pkg = tmp_path / "hgcli"
    for sub in ("remote", "config", "launch", "jobs", "node", "schema", "probe", "bench"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "remote" / "ssh.py").write_text("def f():\n    from ..config import hosts\n")          # up
    (pkg / "config" / "hosts.py").write_text("from ..schema import names\n")                   # down: fine
    (pkg / "schema" / "names.py").write_text("")
    (pkg / "launch" / "record.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..jobs import status\n")   # up, for types
    (pkg / "jobs" / "status.py").write_text("from ..launch import record\nfrom . import logs\n")
    (pkg / "jobs" / "logs.py").write_text("def g():\n    from . import status\n")               # a circle
    (pkg / "probe" / "inventory.py").write_text("from ..bench import cluster\n")                # sideways
    (pkg / "bench" / "cluster.py").write_text("from ..node import agent\n")                    # shared: fine
    (pkg / "node" / "agent.py").write_text("import hgcli.launch.record\n")                      # apart -> controller
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    monkeypatch.setitem(globals(), "MODULES", {module_name(p): p for p in pkg.rglob("*.py")})
    monkeypatch.setitem(globals(), "PENDING", set())
    assert layer_violations() == [
        "hgcli.launch.record (controller layer 8: launch) imports hgcli.jobs.status (controller layer 9: jobs): "
        "up or across",
        "hgcli.node.agent (apart layer 5: node) imports hgcli.launch.record (controller layer 8: launch): up or across",
        "hgcli.probe.inventory (controller layer 6: probe) imports hgcli.bench.cluster (controller layer 6: bench): "
        "sideways",
        "hgcli.remote.ssh (controller layer 4: remote) imports hgcli.config.hosts (controller layer 5: config): "
        "up or across",
    ]
    # launch.record -> jobs.status is for the type checker only: no circle with jobs.status -> launch.record
    assert circles() == [("hgcli.jobs.logs", "hgcli.jobs.status")]
