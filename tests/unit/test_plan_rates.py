"""Plans fitted to a script's measured compute (hgcli/bench/rates.py, devices.fit_to_rates): what
one job measured sets the next plan's per-device costs; the stored file, its key and its staleness."""
from __future__ import annotations

import dataclasses
import json
import os
import stat

import pytest

from hgcli.bench.rates import load_rates, rates_of_job, rates_path, script_identity, store_rates
from hgcli.errors import StateError
from hgcli.plan.pipeline import script_rates
from hgcli.plan.placement import make_plan
from hgcli.schema.stages import JobSpec, MeasuredRate, ScriptRates, Slowdown, Strategy

from tests.unit.plan_clusters import A100, T4, Kind, cluster

FAST, SLOW = Kind("fast", 1.0, None, a=0.0), Kind("slow", 0.25, None, a=0.0)


def rates(*measured: tuple, job: str = "hg-1", bench: float = 0.0) -> ScriptRates:
    """(node, device, batch, samples/s[, noise]) each."""
    return ScriptRates(cluster="fp", script="module train", job_id=job, measured_at=1.0, bench_measured_at=bench,
                       rates=tuple(MeasuredRate(*m) for m in measured))


def test_a_device_slower_in_training_than_benched_gets_a_smaller_batch_and_the_prediction_follows():
    inventory, profiles = cluster([[FAST, SLOW]])
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=100)
    benched = make_plan(inventory, profiles, job)
    assert [r.batch_size for r in benched.workers] == [80, 20] and benched.fitted_to is None
    assert [r.benched_samples_per_s for r in benched.workers] == pytest.approx([2000.0, 500.0])
    # The fast device trained as benched (2,000 samples/s); the slow one at half its bench (250, not 500).
    fitted = make_plan(inventory, profiles, job, rates(("n0", "gpu0", 80, 2000.0), ("n0", "gpu1", 20, 250.0)))
    assert [r.batch_size for r in fitted.workers] == [89, 11]
    assert fitted.fitted_to == "hg-1" and "measured in job hg-1" in fitted.reason
    # The ideal stays the devices' own speeds (the bench's) at the new batches: 2,000 + 500.
    assert fitted.predicted_samples_per_s["ideal"] == pytest.approx(2500.0)
    assert fitted.predicted_samples_per_s["allreduce"] < 2250.0
    assert [r.benched_samples_per_s for r in fitted.workers] == pytest.approx([2000.0, 250.0])


def test_like_devices_keep_one_cost_fitted_to_their_median():
    inventory, profiles = cluster([[A100, A100, A100]])
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=96)
    alone = A100.seconds(32)
    measured = rates(*(("n0", f"gpu{i}", 32, 32 / (alone * f)) for i, f in enumerate((1.5, 2.0, 1.8))))
    plan = make_plan(inventory, profiles, job, measured)
    assert [r.batch_size for r in plan.workers] == [32, 32, 32]
    assert [r.benched_samples_per_s for r in plan.workers] == pytest.approx([32 / (alone * 1.8)] * 3, rel=1e-3)


def test_rates_of_other_devices_leave_the_bench_alone():
    inventory, profiles = cluster([[FAST, SLOW]])
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=100)
    plan = make_plan(inventory, profiles, job, rates(("elsewhere", "gpu0", 80, 10.0), ("n0", "gpu7", 20, 1.0)))
    assert plan == make_plan(inventory, profiles, job)


def test_a_fitted_node_is_not_crowded_twice():
    """Four emulated devices at speed 1 on two cores: the bench's costs are crowded by the cost model
    (they ask for four cores), a cost fitted to what they measured together already holds it."""
    inventory, profiles = cluster([[A100] * 4])
    inventory = dataclasses.replace(inventory, nodes=tuple(dataclasses.replace(n, cpu_cores=2) for n in inventory.nodes))
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=128)
    crowded = make_plan(inventory, profiles, job)
    same = rates(*(("n0", f"gpu{i}", 32, 32 / A100.seconds(32)) for i in range(4)))
    fitted = make_plan(inventory, profiles, job, same)
    assert fitted.predicted_samples_per_s["ideal"] == pytest.approx(crowded.predicted_samples_per_s["ideal"])
    assert fitted.predicted_samples_per_s["allreduce"] > 1.5 * crowded.predicted_samples_per_s["allreduce"]


def test_steps_that_straggled_in_training_move_the_plan_off_one_synchronous_group():
    """Two A100 and two T4 on one node: the bench's steps are even and auto keeps one all-reduce
    group. Measured at their benched speed but with a straggler every other step or so (noise 0.5),
    a group of four waits for its slowest member far more often than two groups of two do."""
    inventory, profiles = cluster([[A100, A100, T4, T4]])
    benched = make_plan(inventory, profiles, JobSpec())
    assert benched.strategy is Strategy.ALLREDUCE

    def measured(noise):
        return rates(*((r.node, r.device, r.batch_size, r.batch_size / k.seconds(r.batch_size), noise)
                       for r, k in zip(benched.workers, (A100, A100, T4, T4))))

    steady = make_plan(inventory, profiles, JobSpec(), measured(None))
    assert steady.strategy is Strategy.ALLREDUCE and steady.fitted_to == "hg-1"
    straggling = make_plan(inventory, profiles, JobSpec(), measured(0.5))
    assert straggling.strategy is Strategy.HYBRID and len(straggling.groups) == 2
    assert straggling.predicted_samples_per_s["allreduce"] < 0.8 * steady.predicted_samples_per_s["allreduce"]


def test_a_fitted_group_is_not_slowed_by_the_benched_group_ratio_again():
    """The bench's synchronous step of the node's devices measured their compute 1.5x slower in a group
    than free: the cost model stretches a benched member by it, not a fitted one (its measured rate
    was taken inside the group)."""
    from hgcli.schema.stages import GroupSyncProfile, Measurement

    inventory, profiles = cluster([[A100] * 4])
    sync = GroupSyncProfile(ranks=4, bytes=4_000_000, step_s=0.02, seconds=Measurement(0.001, 0.001, 0.001, 3),
                            batch=32, speed=1.0, compute_ratio=Measurement(1.5, 1.5, 1.5, 3))
    profiles = dataclasses.replace(profiles, devices=tuple(dataclasses.replace(p, group_sync=sync)
                                                           for p in profiles.devices))
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=128)
    benched = make_plan(inventory, profiles, job)
    fitted = make_plan(inventory, profiles, job, rates(*(("n0", f"gpu{i}", 32, 32 / A100.seconds(32)) for i in range(4))))
    step = A100.seconds(32)
    assert 128 / benched.predicted_samples_per_s["allreduce"] == pytest.approx(1.5 * step + 0.001, rel=0.02)
    assert 128 / fitted.predicted_samples_per_s["allreduce"] == pytest.approx(step + 0.001, rel=0.02)


@pytest.mark.parametrize("command, identity", [
    (("python", "-m", "pkg.train", "--epochs", "3"), "module pkg.train"),
    (("/venv/bin/python3", "-u", "-mpkg.train"), "module pkg.train"),
    (("python", "-u", "./jobs/train.py", "--lr", "0.1"), "script jobs/train.py"),
    (("bash", "run.sh", "x"), "script run.sh"),
    (("./trainer", "--config", "a.yaml"), "command ./trainer --config a.yaml"),
])
def test_a_script_is_its_module_or_path_not_its_arguments(command, identity):
    assert script_identity(command) == identity


def test_a_jobs_rates_leave_out_unreported_and_slowed_down_ranks(private_state_dir):
    from tests.launch.plans import local_cluster, make_plan as hand_plan

    plan = hand_plan(local_cluster(("a", "b")), [["a", "a", "b"]])
    slowed = dataclasses.replace(plan.ranks[1], slowdown=(Slowdown(1, 5.0, 4.0),))
    plan = dataclasses.replace(plan, ranks=(plan.ranks[0], slowed, *plan.ranks[2:]))
    got = rates_of_job(plan, "hg-7", ("python", "train.py"), 12.0, {0: (400.0, 31.5, 0.25), 1: (90.0, 16.0, None)})
    assert got is not None and got.script == "script train.py" and got.job_id == "hg-7"
    assert got.bench_measured_at == 12.0
    assert got.rates == (MeasuredRate(plan.ranks[0].node, plan.ranks[0].device, 31.5, 400.0, 0.25),)
    assert rates_of_job(plan, "hg-7", ("python", "train.py"), 12.0, {1: (90.0, 16.0, None)}) is None


def test_stored_rates_are_private_keyed_by_script_and_refused_when_unreadable(private_state_dir):
    stored = rates(("n0", "gpu0", 32.0, 100.0))
    path = store_rates(stored)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_rates("fp", "module train") == stored
    assert load_rates("fp", "module other") is None
    path.write_text(json.dumps({"cluster": "fp"}))
    with pytest.raises(StateError, match=str(rates_path("fp", "module train"))):
        load_rates("fp", "module train")


def test_rates_of_an_earlier_bench_are_not_used_and_the_stage_says_so(private_state_dir):
    _, profiles = cluster([[FAST]])
    said: list[str] = []
    store_rates(rates(("n0", "gpu0", 32.0, 100.0), bench=profiles.measured_at + 1))
    assert script_rates("fp", profiles, "module train", lambda stage, m: said.append(m)) is None
    assert said == ["planning from the bench alone: the rates job hg-1 measured for module train are of "
                    "an earlier bench"]
    store_rates(rates(("n0", "gpu0", 32.0, 100.0), bench=profiles.measured_at))
    assert script_rates("fp", profiles, "module train", lambda stage, m: said.append(m)) is not None
    assert said[-1].startswith("fitting the devices' costs to the compute job hg-1 measured for module train")
