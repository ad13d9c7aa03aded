"""ArchiveDataset: selection, decoders, inspection helpers, workers; and import without torch."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import wave
import zipfile
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")
from PIL import Image  # noqa: E402

from cdmlfs_torch import ArchiveDataset  # noqa: E402
from cdmlfs_torch.decoders import decode_wav_numpy  # noqa: E402
from cdmlfs_torch.globmatch import glob_match  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def wav_bytes(frames: list[list[int]], width: int, rate: int = 16000) -> bytes:
    """A PCM WAV of ``frames`` (one list per frame, one int per channel)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(len(frames[0]))
        w.setsampwidth(width)
        w.setframerate(rate)
        raw = bytearray()
        for frame in frames:
            for v in frame:
                if width == 1:
                    raw += struct.pack("<B", v)
                elif width == 3:
                    raw += struct.pack("<i", v)[:3]
                else:
                    raw += struct.pack({2: "<h", 4: "<i"}[width], v)
        w.writeframes(bytes(raw))
    return buf.getvalue()


def npy_bytes(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def png_bytes(mode: str = "L") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.arange(48, dtype=np.uint8).reshape(6, 8), mode).save(buf, "PNG")
    return buf.getvalue()


FILES = {
    "clips/a/one.wav": wav_bytes([[0, 1000], [-32768, 32767], [16384, -16384]], 2, 8000),
    "clips/b/two.WAV": wav_bytes([[0], [255], [128]], 1, 22050),
    "clips/three.wav": wav_bytes([[-(1 << 23)], [(1 << 23) - 1], [1]], 3),
    "clips/four.wav": wav_bytes([[-(1 << 31)], [1 << 30]], 4),
    "meta/labels.json": json.dumps({"one": 1, "two": [2, 2]}).encode(),
    "meta/table.csv": b'name,value\r\nx,1\r\n"a,b",2\r\n',
    "meta/readme.txt": "héllo\n".encode(),
    "meta/lines.jsonl": b'{"a": 1}\n\n{"a": 2}\n',
    "feats/x.npy": npy_bytes(np.arange(12, dtype=np.float32).reshape(3, 4)),
    "img/mask.png": png_bytes(),
    "blob.bin": bytes(range(256)),
}


@pytest.fixture(scope="module")
def data_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ds") / "data.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in FILES.items():
            zf.writestr(name, data)
    return path


def test_raw_bytes_by_default_in_name_order(data_zip: Path) -> None:
    ds = ArchiveDataset(str(data_zip))
    assert ds.paths == sorted(FILES)
    assert [ds[i] for i in range(len(ds))] == [FILES[p] for p in ds.paths]
    assert ds.samples[0] == f"{data_zip}::{ds.paths[0]}"
    assert [ds.relpath(i) for i in range(len(ds))] == ds.paths  # as ArchiveImageFolder.relpath


def test_selection_by_extension_glob_and_predicate(data_zip: Path) -> None:
    assert ArchiveDataset(str(data_zip), extensions=".wav").paths == [
        "clips/a/one.wav",
        "clips/b/two.WAV",
        "clips/four.wav",
        "clips/three.wav",
    ]
    assert ArchiveDataset(str(data_zip), glob="clips/*.wav").paths == ["clips/four.wav", "clips/three.wav"]
    assert ArchiveDataset(str(data_zip), glob="**/*.wav").paths == [
        "clips/a/one.wav",
        "clips/four.wav",
        "clips/three.wav",
    ]
    assert ArchiveDataset(str(data_zip), glob=("*.bin", "meta/*.json")).paths == [
        "blob.bin",
        "meta/labels.json",
    ]
    sub = ArchiveDataset(f"{data_zip}::meta", is_valid_file=lambda p: p.endswith("t"))
    assert sub.paths == ["readme.txt"] and sub.samples == [f"{data_zip}::meta/readme.txt"]
    with pytest.raises(FileNotFoundError, match="no files"):
        ArchiveDataset(str(data_zip), extensions=".flac")
    assert len(ArchiveDataset(str(data_zip), extensions=".flac", allow_empty=True)) == 0


def test_glob_rules() -> None:
    assert glob_match("a/b/c.txt", "**/c.txt") and glob_match("c.txt", "**/c.txt")
    assert not glob_match("a/c.txt", "*.txt") and glob_match("a/c.txt", "*/c.txt")
    assert glob_match("x7.txt", "x[0-9].txt") and not glob_match("x7.txt", "x[!0-9].txt")
    assert glob_match("a/b/c", "a/**") and not glob_match("ab/c", "a/**")


def test_automatic_decoders(data_zip: Path) -> None:
    ds = ArchiveDataset(str(data_zip), decode="auto")
    one, rate = ds.by_name("clips/a/one.wav")
    assert rate == 8000 and tuple(one.shape) == (2, 3)
    np.testing.assert_array_equal(
        np.asarray(one), np.array([[0, -32768, 16384], [1000, 32767, -16384]]) / 32768
    )
    two, rate = ds.by_name("clips/b/two.WAV")  # 8-bit WAV is unsigned, centred on 128
    assert rate == 22050
    np.testing.assert_array_equal(np.asarray(two), [[-1.0, 127 / 128, 0.0]])
    three, _ = ds.by_name("clips/three.wav")
    np.testing.assert_array_equal(np.asarray(three), [[-1.0, ((1 << 23) - 1) / (1 << 23), 1 / (1 << 23)]])
    four, _ = ds.by_name("clips/four.wav")
    np.testing.assert_array_equal(np.asarray(four), [[-1.0, 0.5]])
    assert ds.by_name("meta/labels.json") == {"one": 1, "two": [2, 2]}
    assert ds.by_name("meta/table.csv") == [["name", "value"], ["x", "1"], ["a,b", "2"]]
    assert ds.by_name("meta/readme.txt") == "héllo\n"
    assert ds.by_name("meta/lines.jsonl") == [{"a": 1}, {"a": 2}]
    np.testing.assert_array_equal(ds.by_name("feats/x.npy"), np.arange(12, dtype=np.float32).reshape(3, 4))
    mask = ds.by_name("img/mask.png")
    assert mask.mode == "L" and mask.size == (8, 6)  # images keep their mode
    assert ds.by_name("blob.bin") == FILES["blob.bin"]  # unknown extension: bytes


def test_custom_decoders_and_return_path(data_zip: Path) -> None:
    upper = ArchiveDataset(
        f"{data_zip}::meta", decode={".txt": lambda b: b.decode().upper()}, return_path=True
    )
    assert upper.by_name("readme.txt") == ("readme.txt", "HÉLLO\n")
    assert upper.by_name("labels.json")[1] == {"one": 1, "two": [2, 2]}  # others stay automatic
    sizes = ArchiveDataset(str(data_zip), decode=len, transform=lambda n: n * 2)
    assert sizes.by_name("blob.bin") == 512
    with pytest.raises(ValueError):
        ArchiveDataset(str(data_zip), decode="magic")


def test_by_name_index_of_and_extract(data_zip: Path, tmp_path: Path) -> None:
    ds = ArchiveDataset(str(data_zip))
    i = ds.index_of("meta/table.csv")
    assert ds.index_of(ds.samples[i]) == i  # the full sample path works too
    with pytest.raises(KeyError):
        ds.index_of("meta/missing.csv")
    out = ds.extract(i, tmp_path)
    assert out == str(tmp_path / "meta" / "table.csv")
    assert Path(out).read_bytes() == FILES["meta/table.csv"]


def test_directory_root_behaves_the_same(data_zip: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(data_zip) as zf:
        zf.extractall(tmp_path / "x")
    local = ArchiveDataset(str(tmp_path / "x"), decode="auto", glob="meta/*")
    remote = ArchiveDataset(f"{data_zip}", decode="auto", glob="meta/*")
    assert local.paths == remote.paths
    assert [local[i] for i in range(len(local))] == [remote[i] for i in range(len(remote))]
    assert local.samples[0] == os.path.join(str(tmp_path / "x"), local.paths[0])


def test_dataloader_workers(data_zip: Path) -> None:
    """Fork workers here; spawn (which pickles the dataset) is covered by test_torch_folder.py."""
    torch = pytest.importorskip("torch")
    ds = ArchiveDataset(str(data_zip), extensions=".wav", decode="auto", transform=_first_channel_sum)
    blob = pickle.dumps(ds)
    assert b"cdmlfs.archive" not in blob and len(blob) < 2000
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    clone = pickle.loads(blob)
    assert float(clone.by_name("clips/four.wav")) == pytest.approx(-0.5)
    assert [round(float(x), 6) for x in loader] == [round(float(ds[i]), 6) for i in range(len(ds))]


def _first_channel_sum(sample):
    waveform, _ = sample
    return waveform[0].sum()


def _riff_wav(tag: int, channels: int, bits: int, payload: bytes, extensible: bool = False) -> bytes:
    """A WAV as other tools write it: IEEE float (3) or WAVE_FORMAT_EXTENSIBLE headers."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else tag, channels, 16000, 16000 * block, block, bits)
    if extensible:  # cbSize, valid bits, channel mask, then the sub-format GUID (tag first)
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", tag) + bytes(14)
    body = (
        b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", len(payload))
        + payload
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_wav_float_and_extensible_headers_decode() -> None:
    """Python 3.11's wave module refuses both (``unknown format: 3`` / ``65534``); torchaudio reads them."""
    floats = [[0.5, -0.25], [1.0, 0.0], [-1.0, 0.125]]
    payload = struct.pack("<6f", *(v for frame in floats for v in frame))
    arr, rate = decode_wav_numpy(_riff_wav(3, 2, 32, payload))
    assert rate == 16000 and arr.dtype == np.float32
    assert arr.tolist() == [list(c) for c in zip(*floats)]
    plain, _ = decode_wav_numpy(FILES["clips/a/one.wav"])
    pcm = struct.pack("<6h", 0, 1000, -32768, 32767, 16384, -16384)
    ext, _ = decode_wav_numpy(_riff_wav(1, 2, 16, pcm, extensible=True))
    assert np.array_equal(ext, plain)
    with pytest.raises(ValueError, match="unsupported WAV"):
        decode_wav_numpy(_riff_wav(2, 1, 16, b"\0\0"))  # MS ADPCM


def test_wav_numpy_without_torch() -> None:
    arr, rate = decode_wav_numpy(FILES["clips/a/one.wav"])
    assert isinstance(arr, np.ndarray) and arr.dtype == np.float32 and rate == 8000


def test_imports_without_torch(data_zip: Path, tmp_path: Path) -> None:
    """torch is an optional extra: cdmlfs never imports it, the datasets and sampler work without it."""
    tree = tmp_path / "t"
    for cls in ("a", "b"):
        (tree / cls).mkdir(parents=True)
        Image.new("RGB", (4, 3), (1, 2, 3)).save(tree / cls / "x.png")
    subprocess.run(["zip", "-q", "-r", str(tmp_path / "img.zip"), "."], cwd=tree, check=True)
    code = f"""
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked for this test")
sys.meta_path.insert(0, NoTorch())
import cdmlfs, cdmlfs_torch
with cdmlfs.open({str(data_zip)!r}) as ar:
    ar.read("blob.bin")
from cdmlfs_torch import ArchiveDataset, ArchiveImageFolder, ArchiveOrderSampler
wav, rate = ArchiveDataset({str(data_zip)!r}, extensions=".wav", decode="auto")[0]
assert type(wav).__module__ == "numpy", type(wav)
ds = ArchiveImageFolder({str(tmp_path / "img.zip")!r})
assert ds.classes == ["a", "b"] and ds[1][0].size == (4, 3)
assert sorted(ArchiveOrderSampler(ds, window=2, seed=1)) == [0, 1]
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
