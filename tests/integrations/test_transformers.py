"""``HgtrainTrainer`` in real Trainer jobs: a tiny GPT-2 built from a config (no download), two gloo
ranks under ``hgtrain launch`` and torchrun (tests/integrations/scripts/hf_fit.py)."""
from __future__ import annotations

import pytest

from .conftest import require
from .jobs import assert_disjoint_shares, assert_same_as_torchrun, assert_step_metrics, launch, mixed_plan, refusal

pytestmark = pytest.mark.slow
N = 256          # the script's dataset
BATCH = 8        # its per_device_train_batch_size


@pytest.fixture(autouse=True)
def transformers():
    require("transformers")


def test_a_homogeneous_plan_trains_as_the_trainer_under_torchrun_to_the_bit(hg, tmp_path):
    assert_same_as_torchrun(hg, tmp_path, "hf_fit.py", "trainer", steps=2 * (N // (2 * BATCH)))


def test_an_emulated_mix_trains_each_rank_at_its_share(hg, tmp_path):
    # Plan batches 36/12 (speeds 1 and 0.25): the script's global batch of 16 splits 12/4.
    job = launch(hg, tmp_path, mixed_plan([36, 12], [1.0, 0.25]), "hf_fit.py", "hgtrain")
    assert_disjoint_shares(job.ranks, [12, 4], N)
    assert [r["optimizer_steps"] for r in job.ranks] == [2 * (N // 16)] * 2
    losses = job.ranks[0]["losses"]
    assert len(losses) == 2 * (N // 16) and losses[-1] < losses[0]      # it learns
    assert_step_metrics(job, [12, 4], 2 * (N // 16))
    sleep = [next(m for m in job.metrics(r) if m.get("event") == "finish")["emulated_sleep_s"] for r in (0, 1)]
    assert sleep[0] == 0 and sleep[1] > 0


def test_a_hybrid_plan_is_refused_in_one_line_naming_strategy_allreduce(tmp_path):
    proc = refusal(mixed_plan([8, 8], [1.0, 0.25], ps=True), tmp_path,
                   "from hgcli.integrations.transformers import HgtrainTrainer; HgtrainTrainer()")
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--strategy allreduce" in proc.stderr
