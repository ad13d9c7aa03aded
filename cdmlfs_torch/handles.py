"""One open :class:`cdmlfs.Archive` per (process, location): the handle every dataset shares.

Why a registry instead of a handle stored on each dataset:

* A forked DataLoader worker keeps the parent's handles: archives are
  fork-safe (:mod:`cdmlfs.forksafe` gives the child fresh locks, an empty
  cache and new network connections) and the index is shared copy-on-write,
  so a worker starts reading at once instead of re-indexing the archive. A
  spawned worker inherits nothing and opens its own handle lazily, on its
  first read.
* Loaders receive only a sample path (``"data.zip::cat/1.jpg"``, see
  :mod:`cdmlfs_torch.roots`), exactly like torchvision loaders receive a file
  path, and must find the archive from it.
* Datasets over the same archive (train and val folders of one ZIP) share
  one index and one bounded cache per process instead of one each.

At most :data:`MAX_OPEN` handles stay in the registry, least recently used let go first: a
process reading samples from thousands of shard archives (a manifest of ``shard.zip::path``
samples) held a descriptor and a cache for every shard it had touched, and ran out of file
descriptors. A handle let go closes once nothing reads through it (a dataset keeps the one it
listed for as long as it lives); a later sample of that archive opens it again.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cdmlfs.archive import Archive

log = logging.getLogger(__name__)

MAX_OPEN = 64
"""Handles kept per process (each holds a descriptor, or connections, and up to its cache)."""

DEFAULT_CACHE_SIZE = 64 << 20
"""Cache per process and archive. Small on purpose: a DataLoader runs one handle per
worker, and samples of a shuffled epoch are read once, so a big cache buys nothing."""

_lock = threading.Lock()
_open: OrderedDict[str, Archive] = OrderedDict()  # least recently used first
_options: dict[str, dict[str, Any]] = {}  # open options datasets gave for a location (see remember_options)
# The handle a dataset's ``__getitem__`` reads through (see reading_from): loaders get a path only.
_reading: contextvars.ContextVar[tuple[str, Archive] | None] = contextvars.ContextVar(
    "cdmlfs_torch_reading", default=None
)


def remember_options(location: str, open_kwargs: dict[str, Any]) -> None:
    """Options to open ``location`` with when a caller names only the location.

    Loaders, ``read_sample`` and ``open_sample`` get a sample path and nothing else: in a
    spawned worker (a fresh process) a wrapper dataset reading ``ds.samples[i][0]`` that way
    opened the archive without the dataset's options (an S3 ``endpoint_url`` lost: it went to
    AWS). Datasets record theirs here, also when unpickled in a worker; the first one given wins.
    """
    if open_kwargs:
        _options.setdefault(location, dict(open_kwargs))


def _reset_lock_after_fork() -> None:
    """In a forked child: a fresh registry lock (a parent thread may have held it); handles stay."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_lock_after_fork)


def get_archive(location: str, *, revalidate: bool = False, **open_kwargs: Any) -> Archive:
    """The process's handle for ``location``, opened on first use with ``open_kwargs``.

    A later call with different options gets the handle already open (one index
    and cache per archive and process); pass the options on the first call.

    ``revalidate`` (a dataset being made): if the location holds other bytes now than when the
    handle was opened (a file replaced or touched: a stat; an object replaced: a HEAD request),
    a new handle serves from now on. Without it, a process kept the first version for good: a
    new dataset listed the old contents, and spawned workers refused it every epoch.
    """
    archive = _open.get(location)
    if archive is not None and not (revalidate and _changed(archive)):
        with contextlib.suppress(KeyError):  # let go by another thread meanwhile: still fine to use
            _open.move_to_end(location)
        return archive
    if not open_kwargs:
        open_kwargs = dict(_options.get(location, {}))
    with _lock:
        current = _open.get(location)
        if current is None or current is archive:  # not replaced meanwhile by another thread
            import cdmlfs

            open_kwargs.setdefault("cache_size", DEFAULT_CACHE_SIZE)
            fresh = cdmlfs.open(location, **open_kwargs)
            if current is not None:  # a file opened on the old version may still be reading it
                current.close_when_unused()  # kept until close_all, each held its fd and cache
            _open[location] = current = fresh
            _open.move_to_end(location)
            while len(_open) > MAX_OPEN:
                _, oldest = _open.popitem(last=False)
                oldest.close_when_unused()
        return current


@contextlib.contextmanager
def reading_from(location: str, archive: Archive) -> Iterator[None]:
    """Within this block, loaders naming ``location`` read through ``archive``.

    A dataset keeps the handle of the version it listed; a newer dataset over the same location,
    made after the file was touched or replaced, moves the process's handle on. The first
    dataset's loader, given only a sample path, then read the newer version (or, by the
    identity check, refused every sample): it reads its own version through this instead.
    """
    token = _reading.set((location, archive))
    try:
        yield
    finally:
        _reading.reset(token)


def reading_location() -> str | None:
    """The location whose dataset is reading in this context (see :func:`reading_from`), if any."""
    reading = _reading.get()
    return None if reading is None else reading[0]


def handle_for(location: str) -> Archive:
    """The handle a loader should read ``location`` through: the reading dataset's, else the process's."""
    reading = _reading.get()
    if reading is not None and reading[0] == location and not reading[1].closed:
        return reading[1]
    return get_archive(location)


def _changed(archive: Archive) -> bool:
    """Whether the location holds other bytes now; a probe that fails on the network (not a missing
    file or object, which is raised) keeps the handle: the dataset is made as it was before."""
    from cdmlfs.errors import SourceError

    probe = getattr(archive.source, "probe_identity", None)
    if probe is None:
        return False
    try:
        return not probe().same_bytes(archive.source.identity)
    except SourceError as exc:
        log.info("%s: cannot tell whether it changed (%s)", archive.source, exc)
        return False


def close_all() -> None:
    """Close this process's handles (tests, or a long-lived process that is done with its data)."""
    global _open
    with _lock:
        handles, _open = list(_open.values()), OrderedDict()
        _options.clear()
    for archive in handles:
        archive.close()


def open_locations() -> list[str]:
    """Locations with a handle open in this process (for tests and diagnostics)."""
    return list(_open)
