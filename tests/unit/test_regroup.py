"""``launch --adapt``'s re-grouping decision (launch/adapt.py), from a real board fed the workers'
``rates`` records and a real planner on stored profiles (no processes): straggling workers move an
all-reduce job to asynchronous groups when the fitted cost model predicts a gain, never before a
snapshot exists, once, and only for the planner's own auto plans."""
from __future__ import annotations

from pathlib import Path

from hgcli.bench.profiles import store_profiles
from hgcli.launch import adapt
from hgcli.launch.adapt import RegroupWatch, snapshot_every, watched
from hgcli.launch.request import LaunchRequest
from hgcli.launch.metrics import MetricsBoard
from hgcli.plan.pipeline import replan_on
from hgcli.plan.strategy import AUTO_MARGIN
from hgcli.schema.records import RatesRecord, RegroupRecord, SnapshotRecord, encode
from hgcli.schema.stages import Cluster, JobSpec, NodeSpec, Strategy
from tests.bench_inventory import store_inventory
from tests.unit.plan_clusters import A100 as FAST, T4 as SLOW, cluster, link


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored() -> tuple[Cluster, LaunchRequest]:
    spec = Cluster(nodes=(NodeSpec(name="n0", host="10.0.0.1"), NodeSpec(name="n1", host="10.0.0.2")))
    inventory, profiles = cluster([[FAST, FAST], [SLOW, SLOW]], fingerprint=spec.fingerprint(),
                                  links=(link(0, 1, 10.0),))
    store_inventory(inventory)
    store_profiles(profiles)
    return spec, LaunchRequest(command=("python", "train.py"), cluster=spec)


def board_with(plan, noise: float | None, snapshot: bool = True) -> MetricsBoard:
    board = MetricsBoard(plan)
    for r in plan.workers:
        batch = r.batch_size or 1
        board.add(r.rank, encode(RatesRecord(group=r.group or 0, step=100,
                                             compute_samples_per_s=r.benched_samples_per_s or 100.0,
                                             samples=100 * batch, steps=100, compute_noise=noise)))
        if snapshot:
            board.add(r.rank, encode(SnapshotRecord(step=40)))
    return board


def test_straggling_workers_regroup_an_allreduce_job_once_the_fitted_model_predicts_a_gain(private_state_dir):
    spec, request = stored()
    plan = replan_on(spec, JobSpec(), ["n0", "n1"])
    assert plan.strategy is Strategy.ALLREDUCE and watched(request, plan)
    clock = Clock()

    calm = RegroupWatch(request, plan, "job", clock=clock)
    clock.now += adapt.WARMUP_S
    assert calm.check(board_with(plan, 0.0)) is None and "allreduce" in calm.last

    clock.now = 1000.0
    watch = RegroupWatch(request, plan, "job", clock=clock)
    noisy = board_with(plan, 1.0)
    assert watch.check(noisy) is None                  # still warming up
    clock.now += adapt.WARMUP_S
    regroup = watch.check(noisy)
    assert regroup is not None and regroup.plan.ps_shards and len(regroup.plan.groups) == 2
    assert regroup.predicted_new >= regroup.predicted_now * (1 + adapt.GAIN) > 0
    assert "compute noise up to 1.00" in regroup.reason and regroup.plan.global_batch == plan.global_batch
    clock.now += 100
    assert watch.check(noisy) is None                  # once per job


def test_no_regrouping_before_every_worker_reports_its_noise_or_before_a_snapshot(private_state_dir):
    spec, request = stored()
    plan = replan_on(spec, JobSpec(), ["n0", "n1"])
    clock = Clock()
    watch = RegroupWatch(request, plan, "job", clock=clock)
    clock.now += adapt.WARMUP_S
    assert watch.check(board_with(plan, 1.0, snapshot=False)) is None and "snapshot" in watch.last
    assert watch.check(board_with(plan, None)) is None and "noise" in watch.last
    clock.now += adapt.CHECK_EVERY_S
    assert watch.check(board_with(plan, 1.0)) is not None


def test_only_the_planners_auto_allreduce_plans_are_watched(private_state_dir, tmp_path):
    spec, request = stored()
    plan = replan_on(spec, JobSpec(), ["n0", "n1"])
    hybrid = replan_on(spec, JobSpec(strategy=Strategy.HYBRID), ["n0", "n1"])
    assert watched(request, plan) and not watched(request, hybrid)
    for other in (LaunchRequest(command=request.command, cluster=spec, adapt=False),
                  LaunchRequest(command=request.command, cluster=spec, job=JobSpec(strategy=Strategy.ALLREDUCE)),
                  LaunchRequest(command=request.command, cluster=spec, plan_file=Path(tmp_path / "plan.json"))):
        assert not watched(other, plan)


def test_a_watched_job_snapshots_about_every_ten_seconds_of_predicted_steps(private_state_dir):
    spec, _ = stored()
    plan = replan_on(spec, JobSpec(), ["n0", "n1"])
    per_step = sum(r.batch_size or 0 for r in plan.workers)
    rate = plan.predicted_samples_per_s[plan.strategy.value]
    assert abs(snapshot_every(plan) - adapt.SNAPSHOT_S * rate / per_step) <= 1


def test_the_launchers_regroup_record_is_a_mark_on_the_jobs_time_line(private_state_dir):
    from hgcli.launch.series import Series

    spec, _ = stored()
    plan = replan_on(spec, JobSpec(), ["n0", "n1"])
    series = Series(plan)
    series.add(0, {"time": 100.0, "step": 1, "samples": 32, "loss": 1.0})
    regroup = RegroupRecord(attempt=1, strategy=Strategy.HYBRID, groups=((0,), (1,)), predicted_before=2000.0,
                            predicted_after=2600.0)
    points = series.add(0, {"time": 130.0, **encode(regroup)})
    assert [(p.run, p.tag, p.value, p.step) for p in points] == [("job", "regroup", 1.3, 30)]


def recent_board(plan, recent_noise: float | None, run_noise: float = 1.0) -> MetricsBoard:
    """A board of a re-grouped attempt: the run's noise is its straggling past, the recent figures
    say how its last steps went."""
    board = MetricsBoard(plan)
    for r in plan.workers:
        batch, rate = r.batch_size or 1, r.benched_samples_per_s or 100.0
        board.add(r.rank, encode(RatesRecord(group=r.group or 0, step=100, compute_samples_per_s=rate,
                                             samples=100 * batch, steps=100, compute_noise=run_noise,
                                             recent_samples_per_s=rate, recent_noise=recent_noise)))
    board.add(plan.groups[0].ranks[0], encode(SnapshotRecord(step=60)))
    return board


def test_a_regrouped_job_goes_back_to_allreduce_when_its_last_steps_no_longer_straggle(private_state_dir):
    spec, request = stored()
    allreduce = replan_on(spec, JobSpec(), ["n0", "n1"])
    hybrid = replan_on(spec, JobSpec(strategy=Strategy.HYBRID), ["n0", "n1"])
    assert hybrid.ps_shards and adapt.watched_back(request, hybrid) and not adapt.watched_back(request, allreduce)
    clock = Clock()

    still = RegroupWatch(request, hybrid, "job", clock=clock, back=True)
    clock.now += adapt.WARMUP_S
    assert still.check(recent_board(hybrid, 1.0)) is None and "recent noise up to 1.00" in still.last

    clock.now = 1000.0
    watch = RegroupWatch(request, hybrid, "job", clock=clock, back=True)
    recovered = recent_board(hybrid, 0.0)      # the run's noise still says 1.0: the recent figures decide
    clock.now += adapt.WARMUP_S
    assert watch.check(recovered) is None      # one look is not enough
    clock.now += adapt.CHECK_EVERY_S
    back = watch.check(recovered)
    assert back is not None and not back.plan.ps_shards and back.plan.strategy is Strategy.ALLREDUCE
    assert back.predicted_now <= back.predicted_new * (1 + AUTO_MARGIN) and back.predicted_new > 0
    assert "no longer straggle" in back.reason and back.plan.global_batch == hybrid.global_batch
    clock.now += 100
    assert watch.check(recovered) is None      # once


def test_a_look_that_does_not_predict_the_gain_resets_the_way_backs_count(private_state_dir):
    spec, request = stored()
    hybrid = replan_on(spec, JobSpec(strategy=Strategy.HYBRID), ["n0", "n1"])
    clock = Clock()
    watch = RegroupWatch(request, hybrid, "job", clock=clock, back=True)
    clock.now += adapt.WARMUP_S
    assert watch.check(recent_board(hybrid, 0.0)) is None
    clock.now += adapt.CHECK_EVERY_S
    assert watch.check(recent_board(hybrid, 1.0)) is None     # straggling again: the count restarts
    clock.now += adapt.CHECK_EVERY_S
    assert watch.check(recent_board(hybrid, 0.0)) is None
    clock.now += adapt.CHECK_EVERY_S
    assert watch.check(recent_board(hybrid, 0.0)) is not None


def test_a_regrouped_plan_snapshots_about_every_ten_seconds_of_its_first_groups_steps(private_state_dir):
    from hgcli.launch.metrics import group_predictions

    spec, _ = stored()
    hybrid = replan_on(spec, JobSpec(strategy=Strategy.HYBRID), ["n0", "n1"])
    first = hybrid.groups[0]
    rate = group_predictions(hybrid)[0][str(first.id)]
    per_step = sum(hybrid.rank(r).batch_size or 0 for r in first.ranks)
    assert abs(snapshot_every(hybrid) - adapt.SNAPSHOT_S * rate / per_step) <= 1
