"""GetObject by a presigned URL: the SDK signs once in a while, each ranged GET is one plain request.

Why: boto3's ``get_object`` costs about 2.4 ms of CPU a call on this machine (parameter checks,
endpoint rules, event hooks, signing, parsing the reply) — as much as receiving 8 MiB — and a mount
makes one call per small member it reads, or per 8 MiB part of a large one. Sent this way, a GET
costs about 0.5 ms. The SDK still does everything that needs knowing: it presigns the URL (its
endpoint rules, addressing style, access points, signer and refreshed credentials), and the request
goes out through the client's own HTTP session (its connection pool, proxies, CA bundle, timeouts).
``Range`` and ``If-Match`` travel as plain headers, which a presigned URL does not need signed.

URLs are signed with SigV4: botocore presigns S3 URLs with SigV2 in older regions, for backwards
compatibility, and buckets created since 2020 and most other stores refuse those. A URL is signed
again every REFRESH seconds (credentials from roles rotate, and a URL dies with the credentials that
signed it), and at once when the server refuses it. Refused twice in a row, the same request goes
through the SDK: if that succeeds (a store without query-string authentication, a redirect to the
bucket's region, which the SDK follows), the SDK serves this object's GETs from then on; if it fails
too, its error is the answer (access denied, archived object, clock skew...).

The URL's query string holds credentials: it never reaches a log (the SDK loggers are capped at INFO,
and :func:`hide_signature` scrubs messages built from exceptions that may quote it).
"""

from __future__ import annotations

import logging
import re
import threading
import time

log = logging.getLogger(__name__)

REFRESH = 300.0  # seconds a URL is used before it is signed again
EXPIRES = 3600  # seconds a URL is valid for (longer than REFRESH, so that one in use never expires)
# Replies that mean "not with this URL" (an expired or refused signature, a region redirect):
# signed again, then asked through the SDK.
REFUSED = frozenset({301, 302, 307, 400, 403})
ERROR_BODY_MAX = 64 << 10  # bytes of an error reply read to find its <Code>
_PARAMS = {"Range": "Range", "IfMatch": "If-Match"}  # get_object parameters sent as headers

_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_SIGNED_QUERY = re.compile(r"\?[^\s\"'<>]*(?:X-Amz-|AWSAccessKeyId=|Signature=)[^\s\"'<>]*")


def hide_signature(text: str) -> str:
    """``text`` with the query string of any presigned URL (or path) in it replaced."""
    return _SIGNED_QUERY.sub("?<signed query hidden>", text)


def _v4_query(signature_version=None, **_kwargs):
    """botocore ``choose-signer`` hook: presign with SigV4 where botocore's default is SigV2."""
    if signature_version in ("v4-query", "s3v4-query"):
        return "s3v4-query"
    return None


class PresignedGets:
    """``get_object(client, Range=..., IfMatch=...)`` for one object, by presigned URL when it works."""

    def __init__(self, bucket: str, key: str, user_agent: str) -> None:
        self._object = {"Bucket": bucket, "Key": key}
        self._user_agent = user_agent
        self._lock = threading.Lock()
        self._url: str | None = None
        self._signed_at = 0.0
        self.refused: str | None = None  # why the SDK serves every GET of this object (None: it does not)
        self.sent = 0  # GETs sent by presigned URL (for tests and stats)
        self.signed = 0  # URLs signed

    def after_fork(self) -> None:
        """In a forked child: a fresh lock (the parent's may have been held by a thread left behind)."""
        self._lock = threading.Lock()

    def get_object(self, client, **params) -> dict:
        """What ``client.get_object(Bucket=..., Key=..., **params)`` returns, or raises the same way."""
        session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        if self.refused is not None or session is None or not set(params) <= set(_PARAMS):
            return client.get_object(**self._object, **params)
        headers = {"User-Agent": self._user_agent}
        headers.update((_PARAMS[name], value) for name, value in params.items())
        status = 0
        for fresh in (False, True):
            url = self._url_for(client, fresh)
            reply, status = self._send(session, url, headers)
            if reply is not None:
                return reply
        reply = client.get_object(**self._object, **params)  # raises when the SDK is refused too
        self.refused = f"HTTP {status} to a presigned URL"
        log.info(
            "%s/%s: the server refuses presigned GETs (HTTP %d); using the SDK for every request",
            *self._object.values(),
            status,
        )
        return reply

    # -- internals ------------------------------------------------------------------------------
    def _url_for(self, client, fresh: bool) -> str:
        with self._lock:
            now = time.monotonic()
            if self._url is None or fresh or now - self._signed_at > REFRESH:
                client.meta.events.register_first(  # once per client: the id is unique
                    "choose-signer.s3.GetObject", _v4_query, unique_id="cdmlfs-presign-sigv4"
                )
                self._url = client.generate_presigned_url(
                    "get_object", Params=dict(self._object), ExpiresIn=EXPIRES
                )
                self._signed_at = now
                self.signed += 1
            return self._url

    def _send(self, session, url: str, headers: dict) -> tuple[dict | None, int]:
        """(reply, status): a get_object-shaped reply for 200/206, None for a refused URL; other
        statuses raise ClientError as the SDK would (same code, same HTTP status)."""
        from botocore.awsrequest import AWSPreparedRequest
        from botocore.response import StreamingBody

        resp = session.send(AWSPreparedRequest("GET", url, dict(headers), None, True))
        self.sent += 1
        raw = resp.raw
        status = resp.status_code
        if status in (200, 206):
            got = raw.headers
            length = got.get("Content-Length")
            n = int(length) if length is not None and length.isdigit() else None
            reply = {
                "ETag": got.get("ETag"),
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
        if status in REFUSED:
            return None, status
        from botocore.exceptions import ClientError

        m = _CODE.search(body or b"")
        code = m.group(1).decode("ascii", "replace") if m else str(status)
        error = {"Error": {"Code": code, "Message": ""}, "ResponseMetadata": {"HTTPStatusCode": status}}
        raise ClientError(error, "GetObject")
