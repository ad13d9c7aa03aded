"""ZIP: our own central-directory parser (APPNOTE 6.3.x) producing an :class:`~cdmlfs.index.Index`.

Why not ``zipfile``: it builds a ZipInfo object per member (hundreds of bytes
each, slow for 200k entries) and reads through a seekable file object, which
neither bounds memory nor suits a shared positioned-read source.

Handled: ZIP64 (sizes, offsets, entry counts), data descriptors (the central
directory carries the true sizes, so they need nothing), the UTF-8 flag,
cp437 names, the Info-ZIP unicode path extra field (0x7075), the extended
timestamp (0x5455), unix modes and symlinks from external attributes, explicit
and implied directories, prefixed archives (self-extracting stubs) and trailing
comments. Encrypted members are indexed and refuse to read with EACCES.
"""

from __future__ import annotations

import logging
import stat as statmod
import struct
import time
import zlib
from array import array
from collections.abc import Callable

from cdmlfs import extensions
from cdmlfs.errors import ArchiveFormatError, CorruptMemberError
from cdmlfs.index import (
    DIR,
    ENCRYPTED,
    FILE,
    INCONSISTENT,
    MAX_MTIME,
    NEEDS_LOCAL_HEADER,
    STORED,
    SYMLINK,
    Index,
    IndexBuilder,
)
from cdmlfs.sources.base import Source

log = logging.getLogger(__name__)


def _load_plain_run() -> tuple[Callable | None, str]:
    """``cdmlfs._zipdir.plain_run`` (the C parse of plain records) or None, and why, for ``doctor``:
    off when not built, with ``CDMLFS_ZIPDIR=0`` (tests compare both parsers), or when the index
    columns have other item sizes than the C writes."""
    usable, why = extensions.availability(
        "cdmlfs._zipdir", "CDMLFS_ZIPDIR", None, "C for plain records (cdmlfs._zipdir), Python for the rest"
    )
    if not usable:
        return None, f"Python ({why})"
    if {code: array(code).itemsize for code in "HdQqI"} != {"H": 2, "d": 8, "Q": 8, "q": 8, "I": 4}:
        return None, "Python (index columns of other item sizes than cdmlfs._zipdir writes)"
    from cdmlfs._zipdir import plain_run

    return plain_run, why


PLAIN_RUN, _PARSER = _load_plain_run()


def parser_backend() -> str:
    """What parses central directories, for ``cdmlfs doctor``."""
    return _PARSER


EOCD = struct.Struct("<IHHHHIIH")  # end of central directory record (22 bytes)
EOCD_SIG = 0x06054B50
Z64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
Z64_LOCATOR_SIG = 0x07064B50
Z64_EOCD = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
Z64_EOCD_SIG = 0x06064B50
CDH = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header (46 bytes)
CDH_SIG = 0x02014B50
LFH = struct.Struct("<IHHHHHIIIHH")  # local file header (30 bytes)
LFH_SIG = 0x04034B50

EXTRA_ZIP64 = 0x0001
EXTRA_EXT_TIMESTAMP = 0x5455
EXTRA_UNICODE_PATH = 0x7075
EXTRA_NTFS = 0x000A  # Windows FILETIMEs (7-Zip, WinZip)
METHOD_AES = 99
UNIX_SYSTEMS = (3, 19)  # made by Unix / OS X: names are the tool's own bytes
# As unzip (unix/unix.c, mapattr): the systems whose external attributes' high word is st_mode,
# and those whose S_IFLNK entries become symlinks (FAT: when the bits agree with the DOS ones).
UNIX_MODE_SYSTEMS = frozenset((2, 3, 5, 12, 13, 16, 17, 30))  # VMS, Unix, Atari, QDOS, Acorn, BeOS, ...
SYMLINK_SYSTEMS = frozenset((0, 2, 3, 5, 16, 30))
FLAG_ENCRYPTED = 0x1
FLAG_STRONG_ENCRYPTION = 0x40
FLAG_DATA_DESCRIPTOR = 0x8
FLAG_UTF8 = 0x800
DD_SIG = b"PK\x07\x08"
# Records that may follow a member's data when its writer set bit 3 but wrote no descriptor.
NEXT_RECORDS = (b"PK\x03\x04", b"PK\x01\x02", b"PK\x06\x06", b"PK\x05\x06", b"PK\x06\x07")

MAX_COMMENT = 0xFFFF
MAX_SIZE = (1 << 63) - 1  # largest off_t; ZIP64 sizes and offsets are unsigned 64-bit
CHUNK = 8 << 20  # central directory is parsed in windows of this size: bounded transient memory


def descriptor_agrees(tail: bytes, crc: int) -> bool:
    """Whether the bytes after a bit-3 member's data (up to 8) give its CRC-32: a data descriptor
    with or without its signature, or no descriptor at all (the next record starts there)."""
    want = crc.to_bytes(4, "little")
    return tail[:4] == want or (tail[:4] == DD_SIG and tail[4:8] == want) or tail[:4] in NEXT_RECORDS


def is_zip(head: bytes, tail: bytes) -> bool:
    """Cheap format sniffing: an EOCD signature near the end (a prefix may hide the local header)."""
    return head[:4] == b"PK\x03\x04" or b"PK\x05\x06" in tail


class ZipFormat:
    """A ZIP archive opened on a source: the index plus where each member's data starts."""

    name = "zip"

    def __init__(self, source: Source, progress: Callable[[int, int], None] | None = None) -> None:
        self.source = source
        self.prefix = 0
        self.index: Index = self._parse(progress)
        # Data offsets read from local headers on first use (0: not yet). The index's own columns
        # never change after the parse: with the header offset overwritten in place, a thread that
        # had seen "needs its local header" could take the data offset for a header (a spurious
        # EIO), and the C hot path, sharing these arrays, reads them without the GIL.
        self.data_at = array("q", bytes(8 * self.index.entry_count))

    # -- mount time ---------------------------------------------------------
    def _find_eocd(self) -> tuple[int, tuple]:
        size = self.source.size
        if size < EOCD.size:
            raise ArchiveFormatError(f"not a ZIP archive: {size} bytes is too short")
        tail_len = min(size, EOCD.size + MAX_COMMENT + Z64_LOCATOR.size)
        tail_start = size - tail_len
        tail = self.source.read_at(tail_start, tail_len)
        pos = len(tail) - EOCD.size
        last: tuple[int, tuple] | None = None  # the record nearest the end, whatever its comment length
        fits: tuple[int, tuple] | None = None  # the one nearest the end whose comment fits
        while True:
            pos = tail.rfind(b"PK\x05\x06", 0, pos + 4)
            if pos < 0:
                break
            rec = EOCD.unpack_from(tail, pos)
            end = pos + EOCD.size + rec[7]  # rec[7]: its comment's length
            if end == len(tail):  # its comment ends the file: the record (a signature inside that
                return tail_start + pos, rec  # comment, nearer the end, would leave bytes after its own)
            if end < len(tail) and fits is None:  # junk after the comment: some tools append it
                fits = (tail_start + pos, rec)
            if last is None:
                last = (tail_start + pos, rec)
            pos -= 1
        if fits is not None:
            return fits
        if last is None:
            if self.source.read_at(0, 4) == b"PK\x03\x04":  # it starts as a ZIP: the end is missing
                raise ArchiveFormatError(
                    "a ZIP archive cut short: no end-of-central-directory record "
                    "(an incomplete download or copy?)"
                )
            raise ArchiveFormatError("not a ZIP archive (no end-of-central-directory record)")
        # A comment cut short (a truncated download of the comment only): zipfile and unzip read
        # such archives; the central directory checks that follow still validate the record.
        return last

    def _parse(self, progress: Callable[[int, int], None] | None) -> Index:
        source = self.source
        eocd_pos, rec = self._find_eocd()
        _, disk, cd_disk, _, n_total, cd_size, cd_offset, _ = rec
        cd_end_pos = eocd_pos  # where the central directory ends in the file
        z64_needed = n_total == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF
        if eocd_pos >= Z64_LOCATOR.size:
            loc = Z64_LOCATOR.unpack(source.read_at(eocd_pos - Z64_LOCATOR.size, Z64_LOCATOR.size))
            if loc[0] == Z64_LOCATOR_SIG:
                if loc[3] > 1:
                    disk = loc[3] - 1
                n_total, cd_size, cd_offset, cd_end_pos = self._read_zip64_eocd(eocd_pos, loc[2])
            elif z64_needed and cd_offset == 0xFFFFFFFF:
                raise ArchiveFormatError("corrupt ZIP: ZIP64 values without a ZIP64 locator")
        # The last part of a split archive (zip -s) holds the directory, the members are in the
        # others: every read would fail. unzip refuses it the same way.
        if disk not in (0, 0xFFFF) or cd_disk not in (0, 0xFFFF):
            raise ArchiveFormatError(
                f"the last part (disk {disk + 1}) of a split ZIP archive; join the parts into one "
                "file first (zip -s 0 SPLIT.zip --out JOINED.zip)"
            )
        cd_start = cd_end_pos - cd_size
        mtime = getattr(source, "mtime", 0.0)
        try:
            if cd_start < 0:
                raise ArchiveFormatError("corrupt ZIP: central directory size exceeds the file")
            # A stub before the archive (self-extractor) shifts every recorded offset alike.
            self.prefix = cd_start - cd_offset
            if self.prefix < 0:
                raise ArchiveFormatError("corrupt ZIP: central directory offset is past its real position")
            builder, found = self._read_directory(cd_start, cd_size, n_total, mtime, progress)
        except ArchiveFormatError:
            # The end record's directory size may be the wrong one of its two numbers: where its
            # offset says, with no stub, the directory may start (unzip reads such archives, with
            # a warning that bytes are missing or extra).
            if not 0 <= cd_offset < cd_end_pos or cd_offset == cd_start:
                raise
            if source.read_at(cd_offset, 4) != b"PK\x01\x02":
                raise
            log.warning(
                "the ZIP end record says the central directory takes %d bytes, but one starts at its "
                "recorded offset, %d bytes before the record: read from there",
                cd_size,
                cd_end_pos - cd_offset,
            )
            self.prefix = 0
            builder, found = self._read_directory(cd_offset, cd_end_pos - cd_offset, n_total, mtime, progress)
        if found != n_total and n_total not in (0xFFFF, 0xFFFFFFFF):
            log.warning("the ZIP central directory holds %d entries, its end record says %d", found, n_total)
        index = builder.finish()
        # Records that parsed but whose names the path rules drop ("./", "../") leave an empty tree,
        # as unzip shows it: only a count with no record behind it is corrupt.
        if found == 0 and n_total:
            raise ArchiveFormatError("corrupt ZIP: central directory has no readable entries")
        return index

    def _read_directory(
        self, cd_start: int, cd_size: int, n_total: int, mtime: float, progress
    ) -> tuple[IndexBuilder, int]:
        """The central directory's records in a fresh builder, and how many were found."""
        # Every record takes at least 46 bytes: a count beyond that is a lie the parse will tell.
        _check_index_fits(max(min(n_total, cd_size // 46), cd_size // 256))
        builder = IndexBuilder(implied_dir_mtime=mtime)
        return builder, self._parse_central_directory(cd_start, cd_size, builder, progress)

    def _read_zip64_eocd(self, eocd_pos: int, recorded: int) -> tuple[int, int, int, int]:
        """Return (entries, cd_size, cd_offset, position where the central directory ends)."""
        # The ZIP64 record sits right before the locator; its recorded offset is off by the prefix.
        actual = eocd_pos - Z64_LOCATOR.size - Z64_EOCD.size
        for pos in (actual, recorded):
            if 0 <= pos <= self.source.size - Z64_EOCD.size:
                rec = Z64_EOCD.unpack(self.source.read_at(pos, Z64_EOCD.size))
                if rec[0] == Z64_EOCD_SIG:
                    # With an extensible data sector the record is longer; it then ends at the locator.
                    return rec[7], rec[8], rec[9], pos
        raise ArchiveFormatError("corrupt ZIP: ZIP64 end-of-central-directory record not found")

    def _parse_central_directory(
        self, cd_start: int, cd_size: int, builder: IndexBuilder, progress: Callable[[int, int], None] | None
    ) -> int:
        """Add every central directory record to ``builder``; returns how many there were."""
        prefix = self.prefix
        source_size = self.source.size
        unpack = CDH.unpack_from
        add = builder.add
        dos_cache: dict[int, float] = {}
        plain_run = PLAIN_RUN
        buf = b""
        buf_pos = cd_start  # file offset of buf[0]
        pos = 0  # offset inside buf
        done = 0  # bytes of the central directory consumed
        count = 0
        resume_at = misses = 0  # C is tried again from record resume_at (backs off while it takes none)
        while done < cd_size:
            if plain_run is not None and pos < len(buf) and count >= resume_at:
                # C adds the plain records that follow; the loop body below takes the next other one.
                room = 0x10000 - (count & 0xFFFF)  # stop where progress is reported
                n, stop = builder.add_plain_run(
                    plain_run, buf, pos, len(buf), room, prefix, source_size, dos_cache
                )
                if n:
                    misses = 0
                    done += stop - pos
                    pos = stop
                    count += n
                    if progress is not None and not count & 0xFFFF:
                        progress(done, cd_size)
                    continue
                # An archive of records C leaves to Python (Windows names, cp437, one directory per
                # file) must not pay for a C call per record: wait 1, 2, 4, ... 1024 records.
                resume_at = count + (1 << min(misses, 10))
                misses += 1
            if pos + 46 > len(buf):
                buf, buf_pos, pos = self._refill(buf, buf_pos, pos, cd_start, cd_size, 46)
            (sig, made_by, _, flags, method, dtime, ddate, crc, csize, usize, nlen, xlen, clen, _, _, eattr,
             loff) = unpack(buf, pos)  # fmt: skip
            if sig != CDH_SIG:
                raise ArchiveFormatError(
                    f"corrupt ZIP: bad central directory entry #{count + 1} at offset {buf_pos + pos}"
                )
            rec_len = 46 + nlen + xlen + clen
            if pos + rec_len > len(buf):
                buf, buf_pos, pos = self._refill(buf, buf_pos, pos, cd_start, cd_size, rec_len)
            name_b = buf[pos + 46 : pos + 46 + nlen]
            if flags & FLAG_UTF8:
                name = name_b.decode("utf-8", "surrogateescape")
            elif name_b.isascii():
                name = name_b.decode("ascii")
            else:
                name = _decode_legacy_name(name_b, made_by >> 8)
            mtime = None
            problem = None
            xs = pos + 46 + nlen
            extra = buf[xs : xs + xlen] if xlen else b""
            if usize == 0xFFFFFFFF or csize == 0xFFFFFFFF or loff == 0xFFFFFFFF:
                try:
                    usize, csize, loff = _zip64_values(extra, usize, csize, loff)
                except ValueError as exc:  # this member cannot be read; the others can
                    problem = str(exc)
                    usize = csize = 0
                    loff = source_size
            if xlen:
                mtime, upath = _time_and_unicode_path(extra, name_b, (ddate << 16) | dtime)
                if upath is not None and not flags & FLAG_UTF8:
                    name = upath
            if mtime is None:
                dos = (ddate << 16) | dtime
                mtime = dos_cache.get(dos)
                if mtime is None:
                    mtime = dos_cache[dos] = _dos_to_epoch(ddate, dtime)
            # Kind and permissions from the external attributes.
            system = made_by >> 8
            st_mode = _unix_mode(eattr, system, name)
            if st_mode is not None:  # as the tool saw it (a mode of 000 included, as unzip keeps it)
                ftype = st_mode & 0o170000
                kind = (
                    DIR if ftype == statmod.S_IFDIR
                    else SYMLINK if ftype == statmod.S_IFLNK and system in SYMLINK_SYSTEMS
                    else FILE
                )  # fmt: skip
                mode = st_mode & 0o777
            else:
                kind = DIR if eattr & 0x10 or name.endswith("/") else FILE
                mode = _dos_mode(eattr, kind == DIR)
            if name.endswith("/"):
                kind = DIR
            elif kind == DIR and (usize or csize):
                # A directory by its attributes alone, with data: unzip and zipfile go by the
                # name (no slash: a file) and extract the data, which a directory would hide.
                # The mode stays the attributes' (unzip gives such a file a directory's x bits).
                kind = FILE
            eflags = NEEDS_LOCAL_HEADER
            if flags & (FLAG_ENCRYPTED | FLAG_STRONG_ENCRYPTION) or method == METHOD_AES:
                eflags |= ENCRYPTED
            elif usize == 0 and kind == FILE and (crc != 0 or (method == STORED and csize != 0)):
                eflags |= INCONSISTENT  # CRC-32 of no bytes is 0; stored data has its own size
            elif method == STORED and kind == FILE and csize != usize and problem is None:
                problem = f"stored, but its record gives {csize} bytes of data for a file of {usize} bytes"
            if kind == DIR:  # a directory has no data to be wrong about: its sizes are moot
                problem = None
            offset = loff + prefix
            if offset >= source_size:
                offset = -1  # outside the archive (ZIP64 allows 2**64-1): EIO when read, not a failed mount
            if usize > MAX_SIZE or csize > MAX_SIZE:  # beyond off_t: stat would wrap to a negative size
                usize = min(usize, MAX_SIZE)
                csize = min(csize, MAX_SIZE)
            eid = add(name, kind, mode, mtime, usize, method, offset, csize, crc, eflags)
            if problem is not None and eid is not None:
                builder.mark_inconsistent(eid, problem)
            pos += rec_len
            done += rec_len
            count += 1
            if progress is not None and not count & 0xFFFF:
                progress(done, cd_size)
        if progress is not None:
            progress(cd_size, cd_size)
        return count

    def _refill(
        self, buf: bytes, buf_pos: int, pos: int, cd_start: int, cd_size: int, need: int
    ) -> tuple[bytes, int, int]:
        """Slide the parse window: keep the unparsed tail, read the next chunk."""
        new_pos = buf_pos + pos
        cd_end = cd_start + cd_size
        length = min(max(CHUNK, need), cd_end - new_pos)
        if length < need:
            raise ArchiveFormatError("corrupt ZIP: central directory entry runs past the directory's end")
        return self.source.read_at(new_pos, length), new_pos, 0

    # -- read time -----------------------------------------------------------
    def data_offset(self, eid: int) -> int:
        """Where member ``eid``'s data starts, read from its local header on first use."""
        index = self.index
        if not index.flags[eid] & NEEDS_LOCAL_HEADER:
            return index.offset[eid]
        known = self.data_at[eid]
        if known:
            return known
        header_at = index.offset[eid]
        size = self.source.size
        if header_at < 0 or header_at + LFH.size > size:
            raise CorruptMemberError("local header offset points outside the archive")
        rec = LFH.unpack(self.source.read_at(header_at, LFH.size))
        if rec[0] != LFH_SIG:
            raise CorruptMemberError(f"bad local header signature at offset {header_at}")
        data_at = header_at + LFH.size + rec[9] + rec[10]
        if data_at + index.comp_size[eid] > size:
            raise CorruptMemberError("member data extends past the end of the archive")
        self._check_local_header(eid, rec, data_at)
        self.data_at[eid] = data_at  # one aligned 8-byte store: racing resolvers write the same value
        return data_at

    def _check_local_header(self, eid: int, rec: tuple, data_at: int) -> None:
        """Refuse a local header that belongs to another member (a damaged central directory).

        Large stored members are served before their CRC can be checked (that needs every
        byte), so an offset pointing at another member's header would serve its bytes. The
        header's method must be ours, and its CRC-32 too: in the header, or with bit 3 set
        (written while streaming) in the data descriptor after the data. Headers that give
        no CRC at all (zeros, bit 3 clear) and descriptors that were never written (the next
        record follows the data) are let through, as unzip and zipfile read them.
        native/fastpath.c (resolve_local_header) makes the same checks.
        """
        index = self.index
        method, crc = index.method[eid], index.crc[eid]
        if rec[3] != method:
            raise CorruptMemberError(
                f"its local header gives compression method {rec[3]}, the central directory {method}"
            )
        if not rec[2] & FLAG_DATA_DESCRIPTOR:
            if rec[6] != crc and (rec[6], rec[7], rec[8]) != (0, 0, 0):
                raise CorruptMemberError(
                    f"its local header gives CRC-32 {rec[6]:08x}, the central directory {crc:08x}"
                )
            return
        end = data_at + index.comp_size[eid]
        tail = self.source.read_at(end, min(8, self.source.size - end))
        if not descriptor_agrees(tail, crc):
            raise CorruptMemberError(
                f"the data descriptor at offset {end} does not give the central directory's CRC-32 {crc:08x}"
            )


INDEX_BYTES_PER_ENTRY = 250  # measured: ~240 B per entry for typical dataset paths


def _check_index_fits(entries: int) -> None:
    """Refuse, with numbers, an index that cannot fit in memory instead of being OOM-killed mid-scan."""
    need = entries * INDEX_BYTES_PER_ENTRY
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    if need > avail:
        raise ArchiveFormatError(
            f"{entries:,} entries need about {need / 2**30:.1f} GiB of index memory, "
            f"but only {avail / 2**30:.1f} GiB is available"
        )


def _decode_legacy_name(raw: bytes, system: int) -> str:
    """Name without the UTF-8 flag: cp437 by the spec, but Unix tools write their own bytes.

    We follow Info-ZIP unzip on Linux: a Unix-made entry's name is the bytes the tool found
    on disk (UTF-8 mostly; other bytes kept as they are, as for tar names); names from
    other systems are cp437.
    """
    if system in UNIX_SYSTEMS:
        return raw.decode("utf-8", "surrogateescape")
    return raw.decode("cp437")


def _unix_mode(eattr: int, system: int, name: str) -> int | None:
    """The st_mode in the external attributes' high word, when unzip would take it (else None).

    Unix-like systems store it there. An entry made on FAT may carry one too (PKZip for Unix,
    Python's zipfile on Windows): taken when its owner bits agree with the DOS attributes
    (read-only: no owner write; directory: owner exec), as unzip checks.
    """
    mode_hi = eattr >> 16
    if not mode_hi:
        return None
    if system in UNIX_MODE_SYSTEMS:
        return mode_hi
    if system == 0:
        is_dir = bool(eattr & 0x10) or name.endswith("/")
        owner = 0o400 | (0 if eattr & 0x01 else 0o200) | (0o100 if is_dir else 0)
        if mode_hi & 0o700 == owner:
            return mode_hi
    return None


def _dos_mode(eattr: int, is_dir: bool) -> int:
    """Permissions from MS-DOS attributes, as unzip gives them with the usual umask 022: the
    read-only attribute takes the write bits away."""
    return 0o444 | (0 if eattr & 0x01 else 0o200) | (0o111 if is_dir else 0)


def _iter_extra(extra: bytes):
    pos = 0
    end = len(extra)
    while pos + 4 <= end:
        hid, hlen = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + hlen]
        yield hid, body
        pos += 4 + hlen


def _zip64_values(extra: bytes, usize: int, csize: int, loff: int) -> tuple[int, int, int]:
    """The 64-bit values the central record defers to its ZIP64 extra field (ValueError: absent)."""
    for hid, body in _iter_extra(extra):
        if hid != EXTRA_ZIP64:
            continue
        pos = 0
        try:
            if usize == 0xFFFFFFFF:
                (usize,) = struct.unpack_from("<Q", body, pos)
                pos += 8
            if csize == 0xFFFFFFFF:
                (csize,) = struct.unpack_from("<Q", body, pos)
                pos += 8
            if loff == 0xFFFFFFFF:
                (loff,) = struct.unpack_from("<Q", body, pos)
        except struct.error:
            raise ValueError("its ZIP64 extra field is truncated") from None
        return usize, csize, loff
    raise ValueError("its record needs a ZIP64 extra field but has none")


DOS_MINIMUM = 0x00210000  # 1980-01-01 00:00, the DOS time zip writes for anything earlier
DOS_2038 = 0x74320000  # 2038-01-18 00:00


def ext_timestamp(value: int, dos: int) -> float | None:
    """An extended-timestamp (0x5455) mtime: 32 bits whose sign writers disagree on; None where
    the entry's DOS time (``date << 16 | time``) contradicts it, and that is used instead.

    As unzip: a value with its top bit set counts only where the DOS time agrees: past 2038
    (Info-ZIP writes later dates there, unsigned) or the 1980 minimum (a time before 1970, which
    zip clamps the DOS field to). Otherwise (say, 1903 beside a DOS date of 2000) the field is a
    writer's error and the DOS time stands. In that pre-1970 case Debian's unzip 6.0 writes the
    1980 minimum all the same; we give the time the field holds."""
    if value < 1 << 31 or dos >= DOS_2038:
        return float(value)
    if dos == DOS_MINIMUM:
        return float(value - (1 << 32))
    return None


def _time_and_unicode_path(extra: bytes, name_b: bytes, dos: int) -> tuple[float | None, str | None]:
    """The mtime from the extra fields (NTFS, 100 ns, as 7-Zip writes it, over the extended
    timestamp's whole seconds), and the Info-ZIP unicode path; None where they have none."""
    mtime = ntfs = None
    upath = None
    for hid, body in _iter_extra(extra):
        if hid == EXTRA_EXT_TIMESTAMP and len(body) >= 5 and body[0] & 1:
            (value,) = struct.unpack_from("<I", body, 1)
            mtime = ext_timestamp(value, dos)
        elif hid == EXTRA_NTFS:
            ntfs = _ntfs_mtime(body)
        elif hid == EXTRA_UNICODE_PATH and len(body) >= 5 and body[0] == 1:
            (ncrc,) = struct.unpack_from("<I", body, 1)
            if ncrc == zlib.crc32(name_b):  # stale if another tool renamed the entry
                upath = body[5:].decode("utf-8", "surrogateescape")
    return (ntfs if ntfs is not None else mtime), upath


def _ntfs_mtime(body: bytes) -> float | None:
    """Modification time of an NTFS extra field (0x000A): 4 reserved bytes, then tagged attributes;
    tag 1 holds mtime, atime, ctime as Windows FILETIMEs (100 ns since 1601-01-01 UTC)."""
    pos = 4
    while pos + 4 <= len(body):
        tag, size = struct.unpack_from("<HH", body, pos)
        pos += 4
        if tag == 1 and size >= 8 and pos + 8 <= len(body):
            (ft,) = struct.unpack_from("<Q", body, pos)
            t = (ft - 116_444_736_000_000_000) / 1e7  # integers first: exact to 0.2 µs
            # Zero, or garbage past the index's range (0xFF.. gave year 36812): absent, as unzip
            # takes it, so the extended timestamp or the DOS time decides.
            return t if ft and -MAX_MTIME <= t <= MAX_MTIME else None
        pos += size
    return None


def _dos_to_epoch(ddate: int, dtime: int) -> float:
    """DOS date/time is local time, as unzip interprets it."""
    year = ((ddate >> 9) & 0x7F) + 1980
    month = max(1, (ddate >> 5) & 0xF)
    day = max(1, ddate & 0x1F)
    hour = (dtime >> 11) & 0x1F
    minute = (dtime >> 5) & 0x3F
    sec = (dtime & 0x1F) * 2
    try:
        return time.mktime((year, month, day, hour, minute, sec, 0, 0, -1))
    except (OverflowError, ValueError):
        return 0.0
