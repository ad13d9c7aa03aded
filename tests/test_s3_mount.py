"""Real FUSE mounts of S3 archives (moto and localbucket on 127.0.0.1) compared with local mounts.

The mount daemon is a forked child of the CLI: it reads the dummy credentials
from the environment the session fixture sets.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import zipfile
from pathlib import Path

import pytest
import s3util
from archives import infozip, sample_files, write_tree
from mountutil import daemon_pid, mounted, run_cli, tree

pytestmark = pytest.mark.fuse
# Session servers and the proxy factory (fixtures live in s3util: conftest.py is shared).
s3_credentials = s3util.s3_credentials
moto_s3 = s3util.moto_s3
localbucket_s3 = s3util.localbucket_s3
proxy_to = s3util.proxy_to
MiB = 1 << 20


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _tree_zip(tmp_path: Path, name: str = "tree.zip", seed: int = 1) -> Path:
    src = write_tree(
        tmp_path / f"src-{name}",
        {**sample_files(seed), "big/stored.bin": random.Random(seed).randbytes(3 * MiB)},
        symlinks={"data/link_to_csv": "nested/deep/file.csv"},
        empty_dirs=("empty_dir",),
    )
    os.chmod(src / "one_byte", 0o755)
    return infozip(tmp_path / name, src, level=6, extra=("-n", ".bin"))  # .bin members stored


def test_s3_mount_equals_local_mount(moto_s3, tmp_path: Path) -> None:
    archive = _tree_zip(tmp_path)
    moto_s3.put("mnt", "data/tree.zip", archive)
    log = tmp_path / "s3.log"
    with mounted(archive, tmp_path / "local") as local:
        expected = tree(local)
    with mounted(
        "s3://mnt/data/tree.zip", tmp_path / "s3", "--endpoint-url", moto_s3.url, log_file=log
    ) as mnt:
        got = tree(mnt)
    assert got == expected
    assert "multithreaded" in log.read_text()


def test_large_member_over_localbucket_mount(localbucket_s3, tmp_path: Path) -> None:
    data = random.Random(2).randbytes(48 * MiB)
    archive = tmp_path / "large.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("a/small.txt", b"small")
        zf.writestr("a/large.bin", data)
    localbucket_s3.put("mnt", "large.zip", archive)
    with mounted("s3://mnt/large.zip", tmp_path / "m", "--endpoint-url", localbucket_s3.url) as mnt:
        digest = hashlib.sha256()
        with open(mnt / "a/large.bin", "rb") as f:
            while chunk := f.read(1 * MiB):
                digest.update(chunk)
        assert digest.digest() == hashlib.sha256(data).digest()
        with open(mnt / "a/large.bin", "rb") as f:  # random access too
            for off in random.Random(3).sample(range(len(data) - 10_000), 20):
                f.seek(off)
                assert f.read(10_000) == data[off : off + 10_000]


def test_object_replaced_while_mounted_gives_eio_and_the_daemon_stays_up(moto_s3, tmp_path: Path) -> None:
    old = tmp_path / "old.zip"
    new = tmp_path / "new.zip"
    for path, seed in ((old, 1), (new, 2)):
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr("small.txt", f"version {seed}".encode())
            zf.writestr("big.bin", random.Random(seed).randbytes(4 * MiB))
    assert old.stat().st_size == new.stat().st_size
    moto_s3.put("mnt", "replaced.zip", old)
    log = tmp_path / "replaced.log"
    with mounted("s3://mnt/replaced.zip", tmp_path / "m", "--endpoint-url", moto_s3.url, log_file=log) as mnt:
        pid = daemon_pid(mnt)
        assert (mnt / "small.txt").read_bytes() == b"version 1"
        moto_s3.put("mnt", "replaced.zip", new)
        with pytest.raises(OSError) as info, open(mnt / "big.bin", "rb") as f:
            f.read()
        assert info.value.errno == errno.EIO
        assert _alive(pid)
        assert sorted(os.listdir(mnt)) == ["big.bin", "small.txt"]
        assert (mnt / "small.txt").read_bytes() == b"version 1"  # never bytes of the new version
    assert "changed after it was opened" in log.read_text()


def test_network_errors_give_eio_with_a_log_line_then_reads_recover(
    moto_s3, proxy_to, tmp_path: Path
) -> None:
    archive = _tree_zip(tmp_path, "faults.zip", seed=3)
    moto_s3.put("mnt", "faults.zip", archive)
    proxy = proxy_to(moto_s3)
    log = tmp_path / "faults.log"
    expected = (tmp_path / "src-faults.zip" / "big/stored.bin").read_bytes()
    with mounted("s3://mnt/faults.zip", tmp_path / "m", "--endpoint-url", proxy.url, log_file=log) as mnt:
        pid = daemon_pid(mnt)
        proxy.inject("403", 100)  # not retryable: the read fails at once
        with pytest.raises(OSError) as info:
            (mnt / "big/stored.bin").read_bytes()
        assert info.value.errno == errno.EIO
        assert _alive(pid)
        proxy.clear()
        proxy.inject("503", 3)  # retryable: invisible to the reader
        with open(mnt / "big/stored.bin", "rb") as f:  # a fresh open: the page cache holds no error
            assert f.read() == expected
    text = log.read_text()
    assert "access denied" in text


def test_credentials_never_reach_logs_even_verbose(moto_s3, tmp_path: Path, monkeypatch) -> None:
    secrets = {
        "AWS_ACCESS_KEY_ID": "AKIAUNIQUEKEYID4TEST",
        "AWS_SECRET_ACCESS_KEY": "uniqueSecretValue/For+cdmlfs+Tests0123456",
        "AWS_SESSION_TOKEN": "uniqueSessionTokenValueForCdmlfsTests",
    }
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    archive = _tree_zip(tmp_path, "creds.zip", seed=4)
    moto_s3.put("mnt", "creds.zip", archive)
    log = tmp_path / "creds.log"
    uri = "s3://mnt/creds.zip"
    with mounted(uri, tmp_path / "m", "-v", "--endpoint-url", moto_s3.url, log_file=log) as mnt:
        (mnt / "big/stored.bin").read_bytes()
        (mnt / "readme.txt").read_bytes()
    outputs = [log.read_text()]
    for args in (("ls", "-v", "-l", uri), ("cat", "-v", uri, "readme.txt")):
        res = run_cli(*args, "--endpoint-url", moto_s3.url)
        assert res.returncode == 0, res.stderr.decode()
        outputs.append(res.stderr.decode(errors="replace"))
    assert " DEBUG " in outputs[0]  # verbose logging was on (the SDK would log signed headers at DEBUG)
    for text in outputs:
        for value in secrets.values():
            assert value not in text


def test_cli_ls_cat_extract_accept_s3_uris(moto_s3, tmp_path: Path) -> None:
    archive = _tree_zip(tmp_path, "cli.zip", seed=5)
    moto_s3.put("mnt", "cli.zip", archive)
    uri = "s3://mnt/cli.zip"
    ep = ("--endpoint-url", moto_s3.url)
    local = run_cli("ls", "-R", str(archive), check=True).stdout
    assert run_cli("ls", "-R", uri, *ep, check=True).stdout == local
    src = tmp_path / "src-cli.zip"
    assert run_cli("cat", uri, "readme.txt", *ep, check=True).stdout == (src / "readme.txt").read_bytes()
    out = tmp_path / "out"
    run_cli("extract", uri, "data", "-C", str(out), *ep, check=True)
    assert (out / "data/random.bin").read_bytes() == (src / "data/random.bin").read_bytes()
    res = run_cli("ls", "s3://mnt/missing.zip", *ep)
    assert res.returncode == 2 and b"no such object" in res.stderr and len(res.stderr.splitlines()) == 1


def test_torchvision_imagefolder_over_s3_mount_equals_local(moto_s3, tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    pytest.importorskip("torchvision")
    from torchvision.datasets import ImageFolder

    from cdmlfs_torch.synthetic import make_image_tree, zip_tree

    src = tmp_path / "images"
    make_image_tree(src, classes=3, per_class=8, min_side=20, max_side=60, seed=7)
    archive = zip_tree(src, tmp_path / "images.zip", zipfile.ZIP_STORED, shuffle_seed=1)
    moto_s3.put("mnt", "images.zip", archive)
    with (
        mounted(archive, tmp_path / "local") as local,
        mounted("s3://mnt/images.zip", tmp_path / "s3", "--endpoint-url", moto_s3.url) as remote,
    ):
        a, b = ImageFolder(str(local)), ImageFolder(str(remote))
        assert a.classes == b.classes and a.class_to_idx == b.class_to_idx
        assert [(os.path.relpath(p, local), t) for p, t in a.samples] == [
            (os.path.relpath(p, remote), t) for p, t in b.samples
        ]
        for i in range(len(a)):
            (ia, ta), (ib, tb) = a[i], b[i]
            assert ta == tb
            assert np.array_equal(np.asarray(ia), np.asarray(ib))
