"""A plain torchrun-style script (``init_process_group("gloo")`` from env://, no hgcli) under
`hgtrain launch`: its rendezvous store is the agent's, on MASTER_ADDR only, and its gloo listeners
are on the node's cluster address; before, rank 0's store listened on every interface
(``*:MASTER_PORT``). Real agents, real ranks, ``ss`` as a user would check."""
from __future__ import annotations

import sys
from pathlib import Path

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
