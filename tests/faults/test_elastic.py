"""`hgtrain launch --nnodes MIN:MAX` on three real sshd hosts, nodes killed for real: a host's sshd
and every process it started are SIGKILLed mid-run (``TestHost.stop``), as a crashed machine would be.

The job re-plans on the hosts left from the stored probe and bench (run once for the module, copied
into each test's state directory), resumes from the training state (the all-reduce snapshots, the PS
checkpoints) and finishes with the script's accuracy. A host that comes back joins at the next
restart; below MIN the job fails naming the hosts; a controller killed while it re-plans leaves no
process behind (the ``hg`` fixture checks every job's processes after each test).
"""
from __future__ import annotations

import json
import dataclasses
import re
import signal
import time
from pathlib import Path

import pytest

from hgcli.schema.stages import Cluster
from tests.conftest import require_sshd
from tests.faults.test_restarts import PY, attempt_pids
from tests.launch.hg import WAIT_S, cluster_toml
from tests.stored import give_stored, probe_and_bench
from tests.sshhosts import start_hosts, stop_at_once

pytestmark = [pytest.mark.slow, pytest.mark.sshd]
TRAIN = ("-m", "hgcli.examples.train_mlp", "--epochs", "12", "--hidden", "256", "--eval-every", "1000")
BENCH_MODEL = "hgcli.examples.models:example@32,64,96"


@pytest.fixture(scope="module")
def elastic_hosts(tmp_path_factory):
    """Three sshd hosts on fixed ports (a host started again keeps its address and port, so the
    cluster file and its stored profiles still describe it), each with one emulated device (speeds
    1, 1 and 0.4), probed and benched once."""
    require_sshd()
    root = tmp_path_factory.mktemp("elastic")
    hosts = start_hosts(root / "hosts", 3, first=71)
    try:
        for host in hosts.hosts:
            host.fixed_port = host.port
        cluster = Cluster(nodes=tuple(dataclasses.replace(n, python=PY) for n in hosts.nodes()),
                          ssh=hosts.ssh_settings())
        ctoml = cluster_toml(root / "cluster.toml", cluster, known_hosts=str(hosts.known_hosts))
        # Two fast devices and a slow one (emulated: the hosts have no GPU), so hybrid has two groups.
        blocks = ctoml.read_text().split("[[nodes]]")
        ctoml.write_text(blocks[0] + "".join(
            f"[[nodes]]{block.rstrip()}\nemulate = {{ devices = [{name!r}], speed = [{speed}], "
            f"memory_mib = [40960] }}\n\n"
            for block, (name, speed) in zip(blocks[1:], (("A100", 1.0), ("A100", 1.0), ("T4", 0.4)))))
        yield hosts, ctoml, probe_and_bench(ctoml, root / "state", "--model", BENCH_MODEL)
    finally:
        hosts.stop()
    assert not hosts.leftover_pids()


@pytest.fixture
def cluster3(elastic_hosts, hg):
    """Every host up, and the module's probe and bench in this test's state directory."""
    hosts, ctoml, benched = elastic_hosts
    for host in hosts.hosts:
        if host.proc is None:
            host.start(hosts.authorized_keys)
    give_stored(benched, hg.state_dir)
    yield hosts, str(ctoml)
    for host in hosts.hosts:     # a test that failed half-way may leave one down
        if host.proc is None:
            host.start(hosts.authorized_keys)


def node_dirs(host, job_id: str) -> list[Path]:
    return list((host.home / ".cache/hgtrain/jobs").glob(f"{job_id}*/{host.name}"))


def wait_for(what, check, run) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline and run.proc.poll() is None, (
            f"{what}: exit {run.proc.poll()}; events {[e['event'] for e in run.events()]}; "
            f"ended {[e.get('root_cause') for e in of(run, 'job_ended')]}")
        time.sleep(0.1)


def snapshots(host, job_id: str) -> list[int]:
    return sorted(int(m.group(1)) for d in node_dirs(host, job_id) for p in d.glob("ps-checkpoint/snapshot-s*.pt")
                  if (m := re.search(r"s(\d+)\.pt$", p.name)))


def final_accuracy(run) -> float:
    lines = [e["line"] for e in run.events() if e["event"] == "log" and "final test accuracy" in e["line"]]
    assert lines, run.lines[-20:]
    return float(re.search(r"final test accuracy ([0-9.]+)", lines[-1]).group(1))


def of(run, name: str) -> list[dict]:
    return [e for e in run.events() if e["event"] == name]


def test_allreduce_loses_rank_0s_node_then_another_and_the_first_comes_back(hg, cluster3):
    """host1 (rank 0 and the job's store) dies: the job goes on on host2 and host3 from the newest
    snapshot. host1 comes back; host3 dies: host1 rejoins, and its rank gets the snapshot it lacks
    from rank 0 of the new plan."""
    hosts, ctoml = cluster3
    run = hg.start("-c", ctoml, "--json", "--grace", "3", "--heartbeat-timeout", "10", "--nnodes", "2:3",
                   "--restarts", "2", "--strategy", "allreduce", "--checkpoint-every", "10", "--", PY, *TRAIN)
    run.wait_all_started(3)
    h1, h2, h3 = hosts.hosts
    wait_for("a snapshot on host2", lambda: snapshots(h2, run.job_id), run)
    h1.stop()
    wait_for("the second attempt's start", lambda: len(of(run, "resumed")) == 1, run)
    first = of(run, "resumed")[0]["step"]
    wait_for("a snapshot of the second attempt", lambda: max(snapshots(h3, run.job_id)) > first, run)
    h1.start(hosts.authorized_keys)
    time.sleep(1.0)
    h3.stop()
    assert run.finish(timeout=300) == 0, run.stderr

    lost = of(run, "node_lost")
    assert [e["node"] for e in lost][:1] == [h1.name] and h3.name in [e["node"] for e in lost], lost
    replanned = of(run, "replanned")
    assert [(e["old_nodes"], e["new_nodes"]) for e in replanned] == [
        ([h1.name, h2.name, h3.name], [h2.name, h3.name]), ([h2.name, h3.name], [h1.name, h2.name])], replanned
    assert f"back {h1.name}" in replanned[1]["reason"] and f"lost {h3.name}" in replanned[1]["reason"]
    restarted = of(run, "job_restarted")
    assert [e["resume_from"] for e in restarted] == ["snapshot", "snapshot"], restarted
    resumed = of(run, "resumed")
    assert len(resumed) == 2 and all(e["step"] > 0 and e["step"] % 10 == 0 for e in resumed), resumed
    assert resumed[1]["step"] > resumed[0]["step"] and all(e["redone"] is not None for e in resumed)
    # host1's own snapshots stopped at its death: its rank took the newest one from rank 0 (host2).
    record = hg.record(run.job_id)
    assert record["state"] == "succeeded" and len(record["restarts"]) == 2
    assert {r["node"] for r in record["plan"]["ranks"]} == {h1.name, h2.name}
    assert final_accuracy(run) >= 0.92
    assert attempt_pids(run.job_id) == []


def test_hybrid_loses_a_worker_node_and_the_ps_resumes_on_its_own_node(hg, cluster3):
    hosts, ctoml = cluster3
    # One PS rank (--ps 1): the cost model may shard the PS over every node, and then no node could
    # be lost with every shard's checkpoints surviving.
    run = hg.start("-c", ctoml, "--json", "--grace", "3", "--heartbeat-timeout", "10", "--nnodes", "2:3",
                   "--restarts", "1", "--strategy", "hybrid", "--ps", "1", "--checkpoint-every", "10",
                   "--", PY, *TRAIN)
    run.wait_event(lambda ev: sum(e["event"] == "rank_started" for e in ev) >= 4)   # 3 workers, the PS
    plan = hg.record(run.job_id)["plan"]
    ps_nodes = [r["node"] for r in plan["ranks"] if r["role"] == "ps"]
    assert len(ps_nodes) == 1, plan["ranks"]
    victim = next(h for h in hosts.hosts if h.name not in ps_nodes)     # the shard's checkpoints survive
    shard_hosts = [next(h for h in hosts.hosts if h.name == n) for n in ps_nodes]
    wait_for("a checkpoint of every PS shard", lambda: all(
        any(list(d.glob(f"ps-checkpoint/shard{i}-v*.pt")) for d in node_dirs(h, run.job_id))
        for i, h in enumerate(shard_hosts)), run)
    victim.stop()
    assert run.finish(timeout=300) == 0, run.stderr
    replanned = of(run, "replanned")
    assert len(replanned) == 1 and victim.name not in replanned[0]["new_nodes"], replanned
    assert [e["resume_from"] for e in of(run, "job_restarted")] == ["checkpoint"], of(run, "job_restarted")
    record = hg.record(run.job_id)
    assert [r["node"] for r in record["plan"]["ranks"] if r["role"] == "ps"] == ps_nodes
    ps_rank = next(r["rank"] for r in record["plan"]["ranks"] if r["role"] == "ps")
    log = (hg.job_dir(run.job_id) / f"rank{ps_rank}.log").read_text()
    version = re.findall(r"resumed from checkpoint version (\d+)", log)
    assert version and int(version[-1]) >= 10, log[-2000:]
    assert [(e["source"], e["step"]) for e in of(run, "resumed")] == [("checkpoint", int(version[-1]))]
    assert final_accuracy(run) >= 0.92


def test_below_min_the_job_fails_naming_the_nodes_that_do_not_answer(hg, cluster3):
    hosts, ctoml = cluster3
    run = hg.start("-c", ctoml, "--json", "--grace", "3", "--heartbeat-timeout", "10", "--nnodes", "2:3",
                   "--restarts", "3", "--strategy", "allreduce", "--", PY, *TRAIN, "--epochs", "50")
    run.wait_all_started(3)
    _, h2, h3 = hosts.hosts
    stop_at_once(h2, h3)      # one stopped after the other: a restart could re-plan on the second
    assert run.finish(timeout=300) == 4, json.dumps([e for e in run.events() if e["event"] not in ("metric", "log")])[-6000:]
    ended = of(run, "job_ended")[-1]
    assert "only 1 node(s) answer" in ended["root_cause"]["reason"], ended
    assert "--nnodes needs at least 2" in ended["root_cause"]["reason"]
    assert h2.name in ended["root_cause"]["reason"] and h3.name in ended["root_cause"]["reason"]
    assert of(run, "replanned") == [] and hg.record(run.job_id)["state"] == "failed"


def test_a_controller_killed_while_it_replans_leaves_no_process_behind(hg, cluster3):
    hosts, ctoml = cluster3
    run = hg.start("-c", ctoml, "--json", "--grace", "3", "--heartbeat-timeout", "10", "--nnodes", "2:3",
                   "--restarts", "1", "--strategy", "allreduce", "--", PY, *TRAIN, "--epochs", "50",
                   env=hg.env(HGTRAIN_TEST_REPLAN_PAUSE="30"))
    run.wait_all_started(3)
    hosts.hosts[2].stop()
    wait_for("the re-plan", lambda: any(e["event"] == "stage" and "re-planning" in e["message"]
                                        for e in run.events()), run)
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait(30)
    deadline = time.monotonic() + 30
    while attempt_pids(run.job_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert attempt_pids(run.job_id) == []
    assert hg.record(run.job_id)["state"] != "succeeded"
