"""The byte-source interface shared by local files and remote objects."""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable


class SourceIdentity(NamedTuple):
    """What makes two openings of a source the same bytes.

    Used as a key for persisted indexes and to detect an archive replaced while
    mounted: ``location`` plus either (size, mtime_ns) for a file or an ETag.
    """

    location: str
    size: int
    version: str  # mtime_ns for local files, ETag for objects

    def key(self) -> str:
        return f"{self.location}\0{self.size}\0{self.version}"


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
