"""Deflate and CRC-32 for member reads: the only module the package uses for them.

Uses the C accelerator ``cdmlfs._native`` (libdeflate, GIL released) when it is
built, and the stdlib's zlib otherwise; ``CDMLFS_NATIVE=0`` forces the fallback.
Both give the same bytes and raise the same errors with the same reasons:

* :class:`~cdmlfs.errors.CorruptMemberError` when the data does not decode, decodes
  to another size than declared, has bytes after the end of the stream, or fails
  its CRC (``member`` is left for the caller to fill in);
* :class:`~cdmlfs.errors.SourceError` when the bytes cannot be read (I/O error,
  file shorter than the member claims);
* ``ValueError``/``TypeError`` for arguments no caller should pass (negative sizes).

Nothing ever returns partial output, and no declared size is allocated before it
has been checked against what the compressed size can possibly inflate to.
When libdeflate refuses a member or its CRC fails, the C code asks zlib for the
verdict, so the reasons match the fallback's. The one remaining difference:
libdeflate accepts a few malformed-but-decodable streams (e.g. incomplete Huffman
codes) that zlib rejects, and returns them when their CRC matches.
"""

from __future__ import annotations

import logging
import os
import stat
import zlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from cdmlfs.errors import CorruptMemberError, SourceError

log = logging.getLogger(__name__)

# Reason strings, shared with native/cdmlfs_native.c so both backends agree.
BAD_DATA = "invalid deflate data"
SIZE_MISMATCH = "inflated to a different size than declared"
TRAILING_DATA = "trailing data after the end of the deflate stream"
TRUNCATED = "truncated deflate data"

# Deflate cannot turn one input byte into more than 1032 output bytes.
MAX_RATIO = 1032
RATIO_SLACK = 1024

_STEP = 1 << 24  # output bytes per zlib call when filling a caller's buffer
PIECE = 1 << 20  # compressed bytes read at a time by read_deflated_in_pieces

Buffer = Any  # any bytes-like object (bytes, bytearray, memoryview, mmap)


class Backend(NamedTuple):
    """One implementation of the public functions (used directly by the tests)."""

    crc32: Any
    inflate: Any
    read_deflated: Any
    read_stored: Any
    inflate_into: Any


# ------------------------------------------------------------------- checks


def _check_crc_arg(crc: int) -> None:
    if not isinstance(crc, int):
        raise TypeError("crc must be an int")
    if not 0 <= crc <= 0xFFFFFFFF:
        raise ValueError("crc must be in range(2**32)")


def check_sizes(comp_size: int, size: int) -> None:
    """Refuse sizes that are negative or that deflate cannot produce, before allocating."""
    if comp_size < 0 or size < 0:
        raise ValueError("sizes must be non-negative")
    if size > comp_size * MAX_RATIO + RATIO_SLACK:
        raise CorruptMemberError(f"declared size {size} is impossible for {comp_size} compressed bytes")


def crc_mismatch(expected: int, got: int) -> str:
    """The one wording of a failed CRC check (logs and errors name it the same way everywhere)."""
    return f"CRC mismatch (expected {expected:#010x}, got {got:#010x})"


def check_crc(got: int, expected: int | None) -> None:
    """Raise CorruptMemberError unless expected is None or equals got."""
    if expected is not None and got != expected:
        raise CorruptMemberError(crc_mismatch(expected, got))


def _check_extent(fd: int, offset: int, n: int) -> None:
    """Refuse reads past the end of a regular file before allocating for them."""
    if offset < 0:
        raise ValueError("offset must be non-negative")
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise SourceError(f"read error at offset {offset}: {exc.strerror or exc}") from exc
    if stat.S_ISREG(st.st_mode) and offset + n > st.st_size:
        have = max(0, st.st_size - offset)
        raise SourceError(f"unexpected end of file: got {have} of {n} bytes at offset {offset}")


# ----------------------------------------------------------- pure Python


def _pread_exact(fd: int, offset: int, n: int) -> bytes:
    """Exactly n bytes at offset; one pread in the usual case, a loop for short reads."""
    parts: list[bytes] = []
    done = 0
    try:
        while done < n:
            chunk = os.pread(fd, min(n - done, 1 << 30), offset + done)
            if not chunk:
                raise SourceError(f"unexpected end of file: got {done} of {n} bytes at offset {offset}")
            parts.append(chunk)
            done += len(chunk)
    except OSError as exc:
        raise SourceError(f"read error at offset {offset}: {exc.strerror or exc}") from exc
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _py_stream(chunks: Iterator[Buffer], size: int, step: int) -> Iterator[bytes]:
    """Yield the output of a raw deflate stream, given as ``chunks`` of input, in pieces of at most
    ``step`` bytes.

    Checks, in order, exactly like the C ``zlib_inflate_exact``: never more than
    ``size`` bytes (one spare byte detects overflow), stream complete, no
    trailing input. Raises CorruptMemberError after the last piece otherwise. A
    chunk is asked for only when the one before is used up, so a stream that ends
    early is found before the rest is read.
    """
    d = zlib.decompressobj(-15)
    filled = 0
    feed: Buffer = b""
    try:
        while filled < size:
            if not feed and not (feed := next(chunks, b"")):
                break
            out = d.decompress(feed, min(size - filled, step))
            feed = d.unconsumed_tail
            if out:
                filled += len(out)
                yield out
            if d.eof:
                break
        if filled < size:
            raise CorruptMemberError(SIZE_MISMATCH if d.eof else BAD_DATA)
        while not d.eof:  # all the output is out: the stream must end here, with not a byte more
            if not feed and not (feed := next(chunks, b"")):
                raise CorruptMemberError(BAD_DATA)
            if d.decompress(feed, 1):
                raise CorruptMemberError(SIZE_MISMATCH)
            feed = d.unconsumed_tail
    except zlib.error:
        raise CorruptMemberError(BAD_DATA) from None
    if d.unused_data or feed or next(chunks, b""):
        raise CorruptMemberError(TRAILING_DATA)


def _py_crc32(data: Buffer, value: int = 0) -> int:
    return zlib.crc32(data, value & 0xFFFFFFFF)


def _py_inflate(data: Buffer, size: int, crc: int) -> bytes:
    _check_crc_arg(crc)
    check_sizes(memoryview(data).nbytes, size)
    if size == 0 and memoryview(data).nbytes == 0:
        out = b""  # some writers store an empty member as no deflate bytes at all
    else:
        pieces = list(_py_stream(iter((data,)), size, max(size, 1)))
        out = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    check_crc(zlib.crc32(out), crc)
    return out


def _py_inflate_into(data: Buffer, out: Buffer, crc: int) -> int:
    view = memoryview(out)
    if view.readonly:
        raise TypeError("out must be a writable bytes-like object")
    view = view.cast("B")
    size = view.nbytes
    _check_crc_arg(crc)
    comp_size = memoryview(data).nbytes
    check_sizes(comp_size, size)
    got = 0
    if not (size == 0 and comp_size == 0):
        pos = 0
        for piece in _py_stream(iter((data,)), size, _STEP):
            view[pos : pos + len(piece)] = piece
            got = zlib.crc32(piece, got)
            pos += len(piece)
    check_crc(got, crc)
    return size


def _py_read_deflated(fd: int, offset: int, comp_size: int, size: int, crc: int) -> bytes:
    _check_crc_arg(crc)
    check_sizes(comp_size, size)
    _check_extent(fd, offset, comp_size)
    return _py_inflate(_pread_exact(fd, offset, comp_size), size, crc)


def _py_read_stored(fd: int, offset: int, size: int, crc: int | None = None) -> bytes:
    if crc is not None:
        _check_crc_arg(crc)
    if size < 0:
        raise ValueError("sizes must be non-negative")
    _check_extent(fd, offset, size)
    out = _pread_exact(fd, offset, size)
    if crc is not None:
        check_crc(zlib.crc32(out), crc)
    return out


def plausible_comp_size(comp_size: int, size: int) -> bool:
    """Whether a real deflate stream of ``size`` bytes can take ``comp_size`` bytes.

    Stored blocks add 5 bytes per 64 KiB; the slack covers headers and a few empty
    blocks. The C fast path uses the same rule (native/fastpath.c).
    """
    return comp_size <= size + size // 16 + 1024


def read_deflated_in_pieces(
    read_at: Callable[[int, int], Buffer], offset: int, comp_size: int, size: int, crc: int, step: int = PIECE
) -> bytes:
    """Inflate a member read ``step`` compressed bytes at a time, checked like :func:`inflate`.

    For members whose compressed size is implausible for their size (a record
    declaring 16 MiB for 100 bytes): reading them whole allocated the declared
    compressed size in every reader at once, and the heap kept the holes (the
    daemon grew a whole cache's worth over its bound). Here memory stays at
    ``size`` plus one piece, and a stream that ends early fails after its first
    piece instead of after reading everything.
    """
    _check_crc_arg(crc)
    check_sizes(comp_size, size)
    if step <= 0:
        raise ValueError("step must be positive")

    def pieces() -> Iterator[Buffer]:
        pos = 0
        while pos < comp_size:
            chunk = read_at(offset + pos, min(step, comp_size - pos))
            if not chunk:
                raise SourceError(f"unexpected end of data at offset {offset + pos}")
            pos += len(chunk)
            yield chunk

    out = list(_py_stream(pieces(), size, max(size, 1)))
    data = out[0] if len(out) == 1 else b"".join(out)
    check_crc(zlib.crc32(data), crc)
    return data


PYTHON = Backend(_py_crc32, _py_inflate, _py_read_deflated, _py_read_stored, _py_inflate_into)


# ---------------------------------------------------------------- native


def _load_native() -> tuple[Any, str]:
    """The extension module (or None) and the detail string for backend()."""
    if os.environ.get("CDMLFS_NATIVE", "").strip() == "0":
        return None, "disabled by CDMLFS_NATIVE=0"
    try:
        from cdmlfs import _native
    except ImportError as exc:
        log.warning("cdmlfs._native is not built, using the slower pure-Python inflate: %s", exc)
        return None, f"cdmlfs._native not built: {exc}"
    detail = f"libdeflate {_native.LIBDEFLATE_VERSION}, zlib {_native.ZLIB_VERSION}"
    return _native, f"{detail}, CRC-32 by {_native.CRC32_BACKEND}"


_native, _detail = _load_native()


def _native_backend(mod: Any) -> Backend:
    """Wrap the extension's functions so they raise cdmlfs.errors types."""
    decode_error = mod.DecodeError

    def read_error(exc: OSError | EOFError, offset: int) -> SourceError:
        if isinstance(exc, EOFError):
            return SourceError(str(exc))
        return SourceError(f"read error at offset {offset}: {exc.strerror or exc}")

    def inflate(data: Buffer, size: int, crc: int) -> bytes:
        try:
            return mod.inflate(data, size, crc)
        except decode_error as exc:
            raise CorruptMemberError(str(exc)) from None

    def inflate_into(data: Buffer, out: Buffer, crc: int) -> int:
        try:
            return mod.inflate_into(data, out, crc)
        except decode_error as exc:
            raise CorruptMemberError(str(exc)) from None

    def read_deflated(fd: int, offset: int, comp_size: int, size: int, crc: int) -> bytes:
        try:
            return mod.read_deflated(fd, offset, comp_size, size, crc)
        except decode_error as exc:
            raise CorruptMemberError(str(exc)) from None
        except (OSError, EOFError) as exc:
            raise read_error(exc, offset) from exc

    def read_stored(fd: int, offset: int, size: int, crc: int | None = None) -> bytes:
        try:
            return mod.read_stored(fd, offset, size, crc)
        except decode_error as exc:
            raise CorruptMemberError(str(exc)) from None
        except (OSError, EOFError) as exc:
            raise read_error(exc, offset) from exc

    return Backend(mod.crc32, inflate, read_deflated, read_stored, inflate_into)


NATIVE: Backend | None = _native_backend(_native) if _native is not None else None
_active = NATIVE or PYTHON


# ----------------------------------------------------------------- public


def backend() -> tuple[str, str]:
    """Which implementation is in use and why, e.g.
    ("native", "libdeflate 1.14, zlib 1.2.13, CRC-32 by isa-l")."""
    return ("native" if NATIVE is not None else "python", _detail)


def native_module() -> Any:
    """The loaded extension module, or None (cdmlfs.checkpoints uses its zlib part)."""
    return _native


def crc32(data: Buffer, value: int = 0) -> int:
    """CRC-32 of data, continuing from value, as zlib.crc32."""
    return _active.crc32(data, value)


def inflate(data: Buffer, size: int, crc: int) -> bytes:
    """Raw deflate bytes -> exactly ``size`` bytes, CRC-32 checked."""
    return _active.inflate(data, size, crc)


def read_deflated(fd: int, offset: int, comp_size: int, size: int, crc: int) -> bytes:
    """Positioned read of a deflated member from fd, inflated and CRC-checked in one call."""
    return _active.read_deflated(fd, offset, comp_size, size, crc)


def read_stored(fd: int, offset: int, size: int, crc: int | None) -> bytes:
    """Positioned read of exactly ``size`` bytes, CRC-checked unless crc is None."""
    return _active.read_stored(fd, offset, size, crc)


def inflate_into(data: Buffer, out: Buffer, crc: int) -> int:
    """Inflate into the writable buffer ``out``, which must be filled exactly; returns its size.

    On failure ``out`` holds unspecified bytes: never hand it out then.
    """
    return _active.inflate_into(data, out, crc)
