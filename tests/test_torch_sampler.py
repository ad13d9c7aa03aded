"""ArchiveOrderSampler: DistributedSampler's sharding contract, archive order, epochs, resume."""

from __future__ import annotations

import itertools
import math
import random
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from cdmlfs_torch import ArchiveDataset, ArchiveOrderSampler


def shards(n: int, replicas: int, **kw) -> list[list[int]]:
    return [list(ArchiveOrderSampler(range(n), num_replicas=replicas, rank=r, **kw)) for r in range(replicas)]


@pytest.mark.parametrize("n", [1, 7, 64, 101])
@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
@pytest.mark.parametrize("shuffle", [True, False])
def test_shards_padded_like_distributed_sampler(n: int, replicas: int, shuffle: bool) -> None:
    parts = shards(n, replicas, window=5, shuffle=shuffle, seed=3)
    per_rank = math.ceil(n / replicas)
    assert all(len(p) == per_rank for p in parts)
    counts = Counter(i for p in parts for i in p)
    assert set(counts) == set(range(n))  # complete
    assert sum(c - 1 for c in counts.values()) == per_rank * replicas - n  # only the padding repeats
    if n % replicas == 0:
        assert all(c == 1 for c in counts.values())  # disjoint


@pytest.mark.parametrize(("n", "replicas"), [(7, 2), (101, 8), (64, 3), (5, 8)])
def test_drop_last_shards_are_disjoint(n: int, replicas: int) -> None:
    parts = shards(n, replicas, window=4, drop_last=True, seed=1)
    assert all(len(p) == n // replicas for p in parts)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == (n // replicas) * replicas


def test_matches_distributed_sampler_sizes() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data.distributed import DistributedSampler

    for n, replicas, drop_last in [(10, 3, False), (10, 3, True), (9, 3, True), (2, 4, False)]:
        ref = DistributedSampler(range(n), num_replicas=replicas, rank=0, drop_last=drop_last)
        ours = ArchiveOrderSampler(range(n), num_replicas=replicas, rank=0, drop_last=drop_last)
        assert (len(ours), ours.total_size) == (len(ref), ref.total_size)
    del torch


def test_pure_archive_order_without_shuffle() -> None:
    positions = [50, 10, 40, 0, 30, 20]
    assert list(ArchiveOrderSampler(positions, shuffle=False)) == [3, 1, 5, 4, 2, 0]
    two = shards_of(positions, 2, shuffle=False)
    assert two == [[3, 1, 5], [4, 2, 0]]  # contiguous regions, each read forwards


def test_positions_as_numpy_or_a_tensor() -> None:
    """Only a list of Python ints was taken for positions: np.argsort output or a tensor silently
    gave dataset order."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    positions = [50, 10, 40, 0, 30, 20]
    for given in (np.array(positions), list(np.array(positions)), torch.tensor(positions)):
        assert list(ArchiveOrderSampler(given, shuffle=False)) == [3, 1, 5, 4, 2, 0], type(given)
    samples = [("a.png", 1), ("b.png", 0)]  # a list of samples is a dataset: its own order
    assert list(ArchiveOrderSampler(samples, shuffle=False)) == [0, 1]
    tensors = torch.utils.data.TensorDataset(torch.tensor(positions))  # a Dataset: its own order too
    assert list(ArchiveOrderSampler(tensors, shuffle=False)) == list(range(6))


def shards_of(positions, replicas, **kw):
    return [
        list(ArchiveOrderSampler(positions, num_replicas=replicas, rank=r, **kw)) for r in range(replicas)
    ]


def contiguous_start(ranks: list[int], n: int) -> int:
    """Where a set of archive ranks starts, asserting it is one contiguous stretch (mod n)."""
    have = set(ranks)
    heads = [r for r in have if (r - 1) % n not in have]
    assert len(heads) == 1, "not one contiguous stretch of the archive"
    assert have == {(heads[0] + k) % n for k in range(len(have))}
    return heads[0]


@pytest.mark.parametrize("shuffle_windows", [False, True])
def test_windows_are_contiguous_archive_ranges(shuffle_windows: bool) -> None:
    n, window = 1024, 64  # whole windows, so that slices of the order are windows even when shuffled
    positions = random.Random(0).sample(range(10**6), n)  # sample i lies at positions[i]
    rank_of = {i: r for r, i in enumerate(sorted(range(n), key=positions.__getitem__))}
    sampler = ArchiveOrderSampler(positions, window=window, seed=5, shuffle_windows=shuffle_windows)
    order = sampler.global_order()
    assert sorted(order) == list(range(n))
    starts = []
    for w in range(0, n, window):
        ranks = [rank_of[i] for i in order[w : w + window]]
        starts.append(contiguous_start(ranks, n))
        assert ranks != sorted(ranks)  # shuffled inside the window
    forwards = all(b == (a + window) % n for a, b in itertools.pairwise(starts))
    assert forwards != shuffle_windows  # windows follow the archive unless their order is shuffled


def test_epochs_reshuffle_deterministically() -> None:
    a = ArchiveOrderSampler(range(500), window=50, seed=7, num_replicas=2, rank=1)
    b = ArchiveOrderSampler(range(500), window=50, seed=7, num_replicas=2, rank=1)
    e0 = list(a)
    assert e0 == list(a)  # no set_epoch: same order, like DistributedSampler
    a.set_epoch(1)
    e1 = list(a)
    assert e1 != e0 and sorted(e1) != sorted(e0)  # reshuffled, and shard boundaries move
    b.set_epoch(1)
    assert list(b) == e1  # another process computes the same order
    c = ArchiveOrderSampler(range(500), window=50, seed=8, num_replicas=2, rank=1)
    c.set_epoch(1)
    assert list(c) != e1


def test_resume_from_a_sample_position() -> None:
    n, batch = 300, 16
    a = ArchiveOrderSampler(range(n), window=32, seed=2, num_replicas=3, rank=2)
    a.set_epoch(4)
    full = list(a)
    consumed = 5 * batch
    state = a.state_dict(consumed=consumed)
    assert state["epoch"] == 4 and state["start_index"] == consumed

    b = ArchiveOrderSampler(range(n), window=32, seed=2, num_replicas=3, rank=2)
    b.load_state_dict(state)
    b.set_epoch(4)  # the training loop's usual call keeps the resume position
    assert len(b) == len(full) - consumed
    assert list(b) == full[consumed:]
    assert len(b) == len(full) - consumed and b.start_index == consumed  # still this epoch's
    it = iter(b)  # the next pass starts when asked for (a progress bar takes len() before the first)
    assert len(b) == len(full) and list(it) == full  # and it is whole again
    b.set_epoch(5)
    a.set_epoch(5)
    assert list(b) == list(a)

    c = ArchiveOrderSampler(range(n), window=32, seed=2, num_replicas=3, rank=2, start_index=7)
    assert list(c) == list(ArchiveOrderSampler(range(n), window=32, seed=2, num_replicas=3, rank=2))[7:]

    # start_index given to the constructor, then the usual loop's set_epoch(resumed epoch): the skip
    # applies to that first epoch iterated (set_epoch(4) dropped it: the epoch was whole again).
    d = ArchiveOrderSampler(range(n), window=32, seed=2, num_replicas=3, rank=2, start_index=consumed)
    d.set_epoch(4)
    assert len(d) == len(full) - consumed and list(d) == full[consumed:]
    d.set_epoch(5)
    assert list(d) == list(a)  # then whole epochs


def test_state_dict_counts_handed_out_indices_and_rolls_over() -> None:
    s = ArchiveOrderSampler(range(20), window=4, seed=0)
    it = iter(s)
    taken = [next(it) for _ in range(6)]
    assert s.state_dict()["start_index"] == 6
    r = ArchiveOrderSampler(range(20), window=4, seed=0)
    r.load_state_dict(s.state_dict())
    assert taken + list(r) == list(ArchiveOrderSampler(range(20), window=4, seed=0))
    done = s.state_dict(consumed=20)
    assert (done["epoch"], done["start_index"]) == (1, 0)
    # A whole pass, as a DataLoader makes it, then a checkpoint without ``consumed``: the next epoch.
    whole = ArchiveOrderSampler(range(20), window=4, seed=0)
    assert len(list(whole)) == 20
    after = whole.state_dict()
    assert (after["epoch"], after["start_index"]) == (1, 0)
    again = list(whole)  # and iterating again (no set_epoch) is the same epoch, from the start
    assert again == list(ArchiveOrderSampler(range(20), window=4, seed=0))


def test_resume_refuses_a_changed_configuration() -> None:
    state = ArchiveOrderSampler(range(100), seed=1, num_replicas=2, rank=0).state_dict(consumed=10)
    for kw in ({"seed": 2}, {"num_replicas": 4, "rank": 0}, {"window": 8}):
        args = {"seed": 1, "num_replicas": 2, "rank": 0, **kw}
        with pytest.raises(ValueError, match="configuration changed"):
            ArchiveOrderSampler(range(100), **args).load_state_dict(state)
    with pytest.raises(ValueError, match="configuration changed"):
        ArchiveOrderSampler(range(99), seed=1, num_replicas=2, rank=0).load_state_dict(state)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="Invalid rank"):
        ArchiveOrderSampler(range(10), num_replicas=2, rank=2)
    with pytest.raises(ValueError):
        ArchiveOrderSampler(range(10), window=0)
    with pytest.raises(ValueError):
        ArchiveOrderSampler(range(10), start_index=11)


def test_defaults_from_torch_distributed(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    assert (ArchiveOrderSampler(range(10)).num_replicas, ArchiveOrderSampler(range(10)).rank) == (1, 0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        s = ArchiveOrderSampler(range(10))
        assert (s.num_replicas, s.rank) == (1, 0)
        with pytest.raises(ValueError):
            ArchiveOrderSampler(range(10), rank=1)  # world size 1 from torch.distributed
    finally:
        dist.destroy_process_group()


def test_follows_the_archive_of_a_dataset(tmp_path: Path) -> None:
    """A ZIP written in shuffled order: the sampler reads it front to back, not in name order."""
    names = [f"d/{i:03d}.txt" for i in range(40)]
    written = names[:]
    random.Random(1).shuffle(written)
    with zipfile.ZipFile(tmp_path / "a.zip", "w") as zf:
        for name in written:
            zf.writestr(name, name.encode())
    ds = ArchiveDataset(f"{tmp_path / 'a.zip'}::d")
    assert ds.paths == sorted(p[2:] for p in names)
    order = [ds[i].decode() for i in ArchiveOrderSampler(ds, shuffle=False)]
    assert order == written
    shuffled = [ds[i].decode() for i in ArchiveOrderSampler(ds, window=8, seed=3)]
    assert sorted(shuffled) == sorted(written) and shuffled != written
    ranks = [written.index(x) for x in shuffled]
    assert sum(1 for a, b in itertools.pairwise(ranks) if b < a - 8) <= 1  # one wrap-around at most


def test_with_a_dataloader() -> None:
    torch = pytest.importorskip("torch")
    ds = list(range(103))
    sampler = ArchiveOrderSampler(ds, window=10, seed=0, num_replicas=2, rank=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler)
    got = [int(x) for b in loader for x in b]
    assert got == sampler.indices() and len(loader) == math.ceil(52 / 8)


def test_a_resumed_epoch_keeps_its_length_and_start_while_workers_run_ahead() -> None:
    """DataLoader workers drain the sampler batches before the loop gets there; the sampler reset
    its start and length as soon as it was drained: len(loader) grew mid-epoch (5 -> 10 batches)
    and a checkpoint counting from sampler.start_index resumed too early, repeating samples."""
    from torch.utils.data import DataLoader

    n, batch = 40, 4
    sampler = ArchiveOrderSampler(range(n), window=8, seed=1, start_index=20)
    loader = DataLoader(list(range(n)), batch_size=batch, sampler=sampler, num_workers=2)
    lengths, starts, seen = [], [], []
    for step, got in enumerate(loader):
        lengths.append(len(loader))
        starts.append(sampler.start_index)
        seen += got.tolist()
        if step == 2:  # a checkpoint mid-epoch, counted from the epoch's start
            state = sampler.state_dict(consumed=sampler.start_index + (step + 1) * batch)
    assert lengths == [5] * 5 and starts == [20] * 5
    assert state == {**state, "epoch": 0, "start_index": 32}
    resumed = ArchiveOrderSampler(range(n), window=8, seed=1)
    resumed.load_state_dict(state)
    assert seen[-8:] == list(resumed)  # the samples after the checkpoint, none repeated
