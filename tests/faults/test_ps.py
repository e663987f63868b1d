"""The parameter-server rank SIGKILLed under `hgtrain launch`, mid-training: the job fails naming the
PS rank as the root cause (not a worker that lost it), and nothing is left running. (Checkpoints
written by the PS and their survival of a kill during the write: tests/runtime/test_faults.py.)"""
from __future__ import annotations

import os
import signal
import sys

import pytest

from tests.agent.harness import job_pids
from tests.launch.hg import cluster_toml
from tests.launch.plans import local_cluster, make_plan, plan_file

pytestmark = pytest.mark.slow
PY = sys.executable


def test_ps_killed_under_launch_fails_the_job_naming_the_ps_rank(hg, tmp_path):
    cluster = local_cluster(("a", "b"))
    plan = make_plan(cluster, [["a"], ["b"]], ps=["b"], batch=32, speeds=[1.0, 0.5])
    ctoml = cluster_toml(tmp_path / "cluster.toml", cluster)
    run = hg.start("-c", str(ctoml), "--plan", str(plan_file(tmp_path, plan)), "--json", "--grace", "3",
                   "--", PY, "-m", "hgcli.examples.train_mlp", "--epochs", "50")
    pids = run.wait_all_started(3)
    run.wait_event(lambda ev: sum(e["event"] == "metric" and e["data"].get("event") == "ps_push" for e in ev) >= 3)
    os.kill(pids[2], signal.SIGKILL)         # rank 2 is the PS (workers first, then PS ranks)
    assert run.finish(timeout=180) == 137, run.stderr
    events = run.events()
    cause = events[-1]["root_cause"]
    assert (cause["node"], cause["rank"], cause["signal"]) == ("b", 2, "SIGKILL"), cause
    roles = {e["rank"]: e["role"] for e in events if e["event"] == "rank_started"}
    assert roles[2] == "ps"
    states = {r["rank"]: r["state"] for r in hg.record(run.job_id)["ranks"]}
    assert states[2] == "failed" and states[0] in ("failed", "stopped") and states[1] in ("failed", "stopped")
    assert job_pids(run.job_id) == []
