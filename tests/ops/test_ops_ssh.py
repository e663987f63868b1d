"""status and stop over real SSH: agents on real sshd test hosts, one host's sshd stopped."""
from __future__ import annotations

import json

from hgcli.state import records as jobs
from hgcli.cli import main
from hgcli.config.cluster import load_cluster
from hgcli.schema.stages import JobState, RankState
from hgcli.remote.fanout import open_transport
from tests.ops.jobsetup import job_id, job_pids, start_detached, wait_until, write_record

SLEEPER = ("python3", "-u", "-c", "import time\nprint('up', flush=True)\ntime.sleep(600)")


def cluster_file(tmp_path, hosts) -> str:
    lines = [f'[ssh]\nknown_hosts = "{hosts.known_hosts}"\nconfig = "{hosts.root / "no-ssh-config"}"\n'
             'connect_timeout = 10\n']
    for h in hosts.hosts:
        lines.append(f'[[nodes]]\nname = "{h.name}"\nhost = "{h.address}"\nport = {h.port}\nuser = "root"\n'
                     f'identity_file = "{hosts.client_key}"\n')
    path = tmp_path / "cluster.toml"
    path.write_text("\n".join(lines))
    return str(path)


def test_status_with_one_hosts_sshd_stopped_and_stop_naming_it(tmp_path, make_hosts, started_jobs, capsys):
    hosts = make_hosts(2)
    path = cluster_file(tmp_path, hosts)
    cluster = load_cluster(path)
    job = job_id()
    for h in hosts.hosts:
        started_jobs.append((job, h.home / ".cache" / "hgtrain" / "jobs"))
        with open_transport(cluster.node(h.name), cluster) as transport:
            start_detached(job, h.name, {0 if h.name == "host1" else 1: SLEEPER}, transport=transport)
    write_record(job, cluster.fingerprint(), path, ["host1", "host2"])
    wait_until(lambda: len(job_pids(job)) == 2, what="both ranks")

    assert main(["status", job, "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)["live"]["nodes"]
    assert [(n["node"], n["reachable"], n["state"]) for n in nodes] == [("host1", True, "running"),
                                                                        ("host2", True, "running")]
    hosts[1].stop()          # the detached agent outlives its sshd: only the connection is gone
    assert main(["status", job, "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)["live"]["nodes"]
    assert nodes[0]["reachable"] and [r["state"] for r in nodes[0]["ranks"]] == ["running"]
    assert not nodes[1]["reachable"] and [r["state"] for r in nodes[1]["ranks"]] == ["unknown"]
    assert "refused" in nodes[1]["error"] or "no answer" in nodes[1]["error"]

    assert main(["stop", job]) == 4
    assert "not confirmed stopped on 1 node(s): host2" in capsys.readouterr().err
    record = jobs.load(job)
    assert record.state is JobState.RUNNING
    assert [r.state for r in record.ranks] == [RankState.STOPPED, RankState.UNKNOWN]
    assert len(job_pids(job)) == 1        # host2's rank: cleaned up by the fixture through its jobs root
