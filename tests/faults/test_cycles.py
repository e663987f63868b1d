"""Many jobs in a row from one controller process: nothing may accumulate. The controller is this
test's own process (``hgcli.launch.launcher.launch``, as the CLI calls it), so its descriptors, sockets,
threads and child processes can be counted before and after; half the jobs are stopped (SIGTERM to
a rank, as `hgtrain stop` ends it on a node) rather than left to finish.

The issue asks for 200 cycles; they take several minutes on the shared 2-core machine, so the test
runs ``CYCLES`` (30: about a minute here); ``HGTRAIN_FAULT_CYCLES=200`` runs the full count (3 to 7
minutes here, depending on the load; figures in docs/reliability.md).
"""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from hgcli.launch.launcher import launch
from hgcli.launch.request import LaunchRequest
from hgcli.launch.events import RankStarted
from hgcli.remote.local import LocalTransport
from tests.agent.harness import job_pids
from tests.launch.hg import cluster_toml
from tests.agent.harness import wait_until
from tests.launch.plans import local_cluster, make_plan, plan_file
from tests.sshhosts import _descendants

pytestmark = pytest.mark.slow
PY = sys.executable
CYCLES = int(os.environ.get("HGTRAIN_FAULT_CYCLES", "30"))

# Even cycles finish by themselves; odd ones wait to be killed from outside.
SCRIPT = "import os, sys, time\nif int(sys.argv[1]) % 2: time.sleep(600)\n"


def resources() -> dict[str, int]:
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return {"fds": len(fds), "sockets": sockets, "threads": threading.active_count(),
            "children": len(_descendants(os.getpid()))}


def settle(before: dict[str, int], deadline_s: float = 60) -> dict[str, int]:
    """Reader threads and reaped children go away just after launch() returns: wait a bounded while."""
    deadline = time.monotonic() + deadline_s
    while True:
        now = resources()
        if all(now[k] <= before[k] for k in before) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def test_launch_stop_cycles_leak_no_processes_descriptors_or_sockets(tmp_path, node_home):
    cluster = local_cluster(("a", "b"))
    plan = make_plan(cluster, [["a", "b"]])
    pfile = plan_file(tmp_path, plan)
    cluster_toml(tmp_path / "cluster.toml", cluster)

    job_ids: list[str] = []

    def cycle(i: int) -> int:
        def on_event(event) -> None:
            if i % 2 and isinstance(event, RankStarted) and event.rank == 1:
                threading.Timer(0.2, os.kill, (event.pid, 15)).start()
        request = LaunchRequest(cluster=cluster, command=(PY, "-c", SCRIPT, str(i)), plan_file=pfile,
                                grace_s=1.0, heartbeat_timeout_s=30.0)
        result = launch(request, on_event)
        job_ids.append(result.job_id)
        return result.exit_code

    assert cycle(0) == 0    # warm-up: lazy imports, the state dir, the first transport's caches
    before = settle(resources())
    started = time.monotonic()
    codes = [cycle(i) for i in range(1, CYCLES + 1)]
    elapsed = time.monotonic() - started
    assert codes == [143 if i % 2 else 0 for i in range(1, CYCLES + 1)], codes
    after = settle(before)
    assert after == before or all(after[k] <= before[k] for k in before), (before, after)
    assert [j for j in job_ids if job_pids(j)] == []     # no rank of any job is left on the node
    print(f"{CYCLES} cycles in {elapsed:.1f} s; before {before}, after {after}")


def test_a_local_agent_that_exits_after_its_connection_was_dropped_is_reaped():
    """The race behind a stray child after many cycles under load: the controller drops an agent's
    connection (stdin EOF) while the agent is still finishing, and nothing waited for it once it
    exited, so it stayed a zombie child of the controller."""
    cluster = local_cluster(("a",))
    slow_exit = "import sys, time; sys.stdin.read(); time.sleep(1.0)"
    proc = LocalTransport(cluster.nodes[0]).start([PY, "-c", slow_exit])
    pid = proc.pid
    proc.close()
    del proc    # as launch() drops its links: no reference left to wait with
    wait_until(lambda: pid not in _descendants(os.getpid()), timeout=60,
               what=f"the exited process {pid} to be reaped, not left a zombie")
