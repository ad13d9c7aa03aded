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
* **Open bodies (zero copy).** When the source can send a request and hand back
  its reply unread (``open_range``), large prefetch parts stop at the reply's
  headers: the body waits in the kernel's socket buffer, and the reader that
  gets there receives it straight into its own buffer (``read_into``). Measured
  on a 1 GiB scan over loopback: received into a part buffer and copied out,
  the copy from memory written long before was 73% of the client's CPU beyond
  raw GETs. Anything else that meets an open body (a read starting inside it, a
  ``read`` that wants ``bytes``, a second reader waiting) receives what it needs
  into a cached span as before; a body that fails is dropped and its bytes are
  fetched the ordinary way, retries and all. A stream read by several threads
  out of order (a multithreaded FUSE loop serving kernel readahead) prefetches
  into buffers again once seen: through a mount, with open bodies, readers
  waited on each other's bodies (647 vs 1,063 MiB/s).
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
from typing import Protocol

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
OPEN = 3  # a reply whose body is unread, positioned at the span's start (see open_range)

# fetch(start, end, since): bytes [start, end), or raises. ``since`` is when a read first asked
# for them (time.monotonic()): a request queued for a free worker has spent that much of the
# read's deadline already (a prefetch's read begins when its request starts).
Fetch = Callable[[int, int, float], bytes]
_Waiter = tuple["_Span", Future]  # a span being fetched, and the future its readers took when planning
FetchInto = Callable[[int, int, memoryview, float], None]  # fills the buffer with bytes [start, end)


class OpenBody(Protocol):
    """A reply to a ranged request whose body is received a piece at a time, in order."""

    def readinto(self, out: memoryview) -> None:
        """Exactly ``len(out)`` next bytes of the body into ``out``, or raise."""

    def finish(self) -> None:
        """The body was read to its end: the connection may serve again."""

    def close(self) -> None:
        """Give up on the rest of the body (the connection is dropped)."""


# open_range(start, end, since): the checked reply for bytes [start, end), body unread; or raises.
OpenRange = Callable[[int, int, float], OpenBody]
STASH_MAX = 2 * MiB  # bytes before a read inside an open body kept for another reader; more are skipped
OUT_OF_ORDER = 64 * KiB  # a read this far inside an open body came before the one it follows
OPEN_IDLE = 5.0  # seconds an open body may wait for its reader once all may be open are


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
    open_min: int = 1 * MiB  # prefetch parts at least this large stay open bodies (with open_range)
    max_open: int | None = None  # open bodies at once (each holds a connection); None: prefetch_workers


class _Span:
    __slots__ = (
        "body",
        "cancelled",
        "claimed",
        "end",
        "future",
        "key",
        "prefetch",
        "since",
        "start",
        "state",
        "waiters",
    )

    def __init__(self, tag: object, start: int, end: int, state: int, prefetch: bool) -> None:
        self.start = start
        self.end = end
        self.since = time.monotonic()  # when a reader asked for it (see Fetch)
        self.key = (tag, start, end)
        self.state = state
        self.prefetch = prefetch
        self.cancelled = False
        self.future: Future | None = Future() if state != DONE else None
        self.waiters = 0  # readers that took the future (an open body then goes to a buffer for them)
        self.body: OpenBody | None = None  # state OPEN: the reply, positioned at ``start``
        self.claimed = False  # bytes of an open body a reader is receiving (see _claim)

    def move_start(self, tag: object, start: int) -> None:
        """Consumed up to ``start`` (the caller took the span out of the index to do this)."""
        self.start = start
        self.key = (tag, start, self.end)


class _Claim:
    """What one reader took from an open body: bytes it drops, keeps for others, receives itself."""

    __slots__ = ("body", "direct", "hi", "keep_from", "rest", "start", "stash")

    def __init__(self, body, start, keep_from, stash, direct, hi, rest) -> None:
        self.body: OpenBody = body
        self.start = start  # where the body is positioned
        self.keep_from = keep_from  # [start, keep_from) is skipped
        self.stash: _Span | None = stash  # [keep_from, direct) into a cached span
        self.direct = direct  # [direct, hi) into the reader's buffer
        self.hi = hi
        self.rest: _Span | None = rest  # [hi, end): open again afterwards, or received for waiters


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
        self.bodies_opened = 0  # prefetch parts left as open bodies
        self.streamed_bytes = 0  # bytes received straight into a reader's buffer from open bodies
        self.stashed_bytes = 0  # bytes of open bodies received into cached spans for other readers
        self.skipped_bytes = 0  # bytes of open bodies received and dropped (a read far inside one)
        self.bodies_failed = 0  # open bodies that failed: their bytes were fetched again
        self.bodies_dropped = 0  # open bodies closed unread (dropped behind, closed, too old)

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
        open_range: OpenRange | None = None,
    ) -> None:
        self._fetch = fetch
        self._fetch_into = fetch_into
        self._open_range = open_range
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
        if cfg.max_open is None:
            cfg.max_open = cfg.prefetch_workers
        self.config = cfg
        self.readahead = ra
        self._open = 0  # open bodies (in the index, or being received by a reader)
        self._closing: list[OpenBody] = []  # open bodies let go under the lock, closed outside it
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
        return _assemble(self._pieces(offset, length)[0], offset, offset + length)

    def read_into(self, offset: int, out) -> int:
        """Fill the writable buffer ``out`` with the bytes at ``offset``; returns ``len(out)``.

        The copy goes straight from the cached spans into ``out`` (a FUSE reply
        buffer, say): no intermediate ``bytes`` object, so no allocation of the
        read's size per call.
        """
        out = memoryview(out).cast("B")
        length = len(out)
        if length:
            pieces, direct = self._pieces(offset, length, out)
            _copy_into(pieces, offset, out, direct)
        return length

    def _pieces(self, offset: int, length: int, out: memoryview | None = None) -> tuple[list, int]:
        """The spans that cover the read (waited for), and how many of its bytes were received
        from open bodies straight into ``out`` instead (only when ``out`` is given)."""
        if self._closed:
            raise SourceError(f"{self.name}: source is closed")
        began = time.monotonic()
        self.stats.reads += 1
        self.stats.read_bytes += length
        stream, ahead = self._streams.observe(offset, length, self.size)
        expand = self._probes.observe(offset, length)
        pieces, own, waits, claims = self._plan(offset, offset + length, expand, out is not None, stream)
        failed: BaseException | None = None
        try:
            self._submit([span for span, _ in own])
            if ahead is not None:  # queue the prefetch before waiting: it overlaps with our own requests
                # Open bodies only for a reader with a buffer of its own: one that wants ``bytes``
                # would have each piece received into a fresh buffer instead of prefetched parts.
                self._prefetch(ahead[0], ahead[1], stream, opens=out is not None and not stream.shared)
        except BaseException as exc:
            failed = exc
        direct = 0
        left = list(claims)
        try:
            while left:  # each one, whatever happens: others may wait for the spans it owns
                claim = left.pop(0)
                try:
                    direct += self._receive(claim, offset, out, began)
                except BaseException as exc:
                    failed = failed or exc
        finally:
            for claim in left:  # an interrupt between two claims: let the others go too
                self._release(claim, failed or SourceError(f"{self.name}: read interrupted"))
        if failed is not None:
            raise failed
        pieces = self._collect(pieces, own + waits)
        if stream.prefetched:
            self._drop_behind(stream)
        return pieces, direct

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
            elif span.state == OPEN:
                if span.body is not None:
                    self._body_done(span.body, finished=False)
                    span.body = None
            else:
                span.cancelled = True
                _settle(span, exc=SourceError(f"{self.name}: source closed during the read"))

    # -- reading ------------------------------------------------------------------
    def _submit(self, own: list[_Span]) -> None:
        done = 0
        try:
            for span in own:
                self._start(span, self._run_foreground, prefetch=False)
                done += 1
        except BaseException as exc:  # (an interrupt): the rest would be waited for by nobody's request
            for span in own[done:]:
                self._abandon(span, exc)
            raise

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

    def _plan(
        self, offset: int, end: int, expand: int, direct: bool, stream: Stream
    ) -> tuple[list, list, list, list]:
        """Under the lock: what is cached, what is in flight, what this reader takes from open
        bodies (into ``out`` when ``direct``), and register fetches for the rest."""
        pieces: list[tuple[int, bytes]] = []
        waits: list[_Waiter] = []
        own: list[_Waiter] = []
        claims: list[_Claim] = []
        with self._lock:
            starts = self._starts
            i = max(bisect.bisect_right(starts, offset) - 1, 0)
            j = bisect.bisect_left(starts, end)
            gaps: list[list[int]] = []
            pos = offset
            takeover = 0
            for start in starts[i:j]:
                span = self._spans.get(start)  # (a claim's insert may have swept it out meanwhile)
                if span is None or span.end <= pos:
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
                elif span.state == OPEN:
                    if span.start > pos:
                        gaps.append([pos, span.start])
                    claim = self._claim(span, offset, min(end, span.end), direct)
                    claims.append(claim)
                    if claim.stash is not None:  # dropped behind the reader like its body's other bytes
                        stream.prefetched.append(claim.stash)
                        # A read into a buffer far ahead of the body's position: one issued before
                        # the read it follows (not a ZIP member's data after its local header).
                        if direct and claim.stash.end - claim.stash.start >= OUT_OF_ORDER:
                            stream.shared = True
                    if claim.stash is not None and not direct:  # the read's bytes come through it
                        claim.stash.waiters += 1
                        waits.append((claim.stash, claim.stash.future))  # type: ignore[arg-type]
                    pos = claim.hi
                    if pos >= end:
                        break
                    continue
                else:
                    piece = None
                    span.waiters += 1
                    waits.append((span, span.future))  # type: ignore[arg-type]
                    if span.claimed:  # another reader is receiving it: this stream is shared
                        stream.shared = True
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
                    if stream.window:  # a scan's bytes (queued prefetches it took over, say): dropped
                        stream.prefetched.append(span)  # behind it like the ones prefetched for it
        return pieces, own, waits, claims

    def _claim(self, span: _Span, offset: int, hi: int, direct: bool) -> _Claim:
        """Under the lock: take [span.start, hi) of an open body for this read (see _Claim).

        With ``direct`` the read's own bytes are received into its buffer and only
        those before it (a read starting inside the body) go to a cached span, when
        few; otherwise they all go to a cached span the read waits for. The rest of
        the body is in the index meanwhile as a span being fetched: readers that
        want it wait, and then get it received for them.
        """
        start = span.start
        body = span.body
        assert body is not None
        span.body = None
        self._remove(span)
        keep_from = start if offset - start <= STASH_MAX else offset
        stash_to = max(start, offset) if direct else hi
        stash = None
        if stash_to > keep_from:
            stash = _Span(self._tag, keep_from, stash_to, FETCHING, False)
            stash.claimed = True
            self._insert(stash)
        rest = None
        if hi < span.end:
            span.move_start(self._tag, hi)
            span.state = FETCHING
            span.future = Future()
            span.waiters = 0
            span.since = time.monotonic()  # readers that wait for it count their deadline from now
            span.claimed = True
            self._insert(span)
            rest = span
        else:
            span.state = FETCHING  # all taken: out of the index; drop-behind just forgets it
        return _Claim(body, start, keep_from, stash, stash_to if direct else hi, hi, rest)

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
        self.stats.fetches += 1
        self.stats.fetched_bytes += len(data)
        self._commit(span, data, cached)

    # -- open bodies ---------------------------------------------------------------
    def _receive(self, claim: _Claim, offset: int, out: memoryview | None, since: float) -> int:
        """Carry out a claim on this reader's thread; the bytes received into ``out``.

        ``since``: when the read began (a failed body's bytes are fetched again within the
        read's deadline, counted from then). Whatever happens, the spans the claim owns are
        settled and the body is finished, closed or handed on: readers may wait for them.
        """
        body = claim.body
        stash = claim.stash
        rest = claim.rest
        got = None
        try:
            if claim.keep_from > claim.start:
                _skip(body, claim.keep_from - claim.start)
                self.stats.skipped_bytes += claim.keep_from - claim.start
            if stash is not None:
                got = bytearray(stash.end - stash.start)
                body.readinto(memoryview(got))
            if claim.hi > claim.direct:
                assert out is not None
                body.readinto(out[claim.direct - offset : claim.hi - offset])
        except Exception as exc:
            log.debug("%s: open body at %d failed (%s): fetched again", self.name, claim.start, exc)
            self.stats.bodies_failed += 1
            self._body_done(body, finished=False)
            return self._refetch(claim, offset, out, since)
        except BaseException as exc:  # KeyboardInterrupt...: not a failed body, the read ends here
            self._release(claim, exc)
            raise
        try:
            if stash is not None:
                self._commit(stash, got)
                self.stats.stashed_bytes += len(got)  # type: ignore[arg-type]
            self.stats.streamed_bytes += claim.hi - claim.direct
            if rest is None:
                body, done = None, body
                self._body_done(done, finished=True)
                return claim.hi - claim.direct
            with self._lock:
                live = not self._closed and self._spans.get(rest.start) is rest
                keep = live and not rest.waiters
                if keep:
                    rest.state = OPEN
                    rest.body, body = body, None
                    rest.future = None  # nobody took it: no reader waits on it
                    rest.since = time.monotonic()
        except BaseException as exc:
            if body is not None:
                self._body_done(body, finished=False)
            self._abandon(stash, exc)
            self._abandon(rest, exc)
            raise
        if body is not None and not live:  # closed meanwhile: close() failed its readers already
            self._body_done(body, finished=False)
            _settle(rest, exc=SourceError(f"{self.name}: source closed during the read"))
        elif body is not None:
            self._fill(rest, body)  # readers wait for the rest: receive it for them
        return claim.hi - claim.direct

    def _release(self, claim: _Claim, exc: BaseException) -> None:
        """A claim this read will not carry out: its body closed, its spans' readers failed."""
        self._body_done(claim.body, finished=False)
        self._abandon(claim.stash, exc)
        self._abandon(claim.rest, exc)

    def _abandon(self, span: _Span | None, exc: BaseException) -> None:
        """A span this thread owed its readers will not come: out of the index, its readers failed."""
        if span is None:
            return
        with self._lock:
            self._remove_if_indexed(span)
        if not isinstance(exc, Exception):  # an interrupt is this thread's: others get a plain error
            exc = SourceError(f"{self.name}: the read that was receiving these bytes was interrupted")
        _settle(span, exc=exc)

    def _refetch(self, claim: _Claim, offset: int, out: memoryview | None, since: float) -> int:
        """A claim's body failed: fetch what this read and any waiting readers need, with retries."""
        try:
            if claim.hi > claim.direct:
                assert out is not None
                self._fetch_to(claim.direct, claim.hi, out[claim.direct - offset : claim.hi - offset], since)
        finally:
            self._settle_claimed(claim)
        return claim.hi - claim.direct

    def _fetch_to(self, start: int, end: int, view: memoryview, since: float) -> None:
        """Bytes [start, end) into ``view`` the ordinary way (a request, with retries)."""
        if self._fetch_into is not None:
            self._fetch_into(start, end, view, since)
        else:
            view[:] = self._fetch(start, end, since)

    def _settle_claimed(self, claim: _Claim) -> None:
        """The spans a failed claim owed: fetched for the readers that wait, else forgotten."""
        for span in (claim.stash, claim.rest):
            if span is None:
                continue
            with self._lock:
                wanted = span.waiters > 0 and self._spans.get(span.start) is span
                if not wanted:
                    self._remove_if_indexed(span)
            if wanted:
                self._run_foreground(span)  # settles it, whatever happens
            else:
                _settle(span, exc=SourceError(f"{self.name}: internal error: nobody waits for this span"))

    def _fill(self, span: _Span, body: OpenBody) -> None:
        """Readers wait for the rest of an open body: receive it into a cached span for them.

        Never waits on the cache (a waiting reader may hold a decode reservation: see the module
        docstring): the bytes are put, as a foreground fetch's are, or only handed to the readers.
        Settles the span and finishes or closes the body whatever happens.
        """
        n = span.end - span.start
        room = None
        try:
            buffers = self._buffers if self._buffers is not None and n == self._buffers.size else None
            spare = buffers.take() if buffers is not None else None
            if spare is not None:
                buf, room = spare
            else:
                buf = bytearray(n)
            try:
                body.readinto(memoryview(buf))
            except Exception as exc:
                log.debug("%s: open body at %d failed (%s): fetched again", self.name, span.start, exc)
                self.stats.bodies_failed += 1
                body, failed = None, body
                self._body_done(failed, finished=False)
                self._fetch_to(span.start, span.end, memoryview(buf), span.since)
            if body is not None:
                body, done = None, body
                self._body_done(done, finished=True)
            if room is not None:
                room.commit(span.key, buf)
                self._commit(span, buf, cached=True)
            else:
                self._commit(span, buf)
        except BaseException as exc:
            if body is not None:
                self._body_done(body, finished=False)
            self._abandon(span, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            if room is not None:
                room.release()

    def _commit(self, span: _Span, data, cached: bool | None = None) -> None:
        """Bytes of a span this thread received: into the cache (unless ``cached`` says whether
        they are already), the index, then to the readers waiting for them."""
        if cached is None:
            cached = self.cache.put(span.key, data)
        with self._lock:
            # Closed meanwhile: close() failed this span's readers and cleared the cache of its
            # spans, so bytes put now would stay there. Taken out under the lock close() takes too.
            if self._closed:
                self.cache.discard(span.key)
                cached = False
            if cached and self._spans.get(span.start) is span:
                span.state = DONE
            else:
                self._remove_if_indexed(span)
        _settle(span, data)

    def _body_done(self, body: OpenBody, finished: bool) -> None:
        try:
            if finished:
                body.finish()
            else:
                body.close()
        except Exception as exc:  # closing a socket must not fail a read that has its bytes
            log.debug("%s: closing a reply body: %s", self.name, exc)
        finally:
            with self._lock:
                self._open -= 1

    def _run_open_prefetch(self, span: _Span) -> None:
        """A prefetch that stops at the reply's headers: the body stays open for the reader."""
        with self._lock:
            if span.cancelled or self._spans.get(span.start) is not span:
                return
            limit = self.config.max_open or 0
            if self._open >= limit:
                self._close_stale_open(time.monotonic() - OPEN_IDLE)
            opened = self._open < limit
            if opened:  # (no cache reservation: an open body holds no memory of ours)
                self._open += 1
                span.state = FETCHING
        self._close_dropped()
        if not opened:  # as many bodies open as allowed: receive this one into a buffer
            self._run_prefetch(span)
            return
        span.since = time.monotonic()
        try:
            body = self._open_range(span.start, span.end, span.since)  # type: ignore[misc]
        except BaseException as exc:
            log.debug("%s: prefetch of %d-%d failed: %s", self.name, span.start, span.end, exc)
            with self._lock:
                self._open -= 1
                self._remove_if_indexed(span)
            _settle(span, exc=exc)
            return
        with self._lock:
            live = not self._closed and not span.cancelled and self._spans.get(span.start) is span
            keep = live and not span.waiters
            if keep:
                span.state = OPEN
                span.body = body
                span.future = None  # nobody took it: no reader waits on it
                span.since = time.monotonic()
                self.stats.bodies_opened += 1
        if keep:
            return
        if not live:
            self._body_done(body, finished=False)
            return
        self._fill(span, body)  # a reader got there first and waits

    def _close_open(self, span: _Span) -> None:
        """Caller holds the lock: an open body nobody will read is closed (outside the lock)."""
        body, span.body = span.body, None
        self._remove_if_indexed(span)
        span.state = FETCHING  # not DONE: nothing in the cache under its key
        if body is not None:
            self.stats.bodies_dropped += 1
            self._closing.append(body)

    def _close_stale_open(self, before: float) -> None:
        """Caller holds the lock: close open bodies untouched since ``before`` (a reader that
        stopped half-way through a large member; its server may have timed the reply out anyway)."""
        for span in [sp for sp in self._spans.values() if sp.state == OPEN and sp.since < before]:
            self._close_open(span)

    def _close_dropped(self) -> None:
        with self._lock:
            bodies, self._closing = self._closing, []
        for body in bodies:
            self._body_done(body, finished=False)

    # -- prefetch ---------------------------------------------------------------
    def _prefetch(self, lo: int, hi: int, stream: Stream, opens: bool = False) -> None:
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
        opens = opens and self._open_range is not None
        for span in new:
            run = self._run_open_prefetch if opens and span.end - span.start >= self.config.open_min else None
            self._start(span, run or self._run_prefetch, prefetch=True)

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
        self.stats.prefetches += 1
        self.stats.prefetched_bytes += len(data)
        self._commit(span, data, cached=True)

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
                elif span.state == OPEN and self._spans.get(span.start) is span:
                    self._close_open(span)  # the reader went past it
        self._close_dropped()
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
        # Open bodies are the parent's connections: let go here, unread and unclosed.
        for span in list(self._spans.values()):
            if span.state != DONE:
                span.body = None
                self._remove(span)
        self._open = 0
        self._closing = []
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


def _skip(body: OpenBody, n: int) -> None:
    """Receive and drop the next ``n`` bytes of ``body``."""
    scratch = memoryview(bytearray(min(n, 256 * KiB)))
    while n > 0:
        k = min(n, len(scratch))
        body.readinto(scratch[:k])
        n -= k


def _copy_into(pieces: list[tuple[int, bytes]], offset: int, out: memoryview, filled: int = 0) -> None:
    """Copy [offset, offset + len(out)) out of the covering pieces into ``out``, where ``filled``
    bytes of it were received into it already (from open bodies)."""
    end = offset + len(out)
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
