"""A test and benchmark harness: run every rank of a plan as local subprocesses.

Not the launcher (no node agents, no SSH, no log streaming): it gives each rank the same environment
the launcher will (env.rank_env) with MASTER_ADDR 127.0.0.1 and a free port, writes each rank's
output to ``<workdir>/rank<N>.log``, collects the metrics each rank writes to HGTRAIN_METRICS_FD and
the exit codes, and when a rank fails stops all the others (SIGTERM, a grace period, SIGKILL).

    python -m hgcli.local --speeds 1,1,0.25,0.25 --strategy hybrid -- python -m hgcli.examples.train
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..schema import stages as m
from ..node.ports import free_port
from ..runtime.env import ps_argv as default_ps_argv
from ..runtime.env import rank_env
from .plans import emulated_plan


@dataclass
class RankResult:
    """One rank of a local run: its role, how it exited and the file holding its output."""

    rank: int
    role: m.Role
    exit_code: int | None          # None: still running when it was killed
    log: Path

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


@dataclass
class LocalRunResult:
    """A local run of a plan: every rank's result, the metrics they wrote and the first failure
    (the root cause), for tests and benchmarks to assert on."""

    ranks: list[RankResult]
    metrics: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0
    timed_out: bool = False
    first_failure: RankResult | None = None   # the first rank seen exiting non-zero (root cause)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.exit_code == 0 for r in self.ranks)


def run_plan(plan: m.Plan, worker_argv: Sequence[str], *, workdir: Path,
             ps_argv: Sequence[str] | None = None, timeout_s: float = 300.0,
             rank_timeout_s: float | None = None, extra_env: dict[str, str] | None = None,
             kill_on_failure: bool = True, grace_s: float = 3.0, master_addr: str = "127.0.0.1",
             node_prefix: dict[str, list[str]] | None = None,
             node_env: dict[str, dict[str, str]] | None = None) -> LocalRunResult:
    """``node_prefix``/``node_env``: argv prefix and variables per plan node, e.g. to run a "node"
    inside a network namespace (``ip netns exec NS``) with GLOO_SOCKET_IFNAME set."""
    workdir.mkdir(parents=True, exist_ok=True)
    plan_path = workdir / "plan.json"
    plan_path.write_text(m.to_json(plan), encoding="utf-8")
    port = free_port()
    token = os.urandom(16).hex()
    base = {**os.environ, **(extra_env or {})}
    # Subprocesses import this checkout, whatever the caller's working directory.
    root = str(Path(__file__).resolve().parents[2])
    base["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH")) if p)
    procs: list[tuple[subprocess.Popen[bytes], RankResult]] = []
    metrics: list[dict[str, Any]] = []
    lock = threading.Lock()
    readers = []
    start = time.monotonic()
    try:
        for rp in plan.ranks:
            read_fd, write_fd = os.pipe()
            env = {**base, **(node_env or {}).get(rp.node, {}),
                   **rank_env(plan, rp.rank, master_addr=master_addr, master_port=port,
                              plan_path=str(plan_path), job_id=f"local-{os.getpid()}",
                              metrics_fd=write_fd, timeout_s=rank_timeout_s, token=token,
                              # a node run elsewhere (a namespace) listens where its prefix says
                              bind_addr=None if rp.node in (node_prefix or {}) else master_addr)}
            argv = list(worker_argv) if rp.role is m.Role.WORKER else list(ps_argv or default_ps_argv())
            argv = (node_prefix or {}).get(rp.node, []) + argv
            log = workdir / f"rank{rp.rank}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, pass_fds=(write_fd,),
                                        start_new_session=True)
            os.close(write_fd)
            procs.append((proc, RankResult(rp.rank, rp.role, None, log)))
            t = threading.Thread(target=_read_metrics, args=(read_fd, metrics, lock), daemon=True)
            t.start()
            readers.append(t)
        result = _supervise(procs, timeout_s, kill_on_failure, grace_s)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                _signal(proc, signal.SIGKILL)
                proc.wait()
    for t in readers:
        t.join(timeout=5)
    result.metrics = metrics
    result.elapsed_s = time.monotonic() - start
    return result


def _supervise(procs: list[tuple[subprocess.Popen[bytes], RankResult]], timeout_s: float,
               kill_on_failure: bool, grace_s: float) -> LocalRunResult:
    deadline = time.monotonic() + timeout_s
    first: RankResult | None = None
    timed_out = False
    while True:
        running = 0
        for proc, res in procs:
            rc = proc.poll()
            if rc is None:
                running += 1
            elif res.exit_code is None:
                res.exit_code = rc
                if rc != 0 and first is None:
                    first = res
        if not running:
            break
        if (first is not None and kill_on_failure) or time.monotonic() > deadline:
            timed_out = first is None or not kill_on_failure
            _stop_all(procs, grace_s)
            break
        time.sleep(0.05)
    return LocalRunResult(ranks=[r for _, r in procs], timed_out=timed_out, first_failure=first)


def _stop_all(procs: list[tuple[subprocess.Popen[bytes], RankResult]], grace_s: float) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for proc, res in procs:
        try:
            proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL)
            proc.wait()
        if res.exit_code is None and proc.returncode is not None and proc.returncode >= 0:
            res.exit_code = proc.returncode


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _read_metrics(fd: int, sink: list[dict[str, Any]], lock: threading.Lock) -> None:
    with os.fdopen(fd, "rb") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            with lock:
                sink.append(record)


def plan_for_speeds(speeds: Sequence[float], strategy: str, batch: int, n_ps: int,
                    staleness: int) -> m.Plan:
    """Allreduce: one group, batch per rank proportional to speed; hybrid: one group per speed."""
    sizes = [max(1, round(batch * s)) for s in speeds]
    if strategy == "allreduce":
        return emulated_plan([list(speeds)], [sizes])
    groups: dict[float, list[int]] = {}
    for i, s in enumerate(speeds):
        groups.setdefault(s, []).append(i)
    order = sorted(groups, reverse=True)
    return emulated_plan([[speeds[i] for i in groups[s]] for s in order],
                         [[sizes[i] for i in groups[s]] for s in order],
                         n_ps=n_ps, staleness_bound=staleness)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hgcli.local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speeds", default="1,1,0.25,0.25", help="emulated device speeds")
    parser.add_argument("--strategy", choices=["hybrid", "allreduce"], default="hybrid")
    parser.add_argument("--batch", type=int, default=64, help="batch of a speed-1.0 device")
    parser.add_argument("--ps", type=int, default=1, help="parameter-server ranks (hybrid)")
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --")
    plan = plan_for_speeds([float(s) for s in args.speeds.split(",")], args.strategy, args.batch,
                           args.ps, args.staleness)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hgtrain-localrun-"))
    result = run_plan(plan, command, workdir=workdir, timeout_s=args.timeout)
    for r in result.ranks:
        print(f"rank {r.rank} ({r.role.value}): exit {r.exit_code}, log {r.log}")
    print(result.ranks[0].output(), end="")
    if result.first_failure:
        print(f"rank {result.first_failure.rank} failed first; its log:\n"
              f"{result.first_failure.output()[-3000:]}", file=sys.stderr)
    return 0 if result.ok else 1

