"""All-reduce snapshots at the runtime level (hgcli.local, real gloo ranks): the first worker of each
node writes them on the step clock, and a resumed job starts from exactly the snapshot's parameters,
also on a node whose directory lacks the file (it receives it from a rank that has it)."""
from __future__ import annotations

import pytest
import torch

from hgcli.local.plans import emulated_plan
from hgcli.runtime import snapshot
from tests.runtime.helpers import load, run_ok, script

pytestmark = pytest.mark.slow


def snapshot_env(directory, every: int = 0, resume: int | None = None) -> dict[str, str]:
    return {"HGTRAIN_SNAPSHOT_DIR": str(directory), "HGTRAIN_SNAPSHOT_EVERY": str(every),
            "HGTRAIN_SNAPSHOT_SECONDS": "0", "HGTRAIN_RESUME_STEP": "" if resume is None else str(resume)}


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in state.values()])


def test_a_resumed_group_starts_from_the_snapshot_also_where_its_node_lacks_the_file(tmp_path):
    plan = emulated_plan([[1.0, 1.0]], [[8, 8]], nodes=[["a", "b"]])     # one group over two nodes
    dirs = {"a": tmp_path / "snap-a", "b": tmp_path / "snap-b"}
    out = tmp_path / "out"
    out.mkdir()
    run_ok(plan, script("tiny_train.py", "--out", out, "--steps", "10", "--momentum", "0.9"), tmp_path / "first",
           node_env={n: snapshot_env(d, every=4) for n, d in dirs.items()})
    # The first worker of each node wrote its own, on the step clock: steps 4 and 8 (a resumed job's
    # last steps are redone). A snapshot due while the last one is still being written is skipped,
    # which a loaded machine makes happen at 8: resume from the newest one node a has.
    written = {n: snapshot.steps_in(d) for n, d in dirs.items()}
    assert all(steps and set(steps) <= {4, 8} for steps in written.values()), written
    step = written["a"][-1]
    saved = snapshot.load(dirs["a"], step)
    assert saved["samples"] == step * 16 and saved["data"] == {"epoch": 0, "step": step, "steps_per_epoch": 256}
    if step in written["b"]:
        assert torch.equal(flat(saved["model"]), flat(snapshot.load(dirs["b"], step)["model"]))
    assert saved["optimizer"]["state"], "the momentum buffers are in it"
    for old in snapshot.steps_in(dirs["b"]):
        snapshot.snapshot_path(dirs["b"], old).unlink()              # node b "joined at this restart"
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    result = run_ok(plan, script("tiny_train.py", "--out", resumed, "--steps", "0"), tmp_path / "second",
                    node_env={n: snapshot_env(d, every=4, resume=step) for n, d in dirs.items()})
    for rank in (0, 1):
        assert torch.equal(load(resumed / f"start{rank}.pt")["params"], flat(saved["model"])), rank
        assert f"resumed from the snapshot of step {step}" in result.ranks[rank].output()
    records = [m for m in result.metrics if m.get("event") == "resumed"]
    assert [(m["rank"], m["step"], m["samples"]) for m in records] == [(0, step, step * 16)]


def test_a_resume_with_no_rank_holding_the_snapshot_fails_naming_the_step(tmp_path):
    plan = emulated_plan([[1.0, 1.0]], [[8, 8]], nodes=[["a", "b"]])
    out = tmp_path / "out"
    out.mkdir()
    from hgcli.local.run import run_plan

    result = run_plan(plan, script("tiny_train.py", "--out", out, "--steps", "2"), workdir=tmp_path / "w",
                      timeout_s=120, node_env={n: snapshot_env(tmp_path / n, resume=6) for n in "ab"})
    assert not result.ok
    assert all("has the snapshot of step 6" in r.output() for r in result.ranks), [r.output()[-500:] for r in result.ranks]
