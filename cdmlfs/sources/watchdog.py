"""A deadline for reading a reply body, whatever pace the server sends it at.

The HTTP client's read timeout bounds each socket read, not the whole body: a
server (or a broken proxy) that sends a few bytes just often enough keeps one
ranged GET, and the FUSE read waiting on it, going forever. The retry policy's
deadline only applies between attempts. So while a body is being read, its
socket is registered here with the attempt's deadline; one thread shuts down
the sockets whose deadline has passed, which makes the blocked read return
(the body is then short, the attempt fails, and the retry loop, past its
deadline, gives up with a message).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)


def body_socket(body: object) -> socket.socket | None:
    """The socket under a botocore body (urllib3 response, then http.client's), or None."""
    raw = getattr(body, "_raw_stream", None)
    conn = getattr(raw, "_connection", None)
    sock = getattr(conn, "sock", None)
    if isinstance(sock, socket.socket):
        return sock
    fp = getattr(getattr(getattr(raw, "_fp", None), "fp", None), "raw", None)  # SocketIO
    sock = getattr(fp, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


class Watchdog:
    """Shuts down registered sockets at their deadlines (one lazily started thread per process:
    use :data:`WATCHDOG`)."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._reset()

    def _reset(self) -> None:
        """Fresh state (also in a forked child: the parent's thread and its lock stay behind)."""
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, tuple[socket.socket, object]] = {}  # key: (socket, owner)
        self._pid = 0

    @contextlib.contextmanager
    def guard(self, body: object, deadline: float, owner: object = None) -> Iterator[None]:
        """Bound the reading of ``body`` by ``deadline`` (a ``time.monotonic()`` value), or until
        :meth:`cut` is called with the same ``owner``."""
        sock = body_socket(body)
        if sock is None:  # another HTTP stack: only its per-read timeout applies
            yield
            return
        key = self._add(sock, deadline, owner)
        try:
            yield
        finally:
            with self._cv:
                self._live.pop(key, None)

    def cut(self, owner: object) -> None:
        """Shut down now the sockets of bodies being read for ``owner`` (it was closed)."""
        with self._cv:
            keys = [key for key, (_, who) in self._live.items() if who is owner]
            socks = [self._live.pop(key)[0] for key in keys]
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _add(self, sock: socket.socket, deadline: float, owner: object = None) -> int:
        with self._cv:
            if self._pid != os.getpid():  # first use, or a forked child: the thread is not there
                self._pid = os.getpid()
                self._heap.clear()
                self._live.clear()
                threading.Thread(target=self._run, name="cdmlfs-deadlines", daemon=True).start()
            key = next(self._ids)
            self._live[key] = (sock, owner)
            heapq.heappush(self._heap, (deadline, key))
            if self._heap[0][1] == key:  # sooner than the thread waits for (else no wake-up per body)
                self._cv.notify()
            return key

    def _run(self) -> None:
        with self._cv:
            while True:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)  # finished in time
                if not self._heap:
                    self._cv.wait()
                    continue
                deadline, key = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                heapq.heappop(self._heap)
                sock = self._live.pop(key)[0]
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                log.debug("cut off a reply body still arriving at its deadline")


WATCHDOG = Watchdog()
os.register_at_fork(after_in_child=WATCHDOG._reset)
