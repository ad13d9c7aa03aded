"""Test helpers: run the real CLI, mount for real, always unmount, compare trees."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

CDMLFS = [sys.executable, "-m", "cdmlfs"]


def run_cli(*args: str, check: bool = False, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([*CDMLFS, *args], capture_output=True, timeout=timeout, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"cdmlfs {' '.join(args)} failed ({res.returncode}): {res.stderr.decode()}")
    return res


def is_mounted(path: str | os.PathLike) -> bool:
    # The parent resolved, not the mount point itself: a stat there waits on a stopped daemon.
    parent, name = os.path.split(os.fspath(path).rstrip("/"))
    target = os.path.join(os.path.realpath(parent or "."), name)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def force_unmount(path: str | os.PathLike) -> None:
    """Unmount whatever is at ``path``: fusermount, then lazy as the last resort."""
    for cmd in (
        ["fusermount3", "-u", str(path)],
        ["fusermount", "-u", str(path)],
        ["umount", "-l", str(path)],
    ):
        if not is_mounted(path):
            return
        subprocess.run(cmd, capture_output=True)
        for _ in range(50):
            if not is_mounted(path):
                return
            time.sleep(0.02)


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """True while the process runs (a zombie waiting for init to reap it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process: what its work cost, however busy the machine is
    (wall time around a read also counts starting the reader and waiting for a core)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def mounted(
    archive: str | os.PathLike, mountpoint: Path, *extra: str, log_file: Path | None = None
) -> Iterator[Path]:
    """Mount with the real CLI (daemonised); always unmount and kill only the daemon we started."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    pid_file = mountpoint.parent / f".{mountpoint.name}.pid"
    log_file = log_file or mountpoint.parent / f".{mountpoint.name}.log"
    res = run_cli(
        "mount",
        str(archive),
        str(mountpoint),
        "--pid-file",
        str(pid_file),
        "--log-file",
        str(log_file),
        *extra,
    )
    if res.returncode != 0:
        force_unmount(mountpoint)
        raise AssertionError(f"mount failed ({res.returncode}): {res.stderr.decode().strip()}")
    pid = read_pid(pid_file)
    try:
        yield mountpoint
    finally:
        force_unmount(mountpoint)
        if pid is not None:
            await_exit(pid)


def await_exit(pid: int, seconds: float = 5.0) -> None:
    """Give a daemon that was told to go ``seconds`` to exit, then kill it (only ours are passed)."""
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            _kill(pid)
            return
        time.sleep(0.02)


def mount_stats(mountpoint: Path) -> dict:
    """``cdmlfs stats --json`` of a live mount."""
    return json.loads(run_cli("stats", "--json", str(mountpoint), check=True).stdout)


def daemon_pid(mountpoint: Path) -> int | None:
    return read_pid(mountpoint.parent / f".{mountpoint.name}.pid")


def tree(root: Path, with_mtime: bool = True, dir_mtime: bool = False) -> dict[str, tuple]:
    """path -> (kind, perms, size, content-or-target, mtime) for everything below root."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            rel = str(full.relative_to(root))
            st = full.lstat()
            mtime = int(st.st_mtime) if with_mtime else None
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", None, None, os.readlink(full), None)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), None, None, mtime if dir_mtime else None)
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), st.st_size, full.read_bytes(), mtime)
    return out


def unzip(archive: str | os.PathLike, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["unzip", "-qq", "-o", str(archive), "-d", str(dest)], check=True, capture_output=True)
    return dest


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM")
