"""Output from ranks, nodes and files is untrusted: no markup, no terminal escapes, no surprises.

Rendering with real rich consoles (a recording one for tables, a forced terminal for escapes) and
the real CLI's parsing; docs/security-output.md says what is escaped where.
"""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from hgcli.jobs.status import JobLive, JobStatus, LiveRank, NodeLive
from hgcli.jobs.stop import NodeStop, StopResult
from hgcli.render.plan import render_plan
from hgcli.render.probe import render_inventory
from hgcli.render.safe import visible
from hgcli.render.status import render_job, render_status
from hgcli.render.stop import render_stop
from hgcli.schema.stages import (
    GpuInfo, GroupPlan, Inventory, JobRecord, JobState, ModelSpec, NodeInfo, Plan, RankPlan, RankState, Role,
    Strategy,
)
from hgcli.schema.states import NodeJobState

HOSTILE = "[/oops] [link=http://x]y[/link] \x1b]52;c;aGk=\x07 \x1b[2J"   # markup, OSC 52, clear screen
SHOWN = "[/oops] [link=http://x]y[/link] ^[]52;c;aGk=^G ^[[2J"


def _plan(node: str = HOSTILE) -> Plan:
    return Plan(strategy=Strategy.HYBRID, world_size=2, groups=(GroupPlan(0, (0,)),),
                ranks=(RankPlan(0, Role.WORKER, node, HOSTILE, 0, 8), RankPlan(1, Role.PS, node, "cpu")),
                predicted_samples_per_s={"hybrid": 1.0, "ideal": 2.0}, global_batch=8, cluster="fp",
                reason=HOSTILE, ps_shards=(1,), model=ModelSpec(name=HOSTILE, parameters=10))


def _record() -> JobRecord:
    return JobRecord(id="hg-1", cluster="fp", cluster_source=HOSTILE, command=("python", HOSTILE), plan=_plan(),
                     state=JobState.RUNNING, root_cause=HOSTILE, restarts=("node b lost", HOSTILE))


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=400, color_system=None), out


def test_visible_shows_c0_c1_and_del_but_keeps_tab():
    assert visible("a\tb") == "a\tb"
    assert visible("\x1b[31mred\r\x00\x7f\x9b\x85") == "^[[31mred^M^@^?\\x9b\\x85"
    assert visible("x\ny") == "x^Jy" and visible("x\ny", keep_newlines=True) == "x\ny"
    assert visible("plain ünïcode [b]") == "plain ünïcode [b]"


def test_status_of_a_job_whose_rank_logged_markup_and_escapes(private_state_dir):
    live = JobLive("hg-1", (NodeLive(HOSTILE, NodeJobState.RUNNING, True, error=HOSTILE, ranks=(
        LiveRank(0, RankState.RUNNING, pid=7, metrics={"step": "[/oops]", "loss": HOSTILE}),)),
        NodeLive("b", NodeJobState.RUNNING, False, error=HOSTILE)), checked_at=0.0)
    console, out = _terminal()
    render_job(JobStatus(_record(), live), console)       # was: MarkupError, exit 1, table lost
    render_status([JobStatus(_record(), live)], console)
    text = out.getvalue()
    assert "\x1b]52" not in text and "\x1b[2J" not in text and "\x07" not in text
    assert "step [/oops]" in text and f"root cause: {SHOWN}" in text and f"cluster: {SHOWN}" in text
    assert f"unreachable ({SHOWN})" in text
    assert "restart 1 after: node b lost" in text and f"restart 2 after: {SHOWN}" in text   # the attempts


def test_a_ranks_last_record_that_is_not_a_step_shows_its_event(private_state_dir):
    """Issue 52: a rank whose last record was its finish showed "time 1.797e+09 · rank 0 · group 0"."""
    finish = {"time": 1.797e9, "rank": 0, "group": 0, "event": "finish", "samples": 1920, "steps": 60}
    live = JobLive("hg-1", (NodeLive("a", NodeJobState.RUNNING, True, ranks=(
        LiveRank(0, RankState.SUCCEEDED, metrics=finish),)),), checked_at=0.0)
    console, out = _terminal()
    render_job(JobStatus(_record(), live), console)
    text = out.getvalue()
    assert "finish · samples 1920 · steps 60" in text and "1.797e+09" not in text


def test_probe_stop_and_plan_tables_show_node_strings_literally():
    console, out = _terminal()
    render_inventory(Inventory(cluster="x", nodes=(
        NodeInfo(name=HOSTILE, host=HOSTILE, ok=True, cpu_model=HOSTILE, os=HOSTILE,
                 gpus=(GpuInfo(index=0, name=HOSTILE, memory_total_mib=1),)),
        NodeInfo(name="bad", host="b", ok=False, error=HOSTILE))), console)
    render_stop(StopResult(_record(), (NodeStop(HOSTILE, False, agent=HOSTILE, error=HOSTILE),)), console)
    render_plan(_plan(), console)
    text = out.getvalue()
    assert "\x1b]52" not in text and "\x1b[2J" not in text and "\x07" not in text
    assert text.count("[/oops]") >= 9   # probe: name, GPU, CPU, OS, error; stop: node, agent, detail; plan


@pytest.mark.parametrize("argv, hint", [
    (["launch", "--restart", "1", "--", "true"], "did you mean --restarts?"),
    (["launch", "--envv", "A=1", "true"], "did you mean --env?"),
    (["launch", "-q", "--", "true"], "no such option: -q;"),
])
def test_launch_refuses_an_option_like_command_not_after_the_separator(argv, hint, capsys, private_state_dir):
    from hgcli.cli import main

    assert main(argv) == 2   # before any probe, bench, plan or node contact
    err = capsys.readouterr().err
    assert hint in err and "goes after '--'" in err and err.count("\n") == 1
