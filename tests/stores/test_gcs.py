"""What only the GCS backend does: compose trees, CRC32C, standard environment, extras."""

from __future__ import annotations

import base64
import json

import pytest

import cloudckpt.store.gcs as gcs
from cloudckpt.errors import ConfigError, CredentialsError, RetriesExhaustedError
from cloudckpt.options import resolve_options
from cloudckpt.store import RetryPolicy, open_url
from cloudckpt.store.gcs import UPLOADS_PREFIX, GCSStore
from servers import unique_bucket_name


@pytest.fixture
def bucket(gcs_server) -> str:
    name = gcs_server.make_bucket(unique_bucket_name("gcs"))
    yield name
    gcs_server.remove_bucket(name)


def test_crc32c_matches_the_standard_check_value() -> None:
    # CRC-32C of b"123456789" is 0xE3069283 (RFC 3720 check value), base64 as GCS sends it.
    expected = base64.b64encode(bytes.fromhex("e3069283")).decode()
    assert gcs._crc32c(memoryview(b"123456789")) == expected
    assert gcs._crc32c(memoryview(bytearray(b"123456789"))) == expected
    big = bytearray(b"123456789" * 300_000)  # crosses the 1 MiB slices
    assert gcs._crc32c(memoryview(big)) == gcs._crc32c(memoryview(bytes(big)))


def test_more_parts_than_one_compose_takes(gcs_server, bucket: str) -> None:
    store = GCSStore(bucket, gcs_server.storage_options())
    upload = store.create_multipart("tree/obj")
    parts = [bytes([i]) * (1000 + i) for i in range(70)]  # 70 > 2 * 32: a two-level tree
    uploaded = [store.upload_part(upload, i + 1, p, 0) for i, p in enumerate(parts)]
    store.complete_multipart(upload, uploaded)
    assert store.get("tree/obj") == b"".join(parts)
    assert [m["name"] for m in store._list_raw(UPLOADS_PREFIX)] == []
    assert list(store.list_multipart("")) == []


def test_each_part_upload_names_its_generation(gcs_server, bucket: str) -> None:
    """complete pins every source to the generation its upload returned (real GCS checks
    ``ifGenerationMatch`` per source; the emulator ignores it)."""
    store = GCSStore(bucket, gcs_server.storage_options())
    upload = store.create_multipart("k")
    first = store.upload_part(upload, 1, b"a" * 100, 0)
    again = store.upload_part(upload, 1, b"b" * 100, 0)  # a retry that raced the first
    assert first.etag != again.etag  # generations tell the two apart
    store.complete_multipart(upload, [again])
    assert store.get("k") == b"b" * 100


def test_checksum_mismatch_after_upload_is_transient(
    gcs_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = GCSStore(bucket, gcs_server.storage_options()).with_retry(
        RetryPolicy(max_attempts=2, backoff_base=0.001)
    )
    monkeypatch.setattr(gcs, "_crc32c", lambda view: "AAAAAA==")  # not what was sent
    with pytest.raises(RetriesExhaustedError, match=r"after 2 attempts.*CRC32C"):
        store.put("c", b"some bytes")


def test_checksum_none_skips_the_check(
    gcs_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = GCSStore(bucket, {**gcs_server.storage_options(), "checksum": "none"})
    monkeypatch.setattr(gcs, "_crc32c", lambda view: pytest.fail("hashed anyway"))
    store.put("c", b"some bytes")
    assert store.get("c") == b"some bytes"


def test_storage_emulator_host_from_the_environment(
    gcs_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint_url.removeprefix("http://"))
    store, key = open_url(f"gs://{bucket}/env/k", resolve_options())
    store.put(key, b"via env")
    assert gcs_server.download(bucket, "env/k") == b"via env"


def test_missing_credentials_name_the_standard_sources(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "absent.json"))
    with pytest.raises(CredentialsError, match="GOOGLE_APPLICATION_CREDENTIALS") as info:
        GCSStore("some-bucket")
    assert "gs://some-bucket" in str(info.value)


def test_bad_credentials_file_is_a_credentials_error(tmp_path) -> None:
    path = tmp_path / "sa.json"
    path.write_text(json.dumps({"type": "service_account", "private_key": "secret-value"}))
    with pytest.raises(CredentialsError) as info:
        GCSStore("b", {"credentials_file": str(path)})
    assert "secret-value" not in str(info.value)


def test_bad_options() -> None:
    with pytest.raises(ConfigError, match="checksum"):
        GCSStore("b", {"anonymous": True, "checksum": "md5"})
    with pytest.raises(ConfigError, match="region_name"):
        GCSStore("b", {"region_name": "x"})


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gcs, "_IMPORT_ERROR", ImportError("x", name="google_crc32c"))
    with pytest.raises(ConfigError, match=r"cloudckpt\[gcs\]"):
        GCSStore("b", {"anonymous": True})
