"""Build test archives with real tools: Python's zipfile and the Info-ZIP ``zip`` command."""

from __future__ import annotations

import io
import os
import random
import subprocess
import zipfile
from pathlib import Path


class _Unseekable(io.RawIOBase):
    """A write-only stream without seek/tell: zipfile then writes data descriptors (flag bit 3)."""

    def __init__(self, f) -> None:
        self._f = f

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return self._f.write(b)


def text_bytes(n: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"tensor", b"batch", b"epoch", b"loss", b"grad", b"zip"]
    out = bytearray()
    while len(out) < n:
        out += rng.choice(words) + (b"\n" if rng.random() < 0.1 else b" ")
    return bytes(out[:n])


def sample_files(seed: int = 0) -> dict[str, bytes]:
    """A small tree with text, random, empty and unicode-named files."""
    rng = random.Random(seed)
    return {
        "readme.txt": text_bytes(5000, seed),
        "data/random.bin": rng.randbytes(70_000),
        "data/zeros.bin": bytes(300_000),
        "data/empty.txt": b"",
        "data/nested/deep/file.csv": text_bytes(20_000, seed + 1),
        "ünïcødé/名前.txt": "héllo wörld".encode(),
        "one_byte": b"x",
    }


def python_zip(
    path: Path,
    files: dict[str, bytes],
    compression: int = zipfile.ZIP_DEFLATED,
    force_zip64: bool = False,
    streamed: bool = False,
    dirs: tuple[str, ...] = (),
) -> Path:
    """Write ``files`` with zipfile; ``streamed`` writes data descriptors, ``force_zip64`` ZIP64 records."""
    with open(path, "wb") as raw:
        target = _Unseekable(raw) if streamed else raw
        with zipfile.ZipFile(target, "w", compression=compression) as zf:
            for d in dirs:
                zf.mkdir(d) if hasattr(zf, "mkdir") else zf.writestr(d.rstrip("/") + "/", b"")
            for name, data in files.items():
                info = zipfile.ZipInfo(name, date_time=(2021, 6, 15, 12, 30, 44))
                info.compress_type = compression
                info.external_attr = 0o100644 << 16
                if streamed or force_zip64:
                    with zf.open(info, "w", force_zip64=force_zip64) as w:
                        w.write(data)
                else:
                    zf.writestr(info, data)
    return path


def write_tree(
    root: Path,
    files: dict[str, bytes],
    symlinks: dict[str, str] | None = None,
    empty_dirs: tuple[str, ...] = (),
) -> Path:
    for name, data in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.utime(p, (1_600_000_000, 1_600_000_000))
    for name, target in (symlinks or {}).items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, p)
    for d in empty_dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
    return root


def infozip(path: Path, src_root: Path, level: int = 6, extra: tuple[str, ...] = ()) -> Path:
    """Archive ``src_root``'s contents with Info-ZIP ``zip -r -y`` (symlinks stored as links)."""
    subprocess.run(["zip", "-q", "-r", "-y", f"-{level}", *extra, str(path), "."], cwd=src_root, check=True)
    return path


def flip_byte_in_member(archive: Path, member: str) -> None:
    """Corrupt one byte in the middle of a member's data (not its headers): a CRC must catch it."""
    with zipfile.ZipFile(archive) as zf:
        info = zf.getinfo(member)
    with open(archive, "r+b") as f:
        f.seek(info.header_offset + 26)
        nlen, xlen = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        pos = info.header_offset + 30 + nlen + xlen + info.compress_size // 2
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))


def stored_zip_with_a_flipped_byte(path: Path, name: str, size: int) -> bytes:
    """A ZIP of one stored member of ``size`` random bytes plus ``ok.txt`` ("hello"), with one byte
    of the member flipped in the archive; returns the member's original bytes."""
    data = os.urandom(size)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(name, data)
        zf.writestr("ok.txt", b"hello")
    flip_byte_in_member(path, name)
    return data
