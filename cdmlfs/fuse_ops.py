"""FUSE operations over an :class:`~cdmlfs.archive.Archive` (mfusepy, libfuse3 preferred).

The hot callbacks (getattr, readdir, open, read) fill libfuse's C structures
directly instead of going through mfusepy's dict conversion: they run once per
file per epoch, and a dict plus ``setattr`` per field was a measurable share of
a small-file read. Everything else uses mfusepy's normal ``Operations`` API.

Choices (measured, see README "Performance"):
* kernel page cache kept (``keep_cache``): archive members never change;
* entry/attr/negative timeouts of an hour;
* readdir answers READDIRPLUS with full attributes, so a walk needs no lookups;
* ``open`` answers ENOSYS once, so the kernel never sends OPEN or RELEASE again
  (files open with the page cache kept, at no cost to us); with
  ``--direct-io-min`` set instead, every open is answered here and members of
  at least that size get ``direct_io``;
* reads land directly in libfuse's reply buffer (one copy; a positioned read
  from the archive for stored members);
* no flush/release/xattr handlers: libfuse answers them in C (ENOSYS for xattrs, after which
  the kernel stops asking); the one ioctl answered is the stats request on the root
  (``cdmlfs.statsio``), any other gets ENOTTY in C when the fast path is on.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import logging
import math
import os
import stat as statmod
import threading
import time
from types import SimpleNamespace

from cdmlfs import fuseloop, statsio
from cdmlfs.archive import Archive
from cdmlfs.errors import CdmlfsError, CorruptMemberError, MemberError
from cdmlfs.index import DIR, INCONSISTENT, SPARSE, SYMLINK
from cdmlfs.pathrules import NAME_MAX

log = logging.getLogger(__name__)

_FUSE_READDIR_PLUS = 1
_FUSE_FILL_DIR_PLUS = 2
_FUSE_CAP_READDIRPLUS_AUTO = 1 << 14  # libfuse3 fuse_common.h
_FUSE_CAP_IOCTL_DIR = 1 << 11  # libfuse 2 and 3
TIMEOUT = 3600.0


def timespec(mtime: float) -> tuple[int, int]:
    """Seconds and nanoseconds of a time kept as a double: floored seconds (-1.5 is -2 s + 0.5e9 ns,
    as stat gives), nanoseconds rounded to the nearest (doubles near 2021 resolve about 0.24 µs)."""
    sec = math.floor(mtime)
    nsec = int((mtime - sec) * 1e9 + 0.5)
    if nsec >= 1_000_000_000:
        return sec + 1, nsec - 1_000_000_000
    return sec, nsec


def load_mfusepy():
    """Import mfusepy, preferring libfuse3 (mfusepy picks libfuse2 when both are installed)."""
    if "FUSE_LIBRARY_NAME" not in os.environ and "FUSE_LIBRARY_PATH" not in os.environ:
        from ctypes.util import find_library

        if find_library("fuse3"):
            os.environ["FUSE_LIBRARY_NAME"] = "fuse3"
    import mfusepy

    return mfusepy


class ServeStats:
    """Counters for ``cdmlfs stats``; plain ints (updated under the GIL, read approximately)."""

    def __init__(self) -> None:
        self.started = time.time()
        self.requests: dict[str, int] = {"getattr": 0, "readdir": 0, "open": 0, "read": 0, "readlink": 0}
        self.errors: dict[str, int] = {}
        self.bytes_served = 0
        self.open_files = 0


class ArchiveOperations:
    """The filesystem: read-only, paths resolved through the archive index."""

    use_ns = True  # times in integer nanoseconds (mfusepy)

    def __init__(self, archive: Archive, direct_io_min: int | None = None) -> None:
        self.archive = archive
        self.index = archive.index
        self.reader = archive.reader
        self.direct_io_min = direct_io_min
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.stats = ServeStats()
        # Members whose error was logged: one byte each (a set capped at 100k entries logged every
        # failure past that, each epoch, for a badly damaged archive); the last byte is for the rest.
        self._logged = bytearray(self.index.entry_count + 1)
        self._log_lock = threading.Lock()
        self.ready_callback = None  # called once libfuse has mounted and initialised
        self.fast_table = None  # the C fast path's table when active (its counters feed stats)
        self.polling_loop = False  # whether cdmlfs._fuseloop runs the FUSE loop (see cdmlfs.fuseloop)
        self.serving = "single-threaded"
        self._total_bytes: int | None = None
        self._index_bytes = self.index.nbytes()
        self._stats_blob: bytes | None = None
        self._stats_time = 0.0
        self._stats_number = 0
        self._stats_lock = threading.Lock()
        self._open_lock = threading.Lock()
        if direct_io_min is not None:
            # Opens reach us in this mode; count them (no release handler otherwise: libfuse answers it).
            self.release = self._release

    # -- helpers -------------------------------------------------------------
    def _eid(self, path: str) -> int:
        eid = self.index.get(path[1:])
        if eid is None:
            eid = self.index.get(path.strip("/"))
            if eid is None:
                # No component over NAME_MAX exists (the path rule): say so as a local fs would.
                if any(len(c.encode("utf-8", "surrogateescape")) > NAME_MAX for c in path.split("/")):
                    raise OSError(errno.ENAMETOOLONG, "")
                raise OSError(errno.ENOENT, "")
        return eid

    def _fail(self, exc: CdmlfsError, what: str, eid: int | None = None) -> OSError:
        """Log a member error once (users act on the first line, not on a flood), count it, map errno."""
        kind = type(exc).__name__
        key = eid if eid is not None else -1
        with self._log_lock:  # also keeps the error counts exact under the multithreaded loop
            self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
            first = not self._logged[key]
            self._logged[key] = 1
        if first:
            code = errno.errorcode.get(exc.errno, str(exc.errno))
            if isinstance(exc, MemberError):
                log.error("%s failed: %s (answered %s; logged once per member)", what, exc.reason, code)
            else:
                log.error("%s failed: %s (answered %s)", what, exc, code)
        return OSError(exc.errno, str(exc))

    def fill_stat(self, eid: int, st) -> None:
        ix = self.index
        data = ix.hardlink_of.get(eid, eid) if ix.hardlink_of else eid
        kind = ix.kind[eid]
        if kind == DIR:
            st.st_mode = statmod.S_IFDIR | ix.mode[eid]
            st.st_nlink = ix.nlink(eid)
            st.st_size = 4096
            st.st_blocks = 8
        else:
            size = ix.size[data]
            st.st_mode = (statmod.S_IFLNK if kind == SYMLINK else statmod.S_IFREG) | ix.mode[eid]
            st.st_nlink = 1 + ix.nlink_extra.get(data, 0) if ix.nlink_extra else 1
            st.st_size = size
            if ix.flags[data] & SPARSE:  # its data segments only: du, and cp's --sparse=auto, see holes
                st.st_blocks = (sum(ix.sparse[data][1]) + 511) >> 9
            else:
                st.st_blocks = (size + 511) >> 9
        st.st_ino = data + 1
        st.st_uid = self.uid
        st.st_gid = self.gid
        st.st_blksize = 4096
        sec, nsec = timespec(ix.mtime[eid])
        for ts in (st.st_mtimespec, st.st_ctimespec, st.st_atimespec):
            ts.tv_sec = sec
            ts.tv_nsec = nsec

    # -- callbacks (mfusepy API) ----------------------------------------------
    def init_with_config(self, conn, config) -> None:
        if config is not None:
            config.use_ino = 1
            config.kernel_cache = 1
            config.entry_timeout = TIMEOUT
            config.attr_timeout = TIMEOUT
            config.negative_timeout = TIMEOUT
        if conn is not None and hasattr(conn, "want"):
            cache_symlinks = 1 << 23
            if conn.capable & cache_symlinks:
                conn.want |= cache_symlinks
            if conn.capable & _FUSE_CAP_IOCTL_DIR:  # the stats ioctl on the root (libfuse2 asks for it)
                conn.want |= _FUSE_CAP_IOCTL_DIR
            # READDIRPLUS for every listing request, not only a directory's first (the kernel's
            # "auto" mode): the entries then arrive with node ids and attributes, and files opened
            # or stat-ed after a listing need no LOOKUP. Measured on a 120k-entry directory:
            # os.walk + stat 3.44 s -> 0.68 s; a names-only find 0.09 s -> 0.46 s.
            conn.want &= ~_FUSE_CAP_READDIRPLUS_AUTO
        if self.ready_callback is not None:
            self.ready_callback()

    def init(self, path: str) -> None:  # libfuse2
        if self.ready_callback is not None:
            self.ready_callback()

    def getattr(self, path: str, fh=None) -> dict:
        """mfusepy's dict form. FastFUSE.fgetattr fills the C struct directly and never calls this;
        it exists because mfusepy registers the getattr callback only when the method exists."""
        st = SimpleNamespace(st_mtimespec=SimpleNamespace(), st_ctimespec=SimpleNamespace(),
                             st_atimespec=SimpleNamespace())  # fmt: skip
        self.fill_stat(self._eid(path), st)
        t = st.st_mtimespec.tv_sec * 10**9 + st.st_mtimespec.tv_nsec
        keys = ("st_mode", "st_ino", "st_nlink", "st_size", "st_uid", "st_gid", "st_blocks")
        return {**{k: getattr(st, k) for k in keys}, "st_mtime": t, "st_ctime": t, "st_atime": t}

    def readdir(self, path: str, fh):
        """mfusepy's list form: its presence makes mfusepy register readdir, and FastFUSE._readdir
        (attributes and offsets straight into libfuse's buffer) serves every listing instead."""
        ix = self.index
        eid = self._eid(path)
        if ix.kind[eid] != DIR:
            raise OSError(errno.ENOTDIR, "")
        self.stats.requests["readdir"] += 1
        names = [".", ".."]
        names.extend(ix.name(c) for c in ix.children(eid))
        return names

    def readlink(self, path: str) -> str:
        self.stats.requests["readlink"] += 1
        eid = self._eid(path)
        if self.index.kind[eid] != SYMLINK:
            raise OSError(errno.EINVAL, "")
        try:
            target = self.reader.readlink(eid)
            if not target:  # no file system holds one (ln -s "" fails); followed, it acts as "."
                raise CorruptMemberError("symbolic link with an empty target", self.index.paths[eid])
            return target
        except CdmlfsError as exc:
            raise self._fail(exc, f"readlink {path}", eid) from None

    def open(self, path: str, fi) -> int:
        """Per-open flags, or ENOSYS so the kernel stops sending OPEN (and RELEASE) at all.

        With ``direct_io_min`` unset the kernel's no-open mode is used: files are
        opened with the page cache kept and no round trip to us. Otherwise every
        open costs a call here, which sets ``direct_io`` for large members.
        """
        if self.direct_io_min is None:
            return -errno.ENOSYS  # returned, not raised: mfusepy logs a traceback per raised errno (-v)
        eid = self._eid(path)
        if self.index.kind[eid] == DIR:
            raise OSError(errno.EISDIR, "")
        self.stats.requests["open"] += 1
        with self._open_lock:  # a gauge: a lost update under the multithreaded loop would stay
            self.stats.open_files += 1
        fi.fh = eid
        fi.keep_cache = 1
        if self.index.size[self.index.data_entry(eid)] >= self.direct_io_min:
            fi.direct_io = 1
        return 0

    def _release(self, path: str | None, fi) -> int:
        with self._open_lock:
            self.stats.open_files -= 1
        return 0

    def read(self, path: str | None, size: int, offset: int, fi) -> bytes:
        """mfusepy's bytes form (FastFUSE.read calls ``read_into`` with libfuse's buffer instead)."""
        buf = bytearray(size)
        n = self.read_into(fi.fh or self._eid(path), size, offset, buf)
        return bytes(buf[:n])

    def read_into(self, eid: int, size: int, offset: int, out) -> int:
        """The FUSE read hot path: bytes land directly in libfuse's reply buffer."""
        self.stats.requests["read"] += 1
        try:
            n = self.reader.read_into(eid, offset, size, out)
        except CdmlfsError as exc:
            raise self._fail(exc, f"read {self.index.paths[eid]!r}", eid) from None
        self.stats.bytes_served += n
        return n

    def statfs(self, path: str) -> dict:
        if self._total_bytes is None:
            self._total_bytes = self.index.total_file_bytes()
        return {
            "f_bsize": 4096,
            "f_frsize": 4096,
            "f_blocks": (self._total_bytes + 4095) // 4096,
            "f_bfree": 0,
            "f_bavail": 0,
            "f_files": len(self.index),
            "f_ffree": 0,
            "f_favail": 0,
            "f_namemax": 255,
        }

    # -- live stats (cdmlfs stats MNT asks the mount root, see cdmlfs.statsio) -------------------
    # No getxattr handler: libfuse answers ENOSYS and the kernel stops forwarding getxattr, so
    # ls -l costs no round trip per file for ACLs and labels. listxattr stays (an empty list):
    # without it tar --xattrs warned "Cannot flistxattr" for every file; only such copiers ask.
    def listxattr(self, path: str) -> list[str]:
        return []

    def ioctl(self, path: str | None, cmd: int, arg, fh, flags: int, data) -> int:
        if cmd != statsio.REQUEST or path != "/" or not data:
            raise OSError(errno.ENOTTY, "")
        buf = memoryview((ctypes.c_char * statsio.CHUNK).from_address(data)).cast("B")
        statsio.fill_reply(*self._stats_blob_now(), buf)
        return 0

    def _stats_blob_now(self) -> tuple[bytes, int]:
        """The current snapshot as JSON, and its number (one per renewal)."""
        with self._stats_lock:  # threads of a multithreaded loop renew it one at a time
            now = time.monotonic()
            # A reader asks for each chunk of one snapshot microseconds apart: answer them from it.
            # Kept 50 ms, not longer: 'cdmlfs stats' run twice in a row must see what happened between.
            if self._stats_blob is None or now - self._stats_time > 0.05:
                self._stats_blob = json.dumps(self.snapshot(), sort_keys=True).encode()
                self._stats_time = now
                self._stats_number += 1
            return self._stats_blob, self._stats_number

    def snapshot(self) -> dict:
        """Everything ``cdmlfs stats`` shows, as plain JSON-able values."""
        archive = self.archive
        cache = archive.cache
        st = self.stats
        requests = dict(st.requests)
        served = st.bytes_served
        from_source = self.reader.bytes_direct + getattr(archive.source, "bytes_read", 0)
        fast = self.fast_table.stats() if self.fast_table is not None else None
        if fast is not None:
            fast["hot_extents"] = self.fast_table.hot_extents
            requests["getattr"] += fast["getattr_fast"]
            requests["read"] += fast["read_fast"]
            requests["readdir"] += fast["readdir_fast"]
            served += fast["bytes_fast"]
            from_source += fast["bytes_source"]
        lookups = cache.stats.hits + cache.stats.misses
        source_stats = getattr(archive.source, "stats", None)
        decoder_stats = getattr(getattr(archive.format, "stream", None), "stats", None)
        return {
            "archive": archive.location,
            "format": archive.format.name,
            "entries": len(self.index) - 1,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - st.started, 1),
            "serving": self.serving,
            "fast_path": fast,
            "loop": fuseloop.stats() if self.polling_loop else None,
            "cache": {
                "limit": cache.limit,
                "held": cache.held,
                "reserved": cache.reserved,
                "extents": len(cache),
                "hits": cache.stats.hits,
                "misses": cache.stats.misses,
                "hit_rate": round(cache.stats.hits / lookups, 4) if lookups else None,
                "evictions": cache.stats.evictions,
                "inserted_bytes": cache.stats.inserted_bytes,
                "uncacheable": cache.stats.uncacheable,  # values larger than the cache could ever hold
            },
            "bytes": {"from_source": from_source, "served": served},
            "requests": requests,
            "errors": dict(st.errors),
            "open_files": st.open_files if self.direct_io_min is not None else None,
            "index_bytes": self._index_bytes,
            "rss_bytes": _rss_bytes(),
            "source": source_stats() if callable(source_stats) else None,
            "decoder": decoder_stats() if callable(decoder_stats) else None,
        }


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _eio_on_error(func):
    """``func`` (a FUSE callback) with anything but an OSError logged with its traceback as EIO."""

    @functools.wraps(func)
    def guarded(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except OSError:
            raise
        except Exception as exc:
            what = args[0].decode("utf-8", "surrogateescape") if args and isinstance(args[0], bytes) else ""
            log.exception("%s %r failed on an internal error (answered EIO): %r", func.__name__, what, exc)
            raise OSError(errno.EIO, "internal error") from None

    return guarded


def make_fuse_class(mfusepy):
    """An mfusepy.FUSE subclass whose hot callbacks skip the dict round-trips."""

    c_stat = mfusepy.c_stat
    stat_size = ctypes.sizeof(c_stat)
    memset = ctypes.memset
    c_char = ctypes.c_char
    c_void_p = ctypes.c_void_p
    cast = ctypes.cast
    fuse3 = mfusepy.fuse_version_major == 3

    class FastFUSE(mfusepy.FUSE):
        def __init__(self, *args, **kwargs) -> None:
            self._guarded: dict = {}  # callback -> its _eio_on_error guard (mfusepy mounts in __init__)
            super().__init__(*args, **kwargs)

        def _wrapper(self, func, *args, **kwargs):
            # mfusepy answers EINVAL to any exception that is not an OSError: a bug of ours (a
            # ValueError, a MemoryError) would read as a bad argument. Readers get EIO, the log the
            # traceback; the daemon goes on serving the other files. The guard keeps the callback's
            # name, which mfusepy's own logging goes by.
            guarded = self._guarded.get(func)
            if guarded is None:
                guarded = self._guarded[func] = _eio_on_error(func)
            return super()._wrapper(guarded, *args, **kwargs)

        def init_fuse_3(self, conn, config):
            try:
                return super().init_fuse_3(conn, config)
            except BaseException:
                mfusepy.fuse_exit()  # without init the mount would serve but never say it is ready
                raise

        def init_fuse_2(self, conn):
            try:
                return super().init_fuse_2(conn)
            except BaseException:
                mfusepy.fuse_exit()
                raise

        def fgetattr(self, path, buf, fip):
            ops = self.operations
            memset(buf, 0, stat_size)
            if fip:
                eid = fip.contents.fh
                if not eid and path is not None:
                    eid = ops._eid(path.decode("utf-8", "surrogateescape"))
            else:
                eid = ops._eid(path.decode("utf-8", "surrogateescape"))
            ops.stats.requests["getattr"] += 1
            if ops.index.flags[eid] & INCONSISTENT:
                try:
                    ops.reader.check_consistent(eid)
                except CdmlfsError as exc:
                    raise ops._fail(exc, f"stat {ops.index.paths[eid]!r}", eid) from None
            ops.fill_stat(eid, buf.contents)
            return 0

        def read(self, path, buf, size, offset, fip):
            ops = self.operations
            fi = fip.contents
            eid = fi.fh or ops._eid(path.decode("utf-8", "surrogateescape"))
            out = (c_char * size).from_address(cast(buf, c_void_p).value)
            return ops.read_into(eid, size, offset, out)

        def _readdir(self, path, buf, filler, offset, fip, flags=0):
            ops = self.operations
            ix = ops.index
            eid = ops._eid(path.decode("utf-8", "surrogateescape"))
            if ix.kind[eid] != DIR:
                return -errno.ENOTDIR
            ops.stats.requests["readdir"] += 1
            st = c_stat()
            plus = fuse3 and flags & _FUSE_READDIR_PLUS
            fill_flags = _FUSE_FILL_DIR_PLUS if plus else 0
            # Entry k (0 ".", 1 "..", 2 + j child j) goes with the offset of the next, k + 1, as in
            # native/fastpath.c (a listing may switch between the two): libfuse then streams it and
            # gives READDIRPLUS entries node ids (with offset 0 the kernel dropped their attributes).
            k = max(offset, 0)
            dots = ((b".", eid), (b"..", ix.parent[eid]))  # the root is its own parent
            for pos, (name, child) in enumerate(dots):
                if pos < k:
                    continue
                ops.fill_stat(child, st)
                if (filler(buf, name, st, pos + 1, 0) if fuse3 else filler(buf, name, st, pos + 1)) != 0:
                    return 0
            paths = ix.paths
            flags_of = ix.flags
            kids = ix.children(eid)
            for j in range(max(k - 2, 0), len(kids)):
                child = kids[j]
                memset(ctypes.byref(st), 0, stat_size)
                ops.fill_stat(child, st)
                name = paths[child].rpartition("/")[2].encode("utf-8", "surrogateescape")
                # No attributes for an entry that fails its stat: the kernel then asks (and gets EIO).
                child_flags = 0 if flags_of[child] & INCONSISTENT else fill_flags
                rc = filler(buf, name, st, j + 3, child_flags) if fuse3 else filler(buf, name, st, j + 3)
                if rc != 0:
                    break
            return 0

        def readdir_fuse_2(self, path, buf, filler, offset, fip):
            return self._readdir(path, buf, filler, offset, fip)

        def readdir_fuse_3(self, path, buf, filler, offset, fip, flags):
            return self._readdir(path, buf, filler, offset, fip, flags)

    return FastFUSE
