"""``hgcli.integrations.accelerate.Hgtrain`` in a plain accelerate loop: two gloo ranks under
``hgtrain launch`` on an emulated mix (tests/integrations/scripts/accelerate_fit.py)."""
from __future__ import annotations

import pytest
import torch

from .conftest import require
from .jobs import assert_disjoint_shares, launch, mixed_plan

pytestmark = pytest.mark.slow
N, FEATURES = 384, 8


def test_an_emulated_mix_trains_each_rank_at_its_share_with_the_union_batchs_gradient(hg, tmp_path):
    require("accelerate")
    job = launch(hg, tmp_path, mixed_plan([48, 16], [1.0, 0.25]), "accelerate_fit.py")
    assert_disjoint_shares(job.ranks, [24, 8], N)
    # one process's SGD over each step's union batch, from the script's start
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, FEATURES, generator=gen)
    y = x @ torch.randn(FEATURES, 1, generator=gen)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for a, b in zip(job.ranks[0]["seen"], job.ranks[1]["seen"]):
        index = torch.tensor(a + b)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[index]), y[index]).backward()
        opt.step()
    for got, want in zip(job.ranks[0]["params"], model.parameters()):
        assert torch.allclose(torch.tensor(got), want.detach().flatten(), atol=1e-5)
    steps = [m for m in job.metrics(1) if "step" in m and "event" not in m]
    assert {m["samples"] for m in steps} == {8} and all("loss" in m for m in steps)
    assert job.events[-1]["summary"]["samples"] == 2 * N
