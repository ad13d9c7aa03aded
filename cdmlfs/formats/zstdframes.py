"""Zstd frames decoded into pre-faulted buffers, and served before they are finished.

Why this exists: the first read of a member in a 4 MiB frame of a packed
archive used to decode the whole frame (~1.3 ms on the 2-core reference VM)
into freshly allocated memory (another ~1.6 ms of page faults there: 1.5 µs a
page) before answering: 4–5 ms. Two things cut that down:

* **Early members.** ``cdmlfs pack`` stores each member's CRC-32 in the
  archive's index, so a member can be checked on its own. Its first read
  decodes the frame only up to the member's end (half a frame on average),
  checks the member's CRC and answers; a background thread (the other core)
  finishes the frame, checks the frame checksum and puts the frame in the
  cache. Members of foreign archives carry no CRC: they still wait for the
  whole frame and its checksum, so no unverified byte is ever served.
* **No second buffer.** With the C decoder (``cdmlfs._zstdframe``, libzstd's
  stable-output mode) the frame buffer is the decoder's window: no
  window-sized allocation per decoder and no copy out of it; decoders are
  reused. Without the extension, python-zstandard's stream reader does the
  same job with that extra buffer and copy.
* **Finished only when a frame comes back.** A finished frame is cached:
  later reads of its members cost nothing. But finishing a frame at its first
  read costs a whole frame's decode, and a fresh buffer to keep it, at the
  moment readers start frames fastest (a shuffled epoch's start): with two
  cores, the background thread competes with the readers it should serve.
  Measured through the mount (a 420 MB archive, 512 MiB cache, shuffled reads
  back to back): the first read of a frame took 2.45 ms median when every
  frame was finished, 1.99 ms when frames were finished only once they came
  back, for 6% fewer files/s over the epoch (one more prefix decode per
  frame, once). For an archive many times the cache (the 100 GB case) a
  shuffled epoch seldom comes back to a frame before the cache evicts it, and
  finishing doubled the decoding per first read (a 420 MB archive with a
  64 MiB cache, four readers: 3.7–3.8 ms of daemon CPU per read with
  finishing, 2.4 ms without, and 19% more files/s). So frames stay partial: a
  few of them, least recently used let go first, each decoded further only
  when a reader asks for bytes past where it stands (reading in archive order
  stays one pass, and a frame decoded to its end by its readers is cached);
  the buffer of a frame let go serves the next frame (measured: shuffled reads,
  four readers, 2.3 -> 1.4 ms of daemon CPU per read, as making fresh spares
  had taken a third of it). A frame that proves it would stay, started again
  within fewer first reads of other frames than the cache holds frames (every
  frame of an archive the cache holds, read at random; a validation split
  packed together, read each epoch), is finished in the background and cached.
* **Pre-faulted buffers.** Frames are decoded into anonymous mappings. The
  background thread keeps a few spare mappings, already populated, sized for the
  largest frame; a decode takes it (shrunk to the frame) instead of faulting
  fresh pages in the reader's time. A frame evicted from the cache gives its
  mapping straight back to the kernel, so the cache bound is also an RSS bound
  (a partial frame let go lends it to the next frame, within its reservation).
  Not huge pages: ``MADV_HUGEPAGE`` made populating a 4 MiB spare 8x cheaper here
  (1.36 -> 0.17 ms), but with THP defrag at "madvise" the faulting thread compacts
  memory itself, and first reads stalled (medians of 4.8-8.9 ms in some rounds, for
  spares only as for every buffer; measured 2026-12-02).

Memory: every partial frame and the spare hold a cache reservation for their
bytes (:meth:`cdmlfs.cache.ExtentCache.hold`); a finished frame is committed in
place of its reservation. So held + in flight never exceeds the cache limit.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import NamedTuple

import zstandard

from cdmlfs.cache import ExtentCache, Reservation
from cdmlfs.decoders import MAX_WINDOW_LOG
from cdmlfs.errors import CorruptMemberError, MemberError, SourceError
from cdmlfs.sources.base import Source, SourceRange

try:
    from cdmlfs._zstdframe import DecodeError as NativeDecodeError
    from cdmlfs._zstdframe import FrameDecoder as NativeFrameDecoder
    from cdmlfs._zstdframe import populate as native_populate
except ImportError:  # the extension is optional: python-zstandard does the same, a little slower
    NativeFrameDecoder = None  # type: ignore[assignment,misc]
    NativeDecodeError = ValueError  # type: ignore[assignment,misc]
    native_populate = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

MIN_FRAME = 512 << 10  # smaller frames decode whole in one call (a mapping would cost more than it saves)
FINISH_STEP = 512 << 10  # the background thread lets readers of the same frame in after each step
TAIL = 128 << 10  # a reader this close to a frame's end decodes to it (a frame's last member ends before it)
MAX_PARTIAL = 4  # frames in flight at once (being finished, or kept partial)
# "1": finish every frame in the background from its first read; else once it comes back (A/B runs).
FINISH_ENV = os.environ.get("CDMLFS_FINISH_FRAMES", "auto")
MAX_SPARES = 8  # pre-faulted buffers kept ready
INPUT_CHUNK = 64 << 10  # least compressed bytes per source read without a file descriptor (S3)
MAX_INPUT_READ = 2 << 20  # most per read: it is held outside the cache while it is decoded
CLOSE_WAIT = 5.0  # seconds close() waits for a step in progress (a local step takes about a millisecond)
ENABLED = os.environ.get("CDMLFS_FRAME_WORKER", "1") != "0"  # 0: whole decodes only (for A/B runs)
NATIVE = NativeFrameDecoder is not None and os.environ.get("CDMLFS_NATIVE", "1") != "0"


def backend() -> str:
    """Which frame decoder serves (``cdmlfs doctor``)."""
    if NATIVE:
        return "native (cdmlfs._zstdframe, libzstd stable output buffer)"
    if NativeFrameDecoder is None:
        return "python-zstandard (cdmlfs._zstdframe not built)"
    return "python-zstandard (CDMLFS_NATIVE=0)"


def finishes_in_background() -> bool:
    """Whether every frame is finished in the background from its first read (module docstring:
    by default only frames that come back are)."""
    return FINISH_ENV == "1"


class FrameEvicted(Exception):
    """A partial frame was let go before it reached the bytes asked for: decode them another way."""


def new_buffer(size: int, populate: bool = False) -> mmap.mmap:
    """An anonymous private mapping of ``size`` bytes (pages faulted now with ``populate``).

    With the C extension the pages are faulted with the GIL released: ``MAP_POPULATE`` holds it
    for the whole populate (1-2 ms per 4 MiB here), and the spares are made while readers wait
    in Python for it (measured: the first read of a frame spent half its time off the CPU).
    """
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate and native_populate is None:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    buf = mmap.mmap(-1, size, flags=flags)
    if populate and native_populate is not None:
        try:
            native_populate(buf)
        except BaseException:
            buf.close()
            raise
    return buf


class FrameSpan(NamedTuple):
    """Where one frame's compressed bytes are, and what it decodes to."""

    where: str  # for error messages: "zstd frame #i at offset N"
    offset: int
    length: int
    size: int


class _Decode:
    """One frame being decoded forward into its buffer (``pos`` bytes final)."""

    pos = 0

    def advance(self, upto: int) -> None:
        """Make ``upto`` bytes final; at ``upto == size`` also the frame's end and checksum."""
        raise NotImplementedError

    def close(self) -> None:
        """Let go of the buffer (and give the decoder back)."""


class _NativeDecode(_Decode):
    """cdmlfs._zstdframe: libzstd decodes straight into the buffer (GIL released, pread included)."""

    def __init__(self, span: FrameSpan, buffer, worker: Decoders) -> None:
        self._span = span
        self._source = worker.source
        self._fd = worker.fd
        self._worker = worker
        self._dec = worker.native_decoder()
        self._dec.start(buffer)
        self._used = 0  # compressed bytes fed

    def advance(self, upto: int) -> None:
        span, dec = self._span, self._dec
        try:
            # Once the last byte is out, on to the checksum even for a reader who asked for less:
            # an input chunk can end inside it, and a frame is complete only when it was checked.
            while dec.pos < upto or (max(upto, dec.pos) == span.size and not dec.done):
                if self._worker.closed:  # close() gave up waiting for us: no read past it
                    raise _closed_error(span.where)
                left = span.length - self._used
                if left <= 0:
                    raise CorruptMemberError(f"{span.where} ended after {dec.pos} of {span.size} bytes")
                until = upto if dec.pos < upto else span.size
                if self._fd is not None:
                    used = dec.feed_fd(self._fd, span.offset + self._used, left, until)
                    if used <= 0:
                        raise CorruptMemberError(f"{span.where}: the decoder stopped at {dec.pos} bytes")
                    self._used += used
                    with contextlib.suppress(AttributeError):  # read in C, past read_at: for cdmlfs stats
                        self._source.bytes_read += used
                else:
                    # No descriptor (S3): one request for what reaching ``until`` should take at the
                    # frame's compression ratio, plus a margin. A request costs far more than
                    # decoding a little past ``until`` (64 KiB at a time was ~28 GETs a read).
                    want = (until - dec.pos) * span.length // max(span.size, 1) + INPUT_CHUNK
                    n = min(max(want, INPUT_CHUNK), MAX_INPUT_READ, left)
                    dec.feed(self._source.read_at(span.offset + self._used, n))
                    self._used += n
        except NativeDecodeError as exc:
            raise CorruptMemberError(f"corrupt zstd data in {span.where} ({exc})") from None
        except OSError as exc:
            raise SourceError(f"read failed in {span.where}: {exc.strerror}") from exc
        finally:
            self.pos = dec.pos

    def close(self) -> None:
        dec, self._dec = self._dec, None
        if dec is not None:
            dec.release()
            self._worker.give_back(dec)


class _PyDecode(_Decode):
    """python-zstandard's stream reader (decodes via its own window buffer, then copies)."""

    def __init__(self, span: FrameSpan, buffer, worker: Decoders) -> None:
        self._span = span
        self._worker = worker
        self._view = memoryview(buffer)
        dctx = zstandard.ZstdDecompressor(max_window_size=1 << MAX_WINDOW_LOG)
        raw = SourceRange(worker.source, span.offset, span.length)
        self._reader = dctx.stream_reader(raw, read_size=INPUT_CHUNK, read_across_frames=False)

    def advance(self, upto: int) -> None:
        span = self._span
        try:
            while self.pos < upto:
                if self._worker.closed:  # close() gave up waiting for us: no read past it
                    raise _closed_error(span.where)
                n = self._reader.readinto(self._view[self.pos : upto])
                if n <= 0:
                    raise CorruptMemberError(f"{span.where} ended after {self.pos} of {span.size} bytes")
                self.pos += n
            if upto == span.size and self._reader.read(1):  # also makes zstd check the frame checksum
                raise CorruptMemberError(f"{span.where} decodes to more than {span.size} bytes")
        except zstandard.ZstdError as exc:
            if "checksum" in str(exc):  # raised at the frame's end: every byte was written, unverified
                self.pos = span.size
            raise CorruptMemberError(f"corrupt zstd data in {span.where} ({exc})") from None

    def close(self) -> None:
        self._reader = None
        self._view.release()


class PartialFrame:
    """One frame being decoded forward into its buffer; ``done`` bytes of it are final.

    Created locked and registered before its decoder exists, so a second reader
    of the same frame waits for the first instead of starting another decode.
    """

    def __init__(self, key: Hashable, size: int) -> None:
        self.key = key
        self.size = size
        self.where = str(key)
        self.buffer: mmap.mmap | None = None
        self._vlock = threading.Lock()  # views handed out vs letting the buffer go (see slice)
        self.done = 0
        self.complete = False
        self.queued = False
        self.evicted = False
        self.finish = True  # finished in the background once its first reader is served
        self.failed: MemberError | SourceError | None = None
        self.lock = threading.Lock()
        self.lock.acquire()
        self._dec: _Decode | None = None
        self._room: Reservation | None = None

    def ready(self, where: str, buffer: mmap.mmap, dec: _Decode, room: Reservation) -> None:
        """Setup done (by the thread that created it): readers may decode now."""
        self.where = where
        self.buffer = buffer
        self._dec = dec
        self._room = room
        self.lock.release()

    def setup_failed(self, exc: MemberError | SourceError) -> None:
        self.failed = exc
        self.lock.release()

    def advance(self, upto: int) -> None:
        """Decode until at least ``upto`` bytes are final (raises CorruptMemberError)."""
        if self.done >= upto:  # the common case for the frame's later readers: no lock needed
            return
        with self.lock:
            if self.done >= upto:
                return
            if self.failed is not None:
                raise self.failed
            if self.evicted:
                raise FrameEvicted(self.where)
            assert self._dec is not None
            # Close to the end: go there, so the frame is checked and cacheable without the
            # background thread (its last member's readers never ask for the tar padding).
            target = self.size if self.size - upto <= TAIL else upto
            try:
                self._dec.advance(target)
            except MemberError as exc:
                # What was decoded before the failure stays readable: the only readers of a partial
                # frame check each member's CRC (the frame checksum failed, not necessarily they).
                self.done = self._dec.pos
                self.failed = exc
                self.abandon()
                if self.done < upto:
                    raise
                return
            except BaseException as exc:
                # A read error (the frame itself may be fine), or the archive closed: this decoder
                # cannot go on (the native one refuses to after a failed read). Later readers
                # decode the frame afresh.
                self.done = self._dec.pos
                self._let_go()
                # Only the tail rule's extra step failed, past what this reader asked for: serve it.
                if isinstance(exc, Exception) and target > upto and self.done >= upto:
                    return
                raise
            self.done = self._dec.pos
            if self.done == self.size:
                self.complete = True
                self._dec.close()

    def slice(self, lo: int, hi: int) -> memoryview:
        """A view of bytes ``[lo, hi)``, decoded already (``advance`` first).

        Taken under a lock that letting the frame go also takes: a frame let go
        never hands out another view, so once no view of its buffer is left the
        buffer can be reused (``FrameWorker._recycle``).
        """
        with self._vlock:
            if self.evicted or self.buffer is None:
                raise FrameEvicted(self.where)
            return memoryview(self.buffer)[lo:hi]

    def take_buffer(self) -> mmap.mmap | None:
        """The buffer of a frame let go, for reuse; no view is handed out after this."""
        with self._vlock:
            if not self.evicted:
                return None
            buf, self.buffer = self.buffer, None
            return buf

    def commit(self) -> None:
        """Put the finished frame in the cache in place of its reservation."""
        if self._room is not None:
            self._room.commit(self.key, self.buffer)

    def abandon(self) -> None:
        if self._dec is not None:
            self._dec.close()
        if self._room is not None:
            self._room.release()

    def try_evict(self) -> bool:
        """Let go of the frame if no reader holds it now (a complete one is about to be cached)."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.complete or self.queued or self.failed is not None or self.evicted:
                return False
            self._let_go()
        finally:
            self.lock.release()
        return True

    def _let_go(self) -> None:
        """Evicted (lock held): no view is handed out after this (see ``slice``), then abandoned."""
        with self._vlock:
            self.evicted = True
        self.abandon()

    def shut(self, why: SourceError, wait: float) -> None:
        """Abandon the frame for good once no reader decodes into it (later reads raise ``why``).

        Nothing when a reader kept the lock past ``wait`` seconds: its decode
        stops at its next step (the worker is closed) and ``after_read`` shuts the frame.
        """
        if not self.lock.acquire(timeout=wait):
            return
        try:
            if self.failed is None:
                self.failed = why
            self.abandon()
        finally:
            self.lock.release()


class Decoders:
    """A stream's reusable frame decoders, the source they read, and whether its archive closed.

    What a decode (:class:`_NativeDecode`, :class:`_PyDecode`) needs. The frame worker
    is one; a local stream without a worker (a cache too small for one) keeps one for its
    frames of ``MIN_FRAME`` and more: read whole before decoding, their compressed bytes
    were held outside the cache (16 MiB frames of incompressible data, a 64 MiB cache:
    39 MB of RSS past the cache), where the decoder reads them in ``FD_CHUNK`` pieces.
    """

    def __init__(self, source: Source) -> None:
        self.source = source
        self.fd = source.fileno() if hasattr(source, "fileno") else None  # None: read through the source
        self._lock = threading.Lock()
        self._decoders: list = []
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """No decode reads past its current step from now on (the file is about to close)."""
        with self._lock:
            self._closed = True
            self._decoders.clear()

    def native_decoder(self):
        with self._lock:
            if self._decoders:
                return self._decoders.pop()
        return NativeFrameDecoder(MAX_WINDOW_LOG)

    def give_back(self, dec) -> None:
        with self._lock:
            if len(self._decoders) <= MAX_PARTIAL and not self._closed:
                self._decoders.append(dec)

    def decoder_for(self, span: FrameSpan, buffer) -> _Decode:
        if NATIVE:
            return _NativeDecode(span, buffer, self)
        return _PyDecode(span, buffer, self)

    def decode_whole_frame(self, span: FrameSpan, buf: mmap.mmap) -> mmap.mmap:
        """``span`` decoded whole into ``buf`` (closed if that fails), checksum included."""
        try:
            dec = self.decoder_for(span, buf)
        except BaseException:
            buf.close()
            raise
        try:
            dec.advance(span.size)
        except BaseException:
            dec.close()
            buf.close()
            raise
        dec.close()
        return buf


class FrameWorker(Decoders):
    """Per zstd stream: frame decodes into mappings, the frames finished in the background, the spare.

    ``span(i)`` (from the stream) checks frame ``i``'s sizes in the table and
    says where its compressed bytes are (or raises CorruptMemberError).
    ``finish``: finish frames in the background, else keep them partial (see
    :func:`finishes_in_background`) unless one comes back soon: ``frames`` is
    how many the stream has (for the record of when each last started).
    """

    def __init__(
        self,
        cache: ExtentCache,
        spare_size: int,
        source: Source,
        span: Callable[[int], FrameSpan],
        finish: bool = True,
        frames: int = 0,
    ) -> None:
        super().__init__(source)
        self.finish = finish
        # Kept partial: when each frame was last started, counted in frames started (the cache
        # would have evicted it after about ``capacity`` of them).
        self._started = array("q", [-1]) * (frames if not finish else 0)
        self._starts = 0
        self.cache = cache
        self.spare_size = spare_size
        self._span = span
        self._partial: OrderedDict[int, PartialFrame] = OrderedDict()  # least recently read first
        self._queue: queue.Queue[PartialFrame | None] = queue.Queue()
        self._spares: list[tuple[mmap.mmap, Reservation]] = []
        # Fresh pages cost ~1.5 us each on the reference VM (first touch): faulting them here, off
        # the reader's path, is most of what an early member saves. A few spares absorb the burst of
        # new frames at the start of a shuffled epoch; they hold at most 1/16 of the cache.
        self.max_spares = max(1, min(MAX_SPARES, cache.limit // (16 * spare_size)))
        # Frames the cache keeps besides the ones in flight and the spares (see _comes_back).
        self.capacity = max(1, cache.limit // max(spare_size, 1) - MAX_PARTIAL - self.max_spares)
        self._thread: threading.Thread | None = None
        self.early_frames = 0  # frames whose first reader was answered before the frame was finished
        self.spares_used = 0
        self.partial_evictions = 0  # partial frames let go to make room for another (no finishing)
        self.finished_on_reuse = 0  # kept-partial frames finished because they came back soon
        self.buffers_recycled = 0  # buffers of frames let go, reused for the next frame

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "early_frames": self.early_frames,
                "frames_in_flight": len(self._partial),
                "spares_ready": len(self._spares),
                "spares_used": self.spares_used,
                "frames_finished_in_background": int(self.finish),
                "partial_evictions": self.partial_evictions,
                "frames_finished_on_reuse": self.finished_on_reuse,
                "buffers_recycled": self.buffers_recycled,
            }

    def close(self) -> None:
        """Stop the background thread and give back what the worker holds, before the file closes.

        Why wait for the thread: it reads the archive through its file
        descriptor, whose number the process may hand to another file once the
        archive is closed. The step it is in ends within about a millisecond
        (at most ``CLOSE_WAIT``); frames still in flight are abandoned, never
        cached, and the spares go back with their reservations.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._queue.put(None)  # wakes the thread if it waits for work
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_WAIT)
        with self._lock:
            partial = list(self._partial.values())
            self._partial.clear()
            spares, self._spares = self._spares, []
            self._decoders.clear()
        for p in partial:
            p.shut(_closed_error(p.where), wait=CLOSE_WAIT)
        for buf, room in spares:
            buf.close()
            room.release()

    def decode_whole(self, i: int) -> mmap.mmap:
        """Frame ``i`` decoded whole into a mapping (finishing it if it is in flight)."""
        with self._lock:
            p = self._partial.get(i)
        if p is not None:
            try:
                p.advance(p.size)
            except FrameEvicted:
                p = None
            if p is not None and p.evicted and not p.complete:
                p = None  # a reader's read failed at its very end meanwhile: decode it afresh
        if p is not None:
            if not p.complete:  # decoded to its end but failed there (the frame checksum)
                raise p.failed or CorruptMemberError(f"{p.where} did not decode")
            assert p.buffer is not None
            if not p.finish and self._drop(i, p):
                p.abandon()  # the caller caches the buffer under its own reservation
            return p.buffer
        span = self._span(i)
        return self.decode_whole_frame(span, self.buffer(span.size))

    # -- buffers -------------------------------------------------------------
    def buffer(self, size: int, wake: bool = True) -> mmap.mmap:
        """A buffer for a ``size``-byte frame: a pre-faulted spare when one is ready, else a fresh mapping.

        ``wake``: ask the thread for a new spare (not when frames let go supply them).
        """
        with self._lock:
            spare = self._spares.pop() if self._spares else None
        if spare is not None:
            # Let go before anything else can fail (_wake may not start a thread, Ctrl-C): the
            # room was lost for good otherwise. The caller holds a reservation for the frame.
            spare[1].release()
        if wake:
            self._wake()
        if spare is not None:
            buf = spare[0]
            if size <= len(buf):
                if size < len(buf):
                    buf.resize(size)  # mremap: shrinks in place, the populated pages stay
                self.spares_used += 1
                return buf
            buf.close()
        return new_buffer(size)

    def _make_spares(self) -> None:
        """Fill the spare pool while nothing else is queued (each spare is reserved in the cache)."""
        while len(self._spares) < self.max_spares and self._queue.empty() and not self._closed:
            room = self.cache.hold(self.spare_size, wait=False)
            if room is None:
                return  # the cache is busy with decodes: no room for a spare now
            try:
                buf = new_buffer(self.spare_size, populate=True)
            except OSError:
                room.release()
                return
            if not self._keep_spare(buf, room):
                buf.close()
                room.release()
                return

    # -- partial frames -------------------------------------------------------
    def partial(self, i: int, key: Hashable, size: int) -> PartialFrame | None:
        """Frame ``i`` being decoded (started now if it is neither cached nor in flight), or None.

        None means: serve it the ordinary way (it is cached, or there is no
        room for another frame in flight right now, or the worker is closed).
        """
        with self._lock:
            p = self._partial.get(i)
            if p is not None:
                self._partial.move_to_end(i)
                return p
            if self._closed:
                return None
            full = len(self._partial) >= MAX_PARTIAL
        if self.cache.peek(key) is not None:
            return None
        # Kept partial with every slot taken: each new frame lets one go, whose buffer serves it.
        # No new spare is asked for then, even when this one could not be reused (a reader held
        # a view of it): the next frame let go most likely can, and a spare made meanwhile would
        # fill the pool in its place at the cost of faulting in a whole frame.
        recycling = full and not self.finish
        if recycling:
            self._evict_one()
        room = self.cache.hold(size, wait=False)
        if room is None:
            return None
        with self._lock:
            p = self._partial.get(i)
            if p is not None or self._closed or len(self._partial) >= MAX_PARTIAL:
                room.release()
                return p
            p = self._partial[i] = PartialFrame(key, size)  # created locked: others wait for setup
            p.finish = self.finish or self._comes_back(i)
        try:
            span = self._span(i)
            buffer = self.buffer(size, wake=not recycling)
            dec = self.decoder_for(span, buffer)
        except MemberError as exc:
            room.release()
            self._drop(i, p)
            p.setup_failed(exc)
            raise
        except BaseException as exc:
            room.release()
            self._drop(i, p)
            # A read error (S3 reset, EIO) stays one: waiters must not take it for a corrupt frame.
            opened = CorruptMemberError(f"zstd frame #{i} could not be opened")
            p.setup_failed(exc if isinstance(exc, SourceError) else opened)
            raise
        p.ready(span.where, buffer, dec, room)
        self.early_frames += 1
        return p

    def after_read(self, i: int, p: PartialFrame) -> None:
        """A reader is done with partial frame ``i``: finish it in the background, or (kept
        partial) cache it once its readers decoded it to its end, or let it go once it failed."""
        if self._closed:  # close() may have given up on this frame while we decoded it
            self._drop(i, p)
            p.shut(_closed_error(p.where), wait=CLOSE_WAIT)
        elif p.finish and not p.evicted:
            self.finish_later(p)
        elif (p.complete or p.failed is not None or p.evicted) and self._drop(i, p) and p.complete:
            p.commit()

    def _comes_back(self, i: int) -> bool:
        """Frame ``i`` is started again soon enough that the cache would have kept it (lock held)."""
        if i >= len(self._started):
            return False
        last, self._started[i] = self._started[i], self._starts
        between = self._starts - last - 1  # other frames started since (if it was started before)
        self._starts += 1
        if last < 0 or between >= self.capacity:
            return False
        self.finished_on_reuse += 1
        return True

    def _evict_one(self) -> None:
        """Let go of the least recently read partial frame that no reader holds (if any), its
        buffer kept as a spare."""
        with self._lock:
            candidates = list(self._partial.items())
        for i, p in candidates:
            # Outside our lock: abandoning a frame gives its decoder back through give_back().
            if p.try_evict() and self._drop(i, p):
                self.partial_evictions += 1
                self._recycle(p)
                return

    def _recycle(self, p: PartialFrame) -> None:
        """The buffer of a frame let go becomes a spare: its pages are faulted in already (making
        fresh spares took a third of the daemon's CPU in shuffled reads of an archive 6x the
        cache). Not while a view of it lives (a reader still copying out): those bytes stay."""
        buf = p.take_buffer()
        if buf is None:
            return
        try:
            # mremap; refused while any view of the mapping exists. Growing back to the spare size
            # keeps the faulted pages (the frame may have been a little smaller).
            buf.resize(self.spare_size)
        except (BufferError, ValueError, OSError):
            return
        room = self.cache.hold(self.spare_size, wait=False)
        if room is None:
            return
        if self._keep_spare(buf, room):
            self.buffers_recycled += 1
        else:
            room.release()

    def _keep_spare(self, buf: mmap.mmap, room: Reservation) -> bool:
        """Put a spare and its reservation in the pool; False when closed (close() gave the others
        back) or full: then the caller lets go of both."""
        with self._lock:
            if self._closed or len(self._spares) >= self.max_spares:
                return False
            self._spares.append((buf, room))
            return True

    def finish_later(self, p: PartialFrame) -> None:
        """Hand a partial frame to the background thread (once; after its first reader got its bytes,
        so the two never take turns on one decoder while that reader waits)."""
        with self._lock:
            if p.queued:
                return
            p.queued = True
        self._start_thread()
        self._queue.put(p)

    def _drop(self, i: int, p: PartialFrame) -> bool:
        """Take ``p`` out of the frames in flight; False if it was not there (someone else did)."""
        with self._lock:
            if self._partial.get(i) is p:
                del self._partial[i]
                return True
            return False

    def _start_thread(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._closed:
                    self._thread = threading.Thread(target=self._loop, name="cdmlfs-frames", daemon=True)
                    self._thread.start()

    def prefill(self) -> None:
        """Fill the spare pool now, in the background (a burst of first reads follows a mount)."""
        self._wake()

    def _wake(self) -> None:
        """Ask the thread for a new spare (a decode just took it)."""
        if ENABLED:
            self._start_thread()
            self._queue.put(None)

    def _loop(self) -> None:
        while not self._closed:
            p = self._queue.get()
            if p is not None and not self._closed:
                self._finish(p)
            if self._queue.empty() and not self._closed:
                self._make_spares()

    def _finish(self, p: PartialFrame) -> None:
        i = p.key[1]  # type: ignore[index]
        try:
            while not p.complete and p.failed is None and not p.evicted and not self._closed:
                p.advance(min(p.size, p.done + FINISH_STEP))
            if self._closed:
                p.shut(_closed_error(p.where), wait=CLOSE_WAIT)
                return
            if p.failed is not None:
                raise p.failed
            if p.complete:
                p.commit()
        except MemberError as exc:
            # Its members that were checked on their own were served; the rest get EIO from
            # their own reads (which report it). Nothing of this frame enters the cache.
            log.debug("finishing %s failed: %s", p.where, exc)
        except FrameEvicted:
            # Let go between our check and the step (a reader's read failed inside it, an S3 GET
            # that gave up): its next reader decodes it afresh. Not an error of ours.
            log.debug("finishing %s stopped: the frame was let go", p.where)
        except SourceError as exc:
            # The archive closed inside a step (close() waits for it), or a read failed (an S3
            # GET that gave up): the frame was let go, its next reader decodes it afresh and
            # reports a failure that lasts. No traceback: nothing is wrong with this code.
            if self._closed:
                p.shut(_closed_error(p.where), wait=CLOSE_WAIT)
            else:
                log.info("finishing %s stopped: %s (its next reader decodes it again)", p.where, exc)
        except Exception:
            log.exception("finishing %s failed", p.where)
            p.abandon()
        finally:
            self._drop(i, p)


def _closed_error(where: str) -> SourceError:
    return SourceError(f"{where}: the archive was closed")
