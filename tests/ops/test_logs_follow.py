"""`hgtrain logs -f` over real SSH while its connection is broken for real, three ways: the node-side
tail process killed, the sshd session serving it killed, the host's sshd restarted. Every line must
still arrive exactly once and in order (the follow resumes from the byte offsets it printed)."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from hgcli.config.cluster import load_cluster
from hgcli.remote.fanout import open_transport
from tests.ops.conftest import ROOT
from tests.ops.jobsetup import WAIT_S, job_id, start_detached, wait_until, write_record
from tests.ops.test_ops_ssh import cluster_file

# A numbered line every 20 ms until the release file appears, then a last line.
TICKER = ("import os, sys, time\nn = 0\nwhile not os.path.exists(sys.argv[1]):\n"
          "    print('tick', n, flush=True); n += 1; time.sleep(0.02)\nprint('last line', flush=True)\n")


def tail_pids(job: str) -> list[int]:
    """The node-side ``agent --tail JOB`` processes (what a follow talks to on the host)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--tail" in argv and job.encode() in argv:
            found.append(int(name))
    return found


def parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


class Follow:
    """``hgtrain logs JOB -f`` as a user runs it; its lines are collected as they come."""

    def __init__(self, job: str, *, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "hgcli", "logs", job, "-f"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=cwd,
                                     env=env or {**os.environ, "PYTHONPATH": str(ROOT)})
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, count: int) -> None:
        """Until at least ``count`` lines have arrived (bounded)."""
        deadline = time.monotonic() + WAIT_S
        while len(self.lines) < count:
            line = self._queue.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, f"logs -f ended early: {self.lines[-5:]} {self.proc.stderr.read()}"
            self.lines.append(line)

    def finish(self) -> tuple[int, str]:
        """Every remaining line (stdout has one reader: ours), then the exit code and stderr."""
        while (line := self._queue.get(timeout=WAIT_S)) is not None:
            self.lines.append(line)
        assert self.proc.stderr is not None
        err = self.proc.stderr.read()
        return self.proc.wait(WAIT_S), err


def test_follow_resumes_exactly_after_killed_tails_dropped_sessions_and_a_restarted_sshd(
        tmp_path, make_hosts, started_jobs):
    hosts = make_hosts(1)
    host = hosts[0]
    path = cluster_file(tmp_path, hosts)
    cluster = load_cluster(path)
    job, release = job_id(), tmp_path / "release"
    started_jobs.append((job, host.home / ".cache" / "hgtrain" / "jobs"))
    with open_transport(cluster.node(host.name), cluster) as transport:
        start_detached(job, host.name, {0: ("python3", "-u", "-c", TICKER, str(release))}, transport=transport)
    write_record(job, cluster.fingerprint(), path, [host.name])

    follow = Follow(job)
    try:
        follow.wait_for(20)
        tail = wait_until(lambda: tail_pids(job), what="the node-side tail")[0]
        os.kill(tail, signal.SIGKILL)                      # 1. the tail process on the node dies
        follow.wait_for(len(follow.lines) + 50)
        session = parent(wait_until(lambda: [p for p in tail_pids(job) if p != tail], what="a new tail")[0])
        os.kill(session, signal.SIGKILL)                   # 2. the sshd session (the TCP connection) dies
        follow.wait_for(len(follow.lines) + 50)
        host.stop()                                        # 3. the host's sshd goes away and comes back
        time.sleep(1.0)
        host.fixed_port = host.port
        host.start(hosts.authorized_keys)
        follow.wait_for(len(follow.lines) + 50)
    finally:
        release.touch()
    code, err = follow.finish()
    assert code == 0, err
    assert follow.lines[-1] == f"{host.name}:0| last line", follow.lines[-3:]
    ticks = [int(line.rsplit(" ", 1)[1]) for line in follow.lines[:-1]]
    assert ticks == list(range(len(ticks))), "lines lost or repeated across reconnects"
    assert len(ticks) >= 170
    assert not tail_pids(job)
