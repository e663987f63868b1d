"""An emulated device's memory, enforced in training (runtime/memory.py): a real tiny model's steps
counted as the step bench counts them, a step above the cap refused as CUDA would, and only steps of
a micro-batch larger than any before counted."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hgcli.node.bench.step import accounted_step_bytes
from hgcli.runtime.errors import TrainingError
from hgcli.runtime.memory import MIB, DeviceOutOfMemory, MemoryAccountant


class LossModel(torch.nn.Module):
    """Returns its own loss, so the bench (loss outside the model) and the runtime (hooks on the
    model) count the same tensors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 256), torch.randint(0, 10, (n,))


def _train(accountant: MemoryAccountant, batches: list[int]) -> None:
    model = LossModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accountant.attach(model, opt)
    for n in batches:
        model(*_batch(n)).backward()
        opt.step()
        opt.zero_grad()


def test_a_step_counts_what_the_bench_counts_and_only_larger_batches_are_counted():
    counted = MemoryAccountant(cap_mib=None, device="gpu0@local")
    _train(counted, [32])
    model = LossModel()
    x, y = _batch(32)
    bench = accounted_step_bytes(torch, model, torch.optim.AdamW(model.parameters(), lr=1e-3), (x, y), y,
                                 lambda loss, _: loss)
    assert counted.peak_bytes == bench and counted.accounted == 1
    # Parameters, gradients and AdamW's two moments at least; the activations on top.
    params = sum(p.numel() * 4 for p in model.parameters())
    assert counted.peak_bytes > 4 * params

    steps = MemoryAccountant(cap_mib=None, device="gpu0@local")
    _train(steps, [8, 8, 8, 64, 8, 64, 32])
    assert steps.accounted == 2                     # the first step, then the first of 64
    assert steps.peak_bytes > counted.peak_bytes    # 64's activations over 32's


def test_a_step_above_the_cap_fails_like_cuda_and_under_it_trains():
    probe = MemoryAccountant(cap_mib=None, device="gpu2@local")
    _train(probe, [16])
    need_mib = probe.peak_bytes / MIB
    _train(MemoryAccountant(cap_mib=int(need_mib) + 1, device="gpu2@local"), [16, 16, 8])
    with pytest.raises(DeviceOutOfMemory) as refused:
        _train(MemoryAccountant(cap_mib=int(need_mib) - 1, device="gpu2@local"), [16])
    assert isinstance(refused.value, torch.cuda.OutOfMemoryError) and isinstance(refused.value, TrainingError)
    assert str(refused.value).startswith(
        f"emulated device out of memory: a step at micro-batch 16 needs {need_mib:.1f} MiB, gpu2@local has "
        f"{int(need_mib) - 1} MiB")
    assert "\n" not in str(refused.value)
    # A larger batch later (an adaptation) is counted too, and refused at the end of its forward:
    # the state of the earlier steps is held already.
    late = MemoryAccountant(cap_mib=int(need_mib) + 1, device="gpu2@local")
    with pytest.raises(DeviceOutOfMemory, match="micro-batch 512 needs"):
        _train(late, [16, 16, 512])
    assert late.accounted == 2


def test_the_declared_memory_reaches_the_rank_and_old_plans_still_load(tmp_path):
    from hgcli.local.plans import emulated_plan
    from hgcli.plan.slowdowns import with_slowdowns
    from hgcli.runtime.env import RankEnv, rank_env
    from hgcli.schema import stages as m

    cluster = m.Cluster(nodes=(m.NodeSpec(name="local", host="localhost", emulate=m.EmulateSpec(
        devices=("A100", "T4"), speed=(1.0, 0.25), memory_mib=(40960, 15360))),))
    hand_laid = emulated_plan([[1.0, 0.25]], [[8, 2]])
    hand_laid = replace(hand_laid, ranks=tuple(replace(r, device=m.Device(f"gpu{r.rank}")) for r in hand_laid.ranks))
    plan = with_slowdowns(hand_laid, cluster)
    assert [r.memory_mib for r in plan.ranks] == [40960, 15360]
    path = tmp_path / "plan.json"
    path.write_text(m.to_json(plan))
    env = rank_env(plan, 1, master_addr="a", master_port=1, plan_path=str(path), job_id="j")
    assert env["HGTRAIN_DEVICE_MEMORY_MIB"] == "15360" and RankEnv.from_environ(env).memory_mib == 15360
    path.write_text(m.to_json(hand_laid))       # no memory: no cap
    env = rank_env(hand_laid, 1, master_addr="a", master_port=1, plan_path=str(path), job_id="j")
    assert RankEnv.from_environ(env).memory_mib is None
    old = m.from_dict(m.RankPlan, {"rank": 0, "role": "worker", "node": "n0", "device": "gpu0"})
    assert old.memory_mib is None
