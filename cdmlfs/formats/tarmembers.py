"""The member list of a tar stream as compact columns, with one binary encoding.

A tar scan (reading every header of a foreign archive) is the expensive part
of opening a tar or tar.zst; its result is this table. The same bytes are
persisted in the index cache (:mod:`cdmlfs.index_store`) and embedded in
archives that ``cdmlfs pack`` writes, so both remounts and packed archives
skip the scan. The table records members *as the archive states them* (raw
names, hard links by name); :meth:`MemberTable.build_index` replays them
through :class:`~cdmlfs.index.IndexBuilder`, so path rules and duplicate
handling are applied in exactly one place, identically for fresh scans and
cached tables.

Tables written by ``cdmlfs pack`` also carry each file's CRC-32 (``crcs``):
with it the reader can check one member as soon as its own bytes are decoded,
without waiting for the rest of its zstd frame (whose checksum covers the
whole frame). Scanned tables of foreign archives have none.

Encoding (little endian): a JSON header line, then the columns as raw arrays
(version 2 adds the optional CRC column, flagged ``"crc": 1``; version 1
tables still decode), then names and link targets as NUL-separated UTF-8
(surrogate escapes keep non-UTF-8 bytes). NUL never occurs in a name (tar
fields are C strings; pax values are normalised the same way
:mod:`cdmlfs.pathrules` would).
"""

from __future__ import annotations

import json
import sys
from array import array

from cdmlfs.index import DIR, FILE, IN_STREAM, MEMBER_CRC, SPARSE, SYMLINK, Index, IndexBuilder

HARDLINK = 3  # member kinds: FILE, DIR, SYMLINK from cdmlfs.index, plus this one
ENCODING_VERSION = 2  # written when no member is sparse (what cdmlfs pack embeds: older readers read it)
SPARSE_ENCODING_VERSION = 3  # adds the data segments of sparse members
READABLE_VERSIONS = (1, 2, 3)


WARNINGS_ROOM = 2048  # bytes of the header line that scan warnings may take (JSON-encoded)


class MemberTableError(ValueError):
    """Encoded bytes that do not describe a member table (corrupt, truncated, other version)."""


class MemberTable:
    """Members in archive order: kind, mode, mtime, size, data offset in the stream, name, link."""

    __slots__ = (
        "crcs", "ending", "kind", "links", "mode", "mtime", "names", "offset", "size", "sparse",
        "stream_size", "warnings",
    )  # fmt: skip

    def __init__(self) -> None:
        self.kind = bytearray()
        self.mode = array("H")
        self.mtime = array("d")
        self.size = array("Q")
        self.offset = array("Q")
        self.names: list[str] = []
        self.links: dict[int, str] = {}
        self.stream_size = 0  # bytes of the decoded stream the members were found in
        self.crcs: array | None = None  # CRC-32 of each member's data (0 for non-files), or None
        # sparse member -> flat (logical offset, length) pairs of its data segments; ``size`` is then
        # the file's real size and its data in the stream is the segments' bytes, back to back
        self.sparse: dict[int, array] = {}
        # How the tar ended when it did not end as tar writers end it ("" when it did): kept with
        # the index so that a remount from it says so again (cdmlfs.formats.tar.warn_about_end).
        self.ending = ""
        # What the scan warned about (members skipped, headers not understood): kept with the index
        # so that an open from it warns the same (Archive.open_warnings was empty then).
        self.warnings: list[str] = []

    def __len__(self) -> int:
        return len(self.names)

    def append(
        self,
        kind: int,
        name: str,
        mode: int,
        mtime: float,
        size: int,
        offset: int,
        link: str = "",
        crc: int = 0,
        sparse: array | None = None,
    ) -> None:
        """Add a member (``crc`` is kept when the table has a CRC column: ``crcs`` set before the first)."""
        if "\0" in name:
            name = name.replace("\0", "_")
        self.kind.append(kind)
        self.mode.append(mode & 0o7777)
        self.mtime.append(mtime)
        self.size.append(size)
        self.offset.append(offset)
        self.names.append(name)
        if self.crcs is not None:
            self.crcs.append(crc)
        if kind in (SYMLINK, HARDLINK):
            self.links[len(self.names) - 1] = link.replace("\0", "_")
        if sparse is not None:
            self.sparse[len(self.names) - 1] = sparse

    def stored_size(self, i: int) -> int:
        """Bytes of member ``i``'s data in the stream (less than its size when it is sparse)."""
        segments = self.sparse.get(i) if self.sparse else None
        return self.size[i] if segments is None else sum(segments[1::2])

    def data_end(self) -> int:
        """Largest end offset of any member's data (must lie within the stream)."""
        end = 0
        for i, (k, off, size) in enumerate(zip(self.kind, self.offset, self.size)):
            if k == FILE and off + size > end:
                size = self.stored_size(i) if self.sparse else size
                end = max(end, off + size)
        return end

    # -- index ---------------------------------------------------------------
    def build_index(self, implied_dir_mtime: float = 0.0) -> Index:
        """Replay the members through the index builder (path rules, duplicates, hard links)."""
        builder = IndexBuilder(implied_dir_mtime, backslash_is_separator=False, root_entry=True)
        add = builder.add
        links = self.links
        names = self.names
        crcs = self.crcs
        file_flags = 0 if crcs is None else MEMBER_CRC
        for i, (kind, mode, mtime, size, offset) in enumerate(
            zip(self.kind, self.mode, self.mtime, self.size, self.offset)
        ):
            if kind == FILE:
                crc = 0 if crcs is None else crcs[i]
                segments = self.sparse.get(i) if self.sparse else None
                if segments is None:
                    add(names[i], FILE, mode, mtime, size, IN_STREAM, offset, size, crc, file_flags)
                else:
                    stored = self.stored_size(i)
                    eid = add(names[i], FILE, mode, mtime, size, IN_STREAM, offset, stored, 0, SPARSE)
                    if eid is not None:
                        builder.set_sparse(eid, segments)
            elif kind == DIR:
                add(names[i], DIR, mode, mtime, 0, IN_STREAM, 0, 0, 0)
            elif kind == SYMLINK:
                target = links[i]
                length = len(target.encode("utf-8", "surrogateescape"))
                eid = add(names[i], SYMLINK, mode or 0o777, mtime, length, IN_STREAM, 0, 0, 0)
                if eid is not None:
                    builder.set_link_target(eid, target)
            else:
                builder.add_hardlink(names[i], links[i], mtime, mode)
        return builder.finish(archive_order=True)

    # -- encoding --------------------------------------------------------------
    def encode(self) -> bytes:
        link_ids = array("I", sorted(self.links))
        sparse_ids = array("I", sorted(self.sparse))
        names = "\0".join(self.names).encode("utf-8", "surrogateescape")
        link_text = "\0".join(self.links[i] for i in link_ids).encode("utf-8", "surrogateescape")
        header = {
            "v": SPARSE_ENCODING_VERSION if sparse_ids else ENCODING_VERSION,
            "n": len(self.names),
            "links": len(link_ids),
            "stream_size": self.stream_size,
            "crc": int(self.crcs is not None),
            "names_bytes": len(names),
            "links_bytes": len(link_text),
        }
        cols = [self.mode, self.mtime, self.size, self.offset, link_ids]
        if self.crcs is not None:
            if len(self.crcs) != len(self.names):
                raise ValueError("member table has a CRC column of the wrong length")
            cols.append(self.crcs)
        if sparse_ids:
            counts = array("I", (len(self.sparse[i]) for i in sparse_ids))
            values = array("Q")
            for i in sparse_ids:
                values += self.sparse[i]
            header["sparse"] = len(sparse_ids)
            header["sparse_values"] = len(values)
            cols += [sparse_ids, counts, values]
        if self.ending:  # an optional key: readers that do not know it ignore it
            header["ending"] = self.ending
        kept: list[str] = []
        room = WARNINGS_ROOM  # the header line is read from the first 4 KiB
        for warning in self.warnings:
            room -= len(json.dumps(warning)) + 1
            if room < 0:
                break
            kept.append(warning)
        if kept:  # optional too
            header["warnings"] = kept
        parts = [json.dumps(header, separators=(",", ":")).encode() + b"\n"]
        parts += [_le_bytes(col) for col in cols]
        parts += [bytes(self.kind), names, link_text]
        return b"".join(parts)

    @staticmethod
    def _header(data: memoryview) -> tuple[dict, int]:
        """The JSON header line (checked) and where the columns start."""
        nl = bytes(data[:4096]).find(b"\n")
        if nl < 0:
            raise MemberTableError("member table header missing")
        try:
            header = json.loads(bytes(data[:nl]))
            if not isinstance(header, dict):  # valid JSON, but a number or a list has no .get
                raise MemberTableError("member table header is not a JSON object")
            if header.get("v") not in READABLE_VERSIONS:
                raise MemberTableError(f"member table version {header.get('v')} is not supported")
            if type(header.get("crc", 0)) is not int or header.get("crc", 0) not in (0, 1):  # not 1.0
                raise MemberTableError("bad member table header (crc flag)")
            for key in ("n", "links", "names_bytes", "links_bytes", "stream_size"):
                if int(header[key]) < 0:
                    raise ValueError(key)
            n_sparse = int(header.get("sparse", 0))
            n_values = int(header.get("sparse_values", 0))
            if n_sparse < 0 or n_values < 0 or (n_sparse and header["v"] < SPARSE_ENCODING_VERSION):
                raise ValueError("sparse counts")
            if not isinstance(header.get("ending", ""), str):
                raise ValueError("ending")
            warnings = header.get("warnings", [])
            if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
                raise ValueError("warnings")
        except (ValueError, KeyError, TypeError, OverflowError) as exc:  # JSON allows Infinity
            if isinstance(exc, MemberTableError):
                raise
            raise MemberTableError(f"bad member table header ({exc})") from None
        return header, nl + 1

    @staticmethod
    def _layout(header: dict) -> list[tuple[str, int]]:
        """The columns after the header line: (array typecode, count) in order."""
        n = int(header["n"])
        layout = [("H", n), ("d", n), ("Q", n), ("Q", n), ("I", int(header["links"]))]
        layout += [("I", n)] * header.get("crc", 0)
        n_sparse = int(header.get("sparse", 0))
        if n_sparse:
            layout += [("I", n_sparse), ("I", n_sparse), ("Q", int(header.get("sparse_values", 0)))]
        return layout

    @classmethod
    def encoded_length(cls, start: bytes | memoryview) -> int:
        """How long the encoding that begins with ``start`` (its header line at least) must be.

        Lets a decoder stop at that length: a forged table's payload cannot make it produce more.
        """
        header, pos = cls._header(memoryview(start))
        cols = sum(count * array(typecode).itemsize for typecode, count in cls._layout(header))
        return pos + cols + int(header["n"]) + int(header["names_bytes"]) + int(header["links_bytes"])

    @classmethod
    def decode(cls, data: bytes | memoryview) -> MemberTable:
        data = memoryview(data)
        header, pos = cls._header(data)
        n = int(header["n"])
        n_links = int(header["links"])
        names_bytes = int(header["names_bytes"])
        links_bytes = int(header["links_bytes"])
        stream_size = int(header["stream_size"])
        n_values = int(header.get("sparse_values", 0))
        has_crc = header.get("crc", 0)
        n_sparse = int(header.get("sparse", 0))
        ending = header.get("ending", "")
        table = cls()
        table.stream_size = stream_size
        table.ending = ending
        table.warnings = list(header.get("warnings", []))
        cols = []
        for typecode, count in cls._layout(header):
            col = array(typecode)
            nbytes = count * col.itemsize
            if pos + nbytes > len(data):
                raise MemberTableError("member table is truncated")
            col.frombytes(data[pos : pos + nbytes])
            if sys.byteorder != "little":
                col.byteswap()
            cols.append(col)
            pos += nbytes
        if pos + n + names_bytes + links_bytes != len(data):
            raise MemberTableError("member table has the wrong length")
        table.mode, table.mtime, table.size, table.offset, link_ids = cols[:5]
        if has_crc:
            table.crcs = cols[5]
        if n_sparse:
            sparse_ids, counts, values = cols[-3:]
            if sum(counts) != n_values or any(c % 2 for c in counts):
                raise MemberTableError("member table sparse maps disagree")
            at = 0
            for i, c in zip(sparse_ids, counts):
                table.sparse[i] = values[at : at + c]
                at += c
        table.kind = bytearray(data[pos : pos + n])
        pos += n
        try:
            names = bytes(data[pos : pos + names_bytes]).decode("utf-8", "surrogateescape")
            pos += names_bytes
            link_text = bytes(data[pos : pos + links_bytes]).decode("utf-8", "surrogateescape")
        except UnicodeDecodeError as exc:
            raise MemberTableError(f"member table text is not UTF-8 ({exc})") from None
        table.names = names.split("\0") if n else []
        links = link_text.split("\0") if n_links else []
        if len(table.names) != n or len(links) != n_links or max(table.kind, default=0) > HARDLINK:
            raise MemberTableError("member table columns disagree")
        if any(i >= n for i in link_ids):  # an id past the members would fail later, far from here
            raise MemberTableError("member table links name members it does not have")
        if any(i >= n or table.kind[i] != FILE for i in table.sparse):
            raise MemberTableError("member table sparse maps name members that are not files")
        for i, segments in table.sparse.items():  # in order, non-empty, within the file: as scanned
            end = 0
            for j in range(0, len(segments), 2):
                if segments[j] < end or not segments[j + 1] or segments[j] + segments[j + 1] > table.size[i]:
                    raise MemberTableError(f"member table sparse map of member {i} is out of order")
                end = segments[j] + segments[j + 1]
        table.links = dict(zip(link_ids, links))
        if any(table.kind[i] not in (SYMLINK, HARDLINK) for i in table.links) or any(
            k in (SYMLINK, HARDLINK) and i not in table.links for i, k in enumerate(table.kind)
        ):
            raise MemberTableError("member table links disagree with member kinds")
        return table


def _le_bytes(col: array) -> bytes:
    if sys.byteorder == "little":
        return col.tobytes()
    swapped = array(col.typecode, col)
    swapped.byteswap()
    return swapped.tobytes()
