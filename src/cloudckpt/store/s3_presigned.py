"""Ranged GETs on presigned URLs: botocore signs once per object, not once per range.

A ranged GET through the botocore client costs about 1 ms of client CPU whatever its
size (parameter handling, the event system, signing, response parsing), and a resharded
DCP load issues hundreds of them. Here each object's GET is presigned once (SigV4 query
authentication, valid for :data:`PRESIGN_SECONDS`, reused for :data:`REUSE_SECONDS`)
and every range is sent on the client's own connection pool, so with its TLS, proxy and
timeout settings, with nothing but a ``Range`` header: about 0.4 ms. Measured in
docs/transport.md.

Only answers with a body are handled here. Throttling and server errors become
:class:`~cloudckpt.errors.TransientError` (retried by the scheduler, never doubled);
any other refusal returns None and the caller repeats the request through the client,
which refreshes credentials, follows redirects and names the error precisely. After
:data:`MAX_MISSES` refusals in a row that the client then served, the fast path is
turned off for the store (a server without query authentication, a bucket in another
region).

Presigned URLs carry a signature: they are never logged or put into error messages.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from botocore.awsrequest import AWSRequest

from ..errors import TransientError

__all__ = ["MAX_MISSES", "PRESIGN_SECONDS", "REUSE_SECONDS", "PresignedReads"]

#: Lifetime of a presigned URL (temporary credentials may end it sooner: then the
#: server refuses it and the request goes through the client, which refreshes them).
PRESIGN_SECONDS = 900
#: A URL is reused this long after signing, well inside its lifetime.
REUSE_SECONDS = 300
#: Refusals in a row, each then served by the client, that turn the fast path off.
MAX_MISSES = 3
#: Cached URLs per store, at most (one per object read recently).
_MAX_URLS = 4096
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


def strip_query(url: str) -> str:
    """``url`` without its query string (where a presigned URL keeps its signature)."""
    return url.split("?", 1)[0]


class PresignedReads:
    """The fast path of one S3 store's ranged reads."""

    def __init__(self, client: Any, bucket: str) -> None:
        self._client = client
        self._bucket = bucket
        # botocore keeps the client's HTTP session here (a URLLib3Session: its pool,
        # TLS, proxy and timeout settings). Without it, every read takes the client path.
        self._http: Any = getattr(getattr(client, "_endpoint", None), "http_session", None)
        self.enabled = callable(getattr(self._http, "send", None))
        self._urls: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()
        self._misses = 0

    def _url(self, key: str) -> str:
        now = time.monotonic()
        with self._lock:
            hit = self._urls.get(key)
        if hit is not None and now - hit[0] < REUSE_SECONDS:
            return hit[1]
        url: str = self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self._bucket, "Key": key}, ExpiresIn=PRESIGN_SECONDS
        )
        with self._lock:
            if len(self._urls) >= _MAX_URLS:
                self._urls.clear()
            self._urls[key] = (now, url)
        return url

    def get(self, key: str, start: int, length: int, where: str) -> Any | None:
        """The answer (an ``AWSResponse`` with a streamed body) to a GET of ``length``
        bytes at ``start``, or None when the client should make the request instead.

        ``where`` (the object's ``s3://`` URL) names it in errors. Network errors are
        raised with the presigned URL replaced by its unsigned part.
        """
        url = self._url(key)
        request = AWSRequest(
            method="GET", url=url, headers={"Range": f"bytes={start}-{start + length - 1}"}
        ).prepare()
        request.stream_output = True
        try:
            answer = self._http.send(request)
        except Exception as exc:
            exc.args = tuple(
                a.replace(url, strip_query(url)) if isinstance(a, str) else a for a in exc.args
            )
            if hasattr(exc, "kwargs"):  # botocore errors format their message from these
                exc.kwargs = {
                    k: strip_query(v) if isinstance(v, str) and v == url else v
                    for k, v in exc.kwargs.items()
                }
            raise
        status = answer.status_code
        if status in (200, 206):
            return answer
        answer.raw.read()  # the short error document: read it so the connection is reused
        answer.raw.release_conn()
        with self._lock:
            self._urls.pop(key, None)
        if status in _RETRY_STATUS:
            raise TransientError(f"reading {where}: the server answered {status}")
        return None

    def served(self, fast: bool) -> None:
        """Record who served a read: this path (``fast``) or, after a refusal, the client."""
        if fast and not self._misses:
            return
        with self._lock:
            if fast:
                self._misses = 0
                return
            self._misses += 1
            if self._misses >= MAX_MISSES:
                self.enabled = False
