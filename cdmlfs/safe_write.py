"""Extracted files are written where they belong, whole or not at all (and state, where only we write).

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
import stat
import tempfile
from typing import BinaryIO

from cdmlfs.errors import UnsafeDestinationError


def private_temp_dir() -> str | None:
    """``$TMPDIR/cdmlfs-UID``, made ``0700`` if missing, when it is ours alone (a directory this user
    owns that nobody else may enter): where state goes when the home directory cannot take it (a
    read-only or missing home; ``HOME=/`` for a container run under an arbitrary uid). None when
    there is no such place: another user's folder, or a link planted there, is never written into."""
    path = os.path.join(tempfile.gettempdir(), f"cdmlfs-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
        return path
    return None


def is_under(root: str, path: str) -> bool:
    """``path`` is ``root`` or below it (both already resolved with realpath)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_inside(root: str, out: str) -> None:
    """Refuse ``out`` when its directory resolves outside ``root`` (a realpath), e.g. through a symlink."""
    where = os.path.realpath(os.path.dirname(out) or ".")
    if not is_under(root, where):
        raise UnsafeDestinationError(
            f"refusing to write {out}: its directory resolves to {where}, outside {root}"
        )


HOLE_GRAIN = 4 << 10  # zero blocks of this size (a file system block) become holes in a sparse copy


def write_atomically(
    out: str,
    src: BinaryIO,
    mode: int = 0o644,
    mtime: float | None = None,
    chunk: int = 4 << 20,
    sparse: bool = False,
) -> None:
    """Copy ``src`` to the file ``out`` (created or replaced whole) with ``mode`` and ``mtime``.

    ``sparse``: zero runs are left as holes (``tar -x`` of a sparse member makes a sparse file;
    a disk image of mostly holes would otherwise fill the disk it is extracted to)."""
    fd, tmp = tempfile.mkstemp(prefix=".cdmlfs-", suffix=".partial", dir=os.path.dirname(out) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            if sparse:
                _copy_with_holes(src, f, max(chunk, HOLE_GRAIN))
            else:
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


def _copy_with_holes(src: BinaryIO, f: BinaryIO, chunk: int) -> None:
    """``shutil.copyfileobj`` that seeks over zero grains instead of writing them."""
    zeros = bytes(HOLE_GRAIN)
    end = 0
    while data := src.read(chunk):
        view = memoryview(data)
        for at in range(0, len(view), HOLE_GRAIN):
            grain = view[at : at + HOLE_GRAIN]
            if len(grain) == HOLE_GRAIN and grain == zeros:
                f.seek(HOLE_GRAIN, os.SEEK_CUR)
            else:
                f.write(grain)
        end += len(view)
    f.truncate(end)  # a hole at the end: the size still counts it
