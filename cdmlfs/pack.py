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
opens (ZIP, tar, packed tar.zst; members are read in archive order), a
compressed tar read as a stream (.tar.gz, .tgz, .tar.bz2, .tar.xz, and a
tar.zst without a seek table, as ``tar --zstd`` or pzstd write; a local path or
an S3 URI), or ``-``: a tar stream on standard input (plain, gzip, bzip2, xz or
zstd).
Streams are converted in one pass with nothing extracted to disk, read by the
mount's own tar parser (same names, types and rules as a mount of the .tar);
every compressed stream of the file is checked (read to its end for that), and
anything but zero padding after one must be another sound stream. ZIP output
has no hard links: they become copies; a stream converts to .tar.zst or .tar
only (its hard links would need their target's bytes a second time). Mtimes are
stored in whole seconds; a ZIP holds them exactly from 1970 to 2106 (an unsigned
extended timestamp beside the DOS date), others in the DOS date only, clamped to
1980..2107.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import re
import secrets
import stat as statmod
import struct
import sys
import threading
import time
import zipfile
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, NamedTuple

import zstandard

from cdmlfs import inflate, tar_stream
from cdmlfs.decoders import MAX_WINDOW
from cdmlfs.errors import ArchiveFormatError, CdmlfsError, UsageError
from cdmlfs.formats import tarheader as th
from cdmlfs.formats.tar import EMBEDDED_INDEX_NIBBLE, decode_embedded_index, encode_embedded_index
from cdmlfs.formats.tarmembers import HARDLINK, MemberTable
from cdmlfs.index import DIR, FILE, SYMLINK
from cdmlfs.safe_write import is_under
from cdmlfs.sources.base import Source, SourceRange
from cdmlfs.zstd_seekable import (
    MAX_SEEK_TABLE_FRAMES,
    looks_like_zstd,
    read_seek_table,
    seek_table_frame,
    skippable_frame,
)

log = logging.getLogger(__name__)

DEFAULT_FRAME_SIZE = 4 << 20
DEFAULT_ZSTD_LEVEL = 3
DEFAULT_DEFLATE_LEVEL = 6
READ_CHUNK = 1 << 20
# A mount decodes at most 64 MiB in one piece (cdmlfs.reader.WHOLE_MEMBER_MAX, with a cache of 256 MiB
# or more): a larger frame would be served in pieces, each random read decoding from the frame's start,
# and its checksum checked only at its end.
MAX_FRAME_SIZE = 64 << 20
# Frames being compressed or waiting to be written hold their bytes twice (input and output):
# their number is capped so that they stay within this, whatever --threads says (64 threads of
# 64 MiB frames held 8 GiB).
INFLIGHT_BUDGET = 1 << 30
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
    # A hard link to a symlink: that symlink's target (a ZIP, which has no hard links, gets a copy
    # of the symlink; a tar gets the hard link, as `tar -c` writes it).
    target_link: str = ""


# -- sources ------------------------------------------------------------------------------
class _FileChunks:
    """The bytes of a file listed with ``size`` and (device, inode) ``ident``: call it for them.

    Just before its header is written, :meth:`restat` takes the file as it is then
    (:func:`_as_they_are_now`): a file removed since the listing is left out, one
    replaced is packed as the new file, and a pack that takes hours does not pack
    files as they were when it started. Its header is written when it is read, so
    a file that changes after that keeps that size (zeros where it has no bytes; a
    file that grew is cut there), with a warning, and ``changed`` names it (the pack
    then exits 1, as GNU tar does); so does one whose ctime moved while it was read. It is opened
    without following links and without blocking: a file replaced by a symlink
    would otherwise put the link target's bytes (any file on the machine) in the
    archive, and one replaced by a FIFO would hang the pack.

    A small object, not a closure: one is held per file until the pack ends (two closures
    and their cells were ~400 bytes a file, a third of what packing a million files held).
    """

    __slots__ = ("changed", "ctime_ns", "ident", "rel", "root", "size")

    def __init__(
        self, root: str, rel: str, size: int, ident: tuple[int, int], changed: list[str], ctime_ns: int = 0
    ) -> None:
        self.root = root  # shared by every file: the path is joined when the file is read
        self.rel = rel  # the member's name (held by its entry anyway)
        self.size = size
        self.ident = ident
        self.changed = changed
        self.ctime_ns = ctime_ns  # when listed: its size and mtime went into the header then

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.rel)

    def _note_changed(self) -> None:
        """Name this file in ``changed`` once (a file that changed and then shrank was counted twice)."""
        if not self.changed or self.changed[-1] != self.path:
            self.changed.append(self.path)

    def restat(self) -> os.stat_result | None:
        """The file now (its header is written next), or None when it is no longer there to pack."""
        try:
            st = os.lstat(self.path)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):  # EACCES...: stops the pack, naming it
                raise
            st = None
        if st is None or not statmod.S_ISREG(st.st_mode):
            how = "removed" if st is None else "replaced by a non-file"
            log.warning("%s: %s since it was listed: not packed", self.path, how)
            self._note_changed()
            return None
        self.size = st.st_size
        self.ident = (st.st_dev, st.st_ino)
        self.ctime_ns = st.st_ctime_ns
        return st

    def _lost(self, n: int, why: str, *args) -> Iterator[bytes]:
        """The member keeps its announced size: ``n`` zero bytes, warned about and counted."""
        log.warning(f"%s: {why}: packed as %d zero bytes", self.path, *args, n)
        self._note_changed()
        yield from tar_stream.zeros(n)

    def __call__(self) -> Iterator[bytes]:
        try:
            yield from self._chunks()
        except OSError as exc:  # EIO from a damaged disk (or a cdmlfs mount): say which file
            if exc.filename is None:
                raise OSError(exc.errno, exc.strerror, self.path) from exc
            raise

    def _chunks(self) -> Iterator[bytes]:
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
            if self.ctime_ns and st.st_ctime_ns != self.ctime_ns:
                # Rewritten between the listing and now: its header has the listed mtime (and size).
                log.warning("%s: changed since it was listed (file changed as we read it)", path)
                self._note_changed()
                st = None  # said once: no second warning after the read
            if not size:  # nothing to read, but it may have grown since it was listed
                self._check_unchanged(f, st)
            left = size
            while left > 0:
                data = f.read(min(READ_CHUNK, left))
                if not data:
                    yield from self._lost(left, "shrank while being packed")
                    return
                left -= len(data)
                if not left:  # checked before the last chunk goes: the writer stops asking after it
                    self._check_unchanged(f, st)
                yield data

    def _check_unchanged(self, f, before: os.stat_result | None) -> None:
        """Its header is written: a file that grew keeps the size it announced, and one written to
        while it was read may mix old and new bytes. GNU tar says "file changed as we read it" (its
        ctime moved) and exits 1: so does this."""
        if before is None:  # already named as changed when it was opened
            return
        after = os.fstat(f.fileno())
        if after.st_size > self.size or f.read(1):
            log.warning("%s: grew while being packed: packed its first %d bytes", self.path, self.size)
            self._note_changed()
        elif after.st_ctime_ns != before.st_ctime_ns:
            log.warning("%s: changed while being packed (file changed as we read it)", self.path)
            self._note_changed()


def _sorted_entries(path: str, changed: list[str] | None = None) -> Iterator[os.DirEntry]:
    """A directory's entries by name; one removed since its parent was listed is empty, warned about
    and named in ``changed`` (it aborted the whole pack), as GNU tar goes on past it."""
    try:
        with os.scandir(path) as it:
            return iter(sorted(it, key=lambda e: e.name))
    except FileNotFoundError:
        if changed is None:
            raise UsageError(f"{path}: no such directory") from None
        log.warning("%s: removed before it was packed", path)
        changed.append(path)
        return iter(())
    except OSError as exc:
        # The source itself is the command's argument (exit 2); a folder inside it fails the pack
        # like an unreadable file does (exit 1).
        error = UsageError if changed is None else CdmlfsError
        raise error(f"{path}: cannot list directory ({exc.strerror})") from None


def entries_from_directory(
    root: str, skip: str | None = None, changed: list[str] | None = None
) -> list[PackEntry]:
    """Everything under ``root`` (not root itself), names sorted, each directory followed by its
    whole subtree (GNU tar's order: ``tar -x`` sets a directory's mtime once it leaves it, so
    nothing written into it afterwards moves that mtime). ``skip``: a path not to pack (the output).
    ``changed`` collects the files that changed or vanished while packing (see ``_FileChunks``)."""
    changed = [] if changed is None else changed
    # Resolved as the kernel does: abspath made "link/.." the current directory, not the parent
    # of the link's target, and packed another directory than `tar -C link/..` does.
    root = os.path.realpath(root)
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
            stack.append((rel, _sorted_entries(item.path, changed)))
        elif statmod.S_ISLNK(mode):
            try:
                target = os.readlink(item.path)
            except OSError as exc:  # removed or replaced since it was listed
                if exc.errno not in (errno.ENOENT, errno.EINVAL):
                    raise
                log.warning("%s: removed before it was packed", item.path)
                changed.append(item.path)
                continue
            key = (st.st_dev, st.st_ino)
            first = seen_inodes.get(key) if st.st_nlink > 1 else None
            if first is not None:  # a hard link to a symlink packed already
                out.append(PackEntry(rel, HARDLINK, link=first, target_link=target, **common))
            else:
                if st.st_nlink > 1:
                    seen_inodes[key] = rel
                out.append(PackEntry(rel, SYMLINK, link=target, **common))
        elif statmod.S_ISREG(mode):
            key = (st.st_dev, st.st_ino)
            first = seen_inodes.get(key) if st.st_nlink > 1 else None
            chunks = _FileChunks(root, rel, st.st_size, key, changed, st.st_ctime_ns)
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
        log.warning("skipped %d special file%s", skipped, "" if skipped == 1 else "s")
    return out


def _as_they_are_now(entries: Iterable[PackEntry]) -> Iterator[PackEntry]:
    """A directory listing's files as they are when their turn comes, as GNU tar takes them.

    The listing is made before anything is written (for the progress total); a pack
    can take hours. A file removed since is left out (it was packed as zeros of its
    listed size), one replaced is packed as the new file with its own size and times.
    A hard link is checked too: one replaced by another file is packed as that file
    (it was packed as a link to its old first name, with that name's bytes), and when
    the first name of its inode went (removed, or replaced by another file), the first
    of its links still there is packed as the file and the others link to it.
    """
    carrier: dict[str, str | None] = {}  # first name gone -> the link packed with its bytes (None: none yet)
    for entry in entries:
        chunks = entry.read
        if not (isinstance(chunks, _FileChunks) and entry.kind in (FILE, HARDLINK)):
            yield entry
            continue
        listed = chunks.ident
        st = chunks.restat()  # also what a link's own bytes are checked against (a ZIP reads them)
        if st is None:
            if entry.kind == FILE:
                carrier.setdefault(entry.name, None)
            continue
        same = (st.st_dev, st.st_ino) == listed
        entry = entry._replace(size=st.st_size, mode=statmod.S_IMODE(st.st_mode), mtime=st.st_mtime)
        entry = entry._replace(uid=st.st_uid, gid=st.st_gid)
        if entry.kind == FILE:
            if not same:  # replaced (saved by rename): its links keep the old bytes, the first carries them
                carrier.setdefault(entry.name, None)
        elif not same:  # this name now holds another file: packed as itself
            entry = entry._replace(kind=FILE, link="")
        elif entry.link in carrier:
            target = carrier[entry.link]
            if target is None:
                carrier[entry.link] = entry.name
                entry = entry._replace(kind=FILE, link="")
            else:
                entry = entry._replace(link=target)
        yield entry


def entries_from_archive(archive, dirs_last: bool = True) -> list[PackEntry]:
    """Members of an opened :class:`~cdmlfs.archive.Archive`: files in archive order, links, directories.

    Files go in the source's order (one forward pass over it). For a tar, directories go last,
    each before its parent: written first, ``tar -x`` (not root) applied a read-only directory's
    mode once it moved on to the next directory, then could not create the files that came later
    in it, and every file written into a directory after its entry moved the mtime it had set.
    Last, each one's mode and mtime are set once everything in it is there (tar takes an existing
    directory's metadata from its entry by default, ``--overwrite-dir``). ``unzip`` sets the
    metadata of the directories it creates once it is done, and ignores entries of existing ones:
    a ZIP lists them first (``dirs_last=False``).
    """
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
    dirs: list[PackEntry] = []
    links: list[PackEntry] = []
    symlink_links: list[PackEntry] = []  # hard links to symlinks: after every symlink they name
    # Hard links whose target's path now names another entry (a later duplicate replaced it, as
    # `tar -r` appends do): the first such link carries the data as a file, the others link to it.
    carried: dict[int, str] = {}
    carriers: list[PackEntry] = []
    for eid in index.walk(0):
        kind = index.kind[eid]
        path = index.paths[eid]
        if kind == DIR:
            dirs.append(PackEntry(path, DIR, index.mode[eid], index.mtime[eid]))
        elif kind == SYMLINK and eid not in index.hardlink_of:
            links.append(
                PackEntry(path, SYMLINK, index.mode[eid], index.mtime[eid], link=reader.readlink(eid))
            )
        elif kind == SYMLINK:  # a hard link to a symlink: a hard link again, as `tar -c` keeps it
            data = index.hardlink_of[eid]
            text = reader.readlink(data)
            mode, mtime = index.mode[eid], index.mtime[eid]
            if index.get(index.paths[data]) != data:  # its target's name now holds another entry
                links.append(PackEntry(path, SYMLINK, mode, mtime, link=text))
            else:
                symlink_links.append(
                    PackEntry(path, HARDLINK, mode, mtime, link=index.paths[data], target_link=text)
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
    if not dirs_last:
        return dirs + out + carriers + links + symlink_links
    return out + carriers + links + symlink_links + dirs[::-1]  # the walk gives parents first


STDIN = "-"  # pack's source name for a tar stream on standard input
STREAM_CACHE = 64 << 20  # blocks of a remote stream source (S3 reads ahead into it)


class StreamTally:
    """Counts the members and file bytes of entries as they go by (a stream has no list to count)."""

    def __init__(self, kind: str) -> None:
        self.members = 0
        self.bytes = 0
        self._kinds = _kinds_written(kind)

    def count(self, entries: Iterable[PackEntry]) -> Iterator[PackEntry]:
        for entry in entries:
            self.members += 1
            if entry.kind in self._kinds:
                self.bytes += entry.size
            yield entry


def entries_from_tar_stream(raw, where: str, kind: str) -> Iterator[PackEntry]:
    """The members of a tar read as one stream (:func:`cdmlfs.tar_stream.members`) as pack entries."""
    with contextlib.closing(tar_stream.members(raw, where, kind)) as members:  # closed with us
        for m in members:
            yield PackEntry(m.path, m.kind, m.mode, m.mtime, m.size, m.link, read=m.read)


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
        self._frames = 0  # cut so far (written or in flight)
        self._level = level
        self._local = threading.local()
        most = max(1, INFLIGHT_BUDGET // (2 * frame_size))  # frames in flight within the budget
        threads = max(1, min(threads, most))
        self._pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
        self._inflight: deque[tuple[Future | bytes, int]] = deque()
        self._max_inflight = min(2 * threads, most)

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
        self._frames += 1
        if self._frames >= MAX_SEEK_TABLE_FRAMES:  # one entry is left for the member index frame
            raise UsageError(
                f"more than {MAX_SEEK_TABLE_FRAMES - 1} frames, the seek table's limit: "
                f"use a larger --frame-size than {self._frame_size}"
            )
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
        payload = encode_embedded_index(members)
        try:  # the reader's own limits: an index it would refuse makes every first mount a scan
            decode_embedded_index(payload, members.stream_size)
        except ValueError as exc:
            log.warning("the member index would not be used (%s): the archive mounts after a scan", exc)
        index_frame = skippable_frame(payload, EMBEDDED_INDEX_NIBBLE)
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
        if entry.kind == FILE and entry.read is not None:  # an empty one too: it may have grown
            written = 0
            for chunk in entry.read():
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
    # Extended timestamp: the exact mtime, which unzip, libarchive and cdmlfs read as unsigned (so
    # past 2038 too). A time before 1970 gets none: readers disagree on negative ones (libarchive
    # took 1960 for 2096), and all agree on the DOS date (1980-01-01).
    if 0 <= mtime < 2**32:
        info.extra = struct.pack("<HHBI", 0x5455, 5, 1, mtime)
    ext = entry.name.rpartition(".")[2].lower() if "." in entry.name.rpartition("/")[2] else ""
    if entry.kind not in (FILE, HARDLINK) or ext in STORED_EXTENSIONS or entry.size == 0:
        info.compress_type = zipfile.ZIP_STORED
    else:
        info.compress_type = zipfile.ZIP_DEFLATED
        info._compresslevel = level  # type: ignore[attr-defined]  # read by ZipFile.open(info, "w")
    return info


def check_zip_names(entries: list[PackEntry]) -> None:
    """Refuse, before anything is written, names a ZIP cannot hold as they are."""
    for entry in entries:
        try:
            encoded = entry.name.encode("utf-8")
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
        if len(encoded) + (entry.kind == DIR) > 0xFFFF:  # a 16-bit field holds the length
            raise UsageError(
                f"{entry.name[:60]}...: a path of {len(encoded):,} bytes; a ZIP name holds at most "
                "65,535: pack to .tar.zst"
            )


def write_zip(entries: Iterable[PackEntry], f, level: int, progress: Progress | None, total: int) -> None:
    """The ZIP of ``entries`` (names checked by :func:`check_zip_names`) into ``f``."""
    done = 0
    last_report = 0.0
    with zipfile.ZipFile(f, "w", allowZip64=True) as zf:
        for entry in entries:
            if entry.kind == HARDLINK and entry.target_link:  # no hard links in a ZIP: a copy
                entry = entry._replace(kind=SYMLINK, link=entry.target_link, size=0, read=None)
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
                if entry.read is not None:  # an empty file too: it may have grown
                    for chunk in entry.read():
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
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", path):  # s3://...: read as a local path, it wrote ./s3:/...
        raise UsageError(f"{path}: pack writes a local file (upload it afterwards: aws s3 cp OUT {path})")
    lower = path.lower()
    if lower.endswith((".tar.zst", ".tzst", ".tar.zstd")):
        return "tar.zst"
    if lower.endswith(".tar"):
        return "tar"
    if lower.endswith(".zip"):
        return "zip"
    raise UsageError(f"{path}: output must end in .tar.zst, .tzst, .tar or .zip")


def _replaced_entry(out: str) -> str:
    """The directory entry that writing ``out`` replaces: its directory resolved, its own name not.

    ``os.replace`` swaps the name itself in: an ``out`` that is a symlink is replaced, and the
    file it points to is left alone (so that file is still packed, not skipped as the output)."""
    out = os.path.abspath(out)
    return os.path.join(os.path.realpath(os.path.dirname(out)), os.path.basename(out))


def _inside(src: str, out: str) -> str:
    """The path, relative to the directory ``src``, of the entry writing ``out`` replaces, when it lies
    inside ``src``; else ''."""
    real_src = os.path.realpath(src)
    replaced = _replaced_entry(out)
    if replaced == real_src or not is_under(real_src, replaced):
        return ""
    return os.path.relpath(replaced, real_src)


def _kinds_written(kind: str) -> tuple[int, ...]:
    """The entries whose bytes an output of ``kind`` holds: files, and in a ZIP the copies hard
    links become (the progress bar and the summary count the same)."""
    return (FILE, HARDLINK) if kind == "zip" else (FILE,)


def _bytes_to_write(entries: list[PackEntry], kind: str) -> int:
    """What the progress bar counts."""
    kinds = _kinds_written(kind)
    return sum(e.size for e in entries if e.kind in kinds)


def _keep_mode_of(out: str, fd: int) -> None:
    """``--force`` over a regular file: the new one keeps its mode (and owner, where allowed), as
    GNU tar's output does; a private 0600 archive came back 0644."""
    try:
        st = os.lstat(out)
    except OSError:
        return
    if statmod.S_ISREG(st.st_mode):
        os.fchmod(fd, statmod.S_IMODE(st.st_mode))
        with contextlib.suppress(OSError):
            os.fchown(fd, st.st_uid, st.st_gid)


class _HeldRecords(logging.Filter):
    """Keeps a logger's records instead of letting them out (see where pack opens an archive)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


def _create_partial(out: str) -> tuple[BinaryIO, str]:
    """A new temporary file beside ``out`` (its hidden ``.partial`` name), open for writing.

    Created exclusively and never through a link (``O_EXCL | O_NOFOLLOW``): a name that can be guessed
    in a shared directory must not let a planted symlink redirect the archive onto another file. The
    mode is the usual new-file mode (0o666 less the umask), as ``open(out, "wb")`` would give."""
    # Beside the entry os.replace swaps (its directory resolved: "link/../x" is not "./x"), under
    # a name short enough for any legal ``out`` (NAME_MAX is 255 bytes).
    directory, name = os.path.split(_replaced_entry(out))
    short = name.encode("utf-8", "surrogateescape")[:64].decode("utf-8", "ignore")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = os.path.join(directory, f".{short}.partial-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        except OSError as exc:  # name what the user asked for, not our temporary file
            raise UsageError(f"{out}: cannot write it ({exc.strerror})") from None
        _keep_mode_of(out, fd)
        return os.fdopen(fd, "wb"), tmp
    raise UsageError(f"{out}: cannot write it (no free temporary name beside it)")


def pack(
    src: str,
    out: str,
    level: int | None = None,
    frame_size: int | None = None,
    threads: int | None = None,
    force: bool = False,
    progress: Progress | None = None,
    **archive_options,
) -> dict:
    """Write ``src`` (a directory, an archive, a compressed tar, or ``-``: a tar stream on standard
    input) to ``out``; returns a small summary for the CLI."""
    kind = output_kind(out)
    if frame_size is None:
        frame_size = DEFAULT_FRAME_SIZE
    elif kind != "tar.zst":  # accepted and ignored before: a user tuning random access got nothing
        raise UsageError(f"--frame-size applies to .tar.zst outputs; a .{kind} has no zstd frames")
    if not 4096 <= frame_size <= MAX_FRAME_SIZE:
        raise UsageError("--frame-size must be between 4K and 64M (the most a mount decodes in one piece)")
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
    opened_fd: int | None = None
    try:
        if src == STDIN:
            if sys.stdin is None:
                raise UsageError("'-' reads a tar from standard input, which is closed: pipe one in")
            if sys.stdin.isatty():
                raise UsageError("'-' reads a tar from standard input, which is a terminal: pipe one in")
            try:
                fd = sys.stdin.fileno()
            except (OSError, ValueError, AttributeError):  # replaced by an object with no descriptor
                raise UsageError(
                    "'-' reads a tar from standard input, which has no file descriptor"
                ) from None
            pipe = tar_stream.Pipe(fd)
            stream = pipe.kind()
            where = "standard input"
        elif "://" not in src and _is_pipe(src):
            # A FIFO or a shell's process substitution (<(curl ...), /dev/fd/N): read once, forward,
            # as standard input is.
            try:
                opened_fd = os.open(src, os.O_RDONLY)
            except OSError as exc:
                raise UsageError(f"{src}: cannot read it ({exc.strerror})") from None
            try:
                pipe = tar_stream.Pipe(opened_fd, src)
                stream = pipe.kind()
            except BaseException:  # nothing reads it in the background yet: safe to close
                os.close(opened_fd)
                opened_fd = None
                raise
            where = src
        else:
            remote = "://" in src  # an archive URI (s3://...): opened like any archive
            if not remote:
                try:  # what stat says: a symlink loop was reported as "no such file"
                    os.stat(src)
                except OSError as exc:
                    raise UsageError(f"{src}: {(exc.strerror or 'cannot stat it').lower()}") from None
            # An output that is a symlink is replaced, not written through: one to the source is fine.
            if not remote and not os.path.islink(out) and os.path.exists(out) and os.path.samefile(src, out):
                raise UsageError("the output would overwrite the source")
            if remote or not os.path.isdir(src):
                source, stream = _open_if_stream(src, archive_options, zstd=kind != "zip")
            where = src
        if stream is not None and kind == "zip":
            raise UsageError(
                f"{where}: a tar read as a stream converts in one pass to .tar.zst or .tar only "
                "(its hard links would need bytes read before); pack the .tar.zst into a .zip from there"
            )
        options = dict(level=level, frame_size=frame_size, threads=threads, archive_options=archive_options)
        try:
            summary = _pack(src, out, kind, progress=progress, pipe=pipe, source=source, stream=stream,
                            where=where, **options)  # fmt: skip
            if opened_fd is not None:  # read to its end: the read-ahead thread is done with it
                os.close(opened_fd)
            return summary
        except tar_stream.UnterminatedTar as exc:
            if stream != "zstd" or pipe is not None:
                raise
            # The archive path lists such a tar as a mount does (tar -x reads it too): pack what is
            # there, as before zstd files were read as streams.
            log.warning("%s: packing it as an archive instead, as tar -x and a mount read it", exc.reason)
            source.close()
            source = None
            return _pack(src, out, kind, progress=progress, pipe=None, source=None, stream=None,
                         where=where, **options)  # fmt: skip
    finally:
        if source is not None:
            source.close()
        # A pack that failed may leave the read-ahead thread blocked in a read of the pipe: its
        # descriptor stays open (closed, its number could be reused and read by that thread).


def _is_pipe(path: str) -> bool:
    try:
        return statmod.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def _open_if_stream(src: str, options: dict, zstd: bool) -> tuple[Source | None, str | None]:
    """(the opened source, its compressor) when pack reads ``src`` (a path or URI) as one stream;
    (None, None) when it opens it as an archive.

    Streams: gzip, bzip2 and xz compressed tars (nothing else reads them), and zstd files without a
    seek table (``tar --zstd``, pzstd). Opened as an archive, those were indexed by a scan and
    copied through a 256 MiB cache; as a stream, one pass: a 240 MB single-frame or pzstd archive
    packed in about the same time (1.6-2.2 s vs 1.8-2.7 s) with 70 MB of RSS instead of 350, and
    no index file left behind in the index directory. Packed (seekable) tar.zst keep the archive
    path: their index is there; so does any zstd file when ``zstd`` is false (ZIP output, which a
    stream cannot feed).
    """
    from cdmlfs.cache import ExtentCache
    from cdmlfs.sources import open_source

    source = open_source(src, cache=ExtentCache(STREAM_CACHE), **options)
    try:
        head = source.read_at(0, min(th.BLOCK, source.size))
        kind = tar_stream.stream_kind(head)
        if zstd and kind is None and looks_like_zstd(head) and not _has_seek_table(source):
            kind = "zstd"
    except BaseException:
        source.close()
        raise
    if kind is None:
        source.close()
        return None, None
    return source, kind


def _has_seek_table(source: Source) -> bool:
    """A seek table, or something that tries to be one: a malformed table keeps the archive path,
    which warns and locates the frames by their headers (as a mount does)."""
    try:
        return read_seek_table(source) is not None
    except ArchiveFormatError:
        return True


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
    pipe: tar_stream.Pipe | None,
    source: Source | None,
    stream: str | None,
    where: str,
) -> dict:
    """pack() once its arguments are checked: ``stream`` names the compressor (or "tar") of a
    source read as one stream, ``pipe`` (standard input) or ``source`` (a file or object)."""
    threads = max(1, threads or os.cpu_count() or 1)
    archive = None
    tally = None
    streamed = None
    changed: list[str] = []
    try:
        entries: Iterable[PackEntry]
        if stream is not None:
            # One pass, no list: progress goes by (compressed) bytes read, counts are taken on the way.
            raw = pipe if pipe is not None else SourceRange(source, 0, source.size)
            total = None if pipe is not None else source.size
            tally = StreamTally(kind)
            streamed = entries_from_tar_stream(raw, where, stream)
            entries = tally.count(streamed)
            if progress is not None:
                report = progress
                progress = lambda done, _total: report(raw.tell(), total)  # noqa: E731
        elif os.path.isdir(src):
            # An output inside the directory (overwritten with --force) is not packed into itself.
            skip = os.path.join(os.path.realpath(src), _inside(src, out))
            listed = entries_from_directory(src, skip=skip, changed=changed)
            # Counted as written: files removed since the listing are left out (the summary counted them).
            tally = StreamTally(kind)
            entries = tally.count(_as_they_are_now(listed))
            total = _bytes_to_write(listed, kind)
        else:
            from cdmlfs.archive import Archive

            # The tar format's warnings are held until we know we go on: for a damaged tar its
            # "listing what came before" would precede the one-line refusal.
            held = _HeldRecords()
            tar_log = logging.getLogger("cdmlfs.formats.tar")
            tar_log.addFilter(held)
            try:
                # Any window zstd's default takes (128 MiB): a mount's rule (a quarter of its cache)
                # sends such archives here to be converted.
                archive = Archive(src, cache_size=256 << 20, window_limit=MAX_WINDOW, **archive_options)
            finally:
                tar_log.removeFilter(held)
            if not getattr(archive.format, "damaged", False):
                for record in held.records:
                    tar_log.handle(record)
            else:  # a mount lists what came before it; a copy must not drop the rest
                archive.close()
                raise ArchiveFormatError(
                    f"{src}: the tar stream {archive.format.ending}: a copy would lose every member "
                    "after it (tar -x may read on past it)"
                )
            entries = listed = entries_from_archive(archive, dirs_last=kind != "zip")
            total = _bytes_to_write(listed, kind)
        started = time.monotonic()
        f, tmp = _create_partial(out)
        try:
            with f:
                if kind == "zip":
                    check_zip_names(listed)
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
        if streamed is not None:  # stops its read-ahead thread now, before the caller closes the source
            streamed.close()
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
