"""``HgtrainStrategy`` in real Lightning jobs: two gloo ranks under ``hgtrain launch`` and torchrun
(tests/integrations/scripts/lightning_fit.py)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from .conftest import require
from .jobs import SCRIPTS, assert_disjoint_shares, launch, mixed_plan, refusal, torchrun

pytestmark = pytest.mark.slow
N = 384          # the script's dataset
BATCH = 16       # its per-device batch


@pytest.fixture(autouse=True)
def lightning():
    require("pytorch_lightning")


def script_module():
    spec = importlib.util.spec_from_file_location("lightning_fit", SCRIPTS / "lightning_fit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_homogeneous_plan_trains_as_lightning_ddp_under_torchrun_to_the_bit(hg, tmp_path):
    reference = torchrun(tmp_path, 2, "lightning_fit.py", "ddp")
    # The plan's global batch (100) is not the script's (2 x 16): the script's stays, split evenly.
    job = launch(hg, tmp_path, mixed_plan([50, 50], [1.0, 1.0]), "lightning_fit.py", "hgtrain")
    assert job.ranks[0]["params"] == reference[0]["params"]
    for ours, theirs in zip(job.ranks, reference):
        assert ours["losses"] == theirs["losses"] and ours["seen"] == theirs["seen"]
        assert ours["optimizer_steps"] == theirs["optimizer_steps"] == 2 * (N // (2 * BATCH))


def test_an_emulated_mix_trains_each_rank_at_its_share_with_the_union_batchs_gradient(hg, tmp_path):
    # Plan batches 48/16 (speeds 1 and 0.25): the script's global batch of 32 splits 24/8.
    job = launch(hg, tmp_path, mixed_plan([48, 16], [1.0, 0.25]), "lightning_fit.py", "hgtrain")
    assert_disjoint_shares(job.ranks, [24, 8], N)
    # the script's global batch and its optimizer steps: 2 epochs of 384 // 32
    assert [r["optimizer_steps"] for r in job.ranks] == [2 * (N // 32)] * 2
    # the samples-weighted hook: the parameters are one process's SGD over each step's union batch
    fit = script_module()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, fit.FEATURES, generator=gen)
    y = x @ torch.randn(fit.FEATURES, 1, generator=gen) + 0.1 * torch.randn(N, 1, generator=gen)
    model = fit.Regression()
    opt = model.configure_optimizers()
    for a, b in zip(job.ranks[0]["seen"], job.ranks[1]["seen"]):
        index = torch.tensor(a + b)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model.net(x[index]), y[index]).backward()
        opt.step()
    for got, want in zip(job.ranks[0]["params"], model.parameters()):
        assert torch.allclose(torch.tensor(got), want.detach().flatten(), atol=1e-5)
    # hgtrain's metrics pipe: every step of each rank at its share, the slow device emulated
    for rank, share in ((0, 24), (1, 8)):
        steps = [m for m in job.metrics(rank) if "step" in m and "event" not in m]
        assert [m["step"] for m in steps] == list(range(1, 2 * (N // 32) + 1))
        assert {m["samples"] for m in steps} == {share} and all(m["loss"] > 0 for m in steps)
    finish = {rank: next(m for m in job.metrics(rank) if m.get("event") == "finish") for rank in (0, 1)}
    assert finish[0]["emulated_sleep_s"] == 0 and finish[1]["emulated_sleep_s"] > 0
    assert job.events[-1]["summary"]["samples"] == 2 * N


def test_a_hybrid_plan_is_refused_in_one_line_naming_strategy_allreduce(tmp_path):
    proc = refusal(mixed_plan([16, 16], [1.0, 0.25], ps=True), tmp_path,
                   "from hgcli.integrations.lightning import HgtrainStrategy; HgtrainStrategy()")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "--strategy allreduce" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_strategy_keeps_the_comm_hook_its_own():
    from hgcli.integrations.lightning import HgtrainStrategy

    with pytest.raises(TypeError, match="ddp_comm_hook"):
        HgtrainStrategy(ddp_comm_hook=lambda state, bucket: None)


def test_importing_hgcli_integrations_imports_no_framework():
    import subprocess
    import sys

    code = "import sys, hgcli.integrations; print(json.dumps(sorted(m for m in ('torch', 'pytorch_lightning', 'transformers', 'accelerate') if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
