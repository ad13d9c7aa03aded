#!/usr/bin/env python3
"""Training-input benchmark: ArchiveImageFolder vs stock ImageFolder on a cdmlfs mount vs the extracted tree.

CPU part (always): the same synthetic JPEG dataset three ways, one DataLoader
pass each per round (JPEG decode, RandomResizedCrop 224, horizontal flip,
ToTensor; 2 workers, batch 64), rounds alternating the variants' order so
drift and neighbours' load hit all of them alike; medians and per-round
ratios to the extracted directory are reported. Target: ArchiveImageFolder
and ImageFolder-on-mount both at least 90% of the extracted directory.

GPU part (``--gpu``): ResNet-50 training steps (random init, bf16 autocast,
channels_last) fed by ArchiveImageFolder -> DataLoader(pin_memory) ->
GPUPrefetchLoader, with three input pipelines: tensor_loader + transforms.v2
(the target's), the default PIL loader, and torchvision ImageFolder over the
extracted tree with the same tensor pipeline (baseline). Reports, per
pipeline, what the workers can supply with no model running, and the data
stall during training (consumer wait / step time, target <= 5%) in one epoch;
the step time against the same model fed one resident batch; from a
torch.profiler trace, how much of the host-to-device copy time ran while a
compute kernel was running; and nvjpeg's batched decode rate as a lead.

The mount is made with ``python -m cdmlfs mount`` and always unmounted.

Usage:
    .venv/bin/python scripts/bench_torch.py                 # CPU comparison
    .venv/bin/python scripts/bench_torch.py --gpu --no-cpu  # GPU part only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


# -- data ---------------------------------------------------------------------------
def build_data(workdir: Path, images: int, classes: int, seed: int) -> tuple[Path, Path]:
    """A JPEG tree (the "extracted directory") and a stored ZIP of it (members under ``train/``)."""
    from cdmlfs_torch.synthetic import make_image_tree, zip_tree

    extracted = workdir / "extracted" / "train"
    zip_path = workdir / "data.zip"
    marker = workdir / f".built-{images}-{classes}-{seed}"
    if marker.exists() and zip_path.exists():
        return zip_path, extracted
    t0 = time.perf_counter()
    per_class = max(1, images // classes)
    files = make_image_tree(extracted, classes, per_class, seed=seed, workers=os.cpu_count() or 1)
    zip_tree(extracted, zip_path, prefix="train/")
    marker.touch()
    size = sum(p.stat().st_size for p in files)
    print(
        f"data: {len(files)} JPEGs in {classes} classes, {size / len(files) / 1024:.0f} KiB each, "
        f"built in {time.perf_counter() - t0:.1f}s ({zip_path})",
        flush=True,
    )
    return zip_path, extracted


# -- mount ----------------------------------------------------------------------------
def _mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


@contextlib.contextmanager
def cdmlfs_mount(archive: Path, mountpoint: Path) -> Iterator[tuple[Path, int | None]]:
    """Mount with the real CLI; yields (mount point, daemon pid); always unmounts and stops that daemon."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    pid_file = mountpoint.parent / f".{mountpoint.name}.pid"
    log_file = mountpoint.parent / f".{mountpoint.name}.log"
    cmd = [sys.executable, "-m", "cdmlfs", "mount", str(archive), str(mountpoint)]
    res = subprocess.run(
        [*cmd, "--pid-file", str(pid_file), "--log-file", str(log_file)], capture_output=True, text=True
    )
    if res.returncode != 0:
        raise RuntimeError(f"mount failed: {res.stderr.strip()}")
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        pid = None
    try:
        yield mountpoint, pid
    finally:
        subprocess.run([sys.executable, "-m", "cdmlfs", "umount", str(mountpoint)], capture_output=True)
        for tool in (["fusermount3", "-u"], ["fusermount", "-u"], ["fusermount3", "-uz"]):
            if not _mounted(mountpoint):
                break
            with contextlib.suppress(OSError):
                subprocess.run([*tool, str(mountpoint)], capture_output=True)
        if pid is not None:
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if _mounted(mountpoint):
            print(f"warning: {mountpoint} is still mounted", file=sys.stderr)


# -- CPU comparison ---------------------------------------------------------------------
def train_transform(to_tensor: bool = True):
    from torchvision import transforms

    last = transforms.ToTensor() if to_tensor else transforms.PILToTensor()
    return transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), last])


def process_cpu_seconds(pid: int) -> float:
    """user + system CPU time of a live process (the FUSE daemon)."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def own_cpu_seconds() -> float:
    """CPU time of this process plus its reaped children (the DataLoader workers, once joined)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def one_pass(dataset, batch: int, workers: int, seed: int, daemon: int | None = None) -> dict[str, float]:
    """One shuffled epoch through a fresh DataLoader (worker start-up included, as in training).

    Besides wall time, the CPU seconds the pass cost (this process, its workers and, for the
    mount, the FUSE daemon): on a shared machine that figure is far less noisy than images/s.
    """
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(seed),
    )
    n = 0
    checksum = 0.0
    cpu0 = own_cpu_seconds() + (process_cpu_seconds(daemon) if daemon else 0.0)
    t0 = time.perf_counter()
    first = None
    for x, y in loader:
        checksum += float(x[:, :, ::32, ::32].sum())  # touch the batch, as a training step would
        n += len(y)
        if first is None:
            first = time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    del loader  # join the workers so that their CPU time is accounted
    cpu = own_cpu_seconds() + (process_cpu_seconds(daemon) if daemon else 0.0) - cpu0
    return {
        "images": n,
        "seconds": seconds,
        "images_per_s": n / seconds,
        "first_batch_s": first or 0.0,
        "cpu_ms_per_image": 1e3 * cpu / n,
    }


def cpu_benchmark(args: argparse.Namespace, zip_path: Path, extracted: Path, workdir: Path) -> dict:
    import torch
    from torchvision.datasets import ImageFolder

    from cdmlfs_torch import ArchiveImageFolder

    torch.set_num_threads(1)  # the main process only collates; leave the cores to the workers
    tf = train_transform()
    with cdmlfs_mount(zip_path, workdir / "mnt") as (mnt, daemon):
        makers: dict[str, Callable[[], object]] = {
            "archive": lambda: ArchiveImageFolder(f"{zip_path}::train", transform=tf),
            "mount": lambda: ImageFolder(str(mnt / "train"), transform=tf),
            "extracted": lambda: ImageFolder(str(extracted), transform=tf),
        }
        datasets, listing = {}, {}
        for name, make in makers.items():
            t0 = time.perf_counter()
            datasets[name] = make()
            listing[name] = time.perf_counter() - t0
        sizes = {name: len(ds) for name, ds in datasets.items()}
        assert len(set(sizes.values())) == 1, sizes
        names = list(makers)
        rates: dict[str, list[float]] = {n: [] for n in names}
        cpu_ms: dict[str, list[float]] = {n: [] for n in names}
        warm = args.warmup_rounds
        for r in range(warm + args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            line = []
            for name in order:
                pid = daemon if name == "mount" else None
                res = one_pass(datasets[name], args.batch, args.workers, seed=r, daemon=pid)
                if r >= warm:
                    rates[name].append(res["images_per_s"])
                    cpu_ms[name].append(res["cpu_ms_per_image"])
                line.append(f"{name} {res['images_per_s']:.0f}/s {res['cpu_ms_per_image']:.2f} cpu-ms/img")
            tag = "warm-up" if r < warm else f"round {r - warm + 1}/{args.rounds}"
            print(f"  {tag}: " + ", ".join(line), flush=True)
    base = rates["extracted"]
    out = {
        "images": sizes["extracted"],
        "listing_s": listing,
        "images_per_s": rates,
        "median_images_per_s": {n: statistics.median(v) for n, v in rates.items()},
        "cpu_ms_per_image": cpu_ms,
        "median_cpu_ms_per_image": {n: statistics.median(v) for n, v in cpu_ms.items()},
    }
    for n in ("archive", "mount"):
        out[f"{n}_ratio_of_medians"] = statistics.median(rates[n]) / statistics.median(base)
        paired = [a / b for a, b in zip(rates[n], base, strict=True)]
        out[f"{n}_median_paired_ratio"] = statistics.median(paired)
        # Throughput the CPU cost alone implies (the workers are CPU-bound): extracted's cost / this one's.
        out[f"{n}_cpu_efficiency"] = statistics.median(cpu_ms["extracted"]) / statistics.median(cpu_ms[n])
    return out


# -- GPU part ---------------------------------------------------------------------------------
def tensor_transform():
    """The same augmentation on uint8 tensors (torchvision.transforms.v2): what ``tensor_loader`` feeds."""
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])


def gpu_benchmark(args: argparse.Namespace, zip_path: Path, extracted: Path) -> dict:
    """ResNet-50 steps fed by each input pipeline; ``--gpu-device cpu`` runs the same code as a smoke test.

    Pipelines (each with its own DataLoader, workers shut down before the next):
    - ``archive-tensor``: ArchiveImageFolder + tensor_loader + v2 transforms (the one the target is for);
    - ``archive-pil``: ArchiveImageFolder with the default PIL loader and PIL transforms;
    - ``extracted-tensor``: torchvision ImageFolder over the extracted tree, same decoder and transforms.
    For each: feed-only images/s (batches drawn with no model running, i.e. what the CPUs can supply),
    then a fresh epoch of training steps with the consumer's wait timed around every ``next()``.
    """
    import torch
    import torchvision
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    from cdmlfs_torch import ArchiveImageFolder, GPUPrefetchLoader, tensor_loader

    device = torch.device(args.gpu_device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu: CUDA is not available, GPU part skipped", flush=True)
        return {"skipped": "no CUDA"}
    on_cuda = device.type == "cuda"

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize(device)

    torch.backends.cudnn.benchmark = True
    workers = args.gpu_workers or max(2, (os.cpu_count() or 4) - 2)
    pipelines = {
        "archive-tensor": lambda: ArchiveImageFolder(
            f"{zip_path}::train", loader=tensor_loader, transform=tensor_transform()
        ),
        "archive-pil": lambda: ArchiveImageFolder(
            f"{zip_path}::train", transform=train_transform(to_tensor=False)
        ),
        "extracted-tensor": lambda: ImageFolder(
            str(extracted), loader=tensor_loader, transform=tensor_transform()
        ),
    }
    classes = len(pipelines["archive-tensor"]().classes)
    model = torchvision.models.resnet50(num_classes=classes).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    # The model alone: one resident batch, no input pipeline.
    x0 = torch.randn(args.gpu_batch, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last)
    y0 = torch.randint(0, classes, (args.gpu_batch,), device=device)
    for _ in range(args.gpu_warmup):
        step(x0, y0)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.gpu_steps):
        step(x0, y0)
    sync()
    ideal = (time.perf_counter() - t0) / args.gpu_steps
    result: dict = {
        "device": torch.cuda.get_device_name(device) if on_cuda else str(device),
        "batch": args.gpu_batch,
        "workers": workers,
        "images": args.images,
        "model_only_step_ms": 1e3 * ideal,
        "model_only_images_per_s": args.gpu_batch / ideal,
        "pipelines": {},
    }
    print(
        f"gpu: {result['device']}: model alone {1e3 * ideal:.1f} ms/step = "
        f"{args.gpu_batch / ideal:.0f} images/s to keep fed; {workers} workers",
        flush=True,
    )
    for name, make in pipelines.items():
        if args.gpu_pipelines and name not in args.gpu_pipelines:
            continue
        loader = DataLoader(
            make(),
            batch_size=args.gpu_batch,
            shuffle=True,
            num_workers=workers,
            pin_memory=on_cuda,
            drop_last=True,
            persistent_workers=True,
            prefetch_factor=4,
        )
        feed = GPUPrefetchLoader(loader, device=device, prefetch=3, mean=MEAN, std=STD, channels_last=True)
        try:
            r = fed_training(feed, step, sync, args, profile=name == "archive-tensor", on_cuda=on_cuda)
        finally:
            it = getattr(loader, "_iterator", None)
            if it is not None:
                it._shutdown_workers()
        r["slowdown_vs_model_only"] = r["fed_step_ms"] / (1e3 * ideal) - 1
        result["pipelines"][name] = r
        overlap = r.get("copy_overlap", {}).get("overlapped_fraction")
        print(
            f"gpu: {name}: feed alone {r['feed_only_images_per_s']:.0f} images/s; training "
            f"{r['fed_step_ms']:.1f} ms/step, {r['images_per_s']:.0f} images/s, "
            f"data stall {r['data_stall']:.1%}"
            f" (wait p50 {r['wait_ms_p50']:.2f} ms, max {r['wait_ms_max']:.1f} ms, "
            f"{r['epoch_ends_in_window']} epoch ends in the window)"
            + ("" if overlap is None else f"; H2D copy time overlapping kernels {overlap:.0%}"),
            flush=True,
        )
    if on_cuda:
        result["nvjpeg_probe"] = nvjpeg_probe(extracted, args.gpu_batch, device)
    return result


def fed_training(feed, step, sync, args: argparse.Namespace, profile: bool, on_cuda: bool) -> dict:
    """Feed-only rate for a few batches, then a fresh epoch of timed training steps."""
    epoch_ends = 0

    def batches() -> Iterator[tuple]:
        nonlocal epoch_ends
        while True:
            yield from feed
            epoch_ends += 1

    it = batches()
    for _ in range(5):
        next(it)
    sync()
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        next(it)
    sync()
    feed_only = n * args.gpu_batch / (time.perf_counter() - t0)
    del it  # a fresh epoch for the training steps

    it = batches()
    for _ in range(args.gpu_warmup):
        step(*next(it))
    sync()
    ends_before = epoch_ends
    waits = []
    t0 = time.perf_counter()
    for _ in range(args.gpu_steps):
        w0 = time.perf_counter()
        x, y = next(it)
        waits.append(time.perf_counter() - w0)
        step(x, y)
    sync()
    fed = (time.perf_counter() - t0) / args.gpu_steps
    out = {
        "feed_only_images_per_s": feed_only,
        "fed_step_ms": 1e3 * fed,
        "images_per_s": args.gpu_batch / fed,
        "data_stall": sum(waits) / (fed * args.gpu_steps),
        "wait_ms_p50": 1e3 * statistics.median(waits),
        "wait_ms_max": 1e3 * max(waits),
        "epoch_ends_in_window": epoch_ends - ends_before,
    }
    if profile:
        out["copy_overlap"] = profile_overlap(lambda: step(*next(it)), steps=8, cuda=on_cuda)
    return out


def nvjpeg_probe(extracted: Path, batch: int, device) -> dict:
    """Batched JPEG decode on the GPU (nvjpeg via torchvision.io): images/s, as a lead for GPU decoding."""
    import torch
    from torchvision.io import decode_jpeg

    files = sorted(extracted.rglob("*.jpg"))[: batch * 4]
    datas = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in files]
    chunks = [datas[i : i + batch] for i in range(0, len(datas) - batch + 1, batch)]
    try:
        for c in chunks:
            decode_jpeg(c, device=device)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(3):
            for c in chunks:
                decode_jpeg(c, device=device)
        torch.cuda.synchronize(device)
        rate = 3 * len(chunks) * batch / (time.perf_counter() - t0)
    except Exception as exc:  # a probe: report, do not fail the benchmark
        print(f"gpu: nvjpeg probe failed: {exc}", flush=True)
        return {"error": str(exc)}
    print(f"gpu: nvjpeg batched decode (main thread, batch {batch}): {rate:.0f} images/s", flush=True)
    return {"images_per_s": rate}


def profile_overlap(run_step: Callable[[], object], steps: int, cuda: bool = True) -> dict:
    """Share of host-to-device copy time during which some compute kernel was running (profiler trace)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run_step()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as f:
            events = json.load(f).get("traceEvents", [])
    return copy_overlap_from_trace(events)


def copy_overlap_from_trace(events: list[dict]) -> dict:
    """From chrome-trace events: H2D copies, kernels, and how much copy time overlapped kernels."""

    def span(e: dict) -> tuple[float, float]:
        return float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))

    kernels = sorted(span(e) for e in events if e.get("cat") == "kernel")
    copies = [
        (span(e), e.get("args", {}).get("stream"))
        for e in events
        if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")
    ]
    merged: list[list[float]] = []
    for a, b in kernels:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    copy_time = sum(b - a for (a, b), _ in copies)
    overlapped = 0.0
    for (a, b), _ in copies:
        for ka, kb in merged:
            if kb <= a:
                continue
            if ka >= b:
                break
            overlapped += min(b, kb) - max(a, ka)
    kernel_streams = {e.get("args", {}).get("stream") for e in events if e.get("cat") == "kernel"}
    return {
        "h2d_copies": len(copies),
        "h2d_copy_ms": copy_time / 1e3,
        "overlapped_fraction": overlapped / copy_time if copy_time else 0.0,
        "copy_streams": sorted({s for _, s in copies if s is not None}),
        "kernel_streams": sorted(s for s in kernel_streams if s is not None),
    }


# -- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=3000, help="synthetic JPEGs (default 3000)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5, help="measured rounds per variant (default 5)")
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workdir", type=Path, help="keep the dataset here (reused when present)")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU comparison (and the mount)")
    p.add_argument("--gpu", action="store_true", help="also run the ResNet-50 data-stall benchmark")
    p.add_argument("--gpu-batch", type=int, default=64)
    p.add_argument("--gpu-steps", type=int, default=100)
    p.add_argument("--gpu-warmup", type=int, default=30)
    p.add_argument("--gpu-workers", type=int, default=0, help="DataLoader workers (default: cores - 2)")
    p.add_argument("--gpu-device", default="cuda", help="'cpu' runs the GPU part's code as a smoke test")
    p.add_argument(
        "--gpu-pipelines",
        nargs="*",
        default=[],
        help="only these (archive-tensor, archive-pil, extracted-tensor)",
    )
    p.add_argument("--json", type=Path, help="write all figures here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: unmount

    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cdmlfs-bench-")))
        else:
            workdir = args.workdir
            workdir.mkdir(parents=True, exist_ok=True)
        zip_path, extracted = build_data(workdir, args.images, args.classes, args.seed)
        results: dict = {"config": {k: str(v) for k, v in vars(args).items()}}
        ok = True
        if not args.no_cpu:
            print(f"cpu: {args.workers} workers, batch {args.batch}, {os.cpu_count()} cores", flush=True)
            cpu = cpu_benchmark(args, zip_path, extracted, workdir)
            results["cpu"] = cpu
            med = cpu["median_images_per_s"]
            print("cpu: median images/s " + ", ".join(f"{n} {v:.0f}" for n, v in med.items()))
            for n in ("archive", "mount"):
                ratio = cpu[f"{n}_median_paired_ratio"]
                verdict = "ok" if ratio >= 0.9 else "BELOW TARGET"
                print(
                    f"cpu: {n} / extracted = {ratio:.1%} (median of per-round ratios; "
                    f"ratio of medians {cpu[f'{n}_ratio_of_medians']:.1%}) target >= 90%: {verdict}"
                )
                ok &= ratio >= 0.9
            costs = ", ".join(f"{n} {v:.2f}" for n, v in cpu["median_cpu_ms_per_image"].items())
            print(f"cpu: median CPU ms per image (workers + main + FUSE daemon) {costs}")
            for n in ("archive", "mount"):
                print(f"cpu: {n} CPU efficiency vs extracted {cpu[f'{n}_cpu_efficiency']:.1%}")
            listing = {k: round(v, 3) for k, v in cpu["listing_s"].items()}
            print(f"cpu: dataset listing seconds {json.dumps(listing)}")
        if args.gpu:
            gpu = gpu_benchmark(args, zip_path, extracted)
            results["gpu"] = gpu
            main_pipeline = gpu.get("pipelines", {}).get("archive-tensor")
            if main_pipeline is not None:
                stall = main_pipeline["data_stall"]
                verdict = "ok" if stall <= 0.05 else "ABOVE TARGET"
                print(f"gpu: archive-tensor data stall {stall:.1%} (target <= 5%): {verdict}")
                print("gpu: " + json.dumps(gpu))
                ok &= stall <= 0.05
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
