#!/usr/bin/env python3
"""Benchmark member reads (pread + inflate + CRC) and checkpointed random reads.

Compares, in one run on the same files: the C accelerator (cdmlfs._native via
cdmlfs.inflate), plain stdlib zlib (``zlib.decompress(data, -15, bufsize=size)``
+ ``zlib.crc32``) and cdmlfs's pure-Python fallback. Ratios are against the
stdlib measured in the same run, so they mean something on any machine. Then
builds checkpoints over a 1 GB deflated member and times 4 KiB reads at random
offsets. Prints tables only; it asserts nothing (timings do not belong in tests).

Usage: python scripts/bench_inflate.py [--rounds N] [--big-mb 1024] [--skip-big]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable

import numpy as np

from cdmlfs import inflate
from cdmlfs.checkpoints import DeflateCheckpoints


def english_like(n: int, seed: int) -> bytes:
    """About n bytes of English-like text: Zipf-distributed pseudo-words in sentences.

    A repeated string would inflate unrealistically fast (long matches only);
    this gives literals, short and long matches in realistic proportions
    (zlib -6 ratio about 3:1, like real prose).
    """
    rnd = random.Random(seed)
    syllables = [
        "th", "e", "an", "in", "er", "on", "re", "at", "en", "nd", "st", "or", "ou", "ea", "ti", "to",
        "it", "is", "ha", "ar", "al", "le", "se", "me", "de", "co", "ve", "ri", "ro", "li", "la", "ma",
        "ne", "pe", "ce", "ge", "bu", "wa", "fo", "mo", "y", "a", "o", "u", "ck", "sh", "ly", "ing",
    ]  # fmt: skip
    vocab = ["".join(rnd.choices(syllables, k=rnd.choice((1, 2, 2, 2, 3, 3, 4)))) for _ in range(20000)]
    weights = [1.0 / (rank + 1) for rank in range(len(vocab))]
    parts: list[str] = []
    size = 0
    while size < n:
        words = rnd.choices(vocab, weights, k=4000)
        pos = 0
        while pos < len(words):
            k = rnd.randint(4, 24)
            sentence = " ".join(words[pos : pos + k]).capitalize() + rnd.choice(".....,;?!")
            parts.append(sentence + ("\n" if rnd.random() < 0.1 else " "))
            size += len(parts[-1])
            pos += k
    return "".join(parts).encode()[:n]


def jpeg_like(n: int, seed: int) -> bytes:
    """Mostly incompressible bytes with a little structure, like an entropy-coded image."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, n, dtype=np.uint8)
    data[rng.integers(0, n, n // 50)] = 0xFF  # marker-ish bytes
    return data.tobytes()


def deflate(data: bytes, level: int = 6) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


def time_per_call(fn: Callable[[], object], rounds: int, min_round_s: float = 0.05) -> float:
    """Median over rounds of the mean seconds per call; each round lasts at least min_round_s."""
    fn()  # warm up: page cache, thread-local decompressor, allocator
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, int(min_round_s / once))
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def stdlib_read(fd: int, offset: int, comp_size: int, size: int, crc: int) -> bytes:
    """The baseline: what a straightforward Python ZIP reader does."""
    out = zlib.decompress(os.pread(fd, comp_size, offset), -15, size)
    if len(out) != size or zlib.crc32(out) != crc:
        raise ValueError("bad member")
    return out


def bench_members(tmp: str, rounds: int) -> None:
    members = [
        ("text 4 KiB", english_like(4 << 10, 1)),
        ("incompressible 110 KiB", jpeg_like(110 << 10, 2)),
        ("text 1 MiB", english_like(1 << 20, 3)),
        (
            "float32 50 MB",
            np.random.default_rng(4).random(50_000_000 // 4, dtype=np.float32).tobytes(),
        ),
    ]
    path = os.path.join(tmp, "members.bin")
    layout = []
    with open(path, "wb") as f:
        for name, data in members:
            comp = deflate(data)
            f.write(b"\0" * 30)  # a local header's worth of offset
            layout.append((name, f.tell(), len(comp), len(data), zlib.crc32(data)))
            f.write(comp)
    impls: list[tuple[str, Callable[..., bytes]]] = [("stdlib", stdlib_read)]
    if inflate.NATIVE is not None:
        impls.insert(0, ("native", inflate.NATIVE.read_deflated))
    impls.append(("fallback", inflate.PYTHON.read_deflated))

    print(f"\nMember read = pread + inflate + CRC, median of {rounds} rounds (ms per read)")
    header = f"{'member':<24}{'ratio':>7}" + "".join(f"{n:>11}" for n, _ in impls)
    header += "".join(f"{n + '/std':>14}" for n, _ in impls if n != "stdlib")
    print(header)
    print("-" * len(header))
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, off, csize, size, crc in layout:
            times = {}
            for iname, fn in impls:
                assert len(fn(fd, off, csize, size, crc)) == size
                args = (fd, off, csize, size, crc)
                times[iname] = time_per_call(lambda fn=fn, args=args: fn(*args), rounds)
            row = f"{name:<24}{size / csize:>7.2f}" + "".join(f"{times[n] * 1e3:>11.3f}" for n, _ in impls)
            row += "".join(f"{times['stdlib'] / times[n]:>13.2f}x" for n, _ in impls if n != "stdlib")
            print(row, flush=True)
    finally:
        os.close(fd)


def build_big_member(tmp: str, total_mb: int) -> tuple[str, int, int, int, bytes]:
    """A deflate stream of total_mb MiB: one 64 MiB compressed segment repeated.

    Compressing 1 GB at level 6 would take most of the run, so a 64 MiB segment of
    text and float32 data is compressed once with a full flush (byte-aligned,
    no references across it) and written repeatedly; a final empty block ends
    the stream. Inflating it costs the same as a genuinely 1 GB member.
    """
    seg_size = 64 << 20
    text = english_like(seg_size // 2, 5)
    floats = np.random.default_rng(6).random(seg_size // 8, dtype=np.float32).tobytes()
    segment_data = text + floats
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    segment = c.compress(segment_data) + c.flush(zlib.Z_FULL_FLUSH)
    reps = max(1, total_mb // 64)
    crc = 0
    path = os.path.join(tmp, "big.bin")
    with open(path, "wb") as f:
        for _ in range(reps):
            f.write(segment)
            crc = zlib.crc32(segment_data, crc)
        f.write(b"\x03\x00")  # final, empty fixed-Huffman block
    comp_size = reps * len(segment) + 2
    return path, comp_size, reps * seg_size, crc, segment_data


def bench_random_reads(tmp: str, total_mb: int, n_reads: int) -> None:
    path, comp_size, size, crc, segment_data = build_big_member(tmp, total_mb)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)

    def read_at(offset: int, length: int) -> bytes:
        return os.pread(fd, length, offset)

    backends = [("native", inflate.native_module())] if inflate.NATIVE is not None else []
    backends.append(("fallback", None))
    rnd = random.Random(7)
    offsets = [rnd.randrange(size - 4096) for _ in range(n_reads)]
    print(
        f"\nRandom 4 KiB reads in a {size / 2**30:.2f} GiB deflated member "
        f"({comp_size / 2**20:.0f} MiB compressed), {n_reads} reads, spacing 4 MiB"
    )
    print(f"{'backend':<10}{'build s':>9}{'MB/s':>8}{'index MiB':>11}{'interval med/p90 ms':>22}"
          f"{'read() med/p90 ms':>20}")  # fmt: skip
    try:
        for name, native in backends:
            t0 = time.perf_counter()
            cp = DeflateCheckpoints._build(native, read_at, 0, comp_size, size, crc, 4 << 20, None)
            build_s = time.perf_counter() - t0
            by_interval, by_read = [], []
            for off in offsets:
                t0 = time.perf_counter()
                k = off // cp.spacing
                block = cp.decode_interval(read_at, k)
                got = block[off - k * cp.spacing : off - k * cp.spacing + 4096]
                by_interval.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got2 = cp.read(read_at, off, 4096)
                by_read.append(time.perf_counter() - t0)
                seg_off = off % len(segment_data)
                assert got == got2 == segment_data[seg_off : seg_off + 4096]
            q_i = statistics.quantiles(by_interval, n=10)
            q_r = statistics.quantiles(by_read, n=10)
            print(
                f"{name:<10}{build_s:>9.2f}{size / build_s / 1e6:>8.0f}{cp.nbytes / 2**20:>11.1f}"
                f"{statistics.median(by_interval) * 1e3:>14.2f} / {q_i[8] * 1e3:<6.2f}"
                f"{statistics.median(by_read) * 1e3:>12.2f} / {q_r[8] * 1e3:<6.2f}",
                flush=True,
            )
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="timing rounds per member (median is reported)")
    ap.add_argument("--big-mb", type=int, default=1024, help="size of the random-access member in MiB")
    ap.add_argument("--reads", type=int, default=100, help="random 4 KiB reads")
    ap.add_argument("--skip-big", action="store_true", help="skip the random-access part")
    args = ap.parse_args()
    name, detail = inflate.backend()
    print(f"cdmlfs.inflate backend: {name} ({detail}); stdlib zlib {zlib.ZLIB_RUNTIME_VERSION}")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="cdmlfs-bench-") as tmp:
        bench_members(tmp, args.rounds)
        if not args.skip_big:
            bench_random_reads(tmp, args.big_mb, args.reads)
    print("\nTargets: native/std >= 2.3x on 'text 1 MiB', >= 1.9x on 'float32 50 MB'; "
          "random 4 KiB interval reads median <= 20 ms.")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
