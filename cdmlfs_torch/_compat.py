"""Base classes that exist with or without torch.

torch is an optional extra: the datasets and the sampler are useful (and
tested) as plain Python objects, and a DataLoader accepts any object with
``__getitem__``/``__len__`` or ``__iter__``. When torch is importable we still
subclass its ``Dataset``/``Sampler`` so ``isinstance`` checks and ``ds1 + ds2``
(ConcatDataset) keep working.
"""

from __future__ import annotations

from typing import Any

try:  # pragma: no cover - exercised by whichever environment runs the tests
    from torch.utils.data import Dataset as _Dataset
    from torch.utils.data import Sampler as _Sampler

    HAVE_TORCH = True
except ImportError:  # pragma: no cover
    HAVE_TORCH = False

    class _Dataset:  # type: ignore[no-redef]
        """Stand-in for ``torch.utils.data.Dataset`` when torch is absent."""

        def __class_getitem__(cls, item: Any) -> type:
            return cls

    class _Sampler:  # type: ignore[no-redef]
        """Stand-in for ``torch.utils.data.Sampler`` when torch is absent."""

        def __init__(self, data_source: Any = None) -> None:
            pass

        def __class_getitem__(cls, item: Any) -> type:
            return cls


Dataset = _Dataset
Sampler = _Sampler

__all__ = ["HAVE_TORCH", "Dataset", "Sampler"]
