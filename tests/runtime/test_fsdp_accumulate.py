"""Micro-batches per rank (``RankPlan.micro_batches``): a rank's batch comes from ctx.shard in that many
pieces, each stepped, and the group reduces once per update (DDP's ``no_sync``, FSDP2's
``set_requires_gradient_sync(False)``), the samples-weighted gradient still exact."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hgcli.local.plans import emulated_plan
from hgcli.runtime.data.blocks import ShardStream, micro_slices, shard_batches
from hgcli.runtime.data.sampler import RankBatchSampler
from hgcli.schema import stages as m

from .helpers import load, run_ok, script
from .scripts.fsdp_micro import UPDATES, data
from .scripts.fsdp_train import LR, MOMENTUM, Blocks

BATCHES, MICRO = [4, 7], [1, 2]     # rank 1's 7 samples as 4 + 3: unequal micro-batches


def _plan(engine):
    plan = emulated_plan([[1.0, 1.0]], [BATCHES])
    ranks = tuple(dataclasses.replace(r, micro_batches=k) for r, k in zip(plan.ranks, MICRO))
    return dataclasses.replace(plan, ranks=ranks,
                               groups=tuple(dataclasses.replace(g, engine=engine) for g in plan.groups))


def _union_batch_training():
    """One process stepping on the union of the ranks' batches: what the group must compute."""
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ranks = [list(shard_batches(data(), BATCHES, i, epochs=1, seed=0)) for i in range(len(BATCHES))]
    for step in range(UPDATES):
        x, y = (torch.cat([r[step][k] for r in ranks]) for k in range(2))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([q.detach().reshape(-1) for q in model.parameters()])


@pytest.mark.slow
@pytest.mark.parametrize("engine", [m.Engine.DDP, m.Engine.FSDP])
def test_a_rank_with_two_micro_batches_trains_as_the_union_batch(tmp_path, engine):
    run_ok(_plan(engine), script("fsdp_micro.py", "--out", tmp_path), tmp_path, timeout_s=120)
    want = _union_batch_training()
    assert [int((tmp_path / f"steps{r}.txt").read_text()) for r in range(2)] == [UPDATES, 2 * UPDATES]
    for r in range(2):
        got = load(tmp_path / f"rank{r}.pt")
        assert torch.allclose(got, want, rtol=0, atol=1e-6), f"rank {r}: {(got - want).abs().max()}"


def test_micro_slices_cover_the_batch_evenly():
    assert micro_slices(10, 17, 2) == [(10, 14), (14, 17)]
    assert micro_slices(0, 6, 3) == [(0, 2), (2, 4), (4, 6)]


def test_the_data_position_moves_one_step_per_micro_batches():
    stream = shard_batches(data(), BATCHES, 1, epochs=1, seed=0)
    whole = next(stream)[0]
    micro = ShardStream(data(), BATCHES, 1, epochs=1, seed=0, micro=2)
    pieces = iter(micro)
    first, second = next(pieces)[0], next(pieces)[0]
    assert torch.equal(torch.cat([first, second]), whole)
    micro.note_step()
    assert micro.position() == (0, 0)
    micro.note_step()
    assert micro.position() == (0, 1)
    sampler = RankBatchSampler(44, BATCHES, 1, seed=0, micro=2)
    assert len(sampler) == 8 and [len(i) for i in list(sampler)[:2]] == [4, 3]
