"""Node-side preparation before a job's spec: the plan file, and a free port for rank 0.

The agent's first exchange with the launcher (docs/agent.md): the launcher sends
``{"type": "prepare", "job_id", "node", "jobs_root", "plan": "<plan JSON>", "port": true|false,
"checkpoints": DIR|null}`` as the first line of the agent's stdin, and the agent answers
``{"type": "prepared", "job_dir", "plan", "port", "checkpoints", "snapshots"}`` before it reads its spec. It is part of the agent, not a program of its own, so a launch starts one
Python per node instead of two.

The plan is written to ``<jobs root>/<job>/<node>/plan.json`` (the agent's job directory, created here
0700; the spec that follows is accepted because the directory holds no ``agent.json`` yet), so
``HGTRAIN_PLAN`` points at a file on the node itself. With ``port`` this node's kernel is asked for a
free TCP port for ``MASTER_PORT``: a port free on the controller says nothing about rank 0's node.
With an ``address`` too (MASTER_ADDR) the agent binds that port on that address at once and keeps the
socket: the job's store is served on it (``store.py``), so no other process can take the port before
the ranks start. ``peers`` (with ``address``) lists the addresses of the job's other nodes, whose ranks
the store admits (resolved here, where they connect from); ``controller_peer``: the job also has
ranks on the launcher's own machine (a ``localhost`` node), which connect from the address this node's
SSH connection comes from. Without one the port is only picked (below the ephemeral range, where no outgoing
connection lands: hgcli.node.ports) and released, for rank 0 to bind a moment later.
With ``checkpoints`` (a restart of a job with PS ranks) it lists the PS checkpoint versions each shard
has a file of in that directory (shard -> versions, else null): PS shards on different nodes each keep
their own files, so only the launcher, from every node's list, can tell which version is complete.
It also lists the steps of the all-reduce snapshots there (``runtime/snapshot.py``), of which the
launcher resumes the newest any node has.
"""
from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path
from typing import Any

from .spec import DEFAULT_JOBS_ROOT, job_dir
from .store import StoreSocket
from ..store.peers import JobPeers
from ..ports import TRIES, free_port
from ..protocol import FrameType, PreparedFrame
from ...state import ensure_private_dir, write_private

PLAN_FILE = "plan.json"


def prepare(request: dict[str, Any]) -> tuple[PreparedFrame, StoreSocket | None]:
    """Write the plan, find the port; the ``prepared`` answer, and the listening socket of the job's
    store when the request named its address. ValueError for a bad request, an address this node
    cannot bind or a peer it cannot resolve, StateError when the directory or file cannot be written."""
    plan = request.get("plan")
    if not isinstance(plan, str):
        raise ValueError("the prepare request has no plan")
    json.loads(plan)
    path = job_dir(str(request.get("jobs_root") or DEFAULT_JOBS_ROOT), str(request.get("job_id")),
                   str(request.get("node")))
    ensure_private_dir(path.parent)
    ensure_private_dir(path)
    write_private(path / PLAN_FILE, plan)
    checkpoints = request.get("checkpoints")
    listed: dict[int, list[int]] | None = None
    steps: list[int] | None = None
    if checkpoints:
        from ...runtime.ps.files import versions_by_shard   # only on restarts: keeps start-up short
        from ...runtime.snapshot import steps_in              # (neither imports torch)
        listed = versions_by_shard(Path(str(checkpoints)))
        steps = steps_in(Path(str(checkpoints)))
    store, port = None, None
    address = request.get("address")
    if request.get("port") and isinstance(address, str) and address:
        peers = store_peers(request.get("peers"), bool(request.get("controller_peer")))
        store = StoreSocket(store_listener(address), peers)
        port = store.listener.getsockname()[1]
    elif request.get("port"):
        port = free_port()
    return ({"type": FrameType.PREPARED, "job_dir": str(path), "plan": str(path / PLAN_FILE),
             "port": port, "checkpoints": listed, "snapshots": steps}, store)


def store_peers(names: Any, controller: bool) -> JobPeers:
    """Who may use the store: this user's processes here, and the IPv4 addresses of ``names`` (the
    other nodes' hosts) and, with ``controller``, of the machine this node's SSH connection comes
    from. ValueError naming a host this node cannot resolve: its ranks could not get in."""
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError("the prepare request's peers must be a list of host names")
    addresses: set[str] = set()
    for name in names or ():
        try:
            addresses.update(socket.gethostbyname_ex(name)[2])
        except OSError as exc:
            raise ValueError(f"cannot resolve the job's node {name!r} on this node ({exc.strerror or exc}): "
                             "its ranks could not use the job's store") from None
    client = os.environ.get("SSH_CONNECTION", "").split()
    if controller and client:
        addresses.add(client[0])
    return JobPeers(uid=os.geteuid(), addresses=tuple(sorted(addresses)))


def store_listener(address: str) -> socket.socket:
    """A socket listening on ``address`` only, at a port ``free_port`` picks; ValueError naming the
    address when this node holds no such address."""
    from ...runtime.netbind import listen_on

    for _ in range(TRIES):
        try:
            return listen_on(address, free_port(address))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:   # taken since it was picked: pick again
                raise ValueError(f"cannot listen on MASTER_ADDR {address} on this node: "
                                 f"{exc.strerror or exc}") from None
    raise ValueError(f"no free port on {address} after {TRIES} tries")
