"""Wire the C hot path (``cdmlfs._fastpath``) into a libfuse3 mount.

The C module answers getattr, whole-member reads, directory listings and ioctls
(ENOTTY, but for the stats request) straight from the index columns; everything it
does not handle goes to the Python callbacks mfusepy built, so behaviour (errors,
logging, the cache) stays defined in Python.
``CDMLFS_FASTPATH=0`` turns it off; it is also off with libfuse2 and when the
extension is not built. ``cdmlfs doctor`` says which.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from array import array
from collections.abc import Hashable, Iterator

from cdmlfs import extensions, statsio
from cdmlfs.archive import Archive
from cdmlfs.cache import ExtentCache
from cdmlfs.index import DIR, INCONSISTENT, SPARSE

log = logging.getLogger(__name__)


def availability(fuse_major: int | None = None) -> tuple[bool, str]:
    """Whether the C fast path can serve, and why not."""
    ready = "C getattr/read/readdir callbacks"
    return extensions.availability("cdmlfs._fastpath", "CDMLFS_FASTPATH", fuse_major, ready)


def build_table(archive: Archive):
    """The C table over ``archive``'s index columns (shares the reader's verified-CRC bitmap)."""
    from cdmlfs._fastpath import FastPath

    ix = archive.index
    n = ix.entry_count
    nlink = array("I", bytes(4 * n))
    fast = bytearray(n)
    hardlinked = set(ix.hardlink_of) | set(ix.nlink_extra)
    flags = ix.flags
    for eid in ix._lookup.values():
        if eid in hardlinked or flags[eid] & (INCONSISTENT | SPARSE):  # Python answers these
            continue
        fast[eid] = 1
        if ix.kind[eid] == DIR:
            nlink[eid] = ix.nlink(eid)
    reader = archive.reader
    fd = reader._fd if reader._fd is not None else -1
    columns = {
        "kind": ix.kind,
        "mode": ix.mode,
        "mtime": ix.mtime,
        "size": ix.size,
        "method": ix.method,
        "flags": ix.flags,
        "offset": ix.offset,
        "comp_size": ix.comp_size,
        "crc": ix.crc,
        "nlink": nlink,
        "fast": fast,
        "verified": reader._verified,
        # ZIP data offsets resolved from local headers (shared with the Python path); none elsewhere
        "data_at": getattr(archive.format, "data_at", array("q")),
    }
    if getattr(archive.format, "name", "") != "zip":
        fd = -1  # only ZIP members (local headers, CRCs) are read in C; other formats keep C getattr only
    table = FastPath(
        ix._lookup,
        columns,
        fd,
        archive.source.size,
        os.getuid(),
        os.getgid(),
        reader.whole_limit,
    )
    stamp = getattr(archive.source, "stamp", None)
    source_fd = archive.source.fileno()
    if stamp is not None and source_fd is not None:
        table.set_source_stamp(source_fd, *stamp)  # a file written in place: C reads go to Python
        archive.source.on_restamp.append(functools.partial(table.set_source_stamp, source_fd))  # a touch
    # The tree for readdir in C: each directory's children (in listing order, see
    # IndexBuilder.finish) as a run of one array.
    start = array("I", bytes(4 * n))
    count = array("I", bytes(4 * n))
    ids = array("I")
    for eid, kids in ix._children.items():
        start[eid] = len(ids)
        count[eid] = len(kids)
        ids.extend(kids)
    table.set_tree(ix.parent, start, count, ids)
    return table


class HotExtents:
    """Which decoded container extents (zstd frames, tar blocks) the C read path may copy from.

    The reader reports each extent it serves from in Python; from then on reads
    inside it are answered in C. The set mirrors the cache exactly: an extent is
    added only while the cache holds it (checked under the cache lock) and
    dropped when the cache lets it go, so the C views never keep memory alive
    beyond the cache bound. A single "last extent" was not enough: walking
    directories whose files alternate between frames sent half of all reads to
    Python.
    """

    def __init__(self, table, cache: ExtentCache) -> None:
        self._table = table
        self._cache = cache
        self._starts: dict[Hashable, int] = {}  # cache key -> extent start, for extents in the table

    def add(self, key: Hashable, start: int, data: object) -> None:
        """The reader served from ``data`` (the cache's value under ``key``) at stream offset ``start``."""
        if key in self._starts:  # already served in C: no need to take the cache lock to say so again
            return

        def register() -> None:
            if key not in self._starts:
                self._table.add_hot(start, data)
                self._starts[key] = start

        self._cache.call_if_held(key, data, register)

    def removed(self, key: Hashable) -> None:
        """The cache let go of ``key`` (called under the cache lock)."""
        start = self._starts.pop(key, None)
        if start is not None:
            self._table.drop_hot(start)

    def __len__(self) -> int:
        return len(self._starts)


def attach(archive: Archive, table) -> HotExtents:
    """Serve reads inside cached container extents of ``archive`` from ``table`` in C."""
    hot = HotExtents(table, archive.cache)
    archive.cache.on_remove = hot.removed
    archive.reader.on_extent = hot.add
    return hot


@contextlib.contextmanager
def installed(mfusepy, table) -> Iterator[None]:
    """Swap the C callbacks into the fuse_operations that mfusepy hands to libfuse.

    mfusepy builds the struct and calls ``fuse_main_real`` in one go, so this
    wraps that function for the duration of the mount (the one place we reach
    into mfusepy). The Python callbacks stay referenced: they are the fallback.
    """
    real = mfusepy.fuse_main_real
    fields = dict(mfusepy.fuse_operations._fields_)
    keep: list[object] = []

    def fuse_main_with_fast_path(argc, argv, ops_ptr, size, ctx):
        ops = ops_ptr.contents
        keep.append(dict(ops._objects or {}))  # the Python thunks must outlive the loop
        py_getattr = ctypes.cast(ops.getattr, ctypes.c_void_p).value
        py_read = ctypes.cast(ops.read, ctypes.c_void_p).value
        py_ioctl = ctypes.cast(ops.ioctl, ctypes.c_void_p).value or 0
        py_readdir = ctypes.cast(ops.readdir, ctypes.c_void_p).value or 0
        if py_getattr and py_read:
            fast = table.activate(py_getattr, py_read, py_ioctl, py_readdir, statsio.REQUEST)
            fast_getattr, fast_read, fast_ioctl, fast_readdir = fast
            ops.getattr = fields["getattr"](fast_getattr)
            ops.read = fields["read"](fast_read)
            if fast_ioctl:
                ops.ioctl = fields["ioctl"](fast_ioctl)
            if fast_readdir:
                ops.readdir = fields["readdir"](fast_readdir)
            log.debug("C fast path active for getattr, read, ioctl and readdir")
        return real(argc, argv, ops_ptr, size, ctx)

    mfusepy.fuse_main_real = fuse_main_with_fast_path
    try:
        yield
    finally:
        mfusepy.fuse_main_real = real
