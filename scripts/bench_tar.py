#!/usr/bin/env python3
"""Benchmark tar.zst serving: cdmlfs vs ratarmount, and archive-order reading vs ``zstd -dc | tar -x``.

What it measures (all through real FUSE mounts; each archive is read into the page cache before
every tool's round, for every tool alike):

1. **random member reads** — a shuffled epoch (every member once, in the same
   random order for every tool; ``--random N`` reads only the first N), each
   file opened and read whole from a fresh mount: per-read latency (median,
   p90) and files/s. For cdmlfs, the reads that are the first to touch their
   zstd frame are reported separately: each costs exactly one frame decode.
   The decoded data (~420 MB) fits cdmlfs's default 512 MiB cache; a run with
   a 64 MiB cache (first 2,000 reads of the epoch) shows the cost once frames
   get evicted.
2. **read-all** — walk the mount and read every file (fresh mount): files/s, MB/s.
   Tools: cdmlfs and ratarmount on the same seekable 4 MiB-frame archive written
   by ``cdmlfs pack``, and on a ``pzstd`` archive of the same tar.
3. **archive order from a single-frame tar.zst** (what ``tar --zstd`` writes):
   cdmlfs reading every member in ``Archive.archive_order()`` through the
   Python API (what ``cdmlfs_torch`` does with ``ArchiveOrderSampler``; a fresh
   ``Archive`` each round) and through the mount, versus ``zstd -dc | tar -x``
   into tmpfs (/dev/shm). Through the mount every member costs FUSE round trips
   (lookup, read) on top of the decode: one reader waits for each in turn; four
   readers taking members in turn (DataLoader workers on ArchiveOrderSampler)
   overlap them, and requests still reach the decoder in archive order.
   "listed first" times a walk of the whole mount and then the reads, as a
   dataset over the mount does (ImageFolder lists its folders before it reads):
   the listing returns every entry's attributes, so the opens that follow need
   no lookup each.

The machine is shared and small: tools alternate round by round and the
figures are medians over rounds; ratios are against baselines measured in the
same run. Nothing here asserts a time: it prints figures.

    .venv/bin/python scripts/bench_tar.py [--files 20000] [--rounds 3] [--random 1000]

ratarmount is installed with pip into its own venv (``--ratarmount-venv``,
default /tmp/bench-venvs/ratarmount) when missing.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from mountutil import await_exit  # noqa: E402 (tests/, the path fix above)
from ratarmount_venv import DEFAULT_VENV, ForegroundMount, ensure_ratarmount, unmount  # noqa: E402 (scripts/, this file's directory)

from cdmlfs.mountpoints import is_mounted  # noqa: E402 (after the path fix above)
from cdmlfs.statsio import read as mount_stats  # noqa: E402

PY = sys.executable


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- dataset -------------------------------------------------------------------------------
def make_tar(path: Path, n_files: int, seed: int = 0) -> tuple[int, int]:
    """A tar of ``n_files`` members like an image/text dataset: half incompressible, half text."""
    rng = random.Random(seed)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"tensor", b"batch", b"epoch", b"loss", b"grad", b"zip"]
    pool = bytearray()
    while len(pool) < 4 << 20:
        pool += rng.choice(words) + (b"\n" if rng.random() < 0.1 else b" ")
    pool = bytes(pool)
    total = 0
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for i in range(n_files):
            size = int(min(max(rng.lognormvariate(9.6, 0.8), 1024), 256 << 10))  # median ~15 KB
            if i % 2:
                data = rng.randbytes(size)  # "jpeg"
                name = f"class{i % 100:03d}/img{i:06d}.jpg"
            else:
                start = rng.randrange(0, len(pool) - size)
                data = pool[start : start + size]
                name = f"class{i % 100:03d}/txt{i:06d}.txt"
            info = tarfile.TarInfo(name)
            info.size = size
            info.mtime = 1_600_000_000
            tf.addfile(info, io.BytesIO(data))
            total += size
    return n_files, total


# -- mounts ---------------------------------------------------------------------------------
class Mount:
    """One tool's mount for one round. ``foreground``: the command serves until unmounted (run with
    Popen); else it daemonises and writes its pid to ``pid_file``. Either way the next round starts
    only once the server has exited (a daemon tearing down competes with it for the 2 cores)."""

    def __init__(
        self,
        cmd: list[str],
        mnt: Path,
        archive: Path,
        index_dir: Path | None = None,
        foreground: bool = False,
        pid_file: Path | None = None,
    ) -> None:
        self.cmd = cmd
        self.mnt = mnt
        self.archive = archive
        self.index_dir = index_dir  # an on-disk index read during the rounds: warmed as well
        self.foreground = foreground
        self.pid_file = pid_file
        self._server: ForegroundMount | None = None
        self._pid: int | None = None

    def __enter__(self) -> Path:
        warm(self.archive)
        if self.index_dir is not None:
            for index_file in self.index_dir.iterdir():
                if index_file.is_file() and self.archive.name in index_file.name:
                    warm(index_file)
        if self.foreground:
            log = self.mnt.parent / f"{self.mnt.name}.log"
            self._server = ForegroundMount(self.cmd, self.mnt, log, timeout=600)
            self._server.__enter__()
            return self.mnt
        self.mnt.mkdir(parents=True, exist_ok=True)
        unmount(self.mnt)
        res = subprocess.run(self.cmd, capture_output=True, text=True)
        if res.returncode != 0 or not is_mounted(self.mnt):
            raise RuntimeError(f"mount failed: {' '.join(self.cmd)}\n{res.stderr}")
        if self.pid_file is not None:
            self._pid = int(self.pid_file.read_text().split()[0])
        return self.mnt

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:  # unmounts, then waits for the server (30 s, then kills it)
            self._server.__exit__()
            self._server = None
            return
        unmount(self.mnt)
        if self._pid is not None:
            await_exit(self._pid, 30)
            self._pid = None


def cdmlfs_mount(archive: Path, mnt: Path, index_dir: Path, *extra: str) -> Mount:
    pid_file = mnt.parent / f".{mnt.name}.pid"
    cmd = [PY, "-m", "cdmlfs", "mount", str(archive), str(mnt), "--index-dir", str(index_dir)]
    return Mount([*cmd, "--pid-file", str(pid_file), *extra], mnt, archive, pid_file=pid_file)


def ratarmount_mount(ratarmount: Path, archive: Path, mnt: Path, index_dir: Path) -> Mount:
    # -f: ratarmount refuses to daemonise once it has threads open (its own message says to use -f).
    cmd = [str(ratarmount), "-f", "--index-folders", str(index_dir), str(archive), str(mnt)]
    return Mount(cmd, mnt, archive, index_dir, foreground=True)  # its SQLite index is read on every lookup


def warm(path: Path) -> None:
    """Read a whole archive into the page cache before a tool's round: this VM reclaims cold page
    cache proactively (a kdamond pages it out), and a round that reads from disk measures the disk."""
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass


def read_file(path: Path) -> int:
    with open(path, "rb", buffering=0) as f:
        n = 0
        while chunk := f.read(1 << 20):
            n += len(chunk)
        return n


def random_reads(mnt: Path, sample: list[str], sizes: dict[str, int]) -> list[float]:
    """Seconds per file; every file must come back whole (a tool answering short must not look fast)."""
    times = []
    got = 0
    for name in sample:
        t = time.perf_counter()
        got += read_file(mnt / name)
        times.append(time.perf_counter() - t)
    want = sum(sizes[name] for name in sample)
    if got != want:
        raise RuntimeError(f"{mnt}: read {got} bytes of {want}")
    return times


def read_all(mnt: Path) -> tuple[int, int, float]:
    t = time.perf_counter()
    files = total = 0
    for dirpath, _, filenames in os.walk(mnt):
        for name in filenames:
            total += read_file(Path(dirpath) / name)
            files += 1
    return files, total, time.perf_counter() - t


def read_in_order(mnt: Path, order: list[str]) -> tuple[int, float]:
    t = time.perf_counter()
    total = sum(read_file(mnt / name) for name in order)
    return total, time.perf_counter() - t


def list_then_read_in_order(mnt: Path, order: list[str]) -> tuple[int, float]:
    """Walk the whole mount (timed, as a dataset lists before it reads), then read in archive order."""
    t = time.perf_counter()
    for _ in os.walk(mnt):
        pass
    total, _ = read_in_order(mnt, order)
    return total, time.perf_counter() - t


def read_in_order_threads(mnt: Path, order: list[str], threads: int) -> tuple[int, float]:
    """Archive order with ``threads`` readers taking the next member in turn (how DataLoader
    workers fed by ArchiveOrderSampler read): requests still reach the decoder in archive order,
    a few at a time, so the FUSE round trips of one file overlap those of the next."""
    import threading

    it = iter(order)
    lock = threading.Lock()
    total = [0]

    def work() -> None:
        got = 0
        while True:
            with lock:
                name = next(it, None)
            if name is None:
                break
            got += read_file(mnt / name)
        with lock:
            total[0] += got

    t = time.perf_counter()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return total[0], time.perf_counter() - t


def read_in_order_api(archive: Path, index_dir: Path, order: list[str]) -> tuple[int, float]:
    from cdmlfs.archive import Archive

    warm(archive)
    with Archive(str(archive), index_dir=str(index_dir)) as ar:
        t = time.perf_counter()
        total = sum(len(ar.read(name)) for name in order)
        return total, time.perf_counter() - t


def pipeline_extract(archive: Path, dest: Path) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    warm(archive)
    t = time.perf_counter()
    subprocess.run(f"zstd -dc '{archive}' | tar -x -C '{dest}'", shell=True, check=True)
    elapsed = time.perf_counter() - t
    shutil.rmtree(dest, ignore_errors=True)
    return elapsed


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# -- main --------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--random", type=int, default=0, help="random reads per round and tool (0: all, an epoch)"
    )
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cdmlfs-bench-tar"))
    ap.add_argument("--shm", type=Path, default=Path("/dev/shm/cdmlfs-bench-tar"))
    ap.add_argument("--ratarmount-venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--skip-ratarmount", action="store_true")
    args = ap.parse_args()

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    plain = work / f"data-{args.files}.tar"
    seekable = work / f"seekable-{args.files}.tar.zst"
    pz = work / f"pzstd-{args.files}.tar.zst"
    single = work / f"single-{args.files}.tar.zst"
    cidx, ridx = work / "cdmlfs-index", work / "ratarmount-index"
    ridx.mkdir(exist_ok=True)
    if not plain.exists():
        log(f"writing {plain} ...")
        make_tar(plain, args.files)
    if not seekable.exists():
        t = time.perf_counter()
        subprocess.run([PY, "-m", "cdmlfs", "pack", "-q", str(plain), str(seekable)], check=True)
        log(f"cdmlfs pack: {time.perf_counter() - t:.1f}s")
    if not pz.exists():
        subprocess.run(f"pzstd -q -p 2 -c '{plain}' > '{pz}'", shell=True, check=True)
    if not single.exists():  # streamed like tar --zstd: one frame, no content size
        subprocess.run(f"zstd -q -T2 -c < '{plain}' > '{single}'", shell=True, check=True)

    from cdmlfs.archive import Archive

    with Archive(str(seekable), index_dir=str(cidx)) as ar:
        members = ar.files()
        sizes = {p: ar.stat(p).size for p in members}
        fr = ar.format.stream.frames
        import bisect

        frame_of = {
            p: bisect.bisect_right(fr.dec_offset, ar.index.offset[ar.index.lookup(p)]) - 1 for p in members
        }
        data_bytes = ar.index.total_file_bytes()
        n_frames = len(fr)
    for path in (pz, single):
        t = time.perf_counter()
        with Archive(str(path), index_dir=str(cidx)) as ar:
            first_index = time.perf_counter() - t
            if path == single:
                order = ar.archive_order()
            how = ar.format.index_source
        log(f"cdmlfs open of {path.name}: {first_index:.2f}s (index from {how})")
    # The single-frame archive's index costs one decode pass of its own, once (then persisted):
    # timed here from scratch so the archive-order ratios can be shown with it too.
    import tempfile

    with tempfile.TemporaryDirectory() as fresh:
        warm(single)
        t = time.perf_counter()
        with Archive(str(single), index_dir=fresh) as ar:
            single_scan_s = time.perf_counter() - t
            assert ar.format.index_source == "scan"
    log(f"cdmlfs index scan of {single.name}: {single_scan_s:.2f}s")

    ratarmount = None if args.skip_ratarmount else ensure_ratarmount(args.ratarmount_venv, say=log)
    mnt = work / "mnt"
    tools: dict[str, Mount] = {
        "cdmlfs/seekable": cdmlfs_mount(seekable, mnt, cidx),
        "cdmlfs/seekable, 64M cache": cdmlfs_mount(seekable, mnt, cidx, "--cache-size", "64M"),
        "cdmlfs/pzstd": cdmlfs_mount(pz, mnt, cidx),
    }
    if ratarmount is not None:
        tools["ratarmount/seekable"] = ratarmount_mount(ratarmount, seekable, mnt, ridx)
        tools["ratarmount/pzstd"] = ratarmount_mount(ratarmount, pz, mnt, ridx)
        for name in ("ratarmount/seekable", "ratarmount/pzstd"):  # build their indexes outside the timing
            t = time.perf_counter()
            with tools[name]:
                pass
            log(f"{name} first mount (index build): {time.perf_counter() - t:.2f}s")

    rng = random.Random(1)
    results: dict[str, dict[str, list[float]]] = {name: {} for name in tools}
    results["cdmlfs/single-frame archive order, api"] = {}
    results["cdmlfs/single-frame archive order, mount"] = {}
    results["cdmlfs/single-frame archive order, mount, 4 readers"] = {}
    results["cdmlfs/single-frame archive order, mount, listed first"] = {}
    results["zstd -dc | tar -x (tmpfs)"] = {}

    def add(tool: str, key: str, value: float) -> None:
        results[tool].setdefault(key, []).append(value)

    names = list(tools)
    for r in range(args.rounds):
        sample = rng.sample(members, min(args.random or len(members), len(members)))
        order_of_tools = names[r % len(names) :] + names[: r % len(names)]
        for tool in order_of_tools:
            reads = sample[:2000] if "64M" in tool else sample  # mostly one decode per read: keep it short
            with tools[tool] as m:
                times = random_reads(m, reads, sizes)
                if tool.startswith("cdmlfs/seekable"):
                    decoder = mount_stats(str(m))["decoder"]
                    started = decoder["frame_decodes"] + decoder.get("early_frames", 0)
                    add(tool, "frame decodes per frame touched", started / len({frame_of[n] for n in reads}))
            # The first 2,000 reads of the sample: what the 64 MiB-cache run reads (same members).
            add(tool, "random files/s, first 2000", min(len(times), 2000) / sum(times[:2000]))
            add(tool, "random median ms", 1e3 * statistics.median(times))
            add(tool, "random p90 ms", 1e3 * pct(times, 0.9))
            add(tool, "random files/s", len(times) / sum(times))
            if tool.startswith("cdmlfs/seekable"):
                seen: set[int] = set()
                cold = []
                for name, t in zip(reads, times):
                    if frame_of[name] not in seen:
                        seen.add(frame_of[name])
                        cold.append(t)
                add(tool, "first read of a frame median ms", 1e3 * statistics.median(cold))
            if "64M" in tool:
                log(f"round {r + 1}: {tool} done")
                continue
            with tools[tool] as m:
                files, total, elapsed = read_all(m)
            if (files, total) != (len(members), data_bytes):
                raise RuntimeError(f"{tool}: read-all gave {files} files, {total} bytes")
            add(tool, "read-all files/s", files / elapsed)
            add(tool, "read-all MB/s", total / elapsed / 1e6)
            log(f"round {r + 1}: {tool} done")
        # archive order from a single frame vs the pipeline, alternating which goes first
        steps = ["pipe", "api", "mount", "mount, 4 readers", "mount, listed first"]
        for step in steps[r % len(steps) :] + steps[: r % len(steps)]:
            if step == "pipe":
                elapsed = pipeline_extract(single, args.shm)
                add("zstd -dc | tar -x (tmpfs)", "MB/s", data_bytes / elapsed / 1e6)
                add("zstd -dc | tar -x (tmpfs)", "files/s", len(members) / elapsed)
                continue
            if step == "api":
                total, elapsed = read_in_order_api(single, cidx, order)
            elif step == "mount":
                with cdmlfs_mount(single, mnt, cidx) as m:
                    total, elapsed = read_in_order(m, order)
            elif step == "mount, listed first":
                with cdmlfs_mount(single, mnt, cidx) as m:
                    total, elapsed = list_then_read_in_order(m, order)
            else:
                with cdmlfs_mount(single, mnt, cidx) as m:
                    total, elapsed = read_in_order_threads(m, order, 4)
            if total != data_bytes:
                raise RuntimeError(f"single-frame archive order, {step}: {total} of {data_bytes} bytes")
            add(f"cdmlfs/single-frame archive order, {step}", "MB/s", total / elapsed / 1e6)
            add(f"cdmlfs/single-frame archive order, {step}", "files/s", len(order) / elapsed)
        log(f"round {r + 1}: single-frame archive order done")

    med = {tool: {k: statistics.median(v) for k, v in vals.items()} for tool, vals in results.items()}
    print(f"\n# tar.zst benchmark — {len(members)} files, {data_bytes / 1e6:.0f} MB of member data, ", end="")
    print(f"seekable archive: {n_frames} frames; {args.rounds} rounds, medians; {os.cpu_count()} cores")
    for path in (plain, seekable, pz, single):
        print(f"#   {path.name}: {path.stat().st_size / 1e6:.0f} MB")
    for tool, vals in med.items():
        print(f"{tool}:")
        for key, value in vals.items():
            print(f"    {key:34s} {value:10.2f}")
    print("ratios:")
    c = med["cdmlfs/seekable"]
    print(f"    first read of a frame, median                 {c['first read of a frame median ms']:.2f} ms")
    # Same archive, both tools; then each tool on the archive it serves best (cdmlfs's packed
    # archive vs pzstd's, which ratarmount reads as well as any).
    pairs = [("cdmlfs/seekable", "ratarmount/seekable"), ("cdmlfs/pzstd", "ratarmount/pzstd"),
             ("cdmlfs/seekable", "ratarmount/pzstd")]  # fmt: skip
    for mine, other in pairs:
        if mine in med and other in med:
            for key in ("random files/s", "read-all files/s"):
                ratio = med[mine][key] / med[other][key]
                print(f"    {key:16s} {mine:15s} vs {other:20s} {ratio:6.1f}x")
    # The decoded archive fits the default cache: past ~100 first reads every read is a cache hit.
    # With 64 MiB it does not: the same first 2,000 reads of each round, both tools.
    small, other = "cdmlfs/seekable, 64M cache", "ratarmount/seekable"
    if small in med and other in med:
        key = "random files/s, first 2000"
        print(f"    {key} {small} vs {other} {med[small][key] / med[other][key]:6.1f}x")
    # Each read decodes at most one frame (or a prefix of one); above 1.00 per frame, frames kept
    # partial were let go and decoded again when they came back (then finished and cached).
    print(f"    frame decodes started per frame touched      {c['frame decodes per frame touched']:.2f}")
    p = med["zstd -dc | tar -x (tmpfs)"]
    print(f"    single-frame archive order vs zstd|tar MB/s (index persisted; with its one-time "
          f"{single_scan_s:.1f} s scan):")  # fmt: skip
    for way in ("API", "mount", "mount, 4 readers", "mount, listed first"):
        s = med[f"cdmlfs/single-frame archive order, {way.lower() if way == 'API' else way}"]
        with_scan = data_bytes / (data_bytes / (s["MB/s"] * 1e6) + single_scan_s) / 1e6
        print(f"        {way:19s} {s['MB/s'] / p['MB/s']:.2f}   (with the scan {with_scan / p['MB/s']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
