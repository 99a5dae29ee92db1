"""What only the Azure backend does: credentials from every standard source, abfs URLs."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

import cloudckpt.store.azure as azure
from cloudckpt.errors import ConfigError, CredentialsError
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url
from cloudckpt.store.azure import AzureStore
from servers import unique_bucket_name


@pytest.fixture
def container(azure_server) -> str:
    name = azure_server.make_bucket(unique_bucket_name("az"))
    yield name
    azure_server.remove_bucket(name)


def _account_url(server) -> str:
    return f"{server.endpoint_url}/{server.account}"


def _round_trip(server, container: str, store: AzureStore, key: str) -> None:
    store.put(key, b"hello " + key.encode())
    assert server.download(container, key) == b"hello " + key.encode()
    assert store.get(key) == b"hello " + key.encode()


def test_connection_string_from_the_environment(
    azure_server, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in azure_server.env().items():
        monkeypatch.setenv(name, value)
    store, key = open_url(f"az://{container}/env/k", resolve_options())
    _round_trip(azure_server, container, store, key)


def test_account_key_from_options(azure_server, container: str) -> None:
    opts = {
        "account_url": _account_url(azure_server),
        "account_name": azure_server.account,
        "account_key": azure_server.account_key,
    }
    _round_trip(azure_server, container, AzureStore(container, opts), "key/k")


def test_account_and_key_from_the_environment(
    azure_server, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", azure_server.account)
    monkeypatch.setenv("AZURE_STORAGE_KEY", azure_server.account_key)
    store = AzureStore(container, {"account_url": _account_url(azure_server)})
    _round_trip(azure_server, container, store, "envkey/k")


def test_options_win_over_the_environment(
    azure_server, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName=x;AccountKey=eHh4;")
    monkeypatch.setenv("AZURE_STORAGE_KEY", "d3Jvbmc=")
    store = AzureStore(container, azure_server.storage_options())
    _round_trip(azure_server, container, store, "win/k")
    opts = {
        "account_url": _account_url(azure_server),
        "account_name": azure_server.account,
        "account_key": azure_server.account_key,
    }
    _round_trip(azure_server, container, AzureStore(container, opts), "win/k2")


def test_sas_token(azure_server, container: str) -> None:
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    sas = generate_container_sas(
        account_name=azure_server.account,
        container_name=container,
        account_key=azure_server.account_key,
        permission=ContainerSasPermissions(read=True, write=True, delete=True, list=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )
    opts = {"account_url": _account_url(azure_server), "sas_token": sas}
    store = AzureStore(container, opts)
    _round_trip(azure_server, container, store, "sas/k")
    assert [i.key for i in store.list("sas/")] == ["sas/k"]


def test_abfs_url_with_account(azure_server, container: str) -> None:
    opts = {"account_url": _account_url(azure_server), "account_key": azure_server.account_key}
    url = f"abfs://{container}@{azure_server.account}.dfs.core.windows.net/abfs/k"
    store, key = open_url(url, resolve_options(storage_options=opts))
    assert key == "abfs/k"
    _round_trip(azure_server, container, store, key)


def test_checksum_none_and_md5_both_round_trip(azure_server, container: str) -> None:
    for checksum in ("none", "md5"):
        opts = {**azure_server.storage_options(), "checksum": checksum}
        store = AzureStore(container, opts)
        upload = store.create_multipart(f"{checksum}/obj")
        parts = [store.upload_part(upload, 1, bytearray(b"x" * 1000), 0)]
        store.complete_multipart(upload, parts)
        assert store.get(f"{checksum}/obj") == b"x" * 1000


def test_no_account_names_the_standard_sources() -> None:
    with pytest.raises(CredentialsError, match="AZURE_STORAGE_CONNECTION_STRING"):
        AzureStore("c")


def test_bad_options() -> None:
    with pytest.raises(ConfigError, match="checksum"):
        AzureStore("c", {"connection_string": "x", "checksum": "sha1"})
    with pytest.raises(ConfigError, match="endpoint_url"):
        AzureStore("c", {"endpoint_url": "x"})
    with pytest.raises(ConfigError, match="invalid Azure settings"):
        AzureStore("c", {"connection_string": "not a connection string"})


def test_missing_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(azure, "_IMPORT_ERROR", ImportError("x", name="azure.storage.blob"))
    with pytest.raises(ConfigError, match=r"cloudckpt\[azure\]"):
        AzureStore("c", {"connection_string": "x"})
