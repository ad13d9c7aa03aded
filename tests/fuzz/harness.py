"""Fuzz targets: open bytes as an archive through the real path, list everything, read everything.

The contract every target checks (a violation is a *finding*):

* only :class:`~cdmlfs.errors.CdmlfsError` subclasses may escape the core —
  any other exception (IndexError, struct.error, UnicodeError, ValueError,
  RecursionError, MemoryError, ...) is a bug: the FUSE layer would turn it into
  a crash or a wrong errno, the CLI into a traceback;
* a read returns exactly ``min(size, member_size - offset)`` bytes or raises:
  short results would be silently wrong file contents;
* the same bytes come back whichever way they are asked for (whole member,
  sub-range, ``read_into``), i.e. the cache and the decoders agree;
* the drivers add the rest: a time bound per input (libFuzzer ``-timeout`` or
  :func:`time_limit`) and a memory bound (``RLIMIT_AS`` plus peak-RSS growth
  per input).

Archives are opened from memory (:class:`MemorySource`, the Source protocol
without a file descriptor: pure-Python decode paths) or, for every other
input, from a file on tmpfs (:class:`~cdmlfs.sources.local.LocalFile`: the
native pread+inflate paths), chosen by a bit of the input's CRC so a finding
replays identically. Persisted tar indexes go to an in-memory store (no
fsync per input); the ``index`` target feeds its bytes to that store's load.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import ClassVar

from cdmlfs.archive import Archive
from cdmlfs.errors import CdmlfsError, SourceError
from cdmlfs.formats import tar as tarfmt
from cdmlfs.index import DIR, SYMLINK
from cdmlfs.index_store import BuildTurn
from cdmlfs.sources.base import SourceIdentity
from cdmlfs.sources.local import LocalFile

CACHE_SIZE = 4 << 20
HEAD = 1 << 20  # bytes read from the start of each member
MAX_ENTRIES = 5000  # entries exercised per input (a mutated count field can list millions)


class InvariantError(AssertionError):
    """The core broke a promise other than 'only CdmlfsError escapes' (short read, bytes disagree)."""


class InputTimeout(BaseException):
    """One input ran past its time bound (BaseException: no ``except Exception`` may swallow it)."""


class MemorySource:
    """Bytes in memory behind the Source protocol (no fd, so decoders take their Python paths)."""

    prefers_threads = False

    def __init__(self, data: bytes, label: str = "fuzz") -> None:
        self._data = data
        self.size = len(data)
        self.identity = SourceIdentity(
            f"mem://{label}/{zlib.crc32(data):08x}", self.size, "1600000000000000000"
        )

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise SourceError(f"read of {length} bytes at {offset} is outside the source ({self.size} bytes)")
        return self._data[offset : offset + length]

    def fileno(self) -> int | None:
        return None

    def close(self) -> None:
        pass


class MemoryIndexStore:
    """Stands in for :class:`cdmlfs.index_store.IndexStore`: saves to a dict; ``feed`` injects a payload."""

    saved: ClassVar[dict[tuple[str, str], bytes]] = {}
    injected: ClassVar[dict[str, bytes]] = {}

    def __init__(self, directory=None, enabled: bool = True) -> None:
        pass

    def load(self, identity: SourceIdentity, kind: str) -> bytes | None:
        if kind in self.injected:
            return self.injected[kind]
        return self.saved.get((identity.key(), kind))

    def save(self, identity: SourceIdentity, kind: str, payload: bytes) -> str | None:
        if len(self.saved) > 64:
            self.saved.clear()
        self.saved[(identity.key(), kind)] = payload
        return None

    @contextlib.contextmanager
    def building(self, identity: SourceIdentity) -> Iterator[BuildTurn]:
        yield BuildTurn("", identity, waited=False)  # one process: nobody to wait for


@contextlib.contextmanager
def memory_index_store() -> Iterator[type[MemoryIndexStore]]:
    """Route tar index persistence to memory for the duration (restored after)."""
    real = tarfmt.IndexStore
    tarfmt.IndexStore = MemoryIndexStore  # type: ignore[misc]
    try:
        yield MemoryIndexStore
    finally:
        tarfmt.IndexStore = real  # type: ignore[misc]
        MemoryIndexStore.saved.clear()
        MemoryIndexStore.injected.clear()


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise InputTimeout in the main thread after ``seconds`` (no-op elsewhere or when None)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise InputTimeout(f"input took more than {seconds}s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# -- sources ---------------------------------------------------------------------------
_tmpfile: str | None = None


def _file_path() -> str:
    global _tmpfile
    if _tmpfile is None:
        base = os.environ.get("CDMLFS_FUZZ_SCRATCH")  # set by scripts/fuzz.py, which removes it
        if base is None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            base = "/dev/shm"
        fd, _tmpfile = tempfile.mkstemp(prefix="cdmlfs-fuzz-", suffix=".bin", dir=base)
        os.close(fd)
    return _tmpfile


def cleanup() -> None:
    """Remove the tmpfs scratch file (drivers call it at exit)."""
    global _tmpfile
    if _tmpfile is not None:
        with contextlib.suppress(OSError):
            os.unlink(_tmpfile)
        _tmpfile = None


def make_source(data: bytes, file_backed: bool | None = None):
    """In-memory or tmpfs-file source; by default chosen by the input's CRC (replays identically)."""
    if file_backed is None:
        file_backed = bool(zlib.crc32(data) & 1)
    if not file_backed:
        return MemorySource(data)
    path = _file_path()
    with open(path, "wb") as f:
        f.write(data)
    return LocalFile(path)


# -- exercising an archive -----------------------------------------------------------------
def _call(fn: Callable, *args, **kw):
    """Run one API call; documented errors are fine, anything else propagates as a finding."""
    try:
        return fn(*args, **kw)
    except CdmlfsError:
        return None


def _read_checked(reader, eid: int, offset: int, size: int, total: int) -> bytes | None:
    try:
        data = reader.read(eid, offset, size)
    except CdmlfsError:
        return None
    want = max(0, min(size, total - offset))
    if len(data) != want:
        raise InvariantError(
            f"entry {eid}: read({offset}, {size}) of a {total}-byte member gave {len(data)} bytes"
        )
    return data


def _exercise_member(ar: Archive, eid: int) -> None:
    ix = ar.index
    reader = ar.reader
    total = ix.size[ix.data_entry(eid)]
    head = _read_checked(reader, eid, 0, HEAD, total)
    if head is None:
        return
    if total > HEAD:
        _read_checked(reader, eid, total - 65536, 65536, total)
        _read_checked(reader, eid, total // 2, 4096, total)
        _read_checked(reader, eid, total, 10, total)  # at the end: empty
        return
    if len(head) > 8:
        sub = _read_checked(reader, eid, 3, 5, total)
        if sub is not None and sub != head[3:8]:
            raise InvariantError(f"entry {eid}: sub-range read disagrees with the whole-member read")
        buf = bytearray(len(head))
        try:
            n = reader.read_into(eid, 0, len(buf), buf)
        except CdmlfsError:
            return
        if n != len(head) or bytes(buf) != head:
            raise InvariantError(f"entry {eid}: read_into disagrees with read")


def exercise(ar: Archive) -> int:
    """List, stat, readlink and read everything reachable; returns the number of entries visited."""
    ix = ar.index
    visited = 0
    for eid in ix.walk(0):
        if visited >= MAX_ENTRIES:
            break
        visited += 1
        path = ix.paths[eid]
        _call(ar.stat, path, follow_symlinks=False)
        kind = ix.kind[eid]
        if kind == DIR:
            _call(ar.listdir, path)
        elif kind == SYMLINK:
            _call(ar.readlink, path)
            _call(ar.exists, path)
        else:
            _exercise_member(ar, eid)
    _call(ar.archive_order)
    return visited


def open_and_exercise(data: bytes, file_backed: bool | None = None) -> bool:
    """The whole path for one input; True when the archive opened (False: refused cleanly)."""
    source = make_source(data, file_backed)
    try:
        ar = Archive(source, cache_size=CACHE_SIZE)
    except CdmlfsError:
        source.close()
        return False
    with ar:
        exercise(ar)
    return True


# -- targets -------------------------------------------------------------------------------------
def target_archive(data: bytes) -> None:
    """zip / tar / tar.zst: the bytes are the archive (the format is sniffed, as a mount does)."""
    with memory_index_store() as store:
        opened = open_and_exercise(data)
        if opened and store.saved:
            # A tar index was persisted: reopen through it (the remount path) and exercise again.
            open_and_exercise(data)


def target_zstd(data: bytes) -> None:
    """The zstd frame walker and seek-table parser on their own, then the archive path."""
    from cdmlfs.zstd_seekable import read_seek_table, walk_frames

    source = MemorySource(data)
    _call(read_seek_table, source)
    _call(walk_frames, source)
    target_archive(data)


_bases: dict | None = None


def index_bases() -> dict:
    """Small valid archives the index target attaches its payloads to (built once)."""
    global _bases
    if _bases is None:
        from cdmlfs.formats.tarmembers import MemberTable
        from cdmlfs.formats.zstdstream import FrameTable
        from fuzz import craft, seeds

        tar = seeds._ustar_only()
        frame = craft.zstd_frame(tar)
        table = MemberTable()
        tarfmt.scan_tar(_BytesView(tar), table)
        table.stream_size = len(tar)
        frames = FrameTable()
        frames.add(0, len(frame), len(tar))
        _bases = {"tar": tar, "zst": frame, "table": table, "frames": frames}
    return _bases


class _BytesView:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, pos: int, n: int) -> bytes:
        return self.data[pos : pos + n]


def target_index(data: bytes) -> None:
    """Persisted / embedded member tables: a mode byte, then the payload the loader is given."""
    from cdmlfs.zstd_seekable import seek_table_frame, skippable_frame

    if not data:
        return
    mode, payload = data[0] % 3, data[1:]
    bases = index_bases()
    with memory_index_store() as store:
        if mode == 0:
            store.injected[tarfmt.STORE_KIND_TAR] = payload
            open_and_exercise(bases["tar"], file_backed=False)
        elif mode == 1:
            store.injected[tarfmt.STORE_KIND_TAR_ZST] = payload
            open_and_exercise(bases["zst"], file_backed=False)
        else:
            frame = bases["zst"]
            emb = skippable_frame(payload, tarfmt.EMBEDDED_INDEX_NIBBLE)
            archive = frame + emb + seek_table_frame([(len(frame), len(bases["tar"])), (len(emb), 0)])
            open_and_exercise(archive, file_backed=False)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "zip": target_archive,
    "tar": target_archive,
    "zstd": target_zstd,
    "index": target_index,
}


def run(target: str, data: bytes, seconds: float | None = None) -> None:
    """One input through one target, under a time bound; findings propagate."""
    with time_limit(seconds):
        TARGETS[target](data)
