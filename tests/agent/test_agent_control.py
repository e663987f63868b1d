"""The agent dies with its connection, and a fresh connection can find, stop and re-attach to a job."""
from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

from .harness import has_line, job_pids, log_lines, py, wait_until

# A rank with a child in its process group and a grandchild that left it with setsid: teardown must
# find all three (groups, then the job's environment marker).
FAMILY = ("import subprocess, sys, time\n"
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
          "print('family up', flush=True)\n"
          "time.sleep(300)\n")


def family_job(start_agent, **kw):
    agent = start_agent([{"rank": r, "argv": py(FAMILY)} for r in (0, 1)], **kw)
    for r in (0, 1):
        agent.wait_frame(lambda f, r=r: f.get("type") == "logs" and f["rank"] == r)
    wait_until(lambda: len(job_pids(agent.job_id, agent.node)) == 6, what="ranks and their children")
    return agent


def test_stdin_eof_stops_every_process_of_the_job(start_agent):
    agent = family_job(start_agent)
    agent.close_stdin()
    end = agent.wait_type("end")
    assert end["state"] == "stopped" and "stdin EOF" in end["reason"]
    assert agent.wait_exit() == 1
    assert job_pids(agent.job_id) == []


def test_dropped_connection_stops_every_process_of_the_job(start_agent):
    agent = family_job(start_agent)
    agent.close()   # stdin, stdout and stderr all gone, like an SSH connection dropping
    agent.wait_exit()
    assert job_pids(agent.job_id) == []


def test_heartbeats_keep_the_job_and_silence_stops_it(start_agent):
    agent = family_job(start_agent, heartbeat_timeout_s=2.0, heartbeat_interval_s=0.5, heartbeats=False)
    for _ in range(8):   # 4 s of heartbeats: twice the timeout
        agent.heartbeat()
        time.sleep(0.5)
    assert agent.of_type("stopping") == []
    assert len(job_pids(agent.job_id)) == 6
    assert agent.of_type("heartbeat"), "the agent sends heartbeats too"
    # Now silence with stdin still open (a link cut without FIN).
    end = agent.wait_type("end", timeout=60)
    assert "no heartbeat" in end["reason"]
    assert agent.wait_exit() == 1
    assert job_pids(agent.job_id) == []


def test_stop_from_a_second_connection(start_agent):
    agent = family_job(start_agent)
    rc, (res,) = agent.control("--stop", agent.job_id)
    assert rc == 0 and res["type"] == "stopped" and res["agent"] == "stopped" and res["left"] == []
    assert job_pids(agent.job_id) == []
    end = agent.wait_type("end")
    assert end["state"] == "stopped" and "SIGTERM" in end["reason"]


def test_stop_after_the_agent_was_sigkilled(start_agent):
    agent = family_job(start_agent)
    os.kill(agent.pid(), signal.SIGKILL)
    agent.wait_exit()
    time.sleep(0.5)
    assert len(job_pids(agent.job_id)) == 6, "ranks survive their agent's SIGKILL"
    rc, (st,) = agent.control("--status", agent.job_id)
    assert st["state"] == "orphaned" and not st["agent_alive"]
    rc, (res,) = agent.control("--stop", agent.job_id)
    assert rc == 0 and res["agent"] == "gone" and len(res["killed"]) == 6 and res["left"] == []
    assert job_pids(agent.job_id) == []
    rc, (st,) = agent.control("--status", agent.job_id)
    assert st["state"] == "stopped"


def test_two_jobs_stopping_one_leaves_the_other(start_agent):
    one = family_job(start_agent)
    two = family_job(start_agent)
    rc, _ = one.control("--stop", one.job_id)
    assert rc == 0
    assert job_pids(one.job_id) == []
    assert len(job_pids(two.job_id)) == 6
    rc, (st,) = two.control("--status", two.job_id)
    assert st["state"] == "running" and all(r["state"] == "running" for r in st["ranks"])
    two.close_stdin()
    two.wait_type("end")


def test_two_nodes_of_one_job_on_one_host_are_kept_apart(start_agent):
    a = family_job(start_agent, node="a")
    b = family_job(start_agent, node="b", job_id=a.job_id)
    rc, (res,) = a.control("--stop", a.job_id, "--node", "a")
    assert rc == 0 and res["node"] == "a"
    assert job_pids(a.job_id, "a") == []
    assert len(job_pids(a.job_id, "b")) == 6
    b.close_stdin()
    b.wait_type("end")
    assert job_pids(a.job_id) == []


def test_unknown_job_is_a_clear_error(start_agent, jobs_root):
    agent = start_agent([{"rank": 0, "argv": py("pass")}])
    agent.wait_type("end")
    rc, (err,) = agent.control("--stop", "no-such-job")
    assert rc == 3 and err["type"] == "error" and "no job no-such-job" in err["message"]


def test_secret_values_stay_out_of_cmdlines_records_and_logs(start_agent, jobs_root):
    secret = "hunter2-" + os.urandom(8).hex()
    plain_secret = "plain-" + os.urandom(8).hex()
    # The rank checks digests, so the values are not even on the test's own rank command line.
    digest = [hashlib.sha256(v.encode()).hexdigest() for v in (secret, plain_secret)]
    check = ("import hashlib, os, time\n"
             "h = lambda v: hashlib.sha256(os.environ[v].encode()).hexdigest()\n"
             f"assert [h('HF_TOKEN'), h('DB_URL')] == {digest!r}\n"
             "print('env ok', flush=True); time.sleep(300)\n")
    agent = start_agent([{"rank": 0, "argv": py(check), "env": {"DB_URL": plain_secret}}],
                        env={"HF_TOKEN": secret}, secret=["DB_URL"])
    agent.wait_frame(lambda f: has_line(f, "env ok"))
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert secret.encode() not in cmdline and plain_secret.encode() not in cmdline, pid
    agent.close_stdin()
    agent.wait_type("end")
    agent.wait_exit()
    for path in jobs_root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert secret.encode() not in data and plain_secret.encode() not in data, path
    for frame in agent.frames:
        assert secret not in str(frame) and plain_secret not in str(frame)


def test_detached_job_survives_the_controller_and_is_stopped_by_stop(start_agent):
    code = ("import time\n"
            "for i in range(100000):\n"
            "    print('tick', i, flush=True); time.sleep(0.05)\n")
    agent = start_agent([{"rank": 0, "argv": py(code)}, {"rank": 1, "argv": py(code)}], detach=True)
    det = agent.wait_type("detached")
    assert agent.wait_exit() == 0            # the foreground agent returns at once
    assert len(agent.of_type("started")) == 2
    agent.close()                             # the controller goes away
    time.sleep(1.0)
    rc, (st,) = agent.control("--status", agent.job_id)
    assert st["state"] == "running" and st["agent_alive"] and len(job_pids(agent.job_id)) == 2
    rc, frames = agent.control("--tail", agent.job_id)
    lines = log_lines(frames, 0)
    assert lines[:3] == ["tick 0", "tick 1", "tick 2"]
    offsets = frames[-1]["offsets"]
    assert frames[-1]["type"] == "tail_end" and frames[-1]["complete"] is False
    rc, (res,) = agent.control("--stop", agent.job_id)
    assert rc == 0 and res["agent"] == "stopped" and res["left"] == []
    assert job_pids(agent.job_id) == []
    assert not os.path.exists(f"/proc/{det['pid']}") or \
        Path(f"/proc/{det['pid']}/stat").read_text().split(") ")[1][0] in "ZX"
    # Re-attach from the offsets: exactly the lines that came after, nothing repeated.
    rc, more = agent.control("--tail", agent.job_id, "--from", offsets)
    more_lines = log_lines(more, 0)
    all_lines = (agent.job_dir / "rank-0.out").read_text().splitlines()
    assert lines + more_lines == all_lines
    assert more[-1]["complete"] is True


def test_tail_follow_ends_with_the_job(start_agent):
    code = "import time\nfor i in range(30):\n    print('n', i, flush=True); time.sleep(0.05)\n"
    agent = start_agent([{"rank": 0, "argv": py(code)}], detach=True)
    agent.wait_type("detached")
    agent.wait_exit()
    rc, frames = agent.control_attached("--tail", agent.job_id, "--follow")
    assert rc == 0 and frames[-1]["complete"] is True
    assert log_lines(frames, 0) == [f"n {i}" for i in range(30)]
