"""Plans from a node's devices benched together (DeviceProfile.together, devices.beside_neighbours):
the contention the together bench measured is in each device's cost and the prediction; the ideal
stays each device's own speed; profiles without the field plan as before."""
from __future__ import annotations

import dataclasses
import json

import pytest

from hgcli.plan.contention import contention_note
from hgcli.plan.costed import Device
from hgcli.plan.delays import compute_cpu
from hgcli.plan.placement import make_plan
from hgcli.schema.stages import (Inventory, JobSpec, Measurement, MeasuredRate, Profiles, ScriptRates,
                                 Strategy, TogetherProfile, TogetherStep, from_dict, to_dict)

from tests.unit.plan_clusters import A100, T4, Kind, cluster, measured

FAST, SLOW = Kind("fast", 1.0, None, a=0.0), Kind("slow", 0.25, None, a=0.0)


def together(kind: Kind, factor: float, batches: tuple[int, ...] = (16, 64), devices: int = 2) -> TogetherProfile:
    """What the together bench measures of ``kind`` when its steps take ``factor`` x its alone time."""
    return TogetherProfile(devices=devices, steps=tuple(
        TogetherStep(b, measured(kind.seconds(b) * factor), kind.seconds(b) * factor) for b in batches))


def with_together(profiles: Profiles, figures: dict[str, TogetherProfile]) -> Profiles:
    """``profiles`` whose devices named in ``figures`` (by "node/device") carry those together figures."""
    devices = tuple(dataclasses.replace(d, together=figures[f"{d.node}/{d.device}"])
                    if f"{d.node}/{d.device}" in figures else d for d in profiles.devices)
    return dataclasses.replace(profiles, devices=devices)


def test_a_device_slower_beside_its_neighbours_gets_a_smaller_batch_and_the_ideal_stays_alone():
    inventory, profiles = cluster([[FAST, SLOW]])
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=100)
    alone = make_plan(inventory, profiles, job)
    assert [r.batch_size for r in alone.workers] == [80, 20] and not alone.bench_together
    # Together, the fast device's steps took twice its alone time; the slow one's were as alone.
    plan = make_plan(inventory, with_together(profiles, {"n0/gpu0": together(FAST, 2.0), "n0/gpu1": together(SLOW, 1.0)}),
                     job)
    assert [r.batch_size for r in plan.workers] == [67, 33]
    assert plan.bench_together and "benched together" in plan.reason
    assert [r.benched_samples_per_s for r in plan.workers] == pytest.approx([1000.0, 500.0])
    # The prediction holds the contention: at most the devices' together speeds, 1,000 + 500.
    assert plan.predicted_samples_per_s["allreduce"] <= 1500.0 + 1e-6
    assert alone.predicted_samples_per_s["allreduce"] > 2000.0
    # The ideal is each device's own (alone) speed at the plan's batches: 2,000 + 500.
    assert plan.predicted_samples_per_s["ideal"] == pytest.approx(2500.0)


def test_like_devices_keep_one_cost_scaled_by_the_median_of_their_factors():
    inventory, profiles = cluster([[A100, A100, A100]])
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=96)
    figures = {f"n0/gpu{i}": together(A100, f, devices=3) for i, f in enumerate((1.5, 2.0, 1.8))}
    plan = make_plan(inventory, with_together(profiles, figures), job)
    assert [r.batch_size for r in plan.workers] == [32, 32, 32]
    assert [r.benched_samples_per_s for r in plan.workers] == pytest.approx([32 / (A100.seconds(32) * 1.8)] * 3)


def test_a_factor_is_the_median_over_phases_and_never_below_one():
    inventory, profiles = cluster([[FAST, SLOW]])
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=100)
    three = TogetherProfile(2, tuple(TogetherStep(b, measured(1.0), FAST.seconds(b) * f)
                                     for b, f in ((8, 1.2), (32, 3.0), (128, 1.4))))
    plan = make_plan(inventory, with_together(profiles, {"n0/gpu0": three}), job)
    assert plan.workers[0].benched_samples_per_s == pytest.approx(2000.0 / 1.4)
    # Faster together than alone is the bench's noise: the alone cost stays (scaled by 1).
    faster = make_plan(inventory, with_together(profiles, {"n0/gpu0": together(FAST, 0.7)}), job)
    assert [r.benched_samples_per_s for r in faster.workers] == pytest.approx([2000.0, 500.0])


def test_profiles_without_together_figures_plan_as_before_and_old_files_load():
    inventory, profiles = cluster([[A100, A100, T4, T4]])
    job = JobSpec()
    plan = make_plan(inventory, profiles, job)
    assert not plan.bench_together and "benched together" not in plan.reason
    # A profiles file written before the field (no "together" key) loads with None and plans the same.
    data = to_dict(profiles)
    for d in data["devices"]:
        del d["together"]
    old = from_dict(Profiles, json.loads(json.dumps(data)))
    assert all(d.together is None for d in old.devices)
    assert make_plan(inventory, old, job) == plan
    # And a plan file from before bench_together reads as alone figures.
    plan_data = to_dict(plan)
    del plan_data["bench_together"]
    assert not from_dict(type(plan), plan_data).bench_together


def test_together_figures_survive_the_stored_round_trip():
    inventory, profiles = cluster([[FAST, SLOW]])
    stored = with_together(profiles, {"n0/gpu0": together(FAST, 2.0), "n0/gpu1": together(SLOW, 1.1)})
    again = from_dict(Profiles, json.loads(json.dumps(to_dict(stored))))
    assert again == stored
    assert again.devices[0].together == together(FAST, 2.0)


def test_rates_measured_in_a_job_fit_on_top_of_the_together_cost():
    inventory, profiles = cluster([[FAST, SLOW]])
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=100)
    stored = with_together(profiles, {"n0/gpu0": together(FAST, 2.0), "n0/gpu1": together(SLOW, 1.0)})
    rates = ScriptRates(cluster="fp", script="module train", job_id="hg-1", measured_at=1.0, bench_measured_at=0.0,
                        rates=(MeasuredRate("n0", "gpu0", 67, 1500.0), MeasuredRate("n0", "gpu1", 33, 500.0)))
    plan = make_plan(inventory, stored, job, rates)
    # What the job measured wins: 1,500 and 500 samples/s at their batches.
    assert plan.fitted_to == "hg-1" and "measured in job hg-1" in plan.reason
    assert [r.benched_samples_per_s for r in plan.workers] == pytest.approx([1500.0, 500.0], rel=0.02)
    assert plan.predicted_samples_per_s["ideal"] == pytest.approx(sum(
        b / FAST.seconds(b) if r.device == "gpu0" else b / SLOW.seconds(b)
        for r, b in zip(plan.workers, [r.batch_size for r in plan.workers])))


def test_a_device_benched_together_does_not_crowd_its_node_a_second_time():
    d = Device(node=0, device="gpu0", emulated=True, speed=1.0, a=0.0, c=0.001, cap=None)
    assert compute_cpu(d, 10) == pytest.approx(0.01)
    assert compute_cpu(dataclasses.replace(d, together=True), 10) == 0.0
    # On a node of 2 cores asked for 2.5 by its emulated devices, the cost model crowds alone figures
    # (x busy / cores) but not together figures, which had that contention in them.
    inventory, profiles = cluster([[A100, A100, T4, T4]])
    two_cores = Inventory(inventory.cluster, tuple(dataclasses.replace(n, cpu_cores=2) for n in inventory.nodes))
    job = JobSpec(strategy=Strategy.PS, global_batch=128)
    alone = make_plan(two_cores, profiles, job)
    once = {f"n0/gpu{i}": together(k, 1.0, batches=(8, 32), devices=4) for i, k in enumerate((A100, A100, T4, T4))}
    same_speed = make_plan(two_cores, with_together(profiles, once), job)
    assert [r.batch_size for r in same_speed.workers] == [r.batch_size for r in alone.workers]
    assert same_speed.predicted_samples_per_s["ps"] > alone.predicted_samples_per_s["ps"] * 1.2


def test_the_contention_note_says_whether_the_prediction_holds_it():
    inventory, profiles = cluster([[A100, A100, T4, T4]])
    two_cores = Inventory(inventory.cluster, tuple(dataclasses.replace(n, cpu_cores=2) for n in inventory.nodes))
    plan = make_plan(two_cores, profiles, JobSpec())
    note = contention_note(plan, two_cores)
    assert note is not None and "in every measured figure;" in note and "prediction" not in note
    together_note = contention_note(dataclasses.replace(plan, bench_together=True), two_cores)
    assert together_note is not None and "in the prediction (their bench ran them together), not in the ideal" in together_note


def test_uneven_steps_beside_the_neighbours_make_a_synchronous_group_wait_for_its_latest_member():
    from hgcli.plan.delays import straggle

    inventory, profiles = cluster([[A100, A100, A100, A100]])
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=128)
    even = {f"n0/gpu{i}": together(A100, 1.0, devices=4) for i in range(4)}
    # The same mean steps, but each window's fastest step 1 / 1.5 of its mean: noise 0.5.
    uneven = {f"n0/gpu{i}": TogetherProfile(4, tuple(
        TogetherStep(b, Measurement(A100.seconds(b), A100.seconds(b) / 1.5, 2 * A100.seconds(b), 8), A100.seconds(b))
        for b in (16, 64))) for i in range(4)}
    steady = make_plan(inventory, with_together(profiles, even), job)
    waiting = make_plan(inventory, with_together(profiles, uneven), job)
    assert [r.benched_samples_per_s for r in waiting.workers] == [r.benched_samples_per_s for r in steady.workers]
    ratio = steady.predicted_samples_per_s["allreduce"] / waiting.predicted_samples_per_s["allreduce"]
    assert ratio == pytest.approx(straggle(0.5, 4), rel=0.05) and ratio > 1.3
