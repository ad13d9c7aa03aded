"""``ArchiveOrderSampler``: near-sequential reads, shuffled within windows, sharded like DistributedSampler.

Why: a single-frame tar.zst can only be decoded forwards, and an S3 object is
cheapest read in long ranges. Visiting samples in the order their bytes lie
in the archive turns an epoch into (nearly) one forward pass per rank, while
shuffling inside windows of ``window`` consecutive samples keeps batches
mixed. One epoch's global order is built as:

1. all samples sorted by archive position (``dataset.archive_positions()``,
   else dataset order);
2. with ``shuffle``: rotated by a random offset (so shard and window
   boundaries move from epoch to epoch), cut into windows of ``window``
   samples, window order permuted if ``shuffle_windows``, and each window
   shuffled;
3. padded by repeating its head (or truncated with ``drop_last``) to a
   multiple of ``num_replicas``, exactly as ``DistributedSampler`` sizes it;
4. cut into ``num_replicas`` contiguous shards; rank ``r`` takes shard ``r``.
   Contiguous rather than strided (``DistributedSampler``'s ``rank::num_replicas``)
   so that each rank reads its own region forwards instead of every rank
   touching the whole archive.

Everything is a pure function of (seed, epoch, dataset size, positions,
options): ranks agree without talking, and a run resumes exactly from a
sample position (``start_index``, ``state_dict``/``load_state_dict``).

A caveat worth knowing: archives are often written class by class. Windows
much smaller than a class then give single-class batches; use a large
``window`` (``window >= len(dataset)`` is a full shuffle) or ``shuffle_windows``.
"""

from __future__ import annotations

import math
import operator
import random
from collections.abc import Iterator, Sequence, Sized
from typing import Any

from cdmlfs_torch._compat import Dataset, Sampler


def _dist_defaults(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """world size / rank from torch.distributed when it is initialised, else 1 / 0."""
    if num_replicas is None or rank is None:
        world, me = 1, 0
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                world, me = dist.get_world_size(), dist.get_rank()
        except ImportError:
            pass
        num_replicas = world if num_replicas is None else num_replicas
        rank = me if rank is None else rank
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, not {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
    return num_replicas, rank


def _positions_given(data_source: Any) -> bool:
    """A sequence of integer positions (a list, a numpy array, a tensor, ints of numpy), not a dataset.

    Only a list of Python ints counted: ``np.argsort(...)`` or a tensor of positions was taken
    for a dataset and silently gave dataset order.
    """
    if isinstance(data_source, Dataset) or not hasattr(data_source, "__getitem__") or not len(data_source):
        return False
    try:
        operator.index(data_source[0])
    except (TypeError, ValueError, IndexError, KeyError):
        return False
    return True


class ArchiveOrderSampler(Sampler[int]):
    """Indices of one rank's shard, in archive order with shuffled windows (see module docstring).

    Args:
        data_source: the dataset (its ``archive_positions()`` is used when it has one),
            or a sequence of positions, one sort key per sample.
        window: samples per shuffle window.
        shuffle: False gives pure archive order, the same every epoch.
        seed: shared by all ranks; the epoch's order derives from ``(seed, epoch)``.
        num_replicas, rank: default to torch.distributed's when initialised, else 1 and 0.
        drop_last: drop the tail instead of padding so every shard has the same length.
        shuffle_windows: also permute the order of windows (still contiguous reads per window).
        start_index: skip this many of this rank's samples in the first epoch iterated (resume).
    """

    def __init__(
        self,
        data_source: Sized | Sequence[int],
        window: int = 1024,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        shuffle_windows: bool = False,
        start_index: int = 0,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, not {window}")
        self.num_replicas, self.rank = _dist_defaults(num_replicas, rank)
        positions = getattr(data_source, "archive_positions", None)
        if callable(positions):
            keys = list(positions())
        elif _positions_given(data_source):
            keys = [operator.index(k) for k in data_source]  # type: ignore[union-attr]
        else:
            keys = list(range(len(data_source)))
        self._base = sorted(range(len(keys)), key=keys.__getitem__)
        self.dataset_size = len(keys)
        self.window = window
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.shuffle_windows = shuffle_windows
        self.epoch = 0
        n, r = self.dataset_size, self.num_replicas
        if drop_last and n % r:
            self.num_samples = n // r
        else:
            self.num_samples = math.ceil(n / r)
        self.total_size = self.num_samples * r
        self.start_index = 0
        self._set_start(start_index)
        self._handed_out = 0
        self._pass_done = False
        # Given here, the skip waits for the first epoch iterated, whichever set_epoch names it (the
        # usual resume loop calls set_epoch(resumed_epoch) first, which dropped it).
        self._start_pending = start_index > 0

    # -- the order -----------------------------------------------------------
    def global_order(self, epoch: int | None = None) -> list[int]:
        """Every rank's indices for ``epoch``, shard after shard (length ``total_size``)."""
        epoch = self.epoch if epoch is None else epoch
        order = list(self._base)
        n = len(order)
        if self.shuffle and n:
            rng = random.Random(f"cdmlfs-torch:{self.seed}:{epoch}")
            rot = rng.randrange(n)
            order = order[rot:] + order[:rot]
            windows = [order[i : i + self.window] for i in range(0, n, self.window)]
            if self.shuffle_windows:
                rng.shuffle(windows)
            for w in windows:
                rng.shuffle(w)
            order = [i for w in windows for i in w]
        if self.total_size > n:
            pad = self.total_size - n
            order += (order * math.ceil(pad / n))[:pad] if n else []
        else:
            order = order[: self.total_size]
        return order

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's full list for ``epoch`` (``num_samples`` indices), ignoring ``start_index``."""
        start = self.rank * self.num_samples
        return self.global_order(epoch)[start : start + self.num_samples]

    # -- Sampler protocol ----------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        """The rest of this epoch's indices. Not a generator itself: a new pass starts (and
        ``len()`` is whole again) when it is asked for, not at its first index."""
        if self._pass_done:  # a pass after a finished one starts from the beginning, resumed or not
            self.start_index = 0
            self._pass_done = False
        todo = self.indices()[self.start_index :]
        self._start_pending = False
        self._handed_out = 0
        return self._hand_out(todo)

    def _hand_out(self, todo: list[int]) -> Iterator[int]:
        for i in todo:
            self._handed_out += 1
            yield i
        # Done for the sampler, not yet for the loop: DataLoader workers take indices batches
        # ahead. start_index and len() stay this epoch's until the next pass or set_epoch (reset
        # here, a resumed epoch's len(loader) grew mid-epoch and its start could not be read
        # back for a checkpoint); state_dict() already says the epoch is done.
        self._handed_out = self.num_samples - self.start_index
        self._pass_done = True

    def __len__(self) -> int:
        return self.num_samples - self.start_index

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order to produce (call before each epoch, like DistributedSampler).

        A resume position set for this same epoch is kept, so the usual
        ``load_state_dict(...); for epoch in range(start, n): sampler.set_epoch(epoch)`` works; so is
        a ``start_index`` given to the constructor, until the first epoch iterated.
        """
        if epoch != self.epoch and not self._start_pending:
            self.start_index = 0
            self._handed_out = 0
            self._pass_done = False
        self.epoch = epoch

    # -- resume ----------------------------------------------------------------
    def _set_start(self, start_index: int) -> None:
        if not 0 <= start_index <= self.num_samples:
            raise ValueError(f"start_index must be in [0, {self.num_samples}], not {start_index}")
        self.start_index = start_index

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is: pass ``consumed`` (samples of this epoch the model has seen).

        Without it, the count of indices handed out so far is used; with
        DataLoader workers prefetching, that runs ahead of what was trained on,
        so checkpoint code should pass ``consumed`` counted from the start of the
        epoch: ``sampler.start_index + batches_done * batch_size`` in an epoch that
        resumed (``start_index`` holds until the next pass or ``set_epoch``).
        """
        position = self.start_index + self._handed_out if consumed is None else consumed
        if position >= self.num_samples:  # the epoch is done: resume at the next one
            return {**self._config(), "epoch": self.epoch + 1, "start_index": 0}
        return {**self._config(), "epoch": self.epoch, "start_index": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields the rest of ``state['epoch']`` from ``state['start_index']``."""
        mine = self._config()
        changed = [k for k in mine if k in state and state[k] != mine[k]]
        if changed:
            detail = ", ".join(f"{k}: {state[k]!r} -> {mine[k]!r}" for k in changed)
            raise ValueError(f"cannot resume exactly: the sampler's configuration changed ({detail})")
        self.epoch = int(state["epoch"])
        self._set_start(int(state.get("start_index", 0)))
        self._handed_out = 0
        self._pass_done = False

    def _config(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "dataset_size": self.dataset_size,
            "num_replicas": self.num_replicas,
            "window": self.window,
            "shuffle": self.shuffle,
            "shuffle_windows": self.shuffle_windows,
            "drop_last": self.drop_last,
        }
