"""An fsdp group's training-state snapshots with torch's distributed checkpoint (runtime/sharded_snapshots.py):
every rank writes its shards, and a restart on another number of ranks resumes re-sharded. The first
run is also the fsdp case of test_fsdp_accumulate.py: one rank steps its batch as two micro-batches."""
import pytest
import torch

from hgcli.runtime import snapshot
from hgcli.schema import stages as m

from .helpers import load, run_ok, script
from .test_fsdp import _fsdp_plan
from .test_fsdp_accumulate import check_union_batch, micro_plan

BATCHES, MICRO = [4, 7, 4], [1, 2, 1]      # rank 1's 7 samples as 4 + 3; 4 updates of 15 samples


def _env(directory, every, seconds, resume=None):
    return {"HGTRAIN_SNAPSHOT_DIR": str(directory), "HGTRAIN_SNAPSHOT_EVERY": str(every),
            "HGTRAIN_SNAPSHOT_SECONDS": repr(seconds), "HGTRAIN_RESUME_STEP": "" if resume is None else str(resume)}


@pytest.mark.slow
def test_three_ranks_one_with_micro_batches_train_as_the_union_batch_and_resume_on_two(tmp_path):
    snaps, first, second = tmp_path / "snaps", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    run_ok(micro_plan(m.Engine.FSDP, BATCHES, MICRO), script("fsdp_micro.py", "--out", first), tmp_path / "run1",
           extra_env=_env(snaps, every=2, seconds=3600.0), timeout_s=120)
    check_union_batch(first, BATCHES, MICRO)
    # Every 2 updates (with a clock, each update the first rank's decision reaches the others), each
    # a directory of DCP's files and hgtrain's own.
    assert snapshot.steps_in(snaps) == [2, 4]
    saved = torch.load(snapshot.dcp_path(snaps, 4) / "hgtrain.pt", weights_only=True)
    assert saved["samples"] == 4 * 15 and saved["world_size"] == 3
    assert saved["data"] == {"epoch": 1, "step": 0, "steps_per_epoch": 4}
    result = run_ok(_fsdp_plan([6, 6]), script("fsdp_micro.py", "--out", second, "--steps", "0"),
                    tmp_path / "run2", extra_env=_env(snaps, every=2, seconds=0.0, resume=4), timeout_s=120)
    want, momentum = load(first / "rank0.pt"), load(first / "momentum0.pt")
    for r in range(2):
        assert torch.equal(load(second / f"start{r}.pt"), want), f"rank {r}'s parameters"
        assert torch.equal(load(second / f"momentum{r}.pt"), momentum), f"rank {r}'s optimizer state"
        assert "resumed from the snapshot of step 4" in result.ranks[r].output()
    records = [x for x in result.metrics if x.get("event") == "resumed"]
    assert [(x["rank"], x["step"], x["samples"]) for x in records] == [(0, 4, 4 * 15)]
