"""The rank processes of one job on one node, as a whole: started in order, signalled together
(their process groups and any process that left them but carries the job's marker), and ended.

The supervisor decides when; this knows how, and what is left. Every process group it signals
belongs to a rank whose leader is still unreaped (``ranks.Rank``), so its id cannot have been reused.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from . import procs, outbound
from .ranks import Rank
from .spec import AgentSpec
from .store import StoreHost
from ..protocol import ExitFrame, RankState, StartedFrame

ExitCallback = Callable[[int, int | None, int | None], None]   # (rank, code, signal), from a waiter thread


class RankSet:
    """The job's ranks on this node, by rank number, and the processes they started."""

    def __init__(self, spec: AgentSpec, marker: Mapping[str, str], store: StoreHost | None) -> None:
        self.spec = spec
        self.marker = marker
        self.store = store          # carries the marker too, but is ended by its own ``stop``
        self.ranks = {r.rank: Rank(r) for r in spec.ranks}

    def start(self, job_dir: Path, on_exit: ExitCallback,
              post: Callable[[StartedFrame | ExitFrame], None]) -> int | None:
        """Start every rank in order, posting each one's started frame; the first that cannot start
        is a failure (its exit frame is posted, the rest are not started): its rank, else None."""
        for rank in self.ranks.values():
            try:
                rank.start(self.spec, job_dir, on_exit)
            except OSError as exc:
                rank.exited, rank.state, rank.code = True, RankState.FAILED, 127
                rank.reason = f"cannot start {rank.spec.argv[0]!r}: {exc.strerror or exc}"
                post(rank.frame())
                for other in self.ranks.values():
                    if other.state is RankState.PENDING:
                        other.exited, other.state, other.reason = True, RankState.STOPPED, "not started"
                return rank.rank
            assert rank.pid is not None   # set by a start that returned
            post(outbound.started(rank.rank, rank.pid))
        return None

    def all_exited(self) -> bool:
        return all(r.exited for r in self.ranks.values())

    def groups(self) -> dict[int, int | None]:
        """Process groups of ranks whose leader is unreaped: their ids cannot have been reused."""
        return {r.pid: None for r in self.ranks.values()
                if r.pid is not None and r.popen is not None and r.popen.returncode is None}

    def processes(self, groups: dict[int, int | None]) -> list[procs.ProcStat]:
        """The job's processes on this node but the store (which carries the job's marker, so that
        'hgtrain stop' finds it when its agent is gone, and is ended last, after the ranks)."""
        store = self.store.pid if self.store is not None else None
        return [p for p in procs.job_processes(groups, self.marker) if p.pid != store]

    def left_over(self) -> bool:
        """Some process of the job is still there (a rank's child, after the rank itself ended)."""
        return bool(self.processes(self.groups()))

    def gone(self) -> bool:
        return self.all_exited() and not self.left_over()

    def signal(self, sig: int) -> None:
        groups = self.groups()
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        # Processes that left the ranks' groups (setsid daemons) still carry the job's marker.
        strays = [p for p in self.processes(groups) if p.pgid not in groups]
        procs.signal_all(strays, sig)

    def give_up(self) -> list[ExitFrame]:
        """The exit frames of ranks SIGKILL did not end, now marked unknown; then reap every rank."""
        frames = []
        for rank in self.ranks.values():
            if not rank.exited:
                rank.exited, rank.state = True, RankState.UNKNOWN
                rank.reason = "did not exit after SIGKILL (uninterruptible sleep?)"
                frames.append(rank.frame())
            rank.reap(1.0)
        return frames

    def wait_captures(self, timeout: float) -> None:
        """Let the ranks' pipes reach EOF (bounded in all by ``timeout``): their last output is on disk."""
        deadline = time.monotonic() + timeout
        for rank in self.ranks.values():
            for cap in rank.captures.values():
                cap.done.wait(max(0.0, deadline - time.monotonic()))

    def bytes_dropped(self) -> int:
        return sum(c.dropped for r in self.ranks.values() for c in r.captures.values())

    def records(self, secret: tuple[str, ...]) -> list[dict[str, Any]]:
        """Each rank's entry in agent.json."""
        return [r.record(secret) for r in self.ranks.values()]
