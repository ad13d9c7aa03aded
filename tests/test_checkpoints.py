"""DeflateCheckpoints: random access inside deflated members, both backends.

``backend`` is the compiled extension (zran with zlib in C) or None (the pure
Python decompressobj.copy() fallback); every test runs on both and the results
must be the same bytes, and the same errors.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
from inflateutil import deflate, english_like, native_module
from parallel import run_in_threads

from cdmlfs import inflate
from cdmlfs.checkpoints import SNAPSHOT_BYTES, DeflateCheckpoints
from cdmlfs.errors import CorruptMemberError, SourceError


@pytest.fixture(params=["native", "python"])
def backend(request):
    return native_module() if request.param == "native" else None


class Archive:
    """A member at a non-zero offset in a byte blob, read through read_at like a file."""

    def __init__(self, comp: bytes, prefix: int = 1234) -> None:
        self.blob = b"P" * prefix + comp + b"after the member"
        self.offset = prefix
        self.comp_size = len(comp)
        self.reads: list[tuple[int, int]] = []

    def read_at(self, offset: int, length: int) -> bytes:
        self.reads.append((offset, length))
        return self.blob[offset : offset + length]


def build(backend, arch: Archive, data: bytes, spacing: int, **kw) -> DeflateCheckpoints:
    size = kw.pop("size", len(data))
    crc = kw.pop("crc", zlib.crc32(data))
    return DeflateCheckpoints._build(
        backend, arch.read_at, arch.offset, arch.comp_size, size, crc, spacing, None
    )


def check_all(cp: DeflateCheckpoints, arch: Archive, data: bytes, seed: int = 0, reads: int = 60) -> None:
    """Every interval, and random (offset, length) reads, equal slices of the full inflate."""
    sp = cp.spacing
    assert cp.interval_count() == -(-len(data) // sp)
    for k in range(cp.interval_count()):
        assert cp.decode_interval(arch.read_at, k) == data[k * sp : (k + 1) * sp], k
    rnd = random.Random(seed)
    for _ in range(reads):
        off = rnd.randrange(max(1, len(data)))
        n = rnd.choice((1, 4096, rnd.randrange(3 * sp)))
        assert cp.read(arch.read_at, off, n) == data[off : off + n], (off, n)


TEXT = english_like(6 << 20, 1)
NOISE = random.Random(2).randbytes(1 << 20)


@pytest.mark.parametrize(
    ("name", "data", "level", "spacing"),
    [
        ("text", TEXT, 6, 1 << 20),
        ("text-level1", TEXT[: 2 << 20], 1, 300_000),
        ("text-level9", TEXT[: 2 << 20], 9, 1 << 20),
        ("incompressible", NOISE, 6, 100_000),
        ("stored-only", NOISE[:500_000], 0, 64 << 10),
        ("tiny-spacing", TEXT[:400_000], 6, 5000),  # many intervals inside one deflate block
        ("one-interval", TEXT[:300_000], 6, 4 << 20),
        ("exact-multiple", TEXT[: 4 << 20], 6, 1 << 20),
        (
            "mixed",
            TEXT[:1_000_000] + NOISE[:300_000] + bytes(2_000_000) + TEXT[1_000_000:1_500_000],
            6,
            333_333,
        ),
        ("one-byte", b"z", 6, 4 << 20),
    ],
)
def test_intervals_and_random_reads_equal_full_inflate(backend, name, data, level, spacing):
    arch = Archive(deflate(data, level))
    cp = build(backend, arch, data, spacing)
    check_all(cp, arch, data)


def test_flushed_segments(backend):
    data = TEXT[: 3 << 20]
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    comp = b"".join(
        c.compress(data[i : i + 700_000]) + c.flush(zlib.Z_FULL_FLUSH if i % 2 else zlib.Z_SYNC_FLUSH)
        for i in range(0, len(data), 700_000)
    )
    arch = Archive(comp + c.flush())
    check_all(build(backend, arch, data, 1 << 20), arch, data)


def test_empty_members(backend):
    for comp in (b"", b"\x03\x00"):
        arch = Archive(comp)
        cp = build(backend, arch, b"", 1 << 20)
        assert cp.interval_count() == 0
        assert cp.read(arch.read_at, 0, 100) == b""


def test_real_file_and_progress(backend, tmp_path):
    data = TEXT[: 3 << 20]
    comp = deflate(data)
    path = tmp_path / "member.bin"
    path.write_bytes(b"H" * 4321 + comp)
    fd = os.open(path, os.O_RDONLY)
    try:

        def read_at(offset: int, length: int) -> bytes:
            return os.pread(fd, length, offset)

        seen: list[int] = []
        cp = DeflateCheckpoints._build(
            backend, read_at, 4321, len(comp), len(data), zlib.crc32(data), 1 << 20, seen.append
        )
        assert sum(seen) == len(comp)
        rnd = random.Random(5)
        for _ in range(50):
            off = rnd.randrange(len(data))
            assert cp.read(read_at, off, 4096) == data[off : off + 4096]
    finally:
        os.close(fd)


def test_public_build_uses_active_backend():
    data = TEXT[:2_000_000]
    arch = Archive(deflate(data))
    cp = DeflateCheckpoints.build(
        arch.read_at, arch.offset, arch.comp_size, len(data), zlib.crc32(data), spacing=500_000
    )
    assert (cp._points is not None) == (inflate.backend()[0] == "native")
    check_all(cp, arch, data, reads=10)


def test_memory_is_counted(backend):
    data = TEXT[: 4 << 20]
    arch = Archive(deflate(data))
    cp = build(backend, arch, data, 256 << 10)
    n = cp.interval_count()
    assert n == 16
    if backend is None:
        assert cp.nbytes >= n * SNAPSHOT_BYTES
    else:
        # one 32 KiB window per point, at most one point per interval
        assert (n - 1) * 32 << 10 <= cp.nbytes <= n * (33 << 10) + 4096


def test_decode_reads_about_one_interval(backend):
    """Decoding interval k fetches roughly that interval's compressed bytes, not the prefix."""
    data = TEXT
    arch = Archive(deflate(data))
    cp = build(backend, arch, data, 1 << 20)
    per_interval = arch.comp_size / cp.interval_count()
    for k in (1, 3, 5):
        arch.reads.clear()
        cp.decode_interval(arch.read_at, k)
        fetched = sum(n for _, n in arch.reads)
        first = min(off for off, _ in arch.reads) - arch.offset
        assert fetched < per_interval * 1.5 + (64 << 10)
        assert first > per_interval * (k - 0.5)


def test_concurrent_decodes(backend):
    data = TEXT[: 4 << 20]
    arch = Archive(deflate(data))
    cp = build(backend, arch, data, 512 << 10)

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        for _ in range(15):
            k = rnd.randrange(cp.interval_count())
            assert cp.decode_interval(arch.read_at, k) == data[k * cp.spacing : (k + 1) * cp.spacing]

    assert not run_in_threads(worker, [(i,) for i in range(6)])


def test_backends_agree_byte_for_byte():
    native = native_module()
    data = TEXT[:3_000_000] + NOISE[:200_000]
    arch = Archive(deflate(data, 7))
    a = build(native, arch, data, 700_000)
    b = build(None, arch, data, 700_000)
    rnd = random.Random(11)
    for _ in range(40):
        off, n = rnd.randrange(len(data)), rnd.randrange(2_000_000)
        assert a.read(arch.read_at, off, n) == b.read(arch.read_at, off, n) == data[off : off + n]


# ------------------------------------------------------------------- errors

DATA = TEXT[: 3 << 20]
COMP = deflate(DATA)
CRC = zlib.crc32(DATA)


def _corrupt_middle() -> bytes:
    bad = bytearray(COMP)
    for i in range(len(bad) // 2, len(bad) // 2 + 40):
        bad[i] ^= 0x5A
    return bytes(bad)


ERROR_CASES = {
    "corrupt-middle": (_corrupt_middle(), len(DATA), CRC, None),
    "truncated": (COMP[: len(COMP) // 2], len(DATA), CRC, inflate.TRUNCATED),
    "truncated-1": (COMP[:-1], len(DATA), CRC, None),
    "size-larger": (COMP, len(DATA) + 1, CRC, inflate.SIZE_MISMATCH),
    "size-smaller": (COMP, len(DATA) - 1, CRC, inflate.SIZE_MISMATCH),
    "size-much-smaller": (COMP, 1000, CRC, inflate.SIZE_MISMATCH),
    "crc-mismatch": (COMP, len(DATA), CRC ^ 4, f"CRC mismatch (expected 0x{CRC ^ 4:08x}, got 0x{CRC:08x})"),
    "trailing-data": (COMP + b"\0", len(DATA), CRC, inflate.TRAILING_DATA),
    "trailing-chunk": (COMP + bytes(3 << 20), len(DATA), CRC, inflate.TRAILING_DATA),
    "garbage": (b"\x07" + bytes(5000), 100, 0, inflate.BAD_DATA),
    "impossible-size": (
        b"\x03\x00",
        10**9,
        0,
        "declared size 1000000000 is impossible for 2 compressed bytes",
    ),
}


def _build_outcome(backend, comp: bytes, size: int, crc: int) -> str:
    arch = Archive(comp)
    with pytest.raises(CorruptMemberError) as info:
        DeflateCheckpoints._build(backend, arch.read_at, arch.offset, len(comp), size, crc, 1 << 20, None)
    return info.value.reason


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_members_are_detected_at_build(backend, case):
    comp, size, crc, reason = ERROR_CASES[case]
    got = _build_outcome(backend, comp, size, crc)
    if reason is not None:
        assert got == reason


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_build_errors_agree_between_backends(case):
    native = native_module()
    comp, size, crc, _ = ERROR_CASES[case]
    assert _build_outcome(native, comp, size, crc) == _build_outcome(None, comp, size, crc)


def test_short_read_at_is_a_source_error(backend):
    arch = Archive(COMP)
    with pytest.raises(SourceError, match="short read"):
        DeflateCheckpoints._build(
            backend, arch.read_at, arch.offset, len(COMP) + 10**6, len(DATA), CRC, 1 << 20, None
        )


def test_changed_source_after_build_is_detected_or_differs(backend):
    """If the archive changes under an index, decoding fails loudly rather than hanging."""
    arch = Archive(COMP)
    cp = build(backend, arch, DATA, 1 << 20)
    arch.blob = arch.blob[: arch.offset] + bytes(len(COMP))
    with pytest.raises(CorruptMemberError):
        cp.decode_interval(arch.read_at, 2)


def test_argument_errors(backend):
    arch = Archive(COMP)
    with pytest.raises(ValueError, match="spacing"):
        DeflateCheckpoints._build(backend, arch.read_at, arch.offset, len(COMP), len(DATA), CRC, 0, None)
    cp = build(backend, arch, DATA, 1 << 20)
    with pytest.raises(IndexError):
        cp.decode_interval(arch.read_at, cp.interval_count())
    with pytest.raises(ValueError):
        cp.read(arch.read_at, -1, 10)


# -------------------------------------------------------------- big member


def _available_memory() -> int:
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return 0
    return psutil.virtual_memory().available


@pytest.mark.skipif(_available_memory() < 4 << 30, reason="needs 4 GiB of available memory")
@pytest.mark.slow  # marker registered in tests/conftest.py
def test_offsets_beyond_4_gib_native():
    """Output offsets past 2**32 inside the C zran state (streamed, never held whole)."""
    native = native_module()
    seg_data = english_like(1 << 20, 8) + bytes(63 << 20)
    c = zlib.compressobj(1, zlib.DEFLATED, -15)
    seg = c.compress(seg_data) + c.flush(zlib.Z_FULL_FLUSH)
    reps = 66  # 4.125 GiB of output
    crc = 0
    for _ in range(reps):
        crc = zlib.crc32(seg_data, crc)
    comp = seg * reps + b"\x03\x00"
    arch = Archive(comp)
    size = reps * len(seg_data)
    cp = DeflateCheckpoints._build(native, arch.read_at, arch.offset, len(comp), size, crc, 16 << 20, None)
    for off in (0, (4 << 30) - 10, (4 << 30) + 5, size - 4096, (65 << 26) + 12345):
        seg_off = off % len(seg_data)
        want = (seg_data[seg_off : seg_off + 4096] + seg_data[: max(0, seg_off + 4096 - len(seg_data))])[
            : size - off
        ]
        assert cp.read(arch.read_at, off, 4096) == want, off
