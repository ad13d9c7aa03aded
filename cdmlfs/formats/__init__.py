"""Archive formats: each turns a byte source into an index (plus where member bytes live).

``open_format`` sniffs the first and last bytes of the source and picks the
format; adding a format means adding a module and one entry to ``_SNIFFERS``.
"""

from __future__ import annotations

from collections.abc import Callable

from cdmlfs.errors import ArchiveFormatError
from cdmlfs.sources.base import Source

SNIFF_BYTES = 4096
TAIL_BYTES = 65557 + 20  # the largest ZIP end record (with its comment) and a ZIP64 locator


def open_format(source: Source, progress: Callable[[int, int], None] | None = None, **options):
    """Open ``source`` with the format its bytes announce; raise ArchiveFormatError otherwise."""
    head = source.read_at(0, min(SNIFF_BYTES, source.size)) if source.size else b""
    tail_len = min(source.size, TAIL_BYTES)
    tail = source.read_at(source.size - tail_len, tail_len) if tail_len else b""
    for sniff, opener in _sniffers():
        if sniff(head, tail):
            return opener(source, progress=progress, **options)
    kind = compressed_kind(head)
    if kind is not None:
        tool = _FOREIGN[kind]
        if kind in PACKABLE:
            raise ArchiveFormatError(
                f"{kind}-compressed, which cdmlfs does not mount (ZIP, tar and tar.zst only): convert "
                f"it in one pass, with no extraction: 'cdmlfs pack FILE OUT.tar.zst' (or {tool} it and "
                "mount the .tar)"
            )
        raise ArchiveFormatError(
            f"{kind}-compressed, which cdmlfs does not read (ZIP, tar and tar.zst only): "
            f"decompress it ({tool}), then mount the .tar or 'cdmlfs pack' it into a .tar.zst"
        )
    raise ArchiveFormatError("not a supported archive (expected ZIP, tar or tar.zst)")


# Compressed tars people will try: what the file is (by its magic number) and what undoes it.
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x04\x22\x4d\x18", "lz4"))
_FOREIGN = {"gzip": "gunzip", "bzip2": "bunzip2", "xz": "unxz", "lz4": "unlz4"}
# Those `cdmlfs pack` converts as a stream (the Python standard library decompresses them).
PACKABLE = frozenset({"gzip", "bzip2", "xz"})


def compressed_kind(head: bytes) -> str | None:
    """'gzip', 'bzip2', 'xz' or 'lz4' when ``head`` (a file's first bytes) starts that way."""
    return next((kind for magic, kind in _MAGIC if head.startswith(magic)), None)


def _sniffers():
    """Most specific first: magic numbers at offset 0, then a ZIP end record found in the tail.

    The tail check must come last: a tar whose last member is a ZIP has a ZIP
    end record near its end (and a self-extracting ZIP has no magic at 0).
    """
    from cdmlfs.formats import tar as tarfmt
    from cdmlfs.formats import zip as zipfmt

    def open_zip(source, progress=None, **_):
        return zipfmt.ZipFormat(source, progress)

    def zip_at_start(head: bytes, tail: bytes) -> bool:
        return head[:4] == b"PK\x03\x04"

    return [(zip_at_start, open_zip), *tarfmt.SNIFFERS, (zipfmt.is_zip, open_zip), *tarfmt.LAST_SNIFFERS]
