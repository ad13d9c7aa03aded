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


@pytest.mark.parametrize("size", [50_000, 3_000_000], ids=["whole", "large"])
@pytest.mark.parametrize("method", [8, *sorted(METHODS)], ids=lambda m: METHODS.get(m, "deflate"))
def test_a_failed_member_is_not_decoded_again(method: int, size: int, tmp_path: Path) -> None:
    """Once a member fails its check, later reads fail at once: a multi-GiB deflated member used to
    be inflated again (its checkpoints rebuilt) on every read, blocking the mount for seconds each."""
    content = text_bytes(size, 4)
    path = tmp_path / "m.zip"
    members = [_member("bad", method, content, crc_xor=1), craft.member("ok", b"fine")]
    path.write_bytes(craft.build_zip(members))
    with cdmlfs.open(str(path), cache_size=8 << 20) as ar:

        def source_bytes() -> int:
            return ar.source.bytes_read + ar.reader.bytes_direct

        with pytest.raises(CorruptMemberError, match="CRC"):
            ar.read("bad", 0, 4096)
        spent = source_bytes()
        assert spent > 0
        for off in (size // 3, size // 2, size - 10, 0):
            with pytest.raises(CorruptMemberError, match="CRC"):
                ar.read("bad", off, 4096)
        assert source_bytes() == spent
        assert ar.read("ok") == b"fine"


def test_a_read_error_at_a_members_end_is_not_called_corruption() -> None:
    """Past the declared size the decoder reads on to see whether more follows: a network error
    there (an S3 reset) must stay a SourceError (EIO now, fine on retry), never mark the member
    corrupt for the rest of the mount as "decodes to more bytes than declared"."""
    from cdmlfs import decoders
    from cdmlfs.errors import SourceError

    class ResetAtEnd:
        def read(self, n: int) -> bytes:
            raise SourceError("connection reset")

    class MoreData:
        def read(self, n: int) -> bytes:
            return b"x"

    class Ended:
        def read(self, n: int) -> bytes:
            raise EOFError

    with pytest.raises(SourceError):
        decoders.at_end(ResetAtEnd())
    assert not decoders.at_end(MoreData())
    assert decoders.at_end(Ended())


def test_running_out_of_memory_is_not_a_lasting_corrupt_verdict(tmp_path: Path, monkeypatch) -> None:
    """A decoder that cannot start for lack of memory leaves the member readable once memory is
    back: only damage marks a member failed for the rest of the mount."""
    from cdmlfs import decoders

    content = text_bytes(50_000, 6)
    path = tmp_path / "m.zip"
    path.write_bytes(craft.build_zip([_member("a.txt", 12, content)]))
    real = decoders._open_stream
    calls = []

    def short_of_memory(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError
        return real(*args, **kwargs)

    monkeypatch.setattr(decoders, "_open_stream", short_of_memory)
    with cdmlfs.open(str(path), cache_size=8 << 20) as ar:
        with pytest.raises(MemoryError):
            ar.read("a.txt")
        assert ar.read("a.txt") == content


def test_indexing_a_huge_deflated_member_is_announced(tmp_path: Path, caplog) -> None:
    """Its first random read inflates the whole member once (the mount waits meanwhile): the log
    says so, names the member and what avoids it, then how long it took."""
    import logging
    import zipfile

    from cdmlfs import reader

    size = reader.SLOW_INDEX_SIZE + (1 << 20)
    path = tmp_path / "big.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("zeros.bin", "w", force_zip64=True) as f:
            chunk = bytes(8 << 20)
            for _ in range(size // len(chunk)):
                f.write(chunk)
            f.write(bytes(size % len(chunk)))
        zf.writestr("small.txt", b"small")
    with caplog.at_level(logging.WARNING, logger="cdmlfs.reader"), cdmlfs.open(str(path)) as ar:
        assert ar.read("small.txt") == b"small"
        assert not caplog.records
        assert ar.read("zeros.bin", size - 10, 10) == bytes(10)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2, lines
        assert lines[0].startswith("zeros.bin: inflating all 257.0 MiB") and "cdmlfs pack" in lines[0]
        assert lines[1].startswith("zeros.bin: indexed in ")
        ar.read("zeros.bin", 0, 10)
        assert len(caplog.records) == 2  # once
