"""Rebalancing inside a group (runtime/adapt/rebalance.py), the data it cuts, and emulated slowdowns: the
decision on given numbers, and what the samplers hand out after a change."""
from __future__ import annotations

import textwrap
import time
from dataclasses import replace

import pytest

from hgcli.config.cluster import load_cluster
from hgcli.local.plans import emulated_plan
from hgcli.plan.check import PlanProblem, check_plan
from hgcli.plan.slowdowns import with_slowdowns
from hgcli.runtime.adapt.clock import ComputeClock
from hgcli.runtime.data.blocks import epoch_order, shard_batches, step_slice
from hgcli.runtime.emulate import Emulator
from hgcli.runtime.adapt.rebalance import GroupSplit, Rebalancer, split_by_rate
from hgcli.runtime.data.sampler import RankBatchSampler
from hgcli.schema.stages import Slowdown

import torch


def test_split_by_rate_is_proportional_integral_and_capped():
    assert split_by_rate(16, [1.0, 1.0], [16, 16]) == (8, 8)
    assert split_by_rate(16, [4.0, 1.0], [32, 32]) == (13, 3)          # 12.8 / 3.2
    assert sum(split_by_rate(101, [3.0, 2.0, 1.0], [202] * 3)) == 101
    # A member is never above its cap (memory) nor below one sample; the rest follow the rates.
    assert split_by_rate(16, [10.0, 1.0], [10, 16]) == (10, 6)
    assert split_by_rate(16, [1000.0, 1.0, 1.0], [14, 16, 16]) == (14, 1, 1)
    with pytest.raises(ValueError):
        split_by_rate(2, [1.0, 1.0, 1.0], [4, 4, 4])


def feed(rb: Rebalancer, rates, batches=None, steps=(0, 0), at=0):
    """One check where each member ran ``batch / rate`` seconds per step for a window of 4 steps."""
    batches = batches or rb.split.current
    seconds = [4 * b / r for b, r in zip(batches, rates)]
    samples = [4.0 * b for b in batches]
    return rb.check(at, seconds, samples, list(steps))


def test_a_lasting_slowdown_moves_samples_to_the_faster_member_from_a_data_step_no_one_has_yet():
    split = GroupSplit(0, [8, 8])
    rb = Rebalancer(split)
    assert feed(rb, [100.0, 100.0]) is None                  # the first check only settles
    assert feed(rb, [100.0, 100.0]) is None                  # balanced: nothing to do
    assert feed(rb, [100.0, 25.0], steps=(5, 7)) is None     # member 1 became 4x slower: one window ...
    change = feed(rb, [100.0, 25.0], steps=(9, 11), at=12)   # ... the next confirms it
    assert change is not None and change.after == (13, 3) and change.from_step == 11
    assert change.rates == (100.0, 25.0) and change.step_after_s < change.step_before_s
    assert split.sizes(10) == (8, 8) and split.sizes(11) == (13, 3) == split.current
    # The check right after a change is skipped: the new sizes' first steps are not settled.
    assert feed(rb, [100.0, 25.0]) is None


def test_the_new_split_is_cut_from_both_windows_rates():
    rb = Rebalancer(GroupSplit(0, [10, 10]))
    feed(rb, [1.0, 1.0])
    assert feed(rb, [1.0, 0.5]) is None
    change = feed(rb, [1.0, 0.25])               # both qualify, the same way; the rates are pooled
    seconds = (4 * 10 / 1.0 * 2, 4 * 10 / 0.5 + 4 * 10 / 0.25)
    assert change is not None and change.rates == pytest.approx((80 / seconds[0], 80 / seconds[1]))
    assert change.after == split_by_rate(20, change.rates, rb.caps)


def test_noise_never_moves_a_batch_and_small_gains_wait_until_settled():
    split = GroupSplit(0, [50, 50])
    rb = Rebalancer(split)
    feed(rb, [1.0, 1.0])
    for k in range(10):         # +-4% noise: each proposal (52/48) is below the small gain
        assert split_by_rate(100, [1.04, 0.96], [100, 100]) == (52, 48)
        assert feed(rb, [1.04, 0.96] if k % 2 else [0.96, 1.04]) is None
    # Bursts of contention: each window alone proposes a large gain, but never the same way twice.
    for k in range(10):
        assert feed(rb, [1.6, 1.0] if k % 2 else [1.0, 1.6]) is None
    # A burst then a quiet window: the quiet one does not qualify, so the burst is forgotten.
    for k in range(10):
        assert feed(rb, [1.6, 1.0] if k % 2 else [1.0, 1.0]) is None
    assert split.current == (50, 50)
    rb = Rebalancer(GroupSplit(0, [10, 10]))
    feed(rb, [1.0, 1.0])
    # A lasting 15% difference (a 7% shorter step) is taken at the SMALL_CHECKS-th check in a row.
    outcomes = [feed(rb, [1.0, 0.85]) for _ in range(4)]
    assert outcomes[:3] == [None] * 3 and outcomes[3] is not None and outcomes[3].after == (11, 9)


def test_a_large_window_then_a_small_one_is_not_two_large_ones():
    rb = Rebalancer(GroupSplit(0, [50, 50]))
    feed(rb, [1.0, 1.0])
    # One window of heavy contention, then one 8% apart the same way: pooled they would propose a
    # large gain, but only one window had it; it needs SMALL_CHECKS windows like any small gain.
    assert feed(rb, [1.0, 0.35]) is None
    assert feed(rb, [1.0, 0.92]) is None
    assert feed(rb, [1.0, 0.92]) is None
    assert feed(rb, [1.0, 1.0]) is None          # the difference went away: the count starts again
    assert rb.split.current == (50, 50)


def clock_check(rb: Rebalancer, clocks: list[ComputeClock], per_sample: list[list[float]]):
    """Each member computes a window per entry of its list (seconds per sample), then the check."""
    for clock, windows in zip(clocks, per_sample):
        for t in windows:
            batch = rb.split.current[clocks.index(clock)]
            clock.window_done(t * batch, batch)
    change = rb.check(0, [c.steady_s for c in clocks], [c.computed for c in clocks], [0] * len(clocks))
    for c in clocks:
        c.reset_sums()
    return change


def test_a_clock_nobody_checks_gives_its_recent_steady_rate():
    # --no-adapt: no rebalancer clears the sums; the figure sent each step is of the latest windows
    # (a bounded list: not one entry per step of the run sorted every step).
    clock = ComputeClock()
    for _ in range(10_000):
        clock.window_done(0.03 * 8, 8)
    for _ in range(100):
        clock.window_done(0.01 * 8, 8)
    assert clock.steady_s / clock.computed == pytest.approx(0.01)


def test_a_straggler_that_hits_a_member_on_some_steps_moves_nothing_a_lasting_slowdown_does():
    rb = Rebalancer(GroupSplit(0, [54, 54]))
    clocks = [ComputeClock(), ComputeClock()]
    clock_check(rb, clocks, [[0.01] * 4] * 2)
    # A random straggler (3x) that hit member 1 on two steps of each of two windows in a row: its
    # mean rate halved in both (so the windows' sums proposed ~36/72 twice), its steady rate did not.
    for _ in range(2):
        assert clock_check(rb, clocks, [[0.01] * 4, [0.01, 0.03, 0.01, 0.03]]) is None
    assert rb.split.current == (54, 54)
    # Member 1 4x slower on every step: re-split at the second window.
    assert clock_check(rb, clocks, [[0.01] * 4, [0.04] * 4]) is None
    change = clock_check(rb, clocks, [[0.01] * 4, [0.04] * 4])
    assert change is not None and change.after == (86, 22) and change.rates == pytest.approx((100.0, 25.0))


def test_a_member_without_a_data_source_on_the_split_keeps_the_group_on_the_plan():
    rb = Rebalancer(GroupSplit(0, [8, 8]))
    feed(rb, [1.0, 1.0], steps=(-1, 3))
    assert feed(rb, [4.0, 1.0], steps=(-1, 3)) is None


def test_step_slices_of_a_re_split_group_cover_the_same_block():
    sizes, n = [3, 5, 4, 4], 64                 # group 0: workers 0-1, group 1: workers 2-3
    for step in range(n // 16):
        plan_cut = [step_slice(n, sizes, i, step) for i in range(4)]
        cut = [step_slice(n, sizes, i, step, group=(2, 8, (7, 1))) for i in (2, 3)]
        assert cut[0][0] == plan_cut[2][0] and cut[1][1] == plan_cut[3][1]
        assert cut[0][1] - cut[0][0] == 7 and cut[1] == (cut[0][1], cut[0][1] + 1)


def test_samplers_hand_out_the_new_sizes_and_the_union_is_the_epochs_order():
    n, seed = 80, 3
    split = GroupSplit(0, [5, 5])
    samplers = [RankBatchSampler(n, [5, 5], i, seed=seed, split=split) for i in range(2)]
    assert split.next_step == 0
    its = [iter(s) for s in samplers]
    first = [next(it) for it in its]
    assert split.next_step == 1 and [len(b) for b in first] == [5, 5]
    split.change(2, (8, 2))
    later = [[next(it) for _ in range(3)] for it in its]
    assert [len(b) for b in later[0]] == [5, 8, 8] and [len(b) for b in later[1]] == [5, 2, 2]
    order = epoch_order(n, 0, seed).tolist()
    batches = [first[0] + first[1]] + [later[0][k] + later[1][k] for k in range(3)]
    assert [i for b in batches for i in b] == order[:40]
    # ctx.shard follows it too, by the same data steps.
    data = (torch.arange(n),)
    shard = [list(shard_batches(data, [5, 5], i, epochs=1, seed=seed, split=split)) for i in range(2)]
    assert [len(b[0]) for b in shard[0][:4]] == [5, 5, 8, 8]
    assert torch.cat([torch.cat([shard[0][k][0], shard[1][k][0]]) for k in range(8)]).tolist() == \
        epoch_order(n, 0, seed).tolist()
    with pytest.raises(ValueError, match="keep the group's 2 members and 10 samples"):
        split.change(3, (8, 3))


def test_a_declared_slowdown_applies_from_its_time_and_a_factor_of_one_restores_it():
    emu = Emulator(0.5, slowdown=[(0.0, 4.0), (3600.0, 1.0)])
    assert emu.slowdown_factor() == 4.0 and emu._factor(0) == pytest.approx(8.0)
    later = Emulator(1.0, slowdown=[(0.05, 3.0)])
    assert later.slowdown_factor() == 1.0
    time.sleep(0.06)
    assert later.slowdown_factor() == 3.0
    assert Emulator(1.0).slowdown_factor() == 1.0


def test_cluster_slowdowns_reach_the_plan_ranks_and_leave_the_fingerprint_alone(tmp_path):
    body = """
        [[nodes]]
        host = "127.0.0.1"
        name = "a"
        [nodes.emulate]
        devices = ["A100", "T4"]
        speed = [1.0, 0.25]
        memory_mib = [40960, 15360]
        {extra}
        """
    plain = tmp_path / "plain.toml"
    plain.write_text(textwrap.dedent(body.format(extra="")))
    slowed = tmp_path / "slowed.toml"
    slowed.write_text(textwrap.dedent(body.format(extra="slowdown = [[1, 20, 4], [1, 40, 1]]")))
    a, b = load_cluster(plain), load_cluster(slowed)
    assert b.nodes[0].emulate.slowdown == (Slowdown(1, 20.0, 4.0), Slowdown(1, 40.0, 1.0))
    assert a.fingerprint() == b.fingerprint()          # probe and bench caches stay valid
    plan = emulated_plan([[1.0, 0.25]], [[8, 2]], nodes=[["a", "a"]])
    plan = replace(plan, ranks=tuple(replace(r, device=f"gpu{i}") for i, r in enumerate(plan.ranks)))
    out = with_slowdowns(plan, b)
    assert out.ranks[0].slowdown == () and out.ranks[1].slowdown == b.nodes[0].emulate.slowdown
    # Without slowdowns the ranks gain only their emulated devices' memory (the runtime's cap).
    assert with_slowdowns(plan, a) == replace(plan, ranks=tuple(
        replace(r, memory_mib=m) for r, m in zip(plan.ranks, (40960, 15360))))
    # Ranks restarted 30 s into the job: the slowdown in force is theirs from the start, the
    # recovery comes 10 s later; restarted after both, only the recovery holds.
    assert with_slowdowns(plan, b, elapsed_s=30.0).ranks[1].slowdown == (Slowdown(1, 0.0, 4.0), Slowdown(1, 10.0, 1.0))
    assert with_slowdowns(plan, b, elapsed_s=50.0).ranks[1].slowdown == (Slowdown(1, 0.0, 1.0),)
    assert with_slowdowns(plan, b, elapsed_s=5.0).ranks[1].slowdown == (Slowdown(1, 15.0, 4.0), Slowdown(1, 35.0, 1.0))
    bad = replace(out, ranks=(out.ranks[0], replace(out.ranks[1], slowdown=(Slowdown(1, 5.0, 0.5),))))
    with pytest.raises(PlanProblem, match="factor"):
        check_plan(bad)


# --- the controller's side: the leader's record -> one [adapt] line, series points -------------
RECORD = {"time": 100.0, "rank": 2, "event": "adapt", "kind": "rebalance", "group": 1, "step": 8, "data_step": 10,
          "ranks": [2, 3], "before": [16, 16], "batches": [25, 7], "rates": [1991.2, 607.24],
          "step_before_s": 0.02635, "step_after_s": 0.01256}


def test_an_adapt_record_from_the_groups_leader_becomes_one_console_line():
    from hgcli.launch.events import Adapted, event_dict
    from hgcli.render.launch import status_line

    groups = {0: (0, 1), 1: (2, 3)}
    event = Adapted.parse("j1", 2, RECORD, groups)
    assert event is not None and event.batches == (25, 7)
    assert status_line(event) == ("[adapt] group 1 at step 8: batches 16/16 -> 25/7 of ranks 2/3 (measured "
                                  "1,991/607 samples/s; slowest step 26 ms -> 13 ms)")
    assert event_dict(event)["event"] == "adapt"
    # A rank's records are untrusted: anything that does not fit the plan is no event.
    for bad in ({"rank": 3}, {"group": 0}, {"ranks": [3, 2]}, {"batches": [25, 8]}, {"batches": [32, 0]},
                {"rates": [1.0, "x"]}, {"step": 1.5}, {"step_after_s": -1}, {"group": True},
                {"before": [16, 16, 0]}, {"kind": "regroup"}):
        record = {**RECORD, **bad}
        assert Adapted.parse("j1", record["rank"], record, groups) is None, bad


def test_adapt_records_become_batch_points_and_a_group_mark():
    from hgcli.launch.series import Series

    plan = emulated_plan([[1.0, 1.0], [1.0, 1.0]], [[8, 8], [16, 16]], n_ps=1)
    series = Series(plan)
    points = series.add(2, RECORD)
    batch = sorted((p.run, p.step, p.value) for p in points if p.tag == "batch")
    assert batch == [("rank2", 0, 16.0), ("rank2", 10, 25.0), ("rank3", 0, 16.0), ("rank3", 10, 7.0)]
    mark = [p for p in points if p.tag == "adapt"]
    assert [(p.run, p.step) for p in mark] == [("group1", 8)] and 0.5 < mark[0].value < 0.6
    again = series.add(2, {**RECORD, "before": [25, 7], "batches": [28, 4], "data_step": 18})
    assert sorted((p.run, p.step, p.value) for p in again if p.tag == "batch") == [
        ("rank2", 18, 28.0), ("rank3", 18, 4.0)]
    assert series.add(3, RECORD) == []            # not the leader
