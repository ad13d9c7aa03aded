"""Streaming decoders for the methods that are not on the deflate hot path.

bzip2 (12), LZMA (14), Zstandard (93) and xz (95) members are decoded through
file-like streams whose ``read(n)`` never returns more than ``n`` bytes, so a
member that lies about its size cannot make us allocate more than we asked
for. The same streams serve whole small members and bounded forward chunks of
large ones (see :mod:`cdmlfs.reader`).
"""

from __future__ import annotations

import bz2
import io
import lzma
import struct
import zlib

from cdmlfs.errors import CorruptMemberError, MemberError, SourceError, UnsupportedMethodError
from cdmlfs.index import BZIP2, DEFLATE, LZMA, STORED, XZ, ZSTD
from cdmlfs.sources.base import Source, SourceRange

METHOD_NAMES = {
    STORED: "stored",
    1: "shrink",
    6: "implode",
    DEFLATE: "deflate",
    9: "deflate64",
    BZIP2: "bzip2",
    LZMA: "lzma",
    ZSTD: "zstd",
    XZ: "xz",
    97: "wavpack",
    98: "ppmd",
    99: "aes-encrypted",
}
# Deflate is not here: the reader serves it whole (libdeflate) or through checkpoints.
STREAM_METHODS = frozenset({BZIP2, LZMA, ZSTD, XZ})


def method_name(method: int) -> str:
    return METHOD_NAMES.get(method, f"method {method}")


# Largest decoder window (LZMA dictionary) we allocate: a member's header chooses it, and the
# decoder touches up to that much memory outside the cache. Same limit as the zstd CLI's default.
# The one definition: the zstd readers (zstdframes, zstdstream) take theirs from here.
MAX_WINDOW_LOG = 27
MAX_WINDOW = 1 << MAX_WINDOW_LOG
# Taken whatever the cache: what zstd -19 and the frames of cdmlfs pack need (see window_limit).
WINDOW_FLOOR = 8 << 20


def window_limit(cache_limit: int) -> int:
    """The largest decoder window a reader whose cache holds ``cache_limit`` bytes takes.

    A window (a zstd frame's, an LZMA dictionary) is memory outside the cache for as long as its
    decoder lives: a tar.zst written with ``zstd --long=27`` held 128 MiB next to a 16 MiB cache,
    and the daemon peaked at 160 MiB. A quarter of the cache keeps windows in proportion to the
    bound the user set (the default cache takes the 128 MiB of ``--long=27``); 8 MiB whatever
    the cache, so the archives most tools write read with any cache.
    """
    return min(MAX_WINDOW, max(WINDOW_FLOOR, cache_limit // 4))


def window_refusal(window: int, limit: int) -> str:
    """Why a decoder of ``window`` bytes is refused under ``limit`` (window_limit), and what to do."""
    if window > MAX_WINDOW:  # no cache takes it
        return (
            f"needs a {-(-window // (1 << 20))} MiB decoding window, more than the {MAX_WINDOW >> 20} MiB "
            "cdmlfs decodes to keep its memory bound"
        )
    need = -(-4 * window // (1 << 20))  # MiB, rounded up: the cache whose quarter takes it
    return (
        f"needs a {-(-window // (1 << 20))} MiB decoding window, more than the {limit >> 20} MiB "
        f"this cache allows a decoder (a quarter of it, 8 MiB at least): mount with "
        f"--cache-size {need}M or more"
    )


def _lzma_zip_filters(header: bytes, size: int | None = None) -> list[dict]:
    """ZIP method 14: 2-byte version, 2-byte properties size, then LZMA1 properties.

    The dictionary never needs to exceed the member's size (no match reaches
    further back than the output), so it is cut to that; one still larger than
    MAX_WINDOW is refused rather than letting a header size our memory.
    """
    if len(header) < 9:
        raise CorruptMemberError("truncated LZMA header")
    (props_size,) = struct.unpack_from("<H", header, 2)
    if props_size != 5:
        raise CorruptMemberError(f"unexpected LZMA properties size {props_size}")
    d = header[4]
    if d >= 9 * 5 * 5:
        raise CorruptMemberError("invalid LZMA properties")
    lc, d = d % 9, d // 9
    lp, pb = d % 5, d // 5
    (dict_size,) = struct.unpack_from("<I", header, 5)
    if size is not None:
        dict_size = min(dict_size, max(size, 4096))
    if dict_size > MAX_WINDOW:
        raise UnsupportedMethodError(
            f"LZMA dictionary of {dict_size >> 20} MiB exceeds the {MAX_WINDOW >> 20} MiB decoder limit"
        )
    return [{"id": lzma.FILTER_LZMA1, "lc": lc, "lp": lp, "pb": pb, "dict_size": dict_size}]


BZIP2_WINDOW = 4 << 20  # bzip2's decoder needs about 3.7 MB at most (900k blocks)
XZ_HEADERS = 12 + 1024  # an xz stream header and the largest block header
_LZMA2 = 0x21


def xz_dictionary(head: bytes) -> int | None:
    """The dictionary size of the LZMA2 filter in the first block header of an xz stream (``xz -0``
    256 KiB, ``-9`` 64 MiB); None when ``head`` does not say (no block, another layout).

    Taken at the limit, a 40 MiB member written with ``xz -0`` counted as a 40 MiB window.
    """
    if len(head) < 14 or head[:6] != b"\xfd7zXZ\x00" or head[12] == 0:
        return None
    end = 12 + (head[12] + 1) * 4
    flags = head[13]
    pos = 14

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while pos < end and shift < 63:
            byte = head[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
        raise ValueError("xz block header ends inside a number")

    try:
        for present in (flags & 0x40, flags & 0x80):  # compressed, then uncompressed size
            if present:
                varint()
        for _ in range((flags & 3) + 1):
            filter_id, props = varint(), varint()
            if filter_id == _LZMA2 and props == 1 and pos < min(end, len(head)):
                bits = head[pos] & 0x3F
                return 0xFFFFFFFF if bits >= 40 else (2 | (bits & 1)) << (bits // 2 + 11)
            pos += props
    except (ValueError, IndexError):
        return None
    return None


def window_size(source: Source, method: int, offset: int, comp_size: int, size: int) -> int:
    """About how much memory a decoder of this member holds outside the cache (its window).

    Read from the member's own header where it says (zstd frame header, LZMA
    properties, an xz stream's first LZMA2 filter), never more than the member's size; an xz
    stream whose first block does not say is taken at the limit.
    """
    try:
        if method == ZSTD:
            from cdmlfs.zstd_seekable import declared_window

            return min(declared_window(source, offset, comp_size), size)
        if method == LZMA:
            return _lzma_zip_filters(source.read_at(offset, min(9, comp_size)), size)[0]["dict_size"]
        if method == XZ:
            said = xz_dictionary(source.read_at(offset, min(XZ_HEADERS, comp_size)))
            return min(MAX_WINDOW if said is None else said, size)
    except (ValueError, CorruptMemberError, UnsupportedMethodError, SourceError):
        return 0  # opening the decoder reports it
    if method == BZIP2:
        return min(BZIP2_WINDOW, size)
    return min(MAX_WINDOW, size)


def open_stream(
    source: Source,
    method: int,
    offset: int,
    comp_size: int,
    size: int | None = None,
    window_max: int = MAX_WINDOW,
):
    """A file-like object with bounded ``read(n)`` over member ``method`` data at ``offset``.

    ``size`` (the declared uncompressed size) bounds the LZMA dictionary. Decoder
    set-up failures (bad properties, a window over the limit) are member errors; running out of
    memory is not (it passes: a corrupt verdict would stick to the member for the whole mount).
    ``window_max`` caps the zstd window and the xz memory of every frame or stream in the member:
    ``window_size`` reads only the first, and a later one (``cat a.zst b.zst``) declaring a 64 MiB
    window was decoded beside a 16 MiB cache. A frame over it fails its read (not corrupt).
    """
    try:
        return _open_stream(source, method, offset, comp_size, size, window_max)
    except (lzma.LZMAError, ValueError, OSError, EOFError) as exc:
        raise CorruptMemberError(f"cannot start decoding ({exc or type(exc).__name__})") from None


def _open_stream(source: Source, method: int, offset: int, comp_size: int, size: int | None, window_max: int):
    if method == BZIP2:
        return bz2.BZ2File(SourceRange(source, offset, comp_size))
    if method == LZMA:
        header = source.read_at(offset, min(9, comp_size))
        filters = _lzma_zip_filters(header, size)
        return lzma.LZMAFile(
            SourceRange(source, offset + 9, comp_size - 9), format=lzma.FORMAT_RAW, filters=filters
        )
    if method == XZ:
        import _compression  # LZMAFile cannot pass memlimit; this is the reader it wraps

        raw = _compression.DecompressReader(
            SourceRange(source, offset, comp_size),
            lzma.LZMADecompressor,
            trailing_error=lzma.LZMAError,
            format=lzma.FORMAT_XZ,
            memlimit=window_max + (16 << 20),
        )
        return io.BufferedReader(raw)
    if method == ZSTD:
        import zstandard

        return zstandard.ZstdDecompressor(max_window_size=window_max).stream_reader(
            SourceRange(source, offset, comp_size), read_across_frames=True, closefd=False
        )
    raise UnsupportedMethodError(f"compression method {method_name(method)} is not supported")


WINDOW_OVER_LIMIT = (
    "a later zstd frame or xz stream of this member needs a larger decoding window than this cache "
    "allows a decoder (a quarter of it, 8 MiB at least): mount with a larger --cache-size"
)


def read_exact(stream, n: int) -> bytes:
    """Read exactly ``n`` decoded bytes; decoder failures and early ends are corrupt members."""
    parts = []
    got = 0
    try:
        while got < n:
            chunk = stream.read(n - got)
            if not chunk:
                raise CorruptMemberError("member decodes to fewer bytes than declared")
            parts.append(chunk)
            got += len(chunk)
    except SourceError:
        raise
    except CorruptMemberError:
        raise
    except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error) as exc:
        if isinstance(exc, lzma.LZMAError) and "Memory usage limit" in str(exc):
            raise MemberError(WINDOW_OVER_LIMIT) from exc  # not damage: no lasting verdict
        raise CorruptMemberError(f"corrupt compressed data ({exc})") from exc
    except Exception as exc:  # zstandard.ZstdError and friends
        if type(exc).__module__.startswith("zstandard"):
            if "Allocation error" in str(exc):  # memory pressure, not damage: never a lasting verdict
                raise MemoryError(str(exc)) from exc
            if "too much memory" in str(exc):  # a frame's window over window_max (open_stream)
                raise MemberError(WINDOW_OVER_LIMIT) from exc
            raise CorruptMemberError(f"corrupt compressed data ({exc})") from exc
        raise
    return parts[0] if len(parts) == 1 else b"".join(parts)


def at_end(stream) -> bool:
    """True when the stream has no more decoded bytes (a member longer than declared is corrupt).

    Called once the declared size was decoded, before the member's CRC is checked. Input that
    runs out there is an end: LZMA members may omit the end-of-stream marker (general purpose
    flag bit 1 clear, as 7-Zip writes them), and the CRC still covers every byte served.
    """
    try:
        return not stream.read(1)
    except EOFError:
        return True
    except SourceError:
        raise  # a network or disk error says nothing about the member: never call it corrupt
    except Exception:
        return False  # the decoder failed past the declared end: trailing garbage, corrupt
