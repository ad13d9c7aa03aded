"""GPUPrefetchLoader's CPU pass-through: the normalisation arithmetic, loader semantics, metrics."""

from __future__ import annotations

from collections import namedtuple

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402

from cdmlfs_torch import GPUPrefetchLoader  # noqa: E402

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def image_loader(n: int = 20, batch: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, 5, 7), dtype=torch.uint8, generator=g)
    labels = torch.arange(n)
    return DataLoader(TensorDataset(images, labels), batch_size=batch)


def manual(x: torch.Tensor, mean=MEAN, std=STD) -> torch.Tensor:
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return (x.float() / 255 - m) / s


def cpu_only(**kw) -> dict:
    return {"device": "cpu", **kw}


def test_normalises_like_the_manual_formula() -> None:
    base = image_loader()
    loader = GPUPrefetchLoader(base, **cpu_only(mean=MEAN, std=STD))
    for (x, y), (xr, yr) in zip(loader, base, strict=True):
        assert x.dtype == torch.float32 and x.shape == xr.shape
        assert torch.equal(x, manual(xr))
        assert y is not None and torch.equal(y, yr) and y.dtype == torch.int64  # labels untouched


def test_without_mean_it_is_to_tensor_scaling() -> None:
    base = image_loader()
    x, _ = next(iter(GPUPrefetchLoader(base, device="cpu")))
    assert torch.equal(x, next(iter(base))[0].float() / 255)
    x, _ = next(iter(GPUPrefetchLoader(base, device="cpu", mean=MEAN)))  # mean only: std 1
    assert torch.equal(x, next(iter(base))[0].float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1))


def test_len_epochs_and_stop_iteration() -> None:
    base = image_loader(n=22, batch=4)
    loader = GPUPrefetchLoader(base, device="cpu", mean=MEAN, std=STD)
    assert len(loader) == len(base) == 6
    for _ in range(3):  # re-iterable: each pass is a new epoch of the wrapped loader
        assert sum(len(y) for _, y in loader) == 22
    it = iter(loader)
    for _ in range(6):
        next(it)
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
    assert loader.batch_size == 4 and loader.dataset is base.dataset  # the wrapped loader's attributes


def test_without_cuda_device_cuda_is_a_pass_through() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: covered by test_torch_cuda.py")
    base = image_loader()
    loader = GPUPrefetchLoader(base, mean=MEAN, std=STD)  # device="cuda" by default
    assert not loader.use_cuda and loader.device == torch.device("cpu")  # it was None
    x, _ = next(iter(loader))
    assert x.device == loader.device and torch.equal(x, manual(next(iter(base))[0]))


Pair = namedtuple("Pair", "image mask")


class Nested(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        img = torch.full((3, 2, 2), i * 10, dtype=torch.uint8)
        return {
            "pair": Pair(img, torch.ones(2, 2, dtype=torch.uint8)),  # the mask is 3-D per batch: not an image
            "list": [img.float(), torch.tensor(i)],
            "name": f"sample{i}",
        }


def test_nested_batches_keep_their_structure() -> None:
    base = DataLoader(Nested(), batch_size=3)
    out = next(iter(GPUPrefetchLoader(base, device="cpu", mean=MEAN, std=STD)))
    ref = next(iter(base))
    assert set(out) == {"pair", "list", "name"} and isinstance(out["pair"], Pair)
    assert torch.equal(out["pair"].image, manual(ref["pair"].image))
    assert out["pair"].mask.dtype == torch.uint8  # 3-D uint8 (N,H,W) is not an image batch
    assert out["list"][0] is ref["list"][0] or torch.equal(out["list"][0], ref["list"][0])  # float: untouched
    assert out["name"] == ["sample0", "sample1", "sample2"]


def test_channels_last_dtype_and_custom_image_rule() -> None:
    base = image_loader()
    x, _ = next(iter(GPUPrefetchLoader(base, device="cpu", mean=MEAN, std=STD, channels_last=True)))
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(x, manual(next(iter(base))[0]))
    x, _ = next(iter(GPUPrefetchLoader(base, device="cpu", mean=MEAN, std=STD, dtype=torch.bfloat16)))
    assert x.dtype == torch.bfloat16
    assert torch.allclose(x.float(), manual(next(iter(base))[0]), atol=2e-2)
    x, _ = next(iter(GPUPrefetchLoader(base, device="cpu", is_image=lambda t: False)))
    assert x.dtype == torch.uint8


def test_float_images_chosen_by_is_image_are_not_changed_in_place() -> None:
    """``to(float32)`` of a float32 tensor is that tensor: normalising wrote into the loader's own
    batches (a second pass over a TensorDataset then saw them divided by 255 again)."""
    images = torch.full((2, 3, 4, 4), 255.0)
    loader = GPUPrefetchLoader(
        DataLoader(TensorDataset(images), batch_size=None), device="cpu", is_image=lambda t: t.dim() == 3
    )
    for _ in range(2):
        out = [batch[0] for batch in loader]
        assert all(torch.equal(x, torch.ones(3, 4, 4)) for x in out)
    assert torch.equal(images, torch.full((2, 3, 4, 4), 255.0))


def test_images_is_image_accepts_outside_0_to_255_get_one_warning() -> None:
    """An ``is_image`` taking ToTensor()'s floats (already in [0, 1]) or 16-bit images had them
    divided by 255 like uint8 ones, silently: inputs of about -2 after ImageNet stats."""
    import warnings

    def passes(images: torch.Tensor) -> list[str]:
        loader = GPUPrefetchLoader(
            DataLoader(TensorDataset(images), batch_size=2),
            device="cpu",
            mean=MEAN,
            std=STD,
            is_image=lambda t: t.dim() == 4,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                for _batch in loader:
                    pass
        return [str(w.message) for w in caught]

    said = passes(torch.rand(4, 3, 4, 4))
    assert len(said) == 1 and "ToTensor()'s range" in said[0] and "divided by 255" in said[0], said
    said = passes(torch.full((4, 3, 4, 4), 60000, dtype=torch.int32))
    assert len(said) == 1 and "int32 images with values within [60000, 60000]" in said[0], said
    assert passes(torch.full((4, 3, 4, 4), 200.0)) == []  # 0..255 floats: as meant
    assert passes(torch.randint(0, 255, (4, 3, 4, 4), dtype=torch.uint8)) == []


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="same number of channels"):
        GPUPrefetchLoader(image_loader(), device="cpu", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5))
    # A zero std made every batch inf; torchvision's Normalize refuses it (1e-50 is 0 in float32).
    for std in ((0.2, 0.0, 0.2), 1e-50):
        with pytest.raises(ValueError, match="std evaluated to zero"):
            GPUPrefetchLoader(image_loader(), device="cpu", mean=0.5, std=std)
    # One value stands for every channel, as torchvision's Normalize broadcasts it.
    x, _ = next(iter(GPUPrefetchLoader(image_loader(), device="cpu", mean=(0.5,), std=(0.25,))))
    x0, _ = next(iter(image_loader()))
    torch.testing.assert_close(x, manual(x0, (0.5,) * 3, (0.25,) * 3))
    # ... and so does a plain number (Normalize(0.5, 0.25)); it raised TypeError.
    xs, _ = next(iter(GPUPrefetchLoader(image_loader(), device="cpu", mean=0.5, std=0.25)))
    assert torch.equal(xs, x)
    xg, _ = next(iter(GPUPrefetchLoader(image_loader(), device="cpu", mean=(m for m in (0.5,)), std=[0.25])))
    assert torch.equal(xg, x)
    with pytest.raises(ValueError, match="channels"):
        next(iter(GPUPrefetchLoader(image_loader(), device="cpu", mean=(0.5, 0.5))))
    with pytest.raises(ValueError):
        GPUPrefetchLoader(image_loader(), device="cpu", prefetch=0)
    with pytest.raises(ValueError):
        GPUPrefetchLoader(image_loader(), device="cpu", dtype=torch.int32)


class Clock:
    """A clock that moves only when told: the loader's metrics read it, the test says how long
    each sample and each step take (real sleeps made the ratios hostage to a busy machine)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    @classmethod
    def installed(cls, monkeypatch: pytest.MonkeyPatch) -> Clock:
        """A clock that the loader and its metrics read instead of time.perf_counter."""
        import cdmlfs_torch.metrics
        import cdmlfs_torch.prefetch

        clock = cls()
        for module in (cdmlfs_torch.metrics, cdmlfs_torch.prefetch):
            monkeypatch.setattr(module, "time", type("FakeTime", (), {"perf_counter": staticmethod(clock)}))
        return clock


class Slow(Dataset):
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        self.clock.now += 0.02  # loading a sample takes 20 ms
        return torch.zeros(3, 2, 2, dtype=torch.uint8)


def test_metrics_measure_consumer_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock.installed(monkeypatch)
    loader = GPUPrefetchLoader(DataLoader(Slow(clock), batch_size=2), device="cpu")
    assert loader.metrics()["batches"] == 0
    for _ in loader:
        clock.now += 0.01  # "compute"
    m = loader.metrics()
    assert m["batches"] == 3 and loader.wait_times == pytest.approx([0.04] * 3)  # two samples each
    # 3 waits of 40 ms and 3 steps of 10 ms; the steady state starts when the first batch is out.
    assert m["elapsed_s"] == pytest.approx(0.15) and m["wait_s"] == pytest.approx(0.12)
    assert m["wait_fraction"] == pytest.approx(0.8)
    assert m["steady_wait_fraction"] == pytest.approx(0.08 / 0.11)
    assert m["first_wait_s"] == pytest.approx(0.04)
    assert m["batches_per_s"] == pytest.approx(3 / 0.15)
    assert m["steady_batches_per_s"] == pytest.approx(3 / 0.11)
    assert m["wait_ms_max"] == m["wait_ms_p50"] == m["wait_ms_p95"] == pytest.approx(40)
    assert m["wait_ms_mean"] == pytest.approx(40)
    next(iter(loader))
    assert loader.metrics()["batches"] == 1  # a new pass starts new metrics


class SlowToStart:
    """A loader whose pass takes 0.5 s to start (workers spawning) and 0.1 s to end (joining them)."""

    def __init__(self, clock: Clock, batches: int) -> None:
        self.clock = clock
        self.batches = batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        self.clock.now += 0.5
        for _ in range(self.batches):
            self.clock.now += 0.04
            yield torch.zeros(2, 3, 2, 2, dtype=torch.uint8)
        self.clock.now += 0.1


def test_metrics_count_starting_and_ending_a_pass_as_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the workers happened in iter(), untimed, and the call that found the end was not
    counted: a loop that only waited reported a wait fraction of 0.61."""
    clock = Clock.installed(monkeypatch)
    loader = GPUPrefetchLoader(SlowToStart(clock, 3), device="cpu")
    assert sum(1 for _ in loader) == 3  # nothing but waiting
    m = loader.metrics()
    assert m["first_wait_s"] == pytest.approx(0.54)
    assert m["elapsed_s"] == pytest.approx(0.5 + 3 * 0.04 + 0.1)
    assert m["wait_fraction"] == pytest.approx(1.0)


def _fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Just enough of torch.cuda's stream API for the CUDA iterator's own logic to run on a CPU."""
    import contextlib

    class Stream:
        def wait_stream(self, other) -> None:
            pass

        def wait_event(self, event) -> None:
            pass

    class Event:
        def record(self, stream=None) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "Event", Event)


def test_breaking_out_of_a_cuda_pass_frees_the_loader_without_a_collection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA iterator and its look-ahead formed a cycle: after ``break`` the DataLoader's
    iterator (its worker processes, the batches in flight) lived until a garbage collection.
    (tests/test_torch_cuda.py checks the same on a GPU.)"""
    import gc
    import weakref

    _fake_cuda(monkeypatch)
    for dataset in (TensorDataset(torch.zeros(16, 3, 2, 2)), BadAt(16, 1)):
        loader = GPUPrefetchLoader(DataLoader(dataset, batch_size=2), device="cpu")
        loader.use_cuda = True  # the CUDA iterator, with tensors left where they are (device None)
        gc.disable()
        try:
            it = iter(loader)
            try:
                next(it)
            except RuntimeError:  # a bad batch skipped: its error held and raised made cycles too
                next(it)
            source = weakref.ref(it._ahead._source)
            del it
            assert source() is None, dataset
        finally:
            gc.enable()


class Broken(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        if i == 3:
            raise RuntimeError("bad sample 3")
        return torch.zeros(1)


def test_errors_of_the_wrapped_loader_propagate() -> None:
    loader = GPUPrefetchLoader(DataLoader(Broken(), batch_size=1), device="cpu")
    it = iter(loader)
    for _ in range(3):
        next(it)
    with pytest.raises(RuntimeError, match="bad sample 3"):
        next(it)


def test_a_stop_iteration_from_converting_a_batch_is_an_error_on_cpu_too() -> None:
    """Raised inside ``__next__``, it would end the pass silently (as the CUDA path does not)."""
    batches = [torch.zeros((2, 3, 4, 4), dtype=torch.uint8) for _ in range(3)]

    def is_image(t: torch.Tensor) -> bool:
        raise StopIteration  # a buggy predicate

    for batch_of in (lambda b: b, lambda b: {"img": b}):
        it = iter(GPUPrefetchLoader([batch_of(b) for b in batches], device="cpu", is_image=is_image))
        with pytest.raises(RuntimeError, match="StopIteration"):
            next(it)


class BadAt(Dataset):
    """Sample ``bad`` raises: a DataLoader raises for its batch and goes on with the next."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise RuntimeError(f"bad sample {i}")
        return torch.full((3, 2, 2), i, dtype=torch.uint8)


def _skipping_bad_batches(iterable) -> list:
    """What a training loop that skips a failed batch sees: first values, and ERR in place."""
    out: list = []
    it = iter(iterable)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return out
        except (RuntimeError, ValueError):
            out.append("ERR")
        else:
            out.append([int(v) for v in batch.flatten(1)[:, 0]])


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_the_cuda_prefetch_order_keeps_a_failed_batch_in_its_place(depth: int) -> None:
    """The queue the CUDA iterator keeps ahead (_Ahead), run on the CPU with a real DataLoader: a
    failed batch is raised in its turn, after the batches before it, and the epoch goes on after it
    (it ended there). A batch whose conversion fails takes its own place too (it was raised early,
    and the good batch already taken off the queue was lost)."""
    from cdmlfs_torch.prefetch import _Ahead

    expected = [[0, 1], [2, 3], "ERR", [6, 7], [8, 9], [10, 11]]
    assert _skipping_bad_batches(DataLoader(BadAt(12, 5), batch_size=2)) == expected

    class Pass:
        def __init__(self, start) -> None:
            self.start = start

        def __iter__(self):
            ahead = _Ahead(iter(DataLoader(BadAt(12, 5), batch_size=2)), depth, self.start)
            return iter(ahead.next, None)

    assert _skipping_bad_batches(Pass(lambda b: b)) == expected

    def start(batch: torch.Tensor) -> torch.Tensor:
        if int(batch[0, 0, 0, 0]) == 8:
            raise ValueError("conversion failed")
        return batch

    assert _skipping_bad_batches(Pass(start)) == [[0, 1], [2, 3], "ERR", [6, 7], "ERR", [10, 11]]

    def stops(batch: torch.Tensor) -> torch.Tensor:  # from next(), it would end the epoch early
        if int(batch[0, 0, 0, 0]) == 8:
            raise StopIteration
        return batch

    assert _skipping_bad_batches(Pass(stops)) == [[0, 1], [2, 3], "ERR", [6, 7], "ERR", [10, 11]]

    def interrupted_once(batch: torch.Tensor, calls=[0]) -> torch.Tensor:  # noqa: B006 - a counter
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt  # Ctrl-C in the first fill: that batch is gone, the rest is not
        return batch

    ahead = _Ahead(iter(DataLoader(BadAt(12, 5), batch_size=2)), depth, interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        ahead.next()
    rest = _skipping_bad_batches(iter(ahead.next, None))
    assert rest == expected[1:] and len(rest) == 5

    class InterruptedOnce:  # Ctrl-C while the source fetches the batch after the one taken
        def __init__(self) -> None:
            self.items, self.calls = iter(range(8)), 0

        def __next__(self) -> int:
            self.calls += 1
            if self.calls == depth + 1:
                raise KeyboardInterrupt
            return next(self.items)

    ahead = _Ahead(InterruptedOnce(), depth, lambda b: b)
    with pytest.raises(KeyboardInterrupt):
        ahead.next()
    got = list(iter(ahead.next, None))
    assert got == list(range(8)), got  # the batch taken when Ctrl-C came was not lost
    cpu = GPUPrefetchLoader(DataLoader(BadAt(12, 5), batch_size=2), device="cpu", is_image=lambda t: False)
    assert _skipping_bad_batches(cpu) == expected  # the CPU pass-through agrees


def test_float_images_with_mean_and_std_get_one_warning() -> None:
    """ToTensor() at the end of a transform makes float images, which pass through unnormalised:
    said once, not silently; uint8 images, or no mean/std, say nothing."""
    floats = [torch.rand(2, 3, 4, 4) for _ in range(3)]
    with pytest.warns(UserWarning, match="float images") as caught:
        out = list(GPUPrefetchLoader(floats, device="cpu", mean=MEAN, std=STD))
    assert len(caught) == 1 and all(torch.equal(a, b) for a, b in zip(out, floats))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(GPUPrefetchLoader(floats, device="cpu"))
        list(GPUPrefetchLoader(image_loader(), device="cpu", mean=MEAN, std=STD))


def test_mapping_batches_keep_their_type_factory_and_all() -> None:
    """A defaultdict batch came back a plain dict (DataLoader's own collate keeps the type)."""
    from collections import defaultdict

    batch = defaultdict(list, {"x": torch.zeros(2, 3, 4, 4, dtype=torch.uint8), "y": torch.tensor([1, 2])})
    out = next(iter(GPUPrefetchLoader([batch], device="cpu", mean=0.5, std=0.5)))
    assert type(out) is defaultdict and out.default_factory is list
    assert out["x"].dtype == torch.float32 and torch.equal(out["y"], batch["y"])


def test_single_images_chosen_by_is_image_are_normalised_per_channel() -> None:
    """A C,H,W image (batch_size=None) broadcast the 1,C,1,1 stats over H, or failed to."""
    image = torch.randint(0, 256, (3, 3, 5), dtype=torch.uint8)
    mean, std = [0.1, 0.5, 0.9], [0.2, 0.3, 0.4]
    loader = GPUPrefetchLoader(
        [image], device="cpu", mean=mean, std=std, is_image=lambda t: t.dtype == torch.uint8
    )
    out = next(iter(loader))
    expected = (image.float() / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    assert out.shape == (3, 3, 5) and torch.allclose(out, expected)
    odd = GPUPrefetchLoader([image[0]], device="cpu", mean=0.5, is_image=lambda t: t.dtype == torch.uint8)
    with pytest.raises(ValueError, match="N,C,H,W or C,H,W"):
        next(iter(odd))


def test_16_bit_images_with_mean_and_std_get_one_warning() -> None:
    batches = [torch.full((2, 3, 4, 4), 1000, dtype=torch.int16)] * 3
    with pytest.warns(UserWarning, match="int16 N,C,H,W tensors") as caught:
        out = list(GPUPrefetchLoader(batches, device="cpu", mean=0.5, std=0.5))
    assert len(caught) == 1 and out[0].dtype == torch.int16
