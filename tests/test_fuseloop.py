"""The polling FUSE loop (cdmlfs._fuseloop): serves like libfuse's, polls while busy, sleeps when idle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from archives import python_zip, sample_files
from inflateutil import native_module
from mountutil import daemon_pid, is_mounted, mount_stats, mounted, run_cli

pytestmark = pytest.mark.fuse


def _many_files(n: int = 400) -> dict[str, bytes]:
    return {f"d{i % 7}/f{i:04d}.bin": os.urandom(100 + i) for i in range(n)}


def _read_all(mnt: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        with open(mnt / name, "rb", buffering=0) as f:
            assert f.read() == data, name


def test_polling_loop_serves_and_counts_requests_that_found_it_polling(tmp_path: Path, mnt: Path) -> None:
    native_module("cdmlfs._fuseloop")
    files = _many_files()
    archive = python_zip(tmp_path / "many.zip", files)
    # A window of 20 ms, far above the default: back-to-back reads land in it even when other
    # jobs load the CPUs (with 200 us, a preempted reader missed it more often than not).
    with mounted(archive, mnt, "--poll-us", "20000"):
        _read_all(mnt, files)
        loop = mount_stats(mnt)["loop"]
        assert loop is not None and loop["spin_us"] == 20000
        assert loop["requests"] >= 2 * len(files)  # a lookup and a read per file, at least
        # Back-to-back small reads: most requests arrive while the loop is still polling.
        assert loop["woke_spinning"] > loop["woke_sleeping"]
        assert (
            "loop      polling 20000 us between requests"
            in run_cli("stats", str(mnt), check=True).stdout.decode()
        )


def test_polling_loop_sleeps_when_the_mount_is_idle(tmp_path: Path, mnt: Path) -> None:
    native_module("cdmlfs._fuseloop")
    files = _many_files(100)
    archive = python_zip(tmp_path / "idle.zip", files)
    with mounted(archive, mnt, "--poll-us", "1000"):
        _read_all(mnt, files)
        proc = psutil.Process(daemon_pid(mnt))
        time.sleep(0.2)
        before = sum(proc.cpu_times()[:2])
        time.sleep(1.5)
        idle_cpu = sum(proc.cpu_times()[:2]) - before
        assert idle_cpu < 0.3, f"daemon used {idle_cpu:.2f} s of CPU in 1.5 s of idleness"
        _read_all(mnt, files)  # and wakes up again for the next request


def test_zero_poll_time_keeps_libfuse_loop_and_bad_values_are_refused(tmp_path: Path, mnt: Path) -> None:
    files = sample_files()
    archive = python_zip(tmp_path / "s.zip", files)
    with mounted(archive, mnt, "--poll-us", "0"):
        _read_all(mnt, {k: v for k, v in files.items() if not k.endswith("/")})
        assert mount_stats(mnt)["loop"] is None
    res = run_cli("mount", str(archive), str(mnt), "--poll-us", "-5")
    assert res.returncode == 2 and b"invalid poll time" in res.stderr
    assert not is_mounted(mnt)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_end_the_polling_loop_and_unmount(sig: int, tmp_path: Path, mnt: Path) -> None:
    native_module("cdmlfs._fuseloop")
    files = _many_files(50)
    archive = python_zip(tmp_path / "sig.zip", files)
    with mounted(archive, mnt):
        _read_all(mnt, files)
        pid = daemon_pid(mnt)
        os.kill(pid, sig)
        for _ in range(250):
            if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the daemon did not exit on the signal")
        assert not is_mounted(mnt)


def _sysfs(root: Path, driver: str | None, poll_ns: str | None) -> str:
    if driver is not None:
        d = root / "devices/system/cpu/cpuidle"
        d.mkdir(parents=True)
        (d / "current_driver").write_text(driver + "\n")
    if poll_ns is not None:
        p = root / "module/haltpoll/parameters"
        p.mkdir(parents=True)
        (p / "guest_halt_poll_ns").write_text(poll_ns + "\n")
    return str(root)


@pytest.mark.parametrize(
    ("driver", "poll_ns", "expect"),
    [
        ("haltpoll", "0", "guest_halt_poll_ns=0: idle vCPUs halt at once"),
        ("haltpoll", "200000", "haltpoll, polls 200000 ns before halting"),
        ("haltpoll", None, "haltpoll"),
        ("intel_idle", None, "intel_idle"),
        (None, None, "unknown (no cpuidle driver in sysfs)"),
    ],
)
def test_cpu_idle_line_reads_the_cpuidle_driver_and_halt_polling(
    tmp_path: Path, driver: str | None, poll_ns: str | None, expect: str
) -> None:
    from cdmlfs import fuseloop

    line = fuseloop.cpu_idle(_sysfs(tmp_path, driver, poll_ns))
    if poll_ns == "0":  # the costly setting: say so, and what to do about it
        assert expect in line and "echo 200000 >" in line
    else:
        assert line == expect


def test_doctor_reports_how_idle_cpus_wait() -> None:
    from cdmlfs import fuseloop

    out = run_cli("doctor", check=True).stdout.decode()
    assert f"CPU idle: {fuseloop.cpu_idle()}\n" in out


def test_doctor_without_libfuse_claims_no_fuse_accelerator(tmp_path: Path) -> None:
    """With libfuse missing nothing mounts: doctor said "FUSE hot path: C" all the same."""
    env = {**os.environ, "FUSE_LIBRARY_PATH": str(tmp_path / "no-libfuse.so")}
    out = subprocess.run(
        [sys.executable, "-m", "cdmlfs", "doctor"], env=env, capture_output=True, check=True
    ).stdout.decode()
    assert "libfuse: unavailable" in out
    assert "FUSE hot path: none" in out and "FUSE loop: none" in out


def test_doctor_says_whether_dev_fuse_can_be_opened_and_allow_other_used(tmp_path: Path) -> None:
    """ "/dev/fuse: present" for a device the user could not open (0600 on some hosts): the mount then
    failed with libfuse's "Permission denied". And whether -o allow_other is allowed to users."""
    from cdmlfs import cli

    assert cli._dev_fuse_state(str(tmp_path / "none")).startswith("missing")
    locked = tmp_path / "dir-not-a-device"
    locked.mkdir()  # opening a directory read-write fails as a device the user may not use does
    assert cli._dev_fuse_state(str(locked)).startswith("present but not usable")
    assert cli._dev_fuse_state("/dev/null") == "present, usable"
    out = run_cli("doctor", check=True).stdout.decode()
    usable = os.access("/dev/fuse", os.R_OK | os.W_OK)
    assert ("/dev/fuse: present, usable\n" in out) == usable and "allow_other for users: " in out
    conf = tmp_path / "fuse.conf"
    conf.write_text("# user_allow_other\n")
    assert cli._user_allow_other(str(conf), euid=1000).startswith("no")
    conf.write_text("user_allow_other  # trainers run as another user\n")
    assert cli._user_allow_other(str(conf), euid=1000).startswith("yes")
    assert cli._user_allow_other(str(conf), euid=0) == "root may always use it"
