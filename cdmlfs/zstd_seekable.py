"""Zstandard frame layout: frame headers, the seek table of the seekable format, skippable frames.

Random access into a zstd stream needs to know where each frame starts (in the
compressed file) and how many bytes it decodes to. Three ways to learn that,
cheapest first:

1. the **seek table** of the seekable format (a skippable frame at the very end
   whose footer ends with magic ``0x8F92EAB1``; spec: zstd's
   ``contrib/seekable_format/zstd_seekable_compression_format.md``);
2. **walking frame headers**: a frame's header may carry its content size, and
   its end is found by hopping over block headers (3 bytes each) without
   decoding anything (RFC 8878, sections 3.1.1 and 3.1.1.2);
3. decoding, for frames whose header has no content size (``tar --zstd`` and
   ``pzstd`` write such frames); :mod:`cdmlfs.formats.zstdstream` does that
   during the one tar scan it needs anyway.

This module only parses and writes layout; it never decompresses.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import NamedTuple

from cdmlfs.errors import ArchiveFormatError
from cdmlfs.sources.base import Source

ZSTD_MAGIC = 0xFD2FB528
SKIPPABLE_MASK = 0xFFFFFFF0
SKIPPABLE_BASE = 0x184D2A50
SEEK_TABLE_MAGIC = 0x184D2A5E  # skippable magic the seekable format uses for its seek table
SEEKABLE_FOOTER_MAGIC = 0x8F92EAB1
FOOTER_SIZE = 9
MAX_SEEK_TABLE_FRAMES = 0x8000000  # the reference implementation's limit
BLOCK_MAX = 128 << 10  # Block_Maximum_Size: no block may exceed 128 KiB
MAX_FRAME_HEADER = 18  # magic 4 + descriptor 1 + window 1 + dictionary id 4 + content size 8
WALK_CHUNK = 1 << 20


class FrameHeader(NamedTuple):
    header_size: int  # bytes from the magic number to the first block header
    content_size: int | None  # None when the header does not say
    has_checksum: bool
    window_size: int


class Frame(NamedTuple):
    """One frame of a zstd file: where it lies and what it decodes to (None: not known yet)."""

    offset: int
    comp_size: int
    content_size: int | None
    skippable: bool


def is_skippable_magic(magic: int) -> bool:
    return magic & SKIPPABLE_MASK == SKIPPABLE_BASE


def looks_like_zstd(head: bytes) -> bool:
    """A zstd frame or a skippable frame at the start (pzstd begins with one)."""
    if len(head) < 8:
        return False
    (magic,) = struct.unpack_from("<I", head)
    return magic == ZSTD_MAGIC or is_skippable_magic(magic)


def parse_frame_header(buf: bytes | memoryview, where: int = 0) -> FrameHeader:
    """Parse the header of the zstd frame starting at ``buf[0]`` (RFC 8878 3.1.1.1).

    Raises ValueError for anything that is not a well-formed frame header.
    """
    if len(buf) < 6:
        raise ValueError(f"truncated zstd frame header at offset {where}")
    (magic,) = struct.unpack_from("<I", buf)
    if magic != ZSTD_MAGIC:
        raise ValueError(f"no zstd frame at offset {where} (magic {magic:#010x})")
    fhd = buf[4]
    fcs_flag = fhd >> 6
    single_segment = (fhd >> 5) & 1
    if fhd & 0x08:
        raise ValueError(f"zstd frame at offset {where}: reserved header bit set")
    has_checksum = bool(fhd & 0x04)
    did_size = (0, 1, 2, 4)[fhd & 3]
    fcs_size = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    pos = 5
    window_size = 0
    if not single_segment:
        wd = buf[pos]
        exponent, mantissa = wd >> 3, wd & 7
        base = 1 << (10 + exponent)
        window_size = base + (base // 8) * mantissa
        pos += 1
    pos += did_size
    header_size = pos + fcs_size
    if len(buf) < header_size:
        raise ValueError(f"truncated zstd frame header at offset {where}")
    content_size: int | None = None
    if fcs_size:
        content_size = int.from_bytes(buf[pos : pos + fcs_size], "little")
        if fcs_size == 2:
            content_size += 256
    if single_segment:
        window_size = content_size or 0
    return FrameHeader(header_size, content_size, has_checksum, window_size)


class _Window:
    """Buffered positioned reads for walking headers: one source read per MiB, not per block."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.start = 0
        self.buf = b""

    def get(self, pos: int, n: int) -> bytes:
        end = self.start + len(self.buf)
        if pos < self.start or pos + n > end:
            length = min(max(n, WALK_CHUNK), self.source.size - pos)
            if length < n:
                raise ArchiveFormatError(f"zstd data is truncated at offset {pos}")
            self.buf = self.source.read_at(pos, length)
            self.start = pos
        i = pos - self.start
        return self.buf[i : i + n]


def walk_frames(source: Source, progress: Callable[[int, int], None] | None = None) -> list[Frame]:
    """Locate every frame by hopping over frame and block headers (no decoding).

    Raises ArchiveFormatError when the bytes are not a sequence of zstd and
    skippable frames (garbage, truncation).
    """
    size = source.size
    window = _Window(source)
    frames: list[Frame] = []
    pos = 0
    next_report = 64 << 20
    while pos < size:
        if size - pos < 8:
            raise ArchiveFormatError(f"trailing garbage at offset {pos} of the zstd stream")
        head = window.get(pos, min(MAX_FRAME_HEADER, size - pos))
        (magic,) = struct.unpack_from("<I", head)
        if is_skippable_magic(magic):
            (length,) = struct.unpack_from("<I", head, 4)
            if pos + 8 + length > size:
                raise ArchiveFormatError(f"skippable frame at offset {pos} runs past the end of the file")
            frames.append(Frame(pos, 8 + length, 0, True))
            pos += 8 + length
            continue
        try:
            hdr = parse_frame_header(head, pos)
        except ValueError as exc:
            raise ArchiveFormatError(f"corrupt zstd stream: {exc}") from None
        end = _walk_blocks(window, pos + hdr.header_size, size)
        if hdr.has_checksum:
            end += 4
        if end > size:
            raise ArchiveFormatError(f"zstd frame at offset {pos} is truncated")
        frames.append(Frame(pos, end - pos, hdr.content_size, False))
        pos = end
        if progress is not None and pos >= next_report:
            progress(pos, size)
            next_report = pos + (64 << 20)
    return frames


def _walk_blocks(window: _Window, pos: int, size: int) -> int:
    """Position just after the last block of the frame whose first block header is at ``pos``."""
    while True:
        if pos + 3 > size:
            raise ArchiveFormatError(f"zstd block header at offset {pos} is truncated")
        b = window.get(pos, 3)
        header = b[0] | (b[1] << 8) | (b[2] << 16)
        block_type = (header >> 1) & 3
        block_size = header >> 3
        if block_type == 3 or block_size > BLOCK_MAX:
            raise ArchiveFormatError(f"corrupt zstd block header at offset {pos}")
        pos += 3 + (1 if block_type == 1 else block_size)  # an RLE block stores one byte
        if header & 1:
            return pos


def read_seek_table(source: Source) -> list[Frame] | None:
    """Frames listed by the seekable format's seek table, or None when the file has none.

    The table is trusted only if it is self-consistent: correct magics and
    sizes, reserved bits clear, and compressed sizes that add up exactly to
    where the table starts. Decoded sizes are checked again when each frame is
    decoded.
    """
    size = source.size
    if size < 8 + FOOTER_SIZE:
        return None
    n, descriptor, magic = struct.unpack("<IBI", source.read_at(size - FOOTER_SIZE, FOOTER_SIZE))
    if magic != SEEKABLE_FOOTER_MAGIC:
        return None
    if descriptor & 0x7C:
        raise ArchiveFormatError("seek table uses reserved descriptor bits (a newer seekable format?)")
    entry_size = 12 if descriptor & 0x80 else 8
    if n > MAX_SEEK_TABLE_FRAMES:
        raise ArchiveFormatError(f"seek table lists {n} frames (more than the format allows)")
    table_size = n * entry_size + FOOTER_SIZE
    start = size - table_size - 8
    if start < 0:
        raise ArchiveFormatError("seek table is larger than the file")
    raw = source.read_at(start, table_size + 8)
    skip_magic, frame_size = struct.unpack_from("<II", raw)
    if skip_magic != SEEK_TABLE_MAGIC or frame_size != table_size:
        raise ArchiveFormatError("seekable footer found but the seek table frame around it is malformed")
    frames: list[Frame] = []
    pos = 0
    unpack = struct.Struct("<II").unpack_from
    for i in range(n):
        comp, dec = unpack(raw, 8 + i * entry_size)
        frames.append(Frame(pos, comp, dec, False))
        pos += comp
    if pos != start:
        raise ArchiveFormatError(
            f"seek table frames add up to {pos} bytes but the table starts at offset {start}"
        )
    return frames


def skippable_frame(payload: bytes, nibble: int = 0) -> bytes:
    """A skippable frame (magic ``0x184D2A5?``) carrying ``payload``; every zstd decoder skips it."""
    if not 0 <= nibble <= 15:
        raise ValueError("skippable magic nibble must be 0..15")
    return struct.pack("<II", SKIPPABLE_BASE | nibble, len(payload)) + payload


def seek_table_frame(entries: list[tuple[int, int]]) -> bytes:
    """The seekable format's seek table (no per-frame checksums) for ``(comp_size, dec_size)`` entries."""
    if len(entries) > MAX_SEEK_TABLE_FRAMES:
        raise ValueError("too many frames for a seek table")
    body = bytearray()
    for comp, dec in entries:
        if comp > 0xFFFFFFFF or dec > 0xFFFFFFFF:
            raise ValueError("seek table entries are 32-bit: frames must stay under 4 GiB")
        body += struct.pack("<II", comp, dec)
    body += struct.pack("<IBI", len(entries), 0, SEEKABLE_FOOTER_MAGIC)
    return struct.pack("<II", SEEK_TABLE_MAGIC, len(body)) + bytes(body)
