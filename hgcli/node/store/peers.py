"""Who may use the job's store: the job's own processes, told apart by what the kernel knows.

torch's clients send no secret (their first query is VALIDATE with a fixed number), so the store cannot
ask a client who it is; it asks the kernel instead, once per connection, before reading a byte:

* a client on this machine (its socket is in this machine's TCP table) is admitted when the socket
  belongs to the job's user (the agent's effective uid); another user's process is not, whatever it
  sends. The socket is looked up by its four-tuple through sock_diag netlink, exactly, or, where the
  kernel lacks it, in ``/proc/net/tcp``;
* a client from another machine is admitted when its address is one of the job's nodes' (resolved on
  this node from the launcher's list): the cluster network is trusted for the store as it is for gloo,
  so another user on a node of the job still gets in (docs/security.md).

The lookup of the store's own end of the connection tells whether the table could be read at all:
when even that is missing, nobody is admitted rather than everybody.
"""
from __future__ import annotations

import errno
import socket
import struct
from dataclasses import dataclass

Address = tuple[str, int]
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLMSG_ERROR = 4, 20, 1, 2
_TCP_LISTEN = 10
_NO_COOKIE = 0xFFFFFFFF
_UID_AT = 16 + 4 + 48 + 12   # nlmsghdr, then inet_diag_msg: family/state/timer/retrans, id, expires/rqueue/wqueue


@dataclass(frozen=True)
class JobPeers:
    """The store's admission rule, carried from the agent to the store's process (JSON on its stdin)."""

    uid: int                            # the job's user: a client on this machine must be this uid's
    addresses: tuple[str, ...] = ()     # IPv4 addresses of the job's nodes, for clients from elsewhere


@dataclass(frozen=True)
class Verdict:
    """Whether a connection may use the store, and the kind of peer it came from (for store.log)."""

    admitted: bool
    kind: str      # "a process of uid 1001 on this machine", "10.0.0.9, not a node of the job", ...


def _sock_id(local: Address, remote: Address) -> bytes:
    """inet_diag_sockid of the socket whose own end is ``local``: ports and addresses in network
    order, no interface, no cookie."""
    return (struct.pack("!HH", local[1], remote[1]) + socket.inet_aton(local[0]) + bytes(12)
            + socket.inet_aton(remote[0]) + bytes(12) + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE))


def diag_owner(local: Address, remote: Address) -> int | None:
    """The uid of the TCP socket of this machine whose ends are ``local`` and ``remote``, asked of the
    kernel by its exact four-tuple (sock_diag); None when it has none. OSError when sock_diag cannot
    answer (no inet_diag in this kernel, or refused here)."""
    sock_id = _sock_id(local, remote)
    body = struct.pack("=BBBBI", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sock_id
    request = struct.pack("=IHHII", 16 + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + body
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.send(request)
        answer = nl.recv(65536)
    kind = struct.unpack_from("=H", answer, 4)[0]
    if kind == _NLMSG_ERROR:
        code = -struct.unpack_from("=i", answer, 16)[0]
        if code == errno.ENOENT:
            return None
        raise OSError(code, f"sock_diag: {errno.errorcode.get(code, code)}")
    # The kernel's exact lookup falls back to a listening socket on the port: only the connection counts.
    if kind != _SOCK_DIAG_BY_FAMILY or answer[17] == _TCP_LISTEN or _ends(answer[20:56]) != _ends(sock_id[:36]):
        return None
    return int(struct.unpack_from("=I", answer, _UID_AT)[0])


def _ipv4(address: bytes) -> bytes:
    """A sockid's 16-byte address as IPv4: torch's clients use IPv6 sockets, which reach an IPv4
    store as ::ffff:a.b.c.d, and the kernel reports them so."""
    return address[12:] if address[:12] == _MAPPED else address[:4]


def _ends(sock_id: bytes) -> tuple[bytes, bytes, bytes]:
    return sock_id[:4], _ipv4(sock_id[4:20]), _ipv4(sock_id[20:36])


_MAPPED = bytes(10) + b"\xff\xff"


def _hex(address: Address, mapped: bool) -> str:
    """An address as /proc/net/tcp (or, ``mapped`` as ::ffff:a.b.c.d, tcp6) prints it: the address's
    32-bit words as host-order numbers, then the port."""
    raw = (_MAPPED if mapped else b"") + socket.inet_aton(address[0])
    return "".join(f"{w:08X}" for w in struct.unpack(f"={len(raw) // 4}I", raw)) + f":{address[1]:04X}"


def proc_owner(local: Address, remote: Address, tables: tuple[str, str] = ("/proc/net/tcp", "/proc/net/tcp6")) -> int | None:
    """``diag_owner`` from the text tables, for kernels without sock_diag (a scan of every socket)."""
    for table, mapped in zip(tables, (False, True)):
        wanted = (_hex(local, mapped), _hex(remote, mapped))
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)   # the header line
                for line in f:
                    fields = line.split()
                    if len(fields) > 7 and (fields[1], fields[2]) == wanted:
                        return int(fields[7])
        except FileNotFoundError:   # no IPv6 in this kernel
            continue
    return None


def owners(me: Address, peer: Address) -> tuple[int | None, int | None]:
    """The uids of the connection's two sockets on this machine (the peer's, the store's own), None
    for one it has not; sock_diag where it answers, else /proc/net/tcp."""
    try:
        found = diag_owner(peer, me), diag_owner(me, peer)
        if found[1] is not None:
            return found
    except OSError:
        pass
    return proc_owner(peer, me), proc_owner(me, peer)


def admit(conn: socket.socket, peers: JobPeers) -> Verdict:
    """Whether ``conn`` (a just accepted connection) comes from the job's own processes."""
    me, peer = conn.getsockname()[:2], conn.getpeername()[:2]
    try:
        theirs, ours = owners(me, peer)
    except OSError as exc:
        return Verdict(False, f"{peer[0]}, whose socket could not be looked up ({exc.strerror or exc})")
    return judge(peer[0], theirs, ours, peers)


def judge(address: str, theirs: int | None, ours: int | None, peers: JobPeers) -> Verdict:
    """The rule, given what the kernel said: ``theirs``/``ours`` are the owners of the peer's and the
    store's socket of the connection on this machine (None: not in its TCP table)."""
    if theirs is not None:
        return Verdict(theirs == peers.uid, f"a process of uid {theirs} on this machine")
    if ours is None:
        return Verdict(False, f"{address}, not in this machine's TCP table, nor the store's own end")
    if address in peers.addresses:
        return Verdict(True, f"node {address} of the job")
    return Verdict(False, f"{address}, not a node of the job")
