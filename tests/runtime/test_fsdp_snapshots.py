"""An fsdp group's training-state snapshots with torch's distributed checkpoint (runtime/sharded_snapshots.py):
every rank writes its shards, and a restart on another number of ranks resumes re-sharded."""
import pytest
import torch

from hgcli.runtime import snapshot

from .helpers import load, run_ok, script
from .scripts.fsdp_micro import UPDATES
from .test_fsdp import _fsdp_plan


def _env(directory, every, resume=None):
    return {"HGTRAIN_SNAPSHOT_DIR": str(directory), "HGTRAIN_SNAPSHOT_EVERY": str(every),
            "HGTRAIN_SNAPSHOT_SECONDS": "0", "HGTRAIN_RESUME_STEP": "" if resume is None else str(resume)}


@pytest.mark.slow
def test_a_snapshot_of_three_ranks_resumes_on_two(tmp_path):
    snaps, first, second = tmp_path / "snaps", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    run_ok(_fsdp_plan([4, 4, 4]), script("fsdp_micro.py", "--out", first), tmp_path / "run1",
           extra_env=_env(snaps, every=2), timeout_s=120)
    # Updates 2 and 4, each a directory of DCP's files and hgtrain's own.
    assert snapshot.steps_in(snaps) == [2, UPDATES]
    saved = torch.load(snapshot.dcp_path(snaps, UPDATES) / "hgtrain.pt", weights_only=True)
    assert saved["samples"] == UPDATES * 12 and saved["world_size"] == 3
    assert saved["data"] == {"epoch": 1, "step": 0, "steps_per_epoch": UPDATES}
    result = run_ok(_fsdp_plan([6, 6]), script("fsdp_micro.py", "--out", second, "--steps", "0"),
                    tmp_path / "run2", extra_env=_env(snaps, every=2, resume=UPDATES), timeout_s=120)
    want, momentum = load(first / "rank0.pt"), load(first / "momentum0.pt")
    assert not torch.equal(want, load(first / "start0.pt")), "it did not train"
    for r in range(2):
        assert torch.equal(load(second / f"start{r}.pt"), want), f"rank {r}'s parameters"
        assert torch.equal(load(second / f"momentum{r}.pt"), momentum), f"rank {r}'s optimizer state"
        assert f"resumed from the snapshot of step {UPDATES}" in result.ranks[r].output()
    records = [x for x in result.metrics if x.get("event") == "resumed"]
    assert [(x["rank"], x["step"], x["samples"]) for x in records] == [(0, UPDATES, UPDATES * 12)]
