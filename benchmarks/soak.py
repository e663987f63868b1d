"""Soak: a hybrid job under `hgtrain launch --restarts`, a random worker rank SIGKILLed every interval.

The bundled example trains on an emulated local cluster (nodes a and b on this machine, local
transport, real agents and ranks): group 0 = two devices of speed 1.0 on node a, group 1 = two of
speed 0.25 on node b, one PS rank on node a. Every `--interval` seconds (default 60) for `--minutes`
(default 10) one worker rank, chosen at random among the running attempt's workers, gets SIGKILL;
hgtrain restarts the whole job and the PS resumes from its last complete checkpoint. At the end the
launcher gets SIGINT once the last restart runs (the job is endless) and every process carrying the job's marker is counted.

Figures:
- restarts survived: restarts after which every rank of the new attempt started again;
- samples lost (work redone since the last checkpoint): the PS's `ps_push` metrics give, per attempt,
  the version of every applied push and its group; a restarted PS resumes from checkpoint version C
  (its "resumed from checkpoint version C" line; 0 when none was complete), so every push of the
  previous attempt with a version above C is applied again: lost samples = the sum over those pushes
  of their group's batch per push (the plan's per-rank batches summed, times the group's accumulate);
- leaked processes: live processes whose environment carries HGTRAIN_JOB_ID of any attempt of the
  job, once the launcher has exited (goal 0; waited for at most 30 s).
Readable table, then the LAST line one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hgcli.state.records import attempt_job_id
from hgcli.schema.stages import Cluster, NodeSpec, Plan
from hgcli.node.agent.procs import MARKER_JOB, has_marker, proc_stat
from hgcli.plan.files import write_plan
from hgcli.local.plans import emulated_plan

REPO = Path(__file__).resolve().parents[1]
RESUMED = re.compile(r"resumed from checkpoint version (\d+)|no complete checkpoint")


def make_plan(cluster: Cluster) -> Plan:
    plan = emulated_plan([[1.0, 1.0], [0.25, 0.25]], [[32, 32], [8, 8]], n_ps=1, staleness_bound=2,
                         nodes=[["a", "a"], ["b", "b"]], ps_node="a")
    return dataclasses.replace(plan, cluster=cluster.fingerprint())


def cluster_file(path: Path) -> Cluster:
    cluster = Cluster(nodes=tuple(NodeSpec(name=n, host="localhost", python=sys.executable) for n in "ab"))
    path.write_text("".join(f'[[nodes]]\nname = "{n.name}"\nhost = "localhost"\npython = {json.dumps(n.python)}\n\n'
                            for n in cluster.nodes))
    path.chmod(0o600)
    return cluster


def marked_pids(job_id: str, attempts: int) -> list[int]:
    """Live processes of any attempt of the job (HGTRAIN_JOB_ID=<id> or <id>-r<N>)."""
    markers = [{MARKER_JOB: attempt_job_id(job_id, n)} for n in range(attempts)]
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    return [pid for pid in pids if any(has_marker(pid, m) for m in markers)
            and (stat := proc_stat(pid)) is not None and not stat.is_zombie]


class Events:
    """The launcher's --json events, read live on a thread."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.items: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            with self.lock:
                self.items.append(json.loads(raw))

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.items)


def attempts(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events split at each job_restarted."""
    parts: list[list[dict[str, Any]]] = [[]]
    for e in events:
        if e["event"] == "job_restarted":
            parts.append([])
        parts[-1].append(e)
    return parts


def running_workers(part: list[dict[str, Any]], world: int) -> dict[int, int]:
    """rank -> pid of the attempt's workers, once every rank of it started (and none exited)."""
    started = {e["rank"]: (e["pid"], e["role"]) for e in part if e["event"] == "rank_started"}
    if len(started) < world or any(e["event"] in ("rank_exited", "stopping") for e in part):
        return {}
    return {r: pid for r, (pid, role) in started.items() if role == "worker"}


def resume_version(part: list[dict[str, Any]]) -> int | None:
    """The version a restarted PS resumed from (0: no complete checkpoint), None before its line."""
    for e in part:
        if e["event"] == "log" and (m := RESUMED.search(e["line"])):
            return int(m.group(1)) if m.group(1) else 0
    return None


def lost_samples(parts: list[list[dict[str, Any]]], per_push: dict[int, int]
                 ) -> tuple[int, int, list[int | None]]:
    """(samples applied in all, samples lost, resume version of each restart)."""
    applied = lost = 0
    resumes = []
    for i, part in enumerate(parts):
        pushes = [(e["data"]["version"], e["data"]["group"]) for e in part
                  if e["event"] == "metric" and e["data"].get("event") == "ps_push"]
        applied += sum(per_push[g] for _, g in pushes)
        if i + 1 < len(parts):
            version = resume_version(parts[i + 1])
            resumes.append(version)
            if version is not None:   # unknown (never seen): not counted, shown as null
                lost += sum(per_push[g] for v, g in pushes if v > version)
    return applied, lost, resumes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--interval", type=float, default=60.0, help="seconds between two kills")
    p.add_argument("--checkpoint-seconds", type=float, default=10.0)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)
    kills = int(args.minutes * 60 // args.interval)
    with tempfile.TemporaryDirectory(prefix="hg-soak-") as tmp:
        root = Path(tmp)
        cluster = cluster_file(root / "cluster.toml")
        plan = make_plan(cluster)
        write_plan(root / "plan.json", plan)
        per_push = {g.id: sum(plan.rank(r).batch_size or 0 for r in g.ranks) * g.accumulate for g in plan.groups}
        (root / "home").mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(root / "home"),
               "HGTRAIN_STATE_DIR": str(root / "state")}
        argv = [sys.executable, "-m", "hgcli", "launch", "-c", str(root / "cluster.toml"), "--plan",
                str(root / "plan.json"), "--json", "--grace", "3", "--restarts", str(kills + 2),
                "--checkpoint-seconds", str(args.checkpoint_seconds), "--checkpoint-every",
                str(args.checkpoint_every), "--", sys.executable, "-m", "hgcli.examples.train_mlp",
                "--epochs", "100000", "--eval-every", "1000000"]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=env, cwd=root, start_new_session=True)
        events = Events(proc)
        start = time.monotonic()
        killed: list[tuple[float, int]] = []
        next_kill = start + args.interval
        while time.monotonic() - start < args.minutes * 60 and proc.poll() is None:
            time.sleep(0.2)
            if time.monotonic() < next_kill or len(killed) >= kills:
                continue
            workers = running_workers(attempts(events.snapshot())[-1], plan.world_size)
            if workers:   # else the job is (re)starting: kill as soon as it runs again
                rank = rng.choice(sorted(workers))
                os.kill(workers[rank], signal.SIGKILL)
                killed.append((time.monotonic() - start, rank))
                next_kill += args.interval
        # The last kill's restart counts too: give it time to run every rank again (bounded).
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline and not (
                len(parts := attempts(events.snapshot())) == len(killed) + 1
                and running_workers(parts[-1], plan.world_size) and resume_version(parts[-1]) is not None):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        events.thread.join(10)
        got = events.snapshot()
        job_id = next(e["job_id"] for e in got if e["event"] == "job_started")
        parts = attempts(got)
        deadline = time.monotonic() + 30
        while marked_pids(job_id, len(parts)) and time.monotonic() < deadline:
            time.sleep(0.5)
        leaked = marked_pids(job_id, len(parts))
        survived = sum(1 for part in parts[1:] if len({e["rank"] for e in part if e["event"] == "rank_started"})
                       == plan.world_size)
        applied, lost, resumes = lost_samples(parts, per_push)
        record = json.loads((root / "state" / "jobs" / job_id / "job.json").read_text())
    result = {"minutes": args.minutes, "interval_s": args.interval, "checkpoint_seconds": args.checkpoint_seconds,
              "checkpoint_every": args.checkpoint_every, "kills": len(killed), "killed_ranks": [r for _, r in killed],
              "restarts": len(parts) - 1, "restarts_survived": survived, "restarts_in_record": len(record["restarts"]),
              "resume_versions": resumes, "samples_applied": applied, "samples_lost": lost,
              "lost_ratio": lost / applied if applied else None, "leaked_processes": len(leaked),
              "launcher_exit_code": code, "job_id": job_id}
    rows = [("kills (SIGKILL to a random worker)", len(killed)), ("restarts", result["restarts"]),
            ("restarts survived (every rank running again)", survived),
            ("restarts in the job record", len(record["restarts"])),
            ("PS resume versions", ", ".join(map(str, resumes)) or "-"),
            ("samples applied by the PS (all attempts)", applied),
            ("samples lost (pushes redone after a resume)", lost),
            ("lost / applied", f"{result['lost_ratio']:.3f}" if applied else "-"),
            ("leaked processes (goal 0)", len(leaked)), ("launcher exit code (SIGINT at the end)", code)]
    width = max(len(name) for name, _ in rows)
    print(f"soak: {args.minutes:g} min, a worker killed every {args.interval:g} s, checkpoint every "
          f"{args.checkpoint_seconds:g} s / {args.checkpoint_every} versions")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(json.dumps(result))
    return 0 if not leaked and survived == len(killed) else 1


if __name__ == "__main__":
    raise SystemExit(main())
