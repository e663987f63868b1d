"""The store's server: one thread, one selector, torch's wire protocol, only the job's clients.

Every connection is judged the moment it is accepted (``peers.admit``), before a byte of it is read:
a refused one is closed at once and counted, with one line in store.log for the first refusal of each
kind (at most ``LOGGED_KINDS`` kinds: a flood of strangers cannot fill the disk). An admitted one must
begin with torch's VALIDATE; then its queries are carried out in order (``table``) and answered as
torch's servers answer them (``wire``). A query past the limits, or bytes no torch client sends, close
that connection only. The server stops when its stop descriptor (the agent's pipe) reaches EOF.
"""
from __future__ import annotations

import selectors
import socket
import time
from collections import Counter
from typing import Callable, TextIO

from . import wire
from .peers import JobPeers, admit
from .table import Full, Table, Unusable
from .wire import Limits, Query, Request

LOGGED_KINDS = 16
_OUT_HIGH = 64 * 1024 * 1024   # answers a client has not read yet, above which its queries wait
_RECV = 256 * 1024


class Connection:
    """One admitted client: what it sent that is not a whole query yet, and what it has not read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.need = 1            # bytes inbuf must hold before parsing is worth another try
        self.validated = False
        self.open = True


class StoreServer:
    """Serves the store on ``listener`` to the clients ``peers`` admits, until ``stop_fd`` is readable
    and at EOF."""

    def __init__(self, listener: socket.socket, peers: JobPeers, log: TextIO, limits: Limits = Limits()) -> None:
        self.listener, self.peers, self.log, self.limits = listener, peers, log, limits
        self.table: Table[Connection] = Table(limits)
        self.refused: Counter[str] = Counter()
        self.closed: Counter[str] = Counter()
        self.admitted = 0
        self.selector = selectors.DefaultSelector()
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ, None)

    # -- the loop ------------------------------------------------------------------------------
    def serve(self, stop_fd: int, read_stop: Callable[[int], bytes]) -> None:
        """Until ``read_stop(stop_fd)`` answers EOF (b"")."""
        self.selector.register(stop_fd, selectors.EVENT_READ, "stop")
        try:
            while True:
                for key, events in self.selector.select():
                    if key.data == "stop":
                        if not read_stop(stop_fd):
                            return
                    elif key.data is None:
                        self._accept()
                    else:
                        self._ready(key.data, events)
        finally:
            self.selector.unregister(stop_fd)

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            if isinstance(key.data, Connection):
                self._close(key.data)
        self.selector.close()
        self.listener.close()

    def summary(self) -> str:
        refused = ", ".join(f"{n} from {kind}" for kind, n in self.refused.most_common()) or "none"
        return f"admitted {self.admitted} connection(s); refused: {refused}"

    def _note(self, counter: Counter[str], kind: str, line: str) -> None:
        """One line per kind, for the first LOGGED_KINDS kinds; every one counted."""
        counter[kind] += 1
        if counter[kind] == 1 and len(counter) <= LOGGED_KINDS:
            print(line if len(counter) < LOGGED_KINDS else f"{line} (further kinds are only counted)",
                  file=self.log, flush=True)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:   # ECONNABORTED, EMFILE: this one is lost, the store goes on
                self._note(self.closed, "accept", f"could not accept a connection: {exc.strerror or exc}")
                time.sleep(0.05)   # the listener stays readable: no busy loop while descriptors run out
                return
            try:
                verdict = admit(sock, self.peers)
            except OSError:   # gone before it could be judged
                sock.close()
                continue
            if not verdict.admitted:
                self._note(self.refused, verdict.kind, f"refused a connection from {verdict.kind}")
                sock.close()
                continue
            self.admitted += 1
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock)
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def _ready(self, conn: Connection, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
            if conn.open and conn.inbuf and len(conn.outbuf) < _OUT_HIGH:
                self._run(conn)   # queries held back while its answers were pending
        if conn.open and events & selectors.EVENT_READ:
            try:
                data = conn.sock.recv(_RECV)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._close(conn)
                return
            conn.inbuf += data
            self._run(conn)

    def _run(self, conn: Connection) -> None:
        """Carry out every whole query in the connection's buffer, in order."""
        while conn.open and len(conn.inbuf) >= conn.need and len(conn.outbuf) < _OUT_HIGH:
            try:
                request = wire.parse(conn.inbuf, self.limits)
            except wire.Incomplete as more:
                conn.need = more.need
                if more.need > self.limits.query_bytes:
                    self._drop(conn, f"a query of more than {self.limits.query_bytes} bytes")
                return
            except wire.Malformed as exc:
                self._drop(conn, str(exc))
                return
            del conn.inbuf[:request.size]
            conn.need = 1
            if not conn.validated and (request.query is not Query.VALIDATE or request.number != wire.MAGIC):
                self._drop(conn, "a client that did not begin with torch's VALIDATE")
                return
            try:
                _HANDLERS[request.query](self, conn, request)
            except (Full, Unusable) as exc:
                self._drop(conn, str(exc))
        self._interest(conn)

    # -- answers -------------------------------------------------------------------------------
    def _reply(self, conn: Connection, data: bytes) -> None:
        if conn.open:
            conn.outbuf += data
            self._flush(conn)

    def _wake(self, clients: list[Connection]) -> None:
        for client in clients:
            self._reply(client, wire.STOP_WAITING)

    def _flush(self, conn: Connection) -> None:
        while conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            del conn.outbuf[:sent]
        self._interest(conn)

    def _interest(self, conn: Connection) -> None:
        """Read while the client reads its answers; write while any are pending."""
        if not conn.open:
            return
        events = selectors.EVENT_WRITE if conn.outbuf else 0
        if len(conn.outbuf) < _OUT_HIGH:
            events |= selectors.EVENT_READ
        if self.selector.get_key(conn.sock).events != events:
            self.selector.modify(conn.sock, events, conn)

    def _drop(self, conn: Connection, why: str) -> None:
        self._note(self.closed, why, f"closed a client's connection: {why}")
        self._close(conn)

    def _close(self, conn: Connection) -> None:
        if not conn.open:
            return
        conn.open = False
        self.table.forget(conn)
        self.selector.unregister(conn.sock)
        conn.sock.close()


# -- one handler per query type: what the table does, and what the client reads back -----------
def _validate(server: StoreServer, conn: Connection, request: Request) -> None:
    conn.validated = True   # its number was checked before (StoreServer._run)


def _ping(server: StoreServer, conn: Connection, request: Request) -> None:
    server._reply(conn, wire.uint32(request.number))


def _set(server: StoreServer, conn: Connection, request: Request) -> None:
    server._wake(server.table.set(request.keys[0], request.values[0]))


def _compare_set(server: StoreServer, conn: Connection, request: Request) -> None:
    answer, woken = server.table.compare_set(request.keys[0], *request.values)
    server._reply(conn, wire.blob(answer))
    server._wake(woken)


def _get(server: StoreServer, conn: Connection, request: Request) -> None:
    server._reply(conn, wire.blob(server.table.get(request.keys[0])))


def _add(server: StoreServer, conn: Connection, request: Request) -> None:
    total, woken = server.table.add(request.keys[0], request.number)
    server._reply(conn, wire.int64(total))
    server._wake(woken)


def _check(server: StoreServer, conn: Connection, request: Request) -> None:
    server._reply(conn, wire.READY if server.table.check(request.keys) else wire.NOT_READY)


def _wait(server: StoreServer, conn: Connection, request: Request) -> None:
    if server.table.wait(request.keys, conn):
        server._reply(conn, wire.STOP_WAITING)


def _num_keys(server: StoreServer, conn: Connection, request: Request) -> None:
    server._reply(conn, wire.int64(len(server.table.keys)))


def _delete(server: StoreServer, conn: Connection, request: Request) -> None:
    server._reply(conn, wire.int64(server.table.delete(request.keys[0])))


def _append(server: StoreServer, conn: Connection, request: Request) -> None:
    server._wake(server.table.append(request.keys[0], request.values[0]))


def _multi_get(server: StoreServer, conn: Connection, request: Request) -> None:
    server._reply(conn, b"".join(wire.blob(server.table.get(k)) for k in request.keys))


def _multi_set(server: StoreServer, conn: Connection, request: Request) -> None:
    for key, value in zip(request.keys, request.values):
        server._wake(server.table.set(key, value))


def _cancel_wait(server: StoreServer, conn: Connection, request: Request) -> None:
    server.table.forget(conn)
    server._reply(conn, wire.WAIT_CANCELED)


def _queue_push(server: StoreServer, conn: Connection, request: Request) -> None:
    server._wake(server.table.queue_push(request.keys[0], request.values[0]))


def _queue_pop(server: StoreServer, conn: Connection, request: Request) -> None:
    length, value = server.table.queue_pop(request.keys[0])
    server._reply(conn, wire.int64(length) + (wire.blob(value) if value is not None else b""))


def _queue_len(server: StoreServer, conn: Connection, request: Request) -> None:
    server._reply(conn, wire.int64(server.table.queue_len(request.keys[0])))


def _list_keys(server: StoreServer, conn: Connection, request: Request) -> None:
    keys = list(server.table.keys)
    server._reply(conn, wire.int64(len(keys)) + b"".join(wire.blob(k) for k in keys))


def _barrier(server: StoreServer, conn: Connection, request: Request) -> None:
    done, woken = server.table.barrier(request.keys[0], request.number, conn)
    server._wake(woken)
    if done:
        server._reply(conn, wire.STOP_WAITING)


_HANDLERS: dict[Query, Callable[[StoreServer, Connection, Request], None]] = {
    Query.VALIDATE: _validate, Query.PING: _ping, Query.SET: _set, Query.COMPARE_SET: _compare_set,
    Query.GET: _get, Query.ADD: _add, Query.CHECK: _check, Query.WAIT: _wait, Query.GETNUMKEYS: _num_keys,
    Query.DELETE_KEY: _delete, Query.APPEND: _append, Query.MULTI_GET: _multi_get,
    Query.MULTI_SET: _multi_set, Query.CANCEL_WAIT: _cancel_wait, Query.QUEUE_PUSH: _queue_push,
    Query.QUEUE_POP: _queue_pop, Query.QUEUE_LEN: _queue_len, Query.LIST_KEYS: _list_keys,
    Query.BARRIER: _barrier,
}
