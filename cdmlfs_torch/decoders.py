"""Bytes -> Python objects, chosen by file extension, for :class:`ArchiveDataset`.

Each decoder takes the member's bytes and returns one sample. Only the standard
library, PIL and numpy are used (each imported when first needed), so a
dataset of text or JSON needs neither of the latter.
"""

from __future__ import annotations

import csv
import io
import json
import posixpath
import struct
from collections.abc import Callable, Mapping
from typing import Any

Decoder = Callable[[bytes], Any]


def decode_image(data: bytes) -> Any:
    """A fully decoded PIL image in its own mode (no RGB conversion: masks stay single-channel)."""
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def decode_text(data: bytes) -> str:
    """UTF-8 text (a BOM is dropped)."""
    return data.decode("utf-8-sig")


def decode_json(data: bytes) -> Any:
    return json.loads(data)


def decode_jsonl(data: bytes) -> list[Any]:
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def decode_csv(data: bytes) -> list[list[str]]:
    """Rows as lists of strings (the header, if any, is row 0)."""
    return list(csv.reader(io.StringIO(decode_text(data), newline="")))


def decode_npy(data: bytes) -> Any:
    """A numpy array; pickled object arrays are refused (loading them can run code)."""
    import numpy as np

    return np.load(io.BytesIO(data), allow_pickle=False)


def decode_npz(data: bytes) -> dict[str, Any]:
    import numpy as np

    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


_WAV_SCALE = {1: 128.0, 2: 32768.0, 3: 8388608.0, 4: 2147483648.0}
_WAV_PCM, _WAV_FLOAT, _WAV_EXTENSIBLE = 1, 3, 0xFFFE


def _wav_chunks(data: bytes) -> tuple[bytes, memoryview]:
    """The ``fmt `` and ``data`` chunks of a RIFF/WAVE file (the stdlib ``wave`` reads PCM only)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    fmt = None
    pos = 12
    view = memoryview(data)
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = view[pos + 8 : pos + 8 + size]
        if cid == b"fmt ":
            fmt = bytes(body)
        elif cid == b"data":
            if fmt is None:
                raise ValueError("WAV data chunk before its fmt chunk")
            return fmt, body
        pos += 8 + size + (size & 1)  # chunks are padded to even sizes
    raise ValueError("WAV file has no data chunk")


def decode_wav_numpy(data: bytes) -> tuple[Any, int]:
    """``.wav`` -> (float32 array of shape (channels, frames), sample rate).

    The layout and scaling are torchaudio's ``load`` defaults, so models fed by
    either see the same numbers: integer PCM is scaled to [-1, 1) (8-bit PCM is
    unsigned, wider PCM signed little-endian; 24-bit samples are widened to 32
    bits before scaling); IEEE float samples are kept as they are. Plain and
    ``WAVE_FORMAT_EXTENSIBLE`` headers are read.
    """
    import numpy as np

    fmt, raw = _wav_chunks(data)
    if len(fmt) < 16:
        raise ValueError("WAV fmt chunk is truncated")
    tag, channels, rate, _, block, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _WAV_EXTENSIBLE:
        if len(fmt) < 26:
            raise ValueError("WAV extensible fmt chunk is truncated")
        tag = struct.unpack_from("<H", fmt, 24)[0]  # the sub-format GUID starts with the format tag
    if channels < 1 or block < channels:
        raise ValueError(f"WAV header is inconsistent ({channels} channels, {block}-byte frames)")
    width = block // channels
    raw = raw[: len(raw) - len(raw) % block]
    if tag == _WAV_FLOAT and width in (4, 8):
        samples = np.frombuffer(raw, dtype="<f4" if width == 4 else "<f8").astype(np.float32)
    elif tag == _WAV_PCM and width in _WAV_SCALE and bits <= 8 * width:
        if width == 1:
            samples = np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0
        elif width == 2:
            samples = np.frombuffer(raw, dtype="<i2").astype(np.float32)
        elif width == 3:
            b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3)
            wide = np.zeros((b.shape[0], 4), dtype=np.uint8)
            wide[:, 1:] = b  # little-endian: the 3 bytes become the high bytes of an int32
            samples = wide.view("<i4").reshape(-1).astype(np.float32) / 256.0
        else:
            samples = np.frombuffer(raw, dtype="<i4").astype(np.float32)
        samples /= _WAV_SCALE[width]
    else:
        raise ValueError(f"unsupported WAV encoding: format {tag:#x}, {width}-byte samples")
    return samples.reshape(-1, channels).T.copy(), rate


def decode_wav(data: bytes) -> tuple[Any, int]:
    """Like :func:`decode_wav_numpy`, as a torch tensor when torch is importable."""
    waveform, rate = decode_wav_numpy(data)
    try:
        import torch
    except ImportError:
        return waveform, rate
    return torch.from_numpy(waveform), rate


DEFAULT_DECODERS: dict[str, Decoder] = {
    **{
        ext: decode_image
        for ext in (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif")
    },
    ".wav": decode_wav,
    ".txt": decode_text,
    ".json": decode_json,
    ".jsonl": decode_jsonl,
    ".csv": decode_csv,
    ".npy": decode_npy,
    ".npz": decode_npz,
}


def decoder_for(path: str, table: Mapping[str, Decoder] = DEFAULT_DECODERS) -> Decoder | None:
    """The decoder for ``path``'s extension (case-insensitive), or None to keep the bytes."""
    ext = posixpath.splitext(path.rpartition("::")[2])[1].lower()
    return table.get(ext)
