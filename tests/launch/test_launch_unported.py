"""A script that never calls hg.init() under a forced hybrid plan fails within seconds, naming the
ranks and the fix, instead of the workers waiting in init_process_group for the PS rank (whose
WORLD_SIZE they count) until the job's timeout (issue 52)."""
from __future__ import annotations

import sys
import time

import pytest

from .hg import cluster_toml
from .plans import local_cluster, make_plan, plan_file

pytestmark = pytest.mark.slow


def test_a_plain_torchrun_script_under_a_hybrid_plan_fails_at_once_with_the_fix(hg, tmp_path):
    cluster = local_cluster(("a",))
    plan = make_plan(cluster, [["a"], ["a"]], ps=["a"])
    ctoml = cluster_toml(tmp_path / "cluster.toml", cluster)
    began = time.monotonic()
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(plan_file(tmp_path, plan)), "--grace", "2", "--",
                            sys.executable, "-m", "hgcli.examples.torchrun_style",
                            env=hg.env(HGTRAIN_TIMEOUT="120"), timeout=120)
    took = time.monotonic() - began
    said = out + err
    assert code != 0, said[-3000:]
    assert took < 30, f"{took:.0f} s: {said[-3000:]}"
    line = next(x for x in said.splitlines() if "instead of calling hg.init()" in x)
    assert "rank 0 (node a), rank 1 (node a) joined a plain torch.distributed rendezvous" in line, line
    assert "docs/runtime.md" in line and "--strategy allreduce" in line, line
