"""The object options bucket policies ask for: encryption, storage class, tags,
requester-pays, on every object the library writes and every request that needs them.

S3 runs on moto, which records server-side encryption, the KMS key, the bucket key,
the storage class and tags: each object is then inspected with boto3, as a user would.
moto knows nothing of SSE-C nor of requester-pays, so those requests go through
:class:`RecordingProxy` (the test fault proxy, recording each request's headers), which
also refuses a GET or HEAD of an SSE-C object that lacks the key, as S3 does. The GCS
emulator records a storage class but ignores ``kmsKeyName``, and Azurite keeps an
access tier but no encryption scope: those two are checked on the recorded requests.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cloudckpt
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.errors import ConfigError, StorageError
from cloudckpt.manager import CheckpointManager
from cloudckpt.options import MiB, TransferOptions
from cloudckpt.redact import RedactingFilter, is_secret_name, redact_text
from cloudckpt.store import open_target
from cloudckpt.testing.fault_proxy import FaultProxy
from conftest import make_target
from servers import Emulator, S3Server, StoreTarget, unique_bucket_name

# DCP saves and loads here run in one process, without a process group.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

KMS_KEY = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
CUSTOMER_KEY = base64.b64encode(bytes(range(32))).decode()
CUSTOMER_KEY_MD5 = base64.b64encode(hashlib.md5(bytes(range(32))).digest()).decode()
#: 15 MiB of floats: the single checkpoint goes up as a multipart upload of 5 MiB parts.
BIG = 3 * 5 * MiB // 4


class RecordingProxy(FaultProxy):
    """The fault proxy, injecting nothing, recording ``(method, target, headers)`` of each
    request; with ``enforce_sse_c`` it answers S3's 400 to a GET or HEAD, without the
    SSE-C key, of an object created with one (moto would serve it)."""

    def __init__(self, upstream: str, *, enforce_sse_c: bool = False) -> None:
        super().__init__(upstream)
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.enforce_sse_c = enforce_sse_c
        self._sse_c_paths: set[str] = set()

    def _forward(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        lookup = {k.lower(): v for k, v in headers}
        with self._lock:
            self.seen.append((method, target, lookup))
        path = urlsplit(target).path
        keyed = "x-amz-server-side-encryption-customer-key" in lookup
        if self.enforce_sse_c:
            if keyed and method in ("PUT", "POST"):
                with self._lock:
                    self._sse_c_paths.add(path)
            elif method in ("GET", "HEAD") and path in self._sse_c_paths and not keyed:
                body = (
                    b""
                    if method == "HEAD"
                    else (
                        b"<Error><Code>InvalidRequest</Code><Message>The object was stored "
                        b"using a form of Server Side Encryption.</Message></Error>"
                    )
                )
                return 400, [("Content-Type", "application/xml")], body
        return super()._forward(method, target, headers, body)

    def requests_for(self, fragment: str) -> list[tuple[str, str, dict[str, str]]]:
        """The recorded requests whose target contains ``fragment``."""
        return [r for r in self.seen if fragment in unquote(r[1])]


def _state(n: int = BIG) -> dict[str, Any]:
    return {"w": torch.arange(n, dtype=torch.float32), "step": 3}


def _dcp_state() -> dict[str, Any]:
    return {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(64, 3)}


def _write_all(base: str, so: dict[str, Any]) -> None:
    """Every kind of write: a multipart single checkpoint, a small one, a manager run (its
    payloads and markers) and a DCP checkpoint (items and ``.metadata``)."""
    result = cloudckpt.save(
        _state(), f"{base}/single/big.pt", storage_options=so, part_size=5 * MiB
    )
    assert result.size > 2 * 5 * MiB
    cloudckpt.save({"x": 1}, f"{base}/single/small.pt", storage_options=so)
    manager = CheckpointManager(f"{base}/run", storage_options=so)
    manager.save(1, _state(256))
    manager.save(2, _state(256))
    dcp.save(_dcp_state(), storage_writer=CloudStorageWriter(f"{base}/dcp", storage_options=so))


def _read_all(base: str, so: dict[str, Any]) -> None:
    """Read back what :func:`_write_all` wrote: every path reads (HEAD, GET, ranges)."""
    assert torch.equal(
        cloudckpt.load(f"{base}/single/big.pt", storage_options=so)["w"], _state()["w"]
    )
    assert cloudckpt.load(f"{base}/single/small.pt", storage_options=so) == {"x": 1}
    assert CheckpointManager(f"{base}/run", storage_options=so).restore()["step"] == 3
    loaded = {k: torch.empty_like(v) for k, v in _dcp_state().items()}
    dcp.load(loaded, storage_reader=CloudStorageReader(f"{base}/dcp", storage_options=so))
    assert all(torch.equal(loaded[k], v) for k, v in _dcp_state().items())


@pytest.fixture
def s3_bucket(moto_server: S3Server) -> Iterator[str]:
    bucket = moto_server.make_bucket(unique_bucket_name())
    yield bucket
    moto_server.remove_bucket(bucket)


@pytest.fixture
def gcs_target(
    request: pytest.FixtureRequest, tmp_path: Any, gcs_server: Emulator
) -> Iterator[StoreTarget]:
    yield from make_target(request, "gcs", tmp_path)


@pytest.fixture
def azure_target(
    request: pytest.FixtureRequest, tmp_path: Any, azure_server: Emulator
) -> Iterator[StoreTarget]:
    yield from make_target(request, "azure", tmp_path)


def open_url(url: str, storage_options: dict[str, Any]) -> Any:
    """The store serving ``url`` with ``storage_options`` (opening it checks them)."""
    return open_target(url, storage_options=storage_options).store


def _keys(client: Any, bucket: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [o["Key"] for page in pages for o in page.get("Contents", ())]


# ------------------------------------------------------------------------------- S3


def test_s3_kms_class_tags_on_every_object(moto_server: S3Server, s3_bucket: str) -> None:
    so = {
        **moto_server.storage_options(),
        "sse": "aws:kms",
        "sse_kms_key_id": KMS_KEY,
        "sse_bucket_key": True,
        "storage_class": "STANDARD_IA",
        "tags": {"team": "ml", "cost centre": "a/b+c"},
    }
    _write_all(f"s3://{s3_bucket}", so)
    client = moto_server.client()
    keys = _keys(client, s3_bucket)
    assert {"single/big.pt", "single/small.pt", "dcp/.metadata"} <= set(keys)
    assert any(k.endswith("_CHECKPOINT.json") for k in keys)  # the manager's markers
    for key in keys:
        head = client.head_object(Bucket=s3_bucket, Key=key)
        assert head["ServerSideEncryption"] == "aws:kms", key
        assert head["SSEKMSKeyId"] == KMS_KEY, key
        if "-" not in head["ETag"]:  # moto records the bucket key of single puts only
            assert head["BucketKeyEnabled"] is True, key
        assert head["StorageClass"] == "STANDARD_IA", key
        tags = client.get_object_tagging(Bucket=s3_bucket, Key=key)["TagSet"]
        assert sorted((t["Key"], t["Value"]) for t in tags) == [
            ("cost centre", "a/b+c"),
            ("team", "ml"),
        ], key
    # The big checkpoint went up in parts (a multipart ETag: "<md5>-<parts>").
    assert client.head_object(Bucket=s3_bucket, Key="single/big.pt")["ETag"].endswith(
        ('-3"', '-4"')
    )
    _read_all(f"s3://{s3_bucket}", so)


@pytest.mark.parametrize("sse", ["AES256", "aws:kms:dsse"])
def test_s3_other_encryptions_and_tags_as_text(
    moto_server: S3Server, s3_bucket: str, sse: str
) -> None:
    so = {**moto_server.storage_options(), "sse": sse, "tags": "a=1&b=two"}
    cloudckpt.save(_state(), f"s3://{s3_bucket}/x.pt", storage_options=so, part_size=5 * MiB)
    client = moto_server.client()
    assert client.head_object(Bucket=s3_bucket, Key="x.pt")["ServerSideEncryption"] == sse
    tags = client.get_object_tagging(Bucket=s3_bucket, Key="x.pt")["TagSet"]
    assert sorted((t["Key"], t["Value"]) for t in tags) == [("a", "1"), ("b", "two")]


def test_s3_sse_c_on_every_request_and_needed_to_read(
    moto_server: S3Server, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.handler.addFilter(RedactingFilter())  # what `cloudckpt -v` installs
    caplog.set_level(logging.DEBUG)
    with RecordingProxy(moto_server.endpoint_url, enforce_sse_c=True) as proxy:
        plain = {**moto_server.storage_options(), "endpoint_url": proxy.url}
        so = {**plain, "sse_customer_key": CUSTOMER_KEY}
        base = f"s3://{s3_bucket}"
        _write_all(base, so)
        _read_all(base, so)
        object_requests = [
            r
            for r in proxy.requests_for(f"/{s3_bucket}/")
            if urlsplit(r[1]).path != f"/{s3_bucket}/"
        ]
        kinds = {(m, "uploadId" in t, "partNumber" in t) for m, t, _ in object_requests}
        # Puts, multipart create / part / complete, HEADs and GETs were all made...
        assert {("PUT", False, False), ("POST", False, False), ("PUT", True, True)} <= kinds
        assert {("POST", True, False), ("GET", False, False)} <= kinds
        for method, target, headers in object_requests:
            if method == "DELETE" or (method == "POST" and "delete" in target):
                continue
            # ...and each carried the key, its algorithm and its MD5.
            assert headers.get("x-amz-server-side-encryption-customer-algorithm") == "AES256", (
                method,
                target,
            )
            assert headers["x-amz-server-side-encryption-customer-key"] == CUSTOMER_KEY
            assert headers["x-amz-server-side-encryption-customer-key-md5"] == CUSTOMER_KEY_MD5
        # Without the key, a read fails and says what is missing.
        with pytest.raises(StorageError, match="sse_customer_key") as failed:
            cloudckpt.load(f"{base}/single/big.pt", storage_options=plain)
    assert CUSTOMER_KEY not in str(failed.value)
    assert caplog.records and CUSTOMER_KEY not in caplog.text
    shown = repr(TransferOptions(storage_options=so))
    assert CUSTOMER_KEY not in shown and "'sse_customer_key': '***'" in shown


def test_s3_requester_pays_on_every_request(moto_server: S3Server, s3_bucket: str) -> None:
    with RecordingProxy(moto_server.endpoint_url) as proxy:
        so = {
            **moto_server.storage_options(),
            "endpoint_url": proxy.url,
            "requester_pays": True,
        }
        base = f"s3://{s3_bucket}"
        _write_all(base, so)
        _read_all(base, so)
        store = open_url(f"{base}/x", so)
        assert list(store.list_multipart("")) == []
        store.delete("single/small.pt")
        assert len(proxy.seen) > 20
        assert {"GET", "HEAD", "PUT", "POST", "DELETE"} <= {m for m, _, _ in proxy.seen}
        for method, target, headers in proxy.seen:
            assert headers.get("x-amz-request-payer") == "requester", (method, target)


# ------------------------------------------------------------------------ GCS, Azure


def test_gcs_storage_class_and_kms_key(gcs_target: StoreTarget) -> None:
    """The emulator keeps ``storageClass``; ``kmsKeyName`` it ignores, so each upload
    and compose is checked to have carried it."""
    kms = "projects/p/locations/us/keyRings/r/cryptoKeys/k"
    server = gcs_target.server
    assert server is not None
    with RecordingProxy(server.endpoint_url) as proxy:
        so = {
            **gcs_target.storage_options,
            "endpoint_url": proxy.url,
            "kms_key_name": kms,
            "storage_class": "NEARLINE",
        }
        _write_all(gcs_target.base_url, so)
        _read_all(gcs_target.base_url, so)
        writes = [r for r in proxy.seen if r[0] == "POST"]
        uploads = [r for r in writes if "/upload/" in r[1]]
        composes = [r for r in writes if r[1].split("?")[0].endswith("/compose")]
        assert uploads and composes
        for _, target, _ in uploads + composes:
            assert parse_qs(urlsplit(target).query).get("kmsKeyName") == [kms], target
    store = open_url(f"{gcs_target.base_url}/x", gcs_target.storage_options)
    metas = list(store._list_raw(""))  # type: ignore[attr-defined]
    assert any(m["name"] == "single/big.pt" for m in metas)
    for meta in metas:
        assert meta.get("storageClass") == "NEARLINE", meta["name"]


def test_azure_access_tier_and_encryption_scope(azure_target: StoreTarget) -> None:
    """Azurite keeps the access tier; the encryption scope is checked on the requests
    (every Put Blob, Put Block and Put Block List carried it)."""
    server = azure_target.server
    assert server is not None
    with RecordingProxy(server.endpoint_url) as proxy:
        so = {
            "connection_string": server.connection_string().replace(  # type: ignore[attr-defined]
                server.endpoint_url, proxy.url
            ),
            "encryption_scope": "scope-1",
            "access_tier": "Cool",
        }
        cloudckpt.save(
            _state(), f"{azure_target.base_url}/big.pt", storage_options=so, part_size=5 * MiB
        )
        cloudckpt.save({"x": 1}, f"{azure_target.base_url}/small.pt", storage_options=so)
        writes = [r for r in proxy.seen if r[0] == "PUT"]
        assert any("comp=block&" in t or t.endswith("comp=block") for _, t, _ in writes)
        assert any("comp=blocklist" in t for _, t, _ in writes)
        for _, target, headers in writes:
            assert headers.get("x-ms-encryption-scope") == "scope-1", target
    container = server.client().get_container_client(azure_target.bucket)  # type: ignore[attr-defined]
    for name in ("big.pt", "small.pt"):
        assert container.get_blob_client(name).get_blob_properties().blob_tier == "Cool"


# ----------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("scheme", "option", "value"),
    [
        ("s3", "sse", "aes256"),
        ("s3", "sse_bucket_key", "yes"),
        ("s3", "storage_class", "standard_ia"),
        ("s3", "storage_class", ""),
        ("s3", "tags", "novalue"),
        ("s3", "tags", {}),
        ("s3", "tags", {"a": "x&y"}),
        ("s3", "requester_pays", 1),
        ("s3", "sse_customer_key", "c2hvcnQ="),
        ("gs", "storage_class", "nearline"),
        ("gs", "kms_key_name", "my-key"),
        ("az", "access_tier", "hot"),
        ("az", "encryption_scope", "a"),
    ],
)
def test_each_option_is_checked_up_front(scheme: str, option: str, value: Any) -> None:
    so: dict[str, Any] = {option: value}
    if scheme == "s3":
        so.update(
            aws_access_key_id="a", aws_secret_access_key="b", endpoint_url="http://127.0.0.1:9"
        )
    elif scheme == "gs":
        so.update(anonymous=True, endpoint_url="http://127.0.0.1:9")
    else:
        so.update(account_name="acct", account_key=base64.b64encode(b"k").decode())
    with pytest.raises(ConfigError, match=option) as refused:
        open_url(f"{scheme}://bucket/x", so)
    if option == "sse_customer_key":
        assert str(value) not in str(refused.value)


def test_s3_option_combinations_are_refused() -> None:
    base = {"aws_access_key_id": "a", "aws_secret_access_key": "b"}
    with pytest.raises(ConfigError, match="sse_kms_key_id"):
        open_url("s3://b/x", {**base, "sse_kms_key_id": KMS_KEY})
    with pytest.raises(ConfigError, match="sse_customer_key"):
        open_url("s3://b/x", {**base, "sse": "AES256", "sse_customer_key": CUSTOMER_KEY})
    with pytest.raises(ConfigError, match=r"unknown S3 storage option.*kms_key_name"):
        open_url("s3://b/x", {**base, "kms_key_name": "k"})


def test_cli_storage_option_flag() -> None:
    from cloudckpt.cli.main import _options, build_parser

    args = build_parser().parse_args(
        [
            "ls",
            "s3://b/x",
            "-o",
            "sse=aws:kms",
            "--storage-option",
            "tags=a=1&b=2",
            "-o",
            "requester_pays=true",
        ]
    )
    assert args.storage_option == [
        ("sse", "aws:kms"),
        ("tags", "a=1&b=2"),
        ("requester_pays", True),
    ]
    resolved = _options(args).resolve("s3://b/x")
    assert dict(resolved.options.storage_options) == {
        "sse": "aws:kms",
        "tags": "a=1&b=2",
        "requester_pays": True,
    }
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ls", "s3://b/x", "-o", "novalue"])


def test_profile_sets_object_options(
    moto_server: S3Server, s3_bucket: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f'[profiles.secure]\nmatch = ["s3://{s3_bucket}/"]\n\n'
        "[profiles.secure.storage_options]\n"
        'sse = "AES256"\nstorage_class = "GLACIER_IR"\ntags = { team = "ml" }\n'
    )
    monkeypatch.setenv("CLOUDCKPT_CONFIG", str(config))
    cloudckpt.save(
        {"x": 1}, f"s3://{s3_bucket}/p.pt", storage_options=moto_server.storage_options()
    )
    client = moto_server.client()
    head = client.head_object(Bucket=s3_bucket, Key="p.pt")
    assert (head["ServerSideEncryption"], head["StorageClass"]) == ("AES256", "GLACIER_IR")
    tags = client.get_object_tagging(Bucket=s3_bucket, Key="p.pt")["TagSet"]
    assert tags == [{"Key": "team", "Value": "ml"}]


@pytest.mark.parametrize(
    "name",
    [
        "sse_customer_key",
        "SSECustomerKey",
        "x-amz-server-side-encryption-customer-key",
    ],
)
def test_sse_c_key_names_are_secret(name: str) -> None:
    assert is_secret_name(name)
    assert CUSTOMER_KEY not in redact_text(f"{name}: {CUSTOMER_KEY}")
    assert CUSTOMER_KEY not in redact_text(repr({name: CUSTOMER_KEY}))


def test_cli_cp_applies_storage_options(
    moto_server: S3Server, s3_bucket: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cloudckpt.cli.main import main

    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    source = tmp_path / "state.pt"
    source.write_bytes(b"checkpoint bytes")
    argv = ["cp", str(source), f"s3://{s3_bucket}/cli/state.pt", "-o", "sse=AES256"]
    argv += ["--storage-option", "storage_class=STANDARD_IA", "-o", "tags=via=cli"]
    assert main(argv) == 0
    client = moto_server.client()
    head = client.head_object(Bucket=s3_bucket, Key="cli/state.pt")
    assert (head["ServerSideEncryption"], head["StorageClass"]) == ("AES256", "STANDARD_IA")
    tags = client.get_object_tagging(Bucket=s3_bucket, Key="cli/state.pt")["TagSet"]
    assert tags == [{"Key": "via", "Value": "cli"}]
    assert main(["ls", f"s3://{s3_bucket}/cli", "-o", "storage_class=cold"]) == 2
