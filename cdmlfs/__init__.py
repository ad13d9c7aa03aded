"""cdmlfs: mount ZIP, tar.zst and S3 archives as read-only directories, without extraction.

Data path: byte source (``cdmlfs.sources``) -> archive format (``cdmlfs.formats``)
-> index (``cdmlfs.index``) -> extent reader + bounded cache (``cdmlfs.reader``,
``cdmlfs.cache``) -> front ends (``cdmlfs.fuse_ops``, ``cdmlfs.archive``, ``cdmlfs.cli``).

Python API::

    import cdmlfs
    with cdmlfs.open("data.zip") as ar:
        print(ar.listdir(""))
        jpeg = ar.read("train/cat/001.jpg")
"""

from __future__ import annotations

__version__ = "0.1.0"

from cdmlfs.errors import (
    ArchiveFormatError,
    ArchiveNotFoundError,
    CdmlfsError,
    CorruptMemberError,
    EncryptedMemberError,
    LinkLoopError,
    MemberError,
    NotASymlinkError,
    NotFoundError,
    PathIsADirectoryError,
    PathNotADirectoryError,
    SourceChangedError,
    SourceError,
    UnsafeDestinationError,
    UnsupportedMethodError,
    UsageError,
    WindowLimitError,
)

# Every error the API raises is a CdmlfsError; its ``errno`` says what a read through a mount gets.
__all__ = [
    "Archive",
    "ArchiveFormatError",
    "ArchiveNotFoundError",
    "CdmlfsError",
    "CorruptMemberError",
    "EncryptedMemberError",
    "LinkLoopError",
    "MemberError",
    "NotASymlinkError",
    "NotFoundError",
    "PathIsADirectoryError",
    "PathNotADirectoryError",
    "SourceChangedError",
    "SourceError",
    "UnsafeDestinationError",
    "UnsupportedMethodError",
    "UsageError",
    "WindowLimitError",
    "__version__",
    "open",
]


def open(location: str, **kwargs):
    """Open an archive (path or URI) for reading through the Python API.

    ``cache_size`` (bytes, or a string like ``"2G"``; default 512M) bounds the decoded data held.
    ``index_dir``: where tar indexes are kept (default under the user's cache directory).
    ``window_limit``: the largest decoder window (memory beside the cache) taken, in bytes (default
    and most 128 MiB; a mount takes a quarter of its cache, ``cdmlfs.decoders.window_limit``).
    For ``s3://bucket/key`` URIs, the options of ``cdmlfs mount``: ``endpoint_url``, ``region``,
    ``profile``, ``no_sign_request``, ``addressing_style`` (``"path"``/``"virtual"``),
    ``max_connections``, ``part_size``, ``connect_timeout``, ``read_timeout`` and ``retry``
    (a :class:`cdmlfs.sources.retry.RetryPolicy`). Credentials come from boto3's usual chain.
    """
    from cdmlfs.archive import Archive

    return Archive(location, **kwargs)


def __getattr__(name: str):
    if name == "Archive":
        from cdmlfs.archive import Archive

        return Archive
    raise AttributeError(name)
