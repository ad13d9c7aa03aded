"""The archive index: a compact table of entries plus the directory tree.

Formats (ZIP, tar) feed raw entries to :class:`IndexBuilder`; it applies the
path rules (:mod:`cdmlfs.pathrules`), resolves duplicates and clashes, creates
the directories implied by file paths and produces an immutable :class:`Index`.

Memory matters: 200k entries must fit in well under 80 MiB, so entries are
columns (``array``/``bytearray``, one slot per entry) rather than one object
per entry. Entry 0 is always the root directory.
"""

from __future__ import annotations

import logging
import stat as statmod
from array import array
from collections.abc import Iterator
from typing import NamedTuple

from cdmlfs.errors import ArchiveFormatError, NotFoundError, PathNotADirectoryError
from cdmlfs.pathrules import normalize

log = logging.getLogger(__name__)

# Path bytes an index may hold: a base plus an allowance per archive entry. Ordinary archives stay
# far below it (10 million entries of 120-byte paths: 1.2 GB of 41 GB allowed), while one entry
# named a/a/.../a (64 KiB, 32,000 levels) implies 32,000 directories whose paths add up to 1 GiB
# (three such entries, a 393 KB ZIP, took 3 GiB and 14 s to open).
PATH_BYTES_BASE = 256 << 20
PATH_BYTES_PER_ENTRY = 4 << 10

# Entry kinds.
FILE = 0
DIR = 1
SYMLINK = 2

# Methods: ZIP method numbers where one exists, so the ZIP parser stores them as-is.
STORED = 0
DEFLATE = 8
BZIP2 = 12
LZMA = 14
ZSTD = 93
XZ = 95
IN_STREAM = 0xFF00  # bytes at `offset` of the archive's decoded container stream (tar, tar.zst)

# Flags.
ENCRYPTED = 1
NEEDS_LOCAL_HEADER = 2  # ZIP: `offset` is the local header; the data offset is resolved on first read
MEMBER_CRC = 4  # IN_STREAM: `crc` is the member's CRC-32 (written by cdmlfs pack), checkable on its own
# ZIP: a member whose record contradicts itself (declared empty with a CRC other than 0 or stored
# data; stored with two different sizes; ZIP64 sizes missing): EIO on stat and read (the kernel never
# asks to read a file of size 0, so a later check could not catch the empty ones).
INCONSISTENT = 8
SPARSE = 16  # IN_STREAM (tar sparse file): data segments in Index.sparse, holes read as zeros

DEFAULT_DIR_MODE = 0o755
PERMISSION_BITS = 0o777  # setuid, setgid, sticky and device bits are never exposed
MAX_MTIME = float(1 << 40)  # seconds (year ~36800): far past any real date, exact as a double


class EntryStat(NamedTuple):
    """Metadata of one path, as the Python API returns it."""

    path: str
    kind: int
    size: int
    mode: int  # full st_mode, type bits included
    mtime: float
    ino: int
    nlink: int
    compressed_size: int
    method: int

    @property
    def is_dir(self) -> bool:
        return self.kind == DIR

    @property
    def is_file(self) -> bool:
        return self.kind == FILE

    @property
    def is_symlink(self) -> bool:
        return self.kind == SYMLINK


class Index:
    """Immutable entry table plus tree. Built only by :class:`IndexBuilder`.

    Columns are indexed by entry id and never written after building: threads
    and the C hot path read them without locks (a ZIP member's data offset,
    read from its local header on first use, is kept by the format instead).
    """

    __slots__ = (
        "_children",
        "_lookup",
        "comp_size",
        "crc",
        "flags",
        "hardlink_of",
        "kind",
        "link_target",
        "method",
        "mode",
        "mtime",
        "nlink_extra",
        "offset",
        "parent",
        "paths",
        "problems",
        "size",
        "sparse",
    )

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.kind = bytearray()
        self.mode = array("H")
        self.mtime = array("d")
        self.size = array("Q")
        self.method = array("H")
        self.flags = bytearray()
        self.offset = array("q")
        self.comp_size = array("Q")
        self.crc = array("I")
        self.parent = array("I")
        self.link_target: dict[int, str] = {}  # symlink targets known at index time (tar)
        self.hardlink_of: dict[int, int] = {}  # hard link -> entry holding the data (tar)
        self.nlink_extra: dict[int, int] = {}  # entry with data -> number of extra hard links
        self.problems: dict[int, str] = {}  # INCONSISTENT entry -> what its record contradicts (zip)
        # SPARSE entry -> (logical starts, lengths, starts in the stored data) of its data segments
        self.sparse: dict[int, tuple[array, array, array]] = {}
        self._lookup: dict[str, int] = {}
        self._children: dict[int, array] = {}

    # -- queries ---------------------------------------------------------
    def __len__(self) -> int:
        """Number of reachable paths, root included."""
        return len(self._lookup)

    @property
    def entry_count(self) -> int:
        return len(self.paths)

    def lookup(self, path: str) -> int:
        """Entry id of a path ('' or '/' is the root); raises NotFoundError."""
        eid = self._lookup.get(path)
        if eid is None:
            eid = self._lookup.get(path.strip("/"))
            if eid is None:
                raise NotFoundError(f"{path}: no such file or directory in the archive")
        return eid

    def get(self, path: str) -> int | None:
        """Entry id of a normalised path without leading '/', or None (the FUSE hot path)."""
        return self._lookup.get(path)

    def children(self, eid: int) -> array:
        """Ids of the entries in directory ``eid``: name order, or archive order for tar (see ``finish``)."""
        if self.kind[eid] != DIR:
            raise PathNotADirectoryError(f"{self.paths[eid]}: not a directory")
        return self._children.get(eid, _EMPTY)

    def name(self, eid: int) -> str:
        return self.paths[eid].rpartition("/")[2]

    def st_mode(self, eid: int) -> int:
        kind = self.kind[eid]
        type_bits = (
            statmod.S_IFDIR if kind == DIR else statmod.S_IFLNK if kind == SYMLINK else statmod.S_IFREG
        )
        return type_bits | self.mode[eid]

    def inode(self, eid: int) -> int:
        """Inode number: hard links share the inode of the entry holding the data."""
        return self.hardlink_of.get(eid, eid) + 1

    def nlink(self, eid: int) -> int:
        if self.kind[eid] == DIR:
            return 2 + sum(1 for c in self._children.get(eid, _EMPTY) if self.kind[c] == DIR)
        return 1 + self.nlink_extra.get(self.hardlink_of.get(eid, eid), 0)

    def data_entry(self, eid: int) -> int:
        """The entry whose columns describe the bytes of ``eid`` (itself, or a hard link's target)."""
        return self.hardlink_of.get(eid, eid)

    def stat(self, eid: int) -> EntryStat:
        data = self.data_entry(eid)
        return EntryStat(
            path=self.paths[eid],
            kind=self.kind[eid],
            size=self.size[data] if self.kind[eid] != DIR else 0,
            mode=self.st_mode(eid),
            mtime=self.mtime[eid],
            ino=self.inode(eid),
            nlink=self.nlink(eid),
            compressed_size=self.comp_size[data],
            method=self.method[data],
        )

    def walk(self, eid: int = 0) -> Iterator[int]:
        """All reachable entries below ``eid`` (depth first, name order), ``eid`` excluded."""
        stack = [iter(self.children(eid))]
        while stack:
            for child in stack[-1]:
                yield child
                if self.kind[child] == DIR:
                    stack.append(iter(self._children.get(child, _EMPTY)))
                break
            else:
                stack.pop()

    def files_in_archive_order(self) -> list[int]:
        """Reachable files with data, sorted by where their bytes lie in the archive.

        Reading in this order is one forward pass over the archive: what a
        single-frame tar.zst or a remote object wants.
        """
        ids = [e for e in self._lookup.values() if self.kind[e] == FILE and e not in self.hardlink_of]
        ids.sort(key=self.offset.__getitem__)
        return ids

    def total_file_bytes(self) -> int:
        return sum(self.size[e] for e in self._lookup.values() if self.kind[e] == FILE)

    def nbytes(self) -> int:
        """Approximate memory held by the index (for stats and the memory bound)."""
        import sys

        cols = (self.kind, self.mode, self.mtime, self.size, self.method, self.flags, self.offset)
        total = sum(c.buffer_info()[1] * c.itemsize if isinstance(c, array) else len(c) for c in cols)
        total += self.comp_size.buffer_info()[1] * self.comp_size.itemsize
        total += self.crc.buffer_info()[1] * self.crc.itemsize
        total += sys.getsizeof(self.paths) + sum(sys.getsizeof(p) for p in self.paths)
        total += sys.getsizeof(self._lookup) + 28 * len(self._lookup)
        total += sum(sys.getsizeof(a) for a in self._children.values())
        total += sum(sum(sys.getsizeof(a) for a in arrays) for arrays in self.sparse.values())
        return total


_EMPTY = array("I")


class IndexBuilder:
    """Collects raw entries from a format parser and produces an :class:`Index`.

    ``add`` is called once per archive entry and is on the mount-time hot path
    (200k calls must take well under a second), hence the plain positional
    arguments and the absence of per-entry objects.
    """

    def __init__(
        self, implied_dir_mtime: float = 0.0, backslash_is_separator: bool = True, root_entry: bool = False
    ) -> None:
        """``implied_dir_mtime`` dates the root and directories no entry describes (the archive's
        mtime); ``backslash_is_separator``: ZIP names (Windows tools), not tar names (see pathrules);
        ``root_entry``: a ``./`` entry gives the root its mode and mtime (tar -x does; unzip not)."""
        self._backslash = backslash_is_separator
        self._root_entry = root_entry
        self._index = Index()
        self._dir_ids: dict[str, int] = {"": 0}
        self._dir_mtime = implied_dir_mtime
        self.dropped = 0
        self._path_bytes = 0  # every path is held whole (list, dict keys): deep names cost depth**2
        self._path_allowance = PATH_BYTES_BASE
        self._add_raw("", DIR, DEFAULT_DIR_MODE, implied_dir_mtime, 0, STORED, 0, 0, 0, 0, 0)
        self._index._lookup[""] = 0

    def _add_raw(
        self,
        path: str,
        kind: int,
        mode: int,
        mtime: float,
        size: int,
        method: int,
        offset: int,
        comp_size: int,
        crc: int,
        flags: int,
        parent: int,
    ) -> int:
        ix = self._index
        eid = len(ix.paths)
        self._path_bytes += len(path)
        if self._path_bytes > self._path_allowance:
            raise ArchiveFormatError(
                f"the paths of this archive's entries and of the directories they imply add up to more "
                f"than {self._path_allowance >> 20} MiB of index memory ({len(ix.paths):,} paths so far; "
                "names nested thousands of levels deep repeat their parent path for every level)"
            )
        ix.paths.append(path)
        ix.kind.append(kind)
        ix.mode.append(mode & PERMISSION_BITS)
        ix.mtime.append(mtime)
        ix.size.append(size)
        ix.method.append(method)
        ix.flags.append(flags)
        ix.offset.append(offset)
        ix.comp_size.append(comp_size)
        ix.crc.append(crc & 0xFFFFFFFF)
        ix.parent.append(parent)
        return eid

    def add(
        self,
        name: str,
        kind: int,
        mode: int,
        mtime: float,
        size: int,
        method: int,
        offset: int,
        comp_size: int,
        crc: int,
        flags: int = 0,
    ) -> int | None:
        """Add one archive entry; returns its id, or None when the path rules drop it."""
        self._path_allowance += PATH_BYTES_PER_ENTRY
        if not -MAX_MTIME <= mtime <= MAX_MTIME:
            # NaN, infinities and times beyond time_t (a pax mtime is any decimal; embedded and
            # cached tables are raw doubles): stat of the entry, and so listing its directory,
            # failed with EINVAL (int(nan)), and the C fast path converted them to garbage.
            mtime = 0.0 if mtime != mtime else (MAX_MTIME if mtime > 0 else -MAX_MTIME)
        path = normalize(name, self._backslash)
        if not path:
            if kind != DIR:
                log.warning("skipping member %r: its name refers to the archive root", name)
                self.dropped += 1
            elif self._root_entry and name.lstrip("./") == "" and ".." not in name:
                # "./" (or "/"), not a name that climbs back to the root: the root's own mode and
                # mtime, which tar -x gives the target directory (a "../" member it refuses).
                self._index.mode[0] = mode & PERMISSION_BITS
                self._index.mtime[0] = mtime
            return None
        if kind == SYMLINK:
            if not size:
                # No file system holds one (symlink("") is ENOENT; tar -x and unzip fail on it):
                # listed, it was a link whose readlink gave EIO through the mount.
                log.warning("skipping member %r: a symlink with an empty target", name)
                self.dropped += 1
                return None
            mode = 0o777  # what lstat shows for any symlink on Linux (tarfile stores 0644)
        lookup = self._index._lookup
        previous = lookup.get(path)
        if previous is not None:
            prev_kind = self._index.kind[previous]
            if prev_kind == DIR and kind != DIR:
                log.warning("skipping member %r: a directory of the same path wins", name)
                self.dropped += 1
                return None
            if prev_kind == DIR and kind == DIR:
                # Explicit directory entry after an implied one (or a duplicate): take its metadata.
                self._index.mode[previous] = mode & PERMISSION_BITS
                self._index.mtime[previous] = mtime
                return previous
            if kind == DIR:  # a file (or link) seen before: the directory wins, said as when it comes first
                log.warning("hiding member %r: it clashes with a directory of the same path", path)
                self.dropped += 1
        parent_path = path.rpartition("/")[0]
        parent = self._dir_ids.get(parent_path)
        if parent is None:
            parent = self._make_dirs(parent_path)
        if kind == DIR:
            eid = self._add_raw(path, DIR, mode, mtime, 0, STORED, 0, 0, 0, 0, parent)
            self._dir_ids[path] = eid
        else:
            eid = self._add_raw(path, kind, mode, mtime, size, method, offset, comp_size, crc, flags, parent)
        lookup[path] = eid  # the last duplicate wins
        return eid

    def add_plain_run(self, run, *args) -> tuple[int, int]:
        """Let a native parser add a run of plain records; returns (records taken, where it stopped).

        ``run(*args, paths, lookup, dir_ids, path_bytes, path_allowance, allowance_per_entry,
        implied_dir_mode, implied_dir_mtime)`` (``cdmlfs._zipdir.plain_run``) appends only
        entries that need none of :meth:`add`'s special cases (a new, already normal path whose
        missing ancestors clash with nothing) to the builder's containers, with the directories
        they imply, as ``add`` would, and returns their columns; the caller gives every other
        entry to ``add``.
        """
        ix = self._index
        (records, n, stop, self._path_bytes, self._path_allowance,
         kind, mode, mtime, size, method, flags, offset, comp_size, crc, parent) = run(
            *args, ix.paths, ix._lookup, self._dir_ids, self._path_bytes, self._path_allowance,
            PATH_BYTES_PER_ENTRY, DEFAULT_DIR_MODE, self._dir_mtime,
        )  # fmt: skip
        if n:
            ix.kind += kind
            ix.mode.frombytes(mode)
            ix.mtime.frombytes(mtime)
            ix.size.frombytes(size)
            ix.method.frombytes(method)
            ix.flags += flags
            ix.offset.frombytes(offset)
            ix.comp_size.frombytes(comp_size)
            ix.crc.frombytes(crc)
            ix.parent.frombytes(parent)
        return records, stop

    def _make_dirs(self, path: str) -> int:
        """Create the directories implied by a path; a directory wins over a file of the same path."""
        # Ends of the missing ancestors, deepest first; their paths are made one at a time, as
        # they are added (all at once, a 32,000-level name held 1 GiB of prefixes before any check).
        missing: list[int] = []
        end = len(path)
        while path[:end] not in self._dir_ids:
            missing.append(end)
            end = max(path.rfind("/", 0, end), 0)
        parent = self._dir_ids[path[:end]]
        lookup = self._index._lookup
        for end in reversed(missing):
            p = path[:end]
            if p in lookup:
                log.warning("hiding member %r: it clashes with a directory of the same path", p)
                self.dropped += 1
            parent = self._add_raw(p, DIR, DEFAULT_DIR_MODE, self._dir_mtime, 0, STORED, 0, 0, 0, 0, parent)
            self._dir_ids[p] = parent
            lookup[p] = parent
        return parent

    def add_hardlink(self, name: str, target_name: str, mtime: float, mode: int) -> int | None:
        """A hard link (tar): shares the target's data, inode, mode and mtime (what ``tar -x``
        gives: link(2) takes no metadata of its own). Unknown targets are skipped."""
        target_path = normalize(target_name, self._backslash)
        target = self._index._lookup.get(target_path)
        ix = self._index
        is_link = target is not None and ix.kind[target] == SYMLINK and target in ix.link_target
        if target is None or not (is_link or ix.kind[target] == FILE):
            log.warning("skipping hard link %r: target %r is not a file seen before it", name, target_name)
            self.dropped += 1
            return None
        if normalize(name, self._backslash) == target_path:
            return target  # a link to itself: tar -x leaves the entry as it is
        target = ix.hardlink_of.get(target, target)
        if is_link:
            # A hard link to a symlink: link(2) links the symlink itself (tar -x), so the same
            # inode and link count as a file's hard link; its target is copied for readlink.
            eid = self.add(name, SYMLINK, ix.mode[target], ix.mtime[target], ix.size[target], STORED, 0, 0, 0)
            if eid is not None:
                ix.link_target[eid] = ix.link_target[target]
                if eid != target:
                    ix.hardlink_of[eid] = target
            return eid
        eid = self.add(
            name,
            FILE,
            ix.mode[target],
            ix.mtime[target],
            ix.size[target],
            ix.method[target],
            ix.offset[target],
            ix.comp_size[target],
            ix.crc[target],
            ix.flags[target],
        )
        if eid is not None and eid != target:
            ix.hardlink_of[eid] = target
        return eid

    def mark_inconsistent(self, eid: int, reason: str) -> None:
        """The entry's own record contradicts itself: listed, but EIO (with ``reason``) when used."""
        self._index.flags[eid] |= INCONSISTENT
        self._index.problems[eid] = reason

    def set_link_target(self, eid: int, target: str) -> None:
        self._index.link_target[eid] = target

    def set_sparse(self, eid: int, segments: array) -> None:
        """Data segments of a sparse file: flat (logical offset, length) pairs, in order and within
        the file (the tar scan and MemberTable.decode check that)."""
        starts, lengths, stored = array("Q"), array("Q"), array("Q")
        at = 0
        for i in range(0, len(segments), 2):
            starts.append(segments[i])
            lengths.append(segments[i + 1])
            stored.append(at)
            at += segments[i + 1]
        self._index.sparse[eid] = (starts, lengths, stored)

    def finish(self, archive_order: bool = False) -> Index:
        """Build the directory tree and return the index.

        Children are in name order, or with ``archive_order`` in the order entries first appear
        in the archive (entry ids are given in that order). For a tar stream that makes a
        depth-first walk of the mount (find, grep -r, rsync, os.walk + read) one forward pass:
        in name order a walk of a single-frame tar.zst went back and forth and decoded its frame
        about 30 times over.
        """
        ix = self._index
        parent_col = ix.parent
        children: dict[int, array] = {}
        for eid in ix._lookup.values():
            if eid == 0:
                continue
            pid = parent_col[eid]
            arr = children.get(pid)
            if arr is None:
                children[pid] = arr = array("I")
            arr.append(eid)
        # Siblings share their parent's prefix: full path order = name order.
        key = None if archive_order else ix.paths.__getitem__
        for pid, arr in children.items():
            if len(arr) > 1:
                children[pid] = array("I", sorted(arr, key=key))
        ix._children = children
        if ix.hardlink_of:
            # Link counts from the paths that remain: a later duplicate of a link's path (or of its
            # target's) takes that path away from the inode, as it does for tar -x.
            shared = set(ix.hardlink_of.values())
            counts: dict[int, int] = {}
            for eid in ix._lookup.values():
                data = ix.hardlink_of.get(eid, eid)
                if data in shared:
                    counts[data] = counts.get(data, 0) + 1
            ix.nlink_extra = {data: n - 1 for data, n in counts.items() if n > 1}
        self._dir_ids = {}
        return ix
