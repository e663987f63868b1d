"""`hgtrain launch --restarts 1` with a script that reads its data through ctx.loader: a worker is
killed once, the PS resumes from its checkpoint, and each group continues from the data position that
checkpoint recorded for it instead of the epoch start (the runtime-level test, tests/runtime/
test_loader.py, checks the position against the PS trace; this one, that a restart gets there)."""
from __future__ import annotations

import json
import os
import signal

import pytest

from tests.faults.test_restarts import PY, _wait_for_checkpoints, attempt_pids, two_nodes
from tests.runtime.helpers import SCRIPTS

pytestmark = pytest.mark.slow


def test_groups_continue_from_the_checkpointed_data_position_after_a_restart(hg, tmp_path):
    ctoml, plan = two_nodes(tmp_path, ps=True)          # two groups of one (batch 32), the PS on b
    out = tmp_path / "out"
    out.mkdir()
    # Steps per epoch: the restart resumes from a checkpoint a few steps in (the worker is killed at
    # the first one, and the other group cannot run more than the staleness bound ahead of it), so
    # 150 leave ample room before the epoch ends; 300 only made the resumed attempt twice as long.
    per_epoch = 150
    run = hg.start("-c", ctoml, "--plan", plan, "--json", "--grace", "3", "--restarts", "1",
                   "--checkpoint-every", "5", "--", PY, str(SCRIPTS / "loader_train.py"), "--out", str(out),
                   "--n", str(64 * per_epoch), "--epochs", "1", "--workers", "1")
    pids = run.wait_all_started(3)
    _wait_for_checkpoints(run, [(hg.node_dir(run.job_id, "b") / "ps-checkpoint", 0)])
    os.kill(pids[0], signal.SIGKILL)
    assert run.finish(timeout=300) == 0, run.stderr
    assert sum(e["event"] == "job_restarted" for e in run.events()) == 1
    for rank in (0, 1):
        start = json.loads((out / f"start{rank}.json").read_text())           # the restarted attempt's
        trained = [json.loads(line) for line in (out / f"steps{rank}.jsonl").read_text().splitlines()]
        assert start["epoch"] == 0 and 0 < start["step"] < per_epoch, start
        assert [s["step"] for s in trained] == list(range(start["step"], per_epoch))
        log = (hg.job_dir(run.job_id) / f"rank{rank}.log").read_text()
        assert f"data continues from epoch 0 step {start['step']} (PS checkpoint)" in log, log[-2000:]
    assert attempt_pids(run.job_id) == []
