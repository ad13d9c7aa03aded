"""cdmlfs.inflate on both backends: the compiled cdmlfs._native and the zlib fallback.

Every test that takes ``api`` runs twice, once per backend, through the same
wrappers the package uses (cdmlfs.inflate.NATIVE / cdmlfs.inflate.PYTHON). The
native backend is built from the real extension even when CDMLFS_NATIVE=0 is set,
and a subprocess checks that CDMLFS_NATIVE=0 really switches the public functions.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
from inflateutil import deflate, english_like, native_module
from parallel import run_in_threads

from cdmlfs import inflate
from cdmlfs.errors import CorruptMemberError, SourceError


@pytest.fixture(params=["native", "python"])
def api(request) -> inflate.Backend:
    """The public functions of one backend, wrapped exactly as cdmlfs.inflate exports them."""
    if request.param == "python":
        return inflate.PYTHON
    return inflate._native_backend(native_module())


def _payloads() -> dict[str, bytes]:
    rnd = random.Random(42)
    text = english_like(1 << 20, 1)
    return {
        "empty": b"",
        "one-byte": b"x",
        "incompressible": rnd.randbytes(300_000),
        "compressible": text,
        "large-64MiB": english_like(4 << 20, 2) * 8 + rnd.randbytes(32 << 20),
    }


PAYLOADS = _payloads()


@pytest.fixture(scope="module")
def members() -> dict[str, tuple[bytes, bytes, int]]:
    """name -> (data, raw deflate of it at level 6, crc)."""
    return {name: (data, deflate(data), zlib.crc32(data)) for name, data in PAYLOADS.items()}


@pytest.fixture(scope="module")
def member_file(tmp_path_factory, members) -> tuple[Path, dict[str, tuple[int, int, int]]]:
    """All members in one file, deflated and stored, each behind some junk bytes."""
    path = tmp_path_factory.mktemp("native") / "members.bin"
    where: dict[str, tuple[int, int, int]] = {}
    with open(path, "wb") as f:
        for name, (data, comp, _) in members.items():
            f.write(b"J" * 37)
            deflated_at = f.tell()
            f.write(comp)
            f.write(b"K" * 11)
            stored_at = f.tell()
            f.write(data)
            where[name] = (deflated_at, len(comp), stored_at)
    return path, where


# ----------------------------------------------------------------- the build


def test_native_extension_is_built():
    """CI sets CDMLFS_REQUIRE_NATIVE=1: there the accelerator must exist and be used."""
    native = native_module()
    assert issubclass(native.DecodeError, ValueError)
    assert native.LIBDEFLATE_VERSION and native.ZLIB_VERSION
    assert (native.MAX_RATIO, native.RATIO_SLACK) == (inflate.MAX_RATIO, inflate.RATIO_SLACK)
    if os.environ.get("CDMLFS_NATIVE", "").strip() != "0":
        assert inflate.backend() == (
            "native",
            f"libdeflate {native.LIBDEFLATE_VERSION}, zlib {native.ZLIB_VERSION},"
            f" CRC-32 by {native.CRC32_BACKEND}",
        )


def test_crc32_backend_is_isal_where_the_build_requires_it():
    """ISA-L's CRC-32 is about 3x libdeflate's here; CI (CDMLFS_REQUIRE_NATIVE=1) must build with it,
    in both extensions that check CRCs (the FUSE hot path too)."""
    native = native_module()
    fastpath = native_module("cdmlfs._fastpath")
    assert native.CRC32_BACKEND in ("isa-l", "libdeflate")
    assert fastpath.CRC32_BACKEND == native.CRC32_BACKEND
    if os.environ.get("CDMLFS_REQUIRE_NATIVE") == "1":
        assert native.CRC32_BACKEND == "isa-l"


@pytest.mark.parametrize("offset", [0, 1, 3, 8])
def test_native_crc32_equals_zlib_at_every_length_alignment_and_start(offset):
    """Both CRC backends fold in wide blocks with a byte-wise head and tail: lengths around every
    block size, odd alignments and continued CRCs must all give zlib's value."""
    native = native_module()
    rnd = random.Random(offset)
    lengths = [*range(0, 300), 511, 512, 513, 1023, 1024, 1025, 4095, 4096, 4097, 65535, 65536, 65537]
    lengths += [(1 << 20) + 13, (5 << 20) + 1]  # the second is past the GIL-free threshold
    for n in lengths:
        data = memoryview(rnd.randbytes(n + offset))[offset:]
        for start in (0, 1, 0xFFFFFFFF, zlib.crc32(b"earlier bytes")):
            assert native.crc32(data, start) == zlib.crc32(data, start), (n, start)
    whole = rnd.randbytes(100_000)
    cut = 33_333
    assert native.crc32(whole[cut:], native.crc32(whole[:cut])) == zlib.crc32(whole)


def _run_python(code: str, **env: str) -> str:
    full_env = {**os.environ, **env}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, check=True
    )
    return res.stdout.strip()


def test_env_switch_selects_fallback_in_a_fresh_interpreter():
    code = (
        "import zlib; from cdmlfs import inflate, errors\n"
        "d = b'hello world ' * 5000; c = zlib.compressobj(6, 8, -15); z = c.compress(d) + c.flush()\n"
        "assert inflate.inflate(z, len(d), zlib.crc32(d)) == d\n"
        "assert inflate.inflate is not None and inflate._active is inflate.PYTHON\n"
        "try:\n    inflate.inflate(z, len(d) + 1, zlib.crc32(d))\n"
        "except errors.CorruptMemberError as e:\n    print(inflate.backend(), e.reason)\n"
    )
    out = _run_python(code, CDMLFS_NATIVE="0")
    assert out == "('python', 'disabled by CDMLFS_NATIVE=0') inflated to a different size than declared"


def test_default_interpreter_uses_native():
    native_module()
    env = {k: v for k, v in os.environ.items() if k != "CDMLFS_NATIVE"}
    res = subprocess.run(
        [sys.executable, "-c", "from cdmlfs import inflate; print(inflate.backend()[0])"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    assert res.stdout.strip() == "native"


OUR_EXTENSIONS = (
    "cdmlfs._native",
    "cdmlfs._fastpath",
    "cdmlfs._zstdframe",
    "cdmlfs._fuseloop",
    "cdmlfs._zipdir",
)


def test_a_crash_report_names_every_extension_of_ours():
    """faulthandler lists only extension modules that have a methods table: without one, a
    segfault's report (the first thing to read after a crash) would not show that ours were loaded."""
    for name in OUR_EXTENSIONS:
        native_module(name)
    code = f"import faulthandler; [__import__(m) for m in {OUR_EXTENSIONS!r}]; faulthandler._sigsegv()"
    res = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True)
    assert res.returncode != 0
    listed = [line for line in res.stderr.splitlines() if line.startswith("Extension modules:")]
    assert listed, res.stderr
    for name in OUR_EXTENSIONS:
        assert name in listed[0], (name, listed[0])


# ------------------------------------------------------ identical bytes to zlib


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_crc32_matches_zlib(api, name):
    data = PAYLOADS[name]
    assert api.crc32(data) == zlib.crc32(data)
    assert api.crc32(memoryview(data)) == zlib.crc32(data)
    half = len(data) // 2
    assert api.crc32(data[half:], api.crc32(data[:half])) == zlib.crc32(data)
    assert api.crc32(b"abc", -1) == zlib.crc32(b"abc", 0xFFFFFFFF)


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_inflate_matches_zlib(api, members, name):
    data, comp, crc = members[name]
    out = api.inflate(comp, len(data), crc)
    assert type(out) is bytes and out == data
    assert api.inflate(bytearray(comp), len(data), crc) == data
    assert api.inflate(memoryview(comp), len(data), crc) == data


@pytest.mark.parametrize("level", [0, 1, 9])
def test_inflate_other_levels_and_flushes(api, level):
    data = english_like(300_000, 3) + random.Random(3).randbytes(70_000)
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    comp = c.compress(data[:100_000]) + c.flush(zlib.Z_FULL_FLUSH)
    comp += c.compress(data[100_000:]) + c.flush(zlib.Z_SYNC_FLUSH) + c.flush()
    assert api.inflate(comp, len(data), zlib.crc32(data)) == data


def test_empty_member_with_no_deflate_bytes(api):
    assert api.inflate(b"", 0, 0) == b""
    assert api.inflate_into(b"", bytearray(), 0) == 0


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_inflate_into_fills_buffer(api, members, name):
    data, comp, crc = members[name]
    out = bytearray(len(data))
    assert api.inflate_into(comp, out, crc) == len(data)
    assert out == data
    again = bytearray(len(data))
    assert api.inflate_into(comp, memoryview(again), crc) == len(data)
    assert again == data


def test_inflate_into_numpy_buffer(api, members):
    np = pytest.importorskip("numpy")
    data, comp, crc = members["compressible"]
    arr = np.empty(len(data), dtype=np.uint8)
    assert api.inflate_into(comp, arr, crc) == len(data)
    assert arr.tobytes() == data


def test_inflate_into_refuses_read_only_buffer(api, members):
    data, comp, crc = members["compressible"]
    with pytest.raises(TypeError):
        api.inflate_into(comp, bytes(len(data)), crc)


@pytest.mark.parametrize("name", list(PAYLOADS))
def test_read_deflated_and_stored_from_file(api, members, member_file, name):
    data, _, crc = members[name]
    path, where = member_file
    deflated_at, comp_size, stored_at = where[name]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert api.read_deflated(fd, deflated_at, comp_size, len(data), crc) == data
        assert api.read_stored(fd, stored_at, len(data), crc) == data
        assert api.read_stored(fd, stored_at, len(data), None) == data
    finally:
        os.close(fd)


def test_public_functions_follow_active_backend(members, member_file):
    data, comp, crc = members["compressible"]
    path, where = member_file
    deflated_at, comp_size, stored_at = where["compressible"]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert inflate.read_deflated(fd, deflated_at, comp_size, len(data), crc) == data
        assert inflate.read_stored(fd, stored_at, len(data), crc) == data
    finally:
        os.close(fd)
    assert inflate.inflate(comp, len(data), crc) == data
    assert inflate.crc32(data) == crc
    buf = bytearray(len(data))
    assert inflate.inflate_into(comp, buf, crc) == len(data) and buf == data


# ------------------------------------------------------------------ errors


def _outcome(fn, *args):
    """(exception type, reason) of a call that must fail; fails the test if it returns."""
    try:
        result = fn(*args)
    except CorruptMemberError as exc:
        assert exc.member is None  # the caller fills it in
        return ("corrupt", exc.reason)
    except SourceError as exc:
        return ("source", str(exc))
    pytest.fail(f"returned {len(result) if hasattr(result, '__len__') else result!r} instead of raising")


TEXT = english_like(200_000, 5)
TEXT_Z = deflate(TEXT)
TEXT_CRC = zlib.crc32(TEXT)
BAD_CASES = {
    "reserved-block-type": (b"\x07\x00\x00", 10, 0, inflate.BAD_DATA),
    "truncated-half": (TEXT_Z[: len(TEXT_Z) // 2], len(TEXT), TEXT_CRC, inflate.BAD_DATA),
    "truncated-1": (TEXT_Z[:-1], len(TEXT), TEXT_CRC, None),
    "no-data": (b"", 100, TEXT_CRC, inflate.BAD_DATA),
    "size-larger": (TEXT_Z, len(TEXT) + 1, TEXT_CRC, inflate.SIZE_MISMATCH),
    "size-smaller": (TEXT_Z, len(TEXT) - 1, TEXT_CRC, inflate.SIZE_MISMATCH),
    "size-zero": (TEXT_Z, 0, 0, inflate.SIZE_MISMATCH),
    "crc-mismatch": (
        TEXT_Z, len(TEXT), TEXT_CRC ^ 1,
        f"CRC mismatch (expected 0x{TEXT_CRC ^ 1:08x}, got 0x{TEXT_CRC:08x})",
    ),
    "trailing-data": (TEXT_Z + b"\0", len(TEXT), TEXT_CRC, inflate.TRAILING_DATA),
    "impossible-size": (
        b"\x03\x00", 10**12, 0, "declared size 1000000000000 is impossible for 2 compressed bytes",
    ),
}  # fmt: skip


def _all_ways(api, tmp_path, comp, size, crc):
    """The outcome of inflate, inflate_into and read_deflated on the same bad member."""
    path = tmp_path / "bad.bin"
    path.write_bytes(b"xyz" + comp)
    fd = os.open(path, os.O_RDONLY)
    try:
        outcomes = [
            _outcome(api.inflate, comp, size, crc),
            _outcome(api.read_deflated, fd, 3, len(comp), size, crc),
        ]
    finally:
        os.close(fd)
    if size < 1 << 30:
        outcomes.append(_outcome(api.inflate_into, comp, bytearray(size), crc))
    return outcomes


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_members_raise_corrupt_member_error(api, tmp_path, case):
    comp, size, crc, reason = BAD_CASES[case]
    outcomes = _all_ways(api, tmp_path, comp, size, crc)
    assert len(set(outcomes)) == 1, outcomes  # same reason whichever function
    kind, got = outcomes[0]
    assert kind == "corrupt"
    if reason is not None:
        assert got == reason


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_both_backends_give_the_same_reason(tmp_path, case):
    native = inflate._native_backend(native_module())
    comp, size, crc, _ = BAD_CASES[case]
    assert _all_ways(native, tmp_path, comp, size, crc) == _all_ways(
        inflate.PYTHON, tmp_path, comp, size, crc
    )


def test_random_corruptions_agree_between_backends():
    """Flip bytes anywhere in small streams: same verdict and reason from both backends."""
    native = inflate._native_backend(native_module())
    rnd = random.Random(9)
    data = english_like(20_000, 6)
    comp, crc = deflate(data), zlib.crc32(data)
    for _ in range(300):
        bad = bytearray(comp)
        for _ in range(rnd.randint(1, 3)):
            bad[rnd.randrange(len(bad))] ^= 1 << rnd.randrange(8)
        results = []
        for api in (native, inflate.PYTHON):
            try:
                results.append(("ok", api.inflate(bytes(bad), len(data), crc) == data))
            except CorruptMemberError as exc:
                results.append(("corrupt", exc.reason))
        assert results[0] == results[1], (bytes(bad).hex(), results)


def _in_pieces(comp: bytes, size: int, crc: int, step: int):
    def read_at(offset: int, n: int) -> bytes:
        assert offset >= 0 and n <= step and offset + n <= 3 + len(comp)  # never past the member
        return (b"xyz" + comp)[offset : offset + n]

    return inflate.read_deflated_in_pieces(read_at, 3, len(comp), size, crc, step)


@pytest.mark.parametrize("step", [1, 7, 4096, 1 << 20])
def test_reading_in_pieces_agrees_with_inflate(step):
    """The piecewise path (members with implausible compressed sizes) gives the same bytes and reasons."""
    for comp, size, crc, _ in BAD_CASES.values():
        if step == 1 and len(comp) > 5000:
            comp = comp[:4000]  # one byte a time: keep it quick
        want = _outcome(inflate.PYTHON.inflate, comp, size, crc)
        assert _outcome(_in_pieces, comp, size, crc, step) == want
    for level in (0, 1, 9):
        data = english_like(70_000, level)
        assert _in_pieces(deflate(data, level), len(data), zlib.crc32(data), max(step, 64)) == data
    rnd = random.Random(step)
    data = english_like(20_000, 7)
    comp, crc = deflate(data), zlib.crc32(data)
    for _ in range(100):
        bad = bytearray(comp)
        bad[rnd.randrange(len(bad))] ^= 1 << rnd.randrange(8)
        bad = bytes(bad)
        want = _outcome(inflate.PYTHON.inflate, bad, len(data), crc) if bad != comp else None
        assert _outcome(_in_pieces, bad, len(data), crc, max(step, 64)) == want


def test_reading_in_pieces_stops_at_the_end_of_the_stream():
    """100 bytes declared as 16 MiB compressed: one piece is read, then the trailing bytes are reported."""
    text = b"x" * 100
    comp = deflate(text) + bytes(16 << 20)
    asked: list[int] = []

    def read_at(offset: int, n: int) -> bytes:
        asked.append(n)
        return comp[offset : offset + n]

    with pytest.raises(CorruptMemberError, match=inflate.TRAILING_DATA):
        inflate.read_deflated_in_pieces(read_at, 0, len(comp), len(text), zlib.crc32(text))
    assert asked == [inflate.PIECE]
    assert not inflate.plausible_comp_size(len(comp), len(text))
    assert inflate.plausible_comp_size(len(deflate(TEXT, 0)), len(TEXT))


def test_argument_errors(api):
    with pytest.raises(ValueError, match="non-negative"):
        api.inflate(b"\x03\x00", -1, 0)
    with pytest.raises(ValueError, match="crc"):
        api.inflate(b"\x03\x00", 0, 1 << 32)
    with pytest.raises(ValueError, match="crc"):
        api.inflate(b"\x03\x00", 0, -1)
    with pytest.raises(TypeError):
        api.inflate("text", 0, 0)
    with pytest.raises(ValueError, match="non-negative"):
        api.read_stored(0, 0, -5, None)
    with pytest.raises(ValueError, match="offset"):
        api.read_stored(0, -1, 5, None)


def test_short_file_is_a_source_error(api, tmp_path, members):
    data, comp, crc = members["compressible"]
    path = tmp_path / "short.bin"
    path.write_bytes(comp[:1000])
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(SourceError, match="unexpected end of file: got 990 of"):
            api.read_deflated(fd, 10, len(comp), len(data), crc)
        with pytest.raises(SourceError, match="unexpected end of file: got 0 of 10 bytes at offset 5000"):
            api.read_stored(fd, 5000, 10, None)
    finally:
        os.close(fd)


def test_bad_fd_is_a_source_error(api, tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    os.close(fd)
    with pytest.raises(SourceError, match="Bad file descriptor"):
        api.read_stored(fd, 0, 1, None)
    with pytest.raises(SourceError, match="Bad file descriptor"):
        api.read_deflated(fd, 0, 2, 0, 0)


def test_stored_crc_mismatch(api, members, member_file):
    data, _, crc = members["compressible"]
    path, where = member_file
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptMemberError, match=r"CRC mismatch \(expected 0x"):
            api.read_stored(fd, where["compressible"][2], len(data), crc ^ 0xFFFF)
    finally:
        os.close(fd)


# ---------------------------------------------------------- native specifics


def _spin_ratio(work) -> float:
    """How much a Python thread counted during work(), relative to its solo rate.

    Near 0 when work() holds the GIL, near 1 when it releases it (2+ cores).
    """
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        time.sleep(0.05)
        c0, t0 = counter[0], time.perf_counter()
        time.sleep(0.3)
        rate = (counter[0] - c0) / (time.perf_counter() - t0)
        c0, t0 = counter[0], time.perf_counter()
        work()
        during = (counter[0] - c0) / (time.perf_counter() - t0)
    finally:
        stop.set()
        t.join()
    return during / rate


@pytest.fixture(scope="module")
def zeros_member(tmp_path_factory):
    """256 MiB of output from a tiny stream, in memory and in a file at offset 7."""
    data = bytes(256 << 20)
    comp = deflate(data, 1)
    path = tmp_path_factory.mktemp("gil") / "zeros.bin"
    path.write_bytes(b"1234567" + comp)
    return data, comp, zlib.crc32(data), path


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to observe parallelism")
@pytest.mark.parametrize("op", ["inflate", "read_deflated", "crc32", "inflate_into"])
def test_gil_released_during_heavy_work(zeros_member, op):
    native = native_module()
    data, comp, crc, path = zeros_member
    fd = os.open(path, os.O_RDONLY)
    out = bytearray(len(data))
    work = {
        "inflate": lambda: native.inflate(comp, len(data), crc),
        "read_deflated": lambda: native.read_deflated(fd, 7, len(comp), len(data), crc),
        "crc32": lambda: [native.crc32(data) for _ in range(10)],
        "inflate_into": lambda: native.inflate_into(comp, out, crc),
    }[op]
    try:
        work()  # warm up
        ratio = _spin_ratio(lambda: [work() for _ in range(3)])
    finally:
        os.close(fd)
    assert ratio > 0.3, f"counter ran at {ratio:.0%} of its solo rate: GIL held?"


def test_threads_share_nothing(members):
    """Per-thread decompressors: many threads inflating at once all get their own bytes."""
    native = native_module()
    cases = [members[n] for n in ("compressible", "incompressible", "one-byte", "empty")]

    def worker(i: int) -> None:
        for j in range(40):
            data, comp, crc = cases[(i + j) % len(cases)]
            assert native.inflate(comp, len(data), crc) == data

    assert not run_in_threads(worker, [(i,) for i in range(8)])


def _available_memory() -> int:
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return 0
    return psutil.virtual_memory().available


@pytest.mark.skipif(_available_memory() < 8 << 30, reason="needs ~6 GiB of free memory")
@pytest.mark.slow  # marker registered in tests/conftest.py
def test_beyond_4_gib(tmp_path):
    """Output past 4 GiB and reads past 2 GiB: 64-bit sizes everywhere, pread loops."""
    native = inflate._native_backend(native_module())
    seg_data = bytes(64 << 20)
    c = zlib.compressobj(1, zlib.DEFLATED, -15)
    seg = c.compress(seg_data) + c.flush(zlib.Z_FULL_FLUSH)
    reps = 72  # 4.5 GiB
    size = reps * len(seg_data)
    crc = 0
    for _ in range(reps):
        crc = zlib.crc32(seg_data, crc)
    out = native.inflate(seg * reps + b"\x03\x00", size, crc)  # checks the CRC itself
    assert len(out) == size
    assert native.crc32(out) == crc
    assert out[(4 << 30) + 123 : (4 << 30) + 200] == bytes(77)
    del out
    stored = 40 * len(seg_data)  # 2.5 GiB: more than one pread call can return
    sparse = tmp_path / "sparse.bin"
    with open(sparse, "wb") as f:
        f.truncate(stored + 100)
    stored_crc = 0
    for _ in range(40):
        stored_crc = zlib.crc32(seg_data, stored_crc)
    fd = os.open(sparse, os.O_RDONLY)
    try:
        assert len(native.read_stored(fd, 100, stored, stored_crc)) == stored
    finally:
        os.close(fd)
