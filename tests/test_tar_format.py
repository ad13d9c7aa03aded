"""tar / tar.zst through the Python API: index persistence, frame handling, edge-case headers."""

from __future__ import annotations

import io
import itertools
import logging
import os
import random
import shutil
import struct
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
import zlib
from pathlib import Path

import pytest
import zstandard
from archives import text_bytes
from mountutil import mounted, run_cli
from test_tar_support import cdmlfs_pack, gnu_tar

from cdmlfs.archive import Archive
from cdmlfs.errors import ArchiveFormatError, CorruptMemberError, SourceError, UsageError, WindowLimitError
from cdmlfs.formats import SNIFF_BYTES, TAIL_BYTES
from cdmlfs.formats.tar import scan_tar
from cdmlfs.formats.tarheader import build_block, build_header, parse_header, parse_pax, pax_record
from cdmlfs.formats.tarmembers import MemberTable, MemberTableError
from cdmlfs.formats.zstdstream import ZstdScanView
from cdmlfs.index import FILE
from cdmlfs.index_store import IndexStore, default_index_dir
from cdmlfs.sources.local import LocalFile
from cdmlfs.zstd_seekable import (
    FOOTER_SIZE,
    SEEK_TABLE_MAGIC,
    SEEKABLE_FOOTER_MAGIC,
    read_seek_table,
    skippable_frame,
    walk_frames,
)


class CountingSource:
    """A local file that counts the bytes read through it (proves what an open costs)."""

    prefers_threads = False

    def __init__(self, path: Path) -> None:
        self._inner = LocalFile(str(path))
        self.size = self._inner.size
        self.identity = self._inner.identity
        self.bytes_read = 0

    def read_at(self, offset: int, length: int) -> bytes:
        self.bytes_read += length
        return self._inner.read_at(offset, length)

    def fileno(self) -> None:
        return None

    def close(self) -> None:
        self._inner.close()


@pytest.fixture
def many_files(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(200):
        (src / f"d{i % 7}").mkdir(exist_ok=True)
        (src / f"d{i % 7}" / f"f{i:03d}.bin").write_bytes(os.urandom(2000) + bytes(8000))
    return src


def _tar_bytes(members: dict[str, bytes]) -> bytes:
    """A GNU tar of ``members`` (name -> bytes), in memory."""
    with io.BytesIO() as buf:
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        return buf.getvalue()


def _members_by_piece(ar: Archive) -> dict[int, list[str]]:
    """Members lying inside one piece of a large frame, by piece number, in archive order."""
    ix, piece = ar.index, ar.format.stream.piece
    out: dict[int, list[str]] = {}
    for name in ar.archive_order():
        eid = ix.lookup(name)
        if ix.offset[eid] // piece == (ix.offset[eid] + ix.size[eid] - 1) // piece:
            out.setdefault(ix.offset[eid] // piece, []).append(name)
    return out


def _single_frame(tmp_path: Path, src: Path) -> Path:
    return gnu_tar(tmp_path / "single.tar.zst", src, "gnu", ["zstd", "-q", "-c"])


# -- persisted index ------------------------------------------------------------------------
def test_index_is_persisted_and_a_second_open_does_not_rescan(tmp_path: Path, many_files: Path) -> None:
    archive = _single_frame(tmp_path, many_files)
    idx = tmp_path / "idx"
    first = CountingSource(archive)
    with Archive(first, index_dir=str(idx)) as ar:
        assert ar.format.index_source == "scan"
        names = ar.files()
    assert first.bytes_read >= archive.stat().st_size  # the scan decoded everything once
    assert len(list(idx.glob("*.idx"))) == 1
    second = CountingSource(archive)
    with Archive(second, index_dir=str(idx)) as ar:
        assert ar.format.index_source == "cache"
        # Opening read only what format sniffing reads (4 KiB head, 64 KiB tail): no rescan.
        assert second.bytes_read <= SNIFF_BYTES + TAIL_BYTES + 64
        assert ar.files() == names
        assert ar.read(names[5]) == (many_files / names[5]).read_bytes()


@pytest.mark.parametrize("compress", [["zstd", "-q", "-c"], ["pzstd", "-q", "-c", "-1", "-p", "2"]])
def test_first_open_of_a_foreign_tar_zst_reads_it_once(tmp_path: Path, compress: list[str]) -> None:
    """Frames are located as the scan decodes them: walking the file first read it twice (twice
    the download from S3 once the archive outgrows the cache)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i:02d}.bin").write_bytes(os.urandom(60_000 + 997 * i))  # ~3.2 MB: several 1 MiB windows
    archive = gnu_tar(tmp_path / "a.tar.zst", src, "gnu", compress)
    size = archive.stat().st_size
    counted = CountingSource(archive)
    with Archive(counted, index_dir=str(tmp_path / "idx")) as ar:
        assert ar.format.index_source == "scan"
        # The scan, plus format sniffing and the look for a seek table.
        assert counted.bytes_read <= size + SNIFF_BYTES + TAIL_BYTES + FOOTER_SIZE
        assert sorted(ar.files()) == sorted(f"f{i:02d}.bin" for i in range(40))
        for name in ar.files()[::7]:
            assert ar.read(name) == (src / name).read_bytes()


def test_scan_memory_stays_bounded_when_it_skips_the_rest_of_a_frame(tmp_path: Path) -> None:
    """Frames with content sizes (``zstd FILE`` writes them) and a member crossing into the next
    frame: the scan leaves the first frame part-decoded and hops over the rest of it. That hop kept
    every byte it passed (the bytes not yet handed to the decoder were held across refills)."""
    import tracemalloc

    plain = _tar_bytes({"a.txt": b"a", "big.bin": os.urandom(32 << 20), "z.txt": b"z"})
    cut = len(plain) // 2
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    archive = tmp_path / "two.tar.zst"
    archive.write_bytes(cctx.compress(plain[:cut]) + cctx.compress(plain[cut:]))
    tracemalloc.start()
    try:
        with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
            _, peak = tracemalloc.get_traced_memory()
            assert sorted(ar.files()) == ["a.txt", "big.bin", "z.txt"]
            assert ar.read("z.txt") == b"z"
    finally:
        tracemalloc.stop()
    assert peak < 12 << 20, peak  # a few 1 MiB buffers, not the 16 MiB left of the first frame


def test_zstd_files_that_hold_no_tar_say_so(tmp_path: Path) -> None:
    only_skippable = skippable_frame(b"x" * 100) + skippable_frame(b"y")
    not_tar = zstandard.ZstdCompressor().compress(b"just some text, no tar header\n" * 40)
    for data, message in ((only_skippable, "holds no data frames"), (not_tar, "not a tar archive")):
        path = tmp_path / "f.tar.zst"
        path.write_bytes(data)
        with pytest.raises(ArchiveFormatError, match=message):
            Archive(str(path), index_dir=str(tmp_path / "idx"))


def test_stale_and_corrupt_index_files_are_rebuilt(
    tmp_path: Path, many_files: Path, caplog: pytest.LogCaptureFixture
) -> None:
    archive = _single_frame(tmp_path, many_files)
    idx = tmp_path / "idx"
    with Archive(str(archive), index_dir=str(idx)) as ar:
        assert ar.format.index_source == "scan"
    (index_file,) = idx.glob("*.idx")  # beside it, a lock file for builders
    good = index_file.read_bytes()
    # Corrupt in several ways: each is detected, rebuilt, and the rebuilt file is valid again.
    for damage in (
        lambda b: b[: len(b) // 2],
        lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:],
        lambda b: b"garbage",
        lambda b: b[:8] + struct.pack("<H", 99) + b[10:],
    ):
        index_file.write_bytes(damage(good))
        with Archive(str(archive), index_dir=str(idx)) as ar:
            assert ar.format.index_source == "scan"
            assert len(ar.files()) == 200
        assert index_file.read_bytes() == good
    # Stale: the archive changed (same path, new mtime) -> rescanned, file replaced in place.
    st = archive.stat()
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    caplog.clear()
    with caplog.at_level("INFO", logger="cdmlfs"), Archive(str(archive), index_dir=str(idx)) as ar:
        assert ar.format.index_source == "scan"
    assert caplog.text.count("ignoring index file") == 1, caplog.text  # once, not again after the lock
    assert [p.name for p in idx.glob("*.idx")] == [index_file.name]
    with Archive(str(archive), index_dir=str(idx)) as ar:
        assert ar.format.index_source == "cache"


@pytest.mark.parametrize("how", ["replaced", "rewritten in place"])
def test_an_index_is_not_trusted_for_other_bytes_with_the_same_size_and_mtime(
    how: str, tmp_path: Path
) -> None:
    """Same path, same size, mtime put back (touch -r): a persisted index served y's bytes as x.
    The identity also holds the inode (a replaced file) and the ctime (written in place)."""
    archive = tmp_path / "w.tar"

    def write(order: list[str], path: Path) -> None:
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
            for name in order:
                info = tarfile.TarInfo(name)
                info.size = 5
                tf.addfile(info, io.BytesIO(name[0].upper().encode() * 5))

    write(["x.txt", "y.txt"], archive)
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.read("x.txt") == b"XXXXX"
    st = archive.stat()
    other = tmp_path / "other.tar"
    write(["y.txt", "x.txt"], other)
    assert other.stat().st_size == st.st_size
    if how == "replaced":
        other.replace(archive)
    else:
        archive.write_bytes(other.read_bytes())
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns))
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.format.index_source == "scan"
        assert ar.read("x.txt") == b"XXXXX"


@pytest.mark.fuse
def test_an_index_is_not_trusted_for_another_tar_whose_stat_matches_in_every_field(
    tmp_path: Path, mnt: Path
) -> None:
    """A tar inside a mounted zip: FUSE mounts (cdmlfs's own, sshfs) report ctime = mtime and
    number inodes in order, so another zip of the same layout mounted there showed the same size,
    mtime, inode and ctime, and its tar was read through the first one's saved index (a.txt
    served as 1,000 bytes of the 3,000 it holds, no error). The key holds a hash of some bytes."""

    def tar_of(members: list[tuple[str, bytes]]) -> bytes:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tf:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 1_700_000_000
                tf.addfile(info, io.BytesIO(data))
        return raw.getvalue()

    versions = [
        tar_of([("a.txt", b"A" * 1000), ("b.txt", b"B" * 3000)]),
        tar_of([("a.txt", b"C" * 3000), ("b.txt", b"D" * 1000)]),
    ]
    assert len(versions[0]) == len(versions[1])
    idx = str(tmp_path / "idx")
    seen = []
    for i, data in enumerate(versions):
        zpath = tmp_path / f"v{i}.zip"
        with zipfile.ZipFile(zpath, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr(zipfile.ZipInfo("data.tar", date_time=(2024, 1, 1, 0, 0, 0)), data)
        with mounted(zpath, mnt):
            st = os.stat(mnt / "data.tar")
            seen.append((st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns))
            with Archive(str(mnt / "data.tar"), index_dir=idx) as ar:
                assert ar.format.index_source == "scan"
                with tarfile.open(fileobj=io.BytesIO(data)) as tf:
                    for name in ("a.txt", "b.txt"):
                        assert ar.read(name) == tf.extractfile(name).read(), (i, name)
    assert seen[0] == seen[1]  # what made the two alike to a stat


def test_a_tar_on_a_block_device_is_indexed_afresh_at_every_open(tmp_path: Path) -> None:
    """The device node's stat says nothing of the medium: another image behind the same loop
    device (or another stick of the same size) was read through the first one's saved index."""
    if os.geteuid() != 0 or not shutil.which("losetup"):
        pytest.skip("needs root and losetup for a loop device")

    def image(name: str, members: list[tuple[str, bytes]]) -> Path:
        path = tmp_path / name
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
            for member, data in members:
                info = tarfile.TarInfo(member)
                info.size, info.mtime = len(data), 1_700_000_000
                tf.addfile(info, io.BytesIO(data))
        with open(path, "r+b") as f:
            f.truncate(1 << 20)
        return path

    first = image("a.img", [("a.txt", b"A" * 1000), ("b.txt", b"B" * 3000)])
    second = image("b.img", [("a.txt", b"C" * 3000), ("b.txt", b"D" * 1000)])
    attach = subprocess.run(["losetup", "-f", "--show", str(first)], capture_output=True, text=True)
    if attach.returncode != 0:
        pytest.skip(f"needs root with a free loop device: {attach.stderr.strip()}")
    device = attach.stdout.strip()
    idx = tmp_path / "idx"
    try:
        with Archive(device, index_dir=str(idx)) as ar:
            assert ar.format.index_source == "scan"
            assert ar.read("b.txt") == b"B" * 3000
        subprocess.run(["losetup", "-d", device], check=True)
        subprocess.run(["losetup", device, str(second)], check=True)
        with Archive(device, index_dir=str(idx)) as ar:
            assert ar.format.index_source == "scan"
            assert ar.read("a.txt") == b"C" * 3000 and ar.read("b.txt") == b"D" * 1000
        assert not list(idx.glob("*.idx"))
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True)


def _index_file_removed(tmp_path: Path, many_files: Path):
    """A tar indexed once, its index file removed: (archive, index dir, identity, index path)."""
    archive = gnu_tar(tmp_path / "a.tar", many_files, "pax")
    idx = tmp_path / "idx"
    with Archive(str(archive), index_dir=str(idx)) as ar:
        identity = ar.source.identity
    path = IndexStore(str(idx)).path_for(identity)
    os.unlink(path)
    return archive, idx, identity, path


def test_an_index_file_that_is_a_fifo_does_not_hang(tmp_path: Path, many_files: Path) -> None:
    archive, idx, _, path = _index_file_removed(tmp_path, many_files)
    os.mkfifo(path)
    with Archive(str(archive), index_dir=str(idx)) as ar:  # a blocking open() waited forever here
        assert ar.format.index_source == "scan"


def _run_together(code: str, archive: Path, idx: Path, n: int = 4) -> list[tuple[str, str]]:
    """(stdout, stderr) of ``n`` processes running ``code`` with (archive, idx, start time) as
    arguments; ``code`` waits for the start time, so they all open the archive at once."""
    start = time.time() + 3.0  # past their imports
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(archive), str(idx), str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    return [p.communicate(timeout=120) for p in procs]


def test_processes_opening_an_unindexed_archive_together_scan_it_once(tmp_path: Path) -> None:
    """Eight DDP ranks opening the same foreign tar.zst for the first time each decoded all of it
    at once: now one scans, the others wait for its index and load it. (The scan is slowed down
    through its progress callback, so that the processes surely overlap.)"""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(5)
    for i in range(100):
        (src / f"f{i:03d}.bin").write_bytes(rng.randbytes(20_000) + bytes(30_000))
    archive = _single_frame(tmp_path, src)  # needs a scan: one frame, no seek table
    code = (
        "import logging, sys, time\n"
        "from cdmlfs.archive import Archive\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "time.sleep(max(0.0, float(sys.argv[3]) - time.time()))\n"  # all start at the same moment
        "slow = lambda done, total: time.sleep(0.2)\n"
        "with Archive(sys.argv[1], index_dir=sys.argv[2], progress=slow) as ar:\n"
        "    print(ar.format.index_source, len(ar.files()))\n"
    )
    outs = _run_together(code, archive, tmp_path / "idx")
    got = sorted(out.strip() for out, _ in outs)
    assert got == ["cache 100"] * 3 + ["scan 100"], outs
    assert sum("another process is indexing it" in err for _, err in outs) == 3, outs


def test_users_sharing_an_index_dir_each_keep_their_own_index(tmp_path: Path, many_files: Path) -> None:
    """In a shared sticky directory (like /tmp) the index file of a second user of an archive took
    the first one's name: it was not trusted (another user's), nor could it be replaced (EPERM),
    so that user scanned at every open."""
    import shutil
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("running as other users needs root")
    shared = Path(tempfile.mkdtemp(prefix="cdmlfs-shared-", dir="/tmp"))
    try:
        os.chmod(shared, 0o1777)
        data = shared / "data"
        data.mkdir(mode=0o755)
        archive = gnu_tar(data / "a.tar", many_files, "pax")
        os.chmod(archive, 0o644)
        warm = gnu_tar(tmp_path / "warm.tar", many_files, "pax")  # opened as root: imports done
        code = (
            "import os, sys\n"
            "from cdmlfs.archive import Archive\n"
            "Archive(sys.argv[3], index_dir=sys.argv[4]).close()\n"
            "os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))\n"
            "for _ in range(2):\n"
            "    with Archive(sys.argv[2], index_dir=sys.argv[5]) as ar:\n"
            "        print(ar.format.index_source)\n"
        )
        got = {}
        for uid in (2001, 2002):
            args = [str(uid), str(archive), str(warm), str(tmp_path / "root-idx"), str(shared)]
            res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
            got[uid] = res.stdout.split()
            assert res.returncode == 0, res.stderr
        assert got == {2001: ["scan", "cache"], 2002: ["scan", "cache"]}, got
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_an_index_dir_given_relative_is_the_same_after_pickling_elsewhere(
    tmp_path: Path, many_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative index_dir was pickled as given: a worker in another working directory scanned
    again and left an index folder there."""
    import pickle

    archive = gnu_tar(tmp_path / "a.tar", many_files, "pax")
    monkeypatch.chdir(tmp_path)
    with Archive(str(archive), index_dir="rel-idx") as ar:
        assert ar.format.index_source == "scan"
        state = pickle.dumps(ar)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pickle.loads(state) as again:
        assert again.format.index_source == "cache"
    assert not (elsewhere / "rel-idx").exists()


def test_a_huge_file_at_the_index_path_is_rebuilt_under_an_address_space_limit(
    tmp_path: Path, many_files: Path
) -> None:
    """A 3.5 GiB file there (under the 4 GiB an index may take) was read whole: under ulimit -v
    the MemoryError failed the open instead of a rebuild."""
    archive = gnu_tar(tmp_path / "a.tar", many_files, "pax")
    idx = tmp_path / "idx"
    with Archive(str(archive), index_dir=str(idx)) as ar:
        path = IndexStore(str(idx)).path_for(ar.source.identity)
    with open(path, "r+b") as f:
        f.truncate(7 << 29)  # sparse: no disk used
    code = OPEN_UNDER_3_GIB
    res = subprocess.run([sys.executable, "-c", code, str(archive), str(idx)], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.split()[0] == "scan", res.stderr
    assert os.path.getsize(path) < 1 << 20  # replaced by the rebuilt index


def test_indexes_unused_for_a_month_go_when_another_is_saved(tmp_path: Path, many_files: Path) -> None:
    """Every archive ever opened left its index (and a lock file) for ever: a pipeline writing
    archives to fresh paths filled the cache directory. An index loaded now and then stays."""
    idx = tmp_path / "idx"
    month_ago = time.time() - 40 * 86400
    names = ("gone", "used", "new")
    archives = {name: gnu_tar(tmp_path / f"{name}.tar", many_files, "pax") for name in names}
    paths = {}
    idx.mkdir()
    foreign = idx / "train-00000.tfrecord.idx"  # --index-dir may be any folder (DALI's indexes)
    foreign.write_text("0 100\n")
    os.utime(foreign, (month_ago, month_ago))
    for name in ("gone", "used"):
        with Archive(str(archives[name]), index_dir=str(idx)) as ar:
            assert ar.format.index_source == "scan"
            paths[name] = IndexStore(str(idx)).path_for(ar.source.identity)
        for leftover in (paths[name], paths[name] + ".lock"):
            os.utime(leftover, (month_ago, month_ago))
    with Archive(str(archives["used"]), index_dir=str(idx)) as ar:  # a load marks it used
        assert ar.format.index_source == "cache"
    with Archive(str(archives["new"]), index_dir=str(idx)) as ar:  # a save removes what is unused
        assert ar.format.index_source == "scan"
    assert not os.path.exists(paths["gone"]) and not os.path.exists(paths["gone"] + ".lock")
    assert (idx / "train-00000.tfrecord.idx").exists()  # another tool's index: not ours to remove
    assert os.path.exists(paths["used"]) and os.path.exists(paths["used"] + ".lock")
    with Archive(str(archives["used"]), index_dir=str(idx)) as ar:
        assert ar.format.index_source == "cache"


def test_temporary_files_of_killed_saves_are_removed(tmp_path: Path, many_files: Path) -> None:
    """A save killed (OOM killer, end of a pod's grace period) left its temporary file, a whole
    index, for ever: old ones of this user are removed by the next save; a fresh one is kept
    (another process may be writing it)."""
    archive = gnu_tar(tmp_path / "a.tar", many_files, "pax")
    idx = tmp_path / "idx"
    idx.mkdir(mode=0o700)
    old, fresh = idx / ".tmp-killed1.idx", idx / ".tmp-writing.idx"
    for leftover in (old, fresh):
        leftover.write_bytes(bytes(1000))
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    with Archive(str(archive), index_dir=str(idx)) as ar:
        assert ar.format.index_source == "scan"
        path = IndexStore(str(idx)).path_for(ar.source.identity)
    assert not old.exists() and fresh.exists()
    # An index saved under the name used before names carried the user id is still used (an
    # upgrade rescanned every archive), and goes once one under the new name is saved.
    unnamed = path.rpartition("-u")[0] + ".idx"
    os.replace(path, unnamed)
    with Archive(str(archive), index_dir=str(idx)) as ar:
        assert ar.format.index_source == "cache"
    st = archive.stat()
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # changed: indexed again
    with Archive(str(archive), index_dir=str(idx)) as ar:
        assert ar.format.index_source == "scan"
    assert os.path.exists(path) and not os.path.exists(unnamed)


def test_processes_waiting_for_a_scan_that_fails_fail_with_it(tmp_path: Path) -> None:
    """The scan the others waited for failed on the archive's content (here: not a tar): each
    waiter then scanned on its own, one after another (4 processes: failures after 1x, 2x, 3x,
    4x the scan time). They now fail with the error it noted; a later open scans again."""
    archive = tmp_path / "notatar.tar.zst"
    archive.write_bytes(zstandard.ZstdCompressor().compress(os.urandom(200_000)))
    code = (
        "import sys, time\n"
        "from cdmlfs.archive import Archive\n"
        "from cdmlfs.formats.tar import TarFormat\n"
        "real = TarFormat._scan_zstd\n"
        "def slow(self, *a):\n"
        "    print('scanning', file=sys.stderr, flush=True)\n"
        "    time.sleep(1.0)\n"
        "    return real(self, *a)\n"
        "TarFormat._scan_zstd = slow\n"
        "time.sleep(max(0.0, float(sys.argv[3]) - time.time()))\n"
        "try:\n"
        "    Archive(sys.argv[1], index_dir=sys.argv[2])\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    outs = _run_together(code, archive, tmp_path / "idx")
    assert all(out.startswith("ArchiveFormatError") and "not a tar" in out for out, _ in outs), outs
    assert sum(err.count("scanning") for _, err in outs) == 1, outs
    assert sum("another process indexing it at the same time" in out for out, _ in outs) == 3, outs
    res = subprocess.run(  # alone, later: its own scan, its own error
        [sys.executable, "-c", code, str(archive), str(tmp_path / "idx"), "0"], capture_output=True, text=True
    )
    assert "scanning" in res.stderr and "another process" not in res.stdout, res


def test_a_child_forked_while_an_index_is_built_does_not_hold_the_lock(tmp_path: Path) -> None:
    """An flock is shared with a forked child: a DataLoader forked while another thread scanned
    kept the build lock held for its whole life (others waited that long), and a child opening
    the same archive waited on its own copy for ever."""
    from cdmlfs.sources.base import SourceIdentity

    store = IndexStore(str(tmp_path / "idx"))
    identity = SourceIdentity(str(tmp_path / "a.tar.zst"), 1, "v1")
    with store.building(identity):
        pid = os.fork()
        if pid == 0:  # the child: lives on a while, as a DataLoader worker does
            time.sleep(5)
            os._exit(0)
    try:
        started = time.monotonic()
        with store.building(identity):  # another open file: waits for every copy of the first
            waited = time.monotonic() - started
        assert waited < 2.0, f"waited {waited:.1f} s for the forked child's copy of the lock"
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_a_lock_file_planted_by_another_user_does_not_hold_an_open_for_ever(tmp_path: Path) -> None:
    """In a shared index directory another user could create this user's lock file (its name is
    predictable) and hold an flock on it: every open of the archive waited for ever."""
    import fcntl

    from cdmlfs.sources.base import SourceIdentity

    if os.geteuid() != 0:
        pytest.skip("needs root to plant a file owned by another user")
    store = IndexStore(str(tmp_path / "idx"))
    identity = SourceIdentity(str(tmp_path / "a.tar"), 1, "v1")
    lock_path = store.path_for(identity) + ".lock"
    os.makedirs(store.directory, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    os.fchown(fd, 65534, 65534)
    holder = subprocess.Popen(  # another process holds it (an flock taken here would be ours)
        [sys.executable, "-c", f"import fcntl, time; fcntl.flock({fd}, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)"],
        pass_fds=(fd,), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        done = threading.Event()

        def build() -> None:
            with store.building(identity):
                done.set()

        threading.Thread(target=build, daemon=True).start()
        assert done.wait(5), "waited on a lock file another user planted"
        other = os.open(lock_path, os.O_RDWR)  # the planted lock is still held: not ours to take
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    finally:
        holder.kill()
        holder.wait()
        os.close(fd)


def test_index_files_planted_as_links_are_not_followed(tmp_path: Path, many_files: Path) -> None:
    """A link at the index path was opened through: to a terminal, it became the controlling
    terminal of a session leader without one (a container's PID 1), which the planter could
    then signal."""
    archive, idx, identity, path = _index_file_removed(tmp_path, many_files)
    code = (
        "import os, sys\n"
        "from cdmlfs.index_store import IndexStore\n"
        "from cdmlfs.sources.base import SourceIdentity\n"
        "os.setsid()\n"  # a session leader with no terminal
        "master, slave = os.openpty()\n"
        "name = os.ttyname(slave)\n"
        "os.close(slave)\n"
        "os.symlink(name, sys.argv[2])\n"
        "IndexStore(sys.argv[1]).load(SourceIdentity(sys.argv[3], int(sys.argv[4]), *sys.argv[5:7]), 'tar')\n"
        "tty = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[4])\n"
        "print('controlling tty' if tty else 'no tty')\n"
    )
    args = [str(idx), path, identity.location, str(identity.size), identity.version, identity.changed]
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "no tty", (res.stdout, res.stderr)
    with Archive(str(archive), index_dir=str(idx)) as ar:  # the link is replaced by a real index
        assert ar.format.index_source == "scan"
    assert not os.path.islink(path)
    with Archive(str(archive), index_dir=str(idx)) as ar:
        assert ar.format.index_source == "cache"


# Opens an archive (argv 1, index dir argv 2) under ulimit -v 3 GiB, as on HPC nodes.
OPEN_UNDER_3_GIB = (
    "import resource, sys\n"
    "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
    "from cdmlfs.archive import Archive\n"
    "with Archive(sys.argv[1], index_dir=sys.argv[2]) as ar:\n"
    "    print(ar.format.index_source, len(ar.files()))\n"
)


def test_a_saved_index_reopens_under_an_address_space_limit(tmp_path: Path, many_files: Path) -> None:
    """Loading a saved index asked for read(4 GiB) (and the decoder reserved 4 GiB for a frame of
    unstated size): under ulimit -v, as on HPC nodes, every remount was a MemoryError traceback."""
    archive = gnu_tar(tmp_path / "a.tar", many_files, "pax")
    idx = tmp_path / "idx"
    code = OPEN_UNDER_3_GIB
    runs = [
        subprocess.run([sys.executable, "-c", code, str(archive), str(idx)], capture_output=True, text=True)
        for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr
    assert [r.stdout.split()[0] for r in runs] == ["scan", "cache"]
    # A frame without a content size (not how we write one) is decoded in pieces, within the limit.
    from cdmlfs.index_store import decompress_bounded

    chunked = zstandard.ZstdCompressor().compressobj()
    frame = chunked.compress(b"x" * 100_000) + chunked.flush()
    assert zstandard.frame_content_size(frame) == -1
    assert decompress_bounded(frame, 1 << 32) == b"x" * 100_000
    with pytest.raises(ValueError, match="more than"):
        decompress_bounded(frame, 50_000)


def test_a_seek_table_swapping_sizes_of_unsized_frames_gives_eio_not_shifted_bytes(tmp_path: Path) -> None:
    """Frames whose headers state no size (the reference seekable writer's), larger than one decode,
    with sizes swapped in the seek table (the total right): pieces were served shifted by the
    difference, wrong bytes and no error. Such a frame is now decoded to its end once first."""
    from cdmlfs.zstd_seekable import seek_table_frame

    big = b"".join(b"%08d\n" % i for i in range((12 << 20) // 9 + 10))[: 12 << 20]
    data = _tar_bytes({"big": big, "after": b"after"})
    cuts = [0, 512, 512 + (5 << 20), 512 + (12 << 20), len(data)]
    frames, entries = [], []
    for a, b in itertools.pairwise(cuts):
        c = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
        frames.append(c.compress(data[a:b]) + c.flush())
        entries.append((len(frames[-1]), b - a))
    lying = list(entries)
    lying[1], lying[2] = (entries[1][0], entries[2][1]), (entries[2][0], entries[1][1])
    for name, table in (("good", entries), ("lying", lying)):
        path = tmp_path / f"{name}.tar.zst"
        path.write_bytes(b"".join(frames) + seek_table_frame(table))
        for attempt in ("scan", "cache"):  # the persisted index keeps where the sizes came from
            with Archive(str(path), cache_size="16M", index_dir=str(tmp_path / "idx")) as ar:
                assert ar.format.index_source == attempt
                errors = 0
                for at in (9 << 20, 11 << 20, 6 << 20, 0):  # where the shifted bytes were, first
                    try:
                        assert ar.read("big", at, 4096) == big[at : at + 4096], (name, at)  # never wrong
                    except CorruptMemberError:
                        errors += 1
                assert errors == (0 if name == "good" else 4)  # a member that failed fails every read
                assert ar.read("after") == b"after"


def _framed(data: bytes, cuts: list[int], sized: bool) -> tuple[list[bytes], list[tuple[int, int]]]:
    """``data`` in zstd frames cut at ``cuts``, and their (compressed, decoded) seek table entries."""
    frames, entries = [], []
    for a, b in itertools.pairwise([0, *cuts, len(data)]):
        frames.append(zstandard.ZstdCompressor(level=1, write_content_size=sized).compress(data[a:b]))
        entries.append((len(frames[-1]), b - a))
    return frames, entries


@pytest.mark.parametrize("sized", [True, False], ids=["sizes in frame headers", "no sizes in headers"])
def test_a_wrong_seek_table_entry_is_found_and_the_frames_are_located_by_their_headers(
    sized: bool, tmp_path: Path
) -> None:
    """A seek table whose entry for one frame says the wrong decoded size: the scan refused the
    archive when it decoded that frame to its end (the last frame, say), and otherwise read headers
    at the wrong offsets and listed the archive only up to there. The scan now checks each frame it
    decodes against the frame's own header, and a tar that stops at a corrupt header by the table
    is read again by the frames' headers: every member is listed and reads right, with a warning
    that names the seek table (repeated when the archive opens from the saved index)."""
    from cdmlfs.zstd_seekable import seek_table_frame

    big = text_bytes(3 << 20)
    members = {"a": b"a" * 1000, "big": big, "c": b"c" * 3000, "d": b"d" * 5}
    data = _tar_bytes(members)
    cuts = [1 << 20, 2 << 20, len(data) - 4096]  # frames 1 and 2 lie inside big: the scan skips them
    frames, entries = _framed(data, cuts, sized)
    cases = {"last": len(entries) - 1, "skipped": 1} if sized else {"skipped": 1}
    for label, wrong in cases.items():
        table = list(entries)
        table[wrong] = (table[wrong][0], table[wrong][1] + 512)  # the total is wrong too: no swap
        path = tmp_path / f"{label}.tar.zst"
        path.write_bytes(b"".join(frames) + seek_table_frame(table))
        for attempt in ("scan", "cache"):
            with Archive(str(path), index_dir=str(tmp_path / "idx")) as ar:
                assert ar.format.index_source == attempt
                assert sorted(ar.listdir("")) == sorted(members), label
                for name, body in members.items():
                    assert ar.read(name) == body, (label, name)
                assert any("the seek table is wrong" in w for w in ar.open_warnings), ar.open_warnings


@pytest.mark.parametrize("sized", [True, False], ids=["sizes in frame headers", "no sizes in headers"])
def test_a_tar_damaged_behind_a_correct_seek_table_is_still_listed_up_to_the_damage(
    sized: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A corrupt tar header behind a right seek table: the members before it are listed, with no
    word about the table. Where the frames the scan skipped state their sizes (as pack writes
    them), their headers show the table right and the archive is not read a second time (a whole
    pass, over the network for S3); frames that state none leave only that second reading."""
    from cdmlfs.zstd_seekable import seek_table_frame

    data = bytearray(_tar_bytes({"a": b"a" * 1000, "big": text_bytes(3 << 20), "b": b"b" * 2000}))
    header_b = 512 + 1024 + 512 + (3 << 20)
    data[header_b] ^= 0xFF
    frames, entries = _framed(bytes(data), [1 << 20, 2 << 20], sized)  # frame 1 lies inside big
    path = tmp_path / "damaged.tar.zst"
    path.write_bytes(b"".join(frames) + seek_table_frame(entries))
    level = caplog.at_level(logging.DEBUG, logger="cdmlfs.formats.tar")
    with level, Archive(str(path), index_dir=str(tmp_path / "idx")) as ar:
        assert sorted(ar.listdir("")) == ["a", "big"]
        assert ar.read("a") == b"a" * 1000
        assert not any("seek table" in w for w in ar.open_warnings)
    scans = caplog.text.count("scanned 2 members")
    assert scans == (1 if sized else 2), caplog.text
    assert caplog.text.count("corrupt header") == 1, caplog.text  # the second reading says nothing again


def _blocks(*members: tuple) -> bytes:
    """A tar built block by block: (name, data, typeflag[, mtime]) members, then the end blocks."""
    out = b""
    for name, data, typeflag, *rest in members:
        mtime = rest[0] if rest else 1_700_000_000
        out += build_block(name, 0o644, 0, 0, len(data), mtime, typeflag)
        out += data + bytes(-len(data) % 512)
    return out + bytes(1024)


def _fix_checksum(block: bytes) -> bytes:
    b = bytearray(block)
    b[148:156] = b" " * 8
    b[148:156] = b"%06o\0 " % sum(b)
    return bytes(b)


def _gnu_tar_names(path: Path) -> list[str]:
    res = subprocess.run(["tar", "-tf", str(path)], capture_output=True, text=True)
    return [n for n in res.stdout.splitlines() if n]


def test_a_malformed_pax_record_costs_its_member_the_records_not_the_archive(tmp_path: Path, caplog) -> None:
    """GNU tar and bsdtar warn and go on: one bad pax header (a length counted in characters, as
    some writers do, or a bad length) made the whole archive unreadable. Empty values delete a
    record (POSIX), so a local ``mtime=`` puts back the header's over a global one; an mtime that
    is no number leaves the header's."""
    rec = pax_record
    path_chars = " path=dataset/é/ü.txt\n"
    charlen = f"{len(path_chars) + 2}{path_chars}".encode()  # counted in characters, not bytes
    archive = tmp_path / "pax.tar"
    archive.write_bytes(
        _blocks(
            (b"PaxHeaders/g", rec("mtime", b"1234.5"), b"g"),
            (b"globaltime", b"G", b"0"),
            (b"PaxHeaders/e", rec("mtime", b""), b"x"),
            (b"headertime", b"H", b"0", 1_600_000_000),
            (b"PaxHeaders/c", charlen, b"x"),
            (b"dataset/_/_.txt", b"abc", b"0"),
            (b"PaxHeaders/l", b"30 path=wrongname\n", b"x"),
            (b"badlength", b"2", b"0"),
            (b"PaxHeaders/m", rec("mtime", b"abc"), b"x"),
            (b"badtime", b"M", b"0", 1_500_000_000),
            (b"PaxHeaders/s", rec("size", b""), b"x"),
            (b"emptysize", b"SSSS", b"0"),
            (b"after", b"A", b"0"),
        )
    )
    with caplog.at_level(logging.WARNING), Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert sorted(ar.files()) == sorted(_gnu_tar_names(archive))
        assert ar.read("dataset/_/_.txt") == b"abc" and ar.read("badlength") == b"2"
        assert ar.read("emptysize") == b"SSSS" and ar.read("after") == b"A"
        assert ar.stat("globaltime").mtime == 1234.5
        assert ar.stat("headertime").mtime == 1_600_000_000  # the empty record deleted the global one
        assert ar.stat("badtime").mtime == 1_500_000_000
    text = caplog.text
    assert "malformed pax record" in text and "is no time" in text


def test_a_header_mode_or_mtime_that_is_no_number_gets_a_default(tmp_path: Path, caplog) -> None:
    """Only the size says where the next header is: a non-octal mode or mtime field refused the
    whole archive, where GNU tar warns and extracts everything."""
    first = build_block(b"first", 0o644, 0, 0, 1, 1_700_000_000, b"0") + b"1" + bytes(511)
    bad = bytearray(build_block(b"badmode", 0o644, 0, 0, 1, 1_700_000_000, b"0"))
    bad[100:108] = b"0000689\0"
    bad[136:148] = b"1234567890x\0"
    archive = tmp_path / "fields.tar"
    archive.write_bytes(
        first + _fix_checksum(bytes(bad)) + b"M" + bytes(511) + _blocks((b"after", b"A", b"0"))
    )
    with caplog.at_level(logging.WARNING), Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert sorted(ar.files()) == sorted(_gnu_tar_names(archive)) == ["after", "badmode", "first"]
        assert ar.read("badmode") == b"M" and ar.read("after") == b"A"
        st = ar.stat("badmode")
        assert st.mode & 0o777 == 0o644 and st.mtime == 0
    assert "mode and mtime field is no number" in caplog.text


def test_index_dir_default_respects_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_index_dir() == str(tmp_path / "xdg" / "cdmlfs" / "index")
    monkeypatch.delenv("XDG_CACHE_HOME")
    home_default = os.path.join(os.path.expanduser("~"), ".cache", "cdmlfs", "index")
    assert default_index_dir() == home_default
    # A relative value is invalid by the spec, to be ignored (it followed the working directory).
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    assert default_index_dir() == home_default


def test_state_dir_ignores_a_relative_xdg_state_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from cdmlfs.daemon import _state_dir

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_STATE_HOME", "relative/dir")
    assert _state_dir() == str(tmp_path / "home" / ".local" / "state" / "cdmlfs")
    assert not (tmp_path / "relative").exists()
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert _state_dir() == str(tmp_path / "state" / "cdmlfs")


def test_unwritable_index_dir_still_opens(tmp_path: Path, many_files: Path) -> None:
    archive = gnu_tar(tmp_path / "a.tar", many_files, "pax")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with Archive(str(archive), index_dir=str(blocker / "idx")) as ar:
        assert len(ar.files()) == 200
    assert IndexStore(str(blocker / "idx")).load(ar.source.identity, "tar/1") is None


def test_bytes_after_the_last_frame_of_an_ended_tar_are_a_warning(tmp_path: Path, caplog) -> None:
    """Garbage after the last zstd frame refused the archive even though the tar had ended: GNU
    tar lists (and extracts) every member of such a file. A tar cut before its end blocks, with
    garbage after, is still refused (members may be missing)."""
    whole = _tar_bytes({"a.txt": b"A" * 1000, "b.txt": b"B" * 3000})
    ended = tmp_path / "ended.tar.zst"
    ended.write_bytes(zstandard.ZstdCompressor().compress(whole) + b"GARBAGE!" * 100)
    with caplog.at_level(logging.WARNING), Archive(str(ended), index_dir=str(tmp_path / "idx")) as ar:
        assert sorted(ar.files()) == ["a.txt", "b.txt"] and ar.read("b.txt") == b"B" * 3000
    assert "after the end of the tar: ignored" in caplog.text
    # A frame cut short after the end (an interrupted append): the same, never a traceback.
    cut_frame = tmp_path / "cut-frame.tar.zst"
    tail = zstandard.ZstdCompressor().compress(os.urandom(200_000))[:5000]
    cut_frame.write_bytes(zstandard.ZstdCompressor().compress(whole) + tail)
    with Archive(str(cut_frame), index_dir=str(tmp_path / "idx")) as ar:
        assert sorted(ar.files()) == ["a.txt", "b.txt"] and ar.read("a.txt") == b"A" * 1000
    cut = tmp_path / "cut.tar.zst"
    cut.write_bytes(zstandard.ZstdCompressor().compress(whole[:1536]) + b"GARBAGE!" * 100)
    with pytest.raises(ArchiveFormatError, match="no zstd frame"):
        Archive(str(cut), index_dir=str(tmp_path / "idx"))


def test_a_frame_compressed_with_a_dictionary_says_so(tmp_path: Path) -> None:
    """It read 'corrupt zstd frame ... Dictionary mismatch': the file is fine, it needs zstd -D."""
    rng = random.Random(0)
    words = [b"alpha", b"beta", b"gamma", b"tensor", b"batch"]
    samples = [b" ".join(rng.choice(words) for _ in range(200)) for _ in range(400)]
    dictionary = zstandard.train_dictionary(16384, samples)
    archive = tmp_path / "dict.tar.zst"
    archive.write_bytes(
        zstandard.ZstdCompressor(dict_data=dictionary).compress(_tar_bytes({"a": samples[0]}))
    )
    with pytest.raises(ArchiveFormatError, match=r"compressed with a dictionary \(zstd -D\)"):
        Archive(str(archive), index_dir=str(tmp_path / "idx"))


def test_an_index_file_of_another_user_is_not_trusted(tmp_path: Path, many_files: Path, caplog) -> None:
    """In a shared --index-dir another user could plant an index for our archive (the key it must
    hold is what stat shows) mapping names to other bytes: only our own files are used."""
    archive = gnu_tar(tmp_path / "a.tar", many_files, "pax")
    idx = tmp_path / "idx"
    with Archive(str(archive), index_dir=str(idx)) as ar:
        path = Path(IndexStore(str(idx)).path_for(ar.source.identity))
    changes = [lambda: os.chmod(path, 0o666)]
    if os.geteuid() == 0:  # giving a file away needs root
        changes.append(lambda: os.chown(path, 12345, 12345))
    for change in changes:
        change()
        with caplog.at_level(logging.WARNING), Archive(str(archive), index_dir=str(idx)) as ar:
            assert ar.format.index_source == "scan"
        assert "not this user's own" in caplog.text
        caplog.clear()
        with Archive(str(archive), index_dir=str(idx)) as ar:  # saved again, ours: used
            assert ar.format.index_source == "cache"


def test_a_home_that_cannot_take_the_index_keeps_it_in_a_private_temp_dir(
    tmp_path: Path, many_files: Path
) -> None:
    """HOME=/ (a container run under an arbitrary uid) or a read-only home: every mount of a tar
    scanned it again. The index goes to $TMPDIR/cdmlfs-UID/index, ours alone."""
    archive = gnu_tar(tmp_path / "a.tar", many_files, "pax")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME",)}
    env.update(HOME="/proc/self", TMPDIR=str(tmp))
    code = "import sys\nfrom cdmlfs.archive import Archive\nprint(Archive(sys.argv[1]).format.index_source)"
    runs = [
        subprocess.run([sys.executable, "-c", code, str(archive)], capture_output=True, text=True, env=env)
        for _ in range(2)
    ]
    assert [r.stdout.strip() for r in runs] == ["scan", "cache"], runs[0].stderr
    private = tmp / f"cdmlfs-{os.getuid()}"
    assert private.stat().st_mode & 0o777 == 0o700
    assert len(list((private / "index").glob("*.idx"))) == 1


# -- frames ---------------------------------------------------------------------------------
def test_packed_archive_needs_no_decoding_to_open_and_one_frame_per_member(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(300):
        (src / f"f{i:03d}.txt").write_bytes((b"%d " % i) * (i * 37 % 5000))
    archive = cdmlfs_pack(src, tmp_path / "p.tar.zst", "--frame-size", "64K")
    counting = CountingSource(archive)
    with Archive(counting, index_dir=str(tmp_path / "idx")) as ar:
        assert ar.format.index_source == "embedded"
        assert not (tmp_path / "idx").exists()  # nothing to persist
        opened = counting.bytes_read
        assert opened < 30_000
        stream = ar.format.stream
        assert len(stream.frames) > 10
        for name in ("f123.txt", "f007.txt", "f299.txt"):
            before = stream.frame_decodes
            assert ar.read(name) == (src / name).read_bytes()
            assert stream.frame_decodes - before == 1  # a small member never spans frames


def test_embedded_index_equals_a_fresh_scan(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / ("x" * 120)).write_bytes(b"1" * 100_000)
    (src / "ü.txt").write_bytes(b"2")
    os.symlink("sub", src / "l")
    os.link(src / "ü.txt", src / "hard")
    archive = cdmlfs_pack(src, tmp_path / "p.tar.zst", "--frame-size", "16K")
    source = LocalFile(str(archive))
    frames = read_seek_table(source)
    assert frames is not None
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.format.index_source == "embedded"
    from cdmlfs.formats.tar import TarFormat

    embedded = TarFormat(source, compressed=True)._embedded_members(frames)
    scanned = MemberTable()
    view = ZstdScanView(source, frames)
    view.finish(scan_tar(view, scanned))
    scanned.stream_size = view.frame_table().total
    assert embedded is not None and embedded.crcs is not None
    # Same members as a scan finds, plus what only the packer knows: each file's CRC-32.
    expected = [
        zlib.crc32((src / name).read_bytes()) if kind == FILE else 0
        for kind, name in zip(scanned.kind, scanned.names)
    ]
    assert list(embedded.crcs) == expected
    embedded.crcs = None
    assert embedded.encode() == scanned.encode()


def test_frames_too_big_for_a_small_cache_ask_for_a_bigger_cache_not_a_repack(
    tmp_path: Path, many_files: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Packing again would write the same 4 MiB frames: the advice that helps is a larger cache."""
    from cdmlfs.pack import pack

    packed = tmp_path / "p.tar.zst"
    pack(str(many_files), str(packed), frame_size=1 << 20)
    for cache, said in ((1 << 20, "a cache of 4 MiB or more reads them whole"), (64 << 20, None)):
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING),
            Archive(str(packed), cache_size=cache, index_dir=str(tmp_path)) as ar,
        ):
            assert ar.read("d3/f003.bin") == (many_files / "d3/f003.bin").read_bytes()
        if said is None:
            assert caplog.text == ""
        else:
            assert said in caplog.text and "cdmlfs pack" not in caplog.text, caplog.text


def test_single_frame_warns_once_and_archive_order_is_one_pass(
    tmp_path: Path, many_files: Path, caplog: pytest.LogCaptureFixture
) -> None:
    archive = _single_frame(tmp_path, many_files)
    with (
        caplog.at_level(logging.WARNING),
        Archive(str(archive), cache_size=1 << 20, index_dir=str(tmp_path)) as ar,
    ):
        warnings = [r for r in caplog.records if "cdmlfs pack" in r.getMessage()]
        assert len(warnings) == 1
        assert "single zstd frame" in warnings[0].getMessage()
        stream = ar.format.stream
        order = ar.archive_order()
        assert sorted(order) == sorted(ar.files())
        for name in order:
            assert ar.read(name) == (many_files / name).read_bytes()
        assert stream.restarts == 1  # one forward pass for the whole archive
        for name in reversed(order[:20]):  # evicted long ago
            assert ar.read(name) == (many_files / name).read_bytes()
        assert stream.restarts > 1  # backward reads restart from the frame's start
    assert ar.cache.held <= 1 << 20


def test_sequential_reads_decode_the_next_extent_ahead_within_the_cache_bound(
    tmp_path: Path, many_files: Path
) -> None:
    archive = _single_frame(tmp_path, many_files)
    with Archive(str(archive), cache_size=1 << 20, index_dir=str(tmp_path)) as ar:
        ar.warm_up(decode_ahead=True)  # what the daemon asks for (off for in-process readers)
        stream = ar.format.stream
        piece = stream.piece
        assert stream.frames.dec_size[0] > 3 * piece
        ix = ar.index
        by_piece: dict[int, str] = {}
        for name in ar.archive_order():
            eid = ix.lookup(name)
            k = ix.offset[eid] // piece
            if (ix.offset[eid] + ix.size[eid] - 1) // piece == k:
                by_piece.setdefault(k, name)
        for k in (0, 1):  # the reader moves from piece 0 to piece 1 ...
            assert ar.read(by_piece[k]) == (many_files / by_piece[k]).read_bytes()
        deadline = time.monotonic() + 10
        while stream.prefetched < 1 and time.monotonic() < deadline:  # counted once it is cached
            time.sleep(0.01)
        assert stream.prefetched == 1  # ... so piece 2 was decoded ahead, through a reservation
        assert ar.cache.peek(("zp", 0, 2, piece)) is not None
        assert stream.restarts == 1
        before = stream.restarts
        assert ar.read(by_piece[2]) == (many_files / by_piece[2]).read_bytes()
        assert stream.restarts == before
        assert ar.cache.held + ar.cache.reserved <= 1 << 20
        worker = stream._worker
    # Closing stops the thread (it reads through the archive's descriptor, which closing frees).
    assert worker is not None and not worker.is_alive()


def test_a_reader_waiting_for_a_decoder_takes_the_piece_it_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two readers of one piece of a large frame: the second waits for the decoder the first holds.
    The piece was committed to the cache only after that decoder's lock was let go: the second
    found the decoder past its piece and nothing cached, and restarted the frame from byte 0.
    (Delays stand in for the first thread being descheduled at the worst moment.)"""
    from cdmlfs import cache as cachemod
    from cdmlfs.formats import zstdstream

    members = {f"f{i:02d}": (os.urandom(1024) * 256)[: 256 << 10] for i in range(48)}
    archive = tmp_path / "one.tar.zst"
    archive.write_bytes(zstandard.ZstdCompressor(level=1).compress(_tar_bytes(members)))
    with Archive(str(archive), cache_size=4 << 20, index_dir=str(tmp_path / "idx")) as ar:
        stream = ar.format.stream
        assert stream.frames.dec_size[0] > 3 * stream.piece
        in_piece = _members_by_piece(ar)
        for k in (0, 1):  # the decoder now stands at the start of piece 2
            assert ar.read(in_piece[k][0]) == members[in_piece[k][0]]

        decoding = threading.Event()

        def slow_for_first(fn):
            def wrapped(*args):
                if threading.current_thread().name == "first":
                    decoding.set()
                    time.sleep(0.2)
                return fn(*args)

            return wrapped

        monkeypatch.setattr(zstdstream, "_read_piece", slow_for_first(zstdstream._read_piece))
        monkeypatch.setattr(cachemod.Reservation, "commit", slow_for_first(cachemod.Reservation.commit))
        got: list[bytes] = []
        first = threading.Thread(target=lambda: got.append(ar.read(in_piece[2][0])), name="first")
        first.start()
        assert decoding.wait(10)  # the first reader holds the decoder, decoding piece 2
        before = stream.restarts
        inserted = ar.cache.stats.inserted_bytes
        assert ar.read(in_piece[2][1]) == members[in_piece[2][1]]
        first.join()
        assert got == [members[in_piece[2][0]]]
        assert stream.restarts == before
        assert ar.cache.stats.inserted_bytes - inserted == stream.piece  # stored once, not by the waiter too


def test_a_read_that_fails_mid_piece_does_not_shift_later_pieces(tmp_path: Path) -> None:
    """A source error (S3 timeout, EIO) inside a piece left the forward decoder past where it said
    it stood: every later piece from it came out shifted, wrong bytes without an error."""
    members = {f"f{i:02d}": os.urandom(256 << 10) for i in range(48)}  # incompressible: many reads
    archive = tmp_path / "one.tar.zst"
    archive.write_bytes(zstandard.ZstdCompressor(level=1).compress(_tar_bytes(members)))

    class FailsOnce(CountingSource):
        armed = False

        def read_at(self, offset: int, length: int) -> bytes:
            if self.armed and length > 4096:  # compressed data, not a header
                self.armed = False
                raise SourceError("read failed (injected)")
            return super().read_at(offset, length)

    source = FailsOnce(archive)
    with Archive(source, cache_size=4 << 20, index_dir=str(tmp_path / "idx")) as ar:
        in_piece = _members_by_piece(ar)
        assert ar.read(in_piece[0][0]) == members[in_piece[0][0]]
        source.armed = True
        with pytest.raises(SourceError):
            ar.read(in_piece[1][0])
        for k in (1, 2, 3):
            assert ar.read(in_piece[k][0]) == members[in_piece[k][0]], k


def test_reads_a_little_out_of_order_in_a_large_frame_make_one_pass(tmp_path: Path) -> None:
    """The kernel's readahead asks for a file's pieces slightly out of order (more so for cat and
    cp, which ask for sequential access). A piece the decoder passed on its way to a later one is
    kept: it used to be dropped, and asking for it restarted the decoder at the frame's start
    (a 4.6 GB member read by cat decoded its frame about 30 times)."""
    src = tmp_path / "src"
    src.mkdir()
    big = text_bytes(48 << 20, 9)
    (src / "big.bin").write_bytes(big)
    archive = gnu_tar(tmp_path / "one.tar.zst", src, "gnu", ["zstd", "-q", "-c"])
    with Archive(str(archive), cache_size=64 << 20, index_dir=str(tmp_path / "idx")) as ar:
        stream = ar.format.stream
        piece = stream.piece
        assert len(big) > 2 * stream.whole_max  # served in pieces, forward
        before = stream.restarts
        order = [0, 3, 1, 2, 5, 4, *range(6, len(big) // piece + 1)]  # ahead, then back a little
        for k in order:
            at = k * piece
            assert ar.read("big.bin", at, piece) == big[at : at + piece], k
        assert stream.restarts - before <= 1  # the one start of the decoder
        assert ar.cache.held + ar.cache.reserved <= 64 << 20


def test_readers_in_two_regions_of_one_frame_each_keep_their_decoder(tmp_path: Path) -> None:
    """Two readers, each walking its own contiguous half of a single-frame archive in archive order
    (ranks sharing a mount, each on its shard), used to restart the frame's one decoder for each
    other at nearly every file: a 360 MiB archive was decoded about 68 times for one pass."""
    import threading

    src = tmp_path / "src"
    src.mkdir()
    for i in range(240):  # 24 MB in one frame: 12 pieces of an 8 MiB cache's 2 MiB decode budget
        (src / f"f{i:03d}.txt").write_bytes(text_bytes(100_000, i))
    archive = gnu_tar(tmp_path / "one.tar.zst", src, "gnu", ["zstd", "-1", "-q", "-c"])  # 512 KiB windows
    with Archive(str(archive), cache_size=8 << 20, index_dir=str(tmp_path / "idx")) as ar:
        stream = ar.format.stream
        order = ar.archive_order()
        half = len(order) // 2
        errors: list[BaseException] = []
        turns = [threading.Event(), threading.Event()]

        def read(names: list[str], me: int) -> None:
            try:
                for name in names:
                    turns[me].wait(5)  # take turns file by file: the worst interleaving
                    turns[me].clear()
                    assert ar.read(name) == (src / name).read_bytes(), name
                    turns[1 - me].set()
            except BaseException as exc:  # reported below
                errors.append(exc)
                turns[1 - me].set()

        threads = [
            threading.Thread(target=read, args=(order[:half], 0)),
            threading.Thread(target=read, args=(order[half:], 1)),
        ]
        for t in threads:
            t.start()
        turns[0].set()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert stream.frames.dec_size[0] > stream.whole_max  # served by forward decoders
        assert stream.restarts <= 3, stream.restarts  # one decoder per region (was one per file)


def test_frames_without_content_size_and_seek_tables_with_checksums(tmp_path: Path, many_files: Path) -> None:
    """A hand-made seekable file: frames without content size, a skippable frame, a checksummed table."""
    plain = gnu_tar(tmp_path / "a.tar", many_files, "pax").read_bytes()
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=False, write_checksum=True)
    pieces, entries = [], []
    for start in range(0, len(plain), 300_000):
        chunk = plain[start : start + 300_000]
        comp = cctx.compress(chunk)
        pieces.append(comp)
        entries.append((len(comp), len(chunk)))
        if start == 0:
            skip = skippable_frame(b"hello", 3)
            pieces.append(skip)
            entries.append((len(skip), 0))
    body = b"".join(struct.pack("<III", c, d, 0xDEADBEEF) for c, d in entries)
    body += struct.pack("<IBI", len(entries), 0x80, SEEKABLE_FOOTER_MAGIC)
    archive = tmp_path / "seekable.tar.zst"
    archive.write_bytes(b"".join(pieces) + struct.pack("<II", SEEK_TABLE_MAGIC, len(body)) + body)
    source = LocalFile(str(archive))
    table = read_seek_table(source)
    walked = walk_frames(source)
    assert [(f.offset, f.comp_size, f.skippable) for f in walked] == [
        (f.offset, f.comp_size, f.content_size == 0) for f in table
    ] + [(walked[-1].offset, walked[-1].comp_size, True)]
    assert all(f.content_size is None for f in walked if not f.skippable)
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.format.index_source == "scan"
        for name in ar.files()[::17]:
            assert ar.read(name) == (many_files / name).read_bytes()


def test_corrupt_frame_during_the_scan_refuses_the_archive(tmp_path: Path, many_files: Path) -> None:
    archive = gnu_tar(tmp_path / "p.tar.zst", many_files, "pax", ["pzstd", "-q", "-c", "-1", "-p", "2"])
    data = bytearray(archive.read_bytes())
    mid = len(data) // 3
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    archive.write_bytes(bytes(data))
    with pytest.raises(ArchiveFormatError):
        Archive(str(archive), index_dir=str(tmp_path / "idx"))


def test_a_zstd_window_beyond_the_bound_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """zstd --long=28 from a pipe declares a 256 MiB window: said as such, not as a corrupt frame."""
    plain = tmp_path / "t.tar"
    with tarfile.open(plain, "w") as tf:
        _add(tf, "a.txt", b"hello\n")
    packed = tmp_path / "long.tar.zst"
    with open(plain, "rb") as src, open(packed, "wb") as out:
        subprocess.run(["zstd", "-q", "--long=28", "-c"], stdin=src, stdout=out, check=True)
    with pytest.raises(ArchiveFormatError, match=r"256 MiB decoding window.*cdmlfs pack") as exc:
        Archive(str(packed), index_dir=str(tmp_path / "idx"))
    assert "corrupt" not in str(exc.value)
    # What it says works: pack reads such a stream (it failed with libzstd's "too much memory").
    from cdmlfs.pack import pack

    pack(str(packed), str(tmp_path / "ok.tar.zst"))
    with Archive(str(tmp_path / "ok.tar.zst"), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.read("a.txt") == b"hello\n"


def test_a_zstd_window_over_a_quarter_of_a_mounts_cache_is_refused_naming_the_cache_that_takes_it(
    tmp_path: Path,
) -> None:
    """zstd --long=27 from a pipe declares a 128 MiB window, which a decoder fills beside the cache:
    a daemon with a 16 MiB cache peaked at 160 MiB. With a mount's limit (a quarter of its cache)
    such an archive is refused, naming the --cache-size that takes it (the default does), also
    when a saved index spares the scan. A small frame declaring that window fills only what it
    holds: it opens. ls, cat, extract and the API (no limit given) take it as before."""
    from cdmlfs.decoders import window_limit

    def long27(name: str, data: bytes) -> Path:
        plain = tmp_path / f"{name}.tar"
        with tarfile.open(plain, "w") as tf:
            _add(tf, "big.txt", data)
        packed = tmp_path / f"{name}.tar.zst"
        with open(plain, "rb") as src, open(packed, "wb") as out:
            subprocess.run(["zstd", "-q", "--long=27", "-c"], stdin=src, stdout=out, check=True)
        return packed

    data = random.Random(5).randbytes(12 << 20)  # 12 MiB compressed too: the scan sees it fills more
    packed = long27("long", data)
    idx = str(tmp_path / "idx")
    mounts16 = {"cache_size": "16M", "window_limit": window_limit(16 << 20), "index_dir": idx}
    with pytest.raises(ArchiveFormatError, match=r"128 MiB decoding window.*--cache-size 512M") as exc:
        Archive(str(packed), **mounts16)
    assert "corrupt" not in str(exc.value) and "cdmlfs pack" in str(exc.value)
    assert str(packed) in str(exc.value) and isinstance(exc.value, WindowLimitError)
    with Archive(str(packed), index_dir=idx) as ar:  # no limit given: the API as before
        assert ar.read("big.txt", 9 << 20, 1000) == data[9 << 20 : (9 << 20) + 1000]
        assert ar.format.index_source == "scan"
    # The index saved above: no scan. The frame holds 12 MiB, which the window is cut to.
    with pytest.raises(ArchiveFormatError, match=r"13 MiB decoding window.*--cache-size 49M") as exc:
        Archive(str(packed), **mounts16)
    assert str(packed) in str(exc.value)  # said by the reader, outside the format's open
    with Archive(str(packed), cache_size="49M", window_limit=window_limit(49 << 20), index_dir=idx) as ar:
        assert ar.read("big.txt", 9 << 20, 1000) == data[9 << 20 : (9 << 20) + 1000]
    small = text_bytes(200_000, 6)
    little = long27("little", small)
    for _ in range(2):  # scanned, then from the saved index
        with Archive(str(little), **mounts16) as ar:
            assert ar.read("big.txt") == small
    # A few KB that decode to 40 MiB: refused by the scan as soon as it has filled more than the
    # limit (it filled 40 MiB, then the reader refused the frame).
    with pytest.raises(ArchiveFormatError, match=r"128 MiB decoding window.*--cache-size 512M"):
        Archive(str(long27("zeros", bytes(40 << 20))), **mounts16)
    # Frames of 3 MiB each from `zstd --long=27` one after another, no seek table: each fills 3 MiB
    # (the rest of the file was taken for the first frame's size, and the archive refused).
    parts = [random.Random(i).randbytes(3 << 20) for i in range(3)]
    plain = tmp_path / "multi.tar"
    with tarfile.open(plain, "w") as tf:
        for i, part in enumerate(parts):
            _add(tf, f"p{i}.bin", part)
    blob = plain.read_bytes()
    cuts = [0, 3 << 20, 6 << 20, len(blob)]
    multi = tmp_path / "multi.tar.zst"
    zstd = ["zstd", "-q", "--long=27", "-c"]
    frames = [
        subprocess.run(zstd, input=blob[a:b], capture_output=True, check=True).stdout
        for a, b in itertools.pairwise(cuts)
    ]
    multi.write_bytes(b"".join(frames))
    with Archive(str(multi), **mounts16) as ar:
        assert [ar.read(f"p{i}.bin") for i in range(3)] == parts
    res = run_cli("cat", str(packed), "big.txt")  # its 64 MiB cache bounds no window
    assert res.returncode == 0 and res.stdout == data, res.stderr
    # What the refusal says works, to a ZIP too (read as an archive with pack's 256 MiB cache).
    from cdmlfs.pack import pack

    pack(str(packed), str(tmp_path / "o.zip"), index_dir=idx)
    with zipfile.ZipFile(tmp_path / "o.zip") as zf:
        assert zf.read("big.txt") == data


def test_a_packed_archive_whose_frames_outgrow_a_mounts_cache_is_told_to_pack_smaller_frames(
    tmp_path: Path,
) -> None:
    """Frames of pack --level 20 or more have a window as large as the frame: refused beside a small
    cache, the advice was to convert the archive with cdmlfs pack, which wrote it."""
    from cdmlfs.decoders import window_limit
    from cdmlfs.pack import pack

    (tmp_path / "d").mkdir()
    data = random.Random(7).randbytes(12 << 20)
    (tmp_path / "d" / "r.bin").write_bytes(data)
    packed = tmp_path / "p.tar.zst"
    pack(str(tmp_path / "d"), str(packed), level=20, frame_size=12 << 20)
    with pytest.raises(ArchiveFormatError, match=r"12 MiB decoding window.*--cache-size 48M") as exc:
        Archive(str(packed), cache_size="16M", window_limit=window_limit(16 << 20))
    assert "--frame-size" in str(exc.value) and "convert it" not in str(exc.value), exc.value
    with Archive(str(packed), cache_size="48M", window_limit=window_limit(48 << 20)) as ar:
        assert ar.read("r.bin", 5 << 20, 100) == data[5 << 20 : (5 << 20) + 100]


def test_progress_is_reported_for_the_scan(tmp_path: Path, many_files: Path) -> None:
    archive = _single_frame(tmp_path, many_files)
    calls: list[tuple[int, int]] = []
    with Archive(str(archive), index_dir=str(tmp_path / "idx"), progress=lambda d, t: calls.append((d, t))):
        pass
    assert calls and calls[-1][0] == calls[-1][1] == archive.stat().st_size


# -- headers ---------------------------------------------------------------------------------
def _tarfile_archive(path: Path, fmt: int, build) -> Path:
    with tarfile.open(path, "w", format=fmt) as tf:
        build(tf)
    return path


def _add(tf: tarfile.TarFile, name: str, data: bytes = b"", **attrs) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_600_000_000
    for key, value in attrs.items():
        setattr(info, key, value)
    tf.addfile(info, io.BytesIO(data) if data else None)


def test_devices_fifos_unknown_types_duplicates_and_v7_directories(tmp_path: Path) -> None:
    def build(tf: tarfile.TarFile) -> None:
        _add(tf, "dev/null", type=tarfile.CHRTYPE, devmajor=1, devminor=3)
        _add(tf, "dev/sda", type=tarfile.BLKTYPE)
        _add(tf, "pipe", type=tarfile.FIFOTYPE)
        _add(tf, "dup.txt", b"first")
        _add(tf, "dup.txt", b"second, longer")
        _add(tf, "clash", b"a file first")
        _add(tf, "clash/inner.txt", b"inner")
        _add(tf, "vendor.bin", b"vendor data", type=b"Q")
        _add(tf, "olddir/", type=tarfile.AREGTYPE)
        _add(tf, "hl_missing", type=tarfile.LNKTYPE, linkname="nowhere")
        _add(tf, "hl", type=tarfile.LNKTYPE, linkname="dup.txt")

    archive = _tarfile_archive(tmp_path / "edge.tar", tarfile.GNU_FORMAT, build)
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert not ar.exists("dev/null") and not ar.exists("dev/sda") and not ar.exists("pipe")
        assert ar.read("dup.txt") == b"second, longer"  # the last duplicate wins
        assert ar.isdir("clash") and ar.read("clash/inner.txt") == b"inner"  # a directory wins
        assert ar.read("vendor.bin") == b"vendor data"  # unknown type: a regular file (POSIX)
        assert ar.isdir("olddir")
        assert not ar.exists("hl_missing")
        assert ar.read("hl") == b"second, longer"
        assert ar.stat("hl").ino == ar.stat("dup.txt").ino


def test_pax_global_and_local_headers(tmp_path: Path) -> None:
    def build(tf: tarfile.TarFile) -> None:
        _add(tf, "a.txt", b"aaa")
        info = tarfile.TarInfo("b" * 150 + "/ß.txt")
        info.size = 3
        info.mtime = 1_234_567_890.5
        info.uid = 3_000_000_000  # too big for ustar: a pax uid record
        info.pax_headers = {"comment": "x"}
        tf.addfile(info, io.BytesIO(b"bbb"))
        info = tarfile.TarInfo("sym")
        info.type = tarfile.SYMTYPE
        info.linkname = "ü" * 80 + "/target"
        tf.addfile(info)

    archive = _tarfile_archive(tmp_path / "pax.tar", tarfile.PAX_FORMAT, build)
    # Prepend a global header (mtime for all members) like `tar --pax-option` would.
    records = pax_record("mtime", b"1000000000") + pax_record("path", b"ignored-global-path")
    glob = build_header("pax_global_header", b"g", len(records), 0o644, 0)
    blob = glob + records + bytes(-len(records) % 512) + archive.read_bytes()
    (tmp_path / "g.tar").write_bytes(blob)
    with Archive(str(tmp_path / "g.tar"), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.read("a.txt") == b"aaa"
        assert ar.stat("a.txt").mtime == 1_000_000_000  # from the global header
        long_name = "b" * 150 + "/ß.txt"
        assert ar.read(long_name) == b"bbb"
        assert ar.stat(long_name).mtime == 1_234_567_890.5  # local pax beats global
        assert ar.readlink("sym") == "ü" * 80 + "/target"
        assert not ar.exists("ignored-global-path")


def test_truncated_tar_lists_what_came_before(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def build(tf: tarfile.TarFile) -> None:
        _add(tf, "whole.txt", b"w" * 1000)
        _add(tf, "cut.bin", b"c" * 100_000)
        _add(tf, "lost.txt", b"l" * 10)

    archive = _tarfile_archive(tmp_path / "t.tar", tarfile.USTAR_FORMAT, build)
    data = archive.read_bytes()
    cut = data.index(b"c" * 512) + 50_000
    (tmp_path / "cut.tar").write_bytes(data[:cut])
    with caplog.at_level(logging.WARNING):
        Archive(str(tmp_path / "cut.tar"), index_dir=str(tmp_path / "idx")).close()
    assert "truncated" in caplog.text and "'cut.bin'" in caplog.text  # said when mounting
    with Archive(str(tmp_path / "cut.tar"), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.read("whole.txt") == b"w" * 1000
        assert ar.files() == ["whole.txt", "cut.bin"]  # archive order, as tar lists them
        with pytest.raises(CorruptMemberError):
            ar.read("cut.bin")


@pytest.mark.parametrize(
    ("keep", "said"),
    [
        (lambda data, at: data[: at("two.txt") + 100], "ends inside a header at offset"),
        (lambda data, at: data[: at("two.txt")], "ends without its end-of-archive blocks"),
        (lambda data, at: data[: at("two.txt") - 200], "ends without its end-of-archive blocks"),
    ],
    ids=["inside a header", "between members", "inside padding"],
)
def test_a_tar_cut_between_members_is_served_but_never_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, keep, said: str
) -> None:
    """Members before the cut are served (as GNU tar lists them), and every open says the tar is cut,
    also one from the saved index: a remount must not turn a truncated copy into a quiet one."""

    def build(tf: tarfile.TarFile) -> None:
        _add(tf, "one.txt", b"1" * 700)
        _add(tf, "two.txt", b"2" * 10)

    data = _tarfile_archive(tmp_path / "t.tar", tarfile.USTAR_FORMAT, build).read_bytes()

    def header_of(name: str) -> int:
        return data.index(name.encode() + b"\0")

    (tmp_path / "cut.tar").write_bytes(keep(data, header_of))
    for index_source in ("scan", "cache"):
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING),
            Archive(str(tmp_path / "cut.tar"), index_dir=str(tmp_path / "i")) as ar,
        ):
            assert ar.format.index_source == index_source
            assert ar.files() == ["one.txt"] and ar.read("one.txt") == b"1" * 700
            assert any(said in m for m in ar.open_warnings), ar.open_warnings
        assert said in caplog.text and "cut.tar" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING), Archive(str(tmp_path / "t.tar"), index_dir=str(tmp_path)) as a:
        assert a.open_warnings == [] and caplog.text == ""  # a whole tar: nothing to say


def test_a_tar_cut_inside_a_member_names_it_as_the_mount_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """GNU tar writes "./d/big.bin": the warning named it so, a name no listing shows."""

    def build(tf: tarfile.TarFile) -> None:
        _add(tf, "./a.txt", b"a")
        _add(tf, "./d/big.bin", b"b" * 5000)

    data = _tarfile_archive(tmp_path / "t.tar", tarfile.GNU_FORMAT, build).read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: data.index(b"b" * 100) + 1000])
    with caplog.at_level(logging.WARNING), Archive(str(tmp_path / "cut.tar"), index_dir=str(tmp_path)) as ar:
        assert ar.files() == ["a.txt", "d/big.bin"]
        assert "'d/big.bin' first: they read as EIO" in caplog.text, caplog.text
        assert any("'d/big.bin' first" in w for w in ar.open_warnings), ar.open_warnings


def test_open_time_warnings_still_reach_stderr_without_logging_set_up(tmp_path: Path) -> None:
    """Archive.open_warnings keeps them; a script that set up no logging still sees them printed
    (Python's last-resort handler), as before they were kept."""
    whole = _tarfile_archive(tmp_path / "t.tar", tarfile.USTAR_FORMAT, lambda tf: _add(tf, "a", b"a"))
    data = whole.read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:1024])  # header and data of "a", no end blocks
    code = (
        "import cdmlfs, sys; a = cdmlfs.open(sys.argv[1], index_dir=sys.argv[2]);"
        "print(len(a.open_warnings)); a.close()"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "cut.tar"), str(tmp_path / "idx")], capture_output=True
    )
    assert res.returncode == 0 and res.stdout.decode().strip() == "1", res
    assert res.stderr.decode().count("end-of-archive blocks") == 1, res.stderr


TWO_OPENS = r"""
import sys, threading
import cdmlfs

a_started, b_started, a_done = threading.Event(), threading.Event(), threading.Event()

def a_progress(done, total):  # the first open, under way until the second has begun
    a_started.set()
    b_started.wait(30)

def b_progress(done, total):  # the second, paused until the first has finished
    b_started.set()
    a_done.wait(30)

def first():
    cdmlfs.open(sys.argv[1], index_dir=sys.argv[3], progress=a_progress).close()
    a_done.set()

t = threading.Thread(target=first)
t.start()
a_started.wait(30)
b = cdmlfs.open(sys.argv[2], index_dir=sys.argv[3], progress=b_progress)
t.join()
print(len(b.open_warnings), a_done.is_set())
b.close()
"""


def test_warnings_of_two_opens_at_once_are_each_printed_once(tmp_path: Path) -> None:
    """Whether an open printed its warnings was decided when it began: one that began while
    another was under way printed nothing once that other had finished."""
    whole = _tarfile_archive(tmp_path / "t.tar", tarfile.USTAR_FORMAT, lambda tf: _add(tf, "a", b"a"))
    data = whole.read_bytes()
    (tmp_path / "cut1.tar").write_bytes(data[:1024])  # no end blocks: each warns once
    (tmp_path / "cut2.tar").write_bytes(data[:1024])
    res = subprocess.run(
        [sys.executable, "-c", TWO_OPENS, *(str(tmp_path / n) for n in ("cut1.tar", "cut2.tar", "idx"))],
        capture_output=True,
        timeout=120,
    )
    err = res.stderr.decode()
    assert res.returncode == 0 and res.stdout.decode().split() == ["1", "True"], (res.stdout, err)
    assert err.count("cut1.tar") == 1 and err.count("cut2.tar") == 1, err


def test_an_index_dir_that_is_a_file_is_one_clear_error(tmp_path: Path) -> None:
    archive = _tarfile_archive(tmp_path / "t.tar", tarfile.USTAR_FORMAT, lambda tf: _add(tf, "a", b"a"))
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(UsageError, match="afile: not a directory"):
        Archive(str(archive), index_dir=str(tmp_path / "afile"))


def test_header_codec_round_trip_and_base256() -> None:
    block = build_header("x" * 99, b"0", 8**11 + 5, 0o644, 2**40, 5, 6)  # pax size and mtime
    pax = parse_pax(block[512 : 512 + parse_header(block[:512]).size])
    assert int(pax["size"]) == 8**11 + 5 and int(pax["mtime"]) == 2**40
    gnu = bytearray(build_header("f", b"0", 10)[:512])
    gnu[124:136] = b"\x80" + (2**40).to_bytes(11, "big")  # GNU base-256 size
    gnu[148:156] = b" " * 8
    gnu[148:156] = b"%06o\0 " % sum(gnu)
    assert parse_header(bytes(gnu)).size == 2**40


def test_plain_tar_scan_is_fast_enough_for_many_members(tmp_path: Path) -> None:
    """20k members index in well under the time a user notices (no timing assert: just sanity)."""

    def build(tf: tarfile.TarFile) -> None:
        for i in range(20_000):
            _add(tf, f"d{i % 50}/f{i}.txt", b"x")

    archive = _tarfile_archive(tmp_path / "many.tar", tarfile.GNU_FORMAT, build)
    started = time.monotonic()
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert len(ar.files()) == 20_000
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.format.index_source == "cache"
        assert ar.read("d7/f19957.txt") == b"x"
    logging.getLogger(__name__).info("20k members: %.2fs", time.monotonic() - started)


def _raw_member(name: bytes, size_field: bytes, data: bytes = b"", pax: bytes = b"") -> bytes:
    out = b""
    if pax:
        out += build_header("PaxHeaders/x", b"x", len(pax)) + pax + bytes(-len(pax) % 512)
    block = bytearray(build_header(name.decode(), b"0", len(data)))
    block[124:136] = size_field
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return out + bytes(block) + data + bytes(-len(data) % 512)


@pytest.mark.parametrize(
    "member",
    [
        _raw_member(b"neg", b"\xff" * 12),  # base-256 negative size
        _raw_member(b"huge", b"\x80" + b"\xff" * 11),  # base-256 size of 2**88
        _raw_member(b"p", b"%011o\0" % 3, b"abc", pax_record("size", b"-5")),
    ],
)
def test_hostile_sizes_refuse_the_archive(tmp_path: Path, member: bytes) -> None:
    archive = tmp_path / "h.tar"
    archive.write_bytes(member + bytes(1024))
    with pytest.raises(ArchiveFormatError):
        Archive(str(archive), index_dir=str(tmp_path / "idx"))


@pytest.mark.parametrize("mtime", [b"nan", b"inf", b"-1e300", b"1e30"])
def test_absurd_mtimes_become_zero(tmp_path: Path, mtime: bytes) -> None:
    archive = tmp_path / "m.tar"
    archive.write_bytes(_raw_member(b"f", b"%011o\0" % 3, b"abc", pax_record("mtime", mtime)) + bytes(1024))
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.stat("f").mtime == 0.0
        assert ar.read("f") == b"abc"


def test_a_pax_mtime_of_any_precision_is_a_time(tmp_path: Path) -> None:
    """21 digits after the point (more than a double holds) were taken for no time at all."""
    archive = tmp_path / "m.tar"
    mtime = b"1234567890.123456789012345678901"
    archive.write_bytes(_raw_member(b"f", b"%011o\0" % 3, b"abc", pax_record("mtime", mtime)) + bytes(1024))
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.stat("f").mtime == pytest.approx(1234567890.1234567)


def test_frame_claiming_a_huge_content_size_is_refused_or_eio(tmp_path: Path) -> None:
    plain = b"".join(_raw_member(b"f%d" % i, b"%011o\0" % 5, b"hello") for i in range(3)) + bytes(1024)
    frame = bytearray(zstandard.ZstdCompressor(write_content_size=True).compress(plain))
    assert frame[4] >> 6 == 1  # a 2-byte content size field
    frame[4] = (frame[4] & 0x3F) | 0xC0  # claim an 8-byte one: the header now lies about everything
    archive = tmp_path / "lie.tar.zst"
    archive.write_bytes(bytes(frame))
    with pytest.raises(ArchiveFormatError):
        Archive(str(archive), index_dir=str(tmp_path / "idx"))


def test_tar_ending_with_a_zip_member_is_a_tar(tmp_path: Path) -> None:
    import zipfile

    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("inner.txt", b"inner")

    def build(tf: tarfile.TarFile) -> None:
        _add(tf, "a.txt", b"a")
        _add(tf, "last.zip", inner.getvalue())

    archive = _tarfile_archive(tmp_path / "t.tar", tarfile.USTAR_FORMAT, build)
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.format.name == "tar"
        assert sorted(ar.files()) == ["a.txt", "last.zip"]


A_V1 = ("a", "file", b"v1", 0o600, 1000)


def _tar_of(path: Path, entries: list[tuple[str, str, bytes | str, int, int]]) -> Path:
    """(name, 'file'|'link'|'symlink', data or link target, mode, mtime) written in this order."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, kind, payload, mode, mtime in entries:
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = mode, mtime
            if kind == "file":
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
                continue
            info.type = tarfile.LNKTYPE if kind == "link" else tarfile.SYMTYPE
            info.linkname = payload
            tf.addfile(info)
    return path


def _extracted_links(archive: Path, dest: Path) -> dict[str, tuple]:
    subprocess.run(["tar", "-xf", str(archive), "-C", str(dest)], check=True)
    out = {}
    for p in sorted(dest.iterdir()):
        st = p.lstat()
        data = None if p.is_symlink() else p.read_bytes()
        out[p.name] = (st.st_nlink, st.st_mode & 0o7777, int(st.st_mtime), data)
    return out


@pytest.mark.parametrize(
    ("label", "entries"),
    [
        # tar cf x.tar a a, with a hard-linked: the second 'a' is a link to itself
        ("same file twice", [("a", "file", b"v1", 0o644, 1000), ("a", "link", "a", 0o644, 1000)]),
        # tar -r of a new 'a' after 'b' was stored as a link to the old one
        ("target replaced later", [A_V1, ("b", "link", "a", 0o755, 2000), ("a", "file", b"v2", 0o644, 3000)]),
        ("link repeated", [A_V1, ("b", "link", "a", 0o644, 1000), ("b", "link", "a", 0o644, 1000)]),
        ("link metadata", [("a", "file", b"v1", 0o600, 1000), ("b", "link", "a", 0o755, 2000)]),
        ("link to a symlink", [("s", "symlink", "a", 0o777, 1000), ("h", "link", "s", 0o777, 1000)]),
    ],
)
def test_hard_links_have_what_tar_x_gives(label: str, entries: list, tmp_path: Path) -> None:
    """Link counts from the paths that remain, and the target's mode and mtime (link(2) has none)."""
    archive = _tar_of(tmp_path / "links.tar", entries)
    (tmp_path / "x").mkdir()
    expected = _extracted_links(archive, tmp_path / "x")
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        got, inodes = {}, {}
        for name in sorted(expected):
            st = ar.stat(name, follow_symlinks=False)
            data = ar.read(name) if st.kind == FILE else None
            got[name] = (st.nlink, st.mode & 0o7777, int(st.mtime), data)
            inodes.setdefault(st.ino, set()).add(name)
    assert got == expected
    # The same names share an inode (a hard link to a symlink too: link(2) links the symlink).
    x_inodes: dict[int, set] = {}
    for name in expected:
        x_inodes.setdefault((tmp_path / "x" / name).lstat().st_ino, set()).add(name)
    assert sorted(map(sorted, inodes.values())) == sorted(map(sorted, x_inodes.values()))
    # Packed again, the same tree comes out of tar -x (a link whose target was replaced keeps v1).
    packed = cdmlfs_pack(archive, tmp_path / "again.tar.zst", "--index-dir", str(tmp_path / "idx"))
    (tmp_path / "y").mkdir()
    subprocess.run(["tar", "--zstd", "-xf", str(packed), "-C", str(tmp_path / "y")], check=True)
    for name, (_, _, _, data) in expected.items():
        if data is not None:
            assert (tmp_path / "y" / name).read_bytes() == data, name


def test_empty_tar_and_odd_members_match_tar_x(tmp_path: Path) -> None:
    """An empty archive opens (tar -x accepts it); a contiguous-file member named 'x/' is a directory."""
    empty = tmp_path / "empty.tar"
    subprocess.run(["tar", "cf", str(empty), "-T", "/dev/null"], check=True)
    with Archive(str(empty), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.listdir("") == []
    odd = tmp_path / "odd.tar"
    odd.write_bytes(build_header("cont/", b"7", 0) + bytes(1024))
    (tmp_path / "x").mkdir()
    subprocess.run(["tar", "xf", str(odd), "-C", str(tmp_path / "x")], check=True)
    assert (tmp_path / "x" / "cont").is_dir()
    with Archive(str(odd), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.isdir("cont")


@pytest.mark.fuse
def test_negative_and_fractional_mtimes_as_stat_gives_them(
    both_paths: str, tmp_path: Path, mnt: Path
) -> None:
    """Seconds are floored (-1.5 s is -2 s + 0.5e9 ns, not -1 s), nanoseconds rounded."""
    from mountutil import mounted

    archive = tmp_path / "times.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, mtime in (("neg", "-1.5"), ("small", "-0.25"), ("frac", "1600000000.5")):
            info = tarfile.TarInfo(name)
            info.pax_headers = {"mtime": mtime}
            tf.addfile(info, io.BytesIO(b""))
    (tmp_path / "x").mkdir()
    subprocess.run(["tar", "xf", str(archive), "-C", str(tmp_path / "x")], check=True, capture_output=True)
    with mounted(archive, mnt, "--index-dir", str(tmp_path / "idx")):
        for name in ("neg", "small", "frac"):
            assert (mnt / name).stat().st_mtime_ns == (tmp_path / "x" / name).stat().st_mtime_ns, name


@pytest.mark.parametrize(
    "records, why",
    [
        (pax_record("GNU.sparse.size", b"100") + pax_record("GNU.sparse.map", b"0,3,1,3"), "overlap"),
        (pax_record("GNU.sparse.size", b"100") + pax_record("GNU.sparse.map", b"0,5"), "covers 5 bytes"),
        (pax_record("GNU.sparse.size", b"4") + pax_record("GNU.sparse.map", b"2,3"), "pass the file"),
        (pax_record("GNU.sparse.size", b"100") + pax_record("GNU.sparse.map", b"0,x"), "unreadable"),
        (pax_record("GNU.sparse.major", b"1") + pax_record("GNU.sparse.minor", b"0"), "unreadable"),
        (
            pax_record("GNU.sparse.major", b"1") + pax_record("GNU.sparse.minor", b"7"),
            "': sparse format 1.7 is",
        ),
    ],
    ids=["overlap", "too-much-data", "past-the-end", "not-a-number", "no-realsize", "unknown-minor"],
)
def test_a_sparse_map_that_cannot_be_right_skips_that_member_only(
    records: bytes, why: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    archive = tmp_path / "s.tar"
    archive.write_bytes(
        _raw_member(b"bad", b"%011o\0" % 3, b"abc", records)
        + _raw_member(b"good", b"%011o\0" % 2, b"ok")
        + bytes(1024)
    )
    with caplog.at_level(logging.WARNING), Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.files() == ["good"] and ar.read("good") == b"ok"
    assert "'bad'" in caplog.text and why in caplog.text


def _sparse_10(
    name: bytes, segments: list[tuple[int, int]], real: int, map_text: bytes | None = None
) -> bytes:
    """A GNU sparse 1.0 member: pax records, then the map and the data segments' bytes."""
    text = (
        map_text
        if map_text is not None
        else b"%d\n" % len(segments) + b"".join(b"%d\n%d\n" % s for s in segments)
    )
    body = (
        text
        + bytes(-len(text) % 512)
        + b"".join(bytes([65 + i % 26]) * n for i, (_, n) in enumerate(segments))
    )
    records = (
        pax_record("GNU.sparse.major", b"1") + pax_record("GNU.sparse.minor", b"0")
        + pax_record("GNU.sparse.name", name) + pax_record("GNU.sparse.realsize", b"%d" % real)
    )  # fmt: skip
    return _raw_member(b"GNUSparseFile.0/" + name, b"%011o\0" % len(body), body, records)


def test_sparse_maps_are_bounded_in_size_and_scanned_in_linear_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A map line that never ends was read in quadratic time (a 1.3 KB tar.zst stalled a mount for
    minutes); maps compress to nothing, so an archive's total is bounded (it reached 700 MB)."""
    import cdmlfs.formats.tar as tar_format

    monkeypatch.setattr(tar_format, "MAX_SPARSE_TOTAL", 5)  # segments of all sparse files together
    archive = tmp_path / "s.tar"
    endless = b"5\n" + b"7" * (4 << 20)  # 4 MiB of one "number"
    archive.write_bytes(
        _sparse_10(b"endless", [], 10, map_text=endless)
        + _sparse_10(b"a", [(0, 2), (10, 2), (20, 2)], 30)
        + _sparse_10(b"b", [(0, 1), (5, 1), (9, 1)], 12)  # 6 segments in all: over the bound
        + _raw_member(b"ok", b"%011o\0" % 2, b"ok")
        + bytes(1024)
    )
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert sorted(ar.files()) == ["a", "ok"]
        assert ar.read("a") == b"AA" + bytes(8) + b"BB" + bytes(8) + b"CC" + bytes(8)
    assert time.monotonic() - started < 30  # was minutes for the 4 MiB line (a hang guard, not a target)
    assert "'endless': sparse map line too long" in caplog.text
    assert "'b': the archive's sparse maps pass 5 segments" in caplog.text


def test_a_persisted_sparse_map_out_of_order_is_not_trusted() -> None:
    from array import array

    table = MemberTable()
    table.append(FILE, "s", 0o644, 0.0, 100, 512, sparse=array("Q", [0, 10, 50, 10]))
    assert MemberTable.decode(table.encode()).sparse[0] == array("Q", [0, 10, 50, 10])
    table.sparse[0] = array("Q", [50, 10, 0, 10])  # what a tampered or corrupt index file could say
    with pytest.raises(MemberTableError, match="out of order"):
        MemberTable.decode(table.encode())


def _archive_with_a_zeros_table(tmp_path: Path, start: bytes, claims: int | None) -> Path:
    """A tar.zst of one member, its embedded member table ``start`` then 256 MiB of zeros (a few
    KB compressed), its seek table claiming ``claims`` bytes for the data frame (None: the truth)."""
    import json

    from cdmlfs.formats.tar import EMBEDDED_INDEX_MAGIC, EMBEDDED_INDEX_NIBBLE
    from cdmlfs.zstd_seekable import seek_table_frame, skippable_frame

    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as tf:
        info = tarfile.TarInfo("a.txt")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"abc"))
    data = tar.getvalue()
    frame = zstandard.ZstdCompressor().compress(data)
    zeros = zstandard.ZstdCompressor(level=1).compressobj()
    body = zeros.compress(start) + b"".join([zeros.compress(bytes(1 << 20)) for _ in range(256)])
    body += zeros.flush()
    header = json.dumps({"crc32": zlib.crc32(body), "length": len(body)}).encode()
    index = skippable_frame(EMBEDDED_INDEX_MAGIC + struct.pack("<I", len(header)) + header + body,
                            EMBEDDED_INDEX_NIBBLE)  # fmt: skip
    archive = tmp_path / "bomb.tar.zst"
    sizes = [(len(frame), len(data) if claims is None else claims), (len(index), 0)]
    archive.write_bytes(frame + index + seek_table_frame(sizes))
    return archive


def test_an_embedded_index_that_decodes_past_what_the_stream_can_hold_is_not_decoded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A few KB of payload (1 GiB of zeros, compressed) were decoded whole before their size was
    checked against a fixed 4 GiB: a small file took a GB of memory to open."""
    import resource

    archive = _archive_with_a_zeros_table(tmp_path, b"", claims=None)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with caplog.at_level(logging.WARNING), Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.read("a.txt") == b"abc"  # scanned instead
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert "embedded index is unusable (member table header missing)" in caplog.text  # 4 KB decoded
    assert grew_mib < 64, grew_mib


@pytest.mark.parametrize("members", [0, 4_000_000])
def test_an_embedded_index_is_not_decoded_past_its_own_header_or_a_sane_ratio(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, members: int
) -> None:
    """The limit above comes from the seek table's sizes, unchecked until frames are decoded: one
    claiming 4 GiB let 16 KB of forged table decode to a gigabyte (twice that in memory). Now the
    table's header line says how long it is (0 members: a few bytes; 4 million: 120 MB, from a
    payload 1024x smaller than that can be), and decoding stops there."""
    import json
    import resource

    table = {"v": 2, "n": members, "links": 0, "stream_size": 0xFFFFFFFF, "crc": 0, "names_bytes": 0,
             "links_bytes": 0}  # fmt: skip
    # The seek table lies about the data frame: the limit from the stream's size is 4 GiB.
    archive = _archive_with_a_zeros_table(tmp_path, json.dumps(table).encode() + b"\n", claims=0xFFFFFFFF)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with caplog.at_level(logging.WARNING), Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.read("a.txt") == b"abc"  # scanned instead: the lie is found, the frame located
    assert "the seek table is wrong" in caplog.text
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    expected = "decodes to more than 102 bytes" if members == 0 else "it declares 108000108 bytes, more than"
    assert "embedded index is unusable" in caplog.text and expected in caplog.text, caplog.text
    assert grew_mib < 64, grew_mib


def test_a_packed_index_of_long_repetitive_names_is_used_not_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """600 empty members under one 30 KB pax folder: their table shrinks past 1024x, and the
    reader refused pack's own index as a forgery (a full scan at every first mount)."""
    folder = "/".join(["d" * 250] * 120)
    src = tmp_path / "long.tar"
    with tarfile.open(src, "w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(600):
            tf.addfile(tarfile.TarInfo(f"{folder}/f{i:06d}"), io.BytesIO())
    with caplog.at_level(logging.WARNING):
        archive = cdmlfs_pack(src, tmp_path / "long.tar.zst")
        with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
            assert ar.format.index_source == "embedded"
            assert len(ar.listdir(folder)) == 600
    assert "embedded index is unusable" not in caplog.text


def test_member_names_that_add_up_past_the_budget_are_refused_while_scanning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compressed, megabyte pax paths cost nothing on disk: 48 of 8 MiB in 18 KB of .tar.zst made
    opening take 1.2 GB before the index builder's own budget could refuse them. (The budget is
    lowered here to keep the test small.)"""
    from cdmlfs.formats import tar as tarmod

    monkeypatch.setattr(tarmod, "PATH_BYTES_BASE", 1 << 20)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(4):
            info = tarfile.TarInfo(f"{i}/" + "n" * (512 << 10))
            tf.addfile(info, io.BytesIO())
    archive = tmp_path / "names.tar.zst"
    archive.write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    with pytest.raises(ArchiveFormatError, match="member names of this tar add up"):
        Archive(str(archive), index_dir=str(tmp_path / "idx"))
    monkeypatch.undo()
    with Archive(str(archive), index_dir=str(tmp_path / "idx2")) as ar:  # the real budget: fine
        assert len(ar.listdir("")) == 4


def test_an_open_from_a_saved_index_warns_what_the_scan_did(tmp_path: Path) -> None:
    """Skipped devices and FIFOs, a member of unknown type: the scan warned, but an open from the
    index it saved said nothing (open_warnings empty), as if the archive held no such members."""
    path = tmp_path / "odd.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, kind in (("fifo", tarfile.FIFOTYPE), ("dev", tarfile.CHRTYPE)):
            info = tarfile.TarInfo(name)
            info.type = kind
            tf.addfile(info)
        odd = tarfile.TarInfo("odd.bin")
        odd.type, odd.size = b"Q", 3
        tf.addfile(odd, io.BytesIO(b"abc"))
        _add(tf, "ok.txt", b"ok")
    seen = []
    for index_source in ("scan", "cache"):
        with Archive(str(path), index_dir=str(tmp_path / "i")) as ar:
            assert ar.format.index_source == index_source
            assert ar.read("ok.txt") == b"ok" and ar.read("odd.bin") == b"abc"
            seen.append(ar.open_warnings)
    assert any("skipped 2 device/FIFO" in w for w in seen[0]) and any("unknown type" in w for w in seen[0])
    assert seen[1] == seen[0], seen
