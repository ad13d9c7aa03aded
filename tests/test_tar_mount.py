"""Real FUSE mounts of tar / tar.zst archives made by GNU tar, zstd, pzstd and cdmlfs pack,
compared with what ``tar -x`` extracts."""

from __future__ import annotations

import errno
import io
import os
import struct
import subprocess
import tarfile
from pathlib import Path

import pytest
import zstandard
from mountutil import daemon_pid, is_mounted, mount_stats, mounted, run_cli, tree
from test_tar_support import LONG_TARGET, cdmlfs_pack, extract, gnu_tar, tricky_tree

from cdmlfs.archive import Archive
from cdmlfs.zstd_seekable import read_seek_table

pytestmark = pytest.mark.fuse


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tricky_tree(tmp_path_factory.mktemp("tar") / "src")


def _build(kind: str, src: Path, out_dir: Path) -> Path:
    if kind == "gnu-zstd-single-frame":
        return gnu_tar(out_dir / "gnu.tar.zst", src, "gnu", ["zstd", "-q", "-c"])
    if kind == "pax-pzstd-multi-frame":
        return gnu_tar(out_dir / "pax.tar.zst", src, "pax", ["pzstd", "-q", "-c", "-1", "-p", "2"])
    if kind == "pax-plain-tar":
        return gnu_tar(out_dir / "plain.tar", src, "pax")
    if kind == "gnu-plain-tar":
        return gnu_tar(out_dir / "plain-gnu.tar", src, "gnu")
    if kind == "zstd-T0-with-content-size":
        plain = gnu_tar(out_dir / "for-zstd.tar", src, "pax")
        out = out_dir / "t0.tar.zst"
        subprocess.run(["zstd", "-q", "-T0", "-f", str(plain), "-o", str(out)], check=True)
        return out
    assert kind == "cdmlfs-pack"
    return cdmlfs_pack(src, out_dir / "packed.tar.zst", "--frame-size", "1M")


@pytest.mark.parametrize(
    "kind",
    [
        "gnu-zstd-single-frame",
        "pax-pzstd-multi-frame",
        "pax-plain-tar",
        "gnu-plain-tar",
        "zstd-T0-with-content-size",
        "cdmlfs-pack",
    ],
)
def test_mount_equals_tar_extraction(kind: str, src: Path, tmp_path: Path, mnt: Path) -> None:
    archive = _build(kind, src, tmp_path)
    expected = tree(extract(archive, tmp_path / "extracted"))
    with mounted(archive, mnt, "--index-dir", str(tmp_path / "idx")):
        got = tree(mnt)
        # Hard links: one inode, st_nlink counts every name.
        a, b, c = (os.stat(mnt / p) for p in ("hardlink_a", "data/hardlink_b", "many/f001.txt"))
        assert a.st_ino == b.st_ino == c.st_ino
        assert a.st_nlink == 3
        assert os.readlink(mnt / "long_target_link") == LONG_TARGET
        assert (mnt / "link_to_random").read_bytes() == (src / "data/random.bin").read_bytes()
    assert sorted(got) == sorted(expected)
    for path, exp in expected.items():
        assert got[path][0] == exp[0], path
        assert got[path] == exp, path


def test_packed_archive_round_trips_through_gnu_tar_and_zstd(src: Path, tmp_path: Path) -> None:
    packed = cdmlfs_pack(src, tmp_path / "p.tar.zst", "--frame-size", "256K")
    plain = cdmlfs_pack(src, tmp_path / "p.tar")
    # zstd -d skips the member-index frame and the seek table: the same tar stream comes out.
    out = os.popen(f"zstd -dc {packed} | cmp - {plain} && echo same").read()
    assert out.strip() == "same"
    got = tree(extract(packed, tmp_path / "x"), dir_mtime=True)
    expected = tree(src, dir_mtime=False)
    assert sorted(got) == sorted(expected)
    for path, exp in expected.items():
        assert got[path][:4] == exp[:4], path
        if exp[0] == "file":
            assert got[path][4] == exp[4], path  # whole-second mtimes, big one included
    # Every data frame records its content size; the seek table lists the index frame too.
    with Archive(str(packed), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.format.index_source == "embedded"
        frames = read_seek_table(ar.source)
        assert frames is not None and frames[-1].content_size == 0
        assert all(f <= 256 << 10 for f in ar.format.stream.frames.dec_size)


def _frame_of(archive: Path, member: str, idx: Path) -> tuple[int, int, int]:
    """(compressed offset, compressed size, frame number) of the frame holding ``member``'s first byte."""
    with Archive(str(archive), index_dir=str(idx)) as ar:
        fr = ar.format.stream.frames
        off = ar.index.offset[ar.index.lookup(member)]
        i = max(j for j in range(len(fr)) if fr.dec_offset[j] <= off)
        return fr.comp_offset[i], fr.comp_size[i], i


def test_corrupt_frame_gives_eio_on_affected_files_only(tmp_path: Path, mnt: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(60):
        (src / f"f{i:02d}.bin").write_bytes(os.urandom(20_000) + bytes(20_000))
    archive = cdmlfs_pack(src, tmp_path / "c.tar.zst", "--frame-size", "128K")
    idx = tmp_path / "idx"
    comp_off, comp_size, frame = _frame_of(archive, "f30.bin", idx)
    with Archive(str(archive), index_dir=str(idx)) as ar:
        fr = ar.format.stream.frames
        lo, hi = fr.dec_offset[frame], fr.dec_offset[frame] + fr.dec_size[frame]
        affected = {
            p
            for p in ar.files()
            if ar.index.offset[ar.index.lookup(p)] < hi
            and ar.index.offset[ar.index.lookup(p)] + ar.index.size[ar.index.lookup(p)] > lo
        }
    assert "f30.bin" in affected and len(affected) < 10
    with open(archive, "r+b") as f:  # flip bytes inside the frame's compressed blocks
        f.seek(comp_off + comp_size // 2)
        chunk = bytearray(f.read(16))
        f.seek(comp_off + comp_size // 2)
        f.write(bytes(b ^ 0x5A for b in chunk))
    with mounted(archive, mnt, "--index-dir", str(idx)):
        pid = daemon_pid(mnt)
        for i in range(60):
            name = f"f{i:02d}.bin"
            if name in affected:
                with pytest.raises(OSError) as exc:
                    (mnt / name).read_bytes()
                assert exc.value.errno == errno.EIO
            else:
                assert (mnt / name).read_bytes() == (src / name).read_bytes()
        assert is_mounted(mnt)
        assert pid is not None
        os.kill(pid, 0)  # the daemon is alive


def test_single_frame_archive_larger_than_the_cache_budget(tmp_path: Path, mnt: Path) -> None:
    """One 6 MB frame under a 16M cache (4 MiB per decode): served in pieces, forward and backward."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"f{i:02d}.bin").write_bytes(os.urandom(300_000))
    archive = gnu_tar(tmp_path / "one.tar.zst", src, "gnu", ["zstd", "-q", "-c"])
    with mounted(archive, mnt, "--cache-size", "16M", "--index-dir", str(tmp_path / "idx")):
        for order in (range(20), reversed(range(20))):
            for i in order:
                assert (mnt / f"f{i:02d}.bin").read_bytes() == (src / f"f{i:02d}.bin").read_bytes()


def test_mount_refuses_a_zstd_window_the_cache_cannot_bound(tmp_path: Path, mnt: Path) -> None:
    """A tar.zst written with zstd --long=27 needs a 128 MiB decoder window beside the cache: with
    --cache-size 16M the daemon peaked at 160 MiB. The mount is refused in one line naming the
    cache that takes it, and leaves no mount; with that cache it mounts and reads."""
    data = os.urandom(12 << 20)  # fills 12 MiB of its window (a quarter of 16M is 4)
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(data)
    archive = gnu_tar(tmp_path / "long.tar.zst", src, "gnu", ["zstd", "-q", "--long=27", "-c"])
    idx = ("--index-dir", str(tmp_path / "idx"))
    res = run_cli("mount", str(archive), str(mnt), "--cache-size", "16M", *idx)
    err = res.stderr.decode().strip()
    assert res.returncode == 1 and len(err.splitlines()) == 1, err
    assert "128 MiB decoding window" in err and "--cache-size 512M" in err and "Traceback" not in err
    assert not is_mounted(mnt)
    with mounted(archive, mnt, "--cache-size", "512M", *idx):
        assert (mnt / "big.bin").read_bytes() == data


def test_mount_refuses_non_tar_zstd(tmp_path: Path, mnt: Path) -> None:
    blob = tmp_path / "notatar.zst"
    blob.write_bytes(zstandard.ZstdCompressor().compress(os.urandom(100_000)))
    res = run_cli("mount", str(blob), str(mnt), "--index-dir", str(tmp_path / "idx"))
    assert res.returncode == 1
    assert b"not a tar" in res.stderr
    assert not is_mounted(mnt)


def test_inconsistent_seek_table_is_not_trusted(tmp_path: Path) -> None:
    """A seekable footer whose table does not add up is ignored: frames are found by their headers."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a" * 1000)
    archive = cdmlfs_pack(src, tmp_path / "a.tar.zst")
    data = bytearray(archive.read_bytes())
    (n,) = struct.unpack_from("<I", data, len(data) - 9)
    struct.pack_into("<I", data, len(data) - 9, n + 5)
    archive.write_bytes(bytes(data))
    res = run_cli("cat", str(archive), "a.txt", "--index-dir", str(tmp_path / "idx"))
    assert res.returncode == 0, res.stderr
    assert res.stdout == b"a" * 1000
    assert b"seek table" in res.stderr


@pytest.mark.fuse
def test_syscalls_answer_as_a_read_only_local_tree_does(tmp_path: Path, mnt: Path) -> None:
    """From a syscall-by-syscall comparison with a read-only ext4 copy: a tar's own "./" entry dates
    the root; symlinks show mode 0777 whatever was stored; an over-long name is ENAMETOOLONG, not
    ENOENT; a symlink with an empty target (no file system holds one, tar -x fails on it) is
    skipped, not a loop to "." (then listed, and EIO on readlink);
    there are no extended attributes (none listed for cp -a or tar --xattrs to copy)."""
    import io
    import tarfile

    path = tmp_path / "odd.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        root = tarfile.TarInfo("./")
        root.type, root.mode, root.mtime = tarfile.DIRTYPE, 0o700, 1_000_000_000
        tf.addfile(root)
        data = tarfile.TarInfo("d/f.txt")
        data.size, data.mtime = 2, 1_500_000_000
        tf.addfile(data, io.BytesIO(b"hi"))
        for name, target in (("d/link", "f.txt"), ("d/empty", "")):
            link = tarfile.TarInfo(name)
            link.type, link.linkname, link.mode = tarfile.SYMTYPE, target, 0o644
            tf.addfile(link)
    climbing = tmp_path / "climbing.tar"  # "../" is no "./": GNU tar refuses it; it must not date the root
    with tarfile.open(climbing, "w", format=tarfile.GNU_FORMAT) as tf:
        up = tarfile.TarInfo("x/../")
        up.type, up.mode = tarfile.DIRTYPE, 0
        tf.addfile(up)
    with Archive(str(climbing), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.stat("").mode & 0o7777 == 0o755
    with mounted(path, mnt, "--index-dir", str(tmp_path / "idx")):
        st = os.stat(mnt)
        assert st.st_mode & 0o7777 == 0o700 and st.st_mtime == 1_000_000_000
        assert os.lstat(mnt / "d" / "link").st_mode & 0o7777 == 0o777
        assert (mnt / "d" / "link").read_bytes() == b"hi"
        with pytest.raises(OSError) as exc:
            os.stat(mnt / ("x" * 300))
        assert exc.value.errno == errno.ENAMETOOLONG
        assert sorted(os.listdir(mnt / "d")) == ["f.txt", "link"]
        with pytest.raises(FileNotFoundError):
            os.lstat(mnt / "d" / "empty")
        assert os.listxattr(mnt) == []
        assert mount_stats(mnt)["format"] == "tar"  # the stats travel by ioctl


def _sparse_tree(root: Path) -> Path:
    """Files with holes: many data segments (old GNU headers need extension blocks past 4), one
    that is all hole, one that ends in data, and a hard link to a sparse file."""
    root.mkdir()
    with open(root / "many.bin", "wb") as f:
        for i in range(50):  # 50 segments of 4 KiB, 64 KiB apart
            f.seek(i * 65536)
            f.write(bytes([i + 1]) * 4096)
        f.truncate(50 * 65536 + 12345)
    with open(root / "hole.bin", "wb") as f:
        f.truncate(3 << 20)
    with open(root / "tail.bin", "wb") as f:
        f.seek(1 << 20)
        f.write(b"tail" * 3000)
    (root / "plain.txt").write_bytes(b"not sparse\n")
    os.link(root / "many.bin", root / "many-link.bin")
    return root


@pytest.mark.parametrize(
    "how",
    ["gnu", "oldgnu", "posix-0.0", "posix-0.1", "posix-1.0", "posix-1.0-zstd", "bsdtar-pax"],
)
def test_sparse_members_read_as_tar_extracts_them(how: str, tmp_path: Path, mnt: Path) -> None:
    src = _sparse_tree(tmp_path / "src")
    archive = tmp_path / ("s.tar.zst" if how.endswith("zstd") else "s.tar")
    if how.startswith("bsdtar"):
        # libarchive-tools, installed by scripts/setup.sh: a missing producer fails, never skips
        subprocess.run(["bsdtar", "--format=pax", "-C", str(src), "-cf", str(archive), "."], check=True)
        data = archive.read_bytes()
    else:
        fmt, _, version = how.removesuffix("-zstd").partition("-")
        cmd = ["tar", "--sparse", f"--format={fmt}", "-C", str(src), "-cf", "-", "."]
        if version:
            cmd.insert(2, f"--sparse-version={version}")
        data = subprocess.run(cmd, check=True, capture_output=True).stdout
        packed = data
        if how.endswith("zstd"):
            packed = subprocess.run(["zstd", "-q", "-c"], input=data, check=True, capture_output=True).stdout
        archive.write_bytes(packed)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:  # the tool really wrote sparse members
        assert sum(1 for m in tf if m.sparse) >= 3, how
    expected = tree(extract(archive, tmp_path / "extracted"))
    for _ in range(2):  # the second mount reads the persisted index
        with mounted(archive, mnt, "--index-dir", str(tmp_path / "idx")):
            assert tree(mnt) == expected
            many = (src / "many.bin").read_bytes()
            with open(mnt / "many.bin", "rb", buffering=0) as f:  # reads across segments and holes
                for offset, size in (
                    (4000, 200),
                    (65536 * 7 - 10, 4200),
                    (100, 65536 * 3),
                    (len(many) - 50, 99),
                ):
                    f.seek(offset)
                    assert f.read(size) == many[offset : offset + size], (offset, size)
            assert os.stat(mnt / "many.bin").st_ino == os.stat(mnt / "many-link.bin").st_ino
            # du counts the data segments only (it counted every byte), and cp --sparse=auto sees holes
            assert os.stat(mnt / "many.bin").st_blocks == 50 * 4096 // 512
            assert os.stat(mnt / "hole.bin").st_blocks == 0
            assert os.stat(mnt / "plain.txt").st_blocks == 1
    # cdmlfs pack writes them out whole (holes as zeros): tar -x of the result gives the same files.
    packed = cdmlfs_pack(archive, tmp_path / "packed.tar.zst")
    assert tree(extract(packed, tmp_path / "from-packed")) == expected


def test_cdmlfs_extract_leaves_the_holes_of_sparse_members(tmp_path: Path) -> None:
    """As tar -x: a sparse member extracts to a sparse file (a 1 MiB hole took 2,048 blocks; a disk
    image of mostly holes could fill the disk it was extracted to)."""
    src = _sparse_tree(tmp_path / "src")
    archive = tmp_path / "s.tar"
    subprocess.run(["tar", "--sparse", "--format=gnu", "-C", str(src), "-cf", str(archive), "."], check=True)
    res = run_cli(
        "extract", "--index-dir", str(tmp_path / "idx"), str(archive), "", "-C", str(tmp_path / "out")
    )
    assert res.returncode == 0, res.stderr.decode()
    out = tmp_path / "out"
    assert tree(out) == tree(extract(archive, tmp_path / "ref"))
    assert os.stat(out / "hole.bin").st_size == 3 << 20 and os.stat(out / "hole.bin").st_blocks == 0
    assert os.stat(out / "many.bin").st_blocks <= 2 * 50 * 4096 // 512  # its 50 data blocks, not every byte
    assert os.stat(out / "plain.txt").st_blocks > 0


def test_extracting_a_folder_makes_hard_links_again(src: Path, tmp_path: Path) -> None:
    """As tar -x does: the names of one file in the archive share one inode once extracted."""
    archive = gnu_tar(tmp_path / "h.tar", src, "gnu")
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        out = Path(ar.extract("", str(tmp_path / "out")))
    a, b, c = (os.stat(out / p) for p in ("hardlink_a", "data/hardlink_b", "many/f001.txt"))
    assert a.st_ino == b.st_ino == c.st_ino and a.st_nlink == 3
    assert (out / "hardlink_a").read_bytes() == (src / "hardlink_a").read_bytes()
    reference = tree(extract(archive, tmp_path / "ref"))
    assert tree(out) == reference


def test_a_walk_in_listing_order_is_one_pass_over_a_single_frame(tmp_path: Path, mnt: Path) -> None:
    """Directories list their entries in archive order, so find, grep -r, rsync or os.walk + read
    go forward through a single-frame tar.zst once. In name order a walk went back and forth and
    decoded the frame about 30 times (a tar made from a directory holds its readdir order)."""
    from archives import text_bytes

    src = tmp_path / "src"
    order = []
    for d in ("d2", "d0", "d1"):
        (src / d).mkdir(parents=True)
        for i in reversed(range(40)):
            (src / d / f"f{i:02d}.txt").write_bytes(text_bytes(400_000, i + 100 * int(d[1])))
            order.append(f"{d}/f{i:02d}.txt")
    archive = tmp_path / "one.tar.zst"
    with open(archive, "wb") as out:  # 48 MB in one frame, members in the order given
        tar = subprocess.Popen(["tar", "-C", str(src), "-cf", "-", *order], stdout=subprocess.PIPE)
        subprocess.run(["zstd", "-1", "-q", "-c"], stdin=tar.stdout, stdout=out, check=True)
        assert tar.wait() == 0
    with mounted(archive, mnt, "--cache-size", "16M", "--index-dir", str(tmp_path / "idx")):
        assert os.listdir(mnt) == ["d2", "d0", "d1"]
        assert os.listdir(mnt / "d0") == [f"f{i:02d}.txt" for i in reversed(range(40))]
        seen = 0
        for root, _, names in os.walk(mnt):
            for name in names:
                path = Path(root) / name
                assert path.read_bytes() == (src / path.relative_to(mnt)).read_bytes()
                seen += 1
        assert seen == len(order)
        decoder = mount_stats(mnt)["decoder"]
        assert decoder["forward_restarts"] == 1, decoder
        # The daemon decodes the next piece ahead of a reader in archive order (one reader:
        # 91-178 -> 215-293 MB/s in the module's notes), and that restarts nothing.
        assert decoder["prefetched"] > 0, decoder


def test_a_truncated_tar_mounts_and_its_daemon_log_says_so(tmp_path: Path, mnt: Path) -> None:
    """The mount command warns on its terminal; the daemon repeats it in its log, where a user
    looks when files seem to be missing later (the terminal may be gone by then)."""
    whole = tmp_path / "whole.tar"
    with tarfile.open(whole, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in (("kept.txt", b"k" * 600), ("lost.txt", b"lost")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    data = whole.read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: data.index(b"lost.txt\0")])  # cut at the second header
    log_file = tmp_path / "daemon.log"
    with mounted(cut, mnt, "--index-dir", str(tmp_path / "idx"), log_file=log_file) as m:
        assert sorted(os.listdir(m)) == ["kept.txt"]
        assert (m / "kept.txt").read_bytes() == b"k" * 600
    log = log_file.read_text()
    assert "when opened:" in log and "cut.tar" in log and "end-of-archive blocks" in log, log


def test_a_hard_link_to_a_symlink_shares_its_inode_on_the_mount(tmp_path: Path, mnt: Path) -> None:
    """GNU tar stores a hard-linked symlink as a link to it; tar -x links the symlink itself (one
    inode, two names). The mount gave the second name an inode of its own with st_nlink 1."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "target.txt").write_bytes(b"t\n")
    os.symlink("target.txt", src / "sym")
    os.link(src / "sym", src / "sym_hard", follow_symlinks=False)
    archive = gnu_tar(tmp_path / "s.tar", src, "gnu")
    ref = extract(archive, tmp_path / "ref")
    r1, r2 = (os.lstat(ref / n) for n in ("sym", "sym_hard"))
    assert r1.st_ino == r2.st_ino and r1.st_nlink == 2  # what tar -x gives
    with mounted(archive, mnt, "--index-dir", str(tmp_path / "idx")):
        m1, m2 = (os.lstat(mnt / n) for n in ("sym", "sym_hard"))
        assert m1.st_ino == m2.st_ino and m1.st_nlink == m2.st_nlink == 2
        assert os.readlink(mnt / "sym_hard") == "target.txt"
        assert (mnt / "sym_hard").read_bytes() == b"t\n"
        assert tree(mnt) == tree(ref)
