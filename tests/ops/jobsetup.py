"""Real jobs for the status/logs/stop tests: node agents started detached through the real
LocalTransport (as launch starts them, minus launch), plus the job record launch would write.

The agents use their default jobs root (``~/.cache/hgtrain/jobs``); the tests point ``HOME`` at a
temporary directory so that root is private to the test. Processes are found the way a user checks
the process table: by the job marker ``HGTRAIN_JOB_ID`` in ``/proc/<pid>/environ``.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from hgcli.state import records as jobs
from hgcli.schema.stages import (GroupPlan, JobRecord, JobState, NodeSpec, Plan, RankPlan, RankRecord, RankState, Role,
                         Strategy, to_dict)
from hgcli.node import frames
from hgcli.node.agent.spec import AgentSpec, RankSpec
from hgcli.remote.local import LocalTransport
from hgcli.remote.transport import Transport, node_module_argv
from tests.agent.harness import WAIT_S, job_pids, new_job_id, wait_until

PY = sys.executable


def py(code: str) -> tuple[str, ...]:
    return (PY, "-u", "-c", code)


def two_node_cluster_file(tmp_path: Path, extra: str = "") -> Path:
    """Nodes a and b, both this machine through the local transport (two agents on one host)."""
    path = tmp_path / "cluster.toml"
    path.write_text(f'[[nodes]]\nname = "a"\nhost = "localhost"\npython = "{PY}"\n\n'
                    f'[[nodes]]\nname = "b"\nhost = "localhost"\npython = "{PY}"\n{extra}')
    return path


def make_plan(cluster_fp: str, nodes: list[str]) -> Plan:
    ranks = tuple(RankPlan(rank=i, role=Role.WORKER, node=n, device="cpu", group=0, batch_size=8)
                  for i, n in enumerate(nodes))
    return Plan(strategy=Strategy.ALLREDUCE, world_size=len(ranks), groups=(GroupPlan(0, tuple(range(len(ranks)))),),
                ranks=ranks, predicted_samples_per_s={"allreduce": 1.0, "hybrid": 1.0, "ps": 1.0, "ideal": 1.0},
                global_batch=8 * len(ranks), cluster=cluster_fp)


def start_detached(job_id: str, node: str, ranks: dict[int, tuple[str, ...]], *, grace_s: float = 2.0,
                   transport: Transport | None = None) -> int:
    """Start one node's agent detached (``detach: true``) and wait until it reports the job running;
    returns the detached agent's pid. Local unless a transport (SSH) is given."""
    transport = transport or LocalTransport(NodeSpec(name=node, host="localhost", python=PY))
    argv, env = node_module_argv(transport, "agent")
    proc = transport.start(argv, env=env)
    spec = AgentSpec(job_id=job_id, node=node, ranks=tuple(RankSpec(rank=r, argv=a) for r, a in ranks.items()),
                     grace_s=grace_s, detach=True)
    proc.stdin.write(frames.encode({"type": "spec", **to_dict(spec)}).encode())
    proc.stdin.flush()
    found: list[dict] = []
    reader = threading.Thread(target=lambda: found.extend(
        f for f in (frames.decode(raw.decode()) for raw in proc.stdout) if f is not None), daemon=True)
    reader.start()
    assert proc.wait(WAIT_S) == 0, found
    reader.join(WAIT_S)
    proc.close()
    detached = [f for f in found if f.get("type") == "detached"]
    assert detached, f"the agent did not detach: {found}"
    return detached[0]["pid"]


def write_record(job_id: str, cluster_fp: str, cluster_source: str | None, nodes: list[str],
                 state: JobState = JobState.RUNNING, **fields) -> JobRecord:
    """The record launch writes for a detached job: rank i on nodes[i]."""
    plan = make_plan(cluster_fp, nodes)
    record = JobRecord(id=job_id, cluster=cluster_fp, cluster_source=cluster_source, command=("python3", "train.py"),
                       plan=plan, state=state,
                       ranks=tuple(RankRecord(rank=r.rank, node=r.node, role=r.role, state=RankState.RUNNING)
                                   for r in plan.ranks),
                       started_at=time.time(), detached=True, **fields)
    jobs.save(record)
    return record


def job_id() -> str:
    return new_job_id()


def wait_gone(job: str, timeout: float = WAIT_S) -> None:
    wait_until(lambda: not job_pids(job), timeout, f"job {job} to be gone")


__all__ = ["job_pids", "wait_until", "WAIT_S"]
