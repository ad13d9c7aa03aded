"""``GPUPrefetchLoader``: batches reach the GPU while the previous step computes.

What happens to each batch on CUDA:

1. It comes from the wrapped loader, ideally already in pinned memory
   (``DataLoader(pin_memory=True)`` pins in a background thread; unpinned
   tensors are pinned here, on the consumer's thread).
2. On a side stream: a ``non_blocking`` host-to-device copy, then, for uint8
   images (4-D ``N,C,H,W`` by default), conversion to float and
   ``(x / 255 - mean) / std`` — on the GPU, where it is nearly free and the
   copy moves a quarter of the bytes of a float batch.
3. An event recorded on the side stream marks the batch ready. ``prefetch``
   batches are kept in flight ahead of the consumer.
4. When the consumer takes the batch, its current stream waits for that
   event (on the GPU, not the host), and every tensor handed out gets
   ``record_stream(consumer stream)``: the memory was allocated on the side
   stream, and without this the caching allocator could give it to the next
   copy as soon as the consumer drops the tensor, while kernels reading it
   are still queued.

Without CUDA (or with ``device="cpu"``) it is a transparent pass-through that
applies the same normalisation on the CPU, so the arithmetic is tested on any
machine. Batches may be tensors or any nesting of tuples, named tuples,
lists and dicts; other leaves pass through untouched.
"""

from __future__ import annotations

import copy
import functools
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from cdmlfs_torch.metrics import LoaderMetrics


def default_is_image(t: torch.Tensor) -> bool:
    """uint8 and 4-D: a batch of images, channels in dim 1 (``N,C,H,W``)."""
    return t.dtype == torch.uint8 and t.dim() == 4


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in a nested batch, keeping the container types."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(map_tensors(b, fn) for b in batch))
    if isinstance(batch, tuple):
        return tuple(map_tensors(b, fn) for b in batch)
    if isinstance(batch, list):
        return [map_tensors(b, fn) for b in batch]
    if isinstance(batch, Mapping):
        mapped = {k: map_tensors(v, fn) for k, v in batch.items()}
        try:  # as DataLoader's collate and pin_memory do: a defaultdict stays one, factory and all
            clone = copy.copy(batch)
            clone.update(mapped)  # type: ignore[attr-defined]
            return clone
        except (AttributeError, TypeError):  # a read-only Mapping: built from the items, else a dict
            try:
                return type(batch)(mapped)
            except TypeError:
                return mapped
    return batch


def _channel_stat(value: Sequence[float] | float | None) -> torch.Tensor | None:
    """mean or std as a ``1, C, 1, 1`` float32 tensor: a number (every channel), a sequence, an
    iterable, an array or a tensor, as torchvision's Normalize takes them."""
    if value is None:
        return None
    if not isinstance(value, (int, float, torch.Tensor)) and not hasattr(value, "__array__"):
        value = list(value)  # a generator too
    return torch.as_tensor(value, dtype=torch.float32).reshape(1, -1, 1, 1)


def _tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a nested batch, read only (no container is rebuilt)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (tuple, list)):
        for b in batch:
            yield from _tensors_in(b)
    elif isinstance(batch, Mapping):
        for b in batch.values():
            yield from _tensors_in(b)


class GPUPrefetchLoader:
    """Wraps a loader: batches arrive on ``device``, uint8 images normalised, copies overlapped.

    Args:
        loader: any iterable of batches (usually a ``DataLoader``, best with ``pin_memory=True``).
        device: target device; CUDA unavailable or ``"cpu"`` means a CPU pass-through.
        prefetch: batches in flight ahead of the consumer (at least 1).
        mean, std: per-channel, in 0..1 units (torchvision's ImageNet values work as they are);
            images become ``(x / 255 - mean) / std``. Without them just ``x / 255``.
        channels_last: images come out in ``torch.channels_last`` memory format.
        dtype: floating type of normalised images (computed in float32, then cast).
        is_image: which tensors are images to normalise (default: uint8, 4-D).

    ``len()`` is the wrapped loader's; each ``iter()`` is a fresh pass (a new
    epoch of the wrapped loader). :meth:`metrics` describes the latest pass.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: str | torch.device = "cuda",
        prefetch: int = 2,
        mean: Sequence[float] | float | None = None,
        std: Sequence[float] | float | None = None,
        channels_last: bool = False,
        dtype: torch.dtype = torch.float32,
        is_image: Callable[[torch.Tensor], bool] = default_is_image,
    ) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, not {prefetch}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating type, not {dtype}")
        self.loader = loader
        requested = torch.device(device)
        self.use_cuda = requested.type == "cuda" and torch.cuda.is_available()
        if self.use_cuda and requested.index is None:
            requested = torch.device("cuda", torch.cuda.current_device())
        # Where batches are copied (None: they stay where they are, the CPU pass-through)...
        self._copy_to = requested if self.use_cuda or requested.type not in ("cuda", "cpu") else None
        # ...and where they come out, for `x.to(loader.device)` (it was None on the CPU).
        self.device = self._copy_to or torch.device("cpu")
        self.prefetch = prefetch
        self.channels_last = channels_last
        self.dtype = dtype
        self.is_image = is_image
        self._mean = _channel_stat(mean)
        self._std = _channel_stat(std)
        if (
            self._mean is not None
            and self._std is not None
            and 1 not in (self._mean.numel(), self._std.numel())
            and self._mean.numel() != self._std.numel()
        ):
            raise ValueError("mean and std must have the same number of channels (or one value)")
        if self._std is not None and bool((self._std == 0).any()):  # torchvision's Normalize refuses it too
            raise ValueError(
                "std evaluated to zero after conversion to torch.float32, leading to division by zero."
            )
        self._stats: dict[torch.device | None, tuple[Any, Any, Any]] = {}
        self._images_seen = mean is None and std is None  # nothing to check without them
        self._range_seen = False  # the values of the first non-uint8 images is_image accepted (see below)
        self._stream: torch.cuda.Stream | None = None
        self._metrics = LoaderMetrics()

    # -- wrapped loader's face -------------------------------------------------
    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        """``sampler``, ``dataset``, ``batch_size``… of the wrapped loader."""
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        self._metrics = LoaderMetrics()
        if self.use_cuda:
            return _CudaPrefetchIterator(self, self._metrics)
        return _PassThroughIterator(self, self._metrics)

    def metrics(self) -> dict[str, Any]:
        """Consumer waits and throughput of the latest pass (see :class:`LoaderMetrics`)."""
        return self._metrics.as_dict()

    @property
    def wait_times(self) -> list[float]:
        """Seconds the consumer waited for each batch of the latest pass."""
        return list(self._metrics.waits)

    # -- conversion --------------------------------------------------------------
    def _stats_on(self, device: torch.device | None) -> tuple[Any, Any, Any]:
        """mean, std and the 255 to divide by, on ``device`` (None: the CPU).

        255 is a tensor on the images' device: divided by a Python number, CUDA multiplies by
        its reciprocal, which differs from the CPU's true division (by up to 6e-8).
        """
        if device not in self._stats:
            move = (lambda t: t) if device is None else (lambda t: t.to(device))
            self._stats[device] = (
                None if self._mean is None else move(self._mean),
                None if self._std is None else move(self._std),
                255 if device is None else torch.tensor(255.0, device=device),
            )
        return self._stats[device]

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``N,C,H,W`` (or one ``C,H,W`` image, for an ``is_image`` that accepts those)
        -> ``(x / 255 - mean) / std`` in ``dtype``, on the images' device."""
        if images.dim() not in (3, 4):
            raise ValueError(
                f"images to normalise must be N,C,H,W or C,H,W; is_image accepted a tensor of shape "
                f"{tuple(images.shape)}"
            )
        mean, std, scale = self._stats_on(images.device if images.device.type != "cpu" else None)
        channels = images.shape[-3]
        for name, stat in (("mean", mean), ("std", std)):
            if stat is not None and stat.numel() not in (1, channels):  # one value: all channels
                raise ValueError(f"{name} has {stat.numel()} values but the images have {channels} channels")
        if images.dim() == 3:  # stats are 1,C,1,1: as C,1,1 they broadcast over one image's channels
            mean = None if mean is None else mean.reshape(-1, 1, 1)
            std = None if std is None else std.reshape(-1, 1, 1)
        fmt = torch.channels_last if self.channels_last and images.dim() == 4 else torch.preserve_format
        out = images.to(torch.float32, memory_format=fmt, copy=True)  # never the caller's tensor
        out.div_(scale)
        if mean is not None:
            out.sub_(mean)
        if std is not None:
            out.div_(std)
        return out if self.dtype == torch.float32 else out.to(self.dtype)

    def _check_images(self, batch: Any) -> None:
        """Warn once when mean/std were given but batches hold no image ``is_image`` accepts.

        The usual cause: a transform ending in ``ToTensor()`` makes float images, which are left
        as they are, so training would see un-normalised inputs without a word.
        """
        if not self._range_seen:
            self._range_seen = True
            self._check_range([t for t in _tensors_in(batch) if t.dtype != torch.uint8 and self.is_image(t)])
        if self._images_seen:
            return
        self._images_seen = True  # the first batch tells: its layout is every batch's
        leaves = list(_tensors_in(batch))
        if any(self.is_image(t) for t in leaves):
            return
        unconverted = {t.dtype for t in leaves if t.dim() == 4 and t.dtype not in (torch.uint8, torch.bool)}
        if any(dtype.is_floating_point for dtype in unconverted):
            warnings.warn(
                "GPUPrefetchLoader: mean/std were given, but the batches hold float images, which are "
                "passed through unchanged (only uint8 N,C,H,W images are normalised): end the transform "
                "with PILToTensor()/v2.ToImage() instead of ToTensor(), or normalise in the transform",
                stacklevel=3,
            )
        elif unconverted:  # 16-bit images, say: scaled by 255 they would be wrong anyway
            kinds = ", ".join(sorted(str(dtype).removeprefix("torch.") for dtype in unconverted))
            warnings.warn(
                f"GPUPrefetchLoader: mean/std were given, but the batches hold {kinds} N,C,H,W tensors, "
                "which are passed through unchanged (only uint8 images are normalised): convert them "
                "to uint8 in the transform, or normalise there",
                stacklevel=3,
            )

    @staticmethod
    def _check_range(images: list[torch.Tensor]) -> None:
        """Warn once when an ``is_image`` that accepts other types than uint8 gave images whose values
        are not 0..255: all of them divided by 255, ``ToTensor()``'s floats in [0, 1] came out as
        about -2 after ImageNet stats, and 16-bit ones as up to 250, and training went on."""
        for t in images:
            if not t.numel():
                continue
            low, high = float(t.min()), float(t.max())  # the first batch's only: on the host, before the copy
            if t.is_floating_point() and high <= 1.0:
                why = f"float values within [{low:g}, {high:g}] (ToTensor()'s range, already divided by 255)"
            elif high > 255 or low < 0:
                why = f"values within [{low:g}, {high:g}]"
            else:
                continue
            warnings.warn(
                f"GPUPrefetchLoader: is_image accepted {str(t.dtype).removeprefix('torch.')} images with "
                f"{why}; images are taken as 0..255 values and divided by 255: make them uint8 in the "
                "transform (PILToTensor()/v2.ToImage()), or normalise there and leave them out of is_image",
                stacklevel=4,
            )
            return

    def _convert(self, t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
        """One tensor: to ``device`` (None: stay on the CPU), normalised if it is an image."""
        if device is not None and t.device != device:
            if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
                t = t.pin_memory()
            t = t.to(device, non_blocking=True)
        return self.normalize(t) if self.is_image(t) else t

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self._copy_to)
        return self._stream


class _PassThroughIterator:
    """CPU (or a device without streams): convert each batch synchronously, time the waits."""

    def __init__(self, owner: GPUPrefetchLoader, metrics: LoaderMetrics) -> None:
        self._owner = owner
        self._metrics = metrics
        with metrics.starting():
            self._it = iter(owner.loader)  # starts the workers
        self._done = False

    def __iter__(self) -> _PassThroughIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            batch = next(self._it)
        except StopIteration:
            self._done = True
            self._metrics.finish(time.perf_counter() - t0)  # the workers' shutdown is waited for
            raise
        owner = self._owner
        try:
            owner._check_images(batch)
            out = map_tensors(batch, lambda t: owner._convert(t, owner._copy_to))
        except StopIteration as exc:  # leaving __next__, it would end the pass: an error, as on CUDA
            raise RuntimeError(f"a batch's conversion raised StopIteration: {exc}") from exc
        self._metrics.add_wait(time.perf_counter() - t0)
        return out


def _detached(exc: BaseException) -> BaseException:
    """``exc`` as ``_Ahead._fill_one`` caught it, held for later without that frame (which holds
    the look-ahead: a cycle that kept the DataLoader's workers alive after a ``break`` until a
    collection). Where it came from is still told: the rest of its traceback is kept."""
    tb = exc.__traceback__  # starts at the frame that caught it
    return exc.with_traceback(tb.tb_next if tb is not None else None)


class _Ahead:
    """Items started ``depth`` ahead of the consumer, handed out in order.

    An error, from the wrapped loader or from starting an item, takes that
    item's place in the order: it is raised when the consumer reaches it, after
    the items before it, and the pass goes on behind it, as a ``DataLoader``
    does (a training loop that skips a bad batch must not lose the rest of the
    epoch, nor a good batch that was already started).
    """

    def __init__(self, source: Iterator[Any], depth: int, start: Callable[[Any], Any]) -> None:
        self._source = source
        self._depth = depth
        self._start = start
        self._queue: deque[tuple[bool, Any]] = deque()  # (started, item) or (False, error)
        self._exhausted = False

    def _fill_one(self) -> None:
        if self._exhausted:
            return
        try:
            host = next(self._source)
        except StopIteration:
            self._exhausted = True
            return
        except Exception as exc:
            self._queue.append((False, _detached(exc)))
            return
        try:
            self._queue.append((True, self._start(host)))
        except StopIteration as exc:  # raised from next(), it would end the pass: an error instead
            self._queue.append((False, RuntimeError(f"a batch's conversion raised StopIteration: {exc}")))
        except Exception as exc:
            self._queue.append((False, _detached(exc)))

    def next(self) -> Any:
        """The next started item; StopIteration at the end; an item's error in its turn."""
        # Up to `depth` in flight: the first call fills, and a fill cut short (Ctrl-C) is made up for.
        while len(self._queue) < self._depth and not self._exhausted:
            self._fill_one()
        if not self._queue:
            raise StopIteration
        ok, item = self._queue.popleft()
        try:
            self._fill_one()  # keep `depth` items in flight while this one is consumed
        except BaseException:  # Ctrl-C in the source: the item taken stays first in line, not lost
            self._queue.appendleft((ok, item))
            raise
        if not ok:
            try:
                raise item
            finally:  # the frame of this call, kept by the traceback, must not keep the item
                del item
        return item


def _issue_on_side_stream(
    owner: GPUPrefetchLoader, side: torch.cuda.Stream, host: Any
) -> tuple[Any, torch.cuda.Event, Any]:
    """Queue the copy and normalisation of one host batch on the side stream."""
    owner._check_images(host)
    device = owner._copy_to
    # Tensors already on the GPU (decoded there) may still be being written by work queued on
    # the consumer's stream: the side stream must not read them before it is done. Host
    # tensors need no such wait, which would hold their copy behind the running step.
    on_gpu = any(t.is_cuda for t in _tensors_in(host))
    consumer = torch.cuda.current_stream(device)  # before the context makes the side stream current
    with torch.cuda.stream(side):
        if on_gpu:
            side.wait_stream(consumer)
        dev = map_tensors(host, lambda t: owner._convert(t, device))
        ready = torch.cuda.Event()
        ready.record(side)
    return dev, ready, host


class _CudaPrefetchIterator:
    """Keeps ``prefetch`` batches copying on a side stream ahead of the consumer."""

    def __init__(self, owner: GPUPrefetchLoader, metrics: LoaderMetrics) -> None:
        self._owner = owner
        self._metrics = metrics
        with metrics.starting():
            side = owner._side_stream()  # made on the first pass
            source = iter(owner.loader)  # starts the workers
        # Items: (device batch, ready event, host batch kept alive until the copy is consumed).
        # The start function must not hold this iterator: a cycle kept the DataLoader's workers
        # (and the batches in flight) alive after a `break` until a garbage collection.
        issue = functools.partial(_issue_on_side_stream, owner, side)
        self._ahead = _Ahead(source, owner.prefetch, issue)
        self._done = False

    def __iter__(self) -> _CudaPrefetchIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            dev, ready, _host = self._ahead.next()
        except StopIteration:
            self._done = True
            self._metrics.finish(time.perf_counter() - t0)  # the workers' shutdown is waited for
            raise
        consumer = torch.cuda.current_stream(self._owner._copy_to)
        consumer.wait_event(ready)

        def hand_over(t: torch.Tensor) -> torch.Tensor:
            if t.is_cuda:
                t.record_stream(consumer)
            return t

        map_tensors(dev, hand_over)
        self._metrics.add_wait(time.perf_counter() - t0)
        return dev
