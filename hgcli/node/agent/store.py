"""The job's rendezvous store, hosted beside the ranks by the agent of rank 0's node.

torchrun's agent hosts the TCPStore of its job and tells the ranks so with
``TORCHELASTIC_USE_AGENT_STORE=True``: torch's ``env://`` rendezvous then connects as a client on
every rank instead of rank 0 starting a server. hgtrain does the same, for two reasons torch lacks:
TCPStore has no bind-address option (a store that rank 0 of a plain ``init_process_group()`` script
starts listens on every interface of the node), and it lets in anyone who can connect (its clients
send no secret, and ``list_keys`` shows every key). Here the agent binds the listening socket itself,
on MASTER_ADDR only (the node's cluster address, loopback for an all-local job), at ``prepare`` time,
and holds it until the spec comes: the port cannot be taken in between either. The server is
hgtrain's own (``hgcli.node.store``): it speaks torch's wire protocol to torch's own clients and admits
only the job's processes (this user's on this machine, the job's nodes from elsewhere).

torch's TCPStore is no fallback: it cannot serve on a Unix socket nor check a peer, and a proxy in
front of it would need it on a loopback port every local user can reach; nothing torch's client sends
needs its server (the protocol is small, and every query of torch 2.13's client is served).

The store runs in a child process of its own (``python -S -m hgcli.node.agent.store FD``, the admission
rule as one JSON line on its stdin), not in the agent: a store's memory and a stuck client stay apart
from the supervisor. It imports no torch (its start costs about 0.08 s of CPU where torch's server's
import cost 1.6 to 2.3 s on a 2-core test machine), and starts when the first rank connects. The child serves until the agent kills it after the ranks are gone, or until its stdin (a
pipe from the agent) reaches EOF, which happens when the agent dies: no store outlives its agent. It
carries the job's marker (so 'hgtrain stop' finds it should its agent be gone) but is not in the ranks'
process groups: stopping the ranks leaves it serving until the agent is done.
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ..store.peers import JobPeers
from ...schema.codec import from_dict, to_json

STORE_LOG = "store.log"   # in the job directory: what the child said, read back when it fails
STOP_WAIT_S = 5.0
PACKAGE_ROOT = Path(__file__).resolve().parents[3]   # the directory holding hgcli/: the child's only path


@dataclass(frozen=True)
class StoreSocket:
    """What ``prepare`` leaves for the job's store: its bound, listening socket and who may use it."""

    listener: socket.socket
    peers: JobPeers


@dataclass(frozen=True)
class StoreFailure:
    """How the job's store ended before the job: the supervisor's reason to stop it, named as the cause."""

    code: int | None
    message: str          # "exited with code 1: ModuleNotFoundError: No module named 'torch'"


class StoreHost:
    """The child process that serves the store on ``store.listener`` to ``store.peers``.

    The child is started when the first client connects (the connection waits in the socket's
    backlog meanwhile), not with the job: a job that never rendezvouses (a script without
    torch.distributed) then never has one."""

    def __init__(self, store: StoreSocket) -> None:
        self.listener = listener = store.listener
        self.peers = store.peers
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
            # -S: no site-packages to scan (the child needs only hgcli, on PYTHONPATH)
            popen = subprocess.Popen(
                [sys.executable, "-S", "-m", "hgcli.node.agent.store", str(self.listener.fileno())],
                stdin=subprocess.PIPE, stdout=fd, stderr=fd, pass_fds=(self.listener.fileno(),),
                env={**os.environ, **marker, "PYTHONPATH": str(PACKAGE_ROOT)},
                start_new_session=True)   # never gets the terminal's signals meant for the agent
        finally:
            os.close(fd)
        assert popen.stdin is not None
        try:   # the pipe holds far more than one line: this never blocks
            popen.stdin.write(to_json(self.peers, indent=None).encode() + b"\n")
            popen.stdin.flush()
        except OSError:   # the child died at once: its exit code and store.log tell why
            pass
        return popen

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


def _read_line(fd: int, limit: int = 1 << 24) -> bytes:
    """The first line on ``fd`` (the agent writes nothing after it: the pipe's EOF is the stop signal)."""
    line = b""
    while not line.endswith(b"\n") and len(line) < limit:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        line += chunk
    return line


def serve(fd: int) -> int:
    """The child: the job's store on the inherited socket, for the peers named on stdin, until stdin closes."""
    from ..store.server import StoreServer

    peers = from_dict(JobPeers, json.loads(_read_line(0) or b"null"))
    listener = socket.socket(fileno=fd)
    host, port = listener.getsockname()[:2]
    server = StoreServer(listener, peers, sys.stdout)
    nodes = ", ".join(peers.addresses) or "none"
    print(f"serving the job's store on {host}:{port} to uid {peers.uid} here and nodes {nodes}", flush=True)
    try:
        server.serve(0, lambda stop: os.read(stop, 4096))   # EOF: the agent is done with the job, or gone
    finally:
        print(server.summary(), flush=True)
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(serve(int(sys.argv[1])))
