"""The byte-source interface shared by local files and remote objects."""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable


class SourceIdentity(NamedTuple):
    """What makes two openings of a source the same bytes.

    Used as a key for persisted indexes and by a pickled Archive to refuse another
    version when it reopens: ``location`` plus either (size, mtime, ctime, device
    and inode) for a file or (size, ETag) for an object. S3 reads are also pinned
    to the ETag while open; a local file changed in place while open is caught
    only by the formats' own checks (ZIP CRCs, zstd checksums; plain tar has none).
    """

    location: str
    size: int
    version: str  # mtime.ctime.dev.inode for local files, ETag for objects

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
