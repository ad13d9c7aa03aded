"""The decoded byte stream of a tar container, as extents the reader can cache.

Tar members live at offsets of one byte stream: the file itself for a plain
``.tar``, the decompressed output for ``.tar.zst``. The extent reader asks a
*container stream* which extents cover a byte range and how to decode one
(:class:`cdmlfs.reader.ContainerStream`); the classes here answer:

* :class:`RawStream` — plain tar: fixed 256 KiB blocks read straight from the source.
* :class:`ZstdStream` — tar.zst: one extent per zstd frame, decoded in one call
  when it fits the reader's per-decode budget (``whole_max``); frames of 512 KiB
  and more go through :mod:`cdmlfs.formats.zstdframes` (pre-faulted buffers, and
  members of packed archives served before their frame is finished). A larger frame
  (``tar --zstd`` writes one frame for the whole archive) is served in
  ``piece``-sized extents by a forward-only decoder per frame that stays where
  the last read ended: reading in archive order costs one decoding pass; a
  read behind the decoder restarts it at the frame's start. Such a frame's
  checksum is verified when its last piece is decoded.

**Decoding ahead** (``warm_up(decode_ahead=True)``, which the daemon asks for):
a reader that moves from one piece of a large frame to the next (archive order
in a single-frame archive) gets the following piece decoded by a background
thread, through a cache reservation taken only when there is room at once;
random reads never trigger it, and whole frames (packed archives) have the frame
worker instead. A piece is committed before its decoder's lock is let go, so a
reader waiting for that decoder finds the piece and never restarts the frame.
Measured on the 2-core reference VM, a single-frame archive read in archive
order through the mount, alternating rounds, two runs: one reader (it and the
daemon take turns, a core sits idle) 91-178 -> 215-293 MB/s; four readers (both
cores busy) 216-326 -> 245-302 MB/s, medians 298 -> 275 and 269 -> 259. At SCHED_IDLE priority the
four lost less, but the thread could then be starved while holding a decoder
the FUSE thread needs. In-process readers (the Python API) compete with it for
the GIL (-6%): off there. ``CDMLFS_PREFETCH=0`` turns it off, ``=1`` on for
every reader (A/B runs).

The scan views (:class:`RawScanView`, :class:`ZstdScanView`) are forward-only
readers used once, to build the tar index. The zstd one decodes frame by frame
with bounded reads, learns the size of frames whose header does not give it,
and skips frames of known size that hold only member data. Without a seek
table it also finds the frames as it goes, so a foreign archive is read once.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import logging
import mmap
import os
import queue
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable

import zstandard

from cdmlfs import decoders
from cdmlfs.cache import ExtentCache, Reservation
from cdmlfs.errors import ArchiveFormatError, CorruptMemberError, MemberError, SourceError, WindowLimitError
from cdmlfs.formats import zstdframes
from cdmlfs.sizes import human_bytes
from cdmlfs.sources.base import Source, SourceRange
from cdmlfs.zstd_seekable import Frame, FrameWalker, declared_window, is_skippable_magic, parse_frame_header

log = logging.getLogger(__name__)

RAW_BLOCK = 256 << 10
DEFAULT_WHOLE_MAX = 16 << 20
DEFAULT_PIECE = 4 << 20
MAX_CURSORS = 4  # forward decoders kept alive (each holds a window of up to 128 MiB... usually 2-8 MiB)
SCAN_CHUNK = 1 << 20
PACK_FRAME_MAX = 8 << 20  # frames up to this size are what cdmlfs pack writes: repacking would not help
PREFETCH_ENV = os.environ.get("CDMLFS_PREFETCH", "")  # "0": never decode ahead, "1": always (A/B runs)
MAX_STREAM = 1 << 62
SCRATCH_MAX = 8 << 20  # frames compressed to more than this are read into fresh buffers
MAX_WINDOW = decoders.MAX_WINDOW  # larger windows need --long archives


# What to do with an archive written with zstd --long (refuse_large_window, _zstd_error).
_LONG_WINDOW_HINT = "convert it once with 'cdmlfs pack ARCHIVE OUT.tar.zst' (it reads such windows)"
# The same, for an archive pack wrote (its member index is embedded): frames of --frame-size at a
# level of 20 or more have a window as large as the frame.
_PACKED_WINDOW_HINT = "pack it again with a smaller --frame-size or a --level below 20"


_DICTIONARY = "was compressed with a dictionary (zstd -D), which cdmlfs does not take"


def _zstd_error(exc: Exception, what: str) -> CorruptMemberError | MemoryError:
    if "Allocation error" in str(exc):  # memory pressure, not damage: never a lasting corrupt verdict
        return MemoryError(f"{what}: {exc}")
    if "Dictionary mismatch" in str(exc):  # not damage: a frame compressed with a dictionary (zstd -D)
        return CorruptMemberError(f"{what} {_DICTIONARY}")
    if "too much memory" in str(exc):  # zstd --long wrote it: not damage (see refuse_large_window)
        return CorruptMemberError(
            f"{what} needs a decoding window over {MAX_WINDOW >> 20} MiB (written with zstd --long): "
            + _LONG_WINDOW_HINT
        )
    return CorruptMemberError(f"corrupt zstd data in {what} ({exc})")


# -- frame table -----------------------------------------------------------------
TABLE_SIZES_UNMEASURED = 1 << 63  # encoded frame tables: set in the count when sizes came from a seek table


class FrameTable:
    """Data frames (skippable and empty frames dropped): where each lies and which bytes it decodes to."""

    __slots__ = ("comp_offset", "comp_size", "dec_offset", "dec_size", "sizes_measured", "total")

    def __init__(self) -> None:
        self.comp_offset = array("Q")
        self.comp_size = array("Q")
        self.dec_offset = array("Q")
        self.dec_size = array("Q")
        self.total = 0
        # False: sizes were taken from a seek table, not measured by decoding. A frame whose header
        # does not state its size either is then decoded to its end once before it is served in
        # pieces: a table that lies, sizes swapped between frames, would otherwise shift the bytes.
        self.sizes_measured = True

    def __len__(self) -> int:
        return len(self.dec_size)

    def add(self, comp_offset: int, comp_size: int, dec_size: int) -> None:
        if dec_size == 0:
            return
        if self.total + dec_size > MAX_STREAM:
            raise ArchiveFormatError("zstd frames claim more than 2**62 decoded bytes")
        self.comp_offset.append(comp_offset)
        self.comp_size.append(comp_size)
        self.dec_offset.append(self.total)
        self.dec_size.append(dec_size)
        self.total += dec_size

    @classmethod
    def from_frames(cls, frames: list[Frame]) -> FrameTable:
        table = cls()
        for f in frames:
            if f.skippable:
                continue
            if f.content_size is None:
                raise ValueError("frame sizes must be known")
            table.add(f.offset, f.comp_size, f.content_size)
        table.sizes_measured = False
        return table

    def largest(self) -> int:
        return max(self.dec_size, default=0)

    def encode(self) -> bytes:
        head = array("Q", [len(self) | (0 if self.sizes_measured else TABLE_SIZES_UNMEASURED)]).tobytes()
        return head + self.comp_offset.tobytes() + self.comp_size.tobytes() + self.dec_size.tobytes()

    @classmethod
    def decode(cls, data: bytes, source_size: int) -> FrameTable:
        """Inverse of :meth:`encode`; raises ValueError unless every frame lies inside the source."""
        if len(data) < 8:
            raise ValueError("frame table is truncated")
        head = array("Q")
        head.frombytes(data[:8])
        n = head[0] & ~TABLE_SIZES_UNMEASURED
        if len(data) != 8 + 24 * n:
            raise ValueError("frame table has the wrong length")
        cols = []
        for i in range(3):
            col = array("Q")
            col.frombytes(data[8 + 8 * n * i : 8 + 8 * n * (i + 1)])
            cols.append(col)
        table = cls()
        prev_end = 0
        for off, comp, dec in zip(*cols):
            if off < prev_end or off + comp > source_size or dec == 0:
                raise ValueError("frame table does not fit the archive")
            prev_end = off + comp
            table.add(off, comp, dec)
        table.sizes_measured = not head[0] & TABLE_SIZES_UNMEASURED
        return table


EMPTY_FRAME_MAX = 64  # bytes: header (at most 18) + an empty last block (3) + checksum (4), with room


def refuse_large_window(i: int, window: int, limit: int = MAX_WINDOW, hint: str = _LONG_WINDOW_HINT) -> None:
    """Refuse frame ``i`` whose decoder window is beyond MAX_WINDOW (only pack reads it) or beyond
    ``limit`` (a mount's: decoders.window_limit of its cache; a larger cache reads it), saying why
    and what to do. ``zstd --long=N`` writes such frames; zstd's own error ("frame requires too
    much memory") read as a corrupt archive."""
    if window > MAX_WINDOW:
        raise ArchiveFormatError(
            f"zstd frame #{i} needs a {window >> 20} MiB decoding window (written with zstd --long); "
            f"cdmlfs decodes windows of up to {MAX_WINDOW >> 20} MiB to keep its memory bound: "
            + _LONG_WINDOW_HINT
        )
    if window > limit:
        raise WindowLimitError(f"zstd frame #{i} {decoders.window_refusal(window, limit)}, or {hint}")


def check_empty_frames(source: Source, frames: list[Frame], first: int = 0) -> None:
    """Frames said to decode to nothing must: a frame table skips them (they hold no stream bytes).

    A seek table entry or a frame header can claim 0 bytes for a frame that holds data; skipping
    it would shift every later byte of the stream (``zstd -d`` refuses such a file). Genuinely
    empty frames are a few bytes, so this decodes at most ``EMPTY_FRAME_MAX`` bytes per frame.
    """
    for i, f in enumerate(frames, first):
        if f.skippable or f.content_size != 0:
            continue
        where = f"zstd frame #{i} at offset {f.offset}"
        head = source.read_at(f.offset, min(8, f.comp_size))
        if len(head) == 8 and is_skippable_magic(int.from_bytes(head[:4], "little")):
            if int.from_bytes(head[4:], "little") != f.comp_size - 8:  # a seek table lists these as 0
                raise ArchiveFormatError(f"{where}: skippable frame whose size disagrees with the seek table")
            continue
        if f.comp_size > EMPTY_FRAME_MAX:
            raise ArchiveFormatError(f"{where} is said to decode to 0 bytes but is {f.comp_size} bytes long")
        data = source.read_at(f.offset, f.comp_size)
        try:
            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=False)
            extra = reader.read(1)
        except zstandard.ZstdError as exc:
            raise ArchiveFormatError(f"{where} is said to decode to 0 bytes but does not ({exc})") from None
        if extra:
            raise ArchiveFormatError(f"{where} is said to decode to 0 bytes but holds data")


# -- container streams (read time) -------------------------------------------------
class RawStream:
    """Plain tar: the stream is the source; extents are fixed blocks of it."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.total = source.size

    def extents(self, offset: int, size: int) -> list[tuple[Hashable, int, int]]:
        if offset + size > self.total:
            raise CorruptMemberError("member data runs past the end of the archive (truncated tar?)")
        out = []
        k = offset // RAW_BLOCK
        end = offset + size
        while k * RAW_BLOCK < end:
            start = k * RAW_BLOCK
            out.append((("tar", k), start, min(RAW_BLOCK, self.total - start)))
            k += 1
        return out

    def decode(self, key: Hashable, room: Reservation | None = None) -> bytes:
        k = key[1]  # type: ignore[index]
        start = k * RAW_BLOCK
        return self.source.read_at(start, min(RAW_BLOCK, self.total - start))

    def verified_extent(self, key: Hashable) -> bool:
        return False  # plain tar has no checksums


class _Cursor:
    """A forward-only decoder inside one large frame."""

    __slots__ = ("lock", "pos", "reader", "scratch", "users", "window")

    def __init__(self, window: int = 0) -> None:
        self.lock = threading.Lock()
        self.reader = None
        self.pos = 0
        self.scratch: bytearray | None = None
        self.window = window  # bytes of decoder window this cursor's frame needs
        self.users = 0  # readers that chose it and have not let it go (under ZstdStream._lock)


class ZstdStream:
    """tar.zst: extents are frames (or pieces of frames too large for one decode)."""

    def __init__(self, source: Source, frames: FrameTable, label: str = "archive") -> None:
        self.source = source
        self.label = label
        self.frames = frames
        self.total = frames.total
        self.whole_max = DEFAULT_WHOLE_MAX
        self.window_max = MAX_WINDOW  # a forward decoder's window (outside the cache): see bound_extents
        self.piece = DEFAULT_PIECE
        self._fd = source.fileno()  # None unless a local file (Source protocol)
        self._cache: ExtentCache | None = None
        self._spare_size = 0  # > 0: frames go through a FrameWorker (see bound_extents)
        self._reset_process_state()
        self.frame_decodes = 0  # whole frames decoded (for stats and tests)
        self.restarts = 0  # forward decoders started at a frame's beginning
        self.prefetched = 0  # extents decoded ahead of the reader
        self.decode_ahead = PREFETCH_ENV == "1"  # see warm_up
        self.packed = False  # written by cdmlfs pack (its member index embedded): repacking is no advice
        self._closed = False

    def _in_this_process(self) -> None:
        """Start afresh if this is a forked child (see ``_reset_process_state``)."""
        if self._pid != os.getpid():
            self._reset_process_state()

    def _reset_process_state(self) -> None:
        """Locks, decoders and the prefetch thread belong to one process (a fork starts afresh)."""
        self._pid = os.getpid()
        self._local = threading.local()
        self._cursors: OrderedDict[tuple[int, int], _Cursor] = OrderedDict()  # (frame, serial)
        self._cursor_serial = 0
        self._lock = threading.Lock()
        self._cursor_freed = threading.Condition(self._lock)
        self._queue: queue.Queue[Hashable] = queue.Queue(maxsize=1)  # one extent ahead
        self._worker: threading.Thread | None = None
        self._seen: Hashable | None = None
        self._frames = self._new_frame_worker()
        # Without a worker: frames decoded by a native decoder that reads as it goes (see Decoders).
        native = zstdframes.NATIVE and self._fd is not None
        self._decoders = zstdframes.Decoders(self.source) if native else None
        self._sizes_checked: set[int] = set()  # frames decoded once to check the table's size

    def _new_frame_worker(self) -> zstdframes.FrameWorker | None:
        """The frame worker, once ``bound_extents`` chose to use one (``_spare_size``)."""
        if not self._spare_size or self._cache is None:
            return None
        finish = zstdframes.finishes_in_background()
        return zstdframes.FrameWorker(
            self._cache, self._spare_size, self.source, self._frame_span, finish, len(self.frames)
        )

    def bound_extents(
        self, whole_max: int, piece: int, cache: ExtentCache | None = None, window_max: int | None = None
    ) -> None:
        """Called once by the reader: one decode must fit its cache budget.

        Frames above ``whole_max`` are served piece by piece from a forward
        decoder; that is when random reads get slow, so that is when we warn.
        With the ``cache``, extents are decoded ahead of a sequential reader.
        """
        self.whole_max = max(whole_max, piece)
        self.piece = piece
        self._cache = cache
        if window_max is not None:
            self.window_max = window_max
            # Refused at mount rather than on each read: frames read piece by piece hold a decoder
            # window, and those of one archive share their writer's settings (a saved index spares
            # the scan, which checks them too). Frames decoded whole hold none.
            first = next((i for i, s in enumerate(self.frames.dec_size) if s > self.whole_max), None)
            if first is not None:
                hint = _PACKED_WINDOW_HINT if self.packed else _LONG_WINDOW_HINT
                refuse_large_window(first, self._window(first), self.window_max, hint)
        whole = [s for s in self.frames.dec_size if s <= self.whole_max]
        largest = max(whole, default=0)
        if (
            cache is not None
            and zstdframes.ENABLED
            and largest >= zstdframes.MIN_FRAME
            and cache.limit >= 8 * largest
        ):
            self._spare_size = largest
            self._frames = self._new_frame_worker()
        big = [s for s in self.frames.dec_size if s > self.whole_max]
        if (
            big
            and cache is not None
            and (self.packed or (len(self.frames) > 1 and max(big) <= PACK_FRAME_MAX))
        ):
            # Already cut in frames of the size cdmlfs pack writes (or written by it): converting would
            # change nothing; a cache that holds a few of them would (a decode may take up to a quarter).
            mib = -(-max(big) >> 20)  # rounded up
            unchecked = (
                f", and a member over {human_bytes(self.whole_max)} in them is CRC-checked only once "
                "all its bytes have been read"
                if self.packed
                else ""
            )
            log.warning(
                "%s: zstd frames of up to %d MiB do not fit this cache (%s): random reads will decode "
                "from the start of their frame%s; a cache of %d MiB or more reads them whole",
                self.label, mib, human_bytes(cache.limit), unchecked, 4 * mib,
            )  # fmt: skip
        elif big:
            log.warning(
                "%s: %s of up to %d MiB: reading members in archive order is one pass, but a random "
                "read decodes from the start of its frame. For fast random access convert it once: "
                "cdmlfs pack %s OUTPUT.tar.zst",
                self.label,
                "a single zstd frame" if len(self.frames) == 1 else f"{len(big)} zstd frames",
                max(big) >> 20,
                self.label,
            )

    # -- extents ---------------------------------------------------------------
    def extents(self, offset: int, size: int) -> list[tuple[Hashable, int, int]]:
        fr = self.frames
        end = offset + size
        if end > self.total:
            raise CorruptMemberError("member data runs past the end of the zstd stream (truncated archive?)")
        i = bisect.bisect_right(fr.dec_offset, offset) - 1
        out: list[tuple[Hashable, int, int]] = []
        n = len(fr)
        while i < n:
            start = fr.dec_offset[i]
            if start >= end:
                break
            length = fr.dec_size[i]
            if length <= self.whole_max:
                out.append((("zf", i), start, length))
            else:
                piece = self.piece
                k = max(offset - start, 0) // piece
                while k * piece < length and start + k * piece < end:
                    out.append((("zp", i, k, piece), start + k * piece, min(piece, length - k * piece)))
                    k += 1
            i += 1
        if self._cache is not None and out and self.decode_ahead:
            self._note_position(out[-1][0])
        return out

    # -- decoding ahead of a sequential reader ---------------------------------------
    def _note_position(self, key: Hashable) -> None:
        """The reader moved to ``key``; if it came from the extent before, decode the next one now.

        Reading in archive order (a single-frame archive's only fast pattern, and
        read-all of a packed one) then overlaps decoding with serving; random
        reads never trigger it. The prefetch commits through a cache reservation,
        so the memory bound holds.
        """
        prev = self._seen
        if key == prev:
            return
        self._seen = key
        if prev is None or self._next_key(prev) != key:
            return
        nxt = self._next_key(key)
        # Pieces of large frames only: whole frames (packed archives) have the frame worker's
        # early members, which decoding them ahead would bypass (and decode twice).
        if nxt is None or nxt[0] != "zp" or self._cache.peek(nxt) is not None:  # type: ignore[index,union-attr]
            return
        if self._closed:
            return
        self._in_this_process()
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._prefetch_loop, name="cdmlfs-decode-ahead", daemon=True
            )
            self._worker.start()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(nxt)

    def _first_key(self, i: int) -> Hashable:
        return ("zf", i) if self.frames.dec_size[i] <= self.whole_max else ("zp", i, 0, self.piece)

    def _next_key(self, key: Hashable) -> Hashable | None:
        if key[0] == "zp":  # type: ignore[index]
            _, i, k, piece = key  # type: ignore[misc]
            if (k + 1) * piece < self.frames.dec_size[i]:
                return ("zp", i, k + 1, piece)
        else:
            i = key[1]  # type: ignore[index]
        return self._first_key(i + 1) if i + 1 < len(self.frames) else None

    def _piece_length(self, i: int, k: int, piece: int) -> int:
        """Bytes in piece ``k`` of frame ``i`` (the last piece of a frame may be short)."""
        return min(piece, self.frames.dec_size[i] - k * piece)

    def _prefetch_loop(self) -> None:
        while True:
            key = self._queue.get()
            if key is None or self._closed:
                return
            try:
                self._prefetch(key)
            except Exception as exc:  # the reader meets (and reports) the same error when it gets there
                log.debug("prefetch of %r failed: %s", key, exc)

    def _prefetch(self, key: Hashable) -> None:
        cache = self._cache
        if cache is None or cache.peek(key) is not None:
            return
        # Room now or not at all: a prefetch never waits for room (it may take room a reader then
        # waits for, for one piece's decode), and it holds the room before any decoder lock.
        _, i, k, piece = key  # type: ignore[misc]
        room = cache.hold(self._piece_length(i, k, piece), wait=False)
        if room is None:
            return
        try:
            if self._decode_piece(i, k, piece, prefetching=True, room=room) is not None:
                self.prefetched += 1  # committed under the decoder's lock
        finally:
            room.release()

    def close(self) -> None:
        """Stop decoding ahead and the frame worker before the archive's file is closed.

        Their threads read through the file descriptor, whose number the process
        may give to another file once it is closed: the step in progress ends
        (a piece or a frame step, milliseconds) and nothing starts after it.
        """
        self._closed = True
        if self._pid != os.getpid():
            return  # a forked child that never read: none of the parent's threads run here
        worker = self._worker
        if worker is not None:
            with contextlib.suppress(queue.Full):  # full: the key it holds wakes the loop just as well
                self._queue.put_nowait(None)
            if worker is not threading.current_thread():
                worker.join(zstdframes.CLOSE_WAIT)
        if self._frames is not None:
            self._frames.close()
        if self._decoders is not None:
            self._decoders.close()

    def verified_extent(self, key: Hashable) -> bool:
        """A whole frame was decoded to its end (its checksum checked when it has one); a piece
        of a large frame is served before the frame's end is reached."""
        return key[0] == "zf"  # type: ignore[index]

    def decode(self, key: Hashable, room: Reservation | None = None) -> bytes:
        self._in_this_process()
        if key[0] == "zf":  # type: ignore[index]
            return self._decode_frame(key[1])  # type: ignore[index]
        _, i, k, piece = key  # type: ignore[misc]
        data = self._decode_piece(i, k, piece, room=room)
        assert data is not None
        return data

    # -- whole frames ------------------------------------------------------------
    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        return dctx

    def _read_compressed(self, offset: int, length: int) -> bytes | memoryview:
        """A frame's compressed bytes. From a local file they land in a reused per-thread buffer:
        a fresh multi-MiB ``bytes`` per decode costs as much in page faults as the copy itself."""
        fd = self._fd
        if fd is None or length > SCRATCH_MAX:
            return self.source.read_at(offset, length)
        buf = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < length:
            buf = self._local.scratch = bytearray(max(length, 1 << 20))
        view = memoryview(buf)[:length]
        got = 0
        while got < length:
            try:
                n = os.preadv(fd, [view[got:]], offset + got)
            except OSError as exc:
                raise SourceError(f"read failed at offset {offset + got}: {exc.strerror}") from exc
            if n <= 0:
                raise SourceError(f"archive is shorter than its index says (offset {offset + got})")
            got += n
        with contextlib.suppress(AttributeError):  # read past the source's read_at: for cdmlfs stats
            self.source.bytes_read += length
        return view

    def _check_sizes(self, i: int) -> str:
        """Frame ``i``'s sizes in the table are plausible; returns its name for errors."""
        fr = self.frames
        where = f"zstd frame #{i} at offset {fr.comp_offset[i]}"
        expected = fr.dec_size[i]
        if fr.comp_size[i] > expected + (expected >> 7) + (1 << 17):
            # zstd never expands data this much: a lying table must not make us read gigabytes
            raise CorruptMemberError(f"{where} is {fr.comp_size[i]} bytes for {expected} decoded bytes")
        return where

    def _check_frame(self, i: int, head: bytes | memoryview) -> str:
        """Sanity of frame ``i`` against the table before decoding; returns its name for errors."""
        return self._check_header(i, head)[0]

    def _check_header(self, i: int, head: bytes | memoryview) -> tuple[str, bool]:
        """``_check_frame``, and whether the frame's header states its size (then checked)."""
        fr = self.frames
        where = self._check_sizes(i)
        expected = fr.dec_size[i]
        try:
            header = parse_frame_header(head, fr.comp_offset[i])
        except ValueError as exc:
            raise CorruptMemberError(f"{where}: {exc}") from None
        if header.content_size is not None and header.content_size != expected:
            raise CorruptMemberError(
                f"{where} declares {header.content_size} bytes but the index says {expected}"
            )
        return where, header.content_size is not None

    def _frame_reader(self, i: int):
        """A forward zstd stream reader over frame ``i``'s compressed bytes (this frame only)."""
        fr = self.frames
        dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        raw = SourceRange(self.source, fr.comp_offset[i], fr.comp_size[i])
        return dctx.stream_reader(raw, read_size=SCAN_CHUNK, read_across_frames=False)

    def _check_size_by_decoding(self, i: int, where: str) -> None:
        """Decode frame ``i`` to its end once, counting (see ``FrameTable.sizes_measured``)."""
        fr = self.frames
        reader = self._frame_reader(i)
        scratch = bytearray(SCAN_CHUNK)
        n = 0
        try:
            while (k := reader.readinto(scratch)) > 0:
                n += k
                if n > fr.dec_size[i]:
                    break
        except zstandard.ZstdError as exc:
            raise _zstd_error(exc, where) from None
        if n != fr.dec_size[i]:
            got = f"more than {fr.dec_size[i]}" if n > fr.dec_size[i] else str(n)
            raise CorruptMemberError(
                f"{where} decodes to {got} bytes, not the {fr.dec_size[i]} its seek table says"
            )
        self._sizes_checked.add(i)

    def _frame_span(self, i: int) -> zstdframes.FrameSpan:
        """Frame ``i`` for :class:`zstdframes.FrameWorker`, its sizes checked against the table."""
        fr = self.frames
        # No header read: decoding into a buffer of exactly the table's size fails on any other
        # content size (too small, or more data), which is the check the header would give.
        where = self._check_sizes(i)
        return zstdframes.FrameSpan(where, fr.comp_offset[i], fr.comp_size[i], fr.dec_size[i])

    def stats(self) -> dict[str, int]:
        """Decode counters for ``cdmlfs stats``."""
        out = {
            "frame_decodes": self.frame_decodes,
            "forward_restarts": self.restarts,
            "prefetched": self.prefetched,
        }
        if self._frames is not None:
            out.update(self._frames.stats())
        return out

    def warm_up(self, decode_ahead: bool = False) -> None:
        """Have the frame worker's spare buffers faulted in before the first reads need them, and
        with ``decode_ahead`` decode ahead of readers moving in archive order (module docstring)."""
        self._in_this_process()
        if decode_ahead and PREFETCH_ENV != "0":
            self.decode_ahead = True
        if self._frames is not None:
            self._frames.prefill()

    def member_bytes(self, offset: int, size: int) -> memoryview | None:
        """Decoded bytes ``[offset, offset + size)`` of the stream before their frame is finished.

        For a member whose own CRC the caller checks (packed archives): the
        frame is decoded up to the member's end, then finished in the background
        or kept partial for later readers (``zstdframes``: when finishing pays).
        None when that does not apply (frame cached, member across frames,
        no frame worker, too many frames in flight): use the extents.
        """
        self._in_this_process()
        frames = self._frames
        if frames is None:
            return None
        fr = self.frames
        i = bisect.bisect_right(fr.dec_offset, offset) - 1
        if i < 0:
            return None
        lo = offset - fr.dec_offset[i]
        length = fr.dec_size[i]
        if lo + size > length or length > self.whole_max or length < zstdframes.MIN_FRAME:
            return None
        p = frames.partial(i, ("zf", i), length)
        if p is None:
            return None
        try:
            p.advance(lo + size)
            return p.slice(lo, lo + size)
        except zstdframes.FrameEvicted:
            return None  # let go meanwhile (another frame needed its place)
        finally:
            frames.after_read(i, p)

    def _decode_frame(self, i: int) -> bytes | mmap.mmap:
        fr = self.frames
        expected = fr.dec_size[i]
        frames = self._frames
        if frames is not None and zstdframes.MIN_FRAME <= expected <= self.whole_max:
            data = frames.decode_whole(i)
            self.frame_decodes += 1
            return data
        if self._decoders is not None and expected >= zstdframes.MIN_FRAME:
            # Not read whole first: that held the compressed bytes outside the cache (see Decoders).
            data = self._decoders.decode_whole_frame(self._frame_span(i), zstdframes.new_buffer(expected))
            self.frame_decodes += 1
            return data
        comp = self._read_compressed(fr.comp_offset[i], fr.comp_size[i])
        where = self._check_frame(i, comp)
        try:
            data = self._dctx().decompress(comp, max_output_size=expected, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise _zstd_error(exc, where) from None
        if len(data) != expected:
            raise CorruptMemberError(f"{where} decoded to {len(data)} bytes instead of {expected}")
        self.frame_decodes += 1
        return data

    # -- pieces of large frames ----------------------------------------------------
    def _cursor(self, i: int, target: int) -> _Cursor:
        """A forward decoder of frame ``i`` to serve byte ``target``, claimed (``_let_go`` it): the
        one standing nearest at or before it, or a new one when every decoder of the frame has
        passed it.

        Several per frame: two readers in different regions of one big frame (ranks sharing a
        mount, each on its own contiguous shard) used to restart the frame's only decoder for
        each other, decoding a 360 MiB archive about 68 times over for one pass of reads.

        Decoder windows live outside the cache: the windows of all live decoders, those in use
        included, stay within one decode's budget, or are one decoder's. Four frames of a --long
        archive (128 MiB windows) held 512 MiB next to a 64 MiB cache; and with decoders in use
        dropped from the table (still alive, uncounted), 12 concurrent readers of a multithreaded
        mount each kept its own 128 MiB window (505 MiB peak beside a 64 MiB cache). When a new
        decoder does not fit, a reader takes a busy one of its frame (it waits for it, then
        restarts it), or waits for a decoder of another frame to be let go.
        """
        with self._lock:
            found = self._nearest_cursor(i, target)
            if found is not None:
                found.users += 1
                return found
        window = self._window(i)
        if window > self.window_max:  # not damage: no lasting verdict on the member
            raise MemberError(f"zstd frame #{i} {decoders.window_refusal(window, self.window_max)}")
        with self._lock:
            while True:
                found = self._nearest_cursor(i, target)
                if found is not None:
                    found.users += 1
                    return found
                for key in list(self._cursors):  # least recently used first; busy ones stay
                    if self._fits(window):
                        break
                    if self._cursors[key].users == 0:
                        del self._cursors[key]
                if not self._cursors or self._fits(window):
                    self._cursor_serial += 1
                    cur = self._cursors[(i, self._cursor_serial)] = _Cursor(window)
                    cur.users = 1
                    return cur
                busy = [c for (frame, _), c in self._cursors.items() if frame == i]
                if busy:  # every decoder of this frame has passed target: the least advanced restarts
                    cur = min(busy, key=lambda c: c.pos)
                    cur.users += 1
                    return cur
                self._cursor_freed.wait(1.0)  # (timed: a safety net, the loop checks again)

    def _fits(self, window: int) -> bool:
        """Whether a new decoder of ``window`` bytes fits beside the live ones (under ``_lock``)."""
        held = sum(c.window for c in self._cursors.values())
        return len(self._cursors) < MAX_CURSORS and held + window <= self.whole_max

    def _let_go(self, cur: _Cursor) -> None:
        """A reader is done with ``cur`` (it stays in the table for the next reader)."""
        with self._lock:
            cur.users -= 1
            if cur.users == 0:
                self._cursor_freed.notify_all()

    def _chosen_cursor(
        self, i: int, target: int, key: Hashable, create: bool = True
    ) -> tuple[_Cursor | None, bytes | None]:
        """``_cursor`` under its lock, as ``(decoder, None)`` (the caller ``_release``s it); chosen
        again when another reader moved it past ``target`` while we waited (continuing there would
        restart it and undo that reader's progress). ``(None, piece)`` when that reader decoded the
        piece ``key`` we wait for: it is in the cache (pieces are committed before their decoder's
        lock is let go). Without ``create`` (decoding ahead), only an existing decoder at or before
        ``target`` is taken: ``(None, None)`` when there is none (a new one could push out a live one).

        A plain call, not a context manager: a Ctrl-C landing in contextlib's ``__exit__`` left
        the release to the generator's garbage collection, which a traceback kept alive (a REPL
        keeps the last one): the decoder stayed claimed and locked, and its readers waited."""
        for _ in range(3):
            cur = self._claim_locked(i, target, create)
            if cur is None:
                return None, None
            if cur.reader is None or cur.pos <= target:
                return cur, None
            self._release(cur)
            done = self._cache.peek(key) if self._cache is not None else None
            if done is not None:
                return None, done
        if not create:
            return None, None
        return self._claim_locked(i, target, True), None  # still passed: it restarts

    def _claim_locked(self, i: int, target: int, create: bool) -> _Cursor | None:
        """A decoder for ``target`` (``_cursor``; without ``create`` only an existing one, or
        None), claimed and locked. An exception while waiting for its lock (Ctrl-C in a Python
        API session) lets the claim go: a claim left behind would keep the decoder for good, and
        readers of other frames would then wait for it forever."""
        cur = None
        try:
            if create:
                cur = self._cursor(i, target)
            else:
                with self._lock:
                    cur = self._nearest_cursor(i, target)
                    if cur is not None:
                        cur.users += 1
            if cur is not None:
                cur.lock.acquire()
        except BaseException:
            if cur is not None:
                self._let_go(cur)
            raise
        return cur

    def _release(self, cur: _Cursor) -> None:
        """Unlock and let go of a decoder ``_claim_locked`` gave."""
        try:
            cur.lock.release()
        finally:
            self._let_go(cur)

    def _nearest_cursor(self, i: int, target: int) -> _Cursor | None:
        """Frame ``i``'s decoder furthest along but not past ``target`` (under ``_lock``)."""
        best_key = best = None
        for key, cur in self._cursors.items():
            if key[0] == i and cur.pos <= target and (best is None or cur.pos > best.pos):
                best_key, best = key, cur
        if best_key is not None:
            self._cursors.move_to_end(best_key)
        return best

    def _window(self, i: int) -> int:
        """The decoder window frame ``i`` needs (its header's window size, at most its content)."""
        fr = self.frames
        return min(declared_window(self.source, fr.comp_offset[i], fr.comp_size[i]), fr.dec_size[i])

    def _decode_piece(
        self, i: int, k: int, piece: int, prefetching: bool = False, room: Reservation | None = None
    ) -> bytes | None:
        """Piece ``k`` of frame ``i`` from a forward decoder; with ``room``, committed to the cache
        before the decoder's lock is let go, so a reader waiting for that decoder finds it there
        instead of restarting the frame (None: prefetching found nothing to do)."""
        fr = self.frames
        where = f"zstd frame #{i} at offset {fr.comp_offset[i]}"
        frame_size = fr.dec_size[i]
        target = k * piece
        length = self._piece_length(i, k, piece)
        key = ("zp", i, k, piece)
        if self._cache is not None:  # decoded meanwhile by another reader: no decoder to choose
            done = self._cache.peek(key)
            if done is not None:
                return None if prefetching else done
        cur, done = self._chosen_cursor(i, target, key, create=not prefetching)
        if cur is None:  # the piece is cached now (or, decoding ahead, no decoder to continue)
            return None if prefetching else done
        try:
            if self._cache is not None:
                done = self._cache.peek(key)
                if done is not None:  # decoded ahead while we waited for the decoder
                    return None if prefetching else done
            if prefetching and (cur.reader is None or cur.pos > target):
                return None  # decoding ahead only ever continues a decoder, forward
            try:
                if cur.reader is None or cur.pos > target:
                    if cur.reader is not None:
                        log.debug("%s: decoder restarts for byte %d (it was at %d)", where, target, cur.pos)
                    # The header's content size against the table, as whole frames are checked.
                    head = self.source.read_at(fr.comp_offset[i], min(18, fr.comp_size[i]))
                    where, stated = self._check_header(i, head)
                    if not (stated or fr.sizes_measured or i in self._sizes_checked):
                        self._check_size_by_decoding(i, where)
                    cur.reader = self._frame_reader(i)
                    cur.pos = 0
                    self.restarts += 1
                reader = cur.reader
                if cur.pos < target:
                    self._skip_to(cur, i, target, piece, where, frame_size)
                data = _read_piece(reader, length, cur.pos, where, frame_size)
                cur.pos += length
                if cur.pos == frame_size and reader.read(1):  # also makes zstd check the frame checksum
                    raise CorruptMemberError(f"{where} decodes to more than {frame_size} bytes")
                if room is not None:
                    room.commit(key, data)
            except zstandard.ZstdError as exc:
                cur.reader = None
                raise _zstd_error(exc, where) from None
            except BaseException:
                # A read that failed mid-piece (S3 timeout, EIO) left the decoder past cur.pos:
                # continuing it would serve every later piece shifted. It restarts instead.
                cur.reader = None
                raise
        finally:
            self._release(cur)
        return data

    def _skip_to(self, cur: _Cursor, i: int, target: int, piece: int, where: str, frame_size: int) -> None:
        """Move the decoder forward to ``target``, keeping the last pieces it passes in the cache.

        The kernel's readahead (twice as deep for ``cat`` and ``cp``, which ask for sequential
        access) sends requests for a file out of order: the piece after the next one can come
        first. Passed over and dropped, the next one then restarted the decoder at the frame's
        start: a 4.6 GB member read by ``cat`` decoded its frame about 30 times over. The pieces
        just before the target are kept, as many as one decode's budget (a quarter of the cache),
        when the cache has room at once (never waiting for room while holding the decoder).
        """
        reader = cur.reader
        if cur.scratch is None:
            cur.scratch = bytearray(SCAN_CHUNK)
        view = memoryview(cur.scratch)
        while cur.pos < target:
            k, into = divmod(cur.pos, piece)
            room = None
            if into == 0 and target - cur.pos <= self.whole_max and self._cache is not None:
                key = ("zp", i, k, piece)
                if self._cache.peek(key) is None:
                    room = self._cache.hold(min(piece, frame_size - cur.pos), wait=False)
            if room is not None:
                try:
                    length = room.remaining
                    data = _read_piece(reader, length, cur.pos, where, frame_size)
                    cur.pos += length
                    room.commit(key, data)
                finally:
                    room.release()
                continue
            step = min(SCAN_CHUNK, target - cur.pos, piece - into)
            n = reader.readinto(view[:step])
            if n <= 0:
                raise CorruptMemberError(f"{where} ended after {cur.pos} of {frame_size} bytes")
            cur.pos += n


def _read_piece(reader, length: int, at: int, where: str, frame_size: int) -> bytes:
    """``length`` bytes from a zstd stream reader (which may return less than asked at a time)."""
    parts = []
    got = 0
    while got < length:
        chunk = reader.read(length - got)
        if not chunk:
            raise CorruptMemberError(f"{where} ended after {at + got} of {frame_size} bytes")
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


# -- scan views (index time) --------------------------------------------------------
class RawScanView:
    """Forward reads of a plain tar for the header scan: 1 MiB windows, data skipped by seeking."""

    def __init__(self, source: Source, progress: Callable[[int, int], None] | None = None) -> None:
        self.source = source
        self.size = source.size
        self._buf = b""
        self._buf_pos = 0
        self._progress = progress
        self._next_report = 0

    def read(self, pos: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``pos`` (fewer only at the end of the stream)."""
        end = self._buf_pos + len(self._buf)
        if self._buf_pos <= pos and pos + n <= end:
            i = pos - self._buf_pos
            return self._buf[i : i + n]
        length = min(max(n, SCAN_CHUNK), self.size - pos)
        if length <= 0:
            return b""
        self._buf = self.source.read_at(pos, length)
        self._buf_pos = pos
        if self._progress is not None and pos >= self._next_report:
            self._progress(pos, self.size)
            self._next_report = pos + (32 << 20)
        return self._buf[:n]

    def finish(self, end: int) -> None:
        if self._progress is not None:
            self._progress(self.size, self.size)


class _Reporter:
    """Progress of a scan in compressed bytes, reported every 16 MiB."""

    __slots__ = ("next", "progress", "total")

    def __init__(self, progress: Callable[[int, int], None], total: int) -> None:
        self.progress = progress
        self.total = total
        self.next = 0

    def __call__(self, comp_pos: int) -> None:
        if comp_pos >= self.next:
            self.progress(comp_pos, self.total)
            self.next = comp_pos + (16 << 20)


class SeekTableMismatch(ArchiveFormatError):
    """The seek table disagrees with the frames it lists: the scan starts again without it."""


class _ListedFrameRange(SourceRange):
    """A frame's bytes where the seek table puts them, checked against the frame's own header
    as its first bytes pass by (no extra read): a wrong table entry showed only at the frame's
    end, or never when the scan skipped the frame's tail (it then read headers at wrong offsets
    and listed the archive only up to there)."""

    def __init__(self, source: Source, i: int, frame: Frame, listed: int | None, on_read) -> None:
        super().__init__(source, frame.offset, frame.comp_size, on_read)
        self._i = i
        self._offset = frame.offset
        self._listed = listed

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        if self._i >= 0:
            i, self._i = self._i, -1
            try:
                header = parse_frame_header(data, self._offset)
            except ValueError:
                raise SeekTableMismatch(
                    f"no zstd frame starts where the seek table puts frame #{i} (offset {self._offset})"
                ) from None
            if header.content_size is not None and header.content_size != self._listed:
                raise SeekTableMismatch(
                    f"zstd frame #{i} at offset {self._offset} holds {header.content_size} bytes by its "
                    f"header, the seek table says {self._listed}"
                )
        return data


class ZstdScanView:
    """Forward reads of the decoded stream for the header scan.

    Decodes frame by frame through bounded reads; frames whose size is known
    and that lie entirely in skipped member data are not decoded at all. The
    sizes learned on the way complete the frame table (:meth:`frame_table`).

    ``frames`` comes from a seek table; without one (None) the frames are
    found as the scan goes (:class:`FrameWalker`), so the archive is read once,
    and the rest of the file is walked when the scan ends.
    """

    def __init__(
        self,
        source: Source,
        frames: list[Frame] | None,
        progress: Callable[[int, int], None] | None = None,
        window_max: int = MAX_WINDOW,
    ) -> None:
        self.source = source
        self.window_max = window_max  # larger frame windows are refused (refuse_large_window)
        self._fill_window = 0  # the window of the frame being decoded when over window_max (_check_fill)
        self.frames = list(frames) if frames is not None else []
        self.sizes: list[int | None] = [None if f.skippable else f.content_size for f in self.frames]
        self._fi = -1  # index of the frame being decoded (or last one passed)
        self._frame_start = 0  # decoded offset where frame _fi starts
        self._reader = None
        self._pos = 0  # decoded offset of the reader
        self._buf = b""
        self._buf_pos = 0
        self._scratch = bytearray(SCAN_CHUNK)
        self._progress = progress
        # Not a bound method: the zstd reader (a C object the GC cannot traverse) keeps its source's
        # callback, and view -> reader -> range -> view was a cycle never freed when a scan stopped
        # early (every corrupt archive): the view, its 1 MiB scratch buffer and the decoder leaked.
        self._report = _Reporter(progress, source.size) if progress is not None else None
        self._walker = FrameWalker(source, self._report) if frames is None else None
        self._dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        self.decoded_frames = 0
        # Frames whose listed size the scan used without decoding them to their end (it skipped
        # their bytes): what a wrong seek table entry hides in (TarFormat checks them on damage).
        self.unchecked: list[Frame] = []

    @property
    def has_data_frames(self) -> bool:
        """Whether the file holds any zstd data frame (of those listed or found so far)."""
        return any(not f.skippable for f in self.frames)

    def read(self, pos: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``pos`` (fewer only at the end of the stream); ``pos`` never moves back."""
        i = pos - self._buf_pos
        if i >= 0 and i + n <= len(self._buf):  # the common case: a header inside the current chunk
            return self._buf[i : i + n]
        out = []
        while n > 0:
            end = self._buf_pos + len(self._buf)
            if self._buf_pos <= pos < end:
                i = pos - self._buf_pos
                chunk = self._buf[i : i + n]
                out.append(chunk)
                pos += len(chunk)
                n -= len(chunk)
                continue
            if not self._fill(pos):
                break
        return out[0] if len(out) == 1 else b"".join(out)

    def _fill(self, pos: int) -> bool:
        """Make the buffer start at ``pos``; False at the end of the stream."""
        while True:
            if self._reader is None and not self._next_frame(pos):
                return False
            reader = self._reader
            known = self.sizes[self._fi]
            if known is not None and pos >= self._frame_start + known:
                self._frame_start += known  # the rest of this frame is skipped member data
                self._reader = None
                self._passed()
                if self._walker is None:
                    self.unchecked.append(self.frames[self._fi])
                continue
            if pos < self._pos:
                raise AssertionError("the tar scan moved backwards")
            try:
                if self._pos < pos:
                    want = min(SCAN_CHUNK, pos - self._pos)
                    got = reader.readinto(memoryview(self._scratch)[:want])
                    if got > 0:
                        self._pos += got
                        self._check_filled()
                        continue
                else:
                    data = reader.read(SCAN_CHUNK)
                    if data:
                        self._buf = data
                        self._buf_pos = self._pos
                        self._pos += len(data)
                        self._check_filled()
                        return True
            except zstandard.ZstdError as exc:
                frame = self.frames[self._fi]
                if "Dictionary mismatch" in str(exc):
                    raise ArchiveFormatError(
                        f"zstd frame #{self._fi} at offset {frame.offset} {_DICTIONARY}: decompress it "
                        "with that dictionary (zstd -d -D DICT) and pack the tar again"
                    ) from None
                raise ArchiveFormatError(
                    f"corrupt zstd frame #{self._fi} at offset {frame.offset}: {exc} "
                    "(the archive cannot be indexed past it)"
                ) from None
            self._end_frame()

    def _next_frame(self, pos: int) -> bool:
        while self._fi + 1 < len(self.frames) or self._discover():
            self._fi += 1
            frame = self.frames[self._fi]
            if frame.skippable:
                continue
            size = self.sizes[self._fi]
            if size is not None and self._frame_start + size <= pos:
                self._frame_start += size  # all of it is skipped member data: no need to decode
                self._passed()
                if self._walker is None:
                    self.unchecked.append(frame)
                continue
            if self._walker is None:
                window = declared_window(self.source, frame.offset, frame.comp_size)
                refuse_large_window(self._fi, window)
                self._check_fill(window, size)
                raw = _ListedFrameRange(self.source, self._fi, frame, size, self._report)
            else:
                header = self._walker.header
                assert header is not None
                refuse_large_window(self._fi, header.window_size)
                self._check_fill(header.window_size, header.content_size)
                raw = self._walker.frame_bytes()
            self._reader = self._dctx.stream_reader(raw, read_size=SCAN_CHUNK, read_across_frames=False)
            self._pos = self._frame_start
            self.decoded_frames += 1
            return True
        return False

    def _check_fill(self, window: int, content: int | None) -> None:
        """Refuse a frame whose decoder would fill more window than ``window_max`` (a mount's, a
        quarter of its cache). The decoder touches its window as it writes it: no more than the frame
        holds (a 200 KB frame declaring a 128 MiB window, as `zstd --long` writes from a pipe, fills
        200 KB). A frame that states its size is judged now; one that does not, as it decodes
        (``_check_filled``)."""
        self._fill_window = window if window > self.window_max else 0
        if content is not None and min(window, content) > self.window_max:
            refuse_large_window(self._fi, min(window, content), self.window_max)

    def _check_filled(self) -> None:
        """The frame being decoded, of a window over the limit, has now filled more than the limit."""
        if self._fill_window and self._pos - self._frame_start > self.window_max:
            refuse_large_window(self._fi, self._fill_window, self.window_max)

    def _discover(self) -> bool:
        """Walking: the next frame of the file appended to the table (False at the end of the file)."""
        if self._walker is None:
            return False
        frame = self._walker.next_frame()
        if frame is None:
            return False
        self.frames.append(frame)
        self.sizes.append(None if frame.skippable else frame.content_size)
        return True

    def _passed(self) -> None:
        """Walking: frame ``_fi`` is done with; pass the rest of its bytes, now that it is complete."""
        if self._walker is None:
            return
        frame = self.frames[self._fi] = self._walker.hop()
        if frame.content_size == 0:  # reads it again, but it is a few bytes (else it is refused)
            check_empty_frames(self.source, [frame], self._fi)

    def _end_frame(self) -> None:
        size = self._pos - self._frame_start
        expected = self.sizes[self._fi]
        self._passed()
        frame = self.frames[self._fi]
        if expected is not None and expected != size:
            error = SeekTableMismatch if self._walker is None else ArchiveFormatError
            raise error(
                f"zstd frame #{self._fi} at offset {frame.offset} decodes to {size} bytes, "
                f"its header or the seek table says {expected}"
            )
        self.sizes[self._fi] = size
        self._frame_start = self._pos
        self._reader = None

    def finish(self, end: int, tar_ended: bool = False) -> None:
        """The scan is over at decoded offset ``end``: decode the rest of the current frame for its
        size (and, walking, check that the rest of the file is a sequence of frames).

        ``tar_ended``: the tar stopped at its end-of-archive blocks, so bytes after the last frame
        that are no frame hold no member: a warning, not a refusal (``tar --zstd -x`` extracts
        everything from such a file)."""
        if self._reader is not None:
            try:
                while (n := self._reader.readinto(self._scratch)) > 0:
                    self._pos += n
            except zstandard.ZstdError as exc:
                raise ArchiveFormatError(f"corrupt zstd frame #{self._fi}: {exc}") from None
            self._end_frame()
        try:
            while self._discover():
                self._fi = len(self.frames) - 1
                if not self.frames[self._fi].skippable:
                    self._passed()
        except ArchiveFormatError as exc:
            if not tar_ended:
                raise
            log.warning("%s: %s, after the end of the tar: ignored", self.source.identity.location, exc)
            while self.frames and self.frames[-1].comp_size < 0:  # a frame found but cut: not ours
                self.frames.pop()
                self.sizes.pop()
        if self._progress is not None:
            self._progress(self.source.size, self.source.size)

    def frame_table(self) -> FrameTable:
        """Frames up to the first one whose size is still unknown (nothing after it holds members)."""
        table = FrameTable()
        table.sizes_measured = self._walker is not None  # frames found as decoded, not from a seek table
        for frame, size in zip(self.frames, self.sizes):
            if frame.skippable:
                continue
            if size is None:
                break
            table.add(frame.offset, frame.comp_size, size)
        return table
