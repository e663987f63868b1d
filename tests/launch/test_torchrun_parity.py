"""What a torchrun script finds under `hgtrain launch`: torchrun's environment, unbuffered Python
ranks, its ``@record`` error file in the root cause, stderr on stderr, ``--env NAME`` forwarding.

The pure pieces first, then the rank process as the agent starts it, then real launches (local
nodes, real agents). accelerate's own distributed test scripts run in the last test when accelerate
is installed (an optional dev dependency: ``pip install accelerate``)."""
from __future__ import annotations

import io
import json
import os
import sys
import threading
from pathlib import Path

import pytest

from hgcli.config.cluster import default_cluster
from hgcli.launch.events import JobEnded, LogLines, RootCause
from hgcli.schema.states import JobState
from hgcli.launch.launcher import forwarding_note, user_env
from hgcli.launch.inbound import RecordedError
from hgcli.launch.frame_handlers import recorded_error
from hgcli.launch.request import LaunchRequest
from hgcli.node.agent.ranks import Rank, error_file
from hgcli.node.agent.spec import AgentSpec, RankSpec
from hgcli.render.launch import PlainSink, root_cause_lines
from hgcli.runtime.env import rank_env, torchrun_defaults
from hgcli.schema.stages import Cluster, NodeSpec, Role

from tests.agent.harness import wait_until

from .hg import REPO, cluster_toml
from .plans import local_cluster, make_plan, plan_file

PY = sys.executable
ELASTIC = ("GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
           "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE",
           "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
           "PYTHONUNBUFFERED", "RANK", "LOCAL_WORLD_SIZE")


# ---- the pure pieces ------------------------------------------------------------------------------

def test_rank_env_has_torchruns_variables_with_torchruns_meaning():
    cluster = local_cluster(("a", "b"))
    plan = make_plan(cluster, [["b", "a"], ["a"]], ps=["b", "a"])   # rank 0 on b: b is group 0
    env = {r: rank_env(plan, r, master_addr="m", master_port=1, plan_path="/p", job_id="j-r2", run_id="j",
                       restart_count=2, max_restarts=3) for r in range(plan.world_size)}
    assert [env[r]["GROUP_RANK"] for r in range(5)] == ["0", "1", "1", "0", "1"]
    assert {e["GROUP_WORLD_SIZE"] for e in env.values()} == {"2"}
    assert [(env[r]["ROLE_NAME"], env[r]["ROLE_RANK"], env[r]["ROLE_WORLD_SIZE"]) for r in range(5)] == [
        ("worker", "0", "3"), ("worker", "1", "3"), ("worker", "2", "3"), ("ps", "0", "2"), ("ps", "1", "2")]
    assert {(e["TORCHELASTIC_RUN_ID"], e["TORCHELASTIC_RESTART_COUNT"], e["TORCHELASTIC_MAX_RESTARTS"],
             e["TORCHELASTIC_USE_AGENT_STORE"], e["HGTRAIN_JOB_ID"]) for e in env.values()} == {
        ("j", "2", "3", "False", "j-r2")}
    # torchrun sets OMP_NUM_THREADS=1 only where a node runs several workers
    assert torchrun_defaults(1) == {"PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert torchrun_defaults(2)["OMP_NUM_THREADS"] == "1"


def test_bare_env_name_forwards_this_machines_value_and_the_note_names_what_ssh_nodes_miss():
    environ = {"WANDB_PROJECT": "p", "ACCELERATE_USE_CPU": "1", "HF_HOME": "/hf", "MY_TOKEN": "secret",
               "HOME": "/h", "TERM": "xterm", "NCCL_DEBUG": "INFO", "HGTRAIN_STATE_DIR": "/s"}
    remote = Cluster(nodes=(NodeSpec(name="local", host="localhost", python=PY),
                            NodeSpec(name="gpu1", host="10.0.0.9")))
    request = LaunchRequest(cluster=remote, command=("x",), env=("MY_TOKEN", "HF_HOME", "NOT_SET_HERE", "A=1"))
    env = user_env(request, environ)
    assert env == {"NCCL_DEBUG": "INFO", "MY_TOKEN": "secret", "HF_HOME": "/hf", "A": "1"}
    plan = make_plan(remote, [["local", "gpu1"]])
    note = forwarding_note(request, plan, environ, env)
    assert note == ("environment of the ranks on gpu1: set here but not forwarded: ACCELERATE_USE_CPU, "
                    "WANDB_PROJECT (forward one with --env NAME); --env NOT_SET_HERE: not set here, so not set "
                    "there either")
    assert "secret" not in note and "/hf" not in note            # names only, never values
    # a plan on this machine alone: its ranks inherit hgtrain's environment, nothing to say
    assert forwarding_note(request, make_plan(remote, [["local"]]), environ, env) is None


def test_rank_stderr_goes_to_stderr_with_its_tag_and_stdout_to_stdout():
    out, err = io.StringIO(), io.StringIO()
    sink = PlainSink(None, out, err)
    sink(LogLines("j", 0, "n1", Role.WORKER, "out", b"an out line\n"))
    sink(LogLines("j", 1, "n1", Role.PS, "err", b"Traceback\nValueError: x\n"))
    assert out.getvalue() == "n1:0 | an out line\n"
    assert err.getvalue() == "n1:1 ps | Traceback\nn1:1 ps | ValueError: x\n"


def test_recorded_error_is_one_line_shown_visibly_and_its_stack_shows_when_stderr_lacks_it():
    message, stack = recorded_error(RecordedError.decode({"message": "ValueError: bad\x1b[31m\nbatch", "traceback":
                                    "Traceback (most recent call last):\n  File \"t.py\"\nValueError: bad\x07\n"}))
    assert message == "ValueError: bad\x1b[31m batch"     # one line, as the rank wrote it
    assert stack == ("Traceback (most recent call last):", '  File "t.py"', "ValueError: bad\x07")
    assert recorded_error(None) == (None, ()) and RecordedError.decode({"message": 3}) is None
    cause = RootCause(node="n", rank=1, exit_code=1, signal=None, reason="exited with code 1", oom=None,
                      last_lines=("step 3",), error=message, traceback=stack)
    lines = root_cause_lines(cause)
    assert lines[0] == "root cause: n:1 exited with code 1: ValueError: bad\x1b[31m batch"
    assert lines[-1] == "    ValueError: bad\x07" and "@record" in lines[-4]
    # A terminal sees no control character of it: the one sanitiser (render/safe.py) shows them.
    err = io.StringIO()
    err.isatty = lambda: True   # type: ignore[method-assign]
    PlainSink(None, io.StringIO(), err)(JobEnded(job_id="j", state=JobState.FAILED, exit_code=1, root_cause=cause,
                                                 summary=None, job_dir="/j"))
    assert "bad^[[31m batch" in err.getvalue() and "bad^G" in err.getvalue() and "\x1b" not in err.getvalue()
    shown = RootCause(**{**cause.__dict__, "last_lines": ("ValueError: bad\x1b[31m batch",)})
    assert not any("@record" in line for line in root_cause_lines(shown))   # stderr already shows it


# ---- the rank process as the agent starts it ------------------------------------------------------

ENV_REPORT = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {ELASTIC!r}}}))"


def run_rank(tmp_path: Path, code: str, env: dict[str, str], defaults: dict[str, str]) -> Rank:
    spec = AgentSpec(job_id="t-parity", node="n1", ranks=(RankSpec(rank=0, argv=(PY, "-c", code)),), env=env,
                     env_defaults=defaults, jobs_root=str(tmp_path))
    spec.job_dir.mkdir(parents=True, exist_ok=True)
    rank = Rank(spec.ranks[0])
    exited = threading.Event()
    rank.start(spec, spec.job_dir, lambda *_: exited.set())
    assert exited.wait(60)
    rank.reap(10)
    wait_until(lambda: all(c.done.is_set() for c in rank.captures.values()), what="the rank's pipes")
    rank.record_exit(rank.popen.returncode, None, stopping=False, signalled=False)
    return rank


def test_torchrun_defaults_yield_to_the_nodes_environment_and_the_user(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONUNBUFFERED", "")      # set (empty) on the node: the rank keeps it
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    rank = run_rank(tmp_path, ENV_REPORT, {"OMP_NUM_THREADS": "3"}, torchrun_defaults(2))
    seen = json.loads((tmp_path / "t-parity" / "n1" / "rank-0.out").read_text())
    assert seen["PYTHONUNBUFFERED"] == "" and seen["OMP_NUM_THREADS"] == "3"
    assert seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert seen["TORCHELASTIC_ERROR_FILE"] == str(error_file(tmp_path / "t-parity" / "n1", 0))
    assert rank.frame()["error"] is None


RECORDED = """
import json, os
json.dump({"message": {"message": "RuntimeError: from the error file", "extraInfo": {
    "py_callstack": "Traceback (most recent call last):\\nRuntimeError: from the error file\\n",
    "timestamp": "1"}}}, open(os.environ["TORCHELASTIC_ERROR_FILE"], "w"))
raise SystemExit(3)
"""


def test_a_failed_ranks_error_file_is_in_its_exit_frame_and_a_stale_one_is_not(tmp_path):
    rank = run_rank(tmp_path, RECORDED, {}, {})
    assert rank.frame()["error"] == {"message": "RuntimeError: from the error file",
                                     "traceback": "Traceback (most recent call last):\nRuntimeError: from the error file\n"}
    stale = tmp_path / "again"
    (stale / "t-parity" / "n1").mkdir(parents=True)
    error_file(stale / "t-parity" / "n1", 0).write_text('{"message": "old"}')
    assert run_rank(stale, "raise SystemExit(2)", {}, {}).frame()["error"] is None


# ---- real launches ---------------------------------------------------------------------------------

ELASTIC_SCRIPT = f"""
import json, os
report = {{k: os.environ.get(k) for k in {ELASTIC!r}}}
if os.environ["RANK"] == "2":    # only this rank pays torch's import
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record
    report["is_torchelastic_launched"] = dist.is_torchelastic_launched()
    print(json.dumps(report))

    @record
    def main():
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            raise ValueError("bad batch on purpose")
    main()
else:
    print(json.dumps(report))
"""


def test_ranks_get_torchruns_environment_and_a_record_exception_is_the_root_cause(hg, tmp_path):
    cluster = local_cluster(("a", "b"))
    plan = make_plan(cluster, [["a", "a"], ["b"]], ps=())
    ctoml, pfile = cluster_toml(tmp_path / "cluster.toml", cluster), plan_file(tmp_path, plan)
    env = {k: v for k, v in hg.env().items() if k not in ("PYTHONUNBUFFERED", "OMP_NUM_THREADS")}
    code, out, err = hg.run("-c", str(ctoml), "--plan", str(pfile), "--restarts", "1", "--json", "--",
                            PY, "-c", ELASTIC_SCRIPT, env=env)
    assert code == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    job_id = events[0]["job_id"]
    restarted, = [e for e in events if e["event"] == "job_restarted"]
    assert restarted["reason"] == "b:2 exited with code 1: ValueError: bad batch on purpose"
    assert hg.record(job_id)["restarts"] == [restarted["reason"]]
    reports = [(json.loads(e["line"]), e["node"]) for e in events
               if e["event"] == "log" and e["line"].startswith("{")]
    assert len(reports) == 6                                   # 3 ranks x 2 attempts
    for seen, node in reports:
        rank = int(seen["RANK"])
        assert seen["GROUP_RANK"] == ("0" if node == "a" else "1") and seen["GROUP_WORLD_SIZE"] == "2"
        assert (seen["ROLE_NAME"], seen["ROLE_RANK"], seen["ROLE_WORLD_SIZE"]) == ("worker", str(rank), "3")
        assert seen["TORCHELASTIC_RUN_ID"] == job_id and seen["TORCHELASTIC_MAX_RESTARTS"] == "1"
        attempt = int(seen["TORCHELASTIC_RESTART_COUNT"])
        agent_job = job_id if attempt == 0 else f"{job_id}-r{attempt}"
        assert seen["TORCHELASTIC_ERROR_FILE"] == str(hg.node_dir(agent_job, node) / f"rank-{rank}.error.json")
        assert seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and seen["PYTHONUNBUFFERED"] == "1"
        assert seen["OMP_NUM_THREADS"] == ("1" if seen["LOCAL_WORLD_SIZE"] == "2" else None)
        assert seen.get("is_torchelastic_launched", True) is True
    assert sorted(int(s["TORCHELASTIC_RESTART_COUNT"]) for s, _ in reports) == [0, 0, 0, 1, 1, 1]


STREAMS_SCRIPT = """
import os, signal, sys, time
if os.environ["RANK"] == "0":
    print("rank 0 is waiting")                      # no flush: a pipe buffers it without -u
    time.sleep(120)                                  # ended by hgtrain's stop
else:
    deadline = time.monotonic() + 30                 # the test saw rank 0's line by then, or it fails
    while not os.path.exists("go"):
        if time.monotonic() > deadline:
            sys.exit("rank 1: rank 0's line never reached hgtrain's stdout")
        time.sleep(0.05)
    print("rank 1 last words")
    print("rank 1 to stderr", file=sys.stderr)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_unbuffered_ranks_reach_a_pipe_live_and_keep_their_last_words_stderr_on_stderr(hg, tmp_path):
    """PYTHONUNBUFFERED unset, stdout a pipe, the embedded cluster sized by --nproc-per-node: a
    rank's line arrives while it runs, the line a rank printed before it was killed (or stopped)
    is not lost, and its stderr line goes to hgtrain's stderr, tagged."""
    plan = make_plan(default_cluster(2), [["local", "local"]])
    pfile = plan_file(tmp_path, plan)
    env = {k: v for k, v in hg.env().items() if k != "PYTHONUNBUFFERED"}
    run = hg.start("--nproc-per-node", "2", "--plan", str(pfile), "--", PY, "-c", STREAMS_SCRIPT, env=env)
    run.wait_line(lambda line: line == "local:0 | rank 0 is waiting")   # live, while rank 0 sleeps
    (tmp_path / "go").touch()
    assert run.finish() == 137
    assert run.lines == ["local:0 | rank 0 is waiting", "local:1 | rank 1 last words"]
    assert "local:1 | rank 1 to stderr" in run.stderr.splitlines()
    assert "root cause: local:1 killed by SIGKILL" in run.stderr


def test_accelerates_distributed_test_script_passes_with_every_line_in_order(hg, tmp_path):
    """accelerate's own ``test_script.py`` (its broadest: state, RNG sync, dataloaders, training),
    unmodified, on 2 ranks of the embedded cluster, planned as a torchrun user types it. On a CPU
    accelerate runs distributed only with ACCELERATE_USE_CPU=1. (test_sync, test_ops and
    test_distributed_data_loop were compared with torchrun by hand: docs/launch.md.)"""
    script = "test_script"
    accelerate = pytest.importorskip("accelerate", reason="optional: pip install accelerate")
    from tests.unit.plan_clusters import A100, cluster as profiled
    from hgcli import state
    from hgcli.schema.stages import to_dict
    import dataclasses
    import time

    fingerprint = default_cluster(2).fingerprint()
    inventory, profiles = profiled([[A100, A100]], fingerprint=fingerprint, names=["local"])
    state.write_json(state.cluster_dir(fingerprint) / "inventory.json",
                     to_dict(dataclasses.replace(inventory, probed_at=time.time())))
    state.write_json(state.cluster_dir(fingerprint) / "profiles.json", to_dict(profiles))
    path = Path(accelerate.__file__).parent / "test_utils" / "scripts" / f"{script}.py"
    env = {k: v for k, v in hg.env(ACCELERATE_USE_CPU="1").items() if k != "PYTHONUNBUFFERED"}
    code, out, err = hg.run("--nproc-per-node", "2", "--strategy", "allreduce", "--", PY, str(path), env=env,
                            timeout=240)
    assert code == 0, err
    job_id = hg.job_ids()[-1]
    for rank in (0, 1):
        mine = [line.split(" | ", 1)[1] for line in out.splitlines() if line.startswith(f"local:{rank} | ")]
        assert mine, f"rank {rank} printed nothing"
        # every line the rank wrote (the agent's node-local file, straight from its pipe), in order
        assert mine == (hg.node_dir(job_id, "local") / f"rank-{rank}.out").read_text().splitlines()
    assert "Distributed environment: DistributedType.MULTI_CPU" in out and "Num processes: 2" in out
