"""Ranged GETs signed once per object and sent straight to the client's connection pool.

A ranged GET through the botocore client costs about 1 ms of client CPU whatever its
size (parameter handling, the event system, signing, response parsing), and a resharded
DCP load issues hundreds of them. Here each object's GET is signed once with SigV4 in
its headers (``host``, ``x-amz-date`` and ``x-amz-content-sha256``; the ``Range``
header is left unsigned, as presigned URLs leave it) by the client's own signer, so
with the credentials it refreshes; the signature is reused for :data:`REUSE_SECONDS`,
well inside the 15 minutes S3 accepts after ``x-amz-date``. Every range is then a bare
``GET`` on the client's pool (its TLS and timeout settings): about 0.3 ms. A presigned
URL costs more, since urllib3 re-encodes its long query twice per request; signing
every request costs more still. Without a proxy the request goes straight to the
pool's ``urlopen``; through one it takes botocore's HTTP session, which knows how to
address it. Measured in docs/transport.md.

Only answers with a body are handled here. Throttling and server errors become
:class:`~cloudckpt.errors.TransientError` (retried by the store, never doubled), as
does any refusal whose error document is cut short (the connection broke);
any other refusal returns None and the caller repeats the request through the client,
which refreshes credentials, follows redirects and names the error precisely. After
:data:`MAX_MISSES` refusals in a row that the client then served, the fast path is
turned off for the store (a server that wants something this path does not send).

The signed headers (an SSE-C key among them) are never logged nor put into error
messages; URLs carry no secret.
"""

from __future__ import annotations

import http.client
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from botocore import UNSIGNED
from botocore.awsrequest import AWSRequest
from urllib3.exceptions import HTTPError as URLLib3Error
from urllib3.util import Url, parse_url
from urllib3.util.retry import Retry

from ..errors import ThrottledError, TransientError
from ..redact import redact_text
from .status import TRANSIENT_STATUS

__all__ = ["MAX_MISSES", "REUSE_SECONDS", "SignedReads"]

#: A signature is reused this long after signing (S3 accepts it for 15 minutes; temporary
#: credentials may end it sooner: then the server refuses it and the request goes
#: through the client, which refreshes them).
REUSE_SECONDS = 300
#: Refusals in a row, each then served by the client, that turn the fast path off.
MAX_MISSES = 3
#: Cached signatures per store, at most (one per object read recently).
_MAX_CACHED = 4096
#: The store retries; urllib3 must not (a Retry object is immutable, so shared).
_NO_RETRIES = Retry(False)


class SignedReads:
    """The fast path of one S3 store's ranged reads."""

    def __init__(self, client: Any, bucket: str, headers: Mapping[str, str] | None = None) -> None:
        """``headers``: what every GET of the store carries beyond its signature (an SSE-C
        key, requester-pays), signed with it; the client's GETs take the same."""
        self._client = client
        self._bucket = bucket
        self._extra = dict(headers or {})
        meta = client.meta
        self._region = meta.region_name or "us-east-1"
        self._service = meta.service_model.signing_name
        self._signed = meta.config.signature_version is not UNSIGNED
        # botocore keeps the client's HTTP session here (a URLLib3Session: its pools, TLS,
        # proxy and timeout settings) and its signer there. Without them, every read
        # takes the client path.
        self._http: Any = getattr(getattr(client, "_endpoint", None), "http_session", None)
        self._signer: Any = getattr(client, "_request_signer", None)
        self.enabled = callable(getattr(self._http, "send", None)) and (
            not self._signed or callable(getattr(self._signer, "get_auth_instance", None))
        )
        self._pools: Any = None  # the session's pool manager, when requests may skip it
        self._tls_set: weakref.WeakSet[Any] = weakref.WeakSet()  # pools given its TLS settings
        if self.enabled:
            proxies: Any = getattr(self._http, "_proxy_config", None)
            manager = getattr(self._http, "_get_connection_manager", None)
            if (
                callable(getattr(proxies, "proxy_url_for", None))
                and callable(manager)
                and callable(getattr(self._http, "_setup_ssl_cert", None))
                and not proxies.proxy_url_for(meta.endpoint_url)
            ):
                self._pools = manager(meta.endpoint_url, None)
        self._signatures: dict[str, tuple[float, Url, dict[str, str]]] = {}
        self._lock = threading.Lock()
        self._misses = 0

    def _signed_get(self, key: str) -> tuple[Url, dict[str, str]]:
        """The object's URL (as the client addresses it) and the headers of a signed GET."""
        now = time.monotonic()
        with self._lock:
            hit = self._signatures.get(key)
        if hit is not None and now - hit[0] < REUSE_SECONDS:
            return hit[1], hit[2]
        presigned: str = self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self._bucket, "Key": key}, ExpiresIn=60
        )
        url = presigned.split("?", 1)[0]  # endpoint, addressing style, quoted key
        headers = dict(self._extra)
        if self._signed:
            request = AWSRequest(method="GET", url=url, headers=dict(self._extra))
            self._signer.get_auth_instance(self._service, self._region, "s3v4").add_auth(request)
            headers = {name: str(value) for name, value in request.headers.items()}
        parsed = parse_url(url)
        with self._lock:
            if len(self._signatures) >= _MAX_CACHED:
                self._signatures.clear()
            self._signatures[key] = (now, parsed, headers)
        return parsed, headers

    def get(self, key: str, start: int, length: int, where: str) -> Any | None:
        """The answer (a urllib3 response, its body not read) to a GET of ``length`` bytes
        at ``start``, or None when the client should make the request instead.

        ``where`` (the object's ``s3://`` URL) names it in errors.
        """
        url, signed = self._signed_get(key)
        headers = {**signed, "Range": f"bytes={start}-{start + length - 1}"}
        try:
            if self._pools is not None:
                answer = self._direct(url, headers)
            else:
                request = AWSRequest(method="GET", url=url.url, headers=headers).prepare()
                request.stream_output = True
                answer = self._http.send(request).raw
        except URLLib3Error as exc:
            raise TransientError(
                f"reading {where}: {type(exc).__name__}: {redact_text(str(exc))}"
            ) from None
        status = answer.status
        if status in (200, 206):
            return answer
        with self._lock:
            self._signatures.pop(key, None)
        try:
            answer.read()  # the short error document: read it so the connection is reused
            answer.release_conn()
        except (URLLib3Error, http.client.HTTPException, OSError) as exc:
            # Cut short (or reset): the answer cannot be trusted, the connection is
            # unusable; a retryable failure, whatever the status said.
            answer.close()
            cause = f"{type(exc).__name__}: {redact_text(str(exc))}"
            if status in (429, 503):
                raise ThrottledError(
                    f"reading {where}: the server answered {status} (SlowDown), its error "
                    f"document cut short ({cause})"
                ) from None
            raise TransientError(
                f"reading {where}: the server answered {status}, its error document cut "
                f"short ({cause})"
            ) from None
        if status in (429, 503):  # S3's SlowDown (its error document is not parsed here)
            raise ThrottledError(f"reading {where}: the server answered {status} (SlowDown)")
        if status in TRANSIENT_STATUS:
            raise TransientError(f"reading {where}: the server answered {status}")
        return None

    def _direct(self, url: Url, headers: dict[str, str]) -> Any:
        """Send the GET on the session's pool for the URL's host, as the session would."""
        pool = self._pools.connection_from_host(url.host, url.port, url.scheme)
        if pool not in self._tls_set:
            self._http._setup_ssl_cert(pool, url.url, getattr(self._http, "_verify", True))
            self._tls_set.add(pool)
        return pool.urlopen(
            "GET",
            url.request_uri,
            headers=headers,
            retries=_NO_RETRIES,
            assert_same_host=False,
            preload_content=False,
            decode_content=False,
            enforce_content_length=False,
        )

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
