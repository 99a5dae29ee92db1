"""The ``cloudckpt`` command line against the filesystem, moto and rclone.

``Cli.run`` starts the real CLI (``python -m cloudckpt``) in a subprocess; ``Cli.call``
runs the same ``main(argv)`` in this process, which saves the ~2 s interpreter and
torch start-up per call on the edge cases. Credentials reach the CLI through the
standard AWS environment variables only.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt.cli import main
from cloudckpt.manager import CheckpointManager
from cloudckpt.options import resolve_options
from cloudckpt.store import open_url
from conftest import unique_bucket_name

SRC = str(Path(__file__).resolve().parents[2] / "src")


@dataclass
class Cli:
    """A target root URL plus the environment that reaches it (credentials via env only)."""

    name: str
    base_url: str
    env: dict[str, str]
    storage_options: dict[str, Any]
    secret: str | None = None

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cloudckpt", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def call(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``main(argv)`` in this process (the fixture put ``env`` in os.environ)."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
        return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())

    def json(self, *args: str, code: int = 0, subprocess: bool = True) -> Any:
        done = (self.run if subprocess else self.call)(*args, "--json")
        assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
        return json.loads(done.stdout)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.fixture(params=["file", "moto", "rclone"])
def cli(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Cli]:
    """The CLI aimed at a fresh temp dir or a fresh bucket on a real server."""
    env_extra = {"CLOUDCKPT_STATE_DIR": str(tmp_path / "state")}
    monkeypatch.setenv("CLOUDCKPT_STATE_DIR", env_extra["CLOUDCKPT_STATE_DIR"])
    if request.param == "file":
        root = tmp_path / "store"
        root.mkdir()
        yield Cli("file", root.as_uri(), _env(env_extra), {})
        return
    server = request.getfixturevalue(f"{request.param}_server")
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    bucket = server.make_bucket(unique_bucket_name("cli"))
    yield Cli(
        request.param,
        f"s3://{bucket}",
        _env({**env_extra, **server.env()}),
        server.storage_options(),
        server.secret_access_key,
    )
    with contextlib.suppress(Exception):
        server.remove_bucket(bucket)


def make_run(cli: Cli, run: str = "run1") -> CheckpointManager:
    m = CheckpointManager(f"{cli.base_url}/{run}", storage_options=cli.storage_options)
    for step, loss in ((100, 0.9), (200, 0.5), (300, 0.25)):
        m.save(
            step,
            {
                "model": {"w": torch.ones(4, 8) * step, "b": torch.zeros(8)},
                "opt": {"lr": 0.1},
                "step": step,
            },
            metrics={"loss": loss},
        )
    # A failed save's leftover: payload but no marker.
    store, key = open_url(
        f"{cli.base_url}/{run}/step-000000400/state.pt",
        resolve_options(storage_options=cli.storage_options),
    )
    store.put(key, b"partial")
    return m


def test_run_lifecycle(cli: Cli) -> None:
    make_run(cli)
    root = f"{cli.base_url}/run1"

    done = cli.run("ls", root)
    assert done.returncode == 0, done.stderr
    assert "3 checkpoint(s)" in done.stdout and "latest step 300" in done.stdout
    assert "loss=0.25" in done.stdout and "step-000000400" in done.stdout

    listing = cli.json("ls", root)
    assert listing["kind"] == "run"
    assert [c["step"] for c in listing["checkpoints"]] == [100, 200, 300]
    assert listing["checkpoints"][1]["metrics"] == {"loss": 0.5}
    assert listing["uncommitted"] == [f"{root}/step-000000400/"]

    latest = cli.run("latest", root)
    assert latest.returncode == 0 and latest.stdout.strip() == f"{root}/step-000000300/"

    info = cli.json("info", f"{root}/step-000000300")
    assert info["checkpoint"]["step"] == 300
    (archive,) = info["archives"]
    assert archive["top_level_keys"] == ["model", "opt", "step"]
    tensors = {t["name"]: t for t in archive["tensors"]}
    assert tensors["model.w"] == {
        "name": "model.w",
        "dtype": "float32",
        "shape": [4, 8],
        "bytes": 128,
    }
    assert tensors["model.b"]["shape"] == [8]

    verify = cli.json("verify", root)
    assert verify["ok"] is True and len(verify["checked"]) == 3

    # The rest in-process (same main(), no start-up cost).
    dry = cli.json("gc", root, "--grace", "0", "--dry-run", subprocess=False)
    assert [p["url"] for p in dry["prefixes"]] == [f"{root}/step-000000400/"]
    assert cli.json("ls", root, subprocess=False)["uncommitted"]  # dry run removed nothing
    # Younger than the default 1 h grace period: kept.
    assert cli.json("gc", root, subprocess=False)["prefixes"] == []
    cli.json("gc", root, "--grace", "0", subprocess=False)
    assert cli.json("ls", root, subprocess=False)["uncommitted"] == []

    removed = cli.json("rm", f"{root}/step-000000300", subprocess=False)
    assert len(removed["removed"]) == 2
    assert cli.call("latest", root).stdout.strip() == f"{root}/step-000000200/"


def test_verify_detects_corruption(cli: Cli) -> None:
    make_run(cli)
    url = f"{cli.base_url}/run1/step-000000200/state.pt"
    opts = resolve_options(storage_options=cli.storage_options)
    store, key = open_url(url, opts)
    data = bytearray(store.get(key))
    payload = bytes(torch.ones(4, 8).mul(200).numpy().tobytes())
    at = bytes(data).index(payload)
    data[at + 5] ^= 0xFF  # one flipped byte inside model.w, same size
    store.put(key, bytes(data))
    done = cli.call("verify", url)
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert "CRC-32" in done.stdout and "FAILED" in done.stdout
    # Through the run: the other checkpoints pass, the run fails.
    report = cli.json("verify", f"{cli.base_url}/run1", code=4, subprocess=False)
    assert [c["ok"] for c in report["checked"]] == [True, False, True]


def test_cp_upload_download_and_between_stores(cli: Cli, tmp_path: Path) -> None:
    local = tmp_path / "ckpt.pt"
    state = {"w": torch.randn(3 * 1024 * 1024 // 4 + 7)}  # ~3 MiB
    torch.save(state, local)
    remote = f"{cli.base_url}/copies/ckpt.pt"
    # S3 flags apply to the bucket side only, never to the local path.
    flags = ["--endpoint-url", cli.env["AWS_ENDPOINT_URL"]] if cli.name != "file" else []
    up = cli.run("cp", str(local), remote, "--part-size", "5MiB", *flags)
    assert up.returncode == 0, up.stderr
    assert "copied" in up.stdout
    copied = cloudckpt.load(remote, storage_options=cli.storage_options)
    assert torch.equal(copied["w"], state["w"])
    down_dir = tmp_path / "down"
    down_dir.mkdir()
    done = cli.call("cp", remote, str(down_dir), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["size"] == local.stat().st_size
    assert (down_dir / "ckpt.pt").read_bytes() == local.read_bytes()
    same_store = cli.call("cp", remote, f"{cli.base_url}/copies/again/")
    assert same_store.returncode == 0, same_store.stderr
    again = cloudckpt.load(
        f"{cli.base_url}/copies/again/ckpt.pt", storage_options=cli.storage_options
    )
    assert torch.equal(again["w"], state["w"])


def test_not_found_usage_and_help(cli: Cli) -> None:
    missing = cli.call("ls", f"{cli.base_url}/nothing-here")
    assert missing.returncode == 3 and "nothing at" in missing.stderr
    gone = cli.json("latest", f"{cli.base_url}/nothing-here", code=3, subprocess=False)
    assert gone["exit_code"] == 3
    for command in ("info", "verify", "rm"):
        assert cli.call(command, f"{cli.base_url}/nothing-here").returncode == 3
    usage = cli.call("frobnicate")
    assert usage.returncode == 2
    bad_url = cli.call("ls", "gopher://x/y")
    assert bad_url.returncode == 2 and "gopher" in bad_url.stderr


def test_help_teaches() -> None:
    cli = Cli("file", "", _plain_env(), {})
    done = cli.run("--help")
    assert done.returncode == 0
    for word in (
        "ls",
        "info",
        "cp",
        "verify",
        "rm",
        "latest",
        "gc",
        "bench",
        "exit codes",
        "examples",
    ):
        assert word in done.stdout
    sub = cli.call("gc", "--help")
    assert sub.returncode == 0 and "--dry-run" in sub.stdout and "--grace" in sub.stdout
    assert cli.call().returncode == 2


def test_rm_prefix_needs_recursive(tmp_path: Path) -> None:
    cli = Cli("file", "", _plain_env(), {})
    (tmp_path / "dir" / "sub").mkdir(parents=True)
    (tmp_path / "dir" / "sub" / "a.bin").write_bytes(b"a")
    (tmp_path / "dir" / "b.bin").write_bytes(b"b")
    refused = cli.call("rm", str(tmp_path / "dir"))
    assert refused.returncode == 2 and "--recursive" in refused.stderr
    assert (tmp_path / "dir" / "b.bin").exists()
    done = cli.call("rm", "-r", str(tmp_path / "dir"), "--json")
    assert done.returncode == 0 and len(json.loads(done.stdout)["removed"]) == 2
    assert not (tmp_path / "dir" / "b.bin").exists()


def test_bad_credentials_exit_5_and_never_print_secrets(
    moto_server: object, rclone_server: object
) -> None:
    server = rclone_server  # rclone checks credentials
    bucket = server.make_bucket("cli-creds")  # type: ignore[attr-defined]
    env = {**_plain_env(), **server.env()}  # type: ignore[attr-defined]
    env["AWS_SECRET_ACCESS_KEY"] = "definitely-wrong-secret-value"
    cli = Cli("rclone", f"s3://{bucket}", env, {})
    done = cli.run("ls", f"s3://{bucket}/x")
    assert done.returncode == 5, (done.stdout, done.stderr)
    assert "definitely-wrong-secret-value" not in done.stdout + done.stderr


def test_verbose_output_never_shows_credentials(moto_server: object, tmp_path: Path) -> None:
    """``-v`` logs botocore's signing and requests, but no session token, key or signature."""
    server = moto_server
    marker = "session-token-marker-7f3c9e"
    bucket = server.make_bucket(unique_bucket_name("cli-verbose"))  # type: ignore[attr-defined]
    server.client().put_object(Bucket=bucket, Key="run/x.bin", Body=b"abc")  # type: ignore[attr-defined]
    env = {**_plain_env(), **server.env(), "AWS_SESSION_TOKEN": marker}  # type: ignore[attr-defined]
    cli = Cli("moto", f"s3://{bucket}", env, {})
    secret = server.secret_access_key  # type: ignore[attr-defined]
    for args in (
        ("cp", "-v", f"s3://{bucket}/run/x.bin", str(tmp_path / "x.bin")),
        ("ls", "-v", "-v", f"s3://{bucket}/run"),
        ("info", "-vv", f"s3://{bucket}/nothing-here.pt"),
    ):
        done = cli.run(*args)
        out = done.stdout + done.stderr
        assert "DEBUG botocore.auth: CanonicalRequest" in done.stderr, (args, done.stderr[-2000:])
        assert "x-amz-security-token:***" in done.stderr
        assert marker not in out and secret not in out, args
        assert not re.search(r"Signature=[0-9a-f]{64}|Signature:\n[0-9a-f]{64}", out), args


def test_bench_reports_and_cleans_up(cli: Cli) -> None:
    result = cli.json(
        "bench",
        f"{cli.base_url}/scratch",
        "--size",
        "6MiB",
        "--part-size",
        "5MiB",
        "--concurrency",
        "1,2",
        "--requests",
        "3",
        subprocess=False,
    )
    assert set(result["write_GBps"]) == {"1", "2"} and set(result["read_GBps"]) == {"1", "2"}
    assert all(v > 0 for v in result["write_GBps"].values())
    assert result["latency_ms"]["put"]["p50"] > 0
    s = result["suggestion"]
    assert s["part_size"] >= 5 * 1024 * 1024 and s["write_concurrency"] in (1, 2)
    assert cli.call("ls", f"{cli.base_url}/scratch").returncode == 3  # nothing left behind


def _plain_env() -> dict[str, str]:
    return _env({})
