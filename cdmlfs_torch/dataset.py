"""``ArchiveDataset``: every file below a root (archive folder or directory) as a sample.

For data that is not an image classification tree: audio clips, JSON
annotations, ``.npy`` features, or raw bytes for a custom decoder. Items are
the member's bytes by default; ``decode="auto"`` picks a decoder by extension
(:mod:`cdmlfs_torch.decoders`). ``by_name`` and ``extract`` exist so that a
sample that breaks a training run can be looked at by hand.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

from cdmlfs_torch import handles
from cdmlfs_torch._compat import Dataset
from cdmlfs_torch.decoders import DEFAULT_DECODERS, Decoder, decoder_for
from cdmlfs_torch.globmatch import glob_match
from cdmlfs_torch.roots import resolve_root

DecodeSpec = None | str | Decoder | Mapping[str, Decoder]


class ArchiveDataset(Dataset):
    """Files below ``root`` sorted by path, optionally filtered, decoded on access.

    Args:
        root: a directory, ``data.zip``, ``data.zip::folder`` or an archive URI
            (syntax: :mod:`cdmlfs_torch.roots`).
        extensions: keep files ending with one of these (case-insensitive), e.g. ``(".wav",)``.
        glob: keep files whose path relative to ``root`` matches, e.g. ``"clips/**/*.wav"``
            (:mod:`cdmlfs_torch.globmatch`); several patterns may be given as a tuple.
        is_valid_file: keep files for which this returns True (receives the sample path).
        decode: ``None`` for raw bytes; ``"auto"`` for a decoder by extension (unknown
            extensions stay bytes); a mapping of extension -> decoder, merged over the
            automatic ones; or one callable ``bytes -> sample`` for every file.
        transform: applied to the decoded sample.
        return_path: items are ``(relative path, sample)`` instead of ``sample``.
        allow_empty: an empty selection is an error unless this is True.

    Attributes: ``paths`` (relative to root, what :meth:`by_name` takes) and
    ``samples`` (full sample paths, ``LOCATION::INNER`` inside archives).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        extensions: str | tuple[str, ...] | None = None,
        glob: str | tuple[str, ...] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        decode: DecodeSpec = None,
        transform: Callable[[Any], Any] | None = None,
        return_path: bool = False,
        allow_empty: bool = False,
        cache_size: int = handles.DEFAULT_CACHE_SIZE,
        open_options: dict[str, Any] | None = None,
    ) -> None:
        self.root = os.path.expanduser(root) if isinstance(root, str) else root
        self.tree = resolve_root(self.root, cache_size=cache_size, **(open_options or {}))
        self.transform = transform
        self.return_path = return_path
        self._decode_one, self._decode_table = _decode_plan(decode)
        exts = (
            None
            if extensions is None
            else tuple(e.lower() for e in ((extensions,) if isinstance(extensions, str) else extensions))
        )
        globs = None if glob is None else ((glob,) if isinstance(glob, str) else tuple(glob))
        self.samples: list[str] = []
        self.paths: list[str] = []
        for path in self.tree.files():
            rel = self.tree.relpath(path)
            if exts is not None and not rel.lower().endswith(exts):
                continue
            if globs is not None and not any(glob_match(rel, g) for g in globs):
                continue
            if is_valid_file is not None and not is_valid_file(path):
                continue
            self.samples.append(path)
            self.paths.append(rel)
        if not self.samples and not allow_empty:
            raise FileNotFoundError(f"Found no files matching the selection in {self.tree.root_path}.")
        self._index_of: dict[str, int] | None = None

    # -- pickling: the name lookup is rebuilt on demand, never shipped to workers
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_index_of"] = None
        return state

    def __len__(self) -> int:
        return len(self.samples)

    def relpath(self, index: int) -> str:
        """Path of sample ``index`` relative to the root (what ``os.path.relpath`` gives on disk)."""
        return self.tree.relpath(self.samples[index])

    def read_bytes(self, index: int) -> bytes:
        """The raw bytes of sample ``index`` (nothing decoded)."""
        return self.tree.read(self.samples[index])

    def decode(self, index: int, data: bytes) -> Any:
        """Decode bytes the way this dataset does for sample ``index``."""
        if self._decode_one is not None:
            return self._decode_one(data)
        if self._decode_table is not None:
            fn = decoder_for(self.paths[index], self._decode_table)
            if fn is not None:
                return fn(data)
        return data

    def __getitem__(self, index: int) -> Any:
        sample = self.decode(index, self.read_bytes(index))
        if self.transform is not None:
            sample = self.transform(sample)
        return (self.paths[index], sample) if self.return_path else sample

    def index_of(self, path: str) -> int:
        """Index of a sample given its relative path (or its full sample path); KeyError if absent."""
        if self._index_of is None:
            self._index_of = {p: i for i, p in enumerate(self.paths)}
        key = path
        if key not in self._index_of and key.startswith(self.tree.root_path):
            with contextlib.suppress(ValueError):
                key = self.tree.relpath(key)
        index = self._index_of.get(key.strip("/"))
        if index is None:
            raise KeyError(f"{path!r}: no such sample in {self.tree.root_path}")
        return index

    def by_name(self, path: str) -> Any:
        """The item for a relative path, as ``dataset[i]`` returns it."""
        return self[self.index_of(path)]

    def extract(self, index: int, dest: str | os.PathLike) -> str:
        """Copy sample ``index`` to ``dest/<relative path>`` to inspect it; returns the file's path."""
        return self.tree.extract(self.samples[index], os.fspath(dest))

    def archive_positions(self) -> list[int]:
        """Per sample, where its bytes lie in the archive (:class:`ArchiveOrderSampler` reads this)."""
        return self.tree.archive_positions(self.samples)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tree.root_path!r}, {len(self)} samples)"


def _decode_plan(decode: DecodeSpec) -> tuple[Decoder | None, Mapping[str, Decoder] | None]:
    """(one decoder for everything, or a table by extension); both None keeps raw bytes."""
    if decode is None:
        return None, None
    if isinstance(decode, str):
        if decode != "auto":
            raise ValueError(f"decode must be None, 'auto', a callable or a mapping, not {decode!r}")
        return None, DEFAULT_DECODERS
    if isinstance(decode, Mapping):
        return None, {**DEFAULT_DECODERS, **{k.lower(): v for k, v in decode.items()}}
    if callable(decode):
        return decode, None
    raise TypeError(f"decode must be None, 'auto', a callable or a mapping, not {type(decode).__name__}")
