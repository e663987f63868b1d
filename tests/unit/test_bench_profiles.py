"""Stored profiles: round trip through the state directory, private files, staleness reasons."""
from __future__ import annotations

import dataclasses
import json
import stat

import pytest

from hgcli.errors import StateError
from hgcli.schema.stages import (SCHEMA_VERSION, DeviceProfile, GpuInfo, Inventory, LinkProfile, Measurement,
                         ModelSpec, NodeInfo, Profiles, StepSample)
from hgcli.bench.profiles import load_profiles, profile_is_stale, profiles_path, store_profiles

M = Measurement(1.0, 0.9, 1.2, 5)


def inventory() -> Inventory:
    return Inventory(cluster="c0ffee", nodes=(
        NodeInfo("g", "10.0.0.1", True, gpus=(GpuInfo(0, "NVIDIA A100-SXM4-40GB", driver_version="550.54.15"),
                                              GpuInfo(1, "Tesla T4", driver_version="550.54.15")),
                 torch_version="2.3.0"),
        NodeInfo("c", "10.0.0.2", True, torch_version="2.3.0"),
        NodeInfo("down", "10.0.0.3", False, error="connection refused"),
    ))


def profiles() -> Profiles:
    def dev(node, device, name, driver=None):
        return DeviceProfile(node=node, device=device, name=name, emulated=False, speed=1.0, memory_total_mib=1000,
                             matmul_tflops={"fp32": M}, steps=(StepSample(8, M, 100),), torch_version="2.3.0",
                             driver_version=driver)
    return Profiles(cluster="c0ffee", devices=(
        dev("g", "gpu0", "NVIDIA A100-SXM4-40GB", "550.54.15"), dev("g", "gpu1", "Tesla T4", "550.54.15"),
        dev("c", "cpu", "EPYC")), links=(LinkProfile("g", "c", "gloo", M, M),),
        model=ModelSpec("mlp", 669706), measured_at=1.0)


def test_store_and_load_round_trip_private(private_state_dir):
    p = profiles()
    path = store_profiles(p)
    assert path == profiles_path("c0ffee") and path.parent.parent.parent == private_state_dir
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_profiles("c0ffee") == p
    assert load_profiles("other") is None


def test_fresh_profiles_are_not_stale():
    assert profile_is_stale(profiles(), inventory()) is None


@pytest.mark.parametrize("change, reason", [
    (lambda p, i: (dataclasses.replace(p, version=SCHEMA_VERSION + 1), i), "schema"),
    (lambda p, i: (dataclasses.replace(p, cluster="beef"), i), "cluster beef"),
    (lambda p, i: (dataclasses.replace(p, devices=p.devices[1:]), i), "g/gpu0 has no profile"),
    (lambda p, i: (p, dataclasses.replace(i, nodes=(dataclasses.replace(
        i.nodes[0], gpus=(i.nodes[0].gpus[0], GpuInfo(1, "Tesla V100", driver_version="550.54.15"))),
        *i.nodes[1:]))), "g/gpu1 was 'Tesla T4', is now 'Tesla V100'"),
    (lambda p, i: (p, dataclasses.replace(i, nodes=(dataclasses.replace(
        i.nodes[0], gpus=tuple(dataclasses.replace(g, driver_version="560.1") for g in i.nodes[0].gpus)),
        *i.nodes[1:]))), "driver was 550.54.15, is now 560.1"),
    (lambda p, i: (p, dataclasses.replace(i, nodes=(i.nodes[0], dataclasses.replace(i.nodes[1], torch_version="2.4.0"),
                                                    i.nodes[2]))), "c torch was 2.3.0, is now 2.4.0"),
])
def test_staleness_names_what_changed(change, reason):
    p, i = change(profiles(), inventory())
    stale = profile_is_stale(p, i)
    assert stale is not None and reason in stale


@pytest.mark.parametrize("stored, probed, stale", [
    ("2.11.0+cu130", "2.11.0", False),       # an older probe read the metadata, without the label
    ("2.11.0", "2.11.0+cu130", False),
    ("2.11.0+cu130", "2.11.0+cu130", False),
    ("2.11.0+cu121", "2.11.0+cpu", True),    # another build of the same release
    ("2.11.0+cu130", "2.12.0", True),
])
def test_a_torch_version_without_its_local_label_is_the_same_build(stored, probed, stale):
    p, i = profiles(), inventory()
    p = dataclasses.replace(p, devices=tuple(dataclasses.replace(d, torch_version=stored) for d in p.devices))
    i = dataclasses.replace(i, nodes=tuple(dataclasses.replace(n, torch_version=probed) for n in i.nodes))
    assert (profile_is_stale(p, i) is not None) == stale


def test_corrupt_or_foreign_profiles_are_state_errors():
    path = store_profiles(profiles())
    path.write_text("{not json")
    with pytest.raises(StateError, match="profiles.json"):
        load_profiles("c0ffee")
    path.write_text(json.dumps({"cluster": "c0ffee", "devices": "?", "version": 99}))
    with pytest.raises(StateError, match="schema 99"):
        load_profiles("c0ffee")


def test_emulated_profile_scales_exactly_by_declared_speed_and_caps_memory():
    from hgcli.bench.cluster import DeviceTarget, emulated_profile
    from hgcli.schema.stages import DeviceProfile, Measurement, StepSample

    m = lambda v: Measurement(v, v, v, 3)  # noqa: E731
    base = DeviceProfile(node="a", device="gpu0", name="A100", emulated=True, speed=1.0, memory_total_mib=100,
                         matmul_tflops={"fp32": m(2.0)}, mem_bandwidth_gbs=m(10.0),
                         steps=(StepSample(8, m(0.01), 10), StepSample(64, m(0.05), 50)))
    slow = emulated_profile(base, DeviceTarget("gpu3", "Tesla T4", True, 0.25, 20))
    assert (slow.device, slow.name, slow.speed, slow.memory_total_mib) == ("gpu3", "Tesla T4", 0.25, 20)
    assert slow.matmul_tflops["fp32"].median == 0.5 and slow.mem_bandwidth_gbs.median == 2.5
    assert [(s.batch_size, s.seconds.median) for s in slow.steps] == [(8, 0.04)]
    assert slow.error == "out of memory at batch 64: a step needs 50 MiB, the emulated device has 20 MiB"
    fast = emulated_profile(base, DeviceTarget("gpu1", "A100", True, 1.0, 100))
    assert fast.steps == base.steps and fast.error is None


def test_emulated_profile_from_a_base_measured_at_another_speed():
    # A device derived from a measurement at another declared speed scales by the ratio of the
    # speeds (the bench measures each distinct speed, so in practice the ratio is 1).
    from hgcli.bench.cluster import DeviceTarget, emulated_profile
    from hgcli.schema.stages import DeviceProfile, Measurement, StepSample

    m = lambda v: Measurement(v, v, v, 3)  # noqa: E731
    base = DeviceProfile(node="a", device="gpu2", name="T4", emulated=True, speed=0.25, memory_total_mib=100,
                         matmul_tflops={"fp32": m(0.5)}, steps=(StepSample(8, m(0.04), 10),))
    fast = emulated_profile(base, DeviceTarget("gpu0", "A100", True, 1.0, 100))
    assert fast.speed == 1.0 and fast.steps[0].seconds.median == 0.01 and fast.matmul_tflops["fp32"].median == 2.0
    same = emulated_profile(base, DeviceTarget("gpu2", "T4", True, 0.25, 100))
    assert same.steps == base.steps


def test_emulated_clock_counts_cpu_time_and_pauses_like_the_emulator():
    import time

    from hgcli.node.bench.timing import emulated_clock, time_repeats

    def spin_then_sleep() -> None:
        end = time.thread_time() + 0.01
        while time.thread_time() < end:
            pass
        time.sleep(0.05)          # not CPU time: an emulated step's wall time is not what is measured

    start = time.perf_counter()
    seconds = time_repeats(spin_then_sleep, warmup=0, repeats=3, clock=emulated_clock(0.5))
    wall = time.perf_counter() - start
    assert all(0.01 <= s < 0.045 for s in seconds), seconds
    # each timed call is followed by the emulator's pause at speed 0.5: its CPU time again
    assert wall >= 3 * 0.05 + sum(seconds)
