"""Large stored members are CRC-checked once all their bytes were read, in whatever order."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
from archives import stored_zip_with_a_flipped_byte

import cdmlfs
from cdmlfs.crc_coverage import CrcCoverage, crc32_combine
from cdmlfs.errors import CorruptMemberError


def test_combine_matches_the_crc_of_the_concatenation() -> None:
    rng = random.Random(1)
    for _ in range(300):
        a, b = rng.randbytes(rng.randint(0, 5000)), rng.randbytes(rng.randint(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = 5 << 30  # the length only enters as a power of x: no need for the bytes
    assert crc32_combine(zlib.crc32(b"x"), 0, 0) == zlib.crc32(b"x")
    assert crc32_combine(0, 0, big) == 0


@pytest.mark.parametrize("order", ["forwards", "backwards", "shuffled", "overlapping", "again from 0"])
def test_the_crc_comes_once_every_byte_was_read(order: str) -> None:
    rng = random.Random(order)
    data = rng.randbytes(1 << 20)
    chunks = [(o, 65536) for o in range(0, len(data), 65536)]
    if order == "backwards":
        chunks.reverse()
    elif order == "shuffled":
        rng.shuffle(chunks)
    elif order == "overlapping":
        chunks = [(rng.randrange(len(data)), rng.randint(1, 200_000)) for _ in range(400)] + [(0, len(data))]
    elif order == "again from 0":
        chunks = [(0, 4096), (0, 4096), *chunks]
    cov = CrcCoverage(len(data))
    results = [cov.add(o, data[o : o + n]) for o, n in chunks]
    done = [i for i, r in enumerate(results) if r is not None]
    assert done and results[done[0]] == zlib.crc32(data)
    covered = bytearray(len(data))
    for o, n in chunks[: done[0]]:
        covered[o : o + n] = b"\1" * len(covered[o : o + n])
    assert 0 in covered  # never before the last missing byte came


def test_runs_are_bounded() -> None:
    cov = CrcCoverage(1 << 20, max_runs=4)
    for k in range(10):
        assert cov.add(k * 4096 * 2, b"x" * 4096) is None
    assert len(cov._starts) == 4


@pytest.mark.parametrize("how", ["head then all", "out of order"])
def test_a_flipped_byte_in_a_large_stored_member_is_caught_on_any_full_pass(how: str, tmp_path: Path) -> None:
    """One running CRC from offset 0 missed a member read again from 0 after a partial read, or
    read out of order: every byte was served, wrong, and no error came."""
    archive = tmp_path / "big.zip"
    data = stored_zip_with_a_flipped_byte(archive, "big", 6 << 20)
    with cdmlfs.open(str(archive), cache_size=4 << 20) as ar:  # too large for a whole-member check
        with pytest.raises(CorruptMemberError):
            if how == "head then all":
                ar.read("big", 0, 4096)
                with ar.open("big") as f:
                    while f.read(1 << 20):
                        pass
            else:
                offsets = list(range(0, len(data), 1 << 20))
                random.Random(3).shuffle(offsets)
                for off in offsets:
                    ar.read("big", off, 1 << 20)
        with pytest.raises(CorruptMemberError):  # and from now on, whatever the offset
            ar.read("big", 0, 10)
        assert ar.read("ok.txt") == b"hello"
