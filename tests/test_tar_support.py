"""Helpers for the tar / tar.zst / pack tests: a tricky source tree and archives built by real tools.

(No tests here; pytest collects the module and finds none.)
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from archives import text_bytes

BIG_MTIME = 2**34  # year 2514: needs a pax mtime record (or GNU base-256)
LONG_DIR = "d" * 90 + "/" + "é" * 60 + "/" + "deep" * 20
LONG_TARGET = "../" + "t" * 140 + "/target"


def tricky_tree(root: Path, big: int = 3_000_000, seed: int = 0) -> Path:
    """Long names (> 100 bytes, > 255 in total), non-ASCII, symlinks (long target), hard links,
    empty files and directories, a big member, a big mtime, assorted modes."""
    rng = random.Random(seed)
    files = {
        "readme.txt": text_bytes(5000, seed),
        "data/random.bin": rng.randbytes(70_000),
        "data/zeros.bin": bytes(300_000),
        "data/empty.txt": b"",
        f"{LONG_DIR}/{'n' * 120}.txt": b"long name\n",
        "ünïcødé/名前.txt": "héllo wörld".encode(),
        "big/large.bin": rng.randbytes(big // 2) + text_bytes(big - big // 2, seed + 2),
        "future.txt": b"from the future\n",
    }
    for i in range(40):
        files[f"many/f{i:03d}.txt"] = text_bytes(rng.randint(0, 40_000), seed + i)
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.utime(p, (1_600_000_000, 1_600_000_000))
    os.chmod(root / "readme.txt", 0o600)
    os.chmod(root / "data/random.bin", 0o755)
    os.utime(root / "future.txt", (BIG_MTIME, BIG_MTIME))
    os.symlink("data/random.bin", root / "link_to_random")
    os.symlink(LONG_TARGET, root / "long_target_link")
    os.symlink("../readme.txt", root / "data/up_link")
    os.link(root / "many/f001.txt", root / "hardlink_a")
    os.link(root / "many/f001.txt", root / "data/hardlink_b")
    (root / "empty_dir").mkdir()
    (root / "data/empty_sub").mkdir()
    return root


def gnu_tar(out: Path, src: Path, fmt: str = "gnu", compress: list[str] | None = None) -> Path:
    """``tar --format=FMT -c`` of ``src``'s contents, optionally piped through a compressor command."""
    tar = subprocess.Popen(
        ["tar", f"--format={fmt}", "-C", str(src), "-cf", "-", "."],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    with open(out, "wb") as f:
        if compress:
            subprocess.run(compress, stdin=tar.stdout, stdout=f, check=True)
        else:
            shutil.copyfileobj(tar.stdout, f)  # type: ignore[arg-type]
    tar.stdout.close()  # type: ignore[union-attr]
    assert tar.wait() == 0
    return out


def extract(archive: Path, dest: Path) -> Path:
    """What GNU tar extracts (tar.zst through zstd)."""
    dest.mkdir(parents=True, exist_ok=True)
    args = ["tar", "-x", "-f", str(archive), "-C", str(dest)]
    if archive.name.endswith((".zst", ".tzst")):
        args.insert(1, "--zstd")
    subprocess.run(args, check=True, capture_output=True)
    return dest


def cdmlfs_pack(src: Path, out: Path, *args: str) -> Path:
    res = subprocess.run(
        [sys.executable, "-m", "cdmlfs", "pack", "-q", str(src), str(out), *args], capture_output=True
    )
    assert res.returncode == 0, res.stderr.decode()
    return out
