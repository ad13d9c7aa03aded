"""Real FUSE mounts of ZIPs written by zipfile and Info-ZIP, compared with what `unzip` extracts."""

from __future__ import annotations

import contextlib
import errno
import gzip
import multiprocessing
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
from archives import flip_byte_in_member, infozip, python_zip, sample_files, text_bytes, write_tree
from mountutil import (
    CDMLFS,
    alive,
    await_exit,
    daemon_pid,
    force_unmount,
    is_mounted,
    mount_stats,
    mounted,
    read_pid,
    run_cli,
    tree,
    unzip,
)

pytestmark = pytest.mark.fuse


def _compare_with_unzip(archive: Path, mnt: Path, tmp_path: Path, *mount_args: str) -> None:
    expected = tree(unzip(archive, tmp_path / "unzipped"))
    with mounted(archive, mnt, *mount_args):
        got = tree(mnt)
    assert sorted(got) == sorted(expected)
    for path, exp in expected.items():
        assert got[path][0] == exp[0], path
        if exp[0] == "dir":
            continue  # unzip gives implied directories its umask; explicit ones are checked below
        assert got[path] == exp, path


@pytest.mark.parametrize(
    "kind",
    ["stored", "deflated", "zip64", "streamed", "bzip2", "lzma"],
)
def test_python_zipfile_archives_equal_unzip(kind: str, tmp_path: Path, mnt: Path) -> None:
    files = sample_files()
    archive = tmp_path / f"{kind}.zip"
    if kind == "stored":
        python_zip(archive, files, zipfile.ZIP_STORED)
    elif kind == "deflated":
        python_zip(archive, files, zipfile.ZIP_DEFLATED)
    elif kind == "zip64":
        python_zip(archive, files, zipfile.ZIP_DEFLATED, force_zip64=True)
    elif kind == "streamed":
        python_zip(archive, files, zipfile.ZIP_DEFLATED, streamed=True)
        with zipfile.ZipFile(archive) as zf:  # make sure the fixture really has data descriptors
            assert all(i.flag_bits & 0x08 for i in zf.infolist())
    elif kind == "bzip2":
        python_zip(archive, files, zipfile.ZIP_BZIP2)
    else:
        python_zip(archive, files, zipfile.ZIP_LZMA)
    if kind in ("bzip2", "lzma"):
        # unzip 6.0 cannot extract LZMA; compare with zipfile instead.
        with zipfile.ZipFile(archive) as zf, mounted(archive, mnt):
            for info in zf.infolist():
                assert (mnt / info.filename).read_bytes() == zf.read(info), info.filename
        return
    _compare_with_unzip(archive, mnt, tmp_path)


@pytest.mark.parametrize("level", [0, 6])
def test_infozip_archive_with_symlinks_unicode_and_empties(level: int, tmp_path: Path, mnt: Path) -> None:
    src = write_tree(
        tmp_path / "src",
        sample_files(1),
        symlinks={"data/link_to_csv": "nested/deep/file.csv", "dangling": "nowhere/at/all"},
        empty_dirs=("empty_dir", "data/also_empty"),
    )
    os.chmod(src / "readme.txt", 0o600)
    os.chmod(src / "one_byte", 0o755)
    archive = infozip(tmp_path / "info.zip", src, level=level)
    _compare_with_unzip(archive, mnt, tmp_path)
    with mounted(archive, mnt):
        assert (mnt / "data/link_to_csv").read_bytes() == (src / "data/nested/deep/file.csv").read_bytes()
        assert os.readlink(mnt / "dangling") == "nowhere/at/all"
        assert sorted(os.listdir(mnt / "empty_dir")) == []
        st = os.stat(mnt / "data")
        assert st.st_nlink == 2 + 2  # two subdirectories: nested, also_empty


def test_libfuse2_fallback_serves_the_same_tree(tmp_path: Path, mnt: Path, monkeypatch) -> None:
    """libfuse3 is preferred; where only libfuse2 loads (FUSE_LIBRARY_NAME=fuse picks it), the mount
    answers the same tree, modes, mtimes, links and bytes as unzip, and a damaged member gives EIO."""
    src = write_tree(
        tmp_path / "src",
        sample_files(2),
        symlinks={"data/link_to_csv": "nested/deep/file.csv"},
        empty_dirs=("empty_dir",),
    )
    archive = infozip(tmp_path / "info.zip", src, level=6)
    monkeypatch.setenv("FUSE_LIBRARY_NAME", "fuse")
    _compare_with_unzip(archive, mnt, tmp_path)
    flip_byte_in_member(archive, "readme.txt")
    with mounted(archive, mnt):
        with open(f"/proc/{daemon_pid(mnt)}/maps") as f:
            assert "libfuse.so.2" in f.read()
        assert (mnt / "data/link_to_csv").read_bytes() == (src / "data/nested/deep/file.csv").read_bytes()
        with pytest.raises(OSError) as exc:
            (mnt / "readme.txt").read_bytes()
        assert exc.value.errno == errno.EIO
        assert (mnt / "one_byte").read_bytes() == (src / "one_byte").read_bytes()
        assert mount_stats(mnt)["fast_path"] is None  # the C hot path needs libfuse3


def test_more_than_65535_entries(tmp_path: Path, mnt: Path) -> None:
    archive = tmp_path / "many.zip"
    n = 70_000
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zf:
        for i in range(n):
            zf.writestr(f"d{i % 7}/f{i:06d}", f"{i}\n".encode())
    with mounted(archive, mnt):
        count = sum(len(files) for _, _, files in os.walk(mnt))
        assert count == n
        for i in random.Random(0).sample(range(n), 200):
            assert (mnt / f"d{i % 7}/f{i:06d}").read_bytes() == f"{i}\n".encode()


def test_prefixed_archive_and_trailing_comment(tmp_path: Path, mnt: Path) -> None:
    files = sample_files(3)
    plain = python_zip(tmp_path / "plain.zip", files)
    sfx = tmp_path / "sfx.zip"
    sfx.write_bytes(b"#!/bin/sh\necho self-extractor stub\nexit 0\n" + b"\0" * 1000 + plain.read_bytes())
    with zipfile.ZipFile(tmp_path / "commented.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.comment = b"trailing comment " * 100
    for archive in (sfx, tmp_path / "commented.zip"):
        with mounted(archive, mnt):
            for name, data in files.items():
                assert (mnt / name).read_bytes() == data


def test_stock_imagefolder_on_mount_equals_extracted(tmp_path: Path, mnt: Path) -> None:
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("torchvision.datasets")
    transforms = pytest.importorskip("torchvision.transforms")
    from PIL import Image

    src = tmp_path / "images"
    rng = random.Random(0)
    for cls in ("cat", "dog", "zebra"):
        (src / cls).mkdir(parents=True)
        for i in range(6):
            img = Image.new("RGB", (24 + i, 20), tuple(rng.randrange(256) for _ in range(3)))
            img.putpixel((3, 4), (1, 2, 3))
            img.save(src / cls / f"{i}.{'png' if i % 2 else 'jpg'}")
    archive = infozip(tmp_path / "images.zip", src, level=0)
    t = transforms.ToTensor()
    ref = datasets.ImageFolder(str(src), transform=t)
    with mounted(archive, mnt):
        got = datasets.ImageFolder(str(mnt), transform=t)
        assert got.classes == ref.classes
        assert got.class_to_idx == ref.class_to_idx
        assert [(os.path.relpath(p, mnt), c) for p, c in got.samples] == [
            (os.path.relpath(p, src), c) for p, c in ref.samples
        ]
        for i in range(len(ref)):
            a, ya = got[i]
            b, yb = ref[i]
            assert ya == yb
            assert torch.equal(a, b)


def _read_all(root: str, names: list[str]) -> dict[str, bytes]:
    return {n: Path(root, n).read_bytes() for n in names}


def test_concurrent_threads_and_processes_byte_exact(tmp_path: Path, mnt: Path) -> None:
    rng = random.Random(5)
    files = {f"c{i % 10}/f{i}.bin": rng.randbytes(rng.randint(0, 200_000)) for i in range(300)}
    files.update({f"t/{i}.txt": text_bytes(rng.randint(1, 300_000), i) for i in range(100)})
    archive = python_zip(tmp_path / "conc.zip", files, zipfile.ZIP_DEFLATED)
    names = list(files)
    with mounted(archive, mnt, "--cache-size", "16M"):
        errors: list[str] = []

        def worker(seed: int) -> None:
            order = names[:]
            random.Random(seed).shuffle(order)
            for n in order:
                if (mnt / n).read_bytes() != files[n]:
                    errors.append(n)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(4) as pool:
            async_results = [pool.apply_async(_read_all, (str(mnt), names[s::4])) for s in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for r in async_results:
                for n, data in r.get(timeout=300).items():
                    assert data == files[n], n
        assert errors == []


@pytest.mark.parametrize("compression", [zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED])
def test_flipped_byte_gives_eio_on_that_file_only(compression: int, tmp_path: Path, mnt: Path) -> None:
    files = sample_files(7)
    files["victim.bin"] = text_bytes(100_000, 9)
    archive = python_zip(tmp_path / "bad.zip", files, compression)
    flip_byte_in_member(archive, "victim.bin")
    log = tmp_path / "daemon.log"
    with mounted(archive, mnt, log_file=log):
        with pytest.raises(OSError) as excinfo:
            (mnt / "victim.bin").read_bytes()
        assert excinfo.value.errno == errno.EIO
        for name, data in files.items():
            if name != "victim.bin":
                assert (mnt / name).read_bytes() == data
        with pytest.raises(OSError):  # still an error the second time, never wrong bytes
            (mnt / "victim.bin").read_bytes()
        assert os.listdir(mnt)  # daemon alive
        pid = daemon_pid(mnt)
        assert pid is not None
        os.kill(pid, 0)
    text = log.read_text()
    assert "victim.bin" in text and "EIO" in text
    assert text.count("victim.bin") == 1  # logged once, not per read


@pytest.mark.parametrize(
    "content",
    [b"", b"this is not a zip file at all\n" * 100, None, gzip.compress(b"x" * 1024)],
    ids=["empty", "text", "truncated", "gzip"],
)
def test_bad_archive_refused_with_one_line(content: bytes | None, tmp_path: Path, mnt: Path) -> None:
    bad = tmp_path / "bad.zip"
    if content is None:
        good = python_zip(tmp_path / "good.zip", sample_files())
        bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    else:
        bad.write_bytes(content)
    res = run_cli("mount", str(bad), str(mnt))
    assert res.returncode != 0
    err = res.stderr.decode().strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    assert str(bad) in err  # which archive: a job may mount several
    if content is not None and content.startswith(b"\x1f\x8b"):
        assert "gzip" in err and "gunzip" in err and "cdmlfs pack" in err  # converts it (test_pack)
    if content is None:  # the commonest bad ZIP, a download cut short, was "not a ZIP archive"
        assert "a ZIP archive cut short" in err and "not a ZIP" not in err, err
    assert not is_mounted(mnt)


def test_cli_errors_are_one_line_and_leave_no_mount(tmp_path: Path, mnt: Path) -> None:
    good = python_zip(tmp_path / "good.zip", sample_files())
    nonempty = tmp_path / "nonempty"
    nonempty.mkdir()
    (nonempty / "x").write_text("x")
    fifo = tmp_path / "fifo.zip"
    os.mkfifo(fifo)
    cases = [
        ("mount", str(tmp_path / "missing.zip"), str(mnt)),
        ("mount", str(good), str(tmp_path / "no-such-dir")),
        ("mount", str(good), str(nonempty)),
        ("mount", str(good), str(nonempty), "-o", "nonempty=0"),  # was taken as -o nonempty
        ("mount", str(good), str(mnt), "--cache-size", "lots"),
        ("mount", str(good), str(mnt), "--cache-size", "99999T"),  # no bound at all
        ("mount", str(good), str(good)),
        ("mount", "-f", str(good), str(mnt), "-o", "bogus"),  # libfuse refuses in the foreground
        ("mount", str(good), str(mnt), "-o", "allow_other,rw"),  # writes would get ENOSYS, not EROFS
        ("ls", str(fifo)),  # opening a FIFO would wait for a writer forever
        ("ls", "--endpoint-url", "127.0.0.1:9", "s3://bucket/key.zip"),  # no scheme: botocore refuses
        ("ls", "--read-deadline", "0", "s3://bucket/key.zip"),
        ("cat", str(good), "no/such/member"),
        ("umount", str(mnt)),
        ("mount", str(good), str(mnt), "--log-file", str(tmp_path)),  # a directory: checked before forking
        ("mount", str(good), str(mnt), "--log-file", str(tmp_path / "no" / "such" / "dir.log")),
        ("mount", str(good), str(mnt), "--pid-file", str(tmp_path / "no" / "such" / "x.pid")),
        ("mount", "-f", str(good), str(mnt), "--pid-file", str(tmp_path)),
        # Hidden by the mount, and a log left behind made the next mount find the directory not empty.
        ("mount", str(good), str(mnt), "--log-file", str(mnt / "daemon.log")),
        ("mount", str(good), str(mnt), "--pid-file", str(mnt / "daemon.pid")),
        ("mount", str(good), str(mnt), "--log-file", str(tmp_path / "link.log")),  # a symlink into it
        ("mount", str(good), str(mnt), "--readahead", "3G"),  # would evict what it read ahead
        ("mount", str(good), str(mnt), "-o", "subtype=mine"),  # cdmlfs stats would not find it
        ("mount", str(good), str(mnt), "-o", "max_read=4096"),  # libfuse's words named no option
        ("mount", str(good), str(mnt), "-o", "blkdev"),  # "No such file or directory"
        # Options of libfuse 3's config struct with a value mfusepy cannot set: the mount served
        # but never said it was ready, and the command failed after 60 s.
        ("mount", str(good), str(mnt), "-o", "use_ino=1"),
        ("mount", "-f", str(good), str(mnt), "-o", "intr_signal=abc"),
        ("pack", str(good), str(tmp_path / "out.tar.zst"), "--threads", "0"),
    ]
    (tmp_path / "link.log").symlink_to(mnt / "daemon.log")
    for args in cases:
        res = run_cli(*args, timeout=60)
        err = res.stderr.decode().strip()
        assert res.returncode != 0, args
        # in the foreground too, where libfuse's own complaint went straight to the terminal first
        assert len(err.splitlines()) == 1 and "Traceback" not in err, (args, err)
        if "-o" in args:
            assert args[args.index("-o") + 1].split("=")[0].split(",")[-1] in err, (args, err)
    assert not is_mounted(mnt) and not is_mounted(nonempty)
    assert not list(mnt.iterdir())
    res = run_cli("mount", str(good), str(mnt), "--pid-file", str(tmp_path / "no" / "x.pid"))
    assert res.returncode == 2 and "--pid-file" in res.stderr.decode()  # said before any mount, as usage
    for foreground in ([], ["-f"]):
        res = run_cli("mount", *foreground, str(good), str(mnt), "-o", "uid=abc")
        err = res.stderr.decode()
        assert res.returncode != 0 and "uid=abc" in err and len(err.splitlines()) == 1, err  # libfuse's
    assert not is_mounted(mnt)
    with mounted(good, mnt):
        res = run_cli("mount", str(good), str(mnt))
        assert res.returncode != 0 and "already mounted" in res.stderr.decode()


def test_ctrl_c_while_the_command_sets_up_is_one_line(monkeypatch, capsys) -> None:
    """Ctrl-C in a command's first ~40 ms (its logging set-up) printed a 30-line traceback."""
    from cdmlfs import cli

    def interrupted(verbose: bool) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_setup_logging", interrupted)
    assert cli.main(["ls", "nothing.zip"]) == 130
    assert capsys.readouterr().err == "cdmlfs: interrupted\n"


def test_a_config_option_with_a_number_mounts(tmp_path: Path, mnt: Path) -> None:
    """-o intr_signal=10 mounted and served, but the command waited 60 s and then failed."""
    good = python_zip(tmp_path / "good.zip", {"a.txt": b"hello"})
    res = run_cli("mount", str(good), str(mnt), "-o", "intr,intr_signal=10", timeout=50)
    try:
        assert res.returncode == 0, res.stderr
        assert (mnt / "a.txt").read_bytes() == b"hello"
    finally:
        run_cli("umount", str(mnt))


def test_a_failed_init_ends_the_daemon_instead_of_serving_unready(tmp_path: Path, mnt: Path) -> None:
    """Whatever makes libfuse's init fail, the daemon must not go on serving a mount it never said
    was ready (its parent waited the whole mount timeout, then stopped it)."""
    good = python_zip(tmp_path / "good.zip", {"a.txt": b"hello"})
    code = (
        "import sys; from cdmlfs.archive import Archive; from cdmlfs.daemon import ServeOptions, serve\n"
        f"opts = ServeOptions({str(mnt)!r}, fuse_options={{'use_ino': 'yes'}})  # a string: init fails\n"
        f"serve(Archive({str(good)!r}), opts)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "could not mount" in res.stderr, res.stderr
    assert not is_mounted(mnt)


def test_a_mount_that_never_comes_up_is_reported_as_a_timeout(tmp_path: Path, mnt: Path) -> None:
    """The parent stops a daemon that has not mounted in time; it said "the daemon exited"."""
    good = python_zip(tmp_path / "good.zip", sample_files())
    fifo = tmp_path / "pid.fifo"
    os.mkfifo(fifo)  # the daemon blocks writing its pid file: it never mounts
    code = (
        "import sys, cdmlfs.daemon as d; d.MOUNT_TIMEOUT = 2.0; from cdmlfs.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    args = ["mount", str(good), str(mnt), "--pid-file", str(fifo), "--log-file", str(tmp_path / "d.log")]
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, timeout=60)
    err = res.stderr.decode()
    assert res.returncode == 1 and len(err.splitlines()) == 1, err
    assert "no mount within 2 s; stopped the daemon" in err, err
    assert not is_mounted(mnt)


def test_two_mounts_racing_for_one_directory_make_one_mount(tmp_path: Path, mnt: Path) -> None:
    """Both checked "not mounted" before their (slow) archive open, then both mounted: a stacked,
    hidden mount and a second daemon. The mount point lock lets one through, also for commands
    with different state folders (sudo and sudo -H, two containers sharing the directory), which
    each took a lock file of their own and stacked two mounts."""
    good = python_zip(tmp_path / "good.zip", sample_files())
    cmd = [sys.executable, "-m", "cdmlfs", "mount", str(good), str(mnt)]
    envs = [{**os.environ, "XDG_STATE_HOME": str(tmp_path / f"state{i}")} for i in range(2)]
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env) for env in envs]
    try:
        results = [(p.wait(timeout=60), p.stderr.read().decode()) for p in procs]
        assert sorted(code for code, _ in results) == [0, 2], results
        assert "already mounted" in next(err for code, err in results if code)
        with open("/proc/self/mountinfo") as f:
            assert sum(f" {mnt} " in line for line in f) == 1
    finally:
        run_cli("umount", str(mnt))
    assert not is_mounted(mnt)


def test_an_archive_name_with_a_backslash_names_its_mount(tmp_path: Path, mnt: Path) -> None:
    """libfuse takes a backslash in -o fsname as an escape: a\\b.zip showed as ab.zip in df and
    in "already mounted (...)" errors, naming another file."""
    odd = python_zip(tmp_path / "a\\b,c.zip", {"x.txt": b"x"})
    with mounted(odd, mnt):
        res = run_cli("mount", str(odd), str(mnt))
        err = res.stderr.decode()
        assert res.returncode == 2 and f"(cdmlfs:{tmp_path}/a\\b_c.zip)" in err, err  # commas: _


def test_remount_after_a_lazy_unmount_is_not_blocked(tmp_path: Path, mnt: Path) -> None:
    """A busy mount is not detached behind its users' backs unless asked (--lazy). A daemon detached
    that way lives on while a file stays open; the directory is free again (the mount point lock
    only covers setting a mount up)."""
    good = python_zip(tmp_path / "good.zip", sample_files())
    pid_file = tmp_path / "first.pid"
    started = time.monotonic()
    run_cli("mount", str(good), str(mnt), "--pid-file", str(pid_file), check=True)
    baseline = time.monotonic() - started  # a mount on this machine now, however busy it is
    first = int(pid_file.read_text().split()[0])
    holder = open(mnt / next(iter(sample_files())), "rb")  # noqa: SIM115 - kept open on purpose
    try:
        res = run_cli("umount", str(mnt), timeout=30)
        err = res.stderr.decode()
        assert res.returncode != 0 and "busy" in err and "--lazy" in err and err.count("\n") == 1, err
        assert is_mounted(mnt) and holder.read(1)  # still mounted, still serving
        res = run_cli("umount", "--lazy", str(mnt), timeout=30)
        assert res.returncode == 0 and not is_mounted(mnt), res.stderr
        assert alive(first)  # detached, still serving the open file
        started = time.monotonic()
        with mounted(good, mnt):
            assert time.monotonic() - started < baseline + 3.0
            assert sorted(os.listdir(mnt))
    finally:
        holder.close()
        await_exit(first)


def test_a_pid_file_is_only_ever_removed_by_its_own_daemon(tmp_path: Path, mnt: Path) -> None:
    """A mount given the pid file of a running daemon wrote its own pid over it, failed (or ended),
    and removed the file; a daemon outliving its mount (lazy unmount) removed the file of the one
    mounted there since. Now such a pid file is refused, and a daemon removes only its own."""
    good = python_zip(tmp_path / "good.zip", sample_files())
    pid_file = tmp_path / "d.pid"
    run_cli("mount", str(good), str(mnt), "--pid-file", str(pid_file), check=True)
    first = read_pid(pid_file)
    other = tmp_path / "other"
    other.mkdir()
    try:
        for bad in ([], ["-o", "nonsense"]):
            res = run_cli("mount", str(good), str(other), "--pid-file", str(pid_file), *bad)
            err = res.stderr.decode()
            assert res.returncode == 2 and "still running" in err and err.count("\n") == 1, err
            assert read_pid(pid_file) == first and not is_mounted(other)
        pid_file.write_text("1\n")  # another's now (a later daemon's): left alone
        run_cli("umount", str(mnt), check=True)
        await_exit(first)
        assert read_pid(pid_file) == 1
        run_cli("mount", str(good), str(other), "--pid-file", str(pid_file), check=True)  # not cdmlfs
        second = read_pid(pid_file)
        assert second not in (None, 1, first)
        run_cli("umount", str(other), check=True)
        await_exit(second)
        assert not pid_file.exists()  # its own: removed
    finally:
        force_unmount(mnt)
        force_unmount(other)
        await_exit(first)


def test_umount_never_waits_on_a_stuck_daemon(tmp_path: Path, mnt: Path) -> None:
    """A daemon that does not answer (stopped here; deadlocked or blocked on S3 in real life): a
    plain umount still answers at once, busy or not, and --lazy detaches a busy one."""
    good = python_zip(tmp_path / "good.zip", sample_files())
    for busy in (False, True):
        pid_file = tmp_path / f"{busy}.pid"
        run_cli("mount", str(good), str(mnt), "--pid-file", str(pid_file), check=True)
        pid = int(pid_file.read_text().split()[0])
        # Held by another process: ours forks for the CLI, and each fork closing an inherited copy
        # would send the stopped daemon a FLUSH and wait for it forever.
        holder = None
        if busy:
            hold = 'exec 3< "$1"; echo held; exec sleep 600'
            holder = subprocess.Popen(["bash", "-c", hold, "-", mnt / "readme.txt"], stdout=subprocess.PIPE)
            assert holder.stdout.readline() == b"held\n"
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            res = run_cli("umount", str(mnt), timeout=60)
            assert time.monotonic() - started < 30
            if busy:
                err = res.stderr.decode()
                assert res.returncode != 0 and "busy" in err and "--lazy" in err, err
                res = run_cli("umount", "--lazy", str(mnt), timeout=60)
            assert res.returncode == 0 and not is_mounted(mnt), res.stderr
        finally:
            os.kill(pid, signal.SIGCONT)
            if holder is not None:
                holder.kill()
                holder.wait(timeout=30)
            force_unmount(mnt)
            await_exit(pid)


SHORT_TIMEOUTS = (
    "import sys; from cdmlfs import cli, fuse_ops; fuse_ops.TIMEOUT = 0.5; sys.exit(cli.main(sys.argv[1:]))"
)


def test_umount_and_stats_of_a_stuck_daemon_once_its_attributes_expired(tmp_path: Path, mnt: Path) -> None:
    """Past the kernel's attribute timeout (an hour; half a second here), any stat of the mount point
    asks the daemon: umount (even --lazy) stat-ed it first and hung for ever on a stopped daemon, and
    stats waited in its ioctl with Ctrl-C ignored. The mount point is now found in mountinfo without
    touching it (through a symlink too, which fusermount refused), and stats gives up in 10 s."""
    good = python_zip(tmp_path / "good.zip", sample_files())
    pid_file = tmp_path / "d.pid"
    subprocess.run(
        [sys.executable, "-c", SHORT_TIMEOUTS, "mount", str(good), str(mnt), "--pid-file", str(pid_file)],
        check=True,
        timeout=60,
    )
    pid = int(pid_file.read_text().split()[0])
    link = tmp_path / "link"
    link.symlink_to(mnt)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(1.0)
        started = time.monotonic()
        res = run_cli("stats", str(link), timeout=60)
        err = res.stderr.decode()
        assert res.returncode == 1 and "no answer within" in err and err.count("\n") == 1, err
        assert time.monotonic() - started < 20
        # A folder inside: looked up by the stopped daemon itself (that lookup hung for good).
        started = time.monotonic()
        res = run_cli("stats", str(mnt / "data"), timeout=60)
        err = res.stderr.decode()
        assert res.returncode == 1 and "no answer within" in err and err.count("\n") == 1, err
        assert f"'cdmlfs umount --lazy {mnt}'" in err, err  # the mount, which umount takes
        assert time.monotonic() - started < 20
        started = time.monotonic()
        res = run_cli("umount", str(link), timeout=60)
        assert res.returncode == 0 and not is_mounted(mnt), res.stderr.decode()
        assert time.monotonic() - started < 30
    finally:
        os.kill(pid, signal.SIGCONT)
        force_unmount(mnt)
        await_exit(pid)


def test_a_mount_named_through_a_link_and_dot_dot_is_the_same_mount(tmp_path: Path, mnt: Path) -> None:
    """``far/../../mnt`` with far -> a/b is tmp/mnt to the kernel (links first, then ..); resolving
    '..' as text made it a path that was "not a cdmlfs mount" for stats and umount, and let a
    second mount stack on the first with -o nonempty."""
    good = python_zip(tmp_path / "good.zip", sample_files())
    (tmp_path / "a" / "b").mkdir(parents=True)
    far = tmp_path / "far"
    far.symlink_to(tmp_path / "a" / "b")
    via = f"{far}/../../{mnt.name}"
    run_cli("mount", str(good), str(mnt), check=True)
    try:
        res = run_cli("stats", via)
        assert res.returncode == 0 and b"archive" in res.stdout, res.stderr
        res = run_cli("mount", str(good), via, "-o", "nonempty")
        assert res.returncode == 2 and b"already mounted" in res.stderr, res.stderr
        run_cli("umount", via, check=True)
        assert not is_mounted(mnt)
    finally:
        force_unmount(mnt)


def test_stats_and_mount_of_dot_name_the_working_directory(tmp_path: Path, mnt: Path) -> None:
    """'cdmlfs stats .' inside a mount (and 'cdmlfs mount X .') ended in a RecursionError once
    mount points were resolved without a stat: '.' is the working directory, never stat-ed."""
    from cdmlfs.mountpoints import _resolved_above

    assert _resolved_above(".") == _resolved_above("./") == os.getcwd()
    good = python_zip(tmp_path / "good.zip", sample_files())
    with mounted(good, mnt):
        res = run_cli("stats", ".", cwd=mnt)
        assert res.returncode == 0 and b"archive" in res.stdout, res.stderr
        res = run_cli("mount", str(good), ".", cwd=mnt)
        assert res.returncode == 2 and b"already mounted" in res.stderr, res.stderr


def test_the_daemon_keeps_no_descriptor_of_its_caller(tmp_path: Path, mnt: Path) -> None:
    """``{ cdmlfs mount a.zip m; } 3>&1 | cat`` never ended: the daemon held the pipe on fd 3 (a CI
    step's status pipe, bats' output) until the unmount. It closes what its caller passed down."""
    good = python_zip(tmp_path / "good.zip", sample_files())
    rfd, wfd = os.pipe()
    try:
        proc = subprocess.run(
            [*CDMLFS, "mount", str(good), str(mnt)], pass_fds=(wfd,), capture_output=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr.decode()
        os.close(wfd)
        wfd = -1
        ready, _, _ = select.select([rfd], [], [], 10)
        assert ready and os.read(rfd, 1) == b"", "the daemon still holds the caller's pipe"
    finally:
        if wfd >= 0:
            os.close(wfd)
        os.close(rfd)
        run_cli("umount", str(mnt))


def test_umount_of_a_mount_with_another_inside_names_it(tmp_path: Path, mnt: Path) -> None:
    """Busy because another mount sits inside it: the message pointed at open files ('fuser -vm'),
    which list nothing. It names the inner mount."""
    outer = python_zip(tmp_path / "outer.zip", {"sub/keep.txt": b"k", "top.txt": b"t"})
    inner = python_zip(tmp_path / "inner.zip", {"x.txt": b"x"})
    with mounted(outer, mnt):
        run_cli("mount", str(inner), str(mnt / "sub"), "-o", "nonempty", check=True)
        try:
            res = run_cli("umount", str(mnt))
            err = res.stderr.decode()
            assert res.returncode == 2 and f"{mnt}/sub is mounted inside it" in err, err
        finally:
            run_cli("umount", str(mnt / "sub"), check=True)


def test_mount_interrupted_after_the_fork_leaves_nothing(tmp_path: Path, mnt: Path) -> None:
    """Ctrl-C (or SIGTERM, or SIGHUP from a closed terminal) while ``cdmlfs mount`` waits for its
    daemon: the daemon and the mount stayed. Whenever the signal lands, a command that did not
    succeed leaves nothing behind."""
    good = python_zip(tmp_path / "good.zip", sample_files())
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        proc = subprocess.Popen(
            [sys.executable, "-m", "cdmlfs", "mount", str(good), str(mnt)], stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 30
        children: list[str] = []
        while not children and proc.poll() is None and time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = f.read().split()
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
        time.sleep(0.5)
        if code == 0:  # the mount was complete before the signal arrived: a normal mount
            run_cli("umount", str(mnt))
        else:  # as a kill by that signal, and as extract and pack exit (SIGTERM gave 130)
            assert code in (128 + sig, -sig), (sig, code)
        assert not is_mounted(mnt), (sig, code)
        for child in children:
            assert (
                not os.path.exists(f"/proc/{child}") or "zombie" in Path(f"/proc/{child}/status").read_text()
            )


def test_a_signal_as_the_mount_appears_gives_a_consistent_outcome(tmp_path: Path, mnt: Path) -> None:
    """A signal in the last milliseconds of ``cdmlfs mount`` (the mount up, the command not yet
    exited) killed the command (status -15) with the mount in place: a failure that left a mount.
    Now the outcome holds either way: exit 0 with the mount, or non-zero without it."""
    good = python_zip(tmp_path / "good.zip", sample_files())
    # The old window: 4-32 ms after the mount showed, every signal killed the command.
    for delay in (0.008, 0.016, 0.024):
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            _signal_after_the_mount_shows(good, mnt, sig, delay)


def _signal_after_the_mount_shows(good: Path, mnt: Path, sig: int, delay: float) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdmlfs", "mount", str(good), str(mnt)], stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 30
    while proc.poll() is None and not is_mounted(mnt) and time.monotonic() < deadline:
        pass  # busy: the window is a few milliseconds
    shown = time.perf_counter()
    while time.perf_counter() - shown < delay:
        pass
    if proc.poll() is None:
        proc.send_signal(sig)
    code = proc.wait(timeout=30)
    err = proc.stderr.read().decode() if proc.stderr else ""
    time.sleep(0.3)
    up = is_mounted(mnt)
    if up:
        run_cli("umount", str(mnt), check=True)
    assert (code == 0) == up, (sig, delay, code, up, err)


def test_umount_refuses_what_is_not_fuse(tmp_path: Path) -> None:
    """As root, umount(8) would take down any file system: only FUSE mounts (or dead ones) go."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    for fstype, extra in (("tmpfs", ["-o", "size=1m"]), ("fusectl", [])):  # fusectl: "fuse..." too
        target = tmp_path / fstype
        target.mkdir()
        subprocess.run(["mount", "-t", fstype, *extra, "cdmlfs-test", str(target)], check=True)
        try:
            res = run_cli("umount", str(target))
            assert res.returncode != 0 and "not a FUSE mount" in res.stderr.decode(), fstype
            assert is_mounted(target)
        finally:
            subprocess.run(["umount", str(target)], check=False)


TOY_FS = """
import errno, sys
import mfusepy

class Toy(mfusepy.Operations):
    def getattr(self, path, fh=None):
        if path == "/":
            return {"st_mode": 0o40755, "st_nlink": 2}
        raise mfusepy.FuseOSError(errno.ENOENT)

    def readdir(self, path, fh):
        return [".", ".."]

mfusepy.FUSE(Toy(), sys.argv[1], foreground=True, fsname="toy", subtype="toy")
"""


def test_umount_refuses_another_fuse_file_system(mnt: Path) -> None:
    """`cdmlfs umount` took down any FUSE mount (an sshfs given by mistake, say): only its own go."""
    proc = subprocess.Popen([sys.executable, "-c", TOY_FS, str(mnt)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not is_mounted(mnt):
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr.read() if proc.stderr else ""
            )
            time.sleep(0.05)
        for extra in ([], ["--lazy"]):
            res = run_cli("umount", *extra, str(mnt), timeout=60)
            err = res.stderr.decode()
            assert res.returncode == 2 and "not a cdmlfs mount (fuse.toy" in err and "fusermount -u" in err, (
                err
            )
            assert is_mounted(mnt)
    finally:
        force_unmount(mnt)
        proc.terminate()
        proc.wait(timeout=30)


def test_mount_with_its_files_full_or_odd(tmp_path: Path, mnt: Path) -> None:
    """A pid file on a full disk: the foreground mount failed without a word (stderr was still held
    for libfuse) and both modes left an empty pid file. A log on /dev/full read back for the failure's
    reason grew until memory ran out; a FIFO nobody reads as the log hung. `mount -v >/dev/full`
    exited 1 with the mount up; `mount -f 2>/dev/full` skipped its start-up work and exited 1."""
    import resource

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    good = python_zip(tmp_path / "good.zip", {"a.txt": b"A\n"})
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "cdmlfs-test", str(full)], check=True)
    try:
        with contextlib.suppress(OSError), open(full / "fill", "wb") as f:
            f.write(b"\0" * (1 << 20))
        for fg in ([], ["-f"]):
            res = run_cli("mount", *fg, "--pid-file", str(full / "p.pid"), str(good), str(mnt), timeout=60)
            err = res.stderr.decode()
            assert res.returncode == 1 and "pid file" in err and "No space left" in err, (fg, err)
            assert not is_mounted(mnt) and not (full / "p.pid").exists(), fg
    finally:
        subprocess.run(["umount", str(full)], check=False)

    def limited() -> None:  # the old read of /dev/full took all memory: fail fast instead
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    res = run_cli("mount", "--log-file", "/dev/full", "-o", "bogus", str(good), str(mnt), preexec_fn=limited)
    err = res.stderr.decode()
    assert res.returncode == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    res = run_cli("mount", "--log-file", str(fifo), str(good), str(mnt), timeout=30)
    assert res.returncode == 2 and b"FIFO that no process reads" in res.stderr, res.stderr
    assert not is_mounted(mnt)
    with open("/dev/full", "w") as devfull:
        res = subprocess.run([*CDMLFS, "mount", "-v", str(good), str(mnt)], stdout=devfull, timeout=60)
    assert res.returncode == 0 and is_mounted(mnt)
    run_cli("umount", str(mnt), check=True)
    with open("/dev/full", "w") as devfull:
        proc = subprocess.Popen([*CDMLFS, "mount", "-f", str(good), str(mnt)], stderr=devfull)
    try:
        deadline = time.monotonic() + 30
        while not is_mounted(mnt) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (mnt / "a.txt").read_bytes() == b"A\n"
        time.sleep(0.5)  # past the start-up work (a notice on the full stderr raised inside it)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not is_mounted(mnt)


def test_umount_of_a_folder_inside_a_live_mount_names_the_mount(tmp_path: Path, mnt: Path) -> None:
    """`cdmlfs umount MNT/d` answered "not mounted", as if nothing were mounted there."""
    good = python_zip(tmp_path / "good.zip", {"d/x.txt": b"x"})
    with mounted(good, mnt):
        res = run_cli("umount", str(mnt / "d"))
        err = res.stderr.decode().strip()
        assert res.returncode != 0 and f"inside {mnt}; run 'cdmlfs umount {mnt}'" in err, err
        assert len(err.splitlines()) == 1 and is_mounted(mnt)
    res = run_cli("umount", str(tmp_path))  # nothing mounted anywhere above: as before
    assert res.returncode != 0 and "not mounted" in res.stderr.decode()


def test_umount_of_a_folder_under_another_fuse_file_system_says_not_mounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a cdmlfs mount is named: under a root on fuse-overlayfs (rootless containers) the
    answer was to run 'cdmlfs umount /'."""
    from cdmlfs import mountpoints
    from cdmlfs.errors import UsageError

    real = mountpoints._mounts
    overlay = {"id": "999", "mountpoint": "/", "fstype": "fuse.fuse-overlayfs", "source": "overlay"}
    monkeypatch.setattr(mountpoints, "_mounts", lambda: [*real(), overlay])
    with pytest.raises(UsageError, match=r": not mounted$"):
        mountpoints.unmount(str(tmp_path), lazy=False)


def test_umount_of_a_folder_inside_a_stopped_mount_answers(tmp_path: Path, mnt: Path) -> None:
    """Not a mount point itself, the path was probed with a statvfs without a time limit: inside a
    stopped daemon's mount, `cdmlfs umount` waited for ever."""
    good = python_zip(tmp_path / "good.zip", {"d/x.txt": b"x"})
    pid_file = tmp_path / "m.pid"
    run_cli("mount", str(good), str(mnt), "--pid-file", str(pid_file), check=True)
    pid = int(pid_file.read_text().split()[0])
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        res = run_cli("umount", str(mnt / "d"), timeout=60)
        assert time.monotonic() - started < 30 and res.returncode != 0, res.stderr
    finally:
        os.kill(pid, signal.SIGCONT)
        force_unmount(mnt)
        await_exit(pid)


def test_umount_of_a_dead_mount_keeps_a_live_one_inside(tmp_path: Path, mnt: Path) -> None:
    """The plain unmount of a dead mount fails (busy: a mount inside), and the lazy detach that
    followed took the live inner mount, and its reader, along: only --lazy may do that."""
    outer = python_zip(tmp_path / "outer.zip", {"sub/keep.txt": b"k"})
    inner = python_zip(tmp_path / "inner.zip", {"x.txt": b"x"})
    pid_file = tmp_path / "outer.pid"
    run_cli("mount", str(outer), str(mnt), "--pid-file", str(pid_file), check=True)
    outer_pid = int(pid_file.read_text().split()[0])
    run_cli("mount", str(inner), str(mnt / "sub"), "-o", "nonempty", check=True)
    try:
        os.kill(outer_pid, signal.SIGKILL)
        await_exit(outer_pid)
        res = run_cli("umount", str(mnt))
        err = res.stderr.decode()
        assert res.returncode == 2 and "still serves" in err and "--lazy" in err, err
        assert (mnt / "sub" / "x.txt").read_bytes() == b"x"  # untouched
        run_cli("umount", str(mnt / "sub"), check=True)
        run_cli("umount", str(mnt), check=True)  # then the dead one goes
        assert not is_mounted(mnt)
    finally:
        force_unmount(mnt / "sub")
        force_unmount(mnt)


@pytest.mark.parametrize("dead", [False, True], ids=["live", "dead"])
def test_umount_leaves_the_mount_underneath(dead: bool, tmp_path: Path) -> None:
    """A cdmlfs mount stacked on a tmpfs (a container volume): umount takes ours, not the tmpfs."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    archive = python_zip(tmp_path / "a.zip", sample_files())
    target = tmp_path / "volume"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "cdmlfs-test", str(target)], check=True)
    try:
        with mounted(archive, target):
            assert (target / "readme.txt").read_bytes() == sample_files()["readme.txt"]
            if dead:
                os.kill(daemon_pid(target), signal.SIGKILL)
                time.sleep(0.2)
            res = run_cli("umount", str(target))  # it used to wait 10 s, then unmount the tmpfs too
            assert res.returncode == 0, res.stderr
            with open("/proc/self/mountinfo") as f:
                under = [line for line in f if line.split()[4] == str(target)]
            assert len(under) == 1 and " tmpfs " in under[0], under
    finally:
        subprocess.run(["umount", str(target)], check=False)


def test_read_only_and_metadata(tmp_path: Path, mnt: Path) -> None:
    archive = python_zip(tmp_path / "ro.zip", sample_files())
    with mounted(archive, mnt):
        with pytest.raises(OSError) as e:
            (mnt / "readme.txt").write_text("x")
        assert e.value.errno == errno.EROFS
        with pytest.raises(OSError) as e:
            (mnt / "new").write_text("x")
        assert e.value.errno == errno.EROFS
        with pytest.raises(OSError):
            os.mkdir(mnt / "newdir")
        st = os.stat(mnt / "readme.txt")
        assert st.st_size == 5000 and st.st_nlink == 1
        assert st.st_mtime == time.mktime((2021, 6, 15, 12, 30, 44, 0, 0, -1))
        inos = {os.stat(mnt / n).st_ino for n in sample_files()}
        assert len(inos) == len(sample_files())
        vfs = os.statvfs(mnt)
        assert vfs.f_namemax == 255
        assert shutil.disk_usage(mnt).free == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_unmounts_cleanly(sig: int, tmp_path: Path, mnt: Path) -> None:
    archive = python_zip(tmp_path / "a.zip", sample_files())
    with mounted(archive, mnt):
        pid = daemon_pid(mnt)
        os.kill(pid, sig)
        for _ in range(200):
            if not is_mounted(mnt):
                break
            time.sleep(0.05)
        assert not is_mounted(mnt)
        for _ in range(100):
            if not alive(pid):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"daemon still running after {signal.Signals(sig).name}")


def test_umount_clears_dead_mount(tmp_path: Path, mnt: Path) -> None:
    archive = python_zip(tmp_path / "a.zip", sample_files())
    with mounted(archive, mnt):
        pid = daemon_pid(mnt)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(OSError) as e:
            os.listdir(mnt)
        assert e.value.errno == errno.ENOTCONN
        res = run_cli("mount", str(archive), str(mnt))
        assert res.returncode != 0 and "dead mount" in res.stderr.decode()
        res = run_cli("umount", str(mnt))
        assert res.returncode == 0, res.stderr
        assert not is_mounted(mnt)
        assert os.listdir(mnt) == []
        # and a fresh mount works
        res = run_cli("mount", str(archive), str(mnt))
        assert res.returncode == 0, res.stderr
        assert (mnt / "readme.txt").read_bytes() == sample_files()["readme.txt"]


def test_foreground_mode_serves_and_stops_on_sigint(tmp_path: Path, mnt: Path) -> None:
    import sys

    archive = python_zip(tmp_path / "a.zip", sample_files())
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdmlfs", "mount", "-f", str(archive), str(mnt)], stderr=subprocess.PIPE
    )
    try:
        for _ in range(200):
            if is_mounted(mnt):
                break
            time.sleep(0.05)
        assert (mnt / "one_byte").read_bytes() == b"x"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert not is_mounted(mnt)
        said = proc.stderr.read().decode()  # one line says it is mounted and how to stop it
        assert f"mounted {archive} on {mnt}" in said and "Ctrl-C" in said, said
    finally:
        if proc.poll() is None:
            proc.kill()


def _peak_growth_mib(
    archive: Path, mnt: Path, files: dict[str, bytes], cache_mib: int, readers: int, drop_pages: bool = False
) -> float:
    """Mount multithreaded, read every file in ``readers`` threads (each in its own shuffled order;
    with ``drop_pages`` the kernel's cached pages are dropped first, so the daemon serves every read),
    return the daemon's peak RSS growth over its RSS right after mounting (interpreter + index)."""
    from mountutil import hwm_kib, rss_kib

    with mounted(archive, mnt, "--cache-size", f"{cache_mib}M", "--threads", "multi"):
        pid = daemon_pid(mnt)
        base_kib = rss_kib(pid)

        def reader(seed: int) -> None:
            names = list(files)
            random.Random(seed).shuffle(names)
            for n in names:
                with open(mnt / n, "rb") as f:
                    if drop_pages:
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    assert f.read() == files[n]

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(readers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return (hwm_kib(pid) - base_kib) / 1024


def test_cache_bound_holds_while_reading_more_than_the_cache(tmp_path: Path, mnt: Path) -> None:
    rng = random.Random(11)
    base = text_bytes(4 << 20, 1)
    # Distinct members (a different rotation each) of 1-4 MiB: decoded, they add up to 5x the cache.
    files = {}
    for i in range(32):
        n = rng.randint(1 << 20, 4 << 20)
        k = rng.randrange(len(base))
        files[f"m{i:03d}.txt"] = (base[k:] + base[:k])[:n]
    archive = python_zip(tmp_path / "big.zip", files, zipfile.ZIP_DEFLATED)
    total = sum(len(v) for v in files.values())
    cache_mib = 16
    assert total > 4 * (cache_mib << 20)
    peak_mib = _peak_growth_mib(archive, mnt, files, cache_mib, readers=4)
    # Bound: cache + one in-flight member per serving thread + small constant.
    print(f"peak growth {peak_mib:.1f} MiB, cache {cache_mib} MiB, decoded {total >> 20} MiB")
    assert peak_mib < cache_mib + 32, f"daemon grew by {peak_mib:.0f} MiB over its post-mount RSS"


def test_cache_bound_holds_for_incompressible_members_read_by_many_threads(tmp_path: Path, mnt: Path) -> None:
    """A deflated member is read whole before it is inflated: with members that barely compress, eight
    threads used to hold a cache's worth of compressed bytes next to the cache (64 MiB cache: +130)."""
    rng = random.Random(12)
    files = {f"r{i:02d}.bin": rng.randbytes(8 << 20) for i in range(10)}
    archive = python_zip(tmp_path / "random.zip", files, zipfile.ZIP_DEFLATED)
    cache_mib = 64
    peak_mib = _peak_growth_mib(archive, mnt, files, cache_mib, readers=8, drop_pages=True)
    print(f"peak growth {peak_mib:.1f} MiB, cache {cache_mib} MiB")
    assert peak_mib < cache_mib + 32, f"daemon grew by {peak_mib:.0f} MiB over its post-mount RSS"


def _minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def test_a_big_member_read_sequentially_reuses_the_daemon_s_read_buffers(tmp_path: Path, mnt: Path) -> None:
    """libfuse allocates a buffer per read (1 MiB for sequential reads); with glibc's trim
    threshold left at 128 KiB each was given back to the OS on free and faulted in again by the
    next read: one page fault per 4 KiB served (sequential reads of big members at half speed).
    Counted, not timed: the daemon's minor page faults while it serves a 32 MiB member."""
    files = {"warm.bin": os.urandom(32 << 20), "big.bin": os.urandom(32 << 20)}
    archive = python_zip(tmp_path / "big.zip", files, zipfile.ZIP_STORED)
    with mounted(archive, mnt):
        pid = daemon_pid(mnt)
        assert (mnt / "warm.bin").read_bytes() == files["warm.bin"]  # the heap grows to its size
        before = _minor_faults(pid)
        assert (mnt / "big.bin").read_bytes() == files["big.bin"]
        faults = _minor_faults(pid) - before
    pages = (32 << 20) // 4096
    assert faults < pages // 4, f"{faults} page faults to serve {pages} pages"


def test_c_and_python_paths_serve_the_same(both_paths: str, tmp_path: Path, mnt: Path) -> None:
    """The C getattr/read callbacks and the Python ones give identical trees, bytes and errors."""
    rng = random.Random(21)
    files = {f"d{i % 3}/f{i}.bin": rng.randbytes(rng.randint(0, 150_000)) for i in range(60)}
    files.update({f"t/{i}.txt": text_bytes(rng.randint(1, 200_000), i) for i in range(30)})
    files["victim.txt"] = text_bytes(50_000, 99)
    archive = python_zip(tmp_path / "both.zip", files, zipfile.ZIP_DEFLATED)
    with zipfile.ZipFile(tmp_path / "stored.zip", "w", zipfile.ZIP_STORED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    flip_byte_in_member(archive, "victim.txt")
    flip_byte_in_member(tmp_path / "stored.zip", "victim.txt")
    for arch in (archive, tmp_path / "stored.zip"):
        log = tmp_path / f"{arch.stem}.log"
        with mounted(arch, mnt, "-v", log_file=log):
            for name, data in files.items():
                if name == "victim.txt":
                    with pytest.raises(OSError) as e:
                        (mnt / name).read_bytes()
                    assert e.value.errno == errno.EIO
                else:
                    assert (mnt / name).read_bytes() == data, name
                    assert os.stat(mnt / name).st_size == len(data)
            with open(mnt / "t/3.txt", "rb") as f:  # partial reads at odd offsets
                f.seek(12345)
                assert f.read(1000) == files["t/3.txt"][12345:13345]
        active = "C fast path active" in log.read_text()
        assert active == (both_paths == "1")


def test_errors_reach_readers_as_errno_with_a_log_line_naming_the_member(tmp_path: Path, mnt: Path) -> None:
    """Through the mount: an encrypted member is EACCES, an unsupported method (deflate64) EIO."""
    from test_api import _set_method

    archive = python_zip(
        tmp_path / "m.zip", {"d64.bin": b"a" * 1000, "enc.bin": b"b" * 1000, "ok.txt": b"fine"}
    )
    _set_method(archive, "d64.bin", 9)
    _set_method(archive, "enc.bin", 8, flag_or=1)
    log = tmp_path / "daemon.log"
    with mounted(archive, mnt, log_file=log):
        for name, code in (("enc.bin", errno.EACCES), ("d64.bin", errno.EIO)):
            with pytest.raises(OSError) as exc:
                (mnt / name).read_bytes()
            assert exc.value.errno == code, name
        assert (mnt / "ok.txt").read_bytes() == b"fine"
    text = log.read_text()
    assert "enc.bin" in text and "encrypt" in text
    assert "d64.bin" in text and "deflate64" in text


def test_members_can_be_memory_mapped_unless_direct_io_is_asked_for(tmp_path: Path, mnt: Path) -> None:
    """np.memmap / mmap work on a default mount; --direct-io-min makes those members ENODEV for mmap
    (and serves them bypassing the page cache), as the README says."""
    import mmap

    big = os.urandom(3 << 20)
    archive = python_zip(
        tmp_path / "m.zip", {"big.bin": big, "small.txt": b"small"}, compression=zipfile.ZIP_STORED
    )
    with (
        mounted(archive, mnt),
        open(mnt / "big.bin", "rb") as f,
        mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m,
    ):
        assert m[: 1 << 20] == big[: 1 << 20] and m[-10:] == big[-10:]
    with mounted(archive, mnt, "--direct-io-min", "1M"):
        with open(mnt / "big.bin", "rb") as f:
            with pytest.raises(OSError) as exc:
                mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            assert exc.value.errno == errno.ENODEV
            assert f.read() == big
        with open(mnt / "small.txt", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            assert m[:] == b"small"  # below the threshold: page cache, mmap-able


def _listing(root: Path) -> dict[bytes, tuple]:
    """Every directory entry below root as scandir gives it: inode, type and full stat, by bytes path."""
    out: dict[bytes, tuple] = {}
    todo = [os.fsencode(root)]
    while todo:
        d = todo.pop()
        with os.scandir(d) as it:
            for e in it:
                rel = os.path.relpath(e.path, os.fsencode(root))
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError as exc:  # an inconsistent member: EIO on stat, by design
                    out[rel] = ("error", exc.errno)
                    continue
                out[rel] = (
                    e.inode(), e.is_dir(follow_symlinks=False), e.is_symlink(),
                    st.st_mode, st.st_ino, st.st_nlink, st.st_size, st.st_mtime_ns, st.st_blocks,
                )  # fmt: skip
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
    return out


def test_directory_listings_in_c_equal_python_ones(tmp_path: Path, mnt: Path, monkeypatch) -> None:
    """readdir answered in C gives what Python gives: names, inodes, types and READDIRPLUS attributes;
    directories with an entry C cannot describe (a name that is not UTF-8, an inconsistent member)
    are listed by Python."""
    from fuzz import craft

    members = [craft.member(f"big/f{i:05d}.txt", b"x" * (i % 7)) for i in range(3000)]
    members += [
        craft.member("a/b/c/deep.txt", b"deep"),
        craft.member("a/link", b"b/c/deep.txt", method=0, mode=0o120777),
        craft.member("empty/", b"", method=0, mode=0o040755),
        craft.member(b"raw/latin\xe9.txt", b"latin"),  # Unix name bytes that are not UTF-8
        craft.member("raw/ok.txt", b"ok"),
        craft.member("odd/liar.txt", b"", crc=1),  # declared empty with a CRC: inconsistent
        craft.member("odd/fine.txt", b"fine"),
    ]
    # A long listing that C starts and hands to Python partway (the entry after m00700.txt has a
    # name that is not UTF-8; m01200.txt is inconsistent): both number entries alike.
    members += [craft.member(f"mixed/m{i:05d}.txt", b"m" * (i % 5 + 1)) for i in range(1500) if i != 1200]
    members += [craft.member(b"mixed/m00700\xe9.txt", b"raw"), craft.member("mixed/m01200.txt", b"", crc=1)]
    archive = tmp_path / "l.zip"
    archive.write_bytes(craft.build_zip(members))
    seen = {}
    for fast in ("1", "0"):
        monkeypatch.setenv("CDMLFS_FASTPATH", fast)
        with mounted(archive, mnt):
            seen[fast] = _listing(mnt)
            if fast == "1":
                counters = mount_stats(mnt)["fast_path"]
                assert counters["readdir_fast"] >= 5 and counters["readdir_fallback"] >= 2, counters
    assert seen["1"] == seen["0"]
    assert len(seen["1"]) == 3000 + 13 + 1 + 1501


def test_a_listing_spares_the_lookups_of_the_files_it_lists(
    both_paths: str, tmp_path: Path, mnt: Path
) -> None:
    """READDIRPLUS entries carry node ids and attributes, so files opened after a listing need no
    LOOKUP round trip (with offset 0 libfuse sent id 0 and the kernel looked every file up again)."""
    files = {f"d/f{i:04d}.txt": f"{i}".encode() for i in range(2000)}
    archive = python_zip(tmp_path / "a.zip", files)
    with mounted(archive, mnt):
        names = os.listdir(mnt / "d")
        assert sorted(names) == sorted(n.split("/")[1] for n in files)
        before = mount_stats(mnt)["requests"]["getattr"]
        for name in names:
            assert (mnt / "d" / name).read_bytes() == files[f"d/{name}"]
        lookups = mount_stats(mnt)["requests"]["getattr"] - before
        assert lookups < 20, lookups  # was one per file


def test_nonempty_option_default_log_path_and_the_pure_python_paths(tmp_path: Path) -> None:
    """-o nonempty mounts over files; without --log-file the daemon logs where the README says
    ($XDG_STATE_HOME/cdmlfs/<mount point>-<hash>.log) and -v prints that path; with the C
    accelerators and our FUSE loop turned off (CDMLFS_NATIVE=0, CDMLFS_FASTPATH=0,
    CDMLFS_FUSELOOP=0) the mount serves the same bytes."""
    files = sample_files()
    archive = python_zip(tmp_path / "a.zip", files)
    over = tmp_path / "over"
    over.mkdir()
    (over / "hidden.txt").write_text("under the mount")
    state = Path(os.environ["XDG_STATE_HOME"]) / "cdmlfs"
    env = {**os.environ, "CDMLFS_NATIVE": "0", "CDMLFS_FASTPATH": "0", "CDMLFS_FUSELOOP": "0"}
    res = run_cli("mount", "-v", "-o", "nonempty", str(archive), str(over), env=env)
    try:
        assert res.returncode == 0, res.stderr.decode()
        logs = [
            p for p in state.glob("*.log") if p.name.startswith(str(over).strip("/").replace("/", "_")[-120:])
        ]
        assert len(logs) == 1 and str(logs[0]) in res.stdout.decode(), (logs, res.stdout)
        assert not (over / "hidden.txt").exists()
        for name, data in files.items():
            assert (over / name).read_bytes() == data, name
        stats = mount_stats(over)
        assert stats["loop"] is None and stats["fast_path"] is None  # libfuse's own loop, Python callbacks
        doctor = run_cli("doctor", env=env, check=True).stdout.decode()
        assert "CDMLFS_NATIVE=0" in doctor and "CDMLFS_FASTPATH=0" in doctor
    finally:
        run_cli("umount", str(over))
    assert (over / "hidden.txt").read_text() == "under the mount"


def test_a_failed_mount_reports_what_fusermount_said(tmp_path: Path) -> None:
    """Mounting as a user who is not root goes through fusermount, whose reasons ("option allow_other
    only allowed if 'user_allow_other' is set in /etc/fuse.conf") were left in the log: the command
    said only that libfuse failed."""
    from cdmlfs.daemon import _last_log_line

    log = tmp_path / "d.log"
    log.write_text(
        "old line\n"
        "fusermount3: option allow_other only allowed if 'user_allow_other' is set in /etc/fuse.conf\n"
        "2026-12-01 ERROR cdmlfs.daemon[7]: daemon failed: CdmlfsError: libfuse could not mount\n"
    )
    assert _last_log_line(str(log), len("old line\n")) == (
        "fusermount3: option allow_other only allowed if 'user_allow_other' is set in /etc/fuse.conf"
    )


def test_a_home_that_cannot_hold_the_log_falls_back_to_a_private_temporary_folder(
    tmp_path: Path, mnt: Path
) -> None:
    """A read-only or missing home (HOME=/ for a container's arbitrary uid) failed the mount with
    "no such directory" for the default log. The log and the lock go to /tmp/cdmlfs-UID instead."""
    import tempfile

    good = python_zip(tmp_path / "good.zip", sample_files())
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the home's folders would go")
    env = {k: v for k, v in os.environ.items() if k != "XDG_STATE_HOME"}
    env["HOME"] = str(blocker / "home")
    res = run_cli("mount", str(good), str(mnt), "-v", env=env)
    try:
        assert res.returncode == 0, res.stderr.decode()
        private = Path(tempfile.gettempdir()) / f"cdmlfs-{os.getuid()}"
        assert f"log {private}/" in res.stdout.decode(), res.stdout.decode()
        assert private.stat().st_mode & 0o777 == 0o700
    finally:
        run_cli("umount", str(mnt))
