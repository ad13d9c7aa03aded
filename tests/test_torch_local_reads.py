"""cdmlfs_torch reads files on a mount without the per-file terminal check of ``open()``.

Before Python 3.14, ``open(path, "rb")`` asks each file whether it is a terminal (an ioctl),
which FUSE forwards to the daemon: a round trip per sample. The test watches the real system
calls with strace while cdmlfs_torch reads through a real mount, and checks with plain
``open()`` that it would have seen the ioctl (so the check can fail).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from mountutil import mounted

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")

READER = r"""
import sys
from cdmlfs_torch.loaders import open_sample, read_sample
from cdmlfs_torch.roots import LocalTree
what, path = sys.argv[1], sys.argv[2]
if what == "torch":
    a = read_sample(path)
    with open_sample(path) as f:
        b = f.read()
    c = LocalTree("/").read(path)
    with LocalTree("/").open(path) as f:
        d = f.read()
    assert a == b == c == d, "different bytes"
else:
    with open(path, "rb") as f:
        f.read()
print("ok")
"""


def _ioctls_on(path: Path, what: str) -> list[str]:
    res = subprocess.run(
        ["strace", "-f", "-y", "-e", "trace=ioctl", sys.executable, "-c", READER, what, str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
    return [line for line in res.stderr.splitlines() if "ioctl(" in line and str(path) in line]


def test_samples_on_a_mount_are_read_without_an_ioctl(tmp_path: Path) -> None:
    archive = tmp_path / "d.zip"
    payload = bytes(range(256)) * 400
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("cls/a.bin", payload)
    with mounted(archive, tmp_path / "mnt") as mnt:
        sample = mnt / "cls" / "a.bin"
        assert sample.read_bytes() == payload
        assert _ioctls_on(sample, "torch") == []
        if sys.version_info < (3, 14):  # 3.14 dropped the check for regular files
            assert _ioctls_on(sample, "plain-open"), "strace saw no ioctl from open(): the check is blind"
