"""A link to one node cut mid-job: the node's sshd runs in a network namespace of its own, reached
over a veth pair this test makes (10.231.x.0/30, only on those veths) and removes afterwards.

Cutting the link (both ends down) makes the node silent without any FIN or RST, as a pulled cable
or a dead switch port does: hgtrain must give the node up within ``--heartbeat-timeout``, name it,
stop the other node, and the cut node's agent must stop its ranks by itself when the controller's
heartbeats stop arriving. Under ``--restarts 1`` the job is started again once the link is back
(a lost node gets one heartbeat timeout to become reachable), or fails naming the node (exit 6) when
it is still cut.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time

import pytest

from hgcli.schema.stages import Cluster
from hgcli.state.records import attempt_job_id
from tests.agent.harness import job_pids, wait_until
from tests.conftest import require_sshd
from tests.launch.hg import cluster_toml
from tests.launch.plans import make_plan, plan_file
from tests.sshhosts import start_hosts

pytestmark = [pytest.mark.sshd, pytest.mark.slow]
PY = sys.executable

SLEEPER = """
import os, time
print('rank', os.environ['RANK'], 'up', flush=True)
time.sleep(600)
"""


def _need_netns() -> None:
    why = None
    if os.geteuid() != 0:
        why = "network namespaces need root"
    elif shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        why = "'ip netns' is not available"
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why + " (CI runs as root and must run this test)")
        pytest.skip(why)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def cut_link():
    """(namespace, its address, cut(), mend()): a veth pair between here and a fresh namespace."""
    _need_netns()
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"hgfault{tag}", f"hgf{tag}a", f"hgf{tag}b"
    subnet = f"10.231.{os.getpid() % 250}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{subnet}.1/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", ns, "addr", "add", f"{subnet}.2/30", "dev", there)
        _ip("-n", ns, "link", "set", there, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

        def cut() -> None:
            _ip("link", "set", here, "down")
            _ip("-n", ns, "link", "set", there, "down")

        def mend() -> None:
            _ip("link", "set", here, "up")
            _ip("-n", ns, "link", "set", there, "up")

        yield ns, f"{subnet}.2", cut, mend
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_cut_link_fails_the_job_naming_the_node_and_leaves_nothing(tmp_path, hg, cut_link):
    require_sshd()
    ns, address, cut, _ = cut_link
    hosts = start_hosts(tmp_path / "hosts", 2, first=61, namespaced={1: (ns, address)})
    try:
        nodes = tuple(dataclasses.replace(n, python=PY) for n in hosts.nodes())
        cluster = Cluster(nodes=nodes, ssh=hosts.ssh_settings(connect_timeout=5.0))
        plan = make_plan(cluster, [["host1", "host2"]])     # rank 0 on host1, rank 1 behind the link
        ctoml = cluster_toml(tmp_path / "cluster.toml", cluster, known_hosts=str(hosts.known_hosts))
        run = hg.start("-c", str(ctoml), "--plan", str(plan_file(tmp_path, plan)), "--json", "--grace", "1",
                       "--heartbeat-timeout", "6", "--", PY, "-c", SLEEPER)
        run.wait_all_started(2)
        job_id = run.job_id
        run.wait_event(lambda ev: {e["rank"] for e in ev if e["event"] == "log"} == {0, 1})
        cut()
        cut_at = time.monotonic()
        code = run.finish()
        failed_after = time.monotonic() - cut_at
        assert code == 4, run.stderr
        ended = run.events()[-1]
        assert ended["event"] == "job_ended" and ended["state"] == "failed"
        cause = ended["root_cause"]
        assert cause["node"] == "host2" and cause["rank"] is None, cause
        assert "nothing heard from its agent" in cause["reason"], cause
        # Within the heartbeat timeout, plus the bounded stop of the other node (grace 1 s) and the
        # bounded attempt to reach the cut node again (it fails at once: no route any more).
        assert failed_after < 6 + 30, failed_after
        # The cut node's agent stops its rank by itself once the heartbeats stop; host1's was stopped.
        wait_until(lambda: job_pids(job_id) == [], timeout=60, what="every rank on both hosts to be gone")
        record = hg.record(job_id)
        assert record["state"] == "failed" and "host2" in record["root_cause"]
    finally:
        hosts.stop()
    assert not hosts.leftover_pids()


# Attempt 0 sleeps until the link is cut; the restarted attempt (job id ``...-r1``) ends at once, well.
SLEEP_THEN_SUCCEED = """
import os, sys, time
print('rank', os.environ['RANK'], 'up in', os.environ['HGTRAIN_JOB_ID'], flush=True)
if os.environ['HGTRAIN_JOB_ID'].endswith('-r1'):
    sys.exit(0)
time.sleep(600)
"""


def _restartable_job(tmp_path, hg, address, ns):
    require_sshd()
    hosts = start_hosts(tmp_path / "hosts", 2, first=63, namespaced={1: (ns, address)})
    nodes = tuple(dataclasses.replace(n, python=PY) for n in hosts.nodes())
    cluster = Cluster(nodes=nodes, ssh=hosts.ssh_settings(connect_timeout=5.0))
    plan = make_plan(cluster, [["host1", "host2"]])
    ctoml = cluster_toml(tmp_path / "cluster.toml", cluster, known_hosts=str(hosts.known_hosts))
    run = hg.start("-c", str(ctoml), "--plan", str(plan_file(tmp_path, plan)), "--json", "--grace", "1",
                   "--heartbeat-timeout", "6", "--restarts", "1", "--", PY, "-c", SLEEP_THEN_SUCCEED)
    return hosts, run


def _cut_once_running(run, cut) -> None:
    run.wait_all_started(2)
    run.wait_event(lambda ev: {e["rank"] for e in ev if e["event"] == "log"} == {0, 1})
    cut()


def _no_process_of_any_attempt(job_id: str) -> None:
    wait_until(lambda: job_pids(job_id) + job_pids(attempt_job_id(job_id, 1)) == [], timeout=60,
               what="every rank of both attempts on both hosts to be gone")


def test_cut_link_under_restarts_restarts_the_job_once_the_link_is_back(tmp_path, hg, cut_link):
    ns, address, cut, mend = cut_link
    hosts, run = _restartable_job(tmp_path, hg, address, ns)
    try:
        _cut_once_running(run, cut)
        run.wait_event(lambda ev: any(e["event"] == "stopping" for e in ev))
        mend()   # within the heartbeat timeout the restart waits for the lost node
        assert run.finish(timeout=180) == 0, run.stderr
        events = run.events()
        restarted = [e for e in events if e["event"] == "job_restarted"]
        assert len(restarted) == 1 and "node host2" in restarted[0]["reason"], restarted
        assert "nothing heard from its agent" in restarted[0]["reason"], restarted
        assert sum(e["event"] == "rank_started" for e in events) == 4   # both attempts, both hosts
        record = hg.record(run.job_id)
        assert record["state"] == "succeeded" and record["restarts"] == [restarted[0]["reason"]]
        _no_process_of_any_attempt(run.job_id)
    finally:
        hosts.stop()
    assert not hosts.leftover_pids()


def test_cut_link_still_down_at_restart_fails_naming_the_node(tmp_path, hg, cut_link):
    ns, address, cut, _ = cut_link
    hosts, run = _restartable_job(tmp_path, hg, address, ns)
    try:
        _cut_once_running(run, cut)
        cut_at = time.monotonic()
        assert run.finish(timeout=180) == 6, run.stderr   # the restart could not start there
        failed_after = time.monotonic() - cut_at
        events = run.events()
        assert sum(e["event"] == "job_restarted" for e in events) == 1
        cause = events[-1]["root_cause"]
        assert cause["node"] == "host2" and cause["rank"] is None, cause
        assert "cannot restart the job (restart 1) there" in cause["reason"] and address in cause["reason"], cause
        # heartbeat timeout, the stop of host1, then one more heartbeat timeout of tries to reach host2
        assert failed_after < 6 + 30 + 6 + 30, failed_after
        record = hg.record(run.job_id)
        assert record["state"] == "failed" and record["exit_code"] == 6 and len(record["restarts"]) == 1
        assert "host2" in record["root_cause"]
        # attempt 1 started nothing on host1 (it stops at preparing every node); host2's agent of
        # attempt 0 stopped its rank by itself
        assert sum(e["event"] == "rank_started" for e in events) == 2
        _no_process_of_any_attempt(run.job_id)
    finally:
        hosts.stop()
    assert not hosts.leftover_pids()
