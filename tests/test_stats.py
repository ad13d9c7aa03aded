"""`cdmlfs stats MNT`: live counters of a real mount."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
from archives import flip_byte_in_member, python_zip, sample_files, text_bytes
from mountutil import mount_stats, mounted, run_cli

pytestmark = pytest.mark.fuse


def test_stats_count_what_was_served(both_paths: str, tmp_path: Path, mnt: Path) -> None:
    files = sample_files()
    files["bad.txt"] = text_bytes(30_000, 5)
    archive = python_zip(tmp_path / "s.zip", files)
    flip_byte_in_member(archive, "bad.txt")
    with mounted(archive, mnt, "--cache-size", "32M"):
        total = 0
        for name, data in files.items():
            if name == "bad.txt":
                with pytest.raises(OSError):
                    (mnt / name).read_bytes()
                continue
            assert (mnt / name).read_bytes() == data
            total += len(data)
        stats = mount_stats(mnt)
        assert stats["format"] == "zip"
        assert stats["entries"] == len(files) + 4  # plus data, data/nested, data/nested/deep, ünïcødé
        assert stats["bytes"]["served"] >= total
        assert stats["bytes"]["from_source"] > 0
        assert stats["requests"]["read"] >= len(files) - 2  # the empty file needs no read
        # Counted per failed request (the kernel retries a failed readahead once as a plain read).
        assert set(stats["errors"]) == {"CorruptMemberError"} and stats["errors"]["CorruptMemberError"] >= 1
        assert stats["cache"]["limit"] == 32 << 20
        assert 10 << 20 < stats["rss_bytes"] < 300 << 20
        assert stats["serving"] == "single-threaded"
        assert (stats["fast_path"] is not None) == (both_paths == "1")
        human = run_cli("stats", str(mnt), check=True).stdout.decode()
        assert "hit rate" in human and "CorruptMemberError" in human
        # A folder inside the mount: that mount's counters ("not a cdmlfs mount" before).
        inner = json.loads(run_cli("stats", "--json", str(mnt / "data" / "nested"), check=True).stdout)
        assert inner["format"] == "zip" and inner["cache"]["limit"] == 32 << 20
        res = run_cli("stats", str(tmp_path))  # a folder outside any cdmlfs mount
        assert res.returncode == 2 and b"not a cdmlfs mount" in res.stderr
        res = run_cli("stats", str(mnt / "data" / "nestde"))  # a typo: printed the mount's stats
        assert res.returncode == 2 and b"no such directory" in res.stderr, res.stderr
        link = tmp_path / "to-nested"
        link.symlink_to(mnt / "data" / "nested")  # a link to a folder inside: "not a cdmlfs mount"
        assert json.loads(run_cli("stats", "--json", str(link), check=True).stdout)["format"] == "zip"
        # Extended attributes are not supported (ls -l asks each file for its ACL and label): the
        # first getxattr answers ENOSYS and the kernel asks no more; listxattr lists none.
        requests = mount_stats(mnt)["loop"]
        for path in [mnt / name for name in files] * 3:
            for name in ("security.selinux", "user.other"):
                with pytest.raises(OSError) as exc:
                    os.getxattr(path, name)
                assert exc.value.errno == errno.EOPNOTSUPP
            with pytest.raises(OSError) as exc:  # ACLs: the kernel answers "none" itself
                os.getxattr(path, "system.posix_acl_access")
            assert exc.value.errno in (errno.ENODATA, errno.EOPNOTSUPP)
        if requests is not None:  # our loop counts every request: none per file reached the daemon
            # (getxattr once, the stats read, whatever else the kernel sends; answered by the
            # daemon, the 3 x 3 calls per file above would be 9 per file)
            assert mount_stats(mnt)["loop"]["requests"] - requests["requests"] < 3 * len(files)
        assert os.listxattr(mnt / "readme.txt") == []  # tar --xattrs and cp -a copy nothing, quietly
        tar = subprocess.run(
            ["tar", "--xattrs", "--acls", "-cf", "/dev/null", "-C", str(mnt), "."], capture_output=True
        )
        assert b"xattr" not in tar.stderr and b"acl" not in tar.stderr.lower(), tar.stderr
        # Other ioctls (Python's open() asks each file whether it is a terminal) are ENOTTY.
        with open(mnt / "readme.txt", "rb") as f:
            assert not f.isatty()
        if both_paths == "1":
            assert mount_stats(mnt)["fast_path"]["ioctl_fast"] >= 1
            os.listdir(mnt)
            assert "listings (" in run_cli("stats", str(mnt), check=True).stdout.decode()


def test_stats_on_a_plain_directory_is_a_one_line_error(tmp_path: Path) -> None:
    res = run_cli("stats", str(tmp_path))
    assert res.returncode == 2
    assert len(res.stderr.decode().strip().splitlines()) == 1


def test_bytes_read_from_a_tar_zst_count_the_compressed_frames(tmp_path: Path, mnt: Path) -> None:
    """Frames are read past the source's read_at (pread in C, or into a reused buffer): counted too."""
    import os

    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(3 << 20))  # incompressible: frames ~ as large as the data
    packed = tmp_path / "p.tar.zst"  # seekable, index embedded: mounting decodes nothing
    run_cli("pack", "-q", "--frame-size", "1M", str(src), str(packed), check=True)
    with mounted(packed, mnt, "--index-dir", str(tmp_path / "idx")):
        before = mount_stats(mnt)["bytes"]["from_source"]
        assert (mnt / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
        assert mount_stats(mnt)["bytes"]["from_source"] - before >= 3 << 20


def test_stats_replies_frame_a_long_snapshot_in_chunks() -> None:
    """An ioctl carries at most 16 KiB each way: a longer snapshot goes in pieces by offset, and a
    reader whose pieces come from two snapshots (renewed by another reader) starts over."""
    from cdmlfs import statsio

    blob = json.dumps({"errors": {f"Kind{i}": i for i in range(3000)}}).encode()
    assert len(blob) > 2 * statsio.CHUNK
    headers = []

    def daemon(buf: bytearray, number: int = 7) -> None:
        statsio.fill_reply(blob, number, memoryview(buf))
        headers.append((int.from_bytes(buf[:4], "little"), int.from_bytes(buf[4:8], "little")))

    assert statsio.gather(daemon) == json.loads(blob)
    assert len(headers) >= 3 and set(headers) == {(len(blob), 7)}
    renewals = iter((7, 8, 8, 8, 8, 8))
    assert statsio.gather(lambda buf: daemon(buf, next(renewals))) == json.loads(blob)
    assert statsio.REQUEST >> 30 == 3 and (statsio.REQUEST >> 16) & 0x3FFF == statsio.CHUNK


def test_stats_on_a_terminal_escapes_the_archive_name(tmp_path: Path, mnt: Path) -> None:
    """An archive name is the user's to choose, escape sequences and newlines included: stats
    printed it raw (the terminal obeyed the escape, the 'archive' line split in two), ls did not."""
    from test_api import _on_a_terminal

    archive = tmp_path / "we\x1b[31mird\nname.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("a.txt", b"a")
    with mounted(archive, mnt):
        shown = _on_a_terminal("stats", str(mnt))
        assert "\x1b" not in shown and "we\\x1b[31mird\\x0aname.zip'" in shown, shown
        piped = run_cli("stats", "--json", str(mnt), check=True).stdout
        assert json.loads(piped)["archive"] == str(archive)  # JSON: the name as it is
