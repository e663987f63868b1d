"""One rank process on a node: how it is started, watched and described.

Each rank gets its own session (so its process group can be signalled as a whole and it never
receives the agent's terminal signals), stdout/stderr pipes captured to files, and a metrics pipe
whose write end it finds in ``HGTRAIN_METRICS_FD``.

The rank is *not reaped* when it exits: a waiter thread observes the exit with ``WNOWAIT`` and the
zombie is kept until the agent's final cleanup. While the zombie exists its pid, and so its process
group id, cannot be reused, which makes every ``killpg`` of the agent safe against pid reuse.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from . import procs
from .logs import Capture
from .secrets import redact_env
from .spec import AgentSpec, RankSpec
from ..protocol import ExitFrame, FrameType, RankError, RankState
from ...runtime import netbind
from ...schema.deepjson import loads_bounded

STREAMS = ("out", "err")
ERROR_FILE_MAX = 1 << 20   # an @record error file larger than this is not read back


def log_path(job_dir: Path, rank: int, stream: str) -> Path:
    """Node-local log of one rank: ``rank-<r>.out``, ``rank-<r>.err``, ``rank-<r>.metrics.jsonl``."""
    return job_dir / (f"rank-{rank}.metrics.jsonl" if stream == "metrics" else f"rank-{rank}.{stream}")


def error_file(job_dir: Path, rank: int) -> Path:
    """Where the rank's ``@record`` (torch.distributed.elastic) writes its exception: its
    ``TORCHELASTIC_ERROR_FILE``, read back when the rank fails."""
    return job_dir / f"rank-{rank}.error.json"


class Rank:
    """One rank's process: how it was started, how it ended and why, as frames and agent.json tell it."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.popen: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self.start_ticks: int | None = None
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.captures: dict[str, Capture] = {}
        self.exited = False       # exit observed (possibly still an unreaped zombie)
        self.code: int | None = None
        self.signal: int | None = None
        self.state = RankState.PENDING
        self.reason = ""
        self.oom: bool | None = None
        self.error: RankError | None = None
        self.error_file: Path | None = None
        self._oom_counter: tuple[Path, int] | None = None

    @property
    def rank(self) -> int:
        return self.spec.rank

    def start(self, job: AgentSpec, job_dir: Path, on_exit: Callable[[int, int | None, int | None], None]) -> None:
        """Start the process; OSError (missing program, bad cwd) propagates to the caller.
        ``on_exit(rank, code, signal)`` is called from a waiter thread when it has exited."""
        # Our own pipes rather than Popen's file objects: the Capture threads own the read ends.
        pipes = {name: os.pipe() for name in ("out", "err", "metrics")}
        metrics_w = pipes["metrics"][1]
        self.error_file = error_file(job_dir, self.rank)
        self.error_file.unlink(missing_ok=True)   # only this run's exception may be read back
        env = {**job.env_defaults, **os.environ, **job.env, **self.spec.env,
               **procs.job_marker(job.job_id, job.node), "HGTRAIN_METRICS_FD": str(metrics_w),
               "TORCHELASTIC_ERROR_FILE": str(self.error_file)}
        try:
            # gloo, NCCL and TensorPipe listen on the node's cluster address for any script, not only
            # one that calls hg.init() (which pins them itself, and says so when it cannot).
            netbind.pin_interfaces(env)
        except ValueError:
            pass
        try:
            self.popen = subprocess.Popen(
                list(self.spec.argv), stdin=subprocess.DEVNULL, stdout=pipes["out"][1],
                stderr=pipes["err"][1], env=env, cwd=self.spec.cwd, start_new_session=True,
                pass_fds=(metrics_w,))
        except BaseException:
            for r, _ in pipes.values():
                os.close(r)
            raise
        finally:
            for _, w in pipes.values():
                os.close(w)
        self.pid = self.popen.pid
        self.start_ticks = procs.start_ticks(self.pid)
        self.started_at = time.time()
        self.state = RankState.RUNNING
        self._oom_counter = procs.oom_counter(self.pid)
        name = f"rank{self.rank}"
        self.captures = {stream: Capture(r, log_path(job_dir, self.rank, stream), f"{name}-{stream}")
                         for stream, (r, _) in pipes.items()}
        threading.Thread(target=self._wait, args=(on_exit,), name=f"wait-{name}", daemon=True).start()

    def _wait(self, on_exit: Callable[[int, int | None, int | None], None]) -> None:
        assert self.pid is not None
        info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        if info is None:  # cannot happen without WNOHANG; keep the type checker honest
            return
        if info.si_code == os.CLD_EXITED:
            on_exit(self.rank, info.si_status, None)
        else:
            on_exit(self.rank, None, info.si_status)

    def record_exit(self, code: int | None, sig: int | None, *, stopping: bool, signalled: bool) -> None:
        """Set the rank's final state and a one-line reason a user can act on."""
        self.exited = True
        self.ended_at = time.time()
        self.code, self.signal = code, sig
        if code == 0 and not signalled:
            self.state, self.reason = RankState.SUCCEEDED, "exited with code 0"
            return
        # Once hgtrain has signalled the job, how a rank ends is a consequence, not a cause.
        self.state = RankState.STOPPED if (stopping or signalled) else RankState.FAILED
        if self.state is RankState.FAILED and self.error_file is not None:
            self.error = read_error_file(self.error_file)
        after_stop = " (after hgtrain's stop signal)" if signalled else ""
        if sig is None:
            self.reason = f"exited with code {code}{after_stop}"
        elif signalled:
            self.reason = f"killed by {signal_name(sig)}{after_stop}"
        elif sig == signal.SIGKILL:
            self.reason = f"killed by SIGKILL: {self._oom_verdict()}"
        else:
            self.reason = f"killed by {signal_name(sig)}"

    def _oom_verdict(self) -> str:
        if self._oom_counter is None:
            self.oom = None
            return "possibly out of memory (no OOM-killer evidence readable on this node)"
        path, before = self._oom_counter
        after = procs.read_oom_kills(path)
        if after is None:
            self.oom = None
            return "possibly out of memory (no OOM-killer evidence readable on this node)"
        self.oom = after > before
        if self.oom:
            return f"out of memory (the OOM killer; {path} counted an OOM kill)"
        return f"not by hgtrain and not by the OOM killer ({path} counted none)"

    def reap(self, timeout: float) -> None:
        if self.popen is not None and self.popen.returncode is None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass

    def frame(self) -> ExitFrame:
        """The exit frame sent to the controller."""
        return {"type": FrameType.EXIT, "rank": self.rank, "code": self.code, "signal": self.signal,
                "signal_name": signal_name(self.signal) if self.signal else None,
                "state": self.state, "reason": self.reason, "oom": self.oom, "error": self.error}

    def record(self, secret: tuple[str, ...]) -> dict[str, Any]:
        """The rank's entry in agent.json; secret env values never reach it."""
        return {"rank": self.rank, "pid": self.pid, "pgid": self.pid, "start_ticks": self.start_ticks,
                "started_at": self.started_at, "ended_at": self.ended_at, "state": self.state,
                "code": self.code, "signal": self.signal, "reason": self.reason, "oom": self.oom,
                "argv": list(self.spec.argv), "cwd": self.spec.cwd,
                "env": redact_env(self.spec.env, secret)}


def read_error_file(path: Path) -> RankError | None:
    """The exception a rank's ``@record`` wrote (``{"message": {"message": "ValueError: ...",
    "extraInfo": {"py_callstack": "Traceback ..."}}}``, or a newer ``{"message": "..."}``), or None when
    there is none or it is not that JSON. Bounded: a rank decides what the file holds."""
    try:
        with open(path, "rb") as f:
            raw = f.read(ERROR_FILE_MAX + 1)
    except OSError:
        return None
    if len(raw) > ERROR_FILE_MAX:
        return None
    try:
        data = loads_bounded(raw.decode("utf-8", "replace"))
    except ValueError:
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        return {"message": message, "traceback": ""}
    if not isinstance(message, dict) or not isinstance(message.get("message"), str):
        return None
    extra = message.get("extraInfo")
    stack = extra.get("py_callstack") if isinstance(extra, dict) else None
    return {"message": message["message"], "traceback": stack if isinstance(stack, str) else ""}


def signal_name(sig: int | None) -> str:
    if sig is None:
        return ""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
