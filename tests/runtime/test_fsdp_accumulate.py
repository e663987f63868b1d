"""Micro-batches per rank (``RankPlan.micro_batches``): a rank's batch comes from ctx.shard in that many
pieces, each stepped, and the group reduces once per update (DDP's ``no_sync``, FSDP2's
``set_requires_gradient_sync(False)``), the samples-weighted gradient still exact. The fsdp group's
case runs in test_fsdp_snapshots.py, whose first run it is (one run fewer)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hgcli.local.plans import emulated_plan
from hgcli.runtime.data.blocks import ShardStream, micro_slices, shard_batches
from hgcli.runtime.data.sampler import RankBatchSampler
from hgcli.schema import stages as m

from .helpers import load, run_ok, script
from .scripts.fsdp_micro import SAMPLES, data
from .scripts.fsdp_train import LR, MOMENTUM, Blocks


def micro_plan(engine, batches, micro):
    """An emulated group of ``batches``, each rank with its ``micro`` micro-batches."""
    plan = emulated_plan([[1.0] * len(batches)], [batches])
    ranks = tuple(dataclasses.replace(r, micro_batches=k) for r, k in zip(plan.ranks, micro))
    return dataclasses.replace(plan, ranks=ranks,
                               groups=tuple(dataclasses.replace(g, engine=engine) for g in plan.groups))


def union_batch_training(batches):
    """One process stepping on the union of the ranks' batches (what the group must compute): the
    final parameters, flat, and the updates made."""
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ranks = [list(shard_batches(data(), batches, i, epochs=1, seed=0)) for i in range(len(batches))]
    for parts in zip(*ranks):
        x, y = (torch.cat([p[k] for p in parts]) for k in range(2))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([q.detach().reshape(-1) for q in model.parameters()]), len(ranks[0])


def check_union_batch(out, batches, micro):
    """Every rank of the run in ``out`` made its micro-steps and ends on the union batch's parameters."""
    want, updates = union_batch_training(batches)
    assert [int((out / f"steps{r}.txt").read_text()) for r in range(len(batches))] == [k * updates for k in micro]
    for r in range(len(batches)):
        got = load(out / f"rank{r}.pt")
        assert torch.allclose(got, want, rtol=0, atol=1e-6), f"rank {r}: {(got - want).abs().max()}"


@pytest.mark.slow
def test_a_ddp_rank_with_two_micro_batches_trains_as_the_union_batch(tmp_path):
    """Rank 1's 7 samples as 4 + 3: unequal micro-batches."""
    run_ok(micro_plan(m.Engine.DDP, [4, 7], [1, 2]), script("fsdp_micro.py", "--out", tmp_path), tmp_path,
           timeout_s=120)
    check_union_batch(tmp_path, [4, 7], [1, 2])


def test_micro_slices_cover_the_batch_evenly():
    assert micro_slices(10, 17, 2) == [(10, 14), (14, 17)]
    assert micro_slices(0, 6, 3) == [(0, 2), (2, 4), (4, 6)]


def test_the_data_position_moves_one_step_per_micro_batches():
    whole = next(shard_batches(data(), [4, 7], 1, epochs=1, seed=0))[0]
    micro = ShardStream(data(), [4, 7], 1, epochs=1, seed=0, micro=2)
    pieces = iter(micro)
    first, second = next(pieces)[0], next(pieces)[0]
    assert torch.equal(torch.cat([first, second]), whole)
    micro.note_step()
    assert micro.position() == (0, 0)
    micro.note_step()
    assert micro.position() == (0, 1)
    sampler = RankBatchSampler(SAMPLES, [4, 7], 1, seed=0, micro=2)
    assert len(sampler) == 2 * (SAMPLES // 11) and [len(i) for i in list(sampler)[:2]] == [4, 3]


def test_a_batch_smaller_than_its_micro_batches_is_refused_in_one_line():
    from hgcli.runtime.context import Context
    from hgcli.runtime.env import RankEnv
    from hgcli.runtime.errors import TrainingError

    plan = micro_plan(m.Engine.DDP, [1], [2])
    # Not emulated: an emulated rank would set this process's torch threads to one.
    plan = dataclasses.replace(plan, ranks=(dataclasses.replace(plan.ranks[0], emulated=False),))
    ctx = Context(RankEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, role=m.Role.WORKER, group=0,
                          batch_size=1, speed=1.0, job_id=None, metrics_fd=None, timeout_s=10.0, plan=plan))
    with pytest.raises(TrainingError, match="rank 0: a batch of 1 cannot be stepped as 2 micro-batches") as err:
        ctx.shard(data(), batch_size=8)
    assert "\n" not in str(err.value)
