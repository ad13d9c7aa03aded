"""The documented path rule: hostile names never escape the mount, crash it, or stop it mounting."""

from __future__ import annotations

import logging
import os
import stat
import struct
import sys
import zipfile
from pathlib import Path

import pytest
from mountutil import mounted

import cdmlfs
from cdmlfs.pathrules import normalize


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a/b/c.txt", "a/b/c.txt"),
        ("dir/", "dir"),
        ("../../etc/passwd", "etc/passwd"),
        ("/abs/path", "abs/path"),
        ("a\\b\\c", "a/b/c"),
        ("./x/./y", "x/y"),
        ("a//b///c", "a/b/c"),
        ("a/../../b", "b"),
        ("a/b/../c", "a/c"),
        ("..", ""),
        ("/", ""),
        (".hidden", ".hidden"),
        ("a/.hidden/..x", "a/.hidden/..x"),
        ("nul\x00byte", "nul_byte"),
        ("C:\\Windows\\x", "C:/Windows/x"),
    ],
)
def test_normalize(name: str, expected: str) -> None:
    assert normalize(name) == expected


def test_backslash_is_a_character_in_tar_names(tmp_path: Path) -> None:
    """GNU tar keeps ``a\\b`` as a name: packed from a directory that also holds ``a/b``, the
    mount showed one file with the other's bytes (and a repack lost one)."""
    import io
    import subprocess
    import tarfile

    assert normalize("a\\b", backslash_is_separator=False) == "a\\b"
    path = tmp_path / "bs.tar"
    with tarfile.open(path, "w") as tf:
        for name, data in (("a/b", b"slash"), ("a\\b", b"backslash")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with cdmlfs.open(str(path), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.read("a/b") == b"slash" and ar.read("a\\b") == b"backslash"
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["tar", "-xf", str(path), "-C", str(out)], check=True)
    assert (out / "a\\b").read_bytes() == b"backslash"  # GNU tar agrees
    src = tmp_path / "src"
    src.mkdir()
    (src / "a\\b").write_bytes(b"x")
    res = subprocess.run(
        [sys.executable, "-m", "cdmlfs", "pack", str(src), str(tmp_path / "o.zip")], capture_output=True
    )
    assert res.returncode != 0 and "backslash" in res.stderr.decode()  # a ZIP would split it


def test_overlong_component_is_shortened_uniquely() -> None:
    a = normalize("d/" + "é" * 200 + "a")
    b = normalize("d/" + "é" * 200 + "b")
    assert a != b
    for p in (a, b):
        comp = p.split("/")[1]
        assert len(comp.encode()) <= 255
        assert "~" in comp


def _raw_zip(path: Path, entries: list[tuple[str, bytes, int]]) -> Path:
    """Write a ZIP with exactly these names and unix modes (zipfile would sanitise nothing either,
    but we also want modes with setuid and device bits)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data, mode in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.create_system = 3
            info.external_attr = mode << 16
            zf.writestr(info, data)
    return path


HOSTILE = [
    ("../../escape.txt", b"escape", 0o100644),
    ("/absolute.txt", b"absolute", 0o100644),
    ("win\\style\\path.txt", b"backslash", 0o100644),
    ("./dot/./file.txt", b"dot", 0o100644),
    ("empty//components.txt", b"empty", 0o100644),
    ("dup.txt", b"first", 0o100644),
    ("dup.txt", b"second", 0o100644),
    ("clash", b"i am a file", 0o100644),
    ("clash/inside.txt", b"inside", 0o100644),
    ("suid.sh", b"#!/bin/sh\n", 0o104755),
    ("sgid_sticky", b"x", 0o103777),
    ("device", b"", 0o020644),
    ("long/" + "x" * 300 + ".txt", b"long", 0o100644),
    ("../", b"", 0o040755),
]


def test_hostile_names_through_the_api(tmp_path: Path) -> None:
    archive = _raw_zip(tmp_path / "hostile.zip", HOSTILE)
    with cdmlfs.open(str(archive)) as ar:
        assert ar.read("escape.txt") == b"escape"
        assert ar.read("absolute.txt") == b"absolute"
        assert ar.read("win/style/path.txt") == b"backslash"
        assert ar.read("dot/file.txt") == b"dot"
        assert ar.read("empty/components.txt") == b"empty"
        assert ar.read("dup.txt") == b"second"  # last duplicate wins
        assert ar.isdir("clash")  # a directory wins over a file of the same path
        assert ar.read("clash/inside.txt") == b"inside"
        for name in ("suid.sh", "sgid_sticky", "device"):
            mode = ar.stat(name).mode
            assert stat.S_ISREG(mode)
            assert not mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX)
        (long_name,) = ar.listdir("long")
        assert len(long_name.encode()) <= 255
        assert ar.read("long/" + long_name) == b"long"


@pytest.mark.parametrize("file_first", [True, False])
def test_a_file_hidden_by_a_directory_of_the_same_path_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, file_first: bool
) -> None:
    """README: a directory wins over a file of the same path, the file hidden with a log line. A
    file followed by an explicit entry "x/" was hidden with no line (the other order had one)."""
    entries = [("x", b"file", 0o100644), ("x/", b"", 0o040755), ("x/in.txt", b"in", 0o100644)]
    if not file_first:
        entries = entries[1:] + entries[:1]
    archive = _raw_zip(tmp_path / "clash.zip", entries)
    with caplog.at_level(logging.WARNING, logger="cdmlfs"), cdmlfs.open(str(archive)) as ar:
        assert ar.isdir("x") and ar.read("x/in.txt") == b"in"
        assert ar.listdir("") == ["x"]
    said = [r.getMessage() for r in caplog.records]
    assert any("'x'" in m and "directory of the same path" in m for m in said), said


def test_a_zip_of_only_dropped_names_opens_empty(tmp_path: Path) -> None:
    """A ZIP whose only entries are "./", "/" or "../" (names the rules drop) was refused as
    'central directory has no readable entries'; unzip, zipfile and bsdtar list it as empty."""
    archive = _raw_zip(
        tmp_path / "dots.zip", [("./", b"", 0o040755), ("/", b"", 0o040755), ("../", b"", 0o040755)]
    )
    with cdmlfs.open(str(archive)) as ar:
        assert ar.listdir("") == []
    truncated = tmp_path / "lying.zip"  # an end record counting entries over an empty directory still fails
    with zipfile.ZipFile(truncated, "w"):
        pass
    data = bytearray(truncated.read_bytes())
    data[-12:-10] = data[-14:-12] = (3).to_bytes(2, "little")
    truncated.write_bytes(bytes(data))
    with pytest.raises(cdmlfs.ArchiveFormatError, match="no readable entries"):
        cdmlfs.open(str(truncated))


@pytest.mark.fuse
def test_hostile_names_through_the_mount(tmp_path: Path, mnt: Path) -> None:
    archive = _raw_zip(tmp_path / "hostile.zip", HOSTILE)
    outside_before = set(os.listdir(tmp_path))
    with mounted(archive, mnt):
        names = set()
        for dirpath, dirnames, filenames in os.walk(mnt):
            for n in dirnames + filenames:
                full = os.path.join(dirpath, n)
                assert os.path.realpath(full).startswith(str(mnt) + "/")
                names.add(os.path.relpath(full, mnt))
        assert "escape.txt" in names and "absolute.txt" in names
        assert (mnt / "dup.txt").read_bytes() == b"second"
        assert (mnt / "clash").is_dir()
        st = os.stat(mnt / "suid.sh")
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID)
        assert stat.S_ISREG(os.stat(mnt / "device").st_mode)
        (long_name,) = os.listdir(mnt / "long")
        assert (mnt / "long" / long_name).read_bytes() == b"long"
    assert set(os.listdir(tmp_path)) - outside_before <= {".mnt.log", ".mnt.pid"}


def test_non_utf8_names_from_unix_and_dos(tmp_path: Path) -> None:
    """Unflagged names: valid UTF-8 from Unix tools stays UTF-8; names from DOS tools are cp437."""
    path = tmp_path / "names.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("placeholder_a", b"a")
        zf.writestr("placeholder_b", b"b")
    data = bytearray(path.read_bytes())
    # Rewrite both names in place (same length), clearing the UTF-8 flag; entry b claims MS-DOS origin.
    new_a = "é_utf8ness".encode()  # 11 bytes? pad to 13
    new_a = new_a + b"_" * (13 - len(new_a))
    new_b = bytes([0x82]) + b"_cp437_name"  # 0x82 is é in cp437
    new_b = new_b + b"_" * (13 - len(new_b))
    for old, new, system in ((b"placeholder_a", new_a, 3), (b"placeholder_b", new_b, 0)):
        start = 0
        while (i := data.find(old, start)) >= 0:
            data[i : i + 13] = new
            start = i + 13
        # central directory header: set version-made-by system
        cd = data.find(b"PK\x01\x02" + b"")
        while cd >= 0:
            nlen = struct.unpack_from("<H", data, cd + 28)[0]
            if bytes(data[cd + 46 : cd + 46 + nlen]) == new:
                data[cd + 5] = system
            cd = data.find(b"PK\x01\x02", cd + 4)
    path.write_bytes(bytes(data))
    with cdmlfs.open(str(path)) as ar:
        names = sorted(ar.listdir(""))
    assert new_a.decode() in names
    assert new_b.decode("cp437") in names
