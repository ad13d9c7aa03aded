"""cdmlfs_torch: PyTorch datasets, a sampler and a GPU prefetcher over cdmlfs archives.

Read straight from ZIP (tar.zst, S3: whatever ``cdmlfs.open`` accepts) without
FUSE, in DataLoader workers under fork or spawn::

    from cdmlfs_torch import ArchiveImageFolder, ArchiveOrderSampler, GPUPrefetchLoader

    ds = ArchiveImageFolder("imagenet.zip::train", transform=...)
    sampler = ArchiveOrderSampler(ds, window=4096, seed=0)
    loader = GPUPrefetchLoader(DataLoader(ds, 256, sampler=sampler, num_workers=8, pin_memory=True),
                               mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))

Importing this package imports neither torch nor PIL; each name loads its
module on first use, and only ``GPUPrefetchLoader`` needs torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ArchiveImageFolder": "cdmlfs_torch.folder",
    "ArchiveDatasetFolder": "cdmlfs_torch.folder",
    "IMG_EXTENSIONS": "cdmlfs_torch.folder",
    "find_classes": "cdmlfs_torch.folder",
    "make_dataset": "cdmlfs_torch.folder",
    "has_file_allowed_extension": "cdmlfs_torch.folder",
    "ArchiveDataset": "cdmlfs_torch.dataset",
    "ArchiveOrderSampler": "cdmlfs_torch.sampler",
    "GPUPrefetchLoader": "cdmlfs_torch.prefetch",
    "read_sample": "cdmlfs_torch.loaders",
    "open_sample": "cdmlfs_torch.loaders",
    "pil_loader": "cdmlfs_torch.loaders",
    "tensor_loader": "cdmlfs_torch.loaders",
    "default_loader": "cdmlfs_torch.loaders",
    "split_sample_path": "cdmlfs_torch.roots",
    "resolve_root": "cdmlfs_torch.roots",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cdmlfs_torch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
