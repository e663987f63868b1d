"""Link benchmarks: the round schedule, and real 2-rank gloo process groups between local processes."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import given, strategies as st

from hgcli.bench.links import bench_link, link_backend, link_rounds
from hgcli.schema.stages import Cluster, GpuInfo, NodeInfo, NodeSpec
from hgcli.node.frames import decode

ROOT = Path(__file__).resolve().parents[2]


@given(st.integers(min_value=0, max_value=40))
def test_rounds_cover_every_pair_once_without_sharing_a_node(n):
    names = [f"n{i}" for i in range(n)]
    rounds = link_rounds(names)
    pairs = [frozenset(p) for r in rounds for p in r]
    assert sorted(map(sorted, pairs)) == sorted(map(sorted, map(frozenset, itertools.combinations(names, 2))))
    for r in rounds:
        in_round = [name for pair in r for name in pair]
        assert len(in_round) == len(set(in_round)) and r
    assert len(rounds) == (0 if n < 2 else n - 1 if n % 2 == 0 else n)


def test_backend_is_nccl_only_between_real_cuda_gpus():
    real = NodeInfo("a", "a", True, gpus=(GpuInfo(0, "A100"),), torch_cuda="12.4")
    emulated = NodeInfo("b", "b", True, gpus=(GpuInfo(0, "T4", emulated=True, speed=0.5),), torch_cuda="12.4")
    cpu_torch = NodeInfo("c", "c", True, gpus=(GpuInfo(0, "A100"),), torch_cuda=None)
    assert link_backend(real, real) == "nccl"
    assert link_backend(real, emulated) == "gloo"
    assert link_backend(real, cpu_torch) == "gloo"


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hgcli.node.bench.link", "--quick", "--timeout", "60", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _frames(text: str) -> list[dict]:
    return [f for f in map(decode, text.split("\n")) if f is not None]


def test_node_linkbench_between_two_local_processes():
    rank0 = _start("--rank", "0", "--addr", "127.0.0.1")
    try:
        first = decode(rank0.stdout.readline())
        assert first["type"] == "listening" and first["port"] > 0
        rank1 = _start("--rank", "1", "--addr", "127.0.0.1", "--port", str(first["port"]))
        out1, err1 = rank1.communicate(timeout=180)
        out0, err0 = rank0.communicate(timeout=180)
    finally:
        rank0.kill()
    assert rank0.returncode == 0 and rank1.returncode == 0, (err0, err1)
    for frames in (_frames(out0), _frames(out1)):
        (link,) = [f for f in frames if f["type"] == "link"]
        assert link["backend"] == "gloo"
        assert link["bandwidth_gbs"]["median"] > 0 and link["latency_s"]["median"] > 0
        assert link["latency_s"]["min"] <= link["latency_s"]["median"] <= link["latency_s"]["max"]


def test_rank1_without_a_listener_fails_within_its_timeout():
    # A port nobody listens on: the store connect must give up, not hang.
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hgcli.node.bench.link", "--rank", "1", "--addr", "127.0.0.1",
                           "--port", "9", "--timeout", "1", "--quick"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode != 0
    (error,) = [f for f in _frames(proc.stdout) if f["type"] == "error"]
    assert error["message"]
    assert time.monotonic() - start < 100


def test_bench_link_through_the_local_transport():
    cluster = Cluster(nodes=(NodeSpec(name="a", host="localhost", python=sys.executable),
                             NodeSpec(name="b", host="localhost", python=sys.executable)))
    link = bench_link(cluster, cluster.node("a"), cluster.node("b"), "gloo", quick=True)
    assert (link.a, link.b, link.backend, link.error) == ("a", "b", "gloo", None)
    assert link.bandwidth_gbs.median > 0 and link.latency_s.median > 0
    assert link.bandwidth_gbs.repeats >= 3


def test_bench_link_names_a_node_that_cannot_run_it():
    broken = NodeSpec(name="b", host="localhost", python="/nonexistent/python3")
    cluster = Cluster(nodes=(NodeSpec(name="a", host="localhost", python=sys.executable), broken))
    link = bench_link(cluster, cluster.node("b"), cluster.node("a"), "gloo", quick=True)
    assert link.bandwidth_gbs is None and link.error.startswith("b: ")
    assert "/nonexistent/python3" in link.error


def test_intra_node_link_only_where_devices_of_one_node_talk_through_gloo():
    from hgcli.bench.links import intra_node_gloo

    emulated = NodeInfo("e", "e", True, gpus=(GpuInfo(0, "T4", emulated=True, speed=0.5),
                                              GpuInfo(1, "T4", emulated=True, speed=0.5)))
    one = NodeInfo("o", "o", True, gpus=(GpuInfo(0, "T4", emulated=True, speed=0.5),))
    real = NodeInfo("r", "r", True, gpus=(GpuInfo(0, "A100"), GpuInfo(1, "A100")), torch_cuda="12.4")
    cpu_torch = NodeInfo("c", "c", True, gpus=(GpuInfo(0, "A100"), GpuInfo(1, "A100")), torch_cuda=None)
    assert intra_node_gloo(emulated) and intra_node_gloo(cpu_torch)
    assert not intra_node_gloo(one) and not intra_node_gloo(real)
