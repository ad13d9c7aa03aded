"""Mount lifecycle: serve in the foreground, or fork a daemon and return once the mount answers.

The archive is opened (and its index built) *before* forking, so a bad archive
fails the command in the user's terminal and nothing is ever mounted. The
daemon reports readiness through a pipe from libfuse's ``init`` callback; the
parent then checks that the mount point answers and exits 0. If the child dies
first, the parent prints the reason (the daemon log's last line) and makes sure
no mount is left behind.

SIGTERM, SIGINT and SIGHUP are handled by libfuse: the loop ends and the mount
is removed before the process exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import hashlib
import logging
import os
import select
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from cdmlfs import fastpath, fuseloop, xdg
from cdmlfs.archive import Archive
from cdmlfs.errors import CdmlfsError, UsageError
from cdmlfs.fuse_ops import ArchiveOperations, load_mfusepy, make_fuse_class
from cdmlfs.mountpoints import is_mounted, unmount
from cdmlfs.safe_write import private_temp_dir
from cdmlfs.sizes import human_bytes

log = logging.getLogger(__name__)

READY = b"R"
MAX_THREADS = 8
READ_BUFFER = 1 << 20  # the largest read the kernel sends (FUSE's default of 256 pages)
DEFAULT_READAHEAD = 4 << 20
MOUNT_TIMEOUT = 60.0


@dataclass
class ServeOptions:
    mountpoint: str
    threads: str = "auto"  # "single", "multi" or "auto" (single for local files, multi for network sources)
    fuse_options: dict[str, str | bool | int] = field(default_factory=dict)
    debug: bool = False
    pid_file: str | None = None
    direct_io_min: int | None = None  # None: kernel no-open mode (see fuse_ops)
    readahead: int | None = DEFAULT_READAHEAD
    poll_us: int = fuseloop.DEFAULT_POLL_US  # single-threaded loop: poll this long between requests
    lock_fd: int | None = None  # claim_mountpoint's lock: closed once the mount answers

    def multithreaded(self, archive: Archive) -> bool:
        if self.threads == "auto":
            return bool(getattr(archive.source, "prefers_threads", False))
        return self.threads == "multi"


def _tune_malloc(archive: Archive) -> None:
    """Make RSS follow the cache bound without paying a page fault per 4 KiB of every decode.

    Measured: with glibc's default, multi-MiB decode buffers come from the heap
    after the first frees and the heap fragments (cache-bound test: +43 MiB over
    a 16 MiB cache). A fixed 256 KiB mmap threshold returns them on free (+24
    MiB) but every new 4 MiB extent then page-faults fresh memory: a 4 MiB zstd
    frame decode took 2.2 ms instead of 0.8 ms. So extents stay on the heap,
    where freed ones are reused at once, and the cache calls ``malloc_trim``
    after every few evicted MiB so freed pages go back to the OS.
    ``CDMLFS_MMAP_THRESHOLD`` overrides the threshold (0 leaves glibc's default).

    One malloc arena, even when serving multithreaded: with glibc's several
    arenas, each thread's frees land in its own heap, which ``malloc_trim``
    cannot keep compact (measured, 8 readers of 24 MB deflated members through
    a 192 MiB cache: +52 to +68 MiB over the cache with 4 arenas, +12 to +23
    with one, at no cost in throughput: decoders release the GIL, not malloc).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold = -1
    m_mmap_threshold = -3
    m_arena_max = -8
    threshold = int(os.environ.get("CDMLFS_MMAP_THRESHOLD", 64 << 20))
    if threshold > 0:
        libc.mallopt(m_mmap_threshold, threshold)
        # Which turns off glibc's own raising of the trim threshold, left at 128 KiB: every 1 MiB
        # buffer libfuse allocates for a read went back to the OS on free and was faulted in again
        # by the next read (256 page faults each; a big member read sequentially through a mount:
        # 1.5 GB/s, 3.2 GB/s with them kept). Room for the buffers of every FUSE thread; evictions
        # still give the cache's memory back (malloc_trim, above).
        libc.mallopt(m_trim_threshold, MAX_THREADS * READ_BUFFER)
    libc.mallopt(m_arena_max, 1)
    malloc_trim = libc.malloc_trim
    archive.cache.trim_hook = lambda: malloc_trim(0)


def serve(archive: Archive, opts: ServeOptions, ready_fd: int | None = None) -> None:
    """Run the FUSE loop until unmounted or signalled. Blocks."""
    mfusepy = load_mfusepy()
    ops = ArchiveOperations(archive, direct_io_min=opts.direct_io_min)
    multithreaded = opts.multithreaded(archive)
    ops.serving = "multithreaded" if multithreaded else "single-threaded"

    def ready() -> None:
        if opts.lock_fd is not None:  # the mount table guards the directory from now on
            with contextlib.suppress(OSError):
                os.close(opts.lock_fd)
        if ready_fd is not None:
            try:
                os.write(ready_fd, READY)
                os.close(ready_fd)
            except OSError:
                pass
        log.info(
            "mounted %s on %s (%d entries, cache %s, %s)",
            archive.location,
            opts.mountpoint,
            len(archive.index) - 1,
            human_bytes(archive.cache.limit),
            "multithreaded" if multithreaded else "single-threaded",
        )
        if ready_fd is not None:  # the mount command printed them; its terminal may be gone
            for warning in archive.open_warnings:
                log.warning("when opened: %s", warning)
        if ready_fd is None and not log.isEnabledFor(logging.INFO):  # foreground: say it once
            _to_stderr(
                f"cdmlfs: mounted {archive.location} on {opts.mountpoint}; "
                f"Ctrl-C or 'cdmlfs umount {opts.mountpoint}' unmounts\n"
            )

    mounted_once = []
    held: _HeldStderr | None = None

    def on_init() -> None:
        mounted_once.append(True)
        if held is not None:
            _to_stderr(held.release())
        ready()
        archive.warm_up(decode_ahead=True)  # our readers are other processes
        if opts.readahead:
            # Off the FUSE thread: stat-ing the mount point needs the loop to answer.
            tune = threading.Thread(target=set_readahead, args=(opts.mountpoint, opts.readahead), daemon=True)
            tune.start()

    ops.ready_callback = on_init
    fuse_kwargs = _fuse_kwargs(archive, opts, mfusepy.fuse_version_major, multithreaded)
    _tune_malloc(archive)
    gc.collect()
    gc.freeze()  # the index never changes: keep the collector from walking it
    if archive.cache.trim_hook is not None:
        # Opening left freed heap behind (the parse's buffers and temporaries: 4-12 MiB for 200k
        # ZIP entries); give it back before serving, so RSS after mounting is the index's.
        archive.cache.trim_hook()
    fuse_cls = make_fuse_class(mfusepy)
    table = ops.fast_table = _c_fast_path(archive, mfusepy.fuse_version_major)
    # libfuse's "remember" option needs its own loop (fuse_session_loop_remember).
    poll_us = 0 if multithreaded or "remember" in opts.fuse_options else opts.poll_us
    if opts.pid_file:
        _write_pid_file(opts.pid_file)
    # Foreground: libfuse's complaint about a bad -o went to the terminal and our error line
    # followed it; held back until the mount is up, it becomes part of that one line. (Taken only
    # here: a failure before this point must reach the terminal, not the held file.)
    held = _HeldStderr() if ready_fd is None else None
    try:
        with (
            fuseloop.installed(mfusepy, poll_us) as polling,
            fastpath.installed(mfusepy, table) if table is not None else contextlib.nullcontext(),
        ):
            ops.polling_loop = polling
            fuse_cls(ops, opts.mountpoint, raw_fi=True, errors="surrogateescape", **fuse_kwargs)
    except RuntimeError as exc:
        # libfuse's main returns non-zero when its loop ended on SIGTERM/SIGINT/SIGHUP; after a
        # successful mount that is the normal way to stop, and libfuse has unmounted by now.
        if not mounted_once:
            # libfuse said why on stderr (the log, when daemonised): "fuse: unknown option(s)...".
            reason = f"libfuse could not mount {opts.mountpoint} (fuse_main returned {exc})"
            if held is not None:
                lines = held.release().splitlines(keepends=True)
                said = libfuse_complaints(lines)
                sys.stderr.write("".join(ln for ln in lines if ln.strip() not in said))
                reason = "; ".join(said) or reason
            raise CdmlfsError(reason) from None
        log.info("unmounted %s (stopped by a signal)", opts.mountpoint)
        log.debug("libfuse's main returned %s", exc)
    else:
        if not mounted_once:  # the init callback failed (logged), and ended libfuse's loop from there
            raise CdmlfsError(f"libfuse could not mount {opts.mountpoint} (its init failed: see the log)")
        log.info("unmounted %s", opts.mountpoint)
    finally:
        if held is not None:
            _to_stderr(held.release())
        # libfuse has put back the default actions: a second SIGTERM (a process-group kill, tini -g)
        # would now end us with status 143 after a clean unmount. We are on our way out anyway.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(ValueError, OSError):  # ValueError: not the main thread
                signal.signal(sig, signal.SIG_IGN)
        # Only our own: a daemon that outlived its mount (a lazy unmount with a reader inside) must
        # not take the pid file of the one mounted there since.
        if opts.pid_file and _pid_in(opts.pid_file) == os.getpid():
            with contextlib.suppress(OSError):
                os.unlink(opts.pid_file)


def _to_stderr(text: str) -> None:
    """A notice on stderr that may be gone or full (2>/dev/full): never a reason to stop serving
    (raised inside libfuse's init, it skipped the warm-up) or to fail a clean unmount."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(text)
        sys.stderr.flush()


def _write_pid_file(pid_file: str) -> None:
    """Our pid, or an error naming the file; a file left half-written (a full disk) is removed."""
    try:
        with open(pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    except OSError as exc:
        with contextlib.suppress(OSError):
            if os.path.isfile(pid_file) and os.path.getsize(pid_file) == 0:
                os.unlink(pid_file)
        raise CdmlfsError(f"cannot write the pid file {pid_file}: {exc.strerror or exc}") from None


def _fuse_kwargs(archive: Archive, opts: ServeOptions, fuse_major: int, multithreaded: bool) -> dict:
    """The options mfusepy passes to libfuse: read-only, permissions checked by the kernel."""
    kwargs: dict = {
        # libfuse splits options at commas and takes a backslash as an escape (a\b.zip showed as ab.zip).
        "fsname": f"cdmlfs:{archive.location}".replace("\\", "\\\\").replace(",", "_"),
        "subtype": "cdmlfs",
        "ro": True,
        "default_permissions": True,
        "foreground": True,
        "nothreads": not multithreaded,
        "debug": opts.debug,
    }
    if fuse_major == 2:
        timeouts = {"entry_timeout": 3600, "attr_timeout": 3600, "negative_timeout": 3600}
        kwargs.update(use_ino=True, kernel_cache=True, **timeouts)
    elif multithreaded:
        # Each libfuse worker holds a ~1 MiB request buffer: a bounded pool keeps that constant small
        # (unbounded, a burst of readers cost ~45 MiB beyond the cache). Eight waiting reads cover
        # the network latency the multithreaded loop exists for.
        kwargs.update(max_threads=MAX_THREADS, max_idle_threads=MAX_THREADS // 2)
    kwargs.update(opts.fuse_options)
    return kwargs


def _c_fast_path(archive: Archive, fuse_major: int):
    """The C table over the archive's index, attached to its cache; None when C cannot serve."""
    fast, why = fastpath.availability(fuse_major)
    table = None
    if fast:
        try:
            table = fastpath.build_table(archive)
        except Exception as exc:  # e.g. more entries than its 32-bit ids: Python serves everything
            fast, why = False, f"its table could not be built: {exc}"
            log.warning("C fast path off (%s): Python serves every request", exc)
    if table is not None:
        fastpath.attach(archive, table)
    log.debug("C fast path: %s", why if fast else f"off ({why})")
    return table


def set_readahead(mountpoint: str, nbytes: int) -> bool:
    """Raise the kernel readahead of this mount's backing device (root only; FUSE's default is 128 KiB).

    Large sequential reads then arrive as 1 MiB requests served into the page
    cache, instead of 128 KiB ones. Without permission we keep the default.
    """
    try:
        dev = os.stat(mountpoint).st_dev
        path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
        with open(path, "w") as f:
            f.write(str(max(nbytes // 1024, 4)))
    except OSError as exc:
        log.debug("could not set readahead of %s: %s", mountpoint, exc)
        return False
    log.debug("readahead of %s set to %d KiB", mountpoint, nbytes // 1024)
    return True


def _state_dir() -> str:
    """Where daemon logs and mount locks go: ``$XDG_STATE_HOME/cdmlfs`` or ``~/.local/state/cdmlfs``.

    When that cannot be made or written (a read-only or missing home; ``HOME=/`` for a container run
    under an arbitrary uid), a private folder in the temporary directory (``/tmp/cdmlfs-UID``) instead:
    ``cdmlfs mount`` failed there, blaming a missing directory."""
    base = xdg.base_dir("XDG_STATE_HOME", ".local", "state")
    preferred = os.path.join(base, "cdmlfs")
    try:
        os.makedirs(preferred, exist_ok=True)
        if os.access(preferred, os.W_OK | os.X_OK):
            return preferred
    except OSError:
        pass
    fallback = private_temp_dir()
    if fallback is not None:
        return fallback
    return preferred  # the caller's check then says what is wrong with it


def log_path_for(mountpoint: str) -> str:
    """``<state>/cdmlfs/<mount point with / as _>-<hash>.log``: readable, and one file per mount point
    (``/a_b/c`` and ``/a/b_c`` shared one before the hash)."""
    path = os.path.abspath(mountpoint)
    safe = path.strip("/").replace("/", "_")[-120:] or "root"
    digest = hashlib.sha1(os.fsencode(path)).hexdigest()[:8]
    return os.path.join(_state_dir(), f"{safe}-{digest}.log")


def claim_mountpoint(mountpoint: str, notice_after: float = 1.0) -> int | None:
    """Hold a lock on ``mountpoint`` while a mount of it is being set up (see ``ServeOptions.lock_fd``).

    Two ``cdmlfs mount`` commands on one empty directory both passed the
    "already mounted" check (made before the slow archive open) and stacked two
    mounts. The lock covers only the setting up: the daemon lets go of it once its
    mount answers, and from then on the mount table says the directory is taken
    (so a lazily unmounted daemon, or one in another mount namespace, blocks
    nothing). The caller checks the mount point after this returns. The lock is
    an open file description of the directory with ``flock``: a forked daemon
    shares it and the kernel drops it when its last holder exits. Returns the fd,
    or None where no lock can be had (an unreadable directory and a read-only
    home): the mount then goes ahead without.
    """
    try:
        # The directory itself: seen by every mount command, whatever its user's state folder
        # (sudo and sudo -H, two containers sharing the folder stacked two mounts with a lock file
        # per state folder).
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # no read permission on it: a lock file in our state folder instead
        lock_dir = os.path.join(_state_dir(), "locks")
        name = hashlib.sha1(os.fsencode(os.path.realpath(mountpoint))).hexdigest()[:20] + ".lock"
        try:
            os.makedirs(lock_dir, exist_ok=True)
            fd = os.open(os.path.join(lock_dir, name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.debug("no mount point lock (%s)", exc)
            return None
    started = time.monotonic()
    noticed = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if not noticed and time.monotonic() - started >= notice_after:
                print(f"cdmlfs: waiting for another cdmlfs that is mounting {mountpoint}", file=sys.stderr)
                noticed = True
            time.sleep(0.05)


def check_log_file(log_file: str, default: bool, mountpoint: str) -> None:
    """Fail before forking (one line) when the daemon could not write its log there (the default
    log's folder is made by :func:`_state_dir`)."""
    what = f"daemon log {log_file} (set --log-file)" if default else f"--log-file {log_file}"
    _check_file_to_write(log_file, what, mountpoint)
    try:  # without blocking: opening a FIFO no process reads waited forever
        os.close(
            os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
        )
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise UsageError(f"{what}: a FIFO that no process reads") from None
        raise UsageError(f"{what}: cannot write it ({exc.strerror})") from None


def check_pid_file(pid_file: str, mountpoint: str) -> None:
    """Fail before mounting (one line) when the pid file could not be written once the mount is up.
    Nothing is created: a mount that fails must leave no pid file."""
    what = f"--pid-file {pid_file}"
    parent = _check_file_to_write(pid_file, what, mountpoint)
    if not os.access(pid_file if os.path.exists(pid_file) else parent, os.W_OK):
        raise UsageError(f"{what}: cannot write it (permission denied)")
    pid = _pid_in(pid_file)
    if pid is not None and pid != os.getpid() and _is_cdmlfs(pid):  # a stale one is overwritten
        raise UsageError(f"{what}: names cdmlfs process {pid}, still running; give another file")


def _pid_in(pid_file: str) -> int | None:
    """The process id a pid file holds (its first word), or None.

    Only a regular file is read: opening a FIFO (or a device) to read would block, or consume what
    another process waits for; such a "pid file" names no process."""
    fd = _open_regular(pid_file)
    if fd is None:
        return None
    try:
        return int(os.read(fd, 64).split()[0])
    except (OSError, ValueError, IndexError):
        return None
    finally:
        os.close(fd)


def _open_regular(path: str) -> int | None:
    """A descriptor to read ``path``, or None unless it is a regular file. Opened without blocking:
    a FIFO would block (or give away what another process waits for), /dev/full reads forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _is_cdmlfs(pid: int) -> bool:
    """Whether ``pid`` is a live cdmlfs process (not another that reused a stale file's number)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"cdmlfs" in f.read()
    except OSError:
        return False


def _check_file_to_write(path: str, what: str, mountpoint: str) -> str:
    """Not a directory, in one that exists (returned), and not under the mount point (the mount
    would hide it, and a log left there made the next mount refuse a non-empty directory);
    ``what`` names it in the one-line error."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{what}: is a directory")
    if not os.path.isdir(parent):
        raise UsageError(f"{what}: no such directory {parent}")
    inside = os.path.dirname(os.path.realpath(path))  # through a symlink too, where it lands
    mount = os.path.realpath(mountpoint)
    if inside == mount or inside.startswith(mount.rstrip("/") + "/"):
        raise UsageError(f"{what}: is inside the mount point, which the mount hides")
    return parent


def inherited_fds() -> list[int]:
    """The descriptors above 2 open now: call it before cdmlfs opens anything of its own.

    The daemon closes them. It outlives the command that started it, and a descriptor its caller
    passed down (a CI step's status pipe, bats' fd 3, ``{ cdmlfs mount ...; } 3>&1 | cat``) held
    open by the daemon kept that caller waiting for an end of file until the unmount."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    out = []
    for name in names:
        fd = int(name)
        if fd > 2:
            try:
                os.fstat(fd)
            except OSError:  # the listing's own descriptor, closed by now
                continue
            out.append(fd)
    return out


def mount_daemon(
    archive: Archive, opts: ServeOptions, log_file: str, verbose: bool, close_fds: Iterable[int] = ()
) -> int:
    """Fork a daemon that serves ``archive``; return an exit code once the mount answers (or fails).

    Interrupted while waiting (Ctrl-C, SIGTERM, SIGHUP from a closed terminal), or timed
    out, it stops the daemon and removes the mount: a command that did not succeed leaves
    nothing (a SIGHUP killed the command outright and left a daemon finishing its mount).
    A signal the caller ignores (``nohup``) stays ignored. Once the outcome is known (the
    mount answers, or the daemon is being stopped), those signals are ignored until the
    command exits: one landing in the last milliseconds killed it with the mount in place
    (a failed command that left a mount), or cut a clean-up short. The CLI exits right after.
    ``close_fds``: descriptors the caller was given (see :func:`inherited_fds`), closed in the daemon.
    """
    log_start = os.path.getsize(log_file) if os.path.exists(log_file) else 0
    rfd, wfd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    # No signal between fork and the handlers below: the child would inherit a half-done state.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    pid = os.fork()
    if pid == 0:  # child: become the daemon
        os.close(rfd)
        code = 1
        try:
            os.setsid()
            for sig in _STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            _redirect_stdio(log_file)
            for fd in close_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            _configure_daemon_logging(verbose)
            serve(archive, opts, ready_fd=wfd)
            code = 0
        except BaseException as exc:  # the parent reads the reason from the log
            logging.getLogger("cdmlfs").error("daemon failed: %s", _one_line(exc))
        finally:
            logging.shutdown()
            os._exit(code)
    os.close(wfd)
    if opts.lock_fd is not None:  # the daemon holds the mount point lock until its mount answers
        os.close(opts.lock_fd)
    ours = [sig for sig in _STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]
    try:
        for sig in ours:  # in the try: a signal taken by another thread is handled at any bytecode
            signal.signal(sig, _raise_interrupt)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        waited = _wait_ready(rfd, pid)
        ok = waited == "ready" and _answers(opts.mountpoint)
        reaped = not ok and _reaped(pid)
        _ignore_stop_signals(ours)  # decided: success with a mount, or a failure cleaned up below
    except BaseException:
        _ignore_stop_signals(ours)  # interrupted: nothing cuts the clean-up short
        _abandon(pid, opts.mountpoint)
        raise
    finally:
        os.close(rfd)
    if ok:
        if verbose:
            _notice(f"cdmlfs: mounted {archive.location} on {opts.mountpoint} (pid {pid}, log {log_file})")
        return 0
    reason = _last_log_line(log_file, log_start)
    if waited == "timeout":  # the daemon is stopped below: say so, not that it exited
        said = f" ({reason})" if reason else ""
        reason = f"no mount within {MOUNT_TIMEOUT:.0f} s; stopped the daemon{said}"
    reason = reason or "the daemon exited before the mount was ready"
    _abandon(pid, opts.mountpoint, exited=reaped)
    print(f"cdmlfs: mount failed: {reason} (log: {log_file})", file=sys.stderr)
    return 1


def _notice(text: str) -> None:
    """A line on stdout that may be full (>/dev/full): the mount is up, so the command succeeded
    (it exited 1 and left the mount behind); what is still buffered goes nowhere at exit."""
    try:
        print(text, flush=True)
    except OSError:
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class Stopped(KeyboardInterrupt):
    """A stop signal while the mount command waits: unwinds as Ctrl-C does, and exits with the
    status a kill by that signal gives (143 for SIGTERM, as extract and pack do; it was 130)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.status = 128 + signum


def _raise_interrupt(signum: int, frame: object) -> None:
    # The first stop signal decides: a second one must not interrupt the clean-up it starts.
    _ignore_stop_signals(_STOP_SIGNALS)
    raise Stopped(signum)


def _ignore_stop_signals(signals) -> None:
    """Ignore ``signals`` from now on: process-wide, unlike a signal mask (the archive may have
    started threads, and one of them would take a signal the main thread blocks)."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def _reaped(pid: int) -> bool:
    """Whether our child ``pid`` has exited (reaped now, or already by ``_wait_ready``)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done != 0


def _abandon(pid: int, mountpoint: str, exited: bool = False) -> None:
    """Stop a daemon whose mount did not succeed (or was interrupted) and remove its mount.

    ``exited``: the daemon is known to be gone and reaped (its pid may be someone else's now):
    only its mount, if one is still listed, is left to remove.
    """
    if not exited:
        _stop_child(pid)
    if is_mounted(mountpoint):
        with contextlib.suppress(CdmlfsError):
            unmount(mountpoint)


def _stop_child(pid: int) -> None:
    """SIGTERM (a serving daemon unmounts on it), then SIGKILL after 5 s; reaps it either way."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:  # already reaped (by _wait_ready): its pid may be someone else's now
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _wait_ready(rfd: int, pid: int) -> str:
    """ "ready" (the daemon says it mounted), "exited" (it failed, or said otherwise) or "timeout"."""
    deadline = time.monotonic() + MOUNT_TIMEOUT
    while time.monotonic() < deadline:
        readable, _, _ = select.select([rfd], [], [], 0.5)
        if readable:
            return "ready" if os.read(rfd, 1) == READY else "exited"
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return "exited"
    return "timeout"


def _answers(mountpoint: str) -> bool:
    try:
        os.stat(mountpoint)
        return is_mounted(mountpoint)
    except OSError:
        return False


def _redirect_stdio(log_file: str) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    out = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)


def _configure_daemon_logging(verbose: bool) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("mfusepy").setLevel(logging.WARNING if not verbose else logging.DEBUG)


class _HeldStderr:
    """File descriptor 2 sent to a temporary file until :meth:`release` puts it back."""

    def __init__(self) -> None:
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()  # noqa: SIM115 (closed by release)
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self._lock = threading.Lock()

    def release(self) -> str:
        """Put fd 2 back (once; later calls return ""): what was written to it meanwhile."""
        with self._lock:
            if self._saved < 0:
                return ""
            sys.stderr.flush()
            os.dup2(self._saved, 2)
            os.close(self._saved)
            self._saved = -1
            self._file.seek(0)
            text = self._file.read().decode("utf-8", "replace")
            self._file.close()
            return text


def libfuse_complaints(lines: Iterable[str]) -> list[str]:
    """Lines from libfuse or fusermount (not our log's errors), in order, each once.

    They say what to fix ("fuse: unknown option(s): ...", "fusermount3: option allow_other only
    allowed if ..."): our own line after them only says that libfuse failed.
    """
    said = ("fuse:", "fusermount:", "fusermount3:")
    stripped = (ln.strip() for ln in lines)
    return list(dict.fromkeys(ln for ln in stripped if any(w in ln for w in said) and "ERROR" not in ln))


LOG_TAIL = 64 << 10  # the most of a failed daemon's log read back for its last line


def _last_log_line(path: str, start: int) -> str:
    """The line that says why a daemon failed, from what it logged since ``start``. Only a regular
    file is read, and only its tail: a log on /dev/full read zeros until memory ran out."""
    fd = _open_regular(path)
    if fd is None:
        return ""
    try:
        size = os.fstat(fd).st_size
        at = max(start, size - LOG_TAIL)
        text = os.pread(fd, max(0, size - at), at).decode("utf-8", "replace")
    except OSError:
        return ""
    finally:
        os.close(fd)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    complaints = libfuse_complaints(lines)  # fusermount mounts for a user who is not root
    if complaints:
        return "; ".join(complaints)
    for ln in reversed(lines):
        if "ERROR" in ln:
            return ln.split(": ", 1)[-1]
    return lines[-1] if lines else ""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
