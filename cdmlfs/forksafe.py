"""Keep thread pools and HTTP clients usable across ``fork()``.

``cdmlfs mount`` opens the archive (and talks to S3) in the parent, then forks
the daemon; DataLoader workers fork a process that already holds an Archive
(its index is shared copy-on-write, so a worker need not re-read it).
Threads do not survive a fork, and a lock or socket shared with the parent is
unusable in the child. Objects registered here get two callbacks:

* ``_before_fork()`` in the parent (optional): finish in-flight work so no worker
  thread holds a lock (ours or the shared cache's) at the moment of the fork;
* ``_after_fork_child()`` in the child: drop thread pools, in-flight state and
  HTTP connections, so they are rebuilt lazily on first use.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 (its fork hook must be registered before ours, see below)
import logging
import os
import weakref

log = logging.getLogger(__name__)

_registered: weakref.WeakSet = weakref.WeakSet()


def register(obj: object) -> None:
    """Call ``obj._before_fork()`` / ``obj._after_fork_child()`` around every fork while ``obj`` lives."""
    _registered.add(obj)


def _before() -> None:
    for obj in list(_registered):
        hook = getattr(obj, "_before_fork", None)
        if hook is None:
            continue
        try:
            hook()
        except Exception:  # a failing hook must not stop the fork
            log.exception("before-fork hook of %r failed", obj)


def _after_child() -> None:
    for obj in list(_registered):
        try:
            obj._after_fork_child()  # type: ignore[attr-defined]
        except Exception:
            log.exception("after-fork hook of %r failed", obj)


if hasattr(os, "register_at_fork"):
    # Before-fork hooks run in reverse order of registration. concurrent.futures takes its global
    # lock in one; registered after it, ours runs first: our hooks shut pools down (and wait for
    # their threads), which a reader submitting to such a pool meanwhile would otherwise deadlock
    # against (the reader holds the pool's lock and waits for the global one, the fork the reverse).
    os.register_at_fork(before=_before, after_in_child=_after_child)
