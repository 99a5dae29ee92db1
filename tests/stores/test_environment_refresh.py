"""Settings a store takes from the environment are read again when they change, and after
a credentials failure (docs/configuration.md, "When settings are read"): a notebook
that corrects ``AWS_SECRET_ACCESS_KEY`` or points ``AWS_ENDPOINT_URL`` elsewhere needs
no restart, and a store held for long (a manager's) follows them too.

Against real servers: rclone checks signatures (moto does not), so the credentials
tests use it; the endpoint tests move from moto to rclone, each holding a bucket of the
same name. ``gs://`` and ``az://`` follow the same rule: a held store moves to the GCS
emulator or Azurite named by a changed ``STORAGE_EMULATOR_HOST`` or connection string,
and after a refused request reads a rotated credentials file (GCS, its token served by
a small OAuth endpoint here: the emulator checks none) or a corrected key (Azurite).
"""

from __future__ import annotations

import importlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import cloudckpt
from cloudckpt.errors import AccessDeniedError, ConfigError, CredentialsError, StorageError
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url
from cloudckpt.testing.emulators import AzureServer, GCSServer
from servers import S3Server, unique_bucket_name

#: The module (``cloudckpt.store.environment`` as an attribute is its function).
ENVIRONMENT = importlib.import_module("cloudckpt.store.environment")
WRONG = "d3Jvbmctc2VjcmV0LWtleS1mb3ItdGVzdHM="


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Environment changes undone after the test; the store looks at the environment on
    every request (not once a second), so the tests need no sleeps."""
    monkeypatch.setattr(ENVIRONMENT, "CHECK_SECONDS", 0.0)
    yield monkeypatch


def _use(monkeypatch: pytest.MonkeyPatch, server: S3Server, **changes: str) -> None:
    for key, value in {**server.env(), **changes}.items():
        monkeypatch.setenv(key, value)


def test_a_corrected_secret_is_used_after_a_credentials_error(
    rclone_server: S3Server, aws_env: pytest.MonkeyPatch
) -> None:
    bucket = rclone_server.make_bucket(unique_bucket_name("env-secret"))
    url = f"s3://{bucket}/run/w.pt"
    _use(aws_env, rclone_server, AWS_SECRET_ACCESS_KEY=WRONG)
    with pytest.raises(CredentialsError) as info:
        cloudckpt.save({"w": torch.ones(3)}, url)
    assert WRONG not in str(info.value)
    _use(aws_env, rclone_server)  # the secret corrected, as a notebook user would
    cloudckpt.save({"w": torch.ones(3)}, url)
    assert torch.equal(cloudckpt.load(url)["w"], torch.ones(3))


def test_a_store_held_for_long_follows_rotated_credentials(
    rclone_server: S3Server, aws_env: pytest.MonkeyPatch
) -> None:
    """One store, opened once (as a CheckpointManager holds it): its credentials fail,
    the environment is fixed, and the same store's next request succeeds, at once."""
    bucket = rclone_server.make_bucket(unique_bucket_name("env-held"))
    _use(aws_env, rclone_server, AWS_SECRET_ACCESS_KEY=WRONG)
    store, key = open_url(f"s3://{bucket}/run/a.bin", resolve_options())
    with pytest.raises(CredentialsError):
        store.put(key, b"first")
    _use(aws_env, rclone_server)
    store.put(key, b"second")
    assert store.get(key) == b"second"


def test_a_new_endpoint_in_the_environment_is_used(
    moto_server: S3Server, rclone_server: S3Server, aws_env: pytest.MonkeyPatch
) -> None:
    name = unique_bucket_name("env-endpoint")
    moto_server.make_bucket(name)
    rclone_server.make_bucket(name)
    _use(aws_env, moto_server)
    cloudckpt.save({"w": torch.ones(2)}, f"s3://{name}/a.pt")
    held, _ = open_url(f"s3://{name}/b.bin", resolve_options())
    _use(aws_env, rclone_server)  # AWS_ENDPOINT_URL changed
    cloudckpt.save({"w": torch.zeros(2)}, f"s3://{name}/c.pt")
    held.put("b.bin", b"held")  # the store opened before the change follows it too

    def keys(server: S3Server) -> list[str]:
        listed = server.client().list_objects_v2(Bucket=name).get("Contents", [])
        return sorted(o["Key"] for o in listed)

    assert keys(moto_server) == ["a.pt"]
    assert keys(rclone_server) == ["b.bin", "c.pt"]


def test_a_fresh_open_right_after_the_environment_changes_back_uses_it(
    moto_server: S3Server, rclone_server: S3Server, aws_env: pytest.MonkeyPatch
) -> None:
    """A held store made its clients again for B; the environment goes back to A. The
    store stays cached under A (where it was opened), yet a fresh open keyed by A, before
    the held store's next look at the environment, must not get B's clients (F5)."""
    name = unique_bucket_name("env-back")
    moto_server.make_bucket(name)
    rclone_server.make_bucket(name)
    _use(aws_env, moto_server)  # A
    held = cloudckpt.CheckpointManager(f"s3://{name}/held")
    held.save(1, {"w": torch.ones(2)})
    _use(aws_env, rclone_server)  # B: the held store follows at its next request
    held.save(2, {"w": torch.ones(2)})
    aws_env.setattr(ENVIRONMENT, "CHECK_SECONDS", 3600.0)  # no look from a request now
    _use(aws_env, moto_server)  # back to A, and at once:
    cloudckpt.save({"w": torch.zeros(2)}, f"s3://{name}/one-shot.pt")
    cloudckpt.CheckpointManager(f"s3://{name}/fresh").save(1, {"w": torch.zeros(2)})

    def keys(server: S3Server) -> set[str]:
        listed = server.client().list_objects_v2(Bucket=name).get("Contents", [])
        return {o["Key"] for o in listed}

    assert "one-shot.pt" in keys(moto_server)
    assert any(k.startswith("fresh/") for k in keys(moto_server))
    assert not any(k.startswith(("one-shot", "fresh/")) for k in keys(rclone_server))
    assert any(k.startswith("held/step-000000002") for k in keys(rclone_server))


def test_a_fresh_gcs_open_right_after_the_environment_changes_back_uses_it(
    gcs_server: GCSServer, aws_env: pytest.MonkeyPatch
) -> None:
    bucket = gcs_server.make_bucket(unique_bucket_name("env-gcs-back"))
    good = gcs_server.env()["STORAGE_EMULATOR_HOST"]
    aws_env.setenv("STORAGE_EMULATOR_HOST", good)  # A
    options = resolve_options(max_attempts=1)
    held, key = open_url(f"gs://{bucket}/run/a.bin", options)
    held.put(key, b"a")
    aws_env.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{_dead_port()}")  # B
    with pytest.raises(StorageError):
        held.put(key, b"nowhere")  # the held store followed B
    aws_env.setattr(ENVIRONMENT, "CHECK_SECONDS", 3600.0)
    aws_env.setenv("STORAGE_EMULATOR_HOST", good)  # back to A, and at once:
    fresh, _ = open_url(f"gs://{bucket}/run/b.bin", options)
    fresh.put("run/b.bin", b"fresh")
    assert gcs_server.download(bucket, "run/b.bin") == b"fresh"


def test_an_endpoint_without_a_scheme_in_the_environment_is_a_config_error(
    aws_env: pytest.MonkeyPatch,
) -> None:
    aws_env.setenv("AWS_ENDPOINT_URL", "127.0.0.1:9000")
    with pytest.raises(ConfigError, match=r"did you mean 'http://127\.0\.0\.1:9000'\?"):
        open_url("s3://b/k", resolve_options())


def test_metadata_requests_have_their_own_read_timeout(aws_env: pytest.MonkeyPatch) -> None:
    aws_env.setenv("AWS_ACCESS_KEY_ID", "k")
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", "s")
    aws_env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    store, _ = open_url("s3://b/k", resolve_options())
    clients = store._holder.get()  # type: ignore[attr-defined]
    assert clients.quick.meta.config.read_timeout == 10.0  # the default metadata_timeout
    assert clients.data.meta.config.read_timeout == 120.0  # request_timeout
    short, _ = open_url("s3://b/k", resolve_options(request_timeout=5.0))
    assert short._holder.get().quick.meta.config.read_timeout == 5.0  # type: ignore[attr-defined]


# -- gs:// and az:// ----------------------------------------------------------------------


@pytest.fixture
def held_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The environment is looked at only after a refused request (never on a timer), so
    a test of that path sees nothing else pick the change up."""
    monkeypatch.setattr(ENVIRONMENT, "CHECK_SECONDS", 3600.0)
    yield monkeypatch


def _dead_port() -> int:
    """A 127.0.0.1 port nothing listens on: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_held_gcs_store_follows_storage_emulator_host(
    gcs_server: GCSServer, aws_env: pytest.MonkeyPatch
) -> None:
    bucket = gcs_server.make_bucket(unique_bucket_name("env-gcs-host"))
    aws_env.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{_dead_port()}")
    held, key = open_url(f"gs://{bucket}/run/a.bin", resolve_options(max_attempts=1))
    with pytest.raises(StorageError):
        held.put(key, b"nowhere")
    aws_env.setenv("STORAGE_EMULATOR_HOST", gcs_server.env()["STORAGE_EMULATOR_HOST"])
    held.put(key, b"held")  # the store opened before the change follows it
    assert gcs_server.download(bucket, "run/a.bin") == b"held"


class _TokenEndpoint:
    """An OAuth token endpoint on 127.0.0.1: ``/token/good`` grants an access token,
    any other path answers ``invalid_grant`` (what Google says of a revoked key)."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                good = self.path == "/token/good"
                body = {"access_token": "token", "expires_in": 3600, "token_type": "Bearer"}
                answer = json.dumps(body if good else {"error": "invalid_grant"}).encode()
                self.send_response(200 if good else 400)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/token"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def token_endpoint() -> Iterator[_TokenEndpoint]:
    endpoint = _TokenEndpoint()
    yield endpoint
    endpoint.close()


def _service_account_key() -> str:
    """A fresh RSA key in PEM, as a service-account key file holds it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def test_a_held_gcs_store_reads_a_rotated_credentials_file_after_a_refusal(
    gcs_server: GCSServer,
    token_endpoint: _TokenEndpoint,
    held_env: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """``GOOGLE_APPLICATION_CREDENTIALS`` names the same file before and after: its
    content is replaced (a rotated service-account key), so only the refused request
    can notice."""
    bucket = gcs_server.make_bucket(unique_bucket_name("env-gcs-creds"))
    creds = tmp_path / "key.json"

    def write(which: str) -> None:
        info = {
            "type": "service_account",
            "project_id": "cloudckpt-test",
            "private_key_id": which,
            "private_key": _service_account_key(),
            "client_email": f"{which}@cloudckpt-test.iam.gserviceaccount.com",
            "client_id": "1",
            "token_uri": f"{token_endpoint.url}/{which}",
        }
        creds.write_text(json.dumps(info))

    write("revoked")
    held_env.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(creds))
    options = resolve_options(storage_options={"endpoint_url": gcs_server.endpoint_url})
    held, key = open_url(f"gs://{bucket}/run/a.bin", options)
    with pytest.raises(CredentialsError):
        held.put(key, b"refused")
    write("good")  # rotated in place
    held.put(key, b"held")
    assert gcs_server.download(bucket, "run/a.bin") == b"held"


def _with_key(server: AzureServer, key: str) -> str:
    conn = server.connection_string()
    start = conn.index("AccountKey=") + len("AccountKey=")
    return conn[:start] + key + conn[conn.index(";", start) :]


def test_a_held_azure_store_follows_a_new_connection_string(
    azure_server: AzureServer, aws_env: pytest.MonkeyPatch
) -> None:
    bucket = azure_server.make_bucket(unique_bucket_name("env-az-host"))
    conn = azure_server.connection_string().replace(
        azure_server.endpoint_url, f"http://127.0.0.1:{_dead_port()}"
    )
    aws_env.setenv("AZURE_STORAGE_CONNECTION_STRING", conn)
    held, key = open_url(f"az://{bucket}/run/a.bin", resolve_options(max_attempts=1))
    with pytest.raises(StorageError):
        held.put(key, b"nowhere")
    aws_env.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_server.connection_string())
    held.put(key, b"held")
    assert azure_server.download(bucket, "run/a.bin") == b"held"


def test_a_held_azure_store_uses_a_corrected_key_after_a_refusal(
    azure_server: AzureServer, held_env: pytest.MonkeyPatch
) -> None:
    """Azurite refuses a bad signature with 403 AuthorizationFailure (AccessDeniedError;
    Azure itself says AuthenticationFailed, a CredentialsError): either makes the
    clients again from the environment."""
    bucket = azure_server.make_bucket(unique_bucket_name("env-az-key"))
    held_env.setenv("AZURE_STORAGE_CONNECTION_STRING", _with_key(azure_server, WRONG))
    held, key = open_url(f"az://{bucket}/run/a.bin", resolve_options(max_attempts=1))
    with pytest.raises((AccessDeniedError, CredentialsError)) as info:
        held.put(key, b"refused")
    assert WRONG not in str(info.value)
    held_env.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_server.connection_string())
    held.put(key, b"held")
    assert azure_server.download(bucket, "run/a.bin") == b"held"
