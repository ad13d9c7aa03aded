"""``ImageFolder`` over archives: torchvision's behaviour, read straight from the archive.

Same ``classes``, ``class_to_idx``, ``samples``, ``targets``, ``imgs``, order,
extension filter, errors and overridable ``find_classes``/``make_dataset`` as
torchvision's ``DatasetFolder``/``ImageFolder``; the root may also be an
archive or a folder inside one (syntax: :mod:`cdmlfs_torch.roots`), in which
case sample paths are ``LOCATION::INNER`` and nothing goes through FUSE.
torchvision itself is not needed; where it is installed the classes subclass
its ``DatasetFolder``/``ImageFolder`` (overriding every method), so
``isinstance`` checks and helpers such as ``wrap_dataset_for_transforms_v2``
take them as torchvision's own.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from typing import Any

from cdmlfs_torch import handles
from cdmlfs_torch._compat import Dataset
from cdmlfs_torch.loaders import default_loader
from cdmlfs_torch.roots import (
    SEP,
    ArchiveTree,
    SampleNotFoundError,
    Tree,
    positions_by_archive,
    resolve_root,
    sample_errors,
    split_sample_path,
)

try:  # torchvision's classes as bases where installed (see the module docstring)
    from torchvision.datasets import DatasetFolder as _DatasetFolderBase
    from torchvision.datasets import ImageFolder as _ImageFolderBase

    _IMAGE_FOLDER_BASES: tuple[type, ...] = (_ImageFolderBase,)
except Exception:  # pragma: no cover - none, or one that fails to load (built for another torch)
    _DatasetFolderBase = Dataset  # type: ignore[misc,assignment]
    _IMAGE_FOLDER_BASES = ()

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""The extensions torchvision's ImageFolder accepts (compared case-insensitively)."""


def has_file_allowed_extension(filename: str, extensions: str | tuple[str, ...]) -> bool:
    """Whether ``filename`` ends with one of ``extensions`` (lower-case), ignoring case."""
    return filename.lower().endswith(extensions if isinstance(extensions, str) else tuple(extensions))


def is_image_file(filename: str) -> bool:
    return has_file_allowed_extension(filename, IMG_EXTENSIONS)


# The dataset whose constructor is running its hooks: they get its root as torchvision passes it
# (the path), and the module functions below then open it through the dataset, with its options.
# An overridden find_classes left the default make_dataset opening the root with none (cache size,
# S3 endpoint ignored), and the dataset without the handle that checks the archive is unchanged.
_CONSTRUCTING: contextvars.ContextVar[ArchiveDatasetFolder | None] = contextvars.ContextVar(
    "cdmlfs_torch_constructing", default=None
)


def _tree(directory: str | os.PathLike | Tree) -> Tree:
    if isinstance(directory, Tree):
        return directory
    dataset = _CONSTRUCTING.get()
    if dataset is not None and directory is dataset.root:
        return dataset.tree
    return resolve_root(directory)


def _opened_locally(exc: FileNotFoundError, path: str, who: str) -> FileNotFoundError:
    """The error for a callable that gave an archive sample path to ``open()``: says what to use."""
    return FileNotFoundError(
        exc.errno,
        f"{exc.strerror}: {who} opened an archive sample path as a local file; "
        "it must read through cdmlfs_torch.open_sample() or read_sample()",
        path,
    )


def find_classes(directory: str | os.PathLike | Tree) -> tuple[list[str], dict[str, int]]:
    """Class names (sorted sub-directories of the root, symlinks followed) and their indices."""
    tree = _tree(directory)
    classes = sorted(tree.subdirs(tree.root_path))
    if not classes:
        shown = directory.root_path if isinstance(directory, Tree) else directory
        raise FileNotFoundError(f"Couldn't find any class folder in {shown}.")
    return classes, {name: i for i, name in enumerate(classes)}


def make_dataset(
    directory: str | os.PathLike | Tree,
    class_to_idx: dict[str, int] | None = None,
    extensions: str | tuple[str, ...] | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
    allow_empty: bool = False,
) -> list[tuple[str, int]]:
    """(sample path, class index) for every valid file below each class folder.

    Order: classes by name; inside a class, directories by path, files by name
    (torchvision's ``sorted(os.walk(...))``). ``is_valid_file`` receives the
    sample path (``LOCATION::INNER`` inside archives).
    """
    tree = _tree(directory)
    if class_to_idx is None:
        _, class_to_idx = find_classes(tree)
    elif not class_to_idx:
        raise ValueError("'class_to_index' must have at least one entry to collect any samples.")
    if (extensions is None) == (is_valid_file is None):
        raise ValueError("Both extensions and is_valid_file cannot be None or not None at the same time")
    if extensions is not None:
        exts = extensions

        def is_valid_file(path: str) -> bool:
            return has_file_allowed_extension(path, exts)

    assert is_valid_file is not None
    instances: list[tuple[str, int]] = []
    found: set[str] = set()
    first: str | None = None  # the first path is_valid_file was given (shown if it took none)
    for target_class in sorted(class_to_idx):
        class_index = class_to_idx[target_class]
        target_dir = tree.join(tree.root_path, target_class)
        if not tree.isdir(target_dir):
            continue
        for dirpath, _, fnames in sorted(tree.walk(target_dir)):
            for fname in sorted(fnames):
                path = tree.join(dirpath, fname)
                first = path if first is None else first
                try:
                    valid = is_valid_file(path)
                except FileNotFoundError as exc:  # Image.open(path).verify() on "data.zip::a/b.jpg"?
                    if exc.filename != path or not isinstance(tree, ArchiveTree):
                        raise
                    raise _opened_locally(exc, path, "is_valid_file") from exc
                if valid:
                    instances.append((path, class_index))
                    found.add(target_class)
    empty = set(class_to_idx) - found
    if empty and not allow_empty:
        msg = f"Found no valid file for the classes {', '.join(sorted(empty))}. "
        if extensions is not None:
            shown = extensions if isinstance(extensions, str) else ", ".join(extensions)
            msg += f"Supported extensions are: {shown}"
        elif not instances and first is not None and isinstance(tree, ArchiveTree):
            # It took none: "Image.open(p).verify()" in a try that returns False on any error?
            msg += (
                f"is_valid_file took none of the archive's samples, given as paths such as {first!r}: "
                "if it opens them, it must use cdmlfs_torch.open_sample(path), not open() or Image.open(path)"
            )
        raise FileNotFoundError(msg)
    return instances


class _StandardTransform:
    """torchvision's ``StandardTransform`` (used when torchvision is not installed)."""

    def __init__(self, transform: Callable | None, target_transform: Callable | None) -> None:
        self.transform = transform
        self.target_transform = target_transform

    def __call__(self, sample: Any, target: Any) -> tuple[Any, Any]:
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def __repr__(self) -> str:
        body = [type(self).__name__.lstrip("_")]
        for head, fn in (("Transform: ", self.transform), ("Target transform: ", self.target_transform)):
            if fn is not None:
                lines = repr(fn).splitlines()
                body += [head + lines[0]] + [" " * len(head) + line for line in lines[1:]]
        return "\n".join(body)


def _standard_transform(transform: Callable | None, target_transform: Callable | None) -> Any:
    """The ``transforms`` attribute torchvision datasets have (None when both are None)."""
    if transform is None and target_transform is None:
        return None
    try:
        from torchvision.datasets.vision import StandardTransform
    except ImportError:
        return _StandardTransform(transform, target_transform)
    return StandardTransform(transform, target_transform)


class ArchiveDatasetFolder(_DatasetFolderBase):  # type: ignore[misc,valid-type]
    """torchvision's ``DatasetFolder`` whose root may be an archive (``data.zip::train``).

    Pickles as its root, sample list and callables: no archive handle, index
    or cache travels to DataLoader workers; each worker opens its own handle
    on its first sample (fork and spawn alike).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        loader: Callable[[str], Any],
        extensions: tuple[str, ...] | None = None,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        *,
        cache_size: int = handles.DEFAULT_CACHE_SIZE,
        open_options: dict[str, Any] | None = None,
    ) -> None:
        self.root = os.path.expanduser(root) if isinstance(root, str) else root
        self.transform = transform
        self.target_transform = target_transform
        self.transforms = _standard_transform(transform, target_transform)
        # The root is opened by the first hook that needs it (the default find_classes), not here:
        # a subclass whose hooks read a manifest instead never has its root taken for a folder.
        self._tree: Tree | None = None
        self._tree_options = {"cache_size": cache_size, **(open_options or {})}
        constructing = _CONSTRUCTING.set(self)
        try:
            classes, class_to_idx = self.find_classes(self.root)
            samples = self.make_dataset(
                self.root,
                class_to_idx=class_to_idx,
                extensions=extensions,
                is_valid_file=is_valid_file,
                allow_empty=allow_empty,
            )
        finally:
            _CONSTRUCTING.reset(constructing)
        self.loader = loader
        self.extensions = extensions
        self.classes = classes
        self.class_to_idx = class_to_idx
        self.samples = samples
        self.targets = [s[1] for s in samples]

    @staticmethod
    def make_dataset(
        directory: str | os.PathLike,
        class_to_idx: dict[str, int],
        extensions: tuple[str, ...] | None = None,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
    ) -> list[tuple[str, int]]:
        """Override to change which files are samples (torchvision's hook, same arguments)."""
        if class_to_idx is None:
            # An overridden find_classes must not be bypassed by make_dataset's own default.
            raise ValueError("The class_to_idx parameter cannot be None.")
        return make_dataset(
            directory,
            class_to_idx,
            extensions=extensions,
            is_valid_file=is_valid_file,
            allow_empty=allow_empty,
        )

    @property
    def tree(self) -> Tree:
        """The root, opened on first use (a directory, or a folder of an archive)."""
        if self._tree is None:
            self._tree = resolve_root(self.root, **self._tree_options)
        return self._tree

    def find_classes(self, directory: str | os.PathLike) -> tuple[list[str], dict[str, int]]:
        """Override to change what a class is (torchvision's hook, same arguments).

        Like torchvision's, it needs no constructed dataset: a subclass may call it before
        ``super().__init__`` (to pick classes, say), which opens ``directory`` on its own.
        """
        if directory is not getattr(self, "root", None) or "_tree_options" not in vars(self):
            return find_classes(directory)
        tree = self.tree  # a missing root is its own error, not "no class folder"
        try:
            return find_classes(tree)
        except FileNotFoundError:  # name the root as it was given, like torchvision
            raise FileNotFoundError(f"Couldn't find any class folder in {self.root}.") from None

    @property
    def root_path(self) -> str:
        """The root as sample paths start: a directory, or ``LOCATION::FOLDER``."""
        return self.tree.root_path

    def relpath(self, index: int) -> str:
        """Path of sample ``index`` relative to the root (what ``os.path.relpath`` gives on disk)."""
        return self.tree.relpath(self.samples[index][0])

    def archive_positions(self) -> list[int]:
        """Per sample, where its bytes lie in the archive: :class:`ArchiveOrderSampler` reads this.

        Samples a subclass's hooks listed (from a manifest, say) never had the root opened, and
        may lie in other archives than the root: they are ranked archive by archive.
        """
        paths = [path for path, _ in self.samples]
        if isinstance(self._tree, ArchiveTree):
            return self._tree.archive_positions(paths)
        return positions_by_archive(paths, **self._tree_options)

    def extract(self, index: int, dest: str | os.PathLike) -> str:
        """Copy sample ``index`` to ``dest/<relative path>`` to look at it; returns the file's path."""
        return self.tree.extract(self.samples[index][0], os.fspath(dest))

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        path, target = self.samples[index]
        if isinstance(self._tree, ArchiveTree):  # None: the subclass's hooks never opened the root
            with sample_errors(path):  # an archive gone by then: an OSError like any sample's
                archive = self._tree.archive  # this process's handle, opened with this dataset's options
            try:
                with handles.reading_from(self._tree.location, archive):  # the version we listed
                    sample = self.loader(path)
            except FileNotFoundError as exc:
                # Only an archive sample opened as a local file gets the hint; a plain local path
                # the user added to samples keeps the OS's own error.
                local = split_sample_path(path) is None
                if exc.filename != path or isinstance(exc, SampleNotFoundError) or local:
                    raise
                raise _opened_locally(exc, path, "the loader") from exc
        else:
            if SEP in path:  # an archive's sample the loader opens by its location alone
                split = split_sample_path(path)
                if split is not None:  # with this dataset's options, not the defaults (see handles)
                    handles.remember_options(split[0], self._tree_options)
            sample = self.loader(path)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def __len__(self) -> int:
        return len(self.samples)

    def extra_repr(self) -> str:
        """Override to add lines to ``repr`` (torchvision's hook: "Split: train", ...)."""
        return ""

    def __repr__(self) -> str:
        """torchvision's ``VisionDataset`` layout, line for line."""
        body = [f"Number of datapoints: {len(self)}", f"Root location: {self.root}"]
        body += self.extra_repr().splitlines()
        if self.transforms is not None:
            body.append(repr(self.transforms))  # one item: only its first line is indented
        indent = " " * getattr(self, "_repr_indent", 4)  # torchvision's attribute, for subclasses
        return "\n".join([f"Dataset {type(self).__name__}"] + [indent + line for line in body])


class ArchiveImageFolder(ArchiveDatasetFolder, *_IMAGE_FOLDER_BASES):  # type: ignore[misc]
    """torchvision's ``ImageFolder`` whose root may be an archive or a folder inside one.

    ``root``: a directory (a cdmlfs mount too), ``data.zip``, ``data.zip::train``,
    ``data.zip/train`` or ``s3://bucket/data.zip::train``. The default loader
    decodes with PIL from the archive bytes and converts to RGB. Samples are
    ``(LOCATION::INNER, class_index)`` inside archives, ordinary paths for a directory.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        loader: Callable[[str], Any] = default_loader,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        *,
        cache_size: int = handles.DEFAULT_CACHE_SIZE,
        open_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            root,
            loader,
            IMG_EXTENSIONS if is_valid_file is None else None,
            transform=transform,
            target_transform=target_transform,
            is_valid_file=is_valid_file,
            allow_empty=allow_empty,
            cache_size=cache_size,
            open_options=open_options,
        )
        self.imgs = self.samples
