"""A script that draws its own batches (docs/runtime.md, "Scripts that draw their own batches"): the
GPT-style port hgcli/examples/train_gpt.py as real jobs, under a hybrid plan of unequal emulated
devices and alone, each worker drawing its plan share; ``ctx.batch_size`` against the process's
other data sources, in process."""
from __future__ import annotations

import sys

import pytest
import torch

from hgcli.local.plans import emulated_plan
from hgcli.runtime.context import Context
from hgcli.runtime.env import RankEnv
from hgcli.runtime.errors import TrainingError

from .helpers import run_ok

STEPS = 6
GPT = [sys.executable, "-m", "hgcli.examples.train_gpt", "--steps", str(STEPS), "--log-every", "100"]
STATIC = {"HGTRAIN_ADAPT": "0"}         # the plan's shares throughout: what the assertions compare


def step_records(metrics: list[dict], rank: int) -> list[dict]:
    return [r for r in metrics if r.get("rank") == rank and "step" in r and "loss" in r]


@pytest.mark.slow
def test_the_gpt_port_draws_each_workers_share_under_a_hybrid_plan_of_unequal_devices(tmp_path):
    batches = [12, 8, 4]
    plan = emulated_plan([[1.0, 1.0], [0.25]], [batches[:2], batches[2:]], n_ps=1, staleness_bound=1)
    result = run_ok(plan, GPT, tmp_path, extra_env=STATIC, timeout_s=180)
    first_losses = []
    for rank, batch in enumerate(batches):
        steps = step_records(result.metrics, rank)
        assert [(s["step"], s["samples"]) for s in steps] == [(k, batch) for k in range(STEPS)]
        first_losses.append(steps[0]["loss"])
    # Same parameters at step 0, so different losses mean different draws on every worker.
    assert len(set(first_losses)) == 3, first_losses
    finishes = {r["rank"]: r for r in result.metrics if r.get("event") == "finish"}
    # The engine's own count (the forward's first dimension) is what each worker drew.
    assert {r: (f["steps"], f["samples"]) for r, f in finishes.items()} == \
        {r: (STEPS, STEPS * b) for r, b in enumerate(batches)}
    pushes = {r["group"] for r in result.metrics if r.get("event") == "ps_push"}
    assert pushes == {0, 1}                  # both groups trained through the parameter server


@pytest.mark.slow
def test_the_gpt_port_alone_on_an_emulated_device(tmp_path):
    plan = emulated_plan([[0.5]], [[6]])
    result = run_ok(plan, GPT, tmp_path, extra_env=STATIC, timeout_s=120)
    assert [(s["step"], s["samples"]) for s in step_records(result.metrics, 0)] == [(k, 6) for k in range(STEPS)]
    assert [f["samples"] for f in result.metrics if f.get("event") == "finish"] == [STEPS * 6]


def test_batch_size_alone_is_the_scripts_default_and_moves_with_the_steps():
    ctx = Context(RankEnv.from_environ({}))
    net = torch.nn.Linear(3, 1)
    model, opt = ctx.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(2):
        n = ctx.batch_size(5)
        model(torch.randn(n, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert n == 5 and ctx._drawn.data_step == 2           # the data position counts the steps
    ctx.finish()


def test_batch_size_is_refused_where_a_data_source_already_hands_out_the_batches():
    ctx = Context(RankEnv.from_environ({}))
    ctx.shard((torch.zeros(20, 2),), batch_size=4)
    with pytest.raises(TrainingError, match="len\\(x\\)"):
        ctx.batch_size(4)
    assert ctx.generator(1).initial_seed() == Context(RankEnv.from_environ({})).generator(1).initial_seed()
