"""S3 and S3-compatible stores through botocore's low-level client.

Why botocore and how it is configured is in docs/transport.md. In short: we need the
raw multipart calls (and listing of open uploads for gc), our own retries
(store/retry.py; botocore's are switched off), no payload hashing (each record carries its
own CRC-32 inside the archive), and reads that land straight in tensor memory.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import copy
import hashlib
import http.client
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import botocore.session
from botocore import UNSIGNED
from botocore.config import Config
from botocore.credentials import RefreshableCredentials
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
    ResponseStreamingError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)
from urllib3.exceptions import HTTPError as URLLib3Error

from ..errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    CloudCkptError,
    ConfigError,
    CorruptCheckpointError,
    CredentialsError,
    InvalidURLError,
    NotFoundError,
    StorageError,
    ThrottledError,
    TransientError,
)
from ..options import check_flag, check_text
from ..redact import redact_text
from .base import (
    MultipartUpload,
    ObjectInfo,
    Page,
    Store,
    UploadedPart,
    byte_view,
    check_storage_options,
)
from .body import body_skip, content_range_total, read_body_into
from .endpoints import check_endpoint
from .environment import Held
from .s3_signed_reads import SignedReads
from .status import error_for

__all__ = ["S3_OPTIONS", "SSE_ALGORITHMS", "S3Store", "check_bucket_name"]

#: Storage options the S3 backend understands (anything else is a ConfigError).
S3_OPTIONS = frozenset(
    {
        "endpoint_url",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "region_name",
        "profile_name",
        "anonymous",
        "addressing_style",
        "verify",
        *(
            "sse",
            "sse_kms_key_id",
            "sse_bucket_key",
            "sse_customer_key",
            "storage_class",
            "tags",
            "requester_pays",
        ),
    }
)
#: Server-side encryption the ``sse`` option may name.
SSE_ALGORITHMS = ("AES256", "aws:kms", "aws:kms:dsse")
#: The requests that create an object: they carry encryption, storage class and tags.
_CREATING = ("put_object", "create_multipart_upload")
#: The requests that read or add to an SSE-C object: they carry its key again.
_SSE_C_OPS = ("upload_part", "complete_multipart_upload", "head_object", "get_object")
#: Every request the store makes (requester-pays goes on each).
_ALL_OPS = (
    *_CREATING,
    *_SSE_C_OPS,
    "abort_multipart_upload",
    "delete_object",
    "list_objects_v2",
    "list_multipart_uploads",
)

#: S3 error codes whose meaning the status alone does not give (store/status.py).
_CODES: dict[str, type[CloudCkptError]] = {
    "NoSuchBucket": BucketNotFoundError,
    "NoSuchKey": NotFoundError,
    "NotFound": NotFoundError,
    "AccessDenied": AccessDeniedError,
    "AllAccessDisabled": AccessDeniedError,
    "PreconditionFailed": AlreadyExistsError,
    "ConditionalRequestConflict": AlreadyExistsError,
    "InvalidRange": CorruptCheckpointError,
    **dict.fromkeys(
        (
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ExpiredToken",
            "InvalidToken",
            "TokenRefreshRequired",
            "AuthorizationHeaderMalformed",
            "InvalidSecurity",
        ),
        CredentialsError,
    ),
    **dict.fromkeys(
        (
            "SlowDown",
            "Throttling",
            "ThrottlingException",
            "RequestLimitExceeded",
            "TooManyRequests",
            "503",  # a HEAD answer has no body: botocore gives the status as its code
        ),
        ThrottledError,
    ),
    **dict.fromkeys(
        (
            "RequestTimeout",
            "RequestTimeTooSkewed",
            "InternalError",
            "ServiceUnavailable",
        ),
        TransientError,
    ),
}
#: Connection refused/reset, timeouts, bodies cut short: retried by the store.
_TRANSIENT_EXCEPTIONS = (
    HTTPClientError,
    BotoConnectionError,
    ResponseStreamingError,
    ConnectionError,
    TimeoutError,
    # What a body read straight from urllib3 (s3_signed_reads.py, _stream) raises when
    # it is cut short or the connection breaks: ProtocolError(IncompleteRead), ...
    URLLib3Error,
    http.client.HTTPException,
)


#: The client calls whose answers are small (metadata, listings, markers, creating or
#: ending an upload): they wait at most ``metadata_timeout`` for an answer. Data
#: transfers (ranged GETs, puts, parts) and the completion of an upload (which S3 may
#: take a while to answer for a large object) keep ``request_timeout``.
_QUICK_OPS = frozenset(
    {
        "head_object",
        "list_objects_v2",
        "list_multipart_uploads",
        "delete_object",
        "create_multipart_upload",
        "abort_multipart_upload",
    }
)


@dataclass(frozen=True)
class _Clients:
    """What one set of settings made: the data and metadata clients, the fast reads and
    who they act as (endpoint, region, the source and a digest of the credentials; never
    the credentials themselves). Held by the store (store/environment.py ``Held``): made
    again when the AWS variables change and after a credentials failure."""

    data: Any
    quick: Any
    fast: SignedReads
    identity: tuple[Any, ...]


class S3Store(Store):
    """One bucket on S3 or an S3-compatible server."""

    bound_small_requests = True  # a server may trickle its answers (base.py)

    def __init__(
        self,
        bucket: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        max_connections: int = 64,
        metadata_timeout: float | None = None,
    ) -> None:
        opts = check_storage_options("S3", storage_options or {}, S3_OPTIONS)
        self.bucket = check_bucket_name(bucket)
        self.root_url = f"s3://{bucket}"
        #: Parameters each kind of request adds (encryption, class, tags, payer): the one
        #: place they are chosen; ``_call`` adds them to every request of that kind.
        self._params = _request_params(opts)
        self._sse_c = "sse_customer_key" in opts
        timeouts = (connect_timeout, read_timeout, metadata_timeout or read_timeout)
        self._timeouts = timeouts  # a body's read is bounded by them too (body.py)
        self._holder: Held[_Clients] = Held(
            "s3",
            lambda: _make_clients(
                bucket, opts, self.root_url, timeouts, max_connections, self._params
            ),
            lambda made: made.identity,
        )

    def follow_environment(self) -> None:
        """The clients made again now if the environment changed (a fresh open)."""
        self._holder.current()

    @property
    def _client(self) -> Any:
        """The client of data transfers, as the environment has it now."""
        return self._holder.get().data

    @property
    def _fast_reads(self) -> SignedReads:
        return self._holder.get().fast

    # -- error mapping -------------------------------------------------------------------
    def _map_error(self, exc: Exception, key: str | None, op: str) -> Exception:
        """Translate a botocore failure into a typed error naming the URL (never secrets)."""
        url = self.url(key) if key is not None else self.root_url
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return CredentialsError(
                f"no usable AWS credentials for {url}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or storage_options"
            )
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code == "NoSuchUpload":
                return NotFoundError(f"no such multipart upload: {op} {url}")
            if status == 400 and op in ("head_object", "get_object") and not self._sse_c:
                # S3's answer to a read of an SSE-C object without its key (a HEAD's has
                # no body, so the code alone cannot say).
                return StorageError(
                    f"{op} {url} failed: {code or status} (an object written with SSE-C "
                    "reads only with the same sse_customer_key storage option)"
                )
            return error_for(
                status,
                code,
                str(err.get("Message") or ""),
                url=url,
                root_url=self.root_url,
                op=op,
                codes=_CODES,
            )
        if isinstance(exc, _TRANSIENT_EXCEPTIONS):
            return TransientError(f"{op} {url}: {type(exc).__name__}: {redact_text(str(exc))}")
        if isinstance(exc, BotoCoreError):
            return StorageError(f"{op} {url} failed: {redact_text(str(exc))}")
        return exc

    def _call(self, op: str, key: str | None, *, quick: bool | None = None, **kwargs: Any) -> Any:
        """One client call; failures come back as typed errors (the primitives need them).

        ``quick``: a request with a small answer, sent through the client that waits
        ``metadata_timeout`` for it (default: by ``op``). A credentials failure makes
        the clients again from the environment and the shared files; when they then act
        as someone else (rotated keys, a corrected secret, another endpoint), the call
        is made once more with them."""
        return self._holder.call(lambda made: self._send(made, op, key, quick, kwargs))

    def _send(
        self, made: _Clients, op: str, key: str | None, quick: bool | None, kwargs: dict[str, Any]
    ) -> Any:
        client = made.quick if (op in _QUICK_OPS if quick is None else quick) else made.data
        try:
            extra = self._params.get(op, {})  # bucket-level calls take none
            return getattr(client, op)(Bucket=self.bucket, **extra, **kwargs)
        except Exception as exc:
            mapped = self._map_error(exc, key, op)
            if mapped is exc:
                raise
            raise mapped from None

    # -- reads ---------------------------------------------------------------------------
    def _head(self, key: str) -> ObjectInfo:
        try:
            resp = self._call("head_object", key, Key=key)
        except NotFoundError:
            # A HEAD 404 carries no error code: ask whether the bucket itself is missing.
            self._call("list_objects_v2", key, Prefix=key, MaxKeys=1)
            raise
        except AccessDeniedError:
            # A HEAD answer has no body, so a bare 403 cannot say whether the credentials
            # were rejected or lack permission; a one-byte GET returns the error code.
            self._call("get_object", key, quick=True, Key=key, Range="bytes=0-0")["Body"].close()
            raise
        mtime = resp.get("LastModified")
        return ObjectInfo(
            key=key,
            size=int(resp["ContentLength"]),
            mtime=mtime.timestamp() if mtime is not None else None,
            etag=_etag(resp.get("ETag")),
        )

    def _get(self, key: str) -> bytes:
        """A whole (small) object in one GET, not HEAD + GET: manifests are read this way."""
        resp = self._call("get_object", key, quick=True, Key=key)
        stream = _stream(resp["Body"])
        with _reading(stream, self.url(key)):
            size = int(resp.get("ContentLength", -1))
            if size < 0:
                return bytes(stream.read())
            buf = bytearray(size)
            read_body_into(stream, 0, [memoryview(buf)], self.url(key), stall=self._timeouts[2])
            return bytes(buf)

    def _read_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> None:
        length = sum(b.nbytes for b in buffers)
        url = self.url(key)
        answer = None
        fast = self._holder.get().fast
        if fast.enabled:  # the fast path: s3_signed_reads.py
            answer = fast.get(key, start, length, url)
        if answer is not None:
            headers = answer.headers
            stream = answer
            got = int(headers.get("content-length", -1))
            content_range = headers.get("content-range")
        else:
            resp = self._call(
                "get_object", key, Key=key, Range=f"bytes={start}-{start + length - 1}"
            )
            stream = _stream(resp["Body"])
            got = int(resp.get("ContentLength", -1))
            content_range = resp.get("ContentRange")
        with _reading(stream, url):
            skip = body_skip(url, start, length, got, content_range_total(content_range))
            read_body_into(stream, skip, buffers, url, stall=self._timeouts[1])
        if fast.enabled:
            fast.served(answer is not None)

    def _list_page(self, prefix: str, token: Any) -> Page:
        kwargs: dict[str, Any] = {"Prefix": prefix}
        if token:
            kwargs["ContinuationToken"] = token
        resp = self._call("list_objects_v2", prefix, **kwargs)
        items = []
        for item in resp.get("Contents", ()):
            mtime = item.get("LastModified")
            items.append(
                ObjectInfo(
                    key=item["Key"],
                    size=int(item["Size"]),
                    mtime=mtime.timestamp() if mtime is not None else None,
                    etag=_etag(item.get("ETag")),
                )
            )
        more = resp.get("IsTruncated") and resp.get("NextContinuationToken")
        return items, more or None

    # -- writes --------------------------------------------------------------------------
    def _put(self, key: str, data: memoryview, if_none_match: bool) -> str | None:
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if if_none_match else {}
        resp = self._call("put_object", key, Key=key, Body=data, **extra)
        return _etag(resp.get("ETag"))

    def _delete(self, key: str) -> None:
        self._call("delete_object", key, Key=key)

    def _create_multipart(self, key: str) -> MultipartUpload:
        resp = self._call("create_multipart_upload", key, Key=key)
        return MultipartUpload(key=key, upload_id=resp["UploadId"])

    def _upload_part(
        self, upload: MultipartUpload, number: int, data: memoryview, offset: int
    ) -> UploadedPart:
        return self._send_part(upload, number, data)

    def _upload_part_views(
        self, upload: MultipartUpload, number: int, views: Sequence[memoryview], offset: int
    ) -> UploadedPart:
        """The views sent one after another on the connection (urllib3 sends an iterable
        body chunk by chunk after the Content-Length botocore takes from ``len``)."""
        return self._send_part(upload, number, _Views(views))

    def _send_part(self, upload: MultipartUpload, number: int, body: Any) -> UploadedPart:
        resp = self._call(
            "upload_part",
            upload.key,
            Key=upload.key,
            UploadId=upload.upload_id,
            PartNumber=number,
            Body=body,
        )
        return UploadedPart(number=number, etag=resp["ETag"], size=len(body))

    def _complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[UploadedPart]
    ) -> str | None:
        try:
            resp = self._call(
                "complete_multipart_upload",
                upload.key,
                Key=upload.key,
                UploadId=upload.upload_id,
                MultipartUpload={
                    "Parts": [{"ETag": p.etag, "PartNumber": p.number} for p in parts]
                },
            )
        except NotFoundError:
            # A retry after a lost answer: the first attempt completed the upload, so the
            # upload id is gone. Accept it when the object is there with the right size.
            size = sum(p.size for p in parts)
            try:
                found = self._head(upload.key).size
            except NotFoundError:
                found = -1
            if found != size:
                raise
            upload.backend = "completed-on-earlier-attempt"
            return None  # whose ETag the listing shows is not known from here
        return _etag(resp.get("ETag"))

    def _abort_multipart(self, upload: MultipartUpload) -> None:
        # A 404 means the upload is already gone, which is what we wanted.
        with contextlib.suppress(NotFoundError):
            self._call(
                "abort_multipart_upload", upload.key, Key=upload.key, UploadId=upload.upload_id
            )

    def _list_multipart(self, prefix: str) -> Iterator[MultipartUpload]:
        kwargs: dict[str, Any] = {"Prefix": prefix}
        while True:
            try:
                resp = self._call("list_multipart_uploads", prefix, **kwargs)
            except NotFoundError:
                return  # rclone answers NoSuchUpload when there are none
            for item in resp.get("Uploads", ()):
                initiated = item.get("Initiated")
                yield MultipartUpload(
                    key=item["Key"],
                    upload_id=item["UploadId"],
                    initiated=initiated.timestamp() if initiated is not None else None,
                )
            if not resp.get("IsTruncated"):
                return
            kwargs["KeyMarker"] = resp.get("NextKeyMarker")
            kwargs["UploadIdMarker"] = resp.get("NextUploadIdMarker")

    # -- buckets -------------------------------------------------------------------------
    def create_bucket(self, bucket: str | None = None) -> None:
        """Create ``bucket`` (default: this store's) in the client's region with this
        store's client (``cloudckpt mb``; the local test servers make many buckets with
        one); :class:`AlreadyExistsError` if it is there already."""
        if bucket is not None and bucket != self.bucket:
            other = copy.copy(self)  # the same client, errors naming the other bucket
            other.bucket, other.root_url = check_bucket_name(bucket), f"s3://{bucket}"
            other.create_bucket()
            return
        check_bucket_name(self.bucket, creating=True)
        self._retrying("create bucket", "", self._create_bucket)

    def _create_bucket(self) -> None:
        # A HEAD first: us-east-1 (and moto) answer 200 to creating a bucket one owns.
        clients = self._holder.get()
        try:
            clients.quick.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if status != 404:
                raise
        else:
            raise AlreadyExistsError(f"bucket {self.root_url} already exists")
        region = clients.data.meta.region_name
        where = {"CreateBucketConfiguration": {"LocationConstraint": region}}
        try:
            clients.quick.create_bucket(
                Bucket=self.bucket, **({} if region in (None, "us-east-1") else where)
            )
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou"):
                raise AlreadyExistsError(
                    f"bucket {self.root_url} already exists (bucket names are global: "
                    "another account may own it)"
                ) from None
            raise

    def close(self) -> None:
        made = self._holder.made
        made.data.close()
        if made.quick is not made.data:
            made.quick.close()


def _endpoint(opts: Mapping[str, Any]) -> str | None:
    """The endpoint URL: the storage option, else ``AWS_ENDPOINT_URL_S3``, else
    ``AWS_ENDPOINT_URL``; checked (a ConfigError naming where it came from)."""
    for where, value in (
        ("the S3 endpoint_url (storage option, --endpoint-url)", opts.get("endpoint_url")),
        ("AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL_S3")),
        ("AWS_ENDPOINT_URL", os.environ.get("AWS_ENDPOINT_URL")),
    ):
        if value:
            return check_endpoint(value, where)
    return None


def _make_clients(
    bucket: str,
    opts: Mapping[str, Any],
    root_url: str,
    timeouts: tuple[float, float, float],
    max_connections: int,
    params: Mapping[str, Mapping[str, Any]],
) -> _Clients:
    """Clients from the storage options and, beneath them, the environment as it is now.

    ``timeouts``: connect, data read, metadata read (docs/configuration.md)."""
    endpoint = _endpoint(opts)
    connect_timeout, read_timeout, quick_timeout = timeouts
    try:
        session = botocore.session.Session(profile=opts.get("profile_name"))
        region = (
            opts.get("region_name")
            or os.environ.get("AWS_REGION")
            or session.get_config_variable("region")
            or "us-east-1"
        )
    except ProfileNotFound as exc:
        raise _no_profile(exc, opts, root_url) from None
    config = Config(
        s3={
            "addressing_style": opts.get("addressing_style") or ("path" if endpoint else "auto"),
            "payload_signing_enabled": False,
        },
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"total_max_attempts": 1},  # the store retries, not botocore
        max_pool_connections=max_connections,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        tcp_keepalive=True,
        # Validation rejects memoryview bodies; urllib3 sends them with one sendall and
        # no copy. Every call's parameters are built here, so nothing is lost.
        parameter_validation=False,
        # SigV4 for every request (also the fast reads of s3_signed_reads.py).
        signature_version=UNSIGNED if opts.get("anonymous") else "s3v4",
    )
    client_args = {
        "region_name": region,
        "endpoint_url": endpoint,
        "aws_access_key_id": opts.get("aws_access_key_id"),
        "aws_secret_access_key": opts.get("aws_secret_access_key"),
        "aws_session_token": opts.get("aws_session_token"),
        "verify": opts.get("verify"),
    }
    try:
        data = session.create_client("s3", config=config, **client_args)
        quick = data
        if quick_timeout < read_timeout:
            # A second pool whose requests wait less for their answer; the session's
            # credentials are resolved once, for both.
            quick_config = config.merge(Config(read_timeout=quick_timeout))
            quick = session.create_client("s3", config=quick_config, **client_args)
    except ProfileNotFound as exc:  # the region came from elsewhere: found here
        raise _no_profile(exc, opts, root_url) from None
    except ValueError as exc:  # botocore's "Invalid endpoint", a bad region name...
        raise ConfigError(f"invalid S3 settings for {root_url}: {redact_text(str(exc))}") from None
    fast = SignedReads(data, bucket, _read_headers(params))
    return _Clients(data, quick, fast, _identity(session, opts, endpoint, region))


def _no_profile(exc: ProfileNotFound, opts: Mapping[str, Any], root_url: str) -> ConfigError:
    """A ConfigError naming the AWS profile that is in no AWS config file, and where
    its name came from (``profile_name``/``--profile``, else ``AWS_PROFILE``)."""
    name = exc.kwargs.get("profile") or opts.get("profile_name") or os.environ.get("AWS_PROFILE")
    if opts.get("profile_name"):
        where = "the storage option profile_name (--profile)"
    elif os.environ.get("AWS_PROFILE"):
        where = "AWS_PROFILE"
    else:
        where = "AWS_DEFAULT_PROFILE"
    return ConfigError(
        f"AWS profile {name!r} (from {where}) is not in the AWS config or credentials "
        f"files (AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE, ~/.aws/): cannot open {root_url}"
    )


def _identity(
    session: Any, opts: Mapping[str, Any], endpoint: str | None, region: str
) -> tuple[Any, ...]:
    """Who requests act as: the endpoint, the region, and where the credentials came from
    with a digest of static ones (refreshing credentials renew themselves)."""
    if any(opts.get(k) for k in ("aws_access_key_id", "aws_secret_access_key")):
        return (endpoint, region, "storage_options")
    creds = session.get_credentials()  # resolved by create_client already: no new lookup
    if creds is None:
        return (endpoint, region, None)
    method = getattr(creds, "method", type(creds).__name__)
    if isinstance(creds, RefreshableCredentials):
        return (endpoint, region, method)
    secret = "\0".join(str(x) for x in (creds.access_key, creds.secret_key, creds.token))
    return (endpoint, region, method, hashlib.sha256(secret.encode()).hexdigest())


def _request_params(opts: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The parameters each client call adds for the object options in ``opts`` (checked
    here, each failure a ConfigError naming the option; never echoing the SSE-C key).

    Encryption, storage class and tags go where an object is created (PutObject,
    CreateMultipartUpload); an SSE-C key also on every part, completion, HEAD and GET;
    requester-pays on every request.
    """
    creating: dict[str, Any] = {}
    sse = opts.get("sse")
    if sse is not None and sse not in SSE_ALGORITHMS:
        raise ConfigError(
            f"S3 storage option sse={sse!r} must be one of {', '.join(SSE_ALGORITHMS)}"
        )
    kms_key = opts.get("sse_kms_key_id")
    bucket_key = opts.get("sse_bucket_key")
    if (kms_key is not None or bucket_key is not None) and sse not in ("aws:kms", "aws:kms:dsse"):
        given = "sse_kms_key_id" if kms_key is not None else "sse_bucket_key"
        raise ConfigError(f"S3 storage option {given} needs sse='aws:kms' or 'aws:kms:dsse'")
    if sse is not None:
        creating["ServerSideEncryption"] = sse
    if kms_key is not None:
        creating["SSEKMSKeyId"] = check_text(
            "S3", "sse_kms_key_id", kms_key, r"\S+", "a KMS key id, ARN or alias"
        )
    if bucket_key is not None:
        creating["BucketKeyEnabled"] = check_flag("S3", "sse_bucket_key", bucket_key)
    if opts.get("storage_class") is not None:
        creating["StorageClass"] = check_text(
            "S3",
            "storage_class",
            opts["storage_class"],
            r"[A-Z][A-Z0-9_]*",
            "an S3 storage class in capitals (STANDARD, STANDARD_IA, GLACIER_IR...)",
        )
    if opts.get("tags") is not None:
        creating["Tagging"] = _tagging(opts["tags"])
    customer: dict[str, Any] = {}
    if opts.get("sse_customer_key") is not None:
        if sse is not None:
            raise ConfigError("S3 storage options sse and sse_customer_key exclude each other")
        customer = _customer_key(opts["sse_customer_key"])
    payer = {"RequestPayer": "requester"} if _payer(opts) else {}
    params: dict[str, dict[str, Any]] = {op: dict(payer) for op in _ALL_OPS}
    for op in _CREATING:
        params[op].update(creating)
    for op in (*_CREATING, *_SSE_C_OPS):
        params[op].update(customer)
    return params


def _payer(opts: Mapping[str, Any]) -> bool:
    value = opts.get("requester_pays")
    return value is not None and check_flag("S3", "requester_pays", value)


def _customer_key(value: Any) -> dict[str, str]:
    """SSE-C parameters from a base64 256-bit key: algorithm, key and the key's MD5 (sent
    as they are: botocore then neither encodes nor logs raw key bytes)."""
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, (str, bytes)) else b""
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        # The value itself is a secret: the message names the option only.
        raise ConfigError("S3 storage option sse_customer_key must be a base64 32-byte key")
    return {
        "SSECustomerAlgorithm": "AES256",
        "SSECustomerKey": base64.b64encode(raw).decode("ascii"),
        "SSECustomerKeyMD5": base64.b64encode(hashlib.md5(raw).digest()).decode("ascii"),
    }


def _tagging(value: Any) -> str:
    """``tags`` (a mapping, or ``k=v&k2=v2``) as the URL-encoded ``x-amz-tagging`` value."""
    if isinstance(value, str):
        pairs = [part.partition("=") for part in value.split("&") if part]
        if any(not sep for _, sep, _ in pairs):
            raise ConfigError(f"S3 storage option tags={value!r} must be k=v&k2=v2 or a mapping")
        value = {k: v for k, _, v in pairs}
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(f"S3 storage option tags={value!r} must be k=v&k2=v2 or a mapping")
    tags = {str(k): "" if v is None else str(v) for k, v in value.items()}
    if len(tags) > 10 or any(not 0 < len(k) <= 128 or len(v) > 256 for k, v in tags.items()):
        raise ConfigError(
            "S3 storage option tags: at most 10 tags, keys of 1-128 and values of at most "
            "256 characters"
        )
    odd = sorted({c for text in (*tags, *tags.values()) for c in text if not _tag_char(c)})
    if odd:
        raise ConfigError(
            f"S3 storage option tags: S3 takes letters, digits, spaces and _.:/=+-@ in "
            f"tags, not {''.join(odd)!r}"
        )
    return urlencode(tags)


def _tag_char(c: str) -> bool:
    """Whether S3 accepts ``c`` in a tag's key or value."""
    return c.isalnum() or c.isspace() or c in "_.:/=+-@"


def _read_headers(params: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The headers a GET needs beyond its signature (SSE-C key, requester-pays), for the
    fast reads, from the same parameters the client's GETs take."""
    get = params["get_object"]
    names = {
        "SSECustomerAlgorithm": "x-amz-server-side-encryption-customer-algorithm",
        "SSECustomerKey": "x-amz-server-side-encryption-customer-key",
        "SSECustomerKeyMD5": "x-amz-server-side-encryption-customer-key-MD5",
        "RequestPayer": "x-amz-request-payer",
    }
    return {header: str(get[param]) for param, header in names.items() if param in get}


#: What botocore sends as a bucket (legacy names included); an ARN passes through.
_BUCKET_ANY = re.compile(r"[A-Za-z0-9._-]{1,255}")
#: A name a new bucket may take: 3-63 lowercase letters, digits, dots and hyphens,
#: starting and ending with a letter or digit.
_BUCKET_NEW = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def check_bucket_name(name: str, *, creating: bool = False) -> str:
    """``name`` if S3 could hold such a bucket (with ``creating``: if a new bucket may
    take it); otherwise :class:`InvalidURLError` saying the rule in one line."""
    if creating and not _BUCKET_NEW.fullmatch(name):
        raise InvalidURLError(
            f"invalid S3 bucket name {name!r}: a new bucket needs 3-63 lowercase letters, "
            "digits, dots and hyphens, starting and ending with a letter or digit"
        )
    if not (_BUCKET_ANY.fullmatch(name) or name.startswith("arn:")):
        raise InvalidURLError(
            f"invalid S3 bucket name {name!r}: bucket names are letters, digits, dots, "
            "hyphens and underscores (new ones: 3-63 lowercase letters, digits, dots, hyphens)"
        )
    return name


def _etag(value: str | None) -> str | None:
    """ETags without their quotes (servers differ: rclone quotes them in HEAD, not in LIST)."""
    return value.strip('"') if value else value


class _Views:
    """A request body of several buffers: its length, then its buffers in order."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = [byte_view(v) for v in views]
        self._length = sum(v.nbytes for v in self.views)

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[memoryview]:
        return iter([v for v in self.views if v.nbytes])


def _stream(body: Any) -> Any:
    """The urllib3 response under botocore's ``StreamingBody`` (the body itself if none)."""
    return getattr(body, "_raw_stream", body)


@contextlib.contextmanager
def _reading(stream: Any, url: str) -> Iterator[Any]:
    """Read a response body: on any failure close it (its connection is unusable) and
    turn network errors into :class:`TransientError`, which the store retries."""
    try:
        yield stream
    except _TRANSIENT_EXCEPTIONS as exc:
        stream.close()
        raise TransientError(
            f"reading {url}: {type(exc).__name__}: {redact_text(str(exc))}"
        ) from None
    except BaseException:
        stream.close()
        raise
