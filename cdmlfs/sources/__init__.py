"""Byte sources: where archive bytes come from (a local file or an S3 object).

Every source offers the same small interface (:class:`~cdmlfs.sources.base.Source`),
so archive formats never know whether they read a disk or a network.
"""

from __future__ import annotations

from cdmlfs.sources.base import Source, SourceIdentity
from cdmlfs.sources.local import LocalFile

__all__ = ["LocalFile", "Source", "SourceIdentity", "open_source"]


def open_source(location: str, cache=None, **options) -> Source:
    """Open the byte source a user names on the command line or in the Python API.

    ``options`` are source-specific (S3 endpoint, region, ...); local files ignore them.
    ``cache`` is the archive's ExtentCache: remote sources keep fetched blocks in
    it, so one bound covers decoded extents and network bytes alike.
    """
    if "://" in location:
        scheme = location.split("://", 1)[0].lower()
        if scheme == "file":
            return LocalFile(location[len("file://") :])
        if scheme == "s3":
            from cdmlfs.sources.s3 import S3_OPTIONS, S3Object

            s3_options = {k: v for k, v in options.items() if k in S3_OPTIONS}
            return S3Object(location, cache=cache, **s3_options)
        from cdmlfs.errors import UsageError

        raise UsageError(f"unsupported source scheme {scheme!r} in {location!r}")
    return LocalFile(location)
