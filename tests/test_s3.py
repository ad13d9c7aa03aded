"""S3 sources through the Python API against real HTTP endpoints on 127.0.0.1 (moto, localbucket).

A fault-injecting proxy between boto3 and the endpoint counts the bytes requested
and injects 503s, resets, stalls and short bodies.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import s3util
from archives import python_zip, sample_files
from mountutil import run_cli

from cdmlfs.archive import Archive
from cdmlfs.errors import (
    ArchiveFormatError,
    ArchiveNotFoundError,
    SourceChangedError,
    SourceError,
    UsageError,
)
from cdmlfs.sources import s3 as s3mod
from cdmlfs.sources.local import LocalFile
from cdmlfs.sources.retry import RetryPolicy
from cdmlfs.sources.s3 import parse_s3_uri
from cdmlfs.sources.s3_presigned import hide_signature, refused
from cdmlfs.zstd_seekable import walk_frames

# Session servers and the proxy factory (fixtures live in s3util: conftest.py is shared).
s3_credentials = s3util.s3_credentials
moto_s3 = s3util.moto_s3
localbucket_s3 = s3util.localbucket_s3
proxy_to = s3util.proxy_to
MiB = 1 << 20
FAST_RETRY = RetryPolicy(max_attempts=8, base_delay=0.01, max_delay=0.05, deadline=10.0)


def _small_zip(
    tmp_path: Path, name: str = "a.zip", seed: int = 0, method: int = zipfile.ZIP_DEFLATED
) -> Path:
    files = sample_files(seed)
    files["big/stored.bin"] = random.Random(seed).randbytes(3 * MiB)
    return python_zip(tmp_path / name, files, method)


def _stored_zip_on(endpoint, bucket: str, key: str, tmp_path: Path, members: dict[str, bytes]) -> None:
    """A ZIP of stored ``members`` put at ``s3://bucket/key`` on ``endpoint``."""
    path = tmp_path / key
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    endpoint.put(bucket, key, path)


def _many_small_zip(path: Path, n: int, size: int = 2048, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for i in range(n):
            zf.writestr(f"d{i // 1000:03d}/m{i:06d}.bin", rng.randbytes(size))
    return path


def _random_tree(root: Path, files: int, dirs: int, sizes: tuple[int, int], seed: int) -> Path:
    """``files`` files of random bytes (sizes in [lo, hi)) spread over ``dirs`` folders."""
    rng = random.Random(seed)
    for i in range(files):
        p = root / f"d{i % dirs}" / f"f{i:04d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(rng.randrange(*sizes)))
    return root


def _assert_same(remote: Archive, local: Archive) -> None:
    assert remote.files() == local.files()
    for path in local.files():
        assert remote.stat(path).size == local.stat(path).size, path
        assert remote.read(path) == local.read(path), path


# -- basics --------------------------------------------------------------------------------------
def test_uri_parsing() -> None:
    assert parse_s3_uri("s3://bkt/a/b c.zip") == ("bkt", "a/b c.zip")
    for bad in ("s3://bkt", "s3://bkt/", "s3://bkt/dir/", "s3:///key"):
        with pytest.raises(UsageError):
            parse_s3_uri(bad)
    with pytest.raises(UsageError) as info:
        parse_s3_uri("s3://AKIDEXAMPLE:s3cr3t@bkt/key.zip")
    assert "s3cr3t" not in str(info.value)
    with pytest.raises(UsageError, match=r"invalid bucket name 'b' in s3://b/k\.zip: 2-255 letters"):
        parse_s3_uri("s3://b/k.zip")  # says which name and the rule, without a credentials remark
    # Access point ARNs stand for buckets, as in the AWS CLI (they were taken for credentials).
    ap = "arn:aws:s3:us-west-2:123456789012:accesspoint/my-ap"
    assert parse_s3_uri(f"s3://{ap}/data/train.zip") == (ap, "data/train.zip")
    outpost = "arn:aws:s3-outposts:us-east-1:123456789012:outpost/op-01ac5d28a6a232904/accesspoint/ap1"
    assert parse_s3_uri(f"s3://{outpost}/k.tar.zst") == (outpost, "k.tar.zst")
    lam = "arn:aws-cn:s3-object-lambda:cn-north-1:123456789012:accesspoint/olap"
    assert parse_s3_uri(f"s3://{lam}/a b.zip") == (lam, "a b.zip")
    mrap = "arn:aws:s3::123456789012:accesspoint/mfzwi23gnjvgw.mrap"  # multi-region: no region
    assert parse_s3_uri(f"s3://{mrap}/k.zip") == (mrap, "k.zip")
    for bad in (f"s3://{ap}", f"s3://{ap}/", f"s3://{ap}/dir/"):
        with pytest.raises(UsageError, match="an object, not a prefix"):
            parse_s3_uri(bad)
    # Both were told "credentials in the URI are not supported".
    with pytest.raises(UsageError, match="a bucket ARN is not taken; name the bucket"):
        parse_s3_uri("s3://arn:aws:s3:::bkt/a.zip")
    with pytest.raises(UsageError, match="--endpoint-url http://minio:9000 and name the bucket"):
        parse_s3_uri("s3://minio:9000/bkt/a.zip")
    with pytest.raises(UsageError) as info:  # a secret that looks like a port is still never echoed
        parse_s3_uri("s3://AKID:123@bkt/key.zip")
    assert "123" not in str(info.value) and "credentials" in str(info.value)


def test_zip_on_moto_equals_local_and_opens_with_one_request(
    moto_s3, proxy_to, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The open waits HEAD_WAIT (1 s) for the first 4 KiB; moto on a busy machine can be slower, and
    # the sniffing then asks again. That cut-off has its own test (a stalled prefetch of the first
    # bytes); this one counts requests.
    monkeypatch.setattr(s3mod, "HEAD_WAIT", 30.0)
    path = _small_zip(tmp_path)
    etag = moto_s3.put("api", "dir/a.zip", path)
    proxy = proxy_to(moto_s3)
    with Archive("s3://api/dir/a.zip", endpoint_url=proxy.url) as remote, Archive(str(path)) as local:
        # A suffix GET gives size, ETag, the end-of-directory record and the directory itself;
        # the first 4 KiB (format sniffing) come in a second GET sent at the same time.
        assert sorted(r[1] for r in proxy.stats.log) == ["bytes=-131072", "bytes=0-4095"]
        remote.listdir("data")
        remote.read("readme.txt")
        assert proxy.stats.requests == 2
        assert remote.source.identity.version == etag.strip('"')
        assert remote.source.size == path.stat().st_size
        assert remote.source.prefers_threads and remote.source.fileno() is None
        _assert_same(remote, local)
        with remote.open("big/stored.bin") as f:
            f.seek(MiB + 5)
            assert f.read(1000) == local.read("big/stored.bin", MiB + 5, 1000)


def test_open_errors_are_one_line_usage_or_source_errors(moto_s3, proxy_to, tmp_path: Path) -> None:
    moto_s3.put("errs", "x.zip", _small_zip(tmp_path))
    # ArchiveNotFoundError (ENOENT), as for a missing local file: it was a bare UsageError (EINVAL).
    with pytest.raises(ArchiveNotFoundError, match="no such object") as missing:
        Archive("s3://errs/missing.zip", endpoint_url=moto_s3.url)
    assert missing.value.errno == errno.ENOENT
    with pytest.raises(ArchiveNotFoundError, match="no such bucket 'no-such-bucket'"):
        Archive("s3://no-such-bucket/x.zip", endpoint_url=moto_s3.url)
    with pytest.raises(UsageError, match=r"retry must be a cdmlfs\.sources\.retry\.RetryPolicy"):
        Archive("s3://errs/x.zip", endpoint_url=moto_s3.url, retry=1)
    proxy = proxy_to(moto_s3)
    proxy.inject("403", 2)  # the suffix and the head requests
    with pytest.raises(SourceError, match="access denied"):
        Archive("s3://errs/x.zip", endpoint_url=proxy.url)
    with pytest.raises(UsageError, match="profile 'no-such-profile' not found"):
        Archive("s3://errs/x.zip", endpoint_url=moto_s3.url, profile="no-such-profile")
    with pytest.raises(UsageError, match="profile '' not found"):  # was "AWS profile None not found"
        Archive("s3://errs/x.zip", endpoint_url=moto_s3.url, profile="")


def test_no_sign_request_sends_anonymous_requests(moto_s3, proxy_to, tmp_path: Path) -> None:
    path = _small_zip(tmp_path)
    moto_s3.put("public", "p.zip", path)
    with pytest.raises(SourceError, match="access denied"):  # moto checks: anonymous needs a public object
        Archive("s3://public/p.zip", endpoint_url=moto_s3.url, no_sign_request=True)
    moto_s3.client().put_object_acl(Bucket="public", Key="p.zip", ACL="public-read")
    with Archive("s3://public/p.zip", endpoint_url=moto_s3.url, no_sign_request=True) as remote:
        assert remote.read("readme.txt") == Archive(str(path)).read("readme.txt")


def test_archive_pickles_and_reopens_with_its_options(moto_s3, tmp_path: Path) -> None:
    path = _small_zip(tmp_path)
    moto_s3.put("api", "pickled.zip", path)
    with Archive("s3://api/pickled.zip", endpoint_url=moto_s3.url, cache_size=32 * MiB) as remote:
        clone = pickle.loads(pickle.dumps(remote))
        assert clone.read("readme.txt") == remote.read("readme.txt")
        clone.close()


# -- request economy ------------------------------------------------------------------------------
def test_random_small_members_cost_about_the_bytes_they_need(
    localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    path = _many_small_zip(tmp_path / "small.zip", 20_000)
    localbucket_s3.put("bench", "small.zip", path)
    proxy = proxy_to(localbucket_s3)
    with Archive("s3://bench/small.zip", endpoint_url=proxy.url) as remote, Archive(str(path)) as local:
        opened = proxy.stats.body_bytes
        cd_size = _central_directory_size(path)
        assert opened <= max(cd_size + 64 * 1024, 1 * MiB)
        proxy.reset_stats()
        rng = random.Random(1)
        needed = 0
        for name in rng.sample(local.files(), 100):
            assert remote.read(name) == local.read(name)
            needed += 2048 + 30 + len(name)
        assert proxy.stats.body_bytes <= 2 * needed
        assert proxy.stats.requests <= 100 + 3


def _central_directory_size(path: Path) -> int:
    with zipfile.ZipFile(path) as zf:
        return zf.start_dir and path.stat().st_size - zf.start_dir


def test_sequential_read_of_a_large_member_prefetches_in_parallel(
    localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    data = random.Random(3).randbytes(40 * MiB)
    _stored_zip_on(localbucket_s3, "bench", "large.zip", tmp_path, {"small.txt": b"hello", "large.bin": data})
    proxy = proxy_to(localbucket_s3)
    with Archive("s3://bench/large.zip", endpoint_url=proxy.url, cache_size=64 * MiB) as remote:
        proxy.reset_stats()
        digest = hashlib.sha256()
        with remote.open("large.bin") as f:
            while chunk := f.read(1 * MiB):
                digest.update(chunk)
        assert digest.digest() == hashlib.sha256(data).digest()
        stats = remote.source.stats()
        assert stats["prefetches"] > 0
        assert proxy.stats.requests < 40  # far fewer requests than 1 MiB reads
        assert proxy.stats.body_bytes <= len(data) + 2 * MiB  # nothing fetched twice
        assert remote.cache.held <= remote.cache.limit


def _sha256_read_into(remote: Archive, name: str) -> bytes:
    """The member's digest, read front to back into one 1 MiB buffer (as a scanning reader does)."""
    digest = hashlib.sha256()
    with remote.open(name) as f:
        buf = bytearray(1 * MiB)
        while n := f.readinto(buf):
            digest.update(memoryview(buf)[:n])
    return digest.digest()


def test_long_scan_receives_into_recycled_buffers_over_kept_alive_connections(
    localbucket_s3, proxy_to, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts received before the reader gets there (open bodies off: ``read`` callers, too many
    bodies open, or CDMLFS_S3_OPEN_BODIES=0) go into recycled buffers."""
    monkeypatch.setenv("CDMLFS_S3_OPEN_BODIES", "0")
    data = random.Random(6).randbytes(96 * MiB)
    _stored_zip_on(localbucket_s3, "bench", "scan.zip", tmp_path, {"large.bin": data})
    proxy = proxy_to(localbucket_s3)
    # The default cache (512 MiB): 16 MiB parts and four spares (an eighth of the cache); 6 parts.
    with Archive("s3://bench/scan.zip", endpoint_url=proxy.url) as remote:
        proxy.reset_stats()
        for _ in range(2):  # the second pass reuses what the first one dropped behind
            assert _sha256_read_into(remote, "large.bin") == hashlib.sha256(data).digest()
        stats = remote.source.stats()
        assert stats["buffers_reused"] >= 2  # a short scan: most parts are requested before any drop
        assert stats["dropped_behind"] >= 8
        assert remote.cache.held + remote.cache.reserved <= remote.cache.limit
        # Bodies received into buffers hand their connection back: no new connection per request.
        assert proxy.stats.requests >= 12
        assert proxy.stats.connections <= 16 + 2
    assert remote.cache.reserved == 0  # closing gave back the spares' reservations


def test_a_scan_into_a_buffer_receives_replies_straight_into_it_even_with_faults(
    localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    """Prefetched replies stop at their headers and the reader receives each body into its own
    buffer: no copy out of a part buffer. Connections cut, bodies truncated or stalled while they
    wait: those bytes are fetched again (with If-Match), zero wrong bytes."""
    data = random.Random(8).randbytes(96 * MiB)
    _stored_zip_on(localbucket_s3, "bench", "open.zip", tmp_path, {"large.bin": data})
    proxy = proxy_to(localbucket_s3, stall_seconds=1.0)

    def scan(remote) -> None:
        assert _sha256_read_into(remote, "large.bin") == hashlib.sha256(data).digest()

    with Archive("s3://bench/open.zip", endpoint_url=proxy.url) as remote:
        proxy.reset_stats()
        scan(remote)
        stats = remote.source.stats()
        assert stats["streamed_bytes"] >= len(data) // 2, stats  # (see the block layer's tests)
        assert stats["bodies_failed"] == 0
        assert proxy.stats.body_bytes <= len(data) + 2 * MiB  # nothing fetched twice
        assert proxy.stats.connections <= 16 + 2  # finished bodies hand their connection back
    assert remote.source.stats()["get_requests"] > 0  # (closed: no body left open to leak)
    with Archive(
        "s3://bench/open.zip",
        endpoint_url=proxy.url,
        retry=FAST_RETRY,
        read_timeout=0.5,
    ) as remote:
        proxy.inject("stall_body", 2)
        proxy.chaos(0.3, ("reset", "truncate", "short", "503"))
        scan(remote)
        stats = remote.source.stats()
        assert stats["bodies_opened"] >= 2 and stats["streamed_bytes"] > 0, stats
        assert stats["bodies_failed"] >= 1, stats
        assert proxy.stats.faults >= 3


def test_large_and_sequential_reads_go_out_as_parallel_ranged_gets(
    localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    """The README's "large reads split into parallel ranged GETs" and readahead, seen at the wire:
    each GET waits 50 ms at the proxy, so only requests sent in parallel can overlap there."""
    data = random.Random(7).randbytes(64 * MiB)
    _stored_zip_on(localbucket_s3, "bench", "par.zip", tmp_path, {"large.bin": data})
    proxy = proxy_to(localbucket_s3)
    proxy.latency = 0.05
    with Archive("s3://bench/par.zip", endpoint_url=proxy.url) as remote:
        proxy.reset_stats()
        assert remote.read("large.bin", offset=0, size=40 * MiB) == data[: 40 * MiB]
        assert proxy.stats.max_in_flight >= 4, proxy.stats.max_in_flight
    with Archive("s3://bench/par.zip", endpoint_url=proxy.url) as remote:  # nothing cached
        proxy.reset_stats()
        got = bytearray()
        with remote.open("large.bin") as f:  # a sequential reader, 1 MiB at a time
            while chunk := f.read(1 * MiB):
                got += chunk
        assert got == data
        assert proxy.stats.max_in_flight >= 2, proxy.stats.max_in_flight


def test_faults_during_a_long_scan_into_recycled_buffers_give_zero_wrong_bytes(
    localbucket_s3, proxy_to, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDMLFS_S3_OPEN_BODIES", "0")  # parts received into buffers (see above)
    data = random.Random(7).randbytes(80 * MiB)  # above the 64 MiB read-whole limit: a streamed scan
    _stored_zip_on(localbucket_s3, "faults", "faulty-scan.zip", tmp_path, {"large.bin": data})
    proxy = proxy_to(localbucket_s3, stall_seconds=1.0)
    with Archive(
        "s3://faults/faulty-scan.zip",
        endpoint_url=proxy.url,
        retry=FAST_RETRY,
        read_timeout=0.5,
        cache_size=256 * MiB,
    ) as remote:
        proxy.inject("stall_body")
        proxy.chaos(0.3, ("503", "reset", "truncate", "short"))
        for _ in range(2):  # 1 MiB reads: a sequential scan served by prefetched parts
            got = bytearray()
            with remote.open("large.bin") as f:
                while chunk := f.read(1 * MiB):
                    got += chunk
            assert got == data
        stats = remote.source.stats()
        assert stats["prefetches"] >= 8
        assert proxy.stats.faults >= 3
        assert stats["retries"] >= 3
        assert stats["buffers_reused"] >= 1


# -- consistency ----------------------------------------------------------------------------------
@pytest.mark.parametrize("server", ["moto", "localbucket"])
def test_object_replaced_after_open_fails_reads_never_mixes_bytes(
    server: str, moto_s3, localbucket_s3, tmp_path: Path
) -> None:
    """moto enforces If-Match (412); localbucket ignores it, so the reply's ETag check must catch it."""
    ep = moto_s3 if server == "moto" else localbucket_s3
    old = _small_zip(tmp_path, "old.zip", seed=1, method=zipfile.ZIP_STORED)
    new = _small_zip(tmp_path, "new.zip", seed=2, method=zipfile.ZIP_STORED)
    assert old.stat().st_size == new.stat().st_size  # same layout, different bytes
    ep.put("cons", f"{server}.zip", old)
    with Archive(f"s3://cons/{server}.zip", endpoint_url=ep.url, retry=FAST_RETRY) as remote:
        first = remote.read("readme.txt")  # cached in the suffix
        ep.put("cons", f"{server}.zip", new)
        with pytest.raises(SourceChangedError, match="changed after it was opened"):
            remote.read("big/stored.bin")
        with pytest.raises(SourceChangedError):  # sticky: no further requests either
            remote.read("big/stored.bin", 100, 10)
        assert remote.read("readme.txt") == first  # bytes of the version opened, from the cache


def test_a_server_that_drops_if_match_and_etags_cannot_mix_versions(
    moto_s3, proxy_to, tmp_path: Path
) -> None:
    """Without If-Match nor an ETag on ranged replies nothing would tell the versions apart: such
    replies are refused (a plain member of the new version was served under the old index)."""
    old = _small_zip(tmp_path, "old.zip", seed=1, method=zipfile.ZIP_STORED)
    moto_s3.put("cons", "quirky.zip", old)
    proxy = proxy_to(moto_s3)
    proxy.quirks |= {"ignore_if_match", "no_etag"}
    with pytest.raises(SourceError, match="no ETag"):  # the central directory is read at open
        Archive("s3://cons/quirky.zip", endpoint_url=proxy.url, retry=FAST_RETRY)


def test_weak_etags_are_not_sent_as_if_match(moto_s3, proxy_to, tmp_path: Path) -> None:
    """If-Match compares strongly, so a weak ETag never matches: every read was "changed" (EIO).
    Reads then rely on the ETag of each reply (and on Last-Modified: If-Unmodified-Since, which moto
    may enforce first), which still catches a replaced object."""
    rng = random.Random(3)
    v1 = {f"m{i:03d}.bin": rng.randbytes(64 << 10) for i in range(100)}
    _stored_zip_on(moto_s3, "cons", "weak.zip", tmp_path, v1)
    proxy = proxy_to(moto_s3)
    proxy.quirks.add("weak_etag")
    with Archive("s3://cons/weak.zip", endpoint_url=proxy.url, retry=FAST_RETRY) as remote:
        assert remote.source.etag.startswith("W/")
        assert remote.read("m000.bin") == v1["m000.bin"]
        _stored_zip_on(moto_s3, "cons", "weak.zip", tmp_path, {k: bytes(len(v)) for k, v in v1.items()})
        with pytest.raises(SourceChangedError, match=r"ETag is now|If-Unmodified-Since failed"):
            remote.read("m050.bin")


@pytest.mark.parametrize("enforced", [True, False], ids=["server-enforces", "header-dropped"])
def test_a_weak_etag_that_outlives_a_replacement_is_backed_by_last_modified(
    enforced: bool, moto_s3, proxy_to, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server deriving weak ETags from metadata may keep one across a replacement of the same
    size: reads of the new bytes were served under the old index (mixed versions, no error). Reads
    are pinned to Last-Modified too: If-Unmodified-Since where the server enforces it, the reply's
    Last-Modified where it does not."""
    rng = random.Random(5)
    v1 = {f"m{i:03d}.bin": rng.randbytes(64 << 10) for i in range(100)}
    _stored_zip_on(moto_s3, "cons", "meta.zip", tmp_path, v1)
    proxy = proxy_to(moto_s3)
    proxy.quirks.add("metadata_etag")
    if not enforced:
        proxy.quirks.add("ignore_if_unmodified_since")
    with caplog.at_level("WARNING", logger="cdmlfs"):
        remote = Archive("s3://cons/meta.zip", endpoint_url=proxy.url, retry=FAST_RETRY)
    with remote:
        assert remote.source.etag == 'W/"metadata"'
        assert "weak ETag" in caplog.text and "Last-Modified" in caplog.text
        # A dataset reopens an archive whose HEAD shows the same bytes: the identities must agree.
        assert remote.source.probe_identity().same_bytes(remote.source.identity)
        assert remote.read("m000.bin") == v1["m000.bin"]
        assert (proxy.if_unmodified_since > 0) == enforced
        time.sleep(1.1)  # Last-Modified counts whole seconds
        _stored_zip_on(moto_s3, "cons", "meta.zip", tmp_path, {k: bytes(len(v)) for k, v in v1.items()})
        with pytest.raises(SourceChangedError, match="changed after it was opened"):
            remote.read("m050.bin")


def test_weak_etag_replies_without_last_modified_are_read_on_the_etag_alone(
    moto_s3, proxy_to, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server leaving Last-Modified off ranged replies (it sent one with the first) worked on
    the ETag alone before reads were pinned to it: it still does, with a warning."""
    rng = random.Random(6)
    v1 = {f"m{i:03d}.bin": rng.randbytes(64 << 10) for i in range(20)}
    _stored_zip_on(moto_s3, "cons", "nolm.zip", tmp_path, v1)
    proxy = proxy_to(moto_s3)
    proxy.quirks |= {"weak_etag", "no_last_modified", "ignore_if_unmodified_since"}
    with (
        caplog.at_level("WARNING", logger="cdmlfs"),
        Archive("s3://cons/nolm.zip", endpoint_url=proxy.url, retry=FAST_RETRY) as remote,
    ):
        assert all(remote.read(name) == data for name, data in v1.items())
    assert caplog.text.count("no Last-Modified on ranged replies") == 1


@pytest.mark.parametrize(
    "text",
    ["Mon, 01 Jan 2024 00:00:00 GMT", "Mon, 01 Jan 2024 00:00:00 -0000", "Mon Jan  1 00:00:00 2024",
     "2024-01-01T00:00:00.250Z"],
)  # fmt: skip
def test_last_modified_in_any_date_form_the_sdk_reads_is_an_aware_time(text: str) -> None:
    """Naive times (asctime, -0000) compared unequal with the SDK's aware one: every read EIO."""
    import datetime

    from cdmlfs.sources.s3_presigned import _http_date

    when = _http_date(text)
    assert when is not None and when.tzinfo is not None
    new_year = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
    assert int(when.timestamp()) == int(new_year.timestamp())


def test_a_pickled_archive_refuses_another_version(moto_s3, tmp_path: Path) -> None:
    """A spawned DataLoader worker reopens the location: it must not read a replaced object under
    the samples its parent listed (it silently read the new version)."""
    moto_s3.put("api", "versioned.zip", _small_zip(tmp_path, "v1.zip", seed=1))
    with Archive("s3://api/versioned.zip", endpoint_url=moto_s3.url) as remote:
        blob = pickle.dumps(remote)
        pickle.loads(blob).close()  # same version: fine
        moto_s3.put("api", "versioned.zip", _small_zip(tmp_path, "v2.zip", seed=2))
        with pytest.raises(SourceChangedError, match="changed since it was opened"):
            pickle.loads(blob)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://127.0.0.1:9", "scheme must be http or https"),  # "was not a valid URI", exit 1
        ("http://127.0.0.1:99999", "Port out of range"),
        ("http://[::1", "Invalid IPv6 URL"),  # botocore's words alone, naming no URL
        ("http://:9", "no host"),
        ("127.0.0.1:9", "no scheme"),
        (5, "must be a string"),  # a bare TypeError
    ],
)
def test_a_bad_endpoint_url_is_a_usage_error_naming_it(url, says: str, s3_credentials) -> None:
    with pytest.raises(UsageError, match=says) as exc:
        Archive("s3://bucket/key.zip", endpoint_url=url)
    assert isinstance(url, int) or f"'{url}'" in str(exc.value)
    if isinstance(url, str):
        res = run_cli("ls", "--endpoint-url", url, "s3://bucket/key.zip", timeout=60)
        err = res.stderr.decode().strip()
        assert res.returncode == 2 and says in err and len(err.splitlines()) == 1, err


def test_an_endpoint_from_the_environment_keys_the_saved_index_as_a_given_one(
    moto_s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWS_ENDPOINT_URL (or a profile's endpoint_url), as MinIO users set it, was left out of the
    saved index's key: another server's object under the same bucket, key, size and a constant
    weak ETag was listed and read through the first one's index (wrong bytes). AWS's own endpoint
    stays out of the key (AWS objects keep the keys they had)."""
    moto_s3.put("api", "env.zip", _small_zip(tmp_path, "env.zip", seed=3))
    with Archive("s3://api/env.zip", endpoint_url=moto_s3.url) as given:
        expected = given.source.identity
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.url)
    with Archive("s3://api/env.zip") as from_env:
        assert from_env.source.identity == expected
        assert from_env.source.identity.key().endswith(f"endpoint={moto_s3.url}")
    from cdmlfs.sources.s3 import _custom_endpoint

    assert _custom_endpoint("https://s3.eu-west-1.amazonaws.com") == ""
    assert _custom_endpoint("https://s3.cn-north-1.amazonaws.com.cn") == ""


def test_endpoint_credentials_and_tls_mismatch_give_a_fast_clean_error(proxy_to, moto_s3) -> None:
    """user:password in an endpoint URL never reaches a message; https to a plain-http port is not
    retried (it fails the same way every time)."""
    with pytest.raises(SourceError) as exc:
        Archive("s3://bkt/a.zip", endpoint_url="http://minio:SuperSecretPw@127.0.0.1:1", retry=FAST_RETRY)
    assert "SuperSecretPw" not in str(exc.value)
    proxy = proxy_to(moto_s3)
    started = time.monotonic()
    with pytest.raises(SourceError, match="TLS"):
        Archive("s3://bkt/a.zip", endpoint_url=proxy.url.replace("http://", "https://"))
    assert time.monotonic() - started < 3.0
    assert proxy.stats.requests == 0
    # A handshake the server drops (an overloaded load balancer) is retried like a reset.
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)

    def hang_up() -> None:
        with contextlib.suppress(OSError):
            while True:
                server.accept()[0].close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        with pytest.raises(SourceError, match=r"failed after [2-9] attempts"):
            Archive(
                "s3://bkt/a.zip",
                endpoint_url=f"https://127.0.0.1:{server.getsockname()[1]}",
                retry=FAST_RETRY,
            )
    finally:
        server.close()


# -- faults ---------------------------------------------------------------------------------------
def test_injected_faults_are_retried_with_zero_wrong_bytes(localbucket_s3, proxy_to, tmp_path: Path) -> None:
    path = _many_small_zip(tmp_path / "faulty.zip", 3000, size=5000, seed=4)
    localbucket_s3.put("faults", "faulty.zip", path)
    proxy = proxy_to(localbucket_s3, stall_seconds=1.5)
    remote = Archive(
        "s3://faults/faulty.zip",
        endpoint_url=proxy.url,
        retry=FAST_RETRY,
        read_timeout=0.5,
        open_suffix=64 * 1024,
        cache_size=16 * MiB,
    )
    local = Archive(str(path))
    try:
        proxy.inject("503", 2)
        proxy.inject("stall")
        proxy.inject("stall_body")
        proxy.chaos(0.3, ("503", "500", "reset", "truncate"))
        names = local.files()
        rng = random.Random(5)
        for name in rng.sample(names, 150) + names[:400]:
            assert remote.read(name) == local.read(name), name
        stats = remote.source.stats()
        assert proxy.stats.faults >= 20
        assert stats["retries"] >= 20
    finally:
        remote.close()
        local.close()


def test_persistent_failure_gives_source_error_in_bounded_time_then_recovers(
    localbucket_s3, proxy_to, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3mod, "FAILED_RANGE_MEMORY", 0.0)  # each fault kind makes its own attempts
    path = _small_zip(tmp_path, "persist.zip")
    localbucket_s3.put("faults", "persist.zip", path)
    proxy = proxy_to(localbucket_s3, stall_seconds=2.0)
    policy = RetryPolicy(max_attempts=50, base_delay=0.05, max_delay=0.2, deadline=1.5)
    with (
        Archive("s3://faults/persist.zip", endpoint_url=proxy.url, retry=policy, read_timeout=0.4) as remote,
        Archive(str(path)) as local,
    ):
        # drip: every socket read gets bytes within the read timeout, so only a deadline on the
        # whole body ends the read (without one it took as long as the server liked: forever).
        for kind in ("503", "stall", "drip"):
            proxy.inject(kind, 1000)
            started = time.monotonic()
            with pytest.raises(SourceError, match="failed after"):
                remote.read("big/stored.bin", 0, 100)
            elapsed = time.monotonic() - started
            # The deadline, plus at most one attempt already under way (its read timeout), plus slack
            # for a loaded machine; unbounded retrying would take 50 attempts (> 20 s).
            assert elapsed < policy.deadline + 0.4 + 2.0, (kind, elapsed)
            proxy.clear()
        # Not sticky: the object did not change, the network came back.
        assert remote.read("big/stored.bin") == local.read("big/stored.bin")


def _put_blob(endpoint, bucket: str, tmp_path: Path, data: bytes) -> Path:
    """``data`` as the object ``s3://BUCKET/blob.bin`` (and the local file behind it)."""
    blob = tmp_path / "blob.bin"
    blob.write_bytes(data)
    endpoint.put(bucket, "blob.bin", blob)
    return blob


def test_reads_queued_behind_stalled_requests_still_end_by_the_deadline(
    localbucket_s3, proxy_to, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More reads than connections, every request stalled: a read queued for a free connection
    spends its deadline there too. Each queued request used to get a whole deadline once it
    started, so reads ended in waves, the last after four deadlines here."""
    import threading

    monkeypatch.setattr(s3mod, "FAILED_RANGE_MEMORY", 0.0)  # the range read at the end failed before
    blob = _put_blob(localbucket_s3, "stall", tmp_path, random.Random(3).randbytes(40 * MiB))
    proxy = proxy_to(localbucket_s3, stall_seconds=30.0)
    policy = RetryPolicy(max_attempts=50, base_delay=0.05, max_delay=0.2, deadline=2.0)
    src = s3mod.S3Object("s3://stall/blob.bin", endpoint_url=proxy.url, retry=policy, read_timeout=1.0)
    took: list[tuple[float, str]] = []
    lock = threading.Lock()

    def read(i: int) -> None:
        started = time.monotonic()
        try:
            src.read_at(i * MiB, 64 * 1024)
            outcome = "read"
        except SourceError as exc:
            outcome = str(exc)
        with lock:
            took.append((time.monotonic() - started, outcome))

    try:
        proxy.reset_stats()
        proxy.inject("stall", 10_000)
        readers = [threading.Thread(target=read, args=(i,)) for i in range(32)]  # 8 foreground workers
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
        assert len(took) == 32
        slowest = max(t for t, _ in took)
        # The deadline, one attempt under way at it (its read timeout), and slack for a busy machine.
        assert slowest < policy.deadline + 1.0 + 1.5, sorted(took)
        assert all(why != "read" for _, why in took)
        # The first 8 reads make two 1 s attempts each; a queued read starts with its budget (about)
        # spent: no request ("waiting for a free connection") or one with what is left. Given a whole
        # deadline of its own, each made two more (64 in all). (Which of the two a queued read gets
        # is a race between the reader threads' start and a worker's hand-off: not asserted.)
        assert proxy.stats.requests <= 8 * 2 + 24 + 4, (proxy.stats.requests, took)
        proxy.clear()
        assert src.read_at(5 * MiB, 100) == blob.read_bytes()[5 * MiB : 5 * MiB + 100]
    finally:
        src.close()


def test_a_close_between_a_replys_headers_and_its_body_ends_the_read(
    localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    """close() cuts the bodies being read; a reply whose headers came in just before close() had its
    body registered with the watchdog just after, missed the cut, and was read (a few bytes at a
    time here) until the read deadline."""
    _put_blob(localbucket_s3, "closing", tmp_path, random.Random(5).randbytes(2 * MiB))
    proxy = proxy_to(localbucket_s3)
    policy = RetryPolicy(max_attempts=3, deadline=30.0)
    src = s3mod.S3Object("s3://closing/blob.bin", endpoint_url=proxy.url, retry=policy, read_timeout=20.0)
    reply_by = src._reply_by

    def closed_after_headers(*args, **kwargs):
        resp = reply_by(*args, **kwargs)
        # What close() does first lands between the headers and the body (the rest of close()
        # also closes the client's pool, which here ends the read anyway).
        src._closed = True
        src._watchdog.cut(src)
        return resp

    src._reply_by = closed_after_headers  # type: ignore[method-assign]
    proxy.inject("drip", 1000)
    started = time.monotonic()
    try:
        with pytest.raises(SourceError, match="closed"):
            src.read_at(1 * MiB, 256 * 1024)
        assert time.monotonic() - started < 5.0
    finally:
        proxy.clear()
        src.close()


def test_a_read_larger_than_one_batch_of_requests_gets_a_deadline_per_batch(
    localbucket_s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parts of one large read queued behind its own first parts counted their wait too: the
    whole read had to fit in one request's deadline (a 2 GiB member at 35 MB/s, at 60 s)."""
    data = random.Random(6).randbytes(32 * MiB)
    _put_blob(localbucket_s3, "big", tmp_path, data)
    real = s3mod.S3Object._read_body

    def slow_link(self, body, n):  # each 8 MiB part takes 1.5 s to arrive
        time.sleep(1.5)
        return real(self, body, n)

    monkeypatch.setattr(s3mod.S3Object, "_read_body", slow_link)
    policy = RetryPolicy(max_attempts=3, base_delay=0.05, max_delay=0.1, deadline=2.5)
    # 2 foreground workers, 4 parts: two batches of 1.5 s, each well within 2.5 s
    url = localbucket_s3.url
    src = s3mod.S3Object("s3://big/blob.bin", endpoint_url=url, retry=policy, max_connections=4)
    try:
        assert src.read_at(0, 32 * MiB) == data
    finally:
        src.close()


@pytest.mark.parametrize("fault", ["stall", "drip"])
def test_closing_a_source_ends_its_requests_under_way(
    localbucket_s3, proxy_to, tmp_path: Path, fault: str
) -> None:
    """A request waiting for reply headers (stall) or receiving a body a few bytes at a time (drip)
    ends when its source closes: its fetch thread, which interpreter exit (an unmount) waits for,
    used to go on until the read deadline."""
    import threading

    _put_blob(localbucket_s3, "closing", tmp_path, random.Random(4).randbytes(2 * MiB))
    proxy = proxy_to(localbucket_s3, stall_seconds=60.0)
    policy = RetryPolicy(max_attempts=3, deadline=30.0)
    src = s3mod.S3Object("s3://closing/blob.bin", endpoint_url=proxy.url, retry=policy, read_timeout=20.0)
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(src.read_at(1 * MiB, 256 * 1024))
        except BaseException as exc:
            outcome.append(exc)

    proxy.inject(fault, 1000)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        deadline = time.monotonic() + 10
        while proxy.stats.faults == 0 and time.monotonic() < deadline:  # our GET reached the proxy
            time.sleep(0.02)
        time.sleep(0.5)  # well into the stall / the drip
        closed_at = time.monotonic()
        src.close()
        reader.join(10)
        assert not reader.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], SourceError), outcome
        while any(t.name.startswith("cdmlfs-fetch") for t in threading.enumerate()):
            assert time.monotonic() - closed_at < 3.0, "a fetch thread outlived close() by seconds"
            time.sleep(0.05)
    finally:
        proxy.clear()
        src.close()
        reader.join(60)


def test_a_dropped_tls_handshake_is_retried_whatever_the_url_says() -> None:
    """Permanent TLS failures (wrong protocol, a certificate that does not verify) are told by the
    TLS error, not by the URL around it: a key under "certificates/" made a dropped handshake final."""
    import ssl
    import types

    from botocore.exceptions import SSLError

    fake = types.SimpleNamespace(location="s3://b/k")
    classify = s3mod.S3Object._classify
    for url in ("https://s3.example.com/b/certificates/shard.zip", "https://hostname-logs.example.com/a.zip"):
        eof = ssl.SSLEOFError(8, "EOF occurred in violation of protocol")
        dropped = SSLError(endpoint_url=url, error=eof)
        with pytest.raises(s3mod._Transient):
            classify(fake, dropped, opening=False)
    refused = SSLError(
        endpoint_url="https://s3.example.com/b/k",
        error=ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"),
    )
    with pytest.raises(SourceError, match="TLS failed"):
        classify(fake, refused, opening=False)


def test_a_server_that_never_answers_fails_within_the_deadline() -> None:
    """Waiting for a reply's headers is bounded only by the socket timeout (20 s by default): with
    a 2 s deadline, the timeouts shrink to fit it and no attempt starts that could overrun it (it
    took 20 s, then 40 s through a mount)."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        started = time.monotonic()
        with s3util.dummy_credentials(), pytest.raises(SourceError, match="failed after"):
            Archive("s3://silent/a.zip", endpoint_url=url, retry=RetryPolicy(deadline=2.0))
        assert time.monotonic() - started < 2.0 + 1.5
    finally:
        server.close()
        for conn in held:
            conn.close()


# -- tar.zst: the persisted index is keyed by the ETag -------------------------------------------
@pytest.mark.parametrize("compressor", ["zstd", "pzstd"])
def test_tar_zst_on_s3_remount_uses_the_persisted_index(
    compressor: str, localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    """The first open scans a foreign archive, downloading it once (locating its frames and
    decoding them in one pass); a remount downloads nothing but the opening suffix."""
    if not shutil.which(compressor) or not shutil.which("tar"):
        pytest.skip(f"needs tar and {compressor}")
    src = _random_tree(tmp_path / "tree", 300, 7, (1, 40_000), seed=6)
    tzst = tmp_path / "tree.tar.zst"
    plain = tmp_path / "tree.tar"
    subprocess.run(["tar", "-cf", str(plain), "-C", str(src), "."], check=True)
    subprocess.run([compressor, "-q", "-f", "-1", "-o", str(tzst), str(plain)], check=True)
    if compressor == "pzstd":  # several frames
        assert len(walk_frames(LocalFile(str(tzst)))) > 2
    localbucket_s3.put("tars", "tree.tar.zst", tzst)
    index_dir = tmp_path / "index"
    proxy = proxy_to(localbucket_s3)
    # A cache smaller than the archive: a second pass over it would download it again.
    kw = {"endpoint_url": proxy.url, "index_dir": str(index_dir), "cache_size": 4 << 20}
    with Archive("s3://tars/tree.tar.zst", **kw) as first:
        scanned = proxy.stats.body_bytes
        names = first.files()
        assert len(names) == 300
        assert first.read(names[17]) == (src / names[17]).read_bytes()
    proxy.wait_idle()  # prefetches the closed archive left running
    proxy.reset_stats()
    with Archive("s3://tars/tree.tar.zst", **kw) as second:
        assert proxy.stats.body_bytes <= 256 * 1024  # the opening suffix and head, no scan
        size = tzst.stat().st_size
        assert size <= scanned <= size + 256 * 1024, (scanned, size)  # one download
        assert second.read(names[123]) == (src / names[123]).read_bytes()
    # A replaced object has another ETag: its old index is not used.
    localbucket_s3.put("tars", "tree.tar.zst", _small_zip(tmp_path))
    with Archive("s3://tars/tree.tar.zst", **kw) as third:
        assert third.format.name == "zip"


def test_a_password_in_the_endpoint_url_is_not_written_into_the_index(localbucket_s3, tmp_path: Path) -> None:
    """The persisted index is keyed by the endpoint too, and its key held the endpoint URL as
    given, ``user:password@`` included, in the index file (and in the failure record of an
    archive that does not open). The key now holds the URL with the password hidden."""
    import zstandard

    data = _tar_bytes_of({"a.txt": b"alpha", "b.txt": b"beta"})
    localbucket_s3.put("tars", "secret.tar.zst", zstandard.ZstdCompressor().compress(data))
    localbucket_s3.put("tars", "cut.tar.zst", zstandard.ZstdCompressor().compress(data)[:40])
    url = localbucket_s3.url.replace("http://", "http://minio:S3cretPw@")
    index_dir = tmp_path / "index"
    for attempt in ("scan", "cache"):
        with Archive("s3://tars/secret.tar.zst", endpoint_url=url, index_dir=str(index_dir)) as ar:
            assert ar.format.index_source == attempt
            assert ar.read("b.txt") == b"beta"
    with pytest.raises(ArchiveFormatError):
        Archive("s3://tars/cut.tar.zst", endpoint_url=url, index_dir=str(index_dir))
    written = [p for p in index_dir.rglob("*") if p.is_file()]
    assert written
    for path in written:
        assert b"S3cretPw" not in path.read_bytes(), path


def _tar_bytes_of(members: dict[str, bytes]) -> bytes:
    import io
    import tarfile

    with io.BytesIO() as buf:
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for name, body in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tf.addfile(info, io.BytesIO(body))
        return buf.getvalue()


def _plain_tar(path: Path, members: list[tuple[str, bytes]], mtime: int) -> Path:
    import tarfile

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), mtime
            tar.addfile(info, io.BytesIO(data))
    os.utime(path, (mtime, mtime))  # Last-Modified, for a file-backed endpoint
    return path


def test_a_persisted_index_is_not_taken_for_the_same_key_at_another_endpoint(
    localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    """Two endpoints (MinIO beside AWS, say) with the same bucket and key, same size, and a weak
    ETag that says nothing of the bytes: the second was read through the first's persisted index,
    and gave the bytes of the wrong member."""
    a = _plain_tar(tmp_path / "a.tar", [("x", b"x" * 1000), ("y", b"y" * 3000)], 1_700_000_000)
    b = _plain_tar(tmp_path / "b.tar", [("y", b"Y" * 3000), ("x", b"X" * 1000)], 1_700_000_000)
    assert a.stat().st_size == b.stat().st_size
    other = s3util.start_localbucket(tmp_path / "other-endpoint")
    try:
        localbucket_s3.put("tars", "same.tar", a)
        other.put("tars", "same.tar", b)
        proxies = [proxy_to(localbucket_s3), proxy_to(other)]
        for proxy in proxies:
            proxy.quirks.add("metadata_etag")
        kw = {"index_dir": str(tmp_path / "index"), "retry": FAST_RETRY}
        with Archive("s3://tars/same.tar", endpoint_url=proxies[0].url, **kw) as first:
            assert first.read("x") == b"x" * 1000
        with Archive("s3://tars/same.tar", endpoint_url=proxies[1].url, **kw) as second:
            assert second.source.identity.version == first.source.identity.version  # one key but the endpoint
            assert second.format.index_source == "scan"
            assert second.read("x") == b"X" * 1000 and second.read("y") == b"Y" * 3000
    finally:
        other.stop()


def _packed_tree_on_s3(localbucket_s3, tmp_path: Path) -> tuple[Path, dict]:
    """A tree of 40 members (half text, half random) packed in 1 MiB frames, on S3: (tree, options)."""
    src = tmp_path / "tree"
    rng = random.Random(8)
    for i in range(40):
        p = src / f"d{i % 3}" / f"m{i:02d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        size = rng.randrange(20_000, 150_000)
        p.write_bytes(rng.randbytes(size) if i % 2 else bytes(rng.choices(b"abcde \n", k=size)))
    packed = tmp_path / "p.tar.zst"
    res = subprocess.run(
        [sys.executable, "-m", "cdmlfs", "pack", "-q", "--frame-size", "1M", str(src), str(packed)],
        capture_output=True,
    )
    assert res.returncode == 0, res.stderr.decode()
    localbucket_s3.put("tars", "p.tar.zst", packed)
    return src, {"endpoint_url": localbucket_s3.url, "index_dir": str(tmp_path / "index")}


def test_packed_tar_zst_on_s3_serves_early_members_through_the_source(localbucket_s3, tmp_path: Path) -> None:
    """No file descriptor: the frame decoder is fed from the S3 block layer; same bytes, same early path."""
    src, kw = _packed_tree_on_s3(localbucket_s3, tmp_path)
    with Archive("s3://tars/p.tar.zst", **kw) as ar:
        worker = ar.format.stream._frames
        assert worker is not None
        names = ar.files()
        random.Random(8).shuffle(names)
        for name in names:
            assert ar.read(name) == (src / name).read_bytes()
        assert worker.early_frames >= 2


def test_a_first_read_inside_a_packed_frame_on_s3_is_one_request(
    localbucket_s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frame decoder asked the block layer for 64 KiB of compressed bytes at a time: a member
    in the middle of a frame cost several GETs (28 a read on a 240 MB archive, 4000 random reads)."""
    from cdmlfs.formats import zstdframes

    src, kw = _packed_tree_on_s3(localbucket_s3, tmp_path)
    with Archive("s3://tars/p.tar.zst", **kw) as ar:
        stream = ar.format.stream
        assert stream._frames is not None and not stream._frames.finish
        fr, ix = stream.frames, ar.index
        checked = 0
        for i in range(len(fr)):
            lo, hi = fr.dec_offset[i], fr.dec_offset[i] + fr.dec_size[i]
            inside = [n for n in ar.archive_order() if lo <= ix.offset[ix.lookup(n)] < hi]
            if len(inside) < 3 or fr.dec_size[i] < zstdframes.MIN_FRAME:
                continue
            name = inside[len(inside) // 2]
            before = ar.source.stats()["get_requests"]
            assert ar.read(name) == (src / name).read_bytes()
            assert ar.source.stats()["get_requests"] - before <= 2, name
            checked += 1
        assert checked >= 2


def test_one_deadline_thread_per_process(moto_s3, tmp_path: Path) -> None:
    """The body watchdog is shared: opening and closing archives does not leave a thread each."""
    import threading

    path = _small_zip(tmp_path, "w.zip")
    moto_s3.put("deadlines", "w.zip", path)
    for _ in range(5):
        with Archive("s3://deadlines/w.zip", endpoint_url=moto_s3.url) as remote:
            assert remote.read("big/stored.bin", 0, 10)
    assert sum(t.name == "cdmlfs-deadlines" for t in threading.enumerate()) <= 1


def test_cli_s3_options_shape_the_requests(moto_s3, proxy_to, tmp_path: Path) -> None:
    """--profile, --region, --no-sign-request and --addressing-style, seen in the requests the CLI
    sends (moto answers without checking signatures; the proxy records what arrived)."""
    moto_s3.put("opts", "d/a.zip", _small_zip(tmp_path))
    moto_s3.client().put_object_acl(Bucket="opts", Key="d/a.zip", ACL="public-read")  # for the unsigned read
    proxy = proxy_to(moto_s3)
    base = ["ls", "--endpoint-url", proxy.url, "s3://opts/d/a.zip"]

    def requests(*extra: str, env: dict | None = None) -> list[tuple]:
        proxy.reset_stats()
        res = run_cli(*base[:1], *extra, *base[1:], env={**os.environ, **(env or {})})
        assert res.returncode == 0 and b"readme.txt" in res.stdout, res.stderr.decode()
        assert proxy.stats.seen, "no request reached the endpoint"
        return list(proxy.stats.seen)

    # Default: signed with the environment's key, path style (the bucket in the path).
    for _method, path, host, auth in requests():
        assert path.startswith("/opts/") and host.startswith("127.0.0.1"), (path, host)
        assert auth and "Credential=testing/" in auth and "/us-east-1/s3/" in auth, auth
    # --region: the signature's scope names it.
    assert all("/eu-west-3/s3/" in auth for *_, auth in requests("--region", "eu-west-3"))
    # --no-sign-request: no signature at all.
    assert all(auth is None for *_, auth in requests("--no-sign-request"))
    # --profile: that profile's keys, from the shared credentials file.
    creds = tmp_path / "credentials"
    creds.write_text("[team]\naws_access_key_id = AKIDTEAM\naws_secret_access_key = secret\n")
    seen = requests("--profile", "team", env={"AWS_SHARED_CREDENTIALS_FILE": str(creds)})
    assert all(auth and "Credential=AKIDTEAM/" in auth for *_, auth in seen)
    # --addressing-style path, asked for: the same as the default with an endpoint.
    assert all(path.startswith("/opts/") for _, path, *_ in requests("--addressing-style", "path"))


def test_archives_of_one_process_share_an_sdk_session(localbucket_s3, tmp_path: Path, monkeypatch) -> None:
    """A boto3 Session costs ~12 MiB (service models, credential chain): one per archive made a
    40-shard dataset hold 517 MiB per DataLoader worker. One per profile, region and credentials."""
    path = _small_zip(tmp_path, "shared.zip")
    for key in ("one.zip", "two.zip"):
        localbucket_s3.put("shared", key, path)
    url = localbucket_s3.url
    with (
        Archive("s3://shared/one.zip", endpoint_url=url) as a,
        Archive("s3://shared/two.zip", endpoint_url=url) as b,
    ):
        assert a.source._session is b.source._session
        assert a.read("readme.txt") == b.read("readme.txt")
        with Archive("s3://shared/two.zip", endpoint_url=url, region="eu-west-3") as other_region:
            assert other_region.source._session is not a.source._session
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "rotated")  # other credentials: never the old session's
        with Archive("s3://shared/two.zip", endpoint_url=url) as rotated:
            assert rotated.source._session is not a.source._session


def test_a_shared_session_follows_a_rewritten_credentials_file(
    moto_s3, proxy_to, tmp_path: Path, monkeypatch
) -> None:
    """Tools such as saml2aws rewrite ~/.aws/credentials with fresh keys: a session shared across
    archives kept the first keys it read (expired ones, later). A file written since: a new one."""
    path = _small_zip(tmp_path, "creds.zip")
    moto_s3.put("creds", "c.zip", path)
    proxy = proxy_to(moto_s3)
    creds = tmp_path / "credentials"
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    for key in ("AKIDFIRST", "AKIDSECONDKEY"):
        creds.write_text(f"[default]\naws_access_key_id = {key}\naws_secret_access_key = s\n")
        proxy.reset_stats()
        with Archive("s3://creds/c.zip", endpoint_url=proxy.url) as remote:
            assert remote.read("readme.txt")
        auths = [auth for *_, auth in proxy.stats.seen if auth]
        assert auths and all(f"Credential={key}/" in auth for auth in auths), auths


# -- ranged GETs by presigned URL ----------------------------------------------------------------
def _presign_zip(endpoint, tmp_path: Path, key: str) -> Path:
    path = _small_zip(tmp_path, key, method=zipfile.ZIP_STORED)
    endpoint.put("presign", key, path)
    return path


def _read_all_equal(remote: Archive, local: Archive) -> None:
    for name in local.files():
        assert remote.read(name) == local.read(name), name


def test_ranged_reads_go_by_a_sigv4_presigned_url(localbucket_s3, proxy_to, tmp_path: Path) -> None:
    """The SDK's get_object cost ~2.4 ms of CPU per GET: reads send a URL the SDK presigned (with
    SigV4, where botocore's default for us-east-1 is SigV2), the open still goes through the SDK."""
    path = _presign_zip(localbucket_s3, tmp_path, "ps.zip")
    proxy = proxy_to(localbucket_s3)
    # A small opening suffix: the central directory is read by ranged GETs too.
    with Archive("s3://presign/ps.zip", endpoint_url=proxy.url, open_suffix=4096) as remote:
        with Archive(str(path)) as local:
            _read_all_equal(remote, local)
        gets = remote.source._presigned
        assert gets.refused is None
    seen = list(proxy.stats.seen)
    by_url = [p for _, p, _, _ in seen if "?" in p]
    assert len(by_url) == gets.sent >= 2
    for _method, target, _host, auth in seen:
        if "?" in target:
            assert auth is None and target.startswith("/presign/ps.zip?"), (target, auth)
            assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in target and "X-Amz-Credential=testing%2F" in target
        else:  # the open (the suffix, the first bytes): signed headers, through the SDK
            assert auth and "Credential=testing/" in auth, auth


def test_a_store_refusing_presigned_urls_is_read_through_the_sdk(
    localbucket_s3, proxy_to, tmp_path: Path, caplog
) -> None:
    """A store without query-string authentication answers 403: signed again, refused again, the
    SDK's request succeeds, and the SDK serves every GET of the object from then on."""
    path = _presign_zip(localbucket_s3, tmp_path, "refuse.zip")
    proxy = proxy_to(localbucket_s3)
    proxy.quirks.add("refuse_query_auth")
    with (
        caplog.at_level("INFO", logger="cdmlfs"),
        Archive("s3://presign/refuse.zip", endpoint_url=proxy.url, open_suffix=4096) as remote,
        Archive(str(path)) as local,
    ):
        _read_all_equal(remote, local)
        assert remote.source._presigned.refused
    assert sum("?" in p for _, p, _, _ in proxy.stats.seen) == 2  # the URL, then a fresh one: no more
    assert sum("refuses presigned GETs" in r.getMessage() for r in caplog.records) == 1


def test_a_refused_url_is_signed_again_and_presigned_reads_go_on(
    localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    """An expired URL (credentials that rotated): one refusal, a fresh URL, and no fallback for good."""
    path = _presign_zip(localbucket_s3, tmp_path, "once.zip")
    proxy = proxy_to(localbucket_s3)
    proxy.quirks.add("refuse_query_auth_once")
    with Archive("s3://presign/once.zip", endpoint_url=proxy.url, open_suffix=4096) as remote:
        with Archive(str(path)) as local:
            _read_all_equal(remote, local)
        gets = remote.source._presigned
        assert gets.refused is None and gets.sent >= 3 and gets.signed == 2  # again after the refusal
    assert all(auth is None for _, p, _, auth in proxy.stats.seen if "?" in p)


def test_errors_of_presigned_gets_keep_their_meaning(moto_s3, proxy_to, tmp_path: Path) -> None:
    """Statuses of a presigned GET mean what the SDK's would: 503 retried, 403 an access error
    (after the SDK's own try), and a replaced object (412 to If-Match) a change."""
    path = _presign_zip(moto_s3, tmp_path, "errs.zip")
    proxy = proxy_to(moto_s3)
    policy = RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.02, deadline=10.0)
    with Archive(str(path)) as local:
        expected = local.read("big/stored.bin", 0, 1000)
    url = "s3://presign/errs.zip"
    with Archive(url, endpoint_url=proxy.url, retry=policy) as remote:  # a fresh cache each time
        proxy.inject("503", 2)
        assert remote.read("big/stored.bin", 0, 1000) == expected
    with Archive(url, endpoint_url=proxy.url, retry=policy) as remote:
        proxy.inject("403", 3)  # the URL, a fresh one, then the SDK: all refused
        with pytest.raises(SourceError, match="access denied"):
            remote.read("big/stored.bin", 0, 1000)
        assert remote.source._presigned.refused is None  # the SDK was refused too: nothing learnt
    with Archive(url, endpoint_url=proxy.url, retry=policy) as remote:
        moto_s3.put("presign", "errs.zip", _small_zip(tmp_path, "other.zip", seed=9))
        with pytest.raises(SourceChangedError, match="changed after it was opened"):
            remote.read("big/stored.bin", 0, 1000)


def test_presigned_urls_never_reach_messages_or_logs(
    localbucket_s3, proxy_to, tmp_path: Path, caplog
) -> None:
    """botocore quotes the request's URL in connection errors, and a presigned URL holds the key id,
    the signature (and a session token): retry lines and errors show the path without its query."""
    _presign_zip(localbucket_s3, tmp_path, "quiet.zip")
    proxy = proxy_to(localbucket_s3)
    policy = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.02, deadline=10.0)
    with (
        caplog.at_level("DEBUG"),
        Archive("s3://presign/quiet.zip", endpoint_url=proxy.url, retry=policy) as remote,
    ):
        proxy.inject("reset", 5)  # a retry (its log line quotes the error), then the read gives up
        with pytest.raises(SourceError) as info:
            remote.read("big/stored.bin", 2 * MiB, 100)
    text = str(info.value) + "\n".join(r.getMessage() for r in caplog.records)
    assert "ConnectionClosedError" in text or "Connection" in text, text
    for secret in ("X-Amz-Signature", "X-Amz-Credential", "Signature=", "AWSAccessKeyId"):
        assert secret not in text, text
    assert hide_signature("GET http://h/b/k?X-Amz-Algorithm=A&X-Amz-Signature=f00 done") == (
        "GET http://h/b/k?<signed query hidden> done"
    )
    # urllib3's "Failed to parse headers (url=...): [Defect]" lost its "):" with the query.
    assert hide_signature("(url=http://h/b/k?X-Amz-Credential=a%2Fb&X-Amz-Signature=f0): [D]") == (
        "(url=http://h/b/k?<signed query hidden>): [D]"
    )


def test_sdk_log_lines_never_show_a_presigned_query(localbucket_s3, proxy_to, tmp_path: Path, caplog) -> None:
    """urllib3 logs a reply whose headers do not parse with the request target (a WARNING, above the
    SDK loggers' INFO floor), and logs every request target at DEBUG, a level a program may set
    after opening: neither shows the signed query, and the warning is one line."""
    import logging

    path = _presign_zip(localbucket_s3, tmp_path, "logs.zip")
    proxy = proxy_to(localbucket_s3)
    with (
        caplog.at_level("DEBUG"),
        Archive("s3://presign/logs.zip", endpoint_url=proxy.url, open_suffix=4096) as remote,
        Archive(str(path)) as local,
    ):
        for name in ("urllib3", "urllib3.connection", "urllib3.connectionpool", "botocore", "botocore.auth"):
            logging.getLogger(name).setLevel(logging.DEBUG)  # what a program may do after the open
        proxy.chaos(1.0, ("bad_header",))
        _read_all_equal(remote, local)
        assert remote.source._presigned.sent > 0
    text = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert "Failed to parse headers" in text, text  # the warning is there, without the query
    for secret in ("X-Amz-Signature", "X-Amz-Credential", "Signature=", "AWSAccessKeyId"):
        assert secret not in text
    # In one line each, the exception's last: a whole traceback each made 28 lines of one `cdmlfs cat`.
    assert "Traceback" not in text and "HeaderParsingError" in text, text


def test_statuses_that_refuse_a_url_rather_than_answer() -> None:
    """A store without query authentication may say so with any 4xx or 501; 404, 412, 416 and 429
    keep their meaning (deleted, replaced, shorter, slow down), and 5xx are retried."""
    for status in (301, 307, 400, 401, 403, 405, 501):
        assert refused(status), status
    for status in (200, 206, 404, 408, 412, 416, 429, 500, 503):
        assert not refused(status), status


def _spread_members(endpoint, tmp_path: Path, key: str) -> tuple[Path, list[str]]:
    """1,500 members of 2 KiB, and three of them far apart: each read of those is a GET of its own."""
    path = _many_small_zip(tmp_path / key, 1500)
    endpoint.put("presign", key, path)
    return path, ["d000/m000200.bin", "d000/m000700.bin", "d001/m001200.bin"]


def test_a_slow_signing_holds_no_read_back(localbucket_s3, proxy_to, tmp_path: Path, monkeypatch) -> None:
    """Signing may refresh credentials (an STS call taking seconds): while one thread signs the
    URL due for its refresh, the others go on with the current one, valid for minutes more."""
    import threading

    from cdmlfs.sources import s3_presigned

    path, (first, second, third) = _spread_members(localbucket_s3, tmp_path, "slow.zip")
    proxy = proxy_to(localbucket_s3)
    with (
        Archive("s3://presign/slow.zip", endpoint_url=proxy.url, part_size=64 << 10) as remote,
        Archive(str(path)) as local,
    ):
        assert remote.read(first) == local.read(first)
        client = remote.source._s3()
        sign = client.generate_presigned_url
        signing = threading.Event()

        def slow_sign(*args, **kwargs):
            signing.set()
            time.sleep(3.0)
            return sign(*args, **kwargs)

        monkeypatch.setattr(client, "generate_presigned_url", slow_sign)
        monkeypatch.setattr(s3_presigned, "REFRESH", 0.0)  # the current URL is due for its refresh
        signer = threading.Thread(target=remote.read, args=(second,))
        signer.start()
        assert signing.wait(5)
        started = time.monotonic()
        assert remote.read(third) == local.read(third)
        assert time.monotonic() - started < 1.5  # not behind the 3 s signing
        signer.join()
        assert remote.source._presigned.signed == 2


def test_presigned_urls_are_tried_again_after_a_while(
    localbucket_s3, proxy_to, tmp_path: Path, monkeypatch
) -> None:
    """A refusal may be passing (a proxy, a bucket whose DNS was settling): the SDK serves the
    object for RETRY_AFTER seconds, then presigned URLs are tried again."""
    from cdmlfs.sources import s3_presigned

    # Long enough that a stalled test machine cannot end the window early; ended by hand below.
    monkeypatch.setattr(s3_presigned, "RETRY_AFTER", 60.0)
    path, (first, second, third) = _spread_members(localbucket_s3, tmp_path, "again.zip")
    proxy = proxy_to(localbucket_s3)
    proxy.quirks.add("refuse_query_auth")
    with (
        Archive("s3://presign/again.zip", endpoint_url=proxy.url, part_size=64 << 10) as remote,
        Archive(str(path)) as local,
    ):
        gets = remote.source._presigned
        assert remote.read(first) == local.read(first)
        assert gets.refused and gets.sent == 2
        proxy.quirks.discard("refuse_query_auth")
        assert remote.read(second) == local.read(second)
        assert gets.sent == 2  # within RETRY_AFTER: the SDK
        assert gets._sdk_until > time.monotonic() + 30
        gets._sdk_until = time.monotonic() - 0.001  # RETRY_AFTER has passed
        assert remote.read(third) == local.read(third)
        assert gets.refused is None and gets.sent == 3


def test_pack_converts_a_tar_gz_on_s3_as_one_stream(localbucket_s3, proxy_to, tmp_path: Path) -> None:
    """`cdmlfs pack s3://b/k.tar.gz OUT` reads the object once, front to back, through the block
    layer (no local copy of it), and writes the same tree a local pack of the file writes."""
    import tarfile

    src = _random_tree(tmp_path / "tree", 30, 3, (1000, 90_000), seed=3)
    local = tmp_path / "t.tar.gz"
    with tarfile.open(local, "w:gz") as tf:
        tf.add(src, arcname=".")
    localbucket_s3.put("tars", "t.tar.gz", local)
    out = tmp_path / "from-s3.tar.zst"
    proxy = proxy_to(localbucket_s3)
    res = run_cli("pack", "-q", "--endpoint-url", proxy.url, "s3://tars/t.tar.gz", str(out))
    assert res.returncode == 0, res.stderr.decode()
    size = local.stat().st_size
    assert size <= proxy.stats.body_bytes <= size + (1 << 20)  # the object once (and the sniffed head)
    with Archive(str(out), index_dir=str(tmp_path / "idx")) as ar:
        names = ar.files()
        assert len(names) == 30
        for name in names:
            assert ar.read(name) == (src / name).read_bytes(), name


# -- bounds found by a review of the S3 layer -------------------------------------------------------
def test_reply_headers_sent_a_byte_at_a_time_are_cut_off_at_the_deadline(
    localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    """The socket timeout bounds each receive, not the headers: a server sending them a byte every
    0.2 s held an open (and any read) for ever. They are now awaited for a read timeout (retried
    like one), never past the deadline."""
    path = _small_zip(tmp_path, "drip.zip")
    localbucket_s3.put("faults", "drip.zip", path)
    proxy = proxy_to(localbucket_s3, stall_seconds=30.0)
    policy = RetryPolicy(max_attempts=3, base_delay=0.05, max_delay=0.1, deadline=2.0)
    proxy.inject("drip_headers", 10)
    started = time.monotonic()
    with pytest.raises(SourceError, match="no reply headers"):
        Archive("s3://faults/drip.zip", endpoint_url=proxy.url, retry=policy, read_timeout=1.0)
    assert time.monotonic() - started < 2.0 + 1.5
    proxy.clear()
    with Archive("s3://faults/drip.zip", endpoint_url=proxy.url, retry=policy) as remote:
        proxy.inject("drip_headers", 1)  # one slow reply, then the retry within the deadline
        assert len(remote.read("big/stored.bin", 0, 100)) == 100


def test_one_stalled_request_is_retried_within_a_short_deadline(
    localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    """With --read-deadline 10 the read timeout is 5 s: after one stall no retry "could be over by the
    deadline", so a single black-holed request was an EIO ("failed after 1 attempts")."""
    path = _small_zip(tmp_path, "stall1.zip")
    localbucket_s3.put("faults", "stall1.zip", path)
    proxy = proxy_to(localbucket_s3, stall_seconds=5.0)
    policy = RetryPolicy(deadline=3.0)  # read timeout capped to 1.5 s: a stall uses half the budget
    with (
        Archive("s3://faults/stall1.zip", endpoint_url=proxy.url, retry=policy) as remote,
        Archive(str(path)) as local,
    ):
        proxy.inject("stall", 1)
        started = time.monotonic()
        assert remote.read("big/stored.bin", 1000, 5000) == local.read("big/stored.bin", 1000, 5000)
        assert 1.4 < time.monotonic() - started < 3.0


def test_a_range_that_gave_up_fails_at_once_for_a_moment(
    localbucket_s3, proxy_to, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel asks again at once for the pages of a read that failed, and each ask had a whole
    retry budget: a mount read took twice --read-deadline. For a second the same range fails at once
    (same reason); then it is asked again, and works once the server does."""
    # The moment lasts long enough here that a stalled test machine cannot end it early.
    monkeypatch.setattr(s3mod, "FAILED_RANGE_MEMORY", 30.0)
    path = _small_zip(tmp_path, "again.zip")
    localbucket_s3.put("faults", "again.zip", path)
    proxy = proxy_to(localbucket_s3)
    policy = RetryPolicy(max_attempts=4, base_delay=0.05, max_delay=0.1, deadline=5.0)
    with (
        Archive("s3://faults/again.zip", endpoint_url=proxy.url, retry=policy) as remote,
        Archive(str(path)) as local,
    ):
        proxy.inject("503", 1000)
        with pytest.raises(SourceError, match="failed after 4 attempts"):
            remote.read("big/stored.bin", 0, 100)
        asked = proxy.stats.requests
        started = time.monotonic()
        with pytest.raises(SourceError, match="not asked again yet"):
            remote.read("big/stored.bin", 50, 100)
        assert time.monotonic() - started < 2.0 and proxy.stats.requests == asked
        proxy.clear()
        monkeypatch.setattr(s3mod, "FAILED_RANGE_MEMORY", 0.01)  # the moment is over
        time.sleep(0.05)
        assert remote.read("big/stored.bin", 0, 100) == local.read("big/stored.bin", 0, 100)


def test_a_stalled_prefetch_of_the_first_bytes_does_not_hold_the_open(
    localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    """The open also asks for the object's first 4 KiB (format sniffing reads them), unpinned and
    optional, and waited for it without limit: 20 s for one stalled request."""
    path = _small_zip(tmp_path, "head.zip")
    localbucket_s3.put("faults", "head.zip", path)
    proxy = proxy_to(localbucket_s3, stall_seconds=10.0)
    proxy.quirks.add("stall_head_prefetch")
    started = time.monotonic()
    with Archive("s3://faults/head.zip", endpoint_url=proxy.url) as remote:
        assert time.monotonic() - started < s3mod.HEAD_WAIT + 2.0
        assert "big/stored.bin" in remote.files()


def test_close_during_a_large_read_stops_fetching(localbucket_s3, proxy_to, tmp_path: Path) -> None:
    """Closing an archive while a 24 MiB read was under way kept downloading the rest, made a new
    client after close, and left the fetched bytes in the closed archive's cache."""
    import threading

    big = tmp_path / "close.zip"
    with zipfile.ZipFile(big, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("big.bin", random.Random(3).randbytes(24 * MiB))
    localbucket_s3.put("faults", "close.zip", big)
    proxy = proxy_to(localbucket_s3, latency=0.3)
    remote = Archive("s3://faults/close.zip", endpoint_url=proxy.url, max_connections=2, part_size=MiB)
    failed: list[BaseException] = []

    def read() -> None:
        try:
            remote.read("big.bin")
        except BaseException as exc:
            failed.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.5)
    remote.close()
    reader.join(30)
    assert failed and "closed" in str(failed[0])
    proxy.wait_idle(quiet=0.5)
    asked = proxy.stats.requests
    time.sleep(1.0)
    assert proxy.stats.requests == asked
    assert asked < 12  # 24 parts of 1 MiB would have been fetched; at most those under way were
    assert remote.cache.held == 0


def test_an_archived_object_says_so(moto_s3, tmp_path: Path) -> None:
    """A Glacier object answers 403 InvalidObjectState: it was reported as bad credentials."""
    path = _small_zip(tmp_path, "cold.zip")
    client = moto_s3.client()
    client.create_bucket(Bucket="cold")
    client.put_object(Bucket="cold", Key="cold.zip", Body=path.read_bytes(), StorageClass="GLACIER")
    res = subprocess.run(
        [sys.executable, "-m", "cdmlfs", "ls", "s3://cold/cold.zip", "--endpoint-url", moto_s3.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    err = res.stderr.strip()
    assert res.returncode != 0 and "archived" in err and "restore" in err and len(err.splitlines()) == 1, err


def test_a_clock_too_far_off_says_so(localbucket_s3, proxy_to, tmp_path: Path) -> None:
    """S3 refuses a request signed with a clock far off (403 RequestTimeTooSkewed): it was reported
    as bad credentials."""
    path = _small_zip(tmp_path, "skew.zip")
    localbucket_s3.put("faults", "skew.zip", path)
    proxy = proxy_to(localbucket_s3)
    proxy.inject("skew", 2)  # the open's two first requests
    res = run_cli("ls", "s3://faults/skew.zip", "--endpoint-url", proxy.url, timeout=60)
    err = res.stderr.decode().strip()
    assert res.returncode != 0 and "clock" in err and "credentials" not in err, err


def test_commands_exit_at_their_deadline_while_a_request_is_still_stuck(
    localbucket_s3, proxy_to, tmp_path: Path
) -> None:
    """A request left waiting on a server that drips its headers ran on an executor thread, which
    the interpreter joins at exit: 'cdmlfs ls' said it gave up after 3 s and exited after 17. So
    did an open whose optional first-bytes request stalled. Such requests run on daemon threads."""
    path = _small_zip(tmp_path, "stuck.zip")
    localbucket_s3.put("faults", "stuck.zip", path)
    proxy = proxy_to(localbucket_s3, stall_seconds=30.0)
    # What a command costs here without a stall (interpreter, imports, client: seconds on a busy
    # machine), so that the bounds below measure the wait alone; the bug added 14 s and more.
    started = time.monotonic()
    run_cli("ls", "s3://faults/stuck.zip", "--endpoint-url", proxy.url, check=True, timeout=60)
    baseline = time.monotonic() - started
    proxy.inject("drip_headers", 100)
    started = time.monotonic()
    res = run_cli(
        "ls", "s3://faults/stuck.zip", "--endpoint-url", proxy.url, "--read-deadline", "3", timeout=60
    )
    assert res.returncode != 0 and b"failed after" in res.stderr, res.stderr
    assert time.monotonic() - started < 3 + baseline + 4
    proxy.clear()
    proxy.quirks.add("stall_head_prefetch")
    started = time.monotonic()
    res = run_cli("ls", "s3://faults/stuck.zip", "--endpoint-url", proxy.url, timeout=60)
    assert res.returncode == 0 and b"big" in res.stdout, res.stderr
    assert time.monotonic() - started < s3mod.HEAD_WAIT + baseline + 4


def test_a_malformed_aws_config_is_one_line_and_secrets_stay_out_of_debug_logs(tmp_path: Path) -> None:
    """A broken ~/.aws/config was a 40-line traceback; with -v, the optional first-bytes request
    logged the endpoint URL with its user:password when it failed."""
    bad = tmp_path / "config"
    bad.write_text("[default\nregion = us-east-1\n")
    env = {**os.environ, "AWS_CONFIG_FILE": str(bad), "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}
    cmd = [sys.executable, "-m", "cdmlfs", "ls", "s3://bkt/a.zip", "--endpoint-url", "http://127.0.0.1:9"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    err = res.stderr.strip()
    assert res.returncode == 2 and "AWS configuration" in err and len(err.splitlines()) == 1, err
    env["AWS_CONFIG_FILE"] = str(tmp_path / "none")
    cmd = [
        sys.executable,
        "-m",
        "cdmlfs",
        "ls",
        "-v",
        "s3://b/a.zip",
        "--endpoint-url",
        "http://u:S3CRET@127.0.0.1:9",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode != 0 and "S3CRET" not in res.stderr + res.stdout, res.stderr


def test_a_tls_error_in_the_middle_of_a_body_is_retried() -> None:
    """botocore wraps only some of urllib3's errors when a body is read: a TLS record broken mid-body
    came through as urllib3's SSLError (no OSError), was not classified, and escaped every retry as
    an internal error (EIO with a traceback, no 'giving up' line)."""
    import ssl

    from urllib3.exceptions import ProtocolError
    from urllib3.exceptions import SSLError as Urllib3SSLError

    obj = s3mod.S3Object.__new__(s3mod.S3Object)  # classification needs no connection
    obj.location = "s3://b/k"  # what its messages name
    for exc in (
        Urllib3SSLError(ssl.SSLError(1, "[SSL: DECRYPTION_FAILED_OR_BAD_RECORD_MAC]")),
        ProtocolError("x"),
    ):
        with pytest.raises(s3mod._Transient):
            obj._classify(exc, opening=False)


def test_a_failing_credential_process_says_so_in_one_line(moto_s3, tmp_path: Path) -> None:
    """A profile's credential_process that prints no JSON was reported as a bare usage error
    ("cdmlfs: Expecting value: line 1 column 1 (char 0)", exit 2); one that fails had its stderr's
    newline end the message with a blank line."""
    config = tmp_path / "config"
    config.write_text(
        "[profile garbled]\ncredential_process = echo not-json\n"
        "[profile failing]\ncredential_process = sh -c 'echo first >&2; echo second >&2; exit 3'\n"
    )
    env = {**os.environ, "AWS_CONFIG_FILE": str(config), "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    expected = {"garbled": ("credentials", "'garbled'", "not JSON"), "failing": ("first second",)}
    for profile, words in expected.items():
        res = run_cli(
            "ls", "s3://creds/a.zip", "--endpoint-url", moto_s3.url, "--profile", profile, env=env, timeout=60
        )
        err = res.stderr.decode()
        assert res.returncode == 1 and err.count("\n") == 1, err
        assert err.startswith("cdmlfs: s3://creds/a.zip: "), err
        assert all(w in err for w in words) and "Traceback" not in err, err
