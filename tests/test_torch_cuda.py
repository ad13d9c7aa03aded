"""GPUPrefetchLoader on CUDA: values, stream ordering, record_stream, and copies overlapping compute.

Skipped without CUDA; ``scripts/gpu_check.sh`` runs these on a GPU machine.
"""

from __future__ import annotations

import time
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from cdmlfs_torch import GPUPrefetchLoader  # noqa: E402

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def manual(x: torch.Tensor) -> torch.Tensor:
    m = torch.tensor(MEAN).view(1, -1, 1, 1)
    s = torch.tensor(STD).view(1, -1, 1, 1)
    return (x.float() / 255 - m) / s


def constant_batches(n: int, shape: tuple[int, ...], pin: bool = True) -> list[torch.Tensor]:
    """Batch i is filled with i + 1: any mix-up or early overwrite shows in min/max."""
    out = []
    for i in range(n):
        t = torch.full(shape, i + 1, dtype=torch.uint8)
        out.append(t.pin_memory() if pin else t)
    return out


@pytest.mark.parametrize("pin", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_values_equal_cpu_normalisation(pin: bool, channels_last: bool) -> None:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (40, 3, 17, 23), dtype=torch.uint8, generator=g)
    base = DataLoader(TensorDataset(images, torch.arange(40)), batch_size=8, pin_memory=pin)
    loader = GPUPrefetchLoader(base, mean=MEAN, std=STD, channels_last=channels_last)
    assert loader.use_cuda and len(loader) == 5
    for _ in range(2):
        got = list(loader)
        assert len(got) == 5
        for (x, y), (xr, yr) in zip(got, base, strict=True):
            assert x.is_cuda and y.is_cuda and x.dtype == torch.float32
            assert x.is_contiguous(memory_format=torch.channels_last) == channels_last
            torch.testing.assert_close(x.cpu(), manual(xr), rtol=0, atol=1e-6)
            assert torch.equal(y.cpu(), yr)
    m = loader.metrics()
    assert m["batches"] == 5 and m["batches_per_s"] > 0


def test_consumer_stream_waits_for_the_copy_stream() -> None:
    """Copies held back on the side stream: the consumer must still see the finished batch."""
    batches = constant_batches(4, (8, 3, 256, 256))
    loader = GPUPrefetchLoader(batches, is_image=lambda t: False)
    it = iter(loader)  # nothing is copied before the first next()
    with torch.cuda.stream(loader._side_stream()):
        torch.cuda._sleep(200_000_000)  # the side stream is busy for a while (~0.1 s)
    for i, x in enumerate(it):
        lo, hi = torch.aminmax(x)  # queued on the consumer stream, without any host sync
        assert (int(lo), int(hi)) == (i + 1, i + 1)


def test_batches_made_on_the_gpu_are_read_after_the_kernels_that_make_them() -> None:
    """A loader that decodes on the GPU queues each batch on the consumer stream behind slow work:
    the side stream must wait for it before normalising (it read half-written batches)."""

    def made_on_gpu():
        for i in range(4):
            torch.cuda._sleep(200_000_000)  # the consumer stream is busy for ~0.1 s first
            yield torch.full((8, 3, 256, 256), i + 1, dtype=torch.uint8, device="cuda")

    for i, x in enumerate(GPUPrefetchLoader(made_on_gpu())):
        lo, hi = torch.aminmax(x)
        assert abs(float(lo) - (i + 1) / 255) < 1e-6 and abs(float(hi) - (i + 1) / 255) < 1e-6, i


def test_a_failed_batch_is_raised_in_its_turn_and_the_epoch_goes_on() -> None:
    from test_torch_prefetch import BadAt, _skipping_bad_batches

    loader = GPUPrefetchLoader(DataLoader(BadAt(12, 5), batch_size=2), is_image=lambda t: False)
    assert _skipping_bad_batches(loader) == [[0, 1], [2, 3], "ERR", [6, 7], [8, 9], [10, 11]]


def test_record_stream_keeps_batches_alive_while_the_consumer_uses_them() -> None:
    """Each batch is read only after a long kernel on the consumer stream, then dropped at once.

    Without ``record_stream`` the allocator hands its block to the next copy on
    the side stream, which overwrites it before the queued reads run.
    """
    batches = constant_batches(12, (4, 3, 512, 512))
    loader = GPUPrefetchLoader(batches, prefetch=2)
    results = []
    for x in loader:
        torch.cuda._sleep(20_000_000)
        results.append(torch.stack(torch.aminmax(x)))
        del x
    got = torch.stack(results).cpu()
    want = torch.tensor([[(i + 1) / 255, (i + 1) / 255] for i in range(12)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def test_copies_overlap_compute() -> None:
    """Copying K batches while computing K steps takes clearly less than doing one after the other."""
    batches = constant_batches(8, (16, 4, 1024, 1024))  # 64 MiB each
    loader = GPUPrefetchLoader(batches, prefetch=2, is_image=lambda t: False)
    a = torch.randn(2048, 2048, device="cuda")  # small steps, so their count can match a copy

    def copy_only() -> None:
        for _ in loader:
            pass

    def step(reps: int) -> None:
        b = a
        for _ in range(reps):
            b = torch.tanh(b @ a) * 0.01

    copy_only()  # warm up pinned memory, streams, cuBLAS
    step(2)
    t_copy = min(_timed(copy_only) for _ in range(3))
    t_one = min(_timed(lambda: step(8)) for _ in range(3)) / 8
    reps = max(1, round(t_copy / len(batches) / t_one))  # one step ~ one batch's copy

    def compute_only() -> None:
        for _ in batches:
            step(reps)

    def both() -> None:
        for _x in loader:
            step(reps)

    t_compute = min(_timed(compute_only) for _ in range(3))
    t_both = min(_timed(both) for _ in range(3))
    serial = t_copy + t_compute
    assert t_both < 0.8 * serial, (
        f"no overlap: copy {t_copy:.4f}s compute {t_compute:.4f}s both {t_both:.4f}s"
    )


def test_archive_image_folder_end_to_end(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    pytest.importorskip("torchvision")
    from PIL import Image
    from torchvision import transforms

    from cdmlfs_torch import ArchiveImageFolder
    from cdmlfs_torch.synthetic import zip_tree

    rng = np.random.default_rng(0)
    for c in range(3):
        (tmp_path / "src" / f"c{c}").mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(
                tmp_path / "src" / f"c{c}" / f"{i}.png"
            )
    zip_tree(tmp_path / "src", tmp_path / "d.zip", compression=zipfile.ZIP_DEFLATED)  # no zip CLI needed
    ds = ArchiveImageFolder(str(tmp_path / "d.zip"), transform=transforms.PILToTensor())
    base = DataLoader(ds, batch_size=4, num_workers=2, pin_memory=True)
    gpu = GPUPrefetchLoader(base, mean=MEAN, std=STD, channels_last=True)
    for (x, y), (xr, yr) in zip(gpu, base, strict=True):
        torch.testing.assert_close(x.cpu(), manual(xr), rtol=0, atol=1e-6)
        assert torch.equal(y.cpu(), yr)


def test_breaking_out_of_a_pass_frees_the_loader_at_once() -> None:
    """The iterator and its look-ahead formed a cycle: after ``break`` the DataLoader's iterator
    (its workers, the batches in flight) lived on until a garbage collection."""
    import gc
    import weakref

    base = DataLoader(TensorDataset(torch.zeros(64, 3, 4, 4, dtype=torch.uint8)), batch_size=4)
    loader = GPUPrefetchLoader(base, mean=MEAN, std=STD)
    gc.disable()
    try:
        it = iter(loader)
        next(it)
        source = weakref.ref(it._ahead._source)
        del it
        assert source() is None
    finally:
        gc.enable()
