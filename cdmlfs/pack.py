"""``cdmlfs pack``: write archives that mount fast — seekable tar.zst, plain tar, or ZIP.

The tar.zst layout (readable by ``zstd -d`` and ``tar --zstd -x``; they skip
what they do not know):

* a standard tar stream (POSIX ustar headers; pax records only where ustar
  cannot say it: long or non-ASCII names and link targets, sizes ≥ 8 GiB,
  mtimes outside 1970..2242, large ids), cut into zstd frames of at most
  ``frame_size`` decoded bytes. A frame ends at a member boundary when the
  next member would not fit, so a small member is always inside one frame
  (reading it costs one frame decode); a member larger than a frame is split
  over consecutive full frames. Every frame records its content size and a
  checksum;
* a skippable frame holding the member table (:mod:`cdmlfs.formats.tarmembers`),
  so mounting needs no decoding at all;
* the seek table of the zstd seekable format, listing every frame above
  (the member-table frame with decoded size 0, as the format specifies for
  skippable frames).

Frames are compressed by a thread pool (zstandard releases the GIL); the
writer keeps at most ``2 × threads`` frames in flight, so memory stays bounded
whatever the input size. The output is written to a temporary name and renamed
into place when complete.

Sources: a directory (walked in name order; hard links detected by inode;
sockets, devices and FIFOs skipped with a warning), any archive cdmlfs
opens (ZIP, tar, tar.zst; members are read in archive order, so a
single-frame tar.zst is decoded exactly once), a gzip, bzip2 or xz
compressed tar (.tar.gz, .tgz, .tar.bz2, .tar.xz; a local path or an S3 URI),
or ``-``: a tar stream on standard input (plain, gzip, bzip2, xz or zstd).
Streams are converted in one pass with nothing extracted to disk, read by the
mount's own tar parser (same names, types and rules as a mount of the .tar);
every compressed stream of the file is checked (read to its end for that), and
anything but zero padding after one must be another sound stream. ZIP output
has no hard links: they become copies; a stream converts to .tar.zst or .tar
only (its hard links would need their target's bytes a second time). Mtimes are
stored in whole seconds; ZIP can only hold 1980..2107 (exactly: 1901..2038),
later or earlier ones are clamped.
"""

from __future__ import annotations

import bz2
import contextlib
import errno
import logging
import lzma
import math
import os
import queue
import stat as statmod
import struct
import sys
import threading
import time
import zipfile
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import zstandard

from cdmlfs import inflate, pathrules
from cdmlfs.errors import ArchiveFormatError, UsageError
from cdmlfs.formats import PACKABLE, compressed_kind
from cdmlfs.formats import tarheader as th
from cdmlfs.formats.tar import EMBEDDED_INDEX_NIBBLE, encode_embedded_index
from cdmlfs.formats.tarmembers import HARDLINK, MemberTable
from cdmlfs.index import DIR, FILE, SYMLINK
from cdmlfs.safe_write import is_under
from cdmlfs.sources.base import Source, SourceRange
from cdmlfs.zstd_seekable import FrameBoundary, looks_like_zstd, seek_table_frame, skippable_frame

log = logging.getLogger(__name__)

DEFAULT_FRAME_SIZE = 4 << 20
DEFAULT_ZSTD_LEVEL = 3
DEFAULT_DEFLATE_LEVEL = 6
READ_CHUNK = 1 << 20
MAX_FRAME_SIZE = 1 << 30  # the seek table stores 32-bit sizes; keep frames far below that
STORED_EXTENSIONS = frozenset(  # already compressed: deflating them again only costs time
    {
        *("jpg", "jpeg", "png", "gif", "webp", "avif", "heic", "heif", "jxl", "mp3", "m4a", "aac", "ogg"),
        *("opus", "flac", "mp4", "m4v", "mkv", "webm", "mov", "avi", "zip", "gz", "tgz", "bz2", "xz"),
        *("lz4", "zst", "tzst", "7z", "rar", "br", "parquet"),
    }
)

Progress = Callable[[int, int | None], None]  # (done, total); no total for a pipe


class PackEntry(NamedTuple):
    """One member to write. ``read`` yields a file's bytes (also used for hard links in ZIP output)."""

    name: str
    kind: int  # FILE, DIR, SYMLINK or HARDLINK
    mode: int
    mtime: float
    size: int = 0
    link: str = ""
    uid: int = 0
    gid: int = 0
    read: Callable[[], Iterator[bytes]] | None = None


# -- sources ------------------------------------------------------------------------------
def _zeros(n: int) -> Iterator[bytes]:
    while n > 0:
        k = min(READ_CHUNK, n)
        yield bytes(k)
        n -= k


class _FileChunks:
    """The bytes of a file listed with ``size`` and (device, inode) ``ident``: call it for them.

    Its header is already written when it is read, so a file that changed since
    it was listed keeps that size (zeros where it has no bytes), with a warning,
    and ``changed`` names it (the pack then exits 1, as GNU tar does). It is opened
    without following links and without blocking: a file replaced by a symlink
    would otherwise put the link target's bytes (any file on the machine) in the
    archive, and one replaced by a FIFO would hang the pack.

    A small object, not a closure: one is held per file until the pack ends (two closures
    and their cells were ~400 bytes a file, a third of what packing a million files held).
    """

    __slots__ = ("changed", "ident", "rel", "root", "size")

    def __init__(self, root: str, rel: str, size: int, ident: tuple[int, int], changed: list[str]) -> None:
        self.root = root  # shared by every file: the path is joined when the file is read
        self.rel = rel  # the member's name (held by its entry anyway)
        self.size = size
        self.ident = ident
        self.changed = changed

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.rel)

    def _lost(self, n: int, why: str, *args) -> Iterator[bytes]:
        """The member keeps its announced size: ``n`` zero bytes, warned about and counted."""
        log.warning(f"%s: {why}: packed as %d zero bytes", self.path, *args, n)
        self.changed.append(self.path)
        yield from _zeros(n)

    def __call__(self) -> Iterator[bytes]:
        path, size = self.path, self.size
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENXIO):  # EACCES, EMFILE...: an error
                raise
            # Removed, or replaced by a symlink (ELOOP) or a socket (ENXIO) since it was listed.
            yield from self._lost(size, "gone or replaced before it was read (%s)", exc.strerror)
            return
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not statmod.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != self.ident:
                yield from self._lost(size, "replaced by another file while packing")
                return
            left = size
            while left > 0:
                data = f.read(min(READ_CHUNK, left))
                if not data:
                    yield from self._lost(left, "shrank while being packed")
                    return
                left -= len(data)
                yield data
        # A file that grew keeps the size its header announced (like GNU tar).


def _sorted_entries(path: str) -> Iterator[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return iter(sorted(it, key=lambda e: e.name))
    except OSError as exc:
        raise UsageError(f"{path}: cannot list directory ({exc.strerror})") from None


def entries_from_directory(
    root: str, skip: str | None = None, changed: list[str] | None = None
) -> list[PackEntry]:
    """Everything under ``root`` (not root itself), names sorted, each directory followed by its
    whole subtree (GNU tar's order: ``tar -x`` sets a directory's mtime once it leaves it, so
    nothing written into it afterwards moves that mtime). ``skip``: a path not to pack (the output).
    ``changed`` collects the files that changed or vanished while packing (see ``_FileChunks``)."""
    changed = [] if changed is None else changed
    root = os.path.abspath(root)
    out: list[PackEntry] = []
    seen_inodes: dict[tuple[int, int], str] = {}
    skipped = 0
    stack = [("", _sorted_entries(root))]
    while stack:
        rel_dir, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        rel = f"{rel_dir}/{item.name}" if rel_dir else item.name
        if skip is not None and item.path == skip:
            continue
        try:
            st = item.stat(follow_symlinks=False)
        except FileNotFoundError:  # removed since the directory was listed: not packed
            log.warning("%s: removed before it was packed", item.path)
            changed.append(item.path)
            continue
        mode = st.st_mode
        common = {"mode": statmod.S_IMODE(mode), "mtime": st.st_mtime, "uid": st.st_uid, "gid": st.st_gid}
        if statmod.S_ISDIR(mode):
            out.append(PackEntry(rel, DIR, **common))
            stack.append((rel, _sorted_entries(item.path)))
        elif statmod.S_ISLNK(mode):
            out.append(PackEntry(rel, SYMLINK, link=os.readlink(item.path), **common))
        elif statmod.S_ISREG(mode):
            key = (st.st_dev, st.st_ino)
            first = seen_inodes.get(key) if st.st_nlink > 1 else None
            chunks = _FileChunks(root, rel, st.st_size, key, changed)
            if first is not None:
                out.append(PackEntry(rel, HARDLINK, size=st.st_size, link=first, read=chunks, **common))
            else:
                if st.st_nlink > 1:
                    seen_inodes[key] = rel
                out.append(PackEntry(rel, FILE, size=st.st_size, read=chunks, **common))
        else:
            skipped += 1
            log.warning("skipping %s: sockets, devices and FIFOs are not packed", item.path)
    if skipped:
        log.warning("skipped %d special files", skipped)
    return out


def entries_from_archive(archive) -> list[PackEntry]:
    """Members of an opened :class:`~cdmlfs.archive.Archive`: directories, files in archive order, links."""
    index = archive.index
    reader = archive.reader

    def member_chunks(eid: int, size: int) -> Callable[[], Iterator[bytes]]:
        def chunks() -> Iterator[bytes]:
            pos = 0
            while pos < size:
                data = reader.read(eid, pos, min(READ_CHUNK, size - pos))
                if not data:
                    raise OSError(5, f"{index.paths[eid]}: member ended early")
                pos += len(data)
                yield data

        return chunks

    out: list[PackEntry] = []
    links: list[PackEntry] = []
    # Hard links whose target's path now names another entry (a later duplicate replaced it, as
    # `tar -r` appends do): the first such link carries the data as a file, the others link to it.
    carried: dict[int, str] = {}
    carriers: list[PackEntry] = []
    for eid in index.walk(0):
        kind = index.kind[eid]
        path = index.paths[eid]
        if kind == DIR:
            out.append(PackEntry(path, DIR, index.mode[eid], index.mtime[eid]))
        elif kind == SYMLINK:
            links.append(
                PackEntry(path, SYMLINK, index.mode[eid], index.mtime[eid], link=reader.readlink(eid))
            )
        elif eid in index.hardlink_of:
            data = index.hardlink_of[eid]
            size = index.size[data]
            target = index.paths[data]
            if index.get(target) != data:
                if data not in carried:
                    carried[data] = path
                    mode, mtime, chunks = index.mode[eid], index.mtime[eid], member_chunks(data, size)
                    carriers.append(PackEntry(path, FILE, mode, mtime, size, read=chunks))
                    continue
                target = carried[data]
            links.append(
                PackEntry(
                    path,
                    HARDLINK,
                    index.mode[eid],
                    index.mtime[eid],
                    size,
                    link=target,
                    read=member_chunks(data, size),
                )
            )
    for eid in index.files_in_archive_order():
        size = index.size[eid]
        out.append(
            PackEntry(
                index.paths[eid], FILE, index.mode[eid], index.mtime[eid], size, read=member_chunks(eid, size)
            )
        )
    return out + carriers + links


STDIN = "-"  # pack's source name for a tar stream on standard input
STREAM_CHUNK = 1 << 20  # compressed bytes per read, and decompressed bytes per decompress call
STREAM_CACHE = 64 << 20  # blocks of a remote stream source (S3 reads ahead into it)
# An xz header may declare a dictionary of up to 4 GiB, which the decoder then fills: xz -9 needs
# 64 MiB. (zstd's decoder refuses windows over 128 MiB by default.)
XZ_MEMLIMIT = 256 << 20
# What a damaged or truncated stream raises (gzip's and bz2's errors are OSErrors or EOFErrors).
_STREAM_ERRORS = (EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError, OSError)


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
            raise EOFError("the compressed stream ends before its end marker (a truncated file?)")
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
        self._thread.join(timeout=2)  # a read blocked on a stalled pipe: the daemon thread ends with us


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


class _Pipe:
    """A forward-only input (standard input) whose first bytes are read ahead to tell what it holds;
    counts what it hands out, for progress."""

    HEAD = th.BLOCK

    def __init__(self, f) -> None:
        self._f = f
        head = b""
        while len(head) < self.HEAD and (more := f.read(self.HEAD - len(head))):
            head += more
        self.head = self._pending = head
        self.pos = 0

    def read(self, n: int = -1) -> bytes:
        if self._pending:
            data = self._pending if n < 0 else self._pending[:n]
            self._pending = self._pending[len(data) :]
        else:
            data = self._f.read(n)
        self.pos += len(data)
        return data

    def kind(self) -> str:
        """What the stream is: a compressor's name, or "tar"; UsageError for what cannot stream."""
        if not self.head:
            raise UsageError("standard input is empty: pipe a tar (or .tar.gz, .tar.zst, ...) into it")
        if th.looks_like_tar(self.head):  # first, as for files: a tar member may be named "BZh..."
            return "tar"
        if self.head.startswith(b"PK\x03\x04"):
            raise UsageError("a ZIP cannot be read from a pipe (its directory is at its end): give its path")
        if looks_like_zstd(self.head):  # a zstd frame, or a skippable one first (pzstd writes one)
            return "zstd"
        kind = compressed_kind(self.head)
        if kind is not None and kind not in PACKABLE:
            raise UsageError(f"standard input is {kind}-compressed: decompress it into the pipe first")
        return kind or "tar"


def stream_kind(head: bytes) -> str | None:
    """'gzip', 'bzip2' or 'xz' when a file starting with ``head`` is a tar compressed that way
    (which cdmlfs cannot mount, so pack reads it as a stream); None for anything else."""
    if th.looks_like_tar(head):  # a plain tar whose first member is named "BZh..." is a tar
        return None
    kind = compressed_kind(head)
    return kind if kind in PACKABLE else None


class StreamTally:
    """Counts the members and file bytes of entries as they go by (a stream has no list to count)."""

    def __init__(self) -> None:
        self.members = 0
        self.bytes = 0

    def count(self, entries: Iterable[PackEntry]) -> Iterator[PackEntry]:
        for entry in entries:
            self.members += 1
            if entry.kind == FILE:
                self.bytes += entry.size
            yield entry


def entries_from_tar_stream(raw, where: str, kind: str) -> Iterator[PackEntry]:
    """Members of the tar in ``raw`` (``kind``: a compressor, or "tar"), in its own order, as read.

    One forward pass with the mount's own tar parser (:class:`cdmlfs.formats.tar.TarRecords`), so
    names, types, pax and sparse members follow the same rules as a mount of the .tar; a file's
    ``read`` must be used up before the next entry is asked for (as ``write_tar`` does). Names
    follow the mount's path rule; the last of duplicate names wins, as for the mount and for
    ``tar -x``. Damage raises ArchiveFormatError naming ``where``: a bad header, a stream that
    fails its check or ends early, a member the tar ends inside. The rest of the stream is read
    after the last entry, so its checksum has been verified once the last entry is out.
    """
    from cdmlfs.formats.tar import TarRecords

    what = "tar" if kind == "tar" else f"{kind}-compressed tar"

    def failed(exc: BaseException) -> ArchiveFormatError:
        detail = str(exc) or type(exc).__name__
        return ArchiveFormatError(f"{where}: cannot read this {what} ({detail})")

    checked = None
    if kind == "zstd":
        checked = _CheckedZstd(raw)
        stream = zstandard.ZstdDecompressor().stream_reader(checked, read_across_frames=True, closefd=False)
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
                    yield from _zeros(start - real)
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
                yield from _zeros(size - real)
            except _STREAM_ERRORS as exc:
                raise failed(exc) from None

        return read

    records = TarRecords(view)
    try:
        for member_kind, name, mode, mtime, size, offset, link, sparse in records:
            path = pathrules.normalize(name, backslash_is_separator=False)
            if not path:  # "./", what `tar -C DIR -c .` writes first, is the root: nothing to add
                if member_kind != DIR:
                    log.warning("%s: %r names the archive's root; skipped", where, name)
                continue
            mode &= 0o777  # never setuid, setgid or sticky (as the mount shows them)
            if member_kind == FILE:
                yield PackEntry(path, FILE, mode, mtime, size, read=member_bytes(name, offset, size, sparse))
            elif member_kind == HARDLINK:
                target = pathrules.normalize(link, backslash_is_separator=False)
                yield PackEntry(path, HARDLINK, mode, mtime, link=target)
            else:  # DIR, SYMLINK
                yield PackEntry(path, member_kind, mode, mtime, link=link)
        # A mount lists what came before a cut; a copy must not lose the rest without a word.
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
            raise ArchiveFormatError(
                f"the tar stops at byte {records.end:,} without its end-of-archive blocks (a truncated "
                "copy?); to keep what is there, save it as a .tar file and pack or mount that"
            )
        if records.lone_zero is not None:  # more tar data follows: a zeroed header, most likely
            raise ArchiveFormatError(
                f"a lone zero block at byte {records.lone_zero:,} ends the tar before the data after it "
                "(a damaged header?); tar -x stops there too: save it as a .tar file to pack what is "
                "before it"
            )
    except ArchiveFormatError as exc:
        why = str(exc)
        if checked is not None and checked.exhausted and not checked.frames.at_boundary:
            why = "the zstd stream ends inside a frame (a truncated copy?)"  # the tar saw only its effect
        raise ArchiveFormatError(why if why.startswith(where) else f"{where}: {why}") from None
    except _STREAM_ERRORS as exc:
        raise failed(exc) from None
    finally:
        ahead.close()
        with contextlib.suppress(*_STREAM_ERRORS):
            if kind == "zstd":
                stream.close()


# -- tar stream ------------------------------------------------------------------------------
def _tar_header(entry: PackEntry) -> bytes:
    mtime = math.floor(entry.mtime)
    if entry.kind == DIR:
        return th.build_header(entry.name + "/", th.DIRTYPE, 0, entry.mode, mtime, entry.uid, entry.gid)
    if entry.kind == SYMLINK:
        return th.build_header(entry.name, th.SYMTYPE, 0, entry.mode, mtime, entry.uid, entry.gid, entry.link)
    if entry.kind == HARDLINK:
        return th.build_header(entry.name, th.LNKTYPE, 0, entry.mode, mtime, entry.uid, entry.gid, entry.link)
    return th.build_header(entry.name, th.REGTYPE, entry.size, entry.mode, mtime, entry.uid, entry.gid)


class _TarSink:
    """Where tar bytes go: ``write`` anything, ``member_start`` before a member that must not be split."""

    def write(self, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def member_start(self, total: int) -> None:
        """A member of ``total`` bytes (headers + padded data) follows."""

    def close(self, members: MemberTable) -> None:
        raise NotImplementedError


class _PlainTarSink(_TarSink):
    def __init__(self, f) -> None:
        self._f = f

    def write(self, data: bytes | memoryview) -> None:
        self._f.write(data)

    def close(self, members: MemberTable) -> None:
        pass


class _SeekableZstdSink(_TarSink):
    """Cuts the tar stream into frames, compresses them in parallel, writes them in order."""

    def __init__(self, f, level: int, frame_size: int, threads: int) -> None:
        self._f = f
        self._frame_size = frame_size
        self._buf = bytearray()
        self._entries: list[tuple[int, int]] = []  # (compressed, decompressed) per written frame
        self._level = level
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
        self._inflight: deque[tuple[Future | bytes, int]] = deque()
        self._max_inflight = 2 * threads

    def _compress(self, data: bytes | bytearray | memoryview) -> bytes:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = zstandard.ZstdCompressor(
                level=self._level, write_checksum=True, write_content_size=True
            )
        return cctx.compress(data)

    def _cut(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        job: Future | bytes = self._pool.submit(self._compress, data) if self._pool else self._compress(data)
        self._inflight.append((job, len(data)))
        while len(self._inflight) > self._max_inflight or (self._pool is None and self._inflight):
            self._drain_one()

    def _drain_one(self) -> None:
        job, dec = self._inflight.popleft()
        comp = job.result() if isinstance(job, Future) else job
        self._f.write(comp)
        self._entries.append((len(comp), dec))

    def member_start(self, total: int) -> None:
        if total <= self._frame_size and len(self._buf) + total > self._frame_size:
            self._cut_buffer()

    def _cut_buffer(self) -> None:
        """Hand the frame being gathered to the compressor as it is (never touched again: no copy)."""
        data, self._buf = self._buf, bytearray()
        self._cut(data)

    def write(self, data: bytes | memoryview) -> None:
        size = self._frame_size
        if len(self._buf) + len(data) < size:
            self._buf += data
            return
        view = memoryview(data)
        take = size - len(self._buf)
        self._buf += view[:take]
        self._cut_buffer()
        view = view[take:]
        while len(view) >= size:
            # Slices of immutable bytes go as they are; anything else may change under the compressor.
            self._cut(view[:size] if isinstance(data, bytes) else bytes(view[:size]))
            view = view[size:]
        self._buf += view

    def close(self, members: MemberTable) -> None:
        self._cut_buffer()
        while self._inflight:
            self._drain_one()
        if self._pool is not None:
            self._pool.shutdown()
        index_frame = skippable_frame(encode_embedded_index(members), EMBEDDED_INDEX_NIBBLE)
        self._f.write(index_frame)
        self._f.write(seek_table_frame([*self._entries, (len(index_frame), 0)]))

    def abort(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


def write_tar(
    entries: Iterable[PackEntry], sink: _TarSink, progress: Progress | None, total: int | None
) -> MemberTable:
    """The tar stream of ``entries`` into ``sink``; returns the member table (data offsets included)."""
    members = MemberTable()
    members.crcs = array("I")  # lets the reader check a member before the rest of its frame is decoded
    pos = 0
    done = 0
    last_report = 0.0
    for entry in entries:
        header = _tar_header(entry)
        data_size = entry.size if entry.kind == FILE else 0
        padded = th.round_up(data_size)
        sink.member_start(len(header) + padded)
        sink.write(header)
        pos += len(header)
        mtime = float(math.floor(entry.mtime))
        if entry.kind == DIR:
            members.append(DIR, entry.name + "/", entry.mode, mtime, 0, 0)
        elif entry.kind != FILE:
            members.append(entry.kind, entry.name, entry.mode, mtime, 0, 0, entry.link)
        data_at = pos
        crc = 0
        if data_size:
            written = 0
            for chunk in entry.read():  # type: ignore[misc]
                take = chunk if written + len(chunk) <= data_size else chunk[: data_size - written]
                sink.write(take)
                crc = inflate.crc32(take, crc)
                written += len(take)
                done += len(take)
                if written >= data_size:
                    break
                if progress is not None and time.monotonic() - last_report > 0.2:
                    progress(done, total)
                    last_report = time.monotonic()
            if padded > written:
                sink.write(bytes(padded - written))
                if data_size > written:  # a source that shrank: the member reads as zeros to its size
                    crc = inflate.crc32(bytes(data_size - written), crc)
            pos += padded
        if entry.kind == FILE:
            members.append(FILE, entry.name, entry.mode, mtime, data_size, data_at, crc=crc)
        if progress is not None and time.monotonic() - last_report > 0.2:
            progress(done, total)
            last_report = time.monotonic()
    sink.write(bytes(2 * th.BLOCK))  # end of archive
    pos += 2 * th.BLOCK
    members.stream_size = pos
    if progress is not None:
        progress(done, total)
    return members


# -- zip --------------------------------------------------------------------------------------
def _zip_info(entry: PackEntry, level: int) -> zipfile.ZipInfo:
    try:
        date_time = tuple(time.localtime(entry.mtime)[:6])
    except (OverflowError, OSError, ValueError):
        date_time = (1980, 1, 1, 0, 0, 0) if entry.mtime < 0 else (2107, 12, 31, 23, 59, 58)
    date_time = min(max(date_time, (1980, 1, 1, 0, 0, 0)), (2107, 12, 31, 23, 59, 58))  # DOS range
    name = entry.name + "/" if entry.kind == DIR else entry.name
    info = zipfile.ZipInfo(name, date_time=date_time)  # type: ignore[arg-type]
    info.create_system = 3  # Unix: external attributes carry st_mode
    type_bits = {DIR: statmod.S_IFDIR, SYMLINK: statmod.S_IFLNK}.get(entry.kind, statmod.S_IFREG)
    info.external_attr = ((type_bits | (entry.mode & 0o7777)) << 16) | (0x10 if entry.kind == DIR else 0)
    mtime = math.floor(entry.mtime)
    if -(2**31) <= mtime < 2**31:  # extended timestamp: exact mtime (unzip and cdmlfs read it)
        info.extra = struct.pack("<HHBi", 0x5455, 5, 1, mtime)
    ext = entry.name.rpartition(".")[2].lower() if "." in entry.name.rpartition("/")[2] else ""
    if entry.kind not in (FILE, HARDLINK) or ext in STORED_EXTENSIONS or entry.size == 0:
        info.compress_type = zipfile.ZIP_STORED
    else:
        info.compress_type = zipfile.ZIP_DEFLATED
        info._compresslevel = level  # type: ignore[attr-defined]  # read by ZipFile.open(info, "w")
    return info


def write_zip(entries: list[PackEntry], f, level: int, progress: Progress | None, total: int) -> None:
    for entry in entries:
        try:
            entry.name.encode("utf-8")
        except UnicodeEncodeError:
            # A Linux file name is any bytes; a ZIP name is UTF-8 (or cp437, which every reader would
            # show as other characters). tar keeps bytes as they are.
            shown = entry.name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise UsageError(
                f"{shown}: this name is not valid UTF-8 and a ZIP cannot store it as it is; "
                "rename it, or pack to .tar.zst"
            ) from None
        if "\\" in entry.name:  # ZIP readers (and cdmlfs) read it as a folder separator
            raise UsageError(
                f"{entry.name}: a backslash in a ZIP name reads back as a folder separator; "
                "rename it, or pack to .tar.zst"
            )
    done = 0
    last_report = 0.0
    with zipfile.ZipFile(f, "w", allowZip64=True) as zf:
        for entry in entries:
            info = _zip_info(entry, level)
            if entry.kind == DIR:
                zf.writestr(info, b"")
                continue
            if entry.kind == SYMLINK:
                zf.writestr(info, entry.link.encode("utf-8", "surrogateescape"))
                continue
            info.file_size = entry.size
            with zf.open(info, "w", force_zip64=entry.size >= (1 << 31)) as w:
                written = 0
                if entry.size:
                    for chunk in entry.read():  # type: ignore[misc]
                        take = chunk[: entry.size - written]
                        w.write(take)
                        written += len(take)
                        done += len(take)
                        if written >= entry.size:
                            break
                        if progress is not None and time.monotonic() - last_report > 0.2:
                            progress(done, total)
                            last_report = time.monotonic()
                if written < entry.size:
                    w.write(bytes(entry.size - written))
    if progress is not None:
        progress(done, total)


# -- command ------------------------------------------------------------------------------------
def output_kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith((".tar.zst", ".tzst", ".tar.zstd")):
        return "tar.zst"
    if lower.endswith(".tar"):
        return "tar"
    if lower.endswith(".zip"):
        return "zip"
    raise UsageError(f"{path}: output must end in .tar.zst, .tzst, .tar or .zip")


def _inside(src: str, out: str) -> str:
    """``out``'s path relative to the directory ``src`` when it lies inside it, else ''."""
    real_src = os.path.realpath(src)
    real_out = os.path.realpath(out)
    if real_out == real_src or not is_under(real_src, real_out):
        return ""
    return os.path.relpath(real_out, real_src)


def pack(
    src: str,
    out: str,
    level: int | None = None,
    frame_size: int = DEFAULT_FRAME_SIZE,
    threads: int | None = None,
    force: bool = False,
    progress: Progress | None = None,
    **archive_options,
) -> dict:
    """Write ``src`` (a directory, an archive, a compressed tar, or ``-``: a tar stream on standard
    input) to ``out``; returns a small summary for the CLI."""
    kind = output_kind(out)
    if not 4096 <= frame_size <= MAX_FRAME_SIZE:
        raise UsageError("--frame-size must be between 4K and 1G")
    if kind == "tar" and level is not None:
        raise UsageError("--level applies to .tar.zst and .zip outputs; a .tar is not compressed")
    low, high = (-1, 9) if kind == "zip" else (-(1 << 17), 22)  # deflate; zstd (negative: fast modes)
    if level is not None and not low <= level <= high:
        raise UsageError(f"--level must be between {low} and {high} for {kind} output")
    if os.path.lexists(out) and not force:
        raise UsageError(f"{out}: already exists (use --force to overwrite)")
    if os.path.isdir(out) and not os.path.islink(out):
        raise UsageError(f"{out}: is a directory")
    pipe = source = None
    stream: str | None = None
    try:
        if src == STDIN:
            if sys.stdin is None:
                raise UsageError("'-' reads a tar from standard input, which is closed: pipe one in")
            if sys.stdin.isatty():
                raise UsageError("'-' reads a tar from standard input, which is a terminal: pipe one in")
            pipe = _Pipe(sys.stdin.buffer)
            stream = pipe.kind()
            where = "standard input"
        else:
            remote = "://" in src  # an archive URI (s3://...): opened like any archive
            if not remote and not os.path.exists(src):
                raise UsageError(f"{src}: no such file or directory")
            if not remote and os.path.exists(out) and os.path.samefile(src, out):
                raise UsageError("the output would overwrite the source")
            if remote or not os.path.isdir(src):
                source, stream = _open_if_stream(src, archive_options)
            where = src
        if stream is not None and kind == "zip":
            raise UsageError(
                f"{where}: a tar read as a stream converts in one pass to .tar.zst or .tar only "
                "(its hard links would need bytes read before); pack the .tar.zst into a .zip from there"
            )
        return _pack(
            src, out, kind, level=level, frame_size=frame_size, threads=threads, progress=progress,
            archive_options=archive_options, pipe=pipe, source=source, stream=stream, where=where,
        )  # fmt: skip
    finally:
        if source is not None:
            source.close()


def _open_if_stream(src: str, options: dict) -> tuple[Source | None, str | None]:
    """(the opened source, its compressor) when ``src`` (a path or URI) is a gzip, bzip2 or xz
    compressed tar, which pack reads as one stream; (None, None) for anything else."""
    from cdmlfs.cache import ExtentCache
    from cdmlfs.sources import open_source

    source = open_source(src, cache=ExtentCache(STREAM_CACHE), **options)
    try:
        kind = stream_kind(source.read_at(0, min(th.BLOCK, source.size)))
    except BaseException:
        source.close()
        raise
    if kind is None:
        source.close()
        return None, None
    return source, kind


def _pack(
    src: str,
    out: str,
    kind: str,
    *,
    level: int | None,
    frame_size: int,
    threads: int | None,
    progress: Progress | None,
    archive_options: dict,
    pipe: _Pipe | None,
    source: Source | None,
    stream: str | None,
    where: str,
) -> dict:
    """pack() once its arguments are checked: ``stream`` names the compressor (or "tar") of a
    source read as one stream, ``pipe`` (standard input) or ``source`` (a file or object)."""
    threads = max(1, threads or os.cpu_count() or 1)
    archive = None
    tally = None
    changed: list[str] = []
    try:
        entries: Iterable[PackEntry]
        if stream is not None:
            # One pass, no list: progress goes by (compressed) bytes read, counts are taken on the way.
            if pipe is not None:
                raw, total, at = pipe, None, lambda: pipe.pos
            else:
                read_to = [0]
                raw = SourceRange(source, 0, source.size, on_read=lambda pos: read_to.__setitem__(0, pos))
                total, at = source.size, lambda: read_to[0]
            tally = StreamTally()
            entries = tally.count(entries_from_tar_stream(raw, where, stream))
            if progress is not None:
                report = progress
                progress = lambda done, _total: report(at(), total)  # noqa: E731
        elif os.path.isdir(src):
            # An output inside the directory (overwritten with --force) is not packed into itself.
            skip = os.path.join(os.path.abspath(src), _inside(src, out))
            entries = listed = entries_from_directory(src, skip=skip, changed=changed)
            total = sum(e.size for e in listed if e.kind == FILE)
        else:
            from cdmlfs.archive import Archive

            archive = Archive(src, cache_size=256 << 20, **archive_options)
            entries = listed = entries_from_archive(archive)
            total = sum(e.size for e in listed if e.kind == FILE)
        directory = os.path.dirname(os.path.abspath(out))
        tmp = os.path.join(directory, f".{os.path.basename(out)}.partial-{os.getpid()}")
        started = time.monotonic()
        try:
            try:
                f = open(tmp, "wb")  # noqa: SIM115 - closed by the with below
            except OSError as exc:  # name what the user asked for, not our temporary file
                raise UsageError(f"{out}: cannot write it ({exc.strerror})") from None
            with f:
                if kind == "zip":
                    write_zip(entries, f, DEFAULT_DEFLATE_LEVEL if level is None else level, progress, total)
                    frames = 0
                else:
                    if kind == "tar":
                        sink: _TarSink = _PlainTarSink(f)
                    else:
                        sink = _SeekableZstdSink(
                            f, DEFAULT_ZSTD_LEVEL if level is None else level, frame_size, threads
                        )
                    try:
                        members = write_tar(entries, sink, progress, total)
                        sink.close(members)
                    except BaseException:
                        if isinstance(sink, _SeekableZstdSink):
                            sink.abort()
                        raise
                    frames = len(getattr(sink, "_entries", ()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    finally:
        if archive is not None:
            archive.close()
    return {
        "members": tally.members if tally is not None else len(listed),
        "bytes": tally.bytes if tally is not None else total,
        "output_bytes": os.path.getsize(out),
        "frames": frames,
        "seconds": time.monotonic() - started,
        "changed": len(changed),  # files that changed or vanished while packing (warned about)
    }
