"""One open :class:`cdmlfs.Archive` per (process, location): the handle every dataset shares.

Why a registry instead of a handle stored on each dataset:

* DataLoader workers must not use the parent's handle. After ``fork`` the
  child inherits the parent's source (an S3 connection pool is not fork-safe)
  and its cache lock (which another parent thread may have held at the
  moment of the fork). After ``spawn`` nothing is inherited at all. So a
  worker opens its own handle lazily, on its first read; the registry is
  emptied in a forked child (``os.register_at_fork``, with a pid check as a
  second guard) without touching, let alone closing, the parent's objects.
* Loaders receive only a sample path (``"data.zip::cat/1.jpg"``, see
  :mod:`cdmlfs_torch.roots`), exactly like torchvision loaders receive a file
  path, and must find the archive from it.
* Datasets over the same archive (train and val folders of one ZIP) share
  one index and one bounded cache per process instead of one each.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cdmlfs.archive import Archive

DEFAULT_CACHE_SIZE = 64 << 20
"""Cache per process and archive. Small on purpose: a DataLoader runs one handle per
worker, and samples of a shuffled epoch are read once, so a big cache buys nothing."""

_lock = threading.Lock()
_pid = os.getpid()
_open: dict[str, Archive] = {}


def _reset_after_fork() -> None:
    """In a forked child: forget the parent's handles (never close them: they are the parent's)."""
    global _lock, _pid, _open
    _lock = threading.Lock()
    _pid = os.getpid()
    _open = {}


os.register_at_fork(after_in_child=_reset_after_fork)


def get_archive(location: str, **open_kwargs: Any) -> Archive:
    """The process's handle for ``location``, opened on first use with ``open_kwargs``.

    A later call with different options gets the handle already open (one index
    and cache per archive and process); pass the options on the first call.
    """
    if _pid != os.getpid():  # a fork that bypassed os.fork()'s hooks
        _reset_after_fork()
    archive = _open.get(location)
    if archive is not None:
        return archive
    with _lock:
        archive = _open.get(location)
        if archive is None:
            import cdmlfs

            open_kwargs.setdefault("cache_size", DEFAULT_CACHE_SIZE)
            archive = cdmlfs.open(location, **open_kwargs)
            _open[location] = archive
        return archive


def close_all() -> None:
    """Close this process's handles (tests, or a long-lived process that is done with its data)."""
    global _open
    with _lock:
        handles, _open = _open, {}
    if _pid == os.getpid():
        for archive in handles.values():
            archive.close()


def open_locations() -> list[str]:
    """Locations with a handle open in this process (for tests and diagnostics)."""
    if _pid != os.getpid():
        return []
    return list(_open)
