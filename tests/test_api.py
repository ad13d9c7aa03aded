"""The Python API and the no-mount CLI commands (ls, cat, extract) on real archives."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import random
import struct
import time
import zipfile
from pathlib import Path

import pytest
from archives import flip_byte_in_member, infozip, python_zip, sample_files, text_bytes, write_tree
from mountutil import run_cli
from parallel import run_in_threads

import cdmlfs
from cdmlfs.errors import (
    CorruptMemberError,
    EncryptedMemberError,
    LinkLoopError,
    NotFoundError,
    PathNotADirectoryError,
    UnsupportedMethodError,
    UsageError,
)


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    return python_zip(tmp_path / "a.zip", sample_files(), zipfile.ZIP_DEFLATED, dirs=("emptydir/",))


def test_list_stat_read(archive: Path) -> None:
    files = sample_files()
    with cdmlfs.open(str(archive)) as ar:
        assert sorted(ar.listdir("")) == sorted(["readme.txt", "data", "ünïcødé", "one_byte", "emptydir"])
        assert ar.isdir("data/nested") and ar.isfile("data/empty.txt") and not ar.exists("nope")
        assert sorted(ar.files()) == sorted(files)
        for name, data in files.items():
            assert ar.read(name) == data
            assert ar.stat(name).size == len(data)
        blob = files["data/random.bin"]
        for off, n in [(0, 10), (1234, 5000), (len(blob) - 3, 100), (len(blob), 10), (5, 0)]:
            assert ar.read("data/random.bin", off, n) == blob[off : off + n]
        walked = {d: (sorted(ds), sorted(fs)) for d, ds, fs in ar.walk()}
        assert walked["data"] == (["nested"], ["empty.txt", "random.bin", "zeros.bin"])
        with pytest.raises(NotFoundError):
            ar.read("missing")


def test_file_object_seek_and_read(archive: Path) -> None:
    blob = sample_files()["data/zeros.bin"]
    with cdmlfs.open(str(archive)) as ar, ar.open("data/zeros.bin") as f:
        assert f.read(10) == blob[:10]
        f.seek(-5, io.SEEK_END)
        assert f.read() == blob[-5:]
        f.seek(1000)
        assert f.tell() == 1000
        assert f.read(2000) == blob[1000:3000]


def test_pickles_small_and_reopens(archive: Path) -> None:
    with cdmlfs.open(str(archive)) as ar:
        blob = pickle.dumps(ar)
        assert len(blob) < 500
        again = pickle.loads(blob)
        assert again.read("one_byte") == b"x"
        again.close()


def test_a_relative_file_uri_pickles_to_the_same_file(archive: Path, tmp_path: Path, monkeypatch) -> None:
    """``file://data.zip`` kept its relative path in the pickle: a worker in another directory
    failed to open it (or opened another file of that name)."""
    monkeypatch.chdir(archive.parent)
    with cdmlfs.open(f"file://{archive.name}") as ar:
        blob = pickle.dumps(ar)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (elsewhere / archive.name).write_bytes(b"not it")
    with pickle.loads(blob) as again:
        assert again.read("one_byte") == b"x"
    odd = tmp_path / "we:" / "a.zip"  # "://" further in a file:// path is part of the path
    odd.parent.mkdir()
    odd.write_bytes(archive.read_bytes())
    with cdmlfs.open(f"file://{tmp_path}/we://a.zip") as ar:
        assert ar.read("one_byte") == b"x"


def test_extract_and_archive_order(archive: Path, tmp_path: Path) -> None:
    with cdmlfs.open(str(archive)) as ar:
        out = ar.extract("data", str(tmp_path / "out"))
        assert Path(out, "nested/deep/file.csv").read_bytes() == sample_files()["data/nested/deep/file.csv"]
        order = ar.archive_order()
        assert sorted(order) == sorted(sample_files())
        offsets = [ar.index.offset[ar.index.lookup(p)] for p in order]
        assert offsets == sorted(offsets)
        assert [ar.position(p) for p in order] == offsets
        from cdmlfs.errors import PathIsADirectoryError

        with pytest.raises(PathIsADirectoryError):
            ar.position("data")  # no bytes of its own: 0 sorted it before every file


def test_symlinks_resolve_inside_the_archive(tmp_path: Path) -> None:
    src = write_tree(
        tmp_path / "src",
        {"real/f.txt": b"payload"},
        symlinks={"l1": "real/f.txt", "dirlink": "real", "up": "../../outside", "abs": "/etc/passwd"},
    )
    z = infozip(tmp_path / "l.zip", src)
    with cdmlfs.open(str(z)) as ar:
        assert ar.read("l1") == b"payload"
        assert ar.read("dirlink/f.txt") == b"payload"
        assert ar.readlink("abs") == "/etc/passwd"
        with pytest.raises(NotFoundError):
            ar.read("abs")  # never follows a link out of the archive
        with pytest.raises(NotFoundError):
            ar.read("up")


def _set_method(path: Path, member: str, method: int, flag_or: int = 0) -> None:
    """Patch a member's method (and flags) in both headers: a real archive a foreign tool could write."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    lh = info.header_offset
    struct.pack_into("<H", data, lh + 8, method)
    data[lh + 6] |= flag_or
    cd = data.find(b"PK\x01\x02")
    while cd >= 0:
        nlen = struct.unpack_from("<H", data, cd + 28)[0]
        if bytes(data[cd + 46 : cd + 46 + nlen]) == member.encode():
            struct.pack_into("<H", data, cd + 10, method)
            data[cd + 8] |= flag_or
        cd = data.find(b"PK\x01\x02", cd + 4)
    path.write_bytes(bytes(data))


def test_unsupported_and_encrypted_members_are_listed_but_refuse_to_read(tmp_path: Path) -> None:
    z = python_zip(tmp_path / "m.zip", {"d64.bin": b"a" * 1000, "enc.bin": b"b" * 1000, "ok.txt": b"fine"})
    _set_method(z, "d64.bin", 9)  # deflate64
    _set_method(z, "enc.bin", 8, flag_or=1)  # traditional PKWARE encryption flag
    with cdmlfs.open(str(z)) as ar:
        assert sorted(ar.listdir("")) == ["d64.bin", "enc.bin", "ok.txt"]
        with pytest.raises(UnsupportedMethodError, match="deflate64"):
            ar.read("d64.bin")
        with pytest.raises(EncryptedMemberError, match=r"enc\.bin"):
            ar.read("enc.bin")
        assert ar.read("ok.txt") == b"fine"


def test_zip_bomb_declared_size_mismatch_is_corrupt(tmp_path: Path) -> None:
    """A member that inflates to more (or less) than its declared size is an error, never truncated data."""
    z = python_zip(tmp_path / "bomb.zip", {"bomb": bytes(5_000_000), "small": text_bytes(1000)})
    data = bytearray(z.read_bytes())
    cd = data.find(b"PK\x01\x02")
    while cd >= 0:
        nlen = struct.unpack_from("<H", data, cd + 28)[0]
        name = bytes(data[cd + 46 : cd + 46 + nlen])
        if name == b"bomb":
            struct.pack_into("<I", data, cd + 24, 1000)  # claims 1000 bytes
        if name == b"small":
            struct.pack_into("<I", data, cd + 24, 5000)  # claims more than it has
        cd = data.find(b"PK\x01\x02", cd + 4)
    z.write_bytes(bytes(data))
    with cdmlfs.open(str(z)) as ar:
        assert ar.stat("bomb").size == 1000
        with pytest.raises(CorruptMemberError):
            ar.read("bomb")
        with pytest.raises(CorruptMemberError):
            ar.read("small")


def test_cli_ls_cat_extract(archive: Path, tmp_path: Path) -> None:
    res = run_cli("ls", str(archive), check=True)
    assert sorted(res.stdout.decode().split()) == sorted(
        ["data/", "emptydir/", "one_byte", "readme.txt", "ünïcødé/"]
    )
    res = run_cli("ls", "-l", "-R", str(archive), "data", check=True)
    assert "data/nested/deep/file.csv" in res.stdout.decode()
    res = run_cli("cat", str(archive), "readme.txt", check=True)
    assert res.stdout == sample_files()["readme.txt"]
    out = tmp_path / "x"
    run_cli("extract", str(archive), "data/random.bin", "ünïcødé", "-C", str(out), check=True)
    assert (out / "data/random.bin").read_bytes() == sample_files()["data/random.bin"]
    assert (out / "ünïcødé/名前.txt").read_bytes() == sample_files()["ünïcødé/名前.txt"]
    os.symlink("missing-dir", tmp_path / "dangling")  # it said "File exists: dangling"
    res = run_cli("extract", str(archive), "readme.txt", "-C", str(tmp_path / "dangling"))
    err = res.stderr.decode().strip()
    assert res.returncode == 2 and err.endswith("a symlink to 'missing-dir', which does not exist"), err
    res = run_cli("extract", str(archive), "readme.txt", "-C", "")  # was a bare "No such file...", exit 1
    err = res.stderr.decode().strip()
    assert res.returncode == 2 and err == "cdmlfs: -C needs a directory (an empty name was given)", err
    res = run_cli("--version", check=True)
    assert b"cdmlfs" in res.stdout and b"inflate" in res.stdout


def test_cli_ls_marks_folders_alike_and_quotes_control_characters_on_a_terminal(tmp_path: Path) -> None:
    z = python_zip(tmp_path / "n.zip", {"dir/a.txt": b"a", "line\nbreak.txt": b"b"})
    short = run_cli("ls", str(z), check=True).stdout.decode()
    long = run_cli("ls", "-l", str(z), check=True).stdout.decode()
    first = long.splitlines()[0]
    assert "dir/\n" in short and first.startswith("d") and first.endswith(" dir/")  # -l marks them too
    assert "line\nbreak.txt\n" in short  # piped: the raw name, as GNU ls writes it for scripts
    res = run_cli("ls", str(z), "dir/a.txt/")
    assert res.returncode != 0 and "not a directory" in res.stderr.decode()
    shown = _on_a_terminal("ls", str(z))  # on a terminal, a name cannot break a line
    assert "$'line\\x0abreak.txt'" in shown, shown


def test_cli_ls_l_reports_an_unreadable_link_and_lists_the_rest(tmp_path: Path) -> None:
    """A link whose target cannot be read stopped the listing there (entries after it were never
    shown); GNU ls says so, lists the link without a target, goes on and exits 1."""
    z = tmp_path / "links.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("a.txt", b"a")
        link = zipfile.ZipInfo("b-link")
        link.create_system = 3
        link.external_attr = 0o120777 << 16
        zf.writestr(link, b"x" * 5000)  # longer than PATH_MAX: no link target can be
        zf.writestr("c.txt", b"c")
    res = run_cli("ls", "-l", str(z))
    lines = res.stdout.decode().splitlines()
    assert [line.rsplit(" ", 1)[1] for line in lines] == ["a.txt", "b-link", "c.txt"], lines
    assert res.returncode == 1
    why = "symlink target is 5000 bytes (more than 4096)"
    assert res.stderr.decode() == f"cdmlfs: cannot read symbolic link b-link: {why}\n"


def test_cli_ls_sorts_by_name_and_shows_a_link_to_a_folder_with_l_as_ls_does(tmp_path: Path) -> None:
    """A tar listed in archive order (ls sorts by name), and `ls -l dl` listed what dl points to."""
    import tarfile

    tar = tmp_path / "o.tar"
    with tarfile.open(tar, "w") as tf:
        for name in ("zeta.txt", "d/b.txt", "alpha.txt", "d/a.txt", "d.txt", "d-x/c.txt"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tf.addfile(info, io.BytesIO(b"x"))
        link = tarfile.TarInfo("dl")
        link.type, link.linkname = tarfile.SYMTYPE, "d"
        tf.addfile(link)
    idx = ("--index-dir", str(tmp_path / "idx"))
    assert run_cli("ls", str(tar), *idx, check=True).stdout.decode().split() == [
        "alpha.txt", "d/", "d-x/", "d.txt", "dl", "zeta.txt"
    ]  # fmt: skip
    assert run_cli("ls", "-R", str(tar), *idx, check=True).stdout.decode().split() == [
        "alpha.txt",
        "d/",
        "d/a.txt",
        "d/b.txt",
        "d-x/",
        "d-x/c.txt",
        "d.txt",
        "dl",
        "zeta.txt",
    ]  # fmt: skip  (a folder's contents right after it, as ls -R shows them)
    assert run_cli("ls", str(tar), "d", *idx, check=True).stdout.decode().split() == ["a.txt", "b.txt"]
    long = run_cli("ls", "-l", str(tar), "dl", *idx, check=True).stdout.decode().splitlines()
    assert len(long) == 1 and long[0].startswith("l") and long[0].endswith("dl -> d"), long
    inside = run_cli("ls", "-l", str(tar), "dl/", *idx, check=True).stdout.decode().splitlines()
    assert [line.split()[-1] for line in inside] == ["a.txt", "b.txt"], inside
    assert run_cli("ls", str(tar), "dl", *idx, check=True).stdout.decode().split() == ["a.txt", "b.txt"]


def test_cli_ls_l_quotes_link_targets_on_a_terminal(tmp_path: Path) -> None:
    """The name was quoted but not the `-> target` of a link: an archive could send escapes."""
    import tarfile

    tar = tmp_path / "esc.tar"
    with tarfile.open(tar, "w") as tf:
        info = tarfile.TarInfo("link")
        info.type, info.linkname = tarfile.SYMTYPE, "x\x1b]0;PWNED\x07\nfake-line"
        tf.addfile(info)
    shown = _on_a_terminal("ls", "-l", str(tar), "--index-dir", str(tmp_path / "idx"))
    assert "\x1b" not in shown and "fake-line" in shown and len(shown.strip().splitlines()) == 1, shown
    assert shown.strip().endswith("link -> $'x\\x1b]0;PWNED\\x07\\x0afake-line'"), shown


def _on_a_terminal(*args: str) -> str:
    """What ``cdmlfs ARGS`` shows with its output on a terminal (a pty)."""
    import pty
    import subprocess
    import sys

    controller, terminal = pty.openpty()
    with subprocess.Popen(
        [sys.executable, "-m", "cdmlfs", *args], stdout=terminal, stderr=subprocess.DEVNULL
    ) as proc:
        os.close(terminal)
        shown = b""
        while chunk := _read_pty(controller):
            shown += chunk
        assert proc.wait(timeout=60) == 0
    os.close(controller)
    return shown.decode()


def _read_pty(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except OSError:  # EIO once the child closed its side
        return b""


def test_cli_extract_of_a_folder_goes_on_past_a_bad_entry(tmp_path: Path) -> None:
    """As tar -x: a corrupt member, or a name taken at the destination, is reported on its own line
    and the rest of the folder is extracted; the exit status says something failed."""
    files = {f"train/{c}/{i}.txt": text_bytes(3000 + i, i) for c in ("cat", "dog") for i in range(3)}
    z = python_zip(tmp_path / "c.zip", files, zipfile.ZIP_DEFLATED)
    flip_byte_in_member(z, "train/cat/1.txt")
    out = tmp_path / "out"
    (out / "train/dog/2.txt").mkdir(parents=True)  # a directory where a file goes, not empty
    (out / "train/dog/2.txt/keep").write_bytes(b"")
    res = run_cli("extract", str(z), "train", "-C", str(out))
    err = res.stderr.decode()
    assert res.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 3 and "Traceback" not in err, err
    assert lines[0].startswith("cdmlfs: train/cat/1.txt: ") and "train/dog/2.txt" in lines[1], err
    assert "2 entries not extracted" in lines[2]
    for name, data in files.items():
        if name not in ("train/cat/1.txt", "train/dog/2.txt"):
            assert (out / name).read_bytes() == data, name
    assert not (out / "train/cat/1.txt").exists()  # never a partial or wrong file


def test_links_resolve_where_they_are_and_a_slash_asks_for_a_directory(tmp_path: Path) -> None:
    """A relative link reached through another link is relative to the folder it really is in
    (the path asked for names another folder: it read another file's bytes), as the kernel
    resolves it through a mount; "file/" is not a file, as for os."""
    import tarfile

    src = tmp_path / "d"
    (src / "sub/deeper").mkdir(parents=True)
    (src / "b.txt").write_bytes(b"root b")
    (src / "sub/b.txt").write_bytes(b"sub b")
    os.symlink("sub/deeper", src / "deep")
    os.symlink("../b.txt", src / "sub/deeper/x")
    os.symlink("../../sub", src / "sub/deeper/back")
    os.symlink("deep", src / "d1")  # a link to a link to a folder
    os.symlink("b.txt", src / "sub/l")
    with tarfile.open(tmp_path / "l.tar", "w") as tf:
        tf.add(src, arcname=".")
    with cdmlfs.open(tmp_path / "l.tar", index_dir=str(tmp_path / "idx")) as ar:
        for path in ("deep/x", "sub/deeper/x", "deep/back/deeper/x", "deep/back/b.txt"):
            assert ar.read(path) == (src / path).read_bytes(), path
        assert not ar.exists("b.txt/") and not ar.isfile("b.txt/") and ar.isdir("deep/")
        # Parent links are followed; the last component only when asked (lstat, readlink).
        assert ar.readlink("d1/back/l") == os.readlink(src / "d1/back/l") == "b.txt"
        assert ar.stat("d1/back/l", follow_symlinks=False).is_symlink
        with pytest.raises(OSError):  # as os.readlink: EINVAL, an OSError too
            ar.readlink("b.txt")
        assert ar.listdir("deep/") == sorted(os.listdir(src / "deep"))
        with pytest.raises(PathNotADirectoryError):
            ar.read("b.txt/")


def test_odd_paths_resolve_as_the_kernel_resolves_them(tmp_path: Path) -> None:
    """``.``, ``..``, ``//`` and trailing slashes around links, compared with the same tree on disk.

    The API normalised paths as text before following links: ``deep/../b.txt`` (deep -> sub/deeper)
    read the root's b.txt where the kernel reads sub/b.txt, and ``b.txt/.`` read a file."""
    import stat
    import tarfile

    from cdmlfs.errors import CdmlfsError, PathIsADirectoryError

    src = tmp_path / "d"
    (src / "sub/deeper").mkdir(parents=True)
    (src / "e").mkdir()
    (src / "b.txt").write_bytes(b"root b")
    (src / "sub/b.txt").write_bytes(b"sub b")
    (src / "sub/deeper/f").write_bytes(b"deep f")
    links = {
        "deep": "sub/deeper",
        "sub/deeper/x": "../b.txt",
        "sub/deeper/back": "../../sub",
        "d1": "deep",
        "sub/l": "b.txt",
        "up": "sub/deeper/..",
        "dots": "./sub/./deeper/",
        "slash": "b.txt/",
        "loop1": "loop2",
        "loop2": "loop1",
        "deep2": "deep/../deeper",  # deep/.. is sub: sub/deeper
    }
    for name, target in links.items():
        os.symlink(target, src / name)
    with tarfile.open(tmp_path / "l.tar", "w") as tf:
        tf.add(src, arcname=".")

    def on_disk(path: str) -> tuple:
        full = os.path.join(src, path)
        try:
            with open(full, "rb") as f:
                return ("file", f.read())
        except IsADirectoryError:
            return ("dir", sorted(os.listdir(full)))
        except OSError as exc:
            return ("error", exc.errno)

    def lstat_on_disk(path: str) -> tuple:
        try:
            return ("link" if stat.S_ISLNK(os.lstat(os.path.join(src, path)).st_mode) else "other",)
        except OSError as exc:
            return ("error", exc.errno)

    paths = [
        "deep/../b.txt", "d1/../b.txt", "deep/back/../b.txt", "deep/back/deeper/../b.txt", "deep/x",
        "up/b.txt", "up/deeper/f", "dots/f", "dots", "deep2/f", "deep/./f", "deep/.", "deep/", "deep//f",
        "sub/./b.txt", "sub//b.txt", "./b.txt", "b.txt", "b.txt/", "b.txt/.", "b.txt/..", "sub/l/",
        "sub/l/..", "slash", "loop1", "loop1/x", "e/.", "e/..", "e/../b.txt", "nothing/..",
        "deep/nothing/..", "sub/deeper/back/deeper/x", "d1/back/l", "d1/back/l/",
    ]  # fmt: skip
    with cdmlfs.open(tmp_path / "l.tar", index_dir=str(tmp_path / "idx")) as ar:

        def through_api(path: str) -> tuple:
            try:
                return ("file", ar.read(path))
            except PathIsADirectoryError:
                return ("dir", sorted(ar.listdir(path)))
            except CdmlfsError as exc:
                return ("error", exc.errno)

        def lstat_through_api(path: str) -> tuple:
            try:
                return ("link" if ar.stat(path, follow_symlinks=False).is_symlink else "other",)
            except CdmlfsError as exc:
                return ("error", exc.errno)

        for path in paths:
            assert through_api(path) == on_disk(path), path
            assert lstat_through_api(path) == lstat_on_disk(path), path
        assert through_api("deep/../b.txt") == ("file", b"sub b")  # not the root's b.txt
        # Names given back for such paths are where they resolved to, not the text folded.
        top, _, files = next(ar.walk("deep/.."))
        assert top == "sub" and "b.txt" in files and ar.read(f"{top}/b.txt") == b"sub b"
        with ar.open("deep/../b.txt") as f, ar.open("deep/../l") as g:
            assert f.name == "sub/b.txt" and g.name == "sub/l"  # a link keeps its own name
        # ".." at the root stays there (the package's path rule); a link may not climb out of it.
        assert ar.read("../b.txt") == ar.read("/../sub/../b.txt") == b"root b"
    z = _links_zip(tmp_path / "z.zip", {"out": "sub/../../x", "empty": "", "sub/keep": ".."}, {"x": b"x"})
    with cdmlfs.open(z) as ar:
        assert [ar.exists(p) for p in ("out", "empty", "sub/keep/x")] == [False, False, True]
        with pytest.raises(NotFoundError, match="outside the archive"):
            ar.read("out")
        assert "empty" not in ar.listdir("")  # no file system holds an empty link target: skipped


def test_an_archive_dropped_without_close_lets_go_of_its_descriptor_and_threads(tmp_path: Path) -> None:
    import gc
    import threading
    import warnings

    from cdmlfs.pack import pack

    (tmp_path / "d").mkdir()
    blob = text_bytes(3 << 20, 7)
    (tmp_path / "d/big.txt").write_bytes(blob)
    pack(str(tmp_path / "d"), str(tmp_path / "t.tar.zst"), frame_size=1 << 20)
    z = python_zip(tmp_path / "z.zip", {"a.txt": b"a" * 1000})

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def on_archives() -> int:  # descriptors still open on the archives themselves
        targets = {str(tmp_path / "t.tar.zst"), str(z)}
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
                count += os.readlink(f"/proc/self/fd/{fd}") in targets
        return count

    gc.collect()
    fds0, threads0 = fds(), threading.active_count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for _ in range(10):
            assert cdmlfs.open(tmp_path / "t.tar.zst", index_dir=str(tmp_path / "i")).read("big.txt") == blob
            assert cdmlfs.open(z).read("a.txt") == b"a" * 1000
        gc.collect()
        for _ in range(100):  # the frame threads stop on their own after being told to
            if threading.active_count() == threads0:
                break
            time.sleep(0.05)
    # Closed descriptors are kept on /dev/null for a while (LocalFile.close), at most RETIRED_MAX.
    from cdmlfs.sources.local import RETIRED_MAX

    assert on_archives() == 0 and fds() <= fds0 + RETIRED_MAX and threading.active_count() == threads0
    assert sum(issubclass(w.category, ResourceWarning) for w in caught) == 20  # said, as for files
    f = cdmlfs.open(z).open("a.txt")  # the file keeps its archive open
    gc.collect()
    assert f.read() == b"a" * 1000
    f.close()


def test_random_ranges_of_large_members_all_methods(tmp_path: Path) -> None:
    rng = random.Random(3)
    blob = text_bytes(3_000_000, 4) + rng.randbytes(500_000)
    for comp in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA):
        z = python_zip(tmp_path / f"r{comp}.zip", {"blob": blob}, comp)
        # A tiny cache forces the large-member paths (checkpoints, forward decoding).
        with cdmlfs.open(str(z), cache_size=4 << 20) as ar:
            for _ in range(25):
                off = rng.randrange(len(blob))
                n = rng.randrange(1, 300_000)
                assert ar.read("blob", off, n) == blob[off : off + n], (comp, off, n)
            assert ar.read("blob") == blob


def test_index_memory_is_compact(tmp_path: Path) -> None:
    z = tmp_path / "many.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for i in range(20_000):
            zf.writestr(f"train/c{i % 100:03d}/img_{i:07d}.jpg", b"x")
    with cdmlfs.open(str(z)) as ar:
        per_entry = ar.index.nbytes() / 20_000
    assert per_entry < 300, per_entry  # 200k entries in well under 80 MiB


def test_cache_size_takes_the_cli_forms_and_refuses_what_cannot_work(archive: Path) -> None:
    with cdmlfs.open(str(archive), cache_size="64M") as ar:
        assert ar.cache.limit == 64 << 20 and ar.read("readme.txt") == sample_files()["readme.txt"]
    for bad, error in ((0, ValueError), (1000, ValueError), ("lots", ValueError), (2.5e9, TypeError)):
        with pytest.raises(error, match=r"cache_size|size"):  # at open, not at the first read
            cdmlfs.open(str(archive), cache_size=bad)
    with pytest.raises(cdmlfs.CdmlfsError) as e, cdmlfs.open(str(archive)) as ar:  # the API's errors
        ar.read("no/such/member")
    assert isinstance(e.value, cdmlfs.NotFoundError) and e.value.errno == 2
    with pytest.raises(cdmlfs.ArchiveNotFoundError) as e:
        cdmlfs.open(str(archive) + ".missing")
    assert e.value.errno == 2 and isinstance(e.value, cdmlfs.UsageError)  # the CLI: exit status 2
    with pytest.raises(cdmlfs.NotASymlinkError), cdmlfs.open(str(archive)) as ar:
        ar.readlink("readme.txt")
    with cdmlfs.open(str(archive)) as ar:  # size=None: to the end, like -1
        whole = sample_files()["readme.txt"]
        assert ar.read("readme.txt", size=None) == ar.read("readme.txt", 0, -1) == whole


def test_open_missing_file_is_usage_error(tmp_path: Path) -> None:
    from cdmlfs.errors import UsageError

    with pytest.raises(UsageError):
        cdmlfs.open(str(tmp_path / "nope.zip"))
    os.mkdir(tmp_path / "adir")
    with pytest.raises(UsageError):
        cdmlfs.open(str(tmp_path / "adir"))


def test_archive_is_fork_safe_and_shares_its_index(tmp_path: Path) -> None:
    """A forked child reads through the parent's Archive (index shared, fresh cache and locks)."""
    import signal
    import threading

    files = {f"f{i}.txt": text_bytes(50_000 + i, i) for i in range(40)}
    z = python_zip(tmp_path / "fork.zip", files)
    with cdmlfs.open(str(z), cache_size=8 << 20) as ar:
        stop = threading.Event()

        def hammer() -> None:  # parent threads hold the cache lock at random moments during the fork
            while not stop.is_set():
                for name in files:
                    ar.read(name, 100, 1000)

        threads = [threading.Thread(target=hammer) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            pids = []
            for _ in range(4):
                pid = os.fork()
                if pid == 0:  # child: must not deadlock (SIGALRM ends a hang), must read correct bytes
                    signal.alarm(30)
                    ok = all(ar.read(n) == d for n, d in files.items()) and ar.cache.held <= 8 << 20
                    os._exit(0 if ok else 1)
                pids.append(pid)
            for pid in pids:
                _, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert ar.position("f3.txt") < ar.position("f4.txt")


def test_extract_never_writes_through_a_link_in_the_way(tmp_path: Path) -> None:
    """A member (or an earlier extraction) leaves a symlink where a file, or its temporary copy, goes:
    nothing outside -C DIR is written, and a failed copy leaves no partial file behind."""
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    z = tmp_path / "evil.zip"
    with zipfile.ZipFile(z, "w") as zf:
        link = zipfile.ZipInfo("x.cdmlfs-partial")
        link.external_attr = (0o120777 << 16) | 0x20
        link.create_system = 3
        zf.writestr(link, str(victim))  # the old temporary name of "x", pointing outside
        zf.writestr("x", b"ATTACKER CONTENT")
        zf.writestr("d/inner.txt", b"inside")
    out = tmp_path / "out"
    for _ in range(2):  # the second run finds the link already there
        run_cli("extract", str(z), "", "-C", str(out), check=True)
    assert victim.read_text() == "original"
    assert (out / "x").read_bytes() == b"ATTACKER CONTENT" and not (out / "x").is_symlink()
    # A directory of the destination that is a link to elsewhere: refused, nothing written there.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "d").rename(tmp_path / "d-moved")
    (out / "d").symlink_to(elsewhere)
    res = run_cli("extract", str(z), "d/inner.txt", "-C", str(out))
    assert res.returncode != 0 and "outside" in res.stderr.decode()
    assert list(elsewhere.iterdir()) == []
    # A corrupt member: an error, and no temporary file left in the destination.
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("f.bin", text_bytes(100_000))
    flip_byte_in_member(bad, "f.bin")
    clean = tmp_path / "clean"
    res = run_cli("extract", str(bad), "f.bin", "-C", str(clean))
    assert res.returncode != 0
    assert [p.name for p in clean.iterdir()] == []


def test_cli_ls_shows_a_dangling_symlink(tmp_path: Path) -> None:
    z = tmp_path / "links.zip"
    with zipfile.ZipFile(z, "w") as zf:
        link = zipfile.ZipInfo("dog/broken.png")
        link.external_attr = (0o120777 << 16) | 0x20
        link.create_system = 3
        zf.writestr(link, "missing.png")
    res = run_cli("ls", "-l", str(z), "dog/broken.png", check=True)
    assert "dog/broken.png -> missing.png" in res.stdout.decode()


def _links_zip(path: Path, links: dict[str, str], files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, target in links.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o120777 << 16) | 0x20
            info.create_system = 3
            zf.writestr(info, target)
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def test_api_behaves_like_python_files_and_zipfile(archive: Path, tmp_path: Path, monkeypatch) -> None:
    """Path-like locations, negative offsets, buffering, closed files and archives, misspelt options."""
    files = sample_files()
    with cdmlfs.open(archive) as ar:  # a pathlib.Path, as zipfile and tarfile take
        assert ar.read("readme.txt") == files["readme.txt"]
        with pytest.raises(ValueError, match="negative offset"):
            ar.read("readme.txt", -5, 3)  # was the member's tail (Python slicing) or a tar header
        with ar.open("readme.txt", buffering=0) as raw:  # 0: the raw file, as open() gives
            assert raw.read(4) == files["readme.txt"][:4]
        with ar.open("readme.txt", buffering=-1) as f:
            assert f.read() == files["readme.txt"]
        f = ar.open("readme.txt", buffering=0)
        f.close()
        with pytest.raises(ValueError):
            f.tell()
        kept = ar.open("data/random.bin")
    with pytest.raises(ValueError, match="closed archive"):
        ar.read("readme.txt")
    with pytest.raises(ValueError, match="closed archive"):
        kept.read(10)  # its descriptor number may belong to another file by now
    for query in (ar.files, ar.archive_order, lambda: next(ar.walk())):
        with pytest.raises(ValueError, match="closed archive"):
            query()  # listings had answered from the index after close
    with pytest.raises(TypeError, match="cache_sise"):
        cdmlfs.open(str(archive), cache_sise=1 << 20)
    # A relative location pickles as an absolute one: the worker may start elsewhere.
    monkeypatch.chdir(archive.parent)
    with cdmlfs.open(archive.name) as ar:
        blob = pickle.dumps(ar)
    monkeypatch.chdir(tmp_path.parent)
    with pickle.loads(blob) as again:
        assert again.read("one_byte") == b"x"


def test_symlink_loops_through_parents_and_walk_like_os_walk(tmp_path: Path) -> None:
    z = _links_zip(tmp_path / "links.zip", {"a": "b/x", "b": "a/y", "d/dlink": "sub"}, {"d/sub/f.txt": b"f"})
    with cdmlfs.open(str(z)) as ar:
        with pytest.raises(LinkLoopError, match="too many levels"):
            ar.stat("a/q")  # a RecursionError before
        assert not ar.exists("a/q") and not ar.isdir("a")
        walked = {d: (ds, fs) for d, ds, fs in ar.walk("d")}
        assert walked == {"d": (["dlink", "sub"], []), "d/sub": ([], ["f.txt"])}  # the link: not followed
        assert [d for d, _, _ in ar.walk("d/dlink")] == ["d/dlink"]


def test_extract_keeps_the_mtime_of_small_files(tmp_path: Path) -> None:
    """The last bytes of a file were flushed after its mtime was set, which moved it to now."""
    z = tmp_path / "t.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for name, size in (("small.txt", 120), ("tail.bin", (4 << 20) + 100)):
            info = zipfile.ZipInfo(name, date_time=(2001, 2, 3, 4, 5, 6))
            zf.writestr(info, b"s" * size)
    with cdmlfs.open(str(z)) as ar:
        want = ar.stat("small.txt").mtime
        for name in ("small.txt", "tail.bin"):
            out = ar.extract(name, str(tmp_path / "x"))
            assert os.stat(out).st_mtime == want, name


def test_raw_member_file_behaves_like_fileio(tmp_path: Path) -> None:
    """readinto counts bytes whatever the buffer's item type; closed files refuse; write is
    UnsupportedOperation; seek wants an integer; open(path, "rb") works as ZipFile.open does."""
    from array import array

    data = bytes(range(256)) * 64
    z = python_zip(tmp_path / "r.zip", {"blob.bin": data}, zipfile.ZIP_STORED)
    with cdmlfs.open(str(z)) as ar:
        raw = ar.open("blob.bin", buffering=0)
        ints = array("i", [0, 0])
        assert raw.readinto(ints) == 8 and ints.tobytes() == data[:8]
        with pytest.raises(TypeError, match="read-write"):  # as FileIO says it (BufferError before)
            raw.readinto(b"12345678")
        assert raw.tell() == 8
        assert raw.mode == "rb" and raw.seek(0) == 0
        with pytest.raises(io.UnsupportedOperation):
            raw.write(b"x")
        with pytest.raises(TypeError):
            raw.seek(1.5)
        with pytest.raises(io.UnsupportedOperation):
            raw.fileno()
        with pytest.raises(TypeError):  # as FileIO (BufferError before)
            raw.readinto(memoryview(bytearray(10))[::2])
        raw.close()
        closed = (raw.read, raw.readall, lambda: raw.seek(0), raw.readable, raw.seekable, raw.writable)
        closed += (lambda: raw.write(b"x"), raw.truncate, raw.fileno)  # ValueError first, as FileIO
        for call in closed:
            with pytest.raises(ValueError):
                call()
        with ar.open("blob.bin", "rb") as f:
            assert f.read() == data
        with pytest.raises(ValueError, match="read-only"):
            ar.open("blob.bin", "w")


def test_walk_honours_pruned_dirs_like_os_walk(archive: Path) -> None:
    with cdmlfs.open(str(archive)) as ar:
        every = [d for d, _, _ in ar.walk()]
        visited = []
        for top, dirs, _ in ar.walk():
            visited.append(top)
            dirs[:] = []  # os.walk then stops here
        assert len(every) > 1 and visited == [""]


def test_location_through_a_symlink_and_dotdot_is_the_file_open_would_read(tmp_path: Path) -> None:
    real = tmp_path / "real" / "sub"
    real.mkdir(parents=True)
    python_zip(tmp_path / "real" / "a.zip", {"which": b"real/a.zip"})
    python_zip(tmp_path / "a.zip", {"which": b"a.zip"})
    (tmp_path / "link").symlink_to(real)
    with cdmlfs.open(str(tmp_path / "link" / ".." / "a.zip")) as ar:  # the kernel: real/a.zip
        assert ar.read("which") == b"real/a.zip"
    with pytest.raises(UsageError, match="Not a directory"):  # open("a.zip/") fails; it read a.zip
        cdmlfs.open(f"{tmp_path / 'a.zip'}/")
    assert run_cli("ls", f"{tmp_path / 'a.zip'}/").returncode != 0


def test_extracted_directories_keep_their_mode_and_mtime(tmp_path: Path) -> None:
    z = tmp_path / "d.zip"
    with zipfile.ZipFile(z, "w") as zf:
        info = zipfile.ZipInfo("d/", date_time=(2001, 2, 3, 4, 5, 6))
        info.external_attr = (0o40700 << 16) | 0x10
        info.create_system = 3
        zf.writestr(info, b"")
        zf.writestr(zipfile.ZipInfo("d/f.txt", date_time=(2002, 1, 1, 0, 0, 0)), b"f")
    with cdmlfs.open(str(z)) as ar:
        ar.extract("d", str(tmp_path / "out"))
        st = ar.stat("d")
    got = os.stat(tmp_path / "out" / "d")
    assert got.st_mode & 0o777 == 0o700 and abs(got.st_mtime - st.mtime) < 1
    assert (tmp_path / "out" / "d" / "f.txt").read_bytes() == b"f"


def test_member_paths_may_be_pure_paths_or_bytes(archive: Path) -> None:
    from pathlib import PurePosixPath

    with cdmlfs.open(str(archive)) as ar:
        name = ar.files()[0]
        data = ar.read(name)
        assert ar.read(PurePosixPath(name)) == data == ar.read(name.encode())
        assert ar.exists(PurePosixPath(name)) and ar.stat(name.encode()).size == len(data)
        assert list(ar.walk(PurePosixPath("."))) == list(ar.walk("")) == list(ar.walk(b""))


def test_reads_leave_the_index_columns_as_built(tmp_path: Path) -> None:
    """Threads and the C hot path read the index without locks, so nothing may rewrite it: a ZIP
    data offset used to replace its local-header offset in place, and a thread that had seen "needs
    its local header" could take the data offset for a header (a spurious EIO on a good member)."""
    files = {f"d/f{i:03d}.txt": text_bytes(500 + 37 * i, i) for i in range(200)}
    path = tmp_path / "a.zip"
    python_zip(path, files, compression=zipfile.ZIP_DEFLATED)
    with cdmlfs.open(str(path)) as ar:
        ix = ar.index
        before = (bytes(ix.offset), bytes(ix.flags), ar.archive_order())

        def read_all(seed: int) -> None:
            names = list(files)
            random.Random(seed).shuffle(names)
            for name in names:
                assert ar.read(name) == files[name]

        errors = run_in_threads(read_all, [(s,) for s in range(8)])
        assert not errors, errors[0]
        assert (bytes(ix.offset), bytes(ix.flags), ar.archive_order()) == before


def test_cli_extract_of_named_paths_goes_on_past_a_bad_one(tmp_path: Path) -> None:
    """A missing or corrupt member named on the command line stopped every path after it."""
    files = {"bad.txt": text_bytes(5000, 1), "ok.txt": text_bytes(4000, 2)}
    z = python_zip(tmp_path / "c.zip", files, zipfile.ZIP_DEFLATED)
    flip_byte_in_member(z, "bad.txt")
    out = tmp_path / "out"
    res = run_cli("extract", str(z), "nope", "bad.txt", "ok.txt", "-C", str(out))
    err = res.stderr.decode()
    assert res.returncode == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines[0] == "cdmlfs: nope: no such file or directory in the archive", err  # named once
    assert lines[1].startswith("cdmlfs: bad.txt: "), err
    assert lines[2] == "cdmlfs: 2 entries not extracted", err
    assert (out / "ok.txt").read_bytes() == files["ok.txt"] and not (out / "bad.txt").exists()
    # A destination folder that is a link to elsewhere refuses its entries only (it stopped the run,
    # exit 2); so does a path through a file.
    z2 = python_zip(tmp_path / "d.zip", {"sub/a.txt": b"a", "top.txt": b"t"})
    out2 = tmp_path / "out2"
    (out2).mkdir()
    (tmp_path / "elsewhere").mkdir()
    (out2 / "sub").symlink_to(tmp_path / "elsewhere")
    res = run_cli("extract", str(z2), "sub/a.txt", "top.txt/x", "top.txt", "-C", str(out2))
    err = res.stderr.decode()
    assert res.returncode == 1 and "Traceback" not in err, err
    assert "sub/a.txt" in err and "outside" in err and "top.txt/x: not a directory" in err, err
    assert err.strip().splitlines()[-1] == "cdmlfs: 2 entries not extracted", err
    assert (out2 / "top.txt").read_bytes() == b"t" and list((tmp_path / "elsewhere").iterdir()) == []


def test_cli_cat_goes_on_past_a_bad_path_as_cat_does(tmp_path: Path) -> None:
    """`cdmlfs cat A MISSING B` stopped at the missing path: B was never written."""
    files = {"a.txt": b"A" * 3000, "bad.txt": text_bytes(5000, 1), "b.txt": b"B" * 2000, "d/x": b"x"}
    z = python_zip(tmp_path / "c.zip", files, zipfile.ZIP_DEFLATED)
    flip_byte_in_member(z, "bad.txt")
    res = run_cli("cat", str(z), "a.txt", "nope", "d", "bad.txt", "b.txt")
    err = res.stderr.decode()
    assert res.returncode == 1 and "Traceback" not in err, err
    assert res.stdout == files["a.txt"] + files["b.txt"]
    assert err.splitlines()[0] == "cdmlfs: nope: no such file or directory in the archive", err
    assert "cdmlfs: d: is a directory" in err and "bad.txt" in err and len(err.splitlines()) == 3, err
    assert run_cli("cat", str(z), "a.txt", "b.txt").returncode == 0


def test_cli_extract_listing_into_a_closed_pipe_still_extracts_everything(tmp_path: Path) -> None:
    """`extract -v ... | head -1` stopped extracting at the broken pipe, and exited 0."""
    import subprocess
    import sys

    names = [f"d/f{i:05d}.txt" for i in range(3000)]
    z = python_zip(tmp_path / "many.zip", {n: n.encode() for n in names})
    out = tmp_path / "out"
    with subprocess.Popen(
        [sys.executable, "-m", "cdmlfs", "extract", "-v", str(z), *names, "-C", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None and proc.stdout.readline()  # `head -1`
        proc.stdout.close()
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "Exception" not in err, err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.txt")) == names


def test_cli_extract_verbose_lists_every_entry_written(tmp_path: Path) -> None:
    """`extract -v` printed only the paths named on the command line, not the folder's entries."""
    z = python_zip(tmp_path / "d.zip", {"d/a.txt": b"a", "d/sub/b.txt": b"b", "top.txt": b"t"})
    out = tmp_path / "out"
    res = run_cli("extract", "-v", str(z), "d", "top.txt", "-C", str(out), check=True)
    listed = {os.path.relpath(line, out) for line in res.stdout.decode().splitlines()}
    assert listed == {"d", "d/a.txt", "d/sub", "d/sub/b.txt", "top.txt"}, res.stdout


def test_a_directory_given_as_the_archive_says_how_to_make_one(tmp_path: Path) -> None:
    (tmp_path / "photos").mkdir()
    (tmp_path / "mnt").mkdir()
    for command in ("ls", "mount"):
        args = [command, str(tmp_path / "photos")] + ([str(tmp_path / "mnt")] if command == "mount" else [])
        res = run_cli(*args)
        err = res.stderr.decode()
        assert res.returncode == 2 and err.count("\n") == 1, err
        assert "is a directory, not an archive" in err and "cdmlfs pack" in err, err


def test_cli_sigterm_during_extract_leaves_no_partial_file(tmp_path: Path) -> None:
    """pack removed its partial output on SIGTERM; extract left hundreds of MiB of .partial behind."""
    import signal
    import subprocess
    import sys

    z = tmp_path / "zeros.zip"
    with (
        zipfile.ZipFile(z, "w", zipfile.ZIP_DEFLATED) as zf,
        zf.open("zeros.bin", "w", force_zip64=True) as f,
    ):
        block = bytes(1 << 20)
        for _ in range(1536):
            f.write(block)
    out = tmp_path / "out"
    out.mkdir()
    with subprocess.Popen(
        [sys.executable, "-m", "cdmlfs", "extract", str(z), "zeros.bin", "-C", str(out)],
        stderr=subprocess.PIPE,
    ) as proc:
        deadline = time.monotonic() + 60
        while not list(out.glob(".cdmlfs-*.partial")) and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, 128 + signal.SIGTERM)
        err = proc.stderr.read().decode() if proc.stderr else ""
    assert "Traceback" not in err, err
    assert not list(out.glob(".cdmlfs-*")), list(out.iterdir())
    if proc.returncode == 0:  # it finished first: then the whole file is there
        assert (out / "zeros.bin").stat().st_size == 1536 << 20


def test_cli_prints_names_that_are_not_utf8_and_survives_closed_streams(tmp_path: Path) -> None:
    """A name of other bytes made `ls` die with UnicodeEncodeError under a strict UTF-8 stdout;
    `>&-` made ls, cat and mount end in AttributeError tracebacks."""
    import subprocess
    import sys
    import tarfile

    tar = tmp_path / "bytes.tar"
    with tarfile.open(tar, "w", format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape") as tf:
        info = tarfile.TarInfo(os.fsdecode(b"caf\xe9.txt"))
        info.size = 3
        tf.addfile(info, io.BytesIO(b"abc"))
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    idx = str(tmp_path / "idx")
    res = run_cli("ls", str(tar), "--index-dir", idx, env=env)
    assert res.returncode == 0 and res.stdout == b"caf\xe9.txt\n", res.stderr.decode()
    for args in (["ls", str(tar)], ["cat", str(tar), os.fsdecode(b"caf\xe9.txt")]):
        res = subprocess.run(
            ["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "cdmlfs", *args, "--index-dir", idx],
            capture_output=False,
            stderr=subprocess.PIPE,
            timeout=120,
        )
        assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr.decode()


def test_cli_rejects_huge_sizes_and_mfusepy_arguments_as_options_in_one_line(tmp_path: Path) -> None:
    z = python_zip(tmp_path / "a.zip", {"a.txt": b"a"})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for args in (
        ["--cache-size", "9" * 400],
        ["--cache-size", "16E"],
        ["--readahead", "9" * 400 + "K"],
        ["-o", "raw_fi"],
        ["-o", "errors=strict"],
        ["-o", "foreground"],
        ["-o", "encoding=latin1"],
    ):
        res = run_cli("mount", str(z), str(mnt), *args)
        err = res.stderr.decode()
        assert res.returncode == 2 and len(err.strip().splitlines()) == 1, (args, err)
        assert not os.path.ismount(mnt)
    from cdmlfs.sizes import parse_size

    assert parse_size("1.5G") == 3 << 29 and parse_size("8191P") == 8191 << 50
    with pytest.raises(ValueError):
        parse_size("8192P")


def test_cli_takes_verbose_before_the_command(archive: Path) -> None:
    res = run_cli("-v", "ls", str(archive))
    assert res.returncode == 0 and "readme.txt" in res.stdout.decode(), res.stderr.decode()


def test_threads_sharing_an_unbuffered_member_file_get_each_byte_once(tmp_path: Path) -> None:
    """The position was read, the read ran (GIL released), and only then advanced: threads sharing
    one file got some bytes twice, where FileIO (the kernel's position lock) gives each once."""
    from concurrent.futures import ThreadPoolExecutor

    data = random.Random(5).randbytes(1_100_000)
    z = python_zip(tmp_path / "s.zip", {"f.bin": data}, zipfile.ZIP_STORED)
    with cdmlfs.open(str(z), cache_size=1 << 20) as ar, ar.open("f.bin", buffering=0) as f:

        def drain() -> list[bytes]:
            got = []
            while chunk := f.read(777):
                got.append(chunk)
            return got

        with ThreadPoolExecutor(4) as pool:
            chunks = [c for part in pool.map(lambda _: drain(), range(4)) for c in part]
        assert sum(map(len, chunks)) == len(data)
        f.seek(0)
        assert f.read(None) == data  # as FileIO.read(None)


def test_archive_order_lists_hard_link_names_too(tmp_path: Path) -> None:
    """A dataset made from archive_order() silently lost the samples whose names were tar hard links."""
    import tarfile

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"a")
    (src / "b.txt").write_bytes(b"b")
    os.link(src / "b.txt", src / "c.txt")
    with tarfile.open(tmp_path / "t.tar", "w") as tf:
        for name in ("a.txt", "b.txt", "c.txt"):
            tf.add(src / name, arcname=name)
    with cdmlfs.open(str(tmp_path / "t.tar"), index_dir=str(tmp_path / "idx")) as ar:
        assert ar.archive_order() == ["a.txt", "b.txt", "c.txt"]
        assert sorted(ar.archive_order()) == sorted(ar.files())


@pytest.mark.parametrize("kind", ["tar", "stored zip"])
def test_close_under_reads_never_lends_them_another_files_bytes(tmp_path: Path, kind: str) -> None:
    """close() freed the descriptor number while other threads were reading: the next open() in
    the process got it, and a read in flight returned that file's bytes (zeros here) as the
    member's, with no error (round 2-8 of this loop). Reads that race close() now fail as reads
    after it do (ValueError), never as damage, and never with other bytes."""
    import tarfile
    import threading

    rng = random.Random(5)
    files = {f"m{i:02d}.bin": rng.randbytes(rng.randrange(8 << 10, 64 << 10)) for i in range(40)}
    if kind == "tar":
        path = tmp_path / "a.tar"
        with tarfile.open(path, "w") as tf:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    else:
        path = python_zip(tmp_path / "a.zip", files, compression=zipfile.ZIP_STORED)
    decoy = tmp_path / "zeros.bin"  # stands for any file the program opens after close()
    with open(decoy, "wb") as f:
        f.truncate(64 << 20)
    names = sorted(files)
    wrong: list[tuple[str, int]] = []
    errors: list[BaseException] = []

    def reader(ar: cdmlfs.Archive, stop: threading.Event, seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            name = r.choice(names)
            at = r.randrange(len(files[name]) - 64)
            try:
                got = ar.read(name, offset=at, size=64)
            except Exception as exc:  # sorted below
                errors.append(exc)
                return
            if got != files[name][at : at + 64]:
                wrong.append((name, at))

    for rnd in range(60):
        ar = cdmlfs.open(str(path), cache_size="16M")
        stop = threading.Event()
        threads = [threading.Thread(target=reader, args=(ar, stop, rnd * 10 + i)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.002)
        ar.close()
        fds = [os.open(decoy, os.O_RDONLY) for _ in range(4)]  # take whatever number close() freed
        stop.set()
        for t in threads:
            t.join()
        for fd in fds:
            os.close(fd)
        assert not wrong, (rnd, wrong[:3])
    assert errors and all(isinstance(e, ValueError) for e in errors), {repr(e) for e in errors}


def test_extract_keeps_hard_links_to_symlinks_and_replaces_a_file_in_a_folders_way(tmp_path: Path) -> None:
    """As `tar -x`: a hard link to a symlink came out as a second, unrelated symlink (nlink 1), and a
    file (or a dangling link) where the archive has a folder stopped that folder's extraction."""
    import subprocess

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "t").write_bytes(b"T\n")
    (src / "sub" / "f").write_bytes(b"F\n")
    os.symlink("t", src / "s")
    os.link(src / "s", src / "h", follow_symlinks=False)
    tar = tmp_path / "a.tar"
    subprocess.run(["tar", "-cf", str(tar), "-C", str(src), "."], check=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "sub").write_bytes(b"in the way")
    os.symlink("nowhere", out / "gone")
    run_cli("extract", str(tar), ".", "-C", str(out), check=True)
    s, h = os.lstat(out / "s"), os.lstat(out / "h")
    assert os.readlink(out / "h") == "t" and s.st_ino == h.st_ino and s.st_nlink == 2
    assert (out / "sub" / "f").read_bytes() == b"F\n"
    with zipfile.ZipFile(tmp_path / "d.zip", "w") as zf:
        zf.writestr("gone/x", b"X")
    run_cli("extract", str(tmp_path / "d.zip"), "gone", "-C", str(out), check=True)
    assert (out / "gone" / "x").read_bytes() == b"X" and not (out / "gone").is_symlink()


def test_extract_links_long_names_and_replaces_empty_folders_as_tar_does(tmp_path: Path) -> None:
    """A hard link whose name was over ~236 bytes came out as an unrelated copy (the temporary name
    beside it went over NAME_MAX), and an empty folder where a file or symlink goes stopped that
    entry ("Is a directory") where `tar -x` replaces it."""
    import subprocess

    src = tmp_path / "src"
    src.mkdir()
    long = "h" * 240
    (src / "a").write_bytes(b"data\n")
    os.link(src / "a", src / long)
    (src / "f").write_bytes(b"F\n")
    os.symlink("f", src / "s")
    tar = tmp_path / "a.tar"
    subprocess.run(["tar", "-cf", str(tar), "-C", str(src), "a", long, "f", "s"], check=True)
    out = tmp_path / "out"
    for name in ("a", long, "f", "s"):
        (out / name).mkdir(parents=True)
    (out / "f" / "keep").write_bytes(b"")  # not empty: stays, and that entry fails
    res = run_cli("extract", str(tar), ".", "-C", str(out))
    lines = res.stderr.decode().splitlines()
    assert res.returncode == 1 and len(lines) == 2 and lines[0].startswith("cdmlfs: f: Is a directory"), lines
    a, h = os.lstat(out / "a"), os.lstat(out / long)
    assert a.st_ino == h.st_ino and a.st_nlink == 2 and (out / long).read_bytes() == b"data\n"
    assert os.readlink(out / "s") == "f" and (out / "f" / "keep").exists()
    assert not [p for p in os.listdir(out) if p.startswith(".cdmlfs")]


def test_cli_options_may_come_between_positionals(tmp_path: Path) -> None:
    """`ls data.zip -l sub` and `extract data.zip a -C out b` (as ls and tar take them) were refused
    with 'unrecognized arguments'; an option that is unknown still is, by the subcommand's parser."""
    z = python_zip(tmp_path / "t.zip", {"a.txt": b"A\n", "sub/b.txt": b"B\n"})
    res = run_cli("ls", str(z), "-l", "sub", check=True)
    assert "b.txt" in res.stdout.decode() and res.stdout.decode().startswith("-r")
    assert run_cli("ls", str(z), "-R", "sub", check=True).stdout.decode().split() == ["sub/b.txt"]
    out = tmp_path / "out"
    run_cli("extract", str(z), "a.txt", "-C", str(out), "sub/b.txt", check=True)
    assert (out / "a.txt").read_bytes() == b"A\n" and (out / "sub" / "b.txt").read_bytes() == b"B\n"
    res = run_cli("ls", str(z), "sub", "--bogus")
    err = res.stderr.decode()
    assert res.returncode == 2 and "unrecognized arguments: --bogus" in err and "cdmlfs ls --help" in err


def test_cli_extract_listing_to_a_full_stdout_blames_stdout(tmp_path: Path) -> None:
    """A -v listing that could not be written (stdout on a full disk) was reported as the
    destination directory's lack of room."""
    z = python_zip(tmp_path / "t.zip", {"a.txt": b"A\n"})
    import subprocess

    from mountutil import CDMLFS

    with open("/dev/full", "w") as full:
        args = [*CDMLFS, "extract", "-v", str(z), "a.txt", "-C", str(tmp_path / "out")]
        res = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, timeout=60)
    last = res.stderr.decode().strip().splitlines()[-1]
    assert res.returncode == 1 and "standard output" in last and str(tmp_path / "out") not in last, last


def test_reads_of_an_archive_written_in_place_fail(tmp_path: Path) -> None:
    """The API's reads check the file as the mount's do: after an in-place write of other bytes
    (here in a packed tar.zst: a frame read again from the changed file), every read fails with
    SourceChangedError rather than mix bytes; reopening reads the new file. A touch (the same
    bytes) is let be."""
    from cdmlfs.errors import SourceChangedError
    from cdmlfs.pack import pack

    (tmp_path / "d").mkdir()
    data = {f"f{i}.txt": text_bytes(200_000, i) for i in range(4)}
    for name, blob in data.items():
        (tmp_path / "d" / name).write_bytes(blob)
    packed = tmp_path / "t.tar.zst"
    pack(str(tmp_path / "d"), str(packed), frame_size=256 << 10)
    with cdmlfs.open(str(packed)) as ar:
        assert ar.read("f0.txt") == data["f0.txt"]
        os.utime(packed, (time.time() + 5,) * 2)  # a touch: the same bytes
        assert ar.read("f1.txt") == data["f1.txt"]
        with open(packed, "r+b") as f:  # other bytes (a frame's checksum would not catch them all)
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 1]))
        os.utime(packed, (time.time() + 10,) * 2)
        for name in ("f0.txt", "f3.txt"):
            with pytest.raises(SourceChangedError, match="written to after it was opened"):
                ar.read(name)
    with cdmlfs.open(str(packed)) as ar:
        assert ar.read("f3.txt") == data["f3.txt"]


FORK_WHILE_READING = r"""
import os, signal, sys, threading, time
import cdmlfs

ar = cdmlfs.open(sys.argv[1])
f = ar.open("big.bin", buffering=0)

def spin():
    buf = bytearray(1 << 20)
    while True:
        f.seek(0)
        while f.readinto(buf):
            pass

threading.Thread(target=spin, daemon=True).start()
time.sleep(0.2)
hung = 0
for _ in range(10):
    pid = os.fork()
    if pid == 0:
        signal.alarm(5)  # hung on the position lock: killed by SIGALRM
        f.seek(100)
        os._exit(0 if len(f.read(50)) == 50 else 3)
    _, status = os.waitpid(pid, 0)
    hung += status != 0
print(hung)
"""


def test_a_raw_member_file_reads_in_a_child_forked_while_a_thread_read_it(tmp_path: Path) -> None:
    """A raw MemberFile's position lock, held by a parent thread in readinto at the fork, stayed
    held in the child: its first read there hung for good (20 forks out of 20 on a stored member)."""
    import subprocess
    import sys

    z = python_zip(tmp_path / "f.zip", {"big.bin": os.urandom(6 << 20)}, zipfile.ZIP_STORED)
    res = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", FORK_WHILE_READING, str(z)], capture_output=True, timeout=120
    )
    assert res.returncode == 0 and res.stdout.split() == [b"0"], (res.stdout, res.stderr[-2000:])


def test_every_error_class_the_api_raises_is_exported() -> None:
    """LinkLoopError (a symlink loop in a path given to the API) could not be caught by name
    from ``cdmlfs``: every CdmlfsError subclass in cdmlfs.errors is exported there."""
    import inspect

    from cdmlfs import errors

    defined = {n for n, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.CdmlfsError)}
    assert defined <= set(cdmlfs.__all__), defined - set(cdmlfs.__all__)
    assert all(getattr(cdmlfs, n) is getattr(errors, n) for n in defined)
