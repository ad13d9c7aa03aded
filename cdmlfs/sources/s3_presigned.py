"""GetObject by a presigned URL: the SDK signs once in a while, each ranged GET is one plain request.

Why: boto3's ``get_object`` costs about 2.4 ms of CPU a call on this machine (parameter checks,
endpoint rules, event hooks, signing, parsing the reply) — as much as receiving 8 MiB — and a mount
makes one call per small member it reads, or per 8 MiB part of a large one. Sent this way, a GET
costs about 0.5 ms. The SDK still does everything that needs knowing: it presigns the URL (its
endpoint rules, addressing style, access points, signer and refreshed credentials), and the request
goes out through the client's own HTTP session (its connection pool, proxies, CA bundle, timeouts).
``Range`` and ``If-Match`` travel as plain headers, which a presigned URL does not need signed.

URLs are signed with SigV4 (:func:`prefer_sigv4`): botocore presigns S3 URLs with SigV2 in older
regions, for backwards compatibility, and buckets created since 2020 and most other stores refuse
those. A URL is signed again every REFRESH seconds (credentials from roles rotate, and a URL dies
with the credentials that signed it; botocore renews them 10 minutes before they expire at the
latest), by one thread while the others go on with the current URL, and at once when the server
refuses it. Refused again, the same request goes through the SDK: if that succeeds (a store without
query-string authentication, a redirect to the bucket's region, which the SDK follows), the SDK
serves this object's GETs for the next RETRY_AFTER seconds; if it fails too, its error is the answer
(access denied, archived object, clock skew...).

The URL's query string holds credentials. It never reaches a message or a log line:
:func:`hide_signature` scrubs what cdmlfs builds from exceptions, and :func:`guard_sdk_logs` keeps the
SDK's own loggers (urllib3 quotes the request target in some warnings) at INFO and scrubs them.
"""

from __future__ import annotations

import datetime
import email.utils
import logging
import re
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)

REFRESH = 300.0  # seconds a URL is used before it is signed again
SESSION_REFRESH = 60.0  # the same for S3 Express URLs (their session credentials last 5 minutes)
EXPIRES = 900  # seconds a URL is valid: well past REFRESH (a signing may be slow), short if it leaks
RETRY_AFTER = 600.0  # seconds the SDK serves an object whose server refused presigned URLs
ERROR_BODY_MAX = 64 << 10  # bytes of an error reply read to find its <Code>
# get_object parameters sent as headers
_PARAMS = {"Range": "Range", "IfMatch": "If-Match", "IfUnmodifiedSince": "If-Unmodified-Since"}
# Replies that mean what they would mean to the SDK (not found, replaced, out of range, slow down);
# any other 3xx/4xx, and 501, means "not with this URL": signed again, then asked through the SDK.
_MEANINGFUL_4XX = frozenset({404, 408, 412, 416, 429})

_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
# A presigned query is percent-encoded (botocore quotes all but -_.~): it ends at the first other
# character, so "(url=...?X-Amz-...): [Defect]" keeps its "): [Defect]".
_QUERY_CHARS = r"[A-Za-z0-9%&=._~+/:-]*"
_SIGNED_QUERY = re.compile(rf"\?{_QUERY_CHARS}(?:X-Amz-|AWSAccessKeyId=|Signature=){_QUERY_CHARS}")
SDK_LOGGER_PREFIXES = ("botocore", "boto3", "urllib3", "s3transfer")


def hide_signature(text: str) -> str:
    """``text`` with the query string of any presigned URL (or request target) in it replaced."""
    return _SIGNED_QUERY.sub("?<signed query hidden>", text)


def refused(status: int) -> bool:
    """Whether a reply's status refuses the URL rather than answering the request."""
    return 300 <= status < 400 or (400 <= status < 500 and status not in _MEANINGFUL_4XX) or status == 501


class _SdkLogGuard(logging.Filter):
    """On an SDK logger: drop records below INFO (signed headers, strings to sign, request targets
    with a signed query) whatever level is set later, and scrub signed queries from the rest.

    An exception a record carries is said in its one last line: urllib3 warned of each reply with a
    malformed header with a whole traceback (28 lines on stderr for one ``cdmlfs cat`` that read
    fine), in the terminal and in the mount's log.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO:
            return False
        try:
            message = record.getMessage()
        except Exception:  # a malformed SDK log call: never raise into the request that made it
            return False
        clean = hide_signature(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info:  # an exception's text may quote the URL as well
            last = "".join(traceback.format_exception_only(*record.exc_info[:2])).strip().splitlines()
            said = f"{record.getMessage()} ({last[-1]})"
            record.msg, record.args = hide_signature(said), ()
            record.exc_info = None
            record.exc_text = None
        return True


_GUARD = _SdkLogGuard()


def guard_sdk_logs() -> None:
    """Put the guard on every SDK logger there is (a filter applies only to the records its own
    logger emits, not to those its children pass up) and keep the top ones at INFO at least.
    Called again once a client exists: its modules' loggers are there by then."""
    names = [n for n in list(logging.Logger.manager.loggerDict) if n.split(".")[0] in SDK_LOGGER_PREFIXES]
    for name in {*names, *SDK_LOGGER_PREFIXES}:
        logger = logging.getLogger(name)
        if _GUARD not in logger.filters:
            logger.addFilter(_GUARD)
    for name in SDK_LOGGER_PREFIXES:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.INFO:
            logger.setLevel(logging.INFO)


def _v4_query(signature_version=None, **_kwargs):
    """botocore ``choose-signer`` hook: presign with SigV4 where botocore's default is SigV2."""
    if signature_version in ("v4-query", "s3v4-query"):
        return "s3v4-query"
    return None


def prefer_sigv4(client) -> None:
    """Make ``client`` presign GetObject URLs with SigV4 (ordinary requests are signed as before;
    SigV4A, S3 Express and an explicitly configured signature version are left alone). Called once,
    as the client is made: the SDK's event registry is not safe to change under a request."""
    client.meta.events.register_first(
        "choose-signer.s3.GetObject", _v4_query, unique_id="cdmlfs-presign-sigv4"
    )


class PresignedGets:
    """``get_object(client, Range=..., IfMatch=...)`` for one object, by presigned URL when it works."""

    def __init__(self, bucket: str, key: str, user_agent: str) -> None:
        self._object = {"Bucket": bucket, "Key": key}
        self._user_agent = user_agent
        self._lock = threading.Lock()
        self._url: str | None = None
        self._signed_at = 0.0
        self._signing = False  # a thread is signing a new URL (the others use the current one)
        self._sdk_until = 0.0  # monotonic time until which the SDK serves every GET
        self.refused: str | None = None  # why the SDK serves GETs now (None: presigned URLs do)
        self.sent = 0  # GETs sent by presigned URL (stats, tests)
        self.signed = 0  # URLs signed

    def after_fork(self) -> None:
        """In a forked child: a fresh lock (the parent's may have been held by a thread left behind)."""
        self._lock = threading.Lock()
        self._signing = False

    def get_object(self, client, *, stop: Callable[[], bool] | None = None, **params) -> dict:
        """What ``client.get_object(Bucket=..., Key=..., **params)`` returns, or raises the same way.

        ``stop()`` true: the caller gave up waiting, so no further request is made (the one under
        way, if any, ends as it will)."""
        session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        if session is None or not set(params) <= set(_PARAMS) or not self._presigning():
            return client.get_object(**self._object, **params)
        headers = {"User-Agent": self._user_agent}
        headers.update((_PARAMS[name], _header_value(value)) for name, value in params.items())
        url: str | None = None
        status = 0
        for _ in range(2):  # the current URL, then one signed afresh if that one was refused
            url = self._url_for(client, refused_url=url)
            reply, status = self._send(session, url, headers)
            if reply is not None:
                return reply
            if stop is not None and stop():
                raise _GivenUp
        reply = client.get_object(**self._object, **params)  # raises when the SDK is refused too
        self._use_sdk(status)
        return reply

    # -- internals ------------------------------------------------------------------------------
    def _presigning(self) -> bool:
        if not self._sdk_until:
            return True
        with self._lock:
            if self._sdk_until and time.monotonic() >= self._sdk_until:
                self._sdk_until, self.refused = 0.0, None  # the server may take them now: try again
            return not self._sdk_until

    def _use_sdk(self, status: int) -> None:
        with self._lock:
            first = not self._sdk_until
            self._sdk_until = time.monotonic() + RETRY_AFTER
            self.refused = f"HTTP {status} to a presigned URL"
        if first:
            log.info(
                "%s/%s: the server refuses presigned GETs (HTTP %d); the SDK makes every request for %d s",
                *self._object.values(),
                status,
                RETRY_AFTER,
            )

    def _url_for(self, client, refused_url: str | None = None) -> str:
        """The URL to use: signed afresh when none is current (or ``refused_url`` is the current
        one); when only due for its refresh while another thread signs, the current one."""
        with self._lock:
            url = self._url
            if refused_url is not None:
                if url is not None and url != refused_url:
                    return url  # another thread signed a new one meanwhile
            elif url is not None and time.monotonic() - self._signed_at <= self._refresh(url):
                return url
            elif url is not None and self._signing:
                return url  # still valid for minutes: not worth waiting for the signing under way
            self._signing = True
        try:
            # May refresh credentials (an STS call) — outside the lock, so that reads go on.
            new = client.generate_presigned_url("get_object", Params=dict(self._object), ExpiresIn=EXPIRES)
        finally:
            with self._lock:
                self._signing = False
        with self._lock:
            self._url, self._signed_at = new, time.monotonic()
            self.signed += 1
        return new

    @staticmethod
    def _refresh(url: str) -> float:
        return SESSION_REFRESH if "X-Amz-S3session-Token" in url else REFRESH

    def _send(self, session, url: str, headers: dict) -> tuple[dict | None, int]:
        """(reply, status): a get_object-shaped reply for 200/206, None for a refused URL; other
        statuses raise ClientError as the SDK would (same code, same HTTP status)."""
        from botocore.awsrequest import AWSPreparedRequest
        from botocore.response import StreamingBody

        resp = session.send(AWSPreparedRequest("GET", url, dict(headers), None, True))
        with self._lock:
            self.sent += 1
        raw = resp.raw
        status = resp.status_code
        if status in (200, 206):
            got = raw.headers
            length = got.get("Content-Length")
            n = int(length) if length is not None and length.isdigit() else None
            reply = {
                "ETag": got.get("ETag"),
                "LastModified": _http_date(got.get("Last-Modified")),
                "ContentRange": got.get("Content-Range"),
                "ContentLength": n,
                "Body": StreamingBody(raw, n),
            }
            return reply, status
        try:
            body = raw.read(ERROR_BODY_MAX)
        except Exception:  # an error reply cut short: its status says enough
            body = b""
        finally:
            raw.close()
        if refused(status):
            return None, status
        from botocore.exceptions import ClientError

        m = _CODE.search(body or b"")
        code = m.group(1).decode("ascii", "replace") if m else str(status)
        error = {"Error": {"Code": code, "Message": ""}, "ResponseMetadata": {"HTTPStatusCode": status}}
        raise ClientError(error, "GetObject")


def _header_value(value) -> str:
    """A get_object parameter as its header's text (dates as HTTP dates, as the SDK sends them)."""
    if isinstance(value, datetime.datetime):
        return email.utils.format_datetime(value.astimezone(datetime.timezone.utc), usegmt=True)
    return str(value)


def _http_date(text: str | None) -> datetime.datetime | None:
    """An HTTP date header as the SDK returns it (an aware datetime), None when absent or unreadable."""
    if not text:
        return None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        try:  # what the SDK would accept (ISO 8601, fractions of a second...)
            from botocore.utils import parse_timestamp

            when = parse_timestamp(text)
        except (TypeError, ValueError):
            return None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.timezone.utc)


class _GivenUp(Exception):
    """Raised in a request's own thread once its caller stopped waiting: nobody reads it."""
