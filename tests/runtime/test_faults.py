"""Real failures: a PS killed with SIGKILL (also in the middle of writing a checkpoint), then resumed;
a worker killed mid-training, with nobody stopping the others: the job must fail by itself, clearly."""
import json
import os
import signal
import threading
import time

import pytest
import torch

from hgcli.examples.data import make_model
from hgcli.runtime.ps import files as checkpoint
from hgcli.runtime.env import ps_argv
from hgcli.local.plans import emulated_plan
from hgcli.local.run import run_plan

from .helpers import load, run_ok, script

pytestmark = pytest.mark.slow


def events(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_ps_killed_while_writing_a_checkpoint_resumes_from_the_last_complete_set(tmp_path):
    plan = emulated_plan([[1.0], [0.5]], [[8], [8]], n_ps=2, staleness_bound=2)
    ckpt = tmp_path / "ckpt"
    run1, run2 = tmp_path / "run1", tmp_path / "run2"
    run1.mkdir()
    run2.mkdir()
    traces = [run1 / f"trace{i}.jsonl" for i in range(2)]
    box = {}

    def job():
        box["result"] = run_plan(
            plan, script("tiny_train.py", "--out", run1, "--steps", 100000), workdir=run1,
            ps_argv=ps_argv(checkpoint_dir=str(ckpt), checkpoint_every=10, trace=str(run1 / "trace.jsonl")),
            extra_env={checkpoint.PAUSE_ENV: "1.5"}, timeout_s=180, rank_timeout_s=20)

    t = threading.Thread(target=job)
    t.start()
    deadline = time.monotonic() + 150
    victim = None
    while time.monotonic() < deadline and victim is None:
        complete = checkpoint.complete_versions(ckpt, 2)
        temps = list(ckpt.glob(".shard0-v*.tmp")) if ckpt.exists() else []
        if complete and temps:
            starts = [e for e in events(run1 / "trace.jsonl") if e["event"] == "start" and e["shard"] == 0]
            victim = starts[0]["pid"]
            os.kill(victim, signal.SIGKILL)            # shard 0 dies with a temp file half-done
        time.sleep(0.05)
    t.join(timeout=200)
    assert victim is not None, "no checkpoint write was ever caught in progress"
    result = box["result"]
    assert not result.ok and not result.timed_out      # the job failed (and was stopped)
    assert list(ckpt.glob(".shard0-v*.tmp")), "shard 0 was not killed while writing"
    last = checkpoint.complete_versions(ckpt, 2)[0]
    saved = [checkpoint.load(ckpt, s, last)["master"] for s in range(2)]   # SGD: shards of the model's order

    run_ok(plan, script("tiny_train.py", "--out", run2, "--steps", 12), run2,
           ps_argv=ps_argv(checkpoint_dir=str(ckpt), checkpoint_every=10, resume=True,
                           trace=str(run2 / "trace.jsonl")))
    ev = events(run2 / "trace.jsonl")
    assert sorted(e["version"] for e in ev if e["event"] == "resume") == [last, last]
    first_push = next(e for e in ev if e["event"] == "push")
    assert first_push["base"] == last                 # training continued from that version
    assert not list(ckpt.glob(".shard*.tmp"))          # the killed write's leftover is gone
    # A group that started before any push after the resume holds exactly the checkpointed
    # parameters (another group may already have pushed when the other one pulls).
    starts = [load(run2 / f"start{r}.pt") for r in (0, 1)]
    fresh = [s["params"] for s in starts if s["version"] == last]
    assert fresh, [s["version"] for s in starts]
    for params in fresh:
        torch.testing.assert_close(params, torch.cat(saved), rtol=0, atol=0)


def test_a_killed_worker_fails_the_job_within_the_timeout(tmp_path):
    timeout = 10
    plan = emulated_plan([[1.0, 1.0], [1.0]], [[8, 8], [8]], n_ps=1, staleness_bound=1)
    result = run_plan(plan, script("tiny_train.py", "--out", tmp_path, "--steps", 100000,
                                   "--die-rank", 1, "--die-step", 20),
                      workdir=tmp_path, timeout_s=120, rank_timeout_s=timeout, kill_on_failure=False)
    assert not result.timed_out, "a rank hung instead of failing"
    assert result.ranks[1].exit_code == -signal.SIGKILL
    for r in (0, 2, 3):
        assert result.ranks[r].exit_code not in (0, None), result.ranks[r].output()[-2000:]
    assert "all-reduce in group 0" in result.ranks[0].output()
    assert "no message from group(s) [0]" in result.ranks[3].output()
    assert "TrainingError" in result.ranks[2].output()
