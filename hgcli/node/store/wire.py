"""torch's TCPStore wire protocol, as torch 2.13's client speaks it (both its libuv and classic paths).

Read from torch's sources (``torch/csrc/distributed/c10d/TCPStore.cpp``, the client, and
``TCPStoreBackend.hpp``/``TCPStoreLibUvBackend.cpp``, the server), not copied: a query is one byte
(its ``Query`` number), then its fields; a string or value is a ``uint64`` length and its bytes, a
count a ``uint64``, a number an ``int64``, a nonce a ``uint32``. Integers are in the host's byte order,
as torch writes them (``memcpy`` of the value): every node of a job shares it.

Parsing is incremental: ``parse`` reads one query from the front of a connection's buffer, or raises
``Incomplete`` with the size the buffer must reach before another try is worth it, so a value that
arrives in many reads is not parsed again for every one of them.
"""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAGIC = 0x3C85F7CE   # VALIDATE's number: the first query of every torch client
_U64, _I64, _U32 = struct.Struct("=Q"), struct.Struct("=q"), struct.Struct("=I")


class Query(enum.IntEnum):
    """The query types, numbered as torch's ``QueryType`` (their order is the protocol)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


READY, NOT_READY = b"\x00", b"\x01"             # CHECK's answer
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"   # WAIT's and BARRIER's answers, and CANCEL_WAIT's


@dataclass(frozen=True)
class Limits:
    """What one query may carry: torch's own libuv server refuses the same key length, value size and
    key count, so no client of torch's sends more; the store's totals bound what all clients together
    make it hold (a job's rendezvous holds a few kilobytes per rank)."""

    key_bytes: int = 8 * 1024
    value_bytes: int = 8 * 1024 * 1024
    keys_per_query: int = 128 * 1024
    query_bytes: int = 256 * 1024 * 1024  # one query (MULTI_SET's values together)
    stored_keys: int = 1_000_000          # keys and queue items
    stored_bytes: int = 1024 * 1024 * 1024


class Incomplete(Exception):
    """The buffer holds only part of a query: parse again once it holds ``need`` bytes."""

    def __init__(self, need: int) -> None:
        super().__init__(need)
        self.need = need


class Malformed(Exception):
    """Bytes no torch client sends (an unknown query, a field over the limits): the connection is closed."""


@dataclass(frozen=True)
class Request:
    """One parsed query: its keys and values in the order sent; ``number``: ADD's and BARRIER's
    int64, PING's and VALIDATE's uint32; ``size``: the bytes it took from the buffer."""

    query: Query
    keys: tuple[bytes, ...] = ()
    values: tuple[bytes, ...] = ()
    number: int = 0
    size: int = 0


class _Reader:
    """A cursor over a buffer that raises Incomplete where the buffer ends and Malformed past a limit."""

    def __init__(self, buf: bytes | bytearray | memoryview, limits: Limits) -> None:
        self.buf, self.pos, self.limits = memoryview(buf), 0, limits

    def _take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise Incomplete(end)
        part = self.buf[self.pos:end]
        self.pos = end
        return part

    def u64(self) -> int:
        return int(_U64.unpack(self._take(8))[0])

    def i64(self) -> int:
        return int(_I64.unpack(self._take(8))[0])

    def u32(self) -> int:
        return int(_U32.unpack(self._take(4))[0])

    def blob(self, limit: int, what: str) -> bytes:
        n = self.u64()
        if n > limit:
            raise Malformed(f"a {what} of {n} bytes (at most {limit})")
        return bytes(self._take(n))

    def key(self) -> bytes:
        return self.blob(self.limits.key_bytes, "key")

    def value(self) -> bytes:
        return self.blob(self.limits.value_bytes, "value")

    def count(self) -> int:
        n = self.u64()
        if n > self.limits.keys_per_query:
            raise Malformed(f"{n} keys in one query (at most {self.limits.keys_per_query})")
        return n


def _keys(r: _Reader, query: Query) -> Request:
    return Request(query, keys=tuple(r.key() for _ in range(r.count())))


def _key(r: _Reader, query: Query) -> Request:
    return Request(query, keys=(r.key(),))


def _key_value(r: _Reader, query: Query) -> Request:
    key = r.key()
    return Request(query, keys=(key,), values=(r.value(),))


def _key_number(r: _Reader, query: Query) -> Request:
    key = r.key()
    return Request(query, keys=(key,), number=r.i64())


def _compare_set(r: _Reader, query: Query) -> Request:
    key = r.key()
    expected = r.value()
    return Request(query, keys=(key,), values=(expected, r.value()))


def _multi_set(r: _Reader, query: Query) -> Request:
    keys, values = [], []
    for _ in range(r.count()):
        keys.append(r.key())
        values.append(r.value())
    return Request(query, keys=tuple(keys), values=tuple(values))


def _nonce(r: _Reader, query: Query) -> Request:
    return Request(query, number=r.u32())


def _bare(r: _Reader, query: Query) -> Request:
    return Request(query)


# What follows each query's byte: the client's SendBuffer calls, field by field.
_FIELDS = {
    Query.VALIDATE: _nonce, Query.PING: _nonce,
    Query.SET: _key_value, Query.APPEND: _key_value, Query.QUEUE_PUSH: _key_value,
    Query.COMPARE_SET: _compare_set, Query.MULTI_SET: _multi_set,
    Query.GET: _key, Query.DELETE_KEY: _key, Query.QUEUE_POP: _key, Query.QUEUE_LEN: _key,
    Query.ADD: _key_number, Query.BARRIER: _key_number,
    Query.CHECK: _keys, Query.WAIT: _keys, Query.MULTI_GET: _keys,
    Query.GETNUMKEYS: _bare, Query.CANCEL_WAIT: _bare, Query.LIST_KEYS: _bare,
}


def parse(buf: bytes | bytearray | memoryview, limits: Limits) -> Request:
    """The query at the front of ``buf``; Incomplete or Malformed."""
    reader = _Reader(buf, limits)
    (code,) = reader._take(1)
    try:
        query = Query(code)
    except ValueError:
        raise Malformed(f"unknown query type {code}") from None
    request = _FIELDS[query](reader, query)
    return Request(request.query, request.keys, request.values, request.number, reader.pos)


def int64(value: int) -> bytes:
    return _I64.pack(value)


def uint32(value: int) -> bytes:
    return _U32.pack(value)


def blob(value: bytes) -> bytes:
    """A value or key as an answer carries it: its length, then its bytes."""
    return _U64.pack(len(value)) + value
