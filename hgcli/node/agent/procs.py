"""The process table seen through /proc (Linux): identities that survive pid reuse, job membership,
race-free signalling, and OOM-killer evidence.

A pid alone is not an identity: after a process exits its number can be handed to an unrelated
process. We pair every pid with its start time (field 22 of /proc/<pid>/stat, clock ticks since boot)
and the boot id, and signal through a pidfd opened *before* re-checking that start time, so a signal
can never land on a process that merely reused the number.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

# Environment variables every rank carries; a process holding both belongs to that job's node
# (children inherit them, so even a rank's daemonised grandchildren are found).
MARKER_JOB = "HGTRAIN_JOB_ID"
MARKER_NODE = "HGTRAIN_NODE"


@dataclass(frozen=True)
class ProcStat:
    """One process as /proc/<pid>/stat shows it: enough to find a job's processes and tell a reused pid."""

    pid: int
    state: str        # "R", "S", "Z" (zombie), ...
    ppid: int
    pgid: int
    sid: int
    start_ticks: int

    @property
    def is_zombie(self) -> bool:
        return self.state in ("Z", "X")

    @property
    def is_stopped(self) -> bool:
        """Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: it acts on nothing until continued."""
        return self.state in ("T", "t")


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def proc_stat(pid: int) -> ProcStat | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode("ascii", "replace")
    except (OSError, ValueError):
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and ')'.
    rest = raw[raw.rfind(")") + 2:].split()
    try:
        return ProcStat(pid, rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int) -> int | None:
    st = proc_stat(pid)
    return st.start_ticks if st else None


def is_alive(pid: int, ticks: int | None) -> bool:
    """The process that had ``pid`` and started at ``ticks`` still runs (zombies count as gone)."""
    st = proc_stat(pid)
    return st is not None and not st.is_zombie and (ticks is None or st.start_ticks == ticks)


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def has_marker(pid: int, marker: Mapping[str, str]) -> bool:
    """``pid`` was started with every ``NAME=value`` of ``marker`` (unreadable environ: no)."""
    try:
        items = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    except OSError:
        return False
    return all(f"{k}={v}".encode() in items for k, v in marker.items())


def job_marker(job_id: str, node: str) -> dict[str, str]:
    return {MARKER_JOB: job_id, MARKER_NODE: node}


def job_processes(groups: Mapping[int, int | None], marker: Mapping[str, str]) -> list[ProcStat]:
    """Live (non-zombie) processes of one job: members of its process groups and carriers of its marker.

    ``groups`` maps each rank's pgid to its leader's start ticks, or to None when the caller holds the
    leader unreaped (then the group id cannot have been reused and every member is ours). Otherwise a
    group counts only while its leader is the recorded process; members of a leaderless group must
    carry the marker, because the id may since belong to someone else's group.
    """
    me = os.getpid()
    found = []
    for pid in _pids():
        st = proc_stat(pid)
        if st is None or st.is_zombie or pid == me:
            continue
        if st.pgid in groups:
            ticks = groups[st.pgid]
            if ticks is None:
                found.append(st)
                continue
            leader = proc_stat(st.pgid)
            if leader is not None and leader.start_ticks == ticks:
                found.append(st)
                continue
        if has_marker(pid, marker):
            found.append(st)
    return found


def send_signal(proc: ProcStat, sig: int) -> bool:
    """Signal exactly ``proc`` (pid and start time); False when it is gone or the pid was reused."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        pidfd = -1  # no pidfd support: a check-then-kill with a tiny race, the best available
    try:
        if start_ticks(proc.pid) != proc.start_ticks:
            return False
        if pidfd >= 0:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(proc.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def signal_all(procs: Iterable[ProcStat], sig: int) -> list[int]:
    return [p.pid for p in procs if send_signal(p, sig)]


def oom_counter(pid: int) -> tuple[Path, int] | None:
    """The OOM-kill counter of ``pid``'s memory cgroup (v2 memory.events or v1 memory.oom_control).

    The kernel counts every OOM kill (cgroup limit or global) against the victim's memory cgroup,
    so a counter that rose while a rank died of SIGKILL is evidence of the OOM killer.
    """
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":
            for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                candidates.append(Path(base + path) / "memory.events")
        elif "memory" in controllers.split(","):
            candidates.append(Path("/sys/fs/cgroup/memory" + path) / "memory.oom_control")
    for file in candidates:
        count = read_oom_kills(file)
        if count is not None:
            return file, count
    return None


def read_oom_kills(file: Path) -> int | None:
    try:
        for line in file.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None
