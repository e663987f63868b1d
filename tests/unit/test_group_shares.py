"""Re-splitting the global batch across groups (runtime/adapt/shares.py): shard 0's decision on given
paces, the data step it picks, its checkpoint state, and how every group's samplers cut the blocks."""
from __future__ import annotations

import pytest

from hgcli.local.plans import emulated_plan
from hgcli.runtime.data.blocks import epoch_order
from hgcli.runtime.adapt.shares import MARGIN_STEPS, GroupShares, block_layout
from hgcli.runtime.adapt.rebalance import GroupSplit, split_by_rate
from hgcli.runtime.data.sampler import RankBatchSampler


def layout():
    return block_layout(emulated_plan([[1.0, 1.0], [1.0]], [[16, 16], [32]], n_ps=1, staleness_bound=2))


def test_the_block_layout_orders_groups_by_their_first_worker_and_refuses_gaps():
    assert layout() == [(0, 0, (16, 16)), (1, 2, (32,))]
    assert block_layout(emulated_plan([[1.0, 1.0]], [[16, 0]])) is None        # a worker without a batch


def feed(shares, per_sample, steps=4, next_step=(10, 6), reached=(8, 5)):
    """Every group pushes ``steps`` times at ``per_sample`` seconds a sample at its current share."""
    change = None
    for _ in range(steps):
        for g, secs in enumerate(per_sample):
            total = shares.split.current[g]
            change = shares.note(g, (secs * total, float(total), next_step[g], reached[g], 0)) or change
    return change


def test_shard_0_moves_the_batch_to_the_faster_group_after_two_checks_agree_past_every_group():
    shares = GroupShares(layout())
    assert feed(shares, [0.001, 0.004]) is None           # the first check settles
    assert feed(shares, [0.001, 0.004]) is None           # one check of a large gain: not yet
    change = feed(shares, [0.001, 0.004])
    assert change is not None and change.before == (32, 32)
    assert change.after == split_by_rate(64, [4.0, 1.0], [64, 64], [2, 1]) == (51, 13)
    # From a data step past the furthest-ahead group's next one, its look-ahead twice and the margin.
    assert change.from_step == 10 + 2 * 2 + MARGIN_STEPS
    assert shares.schedule() == [(change.from_step, (51, 13))]
    # Steady rates at the new shares: nothing moves.
    assert feed(shares, [0.001, 0.004], steps=12) is None


def test_a_group_re_splitting_among_its_members_restarts_the_count_and_its_old_windows_are_dropped():
    """Group 0 slowed while its members' split was wrong; its members re-split from data step 12:
    the windows it pushes before reaching step 12 do not count, and the checks in a row start again."""
    shares = GroupShares(layout())
    feed(shares, [0.001, 0.004])                          # settled
    feed(shares, [0.001, 0.004])                          # one check agrees
    for k in range(8):                                    # group 0 slow, still at its old split
        for g, secs in enumerate([0.010, 0.004]):
            total = shares.split.current[g]
            assert shares.note(g, (secs * total, float(total), 4 + k, 2 + k, 12 if g == 0 else 0)) is None
    assert shares._per_sample[0] == []                    # nothing before step 12 counted
    change = None
    for k in range(8):                                    # at its new split: as fast as before
        for g, secs in enumerate([0.001, 0.004]):
            total = shares.split.current[g]
            change = shares.note(g, (secs * total, float(total), 20 + k, 18 + k, 12 if g == 0 else 0)) or change
    # Two checks at the new split, agreeing: the change, cut from them alone (the slow windows gone).
    assert change is not None and change.after == (51, 13) and change.from_step == 27 + 2 * 2 + MARGIN_STEPS


def test_a_group_that_hands_out_no_data_by_the_split_keeps_the_plans_shares():
    shares = GroupShares(layout())
    for _ in range(4):
        assert feed(shares, [0.001, 0.004], next_step=(10, -1)) is None
    assert shares.schedule() == []


def test_a_group_keeps_a_sample_per_member_and_at_most_twice_its_planned_total():
    shares = GroupShares(layout())
    for _ in range(3):
        change = feed(shares, [0.004, 0.00001])
    assert change is not None and change.after == (2, 62)     # group 0 keeps one sample per member
    shares = GroupShares(block_layout(emulated_plan([[1.0], [1.0], [1.0]], [[8], [8], [48]], n_ps=1,
                                                    staleness_bound=2)))
    for _ in range(3):
        change = feed(shares, [0.00001, 0.01, 0.01], next_step=(1, 1, 1), reached=(1, 1, 1))
    assert change is not None and change.after[0] == 16      # 2 x its plan's 8


def test_the_schedule_survives_a_checkpoint_of_the_same_plan_only():
    shares = GroupShares(layout())
    for _ in range(3):
        feed(shares, [0.001, 0.004])
    state = shares.state_dict()
    again = GroupShares(layout())
    assert again.load_state_dict(state) and again.schedule() == shares.schedule()
    other = GroupShares(block_layout(emulated_plan([[1.0], [1.0]], [[32], [32]], n_ps=1, staleness_bound=2)))
    assert not other.load_state_dict({**state, "groups": [0, 1], "planned": [24, 40]})
    assert other.schedule() == [] and not other.load_state_dict(None)


def test_every_groups_sampler_cuts_its_share_of_the_same_block():
    """Group 0 (workers 0-1, one re-split of its own) and group 1 (worker 2), the shares moved from
    data step 3: each step's batches are one block of the epoch's order, every sample once."""
    n, seed, totals = 64 * 6, 1, [32, 32]
    splits = [GroupSplit(0, [16, 16], block=0, totals=totals), GroupSplit(2, [32], block=1, totals=totals)]
    splits[0].change(2, (20, 12))
    for split in splits:
        split.share(3, (48, 16))
    assert splits[0].sizes(1) == (16, 16) and splits[0].sizes(2) == (20, 12)
    assert splits[0].sizes(3) == (30, 18) and splits[1].sizes(3) == (16,)      # 20:12 kept, 48 in all
    assert splits[1].cut(3) == (2, 48, (16,))
    samplers = [RankBatchSampler(n, [16, 16, 32], i, seed=seed, split=splits[0 if i < 2 else 1]) for i in range(3)]
    batches = [list(s) for s in samplers]
    order = epoch_order(n, 0, seed).tolist()
    for k in range(6):
        union = [i for b in batches for i in b[k]]
        assert union == order[k * 64:(k + 1) * 64]
    assert [len(b) for b in batches[2]] == [32, 32, 32, 16, 16, 16]
    with pytest.raises(ValueError, match="keep 2 groups and 64 samples"):
        splits[1].share(4, (48, 17))
    with pytest.raises(ValueError, match="outside 1..64"):
        splits[1].share(4, (64, 0))


# --- the controller's side: shard 0's record -> one [adapt] line, a job mark ---------------------
SHARES = {"time": 100.0, "rank": 4, "role": "ps", "event": "adapt", "kind": "shares", "step": 3, "data_step": 40,
          "groups": [0, 1], "before": [32, 32], "batches": [51, 13], "rates": [3228.0, 790.4],
          "step_before_s": 0.0405, "step_after_s": 0.0164}


def test_a_shares_record_from_shard_0_becomes_one_console_line_and_a_job_mark():
    from hgcli.launch.events import Adapted
    from hgcli.launch.series import Series
    from hgcli.render.launch import status_line

    plan = emulated_plan([[1.0, 1.0], [1.0, 1.0]], [[8, 8], [16, 16]], n_ps=1)
    groups = {g.id: tuple(g.ranks) for g in plan.groups}
    event = Adapted.parse("j1", 4, SHARES, groups, coordinator=plan.ps_shards[0])
    assert event is not None and event.kind == "shares" and event.groups == (0, 1) and event.group is None
    assert status_line(event) == ("[adapt] groups 0/1 from data step 40: shares of the global batch 32/32 -> "
                                  "51/13 (measured 3,228/790 samples/s; slowest step 40 ms -> 16 ms)")
    # Only shard 0 sends them, about the plan's groups, keeping the global batch.
    for rank, bad in ((2, {}), (4, {"groups": [0, 2]}), (4, {"batches": [51, 14]}), (4, {"groups": [0]}),
                      (4, {"groups": [0, True]})):
        assert Adapted.parse("j1", rank, {**SHARES, **bad}, groups, coordinator=4) is None, bad
    assert Adapted.parse("j1", 4, SHARES, groups) is None            # no PS: no shares
    series = Series(plan)
    marks = [p for p in series.add(4, SHARES) if p.tag == "adapt"]
    assert [p.run for p in marks] == ["job"] and 0.5 < marks[0].value < 0.65
