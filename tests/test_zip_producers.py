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
