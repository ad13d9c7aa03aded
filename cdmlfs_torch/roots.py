"""Where a dataset's files live: a local directory, or a folder inside an archive.

Root syntax (what ``ArchiveImageFolder(root)`` and ``ArchiveDataset(root)`` accept):

``/data/train`` (an existing directory, a cdmlfs mount included)
    Read with ordinary file calls; behaves exactly like torchvision.
``/data/imagenet.zip``
    The whole archive.
``/data/imagenet.zip::train`` (``LOCATION::FOLDER``)
    The folder ``train`` inside the archive. ``LOCATION`` is anything
    ``cdmlfs.open`` accepts (a path, ``s3://bucket/key.zip``),
    split at the first ``::``; this is the form that always works.
``/data/imagenet.zip/train``
    Shorthand for local archives: when the path does not exist, its longest
    prefix that is an existing regular file is the archive and the rest is
    the folder inside it. URIs have no such shorthand (it would cost network
    round trips to guess): use ``::``.

A path that exists on the local file system is always taken literally first.

Sample paths: files inside an archive are named ``LOCATION::INNER`` with
``INNER`` the member's path from the archive root, e.g.
``/data/imagenet.zip::train/n01440764/x.JPEG``. The string says which archive
and which member, survives pickling to any process, and can be read back
with :func:`cdmlfs_torch.read_sample` / :func:`cdmlfs_torch.open_sample`;
``sample[len(dataset.root_path) + 1:]`` (or :meth:`Tree.relpath`) is the
path relative to the dataset root, as ``os.path.relpath`` gives for
torchvision. Files of a local directory keep their ordinary paths.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import posixpath
import shutil
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from cdmlfs.errors import ArchiveFormatError, CdmlfsError, NotFoundError, UsageError
from cdmlfs.safe_write import check_inside, write_atomically
from cdmlfs_torch import handles

SEP = "::"


class SampleNotFoundError(FileNotFoundError):
    """A sample path that names nothing in its archive (torchvision gives FileNotFoundError there)."""


@contextlib.contextmanager
def sample_errors(path: str) -> Iterator[None]:
    """Raise a sample's cdmlfs errors as the OSError a file on disk or on the mount would give.

    Training loops skip bad samples with ``except OSError`` (or FileNotFoundError),
    whatever the files are: a missing member is FileNotFoundError, a corrupt one
    an OSError with EIO and the reason, the cdmlfs error kept as ``__cause__``.
    """
    try:
        yield
    except NotFoundError as exc:
        raise SampleNotFoundError(errno.ENOENT, str(exc), path) from exc
    except CdmlfsError as exc:
        raise OSError(exc.errno, str(exc), path) from exc


def is_uri(text: str) -> bool:
    """``scheme://...`` (s3://, http://): never looked up on the local file system."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.isascii() and scheme.replace("+", "").replace("-", "").isalnum()


def split_sample_path(path: str) -> tuple[str, str] | None:
    """``"LOCATION::INNER"`` -> ``(LOCATION, INNER)``; None for a plain local path.

    While a dataset reads a sample (:func:`handles.reading_from`), a path under its location
    is its member, whatever the local disk holds. Otherwise the split is at the first ``::``
    whose left side is an archive already open in this process (datasets open theirs before
    calling a loader), else at the first ``::`` whose left side is a local file (an archive
    named ``x::y.zip`` too) or a URI. A path that exists locally, or whose ``::`` follow no file, is a plain
    path: a deleted sample in a folder named ``a::b`` is FileNotFoundError, as on disk.
    """
    if SEP not in path:
        return None
    # A dataset's own samples are its archive's members: a local file spelled like one (made after
    # the listing) was read in the member's place.
    reading = handles.reading_location()
    if reading is not None and path.startswith(reading + SEP):
        return reading, path[len(reading) + len(SEP) :].strip("/")
    # Checked first: with "x.zip" open here, a folder "x.zip::copy" beside it was read from x.zip.
    if not is_uri(path) and os.path.exists(path):  # a URI is never looked up on the local disk
        return None
    split = _split_at_first(path, handles.open_locations().__contains__)
    if split is not None:
        return split
    return _split_at_first(path, lambda location: is_uri(location) or os.path.isfile(location))


def _split_at_first(path: str, accept: Callable[[str], bool]) -> tuple[str, str] | None:
    """(LOCATION, INNER) at the first ``::`` whose left side ``accept`` takes, or None."""
    start = 0
    while (at := path.find(SEP, start)) >= 0:
        if accept(path[:at]):
            return path[:at], path[at + len(SEP) :].strip("/")
        start = at + 1
    return None


class Tree:
    """The file operations the datasets need, over one root; pickles as a few strings."""

    root_path: str
    """The root in this tree's path space: a directory path, or ``LOCATION::FOLDER``."""

    def join(self, *parts: str) -> str:
        raise NotImplementedError

    def relpath(self, path: str) -> str:
        """A path of this tree relative to the root (``/``-separated inside archives)."""
        raise NotImplementedError

    def subdirs(self, path: str) -> list[str]:
        """Names of the directories in ``path`` (symlinks followed), in listing order."""
        raise NotImplementedError

    def isdir(self, path: str) -> bool:
        raise NotImplementedError

    def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
        """``os.walk(path, followlinks=True)`` semantics: (dirpath, dirnames, filenames), top-down."""
        raise NotImplementedError

    def files(self) -> list[str]:
        """Every file below the root (symlinks followed), as tree paths sorted as strings."""
        out = [self.join(d, f) for d, _, fnames in self.walk(self.root_path) for f in fnames]
        out.sort()
        return out

    def read(self, path: str) -> bytes:
        raise NotImplementedError

    def open(self, path: str) -> BinaryIO:
        raise NotImplementedError

    def extract(self, path: str, dest: str) -> str:
        """Copy one file to ``dest/<path relative to the root>``; returns the new file's path."""
        raise NotImplementedError

    def archive_positions(self, paths: list[str]) -> list[int]:
        """A sort key per path: where its bytes lie (archive order); list order for plain files."""
        return list(range(len(paths)))


def read_local_file(path: str) -> bytes:
    """All bytes of a local file, without the terminal check that ``open(path, "rb")`` makes.

    Before Python 3.14, ``open()`` with default buffering asks every file whether it is a
    terminal (an ioctl) to choose line buffering. On a FUSE mount that ioctl is a round trip to
    the daemon, one of three per file (lookup, ioctl, read): measured on a cdmlfs mount, reading
    unbuffered was 1.2-1.5x faster for 2-110 KiB files. The bytes are the same.
    """
    with open(path, "rb", buffering=0) as f:
        return f.readall()


def open_local_file(path: str) -> BinaryIO:
    """``open(path, "rb")`` without the terminal check (see :func:`read_local_file`)."""
    return open(path, "rb", buffering=io.DEFAULT_BUFFER_SIZE)


class LocalTree(Tree):
    """A directory read with ordinary file calls (torchvision's behaviour, byte for byte)."""

    def __init__(self, root: str) -> None:
        self.root_path = root

    def __repr__(self) -> str:
        return f"LocalTree({self.root_path!r})"

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def relpath(self, path: str) -> str:
        return os.path.relpath(path, self.root_path)

    def subdirs(self, path: str) -> list[str]:
        with os.scandir(path) as it:
            return [entry.name for entry in it if entry.is_dir()]

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
        return os.walk(path, followlinks=True)

    def read(self, path: str) -> bytes:
        return read_local_file(path)

    def open(self, path: str) -> BinaryIO:
        return open_local_file(path)

    def extract(self, path: str, dest: str) -> str:
        out = os.path.join(dest, self.relpath(path))
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        return shutil.copy2(path, out)


class ArchiveTree(Tree):
    """A folder inside an archive, read through the process's :mod:`handles` (no FUSE)."""

    def __init__(self, location: str, inner: str = "", **open_kwargs: Any) -> None:
        inner = posixpath.normpath("/" + inner).strip("/") if inner.strip("/") else ""
        self.location = location
        self.inner = inner
        if open_kwargs.get("index_dir"):  # pickled for workers, which may run in another directory
            open_kwargs = {**open_kwargs, "index_dir": os.path.abspath(os.fspath(open_kwargs["index_dir"]))}
        self.open_kwargs = open_kwargs
        self.root_path = f"{location}{SEP}{inner}"
        self._prefix = f"{location}{SEP}"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_handle", None)  # a spawned worker opens its own (a forked one keeps this object)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        handles.remember_options(self.location, self.open_kwargs)  # a worker's loaders need them too

    def __repr__(self) -> str:
        return f"ArchiveTree({self.root_path!r})"

    @property
    def archive(self):
        """This process's handle (opened on first use in each DataLoader worker).

        A spawned worker reopens the location: it must read the version the dataset's
        sample list came from (``identity``, taken by :meth:`check` in the parent), not
        whatever is there now (it silently read a replaced object's bytes under the old
        list); it gets ESTALE instead.
        """
        kept = self.__dict__.get("_handle")
        if kept is not None and not kept.closed:
            # The version this tree listed, even once a newer dataset moved the process's handle
            # on (a touched or replaced file): that made every sample of this one fail ESTALE.
            return kept
        archive = handles.get_archive(self.location, **self.open_kwargs)
        seen = self.__dict__.get("identity")
        if seen is not None and not archive.source.identity.same_bytes(seen):
            raise OSError(
                errno.ESTALE,
                f"{self.location}: the archive changed after the dataset listed it "
                f"(was {seen[1]} bytes, version {seen[2]}; now {archive.source.identity.size} bytes, "
                f"version {archive.source.identity.version}); create the dataset again",
                self.location,
            )
        return archive

    def check(self) -> ArchiveTree:
        """Open the archive now and make sure the folder exists (errors at construction, not in workers).

        The errors are the OSErrors torchvision's folders give for a root on disk: a
        missing archive is FileNotFoundError, a file that is no archive NotADirectoryError.
        """
        if not is_uri(self.location) and not os.path.lexists(self.location):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), self.location)
        try:
            # A dataset being made reads the archive as it is now (a new handle if it changed).
            handles.get_archive(self.location, revalidate=True, **self.open_kwargs)
            archive = self.archive
        except ArchiveFormatError as exc:
            why = f"{os.strerror(errno.ENOTDIR)} (not an archive cdmlfs reads: {exc})"
            raise NotADirectoryError(errno.ENOTDIR, why, self.location) from exc
        except UsageError as exc:
            if "no such" in str(exc):  # an S3 object or a file that is not there
                raise FileNotFoundError(errno.ENOENT, str(exc), self.location) from exc
            raise
        self.identity = tuple(archive.source.identity)  # pickled with the tree: workers compare
        self._handle = archive  # in this process (and forked workers): this version, for as long as we live
        handles.remember_options(self.location, self.open_kwargs)  # for loaders naming only the location
        if self.inner and not archive.isdir(self.inner):
            # As the OS walks a path: the first component that is no directory decides, so a path
            # through a file is NotADirectoryError, as torchvision's folders get it on disk.
            parts = [p for p in self.inner.split("/") if p]
            for i in range(1, len(parts) + 1):
                head = "/".join(parts[:i])
                if archive.isdir(head):
                    continue
                if archive.exists(head):
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), self.root_path)
                break
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), self.root_path)
        return self

    def inner_path(self, path: str) -> str:
        """Member path (from the archive root) of a tree path."""
        if not path.startswith(self._prefix):
            raise ValueError(f"{path!r} is not a path inside {self.location!r}")
        return path[len(self._prefix) :].strip("/")

    def join(self, *parts: str) -> str:
        head, *rest = parts
        inner = self.inner_path(head)
        for part in rest:
            inner = f"{inner}/{part}" if inner else part
        return self._prefix + inner

    def relpath(self, path: str) -> str:
        inner = self.inner_path(path)
        if not self.inner:
            return inner or "."
        if inner == self.inner:
            return "."
        if not inner.startswith(self.inner + "/"):
            raise ValueError(f"{path!r} is not below {self.root_path!r}")
        return inner[len(self.inner) + 1 :]

    def _entries(self, inner: str) -> list[tuple[str, bool]]:
        """(name, is a directory after following symlinks) for each entry of a directory."""
        archive = self.archive
        out = []
        for st in archive.scandir(inner):
            name = st.path.rpartition("/")[2]
            follow = st.is_symlink  # a link to a directory is a directory, as os.scandir's is_dir() says
            out.append((name, archive.isdir(f"{inner}/{name}" if inner else name) if follow else st.is_dir))
        return out

    def subdirs(self, path: str) -> list[str]:
        inner = self.inner_path(path)
        if not self.archive.isdir(inner):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        return [name for name, is_dir in self._entries(inner) if is_dir]

    def isdir(self, path: str) -> bool:
        return self.archive.isdir(self.inner_path(path))

    def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
        """Top-down like ``os.walk(followlinks=True)``; a symlink back to an ancestor is not re-entered
        (``os.walk`` would recurse until the path is too long)."""
        archive = self.archive
        top = self.inner_path(path)
        if not archive.isdir(top):
            return
        stack: list[tuple[str, frozenset[int]]] = [(top, frozenset((archive.stat(top).ino,)))]
        while stack:
            inner, ancestors = stack.pop()
            dirs, files = [], []
            for name, is_dir in self._entries(inner):
                (dirs if is_dir else files).append(name)
            yield self._prefix + inner, dirs, files
            for name in reversed(dirs):
                child = f"{inner}/{name}" if inner else name
                ino = archive.stat(child).ino
                if ino not in ancestors:
                    stack.append((child, ancestors | {ino}))

    def read(self, path: str) -> bytes:
        with sample_errors(path):
            return self.archive.read(self.inner_path(path))

    def open(self, path: str) -> BinaryIO:
        with sample_errors(path):
            return self.archive.open(self.inner_path(path))

    def extract(self, path: str, dest: str) -> str:
        """Copy one member to ``dest/<path relative to the root>`` (symlinks resolved to their data)."""
        rel = self.relpath(path)
        out = os.path.join(dest, *rel.split("/"))
        check_inside(os.path.realpath(dest), out)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with self.open(path) as src:
            write_atomically(out, src)
        return out

    def archive_positions(self, paths: list[str]) -> list[int]:
        archive = self.archive
        rank = {p: i for i, p in enumerate(archive.archive_order())}
        end = len(rank)
        out = []
        for path in paths:
            inner = self.inner_path(path)
            pos = rank.get(inner)
            if pos is None:  # a symlink: sort it with the member holding its bytes
                try:
                    pos = rank.get(archive.stat(inner).path, end)
                except Exception:
                    pos = end
            out.append(pos)
        return out


def positions_by_archive(paths: list[str], **open_kwargs: Any) -> list[int]:
    """Sort keys for sample paths that need not share one root (a subclass's hooks read a
    manifest): archive by archive, in the order each first appears, every archive's samples in
    its archive order; plain files after them, in list order.

    Why: :class:`ArchiveOrderSampler` asked the dataset's root for positions, and a root that
    is a manifest file (no folder, no archive) raised; a directory holding one gave list order.
    """
    by_location: dict[str, list[int]] = {}
    plain: list[int] = []
    for i, path in enumerate(paths):
        split = split_sample_path(path) if SEP in path else None
        if split is None:
            plain.append(i)
        else:
            by_location.setdefault(split[0], []).append(i)
    keys = [0] * len(paths)
    base = 0
    for location, members in by_location.items():
        tree = ArchiveTree(location, "", **open_kwargs)
        ranks = tree.archive_positions([paths[i] for i in members])
        for i, rank in zip(members, ranks):
            keys[i] = base + rank
        base += max(ranks, default=0) + 1
    for i in plain:
        keys[i] = base
        base += 1
    return keys


def resolve_root(root: str | os.PathLike, **open_kwargs: Any) -> Tree:
    """Parse a dataset root (see the module docstring) into a :class:`Tree`; checks it exists."""
    text = os.path.expanduser(os.fspath(root))
    if not is_uri(text):
        if os.path.isdir(text):
            return LocalTree(text)
        if os.path.isfile(text):
            return ArchiveTree(text, "", **open_kwargs).check()
    # LOCATION::INNER splits after a file's name or a URI: an archive may be named 'x::y.zip'.
    if SEP in text and (split := split_sample_path(text)) is not None:
        return ArchiveTree(*split, **open_kwargs).check()
    if is_uri(text):
        return ArchiveTree(text, "", **open_kwargs).check()
    head, rest = text.rstrip("/") or text, ""  # "data.zip/" names the archive's root, as "dir/" a dir
    while head and not os.path.lexists(head):
        parent, name = os.path.split(head.rstrip("/"))
        if parent == head or not name:
            break
        rest = f"{name}/{rest}" if rest else name
        head = parent
    if head and os.path.isfile(head):
        tree = ArchiveTree(head, rest, **open_kwargs)
        try:
            return tree.check()
        except (FileNotFoundError, NotADirectoryError) as exc:  # name the folder as given, as on disk
            if exc.filename != tree.root_path:
                raise
            raise type(exc)(exc.errno, exc.strerror, text) from exc
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), text)
