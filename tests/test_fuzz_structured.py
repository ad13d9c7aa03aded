"""Structured fuzzing with hypothesis: valid-ish ZIPs, tars and tar.zst with mutated fields.

Byte-level mutation (tests/test_fuzz.py, scripts/fuzz.py) rarely gets past a
checksum or a length that must agree with another; these strategies build
archives whose structure holds and lie in one or more chosen fields: sizes,
offsets, CRCs, methods, flags, name and extra lengths, pax records, type
flags, zstd frame splits and seek tables. Every example goes through the same
harness as the byte fuzzers (open through the real path, list, read every
member; only CdmlfsError may escape, reads must be exact) under a time bound.
Derandomized, so a run is reproducible and CI-stable; for a long run set
``CDMLFS_FUZZ_EXAMPLES=20000 CDMLFS_FUZZ_RANDOM=1``.
"""

from __future__ import annotations

import itertools
import os
import struct
import zlib

import pytest
from fuzz import craft, harness
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdmlfs.formats import tarheader as th
from cdmlfs.zstd_seekable import seek_table_frame, skippable_frame

SETTINGS = settings(
    max_examples=int(os.environ.get("CDMLFS_FUZZ_EXAMPLES", "400")),  # raise it for a long run
    derandomize=os.environ.get("CDMLFS_FUZZ_RANDOM") != "1",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BIG = st.sampled_from([0, 1, 0xFFFF, 0xFFFFFFFF, 0x7FFFFFFF, 1 << 32, (1 << 63) - 1, (1 << 64) - 1])
NAMES = st.one_of(
    st.sampled_from(["a", "d/b", "d/", "../../etc/passwd", "/abs", "a\\b", ".", "", "x" * 300, "n\0ul"]),
    st.text(min_size=0, max_size=40),
)


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level("CRITICAL")
    yield
    harness.cleanup()


def _compress(method: int, content: bytes) -> bytes:
    return craft.compress(method, content)


@st.composite
def zip_members(draw) -> craft.ZipMember:
    content = draw(st.one_of(st.binary(max_size=300), st.sampled_from([bytes(70_000), b"ab" * 40_000])))
    method = draw(st.sampled_from([0, 8, 8, 12, 14, 93, 95, 9, 99]))
    name = draw(NAMES).encode("utf-8", "surrogateescape")
    m = craft.ZipMember(name, _compress(method, content), method, zlib.crc32(content), len(content))
    m.mode = draw(st.sampled_from([0o100644, 0o120777, 0o040755, 0o104755, 0o020644, 0]))
    m.flags = draw(st.sampled_from([0, 0x800, 0x8, 0x1, 0x41]))
    lies = draw(
        st.sets(st.sampled_from(["size", "comp", "crc", "offset", "lname", "lextra", "extra", "nolocal"]))
    )
    if "size" in lies:
        m.size = draw(BIG)
    if "comp" in lies:
        m.comp_size = draw(BIG)
    if "crc" in lies:
        m.crc ^= draw(st.integers(1, 0xFFFFFFFF))
    if "offset" in lies:
        m.offset = draw(st.one_of(BIG, st.integers(0, 4096)))
    if "lname" in lies:
        m.local_name = draw(st.binary(max_size=600))
    if "lextra" in lies:
        m.local_extra = draw(st.binary(max_size=64))
    if "extra" in lies:
        hid = draw(st.sampled_from([0x0001, 0x5455, 0x7075, 0xCAFE]))
        body = draw(st.binary(max_size=40))
        m.extra = struct.pack("<HH", hid, draw(st.sampled_from([len(body), 0xFFFF, 3]))) + body
    if "nolocal" in lies:
        m.write_local = False
    return m


@given(
    members=st.lists(zip_members(), min_size=1, max_size=6),
    prefix=st.sampled_from([b"", b"#!stub\n" * 3]),
    comment=st.sampled_from([b"", b"PK\x05\x06 fake eocd in the comment"]),
    zip64=st.booleans(),
    cd_lie=st.sampled_from([None, "offset", "size", "entries"]),
    lie_value=BIG,
)
@SETTINGS
def test_zip_with_lying_fields(members, prefix, comment, zip64, cd_lie, lie_value) -> None:
    kw = {}
    if cd_lie == "offset":
        kw["cd_offset"] = lie_value
    elif cd_lie == "size":
        kw["cd_size"] = lie_value
    elif cd_lie == "entries":
        kw["entries"] = lie_value & 0xFFFF if not zip64 else lie_value
    blob = craft.build_zip(members, comment=comment, prefix=prefix, zip64=zip64, **kw)
    harness.run("zip", blob, seconds=30)


TYPES = [th.REGTYPE, th.AREGTYPE, th.DIRTYPE, th.SYMTYPE, th.LNKTYPE, th.CHRTYPE, th.FIFOTYPE, th.CONTTYPE,
         th.GNU_LONGNAME, th.GNU_LONGLINK, th.PAX_LOCAL, th.PAX_GLOBAL, th.GNU_SPARSE, th.GNU_VOLHDR,
         th.GNU_MULTIVOL, th.GNU_DUMPDIR, b"Z"]  # fmt: skip
PAX_KEYS = ["path", "linkpath", "size", "mtime", "uid", "GNU.sparse.map", "comment", "x"]
PAX_VALUES = [b"a", b"12", b"-5", b"1e999", b"", b"9" * 25, b"d/e", b"nan"]


@st.composite
def tar_members(draw) -> bytes:
    typeflag = draw(st.sampled_from(TYPES))
    content = draw(st.binary(max_size=700))
    name = draw(NAMES)
    link = draw(st.sampled_from(["a", "d/b", "../x", "/etc", "", "y" * 200]))
    out = b""
    if draw(st.booleans()):
        records = b"".join(
            th.pax_record(draw(st.sampled_from(PAX_KEYS)), draw(st.sampled_from(PAX_VALUES)))
            for _ in range(draw(st.integers(1, 3)))
        )
        if draw(st.booleans()):
            records = records.replace(b" ", b"  ", 1)  # a length that no longer matches
        out += th.build_block(b"PaxHeaders/p", 0o644, 0, 0, len(records), 0, th.PAX_LOCAL)
        out += records + bytes(th.round_up(len(records)) - len(records))
    try:
        block = bytearray(th.build_header(name, typeflag, len(content), linkname=link)[-512:])
    except (ValueError, UnicodeEncodeError):
        block = bytearray(th.build_header("fallback", typeflag, len(content))[-512:])
    field = draw(st.sampled_from([None, (124, 12), (100, 8), (136, 12), (0, 100), (345, 155), (257, 8)]))
    if field is not None:
        at, width = field
        value = draw(st.one_of(st.binary(min_size=width, max_size=width), st.sampled_from([
            b"\x80" + bytes(width - 2) + b"\x01", b"\xff" * width, b"7" * width, bytes(width)])))  # fmt: skip
        block[at : at + width] = value[:width]
        if draw(st.booleans()):  # keep the checksum right, so the lie gets past it
            block[148:156] = b" " * 8
            block[148:156] = b"%06o\0 " % sum(block)
    return out + bytes(block) + content + bytes(th.round_up(len(content)) - len(content))


@st.composite
def tar_archives(draw) -> bytes:
    body = b"".join(draw(st.lists(tar_members(), min_size=1, max_size=6)))
    end = draw(st.sampled_from([bytes(1024), bytes(512), b"", bytes(512) + b"junk" * 128]))
    data = body + end
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return data


@given(tar_archives())
@SETTINGS
def test_tar_with_lying_fields(data: bytes) -> None:
    harness.run("tar", data, seconds=30)


@given(
    tar=tar_archives(),
    cuts=st.lists(st.integers(0, 8000), max_size=4),
    content_size=st.booleans(),
    table=st.sampled_from([None, "true", "lying", "short"]),
    skippable_first=st.booleans(),
    lie=st.integers(0, 0xFFFFFFFF),
)
@SETTINGS
def test_tar_zst_with_lying_frames_and_seek_tables(
    tar, cuts, content_size, table, skippable_first, lie
) -> None:
    points = sorted({0, len(tar), *(c for c in cuts if c < len(tar))})
    pieces = [tar[a:b] for a, b in itertools.pairwise(points)] or [b""]
    frames = [craft.zstd_frame(p, content_size=content_size) for p in pieces]
    entries = [(len(f), len(p)) for f, p in zip(frames, pieces)]
    if table == "lying":
        i = lie % len(entries)
        entries[i] = (entries[i][0], lie) if lie & 1 else (lie & 0xFFFF, entries[i][1])
    elif table == "short":
        entries = entries[:-1]
    blob = (skippable_frame(b"pz") if skippable_first else b"") + b"".join(frames)
    if table is not None:
        blob += seek_table_frame(entries)
    harness.run("zstd", blob, seconds=30)
