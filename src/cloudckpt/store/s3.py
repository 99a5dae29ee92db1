"""S3 and S3-compatible stores through botocore's low-level client.

Why botocore and how it is configured is in docs/transport.md. In short: we need the
raw multipart calls (and listing of open uploads for gc), our own retry scheduler
(botocore's retries are switched off), no payload hashing (each record carries its
own CRC-32 inside the archive), and reads that land straight in tensor memory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import botocore.session
from botocore import UNSIGNED
from botocore.config import Config
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

from ..errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    CredentialsError,
    NotFoundError,
    StorageError,
    TransientError,
)
from .base import (
    Buffer,
    MultipartUpload,
    ObjectInfo,
    Store,
    UploadedPart,
    byte_view,
    check_key,
)
from .s3_signed_reads import SignedReads

__all__ = ["S3_OPTIONS", "S3Store"]

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
    }
)

_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
        "InvalidSecurity",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
    }
)
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: Connection refused/reset, timeouts, bodies cut short: retried by the scheduler.
_TRANSIENT_EXCEPTIONS = (
    HTTPClientError,
    BotoConnectionError,
    ResponseStreamingError,
    ConnectionError,
    TimeoutError,
)


class S3Store(Store):
    """One bucket on S3 or an S3-compatible server."""

    def __init__(
        self,
        bucket: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        max_connections: int = 64,
    ) -> None:
        opts = dict(storage_options or {})
        unknown = sorted(set(opts) - S3_OPTIONS)
        if unknown:
            raise ConfigError(
                f"unknown S3 storage option(s) {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(S3_OPTIONS))}"
            )
        self.bucket = bucket
        self.root_url = f"s3://{bucket}"
        endpoint = (
            opts.get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or (os.environ.get("AWS_ENDPOINT_URL"))
        )
        try:
            session = botocore.session.Session(profile=opts.get("profile_name"))
            region = (
                opts.get("region_name")
                or os.environ.get("AWS_REGION")
                or session.get_config_variable("region")
                or "us-east-1"
            )
        except ProfileNotFound as exc:
            raise CredentialsError(f"AWS profile for {self.root_url} not found: {exc}") from None
        config = Config(
            s3={
                "addressing_style": opts.get("addressing_style")
                or ("path" if endpoint else "auto"),
                "payload_signing_enabled": False,
            },
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"total_max_attempts": 1},  # the scheduler retries, not botocore
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
        self._client = session.create_client(
            "s3",
            region_name=region,
            endpoint_url=endpoint,
            aws_access_key_id=opts.get("aws_access_key_id"),
            aws_secret_access_key=opts.get("aws_secret_access_key"),
            aws_session_token=opts.get("aws_session_token"),
            verify=opts.get("verify"),
            config=config,
        )
        self._fast_reads = SignedReads(self._client, bucket)

    # -- error mapping -------------------------------------------------------------------
    def _error(self, exc: Exception, key: str | None, op: str) -> Exception:
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
            message = err.get("Message") or code
            if code == "NoSuchBucket":
                return BucketNotFoundError(f"bucket does not exist: {self.root_url} (for {url})")
            if code in ("NoSuchKey", "NotFound") or (status == 404 and code in ("404", "")):
                return NotFoundError(f"no such object: {url}")
            if code == "NoSuchUpload":
                return NotFoundError(f"no such multipart upload: {op} {url}")
            if code in _CREDENTIAL_CODES:
                return CredentialsError(f"credentials rejected for {url}: {code}")
            if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
                return AccessDeniedError(f"access denied: {op} {url} ({code or status})")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                return AlreadyExistsError(f"{url} already exists")
            if code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS:
                return TransientError(f"{op} {url}: {code or status} {message}")
            if code == "InvalidRange" or status == 416:
                return CorruptCheckpointError(f"{url} is shorter than the range being read")
            return StorageError(f"{op} {url} failed: {code or status}: {message}")
        if isinstance(exc, _TRANSIENT_EXCEPTIONS):
            return TransientError(f"{op} {url}: {type(exc).__name__}: {exc}")
        if isinstance(exc, BotoCoreError):
            return StorageError(f"{op} {url} failed: {exc}")
        return exc

    def _call(self, op: str, key: str | None, **kwargs: Any) -> Any:
        try:
            return getattr(self._client, op)(Bucket=self.bucket, **kwargs)
        except Exception as exc:
            mapped = self._error(exc, key, op)
            if mapped is exc:
                raise
            raise mapped from None

    # -- reads ---------------------------------------------------------------------------
    def head(self, key: str) -> ObjectInfo:
        check_key(key, self.root_url)
        try:
            resp = self._call("head_object", key, Key=key)
        except NotFoundError:
            # A HEAD 404 carries no error code: ask whether the bucket itself is missing.
            self._call("list_objects_v2", key, Prefix=key, MaxKeys=1)
            raise
        except AccessDeniedError:
            # A HEAD answer has no body, so a bare 403 cannot say whether the credentials
            # were rejected or lack permission; a one-byte GET returns the error code.
            self._call("get_object", key, Key=key, Range="bytes=0-0")["Body"].close()
            raise
        mtime = resp.get("LastModified")
        return ObjectInfo(
            key=key,
            size=int(resp["ContentLength"]),
            mtime=mtime.timestamp() if mtime is not None else None,
            etag=_etag(resp.get("ETag")),
        )

    def get(self, key: str) -> bytes:
        """A whole (small) object in one GET, not HEAD + GET: manifests are read this way."""
        check_key(key, self.root_url)
        resp = self._call("get_object", key, Key=key)
        stream = _stream(resp["Body"])
        with _reading(stream, self.url(key)):
            size = int(resp.get("ContentLength", -1))
            if size < 0:
                return bytes(stream.read())
            buf = bytearray(size)
            _read_body_into(stream, 0, [memoryview(buf)], self.url(key))
            return bytes(buf)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        buf = bytearray(end - start)
        self.read_into(key, start, [memoryview(buf)])
        return bytes(buf)

    def read_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> None:
        check_key(key, self.root_url)
        length = sum(b.nbytes for b in buffers)
        if length == 0:
            return
        url = self.url(key)
        answer = None
        if self._fast_reads.enabled:  # the fast path: s3_signed_reads.py
            try:
                answer = self._fast_reads.get(key, start, length, url)
            except TransientError:
                raise
            except Exception as exc:
                mapped = self._error(exc, key, "get_object")
                if mapped is exc:
                    raise
                raise mapped from None
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
            skip = 0
            if got != length:
                # Some servers ignore the range and send the whole object with a 200 and no
                # Content-Range; take our slice of it. An object that ends before the range
                # is corrupt (truncated); any other short answer is a glitch worth a retry.
                total = _content_range_total(content_range)
                size = total if total is not None else got
                if total is None and got >= start + length:
                    skip = start
                elif size < start + length:
                    raise CorruptCheckpointError(
                        f"{url} ends at byte {size}, "
                        f"before the range {start}-{start + length - 1} being read"
                    )
                else:
                    raise TransientError(
                        f"reading {url}: asked for {length} bytes at {start}, "
                        f"the answer holds {got}"
                    )
            _read_body_into(stream, skip, buffers, url)
        if self._fast_reads.enabled:
            self._fast_reads.served(answer is not None)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            resp = self._call("list_objects_v2", prefix, **kwargs)
            for item in resp.get("Contents", ()):
                mtime = item.get("LastModified")
                yield ObjectInfo(
                    key=item["Key"],
                    size=int(item["Size"]),
                    mtime=mtime.timestamp() if mtime is not None else None,
                    etag=_etag(item.get("ETag")),
                )
            if not resp.get("IsTruncated"):
                return
            token = resp.get("NextContinuationToken")

    # -- writes --------------------------------------------------------------------------
    def put(self, key: str, data: Buffer, *, if_none_match: bool = False) -> None:
        check_key(key, self.root_url)
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        self._call("put_object", key, Key=key, Body=byte_view(data), **extra)

    def delete(self, key: str) -> None:
        check_key(key, self.root_url)
        self._call("delete_object", key, Key=key)

    def create_multipart(self, key: str) -> MultipartUpload:
        check_key(key, self.root_url)
        resp = self._call("create_multipart_upload", key, Key=key)
        return MultipartUpload(key=key, upload_id=resp["UploadId"])

    def upload_part(
        self, upload: MultipartUpload, number: int, data: Buffer, offset: int
    ) -> UploadedPart:
        return self._upload_part(upload, number, byte_view(data))

    def upload_part_views(
        self, upload: MultipartUpload, number: int, views: Sequence[memoryview], offset: int
    ) -> UploadedPart:
        """The views sent one after another on the connection (urllib3 sends an iterable
        body chunk by chunk after the Content-Length botocore takes from ``len``)."""
        return self._upload_part(upload, number, _Views(views))

    def _upload_part(self, upload: MultipartUpload, number: int, body: Any) -> UploadedPart:
        resp = self._call(
            "upload_part",
            upload.key,
            Key=upload.key,
            UploadId=upload.upload_id,
            PartNumber=number,
            Body=body,
        )
        return UploadedPart(number=number, etag=resp["ETag"], size=len(body))

    def complete_multipart(self, upload: MultipartUpload, parts: Sequence[UploadedPart]) -> None:
        try:
            self._call(
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
                found = self.head(upload.key).size
            except NotFoundError:
                found = -1
            if found != size:
                raise
            upload.backend = "completed-on-earlier-attempt"

    def abort_multipart(self, upload: MultipartUpload) -> None:
        # A 404 means the upload is already gone, which is what we wanted.
        with contextlib.suppress(NotFoundError):
            self._call(
                "abort_multipart_upload", upload.key, Key=upload.key, UploadId=upload.upload_id
            )

    def list_multipart(self, prefix: str) -> Iterator[MultipartUpload]:
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

    def close(self) -> None:
        self._client.close()


def _etag(value: str | None) -> str | None:
    """ETags without their quotes (servers differ: rclone quotes them in HEAD, not in LIST)."""
    return value.strip('"') if value else value


def _content_range_total(value: str | None) -> int | None:
    """The object size in a ``Content-Range: bytes a-b/total`` header, if given."""
    if not value or "/" not in value:
        return None
    total = value.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


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
    turn network errors into :class:`TransientError`, which the scheduler retries."""
    try:
        yield stream
    except _TRANSIENT_EXCEPTIONS as exc:
        stream.close()
        raise TransientError(f"reading {url}: {type(exc).__name__}: {exc}") from None
    except BaseException:
        stream.close()
        raise


def _read_body_into(stream: Any, skip: int, buffers: Sequence[memoryview], url: str) -> None:
    """Read a response body (a urllib3 response) into ``buffers`` without a copy.

    urllib3's own ``readinto`` reads into a temporary and copies; for an identity-encoded
    body we read from the underlying ``http.client`` response, which fills our memory
    straight from the socket. Other encodings take the copying path.
    """
    fp = getattr(stream, "_fp", None)
    encoding = (getattr(stream, "headers", None) or {}).get("content-encoding", "identity")
    direct = fp is not None and hasattr(fp, "readinto") and encoding in ("identity", "")
    if skip:
        _discard(stream, skip, url)
    for buf in buffers:
        view = byte_view(buf)
        filled = 0
        while filled < len(view):
            if direct and fp is not None:
                n = fp.readinto(view[filled:])
            else:
                chunk = stream.read(len(view) - filled)
                n = len(chunk)
                view[filled : filled + n] = chunk
            if not n:
                raise TransientError(f"reading {url}: connection closed mid-body")
            filled += n
    if skip:
        stream.close()  # the rest of a whole-object answer is not wanted: drop the connection
    elif direct and hasattr(stream, "release_conn"):
        # The body was read to its end: hand the connection back to the pool.
        stream.release_conn()


def _discard(stream: Any, n: int, url: str) -> None:
    while n:
        chunk = stream.read(min(n, 1 << 20))
        if not chunk:
            raise TransientError(f"reading {url}: connection closed mid-body")
        n -= len(chunk)
