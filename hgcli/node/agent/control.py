"""Finding and controlling a job from a fresh connection: ``--status``, ``--stop``, ``--tail``.

These never trust a bare pid: the agent and every process group are checked against the start
times recorded in agent.json (and the boot id), and processes are otherwise recognised by the job's
environment marker, so stopping one job can never touch another job or an unrelated process.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import procs
from .jobdir import last_metrics, read_record, record_finished, record_path, request_stop
from .logs import Follower, log_frames
from .output import FrameWriter
from .ranks import STREAMS, log_path
from ..protocol import AgentOutcome, FrameType, NodeJobState, RankState, StatusFrame, StatusRank, StoppedFrame, TailEndFrame
from ...state import write_json

AGENT_EXTRA_WAIT_S = 15.0   # beyond the job's grace period: the agent's own SIGKILL wait and report
KILL_WAIT_S = 5.0


def _same_boot(record: dict[str, Any]) -> bool:
    return record.get("boot_id") == procs.boot_id()


def agent_alive(record: dict[str, Any]) -> bool:
    agent = record.get("agent") or {}
    pid, ticks = agent.get("pid"), agent.get("start_ticks")
    return _same_boot(record) and isinstance(pid, int) and procs.is_alive(pid, ticks)


def _groups(record: dict[str, Any]) -> dict[int, int | None]:
    """Recorded process groups with their leaders' start ticks (verified, never trusted blindly)."""
    return {r["pgid"]: r.get("start_ticks") or -1 for r in record.get("ranks", [])
            if isinstance(r.get("pgid"), int)}


def leftover(record: dict[str, Any]) -> list[procs.ProcStat]:
    if not _same_boot(record):
        return []   # after a reboot nothing of the job can be running
    return procs.job_processes(_groups(record), procs.job_marker(record["job_id"], record["node"]))


def status(job_dir: Path) -> StatusFrame:
    record = read_record(job_dir) or {}
    alive = agent_alive(record)
    state = record.get("state", NodeJobState.UNKNOWN)
    ranks: list[StatusRank] = []
    for r in record.get("ranks", []):
        rank_state = r.get("state")
        running = isinstance(r.get("pid"), int) and _same_boot(record) and procs.is_alive(r["pid"], r.get("start_ticks"))
        if not alive and RankState.parse(rank_state).is_running():
            rank_state = RankState.RUNNING if running else RankState.UNKNOWN
        ranks.append({"rank": r.get("rank"), "state": rank_state, "pid": r.get("pid"), "code": r.get("code"),
                      "signal": r.get("signal"), "reason": r.get("reason"), "oom": r.get("oom"),
                      "metrics": last_metrics(log_path(job_dir, r.get("rank"), "metrics"))})
    if not alive and not record_finished(record):
        # The agent died without finishing its record: say so rather than repeat a stale "running".
        state = NodeJobState.ORPHANED if any(r["state"] == RankState.RUNNING for r in ranks) else NodeJobState.LOST
    return {"type": FrameType.STATUS, "job_id": record.get("job_id"), "node": record.get("node"), "state": state,
            "agent_alive": alive, "reason": record.get("reason"), "first_failure": record.get("first_failure"),
            "started_at": record.get("started_at"), "ended_at": record.get("ended_at"), "ranks": ranks}


def stop(job_dir: Path) -> StoppedFrame:
    """Stop the job: through its agent when it lives, else by killing the recorded groups here."""
    record = read_record(job_dir) or {}
    grace = float(record.get("grace_s") or 10.0)
    agent: AgentOutcome = "gone"
    if agent_alive(record):
        agent = "stopped"
        request_stop(job_dir)
        me = procs.proc_stat(record["agent"]["pid"])
        if me is not None:
            procs.send_signal(me, signal.SIGTERM)
        deadline = time.monotonic() + grace + AGENT_EXTRA_WAIT_S
        # A stopped agent (SIGSTOP) does not act on SIGTERM until continued: not waited for.
        while agent_alive(record) and time.monotonic() < deadline and not (me is not None and _stopped(me.pid)):
            time.sleep(0.05)
        if agent_alive(record):
            agent = "not responding"
    killed = _kill_leftovers(record, grace)
    left = [p.pid for p in leftover(record)]
    record = read_record(job_dir) or record
    if not agent_alive(record) and not record_finished(record):
        _mark_stopped(job_dir, record)
    return {"type": FrameType.STOPPED, "job_id": record.get("job_id"), "node": record.get("node"), "agent": agent,
            "killed": killed, "left": left, "state": (read_record(job_dir) or record).get("state")}


def _stopped(pid: int) -> bool:
    st = procs.proc_stat(pid)
    return st is not None and st.is_stopped


def _kill_leftovers(record: dict[str, Any], grace: float) -> list[int]:
    found = leftover(record)
    if not found:
        return []
    killed = procs.signal_all(found, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while leftover(record) and time.monotonic() < deadline:
        time.sleep(0.05)
    rest = leftover(record)
    if rest:
        killed += procs.signal_all(rest, signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while leftover(record) and time.monotonic() < deadline:
            time.sleep(0.05)
    return sorted(set(killed))


def _mark_stopped(job_dir: Path, record: dict[str, Any]) -> None:
    """Finish the record of a job whose agent died, so status stops calling it running."""
    record = dict(record, state=NodeJobState.STOPPED, ended_at=time.time(),
                  reason=record.get("reason") or "stopped with --stop after its agent was gone")
    for r in record.get("ranks", []):
        if RankState.parse(r.get("state")).is_running():
            r.update(state=RankState.STOPPED, reason="killed by --stop (agent was gone)")
    write_json(record_path(job_dir), record)


def parse_offsets(text: str | None) -> dict[tuple[int, str], int]:
    """``RANK:STREAM=OFFSET,...`` (as reported by a tail_end frame) -> {(rank, stream): offset}."""
    offsets: dict[tuple[int, str], int] = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        rank, _, stream = key.partition(":")
        if stream not in STREAMS or not rank.isdigit() or not value.isdigit():
            raise ValueError(f"bad offset {item!r}: expected RANK:out=N or RANK:err=N")
        offsets[(int(rank), stream)] = int(value)
    return offsets


def tail(job_dir: Path, *, follow: bool, offsets: dict[tuple[int, str], int], writer: FrameWriter) -> TailEndFrame:
    """Send the job's log lines from ``offsets``; with ``follow`` until the job ends or stdin closes."""
    record = read_record(job_dir) or {}
    hang_up = threading.Event()
    if follow:
        threading.Thread(target=lambda: (sys.stdin.buffer.read(), hang_up.set()),  # type: ignore[func-returns-value]
                         daemon=True).start()   # (the tuple only sequences the two calls)

    def job_over() -> bool:
        current = read_record(job_dir) or record
        return record_finished(current) or not agent_alive(current)

    finished = (lambda: hang_up.is_set() or job_over()) if follow else (lambda: True)
    followers: dict[str, Follower] = {}
    for r in record.get("ranks", []):
        for stream in STREAMS:
            rank = r["rank"]
            followers[f"{rank}:{stream}"] = Follower(
                log_path(job_dir, rank, stream), offsets.get((rank, stream), 0), log_frames(rank, stream),
                writer.send, finished, complete=job_over).start(f"tail{rank}-{stream}")
    while not all(f.done.wait(0.2) for f in followers.values()):
        if hang_up.is_set():
            break
    return {"type": FrameType.TAIL_END, "job_id": record.get("job_id"), "node": record.get("node"),
            "complete": job_over(), "offsets": ",".join(f"{k}={f.offset}" for k, f in followers.items())}
