"""Azure Blob Storage through the ``azure-storage-blob`` SDK (block blobs).

Shared-key and SAS signing are intricate and the SDK does them well, so this backend
uses it, with the SDK's own retries switched off (the store retries, store/retry.py) and one
pooled HTTP session sized for the configured concurrency.

A multipart upload is a set of staged blocks (``Put Block``) made visible at once by
``Put Block List``; the upload id is a random token folded into each block id. Nothing
exists server-side before the first block, and the service discards uncommitted
blocks after a week or at the blob's next commit. Every block and single put carries
its MD5 (or CRC64, with the SDK's checksum extension) for the service to check.
See docs/stores.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import (
    AccessDeniedError,
    AlreadyExistsError,
    BucketNotFoundError,
    CloudCkptError,
    ConfigError,
    CorruptCheckpointError,
    CredentialsError,
    NotFoundError,
    StorageError,
    ThrottledError,
    TransientError,
)
from ..options import check_text
from ..redact import redact_text
from .base import (
    MultipartUpload,
    ObjectInfo,
    Page,
    Store,
    UploadedPart,
    check_storage_options,
)
from .body import body_skip
from .endpoints import check_endpoint
from .environment import Held
from .status import error_for

__all__ = ["ACCESS_TIERS", "AZURE_OPTIONS", "AzureStore"]

#: Storage options the Azure backend understands (anything else is a ConfigError).
AZURE_OPTIONS = frozenset(
    {
        "connection_string",
        "account_name",
        "account_key",
        "sas_token",
        "account_url",
        "credential",
        "anonymous",
        "checksum",
        "encryption_scope",
        "access_tier",
    }
)
#: Access tiers the ``access_tier`` option may name.
ACCESS_TIERS = ("Hot", "Cool", "Cold", "Archive")

_MAX_BLOCK = 4000 * 1024 * 1024  # the service's largest block
_BLOCK_ID_DIGITS = 6  # block ids must all have the same length within a blob
#: Azure error codes whose meaning the status alone does not give (store/status.py).
_CODES: dict[str, type[CloudCkptError]] = {
    "ContainerNotFound": BucketNotFoundError,
    "BlobNotFound": NotFoundError,
    "BlobAlreadyExists": AlreadyExistsError,
    "ConditionNotMet": AlreadyExistsError,
    "InvalidRange": CorruptCheckpointError,
    **dict.fromkeys(
        ("AuthenticationFailed", "InvalidAuthenticationInfo", "NoAuthenticationInformation"),
        CredentialsError,
    ),
    **dict.fromkeys(("ServerBusy", "TooManyRequests"), ThrottledError),
    **dict.fromkeys(
        (
            "OperationTimedOut",
            "InternalError",
            # The body arrived damaged: sending it again is the fix.
            "Md5Mismatch",
            "Crc64Mismatch",
        ),
        TransientError,
    ),
}

try:
    import requests
    from azure.core.exceptions import (
        AzureError,
        ClientAuthenticationError,
        HttpResponseError,
        ServiceRequestError,
        ServiceResponseError,
    )
    from azure.core.pipeline.transport import RequestsTransport
    from azure.storage.blob import BlobBlock, BlobServiceClient, StandardBlobTier
    from requests.adapters import HTTPAdapter
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None


class AzureStore(Store):
    """One Azure Blob container (or one on Azurite)."""

    bound_small_requests = True  # a server may trickle its answers (base.py)

    def __init__(
        self,
        container: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        account: str | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        max_connections: int = 64,
        metadata_timeout: float | None = None,
    ) -> None:
        if _IMPORT_ERROR is not None:
            raise ConfigError(
                f"az:// URLs need the Azure extra ({_IMPORT_ERROR.name} is missing): "
                "pip install 'cloudckpt[azure]'"
            )
        opts = check_storage_options("Azure", storage_options or {}, AZURE_OPTIONS)
        checksum = opts.get("checksum", "md5")
        if checksum not in ("md5", "crc64", "none"):
            raise ConfigError(
                f"Azure storage option checksum must be 'md5', 'crc64' or 'none': {checksum!r}"
            )
        if checksum == "crc64":
            try:
                import azure.storage.extensions.checksums  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "Azure checksum='crc64' needs the SDK's checksum extension: "
                    "pip install 'azure-storage-blob[ext-checksums]'"
                ) from None
        # True is the SDK's long-standing spelling of MD5; "crc64" needs a recent SDK.
        self._validate: str | bool = {"none": False, "md5": True}.get(checksum, checksum)
        self.container = container
        self.root_url = f"az://{container}"
        # The one place the writes' object settings are chosen: the encryption scope goes
        # on every write (each block must name the scope its blob is committed with), the
        # tier on the requests that make a blob (Put Blob, Put Block List).
        self._scope: dict[str, Any] = {}
        if opts.get("encryption_scope") is not None:
            self._scope["encryption_scope"] = check_text(
                "Azure",
                "encryption_scope",
                opts["encryption_scope"],
                r"[A-Za-z0-9](?:[A-Za-z0-9-]{1,61}[A-Za-z0-9])",
                "an encryption scope name (3-63 letters, digits and hyphens)",
            )
        self._creating = dict(self._scope)
        tier = opts.get("access_tier")
        if tier is not None:
            if tier not in ACCESS_TIERS:
                raise ConfigError(
                    f"Azure storage option access_tier={tier!r} must be one of "
                    + ", ".join(ACCESS_TIERS)
                )
            self._creating["standard_blob_tier"] = StandardBlobTier(tier)
        # Requests with a small answer (properties, listings, deletes) wait less for it.
        self._quick: dict[str, Any] = {
            "read_timeout": min(metadata_timeout or read_timeout, read_timeout)
        }
        if opts.get("account_url"):
            check_endpoint(opts["account_url"], "the Azure account_url (storage option)")
        self._opts = opts
        self._account = account
        self._connection = (connect_timeout, read_timeout, max_connections)
        # Azure answers some credential failures with 403 AuthorizationFailure (Azurite
        # every bad signature, a SAS without the permission): a refusal too.
        self._held: Held[_Clients] = Held(
            "az",
            self._connect,
            lambda c: c.identity,
            refused=(CredentialsError, AccessDeniedError),
        )

    def follow_environment(self) -> None:
        """The clients made again now if the environment changed (a fresh open)."""
        self._held.current()

    def _connect(self) -> _Clients:
        """Clients from the storage options and, beneath them, the environment as it is
        now (``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_ACCOUNT``, ``_KEY``,
        ``_SAS_TOKEN``): made again when those change or after a credentials failure
        (store/environment.py ``Held``)."""
        connect_timeout, read_timeout, max_connections = self._connection
        session = requests.Session()
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=max_connections, max_retries=0)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        transport = RequestsTransport(
            session=session,
            session_owner=True,
            connection_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        kwargs: dict[str, Any] = {
            "transport": transport,
            "retry_total": 0,  # the store retries, not the SDK
            "max_single_put_size": 256 * 1024 * 1024,
            "max_single_get_size": 256 * 1024 * 1024,
            "max_chunk_get_size": 64 * 1024 * 1024,
        }
        try:
            service, identity = self._client(self._opts, self._account, kwargs)
        except ValueError as exc:  # malformed connection string, key or URL
            raise ConfigError(
                f"invalid Azure settings for {self.root_url}: {redact_text(str(exc))}"
            ) from None
        return _Clients(service, service.get_container_client(self.container), identity)

    def _client(
        self, opts: Mapping[str, Any], account: str | None, kwargs: dict[str, Any]
    ) -> tuple[BlobServiceClient, tuple[Any, ...]]:
        """A service client from storage options, else the standard environment
        variables, and who it acts as (the account URL and the kind of credential with a
        digest of a static one; never the secret itself)."""
        env = os.environ
        conn = opts.get("connection_string")
        explicit = any(
            k in opts for k in ("account_name", "account_key", "sas_token", "account_url")
        )
        if conn is None and not explicit and "credential" not in opts:
            conn = env.get("AZURE_STORAGE_CONNECTION_STRING")
        if conn:
            client = BlobServiceClient.from_connection_string(conn, **kwargs)
            return client, ("connection_string", _digest(conn))
        name = (
            opts.get("account_name")
            or account
            or env.get("AZURE_STORAGE_ACCOUNT_NAME")
            or env.get("AZURE_STORAGE_ACCOUNT")
        )
        url = opts.get("account_url") or (name and f"https://{name}.blob.core.windows.net")
        if not url:
            raise CredentialsError(
                f"no Azure account for {self.root_url}: set AZURE_STORAGE_CONNECTION_STRING, "
                "AZURE_STORAGE_ACCOUNT, or storage_options connection_string= / account_name="
            )
        # Each setting: storage options first, then the standard environment variable.
        key = opts.get("account_key") or env.get("AZURE_STORAGE_KEY")
        sas = opts.get("sas_token") or env.get("AZURE_STORAGE_SAS_TOKEN")
        credential: Any
        source: tuple[Any, ...]
        if opts.get("anonymous"):
            credential, source = None, ("anonymous",)
        elif opts.get("credential") is not None:
            credential, source = opts["credential"], ("storage_options",)
        elif opts.get("account_key") or (key and not opts.get("sas_token")):
            if not name:
                raise ConfigError(f"an Azure account key needs account_name ({self.root_url})")
            credential = {"account_name": name, "account_key": key}
            source = ("account_key", name, _digest(str(key)))
        elif sas:
            credential, source = str(sas), ("sas_token", _digest(str(sas)))
        else:  # refreshes itself
            credential, source = _default_credential(), ("default",)
        client = BlobServiceClient(account_url=str(url), credential=credential, **kwargs)
        return client, (str(url), *source)

    # -- error mapping ---------------------------------------------------------------------
    def _map_error(self, exc: Exception, key: str | None, op: str) -> Exception:
        where = self.url(key) if key is not None else self.root_url
        if isinstance(exc, HttpResponseError):
            raw = getattr(exc, "error_code", None) or ""
            code = str(getattr(raw, "value", raw))  # a StorageErrorCode enum or a str
            status = int(getattr(exc, "status_code", None) or 0)
            if status == 404 and key is None and code not in _CODES:
                code = "ContainerNotFound"
            if isinstance(exc, ClientAuthenticationError) and code not in _CODES:
                code = "AuthenticationFailed"
            return error_for(
                status,
                code,
                "",
                url=where,
                root_url=self.root_url,
                op=op,
                codes=_CODES,
                container="container",
            )
        if isinstance(exc, (ServiceRequestError, ServiceResponseError, ConnectionError)):
            return TransientError(f"{op} {where}: {type(exc).__name__}")
        if isinstance(exc, AzureError):
            return StorageError(f"{op} {where} failed: {type(exc).__name__}")
        return exc

    def _mapped(self, op: str, key: str | None, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``; failures come back as typed errors naming the URL."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            mapped = self._map_error(exc, key, op)
            if mapped is exc:
                raise
            raise mapped from None

    def _call(self, op: str, key: str | None, action: Callable[[Any], Any]) -> Any:
        """``action(container client)``, its failures typed. After a credentials failure
        the clients are made again from the environment; when they now act as someone
        else (a corrected key, another account or endpoint) the action runs once more
        with them."""
        return self._held.call(lambda made: self._mapped(op, key, action, made.container))

    # -- reads -----------------------------------------------------------------------------
    def _head(self, key: str) -> ObjectInfo:
        props = self._call(
            "head", key, lambda c: c.get_blob_client(key).get_blob_properties(**self._quick)
        )
        return _info(key, props)

    def _read_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> None:
        length = sum(len(v) for v in buffers)
        stream = self._call(
            "read",
            key,
            lambda c: c.get_blob_client(key).download_blob(
                offset=start, length=length, max_concurrency=1
            ),
        )
        total = getattr(getattr(stream, "properties", None), "size", None)
        if body_skip(self.url(key), start, length, stream.size, total):
            raise TransientError(f"reading {self.url(key)}: the range was not honoured")
        sink = _ScatterWriter(buffers)
        self._mapped("read", key, stream.readinto, sink)  # the body of the answer above
        if not sink.full:
            raise TransientError(f"reading {self.url(key)}: connection closed mid-body")

    def _list_page(self, prefix: str, token: Any) -> Page:
        def page(container: Any) -> Page:
            listing = container.list_blobs(name_starts_with=prefix, **self._quick)
            pages = listing.by_page(continuation_token=token)
            found = next(pages, None)
            if found is None:
                return [], None
            items = [_info(p.name, p) for p in found]
            return items, getattr(pages, "continuation_token", None) or None

        result: Page = self._call("list", prefix, page)
        return result

    # -- writes ----------------------------------------------------------------------------
    def _put(self, key: str, view: memoryview, if_none_match: bool) -> str | None:
        body = _body(view)
        made = self._call(
            "put",
            key,
            lambda c: c.get_blob_client(key).upload_blob(
                body,
                length=view.nbytes,
                overwrite=not if_none_match,
                validate_content=self._validate or None,
                max_concurrency=1,
                **self._creating,
            ),
        )
        return _made_etag(made)

    def _delete(self, key: str) -> None:
        with contextlib.suppress(NotFoundError):
            self._call(
                "delete",
                key,
                lambda c: c.get_blob_client(key).delete_blob(
                    delete_snapshots="include", **self._quick
                ),
            )

    def _create_multipart(self, key: str) -> MultipartUpload:
        # Nothing to create server-side: the id lives in the block ids.
        return MultipartUpload(key=key, upload_id=uuid.uuid4().hex)

    def _upload_part(
        self, upload: MultipartUpload, number: int, view: memoryview, offset: int
    ) -> UploadedPart:
        if view.nbytes > _MAX_BLOCK:
            raise ConfigError(
                f"part of {view.nbytes} bytes is above Azure's 4000 MiB block limit "
                f"({self.url(upload.key)}): lower part_size"
            )
        block_id = _block_id(upload.upload_id, number)
        body = _body(view)
        self._call(
            "upload part",
            upload.key,
            lambda c: c.get_blob_client(upload.key).stage_block(
                block_id,
                body,
                length=view.nbytes,
                validate_content=self._validate or None,
                **self._scope,
            ),
        )
        return UploadedPart(number=number, etag=block_id, size=view.nbytes)

    def _complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[UploadedPart]
    ) -> str | None:
        blocks = [BlobBlock(block_id=p.etag) for p in sorted(parts, key=lambda p: p.number)]
        made = self._call(
            "complete",
            upload.key,
            lambda c: c.get_blob_client(upload.key).commit_block_list(blocks, **self._creating),
        )
        return _made_etag(made)

    def _abort_multipart(self, upload: MultipartUpload) -> None:
        """Discard staged blocks where the service allows it.

        Azure has no call that drops uncommitted blocks. When no committed blob exists,
        committing an empty list (only if none exists) and deleting that empty blob
        (only if unchanged) drops them now; otherwise the service drops them at the
        blob's next commit or after seven days.
        """
        key = upload.key
        try:
            self._call(
                "abort",
                key,
                lambda c: c.get_blob_client(key).commit_block_list(
                    [], if_none_match="*", **self._scope
                ),
            )
        except (AlreadyExistsError, StorageError):
            return  # a committed blob is there: leave it alone
        with contextlib.suppress(NotFoundError, AlreadyExistsError, StorageError):
            props = self._call("abort", key, lambda c: c.get_blob_client(key).get_blob_properties())
            if props.size == 0:
                self._call(
                    "abort",
                    key,
                    lambda c: c.get_blob_client(key).delete_blob(
                        etag=props.etag, match_condition=_if_match()
                    ),
                )

    def _list_multipart(self, prefix: str) -> Iterator[MultipartUpload]:
        """Uploads staged to keys that have no committed blob yet (the service lists those)."""
        committed = {info.key for info in self._list_all(prefix)}
        names = self._call(
            "list uploads",
            prefix,
            lambda c: [
                p.name for p in c.list_blobs(name_starts_with=prefix, include=["uncommittedblobs"])
            ],
        )
        for key in [n for n in names if n not in committed]:

            def block_list(container: Any, key: str = key) -> Any:
                return container.get_blob_client(key).get_block_list("uncommitted")

            try:
                _, uncommitted = self._call("list uploads", key, block_list)
            except NotFoundError:
                continue
            ids = {_upload_of(b.id) for b in uncommitted}
            for upload_id in sorted(i for i in ids if i is not None):
                yield MultipartUpload(key=key, upload_id=upload_id)

    def close(self) -> None:
        self._held.made.service.close()


# ------------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _Clients:
    """What one set of settings made: the service and container clients and who they
    act as (the account URL, the kind of credential, a digest of a static one)."""

    service: Any
    container: Any
    identity: tuple[Any, ...]


def _digest(secret: str) -> str:
    """A digest standing for a secret in an identity (the secret itself is never kept)."""
    return hashlib.sha256(secret.encode()).hexdigest()


class _ScatterWriter:
    """A write-only stream that fills caller buffers in order (for the SDK's readinto)."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self._views = list(views)
        self._index = 0
        self._filled = 0

    @property
    def full(self) -> bool:
        return self._index >= len(self._views)

    def write(self, data: Any) -> int:
        src = memoryview(data).cast("B")
        done = 0
        while done < len(src):
            if self.full:
                raise CorruptCheckpointError("the store sent more bytes than were asked for")
            view = self._views[self._index]
            n = min(len(view) - self._filled, len(src) - done)
            view[self._filled : self._filled + n] = src[done : done + n]
            done += n
            self._filled += n
            if self._filled == len(view):
                self._index += 1
                self._filled = 0
        while not self.full and len(self._views[self._index]) == 0:
            self._index += 1
        return done

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        pass


def _default_credential() -> Any:
    """azure-identity's DefaultAzureCredential when installed, else anonymous access."""
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        return None
    return DefaultAzureCredential()


def _if_match() -> Any:
    from azure.core import MatchConditions

    return MatchConditions.IfNotModified


def _block_id(upload_id: str, number: int) -> str:
    return f"{upload_id}-{number:0{_BLOCK_ID_DIGITS}d}"


def _made_etag(made: Any) -> str | None:
    """The ETag of the blob an upload or block-list commit made (its answer's ``etag``),
    unquoted as :func:`_info` gives it."""
    etag = made.get("etag") if isinstance(made, dict) else None
    return (etag or "").strip('"') or None


def _upload_of(block_id: str) -> str | None:
    upload_id, sep, number = str(block_id).rpartition("-")
    ok = sep and len(upload_id) == 32 and number.isdigit() and len(number) == _BLOCK_ID_DIGITS
    return upload_id if ok else None


def _info(key: str, props: Any) -> ObjectInfo:
    modified = getattr(props, "last_modified", None)
    return ObjectInfo(
        key=key,
        size=int(props.size or 0),
        mtime=modified.timestamp() if modified is not None else None,
        etag=(getattr(props, "etag", None) or "").strip('"') or None,  # unquoted, as S3's
    )


def _body(view: memoryview) -> bytes:
    """The request body as ``bytes``: the SDK sends (and hashes) nothing else whole.

    Other buffers (an iterable to the SDK) cost one copy here; ``bytes`` go as they are.
    """
    if isinstance(view.obj, bytes) and len(view.obj) == view.nbytes:
        return view.obj
    return view.tobytes()
