"""The runtime on real NVIDIA GPUs with NCCL groups. Skipped on machines without CUDA (CI here has
none); run on a GPU machine with `.venv/bin/python -m pytest -q tests/runtime/test_gpu.py`."""
import dataclasses
import sys

import pytest
import torch

from hgcli.schema import stages as m
from hgcli.runtime.groups import group_backend
from hgcli.local.plans import emulated_plan
from hgcli.local.run import run_plan

from .helpers import run_ok, script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                       reason="needs a CUDA GPU and NCCL"),
]


def on_gpus(plan: m.Plan, gpus: list[int]) -> m.Plan:
    """The plan with its workers on real GPUs (worker k on gpus[k]) instead of emulated devices."""
    workers = iter(gpus)
    ranks = tuple(dataclasses.replace(r, device=f"gpu{next(workers)}", emulated=False, speed=1.0)
                  if r.role is m.Role.WORKER else r for r in plan.ranks)
    return dataclasses.replace(plan, ranks=ranks)


def train(plan, tmp_path):
    result = run_ok(plan, [sys.executable, "-m", "hgcli.examples.train_mlp", "--epochs", "2"], tmp_path,
                    timeout_s=180)
    final = [x for x in result.metrics if x.get("event") == "final"]
    return result, final


def test_hybrid_groups_on_a_gpu_use_nccl_and_finish_through_the_ps(tmp_path):
    """Two all-reduce groups of one real-GPU rank each and a PS: NCCL groups, CUDA tensors pushed to
    a CPU parameter server over RPC, and the end of the job (its flag broadcast) on the GPU."""
    plan = on_gpus(emulated_plan([[1.0], [1.0]], [[64], [64]], n_ps=1, staleness_bound=2), [0, 0])
    assert [group_backend(plan, g) for g in plan.groups] == ["nccl", "nccl"]
    result, final = train(plan, tmp_path)
    assert len(final) == 1 and final[0]["accuracy"] >= 0.85, final
    syncs = [x for x in result.metrics if x.get("event") == "sync"]
    assert {x["group"] for x in syncs} == {0, 1}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL group of two ranks needs two GPUs")
def test_a_group_of_two_gpus_all_reduces_with_nccl_in_a_hybrid_plan(tmp_path):
    plan = on_gpus(emulated_plan([[1.0, 1.0], [1.0]], [[64, 64], [64]], n_ps=1, staleness_bound=2),
                   [0, 1, 1])
    assert group_backend(plan, plan.groups[0]) == "nccl"
    result, final = train(plan, tmp_path)
    assert len(final) == 1 and final[0]["accuracy"] >= 0.85, final


def test_a_model_left_on_the_cpu_is_named_before_nccl_fails_on_it(tmp_path):
    """Two ranks of one NCCL group (both on GPU 0 where there is one GPU) with a script that never
    moves its model to ctx.device: the runtime says so instead of torch's device-type error."""
    plan = on_gpus(emulated_plan([[1.0, 1.0]], [[64, 64]]), [0, 1 % torch.cuda.device_count()])
    result = run_plan(plan, script("tiny_train.py", "--out", tmp_path, "--steps", 3), workdir=tmp_path,
                      timeout_s=120)
    assert not result.ok
    out = "".join(r.output() for r in result.ranks)
    assert "all-reduces with NCCL, but the model's parameters are on cpu" in out, out[-3000:]
