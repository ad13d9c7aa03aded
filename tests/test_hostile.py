"""Hostile archives through the Python API: bombs, lying headers, impossible fields.

Each case states what must happen: a clean refusal at open time
(ArchiveFormatError, one line), or EIO on the affected member only
(a MemberError) with the rest of the archive readable — never another
exception type, wrong bytes, an allocation sized by a lying field, or a hang.
Real-mount versions of the memory-sensitive cases (VmHWM of the daemon) are in
tests/test_hostile_mount.py.
"""

from __future__ import annotations

import lzma
import resource
import struct
import zlib
from pathlib import Path

import pytest
from fuzz import craft
from fuzz.harness import MemorySource

from cdmlfs import inflate
from cdmlfs.archive import Archive
from cdmlfs.errors import MemberError


def _open(blob: bytes, tmp_path: Path | None = None, cache: int = 64 << 20) -> Archive:
    if tmp_path is None:
        return Archive(MemorySource(blob), cache_size=cache)
    path = tmp_path / "a.bin"
    path.write_bytes(blob)
    return Archive(str(path), cache_size=cache)


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def zeros_member(name: str, mib: int) -> craft.ZipMember:
    """A deflated member of ``mib`` MiB of zeros, ~1 KiB per MiB: full-flush blocks repeat byte for byte."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    zeros = bytes(1 << 20)
    for _ in range(mib):
        crc = inflate.crc32(zeros, crc)
    return craft.ZipMember(name.encode(), block * mib + b"\x03\x00", 8, crc, mib << 20)


def _lzma_member(name: str, content: bytes, header_dict: int, declared: int | None = None) -> craft.ZipMember:
    """ZIP method 14 with the dictionary size in its properties set to ``header_dict``."""
    c = lzma.LZMACompressor(lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA1, "dict_size": 1 << 16}])
    body = c.compress(content) + c.flush()
    props = bytes([0x5D]) + struct.pack("<I", header_dict)
    data = struct.pack("<BBH", 9, 20, 5) + props + body
    size = len(content) if declared is None else declared
    return craft.ZipMember(name.encode(), data, 14, zlib.crc32(content), size)


# -- compressed members that lie about their decoder's memory ---------------------------------------
def test_lzma_dictionary_from_the_header_is_cut_to_the_member_size() -> None:
    """A 4 GiB dictionary in a 12 KB member's header: decoded with a member-sized one (was MemoryError)."""
    content = b"lzma member " * 1000
    blob = craft.build_zip([_lzma_member("m", content, 0xFFFFFFFF), craft.member("ok", b"fine")])
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, hard))  # a 4 GiB reservation would fail here
    try:
        with _open(blob) as ar:
            assert ar.read("m") == content
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_lzma_dictionary_over_the_limit_is_eio_not_an_allocation() -> None:
    content = b"x" * 1000
    blob = craft.build_zip(
        [_lzma_member("big", content, 1 << 30, declared=512 << 20), craft.member("ok", b"fine")]
    )
    with _open(blob) as ar:
        with pytest.raises(MemberError, match="dictionary"):
            ar.read("big", 0, 4096)
        assert ar.read("ok") == b"fine"
