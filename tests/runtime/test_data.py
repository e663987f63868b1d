"""The data side without processes: the sampler's arithmetic, its position, ctx.sampler/ctx.loader in a
world of one, the IterableDataset rule, and the PS recording and restoring data positions."""
import itertools

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import hgcli.runtime as hg
from hgcli.runtime.ps import files as checkpoint
from hgcli.runtime.data.blocks import epoch_order, shard_batches, step_slice, steps_per_epoch, tail_shares
from hgcli.runtime.metrics import MetricsSink
from hgcli.runtime.ps.shards import Segment
from hgcli.runtime.ps.server import ShardServer
from hgcli.runtime.data.sampler import RankBatchSampler


def samplers(n, sizes, **kw):
    return [RankBatchSampler(n, sizes, i, **kw) for i in range(len(sizes))]


def one_epoch(group):
    return [list(s) for s in group]


@pytest.mark.parametrize("sizes", [[5, 3, 1], [4, 4], [1], [2, 7]])
@pytest.mark.parametrize("drop_last", [True, False])
def test_each_step_is_one_block_of_the_permutation_and_no_index_repeats(sizes, drop_last):
    n = 50
    group = samplers(n, sizes, seed=7, drop_last=drop_last)
    for epoch in (0, 1):
        for s in group:
            s.set_epoch(epoch)
        batches = one_epoch(group)
        steps = steps_per_epoch(n, sizes, drop_last)
        assert {len(b) for b in batches} == {steps}                  # every worker, same steps
        perm = epoch_order(n, epoch, 7).tolist()
        g = sum(sizes)
        for step in range(steps):
            union = [i for b in batches for i in b[step]]             # in worker order
            assert union == perm[step * g: step * g + len(union)]      # one contiguous block
            if step < n // g:
                assert [len(b[step]) for b in batches] == sizes         # the plan's batch each
        seen = [i for b in batches for batch in b for i in batch]
        assert len(seen) == len(set(seen))                             # nothing twice in an epoch
        if not drop_last and n % g >= len(sizes):
            assert sorted(seen) == list(range(n))                      # the tail is used too


def test_uneven_tail_is_split_by_batch_with_at_least_one_each():
    assert tail_shares(5, [5, 3, 1]) == [2, 2, 1]     # 1 each, then 2 more in proportion 5:3:1
    assert tail_shares(8, [5, 3, 1]) == [4, 3, 1]
    assert tail_shares(3, [5, 3, 1]) == [1, 1, 1]
    assert steps_per_epoch(11, [5, 3, 1], drop_last=False) == 1      # 2 left: not one for each of 3
    assert steps_per_epoch(12, [5, 3, 1], drop_last=False) == 2
    assert steps_per_epoch(12, [5, 3, 1], drop_last=True) == 1
    with pytest.raises(ValueError, match="larger than the dataset"):
        steps_per_epoch(8, [5, 3, 1])


def test_set_epoch_reshuffles_deterministically_and_a_pass_without_it_moves_on():
    a, b = RankBatchSampler(40, [5, 3], 0, seed=1), RankBatchSampler(40, [5, 3], 0, seed=1)
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b)
    first = list(RankBatchSampler(40, [5, 3], 0, seed=1))
    auto = RankBatchSampler(40, [5, 3], 0, seed=1)
    assert list(auto) == first and auto.epoch == 1          # a finished pass moves to epoch 1
    assert list(auto) != first
    explicit = RankBatchSampler(40, [5, 3], 0, seed=1)
    explicit.set_epoch(1)
    assert list(auto.indices(1, s) for s in range(5)) == list(explicit)
    plain = RankBatchSampler(40, [5, 3], 1, shuffle=False)
    assert next(iter(plain)) == [5, 6, 7]


def test_shard_batches_and_the_sampler_give_the_same_batches():
    x = torch.arange(60) * 10
    sizes = [5, 3, 1]
    for i in range(3):
        tensors = [b[0] // 10 for b in shard_batches((x,), sizes, i, epochs=2, seed=4)]
        s = RankBatchSampler(60, sizes, i, seed=4)
        assert [t.tolist() for t in tensors] == list(s) + list(s)


def test_position_counts_trained_batches_not_the_ones_handed_out():
    s = RankBatchSampler(40, [3, 5], 1, seed=2)        # 5 steps per epoch
    it = iter(s)
    ahead = [next(it) for _ in range(4)]             # a DataLoader prefetches
    assert s.state_dict() == {"epoch": 0, "step": 0, "steps_per_epoch": 5}
    s.note_step()
    s.note_step()
    assert s.position() == (0, 2)
    rest = list(it)
    for _ in range(10):                              # never beyond what was handed out
        s.note_step()
    assert s.position() == (1, 0) and len(ahead + rest) == 5


def test_a_restored_position_skips_earlier_epochs_and_starts_its_epoch_at_its_step():
    s = RankBatchSampler(40, [3, 5], 0, seed=2)
    s.load_state_dict({"epoch": 2, "step": 3, "steps_per_epoch": 5})
    assert s.state_dict()["epoch"] == 2 and len(s) == 0
    passes = []
    for epoch in range(4):                           # the unchanged loop of the first run
        s.set_epoch(epoch)
        passes.append(list(s))
        assert s.position() == ((2, 3) if epoch <= 2 else (epoch, 0))
        for _ in passes[-1]:
            s.note_step()
    assert passes[0] == passes[1] == []
    assert passes[2] == [s.indices(2, k) for k in (3, 4)]
    assert len(passes[3]) == 5 and s.position() == (4, 0)
    auto = RankBatchSampler(40, [3, 5], 0, seed=2)    # no set_epoch: passes still count epochs
    auto.load_state_dict({"epoch": 1, "step": 4})
    assert [len(list(auto)) for _ in range(3)] == [0, 1, 5]
    with pytest.raises(ValueError, match="steps per epoch"):
        s.load_state_dict({"epoch": 0, "step": 0, "steps_per_epoch": 6})
    with pytest.raises(ValueError, match="outside"):
        s.load_state_dict({"epoch": 0, "step": 5})


class Squares(Dataset):
    """Map-style: only len() and __getitem__; counts what was loaded."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor(i * i)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


@pytest.fixture
def alone(monkeypatch):
    """A world of one: no launcher, no torchrun variables."""
    for name in ("RANK", "WORLD_SIZE", "HGTRAIN_PLAN", "HGTRAIN_BATCH_SIZE", "HGTRAIN_METRICS_FD",
                 "HGTRAIN_DEVICE_SPEED", "HGTRAIN_EMULATE_STRAGGLER"):
        monkeypatch.delenv(name, raising=False)
    return hg.init()


def test_an_iterable_dataset_is_refused_with_what_to_use_instead(alone):
    for make in (alone.sampler, alone.loader):
        with pytest.raises(hg.TrainingError, match="Stream is an IterableDataset.*map-style Dataset.*"
                                                   "ctx.worker_index"):
            make(Stream(), batch_size=2)
    with pytest.raises(hg.TrainingError, match="no len"):
        alone.sampler(object(), batch_size=2)


def test_loader_passes_dataloader_arguments_through_and_refuses_its_own(alone):
    seen = []

    def collate(items):
        seen.append(len(items))
        return torch.stack([x for x, _ in items])

    loader = alone.loader(Squares(20), batch_size=4, seed=3, collate_fn=collate, num_workers=0)
    assert isinstance(loader.batch_sampler, RankBatchSampler) and len(loader) == 5
    xs = [b.reshape(-1).long().tolist() for b in loader]
    assert xs == [loader.batch_sampler.indices(0, k) for k in range(5)] and seen == [4] * 5
    assert alone.batch_sizes(4) == [4]
    for bad in ({"sampler": None}, {"batch_sampler": None}):
        with pytest.raises(TypeError, match="sets .* itself"):
            alone.loader(Squares(20), batch_size=4, **bad)


def test_the_first_sampler_follows_opt_step_with_a_prefetching_loader(alone):
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = alone.loader(Squares(24), batch_size=4, num_workers=2)
    alone.wrap(model, opt)
    alone.loader(Squares(8), batch_size=4)           # an evaluation loader: not tracked
    for k, (x, _) in enumerate(itertools.islice(loader, 4)):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        assert loader.batch_sampler.position() == (0, k + 1)
    alone.finish()


def test_the_ps_records_data_positions_in_checkpoints_and_resumes_them(tmp_path):
    LR = [{"lr": 0.1}]      # one parameter group

    def server():
        return ShardServer(shard=0, ps_ranks=[5], group_ids=[0, 1], staleness_bound=1, global_batch=0,
                           timeout_s=60, metrics=MetricsSink(None, {}), checkpoint_dir=tmp_path,
                           checkpoint_every=2)

    first = server()
    try:
        first.seed(0, torch.zeros(3), [Segment(0, 3, None)], {"name": "SGD", "kwargs": {"lr": 0.1}})
        first.pull(0), first.pull(1)
        first.push(0, torch.ones(3), 1.0, LR, None, {"epoch": 0, "step": 1, "steps_per_epoch": 5})
        first.push(1, torch.ones(3), 1.0, LR, None, {"epoch": 0, "step": 1, "steps_per_epoch": 5})
        first.push(0, torch.ones(3), 1.0, LR, None, {"epoch": 0, "step": 2, "steps_per_epoch": 5})
        first.push(1, torch.ones(3), 1.0, LR)        # a push without a position keeps the last one
    finally:
        first.close()
    assert checkpoint.load(tmp_path, 0, 4)["data_positions"] == {
        0: {"epoch": 0, "step": 2, "steps_per_epoch": 5}, 1: {"epoch": 0, "step": 1, "steps_per_epoch": 5}}
    again = server()
    try:
        assert again.resume() == 4
        assert again.data_position(0)["step"] == 2 and again.data_position(1)["step"] == 1
    finally:
        again.close()
    # A checkpoint from before data positions were recorded still resumes: no position for anyone.
    old = checkpoint.load(tmp_path, 0, 4)
    del old["data_positions"]
    checkpoint.save(tmp_path, 0, 6, {k: v for k, v in old.items() if k not in ("format", "shard", "version")})
    legacy = server()
    try:
        assert legacy.resume() == 6 and legacy.data_position(0) is None
    finally:
        legacy.close()


def test_the_ddp_hook_state_is_none_a_group_or_explicit_and_needs_a_batch(monkeypatch):
    from hgcli.runtime.group.ddp import WeightedDDPState, _state_of, weighted_ddp_hook

    explicit = WeightedDDPState(batch_size=3)
    assert _state_of(explicit) is explicit
    assert _state_of(None) is _state_of(None)          # one kept state (and batch sum) per group
    with pytest.raises(TypeError, match="process group or a WeightedDDPState"):
        _state_of(3)
    for name in ("HGTRAIN_PLAN", "HGTRAIN_BATCH_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    class Bucket:
        def buffer(self):
            return torch.zeros(2)

    with pytest.raises(hg.TrainingError, match="no batch size.*WeightedDDPState"):
        weighted_ddp_hook(WeightedDDPState(), Bucket())


def test_a_restored_position_reaches_the_training_sampler_made_before_or_after():
    from hgcli.runtime.exchange.position import DataPosition

    pos = {"epoch": 1, "step": 2, "steps_per_epoch": 5}
    for before in (True, False):
        data = DataPosition()
        sampler = RankBatchSampler(40, [3, 5], 0)
        if before:
            data.track(sampler)
        data.restore(pos)
        data.track(sampler)
        data.track(RankBatchSampler(40, [3, 5], 0))   # a second sampler is not the training data's
        assert data.sampler is sampler and data.current() == pos == sampler.state_dict()
    data = DataPosition()
    data.restore(pos)
    with pytest.raises(hg.TrainingError, match="does not fit this data source"):
        data.track(RankBatchSampler(48, [3, 5], 0))   # 6 steps per epoch; the checkpoint counted 5


def test_ctx_shard_keeps_a_position_and_continues_from_a_restored_one():
    from hgcli.runtime.data.blocks import ShardStream, shard_batches

    x = torch.arange(40).float().unsqueeze(1)
    whole = [b[0].squeeze(1).tolist() for b in shard_batches((x,), [3, 5], 1, epochs=2, seed=4)]
    stream = ShardStream((x,), [3, 5], 1, epochs=2, seed=4)
    taken = iter(stream)
    for _ in range(7):                        # drawn 7, trained 6 (the 7th batch is still in hand)
        next(taken)
    for _ in range(6):
        stream.note_step()
    assert stream.state_dict() == {"epoch": 1, "step": 1, "steps_per_epoch": 5}
    again = ShardStream((x,), [3, 5], 1, epochs=2, seed=4)
    again.load_state_dict(stream.state_dict())
    assert [b[0].squeeze(1).tolist() for b in again] == whole[6:]
    with pytest.raises(ValueError, match="already being drawn"):
        stream.load_state_dict({"epoch": 0, "step": 0, "steps_per_epoch": 5})
    with pytest.raises(ValueError, match="counts 4 steps per epoch"):
        ShardStream((x,), [3, 5], 1, epochs=2, seed=4).load_state_dict({"epoch": 0, "step": 0, "steps_per_epoch": 4})


def test_shard_0_answers_the_groups_shares_and_keeps_them_in_its_checkpoints(tmp_path):
    """Two groups of one, 32 samples each in the plan; group 1 computes 4x slower per sample: shard 0
    moves the global batch to group 0, every answer carries the schedule, a checkpoint keeps it and a
    resumed shard answers it again."""
    from hgcli.local.plans import emulated_plan
    from hgcli.runtime.adapt.shares import GroupShares, block_layout

    LR = [{"lr": 0.1}]
    plan = emulated_plan([[1.0], [1.0]], [[32], [32]], n_ps=1, staleness_bound=1)

    def server():
        return ShardServer(shard=0, ps_ranks=[2], group_ids=[0, 1], staleness_bound=1, global_batch=64,
                           timeout_s=60, metrics=MetricsSink(None, {}), checkpoint_dir=tmp_path,
                           checkpoint_every=2, shares=GroupShares(block_layout(plan)))

    first = server()
    answers = []
    try:
        first.seed(0, torch.zeros(3), [Segment(0, 3, None)], {"name": "SGD", "kwargs": {"lr": 0.1}})
        first.pull(0), first.pull(1)
        for k in range(16):
            for g, per_sample in ((0, 0.001), (1, 0.004)):
                total = first.shares.split.current[g]
                answers.append(first.push(g, torch.ones(3), float(total), LR, None, None, None,
                                          (per_sample * total, float(total), k + 1, k, 0)))
    finally:
        first.close()
    schedule = first.shares.schedule()
    assert len(schedule) == 1 and schedule[0][1] == (51, 13), schedule
    assert answers[-1].wait()[3] == schedule and answers[0].wait()[3] == []
    version = 32
    assert checkpoint.load(tmp_path, 0, version)["group_shares"]["schedule"] == [[schedule[0][0], [51, 13]]]
    again = server()
    try:
        assert again.resume() == version and again.shares.schedule() == schedule
        assert again.pull(0).wait()[3] == schedule
    finally:
        again.close()
