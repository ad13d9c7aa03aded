"""``cdmlfs pack``: seekable tar.zst, plain tar and ZIP output from directories and archives."""

from __future__ import annotations

import os
import shlex
import subprocess
import zipfile
from pathlib import Path

import pytest
from mountutil import CDMLFS, mounted, run_cli, tree, unzip
from test_tar_support import cdmlfs_pack, extract, gnu_tar, tricky_tree

from cdmlfs.archive import Archive
from cdmlfs.sources.local import LocalFile
from cdmlfs.zstd_seekable import parse_frame_header, read_seek_table


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tricky_tree(tmp_path_factory.mktemp("pack") / "src")
    (root / "photo.jpg").write_bytes(os.urandom(5000))
    (root / "notes.md").write_bytes(b"# notes\n" * 500)
    return root


def _same_tree(got: dict, expected: dict, zip_dates: bool = False) -> None:
    assert sorted(got) == sorted(expected)
    for path, exp in expected.items():
        assert got[path][:4] == exp[:4], path
        if exp[0] == "file":
            if zip_dates and path == "future.txt":  # ZIP dates end in 2107: clamped
                assert got[path][4] < exp[4]
                continue
            assert got[path][4] == exp[4], path


def test_frames_are_bounded_cut_at_members_and_carry_size_and_checksum(src: Path, tmp_path: Path) -> None:
    out = cdmlfs_pack(src, tmp_path / "o.tar.zst", "--frame-size", "64K", "--level", "1")
    source = LocalFile(str(out))
    frames = read_seek_table(source)
    assert frames is not None
    data_frames = [f for f in frames if f.content_size]
    assert len(data_frames) >= 3_000_000 // (64 << 10)  # the 3 MB member is split
    for f in data_frames:
        assert f.content_size <= 64 << 10
        header = parse_frame_header(source.read_at(f.offset, 18))
        assert header.content_size == f.content_size
        assert header.has_checksum
    with Archive(str(out), index_dir=str(tmp_path / "idx")) as ar:
        fr = ar.format.stream.frames
        starts = set(fr.dec_offset)
        for name in ar.files():
            eid = ar.index.lookup(name)
            size, off = ar.index.size[eid], ar.index.offset[eid]
            if 0 < size + 1024 <= 64 << 10:
                first = max(s for s in starts if s <= off)
                assert off + size <= first + fr.dec_size[sorted(starts).index(first)], name  # one frame


def test_threads_do_not_change_the_output(src: Path, tmp_path: Path) -> None:
    one = cdmlfs_pack(src, tmp_path / "one.tar.zst", "--frame-size", "128K", "--threads", "1")
    two = cdmlfs_pack(src, tmp_path / "two.tar.zst", "--frame-size", "128K", "--threads", "2")
    assert one.read_bytes() == two.read_bytes()


def test_zip_output_equals_source_with_stored_media(src: Path, tmp_path: Path) -> None:
    out = cdmlfs_pack(src, tmp_path / "o.zip")
    with zipfile.ZipFile(out) as zf:
        kinds = {i.filename: i.compress_type for i in zf.infolist()}
    assert kinds["photo.jpg"] == zipfile.ZIP_STORED
    assert kinds["notes.md"] == zipfile.ZIP_DEFLATED
    assert kinds["big/large.bin"] == zipfile.ZIP_DEFLATED
    got = tree(unzip(out, tmp_path / "unzipped"))
    _same_tree(got, tree(src), zip_dates=True)  # hard links come back as copies: same bytes


@pytest.mark.fuse
def test_pack_from_archives_round_trips(src: Path, tmp_path: Path, mnt: Path) -> None:
    expected = tree(src)
    single = gnu_tar(tmp_path / "single.tar.zst", src, "pax", ["zstd", "-q", "-c"])
    packed = cdmlfs_pack(single, tmp_path / "from-tar.tar.zst", "--frame-size", "256K")
    as_zip = cdmlfs_pack(packed, tmp_path / "from-packed.zip")
    back = cdmlfs_pack(as_zip, tmp_path / "from-zip.tar.zst")
    _same_tree(tree(extract(packed, tmp_path / "x1")), expected)
    _same_tree(tree(unzip(as_zip, tmp_path / "x2")), expected, zip_dates=True)
    with mounted(back, mnt, "--index-dir", str(tmp_path / "idx")):
        got = tree(mnt)
        assert os.stat(mnt / "hardlink_a").st_nlink == 1  # ZIP has no hard links: copies
    _same_tree(got, expected, zip_dates=True)
    with Archive(str(packed), index_dir=str(tmp_path / "idx")) as ar:  # tar -> tar keeps hard links
        assert ar.stat("hardlink_a").nlink == 3


def test_refuses_to_overwrite_without_force(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.tar.zst"
    out.write_bytes(b"precious")
    res = run_cli("pack", str(src), str(out))
    assert res.returncode == 2
    assert b"--force" in res.stderr
    assert out.read_bytes() == b"precious"
    res = run_cli("pack", "-q", str(src), str(out), "--force")
    assert res.returncode == 0, res.stderr
    assert out.read_bytes() != b"precious"
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_force_replaces_a_symlink_to_the_source_without_writing_through_it(src: Path, tmp_path: Path) -> None:
    """An output that is a symlink is replaced, not written through (README): one pointing at the
    source was refused as 'the output would overwrite the source'."""
    first = tmp_path / "first.tar.zst"
    run_cli("pack", "-q", str(src), str(first), check=True)
    before = first.read_bytes()
    link = tmp_path / "link.tar.zst"
    link.symlink_to(first.name)
    res = run_cli("pack", "-q", str(first), str(link), "--force")
    assert res.returncode == 0, res.stderr
    assert not link.is_symlink() and first.read_bytes() == before
    assert (
        run_cli("ls", "-R", str(link), check=True).stdout
        == run_cli("ls", "-R", str(first), check=True).stdout
    )
    # The same path as source and output (no link) is still refused.
    res = run_cli("pack", "-q", str(first), str(first), "--force")
    assert res.returncode == 2 and b"overwrite the source" in res.stderr


@pytest.mark.parametrize("bad", ["o.rar", "o.tar.gz"])
def test_unknown_output_format_is_a_usage_error(src: Path, tmp_path: Path, bad: str) -> None:
    res = run_cli("pack", str(src), str(tmp_path / bad))
    assert res.returncode == 2
    assert b".tar.zst" in res.stderr


def test_directory_mtimes_survive_plain_tar_x(tmp_path: Path) -> None:
    """Each directory is followed by its whole subtree (GNU tar's order): tar -x sets a directory's
    mtime when it leaves it, so files written into it later used to move it to the time of extraction."""
    import subprocess

    src = tmp_path / "src"
    for rel in ("a/b", "a/c", "x"):
        (src / rel).mkdir(parents=True)
    for rel in ("a/f.txt", "a/b/g.txt", "a/c/h.txt", "x/i.txt", "top.txt"):
        (src / rel).write_bytes(rel.encode())
    when = 946684800  # 2000-01-01
    for d in ("a/b", "a/c", "a", "x"):
        os.utime(src / d, (when, when))
    packed = cdmlfs_pack(src, tmp_path / "d.tar.zst")
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["tar", "--zstd", "-xf", str(packed), "-C", str(out)], check=True)
    for d in ("a", "a/b", "a/c", "x"):
        assert int((out / d).stat().st_mtime) == when, d


def test_pack_refusals_and_errors_are_one_line(src: Path, tmp_path: Path) -> None:
    for args, says in (
        (("--level", "99", str(src), str(tmp_path / "o.tar.zst")), b"--level"),
        (("--level", "10", str(src), str(tmp_path / "o.zip")), b"--level"),
        (("--level", "3", str(src), str(tmp_path / "o.tar")), b"not compressed"),
        (("--frame-size", "1M", str(src), str(tmp_path / "o.zip")), b"--frame-size applies to .tar.zst"),
        (("--frame-size", "1M", str(src), str(tmp_path / "o.tar")), b"--frame-size applies to .tar.zst"),
        ((str(src), str(tmp_path / "missing-dir" / "o.tar")), b"o.tar: cannot write"),
        # Larger frames cannot be decoded whole by any mount (1G was taken).
        (("--frame-size", "65M", str(src), str(tmp_path / "o.tar.zst")), b"between 4K and 64M"),
        # Taken for a local path before: with a folder ./s3:/bkt it even "packed ... into s3://bkt/o".
        ((str(src), "s3://bkt/o.tar.zst"), b"pack writes a local file"),
    ):
        res = run_cli("pack", "-q", *args)
        err = res.stderr.decode().strip()
        assert res.returncode != 0 and says.decode() in err and len(err.splitlines()) == 1, (args, err)
    # An output inside the directory being packed is never packed into itself (with --force twice).
    inner = tmp_path / "inner"
    (inner / "d").mkdir(parents=True)
    (inner / "d" / "f.txt").write_bytes(b"f")
    out = inner / "self.tar.zst"
    for _ in range(2):
        cdmlfs_pack(inner, out, "--force")
    with Archive(str(out), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.files() == ["d/f.txt"]


@pytest.mark.parametrize("how", ["symlink", "fifo", "removed"])
def test_a_file_replaced_while_packing_is_never_followed_or_waited_on(how: str, tmp_path: Path) -> None:
    """Listed as a regular file, then swapped before it is read: a symlink put the link target's
    bytes (any file on the machine) in the archive, a FIFO hung the pack, a removed file aborted
    it. The member keeps its announced size as zeros, and the file is reported as changed."""
    from cdmlfs.pack import entries_from_directory

    src = tmp_path / "src"
    src.mkdir()
    (src / "user.txt").write_bytes(b"u" * 1000)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"S" * 1000)
    changed: list[str] = []
    (entry,) = entries_from_directory(str(src), changed=changed)
    (src / "user.txt").unlink()
    if how == "symlink":
        (src / "user.txt").symlink_to(secret)
    elif how == "fifo":
        os.mkfifo(src / "user.txt")
    data = b"".join(entry.read())
    assert data == bytes(1000) and changed == [str(src / "user.txt")]


def test_pack_refuses_a_directory_as_output_before_packing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("a")
    (tmp_path / "out.zip").mkdir()
    res = run_cli("pack", "--force", str(src), str(tmp_path / "out.zip"))
    assert res.returncode == 2 and "is a directory" in res.stderr.decode()


def test_sigterm_during_pack_leaves_no_partial_output(tmp_path: Path) -> None:
    """SIGINT removed the hidden partial file; SIGTERM and SIGHUP left it (20 MiB, and packed into
    the next archive when it lay inside the source)."""
    import random
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "src"
    src.mkdir()
    for i in range(24):
        (src / f"f{i}").write_bytes(random.Random(i).randbytes(1 << 20))
    cmd = [
        sys.executable,
        "-m",
        "cdmlfs",
        "pack",
        "--threads",
        "1",
        "--level",
        "19",
        str(src),
        str(tmp_path / "o.tar.zst"),
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not any(p.name != "src" for p in tmp_path.iterdir()):  # the partial output exists: mid-pack
        assert proc.poll() is None and time.monotonic() < deadline, "pack ended before it could be stopped"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert code == 128 + signal.SIGTERM and leftovers == ["src"], (code, leftovers)
    # Under nohup (SIGHUP ignored) a hangup changes nothing: the pack completes.
    quick = [sys.executable, "-m", "cdmlfs", "pack", "--threads", "1", str(src), str(tmp_path / "n.tar.zst")]
    proc = subprocess.Popen(["nohup", *quick], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=60) == 0 and (tmp_path / "n.tar.zst").exists()


def test_an_unreadable_file_stops_the_pack_instead_of_being_zero_filled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a file that is gone (or now a symlink or socket) is zero-filled; EACCES, EMFILE or EIO
    is an error, as before (a zero-filled member's CRC matches its zeros: nothing would flag it)."""
    import errno

    from cdmlfs import pack as pack_module

    src = tmp_path / "src"
    src.mkdir()
    (src / "secret.txt").write_text("secret")
    (entry,) = pack_module.entries_from_directory(str(src), changed=(changed := []))
    real = os.open

    def denied(path, flags, *args, **kw):
        if str(path).endswith("secret.txt"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(pack_module.os, "open", denied)
    with pytest.raises(PermissionError):
        b"".join(entry.read())
    assert changed == []


def test_listing_a_directory_to_pack_holds_little_per_file(tmp_path: Path) -> None:
    """Packing holds every file's entry until the end: a million files took ~1.2 GB when each held
    two closures; a small object per file halves that."""
    import tracemalloc

    from cdmlfs.pack import entries_from_directory

    root = tmp_path / "many"
    for d in range(20):
        (root / f"d{d:02d}").mkdir(parents=True)
        for i in range(1000):
            (root / f"d{d:02d}" / f"img_{i:05d}.jpg").write_bytes(b"x")
    tracemalloc.start()
    try:
        entries = entries_from_directory(str(root))
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(entries) == 20 * 1001
    assert held / len(entries) < 800, f"{held / len(entries):.0f} bytes per entry"
    first = next(e for e in entries if e.read is not None)
    assert b"".join(first.read()) == b"x"


def test_names_that_are_not_utf8_and_special_mode_bits(tmp_path: Path) -> None:
    """A file name that is not UTF-8: kept byte for byte in .tar.zst, refused (one line) for .zip,
    which cannot store it as it is. setuid, setgid and sticky bits are not carried over."""
    import stat

    src = tmp_path / "src"
    src.mkdir()
    raw = os.fsdecode(b"caf\xe9.txt")
    (src / raw).write_bytes(b"latin-1 name")
    special = src / "tool"
    special.write_bytes(b"#!/bin/sh\n")
    special.chmod(0o4755)
    sticky = src / "shared"
    sticky.mkdir()
    sticky.chmod(0o1777)
    packed = cdmlfs_pack(src, tmp_path / "o.tar.zst")
    out = extract(packed, tmp_path / "x")
    assert (out / raw).read_bytes() == b"latin-1 name"  # tar -x gives back the same bytes
    assert stat.S_IMODE((out / "tool").stat().st_mode) == 0o4755  # from a directory: as tar keeps it
    with Archive(str(packed), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.read(raw) == b"latin-1 name"
        assert stat.S_IMODE(ar.stat("tool").mode) == 0o755  # a mount never shows them
    # Converting an archive keeps permission bits, not the special ones (README).
    converted = cdmlfs_pack(gnu_tar(tmp_path / "s.tar", src), tmp_path / "c.tar.zst")
    out = extract(converted, tmp_path / "y")
    assert stat.S_IMODE((out / "tool").stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "shared").stat().st_mode) == 0o777
    assert (out / raw).read_bytes() == b"latin-1 name"
    res = run_cli("pack", "-q", str(src), str(tmp_path / "o.zip"))
    err = res.stderr.decode().strip()
    assert res.returncode != 0 and "UTF-8" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o.zip").exists()


COMPRESSORS = {"gzip": ["gzip", "-c"], "bzip2": ["bzip2", "-c"], "xz": ["xz", "-c", "-T1"]}


@pytest.mark.fuse
@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_compressed_tars_convert_in_one_pass(kind: str, src: Path, tmp_path: Path, mnt: Path) -> None:
    """tar.gz / tar.bz2 / tar.xz as made by GNU tar piped through the compressor: packed with no
    extraction, the result extracts and mounts as the source tree (hard links kept as links)."""
    expected = tree(src)
    for fmt in ("gnu", "pax"):
        packed_from = gnu_tar(tmp_path / f"{fmt}.tar.{kind}", src, fmt, COMPRESSORS[kind])
        packed = cdmlfs_pack(packed_from, tmp_path / f"{fmt}.tar.zst", "--frame-size", "256K")
        _same_tree(tree(extract(packed, tmp_path / f"x-{fmt}")), expected)
    with mounted(packed, mnt, "--index-dir", str(tmp_path / "idx")):
        _same_tree(tree(mnt), expected)
        assert os.stat(mnt / "hardlink_a").st_nlink == 3
    with Archive(str(packed), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.format.stream.frames.total > 1  # seekable: frames of at most 256 KiB


def test_compressed_tar_to_plain_tar_and_progress_by_compressed_bytes(src: Path, tmp_path: Path) -> None:
    """The Python API: counts taken on the way, progress in compressed bytes up to the file's size."""
    from cdmlfs.pack import pack

    packed_from = gnu_tar(tmp_path / "s.tar.gz", src, "gnu", COMPRESSORS["gzip"])
    calls: list[tuple[int, int]] = []
    summary = pack(str(packed_from), str(tmp_path / "o.tar"), progress=lambda d, t: calls.append((d, t)))
    size = packed_from.stat().st_size
    assert calls[-1] == (size, size)
    assert all(t == size for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    files = {p.stat().st_ino: p.stat().st_size for p in src.rglob("*") if p.is_file() and not p.is_symlink()}
    assert summary["bytes"] == sum(files.values())  # hard links carry no bytes of their own
    _same_tree(tree(extract(tmp_path / "o.tar", tmp_path / "x")), tree(src))


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_compressed_tars_fail_with_one_line_and_no_output(src: Path, tmp_path: Path) -> None:
    """Corrupt or truncated streams, a damaged checksum with every tar byte intact, a damaged tar
    header inside a sound gzip stream, a gzip that holds no tar: exit 1, one line naming the file,
    nothing written. Refused up front: a ZIP from a compressed tar (exit 2)."""
    import gzip
    import io
    import tarfile

    good = gnu_tar(tmp_path / "good.tar.gz", src, "gnu", COMPRESSORS["gzip"])
    size = good.stat().st_size
    cases: dict[str, Path] = {}
    for name, change in (
        ("flipped.tar.gz", lambda p: _flip(p, size // 2)),
        ("truncated.tar.gz", lambda p: p.write_bytes(p.read_bytes()[: size * 2 // 3])),
        ("bad-crc.tar.gz", lambda p: _flip(p, size - 6)),  # the trailer's CRC-32: tar bytes all there
    ):
        p = tmp_path / name
        p.write_bytes(good.read_bytes())
        change(p)
        cases[name] = p
    # A tar whose second header is damaged (checksum no longer matches), in a sound gzip stream.
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for i in range(3):
            info = tarfile.TarInfo(f"f{i}.txt")
            info.size = 600
            tf.addfile(info, io.BytesIO(bytes([65 + i]) * 600))
    tar_bytes = bytearray(raw.getvalue())
    second = 512 + 1024  # header, 600 bytes of data padded to 1024
    assert tar_bytes[second : second + 6] == b"f1.txt"
    tar_bytes[second] = ord("g")
    cases["bad-header.tar.gz"] = tmp_path / "bad-header.tar.gz"
    cases["bad-header.tar.gz"].write_bytes(gzip.compress(bytes(tar_bytes)))
    # Two xz streams, the second damaged at its start: the standard library's reader took that
    # for trailing garbage and converted the first half with success.
    import subprocess

    plain = gnu_tar(tmp_path / "p.tar", src)
    with tarfile.open(plain) as tf:
        cut = [m.offset for m in tf][3]  # a header: the first stream ends as a shorter tar would
    first = subprocess.run(
        ["xz", "-c", "-T1"], input=plain.read_bytes()[:cut], capture_output=True, check=True
    )
    second = bytearray(
        subprocess.run(
            ["xz", "-c", "-T1"], input=plain.read_bytes()[cut:], capture_output=True, check=True
        ).stdout
    )
    second[20] ^= 0xFF
    cases["bad-second-stream.tar.xz"] = tmp_path / "bad-second-stream.tar.xz"
    cases["bad-second-stream.tar.xz"].write_bytes(first.stdout + bytes(second))
    cases["not-a-tar.tar.gz"] = tmp_path / "not-a-tar.tar.gz"
    cases["not-a-tar.tar.gz"].write_bytes(gzip.compress(b"just,some,csv\n" * 1000))
    for name, path in cases.items():
        out = tmp_path / f"{name}.tar.zst"
        res = run_cli("pack", "-q", str(path), str(out))
        err = res.stderr.decode().strip()
        assert res.returncode == 1 and str(path) in err and len(err.splitlines()) == 1, (name, err)
        assert "Traceback" not in err
        assert not out.exists(), name
    assert (
        "corrupt tar header"
        in run_cli("pack", "-q", str(cases["bad-header.tar.gz"]), str(tmp_path / "o.tar")).stderr.decode()
    )
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]
    res = run_cli("pack", "-q", str(good), str(tmp_path / "o.zip"))
    assert res.returncode == 2 and b".tar.zst" in res.stderr and not (tmp_path / "o.zip").exists()


@pytest.mark.parametrize("compress", [None, "gzip", "zstd"])
def test_a_tar_stream_on_standard_input(compress: str | None, src: Path, tmp_path: Path) -> None:
    """``cdmlfs pack - OUT`` (say ``aws s3 cp s3://b/k.tar.gz - | cdmlfs pack - OUT``): what the
    stream is comes from its first bytes; a damaged zstd frame (its checksum) stops the pack."""
    cmd = {None: None, "gzip": COMPRESSORS["gzip"], "zstd": ["zstd", "-q", "-c"]}[compress]
    piped = gnu_tar(tmp_path / "in", src, "pax", cmd)
    out = tmp_path / "o.tar.zst"
    with open(piped, "rb") as stdin:
        res = run_cli("pack", "-q", "-", str(out), stdin=stdin)
    assert res.returncode == 0, res.stderr.decode()
    _same_tree(tree(extract(out, tmp_path / "x")), tree(src))
    if compress == "zstd":
        _flip(piped, piped.stat().st_size // 2)
        with open(piped, "rb") as stdin:
            res = run_cli("pack", "-q", "-", str(tmp_path / "bad.tar.zst"), stdin=stdin)
        err = res.stderr.decode().strip()
        assert res.returncode == 1 and "standard input" in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "bad.tar.zst").exists()


def test_a_fifo_or_process_substitution_is_read_as_a_stream(src: Path, tmp_path: Path) -> None:
    """``cdmlfs pack <(curl ... ) OUT`` names /dev/fd/N, a pipe: read once, as standard input is."""
    piped = gnu_tar(tmp_path / "in", src, "pax", COMPRESSORS["gzip"])
    out = tmp_path / "o.tar.zst"
    script = f"{shlex.join([*CDMLFS, 'pack', '-q'])} <(cat {shlex.quote(str(piped))}) {shlex.quote(str(out))}"
    res = subprocess.run(["bash", "-c", script], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr.decode()
    _same_tree(tree(extract(out, tmp_path / "x")), tree(src))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["bash", "-c", f"cat {shlex.quote(str(piped))} > {shlex.quote(str(fifo))}"])
    try:
        res = run_cli("pack", "-q", str(fifo), str(tmp_path / "f.tar"), timeout=60)
    finally:
        writer.wait(timeout=30)
    assert res.returncode == 0, res.stderr.decode()
    _same_tree(tree(extract(tmp_path / "f.tar", tmp_path / "y")), tree(src))


def test_standard_input_refusals_are_one_line(src: Path, tmp_path: Path) -> None:
    as_zip = tmp_path / "in.zip"
    with zipfile.ZipFile(as_zip, "w") as zf:
        zf.writestr("a.txt", b"a")
    tar = gnu_tar(tmp_path / "in.tar", src)
    for stdin_path, out, code, says in (
        (as_zip, "o.tar.zst", 2, "ZIP cannot be read from a pipe"),
        (Path(os.devnull), "o.tar.zst", 2, "standard input is empty"),
        (tar, "o.zip", 2, ".tar.zst or .tar only"),
    ):
        with open(stdin_path, "rb") as stdin:
            res = run_cli("pack", "-q", "-", str(tmp_path / out), stdin=stdin)
        err = res.stderr.decode().strip()
        assert res.returncode == code and says in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / out).exists()


def _tar_of(path: Path, members: list[tuple[str, bytes, bytes, dict]]) -> Path:
    """A pax tar of (name, type flag, data, pax records) written by Python's tarfile."""
    import io
    import tarfile

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, typ, data, pax in members:
            info = tarfile.TarInfo(name)
            info.type, info.size, info.mtime, info.pax_headers = typ, len(data), 1_600_000_000, pax
            tf.addfile(info, io.BytesIO(data))
    return path


def test_a_stream_packs_as_the_same_tar_unpacked(tmp_path: Path) -> None:
    """The stream path shares the mount's tar parser: GNU incremental dumps (``tar -g``: 'D'
    entries, atime/ctime where ustar keeps a prefix), unknown type flags (shown as files), a
    pre-POSIX directory, a NaN pax mtime, and concatenated xz streams convert exactly as the same
    tar, uncompressed, does. A plain tar whose first name starts like a bzip2 stream stays a tar."""
    import subprocess

    src = tmp_path / "src"
    (src / "emptydir").mkdir(parents=True)
    (src / "plain.txt").write_bytes(b"plain\n" * 100)
    incremental = tmp_path / "incr.tar"
    subprocess.run(
        ["tar", "-g", str(tmp_path / "snar"), "-cf", str(incremental), "-C", str(src), "."], check=True
    )
    odd = _tar_of(
        tmp_path / "odd.tar",
        [
            ("unknown.bin", b"Z", b"zzzzz", {}),
            ("v7dir/", b"0", b"", {}),
            ("cont.bin", b"7", b"contiguous", {}),
            ("nan.txt", b"0", b"nan mtime", {"mtime": "nan"}),
        ],
    )
    bzh = _tar_of(tmp_path / "bzh.tar", [("BZh91AY&SY.txt", b"0", b"looks like bzip2", {})])
    two_streams = tmp_path / "two.tar.xz"
    data = odd.read_bytes()
    xz = ["xz", "-c", "-T1"]
    two_streams.write_bytes(
        subprocess.run(xz, input=data[:1536], capture_output=True, check=True).stdout
        + subprocess.run(xz, input=data[1536:], capture_output=True, check=True).stdout
    )
    for plain, compressed in (
        (incremental, gnu_tar_copy(incremental, COMPRESSORS["gzip"])),
        (odd, gnu_tar_copy(odd, COMPRESSORS["bzip2"])),
        (odd, two_streams),
        (bzh, bzh),
    ):
        want = tree(extract(cdmlfs_pack(plain, tmp_path / "a.tar", "--force"), tmp_path / "a"))
        got = tree(extract(cdmlfs_pack(compressed, tmp_path / "b.tar", "--force"), tmp_path / "b"))
        assert got == want, compressed.name
        assert got, compressed.name
        for d in ("a", "b"):
            subprocess.run(["rm", "-rf", str(tmp_path / d)], check=True)
    assert "emptydir" in tree(extract(cdmlfs_pack(incremental, tmp_path / "c.tar"), tmp_path / "c"))


def gnu_tar_copy(tar: Path, compress: list[str]) -> Path:
    """``tar`` piped through a compressor, beside it."""
    import subprocess

    out = tar.with_name(f"{tar.name}.{compress[0]}")
    with open(tar, "rb") as f, open(out, "wb") as o:
        subprocess.run(compress, stdin=f, stdout=o, check=True)
    return out


def test_a_truncated_stream_never_packs_part_of_the_archive() -> None:
    """Cut anywhere, a compressed tar either fails (ArchiveFormatError) or gives every member
    whole: never fewer members with success. zstd's stream decoder takes an input that stops inside
    a frame for a normal end (a cut on a block boundary packed 1 member of 4); a tar that ends
    inside a header is an error for pack (the mount lists what came before)."""
    import bz2
    import gzip
    import io
    import lzma
    import random
    import tarfile

    import zstandard

    from cdmlfs.errors import ArchiveFormatError
    from cdmlfs.pack import entries_from_tar_stream

    rng = random.Random(2)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, size in (("a", 130_560), ("b", 5000), ("c", 200_000), ("d", 10)):
            info = tarfile.TarInfo(name)
            info.size = size
            tf.addfile(info, io.BytesIO(rng.randbytes(size)))
    tar = raw.getvalue()

    def members(data: bytes, kind: str) -> dict[str, bytes]:
        entries = entries_from_tar_stream(io.BytesIO(data), "x", kind)
        return {e.name: b"".join(e.read()) if e.read else b"" for e in entries}

    full = members(tar, "tar")
    assert sorted(full) == ["a", "b", "c", "d"]
    compress = {
        "tar": lambda b: b,  # cut at a header boundary it has no end-of-archive blocks: refused
        "gzip": lambda b: gzip.compress(b, mtime=0),
        "bzip2": bz2.compress,
        "xz": lzma.compress,
        "zstd": zstandard.ZstdCompressor(write_checksum=True).compress,
    }
    header_cut = 512 + 130_560 + 100  # inside the header of "b"
    headers = [512 + 130_560, 1024 + 130_560 + 5120, 1536 + 130_560 + 5120 + 200_192]
    for kind, make in compress.items():
        data = make(tar)
        cuts = {rng.randrange(1, len(data)) for _ in range(40)} | set(range(len(data) - 12, len(data)))
        if kind == "tar":  # on a header boundary, and inside a member's padding (byte 5000 of 5120)
            cuts |= {*headers, 1024 + 130_560 + 5000}
        for cut in sorted(cuts):
            try:
                got = members(data[:cut], kind)
            except ArchiveFormatError:
                continue
            assert got == full, (kind, cut, sorted(got))
        with pytest.raises(ArchiveFormatError, match="ends inside a header"):
            members(make(tar[:header_cut]), kind)
    import threading

    # Every read-ahead thread was stopped when its pack failed or ended.
    assert not [t for t in threading.enumerate() if t.name == "cdmlfs-pack-read"]


def test_an_xz_header_asking_for_a_huge_dictionary_is_refused(tmp_path: Path) -> None:
    """xz decoders fill the dictionary a block header declares (up to 4 GiB): a 100 KB file took
    750 MB of RSS. The decoder's memory is capped; the pack fails with one line."""
    import lzma
    import struct
    import zlib

    zeros = bytes(4 << 20)
    data = bytearray(lzma.compress(_tar_of(tmp_path / "z.tar", [("z.bin", b"0", zeros, {})]).read_bytes(),
                                   format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32, preset=0))  # fmt: skip
    block = 12  # the first block header follows the 12-byte stream header
    size = (data[block] + 1) * 4
    flags = data[block + 1]
    assert not flags & 0xC0  # no compressed/uncompressed sizes: the filter flags come next
    assert data[block + 2] == 0x21 and data[block + 3] == 1  # LZMA2, one property byte
    data[block + 4] = 40  # dictionary size code 40: 4 GiB
    data[block + size - 4 : block + size] = struct.pack(
        "<I", zlib.crc32(bytes(data[block : block + size - 4]))
    )
    bomb = tmp_path / "dict.tar.xz"
    bomb.write_bytes(bytes(data))
    res = run_cli("pack", "-q", str(bomb), str(tmp_path / "o.tar.zst"))
    err = res.stderr.decode().strip()
    assert res.returncode == 1 and "dictionary needs more than" in err and len(err.splitlines()) == 1, err
    assert "xz -dc" in err  # the way out: xz itself decompresses it into a pipe


def test_a_bad_number_in_an_old_gnu_sparse_map_is_one_line(tmp_path: Path) -> None:
    """A sparse map field that is no octal number: a traceback from ls, a mount and pack alike."""
    import gzip
    import subprocess

    src = tmp_path / "src"
    src.mkdir()
    with open(src / "holes.bin", "wb") as f:
        f.seek(1 << 20)
        f.write(b"data")
    tar = tmp_path / "s.tar"
    subprocess.run(
        ["tar", "--format=gnu", "--sparse", "-cf", str(tar), "-C", str(src), "holes.bin"], check=True
    )
    data = bytearray(tar.read_bytes())
    pos = next(p for p in range(0, len(data), 512) if data[p + 156 : p + 157] == b"S")
    header = data[pos : pos + 512]
    header[386:398] = b"zzzzzzzzzzz\0"
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    data[pos : pos + 512] = header
    tar.write_bytes(bytes(data))
    (tmp_path / "s.tar.gz").write_bytes(gzip.compress(bytes(data)))
    for args in (("ls", str(tar)), ("pack", "-q", str(tmp_path / "s.tar.gz"), str(tmp_path / "o.tar.zst"))):
        res = run_cli(*args)
        err = res.stderr.decode().strip()
        assert res.returncode == 1 and "corrupt tar header" in err and len(err.splitlines()) == 1, err


def test_packed_output_cut_at_a_frame_boundary_is_refused_on_standard_input(
    src: Path, tmp_path: Path
) -> None:
    """cdmlfs pack's frames end on member boundaries: such a file cut after any frame is a valid zstd
    stream holding a valid tar, minus its end-of-archive blocks. Piped back in, it must not pass for
    the whole archive. The whole file, and one led by a skippable frame (pzstd's), pack."""
    import io

    from cdmlfs.errors import ArchiveFormatError
    from cdmlfs.pack import entries_from_tar_stream
    from cdmlfs.zstd_seekable import read_seek_table, skippable_frame

    packed = cdmlfs_pack(src, tmp_path / "p.tar.zst", "--frame-size", "64K")
    frames = read_seek_table(LocalFile(str(packed)))
    assert frames is not None
    data = packed.read_bytes()
    ends = [f.offset + f.comp_size for f in frames if f.content_size][:-1]
    assert len(ends) > 10

    def consume(blob: bytes) -> int:
        return sum(
            1 for e in entries_from_tar_stream(io.BytesIO(blob), "x", "zstd") if not e.read or list(e.read())
        )

    whole = consume(data)
    for end in ends:
        with pytest.raises(ArchiveFormatError, match="truncated copy"):  # in a member, or at its end
            consume(data[:end])
    led = tmp_path / "led.tar.zst"
    led.write_bytes(skippable_frame(b"pzstd-like header") + data)
    with open(led, "rb") as stdin:
        res = run_cli("pack", "-q", "-", str(tmp_path / "o.tar"), stdin=stdin)
    assert res.returncode == 0, res.stderr.decode()
    assert consume(data) == whole
    _same_tree(tree(extract(tmp_path / "o.tar", tmp_path / "x")), tree(src))


def test_a_lone_zero_block_stops_a_stream_pack_but_not_a_listing(tmp_path: Path) -> None:
    """A zero block in place of a header (a zeroed header, most likely) ends the tar for tar -x and
    the mount, with a warning; packed as a stream, the members after it would be lost: refused."""
    tar = _tar_of(tmp_path / "t.tar", [(f"f{i}.txt", b"0", b"x" * 600, {}) for i in range(4)]).read_bytes()
    second = 3 * 512  # header, 600 bytes padded to 1024: the second header
    damaged = tmp_path / "lone.tar"
    damaged.write_bytes(tar[:second] + bytes(512) + tar[second + 512 :])
    with open(damaged, "rb") as stdin:
        res = run_cli("pack", "-q", "-", str(tmp_path / "o.tar.zst"), stdin=stdin)
    err = res.stderr.decode().strip()
    assert res.returncode == 1 and "lone zero block" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o.tar.zst").exists()
    res = run_cli("ls", str(damaged))
    assert res.returncode == 0 and res.stdout.split() == [b"f0.txt"], res
    assert b"lone zero block" in res.stderr


def test_a_tar_zst_without_seek_table_packs_as_one_stream(src: Path, tmp_path: Path) -> None:
    """tar --zstd and pzstd output has no seek table: read as a stream it is decoded once and needs
    no index (none is written to --index-dir; as an archive it was scanned, indexed and copied
    through a 256 MiB cache: 350 MB of RSS). ZIP output, which a stream cannot feed, still works."""
    single = gnu_tar(tmp_path / "single.tar.zst", src, "pax", ["zstd", "-q", "-c"])
    index = tmp_path / "idx"
    out = cdmlfs_pack(single, tmp_path / "o.tar.zst", "--index-dir", str(index))
    assert not index.exists() or not any(index.iterdir())
    _same_tree(tree(extract(out, tmp_path / "x")), tree(src))
    as_zip = cdmlfs_pack(single, tmp_path / "o.zip", "--index-dir", str(index))
    _same_tree(tree(unzip(as_zip, tmp_path / "z")), tree(src), zip_dates=True)


def test_sigterm_while_standard_input_stalls_exits_at_once(src: Path, tmp_path: Path) -> None:
    """The read-ahead thread blocked in a read of a stalled pipe held sys.stdin's buffer lock:
    Python aborted at exit ("could not acquire lock ... at interpreter shutdown", rc 134, seconds
    later). Reading the descriptor itself, the pack ends as SIGTERM asks: 143, no partial file."""
    import signal
    import subprocess
    import sys
    import time

    gz = gnu_tar(tmp_path / "t.tar.gz", src, "gnu", COMPRESSORS["gzip"])
    out = tmp_path / "o.tar.zst"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdmlfs", "pack", "-q", "-", str(out)],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(gz.read_bytes()[: gz.stat().st_size // 2])
    proc.stdin.flush()  # and then nothing more: the pipe stays open, stalled
    # Signalled once the pack has read all of it (its handler is set before it reads): a fixed
    # sleep was too short for a slow machine to start Python, and SIGTERM then killed it outright.
    import array
    import fcntl
    import termios

    waiting = array.array("i", [1])
    deadline = time.monotonic() + 60
    while waiting[0] and time.monotonic() < deadline:
        fcntl.ioctl(proc.stdin.fileno(), termios.FIONREAD, waiting)  # bytes still in the pipe
        time.sleep(0.05)
    assert not waiting[0], "cdmlfs pack never read its input"
    time.sleep(0.5)  # into its next read, which stalls
    proc.send_signal(signal.SIGTERM)
    t = time.monotonic()
    try:
        rc = proc.wait(timeout=10)
    finally:
        proc.stdin.close()
    assert rc == 128 + signal.SIGTERM, proc.stderr.read().decode()  # type: ignore[union-attr]
    assert time.monotonic() - t < 3
    assert b"Fatal Python error" not in proc.stderr.read()  # type: ignore[union-attr]
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name] and not out.exists()


def test_zstd_files_the_stream_path_refuses_fall_back_to_the_archive_path(src: Path, tmp_path: Path) -> None:
    """A single-frame tar.zst whose tar lacks its end-of-archive blocks (the archive path packed it
    before zstd files were read as streams), and a malformed seek table (the archive path warns and
    walks the frames): both still pack, with a warning."""
    import subprocess

    from cdmlfs.zstd_seekable import seek_table_frame

    plain = gnu_tar(tmp_path / "t.tar", src)
    data = plain.read_bytes().rstrip(b"\0")
    data += bytes(-len(data) % 512)  # the last member's padding back, no end-of-archive blocks
    noend = tmp_path / "noend.tar.zst"
    noend.write_bytes(
        subprocess.run(["zstd", "-q", "-c"], input=data, capture_output=True, check=True).stdout
    )
    frame = subprocess.run(
        ["zstd", "-q", "-c"], input=plain.read_bytes(), capture_output=True, check=True
    ).stdout
    table = bytearray(seek_table_frame([(len(frame), plain.stat().st_size)]))
    table[-5] |= 4  # a reserved descriptor bit
    odd = tmp_path / "odd-table.tar.zst"
    odd.write_bytes(frame + bytes(table))
    for path, says in ((noend, "end-of-archive"), (odd, "reserved")):
        res = run_cli("pack", "-q", str(path), str(tmp_path / f"{path.name}.out.tar.zst"))
        assert res.returncode == 0 and says in res.stderr.decode(), res.stderr.decode()
        _same_tree(
            tree(extract(tmp_path / f"{path.name}.out.tar.zst", tmp_path / f"x-{path.name}")), tree(src)
        )


def test_a_non_blocking_standard_input_is_waited_for(src: Path, tmp_path: Path) -> None:
    """A parent may leave the pipe non-blocking: a read before data arrives raised EAGAIN ("Resource
    temporarily unavailable", exit 1). Such a pipe is waited for, as a blocking read would."""
    import subprocess
    import sys
    import time

    data = gnu_tar(tmp_path / "t.tar.gz", src, "gnu", COMPRESSORS["gzip"]).read_bytes()
    out = tmp_path / "o.tar.zst"
    r, w = os.pipe()
    os.set_blocking(r, False)
    proc = subprocess.Popen([sys.executable, "-m", "cdmlfs", "pack", "-q", "-", str(out)], stdin=r,
                            stderr=subprocess.PIPE)  # fmt: skip
    os.close(r)
    try:
        time.sleep(0.5)  # nothing yet: the first read finds the pipe empty
        os.write(w, data[:1000])
        time.sleep(0.5)  # a stall in the middle of the stream
        with os.fdopen(w, "wb") as f:
            f.write(data[1000:])
    finally:
        rc = proc.wait(timeout=60)
    assert rc == 0, proc.stderr.read().decode()  # type: ignore[union-attr]
    _same_tree(tree(extract(out, tmp_path / "x")), tree(src))


def test_an_output_that_is_a_symlink_is_replaced_and_its_target_still_packed(tmp_path: Path) -> None:
    """``pack SRC SRC/link.tar.zst --force`` with link.tar.zst -> real.tar.zst: the link is what gets
    replaced, so the file it points to is a source file like any other. It used to be left out as
    "the output" (resolved through the link), silently."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a")
    (src / "real.tar.zst").write_bytes(b"important")
    (src / "link.tar.zst").symlink_to("real.tar.zst")
    cdmlfs_pack(src, src / "link.tar.zst", "--force")
    assert not (src / "link.tar.zst").is_symlink() and (src / "real.tar.zst").read_bytes() == b"important"
    with Archive(str(src / "link.tar.zst"), index_dir=str(tmp_path / "idx")) as ar:
        assert sorted(ar.files()) == ["a", "real.tar.zst"]  # the link itself, replaced, is not packed


def test_a_symlink_planted_at_the_temporary_name_is_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hidden partial file beside OUT is created exclusively and without following links: a
    symlink under the name it would take (guessable: it was .OUT.partial-PID) used to have its
    target truncated and overwritten with the archive."""
    from cdmlfs import pack as packmod

    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a" * 100)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    tokens = iter(["guessed", "fresh"])
    monkeypatch.setattr(packmod.secrets, "token_hex", lambda n: next(tokens))
    out = tmp_path / "o.tar.zst"
    (tmp_path / f".o.tar.zst.partial-{os.getpid()}-guessed").symlink_to(victim)
    packmod.pack(str(src), str(out))
    assert victim.read_bytes() == b"precious"
    assert out.is_file() and not out.is_symlink()
    assert extract(out, tmp_path / "x").joinpath("a").read_bytes() == b"a" * 100
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("how", ["grew", "rewritten", "empty grew"])
def test_a_file_written_while_packed_is_reported_as_changed(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GNU tar: "file changed as we read it", exit 1. A file that grew was cut to its listed size
    without a word (and exit 0); one rewritten in place as it was read was not noticed either; an
    empty one was never even opened."""
    from cdmlfs import pack as packmod

    src = tmp_path / "src"
    src.mkdir()
    log = src / "log"
    size = 0 if how == "empty grew" else 1000
    log.write_bytes(b"a" * size)
    changed: list[str] = []
    (entry,) = packmod.entries_from_directory(str(src), changed=changed)
    if how == "empty grew":
        log.write_bytes(b"late")
        for kind in ("tar", "zip"):
            changed.clear()
            with open(tmp_path / f"o.{kind}", "wb") as f:
                if kind == "tar":
                    packmod.write_tar([entry], packmod._PlainTarSink(f), None, 0)
                else:
                    packmod.write_zip([entry], f, 6, None, 0)
            assert changed == [str(log)], kind
        return
    if how == "grew":
        with open(log, "ab") as f:
            f.write(b"b" * 5000)
    else:
        real_fstat = os.fstat
        calls = []

        def fstat_then_write(fd: int) -> os.stat_result:  # the file is rewritten between its reads
            calls.append(fd)
            if len(calls) == 2:
                os.utime(log, ns=(0, 0))  # moves its ctime, as a write does
            return real_fstat(fd)

        monkeypatch.setattr(packmod.os, "fstat", fstat_then_write)
    data = b"".join(entry.read())
    assert data == b"a" * size and changed == [str(log)]


def test_zip_output_times_past_2038_and_before_1970(tmp_path: Path) -> None:
    """The extended timestamp is written unsigned (as Info-ZIP does, and unzip and libarchive read it),
    and left out before 1970, where readers disagreed (libarchive read 1960 as 2096): the DOS date
    (1980-01-01) is then what every reader shows."""
    src = tmp_path / "src"
    src.mkdir()
    for name, when in (("f2040", 2_208_988_800), ("f1960", -305_000_000), ("now", 1_700_000_000)):
        (src / name).write_bytes(name.encode())
        os.utime(src / name, (when, when))
    out = cdmlfs_pack(src, tmp_path / "o.zip")
    with zipfile.ZipFile(out) as zf:
        extra = {i.filename: i.extra for i in zf.infolist()}
    assert extra["f1960"] == b""
    assert extra["f2040"] == b"UT\x05\x00\x01" + (2_208_988_800).to_bytes(4, "little")
    with Archive(str(out)) as ar:
        assert ar.stat("f2040").mtime == 2_208_988_800
        assert ar.stat("now").mtime == 1_700_000_000
        assert abs(ar.stat("f1960").mtime - 315_532_800) <= 86_400  # the DOS date: 1980-01-01, local


def test_a_stream_pack_drops_hard_links_to_members_it_does_not_copy(tmp_path: Path) -> None:
    """A hard link to a FIFO (which pack does not copy) was kept, naming a member not in the output:
    tar -x of the output failed ("Cannot hard link"). The stream path now follows the mount's rule,
    as the archive path did: such a link is skipped, with a warning."""
    import gzip
    import io
    import tarfile

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as t:
        for name, typ, link in (("ff", tarfile.FIFOTYPE, ""), ("hl_ff", tarfile.LNKTYPE, "ff")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = typ, link
            t.addfile(info)
        info = tarfile.TarInfo("ok")
        info.size = 3
        t.addfile(info, io.BytesIO(b"ok\n"))
        info = tarfile.TarInfo("hl_ok")
        info.type, info.linkname = tarfile.LNKTYPE, "ok"
        t.addfile(info)
        for name, typ, link in (("sym", tarfile.SYMTYPE, "ok"), ("hl_sym", tarfile.LNKTYPE, "sym")):
            info = tarfile.TarInfo(name)  # a hard link to a symlink is kept, as the mount keeps it
            info.type, info.linkname = typ, link
            t.addfile(info)
    (tmp_path / "s.tar.gz").write_bytes(gzip.compress(raw.getvalue()))
    res = run_cli("pack", "-q", str(tmp_path / "s.tar.gz"), str(tmp_path / "o.tar.zst"))
    err = res.stderr.decode()
    assert res.returncode == 0, err
    assert "skipping hard link 'hl_ff'" in err and "1 device/FIFO" in err
    x = extract(tmp_path / "o.tar.zst", tmp_path / "x")
    assert sorted(p.name for p in x.iterdir()) == ["hl_ok", "hl_sym", "ok", "sym"]
    assert (x / "hl_ok").stat().st_ino == (x / "ok").stat().st_ino
    assert os.readlink(x / "hl_sym") == "ok" and (x / "hl_sym").lstat().st_ino == (x / "sym").lstat().st_ino


def test_a_path_too_long_for_a_zip_name_is_one_line(tmp_path: Path) -> None:
    """A tar may hold a 65,536-byte path (each component within 255 bytes): a ZIP name cannot. It was
    a struct.error traceback from zipfile; now a one-line error, and no output."""
    import io
    import tarfile

    name = "/".join(["d" * 200] * 330) + "/f"
    with tarfile.open(tmp_path / "long.tar", "w", format=tarfile.PAX_FORMAT) as t:
        info = tarfile.TarInfo(name)
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    res = run_cli("pack", "-q", str(tmp_path / "long.tar"), str(tmp_path / "o.zip"))
    err = res.stderr.decode().strip()
    assert res.returncode == 2 and "65,535" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o.zip").exists() and not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_a_file_rewritten_after_the_listing_is_reported_as_changed(tmp_path: Path) -> None:
    """Same size, rewritten between the listing and its read: new bytes under the listed mtime went
    in without a word (exit 0); GNU tar stats a file right before its header."""
    from cdmlfs import pack as packmod

    src = tmp_path / "src"
    src.mkdir()
    f = src / "zz"
    f.write_bytes(b"AAAA")
    os.utime(f, (1_577_836_800, 1_577_836_800))
    changed: list[str] = []
    (entry,) = packmod.entries_from_directory(str(src), changed=changed)
    f.write_bytes(b"BBBB")
    assert b"".join(entry.read()) == b"BBBB" and changed == [str(f)]


def test_directories_and_links_removed_while_listed_are_skipped_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder or symlink removed between being seen and being read aborted the whole pack
    (a usage error, or FileNotFoundError); a vanished file was already skipped, as by GNU tar."""
    from cdmlfs import pack as packmod

    src = tmp_path / "src"
    (src / "d1/sub").mkdir(parents=True)
    (src / "d1/sub/x").write_bytes(b"x")
    (src / "keep").write_bytes(b"k")
    os.symlink("keep", src / "link")
    real_scandir, real_readlink = os.scandir, os.readlink

    def scandir_after_removal(path):  # (os is patched for everyone: rmtree would call this too)
        if isinstance(path, str) and path.endswith("sub"):
            os.unlink(f"{path}/x")
            os.rmdir(path)
        return real_scandir(path)

    def readlink_after_removal(path, *a, **kw):
        os.unlink(path)
        return real_readlink(path, *a, **kw)

    monkeypatch.setattr(packmod.os, "scandir", scandir_after_removal)
    monkeypatch.setattr(packmod.os, "readlink", readlink_after_removal)
    changed: list[str] = []
    names = [e.name for e in packmod.entries_from_directory(str(src), changed=changed)]
    assert names == ["d1", "d1/sub", "keep"]
    assert changed == [str(src / "d1/sub"), str(src / "link")]


def test_paths_through_a_link_and_dotdot_are_resolved_as_the_kernel_does(tmp_path: Path) -> None:
    """'lnk/..' is the parent of the link's target: abspath made it the link's own folder, and
    another directory than `tar -C lnk/..` was packed (the output went elsewhere too)."""
    (tmp_path / "real/inner").mkdir(parents=True)
    (tmp_path / "real/marker_real").write_bytes(b"R")
    (tmp_path / "work").mkdir()
    (tmp_path / "work/marker_work").write_bytes(b"W")
    os.symlink("../real/inner", tmp_path / "work/lnk")
    res = run_cli("pack", "-q", "lnk/..", "lnk/../o.tar", cwd=tmp_path / "work")
    assert res.returncode == 0, res.stderr.decode()
    assert (tmp_path / "real/o.tar").exists() and not (tmp_path / "work/o.tar").exists()
    with Archive(str(tmp_path / "real/o.tar"), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.listdir("") == ["inner", "marker_real"]  # not the output itself


def test_force_keeps_the_mode_of_the_archive_it_replaces_and_long_names_work(
    src: Path, tmp_path: Path
) -> None:
    """--force over a private 0600 archive made it 0644; an output name over ~230 bytes was refused
    (the temporary name beside it went past NAME_MAX)."""
    out = tmp_path / "private.tar.zst"
    out.write_bytes(b"old")
    out.chmod(0o600)
    assert run_cli("pack", "-q", str(src), str(out), "--force").returncode == 0
    assert out.stat().st_mode & 0o777 == 0o600
    long = tmp_path / ("n" * 240 + ".tar.zst")
    res = run_cli("pack", "-q", str(src), str(long))
    assert res.returncode == 0 and long.stat().st_size > 0, res.stderr.decode()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_too_many_frames_stop_early_with_one_line(tmp_path: Path) -> None:
    """The seek table's frame limit was checked after everything was compressed, and then failed
    with a traceback. (The limit is lowered here: 0x8000000 frames is 512 GiB of 4 KiB frames.)"""
    import sys

    src = tmp_path / "src"
    src.mkdir()
    (src / "big").write_bytes(os.urandom(64 << 10))
    code = (
        "import sys, cdmlfs.pack as p; p.MAX_SEEK_TABLE_FRAMES = 6; from cdmlfs.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "o.tar.zst"
    res = subprocess.run(
        [sys.executable, "-c", code, "pack", str(src), str(out), "--frame-size", "4K"],
        capture_output=True,
        timeout=120,
    )
    err = res.stderr.decode()
    assert res.returncode == 2 and len(err.splitlines()) == 1 and "--frame-size" in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_zip_progress_counts_the_copies_hard_links_become(tmp_path: Path) -> None:
    from cdmlfs.pack import pack

    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(os.urandom(300_000))
    for name in ("b", "c"):
        os.link(src / "a", src / name)
    seen: list[tuple[int, int]] = []
    pack(str(src), str(tmp_path / "o.zip"), progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (900_000, 900_000)


def test_files_are_packed_as_they_are_when_their_turn_comes(tmp_path: Path) -> None:
    """The whole tree was listed before anything was written, and each header came from that
    listing: a file removed meanwhile became zeros of its old size (GNU tar leaves it out), one
    replaced by rename was packed as zeros too, and a hard link whose first name went pointed at
    nothing. The listing's window was the whole pack, which can take hours."""
    import tarfile

    from cdmlfs.pack import _as_they_are_now, _PlainTarSink, entries_from_directory, write_tar

    src = tmp_path / "src"
    src.mkdir()
    (src / "gone.txt").write_bytes(b"g" * 100)
    (src / "renamed_over.txt").write_bytes(b"old")
    (src / "touched.txt").write_bytes(b"t" * 10)
    (src / "a_first").write_bytes(b"linked bytes")
    os.link(src / "a_first", src / "b_link")
    os.link(src / "a_first", src / "c_link")
    (src / "x_saved").write_bytes(b"old bytes of x")  # hard-linked, then saved by an editor (rename)
    os.link(src / "x_saved", src / "y_link")
    changed: list[str] = []
    listed = entries_from_directory(str(src), changed=changed)
    # What happens to a tree while a long pack works through it:
    (src / "gone.txt").unlink()
    (src / "new.tmp").write_bytes(b"new and longer content")
    os.replace(src / "new.tmp", src / "renamed_over.txt")
    os.utime(src / "touched.txt", (1_000_000_000, 1_000_000_000))
    (src / "a_first").unlink()
    (src / "x.tmp").write_bytes(b"new x")
    os.replace(src / "x.tmp", src / "x_saved")
    out = tmp_path / "o.tar"
    with open(out, "wb") as f:
        write_tar(_as_they_are_now(listed), _PlainTarSink(f), None, None)
    with tarfile.open(out) as tf:
        names = tf.getnames()
        assert "gone.txt" not in names and "a_first" not in names
        assert tf.extractfile("renamed_over.txt").read() == b"new and longer content"
        assert tf.getmember("touched.txt").mtime == 1_000_000_000
        assert tf.getmember("b_link").isfile() and tf.extractfile("b_link").read() == b"linked bytes"
        link = tf.getmember("c_link")
        assert link.islnk() and link.linkname == "b_link"
        # y_link kept the old inode: as a link to the new x_saved it read "new x" (no warning).
        assert tf.extractfile("x_saved").read() == b"new x"
        assert tf.getmember("y_link").isfile() and tf.extractfile("y_link").read() == b"old bytes of x"
    assert changed == [str(src / "a_first"), str(src / "gone.txt")]  # said once each (exit 1)
    unpacked = tmp_path / "x"
    unpacked.mkdir()
    subprocess.run(["tar", "-xf", str(out), "-C", str(unpacked)], check=True)
    assert (unpacked / "c_link").read_bytes() == b"linked bytes"
    assert os.stat(unpacked / "c_link").st_ino == os.stat(unpacked / "b_link").st_ino


@pytest.mark.parametrize("fmt", ["tar", "zip"])
def test_the_summary_counts_the_members_written_not_those_listed(tmp_path: Path, fmt: str) -> None:
    """Files removed while a pack runs are left out, and warned about: the summary ("packed N
    members") still counted them from the listing."""
    import tarfile

    from cdmlfs.pack import pack

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(8 << 20))  # read in chunks: progress is said before its end
    for i in range(3):
        (src / f"z{i}.txt").write_bytes(b"later")

    def remove_the_rest(done: int, total: int) -> None:  # called once a.bin is under way
        for i in range(3):
            (src / f"z{i}.txt").unlink(missing_ok=True)

    out = tmp_path / f"o.{fmt}"
    summary = pack(str(src), str(out), progress=remove_the_rest)
    if fmt == "zip":
        with zipfile.ZipFile(out) as zf:
            names = zf.namelist()
    else:
        with tarfile.open(out) as tf:
            names = tf.getnames()
    assert names == ["a.bin"], names
    assert summary["members"] == 1 and summary["bytes"] == 8 << 20 and summary["changed"] == 3, summary


@pytest.mark.parametrize("fmt", ["tar", "zip"])
def test_hard_links_are_packed_as_they_are_when_their_turn_comes(tmp_path: Path, fmt: str) -> None:
    """A hard link replaced by another file after the listing was still packed as a link to its
    old first name (that name's bytes, exit 0); a link handed to a stand-in for a removed first
    name was never looked at again: a ZIP read it and called it changed (the unlink had moved
    the inode's ctime), a tar linked it whatever had become of it."""
    import tarfile

    from cdmlfs.pack import _as_they_are_now, _PlainTarSink, entries_from_directory, write_tar, write_zip

    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"OLD")
    os.link(src / "a", src / "z_b")  # z_b: replaced by another file before its turn
    (src / "f_first").write_bytes(b"kept bytes")
    os.link(src / "f_first", src / "g_link")
    os.link(src / "f_first", src / "h_link")
    changed: list[str] = []
    listed = entries_from_directory(str(src), changed=changed)
    (src / "z_b.new").write_bytes(b"NEW-CONTENT")
    os.replace(src / "z_b.new", src / "z_b")
    (src / "f_first").unlink()  # g_link carries the bytes now; h_link links to it, unchanged
    out = tmp_path / f"o.{fmt}"
    if fmt == "tar":
        with open(out, "wb") as f:
            write_tar(_as_they_are_now(listed), _PlainTarSink(f), None, None)
        with tarfile.open(out) as tf:
            assert tf.getmember("z_b").isfile() and tf.extractfile("z_b").read() == b"NEW-CONTENT"
            assert tf.extractfile("a").read() == b"OLD"
            assert tf.getmember("g_link").isfile() and tf.extractfile("g_link").read() == b"kept bytes"
            link = tf.getmember("h_link")
            assert link.islnk() and link.linkname == "g_link"
    else:
        with open(out, "wb") as f:
            write_zip(_as_they_are_now(listed), f, 6, None, 0)
        with zipfile.ZipFile(out) as zf:
            assert zf.read("z_b") == b"NEW-CONTENT" and zf.read("a") == b"OLD"
            assert zf.read("g_link") == zf.read("h_link") == b"kept bytes"
    assert changed == [str(src / "f_first")], changed  # only the file that went: said once (exit 1)


def test_a_file_that_shrinks_is_counted_once(tmp_path: Path) -> None:
    """Truncated after its header was written: warned as changed and as shrunk, counted twice
    ("2 files changed while being packed" for one file)."""
    from cdmlfs.pack import _as_they_are_now, entries_from_directory

    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 5000)
    changed: list[str] = []
    (entry,) = list(_as_they_are_now(entries_from_directory(str(src), changed=changed)))
    chunks = entry.read()
    os.truncate(src / "f", 10)  # after its header, before its bytes
    assert b"".join(chunks) == b"x" * 10 + bytes(4990)
    assert changed == [str(src / "f")]


@pytest.mark.fuse
def test_a_read_error_names_the_file(tmp_path: Path, mnt: Path) -> None:
    """EIO from a damaged member (here a cdmlfs mount of a corrupt ZIP) stopped the pack with
    "cdmlfs: Input/output error" and no file named."""
    from archives import stored_zip_with_a_flipped_byte

    archive = tmp_path / "bad.zip"
    stored_zip_with_a_flipped_byte(archive, "broken.bin", 1 << 16)
    with mounted(archive, mnt):
        res = run_cli("pack", "-q", str(mnt), str(tmp_path / "o.tar.zst"))
    err = res.stderr.decode().strip().splitlines()
    assert res.returncode == 1 and err[-1] == f"cdmlfs: Input/output error: {mnt / 'broken.bin'}", err
    assert not (tmp_path / "o.tar.zst").exists()


def test_an_unlistable_folder_inside_the_source_fails_the_pack_not_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A folder of the tree that cannot be listed exited 2 (a usage error), where an unreadable
    file exits 1: both are failures of the pack, not of how it was asked for. (Root lists any
    folder: the refusal is made by os.scandir here.)"""
    from cdmlfs import cli

    src = tmp_path / "src"
    (src / "closed").mkdir(parents=True)
    (src / "ok.txt").write_text("ok")
    real = os.scandir

    def refuse_closed(path="."):
        if os.fspath(path) == str(src / "closed"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(cli, "_exit_on_termination", lambda: None)  # no signal handlers in pytest
    monkeypatch.setattr(os, "scandir", refuse_closed)
    assert cli.main(["pack", "-q", str(src), str(tmp_path / "o.tar")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"cdmlfs: {src / 'closed'}: cannot list directory (Permission denied)", err
    assert not (tmp_path / "o.tar").exists()
    monkeypatch.setattr(os, "scandir", lambda path=".": refuse_closed(src / "closed"))  # the source itself
    assert cli.main(["pack", "-q", str(src), str(tmp_path / "o.tar")]) == 2


def test_a_symlink_loop_source_says_so(tmp_path: Path) -> None:
    os.symlink("b", tmp_path / "a")
    os.symlink("a", tmp_path / "b")
    res = run_cli("pack", str(tmp_path / "a"), str(tmp_path / "o.tar.zst"))
    assert res.returncode == 2 and "too many levels of symbolic links" in res.stderr.decode()


def test_a_converted_archive_extracts_with_plain_tar_not_as_root(tmp_path: Path) -> None:
    """Converting wrote every directory first: tar -x (not root) set a read-only directory's mode
    when it moved on to the next one, then could not create the files that came later in it
    ("Cannot open: Permission denied", files lost); and files written after a directory's entry
    moved the mtime it had set."""
    import shutil
    import subprocess

    src = tmp_path / "s"
    for d in ("a_ro/deeper", "a_ro/empty", "b"):
        (src / d).mkdir(parents=True)
    (src / "a_ro/f").write_text("f")
    (src / "a_ro/deeper/h").write_text("h")
    (src / "b/g").write_text("g")
    os.symlink("f", src / "a_ro/lnk")
    for d, when in (("a_ro/deeper", 1_000_000_000), ("a_ro/empty", 1_100_000_000), ("a_ro", 900_000_000)):
        os.chmod(src / d, 0o555)
        os.utime(src / d, (when, when), follow_symlinks=False)
    source_tar = tmp_path / "s.tar"
    subprocess.run(["tar", "cf", str(source_tar), "-C", str(src), "."], check=True)
    converted = cdmlfs_pack(source_tar, tmp_path / "conv.tar.zst")
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="cdmlfs-untar-", dir="/tmp"))  # pytest's tmp is root-only (0700)
    shutil.chown(out, "nobody")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    with open(converted, "rb") as archive:  # opened as root, read by tar as nobody
        untar = [*nobody, "tar", "--zstd", "-xf", "-", "-C", str(out)]
        res = subprocess.run(untar, stdin=archive, capture_output=True)
    try:
        assert res.returncode == 0, res.stderr
        for rel in ("a_ro/f", "a_ro/deeper/h", "b/g"):
            assert (out / rel).read_text() == (src / rel).read_text()
        for d in ("a_ro", "a_ro/deeper", "a_ro/empty", "b"):
            got, want = os.stat(out / d), os.stat(src / d)
            assert (got.st_mode, int(got.st_mtime)) == (want.st_mode, int(want.st_mtime)), d
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(out), str(src)], check=False)
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("suffix", [".tar", ".tar.zst"])
def test_pack_refuses_a_tar_whose_listing_a_corrupt_header_ended(suffix: str, tmp_path: Path) -> None:
    """A mount lists the members before a corrupt header; pack read the archive the same way and
    wrote a copy without the rest, exit 0 (convert, delete the source: members lost)."""
    import tarfile

    import zstandard

    raw = tmp_path / "raw.tar"
    with tarfile.open(raw, "w", format=tarfile.GNU_FORMAT) as tf:
        for name in ("a.txt", "b.txt", "c.txt"):
            (tmp_path / name).write_bytes(name.encode() * 100)
            tf.add(tmp_path / name, arcname=name)
    data = bytearray(raw.read_bytes())
    data[1024 + 148 : 1024 + 156] = b"0000000\0"  # b.txt's header checksum
    src = tmp_path / f"bad{suffix}"
    if suffix == ".tar":
        src.write_bytes(bytes(data))
    else:  # one sized frame: read through the archive's index, not a stream
        src.write_bytes(zstandard.ZstdCompressor().compress(bytes(data)))
    assert run_cli("ls", str(src), "--index-dir", str(tmp_path / "idx"), check=True).stdout == b"a.txt\n"
    for out in (tmp_path / "o.tar.zst", tmp_path / "o.zip"):
        res = run_cli("pack", "-q", str(src), str(out), "--index-dir", str(tmp_path / "idx"))
        err = res.stderr.decode()
        # Read as an archive (its index), or as a stream (a .tar.zst without a seek table to tar.zst).
        as_archive = "corrupt header at offset 1024" in err and "a copy would lose every member" in err
        as_stream = "corrupt tar header at byte 1,024" in err
        assert res.returncode == 1 and (as_archive or as_stream) and len(err.splitlines()) == 1, err
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_frames_in_flight_stay_within_the_memory_budget_whatever_the_thread_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to two frames per thread were held (input and output): --threads 64 with 64 MiB frames
    could hold 8 GiB. The count is capped by a byte budget (lowered here to 8 frames' worth)."""
    import threading

    from cdmlfs import pack as packmod

    frame = 64 << 10
    monkeypatch.setattr(packmod, "INFLIGHT_BUDGET", 8 * frame)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i:02d}.bin").write_bytes(os.urandom(3 * frame))
    lock, busy, peak = threading.Lock(), [0], {"compressing": 0, "held": 0}
    compress, cut = packmod._SeekableZstdSink._compress, packmod._SeekableZstdSink._cut

    def counting_compress(self, data):
        with lock:
            busy[0] += 1
            peak["compressing"] = max(peak["compressing"], busy[0])
        try:
            return compress(self, data)
        finally:
            with lock:
                busy[0] -= 1

    def counting_cut(self, data):
        cut(self, data)
        peak["held"] = max(peak["held"], len(self._inflight))

    monkeypatch.setattr(packmod._SeekableZstdSink, "_compress", counting_compress)
    monkeypatch.setattr(packmod._SeekableZstdSink, "_cut", counting_cut)
    out = tmp_path / "out.tar.zst"
    packmod.pack(str(src), str(out), frame_size=frame, threads=64)
    assert 1 <= peak["compressing"] <= 4 and 1 <= peak["held"] <= 4, peak  # 8 frames' bytes, twice each
    with Archive(str(out), index_dir=str(tmp_path / "idx")) as ar:
        assert all(ar.read(p.name) == p.read_bytes() for p in src.iterdir())


def test_a_small_pack_says_its_sizes_and_counts_as_they_are(tmp_path: Path) -> None:
    """A few small files were "0.0 MiB" packed into "0.0 MiB", and one FIFO "1 special files"."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"x" * 3000)
    os.mkfifo(src / "pipe")
    res = run_cli("pack", str(src), str(tmp_path / "o.tar.zst"))
    err = res.stderr.decode()
    assert res.returncode == 0, err
    assert "skipped 1 special file\n" in err and "0.0 MiB" not in err, err
    assert "(2.9 KiB) into" in err, err


def _symlink_with_a_hard_link(src: Path) -> Path:
    """``s`` -> ``t`` and ``h``, a second name of the symlink ``s`` itself (as `ln s h` makes it)."""
    src.mkdir()
    (src / "t").write_bytes(b"T\n")
    os.symlink("t", src / "s")
    os.link(src / "s", src / "h", follow_symlinks=False)
    return src


@pytest.mark.parametrize("source", ["directory", "tar"])
def test_hard_links_to_symlinks_stay_hard_links(tmp_path: Path, source: str) -> None:
    """`tar -c` keeps a hard link to a symlink; pack wrote two unrelated symlinks (nlink 1 each), from
    a directory and from an archive alike. A ZIP, with no hard links, gets a copy of the symlink."""
    src = _symlink_with_a_hard_link(tmp_path / "src")
    given = src if source == "directory" else gnu_tar(tmp_path / "in.tar", src)
    packed = cdmlfs_pack(given, tmp_path / "out.tar.zst")
    unpacked = extract(packed, tmp_path / "x")
    s, h = os.lstat(unpacked / "s"), os.lstat(unpacked / "h")
    assert os.readlink(unpacked / "h") == "t" and s.st_ino == h.st_ino and s.st_nlink == 2
    with Archive(str(packed)) as ar:  # its embedded index says so too
        st_s, st_h = ar.stat("s", follow_symlinks=False), ar.stat("h", follow_symlinks=False)
        assert st_h.ino == st_s.ino and st_h.nlink == 2 and ar.readlink("h") == "t"
    zipped = cdmlfs_pack(given, tmp_path / "out.zip")
    with zipfile.ZipFile(zipped) as zf:
        for name in ("s", "h"):
            info = zf.getinfo(name)
            assert (info.external_attr >> 16) & 0o170000 == 0o120000 and zf.read(name) == b"t"


def test_pack_succeeds_when_only_its_summary_cannot_be_written(tmp_path: Path) -> None:
    """2>/dev/full: the archive was written whole, yet pack exited 1 ("No space left on device")."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.txt").write_bytes(b"hello\n")
    out = tmp_path / "out.tar.zst"
    with open("/dev/full", "w") as full:
        res = subprocess.run([*CDMLFS, "pack", str(src), str(out)], stderr=full, timeout=120)
    assert res.returncode == 0
    with Archive(str(out)) as ar:
        assert ar.read("f.txt") == b"hello\n"


def test_pack_summary_counts_the_copies_hard_links_become_in_a_zip(tmp_path: Path) -> None:
    """From a directory the summary said half the bytes a ZIP holds (a hard link is stored as a
    copy there), from a tar of the same files all of them."""
    from cdmlfs.pack import pack

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 100_000)
    os.link(src / "a.bin", src / "b.bin")
    summary = pack(str(src), str(tmp_path / "out.zip"))
    assert summary["members"] == 2 and summary["bytes"] == 200_000
    with zipfile.ZipFile(tmp_path / "out.zip") as zf:
        assert sum(i.file_size for i in zf.infolist()) == 200_000
