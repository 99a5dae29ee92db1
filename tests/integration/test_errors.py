"""Bad input and missing things: typed errors naming the URL, storage left as it was."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import cloudckpt
from cloudckpt import errors
from cloudckpt.format.torch.zipdir import parse_directory
from cloudckpt.options import MiB, resolve_options
from cloudckpt.store import open_url


def _store(url, storage_options):
    return open_url(url, resolve_options(storage_options=storage_options))


def make_factory():
    def sh_ten_build_fn():  # a local closure, like Megatron's sharded tensor factories
        return torch.zeros(2)

    return sh_ten_build_fn


class ShardedTensorLike:
    def __init__(self):
        self.data = torch.randn(4, 4)
        self.build_fn = make_factory()


def test_unpicklable_state_names_key_path_and_uploads_nothing(store_url):
    state = {"model": {"decoder.mlp.weight": ShardedTensorLike()}, "big": torch.randn(1024, 1024)}
    url = f"{store_url.base_url}/bad.pt"
    with pytest.raises(errors.UnpicklableError) as info:
        cloudckpt.save(state, url, storage_options=store_url.storage_options)
    msg = str(info.value)
    assert "state['model']['decoder.mlp.weight'].build_fn" in msg
    assert info.value.path == "state['model']['decoder.mlp.weight'].build_fn"
    assert url.split("://", 1)[1] in msg
    assert "torch.distributed.checkpoint" in msg  # says what to do instead
    store, key = _store(url, store_url.storage_options)
    assert list(store.list(key.rpartition("/")[0])) == []
    assert list(store.list_multipart(key.rpartition("/")[0])) == []


@pytest.mark.parametrize(
    "bad, where",
    [
        (lambda: {"opt": {"sched": lambda step: 0.1}}, "state['opt']['sched']"),
        (lambda: {"layers": [torch.zeros(1), threading.Lock()]}, "state['layers'][1]"),
        (lambda: {"log": open(__file__)}, "state['log']"),  # noqa: SIM115
    ],
)
def test_each_kind_of_unpicklable_object_is_located(tmp_path, bad, where):
    with pytest.raises(errors.UnpicklableError) as info:
        cloudckpt.save(bad(), tmp_path / "x.pt")
    assert info.value.path == where
    assert not (tmp_path / "x.pt").exists()


def test_tensor_attribute_closure_is_located(tmp_path):
    t = torch.zeros(3)
    t.build_fn = make_factory()
    with pytest.raises(errors.UnpicklableError, match=r"state\['w'\]\.build_fn"):
        cloudckpt.save({"w": t}, tmp_path / "x.pt")


def test_missing_object(store_url):
    url = f"{store_url.base_url}/nope.pt"
    with pytest.raises(errors.NotFoundError, match=r"nope\.pt") as info:
        cloudckpt.load(url, storage_options=store_url.storage_options)
    assert isinstance(info.value, FileNotFoundError)


def test_url_naming_a_directory(store_url):
    opts = {"storage_options": store_url.storage_options}
    cloudckpt.save({"a": 1}, f"{store_url.base_url}/dir/inner.pt", **opts)
    with pytest.raises(errors.NotAnObjectError, match="dir"):
        cloudckpt.load(f"{store_url.base_url}/dir", **opts)


def test_missing_bucket(s3_server):
    url = "s3://no-such-bucket-here/ckpt.pt"
    opts = {"storage_options": s3_server.storage_options()}
    with pytest.raises(errors.BucketNotFoundError, match="s3://no-such-bucket-here"):
        cloudckpt.load(url, **opts)
    with pytest.raises(errors.BucketNotFoundError, match="s3://no-such-bucket-here"):
        cloudckpt.save({"w": torch.zeros(2)}, url, **opts)


def test_rejected_credentials_are_typed_and_never_echoed(rclone_server, caplog):
    # rclone checks signatures (moto accepts any credentials).
    bucket = "creds-check"
    rclone_server.make_bucket(bucket)
    secret = "THIS-IS-A-SECRET-VALUE-123"
    bad = {**rclone_server.storage_options(), "aws_secret_access_key": secret}
    caplog.set_level(logging.DEBUG, logger="cloudckpt")
    with pytest.raises(errors.CredentialsError) as info:
        cloudckpt.save(
            {"w": torch.zeros(2)}, f"s3://{bucket}/x.pt", storage_options=bad, max_attempts=1
        )
    assert isinstance(info.value, PermissionError)
    assert f"s3://{bucket}/x.pt" in str(info.value)
    assert secret not in str(info.value) and secret not in caplog.text
    with pytest.raises(errors.CredentialsError) as info:
        cloudckpt.load(f"s3://{bucket}/x.pt", storage_options=bad)
    assert secret not in str(info.value)


def test_missing_credentials(monkeypatch, tmp_path, s3_server):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    opts = {"endpoint_url": s3_server.endpoint_url, "region_name": "us-east-1"}
    with pytest.raises(errors.CredentialsError, match=r"s3://somebucket/x\.pt"):
        cloudckpt.load("s3://somebucket/x.pt", storage_options=opts)


@pytest.mark.parametrize(
    "url, match",
    [
        ("gopher://host/x.pt", "unsupported URL scheme 'gopher'"),
        ("s3:///key-without-bucket", "missing bucket"),
        ("s3://bucket", "names a bucket, not an object"),
        ("s3://bucket/a/../b.pt", "refusing unsafe object key"),
        ("file://remote-host/x.pt", "must be local"),
    ],
)
def test_bad_urls(url, match):
    with pytest.raises(errors.InvalidURLError, match=match):
        cloudckpt.save({"a": 1}, url)


def test_unknown_storage_option_is_named(s3_server):
    with pytest.raises(errors.ConfigError, match="endpoint"):
        cloudckpt.load("s3://b/x.pt", storage_options={"endpoint": "http://127.0.0.1:1"})


def test_flipped_bit_in_a_tensor_fails_its_checksum(store_url):
    url = f"{store_url.base_url}/c.pt"
    opts = {"storage_options": store_url.storage_options}
    cloudckpt.save({"w": torch.randn(1000)}, url, **opts)
    store, key = _store(url, store_url.storage_options)
    data = bytearray(store.get(key))
    # Flip one bit in the middle of the tensor record's bytes.
    directory = parse_directory(bytes(data), 0, len(data), url)
    record = next(e for name, e in directory.entries.items() if name.endswith("/data/0"))
    data[record.data_offset + record.size // 2] ^= 0x01
    store.put(key, bytes(data))
    with pytest.raises(errors.ChecksumError, match=r"record 'c/data/0'|data/0"):
        cloudckpt.load(url, **opts)


def test_truncated_object_is_reported(store_url):
    url = f"{store_url.base_url}/t.pt"
    opts = {"storage_options": store_url.storage_options}
    cloudckpt.save({"w": torch.randn(100_000)}, url, **opts)
    store, key = _store(url, store_url.storage_options)
    data = store.get(key)
    store.put(key, data[: len(data) // 2])
    with pytest.raises(errors.CorruptCheckpointError):
        cloudckpt.load(url, **opts)


class NotAllowed:
    def __init__(self):
        self.x = 1


def test_weights_only_refuses_arbitrary_classes(tmp_path):
    path = tmp_path / "o.pt"
    cloudckpt.save({"obj": NotAllowed(), "w": torch.zeros(2)}, path)
    with pytest.raises(errors.UnsafeCheckpointError, match="weights_only=False"):
        cloudckpt.load(path)
    out = cloudckpt.load(path, weights_only=False)
    assert isinstance(out["obj"], NotAllowed)


def test_part_size_grows_past_ten_thousand_parts():
    from cloudckpt.io.sink import choose_part_size
    from cloudckpt.options import MAX_PARTS

    assert choose_part_size(100 * MiB, 5 * MiB) == 5 * MiB
    big = 1024 * 1024 * MiB  # 1 TiB
    grown = choose_part_size(big, 64 * MiB)
    assert grown % MiB == 0 and big * 1.05 / grown <= MAX_PARTS
