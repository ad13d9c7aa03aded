"""Process faults on real mounts: the daemon killed or stopped mid-read, many mounts at once.

tests/test_zip_mount.py covers the quiet cases (SIGTERM of an idle daemon,
SIGKILL then ``cdmlfs umount`` and a remount); these add load: readers in
threads and processes in the middle of large reads when the signal lands.
What must hold: readers finish or get an error (ENOTCONN, EIO, ...) within a
bound, never hang; the mount point is usable again; no daemon is left behind.
Every reader here is a child process with a timeout, so a hang fails the test
instead of wedging it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
from archives import python_zip, text_bytes
from mountutil import alive, daemon_pid, force_unmount, is_mounted, mounted, read_pid, run_cli

pytestmark = pytest.mark.fuse

# Reads files over and over in 64 KiB pieces; prints "done" or the errno it stopped on.
READER = r"""
import os, sys, random
root, seed, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
import time
deadline = time.monotonic() + seconds
rng = random.Random(seed)
try:
    names = sorted(os.listdir(root))  # under load this may run after the kill: an errno too
    while time.monotonic() < deadline:
        with open(os.path.join(root, rng.choice(names)), "rb", buffering=0) as f:
            while f.read(1 << 16):
                pass
    print("done", flush=True)
except OSError as exc:
    print(f"errno {exc.errno}", flush=True)
"""


@pytest.fixture(scope="module")
def big_zip(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """~60 MiB of members from 1 to 6 MiB, half stored, half deflated: reads take a while."""
    rng = random.Random(5)
    base = text_bytes(1 << 20, 5) * 7
    files = {}
    for i in range(16):
        start = rng.randrange(1 << 20)
        files[f"m{i:02d}.bin"] = base[start : start + rng.randint(1 << 20, 6 << 20)]
    path = tmp_path_factory.mktemp("faults") / "big.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for i, (name, data) in enumerate(files.items()):
            zf.writestr(name, data, zipfile.ZIP_STORED if i % 2 else zipfile.ZIP_DEFLATED)
    return path, files


def _start_readers(mnt: Path, n: int, seconds: float = 60) -> list[subprocess.Popen]:
    # Drop the page cache's copy between tests: reads must reach the daemon.
    return [
        subprocess.Popen(
            [sys.executable, "-c", READER, str(mnt), str(k), str(seconds)], stdout=subprocess.PIPE
        )
        for k in range(n)
    ]


def _outcomes(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out.append(stdout.decode().strip())
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            out.append("HUNG")
    return out


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):  # a zombie waiting for init to reap it has exited
            return True
        time.sleep(0.05)
    return False


def _reading_threads(mnt: Path, stop: threading.Event, errors: list) -> list[threading.Thread]:
    def run(seed: int) -> None:
        rng = random.Random(seed)
        names = sorted(os.listdir(mnt))
        try:
            while not stop.is_set():
                with open(mnt / rng.choice(names), "rb", buffering=0) as f:
                    while f.read(1 << 16) and not stop.is_set():
                        pass
        except OSError as exc:
            errors.append(exc.errno)

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in range(4)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("threads", ["single", "multi"])
def test_sigkill_mid_read_then_umount_and_remount(threads: str, big_zip, mnt: Path) -> None:
    archive, files = big_zip
    with mounted(archive, mnt, "--threads", threads, "--cache-size", "16M"):
        pid = daemon_pid(mnt)
        # Readers stop by themselves after 8 s: pages and dentries already in the kernel's cache
        # stay readable after the daemon dies (the files are immutable), so a reader may finish
        # ("done") instead of failing; what must never happen is a reader blocked forever.
        procs = _start_readers(mnt, 4, seconds=8)
        stop = threading.Event()
        thread_errors: list[int] = []
        workers = _reading_threads(mnt, stop, thread_errors)
        time.sleep(1.0)  # everyone is mid-read
        os.kill(pid, signal.SIGKILL)
        outcomes = _outcomes(procs, timeout=30)
        stop.set()
        for t in workers:
            t.join(timeout=20)
        assert not any(t.is_alive() for t in workers), "a reader thread hung on the dead mount"
        assert "HUNG" not in outcomes, outcomes
        assert all(o == "done" or o.startswith("errno") for o in outcomes), outcomes
        assert all(e in (errno.ENOTCONN, errno.EIO, errno.ECONNABORTED) for e in thread_errors), thread_errors
        res = run_cli("umount", str(mnt), timeout=30)
        assert res.returncode == 0, res.stderr
        assert not is_mounted(mnt)
        res = run_cli("mount", str(archive), str(mnt), "--threads", threads, timeout=60)
        assert res.returncode == 0, res.stderr
        for name in ("m00.bin", "m01.bin"):
            assert hashlib.sha256((mnt / name).read_bytes()).digest() == hashlib.sha256(files[name]).digest()


def test_umount_of_a_dead_mount_while_a_file_is_still_open(big_zip, mnt: Path) -> None:
    """A process keeps a descriptor into the dead mount: umount detaches lazily, a remount works."""
    archive, files = big_zip
    with mounted(archive, mnt):
        holder = open(mnt / "m03.bin", "rb")  # noqa: SIM115 - held open across the kill on purpose
        try:
            os.kill(daemon_pid(mnt), signal.SIGKILL)
            time.sleep(0.2)
            with pytest.raises(OSError) as e:
                holder.read(10)
            assert e.value.errno == errno.ENOTCONN
            res = run_cli("stats", str(mnt))  # says what to do, in one line
            assert res.returncode != 0 and f"cdmlfs umount {mnt}" in res.stderr.decode()
            res = run_cli("stats", str(mnt / "sub"))  # the command to run names the mount
            assert res.returncode != 0 and f"'cdmlfs umount {mnt}'" in res.stderr.decode()
            res = run_cli("umount", str(mnt / "sub" / "dir"))  # a path inside it: names the mount
            assert res.returncode != 0 and f"inside the dead mount {mnt}" in res.stderr.decode()
            res = run_cli("umount", str(mnt), timeout=30)
            assert res.returncode == 0, res.stderr
            assert not is_mounted(mnt)
            res = run_cli("mount", str(archive), str(mnt), timeout=60)
            assert res.returncode == 0, res.stderr
            assert (mnt / "m03.bin").read_bytes() == files["m03.bin"]
        finally:
            with contextlib.suppress(OSError):  # flush on close reaches the dead connection: ENOTCONN
                holder.close()


@pytest.mark.parametrize("threads", ["single", "multi"])
def test_sigterm_during_heavy_reads_unmounts_without_hanging(threads: str, big_zip, tmp_path: Path) -> None:
    archive, _files = big_zip
    mnt = tmp_path / "mnt"
    with mounted(archive, mnt, "--threads", threads, "--cache-size", "16M"):
        pid = daemon_pid(mnt)
        procs = _start_readers(mnt, 4)
        stop = threading.Event()
        thread_errors: list[int] = []
        workers = _reading_threads(mnt, stop, thread_errors)
        time.sleep(1.0)
        sent = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        assert _wait_gone(pid, 30), "daemon still running 30 s after SIGTERM"
        stopped = time.monotonic() - sent
        outcomes = _outcomes(procs, timeout=30)
        stop.set()
        for t in workers:
            t.join(timeout=20)
        assert not any(t.is_alive() for t in workers), "a reader thread hung after SIGTERM"
        assert "HUNG" not in outcomes, outcomes
        for _ in range(100):
            if not is_mounted(mnt):
                break
            time.sleep(0.05)
        # libfuse detaches the mount on SIGTERM even with files open (readers then get ENOTCONN/ENOENT).
        assert not is_mounted(mnt), "SIGTERM left the mount behind"
    print(f"SIGTERM with 8 readers ({threads}): daemon gone in {stopped:.2f}s, readers: {outcomes}")


def test_two_mounts_of_the_same_archive(big_zip, tmp_path: Path) -> None:
    archive, files = big_zip
    a, b = tmp_path / "a", tmp_path / "b"
    with mounted(archive, a, "--cache-size", "16M"), mounted(archive, b, "--cache-size", "16M"):
        assert daemon_pid(a) != daemon_pid(b)
        procs = [
            subprocess.Popen([sys.executable, "-c", READER, str(m), str(k), "2"], stdout=subprocess.PIPE)
            for k, m in enumerate((a, b, a, b))
        ]
        assert _outcomes(procs, timeout=60) == ["done"] * 4
        for name, data in files.items():
            assert (a / name).read_bytes() == data
            assert (b / name).read_bytes() == data
        os.kill(daemon_pid(a), signal.SIGKILL)  # one dying leaves the other serving
        time.sleep(0.2)
        assert (b / "m05.bin").read_bytes() == files["m05.bin"]
        assert run_cli("umount", str(a)).returncode == 0


def test_twenty_mounts_at_once(tmp_path: Path) -> None:
    """Twenty archives mounted concurrently, each serving its own bytes; all unmount, no daemon left."""
    n = 20
    archives = []
    for i in range(n):
        files = {f"f{j}.txt": text_bytes(50_000 + 1000 * j, i * 100 + j) for j in range(5)}
        archives.append((python_zip(tmp_path / f"a{i}.zip", files), files))
    mounts = [tmp_path / f"m{i}" for i in range(n)]
    for m in mounts:
        m.mkdir()
    results: list = [None] * n

    def mount(i: int) -> None:
        pid_file = tmp_path / f"m{i}.pid"
        res = run_cli("mount", str(archives[i][0]), str(mounts[i]), "--cache-size", "16M",
                      "--pid-file", str(pid_file), timeout=120)  # fmt: skip
        results[i] = (res.returncode, res.stderr.decode(), read_pid(pid_file))

    try:
        threads = [threading.Thread(target=mount, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert all(r is not None and r[0] == 0 for r in results), results
        pids = {r[2] for r in results}
        assert len(pids) == n
        for i, m in enumerate(mounts):
            for name, data in archives[i][1].items():
                assert (m / name).read_bytes() == data, (i, name)
        for m in mounts:
            res = run_cli("umount", str(m), timeout=60)
            assert res.returncode == 0, res.stderr
        assert not any(is_mounted(m) for m in mounts)
        assert all(_wait_gone(pid, 20) for pid in pids if pid), "a daemon outlived its unmount"
    finally:
        for m in mounts:
            if is_mounted(m):
                force_unmount(m)


# The real CLI, with one member's reads failing on a bug-like exception (not an OSError).
BUGGY_DAEMON = r"""
import sys
from cdmlfs import reader
real = reader.ExtentReader.read_into
def read_into(self, eid, offset, size, out):
    if self.index.paths[eid] == "bad.txt":
        raise ValueError("simulated bug")
    return real(self, eid, offset, size, out)
reader.ExtentReader.read_into = read_into
from cdmlfs.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_internal_error_is_eio_and_logged_and_the_daemon_serves_on(tmp_path: Path) -> None:
    """mfusepy answers EINVAL to exceptions that are not OSErrors; a bug of ours must read as EIO
    (what a reader expects of a failed read), leave a traceback in the log, and harm no other file."""
    archive = tmp_path / "a.zip"
    python_zip(archive, {"bad.txt": b"x" * 5000, "good.txt": b"fine"})
    mnt, pid_file, log = tmp_path / "mnt", tmp_path / "pid", tmp_path / "log"
    mnt.mkdir()
    env = dict(os.environ, CDMLFS_FASTPATH="0")  # reads go through Python, where the fault is
    res = subprocess.run(
        [sys.executable, "-c", BUGGY_DAEMON, "mount", str(archive), str(mnt), "--pid-file", str(pid_file),
         "--log-file", str(log)],
        capture_output=True, env=env, timeout=60,
    )  # fmt: skip
    pid = read_pid(pid_file)
    try:
        assert res.returncode == 0, res.stderr
        with pytest.raises(OSError) as exc:
            (mnt / "bad.txt").read_bytes()
        assert exc.value.errno == errno.EIO
        assert (mnt / "good.txt").read_bytes() == b"fine"
        assert pid is not None and alive(pid)
        text = log.read_text()
        assert "'/bad.txt' failed on an internal error (answered EIO)" in text
        assert "ValueError: simulated bug" in text
    finally:
        force_unmount(mnt)
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)
