"""The extent reader: ``read(entry, offset, size)`` for every member, through one bounded cache.

How each kind of member is served:

* **stored** — positioned reads straight from the source, never copied into
  the cache. The first read of a member up to ``whole_limit`` reads it whole
  and checks its CRC (the kernel page cache then keeps it); larger stored
  members are CRC-checked when read sequentially to their end.
* **deflate, small** (≤ ``whole_limit``) — one call: pread + inflate + CRC
  (native libdeflate when built), the whole member cached as one extent. A
  compressed size no real stream of that size can have (16 MiB for 100 bytes)
  is read in 1 MiB pieces instead, so a hostile record never costs its size.
* **deflate, huge** — a checkpoint index (zran technique) built on first access;
  a read at any offset inflates at most one interval; intervals and the
  checkpoint windows are cache entries, so they count against the bound.
* **bzip2 / LZMA / zstd / xz** — bounded streaming decoders; whole when small,
  forward chunks when large (a backward read restarts from the member's start;
  the first read decodes the whole member once to check its CRC, and a
  decoder that reaches the end is freed at once: its window is not cache).
* **in-stream** (tar, tar.zst) — the format's container stream splits a byte
  range into extents (zstd frames) that are decoded and cached one by one.
  A member with its own CRC (written by ``cdmlfs pack``) is served as soon as
  its frame is decoded up to the member's end and the CRC checks; the stream
  finishes the frame in the background (:mod:`cdmlfs.formats.zstdframes`).

Every decode reserves its output size in the cache first, so held + in-flight
decoded bytes never exceed the cache limit.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Protocol

from cdmlfs import decoders, forksafe, inflate
from cdmlfs.cache import ExtentCache, Reservation
from cdmlfs.crc_coverage import CrcCoverage
from cdmlfs.errors import (
    CorruptMemberError,
    EncryptedMemberError,
    MemberError,
    SourceError,
    UnsupportedMethodError,
)
from cdmlfs.index import DEFLATE, ENCRYPTED, IN_STREAM, INCONSISTENT, MEMBER_CRC, SPARSE, STORED, Index
from cdmlfs.sizes import human_bytes
from cdmlfs.sources.base import Source

log = logging.getLogger(__name__)

# Deflated members this large take seconds to index for random access (one inflate pass at
# ~150-250 MB/s here): the pass is announced in the log.
SLOW_INDEX_SIZE = 256 << 20


WHOLE_MEMBER_MAX = 64 << 20
EXTENT_SIZE = 4 << 20
MAX_SYMLINK = 4096
TRIM_AFTER_WINDOW = 4 << 20  # a decoder window this large is handed back to the OS when freed
MAX_FORWARD = 4  # forward decoders kept between reads (each may hold a window up to the member's size)
# States of a member in the reader's ``_verified`` column (shared with the C fast path).
UNCHECKED, VERIFIED, CORRUPT = 0, 1, 2
ENCRYPTED_REASON = "member is encrypted (reading encrypted members is not supported)"


class ContainerStream(Protocol):
    """What a container format (tar, tar.zst) offers the reader for IN_STREAM members."""

    def extents(self, offset: int, size: int) -> list[tuple[Hashable, int, int]]:
        """Extents ``(cache_key, start, length)`` that cover ``[offset, offset + size)`` of the stream."""
        ...

    def decode(self, key: Hashable, room: Reservation | None = None) -> bytes:
        """Decoded bytes of one extent (exactly its length), or raise a MemberError. The stream
        may commit them into ``room`` itself (before other readers can see its decoder move on)."""
        ...

    def verified_extent(self, key: Hashable) -> bool:
        """Whether a decoded extent's bytes were checked as a whole (a zstd frame and its checksum)."""
        ...


class ArchiveFormat(Protocol):
    """An opened archive: its index, its source, and where each member's bytes start."""

    name: str
    source: Source
    index: Index

    def data_offset(self, eid: int) -> int: ...


class _Forward:
    """A forward-only decoder positioned at ``pos`` of a member's output (``crc``: of bytes before it)."""

    __slots__ = ("crc", "evicted", "lock", "pos", "stream", "window")

    def __init__(self, stream) -> None:
        self.stream = stream
        self.pos = 0
        self.crc = 0
        self.window = 0  # memory its decoder holds outside the cache (decoders.window_size)
        self.evicted = False  # dropped from the table while a reader used it: that reader closes it
        self.lock = threading.Lock()

    def evict(self) -> None:
        """Leave the table: closed now if idle, else by the reader using it (never under its feet)."""
        if self.lock.acquire(blocking=False):
            try:
                self.close()
            finally:
                self.lock.release()
        else:
            self.evicted = True

    def close(self) -> None:
        """Free the decoder (its window can be as large as the member, outside the cache)."""
        stream, self.stream = self.stream, None
        if stream is not None:
            _close_quietly(stream)


class ExtentReader:
    """Serves member bytes for the FUSE layer and the Python API."""

    def __init__(self, fmt: ArchiveFormat, cache: ExtentCache, window_limit: int | None = None) -> None:
        self.fmt = fmt
        self.index = fmt.index
        self.source = fmt.source
        self.cache = cache
        self._fd = fmt.source.fileno()
        self.whole_limit = min(WHOLE_MEMBER_MAX, cache.limit // 4)
        # The largest window of a forward decoder (memory outside the cache): as Archive's, 128 MiB
        # unless given (a mount gives decoders.window_limit of its cache).
        self.window_limit = window_limit or decoders.MAX_WINDOW
        self.extent_size = max(64 << 10, min(EXTENT_SIZE, cache.limit // 4))
        # Per member: UNCHECKED, VERIFIED (its CRC checked) or CORRUPT (a check failed: every later read
        # fails too, whatever path or offset it takes, so no page of it is ever served unverified again).
        self._verified = bytearray(self.index.entry_count)
        self._corrupt: dict[int, str] = {}  # why a CORRUPT member failed
        self._crc_runs: dict[int, CrcCoverage] = {}  # large members read so far, before their CRC check
        self._checked_whole: dict[int, bool] = {}  # large packed members: served from checked frames?
        self._forward: dict[int, _Forward] = {}
        self._build_locks: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()
        self.stream: ContainerStream | None = getattr(fmt, "stream", None)
        # Decoded stream bytes before their extent is finished (zstd frames of packed archives).
        self._member_bytes: Callable[[int, int], memoryview | None] | None = getattr(
            self.stream, "member_bytes", None
        )
        self._source_read_into = getattr(fmt.source, "read_into", None)
        # After every read: a local file written in place fails its reads (LocalFile.check_unchanged).
        self._check_source: Callable[[], None] | None = getattr(fmt.source, "check_unchanged", None)
        self._closed = False
        if self.stream is not None and hasattr(self.stream, "bound_extents"):
            # A container extent (a whole zstd frame) is reserved in one piece: it must fit this cache.
            self.stream.bound_extents(self.whole_limit, self.extent_size, cache, self.window_limit)
        # Bytes read straight from the file descriptor (the rest is counted by the source itself).
        self.bytes_direct = 0
        # Told (cache key, stream offset, bytes or mmap) of each container extent a read is served from:
        # the C fast path answers later reads inside it while the cache holds it.
        self.on_extent: Callable[[Hashable, int, object], object] | None = None
        forksafe.register(self)

    def _after_fork_child(self) -> None:
        """Fresh locks and decoder states in a forked child (the index and source stay shared)."""
        self._lock = threading.Lock()
        self._build_locks = {}
        self._forward = {}
        self._crc_runs = {}

    # -- public --------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Refuse every later read: the source's descriptor number may already belong to another file.

        The container stream's background threads (zstd frames finished, pieces
        decoded ahead) stop here too, before the caller closes the source.
        """
        self._closed = True
        self._fd = None
        close = getattr(self.stream, "close", None)
        if close is not None:
            close()

    def _check(self, offset: int) -> None:
        if self._closed:
            raise ValueError("I/O operation on a closed archive")
        if offset < 0:
            raise ValueError(f"negative offset {offset}")

    def read(self, eid: int, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of member ``eid`` at ``offset`` (short only at end of member)."""
        data = self.view(eid, offset, size)
        return data if type(data) is bytes else bytes(data)

    def read_into(self, eid: int, offset: int, size: int, out) -> int:
        """Like ``read`` but into a writable buffer (the FUSE reply buffer): one copy, no garbage.

        Stored members that need no whole-member CRC pass (already verified, or
        too large for one) go straight from the source into ``out``: a positioned
        read for local files, the source's own ``read_into`` for remote ones.
        """
        self._check(offset)
        ix = self.index
        if ix.hardlink_of:
            eid = ix.hardlink_of.get(eid, eid)
        out = memoryview(out)
        if out.format != "B":
            out = out.cast("B")  # ctypes buffers come as '<c'
        total = ix.size[eid]
        if ix.flags[eid] & INCONSISTENT:
            self.check_consistent(eid)
        state = self._verified[eid]
        if ix.method[eid] == STORED and state != CORRUPT and (state == VERIFIED or total > self.whole_limit):
            if offset >= total or size <= 0:
                return 0
            n = min(size, total - offset)
            try:
                if ix.flags[eid] & ENCRYPTED:
                    raise EncryptedMemberError(ENCRYPTED_REASON)
                self._stored_into(eid, self.fmt.data_offset(eid) + offset, out[:n])
                if state != VERIFIED:
                    self._track_crc(eid, offset, out[:n], total)
            except (MemberError, SourceError) as exc:
                self._raise_if_closed_meanwhile(exc)
                if isinstance(exc, MemberError) and exc.member is None:
                    exc.member = ix.paths[eid]
                raise
            self._source_unchanged()
            return n
        data = self._view(eid, offset, size)
        n = len(data)
        out[:n] = data
        self._source_unchanged()
        return n

    def _source_unchanged(self) -> None:
        if self._check_source is not None:
            try:
                self._check_source()
            except SourceError as exc:
                self._raise_if_closed_meanwhile(exc)
                raise

    def _stored_into(self, eid: int, at: int, dst: memoryview) -> None:
        n = len(dst)
        if self._fd is not None:
            if os.preadv(self._fd, [dst], at) != n:
                dst[:] = self.source.read_at(at, n)  # short: the source raises a SourceError with context
            self.bytes_direct += n
        elif self._source_read_into is not None:
            self._source_read_into(at, dst)
        else:
            dst[:] = self.source.read_at(at, n)

    def _track_crc(self, eid: int, offset: int, data, total: int) -> None:
        """Check a large member's CRC once its bytes have all been read, in any order.

        Such members (stored ZIP members, packed tar.zst members in pieces of huge frames)
        are too large to read whole on first access; reads are served as they come,
        unverified until then (documented), and the read that completes the coverage
        fails if the CRC does not match.
        """
        crc = self.index.crc[eid]
        with self._lock:
            coverage = self._crc_runs.get(eid)
            if coverage is None:
                coverage = self._crc_runs[eid] = CrcCoverage(total)
            running = coverage.add(offset, data)
            if running is None:
                return
            self._crc_runs.pop(eid, None)
        if running != crc:
            self._mark_corrupt(eid, inflate.crc_mismatch(crc, running))
        self._verified[eid] = VERIFIED

    def view(self, eid: int, offset: int, size: int) -> bytes | memoryview:
        """Bytes or a memoryview into a cached extent (no copy); the caller must not keep it long."""
        data = self._view(eid, offset, size)
        self._source_unchanged()
        return data

    def _view(self, eid: int, offset: int, size: int) -> bytes | memoryview:
        self._check(offset)
        ix = self.index
        if ix.hardlink_of:
            eid = ix.hardlink_of.get(eid, eid)
        total = ix.size[eid]
        if ix.flags[eid] & INCONSISTENT:
            self.check_consistent(eid)
        if offset >= total or size <= 0:
            return b""
        if offset + size > total:
            size = total - offset
        method = ix.method[eid]
        try:
            if self._verified[eid] == CORRUPT:
                raise CorruptMemberError(self._corrupt.get(eid, "failed an integrity check earlier"))
            if ix.flags[eid] & ENCRYPTED:
                raise EncryptedMemberError(ENCRYPTED_REASON)
            if method == STORED:
                return self._read_stored(eid, offset, size, total)
            if method == IN_STREAM:
                if ix.flags[eid] & MEMBER_CRC:
                    return self._read_member_with_crc(eid, offset, size, total)
                if ix.flags[eid] & SPARSE:
                    return self._read_sparse(eid, offset, size)
                return self._read_in_stream(ix.offset[eid] + offset, size)
            if method == DEFLATE:
                # Whole: the compressed bytes are in memory too (reserved below), so both are bounded.
                if total <= self.whole_limit and ix.comp_size[eid] <= self.whole_limit:
                    return self._read_whole_deflate(eid, offset, size, total)
                return self._read_checkpointed(eid, offset, size, total)
            if method in decoders.STREAM_METHODS:
                if total <= self.whole_limit:
                    return self._read_whole_stream(eid, offset, size, total)
                return self._read_forward(eid, offset, size, total)
            raise UnsupportedMethodError(
                f"compression method {decoders.method_name(method)} is not supported"
            )
        except CorruptMemberError as exc:
            self._raise_if_closed_meanwhile(exc)
            # Damage does not heal: every later read fails at once, with the same reason, instead
            # of decoding the member again (a multi-GiB deflated one for seconds, each time).
            if self._verified[eid] != CORRUPT:
                self._remember_corrupt(eid, exc.reason)
            if exc.member is None:
                exc.member = ix.paths[eid]
            raise
        except (MemberError, SourceError) as exc:
            self._raise_if_closed_meanwhile(exc)
            if isinstance(exc, MemberError) and exc.member is None:
                exc.member = ix.paths[eid]
            raise

    def _raise_if_closed_meanwhile(self, exc: Exception) -> None:
        """A read the archive was closed under fails as one after it does, not as damage: its
        descriptor reads /dev/null by then (LocalFile.close), so it looked truncated or corrupt."""
        if self._closed:
            raise ValueError("I/O operation on a closed archive") from exc

    def readlink(self, eid: int) -> str:
        target = self.index.link_target.get(eid)
        if target is not None:
            return target
        size = self.index.size[eid]
        if size > MAX_SYMLINK:
            raise CorruptMemberError(
                f"symlink target is {size} bytes (more than {MAX_SYMLINK})", self.index.paths[eid]
            )
        target = bytes(self.view(eid, 0, size)).decode("utf-8", "surrogateescape")
        # A NUL ended the target the kernel saw (a C string) while lstat gave the member's size:
        # "_" instead, as tar link names get, keeps the two in agreement.
        return target.replace("\0", "_")

    def check_consistent(self, eid: int) -> None:
        """Raise CorruptMemberError for an entry whose own record is contradictory (see INCONSISTENT)."""
        ix = self.index
        if ix.flags[eid] & INCONSISTENT:
            reason = ix.problems.get(eid) or (
                f"declared empty, but its record says otherwise (CRC {ix.crc[eid]:#010x}, "
                f"{ix.comp_size[eid]} compressed bytes)"
            )
            raise CorruptMemberError(reason, ix.paths[eid])

    def _verify_crc(self, eid: int, data) -> None:
        """Check a whole member's bytes against its CRC: VERIFIED, or CORRUPT and raise."""
        try:
            _check_crc(data, self.index.crc[eid])
        except CorruptMemberError as exc:
            self._mark_corrupt(eid, str(exc))
        self._verified[eid] = VERIFIED

    def _mark_corrupt(self, eid: int, reason: str) -> None:
        """Remember that member ``eid`` failed a check, and raise: later reads fail the same way."""
        self._remember_corrupt(eid, reason)
        raise CorruptMemberError(reason)

    def _remember_corrupt(self, eid: int, reason: str) -> None:
        self._corrupt[eid] = reason
        self._verified[eid] = CORRUPT

    # -- stored --------------------------------------------------------------
    def _read_stored(self, eid: int, offset: int, size: int, total: int) -> bytes:
        start = self.fmt.data_offset(eid)
        if self._verified[eid] == VERIFIED:
            return self.source.read_at(start + offset, size)
        crc = self.index.crc[eid]
        if total <= self.whole_limit:
            with self.cache.reserve(total):
                try:
                    if self._fd is not None:
                        data = inflate.read_stored(self._fd, start, total, crc)
                        self.bytes_direct += total
                    else:
                        data = self.source.read_at(start, total)
                        _check_crc(data, crc)
                except CorruptMemberError as exc:
                    self._mark_corrupt(eid, str(exc))
                self._verified[eid] = VERIFIED
                return _view(data, offset, offset + size)
        # Large stored member: serve directly, verify the CRC as a sequential reader reaches the end.
        data = self.source.read_at(start + offset, size)
        self._track_crc(eid, offset, data, total)
        return data

    # -- deflate -------------------------------------------------------------
    def _read_whole_deflate(self, eid: int, offset: int, size: int, total: int) -> bytes:
        cache = self.cache
        data = cache.get(eid)
        if data is None:
            ix = self.index
            start = self.fmt.data_offset(eid)
            comp = ix.comp_size[eid]
            if not inflate.plausible_comp_size(comp, total):
                # No real stream of this size is that long: read it in pieces, never whole.
                with cache.reserve(min(2 * total + inflate.PIECE, cache.limit)) as room:
                    read_at = self.source.read_at
                    data = inflate.read_deflated_in_pieces(read_at, start, comp, total, ix.crc[eid])
                    room.commit(eid, data)
                return _view(data, offset, offset + size)
            # The compressed member is read whole before it is inflated: that memory counts too
            # (several threads inflating large, barely compressible members held ~a cache of it).
            with cache.reserve(total + comp) as room:
                if self._fd is not None:
                    data = inflate.read_deflated(self._fd, start, comp, total, ix.crc[eid])
                    self.bytes_direct += comp
                else:
                    data = inflate.inflate(self.source.read_at(start, comp), total, ix.crc[eid])
                room.commit(eid, data)
        return _view(data, offset, offset + size)

    def _checkpoints(self, eid: int):
        from cdmlfs.checkpoints import DeflateCheckpoints

        key = ("ckpt", eid)
        ck = self.cache.get(key)
        if ck is not None:
            return ck
        with self._lock:
            lock = self._build_locks.setdefault(eid, threading.Lock())
        with lock:
            ck = self.cache.peek(key)
            if ck is None:
                ix = self.index
                size = ix.size[eid]
                # An impossible declared size (4 EiB from 20 bytes) is corrupt: said before a
                # warning of a long pass and a cache-size demand that only looked real.
                inflate.check_sizes(ix.comp_size[eid], size)
                started = time.monotonic()
                if size >= SLOW_INDEX_SIZE:
                    # The pass blocks a single-threaded mount: say why it stops answering, and how
                    # to avoid it (users otherwise see a hang of tens of seconds per 10 GB).
                    log.warning(
                        "%s: inflating all %s of this deflated member once to index it for random "
                        "access; other requests of the mount wait (store such files uncompressed, or "
                        "'cdmlfs pack' the archive to tar.zst, to avoid it)",
                        ix.paths[eid],
                        human_bytes(size),
                    )
                ck = DeflateCheckpoints.build(
                    self.source.read_at,
                    self.fmt.data_offset(eid),
                    ix.comp_size[eid],
                    size,
                    ix.crc[eid],
                    spacing=self._checkpoint_spacing(size),
                )
                if size >= SLOW_INDEX_SIZE:
                    log.warning("%s: indexed in %.1f s", ix.paths[eid], time.monotonic() - started)
                self.cache.put(key, ck)
        return ck

    def _checkpoint_spacing(self, size: int) -> int:
        """Interval length for a huge deflated member, so that its checkpoints fit a quarter of the cache.

        Each checkpoint keeps a 32 KiB window (about 60 KiB in the zlib fallback).
        At the usual 4 MiB spacing a 10 GiB member (10 MB of zeros in a ZIP) needs
        80 MiB of them: more than a small cache holds, and a checkpoint index the
        cache cannot keep is rebuilt, inflating the whole member, on every read.
        Longer intervals keep it cacheable (a random read then inflates one longer
        interval); when even intervals of 3/8 of the cache would not do, the read is
        refused with a message naming the cache size that would.
        """
        from cdmlfs import checkpoints

        window = 32 << 10 if inflate.native_module() is not None else checkpoints.SNAPSHOT_BYTES + (16 << 10)
        per_point = window + checkpoints.POINT_OVERHEAD + checkpoints.INTERVAL_OVERHEAD + 64
        limit = self.cache.limit
        spacing = self.extent_size
        if -(-size // spacing) * per_point <= limit // 4:
            return spacing
        spacing = -(-size * per_point // max(limit // 4, 1))
        spacing = -(-spacing // (64 << 10)) * (64 << 10)
        # A read reserves an interval's output and its compressed input (up to as much again, for
        # data that does not compress) next to the index: past 3/8 of the cache each, reading one
        # evicted the index, and every read inflated the whole member again to rebuild it.
        if spacing > 3 * limit // 8 - (64 << 10):
            need = int((32 / 3 * size * per_point) ** 0.5) + (2 << 20)
            raise MemberError(
                f"a {size >> 20} MiB deflated member needs a cache of at least {need >> 20} MiB "
                f"for random access (the cache is {limit >> 20} MiB): mount with a larger --cache-size"
            )
        return spacing

    def _read_checkpointed(self, eid: int, offset: int, size: int, total: int) -> bytes:
        ck = self._checkpoints(eid)

        def load(k: int) -> bytes:
            # Output and the compressed interval it is inflated from are in memory together.
            need = min(ck.spacing, total - k * ck.spacing) + ck.interval_input(k)
            with self.cache.reserve(min(need, self.cache.limit)) as room:
                chunk = ck.decode_interval(self.source.read_at, k)
                room.commit((eid, k), chunk)
            return chunk

        return self._gather(eid, offset, size, ck.spacing, load)

    def _gather(self, eid: int, offset: int, size: int, spacing: int, load: Callable[[int], bytes]):
        """Bytes ``[offset, offset+size)`` of a member cached as extents ``(eid, k)`` of ``spacing``
        bytes; ``load(k)`` decodes (and caches) a missing one."""
        parts = []
        end = offset + size
        k = offset // spacing
        while k * spacing < end:
            chunk = self.cache.get((eid, k))
            if chunk is None:
                chunk = load(k)
            lo = max(offset - k * spacing, 0)
            hi = min(end - k * spacing, len(chunk))
            parts.append(_view(chunk, lo, hi))
            k += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # -- other methods ----------------------------------------------------------
    def _read_whole_stream(self, eid: int, offset: int, size: int, total: int) -> bytes:
        """A bzip2 / LZMA / xz / zstd member small enough to decode whole, CRC-checked.

        The decoder's window (up to the member's size: an xz dictionary, a zstd
        window) lives outside the cache while it runs, so it is reserved too, and
        the decoder is closed before the bytes are committed: with only the output
        reserved, four such decodes at once held about one more cache's worth
        (measured +80 MiB over a 64 MiB cache).
        """
        data = self.cache.get(eid)
        if data is None:
            ix = self.index
            at, comp, method = self.fmt.data_offset(eid), ix.comp_size[eid], ix.method[eid]
            window = decoders.window_size(self.source, method, at, comp, total)
            with self.cache.reserve(min(total + window, self.cache.limit)) as room:
                stream = decoders.open_stream(self.source, method, at, comp, total)
                try:
                    data = decoders.read_exact(stream, total)
                    longer = not decoders.at_end(stream)
                finally:
                    _close_quietly(stream)
                if longer:
                    raise CorruptMemberError("member decodes to more bytes than declared")
                _check_crc(data, ix.crc[eid])
                room.commit(eid, data)
            if window >= TRIM_AFTER_WINDOW and self.cache.trim_hook is not None:
                self.cache.trim_hook()  # the window was heap memory: give it back now
        return _view(data, offset, offset + size)

    def _read_forward(self, eid: int, offset: int, size: int, total: int) -> bytes:
        """Large non-deflate members: decode forward in extents; a backward read restarts.

        The first read decodes the whole member once and checks its CRC before
        serving anything (as the deflate checkpoint build does): a forward
        decoder has no other way to know that the bytes it hands out are right.
        The extents that pass keep in the cache as far as it holds them.
        """
        spacing = self.extent_size
        if self._verified[eid] != VERIFIED:
            self._forward_extent(eid, (total - 1) // spacing, total)
        return self._gather(eid, offset, size, spacing, lambda k: self._forward_extent(eid, k, total))

    def _forward_extent(self, eid: int, k: int, total: int) -> bytes:
        spacing = self.extent_size
        ix = self.index
        with self._lock:
            fw = self._forward.pop(eid, None)  # re-inserted last: the table is in order of use
            if fw is None:
                if len(self._forward) >= MAX_FORWARD:  # decoder states hold windows: keep only a few
                    self._forward.pop(next(iter(self._forward))).evict()
                fw = _Forward(None)
            self._forward[eid] = fw
        with fw.lock:
            chunk = self.cache.peek((eid, k))
            if chunk is not None:
                return chunk
            if fw.stream is None or fw.pos > k * spacing:
                fw.close()
                at, comp = self.fmt.data_offset(eid), ix.comp_size[eid]
                fw.window = decoders.window_size(self.source, ix.method[eid], at, comp, total)
                if fw.window > self.window_limit:
                    with self._lock:
                        if self._forward.get(eid) is fw:
                            del self._forward[eid]
                    why = decoders.window_refusal(fw.window, self.window_limit)
                    raise MemberError(f"{decoders.method_name(ix.method[eid])} member {why}")
                self._make_room_for_window(eid, fw.window)
                # A member larger than the limit: every frame's window is held to it (open_stream).
                cap = self.window_limit if total > self.window_limit else decoders.MAX_WINDOW
                fw.stream = decoders.open_stream(self.source, ix.method[eid], at, comp, total, cap)
                fw.pos = 0
                fw.crc = 0
            try:
                while True:
                    j = fw.pos // spacing
                    length = min(spacing, total - fw.pos)
                    with self.cache.reserve(length) as room:
                        chunk = decoders.read_exact(fw.stream, length)
                        fw.crc = inflate.crc32(chunk, fw.crc)
                        fw.pos += length
                        if fw.pos == total:
                            self._finish_forward(eid, fw)
                        room.commit((eid, j), chunk)
                    if j == k:
                        return chunk
            except BaseException:
                fw.close()  # a failed decoder cannot go on from where it stopped
                raise
            finally:
                if fw.evicted:
                    fw.close()
                if fw.stream is None:
                    with self._lock:
                        if self._forward.get(eid) is fw:
                            del self._forward[eid]
                    if self.cache.trim_hook is not None:
                        self.cache.trim_hook()  # the window was heap memory: give it back now

    def _make_room_for_window(self, eid: int, window: int) -> None:
        """Close other forward decoders (least recently used first) until theirs and this window fit
        one decode's budget: four zstd members with 128 MiB windows held 546 MiB next to a 16 MiB
        cache. One other decoder always stays: two readers taking turns on two large members would
        otherwise close each other's decoder at every extent and restart it from the member's start
        (10 s instead of 1 s for 60 interleaved MiB)."""
        with self._lock:
            others = [e for e, f in self._forward.items() if e != eid and f.stream is not None]
            held = sum(self._forward[e].window for e in others)
            for other in others[:-1]:
                if held + window <= self.whole_limit:
                    break
                fw = self._forward.pop(other)
                held -= fw.window
                fw.evict()

    def _finish_forward(self, eid: int, fw: _Forward) -> None:
        """A forward decoder reached the member's end: check it, then let its window go."""
        longer = not decoders.at_end(fw.stream)
        fw.close()
        if longer:
            self._mark_corrupt(eid, "member decodes to more bytes than declared")
        crc = self.index.crc[eid]
        if fw.crc != crc:
            self._mark_corrupt(eid, inflate.crc_mismatch(crc, fw.crc))
        self._verified[eid] = VERIFIED

    # -- containers ----------------------------------------------------------
    def _read_member_with_crc(self, eid: int, offset: int, size: int, total: int) -> bytes | memoryview:
        """A member whose own CRC the index holds (packed archives): checked before it is served.

        Its frame decoded up to the member's end when the frame worker takes it;
        otherwise (a frame too large for one decode is served in pieces, which
        the frame checksum covers only at the frame's end) the whole member
        gathered from the extents. A member too large to gather is served from
        whole frames, each checked by its own checksum; where pieces of a frame
        serve it (a frame over a quarter of the cache), it is checked like a large
        stored member: once every byte has been read, the completing read failing.
        """
        if self._member_bytes is not None:
            data = self._read_checked_member(eid, offset, size, total)
            if data is not None:
                return data
        start = self.index.offset[eid]
        # checked=False: the C path must not serve other members from an unverified piece.
        if self._verified[eid] == VERIFIED:
            return self._read_in_stream(start + offset, size, checked=False)
        if total > self.whole_limit:
            # Asked before the read: stream.extents() marks where the reader is, for decode-ahead.
            checked = self._in_checked_extents(eid, start, total)
            data = self._read_in_stream(start + offset, size, checked=False)
            if not checked:
                self._track_crc(eid, offset, data, total)
            return data
        # Checked part by part and served from the cached extents: joined whole, each reader held
        # a copy of up to a quarter of the cache outside it (8 readers of 15 MiB members in 64 MiB
        # frames: ~100 MiB over the bound).
        parts = self._stream_parts(start, total, checked=False)
        crc = 0
        for part in parts:
            crc = inflate.crc32(part, crc)
        try:
            inflate.check_crc(crc, self.index.crc[eid])
        except CorruptMemberError as exc:
            self._mark_corrupt(eid, str(exc))
        self._verified[eid] = VERIFIED
        return _slice_parts(parts, offset, offset + size)

    def _in_checked_extents(self, eid: int, start: int, total: int) -> bool:
        """Whether every extent of member ``eid`` is checked whole before it is served (zstd frames).

        Asked once per member: a 10 GiB member is thousands of extents, and reads come 128 KiB
        at a time."""
        known = self._checked_whole.get(eid)
        if known is None:
            stream = self.stream
            assert stream is not None
            known = all(stream.verified_extent(key) for key, _, _ in stream.extents(start, total))
            self._checked_whole[eid] = known
        return known

    def _read_checked_member(self, eid: int, offset: int, size: int, total: int) -> memoryview | None:
        """A member decoded only as far as its end, served once its own CRC checks (or None)."""
        whole = self._member_bytes(self.index.offset[eid], total)  # type: ignore[misc]
        if whole is None:
            return None
        if self._verified[eid] != VERIFIED:
            self._verify_crc(eid, whole)
        return whole[offset : offset + size]

    def _read_sparse(self, eid: int, offset: int, size: int) -> bytes:
        """A tar sparse file: its data segments from the stream (stored back to back), zeros between."""
        starts, lengths, stored = self.index.sparse[eid]
        base = self.index.offset[eid]
        end = offset + size
        out = bytearray(size)
        j = max(bisect.bisect_right(starts, offset) - 1, 0)
        while j < len(starts) and starts[j] < end:
            lo = max(starts[j], offset)
            hi = min(starts[j] + lengths[j], end)
            if lo < hi:
                at = base + stored[j] + lo - starts[j]
                out[lo - offset : hi - offset] = self._read_in_stream(at, hi - lo)
            j += 1
        return bytes(out)

    def _read_in_stream(self, offset: int, size: int, checked: bool = True) -> bytes:
        """Stream bytes through cached extents; the last one is handed to the C fast path (which
        serves every member inside it) when there is nothing to check (``checked``: members
        without CRCs) or the stream verified it whole (a zstd frame, checksum included)."""
        parts = self._stream_parts(offset, size, checked)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _stream_parts(self, offset: int, size: int, checked: bool = True) -> list:
        """``_read_in_stream``'s bytes as views of the extents that hold them, in order."""
        stream = self.stream
        if stream is None:
            raise UnsupportedMethodError("member lives in a container stream this archive does not have")
        parts = []
        end = offset + size
        for key, start, length in stream.extents(offset, size):
            chunk = self.cache.get(key)
            if chunk is None:
                with self.cache.reserve(length) as room:
                    chunk = stream.decode(key, room)
                    if len(chunk) != length:
                        raise CorruptMemberError(f"extent decoded to {len(chunk)} bytes instead of {length}")
                    # Not when the stream committed it already, or handed back what the cache
                    # holds (a piece another reader decoded while we waited): storing the same
                    # value again would drop it from the C path and count its bytes twice.
                    if room.remaining and self.cache.peek(key) is not chunk:
                        room.commit(key, chunk)
            lo = max(offset - start, 0)
            hi = min(end - start, length)
            parts.append(_view(chunk, lo, hi))
        if self.on_extent is not None and (checked or stream.verified_extent(key)):
            try:
                self.on_extent(key, start, chunk)
            except Exception as exc:  # an optimisation: the read itself has its bytes
                log.debug("could not hand extent %r to the C path: %s", key, exc)
        return parts


def _close_quietly(stream) -> None:
    try:
        stream.close()
    except Exception as exc:  # a decoder that fails to close has nothing left to give back
        log.debug("closing a decoder: %s", exc)


def _view(data: bytes, lo: int, hi: int) -> bytes | memoryview:
    """``data[lo:hi]`` without copying (the whole object when the range covers it)."""
    if lo == 0 and hi >= len(data):
        return data
    return memoryview(data)[lo:hi]


def _slice_parts(parts: list, lo: int, hi: int) -> bytes | memoryview:
    """Bytes ``[lo, hi)`` of the consecutive ``parts``: a view when one part holds them."""
    pieces = []
    at = 0
    for part in parts:
        n = len(part)
        if at + n > lo and at < hi:
            pieces.append(_view(part, max(lo - at, 0), min(hi - at, n)))
        at += n
        if at >= hi:
            break
    if len(pieces) == 1:
        return pieces[0]
    return b"".join(pieces)


def _check_crc(data: bytes, crc: int) -> None:
    inflate.check_crc(inflate.crc32(data), crc)
