"""Dropping a member's pages from the kernel's page cache once the member is found corrupt.

Why: the mount keeps the kernel's page cache for its files (they never change), so bytes served
once are served again by the kernel without asking us. A large stored member is checked against
its CRC only once all of it has been read; parts of it read before that were answered unchecked.
When the check fails, every later read must fail too, but the kernel would keep answering those
parts from its cache. So the member's cached pages are dropped and its next reads reach us (EIO).

libfuse's ``fuse_invalidate_path`` asks the kernel to drop them. It must not run on the FUSE
loop's own thread while it serves a read of that file: the kernel waits for the pages that read
has locked, which are unlocked only by our reply. So it runs on a thread of its own, and stops
before libfuse frees its state at unmount (``close``). A call the kernel still holds then (a read
of that file left unanswered by the stopped loop) is not waited for beyond a second: the process
is on its way out, and that call touches nothing of libfuse's once the kernel lets it return.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading

log = logging.getLogger("cdmlfs")


class KernelCacheDropper:
    """Drops the kernel's cached pages of paths, off the FUSE loop's thread."""

    def __init__(self, libfuse: ctypes.CDLL) -> None:
        self._invalidate = getattr(libfuse, "fuse_invalidate_path", None)  # libfuse3 only
        if self._invalidate is not None:
            self._invalidate.argtypes = (ctypes.c_void_p, ctypes.c_char_p)
            self._invalidate.restype = ctypes.c_int
        self._get_context = libfuse.fuse_get_context
        self._fuse: int | None = None
        self._lock = threading.Lock()  # held while libfuse is called, so close() waits for it
        # Never the one above: a drop (on the FUSE thread) waiting for a call the kernel holds until
        # that thread answers a read would wait for ever.
        self._start_lock = threading.Lock()
        self._closed = False
        self._queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def bind(self) -> None:
        """Take libfuse's handle; call from a FUSE callback (``init``), where it is the context's."""
        if self._invalidate is not None:
            self._fuse = ctypes.c_void_p(self._get_context().contents.fuse).value

    def drop(self, path: bytes) -> None:
        """Have the kernel forget ``path``'s cached pages soon (returns at once)."""
        if self._fuse is None or self._closed:
            return
        self._queue.put(path)
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cdmlfs-invalidate", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """No new call into libfuse after this returns (libfuse is about to free what it needs)."""
        held = self._lock.acquire(timeout=1.0)
        self._closed = True
        if held:
            self._lock.release()
        self._queue.put(b"")

    def _run(self) -> None:
        while True:
            path = self._queue.get()
            with self._lock:
                if self._closed:
                    return
                # -ENOENT: the kernel holds no inode for it (then no pages either).
                rc = self._invalidate(self._fuse, path)
            if rc not in (0, -2):
                log.warning("could not drop the kernel's cached pages of %r (error %d)", path, -rc)
