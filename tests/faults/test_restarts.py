"""`hgtrain launch --restarts N` with real agents and ranks killed for real (local nodes).

A rank killed once: the whole job is started again, the PS resumes from its last complete checkpoint
and the job succeeds. A rank that always fails: N + 1 attempts, then its exit code. `hgtrain status`
and `hgtrain stop` reach the restarted attempt; Ctrl-C during a restarted job still stops everything.
Each test ends with no process carrying the marker of any attempt's job id.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hgcli.state.records import attempt_job_id
from hgcli.schema.stages import Cluster
from tests.agent.harness import rank_pids, job_pids
from tests.launch.hg import WAIT_S, cluster_toml
from tests.launch.plans import local_cluster, make_plan, plan_file

pytestmark = pytest.mark.slow
PY = sys.executable
# A rank command that fails (exit 3) on rank 1 in the first attempt only, or always with ALWAYS=1;
# every other rank sleeps until it is stopped.
FLAKY = ("import os, sys, time\n"
         "first = not os.environ['HGTRAIN_JOB_ID'].endswith(('-r1', '-r2', '-r3'))\n"
         "if os.environ['RANK'] == '1' and (first or os.environ.get('ALWAYS') == '1'):\n"
         "    time.sleep(0.5); print('rank 1 gives up', flush=True); sys.exit(3)\n"
         "time.sleep(float(os.environ.get('SLEEP', '300')))\n")


def attempt_pids(job_id: str, attempts: int = 4) -> list[int]:
    return [pid for n in range(attempts) for pid in job_pids(attempt_job_id(job_id, n))]


def cli(hg, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "hgcli", *args], capture_output=True, text=True, env=hg.env(),
                          cwd=hg.tmp_path, timeout=WAIT_S)


def two_nodes(tmp_path, *, ps: bool):
    cluster = local_cluster(("a", "b"))
    plan = (make_plan(cluster, [["a"], ["b"]], ps=["b"], batch=32, speeds=[1.0, 0.5]) if ps
            else make_plan(cluster, [["a", "b"]]))
    return str(cluster_toml(tmp_path / "cluster.toml", cluster)), str(plan_file(tmp_path, plan))


def test_worker_killed_once_restarts_and_the_ps_resumes_from_its_checkpoint(hg, tmp_path):
    ctoml, plan = two_nodes(tmp_path, ps=True)
    run = hg.start("-c", ctoml, "--plan", plan, "--json", "--grace", "3", "--restarts", "1",
                   "--checkpoint-every", "5", "--", PY, "-m", "hgcli.examples.train_mlp", "--epochs", "1",
                   "--max-steps", "200")
    pids = run.wait_all_started(3)
    ckpt = hg.node_dir(run.job_id, "b") / "ps-checkpoint"
    deadline = time.monotonic() + WAIT_S
    while not list(ckpt.glob("shard0-v*.pt")):
        assert time.monotonic() < deadline and run.proc.poll() is None, (run.stderr, run.lines[-5:])
        time.sleep(0.1)
    os.kill(pids[0], signal.SIGKILL)
    assert run.finish(timeout=300) == 0, run.stderr
    events = run.events()
    restarted = [e for e in events if e["event"] == "job_restarted"]
    assert len(restarted) == 1 and restarted[0]["attempt"] == 1 and restarted[0]["resume"] is True
    assert restarted[0]["job_id"] == run.job_id and "a:0" in restarted[0]["reason"]
    assert "SIGKILL" in restarted[0]["reason"] or "137" in restarted[0]["reason"], restarted
    record = hg.record(run.job_id)
    assert record["state"] == "succeeded" and record["exit_code"] == 0
    assert record["restarts"] == [restarted[0]["reason"]]
    assert events[-1]["event"] == "job_ended" and events[-1]["exit_code"] == 0
    # The restarted PS (rank 2) resumed from a real checkpoint version, present on disk.
    resumed = re.findall(r"resumed from checkpoint version (\d+)", (hg.job_dir(run.job_id) / "rank2.log").read_text())
    assert resumed and int(resumed[0]) >= 5, (hg.job_dir(run.job_id) / "rank2.log").read_text()[-2000:]
    assert attempt_pids(run.job_id) == []


def test_rank_that_always_fails_gets_n_plus_one_attempts_then_its_exit_code(hg, tmp_path):
    ctoml, plan = two_nodes(tmp_path, ps=False)
    code, out, err = hg.run("-c", ctoml, "--plan", plan, "--json", "--grace", "2", "--restarts", "2",
                            "--", PY, "-c", FLAKY, env=hg.env(ALWAYS="1"), timeout=300)
    assert code == 3, err
    events = [json.loads(line) for line in out.splitlines()]
    job_id = events[-1]["job_id"]
    assert [e["attempt"] for e in events if e["event"] == "job_restarted"] == [1, 2]
    assert all(e["resume"] is False for e in events if e["event"] == "job_restarted")
    assert sum(e["event"] == "rank_started" for e in events) == 6   # 3 attempts x 2 ranks
    record = hg.record(job_id)
    assert record["state"] == "failed" and record["exit_code"] == 3 and len(record["restarts"]) == 2
    assert all("b:1" in reason and "3" in reason for reason in record["restarts"]), record["restarts"]
    assert attempt_pids(job_id) == []
    # The human view says a job without a PS starts again from scratch.
    code, _, err = hg.run("-c", ctoml, "--plan", plan, "--grace", "2", "--restarts", "1",
                          "--", PY, "-c", FLAKY, env=hg.env(ALWAYS="1"), timeout=300)
    assert code == 3 and "restart 1 of job" in err and "from scratch" in err, err


def test_status_and_stop_reach_the_restarted_attempt(hg, tmp_path):
    ctoml, plan = two_nodes(tmp_path, ps=False)
    run = hg.start("-c", ctoml, "--plan", plan, "--json", "--grace", "2", "--restarts", "3",
                   "--", PY, "-c", FLAKY)
    run.wait_event(lambda ev: sum(e["event"] == "rank_started" for e in ev) == 4)   # attempt 1 running
    job_id = run.job_id
    status = cli(hg, "status", job_id, "--json")
    assert status.returncode == 0, status.stderr
    data = json.loads(status.stdout)
    assert len(data["restarts"]) == 1 and [n["state"] for n in data["live"]["nodes"]] == ["running"] * 2, data
    assert len(rank_pids(attempt_job_id(job_id, 1))) == 2
    stop = cli(hg, "stop", job_id, "--json")
    assert stop.returncode == 0, stop.stderr
    assert run.finish(timeout=WAIT_S) == 143           # the user's stop, as a SIGTERM to the launcher
    assert sum(e["event"] == "job_restarted" for e in run.events()) == 1   # a stop is not restarted
    assert attempt_pids(job_id) == []
    assert hg.record(job_id)["state"] == "stopped"
    ended = run.events()[-1]
    assert ended["event"] == "job_ended" and ended["state"] == "stopped" and ended["root_cause"] is None


def test_an_agent_sent_sigterm_by_its_node_is_a_lost_node_and_restarts(hg, tmp_path):
    """A SIGTERM that is not 'hgtrain stop' (a node shutting down): the agent stops its ranks, and the
    job restarts as after a lost node, unlike the stop above."""
    ctoml, plan = two_nodes(tmp_path, ps=False)
    run = hg.start("-c", ctoml, "--plan", plan, "--json", "--grace", "2", "--restarts", "1",
                   "--env", "SLEEP=300", "--", PY, "-c", "import time; time.sleep(300)")
    run.wait_all_started(2)
    agent = json.loads((hg.node_dir(run.job_id, "b") / "agent.json").read_text())["agent"]["pid"]
    os.kill(agent, signal.SIGTERM)
    run.wait_event(lambda ev: any(e["event"] == "job_restarted" for e in ev))
    reason = next(e for e in run.events() if e["event"] == "job_restarted")["reason"]
    assert "node b" in reason and "the agent received SIGTERM" in reason, reason
    cli(hg, "stop", run.job_id, "--json")
    run.finish(timeout=WAIT_S)
    assert sum(e["event"] == "job_restarted" for e in run.events()) == 1
    assert attempt_pids(run.job_id) == []


def test_ctrl_c_after_a_restart_stops_everything_with_130(hg, tmp_path):
    ctoml, plan = two_nodes(tmp_path, ps=False)
    run = hg.start("-c", ctoml, "--plan", plan, "--json", "--grace", "2", "--restarts", "3",
                   "--", PY, "-c", FLAKY)
    run.wait_event(lambda ev: sum(e["event"] == "rank_started" for e in ev) == 4)
    run.proc.send_signal(signal.SIGINT)
    assert run.finish(timeout=WAIT_S) == 130, run.stderr
    assert sum(e["event"] == "job_restarted" for e in run.events()) == 1
    assert attempt_pids(run.job_id) == []


@pytest.mark.sshd
def test_restart_over_sshd_hosts_gets_fresh_agent_dirs_and_completes(hg, tmp_path, hosts):
    cluster = Cluster(nodes=tuple(dataclasses.replace(n, python=PY) for n in hosts.nodes()[:2]),
                      ssh=hosts.ssh_settings())
    ctoml = cluster_toml(tmp_path / "cluster.toml", cluster, known_hosts=str(hosts.known_hosts))
    plan = plan_file(tmp_path, make_plan(cluster, [[n.name for n in cluster.nodes]]))
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(plan), "--json", "--grace", "2", "--restarts", "1",
                            "--env", "SLEEP=3", "--", PY, "-c", FLAKY, timeout=300)
    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    job_id = events[-1]["job_id"]
    second = cluster.nodes[1].name
    assert hg.record(job_id)["restarts"] == [e["reason"] for e in events if e["event"] == "job_restarted"]
    assert len(hg.record(job_id)["restarts"]) == 1 and f"{second}:1" in hg.record(job_id)["restarts"][0]
    for host, node in zip(hosts.hosts[:2], cluster.nodes):   # each attempt has its own agent directory
        for attempt in (0, 1):
            assert (host.home / ".cache/hgtrain/jobs" / attempt_job_id(job_id, attempt) / node.name
                    / "agent.json").is_file()
    stop = cli(hg, "stop", job_id, "--json")                   # after the end: reaches attempt 1, nothing left
    assert stop.returncode == 0, stop.stderr
    assert attempt_pids(job_id) == []


def _wait_for_checkpoints(run, dirs_and_shards) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(list(d.glob(f"shard{s}-v*.pt")) for d, s in dirs_and_shards):
        assert time.monotonic() < deadline and run.proc.poll() is None, (run.stderr, run.lines[-5:])
        time.sleep(0.1)


def test_agent_killed_under_restarts_restarts_the_job_and_the_ps_resumes(hg, tmp_path):
    """Node b (a worker and the PS) loses its agent: the node is lost, what the agent left is stopped
    over a fresh command, and the job starts again with the PS resuming from its checkpoint."""
    ctoml, plan = two_nodes(tmp_path, ps=True)
    run = hg.start("-c", ctoml, "--plan", plan, "--json", "--grace", "3", "--heartbeat-timeout", "10",
                   "--restarts", "1", "--checkpoint-every", "5", "--", PY, "-m", "hgcli.examples.train_mlp",
                   "--epochs", "1", "--max-steps", "200")
    run.wait_all_started(3)
    _wait_for_checkpoints(run, [(hg.node_dir(run.job_id, "b") / "ps-checkpoint", 0)])
    agent = json.loads((hg.node_dir(run.job_id, "b") / "agent.json").read_text())["agent"]["pid"]
    os.kill(agent, signal.SIGKILL)
    assert run.finish(timeout=300) == 0, run.stderr
    events = run.events()
    restarted = [e for e in events if e["event"] == "job_restarted"]
    assert len(restarted) == 1 and restarted[0]["resume"] is True, restarted
    assert "node b" in restarted[0]["reason"] and "lost" in restarted[0]["reason"], restarted
    assert hg.record(run.job_id)["restarts"] == [restarted[0]["reason"]]
    notes = [e for e in events if e["event"] == "notice"]
    assert any(e["node"] == "b" and "stopped what its agent left" in e["message"] for e in notes), notes
    resumed = re.findall(r"resumed from checkpoint version (\d+)", (hg.job_dir(run.job_id) / "rank2.log").read_text())
    assert resumed and int(resumed[0]) >= 5 and int(resumed[0]) % 5 == 0, resumed
    assert attempt_pids(run.job_id) == []


def _push_versions(job_dir, rank: int) -> list[int]:
    lines = (job_dir / "metrics.jsonl").read_text().splitlines()
    return [m["version"] for m in map(json.loads, lines) if m["rank"] == rank and m.get("event") == "ps_push"]


@pytest.mark.sshd
def test_ps_shards_on_two_sshd_hosts_resume_the_newest_version_both_have(hg, tmp_path, hosts):
    """Shard 0 on one host, shard 1 on another, each writing its own files: the restart resumes both
    from the same version, the newest that both hosts have, and training continues from it."""
    cluster = Cluster(nodes=tuple(dataclasses.replace(n, python=PY) for n in hosts.nodes()[:2]),
                      ssh=hosts.ssh_settings())
    first, second = (n.name for n in cluster.nodes)
    ctoml = cluster_toml(tmp_path / "cluster.toml", cluster, known_hosts=str(hosts.known_hosts))
    plan = plan_file(tmp_path, make_plan(cluster, [[first], [second]], ps=[first, second], batch=32))
    run = hg.start("-c", str(ctoml), "--plan", str(plan), "--json", "--grace", "3", "--restarts", "1",
                   "--checkpoint-every", "5", "--", PY, "-m", "hgcli.examples.train_mlp", "--epochs", "1",
                   "--max-steps", "150")
    pids = run.wait_all_started(4)
    ckpt = [hg.node_dir(run.job_id, node.name, home=host.home) / "ps-checkpoint"
            for host, node in zip(hosts.hosts[:2], cluster.nodes)]
    _wait_for_checkpoints(run, [(ckpt[0], 0), (ckpt[1], 1)])
    assert not list(ckpt[0].glob("shard1-*")) and not list(ckpt[1].glob("shard0-*"))   # apart
    os.kill(pids[1], signal.SIGKILL)   # the worker of the second group
    assert run.finish(timeout=300) == 0, run.stderr
    assert len([e for e in run.events() if e["event"] == "job_restarted"]) == 1
    job_dir = hg.job_dir(run.job_id)
    resumed = [re.findall(r"resumed from checkpoint version (\d+)", (job_dir / f"rank{r}.log").read_text())
               for r in (2, 3)]
    assert resumed[0] and resumed[0] == resumed[1], resumed   # both shards, the same version
    version = int(resumed[0][0])
    assert version >= 5 and version % 5 == 0, version
    for rank in (2, 3):
        # attempt 0 went past the checkpoint; attempt 1's first push builds on the resumed version
        # (a fresh start would push version 1)
        pushes = _push_versions(job_dir, rank)
        restart = next((i for i in range(1, len(pushes)) if pushes[i] <= pushes[i - 1]), None)
        if restart is None:
            # attempt 0's last push was the checkpoint itself (the kill came before another one), so
            # the versions run on unbroken; a fresh start would have gone back to 1
            assert pushes[pushes.index(version) + 1] == version + 1, (rank, version, pushes)
        else:
            assert pushes[restart - 1] >= version and pushes[restart] == version + 1, (rank, version, pushes)
    assert attempt_pids(run.job_id) == []
