"""Settings a store takes from the environment are read again when they change, and after
a credentials failure (docs/configuration.md, "When settings are read"): a notebook
that corrects ``AWS_SECRET_ACCESS_KEY`` or points ``AWS_ENDPOINT_URL`` elsewhere needs
no restart, and a store held for long (a manager's) follows them too.

Against real servers: rclone checks signatures (moto does not), so the credentials
tests use it; the endpoint tests move from moto to rclone, each holding a bucket of the
same name.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import cloudckpt
from cloudckpt.errors import ConfigError, CredentialsError
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url
from cloudckpt.store import s3 as s3_store
from servers import S3Server, unique_bucket_name

WRONG = "d3Jvbmctc2VjcmV0LWtleS1mb3ItdGVzdHM="


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Environment changes undone after the test; the store looks at the environment on
    every request (not once a second), so the tests need no sleeps."""
    monkeypatch.setattr(s3_store, "_ENV_CHECK_SECONDS", 0.0, raising=False)
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
