"""`hgtrain logs` and `hgtrain stop` against real detached agents, found again from their job records."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from tests.strictjson import loads as strict_json
from hgcli.state import records as jobs
from hgcli.cli import main
from hgcli.config.cluster import load_cluster
from hgcli.schema.stages import JobState, RankState
from tests.ops.conftest import ROOT
from tests.ops.jobsetup import (WAIT_S, job_id, job_pids, py, start_detached, two_node_cluster_file, wait_gone,
                                wait_until, write_record)

SLEEPER = py("import time\nprint('up', flush=True)\ntime.sleep(600)")
# Prints a numbered line every 0.2 s until the file "release" appears, then a last line with the number
# of ticks printed (so a lost line at the end is caught too), and exits.
TICKER = ("import os, sys, time\nn = 0\nwhile not os.path.exists(sys.argv[1]):\n"
          "    print('tick', n, flush=True); n += 1; time.sleep(0.2)\nprint('last line', n, flush=True)\n")


def detached_job(tmp_path, started_jobs, ranks_a, ranks_b=None):
    path = two_node_cluster_file(tmp_path)
    job = job_id()
    started_jobs.append(job)
    start_detached(job, "a", ranks_a)
    nodes = ["a"] * len(ranks_a)
    if ranks_b:
        start_detached(job, "b", ranks_b)
        nodes += ["b"] * len(ranks_b)
    write_record(job, load_cluster(path).fingerprint(), str(path), nodes)
    return job


def follow_logs(job, **popen) -> subprocess.Popen:
    """``hgtrain logs JOB -f`` into a pipe, as a script or ``| grep`` runs it: without PYTHONUNBUFFERED
    (which the suite's environment may carry), so each line must be flushed by hgtrain itself."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.Popen([sys.executable, "-m", "hgcli", "logs", job, "-f"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**env, "PYTHONPATH": str(ROOT)}, **popen)


def first_lines(proc: subprocess.Popen) -> bytes:
    """What the pipe holds once a whole line is in it (bounded by WAIT_S), read off the descriptor and
    never through proc.stdout: communicate() reads the descriptor itself, so whatever a readline() had
    buffered beyond the first line was lost to the test. Under load "tick 1" sat in the pipe with
    "tick 0", and the test saw ticks [0, 2] although hgtrain had printed every line. A follow that
    shows no whole line in time is killed, so that the caller can read its stderr."""
    head, deadline = b"", time.monotonic() + WAIT_S
    while b"\n" not in head and select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(proc.stdout.fileno(), 1 << 16)
        if not chunk:
            break
        head += chunk
    if b"\n" not in head:
        proc.kill()
    return head


def test_logs_of_a_finished_detached_job_come_from_the_nodes_tagged(tmp_path, started_jobs, capsys):
    job = detached_job(tmp_path, started_jobs, {0: py("print('zero a'); print('zero b')")},
                       {1: py("import sys; print('one out'); print('one err', file=sys.stderr)")})
    wait_gone(job)
    assert main(["logs", job]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("a:0")] == ["a:0| zero a", "a:0| zero b"]
    assert "b:1| one out" in out and "b:1! one err" in out
    assert main(["logs", job, "--ranks", "1", "--json"]) == 0
    events = [strict_json(line) for line in capsys.readouterr().out.splitlines()]
    assert {(e["node"], e["rank"], e["stream"], e["line"]) for e in events} == {
        ("b", 1, "out", "one out"), ("b", 1, "err", "one err")}
    assert all(e["event"] == "log" and e["job_id"] == job for e in events)


def test_controller_copy_is_printed_when_it_exists(tmp_path, started_jobs, capsys):
    job = detached_job(tmp_path, started_jobs, {0: py("print('from the node')")})
    wait_gone(job)
    (jobs.job_dir(job) / "rank0.log").write_bytes(b"from the controller\nbad \xff byte\n")
    assert main(["logs", job]) == 0
    assert capsys.readouterr().out.splitlines() == ["a:0| from the controller", "a:0| bad \\xff byte"]
    assert main(["logs", job, "--ranks", "0-2"]) == 2          # the job has rank 0 only
    assert "no rank 1, 2" in capsys.readouterr().err


def test_follow_reattaches_to_a_detached_job_until_it_ends(tmp_path, started_jobs):
    release = tmp_path / "release"
    job = detached_job(tmp_path, started_jobs, {0: py(TICKER) + (str(release),)})
    proc = follow_logs(job)
    head = first_lines(proc)
    assert head.startswith(b"a:0| tick 0\n"), head.decode() + proc.stderr.read()
    release.touch()
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    lines = (head.decode() + out).splitlines(keepends=True)
    count = int(lines[-1].split()[-1])
    assert lines == [f"a:0| tick {n}\n" for n in range(count)] + [f"a:0| last line {count}\n"]   # all, in order


def test_ctrl_c_on_follow_exits_130_and_leaves_the_job_running(tmp_path, started_jobs):
    job = detached_job(tmp_path, started_jobs, {0: SLEEPER})
    pids = wait_until(lambda: job_pids(job), what="the rank")
    # Ctrl-C at a terminal: SIGINT at its default disposition in the child, whatever the suite was
    # started under (a shell's background job ignores SIGINT, and a Python started so never raises
    # KeyboardInterrupt: 'logs -f' then rightly keeps following, as under nohup).
    proc = follow_logs(job, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    head = first_lines(proc)
    assert head == b"a:0| up\n", head.decode() + proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130 and "interrupted" in err
    time.sleep(1.0)   # give a wrongly propagated stop time to act
    assert set(pids) <= set(job_pids(job))
    assert jobs.load(job).state is JobState.RUNNING


def test_stop_stops_one_job_and_leaves_the_other_running(tmp_path, started_jobs, capsys):
    keep = detached_job(tmp_path, started_jobs, {0: SLEEPER}, {1: SLEEPER})
    stop = detached_job(tmp_path, started_jobs, {0: SLEEPER}, {1: SLEEPER})
    kept = wait_until(lambda: len(job_pids(keep)) == 2 and job_pids(keep), what="job to keep")
    wait_until(lambda: len(job_pids(stop)) == 2, what="job to stop")
    assert main(["stop", stop, "--json"]) == 0
    data = strict_json(capsys.readouterr().out)
    assert data["job_id"] == stop and data["state"] == "stopped"
    assert [(n["node"], n["ok"], n["agent"]) for n in data["nodes"]] == [("a", True, "stopped"), ("b", True, "stopped")]
    assert job_pids(stop) == []
    assert sorted(job_pids(keep)) == sorted(kept)
    record = jobs.load(stop)
    assert record.state is JobState.STOPPED and record.ended_at
    assert [r.state for r in record.ranks] == [RankState.STOPPED, RankState.STOPPED]
    assert jobs.load(keep).state is JobState.RUNNING
    assert main(["status", stop, "--json"]) == 0
    assert strict_json(capsys.readouterr().out)["live"] is None        # ended: nobody asked
    assert main(["stop", keep]) == 0
    assert "is stopped" in capsys.readouterr().out and job_pids(keep) == []


def test_stop_with_an_unreachable_node_names_it_and_exits_4(tmp_path, started_jobs, capsys):
    path = two_node_cluster_file(tmp_path, '\n[[nodes]]\nname = "c"\nhost = "127.0.0.1"\nport = 1\n')
    job = job_id()
    started_jobs.append(job)
    start_detached(job, "a", {0: SLEEPER})
    write_record(job, load_cluster(path).fingerprint(), str(path), ["a", "c"])
    wait_until(lambda: job_pids(job), what="the rank")
    assert main(["stop", job]) == 4
    captured = capsys.readouterr()
    assert "not confirmed stopped on 1 node(s): c (" in captured.err
    assert job_pids(job) == []
    record = jobs.load(job)
    assert record.state is JobState.RUNNING                        # node c may still run its rank
    assert [r.state for r in record.ranks] == [RankState.STOPPED, RankState.UNKNOWN]
