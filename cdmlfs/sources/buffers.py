"""Recycled receive buffers for sequential remote reads.

A sequential scan of a large member receives one part (16 MiB) after another,
keeps each in the cache while the reader passes through it, then drops it.
With a fresh allocation per part, every byte received lands on a page the
kernel must first fault in and zero, and glibc hands freed parts back to the
OS soon after: measured on the 2-core CI machine, that was a quarter of the
client CPU of a 1 GiB read from a loopback S3 endpoint. Receiving into buffers
that drop-behind hands back instead costs no page faults after the first few
parts.

Safety rests on one rule: a buffer is reused only when nothing but the pool
refers to it. Readers copy out of cached parts after releasing the block
layer's lock, so a part dropped from the cache may still be in use: its
reference count says so, and such a buffer is simply left to the allocator.

Bound: every spare holds a reservation of its size in the shared cache, so
held + reserved + spares never exceed the cache limit; spares are capped at a
few parts and at an eighth of the cache, and a cache of fewer than 16 parts
keeps none. (A sixteenth, two 16 MiB parts with the default 512 MiB cache, was
too few: a window refill takes two parts at once while drop-behind returns one
at a time, and a 1 GiB scan let 8-13 buffers go and allocated as many fresh
ones; with four, 1-2.)
"""

from __future__ import annotations

import sys
import threading

from cdmlfs import forksafe
from cdmlfs.cache import ExtentCache, Reservation

MAX_SPARES = 4


def _count_when_unshared() -> int:
    """``sys.getrefcount`` of a buffer only ``recycle`` holds, measured the way ``recycle`` measures.

    The count a local variable adds differs between CPython versions (3.14 borrows
    references to locals), so it is measured at import rather than assumed.
    """
    dropped = [bytearray(1)]
    buf = dropped.pop()
    return sys.getrefcount(buf)


UNSHARED = _count_when_unshared()


class BufferPool:
    """Spare ``bytearray`` receive buffers of one size, each with its cache reservation."""

    def __init__(self, cache: ExtentCache, size: int, max_spares: int = MAX_SPARES) -> None:
        self.cache = cache
        self.size = size
        room = cache.limit // 8 // max(size, 1)
        # A cache of fewer than 16 parts keeps none: one spare would be a large share of it.
        self.max_spares = max(0, min(max_spares, room)) if room >= 2 else 0
        self._spares: list[tuple[bytearray, Reservation]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.recycled = 0  # buffers kept for reuse (for tests; reuse is counted by the block layer)
        forksafe.register(self)

    @property
    def enabled(self) -> bool:
        return self.max_spares > 0

    def take(self) -> tuple[bytearray, Reservation] | None:
        """A spare and the reservation that covers it (commit or release it), or None."""
        with self._lock:
            return self._spares.pop() if self._spares else None

    def recycle(self, dropped: list) -> None:
        """Keep buffers from ``dropped`` (emptied) that are unshared, of our size, while there is room."""
        while dropped:
            buf = dropped.pop()
            # More references than ``buf`` alone gives: a reader is still copying out of it.
            if type(buf) is not bytearray or len(buf) != self.size or sys.getrefcount(buf) > UNSHARED:
                continue
            with self._lock:
                if self._closed or len(self._spares) >= self.max_spares:
                    continue
            room = self.cache.hold(self.size, wait=False)
            if room is None:  # the cache is busy with other reservations: let the buffer go
                continue
            with self._lock:
                if not self._closed and len(self._spares) < self.max_spares:
                    self._spares.append((buf, room))
                    self.recycled += 1
                    room = None
            if room is not None:
                room.release()

    def close(self) -> None:
        """Give back every spare and its reservation; keep no more (a read may still be finishing)."""
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, []
        for _, room in spares:
            room.release()

    def _after_fork_child(self) -> None:
        # The child's cache starts with no reservations: ours belong to the parent's accounting.
        self._lock = threading.Lock()
        self._spares = []
