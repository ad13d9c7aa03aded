"""The remote block layer against an in-memory fake remote: exact bytes, few requests, bounded memory."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from cdmlfs.cache import ExtentCache
from cdmlfs.errors import SourceError
from cdmlfs.sources.blocks import BlockConfig, BlockLayer
from cdmlfs.sources.buffers import MAX_SPARES, BufferPool
from cdmlfs.sources.readahead import ReadaheadConfig

KiB = 1 << 10
MiB = 1 << 20


class FakeRemote:
    """``fetch(start, end)`` over bytes in memory; records requests, concurrency and the cache bound."""

    def __init__(self, data: bytes, latency: float = 0.0, cache: ExtentCache | None = None) -> None:
        self.data = data
        self.latency = latency
        self.cache = cache
        self.calls: list[tuple[int, int]] = []
        self.active = 0
        self.max_active = 0
        self.bound_violations = 0
        self.fail: set[int] = set()  # starts that fail once
        self.opened: list[tuple[int, int]] = []  # open_range calls
        self.open_bodies = 0  # opened and not yet finished or closed
        self.body_bytes = 0  # received from open bodies
        self.fail_bodies: list[int | None] = []  # the next bodies opened fail after these many bytes
        self._lock = threading.Lock()

    def fetch(self, start: int, end: int, since: float = 0.0) -> bytes:
        with self._lock:
            self.calls.append((start, end))
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            if self.cache is not None:
                with self.cache._lock:  # one snapshot: held and reserved move together on a commit
                    over = self.cache.held + self.cache.reserved > self.cache.limit
                if over:
                    self.bound_violations += 1
            fail = start in self.fail
            self.fail.discard(start)
        try:
            if self.latency:
                time.sleep(self.latency)
            if fail:
                raise SourceError(f"injected failure at {start}")
            return self.data[start:end]
        finally:
            with self._lock:
                self.active -= 1

    def fetch_into(self, start: int, end: int, out: memoryview, since: float = 0.0) -> None:
        out[:] = self.fetch(start, end)

    @property
    def fetched(self) -> int:
        return sum(e - s for s, e in self.calls)

    def open_range(self, start: int, end: int, since: float = 0.0) -> FakeBody:
        """A reply whose body is handed over unread (what S3 does with ``open_range``)."""
        with self._lock:
            self.opened.append((start, end))
            self.open_bodies += 1
            fail_at = self.fail_bodies.pop(0) if self.fail_bodies else None
        return FakeBody(self, start, end, fail_at)


class FakeBody:
    """``readinto`` in order over the fake remote's bytes; can fail after ``fail_at`` bytes."""

    def __init__(self, remote: FakeRemote, start: int, end: int, fail_at: int | None) -> None:
        self.remote = remote
        self.pos = start
        self.end = end
        self.fail_at = None if fail_at is None else start + fail_at
        self.done = False

    def readinto(self, out: memoryview) -> None:
        assert not self.done, "read after finish/close"
        n = len(out)
        assert self.pos + n <= self.end, "read past the body"
        if self.fail_at is not None and self.pos + n > self.fail_at:
            raise SourceError(f"injected body failure at {self.fail_at}")
        out[:] = self.remote.data[self.pos : self.pos + n]
        self.pos += n
        with self.remote._lock:
            self.remote.body_bytes += n

    def finish(self) -> None:
        assert self.pos == self.end, "finished before its end"
        self._end()

    def close(self) -> None:
        self._end()

    def _end(self) -> None:
        assert not self.done, "ended twice"
        self.done = True
        with self.remote._lock:
            self.remote.open_bodies -= 1


def make(data: bytes, cache_limit: int = 64 * MiB, latency: float = 0.0, **cfg):
    cache = ExtentCache(cache_limit)
    remote = FakeRemote(data, latency, cache)
    ra = cfg.pop("readahead", None)
    into = remote.fetch_into if cfg.pop("into", False) else None
    opens = remote.open_range if cfg.pop("opens", False) else None
    config = BlockConfig(readahead=ra, **cfg)
    layer = BlockLayer(remote.fetch, len(data), cache, config, name="fake", fetch_into=into, open_range=opens)
    return layer, remote, cache


def test_random_reads_return_exact_bytes_under_eviction() -> None:
    data = random.Random(1).randbytes(8 * MiB)
    layer, remote, cache = make(data, cache_limit=1 * MiB, part_size=256 * KiB)
    rng = random.Random(2)
    for _ in range(400):
        off = rng.randrange(len(data))
        n = min(rng.choice([1, 30, 700, 4096, 100_000, 700_000]), len(data) - off)
        assert layer.read(off, n) == data[off : off + n]
    assert remote.bound_violations == 0
    assert cache.held <= cache.limit
    layer.close()


def test_read_into_fills_a_buffer_with_the_same_bytes() -> None:
    data = random.Random(13).randbytes(6 * MiB)
    layer, _, _ = make(data, part_size=1 * MiB)
    rng = random.Random(14)
    for _ in range(100):
        off = rng.randrange(len(data))
        buf = bytearray(min(rng.choice([1, 999, 300_000, 2 * MiB]), len(data) - off))
        assert layer.read_into(off, buf) == len(buf)
        assert bytes(buf) == data[off : off + len(buf)]
    layer.close()


def test_header_probe_then_data_becomes_one_request_per_member() -> None:
    """ZIP reads a 30-byte local header, then the data behind it: once learned, one GET per member."""
    rng = random.Random(3)
    member = 2048 + 30 + 20
    data = rng.randbytes(50_000 * member)
    layer, remote, _ = make(data)
    needed = 0
    for i in rng.sample(range(50_000), 100):
        at = i * member
        assert layer.read(at, 30) == data[at : at + 30]
        assert layer.read(at + 50, 2048) == data[at + 50 : at + 50 + 2048]
        needed += member
    # The first probes fetch the initial expansion (16 KiB); afterwards about one member each.
    assert len(remote.calls) <= 100 + 5
    assert remote.fetched <= 2 * needed
    layer.close()


def test_sequential_reads_prefetch_in_growing_windows_without_duplicates() -> None:
    data = random.Random(4).randbytes(48 * MiB)
    layer, remote, _ = make(data, part_size=4 * MiB, latency=0.002)
    chunk = 128 * KiB
    for off in range(0, len(data), chunk):
        assert layer.read(off, chunk) == data[off : off + chunk]
    assert layer.stats.prefetched_bytes >= len(data) // 2
    assert remote.fetched <= len(data) + 2 * chunk  # nothing fetched twice
    sizes = [e - s for s, e in remote.calls]
    assert max(sizes) == 4 * MiB  # the window grew to full parts
    assert len(remote.calls) < len(data) // chunk // 8  # far fewer requests than reads
    layer.close()


def test_neighbouring_small_members_in_archive_order_are_coalesced() -> None:
    rng = random.Random(5)
    member = 3000
    data = rng.randbytes(2000 * member)
    layer, remote, _ = make(data)
    for i in range(2000):
        at = i * member
        assert layer.read(at, 30) == data[at : at + 30]
        assert layer.read(at + 60, member - 60) == data[at + 60 : at + member]
    assert len(remote.calls) < 2000 // 20  # one request per many members
    assert remote.fetched <= len(data) + 64 * KiB
    layer.close()


def test_concurrent_readers_of_the_same_bytes_share_one_request() -> None:
    data = random.Random(6).randbytes(4 * MiB)
    layer, remote, _ = make(data, latency=0.2)
    barrier = threading.Barrier(8)
    results = []

    def reader() -> None:
        barrier.wait()
        results.append(layer.read(1 * MiB, 300 * KiB))

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [data[1 * MiB : 1 * MiB + 300 * KiB]] * 8
    assert len(remote.calls) == 1
    layer.close()


def test_large_read_is_split_into_parallel_requests() -> None:
    data = random.Random(7).randbytes(16 * MiB)
    # Each request takes 0.3 s: four of them overlap unless the pool ran them one after another
    # (or a loaded machine took that long to start its threads: 50 ms was not always enough).
    layer, remote, _ = make(data, latency=0.3, part_size=8 * MiB, foreground_workers=8)
    assert layer.read(0, 16 * MiB) == data
    assert len(remote.calls) >= 8
    assert remote.max_active >= 4
    layer.close()


def test_failed_prefetch_fails_the_reads_that_waited_and_the_next_read_fetches_again() -> None:
    """The fetch function retried to the end of its budget: a read that waited for that prefetch gets
    its error (a retry of its own would give it a second budget), and the next read starts over."""
    from cdmlfs.sources.blocks import FETCHING

    data = random.Random(8).randbytes(16 * MiB)
    ra = ReadaheadConfig(min_window=1 * MiB)
    layer, remote, _ = make(data, part_size=1 * MiB, readahead=ra)
    gate = threading.Event()
    real_fetch = remote.fetch

    def fetch(start: int, end: int, since: float) -> bytes:  # prefetches (past 1 MiB): the gate, then fail
        if start >= MiB and not gate.is_set():
            gate.wait(10)
            raise SourceError(f"injected failure at {start}")
        return real_fetch(start, end)

    layer._fetch = fetch
    for off in range(0, MiB, 256 * KiB):
        assert layer.read(off, 256 * KiB) == data[off : off + 256 * KiB]
    deadline = time.monotonic() + 5
    while not any(sp.prefetch and sp.state == FETCHING for sp in list(layer._spans.values())):
        assert time.monotonic() < deadline, "no prefetch in flight"
        time.sleep(0.005)
    waiting_on = next(sp.start for sp in list(layer._spans.values()) if sp.prefetch and sp.state == FETCHING)
    errors: list[BaseException] = []
    planned = threading.Event()
    real_collect = layer._collect

    def collect(pieces, waiters):  # the read planned to wait for the prefetch, and is waiting
        if any(span.start == waiting_on for span, _ in waiters):
            planned.set()
        return real_collect(pieces, waiters)

    layer._collect = collect

    def reader() -> None:
        try:
            layer.read(waiting_on, 4096)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    assert planned.wait(10)  # opening the gate earlier would let the read plan a fetch of its own
    gate.set()
    t.join(10)
    assert len(errors) == 1 and "injected" in str(errors[0])
    assert not any(start == waiting_on for start, _ in remote.calls)  # it fetched nothing of its own
    assert layer.read(waiting_on, 4096) == data[waiting_on : waiting_on + 4096]  # fetched anew
    layer.close()


def test_foreground_failure_reaches_the_reader_and_the_next_read_retries() -> None:
    data = random.Random(9).randbytes(1 * MiB)
    layer, remote, _ = make(data)
    remote.fail = {5000}
    with pytest.raises(SourceError):
        layer.read(5000, 100)
    assert layer.read(5000, 100) == data[5000:5100]
    layer.close()


def test_reservation_holders_and_prefetch_never_deadlock_and_stay_bounded() -> None:
    """Readers that hold decode reservations (like ExtentReader) while reading, next to prefetching scans."""
    data = random.Random(10).randbytes(64 * MiB)
    limit = 8 * MiB
    layer, remote, cache = make(data, cache_limit=limit, latency=0.002, part_size=1 * MiB)
    errors: list[BaseException] = []

    def decoder(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                n = rng.choice([64 * KiB, 1 * MiB, limit // 4])
                off = rng.randrange(len(data) - n)
                with cache.reserve(n):
                    assert layer.read(off, n) == data[off : off + n]
        except BaseException as exc:
            errors.append(exc)

    def scanner(start: int) -> None:
        try:
            for off in range(start, start + 24 * MiB, 256 * KiB):
                assert layer.read(off, 256 * KiB) == data[off : off + 256 * KiB]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=decoder, args=(s,)) for s in range(4)]
    threads += [threading.Thread(target=scanner, args=(s * 32 * MiB,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors
    assert remote.bound_violations == 0
    assert cache.held + cache.reserved <= limit
    layer.close()


def test_drop_behind_keeps_a_long_scan_from_flushing_the_cache() -> None:
    data = random.Random(11).randbytes(64 * MiB)
    layer, _, cache = make(data, cache_limit=32 * MiB, part_size=2 * MiB)
    cache.put("hot", b"x" * (4 * MiB))
    for off in range(0, len(data), 1 * MiB):
        assert layer.read(off, 1 * MiB) == data[off : off + 1 * MiB]
    assert layer.stats.dropped_behind > 0
    assert cache.peek("hot") is not None
    layer.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_reads_with_fresh_pools() -> None:
    data = random.Random(12).randbytes(32 * MiB)
    layer, _, _ = make(data, latency=0.001, part_size=1 * MiB)
    for off in range(0, 8 * MiB, 512 * KiB):  # a sequential stream: prefetches in flight at fork time
        layer.read(off, 512 * KiB)
    pid = os.fork()
    if pid == 0:  # child: must not hang on the parent's dead threads
        code = 1
        try:
            ok = all(layer.read(o, 700 * KiB) == data[o : o + 700 * KiB] for o in range(0, 30 * MiB, 3 * MiB))
            code = 0 if ok else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0
    assert layer.read(9 * MiB, 1000) == data[9 * MiB : 9 * MiB + 1000]  # the parent still works too
    layer.close()


def test_a_pool_shut_down_under_a_reader_is_replaced_not_left_with_orphan_requests() -> None:
    """A fork's hook (or close) can shut a pool down after a reader took it and before it submits:
    submit raised RuntimeError, the reader got EIO and the planned spans went to no thread, so
    every later read of those bytes waited for ever."""
    from concurrent.futures import ThreadPoolExecutor

    data = random.Random(13).randbytes(4 * MiB)
    layer, _, _ = make(data, part_size=1 * MiB)
    dead = ThreadPoolExecutor(1)
    dead.shutdown()
    layer._fg_pool = layer._pf_pool = dead  # what a reader holding the pool meets after the hook
    assert layer.read(1000, 3 * MiB) == data[1000 : 1000 + 3 * MiB]
    assert layer.read(0, 4 * MiB) == data
    layer.close()
    with pytest.raises(SourceError):
        layer.read(0, 10)


def test_our_fork_hook_runs_before_concurrent_futures_takes_its_global_lock() -> None:
    """Python runs before-fork hooks in reverse order of registration: ours, registered first,
    ran with concurrent.futures' global lock held, and a reader submitting to a pool our hook was
    shutting down deadlocked the fork (it held the pool's lock, waiting for the global one)."""
    import concurrent.futures.thread as cft

    from cdmlfs import forksafe

    class Probe:
        def __init__(self) -> None:
            self.held: list[bool] = []

        def _before_fork(self) -> None:
            self.held.append(cft._global_shutdown_lock.locked())

        def _after_fork_child(self) -> None:
            pass

    probe = Probe()
    forksafe.register(probe)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert probe.held == [False]


def test_close_fails_waiters_instead_of_hanging() -> None:
    data = bytes(4 * MiB)
    release = threading.Event()
    started = threading.Event()

    def stuck_fetch(start: int, end: int, since: float) -> bytes:  # a GET that never answers until released
        started.set()
        release.wait(60)
        return data[start:end]

    layer = BlockLayer(
        stuck_fetch, len(data), ExtentCache(64 * MiB), BlockConfig(readahead=None), name="stuck"
    )
    out: list = []

    def reader() -> None:
        try:
            out.append(layer.read(0, 1 * MiB))
        except SourceError as exc:
            out.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        assert started.wait(10)  # the read is waiting on its request
        layer.close()
        t.join(10)
        assert not t.is_alive(), "close() left a reader waiting on a request that never finishes"
        assert len(out) == 1 and isinstance(out[0], SourceError) and "closed" in str(out[0])
    finally:
        release.set()
        t.join(10)


def test_buffer_pool_recycles_only_unshared_buffers_and_reserves_them() -> None:
    cache = ExtentCache(64 * MiB)
    pool = BufferPool(cache, 1 * MiB)
    viewed = bytearray(1 * MiB)
    view = memoryview(viewed)  # a reader copying out of it
    listed = [bytearray(1 * MiB)]  # a reader's list of pieces
    pool.recycle([viewed, listed[0], bytearray(1 * MiB), bytearray(10), bytes(1 * MiB), None])
    assert pool.recycled == 1  # only the buffer nobody else refers to, of the pool's size and type
    assert cache.reserved == 1 * MiB  # and it is counted in the cache's bound
    spare = pool.take()
    assert spare is not None and spare[0] is not viewed and spare[0] is not listed[0]
    assert pool.take() is None
    spare[1].release()
    pool.recycle([bytearray(1 * MiB) for _ in range(10)])
    assert pool.recycled == 1 + pool.max_spares == 5  # at most MAX_SPARES parts (and an eighth of the cache)
    pool.close()
    assert cache.reserved == 0
    pool.recycle([bytearray(1 * MiB)])  # a read finishing after close keeps nothing back
    assert cache.reserved == 0 and pool.take() is None
    view.release()


def test_small_cache_gets_no_spare_buffers() -> None:
    assert not BufferPool(ExtentCache(16 * MiB), 2 * MiB).enabled


def test_a_long_scan_receives_almost_every_part_into_a_recycled_buffer() -> None:
    """The default geometry scaled down (a cache 32 parts large): a window refill takes two parts at
    once while drop-behind gives back one at a time. With room for only two spares, a scan let a
    buffer go about every sixth part and allocated a fresh one (page faults and zeroing of a whole
    part, a quarter of the client's CPU when it was every part)."""
    part = 256 * KiB
    data = random.Random(21).randbytes(512 * part)
    ra = ReadaheadConfig(max_window=4 * part)  # 64 MiB windows of 16 MiB parts, in a 512 MiB cache
    layer, remote, cache = make(
        data, cache_limit=32 * part, part_size=part, into=True, latency=0.0005, readahead=ra
    )
    buf = bytearray(part // 16)
    for off in range(0, len(data), len(buf)):
        layer.read_into(off, buf)
        assert buf == data[off : off + len(buf)]
    stats = layer.stats
    full_parts = stats.prefetched_bytes // part
    fresh = full_parts - stats.buffers_reused
    assert full_parts > 400
    # The first window's parts are fresh (nothing was dropped yet), and a few more while the
    # pool fills (measured: 8-9); past them, next to none. The old policy: 47-85.
    assert fresh <= layer.readahead.max_window // part + MAX_SPARES + 4, stats.as_dict()
    assert remote.bound_violations == 0  # the spares' reservations keep the scan within the cache
    layer.close()
    assert cache.reserved == 0


def test_scan_into_recycled_buffers_with_a_lagging_reader_is_byte_exact() -> None:
    """A reader far behind the stream reads spans that were dropped and whose buffers were reused."""
    data = random.Random(13).randbytes(96 * MiB)
    layer, remote, cache = make(data, cache_limit=64 * MiB, part_size=1 * MiB, into=True)
    errors: list[str] = []

    def scan(delay: float, step: int) -> None:
        rng = random.Random(step)
        buf = bytearray(step)
        try:
            for off in range(0, len(data) - step + 1, step):
                layer.read_into(off, buf)
                if buf != data[off : off + step]:
                    errors.append(f"wrong bytes at {off}")
                    return
                if delay and rng.random() < 0.2:
                    time.sleep(delay)
        except Exception as exc:  # a thread's exception must fail the test, not just warn
            errors.append(repr(exc))

    threads = [
        threading.Thread(target=scan, args=(0.0, 256 * KiB)),
        threading.Thread(target=scan, args=(0.002, 96 * KiB)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert layer.stats.buffers_reused > 0
    assert remote.bound_violations == 0
    layer.close()
    assert cache.reserved == 0


def test_reader_waiting_on_a_span_dropped_behind_still_gets_its_bytes() -> None:
    """Readers of one stream far apart: the leader drops a span a lagging reader planned to wait on.
    The lagging reader took the span's future when it planned: it still gets the bytes."""
    from concurrent.futures import Future

    from cdmlfs.sources import blocks

    data = random.Random(14).randbytes(32 * MiB)
    layer, _, _ = make(data, part_size=1 * MiB, into=True)
    for off in range(0, 8 * MiB, 256 * KiB):  # a sequential stream: prefetched spans
        layer.read(off, 256 * KiB)
    span = next(s for s in layer._spans.values() if s.prefetch and s.state == blocks.DONE)
    lo, hi = span.start, span.end
    taken: Future = Future()  # what the lagging reader took while the span was being fetched
    taken.set_result(layer.cache.peek(span.key))
    with layer._lock:  # what the leader's drop-behind does to it
        layer._remove(span)
        layer.cache.pop(span.key)
    pieces = layer._collect([], [(span, taken)])
    out = bytearray(hi - lo)
    blocks._copy_into(pieces, lo, memoryview(out))
    assert out == data[lo:hi]
    layer.close()


def test_settled_spans_do_not_keep_evicted_bytes_alive() -> None:
    """A span in the index must not hold its bytes once the cache has evicted them: with a 16 MiB
    cache, random 1 MiB reads kept every part ever fetched (814 MiB of RSS for a 1 GiB object)."""
    import gc
    import tracemalloc

    data = random.Random(15).randbytes(64 * MiB)
    layer, _, _ = make(data, part_size=1 * MiB, cache_limit=16 * MiB)
    rng = random.Random(16)
    tracemalloc.start()
    try:
        for _ in range(200):
            off = rng.randrange(0, 63 * MiB)
            assert layer.read(off, MiB) == data[off : off + MiB]
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 16 * MiB + 4 * MiB, held / MiB  # the cache, plus a little
    layer.close()


def test_foreground_parts_together_stay_within_a_quarter_of_the_cache() -> None:
    """Requests a reader waits for are not reserved in the cache: 8 workers of 1/8-cache parts could
    hold a whole cache's worth outside the bound."""
    for limit in (4 * MiB, 64 * MiB, 256 * MiB, 1 << 30):
        layer, _, _ = make(b"x" * 1024, cache_limit=limit)
        workers, part = layer.config.foreground_workers, layer.foreground_part
        assert workers * part <= max(limit // 4, workers * 64 * KiB)
        assert part == 8 * MiB or limit < 256 * MiB
        assert layer.config.part_size == min(8 * MiB, limit // 8)  # prefetch parts are reserved: as before
        layer.close()
    layer, remote, _ = make(bytes(range(256)) * (64 * KiB), cache_limit=32 * MiB)  # 16 MiB
    assert layer.read(0, 16 * MiB) == bytes(range(256)) * (64 * KiB)
    assert max(e - s for s, e in remote.calls) <= 1 * MiB  # a quarter of the cache over 8 workers
    layer.close()


# -- open bodies: prefetched replies received straight into the reader's buffer ---------------------
def _scan_into(layer: BlockLayer, start: int, end: int, step: int) -> bytes:
    got = bytearray()
    buf = bytearray(step)
    for off in range(start, end, step):
        view = memoryview(buf)[: min(step, end - off)]
        layer.read_into(off, view)
        got += view
    return bytes(got)


def test_a_sequential_scan_into_a_buffer_is_received_from_open_bodies() -> None:
    data = random.Random(30).randbytes(48 * MiB)
    layer, remote, cache = make(data, into=True, opens=True, part_size=4 * MiB)
    assert _scan_into(layer, 0, len(data), 1 * MiB) == data
    st = layer.stats
    # Most bytes went from a reply straight into the reader's buffer (the rest: the first reads,
    # and bodies the reader caught up with before their headers came), none fetched twice.
    assert st.streamed_bytes >= len(data) // 2, st.as_dict()
    assert st.bodies_opened >= 8 and st.bodies_failed == 0
    assert remote.fetched + remote.body_bytes <= len(data) + 1 * MiB
    assert remote.bound_violations == 0
    # Open bodies hold no cache memory: only the reads before the stream proved sequential stayed.
    assert cache.held + cache.reserved <= 8 * MiB
    layer.close()
    assert remote.open_bodies == 0  # every reply finished or closed


def test_a_scan_read_as_bytes_is_not_given_open_bodies() -> None:
    """``read`` returns bytes of its own: open bodies would cost a buffer per read."""
    data = random.Random(31).randbytes(24 * MiB)
    layer, remote, _ = make(data, into=True, opens=True, part_size=4 * MiB)
    got = b"".join(layer.read(off, 1 * MiB) for off in range(0, len(data), 1 * MiB))
    assert got == data
    assert remote.opened == [] and layer.stats.prefetches >= 3
    layer.close()


def test_reads_starting_inside_open_bodies_and_as_bytes_are_byte_exact() -> None:
    """Out of order (a multithreaded FUSE loop delivers readahead so), jumps far inside a body, and
    ``read`` over open bodies: bytes kept for the readers that come for them, or fetched again."""
    data = random.Random(32).randbytes(40 * MiB)
    layer, remote, _ = make(data, into=True, opens=True, part_size=4 * MiB)
    rng = random.Random(33)
    off = 0
    step = 256 * KiB
    while off < len(data):
        # A sequential reader whose reads sometimes come swapped, plus stray reads around it.
        if rng.random() < 0.3 and off + 2 * step <= len(data):
            second = bytearray(step)
            layer.read_into(off + step, second)
            assert second == data[off + step : off + 2 * step]
            first = bytearray(step)
            layer.read_into(off, first)
            assert first == data[off : off + step]
            off += 2 * step
            continue
        n = min(step, len(data) - off)
        buf = bytearray(n)
        layer.read_into(off, buf)
        assert buf == data[off : off + n], off
        if rng.random() < 0.1:
            at = min(len(data) - 1, off + rng.randrange(8 * MiB))
            k = min(rng.choice([100, 64 * KiB, 3 * MiB]), len(data) - at)
            assert layer.read(at, k) == data[at : at + k]
        off += n
    st = layer.stats
    assert st.bodies_opened >= 4 and st.streamed_bytes > len(data) // 4, st.as_dict()
    assert st.stashed_bytes > 0
    layer.close()
    assert remote.open_bodies == 0


def test_bodies_that_fail_half_way_are_fetched_again_with_exact_bytes() -> None:
    data = random.Random(34).randbytes(32 * MiB)
    layer, remote, _ = make(data, into=True, opens=True, part_size=4 * MiB)
    remote.fail_bodies = [0, 1 * MiB + 5, None, 3 * MiB, 17, None, 2 * MiB]
    assert _scan_into(layer, 0, len(data), 1 * MiB) == data
    assert layer.stats.bodies_failed >= 5, layer.stats.as_dict()
    layer.close()
    assert remote.open_bodies == 0


def test_concurrent_readers_over_open_bodies_get_exact_bytes() -> None:
    """Two readers taking turns on one stream (a FUSE loop's threads) and others on their own:
    a reader that waits for the rest of a body being received has it received for it."""
    data = random.Random(35).randbytes(64 * MiB)
    layer, remote, _ = make(data, cache_limit=96 * MiB, into=True, opens=True, part_size=4 * MiB)
    errors: list[str] = []
    step = 128 * KiB

    def turns(first: int, start: int, end: int) -> None:
        buf = bytearray(step)
        for off in range(start + first * step, end, 2 * step):
            layer.read_into(off, buf)
            if buf != data[off : off + step]:
                errors.append(f"wrong bytes at {off}")

    def own(start: int, end: int) -> None:
        if _scan_into(layer, start, end, 1 * MiB) != data[start:end]:
            errors.append(f"wrong scan {start}-{end}")

    threads = [threading.Thread(target=turns, args=(k, 0, 32 * MiB)) for k in (0, 1)]
    threads += [threading.Thread(target=own, args=(a, a + 16 * MiB)) for a in (32 * MiB, 48 * MiB)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert layer.stats.streamed_bytes > 0
    assert remote.bound_violations == 0
    layer.close()
    assert remote.open_bodies == 0


def test_open_bodies_are_bounded_and_closed_when_abandoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each open body holds a connection: at most ``max_open`` at once; a reader that stopped half-way
    leaves its bodies behind, closed once new ones need the room (or the layer closes)."""
    import cdmlfs.sources.blocks as blocks

    data = random.Random(36).randbytes(64 * MiB)
    layer, remote, _ = make(data, into=True, opens=True, part_size=2 * MiB, max_open=3)
    peak = 0
    buf = bytearray(1 * MiB)
    for off in range(0, 16 * MiB, 1 * MiB):  # a first reader stops at 16 MiB
        layer.read_into(off, buf)
        peak = max(peak, remote.open_bodies)
    time.sleep(0.2)  # its prefetches settle
    assert 0 < remote.open_bodies <= 3
    monkeypatch.setattr(blocks, "OPEN_IDLE", 0.0)
    assert _scan_into(layer, 40 * MiB, 64 * MiB, 1 * MiB) == data[40 * MiB :]  # another reader
    peak = max(peak, remote.open_bodies)
    assert peak <= 3
    assert layer.stats.bodies_dropped > 0
    # The second reader's bodies were opened after the first one's were closed for them.
    assert any(start >= 40 * MiB for start, _ in remote.opened)
    layer.close()
    assert remote.open_bodies == 0


def test_a_read_far_inside_an_open_body_skips_to_it_and_the_skipped_bytes_are_fetched_again() -> None:
    data, layer, remote, _, start = _with_an_open_body(37)
    at = start + 3 * MiB + 5  # past STASH_MAX into the body: the bytes before are not kept
    buf = bytearray(64 * KiB)
    layer.read_into(at, buf)
    assert buf == data[at : at + len(buf)]
    assert layer.stats.skipped_bytes == 3 * MiB + 5
    skipped = bytearray(3 * MiB)
    layer.read_into(start, skipped)
    assert skipped == data[start : start + 3 * MiB]
    layer.close()
    assert remote.open_bodies == 0


def test_a_stream_read_by_threads_taking_turns_goes_back_to_buffered_prefetch() -> None:
    """A multithreaded FUSE loop serves kernel readahead out of order: readers then wait for the
    rest of bodies other readers are receiving (measured through a mount: 647 vs 1,063 MiB/s). Such
    a stream is seen as shared after its first bodies, and prefetches into buffers from then on."""
    data = random.Random(38).randbytes(64 * MiB)
    layer, remote, _ = make(data, into=True, opens=True, part_size=4 * MiB)
    errors: list[int] = []
    barrier = threading.Barrier(2)

    def turns(first: int) -> None:
        buf = bytearray(1 * MiB)
        for k, off in enumerate(range(first * MiB, len(data), 2 * MiB)):
            if k % 4 == 0:
                barrier.wait(10)  # keep the two readers close, as readahead requests are
            layer.read_into(off, buf)
            if buf != data[off : off + MiB]:
                errors.append(off)

    threads = [threading.Thread(target=turns, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    st = layer.stats
    assert st.prefetches >= 4 and st.bodies_opened <= 6, st.as_dict()
    layer.close()
    assert remote.open_bodies == 0


def test_drop_behind_also_drops_prefetches_the_reader_took_over() -> None:
    """A reader that catches up with a queued prefetch fetches those bytes itself (it does not
    wait for a busy pool): those spans are the scan's too, and are dropped behind it like the rest
    (kept, they flushed the cache of everything else on a long scan). Two scans taking turns on
    one prefetch worker: each one's next part is often queued behind the other's."""
    data = random.Random(39).randbytes(64 * MiB)
    layer, _, cache = make(data, cache_limit=32 * MiB, latency=0.004, part_size=2 * MiB, prefetch_workers=1)
    cache.put("hot", b"x" * (4 * MiB))
    half = len(data) // 2
    for off in range(0, half, 1 * MiB):
        for at in (off, half + off):
            assert layer.read(at, 1 * MiB) == data[at : at + 1 * MiB]
    assert layer.stats.prefetch_cancelled > 4, layer.stats.as_dict()
    assert cache.peek("hot") is not None
    layer.close()


def _with_an_open_body(seed: int):
    """(data, layer, remote, cache, start): a read_into scan of the first 8 MiB of 48 left a body of
    at least 4 MiB open at ``start`` (8 MiB parts)."""
    data = random.Random(seed).randbytes(48 * MiB)
    layer, remote, cache = make(data, into=True, opens=True, part_size=8 * MiB)
    assert _scan_into(layer, 0, 8 * MiB, 256 * KiB) == data[: 8 * MiB]
    start, _ = _an_open_body(layer, 4 * MiB)
    return data, layer, remote, cache, start


def _an_open_body(layer: BlockLayer, size: int) -> tuple[int, int]:
    """(start, end) of an open body at least ``size`` long, once a prefetch left one."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with layer._lock:
            spans = sorted((sp.start, sp.end) for sp in layer._spans.values() if sp.body is not None)
        spans = [(a, b) for a, b in spans if b - a >= size]
        if spans:
            return spans[0]
        time.sleep(0.01)
    raise AssertionError("no open body was left")


def test_a_reader_holding_a_reservation_never_waits_on_an_open_prefetch_waiting_for_room() -> None:
    """A decoder holds a cache reservation and reads compressed bytes a prefetch is fetching (its
    reply's headers slow to come). Once they come, the body is received for that reader without
    waiting on the cache: waiting there, it waited for the reader's own reservation, for ever."""
    data = random.Random(40).randbytes(64 * MiB)
    layer, remote, cache = make(data, cache_limit=64 * MiB, into=True, opens=True, part_size=4 * MiB)
    gate, entered = threading.Event(), threading.Event()
    target: list[tuple[int, int]] = []
    opened = remote.open_range

    def slow_open(start: int, end: int, since: float = 0.0) -> FakeBody:
        if start >= 8 * MiB and not target:
            target.append((start, end))
            entered.set()
            gate.wait(10)
        return opened(start, end, since)

    layer._open_range = slow_open
    buf = bytearray(1 * MiB)
    for off in range(0, 12 * MiB, 1 * MiB):
        layer.read_into(off, buf)
        if entered.is_set():
            break
    assert entered.wait(10)
    start = target[0][0]
    room = cache.hold(cache.limit - 256 * KiB)
    got: list[bytes] = []
    decoder = threading.Thread(target=lambda: got.append(layer.read(start + 100, 1000)), daemon=True)
    decoder.start()
    time.sleep(0.3)  # it waits for the span being fetched
    gate.set()
    decoder.join(10)
    hung = decoder.is_alive()
    room.release()
    decoder.join(10)
    assert not hung and got == [data[start + 100 : start + 1100]]
    layer.close()
    assert remote.open_bodies == 0


def test_a_failing_cache_hook_after_a_body_was_received_fails_its_readers_not_hangs_them() -> None:
    data, layer, remote, cache, start = _with_an_open_body(41)
    put = cache.put

    def failing_put(key, value) -> bool:
        if isinstance(key, tuple) and key[1] == start:  # the bytes kept before the read: a hook fails
            raise RuntimeError("cache hook failed")
        return put(key, value)

    cache.put = failing_put  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="hook failed"):
        layer.read_into(start + 1 * MiB, bytearray(64 * KiB))
    cache.put = put  # type: ignore[method-assign]
    got: list[bytes] = []
    later = threading.Thread(target=lambda: got.append(layer.read(start + 2 * MiB, 100)), daemon=True)
    later.start()
    later.join(10)
    assert not later.is_alive() and got == [data[start + 2 * MiB : start + 2 * MiB + 100]]
    with layer._lock:
        assert not [sp for sp in layer._spans.values() if sp.state == 1 and sp.claimed]  # none owed
    layer.close()
    assert remote.open_bodies == 0 and layer._open == 0


def test_an_interrupt_while_receiving_an_open_body_ends_the_read() -> None:
    """Ctrl-C during a read of an open body is not a failed body to fetch again: it ends the read,
    and nothing is left owed to other readers."""
    data, layer, remote, _, start = _with_an_open_body(42)
    readinto = FakeBody.readinto
    fired: list[int] = []

    def interrupted(self, out) -> None:
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt
        readinto(self, out)

    FakeBody.readinto = interrupted  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            layer.read_into(start, bytearray(64 * KiB))
    finally:
        FakeBody.readinto = readinto  # type: ignore[method-assign]
    buf = bytearray(3 * MiB)
    layer.read_into(start, buf)
    assert buf == data[start : start + 3 * MiB]
    layer.close()
    assert remote.open_bodies == 0 and layer._open == 0


def test_a_sweep_during_a_claim_loses_nothing() -> None:
    """A read from inside an open body into an evicted span after it: the claim's insert swept that
    span out of the index while the plan still walked it (a KeyError that left the claim's spans owed
    and its body open for good)."""
    from cdmlfs.sources.blocks import DONE, _Span

    data, layer, remote, _, start = _with_an_open_body(43)
    with layer._lock:
        end = layer._spans[start].end
        after = layer._spans.get(end)
        if after is not None:
            layer._remove(after)
        layer._insert(_Span(layer._tag, end, end + 64 * KiB, DONE, False))  # its bytes evicted
        layer._sweep_at = len(layer._spans) - 1  # the next insert sweeps
    buf = bytearray(end - start - 1 * MiB + 32 * KiB)
    layer.read_into(start + 1 * MiB, buf)
    assert buf == data[start + 1 * MiB : start + 1 * MiB + len(buf)]
    assert layer.read(start + 100, 100) == data[start + 100 : start + 200]
    layer.close()
    assert remote.open_bodies == 0 and layer._open == 0


def test_one_reader_of_consecutive_members_keeps_its_open_bodies() -> None:
    """A ZIP scan of one member, its neighbour's local header (a 30-byte ``read``), then that
    member's data from a little further on: all in order, so no reason to stop receiving bodies
    into the reader's buffer (a skip forward had marked the stream shared)."""
    data = random.Random(44).randbytes(96 * MiB)
    layer, remote, _ = make(data, into=True, opens=True, part_size=4 * MiB)
    a = 20 * MiB + 12345
    assert _scan_into(layer, 0, a, 1 * MiB) == data[:a]
    assert layer.read(a, 30) == data[a : a + 30]
    before = layer.stats.bodies_opened
    b = a + 30 + 57  # its name and extra field skipped
    assert _scan_into(layer, b, len(data), 1 * MiB) == data[b:]
    assert layer.stats.bodies_opened >= before + 10, layer.stats.as_dict()
    # (A reader that catches up with a prefetch still waiting for its headers has that body
    # received for it into a buffer: how often depends on the machine's load.)
    assert layer.stats.streamed_bytes >= (len(data) - b) // 2
    assert not any(stream.shared for stream in layer._streams._streams.values())
    layer.close()
    assert remote.open_bodies == 0
