"""Plans that fit memory (docs/planning.md, "Memory"): each group's engine by what its devices hold,
micro-batches where memory caps a device below its share, the one-line refusal, and the new fields
of profiles and plans, old files still loading. Synthetic profiles (plan_clusters.py) with the
model's memory profile added, so every figure is checked against arithmetic done here."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from hgcli import state
from hgcli.bench.cluster import DeviceTarget, emulated_profile
from hgcli.cli import main
from hgcli.config.cluster import default_cluster
from hgcli.errors import UsageError
from hgcli.plan.placement import make_plan
from hgcli.render.plan import plan_tree
from hgcli.schema.stages import (
    ActivationSample, DeviceProfile, Engine, JobSpec, Measurement, MemoryProfile, Plan, Profiles, RankPlan, StepSample,
    Strategy, from_dict, to_dict,
)
from tests.unit.plan_clusters import Kind, cluster

GIB = 1 << 30
# 1.5 billion fp32 parameters: 24 GiB of AdamW state, in 20 units of 0.3 GiB; 0.2 GiB + 0.1 per sample.
PARAMS = 6 * GIB
MODEL = MemoryProfile(parameter_bytes=PARAMS, state_bytes=4 * PARAMS, largest_unit_bytes=int(0.3 * GIB),
                      activations=(ActivationSample(8, int(1.0 * GIB)), ActivationSample(128, int(13.0 * GIB))))
BIG = Kind("NVIDIA A100-SXM4-40GB", 1.0, 40960)
SMALL = Kind("Tesla T4", 0.25, 16384)
TINY = Kind("small card", 0.25, 12288)


def activations(batch: int) -> float:
    return 0.2 * GIB + 0.1 * GIB * batch


def with_model(profiles: Profiles, model: MemoryProfile = MODEL) -> Profiles:
    return replace(profiles, devices=tuple(replace(d, memory=model) for d in profiles.devices))


def mixed(kinds: list[Kind], model: MemoryProfile = MODEL):
    inventory, profiles = cluster([kinds])
    return inventory, with_model(profiles, model)


def test_small_devices_that_hold_no_replica_train_sharded_within_their_memory():
    inventory, profiles = mixed([BIG, BIG, SMALL, SMALL])
    # As before (a replica on every device): the T4s cannot hold the 24 GiB state and are left out.
    today = make_plan(inventory, profiles, JobSpec(global_batch=1024, engine=Engine.DDP))
    assert [r.device for r in today.workers] == ["gpu0", "gpu1"] and [g.engine for g in today.groups] == [Engine.DDP]
    assert "gpu2@n0 (cannot hold a DDP replica with its optimizer state and one sample in 16384 MiB" in today.reason
    plan = make_plan(inventory, profiles, JobSpec(global_batch=1024))
    assert plan.strategy is Strategy.ALLREDUCE and "cannot hold a replica" in plan.reason
    assert [g.engine for g in plan.groups] == [Engine.FSDP] and len(plan.workers) == 4
    assert sum(r.batch_size for r in plan.workers) == 1024
    for r in plan.workers:
        usable = 0.9 * (40960 if r.device in ("gpu0", "gpu1") else 16384) * 2**20
        state_held = 4 * PARAMS / 4 + 2 * 0.3 * GIB              # a quarter of the state, two units gathered
        micro = -(-r.batch_size // r.micro_batches)
        assert state_held + activations(micro) <= usable          # every rank under its cap
        if r.micro_batches > 1:                                   # and no more micro-batches than needed
            assert state_held + activations(-(-r.batch_size // (r.micro_batches - 1))) > usable
        assert r.memory.state_gib == pytest.approx(6.6, abs=1e-3) and not r.memory.offload
        assert r.memory.activation_gib == pytest.approx(activations(micro) / GIB, abs=1e-3)
        assert r.memory.headroom_gib == pytest.approx((usable - state_held - activations(micro)) / GIB, abs=2e-3)
    # Every device's share of the speed is more than its memory holds at once: micro-batches.
    assert all(r.micro_batches == 2 for r in plan.workers)
    assert "; 4 device(s) run their batch as micro-batches" in plan.reason and "OFFLOAD" not in plan.reason
    # Priced with the fixed cost paid once per micro-batch: (2 a + c b) / speed.
    for r, kind in zip(plan.workers, [BIG, BIG, SMALL, SMALL]):
        step = (2 * kind.a + kind.c * r.batch_size) / kind.speed
        assert r.benched_samples_per_s == pytest.approx(r.batch_size / step, rel=1e-3)


def test_a_group_that_cannot_shard_its_state_in_memory_offloads_it():
    inventory, profiles = mixed([BIG, TINY])
    plan = make_plan(inventory, profiles, JobSpec(global_batch=64))
    # 24 / 2 + 0.6 GiB does not fit the small card's 10.8 usable GiB: fsdp with the state offloaded.
    assert [g.engine for g in plan.groups] == [Engine.FSDP]
    assert all(r.memory.offload and r.memory.state_gib == pytest.approx(0.6, abs=1e-3) for r in plan.workers)
    assert "fsdp+offload · state 0.60 GiB" in str(plan_tree(plan).children[0].children[1].label)
    assert ("; group(s) 0 keep their state in host memory: launch with --env HGTRAIN_FSDP_OFFLOAD=1; engine by "
            "cost: fsdp+offload on 2 device(s)") in plan.reason


def test_a_model_that_fits_nowhere_is_refused_in_one_line():
    huge = replace(MODEL, largest_unit_bytes=8 * GIB)      # two gathered units: 16 GiB on any rank
    inventory, profiles = mixed([SMALL, SMALL], huge)
    with pytest.raises(UsageError) as refused:
        make_plan(inventory, profiles, JobSpec(global_batch=64))
    assert str(refused.value) == (
        "the model does not fit: its training state is 24.00 GiB (parameters, gradients and AdamW's two "
        "moments), the cluster's 2 device(s) have 32.00 GiB in all, the smallest gpu0@n0 16.00 GiB; even "
        "sharded over any number of devices with the state offloaded, a rank needs 16.30 GiB (one sample's "
        "activations and 2 of its largest unit, 8.00 GiB, gathered): devices with more memory, or a model "
        "with smaller layers")
    with pytest.raises(UsageError, match="each device would hold a whole replica: --engine auto shards"):
        make_plan(*mixed([SMALL, SMALL]), JobSpec(global_batch=64, engine=Engine.DDP))


def test_cli_refuses_with_exit_2_and_shows_memory_per_device(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")          # a rank's line whole
    fingerprint = default_cluster().fingerprint()
    inventory, profiles = cluster([[BIG, BIG, SMALL, SMALL]], fingerprint=fingerprint, names=["local"])
    folder = state.cluster_dir(fingerprint)
    state.write_json(folder / "inventory.json", to_dict(replace(inventory, probed_at=time.time())))
    state.write_json(folder / "profiles.json", to_dict(with_model(profiles)))
    assert main(["plan", "--global-batch", "256"]) == 0
    out = capsys.readouterr().out
    assert "fsdp · state 6.60 GiB · activations" in out and "headroom" in out
    assert main(["plan", "--json", "--global-batch", "256"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert set(raw["ranks"][0]["memory"]) == {"state_gib", "activation_gib", "usable_gib", "headroom_gib", "offload"}
    assert raw["ranks"][0]["micro_batches"] >= 1 and raw["groups"][0]["engine"] == "fsdp"
    huge = replace(MODEL, largest_unit_bytes=30 * GIB)
    state.write_json(folder / "profiles.json", to_dict(with_model(profiles, huge)))
    assert main(["plan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()     # the stages' lines, then the error's one
    assert [line for line in err if "error" in line] == err[-1:]
    assert err[-1].startswith("hgtrain: error: the model does not fit: its training state is 24.00 GiB")


def test_old_plan_and_profile_files_still_load_and_plan_as_before():
    rank = from_dict(RankPlan, {"rank": 0, "role": "worker", "node": "n0", "device": "gpu0", "batch_size": 8})
    assert rank.micro_batches == 1 and rank.memory is None
    old = {"node": "n0", "device": "gpu0", "name": "T4", "emulated": True, "speed": 1.0, "memory_total_mib": 100}
    assert from_dict(DeviceProfile, old).memory is None
    inventory, profiles = cluster([[BIG, BIG, SMALL, SMALL]])      # no memory profile: a replica each
    plan = make_plan(inventory, profiles, JobSpec(global_batch=256))
    assert all(r.memory is None and r.micro_batches == 1 for r in plan.workers)
    assert {g.engine for g in plan.groups} == {Engine.DDP}
    fitted = make_plan(*mixed([BIG, BIG, SMALL, SMALL]), JobSpec(global_batch=256))
    assert from_dict(Plan, json.loads(json.dumps(to_dict(fitted)))) == fitted


def test_emulated_devices_keep_their_steps_where_a_sharded_rank_fits():
    m = MemoryProfile(parameter_bytes=4 << 20, state_bytes=16 << 20, largest_unit_bytes=1 << 20,
                      activations=(ActivationSample(8, 2 << 20),))
    base = DeviceProfile(node="a", device="gpu0", name="A100", emulated=True, speed=1.0, memory_total_mib=100,
                         steps=(StepSample(8, _m(0.01), 14), StepSample(64, _m(0.05), 40)), memory=m)
    small = emulated_profile(base, DeviceTarget("gpu1", "T4", True, 1.0, 10))
    assert small.error is None and small.steps == base.steps        # 2 x 1 MiB + one sample fits 10 MiB
    tiny = emulated_profile(base, DeviceTarget("gpu2", "T4", True, 1.0, 2))
    assert tiny.error == "out of memory at batch 8: a step needs 14 MiB, the emulated device has 2 MiB"


def _m(x: float) -> Measurement:
    return Measurement(x, x, x, 3)
