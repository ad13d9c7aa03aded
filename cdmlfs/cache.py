"""One byte-bounded LRU for every decoded extent, with reservations so the bound is strict.

A plain LRU bounds what it *holds*, but a decoder allocates its output before
the result is inserted: with a full cache, N concurrent decodes would briefly
hold the limit plus N outputs. Decoders therefore ``reserve`` their output
size first; the reservation evicts entries until held + reserved + new fits
the limit, or waits when other reservations already fill it. Held + reserved
never exceeds ``limit``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

from cachetools import Cache, LRUCache

from cdmlfs import forksafe


def _nbytes(value: object) -> int:
    n = getattr(value, "nbytes", None)
    return n if isinstance(n, int) else len(value)  # type: ignore[arg-type]


class CacheStats:
    """Counters for ``cdmlfs stats`` (updated under the cache lock)."""

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.inserted_bytes = 0
        self.evictions = 0
        self.uncacheable = 0


class ExtentCache:
    """Thread-safe LRU of decoded extents, bounded in bytes (values: bytes or objects with ``nbytes``)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError("cache limit must be >= 0")
        self.limit = limit
        self._lru: LRUCache = LRUCache(maxsize=max(limit, 1), getsizeof=_nbytes)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._reserved = 0
        self.stats = CacheStats()
        # Called with the cache lock held after every ``trim_every`` evicted bytes: the daemon
        # returns freed heap pages to the OS there (see daemon._tune_malloc).
        self.trim_hook: Callable[[], object] | None = None
        self.trim_every = max(16 << 20, limit // 8)
        self._evicted_since_trim = 0
        # Called with the cache lock held, with the key of every value that leaves the cache
        # (evicted, discarded, replaced, cleared): the C fast path lets go of its view there.
        self.on_remove: Callable[[Hashable], object] | None = None
        forksafe.register(self)

    def _after_fork_child(self) -> None:
        """A forked child starts with an empty cache and fresh locks.

        A parent thread may have held the lock, or been halfway through an LRU
        update, at the moment of the fork; nothing of that state is trusted.
        """
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._lru = LRUCache(maxsize=max(self.limit, 1), getsizeof=_nbytes)
        self._reserved = 0

    @property
    def held(self) -> int:
        return self._lru.currsize

    @property
    def reserved(self) -> int:
        return self._reserved

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: Hashable):
        with self._lock:
            value = self._lru.get(key)
            if value is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
            return value

    def peek(self, key: Hashable):
        """Look up without counting a hit or miss, nor refreshing recency."""
        with self._lock:
            return self._peek_locked(key)

    def _peek_locked(self, key: Hashable):
        # LRUCache.get and [] move the key to the front: the base class's lookup does not.
        return Cache.__getitem__(self._lru, key) if key in self._lru else None

    def put(self, key: Hashable, value: object) -> bool:
        """Insert (evicting LRU entries); returns False when the value can never fit."""
        size = _nbytes(value)
        with self._lock:
            if size > self.limit - self._reserved:
                self.stats.uncacheable += 1
                return False
            self._evict_locked(size + self._reserved)
            self._store_locked(key, value)
            self.stats.inserted_bytes += size
            return True

    def discard(self, key: Hashable) -> None:
        self.pop(key)

    def pop(self, key: Hashable):
        """Remove and return the value under ``key`` (None if absent), so its owner can reuse it."""
        with self._lock:
            value = self._lru.pop(key, None)
            if value is not None and self.on_remove is not None:
                self.on_remove(key)
            self._room.notify_all()
            return value

    def call_if_held(self, key: Hashable, value: object, fn: Callable[[], object]) -> bool:
        """Run ``fn`` under the cache lock if ``value`` is what the cache holds under ``key``.

        With ``on_remove`` this keeps a mirror of some entries exact: ``fn``
        cannot register a value the cache already let go of.
        """
        with self._lock:
            if key not in self._lru or self._peek_locked(key) is not value:
                return False
            fn()
            return True

    def clear(self) -> None:
        with self._lock:
            keys = list(self._lru) if self.on_remove is not None else []
            self._lru.clear()
            for key in keys:
                self.on_remove(key)  # type: ignore[misc]
            self._room.notify_all()

    @contextmanager
    def reserve(self, nbytes: int) -> Iterator[Reservation]:
        """Hold room for ``nbytes`` about to be allocated by a decoder.

        Evicts as needed; blocks while other reservations fill the cache. The
        decoder hands its result to ``Reservation.commit``, which turns the
        reservation into a cache entry atomically. A request larger than the
        whole limit is a caller bug (decoders split large members into bounded
        extents), so it raises.
        """
        token = None
        try:
            token = self.hold(nbytes)
            assert token is not None
            yield token
        finally:
            if token is not None:
                token.release()

    def hold(self, nbytes: int, wait: bool = True) -> Reservation | None:
        """Like :meth:`reserve`, for room that outlives one call (a decode finished in the background).

        The caller must ``commit`` or ``release`` the token. With ``wait=False``
        it returns None instead of waiting for other reservations to end.
        """
        if nbytes > self.limit:
            raise ValueError(f"reservation of {nbytes} bytes exceeds the cache limit of {self.limit}")
        # The Condition's own lock, taken plainly: Condition.__enter__/__exit__ are Python code, and
        # a Ctrl-C landing inside them left the lock held (every later read and close() hung).
        with self._lock:
            while self._reserved + nbytes > self.limit:
                if not wait:
                    return None
                self._room.wait()
            token = Reservation(self, nbytes)
            self._reserved += nbytes
            try:
                self._evict_locked(self._reserved)
            except BaseException:  # Ctrl-C or a hook failing mid-eviction: no token, so no leak
                self._reserved -= nbytes
                token.remaining = 0
                self._room.notify_all()
                raise
        return token

    def _release(self, token: Reservation) -> None:
        with self._lock:
            # Zeroed first: interrupted in between, a token leaks room rather than releasing twice.
            n, token.remaining = token.remaining, 0
            self._reserved -= n
            self._room.notify_all()

    def _commit(self, token: Reservation, key: Hashable, value: object) -> None:
        size = _nbytes(value)
        with self._lock:
            n, token.remaining = token.remaining, 0
            self._reserved -= n
            if size <= self.limit - self._reserved:
                self._evict_locked(size + self._reserved)
                self._store_locked(key, value)
                self.stats.inserted_bytes += size
            else:
                self.stats.uncacheable += 1
            self._room.notify_all()

    def _store_locked(self, key: Hashable, value: object) -> None:
        if self.on_remove is not None and key in self._lru:
            self.on_remove(key)  # the value it replaces leaves the cache
        self._lru[key] = value

    def _evict_locked(self, room: int) -> None:
        lru = self._lru
        before = lru.currsize
        while lru and lru.currsize + room > self.limit:
            key, _ = lru.popitem()
            if self.on_remove is not None:
                self.on_remove(key)
            self.stats.evictions += 1
        if self.trim_hook is not None and before != lru.currsize:
            self._evicted_since_trim += before - lru.currsize
            if self._evicted_since_trim >= self.trim_every:
                self._evicted_since_trim = 0
                self.trim_hook()


class Reservation:
    """Room held in an :class:`ExtentCache` for one decode (see ``ExtentCache.reserve``)."""

    __slots__ = ("_cache", "remaining")

    def __init__(self, cache: ExtentCache, nbytes: int) -> None:
        self._cache = cache
        self.remaining = nbytes

    def commit(self, key: Hashable, value: object) -> None:
        """Insert the decoded value in place of the reservation."""
        self._cache._commit(self, key, value)

    def release(self) -> None:
        """Give the room back without inserting anything (idempotent)."""
        if self.remaining:
            self._cache._release(self)
