"""How ``cdmlfs stats`` reads a live mount's counters: an ioctl on the mount's root directory.

Why an ioctl: it travels wherever the mount does (a trainer container that
only shares the mount with the daemon's sidecar reads it too), it is never
cached by the kernel, and it leaves extended attributes free to be switched
off. An xattr used to carry the stats, so the daemon had to answer every
getxattr the kernel forwarded: ``ls -l`` asks each file for its ACL and
security label, two round trips per file on every listing. With no xattr
handler the first getxattr answers ENOSYS and the kernel stops asking.

The request is a restricted (well-formed) ioctl, so FUSE passes it without
privileges: ``_IOWR('C', 0x53, char[CHUNK])``. The caller sends the byte
offset it wants (8 bytes, little-endian) and gets back the JSON's total
length and the snapshot's number (4 bytes each) and up to ``CHUNK - 8``
bytes of it from that offset. A reader whose chunks come from two snapshots
(another ``cdmlfs stats`` renewed it meanwhile) sees the number change.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Callable

CHUNK = 16368  # an ioctl's size field has 14 bits: at most 16383 bytes travel each way
_IOC_READ_WRITE = 3
REQUEST = (_IOC_READ_WRITE << 30) | (CHUNK << 16) | (ord("C") << 8) | 0x53
_HEADER = 8


def fill_reply(blob: bytes, number: int, buf: memoryview) -> None:
    """Daemon side: answer a request that arrived in ``buf`` (CHUNK bytes, in place) from ``blob``,
    snapshot ``number``."""
    offset = int.from_bytes(buf[:_HEADER], "little")
    piece = blob[offset : offset + CHUNK - _HEADER]
    buf[:4] = len(blob).to_bytes(4, "little")
    buf[4:_HEADER] = (number & 0xFFFFFFFF).to_bytes(4, "little")
    buf[_HEADER : _HEADER + len(piece)] = piece


def read(mountpoint: str) -> dict:
    """Client side: the stats of the mount at ``mountpoint`` (OSError from the open or the ioctl).
    It waits as long as the daemon takes: ``cdmlfs stats`` bounds it (``mountpoints.call_within``)."""
    fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return gather(lambda buf: fcntl.ioctl(fd, REQUEST, buf, True))
    finally:
        os.close(fd)


def gather(ask: Callable[[bytearray], object]) -> dict:
    """The snapshot, chunk by chunk: ``ask(buf)`` has a request answered in ``buf`` (in place)."""
    for _ in range(3):  # a second reader can renew the daemon's snapshot between our chunks
        parts: list[bytes] = []
        offset, total, number = 0, None, None
        while total is None or offset < total:
            buf = bytearray(CHUNK)
            buf[:_HEADER] = offset.to_bytes(_HEADER, "little")
            ask(buf)
            size, now = int.from_bytes(buf[:4], "little"), int.from_bytes(buf[4:_HEADER], "little")
            if number is not None and now != number:
                break  # renewed under us: start over
            total, number = size, now
            piece = bytes(buf[_HEADER : _HEADER + min(CHUNK - _HEADER, total - offset)])
            parts.append(piece)
            offset += len(piece)
        else:
            try:
                return json.loads(b"".join(parts))
            except ValueError:
                continue  # not JSON: a daemon of another version? try again, then give up
    raise OSError(errno.EAGAIN, "the stats kept changing while they were read")
