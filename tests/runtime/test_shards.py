"""The PS's cut of the parameters into shards, and the leader's staging buffers (in process)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hgcli.runtime.shards import ALIGN, ELEMENTWISE, plan_layout, segment_views
from hgcli.runtime.staging import Staging

shape = st.lists(st.integers(1, 40), min_size=0, max_size=3).map(tuple)


def _groups_of_elements(layout, numels, group_of):
    """The parameter group of every element of the flat vector, from the layout's order."""
    out = []
    for i in layout.order:
        out += [group_of[i]] * numels[i]
    return out


@settings(max_examples=80, deadline=None)
@given(shapes=st.lists(shape, min_size=1, max_size=12), shards=st.integers(1, 5), data=st.data(),
       elementwise=st.booleans())
def test_shards_are_contiguous_ranges_covering_every_element_once_in_their_groups(shapes, shards, data, elementwise):
    groups = data.draw(st.lists(st.integers(-1, 2), min_size=len(shapes), max_size=len(shapes)))
    layout = plan_layout(shapes, groups, shards, elementwise)
    numels = [int(torch.zeros(s).numel()) for s in shapes]
    assert layout.bounds[0] == 0 and layout.bounds[-1] == layout.numel == sum(numels)
    assert list(layout.bounds) == sorted(layout.bounds)
    assert sorted(layout.order) == list(range(len(shapes)))
    per_element = _groups_of_elements(layout, numels, groups)
    for s in range(shards):
        lo, hi = layout.span(s)
        segs = layout.segments[s]
        assert sum(seg.length for seg in segs) == hi - lo
        # every segment holds elements of its own group only
        at = lo
        for seg in segs:
            assert set(per_element[at: at + seg.length]) == {seg.group}
            at += seg.length
        if elementwise:
            assert all(seg.shape is None for seg in segs)
            assert all(a.group != b.group for a, b in zip(segs, segs[1:]))    # runs merged
        else:
            assert all(seg.shape is not None and int(torch.zeros(seg.shape).numel()) == seg.length
                       for seg in segs)                                        # whole tensors
    if elementwise and layout.numel >= shards * ALIGN:
        sizes = [layout.size(s) for s in range(shards)]
        assert max(sizes) - min(sizes) <= 2 * ALIGN                           # equal shares


def test_an_elementwise_layout_balances_one_huge_layer_and_a_shaped_one_cannot():
    shapes = [(1000, 100), (100,), (10, 10)]
    flat = plan_layout(shapes, [0, 1, 0], 4, elementwise=True)
    assert [flat.size(s) for s in range(4)] == [25056, 25040, 25056, 25048]
    assert flat.order == (0, 2, 1)                        # grouped: group 0's tensors, then group 1's
    whole = plan_layout(shapes, [0, 1, 0], 4, elementwise=False)
    assert sorted(whole.size(s) for s in range(4)) == [0, 0, 200, 100000]        # the big layer on one shard
    assert torch.optim.AdamW in ELEMENTWISE and torch.optim.SGD in ELEMENTWISE


def test_views_of_the_flat_vector_and_of_a_shard_address_the_same_elements():
    params = [torch.randn(4, 3), torch.randn(5), torch.randn(2, 2)]
    layout = plan_layout([p.shape for p in params], [1, 0, 1], 2, elementwise=True)
    flat = torch.empty(layout.numel)
    torch._foreach_copy_(layout.views(flat, [p.shape for p in params]), [params[i] for i in layout.order])
    rebuilt = torch.cat([torch.cat([v.reshape(-1) for v in segment_views(flat[slice(*layout.span(s))],
                                                                         layout.segments[s])])
                         for s in range(2)])
    assert torch.equal(rebuilt, flat)
    assert torch.equal(flat[:5], params[1])               # group 0 first


def test_staging_round_trips_fp32_and_bf16_error_feedback_keeps_what_rounding_drops():
    """bf16 keeps 8 significant bits: 1 + 2^-9 rounds to 1 on every push, so plain rounding loses
    2^-9 per push for good; with error feedback the pushes' sum stays within one rounding of the
    gradients' sum."""
    params = [torch.zeros(2), torch.zeros(1)]
    layout = plan_layout([p.shape for p in params], [0, 0], 1, elementwise=True)
    plain = Staging(layout, params, torch.float32, torch.device("cpu"))
    plain.fill([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    assert plain.push.tolist() == [1.0, 2.0, 3.0]
    plain.answer.copy_(torch.tensor([4.0, 5.0, 6.0]))
    plain.load()
    assert params[0].tolist() == [4.0, 5.0] and params[1].tolist() == [6.0]

    grads = [torch.tensor([1 + 2 ** -9, -1e-3 * (1 + 2 ** -9)]), torch.tensor([0.5])]
    staged = Staging(layout, params, torch.bfloat16, torch.device("cpu"))
    total = torch.zeros(3)
    for _ in range(200):
        staged.fill(grads)
        assert staged.push.dtype == torch.bfloat16
        total += staged.push.float()
    exact = 200 * torch.cat(grads)
    assert (total - exact).abs().max() <= 2 ** -8
    assert (200 * torch.cat(grads).to(torch.bfloat16).float() - exact).abs().max() > 0.3   # rounding alone
