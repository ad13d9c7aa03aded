"""Random access inside huge deflated members (say a 5 GB .npy inside a ZIP).

Deflate has no index: byte N of the output depends on everything before it. One
verifying pass over the member records checkpoints, after which any interval of
``spacing`` output bytes decodes on its own, so a read at a random offset costs
one interval of inflate instead of everything before it.

With the C accelerator a checkpoint is what zlib needs to restart at a deflate
block boundary (the "zran" technique): compressed offset, unread bits of the
previous byte and the 32 KiB window. Interval k restarts from the last boundary at
or before its start, so it inflates at most one deflate block it does not return.
Without it, the fallback snapshots ``zlib.decompressobj`` with ``copy()`` exactly
at each interval start (about 45 KiB each, counted in ``nbytes``). Both return the
same bytes and raise the same errors.

``read_at(offset, length)`` is the caller's positioned read of the archive; it
must return exactly ``length`` bytes or raise (a short result is a SourceError).
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from typing import Any

from cdmlfs import inflate
from cdmlfs.errors import CorruptMemberError, SourceError

ReadAt = Callable[[int, int], bytes]
Progress = Callable[[int], Any]

DEFAULT_SPACING = 4 << 20
BUILD_CHUNK = 1 << 20  # compressed bytes per read_at call while building
DECODE_CHUNK = 256 << 10  # compressed bytes per extra read_at call while decoding
PY_SLICE = 16 << 10  # bounds the input a fallback snapshot keeps alive
PY_STEP = 1 << 20  # output bytes per zlib call when skipping in the fallback
SNAPSHOT_BYTES = 45 << 10  # zlib inflate state + 32 KiB window, per fallback snapshot
POINT_OVERHEAD = 200  # tuple, ints and bytes header of one native point
INTERVAL_OVERHEAD = 80  # two list slots and ints per interval


def _read(read_at: ReadAt, offset: int, length: int) -> bytes:
    data = read_at(offset, length)
    if len(data) != length:
        raise SourceError(f"short read: got {len(data)} of {length} bytes at offset {offset}")
    return data


class _Chunks:
    """Compressed input from ``start`` on: first ``first`` bytes, then fixed-size chunks."""

    def __init__(self, read_at: ReadAt, base: int, comp_size: int, start: int, first: int) -> None:
        self._read_at, self._base, self._end = read_at, base, comp_size
        self.pos, self._next = start, max(1, first)

    def next(self) -> bytes:
        """The next chunk, or b"" when the member's compressed bytes are exhausted."""
        n = min(self._next, self._end - self.pos)
        if n <= 0:
            return b""
        data = _read(self._read_at, self._base + self.pos, n)
        self.pos += n
        self._next = DECODE_CHUNK
        return data


class DeflateCheckpoints:
    """Checkpoints of one raw deflate member; thread-safe to decode from once built."""

    spacing: int
    size: int
    nbytes: int

    def __init__(
        self,
        *,
        spacing: int,
        size: int,
        comp_offset: int,
        comp_size: int,
        ends: list[int],
        starts: list[Any],
        points: list[tuple[int, int, int, bytes]] | None,
        nbytes: int,
    ) -> None:
        self.spacing = spacing
        self.size = size
        self.nbytes = nbytes
        self._comp_offset = comp_offset
        self._comp_size = comp_size
        self._ends = ends  # interval k's output is complete after this many compressed bytes
        self._starts = starts  # native: index into points; fallback: (snapshot, comp offset)
        self._points = points  # native only: (out offset, comp offset, bits, window)

    # ------------------------------------------------------------- building

    @classmethod
    def build(
        cls,
        read_at: ReadAt,
        comp_offset: int,
        comp_size: int,
        size: int,
        crc: int,
        spacing: int = DEFAULT_SPACING,
        progress: Progress | None = None,
    ) -> DeflateCheckpoints:
        """One streaming pass over the member that verifies its size and CRC and records checkpoints.

        ``progress(n)`` (if given) is called with the compressed bytes consumed by
        each step, so tqdm's ``update`` fits. Raises CorruptMemberError for bad
        data, SourceError when ``read_at`` fails.
        """
        return cls._build(
            inflate.native_module(), read_at, comp_offset, comp_size, size, crc, spacing, progress
        )

    @classmethod
    def _build(
        cls,
        native: Any,
        read_at: ReadAt,
        comp_offset: int,
        comp_size: int,
        size: int,
        crc: int,
        spacing: int,
        progress: Progress | None,
    ) -> DeflateCheckpoints:
        """build() with the backend chosen by the caller (None = pure Python); tests use both."""
        if spacing <= 0:
            raise ValueError("spacing must be positive")
        if not 0 <= crc <= 0xFFFFFFFF:
            raise ValueError("crc must be in range(2**32)")
        inflate.check_sizes(comp_size, size)
        common = {"spacing": spacing, "size": size, "comp_offset": comp_offset, "comp_size": comp_size}
        if size == 0 and comp_size == 0:  # empty member stored as no deflate bytes
            inflate.check_crc(0, crc)
            return cls(ends=[], starts=[], points=None, nbytes=0, **common)
        if native is not None:
            return cls(
                **common,
                **_build_native(native, read_at, comp_offset, comp_size, size, crc, spacing, progress),
            )
        return cls(**common, **_build_python(read_at, comp_offset, comp_size, size, crc, spacing, progress))

    # ------------------------------------------------------------- decoding

    def interval_count(self) -> int:
        """Number of intervals: ceil(size / spacing)."""
        return len(self._ends)

    def interval_input(self, k: int) -> int:
        """Compressed bytes a decode of interval ``k`` holds at most (reserve them with its output)."""
        start = self._points[self._starts[k]][1] if self._points is not None else self._starts[k][1]
        return self._ends[k] - start + 64

    def decode_interval(self, read_at: ReadAt, k: int) -> bytes:
        """Output bytes [k*spacing, min((k+1)*spacing, size)), inflating at most one interval."""
        if not 0 <= k < len(self._ends):
            raise IndexError(f"interval {k} out of range(0, {len(self._ends)})")
        return self._decode(read_at, k, 0, min(self.spacing, self.size - k * self.spacing))

    def read(self, read_at: ReadAt, offset: int, length: int) -> bytes:
        """Output bytes [offset, offset+length) (clipped at the end), decoding only what is needed."""
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be non-negative")
        end = min(offset + length, self.size)
        parts = []
        while offset < end:
            k, within = divmod(offset, self.spacing)
            n = min(self.spacing - within, end - offset)
            parts.append(self._decode(read_at, k, within, n))
            offset += n
        return b"".join(parts)

    def _decode(self, read_at: ReadAt, k: int, within: int, n: int) -> bytes:
        """n output bytes starting ``within`` bytes into interval k."""
        if n == 0:
            return b""
        if self._points is not None:
            return self._decode_native(read_at, k, within, n)
        return self._decode_python(read_at, k, within, n)

    def _first_read(self, k: int, start_in: int, start_out: int, want_out: int) -> int:
        """Compressed bytes to fetch first: proportional to the output needed, plus slack."""
        end_in = self._ends[k]
        span = min((k + 1) * self.spacing, self.size) - start_out
        if want_out >= span:
            return end_in - start_in + 64
        guess = (end_in - start_in) * want_out // max(span, 1)
        return min(end_in - start_in + 64, guess + guess // 8 + (16 << 10))

    def _decode_native(self, read_at: ReadAt, k: int, within: int, n: int) -> bytes:
        native = inflate.native_module()
        assert self._points is not None
        out_p, in_p, bits, window = self._points[self._starts[k]]
        skip = k * self.spacing + within - out_p
        start = in_p - 1 if bits else in_p  # the byte holding the unread bits comes first
        chunks = _Chunks(
            read_at, self._comp_offset, self._comp_size, start, self._first_read(k, start, out_p, skip + n)
        )
        chunk = chunks.next()
        if not chunk:
            raise CorruptMemberError(inflate.TRUNCATED)
        prime = chunk[0] if bits else 0
        reader = native.ZranReader(window, bits, prime, skip, n)
        feed = memoryview(chunk)[1:] if bits else chunk
        try:
            while not reader.feed(feed):
                feed = chunks.next()
                if not feed:
                    raise CorruptMemberError(inflate.TRUNCATED)
        except native.DecodeError as exc:
            raise CorruptMemberError(str(exc)) from None
        return reader.result()

    def _decode_python(self, read_at: ReadAt, k: int, within: int, n: int) -> bytes:
        snapshot, start = self._starts[k]
        d = snapshot.copy()
        first = self._first_read(k, start, k * self.spacing, within + n)
        chunks = _Chunks(read_at, self._comp_offset, self._comp_size, start, first)
        skip, have, parts = within, 0, []
        feed = chunks.next()
        try:
            while skip or have < n:
                out = d.decompress(feed, min(skip, PY_STEP) if skip else n - have)
                feed = d.unconsumed_tail
                if skip:
                    skip -= len(out)
                else:
                    parts.append(out)
                    have += len(out)
                if d.eof and (skip or have < n):
                    raise CorruptMemberError(inflate.SIZE_MISMATCH)
                if not out and not feed:
                    feed = chunks.next()
                    if not feed:
                        raise CorruptMemberError(inflate.TRUNCATED)
        except zlib.error:
            raise CorruptMemberError(inflate.BAD_DATA) from None
        return b"".join(parts)


def _build_native(
    native: Any,
    read_at: ReadAt,
    comp_offset: int,
    comp_size: int,
    size: int,
    crc: int,
    spacing: int,
    progress: Progress | None,
) -> dict[str, Any]:
    """zran pass in C: the GIL is released while each chunk inflates."""
    builder = native.ZranBuilder(size, spacing)
    pos = 0
    try:
        while pos < comp_size:
            n = min(BUILD_CHUNK, comp_size - pos)
            builder.feed(_read(read_at, comp_offset + pos, n))
            pos += n
            if progress is not None:
                progress(n)
        got, points, point_of, ends = builder.finish()
    except native.DecodeError as exc:
        raise CorruptMemberError(str(exc)) from None
    inflate.check_crc(got, crc)
    nbytes = sum(sys.getsizeof(p[3]) + POINT_OVERHEAD for p in points) + len(ends) * INTERVAL_OVERHEAD
    return {"ends": ends, "starts": point_of, "points": points, "nbytes": nbytes}


def _build_python(
    read_at: ReadAt,
    comp_offset: int,
    comp_size: int,
    size: int,
    crc: int,
    spacing: int,
    progress: Progress | None,
) -> dict[str, Any]:
    """Fallback pass: stop zlib exactly at each interval start and snapshot it with copy()."""
    d = zlib.decompressobj(-15)
    n_intervals = -(-size // spacing)
    starts: list[tuple[Any, int]] = [(d.copy(), 0)] if n_intervals else []
    ends: list[int] = []
    nbytes = len(starts) * SNAPSHOT_BYTES
    out_pos = got = pos = 0
    try:
        while pos < comp_size:
            n = min(BUILD_CHUNK, comp_size - pos)
            chunk = memoryview(_read(read_at, comp_offset + pos, n))
            for s in range(0, n, PY_SLICE):
                if d.eof:
                    raise CorruptMemberError(inflate.TRAILING_DATA)
                feed = chunk[s : s + PY_SLICE]
                base, fed = pos + s, len(feed)
                while True:
                    stop = min((out_pos // spacing + 1) * spacing, size)
                    out = d.decompress(feed, stop - out_pos if stop > out_pos else 1)
                    feed = d.unconsumed_tail
                    if out_pos + len(out) > size:
                        raise CorruptMemberError(inflate.SIZE_MISMATCH)
                    got = zlib.crc32(out, got)
                    out_pos += len(out)
                    while len(ends) < n_intervals and out_pos >= min((len(ends) + 1) * spacing, size):
                        in_pos = base + fed - len(feed)
                        ends.append(in_pos)
                        if len(ends) < n_intervals:  # the next interval starts here
                            starts.append((d.copy(), in_pos))
                            nbytes += SNAPSHOT_BYTES + sys.getsizeof(feed)
                    if d.eof:
                        if d.unused_data:
                            raise CorruptMemberError(inflate.TRAILING_DATA)
                        break
                    if not out and not feed:
                        break
            pos += n
            if progress is not None:
                progress(n)
    except zlib.error:
        raise CorruptMemberError(inflate.BAD_DATA) from None
    if not d.eof:
        raise CorruptMemberError(inflate.TRUNCATED)
    if out_pos != size:
        raise CorruptMemberError(inflate.SIZE_MISMATCH)
    inflate.check_crc(got, crc)
    nbytes += len(ends) * INTERVAL_OVERHEAD
    return {"ends": ends, "starts": starts, "points": None, "nbytes": nbytes}
