"""A many-producer, one-consumer hand-off that wakes the consumer once per burst, not once per item.

Under a log flood a queue that signals its consumer for every line spends more time switching
threads (and passing the GIL) than moving lines. Here a producer signals only when the box was
empty; the consumer takes everything there is in one go. ``deque.append``/``popleft`` are atomic.

With ``limit_bytes``, producers that say what an item weighs (``put(item, size)``) wait while the
consumer holds that many bytes it has not ``release``d yet: the box is bounded, and a producer
reading from a connection stops reading (the sender keeps the rest) until there is room.
"""
from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """The hand-off from many reader threads to one consumer: one wake-up per burst, optionally
    bounded by the bytes the consumer has not released (module docstring)."""

    def __init__(self, limit_bytes: int = 0) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._wake = threading.Event()
        self._limit = limit_bytes
        self._held = 0
        self._room = threading.Condition()
        self._unbounded = False   # unblock(): nobody consumes any more, producers must not wait

    def put(self, item: T, size: int = 0) -> None:
        if size and self._limit:
            with self._room:
                while self._held >= self._limit and not self._unbounded:
                    self._room.wait(0.5)
                self._held += size
        self._items.append(item)
        if len(self._items) == 1:   # was empty: the consumer may be asleep
            self._wake.set()

    def release(self, size: int) -> None:
        """The consumer is done with ``size`` bytes of what it took: room for the producers."""
        if size and self._limit:
            with self._room:
                self._held -= size
                self._room.notify_all()

    def unblock(self) -> None:
        """The consumer is gone: producers never wait again."""
        with self._room:
            self._unbounded = True
            self._room.notify_all()

    def __len__(self) -> int:
        return len(self._items)

    def take(self, timeout: float | None) -> list[T]:
        """Everything queued, waiting up to ``timeout`` for the first item; [] when none came.

        A put racing with the consumer going to sleep is never lost, only seen at the next wake or
        timeout: the consumer clears the signal before it empties the box."""
        if not self._items:
            self._wake.wait(timeout)
        self._wake.clear()
        items = []
        pop = self._items.popleft
        try:
            while True:
                items.append(pop())
        except IndexError:
            return items
