"""The extent cache's LRU order: looking at an entry (peek, call_if_held) must not keep it alive.

Drop-behind and the prefetch checks look at entries they do not use; if that refreshed
them, data a scan had passed would push out what readers still use.
"""

from __future__ import annotations

from cdmlfs.cache import ExtentCache


def _cache_of(*keys: str) -> ExtentCache:
    cache = ExtentCache(30)
    for key in keys:
        cache.put(key, b"x" * 10)
    return cache


def test_peek_leaves_the_lru_order_alone() -> None:
    cache = _cache_of("a", "b", "c")
    assert cache.peek("a") is not None
    cache.put("d", b"x" * 10)  # evicts the least recently used: still "a"
    assert cache.peek("a") is None
    assert cache.peek("b") is not None
    assert (cache.stats.hits, cache.stats.misses) == (0, 0)


def test_call_if_held_leaves_the_lru_order_alone() -> None:
    cache = _cache_of("a", "b", "c")
    value = cache.peek("a")
    calls = []
    assert cache.call_if_held("a", value, lambda: calls.append(1))
    assert not cache.call_if_held("a", b"other", lambda: calls.append(2))
    assert not cache.call_if_held("zz", value, lambda: calls.append(3))
    assert calls == [1]
    cache.put("d", b"x" * 10)
    assert cache.peek("a") is None


def test_get_refreshes_and_counts() -> None:
    cache = _cache_of("a", "b", "c")
    assert cache.get("a") is not None
    assert cache.get("zz") is None
    cache.put("d", b"x" * 10)  # "b" is now the least recently used
    assert cache.peek("a") is not None
    assert cache.peek("b") is None
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)


def test_an_exception_during_eviction_leaks_no_reservation() -> None:
    """`hold` added its bytes to the reserved count, then evicted: Ctrl-C (or a failing hook) there
    left the count raised with no token to release it, and later reads blocked for ever."""
    import pytest

    cache = _cache_of("a", "b", "c")
    calls = []

    def interrupted_once(key) -> None:
        calls.append(key)
        if len(calls) == 1:
            raise KeyboardInterrupt

    cache.on_remove = interrupted_once
    with pytest.raises(KeyboardInterrupt), cache.reserve(25):
        pass
    assert cache.reserved == 0
    token = cache.hold(25, wait=False)  # room for it: nothing leaked
    assert token is not None
    token.release()
    token.release()  # idempotent: released once
    assert cache.reserved == 0
