"""The cost model's measured terms: the time(batch) fit, step noise, the PS exchange, CPU sharing."""
from __future__ import annotations

import dataclasses

import pytest

from hgcli.schema.stages import ExchangeProfile, GroupSyncProfile, JobSpec, Measurement, ModelSpec, StepSample, Strategy
from hgcli.plan.fit import _monotone, fit_time
from hgcli.plan.placement import make_plan
from hgcli.plan.delays import oversubscription, straggle
from hgcli.plan.network import INTRA_NODE_LATENCY_S

from tests.unit.plan_clusters import A100, T4, cluster, measured


def spread(low: float, median: float, high: float | None = None) -> Measurement:
    return Measurement(median=median, min=low, max=high if high is not None else median, repeats=7)


def with_steps(profile, steps):
    return dataclasses.replace(profile, steps=tuple(steps))


def test_fit_is_on_the_fastest_repeat_and_ignores_an_outlier_median():
    inventory, profiles = cluster([[A100]])
    exact = [(b, 0.001 + 0.0001 * b) for b in (4, 16, 64, 256)]
    # Every size's median is 10% above its fastest repeat, except one size whose median an outlier
    # repeat pushed to 3x.
    steps = [StepSample(b, spread(t, t * (3.0 if b == 16 else 1.1))) for b, t in exact]
    a, c, noise = fit_time(with_steps(profiles.devices[0], steps), 4e6)
    assert noise == pytest.approx(0.1 / 0.6931, rel=1e-3)      # median excess 10%, exponential delays
    assert a / (1 + noise) == pytest.approx(0.001, rel=1e-6)     # the noise-free line is exact
    assert c / (1 + noise) == pytest.approx(0.0001, rel=1e-6)


def test_a_non_monotone_measurement_is_pooled_never_a_negative_slope():
    assert _monotone([(16, 2.0), (64, 1.0), (128, 3.0)]) == [(16, 1.5), (64, 1.5), (128, 3.0)]
    inventory, profiles = cluster([[A100]])
    steps = [StepSample(16, measured(0.004)), StepSample(64, measured(0.002)), StepSample(128, measured(0.006))]
    a, c, _ = fit_time(with_steps(profiles.devices[0], steps), 4e6)
    assert a >= 0 and c > 0
    assert a + c * 16 <= a + c * 64 <= a + c * 128


# The example's step on an NVIDIA H200 (hgtrain bench on this project's GPU machine, 2026-11-30):
# (batch, fastest repeat, median) in seconds; fixed cost at every batch size measured.
H200_STEPS = [(32, 0.0017110189999982595, 0.0017778019999994399),
              (64, 0.0017018199999938588, 0.001738951499994812),
              (128, 0.0016166230000038695, 0.001735907999993458),
              (256, 0.0015081019999882983, 0.0016855750000033254),
              (512, 0.001584278000009931, 0.0017016874999953302),
              (1024, 0.001512581999989493, 0.0016285569999965332),
              (2048, 0.0015214550000024474, 0.001961965499994278)]


@pytest.mark.parametrize("digits", [None, 6])
def test_a_flat_step_time_is_a_fixed_cost_not_a_line_through_the_origin(digits):
    """A small model on a GPU takes as long at batch 2048 as at 32. Fitted through the origin (as it
    was), the H200 was predicted 111k samples/s at both global batches 32 and 2048, where it trained
    18k and 1.04M; a fixed cost predicts 64x more samples per second at the larger batch."""
    inventory, profiles = cluster([[A100]])
    # Rounded to 6 digits, the pooled times' slopes came out +3e-22 instead of -1e-22: both flat.
    r = (lambda v: v) if digits is None else (lambda v: round(v, digits))
    steps = [StepSample(b, spread(r(low), r(med))) for b, low, med in H200_STEPS]
    gpu = dataclasses.replace(with_steps(profiles.devices[0], steps), matmul_tflops={"fp32": measured(51.0)})
    a, c, noise = fit_time(gpu, 4 * 5514)
    assert a / (1 + noise) == pytest.approx(0.0015937, rel=1e-3)     # the pooled fastest repeats
    assert 0 < c * 2048 < 0.01 * a                                     # per-sample part: from the matmul rate
    profiles = dataclasses.replace(profiles, devices=(gpu,))
    rate = {gb: make_plan(inventory, profiles, JobSpec(global_batch=gb, model=ModelSpec("example", 5514)))
            .predicted_samples_per_s["allreduce"] for gb in (32, 2048)}
    assert rate[2048] / rate[32] == pytest.approx(64, rel=0.02)
    assert 32 / rate[32] == pytest.approx(a, rel=0.01)


def test_a_noisy_small_batch_does_not_leave_the_slow_device_one_sample():
    # The quick profile that gave the T4s batch 1 (benchmarks/cost_model_accuracy.py, issue 3): the
    # smallest size's median was inflated by one slow repeat, which made the fixed cost look larger
    # than a whole fast step. Fitted on the fastest repeats, the T4s get their share.
    inventory, profiles = cluster([[A100, A100, T4, T4]])
    devices = []
    for p in profiles.devices:
        slow = 1.0 / p.speed
        steps = [StepSample(16, spread(0.00118 * slow, 0.00199 * slow, 0.00228 * slow)),
                 StepSample(64, spread(0.0026 * slow, 0.00384 * slow)),
                 StepSample(128, spread(0.0048 * slow, 0.00584 * slow))]
        devices.append(with_steps(p, steps))
    profiles = dataclasses.replace(profiles, devices=tuple(devices))
    plan = make_plan(inventory, profiles, JobSpec(strategy=Strategy.ALLREDUCE, global_batch=256))
    batches = [r.batch_size for r in plan.workers]
    assert batches[2] >= 8 and batches[3] >= 8           # the median fit gave [127, 127, 1, 1]
    assert sum(batches) == 256


def test_synchronous_groups_wait_for_their_slowest_member():
    assert straggle(0.5, 1) == 1.0 and straggle(0.0, 64) == 1.0
    assert straggle(0.5, 4) == pytest.approx((1 + 0.5 * (1 + 1 / 2 + 1 / 3 + 1 / 4)) / 1.5)
    assert straggle(0.5, 4, accumulate=4) < straggle(0.5, 4)       # accumulated delays average out
    assert straggle(0.5, 4096) > straggle(0.5, 64) > straggle(0.5, 4)
    inventory, quiet = cluster([[A100] * 4])
    noisy = dataclasses.replace(quiet, devices=tuple(
        with_steps(p, [StepSample(s.batch_size, spread(s.seconds.median, 1.3 * s.seconds.median))
                       for s in p.steps]) for p in quiet.devices))
    job = JobSpec(strategy=Strategy.AUTO, global_batch=256)
    calm, jittery = make_plan(inventory, quiet, job), make_plan(inventory, noisy, job)
    # Noise costs the asynchronous PS only its mean; all-reduce also waits for the slowest of four.
    ratio_ps = jittery.predicted_samples_per_s["ps"] / calm.predicted_samples_per_s["ps"]
    ratio_ar = jittery.predicted_samples_per_s["allreduce"] / calm.predicted_samples_per_s["allreduce"]
    assert ratio_ar < ratio_ps < 1
    assert jittery.strategy is Strategy.ALLREDUCE and len(jittery.groups) == 1   # homogeneous: DDP


def exchange(round_trip: float, service: float, latency: float = 0.0005, nbytes: int = 4_000_000):
    return ExchangeProfile(bytes=nbytes, round_trip_s=measured(round_trip), latency_s=measured(latency),
                           service_s=measured(service))


def test_a_measured_ps_exchange_prices_the_push():
    inventory, profiles = cluster([[A100, A100, T4, T4]])
    job = JobSpec(strategy=Strategy.PS, global_batch=256)
    unmeasured = make_plan(inventory, profiles, job).predicted_samples_per_s["ps"]

    def predicted(round_trip: float, service: float) -> float:
        devices = tuple(dataclasses.replace(p, exchange=exchange(round_trip, service)) for p in profiles.devices)
        return make_plan(inventory, dataclasses.replace(profiles, devices=devices), job).predicted_samples_per_s["ps"]

    cheap, dear = predicted(0.001, 0.0002), predicted(0.010, 0.0002)
    assert dear < cheap
    # One PS serves every push one at a time: a service time longer than the workers' push
    # interval caps the total at 1 / service pushes per second.
    saturated = predicted(0.010, 0.050)
    assert saturated < dear
    assert saturated <= 256 / 4 * (1 / 0.050) * 1.01
    assert unmeasured != cheap


def test_emulated_devices_share_their_nodes_cores():
    fast = dataclasses.replace(A100, name="emulated A100", emulated=True)
    inventory, profiles = cluster([[fast] * 4], model=ModelSpec("tiny", 1000))
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=256)
    roomy = make_plan(inventory, profiles, job).predicted_samples_per_s["allreduce"]
    nodes = tuple(dataclasses.replace(n, cpu_cores=2) for n in inventory.nodes)
    crowded = make_plan(dataclasses.replace(inventory, nodes=nodes), profiles, job).predicted_samples_per_s
    # Four speed-1 emulated devices keep four cores busy: on two cores each runs at half speed.
    assert crowded["allreduce"] == pytest.approx(roomy / 2, rel=0.02)
    real = dataclasses.replace(fast, emulated=False)
    inventory, profiles = cluster([[real] * 4], model=ModelSpec("tiny", 1000))
    two = dataclasses.replace(inventory, nodes=tuple(dataclasses.replace(n, cpu_cores=2) for n in inventory.nodes))
    # Real GPUs compute off the CPU: not crowded; only their ring's latencies wait for a core (below).
    shared = make_plan(two, profiles, job).predicted_samples_per_s["allreduce"]
    assert 256 / shared - 256 / roomy == pytest.approx(2 * 3 * INTRA_NODE_LATENCY_S * (4 / 2 - 1), rel=1e-6)


def test_oversubscribed_cores_stretch_latencies_not_bandwidth():
    assert oversubscription(5, 2) == 2.5
    assert oversubscription(2, 2) == oversubscription(1, 2) == oversubscription(64, 0) == 1.0
    # The main job's shape, 2 A100 + 2 T4 ranks on one node plus the PS, with an RPC fixed cost far
    # above its per-byte part. Real GPUs, so no CPU crowding: on two cores only the waits differ.
    inventory, profiles = cluster([[A100, A100, T4, T4]], model=ModelSpec("tiny", 5000))
    devices = tuple(dataclasses.replace(p, exchange=exchange(0.0013, 0.0001, latency=0.0012, nbytes=20_000))
                    for p in profiles.devices)
    profiles = dataclasses.replace(profiles, devices=devices)
    job = JobSpec(strategy=Strategy.PS, global_batch=256, ps_ranks=1)

    def cost(cores: int | None):
        nodes = tuple(dataclasses.replace(n, cpu_cores=cores) for n in inventory.nodes)
        return make_plan(dataclasses.replace(inventory, nodes=nodes), profiles, job)

    many, two = cost(64), cost(2)
    assert two.predicted_samples_per_s["ps"] < many.predicted_samples_per_s["ps"]
    assert cost(None).predicted_samples_per_s["ps"] == pytest.approx(many.predicted_samples_per_s["ps"])


def test_mostly_sleeping_emulated_ranks_make_a_woken_process_wait_less():
    # All runnable (real GPUs spin): ranks / cores. Emulated devices asking for 0.25 of the two cores
    # (benchmarks/cost_model_accuracy.py's 2+2 cluster): the queue's 1 / (1 - 0.125), not x2.5.
    assert oversubscription(5, 2, demand=5.0) == 2.5
    assert oversubscription(5, 2, demand=0.25) == pytest.approx(1 / (1 - 0.125))
    assert oversubscription(5, 2, demand=1.8) == 2.5           # nearly saturated: the bound
    assert oversubscription(2, 2, demand=2.0) == 1.0           # a core per rank
    assert 1.0 < oversubscription(5, 2, demand=1.0) < oversubscription(5, 2, demand=1.5) <= 2.5


def test_one_size_measured_during_a_burst_of_load_does_not_bend_the_line():
    # benchmarks/cost_model_accuracy.py, run C: batch 128's fastest repeat was twice the others' line.
    inventory, profiles = cluster([[A100]])
    exact = {4: 0.0014, 16: 0.0018, 64: 0.0033, 128: 0.0053}
    steps = [StepSample(b, spread(t * (2.0 if b == 128 else 1.0), t * (2.2 if b == 128 else 1.1)))
             for b, t in exact.items()]
    a, c, noise = fit_time(with_steps(profiles.devices[0], steps), 4e6)
    line = [(a + c * b) / (1 + noise) for b in exact]
    assert all(abs(fit / t - 1) < 0.08 for fit, t in zip(line, exact.values()))
    assert noise == pytest.approx(0.1 / 0.6931, rel=0.1)


def test_a_single_shard_push_waits_for_cores_by_its_fixed_cost():
    """Only the RPC's fixed cost (waking its threads) waits for a core; the per-byte part does not.
    With one shard holding the whole model the wait used to cancel out (the stretched fixed cost
    was taken off the measured round trip)."""
    from hgcli.plan.batches import assign_batches
    from hgcli.plan.devices import usable_devices
    from hgcli.plan.placement import _exchanges
    from hgcli.plan.cost import CostModel
    from hgcli.plan.network import Network

    inventory, profiles = cluster([[A100, A100, T4, T4]], model=ModelSpec("tiny", 5000))
    devices = tuple(dataclasses.replace(p, exchange=exchange(0.0030, 0.0001, latency=0.0012, nbytes=20_000))
                    for p in profiles.devices)
    profiles = dataclasses.replace(profiles, devices=devices)
    names = [n.name for n in inventory.nodes]
    usable, _, _ = usable_devices(inventory, profiles, 20_000.0)
    _, batches = assign_batches(usable, 256, names)
    model = CostModel(usable, batches, Network(names, profiles.links), 20_000.0, 256, inventory,
                      JobSpec(strategy=Strategy.PS, global_batch=256), _exchanges(inventory, profiles))
    whole = {0: 20_000.0}
    assert model._push_pull_s(0, whole, 1, 1.0) == pytest.approx(0.0030)
    assert model._push_pull_s(0, whole, 1, 2.5) == pytest.approx(0.0030 + 0.0012 * 1.5)


def test_a_measured_synchronous_step_prices_the_all_reduce_of_exactly_that_group():
    """Four emulated devices on one node with their synchronous step measured (groupbench): the
    all-reduce plan's step is compute + the measured figure, with the plan's model swapped in for
    the benched one at the ring's per-byte rate; a measurement of another group size is not used."""
    emu = dataclasses.replace(A100, name="emulated A100", emulated=True)
    inventory, profiles = cluster([[emu] * 4], model=ModelSpec("m", 1_000_000))
    job = JobSpec(strategy=Strategy.ALLREDUCE, global_batch=256)

    def predicted(sync: GroupSyncProfile | None, model_parameters: int = 1_000_000) -> float:
        devices = tuple(dataclasses.replace(p, group_sync=sync) for p in profiles.devices)
        measured_profiles = dataclasses.replace(profiles, devices=devices, model=ModelSpec("m", model_parameters))
        return make_plan(inventory, measured_profiles, job).predicted_samples_per_s["allreduce"]

    formula = predicted(None)
    slow = predicted(GroupSyncProfile(ranks=4, bytes=4_000_000, step_s=0.03, seconds=measured(0.020)))
    fast = predicted(GroupSyncProfile(ranks=4, bytes=4_000_000, step_s=0.03, seconds=measured(0.001)))
    assert fast > slow and 256 / slow - 256 / fast == pytest.approx(0.019, rel=1e-6)
    assert predicted(GroupSyncProfile(ranks=3, bytes=4_000_000, step_s=0.03, seconds=measured(0.020))) == formula
    # a model twice the benched one's size adds its extra bytes' ring time to the measured figure
    bigger = predicted(GroupSyncProfile(ranks=4, bytes=4_000_000, step_s=0.03, seconds=measured(0.020)), 2_000_000)
    assert bigger < slow


def test_the_measured_synchronous_compute_ratio_slows_synchronous_groups_only():
    """The node's group bench measured its emulated ranks computing slower in a synchronous group
    than running free (groupbench's compute_ratio): allreduce and hybrid (two groups of two) are
    predicted slower by it, ps (every device its own worker) not at all; a profile from before the
    ratio was measured prices like a ratio of 1."""
    inventory, profiles = cluster([[A100, A100, T4, T4]])

    def predicted(ratio: Measurement | None) -> dict[str, float]:
        sync = GroupSyncProfile(ranks=4, bytes=4_000_000, step_s=0.03, seconds=measured(0.002), batch=64,
                                speed=1.0, compute_ratio=ratio)
        devices = tuple(dataclasses.replace(p, group_sync=sync) for p in profiles.devices)
        plan = make_plan(inventory, dataclasses.replace(profiles, devices=devices),
                         JobSpec(strategy=Strategy.AUTO, global_batch=256))
        return plan.predicted_samples_per_s

    before, same, slower = predicted(None), predicted(measured(1.0)), predicted(measured(1.3))
    assert before == same
    assert slower["allreduce"] < same["allreduce"] / 1.15 and slower["hybrid"] < same["hybrid"] / 1.15
    assert slower["ps"] == same["ps"] and slower["ideal"] == same["ideal"]


def test_the_wire_format_prices_ps_bytes_and_overlap_hides_the_exchange_behind_compute():
    """A 25.6M-parameter model, fast devices on n0, slow on n1, a 1 Gbit/s link between: bf16 halves
    what each push and pull puts on the link (hybrid faster, allreduce untouched); overlap makes a
    group's window the longer of its compute and its exchange, not their sum, and needs S >= groups."""
    from tests.unit.plan_clusters import link

    inventory, profiles = cluster([[A100, A100], [T4, T4]], links=(link("n0", "n1", 0.125, 1e-4),),
                                  model=ModelSpec("resnet50-sized", 25_600_000))

    def planned(**kw):
        return make_plan(inventory, profiles, JobSpec(strategy=Strategy.HYBRID, global_batch=2048, **kw))

    fp32, bf16 = planned(overlap=False), planned(overlap=False, wire="bf16")
    overlapped = planned(overlap=True)
    rate = {k: p.predicted_samples_per_s for k, p in {"fp32": fp32, "bf16": bf16, "overlap": overlapped}.items()}
    assert rate["bf16"]["hybrid"] > 1.02 * rate["fp32"]["hybrid"]
    assert rate["bf16"]["allreduce"] == rate["fp32"]["allreduce"]
    assert rate["overlap"]["hybrid"] > 1.05 * rate["fp32"]["hybrid"]
    assert (fp32.overlap, fp32.wire, overlapped.overlap, bf16.wire) == (False, "fp32", True, "bf16")
    assert overlapped.staleness_bound >= len(overlapped.groups)
    assert planned().overlap is False                      # the default (docs/planning.md, "Overlap")
    with pytest.raises(Exception, match="wire format must be one of"):
        planned(wire="fp8")
