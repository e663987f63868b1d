"""Where a rank's listeners bind, and the job's rendezvous secret.

torch.distributed opens three kinds of listening sockets: rank 0's rendezvous store (TCPStore), every
rank's gloo (or NCCL bootstrap) listener, and every rank's TensorPipe listener when the plan has
parameter servers (RPC, whose messages are unpickled). Left to torch, the store listens on every
interface and gloo/TensorPipe on whatever the host name resolves to. hgtrain narrows them:

* the store listens on ``MASTER_ADDR`` only. Under ``hgtrain launch`` it is the agent's
  (``hgcli.node.store``: hgtrain's own server of torch's protocol, which admits only the job's
  processes); where there is no agent store (a plain torchrun environment, the bench programs) rank 0
  binds that address itself and hands the socket to torch (``master_store``: ``master_listen_fd``),
  because TCPStore has no bind-address option. torch's server admits anyone who reaches it;
* gloo, NCCL and TensorPipe bind to the interface that holds ``HGTRAIN_BIND_ADDR`` (the address the
  launcher knows this rank's node by: 127.0.0.1 for an all-local job), through their own
  ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``/``TP_SOCKET_IFNAME``; a value the user set wins;
* every key of the job lives under a prefix made from ``HGTRAIN_JOB_TOKEN``, a random secret the
  launcher sends each rank inside the spec over SSH, so that two jobs (or a stray client) never mix
  keys. The prefix is no secret against a client that reaches the store: torch's ``list_keys`` names
  every key, the prefix included. What keeps strangers out of the agent's store is its admission of
  peers, not the token; a store of torch's own (rank 0's, above) has neither.

Linux only (interfaces are read with the SIOCGIF* ioctls), like the node agent.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist

BIND_ADDR = "HGTRAIN_BIND_ADDR"
TOKEN = "HGTRAIN_JOB_TOKEN"
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B


def new_token() -> str:
    """128 random bits, hex: one per job, shared by its ranks."""
    return os.urandom(16).hex()


def key_prefix(token: str) -> str:
    """Where the job's keys live in the store ("" without a token: a plain torchrun environment)."""
    return f"hgtrain/{token}/" if token else ""


def resolve(host: str) -> str:
    """``host`` as an IPv4 address (it may be a name, as MASTER_ADDR may)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)


def _ifaddr(sock: socket.socket, name: str, request: int) -> str | None:
    try:
        packed = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:   # no IPv4 address on this interface
        return None
    return socket.inet_ntoa(packed[20:24])


def interface_for(address: str) -> str | None:
    """The interface that holds ``address``; for a loopback address, the interface whose network holds
    it (127.0.0.2 is on ``lo``, which holds 127.0.0.1/8); None when no interface does."""
    wanted = ipaddress.ip_address(resolve(address))
    containing = None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            addr, mask = _ifaddr(sock, name, _SIOCGIFADDR), _ifaddr(sock, name, _SIOCGIFNETMASK)
            if addr is None:
                continue
            if ipaddress.ip_address(addr) == wanted:
                return name
            if wanted.is_loopback and mask and containing is None and wanted in ipaddress.ip_network(f"{addr}/{mask}", strict=False):
                containing = name
    return containing


def pin_interfaces(environ: dict[str, str] | None = None) -> str | None:
    """Point gloo, NCCL and TensorPipe at the interface of ``HGTRAIN_BIND_ADDR`` (a variable the user
    set wins). Returns the interface, None without a bind address; ValueError when no interface of
    this machine holds the address."""
    env = os.environ if environ is None else environ
    address = env.get(BIND_ADDR)
    if not address or all(env.get(var) for var in IFNAME_VARS):
        return None
    iface = interface_for(address)
    if iface is None:
        raise ValueError(f"{BIND_ADDR}={address}: no network interface of {socket.gethostname()} holds "
                         "that address")
    for var in IFNAME_VARS:
        if not env.get(var):
            env[var] = iface
    return iface


def master_store(host: str, port: int, world_size: int, timeout: timedelta, **options: Any) -> "dist.TCPStore":
    """A TCPStore master that listens on ``host`` only (``port`` 0: the kernel picks; ``store.port``
    says which): the socket is bound here and handed over, as TCPStore has no bind address."""
    import torch.distributed as dist

    sock = listen_on(host, port)
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=fd,
                             **options)
    except BaseException:
        os.close(fd)
        raise


def listen_on(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host``:``port`` only (never the wildcard address)."""
    address = resolve(host)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as torch's own store does
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock
