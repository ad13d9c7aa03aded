"""Ctrl-C in a Python API session (a notebook's interrupt) lands between any two bytecodes of a
read: whatever it interrupts, no lock stays held, no decoder stays claimed and no cache room
is lost, so the next read (from any thread) and close() go on.

A real interrupt arrives at a random moment; these tests make it deterministic by raising
KeyboardInterrupt at the entry of the n-th Python function a given piece of the read path calls
(sys.settrace), for every n the read reaches."""

from __future__ import annotations

import io
import random
import sys
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import CodeType

import pytest
import zstandard

from cdmlfs.archive import Archive
from cdmlfs.cache import ExtentCache
from cdmlfs.formats import zstdstream

MiB = 1 << 20


def _tar(path: Path, n: int = 24) -> dict[str, bytes]:
    rng = random.Random(7)
    words = [rng.randbytes(6).hex().encode() for _ in range(300)]
    members = {}
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(n):
            size = rng.choice([5_000, 300_000, 1_000_000, 2_500_000])
            data = b" ".join(rng.choice(words) for _ in range(size // 12 + 1))[:size]
            info = tarfile.TarInfo(f"d{i % 3}/f{i:03d}.bin")
            info.size = size
            tf.addfile(info, io.BytesIO(data))
            members[info.name] = data
    return members


def _interrupt_nth_call(callers: set[CodeType], n: int, skip: set[str] = frozenset()) -> Callable:
    """A trace function raising KeyboardInterrupt as the n-th Python call made by ``callers`` starts."""
    seen = [0]

    def tracer(frame, event, arg):
        back = frame.f_back
        ours = back is not None and back.f_code in callers and frame.f_code.co_name not in skip
        if event == "call" and ours:
            seen[0] += 1
            if seen[0] == n + 1:
                sys.settrace(None)
                raise KeyboardInterrupt
        return None

    tracer.seen = seen  # type: ignore[attr-defined]
    return tracer


def _read_interrupted(ar: Archive, name: str, tracer) -> bool:
    """Read ``name`` with ``tracer`` on; whether the read was interrupted."""
    sys.settrace(tracer)
    try:
        ar.read(name)
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def _other_thread_reads(ar: Archive, name: str, expected: bytes) -> None:
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(ar.read(name)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "a read after the interrupt waited for ever"
    assert got == [expected]


def _single_frame(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    plain = tmp_path / "a.tar"
    members = _tar(plain)
    archive = tmp_path / "single.tar.zst"
    with open(plain, "rb") as src, open(archive, "wb") as dst:
        zstandard.ZstdCompressor(level=1).copy_stream(src, dst)  # one frame, no content size
    return archive, members


def test_an_interrupt_anywhere_in_a_cache_reservation_leaves_the_lock_free(tmp_path: Path) -> None:
    """The cache took its lock through a Condition, whose __enter__/__exit__ are Python code: an
    interrupt inside __exit__ left the lock held, and every later read and close() hung."""
    archive, members = _single_frame(tmp_path)
    callers = {ExtentCache.hold.__code__, ExtentCache._release.__code__, ExtentCache._commit.__code__}
    names = sorted(members)
    n = 0
    while True:
        ar = Archive(str(archive), cache_size="8M", index_dir=str(tmp_path / "idx"))
        tracer = _interrupt_nth_call(callers, n)
        interrupted = _read_interrupted(ar, names[-1], tracer)
        assert not ar.cache._lock.locked(), f"cache lock held after an interrupt at call {n}"
        _other_thread_reads(ar, names[n % len(names)], members[names[n % len(names)]])
        closing = threading.Thread(target=ar.close, daemon=True)
        closing.start()
        closing.join(20)
        assert not closing.is_alive(), f"close() hung after an interrupt at call {n}"
        assert ar.cache.reserved == 0, f"room lost to an interrupt at call {n}"
        if not interrupted:
            break
        n += 1
    assert n >= 3  # the read went through several such calls


def test_an_interrupt_while_a_decoder_serves_a_piece_lets_the_decoder_go(tmp_path: Path) -> None:
    """The decoder was claimed through a generator context manager: an interrupt in contextlib's
    __exit__ left its release to garbage collection, which a live traceback (a REPL keeps the
    last one) put off: the decoder stayed claimed and locked, and its readers waited."""
    archive, members = _single_frame(tmp_path)
    callers = {zstdstream.ZstdStream._decode_piece.__code__}
    names = sorted(members)
    kept = []  # tracebacks kept alive, as sys.last_traceback is
    n = 0
    while True:
        with Archive(str(archive), cache_size="8M", index_dir=str(tmp_path / "idx")) as ar:
            stream = ar.format.stream
            # The release itself is the one call an interrupt must not hit (it would hit any code).
            tracer = _interrupt_nth_call(callers, n, skip={"_release"})
            sys.settrace(tracer)
            try:
                ar.read(names[-1], 3_000, 200_000)
                interrupted = False
            except KeyboardInterrupt as exc:
                kept.append(exc.__traceback__)
                interrupted = True
            finally:
                sys.settrace(None)
            claimed = [(c.users, c.lock.locked()) for c in stream._cursors.values()]
            claimed = [c for c in claimed if c[0] or c[1]]
            assert not claimed, f"decoders left claimed by an interrupt at call {n}: {claimed}"
            _other_thread_reads(ar, names[0], members[names[0]])
        if not interrupted:
            break
        n += 1
    assert n >= 5  # the read went through the decoder's whole path


def test_a_spare_frame_buffer_taken_when_a_failure_hits_keeps_no_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spare's reservation was let go only after asking the frame thread for a new spare: when
    that failed (no thread could be started under a pids limit, or Ctrl-C) the room was lost for
    good, and the cache shrank by a frame for the archive's life (reserved never back to 0)."""
    plain = tmp_path / "a.tar"
    members = _tar(plain)
    archive = tmp_path / "multi.tar.zst"
    raw = plain.read_bytes()
    cctx = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True)
    archive.write_bytes(b"".join(cctx.compress(raw[i : i + MiB]) for i in range(0, len(raw), MiB)))
    with Archive(str(archive), cache_size="16M", index_dir=str(tmp_path / "idx")) as ar:
        worker = ar.format.stream._frames
        assert worker is not None
        worker.prefill()
        for _ in range(200):
            if worker._spares:
                break
            threading.Event().wait(0.01)
        assert worker._spares, "no spare buffer was made"

        def cannot_start_a_thread() -> None:
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(worker, "_wake", cannot_start_a_thread)
        name = sorted(members)[5]
        with pytest.raises(RuntimeError, match="new thread"):
            ar.read(name)
        monkeypatch.undo()
        assert ar.read(name) == members[name]
    assert ar.cache.reserved == 0
