"""Exception types of the core, each carrying the errno the FUSE layer answers with.

The core raises these; front ends translate them: the FUSE operations return
``-exc.errno`` (and log once per member), the CLI prints ``str(exc)`` on one line
and exits non-zero. Nothing below the front ends formats user messages or exits.
"""

from __future__ import annotations

import errno as _errno


class CdmlfsError(Exception):
    """Base class; ``errno`` is what a FUSE read of the affected file returns."""

    errno: int = _errno.EIO


class SourceError(CdmlfsError):
    """The byte source could not deliver the requested bytes (I/O error, network, changed object)."""


class SourceChangedError(SourceError):
    """The archive changed after it was indexed (size, mtime or ETag differ): serving it would mix bytes."""


class ArchiveFormatError(CdmlfsError):
    """The archive as a whole cannot be read (not a ZIP, truncated, corrupt directory): mount refused."""


class WindowLimitError(ArchiveFormatError):
    """The archive needs a decoder window beyond this opener's limit (a mount's, from its cache):
    an opener with a larger cache reads it, so it is never noted as the archive's failure."""


class MemberError(CdmlfsError):
    """A problem confined to one member; other members stay readable.

    ``member`` is filled in by the layer that knows the member's path, so that
    low-level decoders can raise without knowing it.
    """

    def __init__(self, reason: str, member: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.member = member

    def __str__(self) -> str:
        return f"{self.member}: {self.reason}" if self.member else self.reason


class CorruptMemberError(MemberError):
    """Member data does not decode, decodes to the wrong size, or fails its CRC."""


class UnsupportedMethodError(MemberError):
    """The member uses a compression method we do not decode (for example deflate64)."""


class EncryptedMemberError(MemberError):
    """The member is encrypted; we never guess passwords."""

    errno = _errno.EACCES


class NotFoundError(CdmlfsError):
    """No such path in the archive."""

    errno = _errno.ENOENT


class LinkLoopError(CdmlfsError):
    """Symbolic links inside the archive that never reach a file (ELOOP, as on disk)."""

    errno = _errno.ELOOP


class PathIsADirectoryError(CdmlfsError):
    """A file operation was asked of a directory."""

    errno = _errno.EISDIR


class PathNotADirectoryError(CdmlfsError):
    """A directory operation was asked of a file."""

    errno = _errno.ENOTDIR


class NotASymlinkError(CdmlfsError, OSError):
    """readlink of something that is not a symbolic link (an OSError too, as os.readlink raises)."""

    errno = _errno.EINVAL


class UnsafeDestinationError(CdmlfsError):
    """An extracted entry would land outside the destination (through a symlink already there):
    that entry is refused, the others are extracted."""

    errno = _errno.EPERM


class UsageError(CdmlfsError):
    """A bad command-line option or mount point; the CLI prints it and exits 2."""

    errno = _errno.EINVAL


class ArchiveNotFoundError(UsageError):
    """The archive itself does not exist (a usage error for the CLI, ENOENT for the API)."""

    errno = _errno.ENOENT
