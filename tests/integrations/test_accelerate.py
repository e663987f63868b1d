"""``hgcli.integrations.accelerate.Hgtrain`` in a plain accelerate loop: two gloo ranks under
``hgtrain launch`` on an emulated mix (tests/integrations/scripts/accelerate_fit.py)."""
from __future__ import annotations

import pytest

from .conftest import require
from .jobs import assert_disjoint_shares, assert_step_metrics, assert_union_sgd, launch, mixed_plan

pytestmark = pytest.mark.slow
N = 384


def test_an_emulated_mix_trains_each_rank_at_its_share_with_the_union_batchs_gradient(hg, tmp_path):
    require("accelerate")
    job = launch(hg, tmp_path, mixed_plan([48, 16], [1.0, 0.25]), "accelerate_fit.py")
    assert_disjoint_shares(job.ranks, [24, 8], N)
    assert_union_sgd(job.ranks)
    assert_step_metrics(job, [24, 8], 2 * (N // 32))
