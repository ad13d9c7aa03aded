"""S3 objects as byte sources: ranged GETs pinned to the ETag seen at open, retried, block-cached.

``s3://bucket/key`` opens with *one* request: a suffix range (the last
``open_suffix`` bytes) whose reply also carries the object's size and ETag, so
no HEAD is needed, and whose bytes hold what every format reads first (the ZIP
end-of-central-directory record and usually the whole central directory, the
zstd seek table). All later reads go through :class:`~cdmlfs.sources.blocks.BlockLayer`.

Consistency: every GET sends ``If-Match: <ETag at open>`` and every reply's
ETag, Content-Range and length are checked, so a replaced object can never mix
bytes of two versions into one read; it fails the read with
:class:`~cdmlfs.errors.SourceChangedError` (EIO in the mount), and every later
read that needs the network fails fast the same way. A server that ignores
If-Match is caught by the ETag check of the reply.

Faults: timeouts, resets, 5xx, throttling and short bodies are retried with
jittered exponential backoff (:class:`~cdmlfs.sources.retry.RetryPolicy`),
bounded in attempts and in total time; then the read fails with SourceError
and one log line. botocore's own retries are off: its retry loop cannot see
failures that happen while the body is read.

Credentials come from boto3's standard chain (environment, ``--profile``,
config files, instance roles) and are never logged: the SDK's DEBUG logs print
signed request headers, so their loggers are capped at INFO.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator

from cdmlfs import __version__, forksafe
from cdmlfs.cache import ExtentCache
from cdmlfs.errors import ArchiveNotFoundError, SourceChangedError, SourceError, UsageError
from cdmlfs.sources.base import SourceIdentity
from cdmlfs.sources.blocks import BlockConfig, BlockLayer, OpenBody
from cdmlfs.sources.retry import RetryPolicy
from cdmlfs.sources.s3_presigned import PresignedGets, guard_sdk_logs, hide_signature, prefer_sigv4
from cdmlfs.sources.watchdog import WATCHDOG

log = logging.getLogger(__name__)

MiB = 1 << 20
# The opening suffix covers what formats read at the end (the ZIP EOCD search window of 64 KiB +
# 22, ZIP64 records, a zstd seek table of thousands of frames) without fetching much more: a
# central directory beyond it is fetched next, in parallel parts, in one more round trip.
OPEN_SUFFIX = 128 * 1024
HEAD_BYTES = 4096  # what format sniffing reads from the start (cdmlfs.formats.SNIFF_BYTES)
HEAD_WAIT = 1.0  # seconds the open waits for that optional prefetch once its own reply is in
# A range whose read gave up is failed again at once for this long: the kernel asks again, at once,
# for the pages of a read that failed (readahead, then the page itself), and each ask got a whole new
# budget. Short, so that a caller's own retry a moment later makes fresh attempts.
FAILED_RANGE_MEMORY = 1.0
PRIVATE_CACHE = 64 * MiB  # when no Archive cache is shared (a bare S3Object)

# Options open_source() passes through to S3Object (the rest belong to formats and front ends).
S3_OPTIONS = frozenset(
    {
        "endpoint_url",
        "region",
        "no_sign_request",
        "profile",
        "addressing_style",
        "max_connections",
        "part_size",
        "connect_timeout",
        "read_timeout",
        "retry",
        "open_suffix",
    }
)

_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")


class _Transient(Exception):
    """One attempt failed in a way worth retrying (the message says how)."""


class RetriesExhaustedError(SourceError):
    """A read whose retries ran out (of attempts or of time): see FAILED_RANGE_MEMORY."""


# An access point ARN stands where a bucket name goes, as in the AWS CLI: its resource part ends
# with the access point's name (Outposts: outpost/ID/accesspoint/NAME), and the key follows.
_HOST_PORT = re.compile(r"^[A-Za-z0-9.-]+:\d{1,5}$")  # s3://minio:9000/...: an endpoint, no secret
_ACCESS_POINT_ARN = re.compile(
    r"^(arn:[a-z-]+:s3(?:-object-lambda|-outposts)?:[a-z0-9-]*:\d{12}:"
    r"(?:outpost/[A-Za-z0-9-]+/)?accesspoint/[A-Za-z0-9.-]+)(?:/(.*))?$"
)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key). The key is taken verbatim (no URL decoding), like the AWS CLI.

    The bucket may be an access point ARN (``s3://arn:aws:s3:REGION:ACCOUNT:accesspoint/NAME/KEY``)."""
    rest = uri[len("s3://") :] if uri[:5].lower() == "s3://" else uri
    arn = _ACCESS_POINT_ARN.match(rest)
    if arn:
        bucket, key = arn.group(1), arn.group(2)
        if not key or key.endswith("/"):
            raise UsageError(f"{uri}: an S3 archive must be named s3://BUCKET/KEY (an object, not a prefix)")
        return bucket, key
    bucket, sep, key = rest.partition("/")
    if not sep or not key or key.endswith("/"):
        raise UsageError(f"{uri}: an S3 archive must be named s3://BUCKET/KEY (an object, not a prefix)")
    if not _BUCKET.match(bucket):
        if rest.startswith("arn:") and "@" not in bucket:  # an ARN holds no secret: name what is wrong
            raise UsageError(
                f"{uri}: a bucket ARN is not taken; name the bucket (s3://BUCKET/KEY) or an access "
                "point (s3://arn:aws:s3:REGION:ACCOUNT:accesspoint/NAME/KEY)"
            )
        if _HOST_PORT.match(bucket):
            raise UsageError(
                f"{uri}: s3://HOST:PORT/... is not an S3 URI; give the endpoint with "
                f"--endpoint-url http://{bucket} and name the bucket: s3://BUCKET/KEY"
            )
        if ":" in bucket or "@" in bucket:  # never echo it: s3://KEY_ID:SECRET@bucket/... was tried
            raise UsageError("invalid bucket name in S3 URI (credentials in the URI are not supported)")
        raise UsageError(
            f"invalid bucket name {bucket!r} in {uri}: 2-255 letters, digits, '.', '-' or '_', "
            "starting with a letter or digit"
        )
    return bucket, key


def _whole_seconds(when: datetime.datetime) -> int:
    """Seconds since the epoch (a naive time is UTC, as HTTP dates are)."""
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return int(when.timestamp())


def _is_weak(etag: str) -> bool:
    return etag.strip().startswith("W/")


def _version(etag: str, last_modified: datetime.datetime | None) -> str:
    """The identity's version: the ETag; for a weak one, with the Last-Modified second as well (a
    weak ETag may stay the same when the bytes change, servers deriving it from size and mtime)."""
    if _is_weak(etag):
        when = _whole_seconds(last_modified) if last_modified is not None else 0
        return f"{etag.strip()}@{when}"
    return _etag(etag)


def _etag(value: str | None) -> str:
    return (value or "").strip().removeprefix("W/").strip('"')


class S3Object:
    """An S3 (or S3-compatible) object read with ranged GETs through a shared block cache."""

    prefers_threads = True

    def __init__(
        self,
        uri: str,
        *,
        cache: ExtentCache | None = None,
        endpoint_url: str | None = None,
        region: str | None = None,
        no_sign_request: bool = False,
        profile: str | None = None,
        addressing_style: str | None = None,
        max_connections: int = 16,
        part_size: int = 16 * MiB,
        connect_timeout: float = 5.0,
        read_timeout: float = 20.0,
        retry: RetryPolicy | None = None,
        open_suffix: int = OPEN_SUFFIX,
    ) -> None:
        self.bucket, self.key = parse_s3_uri(uri)
        self.location = f"s3://{self.bucket}/{self.key}"
        self.endpoint_url = _checked_endpoint(endpoint_url) if endpoint_url is not None else None
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise UsageError(f"retry must be a cdmlfs.sources.retry.RetryPolicy, not {retry!r}")
        self.retry = retry or RetryPolicy()
        if max_connections < 2:
            raise UsageError("max_connections must be at least 2")
        if addressing_style not in (None, "auto", "path", "virtual"):
            raise UsageError(f"addressing style must be auto, path or virtual, not {addressing_style!r}")
        # An explicit endpoint is almost always a non-AWS store (MinIO, Ceph, moto...): path style.
        # Otherwise None: the profile's own s3.addressing_style setting (or botocore's default) applies.
        # An access point ARN cannot go in a path: botocore addresses it by its own host name.
        arn = self.bucket.startswith("arn:")
        self._addressing = addressing_style or ("path" if endpoint_url and not arn else None)
        self._region = region
        self._profile = profile
        self._unsigned = bool(no_sign_request)
        # Socket timeouts that fit the deadline; a reply's headers as a whole are awaited for the read
        # timeout at most (_reply_by), its body until the deadline (the watchdog).
        self._timeouts = self.retry.timeouts(connect_timeout, read_timeout)
        self._connections = max_connections
        self._client_lock = threading.Lock()
        self._client = None
        self._session = None
        self._changed: str | None = None
        self._closed = False
        self._watchdog = WATCHDOG
        self._waiting = _StuckCount()  # requests still waiting for replies their reads gave up on
        self._failed_ranges: dict[tuple[int, int], tuple[float, str]] = {}
        self.requests = 0  # GET attempts, including retries and the opening one
        self.bytes_received = 0
        self.retries = 0
        # Ranged reads by presigned URL (cdmlfs.sources.s3_presigned): CDMLFS_S3_PRESIGNED=0 sends every
        # GET through the SDK's get_object instead (for comparison; refusals fall back on their own).
        self._presigned = (
            PresignedGets(self.bucket, self.key, f"cdmlfs/{__version__}")
            if os.environ.get("CDMLFS_S3_PRESIGNED", "1") != "0"
            else None
        )
        guard_sdk_logs()  # the SDK logs signed headers (key id, session token) at DEBUG: never shown
        self._make_session()
        # Format sniffing reads the first bytes: asked for at the same time as the suffix.
        self._head = head = _Background(self._head_bytes, HEAD_BYTES)
        self.size, self.etag, tail_start, tail = self._open(open_suffix)
        self._weak = _is_weak(self.etag)
        last_modified = getattr(self, "_last_modified", None)
        self.mtime = last_modified.timestamp() if last_modified is not None else 0.0
        self._no_modified_warned = False
        version = _version(self.etag, last_modified)
        if self._weak:
            log.warning(
                "%s: the server sends a weak ETag (%s): reads are pinned to it and to the object's "
                "Last-Modified; a replacement keeping both (same size, mtime set back) would go unseen",
                self.location,
                self.etag,
            )
        # Another endpoint (MinIO beside AWS, two test servers) may hold other bytes under the same
        # bucket, key and ETag (a weak or constant ETag): its persisted index must not be taken.
        # Without its user:password: the key is written into the persisted index and failure records.
        # The endpoint the SDK resolved: one set by AWS_ENDPOINT_URL or a profile's endpoint_url (as
        # MinIO users do) was left out, and another server's saved index was taken (wrong bytes).
        endpoint = endpoint_url or _custom_endpoint(getattr(self._s3().meta, "endpoint_url", ""))
        self._endpoint_key = (
            f"endpoint={_redact(endpoint.rstrip('/'))}" if endpoint else ""
        )  # http://h/ = http://h
        self.identity = SourceIdentity(self.location, self.size, version, self._endpoint_key)
        self._cache = cache if cache is not None else ExtentCache(PRIVATE_CACHE)
        workers = max(1, max_connections // 2)
        config = BlockConfig(
            part_size=part_size,
            foreground_workers=workers,
            prefetch_workers=max_connections - workers,
            request_budget=self.retry.deadline,
        )
        # Large prefetches stay open bodies received straight into readers' buffers (blocks.py);
        # CDMLFS_S3_OPEN_BODIES=0 receives them into buffers first (for comparison).
        opens = os.environ.get("CDMLFS_S3_OPEN_BODIES", "1") != "0"
        self._blocks = BlockLayer(
            self._get_range,
            self.size,
            self._cache,
            config,
            name=self.location,
            fetch_into=self._get_range_into,
            open_range=self._open_range if opens else None,
        )
        if tail:
            self._blocks.seed(tail_start, tail)
        first = head.result(HEAD_WAIT)  # an optimisation: a slow one is not waited for
        # (A weak ETag equal in both replies says little: the first bytes are then read again.)
        if first is not None and first[0] == self.etag and tail_start > 0 and not self._weak:
            self._blocks.seed(0, first[1][: min(len(first[1]), tail_start)])
        forksafe.register(self)

    # -- Source protocol -----------------------------------------------------------
    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise SourceError(
                f"{self.location}: read of {length} bytes at {offset} is outside the object "
                f"({self.size} bytes)"
            )
        return self._blocks.read(offset, length)

    def read_into(self, offset: int, out) -> int:
        """Optional fast path: ``read_at(offset, len(out))`` copied straight into a writable buffer."""
        n = memoryview(out).nbytes
        if offset < 0 or offset + n > self.size:
            raise SourceError(
                f"{self.location}: read of {n} bytes at {offset} is outside the object ({self.size} bytes)"
            )
        return self._blocks.read_into(offset, out)

    def fileno(self) -> int | None:
        return None

    def probe_identity(self) -> SourceIdentity:
        """What the key holds now (a HEAD request): a different identity means a new open reads
        other bytes (the object was replaced)."""

        def attempt(deadline: float):
            try:
                return self._reply_by(deadline, head=True)
            except Exception as exc:
                self._classify(exc, opening=True)
                raise

        resp = self._with_retries(attempt, "HEAD")
        version = _version(resp.get("ETag") or "", resp.get("LastModified"))
        return SourceIdentity(self.location, int(resp.get("ContentLength") or 0), version, self._endpoint_key)

    @property
    def bytes_read(self) -> int:
        """Bytes received from the object store (for cdmlfs stats)."""
        return self.bytes_received

    def close(self) -> None:
        # Requests under way end now: a wait for reply headers returns, a body being received has
        # its socket shut down. They used to go on until the read deadline (a minute by default),
        # holding a fetch thread that interpreter exit, and so an unmount, waited for.
        self._closed = True
        self._waiting.close()
        self._watchdog.cut(self)
        self._blocks.close()
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # closing sockets must never fail an unmount
                client.close()

    def stats(self) -> dict[str, int]:
        """Request and block-layer counters (``cdmlfs stats`` shows them)."""
        out = {"get_requests": self.requests, "retries": self.retries, "bytes_received": self.bytes_received}
        out["presigned_gets"] = self._presigned.sent if self._presigned is not None else 0
        out.update(self._blocks.stats.as_dict())
        return out

    def __repr__(self) -> str:
        return f"S3Object({self.location!r}, size={self.size})"

    # -- client ------------------------------------------------------------------
    def _make_session(self) -> None:
        try:
            import boto3
            from botocore.exceptions import BotoCoreError, ProfileNotFound
        except ImportError:
            raise UsageError("S3 support needs boto3: pip install 'cdmlfs[s3]'") from None
        try:
            self._session = _shared_session(boto3, self._profile, self._region)
        except ProfileNotFound:
            raise UsageError(f"AWS profile {self._profile_name()!r} not found") from None
        except BotoCoreError as exc:  # a malformed ~/.aws/config or credentials file, say
            raise UsageError(f"AWS configuration: {_redact(str(exc))}") from None

    def _s3(self):
        """The client (created lazily, and again in a forked child: sockets are not shared)."""
        client = self._client
        if client is not None:
            return client
        with self._client_lock:
            if self._closed:  # a request still under way after close makes no new client (and pool)
                raise SourceError(f"{self.location}: source is closed")
            if self._client is None:
                from botocore import UNSIGNED
                from botocore.config import Config

                connect, read = self._timeouts
                kwargs = {
                    "connect_timeout": connect,
                    "read_timeout": read,
                    "retries": {"total_max_attempts": 1, "mode": "standard"},  # we retry, body included
                    "max_pool_connections": self._connections,
                    "tcp_keepalive": True,
                    # Ranged GETs carry no whole-object checksum; we check lengths and ETags ourselves.
                    "request_checksum_calculation": "when_required",
                    "response_checksum_validation": "when_required",
                    "user_agent_extra": "cdmlfs",
                }
                if self._addressing:
                    kwargs["s3"] = {"addressing_style": self._addressing}
                if self._unsigned:
                    kwargs["signature_version"] = UNSIGNED
                try:
                    with _SESSIONS.lock:  # a boto3 Session is not safe to make clients from at once
                        self._client = self._session.client(  # type: ignore[union-attr]
                            "s3", endpoint_url=self.endpoint_url, config=Config(**kwargs)
                        )
                except json.JSONDecodeError as exc:
                    # Credentials are resolved here: a credential_process (or SSO cache file) whose
                    # output is not JSON raised this bare, and was reported as a usage error.
                    raise SourceError(
                        f"{self.location}: loading AWS credentials{self._profile_words()} failed: not JSON "
                        f"({exc}); check that profile's credential_process"
                    ) from None
                except ValueError as exc:  # botocore: "Invalid endpoint: 127.0.0.1:9000" (no scheme)
                    hint = " (an endpoint URL looks like http://host:port)" if "endpoint" in str(exc) else ""
                    raise UsageError(f"{_redact(str(exc))}{hint}") from None
                if self._presigned is not None:
                    prefer_sigv4(self._client)
                guard_sdk_logs()  # loggers of the modules the client brought in
            return self._client

    def _profile_name(self) -> str | None:
        """The profile the SDK uses: ours, else the environment's."""
        if self._profile is not None:
            return self._profile
        return os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE")

    def _profile_words(self) -> str:
        name = self._profile_name()
        return f" (profile {name!r})" if name else ""

    def _before_fork(self) -> None:
        # The optional first-bytes request may still be inside the SDK (a fork then would copy its
        # locks held): give it the time the open gave it. Requests abandoned on a stuck server can
        # be too; the child makes its own client and never touches theirs.
        self._head.result(HEAD_WAIT)

    def _after_fork_child(self) -> None:
        self._client_lock = threading.Lock()
        if self._presigned is not None:
            self._presigned.after_fork()
        self._client = None  # the parent's connection pool shares sockets with it
        self._waiting = _StuckCount()  # its threads stayed in the parent
        self._failed_ranges = {}

    # -- requests ----------------------------------------------------------------
    def _open(self, suffix: int) -> tuple[int, str, int, bytes]:
        """One suffix GET: size, ETag, and the object's last bytes (where formats look first)."""

        def attempt(deadline: float):
            try:
                resp = self._reply_by(deadline, Range=f"bytes=-{suffix}")
            except Exception as exc:
                if _error_code(exc) != "InvalidRange":
                    self._classify(exc, opening=True)
                    raise
            else:
                return self._open_reply(resp, suffix, deadline)
            try:  # S3 answers 416 for any range of an empty object
                return self._open_empty(deadline)
            except Exception as exc:
                self._classify(exc, opening=True)
                raise

        return self._with_retries(attempt, "open")

    def _open_reply(self, resp, suffix: int, deadline: float) -> tuple[int, str, int, bytes]:
        """Size, ETag and bytes of the opening suffix GET's reply."""
        body = resp["Body"]
        self._last_modified = resp.get("LastModified")
        try:
            etag = resp.get("ETag")
            if not etag:
                raise SourceError(f"{self.location}: the server sent no ETag; reads could not be pinned")
            length = resp.get("ContentLength")
            crange = resp.get("ContentRange")
            if crange:
                m = _CONTENT_RANGE.match(crange)
                if not m or m.group(3) == "*":
                    raise _Transient(f"unparsable Content-Range {crange!r}")
                start, last, size = int(m.group(1)), int(m.group(2)), int(m.group(3))
                if length is None:  # chunked: the body is counted as it is read
                    length = last - start + 1
                if last != size - 1 or last - start + 1 != length:
                    raise _Transient(f"unexpected Content-Range {crange!r} for a suffix request")
            else:  # 200: the whole object (smaller than the suffix, or empty)
                start, size = 0, length
                if length is None or length > suffix:
                    raise SourceError(
                        f"{self.location}: the server ignores Range requests (it sent all of "
                        f"{length} bytes); random access needs ranged GETs"
                    )
            with self._guard(body, deadline):
                data = self._read_body(body, length)
        finally:
            body.close()
        return size, etag, start, data

    def _head_bytes(self, n: int) -> tuple[str, bytes] | None:
        """The first ``n`` bytes and their ETag, unpinned (kept only if the ETag matches the suffix's)."""
        deadline = time.monotonic() + self.retry.deadline
        try:
            resp = self._reply_by(deadline, Range=f"bytes=0-{n - 1}")
            body = resp["Body"]
            try:
                crange = resp.get("ContentRange") or ""
                if not crange.startswith("bytes 0-"):
                    return None
                with self._guard(body, deadline):
                    data = body.read()
            finally:
                body.close()
            self.requests += 1
            self.bytes_received += len(data)
            return resp.get("ETag") or "", data
        except Exception as exc:  # an optimisation only: the format's own read will fetch it
            log.debug("%s: head prefetch failed: %s", self.location, _redact(str(exc)))
            return None

    def _open_empty(self, deadline: float) -> tuple[int, str, int, bytes]:
        resp = self._reply_by(deadline, head=True)
        self._last_modified = resp.get("LastModified")
        etag = resp.get("ETag")
        if not etag or resp.get("ContentLength"):
            raise _Transient("416 for a suffix range of an object that is not empty")
        return 0, etag, 0, b""

    def _get_range(self, start: int, end: int, since: float) -> bytes:
        """Bytes [start, end) of the version opened, retried; the block layer's fetch function.

        ``since``: when a read first asked for them (``time.monotonic()``); the read's deadline
        counts from then, so time spent queued for a free connection is part of it."""
        return self._ranged_get(start, end, since, lambda body: self._read_body(body, end - start))

    def _get_range_into(self, start: int, end: int, out: memoryview, since: float) -> None:
        """Like ``_get_range``, received straight into ``out`` (the block layer's recycled buffers)."""
        self._ranged_get(start, end, since, lambda body: self._read_body_into(body, out))

    def _open_range(self, start: int, end: int, since: float) -> OpenBody:
        """Like ``_get_range``, but the body is left unread: the block layer's ``open_range``."""
        n = end - start
        return self._ranged_get(start, end, since, lambda body: _OpenReply(self, body, n), keep=True)

    def _ranged_get(self, start: int, end: int, since: float, consume, keep: bool = False):
        """One ranged GET pinned to the opening ETag, checked, retried; ``consume(body)`` reads the body
        (with ``keep``, whatever it returns reads it later: the body is not closed here)."""
        if self._changed:
            raise SourceChangedError(self._changed)
        self._fail_if_failed_lately(start, end)
        n = end - start
        expect = f"bytes {start}-{end - 1}/{self.size}"

        def attempt(deadline: float):
            pin = {"IfMatch": self.etag}
            if self._weak:  # If-Match never matches a weak ETag: the modification time pins instead
                pin = {"IfUnmodifiedSince": self._last_modified} if self._last_modified is not None else {}
            try:
                resp = self._reply_by(deadline, presigned=True, Range=f"bytes={start}-{end - 1}", **pin)
            except Exception as exc:
                self._classify(exc, opening=False)
                raise
            body = resp["Body"]
            kept = False
            try:
                etag = resp.get("ETag")
                if not etag:  # without it, a server that ignores If-Match could mix versions unseen
                    raise SourceError(f"{self.location}: the server sent no ETag with a ranged reply")
                if _etag(etag) != _etag(self.etag):
                    raise self._mark_changed(f"its ETag is now {etag}")
                if self._weak and self._last_modified is not None:
                    self._check_modified(resp.get("LastModified"))
                crange = resp.get("ContentRange")
                if crange != expect:
                    whole = (
                        crange is None and start == 0 and n == self.size and resp.get("ContentLength") == n
                    )
                    if not whole:
                        m = _CONTENT_RANGE.match(crange or "")
                        if m and m.group(3) != "*" and int(m.group(3)) != self.size:
                            raise self._mark_changed(f"its size is now {m.group(3)} bytes")
                        raise _Transient(f"asked for {expect}, got Content-Range {crange!r}")
                length = resp.get("ContentLength")
                if length is not None and length != n:  # readinto stops at n: never accept more
                    raise _Transient(f"asked for {n} bytes, the reply says {length}")
                if keep:
                    reply = consume(body)
                    kept = True  # (not before: a consume that failed leaves the body to close here)
                    return reply
                # A body dripping in never ends otherwise.
                with self._guard(body, deadline):
                    return consume(body)
            finally:
                if not kept:
                    body.close()

        try:
            return self._with_retries(attempt, f"GET bytes={start}-{end - 1}", since)
        except RetriesExhaustedError as exc:
            if not self._closed:
                self._failed_ranges[(start, end)] = (time.monotonic(), str(exc))
            raise

    def _check_modified(self, modified) -> None:
        """A ranged reply's Last-Modified against the one seen at open (weak ETags only), to the
        second (HTTP dates have no more; the SDK's parse and ours may differ below it)."""
        if modified is None:  # the ETag check alone, as before: say so once
            if not self._no_modified_warned:
                self._no_modified_warned = True
                what = "no Last-Modified on ranged replies: the weak ETag alone pins them"
                log.warning("%s: %s", self.location, what)
            return
        if _whole_seconds(modified) != _whole_seconds(self._last_modified):
            raise self._mark_changed(f"it was modified at {modified:%Y-%m-%d %H:%M:%S}")

    def _fail_if_failed_lately(self, start: int, end: int) -> None:
        """A read of a range that gave up within FAILED_RANGE_MEMORY seconds fails at once, with the
        same reason: the kernel asks again for the pages of a failed read, and each ask took a whole
        retry budget (a stalled server held a mount read twice --read-deadline)."""
        if not self._failed_ranges:
            return
        now = time.monotonic()
        for (lo, hi), (when, why) in list(self._failed_ranges.items()):
            if now - when > FAILED_RANGE_MEMORY:
                self._failed_ranges.pop((lo, hi), None)
            elif lo < end and start < hi:
                raise SourceError(f"{why} (failed {now - when:.1f} s ago: not asked again yet)")

    def _reply_by(self, deadline: float, head: bool = False, presigned: bool = False, **params):
        """``get_object`` (``head_object`` with ``head``; by presigned URL with ``presigned``), its
        reply's headers awaited for a read timeout at most (never past ``deadline``).

        The HTTP client's timeouts bound each socket read, not the headers as a whole: a server that
        sent them a byte at a time held the read (and the FUSE request on it) for ever; the watchdog
        bounds only bodies. So the request is made on a thread of its own (a daemon thread: one
        left waiting on such a server must not hold the process at exit) while this one waits;
        headers not all in by then fail the attempt like a stall (it is retried), and a reply that
        comes later is closed unread. Past MAX_STUCK requests left waiting, attempts fail at once.
        """
        deadline = min(deadline, time.monotonic() + self._timeouts[1])
        s3 = self._s3()  # refuses once the source is closed
        if presigned and self._presigned is not None and not head:
            request = _Request(self._presigned.get_object, {"client": s3, **params}, self._waiting)
            request.params["stop"] = request.abandoned  # no fresh URL nor SDK request after that
        else:
            call = s3.head_object if head else s3.get_object
            request = _Request(call, {"Bucket": self.bucket, "Key": self.key, **params}, self._waiting)
        if not request.start():
            raise _Transient(f"{MAX_STUCK} requests are still waiting for replies from this server")
        return request.result(deadline)

    @contextlib.contextmanager
    def _guard(self, body, deadline: float) -> Iterator[None]:
        """Read ``body`` by ``deadline`` (the watchdog), and not at all once this source is closed:
        close() cuts the bodies registered before it, and one registered just after it (its reply's
        headers came in meanwhile) would otherwise be read until the deadline."""
        with self._watchdog.guard(body, deadline, owner=self):
            if self._closed:
                raise SourceError(f"{self.location}: source closed during the read")
            yield

    def _read_body(self, body, n: int | None) -> bytes:
        try:
            data = body.read()
        except Exception as exc:
            self._classify(exc, opening=False)
            raise
        self.bytes_received += len(data)
        if n is not None and len(data) != n:
            raise _Transient(f"truncated body: {len(data)} of {n} bytes")
        return data

    def _read_body_into(self, body, out: memoryview, release: bool = True) -> None:
        """Receive the body into ``out`` with no allocation and no copy beyond the socket's.

        botocore's body wraps urllib3's response, which wraps http.client's:
        only the innermost reads into a caller's buffer (urllib3's ``readinto``
        allocates and copies). When that layering is not there (another HTTP
        stack), the body is read the ordinary way and copied.
        """
        n = len(out)
        raw = getattr(body, "_raw_stream", None)  # urllib3 response
        fp = getattr(raw, "_fp", None)  # http.client response
        if fp is None or not hasattr(fp, "readinto") or not hasattr(raw, "release_conn"):
            out[:] = self._read_body(body, n)
            return
        got = 0
        try:
            while got < n:
                k = fp.readinto(out[got:])
                if not k:
                    break
                got += k
        except Exception as exc:
            self._classify(exc, opening=False)
            raise
        self.bytes_received += got
        if got != n:
            raise _Transient(f"truncated body: {got} of {n} bytes")
        if release and fp.isclosed():  # the body ended where its length said: the connection can serve
            raw.release_conn()  # again (closing the body without this would drop the connection)

    def _with_retries(self, attempt, what: str, since: float | None = None):
        """``attempt(deadline)`` until it succeeds or the policy gives up (the deadline is the
        monotonic time by which the whole read must be over: the body of a reply too).

        ``since``: when the read began, if before now. A read queued behind others for a free
        connection spends its budget there too: with a stalled server, reads queued behind the
        stalled ones each got a whole deadline of their own once they started, and a read took
        several times ``--read-deadline``. One whose budget is gone fails without a request.
        """
        policy = self.retry
        now = time.monotonic()
        started = now if since is None else min(since, now)
        deadline = started + policy.deadline
        if now >= deadline:
            waited = now - started
            log.warning("%s: %s waited %.1f s for a free connection, giving up", self.location, what, waited)
            raise SourceError(
                f"{self.location}: {what} gave up after {waited:.1f} s waiting for a free connection "
                "(the requests ahead of it were slow)"
            )
        failures = 0
        while True:
            self.requests += 1  # an attempt after close is refused by _s3()
            try:
                return attempt(deadline)
            except _Transient as exc:
                failures += 1
                if self._closed:
                    raise SourceError(f"{self.location}: source closed during the read ({exc})") from None
                # Every wait of an attempt ends by the deadline (its reply's headers in _reply_by, its
                # body through the watchdog): any retry that can start before it is worth making.
                pause = policy.next_delay(failures, started)
                elapsed = time.monotonic() - started
                if pause is None:
                    # A failed open is the caller's one-line error; a failed read is logged here, each time.
                    log.log(
                        logging.INFO if what == "open" else logging.WARNING,
                        "%s: %s failed %d times in %.1f s, giving up: %s",
                        self.location, what, failures, elapsed, exc,
                    )  # fmt: skip
                    raise RetriesExhaustedError(
                        f"{self.location}: {what} failed after {failures} attempts in {elapsed:.1f} s ({exc})"
                    ) from None
                self.retries += 1
                log.info("%s: %s failed (%s); retry %d in %.2f s", self.location, what, exc, failures, pause)
                time.sleep(pause)

    def _classify(self, exc: BaseException, opening: bool) -> None:
        """Raise the right error for an SDK or socket exception (never returns for known kinds)."""
        from http.client import HTTPException

        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionError,
            HTTPClientError,
            IncompleteReadError,
            NoCredentialsError,
            PartialCredentialsError,
            SSLError,
        )

        if isinstance(exc, (SourceError, _Transient)):
            return
        if isinstance(exc, ClientError):
            code = _error_code(exc)
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status >= 500 or status == 429 or code in _RETRYABLE_CODES:
                raise _Transient(f"HTTP {status} {code}") from None
            if not opening and (status == 412 or code == "PreconditionFailed"):
                failed = "If-Unmodified-Since" if self._weak else "If-Match"
                raise self._mark_changed(f"it was replaced ({failed} failed)") from None
            if not opening and (status == 416 or code == "InvalidRange"):  # ranges inside the size at open
                raise self._mark_changed("it is now shorter (a range inside it is invalid)") from None
            if code == "InvalidObjectState":  # GetObject on an archived object (403)
                raise SourceError(
                    f"{self.location}: the object is archived (Glacier or Deep Archive storage class, or an "
                    "archive tier of Intelligent-Tiering): restore it first (aws s3api restore-object)"
                ) from None
            if code == "RequestTimeTooSkewed":
                raise SourceError(
                    f"{self.location}: this machine's clock is too far from the server's ({code}): set it "
                    "right (NTP) and try again"
                ) from None
            if code in ("NoSuchKey", "NoSuchBucket") or status == 404:
                if not opening:
                    raise self._mark_changed("it was deleted") from None
                what = f"no such bucket {self.bucket!r}" if code == "NoSuchBucket" else "no such object"
                raise ArchiveNotFoundError(f"{self.location}: {what} ({code or status})") from None
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
                hint = (
                    ""
                    if self._unsigned
                    else " (check credentials or --profile; public buckets: --no-sign-request)"
                )
                raise SourceError(f"{self.location}: access denied ({code or status}){hint}") from None
            raise SourceError(f"{self.location}: S3 error {status} {code}") from None
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            raise SourceError(
                f"{self.location}: no AWS credentials found (set AWS_PROFILE/--profile or the AWS_* "
                "environment variables; public buckets: --no-sign-request)"
            ) from None
        # Matched against the TLS error itself: the message around it quotes the request URL, whose
        # bucket or key may well say "certificate" (a dropped handshake there failed unretried).
        if isinstance(exc, SSLError) and _PERMANENT_TLS.search(str(exc.kwargs.get("error", exc))):
            # These fail the same way every time (https to a plain-http port, a certificate that
            # does not verify): retrying only delays the message. A dropped handshake is retried.
            raise SourceError(f"{self.location}: TLS failed ({_redact(str(exc))})") from None
        from urllib3.exceptions import HTTPError as Urllib3Error

        # urllib3's own errors reach us from a body read (botocore wraps only some): a TLS record
        # broken mid-body (urllib3's SSLError, no OSError) escaped unretried as an internal error.
        transient = (
            ConnectionError,
            HTTPClientError,
            IncompleteReadError,
            OSError,
            HTTPException,
            Urllib3Error,
        )
        if isinstance(exc, transient):
            # A body read that timed out names no URL (botocore's 'endpoint URL: "None"'): say which
            # object it was (never a presigned URL: it carries a signature).
            text = _redact(str(exc)).replace('endpoint URL: "None"', self.location)
            raise _Transient(f"{type(exc).__name__}: {text}") from None
        if isinstance(exc, BotoCoreError):
            # One line: a failing credential_process has its stderr (newlines and all) quoted here.
            raise SourceError(f"{self.location}: {' '.join(_redact(str(exc)).split())}") from None

    def _mark_changed(self, how: str) -> SourceChangedError:
        message = (
            f"{self.location}: the object changed after it was opened ({how}; ETag at open {self.etag}); "
            "open it again (remount) to read the new version"
        )
        if self._changed is None:
            self._changed = message
            log.error("%s", message)
        return SourceChangedError(message)


PIECE = 1 << 20  # an open body is received by the MiB, each within a read timeout


class _OpenReply:
    """A checked ranged reply whose body the block layer receives later, a piece at a time.

    Each piece is received like a whole body (``_read_body_into``: straight into the
    caller's buffer), each MiB of it within a read timeout of its own: the body may have
    waited for its reader for a while, and a server that gave up on it meanwhile must fail
    the piece quickly (the block layer then fetches those bytes again, with the read's
    retries). Another HTTP stack than botocore's (no caller-buffer reads) has the body read
    whole at once: up to max_open parts (8 x 16 MiB) outside the cache; none is known.
    """

    __slots__ = ("_body", "_left", "_owner", "_whole")

    def __init__(self, owner: S3Object, body, n: int) -> None:
        self._owner = owner
        self._body = body
        self._left = n
        raw = getattr(body, "_raw_stream", None)
        fp = getattr(raw, "_fp", None)
        self._whole: memoryview | None = None
        if fp is None or not hasattr(fp, "readinto") or not hasattr(raw, "release_conn"):
            with owner._guard(body, time.monotonic() + owner._timeouts[1]):
                self._whole = memoryview(owner._read_body(body, n))

    def readinto(self, out: memoryview) -> None:
        owner = self._owner
        if owner._closed:
            raise SourceError(f"{owner.location}: source closed during the read")
        if len(out) > self._left:
            raise SourceError(f"{owner.location}: internal error: {len(out)} bytes wanted, {self._left} left")
        if self._whole is not None:
            at = len(self._whole) - self._left
            out[:] = self._whole[at : at + len(out)]
            self._left -= len(out)
            return
        for at in range(0, len(out), PIECE):
            piece = out[at : at + PIECE]
            try:
                with owner._guard(self._body, time.monotonic() + owner._timeouts[1]):
                    owner._read_body_into(self._body, piece, release=False)
            except _Transient as exc:
                raise SourceError(f"{owner.location}: {exc}") from None
            self._left -= len(piece)

    def finish(self) -> None:
        owner = self._owner
        raw = getattr(self._body, "_raw_stream", None)
        fp = getattr(raw, "_fp", None)
        if not self._left and fp is not None and fp.isclosed() and hasattr(raw, "release_conn"):
            raw.release_conn()  # read to its end: the connection can serve again
        elif self._left:
            log.debug("%s: an open body finished with %d bytes unread", owner.location, self._left)
        self._body.close()

    def close(self) -> None:
        self._body.close()


class _SessionRegistry:
    """One boto3 Session per (profile, region) in a process.

    A session holds the SDK's loaded service models and credential chain: about 12 MiB each,
    where a client made from an existing one costs 0.4 MiB. A dataset of 40 S3 shards held a
    session per shard: 517 MiB of a DataLoader worker before any read."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sessions: dict[tuple[str | None, str | None], tuple[bytes, object]] = {}

    def after_fork_child(self) -> None:
        self.lock = threading.Lock()  # a parent thread may have held it; the sessions hold no sockets


_SESSIONS = _SessionRegistry()
os.register_at_fork(after_in_child=_SESSIONS.after_fork_child)


# What a session reads once and keeps: the environment's AWS settings, and the shared config and
# credentials files (saml2aws, gimme-aws-creds, `aws configure` rewrite them with fresh keys). Any
# other value, or a file written since, makes a new session: sharing never serves old credentials.
_SESSION_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
)


def _session_stamp() -> bytes:
    parts = [os.environ.get(k, "\1") for k in _SESSION_ENV]
    home = os.path.expanduser("~")
    for var, default in (("AWS_CONFIG_FILE", "config"), ("AWS_SHARED_CREDENTIALS_FILE", "credentials")):
        path = os.path.expanduser(os.environ.get(var) or os.path.join(home, ".aws", default))
        try:
            st = os.stat(path)
            parts.append(f"{path}\0{st.st_mtime_ns}\0{st.st_size}\0{st.st_ino}")
        except OSError:
            parts.append(f"{path}\0-")
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).digest()


def _shared_session(boto3, profile: str | None, region: str | None):
    stamp = _session_stamp()
    with _SESSIONS.lock:
        kept = _SESSIONS.sessions.get((profile, region))
        if kept is not None and kept[0] == stamp:
            return kept[1]
        session = boto3.session.Session(profile_name=profile, region_name=region)
        _SESSIONS.sessions[(profile, region)] = (stamp, session)  # objects holding the old one keep it
        return session


class _Background:
    """Run one call in a thread; ``result(timeout)`` waits for it (None if it raised or is not done)."""

    def __init__(self, fn, *args) -> None:
        self._result = None
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn, *args) -> None:
        self._result = fn(*args)

    def result(self, timeout: float | None = None):
        """Its value, or None when it raised or is not done within ``timeout`` seconds."""
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self._result


MAX_STUCK = 64  # requests of one object left waiting for replies (one thread each) before attempts stop


class _StuckCount:
    """An object's requests: how many are still waiting for a reply nobody waits for any more, and
    the ones waited for now (closing the object stops those waits at once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stuck = 0
        self.live: set[_Request] = set()
        self.closed = False

    def close(self) -> None:
        with self.lock:
            self.closed = True
            live, self.live = self.live, set()
        for request in live:
            request.wake.set()


class _Request:
    """One SDK call on a daemon thread; :meth:`result` waits for it until a deadline.

    The thread runs at once (no queue, so no request is held back behind stuck ones, or sent
    late after its read gave up). A call given up on counts as stuck until it ends; its reply's
    body, if it comes, is closed (which frees the connection)."""

    def __init__(self, call, params: dict, waiting: _StuckCount) -> None:
        self._call = call
        self.params = params
        self._waiting = waiting
        self._done = threading.Event()
        self.wake = threading.Event()  # the call ended, or its object was closed
        self._abandoned = False
        self._value = None
        self._error: BaseException | None = None

    def start(self) -> bool:
        if self._waiting.stuck >= MAX_STUCK:
            return False
        threading.Thread(target=self._run, name="cdmlfs-s3-request", daemon=True).start()
        return True

    def _run(self) -> None:
        try:
            self._value = self._call(**self.params)
        except BaseException as exc:  # handed to the waiting thread
            self._error = exc
        with self._waiting.lock:
            self._done.set()
            self.wake.set()
            late = self._abandoned
            if late:
                self._waiting.stuck -= 1
        if late and isinstance(self._value, dict) and "Body" in self._value:
            with contextlib.suppress(Exception):
                self._value["Body"].close()

    def abandoned(self) -> bool:
        """Whether the waiting thread gave up on this call (its thread should send nothing more)."""
        return self._abandoned

    def result(self, deadline: float):
        waiting = self._waiting
        with waiting.lock:
            if waiting.closed:
                self.wake.set()
            else:
                waiting.live.add(self)
        try:
            self.wake.wait(max(0.0, deadline - time.monotonic()))
        finally:
            with waiting.lock:
                waiting.live.discard(self)
        if not self._done.is_set():
            with waiting.lock:
                if not self._done.is_set():
                    self._abandoned = True
                    waiting.stuck += 1
                    if waiting.closed:
                        raise _Transient("the source was closed")
                    raise _Transient("no reply headers within the read timeout")
        if self._error is not None:
            raise self._error
        return self._value


_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")
_PERMANENT_TLS = re.compile(r"WRONG_VERSION_NUMBER|CERTIFICATE_VERIFY_FAILED|certificate|hostname", re.I)


def _checked_endpoint(url: object) -> str:
    """``url`` when botocore can use it as an endpoint; a usage error saying why otherwise.

    botocore's own words were "Custom endpoint `ftp://...` was not a valid URI" (exit 1, as if the
    server had failed), "Invalid IPv6 URL" (which URL?), or, for an int, a bare TypeError.
    """
    if not isinstance(url, str):
        raise UsageError(f"endpoint URL must be a string like http://host:port, not {url!r}")
    what = f"endpoint URL {_redact(url)!r}"
    if "://" not in url:
        raise UsageError(f"{what}: no scheme (an endpoint URL looks like http://host:port)")
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError when out of range)
    except ValueError as exc:
        raise UsageError(f"{what}: {exc} (an endpoint URL looks like http://host:port)") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise UsageError(f"{what}: the scheme must be http or https")
    if not parts.hostname:
        raise UsageError(f"{what}: no host (an endpoint URL looks like http://host:port)")
    return url


def _custom_endpoint(url: str) -> str:
    """``url`` unless it is AWS's own (``https://s3.REGION.amazonaws.com``): keys made for AWS objects
    stay as they were, without the region botocore happened to pick."""
    host = urllib.parse.urlsplit(url or "").hostname or ""
    return "" if host.endswith((".amazonaws.com", ".amazonaws.com.cn")) else url or ""


def _redact(text: str) -> str:
    """Drop ``user:password@`` from URLs in a message (an endpoint URL may carry credentials), and
    the signed query of a presigned URL (its signature, key id and session token)."""
    return hide_signature(_USERINFO.sub("***@", text))


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""
