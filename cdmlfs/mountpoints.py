"""Mount-point checks and unmounting, including dead mounts left by a killed daemon."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from cdmlfs.errors import UsageError

T = TypeVar("T")


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo.
    out = []
    i = 0
    while i < len(field):
        octal = field[i + 1 : i + 4]
        if field[i] == "\\" and len(octal) == 3 and octal.isdigit():
            out.append(chr(int(octal, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts() -> list[dict[str, str]]:
    """Every mountinfo entry in mount order (mount ID, mount point, type, source); [] if unreadable."""
    out = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                parts = line.split()
                sep = parts.index("-")
                out.append(
                    {
                        "id": parts[0],
                        "mountpoint": _unescape(parts[4]),
                        "fstype": parts[sep + 1],
                        "source": _unescape(parts[sep + 2]),
                    }
                )
    except OSError:
        return []
    return out


def _resolved_above(path: str) -> str:
    """``path`` absolute, the directories above it resolved (realpath), its own name kept as it is.

    Found without touching what may be mounted at ``path`` itself: a stat of a mount point is
    answered by its daemon, and one that is stuck (stopped, deadlocked) never answers once the
    kernel's cached attributes expire (an hour), so umount and stats would hang with it. ``..``
    is resolved after the links before it, as the kernel does (``link/..`` is the link target's
    parent); a path ending in ``..`` is resolved whole."""
    path = os.fspath(path) or "."
    path = path.rstrip("/") or "/"
    if path == "/":
        return path
    head, name = os.path.split(path)
    if name == ".":  # the folder before it; "." alone is the working directory (never stat-ed)
        return _resolved_above(head) if head else os.getcwd()
    if name == "..":
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(head or "."), name)


def mount_entry(path: str) -> dict[str, str] | None:
    """The mountinfo entry whose mount point is ``path`` (last one wins), or None.

    A symlink to a mount point names that mount (its target is read only once mountinfo says the
    link itself is no mount point: reading a link never asks a daemon anything)."""
    mounts = _mounts()
    target = _resolved_above(path)
    for _ in range(40):  # the kernel's limit on links followed in one path
        found = None
        for entry in mounts:
            if entry["mountpoint"] == target:
                found = entry
        if found is not None:
            return found
        try:
            link = os.readlink(target)
        except OSError:  # not a link (EINVAL), missing, or inside a dead mount
            return None
        target = _resolved_above(os.path.join(os.path.dirname(target), link))
    return None


def _innermost_mount(target: str, at_it_too: bool) -> dict[str, str] | None:
    """The mountinfo entry with the longest mount point above ``target`` (or equal to it, with
    ``at_it_too``); the last of equal ones wins."""
    found = None
    for entry in _mounts():
        mp = entry["mountpoint"]
        inside = target.startswith(mp.rstrip("/") + "/") or (at_it_too and target == mp)
        if inside and (found is None or len(mp) >= len(found["mountpoint"])):
            found = entry
    return found


def enclosing_mount(path: str) -> dict[str, str] | None:
    """The mountinfo entry of the innermost mount holding ``path`` below its mount point, or None
    (``cdmlfs stats MNT/train`` answered "not a cdmlfs mount")."""
    return _innermost_mount(_resolved_above(path), at_it_too=False)


def enclosing_mount_by_name(path: str) -> dict[str, str] | None:
    """The innermost mount whose mount point is ``path`` or above it, by name alone (``path``
    made absolute, no link read): for naming a mount whose daemon does not answer lookups."""
    return _innermost_mount(os.path.abspath(path), at_it_too=True)


def _is_dead(path: str) -> bool:
    # statvfs always reaches the daemon; stat of the mount root may be answered from the attr cache.
    try:
        os.statvfs(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def _is_fuse(fstype: str) -> bool:
    """A FUSE file system ("fuse", "fuseblk", "fuse.cdmlfs"), not the FUSE control one ("fusectl")."""
    return fstype in ("fuse", "fuseblk") or fstype.startswith("fuse.")


def is_mounted(path: str) -> bool:
    return mount_entry(path) is not None


def check_mountpoint(path: str, allow_nonempty: bool = False) -> str:
    """Validate a mount point before doing any work; returns its absolute path."""
    entry = mount_entry(path)
    # A bind mount or container volume is a fine place to mount on; another FUSE mount is not. Found
    # in mountinfo first: a FUSE mount whose daemon is stuck would never answer a stat.
    if entry is not None and _is_fuse(entry["fstype"]):
        if _dead_within(path, DEAD_PROBE_SECONDS):
            raise UsageError(f"{path}: a dead mount is still attached here; run 'cdmlfs umount {path}' first")
        raise UsageError(f"{path}: already mounted ({entry['source']}); unmount it first")
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise UsageError(f"{path}: inside a dead mount; 'cdmlfs umount' the one above it first") from None
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise UsageError(f"{path}: mount point does not exist") from None
        raise UsageError(f"{path}: cannot reach the mount point ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{path}: mount point is not a directory")
    real = os.path.realpath(path)
    if not allow_nonempty:
        try:
            with os.scandir(real) as it:
                if next(it, None) is not None:
                    raise UsageError(f"{path}: mount point is not empty (use -o nonempty to mount over it)")
        except PermissionError:
            raise UsageError(f"{path}: cannot read mount point (permission denied)") from None
    return real


def unmount(path: str, timeout: float = 10.0, lazy: bool = True) -> None:
    """Unmount a cdmlfs mount, live or dead; lazy unmount as the last resort.

    ``lazy=False`` (``cdmlfs umount`` without ``--lazy``): a live mount that is
    busy (a process has a file open or its working directory inside) is not
    detached behind its users' backs: the call fails and says so. A dead mount
    is always detached, lazily if it must: nothing can be read from it anyway.

    Anything else mounted there (another FUSE file system, a tmpfs, a disk, a bind
    mount) is refused: as root, ``umount`` would take it down too.
    """
    # Nothing here may wait on a daemon without a time limit: resolving a path inside a stopped
    # daemon's mount (a folder of it given by mistake) never returned, nor did a statvfs there.
    try:
        entry = call_within(lambda: mount_entry(path), DEAD_PROBE_SECONDS)
        # fusermount refuses a symlink (it unmounts with UMOUNT_NOFOLLOW): the mount point itself.
        target = entry["mountpoint"] if entry is not None else call_within(lambda: _resolved_above(path), 1.0)
    except TimeoutError:
        raise UsageError(f"{path}: not a mount point, inside a mount that does not answer") from None
    if entry is None and not _dead_within(target, DEAD_PROBE_SECONDS):
        try:
            exists = call_within(lambda: os.path.lexists(target), DEAD_PROBE_SECONDS)
        except TimeoutError:
            exists = True
        if not exists:
            raise UsageError(f"{path}: no such directory")
        try:  # a folder of a live mount given by mistake: name the mount to unmount
            above = call_within(lambda: _innermost_mount(target, at_it_too=False), DEAD_PROBE_SECONDS)
        except TimeoutError:
            above = None
        if above is not None and above["fstype"] == "fuse.cdmlfs":  # not the / of fuse-overlayfs
            mp = above["mountpoint"]
            raise UsageError(f"{path}: not a mount point but a path inside {mp}; run 'cdmlfs umount {mp}'")
        raise UsageError(f"{path}: not mounted")
    if entry is None:  # dead, but not a mount point itself: a path inside a dead mount?
        parent = os.path.dirname(target)
        while parent != os.path.dirname(parent):
            above = mount_entry(parent)
            if above is not None:
                if _is_fuse(above["fstype"]) and _dead_within(parent, DEAD_PROBE_SECONDS):
                    raise UsageError(f"{path}: inside the dead mount {parent}; run 'cdmlfs umount {parent}'")
                break
            parent = os.path.dirname(parent)
    if entry is not None and not _is_fuse(entry["fstype"]):
        raise UsageError(f"{path}: not a FUSE mount ({entry['fstype']}); unmount it with umount yourself")
    if entry is not None and entry["fstype"] != "fuse.cdmlfs":  # every cdmlfs mount has that subtype
        raise UsageError(
            f"{path}: not a cdmlfs mount ({entry['fstype']}, {entry['source']}); unmount it with "
            "fusermount -u yourself"
        )
    # Wait for this mount to go, not for the path to be no mount point at all: a cdmlfs mount
    # stacked on a bind mount or tmpfs leaves that one there, and must not take it down too.
    mount_id = (entry["id"], entry["mountpoint"]) if entry is not None else None
    tools = [tool for tool in ("fusermount3", "fusermount") if shutil.which(tool)]
    attempts = [[tool, "-u", target] for tool in tools]
    # Busy (a process has a file open or its cwd inside): detach now, free when the last user leaves.
    detach = [[tool, "-uz", target] for tool in tools]
    if not tools and os.geteuid() == 0 and shutil.which("umount"):
        # Only without fusermount: util-linux umount asks the file system for statfs first, which
        # waits forever on a daemon that is stuck.
        attempts.append(["umount", target])
        detach.append(["umount", "-l", target])
    errors: list[str] = []

    def done(cmds: list[list[str]]) -> bool:
        for cmd in cmds:
            if _gone(target, mount_id):  # an earlier attempt did it after all, late
                return True
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
            except subprocess.TimeoutExpired:
                errors.append(f"{cmd[0]} did not finish in {COMMAND_TIMEOUT:.0f} s (is the daemon stuck?)")
                continue
            if res.returncode == 0 and _wait_unmounted(target, mount_id, timeout):
                return True
            errors.append((res.stderr or res.stdout).strip())
        return False

    if done(attempts):
        return
    # A plain unmount needs nothing of the daemon; asking it whether it is dead does: only now,
    # and never waiting on one that is stuck (that one is busy, not dead: --lazy is the way).
    dead = not lazy and _dead_within(target, DEAD_PROBE_SECONDS)
    if dead:
        # A dead mount is detached lazily, but not with a live mount inside it: that one (and its
        # readers) would go too, which only --lazy may do.
        live_inside = [
            e["mountpoint"]
            for e in _mounts()
            if e["mountpoint"].startswith(target.rstrip("/") + "/")
            and not _dead_within(e["mountpoint"], DEAD_PROBE_SECONDS)
        ]
        if live_inside:
            raise UsageError(
                f"{path}: dead, but {live_inside[0]} is mounted inside it and still serves; unmount that "
                f"first, or 'cdmlfs umount --lazy {path}' detaches both now"
            )
    if (lazy or dead) and done(detach):
        return
    detail = next((e for e in errors if e), "unknown error")
    if not lazy and "busy" in detail.lower():
        inner = [e["mountpoint"] for e in _mounts() if e["mountpoint"].startswith(target.rstrip("/") + "/")]
        if inner:
            raise UsageError(
                f"{path}: busy: {inner[0]} is mounted inside it; unmount that first, or "
                f"'cdmlfs umount --lazy {path}' detaches both now"
            )
        raise UsageError(
            f"{path}: busy (a process has a file open or its working directory in it; 'fuser -vm {path}' "
            f"lists them): close them, or 'cdmlfs umount --lazy {path}' detaches it now and its daemon "
            "exits when the last one is done"
        )
    raise UsageError(f"{path}: could not unmount: {detail}")


DEAD_PROBE_SECONDS = 2.0
COMMAND_TIMEOUT = 30.0


def call_within(fn: Callable[[], T], seconds: float) -> T:
    """``fn()``, or TimeoutError once ``seconds`` have passed without its answer.

    For calls that ask a daemon through its mount: such a wait is in the kernel, which only SIGKILL
    interrupts, and a stopped or stuck daemon never answers. So ``fn`` runs on a daemon thread that
    is left behind when it does not finish (it never holds the process at exit); its exception, if
    it raises in time, is raised here."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append((False, exc))

    worker = threading.Thread(target=run, name="cdmlfs-ask-mount", daemon=True)
    worker.start()
    worker.join(seconds)
    if not outcome:
        raise TimeoutError(errno.ETIMEDOUT, f"no answer within {seconds:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _dead_within(path: str, seconds: float) -> bool:
    """``_is_dead``, but a daemon that does not answer in time counts as alive (and stuck)."""
    try:
        return call_within(lambda: _is_dead(path), seconds)
    except TimeoutError:
        return False


def _gone(path: str, mount_id: tuple[str, str] | None) -> bool:
    """Whether the mount we set out to remove is gone: by mount ID and mount point when we know
    them (the kernel hands a freed ID to the next mount at once, wherever it is)."""
    if mount_id is None:
        return not is_mounted(path)
    return all((entry["id"], entry["mountpoint"]) != mount_id for entry in _mounts())


def _wait_unmounted(path: str, mount_id: tuple[str, str] | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(path, mount_id):
            return True
        time.sleep(0.02)
    return False
