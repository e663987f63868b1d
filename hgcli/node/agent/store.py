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
the store's C++ cannot take the supervisor with it. The child serves until its stdin reaches EOF,
which happens when the agent closes the pipe at the end of the job or dies: no store outlives its
agent. It carries the job's marker (so 'hgtrain stop' finds it should its agent be gone) but is
not in the ranks' process groups: stopping the ranks leaves it serving until the agent is done.
"""
from __future__ import annotations

import os
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
    code: int | None
    message: str          # "exited with code 1: ModuleNotFoundError: No module named 'torch'"


class StoreHost:
    """The child process that serves the store on ``listener`` (a bound, listening socket)."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        host, port = listener.getsockname()[:2]
        self.address = f"{host}:{port}"   # "127.0.0.1:29500"
        self.popen: subprocess.Popen[bytes] | None = None
        self.log: Path | None = None
        self.stopping = False

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def start(self, job_dir: Path, marker: Mapping[str, str], on_exit: Callable[[StoreFailure], None]) -> None:
        """Start serving, the child carrying the job's ``marker``; OSError when it cannot start.
        ``on_exit`` is called (from a waiter thread) if it ends before ``stop``."""
        self.log = job_dir / STORE_LOG
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "hgcli.node.agent.store", str(self.listener.fileno())],
                stdin=subprocess.PIPE, stdout=fd, stderr=fd, pass_fds=(self.listener.fileno(),),
                env={**os.environ, **marker},
                start_new_session=True)   # never gets the terminal's signals meant for the agent
        finally:
            os.close(fd)
        self.listener.close()   # the child holds it now
        threading.Thread(target=self._wait, args=(on_exit,), name="store", daemon=True).start()

    def _wait(self, on_exit: Callable[[StoreFailure], None]) -> None:
        assert self.popen is not None
        code = self.popen.wait()
        if not self.stopping:
            on_exit(StoreFailure(code, f"exited with code {code}: {self._last_line()}"))

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
        graceful end; a child still importing torch would otherwise finish that first)."""
        self.stopping = True
        if self.popen is None:
            self.listener.close()
            return
        self.popen.kill()
        try:
            self.popen.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:   # uninterruptible sleep: nothing more to do from here
            pass
        if self.popen.stdin is not None:
            self.popen.stdin.close()


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
