"""`hgtrain status`: the job list from records, and live rank states from real detached agents."""
from __future__ import annotations

import os
import subprocess
import sys

from hgcli.state import records as jobs
from hgcli.cli import main
from hgcli.config.cluster import default_cluster, load_cluster
from hgcli.schema.stages import JobState, RankState
from hgcli.errors import StateError
from hgcli.jobs.status import job_status, live_status
from tests.ops.conftest import ROOT
from tests.ops.jobsetup import job_id, py, start_detached, two_node_cluster_file, wait_gone, wait_until, write_record
from tests.strictjson import loads as strict_json

SLEEPER = py("import time\nprint('up', flush=True)\ntime.sleep(600)")
METRIC = py("import os, time\nos.write(int(os.environ['HGTRAIN_METRICS_FD']), b'{\"step\": 7, \"loss\": 0.25}\\n')\n"
            "time.sleep(600)")


def test_listing_comes_from_the_records_without_asking_anyone(capsys):
    fp = default_cluster().fingerprint()
    done = write_record("hg-1-done", fp, None, ["local", "local"], state=JobState.SUCCEEDED, exit_code=0,
                        ended_at=None)
    failed = write_record("hg-2-failed", fp, None, ["local"], state=JobState.FAILED, exit_code=3,
                          root_cause="local: rank 0 exited with code 3")
    assert main(["status", "--json"]) == 0
    listed = strict_json(capsys.readouterr().out)["jobs"]
    assert [j["id"] for j in listed] == [failed.id, done.id]          # newest (highest id) first
    assert [j["state"] for j in listed] == ["failed", "succeeded"] and listed[0]["exit_code"] == 3
    assert all(j["live"] is None for j in listed)                    # ended jobs: no node asked
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    for text in ("hg-2-failed", "failed", "allreduce", "succeeded", "local"):
        assert text in out


def test_running_job_shows_live_rank_states_and_metrics(tmp_path, started_jobs, capsys):
    path = two_node_cluster_file(tmp_path)
    cluster = load_cluster(path)
    job = job_id()
    started_jobs.append(job)
    start_detached(job, "a", {0: SLEEPER, 1: METRIC})
    start_detached(job, "b", {2: SLEEPER})
    write_record(job, cluster.fingerprint(), str(path), ["a", "a", "b"])

    def live_metrics():
        s = job_status(job)
        return s if s.live.nodes[0].ranks[1].metrics else None

    status = wait_until(live_metrics, what="rank 1's metrics")
    assert [n.node for n in status.live.nodes] == ["a", "b"]
    assert all(n.reachable and n.agent_alive and n.state == "running" for n in status.live.nodes)
    assert [r.state for n in status.live.nodes for r in n.ranks] == [RankState.RUNNING] * 3
    assert status.live.nodes[0].ranks[1].metrics == {"step": 7, "loss": 0.25}
    assert main(["status", job, "--json"]) == 0
    data = strict_json(capsys.readouterr().out)
    assert data["id"] == job and data["state"] == "running"
    assert [r["state"] for n in data["live"]["nodes"] for r in n["ranks"]] == ["running"] * 3
    assert main(["status", job]) == 0
    out = capsys.readouterr().out
    assert "step 7" in out and "loss 0.25" in out and "running" in out
    assert main(["status"]) == 0
    assert "3/3 ranks running" in capsys.readouterr().out


def test_unreachable_node_is_unknown_and_the_others_are_still_shown(tmp_path, started_jobs, capsys):
    # Node c is declared on a port where nothing listens: a real refused connection.
    path = two_node_cluster_file(tmp_path, '\n[[nodes]]\nname = "c"\nhost = "127.0.0.1"\nport = 1\n')
    cluster = load_cluster(path)
    job = job_id()
    started_jobs.append(job)
    start_detached(job, "a", {0: SLEEPER})
    write_record(job, cluster.fingerprint(), str(path), ["a", "c"])
    assert main(["status", job, "--json"]) == 0
    live = strict_json(capsys.readouterr().out)["live"]["nodes"]
    assert live[0]["node"] == "a" and live[0]["reachable"] and live[0]["ranks"][0]["state"] == "running"
    assert live[1]["node"] == "c" and not live[1]["reachable"] and live[1]["state"] == "unknown"
    assert [r["state"] for r in live[1]["ranks"]] == ["unknown"] and live[1]["error"]
    assert jobs.load(job).state is JobState.RUNNING                  # nothing decided without node c


def test_ended_job_whose_record_says_running_is_corrected(tmp_path, started_jobs, capsys, monkeypatch):
    path = two_node_cluster_file(tmp_path)
    cluster = load_cluster(path)
    job = job_id()
    started_jobs.append(job)
    start_detached(job, "a", {0: py("print('bye')")})
    start_detached(job, "b", {1: py("import sys; sys.exit(3)")})
    write_record(job, cluster.fingerprint(), str(path), ["a", "b"])
    wait_gone(job)
    # A state directory that cannot be written (full, read-only: injected here, as root writes
    # anywhere) made `status` exit 5 and show nothing; it shows what the nodes said and warns.
    wait_until(lambda: live_status(jobs.load(job)).finished, what="the agents to finish")
    with monkeypatch.context() as patch:
        def refuse(record):
            raise StateError(f"cannot write {jobs.job_dir(record.id)}/job.json: Read-only file system")
        patch.setattr(jobs, "save", refuse)
        assert main(["status", job, "--json"]) == 0
        out, err = capsys.readouterr()
        assert strict_json(out)["state"] == "failed" and "shown but not saved" in err and "Read-only" in err
    assert jobs.load(job).state is JobState.RUNNING
    # The agents finish their records a moment after the ranks are gone.
    wait_until(lambda: not job_status(job).record.state.is_running(), what="the record to be fixed")
    record = jobs.load(job)
    assert record.state is JobState.FAILED and record.exit_code == 3 and record.ended_at
    assert "b: rank 1" in record.root_cause
    assert [r.state for r in record.ranks] == [RankState.SUCCEEDED, RankState.FAILED]


def test_agent_killed_while_ranks_run_is_orphaned_and_record_kept(tmp_path, started_jobs):
    path = two_node_cluster_file(tmp_path)
    cluster = load_cluster(path)
    job = job_id()
    started_jobs.append(job)
    agent = start_detached(job, "a", {0: SLEEPER})
    write_record(job, cluster.fingerprint(), str(path), ["a"])
    # The detached agent records its rank's pid a moment after reporting it: kill it only then.
    wait_until(lambda: job_status(job).live.nodes[0].ranks[0].pid, what="the rank's recorded pid")
    os.kill(agent, 9)
    status = wait_until(lambda: (s := job_status(job)).live.nodes[0].state == "orphaned" and s,
                        what="orphaned state")
    assert status.record.state is JobState.RUNNING and status.live.nodes[0].ranks[0].state is RankState.RUNNING


def test_unknown_job_is_exit_6_one_line(capsys):
    for argv in (["status", "nope"], ["logs", "nope"], ["stop", "nope"], ["status", "nope", "--json"]):
        assert main(argv) == 6
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
        assert "no job 'nope'" in captured.err and "Traceback" not in captured.err


def test_status_does_not_import_torch(tmp_path):
    write_record("hg-1-x", default_cluster().fingerprint(), None, ["local"], state=JobState.SUCCEEDED)
    code = ("import sys; from hgcli.cli import main; rc = main(['status', '--json']); "
            "main(['status']); print('torch' in sys.modules, rc, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stderr.strip().endswith("False 0"), done.stderr
