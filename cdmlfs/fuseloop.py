"""Run the single-threaded FUSE loop with a short busy-poll between requests (``cdmlfs._fuseloop``).

A reader that walks small files sends its next request a few microseconds
after our reply. If the daemon's CPU went idle meanwhile, waking it costs an
inter-processor interrupt, and in a VM whose idle vCPUs halt at once that is
tens of microseconds per request, more than serving it. The C loop in
``native/fuseloop.c`` (libfuse's own ``fuse_main_real`` plus a polling loop)
keeps asking for the next request for ``poll_us`` microseconds after each one
before it sleeps; when the mount is idle it sleeps like libfuse's loop.

It replaces libfuse's loop only for single-threaded serving with libfuse3
(the multithreaded loop serves network sources, where requests wait on I/O
anyway). ``--poll-us 0`` or ``CDMLFS_FUSELOOP=0`` keeps libfuse's loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Iterator

from cdmlfs import extensions

log = logging.getLogger(__name__)

DEFAULT_POLL_US = 50


def availability(fuse_major: int | None = None) -> tuple[bool, str]:
    """Whether the polling loop can run, and why not."""
    ready = "polls between requests"
    return extensions.availability("cdmlfs._fuseloop", "CDMLFS_FUSELOOP", fuse_major, ready)


def cpu_idle(sys_root: str = "/sys") -> str:
    """How this machine's idle CPUs wait, and what that costs FUSE (a ``cdmlfs doctor`` line).

    Every FUSE request and reply wakes a thread on another CPU. With the
    ``haltpoll`` cpuidle driver (KVM guests) and ``guest_halt_poll_ns=0`` an idle
    vCPU halts at once and each wake-up is a VM exit: our loop polls on the
    daemon's side, but the reader's side is the machine's setting.
    """
    cpuidle = os.path.join(sys_root, "devices/system/cpu/cpuidle/current_driver")
    poll_ns = os.path.join(sys_root, "module/haltpoll/parameters/guest_halt_poll_ns")
    try:
        with open(cpuidle) as f:
            driver = f.read().strip()
    except OSError:
        return "unknown (no cpuidle driver in sysfs)"
    if driver != "haltpoll":
        return driver
    try:
        with open(poll_ns) as f:
            ns = int(f.read().strip())
    except (OSError, ValueError):
        return "haltpoll"
    if ns > 0:
        return f"haltpoll, polls {ns} ns before halting"
    return (
        "haltpoll, guest_halt_poll_ns=0: idle vCPUs halt at once and every FUSE reply waits for a "
        f"wake-up; as root, echo 200000 > {poll_ns} made one reader's archive-order reads 1.7x "
        "faster on our CI machines (see the README)"
    )


def stats() -> dict | None:
    """The loop's counters, or None when it is not built."""
    try:
        from cdmlfs import _fuseloop
    except ImportError:
        return None
    return _fuseloop.stats()


@contextlib.contextmanager
def installed(mfusepy, poll_us: int) -> Iterator[bool]:
    """Make mfusepy start the polling loop instead of libfuse's ``fuse_main_real`` (yields whether it did)."""
    ok, why = availability(mfusepy.fuse_version_major)
    if not ok or poll_us <= 0:
        log.debug("FUSE loop: libfuse's (%s)", why if not ok else "--poll-us 0")
        yield False
        return
    from cdmlfs import _fuseloop

    _fuseloop.set_spin_us(poll_us)
    main = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p
    )(_fuseloop.fuse_main_address())
    real = mfusepy.fuse_main_real

    def fuse_main_polling(argc, argv, ops_ptr, size, ctx):
        as_ptr = ctypes.c_void_p
        return main(argc, ctypes.cast(argv, as_ptr), ctypes.cast(ops_ptr, as_ptr), size, ctx)

    mfusepy.fuse_main_real = fuse_main_polling
    log.debug("FUSE loop: polling %d us between requests", poll_us)
    try:
        yield True
    finally:
        mfusepy.fuse_main_real = real
