"""ZIPs as real producers write them, read the way Info-ZIP unzip reads them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from mountutil import run_cli

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
