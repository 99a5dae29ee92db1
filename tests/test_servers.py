"""Smoke tests for the local S3 servers and fixtures (tests/servers.py, conftest.py).

They also pin down where the servers differ from AWS S3, so that a change in
moto or rclone behaviour shows up here first rather than as a confusing
failure in a library test. Observed with moto 5.2.5 and rclone v1.75.2.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import botocore.exceptions
import psutil
import pytest

from cloudckpt.cli.main import main as cli_main
from cloudckpt.errors import AlreadyExistsError
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url
from conftest import StoreTarget
from servers import S3Server, listening_addresses, start_server, unique_bucket_name

MiB = 1024 * 1024


def _status(response: dict) -> int:
    return int(response["ResponseMetadata"]["HTTPStatusCode"])


def _error_code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response["Error"]["Code"])


# ------------------------------------------------------------------- fixtures


def test_server_connection_details(s3_server: S3Server) -> None:
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")
    assert s3_server.storage_options() == {
        "endpoint_url": s3_server.endpoint_url,
        "aws_access_key_id": s3_server.access_key_id,
        "aws_secret_access_key": s3_server.secret_access_key,
        "region_name": "us-east-1",
    }
    assert s3_server.env() == {
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": s3_server.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_access_key,
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    # Bound to loopback only.
    port = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    assert s3_server.process is not None
    assert listening_addresses(s3_server.process.pid) == [("127.0.0.1", port)]


def test_environment_is_isolated() -> None:
    assert "AWS_PROFILE" not in os.environ
    assert "AWS_ACCESS_KEY_ID" not in os.environ
    assert "AWS_ENDPOINT_URL" not in os.environ
    assert os.environ["AWS_EC2_METADATA_DISABLED"] == "true"
    assert not Path(os.environ["AWS_CONFIG_FILE"]).exists()


def test_store_url_is_fresh_and_empty(store_url: StoreTarget) -> None:
    if store_url.name == "file":
        assert store_url.base_url.startswith("file:///")
        assert store_url.storage_options == {}
        root = Path(store_url.base_url.removeprefix("file://"))
        assert root.is_dir()
        assert list(root.iterdir()) == []
        return
    assert store_url.server is not None
    bucket = store_url.bucket
    assert bucket is not None
    scheme = {"moto": "s3", "rclone": "s3", "gcs": "gs", "azure": "az"}[store_url.name]
    assert store_url.base_url == f"{scheme}://{bucket}"
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]", bucket)
    assert store_url.storage_options == store_url.server.storage_options()
    store, _ = open_url(
        f"{store_url.base_url}/x", resolve_options(storage_options=store_url.storage_options)
    )
    assert list(store.list("")) == []


# ---------------------------------------------------------------- S3 behaviour


def test_put_get(s3_server: S3Server) -> None:
    client = s3_server.client()
    bucket = s3_server.make_bucket("put-get")
    client.put_object(Bucket=bucket, Key="dir/obj.bin", Body=b"hello world")
    assert client.get_object(Bucket=bucket, Key="dir/obj.bin")["Body"].read() == b"hello world"
    head = client.head_object(Bucket=bucket, Key="dir/obj.bin")
    assert head["ContentLength"] == 11
    with pytest.raises(client.exceptions.NoSuchKey):
        client.get_object(Bucket=bucket, Key="dir/missing")
    with pytest.raises(botocore.exceptions.ClientError) as info:
        client.head_object(Bucket=bucket, Key="dir/missing")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404

    listing = client.list_objects_v2(Bucket=bucket, Prefix="dir/")
    assert [obj["Key"] for obj in listing["Contents"]] == ["dir/obj.bin"]
    assert listing["KeyCount"] == 1
    # rclone quirk: an empty ListObjectsV2 result has no KeyCount element at all
    # (moto and AWS send <KeyCount>0</KeyCount>), so use .get("Contents", []).
    empty = client.list_objects_v2(Bucket=bucket, Prefix="nothing-here/")
    assert "Contents" not in empty
    assert empty.get("KeyCount") == (0 if s3_server.name == "moto" else None)


# Status code of a satisfiable ranged GET. AWS and moto answer 206 Partial
# Content; rclone serve s3 answers 200 OK, but with the right Content-Range
# header and only the requested bytes. Clients must not insist on 206.
RANGED_GET_STATUS = {"moto": 206, "rclone": 200}


def test_ranged_get(s3_server: S3Server) -> None:
    client = s3_server.client()
    bucket = s3_server.make_bucket("ranged-get")
    client.put_object(Bucket=bucket, Key="obj", Body=b"0123456789")

    response = client.get_object(Bucket=bucket, Key="obj", Range="bytes=2-4")
    assert _status(response) == RANGED_GET_STATUS[s3_server.name]
    assert response["ContentRange"] == "bytes 2-4/10"
    assert response["Body"].read() == b"234"

    # Suffix ranges and ranges past the end are clamped, as on AWS.
    response = client.get_object(Bucket=bucket, Key="obj", Range="bytes=-3")
    assert (response["ContentRange"], response["Body"].read()) == ("bytes 7-9/10", b"789")
    response = client.get_object(Bucket=bucket, Key="obj", Range="bytes=8-100")
    assert (response["ContentRange"], response["Body"].read()) == ("bytes 8-9/10", b"89")

    # Both answer 416 InvalidRange when the range starts past the end.
    with pytest.raises(botocore.exceptions.ClientError) as info:
        client.get_object(Bucket=bucket, Key="obj", Range="bytes=20-30")
    assert _error_code(info.value) == "InvalidRange"


def test_ranged_get_with_default_checksum_validation(s3_server: S3Server) -> None:
    """rclone quirk: the whole-object CRC32 is sent with ranged GETs too.

    With botocore's default ``response_checksum_validation="when_supported"``,
    botocore checks the partial body against ``x-amz-checksum-crc32`` and raises
    FlexibleChecksumError on rclone. moto (like AWS) sends no checksum header
    for ranged GETs. A client doing ranged reads must use "when_required" (or
    not send ``x-amz-checksum-mode: ENABLED``), which is why
    ``S3Server.client()`` does.
    """
    client = s3_server.client(response_checksum_validation="when_supported")
    bucket = s3_server.make_bucket("ranged-checksum")
    client.put_object(Bucket=bucket, Key="obj", Body=b"0123456789")
    response = client.get_object(Bucket=bucket, Key="obj", Range="bytes=2-4")
    if s3_server.name == "rclone":
        assert "x-amz-checksum-crc32" in response["ResponseMetadata"]["HTTPHeaders"]
        with pytest.raises(botocore.exceptions.FlexibleChecksumError):
            response["Body"].read()
    else:
        assert response["Body"].read() == b"234"


def test_multipart_upload(s3_server: S3Server) -> None:
    client = s3_server.client()
    bucket = s3_server.make_bucket("multipart")
    data = os.urandom(2 * 5 * MiB + 123)  # two full 5 MiB parts and a short last one
    upload_id = client.create_multipart_upload(Bucket=bucket, Key="big")["UploadId"]
    parts = []
    for number, offset in enumerate(range(0, len(data), 5 * MiB), start=1):
        part = client.upload_part(
            Bucket=bucket,
            Key="big",
            UploadId=upload_id,
            PartNumber=number,
            Body=data[offset : offset + 5 * MiB],
        )
        parts.append({"ETag": part["ETag"], "PartNumber": number})
    done = client.complete_multipart_upload(
        Bucket=bucket, Key="big", UploadId=upload_id, MultipartUpload={"Parts": parts}
    )
    assert len(parts) == 3
    assert done["ETag"].strip('"').endswith("-3")  # both servers: multipart-style ETag

    assert client.get_object(Bucket=bucket, Key="big")["Body"].read() == data
    head = client.head_object(Bucket=bucket, Key="big")
    assert head["ContentLength"] == len(data)
    # moto keeps the multipart ETag ("<md5 of part md5s>-3"), as AWS does.
    # rclone stores a plain file, so HEAD/GET then report the MD5 of the whole
    # object: the ETag from CompleteMultipartUpload differs from the later one.
    if s3_server.name == "rclone":
        assert head["ETag"].strip('"') == hashlib.md5(data).hexdigest()
    else:
        assert head["ETag"] == done["ETag"]
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_list_multipart_uploads_on_fresh_bucket(s3_server: S3Server) -> None:
    """rclone quirk: ListMultipartUploads fails until the bucket has had an upload.

    On a bucket that has not seen a multipart upload since the server started,
    rclone answers 404 NoSuchUpload (with or without Prefix); moto and AWS
    return an empty list. Once one upload was created (even if aborted since),
    rclone returns an empty list too, but also omits IsTruncated.
    """
    client = s3_server.client()
    bucket = s3_server.make_bucket("fresh-mpu-list")
    if s3_server.name == "rclone":
        with pytest.raises(botocore.exceptions.ClientError) as info:
            client.list_multipart_uploads(Bucket=bucket, Prefix="run/")
        assert _error_code(info.value) == "NoSuchUpload"
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    else:
        assert "Uploads" not in client.list_multipart_uploads(Bucket=bucket, Prefix="run/")

    upload_id = client.create_multipart_upload(Bucket=bucket, Key="run/k")["UploadId"]
    listing = client.list_multipart_uploads(Bucket=bucket, Prefix="run/")
    assert [u["UploadId"] for u in listing["Uploads"]] == [upload_id]
    client.abort_multipart_upload(Bucket=bucket, Key="run/k", UploadId=upload_id)
    assert "Uploads" not in client.list_multipart_uploads(Bucket=bucket, Prefix="run/")


# Whether the server enforces conditional writes with ``If-None-Match: *``.
# moto does: 412 PreconditionFailed and the existing object is left alone, as
# on AWS. rclone v1.75.2 ignores the header and silently overwrites (it also
# ignores If-Match on PUT). So rclone cannot be used to test create-only
# semantics; code relying on them needs another guard there.
ENFORCES_IF_NONE_MATCH = {"moto": True, "rclone": False}


def test_put_if_none_match(s3_server: S3Server) -> None:
    client = s3_server.client()
    bucket = s3_server.make_bucket("if-none-match")

    # Creating a new key is always allowed.
    assert _status(client.put_object(Bucket=bucket, Key="k", Body=b"v1", IfNoneMatch="*")) == 200

    if ENFORCES_IF_NONE_MATCH[s3_server.name]:
        with pytest.raises(botocore.exceptions.ClientError) as info:
            client.put_object(Bucket=bucket, Key="k", Body=b"v2", IfNoneMatch="*")
        assert _error_code(info.value) == "PreconditionFailed"
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v1"
    else:
        client.put_object(Bucket=bucket, Key="k", Body=b"v2", IfNoneMatch="*")
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v2"


def test_complete_multipart_if_none_match(s3_server: S3Server) -> None:
    """Same observation for CompleteMultipartUpload: moto enforces, rclone ignores."""
    client = s3_server.client()
    bucket = s3_server.make_bucket("mpu-if-none-match")
    client.put_object(Bucket=bucket, Key="k", Body=b"existing")

    upload_id = client.create_multipart_upload(Bucket=bucket, Key="k")["UploadId"]
    etag = client.upload_part(
        Bucket=bucket, Key="k", UploadId=upload_id, PartNumber=1, Body=b"new"
    )["ETag"]

    def complete() -> None:
        client.complete_multipart_upload(
            Bucket=bucket,
            Key="k",
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"ETag": etag, "PartNumber": 1}]},
            IfNoneMatch="*",
        )

    if ENFORCES_IF_NONE_MATCH[s3_server.name]:
        with pytest.raises(botocore.exceptions.ClientError) as info:
            complete()
        assert _error_code(info.value) == "PreconditionFailed"
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"existing"
        client.abort_multipart_upload(Bucket=bucket, Key="k", UploadId=upload_id)
    else:
        complete()
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"new"


# ----------------------------------------------------------------- lifecycle


@pytest.mark.parametrize("name", ["moto", "rclone"])
def test_start_stop_leaves_no_process(name: str) -> None:
    with start_server(name) as server:  # type: ignore[arg-type]
        assert server.process is not None
        pid = server.process.pid
        assert server.log_path is not None and server.log_path.exists()
        workdir = server.workdir
    assert server.process.returncode is not None  # reaped: no zombie
    assert not psutil.pid_exists(pid)
    assert workdir is not None and not workdir.exists()


def test_main_prints_env_and_stops_on_sigterm() -> None:
    """``python tests/servers.py rclone`` prints exports and shuts down cleanly."""
    script = Path(__file__).with_name("servers.py")
    proc = subprocess.Popen(
        [sys.executable, str(script), "rclone"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        env: dict[str, str] = {}
        while len(env) < 5:
            line = proc.stdout.readline()
            assert line, f"servers.py exited early with {proc.wait()}"
            key, _, value = line.strip().removeprefix("export ").partition("=")
            env[key] = value
        server = S3Server(
            "rclone", env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"],
            env["AWS_SECRET_ACCESS_KEY"], env["AWS_REGION"],
        )  # fmt: skip
        assert server.client().list_buckets()["Buckets"] == []
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not any(child.is_running() for child in children)


# ------------------------------------------------------------------- buckets


def test_make_bucket_needs_no_boto3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Buckets are made by cloudckpt's own S3 store; boto3 is not a dependency."""
    name = unique_bucket_name()
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "boto3", None)  # `import boto3` now fails
        assert s3_server.make_bucket(name) == name
        with pytest.raises(AlreadyExistsError, match=f"bucket s3://{name} already exists"):
            s3_server.make_bucket(name)
    assert name in [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]
    s3_server.remove_bucket(name)


def _cloudckpt(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_cloudckpt_mb(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    name = unique_bucket_name()
    assert _cloudckpt("mb", f"s3://{name}") == (0, f"created bucket s3://{name}\n", "")
    code, _, err = _cloudckpt("mb", f"s3://{name}")
    assert (code, err) == (1, f"cloudckpt mb: bucket s3://{name} already exists\n")
    assert _cloudckpt("ls", f"s3://{name}/run1")[0] == 3  # there, and empty
    s3_server.remove_bucket(name)
    code, _, err = _cloudckpt("mb", "s3://Not_A_New_Name")
    assert code == 2 and "invalid S3 bucket name 'Not_A_New_Name'" in err
    code, _, err = _cloudckpt("mb", f"s3://{name}/run1")
    assert code == 2 and "mb takes a bucket URL" in err
    code, _, err = _cloudckpt("mb", str(tmp_path))
    assert code == 2 and "has no buckets to create" in err


def _readme_block(marker: str) -> str:
    """The fenced block right after ``<!-- marker ... -->`` in README.md."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    after = text[text.index(f"<!-- {marker}") :]
    body = after.split("```bash\n", 1)[1]
    return body.split("```", 1)[0]


def test_the_readme_local_s3_snippet_runs_as_printed(tmp_path: Path) -> None:
    """`python -m cloudckpt.testing rclone --bucket NAME` makes the bucket before it
    prints the exports, so the README's block works line by line."""
    script = _readme_block("local-s3")
    assert "--bucket my-bucket" in script
    venv_bin = str(Path(sys.executable).parent)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {
        **os.environ,
        "PATH": venv_bin + os.pathsep + os.environ["PATH"],
        "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    done = subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "w.pt" in done.stdout, done.stdout
    assert "ok" in done.stdout.lower(), done.stdout  # the verify line
    assert "BucketNotFound" not in done.stderr and "does not exist" not in done.stderr
