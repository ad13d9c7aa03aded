"""ArchiveImageFolder against torchvision's ImageFolder on the extracted tree and on a real mount."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
np = pytest.importorskip("numpy")
from mountutil import mounted, unzip  # noqa: E402
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision import transforms  # noqa: E402
from torchvision.datasets import ImageFolder  # noqa: E402

import cdmlfs_torch  # noqa: E402
from cdmlfs_torch import (  # noqa: E402
    ArchiveDatasetFolder,
    ArchiveImageFolder,
    ArchiveOrderSampler,
    default_loader,
    handles,
    pil_loader,
    read_sample,
    split_sample_path,
    tensor_loader,
)
from cdmlfs_torch.roots import ArchiveTree  # noqa: E402

H, W = 12, 16


def _image(path: Path, seed: int, mode: str = "RGB", fmt: str | None = None) -> None:
    rng = np.random.default_rng(seed)
    shape = (H, W, 3) if mode == "RGB" else (H, W)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(path, fmt)


def make_tree(root: Path) -> Path:
    """A class tree with the orderings, extensions and links that trip up re-implementations."""
    files = {
        "cat/b.jpg": "RGB",
        "cat/A.JPG": "RGB",  # upper case extension, sorts before lower case
        "cat/sub/x.png": "L",  # grayscale, converted to RGB
        "cat/sub-dir/y.jpeg": "RGB",  # "sub-dir" < "sub/..." as strings: torchvision sorts walk roots
        "cat/sub/deeper/z.bmp": "RGB",
        "dog/ü-名.webp": "RGB",
        "dog/1.tif": "RGB",
        "dog/notes.txt": None,  # not an image
        "dog/.hidden.png": "RGB",
        "Zebra/p.ppm": "RGB",  # capital letters sort first
        "bird/nested/only.pgm": "L",
    }
    seed = 0
    for rel, mode in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if mode is None:
            p.write_text("not an image")
        else:
            _image(p, seed, mode)
            seed += 1
    (root / "readme.txt").write_text("a file at the top is not a class")
    os.symlink("../cat/b.jpg", root / "dog/link_to_cat.jpg")  # file symlink inside the tree
    os.symlink("sub", root / "cat/zlink")  # directory symlink: os.walk(followlinks=True) enters it
    return root


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("folder")
    make_tree(base / "src" / "train")
    (base / "src" / "val").mkdir()
    zip_path = base / "data.zip"
    subprocess.run(["zip", "-q", "-r", "-y", str(zip_path), "."], cwd=base / "src", check=True)
    extracted = unzip(zip_path, base / "extracted")
    return {"zip": zip_path, "extracted": extracted / "train", "base": base}


def relpaths(ds, root: str) -> list[tuple[str, int]]:
    return [(os.path.relpath(p, root), t) for p, t in ds.samples]


def assert_same_dataset(ours, theirs, theirs_root: str) -> None:
    assert ours.classes == theirs.classes
    assert ours.class_to_idx == theirs.class_to_idx
    assert [(ours.tree.relpath(p), t) for p, t in ours.samples] == relpaths(theirs, theirs_root)
    assert ours.targets == theirs.targets
    assert ours.imgs is ours.samples
    assert len(ours) == len(theirs)


def test_a_local_folder_named_after_an_open_archive_is_read_from_disk(tmp_path: Path) -> None:
    """With x.zip open in the process, a real folder "x.zip::copy" beside it was read from x.zip."""
    for cls in ("a", "b"):
        (tmp_path / "src" / cls).mkdir(parents=True)
        _image(tmp_path / "src" / cls / "x.png", 5)
    archive = shutil.make_archive(str(tmp_path / "x"), "zip", tmp_path / "src")
    ArchiveImageFolder(archive)  # opens x.zip here
    local = Path(f"{archive}::copy")
    shutil.copytree(tmp_path / "src", local)
    (local / "a" / "only-here.png").write_bytes((local / "a" / "x.png").read_bytes())
    ds = ArchiveImageFolder(str(local))
    assert [Path(p).name for p, _ in ds.samples] == ["only-here.png", "x.png", "x.png"]
    assert all(split_sample_path(p) is None for p, _ in ds.samples)
    assert ds[0][1] == 0 and read_sample(ds.samples[0][0]) == (local / "a" / "only-here.png").read_bytes()
    handles.close_all()


@pytest.mark.parametrize("form", ["sep", "shorthand"])
def test_same_samples_as_torchvision(trees: dict[str, Path], form: str) -> None:
    root = f"{trees['zip']}::train" if form == "sep" else f"{trees['zip']}/train"
    theirs = ImageFolder(str(trees["extracted"]))
    ours = ArchiveImageFolder(root)
    assert_same_dataset(ours, theirs, str(trees["extracted"]))
    # Sample paths name the archive and the member; they read back anywhere.
    path = ours.samples[0][0]
    assert path == f"{trees['zip']}::train/{ours.tree.relpath(path)}"
    assert split_sample_path(path) == (str(trees["zip"]), f"train/{ours.tree.relpath(path)}")
    assert read_sample(path) == (trees["extracted"] / ours.tree.relpath(path)).read_bytes()
    # The symlinked directory and file are seen, as os.walk(followlinks=True) sees them.
    rels = {ours.tree.relpath(p) for p, _ in ours.samples}
    assert {"cat/zlink/x.png", "dog/link_to_cat.jpg", "dog/.hidden.png"} <= rels


@pytest.mark.parametrize("kind", ["tar", "tar.zst"])
def test_tar_formats_give_the_same_dataset(trees: dict[str, Path], kind: str) -> None:
    """The core reads tar and tar.zst behind the same API: same samples, same pixels, archive order."""
    if kind == "tar.zst" and not shutil.which("zstd"):
        pytest.skip("zstd is not installed")
    path = trees["base"] / f"data.{kind}"
    if not path.exists():
        flags = ["--zstd"] if kind == "tar.zst" else []
        subprocess.run(["tar", *flags, "-cf", str(path), "."], cwd=trees["base"] / "src", check=True)
    ours = ArchiveImageFolder(f"{path}::train", transform=transforms.ToTensor())
    theirs = ImageFolder(str(trees["extracted"]), transform=transforms.ToTensor())
    assert_same_dataset(ours, theirs, str(trees["extracted"]))
    for (xa, ya), (xb, yb) in zip(DataLoader(ours, 4, num_workers=2), DataLoader(theirs, 4), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    listed = subprocess.run(["tar", "-tf", str(path)], capture_output=True, text=True, check=True).stdout
    member_order = {name.removeprefix("./"): i for i, name in enumerate(listed.split("\n"))}
    archive = handles.get_archive(str(path))
    data_member = [archive.stat(p.partition("::")[2]).path for p, _ in ours.samples]  # symlinks resolved
    visits = [member_order[data_member[i]] for i in ArchiveOrderSampler(ours, shuffle=False)]
    assert visits == sorted(visits)  # one forward pass through the tar


def test_s3_archive_with_fork_and_spawn_workers(
    trees: dict[str, Path], request: pytest.FixtureRequest
) -> None:
    """s3:// roots pass through to cdmlfs.open; every worker opens its own S3 source."""
    pytest.importorskip("boto3")
    pytest.importorskip("localbucket")
    import s3util

    with s3util.dummy_credentials():
        endpoint = s3util.start_localbucket(trees["base"] / "bucket-root")
        try:
            endpoint.put("data", "sets/data.zip", trees["zip"])
            opts = {"endpoint_url": endpoint.url}
            ours = ArchiveImageFolder(
                "s3://data/sets/data.zip::train", transform=transforms.ToTensor(), open_options=opts
            )
            theirs = ImageFolder(str(trees["extracted"]), transform=transforms.ToTensor())
            assert_same_dataset(ours, theirs, str(trees["extracted"]))
            assert ours.samples[0][0].startswith("s3://data/sets/data.zip::train/")
            want = list(DataLoader(theirs, 5))
            for context in ("fork", "spawn"):
                got = DataLoader(ours, 5, num_workers=2, multiprocessing_context=context)
                for (xa, ya), (xb, yb) in zip(got, want, strict=True):
                    assert torch.equal(xa, xb) and torch.equal(ya, yb)
        finally:
            handles.close_all()
            endpoint.stop()


def test_decoded_images_equal_torchvision(trees: dict[str, Path]) -> None:
    theirs = ImageFolder(str(trees["extracted"]))
    ours = ArchiveImageFolder(f"{trees['zip']}::train")
    for i in range(len(ours)):
        a, ta = ours[i]
        b, tb = theirs[i]
        assert ta == tb and a.mode == b.mode == "RGB"
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_tensor_loader_equals_torchvision_io(trees: dict[str, Path]) -> None:
    """torchvision.io's decoder where it reads the format (JPEG, PNG, WebP), PIL's pixels elsewhere."""
    from torchvision.io import ImageReadMode, decode_image

    ours = ArchiveImageFolder(f"{trees['zip']}::train", loader=tensor_loader)
    theirs = ImageFolder(str(trees["extracted"]))
    kinds = set()
    for i in range(len(ours)):
        x, target = ours[i]
        local = theirs.samples[i][0]
        assert target == theirs.targets[i] and x.dtype == torch.uint8 and x.shape[0] == 3
        if Path(local).suffix.lower() in (".jpg", ".jpeg", ".png", ".webp"):
            expected = decode_image(local, mode=ImageReadMode.RGB)
            kinds.add("torchvision")
        else:
            expected = torch.from_numpy(np.array(theirs[i][0])).permute(2, 0, 1)
            kinds.add("pil")
        assert torch.equal(x, expected), local
    assert kinds == {"torchvision", "pil"}


def _png16_rgb(width: int, height: int, values: np.ndarray) -> bytes:
    """A 16-bit-per-channel RGB PNG (PIL cannot write one): IHDR, one IDAT, IEND."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"".join(b"\0" + values[y].astype(">u2").tobytes() for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    body = chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def test_tensor_loader_gives_the_default_loaders_pixels_for_16_bit_pngs(tmp_path: Path) -> None:
    """decode_image keeps 16 bits (uint16, which default_collate cannot stack with uint8 images); the
    high byte it was cut to differed from PIL's convert("RGB") (it clips grey levels at 255) by up
    to 253: switching loaders changed the training data."""
    grey = np.arange(0, 65536, 4096, dtype=np.uint16).reshape(4, 4)
    png = tmp_path / "grey16.png"
    Image.fromarray(grey).save(png)
    colour = np.arange(4 * 4 * 3, dtype=np.uint16).reshape(4, 12) * 1361
    with zipfile.ZipFile(tmp_path / "deep.zip", "w") as zf:
        zf.write(png, "a/grey16.png")
        zf.writestr("a/rgb16.png", _png16_rgb(4, 4, colour))
    for name in ("grey16.png", "rgb16.png"):
        path = f"{tmp_path / 'deep.zip'}::a/{name}"
        x = tensor_loader(path)
        assert x.dtype == torch.uint8 and x.shape == (3, 4, 4)
        assert torch.equal(x, torch.from_numpy(np.array(pil_loader(path))).permute(2, 0, 1)), name
    assert tensor_loader(f"{tmp_path / 'deep.zip'}::a/grey16.png").max() == 255  # clipped, as PIL does


def test_tensor_loader_fails_as_pil_loader_does_and_takes_a_gifs_first_frame(tmp_path: Path) -> None:
    """A corrupt JPEG or PNG raised RuntimeError (no path), past loops that skip bad samples with
    ``except OSError`` as they do with PIL; an animated GIF came back 4-D instead of C,H,W."""
    import io

    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(buf, "JPEG")
    jpeg = buf.getvalue()
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "PNG")
    png = buf.getvalue()
    frames = [Image.fromarray(np.full((6, 5, 3), v, np.uint8)) for v in (10, 250)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    members = {
        "a/cut.jpg": jpeg[: len(jpeg) // 3],
        "a/bad.png": png[:16] + b"\0" * 40,
        "a/anim.gif": buf.getvalue(),
    }
    z = tmp_path / "bad.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    for name in ("a/cut.jpg", "a/bad.png"):
        with pytest.raises(OSError):
            pil_loader(f"{z}::{name}")
        with pytest.raises(OSError, match=name):
            tensor_loader(f"{z}::{name}")
    gif = tensor_loader(f"{z}::a/anim.gif")
    first = torch.from_numpy(np.array(pil_loader(f"{z}::a/anim.gif"))).permute(2, 0, 1)
    assert gif.shape == (3, 6, 5) and torch.equal(gif, first)


def test_tensor_loader_takes_what_pil_reads_with_pil_pixels_and_names_what_it_cannot(tmp_path: Path) -> None:
    """An animated WebP (torchvision refuses it, PIL gives its first frame) raised; a GIF with a
    transparent palette index came out in other colours than the default loader's; a file PIL
    cannot identify raised an error naming a BytesIO, not the sample."""
    import io

    frames = [Image.fromarray(np.full((6, 5, 3), v, np.uint8)) for v in (40, 220)]
    webp = io.BytesIO()
    frames[0].save(webp, "WEBP", save_all=True, append_images=frames[1:], lossless=True)
    rng = np.random.default_rng(0)
    pal = Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).quantize(16)
    gif = io.BytesIO()
    pal.save(gif, "GIF", transparency=3)
    members = {"a/anim.webp": webp.getvalue(), "a/t.gif": gif.getvalue(), "a/junk.png": b"not an image"}
    z = tmp_path / "imgs.zip"
    with zipfile.ZipFile(z, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    for name in ("a/anim.webp", "a/t.gif"):
        ours = tensor_loader(f"{z}::{name}")
        default = torch.from_numpy(np.array(pil_loader(f"{z}::{name}"))).permute(2, 0, 1)
        assert ours.shape == default.shape and torch.equal(ours, default), name
    with pytest.raises(OSError, match=r"a/junk\.png"):
        tensor_loader(f"{z}::a/junk.png")


def test_whole_archive_and_directory_roots(trees: dict[str, Path]) -> None:
    top = ArchiveImageFolder(str(trees["zip"]), allow_empty=True)  # classes: train, val (empty)
    assert top.classes == ["train", "val"]
    assert top.root_path == f"{trees['zip']}::"
    assert all(p.startswith(f"{trees['zip']}::train/") for p, _ in top.samples)
    slash = ArchiveImageFolder(f"{trees['zip']}/", allow_empty=True)  # as "dir/" names a directory
    assert slash.samples == top.samples
    local = ArchiveImageFolder(str(trees["extracted"]))  # a plain directory: torchvision's paths
    theirs = ImageFolder(str(trees["extracted"]))
    assert local.samples == theirs.samples and local.classes == theirs.classes


@pytest.mark.parametrize(
    ("workers", "context"), [(0, None), (2, "fork"), pytest.param(2, "spawn", marks=pytest.mark.slow)]
)
def test_dataloader_tensors_equal_torchvision(
    trees: dict[str, Path], workers: int, context: str | None
) -> None:
    tf = transforms.ToTensor()
    theirs = ImageFolder(str(trees["extracted"]), transform=tf)
    ours = ArchiveImageFolder(f"{trees['zip']}::train", transform=tf)
    kw = {"num_workers": workers, "batch_size": 3}
    if context:
        kw["multiprocessing_context"] = context
    got = list(DataLoader(ours, **kw))
    want = list(DataLoader(theirs, batch_size=3))
    assert len(got) == len(want)
    for (xa, ya), (xb, yb) in zip(got, want, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def _record_open(pid_dir: str):
    """Wrap cdmlfs.open so every process that opens an archive leaves its pid behind."""
    import cdmlfs

    real = cdmlfs.open

    def spy(location, **kw):
        Path(pid_dir, str(os.getpid())).touch()
        return real(location, **kw)

    return spy


def test_fork_workers_reuse_the_parents_index(
    trees: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forked workers read through the parent's (fork-safe) archive: no re-indexing per worker."""
    import torch

    import cdmlfs

    handles.close_all()
    monkeypatch.setattr(cdmlfs, "open", _record_open(str(tmp_path)))
    ds = ArchiveImageFolder(f"{trees['zip']}::train", transform=transforms.ToTensor())
    ds[0]  # the parent has read data too: its cache and locks are in use when the workers fork
    loader = DataLoader(ds, batch_size=1, num_workers=2, multiprocessing_context="fork")
    got = [(x[0], int(y)) for x, y in loader]
    assert {p.name for p in tmp_path.iterdir()} == {str(os.getpid())}  # only the parent opened it
    assert len(got) == len(ds)
    for i, (x, y) in enumerate(got):
        ref, ref_y = ds[i]
        assert y == ref_y and torch.equal(x, ref)


def test_spawned_workers_refuse_an_archive_replaced_after_the_dataset_listed_it(tmp_path: Path) -> None:
    """Spawned workers reopen the location: they read a replaced archive's pixels under the old
    sample list and targets, with no error (fork workers kept the parent's handle and saw EIO)."""
    import errno
    import pickle

    path = tmp_path / "data.zip"
    for version in (1, 2):
        src = tmp_path / f"v{version}"
        for cls in ("a", "b"):
            (src / cls).mkdir(parents=True)
            _image(src / cls / "x.png", version)
    shutil.make_archive(str(tmp_path / "data"), "zip", tmp_path / "v1")
    ds = ArchiveImageFolder(str(path))
    blob = pickle.dumps(ds)  # what a spawned worker receives
    handles.close_all()  # a fresh process: no handle yet
    pickle.loads(blob)[0]  # same archive: fine
    handles.close_all()
    os.replace(shutil.make_archive(str(tmp_path / "new"), "zip", tmp_path / "v2"), path)
    worker_ds = pickle.loads(blob)
    with pytest.raises(OSError) as exc:
        worker_ds[0]
    assert exc.value.errno == errno.ESTALE and "changed after the dataset listed it" in str(exc.value)


def test_a_relative_index_dir_is_the_same_for_workers_in_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dataset pickled index_dir as given: a spawned worker running elsewhere indexed the
    tar again into a folder of its own working directory."""
    import tarfile

    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    for i in range(3):
        Image.fromarray(np.full((4, 4, 3), 40 * i, np.uint8)).save(src / f"{i}.png")
    archive = tmp_path / "d.tar"
    with tarfile.open(archive, "w") as tf:
        tf.add(src, arcname="cls")
    monkeypatch.chdir(tmp_path)
    ds = ArchiveImageFolder(str(archive), open_options={"index_dir": "rel-idx"})
    state = pickle.dumps(ds)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cdmlfs_torch.handles.close_all()  # as in a spawned worker: no handle open yet
    again = pickle.loads(state)
    assert again[0][1] == 0 and again.tree.archive.format.index_source == "cache"
    assert not (elsewhere / "rel-idx").exists()


def test_a_chmod_or_hard_link_of_the_archive_is_no_change(tmp_path: Path) -> None:
    """chmod, chown and a new hard link move the ctime and leave the bytes alone: a spawned worker
    refused every sample with ESTALE (every epoch) after a chmod of the archive mid-training."""
    import pickle

    import cdmlfs

    for cls in ("a", "b"):
        (tmp_path / "src" / cls).mkdir(parents=True)
        _image(tmp_path / "src" / cls / "x.png", 1)
    path = Path(shutil.make_archive(str(tmp_path / "data"), "zip", tmp_path / "src"))
    ds = ArchiveImageFolder(str(path))
    blob, ar_blob = pickle.dumps(ds), pickle.dumps(cdmlfs.open(str(path)))
    before = os.stat(path).st_ctime_ns
    os.chmod(path, 0o600)
    os.link(path, tmp_path / "snapshot.zip")
    assert os.stat(path).st_ctime_ns != before
    held = handles.get_archive(str(path))
    assert handles.get_archive(str(path), revalidate=True) is held  # a dataset made again: same handle
    handles.close_all()  # a fresh (spawned) process
    assert pickle.loads(blob)[1][1] == 1
    pickle.loads(ar_blob).close()


def test_a_dataset_made_again_sees_the_archive_as_it_is_now(tmp_path: Path) -> None:
    """The process's handle kept the first version for good: a dataset made after the archive was
    replaced listed the old classes, and 'create the dataset again' could not help."""
    import errno

    path = tmp_path / "data.zip"
    for version, classes in ((1, ("a", "b")), (2, ("a", "b", "c"))):
        for cls in classes:
            (tmp_path / f"v{version}" / cls).mkdir(parents=True)
            _image(tmp_path / f"v{version}" / cls / "x.png", version)
    shutil.make_archive(str(tmp_path / "data"), "zip", tmp_path / "v1")
    old = ArchiveImageFolder(str(path))
    assert old.classes == ["a", "b"]
    os.replace(shutil.make_archive(str(tmp_path / "new"), "zip", tmp_path / "v2"), path)
    new = ArchiveImageFolder(str(path))
    assert new.classes == ["a", "b", "c"] and len(new) == 3
    assert new[2][1] == 2
    # The old dataset reads the version it listed, through its own handle (the old file's
    # descriptor); a worker that must open the location again finds another version: ESTALE.
    to_tensor = transforms.functional.pil_to_tensor
    assert torch.equal(to_tensor(old[0][0]), to_tensor(Image.open(tmp_path / "v1/a/x.png").convert("RGB")))
    blob = pickle.dumps(old)
    handles.close_all()  # a fresh (spawned) process
    with pytest.raises(OSError) as exc:
        pickle.loads(blob)[0]
    assert exc.value.errno == errno.ESTALE
    new = ArchiveImageFolder(str(path))
    again = ArchiveImageFolder(str(path))  # nothing changed: the same handle
    assert handles.get_archive(str(path)) is handles.get_archive(str(path), revalidate=True)
    assert again.classes == new.classes


def test_a_newer_dataset_over_a_touched_archive_leaves_the_first_one_working(tmp_path: Path) -> None:
    """Made after a touch (a re-download, cp -p, rsync), a second dataset moved the process's
    handle on, and every sample of the first then failed ESTALE, its loaders too."""
    import time

    from cdmlfs_torch import open_sample

    for cls in ("a", "b"):
        (tmp_path / "src" / cls).mkdir(parents=True)
        _image(tmp_path / "src" / cls / "x.png", 3)
    path = Path(shutil.make_archive(str(tmp_path / "data"), "zip", tmp_path / "src"))

    def by_file_object(sample: str):
        with open_sample(sample) as f:
            return Image.open(f).convert("RGB")

    first = ArchiveImageFolder(str(path))
    custom = ArchiveImageFolder(str(path), loader=by_file_object)
    want = first[1][0]
    os.utime(path, (time.time() + 5,) * 2)  # same bytes, another mtime: another version
    second = ArchiveImageFolder(str(path))
    assert handles.get_archive(str(path)) is second.tree.archive is not first.tree.archive
    for ds in (first, custom, second):
        assert torch.equal(
            transforms.functional.pil_to_tensor(ds[1][0]), transforms.functional.pil_to_tensor(want)
        )
    handles.close_all()


def test_handles_of_replaced_versions_are_let_go(tmp_path: Path) -> None:
    """Each version replaced kept its handle (descriptor, index, cache) until close_all; a file
    opened on an old version still reads to its end."""
    import gc
    import warnings

    path = tmp_path / "data.zip"

    def write(version: int) -> None:
        src = tmp_path / f"v{version}"
        for cls in ("a", "b"):
            (src / cls).mkdir(parents=True)
            _image(src / cls / "x.png", version)
        os.replace(shutil.make_archive(str(tmp_path / "new"), "zip", src), path)

    handles.close_all()
    write(0)
    ArchiveImageFolder(str(path))
    held = handles.get_archive(str(path)).open("a/x.png")  # a reader mid-file on version 0

    def open_fds() -> int:  # a closed archive's number reads /dev/null a while (LocalFile.close)
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                count += os.readlink(f"/proc/self/fd/{fd}") != os.devnull
        return count

    fds = open_fds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # let go quietly, not as an unclosed archive
        for version in range(1, 6):
            write(version)
            assert ArchiveImageFolder(str(path))[0][1] == 0
            gc.collect()
        assert open_fds() <= fds + 1  # the held version and the current one
        assert held.read()[:8] == b"\x89PNG\r\n\x1a\n"
        held.close()
        gc.collect()
    assert open_fds() <= fds  # the current version alone
    handles.close_all()


def test_a_dataset_made_again_sees_an_s3_object_replaced(tmp_path: Path) -> None:
    """The same on S3: an object uploaded again under the key was served as the old one (every
    read outside the cache then EIO) until the process restarted. A HEAD tells when making one."""
    pytest.importorskip("localbucket")
    import s3util

    for version, classes in ((1, ("a", "b")), (2, ("a", "b", "c"))):
        for cls in classes:
            (tmp_path / f"v{version}" / cls).mkdir(parents=True)
            _image(tmp_path / f"v{version}" / cls / "x.png", version)
    with s3util.dummy_credentials():
        endpoint = s3util.start_localbucket(tmp_path / "bucket-root")
        try:
            opts = {"endpoint_url": endpoint.url}
            endpoint.put(
                "data", "d.zip", Path(shutil.make_archive(str(tmp_path / "one"), "zip", tmp_path / "v1"))
            )
            old = ArchiveImageFolder("s3://data/d.zip", open_options=opts)
            assert old.classes == ["a", "b"]
            endpoint.put(
                "data", "d.zip", Path(shutil.make_archive(str(tmp_path / "two"), "zip", tmp_path / "v2"))
            )
            new = ArchiveImageFolder("s3://data/d.zip", open_options=opts)
            assert new.classes == ["a", "b", "c"] and new[2][1] == 2
            # The old dataset reads its own version (held in its cache here: a tiny object) or, where
            # a read must go to the endpoint, fails (GETs pinned to its ETag): never the new bytes.
            try:
                got = transforms.functional.pil_to_tensor(old[1][0])
            except OSError as exc:
                assert exc.errno == errno.EIO and "changed" in str(exc), exc
            else:
                want = Image.open(tmp_path / "v1/b/x.png").convert("RGB")
                assert torch.equal(got, transforms.functional.pil_to_tensor(want))
        finally:
            handles.close_all()
            endpoint.stop()


class _ReadsSamplePaths(torch.utils.data.Dataset):
    """A wrapper reading the inner dataset's sample paths itself (crops, multi-view, captions...)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> bytes:
        return cdmlfs_torch.read_sample(self.inner.samples[index][0])


def test_sample_paths_read_in_a_spawned_worker_keep_the_datasets_open_options(tmp_path: Path) -> None:
    """read_sample(ds.samples[i][0]) in a spawned worker opened the archive without the dataset's
    options: an S3 endpoint_url lost, the read went to AWS (fork workers kept the parent's handle)."""
    pytest.importorskip("localbucket")
    import s3util

    (tmp_path / "src" / "a").mkdir(parents=True)
    _image(tmp_path / "src" / "a" / "x.png", 3)
    archive = Path(shutil.make_archive(str(tmp_path / "d"), "zip", tmp_path / "src"))
    with s3util.dummy_credentials():
        endpoint = s3util.start_localbucket(tmp_path / "bucket-root")
        try:
            endpoint.put("data", "d.zip", archive)
            ds = ArchiveImageFolder("s3://data/d.zip", open_options={"endpoint_url": endpoint.url})
            want = (tmp_path / "src" / "a" / "x.png").read_bytes()
            loader = DataLoader(
                _ReadsSamplePaths(ds), 1, num_workers=1, multiprocessing_context="spawn", collate_fn=list
            )
            assert [batch[0] for batch in loader] == [want]
        finally:
            handles.close_all()
            endpoint.stop()


def test_an_archive_gone_when_a_worker_opens_it_is_an_oserror(tmp_path: Path) -> None:
    """A spawned worker opening a deleted archive raised cdmlfs's ArchiveNotFoundError, which an
    ``except OSError`` skip loop does not catch (every other sample error is an OSError)."""
    import pickle

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    _image(src / "a" / "x.png", 1)
    path = shutil.make_archive(str(tmp_path / "gone"), "zip", src)
    blob = pickle.dumps(ArchiveImageFolder(path))
    handles.close_all()  # as in a spawned worker: no handle yet
    os.unlink(path)
    with pytest.raises(OSError):
        pickle.loads(blob)[0]


def test_pickles_small_without_handle(trees: dict[str, Path]) -> None:
    ds = ArchiveImageFolder(f"{trees['zip']}::train")
    ds[0]  # the handle is open and has read data
    blob = pickle.dumps(ds)
    assert b"cdmlfs.archive" not in blob and b"ExtentCache" not in blob
    assert len(blob) < 1500 + sum(len(p) + 8 for p, _ in ds.samples)
    clone = pickle.loads(blob)
    assert clone.samples == ds.samples
    assert np.array_equal(np.asarray(clone[3][0]), np.asarray(ds[3][0]))


def test_is_valid_file_gets_sample_paths(trees: dict[str, Path]) -> None:
    seen: list[str] = []

    def only_txt(path: str) -> bool:
        seen.append(path)
        return path.endswith(".txt")

    ours = ArchiveImageFolder(f"{trees['zip']}::train", is_valid_file=only_txt, allow_empty=True)
    theirs = ImageFolder(
        str(trees["extracted"]), is_valid_file=lambda p: p.endswith(".txt"), allow_empty=True
    )
    assert_same_dataset(ours, theirs, str(trees["extracted"]))
    assert all(p.startswith(f"{trees['zip']}::train/") for p in seen)
    assert [ours.tree.relpath(p) for p, _ in ours.samples] == ["dog/notes.txt"]


def _error(fn) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn()
    return info.type, str(info.value)


def test_errors_match_torchvision(trees: dict[str, Path]) -> None:
    zip_path, extracted = trees["zip"], trees["extracted"]
    # Empty classes (no valid file): same type and message (it names classes, not paths).
    theirs = _error(lambda: ImageFolder(str(extracted), is_valid_file=lambda p: p.endswith(".txt")))
    ours = _error(
        lambda: ArchiveImageFolder(f"{zip_path}::train", is_valid_file=lambda p: p.endswith(".txt"))
    )
    assert ours == theirs and theirs[0] is FileNotFoundError
    # An is_valid_file that took no file at all on an archive gets a hint: torchvision's documented
    # check, Image.open(p).verify(), failed on every archive sample path.

    def verifies(path: str) -> bool:
        try:
            Image.open(path).verify()
        except Exception:
            return False
        return True

    assert ImageFolder(str(extracted), is_valid_file=verifies, allow_empty=True).samples
    ours = _error(lambda: ArchiveImageFolder(f"{zip_path}::train", is_valid_file=verifies))
    assert ours[0] is FileNotFoundError and "cdmlfs_torch.open_sample(path)" in ours[1], ours
    theirs = _error(lambda: ImageFolder(str(trees["base"] / "extracted")))  # classes train, val; val empty
    ours = _error(lambda: ArchiveImageFolder(str(zip_path)))
    assert ours == theirs and "val" in ours[1] and "Supported extensions are: .jpg" in ours[1]
    # No class folder: the message names the root as given.
    theirs = _error(lambda: ImageFolder(str(extracted / "bird" / "nested")))
    ours = _error(lambda: ArchiveImageFolder(f"{zip_path}::train/bird/nested"))
    assert ours[0] is theirs[0] is FileNotFoundError
    assert ours[1] == theirs[1].replace(str(extracted / "bird" / "nested"), f"{zip_path}::train/bird/nested")
    # extensions and is_valid_file together (or neither): ValueError, same message.
    for ext, fn in ((None, None), ((".jpg",), lambda p: True)):
        theirs = _error(
            lambda ext=ext, fn=fn: torchvision.datasets.DatasetFolder(
                str(extracted), default_loader, ext, is_valid_file=fn
            )
        )
        ours = _error(
            lambda ext=ext, fn=fn: ArchiveDatasetFolder(
                f"{zip_path}::train", default_loader, ext, is_valid_file=fn
            )
        )
        assert ours == theirs and ours[0] is ValueError
    with pytest.raises(ValueError, match="at least one entry"):
        cdmlfs_torch.make_dataset(f"{zip_path}::train", {}, extensions=(".jpg",))


def test_missing_roots(trees: dict[str, Path], tmp_path: Path) -> None:
    zip_path = trees["zip"]
    with pytest.raises(FileNotFoundError):
        ArchiveImageFolder(str(tmp_path / "nope.zip"))
    with pytest.raises(FileNotFoundError):
        ArchiveImageFolder(f"{zip_path}::no/such/folder")
    with pytest.raises(FileNotFoundError) as missing:
        ArchiveImageFolder(f"{zip_path}/no/such/folder")
    assert missing.value.filename == f"{zip_path}/no/such/folder"  # as given, as ImageFolder names it
    with pytest.raises(NotADirectoryError) as not_dir:
        ArchiveImageFolder(f"{zip_path}/train/cat/b.jpg")
    assert not_dir.value.filename == f"{zip_path}/train/cat/b.jpg"
    with pytest.raises(NotADirectoryError):
        ArchiveImageFolder(f"{zip_path}::train/cat/b.jpg")
    # Through a file, as the OS answers for a root on disk (was FileNotFoundError).
    for root in (f"{zip_path}::train/cat/b.jpg/x", f"{zip_path}/train/cat/b.jpg/x/y"):
        with pytest.raises(NotADirectoryError):
            ArchiveImageFolder(root)
    with pytest.raises(NotADirectoryError):
        ImageFolder(str(trees["extracted"] / "cat/b.jpg/x"))
    # As ImageFolder answers for a root on disk: OSErrors, not cdmlfs's own error types.
    with pytest.raises(FileNotFoundError):
        ArchiveImageFolder(f"{tmp_path / 'nope.zip'}::train")
    not_archive = tmp_path / "notes.txt"
    not_archive.write_text("hello")
    with pytest.raises(NotADirectoryError):
        ArchiveImageFolder(str(not_archive))
    # No class folder at the root: the message names the root as given, not an internal form.
    empty = tmp_path / "flat.zip"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("a.png", b"x")
    with pytest.raises(FileNotFoundError, match=f"Couldn't find any class folder in {empty}\\.$"):
        ArchiveImageFolder(str(empty))


def test_transforms_attribute_and_repr_match_torchvision(trees: dict[str, Path]) -> None:
    tf = transforms.Compose([transforms.Resize(8), transforms.ToTensor()])
    for kw in ({}, {"transform": tf}, {"transform": tf, "target_transform": transforms.Lambda(int)}):
        theirs = ImageFolder(str(trees["extracted"]), **kw)
        ours = ArchiveImageFolder(f"{trees['zip']}::train", **kw)
        assert repr(ours.transforms) == repr(theirs.transforms)
        assert repr(ours).replace(f"{trees['zip']}::train", "ROOT") == repr(theirs).replace(
            str(trees["extracted"]), "ROOT"
        ).replace("Dataset ImageFolder", "Dataset ArchiveImageFolder")

    class Split(ImageFolder):  # torchvision's hook for more repr lines
        def extra_repr(self) -> str:
            return "Split: train"

    class OurSplit(ArchiveImageFolder):
        def extra_repr(self) -> str:
            return "Split: train"

    theirs, ours = Split(str(trees["extracted"])), OurSplit(f"{trees['zip']}::train")
    here = f"{trees['zip']}::train"
    assert repr(ours).splitlines()[1:] == [
        line.replace(str(trees["extracted"]), here) for line in repr(theirs).splitlines()[1:]
    ]


def test_torchvision_takes_ours_for_its_own(trees: dict[str, Path]) -> None:
    """isinstance(ds, ImageFolder) was False, and wrap_dataset_for_transforms_v2 refused ours
    ("meant for subclasses of VisionDataset"); torchvision's own wraps fine."""
    from torchvision.datasets import DatasetFolder, VisionDataset, wrap_dataset_for_transforms_v2

    ours = ArchiveImageFolder(f"{trees['zip']}::train", transform=transforms.PILToTensor())
    theirs = ImageFolder(str(trees["extracted"]), transform=transforms.PILToTensor())
    assert isinstance(ours, ImageFolder) and isinstance(ours, VisionDataset)
    folder = ArchiveDatasetFolder(f"{trees['zip']}::train", read_sample, (".png",), allow_empty=True)
    assert isinstance(folder, DatasetFolder) and not isinstance(folder, ImageFolder)
    wrapped = wrap_dataset_for_transforms_v2(ours)
    image, target = wrapped[0]
    assert target == theirs[0][1] and torch.equal(image, theirs[0][0])
    assert vars(ours).keys() - vars(theirs).keys() == {"_tree", "_tree_options"}


def test_allow_empty_keeps_empty_classes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for d in ("a", "b", "c"):
        (src / d).mkdir(parents=True)
    _image(src / "a" / "1.png", 1)
    (src / "c" / "x.txt").write_text("x")
    with zipfile.ZipFile(tmp_path / "d.zip", "w") as zf:  # explicit directory entries keep b/ and c/
        for p in sorted(src.rglob("*")):
            zf.write(p, p.relative_to(src).as_posix())
    ours = ArchiveImageFolder(str(tmp_path / "d.zip"), allow_empty=True)
    theirs = ImageFolder(str(src), allow_empty=True)
    assert_same_dataset(ours, theirs, str(src))
    assert ours.classes == ["a", "b", "c"]


def test_overridden_find_classes_is_used(trees: dict[str, Path]) -> None:
    class OnlyCats(ArchiveImageFolder):
        def find_classes(self, directory):
            return ["cat"], {"cat": 0}

    class TvOnlyCats(ImageFolder):
        def find_classes(self, directory):
            return ["cat"], {"cat": 0}

    ours = OnlyCats(f"{trees['zip']}::train")
    theirs = TvOnlyCats(str(trees["extracted"]))
    assert_same_dataset(ours, theirs, str(trees["extracted"]))


def test_a_loader_that_opens_local_files_gets_a_hint(trees: dict[str, Path]) -> None:
    from torchvision.datasets.folder import pil_loader as local_only

    ds = ArchiveImageFolder(f"{trees['zip']}::train", loader=local_only)
    with pytest.raises(FileNotFoundError, match="open_sample"):
        ds[0]
    ok = ArchiveImageFolder(
        f"{trees['zip']}::train", loader=lambda p: Image.open(cdmlfs_torch.open_sample(p))
    )
    assert ok[0][0].size == (W, H)


def test_extract_a_bad_sample(trees: dict[str, Path], tmp_path: Path) -> None:
    ds = ArchiveImageFolder(f"{trees['zip']}::train")
    out = ds.extract(0, tmp_path / "inspect")
    rel = ds.relpath(0)
    assert out == str(tmp_path / "inspect" / rel)
    assert Path(out).read_bytes() == (trees["extracted"] / rel).read_bytes()


@pytest.mark.fuse
def test_stock_imagefolder_on_mount_equals_archive_reads(trees: dict[str, Path], mnt: Path) -> None:
    tf = transforms.ToTensor()
    with mounted(trees["zip"], mnt):
        stock = ImageFolder(str(mnt / "train"), transform=tf)
        via_mount = ArchiveImageFolder(str(mnt / "train"), transform=tf)  # a directory: plain file reads
        direct = ArchiveImageFolder(f"{trees['zip']}::train", transform=tf)
        assert via_mount.samples == stock.samples
        assert_same_dataset(direct, stock, str(mnt / "train"))
        for (xa, ya), (xb, yb) in zip(
            DataLoader(direct, 4), DataLoader(stock, 4, num_workers=2), strict=True
        ):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_bad_samples_raise_oserror_like_files_on_disk(tmp_path: Path) -> None:
    """Loops that skip bad samples with ``except OSError`` work on archives as on a directory: a link
    to a missing file is FileNotFoundError, a corrupt member an OSError with EIO."""
    import errno

    from archives import flip_byte_in_member

    z = tmp_path / "bad.zip"
    good = tmp_path / "good.png"
    _image(good, 1)
    with zipfile.ZipFile(z, "w", zipfile.ZIP_STORED) as zf:
        zf.write(good, "cat/good.png")
        zf.write(good, "cat/corrupt.png")
        link = zipfile.ZipInfo("dog/broken.png")
        link.external_attr = (0o120777 << 16) | 0x20
        link.create_system = 3
        zf.writestr(link, "missing.png")
        zf.write(good, "dog/good.png")
    flip_byte_in_member(z, "cat/corrupt.png")
    ds = ArchiveImageFolder(str(z))
    by_name = {os.path.basename(p) + str(t): i for i, (p, t) in enumerate(ds.samples)}
    with pytest.raises(FileNotFoundError):
        ds[by_name["broken.png1"]]
    with pytest.raises(OSError) as err:
        ds[by_name["corrupt.png0"]]
    assert err.value.errno == errno.EIO and "CRC" in str(err.value)
    assert ds[by_name["good.png1"]][1] == 1
    z = tmp_path / "odd.zip"  # a new location: handles are kept per location
    with zipfile.ZipFile(z, "w") as zf:
        zf.write(good, "cat/good.png")
        zf.writestr("bird/not_an_image.png", b"plain text")
        for name, target in (("bird/loop_a.png", "loop_b.png"), ("bird/loop_b.png", "loop_a.png")):
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o120777 << 16) | 0x20
            info.create_system = 3
            zf.writestr(info, target)
    ds = ArchiveImageFolder(str(z))
    by_name = {os.path.basename(p): i for i, (p, _) in enumerate(ds.samples)}
    from PIL import UnidentifiedImageError

    with pytest.raises(UnidentifiedImageError, match=r"bird/not_an_image\.png"):  # names the sample
        ds[by_name["not_an_image.png"]]
    with pytest.raises(OSError) as err:
        ds[by_name["loop_a.png"]]
    assert err.value.errno == errno.ELOOP  # as on disk: not a FileNotFoundError


def test_double_colons_in_real_names(tmp_path: Path) -> None:
    """'::' separates archive and member only after a file (or a URI): a folder named 'a::b' on
    disk is a folder (a deleted sample is FileNotFoundError, as torchvision's), and an archive
    named 'x::y.zip' opens with its own '::'."""
    folder = tmp_path / "a::b"
    for cls in ("cat", "dog"):
        (folder / cls).mkdir(parents=True)
        Image.new("RGB", (4, 4), (10, 20, 30)).save(folder / cls / "1.png")
    ds = ArchiveImageFolder(str(folder))
    assert ds.samples == ImageFolder(str(folder)).samples
    os.unlink(folder / "dog" / "1.png")
    with pytest.raises(FileNotFoundError):
        ds[1]
    odd = tmp_path / "x::y.zip"
    with zipfile.ZipFile(odd, "w") as zf:
        for cls in ("cat", "dog"):
            zf.write(folder / "cat" / "1.png", f"top/{cls}/1.png")
    for root in (f"{odd}::top", f"{odd}/top"):
        ds = ArchiveImageFolder(root)
        assert ds.classes == ["cat", "dog"] and ds[1][0].size == (4, 4), root
    assert cdmlfs_torch.read_sample(f"{odd}::top/cat/1.png") == (folder / "cat" / "1.png").read_bytes()


class _PicksFirst(ImageFolder):
    """A subclass that asks find_classes before its base is built (torchvision's hook allows it)."""

    def __init__(self, root: str, **kw) -> None:
        classes, _ = self.find_classes(root)
        self.first = classes[0]
        super().__init__(root, **kw)


class _OursPicksFirst(ArchiveImageFolder):
    def __init__(self, root: str, **kw) -> None:
        classes, _ = self.find_classes(root)
        self.first = classes[0]
        super().__init__(root, **kw)


def test_find_classes_before_the_dataset_is_built(trees: dict[str, Path]) -> None:
    """It read self.root and self.tree, which a subclass calling it first has not set: AttributeError."""
    theirs = _PicksFirst(str(trees["extracted"]))
    for root in (f"{trees['zip']}::train", str(trees["extracted"])):
        ours = _OursPicksFirst(root)
        assert ours.first == theirs.first == "Zebra"
        assert ours.classes == theirs.classes and ours.targets == theirs.targets


def test_hooks_that_read_a_manifest_never_open_the_root_as_a_folder(tmp_path: Path) -> None:
    """The root was opened as a folder before the hooks ran: a subclass whose hooks read a list of
    samples from a file (torchvision's docstring suggests overriding make_dataset so) was refused."""
    manifest = tmp_path / "manifest.csv"
    manifest.write_text("a.jpg,0\nb.jpg,1\n")

    def hooks(base: type) -> type:
        class Manifest(base):
            def find_classes(self, directory):
                return ["x", "y"], {"x": 0, "y": 1}

            @staticmethod
            def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
                return [(p, int(t)) for p, t in (line.split(",") for line in open(directory).read().split())]

        return Manifest

    from torchvision.datasets import DatasetFolder

    theirs = hooks(DatasetFolder)(str(manifest), loader=str.upper, extensions=(".jpg",))
    ours = hooks(ArchiveDatasetFolder)(str(manifest), loader=str.upper, extensions=(".jpg",))
    assert ours.samples == theirs.samples == [("a.jpg", 0), ("b.jpg", 1)]
    assert ours[1] == theirs[1] == ("B.JPG", 1)


def test_archive_order_of_manifest_samples_spread_over_archives(tmp_path: Path) -> None:
    """ArchiveOrderSampler asked the dataset's root for archive positions: a root that is a
    manifest file raised NotADirectoryError, a directory holding one gave list order."""
    from cdmlfs_torch import ArchiveOrderSampler

    archives = []
    for k in range(2):
        path = tmp_path / f"part{k}.zip"
        with zipfile.ZipFile(path, "w") as zf:
            for name in ("c.jpg", "a.jpg", "b.jpg"):  # archive order differs from name order
                zf.writestr(name, f"{k}{name}")
        archives.append(path)
    rows = [(f"{archives[k]}::{name}", k) for name in ("a.jpg", "b.jpg", "c.jpg") for k in (1, 0)]
    rows.append((str(tmp_path / "plain.jpg"), 0))  # a file on disk: after the archives' samples
    (tmp_path / "plain.jpg").write_text("plain")
    manifest = tmp_path / "list" / "manifest.csv"
    manifest.parent.mkdir()
    manifest.write_text("".join(f"{p},{t}\n" for p, t in rows))

    class Manifest(ArchiveDatasetFolder):
        def find_classes(self, directory):
            return ["zero", "one"], {"zero": 0, "one": 1}

        @staticmethod
        def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
            path = directory if os.path.isfile(directory) else os.path.join(directory, "manifest.csv")
            return [(p, int(t)) for p, t in (line.rsplit(",", 1) for line in open(path).read().split())]

    for root in (manifest, manifest.parent):  # the manifest itself; a folder holding it
        ds = Manifest(str(root), loader=lambda p: cdmlfs_torch.open_sample(p).read())
        order = [ds.samples[i][0] for i in ArchiveOrderSampler(ds, shuffle=False)]
        # part1 first (its sample comes first in the list), each archive in its own order: c, a, b
        assert order == [f"{archives[k]}::{n}" for k in (1, 0) for n in ("c.jpg", "a.jpg", "b.jpg")] + [
            str(tmp_path / "plain.jpg")
        ], order
        assert ds[0] == (b"1a.jpg", 1)


class _ManifestFolder(ArchiveDatasetFolder):
    """Samples from a list file ("PATH,TARGET" lines), one class (module level: it pickles)."""

    def find_classes(self, directory):
        return ["zero"], {"zero": 0}

    @staticmethod
    def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        return [(p, int(t)) for p, t in (line.rsplit(",", 1) for line in open(directory).read().split())]


def _read_bytes(path: str) -> bytes:
    return cdmlfs_torch.open_sample(path).read()


def test_manifest_samples_open_their_archive_with_the_datasets_options(tmp_path: Path) -> None:
    """Hooks that read a sample list never open the root: the loader opened each sample's archive
    by its location alone, with the default options (an S3 endpoint_url lost), in the parent and
    in every worker process, unless something else had opened it first."""
    import pickle

    from cdmlfs_torch import handles

    archive = tmp_path / "part.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("a.jpg", "A")
    manifest = tmp_path / "manifest.csv"
    manifest.write_text(f"{archive}::a.jpg,0\n")

    handles.close_all()
    try:
        ds = _ManifestFolder(str(manifest), loader=_read_bytes, cache_size=3 << 20)
        assert ds[0] == (b"A", 0)
        assert handles.get_archive(str(archive))._cache_size == 3 << 20
        copy = pickle.loads(pickle.dumps(ds))
        handles.close_all()  # what a spawned worker starts with: no handle, no options
        assert copy[0] == (b"A", 0)
        assert handles.get_archive(str(archive))._cache_size == 3 << 20
    finally:
        handles.close_all()


def test_a_missing_local_sample_keeps_the_os_error(trees: dict[str, Path], tmp_path: Path) -> None:
    """A plain local path added to samples got the hint meant for archive samples opened locally."""
    ds = ArchiveImageFolder(f"{trees['zip']}::train")
    missing = str(tmp_path / "gone.png")
    ds.samples.append((missing, 0))
    with pytest.raises(FileNotFoundError) as err:
        ds[-1]
    assert err.value.filename == missing and "open_sample" not in str(err.value)


def test_is_valid_file_that_opens_sample_paths_itself_is_told_what_to_use(trees: dict[str, Path]) -> None:
    """An is_valid_file that lets Image.open's error out got a bare FileNotFoundError on 'x.zip::a.png'."""
    from PIL import UnidentifiedImageError

    def decodes(path: str) -> bool:  # not an image: False; no such file: the error goes out
        try:
            with Image.open(path) as img:
                img.verify()
        except UnidentifiedImageError:
            return False
        return True

    with pytest.raises(FileNotFoundError, match=r"is_valid_file opened an archive sample path .*open_sample"):
        ArchiveImageFolder(f"{trees['zip']}::train", is_valid_file=decodes)
    # On a directory the paths are local files: the same function works, as with ImageFolder.
    ours = ArchiveImageFolder(str(trees["extracted"]), is_valid_file=decodes)
    assert ours.samples == ImageFolder(str(trees["extracted"]), is_valid_file=decodes).samples

    def swallows(path: str) -> bool:  # every error is "not valid": it takes none, silently
        try:
            return decodes(path)
        except Exception:
            return False

    # The hint names a path it was given (it showed "x.zip::/..." for a whole archive's root).
    with pytest.raises(FileNotFoundError, match=r"is_valid_file took none .* such as '[^']*\.zip::train/"):
        ArchiveImageFolder(str(trees["zip"]), is_valid_file=swallows)


def test_repr_follows_repr_indent(trees: dict[str, Path]) -> None:
    class Wide(ArchiveImageFolder):
        _repr_indent = 2

    class TheirWide(ImageFolder):
        _repr_indent = 2

    root = str(trees["extracted"])
    assert repr(Wide(root)).replace("Wide", "X") == repr(TheirWide(root)).replace("TheirWide", "X")


def test_default_loader_follows_torchvisions_image_backend(trees: dict[str, Path]) -> None:
    """torchvision.set_image_backend("accimage") was ignored: ImageFolder's default loader uses
    accimage for files on disk, ours always PIL. Archive samples stay with PIL (accimage reads
    only paths on disk)."""
    from torchvision.datasets.folder import default_loader as theirs_loader

    local = next(str(p) for p in sorted(trees["extracted"].rglob("*.jpg")))
    inner = f"{trees['zip']}::train/{os.path.relpath(local, trees['extracted'])}"
    previous = torchvision.get_image_backend()
    torchvision.set_image_backend("accimage")
    try:
        try:
            import accimage  # noqa: F401
        except ImportError:  # not installed here: both loaders fail the same way on a local file
            with pytest.raises(ImportError, match="accimage"):
                theirs_loader(local)
            with pytest.raises(ImportError, match="accimage"):
                default_loader(local)
        else:
            assert type(default_loader(local)) is type(theirs_loader(local))
        assert default_loader(inner).size == Image.open(local).size  # from the archive: PIL
    finally:
        torchvision.set_image_backend(previous)
    assert np.array_equal(np.array(default_loader(inner)), np.array(theirs_loader(local)))


def test_a_subclass_picking_its_classes_keeps_the_datasets_open_options(tmp_path: Path) -> None:
    """Overriding only find_classes (a common torchvision idiom) left the default make_dataset to
    open the root on its own: the archive opened without the dataset's cache_size / open_options
    (an S3 endpoint lost), and the dataset without the handle that notices a replaced archive."""
    src = tmp_path / "src"
    for name in ("a", "b", "c"):
        (src / name).mkdir(parents=True)
        _image(src / name / "x.png", 1)
    path = shutil.make_archive(str(tmp_path / "d"), "zip", src)

    class TwoClasses(ArchiveImageFolder):
        def find_classes(self, directory):
            return ["a", "c"], {"a": 0, "c": 1}

    handles.close_all()
    try:
        ds = TwoClasses(path, cache_size=3 << 20)
        assert [(ds.relpath(i), t) for i, (_, t) in enumerate(ds.samples)] == [("a/x.png", 0), ("c/x.png", 1)]
        assert handles.get_archive(path).cache.limit == 3 << 20
        assert isinstance(ds._tree, ArchiveTree) and ds[1][1] == 1
    finally:
        handles.close_all()


def _shard(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("c/m.bin", payload)
    return path


def test_handles_of_many_archives_stay_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading samples from one shard archive after another kept every shard open (a descriptor and
    a cache each) until the process ran out of descriptors."""
    handles.close_all()
    monkeypatch.setattr(handles, "MAX_OPEN", 4)
    shards = [_shard(tmp_path / f"s{i:02d}.zip", bytes([i]) * 100) for i in range(12)]
    listed = ArchiveDatasetFolder(f"{shards[0]}::", loader=read_sample, extensions=(".bin",))

    def shards_open() -> int:  # descriptors on shard files (closed ones point at /dev/null)
        targets = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own descriptor, gone by now
                targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sum(t.startswith(str(tmp_path)) for t in targets)

    for _ in range(2):
        for i, shard in enumerate(shards):
            assert read_sample(f"{shard}::c/m.bin") == bytes([i]) * 100
            assert len(handles.open_locations()) <= 4
            assert shards_open() <= 5  # the registry's 4 and the dataset's own
    assert listed[0][0] == bytes([0]) * 100  # a dataset keeps its own handle, let go or not
    handles.close_all()


def test_running_out_of_descriptors_is_emfile_not_a_bad_sample(tmp_path: Path) -> None:
    """EMFILE at an archive's open became EINVAL (a usage error): a loop skipping bad samples on
    OSError could not tell it from a corrupt one."""
    shard = _shard(tmp_path / "s.zip", b"x")
    warm = _shard(tmp_path / "warm.zip", b"y")
    script = f"""
import errno, os, resource
from cdmlfs_torch import read_sample
read_sample({str(warm)!r} + "::c/m.bin")  # every module imported while descriptors are left
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
try:
    read_sample({str(shard)!r} + "::c/m.bin")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "EMFILE", (res.stdout, res.stderr)


def test_a_local_file_spelled_like_a_sample_does_not_replace_the_member(tmp_path: Path) -> None:
    """A file made on disk at ``<archive>::<member>`` after the listing was read instead of the member."""
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    Image.new("RGB", (4, 4), (255, 0, 0)).save(src / "cat" / "1.png")
    archive = tmp_path / "train.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.write(src / "cat" / "1.png", "cat/1.png")
    ds = ArchiveImageFolder(f"{archive}::")
    shadow = tmp_path / "train.zip::cat"
    shadow.mkdir()
    Image.new("RGB", (4, 4), (0, 0, 255)).save(shadow / "1.png")
    assert ds[0][0].getpixel((0, 0)) == (255, 0, 0)
    handles.close_all()


def test_tensor_loader_decodes_with_pil_where_torchvision_no_longer_does(
    trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchvision's image decoding is deprecated; without it every sample failed with ImportError."""
    from cdmlfs_torch import loaders

    ds = ArchiveImageFolder(f"{trees['zip']}::train")
    path = next(p for p, _ in ds.samples if p.endswith(".png"))  # lossless: the same pixels either way
    expected = tensor_loader(path)
    loaders._torchvision_decoder.cache_clear()
    monkeypatch.setitem(sys.modules, "torchvision.io", None)  # import torchvision.io: ImportError
    try:
        got = tensor_loader(path)
    finally:
        loaders._torchvision_decoder.cache_clear()
    assert got.dtype == torch.uint8 and torch.equal(got, expected)
    handles.close_all()
