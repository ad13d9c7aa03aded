#!/usr/bin/env python3
"""Soak a real mount: 8 threads and 4 processes read at random, every byte is checked, RSS is watched.

    scripts/soak.py --duration 300 --out soak-report            # ZIP and tar.zst, 5 minutes each
    scripts/soak.py --format zip --duration 60 --size-mb 300     # quicker

What it does, per format:

1. builds (once, kept in --work) an archive larger than the cache: ~--size-mb of
   members from 4 KiB to 64 MiB, half deflated and half stored in the ZIP; the
   tar.zst is ``cdmlfs pack`` of that ZIP. Each member's bytes are a seeded
   function of its seed (see Content), so any range can be checked without a
   copy of the data;
2. mounts it (``--cache-size``, default 64M) and runs --threads reader threads
   and --procs reader processes until --duration: whole small files, random
   ranges of large ones, each read compared with the expected bytes, then
   ``posix_fadvise(DONTNEED)`` so the next read goes to the daemon, not the
   page cache;
3. every --interval seconds samples the daemon's RSS and ``cdmlfs stats`` (the
   ioctl on the mount root, cdmlfs.statsio) and the readers' counters;
4. writes ``OUT/soak-FORMAT.json`` (every sample) and ``OUT/soak-FORMAT.txt``:
   wrong bytes (must be 0), errors, RSS flat within the bound (RSS after mount
   + cache + 48 MiB of in-flight slack), files/s and MB/s per interval and how
   steady they were. Exit status 1 when a check fails.

Not part of the test suite (it runs for minutes); the figures go in the issue.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

from cdmlfs import statsio

ROOT = Path(__file__).resolve().parent.parent
WORDS = [b"tensor", b"batch", b"epoch", b"gradient", b"loss", b"cdmlfs", b"zip", b"frame", b"shard", b"\n"]
# counters shared by every reader: reads, whole files, bytes, wrong bytes, errors, slowest read (ms)
READS, FILES, BYTES, WRONG, ERRORS, SLOWEST = range(6)


# -- content ---------------------------------------------------------------------------------------
CHUNK = 1 << 16


class Content:
    """A member's bytes as a function of its seed: 64 KiB chunks of shared text plus per-chunk random.

    Any range is generated on demand (no copy of the data is kept); the random
    halves differ from chunk to chunk, so neither deflate nor zstd can shrink a
    member below about half its size, and the archives stay larger than the cache.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = random.Random(seed)
        text = bytearray()
        while len(text) < CHUNK // 2:
            text += rng.choice(WORDS) + b" "
        self.text = bytes(text[: CHUNK // 2])

    def chunk(self, j: int) -> bytes:
        return self.text + random.Random(self.seed * 1_000_003 + j).randbytes(CHUNK // 2)

    def range(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n)."""
        first, last = offset // CHUNK, (offset + n - 1) // CHUNK if n else offset // CHUNK
        data = b"".join(self.chunk(j) for j in range(first, last + 1))
        start = offset - first * CHUNK
        return data[start : start + n]


def plan_members(total: int, seed: int) -> list[tuple[str, int, int]]:
    """(name, size, pattern seed): 70 % small, 25 % medium, 5 % large, until ``total`` bytes."""
    rng = random.Random(seed)
    out = []
    acc = 0
    i = 0
    while acc < total:
        r = rng.random()
        if r < 0.70:
            size = rng.randint(4 << 10, 256 << 10)
        elif r < 0.95:
            size = rng.randint(256 << 10, 8 << 20)
        else:
            size = rng.randint(16 << 20, 64 << 20)
        out.append((f"d{i % 10}/m{i:05d}.bin", size, seed * 100_000 + i))
        acc += size
        i += 1
    return out


def build_zip(path: Path, members: list[tuple[str, int, int]]) -> None:
    tmp = path.with_suffix(".partial")
    with zipfile.ZipFile(tmp, "w", allowZip64=True) as zf:
        for k, (name, size, seed) in enumerate(members):
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED if k % 2 == 0 else zipfile.ZIP_STORED
            info.external_attr = 0o100644 << 16
            content = Content(seed)
            with zf.open(info, "w", force_zip64=size > (1 << 30)) as w:
                if info.compress_type == zipfile.ZIP_DEFLATED:
                    w._compressor = __import__("zlib").compressobj(1, 8, -15)  # level 1: build fast
                for off in range(0, size, 4 << 20):
                    w.write(content.range(off, min(4 << 20, size - off)))
    tmp.rename(path)


def build_archives(work: Path, size_mb: int, seed: int) -> tuple[dict[str, Path], list[tuple[str, int, int]]]:
    work.mkdir(parents=True, exist_ok=True)
    members = plan_members(size_mb << 20, seed)
    manifest = work / f"manifest-{seed}-{size_mb}.json"
    zpath = work / f"soak-{seed}-{size_mb}.zip"
    tpath = work / f"soak-{seed}-{size_mb}.tar.zst"
    if not zpath.exists():
        started = time.monotonic()
        build_zip(zpath, members)
        print(
            f"built {zpath} ({zpath.stat().st_size >> 20} MiB) in {time.monotonic() - started:.0f}s",
            flush=True,
        )
    if not tpath.exists():
        started = time.monotonic()
        cli("pack", str(zpath), str(tpath), "--threads", "1", "-q")
        print(
            f"packed {tpath} ({tpath.stat().st_size >> 20} MiB) in {time.monotonic() - started:.0f}s",
            flush=True,
        )
    manifest.write_text(json.dumps(members))
    return {"zip": zpath, "tar.zst": tpath}, members


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "cdmlfs", *args], capture_output=True, timeout=timeout, cwd=ROOT
    )
    if res.returncode != 0:
        raise SystemExit(f"cdmlfs {' '.join(args)} failed: {res.stderr.decode().strip()}")
    return res


# -- readers ---------------------------------------------------------------------------------------
def reader(root: str, members: list, seed: int, counters, stop, deadline: float) -> None:
    """Random reads until ``deadline``: whole files up to 8 MiB, else ranges; every byte compared."""
    rng = random.Random(seed)
    while time.monotonic() < deadline and not stop.is_set():
        name, size, pseed = members[rng.randrange(len(members))]
        content = Content(pseed)
        whole = size <= (1 << 20) or (size <= (8 << 20) and rng.random() < 0.3)
        offset = 0 if whole else rng.randrange(size)
        n = size if whole else min(rng.choice((4096, 65536, 1 << 20, 4 << 20)), size - offset)
        started = time.monotonic()
        wrong = errs = 0
        try:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                data = os.pread(fd, n, offset)
                while len(data) < n:
                    more = os.pread(fd, n - len(data), offset + len(data))
                    if not more:
                        break
                    data += more
                exp = content.range(offset, n)
                if data != exp:
                    wrong = sum(1 for a, b in zip(data, exp) if a != b) + abs(len(exp) - len(data))
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # next read reaches the daemon
            finally:
                os.close(fd)
        except OSError as exc:
            errs = 1
            print(f"read error {name} @{offset}+{n}: {exc}", file=sys.stderr, flush=True)
            n = 0
        ms = int((time.monotonic() - started) * 1000)
        with counters.get_lock():
            counters[READS] += 1
            counters[FILES] += 1 if whole else 0
            counters[BYTES] += n
            counters[WRONG] += wrong
            counters[ERRORS] += errs
            counters[SLOWEST] = max(counters[SLOWEST], ms)


def _proc_main(root: str, manifest: str, seed: int, counters, stop, deadline: float) -> None:
    members = json.loads(Path(manifest).read_text())
    reader(root, members, seed, counters, stop, deadline)


# -- sampling ----------------------------------------------------------------------------------------
def proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) << 10
    return out


def mount_stats(mnt: Path) -> dict:
    return statsio.read(str(mnt))


def soak_one(fmt: str, archive: Path, members: list, args: argparse.Namespace, out: Path) -> dict:
    mnt = Path(args.work) / f"mnt-{fmt.replace('.', '-')}"
    mnt.mkdir(parents=True, exist_ok=True)
    pid_file = mnt.parent / f".{mnt.name}.pid"
    cli("mount", str(archive), str(mnt), "--cache-size", args.cache_size, "--pid-file", str(pid_file),
        "--log-file", str(out / f"daemon-{fmt}.log"), *args.mount_arg)  # fmt: skip
    pid = int(pid_file.read_text())
    try:
        time.sleep(0.5)
        base = proc_status(pid)["VmRSS"]
        first = mount_stats(mnt)
        cache_limit = first["cache"]["limit"]
        bound = base + cache_limit + (48 << 20)
        manifest = Path(args.work) / f"manifest-{fmt}.json"
        manifest.write_text(json.dumps(members))
        ctx = mp.get_context("spawn")
        counters = ctx.Array("q", 6)
        stop = ctx.Event()
        deadline = time.monotonic() + args.duration
        procs = [
            ctx.Process(target=_proc_main, args=(str(mnt), str(manifest), 1000 + k, counters, stop, deadline))
            for k in range(args.procs)
        ]
        threads = [
            threading.Thread(
                target=reader, args=(str(mnt), members, k, counters, stop, deadline), daemon=True
            )
            for k in range(args.threads)
        ]
        for w in (*procs, *threads):
            w.start()
        samples = []
        prev = [0] * 6
        prev_t = time.monotonic()
        started = prev_t
        while any(p.is_alive() for p in procs) or any(t.is_alive() for t in threads):
            time.sleep(min(args.interval, max(0.1, deadline - time.monotonic() + 0.1)))
            now = time.monotonic()
            cur = list(counters)
            st = proc_status(pid)
            stats = mount_stats(mnt)
            dt = now - prev_t
            sample = {
                "t": round(now - started, 1),
                "rss": st["VmRSS"],
                "hwm": st["VmHWM"],
                "files_per_s": round((cur[FILES] - prev[FILES]) / dt, 1),
                "reads_per_s": round((cur[READS] - prev[READS]) / dt, 1),
                "mb_per_s": round((cur[BYTES] - prev[BYTES]) / dt / 1e6, 1),
                "wrong_bytes": cur[WRONG],
                "errors": cur[ERRORS],
                "cache_held": stats["cache"]["held"],
                "hit_rate": stats["cache"]["hit_rate"],
                "served": stats["bytes"]["served"],
                "from_source": stats["bytes"]["from_source"],
            }
            samples.append(sample)
            print(
                f"[{fmt}] t={sample['t']:6.1f}s rss={sample['rss'] >> 20} MiB "
                f"files/s={sample['files_per_s']} MB/s={sample['mb_per_s']} "
                f"wrong={cur[WRONG]} errors={cur[ERRORS]}",
                flush=True,
            )
            prev, prev_t = cur, now
        for p in procs:
            p.join(timeout=30)
        final = mount_stats(mnt)
        totals = list(counters)
        end_status = proc_status(pid)
    finally:
        with contextlib.suppress(SystemExit):
            cli("umount", str(mnt))
    steady = samples[1:-1] or samples  # first interval warms up, last is partial
    mbs = [s["mb_per_s"] for s in steady]
    fps = [s["files_per_s"] for s in steady]
    rss = [s["rss"] for s in samples]
    half = len(rss) // 2
    result = {
        "format": fmt,
        "archive": str(archive),
        "archive_bytes": archive.stat().st_size,
        "members": len(members),
        "member_bytes": sum(m[1] for m in members),
        "duration_s": args.duration,
        "threads": args.threads,
        "procs": args.procs,
        "cache_limit": cache_limit,
        "rss_after_mount": base,
        "rss_bound": bound,
        "rss_min": min(rss),
        "rss_max": max(rss),
        "hwm": end_status["VmHWM"],
        "rss_drift_second_half": max(rss[half:]) - max(rss[:half] or rss),
        "reads": totals[READS],
        "files": totals[FILES],
        "bytes": totals[BYTES],
        "wrong_bytes": totals[WRONG],
        "errors": totals[ERRORS],
        "slowest_read_ms": totals[SLOWEST],
        "mb_per_s": {"mean": round(statistics.mean(mbs), 1), "min": min(mbs), "max": max(mbs),
                     "cv": round(statistics.pstdev(mbs) / max(statistics.mean(mbs), 1e-9), 3)},
        "files_per_s": {"mean": round(statistics.mean(fps), 1), "min": min(fps), "max": max(fps)},
        "final_stats": final,
        "samples": samples,
    }  # fmt: skip
    result["checks"] = {
        "zero_wrong_bytes": result["wrong_bytes"] == 0,
        "zero_errors": result["errors"] == 0,
        "rss_within_bound": result["hwm"] <= bound,
        "rss_flat": result["rss_drift_second_half"] <= (16 << 20),
    }
    return result


def summary(r: dict) -> str:
    mib = 1 << 20
    final = r["final_stats"]
    lines = [
        f"soak {r['format']}: {r['duration_s']}s, {r['threads']} threads + {r['procs']} processes, "
        f"{r['members']} members ({r['member_bytes'] / mib:.0f} MiB, "
        f"archive {r['archive_bytes'] / mib:.0f} MiB), "
        f"cache {r['cache_limit'] / mib:.0f} MiB",
        f"  reads {r['reads']} (whole files {r['files']}), {r['bytes'] / 1e9:.2f} GB checked: "
        f"wrong bytes {r['wrong_bytes']}, errors {r['errors']}, slowest read {r['slowest_read_ms']} ms",
        f"  throughput per {len(r['samples'])} intervals: {r['mb_per_s']['mean']} MB/s "
        f"(min {r['mb_per_s']['min']}, max {r['mb_per_s']['max']}, cv {r['mb_per_s']['cv']}), "
        f"{r['files_per_s']['mean']} files/s",
        f"  daemon RSS: after mount {r['rss_after_mount'] / mib:.0f} MiB, during {r['rss_min'] / mib:.0f}.."
        f"{r['rss_max'] / mib:.0f} MiB, peak {r['hwm'] / mib:.0f} MiB, bound {r['rss_bound'] / mib:.0f} MiB, "
        f"drift in the second half {r['rss_drift_second_half'] / mib:+.1f} MiB",
        f"  cache hit rate {final['cache']['hit_rate']}, served {final['bytes']['served'] / 1e9:.2f} GB, "
        f"read from the archive {final['bytes']['from_source'] / 1e9:.2f} GB",
        "  checks: " + ", ".join(f"{k}={'ok' if v else 'FAIL'}" for k, v in r["checks"].items()),
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=("zip", "tar.zst", "both"), default="both")
    ap.add_argument("--duration", type=float, default=300, help="seconds per format (default 300)")
    ap.add_argument("--size-mb", type=int, default=600, help="member bytes in the archive (default 600)")
    ap.add_argument("--cache-size", default="64M")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default="/tmp/cdmlfs-soak", help="archives and mount points (kept for reruns)")
    ap.add_argument("--out", default="soak-report", help="report directory")
    ap.add_argument("--mount-arg", action="append", default=[], help="extra argument for cdmlfs mount")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    archives, members = build_archives(Path(args.work), args.size_mb, args.seed)
    formats = ("zip", "tar.zst") if args.format == "both" else (args.format,)
    ok = True
    for fmt in formats:
        result = soak_one(fmt, archives[fmt], members, args, out)
        (out / f"soak-{fmt}.json").write_text(json.dumps(result, indent=1))
        text = summary(result)
        (out / f"soak-{fmt}.txt").write_text(text + "\n")
        print(text, flush=True)
        ok = ok and all(result["checks"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
