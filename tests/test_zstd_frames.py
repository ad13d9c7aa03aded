"""Early members and frame decodes into pre-faulted buffers (cdmlfs.formats.zstdframes, cdmlfs._zstdframe).

A member of a packed archive is served once its frame is decoded up to the
member's end and its own CRC checks; the rest of the frame is finished in the
background and cached. These tests drive that through the real decoder (C and
python-zstandard), the real cache and a real FUSE mount.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import random
import tarfile
import threading
import time
import zlib
from array import array
from pathlib import Path

import pytest
import zstandard
from inflateutil import english_like, native_module
from mountutil import daemon_pid, is_mounted, mount_stats, mounted, run_cli
from test_tar_format import CountingSource
from test_tar_support import cdmlfs_pack

from cdmlfs.archive import Archive
from cdmlfs.cache import ExtentCache
from cdmlfs.errors import CorruptMemberError, SourceError
from cdmlfs.formats import zstdframes
from cdmlfs.formats.tarmembers import MemberTable, MemberTableError
from cdmlfs.index import FILE, MEMBER_CRC

MiB = 1 << 20


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~6 MiB of members, text and incompressible, 20-200 KB each."""
    root = tmp_path_factory.mktemp("frames") / "src"
    rng = random.Random(7)
    for i in range(60):
        d = root / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        size = rng.randrange(20_000, 200_000)
        data = english_like(size, i) if i % 2 else rng.randbytes(size)
        (d / f"m{i:02d}.bin").write_bytes(data)
    return root


@pytest.fixture(scope="module")
def packed(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cdmlfs_pack(src, tmp_path_factory.mktemp("packed") / "p.tar.zst", "--frame-size", "1M")


@pytest.fixture(params=["native", "python"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        native_module("cdmlfs._zstdframe")
        monkeypatch.setattr(zstdframes, "NATIVE", True)
    else:
        monkeypatch.setattr(zstdframes, "NATIVE", False)
    return request.param


@pytest.fixture
def finishing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every frame finished in the background from its first read (CDMLFS_FINISH_FRAMES=1), in this
    process and in daemons started from it; by default only frames that come back are."""
    monkeypatch.setattr(zstdframes, "FINISH_ENV", "1")
    monkeypatch.setenv("CDMLFS_FINISH_FRAMES", "1")


def _frame_bytes(archive: Path, ar: Archive, i: int) -> bytes:
    fr = ar.format.stream.frames
    with open(archive, "rb") as f:
        f.seek(fr.comp_offset[i])
        return zstandard.ZstdDecompressor().decompress(f.read(fr.comp_size[i]))


def _wait_cached(ar: Archive, key: tuple, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ar.cache.peek(key)
        if value is not None:
            return value
        time.sleep(0.005)
    raise AssertionError(f"{key} never entered the cache")


def _source_paths(src: Path) -> list[str]:
    return sorted(p.relative_to(src).as_posix() for p in src.rglob("*.bin"))


def _read_all_through(mnt: Path, src: Path, paths: list[str]) -> None:
    for path in paths:
        assert (mnt / path).read_bytes() == (src / path).read_bytes()


def _members_of_frame(ar: Archive, i: int) -> list[str]:
    fr = ar.format.stream.frames
    lo, hi = fr.dec_offset[i], fr.dec_offset[i] + fr.dec_size[i]
    ix = ar.index
    return [p for p in ar.archive_order() if lo <= ix.offset[ix.lookup(p)] and ix.offset[ix.lookup(p)] < hi]


def _read_shuffled_from_threads(ar: Archive, src: Path, seed: int) -> None:
    """Every member, in a shuffled order, from 4 threads: same bytes, the cache bound respected."""
    paths = ar.files()
    random.Random(seed).shuffle(paths)
    errors: list[str] = []
    peak = [0]

    def read_some(part: list[str]) -> None:
        for p in part:
            if ar.read(p) != (src / p).read_bytes():
                errors.append(p)
            peak[0] = max(peak[0], ar.cache.held + ar.cache.reserved)

    threads = [threading.Thread(target=read_some, args=(paths[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert peak[0] <= ar.cache.limit


# -- the member table carries CRCs ---------------------------------------------------------------
def test_packed_members_carry_crcs_and_old_tables_still_decode(
    packed: Path, src: Path, tmp_path: Path
) -> None:
    with Archive(str(packed), index_dir=str(tmp_path / "idx")) as ar:
        ix = ar.index
        for path in ar.files():
            eid = ix.lookup(path)
            assert ix.flags[eid] & MEMBER_CRC
            assert ix.crc[eid] == zlib.crc32((src / path).read_bytes())
    table = MemberTable()
    table.crcs = array("I")
    table.append(FILE, "a", 0o644, 0.0, 3, 512, crc=0xDEADBEEF)
    table.stream_size = 2048
    again = MemberTable.decode(table.encode())
    assert list(again.crcs) == [0xDEADBEEF]
    # A version-1 table (before CRCs) decodes, without them.
    table.crcs = None
    v1 = table.encode().replace(b'"v":2', b'"v":1', 1).replace(b',"crc":0', b"", 1)
    old = MemberTable.decode(v1)
    assert old.crcs is None and old.names == ["a"]
    assert not old.build_index().flags[1] & MEMBER_CRC
    with pytest.raises(MemberTableError):
        MemberTable.decode(table.encode().replace(b'"crc":0', b'"crc":7', 1))


# -- early members ------------------------------------------------------------------------------
def test_member_is_served_before_its_frame_is_finished_then_the_frame_is_cached(
    packed: Path, src: Path, tmp_path: Path, decoder: str, finishing: None
) -> None:
    with Archive(str(packed), index_dir=str(tmp_path / "idx")) as ar:
        stream = ar.format.stream
        worker = stream._frames
        assert worker is not None, "1 MiB frames with a 512 MiB cache go through the frame worker"
        i = 2
        members = _members_of_frame(ar, i)
        assert len(members) >= 3
        first = members[len(members) // 2]
        assert ar.read(first) == (src / first).read_bytes()
        assert worker.early_frames == 1
        frame = _wait_cached(ar, ("zf", i))  # finished in the background, zstd checksum verified
        assert bytes(frame) == _frame_bytes(packed, ar, i)
        assert stream.frame_decodes == 0  # nobody decoded the frame a second time
        for path in members:
            assert ar.read(path) == (src / path).read_bytes()
        assert worker.early_frames == 1
        _read_shuffled_from_threads(ar, src, seed=3)


def test_archive_much_larger_than_the_cache_keeps_frames_partial(
    packed: Path, src: Path, tmp_path: Path, decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With an archive many times the cache, finishing every frame a reader touched doubled the
    decoding of a shuffled epoch for frames the cache seldom kept until their next reader. Frames
    stay partial instead: decoded only as far as readers ask, a few of them, least recently read
    let go first, and cached once their readers reach the end (archive order stays one pass)."""
    with Archive(str(packed), cache_size=8 * MiB, index_dir=str(tmp_path / "idx")) as ar:
        stream = ar.format.stream
        worker = stream._frames
        assert worker is not None and not worker.finish
        fr = stream.frames
        large = [i for i in range(len(fr)) if fr.dec_size[i] >= zstdframes.MIN_FRAME]
        assert len(large) > zstdframes.MAX_PARTIAL + 1
        i = large[1]
        members = _members_of_frame(ar, i)
        assert ar.read(members[0]) == (src / members[0]).read_bytes()
        p = worker._partial[i]
        time.sleep(0.2)  # time the background thread would have taken to finish the frame
        assert 0 < p.done < p.size and ar.cache.peek(("zf", i)) is None
        for path in members[1:]:  # its readers take it to its end: verified, then cached
            assert ar.read(path) == (src / path).read_bytes()
        assert bytes(ar.cache.peek(("zf", i))) == _frame_bytes(packed, ar, i)
        assert i not in worker._partial and stream.frame_decodes == 0
        # First reads of more frames than stay in flight: the least recently read are let go.
        for j in large[2:]:
            path = _members_of_frame(ar, j)[0]
            assert ar.read(path) == (src / path).read_bytes()
        assert worker.partial_evictions >= len(large[2:]) - zstdframes.MAX_PARTIAL
        assert worker.stats()["frames_in_flight"] <= zstdframes.MAX_PARTIAL
        evicted = large[2]
        assert evicted not in worker._partial
        path = _members_of_frame(ar, evicted)[-1]
        assert ar.read(path) == (src / path).read_bytes()
        _read_shuffled_from_threads(ar, src, seed=5)
    # Archive order, afresh: every frame decoded once, by its readers.
    with Archive(str(packed), cache_size=8 * MiB, index_dir=str(tmp_path / "idx")) as ar:
        before = ar.source.bytes_read
        for path in ar.archive_order():
            assert ar.read(path) == (src / path).read_bytes()
        assert ar.source.bytes_read - before <= packed.stat().st_size
        assert ar.format.stream._frames.partial_evictions == 0


@contextlib.contextmanager
def _frames_kept_partial(packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The packed archive (~6 MiB) opened with a cache that holds it: (archive, its frame worker
    keeping frames partial, the frames large enough for that worker)."""
    with Archive(str(packed), cache_size=16 * MiB, index_dir=str(tmp_path / "idx")) as ar:
        worker = ar.format.stream._frames
        assert worker is not None and not worker.finish
        fr = ar.format.stream.frames
        yield ar, worker, [i for i in range(len(fr)) if fr.dec_size[i] >= zstdframes.MIN_FRAME]


def test_a_frame_kept_partial_that_comes_back_soon_is_finished_and_cached(
    packed: Path, src: Path, tmp_path: Path, decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames stay partial in an archive many times the cache; but a frame started again within
    fewer frame starts than the cache holds frames would have stayed cached (a validation split
    packed together, read every epoch): it is finished and cached instead of decoded from its
    start at every read."""
    with _frames_kept_partial(packed, tmp_path, monkeypatch) as (ar, worker, large):
        a, others = large[1], large[2:]
        assert zstdframes.MAX_PARTIAL <= len(others) < worker.capacity

        def read_in(i: int, k: int = 0) -> None:
            path = _members_of_frame(ar, i)[k]
            assert ar.read(path) == (src / path).read_bytes()

        read_in(a)
        for j in others:  # enough first reads of other frames to let a's partial frame go
            read_in(j)
        assert a not in worker._partial and ar.cache.peek(("zf", a)) is None
        read_in(a, 1)  # back after fewer starts than the cache holds frames: finished and cached
        assert bytes(_wait_cached(ar, ("zf", a))) == _frame_bytes(packed, ar, a)
        assert worker.finished_on_reuse == 1
        worker.capacity = 2  # now the next comeback is too late for a cache this small
        c = others[0]
        assert c not in worker._partial
        read_in(c, 1)
        time.sleep(0.2)  # time the background thread would take to finish it
        assert worker.finished_on_reuse == 1 and ar.cache.peek(("zf", c)) is None


def test_a_frame_let_go_lends_its_buffer_to_the_next_but_never_under_a_view(
    packed: Path, src: Path, tmp_path: Path, decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Making fresh spare buffers took a third of the daemon's CPU in shuffled reads of an archive
    6x the cache: the buffer of a partial frame let go is reused for the next frame, unless a
    view of it is still held (a reader copying out), whose bytes must stay as they are."""
    with _frames_kept_partial(packed, tmp_path, monkeypatch) as (ar, worker, large):
        assert len(large) >= zstdframes.MAX_PARTIAL + 3
        first = _members_of_frame(ar, large[0])[0]
        assert ar.read(first) == (src / first).read_bytes()
        # A view into the second frame's buffer: when that frame is let go (the first one went
        # before it, so the spare pool has room for its buffer), the buffer must not be reused.
        path = _members_of_frame(ar, large[1])[0]
        eid = ar.index.lookup(path)
        held = ar.reader.view(eid, 0, ar.index.size[eid])
        expected = (src / path).read_bytes()
        assert isinstance(held, memoryview) and bytes(held) == expected
        for j in large[2:]:  # more first reads than slots: the least recent frames are let go
            path = _members_of_frame(ar, j)[0]
            assert ar.read(path) == (src / path).read_bytes()
        assert large[1] not in worker._partial
        assert bytes(held) == expected  # its buffer was not reused under the view
        assert worker.buffers_recycled >= 1  # others were
        held.release()
        _read_shuffled_from_threads(ar, src, seed=7)


def test_a_read_error_at_a_frames_checksum_is_not_taken_for_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that failed after a frame's last byte came out, while fetching its checksum for a
    whole-frame read, was swallowed: the frame was then reported corrupt, and the reader marks
    a corrupt member's damage as lasting. It is a read error (EIO now, fine later)."""
    monkeypatch.setattr(zstdframes, "NATIVE", False)  # stops at what is asked: the checksum comes later
    data = english_like(64 << 10, 2) * 16
    comp = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(data)
    path = tmp_path / "frame.zst"
    path.write_bytes(comp)
    monkeypatch.setattr(zstdframes, "INPUT_CHUNK", len(comp) - 2)  # the checksum is in the second read

    class FailsAtTheEnd(CountingSource):
        armed = False

        def read_at(self, offset: int, length: int) -> bytes:
            if self.armed and offset + length > len(comp) - 2:
                raise SourceError("read failed (injected)")
            return super().read_at(offset, length)

    source = FailsAtTheEnd(path)
    cache = ExtentCache(64 * MiB)
    span = zstdframes.FrameSpan("frame #0", 0, len(comp), len(data))
    worker = zstdframes.FrameWorker(cache, len(data), source, lambda i: span, finish=False, frames=1)
    try:
        p = worker.partial(0, ("zf", 0), len(data))
        assert p is not None
        p.advance(1000)
        worker.after_read(0, p)
        source.armed = True
        with pytest.raises(SourceError):
            worker.decode_whole(0)
        source.armed = False
        assert bytes(worker.decode_whole(0)) == data
    finally:
        worker.close()
        source.close()


@contextlib.contextmanager
def _reads_fail(fd: int, directory: Path):
    """Reads through ``fd`` fail (EISDIR: it points at a directory) until the block ends."""
    saved = os.dup(fd)
    bad = os.open(directory, os.O_RDONLY)
    os.dup2(bad, fd)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(bad)


def test_a_read_error_inside_a_partial_frame_leaves_it_to_a_fresh_decode(
    packed: Path, src: Path, tmp_path: Path, decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed read (EIO, an S3 timeout) while a reader decoded further into a frame kept partial
    left the frame in flight with a decoder that refuses to go on: every later read of its
    members failed, however healthy the archive."""
    with Archive(str(packed), cache_size=8 * MiB, index_dir=str(tmp_path / "idx")) as ar:
        worker = ar.format.stream._frames
        assert worker is not None and not worker.finish
        fr = ar.format.stream.frames
        i = next(i for i in range(1, len(fr)) if fr.dec_size[i] >= zstdframes.MIN_FRAME)
        members = _members_of_frame(ar, i)
        assert ar.read(members[0]) == (src / members[0]).read_bytes()
        with _reads_fail(ar.source.fileno(), tmp_path), pytest.raises(SourceError):
            ar.read(members[-1])
        for path in members:
            assert ar.read(path) == (src / path).read_bytes()


@pytest.mark.parametrize("finish", [True, False], ids=["finished", "kept-partial"])
def test_a_frame_is_complete_only_once_its_checksum_is_checked(
    tmp_path: Path, decoder: str, finish: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An input chunk can end inside a frame's 4-byte checksum right after its last byte comes
    out: the frame counted as complete for a reader who asked for less, and was cached (and
    served by the C path) unchecked."""
    data = english_like(64 << 10, 1) * 16
    comp = bytearray(zstandard.ZstdCompressor(level=3, write_checksum=True).compress(data))
    comp[-1] ^= 0xFF
    path = tmp_path / "frame.zst"
    path.write_bytes(comp)
    # The first read stops in the checksum (the native decoder asks for what reaching the reader's
    # 1000 bytes takes at the frame's ratio, plus INPUT_CHUNK).
    monkeypatch.setattr(zstdframes, "INPUT_CHUNK", len(comp) - 2 - 1000 * len(comp) // len(data))
    source = CountingSource(path)  # no descriptor: compressed bytes come through read_at, a chunk at a time
    cache = ExtentCache(64 * MiB)
    span = zstdframes.FrameSpan("frame #0", 0, len(comp), len(data))
    worker = zstdframes.FrameWorker(cache, len(data), source, lambda i: span, finish=finish)
    try:
        p = worker.partial(0, ("zf", 0), len(data))
        assert p is not None
        p.advance(1000)  # a member at the frame's start (far from its end)
        assert bytes(p.slice(0, 1000)) == data[:1000]  # its own CRC is the reader's to check
        assert not p.complete
        worker.after_read(0, p)
        if finish:  # the background thread goes on to the end, and fails at the checksum
            deadline = time.monotonic() + 10
            while worker.stats()["frames_in_flight"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert worker.stats()["frames_in_flight"] == 0
        assert cache.peek(("zf", 0)) is None
    finally:
        worker.close()
        source.close()


def test_foreign_frames_without_member_crcs_decode_whole_into_buffers(
    src: Path, tmp_path: Path, decoder: str
) -> None:
    """Frames concatenated by another tool (no member CRCs): no early members, whole frames verified."""
    plain = tmp_path / "t.tar"
    with tarfile.open(plain, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(src, arcname=".")
    data = plain.read_bytes()
    comp = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True)
    archive = tmp_path / "t.tar.zst"
    archive.write_bytes(b"".join(comp.compress(data[k : k + MiB]) for k in range(0, len(data), MiB)))
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        stream = ar.format.stream
        assert stream._frames is not None and len(stream.frames) >= 4
        paths = ar.files()
        random.Random(5).shuffle(paths)
        for path in paths:
            assert ar.read(path) == (src / path).read_bytes()
        assert stream._frames.early_frames == 0
        assert stream.frame_decodes == len(stream.frames)
        assert all(isinstance(ar.cache.peek(("zf", i)), mmap.mmap) for i in range(len(stream.frames)))


def test_small_cache_and_disabled_worker_decode_whole_frames(packed: Path, src: Path, tmp_path: Path) -> None:
    with Archive(str(packed), cache_size=4 * MiB, index_dir=str(tmp_path / "idx")) as ar:
        assert ar.format.stream._frames is None  # 4 spares would not fit: plain whole-frame decodes
        for path in ar.files():
            assert ar.read(path) == (src / path).read_bytes()


def test_spares_stay_within_the_cache_and_are_used(
    packed: Path, src: Path, tmp_path: Path, finishing: None
) -> None:
    with Archive(str(packed), cache_size=64 * MiB, index_dir=str(tmp_path / "idx")) as ar:
        worker = ar.format.stream._frames
        assert worker is not None and worker.max_spares >= 1
        frames = ar.format.stream.frames
        for i in range(len(frames)):
            members = _members_of_frame(ar, i)
            if members:
                assert ar.read(members[0]) == (src / members[0]).read_bytes()
                _wait_cached(ar, ("zf", i))
            assert len(worker._spares) <= worker.max_spares
            assert ar.cache.held + ar.cache.reserved <= ar.cache.limit
        assert worker.spares_used >= 1  # waiting for each frame left time to prepare spares


def test_a_window_limit_out_of_range_says_so() -> None:
    mod = native_module("cdmlfs._zstdframe")
    for bad in (5, 40, -1):
        with pytest.raises(ValueError, match=f"window_log_max {bad} is outside"):
            mod.FrameDecoder(bad)
    assert mod.FrameDecoder(27).pos == 0


def test_populate_faults_pages_in_and_keeps_their_bytes() -> None:
    """Spares are pre-faulted by cdmlfs._zstdframe.populate: after it, writing them faults nothing,
    and a buffer that already holds bytes keeps them (any start offset, not only page-aligned)."""
    mod = native_module("cdmlfs._zstdframe")
    import resource

    page = mmap.PAGESIZE
    buf = zstdframes.new_buffer(256 * page, populate=True)
    payload = random.Random(7).randbytes(len(buf))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf[:] = payload
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 16  # was 256 without populate
    fresh = mmap.mmap(-1, 64 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fresh[5 * page : 5 * page + 100] = payload[:100]
    view = memoryview(fresh)[3 * page + 17 :]
    mod.populate(view)
    view.release()
    assert fresh[5 * page : 5 * page + 100] == payload[:100]
    assert fresh[: 5 * page] == bytes(5 * page)
    assert fresh[5 * page + 100 :] == bytes(len(fresh) - 5 * page - 100)
    with pytest.raises((TypeError, BufferError)):
        mod.populate(b"read-only bytes")
    mod.populate(bytearray())  # nothing to do
    buf.close()
    fresh.close()


def test_populate_lets_other_threads_run() -> None:
    """The point of populate over MAP_POPULATE: other threads keep running Python while pages are
    faulted in. Held through the call, the GIL would stop the main thread for nearly all of it
    (512 MiB takes tens of milliseconds anywhere; the GIL switch interval is 5 ms)."""
    mod = native_module("cdmlfs._zstdframe")
    big = mmap.mmap(-1, 512 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    go, done = threading.Event(), threading.Event()
    span: list[float] = []

    def fault_in() -> None:
        go.wait()  # the main thread is in its loop by then
        span.append(time.perf_counter())
        mod.populate(big)
        span.append(time.perf_counter())
        done.set()

    thread = threading.Thread(target=fault_in)
    thread.start()
    # The longest the main thread went without a turn. Nothing in the loop allocates (a list
    # growing would wait for the mapping lock that populate holds, which says nothing of the GIL).
    prev = time.perf_counter()
    gap = 0.0
    go.set()
    while not done.is_set():
        now = time.perf_counter()
        gap = max(gap, now - prev)
        prev = now
    thread.join()
    big.close()
    begin, end = span
    assert gap < (end - begin) / 2, f"the main thread waited {gap:.3f} s of a {end - begin:.3f} s call"


def test_warm_up_fills_the_spares_inside_the_cache_bound(packed: Path, src: Path, tmp_path: Path) -> None:
    with Archive(str(packed), cache_size=64 * MiB, index_dir=str(tmp_path / "idx")) as ar:
        worker = ar.format.stream._frames
        assert worker is not None and not worker._spares
        ar.warm_up()
        deadline = time.monotonic() + 10
        while len(worker._spares) < worker.max_spares and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(worker._spares) == worker.max_spares
        assert ar.cache.reserved == worker.max_spares * worker.spare_size  # counted against the bound
        path = ar.archive_order()[3]
        assert ar.read(path) == (src / path).read_bytes()
        assert worker.spares_used == 1


def test_decoding_ahead_leaves_packed_frames_to_the_early_member_path(
    packed: Path, src: Path, tmp_path: Path
) -> None:
    """Decoding whole frames ahead bypassed the early members (and decoded frames twice when the
    reader came while the prefetch was at it): it is for pieces of large frames only."""
    with Archive(str(packed), cache_size=64 * MiB, index_dir=str(tmp_path / "idx")) as ar:
        ar.warm_up(decode_ahead=True)
        stream = ar.format.stream
        for path in ar.archive_order():
            assert ar.read(path) == (src / path).read_bytes()
        assert stream.prefetched == 0  # no frame decoded ahead whole
        large = sum(1 for n in stream.frames.dec_size if n >= zstdframes.MIN_FRAME)  # smaller: decoded whole
        # Most large frames are first read as early members. Not necessarily all: when frames
        # finished in the background still hold the cache's room (a slow or busy machine), a first
        # reader decodes its frame whole instead (CI once saw 6 of 7).
        assert stream._frames is not None and 1 <= stream._frames.early_frames <= large and large > 1


def test_close_stops_the_worker_before_the_file_closes(
    packed: Path, src: Path, tmp_path: Path, decoder: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Frames still being finished when the archive closed were read on through its closed
    descriptor (a number the process may give to another file): the thread ran forever and
    logged EBADF, and what it finished went into the cleared cache."""
    ar = Archive(str(packed), index_dir=str(tmp_path / "idx"))
    worker = ar.format.stream._frames
    assert worker is not None
    ar.warm_up()  # spares, each holding a reservation
    fr = ar.format.stream.frames
    firsts = [_members_of_frame(ar, i)[0] for i in range(len(fr)) if fr.dec_size[i] >= zstdframes.MIN_FRAME]
    assert len(firsts) >= zstdframes.MAX_PARTIAL
    for path in firsts:  # each first read leaves its frame to the background thread
        assert ar.read(path) == (src / path).read_bytes()
    ar.close()
    thread = worker._thread
    assert thread is not None and not thread.is_alive()
    stats = worker.stats()
    assert stats["frames_in_flight"] == stats["spares_ready"] == 0
    assert ar.cache.held == ar.cache.reserved == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_close_landing_inside_a_finishing_step_logs_no_error(
    packed: Path, src: Path, tmp_path: Path, decoder: str, caplog: pytest.LogCaptureFixture, finishing: None
) -> None:
    """close() between the background thread's check and its step: the step refused to read on
    (the archive was closed) and the thread logged "finishing ... failed" with a traceback."""
    import threading

    ar = Archive(str(packed), index_dir=str(tmp_path / "idx"))
    worker = ar.format.stream._frames
    assert worker is not None
    closing: list[threading.Thread] = []
    real = {cls: cls.advance for cls in (zstdframes._NativeDecode, zstdframes._PyDecode)}

    def close_first(self, upto: int) -> None:
        if threading.current_thread() is worker._thread and not closing:
            closer = threading.Thread(target=ar.close)  # close() waits for this step
            closer.start()
            closing.append(closer)  # started: the test may join it now
            deadline = time.monotonic() + 10
            while not worker.closed and time.monotonic() < deadline:
                time.sleep(0.001)
        return real[type(self)](self, upto)

    fr = ar.format.stream.frames
    first = next(i for i in range(len(fr)) if fr.dec_size[i] >= zstdframes.MIN_FRAME)
    with caplog.at_level(logging.DEBUG, logger="cdmlfs"):
        try:
            for cls in real:
                cls.advance = close_first
            path = _members_of_frame(ar, first)[0]
            assert ar.read(path) == (src / path).read_bytes()  # its frame goes to the background
            deadline = time.monotonic() + 10
            while not closing and time.monotonic() < deadline:
                time.sleep(0.01)
            assert closing, "the background thread never took the frame"
            closing[0].join(10)
        finally:
            for cls, fn in real.items():
                cls.advance = fn
            ar.close()
    assert worker._thread is not None and not worker._thread.is_alive()
    assert ar.cache.held == ar.cache.reserved == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_frame_let_go_inside_a_finishing_step_logs_no_error(
    packed: Path, src: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, finishing: None
) -> None:
    """A reader's failed read (an S3 GET that gave up) lets its frame go while the background
    thread is between its check and its step: the step raised FrameEvicted, logged as an ERROR
    with a traceback (seen in an S3 soak under faults)."""
    import threading

    with Archive(str(packed), index_dir=str(tmp_path / "idx")) as ar:
        worker = ar.format.stream._frames
        assert worker is not None
        real = zstdframes.PartialFrame.advance
        hit: list[bool] = []

        def let_go_first(self, upto: int) -> None:
            if threading.current_thread() is worker._thread and not hit:
                hit.append(True)
                with self.lock:
                    self._let_go()  # as a reader's failed read does
            return real(self, upto)

        fr = ar.format.stream.frames
        first = next(i for i in range(len(fr)) if fr.dec_size[i] >= zstdframes.MIN_FRAME)
        path = _members_of_frame(ar, first)[0]
        with caplog.at_level(logging.DEBUG, logger="cdmlfs"):
            zstdframes.PartialFrame.advance = let_go_first
            try:
                assert ar.read(path) == (src / path).read_bytes()  # its frame goes to the background
                deadline = time.monotonic() + 10
                while first in worker._partial and time.monotonic() < deadline:
                    time.sleep(0.01)
            finally:
                zstdframes.PartialFrame.advance = real
        assert hit and first not in worker._partial
        for member in _members_of_frame(ar, first):  # decoded afresh by its next reader
            assert ar.read(member) == (src / member).read_bytes()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_close_that_gives_up_on_a_busy_reader_still_frees_its_frame(
    packed: Path, src: Path, tmp_path: Path, decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() waits only so long for a reader inside a frame's decode (an S3 read can stall):
    that reader went on reading, and its frame's reservation was never given back."""
    monkeypatch.setattr(zstdframes, "CLOSE_WAIT", 0.05)

    class Slow(CountingSource):
        armed = False
        stalled = threading.Event()

        def read_at(self, offset: int, length: int) -> bytes:
            if self.armed:
                self.stalled.set()
                time.sleep(0.3)  # a stalled request: close() gives up waiting for it
            return super().read_at(offset, length)

    source = Slow(packed)
    ar = Archive(source, index_dir=str(tmp_path / "idx"))
    fr = ar.format.stream.frames
    i = next(i for i in range(1, len(fr)) if fr.dec_size[i] >= zstdframes.MIN_FRAME)
    last = _members_of_frame(ar, i)[-1]
    failed: list[BaseException] = []

    def read() -> None:
        try:
            ar.read(last)
        except BaseException as exc:
            failed.append(exc)

    source.armed = True
    t = threading.Thread(target=read)
    t.start()
    assert source.stalled.wait(30)  # inside the frame's decode, waiting for its compressed bytes
    ar.close()
    t.join(10)
    assert not t.is_alive()
    # As a read after close() fails (the reason, "the archive was closed", is its cause).
    assert len(failed) == 1 and isinstance(failed[0], ValueError), failed
    assert isinstance(failed[0].__cause__, SourceError), failed[0].__cause__
    assert ar.cache.reserved == 0


def test_forked_child_reads_with_its_own_worker(packed: Path, src: Path, tmp_path: Path) -> None:
    with Archive(str(packed), index_dir=str(tmp_path / "idx")) as ar:
        paths = ar.archive_order()
        assert ar.read(paths[5]) == (src / paths[5]).read_bytes()  # the parent's worker thread runs
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            try:
                ok = all(ar.read(p) == (src / p).read_bytes() for p in reversed(paths))
                os._exit(0 if ok else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


# -- corruption: never a wrong byte ---------------------------------------------------------------
def _corrupt_raw_block(archive: Path, tmp_path: Path) -> tuple[int, list[str], str]:
    """Flip one byte that zstd stores as it is (literals of incompressible data) inside frame 1:
    decoding succeeds, so only the member's CRC and the frame checksum can notice."""
    with Archive(str(archive), index_dir=str(tmp_path / "idx0")) as ar:
        ix = ar.index
        fr = ar.format.stream.frames
        members = _members_of_frame(ar, 1)
        frame = _frame_bytes(archive, ar, 1)
        with open(archive, "rb") as f:
            f.seek(fr.comp_offset[1])
            comp = f.read(fr.comp_size[1])
        for victim in members[1:]:  # a member some of whose bytes are stored as they are
            start = ix.offset[ix.lookup(victim)] - fr.dec_offset[1]
            size = ix.size[ix.lookup(victim)]
            hits = [comp.find(frame[start + k : start + k + 32]) for k in range(0, size - 32, 997)]
            pos = max(hits, default=-1)
            if pos > 0:
                break
        else:
            raise AssertionError("no member of frame 1 is stored raw")
        with open(archive, "r+b") as f:
            f.seek(fr.comp_offset[1] + pos + 5)
            byte = f.read(1)
            f.seek(fr.comp_offset[1] + pos + 5)
            f.write(bytes([byte[0] ^ 0x01]))
        return 1, members, victim


def test_raw_block_corruption_gives_eio_never_wrong_bytes(
    packed: Path, src: Path, tmp_path: Path, decoder: str
) -> None:
    archive = tmp_path / "bad.tar.zst"
    archive.write_bytes(packed.read_bytes())
    _, members, victim = _corrupt_raw_block(archive, tmp_path)
    before = members[: members.index(victim)]
    with Archive(str(archive), index_dir=str(tmp_path / "idx")) as ar:
        for path in before:  # served early: their own CRCs check
            assert ar.read(path) == (src / path).read_bytes()
        with pytest.raises(CorruptMemberError, match=r"CRC|checksum"):
            ar.read(victim)
        for path in members:  # every member of the frame: its exact bytes, or an error
            try:
                data = ar.read(path)
            except CorruptMemberError:
                assert path == victim
            else:
                assert data == (src / path).read_bytes()
        time.sleep(0.2)
        assert ar.cache.peek(("zf", 1)) is None  # the frame checksum failed: never cached


@pytest.mark.fuse
@pytest.mark.parametrize("finish", ["1", "auto"], ids=["finished", "kept-partial"])
def test_mount_serves_early_members_and_stats_show_it(
    packed: Path, src: Path, tmp_path: Path, mnt: Path, finish: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDMLFS_FINISH_FRAMES", finish)  # auto: finished once a frame comes back
    with mounted(packed, mnt, "--index-dir", str(tmp_path / "idx")):
        paths = _source_paths(src)
        random.Random(2).shuffle(paths)
        _read_all_through(mnt, src, paths)
        stats = mount_stats(mnt)
        decoder = stats["decoder"]
        assert decoder["early_frames"] >= 1  # first reads of frames answered before the frame was done
        assert decoder["spares_used"] >= 1  # the daemon warmed spare buffers up after mounting
        assert decoder["frames_finished_in_background"] == (finish == "1")
        text = run_cli("stats", str(mnt), check=True).stdout.decode()
        assert any(line.startswith("decoder ") and "early_frames" in line for line in text.splitlines())


@pytest.mark.fuse
def test_raw_block_corruption_through_the_mount(packed: Path, src: Path, tmp_path: Path, mnt: Path) -> None:
    archive = tmp_path / "bad.tar.zst"
    archive.write_bytes(packed.read_bytes())
    _, members, victim = _corrupt_raw_block(archive, tmp_path)
    with mounted(archive, mnt, "--index-dir", str(tmp_path / "idx")):
        pid = daemon_pid(mnt)
        for path in members[::-1] + members:
            try:
                data = (mnt / path).read_bytes()
            except OSError as exc:
                assert exc.errno == errno.EIO and path == victim
            else:
                assert data == (src / path).read_bytes()
        with pytest.raises(OSError) as exc:
            (mnt / victim).read_bytes()
        assert exc.value.errno == errno.EIO
        assert is_mounted(mnt)
        assert pid is not None
        os.kill(pid, 0)


# -- the C decoder on its own ---------------------------------------------------------------------
def test_native_frame_decoder_checks_size_and_checksum(tmp_path: Path) -> None:
    mod = native_module("cdmlfs._zstdframe")
    data = english_like(300_000, 1) + random.Random(1).randbytes(200_000)
    comp = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(data)
    dec = mod.FrameDecoder()
    out = bytearray(len(data))
    dec.start(out)
    for k in range(0, len(comp), 7_000):
        dec.feed(comp[k : k + 7_000])
    assert dec.done and dec.pos == len(data) and bytes(out) == data
    dec.release()
    path = tmp_path / "f.zst"
    path.write_bytes(b"pad" + comp)
    fd = os.open(path, os.O_RDONLY)
    try:
        out = bytearray(len(data))
        dec.start(out)
        used = dec.feed_fd(fd, 3, len(comp), 1000)  # stops soon after 1000 bytes are final
        assert 1000 <= dec.pos < len(data) and not dec.done and 0 < used < len(comp)
        used += dec.feed_fd(fd, 3 + used, len(comp) - used, len(data))
        assert dec.done and used == len(comp) and bytes(out) == data
    finally:
        os.close(fd)
    plain = zstandard.ZstdCompressor(level=3, write_checksum=False).compress(data)
    out = bytearray(len(data))
    dec.start(out)
    dec.feed(plain)  # no checksum to check
    assert dec.done and bytes(out) == data
    bad = bytearray(comp)
    bad[-1] ^= 1  # the checksum
    for payload, size, what in (
        (bytes(bad), len(data), "checksum"),
        (comp, len(data) - 1, "small"),
        (comp, len(data) + 1, "ended before"),
        (comp + b"x", len(data), "after the end"),
    ):
        dec.start(bytearray(size))
        with pytest.raises(mod.DecodeError, match=what):
            dec.feed(payload)
        with pytest.raises(RuntimeError):
            dec.feed(comp)  # a failed decoder needs start() again
    # A header that arrives over several feeds is read whole before the checksum flag is known:
    # a 3-byte first feed used to count as "unreadable, so checked" and failed a frame without one.
    for payload, good in ((plain, True), (comp, True), (bytes(bad), False)):
        dec.start(out := bytearray(len(data)))
        feeds = [payload[k : k + 3] for k in range(0, 30, 3)] + [payload[30:]]
        if good:
            for chunk in feeds:
                dec.feed(chunk)
            assert dec.done and bytes(out) == data
        else:
            with pytest.raises(mod.DecodeError, match="checksum"):
                for chunk in feeds:
                    dec.feed(chunk)


def test_hot_extents_in_c_mirror_the_frames_the_cache_holds(packed: Path, src: Path, tmp_path: Path) -> None:
    """Every cached frame the reader served from is readable in C; evicted ones are let go at once."""
    fastpath = pytest.importorskip("cdmlfs.fastpath")
    native_module("cdmlfs._fastpath")
    with Archive(str(packed), index_dir=str(tmp_path / "idx"), cache_size=3 * (1 << 20)) as ar:
        table = fastpath.build_table(ar)
        hot = fastpath.attach(ar, table)
        frames = {key for key in ar.cache._lru if key[0] != "tar"}
        assert table.hot_extents == 0 and not frames
        for path in _source_paths(src):
            assert ar.read(path) == (src / path).read_bytes()
            cached = set(ar.cache._lru)
            assert set(hot._starts) <= cached  # never a view of something the cache let go
            assert table.hot_extents == len(hot._starts)
        assert ar.cache.stats.evictions > 0  # the 3 MiB cache could not keep all frames
        assert table.hot_extents >= 1
        ar.cache.clear()
        assert table.hot_extents == 0


@pytest.mark.fuse
def test_mount_serves_reads_across_many_frames_in_c(
    packed: Path, src: Path, tmp_path: Path, mnt: Path
) -> None:
    """Once frames are decoded, reads that jump between them are answered in C, each frame
    going to Python at most once to be reported (one "last extent" would send most to Python).

    The first pass warms the cache; how many of its reads reach C depends on timing (a read of
    a frame still being decoded ahead is served in Python), so only the second is counted.
    """
    with mounted(packed, mnt, "--index-dir", str(tmp_path / "idx")):
        paths = _source_paths(src)
        _read_all_through(mnt, src, paths)
        before = mount_stats(mnt)["fast_path"]
        if before is None:
            pytest.skip("C fast path not active")
        for path in paths:  # drop the kernel's copies so the next reads reach the daemon
            fd = os.open(mnt / path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        # m00 (c0), m01 (c1), m02 (c2), ...: consecutive reads land in different frames
        jumping = sorted(paths, key=lambda p: p.rsplit("/", 1)[1])
        _read_all_through(mnt, src, jumping)
        stats = mount_stats(mnt)
        fast = stats["fast_path"]
        frames = stats["cache"]["extents"]
        assert 1 <= fast["hot_extents"] <= frames, fast
        to_python = fast["read_fallback"] - before["read_fallback"]
        in_c = fast["read_fast"] - before["read_fast"]
        assert in_c + to_python >= len(paths), (before, fast)  # every file was read again
        assert to_python <= frames, (before, fast)


def _packed_16m_frames_with_a_flipped_byte(
    tmp_path: Path, files: dict[str, bytes], victim: str, at: int
) -> Path:
    """``files`` packed with 16 MiB frames, one byte of ``victim`` flipped about offset ``at``."""
    src = tmp_path / "src"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    archive = cdmlfs_pack(src, tmp_path / "big-frames.tar.zst", "--frame-size", "16M")
    blob = bytearray(archive.read_bytes())
    pos = blob.find(files[victim][at : at + 64])  # random bytes: stored verbatim
    assert pos > 0
    blob[pos + 10] ^= 0xFF
    archive.write_bytes(bytes(blob))
    return archive


@pytest.mark.fuse
def test_frames_too_large_for_one_decode_still_check_member_crcs(
    both_paths: str, tmp_path: Path, mnt: Path
) -> None:
    """16 MiB frames and a 16 MiB cache: frames are served in pieces, before their checksum can be
    checked. A flipped byte in a raw block of one member is then caught by that member's own CRC."""
    rng = random.Random(1)
    files = {f"f{i}.bin": rng.randbytes(3 << 20) for i in range(3)}
    archive = _packed_16m_frames_with_a_flipped_byte(tmp_path, files, "f1.bin", 1_000_000)
    with Archive(str(archive), index_dir=str(tmp_path / "idx"), cache_size=16 << 20) as ar:
        assert ar.read("f0.bin") == files["f0.bin"]
        for _ in range(2):
            with pytest.raises(CorruptMemberError, match="CRC"):
                ar.read("f1.bin", 0, 4096)
    with mounted(archive, mnt, "--index-dir", str(tmp_path / "idx"), "--cache-size", "16M"):
        for name, data in files.items():  # every member: its exact bytes, or EIO
            try:
                got = (mnt / name).read_bytes()
            except OSError as exc:
                assert exc.errno == errno.EIO
            else:
                assert got == data, name
        with pytest.raises(OSError) as exc:
            (mnt / "f1.bin").read_bytes()
        assert exc.value.errno == errno.EIO


@pytest.mark.fuse
def test_members_too_large_to_gather_from_pieces_are_crc_checked_once_read(
    both_paths: str, tmp_path: Path, mnt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A packed member larger than a quarter of the cache, in a frame served in pieces: its pieces
    were served unchecked for ever (the frame continues past it, so reading it never reached the
    frame checksum): every read of a flipped byte gave wrong bytes, and no error ever came. Now its
    CRC is checked once all its bytes have been read (the rule for large stored ZIP members)."""
    rng = random.Random(2)
    files = {"a_big.bin": rng.randbytes(6 << 20), "b_after.bin": rng.randbytes(6 << 20)}
    archive = _packed_16m_frames_with_a_flipped_byte(tmp_path, files, "a_big.bin", 3_000_000)
    chunk = 1 << 20
    with (
        caplog.at_level(logging.WARNING),
        Archive(str(archive), index_dir=str(tmp_path / "idx"), cache_size=16 << 20) as ar,
    ):
        # Written by cdmlfs pack: the advice is a larger cache, not "convert it with cdmlfs pack".
        assert "a cache of 52 MiB or more" in caplog.text and "CRC-checked only once" in caplog.text
        assert "cdmlfs pack" not in caplog.text
        assert ar.reader.whole_limit < len(files["a_big.bin"])
        offsets = list(range(0, len(files["a_big.bin"]), chunk))
        rng.shuffle(offsets)
        for k, offset in enumerate(offsets):
            want = files["a_big.bin"][offset : offset + chunk]
            if k < len(offsets) - 1:  # served before the CRC can be known (documented)
                ar.read("a_big.bin", offset, chunk)
                continue
            with pytest.raises(CorruptMemberError, match="CRC"):  # the read that completes the member
                ar.read("a_big.bin", offset, chunk)
        for offset in offsets[:2]:  # and every read after it, wherever
            with pytest.raises(CorruptMemberError):
                ar.read("a_big.bin", offset, 4096)
        assert want  # the last chunk exists
    with mounted(archive, mnt, "--index-dir", str(tmp_path / "idx2"), "--cache-size", "16M"):
        with pytest.raises(OSError) as exc:
            (mnt / "a_big.bin").read_bytes()
        assert exc.value.errno == errno.EIO
        with pytest.raises(OSError) as exc:
            (mnt / "a_big.bin").read_bytes()
        assert exc.value.errno == errno.EIO
        try:  # its pieces reach the end of the damaged frame, whose checksum fails: EIO, or its bytes
            assert (mnt / "b_after.bin").read_bytes() == files["b_after.bin"]
        except OSError as err:
            assert err.errno == errno.EIO


SERVE_WITH_A_WRONG_CRC = r"""
import sys
from cdmlfs.archive import Archive
from cdmlfs.daemon import ServeOptions, serve
archive, mountpoint, index_dir, member = sys.argv[1:5]
ar = Archive(archive, cache_size=64 << 20, index_dir=index_dir)
ar.index.crc[ar.index.get(member)] ^= 1  # the member table disagrees with the frame's bytes
serve(ar, ServeOptions(mountpoint=mountpoint, threads="single"))
"""


@pytest.mark.fuse
@pytest.mark.parametrize("neighbour_first", [False, True], ids=["victim-first", "neighbour-first"])
def test_c_path_refuses_a_member_whose_own_crc_failed(
    packed: Path, src: Path, tmp_path: Path, mnt: Path, neighbour_first: bool, finishing: None
) -> None:
    """A packed member whose CRC fails while its frame is sound: the frame is handed to the C path
    (it serves the frame's other members), but not that member, on any later read either. Read
    after a neighbour put the frame in C, the member is checked there before its first byte."""
    import subprocess
    import sys

    with Archive(str(packed), index_dir=str(tmp_path / "idx")) as ar:
        victim, neighbour = ar.archive_order()[:2]  # the first two members: one 1 MiB frame
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_WITH_A_WRONG_CRC, str(packed), str(mnt), str(tmp_path / "idx"), victim],
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while not is_mounted(mnt):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.05)
        if neighbour_first:
            assert (mnt / neighbour).read_bytes() == (src / neighbour).read_bytes()
            time.sleep(0.5)  # the frame is finished in the background and cached
            fd = os.open(mnt / neighbour, os.O_RDONLY)
            try:  # drop its page cache: the next read reaches the daemon, which hands the frame to C
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert os.pread(fd, 4096, 0) == (src / neighbour).read_bytes()[:4096]
            finally:
                os.close(fd)
            assert mount_stats(mnt)["fast_path"]["hot_extents"] >= 1
        with pytest.raises(OSError) as exc:
            (mnt / victim).read_bytes()
        assert exc.value.errno == errno.EIO
        time.sleep(0.5)  # the frame is finished in the background and cached
        assert (mnt / neighbour).read_bytes() == (src / neighbour).read_bytes()  # hands the frame to C
        assert mount_stats(mnt)["fast_path"]["hot_extents"] >= 1
        for _ in range(2):
            with pytest.raises(OSError) as exc:
                (mnt / victim).read_bytes()
            assert exc.value.errno == errno.EIO
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_without_a_frame_worker_large_frames_are_not_read_whole_first(tmp_path: Path) -> None:
    """A cache too small for the frame worker (under 8 frames): each frame's compressed bytes were
    read whole into memory outside the cache before decoding (16 MiB frames of incompressible
    data, a 64 MiB cache: 39 MB of daemon RSS past the cache), and the decoded frame was a second
    Python object. The native decoder reads them in 256 KiB pieces straight into the frame's buffer."""
    import tracemalloc

    if not zstdframes.NATIVE:
        pytest.skip("needs the C frame decoder")
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(3)
    files = {f"f{i}.bin": rng.randbytes(5 << 20) for i in range(6)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    archive = cdmlfs_pack(src, tmp_path / "p.tar.zst", "--frame-size", "16M")
    with Archive(str(archive), index_dir=str(tmp_path / "idx"), cache_size=64 << 20) as ar:
        stream = ar.format.stream
        assert stream._frames is None and max(stream.frames.dec_size) > 8 << 20  # no worker: the path
        tracemalloc.start()
        try:
            for name in ("f0.bin", "f4.bin"):
                assert ar.read(name, 1 << 20, 4096) == files[name][1 << 20 : (1 << 20) + 4096]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert stream.frame_decodes >= 2
        assert peak < 2 << 20, peak  # was the whole compressed frame and the decoded one: > 16 MiB
        for name, data in files.items():  # and the bytes are right, checksums checked
            assert ar.read(name) == data


def test_large_packed_members_in_pieces_are_still_decoded_ahead(tmp_path: Path) -> None:
    """The check of whether a large packed member is served from checked frames listed all of its
    extents on every read: that moved the stream's idea of where the reader was to the member's
    end, so the piece after each read was never decoded ahead (and each read cost O(member))."""
    src = tmp_path / "src"
    src.mkdir()
    data = random.Random(4).randbytes(48 << 20)
    (src / "big.bin").write_bytes(data)
    archive = cdmlfs_pack(src, tmp_path / "p.tar.zst", "--frame-size", "16M")
    with Archive(str(archive), index_dir=str(tmp_path / "idx"), cache_size=32 << 20) as ar:
        ar.warm_up(decode_ahead=True)
        stream = ar.format.stream
        chunk = 128 << 10
        for offset in range(0, len(data), chunk):
            assert ar.read("big.bin", offset, chunk) == data[offset : offset + chunk]
        assert stream.prefetched > 0
