"""A mixed emulated cluster whose small devices cannot hold a replica (issue 49): planned with the
default ``--engine auto`` they train as an fsdp group and every rank's accounted peak stays under its
device's memory; a DDP plan laid out by hand that puts a replica on them fails under ``hgtrain launch``
with the emulated out-of-memory line, no traceback. Real ranks, real process groups; the profiles are
synthetic (the planner's own tests check its arithmetic), with the training script's real model."""
from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from hgcli.config.cluster import load_cluster
from hgcli.node.bench.memory import model_memory
from hgcli.plan.files import write_plan
from hgcli.plan.placement import make_plan
from hgcli.plan.slowdowns import with_slowdowns
from hgcli.schema.stages import ActivationSample, Engine, JobSpec
from tests.launch.hg import Hg
from tests.unit.plan_clusters import Kind, cluster

from .helpers import run_ok, script
from .scripts.memory_train import Net

pytestmark = pytest.mark.slow
BIG, SMALL = Kind("big card", 1.0, 64), Kind("small card", 1.0, 3)


def mixed(tmp_path, kinds):
    """The cluster file (emulated devices of ``kinds`` at one speed: no pacing) and its auto plan."""
    path = tmp_path / "cluster.toml"
    names = ", ".join(json.dumps(k.name) for k in kinds)
    path.write_text(f'[[nodes]]\nname = "local"\nhost = "localhost"\npython = {json.dumps(sys.executable)}\n'
                    f'emulate = {{ devices = [{names}], speed = [{", ".join("1.0" for _ in kinds)}], '
                    f'memory_mib = [{", ".join(str(k.memory_mib) for k in kinds)}] }}\n')
    declared = load_cluster(path)
    inventory, profiles = cluster([list(kinds)], fingerprint=declared.fingerprint(), names=["local"])
    need = replace(model_memory(Net()), activations=(ActivationSample(8, 96 << 10), ActivationSample(32, 384 << 10)))
    profiles = replace(profiles, devices=tuple(replace(d, memory=need) for d in profiles.devices))
    return path, declared, make_plan(inventory, profiles, JobSpec(global_batch=8 * len(kinds)))


def test_small_devices_train_sharded_under_their_memory(tmp_path):
    _, declared, plan = mixed(tmp_path, (BIG, BIG, SMALL, SMALL))
    assert [g.engine for g in plan.groups] == [Engine.FSDP] and len(plan.workers) == 4
    plan = with_slowdowns(plan, declared)           # what launch does: the devices' memory joins
    assert [r.memory_mib for r in plan.workers] == [64, 64, 3, 3]
    result = run_ok(plan, script("memory_train.py"), tmp_path, timeout_s=180)
    finish = {r["rank"]: r for r in result.metrics if r.get("event") == "finish"}
    assert sorted(finish) == [0, 1, 2, 3]
    for r in plan.workers:
        peak = finish[r.rank]["accounted_peak_mib"]
        # Over its quarter of AdamW's state (1 MiB) with the gathered units and activations, under the cap.
        assert 1.0 < peak < r.memory_mib, (r.rank, peak)
        assert finish[r.rank]["peak_rss_growth_mib"] is not None and finish[r.rank]["cuda_max_allocated_mib"] is None


def test_a_replica_on_a_small_device_fails_with_the_out_of_memory_line(tmp_path, monkeypatch):
    path, _, plan = mixed(tmp_path, (BIG, SMALL))        # two ranks: the small one fails
    ddp = replace(plan, groups=tuple(replace(g, engine=Engine.DDP) for g in plan.groups),
                  ranks=tuple(replace(r, micro_batches=1, memory=None) for r in plan.ranks))
    write_plan(tmp_path / "plan.json", ddp)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    hg = Hg(tmp_path, home, tmp_path / "state")
    code, out, err = hg.run("-c", str(path), "--plan", str(tmp_path / "plan.json"), "--grace", "2", "--",
                            sys.executable, str(script("memory_train.py")[1]), timeout=300)
    assert code == 1, err
    lines = [line for line in err.splitlines() if "emulated device out of memory" in line]
    assert lines, err
    tag, said = lines[0].split(" | ", 1)
    assert tag == "local:1"
    # torch.distributed's own excepthook tags the line with the rank, as it tags a traceback.
    assert said.startswith(f"[rank{tag[-1]}]: hgtrain: emulated device out of memory: a step at micro-batch 8 needs ")
    assert said.split(" MiB, ")[1].startswith(f"gpu{tag[-1]}@local has 3 MiB")
    assert not [line for line in err.splitlines() if line.startswith(tag) and "Traceback" in line], err
