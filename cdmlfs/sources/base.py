"""The byte-source interface shared by local files and remote objects."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable


class SourceIdentity(NamedTuple):
    """What makes two openings of a source the same bytes.

    ``location`` plus either (size, mtime and inode) for a file or (size, ETag) for an
    object. S3 reads are also pinned to the ETag while open; a local file changed in
    place while open is caught only by the formats' own checks (ZIP CRCs, zstd
    checksums; plain tar has none).

    ``changed`` (a local file's ctime) is part of the persisted index's key only
    (:meth:`key`): it moves on every write, so an archive rewritten in place with its
    mtime put back is indexed again, but also on chmod, chown and a new hard link, which
    leave the bytes alone. A pickled Archive or dataset reopening in a worker compares
    :meth:`same_bytes`, so a chmod of the archive during training does not refuse every
    sample (it did: ESTALE in each spawned worker, every epoch).
    """

    location: str
    size: int
    version: str  # mtime.inode for local files, ETag for objects
    # ctime for local files (and a hash of sampled bytes: LocalFile.index_identity); the endpoint
    # for S3 objects off AWS. Keys the saved index only (same_bytes leaves it out).
    changed: str = ""

    def key(self) -> str:
        return f"{self.location}\0{self.size}\0{self.version}\0{self.changed}"

    def same_bytes(self, other: tuple) -> bool:
        """Whether ``other`` (an identity, or one pickled as a tuple) names the same bytes."""
        return tuple(self)[:3] == tuple(other)[:3]


@runtime_checkable
class Source(Protocol):
    """Random-access, thread-safe, read-only bytes.

    ``read_at`` returns exactly ``length`` bytes or raises
    :class:`~cdmlfs.errors.SourceError` (short reads are errors, never silent).
    ``fileno()`` returns an OS file descriptor when the bytes are a local file,
    else ``None``: decoders use it to pread and decode in one GIL-free call.
    ``prefers_threads`` tells the FUSE layer whether reads wait on I/O (network)
    and so benefit from a multithreaded loop.
    """

    size: int
    identity: SourceIdentity
    mtime: float  # seconds; dates the root and directories no entry describes
    prefers_threads: bool

    def read_at(self, offset: int, length: int) -> bytes: ...

    def fileno(self) -> int | None: ...

    def close(self) -> None: ...


class SourceRange(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a source as a forward-only raw stream.

    What the stream decoders read from (zstandard's stream reader, bz2, lzma):
    each read is one ``read_at``, with no buffer of its own in between.
    ``on_read`` is told the position after each read (scan progress).
    """

    def __init__(
        self, source: Source, start: int, length: int, on_read: Callable[[int], None] | None = None
    ) -> None:
        self._source = source
        self._pos = start
        self._end = start + length
        self._on_read = on_read

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        """Where the next read starts in the source (progress of a scan)."""
        return self._pos

    def read(self, size: int = -1) -> bytes:
        n = self._end - self._pos if size is None or size < 0 else min(size, self._end - self._pos)
        if n <= 0:
            return b""
        data = self._source.read_at(self._pos, n)
        self._pos += n
        if self._on_read is not None:
            self._on_read(self._pos)
        return data

    def readinto(self, buf) -> int:  # type: ignore[override]
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)
