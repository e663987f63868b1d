"""The data source of a script that draws its own batches (hgcli/runtime/data/drawn.py): this
worker's size per opt.step() (the plan's share, its micro-batches, a group's re-split from the data
step it applies at), per-worker streams, and the data position that checkpoints keep."""
from __future__ import annotations

import pytest
import torch

from hgcli.runtime.adapt.rebalance import GroupSplit
from hgcli.runtime.data.drawn import DrawnBatches, worker_seed


def draws(source: DrawnBatches, steps: int, default: int = 5) -> list[int]:
    """The sizes a script reads over ``steps`` opt.step() calls (the optimizer's hook notes each)."""
    out = []
    for _ in range(steps):
        out.append(source.batch_size(default))
        source.note_step()
    return out


def test_the_plans_batch_and_the_default_where_the_plan_gives_none():
    assert draws(DrawnBatches(12, 0), 3) == [12, 12, 12]
    assert draws(DrawnBatches(None, 2), 2, default=7) == [7, 7]


def test_micro_batches_cut_each_step_as_ctx_shard_does():
    source = DrawnBatches(7, 0, micro=2)
    assert draws(source, 6) == [4, 3] * 3
    assert source.state_dict() == {"epoch": 0, "step": 3, "steps_per_epoch": 0}


def test_a_re_split_applies_from_its_data_step_and_reading_reports_the_step_handed_out():
    split = GroupSplit(1, [6, 2])               # a group of workers 1 and 2
    member = DrawnBatches(2, 2)
    member.follow(split)
    assert split.next_step == 0                 # attached: a change can start at data step 0 at the earliest
    assert draws(member, 2) == [2, 2]
    assert split.next_step == 2                 # steps 0 and 1 handed out
    split.change(3, [5, 3])
    assert draws(member, 3) == [2, 3, 3]        # step 2 still the plan's, 3 and 4 the re-split's


def test_workers_get_different_streams_and_a_rerun_the_same():
    a, b = DrawnBatches(4, 0).generator(7), DrawnBatches(4, 1).generator(7)
    again = DrawnBatches(4, 0).generator(7)
    first = torch.randint(1000, (8,), generator=a)
    assert not torch.equal(first, torch.randint(1000, (8,), generator=b))
    assert torch.equal(first, torch.randint(1000, (8,), generator=again))
    # seed + rank would collide here: worker 1 of seed 0 and worker 0 of seed 1
    assert worker_seed(0, 1, 0) != worker_seed(1, 0, 0)


def test_a_restored_position_moves_the_step_and_re_seeds_the_streams():
    source = DrawnBatches(4, 1)
    gen = source.generator(3)
    source.load_state_dict({"epoch": 0, "step": 40, "steps_per_epoch": 0})
    assert source.data_step == 40 and source.state_dict()["step"] == 40
    expected = torch.Generator().manual_seed(worker_seed(3, 1, 40))
    assert torch.equal(torch.randint(1000, (8,), generator=gen), torch.randint(1000, (8,), generator=expected))
    assert not torch.equal(torch.Generator().manual_seed(worker_seed(3, 1, 0)).get_state(),
                           torch.Generator().manual_seed(worker_seed(3, 1, 40)).get_state())


def test_a_position_is_refused_once_the_script_has_stepped():
    source = DrawnBatches(4, 0)
    draws(source, 1)
    with pytest.raises(ValueError, match="stepped already"):
        source.load_state_dict({"epoch": 0, "step": 5, "steps_per_epoch": 0})
