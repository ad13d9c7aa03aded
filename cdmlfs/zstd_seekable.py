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
   during the one tar scan it needs anyway, walking (2.) in the same pass
   (:class:`FrameWalker` hands it the bytes it walks over).

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


def declared_window(source: Source, offset: int, comp_size: int) -> int:
    """The window the zstd frame at ``offset`` declares, read from its header (18 bytes at most);
    0 when it is no valid header (a skippable frame, damage: the decode says so)."""
    try:
        return parse_frame_header(source.read_at(offset, min(18, comp_size))).window_size
    except ValueError:
        return 0


# A cut tar.zst has no usable frame index; the plain tar that zstd decodes from it does: cdmlfs
# lists the members before the cut there (with a warning) and gives EIO for the one cut.
TRUNCATED_HINT = (
    " (a truncated copy? 'zstd -dc' writes what it holds to a .tar, which mounts with the members "
    "before the cut)"
)


class _Window:
    """Forward positioned reads for walking a zstd file: one source read per MiB, not per block.

    What is left of the buffer is kept when it is refilled, so a walk that moves forward reads
    each byte of the file once, whether it hops over block headers or hands blocks to a decoder.
    """

    def __init__(self, source: Source, on_read: Callable[[int], None] | None = None) -> None:
        self.source = source
        self.start = 0
        self.buf = memoryview(b"")
        self.hold = -1  # when >= 0: bytes from this offset on are kept across refills (not yet handed out)
        self._on_read = on_read

    def get(self, pos: int, n: int) -> memoryview:
        """``n`` bytes at ``pos``, a view into the buffer (raises ArchiveFormatError past the end)."""
        i = pos - self.start
        if i < 0 or i + n > len(self.buf):
            lo = min(pos, self.hold) if self.hold >= 0 else pos  # bytes from here are still wanted
            j = lo - self.start
            kept = len(self.buf) - j if 0 <= j < len(self.buf) else 0
            at = lo + kept
            length = min(max(pos + n - at, WALK_CHUNK), self.source.size - at)
            if at + length < pos + n:
                raise ArchiveFormatError(f"zstd data is truncated at offset {pos}{TRUNCATED_HINT}")
            fresh = self.source.read_at(at, length)
            self.buf = memoryview(b"".join((self.buf[j:], fresh)) if kept else fresh)
            self.start, i = lo, pos - lo
            if self._on_read is not None:
                self._on_read(at + length)
        return self.buf[i : i + n]


class FrameWalker:
    """The frames of a zstd file, one after another, reading the file once (forward only).

    :meth:`next_frame` finds a frame; a data frame is then passed either by
    hopping over its block headers (:meth:`hop`, nothing decoded) or through
    :meth:`frame_bytes`, a file object of its compressed bytes for a decoder,
    after which :meth:`hop` completes it. So a tar scan of a foreign archive
    locates frames and decodes the ones it needs in one pass: walking the file
    first and decoding it after read it twice (twice the download from S3).

    Raises ArchiveFormatError when the bytes are not a sequence of zstd and
    skippable frames (garbage, truncation).
    """

    def __init__(self, source: Source, on_read: Callable[[int], None] | None = None) -> None:
        self.size = source.size
        self.pos = 0  # where the next frame starts
        self.header: FrameHeader | None = None  # of the data frame being passed
        self._window = _Window(source, on_read)
        self._frame = 0  # offset of the data frame being passed
        self._block = -1  # offset of its next block header; -1 once its last block is passed

    def next_frame(self) -> Frame | None:
        """The next frame (None at the end of the file).

        A skippable frame is passed at once. A data frame comes with
        ``comp_size`` -1 (not known until its end) and must be passed
        (:meth:`hop`) before the next call.
        """
        if self.header is not None:
            raise RuntimeError("the previous zstd frame was not passed")
        pos, size = self.pos, self.size
        if pos >= size:
            return None
        if size - pos < 8:
            raise ArchiveFormatError(f"trailing garbage at offset {pos} of the zstd stream")
        head = self._window.get(pos, min(MAX_FRAME_HEADER, size - pos))
        (magic,) = struct.unpack_from("<I", head)
        if is_skippable_magic(magic):
            (length,) = struct.unpack_from("<I", head, 4)
            if pos + 8 + length > size:
                raise ArchiveFormatError(f"skippable frame at offset {pos} runs past the end of the file")
            self.pos = pos + 8 + length
            return Frame(pos, 8 + length, 0, True)
        try:
            self.header = parse_frame_header(head, pos)
        except ValueError as exc:
            raise ArchiveFormatError(f"corrupt zstd stream: {exc}") from None
        self._frame = pos
        self._block = pos + self.header.header_size
        return Frame(pos, -1, self.header.content_size, False)

    def hop(self) -> Frame:
        """Pass what is left of the current data frame (block headers only): the frame, complete."""
        header = self.header
        if header is None:
            raise RuntimeError("no zstd frame to pass")
        self._window.hold = -1  # nothing of the rest is handed out: keep none of it
        while self._next_block() > 0:
            pass
        self.header = None
        return Frame(self._frame, self.pos - self._frame, header.content_size, False)

    def frame_bytes(self) -> _FrameBytes:
        """The current data frame's compressed bytes, block by block, as a forward file object."""
        if self.header is None:
            raise RuntimeError("no zstd frame to read")
        return _FrameBytes(self, self._frame, self._frame + self.header.header_size)

    def read_frame(self, pos: int, n: int, passed: int) -> tuple[bytes | memoryview, int]:
        """Up to ``n`` bytes of the current frame at ``pos``, passing blocks as needed.

        ``passed``: the end of what is known to belong to the frame so far (the
        caller's, from its previous call). Returns the bytes and the new ``passed``.
        """
        window = self._window
        want = pos + n
        window.hold = pos  # passing blocks must not drop bytes not handed out yet
        while passed < want and (end := self._next_block()) > 0:
            passed = end
        end = min(want, passed)
        if end <= pos:
            return b"", passed
        data = window.get(pos, end - pos)
        window.hold = end
        return data, passed

    def _next_block(self) -> int:
        """Pass the next block of the current frame: where it ends (its checksum included after
        the last block), or 0 when the frame was already over."""
        pos = self._block
        if pos < 0:
            return 0
        if pos + 3 > self.size:
            raise ArchiveFormatError(f"zstd block header at offset {pos} is truncated{TRUNCATED_HINT}")
        b = self._window.get(pos, 3)
        header = b[0] | (b[1] << 8) | (b[2] << 16)
        block_type = (header >> 1) & 3
        block_size = header >> 3
        if block_type == 3 or block_size > BLOCK_MAX:
            raise ArchiveFormatError(f"corrupt zstd block header at offset {pos}")
        end = pos + 3 + (1 if block_type == 1 else block_size)  # an RLE block stores one byte
        last = header & 1
        if last:
            assert self.header is not None
            end += 4 if self.header.has_checksum else 0
        if end > self.size:
            raise ArchiveFormatError(f"zstd frame at offset {self._frame} is truncated{TRUNCATED_HINT}")
        if last:
            self._block = -1
            self.pos = end
        else:
            self._block = end
        return end


class FrameBoundary:
    """Follows the frame, block and skippable-frame headers of zstd bytes fed in order, hopping
    over payloads, to tell whether the bytes so far end on a frame boundary.

    Why: zstd's streaming decoder takes input that stops inside a frame for a normal end, so a
    truncated stream (a pipe cut short) would otherwise look complete wherever a block ended.
    Malformed headers raise ArchiveFormatError (the decoder would refuse them too).
    """

    def __init__(self) -> None:
        self._head = b""  # header bytes gathered so far
        self._skip = 0  # payload bytes to pass before the next header
        self._in_frame = False  # between a data frame's header and the end of its last block
        self._checksum = False
        self._pos = 0

    @property
    def at_boundary(self) -> bool:
        return not (self._in_frame or self._head or self._skip)

    def _want(self) -> int:
        """Header bytes needed to decide what comes next."""
        if self._in_frame:
            return 3  # a block header
        if len(self._head) < 5:
            return 5  # magic and frame header descriptor
        if is_skippable_magic(struct.unpack_from("<I", self._head)[0]):
            return 8
        fhd = self._head[4]
        single = (fhd >> 5) & 1
        return 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + ((1 if single else 0), 2, 4, 8)[fhd >> 6]

    def feed(self, data: bytes | memoryview) -> None:
        i, n = 0, len(data)
        while i < n:
            if self._skip:
                take = min(self._skip, n - i)
                self._skip -= take
                i += take
                continue
            want = self._want()
            take = min(want - len(self._head), n - i)
            self._head += bytes(data[i : i + take])
            i += take
            if len(self._head) == want and want == self._want():
                self._passed_header(self._pos + i - want)
        self._pos += n

    def _passed_header(self, where: int) -> None:
        """The header in ``_head`` (which started at offset ``where``) is whole: what follows it."""
        head, self._head = self._head, b""
        if self._in_frame:
            header = head[0] | (head[1] << 8) | (head[2] << 16)
            block_type, size = (header >> 1) & 3, header >> 3
            if block_type == 3 or size > BLOCK_MAX:
                raise ArchiveFormatError(f"corrupt zstd block header near offset {where}")
            self._skip = 1 if block_type == 1 else size
            if header & 1:  # the last block: then the checksum, if the frame has one
                self._skip += 4 if self._checksum else 0
                self._in_frame = False
            return
        (magic,) = struct.unpack_from("<I", head)
        if is_skippable_magic(magic):
            self._skip = struct.unpack_from("<I", head, 4)[0]
            return
        try:
            self._checksum = parse_frame_header(head, where).has_checksum
        except ValueError as exc:
            raise ArchiveFormatError(f"corrupt zstd stream: {exc}") from None
        self._in_frame = True


class _FrameBytes:
    """One frame's compressed bytes as a forward file object (what zstd's stream reader reads)."""

    def __init__(self, walker: FrameWalker, start: int, header_end: int) -> None:
        self._walker = walker
        self._pos = start  # next byte to hand out
        self._passed = header_end  # bytes before this are known to belong to the frame

    def read(self, n: int = -1) -> bytes | memoryview:
        data, self._passed = self._walker.read_frame(self._pos, n if n >= 0 else 1 << 62, self._passed)
        self._pos += len(data)
        return data


def walk_frames(source: Source) -> list[Frame]:
    """Every frame of a zstd file, located by hopping over frame and block headers (no decoding)."""
    walker = FrameWalker(source)
    frames: list[Frame] = []
    while (frame := walker.next_frame()) is not None:
        frames.append(frame if frame.skippable else walker.hop())
    return frames


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
