"""A local archive file read with positioned reads on one descriptor."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import threading
from collections import deque
from collections.abc import Callable

from cdmlfs import forksafe
from cdmlfs.errors import ArchiveNotFoundError, SourceChangedError, SourceError, UsageError
from cdmlfs.sources.base import SourceIdentity

FINGERPRINT_END = 64 << 10  # bytes hashed at each end of the file (see _fingerprint)
FINGERPRINT_SAMPLE = 4 << 10  # and at 16 places between
# Out of descriptors or memory: the process's state, not a bad path (a loader skipping bad samples
# on EINVAL would have dropped every later one).
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})
RETIRED_MAX = 64  # descriptor numbers of closed files kept pointing at /dev/null (see LocalFile.close)

log = logging.getLogger(__name__)


class LocalFile:
    """``os.pread`` on a single descriptor: thread-safe without locks, no seek state."""

    prefers_threads = False

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        try:
            # O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever (refused below).
            # The path as given, as open() takes it: abspath drops the "/" of "a.zip/" (ENOTDIR).
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise ArchiveNotFoundError(f"{path}: no such file") from None
        except OSError as exc:
            if exc.errno in _RESOURCE_ERRNOS:  # not the user's mistake: keep the errno (EMFILE, ...)
                error = SourceError(f"{path}: cannot open: {exc.strerror}")
                error.errno = exc.errno
                raise error from None
            raise UsageError(f"{path}: cannot open: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):  # open(O_RDONLY) of a directory succeeds: EISDIR never comes
                raise UsageError(
                    f"{path}: is a directory, not an archive"
                    f" (`cdmlfs pack {path} OUT.tar.zst` makes one of it)"
                )
            if not stat.S_ISREG(st.st_mode) and not stat.S_ISBLK(st.st_mode):
                raise UsageError(f"{path}: not a regular file")
            os.set_blocking(fd, True)  # pread ignores it on files; keep the descriptor ordinary anyway
            self.size = st.st_size if stat.S_ISREG(st.st_mode) else os.lseek(fd, 0, os.SEEK_END)
            # A block device's node says nothing of the medium behind it (another loop image, another
            # stick of the same size): its tar index is not persisted.
            self.persist_index = stat.S_ISREG(st.st_mode)
        except OSError as exc:
            os.close(fd)
            raise UsageError(f"{path}: cannot open: {exc.strerror}") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        # mtime alone missed a file rewritten in place or replaced by a same-sized one with its
        # mtime put back (touch -r): a persisted tar index was then trusted for other bytes. The
        # inode changes when a file is replaced, the ctime on any write (and touch cannot set it);
        # the ctime keys the saved index only, since chmod moves it too (see SourceIdentity).
        # Not the device number: NFS clients each number the same export differently, and nodes
        # sharing a home then took each other's saved index for stale, each scanning again.
        self.identity = _identity(self.path, st, self.size)
        self._index_identity: SourceIdentity | None = None
        self.mtime = st.st_mtime
        self.bytes_read = 0  # through read_at (for cdmlfs stats)
        # What a write in place changes: size, mtime_ns, ctime_ns (see check_unchanged); a block
        # device keeps no such record.
        self.stamp: tuple[int, int, int] | None = None
        self._sampled = ""  # _fingerprint at open: tells a touch from a write of other bytes
        if stat.S_ISREG(st.st_mode):
            self.stamp = _stamp(st)
            self._sampled = _fingerprint(fd, self.size)
        self.on_restamp: list[Callable[[int, int, int], object]] = []  # told a new stamp kept
        self._changed: str | None = None
        self._stamp_lock = threading.Lock()

    def fileno(self) -> int | None:
        return self._fd

    def index_identity(self) -> SourceIdentity:
        """What keys this file's saved index: ``identity`` with a hash of sampled bytes (see
        ``_fingerprint``), read once, when a format that saves an index first asks (a ZIP never does)."""
        if self._index_identity is None:
            fingerprint = self._sampled or _fingerprint(self._fd, self.size)  # sampled at open
            changed = f"{self.identity.changed}.{fingerprint}" if fingerprint else self.identity.changed
            self._index_identity = self.identity._replace(changed=changed)
        return self._index_identity

    def probe_identity(self) -> SourceIdentity:
        """What the path holds now (a stat): a different identity means a new open reads other bytes."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise ArchiveNotFoundError(f"{self.path}: no such file") from None
        except OSError as exc:
            raise UsageError(f"{self.path}: cannot stat: {exc.strerror}") from None
        return _identity(self.path, st, st.st_size if stat.S_ISREG(st.st_mode) else self.size)

    def check_unchanged(self) -> None:
        """Raise SourceChangedError (from then on, every time) once the file was written in place.

        The reader calls it after each read: a file rewritten under a mount (``cp new.zip
        data.zip``) gave wrong bytes wherever a checksum was not checked again (a verified
        stored member, a deflate interval decoded again after eviction). A write moves the
        mtime and ctime (and the size, mostly) before its data lands, so a read whose bytes it
        touched sees the change here, after its pread; a file replaced by rename leaves ours as
        it was. The ctime because ``touch -d`` can put the mtime back after a write (and then a
        read pass gave old bytes, then new ones), but nothing sets the ctime. A ``chmod``, a
        ``touch`` or a hard link move it too: when the size and the bytes sampled at open are the
        same, reads go on.
        """
        if self._changed is None:
            fd = self._fd
            if self.stamp is None or fd < 0:
                return
            try:
                st = os.fstat(fd)
            except OSError:
                return  # the read itself says what is wrong
            if _stamp(st) == self.stamp:
                return
            with self._stamp_lock:  # one thread samples the file again; the others wait for its verdict
                if self._changed is None and _stamp(st) != self.stamp:
                    self._judge(fd, st)
            if self._changed is None:
                return
        raise SourceChangedError(self._changed)

    def _judge(self, fd: int, st: os.stat_result) -> None:
        """A new size, mtime or ctime: a touch, a chmod (or the same bytes copied over, cp -p)
        keeps the samples of the file taken at open, and is let be; anything else is a change."""
        if self._fd < 0:  # closed meanwhile: the number may read /dev/null now
            return
        size = self.stamp[0]  # type: ignore[index]
        if st.st_size == size and self._sampled and _fingerprint(fd, size) == self._sampled:
            self.stamp = _stamp(st)
            log.info("%s: its mtime or ctime moved, its bytes did not (sampled): reads go on", self.path)
            for hook in self.on_restamp:
                hook(*self.stamp)
            return
        how = f"{size} -> {st.st_size} bytes" if st.st_size != size else "other bytes, the same size"
        self._changed = (
            f"{self.path}: the archive was written to after it was opened ({how}); its reads fail "
            "from now on rather than mix old and new bytes: remount (or open it again)"
        )
        log.error("%s", self._changed)

    def read_at(self, offset: int, length: int) -> bytes:
        if self._fd < 0:
            raise SourceError(f"{self.path}: the archive was closed")
        if offset < 0 or length < 0 or offset + length > self.size:
            raise SourceError(
                f"{self.path}: read of {length} bytes at {offset} is outside the file ({self.size} bytes)"
            )
        self.bytes_read += length
        parts: list[bytes] = []
        got = 0
        while True:  # one pread, but for a short one: at EOF, so the file shrank under us
            try:
                data = os.pread(self._fd, length - got, offset + got)
            except OSError as exc:
                where = f"{self.path}: read failed at offset {offset + got}"
                raise SourceError(f"{where}: {exc.strerror}") from exc
            got += len(data)
            if got == length:
                return b"".join((*parts, data)) if parts else data
            if not data:
                if self._fd < 0:  # closed during the read: its descriptor now reads /dev/null
                    raise SourceError(f"{self.path}: the archive was closed")
                raise SourceError(f"{self.path}: file is shorter than when it was opened")
            parts.append(data)

    def close(self) -> None:
        """Close the file, without freeing its descriptor number under a read in flight.

        Readers in other threads (and the C paths, which are given the number) may be
        between taking the number and their pread. Freed at once, the next ``open()``
        anywhere in the process got it, and such a read returned that file's bytes as
        the member's. So the number is pointed at /dev/null instead (a read in flight
        sees end of file and fails) and freed only after ``RETIRED_MAX`` later closes.
        """
        _retired.retire(self)

    def __repr__(self) -> str:
        return f"LocalFile({self.path!r}, size={self.size})"


class _RetiredDescriptors:
    """Descriptor numbers of closed archives, each a /dev/null reader until enough closes follow."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: deque[int] = deque()
        forksafe.register(self)

    def retire(self, file: LocalFile) -> None:
        """Take ``file``'s descriptor (once, whichever thread closes first) and keep its number."""
        with self._lock:
            fd, file._fd = file._fd, -1
        if fd < 0:
            return
        try:
            null = os.open(os.devnull, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # out of descriptors: free the number as before rather than fail the close
            os.close(fd)
            return
        try:
            os.dup2(null, fd, inheritable=False)  # one step: the number is never free meanwhile
        except OSError:
            os.close(fd)
            return
        finally:
            os.close(null)
        with self._lock:
            self._fds.append(fd)
            expired = [self._fds.popleft() for _ in range(len(self._fds) - RETIRED_MAX)]
        for old in expired:
            os.close(old)

    def _after_fork_child(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it at the fork


_retired = _RetiredDescriptors()


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _identity(path: str, st: os.stat_result, size: int) -> SourceIdentity:
    return SourceIdentity(path, size, f"{st.st_mtime_ns}.{st.st_ino}", str(st.st_ctime_ns))


def _fingerprint(fd: int, size: int) -> str:
    """A hash of some of the file's bytes: its first and last 64 KiB and 4 KiB at 16 places between.

    Why: the saved index is keyed by size, mtime, inode and ctime, and where the ctime is only the
    mtime (sshfs, and FUSE mounts such as cdmlfs's own: a tar inside a mounted zip) and inode
    numbers are handed out in order, another archive at the same path matched all four, and its
    members were read through the old index (wrong bytes, no error). Some 200 KiB read at open
    tell such archives apart.
    """
    h = hashlib.blake2b(digest_size=12)
    spots = [(0, FINGERPRINT_END)]  # in file order: a reader decoding as it goes passes once
    spots += [(size * i // 17, FINGERPRINT_SAMPLE) for i in range(1, 17)]
    spots.append((max(0, size - FINGERPRINT_END), FINGERPRINT_END))
    try:
        for offset, length in spots:
            h.update(os.pread(fd, min(length, max(0, size - offset)), offset))
    except OSError:
        return ""  # the key falls back to the stat fields (the read that fails later says why)
    return h.hexdigest()
