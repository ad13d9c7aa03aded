"""The ``cdmlfs`` command: mount / umount / ls / cat / extract / pack / doctor.

Every failure the user can cause (bad archive, missing file, bad mount point,
bad option) ends as one line on stderr and a non-zero exit: 1 for a runtime
failure, 2 for a usage error. Tracebacks only with ``--verbose``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import re
import signal
import stat as statmod
import sys
import time
from collections.abc import Callable

from cdmlfs import __version__, fuseloop, sizes
from cdmlfs.errors import (
    CdmlfsError,
    LinkLoopError,
    MemberError,
    NotFoundError,
    PathIsADirectoryError,
    PathNotADirectoryError,
    UnsafeDestinationError,
    UsageError,
)

log = logging.getLogger("cdmlfs")

# Errors of one path named on the command line: reported, and the others are still done.
_ONE_PATH_ERRORS = (
    MemberError,
    NotFoundError,
    LinkLoopError,
    PathIsADirectoryError,
    PathNotADirectoryError,
    UnsafeDestinationError,
)


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '4096' -> bytes (binary units: 1K = 1024), as an argparse type."""
    try:
        return sizes.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number_in(cast: Callable[[str], float], low: float, high: float, what: str) -> Callable[[str], float]:
    """An argparse type: ``cast(text)`` within [low, high], else a one-line error saying ``what``."""

    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"invalid {what} {text!r} ({low:.0f} to {high:.0f})")
        return value

    return parse


_seconds = _number_in(float, 1, 86400, "time in seconds")
_poll_us = _number_in(int, 0, 1_000_000, "poll time in microseconds")
_threads = _number_in(int, 1, 1024, "thread count")
MAX_READAHEAD = 256 << 20


def _readahead(text: str) -> int:
    """0 (keep the kernel's default) or 4K to 256M: beyond that, readahead only evicts useful pages."""
    value = parse_size(text)
    if value and not 4096 <= value <= MAX_READAHEAD:
        raise argparse.ArgumentTypeError(f"invalid readahead {text!r} (0 to keep the default, or 4K to 256M)")
    return value


_NOT_FUSE_OPTIONS = {
    "raw_fi": "",
    "errors": "",
    "encoding": "",
    "operations": "",
    "mountpoint": " (give the mount point as an argument)",
    "foreground": " (use -f)",
    "nothreads": " (use --threads single)",
    "debug": " (use --debug)",
}
"""Keyword arguments of mfusepy's FUSE class that ``-o`` would otherwise reach."""
# FUSE options libfuse takes but a cdmlfs mount cannot: their failure said only "init() and
# fuse_session_new() requested different maximum read size" or "mount failed: No such file or directory".
_UNFIT_FUSE_OPTIONS = {
    "max_read": "not supported (reads are served at the size the kernel asks for)",
    "blkdev": "for file systems on a block device (fuseblk), which an archive mount is not",
}


# Options libfuse 3 takes in its config struct, which mfusepy fills in at init: a value there must
# be an integer, and a string one failed the init, so the mount served but never said it was ready.
_CONFIG_FLAGS = {"hard_remove", "use_ino", "readdir_ino", "direct_io", "nopath", "intr"}


def parse_fuse_options(values: list[str]) -> dict[str, str | bool | int]:
    opts: dict[str, str | bool | int] = {}
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, val = item.partition("=")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise UsageError(f"invalid FUSE option {item!r}")
            if key in ("rw", "ro"):  # a read-write mount answered writes with ENOSYS instead of EROFS
                if key == "rw":
                    raise UsageError("-o rw: cdmlfs mounts are read-only")
                continue
            if key in ("subtype", "fsname"):  # stats, umount and doctor find our mounts by these
                raise UsageError(f"-o {key}: cdmlfs sets it (its commands find their mounts by it)")
            if key in _NOT_FUSE_OPTIONS:  # mfusepy's own arguments: a traceback, or a changed loop
                raise UsageError(f"-o {key}: not a FUSE mount option{_NOT_FUSE_OPTIONS[key]}")
            if key in _UNFIT_FUSE_OPTIONS:
                raise UsageError(f"-o {key}: {_UNFIT_FUSE_OPTIONS[key]}")
            if key in _CONFIG_FLAGS and sep:
                raise UsageError(f"-o {item}: {key} takes no value")
            if key == "intr_signal":
                if not (sep and val.isdigit() and 1 <= int(val) <= signal.SIGRTMAX):
                    raise UsageError(f"-o {item}: takes a signal number (1-{int(signal.SIGRTMAX)})")
                opts[key] = int(val)
                continue
            opts[key] = val if sep else True
    return opts


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="cdmlfs: %(levelname)s: %(message)s"
        if not verbose
        else "%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not verbose:
        logging.getLogger("mfusepy").setLevel(logging.ERROR)


def _source_options(args: argparse.Namespace) -> dict:
    opts = {}
    for key in ("endpoint_url", "region", "no_sign_request", "profile", "addressing_style", "index_dir"):
        value = getattr(args, key, None)
        if value not in (None, False):
            opts[key] = value
    deadline = getattr(args, "read_deadline", None)
    if deadline is not None:
        from cdmlfs.sources.retry import RetryPolicy

        opts["retry"] = RetryPolicy(deadline=deadline)
    return opts


def _open_archive(args: argparse.Namespace, cache_size: int | None = None, bounded: bool = False):
    """``bounded``: decoder windows count against the cache (decoders.window_limit), as a mount's
    must (its bound is what --cache-size promises); ls, cat and extract take what zstd takes."""
    from cdmlfs import decoders
    from cdmlfs.archive import DEFAULT_CACHE_SIZE, Archive

    if not args.source:
        raise UsageError("the archive path is empty")
    progress = _progress_bar() if sys.stderr.isatty() else None
    cache_size = cache_size or getattr(args, "cache_size", None) or DEFAULT_CACHE_SIZE
    try:
        return Archive(
            args.source,
            cache_size=cache_size,
            progress=progress,
            window_limit=decoders.window_limit(cache_size) if bounded else decoders.MAX_WINDOW,
            **_source_options(args),
        )
    finally:
        if progress is not None:
            progress.close()


class _progress_bar:
    """Shows indexing progress for long scans only (no flicker for a fast ZIP directory)."""

    def __init__(self, desc: str = "indexing") -> None:
        self._bar = None
        self._desc = desc
        self._start = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            if time.monotonic() - self._start < 1.0:
                return
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=self._desc, leave=False)
        self._bar.total = total
        self._bar.n = done
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _memory_available_to_us() -> int:
    """Physical memory, or the cgroup (container) limit when lower; 0 when unknown."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        total = 0
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit)) if total else int(limit)
    except OSError:
        pass
    return total


# -- commands -------------------------------------------------------------------
def cmd_mount(args: argparse.Namespace) -> int:
    from cdmlfs.daemon import (
        ServeOptions,
        check_log_file,
        check_pid_file,
        claim_mountpoint,
        inherited_fds,
        log_path_for,
        mount_daemon,
        serve,
    )
    from cdmlfs.mountpoints import check_mountpoint
    from cdmlfs.sizes import human_bytes

    inherited = inherited_fds()  # before cdmlfs opens anything: what the daemon must not keep
    fuse_options = parse_fuse_options(args.options or [])
    nonempty = fuse_options.pop("nonempty", False)
    if nonempty is not True and nonempty is not False:  # "nonempty=0" was taken as yes
        raise UsageError(f"-o nonempty takes no value (got nonempty={nonempty})")
    if args.cache_size < (16 << 20):
        raise UsageError("--cache-size must be at least 16M")
    memory = _memory_available_to_us()
    if memory and args.cache_size > memory:
        raise UsageError(
            f"--cache-size {human_bytes(args.cache_size)} is more than this machine's memory "
            f"({human_bytes(memory)}): the cache would never be bounded"
        )
    check_mountpoint(args.mountpoint, allow_nonempty=nonempty)  # fail fast, before any wait
    lock_fd = claim_mountpoint(args.mountpoint)  # one mount being set up per directory
    mountpoint = check_mountpoint(args.mountpoint, allow_nonempty=nonempty)  # one may have finished
    log_file = args.log_file or log_path_for(mountpoint)
    if not args.foreground:
        check_log_file(log_file, default=not args.log_file, mountpoint=mountpoint)
    if args.pid_file:
        check_pid_file(args.pid_file, mountpoint)
    fuse_device = _dev_fuse_state()
    if fuse_device != DEV_FUSE_USABLE:  # before the archive opens (minutes for a large S3 scan)
        raise CdmlfsError(f"/dev/fuse is {fuse_device}")
    archive = _open_archive(args, bounded=True)
    opts = ServeOptions(
        mountpoint=mountpoint,
        threads=args.threads,
        fuse_options=fuse_options,
        debug=args.debug,
        pid_file=os.path.abspath(args.pid_file) if args.pid_file else None,
        direct_io_min=None if args.direct_io_min == 0 else args.direct_io_min,
        readahead=args.readahead,
        poll_us=args.poll_us,
        lock_fd=lock_fd,
    )
    if args.foreground:
        serve(archive, opts)
        return 0
    return mount_daemon(archive, opts, log_file, args.verbose, close_fds=inherited)


def cmd_umount(args: argparse.Namespace) -> int:
    from cdmlfs.mountpoints import unmount

    unmount(args.mountpoint, lazy=args.lazy)
    return 0


def _format_mode(mode: int) -> str:
    return statmod.filemode(mode)


def cmd_ls(args: argparse.Namespace) -> int:
    archive = _open_archive(args, cache_size=64 << 20)
    with archive:
        own = archive.stat(args.path, follow_symlinks=False)
        try:
            st = archive.stat(args.path, follow_symlinks=True)
        except (NotFoundError, LinkLoopError):  # dangling or looping: listed, as GNU ls does
            st = own
        if st.is_dir and own.is_symlink and args.long and not args.path.endswith("/"):
            st = own  # `ls -l link-to-dir` shows the link; `ls -l link-to-dir/` its contents
        if not st.is_dir:
            rows = [own]
            prefix = ""
        elif args.recursive:
            idx = archive.index
            top = idx.lookup(st.path)
            rows = [idx.stat(e) for e in idx.walk(top)]
            prefix = ""
        else:
            rows = archive.scandir(args.path)
            prefix = ""
        out = sys.stdout
        quote = _quote_for_terminal if out.isatty() else str
        # By name, as ls sorts (a tar's folders list in archive order, as its mount's readdir does).
        rows = sorted(rows, key=lambda r: r.path.split("/"))  # a folder's contents right after it
        unreadable = 0
        for r in rows:
            name = quote(r.path if args.recursive or not st.is_dir else r.path.rpartition("/")[2])
            if r.is_dir:
                name += "/"
            if args.long:
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.mtime))
                line = f"{_format_mode(r.mode)} {r.size:>12} {when} {prefix}{name}"
                if r.is_symlink:
                    try:
                        line += f" -> {quote(archive.reader.readlink(archive.index.lookup(r.path)))}"
                    except MemberError as exc:  # as GNU ls: said, listed without its target, and on
                        out.flush()
                        print(f"cdmlfs: cannot read symbolic link {_about(r.path, exc)}", file=sys.stderr)
                        unreadable += 1
                out.write(line + "\n")
            else:
                out.write(prefix + name + "\n")
    return 1 if unreadable else 0


_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape_char(c: str) -> str:
    o = ord(c)
    if 0xDC80 <= o <= 0xDCFF:  # a byte of a name that is not UTF-8 (surrogateescape)
        return f"\\x{o - 0xDC00:02x}"
    if o < 0x20 or 0x7F <= o <= 0x9F:
        return f"\\x{o:02x}"
    if 0xD800 <= o <= 0xDFFF:
        return f"\\u{o:04x}"
    return {"\\": "\\\\", "'": "\\'"}.get(c, c)


def _quote_for_terminal(name: str) -> str:
    """A name with control characters (a newline...) as GNU ls shows it on a terminal: $'a\\nb'.

    Piped output stays raw, as GNU ls's does, for scripts that read names back.
    """
    if not _UNPRINTABLE.search(name):
        return name
    return "$'" + "".join(map(_escape_char, name)) + "'"


def _about(path: str, exc: Exception) -> str:
    """One line on what went wrong with ``path``, naming it once ("nope: nope: no such..." before)."""
    why = _os_error_text(exc) if isinstance(exc, OSError) else getattr(exc, "reason", None) or str(exc)
    return why if why.startswith(f"{path}: ") else f"{path}: {why}"


def cmd_cat(args: argparse.Namespace) -> int:
    """Like cat(1): a path that fails is reported on its own line and the others are still written."""
    archive = _open_archive(args, cache_size=64 << 20)
    failed = 0
    with archive:
        out = sys.stdout.buffer
        for path in args.paths:
            try:
                with archive.open(path) as f:
                    while chunk := f.read(1 << 20):
                        out.write(chunk)
            except _ONE_PATH_ERRORS as exc:
                out.flush()  # what came before goes out before the complaint, as cat's order
                print(f"cdmlfs: {_about(path, exc)}", file=sys.stderr)
                failed += 1
        out.flush()
    return 1 if failed else 0


def _name_failed_write(exc: OSError, where: str) -> None:
    """A write that failed for lack of room names no file: say where (``main`` prints the name)."""
    if exc.filename is None and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        exc.filename = where


def cmd_extract(args: argparse.Namespace) -> int:
    if not args.directory:  # makedirs("") failed with a bare "No such file or directory"
        raise UsageError("-C needs a directory (an empty name was given)")
    if os.path.exists(args.directory) and not os.path.isdir(args.directory):
        raise UsageError(f"{args.directory}: not a directory (the -C destination)")
    if os.path.islink(args.directory) and not os.path.exists(args.directory):  # makedirs: "File exists"
        raise UsageError(
            f"{args.directory}: a symlink to {os.readlink(args.directory)!r}, which does not exist"
        )
    from cdmlfs.archive import stops_extraction

    archive = _open_archive(args, cache_size=64 << 20)
    failed: list[str] = []

    def report(member: str, exc: Exception) -> None:  # then on to the next entry, as tar -x goes on
        failed.append(member)
        print(f"cdmlfs: {_about(member, exc)}", file=sys.stderr)

    listing = args.verbose

    def list_entry(out: str) -> None:  # -v: every entry as it is written, as tar -xv
        nonlocal listing
        if listing:
            try:
                print(out, flush=True)
            except BrokenPipeError:  # `| head`: stop listing, not extracting
                _stdout_to_devnull()
                listing = False
            except OSError as exc:  # a full disk under stdout: not the destination's fault
                if exc.filename is None:
                    exc.filename = "standard output (the -v listing)"
                raise

    _exit_on_termination()  # the partial file is removed on the way out
    with archive:
        os.makedirs(args.directory, exist_ok=True)
        for path in args.paths:
            try:
                archive.extract(path, args.directory, on_error=report, on_extracted=list_entry)
            except _ONE_PATH_ERRORS as exc:  # this path only, as tar -x
                report(path, exc)
                continue
            except OSError as exc:
                if not stops_extraction(exc):  # a name taken by a directory there, ...
                    report(path, exc)
                    continue
                _name_failed_write(exc, args.directory)
                raise
    if failed:
        entries = "entry" if len(failed) == 1 else "entries"
        print(f"cdmlfs: {len(failed)} {entries} not extracted", file=sys.stderr)
        return 1
    return 0


def _exit_on_termination() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so partial output files are removed on the way out
    (killed outright, extract and pack left a large ``.partial`` file behind)."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # the status a kill by that signal gives (143 for SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup (or the caller) wants it ignored
            signal.signal(sig, stop)


def _stdout_to_devnull() -> None:
    """After a broken pipe: later writes and the flush at exit go nowhere instead of failing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def cmd_pack(args: argparse.Namespace) -> int:
    from cdmlfs.pack import pack

    _exit_on_termination()
    progress = _progress_bar("packing") if sys.stderr.isatty() else None
    try:
        summary = pack(
            args.source,
            args.output,
            level=args.level,
            frame_size=args.frame_size,
            threads=args.threads,
            force=args.force,
            progress=progress,
            **_source_options(args),
        )
    except OSError as exc:
        _name_failed_write(exc, args.output)
        raise
    finally:
        if progress is not None:
            progress.close()
    if not args.quiet:
        n = summary["frames"]
        frames = f", {n} frame{'s' if n != 1 else ''}" if n else ""
        line = (
            f"cdmlfs: packed {summary['members']} members ({sizes.human_bytes(summary['bytes'])}) into "
            f"{args.output} ({sizes.human_bytes(summary['output_bytes'])}{frames})"
            f" in {summary['seconds']:.1f}s"
        )
        with contextlib.suppress(OSError):  # 2>/dev/full: the archive is written all the same
            print(line, file=sys.stderr, flush=True)
    if summary["changed"]:  # the archive is written, but not all of it is what was listed (GNU tar: 1)
        print(f"cdmlfs: {summary['changed']} files changed while being packed (see above)", file=sys.stderr)
        return 1
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Report the active accelerators and FUSE setup (a diagnosis never crashes on a broken setup)."""
    import shutil

    from cdmlfs import fastpath, inflate

    name, detail = inflate.backend()
    print(f"cdmlfs {__version__}")
    print(f"inflate backend: {name} ({detail})")
    from cdmlfs.formats import zstdframes

    print(f"zstd frame decoder: {zstdframes.backend()}")
    from cdmlfs.formats import zip as zipfmt

    print(f"ZIP central directory: {zipfmt.parser_backend()}")
    fuse_major = None
    try:
        from cdmlfs.fuse_ops import load_mfusepy

        mfusepy = load_mfusepy()
        fuse_major = mfusepy.fuse_version_major
        print(f"libfuse: {mfusepy._libfuse_path} (version {fuse_major}.{mfusepy.fuse_version_minor})")
    except Exception as exc:
        print(f"libfuse: unavailable ({exc})")
    if fuse_major is None:  # nothing can mount: the accelerators of the FUSE path do not apply
        print("FUSE hot path: none (no libfuse)")
        print("FUSE loop: none (no libfuse)")
    else:
        fast, why = fastpath.availability(fuse_major)
        print(f"FUSE hot path: {'C' if fast else 'Python'} ({why})")
        polling, why = fuseloop.availability(fuse_major)
        print(f"FUSE loop: {'cdmlfs polling loop' if polling else 'libfuse'} ({why})")
    print(f"CPU idle: {fuseloop.cpu_idle()}")
    print(f"/dev/fuse: {_dev_fuse_state()}")
    for tool in ("fusermount3", "fusermount"):
        print(f"{tool}: {shutil.which(tool) or 'not found'}")
    print(f"allow_other for users: {_user_allow_other()}")
    return 0


DEV_FUSE_USABLE = "present, usable"


def _dev_fuse_state(path: str = "/dev/fuse") -> str:
    """Present is not enough: a user who cannot open it gets libfuse's "Permission denied" at mount."""
    if not os.path.exists(path):
        return "missing (load the fuse module, or run the container with --device /dev/fuse)"
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        return f"present but not usable by this user ({exc.strerror}; as root: chmod 0666 {path})"
    return DEV_FUSE_USABLE


def _user_allow_other(conf: str = "/etc/fuse.conf", euid: int | None = None) -> str:
    """Whether users other than root may mount with -o allow_other (a trainer running as another user
    then reads the mount), as fusermount decides it."""
    try:
        with open(conf) as f:
            on = any(line.split("#", 1)[0].strip() == "user_allow_other" for line in f)
    except OSError:
        on = False
    if (os.geteuid() if euid is None else euid) == 0:
        return "root may always use it"
    return "yes (user_allow_other is set)" if on else f"no (add user_allow_other to {conf} as root)"


STATS_TIMEOUT = 10.0  # seconds cdmlfs stats waits for the daemon's answer


def cmd_stats(args: argparse.Namespace) -> int:
    """Live counters of a mount, asked of its root (an ioctl, see cdmlfs.statsio)."""
    import json

    from cdmlfs import statsio
    from cdmlfs.mountpoints import call_within, enclosing_mount, enclosing_mount_by_name, mount_entry

    def find() -> dict[str, str] | None:
        entry = mount_entry(args.mountpoint)
        if entry is not None:
            return entry
        # A folder inside a mount: its mount's counters, as df answers for it. It must exist
        # (a typo printed the mount's stats); a link to one is followed.
        try:
            os.stat(args.mountpoint)
        except FileNotFoundError:
            return None
        except OSError:  # inside a dead mount (ENOTCONN): found below, its stats say what to do
            pass
        entry = enclosing_mount(args.mountpoint)
        if (entry is None or entry["fstype"] != "fuse.cdmlfs") and os.path.islink(args.mountpoint):
            entry = enclosing_mount(os.path.realpath(args.mountpoint)) or entry
        return entry

    def busy(mountpoint: str) -> str:
        return (
            " (its daemon is busy with a long request, or stopped: if it stays so, 'cdmlfs umount "
            f"--lazy {mountpoint}' detaches the mount)"
        )

    try:  # a folder inside a mount is looked up by its daemon: one that is stopped never answers
        entry = call_within(find, STATS_TIMEOUT)
    except TimeoutError as exc:
        held = enclosing_mount_by_name(args.mountpoint)
        hint = busy(held["mountpoint"]) if held is not None and held["fstype"] == "fuse.cdmlfs" else ""
        raise CdmlfsError(f"{args.mountpoint}: cannot read stats: {exc.strerror}{hint}") from None
    if entry is None or entry["fstype"] != "fuse.cdmlfs":
        if not os.path.lexists(args.mountpoint):
            raise UsageError(f"{args.mountpoint}: no such directory")
        raise UsageError(f"{args.mountpoint}: not a cdmlfs mount")
    mountpoint = entry["mountpoint"]  # what umount takes (it refuses a folder inside the mount)
    try:
        stats = call_within(lambda: statsio.read(mountpoint), STATS_TIMEOUT)
    except OSError as exc:
        hint = ""
        if isinstance(exc, TimeoutError):
            hint = busy(mountpoint)
        elif exc.errno == errno.ENOTCONN:
            # A daemon killed outright (SIGKILL, the OOM killer) logged nothing about it.
            hint = (
                f" (its daemon is gone: 'cdmlfs umount {mountpoint}' clears it; why: the end of its log, "
                "and for a kill by the OOM killer, dmesg)"
            )
        elif exc.errno == errno.ENOTTY:
            hint = " (its daemon does not answer this request: an older cdmlfs? remount to update it)"
        raise CdmlfsError(f"{args.mountpoint}: cannot read stats: {exc.strerror}{hint}") from None
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print(_format_stats(stats, _quote_for_terminal if sys.stdout.isatty() else str))
    return 0


def _mib(n: int | None) -> str:
    return "?" if n is None else sizes.human_bytes(n)  # 0.0 MiB read as nothing on small archives


def _format_stats(s: dict, quote: Callable[[str], str] = str) -> str:
    """``quote``: how names are shown (escaped on a terminal, as ``ls``: an archive's name is the
    user's to choose, control characters and all)."""
    c = s["cache"]
    hit = "n/a" if c["hit_rate"] is None else f"{100 * c['hit_rate']:.1f}%"
    lines = [
        f"archive   {quote(s['archive'])} ({s['format']}, {s['entries']:,} entries)",
        f"daemon    pid {s['pid']}, up {s['uptime_s']:.0f}s, {s['serving']}, RSS {_mib(s['rss_bytes'])}, "
        f"index {_mib(s['index_bytes'])}",
        f"cache     {_mib(c['held'])} of {_mib(c['limit'])} held ({c['extents']:,} extents), hit rate {hit}, "
        f"{c['evictions']:,} evictions",
        f"bytes     {_mib(s['bytes']['from_source'])} read from the archive, "
        f"{_mib(s['bytes']['served'])} served",
        "requests  " + ", ".join(f"{k} {v:,}" for k, v in sorted(s["requests"].items())),
        "errors    " + (", ".join(f"{k} {v:,}" for k, v in sorted(s["errors"].items())) or "none"),
        "open      "
        + ("not tracked (kernel no-open mode)" if s["open_files"] is None else f"{s['open_files']:,} files"),
    ]
    if s.get("fast_path"):
        f = s["fast_path"]
        listings = f"{f.get('readdir_fast', 0):,} listings ({f.get('readdir_fallback', 0):,} in Python)"
        lines.append(f"C path    {f['getattr_fast']:,} getattr, {f['read_fast']:,} reads, {listings} and "
                     f"{f.get('ioctl_fast', 0):,} ioctls served in C "
                     f"({f['getattr_fallback']:,} / {f['read_fallback']:,} passed to Python), "
                     f"{f.get('hot_extents', 0):,} decoded extents readable in C")  # fmt: skip
    if s.get("loop"):
        lp = s["loop"]
        lines.append(f"loop      polling {lp['spin_us']} us between requests: {lp['woke_spinning']:,} of "
                     f"{lp['requests']:,} requests arrived while polling, "
                     f"{lp['woke_sleeping']:,} woke it")  # fmt: skip
    if s.get("source"):
        lines.append("source    " + ", ".join(f"{k} {quote(str(v))}" for k, v in sorted(s["source"].items())))
    if s.get("decoder"):
        lines.append("decoder   " + ", ".join(f"{k} {v:,}" for k, v in sorted(s["decoder"].items())))
    return "\n".join(lines)


def _version_string() -> str:
    try:
        from cdmlfs import inflate

        name, detail = inflate.backend()
        return f"cdmlfs {__version__} (inflate: {name}, {detail})"
    except Exception:
        return f"cdmlfs {__version__}"


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (the full usage is one ``--help`` away)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="cdmlfs",
        description="Mount ZIP, tar and tar.zst archives (local or S3) as read-only directories.",
    )
    parser.add_argument("--version", action="version", version=_version_string())
    common = _OneLineParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="more logging (and tracebacks)")
    indexed = _OneLineParser(add_help=False)
    indexed.add_argument(
        "--index-dir",
        metavar="DIR",
        help="where tar / tar.zst indexes are kept so a remount needs no scan "
        "(default $XDG_CACHE_HOME/cdmlfs/index or ~/.cache/cdmlfs/index)",
    )

    def add_s3_options(p: argparse.ArgumentParser) -> None:
        # A group per subcommand: argparse mixes up groups inherited through parents=.
        g = p.add_argument_group("S3 sources (s3://BUCKET/KEY; credentials from the standard AWS chain)")
        g.add_argument("--endpoint-url", metavar="URL", help="S3-compatible endpoint; implies path style")
        g.add_argument("--region", help="bucket region (default: from the AWS profile or environment)")
        g.add_argument("--no-sign-request", action="store_true", help="anonymous requests (public buckets)")
        g.add_argument("--profile", help="AWS profile from ~/.aws/config and ~/.aws/credentials")
        g.add_argument(
            "--read-deadline",
            type=_seconds,
            metavar="SECONDS",
            help="longest one read request may take, retries and slow replies included, before it "
            "fails with EIO (default 60; a large read() through a mount is several requests)",
        )
        g.add_argument(
            "--addressing-style",
            choices=("auto", "path", "virtual"),
            help="bucket in the host name (virtual) or the path (default: path with an endpoint, else auto)",
        )

    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("mount", parents=[common, indexed], help="mount an archive as a read-only directory")
    p.add_argument("source", help="archive path or URI (data.zip, data.tar.zst, s3://bucket/data.zip)")
    p.add_argument("mountpoint", help="an existing empty directory")
    p.add_argument("-f", "--foreground", action="store_true", help="serve in the foreground (logs to stderr)")
    p.add_argument(
        "--cache-size",
        type=parse_size,
        default=512 << 20,
        metavar="SIZE",
        help="RAM for decoded data, e.g. 512M, 2G (default 512M)",
    )
    p.add_argument(
        "-o",
        dest="options",
        action="append",
        metavar="OPT[,OPT...]",
        help="FUSE mount options, e.g. allow_other",
    )
    p.add_argument(
        "--threads",
        choices=("auto", "single", "multi"),
        default="auto",
        help="FUSE serving loop: single-threaded is fastest for local files, "
        "multithreaded for network sources (default: auto)",
    )
    p.add_argument(
        "--log-file",
        help="daemon log (default $XDG_STATE_HOME/cdmlfs or ~/.local/state/cdmlfs, <mount point>-<hash>.log)",
    )
    p.add_argument(
        "--direct-io-min",
        type=parse_size,
        default=0,
        metavar="SIZE",
        help="members at least this large bypass the kernel page cache (and cannot be mmapped); "
        "0 (default) = never, which lets the kernel skip open calls entirely (fastest for many files)",
    )
    p.add_argument(
        "--readahead",
        type=_readahead,
        default=4 << 20,
        metavar="SIZE",
        help="kernel readahead for this mount when running as root (default 4M, at most 256M; "
        "0 keeps FUSE's own, 128K)",
    )
    p.add_argument(
        "--poll-us",
        type=_poll_us,
        default=fuseloop.DEFAULT_POLL_US,
        metavar="N",
        help="single-threaded loop: after each request, poll for the next one for N microseconds "
        "before sleeping, which saves waking an idle CPU "
        f"(default {fuseloop.DEFAULT_POLL_US}; 0: sleep at once)",
    )
    p.add_argument("--pid-file", help="write the serving process id here (removed on exit)")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    add_s3_options(p)
    p.set_defaults(func=cmd_mount)

    p = sub.add_parser("umount", parents=[common], help="unmount (also clears a dead mount)")
    p.add_argument("mountpoint", help="where the archive is mounted")
    p.add_argument(
        "-z",
        "--lazy",
        action="store_true",
        help="a mount still in use: detach it now; its daemon exits when the last open file is closed",
    )
    p.set_defaults(func=cmd_umount)

    p = sub.add_parser("ls", parents=[common, indexed], help="list archive contents without mounting")
    p.add_argument("source", help="archive path or URI")
    p.add_argument("path", nargs="?", default="", help="a directory inside the archive (default: its root)")
    p.add_argument("-l", "--long", action="store_true", help="mode, size, mtime")
    p.add_argument("-R", "--recursive", action="store_true", help="list subdirectories too")
    add_s3_options(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("cat", parents=[common, indexed], help="write members to stdout")
    p.add_argument("source", help="archive path or URI")
    p.add_argument("paths", nargs="+", help="members to write, in this order")
    add_s3_options(p)
    p.set_defaults(func=cmd_cat)

    p = sub.add_parser(
        "extract",
        parents=[common, indexed],
        help="copy members (or folders) out of the archive; files already there are replaced, as tar -x "
        "does; -v lists each entry written",
    )
    p.add_argument("source", help="archive path or URI")
    p.add_argument("paths", nargs="+", help="members or directories to extract")
    p.add_argument("-C", "--directory", default=".", help="destination directory (default .)")
    add_s3_options(p)
    p.set_defaults(func=cmd_extract)

    p = sub.add_parser(
        "pack",
        parents=[common, indexed],
        help="write a directory or archive as a seekable tar.zst (or .tar, .zip) that mounts instantly",
    )
    p.add_argument(
        "source",
        help="a directory, an archive (zip, tar, tar.zst), a tar.gz / tar.bz2 / tar.xz, or - for a tar "
        "stream (plain or compressed) on standard input",
    )
    p.add_argument("output", help="OUT.tar.zst (seekable zstd), OUT.tar or OUT.zip")
    p.add_argument("--level", type=int, help="compression level (zstd default 3, deflate default 6)")
    p.add_argument(
        "--frame-size",
        type=parse_size,
        metavar="SIZE",
        help="decoded bytes per zstd frame of a .tar.zst: a random read decodes at most one (default 4M)",
    )
    p.add_argument("--threads", type=_threads, help="compression threads, 1 to 1024 (default: all cores)")
    p.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary line")
    add_s3_options(p)
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("stats", parents=[common], help="live counters of a mount (cache, bytes, errors, RSS)")
    p.add_argument("mountpoint")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("doctor", parents=[common], help="show which accelerators and FUSE library are in use")
    p.set_defaults(func=cmd_doctor)
    return parser


def _usable_std_streams() -> None:
    """Closed standard descriptors (``>&-``) on /dev/null, names that are not UTF-8 written as
    their bytes: either made commands end in a traceback instead of doing their work."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            devnull = os.open(os.devnull, os.O_RDWR)
            if devnull != fd:
                os.dup2(devnull, fd)
                os.close(devnull)
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 (the process's own)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="surrogateescape" if stream is sys.stdout else "backslashreplace")


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse_command_line(argv)
    except KeyboardInterrupt:  # Ctrl-C before the command started (a traceback from its set-up)
        print("cdmlfs: interrupted", file=sys.stderr)
        return 130
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"cdmlfs: {exc}", file=sys.stderr)
        return 2
    except CdmlfsError as exc:
        if args.verbose:
            log.exception("failed")
        print(f"cdmlfs: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt as exc:
        print("cdmlfs: interrupted", file=sys.stderr)
        return getattr(exc, "status", 130)  # 128 + the signal (mount's wait: daemon.Stopped)
    except OSError as exc:
        if args.verbose:
            log.exception("failed")
        print(f"cdmlfs: {_os_error_text(exc)}", file=sys.stderr)
        return 1


def _parse_command_line(argv: list[str] | None) -> argparse.Namespace:
    """The command's arguments, with logging set up for it (argparse exits on a usage error)."""
    _usable_std_streams()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-v", "--verbose"):  # `cdmlfs -v ls ...`: as after the command
        argv = [*argv[1:2], argv[0], *argv[2:]]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Options between positionals (`ls data.zip -l sub`, `extract data.zip a -C out b`), as ls
        # and tar take them: the subcommand's parser again, intermixed. What is still unknown is
        # said by that parser, so the hint points at its own --help.
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        rest = argv[argv.index(args.command) + 1 :]
        args = sub.choices[args.command].parse_intermixed_args(rest, argparse.Namespace(command=args.command))
    _setup_logging(getattr(args, "verbose", False))
    return args


def _os_error_text(exc: OSError) -> str:
    """ "Is a directory: out/x" — os.replace(tmp, out) names both: the second is the one asked for."""
    name = exc.filename2 or exc.filename
    return f"{exc.strerror or exc}{': ' + str(name) if name else ''}"


if __name__ == "__main__":
    sys.exit(main())
