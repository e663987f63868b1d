"""``ctx.wrap`` returns a module of DDP's shape in every plan (issue 52): ``.module`` and
``no_sync()`` work in a group of one as in a group of two; ``ctx.num_workers`` leaves the PS ranks
out of WORLD_SIZE."""
from __future__ import annotations

import json

import torch

from hgcli.local.plans import emulated_plan
from hgcli.runtime.context import Context
from hgcli.runtime.env import RankEnv
from hgcli.runtime.wrapped import Wrapped

from .helpers import run_ok, script


def test_a_world_of_one_wraps_the_model_as_ddp_would():
    ctx = Context(RankEnv.from_environ({}))
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    model, opt = ctx.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(model, Wrapped) and model.module is net and model.module[2] is net[2]
    assert list(model.state_dict()) == [f"module.{k}" for k in net.state_dict()]   # DDP's names
    x = torch.randn(5, 4)
    with model.no_sync():
        out = model(x)
    torch.testing.assert_close(out, net(x))
    out.sum().backward()
    opt.step()
    assert (ctx.num_workers, ctx.worker_index) == (1, 0)
    ctx.finish()


def test_model_module_works_in_a_group_of_two_and_a_group_of_one_beside_a_ps(tmp_path):
    plan = emulated_plan([[1.0, 1.0], [1.0]], [[8, 8], [8]], n_ps=1, staleness_bound=2)
    run_ok(plan, script("module_train.py", "--out", tmp_path, "--steps", 4), tmp_path, timeout_s=120)
    seen = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)}
    assert [seen[r]["type"] for r in range(3)] == ["DistributedDataParallel", "DistributedDataParallel", "Wrapped"]
    for r in range(3):
        assert seen[r]["module_is_model"] and seen[r]["head_out"] == 10, seen[r]
        assert seen[r]["keys"] == ["module.0.bias"], seen[r]
        # WORLD_SIZE counts the PS rank; the workers are three, this one the r-th of them.
        assert (seen[r]["world_size"], seen[r]["num_workers"], seen[r]["worker_index"]) == (4, 3, r)
