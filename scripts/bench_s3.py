#!/usr/bin/env python3
"""Benchmark S3 reads against a localbucket server on 127.0.0.1 (numbers printed, nothing asserted).

Two measurements on one ZIP object (~1 GiB stored member plus many 2 KiB members):

1. **Random small members**: 100 random 2 KiB members read through a fresh
   FUSE mount, cdmlfs versus ratarmount's S3 support (fsspec/s3fs) on the same
   object. Bytes are counted at the endpoint by a counting proxy placed between
   the client and localbucket; mount (index) bytes and time are reported apart
   from the 100 reads. Target: bytes requested <= 2x bytes needed + the central
   directory.
2. **Sequential read of the 1 GiB member**: cdmlfs (Python API and FUSE mount)
   versus raw boto3 parallel range GETs of the same byte range, direct to
   localbucket (8 or 16 threads, 8 or 16 MiB parts; the fastest is the baseline). Target:
   cdmlfs >= 80% of raw throughput.
3. **Random small members, 8 threads, through a mount**: files/s and CPU per
   file (reader + daemon) with ranged GETs by presigned URL (the default)
   versus every GET through boto3's ``get_object`` (``CDMLFS_S3_PRESIGNED=0``).

Rounds alternate between contenders (the machine is shared and small); medians
are reported, and every ratio compares figures measured in this run.

    .venv/bin/python scripts/bench_s3.py [--rounds 3] [--ratarmount /path/to/ratarmount]

ratarmount is installed with pip, with s3fs for its S3 support, into its own venv (the default
``--ratarmount`` path's, /tmp/bench-venvs/ratarmount) when it is missing there or lacks s3fs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from mountutil import mounted  # noqa: E402
from ratarmount_venv import DEFAULT_VENV, ForegroundMount, ensure_ratarmount  # noqa: E402 (scripts/, this file's directory)
from s3util import DUMMY_ENV, FaultProxy, dummy_credentials, start_localbucket  # noqa: E402

MiB = 1 << 20
BUCKET = "bench"
KEY = "data.zip"
BIG = "big/blob.bin"


# -- data ------------------------------------------------------------------------------------------
def build_zip(path: Path, big_bytes: int, small_count: int, small_size: int) -> None:
    """Stored members: ``small_count`` random members of ``small_size`` bytes, then one big member."""
    if path.exists():
        return
    print(
        f"building {path} ({big_bytes / 2**30:.2f} GiB member + {small_count} x {small_size} B) ...",
        flush=True,
    )
    tmp = path.with_suffix(".tmp")
    rng = random.Random(0)
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for i in range(small_count):
            zf.writestr(f"small/d{i // 1000:03d}/m{i:06d}.bin", rng.randbytes(small_size))
        info = zipfile.ZipInfo(BIG, date_time=(2024, 1, 1, 0, 0, 0))
        with zf.open(info, "w", force_zip64=True) as w:
            left = big_bytes
            while left:
                n = min(8 * MiB, left)
                w.write(os.urandom(n))
                left -= n
    tmp.rename(path)


def zip_layout(path: Path) -> tuple[list[zipfile.ZipInfo], int, int, int]:
    """(small members, central directory size, big member data offset, big member size)."""
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        cd_size = path.stat().st_size - zf.start_dir
        big = zf.getinfo(BIG)
    with open(path, "rb") as f:
        f.seek(big.header_offset + 26)
        nlen, xlen = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    data_at = big.header_offset + 30 + nlen + xlen
    return [i for i in infos if i.filename != BIG], cd_size, data_at, big.file_size


# -- random members through FUSE mounts ------------------------------------------------------------
def read_members(mnt: Path, names: list[str]) -> tuple[float, int]:
    started = time.perf_counter()
    total = 0
    for name in names:
        with open(mnt / name, "rb") as f:
            total += len(f.read())
    return time.perf_counter() - started, total


def cdmlfs_random(proxy: FaultProxy, names: list[str], work: Path) -> dict:
    proxy.reset_stats()
    mnt = work / "mnt-cdmlfs"
    started = time.perf_counter()
    with mounted(f"s3://{BUCKET}/{KEY}", mnt, "--endpoint-url", proxy.url, log_file=work / "cdmlfs.log"):
        mount_s = time.perf_counter() - started
        mount_bytes, mount_reqs = proxy.stats.body_bytes, proxy.stats.requests
        proxy.reset_stats()
        read_s, got = read_members(mnt, names)
        read_bytes, read_reqs = proxy.stats.body_bytes, proxy.stats.requests
    return {"mount_s": mount_s, "mount_bytes": mount_bytes, "mount_requests": mount_reqs,
            "read_s": read_s, "read_bytes": read_bytes, "read_requests": read_reqs, "got": got}  # fmt: skip


def ratarmount_random(ratarmount: str, proxy: FaultProxy, names: list[str], work: Path) -> dict:
    proxy.reset_stats()
    index_dir = work / "ratarmount-index"
    shutil.rmtree(index_dir, ignore_errors=True)
    index_dir.mkdir()
    env = {**os.environ, **DUMMY_ENV, "FSSPEC_S3_ENDPOINT_URL": proxy.url}
    mnt = work / "mnt-ratarmount"
    cmd = [ratarmount, "-f", "--index-folders", str(index_dir), f"s3://{BUCKET}/{KEY}", str(mnt)]
    with ForegroundMount(cmd, mnt, work / "ratarmount.log", env=env, timeout=900) as server:
        mount_bytes, mount_reqs = proxy.stats.body_bytes, proxy.stats.requests
        proxy.reset_stats()
        read_s, got = read_members(mnt, names)
        read_bytes, read_reqs = proxy.stats.body_bytes, proxy.stats.requests
    return {"mount_s": server.mount_s, "mount_bytes": mount_bytes, "mount_requests": mount_reqs,
            "read_s": read_s, "read_bytes": read_bytes, "read_requests": read_reqs, "got": got}  # fmt: skip


# -- sequential ------------------------------------------------------------------------------------
def process_cpu(pid: int) -> float:
    """user + system CPU seconds of a live process (the endpoint, the FUSE daemon)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def own_cpu() -> float:
    return sum(os.times()[:2])


def raw_boto3(url: str, start: int, size: int, workers: int, part: int) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) for parallel ranged GETs of [start, start + size)."""
    import boto3
    from botocore.config import Config

    config = Config(
        s3={"addressing_style": "path"}, max_pool_connections=workers, retries={"total_max_attempts": 1}
    )
    client = boto3.client("s3", endpoint_url=url, config=config)
    client.head_object(Bucket=BUCKET, Key=KEY)  # connection and credentials outside the timing

    def get(off: int) -> int:
        end = min(off + part, start + size) - 1
        body = client.get_object(Bucket=BUCKET, Key=KEY, Range=f"bytes={off}-{end}")["Body"]
        return len(body.read())

    cpu0, started = own_cpu(), time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        got = sum(pool.map(get, range(start, start + size, part)))
    elapsed, cpu = time.perf_counter() - started, own_cpu() - cpu0
    assert got == size, (got, size)
    return elapsed, cpu


def cdmlfs_api(url: str, size: int, chunk: int = 1 * MiB) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) to read the big member with readinto, 1 MiB at a time."""
    from cdmlfs.archive import Archive

    with Archive(f"s3://{BUCKET}/{KEY}", endpoint_url=url) as archive:
        cpu0, started = own_cpu(), time.perf_counter()
        got = 0
        with archive.open(BIG) as f:
            buf = bytearray(chunk)
            while n := f.readinto(buf):
                got += n
        elapsed, cpu = time.perf_counter() - started, own_cpu() - cpu0
    assert got == size, (got, size)
    return elapsed, cpu


def cdmlfs_fuse(url: str, size: int, work: Path, chunk: int = 1 * MiB) -> tuple[float, float]:
    """(seconds, CPU seconds of the reader and the daemon) to read the big member through a mount."""
    pid_file = work / ".mnt-seq.pid"
    with mounted(
        f"s3://{BUCKET}/{KEY}", work / "mnt-seq", "--endpoint-url", url, log_file=work / "seq.log"
    ) as mnt:
        daemon = int(pid_file.read_text().split()[0])
        cpu0, started = own_cpu() + process_cpu(daemon), time.perf_counter()
        got = 0
        fd = os.open(mnt / BIG, os.O_RDONLY)
        try:
            while n := len(os.read(fd, chunk)):
                got += n
        finally:
            os.close(fd)
        elapsed, cpu = time.perf_counter() - started, own_cpu() + process_cpu(daemon) - cpu0
    assert got == size, (got, size)
    return elapsed, cpu


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "cdmlfs-bench-s3")
    ap.add_argument("--big-mib", type=int, default=1024, help="size of the big member (default 1024 MiB)")
    ap.add_argument("--small", type=int, default=50_000, help="number of 2 KiB members (default 50000)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--members", type=int, default=100, help="random members read per round")
    ap.add_argument("--ratarmount", default=DEFAULT_RATARMOUNT)
    ap.add_argument("--parallel-members", type=int, default=2000, help="members read per round in (3)")
    ap.add_argument("--skip", choices=("random", "sequential", "parallel"), action="append", default=[])
    args = ap.parse_args()
    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    # Named by what it holds: a file built for other sizes (say --small 1000 in a quick run, where
    # 100 random members are a tenth of them) is never measured as the default one.
    data = work / f"data-{args.big_mib}MiB-{args.small}x2048.zip"
    build_zip(data, args.big_mib * MiB, args.small, 2048)
    smalls, cd_size, big_at, big_size = zip_layout(data)
    print(f"object: {data.stat().st_size / 2**30:.2f} GiB, {len(smalls) + 1} members, "
          f"central directory {cd_size / MiB:.1f} MiB", flush=True)  # fmt: skip

    with dummy_credentials():
        server = start_localbucket(work / "localbucket")
        try:
            server.put(BUCKET, KEY, data)  # a hard link: no copy
            subprocess.run(
                ["cat", str(data)], stdout=subprocess.DEVNULL, check=True
            )  # page cache, like S3's RAM
            server.client().head_object(Bucket=BUCKET, Key=KEY)  # localbucket computes the MD5 ETag once
            if "random" not in args.skip:
                bench_random(args, server, smalls, cd_size, work)
            if "sequential" not in args.skip:
                bench_sequential(args, server, data, big_at, big_size, work)
            if "parallel" not in args.skip:
                bench_parallel(args, server, smalls, work)
        finally:
            server.stop()
    return 0


DEFAULT_RATARMOUNT = str(DEFAULT_VENV / "bin" / "ratarmount")


def ratarmount_with_s3(exe: str) -> bool:
    """Whether ratarmount ``exe`` can mount s3:// URIs: s3fs installed into its venv when missing
    (a venv that ``--ratarmount`` names without one is used as it is)."""
    venv = Path(exe).parent.parent
    if exe != DEFAULT_RATARMOUNT and not (venv / "bin" / "python").exists():
        print(f"  {exe}: no venv to install s3fs into; ratarmount skipped")
        return False
    return ensure_ratarmount(venv, ("s3fs",)) is not None


def bench_random(args, server, smalls, cd_size: int, work: Path) -> None:
    rng = random.Random(42)
    have_ratarmount = ratarmount_with_s3(args.ratarmount)
    results: dict[str, list[dict]] = {"cdmlfs": [], "ratarmount": []}
    print(f"\n== {args.members} random 2 KiB members through a fresh FUSE mount, {args.rounds} rounds ==")
    for r in range(args.rounds):
        picks = rng.sample(smalls, args.members)
        names = [i.filename for i in picks]
        needed = sum(30 + len(i.filename.encode()) + i.compress_size for i in picks)
        order = ["cdmlfs", "ratarmount"] if r % 2 == 0 else ["ratarmount", "cdmlfs"]
        for who in order:
            if who == "ratarmount" and not have_ratarmount:
                continue
            proxy = FaultProxy(server.url)
            try:
                if who == "cdmlfs":
                    res = cdmlfs_random(proxy, names, work)
                else:
                    res = ratarmount_random(args.ratarmount, proxy, names, work)
            except Exception as exc:
                print(f"  round {r + 1} {who}: FAILED: {exc}")
                continue
            finally:
                proxy.close()
            res["needed"] = needed
            want = sum(i.file_size for i in picks)
            if res["got"] != want:  # a tool answering short reads must not look fast
                print(f"  round {r + 1} {who}: FAILED: read {res['got']} bytes of {want}")
                continue
            results[who].append(res)
            print(
                f"  round {r + 1} {who:10s}: mount {res['mount_s']:6.2f} s"
                f" / {res['mount_bytes'] / MiB:8.2f} MiB"
                f" in {res['mount_requests']} GETs; reads {res['read_s']:6.3f} s"
                f" / {res['read_bytes'] / 1024:9.1f} KiB in {res['read_requests']} GETs"
                f" (needed {needed / 1024:.1f} KiB)",
                flush=True,
            )
    print(f"  central directory: {cd_size / 1024:.1f} KiB")
    for who, rows in results.items():
        if not rows:
            continue
        rb = median([x["read_bytes"] for x in rows])
        nd = median([x["needed"] for x in rows])
        total = median([x["read_bytes"] + x["mount_bytes"] for x in rows])
        print(f"  {who:10s} median: reads {median([x['read_s'] for x in rows]):.3f} s, "
              f"{rb / 1024:.1f} KiB requested = {rb / nd:.2f}x needed; with mount {total / MiB:.2f} MiB "
              f"(target <= 2x needed + CD = {(2 * nd + cd_size) / MiB:.2f} MiB); mount "
              f"{median([x['mount_s'] for x in rows]):.2f} s", flush=True)  # fmt: skip
    if results["cdmlfs"] and results["ratarmount"]:
        c, t = results["cdmlfs"], results["ratarmount"]

        def med(rows: list[dict], *keys: str) -> float:
            return median([sum(x[k] for k in keys) for x in rows])

        time_ratio = med(t, "read_s") / med(c, "read_s")
        bytes_ratio = med(t, "read_bytes", "mount_bytes") / med(c, "read_bytes", "mount_bytes")
        print(
            f"  ratio ratarmount/cdmlfs: bytes (mount + reads) {bytes_ratio:.1f}x; read time"
            f" {time_ratio:.1f}x (through the counting proxy, pure Python, whose cost grows with the"
            " bytes: it weighs on ratarmount's time more than on cdmlfs's; ratarmount with s3fs's"
            " default block size)"
        )


def bench_sequential(args, server, data: Path, big_at: int, big_size: int, work: Path) -> None:
    print(
        f"\n== sequential read of the {big_size / 2**30:.2f} GiB member, {args.rounds} rounds"
        " (direct to the endpoint, no proxy) =="
    )
    times: dict[str, list[float]] = {
        "raw boto3 8x8MiB": [],
        "raw boto3 16x8MiB": [],
        "raw boto3 8x16MiB": [],  # cdmlfs's parts: 16 MiB, 8 prefetch + 8 foreground connections
        "raw boto3 16x16MiB": [],
        "cdmlfs API": [],
        "cdmlfs FUSE": [],
    }
    # CPU seconds per GiB: the client side (this process, plus the daemon for FUSE) and the endpoint.
    client_cpu: dict[str, list[float]] = {k: [] for k in times}
    server_cpu: dict[str, list[float]] = {k: [] for k in times}
    gib = big_size / 2**30
    for r in range(args.rounds):
        runs = list(times)
        if r % 2:
            runs.reverse()
        for name in runs:
            # The object in page cache before every contender (S3 serves from RAM; this VM pages
            # idle cache out, and the random-members part ran minutes before this one).
            subprocess.run(["cat", str(data)], stdout=subprocess.DEVNULL, check=True)
            srv0 = process_cpu(server.proc.pid)  # the endpoint is idle outside the timed reads
            if name.startswith("raw"):
                workers, part = (int(x) for x in name.split()[-1].removesuffix("MiB").split("x"))
                t, client = raw_boto3(server.url, big_at, big_size, workers, part * MiB)
            elif name == "cdmlfs API":
                t, client = cdmlfs_api(server.url, big_size)
            else:
                t, client = cdmlfs_fuse(server.url, big_size, work)
            times[name].append(t)
            srv = process_cpu(server.proc.pid) - srv0
            client_cpu[name].append(client / gib)
            server_cpu[name].append(srv / gib)
            print(
                f"  round {r + 1} {name:18s} {t:6.2f} s  {big_size / t / MiB:7.1f} MiB/s"
                f"  CPU/GiB client {client / gib:5.2f} s, endpoint {srv / gib:5.2f} s",
                flush=True,
            )
    med = {k: median(v) for k, v in times.items()}
    # The target compares with the fastest raw configuration (cdmlfs requests 16 MiB parts on up to
    # 16 connections; larger parts cost botocore fewer requests); 8 MiB parts are shown too.
    best_raw = min(t for k, t in med.items() if k.startswith("raw"))
    raw_8 = min(med["raw boto3 8x8MiB"], med["raw boto3 16x8MiB"])
    for name, t in med.items():
        print(f"  {name:18s} median {t:6.2f} s  {big_size / t / MiB:7.1f} MiB/s  "
              f"= {best_raw / t * 100:5.1f}% of the best raw ({raw_8 / t * 100:5.1f}% of raw 8 MiB parts);"
              f" CPU s/GiB: client {median(client_cpu[name]):.2f},"
              f" endpoint {median(server_cpu[name]):.2f}")  # fmt: skip
    cores = os.cpu_count() or 1
    print(
        f"  ({cores} cores here: when client + endpoint CPU per GiB, divided by the cores, is close to the"
        " seconds per GiB, the run is CPU-bound and the ratios compare CPU costs, not network use)"
    )


def cdmlfs_parallel(
    url: str, names: list[str], work: Path, presigned: bool, threads: int = 8
) -> tuple[float, float]:
    """(seconds, CPU seconds of the reader and the daemon) for ``threads`` readers of ``names``."""
    saved = os.environ.get("CDMLFS_S3_PRESIGNED")
    os.environ["CDMLFS_S3_PRESIGNED"] = "1" if presigned else "0"  # the daemon inherits it
    try:
        with mounted(
            f"s3://{BUCKET}/{KEY}", work / "mnt-par", "--endpoint-url", url, log_file=work / "par.log"
        ) as mnt:
            daemon = int((work / ".mnt-par.pid").read_text().split()[0])
            cpu0, started = own_cpu() + process_cpu(daemon), time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                got = sum(pool.map(lambda name: len((mnt / name).read_bytes()), names))
            elapsed = time.perf_counter() - started
            cpu = own_cpu() + process_cpu(daemon) - cpu0
    finally:
        if saved is None:
            os.environ.pop("CDMLFS_S3_PRESIGNED", None)
        else:
            os.environ["CDMLFS_S3_PRESIGNED"] = saved
    assert got == 2048 * len(names), got
    return elapsed, cpu


def bench_parallel(args, server, smalls, work: Path) -> None:
    n = min(args.parallel_members, len(smalls))
    print(f"\n== {n} random 2 KiB members, 8 threads, through a fresh mount, {args.rounds} rounds ==")
    rng = random.Random(7)
    rows: dict[str, list[tuple[float, float]]] = {"presigned GETs": [], "SDK get_object": []}
    for r in range(args.rounds):
        names = [i.filename for i in rng.sample(smalls, n)]
        ways = list(rows) if r % 2 == 0 else list(reversed(rows))
        for way in ways:
            t, cpu = cdmlfs_parallel(server.url, names, work, presigned=way == "presigned GETs")
            rows[way].append((t, cpu))
            print(
                f"  round {r + 1} {way:15s} {n / t:7.0f} files/s  CPU {cpu / n * 1e3:5.2f} ms/file",
                flush=True,
            )
    med = {way: (median([t for t, _ in v]), median([c for _, c in v])) for way, v in rows.items()}
    for way, (t, cpu) in med.items():
        print(f"  {way:15s} median {n / t:7.0f} files/s  CPU {cpu / n * 1e3:5.2f} ms/file")
    (tp, cp), (ts, cs) = med["presigned GETs"], med["SDK get_object"]
    print(f"  presigned vs SDK: {ts / tp:.2f}x files/s, {cp / cs:.2f}x CPU per file")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
