"""Whether a launched script can train under parameter servers: only ``hg.init()`` sets up a hybrid or
ps plan's groups, RPC and exchange. A script that never calls it (plain torchrun + DDP) runs under
allreduce only: its ranks join a plain ``init_process_group`` whose WORLD_SIZE counts PS ranks that
never join it, so ``auto`` must not give it parameter servers (docs/planning.md, rule 0).

Two signals, either one enough: the script's last job on this cluster stored measured rates, which
only ``ctx.finish()`` reports (bench/rates.py); or the entry module, read and parsed here (never
imported), imports ``hgcli.runtime``. The parse is of the entry module only: a script that reaches
the runtime through a helper module of its own is known after its first job.
"""
from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import StateError

# A training script's entry module is small; a larger file is not parsed (it is not one we can judge).
MAX_SOURCE_BYTES = 4 << 20
RUNTIME = "hgcli.runtime"
INTEGRATIONS = "hgcli.integrations"


@dataclass(frozen=True)
class ScriptUse:
    """What the planner knows of a script: whether it may train under parameter servers, and, when
    not, why in one clause (it ends the plan's reason)."""

    runtime: bool
    why: str


def entry_path(script: str, cwd: Path, search: list[str]) -> Path | None:
    """The file that ``script`` (``bench.rates.script_identity``) runs, where this machine has it:
    ``script p`` relative to ``cwd``, ``module m`` on ``cwd`` then ``search`` (sys.path), as
    ``m.py`` or ``m/__main__.py``; None for a binary's command or a file not found here."""
    kind, _, name = script.partition(" ")
    if kind == "script":
        path = cwd / name
        return path if path.suffix == ".py" and path.is_file() else None
    if kind != "module":
        return None
    rel = Path(*name.split("."))
    for base in [str(cwd), *search]:
        for candidate in (Path(base or ".") / rel.with_suffix(".py"), Path(base or ".") / rel / "__main__.py"):
            if candidate.is_file():
                return candidate
    return None


def imported_modules(source: str) -> set[str]:
    """Every absolute module an ``import`` or ``from ... import`` names, with ``from a import b``
    also as ``a.b`` (``from hgcli import runtime``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _under(names: set[str], package: str) -> bool:
    return any(n == package or n.startswith(package + ".") for n in names)


def static_use(path: Path) -> ScriptUse:
    """What the source of ``path`` says (a file that cannot be read or parsed says no)."""
    label = path.name if path.name != "__main__.py" else f"{path.parent.name}/__main__.py"
    try:
        if path.stat().st_size > MAX_SOURCE_BYTES:
            return ScriptUse(False, f"{label} is too large to check for hgcli.runtime")
        names = imported_modules(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError) as exc:
        return ScriptUse(False, f"{label} could not be checked for hgcli.runtime ({exc.__class__.__name__})")
    if _under(names, RUNTIME):
        return ScriptUse(True, f"{label} imports hgcli.runtime")
    if _under(names, INTEGRATIONS):
        return ScriptUse(False, f"{label} trains through a framework integration (hgcli.integrations), "
                                "which trains one all-reduce group")
    return ScriptUse(False, f"{label} does not import hgcli.runtime (never calls hg.init())")


def last_job_used_runtime(fingerprint: str, script: str) -> bool:
    """Whether the script's last job on this cluster stored rates: only ``ctx.finish()`` reports the
    compute rate they hold, so its ranks called ``hg.init()``."""
    from ..bench.rates import load_rates

    try:
        return load_rates(fingerprint, script) is not None
    except StateError:
        return False


def script_use(fingerprint: str, script: str, cwd: Path | None = None,
               search: list[str] | None = None) -> ScriptUse:
    """Whether ``script`` may train under parameter servers, from its last job, else its source."""
    if last_job_used_runtime(fingerprint, script):
        return ScriptUse(True, "its last job called hg.init()")
    path = entry_path(script, Path(os.getcwd()) if cwd is None else cwd, sys.path if search is None else search)
    if path is None:
        return ScriptUse(False, f"{script.partition(' ')[2] or script} could not be checked here for "
                                "hgcli.runtime, and no earlier job of it called hg.init()")
    return static_use(path)
