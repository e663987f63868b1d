"""The PS's cut of the parameters into shards, and the leader's staging buffers (in process)."""
from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hgcli.runtime.ps.shards import ALIGN, ELEMENTWISE, plan_layout, segment_views
from hgcli.runtime.exchange.staging import Staging

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


def test_transfer_sends_in_chunks_and_widens_bf16_through_two_small_buffers(tmp_path):
    import subprocess
    import sys

    from hgcli.node.ports import free_port

    from .helpers import SCRIPTS

    port, out = free_port(), tmp_path / "got.pt"
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "transfer_pair.py"), str(r), str(port), str(out)])
             for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    got = torch.load(out, weights_only=True)
    assert torch.equal(got["straight"], got["expected"])
    assert got["widened"].dtype == torch.float32
    assert torch.equal(got["widened"], got["expected"].to(torch.bfloat16).float())


def test_ps_threads_come_from_the_environment_or_the_nodes_cores_shared_by_its_ranks():
    import pytest

    from hgcli.local.plans import emulated_plan
    from hgcli.runtime.errors import TrainingError
    from hgcli.runtime.ps.rank import ps_threads

    plan = emulated_plan([[1.0], [1.0]], [[4], [4]], n_ps=2, nodes=[["a"], ["b"]], ps_node="b")
    ps = plan.ps_shards[0]
    assert ps_threads(plan, ps, {}, 16) == 5                 # node b: a worker and two shards
    assert ps_threads(plan, ps, {}, 2) == 1                  # never below one
    assert ps_threads(plan, ps, {"HGTRAIN_PS_THREADS": "3"}, 16) == 3
    with pytest.raises(TrainingError, match="HGTRAIN_PS_THREADS='0' is not a positive"):
        ps_threads(plan, ps, {"HGTRAIN_PS_THREADS": "0"}, 16)


def test_a_checkpoint_of_whole_tensor_shards_is_refused_with_the_reason(tmp_path):
    import pytest

    from hgcli.runtime.ps import files as checkpoint

    # The directory is the rank's to create, 0700 under any umask (it was 0755: the audit's find).
    old_umask = os.umask(0)
    try:
        checkpoint.save(tmp_path / "ps-checkpoint", 0, 5, {"params": [torch.ones(2)]})
    finally:
        os.umask(old_umask)
    assert (tmp_path / "ps-checkpoint").stat().st_mode & 0o777 == 0o700
    tmp_path = tmp_path / "ps-checkpoint"
    path = checkpoint.shard_path(tmp_path, 0, 5)
    data = torch.load(path, weights_only=True)
    data["format"] = "hgtrain-ps-shard/1"
    torch.save(data, path)
    with pytest.raises(ValueError, match=r"older hgtrain \(shards of whole tensors\).*without resuming"):
        checkpoint.load(tmp_path, 0, 5)


def test_a_corrupt_checkpoint_names_its_file_and_every_shard_falls_back_to_the_version_before(tmp_path, capsys):
    """Garbage, an empty file, a truncated one and a pickled list: one ValueError naming the file
    (no unpickling traceback), and resume takes the newest set whose files are all readable, on
    every shard alike, even when the bad file is another shard's."""
    import pytest

    from hgcli.runtime.ps import files as checkpoint
    from hgcli.runtime.metrics import MetricsSink
    from hgcli.runtime.ps.server import ShardServer
    from hgcli.runtime.ps.shards import Segment

    def server(shard):
        return ShardServer(shard=shard, ps_ranks=[5, 6], group_ids=[0], staleness_bound=0, global_batch=0,
                           timeout_s=60, metrics=MetricsSink(None, {}), checkpoint_dir=tmp_path, checkpoint_every=1)

    spec = {"name": "SGD", "kwargs": {"lr": 1.0}}
    for shard in (0, 1):                                # versions 1 and 2 of both shards
        s = server(shard)
        try:
            s.seed(0, torch.zeros(2), [Segment(0, 2, None)], spec)
            s.pull(0)
            s.push(0, torch.ones(2), 1.0, [{"lr": 1.0}]).wait()
            s.push(0, torch.ones(2), 1.0, [{"lr": 1.0}]).wait()
        finally:
            s.close()
    assert checkpoint.complete_versions(tmp_path, 2) == [2, 1]
    good = checkpoint.shard_path(tmp_path, 1, 2).read_bytes()
    for bad in (b"garbage" * 10, b"", good[: len(good) // 2], None):
        path = checkpoint.shard_path(tmp_path, 1, 2)
        if bad is None:
            torch.save([1, 2], path)
        else:
            path.write_bytes(bad)
        with pytest.raises(ValueError, match=r"shard1-v0000000002\.pt: not a (readable )?checkpoint") as err:
            checkpoint.load(tmp_path, 1, 2)
        assert "\n" not in str(err.value) and "weights_only" not in str(err.value)
        assert checkpoint.intact(tmp_path, 1, 2) is not None
        for shard in (0, 1):                            # both fall back to version 1
            s = server(shard)
            try:
                assert s.resume() == 1
                torch.testing.assert_close(s.held.master, torch.full((2,), -1.0))
            finally:
                s.close()
        assert "checkpoint version 2 is not usable (" in capsys.readouterr().out
    path.write_bytes(good)
    assert checkpoint.intact(tmp_path, 1, 2) is None


def test_a_step_waits_for_the_answers_still_being_sent_from_the_master_copy():
    """An answer with parameters is sent from the master copy itself, counted as a reader until the
    send is done: the next push's optimizer step must not change the master copy before that."""
    import threading

    from hgcli.runtime.metrics import MetricsSink
    from hgcli.runtime.ps.server import PARAMS, ShardServer
    from hgcli.runtime.ps.shards import Segment

    server = ShardServer(shard=0, ps_ranks=[3], group_ids=[0], staleness_bound=0, global_batch=0,
                         timeout_s=60, metrics=MetricsSink(None, {}))
    in_flight = []

    def deliver(group, fut, fields):                  # as ps_io.ShardIO does: a send still going on
        if any(f is PARAMS for f in fields):
            server.readers += 1
            in_flight.append(server.held.master.clone())
        fut.set_result(fields)

    server.deliver = deliver
    try:
        server.seed(0, torch.zeros(2), [Segment(0, 2, None)], {"name": "SGD", "kwargs": {"lr": 1.0}})
        server.pull(0)
        assert server.readers == 1
        pushed = threading.Thread(target=lambda: server.push(0, torch.ones(2), 1.0, [{"lr": 1.0}]))
        pushed.start()
        pushed.join(0.5)
        assert pushed.is_alive() and torch.equal(server.held.master, torch.zeros(2))   # waiting, untouched
        with server.cv:
            server.readers -= 1                       # the send is done
            server.cv.notify_all()
        pushed.join(10)
        assert not pushed.is_alive() and torch.equal(server.held.master, torch.full((2,), -1.0))
    finally:
        server.close()
