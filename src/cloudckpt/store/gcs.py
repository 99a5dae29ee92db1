"""Google Cloud Storage through its JSON API, with google-auth for credentials.

Why not the ``google-cloud-storage`` SDK: its upload and download helpers copy every
byte at least once, hash on their own schedule and retry on their own; the handful of
JSON API calls a :class:`~cloudckpt.store.base.Store` needs is small, and going through
google-auth's ``AuthorizedSession`` keeps credentials standard (``GOOGLE_APPLICATION_
CREDENTIALS``, gcloud's application-default login, the metadata server) while bodies go
to the socket straight from caller memory and ranged reads land straight in it.

Multipart uploads are parallel part objects joined by ``compose`` (32 sources a call,
composed in a tree beyond that); parts live under :data:`UPLOADS_PREFIX` in the same
bucket until the upload completes or is aborted, which is also where
``list_multipart`` finds abandoned ones for gc. Every upload sends its CRC32C and
checks the one the service computed. See docs/stores.md.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

from ..errors import (
    AlreadyExistsError,
    BucketNotFoundError,
    ConfigError,
    CredentialsError,
    NotFoundError,
    StorageError,
    ThrottledError,
    TransientError,
)
from ..options import check_text
from ..redact import redact_text
from .base import (
    Buffer,
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
from .status import error_for

__all__ = ["GCS_OPTIONS", "UPLOADS_PREFIX", "GCSStore"]

#: Storage options the GCS backend understands (anything else is a ConfigError).
GCS_OPTIONS = frozenset(
    {
        "endpoint_url",
        "project",
        "credentials_file",
        "anonymous",
        "checksum",
        "verify",
        "kms_key_name",
        "storage_class",
    }
)

#: Where the parts of open multipart uploads live; ``list`` never shows this prefix.
UPLOADS_PREFIX = ".cloudckpt-uploads/"

_SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
_DEFAULT_ENDPOINT = "https://storage.googleapis.com"
_CRC_SLICE = 1 << 20
_COMPOSE_FANIN = 32  # the most sources one compose call accepts
_MARKER = "upload"  # name of the empty object that records an open upload
_PART = re.compile(r"part-(\d{5,})")
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")


def _missing_extra(exc: ImportError) -> ConfigError:
    return ConfigError(
        f"gs:// URLs need the GCS extra ({exc.name} is missing): pip install 'cloudckpt[gcs]'"
    )


try:
    import google_crc32c
    import requests
    from google.auth.credentials import AnonymousCredentials
    from google.auth.exceptions import DefaultCredentialsError, GoogleAuthError, TransportError
    from google.auth.transport.requests import AuthorizedSession
    from requests.adapters import HTTPAdapter
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None


class GCSStore(Store):
    """One Google Cloud Storage bucket (or one on an emulator)."""

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
        if _IMPORT_ERROR is not None:
            raise _missing_extra(_IMPORT_ERROR)
        opts = check_storage_options("GCS", storage_options or {}, GCS_OPTIONS)
        checksum = opts.get("checksum", "crc32c")
        if checksum not in ("crc32c", "none"):
            raise ConfigError(
                f"GCS storage option checksum must be 'crc32c' or 'none': {checksum!r}"
            )
        self.bucket = bucket
        self.root_url = f"gs://{bucket}"
        self._crc = checksum == "crc32c"
        # CMEK goes on every upload and compose (a policy requiring it covers the parts
        # too); the storage class only on the objects a caller sees, never on the parts,
        # which a colder class would bill for a minimum duration after their deletion.
        self._kms: dict[str, str] = {}
        if opts.get("kms_key_name") is not None:
            self._kms["kmsKeyName"] = check_text(
                "GCS",
                "kms_key_name",
                opts["kms_key_name"],
                r"projects/[^/\s]+/locations/[^/\s]+/keyRings/[^/\s]+/cryptoKeys/[^/\s]+",
                "projects/P/locations/L/keyRings/R/cryptoKeys/K",
            )
        self._class: dict[str, str] = {}
        if opts.get("storage_class") is not None:
            self._class["storageClass"] = check_text(
                "GCS",
                "storage_class",
                opts["storage_class"],
                r"[A-Z][A-Z_]*",
                "a GCS storage class in capitals (STANDARD, NEARLINE, COLDLINE, ARCHIVE)",
            )
        self._timeout = (connect_timeout, read_timeout)
        # Requests with a small answer (metadata, listings, deletes) wait less for it.
        self._quick = (connect_timeout, min(metadata_timeout or read_timeout, read_timeout))
        if opts.get("endpoint_url"):
            check_endpoint(
                opts["endpoint_url"], "the GCS endpoint_url (storage option, --endpoint-url)"
            )
        self._opts = opts
        self._max_connections = max_connections
        # Paths under the endpoint, which the environment may change (_connect).
        b = quote(bucket, safe="")
        self._bucket_api = f"/storage/v1/b/{b}"
        self._upload_api = f"/upload/storage/v1/b/{b}/o"
        self._download_api = f"/download/storage/v1/b/{b}/o"
        self._bucket_seen = False
        self._held: Held[_Connection] = Held("gs", self._connect, lambda c: c.identity)

    def follow_environment(self) -> None:
        """The clients made again now if the environment changed (a fresh open)."""
        self._held.current()

    def _connect(self) -> _Connection:
        """A session from the storage options and, beneath them, the environment as it
        is now (``STORAGE_EMULATOR_HOST``, ``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's
        application-default file): made again when those change or after a credentials
        failure (store/environment.py ``Held``)."""
        opts = self._opts
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        if emulator and "://" not in emulator:  # the Google libraries' convention: host:port
            emulator = f"http://{emulator}"
        endpoint = (opts.get("endpoint_url") or emulator or _DEFAULT_ENDPOINT).rstrip("/")
        # An emulator takes no credentials; so does a public bucket read anonymously.
        anonymous = bool(opts.get("anonymous")) or (
            bool(emulator) and not opts.get("endpoint_url") and "credentials_file" not in opts
        )
        session = AuthorizedSession(self._credentials(opts, anonymous))
        session.headers["Accept-Encoding"] = "identity"
        if opts.get("verify") is not None:
            session.verify = opts["verify"]
        pool = self._max_connections
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=pool, max_retries=0)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        return _Connection(session, endpoint, (endpoint, *_credentials_source(opts, anonymous)))

    def _credentials(self, opts: Mapping[str, Any], anonymous: bool) -> Any:
        """Credentials from storage options, else google-auth's standard search."""
        import google.auth

        if anonymous:
            return AnonymousCredentials()
        try:
            if opts.get("credentials_file"):
                return _credentials_from_file(os.fspath(opts["credentials_file"]))
            else:
                # GOOGLE_APPLICATION_CREDENTIALS, gcloud's ADC file, then the metadata server.
                creds, _ = google.auth.default(scopes=_SCOPES)
        except (DefaultCredentialsError, OSError, ValueError, KeyError) as exc:
            raise CredentialsError(
                f"no usable Google credentials for {self.root_url}: set "
                "GOOGLE_APPLICATION_CREDENTIALS, run `gcloud auth application-default login`, "
                "or pass storage_options credentials_file= (or anonymous=True for public "
                f"buckets): {type(exc).__name__}"
            ) from None
        return creds

    # -- requests and error mapping ---------------------------------------------------------
    def _object_path(self, key: str) -> str:
        return f"{self._bucket_api}/o/{quote(key, safe='')}"

    def _request(
        self, method: str, path: str, key: str | None, op: str, **kwargs: Any
    ) -> requests.Response:
        """One HTTP request to ``path`` under the endpoint; failures come back as typed
        errors naming the URL. After a credentials failure the session is made again
        from the environment and the credentials file; when it now acts as someone else
        (a rotated key file, another endpoint) the request is sent once more with it."""
        kwargs.setdefault("timeout", self._timeout)
        where = self.url(key) if key is not None else self.root_url

        def send(conn: _Connection) -> requests.Response:
            try:
                resp = conn.session.request(method, conn.endpoint + path, **kwargs)
            except (
                requests.ConnectionError,
                requests.Timeout,
                requests.exceptions.ChunkedEncodingError,  # an answer cut short
                TransportError,
            ) as exc:
                raise TransientError(f"{op} {where}: {type(exc).__name__}") from None
            except GoogleAuthError as exc:
                raise CredentialsError(
                    f"Google credentials failed for {where}: {redact_text(str(exc))}"
                ) from None
            except requests.RequestException as exc:
                detail = redact_text(str(exc))
                raise StorageError(f"{op} {where} failed: {type(exc).__name__}: {detail}") from None
            if resp.status_code < 300:
                return resp
            raise self._status_error(resp, key, op)

        return self._held.call(send)

    def _status_error(self, resp: requests.Response, key: str | None, op: str) -> Exception:
        status = resp.status_code
        where = self.url(key) if key is not None else self.root_url
        try:
            message = str(resp.json().get("error", {}).get("message", ""))
        except ValueError:
            message = resp.text[:200]
        except requests.RequestException as exc:  # the error document cut short
            return (ThrottledError if status == 429 else TransientError)(
                f"{op} {where}: the server answered {status}, its error document cut short "
                f"({type(exc).__name__})"
            )
        finally:
            resp.close()
        if status == 404 and (key is None or not self._bucket_exists()):
            return BucketNotFoundError(f"bucket does not exist: {self.root_url} (for {where})")
        if status == 400 and ("CRC32C" in message or "MD5" in message):
            # The service computed another checksum than we sent: damaged on the way.
            return TransientError(f"{op} {where}: checksum mismatch: {message}")
        return error_for(status, "", message, url=where, root_url=self.root_url, op=op)

    def _bucket_exists(self) -> bool:
        """Tell a missing bucket from a missing object (asked only after a 404)."""
        if self._bucket_seen:
            return True
        conn = self._held.get()
        try:
            resp = conn.session.get(conn.endpoint + self._bucket_api, timeout=self._quick)
        except requests.RequestException:
            return True  # cannot tell: report the object as missing
        resp.close()
        self._bucket_seen = resp.status_code != 404
        return self._bucket_seen

    # -- reads ----------------------------------------------------------------------------
    def _head(self, key: str) -> ObjectInfo:
        meta = self._request("GET", self._object_path(key), key, "head", timeout=self._quick).json()
        return _info(meta)

    def _read_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> None:
        length = sum(b.nbytes for b in buffers)
        path = f"{self._download_api}/{quote(key, safe='')}?alt=media"
        headers = {"Range": f"bytes={start}-{start + length - 1}"}
        resp = self._request("GET", path, key, "read", headers=headers, stream=True)
        try:
            got = int(resp.headers.get("Content-Length", -1))
            total = content_range_total(resp.headers.get("Content-Range"))
            skip = body_skip(self.url(key), start, length, got, total)
            read_body_into(resp.raw, skip, buffers, self.url(key), stall=self._timeout[1])
        except (requests.RequestException, ConnectionError, TimeoutError) as exc:
            raise TransientError(f"reading {self.url(key)}: {type(exc).__name__}") from None
        finally:
            resp.close()

    def _list_page(self, prefix: str, token: Any) -> Page:
        items, token = self._raw_page(prefix, token)
        return [_info(m) for m in items if not m["name"].startswith(UPLOADS_PREFIX)], token

    def _raw_page(self, prefix: str, token: str | None) -> tuple[list[dict[str, Any]], str | None]:
        params: dict[str, str] = {"prefix": prefix}
        if token:
            params["pageToken"] = token
        resp = self._request(
            "GET", f"{self._bucket_api}/o", prefix, "list", params=params, timeout=self._quick
        )
        body = resp.json()
        # The service returns names in lexicographic order; an emulator may not.
        items = sorted(body.get("items", ()), key=lambda m: m["name"])
        return items, body.get("nextPageToken") or None

    def _list_raw(self, prefix: str) -> Iterator[dict[str, Any]]:
        token: str | None = None
        while True:
            items, token = self._raw_page(prefix, token)
            yield from items
            if token is None:
                return

    # -- writes ---------------------------------------------------------------------------
    def _upload(
        self, key: str, data: Buffer, *, if_none_match: bool, final: bool = False
    ) -> dict[str, Any]:
        """One upload with its CRC32C, checked against the service's own: the one place
        every object is written (``final``: one a caller sees, not a part of an upload).

        A plain media upload takes no object metadata; a storage class, and an empty
        body (which trips some emulators), go as a multipart upload: metadata, then data.
        """
        view = byte_view(data)
        params = {"uploadType": "media", "name": key, **self._kms}
        if if_none_match:
            params["ifGenerationMatch"] = "0"
        crc = _crc32c(view) if self._crc else None
        metadata = {**self._class} if final else {}
        body: Any = view
        if metadata or not view.nbytes:
            params["uploadType"] = "multipart"
            if crc is not None:
                metadata["crc32c"] = crc
            body = _Related({"name": key, **metadata}, view)
            headers = {"Content-Type": f"multipart/related; boundary={body.boundary}"}
        else:
            headers = {"Content-Type": "application/octet-stream"}
            if crc is not None:
                headers["X-Goog-Hash"] = f"crc32c={crc}"
        resp = self._request(
            "POST", self._upload_api, key, "put", params=params, data=body, headers=headers
        )
        meta: dict[str, Any] = resp.json()
        if crc is not None and meta.get("crc32c") not in (None, crc):
            # Damaged on the way: the service stored other bytes. Sending again fixes it.
            raise TransientError(f"put {self.url(key)}: CRC32C mismatch after upload")
        return meta

    def _put(self, key: str, data: memoryview, if_none_match: bool) -> str | None:
        return _info(self._upload(key, data, if_none_match=if_none_match, final=True)).etag

    def _delete(self, key: str) -> None:
        with contextlib.suppress(NotFoundError):
            path = self._object_path(key)
            self._request("DELETE", path, key, "delete", timeout=self._quick).close()

    def _create_multipart(self, key: str) -> MultipartUpload:
        upload_id = uuid.uuid4().hex
        self._upload(_upload_dir(key, upload_id) + _MARKER, b"", if_none_match=False)
        return MultipartUpload(key=key, upload_id=upload_id, initiated=time.time())

    def _upload_part(
        self, upload: MultipartUpload, number: int, data: memoryview, offset: int
    ) -> UploadedPart:
        name = _upload_dir(upload.key, upload.upload_id) + f"part-{number:05d}"
        meta = self._upload(name, data, if_none_match=False)
        size = byte_view(data).nbytes
        return UploadedPart(number=number, etag=str(meta.get("generation", "")), size=size)

    def _complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[UploadedPart]
    ) -> str | None:
        folder = _upload_dir(upload.key, upload.upload_id)
        sources = [
            {"name": folder + f"part-{p.number:05d}", "generation": p.etag}
            for p in sorted(parts, key=lambda p: p.number)
        ]
        if not sources:  # an empty object: compose needs at least one source
            made = self._upload(upload.key, b"", if_none_match=False, final=True)
        else:
            level = 0
            while len(sources) > _COMPOSE_FANIN:
                groups = [
                    sources[i : i + _COMPOSE_FANIN] for i in range(0, len(sources), _COMPOSE_FANIN)
                ]
                sources = [
                    self._compose(group, folder + f"tree-{level}-{i:05d}", upload.key)
                    for i, group in enumerate(groups)
                ]
                level += 1
            made = self._compose(sources, upload.key, upload.key)
        # The object is committed; leftovers are only untidy (gc finds them), never an error.
        with contextlib.suppress(StorageError):
            self._abort_multipart(upload)
        return _info(made).etag

    def _compose(self, sources: Sequence[dict[str, Any]], dest: str, key: str) -> dict[str, Any]:
        body = {
            "sourceObjects": [
                {"name": s["name"], **_generation_precondition(s.get("generation"))}
                for s in sources
            ],
            "destination": {
                "contentType": "application/octet-stream",
                **(self._class if dest == key else {}),
            },
        }
        try:
            resp = self._request(
                "POST",
                self._object_path(dest) + "/compose",
                key,
                "complete",
                json=body,
                params=self._kms,
            )
        except AlreadyExistsError:
            raise StorageError(
                f"complete {self.url(key)}: a part changed while the upload was open"
            ) from None
        except NotFoundError as exc:
            if isinstance(exc, BucketNotFoundError):
                raise
            raise NotFoundError(
                f"no such multipart upload (parts missing): {self.url(key)}"
            ) from None
        meta: dict[str, Any] = resp.json()
        # The object made, as a listing describes it (its etag: what a commit checks).
        fields = ("size", "updated", "etag", "md5Hash", "crc32c")
        kept: dict[str, Any] = {k: meta[k] for k in fields if k in meta}
        return {**kept, "name": dest, "generation": str(meta.get("generation", ""))}

    def _abort_multipart(self, upload: MultipartUpload) -> None:
        folder = _upload_dir(upload.key, upload.upload_id)
        for meta in list(self._list_raw(folder)):
            self._delete(meta["name"])

    def _list_multipart(self, prefix: str) -> Iterator[MultipartUpload]:
        seen: dict[tuple[str, str], float | None] = {}
        for meta in self._list_raw(UPLOADS_PREFIX + prefix):
            parsed = _parse_upload_name(meta["name"])
            if parsed is None:
                continue
            key, upload_id, leaf = parsed
            if not key.startswith(prefix):
                continue
            slot = (key, upload_id)
            if leaf == _MARKER or slot not in seen:  # the marker's time is the start
                seen[slot] = _timestamp(meta.get("timeCreated"))
        for (key, upload_id), initiated in sorted(seen.items()):
            yield MultipartUpload(key=key, upload_id=upload_id, initiated=initiated)

    def close(self) -> None:
        self._held.made.session.close()


# ------------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class _Connection:
    """What one set of settings made: the authorized session, the endpoint its requests
    go to, and who they act as (the endpoint and where the credentials came from with a
    digest of that file; never a secret)."""

    session: Any
    endpoint: str
    identity: tuple[Any, ...]


def _credentials_source(opts: Mapping[str, Any], anonymous: bool) -> tuple[Any, ...]:
    """Where the credentials come from, with a digest of that file: the storage
    option's file, else ``GOOGLE_APPLICATION_CREDENTIALS``, else gcloud's
    application-default file (metadata-server credentials refresh themselves)."""
    if anonymous:
        return ("anonymous",)
    path = opts.get("credentials_file") or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if not path:
        config = os.environ.get("CLOUDSDK_CONFIG") or os.path.join(
            os.path.expanduser("~"), ".config", "gcloud"
        )
        path = os.path.join(config, "application_default_credentials.json")
    try:
        with open(os.fspath(path), "rb") as f:
            digest: str | None = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        digest = None
    return (os.fspath(path), digest)


def _credentials_from_file(path: str) -> Any:
    """Service-account or authorized-user credentials from a JSON key file.

    Other kinds (workload identity federation...) go through
    ``GOOGLE_APPLICATION_CREDENTIALS``, where google-auth vets them itself.
    """
    import json

    with open(path, encoding="utf-8") as f:
        info = json.load(f)
    kind = info.get("type") if isinstance(info, dict) else None
    if kind == "service_account":
        from google.oauth2 import service_account

        return service_account.Credentials.from_service_account_info(info, scopes=_SCOPES)
    if kind == "authorized_user":
        from google.oauth2 import credentials

        return credentials.Credentials.from_authorized_user_info(info, scopes=_SCOPES)
    raise ValueError(
        f"credentials_file of type {kind!r}: use GOOGLE_APPLICATION_CREDENTIALS for this kind"
    )


def _upload_dir(key: str, upload_id: str) -> str:
    return f"{UPLOADS_PREFIX}{key}/{upload_id}/"


def _parse_upload_name(name: str) -> tuple[str, str, str] | None:
    """``(key, upload_id, leaf)`` of an object under :data:`UPLOADS_PREFIX`."""
    rest = name[len(UPLOADS_PREFIX) :]
    key, sep, tail = rest.rpartition("/")
    key, sep2, upload_id = key.rpartition("/")
    if not (sep and sep2 and key and _UPLOAD_ID.fullmatch(upload_id)):
        return None
    if tail != _MARKER and not _PART.fullmatch(tail) and not tail.startswith("tree-"):
        return None
    return key, upload_id, tail


def _generation_precondition(generation: str | None) -> dict[str, Any]:
    if not generation:
        return {}
    return {"generation": generation, "objectPreconditions": {"ifGenerationMatch": generation}}


def _info(meta: Mapping[str, Any]) -> ObjectInfo:
    return ObjectInfo(
        key=meta["name"],
        size=int(meta.get("size", 0)),
        mtime=_timestamp(meta.get("updated")),
        etag=meta.get("etag") or meta.get("md5Hash") or meta.get("crc32c"),
    )


def _timestamp(value: Any) -> float | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


class _Related:
    """A ``multipart/related`` upload body: object metadata as JSON, then the data sent
    from caller memory (``len`` gives requests its Content-Length; each iteration sends
    the three pieces again, so a request repeated after a credential refresh is whole)."""

    def __init__(self, metadata: Mapping[str, Any], data: memoryview) -> None:
        self.boundary = f"cloudckpt-{uuid.uuid4().hex}"
        self._head = (
            f"--{self.boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            f"{json.dumps(dict(metadata))}\r\n"
            f"--{self.boundary}\r\nContent-Type: application/octet-stream\r\n\r\n"
        ).encode()
        self._data = data
        self._tail = f"\r\n--{self.boundary}--\r\n".encode()

    def __len__(self) -> int:
        return len(self._head) + self._data.nbytes + len(self._tail)

    def __iter__(self) -> Iterator[Any]:
        pieces = (self._head, self._data, self._tail)
        return iter([p for p in pieces if len(p)])


def _crc32c(view: memoryview) -> str:
    """The base64 big-endian CRC32C GCS reports for ``view``.

    The C extension takes only immutable ``bytes``; other buffers go through it in
    1 MiB slices, a copy that stays in cache and costs far less than the hashing.
    """
    if isinstance(view.obj, bytes) and view.nbytes == len(view.obj):
        value = google_crc32c.value(view.obj)
    else:
        value = 0
        for i in range(0, view.nbytes, _CRC_SLICE):
            value = google_crc32c.extend(value, bytes(view[i : i + _CRC_SLICE]))
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")
