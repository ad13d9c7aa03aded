"""The Python API: open an archive (path or URI), list, stat, read, extract — no FUSE needed.

This is the one object the front ends (FUSE operations, CLI, cdmlfs_torch) use;
it wires source -> format -> index -> extent reader + cache.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import operator
import os
import posixpath
import secrets
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator

from cdmlfs import decoders, forksafe
from cdmlfs.cache import ExtentCache
from cdmlfs.errors import (
    ArchiveFormatError,
    LinkLoopError,
    MemberError,
    NotASymlinkError,
    NotFoundError,
    PathIsADirectoryError,
    PathNotADirectoryError,
    SourceChangedError,
    UnsafeDestinationError,
    WindowLimitError,
)
from cdmlfs.formats import open_format
from cdmlfs.index import DIR, FILE, SPARSE, SYMLINK, EntryStat, Index
from cdmlfs.reader import ExtentReader
from cdmlfs.safe_write import check_inside, write_atomically
from cdmlfs.sizes import parse_size
from cdmlfs.sources import open_source
from cdmlfs.sources.base import Source
from cdmlfs.sources.s3 import S3_OPTIONS

DEFAULT_CACHE_SIZE = 512 << 20
MIN_CACHE_SIZE = 1 << 20
OPTIONS = S3_OPTIONS | {"index_dir"}  # what Archive(**options) passes to sources and formats
MAX_SYMLINK_HOPS = 40
_MISSING = (NotFoundError, LinkLoopError, PathNotADirectoryError)  # os.path.exists / isdir / isfile: False


class _WarningsOfThisThread(logging.Handler):
    """Keeps the warnings cdmlfs logs while this thread opens an archive (``Archive.open_warnings``)."""

    def __init__(self, also_print: bool) -> None:
        super().__init__(logging.WARNING)
        self.thread = threading.get_ident()
        self.messages: list[str] = []
        self.also_print = also_print

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            with contextlib.suppress(Exception):  # a bad format string must not fail the open
                self.messages.append(record.getMessage())
        if self.also_print and self._prints(record):
            logging.lastResort.handle(record)  # no logging set up: as Python's last resort would

    def _prints(self, record: logging.LogRecord) -> bool:
        """Whether this handler prints ``record``: each record once, by the open of its own thread
        (else the oldest open under way), and only while no real handler is set up. Decided when
        installed, a second open running at once printed nothing once the first had finished."""
        with _KEEPERS_LOCK:
            keepers = list(_KEEPERS)
        owner = next((k for k in keepers if k.thread == record.thread), keepers[0] if keepers else self)
        if owner is not self or logging.lastResort is None:
            return False
        logger: logging.Logger | None = logging.getLogger("cdmlfs")
        while logger is not None:
            if any(not isinstance(h, _WarningsOfThisThread) for h in logger.handlers):
                return False
            logger = logger.parent if logger.propagate else None
        return True


_KEEPERS: list[_WarningsOfThisThread] = []  # the opens under way, oldest first
_KEEPERS_LOCK = threading.Lock()


@contextlib.contextmanager
def _keeping_warnings() -> Iterator[list[str]]:
    logger = logging.getLogger("cdmlfs")
    handler = _WarningsOfThisThread(also_print=True)
    with _KEEPERS_LOCK:
        _KEEPERS.append(handler)
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        with _KEEPERS_LOCK:
            _KEEPERS.remove(handler)


def _cache_bytes(size: int | str) -> int:
    """``cache_size`` as bytes: an int, or a string as the CLI takes it ("512M", "2G")."""
    if isinstance(size, str):
        size = parse_size(size)
    try:
        if isinstance(size, bool):
            raise TypeError
        size = operator.index(size)  # an int, a numpy integer...
    except TypeError:
        raise TypeError(f"cache_size must be bytes (an int) or a string like '512M', not {size!r}") from None
    if size < MIN_CACHE_SIZE:
        raise ValueError(f"cache_size must be at least 1M (a read needs room for its data), not {size}")
    return size


def stops_extraction(exc: Exception) -> bool:
    """Failures that every later entry would meet too: going on would only repeat them."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def _close_parts(reader: ExtentReader, cache: ExtentCache, source: Source) -> None:
    reader.close()  # reads after this fail: the file descriptor number may be reused
    cache.clear()
    source.close()


def _close_unclosed(reader: ExtentReader, cache: ExtentCache, source: Source, location: str) -> None:
    warnings.warn(f"unclosed archive {location}", ResourceWarning, stacklevel=2)
    _close_parts(reader, cache, source)


class Archive:
    """A read-only view of one archive.

    Thread-safe and fork-safe: in a forked child (a DataLoader worker) the
    index is shared copy-on-write, while locks, the cache and network
    connections start afresh (:mod:`cdmlfs.forksafe`). Pickles as its location
    and options only, so a spawned worker reopens it.
    """

    def __init__(
        self,
        location: str | os.PathLike | Source,
        cache_size: int | str = DEFAULT_CACHE_SIZE,
        progress: Callable[[int, int], None] | None = None,
        *,
        window_limit: int | None = None,
        **options,
    ) -> None:
        cache_size = _cache_bytes(cache_size)
        # The largest decoder window (memory beside the cache) taken: by default, and at most, what
        # zstd's own default takes (128 MiB; more failed the read as a corrupt frame); a mount passes
        # a quarter of its cache (decoders.window_limit).
        window_limit = min(window_limit or decoders.MAX_WINDOW, decoders.MAX_WINDOW)
        unknown = set(options) - OPTIONS
        if unknown:  # a misspelt option (endpoint= for endpoint_url=) must not be dropped silently
            known = ", ".join(sorted(OPTIONS))
            raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; known: {known}")
        if isinstance(location, (str, bytes, os.PathLike)):
            location = os.fsdecode(location)
            local = location[:7].lower() == "file://"
            if local:  # a local path all the same (relative ones too, and "://" further in)
                location = location[7:]
            if local or "://" not in location:  # a pickled Archive reopens it from any working directory
                # The directory as the kernel resolves it (abspath folded "link/.." as text and
                # opened another file than open() would); the archive's own name is kept.
                head, name = os.path.split(location)
                location = os.path.join(os.path.realpath(head or "."), name)
        self._location = location if isinstance(location, str) else None
        self._cache_size = cache_size
        self._window_limit = window_limit  # pickled with the rest: a worker keeps the parent's
        if options.get("index_dir"):  # pickled with the options: a worker may run elsewhere
            options["index_dir"] = os.path.abspath(os.fspath(options["index_dir"]))
        self._options = options
        # Created first: a remote source keeps its fetched blocks in it (one bound for all bytes held).
        self.cache = ExtentCache(cache_size)
        self.source: Source = (
            open_source(location, cache=self.cache, **options) if isinstance(location, str) else location
        )
        try:
            # What opening found worth a warning (a truncated tar, a damaged seek table...): a
            # daemon repeats it in its log, where a user looks later (the terminal may be gone).
            with _keeping_warnings() as self.open_warnings:
                self.format = open_format(self.source, progress=progress, window_max=window_limit, **options)
            self.index: Index = self.format.index
            # Also refuses frames whose window the cache cannot take (an index saved earlier).
            self.reader = ExtentReader(self.format, self.cache, window_limit)
        except ArchiveFormatError as exc:
            self.source.close()
            # Name the archive: a job that mounts several (or a container log) must say which failed.
            where = self._location or getattr(self.source, "location", None)
            kind = WindowLimitError if isinstance(exc, WindowLimitError) else ArchiveFormatError
            raise kind(f"{where}: {exc}" if where else str(exc)) from None
        except BaseException:
            self.source.close()
            raise
        # Dropped without close() (cdmlfs.open(p).read(x), a copy, an unpickled worker's): the
        # descriptor, decode threads and cache go with the object, as an unclosed file's do.
        self._finalizer = weakref.finalize(
            self, _close_unclosed, self.reader, self.cache, self.source, self.location
        )
        self._finalizer.atexit = False  # at exit the process lets go of all of it anyway

    # -- lifecycle -----------------------------------------------------------
    @property
    def location(self) -> str:
        return self._location if self._location is not None else repr(self.source)

    def warm_up(self, decode_ahead: bool = False) -> None:
        """Prepare for the first reads in the background (pre-faulted zstd frame buffers).

        The daemon calls it once it serves; a long-lived Python user may too.
        Call it in the process that will read (threads do not survive a fork).
        ``decode_ahead``: a reader moving through a large zstd frame in archive
        order gets the next piece decoded by a background thread; it pays when a
        core is idle and the readers are other processes (the daemon's case), not
        threads of this one (they share the GIL).
        """
        warm = getattr(getattr(self.format, "stream", None), "warm_up", None)
        if warm is not None:
            warm(decode_ahead=decode_ahead)

    def close(self) -> None:
        self._finalizer.detach()
        _close_parts(self.reader, self.cache, self.source)

    @property
    def closed(self) -> bool:
        """True once closed (as a file's ``closed``)."""
        return self.reader.closed

    def close_when_unused(self) -> None:
        """Close once the last reference goes (a file still open on it, say), without the
        unclosed-archive warning: for an owner that lets go of a handle others may still read."""
        if self._finalizer.detach() is not None:
            self._finalizer = weakref.finalize(self, _close_parts, self.reader, self.cache, self.source)
            self._finalizer.atexit = False

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        if self._location is None:
            raise TypeError("an Archive opened on a Source object cannot be pickled; open it by location")
        return {
            "location": self._location,
            "cache_size": self._cache_size,
            "window_limit": self._window_limit,
            "options": self._options,
            "identity": tuple(self.source.identity),
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(  # type: ignore[misc]
            state["location"], state["cache_size"], window_limit=state.get("window_limit"), **state["options"]
        )
        seen = state.get("identity")
        if seen is not None and not self.source.identity.same_bytes(seen):
            # A worker must not read another version than the one its parent listed and indexed.
            self.close()
            raise SourceChangedError(
                f"{self.location}: the archive changed since it was opened in the parent process "
                f"(was {seen[1]} bytes, version {seen[2]}; now {self.source.identity.size} bytes, "
                f"version {self.source.identity.version}); open it again"
            )

    def __repr__(self) -> str:
        return f"Archive({self.location!r}, format={self.format.name}, entries={len(self.index) - 1})"

    # -- paths ---------------------------------------------------------------
    def _check_open(self) -> None:
        """Every question about paths fails on a closed archive, as a closed file's methods do:
        listings that still answered from the index hid a use after close until the first read."""
        if self.reader.closed:
            raise ValueError("I/O operation on a closed archive")

    def _resolve(self, path: str, follow: bool = True) -> int:
        """Entry id for ``path``, following symlinks inside the archive (never outside it).

        A plain path the index holds is one dict lookup. Anything else (``.``,
        ``..``, ``//``, a trailing ``/``, links on the way) is walked component by
        component as the kernel walks it through a mount: ``lnk/..`` is the
        parent of where ``lnk`` points, ``file/.`` is not a directory. ``..``
        at the archive's root stays there (the path rule of the whole package);
        a link whose target climbs above the root points outside the archive.
        """
        self._check_open()
        text = path if isinstance(path, str) else os.fsdecode(path)
        index = self.index
        eid = index.get(text.lstrip("/"))
        if eid is not None and (not follow or index.kind[eid] != SYMLINK):
            return eid  # the index holds normalised paths only: a hit needs no walk
        return self._walk(text, follow)

    def _walk(self, text: str, follow: bool) -> int:
        index = self.index
        root = index.get("")
        assert root is not None
        # Components still to resolve, each marked whether it came from a link's target.
        todo: deque[tuple[str, bool]] = deque((c, False) for c in text.split("/"))
        dirs = [root]  # the directories resolved so far, from the root: ".." pops one
        cur = root
        hops = 0
        while todo:
            name, from_link = todo.popleft()
            if index.kind[cur] != DIR:
                raise PathNotADirectoryError(f"{text}: not a directory")
            if name in ("", "."):
                continue
            if name == "..":
                if len(dirs) > 1:
                    dirs.pop()
                elif from_link:
                    raise NotFoundError(f"{text}: a symlink on the way points outside the archive")
                cur = dirs[-1]
                continue
            parent = index.paths[cur]
            eid = index.get(f"{parent}/{name}" if parent else name)
            if eid is None:
                raise NotFoundError(f"{text}: no such file or directory in the archive")
            if index.kind[eid] == SYMLINK and (todo or follow):
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    raise LinkLoopError(f"{text}: too many levels of symbolic links")
                target = self.reader.readlink(eid)
                if not target:
                    raise NotFoundError(f"{index.paths[eid]}: symlink with an empty target")
                if target.startswith("/"):
                    raise NotFoundError(f"{index.paths[eid]}: symlink points outside the archive ({target})")
                todo.extendleft((c, True) for c in reversed(target.split("/")))
                continue  # the target is resolved from the folder the link is in: cur
            cur = eid
            if index.kind[eid] == DIR:
                dirs.append(eid)
        return cur

    def _name_for(self, path, eid: int) -> str:
        """The name to give what ``path`` resolved to (``eid``): the path as asked, normalised
        (``"./a/"`` is ``"a"``, a link keeps its own name). With ``..`` in it, the folder it
        resolved to and its last component: folded as text, ``lnk/../f`` named the link's folder,
        not where the kernel (and ``_resolve``) took it. PurePosixPath and bytes as os takes them."""
        text = path if isinstance(path, str) else os.fsdecode(path)
        if ".." not in text.split("/"):
            name = posixpath.normpath("/" + text).lstrip("/")
            return "" if name == "." else name
        head, _, last = text.rstrip("/").rpartition("/")
        if last in ("", ".", ".."):
            return self.index.paths[eid]
        folder = self.index.paths[self._resolve(head)]
        return f"{folder}/{last}" if folder else last

    # -- queries -------------------------------------------------------------
    def stat(self, path: str, follow_symlinks: bool = True) -> EntryStat:
        return self.index.stat(self._resolve(path, follow_symlinks))

    def exists(self, path: str) -> bool:
        try:
            self._resolve(path)
        except _MISSING:
            return False
        return True

    def isdir(self, path: str) -> bool:
        try:
            return self.index.kind[self._resolve(path)] == DIR
        except _MISSING:
            return False

    def isfile(self, path: str) -> bool:
        try:
            return self.index.kind[self._resolve(path)] == FILE
        except _MISSING:
            return False

    def listdir(self, path: str = "") -> list[str]:
        eid = self._resolve(path)
        if self.index.kind[eid] != DIR:
            raise PathNotADirectoryError(f"{path}: not a directory")
        return [self.index.name(c) for c in self.index.children(eid)]

    def scandir(self, path: str = "") -> list[EntryStat]:
        """The entries of a directory with their stat records (``EntryStat``: path, kind, size,
        mode, mtime... as attributes, not ``os.DirEntry`` methods), read from the index at once."""
        eid = self._resolve(path)
        if self.index.kind[eid] != DIR:
            raise PathNotADirectoryError(f"{path}: not a directory")
        return [self.index.stat(c) for c in self.index.children(eid)]

    def walk(self, top: str = "") -> Iterator[tuple[str, list[str], list[str]]]:
        """Like ``os.walk``: top-down, each directory's entries in name order (ZIP) or archive
        order (tar); a symlink to a directory is listed with the directories but not followed.

        Unlike ``os.walk``: paths are member paths (``top`` normalised: ``"./a/"`` gives ``"a"``,
        ``"lnk/.."`` the folder it resolves to),
        and a ``top`` that is missing or not a directory raises instead of yielding nothing.
        """
        index = self.index
        eid = self._resolve(top)
        stack = [(self._name_for(top, eid), eid)]
        while stack:
            path, eid = stack.pop()
            dirs, files, real = [], [], {}
            for c in index.children(eid):
                name = index.name(c)
                kind = index.kind[c]
                if kind == DIR:
                    dirs.append(name)
                    real[name] = c
                elif kind == SYMLINK and self.isdir(index.paths[c]):
                    dirs.append(name)
                else:
                    files.append(name)
            yield path, dirs, files
            # As os.walk: the caller may prune (or reorder) ``dirs`` in place before we descend.
            subdirs = [(f"{path}/{name}" if path else name, real[name]) for name in dirs if name in real]
            stack.extend(reversed(subdirs))

    def files(self) -> list[str]:
        """Every regular file path (no directories or symlinks), depth first in listing order."""
        self._check_open()
        index = self.index
        return [index.paths[e] for e in index.walk(0) if index.kind[e] == FILE]

    def archive_order(self) -> list[str]:
        """File paths in the order their bytes lie in the archive (one forward pass reads them all).

        Every name of a file, hard links too (next to the name holding the data): a dataset made
        from this list lost the samples whose names were tar hard links.
        """
        self._check_open()
        index = self.index
        ids = [e for e in index.walk(0) if index.kind[e] == FILE]
        ids.sort(key=lambda e: index.offset[index.data_entry(e)])
        return [index.paths[e] for e in ids]

    def position(self, path: str) -> int:
        """Where a file's bytes lie in the archive (sort key of ``archive_order``).

        Directories hold no bytes: they raise, as :meth:`read` does (0 sorted them before every
        file, as if they were the archive's first member)."""
        eid = self._resolve(path)
        if self.index.kind[eid] == DIR:
            raise PathIsADirectoryError(f"{path}: is a directory")
        return self.index.offset[self.index.data_entry(eid)]

    def readlink(self, path: str) -> str:
        eid = self._resolve(path, follow=False)
        if self.index.kind[eid] != SYMLINK:
            raise NotASymlinkError(f"{path}: not a symbolic link")
        return self.reader.readlink(eid)

    # -- data ----------------------------------------------------------------
    def read(self, path: str, offset: int = 0, size: int | None = -1) -> bytes:
        """Bytes of a file (following symlinks); ``size=-1`` (or None) reads to the end."""
        offset = operator.index(offset)
        size = -1 if size is None else operator.index(size)
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        eid = self._resolve(path)
        if self.index.kind[eid] == DIR:
            raise PathIsADirectoryError(f"{path}: is a directory")
        if size < 0:
            size = self.index.size[self.index.data_entry(eid)] - offset
        return self.reader.read(eid, offset, size)

    def open(
        self, path: str, mode: str | int = "rb", buffering: int = 1 << 20
    ) -> io.BufferedReader | MemberFile:
        """A seekable binary file object over a member (reads go through the bounded cache).

        ``mode`` is ``"rb"`` (or ``"r"``, as ``ZipFile.open`` takes it); ``buffering`` as for
        ``open()``: 0 gives the raw, unbuffered file, -1 the default buffer. An int in place of
        the mode is taken as ``buffering`` (the older signature).
        """
        if isinstance(mode, int):
            mode, buffering = "rb", mode
        if mode not in ("r", "rb"):
            raise ValueError(f"archive members open read-only in binary mode ('rb'), not {mode!r}")
        eid = self._resolve(path)
        if self.index.kind[eid] == DIR:
            raise PathIsADirectoryError(f"{path}: is a directory")
        raw = MemberFile(self.reader, eid, self._name_for(path, eid))  # as asked: a link's own name
        raw._archive = self  # the archive lives as long as a file of it is open: cdmlfs.open(p).open(n)
        if buffering == 0:
            return raw
        return io.BufferedReader(raw, buffer_size=buffering if buffering > 0 else 1 << 20)

    def extract(
        self,
        path: str,
        dest_dir: str,
        chunk: int = 4 << 20,
        on_error: Callable[[str, Exception], None] | None = None,
        on_extracted: Callable[[str], None] | None = None,
    ) -> str:
        """Copy one entry (file, symlink or a whole directory) under ``dest_dir``; returns the output path.

        Files already there are replaced, as ``tar -x`` does (never written through a link in the
        way). ``on_error(member_path, exc)``: in a directory, an entry that cannot be extracted (a
        corrupt member, a name taken by a directory at the destination) is reported to it and the
        rest is extracted, as ``tar -x`` goes on; without it the first failure raises. A full disk
        and a source that fails (the archive changed, the network is gone) always raise.
        ``on_extracted(output_path)`` is told of every entry written, as it is (``extract -v``).
        """
        done = on_extracted or (lambda _out: None)
        eid = self._resolve(path, follow=False)
        index = self.index
        root = os.path.realpath(dest_dir)
        out = os.path.join(dest_dir, index.paths[eid])
        if index.kind[eid] == DIR:
            check_inside(root, os.path.join(out, "."))
            _make_dir(out)
            done(out)
            folders = [eid]
            written: dict[int, str] = {}  # data entry -> the file written for it, for hard links
            for c in index.walk(eid):
                try:
                    self._extract_one(c, os.path.join(dest_dir, index.paths[c]), chunk, root, written)
                except (MemberError, UnsafeDestinationError, OSError) as exc:
                    if on_error is None or stops_extraction(exc):
                        raise
                    on_error(index.paths[c], exc)
                    continue
                done(os.path.join(dest_dir, index.paths[c]))
                if index.kind[c] == DIR and c != eid:
                    folders.append(c)
            # Directory modes and mtimes last, deepest first, as tar -x does: writing into a folder
            # changes its mtime, and a read-only mode set first would stop its contents.
            for d in reversed(folders):
                if d == 0:  # the archive's root is dest_dir itself: not ours to change
                    continue
                target = os.path.join(dest_dir, index.paths[d])
                os.chmod(target, index.mode[d])
                os.utime(target, (index.mtime[d], index.mtime[d]))
            return out
        self._extract_one(eid, out, chunk, root)
        done(out)
        return out

    def _extract_one(
        self, eid: int, out: str, chunk: int, root: str, written: dict[int, str] | None = None
    ) -> None:
        """One entry; nothing is written outside ``root``, even through links already there.

        With ``written`` (a directory being extracted), the names of a tar hard link become hard
        links again, as ``tar -x`` makes them: the first is written, the others linked to it.
        """
        index = self.index
        kind = index.kind[eid]
        if kind == DIR:
            check_inside(root, os.path.join(out, "."))
            _make_dir(out)
            return
        check_inside(root, out)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        _remove_empty_dir(out)
        data = index.data_entry(eid)
        linked = written is not None and (eid in index.hardlink_of or data in index.nlink_extra)
        if linked and data in written and _hard_link(written[data], out):  # type: ignore[operator]
            return
        if kind == SYMLINK:
            if os.path.lexists(out):
                os.unlink(out)
            os.symlink(self.reader.readlink(eid), out)
            with contextlib.suppress(OSError, NotImplementedError):  # as tar -x: the link's own mtime
                os.utime(out, (index.mtime[eid], index.mtime[eid]), follow_symlinks=False)
            if linked:  # a hard link to a symlink: its other names link to this one
                written[data] = out  # type: ignore[index]
            return
        raw = MemberFile(self.reader, eid, index.paths[eid])
        sparse = bool(index.flags[data] & SPARSE)
        write_atomically(out, raw, mode=index.mode[eid], mtime=index.mtime[eid], chunk=chunk, sparse=sparse)
        if linked:
            written[data] = out  # type: ignore[index]


def _make_dir(out: str) -> None:
    """A folder at ``out``; a file or a dangling link in the way is replaced, as ``tar -x`` does."""
    if os.path.lexists(out) and not os.path.isdir(out):
        os.unlink(out)
    os.makedirs(out, exist_ok=True)


def _remove_empty_dir(out: str) -> None:
    """An empty folder where a file or link goes is removed, as ``tar -x`` does (one with files
    in it stays: the write then fails on it with "Is a directory")."""
    if os.path.isdir(out) and not os.path.islink(out):
        with contextlib.suppress(OSError):
            os.rmdir(out)


def _hard_link(existing: str, out: str) -> bool:
    """``out`` as another name of ``existing`` (a symlink itself, not what it points to), replacing
    what is there; False where the file system has no hard links (the caller writes a copy)."""
    # A short name beside it: the member's own name plus a suffix went over NAME_MAX (255 bytes)
    # for long names, and the link silently became a copy.
    tmp = os.path.join(os.path.dirname(out), f".cdmlfs-link-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.link(existing, tmp, follow_symlinks=False)
        os.replace(tmp, out)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False


class MemberFile(io.RawIOBase):
    """Raw, seekable reads of one member through the extent reader (``FileIO``'s behaviour)."""

    mode = "rb"

    _archive: Archive | None = None

    def __init__(self, reader: ExtentReader, eid: int, name: str) -> None:
        self._reader = reader
        self._eid = eid
        self._pos = 0
        # Read at the position and advance it as one step, as the kernel does for FileIO: threads
        # sharing an unbuffered file got some bytes twice (the read releases the GIL).
        self._pos_lock = threading.Lock()
        forksafe.register(self)  # a child forked while another thread read through it inherited the lock held
        self._size = reader.index.size[reader.index.data_entry(eid)]
        self.name = name

    def __repr__(self) -> str:
        return f"<cdmlfs.MemberFile name={self.name!r}{' closed' if self.closed else ''}>"

    def _after_fork_child(self) -> None:
        self._pos_lock = threading.Lock()

    def close(self) -> None:
        super().close()
        self._archive = None  # the archive may go now (see Archive.open)

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")

    def readable(self) -> bool:
        self._check_open()
        return True

    def seekable(self) -> bool:
        self._check_open()
        return True

    def writable(self) -> bool:
        self._check_open()  # closed: ValueError, as FileIO says it
        return False

    def write(self, b) -> int:
        self._check_open()
        raise io.UnsupportedOperation("write: archive members are read-only")

    def truncate(self, size: int | None = None) -> int:
        self._check_open()
        raise io.UnsupportedOperation("truncate: archive members are read-only")

    def fileno(self) -> int:
        self._check_open()
        raise io.UnsupportedOperation("fileno: an archive member has no file descriptor")

    def tell(self) -> int:
        self._check_open()
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        offset = operator.index(offset)  # as FileIO: 1.5 is a TypeError here, not at the next read
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise OSError(22, "negative seek position")
        with self._pos_lock:
            self._pos = pos
        return pos

    def read(self, size: int | None = -1) -> bytes:
        return super().read(-1 if size is None else size)  # FileIO's read(None) reads it all

    def readinto(self, buf) -> int:  # type: ignore[override]
        self._check_open()
        view = memoryview(buf)
        if view.readonly:  # as io's files say it, before anything is read or the position moves
            kind = type(buf).__name__
            raise TypeError(f"readinto() argument must be read-write bytes-like object, not {kind}")
        if not view.contiguous:  # TypeError, as FileIO gives it
            raise TypeError("readinto() argument must be a contiguous buffer")
        view = view.cast("B")  # bytes, whatever the buffer's item type or shape (array('i'), numpy)
        with self._pos_lock:
            n = self._reader.read_into(self._eid, self._pos, view.nbytes, view)
            self._pos += n
        return n

    def readall(self) -> bytes:
        self._check_open()
        with self._pos_lock:
            data = self._reader.read(self._eid, self._pos, max(self._size - self._pos, 0))
            self._pos += len(data)
        return data

    @property
    def size(self) -> int:
        return self._size
