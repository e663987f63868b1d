"""The porting guide's two scripts (docs/runtime.md, "Porting a DDP script") as real jobs under
`hgtrain launch`, at their --quick sizes: the plain torchrun DDP script under an all-reduce plan (one
group of two ranks), and its hgcli port under a hybrid plan
(two groups of one emulated device, speeds 1 and 0.25, and a PS rank). Both must reach the accuracy
--quick states. Real processes, gloo groups, RPC and DataLoader worker processes; the hg fixture
fails the test if any process of either job is left behind."""
from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest

from hgcli.examples.recipe import QUICK_TARGET

from .hg import cluster_toml
from .plans import local_cluster, make_plan, plan_file

PY = sys.executable
pytestmark = pytest.mark.slow
FINAL = re.compile(r"final test accuracy (\d\.\d+) after [\d.]+ s \(target ([\d.]+): (reached|NOT reached)\)")


def final_accuracy(events: list[dict[str, Any]]) -> float:
    """The one "final test accuracy" line (the first worker's), its target the --quick one."""
    finals = [(e["rank"], FINAL.search(e["line"])) for e in events if e["event"] == "log"]
    found = [(rank, m) for rank, m in finals if m]
    assert len(found) == 1 and found[0][0] == 0, found
    accuracy, target, _ = found[0][1].groups()
    assert float(target) == QUICK_TARGET
    return float(accuracy)


def test_the_ddp_script_under_allreduce_and_its_port_under_a_hybrid_plan(hg, tmp_path):
    # The plain script under an all-reduce plan of one group of two ranks. Laid out by hand: a script
    # that does not import hgcli.runtime takes no plan batches and no emulation (docs/runtime.md), so a
    # bench would time what it never uses; probe, bench and plan are the main job's test
    # (test_launch_training.py).
    cluster = local_cluster(("local",))
    plan = make_plan(cluster, [["local", "local"]], batch=32)
    code, out, err = hg.run("-c", str(cluster_toml(tmp_path / "local.toml", cluster)), "--plan",
                            str(plan_file(tmp_path, plan)), "--json", "--", PY, "-m", "hgcli.examples.ddp_resnet",
                            "--quick", timeout=900)
    events = [json.loads(line) for line in out.splitlines()]
    assert code == 0, err[-3000:] + "\n".join(e.get("line", "") for e in events if e["event"] == "log")[-3000:]
    started = next(e for e in events if e["event"] == "job_started")
    assert (started["strategy"], started["world_size"]) == ("allreduce", 2)
    assert final_accuracy(events) >= QUICK_TARGET

    cluster = local_cluster(("a", "b"))
    plan = make_plan(cluster, [["a"], ["b"]], ps=["b"], batch=32, speeds=[1.0, 0.25])
    code, out, err = hg.run("-c", str(cluster_toml(tmp_path / "cluster.toml", cluster)),
                            "--plan", str(plan_file(tmp_path, plan)), "--json", "--",
                            PY, "-m", "hgcli.examples.train", "--quick", timeout=600)
    events = [json.loads(line) for line in out.splitlines()]
    assert code == 0, err[-3000:] + "\n".join(e.get("line", "") for e in events if e["event"] == "log")[-3000:]
    pushes = {e["data"]["group"] for e in events if e["event"] == "metric" and e["data"].get("event") == "ps_push"}
    assert pushes == {0, 1}                  # both groups trained through the parameter server
    accuracy = final_accuracy(events)
    assert accuracy >= QUICK_TARGET
    summary = events[-1]["summary"]
    assert summary["accuracy"] == pytest.approx(accuracy, abs=1e-4) and summary["samples"] > 0
