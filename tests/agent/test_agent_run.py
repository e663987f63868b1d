"""A job's normal life on one node: output, metrics, exit codes, failures, records."""
from __future__ import annotations

import json
import os
import stat
import time

from hgcli.node.agent.spec import job_dir

from .harness import has_line, job_pids, py, wait_until

PRINTER = """
import json, os, sys
r = os.environ['RANK']
for i in range(200):
    print(f'rank {r} out {i}')
    print(f'rank {r} err {i}', file=sys.stderr)
sys.stdout.flush()
os.write(int(os.environ['HGTRAIN_METRICS_FD']), json.dumps({'step': 7, 'loss': 0.25, 'rank': r}).encode() + b'\\n')
sys.stdout.buffer.write(b'bad \\xff\\xfe bytes\\n' + 'caf\\u00e9\\n'.encode() + b'no newline at the end')
"""


def test_ranks_output_arrives_tagged_complete_and_in_order(start_agent):
    agent = start_agent([{"rank": r, "argv": py(PRINTER), "env": {"RANK": str(r)}} for r in (0, 1)])
    end = agent.wait_type("end")
    assert end["state"] == "succeeded" and end["logs_complete"] is True
    assert agent.wait_exit() == 0
    for r in (0, 1):
        out = agent.lines(r, "out")
        assert out[:200] == [f"rank {r} out {i}" for i in range(200)]
        # non-UTF-8 bytes are escaped, UTF-8 survives, the unterminated last line is flushed at exit
        assert out[200:] == ["bad \\xff\\xfe bytes", "caf\u00e9", "no newline at the end"]
        assert agent.lines(r, "err") == [f"rank {r} err {i}" for i in range(200)]
        metrics = [f for f in agent.of_type("metric") if f["rank"] == r]
        assert metrics == [{"type": "metric", "rank": r, "data": {"step": 7, "loss": 0.25, "rank": str(r)}}]
        # the node-local file keeps the exact bytes
        raw = (agent.job_dir / f"rank-{r}.out").read_bytes()
        assert raw.endswith(b"bad \xff\xfe bytes\ncaf\xc3\xa9\nno newline at the end")
    exits = sorted((f["rank"], f["code"], f["signal"], f["state"]) for f in agent.of_type("exit"))
    assert exits == [(0, 0, None, "succeeded"), (1, 0, None, "succeeded")]
    # the last frame is the end frame: every log frame came before it
    assert agent.frames[-1]["type"] == "end"


def test_job_dir_and_record_are_private_and_complete(start_agent, jobs_root):
    agent = start_agent([{"rank": 3, "argv": py("print('hi')")}])
    agent.wait_type("end")
    agent.wait_exit()
    path = job_dir(str(jobs_root), agent.job_id, "n1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for f in path.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    record = json.loads((path / "agent.json").read_text())
    assert record["state"] == "succeeded" and record["agent"]["pid"] == agent.pid()
    (rank,) = record["ranks"]
    assert rank["rank"] == 3 and rank["pgid"] == rank["pid"] and rank["start_ticks"] > 0
    assert rank["code"] == 0 and rank["state"] == "succeeded"


def test_failing_rank_stops_the_others_and_is_the_root_cause(start_agent):
    sleeper = py("import time; print('up', flush=True); time.sleep(300)")
    agent = start_agent([{"rank": 0, "argv": sleeper},
                         {"rank": 1, "argv": py("import time, sys; time.sleep(0.5); sys.exit(3)")},
                         {"rank": 2, "argv": sleeper}])
    agent.wait_frame(lambda f: f.get("type") == "logs" and f["rank"] == 2)
    first = agent.wait_frame(lambda f: f.get("type") == "exit" and f["rank"] == 1)
    t0 = time.monotonic()
    end = agent.wait_type("end")
    took = time.monotonic() - t0
    assert first["code"] == 3 and first["state"] == "failed" and first["reason"] == "exited with code 3"
    assert end["state"] == "failed" and end["first_failure"]["rank"] == 1
    assert end["reason"] == "rank 1 exited with code 3"
    stopped = {f["rank"]: f for f in agent.of_type("exit") if f["rank"] != 1}
    assert {r: (f["signal_name"], f["state"]) for r, f in stopped.items()} == \
        {0: ("SIGTERM", "stopped"), 2: ("SIGTERM", "stopped")}
    assert took < 30, took   # "within a few seconds"; generous for a loaded machine
    assert agent.wait_exit() == 1
    assert job_pids(agent.job_id) == []


def test_signals_are_reported_and_sigkill_names_memory_honestly(start_agent):
    agent = start_agent([{"rank": 0, "argv": py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")}])
    ex = agent.wait_type("exit")
    assert ex["code"] is None and ex["signal"] == 9 and ex["signal_name"] == "SIGKILL"
    assert ex["state"] == "failed"
    # No OOM kill happened: with readable cgroup counters we say it was not the OOM killer; without
    # them we may only say "possibly out of memory".
    if ex["oom"] is None:
        assert "possibly out of memory" in ex["reason"]
    else:
        assert ex["oom"] is False and "not by the OOM killer" in ex["reason"]


def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(start_agent):
    stubborn = py("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print('ready', flush=True); time.sleep(300)")
    agent = start_agent([{"rank": 0, "argv": stubborn},
                         {"rank": 1, "argv": py("import time; time.sleep(1); raise SystemExit(5)")}],
                        grace_s=1.0)
    agent.wait_frame(lambda f: has_line(f, "ready"))
    ex0 = agent.wait_frame(lambda f: f.get("type") == "exit" and f["rank"] == 0)
    assert ex0["signal_name"] == "SIGKILL" and ex0["state"] == "stopped"
    assert "stop signal" in ex0["reason"]
    assert agent.wait_type("end")["first_failure"]["code"] == 5


def test_rank_that_cannot_start_fails_the_job(start_agent):
    agent = start_agent([{"rank": 0, "argv": py("import time; time.sleep(300)")},
                         {"rank": 1, "argv": ["/nonexistent/program"]}])
    end = agent.wait_type("end")
    assert end["state"] == "failed" and end["first_failure"]["rank"] == 1
    assert end["first_failure"]["code"] == 127 and "cannot start" in end["first_failure"]["reason"]
    assert agent.wait_exit() == 1


def test_leftover_children_of_a_finished_rank_are_reaped(start_agent):
    # The rank exits 0 but leaves a child in its process group and a setsid'd grandchild.
    code = ("import subprocess, sys; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True); "
            "print('spawned', flush=True)")
    agent = start_agent([{"rank": 0, "argv": py(code)}])
    assert agent.wait_type("end")["state"] == "succeeded"
    assert agent.wait_exit() == 0
    assert job_pids(agent.job_id) == []


def test_bad_spec_is_one_error_frame(start_agent):
    agent = start_agent([], job_id="../escape")
    err = agent.wait_type("error")
    assert "job id" in err["message"]
    assert agent.wait_exit() == 2


def test_status_reports_running_ranks_and_last_metrics(start_agent):
    code = ("import json, os, time\n"
            "fd = int(os.environ['HGTRAIN_METRICS_FD'])\n"
            "for s in range(3): os.write(fd, (json.dumps({'step': s}) + '\\n').encode())\n"
            "print('ready', flush=True); time.sleep(300)\n")
    agent = start_agent([{"rank": 0, "argv": py(code)}])
    wait_until(lambda: len(agent.of_type("metric")) == 3, what="metrics")
    rc, (st,) = agent.control("--status", agent.job_id)
    assert rc == 0 and st["type"] == "status" and st["state"] == "running" and st["agent_alive"]
    (rank,) = st["ranks"]
    assert rank["state"] == "running" and rank["metrics"] == {"step": 2}
    agent.close()
    agent.wait_exit()
    rc, (st,) = agent.control("--status", agent.job_id)
    assert st["state"] == "stopped" and st["ranks"][0]["state"] == "stopped"
    assert not os.path.exists(f"/proc/{rank['pid']}") or job_pids(agent.job_id) == []


def test_ranks_inherit_no_stray_descriptors(start_agent):
    # Only stdio and the metrics pipe: a rank holding another rank's pipe would keep it from EOF.
    code = "import os; print(','.join(os.listdir('/proc/self/fd')), os.environ['HGTRAIN_METRICS_FD'])"
    agent = start_agent([{"rank": r, "argv": py(code)} for r in (0, 1)])
    agent.wait_type("end")
    for r in (0, 1):
        (line,) = agent.lines(r)
        fds, metrics_fd = line.rsplit(" ", 1)
        # 3 is the directory listing's own descriptor
        assert sorted({int(fd) for fd in fds.split(",")} - {0, 1, 2, int(metrics_fd)}) == [3], line


def test_stop_frame_stops_the_job_and_frames_still_arrive(start_agent):
    agent = start_agent([{"rank": 0, "argv": py(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('cleaning up', flush=True), sys.exit(0)))\n"
        "print('ready', flush=True); time.sleep(300)\n")}])
    agent.wait_frame(lambda f: has_line(f, "ready"))
    agent.send({"type": "stop"})
    end = agent.wait_type("end")
    assert end["state"] == "stopped" and end["reason"] == "stop requested by the controller"
    assert end["logs_complete"] is True
    assert agent.lines(0) == ["ready", "cleaning up"]
    (ex,) = agent.of_type("exit")
    assert ex["code"] == 0 and ex["state"] == "stopped"
