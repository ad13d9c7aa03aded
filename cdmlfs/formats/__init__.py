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
    for magic, kind, tool in _FOREIGN:
        if head.startswith(magic):
            raise ArchiveFormatError(
                f"{kind}-compressed, which cdmlfs does not read (ZIP, tar and tar.zst only): "
                f"decompress it ({tool}), then mount the .tar or 'cdmlfs pack' it into a .tar.zst"
            )
    raise ArchiveFormatError("not a supported archive (expected ZIP, tar or tar.zst)")


# Compressed tars people will try: say what the file is and what to do about it.
_FOREIGN = (
    (b"\x1f\x8b", "gzip", "gunzip"),
    (b"BZh", "bzip2", "bunzip2"),
    (b"\xfd7zXZ\x00", "xz", "unxz"),
    (b"\x04\x22\x4d\x18", "lz4", "unlz4"),
)


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
