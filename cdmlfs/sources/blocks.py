"""The block layer of remote sources: fetched byte spans live in the shared, bounded ExtentCache.

A remote source turns ``read_at(offset, length)`` into ranged requests through
a ``fetch(start, end) -> bytes`` function (which retries on its own). This
layer decides *which* ranges to request and keeps what came back:

* **Spans, not fixed blocks.** Random access to small members must not drag in
  a large block per read (a 2 KiB member in a 1 MiB block is 500x the bytes),
  and sequential reads want large requests. So every request is a span of the
  size the access pattern calls for (see :mod:`cdmlfs.sources.readahead`), and
  spans are entries of the archive's one :class:`~cdmlfs.cache.ExtentCache`:
  they share its byte bound and LRU with decoded extents. A sorted index of
  disjoint spans finds which parts of a read are cached, in flight or missing.
* **In flight once.** A span being fetched is in the index with a future;
  concurrent readers of the same bytes wait for it instead of fetching again.
* **Large reads in parallel.** A missing range is split into parts (at most
  ``part_size``, at least ``min_parallel_part`` each when it pays) fetched
  concurrently on a bounded pool; the HTTP connection pool has the same size.
* **Prefetch without breaking the bound or deadlocking.** Prefetched spans
  reserve their bytes in the cache before their request starts, so held +
  in-flight bytes never exceed the limit. A prefetch still waiting for its
  reservation is invisible to readers (a reader that needs those bytes cancels
  it and fetches them itself), and foreground fetches never wait on the cache
  (they insert with ``put``, which fails instead of blocking): a reader that
  holds a decode reservation can therefore never wait on a fetch that waits on
  that reservation. Foreground and prefetch requests use separate pools, so a
  long prefetch queue never delays a read someone is waiting for.
* **Drop-behind.** Prefetched spans a sequential reader has passed are dropped
  from the cache, so scanning a huge member does not flush everything else.
  When the source can receive into a caller's buffer (``fetch_into``), full
  prefetch parts are received into buffers that drop-behind recycles
  (:mod:`cdmlfs.sources.buffers`): a long scan then faults in no fresh memory.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass

from cdmlfs import forksafe
from cdmlfs.cache import ExtentCache
from cdmlfs.errors import SourceError
from cdmlfs.sources.buffers import BufferPool
from cdmlfs.sources.readahead import ProbeLearner, ReadaheadConfig, Stream, StreamTable

log = logging.getLogger(__name__)

KiB = 1 << 10
MiB = 1 << 20

PENDING = 0  # prefetch queued, no reservation yet: readers cancel it rather than wait
FETCHING = 1  # request running: readers wait for it
DONE = 2  # bytes are (or were, until evicted) in the cache under the span's key

# fetch(start, end, since): bytes [start, end), or raises. ``since`` is when a read first asked
# for them (time.monotonic()): a request queued for a free worker has spent that much of the
# read's deadline already (a prefetch's read begins when its request starts).
Fetch = Callable[[int, int, float], bytes]
_Waiter = tuple["_Span", Future]  # a span being fetched, and the future its readers took when planning
FetchInto = Callable[[int, int, memoryview, float], None]  # fills the buffer with bytes [start, end)


@dataclass
class BlockConfig:
    part_size: int = 8 * MiB  # largest single request
    min_parallel_part: int = 1 * MiB  # a missing range is split into parts of at least this
    foreground_workers: int = 8
    prefetch_workers: int = 8
    prefetch_headroom: float = 0.5  # no prefetch while reservations fill more than this share of the cache
    readahead: ReadaheadConfig | None = None
    # Seconds one request may take (the source's read deadline): the parts of one large read
    # beyond the first batch count theirs from when a worker could first be free for them.
    request_budget: float | None = None


class _Span:
    __slots__ = ("cancelled", "end", "future", "key", "prefetch", "since", "start", "state")

    def __init__(self, tag: object, start: int, end: int, state: int, prefetch: bool) -> None:
        self.start = start
        self.end = end
        self.since = time.monotonic()  # when a reader asked for it (see Fetch)
        self.key = (tag, start, end)
        self.state = state
        self.prefetch = prefetch
        self.cancelled = False
        self.future: Future | None = Future() if state != DONE else None


class BlockStats:
    """Counters for benchmarks and ``stats`` (best effort under concurrency)."""

    def __init__(self) -> None:
        self.reads = 0
        self.read_bytes = 0
        self.fetches = 0
        self.fetched_bytes = 0
        self.prefetches = 0
        self.prefetched_bytes = 0
        self.prefetch_cancelled = 0
        self.dropped_behind = 0
        self.buffers_reused = 0  # prefetch parts received into a recycled buffer

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class BlockLayer:
    """``read(offset, length)`` over a ranged ``fetch`` through spans in a shared ExtentCache."""

    def __init__(
        self,
        fetch: Fetch,
        size: int,
        cache: ExtentCache,
        config: BlockConfig | None = None,
        name: str = "remote",
        fetch_into: FetchInto | None = None,
    ) -> None:
        self._fetch = fetch
        self._fetch_into = fetch_into
        self.size = size
        self.cache = cache
        self.name = name
        cfg = config or BlockConfig()
        ra = cfg.readahead or ReadaheadConfig()
        # Nothing may exceed what the cache can reserve next to other users.
        cap = max(64 * KiB, cache.limit // 8)
        cfg.part_size = max(64 * KiB, min(cfg.part_size, cap))
        # Requests a reader waits for are not reserved (they must never wait on the cache): all
        # foreground workers' parts together stay within a quarter of it, the bound's allowance
        # for bytes in flight outside the cache (8 parts of 1/8 were a whole cache's worth).
        self.foreground_part = max(
            64 * KiB, min(cfg.part_size, cache.limit // (4 * max(1, cfg.foreground_workers)))
        )
        cfg.min_parallel_part = min(cfg.min_parallel_part, self.foreground_part)
        ra.max_window = max(ra.min_window, min(ra.max_window, cache.limit // 4))
        self.config = cfg
        self.readahead = ra
        self._tag = object()  # cache keys of this layer cannot collide with anyone else's
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted starts of disjoint spans
        self._spans: dict[int, _Span] = {}
        self._sweep_at = 4096
        self._streams = StreamTable(ra)
        self._probes = ProbeLearner(ra)
        self._fg_pool: ThreadPoolExecutor | None = None
        self._pf_pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False
        self.stats = BlockStats()
        pool = BufferPool(cache, cfg.part_size) if fetch_into is not None else None
        self._buffers = pool if pool is not None and pool.enabled else None
        forksafe.register(self)

    # -- public ----------------------------------------------------------------
    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset`` (the caller checked the bounds)."""
        if length <= 0:
            return b""
        return _assemble(self._pieces(offset, length), offset, offset + length)

    def read_into(self, offset: int, out) -> int:
        """Fill the writable buffer ``out`` with the bytes at ``offset``; returns ``len(out)``.

        The copy goes straight from the cached spans into ``out`` (a FUSE reply
        buffer, say): no intermediate ``bytes`` object, so no allocation of the
        read's size per call.
        """
        out = memoryview(out).cast("B")
        length = len(out)
        if length:
            _copy_into(self._pieces(offset, length), offset, out)
        return length

    def _pieces(self, offset: int, length: int) -> list[tuple[int, bytes]]:
        if self._closed:
            raise SourceError(f"{self.name}: source is closed")
        self.stats.reads += 1
        self.stats.read_bytes += length
        stream, ahead = self._streams.observe(offset, length, self.size)
        expand = self._probes.observe(offset, length)
        pieces, own, waits = self._plan(offset, offset + length, expand)
        self._submit([span for span, _ in own])
        if ahead is not None:  # queue the prefetch before waiting: it overlaps with our own requests
            self._prefetch(ahead[0], ahead[1], stream)
        pieces = self._collect(pieces, own + waits)
        if stream.prefetched:
            self._drop_behind(stream)
        return pieces

    def seed(self, start: int, data: bytes) -> None:
        """Insert bytes fetched elsewhere (the suffix read when the object was opened)."""
        end = start + len(data)
        with self._lock:
            if self._overlaps(start, end):
                return
            span = _Span(self._tag, start, end, DONE, False)
            if self.cache.put(span.key, data):
                self._insert(span)

    def close(self) -> None:
        self._closed = True
        self._shutdown_pools(wait=False)
        if self._buffers is not None:
            self._buffers.close()
        with self._lock:
            spans = list(self._spans.values())
            self._starts.clear()
            self._spans.clear()
        for span in spans:
            if span.state == DONE:
                self.cache.discard(span.key)
            else:
                span.cancelled = True
                _settle(span, exc=SourceError(f"{self.name}: source closed during the read"))

    # -- reading ------------------------------------------------------------------
    def _submit(self, own: list[_Span]) -> None:
        for span in own:
            self._start(span, self._run_foreground, prefetch=False)

    def _start(self, span: _Span, run: Callable[[_Span], None], prefetch: bool) -> None:
        """Hand ``span`` to a pool thread, or fail it as close() does when the source is closed.

        A pool can be shut down between taking it and submitting to it (a fork's hook, close):
        the span then went to no thread and its readers waited for ever. A fresh pool takes it.
        """
        for _ in range(3):
            try:
                pool = self._pool(prefetch)
            except RuntimeError:  # closed
                break
            try:
                pool.submit(run, span)
                return
            except RuntimeError:  # "cannot schedule new futures after shutdown"
                with self._pool_lock:
                    if self._fg_pool is pool:
                        self._fg_pool = None
                    if self._pf_pool is pool:
                        self._pf_pool = None
        with self._lock:
            span.cancelled = True
            self._remove_if_indexed(span)
        _settle(span, exc=SourceError(f"{self.name}: source closed during the read"))

    @staticmethod
    def _collect(pieces: list, waiters: list[_Waiter]) -> list[tuple[int, bytes]]:
        """Wait for our requests and the ones we share: with ``pieces``, all that cover the read.

        The futures were taken when the read was planned: a span lets go of its
        future once settled (so bytes the cache evicts are not kept alive by the
        span index), and a span dropped behind a stream meanwhile still hands
        its bytes to the readers that were waiting for it. A failed request
        (already retried to the end of its budget by the fetch function) fails
        the reads that waited for it, prefetch or not: retrying here would give
        those reads a second full budget.
        """
        for span, fut in waiters:
            pieces.append((span.start, fut.result()))
        return pieces

    def _plan(self, offset: int, end: int, expand: int) -> tuple[list, list[_Waiter], list[_Waiter]]:
        """Under the lock: what is cached, what is in flight, and register fetches for the rest."""
        pieces: list[tuple[int, bytes]] = []
        waits: list[_Waiter] = []
        own: list[_Waiter] = []
        with self._lock:
            starts = self._starts
            i = max(bisect.bisect_right(starts, offset) - 1, 0)
            j = bisect.bisect_left(starts, end)
            gaps: list[list[int]] = []
            pos = offset
            takeover = 0
            for start in starts[i:j]:
                span = self._spans[start]
                if span.end <= pos:
                    continue
                if span.state == DONE:
                    data = self.cache.get(span.key)
                    if data is None:  # evicted: forget it, its range becomes a gap
                        self._remove(span)
                        continue
                    piece: tuple | None = (span.start, data)
                elif span.state == PENDING:  # not started: take all of it over (we read sequentially)
                    span.cancelled = True
                    self.stats.prefetch_cancelled += 1
                    self._remove(span)
                    takeover = max(takeover, span.end)
                    continue
                else:
                    piece = None
                    waits.append((span, span.future))  # type: ignore[arg-type]
                if span.start > pos:
                    gaps.append([pos, span.start])
                if piece is not None:
                    pieces.append(piece)
                pos = span.end
                if pos >= end:
                    break
            if pos < end:
                gaps.append([pos, max(end, takeover)])
            if gaps and expand and gaps[-1][1] == end:
                # A header probe that misses: fetch what usually follows it in the same request.
                limit = min(self.size, offset + expand, self._next_start(end))
                gaps[-1][1] = max(end, limit)
            budget = self.config.request_budget
            workers = max(1, self.config.foreground_workers)
            for lo, hi in gaps:
                for plo, phi in self._split(lo, hi):
                    span = _Span(self._tag, plo, phi, FETCHING, False)
                    if budget and len(own) >= workers:
                        # Queued behind this read's own first parts: a 2 GiB read is not one
                        # request, and must not fit in one request's deadline.
                        span.since += (len(own) // workers) * budget
                    self._insert(span)
                    own.append((span, span.future))  # type: ignore[arg-type]
        return pieces, own, waits

    def _split(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Parts of a missing range: at most ``foreground_part``, spread over the pool when large."""
        cfg = self.config
        n = hi - lo
        parts = -(-n // self.foreground_part)
        if n >= 2 * cfg.min_parallel_part:
            parts = max(parts, min(cfg.foreground_workers, n // cfg.min_parallel_part))
        step = -(-n // parts)
        return [(p, min(p + step, hi)) for p in range(lo, hi, step)]

    def _run_foreground(self, span: _Span) -> None:
        try:
            data = self._fetch(span.start, span.end, span.since)
            # In the try too: an exception from a cache hook must not leave the span's readers
            # waiting on a future nobody settles.
            cached = self.cache.put(span.key, data)
        except BaseException as exc:
            with self._lock:
                self._remove_if_indexed(span)
            _settle(span, exc=exc)
            return
        with self._lock:
            # Closed meanwhile: close() failed this span's readers and cleared the cache of its
            # spans, so bytes put now would stay there. Taken out under the lock close() takes too.
            if self._closed:
                self.cache.discard(span.key)
                cached = False
            self.stats.fetches += 1
            self.stats.fetched_bytes += len(data)
            if cached and self._spans.get(span.start) is span:
                span.state = DONE
            else:
                self._remove_if_indexed(span)
        _settle(span, data)

    # -- prefetch ---------------------------------------------------------------
    def _prefetch(self, lo: int, hi: int, stream: Stream) -> None:
        part = self.config.part_size
        new: list[_Span] = []
        with self._lock:
            starts = self._starts
            i = max(bisect.bisect_right(starts, lo) - 1, 0)
            pos = lo
            gaps = []
            for start in starts[i:]:
                if start >= hi:
                    break
                span = self._spans[start]
                if span.end <= pos:
                    continue
                if span.start > pos:
                    gaps.append((pos, span.start))
                pos = span.end
            if pos < hi:
                gaps.append((pos, hi))
            for glo, ghi in gaps:
                for p in range(glo, ghi, part):
                    span = _Span(self._tag, p, min(p + part, ghi), PENDING, True)
                    self._insert(span)
                    new.append(span)
                    stream.prefetched.append(span)
        for span in new:
            self._start(span, self._run_prefetch, prefetch=True)

    def _run_prefetch(self, span: _Span) -> None:
        cache = self.cache
        n = span.end - span.start
        with self._lock:
            if span.cancelled or self._spans.get(span.start) is not span:
                return
            if cache.reserved + n > cache.limit * self.config.prefetch_headroom:
                span.cancelled = True  # the cache is busy with decodes: do not compete
                self.stats.prefetch_cancelled += 1
                self._remove(span)
                return
        # A full part is received into a reusable buffer; other sizes into what the fetch allocates.
        buffers = self._buffers if self._buffers is not None and n == self._buffers.size else None
        spare = buffers.take() if buffers is not None else None
        buf, room = spare if spare is not None else (None, cache.hold(n))
        assert room is not None  # hold() waits for room
        try:
            with self._lock:
                if span.cancelled or self._spans.get(span.start) is not span:
                    return
                span.state = FETCHING
            span.since = time.monotonic()  # no reader waited for it while it was queued
            try:
                if buffers is not None:
                    if buf is None:
                        buf = bytearray(n)
                    else:
                        self.stats.buffers_reused += 1
                    self._fetch_into(span.start, span.end, memoryview(buf), span.since)
                    data = buf
                else:
                    data = self._fetch(span.start, span.end, span.since)
                room.commit(span.key, data)  # in the try: as in _run_foreground
            except BaseException as exc:
                log.debug("%s: prefetch of %d-%d failed: %s", self.name, span.start, span.end, exc)
                with self._lock:
                    self._remove_if_indexed(span)
                _settle(span, exc=exc)
                return
        finally:
            room.release()
        with self._lock:
            if self._closed:  # as in _run_foreground: closed meanwhile, so not kept (not readable)
                self.cache.discard(span.key)
            self.stats.prefetches += 1
            self.stats.prefetched_bytes += len(data)
            if self._spans.get(span.start) is span:
                span.state = DONE
        _settle(span, data)

    def _drop_behind(self, stream: Stream) -> None:
        """Forget prefetched spans the stream has left well behind."""
        lag = 2 * self.config.part_size
        dropped: list = []
        with self._lock:
            q = stream.prefetched
            while q and q[0].end + lag < stream.next:
                span = q[0]
                if span.state == DONE and not _settled(span):
                    break  # its fetch thread has yet to hand the bytes to waiting readers: next time
                q.popleft()
                if span.state == DONE and self._spans.get(span.start) is span:
                    self._remove(span)
                    dropped.append(self.cache.pop(span.key))
                    self.stats.dropped_behind += 1
        if dropped and self._buffers is not None:
            self._buffers.recycle(dropped)

    # -- index (caller holds self._lock) -------------------------------------------
    def _insert(self, span: _Span) -> None:
        bisect.insort(self._starts, span.start)
        self._spans[span.start] = span
        if len(self._spans) > self._sweep_at:
            self._sweep()

    def _remove(self, span: _Span) -> None:
        del self._spans[span.start]
        i = bisect.bisect_left(self._starts, span.start)
        del self._starts[i]

    def _remove_if_indexed(self, span: _Span) -> None:
        if self._spans.get(span.start) is span:
            self._remove(span)

    def _overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0 and self._spans[self._starts[i]].end > start:
            return True
        return i + 1 < len(self._starts) and self._starts[i + 1] < end

    def _next_start(self, pos: int) -> int:
        i = bisect.bisect_left(self._starts, pos)
        return self._starts[i] if i < len(self._starts) else self.size

    def _sweep(self) -> None:
        """Drop index entries whose bytes the LRU evicted (the cache does not tell us)."""
        for span in list(self._spans.values()):
            if span.state == DONE and self.cache.peek(span.key) is None:
                self._remove(span)
        self._sweep_at = max(4096, 2 * len(self._spans))

    # -- pools and fork -----------------------------------------------------------
    def _pool(self, prefetch: bool) -> ThreadPoolExecutor:
        """The pool for fetches (made on first use, and again after a fork); RuntimeError once closed."""
        with self._pool_lock:
            if self._closed:  # a pool made now would never be shut down
                raise RuntimeError(f"{self.name}: closed")
            if prefetch:
                if self._pf_pool is None:
                    self._pf_pool = ThreadPoolExecutor(
                        self.config.prefetch_workers, thread_name_prefix="cdmlfs-prefetch"
                    )
                return self._pf_pool
            if self._fg_pool is None:
                self._fg_pool = ThreadPoolExecutor(
                    self.config.foreground_workers, thread_name_prefix="cdmlfs-fetch"
                )
            return self._fg_pool

    def _shutdown_pools(self, wait: bool) -> None:
        with self._pool_lock:
            fg, pf = self._fg_pool, self._pf_pool
            self._fg_pool = self._pf_pool = None
        if pf is not None:
            pf.shutdown(wait=wait, cancel_futures=True)  # queued prefetches are PENDING: nobody waits
        if fg is not None:
            # Readers wait on these: on close their spans were failed already ("source closed"), so
            # queued ones go (a closed archive kept downloading what nobody would read); before a
            # fork every queued one runs.
            fg.shutdown(wait=wait, cancel_futures=self._closed)

    def _before_fork(self) -> None:
        # Let running requests finish: afterwards no pool thread holds our lock or the cache's.
        self._shutdown_pools(wait=True)
        with self._lock:
            for span in list(self._spans.values()):
                if span.state == PENDING:  # its task was cancelled with the pool
                    span.cancelled = True
                    self._remove(span)

    def _after_fork_child(self) -> None:
        self._lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._fg_pool = self._pf_pool = None
        # In-flight spans belong to the parent's threads: their futures would never complete here.
        for span in list(self._spans.values()):
            if span.state != DONE:
                self._remove(span)
        self._streams = StreamTable(self.readahead)
        self._probes = ProbeLearner(self.readahead)

    def __repr__(self) -> str:
        return f"BlockLayer({self.name!r}, spans={len(self._spans)}, pid={os.getpid()})"


def _settled(span: _Span) -> bool:
    # A function, not a local in the caller: a reference to the finished future would keep its
    # bytes referenced, and BufferPool.recycle would (rightly) refuse the buffer.
    fut = span.future
    return fut is None or fut.done()


def _settle(span: _Span, data: bytes | None = None, exc: BaseException | None = None) -> None:
    """Complete a span's future once (close() may have failed it already), then let go of it.

    The readers that wait took the future when they planned; the span itself
    must not keep it, or the bytes would stay referenced after the cache evicts
    them, for as long as the span stays in the index (measured: a 16 MiB cache,
    random 1 MiB reads of a 1 GiB object, 814 MiB of RSS).
    """
    fut = span.future
    if fut is None:
        return
    span.future = None
    if fut.done():
        return
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(data)
    except InvalidStateError:
        pass


def _copy_into(pieces: list[tuple[int, bytes]], offset: int, out: memoryview) -> None:
    """Copy [offset, offset + len(out)) out of the covering pieces into ``out``."""
    end = offset + len(out)
    filled = 0
    for start, data in sorted(pieces, key=lambda p: p[0]):
        lo = max(offset - start, 0)
        hi = min(end - start, len(data))
        if hi > lo:
            at = start + lo - offset
            out[at : at + hi - lo] = memoryview(data)[lo:hi]
            filled += hi - lo
    if filled != len(out):
        raise SourceError(f"internal error: filled {filled} bytes instead of {len(out)}")


def _assemble(pieces: list[tuple[int, bytes]], offset: int, end: int) -> bytes:
    """The bytes of [offset, end) out of spans that cover it (each given by its start)."""
    if len(pieces) == 1:
        start, data = pieces[0]
        lo = offset - start
        if lo == 0 and len(data) == end - offset:
            return data if type(data) is bytes else bytes(data)
        return bytes(data[lo : lo + end - offset])
    pieces.sort(key=lambda p: p[0])
    views = []
    for start, data in pieces:
        lo = max(offset - start, 0)
        hi = min(end - start, len(data))
        if hi > lo:
            views.append(memoryview(data)[lo:hi])
    out = b"".join(views)
    if len(out) != end - offset:
        raise SourceError(f"internal error: assembled {len(out)} bytes instead of {end - offset}")
    return out
