"""The together bench's job (hgcli/bench/together.py): which batches a node's devices step at once,
and for how long; the node side's summary of a phase."""
from __future__ import annotations

import dataclasses

import pytest

from hgcli.bench.together import LEAST_S, MOST_S, STEPS, alone_seconds, batch_for, together_job
from hgcli.node.bench.together import summarize_phase
from hgcli.schema.stages import DeviceProfile, Measurement, StepSample


def profile(device: str, seconds: dict[int, float], speed: float = 1.0, emulated: bool = True,
            error: str | None = None) -> DeviceProfile:
    steps = tuple(StepSample(b, Measurement(t, t, t, 3)) for b, t in seconds.items())
    return DeviceProfile("n0", device, "dev", emulated, speed, None, steps=steps, error=error)


# The main job's devices as a quick bench times them: a fast device and one four times slower.
FAST = {4: 0.007, 16: 0.018, 64: 0.060, 256: 0.225}
SLOW = {b: 4 * t for b, t in FAST.items()}


def test_each_phase_runs_the_fastest_device_at_a_benched_batch_and_the_others_at_its_step_length():
    job = together_job([profile("gpu0", FAST), profile("gpu1", FAST), profile("gpu2", SLOW, speed=0.25)], quick=True)
    assert job is not None
    # The fastest device's two largest sizes whose alone step is at most 0.1 s: 16 and 64 (256 takes
    # 0.225 s); the slow one at the batch of about as long a step: 4 (its smallest) and 13.
    assert [d["batches"] for d in job["devices"]] == [[16, 64], [16, 64], [4, 13]]
    assert [d["speed"] for d in job["devices"]] == [1.0, 1.0, 0.25]
    assert (job["steps"], job["least_s"], job["most_s"]) == (STEPS[True], LEAST_S[True], MOST_S[True])
    full = together_job([profile("gpu0", FAST), profile("gpu1", SLOW)], quick=False)
    assert full is not None and (full["steps"], full["most_s"]) == (STEPS[False], MOST_S[False])


def test_a_real_device_runs_without_a_speed_and_a_failed_one_is_left_out():
    job = together_job([profile("gpu0", FAST, emulated=False), profile("gpu1", FAST, emulated=False),
                        profile("gpu2", FAST, error="out of memory at batch 4")], quick=True)
    assert job is not None
    assert [(d["device"], d["speed"]) for d in job["devices"]] == [("gpu0", None), ("gpu1", None)]


def test_a_node_of_one_usable_device_has_no_together_bench():
    assert together_job([profile("gpu0", FAST)], quick=True) is None
    assert together_job([profile("gpu0", FAST), profile("gpu1", {}, error="no CUDA")], quick=True) is None


def test_when_every_size_is_slow_the_smallest_is_the_one_phase():
    slow_only = {16: 0.3, 64: 1.1}
    job = together_job([profile("gpu0", slow_only), profile("gpu1", {b: 2 * t for b, t in slow_only.items()})],
                       quick=True)
    assert job is not None and [d["batches"] for d in job["devices"]] == [[16], [16]]


def test_batches_come_from_the_benched_medians_within_the_benched_sizes():
    steps = list(profile("gpu0", SLOW).steps)
    assert alone_seconds(steps, 10) == pytest.approx(0.028 + 6 / 12 * (0.072 - 0.028))
    assert alone_seconds(steps, 1000) == pytest.approx(0.9)          # beyond the largest: its time
    p = profile("gpu0", SLOW)
    assert batch_for(p, 0.001) == 4                                   # never below the smallest size
    assert batch_for(p, 10.0) == 256                                  # nor above the largest
    noisy = dataclasses.replace(p, steps=tuple(dataclasses.replace(s, seconds=Measurement(
        s.seconds.median, s.seconds.median / 2, s.seconds.median * 3, 3)) for s in p.steps))
    assert batch_for(noisy, 0.072) == 16                              # the medians, not the minima


def test_a_phase_summary_keeps_the_spread_and_the_mean_throughput_follows():
    s = summarize_phase(16, [0.010, 0.012, 0.050])
    assert s.batch_size == 16 and s.seconds == Measurement(0.012, 0.010, 0.050, 3)
    assert s.mean_s == pytest.approx(0.024)
