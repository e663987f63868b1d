"""The launcher's restart state machine: how an attempt ends (``AttemptEnd``) and the one decision of
what follows (``what_follows``), with the shape rules of ``hgcli/launch`` that keep it one piece
(no circles, no giant module or class)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hgcli.errors import EXIT_NODES_FAILED
from hgcli.launch.adapt import Regroup
from hgcli.launch.ending import AttemptEnd, Next, Outcome, what_follows
from hgcli.launch.events import RootCause
from hgcli.schema.stages import JobState

from tests.launch.plans import local_cluster, make_plan
from tests.unit import test_import_boundaries as boundaries

LAUNCH = Path(__file__).resolve().parents[2] / "hgcli" / "launch"
CAUSE = RootCause(node="a", rank=0, exit_code=1, signal=None, reason="exit 1", oom=None)


def outcome(end: AttemptEnd, restartable: bool = False) -> Outcome:
    regroup = None
    if end is AttemptEnd.REGROUP:
        plan = make_plan(local_cluster(), [["local"]], ps=["local"])
        regroup = Regroup(plan=plan, reason="straggling", predicted_now=1.0, predicted_new=2.0)
    cause = CAUSE if end in (AttemptEnd.FAILED, AttemptEnd.REPLAN) else None
    return Outcome(end, 1 if cause else 0, cause, restartable=restartable, regroup=regroup)


# (ending, restartable, restarts left, --nnodes elastic, interrupted) -> what follows
TABLE = [
    (AttemptEnd.SUCCEEDED, False, 1, False, False, Next.FINISH),
    (AttemptEnd.SUCCEEDED, False, 0, True, False, Next.FINISH),
    (AttemptEnd.STOPPED, False, 3, False, False, Next.FINISH),
    (AttemptEnd.STOPPED, False, 3, True, True, Next.FINISH),
    (AttemptEnd.DETACHED, False, 0, False, False, Next.DETACH),
    (AttemptEnd.DETACHED, False, 0, False, True, Next.DETACH),
    # a failed rank: restarted while restarts are left; under --nnodes on the nodes that answer
    (AttemptEnd.FAILED, True, 1, False, False, Next.RESTART),
    (AttemptEnd.FAILED, True, 1, True, False, Next.REPLAN),
    (AttemptEnd.FAILED, True, 0, False, False, Next.GIVE_UP),
    (AttemptEnd.FAILED, True, 0, True, False, Next.GIVE_UP),
    (AttemptEnd.FAILED, True, 2, False, True, Next.FINISH),      # Ctrl-C wins over a restart
    # a failure no restart fixes (an agent refused the job, fewer than MIN nodes answer)
    (AttemptEnd.FAILED, False, 2, False, False, Next.FINISH),
    (AttemptEnd.FAILED, False, 2, True, False, Next.FINISH),
    # a lost node: the same plan once it answers again; under --nnodes a plan on the nodes that answer
    (AttemptEnd.REPLAN, True, 1, False, False, Next.RESTART),
    (AttemptEnd.REPLAN, True, 1, True, False, Next.REPLAN),
    (AttemptEnd.REPLAN, True, 0, True, False, Next.GIVE_UP),
    (AttemptEnd.REPLAN, True, 1, True, True, Next.FINISH),
    # a re-grouping costs no restart, even with none left; interrupted, the job ends stopped
    (AttemptEnd.REGROUP, False, 0, False, False, Next.REGROUP),
    (AttemptEnd.REGROUP, False, 2, True, False, Next.REGROUP),
    (AttemptEnd.REGROUP, False, 2, False, True, Next.STOP),
]


@pytest.mark.parametrize("end, restartable, left, elastic, interrupted, follows", TABLE)
def test_what_follows_each_ending(end, restartable, left, elastic, interrupted, follows):
    assert what_follows(outcome(end, restartable), restarts_left=left, elastic=elastic,
                        interrupted=interrupted) is follows


def test_the_table_covers_every_ending_and_every_next_step():
    assert {row[0] for row in TABLE} == set(AttemptEnd)
    assert {row[-1] for row in TABLE} == set(Next)


def test_only_restart_replan_and_regroup_start_another_attempt():
    assert {n for n in Next if n.restarts} == {Next.RESTART, Next.REPLAN, Next.REGROUP}


def test_each_ending_is_the_jobs_state_when_the_job_ends_with_it():
    """A detached job is RUNNING; a lost node is the job's failure; RUNNING means nothing else."""
    states = {end: end.job_state for end in AttemptEnd}
    assert states == {AttemptEnd.SUCCEEDED: JobState.SUCCEEDED, AttemptEnd.FAILED: JobState.FAILED,
                      AttemptEnd.STOPPED: JobState.STOPPED, AttemptEnd.REGROUP: JobState.STOPPED,
                      AttemptEnd.REPLAN: JobState.FAILED, AttemptEnd.DETACHED: JobState.RUNNING}
    assert outcome(AttemptEnd.DETACHED).state is JobState.RUNNING


def test_an_outcome_refuses_an_ending_that_contradicts_what_it_carries():
    with pytest.raises(ValueError, match="regroup"):
        Outcome(AttemptEnd.REGROUP, 0, None)
    with pytest.raises(ValueError, match="regroup"):
        Outcome(AttemptEnd.SUCCEEDED, 0, None, regroup=outcome(AttemptEnd.REGROUP).regroup)
    with pytest.raises(ValueError, match="restartable"):
        Outcome(AttemptEnd.REPLAN, EXIT_NODES_FAILED, CAUSE)


def test_no_module_of_launch_imports_another_that_imports_it_back(monkeypatch):
    """Within hgcli/launch even a type-only import counts: the type checker follows it."""
    launch = {m: p for m, p in boundaries.MODULES.items() if m.startswith("hgcli.launch")}
    monkeypatch.setattr(boundaries, "MODULES", launch)
    real = boundaries.imports
    monkeypatch.setattr(boundaries, "imports",
                        lambda name, *, top_level_only, type_checking=True: real(name, top_level_only=top_level_only))
    assert boundaries.circles() == []


def test_the_launch_circle_check_sees_a_type_only_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "hgcli" / "launch"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    monkeypatch.setattr(boundaries, "PACKAGE", pkg.parent)
    monkeypatch.setattr(boundaries, "MODULES", {boundaries.module_name(p): p for p in pkg.parent.rglob("*.py")})
    assert boundaries.circles() == []     # the repository-wide rule: type-only imports never run
    real = boundaries.imports
    monkeypatch.setattr(boundaries, "imports",
                        lambda name, *, top_level_only, type_checking=True: real(name, top_level_only=top_level_only))
    assert boundaries.circles() == [("hgcli.launch.a", "hgcli.launch.b")]


def methods_over(limit: int) -> dict[str, int]:
    """``module:Class`` -> methods, for classes of hgcli/launch over ``limit`` methods whose
    docstring does not say why they need that many (it names its "methods")."""
    found = {}
    for path in sorted(LAUNCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                count = sum(isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)) for c in node.body)
                if count > limit and "methods" not in (ast.get_docstring(node) or ""):
                    found[f"{path.stem}:{node.name}"] = count
    return found


def test_no_launch_class_has_more_than_20_methods_unless_it_says_why():
    assert methods_over(20) == {}
    assert methods_over(10), "the count sees classes with many methods"


def test_no_launch_module_is_over_500_lines():
    lengths = {p.name: len(p.read_text().splitlines()) for p in LAUNCH.glob("*.py")}
    assert lengths["launcher.py"] > 100      # the count reads the files
    assert {name: n for name, n in lengths.items() if n > 500} == {}
