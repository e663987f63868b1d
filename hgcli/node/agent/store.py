"""The job's rendezvous store, hosted beside the ranks by the agent of rank 0's node.

torchrun's agent hosts the TCPStore of its job and tells the ranks so with
``TORCHELASTIC_USE_AGENT_STORE=True``: torch's ``env://`` rendezvous then connects as a client on
every rank instead of rank 0 starting a server. hgtrain does the same, for one reason torch lacks:
TCPStore has no bind-address option, so a store that rank 0 of a plain ``init_process_group()``
script starts listens on every interface of the node. Here the agent binds the listening socket
itself, on MASTER_ADDR only (the node's cluster address, loopback for an all-local job), at
``prepare`` time, and holds it until the spec comes: the port cannot be taken in between either.

The store runs in a child process of its own (``python -m hgcli.node.agent.store FD``), not in the
agent: the agent stays free of torch (its start-up is on every launch's critical path) and a crash in
the store's C++ cannot take the supervisor with it. It is started when the first rank connects. The
child serves until the agent kills it after the ranks are gone, or until its stdin (a pipe from the
agent) reaches EOF, which happens when the agent dies: no store outlives its agent. It carries the
job's marker (so 'hgtrain stop' finds it should its agent be gone) but is not in the ranks'
process groups: stopping the ranks leaves it serving until the agent is done.
"""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

STORE_LOG = "store.log"   # in the job directory: what the child said, read back when it fails
STOP_WAIT_S = 5.0


@dataclass(frozen=True)
class StoreFailure:
    """How the job's store ended before the job: the supervisor's reason to stop it, named as the cause."""

    code: int | None
    message: str          # "exited with code 1: ModuleNotFoundError: No module named 'torch'"


class StoreHost:
    """The child process that serves the store on ``listener`` (a bound, listening socket).

    The child is started when the first client connects (the connection waits in the socket's
    backlog meanwhile), not with the job: its import of torch costs a second of CPU on a small node,
    which a job that never rendezvouses (a script without torch.distributed) should not pay while
    its ranks start and run; a job that does pays it once, overlapped with its other ranks' start."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        host, port = listener.getsockname()[:2]
        self.address = f"{host}:{port}"   # "127.0.0.1:29500"
        self.popen: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None
        self.stopping = False
        self._lock = threading.Lock()       # stop() against the watcher starting the child
        self._wake_r, self._wake_w = os.pipe()

    @property
    def pid(self) -> int | None:
        popen = self.popen
        return popen.pid if popen is not None else None

    def start(self, job_dir: Path, marker: Mapping[str, str], on_exit: Callable[[StoreFailure], None]) -> None:
        """Serve from the first connection on, the child carrying the job's ``marker``. ``on_exit``
        is called (from a watcher thread) if the child cannot start or ends before ``stop``."""
        self.log = job_dir / STORE_LOG
        threading.Thread(target=self._watch, args=(marker, on_exit), name="store", daemon=True).start()

    def _watch(self, marker: Mapping[str, str], on_exit: Callable[[StoreFailure], None]) -> None:
        select.select([self.listener.fileno(), self._wake_r], [], [])   # a client, or stop()
        failure: StoreFailure | None = None
        with self._lock:
            if self.stopping:
                return
            try:
                self.popen = self._spawn(marker)
            except OSError as exc:
                failure = StoreFailure(None, f"could not start: {exc.strerror or exc}")
            self.listener.close()   # the child holds it now
        if failure is not None:
            on_exit(failure)
            return
        assert self.popen is not None
        code = self.popen.wait()
        if not self.stopping:
            on_exit(StoreFailure(code, f"exited with code {code}: {self._last_line()}"))

    def _spawn(self, marker: Mapping[str, str]) -> subprocess.Popen[bytes]:
        assert self.log is not None
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "hgcli.node.agent.store", str(self.listener.fileno())],
                stdin=subprocess.PIPE, stdout=fd, stderr=fd, pass_fds=(self.listener.fileno(),),
                env={**os.environ, **marker},
                start_new_session=True)   # never gets the terminal's signals meant for the agent
        finally:
            os.close(fd)

    def _last_line(self) -> str:
        try:
            assert self.log is not None
            with open(self.log, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return "(no output)"
        return lines[-1].strip() if lines else "(no output)"

    def stop(self) -> None:
        """End the child at once (SIGKILL: the ranks are gone, and a store keeps nothing worth a
        graceful end; a child still importing torch would otherwise finish that first); without
        one, close the socket."""
        with self._lock:
            self.stopping = True
            os.write(self._wake_w, b"x")   # a watcher still waiting for the first client gives up
            popen = self.popen
            if popen is None:
                self.listener.close()
                return
        popen.kill()
        try:
            popen.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:   # uninterruptible sleep: nothing more to do from here
            pass
        if popen.stdin is not None:
            popen.stdin.close()


def serve(fd: int) -> int:
    """The child: a TCPStore server on the inherited socket, until stdin closes."""
    import datetime

    import torch.distributed as dist

    with socket.socket(fileno=os.dup(fd)) as sock:
        host, port = sock.getsockname()[:2]
    # wait_for_workers=False: the ranks come and go (torchrun's agent store does the same); the
    # timeout bounds only the server's own operations.
    store = dist.TCPStore(host, port, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60), master_listen_fd=fd)
    print(f"serving the job's store on {host}:{port}", flush=True)
    sys.stdin.buffer.read()   # EOF: the agent is done with the job, or gone
    del store
    return 0


if __name__ == "__main__":
    raise SystemExit(serve(int(sys.argv[1])))
