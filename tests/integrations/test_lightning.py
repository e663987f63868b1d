"""``HgtrainStrategy`` in real Lightning jobs: two gloo ranks under ``hgtrain launch`` and torchrun
(tests/integrations/scripts/lightning_fit.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
