"""A many-producer, one-consumer hand-off that wakes the consumer once per burst, not once per item.

Under a log flood a queue that signals its consumer for every line spends more time switching
threads (and passing the GIL) than moving lines. Here a producer signals only when the box was
empty; the consumer takes everything there is in one go. ``deque.append``/``popleft`` are atomic.
"""
from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._wake = threading.Event()

    def put(self, item: T) -> None:
        self._items.append(item)
        if len(self._items) == 1:   # was empty: the consumer may be asleep
            self._wake.set()

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
