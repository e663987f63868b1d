"""`hgtrain launch` over real sshd test hosts (tests/sshhosts.py): 3 hosts on 127.0.0.11-13.

The hosts share this machine, so the process table checked by the job marker covers every host; each
host has its own HOME, so its agents' job directories and the shipped package are its own.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys

import pytest

from hgcli.launch.spec import unforwarded_names
from hgcli.schema.stages import Cluster
from tests.agent.harness import rank_pids, job_pids, wait_until

from .hg import assert_not_in_any_cmdline, cluster_toml, text_under
from .plans import make_plan, plan_file

pytestmark = pytest.mark.sshd
PY = sys.executable


@pytest.fixture
def cluster(hosts) -> Cluster:
    nodes = tuple(dataclasses.replace(n, python=PY) for n in hosts.nodes())
    return Cluster(nodes=nodes, ssh=hosts.ssh_settings())


def files(tmp_path, hosts, cluster, groups, ps=()):
    plan = make_plan(cluster, groups, ps=ps, predicted=50.0)
    return (cluster_toml(tmp_path / "cluster.toml", cluster, known_hosts=str(hosts.known_hosts)),
            plan_file(tmp_path, plan), plan)


def sessions(hosts) -> int:
    """sshd processes besides the listeners: open sessions (a leftover agent would keep one)."""
    return len(hosts.leftover_pids()) - len(hosts.hosts)


HELLO = """
import json, os, sys, time
from datetime import timedelta
print(json.dumps({k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'HOME')}))
print(json.dumps(sys.argv[1:]))
# rank 0's agent serves the job's store at MASTER_ADDR: every rank, on every host, reaches it there as a
# torch.distributed client does. Rank 0 stays until all have (as a rendezvous keeps it): its node's
# agent, and with it the store, ends when its last rank does.
from torch.distributed import TCPStore
store = TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False,
                 timeout=timedelta(seconds=60))
store.add('reached', 1)
print('reached the store')
while os.environ['RANK'] == '0' and store.add('reached', 0) < int(os.environ['WORLD_SIZE']):
    time.sleep(0.05)
"""

ARGS = ["$HOME", "a b", "it's", 'say "hi"', "; echo pwned", "`id`", "$(id)", "*", "x\ny", "\\", ""]


def test_job_across_three_hosts_runs_to_completion_and_args_arrive_literally(hosts, cluster, hg, tmp_path):
    ctoml, pfile, plan = files(tmp_path, hosts, cluster, [["host1", "host2"], ["host3", "host3"]])
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--json", "--", PY, "-c", HELLO, *ARGS)
    assert code == 0, err + out[-3000:]
    events = [json.loads(line) for line in out.splitlines()]
    assert events[-1]["state"] == "succeeded"
    logs = [e for e in events if e["event"] == "log"]
    seen = {}
    for e in logs:
        if e["line"].startswith("{"):
            seen[e["rank"]] = (e["node"], json.loads(e["line"]))
    assert {r: node for r, (node, _) in seen.items()} == {0: "host1", 1: "host2", 2: "host3", 3: "host3"}
    for rank, (node, env) in seen.items():
        assert env["MASTER_ADDR"] == hosts[0].address                   # rank 0's host as the others reach it
        assert env["HOME"] == str(hosts[int(node[-1]) - 1].home)          # it really ran on that host
    assert [e["rank"] for e in logs if e["line"] == "reached the store"].count(0) == 1
    assert sorted(e["rank"] for e in logs if e["line"] == "reached the store") == [0, 1, 2, 3]
    for rank in range(4):
        argv_line = [e["line"] for e in logs if e["rank"] == rank and e["line"].startswith("[")]
        assert json.loads(argv_line[0]) == ARGS
    assert sessions(hosts) == 0


FAIL = """
import os, sys, time
if os.environ['RANK'] == '3':
    time.sleep(1)
    print('host3 gives up', file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(600)
"""


def test_rank_exit_3_on_one_host_stops_every_host(hosts, cluster, hg, tmp_path):
    ctoml, pfile, _ = files(tmp_path, hosts, cluster, [["host1", "host2"], ["host3", "host3"]])
    run = hg.start("-c", str(ctoml), "--plan", str(pfile), "--grace", "2", "--", PY, "-c", FAIL)
    assert run.finish() == 3, run.stderr
    cause = next(line for line in run.stderr.splitlines() if "root cause" in line)
    assert "host3:3 exited with code 3" in cause
    assert "host3 gives up" in run.stderr.split(cause)[1]
    assert job_pids(hg.job_ids()[0]) == []
    wait_until(lambda: sessions(hosts) == 0, what="the ssh sessions to close")


def test_sigint_and_controller_sigkill_leave_nothing_on_any_host(hosts, cluster, hg, tmp_path):
    ctoml, pfile, _ = files(tmp_path, hosts, cluster, [["host1", "host2", "host3"]])
    run = hg.start("-c", str(ctoml), "--plan", str(pfile), "--grace", "2", "--json", "--",
                   PY, "-c", "import time; time.sleep(600)")
    run.wait_all_started(3)
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 130, run.stderr
    assert job_pids(run.job_id) == []
    # the controller killed outright: sshd closes the sessions, each agent sees EOF and stops its ranks
    run = hg.start("-c", str(ctoml), "--plan", str(pfile), "--grace", "2", "--json", "--",
                   PY, "-c", "import time; time.sleep(600)")
    run.wait_all_started(3)
    job_id = run.job_id
    run.proc.kill()
    run.finish()
    wait_until(lambda: job_pids(job_id) == [], what="the agents to stop their ranks")
    wait_until(lambda: sessions(hosts) == 0, what="the ssh sessions to close")


def test_two_detached_jobs_on_the_same_hosts_stop_independently(hosts, cluster, hg, tmp_path):
    ctoml, pfile, _ = files(tmp_path, hosts, cluster, [["host1", "host2", "host3"]])
    jobs = []
    for _ in range(2):
        code, out, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--detach", "--json", "--grace", "2",
                                "--", PY, "-c", "import time; time.sleep(600)")
        assert code == 0, err
        jobs.append(json.loads(out.splitlines()[-1])["job_id"])
    for job_id in jobs:
        wait_until(lambda: len(rank_pids(job_id)) == 3, what="the detached ranks")
    from hgcli.remote.fanout import open_transport
    from hgcli.remote.transport import node_module_argv

    def stop(job_id: str) -> None:
        for node in cluster.nodes:
            with open_transport(node, cluster) as t:
                argv, env = node_module_argv(t, "agent", "--stop", job_id)
                assert t.run(argv, env=env, timeout=120).exit_code == 0

    stop(jobs[0])
    assert job_pids(jobs[0]) == [] and len(rank_pids(jobs[1])) == 3
    stop(jobs[1])
    assert job_pids(jobs[1]) == []


def test_secret_values_stay_off_remote_command_lines_and_files(hosts, cluster, hg, tmp_path):
    ctoml, pfile, _ = files(tmp_path, hosts, cluster, [["host1", "host2"]])
    secret = "tok-" + os.urandom(8).hex()
    (tmp_path / "s.env").write_text(f"HF_TOKEN={secret}\n")
    script = ("import os, time; assert os.environ['HF_TOKEN'].startswith('tok-'); print('ok', flush=True); "
              "time.sleep(600)")
    run = hg.start("-c", str(ctoml), "--plan", str(pfile), "--env-file", str(tmp_path / "s.env"), "--grace", "2",
                   "--json", "--", PY, "-c", script)
    run.wait_event(lambda ev: sum(e["event"] == "log" and e["line"] == "ok" for e in ev) == 2)
    assert_not_in_any_cmdline(secret)   # the sshd sessions' commands included
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 130
    (tmp_path / "s.env").unlink()
    seen = "\n".join(run.lines) + run.stderr + text_under(hg.state_dir, hg.home, *(h.dir for h in hosts.hosts))
    assert "ok" in seen and secret not in seen


def test_bare_env_name_forwards_the_local_value_and_the_rest_is_named_once(hosts, cluster, hg, tmp_path):
    """A variable exported here reaches SSH nodes only when named (``--env NAME``, as docker's -e);
    the relevant ones that do not are named once, after job_started, values never shown."""
    ctoml, pfile, _ = files(tmp_path, hosts, cluster, [["host1", "host2"]])
    script = "import os; print(os.environ.get('ACCELERATE_USE_CPU'), os.environ.get('WANDB_MODE'))"
    env = {k: v for k, v in hg.env().items() if k not in unforwarded_names(os.environ, {})}   # only ours
    env.update(ACCELERATE_USE_CPU="1", WANDB_MODE="offline-value")
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--env", "ACCELERATE_USE_CPU", "--json", "--",
                            PY, "-c", script, env=env)
    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    assert sorted(e["line"] for e in events if e["event"] == "log") == ["1 None", "1 None"]
    notices = [e["message"] for e in events if e["event"] == "notice"]
    assert notices == ["environment of the ranks on host1, host2: set here but not forwarded: WANDB_MODE "
                       "(forward one with --env NAME)"]
    assert [e["event"] for e in events].index("notice") == [e["event"] for e in events].index("job_started") + 1
    assert "offline-value" not in out + err


def test_a_node_whose_agent_cannot_start_fails_the_launch_with_6_naming_it(hg, tmp_path, hosts, cluster):
    """The agent itself prepares the node (plan file, port): a node where it cannot even start (no such
    Python) is named with the reason, exit 6, and the agents of the other nodes leave nothing."""
    broken = Cluster(nodes=tuple(dataclasses.replace(n, python="/nonexistent/python3") if n.name == "host2" else n
                                 for n in cluster.nodes), ssh=cluster.ssh)
    ctoml, plan, _ = files(tmp_path, hosts, broken, [["host1", "host2"]])
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(plan), "--", PY, "-c", "import time; time.sleep(60)")
    assert code == 6, err
    assert "node host2" in err and "/nonexistent/python3" in err and "not found" in err, err
    (job_id,) = hg.job_ids()
    wait_until(lambda: not job_pids(job_id) and sessions(hosts) == 0, what="host1's agent to leave")
