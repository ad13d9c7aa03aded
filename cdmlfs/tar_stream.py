"""A tar read as one forward stream: standard input, or a gzip, bzip2, xz or zstd compressed tar.

What ``cdmlfs pack`` converts without a random-access index (a .tar.gz cannot be entered anywhere
but at its start). The data path: the raw bytes, a strict decompressor (:class:`_Decompressed`,
or zstd's with :class:`~cdmlfs.zstd_seekable.FrameBoundary` following its frames), a read-ahead
thread (:class:`_ReadAhead`: decompression runs beside the caller), a forward view
(:class:`_ForwardView`) that the mount's own tar parser (:class:`~cdmlfs.formats.tar.TarRecords`)
reads, and :func:`members`, which checks what a parser that lists leniently lets through: a tar
cut short anywhere, a stream that fails its check, a lone zero block before more members.
"""

from __future__ import annotations

import bz2
import contextlib
import logging
import lzma
import os
import queue
import select
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import zstandard

from cdmlfs import pathrules
from cdmlfs.errors import ArchiveFormatError, UsageError
from cdmlfs.formats import PACKABLE, compressed_kind
from cdmlfs.formats import tarheader as th
from cdmlfs.formats.tar import TarRecords
from cdmlfs.formats.tarmembers import HARDLINK
from cdmlfs.index import DIR, FILE
from cdmlfs.zstd_seekable import FrameBoundary, looks_like_zstd

log = logging.getLogger(__name__)

STREAM_CHUNK = 1 << 20  # compressed bytes per read, and decompressed bytes per decompress call
# An xz header may declare a dictionary of up to 4 GiB, which the decoder then fills: xz -9 needs
# 64 MiB.
XZ_MEMLIMIT = 256 << 20
# zstd's decoder refuses windows over 128 MiB by default: a tar.zst written with `zstd --long`
# (even a 7 MB one, through a pipe) failed to pack with libzstd's "Frame requires too much
# memory". Converting such archives is what pack is for (the mount refuses them and says to
# pack), so one pass may use the window the stream declares, as `zstd -d --long=31` would.
ZSTD_WINDOW_MAX = 1 << 31
# What a damaged or truncated stream raises (gzip's and bz2's errors are OSErrors or EOFErrors).
STREAM_ERRORS = (EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError, OSError)


class UnterminatedTar(ArchiveFormatError):
    """The tar stream ends without its end-of-archive blocks, or a lone zero block ends it before more
    data: whole as far as it goes, but most likely cut. A lister reads what is there; a copy refuses
    (pack falls back to the archive path for a file that has one). ``reason``: what was seen, without
    the advice."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class Member(NamedTuple):
    """One member of a tar stream; ``read`` yields a file's bytes (holes of a sparse one as zeros)."""

    path: str  # after the mount's path rule
    kind: int  # FILE, DIR, SYMLINK or HARDLINK
    mode: int  # permission bits only
    mtime: float
    size: int = 0
    link: str = ""
    read: Callable[[], Iterator[bytes]] | None = None


def zeros(n: int) -> Iterator[bytes]:
    """``n`` zero bytes, a chunk at a time."""
    while n > 0:
        k = min(STREAM_CHUNK, n)
        yield bytes(k)
        n -= k


class _Decompressed:
    """The decompressed bytes of a gzip, bzip2 or xz file (every stream of a concatenation), read
    forward, each stream's own check verified by the decompressor as it ends.

    Strict where the standard library's file readers are lenient: they take a damaged later stream
    for trailing garbage and stop quietly, which packed half an archive with success. Here only
    zero bytes (xz stream padding, dd blocks) may follow a stream that is not another stream. Every
    call makes at most ``n`` bytes, so a bomb costs no memory.
    """

    def __init__(self, raw, kind: str) -> None:
        self._raw = raw
        self._new = {
            "gzip": lambda: zlib.decompressobj(31),  # 31: gzip wrapper, CRC-32 and length checked
            "bzip2": bz2.BZ2Decompressor,
            "xz": lambda: lzma.LZMADecompressor(lzma.FORMAT_XZ, memlimit=XZ_MEMLIMIT),
        }[kind]
        self._zlib = kind == "gzip"
        self._dec = None
        self._input = b""
        self._streams = 0
        self._ended = False

    def _more_input(self) -> bytes:
        data = self._raw.read(STREAM_CHUNK)
        if not data and self._dec is not None:
            raise EOFError("the compressed stream ends before its end marker: a truncated file?")
        return data

    def _start(self) -> bool:
        """Begin the next stream, after the zero padding; False at the end of the input."""
        while True:
            if not self._input:
                self._input = self._raw.read(STREAM_CHUNK)
                if not self._input:
                    return False
            if self._streams:
                self._input = self._input.lstrip(b"\0")
                if not self._input:
                    continue
            self._dec = self._new()
            self._streams += 1
            return True

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes; fewer only at the end of the input."""
        out: list[bytes] = []
        got = 0
        while got < n and not self._ended:
            if self._dec is None and not self._start():
                self._ended = True
                break
            d = self._dec
            if self._zlib:
                if not self._input:
                    self._input = self._more_input()
                data = d.decompress(self._input, n - got)
                self._input = d.unused_data if d.eof else d.unconsumed_tail
            else:
                try:
                    if d.needs_input:
                        if not self._input:
                            self._input = self._more_input()
                        data, self._input = d.decompress(self._input, max_length=n - got), b""
                    else:
                        data = d.decompress(b"", max_length=n - got)
                except lzma.LZMAError as exc:
                    if "limit" not in str(exc).lower():
                        raise
                    raise lzma.LZMAError(
                        f"its dictionary needs more than {XZ_MEMLIMIT >> 20} MiB; decompress it with xz "
                        "and pipe the tar in: xz -dc FILE | cdmlfs pack - OUT"
                    ) from None
            if d.eof:
                if not self._zlib:
                    self._input = d.unused_data
                self._dec = None
            if data:
                out.append(data)
                got += len(data)
        return b"".join(out)


class _CheckedZstd:
    """A zstd stream's compressed bytes, followed frame by frame as they are read (FrameBoundary),
    so that an input cut short inside a frame is an error and not an early end of the tar."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self.frames = FrameBoundary()
        self.exhausted = False  # the input's end was read

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        self.exhausted = self.exhausted or not data
        self.frames.feed(data)
        return data


class _ReadAhead:
    """Reads a stream on a thread of its own, a few chunks ahead of its reader.

    Why: decompression (zlib, bz2, lzma and zstd all release the GIL) then runs on one core while
    the tar is parsed, checksummed and handed to the compressors on the other, instead of before
    them. At most ``DEPTH`` chunks wait; what the stream raises is raised to the reader, in order.
    """

    DEPTH = 4

    def __init__(self, stream) -> None:
        self._stream = stream
        self._queue: queue.Queue = queue.Queue(maxsize=self.DEPTH)
        self._stop = threading.Event()
        self._chunk = b""
        self._off = 0
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="cdmlfs-pack-read", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                data = self._stream.read(STREAM_CHUNK)
                self._put(data)
                if not data:
                    return
        except BaseException as exc:  # handed to the reader, raised there
            self._put(exc)

    def _put(self, item: bytes | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def read(self, n: int = -1) -> bytes:
        out: list[bytes] = []
        got = 0
        while (n < 0 or got < n) and not self._ended:
            if self._off >= len(self._chunk):
                item = self._queue.get()
                if isinstance(item, BaseException):
                    self._ended = True
                    raise item
                if not item:
                    self._ended = True
                    break
                self._chunk, self._off = item, 0
            take = len(self._chunk) - self._off if n < 0 else min(n - got, len(self._chunk) - self._off)
            out.append(self._chunk[self._off : self._off + take])
            self._off += take
            got += take
        return b"".join(out) if len(out) != 1 else out[0]

    def close(self) -> None:
        """Stop the thread (it may be between reads: its chunk is dropped)."""
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join(timeout=0.5)  # a read blocked on a stalled pipe: the daemon thread ends with us


class _ForwardView:
    """``read(pos, n)`` over a forward-only stream, as the tar scanner reads: positions never go
    back before the last one asked for, and what is skipped is read and dropped."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._at = 0  # stream position of _buf[0]
        self._buf = b""
        self.ended_short: int | None = None  # where the stream ended before a position asked for

    def read(self, pos: int, n: int) -> bytes:
        if pos < self._at:
            raise AssertionError(f"tar stream read at {pos}, behind {self._at}")  # a bug of ours
        skip = pos - self._at
        if skip >= len(self._buf):
            skip -= len(self._buf)
            self._buf = b""
            while skip:
                dropped = self._stream.read(min(skip, STREAM_CHUNK))
                if not dropped:
                    break
                skip -= len(dropped)
            self._at = pos - skip  # short of pos only at the stream's end
            if skip and self.ended_short is None:
                self.ended_short = self._at
        else:
            self._buf = self._buf[skip:]
            self._at = pos
        if len(self._buf) < n:
            parts = [self._buf]
            have = len(self._buf)
            while have < n and (more := self._stream.read(max(n - have, 64 << 10))):
                parts.append(more)
                have += len(more)
            self._buf = b"".join(parts)
        return self._buf[:n] if pos == self._at else b""

    def drain(self) -> None:
        """Read on to the stream's end (where a decompressor checks the last stream)."""
        self._buf = b""
        while self._stream.read(STREAM_CHUNK):
            pass


class Pipe:
    """A forward-only input (standard input) whose first bytes are read ahead to tell what it holds."""

    HEAD = th.BLOCK

    def __init__(self, fd: int, name: str = "standard input") -> None:
        self.name = name
        # The descriptor itself, not sys.stdin.buffer: a read blocked on a stalled pipe in the
        # read-ahead thread held that buffer's lock, and Python aborted at exit when a failed or
        # interrupted pack left it there (rc 134 instead of 1 or 143).
        self._fd = fd
        head = b""
        while len(head) < self.HEAD and (more := self._read_fd(self.HEAD - len(head))):
            head += more
        self.head = self._pending = head
        self._pos = 0

    def _read_fd(self, n: int) -> bytes:
        while True:
            try:
                return os.read(self._fd, n)
            except BlockingIOError:  # a parent left the pipe non-blocking: wait for data as a read would
                select.select([self._fd], [], [])

    def read(self, n: int = -1) -> bytes:
        """``n`` bytes (all with -1), fewer only at the end: a pipe hands out 64 KiB at a time, and
        reading ahead in such crumbs cost the read-ahead its depth."""
        if self._pending:
            data = self._pending if n < 0 else self._pending[:n]
            self._pending = self._pending[len(data) :]
        else:
            parts = []
            got = 0
            while (n < 0 or got < n) and (more := self._read_fd(STREAM_CHUNK if n < 0 else n - got)):
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        self._pos += len(data)
        return data

    def tell(self) -> int:
        """Bytes handed out so far (progress)."""
        return self._pos

    def kind(self) -> str:
        """What the stream is: a compressor's name, or "tar"; UsageError for what cannot stream."""
        if not self.head:
            raise UsageError(f"{self.name} is empty: pipe a tar (or .tar.gz, .tar.zst, ...) into it")
        if th.looks_like_tar(self.head):  # first, as for files: a tar member may be named "BZh..."
            return "tar"
        if self.head.startswith(b"PK\x03\x04"):
            raise UsageError("a ZIP cannot be read from a pipe (its directory is at its end): give its path")
        if looks_like_zstd(self.head):  # a zstd frame, or a skippable one first (pzstd writes one)
            return "zstd"
        kind = compressed_kind(self.head)
        if kind is not None and kind not in PACKABLE:
            raise UsageError(f"{self.name} is {kind}-compressed: decompress it into the pipe first")
        return kind or "tar"


def stream_kind(head: bytes) -> str | None:
    """'gzip', 'bzip2' or 'xz' when a file starting with ``head`` is a tar compressed that way
    (which cdmlfs cannot mount, so pack reads it as a stream); None for anything else."""
    if th.looks_like_tar(head):  # a plain tar whose first member is named "BZh..." is a tar
        return None
    kind = compressed_kind(head)
    return kind if kind in PACKABLE else None


def members(raw, where: str, kind: str) -> Iterator[Member]:
    """Members of the tar in ``raw`` (``kind``: a compressor, or "tar"), in its own order, as read.

    One forward pass with the mount's own tar parser (:class:`cdmlfs.formats.tar.TarRecords`), so
    names, types, pax and sparse members follow the same rules as a mount of the .tar; a file's
    ``read`` must be used up before the next member is asked for (as pack's ``write_tar`` does). Names
    follow the mount's path rule; the last of duplicate names wins, as for the mount and for
    ``tar -x``. Damage raises ArchiveFormatError naming ``where``: a bad header, a stream that
    fails its check or ends early, a member the tar ends inside. The rest of the stream is read
    after the last member, so its checksum has been verified once the last member is out.
    """
    what = "tar" if kind == "tar" else f"{kind}-compressed tar"

    def failed(exc: BaseException) -> ArchiveFormatError:
        detail = str(exc) or type(exc).__name__
        return ArchiveFormatError(f"{where}: cannot read this {what} ({detail})")

    def named(exc: ArchiveFormatError) -> ArchiveFormatError:
        """``exc`` naming the stream; for a zstd input cut inside a frame, that cut (the tar parser
        and a member's read see only its effect)."""
        why = str(exc)
        if checked is not None and checked.exhausted and not checked.frames.at_boundary:
            why = "the zstd stream ends inside a frame (a truncated copy?)"
        return ArchiveFormatError(why if why.startswith(where) else f"{where}: {why}")

    checked = None
    if kind == "zstd":
        checked = _CheckedZstd(raw)
        dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_WINDOW_MAX)
        stream = dctx.stream_reader(checked, read_across_frames=True, closefd=False)
    elif kind == "tar":
        stream = raw
    else:
        stream = _Decompressed(raw, kind)
    ahead = _ReadAhead(stream)
    view = _ForwardView(ahead)

    def member_bytes(name: str, offset: int, size: int, sparse) -> Callable[[], Iterator[bytes]]:
        # (position in the real file, stored bytes) runs: one for a plain file, a sparse one's data
        # segments with the holes between them (zeros) otherwise.
        runs = [(0, size)] if sparse is None else list(zip(sparse[0::2], sparse[1::2]))

        def read() -> Iterator[bytes]:
            at, real = offset, 0
            try:
                for start, length in runs:
                    yield from zeros(start - real)
                    end = at + length
                    while at < end:
                        data = view.read(at, min(STREAM_CHUNK, end - at))
                        if not data:
                            raise ArchiveFormatError(
                                f"{where}: the tar ends inside {name!r} (a truncated copy?)"
                            )
                        at += len(data)
                        yield data
                    real = start + length
                yield from zeros(size - real)
            except ArchiveFormatError as exc:  # zstd framing, seen while reading ahead
                raise named(exc) from None
            except STREAM_ERRORS as exc:
                raise failed(exc) from None

        return read

    records = TarRecords(view)
    # Names a hard link may name so far: files, symlinks and hard links to them (the index's rule).
    linkable: set[str] = set()
    try:
        for member_kind, name, mode, mtime, size, offset, link, sparse in records:
            path = pathrules.normalize(name, backslash_is_separator=False)
            if not path:  # "./", what `tar -C DIR -c .` writes first, is the root: nothing to add
                if member_kind != DIR:
                    log.warning("%s: %r names the archive's root; skipped", where, name)
                continue
            mode &= 0o777  # never setuid, setgid or sticky (as the mount shows them)
            if member_kind == HARDLINK:
                target = pathrules.normalize(link, backslash_is_separator=False)
                if target not in linkable:  # the mount's rule (cdmlfs.formats.tar): tar -x would fail on it
                    log.warning(
                        "%s: skipping hard link %r: target %r is not a file seen before it", where, name, link
                    )
                    linkable.discard(path)
                    continue
                linkable.add(path)
                yield Member(path, HARDLINK, mode, mtime, link=target)
                continue
            if member_kind == DIR:
                linkable.discard(path)
            else:  # FILE, SYMLINK
                linkable.add(path)
            if member_kind == FILE:
                yield Member(path, FILE, mode, mtime, size, read=member_bytes(name, offset, size, sparse))
            else:  # DIR, SYMLINK
                yield Member(path, member_kind, mode, mtime, link=link)
        # A mount lists what came before a cut; a copy must not lose the rest without a word.
        if records.damaged is not None:
            pos, why = records.damaged
            raise ArchiveFormatError(f"corrupt tar header at byte {pos:,} of the tar stream: {why}")
        if records.cut is not None:
            raise ArchiveFormatError(
                f"the tar ends inside a header at byte {records.cut:,} (a truncated copy?)"
            )
        if view.ended_short is not None:
            raise ArchiveFormatError(
                f"the tar ends at byte {view.ended_short:,}, inside a member's data (a truncated copy?)"
            )
        view.drain()
        if checked is not None and not checked.frames.at_boundary:
            raise ArchiveFormatError("the zstd stream ends inside a frame (a truncated copy?)")
        if not records.marked:
            # Every tar writer ends with zero blocks; without them the stream was most likely cut at a
            # member boundary (cdmlfs pack's frames end on one). tar -x and a mount read such a tar.
            reason = f"the tar stops at byte {records.end:,} without its end-of-archive blocks"
            raise UnterminatedTar(
                f"{where}: {reason} (a truncated copy?); to keep what is there, save it as a .tar file "
                "and pack or mount that",
                f"{where}: {reason}",
            )
        if records.lone_zero is not None:  # more tar data follows: a zeroed header, most likely
            reason = f"a lone zero block at byte {records.lone_zero:,} ends the tar before more data"
            raise UnterminatedTar(
                f"{where}: {reason} (a damaged header?); tar -x stops there too: save it as a .tar file "
                "to pack what is before it",
                f"{where}: {reason}",
            )
    except UnterminatedTar:
        raise
    except ArchiveFormatError as exc:
        raise named(exc) from None
    except STREAM_ERRORS as exc:
        raise failed(exc) from None
    finally:
        ahead.close()
        with contextlib.suppress(*STREAM_ERRORS):
            if kind == "zstd":
                stream.close()
