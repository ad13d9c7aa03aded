"""Read a sample path, wherever it lives: ``LOCATION::INNER`` from an archive, else a local file.

Loaders take a path, as torchvision loaders do, so a custom loader written for
``ImageFolder`` only has to swap ``open(path, "rb")`` for :func:`open_sample`.
"""

from __future__ import annotations

import functools
import io
import os
import sys
from typing import Any, BinaryIO

from cdmlfs_torch import handles
from cdmlfs_torch.roots import open_local_file, read_local_file, sample_errors, split_sample_path


def read_sample(path: str | os.PathLike) -> bytes:
    """All bytes of a sample (one call into the archive: no FUSE, no file object)."""
    text = os.fspath(path)
    split = split_sample_path(text)
    if split is None:
        return read_local_file(text)
    location, inner = split
    with sample_errors(text):
        return handles.handle_for(location).read(inner)


def open_sample(path: str | os.PathLike) -> BinaryIO:
    """A seekable binary file object over a sample (archive member or local file)."""
    text = os.fspath(path)
    split = split_sample_path(text)
    if split is None:
        return open_local_file(text)
    location, inner = split
    with sample_errors(text):
        return handles.handle_for(location).open(inner)


def pil_loader(path: str | os.PathLike) -> Any:
    """Decode an image with PIL and convert it to RGB, like torchvision's ``pil_loader``.

    The whole member is read in one call and decoded from memory: images are
    small, and one read beats PIL's many small reads through a file object.
    """
    return _pil_rgb(read_sample(path), path)


def _pil_rgb(data: bytes, path: str | os.PathLike) -> Any:
    """``data`` (the bytes of sample ``path``) decoded by PIL, in RGB; an unreadable one's error names it."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as exc:  # name the sample, as PIL does for a file opened by path
        raise UnidentifiedImageError(f"cannot identify image file {os.fspath(path)!r}") from exc
    with img:
        return img.convert("RGB")


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_BIT_DEPTH_AT = 24  # signature, IHDR length and type, width, height: then the bit depth


def _torchvision_decodes(head: bytes) -> bool:
    """JPEG, 8-bit PNG and WebP: what ``torchvision.io.decode_image`` gives as PIL's loader does.

    16-bit PNGs are left to PIL: ``convert("RGB")`` clips grey levels at 255 and keeps
    the high byte of colour ones, and the two loaders must give the same pixels. So are
    GIFs: torchvision colours a transparent palette index otherwise than PIL does.
    """
    if head.startswith(PNG_SIGNATURE):
        return len(head) > PNG_BIT_DEPTH_AT and head[PNG_BIT_DEPTH_AT] <= 8
    return head.startswith(b"\xff\xd8\xff") or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


@functools.cache
def _torchvision_decoder() -> tuple[Any, Any]:
    """torchvision's ``decode_image`` and its RGB mode, or ``(None, None)`` where torchvision no
    longer decodes images (deprecated in 0.29, to move to torchcodec): PIL decodes them all then."""
    try:
        from torchvision.io import ImageReadMode, decode_image
    except ImportError:
        return None, None
    return decode_image, ImageReadMode.RGB


def tensor_loader(path: str | os.PathLike) -> Any:
    """Decode an image into a uint8 ``C,H,W`` RGB tensor, for ``torchvision.transforms.v2`` pipelines.

    JPEG, 8-bit PNG and WebP go through ``torchvision.io.decode_image`` (for JPEG,
    libjpeg-turbo straight into a tensor, skipping PIL's image object and its
    conversions: a RandomResizedCrop + flip pipeline then costs about 1.1 ms of
    CPU per ImageNet-sized JPEG instead of 1.8 ms with PIL, which is what keeps a
    fast GPU fed when decoding is the bottleneck). The other formats (BMP, TIFF,
    PPM/PGM, GIF, 16-bit PNG), and files torchvision refuses but PIL reads (an
    animated WebP: its first frame), are decoded by PIL and converted, so any tree
    that ``ImageFolder`` accepts works, with the pixels the default loader gives.
    """
    import torch

    data = read_sample(path)
    decode_image, rgb_mode = _torchvision_decoder()
    if decode_image is not None and _torchvision_decodes(data[: PNG_BIT_DEPTH_AT + 1]):
        try:
            return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=rgb_mode)
        except RuntimeError as exc:
            try:  # what the default loader makes of it (an animated WebP: its first frame)
                rgb = _pil_rgb(data, path)
            except OSError:  # an OSError, as PIL gives: loops that skip bad samples catch that
                raise OSError(f"cannot decode image file {os.fspath(path)!r}: {exc}") from exc
    else:
        rgb = _pil_rgb(data, path)
    import numpy as np

    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1).contiguous()


def default_loader(path: str | os.PathLike) -> Any:
    """torchvision's ``default_loader``: PIL, or accimage for local files when torchvision's image
    backend is set to it (``torchvision.set_image_backend("accimage")``); accimage reads only paths
    on disk, so archive samples always go through PIL."""
    tv = sys.modules.get("torchvision")  # set_image_backend is only ever called after importing it
    if tv is not None and tv.get_image_backend() == "accimage" and split_sample_path(path) is None:
        from torchvision.datasets.folder import accimage_loader

        return accimage_loader(os.fspath(path))
    return pil_loader(path)
