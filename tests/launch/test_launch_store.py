"""A plain torchrun-style script (``init_process_group("gloo")`` from env://, no hgcli) under
`hgtrain launch`: its rendezvous store is the agent's, on MASTER_ADDR only, and its gloo listeners
are on the node's cluster address; before, rank 0's store listened on every interface
(``*:MASTER_PORT``). Real agents, real ranks, ``ss`` as a user would check."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from tests.agent.harness import job_pids, store_pid, wait_until

from .hg import cluster_toml
from .plans import local_cluster, make_plan, plan_file

PY = sys.executable
SCRIPT = Path(__file__).parent / "scripts" / "plain_listeners.py"


def test_a_plain_scripts_store_and_gloo_listen_on_the_cluster_address_only(hg, tmp_path):
    cluster = local_cluster(("a",))
    plan = make_plan(cluster, [["a", "a"]])
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, err = hg.run("-c", str(cluster_toml(tmp_path / "cluster.toml", cluster)),
                               "--plan", str(plan_file(tmp_path, plan)), "--", PY, str(SCRIPT), str(out),
                               timeout=300)
    assert code == 0, err + stdout[-3000:]
    for rank in (0, 1):
        store = (out / f"store{rank}.txt").read_text().split()
        assert len(store) == 1 and store[0].startswith("127.0.0.1:"), store   # one listener, loopback
        listening = (out / f"listen{rank}.txt").read_text().split()
        assert listening and all(a.rsplit(":", 1)[0] == "127.0.0.1" for a in listening), (rank, listening)
        assert (out / f"sum{rank}.txt").read_text() == "2"


def test_a_store_killed_mid_job_is_the_jobs_root_cause(hg, tmp_path):
    """The agent's ``stopping`` frame with ``failed``: the controller names the store, not a rank."""
    cluster = local_cluster(("a",))
    plan = make_plan(cluster, [["a", "a"]])
    sleeper = ("import datetime, time\nfrom torch.distributed.rendezvous import rendezvous\n"
               "next(rendezvous('env://', timeout=datetime.timedelta(seconds=120)))\nprint('joined', flush=True)\n"
               "time.sleep(600)\n")
    run = hg.start("-c", str(cluster_toml(tmp_path / "cluster.toml", cluster)), "--plan",
                   str(plan_file(tmp_path, plan)), "--grace", "2", "--json", "--", PY, "-c", sleeper)
    wait_until(lambda: sum(1 for e in run.events() if e["event"] == "log" and e["line"] == "joined") == 2,
               timeout=180, what="both ranks to join through the store")
    os.kill(wait_until(lambda: store_pid(run.job_id), what="the store process"), signal.SIGKILL)
    assert run.finish() == 6, run.stderr
    ended = run.events()[-1]
    assert ended["state"] == "failed" and ended["exit_code"] == 6
    cause = ended["root_cause"]
    assert cause["node"] == "a" and cause["rank"] is None
    assert cause["reason"].startswith("the job's rendezvous store on 127.0.0.1:")
    assert "exited with code -9" in cause["reason"]
    assert job_pids(run.job_id) == []
