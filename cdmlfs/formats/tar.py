"""tar and tar.zst archives: header scan, persisted member index, frame-level random access.

Opening, cheapest path first:

1. a ``cdmlfs pack`` archive carries its member table in a skippable frame
   listed in the seek table: two small reads, no decoding;
2. a member table persisted in the index directory for this exact source
   identity (location, size, mtime; ETag for S3) — see :mod:`cdmlfs.index_store`;
3. otherwise one streaming scan over the archive (frames are located from
   the seek table or by walking frame headers; frames without a content size
   are decoded once to learn it), whose result is persisted for next time.

Member data lives in the decoded stream (index method ``IN_STREAM``, offset =
data offset in the decoded tar). Reads go through
:class:`~cdmlfs.formats.zstdstream.ZstdStream` (one zstd frame per extent) or
:class:`~cdmlfs.formats.zstdstream.RawStream` (plain tar).

Rules for what the mount shows (documented in the README):

* regular files (``0``, ``\\0``, ``7`` contiguous, and unknown type flags,
  which POSIX says to extract as regular files), directories (``5``, GNU
  dumpdir ``D``), symlinks (``2``, targets known at index time) and hard
  links (``1``: same inode as their target, ``st_nlink`` counts them; a link
  to a member not seen before it, or to a non-file, is skipped with a warning);
* character/block devices and FIFOs (``3``, ``4``, ``6``) are **skipped**:
  they carry no data, and a read-only archive mount must not create device
  nodes; their count is logged once. Sparse files (old GNU ``S``, pax
  ``GNU.sparse.*`` formats 0.0, 0.1 and 1.0, as GNU tar and bsdtar write
  them) are regular files whose holes read as zeros; one whose map
  contradicts itself is skipped with a warning, as are multi-volume
  continuations (``M``); volume labels (``V``) are skipped silently;
* names: pax ``path`` > GNU ``L`` long name > ustar prefix/name; link targets:
  pax ``linkpath`` > GNU ``K`` > ustar linkname; size and mtime from pax when
  present. Global pax headers (``g``) apply to the members after them, except
  ``path``, ``linkpath`` and ``size``, which only make sense per member;
* owner ids are parsed but not shown: like ZIP members, files belong to the
  mounting user;
* duplicates follow the ZIP rule (:mod:`cdmlfs.index`): the last one wins, a
  directory wins over a file of the same path;
* an archive truncated inside a header ends the listing there (with a
  warning); a member whose data is cut off keeps its declared size and reads
  give EIO where its data ends (the bytes before are served, as ``tar -x``
  writes them before it fails); a corrupt header or a
  corrupt zstd frame met while scanning refuses the archive (nothing after it
  could be located reliably).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import struct
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from typing import TypeVar

from cdmlfs.errors import ArchiveFormatError
from cdmlfs.formats import tarheader as th
from cdmlfs.formats.tarmembers import HARDLINK, MemberTable, MemberTableError
from cdmlfs.formats.zstdstream import (
    MAX_WINDOW,
    FrameTable,
    RawScanView,
    RawStream,
    SeekTableMismatch,
    ZstdScanView,
    ZstdStream,
    check_empty_frames,
)
from cdmlfs.index import DIR, FILE, PATH_BYTES_BASE, PATH_BYTES_PER_ENTRY, SYMLINK, Index
from cdmlfs.index_store import IndexStore, decompress_bounded
from cdmlfs.pathrules import normalize
from cdmlfs.sources.base import Source
from cdmlfs.zstd_seekable import (
    SKIPPABLE_BASE,
    Frame,
    looks_like_zstd,
    parse_frame_header,
    read_seek_table,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

EMBEDDED_INDEX_NIBBLE = 0xC  # skippable magic 0x184D2A5C holds a packed archive's member table
EMBEDDED_INDEX_MAGIC = b"CDMLFS-MEMBERS\x00\x01"
MAX_META_MEMBER = 16 << 20  # longest pax / GNU long-name payload we accept
# Versions of the persisted member tables. tar/2, tar.zst/3: links, devices and fifos carry no data
# (a table built before could lack the members behind such a header that declared a size).
# tar/3, tar.zst/4: a hard link's data is skipped (pax linkdata; tables before stopped there).
STORE_KIND_TAR = "tar/3"
STORE_KIND_TAR_ZST = "tar.zst/4"  # 2: frame tables say whether their sizes came from a seek table
# Types whose size field is ignored: the next header follows at once. A full ``tar -x`` (GNU tar
# 1.34), bsdtar and Python's tarfile all read on there, so members behind a symlink, device or fifo
# header that declares a size are members (``tar -t``, or ``tar -x`` given names, skip the size
# instead: GNU tar does not agree with itself, and we go with what extracting the archive makes).
# A pax ``size`` record on such a header is ignored too, as GNU tar -x and tarfile do (bsdtar
# skips that size).
_NO_DATA_TYPES = frozenset((th.LNKTYPE, th.DIRTYPE, th.SYMTYPE, th.CHRTYPE, th.BLKTYPE, th.FIFOTYPE))
_META_TYPES = frozenset((th.PAX_LOCAL, th.SOLARIS_PAX, th.PAX_GLOBAL, th.GNU_LONGNAME, th.GNU_LONGLINK))
_PER_MEMBER_ONLY = frozenset(("path", "linkpath", "size"))
MAX_MEMBER_SIZE = 1 << 62  # base-256 fields can say more; no stream is that long
# Sparse maps compress to almost nothing: bounded per member and per archive, so that a tiny
# archive cannot make a huge index (about 40 bytes per segment once indexed).
MAX_SPARSE_SEGMENTS = 1 << 18  # data segments of one sparse file
MAX_SPARSE_TOTAL = 1 << 20  # ... and of all the sparse files of an archive
MAX_SPARSE_MAP_BYTES = 16 << 20  # a 1.0 map at the start of the data: 256k segments of 2 lines
MAX_SPARSE_LINE = 24  # a decimal 64-bit number and its newline
MAX_MTIME = float(1 << 40)  # ~36,000 years: beyond that (or NaN) the mtime is shown as 0


# -- sniffing ----------------------------------------------------------------------
def _is_tar_zst(head: bytes, tail: bytes) -> bool:
    return looks_like_zstd(head)


def _is_tar(head: bytes, tail: bytes) -> bool:
    return th.looks_like_tar(head)


def open_tar_zst(source: Source, progress=None, index_dir=None, window_max=MAX_WINDOW, **_) -> TarFormat:
    return TarFormat(source, compressed=True, progress=progress, index_dir=index_dir, window_max=window_max)


def open_tar(source: Source, progress=None, index_dir=None, **_) -> TarFormat:
    return TarFormat(source, compressed=False, progress=progress, index_dir=index_dir)


def _is_empty_tar(head: bytes, tail: bytes) -> bool:
    return th.looks_like_empty_tar(head)


SNIFFERS = [(_is_tar_zst, open_tar_zst), (_is_tar, open_tar)]
LAST_SNIFFERS = [(_is_empty_tar, open_tar)]  # after the ZIP tail check (see looks_like_empty_tar)


# -- the scan --------------------------------------------------------------------------
DAMAGED_ENDING = "has a corrupt header"  # how a member table's ending starts when one stopped it


class _ScanStats:
    def __init__(self) -> None:
        self.devices = 0
        self.sparse = 0  # sparse members skipped
        self.sparse_segments = 0  # data segments of the sparse members kept
        self.other = 0


def scan_tar(view, members: MemberTable) -> int:
    """Read every header of the tar stream behind ``view``; returns the offset where the tar ends.

    ``view.read(pos, n)`` returns up to ``n`` bytes of the decoded stream at
    ``pos`` (fewer only at its end); ``pos`` only moves forward.
    """
    records = TarRecords(view)
    append = members.append
    for kind, name, mode, mtime, size, offset, link, sparse in records:
        append(kind, name, mode, mtime, size, offset, link, sparse=sparse)
    if records.damaged is not None:
        pos, why = records.damaged
        members.ending = f"{DAMAGED_ENDING} at offset {pos} ({why}), where cdmlfs stops"
    elif records.cut is not None:
        members.ending = f"ends inside a header at offset {records.cut} (a truncated copy?)"
    elif records.lone_zero is not None:
        members.ending = (
            f"has a lone zero block at offset {records.lone_zero}, which ends it as it does for tar -x"
        )
    elif not records.marked:
        # Every tar writer ends with zero blocks: without them the copy was most likely cut between
        # members. Served like GNU tar serves it, but never silently.
        members.ending = "ends without its end-of-archive blocks (a truncated copy?)"
    return records.end


class TarRecords:
    """The members of a tar stream, one tuple each as its header is read: (kind, name, mode, mtime,
    size, offset, link, sparse), ``offset`` where its bytes start in the stream.

    Lazy, so that a reader of the stream itself (``cdmlfs pack`` from a pipe) can take a member's
    bytes before the next header is read: every reader of the tar format then shares one parser and
    one set of rules (names, types, pax, sparse maps, bad headers). ``end``: where the tar ended,
    once iterated to the end.
    """

    def __init__(self, view) -> None:
        self._view = view
        self.end = 0
        self.cut: int | None = None  # where the stream ended inside a header or extension record
        self.marked = False  # the tar ended with its end-of-archive (zero) block, not just the stream
        self.lone_zero: int | None = None  # a single zero block followed by more data ended it here
        self.damaged: tuple[int, str] | None = None  # (offset, why): a corrupt header ended it there

    def _stop_at_damage(self, pos: int, exc: th.TarHeaderError, listed: bool) -> None:
        """A corrupt header at ``pos``: the members before it are sound and listed, as after a
        cut (tar -x skips on to the next header it can read; we do not guess where that is).
        Refusing the whole archive lost a dataset to one damaged block; with nothing listed
        before it (only extension records), it is refused."""
        if not listed:
            raise ArchiveFormatError(f"corrupt tar header at offset {pos}: {exc}") from None
        self.damaged = (pos, str(exc))

    def __iter__(self) -> Iterator[tuple[int, str, int, float, int, int, str, array | None]]:
        view = self._view
        pos = 0
        pax: dict[str, bytes] = {}
        global_pax: dict[str, bytes] = {}
        long_name: bytes | None = None
        long_link: bytes | None = None
        stats = _ScanStats()
        read = view.read
        headers = name_bytes = 0
        listed = False  # a member was yielded (a corrupt header after one ends the listing there)
        while True:
            block = read(pos, th.BLOCK)
            if len(block) < th.BLOCK:
                if pos == 0:
                    raise ArchiveFormatError("not a tar archive (the stream is shorter than one header)")
                if block.strip(b"\0"):
                    self.cut = pos  # a header cut short (scan_tar warns; pack refuses)
                elif block:  # zeros where the end-of-archive blocks belong, cut short: as GNU tar, an end
                    self.marked = True
                break  # ended on a block boundary without the end-of-archive blocks: accepted like GNU tar
            if block == th.ZERO_BLOCK:
                nxt = read(pos + th.BLOCK, th.BLOCK)
                if nxt and nxt != th.ZERO_BLOCK[: len(nxt)]:
                    # GNU tar stops here too ("A lone zero block"); only tar -i would read on. scan_tar
                    # warns; pack of a file keeps what tar -x gives, with the warning; pack of a stream
                    # refuses (it cannot say so before its output is written: see tar_stream).
                    self.lone_zero = pos
                self.marked = True
                break  # end of archive: two zero blocks (or one and the end of the stream)
            try:
                h = th.parse_header(block)
            except th.TarHeaderError as exc:
                if pos == 0:
                    raise ArchiveFormatError(f"not a tar archive ({exc})") from None
                self._stop_at_damage(pos, exc, listed)
                break
            typeflag = h.typeflag
            if not 0 <= h.size <= MAX_MEMBER_SIZE:
                # base-256 sizes can be negative or above 2**64: a negative one moved the scan backwards
                # (an endless loop for types that store no member), a huge one overflowed the size column.
                raise ArchiveFormatError(f"tar header at offset {pos} declares an impossible size ({h.size})")
            header_end = pos + th.BLOCK
            old_sparse: list[int] | None = None
            try:
                if typeflag == th.GNU_SPARSE:
                    old_sparse = th.old_gnu_sparse_entries(block, 386, 4)
                if h.old_gnu_sparse_extended:  # old GNU sparse maps continue in extra header blocks
                    while True:
                        ext = read(header_end, th.BLOCK)
                        header_end += th.BLOCK
                        if len(ext) < th.BLOCK:
                            break
                        if old_sparse is not None and len(old_sparse) <= 2 * MAX_SPARSE_SEGMENTS:
                            old_sparse += th.old_gnu_sparse_entries(ext, 0, 21)
                        if not ext[504]:
                            break
            except th.TarHeaderError as exc:  # a sparse map field that is no number
                self._stop_at_damage(pos, exc, listed)
                break
            if typeflag in _META_TYPES:
                if h.size > MAX_META_MEMBER:
                    raise ArchiveFormatError(f"tar extension header at offset {pos} is {h.size} bytes long")
                data = read(header_end, h.size)
                if len(data) < h.size:
                    self.cut = pos
                    break
                problems: list[str] = []
                if typeflag == th.GNU_LONGNAME:
                    long_name = th._cstr(data)
                elif typeflag == th.GNU_LONGLINK:
                    long_link = th._cstr(data)
                elif typeflag == th.PAX_GLOBAL:
                    for key, value in th.parse_pax(data, problems).items():
                        if key in _PER_MEMBER_ONLY:
                            continue
                        if value:
                            global_pax[key] = value
                        else:
                            global_pax.pop(key, None)
                else:
                    pax.update(th.parse_pax(data, problems))
                for problem in problems:
                    log.warning("pax header at offset %d: %s; the records after it are ignored", pos, problem)
                pos = header_end + th.round_up(h.size)
                continue
            attrs = {**global_pax, **pax} if global_pax else pax
            size = h.size
            mtime: float = h.mtime
            if h.unreadable:
                log.warning(
                    "tar header at offset %d: its %s field is no number; using a default",
                    pos,
                    " and ".join(h.unreadable),
                )
            if attrs:
                size, mtime = _pax_numbers(attrs, size, mtime, pos)
            if not 0 <= size <= MAX_MEMBER_SIZE:
                raise ArchiveFormatError(f"tar header at offset {pos} gives an impossible size ({size})")
            if not -MAX_MTIME <= mtime <= MAX_MTIME:  # also catches NaN: a timestamp must fit a stat field
                mtime = 0.0
            raw_name = attrs.get("path") or long_name or h.name
            raw_link = attrs.get("linkpath") or long_link or h.linkname
            # Names are held until the index is built (and normalised); compressed, 8 MiB pax paths
            # cost nothing on disk: 48 of them in 18 KB of .tar.zst made opening take 1.2 GB.
            headers += 1
            name_bytes += len(raw_name) + len(raw_link)
            if name_bytes > PATH_BYTES_BASE + PATH_BYTES_PER_ENTRY * headers:
                raise ArchiveFormatError(
                    f"the member names of this tar add up to more than {name_bytes >> 20} MiB by the "
                    f"header at offset {pos} ({headers:,} members so far): not a dataset's names"
                )
            name = th.decode_name(raw_name)
            has_data = typeflag not in _NO_DATA_TYPES
            if typeflag == th.LNKTYPE and size > 0 and _link_data_follows(read(header_end, th.BLOCK)):
                has_data = True  # said, as it could also be a damaged header hiding behind the link
                log.warning("hard link %r carries %d bytes of data (pax linkdata): skipped over", name, size)
            data_off = header_end
            pos = header_end + (th.round_up(size) if has_data else 0)
            pax = {}
            long_name = long_link = None
            if old_sparse is not None or (
                typeflag in (th.REGTYPE, th.AREGTYPE, th.CONTTYPE)
                and any(k.startswith("GNU.sparse.") for k in attrs)
            ):
                sparse_name = attrs.get("GNU.sparse.name")
                if sparse_name:  # formats 0.1 and 1.0 keep the real name here ("./GNUSparseFile.123/x")
                    name = th.decode_name(sparse_name)
                try:
                    real, segments, skip = _sparse_layout(old_sparse, attrs, block, data_off, size, read)
                    stats.sparse_segments += len(segments) // 2
                    if stats.sparse_segments > MAX_SPARSE_TOTAL:
                        raise _BadSparse(f"the archive's sparse maps pass {MAX_SPARSE_TOTAL} segments")
                except _BadSparse as exc:
                    stats.sparse += 1
                    log.warning("skipping member %r: %s", name, exc)
                    continue
                listed = True
                yield (FILE, name, h.mode, mtime, real, data_off + skip, "", segments)
                continue
            listed = True  # (a device or an unsupported entry counts: there is something before)
            if typeflag in (th.REGTYPE, th.AREGTYPE, th.CONTTYPE):
                if name.endswith("/"):  # pre-POSIX tars mark directories with a slash
                    yield (DIR, name, h.mode, mtime, 0, 0, "", None)
                else:
                    yield (FILE, name, h.mode, mtime, size, data_off, "", None)
            elif typeflag in (th.DIRTYPE, th.GNU_DUMPDIR):
                yield (DIR, name, h.mode, mtime, 0, 0, "", None)
            elif typeflag == th.SYMTYPE:
                yield (SYMLINK, name, h.mode, mtime, 0, 0, th.decode_name(raw_link), None)
            elif typeflag == th.LNKTYPE:
                yield (HARDLINK, name, h.mode, mtime, 0, 0, th.decode_name(raw_link), None)
            elif typeflag in (th.CHRTYPE, th.BLKTYPE, th.FIFOTYPE):
                stats.devices += 1
            elif typeflag == th.GNU_MULTIVOL:
                stats.sparse += 1
                log.warning("skipping member %r: multi-volume parts are not supported", name)
            elif typeflag in (th.GNU_VOLHDR, th.GNU_OLD_LONGNAME):
                stats.other += 1
            else:
                log.warning(
                    "member %r has unknown type %r: shown as a regular file (POSIX rule)", name, typeflag
                )
                yield (FILE, name, h.mode, mtime, size, data_off, "", None)
        if stats.devices:
            log.warning(
                "skipped %d device/FIFO members (a mount does not show them, pack does not copy them)",
                stats.devices,
            )
        self.end = pos


def _link_data_follows(block: bytes) -> bool:
    """Whether a hard link header that declares a size is followed by that many bytes of data.

    Tar readers have long ignored a hard link's size (the next header follows at once), but pax
    lets a hard link carry its target's bytes (``pax -o linkdata``). No field says which, so the
    block after the header decides, as bsdtar's reader does: a valid header there means the size
    is to be ignored; anything else but zeros (which end the archive) is the link's data, skipped.
    GNU tar reads such data as a damaged header and skips to the next one ("Skipping to next
    header"), reaching the same members."""
    return len(block) == th.BLOCK and block != th.ZERO_BLOCK and not th.checksum_ok(block)


class _BadSparse(ValueError):
    """A sparse member whose map cannot be right (the member is skipped, with the reason)."""


def _sparse_layout(
    old_sparse: list[int] | None, attrs: dict[str, bytes], block: bytes, data_off: int, stored: int, read
) -> tuple[int, array, int]:
    """(real size, flat (offset, length) data segments, bytes of map before the data) of a sparse
    member, from an old GNU header (``S``) or pax ``GNU.sparse.*`` records (0.0, 0.1, 1.0)."""
    try:
        if old_sparse is not None:
            real = th.parse_number(block[483:495])
            flat = old_sparse
            skip = 0
        elif attrs.get("GNU.sparse.major") == b"1":
            minor = attrs.get("GNU.sparse.minor", b"").decode("ascii", "replace")
            if minor != "0":
                raise _BadSparse(f"sparse format 1.{minor or '?'} is not known")
            real = int(attrs["GNU.sparse.realsize"])
            flat, skip = _sparse_map_in_data(read, data_off, stored)
        else:
            real = int(attrs.get("GNU.sparse.size") or attrs.get("GNU.sparse.realsize") or b"-1")
            text = attrs.get("GNU.sparse.map", b"")
            if text.count(b",") >= 2 * MAX_SPARSE_SEGMENTS:
                raise _BadSparse("sparse map with a huge number of values")
            flat = [int(x) for x in text.split(b",")] if text else []
            skip = 0
    except _BadSparse:
        raise
    except (KeyError, ValueError, th.TarHeaderError) as exc:
        raise _BadSparse(f"unreadable sparse map ({exc})") from None
    if len(flat) % 2 or len(flat) > 2 * MAX_SPARSE_SEGMENTS:
        raise _BadSparse("sparse map with an odd or huge number of values")
    if not 0 <= real <= MAX_MEMBER_SIZE:
        raise _BadSparse(f"impossible sparse file size {real}")
    segments = array("Q")
    end = 0
    for i in range(0, len(flat), 2):
        offset, length = flat[i], flat[i + 1]
        if offset < end or length < 0 or offset + length > real:
            raise _BadSparse("sparse map segments overlap, go backwards or pass the file's size")
        if length:
            segments += array("Q", (offset, length))
        end = offset + length
    covered = sum(segments[1::2])
    if covered != stored - skip:
        raise _BadSparse(f"sparse map covers {covered} bytes of data, the member has {stored - skip}")
    return real, segments, skip


def _sparse_map_in_data(read, data_off: int, stored: int) -> tuple[list[int], int]:
    """GNU sparse 1.0: decimal numbers, one per line (count, then offset/length pairs), at the start
    of the member's data, padded to a whole block; returns the pairs and the padded length."""
    numbers: list[int] = []
    count = None
    at = data_off
    pending = b""
    while count is None or len(numbers) < 2 * count:
        if at - data_off >= min(stored, MAX_SPARSE_MAP_BYTES):
            raise _BadSparse("sparse map runs past the member's data")
        chunk = read(at, th.BLOCK)
        if len(chunk) < th.BLOCK:
            raise _BadSparse("sparse map cut short")
        at += th.BLOCK
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            if count is None:
                count = int(line)
                if not 0 <= count <= MAX_SPARSE_SEGMENTS:
                    raise _BadSparse(f"sparse map of {count} segments")
            elif len(numbers) < 2 * count:
                numbers.append(int(line))
        wanted = count is None or len(numbers) < 2 * count
        if wanted and len(pending) > MAX_SPARSE_LINE:  # no newline in sight: never quadratic
            raise _BadSparse("sparse map line too long")
    return numbers, at - data_off


MAX_KEPT_WARNINGS = 16  # a scan's warnings kept with its index (see MemberTable.warnings)


class _KeptWarnings(logging.Handler):
    """The scanning thread's own warnings: two archives scanned at once share the module's logger."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into
        self.thread = threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread and len(self.into) < MAX_KEPT_WARNINGS:
            with contextlib.suppress(Exception):
                self.into.append(record.getMessage()[:500])


class _HeldWarnings(logging.Filter):
    """Holds back this thread's warnings (a second reading of an archive), to be said or dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread or record.levelno != logging.WARNING:
            return True
        self.messages.append(record.getMessage()[:500])
        return False


@contextlib.contextmanager
def keeping_warnings(members: MemberTable) -> Iterator[None]:
    """What the scan warns about, also kept in ``members.warnings`` (saved with the index)."""
    handler = _KeptWarnings(members.warnings)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def repeat_scan_warnings(members: MemberTable) -> None:
    """An open from a saved index warns what the scan that made it warned."""
    for warning in members.warnings:
        log.warning("%s", warning)


def warn_about_end(members: MemberTable, where: str) -> None:
    """Say at every open, from a scan or from a saved index, that the tar did not end as it should.

    The members before the cut stay readable, as with ``tar -x``; the cut ones read as EIO.
    """
    cut = [
        name
        for i, (kind, off, name) in enumerate(zip(members.kind, members.offset, members.names))
        if kind == FILE and off + members.stored_size(i) > members.stream_size
    ]
    if cut:
        # Named as the mount, ls and the API name it ("./d/big.bin" could be neither grepped nor pasted).
        first = normalize(cut[0], backslash_is_separator=False) or cut[0]
        log.warning(
            "%s ends inside the data of %d member(s) (a truncated copy?), %r first: they read as EIO",
            where, len(cut), first,
        )  # fmt: skip
    elif members.ending:
        log.warning("%s: the tar stream %s: listing what came before", where, members.ending)


_PAX_SIZE = re.compile(rb"[0-9]{1,20}")
_PAX_TIME = re.compile(rb"-?[0-9]{1,20}(\.[0-9]*)?")  # any precision: digits past a double's are moot


def _pax_numbers(attrs: dict[str, bytes], size: int, mtime: float, pos: int) -> tuple[int, float]:
    """The member's size and mtime with its pax records applied.

    An empty value deletes the record (POSIX: the header's field stands, even over a global
    record). A size that is no number loses the archive (where the next header is would be a
    guess); an mtime that is no number, or none a stat field can hold, leaves the header's.
    """
    raw = attrs.get("size")
    if raw:
        if not _PAX_SIZE.fullmatch(raw):
            raise ArchiveFormatError(f"corrupt pax size record {raw[:40]!r} for the member at offset {pos}")
        size = int(raw)
        if not 0 <= size <= MAX_MEMBER_SIZE:
            raise ArchiveFormatError(f"impossible member size {size} in the pax header at offset {pos}")
    raw = attrs.get("mtime")
    if raw:
        value = float(raw) if _PAX_TIME.fullmatch(raw) else math.nan
        if -MAX_MTIME <= value <= MAX_MTIME:
            mtime = value
        else:
            log.warning("pax header at offset %d: mtime %r is no time; the header's stands", pos, raw[:40])
    return size, mtime


# -- the format ------------------------------------------------------------------------
class TarFormat:
    """A tar or tar.zst archive opened on a source: index + container stream."""

    def __init__(
        self,
        source: Source,
        compressed: bool,
        progress: Callable[[int, int], None] | None = None,
        index_dir: str | None = None,
        window_max: int = MAX_WINDOW,
    ) -> None:
        self.source = source
        self.name = "tar.zst" if compressed else "tar"
        self.index_source = ""  # "embedded", "cache" or "scan": how the member table was obtained
        persist = getattr(source, "persist_index", True)
        self.store = IndexStore(index_dir, enabled=persist)
        # What keys the saved index: a local file's adds a hash of sampled bytes (LocalFile).
        index_identity = getattr(source, "index_identity", None)
        self._key = index_identity() if index_identity is not None and persist else source.identity
        self._mtime = getattr(source, "mtime", 0.0)
        self._window_max = window_max  # the largest zstd window the scan decodes (decoders.window_limit)
        if compressed:
            members, frames = self._open_zstd(progress)
            self.stream: ZstdStream | RawStream = ZstdStream(source, frames, source.identity.location)
            self.stream.packed = self.index_source == "embedded"
        else:
            members = self._open_tar(progress)
            self.stream = RawStream(source)
        self.index: Index = members.build_index(self._mtime)
        # How the tar stream ended when it did not end as it should ("" when it did): a mount
        # lists what came before; a copy (cdmlfs pack) of a damaged one must not.
        self.ending = members.ending

    @property
    def damaged(self) -> bool:
        """A corrupt header ended the listing: members after it exist but are not listed."""
        return self.ending.startswith(DAMAGED_ENDING)

    def data_offset(self, eid: int) -> int:
        return self.index.offset[eid]

    # -- the persisted index (plain tar and tar.zst) -----------------------------------------
    def _cached_or_built(self, cached: Callable[[], T | None], build: Callable[[], T]) -> T:
        """The saved index, else one built here, unless a process building it meanwhile (which
        this one waits for, see ``IndexStore.building``) saved it or found the archive unreadable."""
        found = cached()
        if found is not None:
            return found
        with self.store.building(self._key) as turn:
            found = cached()  # saved by a process we waited for
            if found is not None:
                return found
            turn.raise_noted_failure()  # or that process found the archive unreadable
            return build()

    # -- plain tar ----------------------------------------------------------------------
    def _open_tar(self, progress) -> MemberTable:
        return self._cached_or_built(self._cached_tar, lambda: self._scan_tar(progress))

    def _cached_tar(self) -> MemberTable | None:
        payload = self.store.load(self._key, STORE_KIND_TAR)
        if payload is not None:
            try:
                members = MemberTable.decode(payload)
                if members.data_end() <= self.source.size:
                    self.index_source = "cache"
                    repeat_scan_warnings(members)
                    warn_about_end(members, self.source.identity.location)
                    return members
            except MemberTableError as exc:
                log.info("ignoring cached index: %s", exc)
        return None

    def _scan_tar(self, progress) -> MemberTable:
        members = MemberTable()
        view = RawScanView(self.source, progress)
        started = time.monotonic()
        with keeping_warnings(members):
            end = scan_tar(view, members)
        view.finish(end)
        members.stream_size = self.source.size
        warn_about_end(members, self.source.identity.location)
        self.index_source = "scan"
        log.debug("scanned %d tar members in %.2fs", len(members), time.monotonic() - started)
        self.store.save(self._key, STORE_KIND_TAR, members.encode())
        return members

    # -- tar.zst -------------------------------------------------------------------------
    def _open_zstd(self, progress) -> tuple[MemberTable, FrameTable]:
        try:
            seek_frames = read_seek_table(self.source)
        except ArchiveFormatError as exc:
            where = self.source.identity.location
            log.warning("%s: %s; locating frames by their headers instead", where, exc)
            seek_frames = None
        if seek_frames is not None:
            check_empty_frames(self.source, seek_frames)
            members = self._embedded_members(seek_frames)
            if members is not None:
                self.index_source = "embedded"
                return members, FrameTable.from_frames(seek_frames)
        return self._cached_or_built(self._cached_zstd, lambda: self._scan_zstd(seek_frames, progress))

    def _scan_zstd(self, seek_frames: list[Frame] | None, progress) -> tuple[MemberTable, FrameTable]:
        where = self.source.identity.location
        if seek_frames is None:
            members, table, _ = self._scan_zstd_frames(None, progress)
        else:
            # The seek table says where frames start and what they hold, so that the scan can skip
            # the frames inside large members; a wrong entry would misplace every header after it.
            try:
                members, table, unchecked = self._scan_zstd_frames(seek_frames, progress)
            except SeekTableMismatch as exc:
                members, table = self._scan_without_seek_table(f"{where}: {exc}", progress)
            else:
                # A wrong size for a frame the scan skipped shows as a header in the wrong place.
                damaged = members.ending.startswith(DAMAGED_ENDING)
                if damaged and not self._headers_agree(unchecked):
                    members, table = self._rescan_if_better(members, table, progress)
        warn_about_end(members, where)
        self._save_zstd(members, table)
        return members, table

    def _scan_without_seek_table(self, why: str, progress) -> tuple[MemberTable, FrameTable]:
        message = f"{why}: the seek table is wrong; locating frames by their headers instead"
        log.warning("%s", message)
        members, table, _ = self._scan_zstd_frames(None, progress)
        members.warnings.insert(0, message)  # repeated when the archive opens from the saved index
        return members, table

    def _headers_agree(self, frames: list[Frame]) -> bool:
        """Whether the frames a scan skipped state in their own headers the sizes the seek table
        gives them: then a corrupt header is the tar's own, and the archive is not read again
        (a whole pass over it, over the network for S3). Frames that state no size (the reference
        seekable writer's) cannot say: False."""
        for frame in frames:
            try:
                header = parse_frame_header(self.source.read_at(frame.offset, 18), frame.offset)
            except ValueError:
                return False
            if header.content_size is None or header.content_size != frame.content_size:
                return False
        return True

    def _rescan_if_better(self, members: MemberTable, table: FrameTable, progress):
        """The tar read through the seek table stopped at a corrupt header: read it again by the
        frames' own headers, and keep that reading if it lists more (the table was wrong)."""
        held = _HeldWarnings()  # the first reading has said its warnings: this one's wait
        log.addFilter(held)
        try:
            again, again_table, _ = self._scan_zstd_frames(None, progress)
        except ArchiveFormatError:
            return members, table
        finally:
            log.removeFilter(held)
        if again.ending.startswith(DAMAGED_ENDING) and len(again) <= len(members):
            return members, table  # the damage is in the tar itself
        again.warnings[:] = held.messages[:MAX_KEPT_WARNINGS]  # kept: its own warnings stand instead
        repeat_scan_warnings(again)
        damage = members.ending.split(", where")[0]
        message = (
            f"{self.source.identity.location}: the seek table is wrong (read by it, the tar {damage}); "
            "located frames by their headers instead"
        )
        log.warning("%s", message)
        again.warnings.insert(0, message)
        return again, again_table

    def _scan_zstd_frames(
        self, seek_frames: list[Frame] | None, progress
    ) -> tuple[MemberTable, FrameTable, list[Frame]]:
        """One scan: the members, the frames, and the listed frames it skipped unchecked."""
        # Without a seek table, frames are found as the scan goes: the archive is read once.
        view = ZstdScanView(self.source, seek_frames, progress, self._window_max)
        started = time.monotonic()
        members = MemberTable()
        not_tar = False
        try:
            with keeping_warnings(members):
                end = scan_tar(view, members)
            view.finish(end, tar_ended=not members.ending)
        except ArchiveFormatError as exc:
            if len(members) != 0 or "not a tar" not in str(exc):
                raise
            not_tar = True
        if not view.has_data_frames:
            raise ArchiveFormatError("zstd file holds no data frames")
        if not_tar:
            raise ArchiveFormatError("zstd data that is not a tar archive")
        table = view.frame_table()
        members.stream_size = table.total
        self.index_source = "scan"
        log.debug(
            "scanned %d members in %.2fs (%d of %d frames decoded)",
            len(members),
            time.monotonic() - started,
            view.decoded_frames,
            len(view.frames),
        )
        return members, table, view.unchecked

    def _embedded_members(self, frames: list[Frame]) -> MemberTable | None:
        """The member table a ``cdmlfs pack`` archive stores in its last listed skippable frame."""
        for frame in reversed(frames):
            if frame.content_size:
                return None  # only skippable frames after the last data frame are looked at
            if frame.comp_size < 8 + len(EMBEDDED_INDEX_MAGIC) + 8:
                continue
            head = self.source.read_at(frame.offset, 8 + len(EMBEDDED_INDEX_MAGIC))
            magic, length = struct.unpack_from("<II", head)
            if magic != SKIPPABLE_BASE | EMBEDDED_INDEX_NIBBLE or head[8:] != EMBEDDED_INDEX_MAGIC:
                continue
            if length + 8 != frame.comp_size:
                log.warning("embedded index frame has the wrong size: scanning the archive instead")
                return None
            body = self.source.read_at(frame.offset + 8, length)
            total = sum(f.content_size or 0 for f in frames)
            try:
                members = decode_embedded_index(body, total)
            except ValueError as exc:
                log.warning("embedded index is unusable (%s): scanning the archive instead", exc)
                return None
            if members.stream_size != total or members.data_end() > total:
                log.warning("embedded index does not match the seek table: scanning the archive instead")
                return None
            return members
        return None

    def _cached_zstd(self) -> tuple[MemberTable, FrameTable] | None:
        payload = self.store.load(self._key, STORE_KIND_TAR_ZST)
        if payload is None:
            return None
        try:
            (n,) = struct.unpack_from("<Q", payload)
            frames = FrameTable.decode(payload[8 : 8 + n], self.source.size)
            members = MemberTable.decode(memoryview(payload)[8 + n :])
            if members.stream_size != frames.total or members.data_end() > frames.total:
                raise ValueError("member table and frame table disagree")
        except (ValueError, struct.error, ArchiveFormatError) as exc:
            log.info("ignoring cached index: %s; rescanning", exc)
            return None
        self.index_source = "cache"
        repeat_scan_warnings(members)
        warn_about_end(members, self.source.identity.location)
        return members, frames

    def _save_zstd(self, members: MemberTable, frames: FrameTable) -> None:
        frame_bytes = frames.encode()
        payload = struct.pack("<Q", len(frame_bytes)) + frame_bytes + members.encode()
        self.store.save(self._key, STORE_KIND_TAR_ZST, payload)


# -- embedded index (written by cdmlfs pack) ----------------------------------------------
def encode_embedded_index(members: MemberTable) -> bytes:
    """Payload of the skippable frame a packed archive carries: magic, header, zstd(member table)."""
    import zlib

    import zstandard

    body = zstandard.ZstdCompressor(level=9).compress(members.encode())
    header = json.dumps({"crc32": zlib.crc32(body), "length": len(body)}).encode()
    return EMBEDDED_INDEX_MAGIC + struct.pack("<I", len(header)) + header + body


EMBEDDED_INDEX_MAX_RATIO = 1024
# Tables up to this size decode whatever their ratio: long repetitive names (pax paths of tens of
# KB under one folder) shrink past 1024x, and pack's own table was refused (a scan at every mount).
EMBEDDED_INDEX_RATIO_FLOOR = 64 << 20


def decode_embedded_index(payload: bytes, stream_size: int = 1 << 40) -> MemberTable:
    """The member table of a packed archive whose tar stream is ``stream_size`` bytes.

    The table can only describe what the stream holds: a member per 512-byte header at most,
    names and links no longer than the stream that carries them. Decoding stops past that: a
    few KB of payload decoded to a gigabyte and more before its size was checked.
    """
    import zlib

    if not payload.startswith(EMBEDDED_INDEX_MAGIC):
        raise ValueError("not a cdmlfs member table")
    pos = len(EMBEDDED_INDEX_MAGIC)
    (hlen,) = struct.unpack_from("<I", payload, pos)
    pos += 4
    try:
        header = json.loads(payload[pos : pos + hlen])
        crc, length = int(header["crc32"]), int(header["length"])
    except (ValueError, KeyError, TypeError, OverflowError) as exc:  # JSON allows Infinity
        raise ValueError(f"bad header ({exc})") from None
    body = payload[pos + hlen :]
    if len(body) != length or zlib.crc32(body) != crc:
        raise ValueError("checksum mismatch")
    limit = min(1 << 32, 64 * (stream_size // th.BLOCK + 1) + 6 * stream_size + (1 << 20))
    # stream_size is the seek table's claim, not checked until frames are decoded: a 16 KB file
    # claiming 4 GiB decoded a gigabyte of forged table. Tables that cdmlfs pack writes shrink
    # 2-15x (CRCs and offsets barely compress) unless their names repeat at length; beyond 1024x,
    # and larger than the floor, the payload is not one of them.
    limit = min(limit, max(EMBEDDED_INDEX_RATIO_FLOOR, EMBEDDED_INDEX_MAX_RATIO * len(body) + (1 << 20)))
    return MemberTable.decode(decompress_bounded(body, limit, MemberTable.encoded_length))
