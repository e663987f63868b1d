"""What the job's store holds, and who waits for what: the server's semantics, without sockets.

The rules are those of torch's own servers, as torch 2.13's client relies on them: a WAIT is answered
once every key it names exists (a key, or a queue with an item), and a SET, ADD, APPEND, COMPARE_SET
that writes, MULTI_SET or completed BARRIER of a key wakes every waiter of it, while a QUEUE_PUSH wakes
one; ADD keeps its number as decimal text (so GET reads ``b"3"``); COMPARE_SET writes when the key
holds ``expected``, or is missing and ``expected`` is empty, and answers the value the key holds
afterwards (``expected`` itself when it is missing). One difference, on purpose: torch's libuv server
also wakes waiters on a COMPARE_SET that wrote nothing to a missing key, which would answer a WAIT for
a key that does not exist; here only a write wakes.

A client is any hashable object (the server's connection); the methods that wake return the clients
whose wait ended, for the server to answer ``STOP_WAITING``.
"""
from __future__ import annotations

from collections import deque
from typing import Generic, Hashable, TypeVar

from .wire import Limits

_INT64 = (-(1 << 63), (1 << 63) - 1)
C = TypeVar("C", bound=Hashable)   # a client: the server's connection


class Full(Exception):
    """A write would take the store past its limits: the client that asked is closed, the store goes on."""


class Unusable(Exception):
    """A query the store cannot carry out on what it holds (ADD to a value that is not a number)."""


class Table(Generic[C]):
    """The keys, the queues and the waiters of one store."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.keys: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque[bytes]] = {}
        self.waiters: dict[bytes, list[C]] = {}   # key -> clients waiting for it, in arrival order
        self.awaited: dict[C, int] = {}           # client -> keys it still waits for
        self.items = 0       # keys plus queued values
        self.bytes = 0       # their keys' and values' bytes

    # -- accounting ----------------------------------------------------------------------------
    def _charge(self, items: int, size: int) -> None:
        if self.items + items > self.limits.stored_keys:
            raise Full(f"more than {self.limits.stored_keys} keys and queued values")
        if self.bytes + size > self.limits.stored_bytes:
            raise Full(f"more than {self.limits.stored_bytes} bytes")
        self.items += items
        self.bytes += size

    def _store(self, key: bytes, value: bytes) -> None:
        old = self.keys.get(key)
        if old is None:
            self._charge(1, len(key) + len(value))
        else:
            self._charge(0, len(value) - len(old))
        self.keys[key] = value

    def _write(self, key: bytes, value: bytes) -> list[C]:
        self._store(key, value)
        return self._wake(key)

    def _count(self, key: bytes, delta: int) -> int:
        """The key's number plus ``delta``, stored as decimal text (waking no one)."""
        old = self.keys.get(key)
        try:
            total = delta + (int(old.decode("ascii")) if old is not None else 0)
        except ValueError:
            raise Unusable("ADD to a key whose value is not a number") from None
        if not _INT64[0] <= total <= _INT64[1]:
            raise Unusable("ADD past the range of a 64-bit integer")
        self._store(key, str(total).encode())
        return total

    def ready(self, key: bytes) -> bool:
        return key in self.keys or bool(self.queues.get(key))

    # -- waiting -------------------------------------------------------------------------------
    def _wake(self, key: bytes, only_one: bool = False) -> list[C]:
        woken: list[C] = []
        waiting = self.waiters.get(key, [])
        while waiting and not (only_one and woken):
            client = waiting.pop(0)
            left = self.awaited.get(client, 0) - 1
            if left > 0:
                self.awaited[client] = left
                continue
            self.awaited.pop(client, None)
            woken.append(client)
        if not waiting:
            self.waiters.pop(key, None)
        return woken

    def wait(self, keys: tuple[bytes, ...], client: C) -> bool:
        """True when every key is there now; else the client waits (one wait per client: a new one
        replaces what is left of the last)."""
        self.forget(client)
        missing = {k for k in keys if not self.ready(k)}
        for key in missing:
            self.waiters.setdefault(key, []).append(client)
        if missing:
            self.awaited[client] = len(missing)
        return not missing

    def forget(self, client: C) -> None:
        """The client stops waiting (CANCEL_WAIT, or its connection closed)."""
        if self.awaited.pop(client, None) is None:
            return
        for key in [k for k, clients in self.waiters.items() if client in clients]:
            self.waiters[key] = [c for c in self.waiters[key] if c != client]
            if not self.waiters[key]:
                del self.waiters[key]

    # -- keys ----------------------------------------------------------------------------------
    def set(self, key: bytes, value: bytes) -> list[C]:
        return self._write(key, value)

    def get(self, key: bytes) -> bytes:
        return self.keys.get(key, b"")

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> tuple[bytes, list[C]]:
        current = self.keys.get(key)
        if current is None and expected:
            return expected, []
        if current is not None and current != expected:
            return current, []
        return desired, self._write(key, desired)

    def add(self, key: bytes, delta: int) -> tuple[int, list[C]]:
        total = self._count(key, delta)
        return total, self._wake(key)

    def append(self, key: bytes, value: bytes) -> list[C]:
        return self._write(key, self.keys.get(key, b"") + value)

    def delete(self, key: bytes) -> int:
        value = self.keys.pop(key, None)
        if value is None:
            return 0
        self.items -= 1
        self.bytes -= len(key) + len(value)
        return 1

    def check(self, keys: tuple[bytes, ...]) -> bool:
        return all(self.ready(k) for k in keys)

    def barrier(self, key: bytes, world_size: int, client: C) -> tuple[bool, list[C]]:
        """Count the client in; True (and the earlier arrivals woken) once ``world_size`` are."""
        arrived = self._count(key, 1)
        if arrived >= world_size:
            return True, self._wake(key)
        self.forget(client)
        self.waiters.setdefault(key, []).append(client)
        self.awaited[client] = 1
        return False, []

    # -- queues --------------------------------------------------------------------------------
    def queue_push(self, key: bytes, value: bytes) -> list[C]:
        self._charge(1, len(key) + len(value))
        self.queues.setdefault(key, deque()).append(value)
        return self._wake(key, only_one=True)

    def queue_pop(self, key: bytes) -> tuple[int, bytes | None]:
        """The queue's length before the pop, and its first value (None when it was empty)."""
        queue = self.queues.get(key)
        if not queue:
            return 0, None
        length, value = len(queue), queue.popleft()
        self.items -= 1
        self.bytes -= len(key) + len(value)
        if not queue:
            del self.queues[key]
        return length, value

    def queue_len(self, key: bytes) -> int:
        return len(self.queues.get(key, ()))
