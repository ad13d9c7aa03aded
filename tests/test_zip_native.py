"""The C parse of plain ZIP records (``cdmlfs._zipdir``) builds the very index the Python parser builds.

The C side takes only records that need none of the Python rules' special
cases and hands every other one back; these tests hold it to that: each
archive (written by zipfile, by Info-ZIP ``zip``, crafted to lie in every
field the parser reads, then mutated at random) is parsed both ways, and the
indexes (every column, every table), the errors and the log lines must be
equal.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import stat
import struct
import subprocess
import time
import zipfile
import zlib
from pathlib import Path

import pytest
from archives import infozip, python_zip, sample_files, write_tree
from fuzz import craft
from fuzz.harness import MemorySource
from fuzz.seeds import zip_seeds

from cdmlfs.archive import Archive
from cdmlfs.errors import CdmlfsError
from cdmlfs.formats import zip as zipfmt
from cdmlfs.index import DIR, FILE, IndexBuilder

CDH_SIZE = 46
_FINISH = IndexBuilder.finish


def _snapshot(index) -> dict:
    out = {}
    for name in type(index).__slots__:
        value = getattr(index, name)
        if isinstance(value, dict):
            value = {k: (tuple(tuple(a) for a in v) if isinstance(v, tuple) else v) for k, v in value.items()}
            if name == "_children":
                value = {k: tuple(v) for k, v in value.items()}
        else:
            value = tuple(value)
        out[name] = value
    return out


def _parse(data: bytes, native: bool, monkeypatch, caplog) -> tuple:
    """(index snapshot or error, progress calls, log lines, the builder's path budget) of one parse."""
    monkeypatch.setattr(zipfmt, "PLAIN_RUN", zipfmt.PLAIN_RUN if native else None)
    calls: list[tuple[int, int]] = []
    budget: list[tuple[int, int]] = []
    finish = _FINISH

    def finish_and_note(self, *args, **kwargs):
        budget.append((self._path_bytes, self._path_allowance))
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(IndexBuilder, "finish", finish_and_note)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="cdmlfs"):
        try:
            source = MemorySource(data)
            source.mtime = 1_600_000_123.5  # what implied directories are dated
            fmt = zipfmt.ZipFormat(source, lambda done, total: calls.append((done, total)))
            result: object = _snapshot(fmt.index)
        except CdmlfsError as exc:
            result = (type(exc).__name__, str(exc))
    return result, calls, [(r.levelname, r.getMessage()) for r in caplog.records], budget


@pytest.fixture
def native_run():
    if zipfmt.PLAIN_RUN is None:
        if os.environ.get("CDMLFS_REQUIRE_NATIVE") == "1":
            pytest.fail("cdmlfs._zipdir is not built (CDMLFS_REQUIRE_NATIVE=1)")
        pytest.skip("cdmlfs._zipdir is not built")
    return zipfmt.PLAIN_RUN


def _assert_same(data: bytes, monkeypatch, caplog, label: str = "") -> object:
    fast = _parse(data, True, monkeypatch, caplog)
    slow = _parse(data, False, monkeypatch, caplog)
    assert fast == slow, label
    return fast[0]


# ------------------------------------------------------------------------- crafted


def _ext_time(seconds: int, flags: int = 1) -> bytes:
    """The field's 32 bits: a negative time as two's complement, past 2038 unsigned (as Info-ZIP)."""
    body = struct.pack("<BI", flags, seconds & 0xFFFFFFFF)
    return struct.pack("<HH", 0x5455, len(body)) + body


def _ntfs(filetime: int, tag: int = 1) -> bytes:
    attr = struct.pack("<HHQQQ", tag, 24, filetime, filetime, filetime)
    body = b"\0\0\0\0" + attr
    return struct.pack("<HH", 0x000A, len(body)) + body


def _upath(name: bytes, unicode: str, version: int = 1, crc: int | None = None) -> bytes:
    body = struct.pack("<BI", version, zlib.crc32(name) if crc is None else crc) + unicode.encode()
    return struct.pack("<HH", 0x7075, len(body)) + body


def _z64(*values: int) -> bytes:
    body = b"".join(struct.pack("<Q", v) for v in values)
    return struct.pack("<HH", 1, len(body)) + body


def _m(name, content=b"data", **kw) -> craft.ZipMember:
    return craft.member(name, content, method=0, **kw)


DOS = 0 << 8 | 20  # made by MS-DOS
OSX = 19 << 8 | 20
# fmt: off
CRAFTED = {
    "plain": [_m("a/b/c.txt"), _m("a/b/d.txt"), _m("a/"), _m("top.bin"), _m("a/b/")],
    "names": [
        _m("../evil"), _m("/abs"), _m("a\\b\\c"), _m("./x"), _m("a//b"), _m("a/./b"), _m("a/../b"),
        _m(""), _m("dir/"), _m("/"), _m(".."), _m("a\x00b"), _m("x" * 255), _m("y" * 256),
        _m("d/" + "z" * 300 + "/f"), _m(".hidden/..x/..."), _m("trailing//"), _m("ok/name"),
        # in a directory already known (no implied directory sends them to Python for that reason)
        _m("ok/."), _m("ok/.."), _m("ok/./n"), _m("ok/x\\y"), _m("ok/\x00"), _m("ok//z"),
        _m("ok/" + "w" * 256), _m("ok/" + "v" * 255),
    ],
    "implied": [
        _m("p/q/r/s.txt"), _m("p/q/t.txt"), _m("p/u/v.txt"), _m("f.txt"), _m("f.txt/g.txt"),
        _m("/".join(["d"] * 40) + "/leaf"), _m("/".join(["e"] * 32) + "/leaf"), _m("e/"),
        _m("h/i/"), _m("h/i/j"), _m(b"\xff/\xfe/x"), _m("ünï/名/x".encode(), flags=0x800),
        *(_m(f"k{i}/file") for i in range(300)),
        *(_m(f"m{i}/n/o/file") for i in range(200)),  # more implied entries than a run has room for
    ],
    "duplicates": [_m("x"), _m("x", b"second"), _m("x/"), _m("x/y"), _m("f/"), _m("f"), _m("g"), _m("g/h")],
    "bytes": [
        _m(b"unix-\xff\xfe.bin"),
        _m(b"dos-\x81\x82.bin", fields={"made_by": DOS}),
        _m(b"utf8-\xff.bin", flags=0x800),
        _m("utf8-ünï/名.txt".encode(), flags=0x800),
        _m(b"osx-\xc3\xa9.bin", fields={"made_by": OSX}),
        _m(b"dos-ascii.bin", fields={"made_by": DOS}),
    ],
    "unicode_path": [
        _m(b"caf\x82.txt", fields={"made_by": DOS}, extra=_upath(b"caf\x82.txt", "café.txt")),
        _m(b"stale.txt", extra=_upath(b"other", "renamed.txt")),
        _m(b"flagged.txt", flags=0x800, extra=_upath(b"flagged.txt", "ignored.txt")),
        _m(b"v2.txt", extra=_upath(b"v2.txt", "v2-new.txt", version=2)),
        _m(b"short.txt", extra=struct.pack("<HH", 0x7075, 3) + b"\x01\x00\x00"),
        _m(b"ascii.txt", extra=_upath(b"ascii.txt", "renamed/ünï.txt")),
        _m(b"unix-\xe9.txt", extra=_upath(b"unix-\xe9.txt", "unix-é.txt")),
    ],
    "times": [
        _m("ext", extra=_ext_time(1_234_567_890)),
        _m("ext-noflag", extra=_ext_time(1_234_567_890, flags=2)),
        _m("ext-negative", extra=_ext_time(-5)),
        _m("ext-2040", extra=_ext_time(2_208_988_800), fields={"date": 60 << 9 | 1 << 5 | 1}),
        _m("ext-1960", extra=_ext_time(-305_000_000), fields={"date": 0 << 9 | 1 << 5 | 1, "time": 0}),
        _m("ext-1960-dos-noon", extra=_ext_time(-305_000_000), fields={"date": 0 << 9 | 1 << 5 | 1}),
        _m("ext-2106-dos-2107", extra=_ext_time(2**32 - 1), fields={"date": 0xFFFF}),
        _m("ext-short", extra=struct.pack("<HH", 0x5455, 3) + b"\x01\x02\x03"),
        _m("ext-4", extra=struct.pack("<HH", 0x5455, 4) + b"\x01\x02\x03\x04" + _ext_time(1)[:3]),
        _m("ntfs", extra=_ntfs(132_000_000_000_000_000)),
        _m("ntfs-zero", extra=_ntfs(0) + _ext_time(99)),
        _m("ntfs-early", extra=_ntfs(5)),
        _m("ntfs-huge", extra=_ntfs(2**64 - 1)),
        _m("ntfs-tag2", extra=_ntfs(132_000_000_000_000_000, tag=2)),
        _m("ntfs-then-none", extra=_ntfs(132_000_000_000_000_000) + _ntfs(0)),
        _m("ntfs-over-ext", extra=_ext_time(7) + _ntfs(132_000_000_000_000_123)),
        _m("extra-truncated", extra=struct.pack("<HH", 0x5455, 40) + b"\x01\x01\x02"),
        _m("extra-tail", extra=_ext_time(11) + b"\x55"),
        _m("dos-month0", fields={"date": 0x0000, "time": 0}),
        _m("dos-month15", fields={"date": (40 << 9) | (15 << 5) | 3, "time": 0xBFFF}),
        _m("dos-hour31", fields={"date": (40 << 9) | (2 << 5) | 31, "time": (31 << 11) | (63 << 5) | 31}),
        _m("dos-2107", fields={"date": 0xFFFF, "time": 0xFFFF}),
        _m("comment", fields={"clen": 0}),
    ],
    "zip64": [
        _m("z64-size", fields={"size": 0xFFFFFFFF, "comp": 0xFFFFFFFF}, extra=_z64(4, 4)),
        _m("z64-offset", fields={"offset": 0xFFFFFFFF}, extra=_z64(0)),
        _m("z64-missing", fields={"size": 0xFFFFFFFF}),
        _m("z64-truncated", fields={"size": 0xFFFFFFFF, "comp": 0xFFFFFFFF}, extra=_z64(4)),
        _m("z64-dir/", fields={"size": 0xFFFFFFFF}),
        _m("z64-huge", fields={"size": 0xFFFFFFFF, "comp": 0xFFFFFFFF}, extra=_z64(2**64 - 1, 2**63 + 5)),
        _m("z64-after-other", fields={"comp": 0xFFFFFFFF}, extra=_ext_time(3) + _z64(4)),
        _m("z64-far", fields={"offset": 0xFFFFFFFF}, extra=_z64(2**62)),
        _m("z64-offset-short", fields={"offset": 0xFFFFFFFF}, extra=_z64()),
        _m("z64-offset-cut", fields={"size": 0xFFFFFFFF, "offset": 0xFFFFFFFF}, extra=_z64(4)),
        craft.member("z64-huge-deflated", b"x", fields={"size": 0xFFFFFFFF, "comp": 0xFFFFFFFF},
                     extra=_z64(2**64 - 1, 2**63 + 5)),
        _m("far-offset", offset=10**9),
    ],
    "modes": [
        _m("unix-file", mode=0o104755),
        _m("unix-dir", mode=0o040700),
        _m("unix-link", b"target", mode=0o120777),
        _m("unix-link-755", b"target", mode=0o120755),
        _m("osx-link", b"target", mode=0o120777, fields={"made_by": OSX}),
        _m("acorn-link", b"target", mode=0o120777, fields={"made_by": 13 << 8}),
        _m("dos-attr-dir", mode=0, fields={"made_by": DOS, "eattr": 0x10}),
        _m("dos-readonly", mode=0, fields={"made_by": DOS, "eattr": 0x01}),
        _m("dos-with-mode", fields={"made_by": DOS, "eattr": (0o100644 << 16)}),
        _m("dos-mode-mismatch", fields={"made_by": DOS, "eattr": (0o100444 << 16)}),
        _m("dos-dir-mode", fields={"made_by": DOS, "eattr": (0o040755 << 16) | 0x10}),
        _m("other-system", fields={"made_by": 10 << 8, "eattr": 0o100600 << 16}),
        _m("zero-mode", mode=0o100000),
        _m("mode-dir-slash/", mode=0o100644),
    ],
    "flags": [
        craft.member("enc", b"secret", flags=1),
        craft.member("strong", b"secret", flags=0x41),
        craft.member("aes", b"secret", method=99),
        _m("empty-crc", b"", crc=5),
        _m("empty-stored-data", b"", comp_size=3),
        _m("stored-mismatch", b"12345", size=9),
        _m("dir-with-size/", b"12345", size=9),
        craft.member("deflated", b"abc" * 100),
        craft.member("method-bzip2", b"x", method=12),
    ],
}
# fmt: on


def _offset_at_the_end() -> bytes:
    """A member whose recorded offset is exactly the archive's size (the first one outside it)."""
    members = [_m("a"), _m("b")]
    size = len(craft.build_zip(members))
    members[1].offset = size
    data = craft.build_zip(members)
    assert len(data) == size
    return data


def _dos(year: int, month: int, day: int, hour: int, minute: int) -> dict:
    return {"date": (year - 1980) << 9 | month << 5 | day, "time": hour << 11 | minute << 5}


def test_dos_dates_computed_once_each_in_record_order(native_run, monkeypatch, caplog):
    """Local DOS times go through mktime, which resolves the hour repeated when clocks go back from
    the state its previous call left: both parsers must compute each date once, in record order.
    (The first C record of a run dated 0xFFFF/0xFFFF once got mtime 0: its cache key.)"""
    monkeypatch.setenv("TZ", "EST5EDT,M3.2.0,M11.1.0")  # POSIX rule: no tzdata needed
    time.tzset()
    try:
        ambiguous = _dos(2021, 11, 7, 1, 30)
        members = [
            _m("a", fields=_dos(2021, 7, 1, 12, 0)),  # the first record is always Python's
            _m("b", fields={"date": 0xFFFF, "time": 0xFFFF}),
            _m("c", fields=ambiguous),
            _m("d", fields=_dos(2021, 12, 1, 12, 0)),
            _m("e/../e2", fields=ambiguous),  # Python's record
            _m("f", fields=ambiguous),
            _m("g", fields=_dos(2021, 7, 1, 12, 0)),
            _m("h/../h2"),
            _m("i", fields={"date": 0, "time": 0}),  # first of its run too, with a zero key
        ]
        result = _assert_same(craft.build_zip(members), monkeypatch, caplog)
        mtimes = dict(zip(result["paths"], result["mtime"]))
        assert mtimes["b"] > 4e9  # 2107-15-31 31:63:62, normalised by mktime
        assert mtimes["c"] == mtimes["e2"] == mtimes["f"]
        assert mtimes["i"] > 3e8  # 1980-01-00 -> 01-01
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_offset_boundary(native_run, monkeypatch, caplog):
    result = _assert_same(_offset_at_the_end(), monkeypatch, caplog)
    assert result["offset"][2] == -1


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_records_parse_the_same(case, native_run, monkeypatch, caplog):
    data = craft.build_zip(CRAFTED[case], comment=b"c")
    result = _assert_same(data, monkeypatch, caplog, case)
    assert isinstance(result, dict), result  # every case is an archive that opens


@pytest.mark.parametrize("native", [True, False])
def test_extended_timestamps_past_2038_and_before_1970(native, monkeypatch, caplog):
    """Info-ZIP writes the extended timestamp unsigned (2040 read as 1903 before). As unzip decides
    it, a value with its top bit set counts only where the DOS time agrees: from 2038-01-18 on
    (unsigned) or at the 1980 minimum zip clamps earlier times to (before 1970); beside any other
    DOS time it was read as a time before 1970 (1903 next to 2021) and the DOS time now stands."""
    if native and zipfmt.PLAIN_RUN is None:
        pytest.skip("cdmlfs._zipdir is not built")
    data = craft.build_zip([m for m in CRAFTED["times"] if m.name.startswith(b"ext")])
    snapshot = _parse(data, native, monkeypatch, caplog)[0]
    assert isinstance(snapshot, dict), snapshot
    mtimes = dict(zip(snapshot["paths"], snapshot["mtime"]))
    assert mtimes["ext-2040"] == 2_208_988_800  # 2040-01-01 UTC
    assert mtimes["ext-1960"] == -305_000_000
    assert mtimes["ext-negative"] == zipfmt._dos_to_epoch(craft.DOS_DATE, craft.DOS_TIME)  # 2021-06-15
    assert mtimes["ext-1960-dos-noon"] == zipfmt._dos_to_epoch(0 << 9 | 1 << 5 | 1, 0x6000)
    assert mtimes["ext-2106-dos-2107"] == 2**32 - 1
    assert mtimes["ext"] == 1_234_567_890


@pytest.mark.parametrize("native", [True, False])
def test_an_ntfs_time_past_the_index_range_is_taken_as_absent(native, monkeypatch, caplog):
    """A garbage FILETIME (all ones) was read as year 36812; unzip takes the DOS time then."""
    if native and zipfmt.PLAIN_RUN is None:
        pytest.skip("cdmlfs._zipdir is not built")
    members = [
        _m("first"),
        _m("huge", extra=_ntfs(2**64 - 1)),
        _m("huge-ext", extra=_ntfs(2**64 - 1) + _ext_time(7)),
    ]
    snapshot = _parse(craft.build_zip(members), native, monkeypatch, caplog)[0]
    mtimes = dict(zip(snapshot["paths"], snapshot["mtime"]))
    assert mtimes["huge"] == zipfmt._dos_to_epoch(craft.DOS_DATE, craft.DOS_TIME)
    assert mtimes["huge-ext"] == 7


@pytest.mark.parametrize("native", [True, False])
def test_a_directory_by_attributes_alone_with_data_is_a_file(native, monkeypatch, caplog, tmp_path: Path):
    """No slash, the DOS directory bit (or S_IFDIR in a Unix mode) and data: unzip and zipfile
    extract a file by that name; it was shown as an empty directory, its data unreachable."""
    if native and zipfmt.PLAIN_RUN is None:
        pytest.skip("cdmlfs._zipdir is not built")
    dos = craft.member("folder", b"twelve bytes", fields={"made_by": 0, "eattr": 0x10})
    unix = craft.member("notdir", b"abcde", mode=0o040755)
    empty = craft.member("empty", b"", method=0, fields={"made_by": 0, "eattr": 0x10})
    data = craft.build_zip([dos, unix, empty])
    snapshot = _parse(data, native, monkeypatch, caplog)[0]
    assert isinstance(snapshot, dict), snapshot
    kinds = dict(zip(snapshot["paths"], snapshot["kind"]))
    modes = dict(zip(snapshot["paths"], snapshot["mode"]))
    assert (kinds["folder"], kinds["notdir"], kinds["empty"]) == (FILE, FILE, DIR)
    assert (modes["folder"], modes["notdir"]) == (0o755, 0o755)  # "folder" was 0o644
    if not native:  # (the bytes do not depend on the parser)
        (tmp_path / "a.zip").write_bytes(data)
        with Archive(str(tmp_path / "a.zip")) as ar, zipfile.ZipFile(tmp_path / "a.zip") as zf:
            assert ar.read("folder") == zf.read("folder") == b"twelve bytes"
            assert ar.read("notdir") == b"abcde"
        if shutil.which("unzip"):  # the mode unzip gives them (umask 022)
            out = tmp_path / "out"
            unzip = ["unzip", "-q", str(tmp_path / "a.zip"), "-d", str(out)]
            subprocess.run(unzip, check=True, preexec_fn=lambda: os.umask(0o022))
            assert (out / "folder").read_bytes() == b"twelve bytes"
            assert stat.S_IMODE((out / "folder").stat().st_mode) == modes["folder"]


def test_prefixed_archive_and_zip64_records(native_run, monkeypatch, caplog):
    members = [_m("a/b"), _m("a/c"), _m("d")]
    for data in (
        b"#!/bin/sh\nexit 0\n" + craft.build_zip(members),
        craft.build_zip(members, zip64=True),
        craft.build_zip(members, prefix=b"MZ" + bytes(500)),
    ):
        assert isinstance(_assert_same(data, monkeypatch, caplog), dict)


def test_zipfile_and_infozip_archives(native_run, tmp_path: Path, monkeypatch, caplog):
    files = sample_files(3)
    paths = [
        python_zip(tmp_path / "deflated.zip", files, dirs=("empty/", "data/")),
        python_zip(tmp_path / "stored.zip", files, zipfile.ZIP_STORED),
        python_zip(tmp_path / "zip64.zip", files, force_zip64=True),
        python_zip(tmp_path / "streamed.zip", files, streamed=True),
    ]
    src = write_tree(tmp_path / "src", files, symlinks={"link": "data/random.bin"}, empty_dirs=("void/x",))
    paths.append(infozip(tmp_path / "infozip.zip", src))
    paths.append(infozip(tmp_path / "infozip-x.zip", src, extra=("-X",)))  # no extra fields
    for path in paths:
        assert isinstance(_assert_same(path.read_bytes(), monkeypatch, caplog, path.name), dict)


def test_runs_that_imply_many_directories_fill_their_columns(native_run, monkeypatch, caplog):
    """Records implying many directories each, then records in known ones: a run's column space
    ran out and later entries were written past it (sizes, parents and kinds garbled)."""
    import io

    for deep, flat in ((2, 12), (10, 120), (20, 400)):
        members = [_m("first")]  # the first record is always Python's
        members += [_m(f"x{j}/" + "d/" * 31 + "leaf") for j in range(deep)]  # 32 implied each
        members += [_m(f"f{k}") for k in range(flat)]
        _assert_same(craft.build_zip(members), monkeypatch, caplog, f"{deep} deep, {flat} flat")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:  # zipfile writes no directory entries
        for i in range(79):
            for leaf in "xyz":
                zf.writestr(f"{i}/a/b/c/d/{leaf}", b"hello")
    result = _assert_same(buf.getvalue(), monkeypatch, caplog, "79 samples")
    assert {size for size, kind in zip(result["size"], result["kind"]) if kind == 0} == {5}


def test_many_entries_cross_the_progress_boundary(native_run, monkeypatch, caplog):
    """70,000 entries: runs stop where progress is reported, so both parsers report alike."""
    members = [_m(f"d{i // 1000:03d}/f{i:05d}", b"") for i in range(70_000)]
    members[40_000] = _m("d040/f40000/..", b"")  # a record for Python in the middle of a run
    data = craft.build_zip(members, zip64=True)
    fast = _parse(data, True, monkeypatch, caplog)
    assert fast == _parse(data, False, monkeypatch, caplog)
    assert [done for done, _ in fast[1]][:2] == [
        sum(CDH_SIZE + len(m.name) for m in members[:n]) for n in (65_536, 70_000)
    ]


def test_plain_run_adds_plain_records_and_stops_at_others(native_run):
    """The fast path really runs: it takes the plain records, with the directories they imply, and
    leaves the first other one."""
    assert zipfmt.parser_backend().startswith("C for plain records")
    members = [_m("a/x"), _m("a/y"), _m("b/c/z"), _m("a/w"), _m("a/x"), _m("a/v")]
    data = craft.build_zip(members)
    cd_start = len(data) - 22 - sum(CDH_SIZE + len(m.name) for m in members)
    builder = IndexBuilder(implied_dir_mtime=123.0)
    builder.add("a/", 1, 0o700, 0.0, 0, 0, 0, 0, 0)
    n, stop = builder.add_plain_run(native_run, data, cd_start, len(data) - 22, 100, 0, len(data), {})
    assert n == 4  # up to the duplicate a/x
    assert stop == cd_start + 4 * CDH_SIZE + 3 + 3 + 5 + 3
    index = builder.finish()
    assert index.paths == ["", "a", "a/x", "a/y", "b", "b/c", "b/c/z", "a/w"]
    assert index.lookup("b/c/z") == 6 and index.parent[6] == 5 and index.parent[5] == 4
    assert (index.mode[4], index.mtime[4], index.kind[4]) == (0o755, 123.0, 1)
    assert index.size[2] == 4 and index.offset[3] == 3 + 30 + 4  # its local header's offset


# ------------------------------------------------------------------------- mutated


def _cd_range(data: bytes) -> tuple[int, int]:
    eocd = data.rfind(b"PK\x05\x06")
    size, offset = struct.unpack_from("<II", data, eocd + 12)
    if size == 0xFFFFFFFF or offset == 0xFFFFFFFF:
        start = data.find(b"PK\x01\x02")
        return start, eocd
    return offset, offset + size


def test_mutated_central_directories_parse_the_same(native_run, monkeypatch, caplog):
    """Random byte changes in the central directory: the same index, or the same error."""
    rng = random.Random(20261130)
    seeds = list(zip_seeds().values()) + [craft.build_zip(m) for m in CRAFTED.values()]
    interesting = (0x00, 0x01, 0x2F, 0x2E, 0x5C, 0x80, 0xFF, 0x10, 0x41)
    opened = 0
    for s, seed in enumerate(seeds):
        lo, hi = _cd_range(seed)
        for trial in range(60):
            data = bytearray(seed)
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(lo, hi)
                data[at] = rng.choice(interesting) if rng.random() < 0.5 else rng.randrange(256)
            result = _assert_same(bytes(data), monkeypatch, caplog, f"seed {s} trial {trial}")
            opened += isinstance(result, dict)
    assert opened > len(seeds) * 20  # most mutants still open: the comparison covers real indexes
