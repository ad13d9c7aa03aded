"""Byte-level archive builders whose every field can lie (hostile tests, fuzz seeds).

``zipfile`` and ``tarfile`` refuse to write inconsistent archives, which is
exactly what hostile-input tests need: local headers that disagree with the
central directory, sizes no data backs, offsets outside the file, many
central entries sharing one local header. These helpers write the structures
of APPNOTE 6.3 and ustar directly from plain values.
"""

from __future__ import annotations

import bz2
import lzma
import struct
import zlib
from dataclasses import dataclass, field

import zstandard

LFH = struct.Struct("<IHHHHHIIIHH")
CDH = struct.Struct("<IHHHHHHIIIHHHHHII")
EOCD = struct.Struct("<IHHHHIIH")
Z64_EOCD = struct.Struct("<IQHHIIQQQQ")
Z64_LOCATOR = struct.Struct("<IIQI")
UNIX = 3 << 8 | 20  # "made by" Unix, spec 2.0
DOS_TIME, DOS_DATE = 0x6000, 0x52CF  # 2021-06-15 12:00


def deflate_raw(data: bytes, level: int = 6) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


@dataclass
class ZipMember:
    """One member as written: ``data`` is what lies in the file (already compressed)."""

    name: bytes
    data: bytes
    method: int = 0
    crc: int = 0
    size: int = 0  # declared uncompressed size
    comp_size: int | None = None  # declared compressed size (default: len(data))
    mode: int = 0o100644
    flags: int = 0
    extra: bytes = b""
    local_name: bytes | None = None  # what the local header says (default: name)
    local_extra: bytes = b""
    offset: int | None = None  # central directory's local header offset (default: where it was written)
    write_local: bool = True
    fields: dict = field(default_factory=dict)  # raw central field overrides by name


def compress(method: int, content: bytes, lzma_dict: int = 1 << 16) -> bytes:
    """``content`` as a ZIP member of ``method`` stores it (unknown methods: as it is)."""
    if method == 8:
        return deflate_raw(content)
    if method == 12:
        return bz2.compress(content)
    if method == 14:  # ZIP's LZMA: version, properties size, properties, then a raw LZMA1 stream
        c = lzma.LZMACompressor(lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA1, "dict_size": lzma_dict}])
        return (
            struct.pack("<BBHB", 9, 20, 5, 0x5D)
            + struct.pack("<I", lzma_dict)
            + c.compress(content)
            + c.flush()
        )
    if method == 93:
        return zstd_frame(content)
    if method == 95:
        return lzma.compress(content, format=lzma.FORMAT_XZ)
    return content


def member(name: str | bytes, content: bytes, method: int = 8, **kw) -> ZipMember:
    """A consistent member for ``content`` (deflated or stored); keyword arguments override fields."""
    raw_name = name.encode() if isinstance(name, str) else name
    data = deflate_raw(content) if method == 8 else content
    m = ZipMember(raw_name, data, method, zlib.crc32(content), len(content))
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def build_zip(
    members: list[ZipMember],
    comment: bytes = b"",
    prefix: bytes = b"",
    cd_offset: int | None = None,
    cd_size: int | None = None,
    entries: int | None = None,
    zip64: bool = False,
) -> bytes:
    """Local headers + data, central directory, (ZIP64 records,) EOCD; overrides make it lie."""
    out = bytearray(prefix)
    offsets = []
    for m in members:
        offsets.append(len(out) - len(prefix))
        if not m.write_local:
            continue
        lname = m.name if m.local_name is None else m.local_name
        comp = len(m.data) if m.comp_size is None else m.comp_size
        out += LFH.pack(
            0x04034B50, 20, m.flags, m.method, DOS_TIME, DOS_DATE, m.crc,
            comp & 0xFFFFFFFF, m.size & 0xFFFFFFFF, len(lname), len(m.local_extra),
        )  # fmt: skip
        out += lname + m.local_extra + m.data
    cd_start = len(out) - len(prefix)
    for m, off in zip(members, offsets):
        comp = len(m.data) if m.comp_size is None else m.comp_size
        at = off if m.offset is None else m.offset
        vals = {
            "made_by": UNIX, "version": 20, "flags": m.flags, "method": m.method, "time": DOS_TIME,
            "date": DOS_DATE, "crc": m.crc, "comp": comp, "size": m.size, "nlen": len(m.name),
            "xlen": len(m.extra), "clen": 0, "disk": 0, "iattr": 0, "eattr": (m.mode << 16) & 0xFFFFFFFF,
            "offset": at,
        }  # fmt: skip
        vals.update(m.fields)
        extra = m.extra
        big = [k for k in ("size", "comp", "offset") if vals[k] > 0xFFFFFFFF]
        if big and not m.extra:
            body = b"".join(struct.pack("<Q", vals[k]) for k in ("size", "comp", "offset") if k in big)
            extra = struct.pack("<HH", 1, len(body)) + body
            vals["xlen"] = len(extra)
            for k in big:
                vals[k] = 0xFFFFFFFF
        out += CDH.pack(
            0x02014B50, vals["made_by"], vals["version"], vals["flags"], vals["method"], vals["time"],
            vals["date"], vals["crc"] & 0xFFFFFFFF, vals["comp"] & 0xFFFFFFFF, vals["size"] & 0xFFFFFFFF,
            vals["nlen"], vals["xlen"], vals["clen"], vals["disk"], vals["iattr"], vals["eattr"],
            vals["offset"] & 0xFFFFFFFF,
        )  # fmt: skip
        out += m.name + extra
    size = len(out) - len(prefix) - cd_start if cd_size is None else cd_size
    offset = cd_start if cd_offset is None else cd_offset
    n = len(members) if entries is None else entries
    if zip64:
        z64_at = len(out) - len(prefix)
        out += Z64_EOCD.pack(0x06064B50, 44, 45, 45, 0, 0, n, n, size, offset)
        out += Z64_LOCATOR.pack(0x07064B50, 0, z64_at, 1)
        out += EOCD.pack(0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, len(comment))
    else:
        out += EOCD.pack(
            0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), size & 0xFFFFFFFF, offset & 0xFFFFFFFF,
            len(comment),
        )  # fmt: skip
    return bytes(out + comment)


def zstd_frame(data: bytes, content_size: bool = True, checksum: bool = True, level: int = 3) -> bytes:
    c = zstandard.ZstdCompressor(level=level, write_content_size=content_size, write_checksum=checksum)
    if content_size:
        return c.compress(data)
    obj = c.compressobj()  # streaming: the frame header then carries no content size
    return obj.compress(data) + obj.flush()


def lzma1_literals_without_end_marker(data: bytes) -> bytes:
    """A raw LZMA1 stream (lc=3, lp=0, pb=2) of ``data`` coded as literals, with no end marker.

    liblzma's encoders always write the end-of-stream marker; ZIP method 14 members
    without one (general purpose flag bit 1 clear, as 7-Zip writes them) need this
    tiny range coder: every byte a literal, so the state never leaves 0.
    """
    low, rng, cache, pending = 0, 0xFFFFFFFF, 0, 1
    out = bytearray()

    def shift() -> None:
        nonlocal low, cache, pending
        if low < 0xFF000000 or low >= 1 << 32:
            carry = low >> 32
            byte = cache
            while True:
                out.append((byte + carry) & 0xFF)
                byte = 0xFF
                pending -= 1
                if not pending:
                    break
            cache = (low >> 24) & 0xFF
        pending += 1
        low = (low & 0x00FFFFFF) << 8

    def bit(probs: list[int], i: int, b: int) -> None:
        nonlocal low, rng
        p = probs[i]
        bound = (rng >> 11) * p
        if b:
            low += bound
            rng -= bound
            probs[i] = p - (p >> 5)
        else:
            rng = bound
            probs[i] = p + ((2048 - p) >> 5)
        while rng < 1 << 24:
            rng = (rng << 8) & 0xFFFFFFFF
            shift()

    is_match = [1024] * (12 << 4)
    literal = [1024] * (0x300 << 3)
    prev = 0
    for pos, byte in enumerate(data):
        bit(is_match, pos & 3, 0)
        base = 0x300 * (prev >> 5)
        sym = 1
        for k in range(7, -1, -1):
            b = (byte >> k) & 1
            bit(literal, base + sym, b)
            sym = (sym << 1) | b
        prev = byte
    for _ in range(5):
        shift()
    return bytes(out)
