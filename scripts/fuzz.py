#!/usr/bin/env python3
"""Fuzz cdmlfs's parsers: coverage-guided (atheris/libFuzzer) or plain mutation, resumable, with a report.

    scripts/fuzz.py --total 1000000 --corpus ~/cdmlfs-fuzz        # all targets, 250k inputs each
    scripts/fuzz.py --target zip --runs 3000 --seed 1 --corpus /tmp/c   # what the test suite runs
    scripts/fuzz.py --replay tests/fuzz/regressions                 # re-run saved findings

Targets (tests/fuzz/harness.py): ``zip`` (central directory + local headers),
``tar`` (tar headers, pax, GNU long names), ``zstd`` (frame walker, seek
table, tar.zst scan), ``index`` (persisted and embedded member tables). Each
input is opened as an archive through the real path, listed and read whole;
only CdmlfsError may escape, reads must be exact, each input is bounded in
time (``--timeout``) and memory (``--rss-limit-mb`` growth and RLIMIT_AS).

Why a driver around libFuzzer: atheris hands the process to libFuzzer, which
stops at the first finding. The driver runs one libFuzzer worker process per
target and restarts it after a finding until the requested number of inputs
has run; the corpus directory (one sub-directory per target) keeps what
coverage found, so a later run resumes from it. Findings are copied to
``CORPUS/findings/TARGET/``; put the ones worth keeping under
``tests/fuzz/regressions/TARGET/`` once fixed, where the test suite replays them.

The report (``CORPUS/report.json`` plus stdout) gives, per target: inputs
executed, seconds, inputs/s, coverage features, corpus size and findings.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
TARGET_NAMES = ("zip", "tar", "zstd", "index")
DICTIONARY = [
    b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07", b"PK\x07\x08",
    b"\x01\x00", b"UT", b"up", b"\xff\xff\xff\xff", b"\xff\xff", b"\x00\x00\x00\x80",
    b"ustar\x00", b"ustar  \x00", b"00000000000", b"0000644\x00", b"\x80\x00\x00\x00",
    b" path=", b" size=", b" linkpath=", b" mtime=", b"GNU.sparse.map", b"././@LongLink",
    b"(\xb5/\xfd", b"P*M\x18", b"\\*M\x18", b"^*M\x18", b"\xb1\xea\x92\x8f", b"CDMLFS-MEMBERS\x00\x01",
]  # fmt: skip


def _setup_path() -> None:
    for p in (str(TESTS), str(ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)


def _limit_address_space(mb: int) -> None:
    """RLIMIT_AS: an allocation sized by a lying field fails as MemoryError (a finding) instead of OOM."""
    if mb > 0:
        soft = mb << 20
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (soft, soft))


def _quiet_logging() -> None:
    import logging

    logging.disable(logging.CRITICAL)


# -- atheris worker (one process per target; libFuzzer owns it) ---------------------------------
def atheris_worker(target: str, libfuzzer_args: list[str], as_limit_mb: int) -> None:
    import atheris

    _setup_path()
    with atheris.instrument_imports(include=["cdmlfs", "fuzz"]):
        from fuzz import harness
    _quiet_logging()
    _limit_address_space(as_limit_mb)
    run = harness.TARGETS[target]

    def one(data: bytes) -> None:
        run(data)

    atheris.Setup([sys.argv[0], *libfuzzer_args], one)
    atheris.Fuzz()


# -- driver -------------------------------------------------------------------------------
def _seed_corpus(target: str, directory: Path) -> None:
    """Write the target's seeds into an empty corpus directory (a resumed run keeps what it has)."""
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.iterdir()):
        return
    _setup_path()
    from fuzz import seeds

    for name, data in seeds.SEEDS[target]().items():
        (directory / f"seed-{name}").write_bytes(data)


def _escape(token: bytes) -> str:
    """libFuzzer dictionary syntax: every byte as \\xNN."""
    return "".join(f"\\x{b:02x}" for b in token)


def _stat(pattern: str, text: str) -> int | None:
    m = re.findall(pattern, text)
    return int(m[-1]) if m else None


def run_atheris(target: str, args: argparse.Namespace, corpus: Path, findings: Path) -> dict:
    """libFuzzer workers until ``args.runs`` inputs ran; returns the target's figures."""
    artifacts = corpus.parent / "artifacts" / target
    artifacts.mkdir(parents=True, exist_ok=True)
    dict_file = corpus.parent / "cdmlfs.dict"
    dict_file.write_text("".join(f'"{_escape(tok)}"\n' for tok in DICTIONARY))
    done = 0
    seconds = 0.0
    features = cov = None
    found: list[str] = []
    attempt = 0
    while done < args.runs:
        attempt += 1
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "--worker", target,
            "--as-limit-mb", str(args.as_limit_mb), "--",
            str(corpus), f"-runs={args.runs - done}", f"-seed={args.seed + attempt - 1}",
            f"-timeout={args.timeout}", f"-rss_limit_mb={args.rss_limit_mb}", f"-max_len={args.max_len}",
            f"-artifact_prefix={artifacts}/", f"-dict={dict_file}", "-print_final_stats=1",
            "-print_pcs=0", "-reload=0",
        ]  # fmt: skip
        started = time.monotonic()
        # libFuzzer ends the worker with exit(): no Python exit handlers, so the harness's scratch
        # file is put in a directory of ours and removed here (it piled up in /dev/shm).
        scratch = tempfile.mkdtemp(
            prefix="cdmlfs-fuzz-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        )
        try:
            proc = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                env={**os.environ, "CDMLFS_FUZZ_SCRATCH": scratch},
            )  # fmt: skip
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        seconds += time.monotonic() - started
        out = proc.stdout
        ran = _stat(r"stat::number_of_executed_units:\s+(\d+)", out)
        if ran is None:
            ran = _stat(r"Done (\d+) runs", out) or 0
        done += ran
        cov = _stat(r"cov: (\d+)", out) or cov
        features = _stat(r"ft: (\d+)", out) or features
        crashed = re.search(r"Test unit written to (\S+)", out)
        if crashed:
            src = Path(crashed.group(1))
            findings.mkdir(parents=True, exist_ok=True)
            dest = findings / src.name
            shutil.copy(src, dest)
            (findings / (src.name + ".txt")).write_text(out[-6000:])
            found.append(str(dest))
            print(f"[{target}] finding after {done} inputs: {dest}", flush=True)
            if len(found) >= args.max_findings:
                break
        elif proc.returncode != 0:
            # Died without writing the input (e.g. a signal while reporting an exception): keep the
            # output, whose traceback names the bug, and go on from the saved corpus.
            findings.mkdir(parents=True, exist_ok=True)
            note = findings / f"worker-died-{int(time.time())}-{attempt}.txt"
            note.write_text(f"exit {proc.returncode}\n" + out[-6000:])
            found.append(str(note))
            print(f"[{target}] worker died (exit {proc.returncode}) after {done} inputs: {note}", flush=True)
            if ran == 0 or len(found) >= args.max_findings:
                break
        elif ran == 0:
            break
    return {
        "engine": "atheris",
        "inputs": done,
        "seconds": round(seconds, 1),
        "inputs_per_s": round(done / seconds, 1) if seconds else None,
        "coverage_edges": cov,
        "coverage_features": features,
        "corpus_files": sum(1 for _ in corpus.iterdir()),
        "findings": found,
    }


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    """One structure-unaware mutation: flips, interesting integers, splices, tokens, truncation."""
    buf = bytearray(data or b"\0")
    for _ in range(rng.choice((1, 1, 2, 3, 6))):
        if not buf:
            buf = bytearray(b"\0")
        op = rng.randrange(8)
        pos = rng.randrange(len(buf))
        if op == 0:
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[pos] = rng.randrange(256)
        elif op == 2:
            width = rng.choice((2, 4, 8))
            value = rng.choice((0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1, 1 << 31))
            buf[pos : pos + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        elif op == 3:
            del buf[pos : pos + rng.randrange(1, 64)]
        elif op == 4:
            other = rng.choice(pool)
            s = rng.randrange(len(other) or 1)
            buf[pos:pos] = other[s : s + rng.randrange(1, 256)]
        elif op == 5:
            buf[pos:pos] = rng.choice(DICTIONARY)
        elif op == 6:
            del buf[rng.randrange(len(buf) + 1) :]
        else:
            digits = str(rng.choice((0, 1, 511, 512, 10**12, 8**11, 2**63))).encode()
            buf[pos : pos + len(digits)] = digits
    return bytes(buf[: 1 << 20])


def run_random(target: str, args: argparse.Namespace, corpus: Path, findings: Path) -> dict:
    """In-process mutation fuzzing (no coverage): the fallback engine, and a second opinion."""
    _setup_path()
    from fuzz import harness

    _quiet_logging()
    _limit_address_space(args.as_limit_mb)
    rng = random.Random(args.seed)
    pool = [p.read_bytes() for p in sorted(corpus.iterdir()) if p.is_file()]
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    found: list[str] = []
    started = time.monotonic()
    done = 0
    while done < args.runs:
        data = mutate(rng, rng.choice(pool), pool)
        done += 1
        try:
            harness.run(target, data, args.timeout)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            if (peak - base_rss) >> 10 > args.rss_limit_mb:
                raise MemoryError(f"peak RSS grew by {(peak - base_rss) >> 10} MiB on one input")
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            name = "crash-" + hashlib.sha1(data).hexdigest()
            findings.mkdir(parents=True, exist_ok=True)
            (findings / name).write_bytes(data)
            (findings / (name + ".txt")).write_text(f"{type(exc).__name__}: {exc}\n")
            found.append(str(findings / name))
            print(f"[{target}] finding after {done} inputs: {type(exc).__name__}: {exc}", flush=True)
            if isinstance(exc, MemoryError):
                base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            if len(found) >= args.max_findings:
                break
    seconds = time.monotonic() - started
    harness.cleanup()
    return {
        "engine": "random",
        "inputs": done,
        "seconds": round(seconds, 1),
        "inputs_per_s": round(done / seconds, 1) if seconds else None,
        "corpus_files": len(pool),
        "findings": found,
    }


def replay(paths: list[str], timeout: float, as_limit_mb: int) -> int:
    """Run saved inputs (files or directories named after their target) and report failures."""
    _setup_path()
    from fuzz import harness

    _quiet_logging()
    _limit_address_space(as_limit_mb)
    failures = 0
    for p in map(Path, paths):
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.suffix != ".txt")
        for f in files:
            target = next((t for t in TARGET_NAMES if t in f.parts), "zip")
            try:
                harness.run(target, f.read_bytes(), timeout)
                status = "ok"
            except BaseException as exc:
                failures += 1
                status = f"FAIL {type(exc).__name__}: {exc}"
            print(f"{f}: {status}")
    harness.cleanup()
    return 1 if failures else 0


def _save_report(root: Path, report: dict) -> None:
    """Add (or update) this run in CORPUS/report.json, after every target: a killed run keeps its figures."""
    report["total_inputs"] = sum(r["inputs"] for r in report["targets"].values())
    history = root / "report.json"
    runs = []
    if history.exists():
        with contextlib.suppress(ValueError):
            runs = json.loads(history.read_text())
    runs = [r for r in runs if r.get("started") != report["started"]]
    runs.append(report)
    history.write_text(json.dumps(runs, indent=1))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        target = argv[1]
        rest = argv[2:]
        as_limit = 0
        if rest[:1] == ["--as-limit-mb"]:
            as_limit = int(rest[1])
            rest = rest[2:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        atheris_worker(target, rest, as_limit)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=(*TARGET_NAMES, "all"), default="all")
    ap.add_argument("--runs", type=int, help="inputs per target")
    ap.add_argument("--total", type=int, help="inputs in all, split evenly over the targets")
    ap.add_argument("--corpus", default=str(Path.home() / ".cache/cdmlfs-fuzz"), help="corpus directory")
    ap.add_argument("--engine", choices=("atheris", "random", "auto"), default="auto")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=10, help="seconds per input")
    ap.add_argument("--rss-limit-mb", type=int, default=1024, help="peak RSS (growth, for random) per input")
    ap.add_argument("--as-limit-mb", type=int, default=4096, help="RLIMIT_AS of the fuzzing process")
    ap.add_argument("--max-len", type=int, default=16384, help="largest input libFuzzer generates")
    ap.add_argument("--max-findings", type=int, default=20, help="stop a target after this many")
    ap.add_argument("--replay", nargs="+", metavar="PATH", help="re-run saved inputs instead of fuzzing")
    args = ap.parse_args(argv)
    if args.replay:
        return replay(args.replay, args.timeout, args.as_limit_mb)
    targets = TARGET_NAMES if args.target == "all" else (args.target,)
    if args.runs is None:
        args.runs = (args.total or 100_000) // len(targets)
    engine = args.engine
    if engine == "auto":
        try:
            import atheris  # noqa: F401

            engine = "atheris"
        except ImportError:
            engine = "random"
    root = Path(args.corpus).expanduser()
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "engine": engine, "targets": {}}
    for target in targets:
        corpus = root / target
        _seed_corpus(target, corpus)
        findings = root / "findings" / target
        run = run_atheris if engine == "atheris" else run_random
        result = run(target, args, corpus, findings)
        report["targets"][target] = result
        _save_report(root, report)
        print(
            f"[{target}] {result['inputs']} inputs in {result['seconds']}s "
            f"({result['inputs_per_s']}/s), {len(result['findings'])} findings",
            flush=True,
        )
    _save_report(root, report)
    print(json.dumps(report, indent=1))
    return 1 if any(r["findings"] for r in report["targets"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
