"""bzip2, LZMA, zstd and xz ZIP members: exact bytes at any offset, and CRCs checked before any byte.

The README promises that large members of these methods (forward-only decoders) are decoded
and CRC-checked whole on their first read, before a byte is served.
"""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
from archives import text_bytes
from fuzz import craft

import cdmlfs
from cdmlfs.errors import CorruptMemberError

METHODS = {12: "bzip2", 14: "lzma", 93: "zstd", 95: "xz"}


def _member(name: str, method: int, content: bytes, crc_xor: int = 0) -> craft.ZipMember:
    data = craft.compress(method, content, lzma_dict=1 << 20)
    return craft.ZipMember(name.encode(), data, method, zlib.crc32(content) ^ crc_xor, len(content))


@pytest.mark.parametrize("method", sorted(METHODS), ids=[METHODS[m] for m in sorted(METHODS)])
def test_small_and_large_members_read_exactly_at_any_offset(method: int, tmp_path: Path) -> None:
    rng = random.Random(method)
    small = text_bytes(50_000, 1)
    large = text_bytes(3_000_000, 2) + rng.randbytes(200_000)  # above a quarter of an 8 MiB cache
    path = tmp_path / "m.zip"
    path.write_bytes(craft.build_zip([_member("small", method, small), _member("large", method, large)]))
    with cdmlfs.open(str(path), cache_size=8 << 20) as ar:
        assert ar.read("small") == small
        for _ in range(20):
            off = rng.randrange(len(large))
            n = rng.randrange(1, 400_000)
            assert ar.read("large", off, n) == large[off : off + n], (off, n)
        assert ar.read("large") == large


@pytest.mark.parametrize("method", sorted(METHODS), ids=[METHODS[m] for m in sorted(METHODS)])
def test_a_large_member_with_a_wrong_crc_serves_no_byte(method: int, tmp_path: Path) -> None:
    large = text_bytes(3_000_000, 3)
    path = tmp_path / "m.zip"
    path.write_bytes(craft.build_zip([_member("bad", method, large, crc_xor=1), craft.member("ok", b"fine")]))
    with cdmlfs.open(str(path), cache_size=8 << 20) as ar:
        for off in (0, len(large) // 2, len(large) - 10):  # the first read, and every later one
            with pytest.raises(CorruptMemberError, match="CRC"):
                ar.read("bad", off, 4096)
        assert ar.read("ok") == b"fine"
