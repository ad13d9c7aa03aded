"""Extracted files are written where they belong, whole or not at all.

An archive (or an earlier extraction into the same directory) can leave a
symlink where a file or its temporary copy is about to be written. Opening such
a path follows the link and writes outside the destination. So files are
written through a temporary file created exclusively beside the target
(``mkstemp``: ``O_CREAT | O_EXCL``, never through a link), mode and times are
set on its descriptor, and ``os.replace`` swaps it in (a link at the target is
replaced, not followed). A failed copy (a corrupt member, a full disk) removes
the temporary file instead of leaving a partial one behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import BinaryIO

from cdmlfs.errors import UsageError


def is_under(root: str, path: str) -> bool:
    """``path`` is ``root`` or below it (both already resolved with realpath)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_inside(root: str, out: str) -> None:
    """Refuse ``out`` when its directory resolves outside ``root`` (a realpath), e.g. through a symlink."""
    where = os.path.realpath(os.path.dirname(out) or ".")
    if not is_under(root, where):
        raise UsageError(f"refusing to write {out}: its directory resolves to {where}, outside {root}")


def write_atomically(
    out: str, src: BinaryIO, mode: int = 0o644, mtime: float | None = None, chunk: int = 4 << 20
) -> None:
    """Copy ``src`` to the file ``out`` (created or replaced whole) with ``mode`` and ``mtime``."""
    fd, tmp = tempfile.mkstemp(prefix=".cdmlfs-", suffix=".partial", dir=os.path.dirname(out) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            shutil.copyfileobj(src, f, chunk)
            f.flush()  # the last bytes still buffered would be written after utime, and move the mtime
            os.fchmod(f.fileno(), mode)
            if mtime is not None:
                os.utime(f.fileno(), (mtime, mtime))
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
