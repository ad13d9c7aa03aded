"""Tar headers: parse (ustar, GNU, pax) and build (ustar + pax) 512-byte header blocks.

Written from POSIX.1-2017 ``pax`` (ustar interchange format, pax extended
headers) and the GNU tar manual's "Basic Tar Format" (long names ``L``/``K``,
base-256 numbers, the old-GNU layout of the prefix area). Parsing and
building live together so the writer (``cdmlfs pack``) and the reader agree
byte for byte.
"""

from __future__ import annotations

from typing import NamedTuple

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
MAX_OCTAL_11 = 8**11 - 1  # the largest size or mtime a 12-byte octal field holds

REGTYPE = b"0"
AREGTYPE = b"\0"
LNKTYPE = b"1"
SYMTYPE = b"2"
CHRTYPE = b"3"
BLKTYPE = b"4"
DIRTYPE = b"5"
FIFOTYPE = b"6"
CONTTYPE = b"7"
PAX_LOCAL = b"x"
PAX_GLOBAL = b"g"
SOLARIS_PAX = b"X"  # Solaris tar wrote per-file extended headers with this flag
GNU_LONGNAME = b"L"
GNU_LONGLINK = b"K"
GNU_DUMPDIR = b"D"
GNU_SPARSE = b"S"
GNU_MULTIVOL = b"M"
GNU_VOLHDR = b"V"
GNU_OLD_LONGNAME = b"N"


class TarHeaderError(ValueError):
    """A block that is not a valid tar header (bad checksum or number field)."""


class RawHeader(NamedTuple):
    name: bytes  # prefix/name already joined for POSIX ustar
    mode: int
    size: int
    mtime: int
    typeflag: bytes
    linkname: bytes
    old_gnu_sparse_extended: bool  # an old-GNU sparse header continues in extra 512-byte blocks
    unreadable: tuple[str, ...] = ()  # mode/mtime fields that are no number (defaults stand in)


def round_up(n: int) -> int:
    return (n + BLOCK - 1) & ~(BLOCK - 1)


def _cstr(field: bytes) -> bytes:
    i = field.find(b"\0")
    return field if i < 0 else field[:i]


def parse_number(field: bytes) -> int:
    """Octal (NUL/space padded) or GNU base-256 (first byte 0x80, or 0xFF for a negative number).

    Another first byte with its high bit set is no number for GNU tar or Python's tarfile
    (its low bits would be part of the value: they refuse to guess, and so do we)."""
    if field[0] & 0x80:
        if field[0] == 0x80:
            return int.from_bytes(field[1:], "big")
        if field[0] == 0xFF:  # negative: two's complement over the whole field
            return int.from_bytes(field, "big") - (1 << (8 * len(field)))
        raise TarHeaderError(f"invalid base-256 number {field!r}")
    text = field.split(b"\0", 1)[0].strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise TarHeaderError(f"invalid octal number {field!r}") from None


def checksum_ok(block: bytes) -> bool:
    """The header checksum, unsigned as POSIX says or signed as some old tars computed it."""
    try:
        stored = parse_number(block[148:156])
    except TarHeaderError:
        return False
    unsigned = sum(block) - sum(block[148:156]) + 8 * 32
    if stored == unsigned:
        return True
    high = sum(1 for b in block if b >= 128) - sum(1 for b in block[148:156] if b >= 128)
    return stored == unsigned - 256 * high  # bytes >= 128 counted as negative


def looks_like_tar(head: bytes) -> bool:
    """Sniffing: a first block with a valid checksum (and a ustar magic, or a sane v7 name)."""
    if len(head) < BLOCK:
        return False
    block = head[:BLOCK]
    if block == ZERO_BLOCK or not checksum_ok(block):
        return False
    return block[257:262] == b"ustar" or bool(_cstr(block[:100]))


def looks_like_empty_tar(head: bytes) -> bool:
    """The two zero blocks of an empty archive (``tar cf empty.tar -T /dev/null``). Sniffed last:
    a ZIP behind a run of zero bytes starts the same way."""
    return len(head) >= 2 * BLOCK and head[: 2 * BLOCK] == ZERO_BLOCK * 2


def parse_header(block: bytes) -> RawHeader:
    """Decode one non-zero header block; raises TarHeaderError."""
    if not checksum_ok(block):
        raise TarHeaderError("bad tar header checksum")
    typeflag = block[156:157]
    name = _cstr(block[0:100])
    magic = block[257:263]
    sparse_ext = False
    if magic == b"ustar\x00":  # POSIX: a prefix extends the name
        prefix = _cstr(block[345:500])
        if prefix:
            name = prefix + b"/" + name
    elif magic == b"ustar " and typeflag == GNU_SPARSE:  # old GNU: the prefix area holds sparse data
        sparse_ext = bool(block[482])
    # Only the size is vital (it says where the next header is): a mode or mtime that is no number
    # gets a default and a warning, as GNU tar gives them, rather than losing the whole archive.
    unreadable = []
    try:
        mode = parse_number(block[100:108])
    except TarHeaderError:
        mode = 0o755 if typeflag == DIRTYPE or name.endswith(b"/") else 0o644
        unreadable.append("mode")
    try:
        mtime = parse_number(block[136:148])
    except TarHeaderError:
        mtime = 0
        unreadable.append("mtime")
    return RawHeader(
        name=name,
        mode=mode,
        size=parse_number(block[124:136]),
        mtime=mtime,
        typeflag=typeflag,
        linkname=_cstr(block[157:257]),
        old_gnu_sparse_extended=sparse_ext,
        unreadable=tuple(unreadable),
    )


def parse_pax(data: bytes, problems: list[str] | None = None) -> dict[str, bytes]:
    """Records ``"<len> <key>=<value>\\n"`` of a pax extended header; values stay bytes.

    A malformed record raises TarHeaderError; with ``problems``, it is described there instead
    and the records before it are returned (no record after it can be found for sure: GNU tar
    and bsdtar also warn and go on with the member's own header).
    """
    out: dict[str, bytes] = {}
    pairs: list[bytes] = []
    pos = 0
    end = len(data)

    def malformed(why: str) -> None:
        if problems is None:
            raise TarHeaderError(why)
        problems.append(f"{why} at byte {pos} of {end}")

    while pos < end:
        if data[pos] == 0:  # NUL padding after the last record
            break
        sp = data.find(b" ", pos, pos + 24)
        if sp < 0:
            malformed("malformed pax record (no length)")
            break
        digits = data[pos:sp]
        if not digits.isdigit():
            malformed("malformed pax record length")
            break
        length = int(digits)
        rec_end = pos + length
        if length <= sp - pos + 1 or rec_end > end or data[rec_end - 1] != 0x0A:
            malformed("malformed pax record")
            break
        eq = data.find(b"=", sp + 1, rec_end)
        if eq < 0:
            malformed("malformed pax record (no '=')")
            break
        key = data[sp + 1 : eq].decode("utf-8", "surrogateescape")
        value = data[eq + 1 : rec_end - 1]
        if key in _SPARSE_00_KEYS:  # GNU sparse 0.0 repeats these: the pairs, in order, as 0.1's map
            pairs.append(value)
        else:
            out[key] = value
        pos = rec_end
    if pairs and "GNU.sparse.map" not in out:
        out["GNU.sparse.map"] = b",".join(pairs)
    return out


_SPARSE_00_KEYS = ("GNU.sparse.offset", "GNU.sparse.numbytes")


def old_gnu_sparse_entries(block: bytes, start: int, count: int) -> list[int]:
    """(offset, numbytes) pairs of an old GNU sparse header or extension block, flat; empty slots
    (all zero) dropped."""
    out: list[int] = []
    for i in range(count):
        at = start + 24 * i
        offset, numbytes = parse_number(block[at : at + 12]), parse_number(block[at + 12 : at + 24])
        if offset or numbytes:
            out += (offset, numbytes)
    return out


def decode_name(raw: bytes) -> str:
    """Names are bytes in tar; UTF-8 with surrogate escapes round-trips any of them to the mount."""
    return raw.decode("utf-8", "surrogateescape")


# -- building -------------------------------------------------------------------
def _octal(value: int, width: int) -> bytes:
    """``width - 1`` octal digits and a NUL."""
    return b"%0*o\0" % (width - 1, value)


def _fits_octal(value: int, width: int) -> bool:
    return 0 <= value < 8 ** (width - 1)


def _split_ustar_name(name: bytes) -> tuple[bytes, bytes] | None:
    """(prefix, name) fitting the 155 + 100 byte ustar fields, or None."""
    if len(name) <= 100:
        return b"", name
    if len(name) > 256:
        return None
    i = name.rfind(b"/", 0, 156)
    while i > 0:
        if len(name) - i - 1 <= 100:
            return name[:i], name[i + 1 :]
        i = name.rfind(b"/", 0, i)
    return None


def pax_record(key: str, value: bytes) -> bytes:
    """One ``"<len> key=value\\n"`` record; the length counts its own digits."""
    body = b" " + key.encode() + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode() + body


def build_block(
    name: bytes,
    mode: int,
    uid: int,
    gid: int,
    size: int,
    mtime: int,
    typeflag: bytes,
    linkname: bytes = b"",
    prefix: bytes = b"",
) -> bytes:
    """One POSIX ustar header block (values must already fit their fields)."""
    block = bytearray(BLOCK)
    block[0 : len(name)] = name
    block[100:108] = _octal(mode, 8)
    block[108:116] = _octal(uid, 8)
    block[116:124] = _octal(gid, 8)
    block[124:136] = _octal(size, 12)
    block[136:148] = _octal(mtime, 12)
    block[148:156] = b" " * 8
    block[156:157] = typeflag
    block[157 : 157 + len(linkname)] = linkname
    block[257:265] = b"ustar\x0000"
    block[329:337] = _octal(0, 8)
    block[337:345] = _octal(0, 8)
    block[345 : 345 + len(prefix)] = prefix
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def build_header(
    name: str,
    typeflag: bytes,
    size: int = 0,
    mode: int = 0o644,
    mtime: int = 0,
    uid: int = 0,
    gid: int = 0,
    linkname: str = "",
) -> bytes:
    """Header block(s) for one member: plain ustar when it fits, else a pax header first.

    pax records are used for non-ASCII or over-long names and link targets,
    sizes of 8 GiB and more, mtimes before 1970 or after 2242, and large ids.
    mtimes are whole seconds (like GNU tar's default formats).
    """
    raw_name = name.encode("utf-8", "surrogateescape")
    raw_link = linkname.encode("utf-8", "surrogateescape")
    records: list[bytes] = []
    split = _split_ustar_name(raw_name) if raw_name.isascii() else None
    if split is None:
        records.append(pax_record("path", raw_name))
        prefix, short = b"", _ascii_stub(raw_name, 100)
    else:
        prefix, short = split
    if raw_link and (len(raw_link) > 100 or not raw_link.isascii()):
        records.append(pax_record("linkpath", raw_link))
        raw_link = _ascii_stub(raw_link, 100)
    if not _fits_octal(size, 12):
        records.append(pax_record("size", str(size).encode()))
    if not _fits_octal(mtime, 12):
        records.append(pax_record("mtime", str(mtime).encode()))
    ids = []
    for key, value in (("uid", uid), ("gid", gid)):
        if not _fits_octal(value, 8):
            records.append(pax_record(key, str(value).encode()))
            value = 0
        ids.append(value)
    block = build_block(
        short,
        mode & 0o7777,
        ids[0],
        ids[1],
        size if _fits_octal(size, 12) else 0,
        min(max(mtime, 0), MAX_OCTAL_11),
        typeflag,
        raw_link,
        prefix,
    )
    if not records:
        return block
    body = b"".join(records)
    pax_name = _ascii_stub(b"PaxHeaders/" + raw_name.rpartition(b"/")[2], 100)
    pax = build_block(pax_name, 0o644, 0, 0, len(body), min(max(mtime, 0), MAX_OCTAL_11), PAX_LOCAL)
    return pax + body + bytes(round_up(len(body)) - len(body)) + block


def _ascii_stub(raw: bytes, width: int) -> bytes:
    """A readable ASCII stand-in for a field whose real value is in a pax record (old tars show it)."""
    stub = raw.decode("ascii", "replace").encode("ascii", "replace").replace(b"\0", b"_")
    return stub[-width:] if len(stub) > width else stub
