"""ratarmount, the benchmarks' baseline, in a venv of its own: installed with pip when missing,
and run in the foreground for one measurement.

Shared by bench_zip, bench_tar and bench_s3 so that they install and run it the same way; bench_s3
asks for s3fs too (ratarmount's S3 support: without it every ``s3://`` mount fails with "fsspec was
not found", and a venv another benchmark made has none).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_VENV = Path("/tmp/bench-venvs/ratarmount")


def _say(msg: str) -> None:
    print(msg, flush=True)


RATARMOUNT_VERSION = "1.3.0"  # the baseline measured: pinned, so runs compare with the same peer


def ensure_ratarmount(
    venv: Path = DEFAULT_VENV, extras: tuple[str, ...] = (), say: Callable[[str], object] = _say
) -> Path | None:
    """``venv``'s ratarmount with the packages ``extras`` (importable under those names),
    installing what is missing; None when pip cannot, and the caller skips ratarmount."""
    exe = venv / "bin" / "ratarmount"
    python = venv / "bin" / "python"
    if exe.exists() and all(
        subprocess.run([str(python), "-c", f"import {name}"], capture_output=True).returncode == 0
        for name in extras
    ):
        return exe
    say(f"installing {' and '.join(('ratarmount', *extras))} into {venv} ...")
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pinned = f"ratarmount=={RATARMOUNT_VERSION}"
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", pinned, *extras], check=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        say(f"ratarmount unavailable ({exc}): skipping its baselines")
        return None
    return exe if exe.exists() else None


class ForegroundMount:
    """A FUSE server that serves in the foreground (ratarmount needs ``-f``: it refuses to
    daemonise once it has threads open), for one measurement.

    Started with Popen, its output to ``log`` (a pipe nobody reads would stall it once warnings
    fill it); ready once the mount point lists; on exit unmounted, then awaited for 30 s and killed
    after that, so the next measurement never shares the cores with a server tearing down.
    ``mount_s``: seconds from start to ready. The benchmarks put tests/ on sys.path for mountutil.
    """

    def __init__(
        self, cmd: list[str], mnt: Path, log: Path, env: dict[str, str] | None = None, timeout: float = 900
    ) -> None:
        self.cmd, self.mnt, self.log, self.env, self.timeout = cmd, mnt, log, env, timeout
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None  # the last server started (its RSS is read while it serves)
        self.mount_s = float("nan")

    def __enter__(self) -> ForegroundMount:
        from mountutil import is_mounted

        self.mnt.mkdir(parents=True, exist_ok=True)
        unmount(self.mnt)
        started = time.perf_counter()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        self.pid = self.proc.pid
        try:
            while not (is_mounted(self.mnt) and _lists(self.mnt)):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.cmd[0]} exited with {self.proc.returncode}: {self._tail()}")
                if time.perf_counter() - started > self.timeout:
                    raise RuntimeError(
                        f"{self.cmd[0]} did not mount within {self.timeout:.0f} s: {self._tail()}"
                    )
                time.sleep(0.02)
        except BaseException:
            self.__exit__()
            raise
        self.mount_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc: object) -> None:
        unmount(self.mnt)
        if self.proc is not None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def _tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return f"(no log at {self.log})"


def unmount(mnt: Path) -> None:
    """Unmount whatever serves ``mnt`` (the benchmarks' mounts, ours and ratarmount's).

    Politely first, for a while: a mount still busy for a moment (a reader's last close) refuses,
    and a lazy unmount would leave its server serving the detached mount until killed. Then
    mountutil's last resorts. The benchmarks put tests/ on sys.path for mountutil.
    """
    from mountutil import force_unmount, is_mounted

    for _ in range(50):
        if not is_mounted(mnt):
            return
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        time.sleep(0.05)
    force_unmount(mnt)


def _lists(mnt: Path) -> bool:
    try:
        os.listdir(mnt)
        return True
    except OSError:
        return False
