"""Metis profile conversion: names Metis can parse, fields it reads, and the round trip."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, strategies as st

from hgcli.bench.metis import METIS_NODE, device_type, file_name, from_metis, to_metis
from hgcli.schema.stages import DeviceProfile, Measurement, ModelSpec, Profiles, StepSample

# How Metis' loader finds the device type, tp and batch size in a file name (its data_loader.py).
METIS_TYPE = re.compile(r"DeviceType\.(\w+?)_")


def device(node, dev, name, steps, emulated=False):
    return DeviceProfile(node=node, device=dev, name=name, emulated=emulated, speed=1.0, memory_total_mib=40960,
                         steps=tuple(StepSample(bs, Measurement(t, t * 0.9, t * 1.1, 5), mem) for bs, t, mem in steps))


def profiles(*devices):
    return Profiles(cluster="c", devices=devices, model=ModelSpec("mlp", 669706))


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA A100-SXM4-40GB", "A100SXM440GB"),
    ("Tesla T4", "T4"),
    ("NVIDIA GeForce RTX 3090", "RTX3090"),
    ("NVIDIA H100 80GB HBM3", "H10080GBHBM3"),
    ("weird_name", "weirdname"),
])
def test_device_type_survives_metis_file_name_parsing(name, expected):
    dtype = device_type(name)
    assert dtype == expected
    assert METIS_TYPE.search(file_name(dtype, 4)).group(1) == dtype


def test_to_metis_fields_are_the_ones_metis_reads():
    files = to_metis(profiles(device("a", "gpu0", "NVIDIA A100-SXM4-40GB", [(8, 0.020, 900), (16, 0.030, 1200)])))
    assert sorted(files) == ["DeviceType.A100SXM440GB_tp1_bs16.json", "DeviceType.A100SXM440GB_tp1_bs8.json"]
    f = files["DeviceType.A100SXM440GB_tp1_bs8.json"]
    json.dumps(f)                                               # plain JSON
    assert f["model"]["model_name"] == "mlp"
    assert f["model"]["parameters"]["parameters_per_layer_bytes"] == [669706 * 4]
    t = f["execution_time"]
    assert t["total_time_ms"] == pytest.approx(20.0)
    # Metis: fb_sync = forward_backward - sum(layers); optimizer counted separately (so 0 here).
    assert t["forward_backward_time_ms"] - sum(t["layer_compute_total_ms"]) == pytest.approx(0.0)
    assert t["optimizer_time_ms"] == 0.0 and t["batch_generator_time_ms"] == 0.0
    assert f["execution_memory"]["layer_memory_total_mb"] == [900.0]


def test_devices_of_one_type_merge_and_emulated_are_left_out_unless_asked():
    p = profiles(device("a", "gpu0", "Tesla T4", [(8, 0.010, 500)]),
                 device("b", "gpu0", "Tesla T4", [(8, 0.030, 700)]),
                 device("b", "gpu1", "Tesla T4", [(8, 0.020, 600)]),
                 device("e", "gpu0", "Tesla V100", [(8, 0.005, 100)], emulated=True))
    files = to_metis(p)
    assert list(files) == ["DeviceType.T4_tp1_bs8.json"]
    f = files["DeviceType.T4_tp1_bs8.json"]
    assert f["execution_time"]["total_time_ms"] == pytest.approx(20.0)       # median of the three
    assert f["execution_memory"]["total_memory_mb"] == 700.0                  # the largest
    assert "DeviceType.V100_tp1_bs8.json" in to_metis(p, include_emulated=True)


def test_without_a_model_there_is_nothing_to_describe():
    with pytest.raises(ValueError, match="no model"):
        to_metis(Profiles(cluster="c", devices=()))


@given(st.dictionaries(
    st.sampled_from(["NVIDIA A100-SXM4-40GB", "Tesla T4", "Tesla V100-PCIE-16GB", "NVIDIA H100 80GB HBM3"]),
    st.dictionaries(st.integers(1, 4096), st.tuples(st.floats(1e-5, 100.0), st.integers(1, 200_000)),
                    min_size=1, max_size=6),
    min_size=1))
def test_round_trip_keeps_time_and_memory_per_type_and_batch(table):
    p = profiles(*(device("n", f"gpu{i}", name, [(bs, t, mem) for bs, (t, mem) in steps.items()])
                   for i, (name, steps) in enumerate(table.items())))
    back = from_metis(to_metis(p))
    assert back.model == p.model and back.skipped == ()
    assert {d.name for d in back.devices} == {device_type(n) for n in table}
    for d in back.devices:
        assert d.node == METIS_NODE and not d.emulated
        (original,) = [s for n, s in table.items() if device_type(n) == d.name]
        assert [s.batch_size for s in d.steps] == sorted(original)
        for s in d.steps:
            t, mem = original[s.batch_size]
            assert s.seconds.median == pytest.approx(t) and s.seconds.repeats == 1
            assert s.memory_mib == mem
    # And back again: the Metis files themselves are a fixed point.
    assert to_metis(profiles(*back.devices)) == to_metis(p)


def test_from_metis_reads_files_written_by_metis_users():
    # The shape of Metis' sample profiles (its profile_data_samples/): per-layer lists, the memory
    # total under "total_memory", and a tensor-parallel file hgtrain has no use for. Numbers are ours.
    sample = {
        "model": {"model_name": "GPT3", "num_layers": 3,
                  "parameters": {"total_parameters_bytes": 4000, "parameters_per_layer_bytes": [1000, 2000, 1000]}},
        "execution_time": {"total_time_ms": 120.0, "forward_backward_time_ms": 100.0, "batch_generator_time_ms": 1.0,
                           "layernorm_grads_all_reduce_time_ms": 0.1, "embedding_grads_all_reduce_time_ms": 0.1,
                           "optimizer_time_ms": 18.0, "layer_compute_total_ms": [10.0, 80.0, 10.0]},
        "execution_memory": {"total_memory": 5000, "layer_memory_total_mb": [1000, 3000, 1000]},
    }
    no_total = {**sample, "execution_memory": {"layer_memory_total_mb": [1000, 3000, 1500]}}
    got = from_metis({"DeviceType.A100_tp1_bs2.json": sample, "DeviceType.A100_tp1_bs4.json": no_total,
                      "DeviceType.A100_tp2_bs2.json": sample})
    (a100,) = got.devices
    assert a100.name == "A100" and [s.batch_size for s in a100.steps] == [2, 4]
    assert a100.steps[0].seconds.median == pytest.approx(0.120) and a100.steps[0].memory_mib == 5000
    assert a100.steps[1].memory_mib == 5500
    assert got.model == ModelSpec("GPT3", 1000)
    assert got.skipped == ("DeviceType.A100_tp2_bs2.json",)


@pytest.mark.parametrize("name, data, message", [
    ("A100_bs2.json", {}, "not a Metis profile name"),
    ("DeviceType.A100_tp1_bs2.json", {"model": {}}, "missing or bad field"),
])
def test_from_metis_rejects_bad_files(name, data, message):
    with pytest.raises(ValueError, match=message):
        from_metis({name: data})
