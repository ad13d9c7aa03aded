"""Persisted archive indexes: one file per archive, keyed by the source's identity.

Building a tar index means reading every header of the archive (for tar.zst:
decoding all of it). The result is saved here so a remount is instant. The
store knows nothing about local files: it is keyed by
``SourceIdentity.key()`` (location + size + mtime for a file; an S3 source
would put its ETag in the version), so remote sources reuse it unchanged.

Never trusted blindly: a file is used only if its magic, format version,
length, CRC-32 and the full identity key stored inside all match; anything
else is treated as absent (and overwritten by the rebuilt index). Writes go
to a temporary file in the same directory, then ``os.replace``: readers see
the old file or the new one, never half of one.

File layout::

    magic "CDMLFSIX" | u16 version | u16 flags | u32 crc32(body) | u64 len(body)
    body = zstd( u32 len(key) | key utf-8 | u32 len(kind) | kind | payload )
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
import struct
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from typing import ClassVar

import zstandard

from cdmlfs import forksafe, xdg
from cdmlfs.errors import ArchiveFormatError, CorruptMemberError, MemberError, UsageError, WindowLimitError
from cdmlfs.safe_write import private_temp_dir
from cdmlfs.sources.base import SourceIdentity

log = logging.getLogger(__name__)

MAGIC = b"CDMLFSIX"
# 2: hard links take their target's mode and mtime, link counts from the paths that remain.
# 3: a lone zero block ends the listing (as GNU tar).
# 4: symlink, device and fifo headers skip the bytes their size declares (as GNU tar).
# 5: sparse files are members with their data segments (a version 4 scan skipped them).
# Older files are rebuilt, never trusted.
VERSION = 5
HEADER = struct.Struct("<8sHHIQ")
MAX_INDEX_FILE = 4 << 30
HEAD_BYTES = 4096  # what decompress_bounded decodes before asking how long the whole is
STALE_TEMP_SECONDS = 3600  # a temporary file this old was left by a save that was killed
# An index not used for this long is removed (with its lock and note files) when another is saved:
# archives written to fresh paths (a pipeline's temporary ones) each left an index for ever.
UNUSED_SECONDS = 30 * 86400
TOUCH_AFTER_SECONDS = 86400  # a load marks its file used (its mtime) at most once a day
# Only names path_for gives (or gave, before they carried the uid): --index-dir may name any folder,
# and other tools' ".idx" files there (DALI's TFRecord indexes) are not ours to remove.
_OWN_NAME = re.compile(r".+-[0-9a-f]{16}(-u[0-9]+)?\.idx(\.lock|\.failed)?")
# No link followed (a link planted in a shared directory), no FIFO waited on, no terminal made
# the controlling one of a session leader that has none (a container's PID 1).
_OPEN_FLAGS = os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NOCTTY


def default_index_dir() -> str:
    """``$XDG_CACHE_HOME/cdmlfs/index``, else ``~/.cache/cdmlfs/index``."""
    base = xdg.base_dir("XDG_CACHE_HOME", ".cache")
    return os.path.join(base, "cdmlfs", "index")


def decompress_bounded(
    data: bytes, limit: int, length_of: Callable[[bytes], int] | None = None
) -> bytes | bytearray:
    """The first zstd frame of ``data`` decoded; ValueError if it is damaged or decodes to more
    than ``limit`` bytes.

    ``length_of``, given the first few KB of the output, says how long the whole must be (a format
    whose header states it): decoding stops there, so a forged header cannot make it run on.

    python-zstandard's ``decompress(max_output_size=N)`` reserves N bytes up front for a frame that
    does not state its size: with a limit of gigabytes that fails under an address-space limit or
    strict overcommit (a MemoryError, not a rebuild). Such frames are read in pieces instead, into
    one buffer that is returned as it is (a copy at the end doubled the peak).
    """
    try:
        size = zstandard.frame_content_size(data)
        if size > limit:
            raise ValueError(f"it declares {size} bytes, more than {limit}")
        if size >= 0 and length_of is None:
            return zstandard.ZstdDecompressor().decompress(data)
        reader = zstandard.ZstdDecompressor().stream_reader(data)
        out = bytearray()
        if length_of is not None:
            while len(out) < HEAD_BYTES and (chunk := reader.read(HEAD_BYTES - len(out))):
                out += chunk
            expected = length_of(bytes(out))
            if expected > limit:
                raise ValueError(f"it declares {expected} bytes, more than {limit}")
            if size >= 0 and size != expected:
                raise ValueError(f"it declares {expected} bytes, its zstd frame {size}")
            limit = expected
        if len(out) > limit:
            raise ValueError(f"it decodes to more than {limit} bytes")
        while chunk := reader.read(min(1 << 20, limit + 1 - len(out))):
            out += chunk
            if len(out) > limit:
                raise ValueError(f"it decodes to more than {limit} bytes")
        if length_of is not None and len(out) != limit:
            raise ValueError(f"it decodes to {len(out)} bytes, not the {limit} it declares")
        return out
    except zstandard.ZstdError as exc:
        raise ValueError(f"undecodable ({exc})") from None
    except MemoryError:
        raise ValueError("too large for the memory available") from None


def _usable_dir(path: str) -> bool:
    """``path`` exists or can be made, and this user can write files in it."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


class IndexStore:
    """A directory of persisted indexes. ``load``/``save`` never raise for I/O problems: they log."""

    def __init__(self, directory: str | os.PathLike | None = None, enabled: bool = True) -> None:
        # Disabled for sources whose identity says nothing of their bytes (a block device: another
        # medium behind the same node read through the old index): nothing is loaded nor saved.
        self.enabled = enabled
        # Why an index file was not used, said once: an open checks again after its build lock.
        self._told: set[tuple[str, str]] = set()
        self.directory = os.fspath(directory) if directory else default_index_dir()
        if directory and os.path.exists(self.directory) and not os.path.isdir(self.directory):
            # Asked for by name (--index-dir): a mistake worth one clear line, not a warning per use.
            raise UsageError(f"index directory {self.directory}: not a directory")
        if not directory and not _usable_dir(self.directory):
            # A read-only or missing home (HOME=/ in a container run under any uid): every mount
            # scanned again. A private folder in the temporary directory keeps the indexes instead.
            fallback = private_temp_dir()
            if fallback is not None:
                self.directory = os.path.join(fallback, "index")

    def path_for(self, identity: SourceIdentity) -> str:
        """One file per archive location and user: the base name (for humans), 64 bits of a
        location hash, the user id.

        Size and mtime (or ETag) are checked inside the file, so a changed
        archive's index is overwritten in place instead of piling up. The user id: only a
        user's own files are trusted, and in a directory shared by users (a sticky /tmp-like
        one) a second user could neither use nor replace the first one's file, and scanned
        at every open.
        """
        loc = identity.location.encode("utf-8", "surrogateescape")
        digest = (zlib.crc32(loc) << 32) | zlib.adler32(loc[::-1])
        base = os.path.basename(identity.location.rstrip("/")) or "archive"
        base = "".join(c if c.isalnum() or c in "._-" else "_" for c in base)[:80]
        return os.path.join(self.directory, f"{base}-{digest:016x}-u{os.geteuid()}.idx")

    @contextlib.contextmanager
    def building(self, identity: SourceIdentity) -> Iterator[BuildTurn]:
        """Held while this archive's index is built and saved (an advisory lock beside its file).

        Why: eight training processes (DDP ranks, mounts on one node) opening the same
        archive for the first time each scanned all of it at once. With the lock, one
        scans; the others wait, then load what it saved (the caller loads again inside).
        The kernel drops the lock of a process that dies; a forked child lets go of its
        copy at once (see :class:`_BuildLock`). No lock can be had (directory not
        writable, a file system without locks): build without one.

        A build that fails on the archive's content (not a tar, corrupt data) leaves a note
        for the processes that waited meanwhile (:meth:`BuildTurn.raise_noted_failure`): they
        failed one after another, each after a scan of its own. A later open scans again.
        """
        path = self.path_for(identity)
        if not self.enabled:
            yield BuildTurn(path + ".failed", identity, False)  # no lock, no notes
            return
        taken = _BuildLock.take(path + ".lock", self.directory, identity.location)
        lock, waited = taken if taken is not None else (None, False)
        turn = BuildTurn(path + ".failed", identity, waited)
        try:
            yield turn
        except (ArchiveFormatError, MemberError) as exc:
            if lock is not None and not isinstance(exc, WindowLimitError):  # the archive is fine
                turn.note_failure(exc)
            raise
        else:
            turn.clear()
        finally:
            if lock is not None:
                lock.release()

    def load(self, identity: SourceIdentity, kind: str) -> bytes | None:
        """The payload saved for exactly this identity and kind, or None (absent, stale or corrupt)."""
        if not self.enabled:
            return None
        path = self.path_for(identity)
        got = self._load_path(path, identity, kind)
        if got is _ABSENT:  # saved before names carried the uid: as good, when it is ours
            got = self._load_path(_unnamed(path), identity, kind)
        return None if got is _ABSENT else got  # type: ignore[return-value]

    def _load_path(self, path: str, identity: SourceIdentity, kind: str) -> bytes | object | None:
        try:
            # Non-blocking and regular files only: a FIFO (or a link to /dev/zero) put there would
            # hang the mount or feed it gigabytes.
            fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
            with open(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    log.warning("index file %s is not a regular file: rebuilding the index", path)
                    return None
                if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                    # In a shared --index-dir another user could plant an index (the key it must
                    # hold is what stat shows) that maps names to other bytes of the archive.
                    log.warning(
                        "index file %s is not this user's own (owner uid %d, mode %o): rebuilding the index",
                        path,
                        st.st_uid,
                        st.st_mode & 0o777,
                    )
                    return None
                if st.st_size > MAX_INDEX_FILE + HEADER.size:
                    log.warning("index file %s is too large to be ours: rebuilding the index", path)
                    return None
                # Its size, not the limit: read(N) reserves N bytes first, and 4 GiB at once fails
                # under an address-space limit (ulimit -v) or strict overcommit.
                raw = f.read(st.st_size)
        except FileNotFoundError:
            return _ABSENT
        except OSError as exc:
            log.warning("cannot read index file %s (%s): rebuilding the index", path, exc.strerror)
            return None
        except MemoryError:  # a huge file under an address-space limit: ours never is (rebuilt)
            log.warning("index file %s is too large to read here: rebuilding the index", path)
            return None
        try:
            payload = self._decode(raw, identity, kind)
        except ValueError as exc:
            if (path, str(exc)) not in self._told:
                self._told.add((path, str(exc)))
                log.info("ignoring index file %s: %s; rebuilding the index", path, exc)
            return None
        if time.time() - st.st_mtime > TOUCH_AFTER_SECONDS:  # used: kept from removal a while longer
            with contextlib.suppress(OSError):
                os.utime(path, follow_symlinks=False)
        return payload

    @staticmethod
    def _decode(raw: bytes, identity: SourceIdentity, kind: str) -> bytes:
        if len(raw) < HEADER.size:
            raise ValueError("truncated")
        magic, version, _flags, crc, length = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise ValueError("not an index file")
        if version != VERSION:
            raise ValueError(f"version {version} (this cdmlfs writes {VERSION})")
        body = raw[HEADER.size :]
        if len(body) != length or zlib.crc32(body) != crc:
            raise ValueError("checksum or length mismatch")
        plain = decompress_bounded(body, MAX_INDEX_FILE)
        pos = 0
        fields = []
        for _ in range(2):
            if pos + 4 > len(plain):
                raise ValueError("truncated body")
            (n,) = struct.unpack_from("<I", plain, pos)
            fields.append(plain[pos + 4 : pos + 4 + n])
            pos += 4 + n
        if fields[0] != identity.key().encode("utf-8", "surrogateescape"):
            raise ValueError("it describes another version of the archive (stale)")
        if fields[1] != kind.encode():
            raise ValueError(f"it holds a {fields[1].decode(errors='replace')} index, not {kind}")
        return plain[pos:]

    def save(self, identity: SourceIdentity, kind: str, payload: bytes) -> str | None:
        """Write atomically; returns the path, or None when the directory is not writable (or disabled)."""
        if not self.enabled:
            return None
        key = identity.key().encode("utf-8", "surrogateescape")
        kind_b = kind.encode()
        plain = struct.pack("<I", len(key)) + key + struct.pack("<I", len(kind_b)) + kind_b + payload
        body = zstandard.ZstdCompressor(level=3).compress(plain)
        header = HEADER.pack(MAGIC, VERSION, 0, zlib.crc32(body), len(body))
        path = self.path_for(identity)
        tmp = None
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".idx", dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            self._remove_leftovers()
            self._remove_unnamed_by_user(path)
        except OSError as exc:
            log.warning(
                "cannot save the archive index in %s (%s): the next open will scan again",
                self.directory,
                exc.strerror or exc,
            )
            return None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        return path

    def _remove_leftovers(self) -> None:
        """This user's files nobody will use: temporary files of saves that were killed (OOM killer,
        a pod's grace period over; each was a whole index) once old enough that no save is writing,
        and indexes not loaded for UNUSED_SECONDS (archives that are gone, or no longer opened), with
        their lock and note files."""
        now = time.time()
        uid = os.geteuid()
        with contextlib.suppress(OSError), os.scandir(self.directory) as it:
            for entry in it:
                temp = entry.name.startswith(".tmp-") and entry.name.endswith(".idx")
                if not temp and not _OWN_NAME.fullmatch(entry.name):
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                        continue
                    age = now - st.st_mtime
                    # A lock or note goes with its index (the lock of an index in use is old too).
                    unused = age > UNUSED_SECONDS and (
                        entry.name.endswith(".idx") or _unused_since(_index_of(entry.path), now)
                    )
                    if (age > STALE_TEMP_SECONDS) if temp else unused:
                        os.unlink(entry.path)

    @staticmethod
    def _remove_unnamed_by_user(path: str) -> None:
        """The same archive's index under the name cdmlfs gave it before names carried the user
        id: read only while no file has the new name, so removed once that is saved (if ours)."""
        old = _unnamed(path)
        if old == path:
            return
        with contextlib.suppress(OSError):
            st = os.lstat(old)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(old)


_ABSENT = object()  # no file at a path (as opposed to a file that is not usable)


def _unused_since(path: str, now: float) -> bool:
    """Whether the index file at ``path`` is gone or unused for UNUSED_SECONDS."""
    try:
        return now - os.stat(path, follow_symlinks=False).st_mtime > UNUSED_SECONDS
    except OSError:
        return True


def _index_of(path: str) -> str:
    """The index file a lock or note file belongs to."""
    return path.rsplit(".idx.", 1)[0] + ".idx"


def _unnamed(path: str) -> str:
    """The name an index had before names carried the user id (``...-uUID.idx`` without it)."""
    head, sep, _ = path.rpartition("-u")
    return head + ".idx" if sep else path


class BuildTurn:
    """One process's turn at building an index (see :meth:`IndexStore.building`)."""

    _KINDS: ClassVar[dict[str, type[Exception]]] = {
        "ArchiveFormatError": ArchiveFormatError,
        "CorruptMemberError": CorruptMemberError,
    }

    def __init__(self, note: str, identity: SourceIdentity, waited: bool) -> None:
        self.note = note
        self.key = identity.key()
        self.waited = waited  # another process held the lock when this one asked

    def note_failure(self, exc: Exception) -> None:
        kind = type(exc).__name__ if type(exc).__name__ in self._KINDS else "ArchiveFormatError"
        text = f"{self.key}\n{kind}\n{exc}"
        with contextlib.suppress(OSError):
            fd = os.open(self.note, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN_FLAGS, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
                f.write(text)

    def clear(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.note)

    def raise_noted_failure(self) -> None:
        """Raise the failure the process we waited for noted for this very archive, if any."""
        if not self.waited:
            return
        try:
            fd = os.open(self.note, os.O_RDONLY | _OPEN_FLAGS)
            with os.fdopen(fd, encoding="utf-8", errors="surrogateescape") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > 64 << 10:
                    return
                key, kind, message = [*f.read().split("\n", 2), "", ""][:3]
        except OSError:
            return
        if key == self.key and kind in self._KINDS:
            raise self._KINDS[kind](f"{message} (found by another process indexing it at the same time)")


class _BuildLock:
    """An ``flock`` on a lock file, held while one index is built.

    An flock belongs to the open file, which a forked child shares: a DataLoader forked while
    another thread scanned kept the lock held for the child's whole life (the processes waiting
    for it waited that long), and a child that opened the same archive waited on its own copy
    for ever. So a child closes its copy at once (a forksafe hook).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        forksafe.register(self)

    @classmethod
    def take(cls, path: str, directory: str, location: str) -> tuple[_BuildLock, bool] | None:
        """The lock, and whether another process held it first; None: no lock to be had."""
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o600)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            # Planted by another user in a shared directory (with fs.protected_regular off, the open
            # succeeds): holding an flock on it kept this user's every open waiting for ever.
            os.close(fd)
            log.warning("lock file %s is not this user's own: indexing without it", path)
            return None
        waited = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.warning("%s: another process is indexing it; waiting to use its index", location)
                waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no locks on this file system (ENOLCK, some network ones): build without
            os.close(fd)
            return None
        except BaseException:  # interrupted while waiting (Ctrl-C)
            os.close(fd)
            raise
        return cls(fd), waited

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _after_fork_child(self) -> None:
        self.release()
