"""S3 test endpoints on 127.0.0.1: moto and localbucket servers, and a fault-injecting proxy.

Servers run as child processes on ports the OS picks (they print it), and exit
when their stdin closes, so a killed test run leaves no server behind. Only
dummy credentials and loopback addresses are used.

* **moto** (server mode): the S3 API as AWS defines it (If-Match, error codes);
  it keeps objects in memory and copies them per request, so keep them small.
* **localbucket**: file-backed, fast; objects are plain files under
  ``root/bucket/key``, so large test objects are written (or hard-linked)
  straight into its directory.
* :class:`FaultProxy`: a threaded HTTP forwarder placed between boto3 and an
  endpoint. It counts requests and response body bytes, and on demand answers
  503 SlowDown or 500, resets connections, stalls past the client's read
  timeout, or cuts bodies short.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
_CLEARED_ENV = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")

_MOTO = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
"""

_LOCALBUCKET = """
import sys, threading
from http.server import ThreadingHTTPServer
from pathlib import Path
import localbucket
localbucket.S3Handler.data_root = Path(sys.argv[1]).resolve()
import socket
class Server(ThreadingHTTPServer):
    daemon_threads = True
    def get_request(self):
        # localbucket writes headers and body separately: without NODELAY, Nagle + delayed ACK = 40 ms.
        sock, addr = super().get_request()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, addr
server = Server(("127.0.0.1", 0), localbucket.S3Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
print(server.server_address[1], flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def dummy_credentials() -> Iterator[None]:
    """AWS_* variables for the test endpoints (and nothing from the real user's AWS setup)."""
    saved = {k: os.environ.get(k) for k in (*DUMMY_ENV, *_CLEARED_ENV)}
    os.environ.update(DUMMY_ENV)
    for k in _CLEARED_ENV:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Endpoint:
    """A running S3 server: its URL, and for localbucket the directory that holds the buckets."""

    url: str
    proc: subprocess.Popen
    root: Path | None = None

    def client(self, **config):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            config=Config(s3={"addressing_style": "path"}, **config),
        )

    def put(self, bucket: str, key: str, data: bytes | Path) -> str:
        """Store an object (creating the bucket); returns its ETag."""
        if self.root is not None:  # localbucket: a plain file, hard-linked when possible
            target = self.root / bucket / key
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            if isinstance(data, Path):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                try:
                    os.link(data, tmp)
                except OSError:
                    tmp.write_bytes(data.read_bytes())
            else:
                tmp.write_bytes(data)
            os.replace(tmp, target)
            return self.client().head_object(Bucket=bucket, Key=key)["ETag"]
        client = self.client()
        with contextlib.suppress(
            client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists
        ):
            client.create_bucket(Bucket=bucket)
        body = data.read_bytes() if isinstance(data, Path) else data
        return client.put_object(Bucket=bucket, Key=key, Body=body)["ETag"]

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _start(code: str, *args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **DUMMY_ENV},
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError(f"S3 test server did not start (printed {line!r})")
    return proc, int(line)


def start_moto() -> Endpoint:
    proc, port = _start(_MOTO)
    return Endpoint(f"http://127.0.0.1:{port}", proc)


def start_localbucket(root: Path) -> Endpoint:
    root.mkdir(parents=True, exist_ok=True)
    proc, port = _start(_LOCALBUCKET, str(root))
    return Endpoint(f"http://127.0.0.1:{port}", proc, root)


# -- fault-injecting proxy ------------------------------------------------------------------
# drip: the whole body, 16 bytes every DRIP_PAUSE seconds (each socket read gets data in time)
FAULTS = (
    "503",
    "500",
    "reset",
    "stall",
    "truncate",
    "short",
    "stall_body",
    "403",
    "drip",
    "drip_headers",
    "skew",
    "bad_header",  # the reply (otherwise right) carries a header line without a colon
)
DRIP_PAUSE = 0.2


@dataclass
class ProxyStats:
    requests: int = 0
    connections: int = 0  # TCP connections clients opened (kept-alive ones count once)
    body_bytes: int = 0
    faults: int = 0
    max_in_flight: int = 0  # most ranged GETs being answered at once (parallel requests)
    # (method, path, Host, Authorization) of every request, as the client sent them
    seen: deque = field(default_factory=lambda: deque(maxlen=10_000))
    log: deque = field(default_factory=lambda: deque(maxlen=10_000))  # (method, range, status, bytes to send)


class FaultProxy:
    """Forwards HTTP to ``upstream``; counts traffic; injects faults into requests that match.

    ``inject(kind, n)`` queues faults applied to the next ``n`` matching requests;
    ``chaos(p)`` applies a random fault to each matching request with probability
    ``p``. By default only ranged GETs match (the reads, not the test's own setup).
    """

    def __init__(
        self, upstream: str, stall_seconds: float = 3.0, latency: float = 0.0, seed: int = 0
    ) -> None:
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.stall_seconds = stall_seconds
        self.latency = latency
        self.stats = ProxyStats()
        self._in_flight = 0
        self._queue: deque[str] = deque()
        self._chaos = 0.0
        self._chaos_kinds: tuple[str, ...] = ()
        # Standing misbehaviours of a non-compliant server, on ranged GETs: "weak_etag" (W/ ETags),
        # "no_etag" (none on replies to non-suffix ranges), "ignore_if_match" (If-Match dropped);
        # "metadata_etag": one weak ETag whatever the bytes (a server deriving it from metadata);
        # "ignore_if_unmodified_since" (If-Unmodified-Since dropped); "no_last_modified" (none on
        # replies to non-suffix ranges);
        # "stall_head_prefetch": the open's optional request for the first 4 KiB stalls (once);
        # "refuse_query_auth": 403 to every request authenticated by its query string (a presigned
        # URL), as a store without query authentication answers; "refuse_query_auth_once": the next.
        self.quirks: set[str] = set()
        self.if_unmodified_since = 0  # ranged GETs that carried the header
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def inject(self, kind: str, n: int = 1) -> None:
        assert kind in FAULTS, kind
        with self._lock:
            self._queue.extend([kind] * n)

    def chaos(self, p: float, kinds: tuple[str, ...] = ("503", "500", "reset", "truncate")) -> None:
        with self._lock:
            self._chaos = p
            self._chaos_kinds = kinds

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()
            self._chaos = 0.0

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = ProxyStats()

    def wait_idle(self, quiet: float = 0.2, timeout: float = 10.0) -> None:
        """Return once no ranged GET has been under way for ``quiet`` seconds: a closed source's
        prefetches still running would otherwise count toward what the test measures next."""
        deadline = time.monotonic() + timeout
        idle_since = None
        while time.monotonic() < deadline:
            with self._lock:
                busy = self._in_flight > 0
            now = time.monotonic()
            if busy:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= quiet:
                return
            time.sleep(0.01)
        raise AssertionError("the S3 proxy stayed busy")

    def _next_fault(self, method: str, headers) -> str | None:
        if method != "GET" or "Range" not in headers:
            return None
        with self._lock:
            if self._queue:
                kind = self._queue.popleft()
            elif self._chaos and self._rng.random() < self._chaos:
                kind = self._rng.choice(self._chaos_kinds)
            else:
                return None
            self.stats.faults += 1
            return kind

    def _count(self, method: str, rng: str | None, status: int, nbytes: int) -> None:
        with self._lock:
            self.stats.requests += 1
            self.stats.body_bytes += nbytes
            self.stats.log.append((method, rng, status, nbytes))

    def _uncount(self, nbytes: int) -> None:
        """Take back body bytes counted but not sent (the client went away, or the upstream body ended)."""
        with self._lock:
            self.stats.body_bytes -= nbytes

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade"})


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy
    _conn: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner.stats.connections += 1
        # Headers and body go out in separate writes: without this, Nagle + delayed ACKs add 40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        self._forward()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _upstream(self) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
            self._conn.connect()
            self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._conn

    def _forward(self) -> None:
        with self.owner._lock:
            self.owner.stats.seen.append(
                (self.command, self.path, self.headers.get("Host", ""), self.headers.get("Authorization"))
            )
        ranged = self.command == "GET" and "Range" in self.headers
        if ranged:
            with self.owner._lock:
                self.owner._in_flight += 1
                self.owner.stats.max_in_flight = max(self.owner.stats.max_in_flight, self.owner._in_flight)
        try:
            self._forward_one()
        finally:
            if ranged:
                with self.owner._lock:
                    self.owner._in_flight -= 1

    def _forward_one(self) -> None:
        owner = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        fault = owner._next_fault(self.command, self.headers)
        if owner.latency:
            time.sleep(owner.latency)
        if fault in ("503", "500", "403"):
            self._error(int(fault))
            return
        query_auth = "X-Amz-Signature=" in self.path or "Signature=" in self.path
        with owner._lock:
            refuse = query_auth and bool(owner.quirks & {"refuse_query_auth", "refuse_query_auth_once"})
            if refuse:
                owner.quirks.discard("refuse_query_auth_once")
        if refuse:
            self._error(403)
            return
        if fault == "skew":  # what S3 answers a request signed with a clock far off
            self._error(403, "RequestTimeTooSkewed")
            return
        if fault == "reset":
            self._reset()
            return
        head_prefetch = self.headers.get("Range") == "bytes=0-4095" and "stall_head_prefetch" in owner.quirks
        if head_prefetch:
            owner.quirks.discard("stall_head_prefetch")
        if fault == "stall" or head_prefetch:
            time.sleep(owner.stall_seconds)
            self._reset()
            return
        if fault == "drip_headers":  # a status line, then header bytes just often enough for any timeout
            ends = time.monotonic() + owner.stall_seconds
            try:
                self.wfile.write(b"HTTP/1.1 206 Partial Content\r\nX-Slow: ")
                while time.monotonic() < ends:
                    self.wfile.write(b"a")
                    self.wfile.flush()
                    time.sleep(DRIP_PAUSE)
            except OSError:
                pass
            self._reset()
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        ranged = self.command == "GET" and "Range" in headers
        if ranged and "ignore_if_match" in owner.quirks:
            headers.pop("If-Match", None)
        if ranged and "ignore_if_unmodified_since" in owner.quirks:
            headers.pop("If-Unmodified-Since", None)
        if ranged and "If-Unmodified-Since" in headers:
            owner.if_unmodified_since += 1
        try:
            conn = self._upstream()
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException):
            self._conn = None
            self._reset()
            return
        self.send_response_only(resp.status, resp.reason)
        suffix = self.headers.get("Range", "").startswith("bytes=-")
        for k, v in resp.getheaders():
            if k.lower() in _HOP:
                continue
            if (ranged or self.command == "HEAD") and k.lower() == "etag":  # HEAD: the same server
                if "no_etag" in owner.quirks and not suffix and ranged:
                    continue
                if "weak_etag" in owner.quirks:
                    v = "W/" + v
                if "metadata_etag" in owner.quirks:
                    v = 'W/"metadata"'
            if ranged and not suffix and k.lower() == "last-modified" and "no_last_modified" in owner.quirks:
                continue
            self.send_header(k, v)
        if fault == "bad_header":  # urllib3 warns "Failed to parse headers (url=...)" and goes on
            self._headers_buffer.append(b"this header line has no colon\r\n")
        self.end_headers()
        total = int(resp.getheader("Content-Length") or 0) if self.command != "HEAD" else 0
        limit = total // 2 if fault in ("truncate", "short", "stall_body") else total
        # Counted before the body goes out: the client can act on the last byte (and a test can
        # read the stats) before this thread runs again. Bytes that could not be sent are taken back.
        owner._count(self.command, self.headers.get("Range"), resp.status, limit)
        sent = written = 0
        try:
            while sent < total:
                chunk = resp.read(min(256 << 10, total - sent))
                if not chunk:
                    break
                keep = chunk[: max(0, limit - sent)]
                if keep and fault == "drip":
                    for i in range(0, len(keep), 16):
                        self.wfile.write(keep[i : i + 16])
                        self.wfile.flush()
                        written += len(keep[i : i + 16])
                        time.sleep(DRIP_PAUSE)
                elif keep:
                    self.wfile.write(keep)
                    written += len(keep)
                sent += len(chunk)
                if len(keep) < len(chunk):
                    break
        except OSError:
            self._conn = None
            self.close_connection = True
            return
        finally:
            if written < limit:
                owner._uncount(limit - written)
        if fault in ("truncate", "short", "stall_body"):
            self.wfile.flush()
            if fault == "stall_body":
                time.sleep(owner.stall_seconds)
            with contextlib.suppress(OSError):
                resp.read()  # drain upstream so its connection stays usable
            if fault == "short":  # a clean close (FIN) mid-body: the client sees EOF, not an error
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_WR)
            else:
                self._reset()

    def _error(self, status: int, code: str | None = None) -> None:
        code = code or {503: "SlowDown", 500: "InternalError", 403: "AccessDenied"}[status]
        data = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
        self.owner._count(self.command, self.headers.get("Range"), status, 0)  # before the client sees it
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _reset(self) -> None:
        """Abort the client connection with a TCP RST (SO_LINGER 0), not a clean close."""
        with contextlib.suppress(OSError):
            self.wfile.flush()
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.close()


# -- pytest fixtures (import them into a test module to use them) ------------------------------
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def s3_credentials():
    """Dummy AWS credentials in os.environ for the whole session (mount daemons inherit them)."""
    with dummy_credentials():
        yield DUMMY_ENV


@pytest.fixture(scope="session")
def moto_s3(s3_credentials) -> Iterator[Endpoint]:
    ep = start_moto()
    try:
        yield ep
    finally:
        ep.stop()


@pytest.fixture(scope="session")
def localbucket_s3(s3_credentials, tmp_path_factory) -> Iterator[Endpoint]:
    ep = start_localbucket(tmp_path_factory.mktemp("localbucket"))
    try:
        yield ep
    finally:
        ep.stop()


@pytest.fixture
def proxy_to(request):
    """``proxy_to(endpoint, **kw)`` -> a FaultProxy in front of it, closed after the test."""
    proxies: list[FaultProxy] = []

    def make(endpoint: Endpoint, **kw) -> FaultProxy:
        p = FaultProxy(endpoint.url, **kw)
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.close()
