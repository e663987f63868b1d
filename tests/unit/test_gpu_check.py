"""benchmarks/gpu_check.py on a machine without a GPU: its wrap-bench child (step 3) at tiny sizes on
the CPU, the hand-built ResNet-50's size, step 4's cluster file through hgtrain's loader, and the
verdicts it draws from a launch's events."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hgcli.config.cluster import load_cluster

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))     # as when a script in benchmarks/ runs
    return importlib.import_module("gpu_check")


# A bound against a hang, not a speed goal: the child imports torch and times a small net twice,
# which took over 20 s on a loaded 2-core machine.
@pytest.mark.timeout(150)
def test_wrap_bench_child_times_both_variants_and_prints_one_result_line(check: ModuleType) -> None:
    """A plain process (world of one, no torchrun): fp32 and bf16, plain and wrapped, on the CPU."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "wrap-bench", *check.TINY_WRAP],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    result = check.result_of(done.stdout)
    assert result is not None, done.stdout
    assert set(result) == {"device", "ctx_device", "batch", "image", "params", "fp32", "bf16"}
    assert (result["device"], result["ctx_device"], result["batch"], result["image"]) == ("cpu", "cpu", 4, 32)
    assert result["params"] == sum(p.numel() for p in check.resnet50_like(8, (1, 1), 10).parameters())
    for amp in ("fp32", "bf16"):
        figures = result[amp]
        assert set(figures) == {"plain_ms", "wrapped_ms", "ratio"}
        assert all(isinstance(v, float) and v > 0 for v in figures.values()), figures
        assert figures["ratio"] == pytest.approx(figures["plain_ms"] / figures["wrapped_ms"], rel=1e-2)
    json.dumps(result)       # the summary stores it as JSON


def test_the_hand_built_net_is_resnet50_sized(check: ModuleType) -> None:
    import torch
    net = check.resnet50_like()
    assert sum(p.numel() for p in net.parameters()) == 25_557_032       # torchvision's resnet50
    assert net(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_hybrid_cluster_file_declares_the_real_gpu_and_two_emulated_devices(check: ModuleType,
                                                                           tmp_path: Path) -> None:
    cluster = load_cluster(check.hybrid_cluster_toml(tmp_path / "hybrid.toml"))
    gpu, emu = cluster.nodes
    assert (gpu.name, gpu.is_local, gpu.gpus, gpu.emulate) == ("gpu", True, (0,), None)
    assert (emu.name, emu.is_local, emu.gpus) == ("emu", True, None)
    assert emu.emulate is not None and list(emu.emulate.speed) == [1.0, 1.0]
    assert load_cluster(check.hybrid_cluster_toml(tmp_path / "cpu.toml", gpu=False)).nodes[0].emulate


def events(*docs: dict) -> str:
    return "\n".join(json.dumps(d) for d in docs)


def test_hybrid_verdict_needs_two_groups_a_ps_and_the_gpu_rank_on_cuda(check: ModuleType) -> None:
    ranks = ((0, "gpu", "worker"), (1, "emu", "worker"), (2, "emu", "worker"), (3, "gpu", "ps"))
    started = [{"event": "rank_started", "rank": r, "node": n, "role": role} for r, n, role in ranks]
    logs = [{"event": "log", "rank": r, "line": f"gpu_check: ctx.device {d} (rank {r}, LOCAL_RANK 0)"}
            for r, d in ((0, "cuda:0"), (1, "cpu"), (2, "cpu"))]
    ended = {"event": "job_ended", "state": "succeeded", "exit_code": 0,
             "summary": {"strategy": "hybrid", "samples_per_s": 900.0, "predicted_samples_per_s": 1000.0,
                         "accuracy": 0.8, "groups": {"0": 700.0, "1": 200.0}}}
    fig = check.hybrid_figures(events(*started, *logs, ended))
    assert fig["worker_nodes"] == ["emu", "gpu"] and fig["ps_ranks"] == 1
    assert fig["rank_devices"] == ["cuda:0", "cpu", "cpu"]
    assert check.hybrid_ok(0, fig)
    one_group = {**ended, "summary": {**ended["summary"], "groups": {"0": 900.0}}}
    assert not check.hybrid_ok(0, check.hybrid_figures(events(*started, *logs, one_group)))
    on_cpu = [{**e, "line": e["line"].replace("cuda:0", "cpu")} for e in logs]
    assert not check.hybrid_ok(0, check.hybrid_figures(events(*started, *on_cpu, ended)))


def test_goals_are_null_where_a_step_did_not_run_and_judge_the_ratio(check: ModuleType,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "summary", {})
    assert check.goals() == {"wrap_vs_plain_ge_0.97": None, "torchrun_on_cuda": None,
                          "hybrid_gpu_plus_emulated_ok": None}
    monkeypatch.setattr(check, "summary", {"wrap_exit": 0, "wrap": {"fp32": {"ratio": 0.96}},
                                        "torchrun_on_cuda": False, "hybrid_ok": True})
    assert check.goals() == {"wrap_vs_plain_ge_0.97": False, "torchrun_on_cuda": False,
                          "hybrid_gpu_plus_emulated_ok": True}
