"""`hgtrain logs` of a job that `launch --restarts` restarted: the current attempt's agents are read,
and a follow started during attempt 0 moves on to attempt 1 (real launch, real agents, local node)."""
from __future__ import annotations

import subprocess
import sys

from hgcli.state.records import attempt_job_id
from tests.agent.harness import job_pids
from tests.launch.hg import WAIT_S, cluster_toml
from tests.launch.plans import local_cluster, make_plan, plan_file
from tests.ops.test_logs_follow import Follow

PY = sys.executable
# Says which attempt it is, waits for its gate file (argv[1] + attempt), then attempt 0 fails (exit 3,
# so --restarts 1 starts attempt 1) and attempt 1 succeeds.
ATTEMPTS = ("import os, sys, time\n"
            "attempt = 1 if os.environ['HGTRAIN_JOB_ID'].endswith('-r1') else 0\n"
            "print(f'attempt {attempt} up', flush=True)\n"
            "while not os.path.exists(sys.argv[1] + str(attempt)):\n"
            "    time.sleep(0.05)\n"
            "print(f'attempt {attempt} done', flush=True)\n"
            "sys.exit(3 if attempt == 0 else 0)\n")


def logs(hg, job: str) -> list[str]:
    done = subprocess.run([PY, "-m", "hgcli", "logs", job], capture_output=True, text=True, env=hg.env(),
                          cwd=hg.tmp_path, timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_logs_follow_the_current_attempt_and_move_on_to_the_next(hg, tmp_path):
    cluster = local_cluster(("a",))
    ctoml = cluster_toml(tmp_path / "cluster.toml", cluster)
    plan = plan_file(tmp_path, make_plan(cluster, [["a"]]))
    gate = tmp_path / "gate"
    run = hg.start("-c", str(ctoml), "--plan", str(plan), "--json", "--grace", "2", "--restarts", "1",
                   "--", PY, "-u", "-c", ATTEMPTS, str(gate))
    job = run.job_id
    try:
        run.wait_event(lambda ev: any(e.get("line") == "attempt 0 up" for e in ev))
        during_0 = Follow(job, env=hg.env(), cwd=hg.tmp_path)
        during_0.wait_for(1)
        (tmp_path / "gate0").touch()
        run.wait_event(lambda ev: any(e.get("line") == "attempt 1 up" for e in ev))
        during_1 = Follow(job, env=hg.env(), cwd=hg.tmp_path)
        during_1.wait_for(1)
    finally:
        (tmp_path / "gate1").touch()
    assert run.finish() == 0, run.stderr
    assert during_0.finish()[0] == 0 and during_1.finish()[0] == 0
    # attempt 0's node-local lines, then attempt 1's from its start: nothing twice, nothing missing
    assert during_0.lines == ["a:0| attempt 0 up", "a:0| attempt 0 done", "a:0| attempt 1 up", "a:0| attempt 1 done"]
    # a follow begun during attempt 1 reads attempt 1's agents, not attempt 0's
    assert during_1.lines == ["a:0| attempt 1 up", "a:0| attempt 1 done"]
    # plain logs: the controller's copy holds every attempt; without it, the nodes' current attempt
    assert logs(hg, job) == ["a:0| attempt 0 up", "a:0| attempt 0 done", "a:0| attempt 1 up", "a:0| attempt 1 done"]
    (hg.job_dir(job) / "rank0.log").unlink()
    assert logs(hg, job) == ["a:0| attempt 1 up", "a:0| attempt 1 done"]
    assert not job_pids(job) and not job_pids(attempt_job_id(job, 1))
