"""``HgtrainStrategy`` in real Lightning jobs: two gloo ranks under ``hgtrain launch`` and torchrun
(tests/integrations/scripts/lightning_fit.py), DDP and FSDP2 (``HgtrainFSDPStrategy``); the refusals
in-process, as rank 0 of a plan with nothing started."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from hgcli.runtime.errors import TrainingError
from tests.launch.plans import plan_file

from .conftest import require
from .jobs import (assert_disjoint_shares, assert_same_as_torchrun, assert_step_metrics, assert_union_sgd, launch,
                   mixed_plan, refusal, sharded)

pytestmark = pytest.mark.slow
N = 384          # the script's dataset
BATCH = 16       # its per-device batch


@pytest.fixture(autouse=True)
def lightning():
    require("pytorch_lightning")


def test_a_homogeneous_plan_trains_as_lightning_ddp_under_torchrun_to_the_bit(hg, tmp_path):
    assert_same_as_torchrun(hg, tmp_path, "lightning_fit.py", "ddp", steps=2 * (N // (2 * BATCH)))


def test_an_emulated_mix_trains_each_rank_at_its_share_with_the_union_batchs_gradient(hg, tmp_path):
    # Plan batches 48/16 (speeds 1 and 0.25): the script's global batch of 32 splits 24/8. The script
    # leaves devices to Lightning (one CPU): the strategy takes the ranks from the environment.
    job = launch(hg, tmp_path, mixed_plan([48, 16], [1.0, 0.25]), "lightning_fit.py", "hgtrain",
                 "--devices", "auto")
    assert_disjoint_shares(job.ranks, [24, 8], N)
    # the script's global batch and its optimizer steps: 2 epochs of 384 // 32
    assert [r["optimizer_steps"] for r in job.ranks] == [2 * (N // 32)] * 2
    assert_union_sgd(job.ranks)
    assert_step_metrics(job, [24, 8], 2 * (N // 32))
    sleep = [next(m for m in job.metrics(r) if m.get("event") == "finish")["emulated_sleep_s"] for r in (0, 1)]
    assert sleep[0] == 0 and sleep[1] > 0          # the slow device was emulated, the fast one ran as it is


def test_accumulated_batches_are_weighted_by_the_shares(hg, tmp_path):
    # accumulate_grad_batches=2: DDP all-reduces every second backward, the hook weights the sum
    job = launch(hg, tmp_path, mixed_plan([48, 16], [1.0, 0.25]), "lightning_fit.py", "hgtrain",
                 "--accumulate", "2", "--epochs", "1")
    assert_disjoint_shares(job.ranks, [24, 8], N)
    assert [r["optimizer_steps"] for r in job.ranks] == [N // 32 // 2] * 2
    assert_union_sgd(job.ranks, accumulate=2)


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
    code = ("import json, sys, hgcli.integrations; print(json.dumps(sorted(m for m in ('torch', 'pytorch_lightning', "
            "'transformers', 'accelerate') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_an_fsdp_plan_shards_with_each_ranks_share_and_the_union_batchs_gradient(hg, tmp_path):
    # The plan's group trains with fsdp: the script's HgtrainStrategy() is the FSDP2 variant. Plan
    # batches 48/16 split the script's 32 as 24/8; one optimizer step over two accumulated
    # micro-batches, each reduce-scattered with its own weights, equals one process on the union.
    job = launch(hg, tmp_path, sharded(mixed_plan([48, 16], [1.0, 1.0])), "lightning_fit.py", "hgtrain",
                 "--steps", "1", "--accumulate", "2")
    assert [r["strategy"] for r in job.ranks] == ["HgtrainFSDPStrategy"] * 2
    assert [[len(b) for b in r["seen"]] for r in job.ranks] == [[24, 24], [8, 8]]
    assert [r["optimizer_steps"] for r in job.ranks] == [1, 1]
    assert_union_sgd(job.ranks, accumulate=2, atol=1e-6)


@pytest.fixture
def one_rank(monkeypatch, tmp_path):
    """This process as rank 0 of a plan (what hgtrain launch gives a rank), nothing started."""
    def planned(plan):
        for name, value in {"RANK": "0", "WORLD_SIZE": str(plan.world_size), "LOCAL_RANK": "0",
                            "HGTRAIN_PLAN": str(plan_file(tmp_path, plan))}.items():
            monkeypatch.setenv(name, value)
    return planned


def refused(capfd, build) -> str:
    """``build()`` stops with exit code 2 and one line on stderr: that line."""
    with pytest.raises(SystemExit) as stop:
        build()
    assert stop.value.code == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_hgtrain_strategy_is_the_fsdp_variant_where_the_plan_says_fsdp_and_ddp_elsewhere(one_rank):
    from hgcli.integrations.lightning import HgtrainStrategy
    from hgcli.integrations.lightning_fsdp import HgtrainFSDPStrategy

    one_rank(sharded(mixed_plan([16], [1.0])))
    assert type(HgtrainStrategy(process_group_backend="gloo")) is HgtrainFSDPStrategy
    one_rank(mixed_plan([16], [1.0]))
    assert type(HgtrainStrategy()) is HgtrainStrategy


class Frozen(torch.nn.Module):
    def __init__(self, *, bare: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1).requires_grad_(bare)
        if bare:
            self.scale = torch.nn.Parameter(torch.ones(1))       # the module's own: no unit holds it


@pytest.mark.parametrize("case, expect", [
    ("ps plan", "--strategy allreduce"),
    ("micro-batches", "into 2 micro-batches"),
    ("ddp argument", "find_unused_parameters, which only DDP takes"),
    ("old lightning", "needs Lightning's ModelParallelStrategy"),
    ("nothing to shard", "Frozen has no trained parameters"),
    ("stray parameter", "Frozen.scale is in no FSDP unit"),
])
def test_what_fsdp_cannot_train_is_refused_in_one_line(case, expect, one_rank, capfd, monkeypatch):
    from hgcli.integrations.lightning import HgtrainStrategy

    plan = sharded(mixed_plan([16, 16], [1.0, 1.0], ps=case == "ps plan"))
    if case == "micro-batches":
        plan = dataclasses.replace(plan, ranks=tuple(dataclasses.replace(r, micro_batches=2) if r.rank == 1 else r
                                                     for r in plan.ranks))
    one_rank(plan)
    kwargs = {"find_unused_parameters": True} if case == "ddp argument" else {}
    if case == "old lightning":
        monkeypatch.setitem(sys.modules, "hgcli.integrations.lightning_fsdp", None)   # its import fails
    if case in ("nothing to shard", "stray parameter"):
        strategy = HgtrainStrategy()
        line = refused(capfd, lambda: strategy._shard(Frozen(bare=case == "stray parameter")))
    else:
        line = refused(capfd, lambda: HgtrainStrategy(**kwargs))
    assert line.startswith("hgtrain: ") and expect in line, line


def test_a_lightning_modules_roots_are_its_children_with_parameters_outside_the_units():
    from hgcli.integrations.lightning_fsdp import sharding_roots

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])  # units
            self.head = torch.nn.Linear(4, 1)
            self.act = torch.nn.Tanh()                                                          # nothing to shard

    model = Blocks()
    assert sharding_roots(model, None) == [model.head]
    assert sharding_roots(model, "blocks.*") == [model.head]
    assert sharding_roots(model, "*") == []             # every child a unit already: its own root
    with pytest.raises(TrainingError, match=r"Blocks\.blocks\.0\.weight is in no FSDP unit"):
        sharding_roots(model, "head")                   # the ModuleList has no forward to be a root
