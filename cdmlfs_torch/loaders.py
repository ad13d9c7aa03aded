"""Read a sample path, wherever it lives: ``LOCATION::INNER`` from an archive, else a local file.

Loaders take a path, as torchvision loaders do, so a custom loader written for
``ImageFolder`` only has to swap ``open(path, "rb")`` for :func:`open_sample`.
"""

from __future__ import annotations

import io
import os
from typing import Any, BinaryIO

from cdmlfs_torch import handles
from cdmlfs_torch.roots import split_sample_path


def read_sample(path: str | os.PathLike) -> bytes:
    """All bytes of a sample (one call into the archive: no FUSE, no file object)."""
    text = os.fspath(path)
    split = split_sample_path(text)
    if split is None:
        with open(text, "rb") as f:
            return f.read()
    location, inner = split
    return handles.get_archive(location).read(inner)


def open_sample(path: str | os.PathLike) -> BinaryIO:
    """A seekable binary file object over a sample (archive member or local file)."""
    text = os.fspath(path)
    split = split_sample_path(text)
    if split is None:
        return open(text, "rb")
    location, inner = split
    return handles.get_archive(location).open(inner)


def pil_loader(path: str | os.PathLike) -> Any:
    """Decode an image with PIL and convert it to RGB, like torchvision's ``pil_loader``.

    The whole member is read in one call and decoded from memory: images are
    small, and one read beats PIL's many small reads through a file object.
    """
    from PIL import Image

    with Image.open(io.BytesIO(read_sample(path))) as img:
        return img.convert("RGB")


default_loader = pil_loader
