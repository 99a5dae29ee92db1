"""Configuration profiles: selected by URL, merged under the call's own arguments."""

from __future__ import annotations

import pytest
import torch

import cloudckpt
from cloudckpt import errors
from cloudckpt.options import MiB, resolve_options
from cloudckpt.profiles import find_profile


@pytest.fixture
def config(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    monkeypatch.setenv("CLOUDCKPT_CONFIG", str(path))

    def write(text: str):
        path.write_text(text)
        return path

    return write


def _profile_toml(server, bucket: str) -> str:
    opts = server.storage_options()
    return f"""
[profiles.lab]
url = "s3://{bucket}"
match = ["s3://{bucket}/"]
part_size = "8MiB"
write_concurrency = 3
requests_per_second = 500

[profiles.lab.storage_options]
endpoint_url = "{opts["endpoint_url"]}"
aws_access_key_id = "{opts["aws_access_key_id"]}"
aws_secret_access_key = "{opts["aws_secret_access_key"]}"
region_name = "us-east-1"
"""


def test_profile_url_reaches_the_store_with_the_profiles_credentials(config, moto_server):
    bucket = moto_server.make_bucket("profile-url")
    config(_profile_toml(moto_server, bucket))
    state = {"w": torch.arange(1000)}
    cloudckpt.save(state, "profile://lab/run1/a.pt")  # no storage_options anywhere
    assert torch.equal(cloudckpt.load("profile://lab/run1/a.pt")["w"], state["w"])
    keys = [o["Key"] for o in moto_server.client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys == ["run1/a.pt"]
    # A URL under the profile's match prefix picks it up too.
    assert torch.equal(cloudckpt.load(f"s3://{bucket}/run1/a.pt")["w"], state["w"])


def test_precedence_call_over_profile_over_configure(config, moto_server):
    bucket = moto_server.make_bucket("profile-precedence")
    config(_profile_toml(moto_server, bucket))
    url = f"s3://{bucket}/x.pt"
    opts = resolve_options(url=url)
    assert (opts.part_size, opts.write_concurrency, opts.requests_per_second) == (8 * MiB, 3, 500)
    assert opts.storage_options["endpoint_url"] == moto_server.endpoint_url
    opts = resolve_options(url=url, part_size=16 * MiB, storage_options={"region_name": "x"})
    assert opts.part_size == 16 * MiB and opts.write_concurrency == 3
    assert opts.storage_options["region_name"] == "x"
    before = cloudckpt.get_defaults()
    try:
        cloudckpt.configure(write_concurrency=7, part_size=32 * MiB)
        assert resolve_options(url=url).write_concurrency == 3  # the profile wins
        assert resolve_options(url="s3://elsewhere/x").write_concurrency == 7
    finally:
        cloudckpt.configure(write_concurrency=before.write_concurrency, part_size=before.part_size)


@pytest.mark.parametrize(
    "text, match",
    [
        ("[profiles.a]\nendpoint = 'http://x'\n", "unknown key.*endpoint"),
        ("[profiles.a]\npart_size = 'lots'\n", "not a size"),
        ("[profiles.a]\nmatch = ['bucket/prefix']\n", "not a store URL"),
        ("[profile.a]\n", "unknown top-level key"),
        ("[profiles.a\n", "cannot read the profiles file"),
    ],
)
def test_bad_profiles_are_errors_not_ignored(config, text, match):
    config(text)
    with pytest.raises(errors.ConfigError, match=match):
        find_profile("s3://b/k")


def test_unknown_profile_name_is_an_error(config):
    config("[profiles.lab]\nurl = 's3://b'\n")
    with pytest.raises(errors.InvalidURLError, match=r"no profile named 'labs'.*lab"):
        cloudckpt.save({"a": 1}, "profile://labs/x.pt")


def test_missing_config_named_by_env_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CLOUDCKPT_CONFIG", str(tmp_path / "nope.toml"))
    with pytest.raises(errors.ConfigError, match="does not exist"):
        find_profile("s3://b/k")


def test_cp_and_lightning_keep_the_profiles_transfer_settings(config, moto_server, tmp_path):
    """The CLI and Lightning resolve their settings per URL: the profile's part size
    reaches a copy's multipart upload, and its endpoint and credentials the IO."""
    import math

    from cloudckpt.cli import main as cli_main
    from cloudckpt.io.sink import choose_part_size
    from cloudckpt.lightning import CloudCheckpointIO

    bucket = moto_server.make_bucket("profile-cp")
    config(_profile_toml(moto_server, bucket))  # part_size 8 MiB, write_concurrency 3
    src = tmp_path / "big.bin"
    src.write_bytes(bytes(range(256)) * (20 * MiB // 256))
    assert cli_main(["cp", str(src), f"s3://{bucket}/copied.bin", "--no-progress"]) == 0
    etag = moto_server.client().head_object(Bucket=bucket, Key="copied.bin")["ETag"]
    part = choose_part_size(20 * MiB, 8 * MiB, 3)
    assert etag.strip('"').endswith(f"-{math.ceil(20 * MiB / part)}"), etag

    io = CloudCheckpointIO()  # no storage options: the profile gives them
    io.save_checkpoint({"w": torch.arange(5)}, f"s3://{bucket}/io.ckpt")
    assert torch.equal(io.load_checkpoint(f"s3://{bucket}/io.ckpt")["w"], torch.arange(5))
