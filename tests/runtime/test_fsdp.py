"""fsdp groups: the model sharded with FSDP2 over the group (group/fsdp.py, group/sharded.py).

A homogeneous fsdp group is plain FSDP2 under torchrun, bit for bit; unequal batches give one
process's step on the union batch; the optimizer FSDP2 would leave stale is rebuilt the same, or
refused in one line; a shard pattern that matches nothing is refused in one line."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hgcli.local.plans import emulated_plan
from hgcli.runtime.errors import TrainingError
from hgcli.runtime.group.fsdp import ShardOptions, shard, shard_units
from hgcli.runtime.group.rebuild import parameter_names, rebuild_optimizer
from hgcli.schema import stages as m

from .helpers import load, run_ok, script
from .scripts.fsdp_train import LR, MOMENTUM, STEPS, Blocks, batch


def _fsdp_plan(batches):
    plan = emulated_plan([[1.0] * len(batches)], [batches])
    return dataclasses.replace(plan, groups=tuple(dataclasses.replace(g, engine=m.Engine.FSDP) for g in plan.groups))


def _train(tmp_path, mode, batches, *args):
    out = tmp_path / mode
    out.mkdir()
    run_ok(_fsdp_plan(batches), script("fsdp_train.py", mode, "--out", out, *args), out)
    return [load(out / f"rank{r}.pt") for r in range(len(batches))]


def _flat(model):
    return torch.cat([q.detach().reshape(-1) for q in model.parameters()])


@pytest.mark.slow
def test_a_homogeneous_fsdp_group_is_plain_fsdp2_bit_for_bit(tmp_path):
    ours, plain = _train(tmp_path, "hg", [8, 8]), _train(tmp_path, "fsdp", [8, 8])
    assert not torch.equal(ours[0], _flat(Blocks())), "it did not train"
    for r in range(2):
        assert torch.equal(ours[r], plain[r]), f"rank {r} differs by {(ours[r] - plain[r]).abs().max()}"
    # Every block, the root's layers: each an FSDP unit whose reduce-scatter the engine ran.
    assert int((tmp_path / "hg" / "calls0.txt").read_text()) == 3 * STEPS


@pytest.mark.slow
def test_unequal_batches_give_the_step_on_the_union_batch(tmp_path):
    """The plan's batches are 4 and 6, the data's 3 and 7: both of the engine's factors at work (n_i W / B
    before the reduce-scatter, B / N after)."""
    sizes = [3, 7]
    ours = _train(tmp_path, "hg", [4, 6], "--sizes", "3,7")
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        parts = [batch(step, r, sizes) for r in range(2)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    want = _flat(model)
    for r in range(2):
        assert torch.allclose(ours[r], want, rtol=0, atol=1e-6), (ours[r] - want).abs().max()


def _resharded(model):
    """What FSDP2 does to the optimizer's view: every parameter replaced by a new one, same name."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(p.detach().clone()))
    return model


def test_the_rebuilt_optimizer_keeps_class_groups_and_hyperparameters():
    model = Blocks()
    opt = torch.optim.AdamW([{"params": model.inp.parameters(), "lr": 0.01, "weight_decay": 0.0},
                             {"params": list(model.layers.parameters()) + list(model.head.parameters())}],
                            lr=0.003, betas=(0.8, 0.95), weight_decay=0.2)
    names = parameter_names(model)
    before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    new = rebuild_optimizer(opt, names, _resharded(model))
    assert type(new) is torch.optim.AdamW and new.defaults == opt.defaults
    assert [{k: v for k, v in g.items() if k != "params"} for g in new.param_groups] == before
    now = dict(model.named_parameters())
    for old_group, new_group in zip(opt.param_groups, new.param_groups):
        assert [id(p) for p in new_group["params"]] == [id(now[names[id(p)]]) for p in old_group["params"]]
    assert not any(id(p) in names for g in new.param_groups for p in g["params"])


class _NeedsScale(torch.optim.SGD):
    """An optimizer whose constructor does not take its own defaults back."""

    def __init__(self, params, scale):
        super().__init__(params, lr=0.1 * scale)


@pytest.mark.parametrize("case,says", [
    ("constructor", "cannot rebuild _NeedsScale over the sharded parameters"),
    ("state", "already has state"),
    ("scheduler", "learning-rate scheduler was built on the SGD before ctx.wrap"),
])
def test_an_optimizer_that_cannot_be_rebuilt_is_refused_in_one_line(case, says):
    model = Blocks()
    opt = (_NeedsScale(model.parameters(), 2.0) if case == "constructor"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    if case == "state":
        F.cross_entropy(model(torch.randn(4, 8)), torch.zeros(4, dtype=torch.long)).backward()
        opt.step()
    if case == "scheduler":
        torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    names = parameter_names(model)
    with pytest.raises(TrainingError, match=says) as err:
        rebuild_optimizer(opt, names, _resharded(model))
    assert "\n" not in str(err.value)


def test_units_are_each_block_of_a_module_list_or_the_pattern_deepest_first():
    model = Blocks()
    assert [n for n, _ in shard_units(model, None)] == ["layers.1", "layers.0"]
    assert [n for n, _ in shard_units(model, "layers.*")] == ["layers.1.0", "layers.1", "layers.0.0", "layers.0"]
    assert [n for n, _ in shard_units(model, "head")] == ["head"]


@pytest.mark.parametrize("pattern,says", [
    ("encoder.*", "'encoder.*' matches no module of Blocks (names as model.named_modules() gives them, e.g. inp, "),
    ("layers.*.1", "matches only modules without parameters (layers.0.1, layers.1.1): nothing to shard"),
])
def test_a_shard_pattern_that_matches_nothing_is_refused_in_one_line(pattern, says):
    with pytest.raises(TrainingError, match=None) as err:
        shard_units(Blocks(), pattern)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_model_without_parameters_has_nothing_to_shard():
    with pytest.raises(TrainingError, match="ReLU has no trained parameters: an fsdp group has nothing to shard"):
        shard(torch.nn.ReLU(), None, torch.device("cpu"), ShardOptions())
