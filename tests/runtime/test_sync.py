"""Synchronous plans (one group, no PS) against torch's own DDP and a single process."""
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from hgcli.examples.data import make_dataset, make_model
from hgcli.runtime.data.blocks import shard_batches
from hgcli.local.plans import emulated_plan

from .helpers import load, run_ok, script

pytestmark = pytest.mark.slow


def test_homogeneous_plan_matches_ddp(tmp_path):
    plan = emulated_plan([[1.0, 1.0]], [[8, 8]])
    args = ("--steps", 6, "--batch", 8, "--lr", 0.1, "--momentum", 0.9)
    (tmp_path / "hg").mkdir()
    (tmp_path / "ddp").mkdir()
    ours_run = run_ok(plan, script("tiny_train.py", "--out", tmp_path / "hg", *args), tmp_path / "hg")
    run_ok(plan, script("ddp_reference.py", "--out", tmp_path / "ddp", *args), tmp_path / "ddp")
    # Each rank accounts for where its steps went: the all-reduces are its synchronisation time.
    finishes = {m["rank"]: m for m in ours_run.metrics if m.get("event") == "finish"}
    assert sorted(finishes) == [0, 1]
    assert all(m["steps"] == 6 and m["sync_s"] > 0 for m in finishes.values())   # waits after the last bucket
    start = load(tmp_path / "hg" / "start0.pt")["params"]
    for rank in (0, 1):
        ours, ddp = load(tmp_path / "hg" / f"rank{rank}.pt"), load(tmp_path / "ddp" / f"rank{rank}.pt")
        assert not torch.allclose(ours, start)          # it trained
        torch.testing.assert_close(ours, ddp, rtol=1e-5, atol=1e-6)


def test_unequal_batches_give_the_gradient_of_the_union_batch(tmp_path):
    plan = emulated_plan([[1.0, 0.5]], [[3, 5]])
    run_ok(plan, script("tiny_train.py", "--out", tmp_path, "--steps", 1, "--lr", 0.5), tmp_path)
    (x, y), _ = make_dataset(n_train=4096, n_test=16)
    model = make_model(hidden=16)
    (xb, yb), = [b for b, _ in zip(shard_batches((x, y), [8], 0, epochs=1, seed=0), range(1))]
    F.cross_entropy(model(xb), yb).backward()
    with torch.no_grad():
        expected = torch.cat([(p - 0.5 * p.grad).reshape(-1) for p in model.parameters()])
    for rank in (0, 1):
        torch.testing.assert_close(load(tmp_path / f"rank{rank}.pt"), expected, rtol=1e-5, atol=1e-6)
    # DDP's plain mean of the two ranks' means would differ: the weighting is what is tested.
    model = make_model(hidden=16)
    grads = []
    for lo, hi in ((0, 3), (3, 8)):
        model.zero_grad()
        F.cross_entropy(model(xb[lo:hi]), yb[lo:hi]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert not torch.allclose(start - 0.5 * (grads[0] + grads[1]) / 2, expected, atol=1e-6)


def test_torchrun_style_script_runs_unchanged(tmp_path):
    plan = emulated_plan([[1.0, 1.0]], [[32, 32]])
    result = run_ok(plan, [sys.executable, "-m", "hgcli.examples.torchrun_style"], tmp_path)
    lines = [re.search(r"accuracy (\S+) checksum (\S+)", r.output()) for r in result.ranks]
    assert all(lines)
    assert lines[0].group(2) == lines[1].group(2)      # DDP kept the ranks identical
    assert float(lines[0].group(1)) > 0.85             # and it learned


def test_ranks_of_a_group_on_one_node_pool_their_emulated_speed(tmp_path):
    """Emulated ranks of one group on one node stretch one pooled estimate of the step's CPU time
    (identical devices run at one speed), so a process that happens to be slower does not make the
    whole group wait for it; a member on another node keeps its own. Rank 1 does 6 ms more CPU per
    step than ranks 0 and 2; at speed 0.1 the pooled estimate (median of ranks 0 and 1: +3 ms)
    stretches rank 0's step ~30 ms more than rank 2's, which runs the same work on node b. What is
    compared is the step each rank's emulator stretched to (``emulated_step_s``): its sleep also
    depends on how long it waited for the others inside backward's all-reduces."""
    plan = emulated_plan([[0.1, 0.1, 0.1]], [[8, 8, 8]], nodes=[["a", "a", "b"]])
    # 20 steps: the first two stretch each rank's own estimate (the pool takes the estimates of the
    # steps before, and there are none at the first), which the totals below average over.
    result = run_ok(plan, script("tiny_train.py", "--out", tmp_path, "--steps", 20,
                                 "--spin-rank", 1, "--spin-ms", 6), tmp_path)
    target = {m["rank"]: 1e3 * m["emulated_step_s"] / m["steps"]
              for m in result.metrics if m.get("event") == "finish"}
    assert target[0] > target[2] + 12, target      # ~+27 ms: pooled with rank 1 from the first sync on
    # rank 1 stretched the same pooled estimate, not its own (that would be ~30 ms more than rank 0's)
    assert target[1] < target[0] + 10, target
