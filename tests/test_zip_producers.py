"""ZIPs as real producers write them, read the way Info-ZIP unzip reads them."""

from __future__ import annotations

import os
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest
from mountutil import mounted, run_cli

import cdmlfs
from cdmlfs.errors import ArchiveFormatError


def test_split_zip_is_refused_with_how_to_join_and_one_segment_reads(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "r.bin").write_bytes(bytes(range(256)) * 1200)  # 300 KiB: three 100 KiB parts
    (src / "a.txt").write_bytes(b"hi\n")
    split = tmp_path / "split.zip"
    subprocess.run(["zip", "-q", "-0", "-s", "100k", str(split), "r.bin", "a.txt"], cwd=src, check=True)
    assert (tmp_path / "split.z01").exists()
    with pytest.raises(ArchiveFormatError, match=r"split ZIP.*zip -s 0"):
        cdmlfs.open(str(split))
    res = run_cli("ls", str(split))
    assert res.returncode != 0 and len(res.stderr.decode().strip().splitlines()) == 1
    # zip -s with a size above the archive's makes one segment (with a spanning marker): fine.
    one = tmp_path / "one.zip"
    subprocess.run(["zip", "-q", "-s", "10m", str(one), "r.bin", "a.txt"], cwd=src, check=True)
    with cdmlfs.open(str(one)) as ar:
        assert ar.read("a.txt") == b"hi\n" and ar.read("r.bin") == (src / "r.bin").read_bytes()


def _entry(zf: zipfile.ZipFile, name: str, system: int, eattr: int, data: bytes = b"x") -> None:
    info = zipfile.ZipInfo(name, (2024, 1, 2, 3, 4, 6))
    info.create_system = system
    info.external_attr = eattr
    zf.writestr(info, b"" if name.endswith("/") else data)


def test_modes_and_unix_name_bytes_as_unzip_gives_them(tmp_path: Path, mnt: Path) -> None:
    """Entries without Unix modes (Windows, FAT), Unix modes of 000, and Unix names that are not
    UTF-8: the mount shows what unzip (umask 022) extracts."""
    archive = tmp_path / "producers.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        _entry(zf, "fat_unix_bits.txt", 0, (0o100600 << 16) | 0x20)  # Python's zipfile on Windows
        _entry(zf, "fat_readonly.txt", 0, 0x21)  # DOS read-only + archive
        _entry(zf, "fat_plain.txt", 0, 0x20)
        _entry(zf, "ntfs_readonly_dir/", 11, 0x11)
        _entry(zf, "ntfs_dir/", 11, 0x10)
        _entry(zf, "unix_000", 3, 0o100000 << 16)
        _entry(zf, "unix_750", 3, 0o100750 << 16)
        for system, label in ((2, "vms"), (13, "acorn"), (16, "beos"), (19, "osx")):  # Unix bits or not
            _entry(zf, f"{label}_640", system, 0o100640 << 16)
        _entry(zf, "beos_link", 16, 0o120777 << 16, b"unix_750")
        _entry(zf, "fat_link", 0, (0o120644 << 16) | 0x20, b"unix_750")  # bits agree with DOS ones
    src = tmp_path / "src"
    src.mkdir()
    latin = os.fsdecode(b"latin\xe9.txt")  # a Linux file name that is not UTF-8
    (src / latin).write_bytes(b"latin-1 name\n")
    subprocess.run(["zip", "-q", str(archive), latin], cwd=src, check=True)  # appends, flag unset

    ref = tmp_path / "ref"
    subprocess.run(["sh", "-c", f"umask 022 && unzip -q '{archive}' -d '{ref}'"], check=True)

    def listing(root: Path) -> dict[bytes, int]:
        out = {}
        for dirpath, dirnames, filenames in os.walk(os.fsencode(root)):
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                out[os.path.relpath(full, os.fsencode(root))] = os.lstat(full).st_mode
        return out

    with mounted(archive, mnt):
        ours = listing(mnt)
    assert ours == listing(ref)
    assert ours[b"latin\xe9.txt"] == 0o100644 and ours[b"unix_000"] == 0o100000
    assert (
        ours[b"fat_readonly.txt"] == 0o100444
        and ours[b"vms_640"] == 0o100640
        and ours[b"osx_640"] == 0o100644
    )
    assert stat.S_ISLNK(ours[b"beos_link"]) and stat.S_ISLNK(ours[b"fat_link"])


def test_ntfs_timestamps_give_mtimes_to_the_100_ns(tmp_path: Path, mnt: Path) -> None:
    """7-Zip and WinZip store Windows FILETIMEs (NTFS extra field 0x000A): mtimes to 100 ns where
    the DOS time has 2 s. They win over the extended timestamp's whole seconds."""
    import struct

    when_ns = 1_714_979_289_123_456_700  # 2024-05-06 07:08:09.1234567 UTC
    filetime = when_ns // 100 + 116_444_736_000_000_000
    ntfs = struct.pack("<IHH3Q", 0, 1, 24, filetime, filetime, filetime)
    ut = struct.pack("<BI", 1, when_ns // 10**9 - 3600)  # an hour off: NTFS must win
    archive = tmp_path / "t.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name, extra in (("ntfs.txt", struct.pack("<HH", 0x000A, len(ntfs)) + ntfs),
                            ("both.txt", struct.pack("<HH", 0x5455, len(ut)) + ut
                             + struct.pack("<HH", 0x000A, len(ntfs)) + ntfs)):  # fmt: skip
            info = zipfile.ZipInfo(name, (2024, 5, 6, 9, 8, 8))
            info.extra = extra
            zf.writestr(info, b"x")
    with cdmlfs.open(str(archive)) as ar:
        for name in ("ntfs.txt", "both.txt"):
            assert abs(ar.stat(name).mtime - when_ns / 1e9) < 1e-6, name
    with mounted(archive, mnt):
        for name in ("ntfs.txt", "both.txt"):
            assert abs(os.stat(mnt / name).st_mtime_ns - when_ns) < 1000, name
    # The real producer (p7zip-full, installed by scripts/setup.sh).
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(b"y")
    os.utime(src / "f.bin", ns=(when_ns, when_ns))
    made = tmp_path / "7z.zip"
    seven_zip = ["7z", "a", "-tzip", "-mtc=on", str(made), "f.bin"]
    subprocess.run(seven_zip, cwd=src, check=True, capture_output=True)
    with cdmlfs.open(str(made)) as ar:
        assert abs(ar.stat("f.bin").mtime - when_ns / 1e9) < 1e-6
