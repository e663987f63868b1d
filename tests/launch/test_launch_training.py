"""Real training under `hgtrain launch`: the bundled example with a hybrid plan across 3 sshd test
hosts (all-reduce groups + a parameter server, emulated devices), and an unmodified torchrun-style
DDP script under an all-reduce plan. Real torch.distributed process groups, real RPC."""
from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from hgcli.schema.stages import Cluster
from tests.agent.harness import job_pids

from .hg import cluster_toml
from .plans import local_cluster, make_plan, plan_file

PY = sys.executable
pytestmark = pytest.mark.slow


@pytest.mark.sshd
def test_hybrid_example_across_three_hosts_trains_to_completion(hosts, hg, tmp_path):
    cluster = Cluster(nodes=tuple(dataclasses.replace(n, python=PY) for n in hosts.nodes()),
                      ssh=hosts.ssh_settings())
    plan = make_plan(cluster, [["host1", "host2"], ["host3"]], ps=["host3"], batch=32, speeds=[1.0, 0.5],
                     predicted=500.0)
    ctoml = cluster_toml(tmp_path / "cluster.toml", cluster, known_hosts=str(hosts.known_hosts))
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(plan_file(tmp_path, plan)), "--json", "--grace", "5",
                            "--", PY, "-m", "hgcli.examples.train", "--epochs", "1", "--max-steps", "40",
                            timeout=600)
    events = [json.loads(line) for line in out.splitlines()]
    assert code == 0, err + "\n".join(e.get("line", "") for e in events if e["event"] == "log")[-3000:]
    exits = {e["rank"]: (e["node"], e["role"], e["state"]) for e in events if e["event"] == "rank_exited"}
    assert exits == {0: ("host1", "worker", "succeeded"), 1: ("host2", "worker", "succeeded"),
                     2: ("host3", "worker", "succeeded"), 3: ("host3", "ps", "succeeded")}
    steps = {e["rank"] for e in events if e["event"] == "metric" and "step" in e["data"]
             and "event" not in e["data"]}
    assert steps == {0, 1, 2}
    syncs = [e for e in events if e["event"] == "metric" and e["data"].get("event") == "ps_push"]
    assert syncs, "the groups exchanged updates through the parameter server"
    summary = events[-1]["summary"]
    assert summary["samples"] > 0 and summary["samples_per_s"] > 0 and 0 <= summary["accuracy"] <= 1
    assert job_pids(events[0]["job_id"]) == []


def test_unmodified_torchrun_style_script_under_allreduce(hg, tmp_path):
    cluster = local_cluster(("a", "b"))
    plan = make_plan(cluster, [["a", "a", "b"]])
    ctoml = cluster_toml(tmp_path / "cluster.toml", cluster)
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(plan_file(tmp_path, plan)), "--",
                            PY, "-m", "hgcli.examples.torchrun_style", timeout=600)
    assert code == 0, err + out[-3000:]
    finals = sorted(line for line in out.splitlines() if ": accuracy " in line and " checksum " in line)
    assert len(finals) == 3
    # DDP keeps every replica identical: the same checksum on every rank
    assert len({line.rsplit("checksum", 1)[1] for line in finals}) == 1
    assert [line.split(" | ")[0] for line in finals] == ["a:0", "a:1", "b:2"]


def test_main_job_probes_benches_plans_and_trains_on_the_embedded_cluster(hg, tmp_path):
    """The README's main command, with no cluster file: probe -> bench -> plan -> launch -> summary.
    Its bench times two batch sizes ($HGTRAIN_BENCH_MODEL): every quick size of the embedded cluster is
    benched in tests/integration/test_bench_local.py."""
    pytest.importorskip("hgcli.plan.pipeline")
    code, out, err = hg.run("--json", "--", PY, "-m", "hgcli.examples.train", "--epochs", "1",
                            "--max-steps", "30", env=hg.env(HGTRAIN_BENCH_MODEL="example@16,64"), timeout=900)
    events = [json.loads(line) for line in out.splitlines()]
    assert code == 0, err + out[-3000:]
    stages = [e["stage"] for e in events if e["event"] == "stage"]
    assert "probe" in stages and "bench" in stages and "plan" in stages
    started = next(e for e in events if e["event"] == "job_started")
    assert started["nodes"] == ["local"] and started["world_size"] >= 4
    ended = events[-1]
    assert ended["event"] == "job_ended" and ended["state"] == "succeeded"
    summary = ended["summary"]
    assert summary["samples_per_s"] > 0 and summary["predicted_samples_per_s"] > 0
    assert summary["ideal_samples_per_s"] >= summary["predicted_samples_per_s"]
    assert 0 < summary["accuracy"] <= 1
    # What the workers measured is kept for the script; its next plan is fitted to it, without a bench.
    assert summary["fitted_to"] is None and summary["rates_stored"] is True
    from hgcli.config.cluster import default_cluster
    from hgcli.plan.pipeline import prepare_plan
    from hgcli.schema.stages import JobSpec

    said: list[str] = []
    plan = prepare_plan(default_cluster(), JobSpec(), on_stage=lambda stage, m: said.append(m),
                        script="module hgcli.examples.train")
    assert plan.fitted_to == started["job_id"], said
    assert not any(m.startswith("benching") for m in said), said


def test_rank_sigkilled_inside_a_collective_ends_every_rank_without_a_hang(hg, tmp_path):
    import os
    import signal
    import time

    cluster = local_cluster(("a", "b"))
    plan = make_plan(cluster, [["a", "b", "b"]])
    ctoml = cluster_toml(tmp_path / "cluster.toml", cluster)
    run = hg.start("-c", str(ctoml), "--plan", str(plan_file(tmp_path, plan)), "--json", "--grace", "3",
                   "--", PY, "-m", "hgcli.examples.train_mlp", "--epochs", "50")   # the MLP: steps of little CPU
    pids = run.wait_all_started(3)
    run.wait_event(lambda ev: any(e["event"] == "metric" and e["data"].get("step", 0) >= 5 for e in ev))
    os.kill(pids[2], signal.SIGKILL)          # mid-training: its peers are inside all-reduces
    killed_at = time.monotonic()
    assert run.finish(timeout=120) == 137, run.stderr
    assert time.monotonic() - killed_at < 60
    cause = run.events()[-1]["root_cause"]
    assert (cause["node"], cause["rank"], cause["signal"]) == ("b", 2, "SIGKILL")
    assert job_pids(run.job_id) == []
